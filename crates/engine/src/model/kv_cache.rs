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
        let one = KvBlocks { full: 1, sliding: usize::from(crate::kv::has_sliding(&self.cfg)) };
        self.backend.kv_store_scheme(&self.cfg, one, &scheme)?;
        self.kv_scheme = scheme;
        // Pooled sessions hold caches of the scheme before.
        self.session_pool.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(())
    }

    /// A cache of one sequence of up to `max_seq` positions in the model's scheme, for
    /// `forward`.
    pub fn new_cache(&self, max_seq: usize) -> Result<SeqCache<B>> {
        SeqCache::with_scheme(&self.backend, &self.cfg, max_seq, &self.kv_scheme)
    }
}
