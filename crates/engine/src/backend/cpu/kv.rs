//! The CPU's KV store: per layer `[blocks·BLOCK, n_kv·hd]` bf16 for K and for V, the full
//! layers' over the full blocks and the sliding layers' over theirs (`kv` module); or, in
//! a quantized scheme, per layer `[blocks·BLOCK, n_kv]` rows of kv::rows's layout.

use crate::config::ModelConfig;
use crate::kv::rows::RowCodec;
use crate::kv::scheme::KvScheme;
use crate::kv::turboquant::Precision;
use crate::kv::{is_sliding, row_of, KvBlocks, Span, BLOCK};
use half::bf16;

/// A quantized store's layers: each one's codec and its rows (position-major, then KV
/// head), `codec.bytes()` each.
pub struct QuantLayers {
    pub codecs: Vec<RowCodec>,
    pub rows: Vec<Vec<u8>>,
}

pub struct CpuKv {
    pub blocks: KvBlocks,
    /// n_kv_heads · head_dim
    pub width: usize,
    pub head_dim: usize,
    /// Whether each layer is a sliding-window one (its rows over the sliding blocks).
    pub sliding: Vec<bool>,
    pub k: Vec<Vec<bf16>>,
    pub v: Vec<Vec<bf16>>,
    /// Set in a quantized scheme (k and v are then empty).
    pub quant: Option<QuantLayers>,
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
            quant: None,
        }
    }

    /// A store of `blocks` holding `scheme`'s rows (bf16: `new`).
    pub fn with_scheme(cfg: &ModelConfig, blocks: KvBlocks, scheme: &KvScheme) -> crate::Result<CpuKv> {
        scheme.check(cfg)?;
        let codecs = (0..cfg.n_layers)
            .map(|l| RowCodec::new(scheme, l, cfg.head_dim))
            .collect::<crate::Result<Option<Vec<RowCodec>>>>()?;
        let Some(codecs) = codecs else { return Ok(CpuKv::new(cfg, blocks)) };
        let sliding: Vec<bool> = (0..cfg.n_layers).map(|i| is_sliding(cfg, i)).collect();
        let rows = codecs
            .iter()
            .zip(&sliding)
            .map(|(c, s)| {
                bytemuck::zeroed_vec::<u8>(
                    if *s { blocks.sliding } else { blocks.full } * BLOCK * cfg.n_kv_heads * c.bytes(),
                )
            })
            .collect();
        Ok(CpuKv {
            blocks,
            width: cfg.n_kv_heads * cfg.head_dim,
            head_dim: cfg.head_dim,
            sliding,
            k: vec![],
            v: vec![],
            quant: Some(QuantLayers { codecs, rows }),
        })
    }

    /// The bytes of KV head `kvh` at store row `row` of a quantized `layer`.
    pub fn quant_row(&self, layer: usize, row: usize, kvh: usize) -> &[u8] {
        let q = self.quant.as_ref().expect("a quantized store");
        let (n, b) = (self.width / self.head_dim, q.codecs[layer].bytes());
        &q.rows[layer][(row * n + kvh) * b..][..b]
    }

    /// Store row of position p of the sequence `span` in `layer`.
    pub fn row(&self, layer: usize, span: &Span<'_>, p: usize) -> usize {
        row_of(span.table(self.sliding[layer]), p)
    }

    /// Store each span's rows `[m, width]` of k and v (consecutive, as the spans) at its
    /// positions of `layer`.
    pub fn write(&mut self, layer: usize, spans: &[Span<'_>], k: &[f32], v: &[f32]) -> crate::Result<()> {
        if self.quant.is_some() {
            return self.write_quantized(layer, spans, k, v);
        }
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
        Ok(())
    }

    /// `write` into a quantized store: each KV head's key and value encoded into its row
    /// (from the CPU's f32 activations).
    fn write_quantized(&mut self, layer: usize, spans: &[Span<'_>], k: &[f32], v: &[f32]) -> crate::Result<()> {
        let (w, hd) = (self.width, self.head_dim);
        let n = w / hd;
        let places: Vec<usize> = spans
            .iter()
            .flat_map(|s| (s.pos0..s.pos0 + s.rows).map(move |p| (s, p)))
            .map(|(s, p)| self.row(layer, s, p))
            .collect();
        let q = self.quant.as_mut().expect("a quantized store");
        let (codec, rows) = (q.codecs[layer], &mut q.rows[layer]);
        let b = codec.bytes();
        for (r, &at) in places.iter().enumerate() {
            for h in 0..n {
                let src = r * w + h * hd..r * w + (h + 1) * hd;
                let dst = &mut rows[(at * n + h) * b..][..b];
                codec.encode(&k[src.clone()], &v[src], Precision::F32, dst)?;
            }
        }
        Ok(())
    }
}
