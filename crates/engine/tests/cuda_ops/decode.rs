//! The fused decode GEMVs at the Llama-3.2-1B shapes (4-bit, group 64, bf16 scales; random
//! weights): parity with the CPU composition, then the time per launch inside a captured
//! graph, as a decode step runs them (launch gaps and PDL overlap included). Timed launches
//! cycle over 16 device copies of the weights, as a decode step walks 16 layers: one copy
//! would stay in the 50 MB L2 and time L2, not HBM (`FERROLM_WEIGHT_COPIES=1` times that
//! on purpose). The timings are printed for the record, never asserted.

use super::{bf, cpu, gpu, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::cuda::Cuda;
use ferrolm::backend::Backend;
use ferrolm::quant::{AffineTensor, ScaleDtype, Weight};

fn mat(g: &Cuda, r: &mut Rng, rows: usize, cols: usize) -> (ferrolm::backend::cuda::CudaMat, Weight) {
    let w =
        Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, 4, 64, ScaleDtype::BF16).unwrap());
    (g.matrix(w.clone()).unwrap(), w)
}

/// Device copies of a weight the timed launches cycle over (layers of a decode step): 16,
/// or `FERROLM_WEIGHT_COPIES` (1 keeps a matrix in L2: what an L2-resident weight would
/// cost, the ceiling of any L2 prefetch).
fn n_copies() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("FERROLM_WEIGHT_COPIES").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(16)
    })
}

fn copies(g: &Cuda, w: &Weight) -> Vec<ferrolm::backend::cuda::CudaMat> {
    (0..n_copies()).map(|_| g.matrix(w.clone()).unwrap()).collect()
}

/// Mean µs per call of `f(i)` over `n` calls (i = 0..n) captured into one graph (after a
/// warm-up replay).
fn graph_time(g: &Cuda, n: usize, f: &mut dyn FnMut(usize)) -> f64 {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    f(0); // kernels loaded and compiled outside the capture
    g.stream.synchronize().unwrap();
    g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    for i in 0..n {
        f(i);
    }
    let graph = g.stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
    graph.launch().unwrap();
    g.stream.synchronize().unwrap();
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        graph.launch().unwrap();
        g.stream.synchronize().unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
    times.sort_by(f64::total_cmp);
    times[2]
}

/// The parity check; `FERROLM_TIMING_ONLY=1` skips it (and says so) for timing kernel
/// experiments that compute something else (e.g. a memory-only variant of the GEMV).
fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    if std::env::var("FERROLM_TIMING_ONLY").is_ok_and(|v| v == "1") {
        eprintln!("{what}: parity NOT checked (FERROLM_TIMING_ONLY=1)");
        return;
    }
    super::check(what, got, want, tol)
}

fn report(what: &str, us: f64, bytes: usize) {
    eprintln!("{what}: {us:.2} µs per launch, {:.0} GB/s of weights", bytes as f64 / us / 1e3);
}

/// Both GEMV feeds (register tiles, and the shared-memory ring fed by bulk copies) at the
/// 1B shapes; the ring's lines say "[ring]".
#[test]
fn decode_gemvs_at_1b_shapes_match_cpu_and_time_them() {
    let g = gpu();
    let before = g.gemv_ring();
    for ring in [false, true] {
        g.set_gemv_ring(ring);
        gemvs_at_1b_shapes(if ring { " [ring]" } else { "" });
    }
    g.set_gemv_ring(before);
}

fn gemvs_at_1b_shapes(feed: &str) {
    let (g, c, mut r) = (gpu(), Cpu, Rng::seeded());
    let report = |what: &str, us: f64, bytes: usize| report(&format!("{what}{feed}"), us, bytes);
    let check = |what: &str, got: &[f32], want: &[f32], tol: f64| check(&format!("{what}{feed}"), got, want, tol);
    let (d, kvd, f, vocab) = (2048, 512, 8192, 128256);
    let x = r.v(d, 20.0);
    let norm = r.v(d, 1.0);
    let (xg, xc) = (g.act_from_f32(1, d, &x).unwrap(), cpu(1, d, x.clone()));
    let ng = g.vector(norm.clone()).unwrap();
    let (mut xn, mut xnc) = (g.act(1, d).unwrap(), c.act(1, d).unwrap());
    let bytes = |ws: &[&Weight]| ws.iter().map(|w| w.byte_size()).sum::<usize>();

    // norm → q/k/v (one launch)
    let (wq, wk, wv) = (mat(g, &mut r, d, d), mat(g, &mut r, kvd, d), mat(g, &mut r, kvd, d));
    let mut og: Vec<_> = [d, kvd, kvd].iter().map(|&n| g.act_poisoned(1, n, false).unwrap()).collect();
    let mut oc: Vec<_> = [d, kvd, kvd].iter().map(|&n| c.act(1, n).unwrap()).collect();
    {
        let [a, b, e] = &mut og[..] else { unreachable!() };
        g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wq.0, &wk.0, &wv.0], &mut [a, b, e]).unwrap();
        let [a, b, e] = &mut oc[..] else { unreachable!() };
        c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wq.1, &wk.1, &wv.1], &mut [a, b, e]).unwrap();
    }
    for (i, (a, b)) in og.iter().zip(&oc).enumerate() {
        check(&format!("1B norm→qkv[{i}]"), &g.read_rows(a, 0).unwrap(), &b.data, 1e-2);
    }
    let (cq, ck, cv) = (copies(g, &wq.1), copies(g, &wk.1), copies(g, &wv.1));
    let us = graph_time(g, 48, &mut |i| {
        let [a, b, e] = &mut og[..] else { unreachable!() };
        let j = i % n_copies();
        g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&cq[j], &ck[j], &cv[j]], &mut [a, b, e]).unwrap();
    });
    report("1B norm→q/k/v 2048+512+512×2048", us, bytes(&[&wq.1, &wk.1, &wv.1]));

    // o: GEMV + residual add
    let wo = mat(g, &mut r, d, d);
    let y = bf(&r.v(d, 1.0));
    let yg = g.act_from(1, d, &y).unwrap();
    let mut rg = g.act_from_f32(1, d, &x).unwrap();
    let mut tmp = g.act(1, d).unwrap();
    g.matmul_add(&yg, &wo.0, &mut rg, &mut tmp).unwrap();
    let (mut rc, mut tmpc) = (xc.clone(), c.act(1, d).unwrap());
    c.matmul_add(&cpu(1, d, y), &wo.1, &mut rc, &mut tmpc).unwrap();
    let delta = |v: Vec<f32>| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
    check("1B o + residual", &delta(g.read_rows(&rg, 0).unwrap()), &delta(rc.data), 1e-2);
    let co = copies(g, &wo.1);
    let us = graph_time(g, 48, &mut |i| g.matmul_add(&yg, &co[i % n_copies()], &mut rg, &mut tmp).unwrap());
    report("1B o 2048×2048 + add", us, bytes(&[&wo.1]));

    // norm → gate/up → SwiGLU (one launch)
    let (wg, wu) = (mat(g, &mut r, f, d), mat(g, &mut r, f, d));
    let (mut gg, mut ug, mut sg) = (g.act(1, f).unwrap(), g.act(1, f).unwrap(), g.act_poisoned(1, f, false).unwrap());
    g.norm_swiglu(&xg, &ng, 1e-5, &mut xn, &wg.0, &wu.0, &mut gg, &mut ug, &mut sg).unwrap();
    let (mut gc, mut uc, mut sc) = (c.act(1, f).unwrap(), c.act(1, f).unwrap(), c.act(1, f).unwrap());
    c.norm_swiglu(&xc, &norm, 1e-5, &mut xnc, &wg.1, &wu.1, &mut gc, &mut uc, &mut sc).unwrap();
    check("1B norm→gate/up→SwiGLU", &g.read_rows(&sg, 0).unwrap(), &sc.data, 1e-2);
    let (cg, cu) = (copies(g, &wg.1), copies(g, &wu.1));
    let us = graph_time(g, 48, &mut |i| {
        let j = i % n_copies();
        g.norm_swiglu(&xg, &ng, 1e-5, &mut xn, &cg[j], &cu[j], &mut gg, &mut ug, &mut sg).unwrap()
    });
    report("1B norm→gate/up 2×8192×2048 →SwiGLU", us, bytes(&[&wg.1, &wu.1]));

    // down: GEMV + residual add
    let wd = mat(g, &mut r, d, f);
    let y = bf(&r.v(f, 1.0));
    let yg = g.act_from(1, f, &y).unwrap();
    let mut rg = g.act_from_f32(1, d, &x).unwrap();
    g.matmul_add(&yg, &wd.0, &mut rg, &mut tmp).unwrap();
    let mut rc = xc.clone();
    c.matmul_add(&cpu(1, f, y), &wd.1, &mut rc, &mut tmpc).unwrap();
    check("1B down + residual", &delta(g.read_rows(&rg, 0).unwrap()), &delta(rc.data), 1e-2);
    let cd = copies(g, &wd.1);
    let us = graph_time(g, 48, &mut |i| g.matmul_add(&yg, &cd[i % n_copies()], &mut rg, &mut tmp).unwrap());
    report("1B down 2048×8192 + add", us, bytes(&[&wd.1]));

    // The MLP split along the FFN dimension (one launch, ffn_splitk.cuh): norm → gate/up →
    // SwiGLU → down + residual add, against the CPU's norm_swiglu then matmul_add. Its grid:
    // the most blocks in co-resident clusters of 8, 4 or 2 (Cuda::splitk_grid).
    if feed.is_empty() {
        let mut rg = g.act_from_f32(1, d, &x).unwrap();
        let mut act = g.act_poisoned(1, f, false).unwrap();
        assert!(g.ffn_splitk(&mut rg, (&ng, 1e-5), (&wg.0, &wu.0, &wd.0), &mut act).unwrap(), "split-K MLP ran");
        let (mut rc, mut tmpc) = (xc.clone(), c.act(1, d).unwrap());
        c.norm_swiglu(&xc, &norm, 1e-5, &mut xnc, &wg.1, &wu.1, &mut gc, &mut uc, &mut sc).unwrap();
        c.matmul_add(&sc, &wd.1, &mut rc, &mut tmpc).unwrap();
        check("1B split-K MLP + residual", &delta(g.read_rows(&rg, 0).unwrap()), &delta(rc.data), 1e-2);
        check("1B split-K MLP act", &g.read_rows(&act, 0).unwrap(), &sc.data, 1e-2);
        // Each copy's down scales transposed (once per matrix, outside any capture).
        for j in 0..n_copies() {
            assert!(g.ffn_splitk(&mut rg, (&ng, 1e-5), (&cg[j], &cu[j], &cd[j]), &mut act).unwrap());
        }
        let us = graph_time(g, 48, &mut |i| {
            let j = i % n_copies();
            assert!(g.ffn_splitk(&mut rg, (&ng, 1e-5), (&cg[j], &cu[j], &cd[j]), &mut act).unwrap());
        });
        report("1B split-K MLP (gate/up→SwiGLU→down + add, one launch)", us, bytes(&[&wg.1, &wu.1, &wd.1]));
        let us = graph_time(g, 48, &mut |i| {
            let j = i % n_copies();
            g.norm_swiglu(&rg, &ng, 1e-5, &mut xn, &cg[j], &cu[j], &mut gg, &mut ug, &mut sg).unwrap();
            g.matmul_add(&sg, &cd[j], &mut rg, &mut tmp).unwrap();
        });
        report("1B MLP as two launches (norm→gate/up→SwiGLU, down + add)", us, bytes(&[&wg.1, &wu.1, &wd.1]));
    }

    // A whole layer as the decode step runs it (norm→q/k/v, attention over 512 cached
    // positions with RoPE, o + add, norm→gate/up→SwiGLU, down + add), over 16 layers.
    {
        use ferrolm::backend::Rope;
        use ferrolm::config::RopeStyle;
        let (heads, n_kv, hd, pos) = (32, 8, 64, 512);
        let cfg = super::attn_cfg(heads, n_kv, hd, n_copies(), RopeStyle::Interleaved);
        let rope = Rope { inv_freq: cfg.rope_inv_freq(), style: RopeStyle::Interleaved, linear: 1.0 };
        let mut kv = g.kv_cache(&cfg, 640).unwrap();
        let mut att = g.act(1, d).unwrap();
        let mut resid = g.act_from_f32(1, d, &x).unwrap();
        g.begin(&[], pos).unwrap();
        let us = graph_time(g, 48, &mut |i| {
            let j = i % n_copies();
            let [q, k, v] = &mut og[..] else { unreachable!() };
            g.norm_matmul_many(&resid, &ng, 1e-5, &mut xn, &[&cq[j], &ck[j], &cv[j]], &mut [q, k, v]).unwrap();
            g.rope_attention(q, k, v, &mut kv, j, pos, &rope, (heads, n_kv), &mut att).unwrap();
            g.matmul_add(&att, &co[j], &mut resid, &mut tmp).unwrap();
            g.norm_swiglu(&resid, &ng, 1e-5, &mut xn, &cg[j], &cu[j], &mut gg, &mut ug, &mut sg).unwrap();
            g.matmul_add(&sg, &cd[j], &mut resid, &mut tmp).unwrap();
        });
        let layer_bytes = bytes(&[&wq.1, &wk.1, &wv.1, &wo.1, &wg.1, &wu.1, &wd.1]);
        report("1B whole layer (5 launches, 512 cached)", us, layer_bytes);
    }

    // final norm → head (f32 logits)
    let wh = mat(g, &mut r, vocab, d);
    let mut hg = g.act_poisoned(1, vocab, true).unwrap();
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wh.0], &mut [&mut hg]).unwrap();
    let mut hc = c.act(1, vocab).unwrap();
    c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wh.1], &mut [&mut hc]).unwrap();
    check("1B norm→head", &g.read_rows(&hg, 0).unwrap(), &hc.data, 1e-2);
    let us = graph_time(g, 20, &mut |_| g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wh.0], &mut [&mut hg]).unwrap());
    report("1B norm→head 128256×2048", us, bytes(&[&wh.1]));
}

/// Decode attention at the 1B shape (32 query / 8 kv heads of 64) over 512 and 8191 cached
/// positions (caches sized as `ferrolm bench` sizes them): time per launch in a graph.
/// Correctness is rope_attention_matches_cpu's.
#[test]
fn decode_attention_at_1b_shape_time() {
    use ferrolm::backend::Rope;
    use ferrolm::config::RopeStyle;
    let (g, mut r) = (gpu(), Rng::seeded());
    let (heads, n_kv, hd) = (32, 8, 64);
    let cfg = super::attn_cfg(heads, n_kv, hd, n_copies(), RopeStyle::Interleaved);
    let rope = Rope { inv_freq: cfg.rope_inv_freq(), style: RopeStyle::Interleaved, linear: 1.0 };
    for (pos, cache) in [(512, 640), (8191, 8320)] {
        let mut kv = g.kv_cache(&cfg, cache).unwrap(); // 16 layers: one per timed launch
        let mut q = g.act_from(1, heads * hd, &bf(&r.v(heads * hd, 1.0))).unwrap();
        let mut k = g.act_from(1, n_kv * hd, &bf(&r.v(n_kv * hd, 1.0))).unwrap();
        let v = g.act_from(1, n_kv * hd, &bf(&r.v(n_kv * hd, 1.0))).unwrap();
        let mut out = g.act(1, heads * hd).unwrap();
        g.begin(&[], pos).unwrap();
        let us = graph_time(g, 48, &mut |i| {
            g.rope_attention(&mut q, &mut k, &v, &mut kv, i % n_copies(), pos, &rope, (heads, n_kv), &mut out).unwrap()
        });
        let bytes = 2 * (pos + 1) * n_kv * hd * 2;
        eprintln!(
            "1B decode attention at {pos} cached: {us:.2} µs per launch, {:.0} GB/s of K/V",
            bytes as f64 / us / 1e3
        );
    }
}

/// Device top-k over a 128K vocabulary (the sampled step's last launch) and device argmax
/// (the greedy step's): time per launch in a graph. Correctness is top_k_matches_cpu's.
#[test]
fn decode_sampling_time() {
    let (g, mut r) = (gpu(), Rng::seeded());
    let vocab = 128256;
    let x = g.act_from_f32(1, vocab, &r.v(vocab, 10.0)).unwrap();
    let mut am = g.act_poisoned(1, 1, true).unwrap();
    let us = graph_time(g, 48, &mut |_| g.argmax(&x, &mut am).unwrap());
    eprintln!("argmax over {vocab}: {us:.2} µs per launch");
    for k in [40, 1024] {
        let mut out = g.act_poisoned(1, 2 * k, true).unwrap();
        let us = graph_time(g, 48, &mut |_| g.top_k(&x, k, 1.0 / 0.8, &mut out).unwrap());
        eprintln!("top-{k} over {vocab}: {us:.2} µs per launch");
    }
}

/// The fused layer end (gemv.cu's ffn: [o + add,] gate/up→SwiGLU, then down + add, the
/// blocks counting themselves in between phases) against the separate launches it
/// replaces: bit-identical residual and SwiGLU output (same row math), on repeated launches
/// (its counters reset), with and without the o phase, for the 1B and SmolLM2 shapes and
/// other formats; then the three ways timed at the 1B shape.
#[test]
fn fused_layer_end_matches_separate_launches_and_times_it() {
    use ferrolm::backend::cuda::ffn::LayerEndFusion;
    use ferrolm::backend::cuda::CudaMat;
    // A device of its own: the fusion is switched here.
    let (g, mut r) = (Cuda::new(0).unwrap(), Rng::seeded());
    let shapes = [
        (2048, 2048, 8192, 4, 64, ScaleDtype::BF16),
        (576, 576, 1536, 4, 64, ScaleDtype::BF16),
        (512, 1024, 1024, 8, 32, ScaleDtype::F16),
        (256, 512, 768, 2, 16, ScaleDtype::F32),
    ];
    for (d, qd, f, bits, group, dt) in shapes {
        let name = format!("d{d} q{qd} f{f} q{bits} g{group} {dt:?}");
        let mut mat = |rows: usize, cols: usize| {
            let w = AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, bits, group, dt).unwrap();
            g.matrix(Weight::Affine(w)).unwrap()
        };
        let (wo, wg, wu, wd): (CudaMat, CudaMat, CudaMat, CudaMat) = (mat(d, qd), mat(f, d), mat(f, d), mat(d, f));
        let x = r.v(d, 20.0);
        let att = g.act_from(1, qd, &bf(&r.v(qd, 1.0))).unwrap();
        let ng = g.vector(r.v(d, 1.0)).unwrap();
        let (mut xn, mut gg, mut ug, mut tmp) =
            (g.act(1, d).unwrap(), g.act(1, f).unwrap(), g.act(1, f).unwrap(), g.act(1, d).unwrap());
        g.set_layer_end_fusion(LayerEndFusion::None);
        let mut xa = g.act_from_f32(1, d, &x).unwrap();
        let mut aa = g.act_poisoned(1, f, false).unwrap();
        let scratch = (&mut xn, &mut gg, &mut ug, &mut tmp);
        g.o_proj_mlp(&att, &wo, &mut xa, (&ng, 1e-5), (&wg, &wu, &wd), scratch, &mut aa).unwrap();
        let (want_x, want_act) = (g.read_rows(&xa, 0).unwrap(), g.read_rows(&aa, 0).unwrap());
        let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (with_o, run) in [(true, 0), (false, 1), (true, 2), (false, 3)] {
            let mut xb = g.act_from_f32(1, d, &x).unwrap();
            let mut ab = g.act_poisoned(1, f, false).unwrap();
            if !with_o {
                g.matmul_add(&att, &wo, &mut xb, &mut tmp).unwrap();
            }
            let o = with_o.then_some((&att, &wo));
            let fused = g.ffn_fused(&mut xb, o, (&ng, 1e-5), (&wg, &wu, &wd), &mut ab).unwrap();
            assert!(fused, "{name}: fused layer end declined (o phase: {with_o})");
            let what = format!("{name} run {run} (o phase: {with_o})");
            assert_eq!(bits_of(&g.read_rows(&xb, 0).unwrap()), bits_of(&want_x), "{what}: residual");
            assert_eq!(bits_of(&g.read_rows(&ab, 0).unwrap()), bits_of(&want_act), "{what}: SwiGLU");
        }
    }
    // Timing at the 1B shape, cycling over weight copies as the layers of a step do.
    let (d, f) = (2048, 8192);
    let w = |rows: usize, cols: usize, r: &mut Rng| {
        Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, 4, 64, ScaleDtype::BF16).unwrap())
    };
    let (wo, wg, wu, wd) = (w(d, d, &mut r), w(f, d, &mut r), w(f, d, &mut r), w(d, f, &mut r));
    let bytes = wo.byte_size() + wg.byte_size() + wu.byte_size() + wd.byte_size();
    let (co, cg, cu, cd) = (copies(&g, &wo), copies(&g, &wg), copies(&g, &wu), copies(&g, &wd));
    let ng = g.vector(r.v(d, 1.0)).unwrap();
    let att = g.act_from(1, d, &bf(&r.v(d, 1.0))).unwrap();
    let mut xg = g.act_from_f32(1, d, &r.v(d, 20.0)).unwrap();
    let (mut xn, mut gg, mut ug, mut tmp, mut act) =
        (g.act(1, d).unwrap(), g.act(1, f).unwrap(), g.act(1, f).unwrap(), g.act(1, d).unwrap(), g.act(1, f).unwrap());
    for fusion in [LayerEndFusion::None, LayerEndFusion::Mlp, LayerEndFusion::OProjMlp] {
        g.set_layer_end_fusion(fusion);
        let us = graph_time(&g, 48, &mut |i| {
            let j = i % n_copies();
            let scratch = (&mut xn, &mut gg, &mut ug, &mut tmp);
            g.o_proj_mlp(&att, &co[j], &mut xg, (&ng, 1e-5), (&cg[j], &cu[j], &cd[j]), scratch, &mut act).unwrap()
        });
        report(&format!("1B o + add, norm→gate/up→SwiGLU, down + add; fused: {fusion:?}"), us, bytes);
    }
}

/// The fused decode ops (norm→q/k/v in one launch, norm→gate/up→SwiGLU, GEMV + residual
/// add, norm→head, RoPE + cache write + attention with its merge, argmax) against the CPU
/// backend's reference compositions, for one token and every weight format family (always
/// checked: `super::check`, which FERROLM_TIMING_ONLY does not skip).
#[test]
fn fused_decode_ops_match_cpu() {
    let mut r = Rng::seeded();
    let formats = [
        (4, 32, ScaleDtype::F16),
        (4, 128, ScaleDtype::F32),
        (8, 32, ScaleDtype::F16),
        (8, 64, ScaleDtype::BF16),
        (2, 16, ScaleDtype::BF16),
        (2, 64, ScaleDtype::F16),
    ];
    for (bits, group, dt) in formats {
        fused_decode_ops_case(&mut r, (512, 512, 128, 1024), bits, group, dt);
    }
    // The 1B shape's rows (2048 wide, 8192 for down), where down splits its chunks over
    // two warps (gemv.cu's K slices; FERROLM_GEMV_KS=0 turns them off).
    fused_decode_ops_case(&mut r, (2048, 2048, 512, 8192), 4, 64, ScaleDtype::BF16);
    let g = gpu();
    // argmax, ties to the lowest index
    for n in [7, 1000, 49152, 128256] {
        let mut v = r.v(n, 10.0);
        v[n / 3] = 50.0;
        v[n / 2] = 50.0;
        let mut og = g.act_poisoned(1, 1, true).unwrap();
        g.argmax(&g.act_from_f32(1, n, &v).unwrap(), &mut og).unwrap();
        let got = g.read_rows(&og, 0).unwrap()[0];
        assert_eq!(got as u32, ferrolm::sample::argmax(&v), "argmax over {n}");
    }
}

/// One format's fused decode GEMVs (norm → q/k/v, norm → head, norm → SwiGLU, o and down
/// adding into the residual) against the CPU, at dims (hidden, q rows, kv rows, ffn).
fn fused_decode_ops_case(r: &mut Rng, dims: (usize, usize, usize, usize), bits: u32, group: usize, dt: ScaleDtype) {
    let (g, c) = (gpu(), Cpu);
    let (d, qd, kvd, f) = dims;
    let name = format!("q{bits} g{group} {dt:?} {d}x{f}");
    let mut mat = |rows: usize, cols: usize| {
        let w = Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, bits, group, dt).unwrap());
        (g.matrix(w.clone()).unwrap(), w)
    };
    let (wq, wk, wv, wg, wu, wd, wo) =
        (mat(qd, d), mat(kvd, d), mat(kvd, d), mat(f, d), mat(f, d), mat(d, f), mat(d, qd));
    let x = r.v(d, 20.0); // the f32 residual stream
    let norm = r.v(d, 1.0);
    let (xg, xc) = (g.act_from_f32(1, d, &x).unwrap(), cpu(1, d, x.clone()));
    let ng = g.vector(norm.clone()).unwrap();
    // norm → q/k/v
    let mut outs_g: Vec<_> = [qd, kvd, kvd].iter().map(|&n| g.act_poisoned(1, n, false).unwrap()).collect();
    let mut outs_c: Vec<_> = [qd, kvd, kvd].iter().map(|&n| c.act(1, n).unwrap()).collect();
    let [og0, og1, og2] = &mut outs_g[..] else { unreachable!() };
    let mut xn = g.act(1, d).unwrap();
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wq.0, &wk.0, &wv.0], &mut [og0, og1, og2]).unwrap();
    let [oc0, oc1, oc2] = &mut outs_c[..] else { unreachable!() };
    let mut xnc = c.act(1, d).unwrap();
    c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wq.1, &wk.1, &wv.1], &mut [oc0, oc1, oc2]).unwrap();
    for (i, (a, b)) in outs_g.iter().zip(&outs_c).enumerate() {
        super::check(&format!("norm→qkv[{i}] {name}"), &g.read_rows(a, 0).unwrap(), &b.data, 1e-2);
    }
    // norm → head (f32 out)
    let mut hg = g.act_poisoned(1, f, true).unwrap();
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wg.0], &mut [&mut hg]).unwrap();
    let mut hc = c.act(1, f).unwrap();
    c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wg.1], &mut [&mut hc]).unwrap();
    super::check(&format!("norm→head f32 {name}"), &g.read_rows(&hg, 0).unwrap(), &hc.data, 1e-2);
    // norm → gate/up → SwiGLU
    let (mut gg, mut ug, mut sg) = (g.act(1, f).unwrap(), g.act(1, f).unwrap(), g.act_poisoned(1, f, false).unwrap());
    g.norm_swiglu(&xg, &ng, 1e-5, &mut xn, &wg.0, &wu.0, &mut gg, &mut ug, &mut sg).unwrap();
    let (mut gc, mut uc, mut sc) = (c.act(1, f).unwrap(), c.act(1, f).unwrap(), c.act(1, f).unwrap());
    c.norm_swiglu(&xc, &norm, 1e-5, &mut xnc, &wg.1, &wu.1, &mut gc, &mut uc, &mut sc).unwrap();
    super::check(&format!("norm→swiglu {name}"), &g.read_rows(&sg, 0).unwrap(), &sc.data, 1e-2);
    // GEMV + residual add (down: d × f, o: d × qd): compare the added part (the residual
    // itself is exact)
    let delta = |v: Vec<f32>| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
    for (what, n, w) in [("down", f, &wd), ("o", qd, &wo)] {
        let y = bf(&r.v(n, 1.0));
        let mut rg = g.act_from_f32(1, d, &x).unwrap();
        let mut tmp = g.act(1, d).unwrap();
        g.matmul_add(&g.act_from(1, n, &y).unwrap(), &w.0, &mut rg, &mut tmp).unwrap();
        let mut rc = xc.clone();
        let mut tmpc = c.act(1, d).unwrap();
        c.matmul_add(&cpu(1, n, y), &w.1, &mut rc, &mut tmpc).unwrap();
        super::check(&format!("matmul_add {what} {name}"), &delta(g.read_rows(&rg, 0).unwrap()), &delta(rc.data), 1e-2);
    }
}

/// The decode MLP with down's x staged by the SwiGLU launch (staged.rs, x_staged.cuh) is
/// bit-identical to the separate launches (residual and SwiGLU output), and matches the
/// CPU's MLP, at the 1B shape and in other weight formats; SmolLM2's 1536-wide MLP is
/// not staged (measured slower).
#[test]
fn mlp_staged_x_is_bit_identical() {
    // A device of its own: staging is switched here.
    let (g, c, mut r) = (Cuda::new(0).unwrap(), Cpu, Rng::seeded());
    let shapes = [
        (2048, 8192, 4, 64, ScaleDtype::BF16, true),
        (576, 4096, 4, 32, ScaleDtype::F16, true),
        (512, 4096, 8, 32, ScaleDtype::F16, true),
        (256, 4608, 2, 16, ScaleDtype::F32, true),
        (576, 1536, 4, 64, ScaleDtype::BF16, false),
    ];
    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (d, f, bits, group, dt, staged_here) in shapes {
        let name = format!("d{d} f{f} q{bits} g{group} {dt:?}");
        let mut mat = |rows: usize, cols: usize| {
            let w =
                Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, bits, group, dt).unwrap());
            (g.matrix(w.clone()).unwrap(), w)
        };
        let (wg, wu, wd) = (mat(f, d), mat(f, d), mat(d, f));
        let (x, norm) = (r.v(d, 20.0), r.v(d, 1.0));
        let ng = g.vector(norm.clone()).unwrap();
        let run = |staged: bool| {
            g.set_staged_x(staged);
            let before = g.staged_x_launches();
            let mut xg = g.act_from_f32(1, d, &x).unwrap();
            let mut act = g.act_poisoned(1, f, false).unwrap();
            let (mut xn, mut gg, mut ug, mut tmp) =
                (g.act(1, d).unwrap(), g.act(1, f).unwrap(), g.act(1, f).unwrap(), g.act(1, d).unwrap());
            let scratch = (&mut xn, &mut gg, &mut ug, &mut tmp);
            g.mlp(&mut xg, (&ng, 1e-5), (&wg.0, &wu.0, &wd.0), scratch, &mut act).unwrap();
            let taken = g.staged_x_launches() - before;
            assert_eq!(taken, usize::from(staged && staged_here), "{name}: staged path taken (asked: {staged})");
            (g.read_rows(&xg, 0).unwrap(), g.read_rows(&act, 0).unwrap())
        };
        let (want_x, want_act) = run(false);
        let (got_x, got_act) = run(true);
        assert_eq!(bits_of(&got_x), bits_of(&want_x), "{name}: residual");
        assert_eq!(bits_of(&got_act), bits_of(&want_act), "{name}: SwiGLU");
        // And the CPU's MLP (the added part; the residual itself is exact).
        let mut xc = cpu(1, d, x.clone());
        let (mut xn, mut gc, mut uc, mut tmp, mut ac) = (
            c.act(1, d).unwrap(),
            c.act(1, f).unwrap(),
            c.act(1, f).unwrap(),
            c.act(1, d).unwrap(),
            c.act(1, f).unwrap(),
        );
        c.mlp(&mut xc, (&norm, 1e-5), (&wg.1, &wu.1, &wd.1), (&mut xn, &mut gc, &mut uc, &mut tmp), &mut ac).unwrap();
        let delta = |v: &[f32]| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
        super::check(&format!("staged MLP {name}"), &delta(&got_x), &delta(&xc.data), 1e-2);
    }
}

/// The head with its argmax in one launch (head.rs) stores the same logits, bit for bit, as
/// the head alone, and gives the argmax of what it stored (ties to the lowest index: a head
/// of identical rows has every logit equal), at the 1B and SmolLM2 head shapes.
#[test]
fn head_argmax_matches_separate_launches() {
    // A device of its own: the fusion is switched here.
    let (g, mut r) = (Cuda::new(0).unwrap(), Rng::seeded());
    let shapes = [
        (2048, 128256, 4, 64, ScaleDtype::BF16, false),
        (576, 49152, 4, 32, ScaleDtype::F16, false),
        (512, 16384, 8, 64, ScaleDtype::BF16, false),
        (512, 16384, 4, 64, ScaleDtype::BF16, true),
    ];
    for (d, vocab, bits, group, dt, ties) in shapes {
        let name = format!("d{d} V{vocab} q{bits} g{group} {dt:?}{}", if ties { " (identical rows)" } else { "" });
        let w = match ties {
            true => r.v(d, 0.05).repeat(vocab),
            false => r.v(vocab * d, 0.05),
        };
        let head = g.matrix(Weight::Affine(AffineTensor::quantize(&w, vocab, d, bits, group, dt).unwrap())).unwrap();
        let (x, ng) = (g.act_from_f32(1, d, &r.v(d, 20.0)).unwrap(), g.vector(r.v(d, 1.0)).unwrap());
        let run = |fused: bool| {
            g.set_head_argmax(fused);
            let before = g.head_argmax_launches();
            let (mut xn, mut logits, mut out) =
                (g.act(1, d).unwrap(), g.act_poisoned(1, vocab, true).unwrap(), g.act_poisoned(1, 1, true).unwrap());
            g.norm_head_argmax(&x, (&ng, 1e-5), &mut xn, &head, &mut logits, &mut out, false).unwrap();
            assert_eq!(g.head_argmax_launches() - before, usize::from(fused), "{name}: fused launch (asked: {fused})");
            (g.read_rows(&logits, 0).unwrap(), g.read_rows(&out, 0).unwrap()[0])
        };
        let (want_logits, want) = run(false);
        let (got_logits, got) = run(true);
        let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits_of(&got_logits), bits_of(&want_logits), "{name}: logits");
        assert_eq!(got, want, "{name}: argmax, fused vs separate");
        assert_eq!(got as u32, ferrolm::sample::argmax(&got_logits), "{name}: argmax of the stored logits");
        if ties {
            assert_eq!(got, 0.0, "{name}: ties go to the lowest index");
        }
    }
}
