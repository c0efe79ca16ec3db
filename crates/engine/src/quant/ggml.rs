//! GGUF tensor types and their import into the affine format.
//!
//! Legacy 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) map losslessly onto affine groups
//! of 32 with f16 scale/bias (the offsets −8d, −16d, −128d are exact in f16 unless they
//! overflow it; a tensor where one does keeps f32 scales/biases instead). Elements in
//! ggml's 4/5-bit blocks are stored low nibbles first (j and j+16 share a byte); we
//! re-pack them into our LSB-first stream. K-quants (kquants.rs) get f32 scales: the
//! product of the super-block scale and a 6/8-bit sub-scale does not fit f16.

use super::affine::{set_q, AffineTensor, Scales};
use super::{DenseData, DenseTensor, Weight};
use crate::{Error, Result};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    /// ggml's type id (the inverse of `from_id`), as written in GGUF tensor infos.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
        }
    }
    /// Map ggml's type id; `None` for types ferrolm does not import.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }
    /// (elements per block, bytes per block)
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
        }
    }
    /// Bytes for `n` elements, or an error when `n` is not whole blocks.
    pub fn byte_size(self, n: usize) -> Option<usize> {
        let (be, bb) = self.block();
        n.is_multiple_of(be).then(|| n / be * bb)
    }
}

/// Import one GGUF tensor `[rows, cols]` (cols = ggml's ne0, the contiguous input dim).
pub fn import(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Result<Weight> {
    let need = ty.byte_size(rows * cols).filter(|_| cols.is_multiple_of(ty.block().0));
    if need != Some(data.len()) {
        return Err(Error::Invalid(format!(
            "{} tensor [{rows}, {cols}] needs {:?} bytes (whole blocks per row), got {}",
            ty.name(),
            need,
            data.len()
        )));
    }
    let dense = |d: DenseData| Ok(Weight::Dense(DenseTensor { rows, cols, data: d }));
    match ty {
        GgmlType::F32 => dense(DenseData::F32(bytemuck::pod_collect_to_vec(data))),
        GgmlType::F16 => dense(DenseData::F16(
            bytemuck::pod_collect_to_vec::<u8, u16>(data).into_iter().map(f16::from_bits).collect(),
        )),
        GgmlType::BF16 => dense(DenseData::BF16(
            bytemuck::pod_collect_to_vec::<u8, u16>(data).into_iter().map(bf16::from_bits).collect(),
        )),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            legacy(ty, data, rows, cols)
        }
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => super::kquants::import(ty, data, rows, cols),
    }
}

#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Legacy 32-element blocks → affine groups of 32 with f16 scale and bias, bit-exact.
fn legacy(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Result<Weight> {
    let (_, bb) = ty.block();
    let bits: u32 = match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => 4,
        GgmlType::Q5_0 | GgmlType::Q5_1 => 5,
        _ => 8,
    };
    let nblocks = rows * cols / 32;
    let wpb = bits as usize; // 32 values × bits / 32
    let mut packed = vec![0u32; nblocks * wpb];
    let mut scales = Vec::with_capacity(nblocks);
    let mut biases = Vec::with_capacity(nblocks);
    let mut q = [0u32; 32];
    for (b, blk) in data.chunks_exact(bb).enumerate() {
        let d = f16_at(blk, 0);
        // −k·d is exact in f32 (k a power of two); whether it fits f16 is checked below.
        let (bias, qs) = match ty {
            GgmlType::Q4_0 => (-8.0 * d.to_f32(), &blk[2..18]),
            GgmlType::Q4_1 => (f16_at(blk, 2).to_f32(), &blk[4..20]),
            GgmlType::Q5_0 => (-16.0 * d.to_f32(), &blk[2..22]),
            GgmlType::Q5_1 => (f16_at(blk, 2).to_f32(), &blk[4..24]),
            _ => (-128.0 * d.to_f32(), &blk[2..34]),
        };
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                for j in 0..16 {
                    q[j] = (qs[j] & 0x0f) as u32;
                    q[j + 16] = (qs[j] >> 4) as u32;
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let qh = u32::from_le_bytes([qs[0], qs[1], qs[2], qs[3]]);
                let ql = &qs[4..20];
                for j in 0..16 {
                    q[j] = (ql[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4;
                    q[j + 16] = (ql[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                }
            }
            _ => {
                for j in 0..32 {
                    q[j] = (qs[j] as i8 as i32 + 128) as u32;
                }
            }
        }
        let words = &mut packed[b * wpb..(b + 1) * wpb];
        for (j, &v) in q.iter().enumerate() {
            set_q(words, bits, j, v);
        }
        scales.push(d);
        biases.push(bias);
    }
    // |d| > 8188 (Q4_0) or > 511 (Q8_0) makes −k·d overflow f16, though ggml's d·(q − k)
    // stays finite; keep such a tensor in f32 rather than store an infinite bias.
    let f16_exact = biases.iter().all(|&b: &f32| f16::from_f32(b).to_f32() == b || b.is_nan());
    let (scales, biases) = if f16_exact {
        (Scales::F16(scales), Scales::F16(biases.into_iter().map(f16::from_f32).collect()))
    } else {
        (Scales::F32(scales.into_iter().map(f16::to_f32).collect()), Scales::F32(biases))
    };
    Ok(Weight::Affine(AffineTensor::new(rows, cols, bits, 32, packed, scales, biases)?))
}
