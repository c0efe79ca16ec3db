//! The TurboQuant KV codec, bit-exact with its reference (vllm-metal's turboquant.py, run
//! with MLX; ../shared/goldens/turboquant/ holds its vectors and tests/turboquant.rs checks
//! every one). Per token and KV head, in groups of 32 along head_dim:
//! - keys: asymmetric affine, no rotation; f16 scale and zero point per group, indices
//!   signed int8 or unsigned 8/5/4/2-bit, x̂ = (index + zero)·scale;
//! - values: multiplied by a fixed ±1 sign vector and Walsh-Hadamard transformed
//!   (orthonormal), then per group an RMS scale (f16) and the Lloyd-Max codebook index of
//!   each value over that scale; x̂ = H(centroid[index]·scale)·signs.
//!
//! Sub-8-bit indices pack LSB first: element i at bits [i·b, i·b + b).
//!
//! The reference computes in the input's dtype: every elementwise step rounds to it
//! (`Precision`), reductions accumulate in f32 and round once, the transform rounds each
//! butterfly stage. Where the reference divides by a zero range (a constant key group) or
//! its zero point overflows f16, it stores inf and decodes NaN; there this codec stores
//! index 0, zero point 1 and the group's midpoint as the scale, which decodes to that
//! midpoint (the constant, within f16 rounding).

use super::turboquant_tables as tables;
use half::{bf16, f16};

/// Values per scale group.
pub const GROUP: usize = 32;

/// Head dims the value transform supports (its sign vectors).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Value bit widths (Lloyd-Max tables).
pub const VALUE_BITS: [u32; 5] = [2, 3, 4, 5, 8];

/// The dtype the reference's arithmetic rounds to: the cache input's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    F16,
    Bf16,
}

impl Precision {
    /// v rounded to this precision (to nearest, ties to even), as f32.
    pub fn round(self, v: f32) -> f32 {
        match self {
            Precision::F32 => v,
            Precision::F16 => f16::from_f32(v).to_f32(),
            Precision::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }
}

/// A key index format: signed int8 (indices -127..=127) or unsigned 8, 5, 4 or 2 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyFormat {
    pub bits: u32,
    pub signed: bool,
}

impl KeyFormat {
    pub const INT8: KeyFormat = KeyFormat { bits: 8, signed: true };

    /// The format of `bits` key bits as `--kv turbo` names them: 8 is signed int8; 5, 4 and
    /// 2 are unsigned and packed.
    pub fn for_bits(bits: u32) -> Option<KeyFormat> {
        match bits {
            8 => Some(KeyFormat::INT8),
            5 | 4 | 2 => Some(KeyFormat { bits, signed: false }),
            _ => None,
        }
    }

    /// Largest index magnitude.
    fn max_index(self) -> i32 {
        match self.signed {
            true => (1 << (self.bits - 1)) - 1,
            false => (1 << self.bits) - 1,
        }
    }
}

/// One key group's encoding: indices, and the f16 bit patterns of scale and zero point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyGroup {
    pub idx: [i32; GROUP],
    pub scale: u16,
    pub zero: u16,
}

/// Encode one group of 32 key values (given in `p`'s precision).
pub fn encode_key_group(x: &[f32], p: Precision, fmt: KeyFormat) -> KeyGroup {
    assert_eq!(x.len(), GROUP, "a key group is {GROUP} values");
    let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
    let mv = fmt.max_index();
    let r = |v: f32| p.round(v);
    let eps = r(1e-8);
    let range = r(hi - lo);
    let (scale, zero, scale_eps) = if fmt.signed {
        let scale = r(range / (2.0 * mv as f32));
        let se = r(scale + eps);
        (scale, r(r(hi + lo) / r(2.0 * se)).round_ties_even(), se)
    } else {
        let scale = r(range / mv as f32);
        let se = r(scale + eps);
        (scale, r(lo / se).round_ties_even(), se)
    };
    let zero16 = f16::from_f32(zero);
    if range == 0.0 || !zero16.is_finite() || !zero.is_finite() {
        return constant_group(lo, hi);
    }
    let (lo_i, hi_i) = if fmt.signed { (-mv, mv) } else { (0, mv) };
    let mut idx = [0i32; GROUP];
    for (o, &v) in idx.iter_mut().zip(x) {
        *o = (r(r(v / scale_eps) - zero).round_ties_even() as i32).clamp(lo_i, hi_i);
    }
    KeyGroup { idx, scale: f16::from_f32(scale).to_bits(), zero: zero16.to_bits() }
}

/// A group the affine rule cannot hold: index 0, zero point 1, its midpoint as the scale.
fn constant_group(lo: f32, hi: f32) -> KeyGroup {
    let mid = (0.5 * (lo as f64 + hi as f64)) as f32;
    let mid = mid.clamp(-f16::MAX.to_f32(), f16::MAX.to_f32());
    KeyGroup { idx: [0; GROUP], scale: f16::from_f32(mid).to_bits(), zero: f16::ONE.to_bits() }
}

/// Decode one key group into `out` (32 values): (index + zero)·scale in f32.
pub fn decode_key_group(g: &KeyGroup, out: &mut [f32]) {
    let (s, z) = (f16::from_bits(g.scale).to_f32(), f16::from_bits(g.zero).to_f32());
    for (o, &i) in out.iter_mut().zip(&g.idx) {
        *o = (i as f32 + z) * s;
    }
}

/// The Lloyd-Max centroids and boundaries of `bits`-bit values.
pub fn value_table(bits: u32) -> Option<(&'static [u32], &'static [u32])> {
    Some(match bits {
        2 => (&tables::CENTROIDS_2[..], &tables::BOUNDARIES_2[..]),
        3 => (&tables::CENTROIDS_3[..], &tables::BOUNDARIES_3[..]),
        4 => (&tables::CENTROIDS_4[..], &tables::BOUNDARIES_4[..]),
        5 => (&tables::CENTROIDS_5[..], &tables::BOUNDARIES_5[..]),
        8 => (&tables::CENTROIDS_8[..], &tables::BOUNDARIES_8[..]),
        _ => return None,
    })
}

/// The sign vector of `head_dim` as bit masks (bit i: element i negated).
fn signs(head_dim: usize) -> Option<&'static [u64]> {
    match head_dim {
        64 => Some(&tables::SIGNS_64[..]),
        128 => Some(&tables::SIGNS_128[..]),
        256 => Some(&tables::SIGNS_256[..]),
        _ => None,
    }
}

/// The sign vector of `head_dim` as 32-bit words (bit i of word i/32: element i negated),
/// as kernels take it.
pub fn sign_words(head_dim: usize) -> crate::Result<Vec<u32>> {
    check_head_dim(head_dim)?;
    let masks = signs(head_dim).expect("checked");
    Ok(masks.iter().flat_map(|m| [*m as u32, (*m >> 32) as u32]).collect())
}

/// A head dim the value codec refuses, with what it takes.
pub fn check_head_dim(head_dim: usize) -> crate::Result<()> {
    match signs(head_dim) {
        Some(_) => Ok(()),
        None => Err(crate::Error::Unsupported(format!(
            "TurboQuant KV needs a head dim of 64, 128 or 256; this model's is {head_dim}"
        ))),
    }
}

/// x·signs in place.
fn apply_signs(x: &mut [f32], head_dim_signs: &[u64]) {
    for (i, v) in x.iter_mut().enumerate() {
        if head_dim_signs[i / 64] >> (i % 64) & 1 == 1 {
            *v = -*v;
        }
    }
}

/// The orthonormal Walsh-Hadamard transform in place, as the reference computes it: radix-2
/// butterflies in f32, each stage's results rounded to `p`, the last stage's then scaled by
/// 1/√n (rounded again).
pub fn hadamard(x: &mut [f32], p: Precision) {
    let n = x.len();
    assert!(n.is_power_of_two() && n >= 2, "a Hadamard transform of {n} values");
    let scale = (1.0 / (n as f64).sqrt()) as f32;
    let mut h = 1;
    while h < n {
        for i in 0..n / 2 {
            let k = i & (h - 1);
            let j = ((i - k) << 1) + k;
            let (a, b) = (x[j], x[j + h]);
            x[j] = p.round(a + b);
            x[j + h] = p.round(a - b);
            if h == n / 2 {
                x[j] = p.round(x[j] * scale);
                x[j + h] = p.round(x[j + h] * scale);
            }
        }
        h <<= 1;
    }
}

/// The values' forward rotation: H(x·signs) in `p`. x is one head (64, 128 or 256 values).
pub fn rotate(x: &mut [f32], p: Precision) -> crate::Result<()> {
    check_head_dim(x.len())?;
    for v in x.iter_mut() {
        *v = p.round(*v);
    }
    apply_signs(x, signs(x.len()).expect("checked"));
    hadamard(x, p);
    Ok(())
}

/// The inverse rotation in f32: H(y)·signs (attention applies it once to its output).
pub fn unrotate(y: &mut [f32]) -> crate::Result<()> {
    check_head_dim(y.len())?;
    hadamard(y, Precision::F32);
    apply_signs(y, signs(y.len()).expect("checked"));
    Ok(())
}

/// Encode one head of values (rotated here) into indices (one per value) and the f16 bits
/// of each group's RMS scale.
pub fn encode_values(x: &[f32], p: Precision, bits: u32, idx: &mut [u8], scales: &mut [u16]) -> crate::Result<()> {
    let (_, bounds) = value_table(bits)
        .ok_or_else(|| crate::Error::Unsupported(format!("TurboQuant values of {bits} bits (2, 3, 4, 5 or 8)")))?;
    let mut y = x.to_vec();
    rotate(&mut y, p)?;
    let r = |v: f32| p.round(v);
    let eps = r(1e-8);
    for ((g, gi), s) in y.chunks(GROUP).zip(idx.chunks_mut(GROUP)).zip(scales.iter_mut()) {
        let sum: f32 = g.iter().map(|&v| r(v * v)).sum();
        let scale = r(r(r(sum) * (1.0 / GROUP as f32)).sqrt());
        let se = r(scale + eps);
        for (o, &v) in gi.iter_mut().zip(g) {
            let xn = r(v / se);
            *o = bounds.iter().take_while(|&&b| xn > f32::from_bits(b)).count() as u8;
        }
        *s = f16::from_f32(scale).to_bits();
    }
    Ok(())
}

/// Decode one head of values in the rotated domain: centroid[index]·scale in f32 (what
/// attention accumulates before `unrotate`).
pub fn dequantize_rotated(idx: &[u8], scales: &[u16], bits: u32, out: &mut [f32]) -> crate::Result<()> {
    let (cents, _) = value_table(bits)
        .ok_or_else(|| crate::Error::Unsupported(format!("TurboQuant values of {bits} bits (2, 3, 4, 5 or 8)")))?;
    for ((o, i), s) in out.chunks_mut(GROUP).zip(idx.chunks(GROUP)).zip(scales) {
        let s = f16::from_bits(*s).to_f32();
        for (v, &q) in o.iter_mut().zip(i) {
            *v = f32::from_bits(cents[q as usize]) * s;
        }
    }
    Ok(())
}

/// Decode one head of values: the rotated dequantization, then the inverse rotation.
pub fn decode_values(idx: &[u8], scales: &[u16], bits: u32, out: &mut [f32]) -> crate::Result<()> {
    dequantize_rotated(idx, scales, bits, out)?;
    unrotate(out)
}

/// Pack `bits`-bit values LSB first: element i at bits [i·bits, i·bits + bits) of `out`
/// (len·bits/8 bytes, len·bits a multiple of 8).
pub fn pack_bits(vals: impl IntoIterator<Item = u32>, bits: u32, out: &mut [u8]) {
    out.fill(0);
    for (i, v) in vals.into_iter().enumerate() {
        let v = v & ((1 << bits) - 1);
        let at = i * bits as usize;
        let word = (v as u16) << (at % 8);
        out[at / 8] |= word as u8;
        if at % 8 + bits as usize > 8 {
            out[at / 8 + 1] |= (word >> 8) as u8;
        }
    }
}

/// Value i of a `pack_bits` stream.
pub fn unpack_bit(packed: &[u8], bits: u32, i: usize) -> u32 {
    let at = i * bits as usize;
    let lo = packed[at / 8] as u16;
    let hi = if at % 8 + bits as usize > 8 { (packed[at / 8 + 1] as u16) << 8 } else { 0 };
    (((lo | hi) >> (at % 8)) & ((1 << bits) - 1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic standard-normal-ish samples (Box-Muller over a xorshift).
    fn normals(n: usize, mut s: u64) -> Vec<f32> {
        let mut u = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()) as f32).collect()
    }

    #[test]
    fn the_rotation_is_orthonormal_and_undone() {
        for hd in HEAD_DIMS {
            let x = normals(hd, hd as u64);
            let mut y = x.clone();
            rotate(&mut y, Precision::F32).unwrap();
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&y) / norm(&x) - 1.0).abs() < 1e-5);
            unrotate(&mut y).unwrap();
            assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5), "head dim {hd}");
        }
    }

    #[test]
    fn three_bit_values_keep_the_lloyd_max_distortion() {
        // The rotation makes values near-Gaussian; 3-bit Lloyd-Max on a unit normal has a
        // mean squared error of ~0.035 per unit variance.
        let (mut err, mut var) = (0f64, 0f64);
        for head in 0..64 {
            let x = normals(128, 1000 + head);
            let (mut qi, mut qs, mut out) = (vec![0u8; 128], vec![0u16; 4], vec![0f32; 128]);
            encode_values(&x, Precision::F32, 3, &mut qi, &mut qs).unwrap();
            decode_values(&qi, &qs, 3, &mut out).unwrap();
            err += x.iter().zip(&out).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
            var += x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
        }
        let d = err / var;
        assert!((0.025..0.05).contains(&d), "3-bit distortion {d}");
    }

    #[test]
    fn packed_bits_come_back() {
        for bits in [2, 3, 4, 5] {
            let vals: Vec<u32> = (0..64u32).map(|i| (i * 7 + 3) % (1 << bits)).collect();
            let mut packed = vec![0u8; 64 * bits as usize / 8];
            pack_bits(vals.iter().copied(), bits, &mut packed);
            let back: Vec<u32> = (0..64).map(|i| unpack_bit(&packed, bits, i)).collect();
            assert_eq!(back, vals, "{bits} bits");
        }
    }

    #[test]
    fn constant_key_groups_decode_to_their_constant() {
        let mut out = [0f32; GROUP];
        for c in [0.0f32, 1.5, -3.25, 1e-3] {
            for fmt in [KeyFormat::INT8, KeyFormat::for_bits(4).unwrap(), KeyFormat::for_bits(2).unwrap()] {
                decode_key_group(&encode_key_group(&[c; GROUP], Precision::Bf16, fmt), &mut out);
                assert!(out.iter().all(|&o| (o - c).abs() <= c.abs() * 1e-3), "{c} {fmt:?}: {out:?}");
            }
        }
    }
}
