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
use rayon::prelude::*;

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

/// Input bytes per parallel task: big enough that scheduling is noise next to the work,
/// small enough that a 512×2048 Q4_0 tensor (590 KB) still spreads over 16 cores.
const PAR_BYTES: usize = 32 << 10;

/// Convert the blocks of `data` (`bb` bytes each) in parallel. Block b owns words
/// [b·wpb, (b+1)·wpb) of `packed` and slots [b·gpb, (b+1)·gpb) of `scales` and `biases`,
/// so blocks are independent and the result is the same as converting them in order.
/// `f` gets runs of whole blocks with their matching output slices. (A 1B model is ~40M
/// blocks: converting them on one core made this, not reading the file, most of a load.)
pub(crate) fn par_blocks<S: Send, B: Send>(
    data: &[u8],
    bb: usize,
    (packed, wpb): (&mut [u32], usize),
    (scales, biases, gpb): (&mut [S], &mut [B], usize),
    f: impl Fn(&[u8], &mut [u32], &mut [S], &mut [B]) + Sync,
) {
    let n = data.len() / bb;
    assert!(n * bb == data.len() && packed.len() == n * wpb && scales.len() == n * gpb && biases.len() == n * gpb);
    let per_task = (PAR_BYTES / bb).max(1);
    data.par_chunks(bb * per_task)
        .zip(packed.par_chunks_mut(wpb * per_task))
        .zip(scales.par_chunks_mut(gpb * per_task))
        .zip(biases.par_chunks_mut(gpb * per_task))
        .for_each(|(((d, p), s), b)| f(d, p, s, b));
}

/// Eight nibbles, one in the low half of each byte of `x`, packed LSB-first into a word.
#[inline]
fn nibbles(x: u64) -> u32 {
    let x = (x | x >> 4) & 0x00ff_00ff_00ff_00ff;
    let x = (x | x >> 8) & 0x0000_ffff_0000_ffff;
    (x | x >> 16) as u32
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
    super::advise_huge_pages(&packed);
    let mut scales = vec![f16::ZERO; nblocks];
    let mut biases = vec![0f32; nblocks];
    par_blocks(data, bb, (&mut packed, wpb), (&mut scales, &mut biases, 1), |data, packed, scales, biases| {
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
            let words = &mut packed[b * wpb..(b + 1) * wpb];
            match ty {
                // Word k holds values 8k..8k+8, a nibble each: words 0-1 are the low nibbles
                // of bytes 0..16 (values 0..16), words 2-3 their high nibbles (16..32).
                GgmlType::Q4_0 | GgmlType::Q4_1 => {
                    for h in 0..2 {
                        let x = u64::from_le_bytes(qs[8 * h..8 * h + 8].try_into().unwrap());
                        words[h] = nibbles(x & 0x0f0f_0f0f_0f0f_0f0f);
                        words[2 + h] = nibbles((x >> 4) & 0x0f0f_0f0f_0f0f_0f0f);
                    }
                }
                GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    let qh = u32::from_le_bytes([qs[0], qs[1], qs[2], qs[3]]);
                    let ql = &qs[4..20];
                    for j in 0..16 {
                        q[j] = (ql[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4;
                        q[j + 16] = (ql[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                    }
                    for (j, &v) in q.iter().enumerate() {
                        set_q(words, 5, j, v);
                    }
                }
                // q = i8 + 128 flips the sign bit: four bytes per word, in order.
                _ => {
                    for (w, c) in words.iter_mut().zip(qs.chunks_exact(4)) {
                        *w = u32::from_le_bytes(c.try_into().unwrap()) ^ 0x8080_8080;
                    }
                }
            }
            scales[b] = d;
            biases[b] = bias;
        }
    });
    // |d| > 8188 (Q4_0) or > 511 (Q8_0) makes −k·d overflow f16, though ggml's d·(q − k)
    // stays finite; keep such a tensor in f32 rather than store an infinite bias.
    let f16_exact = biases.par_iter().all(|&b: &f32| f16::from_f32(b).to_f32() == b || b.is_nan());
    let (scales, biases) = if f16_exact {
        (Scales::F16(scales), Scales::F16(biases.par_iter().map(|&b| f16::from_f32(b)).collect()))
    } else {
        (Scales::F32(scales.into_iter().map(f16::to_f32).collect()), Scales::F32(biases))
    };
    Ok(Weight::Affine(AffineTensor::new(rows, cols, bits, 32, packed, scales, biases)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn bits(s: &Scales) -> Vec<u32> {
        match s {
            Scales::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Scales::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Scales::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        }
    }

    /// `par_blocks` cuts a tensor into runs of blocks converted on different threads. The
    /// whole tensor must equal its rows imported one by one (each a single run), word for
    /// word and bit for bit, with a last run that is only partly filled.
    #[test]
    fn parallel_import_equals_row_by_row() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for ty in GgmlType::ALL.into_iter().filter(|t| t.block().0 > 1) {
            let (be, bb) = ty.block();
            let (rows, cols) = (101, 2048);
            let row_bytes = cols / be * bb;
            assert!(rows * row_bytes > 3 * PAR_BYTES, "{}: the tensor must span several runs", ty.name());
            let mut data: Vec<u8> = (0..rows * row_bytes).map(|_| rng.gen()).collect();
            if be == 32 {
                // Small scales: a legacy tensor whose offset −k·d overflows f16 keeps f32
                // scales as a whole, which a lone row need not.
                for blk in data.chunks_exact_mut(bb) {
                    blk[..2].copy_from_slice(&f16::from_f32(rng.gen_range(-1.0f32..1.0)).to_le_bytes());
                }
            }
            let Ok(Weight::Affine(whole)) = import(ty, &data, rows, cols) else { panic!("{}", ty.name()) };
            let (wpr, gpr) = (whole.packed.len() / rows, bits(&whole.scales).len() / rows);
            for (r, raw) in data.chunks_exact(row_bytes).enumerate() {
                let Ok(Weight::Affine(row)) = import(ty, raw, 1, cols) else { panic!("{}", ty.name()) };
                let what = format!("{} row {r}", ty.name());
                assert_eq!(row.packed, whole.packed[r * wpr..(r + 1) * wpr], "{what}: packed");
                assert_eq!(bits(&row.scales), bits(&whole.scales)[r * gpr..(r + 1) * gpr], "{what}: scales");
                assert_eq!(bits(&row.biases), bits(&whole.biases)[r * gpr..(r + 1) * gpr], "{what}: biases");
            }
        }
    }
}
