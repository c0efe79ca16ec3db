//! The CPU's KV store: per layer `[blocks·BLOCK, n_kv·hd]` bf16 for K and for V, the full
//! layers' over the full blocks and the sliding layers' over theirs (`kv` module).

use crate::config::ModelConfig;
use crate::kv::{is_sliding, row_of, KvBlocks, Span, BLOCK};
use half::bf16;

pub struct CpuKv {
    pub blocks: KvBlocks,
    /// n_kv_heads · head_dim
    pub width: usize,
    pub head_dim: usize,
    /// Whether each layer is a sliding-window one (its rows over the sliding blocks).
    pub sliding: Vec<bool>,
    pub k: Vec<Vec<bf16>>,
    pub v: Vec<Vec<bf16>>,
}

impl CpuKv {
    pub fn new(cfg: &ModelConfig, blocks: KvBlocks) -> CpuKv {
        let width = cfg.n_kv_heads * cfg.head_dim;
        let sliding: Vec<bool> = (0..cfg.n_layers).map(|i| is_sliding(cfg, i)).collect();
        // Zeroed pages from the allocator, mapped as they are first written (a large budget
        // costs no time at start); rows past a sequence's written positions are never read.
        let layer =
            |s: &bool| bytemuck::zeroed_vec::<bf16>(if *s { blocks.sliding } else { blocks.full } * BLOCK * width);
        CpuKv {
            blocks,
            width,
            head_dim: cfg.head_dim,
            k: sliding.iter().map(layer).collect(),
            v: sliding.iter().map(layer).collect(),
            sliding,
        }
    }

    /// Store row of position p of the sequence `span` in `layer`.
    pub fn row(&self, layer: usize, span: &Span<'_>, p: usize) -> usize {
        row_of(span.table(self.sliding[layer]), p)
    }

    /// Store each span's rows `[m, width]` of k and v (consecutive, as the spans) at its
    /// positions of `layer`.
    pub fn write(&mut self, layer: usize, spans: &[Span<'_>], k: &[f32], v: &[f32]) {
        let w = self.width;
        let mut r = 0;
        for s in spans {
            for p in s.pos0..s.pos0 + s.rows {
                let at = self.row(layer, s, p) * w;
                let src = r * w..(r + 1) * w;
                for (d, x) in self.k[layer][at..at + w].iter_mut().zip(&k[src.clone()]) {
                    *d = bf16::from_f32(*x);
                }
                for (d, x) in self.v[layer][at..at + w].iter_mut().zip(&v[src]) {
                    *d = bf16::from_f32(*x);
                }
                r += 1;
            }
        }
    }
}
