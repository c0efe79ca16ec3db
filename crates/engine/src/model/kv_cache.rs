//! The model's KV cache scheme: what every cache it makes for a session or the serving
//! engine stores (`--kv`), checked once, when it is set.

use super::decoder::Decoder;
use crate::backend::Backend;
use crate::kv::scheme::KvScheme;
use crate::kv::seq::SeqCache;
use crate::kv::KvBlocks;
use crate::Result;

impl<B: Backend> Decoder<B> {
    /// The scheme the model's caches store (bf16 unless `set_kv_scheme` changed it).
    pub fn kv_scheme(&self) -> &KvScheme {
        &self.kv_scheme
    }

    /// Store keys and values in `scheme` from now on. A scheme the model's shape cannot
    /// take, or the backend has no kernels for, is refused here by name, before any
    /// request runs (never a slow fallback later).
    pub fn set_kv_scheme(&mut self, scheme: KvScheme) -> Result<()> {
        scheme.check(&self.cfg)?;
        let one = KvBlocks { full: 1, sliding: usize::from(crate::kv::has_sliding(&self.cfg)), head: 0 };
        self.backend.kv_store_scheme(&self.cfg, one, &scheme)?;
        self.kv_scheme = scheme;
        // Pooled sessions hold caches of the scheme before.
        self.session_pool.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(())
    }

    /// Keep the first `positions` positions of every sequence in bf16 in the model's
    /// quantized caches (`--kv-start`; whole blocks of `kv::BLOCK`, so rounded up; nothing
    /// changes in bf16, where every position is).
    /// Refused when the backend cannot keep them for the model's scheme.
    pub fn set_kv_start(&mut self, positions: usize) -> Result<()> {
        let lead = crate::kv::head_blocks(&self.kv_scheme, positions);
        if lead > 0 {
            let sliding = usize::from(crate::kv::has_sliding(&self.cfg));
            self.backend.kv_store_scheme(&self.cfg, KvBlocks { full: 1, sliding, head: 1 }, &self.kv_scheme)?;
        }
        self.kv_start = positions.div_ceil(crate::kv::BLOCK) * crate::kv::BLOCK;
        self.session_pool.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(())
    }

    /// Leading positions the model's caches keep in bf16 apart from the rest (a multiple
    /// of `kv::BLOCK`; 0 in bf16).
    pub fn kv_start(&self) -> usize {
        crate::kv::head_blocks(&self.kv_scheme, self.kv_start) * crate::kv::BLOCK
    }

    /// A cache of one sequence of up to `max_seq` positions in the model's scheme, for
    /// `forward`.
    pub fn new_cache(&self, max_seq: usize) -> Result<SeqCache<B>> {
        SeqCache::with_layout(&self.backend, &self.cfg, max_seq, &self.kv_scheme, self.kv_start)
    }
}
