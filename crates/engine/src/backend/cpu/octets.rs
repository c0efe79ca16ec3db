//! Affine 4- and 8-bit matrices laid out for the CPU's integer dot eight weight rows at a
//! time ("octets"): one vector's 8 lanes are 8 output columns, so a 32-value block's
//! integer sums for 8 rows are converted, scaled and added by one instruction each, where
//! the row-major layout (qdot.rs) pays those per row and block and sums 8 lanes a row at
//! the end. With x quantized as in qdot.rs, each `vpmaddwd` (or VNNI `vpdpwssd`) pairs one
//! weight vector (8 rows × 2 values) with one broadcast pair of x values.
//!
//! Layout: per (octet o, block b of 32 columns), 32·bits bytes in 16-byte chunks; byte
//! 2l + e of a chunk belongs to row 8o + l. 4-bit: chunk c (0..8) holds columns 2c + e in
//! its low nibbles and 16 + 2c + e in its high ones (one widening, then a mask and a shift,
//! give both vectors). 8-bit: chunk c (0..16) holds columns 2c + e. Scales and biases per
//! (octet, group) as 8 consecutive values (the rows'), in the source's dtype.
//!
//! A matrix takes this layout when `Octets::takes` it (CpuMat::new), whatever the calls'
//! row counts, so a row's product stays the same alone and batched.

use super::qdot::XB;
use crate::quant::affine::{AffineTensor, Scales};
use rayon::prelude::*;

/// Weight rows an octet holds: the lanes of one f32 vector.
pub const OCT: usize = 8;

/// An affine matrix in octet layout (see the module's documentation): `rows` rows, held as
/// whole octets (the last one padded with zero rows).
#[derive(Clone, Debug)]
pub struct Octets {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group: usize,
    pub q: Vec<u8>,
    pub scales: Scales,
    pub biases: Scales,
}

impl Octets {
    /// Whether the octet kernels take this matrix: one the integer dot takes (qdot.rs), of 4
    /// or 8 bits and groups of whole 32-value blocks. (A last octet of fewer rows is padded with
    /// zero rows, so that the row count never decides a matrix's arithmetic: a vocabulary
    /// cut to the tokenizer's ids scores them as the whole head does.)
    pub fn takes(a: &AffineTensor) -> bool {
        super::qdot::takes(a) && matches!(a.bits, 4 | 8) && a.group.is_multiple_of(XB) && a.rows > 0
    }

    /// `a` re-laid (`takes(a)` must hold).
    pub fn from_affine(a: &AffineTensor) -> Octets {
        assert!(Self::takes(a), "octet layout: {}-bit g{} [{}, {}]", a.bits, a.group, a.rows, a.cols);
        let padded = a.rows.next_multiple_of(OCT);
        let mut q = vec![0u8; padded * a.cols * a.bits as usize / 8];
        // Octet by octet in parallel (each its own bytes): a large model's load would
        // otherwise wait seconds on this.
        q.par_chunks_mut(OCT * a.cols * a.bits as usize / 8).enumerate().for_each(|(o, q)| {
            for r in o * OCT..(o * OCT + OCT).min(a.rows) {
                Self::place_row(a, r, q);
            }
        });
        let gpr = a.cols / a.group;
        let order: Vec<Option<usize>> = (0..padded * gpr).map(|i| Self::source_of(i, gpr, a.rows)).collect();
        Octets {
            rows: a.rows,
            cols: a.cols,
            bits: a.bits,
            group: a.group,
            q,
            scales: permute(&a.scales, &order),
            biases: permute(&a.biases, &order),
        }
    }

    /// Row r of `a` into its octet's bytes `q`, block by block. The packed stream is LSB
    /// first, so a 4-bit block's 16 bytes hold values 2k and 2k + 1 in byte k's low and high
    /// nibbles, and an 8-bit block's 32 bytes value k in byte k.
    fn place_row(a: &AffineTensor, r: usize, q: &mut [u8]) {
        let bytes: &[u8] = bytemuck::cast_slice(a.row_words(r));
        let (l, bb) = (r % OCT, XB * a.bits as usize / 8);
        for (b, src) in bytes.chunks_exact(bb).enumerate() {
            let dst = &mut q[b * OCT * bb..][..OCT * bb];
            if a.bits == 4 {
                // Chunk c, byte 2l + e: value 2c + e low, value 16 + 2c + e high.
                for c in 0..8 {
                    let (lo, hi) = (src[c], src[8 + c]);
                    dst[16 * c + 2 * l] = (lo & 0x0f) | (hi << 4);
                    dst[16 * c + 2 * l + 1] = (lo >> 4) | (hi & 0xf0);
                }
            } else {
                // Chunk c, byte 2l + e: value 2c + e.
                for c in 0..16 {
                    dst[16 * c + 2 * l..][..2].copy_from_slice(&src[2 * c..2 * c + 2]);
                }
            }
        }
    }

    /// The byte holding value (r, c) and the shift of its bits in it.
    fn place(bits: u32, cols: usize, r: usize, c: usize) -> (usize, u32) {
        let (o, l, b, v) = (r / OCT, r % OCT, c / XB, c % XB);
        let (chunk, shift) = match bits {
            4 => ((v % 16) / 2, if v < 16 { 0 } else { 4 }),
            _ => (v / 2, 0),
        };
        let base = (o * (cols / XB) + b) * XB * bits as usize;
        (base + chunk * 16 + 2 * l + v % 2, shift)
    }

    /// The row-major (row, group) index whose scale goes to octet-layout slot `i` (none for
    /// the padding rows of a last octet).
    fn source_of(i: usize, gpr: usize, rows: usize) -> Option<usize> {
        let (o, g, l) = (i / (gpr * OCT), i / OCT % gpr, i % OCT);
        let r = o * OCT + l;
        (r < rows).then_some(r * gpr + g)
    }

    /// Row r dequantized, as `AffineTensor::dequant_row` does it (s·q + b, two roundings).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let gpr = self.cols / self.group;
        let mask = (1u32 << self.bits) - 1;
        for (c, o) in out.iter_mut().enumerate() {
            let (at, shift) = Self::place(self.bits, self.cols, r, c);
            let slot = ((r / OCT) * gpr + c / self.group) * OCT + r % OCT;
            let q = (self.q[at] as u32 >> shift) & mask;
            *o = self.scales.get(slot) * q as f32 + self.biases.get(slot);
        }
    }

    pub fn byte_size(&self) -> usize {
        self.q.len() + self.scales.byte_size() + self.biases.byte_size()
    }
}

/// `s` reordered: slot i takes `s[order[i]]`, or zero.
fn permute(s: &Scales, order: &[Option<usize>]) -> Scales {
    fn pick<T: Copy + Default>(v: &[T], order: &[Option<usize>]) -> Vec<T> {
        order.iter().map(|i| i.map_or(T::default(), |i| v[i])).collect()
    }
    match s {
        Scales::F16(v) => Scales::F16(pick(v, order)),
        Scales::BF16(v) => Scales::BF16(pick(v, order)),
        Scales::F32(v) => Scales::F32(pick(v, order)),
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
#[path = "octets_tests.rs"]
mod tests;
