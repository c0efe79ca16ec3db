//! How tensor parallelism splits a model between ranks (Megatron's layout): each rank
//! takes some query heads with their KV heads (q/k/v by output rows, o by input columns),
//! some FFN columns (gate/up by rows, down by columns) and some of the vocabulary (the
//! embedding and the head by rows); the ranks' output-projection sums meet in an
//! all-reduce, their logits in a gather (backend::sharded runs the ranks).
//!
//! Cuts fall where every rank's sums are whole units of the unsharded ones: between heads
//! (the output projection sums a head at a time) and at multiples of `FFN_UNIT` FFN
//! columns (the down projection sums that many at a time), so on the CPU the ranks' parts
//! add up, in rank order, to exactly the unsharded sums.

use crate::config::ModelConfig;
use crate::{Error, Result};
use std::ops::Range;

/// Columns of the down projection summed as one unit, and the granularity of the FFN's
/// split between ranks.
pub const FFN_UNIT: usize = 256;

/// One rank's share of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShard {
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub ffn: Range<usize>,
    pub vocab: Range<usize>,
}

/// Every rank's share, in rank order (rank r's parts come before rank r+1's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub ranks: Vec<RankShard>,
}

/// `n` nearly equal consecutive parts of `0..len` (the first ones one larger).
fn even_parts(len: usize, n: usize) -> Vec<Range<usize>> {
    let (base, extra) = (len / n, len % n);
    let mut start = 0;
    (0..n)
        .map(|r| {
            let end = start + base + usize::from(r < extra);
            let part = start..end;
            start = end;
            part
        })
        .collect()
}

impl ShardPlan {
    /// The whole model on one rank.
    pub fn whole(cfg: &ModelConfig) -> ShardPlan {
        ShardPlan {
            ranks: vec![RankShard {
                q_heads: 0..cfg.n_heads,
                kv_heads: 0..cfg.n_kv_heads,
                ffn: 0..cfg.ffn,
                vocab: 0..cfg.vocab,
            }],
        }
    }

    /// The model split between `n` ranks, or why it cannot be.
    pub fn new(cfg: &ModelConfig, n: usize) -> Result<ShardPlan> {
        let no = |why: String| Err(Error::Unsupported(format!("tensor parallelism over {n} ranks: {why}")));
        if n == 0 {
            return no("no ranks".into());
        }
        if n == 1 {
            return Ok(ShardPlan::whole(cfg));
        }
        let (h, kvh) = (cfg.n_heads, cfg.n_kv_heads);
        let group = h / kvh;
        // KV heads split between the ranks, or each replicated on n / kvh ranks that
        // share its query heads.
        let heads: Vec<(Range<usize>, Range<usize>)> = if kvh >= n {
            even_parts(kvh, n).into_iter().map(|kv| (kv.start * group..kv.end * group, kv)).collect()
        } else {
            let per_kv = n / kvh;
            if !n.is_multiple_of(kvh) || !group.is_multiple_of(per_kv) {
                return no(format!(
                    "{kvh} KV heads with {group} query heads each cannot be shared evenly (ranks must be a multiple of the KV heads, and divide each one's query heads)"
                ));
            }
            let q = group / per_kv;
            (0..n).map(|r| (r * q..(r + 1) * q, r / per_kv..r / per_kv + 1)).collect()
        };
        if !cfg.ffn.is_multiple_of(FFN_UNIT) || cfg.ffn / FFN_UNIT < n {
            return no(format!("the FFN width {} is not {n} or more whole units of {FFN_UNIT} columns", cfg.ffn));
        }
        let ffn = even_parts(cfg.ffn / FFN_UNIT, n);
        if cfg.vocab < n {
            return no(format!("a vocabulary of {} ids", cfg.vocab));
        }
        let vocab = even_parts(cfg.vocab, n);
        let ranks = heads
            .into_iter()
            .zip(ffn)
            .zip(vocab)
            .map(|(((q_heads, kv_heads), f), vocab)| RankShard {
                q_heads,
                kv_heads,
                ffn: f.start * FFN_UNIT..f.end * FFN_UNIT,
                vocab,
            })
            .collect();
        Ok(ShardPlan { ranks })
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// The model rank `r` runs: the shape of its share.
    pub fn rank_config(&self, cfg: &ModelConfig, r: usize) -> ModelConfig {
        let s = &self.ranks[r];
        ModelConfig {
            n_heads: s.q_heads.len(),
            n_kv_heads: s.kv_heads.len(),
            ffn: s.ffn.len(),
            vocab: s.vocab.len(),
            ..cfg.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(h: usize, kvh: usize, ffn: usize) -> ModelConfig {
        ModelConfig { n_heads: h, n_kv_heads: kvh, ffn, vocab: 1000, head_dim: 64, ..Default::default() }
    }

    #[test]
    fn heads_follow_their_kv_heads() {
        // SmolLM2: 9 query heads over 3 KV heads, on 2 ranks: 2 KV heads and 1.
        let p = ShardPlan::new(&shape(9, 3, 1536), 2).unwrap();
        assert_eq!(p.ranks[0].q_heads, 0..6);
        assert_eq!(p.ranks[0].kv_heads, 0..2);
        assert_eq!(p.ranks[1].q_heads, 6..9);
        assert_eq!(p.ranks[1].kv_heads, 2..3);
        assert_eq!((p.ranks[0].ffn.clone(), p.ranks[1].ffn.clone()), (0..768, 768..1536));
        assert_eq!((p.ranks[0].vocab.clone(), p.ranks[1].vocab.clone()), (0..500, 500..1000));
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        // Gemma 3 270M: 4 query heads, 1 KV head, on 2 ranks: each has the KV head.
        let p = ShardPlan::new(&shape(4, 1, 2048), 2).unwrap();
        assert_eq!(p.ranks[1].q_heads, 2..4);
        assert_eq!(p.ranks[1].kv_heads, 0..1);
        let c = p.rank_config(&shape(4, 1, 2048), 1);
        assert_eq!((c.n_heads, c.n_kv_heads, c.ffn, c.vocab), (2, 1, 1024, 500));
    }

    /// The shapes issue 31 measures split over 2, 4 and 8 GPUs into equal parts.
    #[test]
    fn the_8b_and_70b_shapes_split_evenly() {
        for name in ["llama-3.1-8b", "llama-3.1-70b"] {
            let c = crate::formats::synthetic::config(name).unwrap();
            for n in [2, 4, 8] {
                let p = ShardPlan::new(&c, n).unwrap();
                for s in &p.ranks {
                    assert_eq!((s.q_heads.len(), s.kv_heads.len()), (c.n_heads / n, c.n_kv_heads / n), "{name} / {n}");
                    assert_eq!(s.ffn.len(), c.ffn / n, "{name} / {n}");
                }
            }
        }
    }

    #[test]
    fn shapes_that_cannot_split_are_refused_by_name() {
        let e = ShardPlan::new(&shape(9, 3, 1536), 4).unwrap_err().to_string();
        assert!(e.contains("3 KV heads"), "{e}");
        let e = ShardPlan::new(&shape(8, 8, 1000), 2).unwrap_err().to_string();
        assert!(e.contains("FFN width 1000"), "{e}");
        assert!(ShardPlan::new(&shape(8, 8, 1024), 0).is_err());
        assert_eq!(ShardPlan::new(&shape(8, 8, 1024), 1).unwrap(), ShardPlan::whole(&shape(8, 8, 1024)));
    }
}
