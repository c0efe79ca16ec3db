//! KV caches.
