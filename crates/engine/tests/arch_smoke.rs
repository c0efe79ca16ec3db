//! Tiny random models, one per architecture variant: the backend forward pass against a
//! naive f64 reference written here from the equations, prefill vs token-by-token cache
//! path, and several prompts interleaved on separate caches.

use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::Backend;
use ferrolm::config::{Activation, Arch, AttnKind, Llama3Scaling, ModelConfig, RopeStyle};
use ferrolm::formats::{names, ModelSource, TensorMap, TokenizerSource};
use ferrolm::generate::Session;
use ferrolm::model::{Decoder, Logits};
use ferrolm::quant::{AffineTensor, DenseData, DenseTensor, ScaleDtype, Weight};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn base_cfg() -> ModelConfig {
    ModelConfig {
        hidden: 64,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        vocab: 96,
        max_ctx: 64,
        ..Default::default()
    }
}

/// Variants: (name, config, weight bits: None = dense f32).
fn variants() -> Vec<(&'static str, ModelConfig, Option<u32>)> {
    let mut v = vec![];
    v.push(("llama2-mha-dense", ModelConfig { n_kv_heads: 4, ..base_cfg() }, None));
    v.push(("llama-gqa-q4", base_cfg(), Some(4)));
    v.push((
        "smollm2-tied-interleaved-q8",
        ModelConfig { tie_embeddings: true, rope_style: RopeStyle::Interleaved, ..base_cfg() },
        Some(8),
    ));
    let l3 = Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 16.0 };
    v.push(("llama3-scaled-q4", ModelConfig { llama3_scaling: Some(l3), rope_theta: 500000.0, ..base_cfg() }, Some(4)));
    v.push(("qwen2-bias-q6", ModelConfig { arch: Arch::Qwen2, qkv_bias: true, ..base_cfg() }, Some(6)));
    v.push(("mistral-minicpm5-mqa-q2", ModelConfig { n_kv_heads: 1, ..base_cfg() }, Some(2)));
    v.push(("qwen3-qknorm-dense", ModelConfig { arch: Arch::Qwen3, qk_norm: true, ..base_cfg() }, None));
    v.push(("qwen3-qknorm-q4", ModelConfig { arch: Arch::Qwen3, qk_norm: true, ..base_cfg() }, Some(4)));
    // Mistral-style: every layer sliding, a window shorter than the prompt.
    let sliding = vec![AttnKind::Sliding; 2];
    v.push(("mistral-sliding-q8", ModelConfig { sliding_window: 5, layer_kinds: sliding, ..base_cfg() }, Some(8)));
    // Gemma 3: a sliding layer (window 4, its own RoPE base) then a global one (layer
    // kinds for 2 layers with period 2), GeGLU, post-norms, scaled embeddings and queries.
    let gemma =
        ModelConfig { tie_embeddings: true, n_kv_heads: 1, rope_theta: 1e6, ..base_cfg() }.gemma3(4, Some(24.0));
    let gemma = ModelConfig { layer_kinds: ModelConfig::interleaved_kinds(2, 2), ..gemma };
    v.push(("gemma3-sliding-geglu-q4", gemma, Some(4)));
    v
}

/// Norm gains as a model's files hold them: around 1, or Gemma's w around 0 (gain 1 + w).
fn gains(r: &mut Rng, cfg: &ModelConfig, n: usize) -> Vec<f32> {
    let offset = if cfg.norm_plus_one { 0.0 } else { 1.0 };
    r.vec(n, 0.2).into_iter().map(|v| offset + v).collect()
}

fn dense(rows: usize, cols: usize, data: Vec<f32>) -> Weight {
    Weight::Dense(DenseTensor { rows, cols, data: DenseData::F32(data) })
}

/// Random weights; returns the source (quantized if asked) and the f32 values the
/// reference uses (the dequantized ones, so only the compute differs).
fn build(cfg: &ModelConfig, bits: Option<u32>, seed: u64) -> (ModelSource, TensorMap) {
    let mut r = Rng(seed);
    let mut t = TensorMap::new();
    let (d, hd, f) = (cfg.hidden, cfg.head_dim, cfg.ffn);
    let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let mut mats = vec![(names::EMBED.to_string(), cfg.vocab, d)];
    if !cfg.tie_embeddings {
        mats.push((names::LM_HEAD.to_string(), cfg.vocab, d));
    }
    for i in 0..cfg.n_layers {
        for (s, rows, cols) in [
            ("self_attn.q_proj.weight", qd, d),
            ("self_attn.k_proj.weight", kvd, d),
            ("self_attn.v_proj.weight", kvd, d),
            ("self_attn.o_proj.weight", d, qd),
            ("mlp.gate_proj.weight", f, d),
            ("mlp.up_proj.weight", f, d),
            ("mlp.down_proj.weight", d, f),
        ] {
            mats.push((names::layer(i, s), rows, cols));
        }
        let mut norms = vec![("input_layernorm.weight", d), ("post_attention_layernorm.weight", d)];
        if cfg.post_norms {
            norms.extend([("pre_feedforward_layernorm.weight", d), ("post_feedforward_layernorm.weight", d)]);
        }
        if cfg.qk_norm {
            norms.extend([("self_attn.q_norm.weight", hd), ("self_attn.k_norm.weight", hd)]);
        }
        for (s, n) in norms {
            t.insert(names::layer(i, s), dense(1, n, gains(&mut r, cfg, n)));
        }
        if cfg.qkv_bias {
            for (s, n) in
                [("self_attn.q_proj.bias", qd), ("self_attn.k_proj.bias", kvd), ("self_attn.v_proj.bias", kvd)]
            {
                t.insert(names::layer(i, s), dense(1, n, r.vec(n, 0.1)));
            }
        }
    }
    t.insert(names::NORM.to_string(), dense(1, d, gains(&mut r, cfg, d)));
    for (name, rows, cols) in mats {
        let w = r.vec(rows * cols, 1.0 / (cols as f32).sqrt() * 1.5);
        let wt = match bits {
            None => dense(rows, cols, w),
            Some(b) => Weight::Affine(AffineTensor::quantize(&w, rows, cols, b, 32, ScaleDtype::BF16).unwrap()),
        };
        t.insert(name, wt);
    }
    let reference: TensorMap = t.iter().map(|(k, v)| (k.clone(), dense(v.rows(), v.cols(), v.to_f32_vec()))).collect();
    let src = ModelSource {
        path: "tiny".into(),
        format: "test",
        config: cfg.clone(),
        tensors: t,
        tokenizer: TokenizerSource::Dir("none".into()),
        file_bytes: 0,
        synthetic: None,
        tokenizer_vocab: None,
    };
    (src, reference)
}

/// Naive reference forward over the whole sequence in f64: returns logits [m, V].
fn reference(cfg: &ModelConfig, w: &TensorMap, tokens: &[u32]) -> Vec<f64> {
    let g = |n: &str| w[n].to_f32_vec().into_iter().map(|v| v as f64).collect::<Vec<f64>>();
    let (d, hd, m) = (cfg.hidden, cfg.head_dim, tokens.len());
    let matvec = |wm: &[f64], x: &[f64], rows: usize| -> Vec<f64> {
        (0..rows).map(|r| (0..x.len()).map(|j| wm[r * x.len() + j] * x[j]).sum()).collect()
    };
    // RMSNorm with the file's gains (Gemma's: 1 + w).
    let offset = if cfg.norm_plus_one { 1.0 } else { 0.0 };
    let norm = |x: &[f64], gain: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        x.iter().zip(gain).map(|(v, g)| v / (ms + cfg.rms_eps as f64).sqrt() * (g + offset)).collect()
    };
    let norm_heads = |x: &mut Vec<f64>, gain: &[f64]| {
        *x = x.chunks(hd).flat_map(|h| norm(h, gain)).collect();
    };
    let act = |a: f64| match cfg.activation {
        Activation::Silu => a / (1.0 + (-a).exp()),
        Activation::GeluTanh => {
            0.5 * a * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (a + 0.044715 * a.powi(3))).tanh())
        }
    };
    let global: Vec<f64> = cfg.rope_inv_freq().into_iter().map(|v| v as f64).collect();
    let local: Option<Vec<f64>> = cfg.rope_local_inv_freq().map(|f| f.into_iter().map(|v| v as f64).collect());
    let rope = |x: &mut [f64], pos: usize, inv_freq: &[f64]| {
        for head in x.chunks_mut(hd) {
            for (j, f) in inv_freq.iter().enumerate() {
                let (a, b) = match cfg.rope_style {
                    RopeStyle::Half => (j, j + hd / 2),
                    RopeStyle::Interleaved => (2 * j, 2 * j + 1),
                };
                let (c, s) = ((pos as f64 * f).cos(), (pos as f64 * f).sin());
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    };
    let emb = g(names::EMBED);
    let scale = cfg.embed_scale as f64;
    let mut xs: Vec<Vec<f64>> =
        tokens.iter().map(|&t| emb[t as usize * d..(t as usize + 1) * d].iter().map(|v| v * scale).collect()).collect();
    for l in 0..cfg.n_layers {
        let n = |s: &str| names::layer(l, s);
        let sliding = cfg.layer_kind(l) == AttnKind::Sliding;
        let inv_freq = if sliding { local.as_deref().unwrap_or(&global) } else { &global };
        let (wq, wk, wv, wo) = (
            g(&n("self_attn.q_proj.weight")),
            g(&n("self_attn.k_proj.weight")),
            g(&n("self_attn.v_proj.weight")),
            g(&n("self_attn.o_proj.weight")),
        );
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        for (p, x) in xs.iter().enumerate() {
            let h = norm(x, &g(&n("input_layernorm.weight")));
            let (mut q, mut k, mut v) = (
                matvec(&wq, &h, cfg.n_heads * hd),
                matvec(&wk, &h, cfg.n_kv_heads * hd),
                matvec(&wv, &h, cfg.n_kv_heads * hd),
            );
            if cfg.qkv_bias {
                for (vec, s) in [
                    (&mut q, "self_attn.q_proj.bias"),
                    (&mut k, "self_attn.k_proj.bias"),
                    (&mut v, "self_attn.v_proj.bias"),
                ] {
                    vec.iter_mut().zip(g(&n(s))).for_each(|(a, b)| *a += b);
                }
            }
            if cfg.qk_norm {
                norm_heads(&mut q, &g(&n("self_attn.q_norm.weight")));
                norm_heads(&mut k, &g(&n("self_attn.k_norm.weight")));
            }
            rope(&mut q, p, inv_freq);
            rope(&mut k, p, inv_freq);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for p in 0..m {
            let mut att = vec![0f64; cfg.n_heads * hd];
            for h in 0..cfg.n_heads {
                let kh = h / (cfg.n_heads / cfg.n_kv_heads);
                // A sliding layer sees the last `sliding_window` positions.
                let first = if sliding { (p + 1).saturating_sub(cfg.sliding_window) } else { 0 };
                let qscale = cfg.query_pre_attn_scalar.map_or(hd as f64, |s| s as f64).sqrt();
                let sc: Vec<f64> = (first..=p)
                    .map(|j| (0..hd).map(|e| qs[p][h * hd + e] * ks[j][kh * hd + e]).sum::<f64>() / qscale)
                    .collect();
                let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
                for (j, s) in (first..=p).zip(&sc) {
                    for e in 0..hd {
                        att[h * hd + e] += (s - mx).exp() / z * vs[j][kh * hd + e];
                    }
                }
            }
            let mut o = matvec(&wo, &att, d);
            // Gemma: post_attention_layernorm norms the attention output and the MLP has its
            // own pre- and post-norms; in Llama the same name is the MLP's pre-norm.
            let pre_mlp = match cfg.post_norms {
                true => {
                    o = norm(&o, &g(&n("post_attention_layernorm.weight")));
                    "pre_feedforward_layernorm.weight"
                }
                false => "post_attention_layernorm.weight",
            };
            xs[p].iter_mut().zip(o).for_each(|(a, b)| *a += b);
            let h = norm(&xs[p], &g(&n(pre_mlp)));
            let gate = matvec(&g(&n("mlp.gate_proj.weight")), &h, cfg.ffn);
            let up = matvec(&g(&n("mlp.up_proj.weight")), &h, cfg.ffn);
            let prod: Vec<f64> = gate.iter().zip(&up).map(|(a, b)| act(*a) * b).collect();
            let mut down = matvec(&g(&n("mlp.down_proj.weight")), &prod, d);
            if cfg.post_norms {
                down = norm(&down, &g(&n("post_feedforward_layernorm.weight")));
            }
            xs[p].iter_mut().zip(down).for_each(|(a, b)| *a += b);
        }
    }
    let head = if cfg.tie_embeddings { emb } else { g(names::LM_HEAD) };
    xs.iter().flat_map(|x| matvec(&head, &norm(x, &g(names::NORM)), cfg.vocab)).collect()
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn every_variant_matches_the_reference_and_its_own_cache_path() {
    let tokens: Vec<u32> = vec![3, 17, 42, 5, 88, 1, 60, 33, 9, 70, 2, 95];
    for (name, cfg, bits) in variants() {
        let (mut src, wref) = build(&cfg, bits, 7);
        let model = Decoder::load(Cpu, &mut src).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = reference(&cfg, &wref, &tokens);
        // 1) whole sequence at once (prefill path, every position's logits)
        let mut kv = model.new_cache(32).unwrap();
        let all = model.forward(&tokens, 0, &mut kv, Logits::All).unwrap();
        assert_eq!(all.len(), tokens.len() * cfg.vocab, "{name}: logits shape");
        let e = rel_err(&all, &want);
        // The bf16 KV cache bounds agreement (measured ~2.5e-3 relative).
        assert!(e < 6e-3, "{name}: prefill vs reference rel err {e}");
        // 2) token by token through the cache (decode path) gives the same logits
        let mut kv = model.new_cache(32).unwrap();
        let mut steps = vec![];
        for (p, &t) in tokens.iter().enumerate() {
            steps.extend(model.forward(&[t], p, &mut kv, Logits::Last).unwrap());
        }
        let e2 = rel_err(&steps, &all.iter().map(|&v| v as f64).collect::<Vec<_>>());
        // The two paths' matmuls sum in different orders (~1e-7 relative); where that flips
        // the bf16 rounding of a cached k or v value (one ulp, 2⁻⁸ relative) the logits move
        // by ~1e-4 (seen: qwen3-qknorm-q4); otherwise they agree to ~1e-6.
        assert!(e2 < 1e-3, "{name}: decode path vs prefill rel err {e2}");
        // 3) chunked prefill (5 then 7) matches too
        let mut kv = model.new_cache(32).unwrap();
        model.forward(&tokens[..5], 0, &mut kv, Logits::Last).unwrap();
        let last = model.forward(&tokens[5..], 5, &mut kv, Logits::Last).unwrap();
        let e3 = rel_err(&last, &all[(tokens.len() - 1) * cfg.vocab..].iter().map(|&v| v as f64).collect::<Vec<_>>());
        assert!(e3 < 1e-3, "{name}: chunked prefill rel err {e3}");
    }
}

#[test]
fn a_batch_of_prompts_on_separate_caches_matches_single_runs() {
    let (_, cfg, bits) = variants().remove(1);
    let (mut src, _) = build(&cfg, bits, 11);
    let model = Decoder::load(Cpu, &mut src).unwrap();
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![50, 40, 30, 20, 10], vec![7]];
    let single: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| {
            let mut kv = model.new_cache(16).unwrap();
            let mut l = model.forward(p, 0, &mut kv, Logits::Last).unwrap();
            for i in 0..4 {
                l = model.forward(&[i + 5], p.len() + i as usize, &mut kv, Logits::Last).unwrap();
            }
            l
        })
        .collect();
    // Interleave: every sequence advances one step per round, as a batch scheduler would.
    let mut sessions: Vec<Session<Cpu>> = prompts.iter().map(|_| Session::new(&model, 16).unwrap()).collect();
    let mut last: Vec<Vec<f32>> = sessions.iter_mut().zip(&prompts).map(|(s, p)| s.feed(p).unwrap().0).collect();
    for i in 0..4u32 {
        for (s, l) in sessions.iter_mut().zip(last.iter_mut()) {
            *l = s.step(i + 5).unwrap();
        }
    }
    assert_eq!(last, single);
}

/// A session of a finished one's capacity takes its cache and buffers (so a backend's
/// captured steps replay), starts empty, and computes what a new cache would: nothing of
/// the last session's tokens shows. Other capacities, and sessions alive at once, get
/// their own.
#[test]
fn a_new_session_reuses_a_finished_ones_parts_and_starts_empty() {
    let (_, cfg, bits) = variants().remove(1);
    let (mut src, _) = build(&cfg, bits, 13);
    let model = Decoder::load(Cpu, &mut src).unwrap();
    let fresh = |prompt: &[u32], steps: &[u32]| {
        let mut kv = model.new_cache(16).unwrap();
        let mut l = model.forward(prompt, 0, &mut kv, Logits::Last).unwrap();
        for (i, &t) in steps.iter().enumerate() {
            l = model.forward(&[t], prompt.len() + i, &mut kv, Logits::Last).unwrap();
        }
        l
    };
    let mut a = Session::new(&model, 16).unwrap();
    a.feed(&[9, 8, 7, 6, 5, 4]).unwrap();
    a.step(3).unwrap();
    let id = a.id();
    drop(a);
    let mut b = Session::new(&model, 16).unwrap();
    assert_eq!(b.id(), id, "the finished session's parts are taken");
    assert!(b.tokens.is_empty());
    let (mut l, n) = b.feed(&[9, 8, 1]).unwrap();
    assert_eq!(n, 3, "nothing of the last session's tokens is reused");
    for t in [2, 3] {
        l = b.step(t).unwrap();
    }
    assert_eq!(l, fresh(&[9, 8, 1], &[2, 3]));
    let c = Session::new(&model, 16).unwrap();
    assert_ne!(c.id(), id, "a session alive at once has its own parts");
    assert_ne!(Session::new(&model, 8).unwrap().id(), id, "another capacity has its own");
}

#[test]
fn oversize_prompts_and_bad_token_ids_are_errors() {
    let (_, cfg, bits) = variants().remove(1);
    let (mut src, _) = build(&cfg, bits, 3);
    let model = Decoder::load(Cpu, &mut src).unwrap();
    let mut s = Session::new(&model, 8).unwrap();
    let e = s.feed(&[1; 9]).unwrap_err().to_string();
    assert!(e.contains("9 tokens") && e.contains("context of 8"), "{e}");
    let e = s.feed(&[1, 500]).unwrap_err().to_string();
    assert!(e.contains("500") && e.contains("vocabulary"), "{e}");
    let mut kv = model.new_cache(4).unwrap();
    assert!(model.forward(&[1, 2, 3], 2, &mut kv, Logits::Last).is_err());
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let cfg = base_cfg();
    let (mut src, _) = build(&cfg, Some(4), 5);
    src.tensors.remove("model.layers.1.mlp.up_proj.weight");
    let e = Decoder::load(Cpu, &mut src).err().unwrap().to_string();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("missing"), "{e}");
    let (mut src, _) = build(&cfg, None, 5);
    src.tensors.insert("model.layers.0.self_attn.k_proj.weight".into(), dense(3, 64, vec![0.0; 192]));
    let e = Decoder::load(Cpu, &mut src).err().unwrap().to_string();
    assert!(e.contains("k_proj") && e.contains("[3, 64]"), "{e}");
}

/// Top-k sampling through `Session::step_top_k` (the k best found by the backend, the draw
/// on the host) picks what the host sampler picks from the full logits, step for step, and
/// `generate` (which takes that path for top-k configurations) gives the same tokens.
#[test]
fn top_k_steps_sample_what_the_host_sampler_samples() {
    use ferrolm::sample::{Sampler, SamplerConfig};
    let (_, cfg, bits) = variants().remove(1);
    let (mut src, _) = build(&cfg, bits, 13);
    let model = Decoder::load(Cpu, &mut src).unwrap();
    let prompt = [3u32, 1, 4, 1, 5];
    for (k, temperature, top_p) in [(5, 0.9f32, 1.0f32), (17, 1.4, 0.9), (1, 1.0, 1.0)] {
        let sc = SamplerConfig { temperature, top_k: k, top_p, seed: 21, ..Default::default() };
        let (mut sa, mut sb) = (Sampler::new(sc.clone()), Sampler::new(sc.clone()));
        let (mut a, mut b) = (Session::new(&model, 32).unwrap(), Session::new(&model, 32).unwrap());
        let (mut la, _) = a.feed(&prompt).unwrap();
        b.feed(&prompt).unwrap();
        let mut ta = sa.sample(&mut la.clone(), &[]);
        let mut tb = ta;
        sb.sample(&mut la.clone(), &[]); // same draw count on both samplers
        for i in 0..12 {
            la = a.step(ta).unwrap();
            ta = sa.sample(&mut la.clone(), &[]);
            let cand = b.step_top_k(tb, k, 1.0 / temperature).unwrap();
            assert_eq!(cand.len(), k);
            tb = sb.sample_candidates(&cand);
            assert_eq!(tb, ta, "k {k} t {temperature} step {i}");
        }
        // generate: the same tokens whichever path it takes
        let run = || {
            let mut s = Session::new(&model, 32).unwrap();
            let mut out = vec![];
            s.generate(&prompt, 10, &mut Sampler::new(sc.clone()), &[], |t| {
                out.push(t);
                Ok(true)
            })
            .unwrap();
            out
        };
        let mut host = Session::new(&model, 32).unwrap();
        let mut want = vec![];
        let mut s = Sampler::new(sc.clone());
        let (mut l, _) = host.feed(&prompt).unwrap();
        for _ in 0..10 {
            let t = s.sample(&mut l, &[]);
            want.push(t);
            l = host.step(t).unwrap();
        }
        assert_eq!(run(), want, "generate k {k}");
    }
    // bad k is an error, not a panic
    let mut s = Session::new(&model, 8).unwrap();
    s.feed(&prompt).unwrap();
    assert!(s.step_top_k(1, 0, 1.0).is_err());
    assert!(s.step_top_k(1, cfg.vocab + 1, 1.0).is_err());
}

/// A sliding-window layer attends to nothing before its window: in a one-layer model of
/// sliding layers, the last position's logits do not depend on a token before the window
/// (bit for bit), where a global layer's do; on the prefill path and through the cache.
#[test]
fn positions_before_the_window_are_not_attended() {
    let one = |kinds: AttnKind| ModelConfig { n_layers: 1, sliding_window: 4, layer_kinds: vec![kinds], ..base_cfg() };
    let a: Vec<u32> = vec![3, 17, 42, 5, 88, 1, 60, 33, 9, 70];
    let mut b = a.clone();
    b[0] = 91; // position 0: outside the last position's window (6..=9)
    for (kind, same) in [(AttnKind::Sliding, true), (AttnKind::Full, false)] {
        let (mut src, _) = build(&one(kind), Some(8), 5);
        let model = Decoder::load(Cpu, &mut src).unwrap();
        let last = |t: &[u32], decode: bool| {
            let mut kv = model.new_cache(16).unwrap();
            if !decode {
                return model.forward(t, 0, &mut kv, Logits::Last).unwrap();
            }
            let mut l = vec![];
            for (p, &x) in t.iter().enumerate() {
                l = model.forward(&[x], p, &mut kv, Logits::Last).unwrap();
            }
            l
        };
        for decode in [false, true] {
            assert_eq!(last(&a, decode) == last(&b, decode), same, "{kind:?} decode {decode}");
        }
    }
}

/// A sliding layer's cache holds blocks for its window and one call (CALL_ROWS), blocks
/// out of the window going back as the sequence grows: a sequence longer than that and
/// than one call (the model splits a long prefill) gives the reference's logits on the
/// prefill and decode paths.
#[test]
fn sliding_layers_keep_only_their_window() {
    let n = 1100;
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 37 + 11) % 96) as u32).collect();
    for (name, cfg, bits) in variants().into_iter().filter(|(n, ..)| n.contains("sliding")) {
        let cfg = ModelConfig { max_ctx: 2048, ..cfg };
        let (mut src, wref) = build(&cfg, bits, 7);
        let model = Decoder::load(Cpu, &mut src).unwrap();
        let want = reference(&cfg, &wref, &tokens);
        let mut kv = model.new_cache(2048).unwrap();
        let blocks = model.backend.kv_blocks(&kv.store);
        let window_blocks = (cfg.sliding_window + ferrolm::kv::CALL_ROWS - 1 + ferrolm::kv::seq::RELEASE_LAG)
            .div_ceil(ferrolm::kv::BLOCK)
            + 1;
        assert_eq!((blocks.full, blocks.sliding), (2048 / ferrolm::kv::BLOCK, window_blocks), "{name}");
        assert!(kv.windowed() && blocks.sliding * ferrolm::kv::BLOCK < n, "{name}: {blocks:?}");
        let all = model.forward(&tokens, 0, &mut kv, Logits::All).unwrap();
        let e = rel_err(&all, &want);
        assert!(e < 6e-3, "{name}: {n} positions through rings, prefill vs reference rel err {e}");
        let mut kv = model.new_cache(2048).unwrap();
        let split = n - 40;
        model.forward(&tokens[..split], 0, &mut kv, Logits::Last).unwrap();
        for (p, &t) in tokens.iter().enumerate().skip(split) {
            let step = model.forward(&[t], p, &mut kv, Logits::Last).unwrap();
            let e = rel_err(&step, &want[p * cfg.vocab..(p + 1) * cfg.vocab]);
            assert!(e < 6e-3, "{name}: decode at {p} vs reference rel err {e}");
        }
    }
}

/// A padded vocabulary (more embedding rows than the tokenizer has ids, as Qwen's): the
/// head scores only the tokenizer's ids, with the same values the full head gives them,
/// tied and untied, on the prefill and decode paths; generation never leaves them.
#[test]
fn a_padded_vocabulary_scores_only_the_tokenizers_ids() {
    let tokens: Vec<u32> = vec![3, 17, 42, 5, 93, 1, 60]; // 93: a padded id as input is fine
    for tied in [false, true] {
        let cfg = ModelConfig { tie_embeddings: tied, ..base_cfg() };
        let (mut full, _) = build(&cfg, Some(4), 21);
        let (mut padded, _) = build(&cfg, Some(4), 21);
        padded.tokenizer_vocab = Some(90);
        let (full, padded) = (Decoder::load(Cpu, &mut full).unwrap(), Decoder::load(Cpu, &mut padded).unwrap());
        assert_eq!((full.logits_width(), padded.logits_width()), (96, 90));
        let logits = |m: &Decoder<Cpu>, decode: bool| {
            let mut kv = m.new_cache(16).unwrap();
            if !decode {
                return m.forward(&tokens, 0, &mut kv, Logits::All).unwrap();
            }
            tokens.iter().enumerate().flat_map(|(p, &t)| m.forward(&[t], p, &mut kv, Logits::Last).unwrap()).collect()
        };
        for decode in [false, true] {
            let (a, b) = (logits(&full, decode), logits(&padded, decode));
            let cut: Vec<f32> = a.chunks(96).flat_map(|r| r[..90].to_vec()).collect();
            assert_eq!(b, cut, "tied {tied} decode {decode}");
        }
        let mut s = Session::new(&padded, 32).unwrap();
        let mut sampler = ferrolm::sample::Sampler::new(ferrolm::sample::SamplerConfig {
            temperature: 5.0,
            seed: 3,
            ..Default::default()
        });
        let mut out = vec![];
        s.generate(&tokens, 20, &mut sampler, &[], |t| {
            out.push(t);
            Ok(true)
        })
        .unwrap();
        assert!(out.len() == 20 && out.iter().all(|&t| t < 90), "tied {tied}: {out:?}");
    }
}
