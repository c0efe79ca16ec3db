//! The fused decode ops at the Llama-3.2-1B shapes (4-bit, group 64, bf16 scales; random
//! weights) and in other weight formats: parity with the CPU composition, and the decode
//! paths a `CudaConfig` switch selects bit-identical to each other where they are the same
//! sums. Their timings are crates/lab's (`timings`).

use super::{bf, check, cpu, gpu, Rng};
use ferrolm::backend::cpu::{Cpu, CpuMat};
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::backend::Backend;
use ferrolm::config::Activation;
use ferrolm::quant::{AffineTensor, ScaleDtype, Weight};

fn mat(g: &Cuda, r: &mut Rng, rows: usize, cols: usize) -> (ferrolm::backend::cuda::CudaMat, CpuMat) {
    let w =
        Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, 4, 64, ScaleDtype::BF16).unwrap());
    (g.matrix(w.clone()).unwrap(), CpuMat::new(w))
}

/// Each decode GEMV of a 1B layer and the head against the CPU.
#[test]
fn decode_gemvs_at_1b_shapes_match_cpu() {
    let (g, c, mut r) = (gpu(), Cpu, Rng::seeded());
    let (d, kvd, f, vocab) = (2048, 512, 8192, 128256);
    let x = r.v(d, 20.0);
    let norm = r.v(d, 1.0);
    let (xg, xc) = (g.act_from_f32(1, d, &x).unwrap(), cpu(1, d, x.clone()));
    let ng = g.vector(norm.clone()).unwrap();
    let (mut xn, mut xnc) = (g.act(1, d).unwrap(), c.act(1, d).unwrap());

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

    // norm → gate/up → SwiGLU or GeGLU (one launch)
    let (wg, wu) = (mat(g, &mut r, f, d), mat(g, &mut r, f, d));
    for act in [Activation::Silu, Activation::GeluTanh] {
        let (mut gg, mut ug) = (g.act(1, f).unwrap(), g.act(1, f).unwrap());
        let mut sg = g.act_poisoned(1, f, false).unwrap();
        g.norm_glu(&xg, (&ng, 1e-5), &mut xn, (&wg.0, &wu.0), act, &mut gg, &mut ug, &mut sg).unwrap();
        let (mut gc, mut uc, mut sc) = (c.act(1, f).unwrap(), c.act(1, f).unwrap(), c.act(1, f).unwrap());
        c.norm_glu(&xc, (&norm, 1e-5), &mut xnc, (&wg.1, &wu.1), act, &mut gc, &mut uc, &mut sc).unwrap();
        check(&format!("1B norm→gate/up→{act:?}"), &g.read_rows(&sg, 0).unwrap(), &sc.data, 1e-2);
    }

    // down: GEMV + residual add
    let wd = mat(g, &mut r, d, f);
    let y = bf(&r.v(f, 1.0));
    let yg = g.act_from(1, f, &y).unwrap();
    let mut rg = g.act_from_f32(1, d, &x).unwrap();
    g.matmul_add(&yg, &wd.0, &mut rg, &mut tmp).unwrap();
    let mut rc = xc.clone();
    c.matmul_add(&cpu(1, f, y), &wd.1, &mut rc, &mut tmpc).unwrap();
    check("1B down + residual", &delta(g.read_rows(&rg, 0).unwrap()), &delta(rc.data), 1e-2);

    // final norm → head (f32 logits)
    let wh = mat(g, &mut r, vocab, d);
    let mut hg = g.act_poisoned(1, vocab, true).unwrap();
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wh.0], &mut [&mut hg]).unwrap();
    let mut hc = c.act(1, vocab).unwrap();
    c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wh.1], &mut [&mut hc]).unwrap();
    check("1B norm→head", &g.read_rows(&hg, 0).unwrap(), &hc.data, 1e-2);
}

/// The fused decode ops (norm→q/k/v in one launch, norm→gate/up→SwiGLU, GEMV + residual
/// add, norm→head, RoPE + cache write + attention with its merge, argmax) against the CPU
/// backend's reference compositions, for one token and every weight format family.
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
    // two warps (gemv.cu's K slices; `CudaConfig::gemv_k_slices`).
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
        (g.matrix(w.clone()).unwrap(), CpuMat::new(w))
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
    g.norm_glu(&xg, (&ng, 1e-5), &mut xn, (&wg.0, &wu.0), Activation::Silu, &mut gg, &mut ug, &mut sg).unwrap();
    let (mut gc, mut uc, mut sc) = (c.act(1, f).unwrap(), c.act(1, f).unwrap(), c.act(1, f).unwrap());
    c.norm_glu(&xc, (&norm, 1e-5), &mut xnc, (&wg.1, &wu.1), Activation::Silu, &mut gc, &mut uc, &mut sc).unwrap();
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

/// The decode MLP with down's x staged by the SwiGLU launch (decode.rs, x_staged.cuh) is
/// bit-identical to the separate launches (residual and SwiGLU output), and matches the
/// CPU's MLP, at the 1B shape and in other weight formats; SmolLM2's 1536-wide MLP is
/// not staged (measured slower).
#[test]
fn mlp_staged_x_is_bit_identical() {
    // Two devices: staging on and off.
    let on = Cuda::with_config(0, CudaConfig { staged_x: true, ..CudaConfig::default() }).unwrap();
    let off = Cuda::with_config(0, CudaConfig { staged_x: false, ..CudaConfig::default() }).unwrap();
    let (c, mut r) = (Cpu, Rng::seeded());
    let shapes = [
        (2048, 8192, 4, 64, ScaleDtype::BF16, true),
        (576, 4096, 4, 32, ScaleDtype::F16, true),
        (512, 4096, 8, 32, ScaleDtype::F16, true),
        (256, 4608, 2, 16, ScaleDtype::F32, true),
        (576, 1536, 4, 64, ScaleDtype::BF16, false),
    ];
    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let acts = [Activation::Silu, Activation::GeluTanh];
    for ((d, f, bits, group, dt, staged_here), act) in shapes.into_iter().flat_map(|s| acts.map(|a| (s, a))) {
        let name = format!("d{d} f{f} q{bits} g{group} {dt:?} {act:?}");
        let mut mat = |rows: usize, cols: usize| {
            Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, bits, group, dt).unwrap())
        };
        let (wg, wu, wd) = (mat(f, d), mat(f, d), mat(d, f));
        let (x, norm) = (r.v(d, 20.0), r.v(d, 1.0));
        let run = |staged: bool| {
            let g = if staged { &on } else { &off };
            let (wg, wu, wd) =
                (g.matrix(wg.clone()).unwrap(), g.matrix(wu.clone()).unwrap(), g.matrix(wd.clone()).unwrap());
            let ng = g.vector(norm.clone()).unwrap();
            let before = g.staged_x_launches();
            let mut xg = g.act_from_f32(1, d, &x).unwrap();
            let mut out = g.act_poisoned(1, f, false).unwrap();
            let (mut xn, mut gg, mut ug, mut tmp) =
                (g.act(1, d).unwrap(), g.act(1, f).unwrap(), g.act(1, f).unwrap(), g.act(1, d).unwrap());
            let scratch = (&mut xn, &mut gg, &mut ug, &mut tmp);
            g.decode_mlp(&mut xg, (&ng, 1e-5), (&wg, &wu, &wd), act, scratch, &mut out).unwrap();
            let taken = g.staged_x_launches() - before;
            assert_eq!(taken, usize::from(staged && staged_here), "{name}: staged path taken (asked: {staged})");
            (g.read_rows(&xg, 0).unwrap(), g.read_rows(&out, 0).unwrap())
        };
        let (want_x, want_act) = run(false);
        let (got_x, got_act) = run(true);
        assert_eq!(bits_of(&got_x), bits_of(&want_x), "{name}: residual");
        assert_eq!(bits_of(&got_act), bits_of(&want_act), "{name}: gated product");
        // And the CPU's MLP (the added part; the residual itself is exact).
        let mut xc = cpu(1, d, x.clone());
        let (mut xn, mut gc, mut uc, mut tmp, mut ac) = (
            c.act(1, d).unwrap(),
            c.act(1, f).unwrap(),
            c.act(1, f).unwrap(),
            c.act(1, d).unwrap(),
            c.act(1, f).unwrap(),
        );
        let (wg, wu, wd) = (CpuMat::new(wg.clone()), CpuMat::new(wu.clone()), CpuMat::new(wd.clone()));
        c.norm_glu(&xc, (&norm, 1e-5), &mut xn, (&wg, &wu), act, &mut gc, &mut uc, &mut ac).unwrap();
        c.matmul_add(&ac, &wd, &mut xc, &mut tmp).unwrap();
        let delta = |v: &[f32]| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
        super::check(&format!("staged MLP {name}"), &delta(&got_x), &delta(&xc.data), 1e-2);
    }
}

/// The head with its argmax in one launch (head.rs) stores the same logits, bit for bit, as
/// the head alone, and gives the argmax of what it stored (ties to the lowest index: a head
/// of identical rows has every logit equal), at the 1B and SmolLM2 head shapes.
#[test]
fn head_argmax_matches_separate_launches() {
    // Two devices: the fusion on and off.
    let on = Cuda::with_config(0, CudaConfig { head_argmax: true, ..CudaConfig::default() }).unwrap();
    let off = Cuda::with_config(0, CudaConfig { head_argmax: false, ..CudaConfig::default() }).unwrap();
    let mut r = Rng::seeded();
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
        let head = Weight::Affine(AffineTensor::quantize(&w, vocab, d, bits, group, dt).unwrap());
        let (xv, nv) = (r.v(d, 20.0), r.v(d, 1.0));
        let run = |fused: bool| {
            let g = if fused { &on } else { &off };
            let head = g.matrix(head.clone()).unwrap();
            let (x, ng) = (g.act_from_f32(1, d, &xv).unwrap(), g.vector(nv.clone()).unwrap());
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
