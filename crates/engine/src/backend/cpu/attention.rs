//! Causal attention over the dense bf16 KV cache (a sliding layer's a ring), f32 math, GQA,
//! optionally windowed.
//!
//! Parallel over (query row, head). Each task streams the cached keys of its kv head once
//! (scores), softmaxes in f32, then streams the values once.

use crate::backend::Attend;
use crate::kv::dense::DenseKv;
use half::bf16;
use rayon::prelude::*;

/// q `[m, n_heads·hd]` at positions pos0..pos0+m; the cache already holds 0..pos0+m.
/// Row t attends to positions attend.first(pos0 + t)..=pos0 + t. out `[m, n_heads·hd]`.
pub fn attention<'a>(
    q: &[f32],
    (m, n_heads, hd): (usize, usize, usize),
    kv: &'a DenseKv,
    layer: usize,
    pos0: usize,
    attend: Attend,
    out: &mut [f32],
) {
    assert_eq!(out.len(), m * n_heads * hd, "attention: out is not [{m}, {n_heads}·{hd}]");
    let n_kv = kv.width / hd;
    let group = n_heads / n_kv;
    let scale = attend.scale;
    let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
    let simd = super::simd::has_avx2() && hd.is_multiple_of(8);
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (t, h) = (idx / n_heads, idx % n_heads);
        let kvh = h / group;
        let (first, len) = (attend.first(pos0 + t), pos0 + t + 1);
        let qh = &q[t * n_heads * hd + h * hd..][..hd];
        let row = |c: &'a [bf16], p: usize| -> &'a [bf16] { &c[kv.slot(layer, p) * kv.width + kvh * hd..][..hd] };
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
}
