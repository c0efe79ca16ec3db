//! KV caches. Keys and values live in blocks of `BLOCK` positions, in one store per model
//! shared by every sequence (`Backend::Kv`); each sequence has a block table per kind of
//! layer (`paged::SeqKv`), and a forward call says where each of its rows goes (`Span`).
//! Blocks are preallocated and updated in place, so decode steps have fixed shapes.

pub mod blocks;
pub mod file;
pub mod paged;
pub mod persist;
pub mod rows;
pub mod scheme;
pub mod seq;
pub mod turboquant;
mod turboquant_tables;

use crate::config::{AttnKind, ModelConfig};

/// Positions per block. A multiple of 32 (the quantized key formats group 32 positions).
pub const BLOCK: usize = 32;

/// Most rows one forward call writes into a sequence's cache that holds only a sliding
/// window (`SeqCache` sizes the sliding layers' blocks for window + CALL_ROWS positions;
/// the model splits longer calls). The CUDA backend's prefill chunk.
pub const CALL_ROWS: usize = 512;

/// Blocks of a store, per kind of layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvBlocks {
    /// For the full-attention layers.
    pub full: usize,
    /// For the sliding-window layers (0 when the model has none).
    pub sliding: usize,
    /// bf16 blocks for the full-attention layers' leading positions (`--kv-start`) in a
    /// quantized store; block ids `full..full + head` (0: none).
    pub head: usize,
}

/// One sequence's rows in a forward call: `rows` tokens at positions pos0.., whose keys
/// and values go, and are read, through its tables: position p of a layer lives in row
/// `table[p / BLOCK]·BLOCK + p % BLOCK` of that layer's store, `full` for full-attention
/// layers and `sliding` for sliding-window ones.
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    pub rows: usize,
    pub pos0: usize,
    pub full: &'a [u32],
    pub sliding: &'a [u32],
}

impl Span<'_> {
    /// The table of a layer (sliding or not).
    pub fn table(&self, sliding: bool) -> &[u32] {
        if sliding {
            self.sliding
        } else {
            self.full
        }
    }
}

/// Store row of position p through `table`.
#[inline]
pub fn row_of(table: &[u32], p: usize) -> usize {
    table[p / BLOCK] as usize * BLOCK + p % BLOCK
}

/// The sequence index and position of each row of a call over `spans`.
pub fn row_positions(spans: &[Span<'_>]) -> Vec<(usize, usize)> {
    spans.iter().enumerate().flat_map(|(i, s)| (s.pos0..s.pos0 + s.rows).map(move |p| (i, p))).collect()
}

/// The row of a call over `spans` that holds each span's last token.
pub fn span_ends(spans: &[Span<'_>]) -> Vec<usize> {
    spans
        .iter()
        .scan(0, |end, s| {
            *end += s.rows;
            Some(*end - 1)
        })
        .collect()
}

/// Whether layer i of the model attends a sliding window.
pub fn is_sliding(cfg: &ModelConfig, i: usize) -> bool {
    cfg.layer_kind(i) == AttnKind::Sliding
}

/// How many of the model's layers attend a sliding window.
pub fn sliding_layers(cfg: &ModelConfig) -> usize {
    (0..cfg.n_layers).filter(|&i| is_sliding(cfg, i)).count()
}

/// Whether the model has sliding-window layers.
pub fn has_sliding(cfg: &ModelConfig) -> bool {
    sliding_layers(cfg) > 0
}

/// Bytes one block takes over the full-attention layers and over the sliding-window ones,
/// in `scheme`'s rows.
pub fn block_bytes(cfg: &ModelConfig, scheme: &scheme::KvScheme) -> (usize, usize) {
    let (mut full, mut sliding) = (0, 0);
    for l in 0..cfg.n_layers {
        let b = BLOCK * scheme.layer_position_bytes(cfg, l);
        *if is_sliding(cfg, l) { &mut sliding } else { &mut full } += b;
    }
    (full, sliding)
}

/// Leading blocks of a sequence kept in bf16 for `kv_start` positions (`--kv-start`, whole
/// blocks) under `scheme`: none in bf16, where every block is.
pub fn head_blocks(scheme: &scheme::KvScheme, kv_start: usize) -> usize {
    match scheme {
        scheme::KvScheme::Bf16 => 0,
        _ => kv_start.div_ceil(BLOCK),
    }
}

/// Store bytes of `blocks` in `scheme`'s rows (its head blocks in bf16).
pub fn store_bytes(cfg: &ModelConfig, scheme: &scheme::KvScheme, blocks: KvBlocks) -> usize {
    let (full, sliding) = block_bytes(cfg, scheme);
    full * blocks.full + sliding * blocks.sliding + block_bytes(cfg, &scheme::KvScheme::Bf16).0 * blocks.head
}

/// Blocks for every position up to `max_seq` in every layer (nothing released): for
/// backend-level tests and probes that drive one sequence through `InOrder` tables.
pub fn blocks_for(cfg: &ModelConfig, max_seq: usize) -> KvBlocks {
    let full = max_seq.div_ceil(BLOCK);
    KvBlocks { full, sliding: if has_sliding(cfg) { full } else { 0 }, head: 0 }
}

/// One sequence's tables over a whole store, block i holding positions i·BLOCK.. (what
/// `seq::SeqCache` builds while nothing is released): with head blocks (`--kv-start`) the
/// full layers' first ones (ids `full..`), then the main blocks.
pub struct InOrder {
    full: Vec<u32>,
    sliding: Vec<u32>,
}

impl InOrder {
    pub fn new(blocks: KvBlocks) -> InOrder {
        let table = |n: usize| (0..n as u32).collect();
        let full = (blocks.full..blocks.full + blocks.head).chain(0..blocks.full).map(|b| b as u32).collect();
        InOrder { full, sliding: table(blocks.sliding) }
    }

    /// `rows` rows at positions pos0...
    pub fn span(&self, pos0: usize, rows: usize) -> Span<'_> {
        Span { rows, pos0, full: &self.full, sliding: &self.sliding }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_through_the_table() {
        let t = [5, 2];
        assert_eq!(row_of(&t, 0), 5 * BLOCK);
        assert_eq!(row_of(&t, BLOCK + 3), 2 * BLOCK + 3);
        let s = [Span { rows: 2, pos0: 7, full: &t, sliding: &[] }, Span { rows: 1, pos0: 0, full: &t, sliding: &[] }];
        assert_eq!(row_positions(&s), vec![(0, 7), (0, 8), (1, 0)]);
        assert_eq!(span_ends(&s), vec![1, 2]);
    }

    /// The CPU's gather of each span's last row (what the serving calls' head reads): the
    /// rows past the spans get row 0; shapes that do not fit are refused.
    #[test]
    fn last_rows_are_gathered_and_bad_shapes_refused() {
        use crate::backend::cpu::{Cpu, CpuAct};
        use crate::backend::Backend;
        let t = [0u32];
        let spans =
            [Span { rows: 2, pos0: 0, full: &t, sliding: &[] }, Span { rows: 3, pos0: 0, full: &t, sliding: &[] }];
        let x = CpuAct { rows: 5, cols: 2, data: (0..10).map(|v| v as f32).collect() };
        let mut out = CpuAct { rows: 4, cols: 2, data: vec![f32::NAN; 8] };
        Cpu.gather_last_rows(&x, &spans, &mut out).unwrap();
        assert_eq!(out.data, [2.0, 3.0, 8.0, 9.0, 0.0, 1.0, 0.0, 1.0]);
        let mut narrow = CpuAct { rows: 1, cols: 2, data: vec![0.0; 2] };
        assert!(Cpu.gather_last_rows(&x, &spans, &mut narrow).is_err(), "fewer rows than spans");
        let short = CpuAct { rows: 4, cols: 2, data: vec![0.0; 8] };
        assert!(Cpu.gather_last_rows(&short, &spans, &mut out).is_err(), "a span past x's rows");
        let mut ids = CpuAct { rows: 5, cols: 1, data: vec![f32::NAN; 5] };
        let y = CpuAct {
            rows: 5,
            cols: 3,
            data: vec![1.0, 3.0, 3.0, 0.0, -1.0, -2.0, 5.0, 5.0, 5.0, f32::NAN, 1.0, 0.5, -1.0, -1.0, 2.0],
        };
        Cpu.argmax_rows(&y, &mut ids).unwrap();
        assert_eq!(ids.data, [1.0, 0.0, 0.0, 0.0, 2.0]);
        assert!(Cpu.argmax_rows(&y, &mut CpuAct { rows: 4, cols: 1, data: vec![0.0; 4] }).is_err());
    }
}
