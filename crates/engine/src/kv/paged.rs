//! A paged KV cache's sequences: each holds a block table per kind of layer (full
//! attention, and sliding-window layers where the model has them), filled as it grows,
//! starting from the longest prefix the cache already holds. A sliding layer's blocks that
//! fall wholly out of the window go back to its pool (cached, so a later request with the
//! same prefix can still find them).
//!
//! Position p of a sequence lives in row `table[p / block] · block + p % block` of its
//! layers' block storage.
//!
//! With `--kv-start` (`with_head`) a sequence's first `head` blocks of the full layers come
//! from a second pool of bf16 blocks, whose ids follow the main pool's (store block
//! `full.len() + i`), so one table and one row space address both; the store keeps those
//! rows in bf16.

use super::blocks::BlockPool;

/// A table entry for a sliding layer's block released out of the window.
pub const NO_BLOCK: u32 = u32::MAX;

/// The blocks ran out: the caller frees a sequence (preemption) or waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exhausted;

/// One sequence's tables.
#[derive(Clone, Debug)]
pub struct SeqKv {
    pub full: Vec<u32>,
    /// Empty when the model has no sliding layers.
    pub sliding: Vec<u32>,
    /// Positions written.
    pub len: usize,
    /// Leading positions found in the prefix cache instead of computed.
    pub cached: usize,
    /// Chain hash after each full block published so far.
    hashes: Vec<u64>,
    /// The first position computed as a generated row where those rows take an arithmetic
    /// of their own (`start_from`); `usize::MAX`: none.
    generated_from: usize,
}

impl Default for SeqKv {
    /// An empty sequence whose rows all take the prompt's arithmetic.
    fn default() -> Self {
        SeqKv { full: vec![], sliding: vec![], len: 0, cached: 0, hashes: vec![], generated_from: usize::MAX }
    }
}

/// The parent a block ending at `end` is published and found under: the prefix's hash, or,
/// for a block reaching past `generated_from`, that hash joined with `generated_from`. A
/// generated row's keys and values differ from what a prompt row computes for the same token
/// where generated rows take an arithmetic of their own, so such blocks serve only
/// sequences that generated from the same position (the same request readmitted after a
/// preemption), never a prompt that contains those tokens.
fn keyed(parent: u64, end: usize, generated_from: usize) -> u64 {
    match end > generated_from {
        true => super::blocks::chain_hash(!parent, &[generated_from as u32, (generated_from >> 32) as u32]),
        false => parent,
    }
}

impl SeqKv {
    /// A forward call's `rows` rows of this sequence, from its first unwritten position.
    pub fn span(&self, rows: usize) -> super::Span<'_> {
        super::Span { rows, pos0: self.len, full: &self.full, sliding: &self.sliding }
    }
}

pub struct PagedKv {
    pub block: usize,
    /// Positions before a step's window whose sliding blocks are still kept (for steps
    /// queued on a device that may still read them: kv::seq::SeqCache); 0 normally.
    pub lag: usize,
    pub full: BlockPool,
    /// The sliding layers' pool and window.
    pub sliding: Option<(BlockPool, usize)>,
    /// The bf16 head blocks' pool and how many leading blocks of a sequence it holds.
    pub head: Option<(BlockPool, usize)>,
}

impl PagedKv {
    pub fn new(block: usize, full_blocks: usize, sliding: Option<(usize, usize)>) -> PagedKv {
        assert!(block > 0, "a block holds at least one position");
        PagedKv {
            block,
            lag: 0,
            full: BlockPool::new(full_blocks),
            sliding: sliding.map(|(n, w)| (BlockPool::new(n), w)),
            head: None,
        }
    }

    /// The same cache with every sequence's first `leading` blocks from a pool of `blocks`
    /// bf16 blocks (`--kv-start`; none when `leading` is 0).
    pub fn with_head(self, blocks: usize, leading: usize) -> PagedKv {
        PagedKv { head: (leading > 0).then(|| (BlockPool::new(blocks), leading)), ..self }
    }

    /// Leading blocks of a sequence the head pool holds.
    pub fn head_blocks(&self) -> usize {
        self.head.as_ref().map_or(0, |(_, n)| *n)
    }

    /// The pool logical block `i` of a sequence comes from, and its ids' offset.
    fn pool(&mut self, i: usize) -> (&mut BlockPool, u32) {
        let offset = self.full.len() as u32;
        match &mut self.head {
            Some((pool, n)) if i < *n => (pool, offset),
            _ => (&mut self.full, 0),
        }
    }

    /// Whether `blocks` more blocks from logical block `from` on are free now (head and
    /// main pools apart).
    pub fn can_take(&self, from: usize, blocks: usize) -> bool {
        let lead = self.head_blocks();
        let head_need = lead.saturating_sub(from).min(blocks);
        self.head.as_ref().is_none_or(|(pool, _)| pool.available() >= head_need)
            && self.full.available() >= blocks - head_need
    }

    /// Whether a sequence of `blocks` blocks fits the pools at all.
    pub fn holds(&self, blocks: usize) -> bool {
        let head_need = self.head_blocks().min(blocks);
        self.head.as_ref().is_none_or(|(pool, _)| pool.len() >= head_need) && self.full.len() >= blocks - head_need
    }

    /// Blocks held by sequences and in all, over both pools of the full layers.
    pub fn usage(&self) -> (usize, usize) {
        let (hu, hl) = self.head.as_ref().map_or((0, 0), |(p, _)| (p.used(), p.len()));
        (self.full.used() + hu, self.full.len() + hl)
    }

    /// A sequence for `prompt`, holding the longest cached prefix of whole blocks that
    /// leaves at least its last token to compute (whose logits the caller needs).
    pub fn start(&mut self, prompt: &[u32]) -> SeqKv {
        self.start_from(prompt, usize::MAX)
    }

    /// `start` for a sequence whose positions from `generated_from` on are (or will be)
    /// computed as generated rows in an arithmetic of their own: blocks reaching past it
    /// are published and found under keys that carry it (`keyed`).
    pub fn start_from(&mut self, tokens: &[u32], generated_from: usize) -> SeqKv {
        let b = self.block;
        let mut s = SeqKv { generated_from, ..SeqKv::default() };
        let mut parent = 0;
        for (i, chunk) in tokens[..tokens.len().saturating_sub(1)].chunks_exact(b).enumerate() {
            let (pool, offset) = self.pool(i);
            let Some((blk, h)) = pool.lookup(keyed(parent, (i + 1) * b, generated_from), chunk) else { break };
            s.full.push(blk + offset);
            s.hashes.push(h);
            parent = h;
        }
        // The sliding layers need their blocks over the window before the prefix's end.
        if let Some((pool, window)) = &self.sliding {
            while !s.full.is_empty() {
                let k = s.full.len();
                let first = (k * b).saturating_sub(*window) / b;
                let parent = |i: usize| keyed(if i == 0 { 0 } else { s.hashes[i - 1] }, (i + 1) * b, generated_from);
                let found: Option<Vec<u32>> = (first..k)
                    .map(|i| pool.lookup(parent(i), &tokens[i * b..(i + 1) * b]))
                    .map(|f| f.map(|(blk, _)| blk))
                    .collect();
                if let Some(found) = found {
                    s.sliding = vec![NO_BLOCK; first];
                    s.sliding.extend(found);
                    break;
                }
                s.full.pop();
                s.hashes.pop();
            }
        }
        for (i, &blk) in s.full.iter().enumerate() {
            let (pool, offset) = self.pool(i);
            pool.retain(blk - offset);
        }
        if let Some((pool, _)) = &mut self.sliding {
            s.sliding.iter().filter(|&&x| x != NO_BLOCK).for_each(|&blk| pool.retain(blk));
        }
        s.len = s.full.len() * b;
        s.cached = s.len;
        s
    }

    /// Blocks for positions up to `upto` (the next step writes s.len..upto). A sliding
    /// layer's blocks that no query from s.len on attends are released first. Nothing is
    /// taken when the blocks do not suffice.
    pub fn reserve(&mut self, s: &mut SeqKv, upto: usize) -> Result<(), Exhausted> {
        let b = self.block;
        let need = upto.div_ceil(b);
        let new_full = need.saturating_sub(s.full.len());
        if let Some((pool, window)) = &mut self.sliding {
            // The step's first query, at s.len, attends from s.len + 1 - window on.
            let keep_from = (s.len + 1).saturating_sub(*window + self.lag) / b;
            for x in s.sliding.iter_mut().take(keep_from) {
                if *x != NO_BLOCK {
                    pool.release(std::mem::replace(x, NO_BLOCK));
                }
            }
            if pool.available() < need.saturating_sub(s.sliding.len()) {
                return Err(Exhausted);
            }
        }
        if !self.can_take(s.full.len(), new_full) {
            return Err(Exhausted);
        }
        while s.full.len() < need {
            let (pool, offset) = self.pool(s.full.len());
            s.full.push(pool.alloc().expect("counted above") + offset);
        }
        if let Some((pool, _)) = &mut self.sliding {
            while s.sliding.len() < need {
                s.sliding.push(pool.alloc().expect("counted above"));
            }
        }
        Ok(())
    }

    /// The step wrote positions up to `upto`; `tokens` are the sequence's tokens (at least
    /// `upto`). Blocks it filled are published to the prefix cache.
    pub fn commit(&mut self, s: &mut SeqKv, tokens: &[u32], upto: usize) {
        let b = self.block;
        s.len = upto;
        while s.hashes.len() < upto / b {
            let i = s.hashes.len();
            let parent = keyed(if i == 0 { 0 } else { s.hashes[i - 1] }, (i + 1) * b, s.generated_from);
            let chunk = &tokens[i * b..(i + 1) * b];
            let (pool, offset) = self.pool(i);
            let h = pool.publish(s.full[i] - offset, parent, chunk);
            if let Some((pool, _)) = &mut self.sliding {
                if s.sliding[i] != NO_BLOCK {
                    pool.publish(s.sliding[i], parent, chunk);
                }
            }
            s.hashes.push(h);
        }
    }

    /// Give `s`'s sliding-layer blocks before block `first` back, unpublished (their rows
    /// were never written, or are no longer wanted).
    pub fn release_sliding_before(&mut self, s: &mut SeqKv, first: usize) {
        if let Some((pool, _)) = &mut self.sliding {
            for x in s.sliding.iter_mut().take(first) {
                if *x != NO_BLOCK {
                    pool.release(std::mem::replace(x, NO_BLOCK));
                }
            }
        }
    }

    /// The sequence is done (or preempted): its blocks go back, cached ones stay findable.
    pub fn free(&mut self, s: SeqKv) {
        for (i, &blk) in s.full.iter().enumerate() {
            let (pool, offset) = self.pool(i);
            pool.release(blk - offset);
        }
        if let Some((pool, _)) = &mut self.sliding {
            s.sliding.iter().filter(|&&x| x != NO_BLOCK).for_each(|&blk| pool.release(blk));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run a sequence of `tokens` through the cache in steps of `step` positions.
    fn fill(kv: &mut PagedKv, tokens: &[u32], step: usize) -> SeqKv {
        let mut s = kv.start(tokens);
        while s.len < tokens.len() {
            let upto = (s.len + step).min(tokens.len());
            kv.reserve(&mut s, upto).unwrap();
            kv.commit(&mut s, tokens, upto);
        }
        s
    }

    #[test]
    fn a_second_request_reuses_the_first_ones_whole_blocks() {
        let mut kv = PagedKv::new(4, 16, None);
        let a: Vec<u32> = (0..14).collect();
        let sa = fill(&mut kv, &a, 5);
        assert_eq!((sa.full.len(), sa.cached, kv.full.used()), (4, 0, 4));
        // Shares 3 whole blocks (12 tokens) then differs.
        let mut b = a[..12].to_vec();
        b.extend([99, 98, 97]);
        let sb = kv.start(&b);
        assert_eq!((sb.cached, &sb.full[..]), (12, &sa.full[..3]));
        assert_eq!(kv.full.refs(sa.full[0]), 2);
        // A prompt of exactly the cached blocks keeps its last token to compute.
        let sc = kv.start(&a[..8]);
        assert_eq!(sc.cached, 4);
        kv.free(sa);
        kv.free(sb);
        kv.free(sc);
        assert_eq!(kv.full.used(), 0);
        // Cached after everyone left, until the space is needed.
        assert_eq!(kv.start(&b).cached, 12);
    }

    /// Blocks a sequence filled past its `generated_from` are published under keys that
    /// carry it: the sequence readmitted finds them, a prompt of the same tokens (or another
    /// boundary) finds only the blocks before it, with and without sliding layers.
    #[test]
    fn blocks_past_the_generated_rows_start_serve_only_that_start() {
        for sliding in [None, Some((16, 6))] {
            let mut kv = PagedKv::new(4, 16, sliding);
            let t: Vec<u32> = (0..14).collect();
            // 6 prompt positions, then generated ones: block 0 (0..4) plain, 1 and 2 keyed.
            let mut s = kv.start_from(&t[..6], 6);
            while s.len < t.len() {
                let upto = (s.len + 3).min(t.len());
                kv.reserve(&mut s, upto).unwrap();
                kv.commit(&mut s, &t, upto);
            }
            kv.free(s);
            for (from, cached) in [(6, 12), (usize::MAX, 4), (10, 4), (4, 4), (3, 0)] {
                let s = kv.start_from(&t, from);
                assert_eq!(s.cached, cached, "generated from {from}, sliding {sliding:?}");
                kv.free(s);
            }
            assert_eq!(kv.start(&t).cached, 4);
        }
    }

    #[test]
    fn reserve_takes_nothing_when_blocks_run_out() {
        let mut kv = PagedKv::new(4, 3, None);
        let mut s = kv.start(&[1; 20]);
        assert_eq!(kv.reserve(&mut s, 16), Err(Exhausted));
        assert_eq!((s.full.len(), kv.full.available()), (0, 3));
        kv.reserve(&mut s, 12).unwrap();
        assert_eq!(kv.full.available(), 0);
    }

    #[test]
    fn sliding_layers_keep_only_the_window_and_find_it_again() {
        // Window 6, blocks of 4: a query at p attends p-5..=p.
        let mut kv = PagedKv::new(4, 16, Some((16, 6)));
        let t: Vec<u32> = (100..124).collect();
        let s = fill(&mut kv, &t, 3);
        let live: Vec<usize> = (0..s.sliding.len()).filter(|&i| s.sliding[i] != NO_BLOCK).collect();
        // The last step started at 21: it attends from 16 on (blocks 4 and 5).
        assert_eq!(live, vec![4, 5]);
        let (pool, _) = kv.sliding.as_ref().unwrap();
        assert_eq!((pool.used(), kv.full.used()), (2, 6));
        kv.free(s);
        // A 25-token prompt reuses all 6 blocks; its sliding layers need positions 18..23
        // (blocks 4 and 5), released to the cache when the first sequence ended.
        let mut p = t.clone();
        p.push(7);
        let s2 = kv.start(&p);
        assert_eq!(s2.cached, 24);
        assert_eq!(s2.sliding.iter().filter(|&&x| x != NO_BLOCK).count(), 2);
        kv.free(s2);
        // A pool of 3 sliding blocks: the window's blocks stay cached until evicted (oldest
        // first: 3, then 4); without block 4 no prefix has its sliding blocks.
        let mut kv = PagedKv::new(4, 16, Some((3, 6)));
        let s = fill(&mut kv, &t, 4);
        kv.free(s);
        let mut other = kv.start(&[5; 8]);
        kv.reserve(&mut other, 4).unwrap();
        let s3 = kv.start(&p);
        assert_eq!(s3.cached, 24, "block 3 evicted, 4 and 5 still cached");
        kv.free(s3);
        kv.reserve(&mut other, 8).unwrap();
        assert_eq!(kv.start(&p).cached, 0, "block 4 evicted too");
    }

    /// `--kv-start`: a sequence's first blocks come from the head pool (ids after the main
    /// pool's), the rest from the main pool; prefixes are shared in both; a head pool
    /// that runs out stops a reserve as the main one does.
    #[test]
    fn leading_blocks_come_from_the_head_pool() {
        let mut kv = PagedKv::new(4, 8, None).with_head(3, 2);
        let a: Vec<u32> = (0..14).collect();
        let sa = fill(&mut kv, &a, 5);
        assert_eq!(&sa.full[..2], &[8, 9], "head ids follow the main pool's 8");
        assert!(sa.full[2..].iter().all(|&b| b < 8), "{:?}", sa.full);
        assert_eq!((kv.full.used(), kv.usage()), (2, (4, 11)));
        let sb = kv.start(&a[..9]);
        assert_eq!((sb.cached, &sb.full[..]), (8, &sa.full[..2]));
        assert!(kv.can_take(2, 6) && !kv.can_take(2, 7) && kv.can_take(0, 1) && !kv.can_take(0, 3));
        assert!(kv.holds(10) && !kv.holds(11));
        let mut sc = kv.start(&[7; 9]);
        kv.reserve(&mut sc, 4).unwrap();
        assert_eq!(kv.reserve(&mut sc, 8), Err(Exhausted), "one head block left for two");
        kv.free(sa);
        kv.free(sb);
        kv.free(sc);
        assert_eq!(kv.usage().0, 0);
        assert_eq!(kv.start(&a).cached, 12, "both pools' blocks stay cached");
    }
}
