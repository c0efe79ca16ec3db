//! The integer dot over octet matrices (octets.rs): out[t·n + r] = w_r · x'_t, eight weight
//! rows a vector. Per 32-value block and x row, the 8 rows' integer sums come from 16
//! pair products (weights widened to u16, x pairs broadcast), then one conversion, one
//! multiply by x's block scale and one FMA with the rows' scales; per unit the bias terms
//! (b_g·Σx'_g, FMAs) come first, and units are added to the output in order. Every
//! operation is lane-wise, so a row's result does not depend on how many x rows share the
//! call or which tile takes it, and the AVX2 and VNNI forms give the same bits (integer
//! sums are exact; the float operations are the same ones in the same order).

#![allow(clippy::needless_range_loop)]

use super::octets::OCT;
use super::qdot::{Bf16Src, F16Src, F32Src, Mat, QuantX, XB};
use std::arch::x86_64::*;

/// Eight consecutive scales or biases as one f32 vector (of the sources qdot.rs reads in
/// bulk).
pub trait Lanes8: Copy {
    /// # Safety
    /// AVX2+F16C present; values [i, i + 8) are inside the source.
    unsafe fn load8(self, i: usize) -> __m256;
}

impl Lanes8 for F16Src<'_> {
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> __m256 {
        debug_assert!(i + 8 <= self.0.len());
        _mm256_cvtph_ps(_mm_loadu_si128(self.0.as_ptr().add(i).cast()))
    }
}
impl Lanes8 for Bf16Src<'_> {
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> __m256 {
        debug_assert!(i + 8 <= self.0.len());
        let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(self.0.as_ptr().add(i).cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
    }
}
impl Lanes8 for F32Src<'_> {
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> __m256 {
        debug_assert!(i + 8 <= self.0.len());
        _mm256_loadu_ps(self.0.as_ptr().add(i))
    }
}

/// Weight rows r0..r1 (r0 a multiple of 8; r1 too unless it is n) against every row of x;
/// `w.bytes` in octet layout (`Octets::q`).
///
/// # Safety
/// AVX2+FMA+F16C present; the matrix is consistent (`Octets` of n rows and `cols`
/// columns); `out` is an [x.rows, n] output (n ≥ r1) whose columns r0..r1 only this call
/// writes; `sums` = `x.group_sums(group)`; x has `cols` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn octet_rows<const BITS: u32, S: Lanes8>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    rows: (usize, usize),
    out: *mut f32,
    n: usize,
) {
    octet_rows_as::<BITS, S, false>(w, x, sums, rows, out, n)
}

/// `octet_rows` with VNNI's fused multiply-add-and-sum and tiles of eight x rows (the 32
/// vector registers of AVX-512 hold their accumulators): the same bits.
///
/// # Safety
/// As `octet_rows`, and AVX-512 F, VL, BW and VNNI present.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn octet_rows_vnni<const BITS: u32, S: Lanes8>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    rows: (usize, usize),
    out: *mut f32,
    n: usize,
) {
    octet_rows_as::<BITS, S, true>(w, x, sums, rows, out, n)
}

#[inline(always)]
unsafe fn octet_rows_as<const BITS: u32, S: Lanes8, const VNNI: bool>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    (r0, r1): (usize, usize),
    out: *mut f32,
    n: usize,
) {
    debug_assert!(r0.is_multiple_of(OCT) && (r1.is_multiple_of(OCT) || r1 == n) && r1 <= n);
    debug_assert!(x.cols == w.cols && w.cols.is_multiple_of(w.unit) && w.unit.is_multiple_of(w.group));
    for o in r0 / OCT..r1.div_ceil(OCT) {
        let at = Tile { o, t0: 0, out, n, lanes: (n - o * OCT).min(OCT) };
        let mut t = 0;
        // Tiles of R x rows keep 8/R integer chains a row, so that R·(8/R) sums are in
        // flight whatever R (a lone row's 16 products a block would otherwise wait on
        // each other).
        if VNNI {
            while t + 8 <= x.rows {
                tile::<BITS, S, VNNI, 8, 1>(w, x, sums, Tile { t0: t, ..at });
                t += 8;
            }
        }
        while t + 4 <= x.rows {
            tile::<BITS, S, VNNI, 4, 2>(w, x, sums, Tile { t0: t, ..at });
            t += 4;
        }
        if t + 2 <= x.rows {
            tile::<BITS, S, VNNI, 2, 4>(w, x, sums, Tile { t0: t, ..at });
            t += 2;
        }
        if t < x.rows {
            tile::<BITS, S, VNNI, 1, 8>(w, x, sums, Tile { t0: t, ..at });
        }
    }
}

/// Where a tile works: octet o, x rows from t0, an [x rows, n] output, of whose columns
/// the octet's first `lanes` exist (fewer than 8 in a last octet).
#[derive(Clone, Copy)]
struct Tile {
    o: usize,
    t0: usize,
    out: *mut f32,
    n: usize,
    lanes: usize,
}

/// Octet `at.o` against x rows t0..t0+R, unit by unit.
#[inline(always)]
unsafe fn tile<const BITS: u32, S: Lanes8, const VNNI: bool, const R: usize, const CH: usize>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    at: Tile,
) {
    let (k, g) = (w.cols, w.group);
    let (nb, gpr, bpg) = (k / XB, k / g, g / XB);
    let block_bytes = XB * BITS as usize;
    let wq = w.bytes.as_ptr().add(at.o * nb * block_bytes);
    let mut xq = [std::ptr::null::<i32>(); R];
    for j in 0..R {
        xq[j] = x.q.as_ptr().add((at.t0 + j) * k).cast();
    }
    let (gpu, bpu) = (w.unit / g, w.unit / XB);
    for u in 0..k / w.unit {
        let mut acc = [_mm256_setzero_ps(); R];
        for gi in u * gpu..(u + 1) * gpu {
            let bv = w.biases.load8((at.o * gpr + gi) * OCT);
            for j in 0..R {
                let s = *sums.get_unchecked((at.t0 + j) * gpr + gi);
                acc[j] = _mm256_fmadd_ps(bv, _mm256_set1_ps(s), acc[j]);
            }
        }
        for b in u * bpu..(u + 1) * bpu {
            let sv = w.scales.load8((at.o * gpr + b / bpg) * OCT);
            let ia = block::<BITS, VNNI, R, CH>(wq.add(b * block_bytes), xq, b);
            for j in 0..R {
                let d = _mm256_set1_ps(*x.d.get_unchecked((at.t0 + j) * nb + b));
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ia[j]), d), sv, acc[j]);
            }
        }
        for j in 0..R {
            let p = at.out.add((at.t0 + j) * at.n + at.o * OCT);
            let v = match u == 0 && !w.accumulate {
                true => acc[j],
                false => _mm256_add_ps(load_lanes(p, at.lanes), acc[j]),
            };
            store_lanes(p, at.lanes, v);
        }
    }
}

/// One block's integer sums for the octet's 8 rows against each of R x rows, in CH
/// chains a row (exact: a block's sum is below 2^31 whatever the order).
#[inline(always)]
unsafe fn block<const BITS: u32, const VNNI: bool, const R: usize, const CH: usize>(
    wb: *const u8,
    xq: [*const i32; R],
    b: usize,
) -> [__m256i; R] {
    let mut ia = [[_mm256_setzero_si256(); CH]; R];
    // x's pairs of block b start at i32 index 16·b. (No closures: they would not inherit
    // the target features.)
    let xb = xq.map(|p| p.add(16 * b));
    if BITS == 4 {
        for c in 0..8 {
            let raw = _mm256_cvtepu8_epi16(_mm_loadu_si128(wb.add(16 * c).cast()));
            let (lo, hi) = (_mm256_and_si256(raw, _mm256_set1_epi16(15)), _mm256_srli_epi16::<4>(raw));
            for j in 0..R {
                let (a, h) = ((2 * c) % CH, (2 * c + 1) % CH);
                ia[j][a] = dp::<VNNI>(ia[j][a], lo, pair(xb[j], c));
                ia[j][h] = dp::<VNNI>(ia[j][h], hi, pair(xb[j], 8 + c));
            }
        }
    } else {
        for c in 0..16 {
            let wv = _mm256_cvtepu8_epi16(_mm_loadu_si128(wb.add(16 * c).cast()));
            for j in 0..R {
                ia[j][c % CH] = dp::<VNNI>(ia[j][c % CH], wv, pair(xb[j], c));
            }
        }
    }
    let mut sum = [_mm256_setzero_si256(); R];
    for j in 0..R {
        sum[j] = ia[j][0];
        for c in 1..CH {
            sum[j] = _mm256_add_epi32(sum[j], ia[j][c]);
        }
    }
    sum
}

/// The first `lanes` outputs at p (the rest zero): a whole vector, or masked in a last
/// octet so that no other row's outputs are read or written.
#[inline(always)]
unsafe fn load_lanes(p: *const f32, lanes: usize) -> __m256 {
    match lanes {
        OCT => _mm256_loadu_ps(p),
        _ => _mm256_maskload_ps(p, super::qdot::head_mask(lanes)),
    }
}

/// v's first `lanes` values to p (see `load_lanes`).
#[inline(always)]
unsafe fn store_lanes(p: *mut f32, lanes: usize, v: __m256) {
    match lanes {
        OCT => _mm256_storeu_ps(p, v),
        _ => _mm256_maskstore_ps(p, super::qdot::head_mask(lanes), v),
    }
}

/// x's i-th pair of values from p, in every lane.
#[inline(always)]
unsafe fn pair(p: *const i32, i: usize) -> __m256i {
    _mm256_set1_epi32(p.add(i).read_unaligned())
}

/// acc + the pair products of w and x (u16 weights below 2^15, int16 x: no saturation).
#[inline(always)]
unsafe fn dp<const VNNI: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpwssd_epi32(acc, w, x)
    } else {
        _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
    }
}
