//! Tensor parallelism on the CPU's simulated ranks: the sharded forward equals the
//! unsharded one bit for bit (prefill, decode steps and a later chunk), for the real
//! SmolLM2 (KV heads split unevenly) and Gemma 3 270M (one KV head replicated, sliding
//! layers, post-norms), and synthetic shapes (q/k/v biases, q/k norms, dense and
//! quantized weights); shapes that cannot split are refused by name.

use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::sharded::{InOrder, Sharded};
use ferrolm::config::ModelConfig;
use ferrolm::formats::{synthetic, ModelSource};
use ferrolm::model::{Decoder, Logits};
use ferrolm::quant::scheme::QuantScheme;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The model of `source()` whole and over `n` ranks give the same bits for a prompt's
/// logits, three decode steps after it, and a chunk of five more tokens.
fn sharded_equals_whole(source: impl Fn() -> ModelSource, n: usize, what: &str) {
    sharded_equals_whole_with(source, n, what, None);
}

/// `sharded_equals_whole` with both models' caches in a quantized `scheme` and their first
/// `kv_start` positions in bf16.
fn sharded_equals_whole_with(source: impl Fn() -> ModelSource, n: usize, what: &str, kv: Option<(&str, usize)>) {
    let mut whole = Decoder::load(Cpu, &mut source()).unwrap();
    let mut tp = sharded(&mut source(), n).unwrap();
    if let Some((scheme, kv_start)) = kv {
        let s = ferrolm::kv::scheme::KvScheme::parse(scheme).unwrap();
        whole.set_kv_scheme(s.clone()).unwrap();
        tp.set_kv_scheme(s).unwrap();
        whole.set_kv_start(kv_start).unwrap();
        tp.set_kv_start(kv_start).unwrap();
    }
    assert_eq!(tp.backend.ranks.len(), n);
    let vocab = whole.logits_width() as u32;
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut cache = whole.new_cache(64).unwrap();
    let mut caches = tp.new_cache(64).unwrap();
    let want = whole.forward(&prompt, 0, &mut cache, Logits::All).unwrap();
    let got = tp.forward(&prompt, 0, &mut caches, Logits::All).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: prompt logits");
    assert!(bits(&got) == bits(&want), "{what} over {n} ranks: the prompt's logits differ");
    let mut pos = prompt.len();
    for step in 0..3 {
        let t = ferrolm::sample::argmax(&want[want.len() - whole.logits_width()..]) as u32;
        let t = (t + step) % vocab;
        let want = whole.forward(&[t], pos, &mut cache, Logits::Last).unwrap();
        let got = tp.forward(&[t], pos, &mut caches, Logits::Last).unwrap();
        assert!(bits(&got) == bits(&want), "{what} over {n} ranks: decode step {step} differs");
        pos += 1;
    }
    let chunk = [5, 6, 7, 8, 9];
    let want = whole.forward(&chunk, pos, &mut cache, Logits::All).unwrap();
    let got = tp.forward(&chunk, pos, &mut caches, Logits::All).unwrap();
    assert!(bits(&got) == bits(&want), "{what} over {n} ranks: the later chunk differs");
}

/// The model of `src` over `n` simulated CPU ranks.
fn sharded(src: &mut ModelSource, n: usize) -> ferrolm::Result<Decoder<Sharded<Cpu, InOrder>>> {
    let backend = Sharded::new((0..n).map(|_| Cpu).collect(), &src.config, InOrder)?;
    Decoder::load(backend, src)
}

fn gguf(name: &str) -> impl Fn() -> ModelSource {
    let path = ferrolm::env::test_models_dir().join(name);
    move || ferrolm::formats::load(&path, false).unwrap()
}

#[test]
fn smollm2_over_two_and_three_ranks_is_the_whole_model() {
    // 3 KV heads: 2 and 1 on two ranks, one each on three.
    for n in [2, 3] {
        sharded_equals_whole(gguf("SmolLM2-135M-Instruct.Q4_1.gguf"), n, "SmolLM2");
    }
}

/// Quantized caches (each rank quantizes its own heads' rows as the whole model does),
/// with leading positions in bf16.
#[test]
fn quantized_caches_split_exactly() {
    for kv in [("turbo:k8v3", 32), ("affine:4", 0)] {
        sharded_equals_whole_with(gguf("SmolLM2-135M-Instruct.Q4_1.gguf"), 3, &format!("SmolLM2 {kv:?}"), Some(kv));
    }
}

#[test]
fn gemma3_over_two_ranks_is_the_whole_model() {
    sharded_equals_whole(gguf("gemma-3-270m-q4_k_m.gguf"), 2, "Gemma 3 270M");
}

/// A small Llama-family shape: 8 query heads over 2 KV heads, FFN 1024, 2 layers.
fn small(qkv_bias: bool, qk_norm: bool) -> ModelConfig {
    let base = synthetic::config("llama-3.2-1b").unwrap();
    ModelConfig {
        hidden: 512,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        ffn: 1024,
        vocab: 1000,
        n_layers: 2,
        qkv_bias,
        qk_norm,
        tie_embeddings: !qkv_bias,
        ..base
    }
}

#[test]
fn synthetic_shapes_split_exactly_in_every_weight_form() {
    for (scheme, bias, norm) in
        [("4", true, false), ("bf16", false, true), ("mixed:3,6:g32", false, false), ("5:g16", true, true)]
    {
        let cfg = small(bias, norm);
        let q = QuantScheme::parse(scheme).unwrap();
        let source = || synthetic::build_config("tp-small", &cfg, &q, 7, false).unwrap();
        // Two ranks split the KV heads; four share each KV head between two.
        for n in [2, 4] {
            sharded_equals_whole(source, n, &format!("{scheme} (bias {bias}, q/k norm {norm})"));
        }
    }
}

#[test]
fn shapes_that_cannot_split_are_refused_by_name() {
    let cfg = small(false, false);
    let q = QuantScheme::parse("4").unwrap();
    let mut src = synthetic::build_config("tp-small", &cfg, &q, 7, false).unwrap();
    let e = sharded(&mut src, 8).err().unwrap().to_string();
    assert!(e.contains("FFN width 1024"), "{e}");
    let mut src = synthetic::build_config("tp-small", &cfg, &q, 7, false).unwrap();
    let e = sharded(&mut src, 3).err().unwrap().to_string();
    assert!(e.contains("2 KV heads"), "{e}");
    // Eight ranks of one 64-wide head each: a 128-value group of the output projection
    // would be cut.
    let cfg = ModelConfig { ffn: 2048, ..cfg };
    let q = QuantScheme::parse("4:g128").unwrap();
    let mut src = synthetic::build_config("tp-small", &cfg, &q, 7, false).unwrap();
    let e = sharded(&mut src, 8).err().unwrap().to_string();
    assert!(e.contains("o_proj") && e.contains("column 64"), "{e}");
}

/// Generation through a session (greedy, and sampled with top-k, which the sharded
/// backend merges from each rank's candidates): the same tokens as the whole model.
#[test]
fn sessions_generate_the_whole_models_tokens() {
    use ferrolm::generate::Session;
    use ferrolm::sample::{Sampler, SamplerConfig};
    let source = gguf("SmolLM2-135M-Instruct.Q4_1.gguf");
    let whole = Decoder::load(Cpu, &mut source()).unwrap();
    let tp = sharded(&mut source(), 2).unwrap();
    let prompt: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314];
    let sampled = SamplerConfig { temperature: 0.8, top_k: 40, seed: 11, ..Default::default() };
    for cfg in [SamplerConfig::default(), sampled] {
        let mut runs = vec![];
        for run in 0..2 {
            let mut out = vec![];
            let mut sampler = Sampler::new(cfg.clone());
            let mut go = |t: u32| {
                out.push(t);
                Ok(true)
            };
            match run {
                0 => Session::new(&whole, 64).unwrap().generate(&prompt, 12, &mut sampler, &[], &mut go),
                _ => Session::new(&tp, 64).unwrap().generate(&prompt, 12, &mut sampler, &[], &mut go),
            }
            .unwrap();
            runs.push(out);
        }
        assert_eq!(runs[0].len(), 12);
        assert_eq!(runs[0], runs[1], "top-k {}", cfg.top_k);
    }
}

/// Greedy tokens after `prompt` from session `s`.
fn greedy<B: ferrolm::backend::Backend>(
    s: &mut ferrolm::generate::Session<'_, B>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let mut out = vec![];
    let mut sampler = ferrolm::sample::Sampler::new(Default::default());
    s.generate(prompt, n, &mut sampler, &[], |t| {
        out.push(t);
        Ok(true)
    })
    .unwrap();
    out
}

/// A cache saved by `saver` after 5 tokens and restored by `loader` continues to the
/// tokens `saver` generates uninterrupted.
fn save_here_continue_there<A, B>(saver: &Decoder<A>, loader: &Decoder<B>, what: &str)
where
    A: ferrolm::backend::Backend,
    B: ferrolm::backend::Backend,
{
    use ferrolm::generate::Session;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kv");
    let prompt: Vec<u32> = (0..41u32).map(|i| (i * 7919 + 13) % 49152).collect();
    let whole = greedy(&mut Session::new(saver, 96).unwrap(), &prompt, 12);
    let mut s = Session::new(saver, 96).unwrap();
    let head = greedy(&mut s, &prompt, 5);
    s.save_cache(&path, "fp").unwrap();
    drop(s);
    let mut s = Session::new(loader, 96).unwrap();
    assert!(s.restore_cache(&path, "fp").unwrap().is_some(), "{what}: nothing restored");
    let more: Vec<u32> = prompt.iter().chain(&head).copied().collect();
    let tail = greedy(&mut s, &more, 7);
    assert_eq!([head, tail].concat(), whole, "{what}");
}

/// KV files hold the unsplit cache's rows: a file saved over 3 ranks continues in the
/// whole model and one saved by the whole model over 3 ranks (bf16, and TurboQuant with
/// bf16 leading positions); Gemma 3's replicated KV head is written once.
#[test]
fn kv_files_move_between_split_and_whole_models() {
    let source = gguf("SmolLM2-135M-Instruct.Q4_1.gguf");
    for (scheme, kv_start) in [("bf16", 0), ("turbo:k8v3", 32)] {
        let mut whole = Decoder::load(Cpu, &mut source()).unwrap();
        let mut tp = sharded(&mut source(), 3).unwrap();
        let s = ferrolm::kv::scheme::KvScheme::parse(scheme).unwrap();
        whole.set_kv_scheme(s.clone()).unwrap();
        tp.set_kv_scheme(s).unwrap();
        whole.set_kv_start(kv_start).unwrap();
        tp.set_kv_start(kv_start).unwrap();
        save_here_continue_there(&tp, &whole, &format!("{scheme}: 3 ranks to whole"));
        save_here_continue_there(&whole, &tp, &format!("{scheme}: whole to 3 ranks"));
    }
    let source = gguf("gemma-3-270m-q4_k_m.gguf");
    let (whole, tp) = (Decoder::load(Cpu, &mut source()).unwrap(), sharded(&mut source(), 2).unwrap());
    save_here_continue_there(&tp, &whole, "Gemma 3: 2 ranks to whole");
}
