//! Block bookkeeping of a paged KV cache: a pool of fixed-size blocks of positions with
//! reference counts (sequences share prefix blocks), a free list, and the prefix cache:
//! every full block is indexed by the hash of all tokens up to its end, and stays indexed
//! after its last user leaves, until its space is needed (least recently used first).
//!
//! A cached block is only ever read: a sequence reuses whole blocks of its prefix and
//! writes its own positions into blocks of its own, so no shared block is written and
//! none needs copying.

use std::collections::{BTreeMap, HashMap};

/// What identifies a full block's contents: the hash of the tokens before it and its own
/// tokens. The lookup compares the tokens too, so a hash collision cannot hand out another
/// prefix's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Content {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

/// The hash of a block of `tokens` after a prefix hashing to `parent` (0: the start).
/// FNV-1a over the parent and the ids: stable across runs and machines, so cached blocks
/// could later be persisted under it.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in parent.to_le_bytes().into_iter().chain(tokens.iter().flat_map(|t| t.to_le_bytes())) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

pub struct BlockPool {
    /// Users of each block (sequences holding it in their table).
    refs: Vec<u32>,
    /// Blocks with no user and no cached content.
    free: Vec<u32>,
    /// Each block's cached content, when it has some.
    content: Vec<Option<Content>>,
    by_hash: HashMap<u64, u32>,
    /// Cached blocks with no user, by the tick they were last released: evicted oldest
    /// first when the free list is empty.
    idle: BTreeMap<u64, u32>,
    idle_since: Vec<u64>,
    tick: u64,
}

impl BlockPool {
    pub fn new(blocks: usize) -> BlockPool {
        let n = u32::try_from(blocks).expect("block count fits u32");
        BlockPool {
            refs: vec![0; blocks],
            // Popped from the end: block 0 first.
            free: (0..n).rev().collect(),
            content: vec![None; blocks],
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_since: vec![0; blocks],
            tick: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.refs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }

    /// Blocks `alloc` can still hand out (free, or cached without a user).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks some sequence holds.
    pub fn used(&self) -> usize {
        self.len() - self.available()
    }

    /// Cached blocks (held or idle).
    pub fn cached(&self) -> usize {
        self.by_hash.len()
    }

    pub fn refs(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// A block for one user: a free one, else the least recently used idle cached one
    /// (its content forgotten). None when every block is held.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.idle.pop_first()?;
                self.forget(b);
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more user of a block (a cached prefix block found by `lookup`).
    pub fn retain(&mut self, block: u32) {
        let i = block as usize;
        if self.refs[i] == 0 {
            self.idle.remove(&self.idle_since[i]);
        }
        self.refs[i] += 1;
    }

    /// One user fewer: a block nobody holds stays cached (idle) if it has content, else it
    /// is free again.
    pub fn release(&mut self, block: u32) {
        let i = block as usize;
        assert!(self.refs[i] > 0, "releasing block {block}, which no one holds");
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            match self.content[i] {
                Some(_) => {
                    self.tick += 1;
                    self.idle_since[i] = self.tick;
                    self.idle.insert(self.tick, block);
                }
                None => self.free.push(block),
            }
        }
    }

    /// A held block is full and final: index it as the block of `tokens` after a prefix
    /// hashing to `parent`. Returns its hash. If another block already caches the same
    /// content, that one stays indexed (this one is then freed when released).
    pub fn publish(&mut self, block: u32, parent: u64, tokens: &[u32]) -> u64 {
        let hash = chain_hash(parent, tokens);
        if self.content[block as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, block);
            self.content[block as usize] = Some(Content { hash, parent, tokens: tokens.into() });
        }
        hash
    }

    /// The cached block of `tokens` after a prefix hashing to `parent`, if any.
    pub fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<(u32, u64)> {
        let hash = chain_hash(parent, tokens);
        let &b = self.by_hash.get(&hash)?;
        let c = self.content[b as usize].as_ref()?;
        (c.parent == parent && *c.tokens == *tokens).then_some((b, hash))
    }

    fn forget(&mut self, block: u32) {
        if let Some(c) = self.content[block as usize].take() {
            self.by_hash.remove(&c.hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_shared_cached_and_evicted_oldest_first() {
        let mut p = BlockPool::new(3);
        let (a, b, c) = (p.alloc().unwrap(), p.alloc().unwrap(), p.alloc().unwrap());
        assert_eq!((p.alloc(), p.available(), p.used()), (None, 0, 3));
        let ha = p.publish(a, 0, &[1, 2]);
        let hb = p.publish(b, ha, &[3, 4]);
        // A second user of a, then both release: a stays cached (idle), c (no content) frees.
        assert_eq!(p.lookup(0, &[1, 2]), Some((a, ha)));
        assert_eq!(p.lookup(ha, &[3, 4]), Some((b, hb)));
        assert_eq!(p.lookup(0, &[3, 4]), None, "another prefix");
        assert_eq!(p.lookup(ha, &[3, 5]), None, "other tokens");
        p.retain(a);
        p.release(a);
        assert_eq!(p.refs(a), 1);
        p.release(a);
        p.release(b);
        p.release(c);
        assert_eq!((p.available(), p.used(), p.cached()), (3, 0, 2));
        // Reuse of an idle block takes it out of the eviction order.
        p.retain(b);
        // Allocation takes the free block first, then evicts the oldest idle one (a).
        assert_eq!(p.alloc(), Some(c));
        assert_eq!(p.alloc(), Some(a));
        assert_eq!(p.lookup(0, &[1, 2]), None, "evicted");
        assert_eq!(p.lookup(ha, &[3, 4]), Some((b, hb)), "held blocks are never evicted");
        assert_eq!(p.alloc(), None);
    }

    #[test]
    fn duplicate_content_keeps_the_first_block_indexed() {
        let mut p = BlockPool::new(2);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        let h = p.publish(a, 0, &[7]);
        assert_eq!(p.publish(b, 0, &[7]), h);
        assert_eq!(p.lookup(0, &[7]), Some((a, h)));
        p.release(b);
        assert_eq!((p.available(), p.cached()), (1, 1), "the duplicate is simply free");
        assert_eq!(chain_hash(0, &[7]), h);
        assert_ne!(chain_hash(1, &[7]), h);
    }

    #[test]
    #[should_panic(expected = "no one holds")]
    fn releasing_an_unheld_block_is_a_bug() {
        BlockPool::new(1).release(0);
    }
}
