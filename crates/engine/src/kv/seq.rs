//! One sequence's KV cache: a store of its own and the tables of its one sequence, for the
//! single-sequence paths (generation sessions, perplexity, tests). The same blocks and
//! tables as the serving engine's shared cache, so there is one KV implementation.

use super::paged::{PagedKv, SeqKv, NO_BLOCK};
use super::{has_sliding, KvBlocks, Span, BLOCK, CALL_ROWS};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::{Error, Result};

pub struct SeqCache<B: Backend> {
    pub store: B::Kv,
    paged: PagedKv,
    seq: SeqKv,
    max_seq: usize,
}

/// Positions a single sequence's sliding layers keep before a call's window: the greedy
/// steps a device may still have queued (two fed runs) read them after the host has
/// prepared the next run.
pub const RELEASE_LAG: usize = 2 * crate::backend::FEED_STEPS_MAX;

/// Blocks a single sequence of up to `max_seq` positions needs: every position of the
/// full layers; the sliding layers' window, one call of CALL_ROWS and RELEASE_LAG (a
/// call's first query attends from pos0 + 1 - window on, and blocks before that, less
/// the lag, go back to the pool).
pub fn seq_blocks(cfg: &ModelConfig, max_seq: usize) -> KvBlocks {
    let full = max_seq.div_ceil(BLOCK);
    let sliding = match has_sliding(cfg) {
        true => full.min((cfg.sliding_window + CALL_ROWS - 1 + RELEASE_LAG).div_ceil(BLOCK) + 1),
        false => 0,
    };
    KvBlocks { full, sliding, head: 0 }
}

impl<B: Backend> SeqCache<B> {
    pub fn new(b: &B, cfg: &ModelConfig, max_seq: usize) -> Result<Self> {
        Self::with_scheme(b, cfg, max_seq, &super::scheme::KvScheme::Bf16)
    }

    /// A cache whose store holds `scheme`'s rows.
    pub fn with_scheme(b: &B, cfg: &ModelConfig, max_seq: usize, scheme: &super::scheme::KvScheme) -> Result<Self> {
        Self::with_layout(b, cfg, max_seq, scheme, 0)
    }

    /// A cache whose store holds `scheme`'s rows but for the first `kv_start` positions
    /// of the full-attention layers (whole blocks), kept in bf16 (`--kv-start`).
    pub fn with_layout(
        b: &B,
        cfg: &ModelConfig,
        max_seq: usize,
        scheme: &super::scheme::KvScheme,
        kv_start: usize,
    ) -> Result<Self> {
        let mut blocks = seq_blocks(cfg, max_seq);
        let lead = super::head_blocks(scheme, kv_start).min(blocks.full);
        (blocks.full, blocks.head) = (blocks.full - lead, lead);
        Ok(SeqCache {
            store: b.kv_store_scheme(cfg, blocks, scheme)?,
            paged: Self::paged(blocks, has_sliding(cfg).then_some(cfg.sliding_window)),
            seq: SeqKv::default(),
            max_seq,
        })
    }

    /// The tables' bookkeeping over a store of `blocks` (its head blocks a sequence's
    /// first), sliding layers of `window` where the model has them.
    fn paged(blocks: KvBlocks, window: Option<usize>) -> PagedKv {
        let sliding = window.map(|w| (blocks.sliding, w));
        let paged = PagedKv::new(BLOCK, blocks.full, sliding).with_head(blocks.head, blocks.head);
        PagedKv { lag: RELEASE_LAG, ..paged }
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.max_seq
    }

    /// Positions written.
    pub fn len(&self) -> usize {
        self.seq.len
    }

    pub fn is_empty(&self) -> bool {
        self.seq.len == 0
    }

    /// Whether the sliding layers keep only their window (then a call writes at most
    /// CALL_ROWS positions).
    pub fn windowed(&self) -> bool {
        self.paged.sliding.as_ref().is_some_and(|(pool, _)| pool.len() < self.paged.usage().1)
    }

    /// Blocks for `m` positions from pos0 (pos0 at most the length: earlier positions are
    /// rewritten, the ones after forgotten).
    pub fn prepare(&mut self, pos0: usize, m: usize) -> Result<()> {
        if pos0 > self.seq.len {
            return Err(Error::Invalid(format!(
                "forward at position {pos0}, after the {} positions in the cache",
                self.seq.len
            )));
        }
        if pos0 + m > self.max_seq {
            return Err(Error::Invalid(format!(
                "{m} tokens at position {pos0} exceed the context of {} tokens",
                self.max_seq
            )));
        }
        if self.windowed() && m > CALL_ROWS {
            return Err(Error::Invalid(format!(
                "forward: {m} tokens in one call on a cache keeping only the sliding window (at most {CALL_ROWS})"
            )));
        }
        self.seq.len = pos0;
        let first = self.paged.sliding.as_ref().map_or(0, |(_, w)| (pos0 + 1).saturating_sub(*w) / BLOCK);
        if self.seq.sliding.get(first..).is_some_and(|t| t.contains(&NO_BLOCK)) {
            return Err(Error::Invalid(format!(
                "forward at position {pos0}: the sliding window's earlier positions are gone"
            )));
        }
        self.paged
            .reserve(&mut self.seq, pos0 + m)
            .map_err(|_| Error::Invalid(format!("the KV cache has no blocks left for position {}", pos0 + m)))
    }

    /// Whether a call can start at pos0 (at most the length): the sliding layers still
    /// hold the window before it (a rewind past what they released cannot).
    pub fn can_resume(&self, pos0: usize) -> bool {
        let first = self.paged.sliding.as_ref().map_or(0, |(_, w)| (pos0 + 1).saturating_sub(*w) / BLOCK);
        pos0 <= self.seq.len && !self.seq.sliding.get(first..).is_some_and(|t| t.contains(&NO_BLOCK))
    }

    /// The store and the span of `m` rows from pos0 (after `prepare`).
    pub fn span(&mut self, pos0: usize, m: usize) -> (&mut B::Kv, Span<'_>) {
        let s = Span { rows: m, pos0, full: &self.seq.full, sliding: &self.seq.sliding };
        (&mut self.store, s)
    }

    /// Copies of the tables (the full layers', the sliding layers'), for a step whose
    /// launches are queued while the cache is borrowed elsewhere.
    pub fn tables(&self) -> (Vec<u32>, Vec<u32>) {
        (self.seq.full.clone(), self.seq.sliding.clone())
    }

    /// The call wrote positions up to `upto`.
    pub fn advance(&mut self, upto: usize) {
        self.seq.len = upto;
    }

    /// Give the sliding layers' blocks before block `first` back (their positions are gone).
    pub fn release_sliding_before(&mut self, first: usize) {
        self.paged.release_sliding_before(&mut self.seq, first);
    }

    /// Start over, empty, as a new cache: the blocks handed out in order again (0, 1, …).
    pub fn clear(&mut self) {
        let sliding = self.paged.sliding.as_ref().map(|(pool, w)| (pool.len(), *w));
        let head = self.paged.head_blocks();
        let blocks = KvBlocks { full: self.paged.full.len(), sliding: sliding.map_or(0, |s| s.0), head };
        self.paged = Self::paged(blocks, sliding.map(|s| s.1));
        self.seq = SeqKv::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;

    /// A sequence's blocks come in order, as from a new cache, after a rewind and after the
    /// cache is cleared for its next session.
    #[test]
    fn blocks_come_in_order_after_rewinds_and_clears() {
        let cfg = ModelConfig { n_layers: 2, n_heads: 2, n_kv_heads: 1, head_dim: 32, ..Default::default() };
        let mut c = SeqCache::new(&Cpu, &cfg, 10 * BLOCK).unwrap();
        let in_order = |c: &SeqCache<Cpu>| c.seq.full.iter().enumerate().all(|(i, &b)| b as usize == i);
        c.prepare(0, 3 * BLOCK + 5).unwrap();
        c.advance(3 * BLOCK + 5);
        c.prepare(BLOCK, 4 * BLOCK).unwrap();
        c.advance(5 * BLOCK);
        assert!(in_order(&c) && c.seq.full.len() == 5, "{:?}", c.seq.full);
        c.clear();
        assert!(c.is_empty());
        c.prepare(0, 7 * BLOCK).unwrap();
        assert!(in_order(&c) && c.seq.full.len() == 7, "{:?}", c.seq.full);
        // Past the context, or after the positions written: refused.
        assert!(c.prepare(0, 10 * BLOCK + 1).is_err());
        assert!(c.prepare(8, 1).is_err());
    }
}
