//! Integer matmul for affine weights in row-major layout, AVX2: decode and prefill alike,
//! for the matrices the octet layout (octets.rs) does not take: 2/3/5/6-bit, group 16.
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
//! Unpacking, into u16 lanes, 16 values at a time: one byte shuffle gives each lane the two
//! bytes holding its value, one multiply-high shifts it down, a mask keeps BITS bits. (The
//! kernel takes any width 2-8; 4- and 8-bit matrices of groups of 32 or more go to the
//! octet kernels instead, against the same x.)
//!
//! Each unpacked weight block serves up to four x rows (prefill, batched decode; eight
//! where AVX-512 gives the registers: `rows_vnni`), and a product's arithmetic does not
//! depend on how many rows share it.
//!
//! Where the time goes (2-core x86-64, Gemma 3 270M decode): its 5-bit layers, here, are
//! bound by the unpacking (5 instructions per 16 values); its 180 MiB 8-bit head (in octet
//! layout) streams at near memory bandwidth, about half the step.

// The tile kernels index several per-row arrays in lockstep.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
#[path = "qdot_blocks.rs"]
mod blocks;
#[cfg(target_arch = "x86_64")]
pub(crate) use blocks::head_mask;
#[cfg(target_arch = "x86_64")]
use blocks::*;

/// Values per x scale.
pub const XB: usize = 32;

/// x quantized for the integer dot: int16 values, one scale per 32 values (and the same
/// scale repeated per 16, for group-16 weights).
pub struct QuantX {
    /// Rows of x, each of `cols` values.
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<i16>,
    pub d: Vec<f32>,
    pub d16: Vec<f32>,
}

/// Whether the integer dot takes this matrix (in either layout): rows of whole 32-value
/// blocks, scales and biases of one dtype.
pub fn takes(a: &crate::quant::affine::AffineTensor) -> bool {
    a.cols.is_multiple_of(XB) && a.scales.dtype() == a.biases.dtype()
}

/// One 32-value block of x to int16 (into qc), returning its scale.
fn quantize_block(c: &[f32], qc: &mut [i16]) -> f32 {
    let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
    let finite = amax.is_finite() && !c.iter().any(|v| v.is_nan());
    let inv = if amax > 0.0 && finite { 32767.0 / amax } else { 0.0 };
    // Round half to even by the 1.5·2²³ trick (|v·inv| ≤ 32767): exact, and it vectorizes
    // where round_ties_even is a libm call without SSE4.1.
    const MAGIC: f32 = 12_582_912.0;
    for (o, v) in qc.iter_mut().zip(c) {
        *o = ((v * inv + MAGIC) - MAGIC) as i16;
    }
    if finite {
        amax / 32767.0
    } else {
        f32::NAN
    }
}

impl QuantX {
    /// Quantize the rows of x `[rows, cols]` (cols a multiple of 32). A block holding a NaN
    /// or ±inf gets a NaN scale, so it poisons the outputs as the f32 product would.
    pub fn new(x: &[f32], cols: usize) -> QuantX {
        assert!(cols.is_multiple_of(XB) && cols > 0 && x.len().is_multiple_of(cols));
        let mut q = vec![0i16; x.len()];
        let mut d = vec![0f32; x.len() / XB];
        if x.len() / cols >= super::PAR_ROWS {
            use rayon::prelude::*;
            let blocks = x.par_chunks_exact(XB).zip(q.par_chunks_exact_mut(XB)).zip(d.par_iter_mut());
            blocks.with_min_len(64).for_each(|((c, qc), d)| *d = quantize_block(c, qc));
        } else {
            for ((c, qc), d) in x.chunks_exact(XB).zip(q.chunks_exact_mut(XB)).zip(&mut d) {
                *d = quantize_block(c, qc);
            }
        }
        let d16 = d.iter().flat_map(|&v| [v, v]).collect();
        QuantX { rows: x.len() / cols, cols, q, d, d16 }
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
    /// All rows' packed bytes (rows × cols·BITS/8): row-major here, in octet layout for
    /// qdot_octets.rs (octets.rs).
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

/// Scratch reused across tasks: a task's scales and biases as f32, one row's unit factors
/// and bias terms, and a padded copy of the matrix's last row (16-byte reads may pass a
/// row's end).
#[derive(Default)]
pub struct Scratch {
    s: Vec<f32>,
    b: Vec<f32>,
    f: Vec<f32>,
    bt: Vec<f32>,
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
/// call alone writes in columns r0..r1; `x` holds rows of cols values (`QuantX::new`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows<const BITS: u32, S: ScaleSrc>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    rows: (usize, usize),
    sc: &mut Scratch,
    out: *mut f32,
    n: usize,
) {
    rows_tiled::<BITS, S, 4>(w, x, sums, rows, sc, out, n)
}

/// `rows` where the CPU has AVX-512 (F, VL, BW) and VNNI: the same 256-bit kernels, whose
/// 32 vector registers hold eight x rows' accumulators a tile (whole-row sums; at sixteen
/// registers eight rows spilled and lost) and whose VNNI instruction fuses each pair of
/// multiply-adds with their sum. The integer sums are exact and every row's f32 operations
/// are `rows`' in the same order, so the outputs are `rows`' bits (qdot_tests.rs). Its
/// gain is measured in docs/perf.md ("Serving on the CPU").
///
/// # Safety
/// As `rows`, and the CPU supports AVX-512 F, VL, BW and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_vnni<const BITS: u32, S: ScaleSrc>(
    w: &Mat<S>,
    x: &QuantX,
    sums: &[f32],
    rows: (usize, usize),
    sc: &mut Scratch,
    out: *mut f32,
    n: usize,
) {
    rows_tiled::<BITS, S, 8>(w, x, sums, rows, sc, out, n)
}

/// `rows`' body with tiles of up to `MAX` x rows (4, or 8 for whole-row sums).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tiled<const BITS: u32, S: ScaleSrc, const MAX: usize>(
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
    sc.f.resize(MAX * units.next_multiple_of(8), 0.0);
    sc.bt.resize(MAX * gpr.next_multiple_of(8), 0.0);
    let last = w.bytes.len() / rb - 1;
    let (shuf, mul) = unpack_consts(BITS);
    let (shuf, mul) = (_mm256_loadu_si256(shuf.as_ptr().cast()), _mm256_loadu_si256(mul.as_ptr().cast()));
    for r in r0..r1 {
        let i = r - r0;
        let (s, b) = (&ss[i * gpr..(i + 1) * gpr], &bs[i * gpr..(i + 1) * gpr]);
        let mut p = w.bytes.as_ptr().add(r * rb);
        if r == last && BITS != 8 {
            sc.pad.clear();
            sc.pad.extend_from_slice(&w.bytes[last * rb..]);
            sc.pad.resize(rb + 16, 0);
            p = sc.pad.as_ptr();
        }
        let row = RowJob { p, shuf, mul, s, b, sums, gpr, out: out.add(r), n, unit: w.unit, accumulate: w.accumulate };
        let mut t = 0;
        // Eight-row tiles only for whole-row sums: the units' path gathers four rows' totals.
        if MAX == 8 && w.unit == x.cols && !w.accumulate {
            while t + 8 <= x.rows {
                tile::<BITS, 8>(&row, x, t, (&mut sc.f, &mut sc.bt));
                t += 8;
            }
        }
        while t + 4 <= x.rows {
            tile::<BITS, 4>(&row, x, t, (&mut sc.f, &mut sc.bt));
            t += 4;
        }
        match x.rows - t {
            3 => tile::<BITS, 3>(&row, x, t, (&mut sc.f, &mut sc.bt)),
            2 => tile::<BITS, 2>(&row, x, t, (&mut sc.f, &mut sc.bt)),
            1 => tile::<BITS, 1>(&row, x, t, (&mut sc.f, &mut sc.bt)),
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

/// A tile's first x row and x's layout, and its shape, worked out once rather than per
/// unit (five integer divisions a unit, a measurable share of a 64-column unit's work).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Shape {
    t0: usize,
    xq: *const i16,
    /// Per unit: groups, factors (blocks of min(g, 32) values), 32-value x blocks.
    groups: usize,
    factors: usize,
    blocks: usize,
    /// 32-value blocks per x row, and the distance between x rows' factors in `f`.
    kb: usize,
    stride: usize,
}

/// The weight row against x rows t0..t0+R: per unit of `row.unit` columns, the unit's
/// bias term and blocks in one vector sum, its total added to the row's.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const BITS: u32, const R: usize>(
    row: &RowJob,
    x: &QuantX,
    t0: usize,
    (f, bt): (&mut [f32], &mut [f32]),
) {
    let (g, kb) = (x.cols / row.s.len(), x.cols / XB);
    let xq = x.q.as_ptr();
    let fpr = x.cols / g.min(XB);
    let stride = fpr.next_multiple_of(8);
    for j in 0..R {
        match g {
            16 => factors(row.s, &x.d16[(t0 + j) * 2 * kb..], &mut f[j * stride..]),
            XB => factors(row.s, &x.d[(t0 + j) * kb..], &mut f[j * stride..]),
            _ => {}
        }
    }
    let (groups, factors, blocks) = (row.unit / g, row.unit / g.min(XB), row.unit / XB);
    let sh = Shape { t0, xq, groups, factors, blocks, kb, stride };
    // One kernel for the whole tile, so that a unit's loop holds only its own code.
    let args = (sh, (f, bt));
    match g {
        16 => tile_as::<BITS, R, K16>(row, x, args),
        XB => tile_as::<BITS, R, KB>(row, x, args),
        _ => tile_as::<BITS, R, KG>(row, x, args),
    }
}

/// The kernels a tile's units run (`unit_acc`): group 16, group 32, larger groups.
const K16: u8 = 0;
const KB: u8 = 1;
const KG: u8 = 2;

/// `tile` with its kernel K: the whole row's sum, or the units' sums added in order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_as<const BITS: u32, const R: usize, const K: u8>(
    row: &RowJob,
    x: &QuantX,
    (sh, (f, bt)): (Shape, (&mut [f32], &mut [f32])),
) {
    let t0 = sh.t0;
    debug_assert!(R <= 4 || (row.unit == x.cols && !row.accumulate), "eight-row tiles sum whole rows");
    // A row summed whole (every matrix but the output projections) stores its one sum
    // directly: through the units loop it decoded SmolLM2 about 10% slower.
    if row.unit == x.cols && !row.accumulate {
        let mut acc = [_mm256_setzero_ps(); R];
        for (j, a) in acc.iter_mut().enumerate() {
            *a = bias(row.b, &row.sums[(t0 + j) * row.gpr..]);
        }
        let acc = unit_acc::<BITS, R, K>(row, x, 0, sh, f, acc);
        for (j, a) in acc.into_iter().enumerate() {
            *row.out.add((t0 + j) * row.n) = super::simd::hsum(a);
        }
        return;
    }
    // Each unit's bias term: units of up to 8 groups load theirs from the row's products,
    // made once as `bias` makes them (a masked bias loop per unit and x row was about a
    // fifth of o's time at 128 rows).
    let bstride = row.gpr.next_multiple_of(8);
    let few = sh.groups <= 8;
    if few {
        for j in 0..R {
            bias_terms(row.b, &row.sums[(t0 + j) * row.gpr..], &mut bt[j * bstride..]);
        }
    }
    let mask = head_mask(sh.groups.min(8));
    // The x rows' totals as the lanes of one vector, each unit's sums (hsum4: hsum's bits)
    // added in unit order (the same adds as one scalar a row; per-row hsums and scalar
    // chains cost o at 128 rows as much as its blocks). A continued sum starts from what
    // the outputs hold.
    let mut total = [0f32; 4];
    if row.accumulate {
        for j in 0..R {
            total[j] = *row.out.add((t0 + j) * row.n);
        }
    }
    let mut total = _mm_loadu_ps(total.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    for u in 0..x.cols / row.unit {
        let g0 = u * sh.groups;
        let mut start = [_mm256_setzero_ps(); R];
        for (j, a) in start.iter_mut().enumerate() {
            *a = match few {
                true => _mm256_maskload_ps(bt.as_ptr().add(j * bstride + g0), mask),
                false => bias(&row.b[g0..g0 + sh.groups], &row.sums[(t0 + j) * row.gpr + g0..]),
            };
        }
        let unit = unit_acc::<BITS, R, K>(row, x, u, sh, &f[u * sh.factors..], start);
        acc[..R].copy_from_slice(&unit);
        let sums = super::simd::hsum4(&acc);
        total = if u == 0 && !row.accumulate { sums } else { _mm_add_ps(total, sums) };
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), total);
    for (j, t) in out.into_iter().take(R).enumerate() {
        *row.out.add((t0 + j) * row.n) = t;
    }
}

/// Unit `u` (columns u·row.unit onwards) of the weight row against x rows t0..t0+R (xq: x
/// in the layout the row reads; f: the rows' factors from the unit's first one on), each
/// x row's sum as 8 lanes continuing `acc` (the unit's bias term).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn unit_acc<const BITS: u32, const R: usize, const K: u8>(
    row: &RowJob,
    x: &QuantX,
    u: usize,
    sh: Shape,
    f: &[f32],
    acc: [__m256; R],
) -> [__m256; R] {
    let (t0, xq, stride) = (sh.t0, sh.xq, sh.stride);
    let c0 = u * row.unit;
    let (g0, g1) = (u * sh.groups, (u + 1) * sh.groups);
    // (No closures here: they would not inherit the target features, and their intrinsics
    // would be calls.)
    let mut src = Src::<R> { p: row.p.add(c0 * BITS as usize / 8), xq: [xq; R], shuf: row.shuf, mul: row.mul };
    for j in 0..R {
        src.xq[j] = xq.add((t0 + j) * x.cols + c0);
    }
    match K {
        K16 => dot_units16::<BITS, R>(src, f, stride, sh.factors, acc),
        KB => dot_blocks::<BITS, R>(src, f, stride, sh.factors, acc),
        _ => {
            let (kb, b0) = (sh.kb, u * sh.blocks);
            let mut d: [&[f32]; R] = [&[]; R];
            for (j, d) in d.iter_mut().enumerate() {
                *d = &x.d[(t0 + j) * kb + b0..(t0 + j + 1) * kb];
            }
            let (s, bpg) = (&row.s[g0..g1], sh.blocks / sh.groups);
            dot_groups::<BITS, R>(src, s, d, bpg, acc)
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
#[path = "qdot_tests.rs"]
mod tests;
