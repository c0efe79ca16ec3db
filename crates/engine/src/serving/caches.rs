//! Where the running requests' keys and values live. On a backend whose store honours
//! block tables (`Backend::kv_paged`), one store shared by every request: blocks taken as
//! sequences grow, full blocks published to the prefix cache, one forward call per step.
//! Otherwise (CUDA until its kernels index through tables) each request has a store of its
//! own, sized for its whole context when it is admitted, and runs its own forward call.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::kv::paged::{Exhausted, PagedKv, SeqKv};
use crate::kv::seq::SeqCache;
use crate::kv::{has_sliding, layer_position_bytes, sliding_layers, KvBlocks, BLOCK};
use crate::model::Decoder;
use crate::Result;

pub(super) enum Caches<B: Backend> {
    Shared { store: B::Kv, paged: Box<PagedKv>, bytes: usize },
    Own { budget: usize, used: usize, position_bytes: usize },
}

/// A request's place in the caches.
pub(super) enum Place<B: Backend> {
    Shared(SeqKv),
    Own(Box<SeqCache<B>>),
}

impl<B: Backend> Place<B> {
    /// Positions written.
    pub(super) fn len(&self) -> usize {
        match self {
            Place::Shared(s) => s.len,
            Place::Own(c) => c.len(),
        }
    }
}

/// How a budget of `bytes` splits into blocks: the sliding layers get what `max_batch`
/// sequences need at once (their window and one step of `step_rows`), the full layers
/// the rest.
pub(super) fn split_budget(cfg: &ModelConfig, bytes: usize, max_batch: usize, step_rows: usize) -> KvBlocks {
    let per_position = layer_position_bytes(cfg) * BLOCK;
    let sliding_layers = sliding_layers(cfg);
    let full_layers = cfg.n_layers - sliding_layers;
    let sliding = match has_sliding(cfg) {
        true => {
            let per_seq = (cfg.sliding_window + step_rows - 1).div_ceil(BLOCK) + 1;
            let cap = bytes / 2 / (sliding_layers * per_position);
            (max_batch * per_seq).min(cap).max(per_seq)
        }
        false => 0,
    };
    let rest = bytes.saturating_sub(sliding * sliding_layers * per_position);
    let full = match full_layers {
        0 => sliding,
        n => rest / (n * per_position),
    };
    KvBlocks { full, sliding }
}

impl<B: Backend> Caches<B> {
    pub(super) fn new(model: &Decoder<B>, bytes: usize, max_batch: usize, step_rows: usize) -> Result<Self> {
        let cfg = &model.cfg;
        if !model.backend.kv_paged() {
            let position_bytes = cfg.n_layers * layer_position_bytes(cfg);
            return Ok(Caches::Own { budget: bytes, used: 0, position_bytes });
        }
        let blocks = split_budget(cfg, bytes, max_batch, step_rows);
        let sliding = has_sliding(cfg).then_some((blocks.sliding, cfg.sliding_window));
        Ok(Caches::Shared {
            store: model.backend.kv_store(cfg, blocks)?,
            paged: Box::new(PagedKv::new(BLOCK, blocks.full, sliding)),
            bytes: crate::kv::store_bytes(cfg, blocks),
        })
    }

    /// Whether a request of `cap` positions can ever run here.
    pub(super) fn fits(&self, cap: usize) -> bool {
        match self {
            Caches::Shared { paged, .. } => cap.div_ceil(BLOCK) <= paged.full.len(),
            Caches::Own { budget, position_bytes, .. } => cap * position_bytes <= *budget,
        }
    }

    /// A place for a request of `cap` positions holding `tokens` (its prompt, or prompt
    /// and generated tokens after a preemption), if there is room now: the shared cache
    /// finds the longest cached prefix of `tokens`.
    pub(super) fn admit(&mut self, model: &Decoder<B>, tokens: &[u32], cap: usize) -> Result<Option<Place<B>>> {
        match self {
            Caches::Shared { paged, .. } => {
                // Room for the whole prompt, computed, and the first generated position.
                if paged.full.available() < (tokens.len() + 1).div_ceil(BLOCK) {
                    return Ok(None);
                }
                Ok(Some(Place::Shared(paged.start(tokens))))
            }
            Caches::Own { budget, used, position_bytes } => {
                if *used + cap * *position_bytes > *budget {
                    return Ok(None);
                }
                let cache = SeqCache::new(&model.backend, &model.cfg, cap)?;
                *used += cap * *position_bytes;
                Ok(Some(Place::Own(Box::new(cache))))
            }
        }
    }

    /// Blocks for `place` to hold positions up to `upto` (own stores hold them already).
    pub(super) fn reserve(&mut self, place: &mut Place<B>, upto: usize) -> std::result::Result<(), Exhausted> {
        match (self, place) {
            (Caches::Shared { paged, .. }, Place::Shared(s)) => paged.reserve(s, upto),
            _ => Ok(()),
        }
    }

    /// The step wrote `place`'s positions up to `upto`; `tokens` holds them.
    pub(super) fn commit(&mut self, place: &mut Place<B>, tokens: &[u32], upto: usize) {
        if let (Caches::Shared { paged, .. }, Place::Shared(s)) = (self, place) {
            paged.commit(s, tokens, upto);
        }
    }

    /// The request left (or was preempted): its blocks or its store go back.
    pub(super) fn free(&mut self, place: Place<B>) {
        match (self, place) {
            (Caches::Shared { paged, .. }, Place::Shared(s)) => paged.free(s),
            (Caches::Own { used, position_bytes, .. }, Place::Own(c)) => {
                *used -= c.capacity() * *position_bytes;
            }
            _ => {}
        }
    }

    /// Full-attention blocks the running requests hold, and the cache's.
    pub(super) fn blocks(&self) -> (usize, usize) {
        match self {
            Caches::Shared { paged, .. } => (paged.full.used(), paged.full.len()),
            Caches::Own { .. } => (0, 0),
        }
    }

    /// Bytes the running requests hold, and the cache's size.
    pub(super) fn bytes(&self) -> (usize, usize) {
        match self {
            Caches::Shared { paged, bytes, .. } => {
                let (used, total) = (paged.full.used(), paged.full.len().max(1));
                (bytes * used / total, *bytes)
            }
            Caches::Own { budget, used, .. } => (*used, *budget),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AttnKind;

    /// Gemma-like layers (5 sliding, 1 full, window 512): the sliding pool holds every
    /// running request's window and step, the full layers the rest, within the budget.
    #[test]
    fn the_budget_splits_into_windows_and_the_rest() {
        let kinds = [[AttnKind::Sliding; 5].as_slice(), &[AttnKind::Full]].concat();
        let cfg = ModelConfig {
            n_layers: 6,
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: 256,
            sliding_window: 512,
            layer_kinds: kinds,
            ..Default::default()
        };
        let budget = 1 << 30;
        let b = split_budget(&cfg, budget, 8, 128);
        let per_seq = (512usize + 127).div_ceil(BLOCK) + 1;
        assert_eq!(b.sliding, 8 * per_seq);
        assert!(crate::kv::store_bytes(&cfg, b) <= budget && b.full * BLOCK > 100_000, "{b:?}");
        // A small budget: at most half of it for the windows, still one request's worth.
        let b = split_budget(&cfg, 4 << 20, 8, 128);
        assert_eq!(b.sliding, per_seq);
        // No sliding layers: all of it for the full ones.
        let plain = ModelConfig { layer_kinds: vec![], sliding_window: 0, ..cfg };
        let b = split_budget(&plain, budget, 8, 128);
        assert_eq!((b.sliding, b.full), (0, budget / (6 * layer_position_bytes(&plain) * BLOCK)));
    }
}
