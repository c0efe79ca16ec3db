//! K-quant super-blocks (Q4_K, Q5_K, Q6_K) → affine groups, bit-exact with ggml's dequant.
//!
//! A super-block holds 256 values. Q4_K/Q5_K split it into 8 sub-blocks of 32 with 6-bit
//! sub-scales `sc` and sub-mins `m` under f16 `d`, `dmin`: w = d·sc·q − dmin·m. That is an
//! affine group of 32 with scale = d·sc and bias = −dmin·m. Q6_K splits it into 16
//! sub-blocks of 16 with i8 sub-scales: w = d·sc·(q − 32), i.e. scale = d·sc and
//! bias = −32·d·sc on q ∈ [0, 64).
//!
//! Why f32 scales: d·sc needs up to 11 + 7 significant bits, more than f16 holds, but always
//! fits f32 exactly. With exact scale and bias, `scale·q + bias` in f32 rounds exactly once,
//! like ggml's `d·q − dm` (Q4_K/Q5_K, d·q is exact), and for Q6_K the sum is d·sc·(q − 32)
//! itself (a 24-bit product), so our dequant equals ggml's bit for bit.

use super::affine::{set_q, AffineTensor, Scales};
use super::ggml::{f16_at, par_blocks, GgmlType};
use super::Weight;
use crate::{Error, Result};

/// Values per super-block.
const QK_K: usize = 256;

/// Import a K-quant tensor `[rows, cols]` (cols = ggml's ne0, a multiple of 256).
pub fn import(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Result<Weight> {
    let (bits, group): (u32, usize) = match ty {
        GgmlType::Q4K => (4, 32),
        GgmlType::Q5K => (5, 32),
        GgmlType::Q6K => (6, 16),
        other => return Err(Error::Invalid(format!("kquants::import called with non-K-quant type {}", other.name()))),
    };
    let (_, block_bytes) = ty.block();
    let nblocks = rows * cols / QK_K;
    if !cols.is_multiple_of(QK_K) || data.len() != nblocks * block_bytes {
        return Err(Error::Invalid(format!(
            "{} tensor [{rows}, {cols}]: needs whole 256-value super-blocks per row ({} bytes), got {} bytes",
            ty.name(),
            nblocks * block_bytes,
            data.len()
        )));
    }
    // Rows are whole super-blocks and a super-block is a whole number of u32 words
    // (256·bits/32), so block b owns words [b·wpb, (b+1)·wpb) of the flat packed array.
    let wpb = QK_K * bits as usize / 32;
    let gpb = QK_K / group;
    let mut packed = vec![0u32; nblocks * wpb];
    super::advise_huge_pages(&packed);
    let mut scales = vec![0f32; nblocks * gpb];
    let mut biases = vec![0f32; nblocks * gpb];
    par_blocks(
        data,
        block_bytes,
        (&mut packed, wpb),
        (&mut scales, &mut biases, gpb),
        |data, packed, scales, biases| {
            let mut q = [0u32; QK_K];
            for (b, blk) in data.chunks_exact(block_bytes).enumerate() {
                let (s, o) = (&mut scales[b * gpb..(b + 1) * gpb], &mut biases[b * gpb..(b + 1) * gpb]);
                match ty {
                    GgmlType::Q4K => q4k_block(blk, &mut q, s, o),
                    GgmlType::Q5K => q5k_block(blk, &mut q, s, o),
                    _ => q6k_block(blk, &mut q, s, o),
                }
                let words = &mut packed[b * wpb..(b + 1) * wpb];
                for (i, &v) in q.iter().enumerate() {
                    set_q(words, bits, i, v);
                }
            }
        },
    );
    Ok(Weight::Affine(AffineTensor::new(rows, cols, bits, group, packed, Scales::F32(scales), Scales::F32(biases))?))
}

/// The 6-bit (scale, min) of sub-block `j` from Q4_K/Q5_K's 12 packed bytes: bytes 0..4
/// hold scales 0..3 in their low 6 bits, bytes 4..8 mins 0..3; sub-blocks 4..7 take their
/// low nibbles from bytes 8..12 and their top 2 bits from the spare bits of bytes 0..8.
#[inline]
fn scale_min(j: usize, p: &[u8]) -> (u8, u8) {
    if j < 4 {
        (p[j] & 63, p[j + 4] & 63)
    } else {
        ((p[j + 4] & 0x0f) | ((p[j - 4] >> 6) << 4), (p[j + 4] >> 4) | ((p[j] >> 6) << 4))
    }
}

/// The 8 (scale, bias) pairs of a Q4_K/Q5_K super-block whose header is d, dmin, scales[12].
fn kq_scales(blk: &[u8], scales: &mut [f32], biases: &mut [f32]) {
    let d = f16_at(blk, 0).to_f32();
    let dmin = f16_at(blk, 2).to_f32();
    let packed = &blk[4..16];
    for j in 0..8 {
        let (sc, m) = scale_min(j, packed);
        // Both products are exact in f32 (11-bit × 6-bit significands).
        scales[j] = d * sc as f32;
        biases[j] = -(dmin * m as f32);
    }
}

/// Q4_K (144 bytes): d, dmin, scales[12], qs[128]. Each 32 bytes of qs hold two sub-blocks:
/// low nibbles are sub-block 2k (values 64k..64k+32), high nibbles sub-block 2k+1.
fn q4k_block(blk: &[u8], q: &mut [u32; QK_K], scales: &mut [f32], biases: &mut [f32]) {
    kq_scales(blk, scales, biases);
    let qs = &blk[16..144];
    for k in 0..4 {
        for l in 0..32 {
            let byte = qs[32 * k + l];
            q[64 * k + l] = (byte & 0x0f) as u32;
            q[64 * k + 32 + l] = (byte >> 4) as u32;
        }
    }
}

/// Q5_K (176 bytes): d, dmin, scales[12], qh[32], qs[128]. Low 4 bits as in Q4_K; the 5th
/// bit of value l in sub-block i is bit i of qh[l].
fn q5k_block(blk: &[u8], q: &mut [u32; QK_K], scales: &mut [f32], biases: &mut [f32]) {
    kq_scales(blk, scales, biases);
    let qh = &blk[16..48];
    let qs = &blk[48..176];
    for k in 0..4 {
        for l in 0..32 {
            let byte = qs[32 * k + l];
            let (lo, hi) = (2 * k, 2 * k + 1);
            q[32 * lo + l] = (byte & 0x0f) as u32 | (((qh[l] >> lo) & 1) as u32) << 4;
            q[32 * hi + l] = (byte >> 4) as u32 | (((qh[l] >> hi) & 1) as u32) << 4;
        }
    }
}

/// Q6_K (210 bytes): ql[128], qh[64], scales i8[16], d. Each half h (128 values) uses
/// ql[64h..64h+64] and qh[32h..32h+32]: value 128h + 32k + l (k < 4, l < 32) takes its low
/// nibble from ql[64h + 32(k%2) + l] (low nibble for k < 2, high for k ≥ 2) and its top two
/// bits from qh[32h + l] >> 2k.
fn q6k_block(blk: &[u8], q: &mut [u32; QK_K], scales: &mut [f32], biases: &mut [f32]) {
    let ql = &blk[0..128];
    let qh = &blk[128..192];
    let sc = &blk[192..208];
    let d = f16_at(blk, 208).to_f32();
    for (j, &s) in sc.iter().enumerate() {
        // d·sc is exact (11-bit × 8-bit); ·32 is a power of two, also exact.
        let scale = d * (s as i8) as f32;
        scales[j] = scale;
        biases[j] = -32.0 * scale;
    }
    for h in 0..2 {
        for k in 0..4 {
            for l in 0..32 {
                let lo = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
                let hi = (qh[32 * h + l] >> (2 * k)) & 3;
                q[128 * h + 32 * k + l] = (lo | (hi << 4)) as u32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_unpacks_all_six_bits() {
        // Sub-block 5: scale low nibble in byte 9, top bits in byte 1; min in byte 9's high
        // nibble plus byte 5's top bits.
        let mut p = [0u8; 12];
        p[1] = 0b11_000000;
        p[5] = 0b10_000000;
        p[9] = 0xa5;
        assert_eq!(scale_min(5, &p), (0x5 | (0b11 << 4), 0xa | (0b10 << 4)));
        p[2] = 0b01_101010;
        p[6] = 0b00_010101;
        assert_eq!(scale_min(2, &p), (0b101010, 0b010101));
    }

    #[test]
    fn rejects_bad_lengths_and_types() {
        assert!(import(GgmlType::Q4K, &[0u8; 143], 1, 256).is_err());
        assert!(import(GgmlType::Q6K, &[0u8; 210], 1, 128).is_err());
        assert!(import(GgmlType::Q4_0, &[0u8; 18], 1, 32).is_err());
    }
}
