//! Tensor parallelism as a backend: N ranks, each an inner backend (a GPU, or a simulated
//! CPU rank) holding its share of the model (model::shard): its query heads with their KV
//! heads, its FFN columns and its part of the vocabulary. The model is written once
//! against `Backend`; here each op runs on every rank's part, and where the parts must
//! meet, the ranks exchange through a `Collective`: the output projections' all-reduce,
//! the embedding's lookup and the logits' gather.
//!
//! Activations say what their columns are (`Width`): the model's width is held whole by
//! every rank (the residual stream, norms, the projections' sums), a split width in
//! parts. Matrices say how they split (`MatKind`): by output rows (each rank's product is
//! its part of the output) or by input columns (each rank's product is a partial sum of
//! the whole output, and the all-reduce adds them).

mod cpu;
mod kv_files;
mod nccl;
mod ops;

pub use cpu::InOrder;
pub use nccl::Nccl;

use super::{Backend, MatKind, Width};
use crate::config::ModelConfig;
use crate::model::shard::ShardPlan;
use crate::quant::Weight;
use crate::{Error, Result};
use std::ops::Range;

/// How the ranks exchange what each computed: copies and a fixed-order reduction in
/// memory for simulated CPU ranks (`InOrder`); NCCL between GPUs.
pub trait Collective<B: Backend>: Sync {
    /// xs[r] (every rank) = the embedding rows of `tokens` × `scale`; rank r's table holds
    /// ids `firsts[r]..` (as many as its rows).
    fn embed(
        &self,
        ranks: &[B],
        tables: &[&B::Mat],
        firsts: &[usize],
        tokens: &[u32],
        scale: f32,
        xs: &mut [&mut B::Act],
    ) -> Result<()>;
    /// outs[r] (every rank) = Σ_r ys[r]·ws[r]ᵀ: the all-reduce of the products of a matrix
    /// split by input columns.
    fn row_parallel(&self, ranks: &[B], ys: &[&B::Act], ws: &[&B::Mat], outs: &mut [&mut B::Act]) -> Result<()>;
    /// Rows `first..` (`rows` of them) of the ranks' parts, side by side: `[rows, Σ
    /// cols_r]` on the host.
    fn gather(&self, ranks: &[B], parts: &[&B::Act], first: usize, rows: usize) -> Result<Vec<f32>> {
        let mut read = vec![];
        for (b, p) in ranks.iter().zip(parts) {
            read.push(b.read_rows(p, first)?);
        }
        Ok(side_by_side(&read, rows))
    }
}

/// Row-major arrays of `rows` rows each joined column-wise.
fn side_by_side(parts: &[Vec<f32>], rows: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    if rows == 0 {
        return out;
    }
    for i in 0..rows {
        for p in parts {
            let w = p.len() / rows;
            out.extend_from_slice(&p[i * w..(i + 1) * w]);
        }
    }
    out
}

/// A model's ranks: the inner backends, the plan that shares the model between them and
/// the transport between them.
pub struct Sharded<B: Backend, C: Collective<B>> {
    pub ranks: Vec<B>,
    pub plan: ShardPlan,
    head_dim: usize,
    comm: C,
}

/// An activation: each rank's part (all of it, for `Width::Model`), and, after a
/// reduction over ranks to the host (argmax, top-k), its values.
pub struct ShardedAct<A> {
    parts: Vec<A>,
    rows: usize,
    cols: usize,
    width: Width,
    host: Option<Vec<f32>>,
}

/// A matrix: each rank's part (or a copy of the whole, for `MatKind::Whole`).
pub struct ShardedMat<M> {
    parts: Vec<M>,
    kind: MatKind,
}

/// A KV store: each rank's store of its KV heads (the same blocks on every rank), whether
/// its rows are quantized, and which layers are sliding (they have no bf16 head rows).
pub struct ShardedKv<K> {
    parts: Vec<K>,
    quantized: bool,
    sliding: Vec<bool>,
}

impl<B: Backend, C: Collective<B>> Sharded<B, C> {
    /// `ranks` sharing the model of shape `cfg`, exchanging through `comm`; refused when
    /// the shape cannot be split between that many (model::shard).
    pub fn new(ranks: Vec<B>, cfg: &ModelConfig, comm: C) -> Result<Self> {
        let plan = ShardPlan::new(cfg, ranks.len())?;
        Ok(Sharded { ranks, plan, head_dim: cfg.head_dim, comm })
    }

    /// Rank r's columns of `width` (None: all of them).
    fn range(&self, r: usize, width: Width) -> Option<Range<usize>> {
        let (s, hd) = (&self.plan.ranks[r], self.head_dim);
        let part = match width {
            Width::Model => return None,
            Width::Heads => s.q_heads.start * hd..s.q_heads.end * hd,
            Width::KvHeads => s.kv_heads.start * hd..s.kv_heads.end * hd,
            Width::Ffn => s.ffn.clone(),
            Width::Vocab => s.vocab.clone(),
        };
        Some(part)
    }

    /// The whole extent of `width` the plan splits (what a split matrix must have).
    fn extent(&self, width: Width) -> Option<usize> {
        let last = self.plan.ranks.last()?;
        let hd = self.head_dim;
        match width {
            Width::Model => None,
            Width::Heads => Some(last.q_heads.end * hd),
            Width::KvHeads => Some(self.plan.ranks.iter().map(|s| s.kv_heads.end).max()? * hd),
            Width::Ffn => Some(last.ffn.end),
            Width::Vocab => Some(last.vocab.end),
        }
    }

    /// Each rank's part of `w` as `kind` says.
    fn parts(&self, w: Weight, kind: MatKind) -> Result<Vec<Weight>> {
        let n = self.ranks.len();
        let (width, along) = match kind {
            MatKind::Whole => return Ok(vec![w; n]),
            MatKind::Rows(width) => (width, w.rows()),
            MatKind::Cols(width, _) => (width, w.cols()),
        };
        if width == Width::Model {
            return Ok(vec![w; n]);
        }
        if self.extent(width) != Some(along) {
            return Err(Error::Unsupported(format!(
                "tensor parallelism over {n} ranks: {along} {} where the model's shape has {} ({width:?}; a padded vocabulary cannot be split)",
                if matches!(kind, MatKind::Rows(_)) { "rows" } else { "columns" },
                self.extent(width).unwrap_or(0)
            )));
        }
        (0..n)
            .map(|r| {
                let part = self.range(r, width).expect("a split width");
                match kind {
                    MatKind::Cols(_, unit) => {
                        if let Some(cut) = [part.start, part.end].into_iter().find(|c| !c.is_multiple_of(unit)) {
                            return Err(Error::Unsupported(format!(
                                "tensor parallelism over {n} ranks: a cut at column {cut} would fall inside a unit of {unit} columns the products sum together"
                            )));
                        }
                        w.cols_part(part)
                    }
                    _ => w.rows_part(part),
                }
            })
            .collect()
    }

    fn act_parts(&self, rows: usize, cols: usize, width: Width, f32: bool) -> Result<ShardedAct<B::Act>> {
        let parts = self
            .ranks
            .iter()
            .enumerate()
            .map(|(r, b)| {
                let c = self.range(r, width).map_or(cols, |p| p.len());
                match f32 {
                    true => b.act_f32(rows, c),
                    false => b.act(rows, c),
                }
            })
            .collect::<Result<_>>()?;
        Ok(ShardedAct { parts, rows, cols, width, host: None })
    }

    /// Rank r's count of `heads` (of `total` in the whole model) for an activation.
    fn heads_of(&self, x: &ShardedAct<B::Act>, r: usize, total: usize) -> usize {
        match self.range(r, x.width) {
            Some(p) => p.len() / self.head_dim,
            None => total,
        }
    }
}
