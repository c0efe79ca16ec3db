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
        return quantized(codec, q, (n_heads, hd), kv, layer, (spans, &rows), attend, out);
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

/// Positions one task of `quantized` attends over at most: a longer span is cut into parts
/// of this many, attended in parallel and merged in order. A function of the row's own span
/// alone, so a row's bits do not depend on what else the call holds; it gives every core
/// work where one decode row has few KV heads (SmolLM2: 3 tasks on 2 cores otherwise).
const QUANT_PART: usize = 256;

/// Unmerged parts `quantized` holds at once: a long prefill's rows go in runs of at most
/// this many parts (each group·head_dim floats: 4 KiB for Gemma 3 270M), so its transient
/// memory stays ~4 MiB where the whole call at 4,096 tokens would hold ~130 MB. Plenty of
/// tasks for any core count.
const PARTS_AT_ONCE: usize = 1024;

/// `attention` over a quantized store: a task per (query row, KV head, part of the span),
/// the query heads sharing a KV head together (each cached row's codes unpacked once for
/// all of them), then each (row, KV head)'s parts merged in position order.
#[allow(clippy::too_many_arguments)]
fn quantized(
    codec: &crate::kv::rows::RowCodec,
    q: &[f32],
    (n_heads, hd): (usize, usize),
    kv: &CpuKv,
    layer: usize,
    (spans, rows): (&[Span<'_>], &[(usize, usize)]),
    attend: Attend,
    out: &mut [f32],
) -> crate::Result<()> {
    use crate::kv::rows::{attend_group, attend_group_part, merge_parts, KvRow};
    let n_kv = kv.width / hd;
    let group = n_heads / n_kv;
    let width = group * hd;
    let qs_of = |idx: usize| &q[(idx / n_kv) * n_heads * hd + (idx % n_kv) * width..][..width];
    let kv_rows = |idx: usize, positions: std::ops::RangeInclusive<usize>| -> Vec<KvRow> {
        let (seq, kvh) = (rows[idx / n_kv].0, idx % n_kv);
        positions.map(|p| kv.kv_row(layer, kv.row(layer, &spans[seq], p), kvh)).collect()
    };
    let span_of = |idx: usize| {
        let pos = rows[idx / n_kv].1;
        (attend.first(pos), pos)
    };
    let parts_of = |idx: usize| {
        let (first, last) = span_of(idx);
        if last - first >= QUANT_PART {
            (last - first) / QUANT_PART + 1
        } else {
            0
        }
    };
    // One pass over (row, KV head) indices a..b: their spans' parts in parallel, then each
    // index's parts merged in position order (or its short span attended whole).
    let attend_range = |(a, b): (usize, usize), out: &mut [f32]| -> crate::Result<()> {
        let tasks: Vec<(usize, usize)> = (a..b)
            .filter(|&idx| parts_of(idx) > 0)
            .flat_map(|idx| {
                let (first, last) = span_of(idx);
                (first..=last).step_by(QUANT_PART).map(move |lo| (idx, lo))
            })
            .collect();
        let parts: Vec<crate::kv::rows::SpanPart> = tasks
            .par_iter()
            .map(|&(idx, lo)| {
                let hi = (lo + QUANT_PART - 1).min(span_of(idx).1);
                let (mut acc, mut stats) = (vec![0f32; width], vec![(0f32, 0f32); group]);
                attend_group_part(codec, qs_of(idx), &kv_rows(idx, lo..=hi), attend.scale, &mut acc, &mut stats)?;
                Ok((acc, stats))
            })
            .collect::<crate::Result<_>>()?;
        out.par_chunks_mut(width).zip(a..b).try_for_each(|(o, idx)| {
            if parts_of(idx) == 0 {
                let (first, last) = span_of(idx);
                return attend_group(codec, qs_of(idx), &kv_rows(idx, first..=last), attend.scale, o);
            }
            let start = tasks.partition_point(|&(i, _)| i < idx);
            let end = tasks.partition_point(|&(i, _)| i <= idx);
            merge_parts(codec, &parts[start..end], o)
        })
    };
    for (a, b) in runs(rows.len() * n_kv, parts_of, PARTS_AT_ONCE) {
        attend_range((a, b), &mut out[a * width..b * width])?;
    }
    Ok(())
}

/// Cuts indices 0..total into consecutive runs holding at most `cap` parts each (`parts_of`
/// of every index summed; a run holds at least one index), so that a long prefill holds a
/// bounded number of unmerged parts. Each index's bits are its own whatever run it is in.
fn runs(total: usize, parts_of: impl Fn(usize) -> usize, cap: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut a = 0;
    while a < total {
        let (mut b, mut held) = (a + 1, parts_of(a));
        while b < total && held + parts_of(b) <= cap {
            held += parts_of(b);
            b += 1;
        }
        out.push((a, b));
        a = b;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_cover_every_index_once_within_the_cap() {
        let parts = |i: usize| [0, 3, 5, 0, 2, 9, 1, 1, 0, 4][i];
        let got = runs(10, parts, 6);
        assert_eq!(got, [(0, 2), (2, 4), (4, 5), (5, 6), (6, 10)]);
        assert_eq!(runs(0, parts, 6), []);
        // An index over the cap alone still gets its run.
        assert_eq!(runs(3, |_| 10, 4), [(0, 1), (1, 2), (2, 3)]);
    }
}
