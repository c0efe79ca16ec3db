//! One cached position of one KV head in a quantized scheme (`KvScheme`): its byte layout,
//! its encoding, and attention that reads it without a dequantized copy.
//!
//! Layouts (all little-endian; sizes are `KvScheme::head_position_bytes`):
//! - affine, b bits: keys' q values as an LSB-first bit stream (head_dim·b/8 bytes), then a
//!   bf16 scale per 64-group, then a bf16 bias per group; then the values the same way.
//! - turbo: keys' indices (int8, or the unsigned ones packed), then per 32-group the f16
//!   scale and zero point; values' packed Lloyd-Max indices (8-bit: a byte each), then per
//!   group the f16 RMS scale.
//!
//! Attention factors the dequantization out of the inner loops: a key group's dot with q is
//! scale·Σ qᵢ·codeᵢ plus the group's offset times Σ qᵢ; turbo values accumulate in the
//! rotated domain (attention is linear in V), and the inverse rotation runs once on the
//! output.

use super::scheme::{KvScheme, AFFINE_GROUP};
use super::turboquant::{self as tq, KeyFormat, Precision};
use crate::quant::affine::{quantize_group, ScaleDtype};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Affine { bits: u32 },
    Turbo { key: KeyFormat, value_bits: u32 },
}

/// The codec of one layer's quantized rows.
#[derive(Clone, Copy, Debug)]
pub struct RowCodec {
    format: Format,
    head_dim: usize,
    /// Bytes of the keys' half (the values' half follows).
    k_bytes: usize,
    /// Bytes of a row.
    bytes: usize,
}

/// Working buffers of `RowCodec::key_dot` and `values`, made once per attention.
pub struct RowScratch {
    codes: Vec<f32>,
    groups: Vec<(f32, f32)>,
}

fn le16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[2 * i], b[2 * i + 1]])
}

fn put16(b: &mut [u8], i: usize, v: u16) {
    b[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
}

impl RowCodec {
    /// The codec of `layer` under `scheme` (None for bf16); an error names a head dim or
    /// bit width the scheme cannot take.
    pub fn new(scheme: &KvScheme, layer: usize, head_dim: usize) -> crate::Result<Option<RowCodec>> {
        let bad = |why: String| crate::Error::Unsupported(format!("KV scheme {scheme}: {why}"));
        let format = match scheme {
            KvScheme::Bf16 => return Ok(None),
            KvScheme::Affine(bits) => {
                let bits = *bits
                    .get(if bits.len() == 1 { 0 } else { layer })
                    .ok_or_else(|| bad(format!("no bits for layer {layer}")))?;
                if !super::scheme::AFFINE_BITS.contains(&bits) || !head_dim.is_multiple_of(AFFINE_GROUP) {
                    return Err(bad(format!("{bits}-bit affine rows of head dim {head_dim}")));
                }
                Format::Affine { bits }
            }
            KvScheme::Turbo { key, value_bits } => {
                tq::check_head_dim(head_dim)?;
                if tq::value_table(*value_bits).is_none() || KeyFormat::for_bits(key.bits).is_none() {
                    return Err(bad(format!("keys of {} bits, values of {value_bits}", key.bits)));
                }
                Format::Turbo { key: *key, value_bits: *value_bits }
            }
        };
        let (k_bytes, bytes) = (scheme.head_key_bytes(head_dim, layer), scheme.head_position_bytes(head_dim, layer));
        Ok(Some(RowCodec { format, head_dim, k_bytes, bytes }))
    }

    /// Bytes of one row (keys and values).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The row format as a kernel takes it: (turbo, key bits, signed keys, value bits);
    /// affine rows' keys and values share their bits.
    pub fn kernel_format(&self) -> (bool, u32, bool, u32) {
        match self.format {
            Format::Affine { bits } => (false, bits, false, bits),
            Format::Turbo { key, value_bits } => (true, key.bits, key.signed, value_bits),
        }
    }

    /// Buffers for `key_dot` and `values`.
    pub fn scratch(&self) -> RowScratch {
        RowScratch { codes: vec![0.0; self.head_dim], groups: vec![(0.0, 0.0); self.head_dim / self.group()] }
    }

    /// Encode one position's key and value head (in `p`'s precision) into `out`.
    pub fn encode(&self, k: &[f32], v: &[f32], p: Precision, out: &mut [u8]) -> crate::Result<()> {
        let (ko, vo) = out[..self.bytes()].split_at_mut(self.k_bytes);
        match self.format {
            Format::Affine { bits } => {
                affine_encode(k, bits, ko);
                affine_encode(v, bits, vo);
            }
            Format::Turbo { key, value_bits } => {
                self.turbo_encode_keys(k, p, key, ko);
                let hd = self.head_dim;
                let (mut idx, mut scales) = (vec![0u8; hd], vec![0u16; hd / tq::GROUP]);
                tq::encode_values(v, p, value_bits, &mut idx, &mut scales)?;
                let (codes, tail) = vo.split_at_mut(hd * value_bits as usize / 8);
                pack(&idx, value_bits, codes);
                for (g, s) in scales.iter().enumerate() {
                    put16(tail, g, *s);
                }
            }
        }
        Ok(())
    }

    fn turbo_encode_keys(&self, k: &[f32], p: Precision, key: KeyFormat, out: &mut [u8]) {
        let (codes, tail) = out.split_at_mut(self.head_dim * key.bits as usize / 8);
        let mut idx = vec![0u8; self.head_dim];
        for (g, x) in k.chunks(tq::GROUP).enumerate() {
            let e = tq::encode_key_group(x, p, key);
            for (o, &i) in idx[g * tq::GROUP..].iter_mut().zip(&e.idx) {
                *o = i as u8; // int8 as its byte; unsigned ones fit
            }
            put16(tail, 2 * g, e.scale);
            put16(tail, 2 * g + 1, e.zero);
        }
        pack(&idx, key.bits, codes);
    }

    /// Each key code of `row` as f32 (signed for int8 keys), with its group's pair: affine
    /// (scale, bias), key = scale·code + bias; turbo (scale, zero), key = (code + zero)·scale.
    #[inline(always)]
    fn key_codes(&self, row: &[u8], codes: &mut [f32], groups: &mut [(f32, f32)]) {
        let hd = self.head_dim;
        match self.format {
            Format::Affine { bits } => affine_codes(&row[..self.k_bytes], hd, bits, codes, groups),
            Format::Turbo { key, .. } => {
                let (packed, tail) = row[..self.k_bytes].split_at(hd * key.bits as usize / 8);
                match key.signed {
                    true => codes.iter_mut().zip(packed).for_each(|(c, &b)| *c = b as i8 as f32),
                    false => unpack_all(packed, key.bits, codes),
                }
                for (g, sz) in groups.iter_mut().enumerate() {
                    *sz = (f16::from_bits(le16(tail, 2 * g)).to_f32(), f16::from_bits(le16(tail, 2 * g + 1)).to_f32());
                }
            }
        }
    }

    /// Keys of `row` dequantized (the reference attention's input).
    pub fn decode_k(&self, row: &[u8], out: &mut [f32]) {
        let (g, mut sc) = (self.group(), self.scratch());
        self.key_codes(row, &mut sc.codes, &mut sc.groups);
        let turbo = matches!(self.format, Format::Turbo { .. });
        for (i, o) in out.iter_mut().enumerate() {
            let (s, b) = sc.groups[i / g];
            *o = if turbo { (sc.codes[i] + b) * s } else { s * sc.codes[i] + b };
        }
    }

    /// Values of `row` dequantized (inverse rotation included).
    pub fn decode_v(&self, row: &[u8], out: &mut [f32]) -> crate::Result<()> {
        self.values(row, out, &mut self.scratch());
        self.finish_v(out)
    }

    fn group(&self) -> usize {
        match self.format {
            Format::Affine { .. } => AFFINE_GROUP,
            Format::Turbo { .. } => tq::GROUP,
        }
    }

    /// q·key of `row`, the dequantization factored out: per group scale·Σ qᵢ·codeᵢ + offset·Σ qᵢ
    /// (offset: the bias, or zero point·scale). `q_sums` holds Σ qᵢ per group (`group_sums`).
    pub fn key_dot(&self, row: &[u8], q: &[f32], q_sums: &[f32], sc: &mut RowScratch) -> f32 {
        self.key_codes(row, &mut sc.codes, &mut sc.groups);
        self.codes_dot(q, q_sums, sc)
    }

    /// q·key of the row whose codes `key_codes` put in `sc`.
    #[inline(always)]
    fn codes_dot(&self, q: &[f32], q_sums: &[f32], sc: &RowScratch) -> f32 {
        let (g, turbo) = (self.group(), matches!(self.format, Format::Turbo { .. }));
        let mut dot = 0f32;
        for (gi, (&(s, b), qs)) in sc.groups.iter().zip(q_sums).enumerate() {
            let raw = dot8(&q[gi * g..(gi + 1) * g], &sc.codes[gi * g..(gi + 1) * g]);
            let off = if turbo { b * s } else { b };
            dot += s * raw + off * qs;
        }
        dot
    }

    /// Σ qᵢ per key group of q.
    pub fn group_sums(&self, q: &[f32]) -> Vec<f32> {
        q.chunks(self.group()).map(|c| c.iter().sum()).collect()
    }

    /// The values of `row` (turbo's still rotated), into `out`.
    #[inline(always)]
    fn values(&self, row: &[u8], out: &mut [f32], sc: &mut RowScratch) {
        let hd = self.head_dim;
        let v = &row[self.k_bytes..self.bytes()];
        match self.format {
            Format::Affine { bits } => {
                affine_codes(v, hd, bits, &mut sc.codes, &mut sc.groups);
                for ((o, c), &(s, b)) in out.chunks_mut(AFFINE_GROUP).zip(sc.codes.chunks(AFFINE_GROUP)).zip(&sc.groups)
                {
                    o.iter_mut().zip(c).for_each(|(o, c)| *o = s * c + b);
                }
            }
            Format::Turbo { value_bits, .. } => {
                let (packed, tail) = v.split_at(hd * value_bits as usize / 8);
                let (cents, _) = tq::value_table(value_bits).expect("checked at construction");
                unpack_all(packed, value_bits, &mut sc.codes);
                for (g, (o, c)) in out.chunks_mut(tq::GROUP).zip(sc.codes.chunks(tq::GROUP)).enumerate() {
                    let s = f16::from_bits(le16(tail, g)).to_f32();
                    o.iter_mut().zip(c).for_each(|(o, &c)| *o = f32::from_bits(cents[c as usize]) * s);
                }
            }
        }
    }

    /// A value vector into the domain attention accumulates rows' values in (turbo: the
    /// rotation `encode` applies before quantizing; affine: as it is), for rows kept in
    /// bf16 beside quantized ones (`--kv-start`).
    pub fn to_accumulation(&self, v: &mut [f32]) -> crate::Result<()> {
        match self.format {
            Format::Affine { .. } => Ok(()),
            Format::Turbo { .. } => tq::rotate(v, Precision::F32),
        }
    }

    /// The accumulated values out of the rotated domain (turbo); nothing for affine.
    pub fn finish_v(&self, acc: &mut [f32]) -> crate::Result<()> {
        match self.format {
            Format::Affine { .. } => Ok(()),
            Format::Turbo { .. } => tq::unrotate(acc),
        }
    }
}

/// One cached position of one KV head as attention reads it.
#[derive(Clone, Copy, Debug)]
pub enum KvRow<'a> {
    /// Quantized, in the codec's layout.
    Quant(&'a [u8]),
    /// Kept in bf16 (`--kv-start`): the key as it is, the value in the accumulation domain
    /// (`RowCodec::to_accumulation`).
    Head(&'a [bf16], &'a [bf16]),
}

/// Attention of one query head over cached rows (causal span already chosen): softmax of
/// scale·q·kₚ over the rows, then Σ pₚ·vₚ, in row order. out has head_dim values.
pub fn attend_head(codec: &RowCodec, q: &[f32], rows: &[KvRow<'_>], scale: f32, out: &mut [f32]) -> crate::Result<()> {
    attend_group(codec, q, rows, scale, out)
}

/// `attend_head` for the query heads sharing one KV head (`qs` and `out`: heads × head_dim,
/// consecutive): each row's codes are unpacked once for all of them. Compiled for AVX2 too,
/// taken where the CPU has it: the same operations in the same order, in wider registers.
pub fn attend_group(
    codec: &RowCodec,
    qs: &[f32],
    rows: &[KvRow<'_>],
    scale: f32,
    out: &mut [f32],
) -> crate::Result<()> {
    attend_group_dispatch(codec, qs, rows, scale, out, None)?;
    out.chunks_mut(codec.head_dim).try_for_each(|o| codec.finish_v(o))
}

/// One part of a span for `merge_parts`: per query head the part's score maximum m and
/// Σ exp(s − m) into `stats`, and Σ exp(s − m)·v (not normalized, still in the accumulation
/// domain) into `out`.
pub fn attend_group_part(
    codec: &RowCodec,
    qs: &[f32],
    rows: &[KvRow<'_>],
    scale: f32,
    out: &mut [f32],
    stats: &mut [(f32, f32)],
) -> crate::Result<()> {
    attend_group_dispatch(codec, qs, rows, scale, out, Some(stats))
}

/// One part of a span as `attend_group_part` leaves it: the value sums not normalized
/// (heads × head_dim) and per head the part's score maximum and Σ exp(s − m).
pub type SpanPart = (Vec<f32>, Vec<(f32, f32)>);

/// The parts of one span (`attend_group_part`'s outputs and stats, in position order)
/// merged in that order into `out`, then out of the accumulation domain: the span's
/// attention.
pub fn merge_parts(codec: &RowCodec, parts: &[SpanPart], out: &mut [f32]) -> crate::Result<()> {
    let hd = codec.head_dim;
    for (j, o) in out.chunks_mut(hd).enumerate() {
        let m = parts.iter().fold(f32::NEG_INFINITY, |m, (_, st)| m.max(st[j].0));
        let sum: f32 = parts.iter().map(|(_, st)| (st[j].0 - m).exp() * st[j].1).sum();
        o.fill(0.0);
        for (acc, st) in parts {
            let w = (st[j].0 - m).exp() / sum;
            o.iter_mut().zip(&acc[j * hd..(j + 1) * hd]).for_each(|(a, v)| *a += w * v);
        }
        codec.finish_v(o)?;
    }
    Ok(())
}

fn attend_group_dispatch(
    codec: &RowCodec,
    qs: &[f32],
    rows: &[KvRow<'_>],
    scale: f32,
    out: &mut [f32],
    stats: Option<&mut [(f32, f32)]>,
) -> crate::Result<()> {
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::simd::has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { attend_group_avx2(codec, qs, rows, scale, out, stats) };
    }
    attend_group_any(codec, qs, rows, scale, out, stats)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_group_avx2(
    codec: &RowCodec,
    qs: &[f32],
    rows: &[KvRow<'_>],
    scale: f32,
    out: &mut [f32],
    stats: Option<&mut [(f32, f32)]>,
) -> crate::Result<()> {
    attend_group_any(codec, qs, rows, scale, out, stats)
}

/// Softmax-weighted values of `rows` per query head, in the accumulation domain. Without
/// `stats` the weights are normalized; with it they are exp(s − m), and (m, Σ) per head go
/// to `stats` (a part of a longer span).
#[inline(always)]
fn attend_group_any(
    codec: &RowCodec,
    qs: &[f32],
    rows: &[KvRow<'_>],
    scale: f32,
    out: &mut [f32],
    mut stats: Option<&mut [(f32, f32)]>,
) -> crate::Result<()> {
    let (hd, n) = (codec.head_dim, rows.len());
    let q_sums: Vec<Vec<f32>> = qs.chunks(hd).map(|q| codec.group_sums(q)).collect();
    let mut sc = codec.scratch();
    // Scores, head-major: [head][row].
    let mut e = vec![0f32; q_sums.len() * n];
    for (p, r) in rows.iter().enumerate() {
        match r {
            KvRow::Quant(r) => {
                codec.key_codes(r, &mut sc.codes, &mut sc.groups);
                for (j, (q, qs)) in qs.chunks(hd).zip(&q_sums).enumerate() {
                    e[j * n + p] = scale * codec.codes_dot(q, qs, &sc);
                }
            }
            KvRow::Head(k, _) => {
                for (j, q) in qs.chunks(hd).enumerate() {
                    e[j * n + p] = scale * q.iter().zip(k.iter()).map(|(a, b)| a * b.to_f32()).sum::<f32>();
                }
            }
        }
    }
    // What each head's exp(s − m) is divided by: Σ, or 1 for a part.
    let mut divisors = Vec::with_capacity(q_sums.len());
    for (j, s) in e.chunks_mut(n.max(1)).enumerate() {
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        s.iter_mut().for_each(|x| *x = (*x - m).exp());
        let sum = s.iter().sum::<f32>();
        match stats.as_deref_mut() {
            Some(st) => {
                st[j] = (m, sum);
                divisors.push(1.0);
            }
            None => divisors.push(sum),
        }
    }
    out.fill(0.0);
    let mut vals = vec![0f32; hd];
    for (p, r) in rows.iter().enumerate() {
        match r {
            KvRow::Quant(r) => codec.values(r, &mut vals, &mut sc),
            KvRow::Head(_, v) => vals.iter_mut().zip(v.iter()).for_each(|(o, x)| *o = x.to_f32()),
        }
        for (j, o) in out.chunks_mut(hd).enumerate() {
            let w = e[j * n + p] / divisors[j];
            o.iter_mut().zip(&vals).for_each(|(a, v)| *a += w * v);
        }
    }
    Ok(())
}

/// MLX affine groups of 64 with bf16 scale and bias, into `out`'s layout.
fn affine_encode(x: &[f32], bits: u32, out: &mut [u8]) {
    let hd = x.len();
    let groups = hd / AFFINE_GROUP;
    let (codes, tail) = out.split_at_mut(hd * bits as usize / 8);
    let mut q = vec![0u32; hd];
    for (g, vals) in x.chunks(AFFINE_GROUP).enumerate() {
        let (s, b) = quantize_group(vals, bits, ScaleDtype::BF16, &mut q[g * AFFINE_GROUP..(g + 1) * AFFINE_GROUP]);
        put16(tail, g, bf16::from_f32(s).to_bits());
        put16(tail, groups + g, bf16::from_f32(b).to_bits());
    }
    let q8: Vec<u8> = q.iter().map(|&v| v as u8).collect();
    pack(&q8, bits, codes);
}

#[inline(always)]
fn affine_codes(half: &[u8], hd: usize, bits: u32, codes: &mut [f32], groups: &mut [(f32, f32)]) {
    let (packed, tail) = half.split_at(hd * bits as usize / 8);
    unpack_all(packed, bits, codes);
    let n = hd / AFFINE_GROUP;
    for (g, sb) in groups.iter_mut().enumerate() {
        *sb = (bf16::from_bits(le16(tail, g)).to_f32(), bf16::from_bits(le16(tail, n + g)).to_f32());
    }
}

fn pack(vals: &[u8], bits: u32, out: &mut [u8]) {
    match bits {
        8 => out.copy_from_slice(vals),
        _ => tq::pack_bits(vals.iter().map(|&v| v as u32), bits, out),
    }
}

/// Every value of a `pack` stream as f32 (LSB first; 8, 4 and 2 bits a byte at a time).
#[inline(always)]
fn unpack_all(packed: &[u8], bits: u32, out: &mut [f32]) {
    match bits {
        8 => out.iter_mut().zip(packed).for_each(|(o, &b)| *o = b as f32),
        4 => out.chunks_exact_mut(2).zip(packed).for_each(|(o, &b)| {
            o[0] = (b & 15) as f32;
            o[1] = (b >> 4) as f32;
        }),
        2 => out.chunks_exact_mut(4).zip(packed).for_each(|(o, &b)| {
            for (k, v) in o.iter_mut().enumerate() {
                *v = ((b >> (2 * k)) & 3) as f32;
            }
        }),
        // Eight values in `bits` bytes.
        3 | 5 => out.chunks_exact_mut(8).zip(packed.chunks_exact(bits as usize)).for_each(|(o, b)| {
            let w = b.iter().rev().fold(0u64, |w, &x| w << 8 | x as u64);
            for (k, v) in o.iter_mut().enumerate() {
                *v = ((w >> (bits as usize * k)) & ((1 << bits) - 1)) as f32;
            }
        }),
        _ => out.iter_mut().enumerate().for_each(|(i, o)| *o = tq::unpack_bit(packed, bits, i) as f32),
    }
}

/// Σ aᵢ·bᵢ in eight lanes (vectorized; the lanes summed in a fixed order).
#[inline(always)]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = a.chunks_exact(8).remainder().iter().zip(b.chunks_exact(8).remainder()).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    fn randoms(n: usize, mut s: u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// Attention over the dequantized copy, in f64: the reference.
    fn reference(codec: &RowCodec, q: &[f32], rows: &[KvRow], scale: f32) -> Vec<f64> {
        let hd = q.len();
        let (mut k, mut v) = (vec![0f32; hd], vec![0f32; hd]);
        let mut scores = vec![];
        let mut vals = vec![];
        for r in rows {
            match r {
                KvRow::Quant(r) => {
                    codec.decode_k(r, &mut k);
                    codec.decode_v(r, &mut v).unwrap();
                }
                KvRow::Head(hk, hv) => {
                    k.iter_mut().zip(hk.iter()).for_each(|(o, x)| *o = x.to_f32());
                    v.iter_mut().zip(hv.iter()).for_each(|(o, x)| *o = x.to_f32());
                    codec.finish_v(&mut v).unwrap();
                }
            }
            scores.push(scale as f64 * q.iter().zip(&k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>());
            vals.push(v.clone());
        }
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        (0..hd).map(|i| vals.iter().zip(&e).map(|(v, w)| v[i] as f64 * w / sum).sum()).collect()
    }

    #[test]
    fn attention_over_quantized_rows_equals_attention_over_their_dequantized_copy() {
        for scheme in ["affine:8", "affine:4", "turbo", "turbo:k4v2", "turbo:k2v8", "turbo:k5v5", "turbo:k8v4"] {
            let s = KvScheme::parse(scheme).unwrap();
            for hd in [64, 128, 256] {
                let codec = RowCodec::new(&s, 0, hd).unwrap().unwrap();
                assert_eq!(codec.bytes(), s.head_position_bytes(hd, 0), "{scheme} {hd}");
                for n in [1, 31, 32, 33, 100] {
                    let mut store = vec![0u8; n * codec.bytes()];
                    for (p, row) in store.chunks_mut(codec.bytes()).enumerate() {
                        let (k, v) = (randoms(hd, 7 + p as u64), randoms(hd, 1000 + p as u64));
                        codec.encode(&k, &v, Precision::F32, row).unwrap();
                    }
                    let rows: Vec<&[u8]> = store.chunks(codec.bytes()).collect();
                    let kv_rows: Vec<KvRow> = rows.iter().map(|r| KvRow::Quant(r)).collect();
                    let q = randoms(hd, 99 + n as u64);
                    let scale = 1.0 / (hd as f32).sqrt();
                    let mut out = vec![0f32; hd];
                    attend_head(&codec, &q, &kv_rows, scale, &mut out).unwrap();
                    let want = reference(&codec, &q, &kv_rows, scale);
                    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-3);
                    let err = out.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt() / norm;
                    assert!(err < 2e-5, "{scheme} head_dim {hd}, {n} positions: relative error {err:.2e}");
                }
            }
        }
    }

    /// A span cut into parts (`attend_group_part`, then `merge_parts`) attends as the
    /// reference over the whole span, for a group of heads, parts of unequal lengths.
    #[test]
    fn parts_of_a_span_merge_to_the_whole_spans_attention() {
        for scheme in ["affine:8", "turbo"] {
            let (hd, heads, n) = (64, 3, 300);
            let codec = RowCodec::new(&KvScheme::parse(scheme).unwrap(), 0, hd).unwrap().unwrap();
            let mut store = vec![0u8; n * codec.bytes()];
            for (p, row) in store.chunks_mut(codec.bytes()).enumerate() {
                codec.encode(&randoms(hd, 7 + p as u64), &randoms(hd, 1000 + p as u64), Precision::F32, row).unwrap();
            }
            let rows: Vec<KvRow> = store.chunks(codec.bytes()).map(KvRow::Quant).collect();
            let qs = randoms(heads * hd, 5);
            let scale = 1.0 / (hd as f32).sqrt();
            let parts: Vec<SpanPart> = [0..128, 128..256, 256..n]
                .into_iter()
                .map(|r| {
                    let (mut acc, mut stats) = (vec![0f32; heads * hd], vec![(0f32, 0f32); heads]);
                    attend_group_part(&codec, &qs, &rows[r], scale, &mut acc, &mut stats).unwrap();
                    (acc, stats)
                })
                .collect();
            let mut out = vec![0f32; heads * hd];
            merge_parts(&codec, &parts, &mut out).unwrap();
            for (j, o) in out.chunks(hd).enumerate() {
                let want = reference(&codec, &qs[j * hd..(j + 1) * hd], &rows, scale);
                let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-3);
                let err = o.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt() / norm;
                assert!(err < 2e-5, "{scheme}, head {j}: relative error {err:.2e}");
            }
        }
    }

    /// `--kv-start`'s rows: bf16 keys and accumulation-domain values before quantized ones
    /// attend as the reference over the plain values.
    #[test]
    fn bf16_head_rows_attend_beside_quantized_ones() {
        for scheme in ["affine:4", "turbo", "turbo:k4v2"] {
            let codec = RowCodec::new(&KvScheme::parse(scheme).unwrap(), 0, 64).unwrap().unwrap();
            let (hd, heads, n) = (64, 9, 40);
            let mut store = vec![0u8; n * codec.bytes()];
            for (p, row) in store.chunks_mut(codec.bytes()).enumerate() {
                codec.encode(&randoms(hd, 7 + p as u64), &randoms(hd, 1000 + p as u64), Precision::F32, row).unwrap();
            }
            let (mut hk, mut hv) = (vec![bf16::ZERO; heads * hd], vec![bf16::ZERO; heads * hd]);
            for p in 0..heads {
                let mut v = randoms(hd, 2000 + p as u64);
                codec.to_accumulation(&mut v).unwrap();
                for (i, (k, v)) in randoms(hd, 3000 + p as u64).iter().zip(&v).enumerate() {
                    (hk[p * hd + i], hv[p * hd + i]) = (bf16::from_f32(*k), bf16::from_f32(*v));
                }
            }
            let rows: Vec<KvRow> = (0..heads)
                .map(|p| KvRow::Head(&hk[p * hd..][..hd], &hv[p * hd..][..hd]))
                .chain(store.chunks(codec.bytes()).map(KvRow::Quant))
                .collect();
            let q = randoms(hd, 5);
            let mut out = vec![0f32; hd];
            attend_head(&codec, &q, &rows, 0.125, &mut out).unwrap();
            let want = reference(&codec, &q, &rows, 0.125);
            let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
            let err = out.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt() / norm;
            assert!(err < 2e-5, "{scheme}: relative error {err:.2e}");
        }
    }

    /// The byte-at-a-time unpacking of 8, 4 and 2 bits (and the generic one of 3 and 5)
    /// gives the packed stream's values.
    #[test]
    fn whole_streams_unpack_to_their_values() {
        for bits in [2, 3, 4, 5, 8] {
            let vals: Vec<u8> = (0..128u32).map(|i| ((i * 37 + 11) % (1 << bits)) as u8).collect();
            let mut packed = vec![0u8; 128 * bits as usize / 8];
            pack(&vals, bits, &mut packed);
            let mut out = vec![0f32; 128];
            unpack_all(&packed, bits, &mut out);
            assert!(out.iter().zip(&vals).all(|(o, &v)| *o == v as f32), "{bits} bits");
            assert!((0..128).all(|i| tq::unpack_bit(&packed, bits, i) == vals[i] as u32), "{bits} bits");
        }
    }

    /// The query heads of a KV head attended together give each one's own result, bit for bit.
    #[test]
    fn a_group_of_heads_attends_as_each_head_alone() {
        let (hd, n) = (64, 45);
        for scheme in ["affine:8", "turbo"] {
            let codec = RowCodec::new(&KvScheme::parse(scheme).unwrap(), 0, hd).unwrap().unwrap();
            let mut store = vec![0u8; n * codec.bytes()];
            for (p, row) in store.chunks_mut(codec.bytes()).enumerate() {
                codec.encode(&randoms(hd, 3 + p as u64), &randoms(hd, 500 + p as u64), Precision::F32, row).unwrap();
            }
            let rows: Vec<KvRow> = store.chunks(codec.bytes()).map(KvRow::Quant).collect();
            let qs = randoms(3 * hd, 42);
            let mut together = vec![0f32; 3 * hd];
            attend_group(&codec, &qs, &rows, 0.125, &mut together).unwrap();
            for (q, want) in qs.chunks(hd).zip(together.chunks(hd)) {
                let mut alone = vec![0f32; hd];
                attend_head(&codec, q, &rows, 0.125, &mut alone).unwrap();
                assert_eq!(alone, want, "{scheme}");
            }
        }
    }

    #[test]
    fn schemes_a_row_cannot_take_are_errors() {
        assert!(RowCodec::new(&KvScheme::Bf16, 0, 128).unwrap().is_none());
        let bad_v = KvScheme::Turbo { key: KeyFormat::INT8, value_bits: 6 };
        assert!(RowCodec::new(&bad_v, 0, 128).unwrap_err().to_string().contains("values of 6"));
        assert!(RowCodec::new(&KvScheme::parse("turbo").unwrap(), 0, 96).unwrap_err().to_string().contains("96"));
        assert!(RowCodec::new(&KvScheme::Affine(vec![8, 4]), 2, 128).unwrap_err().to_string().contains("layer 2"));
    }

    #[test]
    fn rows_decode_close_to_what_was_encoded() {
        for (scheme, tol) in [("affine:8", 0.02), ("affine:4", 0.3), ("turbo:k8v8", 0.05), ("turbo", 0.6)] {
            let codec = RowCodec::new(&KvScheme::parse(scheme).unwrap(), 0, 128).unwrap().unwrap();
            let (k, v) = (randoms(128, 3), randoms(128, 4));
            let mut row = vec![0u8; codec.bytes()];
            codec.encode(&k, &v, Precision::F32, &mut row).unwrap();
            let (mut kd, mut vd) = (vec![0f32; 128], vec![0f32; 128]);
            codec.decode_k(&row, &mut kd);
            codec.decode_v(&row, &mut vd).unwrap();
            let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst(&k, &kd) < tol && worst(&v, &vd) < tol, "{scheme}: {} {}", worst(&k, &kd), worst(&v, &vd));
        }
    }
}
