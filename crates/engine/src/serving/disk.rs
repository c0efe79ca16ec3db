//! The prefix cache on disk (`serve --prefix-cache-dir`). When a request's prefill is done,
//! its prompt's shareable blocks (all but the last token's) are saved as one KV file, named
//! by the chain hash of the last of them (and the model and scheme), unless one is there: the engine reads the rows,
//! a writer thread of its own writes the file, so steps never wait on the disk (files still
//! queued are written before the engine ends). An index maps the chain hash of every block
//! of every file (read from the headers at start, extended as files are queued) to its
//! file, so a prompt sharing any whole blocks with a file finds it. Before
//! a request is admitted, the blocks of its prompt that a file holds beyond what the memory
//! cache has are loaded into free blocks and published to the memory cache, so it starts
//! from them as from any cached prefix. A file that cannot be used (damaged, of another
//! model or scheme) is skipped with a warning and the prompt computed: nothing on disk fails
//! a request.

use super::caches::Caches;
use super::PrefixCacheDir;
use crate::backend::Backend;
use crate::kv::blocks::chain_hash;
use crate::kv::paged::SeqKv;
use crate::kv::{file, persist, BLOCK};
use crate::model::Decoder;
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::PathBuf;

/// The chain hash after each whole block of `tokens`.
fn block_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0;
    tokens
        .chunks_exact(BLOCK)
        .map(|c| {
            h = chain_hash(h, c);
            h
        })
        .collect()
}

/// Positions of `prompt` a request may take from a cache: whole blocks, its last token left.
fn shareable(prompt: &[u32]) -> usize {
    prompt.len().saturating_sub(1) / BLOCK * BLOCK
}

pub(super) struct DiskPrefixes {
    cfg: PrefixCacheDir,
    /// Chain hash of a block → the file (by its name's hash) whose tokens run through it.
    index: HashMap<u64, u64>,
    /// The model's fingerprint and KV scheme, as the files' names carry them.
    tag: String,
    /// Files to write, to the writer thread: the engine's steps do not wait on the disk.
    writes: Option<std::sync::mpsc::Sender<(PathBuf, file::KvFileHeader, Vec<u8>)>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for DiskPrefixes {
    /// The files queued are written before the engine ends.
    fn drop(&mut self) {
        self.writes.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl DiskPrefixes {
    /// The directory (made if missing) and the index of the files in it of this model and
    /// KV scheme (`scheme`'s name): files are named by both too, so that engines of other
    /// models or schemes sharing the directory never write over each other's.
    pub(super) fn open(cfg: PrefixCacheDir, scheme: &str) -> Result<Self> {
        let err = |e: std::io::Error| Error::Invalid(format!("prefix cache directory {}: {e}", cfg.dir.display()));
        std::fs::create_dir_all(&cfg.dir).map_err(err)?;
        let (tx, rx) = std::sync::mpsc::channel::<(PathBuf, file::KvFileHeader, Vec<u8>)>();
        let writer = std::thread::Builder::new()
            .name("ferrolm-prefix-disk".into())
            .spawn(move || {
                for (path, header, payload) in rx {
                    if let Err(e) = file::write(&path, &header, &payload) {
                        tracing::warn!("prefix cache on disk: {e}");
                    }
                }
            })
            .map_err(err)?;
        let tag: String = format!("{}.{scheme}", cfg.fingerprint)
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' })
            .collect();
        let mut d =
            DiskPrefixes { index: HashMap::new(), cfg: cfg.clone(), tag, writes: Some(tx), writer: Some(writer) };
        let suffix = format!(".{}.kv", d.tag);
        for entry in std::fs::read_dir(&cfg.dir).map_err(err)? {
            let path = entry.map_err(err)?.path();
            let name = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(&suffix));
            let Some(hash) = name.and_then(|n| u64::from_str_radix(n, 16).ok()) else { continue };
            match file::read_header(&path) {
                Ok(h) if h.model == cfg.fingerprint && h.scheme == scheme => d.add(hash, &h.tokens),
                Ok(_) => {}
                Err(e) => tracing::warn!("prefix cache on disk: {e}; skipped"),
            }
        }
        Ok(d)
    }

    fn add(&mut self, file: u64, tokens: &[u32]) {
        for h in block_hashes(tokens) {
            self.index.entry(h).or_insert(file);
        }
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.cfg.dir.join(format!("{hash:016x}.{}.kv", self.tag))
    }

    /// After its prefill: save the prompt's shareable blocks through `place`'s tables,
    /// unless a file has them already (the rows are read here, the file is written by the
    /// writer thread; until it is there, a lookup finds no file and computes).
    pub(super) fn save<B: Backend>(
        &mut self,
        model: &Decoder<B>,
        caches: &Caches<B>,
        place: &SeqKv,
        prompt: &[u32],
    ) -> Result<()> {
        let len = shareable(prompt);
        let Some(&last) = block_hashes(&prompt[..len]).last() else { return Ok(()) };
        if self.index.contains_key(&last) {
            return Ok(());
        }
        let payload = persist::export_payload(model, &caches.store, (&place.full, &place.sliding), len)?;
        let header = persist::header(model, &caches.store, &self.cfg.fingerprint, &prompt[..len]);
        let writes = self.writes.as_ref().expect("set until drop");
        writes
            .send((self.path(last), header, payload))
            .map_err(|_| Error::Invalid("the writer thread ended".into()))?;
        self.add(last, &prompt[..len]);
        Ok(())
    }

    /// Before admitting `prompt`: load the longest run of its blocks a file holds beyond
    /// what the memory cache has, in calls of `step_rows` positions. The tokens loaded (0
    /// when nothing was, or the blocks to hold them are not free now).
    pub(super) fn load<B: Backend>(
        &self,
        model: &Decoder<B>,
        caches: &mut Caches<B>,
        prompt: &[u32],
        step_rows: usize,
    ) -> Result<usize> {
        let hashes = block_hashes(&prompt[..shareable(prompt)]);
        let have = caches.cached_prefix(prompt) / BLOCK;
        let Some(j) = (have + 1..=hashes.len()).rev().find(|&j| self.index.contains_key(&hashes[j - 1])) else {
            return Ok(0);
        };
        let path = self.path(self.index[&hashes[j - 1]]);
        let Some((header, payload)) = persist::read(model, &caches.store, &self.cfg.fingerprint, &path)? else {
            return Ok(0);
        };
        // A hash collision holds another prompt's blocks.
        if header.tokens.get(..j * BLOCK) != Some(&prompt[..j * BLOCK]) {
            return Ok(0);
        }
        fill(model, caches, (&header.tokens, &payload), j * BLOCK, step_rows)
    }
}

/// Put the first `upto` positions' rows of a file (its tokens and payload) into blocks of
/// the cache, published as a computed prefill publishes them.
fn fill<B: Backend>(
    model: &Decoder<B>,
    caches: &mut Caches<B>,
    (tokens, payload): (&[u32], &[u8]),
    upto: usize,
    step_rows: usize,
) -> Result<usize> {
    let len = tokens.len();
    let starts = persist::payload_starts(model, &caches.store, len, payload.len())?;
    // Sliding blocks the file has no rows for must not be published.
    let first_sliding = persist::first_sliding_block(&model.cfg, len);
    let mut place = caches.start(&tokens[..upto]);
    let from = place.len;
    let mut p = from;
    while p < upto {
        let m = step_rows.max(1).min(upto - p);
        if caches.reserve(&mut place, p + m).is_err() {
            caches.free(place);
            return Ok(0);
        }
        caches.release_sliding_before(&mut place, first_sliding);
        let tables = (&place.full[..], &place.sliding[..]);
        if let Err(e) = persist::import_range(model, &mut caches.store, tables, (len, &starts, payload), p..p + m) {
            caches.free(place);
            return Err(e);
        }
        caches.commit(&mut place, tokens, p + m);
        p += m;
    }
    caches.free(place);
    Ok(upto - from)
}
