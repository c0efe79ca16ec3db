//! The one internal weight format: MLX-style affine groups.
//!
//! A matrix `[rows (out), cols (in)]` is split along the input dim into groups of `group`
//! values; each group has a `scale` and a `bias` and w ≈ scale·q + bias with
//! q ∈ [0, 2^bits). Each row's q values form one continuous LSB-first bit stream stored in
//! little-endian u32 words (value i at bits [i·bits, (i+1)·bits)). For 2/4/8 bits that is
//! MLX's u32 packing; for 3/5/6 bits it equals MLX's byte packing (8 values in 3/5 bytes,
//! 4 values in 3 bytes), so MLX files load without repacking.

use crate::{Error, Result};
use half::{bf16, f16};

pub const BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
pub const GROUPS: [usize; 4] = [16, 32, 64, 128];

/// Precision of scales/biases; kept from the source so imports are lossless.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleDtype {
    F16,
    BF16,
    F32,
}

impl ScaleDtype {
    pub fn name(self) -> &'static str {
        match self {
            ScaleDtype::F16 => "f16",
            ScaleDtype::BF16 => "bf16",
            ScaleDtype::F32 => "f32",
        }
    }
    pub fn size(self) -> usize {
        match self {
            ScaleDtype::F32 => 4,
            _ => 2,
        }
    }
}

/// Per-group scales or biases in their source precision.
#[derive(Clone, Debug)]
pub enum Scales {
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
}

impl Scales {
    pub fn from_f32(v: &[f32], dtype: ScaleDtype) -> Scales {
        match dtype {
            ScaleDtype::F16 => Scales::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            ScaleDtype::BF16 => Scales::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            ScaleDtype::F32 => Scales::F32(v.to_vec()),
        }
    }
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Scales::F16(v) => v[i].to_f32(),
            Scales::BF16(v) => v[i].to_f32(),
            Scales::F32(v) => v[i],
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Scales::F16(v) => v.len(),
            Scales::BF16(v) => v.len(),
            Scales::F32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> ScaleDtype {
        match self {
            Scales::F16(_) => ScaleDtype::F16,
            Scales::BF16(_) => ScaleDtype::BF16,
            Scales::F32(_) => ScaleDtype::F32,
        }
    }
    /// Copy `out.len()` values starting at `start` into f32.
    #[inline]
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        use half::slice::HalfFloatSliceExt;
        match self {
            // Slice conversion uses F16C where the CPU has it (the hot path reads scales per row).
            Scales::F16(v) => v[start..start + n].convert_to_f32_slice(out),
            Scales::BF16(v) => v[start..start + n].convert_to_f32_slice(out),
            Scales::F32(v) => out.copy_from_slice(&v[start..start + n]),
        }
    }
    /// Values [0, n).
    pub fn prefix(&self, n: usize) -> Scales {
        match self {
            Scales::F16(v) => Scales::F16(v[..n].to_vec()),
            Scales::BF16(v) => Scales::BF16(v[..n].to_vec()),
            Scales::F32(v) => Scales::F32(v[..n].to_vec()),
        }
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.read_into(0, &mut out);
        out
    }
    pub fn byte_size(&self) -> usize {
        self.len() * self.dtype().size()
    }
}

/// A quantized matrix `[rows, cols]` in affine groups along `cols`.
#[derive(Clone, Debug)]
pub struct AffineTensor {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group: usize,
    /// `rows × words_per_row()` u32 words.
    pub packed: Vec<u32>,
    /// `rows × cols/group`.
    pub scales: Scales,
    pub biases: Scales,
}

pub fn check_scheme(bits: u32, group: usize, cols: usize) -> Result<()> {
    if !BITS.contains(&bits) {
        return Err(Error::Unsupported(format!("{bits}-bit affine quantization (supported: 2,3,4,5,6,8)")));
    }
    if !GROUPS.contains(&group) {
        return Err(Error::Unsupported(format!("affine group size {group} (supported: 16,32,64,128)")));
    }
    if !cols.is_multiple_of(group) || !(cols * bits as usize).is_multiple_of(32) {
        return Err(Error::Invalid(format!(
            "input dim {cols} is not a multiple of group {group} (or its {bits}-bit row is not whole u32 words)"
        )));
    }
    Ok(())
}

impl AffineTensor {
    /// Assemble from parts, checking every length.
    pub fn new(
        rows: usize,
        cols: usize,
        bits: u32,
        group: usize,
        packed: Vec<u32>,
        scales: Scales,
        biases: Scales,
    ) -> Result<Self> {
        check_scheme(bits, group, cols)?;
        let t = AffineTensor { rows, cols, bits, group, packed, scales, biases };
        let ng = rows * (cols / group);
        if t.packed.len() != rows * t.words_per_row() || t.scales.len() != ng || t.biases.len() != ng {
            return Err(Error::Invalid(format!(
                "affine tensor [{rows}, {cols}] {bits}-bit g{group}: got {} words, {} scales, {} biases; expected {}, {ng}, {ng}",
                t.packed.len(),
                t.scales.len(),
                t.biases.len(),
                rows * t.words_per_row()
            )));
        }
        Ok(t)
    }

    #[inline]
    pub fn words_per_row(&self) -> usize {
        self.cols * self.bits as usize / 32
    }
    #[inline]
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group
    }
    pub fn row_words(&self, r: usize) -> &[u32] {
        let w = self.words_per_row();
        &self.packed[r * w..(r + 1) * w]
    }
    pub fn byte_size(&self) -> usize {
        self.packed.len() * 4 + self.scales.byte_size() + self.biases.byte_size()
    }

    /// The same tensor with its q values re-packed at `bits` ≥ its own width: scales and
    /// biases unchanged, so it dequantizes to exactly the same values (a backend without a
    /// kernel for 3/5/6-bit streams runs them as 4- or 8-bit).
    pub fn widen(&self, bits: u32) -> Result<AffineTensor> {
        if bits < self.bits {
            return Err(Error::Invalid(format!("widening {}-bit weights to {bits} bits", self.bits)));
        }
        check_scheme(bits, self.group, self.cols)?;
        let wpr = self.cols * bits as usize / 32;
        let mut packed = vec![0u32; self.rows * wpr];
        for (r, out) in packed.chunks_mut(wpr).enumerate() {
            let words = self.row_words(r);
            for i in 0..self.cols {
                set_q(out, bits, i, get_q(words, self.bits, i));
            }
        }
        AffineTensor::new(self.rows, self.cols, bits, self.group, packed, self.scales.clone(), self.biases.clone())
    }

    /// Rows [0, n) as a tensor of their own (n ≤ rows).
    pub fn first_rows(&self, n: usize) -> Result<AffineTensor> {
        let n = n.min(self.rows);
        let (w, g) = (n * self.words_per_row(), n * self.groups_per_row());
        let packed = self.packed[..w].to_vec();
        AffineTensor::new(n, self.cols, self.bits, self.group, packed, self.scales.prefix(g), self.biases.prefix(g))
    }

    /// Dequantize row `r` into `out` (len `cols`), f32.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let words = self.row_words(r);
        let gpr = self.groups_per_row();
        for g in 0..gpr {
            let s = self.scales.get(r * gpr + g);
            let b = self.biases.get(r * gpr + g);
            let span = g * self.group..(g + 1) * self.group;
            for (i, o) in span.clone().zip(&mut out[span]) {
                // Two roundings (mul, add), never fused: GGUF parity depends on it.
                *o = s * get_q(words, self.bits, i) as f32 + b;
            }
        }
    }

    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols).enumerate() {
            self.dequant_row(r, row);
        }
        out
    }

    /// Quantize an f32 matrix with MLX's `affine_quantize` rule (see `quantize_group`).
    pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: u32, group: usize, dtype: ScaleDtype) -> Result<Self> {
        check_scheme(bits, group, cols)?;
        if w.len() != rows * cols {
            return Err(Error::Invalid(format!("quantize: {} values for [{rows}, {cols}]", w.len())));
        }
        let wpr = cols * bits as usize / 32;
        let mut packed = vec![0u32; rows * wpr];
        let ng = rows * (cols / group);
        let (mut scales, mut biases) = (vec![0f32; ng], vec![0f32; ng]);
        let mut q = vec![0u32; group];
        for r in 0..rows {
            let words = &mut packed[r * wpr..(r + 1) * wpr];
            for g in 0..cols / group {
                let gi = r * (cols / group) + g;
                let vals = &w[r * cols + g * group..r * cols + (g + 1) * group];
                let (s, b) = quantize_group(vals, bits, dtype, &mut q);
                scales[gi] = s;
                biases[gi] = b;
                for (j, &qv) in q.iter().enumerate() {
                    set_q(words, bits, g * group + j, qv);
                }
            }
        }
        AffineTensor::new(
            rows,
            cols,
            bits,
            group,
            packed,
            Scales::from_f32(&scales, dtype),
            Scales::from_f32(&biases, dtype),
        )
    }
}

/// MLX `affine_quantize` for one group (MLX's CPU kernel, `quantize` in
/// backend/cpu/quantized.cpp, op for op in f32): returns (scale, bias) as stored (rounded to
/// `dtype`, returned as f32) and writes q.
///
/// n_bins = 2^bits−1; scale = max((wmax−wmin)/n_bins, 1e-7), negated unless |wmin| > |wmax|;
/// the edge with the larger magnitude is snapped onto the grid (q0 = rint(edge/scale),
/// scale = edge/q0, bias = edge) unless q0 = 0 (then bias = 0); q = clamp(rint((w−bias)/scale),
/// 0, n_bins). Two details decide bit-exactness: `rint` rounds ties to even (not away from
/// zero), and q is computed from the f32 scale/bias *before* they are rounded to `dtype`.
pub fn quantize_group(vals: &[f32], bits: u32, dtype: ScaleDtype, q: &mut [u32]) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    // std::max/std::min semantics (keep the first on ties), so signed zeros match MLX.
    let (mut wmin, mut wmax) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in vals {
        if wmax < v {
            wmax = v;
        }
        if v < wmin {
            wmin = v;
        }
    }
    let mask = wmin.abs() > wmax.abs();
    let range = (wmax - wmin) / n_bins;
    let mut scale = if range < eps { eps } else { range };
    scale = if mask { scale } else { -scale };
    let edge = if mask { wmin } else { wmax };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    for (qi, &v) in q.iter_mut().zip(vals) {
        *qi = ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32;
    }
    (round_to(scale, dtype), round_to(bias, dtype))
}

#[inline]
pub fn round_to(x: f32, dtype: ScaleDtype) -> f32 {
    match dtype {
        ScaleDtype::F16 => f16::from_f32(x).to_f32(),
        ScaleDtype::BF16 => bf16::from_f32(x).to_f32(),
        ScaleDtype::F32 => x,
    }
}

/// Read value `i` of a packed LSB-first bit stream.
#[inline]
pub fn get_q(words: &[u32], bits: u32, i: usize) -> u32 {
    let bit = i * bits as usize;
    let (w, off) = (bit / 32, (bit % 32) as u32);
    let lo = words[w] as u64;
    let hi = if off + bits > 32 { words[w + 1] as u64 } else { 0 };
    (((hi << 32) | lo) >> off) as u32 & ((1u32 << bits) - 1)
}

/// Write value `i` (< 2^bits) of a packed LSB-first bit stream (the slot must be zero).
#[inline]
pub fn set_q(words: &mut [u32], bits: u32, i: usize, q: u32) {
    let bit = i * bits as usize;
    let (w, off) = (bit / 32, (bit % 32) as u32);
    let v = (q as u64) << off;
    words[w] |= v as u32;
    if off + bits > 32 {
        words[w + 1] |= (v >> 32) as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_keeps_every_value() {
        let mut seed = 7u64;
        let w: Vec<f32> = (0..8 * 128)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        for bits in [2, 3, 4, 5, 6] {
            for group in [32, 64] {
                let a = AffineTensor::quantize(&w, 8, 128, bits, group, ScaleDtype::F16).unwrap();
                for to in [4, 8].into_iter().filter(|&to| to >= bits) {
                    let b = a.widen(to).unwrap();
                    assert_eq!((b.bits, b.group), (to, group));
                    assert_eq!(a.dequantize(), b.dequantize(), "{bits}-bit g{group} widened to {to}");
                    assert!(b.widen(to - 1).is_err());
                }
            }
        }
    }

    #[test]
    fn pack_roundtrip_all_bits() {
        for bits in BITS {
            let n = 128;
            let mut words = vec![0u32; n * bits as usize / 32];
            let vals: Vec<u32> = (0..n).map(|i| (i as u32).wrapping_mul(2654435761) >> (32 - bits)).collect();
            for (i, &v) in vals.iter().enumerate() {
                set_q(&mut words, bits, i, v);
            }
            for (i, &v) in vals.iter().enumerate() {
                assert_eq!(get_q(&words, bits, i), v, "bits {bits} i {i}");
            }
        }
    }

    #[test]
    fn quantize_error_is_bounded_by_one_step() {
        let (rows, cols) = (4, 128);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        for bits in BITS {
            let t = AffineTensor::quantize(&w, rows, cols, bits, 32, ScaleDtype::F32).unwrap();
            let d = t.dequantize();
            for r in 0..rows {
                for g in 0..cols / 32 {
                    let s = t.scales.get(r * 4 + g).abs();
                    for i in g * 32..(g + 1) * 32 {
                        let e = (d[r * cols + i] - w[r * cols + i]).abs();
                        // MLX snaps one edge onto the grid: the far edge may miss by up to a step.
                        assert!(e <= s + 1e-6, "bits {bits}: err {e} > step {s}");
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_bad_schemes() {
        assert!(check_scheme(7, 32, 64).is_err());
        assert!(check_scheme(4, 48, 96).is_err());
        assert!(check_scheme(4, 32, 48).is_err());
    }
}
