//! Integer decode GEMV (one activation row) for affine weights, AVX2.
//!
//! x is quantized once per matmul call to int16 with one f32 scale per 32 values
//! (xd = max|x|/32767, x' = xd·xq: 15 significant bits, far finer than bf16), so the inner
//! loop is integer: quantized weights widened to 16 bits, `madd_epi16` against xq, one i32
//! vector per 32 values. Per 32-value block (per 16-value half for group 16) that sum is
//! converted once and scaled by f = scale_g·xd, and the bias enters through the group sums
//! of the same x': y = Σ_b f_b·Σ_{j∈b} q_j·xq_j + Σ_g bias_g·Σ_{j∈g} x'_j. Since Σx' is
//! exact (integer sums times xd), y equals w·x' up to f32 rounding: the only error is x's
//! quantization, |x − x'| ≤ xd/2 per value.
//!
//! Unpacking, into u16 lanes: 8-bit weights are 32 bytes unpacked against zero, x permuted
//! per block to match (values 0-7, 16-23, 8-15, 24-31); 4-bit ones are 16 bytes widened and
//! split into low and high nibbles (x per block: even values, then odd). Group-16 rows and
//! the other widths go 16 values at a time: one byte shuffle gives each lane the two bytes
//! holding its value, one multiply-high shifts it down, a mask keeps BITS bits.
//!
//! Where the time goes (2-core x86-64, Gemma 3 270M decode): the 180 MiB 8-bit head streams
//! at near memory bandwidth and takes about half the step; the 5-bit layers are bound by
//! the unpacking (5 instructions per 16 values).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Values per x scale.
pub const XB: usize = 32;

/// x quantized for the integer dot: int16 values, one scale per 32 values (and the same
/// scale repeated per 16, for group-16 weights), and the block layouts asked for.
pub struct QuantX {
    pub q: Vec<i16>,
    /// Per 32-value block: its 16 even values, then its 16 odd ones (4-bit nibble order).
    pub q4: Vec<i16>,
    /// Per 32-value block: values 0-7, 16-23, 8-15, 24-31 (the order in which byte
    /// unpacking takes 8-bit weights out of 32 bytes, 128-bit half by half).
    pub q8: Vec<i16>,
    pub d: Vec<f32>,
    pub d16: Vec<f32>,
}

/// Which block layouts of x the matrices of a call need.
#[derive(Clone, Copy, Default)]
pub struct Layouts {
    pub nibble: bool,
    pub byte: bool,
}

impl Layouts {
    /// The layout a matrix of `bits` and `group` reads (group-16 matrices read x in order).
    pub fn of(bits: u32, group: usize) -> Layouts {
        Layouts { nibble: bits == 4 && group >= XB, byte: bits == 8 && group >= XB }
    }
    pub fn or(self, o: Layouts) -> Layouts {
        Layouts { nibble: self.nibble || o.nibble, byte: self.byte || o.byte }
    }
}

/// x's blocks reordered: block value `order[j]` goes to slot j.
fn permuted(q: &[i16], order: impl Fn(usize) -> usize) -> Vec<i16> {
    let mut out = vec![0i16; q.len()];
    for (o, c) in out.chunks_exact_mut(XB).zip(q.chunks_exact(XB)) {
        for (j, v) in o.iter_mut().enumerate() {
            *v = c[order(j)];
        }
    }
    out
}

impl QuantX {
    /// Quantize x (len a multiple of 32). A block holding a NaN or ±inf gets a NaN scale,
    /// so it poisons the outputs as the f32 product would.
    pub fn new(x: &[f32], layouts: Layouts) -> QuantX {
        assert!(x.len().is_multiple_of(XB));
        let mut q = vec![0i16; x.len()];
        let mut d = vec![0f32; x.len() / XB];
        for ((c, qc), d) in x.chunks_exact(XB).zip(q.chunks_exact_mut(XB)).zip(&mut d) {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let finite = amax.is_finite() && !c.iter().any(|v| v.is_nan());
            let inv = if amax > 0.0 && finite { 32767.0 / amax } else { 0.0 };
            // Round half to even by the 1.5·2²³ trick (|v·inv| ≤ 32767): exact, and it
            // vectorizes where round_ties_even is a libm call without SSE4.1.
            const MAGIC: f32 = 12_582_912.0;
            for (o, v) in qc.iter_mut().zip(c) {
                *o = ((v * inv + MAGIC) - MAGIC) as i16;
            }
            *d = if finite { amax / 32767.0 } else { f32::NAN };
        }
        let q4 = if layouts.nibble { permuted(&q, |j| 2 * (j % 16) + j / 16) } else { Vec::new() };
        let q8 = if layouts.byte { permuted(&q, |j| [0, 16, 8, 24][j / 8] + j % 8) } else { Vec::new() };
        let d16 = d.iter().flat_map(|&v| [v, v]).collect();
        QuantX { q, q4, q8, d, d16 }
    }

    /// Σ x' per group of `group` values, each exact: an integer sum times its scale.
    pub fn group_sums(&self, group: usize) -> Vec<f32> {
        let isum = |r: std::ops::Range<usize>| self.q[r].iter().map(|&v| v as i32).sum::<i32>() as f32;
        if group < XB {
            (0..self.q.len() / group).map(|g| self.d[g * group / XB] * isum(g * group..(g + 1) * group)).collect()
        } else {
            let bpg = group / XB;
            (0..self.q.len() / group)
                .map(|g| (g * bpg..(g + 1) * bpg).map(|b| self.d[b] * isum(b * XB..(b + 1) * XB)).sum())
                .collect()
        }
    }
}

/// Reads a task's scales or biases as f32, in bulk.
pub trait ScaleSrc: Copy {
    /// Values [start, start + n) as f32: the source itself when it is f32, else converted
    /// into `buf`.
    ///
    /// # Safety
    /// CPU must support AVX2+F16C; the range is inside the source.
    unsafe fn get<'b>(self, start: usize, n: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        Self: 'b;
}

#[derive(Clone, Copy)]
pub struct F16Src<'a>(pub &'a [u16]);
#[derive(Clone, Copy)]
pub struct Bf16Src<'a>(pub &'a [u16]);
#[derive(Clone, Copy)]
pub struct F32Src<'a>(pub &'a [f32]);

impl ScaleSrc for F16Src<'_> {
    #[inline(always)]
    unsafe fn get<'b>(self, start: usize, n: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        Self: 'b,
    {
        buf.resize(n, 0.0);
        super::simd::f16_to_f32(&self.0[start..start + n], buf);
        buf
    }
}
impl ScaleSrc for Bf16Src<'_> {
    #[inline(always)]
    unsafe fn get<'b>(self, start: usize, n: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        Self: 'b,
    {
        buf.clear();
        buf.extend(self.0[start..start + n].iter().map(|&h| f32::from_bits((h as u32) << 16)));
        buf
    }
}
impl ScaleSrc for F32Src<'_> {
    #[inline(always)]
    unsafe fn get<'b>(self, start: usize, n: usize, _: &'b mut Vec<f32>) -> &'b [f32]
    where
        Self: 'b,
    {
        &self.0[start..start + n]
    }
}

/// One affine matrix in raw form for the kernel.
pub struct Mat<'a, S> {
    /// All rows' packed bytes (rows × cols·BITS/8).
    pub bytes: &'a [u8],
    pub cols: usize,
    pub group: usize,
    pub scales: S,
    pub biases: S,
}

/// Scratch reused across tasks: a task's scales and biases as f32, one row's unit factors,
/// and a padded copy of the matrix's last row (16-byte reads may pass a row's end).
#[derive(Default)]
pub struct Scratch {
    s: Vec<f32>,
    b: Vec<f32>,
    f: Vec<f32>,
    pad: Vec<u8>,
}

/// out[r − r0] = w_r · x' for rows r0..r1 (BITS 2-8; cols a multiple of 32; `sums` = Σx'
/// per group, from `QuantX::group_sums`).
///
/// # Safety
/// CPU must support AVX2+FMA+F16C; the matrix is consistent (bytes, scales, biases hold
/// every row's values); `out` has r1 − r0 cells; `x` was quantized from cols values with
/// the layout `Layouts::of(BITS, group)` names.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows<const BITS: u32, S: ScaleSrc>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    r0: usize,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    let (k, g) = (w.cols, w.group);
    let (gpr, rb) = (k / g, k * BITS as usize / 8);
    let lay = Layouts::of(BITS, g);
    let xq = if lay.nibble {
        x.q4.as_ptr()
    } else if lay.byte {
        x.q8.as_ptr()
    } else {
        x.q.as_ptr()
    };
    // The task's scales and biases in one pass each (contiguous: row-major per group).
    let ss = w.scales.get(r0 * gpr, out.len() * gpr, &mut sc.s);
    let bs = w.biases.get(r0 * gpr, out.len() * gpr, &mut sc.b);
    let units = k / g.min(XB);
    sc.f.resize(units.next_multiple_of(8), 0.0);
    let last = w.bytes.len() / rb - 1;
    let (shuf, mul) = unpack_consts(BITS);
    let (shuf, mul) = (_mm256_loadu_si256(shuf.as_ptr().cast()), _mm256_loadu_si256(mul.as_ptr().cast()));
    for (i, o) in out.iter_mut().enumerate() {
        let (s, b) = (&ss[i * gpr..(i + 1) * gpr], &bs[i * gpr..(i + 1) * gpr]);
        let mut p = w.bytes.as_ptr().add((r0 + i) * rb);
        if r0 + i == last && BITS != 8 && !lay.nibble {
            sc.pad.clear();
            sc.pad.extend_from_slice(&w.bytes[last * rb..]);
            sc.pad.resize(rb + 16, 0);
            p = sc.pad.as_ptr();
        }
        let src = Src { p, xq, shuf, mul };
        // The bias term Σ_g b_g·Σx'_g starts the row's accumulator.
        let a = bias(b, sums);
        let acc = match g {
            16 => {
                factors(s, &x.d16, &mut sc.f);
                dot_units16::<BITS>(src, &sc.f[..units], a)
            }
            XB => {
                factors(s, &x.d, &mut sc.f);
                match (lay.nibble, lay.byte) {
                    (true, _) => dot_blocks::<BITS, NIBBLE>(src, &sc.f[..units], a),
                    (_, true) => dot_blocks::<BITS, BYTE>(src, &sc.f[..units], a),
                    _ => dot_blocks::<BITS, SEG>(src, &sc.f[..units], a),
                }
            }
            _ => match (lay.nibble, lay.byte) {
                (true, _) => dot_groups::<BITS, NIBBLE>(src, s, &x.d, g / XB, a),
                (_, true) => dot_groups::<BITS, BYTE>(src, s, &x.d, g / XB, a),
                _ => dot_groups::<BITS, SEG>(src, s, &x.d, g / XB, a),
            },
        };
        *o = super::simd::hsum(acc);
    }
}

/// A row for the block kernels: its packed bytes, x in the layout they read, and the
/// byte shuffle and multipliers of `load16`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Src {
    p: *const u8,
    xq: *const i16,
    shuf: __m256i,
    mul: __m256i,
}

/// How a 32-value block is unpacked: two 16-value segments of any width (x in order),
/// 4-bit nibbles (x in `q4` order), 8-bit bytes (x in `q8` order).
const SEG: u8 = 0;
const NIBBLE: u8 = 1;
const BYTE: u8 = 2;

/// Lanes [0, n) of 8 set (n ≤ 8).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn head_mask(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// A row's unit factors f = s ⊙ d, written in whole vectors (a masked store is slow on
/// AMD): f holds s.len() rounded up to 8 values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn factors(s: &[f32], d: &[f32], f: &mut [f32]) {
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
unsafe fn bias(b: &[f32], sums: &[f32]) -> __m256 {
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

/// acc + Σ_b f_b · (q·xq over block b) for a row of 32-value blocks (group 32).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_blocks<const BITS: u32, const L: u8>(src: Src, f: &[f32], acc: __m256) -> __m256 {
    let (n, fp) = (f.len(), f.as_ptr());
    let (mut a0, mut a1) = (acc, _mm256_setzero_ps());
    // (A closure here would not inherit the target features: its intrinsics would be calls.)
    let blk = block::<BITS, L>;
    let mut b = 0;
    while b + 2 <= n {
        let (i0, i1) = (blk(src, b), blk(src, b + 1));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*fp.add(b)), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*fp.add(b + 1)), a1);
        b += 2;
    }
    if b < n {
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blk(src, b)), _mm256_broadcast_ss(&*fp.add(b)), a0);
    }
    _mm256_add_ps(a0, a1)
}

/// acc + Σ_g s_g · Σ_{b∈g} xd_b · (q·xq over block b) for groups of bpg ≥ 2 blocks.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_groups<const BITS: u32, const L: u8>(
    src: Src,
    s: &[f32],
    d: &[f32],
    bpg: usize,
    mut acc: __m256,
) -> __m256 {
    let dp = d.as_ptr();
    let blk = block::<BITS, L>;
    let mut b = 0;
    for s in s {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let end = b + bpg;
        while b < end {
            let (i0, i1) = (blk(src, b), blk(src, b + 1));
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*dp.add(b)), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*dp.add(b + 1)), a1);
            b += 2;
        }
        acc = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_broadcast_ss(s), acc);
    }
    acc
}

/// q·xq of 32-value block b as 8 i32 partial sums, x in layout L's order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block<const BITS: u32, const L: u8>(src: Src, b: usize) -> __m256i {
    match L {
        NIBBLE => block4(src, b),
        BYTE => block8(src, b),
        _ => _mm256_add_epi32(seg::<BITS>(src, 2 * b), seg::<BITS>(src, 2 * b + 1)),
    }
}

/// acc + Σ_u f_u · (q·xq over 16-value unit u) (group 16: a scale per unit).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_units16<const BITS: u32>(src: Src, f: &[f32], acc: __m256) -> __m256 {
    let fp = f.as_ptr();
    let (mut a0, mut a1) = (acc, _mm256_setzero_ps());
    // cols is a multiple of 32: units come in pairs.
    let mut u = 0;
    while u < f.len() {
        let (i0, i1) = (seg::<BITS>(src, u), seg::<BITS>(src, u + 1));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*fp.add(u)), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*fp.add(u + 1)), a1);
        u += 2;
    }
    _mm256_add_ps(a0, a1)
}

/// q·xq of 16-value segment s as 8 i32 partial sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn seg<const BITS: u32>(src: Src, s: usize) -> __m256i {
    let x = _mm256_loadu_si256(src.xq.add(16 * s) as *const __m256i);
    _mm256_madd_epi16(load16::<BITS>(src, s), x)
}

/// q·xq of 4-bit block b (32 values in 16 bytes; x in nibble order) as 8 i32 partial sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block4(src: Src, b: usize) -> __m256i {
    let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(src.p.add(16 * b) as *const __m128i));
    let lo = _mm256_and_si256(v, _mm256_set1_epi16(15));
    let hi = _mm256_srli_epi16::<4>(v);
    let x = src.xq.add(XB * b);
    _mm256_add_epi32(
        _mm256_madd_epi16(lo, _mm256_loadu_si256(x as *const __m256i)),
        _mm256_madd_epi16(hi, _mm256_loadu_si256(x.add(16) as *const __m256i)),
    )
}

/// q·xq of 8-bit block b (32 bytes; x in byte-unpack order) as 8 i32 partial sums: one
/// 32-byte load, its bytes widened half by half by unpacking against zero.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block8(src: Src, b: usize) -> __m256i {
    let v = _mm256_loadu_si256(src.p.add(XB * b) as *const __m256i);
    let z = _mm256_setzero_si256();
    let x = src.xq.add(XB * b);
    _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_unpacklo_epi8(v, z), _mm256_loadu_si256(x as *const __m256i)),
        _mm256_madd_epi16(_mm256_unpackhi_epi8(v, z), _mm256_loadu_si256(x.add(16) as *const __m256i)),
    )
}

/// The 16 values of segment s (bytes [2·BITS·s, 2·BITS·(s+1)) of the row) as u16 lanes.
/// Not 8-bit: 16 bytes are read from the segment's start, past the row's end for its last
/// segments (the matrix's last row is read from a padded copy).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load16<const BITS: u32>(src: Src, s: usize) -> __m256i {
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
fn unpack_consts(bits: u32) -> (&'static [i8; 32], &'static [u16; 16]) {
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
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
        let (n, k) = (9, 256);
        let mut seed = 99u64;
        for bits in [2, 3, 4, 5, 6, 8] {
            for group in [16, 32, 64, 128] {
                for dtype in [ScaleDtype::F16, ScaleDtype::BF16, ScaleDtype::F32] {
                    // Offset weights: large biases, so a dropped or misplaced bias term shows.
                    let w: Vec<f32> = (0..n * k).map(|_| 0.3 + lcg(&mut seed)).collect();
                    let x = activations(k, &mut seed);
                    let a = AffineTensor::quantize(&w, n, k, bits, group, dtype).unwrap();
                    let qx = QuantX::new(&x, Layouts::default());
                    let mut got = vec![f32::NAN; n];
                    let refs = reference(&a, &x, &qx);
                    matmul(&x, 1, &Weight::Affine(a), &mut got);
                    for (r, (&y, (want, tol, bias))) in got.iter().zip(refs).enumerate() {
                        let what = format!("bits {bits} g{group} {dtype:?} row {r}");
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
}
