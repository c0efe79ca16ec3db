//! Quantized and dense matrix products on the CPU: out[m, n] = x[m, k] · W[n, k]ᵀ.
//!
//! Where the time goes: decode (m = 1) is bound by unpacking weights, so each group of q
//! values is unpacked once into an f32 scratch (shifts and masks LLVM vectorizes) and then
//! reused for every one of the m activation rows (prefill amortizes the unpack m-fold).
//! The affine form is folded once per group: Σ(s·q+b)·x = s·Σq·x + b·Σx, with Σx per group
//! precomputed for each row. Output rows are split across threads with rayon; weights are
//! never dequantized as a whole.

use super::simd;
use crate::quant::affine::{get_q, AffineTensor};
use crate::quant::{DenseTensor, Weight};
use rayon::prelude::*;

/// Output rows per rayon task: big enough to amortize scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

pub fn matmul(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), m * k, "matmul: x is not [{m}, {k}]");
    assert_eq!(out.len(), m * n, "matmul: out is not [{m}, {n}]");
    // Task t owns rows [t·R, (t+1)·R) of W and computes out[i, r] for every i; tiles are
    // scattered into the row-major output afterwards.
    let tiles: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|t| {
            let r0 = t * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(n);
            let mut tile = vec![0f32; (r1 - r0) * m];
            match w {
                Weight::Affine(a) => affine_rows(a, x, m, r0, r1, &mut tile),
                Weight::Dense(d) => dense_rows(d, x, m, r0, r1, &mut tile),
            }
            (r0, tile)
        })
        .collect();
    for (r0, tile) in tiles {
        let nr = tile.len() / m;
        for i in 0..m {
            out[i * n + r0..i * n + r0 + nr].copy_from_slice(&tile[i * nr..(i + 1) * nr]);
        }
    }
}

/// Σx per group for each row of x: `[m, k/group]`.
fn group_sums(x: &[f32], group: usize) -> Vec<f32> {
    x.chunks_exact(group).map(|c| c.iter().sum()).collect()
}

fn affine_rows(a: &AffineTensor, x: &[f32], m: usize, r0: usize, r1: usize, tile: &mut [f32]) {
    let (k, g) = (a.cols, a.group);
    let gpr = k / g;
    let simd = simd::has_avx2();
    let xs = group_sums(x, g);
    let mut q = vec![0f32; k];
    let mut scales = vec![0f32; gpr];
    let mut biases = vec![0f32; gpr];
    let nr = r1 - r0;
    for r in r0..r1 {
        let words = a.row_words(r);
        a.scales.read_into(r * gpr, &mut scales);
        a.biases.read_into(r * gpr, &mut biases);
        let bias_term = |i: usize| -> f32 { biases.iter().zip(&xs[i * gpr..(i + 1) * gpr]).map(|(b, s)| b * s).sum() };
        // Decode: unpack and multiply in one pass, no scratch.
        if m == 1 && simd && (a.bits == 4 || a.bits == 8) {
            // SAFETY: AVX2+FMA present; lengths follow from the tensor's checked shape.
            let d = unsafe {
                match a.bits {
                    4 => simd::row_dot::<4>(words, x, &scales, g),
                    _ => simd::row_dot::<8>(words, x, &scales, g),
                }
            };
            tile[r - r0] = d + bias_term(0);
            continue;
        }
        // Prefill (or odd bit widths): unpack once, reuse for all m rows of x.
        match a.bits {
            // SAFETY: as above.
            4 if simd => unsafe { simd::unpack::<4>(words, &mut q) },
            8 if simd => unsafe { simd::unpack::<8>(words, &mut q) },
            bits => q.iter_mut().enumerate().for_each(|(i, v)| *v = get_q(words, bits, i) as f32),
        }
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let d = if simd {
                // SAFETY: AVX2+FMA present; q and xi are both k long, k a multiple of g ≥ 16.
                unsafe { simd::dot_groups(&q, xi, &scales, g) }
            } else {
                q.chunks_exact(g).zip(xi.chunks_exact(g)).zip(&scales).map(|((a, b), s)| s * dot_scalar(a, b)).sum()
            };
            tile[i * nr + (r - r0)] = d + bias_term(i);
        }
    }
}

fn dense_rows(d: &DenseTensor, x: &[f32], m: usize, r0: usize, r1: usize, tile: &mut [f32]) {
    let k = d.cols;
    let mut row = vec![0f32; k];
    let nr = r1 - r0;
    for r in r0..r1 {
        d.row_f32(r, &mut row);
        for i in 0..m {
            tile[i * nr + (r - r0)] = dot(&row, &x[i * k..(i + 1) * k]);
        }
    }
}

/// f32 dot product (AVX2+FMA when available).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    if simd::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time); lengths are equal.
        unsafe { simd::dot(a, b) }
    } else {
        dot_scalar(a, b)
    }
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{ScaleDtype, Weight};

    fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for r in 0..n {
                out[i * n + r] = (0..k).map(|j| x[i * k + j] as f64 * w[r * k + j] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn quantized_matmul_matches_dequantized_reference() {
        let (n, k) = (37, 256);
        let mut seed = 12345u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
        for bits in [2, 3, 4, 5, 6, 8] {
            for group in [32, 64, 128] {
                for m in [1, 3] {
                    let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
                    let q = crate::quant::AffineTensor::quantize(&w, n, k, bits, group, ScaleDtype::BF16).unwrap();
                    let deq = q.dequantize();
                    let want = reference(&x, m, &deq, n, k);
                    let mut got = vec![f32::NAN; m * n];
                    matmul(&x, m, &Weight::Affine(q), &mut got);
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "bits {bits} g {group} m {m}: {a} vs {b}");
                    }
                }
            }
        }
    }
}
