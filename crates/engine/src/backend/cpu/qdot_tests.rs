//! qdot.rs's tests: the integer dot against an f64 reference, non-finite inputs.

use super::*;
use crate::backend::cpu::matmul::matmul;
use crate::quant::affine::{get_q, AffineTensor, ScaleDtype};
use crate::quant::Weight;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// x with block magnitudes from 1e-3 to 1e3 and one zero block, so xd varies per block.
fn activations(k: usize, seed: &mut u64) -> Vec<f32> {
    (0..k)
        .map(|j| {
            let b = j / XB;
            let mag = if b == 2 { 0.0 } else { 10f32.powi((b % 7) as i32 - 3) };
            mag * lcg(seed)
        })
        .collect()
}

/// Per row of `a`: (reference w·x in f64, tolerance, the bias term Σ_g b_g·Σx'_g). The
/// tolerance is the int16 rounding of x, |x − xd·xq| ≤ xd/2 (0.51·xd with the f32
/// rounding of xd and 1/xd), summed over |w|, plus f32 rounding of the kernel's sums:
/// (units + 10)·ε·Σ|terms| (one rounding per sequential add, lanes, hsum, bias dot).
fn reference(a: &AffineTensor, x: &[f32], qx: &QuantX) -> Vec<(f64, f64, f64)> {
    let (k, g) = (a.cols, a.group);
    let wd = a.dequantize();
    let sx = qx.group_sums(g);
    let eps = f32::EPSILON as f64 * ((k / g.min(XB)) as f64 + 10.0);
    (0..a.rows)
        .map(|r| {
            let (mut want, mut quant, mut mag, mut bias) = (0f64, 0f64, 0f64, 0f64);
            for j in 0..k {
                let w = wd[r * k + j] as f64;
                want += w * x[j] as f64;
                let d = qx.d[j / XB] as f64;
                quant += w.abs() * 0.51 * d;
                let q = get_q(a.row_words(r), a.bits, j) as f64;
                mag += (a.scales.get(r * (k / g) + j / g) as f64 * q * d * qx.q[j] as f64).abs();
            }
            for (gi, &s) in sx.iter().enumerate() {
                let t = a.biases.get(r * (k / g) + gi) as f64 * s as f64;
                bias += t;
                mag += t.abs();
            }
            (want, quant + eps * mag, bias)
        })
        .collect()
}

#[test]
fn integer_dot_matches_f64_reference_within_int16_rounding() {
    if !super::super::simd::has_avx2() {
        eprintln!("skipped: no AVX2");
        return;
    }
    // The 4- and 8-bit matrices of groups of 32 or more take the octet layout (octets.rs):
    // 9 rows end in a partial octet, 16 in a whole one.
    let k = 256;
    let mut seed = 99u64;
    for (n, bits) in [9, 16].into_iter().flat_map(|n| [2, 3, 4, 5, 6, 8].map(|b| (n, b))) {
        for group in [16, 32, 64, 128] {
            for dtype in [ScaleDtype::F16, ScaleDtype::BF16, ScaleDtype::F32] {
                // Offset weights: large biases, so a dropped or misplaced bias term shows.
                let w: Vec<f32> = (0..n * k).map(|_| 0.3 + lcg(&mut seed)).collect();
                let x = activations(k, &mut seed);
                let a = AffineTensor::quantize(&w, n, k, bits, group, dtype).unwrap();
                let qx = QuantX::new(&x, k);
                let mut got = vec![f32::NAN; n];
                let refs = reference(&a, &x, &qx);
                matmul(&x, 1, &Weight::Affine(a), &mut got);
                for (r, (&y, (want, tol, bias))) in got.iter().zip(refs).enumerate() {
                    let what = format!("{n} rows, bits {bits} g{group} {dtype:?} row {r}");
                    let err = (y as f64 - want).abs();
                    assert!(err <= tol, "{what}: {y} vs {want}, err {err:e} > tol {tol:e}");
                    // The check has teeth: without the bias term the same row fails it.
                    let miss = (y as f64 - bias - want).abs();
                    assert!(miss > tol, "{what}: dropping the bias ({bias:e}) passes");
                }
            }
        }
    }
}

#[test]
fn non_finite_x_poisons_the_output() {
    if !super::super::simd::has_avx2() {
        return;
    }
    let k = 64;
    let w: Vec<f32> = (0..4 * k).map(|i| (i as f32 * 0.37).sin()).collect();
    let a = Weight::Affine(AffineTensor::quantize(&w, 4, k, 8, 32, ScaleDtype::F16).unwrap());
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x: Vec<f32> = (0..k).map(|i| (i as f32).cos()).collect();
        x[40] = bad;
        let mut got = vec![0f32; 4];
        matmul(&x, 1, &a, &mut got);
        assert!(got.iter().all(|v| v.is_nan()), "{bad}: {got:?}");
    }
}

/// `rows_vnni` (eight-row tiles, VNNI) gives `rows`' bits, and either gives each x row of a
/// batch the bits that row gets alone: every width and group, whole-row sums and sums unit
/// by unit (tensor parallelism's), 1 to 19 x rows. Skipped where AVX-512 VNNI is absent.
#[test]
fn the_vnni_rows_give_the_avx2_rows_bits() {
    use super::super::simd::has_avx512_vnni;
    use crate::quant::affine::Scales;
    if !has_avx512_vnni() {
        eprintln!("skipped: no AVX-512 VNNI");
        return;
    }
    let (n, k) = (5, 256);
    let mut seed = 7u64;
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [16, 32, 64, 128] {
            let w: Vec<f32> = (0..n * k).map(|_| 0.3 + lcg(&mut seed)).collect();
            let a = AffineTensor::quantize(&w, n, k, bits, group, ScaleDtype::F16).unwrap();
            let (Scales::F16(s), Scales::F16(b)) = (&a.scales, &a.biases) else { unreachable!("F16 asked") };
            let x: Vec<f32> = (0..19).flat_map(|_| activations(k, &mut seed)).collect();
            let qx = QuantX::new(&x, k);
            let sums = qx.group_sums(group);
            for (unit, accumulate) in [(k, false), (k / 2, true)] {
                let m = Mat {
                    bytes: bytemuck::cast_slice(&a.packed),
                    cols: k,
                    group,
                    scales: F16Src(bytemuck::cast_slice(s)),
                    biases: F16Src(bytemuck::cast_slice(b)),
                    unit,
                    accumulate,
                };
                let run = |vnni: bool, x_rows: usize| {
                    let xr = QuantX::new(&x[..x_rows * k], k);
                    let mut out = vec![0.25f32; x_rows * n];
                    let mut sc = Scratch::default();
                    let o = out.as_mut_ptr();
                    macro_rules! by_bits {
                        ($rows:ident) => {
                            match bits {
                                2 => $rows::<2, _>(&m, &xr, &sums, (0, n), &mut sc, o, n),
                                3 => $rows::<3, _>(&m, &xr, &sums, (0, n), &mut sc, o, n),
                                4 => $rows::<4, _>(&m, &xr, &sums, (0, n), &mut sc, o, n),
                                5 => $rows::<5, _>(&m, &xr, &sums, (0, n), &mut sc, o, n),
                                6 => $rows::<6, _>(&m, &xr, &sums, (0, n), &mut sc, o, n),
                                _ => $rows::<8, _>(&m, &xr, &sums, (0, n), &mut sc, o, n),
                            }
                        };
                    }
                    // SAFETY: AVX2 and AVX-512 VNNI checked above; out is [rows, n].
                    unsafe {
                        if vnni {
                            by_bits!(rows_vnni)
                        } else {
                            by_bits!(rows)
                        }
                    }
                    out
                };
                let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let (all_vnni, all_avx2) = (run(true, 19), run(false, 19));
                let what = format!("bits {bits} g{group} unit {unit}");
                assert_eq!(bits_of(&all_vnni), bits_of(&all_avx2), "{what}: VNNI and AVX2 rows differ");
                for rows in [1, 7, 8, 9, 16] {
                    let part = run(true, rows);
                    assert_eq!(bits_of(&part), bits_of(&all_vnni[..rows * n]), "{what}: {rows} rows against 19");
                }
            }
        }
    }
}
