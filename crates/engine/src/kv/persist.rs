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
fn layout<B: Backend>(model: &Decoder<B>, store: &B::Kv) -> String {
    let c = &model.cfg;
    let rows: Vec<usize> = (0..c.n_layers).map(|l| model.backend.kv_row_bytes(store, l)).collect();
    let start = match model.kv_start() {
        0 => String::new(),
        n => format!(", the full layers' first {n} positions in bf16"),
    };
    format!(
        "{} layers of {} KV heads x {}, row bytes {rows:?}, sliding window {}, block {BLOCK}{start}",
        c.n_layers, c.n_kv_heads, c.head_dim, c.sliding_window
    )
}

/// Payload bytes of `layer`'s positions `from..to`: the rows in the store's form, those
/// before `--kv-start`'s positions in a full layer of a quantized cache in bf16 (key then
/// value).
fn span_bytes<B: Backend>(model: &Decoder<B>, store: &B::Kv, layer: usize, (from, to): (usize, usize)) -> usize {
    let head = match is_sliding(&model.cfg, layer) {
        true => 0,
        false => model.kv_start().clamp(from, to.max(from)) - from,
    };
    head * 4 * model.cfg.n_kv_heads * model.cfg.head_dim + (to - from - head) * model.backend.kv_row_bytes(store, layer)
}

/// The store rows of `positions` through `table` (a released block is an error).
pub fn table_rows(table: &[u32], positions: std::ops::Range<usize>) -> Result<Vec<usize>> {
    positions
        .map(|p| match table.get(p / BLOCK) {
            Some(&blk) if blk != super::paged::NO_BLOCK => Ok(blk as usize * BLOCK + p % BLOCK),
            _ => Err(Error::Invalid(format!("position {p} is not in the KV cache"))),
        })
        .collect()
}

/// A KV file's payload: the rows of positions ..len of every layer (a sliding layer's
/// from `first_position`) through a sequence's tables (full, sliding).
pub fn export_payload<B: Backend>(
    model: &Decoder<B>,
    store: &B::Kv,
    (full, sliding): (&[u32], &[u32]),
    len: usize,
) -> Result<Vec<u8>> {
    let mut payload = Vec::new();
    for l in 0..model.cfg.n_layers {
        let table = if is_sliding(&model.cfg, l) { sliding } else { full };
        let rows = table_rows(table, first_position(&model.cfg, l, len)..len)?;
        model.backend.kv_export(store, l, &rows, &mut payload)?;
    }
    Ok(payload)
}

/// Where a payload of `len` positions begins each layer's rows; an error when `payload`
/// is not that long.
pub fn payload_starts<B: Backend>(model: &Decoder<B>, store: &B::Kv, len: usize, payload: usize) -> Result<Vec<usize>> {
    let c = &model.cfg;
    let mut starts = Vec::with_capacity(c.n_layers + 1);
    starts.push(0);
    for l in 0..c.n_layers {
        starts.push(starts[l] + span_bytes(model, store, l, (first_position(c, l, len), len)));
    }
    match starts[c.n_layers] == payload {
        true => Ok(starts),
        false => Err(Error::Invalid(format!("{payload} payload bytes for {len} tokens of this layout"))),
    }
}

/// Write the payload's rows of positions `range` (those it holds) through the tables.
pub fn import_range<B: Backend>(
    model: &Decoder<B>,
    store: &mut B::Kv,
    (full, sliding): (&[u32], &[u32]),
    (len, starts, payload): (usize, &[usize], &[u8]),
    range: std::ops::Range<usize>,
) -> Result<()> {
    let (c, b) = (&model.cfg, &model.backend);
    for (l, &start) in starts.iter().take(c.n_layers).enumerate() {
        let first = first_position(c, l, len);
        let from = first.max(range.start);
        if from >= range.end {
            continue;
        }
        let table = if is_sliding(c, l) { sliding } else { full };
        let rows = table_rows(table, from..range.end)?;
        let at = start + span_bytes(model, store, l, (first, from));
        let n = span_bytes(model, store, l, (from, range.end));
        b.kv_import(store, l, &rows, &payload[at..at + n])?;
    }
    Ok(())
}

/// The first block of the sliding layers a file of `len` positions holds.
pub fn first_sliding_block(cfg: &ModelConfig, len: usize) -> usize {
    len.saturating_sub(cfg.sliding_window) / BLOCK
}

/// The header of a file of `tokens` from `model`'s caches (`store`'s layout).
pub fn header<B: Backend>(model: &Decoder<B>, store: &B::Kv, fingerprint: &str, tokens: &[u32]) -> KvFileHeader {
    let scheme = model.kv_scheme();
    let (kv_start, layout) = (model.kv_start(), layout(model, store));
    KvFileHeader::new(fingerprint, &scheme.to_string(), groups(scheme), kv_start, tokens.to_vec(), &layout)
}

/// What a file read for `model`'s caches (`store`'s layout) must be.
pub fn read<B: Backend>(
    model: &Decoder<B>,
    store: &B::Kv,
    fingerprint: &str,
    path: &Path,
) -> Result<Option<(KvFileHeader, Vec<u8>)>> {
    let (scheme, layout) = (model.kv_scheme().to_string(), layout(model, store));
    file::read(path, &Expect { model: fingerprint, scheme: &scheme, layout: &layout })
}

/// Save the cache of `tokens`, its first positions, to `path`, atomically (positions
/// past them, written by decode steps queued ahead of the host, are not saved).
/// `fingerprint`: kv::file::model_fingerprint of the model.
pub fn save<B: Backend>(
    model: &Decoder<B>,
    cache: &SeqCache<B>,
    tokens: &[u32],
    fingerprint: &str,
    path: &Path,
) -> Result<()> {
    let len = tokens.len();
    if len > cache.len() {
        return Err(Error::Invalid(format!("saving {len} tokens from a cache of {} positions", cache.len())));
    }
    let (full, sliding) = cache.tables();
    let payload = export_payload(model, &cache.store, (&full, &sliding), len)?;
    file::write(path, &header(model, &cache.store, fingerprint, tokens), &payload)
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
    let Some((header, payload)) = read(model, &cache.store, fingerprint, path)? else { return Ok(None) };
    let len = header.tokens.len();
    let bad = |why: String| Error::Invalid(format!("KV file {}: {why}; not loaded", path.display()));
    if len > cache.capacity() {
        return Err(bad(format!("it holds {len} tokens, more than the context of {}", cache.capacity())));
    }
    let starts = payload_starts(model, &cache.store, len, payload.len()).map_err(|e| bad(e.to_string()))?;
    cache.clear();
    // Through the cache's own steps (a sliding layer's blocks taken and released as calls
    // of CALL_ROWS would), so that its tables end as a computed prefill leaves them.
    for p in (0..len).step_by(CALL_ROWS) {
        let m = CALL_ROWS.min(len - p);
        cache.prepare(p, m)?;
        let (full, sliding) = cache.tables();
        import_range(model, &mut cache.store, (&full, &sliding), (len, &starts, &payload), p..p + m)?;
        cache.advance(p + m);
    }
    // Positions the file does not hold are gone, not garbage a rewind could read.
    cache.release_sliding_before(first_sliding_block(&model.cfg, len));
    Ok(Some(header.tokens))
}
