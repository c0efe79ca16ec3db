//! The ops of a tensor-parallel backend: each on every rank's part, the exchanges through
//! the collective.

use super::{Collective, Sharded, ShardedAct, ShardedKv, ShardedMat};
use crate::backend::{Activation, Attend, Backend, MatKind, Rope, Width};
use crate::config::ModelConfig;
use crate::kv::{KvBlocks, Span};
use crate::quant::Weight;
use crate::{Error, Result};

impl<B: Backend, C: Collective<B>> Sharded<B, C> {
    /// Run `f` on every rank in turn.
    fn each(&self, mut f: impl FnMut(usize, &B) -> Result<()>) -> Result<()> {
        self.ranks.iter().enumerate().try_for_each(|(r, b)| f(r, b))
    }

    /// Each rank's best `k` (at most its part) of row 0 of the vocabulary-split `x` × inv_t
    /// as (id in the whole vocabulary, value), ordered by value descending, id ascending.
    fn best(&self, x: &ShardedAct<B::Act>, k: usize, inv_t: f32) -> Result<Vec<(usize, f32)>> {
        let mut all = vec![];
        for (r, b) in self.ranks.iter().enumerate() {
            let first = self.range(r, x.width).map_or(0, |p| p.start);
            let kr = k.min(self.range(r, x.width).map_or(x.cols, |p| p.len()));
            let mut out = b.act_f32(1, 2 * kr)?;
            b.top_k(&x.parts[r], kr, inv_t, &mut out)?;
            let v = b.read_rows(&out, 0)?;
            all.extend(v.chunks_exact(2).map(|p| (first + p[0] as usize, p[1])));
        }
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(k);
        Ok(all)
    }
}

impl<B: Backend, C: Collective<B>> Backend for Sharded<B, C> {
    type Act = ShardedAct<B::Act>;
    type Mat = ShardedMat<B::Mat>;
    type Vector = Vec<B::Vector>;
    type Kv = ShardedKv<B::Kv>;

    fn name(&self) -> &'static str {
        self.ranks[0].name()
    }
    fn prefill_chunk(&self) -> usize {
        self.ranks[0].prefill_chunk()
    }
    fn device_memory(&self) -> Result<Option<(String, usize, usize)>> {
        let mut sum: Option<(String, usize, usize)> = None;
        for b in &self.ranks {
            if let Some((name, used, total)) = b.device_memory()? {
                let s = sum.get_or_insert((format!("{} × {name}", self.ranks.len()), 0, 0));
                s.1 += used;
                s.2 += total;
            }
        }
        Ok(sum)
    }
    fn kv_memory_free(&self) -> Result<Option<usize>> {
        let n_kv = self.plan.ranks.iter().map(|s| s.kv_heads.end).max().unwrap_or(1);
        let mut held = vec![];
        for (b, s) in self.ranks.iter().zip(&self.plan.ranks) {
            if let Some(free) = b.kv_memory_free()? {
                held.push((free, s.kv_heads.len()));
            }
        }
        Ok(unsplit_free(&held, n_kv))
    }
    fn copy_bandwidth(&self) -> Result<Option<f64>> {
        let mut sum = None;
        for b in &self.ranks {
            if let Some(bw) = b.copy_bandwidth()? {
                *sum.get_or_insert(0.0) += bw;
            }
        }
        Ok(sum)
    }
    fn matrix(&self, w: Weight) -> Result<Self::Mat> {
        self.matrix_as(w, MatKind::Whole)
    }
    fn matrix_as(&self, w: Weight, kind: MatKind) -> Result<Self::Mat> {
        let parts = self.parts(w, kind)?;
        let parts = parts.into_iter().zip(&self.ranks).map(|(p, b)| b.matrix_as(p, kind)).collect::<Result<_>>()?;
        Ok(ShardedMat { parts, kind })
    }
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector> {
        self.vector_as(v, Width::Model)
    }
    fn vector_as(&self, v: Vec<f32>, width: Width) -> Result<Self::Vector> {
        if width != Width::Model && self.extent(width) != Some(v.len()) {
            return Err(Error::Invalid(format!("a vector of {} values split as {width:?}", v.len())));
        }
        (0..self.ranks.len())
            .map(|r| {
                let part = self.range(r, width).map_or_else(|| v.clone(), |p| v[p].to_vec());
                self.ranks[r].vector_as(part, width)
            })
            .collect()
    }
    fn act(&self, rows: usize, cols: usize) -> Result<Self::Act> {
        self.act_parts(rows, cols, Width::Model, false)
    }
    fn act_f32(&self, rows: usize, cols: usize) -> Result<Self::Act> {
        self.act_parts(rows, cols, Width::Model, true)
    }
    fn act_as(&self, rows: usize, cols: usize, width: Width) -> Result<Self::Act> {
        self.act_parts(rows, cols, width, false)
    }
    fn act_f32_as(&self, rows: usize, cols: usize, width: Width) -> Result<Self::Act> {
        self.act_parts(rows, cols, width, true)
    }
    fn kv_store(&self, cfg: &ModelConfig, blocks: KvBlocks) -> Result<Self::Kv> {
        let parts = (0..self.ranks.len())
            .map(|r| self.ranks[r].kv_store(&self.plan.rank_config(cfg, r), blocks))
            .collect::<Result<_>>()?;
        let sliding = (0..cfg.n_layers).map(|i| crate::kv::is_sliding(cfg, i)).collect();
        Ok(ShardedKv { parts, quantized: false, sliding })
    }
    fn kv_store_scheme(
        &self,
        cfg: &ModelConfig,
        blocks: KvBlocks,
        scheme: &crate::kv::scheme::KvScheme,
    ) -> Result<Self::Kv> {
        let parts = (0..self.ranks.len())
            .map(|r| self.ranks[r].kv_store_scheme(&self.plan.rank_config(cfg, r), blocks, scheme))
            .collect::<Result<_>>()?;
        let sliding = (0..cfg.n_layers).map(|i| crate::kv::is_sliding(cfg, i)).collect();
        let quantized = !matches!(scheme, crate::kv::scheme::KvScheme::Bf16);
        Ok(ShardedKv { parts, quantized, sliding })
    }
    fn kv_blocks(&self, kv: &Self::Kv) -> KvBlocks {
        self.ranks[0].kv_blocks(&kv.parts[0])
    }
    fn kv_row_bytes(&self, kv: &Self::Kv, layer: usize) -> usize {
        self.row_bytes(kv, layer)
    }
    fn kv_export(&self, kv: &Self::Kv, layer: usize, rows: &[usize], out: &mut Vec<u8>) -> Result<()> {
        self.export_rows(kv, layer, rows, out)
    }
    fn kv_import(&self, kv: &mut Self::Kv, layer: usize, rows: &[usize], data: &[u8]) -> Result<()> {
        self.import_rows(kv, layer, rows, data)
    }
    fn begin(&self, tokens: &[u32], spans: &[Span<'_>], invariant: bool) -> Result<()> {
        self.each(|_, b| b.begin(tokens, spans, invariant))
    }
    fn embed(&self, table: &Self::Mat, tokens: &[u32], scale: f32, out: &mut Self::Act) -> Result<()> {
        let tables: Vec<&B::Mat> = table.parts.iter().collect();
        let firsts: Vec<usize> = match table.kind {
            MatKind::Rows(Width::Vocab) => self.plan.ranks.iter().map(|s| s.vocab.start).collect(),
            _ => vec![0; self.ranks.len()],
        };
        let mut xs: Vec<&mut B::Act> = out.parts.iter_mut().collect();
        self.comm.embed(&self.ranks, &tables, &firsts, tokens, scale, &mut xs)
    }
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, out: &mut Self::Act) -> Result<()> {
        self.each(|r, b| b.rms_norm(&x.parts[r], &w[r], eps, &mut out.parts[r]))
    }
    fn rms_norm_heads(&self, x: &mut Self::Act, w: &Self::Vector, eps: f32) -> Result<()> {
        self.each(|r, b| b.rms_norm_heads(&mut x.parts[r], &w[r], eps))
    }
    fn matmul(&self, x: &Self::Act, w: &Self::Mat, out: &mut Self::Act) -> Result<()> {
        match w.kind {
            MatKind::Cols(..) => {
                let ys: Vec<&B::Act> = x.parts.iter().collect();
                let ws: Vec<&B::Mat> = w.parts.iter().collect();
                let mut outs: Vec<&mut B::Act> = out.parts.iter_mut().collect();
                self.comm.row_parallel(&self.ranks, &ys, &ws, &mut outs)
            }
            _ => self.each(|r, b| b.matmul(&x.parts[r], &w.parts[r], &mut out.parts[r])),
        }
    }
    fn matmul_many(&self, x: &Self::Act, ws: &[&Self::Mat], outs: &mut [&mut Self::Act]) -> Result<()> {
        if ws.iter().any(|w| matches!(w.kind, MatKind::Cols(..))) {
            return ws.iter().zip(outs.iter_mut()).try_for_each(|(w, o)| self.matmul(x, w, o));
        }
        self.each(|r, b| {
            let wr: Vec<&B::Mat> = ws.iter().map(|w| &w.parts[r]).collect();
            let mut or: Vec<&mut B::Act> = outs.iter_mut().map(|o| &mut o.parts[r]).collect();
            b.matmul_many(&x.parts[r], &wr, &mut or)
        })
    }
    fn add_bias(&self, x: &mut Self::Act, bias: &Self::Vector) -> Result<()> {
        self.each(|r, b| b.add_bias(&mut x.parts[r], &bias[r]))
    }
    fn rope(&self, x: &mut Self::Act, n_heads: usize, spans: &[Span<'_>], rope: &Rope) -> Result<()> {
        for r in 0..self.ranks.len() {
            let h = self.heads_of(x, r, n_heads);
            self.ranks[r].rope(&mut x.parts[r], h, spans, rope)?;
        }
        Ok(())
    }
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        spans: &[Span<'_>],
        attend: Attend,
        out: &mut Self::Act,
    ) -> Result<()> {
        self.each(|r, b| {
            b.attention(
                &q.parts[r],
                &k.parts[r],
                &v.parts[r],
                &mut kv.parts[r],
                layer,
                spans,
                attend,
                &mut out.parts[r],
            )
        })
    }
    fn glu(&self, gate: &Self::Act, up: &Self::Act, act: Activation, out: &mut Self::Act) -> Result<()> {
        self.each(|r, b| b.glu(&gate.parts[r], &up.parts[r], act, &mut out.parts[r]))
    }
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()> {
        self.each(|r, b| b.add(&mut x.parts[r], &y.parts[r]))
    }
    fn norm_matmul_many(
        &self,
        x: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        xn: &mut Self::Act,
        ws: &[&Self::Mat],
        outs: &mut [&mut Self::Act],
    ) -> Result<()> {
        if ws.iter().any(|w| matches!(w.kind, MatKind::Cols(..))) {
            self.rms_norm(x, norm, eps, xn)?;
            return self.matmul_many(xn, ws, outs);
        }
        self.each(|r, b| {
            let wr: Vec<&B::Mat> = ws.iter().map(|w| &w.parts[r]).collect();
            let mut or: Vec<&mut B::Act> = outs.iter_mut().map(|o| &mut o.parts[r]).collect();
            b.norm_matmul_many(&x.parts[r], &norm[r], eps, &mut xn.parts[r], &wr, &mut or)
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn norm_glu(
        &self,
        x: &Self::Act,
        (norm, eps): (&Self::Vector, f32),
        xn: &mut Self::Act,
        (gate, up): (&Self::Mat, &Self::Mat),
        act: Activation,
        g: &mut Self::Act,
        u: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<()> {
        self.each(|r, b| {
            let (gr, ur) = (&gate.parts[r], &up.parts[r]);
            let (gp, up, op) = (&mut g.parts[r], &mut u.parts[r], &mut out.parts[r]);
            b.norm_glu(&x.parts[r], (&norm[r], eps), &mut xn.parts[r], (gr, ur), act, gp, up, op)
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        q: &mut Self::Act,
        k: &mut Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        spans: &[Span<'_>],
        rope: &Rope,
        (n_heads, n_kv): (usize, usize),
        attend: Attend,
        out: &mut Self::Act,
    ) -> Result<()> {
        for r in 0..self.ranks.len() {
            let heads = (self.heads_of(q, r, n_heads), self.heads_of(k, r, n_kv));
            let (qr, kr, vr) = (&mut q.parts[r], &mut k.parts[r], &v.parts[r]);
            let (kvr, outr) = (&mut kv.parts[r], &mut out.parts[r]);
            self.ranks[r].rope_attention(qr, kr, vr, kvr, layer, spans, rope, heads, attend, outr)?;
        }
        Ok(())
    }
    fn argmax(&self, x: &Self::Act, out: &mut Self::Act) -> Result<()> {
        let best = self.best(x, 1, 1.0)?;
        out.host = Some(vec![best.first().map_or(0.0, |b| b.0 as f32)]);
        Ok(())
    }
    fn argmax_rows(&self, x: &Self::Act, out: &mut Self::Act) -> Result<()> {
        crate::backend::check_argmax_rows(x.rows, x.cols, out.rows * out.cols)?;
        let all = self.read_rows(x, 0)?;
        out.host = Some(all.chunks_exact(x.cols).map(|row| crate::sample::argmax(row) as f32).collect());
        Ok(())
    }
    fn top_k(&self, x: &Self::Act, k: usize, inv_t: f32, out: &mut Self::Act) -> Result<()> {
        crate::backend::check_top_k(x.cols, k, out.cols)?;
        let best = self.best(x, k, inv_t)?;
        out.host = Some(best.into_iter().flat_map(|(i, v)| [i as f32, v]).collect());
        Ok(())
    }
    fn top_k_preferred(&self) -> bool {
        self.ranks[0].top_k_preferred()
    }
    fn slice_rows(&self, x: &Self::Act, first: usize) -> Result<Self::Act> {
        let parts = self.ranks.iter().zip(&x.parts).map(|(b, p)| b.slice_rows(p, first)).collect::<Result<_>>()?;
        let host = x.host.as_ref().map(|h| h[(first * x.cols).min(h.len())..].to_vec());
        Ok(ShardedAct { parts, rows: x.rows - first, cols: x.cols, width: x.width, host })
    }
    fn gather_last_rows(&self, x: &Self::Act, spans: &[Span<'_>], out: &mut Self::Act) -> Result<()> {
        self.each(|r, b| b.gather_last_rows(&x.parts[r], spans, &mut out.parts[r]))
    }
    fn read_rows(&self, x: &Self::Act, first: usize) -> Result<Vec<f32>> {
        if let Some(h) = &x.host {
            return Ok(h[(first * x.cols).min(h.len())..].to_vec());
        }
        match x.width {
            Width::Model => self.ranks[0].read_rows(&x.parts[0], first),
            _ => {
                let parts: Vec<&B::Act> = x.parts.iter().collect();
                self.comm.gather(&self.ranks, &parts, first, x.rows - first)
            }
        }
    }
}

/// The unsplit KV cache the ranks can hold together: rank r, with `free` bytes and `kv`
/// of the `n_kv` KV heads (more than its 1/N with a head replicated), takes free · n_kv /
/// kv of it; the least over the ranks. None when no rank has device memory.
fn unsplit_free(ranks: &[(usize, usize)], n_kv: usize) -> Option<usize> {
    ranks.iter().map(|&(free, kv)| (free as u128 * n_kv as u128 / kv.max(1) as u128) as usize).min()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_replicated_kv_head_halves_what_two_ranks_hold() {
        // 8 KV heads over 2 GPUs of 10 GB free: 20 GB of unsplit cache.
        assert_eq!(super::unsplit_free(&[(10, 4), (10, 4)], 8), Some(20));
        // One KV head held by both: each can take only 10.
        assert_eq!(super::unsplit_free(&[(10, 1), (10, 1)], 1), Some(10));
        // Uneven (3 heads as 2 + 1): the fuller rank bounds it.
        assert_eq!(super::unsplit_free(&[(12, 2), (12, 1)], 3), Some(18));
        assert_eq!(super::unsplit_free(&[], 3), None);
    }
}
