//! The integer dot's block kernels (qdot.rs): a weight block unpacked and multiplied into
//! each x row's 8 lanes, per group layout, and the per-row factors and bias terms they
//! start from.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::XB;

/// A weight row and R rows of x for the block kernels: the row's packed bytes, each x
/// row's int16 values, and the byte shuffle and multipliers of `load16`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Src<const R: usize> {
    pub p: *const u8,
    pub xq: [*const i16; R],
    pub shuf: __m256i,
    pub mul: __m256i,
}

/// Lanes [0, n) of 8 set (n ≤ 8).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn head_mask(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// A row's unit factors f = s ⊙ d, written in whole vectors (a masked store is slow on
/// AMD): f holds s.len() rounded up to 8 values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn factors(s: &[f32], d: &[f32], f: &mut [f32]) {
    let n = s.len();
    debug_assert!(d.len() >= n && f.len() >= n.next_multiple_of(8));
    for i in (0..n).step_by(8) {
        let m = head_mask(n - i);
        let v = _mm256_mul_ps(_mm256_maskload_ps(s.as_ptr().add(i), m), _mm256_maskload_ps(d.as_ptr().add(i), m));
        _mm256_storeu_ps(f.as_mut_ptr().add(i), v);
    }
}

/// A row's bias term b · sums as 8 partial sums (a handful of vectors).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn bias(b: &[f32], sums: &[f32]) -> __m256 {
    let n = b.len();
    debug_assert!(sums.len() >= n);
    let mut acc = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        let m = head_mask(n - i);
        acc =
            _mm256_fmadd_ps(_mm256_maskload_ps(b.as_ptr().add(i), m), _mm256_maskload_ps(sums.as_ptr().add(i), m), acc);
    }
    acc
}

/// `bias`'s lanes for every group of a row, each alone (fma onto zero, as `bias` rounds a
/// group's product when it has 8 or fewer): out[g] = b_g·sums_g.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn bias_terms(b: &[f32], sums: &[f32], out: &mut [f32]) {
    let n = b.len();
    debug_assert!(sums.len() >= n && out.len() >= n.next_multiple_of(8));
    for i in (0..n).step_by(8) {
        let m = head_mask(n - i);
        let (bv, sv) = (_mm256_maskload_ps(b.as_ptr().add(i), m), _mm256_maskload_ps(sums.as_ptr().add(i), m));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_fmadd_ps(bv, sv, _mm256_setzero_ps()));
    }
}

/// acc_j + Σ_b f_j,b · (q·xq_j over block b) for R x rows of 32-value blocks (group 32);
/// x row j's unit factors at f[j·stride..][..units].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dot_blocks<const BITS: u32, const R: usize>(
    src: Src<R>,
    f: &[f32],
    stride: usize,
    units: usize,
    acc: [__m256; R],
) -> [__m256; R] {
    let fp = f.as_ptr();
    let (mut a0, mut a1) = (acc, [_mm256_setzero_ps(); R]);
    let mut b = 0;
    while b + 2 <= units {
        let (w0, w1) = (wblock::<BITS, R>(src, b), wblock::<BITS, R>(src, b + 1));
        for j in 0..R {
            let (i0, i1) = (xdot(w0, src.xq[j], b), xdot(w1, src.xq[j], b + 1));
            let f = fp.add(j * stride + b);
            a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*f), a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*f.add(1)), a1[j]);
        }
        b += 2;
    }
    if b < units {
        let w0 = wblock::<BITS, R>(src, b);
        for j in 0..R {
            let i0 = xdot(w0, src.xq[j], b);
            a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*fp.add(j * stride + b)), a0[j]);
        }
    }
    for j in 0..R {
        a0[j] = _mm256_add_ps(a0[j], a1[j]);
    }
    a0
}

/// acc_j + Σ_g s_g · Σ_{b∈g} d_j,b · (q·xq_j over block b) for groups of bpg ≥ 2 blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dot_groups<const BITS: u32, const R: usize>(
    src: Src<R>,
    s: &[f32],
    d: [&[f32]; R],
    bpg: usize,
    mut acc: [__m256; R],
) -> [__m256; R] {
    let mut b = 0;
    for s in s {
        let (mut a0, mut a1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        let end = b + bpg;
        while b < end {
            let (w0, w1) = (wblock::<BITS, R>(src, b), wblock::<BITS, R>(src, b + 1));
            for j in 0..R {
                let (i0, i1) = (xdot(w0, src.xq[j], b), xdot(w1, src.xq[j], b + 1));
                let dp = d[j].as_ptr().add(b);
                a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*dp), a0[j]);
                a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*dp.add(1)), a1[j]);
            }
            b += 2;
        }
        for j in 0..R {
            acc[j] = _mm256_fmadd_ps(_mm256_add_ps(a0[j], a1[j]), _mm256_broadcast_ss(s), acc[j]);
        }
    }
    acc
}

/// acc_j + Σ_u f_j,u · (q·xq_j over 16-value unit u) (group 16: a scale per unit).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dot_units16<const BITS: u32, const R: usize>(
    src: Src<R>,
    f: &[f32],
    stride: usize,
    units: usize,
    acc: [__m256; R],
) -> [__m256; R] {
    let fp = f.as_ptr();
    let (mut a0, mut a1) = (acc, [_mm256_setzero_ps(); R]);
    // cols is a multiple of 32: units come in pairs.
    let mut u = 0;
    while u < units {
        let (w0, w1) = (load16::<BITS, R>(src, u), load16::<BITS, R>(src, u + 1));
        for j in 0..R {
            let x = src.xq[j].add(16 * u);
            let i0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(x as *const __m256i));
            let i1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(x.add(16) as *const __m256i));
            let f = fp.add(j * stride + u);
            a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*f), a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*f.add(1)), a1[j]);
        }
        u += 2;
    }
    for j in 0..R {
        a0[j] = _mm256_add_ps(a0[j], a1[j]);
    }
    a0
}

/// The 32 weights of block b as two vectors of u16 lanes: values 0-15 and 16-31.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn wblock<const BITS: u32, const R: usize>(src: Src<R>, b: usize) -> (__m256i, __m256i) {
    (load16::<BITS, R>(src, 2 * b), load16::<BITS, R>(src, 2 * b + 1))
}

/// w·xq over block b (w from `wblock`) as 8 i32 partial sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn xdot(w: (__m256i, __m256i), xq: *const i16, b: usize) -> __m256i {
    let x = xq.add(XB * b);
    _mm256_add_epi32(
        _mm256_madd_epi16(w.0, _mm256_loadu_si256(x as *const __m256i)),
        _mm256_madd_epi16(w.1, _mm256_loadu_si256(x.add(16) as *const __m256i)),
    )
}

/// The 16 values of segment s (bytes [2·BITS·s, 2·BITS·(s+1)) of the row) as u16 lanes.
/// Not 8-bit: 16 bytes are read from the segment's start, past the row's end for its last
/// segments (the matrix's last row is read from a padded copy).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn load16<const BITS: u32, const R: usize>(src: Src<R>, s: usize) -> __m256i {
    if BITS == 8 {
        return _mm256_cvtepu8_epi16(_mm_loadu_si128(src.p.add(16 * s) as *const __m128i));
    }
    let v = _mm_loadu_si128(src.p.add(2 * BITS as usize * s) as *const __m128i);
    let t = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(v), src.shuf);
    // The multiply-high as written: through the intrinsic, LLVM sees the powers of two and
    // rewrites it as 32-bit shifts and packs, twice the work.
    let w: __m256i;
    std::arch::asm!("vpmulhuw {w}, {t}, {m}", w = lateout(ymm_reg) w, t = in(ymm_reg) t, m = in(ymm_reg) src.mul,
        options(pure, nomem, nostack, preserves_flags));
    _mm256_and_si256(w, _mm256_set1_epi16((1 << BITS) - 1))
}

/// Byte shuffle and multiplier for 16 BITS-bit values: lane i gets the two bytes holding
/// value i, whose low bit is then at o = BITS·i mod 8 of the lane (at 8 when o would be
/// 0: the lane holds the value's byte on top, zero below), and the high half of the
/// product with 2^(16−o) shifts it down by o (one multiply; an AND keeps BITS bits).
#[inline(always)]
pub(super) fn unpack_consts(bits: u32) -> (&'static [i8; 32], &'static [u16; 16]) {
    const fn shuf(bits: usize) -> [i8; 32] {
        let mut t = [0i8; 32];
        let mut i = 0;
        while i < 16 {
            let byte = (bits * i / 8) as i8;
            if (bits * i).is_multiple_of(8) {
                t[2 * i] = -128; // the zero byte
                t[2 * i + 1] = byte;
            } else {
                t[2 * i] = byte;
                t[2 * i + 1] = byte + 1;
            }
            i += 1;
        }
        t
    }
    const fn mul(bits: usize) -> [u16; 16] {
        let mut t = [0u16; 16];
        let mut i = 0;
        while i < 16 {
            let o = if (bits * i).is_multiple_of(8) { 8 } else { bits * i % 8 };
            t[i] = (1u32 << (16 - o)) as u16;
            i += 1;
        }
        t
    }
    const S: [[i8; 32]; 5] = [shuf(2), shuf(3), shuf(4), shuf(5), shuf(6)];
    const M: [[u16; 16]; 5] = [mul(2), mul(3), mul(4), mul(5), mul(6)];
    let i = match bits {
        2 => 0,
        3 => 1,
        4 => 2,
        5 => 3,
        _ => 4, // 6 (8-bit rows take no table)
    };
    (&S[i], &M[i])
}
