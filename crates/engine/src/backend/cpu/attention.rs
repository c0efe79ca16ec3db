//! Causal attention over the paged bf16 KV store, f32 math, GQA, optionally windowed.
//!
//! Parallel over (query row, head). Each task streams the cached keys of its kv head once
//! (scores), softmaxes in f32, then streams the values once. A row's result depends only
//! on its own sequence's cache: the same bits whatever else the call holds.

use super::kv::CpuKv;
use crate::backend::Attend;
use crate::kv::Span;
use half::bf16;
use rayon::prelude::*;

/// q `[m, n_heads·hd]`, the rows of `spans` (each sequence's at its positions pos0..); the
/// store already holds each sequence's positions up to its last row. A row at position p
/// attends to its sequence's positions attend.first(p)..=p. out `[m, n_heads·hd]`.
pub fn attention<'a>(
    q: &[f32],
    (m, n_heads, hd): (usize, usize, usize),
    kv: &'a CpuKv,
    layer: usize,
    spans: &[Span<'_>],
    attend: Attend,
    out: &mut [f32],
) -> crate::Result<()> {
    assert_eq!(out.len(), m * n_heads * hd, "attention: out is not [{m}, {n_heads}·{hd}]");
    let rows = crate::kv::row_positions(spans);
    assert_eq!(rows.len(), m, "attention: {m} query rows, spans of {}", rows.len());
    let n_kv = kv.width / hd;
    let group = n_heads / n_kv;
    let scale = attend.scale;
    if let Some(q_layers) = &kv.quant {
        let codec = &q_layers.codecs[layer];
        // A task per (row, KV head): the query heads sharing a KV head are consecutive, and
        // each cached row's codes are unpacked once for all of them.
        return out.par_chunks_mut(group * hd).enumerate().try_for_each(|(idx, o)| {
            let (t, kvh) = (idx / n_kv, idx % n_kv);
            let (seq, pos) = rows[t];
            let span = &spans[seq];
            let qs = &q[t * n_heads * hd + kvh * group * hd..][..group * hd];
            let kv_rows: Vec<crate::kv::rows::KvRow> =
                (attend.first(pos)..=pos).map(|p| kv.kv_row(layer, kv.row(layer, span, p), kvh)).collect();
            crate::kv::rows::attend_group(codec, qs, &kv_rows, scale, o)
        });
    }
    let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
    let simd = super::simd::has_avx2() && hd.is_multiple_of(8);
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (t, h) = (idx / n_heads, idx % n_heads);
        let kvh = h / group;
        let (seq, pos) = rows[t];
        let span = &spans[seq];
        let (first, len) = (attend.first(pos), pos + 1);
        let qh = &q[t * n_heads * hd + h * hd..][..hd];
        let row = |c: &'a [bf16], p: usize| -> &'a [bf16] { &c[kv.row(layer, span, p) * kv.width + kvh * hd..][..hd] };
        let mut scores = Vec::with_capacity(len - first);
        let mut max = f32::NEG_INFINITY;
        for p in first..len {
            let kr = row(kc, p);
            let s = if simd {
                // SAFETY: AVX2+FMA present; both are hd long, hd a multiple of 8.
                unsafe { super::simd::dot_bf16(qh, bytemuck::cast_slice(kr)) }
            } else {
                qh.iter().zip(kr).map(|(a, b)| a * b.to_f32()).sum()
            } * scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        o.fill(0.0);
        for (p, &w) in (first..len).zip(&scores) {
            let (w, vr) = (w / sum, row(vc, p));
            if simd {
                // SAFETY: as above.
                unsafe { super::simd::axpy_bf16(o, w, bytemuck::cast_slice(vr)) }
            } else {
                o.iter_mut().zip(vr).for_each(|(a, b)| *a += w * b.to_f32());
            }
        }
    });
    Ok(())
}
