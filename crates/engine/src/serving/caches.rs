//! Where the running requests' keys and values live: one store shared by every request,
//! blocks taken as sequences grow, full blocks published to the prefix cache.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::kv::paged::{Exhausted, PagedKv, SeqKv};
use crate::kv::scheme::KvScheme;
use crate::kv::{block_bytes, has_sliding, store_bytes, KvBlocks, BLOCK};
use crate::model::Decoder;
use crate::Result;

pub(super) struct Caches<B: Backend> {
    pub(super) store: B::Kv,
    paged: PagedKv,
    bytes: usize,
    /// Bytes of a main-pool block and of a head block (bf16, `--kv-start`).
    block_bytes: (usize, usize),
}

/// How a budget of `bytes` splits into blocks of `scheme`'s rows: the sliding layers get
/// what `max_batch` sequences need at once (their window and one step of `step_rows`), the
/// bf16 head blocks `max_batch` sequences' `lead` each (`--kv-start`; at most half the
/// budget), the full layers the rest.
pub(super) fn split_budget(
    cfg: &ModelConfig,
    scheme: &KvScheme,
    bytes: usize,
    (max_batch, step_rows): (usize, usize),
    lead: usize,
) -> KvBlocks {
    let (full_block, sliding_block) = block_bytes(cfg, scheme);
    let sliding = match sliding_block > 0 {
        true => {
            let per_seq = (cfg.sliding_window + step_rows - 1).div_ceil(BLOCK) + 1;
            let cap = bytes / 2 / sliding_block;
            (max_batch * per_seq).min(cap).max(per_seq)
        }
        false => 0,
    };
    let head_block = block_bytes(cfg, &KvScheme::Bf16).0;
    let head = match lead {
        0 => 0,
        n => (max_batch * n).min(bytes / 2 / head_block.max(1)).max(n),
    };
    let rest = bytes.saturating_sub(sliding * sliding_block + head * head_block);
    let full = match full_block {
        0 => sliding,
        n => rest / n,
    };
    KvBlocks { full, sliding, head }
}

impl<B: Backend> Caches<B> {
    /// A store of `model.kv_scheme()`'s rows within `bytes`.
    pub(super) fn new(model: &Decoder<B>, bytes: usize, max_batch: usize, step_rows: usize) -> Result<Self> {
        let (cfg, scheme) = (&model.cfg, model.kv_scheme());
        let lead = model.kv_start() / BLOCK;
        let blocks = split_budget(cfg, scheme, bytes, (max_batch, step_rows), lead);
        let sliding = has_sliding(cfg).then_some((blocks.sliding, cfg.sliding_window));
        Ok(Caches {
            store: model.backend.kv_store_scheme(cfg, blocks, scheme)?,
            paged: PagedKv::new(BLOCK, blocks.full, sliding).with_head(blocks.head, lead),
            bytes: store_bytes(cfg, scheme, blocks),
            block_bytes: (block_bytes(cfg, scheme).0, block_bytes(cfg, &KvScheme::Bf16).0),
        })
    }

    /// Whether a request of `cap` positions can ever run here.
    pub(super) fn fits(&self, cap: usize) -> bool {
        self.paged.holds(cap.div_ceil(BLOCK))
    }

    /// A place for a request holding `tokens` (its prompt, or prompt and generated tokens
    /// after a preemption), starting from the longest cached prefix, if there is room now
    /// for all of it and the first generated position. `generated_from`: where its
    /// generated rows start when they take an arithmetic of their own (`usize::MAX`
    /// otherwise: paged.rs `start_from`).
    pub(super) fn admit(&mut self, tokens: &[u32], generated_from: usize) -> Option<SeqKv> {
        let fits = self.paged.can_take(0, (tokens.len() + 1).div_ceil(BLOCK));
        fits.then(|| self.paged.start_from(tokens, generated_from))
    }

    /// Positions of `tokens` the prefix cache holds now (whole blocks; at least the last
    /// token left to compute).
    pub(super) fn cached_prefix(&mut self, tokens: &[u32]) -> usize {
        let place = self.paged.start(tokens);
        let n = place.len;
        self.paged.free(place);
        n
    }

    /// A place for `tokens` from the longest cached prefix, whatever room there is (the
    /// disk prefix cache fills the rest block by block).
    pub(super) fn start(&mut self, tokens: &[u32]) -> SeqKv {
        self.paged.start(tokens)
    }

    /// Give `place`'s sliding blocks before block `first` back, unpublished.
    pub(super) fn release_sliding_before(&mut self, place: &mut SeqKv, first: usize) {
        self.paged.release_sliding_before(place, first);
    }

    /// Blocks for `place` to hold positions up to `upto`.
    pub(super) fn reserve(&mut self, place: &mut SeqKv, upto: usize) -> std::result::Result<(), Exhausted> {
        self.paged.reserve(place, upto)
    }

    /// The step wrote `place`'s positions up to `upto`; `tokens` holds them.
    pub(super) fn commit(&mut self, place: &mut SeqKv, tokens: &[u32], upto: usize) {
        self.paged.commit(place, tokens, upto);
    }

    /// The request left (or was preempted): its blocks go back, cached ones stay findable.
    pub(super) fn free(&mut self, place: SeqKv) {
        self.paged.free(place);
    }

    /// Full-attention blocks the running requests hold, and the cache's (head blocks too).
    pub(super) fn blocks(&self) -> (usize, usize) {
        self.paged.usage()
    }

    /// Bytes the running requests hold, and the cache's size (the sliding layers' blocks
    /// counted in proportion to the full layers').
    pub(super) fn bytes(&self) -> (usize, usize) {
        let head = self.paged.head.as_ref().map_or((0, 0), |(p, _)| (p.used(), p.len()));
        let (fb, hb) = self.block_bytes;
        let (used, total) = (self.paged.full.used() * fb + head.0 * hb, self.paged.full.len() * fb + head.1 * hb);
        (self.bytes * used / total.max(1), self.bytes)
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
        let bf16 = KvScheme::Bf16;
        let b = split_budget(&cfg, &bf16, budget, (8, 128), 0);
        let per_seq = (512usize + 127).div_ceil(BLOCK) + 1;
        assert_eq!(b.sliding, 8 * per_seq);
        assert!(store_bytes(&cfg, &bf16, b) <= budget && b.full * BLOCK > 100_000, "{b:?}");
        // A small budget: at most half of it for the windows, still one request's worth.
        let b = split_budget(&cfg, &bf16, 4 << 20, (8, 128), 0);
        assert_eq!(b.sliding, per_seq);
        // No sliding layers: all of it for the full ones (a position: K and V, bf16).
        let plain = ModelConfig { layer_kinds: vec![], sliding_window: 0, ..cfg };
        let b = split_budget(&plain, &bf16, budget, (8, 128), 0);
        assert_eq!((b.sliding, b.full), (0, budget / (6 * 2 * 256 * 2 * BLOCK)));
        // turbo:k8v3 at head dim 256 takes 400 bytes a position and head (1,024 in bf16):
        // 2.56 times the blocks in the same budget.
        let turbo = KvScheme::parse("turbo").unwrap();
        let t = split_budget(&plain, &turbo, budget, (8, 128), 0);
        assert_eq!(t.full, budget / (6 * 400 * BLOCK));
        assert!(store_bytes(&plain, &turbo, t) <= budget && t.full as f64 >= 2.55 * b.full as f64, "{t:?} {b:?}");
    }
}
