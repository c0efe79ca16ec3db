//! CUDA vs the CPU reference. Needs an NVIDIA GPU: built by CI (`--features cuda-tests`)
//! but run only by scripts/gpu-check.sh on a GPU machine.
//!
//! Every op gets fresh random inputs each run (never zeros) and NaN-poisoned outputs, and
//! must match the CPU backend to ‖out−ref‖/‖ref‖ ≤ 1e-2 (bf16 activations). The whole model
//! (SmolLM2-135M) must agree with the CPU path on teacher-forced argmax (≥ 98% where the
//! reference's top-2 margin > 0.05) with mean KL(CPU‖CUDA) ≤ 2e-3, give the same greedy
//! text, and give bit-identical logits over three runs.

use ferrolm::backend::cpu::{Cpu, CpuAct};
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::backend::{Backend, Rope};
use ferrolm::config::{Activation, RopeStyle};
use ferrolm::kv::{blocks_for, InOrder};
use ferrolm::model::{Decoder, Logits};
use ferrolm::quant::{AffineTensor, DenseData, DenseTensor, ScaleDtype, Weight};
use std::sync::OnceLock;

#[path = "cuda_ops/attention.rs"]
mod attention;
#[path = "cuda_ops/batching.rs"]
mod batching;
#[path = "cuda_ops/decode.rs"]
mod decode;
#[path = "cuda_ops/decode_rows.rs"]
mod decode_rows;
#[path = "cuda_ops/flash.rs"]
mod flash;
#[path = "cuda_ops/gemm.rs"]
mod gemm;
#[path = "cuda_ops/gemma.rs"]
mod gemma;
#[path = "cuda_ops/kv_files.rs"]
mod kv_files;
#[path = "cuda_ops/kv_quant.rs"]
mod kv_quant;
#[path = "cuda_ops/models.rs"]
mod models;
#[path = "cuda_ops/serving.rs"]
mod serving;
#[path = "cuda_ops/tensor_parallel.rs"]
mod tensor_parallel;

use attention::{attention_both, attn_cfg, rope_attention_both};
use models::smollm2;

fn gpu() -> &'static Cuda {
    static G: OnceLock<Cuda> = OnceLock::new();
    G.get_or_init(|| Cuda::new(0).expect("a CUDA device"))
}

struct Rng(u64);
impl Rng {
    fn seeded() -> Rng {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        eprintln!("seed {t}");
        Rng(t | 1)
    }
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn v(&mut self, n: usize, s: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * s).collect()
    }
}

fn bf(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
}

fn cpu(rows: usize, cols: usize, data: Vec<f32>) -> CpuAct {
    CpuAct { rows, cols, data }
}

fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: NaN/inf in output (unwritten element?)");
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().max(1e-30);
    let e = (num / den).sqrt();
    eprintln!("{what}: rel err {e:.2e}");
    assert!(e <= tol, "{what}: rel err {e} > {tol}");
}

#[test]
fn ops_match_cpu() {
    let (g, c) = (gpu(), Cpu);
    let mut r = Rng::seeded();
    let (m, d) = (3, 256);
    let x = bf(&r.v(m * d, 1.0));
    let xg = g.act_from(m, d, &x).unwrap();
    let xc = cpu(m, d, x.clone());
    // rmsnorm
    let w = r.v(d, 1.0);
    let xf = r.v(m * d, 30.0); // the f32 residual stream, with large values as real models have
    let mut oc = c.act(m, d).unwrap();
    c.rms_norm(&xc, &w, 1e-5, &mut oc).unwrap();
    let mut og = g.act_poisoned(m, d, false).unwrap();
    g.rms_norm(&xg, &g.vector(w.clone()).unwrap(), 1e-5, &mut og).unwrap();
    check("rmsnorm bf16 in", &g.read_rows(&og, 0).unwrap(), &oc.data, 1e-2);
    let mut oc = c.act(m, d).unwrap();
    c.rms_norm(&cpu(m, d, xf.clone()), &w, 1e-5, &mut oc).unwrap();
    let mut og = g.act_poisoned(m, d, false).unwrap();
    g.rms_norm(&g.act_from_f32(m, d, &xf).unwrap(), &g.vector(w.clone()).unwrap(), 1e-5, &mut og).unwrap();
    check("rmsnorm f32 in", &g.read_rows(&og, 0).unwrap(), &oc.data, 1e-2);
    // q/k head norms (in place, heads of 64)
    let wh = r.v(64, 1.0);
    let mut hg = g.act_from(m, d, &x).unwrap();
    g.rms_norm_heads(&mut hg, &g.vector(wh.clone()).unwrap(), 1e-6).unwrap();
    let mut hc = xc.clone();
    c.rms_norm_heads(&mut hc, &wh, 1e-6).unwrap();
    check("rms_norm_heads", &g.read_rows(&hg, 0).unwrap(), &hc.data, 1e-2);
    // add, glu (SwiGLU, GeGLU), add_bias
    let y = bf(&r.v(m * d, 1.0));
    let mut ag = g.act_from(m, d, &x).unwrap();
    g.add(&mut ag, &g.act_from(m, d, &y).unwrap()).unwrap();
    let mut ac = xc.clone();
    c.add(&mut ac, &cpu(m, d, y.clone())).unwrap();
    check("add bf16", &g.read_rows(&ag, 0).unwrap(), &ac.data, 1e-2);
    let mut ag = g.act_from_f32(m, d, &xf).unwrap();
    g.add(&mut ag, &g.act_from(m, d, &y).unwrap()).unwrap();
    let mut ac = cpu(m, d, xf.clone());
    c.add(&mut ac, &cpu(m, d, y.clone())).unwrap();
    check("add f32 += bf16", &g.read_rows(&ag, 0).unwrap(), &ac.data, 1e-6);
    for act in [Activation::Silu, Activation::GeluTanh] {
        let mut sg = g.act_poisoned(m, d, false).unwrap();
        g.glu(&xg, &g.act_from(m, d, &y).unwrap(), act, &mut sg).unwrap();
        let mut sc = c.act(m, d).unwrap();
        c.glu(&xc, &cpu(m, d, y.clone()), act, &mut sc).unwrap();
        check(&format!("glu {act:?}"), &g.read_rows(&sg, 0).unwrap(), &sc.data, 1e-2);
    }
    let bias = r.v(d, 0.5);
    let mut bg = g.act_from(m, d, &x).unwrap();
    g.add_bias(&mut bg, &g.vector(bias.clone()).unwrap()).unwrap();
    let mut bc = xc.clone();
    c.add_bias(&mut bc, &bias).unwrap();
    check("add_bias", &g.read_rows(&bg, 0).unwrap(), &bc.data, 1e-2);
    // rope, both pair orders, at a far position
    for style in [RopeStyle::Interleaved, RopeStyle::Half] {
        let rope =
            Rope { inv_freq: (0..32).map(|i| 1.0 / 10000f32.powf(i as f32 / 32.0)).collect(), style, linear: 1.0 };
        let mut rg = g.act_from(m, d, &x).unwrap();
        let t = InOrder::new(blocks_for(&attn_cfg(4, 4, 64, 1, style), 3000 + m));
        g.begin(&[], &[t.span(3000, m)], false).unwrap(); // CUDA reads the position staged by the forward call
        g.rope(&mut rg, 4, &[t.span(3000, m)], &rope).unwrap();
        let mut rc = xc.clone();
        c.rope(&mut rc, 4, &[t.span(3000, m)], &rope).unwrap();
        check(&format!("rope {style:?}"), &g.read_rows(&rg, 0).unwrap(), &rc.data, 1e-2);
    }
}

#[test]
fn matmuls_and_embeddings_match_cpu() {
    let (g, c) = (gpu(), Cpu);
    let mut r = Rng::seeded();
    let (n, k) = (200, 512);
    let wf = r.v(n * k, 0.05);
    let mut cases: Vec<(String, Weight)> = vec![];
    for bits in [2, 4, 8] {
        for group in [16, 32, 64, 128] {
            for dt in [ScaleDtype::F16, ScaleDtype::BF16, ScaleDtype::F32] {
                let a = AffineTensor::quantize(&wf, n, k, bits, group, dt).unwrap();
                cases.push((format!("q{bits} g{group} {dt:?}"), Weight::Affine(a)));
            }
        }
    }
    // 3-bit weights run widened to 4 bits, 5/6-bit to 8
    for (bits, group, dt) in [(3, 32, ScaleDtype::F16), (5, 64, ScaleDtype::BF16), (6, 16, ScaleDtype::F32)] {
        let a = AffineTensor::quantize(&wf, n, k, bits, group, dt).unwrap();
        cases.push((format!("q{bits} g{group} {dt:?} (widened)"), Weight::Affine(a)));
    }
    let dense = bf(&wf);
    let dense = DenseData::BF16(dense.iter().map(|&v| half::bf16::from_f32(v)).collect());
    cases.push(("dense bf16".into(), Weight::Dense(DenseTensor { rows: n, cols: k, data: dense })));
    for (name, w) in cases {
        let wg = g.matrix(w.clone()).unwrap();
        for m in [1, 4, 13] {
            let x = bf(&r.v(m * k, 1.0));
            let xg = g.act_from(m, k, &x).unwrap();
            let mut want = c.act(m, n).unwrap();
            c.matmul(&cpu(m, k, x.clone()), &c.matrix(w.clone()).unwrap(), &mut want).unwrap();
            for f32_out in [false, true] {
                let mut og = g.act_poisoned(m, n, f32_out).unwrap();
                g.matmul(&xg, &wg, &mut og).unwrap();
                check(&format!("matmul {name} m{m} f32out {f32_out}"), &g.read_rows(&og, 0).unwrap(), &want.data, 1e-2);
            }
        }
        let toks = [3u32, 0, 199, 42];
        // Plain, and scaled as Gemma's are (√640).
        for scale in [1.0, 25.298_22] {
            let mut eg = g.act_poisoned(4, k, true).unwrap();
            let t = InOrder::new(ferrolm::kv::KvBlocks { full: 1, sliding: 0, head: 0 });
            g.begin(&toks, &[t.span(0, toks.len())], false).unwrap();
            g.embed(&wg, &toks, scale, &mut eg).unwrap();
            let mut ec = c.act(4, k).unwrap();
            c.embed(&c.matrix(w.clone()).unwrap(), &toks, scale, &mut ec).unwrap();
            check(&format!("embed {name} ×{scale}"), &g.read_rows(&eg, 0).unwrap(), &ec.data, 1e-6);
        }
    }
}

/// SmolLM2 on a CUDA device with `cfg`.
pub fn smollm2_cuda(cfg: CudaConfig) -> Decoder<Cuda> {
    let path = ferrolm::hub::default_model().expect("SmolLM2 in the model cache");
    let (mut b, _) = ferrolm::formats::load_with_tokenizer(&path, false).unwrap();
    Decoder::load(Cuda::with_config(0, cfg).unwrap(), &mut b).unwrap()
}

/// The Logits::Last path (slice, norm, head on one row) equals the last row of Logits::All.
#[test]
fn last_row_path_matches_all_rows() {
    let g = gpu();
    let mut r = Rng::seeded();
    let x: Vec<f32> = bf(&r.v(5 * 64, 1.0));
    let a = g.act_from(5, 64, &x).unwrap();
    let s = g.slice_rows(&a, 4).unwrap();
    check("slice_rows", &g.read_rows(&s, 0).unwrap(), &x[4 * 64..], 0.0);
    let (_, mg, _) = smollm2();
    let ids: Vec<u32> = vec![1, 9690, 198, 504, 3575, 282, 4649, 314];
    let mut k1 = mg.new_cache(16).unwrap();
    let all = mg.forward(&ids, 0, &mut k1, Logits::All).unwrap();
    let mut k2 = mg.new_cache(16).unwrap();
    let last = mg.forward(&ids, 0, &mut k2, Logits::Last).unwrap();
    let v = mg.cfg.vocab;
    // The same layers, two roundings of one row's head: Last's is the decode GEMV (int16 x of
    // bf16(g·x), the norm's factor on the row sums), All's the quantized GEMM (bf16 x of the
    // normalized rows, K summed in 256-value chunks): 6.8e-3 apart (H200, docs/perf-log.md
    // Session 30; 2.7e-3 when the GEMM summed K in one run), inside the bf16 paths' 1e-2.
    // (Against the CPU the whole model's drift adds in: 1.2e-2.) A wrong row or a missing
    // norm is O(1).
    check("Last vs All's last row", &last, &all[(ids.len() - 1) * v..], 1e-2);
}

/// Decode steps through `Session` (captured once, then replayed as a CUDA graph, also by
/// the next session of the same capacity) give bit-identical logits to plain forward calls.
#[test]
fn graph_replay_matches_plain_forward() {
    let (_, mg, tok) = smollm2();
    let msgs = [ferrolm::tokenizer::ChatMessage { role: "user".into(), content: "Name three colors.".into() }];
    let ids = tok.encode_chat(&tok.apply_chat_template(&msgs, true).unwrap()).unwrap();
    let mut s = ferrolm::generate::Session::new(&mg, 256).unwrap();
    let (mut l, _) = s.feed(&ids).unwrap();
    let mut kv = mg.new_cache(256).unwrap();
    check("prefill", &l, &mg.forward(&ids, 0, &mut kv, Logits::Last).unwrap(), 0.0);
    for i in 0..20 {
        let t = ferrolm::sample::argmax(&l);
        l = s.step(t).unwrap();
        let lp = mg.forward(&[t], ids.len() + i, &mut kv, Logits::Last).unwrap();
        check(&format!("graph step {i}"), &l, &lp, 0.0);
    }
    // a new session of the same capacity takes the finished one's cache and buffers, and
    // replays its captured step: no new capture, the same logits
    let (id, captures) = (s.id(), mg.backend.captures());
    drop(s);
    let mut s = ferrolm::generate::Session::new(&mg, 256).unwrap();
    assert_eq!(s.id(), id, "the finished session's parts are reused");
    let (mut l, _) = s.feed(&ids[1..]).unwrap();
    let mut kv = mg.new_cache(256).unwrap();
    check("prefill, reused session", &l, &mg.forward(&ids[1..], 0, &mut kv, Logits::Last).unwrap(), 0.0);
    for i in 0..8 {
        let t = ferrolm::sample::argmax(&l);
        l = s.step(t).unwrap();
        let lp = mg.forward(&[t], ids.len() - 1 + i, &mut kv, Logits::Last).unwrap();
        check(&format!("reused session, graph step {i}"), &l, &lp, 0.0);
    }
    assert_eq!(mg.backend.captures(), captures, "the reused session captured no new step");
    drop(s);
    // the greedy step (argmax on the device, its own captured graph) follows plain argmax
    let mut s = ferrolm::generate::Session::new(&mg, 256).unwrap();
    let (l, _) = s.feed(&ids).unwrap();
    let mut kv = mg.new_cache(256).unwrap();
    mg.forward(&ids, 0, &mut kv, Logits::Last).unwrap();
    let mut t = ferrolm::sample::argmax(&l);
    for i in 0..20 {
        let next = s.step_greedy(t).unwrap();
        let lp = mg.forward(&[t], ids.len() + i, &mut kv, Logits::Last).unwrap();
        assert_eq!(next, ferrolm::sample::argmax(&lp), "greedy step {i}");
        t = next;
    }
}

/// Greedy `generate` on CUDA queues fed steps in runs (one graph of k steps, each step's
/// argmax the next step's input on the device, read back one run behind): at every run
/// length it gives the tokens of step-by-step greedy decoding; stopping (a stop token,
/// `on_token` returning false, max_tokens, a full context) hands out exactly the tokens
/// before the stop, mid-run too; and the session's cache stays right for the next turn
/// although speculative steps wrote slots past its tokens.
#[test]
fn fed_greedy_generate_matches_step_by_step() {
    use ferrolm::generate::Session;
    use ferrolm::sample::{Sampler, SamplerConfig};
    let (_, mg, tok) = smollm2();
    assert!(mg.backend.feeds_steps(), "CUDA feeds greedy steps by default");
    let ids = tok.encode("The capital of France is", true).unwrap();
    let greedy = || Sampler::new(SamplerConfig { temperature: 0.0, ..Default::default() });
    // reference: one step at a time, each read back before the next (a session of the
    // same capacity: the attention's splits, so its rounding, follow the cache size)
    let reference = |cap: usize, n: usize| {
        let mut s = Session::new(&mg, cap).unwrap();
        let (l, _) = s.feed(&ids).unwrap();
        let mut want = vec![ferrolm::sample::argmax(&l)];
        while want.len() < n {
            let t = *want.last().unwrap();
            want.push(s.step_greedy(t).unwrap());
        }
        (s, want)
    };
    let (_, want) = reference(256, 80);
    // Runs of 8 steps (the default), 1 (a graph per step) and 3 (runs ending mid-way
    // through the stops below).
    for k in [8, 1, 3] {
        let new = |cap: usize| {
            let mut s = Session::new(&mg, cap).unwrap();
            s.set_feed_steps(k).unwrap();
            s
        };
        let run = |s: &mut Session<'_, _>, prompt: &[u32], max: usize, stop: &[u32], until: usize| {
            let mut got = Vec::new();
            let st = s
                .generate(prompt, max, &mut greedy(), stop, |t| {
                    got.push(t);
                    Ok(got.len() < until)
                })
                .unwrap();
            (got, st)
        };
        // 80 tokens: positions past 64, where the device's token history wraps mid-run
        let mut s = new(256);
        let (got, st) = run(&mut s, &ids, 80, &[], usize::MAX);
        assert_eq!(got, want, "fed greedy tokens, runs of {k}");
        assert_eq!((st.generated, st.stopped_by_eos), (80, false));
        // the last token is handed out but not fed: the cache holds the prompt and 79 tokens
        assert_eq!(s.tokens.len(), ids.len() + 79);
        // a stop token: the tokens before it, and it is not handed out
        let stop_at = 7;
        let mut s = new(256);
        let (got, st) = run(&mut s, &ids, 80, &[want[stop_at]], usize::MAX);
        let first_stop = want.iter().position(|&t| t == want[stop_at]).unwrap();
        assert_eq!(got, want[..first_stop], "tokens before the stop token");
        assert!(st.stopped_by_eos);
        // on_token saying stop, and max_tokens
        let mut s = new(256);
        assert_eq!(run(&mut s, &ids, 40, &[], 5).0, want[..5]);
        let mut s = new(256);
        assert_eq!(run(&mut s, &ids, 3, &[], usize::MAX).0, want[..3]);
        assert_eq!(run(&mut new(256), &ids, 1, &[], usize::MAX).0, want[..1]);
        // a context that fills up: capacity for the prompt and 10 more
        let mut s = new(ids.len() + 10);
        let (got, _) = run(&mut s, &ids, 40, &[], usize::MAX);
        assert_eq!(got, reference(ids.len() + 10, 11).1, "generation stops when the context is full");
        // next turn on the stopped session (its speculative step wrote the slot after its
        // tokens) equals the next turn on a session that fed the same tokens step by step
        let mut s = new(256);
        let (first, _) = run(&mut s, &ids, 40, &[], 5);
        let (mut r, _) = reference(256, 5);
        assert_eq!(s.tokens, r.tokens, "fed tokens after a stop by on_token");
        let mut turn2 = s.tokens.clone();
        turn2.push(first[4]);
        turn2.extend(tok.encode(" Also,", false).unwrap());
        let (a, _) = run(&mut s, &turn2, 12, &[], usize::MAX);
        let (b, _) = run(&mut r, &turn2, 12, &[], usize::MAX);
        assert_eq!(a, b, "second turn after a stopped fed generation, runs of {k}");
    }
}

/// Asking for more device memory than there is gives a clear error, and the device stays
/// usable afterwards.
#[test]
fn out_of_memory_is_a_clear_error() {
    let g = gpu();
    let cfg = attn_cfg(32, 32, 128, 64, RopeStyle::Half);
    // 64 layers × 2 × 1M positions × 4096 × 2 bytes = 1 TiB
    let e = g.kv_store(&cfg, blocks_for(&cfg, 1 << 20)).err().expect("a 1 TiB KV cache cannot fit").to_string();
    assert!(e.contains("out of memory") && e.contains("KV cache"), "{e}");
    let x = g.act_from(1, 4, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(g.read_rows(&x, 0).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
}

/// The device top-k (sample.cu's radix select + ordered compaction) returns exactly the
/// host's candidates (same tokens, same scaled values to the bit, ties to the lower id)
/// on every split it takes (one block; many blocks with slices in shared memory; slices
/// too long for it; a short last slice), and SmolLM2 top-k steps through a session (a captured graph ending in top_k) sample
/// what the host sampler samples from the full logits.
#[test]
fn top_k_matches_cpu() {
    let g = gpu();
    let mut r = Rng::seeded();
    for n in [7, 1000, 5000, 49152, 128256, 128256 + 1017] {
        // coarse values: many exact ties at every k
        let v: Vec<f32> = r.v(n, 8.0).iter().map(|x| (x * 4.0).floor() / 4.0).collect();
        let xg = g.act_from_f32(1, n, &v).unwrap();
        for k in [1, 40, 1000, 1024].into_iter().filter(|&k| k <= n) {
            for inv_t in [1.0f32, 1.0 / 0.7] {
                let mut og = g.act_poisoned(1, 2 * k, true).unwrap();
                g.top_k(&xg, k, inv_t, &mut og).unwrap();
                let got = g.read_rows(&og, 0).unwrap();
                let mut got: Vec<(u32, f32)> = got.chunks(2).map(|p| (p[0] as u32, p[1])).collect();
                got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let mut want = Vec::new();
                ferrolm::sample::top_k_into(&v, k, inv_t, &mut want);
                let bits = |c: &[(u32, f32)]| c.iter().map(|&(i, s)| (i, s.to_bits())).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "top-k n {n} k {k} inv_t {inv_t}");
            }
        }
    }
    let (_, mg, tok) = smollm2();
    let ids = tok.encode("The capital of France is", true).unwrap();
    let sc = ferrolm::sample::SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 3, ..Default::default() };
    let (mut sa, mut sb) = (ferrolm::sample::Sampler::new(sc.clone()), ferrolm::sample::Sampler::new(sc));
    let mut a = ferrolm::generate::Session::new(&mg, 128).unwrap();
    let mut b = ferrolm::generate::Session::new(&mg, 128).unwrap();
    let (mut l, _) = a.feed(&ids).unwrap();
    b.feed(&ids).unwrap();
    let mut t = sa.sample(&mut l.clone(), &[]);
    sb.sample(&mut l.clone(), &[]);
    for i in 0..24 {
        l = a.step(t).unwrap();
        let want = sa.sample(&mut l.clone(), &[]);
        let got = sb.sample_candidates(&b.step_top_k(t, 40, 1.0 / 0.8).unwrap());
        assert_eq!(got, want, "SmolLM2 top-k step {i}");
        t = want;
    }
}

/// The kernel timeline (`CudaConfig::trace`, trace.rs): a traced device records, for a prompt and
/// greedy decode steps, launches that each start before they end, an embedding per step
/// and the GEMVs' pdl_wait releases, and writes them when dropped. The greedy tokens are
/// the untraced device's (tracing changes no result).
#[test]
fn kernel_trace_records_decode_steps() {
    use ferrolm::generate::Session;
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.bin");
    let path_mb = ferrolm::hub::default_model().expect("SmolLM2 in the model cache");
    let ids: Vec<u32>;
    let mut tokens = Vec::new();
    {
        let cuda = Cuda::with_config(0, CudaConfig { trace: Some(path.clone()), ..CudaConfig::default() });
        let (mut w, tok) = ferrolm::formats::load_with_tokenizer(&path_mb, false).unwrap();
        let mg = Decoder::load(cuda.unwrap(), &mut w).unwrap();
        ids = tok.encode("The capital of France is", true).unwrap();
        let mut s = Session::new(&mg, 128).unwrap();
        let (l, _) = s.feed(&ids).unwrap();
        let mut t = ferrolm::sample::argmax(&l);
        for _ in 0..8 {
            tokens.push(t);
            t = s.step_greedy(t).unwrap();
        }
    } // the traced device is dropped here and writes the file
    let (_, mg, _) = smollm2();
    let mut s = Session::new(&mg, 128).unwrap();
    let (l, _) = s.feed(&ids).unwrap();
    let mut want = vec![ferrolm::sample::argmax(&l)];
    while want.len() < tokens.len() {
        let t = *want.last().unwrap();
        want.push(s.step_greedy(t).unwrap());
    }
    assert_eq!(tokens, want, "greedy tokens with the trace on differ from those without");

    let data = std::fs::read(&path).expect("the traced device wrote its trace file");
    let word = |i: usize| u64::from_le_bytes(data[8 * i..8 * i + 8].try_into().unwrap());
    let n = word(0) as usize;
    assert_eq!(data.len(), 8 * (1 + 2 * n), "trace file size");
    // grid id -> (file, first start, last end, waits)
    let mut launches: HashMap<u64, (u64, u64, u64, usize)> = HashMap::new();
    for i in 0..n {
        let (t, meta) = (word(1 + 2 * i), word(2 + 2 * i));
        let (grid, file, ev) = (meta >> 36, (meta >> 32) & 0xf, (meta >> 20) & 3);
        let e = launches.entry(grid).or_insert((0, u64::MAX, 0, 0));
        match ev {
            0 => (e.0, e.1) = (file, e.1.min(t)),
            1 => e.3 += 1,
            2 => e.2 = e.2.max(t),
            _ => panic!("record {i}: event {ev}"),
        }
    }
    // Replays of a captured graph reuse its launches' grid ids (measured on the H200), so
    // launches are counted by their start records: the embedding is one block, block 0,
    // which is sampled.
    let embeds = (0..n).filter(|&i| (word(2 + 2 * i) >> 32) & 0xf == 4 && (word(2 + 2 * i) >> 20) & 3 == 0).count();
    assert!(embeds >= 9, "{embeds} embedding launches for a prompt and 8 decode steps");
    for (g, (file, start, end, _)) in &launches {
        assert!(*file >= 1 && *file <= 5, "launch {g}: file id {file}");
        assert!(start <= end && *end > 0, "launch {g} ends ({end}) before it starts ({start})");
    }
    let waited = launches.values().filter(|l| l.0 == 1 && l.3 > 0).count();
    assert!(waited > 0, "no GEMV launch recorded a pdl_wait release");
    eprintln!("trace: {n} records, {} grid ids, {embeds} embeddings", launches.len());
}
