//! Quantized and dense matrix products on the CPU: out[m, n] = x[m, k] · W[n, k]ᵀ.
//!
//! Where the time goes: decode is bound by unpacking weights, so with AVX2 x is quantized
//! once per call to int16 and the products are integer dots: 4- and 8-bit matrices with
//! groups of 32 or more in octet layout, eight weight rows a vector (octets.rs,
//! qdot_octets.rs), the others row-major, each unpacked weight block serving up to four
//! activation rows (qdot.rs). Without AVX2, or for a row width that
//! is not a multiple of 32, a weight row is unpacked once into an f32 scratch and reused
//! for every activation row, four at a time. Either way a row's product does not depend on
//! how many rows the call has (batch invariance). The affine form is folded once per
//! group: Σ(s·q+b)·x = s·Σq·x + b·Σx, with Σx per group precomputed. Several matrices
//! sharing one input (q/k/v, gate/up) run in one parallel region, since on few cores the
//! fork/join per region costs as much as a small matmul. Weights are never dequantized as a
//! whole.

use super::octets::Octets;
use super::qdot::{self, QuantX};
use super::qdot_octets;
use super::simd;
use crate::quant::affine::{get_q, AffineTensor, Scales};
use crate::quant::{DenseTensor, Weight};
use rayon::prelude::*;

/// Output rows per rayon task: big enough to amortize scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 32;
const _: () = assert!(ROWS_PER_TASK.is_multiple_of(super::octets::OCT));

/// Disjoint writes into outputs from parallel tasks.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of (row, column) cells; see matmul_many.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Where a task's products go and how they are summed (`CpuMat`'s unit; `accumulate`:
/// continuing the sums the output holds).
#[derive(Clone, Copy)]
struct Out {
    ptr: OutPtr,
    unit: usize,
    accumulate: bool,
}

impl Out {
    /// The sum of unit sums `part(c0..c1)` over a row of `k` columns, continuing the value
    /// at `cell` when accumulating, stored there.
    ///
    /// # Safety
    /// `cell` is inside the output, and only this task writes it.
    #[inline]
    unsafe fn store(self, cell: usize, k: usize, mut part: impl FnMut(std::ops::Range<usize>) -> f32) {
        let o = self.ptr.0.add(cell);
        let mut total = if self.accumulate { *o } else { 0.0 };
        for c0 in (0..k).step_by(self.unit) {
            let p = part(c0..c0 + self.unit);
            total = if c0 == 0 && !self.accumulate { p } else { total + p };
        }
        *o = total;
    }
}

/// A matrix as the CPU's products take it: the weight (affine 4- and 8-bit ones in octet
/// layout where the CPU has AVX2: octets.rs), and the columns each product sums as one
/// unit before adding the unit's sum to the row's, unit after unit. A matrix cut at unit
/// boundaries (tensor parallelism's output projections) then gives the same sums part
/// after part (`matmul_continue`).
#[derive(Clone, Debug)]
pub struct CpuMat {
    store: Store,
    pub unit: usize,
}

#[derive(Clone, Debug)]
enum Store {
    Weight(Weight),
    Octets(Octets),
}

impl CpuMat {
    /// Each product one sum over the whole row.
    pub fn new(w: Weight) -> CpuMat {
        let unit = w.cols();
        CpuMat::with_unit(w, unit)
    }

    /// Products summed in units of `unit` columns where the weight can be cut there (see
    /// `Weight::cuts_at`), else over whole rows.
    pub fn in_units(w: Weight, unit: usize) -> CpuMat {
        let cols = w.cols();
        let unit = match unit > 0 && cols.is_multiple_of(unit) && w.cuts_at(unit) {
            true => unit,
            false => cols,
        };
        CpuMat::with_unit(w, unit)
    }

    fn with_unit(w: Weight, unit: usize) -> CpuMat {
        let store = match w {
            Weight::Affine(a) if simd::has_avx2() && Octets::takes(&a) => Store::Octets(Octets::from_affine(&a)),
            w => Store::Weight(w),
        };
        CpuMat { store, unit }
    }

    pub fn rows(&self) -> usize {
        match &self.store {
            Store::Weight(w) => w.rows(),
            Store::Octets(o) => o.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match &self.store {
            Store::Weight(w) => w.cols(),
            Store::Octets(o) => o.cols,
        }
    }

    /// Row r as f32 (dequantized as `Weight::row_f32` does).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match &self.store {
            Store::Weight(w) => w.row_f32(r, out),
            Store::Octets(o) => o.row_f32(r, out),
        }
    }
}

/// out = x · wᵀ, w in the layout `CpuMat::new` gives it (tests and probes).
pub fn matmul(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    products(x, m, &[&CpuMat::new(w.clone())], &mut [out], false);
}

/// out_i = x · w_iᵀ for every i, in one parallel region.
pub fn matmul_many(x: &[f32], m: usize, ws: &[&CpuMat], outs: &mut [&mut [f32]]) {
    products(x, m, ws, outs, false);
}

/// out += x · wᵀ where each product continues out's value unit by unit: ((out + u₀) + u₁)…,
/// so a matrix cut between ranks at unit boundaries, each rank continuing the one before,
/// sums exactly as the whole matrix does.
pub fn matmul_continue(x: &[f32], m: usize, w: &CpuMat, out: &mut [f32]) {
    products(x, m, &[w], &mut [out], true);
}

/// Which product a matrix takes.
enum Path<'a> {
    Octets(&'a Octets),
    Int(&'a AffineTensor),
    Affine(&'a AffineTensor),
    Dense(&'a DenseTensor),
}

impl CpuMat {
    fn path(&self) -> Path<'_> {
        match &self.store {
            Store::Octets(o) => Path::Octets(o),
            Store::Weight(Weight::Affine(a)) if simd::has_avx2() && qdot::takes(a) => Path::Int(a),
            Store::Weight(Weight::Affine(a)) => Path::Affine(a),
            Store::Weight(Weight::Dense(d)) => Path::Dense(d),
        }
    }
}

/// out_i = x · w_iᵀ (or, `accumulate`, out_i + x · w_iᵀ) for every matrix.
fn products(x: &[f32], m: usize, ws: &[&CpuMat], outs: &mut [&mut [f32]], accumulate: bool) {
    assert_eq!(ws.len(), outs.len());
    let mut tasks = Vec::new();
    let mut ptrs = Vec::with_capacity(ws.len());
    for (wi, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        let (n, k) = (w.rows(), w.cols());
        assert_eq!(x.len(), m * k, "matmul: x is not [{m}, {k}]");
        assert_eq!(out.len(), m * n, "matmul: out is not [{m}, {n}]");
        ptrs.push(OutPtr(out.as_mut_ptr()));
        tasks.extend((0..n).step_by(ROWS_PER_TASK).map(|r0| (wi, r0, (r0 + ROWS_PER_TASK).min(n))));
    }
    if m == 0 {
        return;
    }
    let paths: Vec<Path> = ws.iter().map(|w| w.path()).collect();
    // x quantized once for every matrix the integer dots take.
    let int = paths.iter().any(|p| matches!(p, Path::Octets(_) | Path::Int(_)));
    let qx = int.then(|| QuantX::new(x, x.len() / m));
    // Σx per group (of the quantized x for the integer dots), once per group size: the
    // matrices of a call (q/k/v, gate/up) mostly share theirs.
    let mut sums: Vec<Vec<f32>> = Vec::new();
    let mut sums_of: Vec<usize> = Vec::with_capacity(paths.len());
    let mut made: Vec<(bool, usize)> = Vec::new();
    for p in &paths {
        let key = match p {
            Path::Octets(o) => (true, o.group),
            Path::Int(a) => (true, a.group),
            Path::Affine(a) => (false, a.group),
            Path::Dense(_) => (false, 0),
        };
        let i = made.iter().position(|&m| m == key).unwrap_or_else(|| {
            sums.push(match (key, &qx) {
                ((true, g), Some(q)) => q.group_sums(g),
                ((false, g), _) if g > 0 => x.chunks_exact(g).map(|c| c.iter().sum()).collect(),
                _ => Vec::new(),
            });
            made.push(key);
            made.len() - 1
        });
        sums_of.push(i);
    }
    // Scratch per rayon job, not per task (the head's 8192 tasks would allocate per task).
    tasks.par_iter().for_each_init(qdot::Scratch::default, |sc, &(wi, r0, r1)| {
        let out = Out { ptr: ptrs[wi], unit: ws[wi].unit, accumulate };
        let s = &sums[sums_of[wi]];
        match (&paths[wi], &qx) {
            (Path::Octets(o), Some(q)) => octet_rows(o, q, s, r0, r1, out),
            (Path::Int(a), Some(q)) => int_rows(a, q, s, r0, r1, sc, out),
            (Path::Affine(a), _) => affine_rows(a, x, s, m, r0, r1, out),
            (Path::Dense(d), _) => dense_rows(d, x, m, r0, r1, out),
            _ => unreachable!("x is quantized for every integer path"),
        }
    });
}

/// Columns r0..r1 of the product through the octet kernels (qdot_octets.rs).
fn octet_rows(o: &Octets, qx: &QuantX, sums: &[f32], r0: usize, r1: usize, out: Out) {
    use qdot::{Bf16Src, F16Src, F32Src};
    let (ptr, n) = (out.ptr.0, o.rows);
    macro_rules! run {
        ($lanes:expr, $s:expr, $b:expr) => {{
            let (scales, biases) = ($lanes($s), $lanes($b));
            let w = qdot::Mat {
                bytes: &o.q,
                cols: o.cols,
                group: o.group,
                scales,
                biases,
                unit: out.unit,
                accumulate: out.accumulate,
            };
            // SAFETY: Octets exist only where has_avx2 held (CpuMat::with_unit), VNNI's
            // form only where has_avx512_vnni holds; the tensor's lengths were checked when
            // it was built; out is [m, n] and this task alone writes its columns r0..r1,
            // from an octet's first row (ROWS_PER_TASK is a multiple of 8).
            unsafe {
                match (o.bits, simd::has_avx512_vnni()) {
                    (4, true) => qdot_octets::octet_rows_vnni::<4, _>(&w, qx, sums, (r0, r1), ptr, n),
                    (4, false) => qdot_octets::octet_rows::<4, _>(&w, qx, sums, (r0, r1), ptr, n),
                    (_, true) => qdot_octets::octet_rows_vnni::<8, _>(&w, qx, sums, (r0, r1), ptr, n),
                    (_, false) => qdot_octets::octet_rows::<8, _>(&w, qx, sums, (r0, r1), ptr, n),
                }
            }
        }};
    }
    match (&o.scales, &o.biases) {
        (Scales::F16(s), Scales::F16(b)) => run!(F16Src, bytemuck::cast_slice(s), bytemuck::cast_slice(b)),
        (Scales::BF16(s), Scales::BF16(b)) => run!(Bf16Src, bytemuck::cast_slice(s), bytemuck::cast_slice(b)),
        (Scales::F32(s), Scales::F32(b)) => run!(F32Src, s, b),
        _ => unreachable!("Octets::takes admits one scale dtype"),
    }
}

/// Columns r0..r1 of the product through the integer dot (qdot.rs).
fn int_rows(a: &AffineTensor, qx: &QuantX, sums: &[f32], r0: usize, r1: usize, sc: &mut qdot::Scratch, out: Out) {
    let bytes: &[u8] = bytemuck::cast_slice(&a.packed);
    let (cols, group, unit, accumulate) = (a.cols, a.group, out.unit, out.accumulate);
    let out = out.ptr;
    // The same call for each scale dtype's source type.
    macro_rules! run {
        ($scales:expr, $biases:expr) => {{
            let (scales, biases) = ($scales, $biases);
            let w = qdot::Mat { bytes, cols, group, scales, biases, unit, accumulate };
            int_bits(a.bits, &w, qx, sums, (r0, r1), sc, out, a.rows)
        }};
    }
    match (&a.scales, &a.biases) {
        (Scales::F16(s), Scales::F16(b)) => {
            run!(qdot::F16Src(bytemuck::cast_slice(s)), qdot::F16Src(bytemuck::cast_slice(b)))
        }
        (Scales::BF16(s), Scales::BF16(b)) => {
            run!(qdot::Bf16Src(bytemuck::cast_slice(s)), qdot::Bf16Src(bytemuck::cast_slice(b)))
        }
        (Scales::F32(s), Scales::F32(b)) => run!(qdot::F32Src(s), qdot::F32Src(b)),
        _ => unreachable!("qdot::takes admits one scale dtype"),
    }
}

#[allow(clippy::too_many_arguments)]
fn int_bits<S: qdot::ScaleSrc>(
    bits: u32,
    w: &qdot::Mat<S>,
    qx: &QuantX,
    sums: &[f32],
    rows: (usize, usize),
    sc: &mut qdot::Scratch,
    out: OutPtr,
    n: usize,
) {
    let (r0, r1) = rows;
    let out = out.0;
    macro_rules! by_bits {
        ($rows:ident) => {
            match bits {
                2 => qdot::$rows::<2, S>(w, qx, sums, (r0, r1), sc, out, n),
                3 => qdot::$rows::<3, S>(w, qx, sums, (r0, r1), sc, out, n),
                4 => qdot::$rows::<4, S>(w, qx, sums, (r0, r1), sc, out, n),
                5 => qdot::$rows::<5, S>(w, qx, sums, (r0, r1), sc, out, n),
                6 => qdot::$rows::<6, S>(w, qx, sums, (r0, r1), sc, out, n),
                _ => qdot::$rows::<8, S>(w, qx, sums, (r0, r1), sc, out, n),
            }
        };
    }
    // rows_vnni: the same bits with eight-row tiles, where AVX-512 VNNI is present and x
    // has eight rows or more (fewer rows through it measured no faster, one-row decode
    // slower in some rounds).
    // SAFETY: AVX2+FMA+F16C present (has_avx2), AVX-512 F/VL/BW/VNNI where rows_vnni runs
    // (has_avx512_vnni); the tensor's lengths were checked when it was built; out is [m, n]
    // and this task alone writes its columns r0..r1; qx is the call's x (products).
    unsafe {
        if qx.rows >= 8 && simd::has_avx512_vnni() {
            by_bits!(rows_vnni)
        } else {
            by_bits!(rows)
        }
    }
}

/// Scales or biases of row r as f32 (F16C conversion where available).
fn row_scales(s: &Scales, start: usize, out: &mut [f32], simd: bool) {
    match s {
        // SAFETY: AVX2+F16C present when simd is true; lengths are equal.
        Scales::F16(v) if simd => unsafe { simd::f16_to_f32(bytemuck::cast_slice(&v[start..start + out.len()]), out) },
        _ => s.read_into(start, out),
    }
}

fn affine_rows(a: &AffineTensor, x: &[f32], xs: &[f32], m: usize, r0: usize, r1: usize, out: Out) {
    let (k, g, n) = (a.cols, a.group, a.rows);
    let gpr = k / g;
    let simd = simd::has_avx2();
    let mut scales = vec![0f32; gpr];
    let mut biases = vec![0f32; gpr];
    let mut q = vec![0f32; k];
    for r in r0..r1 {
        let words = a.row_words(r);
        row_scales(&a.scales, r * gpr, &mut scales, simd);
        row_scales(&a.biases, r * gpr, &mut biases, simd);
        // Unpack once, reuse for all m rows of x.
        match a.bits {
            // SAFETY: as above.
            2 if simd => unsafe { simd::unpack::<2>(words, &mut q) },
            3 if simd => unsafe { simd::unpack::<3>(words, &mut q) },
            4 if simd => unsafe { simd::unpack::<4>(words, &mut q) },
            5 if simd => unsafe { simd::unpack::<5>(words, &mut q) },
            6 if simd => unsafe { simd::unpack::<6>(words, &mut q) },
            8 if simd => unsafe { simd::unpack::<8>(words, &mut q) },
            bits => q.iter_mut().enumerate().for_each(|(i, v)| *v = get_q(words, bits, i) as f32),
        }
        // One x row's unit over columns c: its groups' dot, then their bias term.
        let unit = |i: usize, c: std::ops::Range<usize>| -> f32 {
            let (xr, gs) = (&x[i * k + c.start..i * k + c.end], c.start / g..c.end / g);
            let d = if simd {
                // SAFETY: AVX2+FMA present; q and x's unit are as long, a multiple of g ≥ 16.
                unsafe { simd::dot_groups(&q[c.clone()], xr, &scales[gs.clone()], g) }
            } else {
                q[c].chunks_exact(g)
                    .zip(xr.chunks_exact(g))
                    .zip(&scales[gs.clone()])
                    .map(|((a, b), s)| s * dot_scalar(a, b))
                    .sum()
            };
            d + dot(&biases[gs.clone()], &xs[i * gpr + gs.start..i * gpr + gs.end])
        };
        for i in 0..m {
            // SAFETY: (i, r) is inside out's [m, n] and only this task writes rows r0..r1.
            unsafe { out.store(i * n + r, k, |c| unit(i, c)) }
        }
    }
}

fn dense_rows(d: &DenseTensor, x: &[f32], m: usize, r0: usize, r1: usize, out: Out) {
    let (k, n) = (d.cols, d.rows);
    let mut row = vec![0f32; k];
    for r in r0..r1 {
        d.row_f32(r, &mut row);
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            // SAFETY: (i, r) is inside out's [m, n] and only this task writes rows r0..r1.
            unsafe { out.store(i * n + r, k, |c| dot(&row[c.clone()], &xr[c])) }
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
        let k = 256;
        let mut seed = 12345u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        // 4- and 8-bit matrices with groups of 32 or more take octets.rs' layout: 37 rows end
        // in a partial octet, 40 in a whole one.
        for n in [37, 40] {
            let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            for bits in [2, 3, 4, 5, 6, 8] {
                for group in [32, 64, 128] {
                    for dtype in [ScaleDtype::BF16, ScaleDtype::F16, ScaleDtype::F32] {
                        for m in [1, 3, 6] {
                            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
                            let q = AffineTensor::quantize(&w, n, k, bits, group, dtype).unwrap();
                            let want = reference(&x, m, &q.dequantize(), n, k);
                            let mut got = vec![f32::NAN; m * n];
                            matmul(&x, m, &Weight::Affine(q), &mut got);
                            for (a, b) in got.iter().zip(&want) {
                                assert!(
                                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                    "n {n} bits {bits} g {group} m {m}: {a} vs {b}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A row's product is the same whatever the call's other rows (batch invariance): row
    /// i of an m-row call equals row i of a 9-row call, bit for bit, for every m, in the
    /// integer path (every layout and group kind) and the f32 one (a width not a multiple
    /// of 32).
    #[test]
    fn rows_do_not_depend_on_the_row_count() {
        for (bits, group, k) in [(3, 64, 128), (4, 32, 128), (4, 128, 256), (8, 32, 128), (5, 16, 128), (4, 16, 48)] {
            let n = 24;
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
            let x: Vec<f32> = (0..9 * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let a = Weight::Affine(AffineTensor::quantize(&w, n, k, bits, group, ScaleDtype::F16).unwrap());
            let mut all = vec![0f32; 9 * n];
            matmul(&x, 9, &a, &mut all);
            for m in 1..9 {
                let mut got = vec![0f32; m * n];
                matmul(&x[..m * k], m, &a, &mut got);
                let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits_of(&got), bits_of(&all[..m * n]), "{bits}-bit g{group} k {k}, {m} rows");
            }
        }
    }

    #[test]
    fn matmul_many_equals_separate_matmuls() {
        let k = 64;
        let w1: Vec<f32> = (0..40 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        let w2: Vec<f32> = (0..70 * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 90.0).collect();
        let a = Weight::Affine(AffineTensor::quantize(&w1, 40, k, 4, 32, ScaleDtype::F16).unwrap());
        let b = Weight::Dense(crate::quant::DenseTensor { rows: 70, cols: k, data: crate::quant::DenseData::F32(w2) });
        let x: Vec<f32> = (0..2 * k).map(|i| (i as f32).sin()).collect();
        let (mut o1, mut o2) = (vec![f32::NAN; 80], vec![f32::NAN; 140]);
        matmul_many(&x, 2, &[&CpuMat::new(a.clone()), &CpuMat::new(b.clone())], &mut [&mut o1, &mut o2]);
        let (mut s1, mut s2) = (vec![0f32; 80], vec![0f32; 140]);
        matmul(&x, 2, &a, &mut s1);
        matmul(&x, 2, &b, &mut s2);
        assert_eq!((o1, o2), (s1, s2));
    }

    /// A matrix summed in units gives, cut at a unit boundary, the same bits part after
    /// part (the first part's sums continued by the second's) as whole, for every x row
    /// count (the tiles of 1-4 rows), quantized (each kernel layout) and dense; units of
    /// 128 and of 32 columns (16 units), parts of one unit (summed as a whole row) and of
    /// several.
    #[test]
    fn parts_continued_in_order_sum_as_the_whole() {
        // The octet layout where it applies, 20 rows ending in a partial octet.
        for n in [20, 24] {
            let k = 512;
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
            let mut weights: Vec<Weight> = [(4, 32), (8, 32), (4, 64), (3, 32), (5, 16), (6, 128)]
                .into_iter()
                .map(|(bits, group)| {
                    Weight::Affine(AffineTensor::quantize(&w, n, k, bits, group, ScaleDtype::F16).unwrap())
                })
                .collect();
            weights.push(Weight::Dense(crate::quant::DenseTensor {
                rows: n,
                cols: k,
                data: crate::quant::DenseData::F32(w),
            }));
            for unit in [128, 32] {
                for wt in weights.iter().filter(|w| w.cuts_at(unit)) {
                    let whole = CpuMat::in_units(wt.clone(), unit);
                    assert_eq!(whole.unit, unit, "{}", wt.describe());
                    for cut in [unit, 3 * unit, k - unit] {
                        let (a, b) = (
                            CpuMat::in_units(wt.cols_part(0..cut).unwrap(), unit),
                            CpuMat::in_units(wt.cols_part(cut..k).unwrap(), unit),
                        );
                        for m in 1..7 {
                            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
                            let xa: Vec<f32> = x.chunks(k).flat_map(|r| r[..cut].to_vec()).collect();
                            let xb: Vec<f32> = x.chunks(k).flat_map(|r| r[cut..].to_vec()).collect();
                            let mut want = vec![0f32; m * n];
                            matmul_many(&x, m, &[&whole], &mut [&mut want]);
                            let mut got = vec![0f32; m * n];
                            matmul_many(&xa, m, &[&a], &mut [&mut got]);
                            matmul_continue(&xb, m, &b, &mut got);
                            let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            let what = format!("{}, units of {unit}, cut at {cut}, {m} rows", wt.describe());
                            assert_eq!(bits_of(&got), bits_of(&want), "{what}");
                        }
                    }
                }
            }
        }
    }
}
