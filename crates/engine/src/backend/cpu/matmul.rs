//! Quantized and dense matrix products on the CPU: out[m, n] = x[m, k] · W[n, k]ᵀ.
//!
//! Where the time goes: decode (m = 1) is bound by unpacking weights, so each group of q
//! values is unpacked once into an f32 scratch (shifts and masks LLVM vectorizes) and then
//! reused for every one of the m activation rows (prefill amortizes the unpack m-fold).
//! The affine form is folded once per group: Σ(s·q+b)·x = s·Σq·x + b·Σx, with Σx per group
//! precomputed for each row. Output rows are split across threads with rayon; weights are
//! never dequantized as a whole.

use crate::quant::affine::{get_q, AffineTensor};
use crate::quant::{DenseTensor, Weight};
use rayon::prelude::*;

/// Output rows per rayon task: big enough to amortize scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

pub fn matmul(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), m * k, "matmul: x is not [{m}, {k}]");
    assert_eq!(out.len(), m * n, "matmul: out is not [{m}, {n}]");
    // Work in column-major output tiles: task t owns rows [t·R, (t+1)·R) of W and writes
    // out[i, r] for all i. Collect per task then scatter, since out is row-major in i.
    let tiles: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|t| {
            let r0 = t * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(n);
            let mut tile = vec![0f32; (r1 - r0) * m];
            match w {
                Weight::Affine(a) if simd::has_avx2() => {
                    // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                    unsafe { simd::affine_rows_avx2(a, x, m, r0, r1, &mut tile) }
                }
                Weight::Affine(a) => affine_rows(a, x, m, r0, r1, &mut tile),
                Weight::Dense(d) if simd::has_avx2() => {
                    // SAFETY: as above.
                    unsafe { simd::dense_rows_avx2(d, x, m, r0, r1, &mut tile) }
                }
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

#[inline(always)]
fn affine_rows(a: &AffineTensor, x: &[f32], m: usize, r0: usize, r1: usize, tile: &mut [f32]) {
    let (k, g) = (a.cols, a.group);
    let gpr = k / g;
    let xs = group_sums(x, g);
    let mut q = vec![0f32; k];
    let mut scales = vec![0f32; gpr];
    let mut biases = vec![0f32; gpr];
    let nr = r1 - r0;
    for r in r0..r1 {
        unpack_generic(a.row_words(r), a.bits, &mut q);
        a.scales.read_into(r * gpr, &mut scales);
        a.biases.read_into(r * gpr, &mut biases);
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let mut acc = 0f32;
            for gi in 0..gpr {
                let d = dot_generic(&q[gi * g..(gi + 1) * g], &xi[gi * g..(gi + 1) * g]);
                acc += scales[gi] * d + biases[gi] * xs[i * gpr + gi];
            }
            tile[i * nr + (r - r0)] = acc;
        }
    }
}

#[inline(always)]
fn dense_rows(d: &DenseTensor, x: &[f32], m: usize, r0: usize, r1: usize, tile: &mut [f32]) {
    let k = d.cols;
    let mut row = vec![0f32; k];
    let nr = r1 - r0;
    for r in r0..r1 {
        d.row_f32(r, &mut row);
        for i in 0..m {
            tile[i * nr + (r - r0)] = dot_generic(&row, &x[i * k..(i + 1) * k]);
        }
    }
}

/// Unpack one row's q values to f32. 2/4/8 bits (the common cases) unpack whole words
/// with fixed shifts; 3/5/6 bits use the generic bit-stream reader.
#[inline(always)]
fn unpack_generic(words: &[u32], bits: u32, out: &mut [f32]) {
    match bits {
        2 | 4 | 8 => {
            let per = (32 / bits) as usize;
            let mask = (1u32 << bits) - 1;
            for (w, o) in words.iter().zip(out.chunks_exact_mut(per)) {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = ((w >> (j as u32 * bits)) & mask) as f32;
                }
            }
        }
        _ => {
            for (i, v) in out.iter_mut().enumerate() {
                *v = get_q(words, bits, i) as f32;
            }
        }
    }
}

/// f32 dot product with 16 independent accumulators so LLVM emits packed FMAs.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    if simd::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
        unsafe { simd::dot_avx2(a, b) }
    } else {
        dot_generic(a, b)
    }
}

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    for v in acc {
        s += v;
    }
    s
}

mod simd {
    use crate::quant::{AffineTensor, DenseTensor};
    use std::sync::OnceLock;

    pub fn has_avx2() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
    }

    /// The generic bodies compiled with AVX2+FMA enabled, so their loops vectorize.
    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        super::dot_generic(a, b)
    }

    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
    pub unsafe fn affine_rows_avx2(
        a: &AffineTensor,
        x: &[f32],
        m: usize,
        r0: usize,
        r1: usize,
        tile: &mut [f32],
    ) {
        super::affine_rows(a, x, m, r0, r1, tile)
    }

    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
    pub unsafe fn dense_rows_avx2(
        d: &DenseTensor,
        x: &[f32],
        m: usize,
        r0: usize,
        r1: usize,
        tile: &mut [f32],
    ) {
        super::dense_rows(d, x, m, r0, r1, tile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{ScaleDtype, Weight};

    fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for r in 0..n {
                out[i * n + r] = (0..k)
                    .map(|j| x[i * k + j] as f64 * w[r * k + j] as f64)
                    .sum::<f64>() as f32;
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
                    let q = crate::quant::AffineTensor::quantize(
                        &w,
                        n,
                        k,
                        bits,
                        group,
                        ScaleDtype::BF16,
                    )
                    .unwrap();
                    let deq = q.dequantize();
                    let want = reference(&x, m, &deq, n, k);
                    let mut got = vec![f32::NAN; m * n];
                    matmul(&x, m, &Weight::Affine(q), &mut got);
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "bits {bits} g {group} m {m}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
