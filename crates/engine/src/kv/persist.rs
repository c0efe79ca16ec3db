//! One sequence's cache to a KV file and back (`--prompt-cache`): the rows of every position
//! the sequence holds, layer by layer, in `Backend::kv_export`'s form (the same bytes on
//! every backend), under kv::file's header and checksum.

use super::file::{self, Expect, KvFileHeader};
use super::scheme::{KvScheme, AFFINE_GROUP};
use super::seq::SeqCache;
use super::{is_sliding, BLOCK, CALL_ROWS};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::model::Decoder;
use crate::{Error, Result};
use std::path::Path;

/// The first position of `layer` a file holds for `len` positions: 0, or for a sliding
/// layer the start of the block holding the first position a call at `len` reads.
fn first_position(cfg: &ModelConfig, layer: usize, len: usize) -> usize {
    match is_sliding(cfg, layer) {
        true => len.saturating_sub(cfg.sliding_window) / BLOCK * BLOCK,
        false => 0,
    }
}

/// The (key, value) group sizes the header records.
fn groups(scheme: &KvScheme) -> (usize, usize) {
    match scheme {
        KvScheme::Bf16 => (0, 0),
        KvScheme::Affine(_) => (AFFINE_GROUP, AFFINE_GROUP),
        KvScheme::Turbo { .. } => (super::turboquant::GROUP, super::turboquant::GROUP),
    }
}

/// What the payload's rows are; a file of another layout is refused.
fn layout<B: Backend>(model: &Decoder<B>, cache: &SeqCache<B>) -> String {
    let c = &model.cfg;
    let rows: Vec<usize> = (0..c.n_layers).map(|l| model.backend.kv_row_bytes(&cache.store, l)).collect();
    format!(
        "{} layers of {} KV heads x {}, row bytes {rows:?}, sliding window {}, block {BLOCK}",
        c.n_layers, c.n_kv_heads, c.head_dim, c.sliding_window
    )
}

/// Save the `tokens` `cache` holds (all of its positions) to `path`, atomically.
/// `fingerprint`: kv::file::model_fingerprint of the model.
pub fn save<B: Backend>(
    model: &Decoder<B>,
    cache: &SeqCache<B>,
    tokens: &[u32],
    fingerprint: &str,
    path: &Path,
) -> Result<()> {
    let len = cache.len();
    if tokens.len() != len {
        return Err(Error::Invalid(format!("saving a cache of {len} positions with {} tokens", tokens.len())));
    }
    let mut payload = Vec::new();
    for l in 0..model.cfg.n_layers {
        let rows = cache.store_rows(is_sliding(&model.cfg, l), first_position(&model.cfg, l, len)..len)?;
        model.backend.kv_export(&cache.store, l, &rows, &mut payload)?;
    }
    let scheme = model.kv_scheme();
    let header =
        KvFileHeader::new(fingerprint, &scheme.to_string(), groups(scheme), 0, tokens.to_vec(), &layout(model, cache));
    file::write(path, &header, &payload)
}

/// Restore the cache saved at `path` into `cache` (which it empties first) and return its
/// tokens; None when there is no file. A file of another model, scheme or layout, a
/// damaged one, or one longer than the cache is refused by name and nothing is loaded.
pub fn restore<B: Backend>(
    model: &Decoder<B>,
    cache: &mut SeqCache<B>,
    fingerprint: &str,
    path: &Path,
) -> Result<Option<Vec<u32>>> {
    let (c, b) = (&model.cfg, &model.backend);
    let (scheme, layout) = (model.kv_scheme().to_string(), layout(model, cache));
    let Some((header, payload)) = file::read(path, &Expect { model: fingerprint, scheme: &scheme, layout: &layout })?
    else {
        return Ok(None);
    };
    let len = header.tokens.len();
    let bad = |why: String| Error::Invalid(format!("KV file {}: {why}; not loaded", path.display()));
    if len > cache.capacity() {
        return Err(bad(format!("it holds {len} tokens, more than the context of {}", cache.capacity())));
    }
    // Where each layer's rows start in the payload, and the payload's whole length.
    let mut starts = Vec::with_capacity(c.n_layers + 1);
    starts.push(0);
    for l in 0..c.n_layers {
        let rows = len - first_position(c, l, len);
        starts.push(starts[l] + rows * b.kv_row_bytes(&cache.store, l));
    }
    if starts[c.n_layers] != payload.len() {
        return Err(bad(format!("{} payload bytes for {len} tokens of this layout", payload.len())));
    }
    cache.clear();
    // Through the cache's own steps (a sliding layer's blocks taken and released as calls
    // of CALL_ROWS would), so that its tables end as a computed prefill leaves them.
    for p in (0..len).step_by(CALL_ROWS) {
        let m = CALL_ROWS.min(len - p);
        cache.prepare(p, m)?;
        for l in 0..c.n_layers {
            let first = first_position(c, l, len);
            if first >= p + m {
                continue;
            }
            let from = first.max(p);
            let rows = cache.store_rows(is_sliding(c, l), from..p + m)?;
            let rb = b.kv_row_bytes(&cache.store, l);
            let at = starts[l] + (from - first) * rb;
            b.kv_import(&mut cache.store, l, &rows, &payload[at..at + rows.len() * rb])?;
        }
        cache.advance(p + m);
    }
    // Positions the file does not hold are gone, not garbage a rewind could read.
    cache.release_sliding_before(len.saturating_sub(c.sliding_window) / BLOCK);
    Ok(Some(header.tokens))
}
