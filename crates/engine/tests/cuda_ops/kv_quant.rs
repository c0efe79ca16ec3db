//! Quantized KV caches on CUDA (kv_quant.cu) against the CPU's (kv::rows): the rows the
//! same bytes (the encoding bit-exact from the same bf16 inputs), attention over them within
//! 1e-2 relative of the CPU's (whose attention over the rows equals attention over their
//! dequantized copy within f32 rounding: kv::rows' tests; CUDA's tensor-core kernels take q
//! and the probabilities in bf16), prefill and decode, causal and sliding, caches that are
//! and are not whole blocks; and real models whose quantized caches cost on CUDA what they
//! cost on the CPU.

use super::models::{golden_texts, kl_and_agreement, teacher_forced};
use super::{attention_both, attn_cfg, bf, check, gpu, rope_attention_both, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::backend::{Attend, Backend, Rope};
use ferrolm::config::RopeStyle;
use ferrolm::kv::scheme::KvScheme;
use ferrolm::kv::{blocks_for, InOrder};
use ferrolm::model::{Decoder, Logits};

/// Every row format's kernels: affine 8/4, TurboQuant int8 and packed keys, 2-8-bit values.
const SCHEMES: [&str; 7] =
    ["affine:8", "affine:4", "turbo:k8v3", "turbo:k8v8", "turbo:k5v5", "turbo:k4v2", "turbo:k2v4"];

/// Attention steps of 45, 1, 1, 16, 1, 64 and 1 rows (no RoPE) over new stores of `blocks`
/// in `scheme` on both backends, each within 1e-2 of the CPU's (a decode row ending a block
/// at 64 positions, a prefill ending one at 128, decode rows short of and past a block's
/// end); then the rows CUDA wrote must be the CPU's bytes.
fn steps_match_the_cpu(
    r: &mut Rng,
    (cfg, shape): (&ferrolm::config::ModelConfig, (usize, usize, usize)),
    scheme: &str,
    blocks: ferrolm::kv::KvBlocks,
) {
    let (g, c) = (gpu(), Cpu);
    let (heads, n_kv, hd) = shape;
    let kv = KvScheme::parse(scheme).unwrap();
    let mut kvg = g.kv_store_scheme(cfg, blocks, &kv).unwrap();
    let mut kvc = c.kv_store_scheme(cfg, blocks, &kv).unwrap();
    let mut pos = 0;
    for m in [45, 1, 1, 16, 1, 64, 1] {
        let (og, want, _) = attention_both(r, &mut kvg, &mut kvc, shape, m, pos, Attend::causal(hd));
        let what = format!("{scheme} {blocks:?} {heads}/{n_kv}x{hd} m{m} pos{pos}");
        check(&what, &g.read_rows(&og, 0).unwrap(), &want, 1e-2);
        pos += m;
    }
    let rows: Vec<usize> = (0..pos).map(|p| ferrolm::kv::row_of(InOrder::new(blocks).span(0, 1).full, p)).collect();
    let (mut a, mut b) = (vec![], vec![]);
    g.kv_export(&kvg, 0, &rows, &mut a).unwrap();
    c.kv_export(&kvc, 0, &rows, &mut b).unwrap();
    assert_eq!(a.len(), b.len());
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    assert!(first.is_none(), "{scheme} {heads}/{n_kv}x{hd}: CUDA's rows differ from the CPU's at byte {first:?}");
}

#[test]
fn quantized_rows_and_attention_match_the_cpu() {
    let mut r = Rng::seeded();
    for (heads, n_kv, hd) in [(4, 2, 64), (16, 2, 128), (4, 1, 256)] {
        for s in SCHEMES {
            let cfg = attn_cfg(heads, n_kv, hd, 1, RopeStyle::Half);
            steps_match_the_cpu(&mut r, (&cfg, (heads, n_kv, hd)), s, blocks_for(&cfg, 200));
        }
    }
}

/// `--kv-start`: a store whose first two blocks of each sequence are bf16 head blocks. The
/// rows CUDA writes (the head blocks' keys and rotated values, and the quantized rest) are
/// the CPU's bytes, attention over both matches the CPU's, and RoPE'd prefill (flash over
/// dequantized tiles and head rows) and decode steps across the boundary do too.
#[test]
fn leading_bf16_blocks_match_the_cpu() {
    let (g, c) = (gpu(), Cpu);
    let mut r = Rng::seeded();
    for (heads, n_kv, hd) in [(4, 2, 64), (16, 2, 128), (4, 1, 256)] {
        for s in ["affine:4", "turbo:k8v3", "turbo:k4v2"] {
            let scheme = KvScheme::parse(s).unwrap();
            let cfg = attn_cfg(heads, n_kv, hd, 2, RopeStyle::Half);
            let mut blocks = blocks_for(&cfg, 300);
            (blocks.full, blocks.head) = (blocks.full - 2, 2);
            steps_match_the_cpu(&mut r, (&cfg, (heads, n_kv, hd)), s, blocks);
            let rope = Rope { inv_freq: cfg.rope_inv_freq(), style: RopeStyle::Half, linear: 1.0 };
            let mut kvg = g.kv_store_scheme(&cfg, blocks, &scheme).unwrap();
            let mut kvc = c.kv_store_scheme(&cfg, blocks, &scheme).unwrap();
            let mut pos = 0;
            for m in [40, 1, 100, 1, 1] {
                let (got, want) = rope_attention_both(
                    g,
                    &mut r,
                    (&mut kvg, &mut kvc),
                    (heads, n_kv, hd),
                    &rope,
                    (m, pos),
                    Attend::causal(hd),
                );
                let tol = if s.ends_with("v2") { 4e-2 } else { 2e-2 };
                check(&format!("{s} head rope_attention {heads}/{n_kv}x{hd} m{m} pos{pos}"), &got, &want, tol);
                pos += m;
            }
        }
    }
}

/// RoPE with the cache write and attention (`rope_attention`: kv_encode with q rotated in
/// place for prefill, into the output for a decode row) against the CPU, windows included
/// (prefill rows m > 1 and single decode rows).
/// The CPU rotates k in f32 and CUDA in bf16, so a value at a code boundary may land one
/// code apart: the bar is the bf16 path's, widened for 2-bit values.
#[test]
fn quantized_rope_attention_matches_cpu() {
    rope_attention_cases(gpu());
}

/// `quantized_rope_attention_matches_cpu` (whose prefill runs flash attention over
/// dequantized tiles, the default) with prefill through the split-K kernel instead
/// (`FERROLM_FLASH_KVQ=0`).
#[test]
fn quantized_split_prefill_matches_cpu() {
    let cfg = CudaConfig { flash_quant_prefill: false, ..CudaConfig::default() };
    rope_attention_cases(&Cuda::with_config(0, cfg).unwrap());
}

fn rope_attention_cases(g: &Cuda) {
    let c = Cpu;
    let mut r = Rng::seeded();
    let window = |w: usize, scale: f32| Attend { scale, window: Some(w) };
    let cases = [
        (9, 3, 64, RopeStyle::Half, 700, Attend::causal(64)),
        (16, 2, 128, RopeStyle::Interleaved, 700, Attend::causal(128)),
        (4, 1, 256, RopeStyle::Half, 700, window(512, 0.0625)),
        (16, 2, 128, RopeStyle::Half, 700, window(37, 0.1)),
    ];
    for (heads, n_kv, hd, style, cache, attend) in cases {
        for s in ["affine:8", "affine:4", "turbo:k8v3", "turbo:k4v2"] {
            let scheme = KvScheme::parse(s).unwrap();
            let cfg = attn_cfg(heads, n_kv, hd, 2, style);
            let rope = Rope { inv_freq: cfg.rope_inv_freq(), style, linear: 1.0 };
            let mut kvg = g.kv_store_scheme(&cfg, blocks_for(&cfg, cache), &scheme).unwrap();
            let mut kvc = c.kv_store_scheme(&cfg, blocks_for(&cfg, cache), &scheme).unwrap();
            let mut pos = 0;
            for m in [300, 1, 1, 77, 1, 1, 250, 1] {
                let shape = (heads, n_kv, hd);
                let (got, want) = rope_attention_both(g, &mut r, (&mut kvg, &mut kvc), shape, &rope, (m, pos), attend);
                let tol = if s.ends_with("v2") { 4e-2 } else { 2e-2 };
                let what = format!("{s} rope_attention {heads}/{n_kv}x{hd} {style:?} m{m} pos{pos} {attend:?}");
                check(&what, &got, &want, tol);
                pos += m;
            }
        }
    }
}

/// Teacher-forced logits of `m` over each of the golden's texts, concatenated.
fn golden_logits<B: Backend>(m: &Decoder<B>, golden: &serde_json::Value) -> Vec<Vec<f32>> {
    golden_texts(golden).iter().flat_map(|ids| teacher_forced(m, ids)).collect()
}

/// A real model's quantized cache on CUDA costs what it costs on the CPU: KL from the
/// CPU's bf16-cache logits to the CUDA model under `scheme` is within 1.25× (plus the bf16
/// paths' own 2e-3 bar) of KL to the CPU model under it, and its top-token agreement
/// within two points. (The two quantize slightly different activations, bf16 on CUDA, so a
/// coarse scheme's codes differ where a value sits near a boundary: comparing the two
/// quantized models directly measures that noise twice, not a defect.)
fn quantized_cost_matches(name: &str, mut mc: Decoder<Cpu>, mut mg: Decoder<Cuda>, golden: &str, schemes: &[&str]) {
    let golden: serde_json::Value = serde_json::from_str(golden).unwrap();
    let base = golden_logits(&mc, &golden);
    for s in schemes {
        let scheme = KvScheme::parse(s).unwrap();
        mc.set_kv_scheme(scheme.clone()).unwrap();
        mg.set_kv_scheme(scheme).unwrap();
        let (kl_c, agree_c, n_c) = kl_and_agreement(&base, &golden_logits(&mc, &golden));
        let (kl_g, agree_g, n_g) = kl_and_agreement(&base, &golden_logits(&mg, &golden));
        let (top_c, top_g) = (agree_c as f64 / n_c as f64, agree_g as f64 / n_g as f64);
        eprintln!("{name} --kv {s}: KL from bf16 CPU {kl_c:.4e}, CUDA {kl_g:.4e}; same top {top_c:.4} / {top_g:.4}");
        assert!(kl_g <= 1.25 * kl_c + 2e-3, "{name} --kv {s}: CUDA's KL {kl_g} against the CPU's {kl_c}");
        assert!(top_g >= top_c - 0.02, "{name} --kv {s}: CUDA's top-token agreement {top_g} against {top_c}");
    }
}

/// SmolLM2 and Gemma 3 270M (head dim 256, q/k norms in the decode path's encoding,
/// sliding layers) under quantized caches on CUDA against the CPU.
#[test]
fn models_with_quantized_kv_cost_what_they_cost_on_the_cpu() {
    let (mc, mg, _) = super::smollm2();
    let golden = include_str!("../goldens/smollm2_hf.json");
    quantized_cost_matches("SmolLM2", mc, mg, golden, &["affine:8", "affine:4", "turbo:k8v3", "turbo:k4v2"]);
    let path = super::models::gemma3_path();
    let (mut a, _) = ferrolm::formats::load_with_tokenizer(&path, false).unwrap();
    let mc = Decoder::load(Cpu, &mut a).unwrap();
    let (mut b, _) = ferrolm::formats::load_with_tokenizer(&path, false).unwrap();
    let mg = Decoder::load(Cuda::with_config(0, CudaConfig::from_env()).unwrap(), &mut b).unwrap();
    let golden = include_str!("../goldens/gemma3_hf.json");
    quantized_cost_matches("Gemma 3 270M", mc, mg, golden, &["affine:8", "turbo:k8v3"]);
}

/// `g`'s rope_attention of one step (`m` rows from `pos`, layer 1) on the given inputs.
fn rope_attention_gpu(
    g: &Cuda,
    kv: &mut ferrolm::backend::cuda::CudaKv,
    (heads, n_kv, hd): (usize, usize, usize),
    (rope, attend): (&Rope, Attend),
    (m, pos): (usize, usize),
    (q, k, v): (&[f32], &[f32], &[f32]),
) -> Vec<f32> {
    let mut og = g.act_poisoned(m, heads * hd, false).unwrap();
    let t = InOrder::new(g.kv_blocks(kv));
    let at = [t.span(pos, m)];
    g.begin(&[], &at, false).unwrap();
    let (mut qg, mut kg) = (g.act_from(m, heads * hd, q).unwrap(), g.act_from(m, n_kv * hd, k).unwrap());
    let vg = g.act_from(m, n_kv * hd, v).unwrap();
    g.rope_attention(&mut qg, &mut kg, &vg, kv, 1, &at, rope, (heads, n_kv), attend, &mut og).unwrap();
    g.read_rows(&og, 0).unwrap()
}

/// A decode row over a quantized cache through attention_q_decode and the merge (the
/// default) is the three kernels (kv_encode, attention_q, attention_merge_q;
/// `FERROLM_KVQ_FUSED=0`) bit for bit: every output and every byte of the rows written,
/// over prefill and decode steps across block boundaries, at head dims 64 and 128 (1 to 4
/// query heads a block), causal and sliding, with bf16 head blocks (--kv-start) and without.
#[test]
fn fused_quantized_decode_is_the_three_kernels_bit_for_bit() {
    let fused = gpu();
    let split = Cuda::with_config(0, CudaConfig { fused_quant_decode: false, ..CudaConfig::default() }).unwrap();
    let mut r = Rng::seeded();
    let window = |w: usize, scale: f32| Attend { scale, window: Some(w) };
    let cases = [
        (9, 3, 64, RopeStyle::Half, Attend::causal(64), 0),
        (16, 2, 128, RopeStyle::Interleaved, Attend::causal(128), 2),
        (8, 8, 128, RopeStyle::Half, window(37, 0.1), 0),
        (12, 2, 64, RopeStyle::Half, Attend::causal(64), 0),
    ];
    for (heads, n_kv, hd, style, attend, head_blocks) in cases {
        for s in SCHEMES {
            let scheme = KvScheme::parse(s).unwrap();
            let cfg = attn_cfg(heads, n_kv, hd, 2, style);
            let rope = Rope { inv_freq: cfg.rope_inv_freq(), style, linear: 1.0 };
            let mut blocks = blocks_for(&cfg, 400);
            (blocks.full, blocks.head) = (blocks.full - head_blocks, head_blocks);
            let mut kf = fused.kv_store_scheme(&cfg, blocks, &scheme).unwrap();
            let mut ks = split.kv_store_scheme(&cfg, blocks, &scheme).unwrap();
            let mut pos = 0;
            for m in [45, 1, 1, 1, 19, 1, 64, 1, 1, 200, 1] {
                let (q, k, v) =
                    (bf(&r.v(m * heads * hd, 1.0)), bf(&r.v(m * n_kv * hd, 1.0)), bf(&r.v(m * n_kv * hd, 1.0)));
                let shape = (heads, n_kv, hd);
                let a = rope_attention_gpu(fused, &mut kf, shape, (&rope, attend), (m, pos), (&q, &k, &v));
                let b = rope_attention_gpu(&split, &mut ks, shape, (&rope, attend), (m, pos), (&q, &k, &v));
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let what = format!("{s} {heads}/{n_kv}x{hd} head blocks {head_blocks} {attend:?} m{m} pos{pos}");
                assert!(bits(&a) == bits(&b), "{what}: the fused decode's output differs from the three kernels'");
                pos += m;
            }
            let rows: Vec<usize> =
                (0..pos).map(|p| ferrolm::kv::row_of(InOrder::new(blocks).span(0, 1).full, p)).collect();
            let (mut a, mut b) = (vec![], vec![]);
            fused.kv_export(&kf, 1, &rows, &mut a).unwrap();
            split.kv_export(&ks, 1, &rows, &mut b).unwrap();
            assert!(a == b, "{s} {heads}/{n_kv}x{hd}: the fused decode's rows differ from kv_encode's");
        }
    }
}

/// The same at model level with the q/k norms the fused kernel applies (a small synthetic
/// Qwen3: head dim 128, 8 query heads over 2 KV heads): greedy decode steps' logits over
/// quantized caches, with and without bf16 head blocks, are the unfused path's bits.
#[test]
fn fused_quantized_decode_with_qk_norms_is_the_unfused_path() {
    use ferrolm::formats::synthetic;
    use ferrolm::quant::scheme::QuantScheme;
    let base = synthetic::config("qwen3-0.6b").unwrap();
    let cfg = ferrolm::config::ModelConfig {
        hidden: 512,
        n_layers: 2,
        n_heads: 8,
        n_kv_heads: 2,
        ffn: 1024,
        vocab: 1000,
        ..base
    };
    let q = QuantScheme::parse("4").unwrap();
    let model = |fused: bool| {
        let mut src = synthetic::build_config("qwen3-small", &cfg, &q, 3, false).unwrap();
        let c = CudaConfig { fused_quant_decode: fused, ..CudaConfig::default() };
        Decoder::load(Cuda::with_config(0, c).unwrap(), &mut src).unwrap()
    };
    let (mut mf, mut ms) = (model(true), model(false));
    let prompt: Vec<u32> = (0..150).map(|i| (i * 37 + 11) % 1000).collect();
    for (s, start) in [("turbo:k8v3", 0), ("affine:4", 0), ("turbo:k4v2", 64), ("affine:8", 64)] {
        let mut steps = vec![];
        for m in [&mut mf, &mut ms] {
            m.set_kv_scheme(KvScheme::parse(s).unwrap()).unwrap();
            m.set_kv_start(start).unwrap();
            let mut kv = m.new_cache(200).unwrap();
            let mut l = m.forward(&prompt, 0, &mut kv, Logits::Last).unwrap();
            let mut out = vec![];
            for p in prompt.len()..prompt.len() + 40 {
                let t = ferrolm::sample::argmax(&l);
                l = m.forward(&[t], p, &mut kv, Logits::Last).unwrap();
                out.extend(l.iter().map(|v| v.to_bits()));
            }
            steps.push(out);
        }
        assert!(steps[0] == steps[1], "{s} --kv-start {start}: fused decode logits differ from the unfused path's");
    }
}
