//! Tensor-core GEMM (prefill) vs the CPU reference.

use super::{bf, check, cpu, gpu, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::cuda::{Cuda, CudaConfig, QgemmKernel};
use ferrolm::backend::Backend;
use ferrolm::config::Activation;
use ferrolm::quant::{AffineTensor, DenseData, DenseTensor, ScaleDtype, Weight};

/// `gpu().qgemm` by `w` ([n, k]) for each token count, both output precisions, against the
/// CPU matmul; outputs are NaN-poisoned first so unwritten elements fail.
fn compare(name: &str, w: &Weight, ms: &[usize], r: &mut Rng) {
    let (g, c) = (gpu(), Cpu);
    let (n, k) = (w.rows(), w.cols());
    let wg = g.matrix(w.clone()).unwrap();
    assert!(g.qgemm_supported(&wg), "{name}: qgemm refuses it");
    for &m in ms {
        let x = bf(&r.v(m * k, 1.0));
        let xg = g.act_from(m, k, &x).unwrap();
        let mut want = c.act(m, n).unwrap();
        c.matmul(&cpu(m, k, x), &c.matrix(w.clone()).unwrap(), &mut want).unwrap();
        for f32_out in [false, true] {
            let mut og = g.act_poisoned(m, n, f32_out).unwrap();
            g.qgemm(&xg, &wg, &mut og).unwrap();
            check(&format!("qgemm {name} m{m} f32out {f32_out}"), &g.read_rows(&og, 0).unwrap(), &want.data, 1e-2);
        }
    }
}

fn affine(r: &mut Rng, n: usize, k: usize, bits: u32, group: usize, dt: ScaleDtype) -> Weight {
    Weight::Affine(AffineTensor::quantize(&r.v(n * k, 0.05), n, k, bits, group, dt).unwrap())
}

#[test]
fn qgemm_matches_cpu_every_variant() {
    let mut r = Rng::seeded();
    let k = 512;
    // Rows not a multiple of the 64-row tile; 1 to 300 tokens (partial token tiles).
    for n in [200, 576] {
        for bits in [2, 4, 8] {
            for group in [16, 32, 64, 128] {
                for dt in [ScaleDtype::F16, ScaleDtype::BF16, ScaleDtype::F32] {
                    let w = affine(&mut r, n, k, bits, group, dt);
                    compare(&format!("q{bits} g{group} {dt:?} n{n} k{k}"), &w, &[1, 16, 77, 300], &mut r);
                }
            }
        }
    }
}

#[test]
fn qgemm_matches_cpu_on_ragged_shapes() {
    let mut r = Rng::seeded();
    // Odd rows (element-wise epilogue), fewer rows than a tile, and cols with a half k-step
    // (544 = 8.5 × 64) or a single one.
    for (n, k, bits, group, dt) in [
        (201, 544, 4, 32, ScaleDtype::F16),
        (37, 544, 8, 16, ScaleDtype::BF16),
        (201, 64, 2, 64, ScaleDtype::F32),
        (63, 96, 4, 16, ScaleDtype::F16),
    ] {
        let w = affine(&mut r, n, k, bits, group, dt);
        compare(&format!("q{bits} g{group} {dt:?} n{n} k{k}"), &w, &[1, 5, 63, 65, 130], &mut r);
    }
}

#[test]
fn qgemm_refuses_what_it_cannot_run() {
    let (g, mut r) = (gpu(), Rng::seeded());
    // 8-bit with cols an odd multiple of 16: loadable, but not in 32-value segments.
    let w = g.matrix(affine(&mut r, 64, 528, 8, 16, ScaleDtype::F16)).unwrap();
    assert!(!g.qgemm_supported(&w));
    let x = g.act_from(4, 528, &bf(&r.v(4 * 528, 1.0))).unwrap();
    let e = g.qgemm(&x, &w, &mut g.act_poisoned(4, 64, false).unwrap()).unwrap_err();
    assert!(e.to_string().contains("cols"), "{e}");
    // Dense weights.
    let d = bf(&r.v(64 * 512, 0.05)).iter().map(|&v| half::bf16::from_f32(v)).collect();
    let w = g.matrix(Weight::Dense(DenseTensor { rows: 64, cols: 512, data: DenseData::BF16(d) })).unwrap();
    assert!(!g.qgemm_supported(&w));
    let x = g.act_from(4, 512, &bf(&r.v(4 * 512, 1.0))).unwrap();
    assert!(g.qgemm(&x, &w, &mut g.act_poisoned(4, 64, false).unwrap()).is_err());
    // Shapes that do not fit.
    let w = g.matrix(affine(&mut r, 64, 512, 4, 32, ScaleDtype::F16)).unwrap();
    assert!(g.qgemm(&x, &w, &mut g.act_poisoned(4, 63, false).unwrap()).is_err());
}

#[test]
fn qgemm_matches_cpu_at_prefill_size() {
    let mut r = Rng::seeded();
    let (n, k, m) = (2048, 2048, 512);
    let w = affine(&mut r, n, k, 4, 64, ScaleDtype::F16);
    compare("q4 g64 F16 n2048 k2048", &w, &[m], &mut r);
}

/// The prefill MLP's gate and up in one GEMM (qgemm_glu): act(x·gateᵀ)·(x·upᵀ) against the
/// CPU's two matmuls and `glu`, for both activations, rows not a multiple of the 32-row
/// tile and odd, 1 to 300 tokens; the output NaN-poisoned first.
#[test]
fn qgemm_glu_matches_cpu() {
    let (g, c, mut r) = (gpu(), Cpu, Rng::seeded());
    for (n, k, bits, group, dt) in
        [(2048, 640, 4, 32, ScaleDtype::F16), (200, 512, 8, 64, ScaleDtype::BF16), (37, 128, 2, 32, ScaleDtype::F32)]
    {
        let (gate, up) = (affine(&mut r, n, k, bits, group, dt), affine(&mut r, n, k, bits, group, dt));
        let (gg, ug) = (g.matrix(gate.clone()).unwrap(), g.matrix(up.clone()).unwrap());
        for m in [1, 77, 300] {
            let x = bf(&r.v(m * k, 1.0));
            let xg = g.act_from(m, k, &x).unwrap();
            for act in [Activation::Silu, Activation::GeluTanh] {
                let (mut gc, mut uc, mut want) = (c.act(m, n).unwrap(), c.act(m, n).unwrap(), c.act(m, n).unwrap());
                c.matmul(&cpu(m, k, x.clone()), &c.matrix(gate.clone()).unwrap(), &mut gc).unwrap();
                c.matmul(&cpu(m, k, x.clone()), &c.matrix(up.clone()).unwrap(), &mut uc).unwrap();
                c.glu(&gc, &uc, act, &mut want).unwrap();
                let mut og = g.act_poisoned(m, n, false).unwrap();
                assert!(g.qgemm_glu(&xg, (&gg, &ug), act, &mut og).unwrap(), "qgemm_glu refused q{bits} n{n}");
                let what = format!("qgemm_glu {act:?} q{bits} g{group} n{n} k{k} m{m}");
                check(&what, &g.read_rows(&og, 0).unwrap(), &want.data, 1e-2);
            }
        }
    }
}

/// The output's values as bits (a bf16 read back as f32 is exact).
fn to_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Each of `kernels` gives the tiled kernel's bits for every element at each token count of
/// `ms`, in every form (bf16 and f32 out, GLU). Shapes: rows not a multiple of 8 or 64, cols
/// with a partial chunk, a half 64-step (544), under one chunk (192) and more chunks than
/// the few-token kernel's warps (4160: three rounds); each bit width.
fn same_bits_as_tiled(kernels: &[QgemmKernel], ms: &[usize]) {
    same_bits_as_tiled_over(kernels, ms, &SHAPES);
}

/// (rows, cols, bits, group, scale dtype) of `same_bits_as_tiled`.
type Shape = (usize, usize, u32, usize, ScaleDtype);
const SHAPES: [Shape; 5] = [
    (203, 544, 4, 32, ScaleDtype::F16),
    (61, 4160, 4, 64, ScaleDtype::BF16),
    (64, 192, 2, 16, ScaleDtype::F32),
    (37, 1152, 8, 128, ScaleDtype::F16),
    (130, 256, 2, 128, ScaleDtype::BF16),
];

/// `same_bits_as_tiled` over the given shapes.
fn same_bits_as_tiled_over(kernels: &[QgemmKernel], ms: &[usize], shapes: &[Shape]) {
    let (g, mut r) = (gpu(), Rng::seeded());
    for &(n, k, bits, group, dt) in shapes {
        let (w, up) = (affine(&mut r, n, k, bits, group, dt), affine(&mut r, n, k, bits, group, dt));
        let (wg, ug) = (g.matrix(w).unwrap(), g.matrix(up).unwrap());
        for &m in ms {
            let what = format!("q{bits} g{group} {dt:?} n{n} k{k} m{m}");
            let xg = g.act_from(m, k, &bf(&r.v(m * k, 1.0))).unwrap();
            for f32_out in [false, true] {
                let run = |kernel| {
                    let mut o = g.act_poisoned(m, n, f32_out).unwrap();
                    g.qgemm_as(&xg, &wg, &mut o, kernel).unwrap();
                    to_bits(&g.read_rows(&o, 0).unwrap())
                };
                let tiled = run(QgemmKernel::Tiled);
                assert!(tiled.iter().all(|b| !f32::from_bits(*b).is_nan()), "{what}: tiled left outputs unwritten");
                for &kernel in kernels {
                    assert_eq!(tiled, run(kernel), "{what} f32out {f32_out}: {kernel:?} bits differ from tiled");
                }
            }
            for act in [Activation::Silu, Activation::GeluTanh] {
                let run = |kernel| {
                    let mut o = g.act_poisoned(m, n, false).unwrap();
                    assert!(g.qgemm_glu_as(&xg, (&wg, &ug), act, &mut o, kernel).unwrap(), "{what}: glu refused");
                    to_bits(&g.read_rows(&o, 0).unwrap())
                };
                let tiled = run(QgemmKernel::Tiled);
                for &kernel in kernels {
                    assert_eq!(tiled, run(kernel), "{what} glu {act:?}: {kernel:?} bits differ from tiled");
                }
            }
        }
    }
}

/// The few-token kernels (gemm_small.cuh) give the tiled kernel's bits at every token count
/// they take: the serving engine's calls switch between them with the call's row count,
/// and a row's logits must not change.
#[test]
fn few_token_kernel_gives_the_tiled_bits() {
    same_bits_as_tiled(&[QgemmKernel::Small], &[1, 2, 15, 16, 17, 40, 64]);
    let (g, mut r) = (gpu(), Rng::seeded());
    // More tokens than the few-token kernels take is an error, never a silent other kernel.
    let w = g.matrix(affine(&mut r, 64, 256, 4, 64, ScaleDtype::F16)).unwrap();
    let x = g.act_from(65, 256, &bf(&r.v(65 * 256, 1.0))).unwrap();
    let e = g.qgemm_as(&x, &w, &mut g.act_poisoned(65, 64, false).unwrap(), QgemmKernel::Small).unwrap_err();
    assert!(e.to_string().contains("at most"), "{e}");
}

/// The wide tiles (128 tokens a block, one weight stage) give the tiled kernel's bits, with
/// partial and several token tiles.
#[test]
fn wide_tiles_give_the_tiled_bits() {
    same_bits_as_tiled(&[QgemmKernel::Wide], &[1, 65, 128, 300]);
}

/// The wgmma kernel (sm_90 devices: weights dequantized to a bf16 copy, warpgroup MMAs over
/// 128 × 128 tiles) gives the tiled kernel's bits: partial and several token tiles, rows
/// over several weight tiles and partial ones, a partial chunk (576 = 2¼ chunks), each bit
/// width, and the GLU form's gate and up interleaved. Elsewhere it is refused, never run.
#[test]
fn the_wgmma_kernel_gives_the_tiled_bits() {
    let g = gpu();
    if g.arch != "sm_90" {
        let (x, w) = (
            g.act_from(1, 64, &[0.0; 64]).unwrap(),
            g.matrix(affine(&mut Rng::seeded(), 8, 64, 4, 64, ScaleDtype::F16)).unwrap(),
        );
        let e = g.qgemm_as(&x, &w, &mut g.act_poisoned(1, 8, false).unwrap(), QgemmKernel::Wgmma).unwrap_err();
        assert!(e.to_string().contains("sm_90"), "{e}");
        return;
    }
    let shapes: Vec<Shape> = SHAPES
        .into_iter()
        .filter(|s| s.1 % 64 == 0)
        .chain([(203, 576, 4, 32, ScaleDtype::F16), (300, 1024, 4, 64, ScaleDtype::BF16)])
        .collect();
    same_bits_as_tiled_over(&[QgemmKernel::Wgmma], &[1, 127, 128, 300, 512], &shapes);
    // cols not a multiple of 64: refused by name (Auto keeps the tiles there).
    let mut r = Rng::seeded();
    let w = g.matrix(affine(&mut r, 64, 544, 4, 32, ScaleDtype::F16)).unwrap();
    let x = g.act_from(512, 544, &bf(&r.v(512 * 544, 1.0))).unwrap();
    let e = g.qgemm_as(&x, &w, &mut g.act_poisoned(512, 64, false).unwrap(), QgemmKernel::Wgmma).unwrap_err();
    assert!(e.to_string().contains("multiple of 64"), "{e}");
}

/// `matmul_add` on the wgmma GEMM with the residual add in its epilogue (qgemm_wgmma_add)
/// gives the bits of the tiled kernel's product stored as bf16 and added after it, at sizes
/// Auto gives the wgmma kernel (every matrix: min weights 0).
#[test]
fn the_wgmma_add_epilogue_gives_the_stored_products_bits() {
    if gpu().arch != "sm_90" {
        return; // the kernel's refusal elsewhere: the_wgmma_kernel_gives_the_tiled_bits
    }
    let with = |gemm_wgmma| {
        Cuda::with_config(0, CudaConfig { gemm_wgmma, wgmma_min_weights: 0, ..CudaConfig::default() }).unwrap()
    };
    let (epilogue, tiled) = (with(true), with(false));
    let mut r = Rng::seeded();
    for (n, k, m) in [(256, 512, 512), (200, 1024, 700)] {
        let w = affine(&mut r, n, k, 4, 32, ScaleDtype::F16);
        let (y, x0) = (bf(&r.v(m * k, 1.0)), r.v(m * n, 4.0));
        let run = |g: &Cuda| {
            let (wg, yg) = (g.matrix(w.clone()).unwrap(), g.act_from(m, k, &y).unwrap());
            let (mut x, mut tmp) = (g.act_from_f32(m, n, &x0).unwrap(), g.act_poisoned(m, n, false).unwrap());
            g.matmul_add(&yg, &wg, &mut x, &mut tmp).unwrap();
            (to_bits(&g.read_rows(&x, 0).unwrap()), to_bits(&g.read_rows(&tmp, 0).unwrap()))
        };
        let (want, stored) = run(&tiled);
        assert!(want.iter().all(|b| !f32::from_bits(*b).is_nan()), "n{n} k{k} m{m}: the tiled sums are NaN");
        assert!(stored.iter().all(|b| !f32::from_bits(*b).is_nan()), "n{n} k{k} m{m}: tiled stored no product");
        let (got, untouched) = run(&epilogue);
        assert_eq!(want, got, "n{n} k{k} m{m}: the wgmma epilogue's add differs from tiled");
        assert!(untouched.iter().all(|b| f32::from_bits(*b).is_nan()), "n{n} k{k} m{m}: not the epilogue's path");
    }
}
