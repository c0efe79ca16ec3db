//! Integer matmul for affine weights, AVX2: decode and prefill alike.
//!
//! x is quantized once per matmul call, row by row, to int16 with one f32 scale per 32 values
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
//! Each unpacked weight block serves up to four x rows (prefill, batched decode), and a
//! product's arithmetic does not depend on how many rows share it.
//!
//! Where the time goes (2-core x86-64, Gemma 3 270M decode): the 180 MiB 8-bit head streams
//! at near memory bandwidth and takes about half the step; the 5-bit layers are bound by
//! the unpacking (5 instructions per 16 values).

// The tile kernels index several per-row arrays in lockstep.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Values per x scale.
pub const XB: usize = 32;

/// x quantized for the integer dot: int16 values, one scale per 32 values (and the same
/// scale repeated per 16, for group-16 weights), and the block layouts asked for.
pub struct QuantX {
    /// Rows of x, each of `cols` values.
    pub rows: usize,
    pub cols: usize,
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
    /// Quantize the rows of x `[rows, cols]` (cols a multiple of 32). A block holding a NaN
    /// or ±inf gets a NaN scale, so it poisons the outputs as the f32 product would.
    pub fn new(x: &[f32], cols: usize, layouts: Layouts) -> QuantX {
        assert!(cols.is_multiple_of(XB) && cols > 0 && x.len().is_multiple_of(cols));
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
        QuantX { rows: x.len() / cols, cols, q, q4, q8, d, d16 }
    }

    /// Σ x' per group of `group` values (row after row: groups never straddle rows), each
    /// exact: an integer sum times its scale.
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
    /// Columns each product sums as one unit (a multiple of the group and of 32 dividing
    /// cols): the units' sums are added one after another, so a matrix cut at unit
    /// boundaries gives the same sums part after part (tensor parallelism's ranks).
    pub unit: usize,
    /// Whether each product continues the sum the output already holds instead of
    /// replacing it (the next rank's part of a split matrix).
    pub accumulate: bool,
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

/// out[t·n + r] = w_r · x'_t for weight rows r0..r1 and every row t of x (BITS 2-8; cols
/// a multiple of 32; `sums` = Σx' per group of every x row, from `QuantX::group_sums`).
/// Each weight block is unpacked once for up to four x rows; a product's arithmetic is the
/// same whatever the number of x rows (batch invariance: a row of a batch gets the bits it
/// gets alone).
///
/// # Safety
/// CPU must support AVX2+FMA+F16C; the matrix is consistent (bytes, scales, biases hold
/// every row's values); `out` points at an [x.rows, n] output with n > r1 − 1 that this
/// call alone writes in columns r0..r1; `x` was quantized from rows of cols values with the
/// layout `Layouts::of(BITS, group)` names.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows<const BITS: u32, S: ScaleSrc>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    (r0, r1): (usize, usize),
    sc: &mut Scratch,
    out: *mut f32,
    n: usize,
) {
    let (k, g) = (w.cols, w.group);
    let (gpr, rb) = (k / g, k * BITS as usize / 8);
    // The task's scales and biases in one pass each (contiguous: row-major per group).
    let ss = w.scales.get(r0 * gpr, (r1 - r0) * gpr, &mut sc.s);
    let bs = w.biases.get(r0 * gpr, (r1 - r0) * gpr, &mut sc.b);
    let units = k / g.min(XB);
    sc.f.resize(4 * units.next_multiple_of(8), 0.0);
    let last = w.bytes.len() / rb - 1;
    let (shuf, mul) = unpack_consts(BITS);
    let (shuf, mul) = (_mm256_loadu_si256(shuf.as_ptr().cast()), _mm256_loadu_si256(mul.as_ptr().cast()));
    for r in r0..r1 {
        let i = r - r0;
        let (s, b) = (&ss[i * gpr..(i + 1) * gpr], &bs[i * gpr..(i + 1) * gpr]);
        let mut p = w.bytes.as_ptr().add(r * rb);
        if r == last && BITS != 8 && !Layouts::of(BITS, g).nibble {
            sc.pad.clear();
            sc.pad.extend_from_slice(&w.bytes[last * rb..]);
            sc.pad.resize(rb + 16, 0);
            p = sc.pad.as_ptr();
        }
        let row = RowJob { p, shuf, mul, s, b, sums, gpr, out: out.add(r), n, unit: w.unit, accumulate: w.accumulate };
        let mut t = 0;
        while t + 4 <= x.rows {
            tile::<BITS, 4>(&row, x, t, &mut sc.f);
            t += 4;
        }
        match x.rows - t {
            3 => tile::<BITS, 3>(&row, x, t, &mut sc.f),
            2 => tile::<BITS, 2>(&row, x, t, &mut sc.f),
            1 => tile::<BITS, 1>(&row, x, t, &mut sc.f),
            _ => {}
        }
    }
}

/// One weight row's part of `rows`: its bytes, unpacking constants, scales, biases, and
/// where its outputs go (column r of an [x rows, n] output).
#[cfg(target_arch = "x86_64")]
struct RowJob<'a> {
    p: *const u8,
    shuf: __m256i,
    mul: __m256i,
    s: &'a [f32],
    b: &'a [f32],
    sums: &'a [f32],
    gpr: usize,
    out: *mut f32,
    n: usize,
    unit: usize,
    accumulate: bool,
}

/// The weight row against x rows t0..t0+R: per unit of `row.unit` columns, the unit's
/// bias term and blocks in one vector sum, its total added to the row's.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const BITS: u32, const R: usize>(row: &RowJob, x: &QuantX, t0: usize, f: &mut [f32]) {
    let (g, kb) = (x.cols / row.s.len(), x.cols / XB);
    let lay = Layouts::of(BITS, g);
    let xq = if lay.nibble {
        x.q4.as_ptr()
    } else if lay.byte {
        x.q8.as_ptr()
    } else {
        x.q.as_ptr()
    };
    let units = x.cols / g.min(XB);
    let stride = units.next_multiple_of(8);
    for j in 0..R {
        match g {
            16 => factors(row.s, &x.d16[(t0 + j) * 2 * kb..], &mut f[j * stride..]),
            XB => factors(row.s, &x.d[(t0 + j) * kb..], &mut f[j * stride..]),
            _ => {}
        }
    }
    // A row summed whole (every matrix but the output projections) stores its one sum
    // directly: through the units loop it decoded SmolLM2 about 10% slower.
    if row.unit == x.cols && !row.accumulate {
        let part = unit_dot::<BITS, R>(row, x, (t0, xq), 0, f, stride);
        for (j, t) in part.into_iter().enumerate() {
            *row.out.add((t0 + j) * row.n) = t;
        }
        return;
    }
    // Continuing: each x row's sum starts from what its output holds.
    let mut total = [0f32; R];
    if row.accumulate {
        for j in 0..R {
            total[j] = *row.out.add((t0 + j) * row.n);
        }
    }
    for c0 in (0..x.cols).step_by(row.unit) {
        let part = unit_dot::<BITS, R>(row, x, (t0, xq), c0, &f[c0 / g.min(XB)..], stride);
        for j in 0..R {
            total[j] = if c0 == 0 && !row.accumulate { part[j] } else { total[j] + part[j] };
        }
    }
    for (j, t) in total.into_iter().enumerate() {
        *row.out.add((t0 + j) * row.n) = t;
    }
}

/// Columns c0..c0 + row.unit of the weight row against x rows t0..t0+R (xq: x in the
/// layout the row reads; f: the rows' unit factors from the unit's first one on).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn unit_dot<const BITS: u32, const R: usize>(
    row: &RowJob,
    x: &QuantX,
    (t0, xq): (usize, *const i16),
    c0: usize,
    f: &[f32],
    stride: usize,
) -> [f32; R] {
    let g = x.cols / row.s.len();
    let lay = Layouts::of(BITS, g);
    let (g0, g1) = (c0 / g, (c0 + row.unit) / g);
    // (No closures here: they would not inherit the target features, and their intrinsics
    // would be calls.)
    let mut src = Src::<R> { p: row.p.add(c0 * BITS as usize / 8), xq: [xq; R], shuf: row.shuf, mul: row.mul };
    // The bias term Σ_g b_g·Σx'_g starts each x row's accumulator.
    let mut acc = [_mm256_setzero_ps(); R];
    for j in 0..R {
        src.xq[j] = xq.add((t0 + j) * x.cols + c0);
        acc[j] = bias(&row.b[g0..g1], &row.sums[(t0 + j) * row.gpr + g0..]);
    }
    let units = row.unit / g.min(XB);
    let acc = match g {
        16 => dot_units16::<BITS, R>(src, f, stride, units, acc),
        XB => match (lay.nibble, lay.byte) {
            (true, _) => dot_blocks::<BITS, NIBBLE, R>(src, f, stride, units, acc),
            (_, true) => dot_blocks::<BITS, BYTE, R>(src, f, stride, units, acc),
            _ => dot_blocks::<BITS, SEG, R>(src, f, stride, units, acc),
        },
        _ => {
            let (kb, b0) = (x.cols / XB, c0 / XB);
            let mut d: [&[f32]; R] = [&[]; R];
            for (j, d) in d.iter_mut().enumerate() {
                *d = &x.d[(t0 + j) * kb + b0..(t0 + j + 1) * kb];
            }
            let s = &row.s[g0..g1];
            match (lay.nibble, lay.byte) {
                (true, _) => dot_groups::<BITS, NIBBLE, R>(src, s, d, g / XB, acc),
                (_, true) => dot_groups::<BITS, BYTE, R>(src, s, d, g / XB, acc),
                _ => dot_groups::<BITS, SEG, R>(src, s, d, g / XB, acc),
            }
        }
    };
    let mut sums = [0f32; R];
    for j in 0..R {
        sums[j] = super::simd::hsum(acc[j]);
    }
    sums
}

/// A weight row and R rows of x for the block kernels: the row's packed bytes, each x
/// row in the layout they read, and the byte shuffle and multipliers of `load16`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Src<const R: usize> {
    p: *const u8,
    xq: [*const i16; R],
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

/// acc_j + Σ_b f_j,b · (q·xq_j over block b) for R x rows of 32-value blocks (group 32);
/// x row j's unit factors at f[j·stride..][..units].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_blocks<const BITS: u32, const L: u8, const R: usize>(
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
        let (w0, w1) = (wblock::<BITS, L, R>(src, b), wblock::<BITS, L, R>(src, b + 1));
        for j in 0..R {
            let (i0, i1) = (xdot(w0, src.xq[j], b), xdot(w1, src.xq[j], b + 1));
            let f = fp.add(j * stride + b);
            a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(&*f), a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(&*f.add(1)), a1[j]);
        }
        b += 2;
    }
    if b < units {
        let w0 = wblock::<BITS, L, R>(src, b);
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
unsafe fn dot_groups<const BITS: u32, const L: u8, const R: usize>(
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
            let (w0, w1) = (wblock::<BITS, L, R>(src, b), wblock::<BITS, L, R>(src, b + 1));
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
unsafe fn dot_units16<const BITS: u32, const R: usize>(
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

/// The 32 weights of block b as two vectors of u16 lanes, in the order layout L pairs
/// them with x: values 0-15 and 16-31 (segments), even and odd values (4-bit nibbles), or
/// the bytes' unpack halves (8-bit).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn wblock<const BITS: u32, const L: u8, const R: usize>(src: Src<R>, b: usize) -> (__m256i, __m256i) {
    match L {
        NIBBLE => {
            let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(src.p.add(16 * b) as *const __m128i));
            (_mm256_and_si256(v, _mm256_set1_epi16(15)), _mm256_srli_epi16::<4>(v))
        }
        BYTE => {
            let v = _mm256_loadu_si256(src.p.add(XB * b) as *const __m256i);
            let z = _mm256_setzero_si256();
            (_mm256_unpacklo_epi8(v, z), _mm256_unpackhi_epi8(v, z))
        }
        _ => (load16::<BITS, R>(src, 2 * b), load16::<BITS, R>(src, 2 * b + 1)),
    }
}

/// w·xq over block b (w from `wblock`; x row xq in the block's layout) as 8 i32 partial
/// sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn xdot(w: (__m256i, __m256i), xq: *const i16, b: usize) -> __m256i {
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
unsafe fn load16<const BITS: u32, const R: usize>(src: Src<R>, s: usize) -> __m256i {
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
#[path = "qdot_tests.rs"]
mod tests;
