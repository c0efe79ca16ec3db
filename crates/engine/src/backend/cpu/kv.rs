//! The CPU's KV store: per layer `[blocks·BLOCK, n_kv·hd]` bf16 for K and for V, the full
//! layers' over the full blocks and the sliding layers' over theirs (`kv` module); or, in
//! a quantized scheme, per layer `[blocks·BLOCK, n_kv]` rows of kv::rows's layout, and
//! with `--kv-start` the full layers' head blocks (store rows from `head_row0` on) in bf16,
//! their values already in the scheme's accumulation domain (TurboQuant: rotated), so
//! attention sums them with the quantized rows' and undoes the rotation once.

use crate::config::ModelConfig;
use crate::kv::rows::{KvRow, RowCodec};
use crate::kv::scheme::KvScheme;
use crate::kv::turboquant::Precision;
use crate::kv::{is_sliding, row_of, KvBlocks, Span, BLOCK};
use half::bf16;

/// A quantized store's layers: each one's codec and its rows (position-major, then KV
/// head), `codec.bytes()` each.
pub struct QuantLayers {
    pub codecs: Vec<RowCodec>,
    pub rows: Vec<Vec<u8>>,
    /// The first store row of the head blocks (blocks.full · BLOCK).
    pub head_row0: usize,
    /// Per layer `[head·BLOCK, width]` keys and values of the head blocks (empty for a
    /// sliding layer).
    pub head_k: Vec<Vec<bf16>>,
    pub head_v: Vec<Vec<bf16>>,
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
        let width = cfg.n_kv_heads * cfg.head_dim;
        let head = |s: &bool| bytemuck::zeroed_vec::<bf16>(if *s { 0 } else { blocks.head * BLOCK * width });
        Ok(CpuKv {
            blocks,
            width,
            head_dim: cfg.head_dim,
            k: vec![],
            v: vec![],
            quant: Some(QuantLayers {
                codecs,
                rows,
                head_row0: blocks.full * BLOCK,
                head_k: sliding.iter().map(head).collect(),
                head_v: sliding.iter().map(head).collect(),
            }),
            sliding,
        })
    }

    /// Whether store `row` of `layer` is a head block's (bf16 in a quantized store).
    fn is_head(&self, layer: usize, row: usize) -> bool {
        self.quant.as_ref().is_some_and(|q| !self.sliding[layer] && row >= q.head_row0)
    }

    /// KV head `kvh` at store row `row` of a quantized `layer`, as attention reads it.
    pub fn kv_row(&self, layer: usize, row: usize, kvh: usize) -> KvRow<'_> {
        match self.is_head(layer, row) {
            true => {
                let q = self.quant.as_ref().expect("a quantized store");
                let at = (row - q.head_row0) * self.width + kvh * self.head_dim;
                KvRow::Head(&q.head_k[layer][at..][..self.head_dim], &q.head_v[layer][at..][..self.head_dim])
            }
            false => KvRow::Quant(self.quant_row(layer, row, kvh)),
        }
    }

    /// The bytes of KV head `kvh` at store row `row` of a quantized `layer`.
    pub fn quant_row(&self, layer: usize, row: usize, kvh: usize) -> &[u8] {
        let q = self.quant.as_ref().expect("a quantized store");
        let (n, b) = (self.width / self.head_dim, q.codecs[layer].bytes());
        &q.rows[layer][(row * n + kvh) * b..][..b]
    }

    /// Bytes of one row of `layer` in `Backend::kv_export`'s form.
    pub fn row_bytes(&self, layer: usize) -> usize {
        match &self.quant {
            Some(q) => self.width / self.head_dim * q.codecs[layer].bytes(),
            None => 4 * self.width,
        }
    }

    /// Bytes of store row `row` of `layer` in `export`'s form: a head block's row is bf16.
    fn row_bytes_at(&self, layer: usize, row: usize) -> usize {
        match self.is_head(layer, row) {
            true => 4 * self.width,
            false => self.row_bytes(layer),
        }
    }

    /// Check a request for `rows` of `layer` (and `data`'s length, when importing).
    fn check_rows(&self, layer: usize, rows: &[usize], data: Option<usize>) -> crate::Result<()> {
        if layer >= self.sliding.len() {
            return Err(crate::Error::Invalid(format!("no KV layer {layer}")));
        }
        let w = self.width.max(1);
        let (stored, head) = match &self.quant {
            Some(q) => (q.rows[layer].len() / self.row_bytes(layer), (q.head_row0, q.head_k[layer].len() / w)),
            None => (self.k[layer].len() / w, (0, 0)),
        };
        if let Some(r) = rows.iter().find(|&&r| r >= stored && !(head.0..head.0 + head.1).contains(&r)) {
            return Err(crate::Error::Invalid(format!("KV row {r} past layer {layer}'s {stored} rows")));
        }
        let want: usize = rows.iter().map(|&r| self.row_bytes_at(layer, r)).sum();
        match data {
            Some(n) if n != want => {
                Err(crate::Error::Invalid(format!("{n} bytes for {} KV rows of {want} bytes", rows.len())))
            }
            _ => Ok(()),
        }
    }

    /// The bf16 key and value vectors of store row `r` of `layer` (a bf16 store's, or a
    /// quantized store's head block's).
    fn bf16_rows(&self, layer: usize, r: usize) -> (&[bf16], &[bf16]) {
        let w = self.width;
        match &self.quant {
            Some(q) => {
                let at = (r - q.head_row0) * w;
                (&q.head_k[layer][at..at + w], &q.head_v[layer][at..at + w])
            }
            None => (&self.k[layer][r * w..(r + 1) * w], &self.v[layer][r * w..(r + 1) * w]),
        }
    }

    /// Append `rows` of `layer` to `out` (a quantized row as stored; a bf16 row as its key
    /// then its value, little-endian).
    pub fn export(&self, layer: usize, rows: &[usize], out: &mut Vec<u8>) -> crate::Result<()> {
        self.check_rows(layer, rows, None)?;
        for &r in rows {
            match &self.quant {
                Some(q) if !self.is_head(layer, r) => {
                    let b = self.row_bytes(layer);
                    out.extend_from_slice(&q.rows[layer][r * b..(r + 1) * b]);
                }
                _ => {
                    let (k, v) = self.bf16_rows(layer, r);
                    k.iter().chain(v).for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
            }
        }
        Ok(())
    }

    /// Write `data` (as `export` gave it) into `rows` of `layer`.
    pub fn import(&mut self, layer: usize, rows: &[usize], data: &[u8]) -> crate::Result<()> {
        self.check_rows(layer, rows, Some(data.len()))?;
        let (w, mut at) = (self.width, 0);
        for &r in rows {
            let (n, head) = (self.row_bytes_at(layer, r), self.is_head(layer, r));
            let src = &data[at..at + n];
            at += n;
            let (kd, vd, r0) = match &mut self.quant {
                Some(q) if !head => {
                    q.rows[layer][r * n..(r + 1) * n].copy_from_slice(src);
                    continue;
                }
                Some(q) => (&mut q.head_k[layer], &mut q.head_v[layer], r - q.head_row0),
                None => (&mut self.k[layer], &mut self.v[layer], r),
            };
            let (k, v) = src.split_at(2 * w);
            for (dst, x) in [(kd, k), (vd, v)] {
                for (d, x) in dst[r0 * w..(r0 + 1) * w].iter_mut().zip(x.chunks_exact(2)) {
                    *d = bf16::from_le_bytes([x[0], x[1]]);
                }
            }
        }
        Ok(())
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
        let head: Vec<bool> = places.iter().map(|&at| self.is_head(layer, at)).collect();
        let q = self.quant.as_mut().expect("a quantized store");
        let (codec, rows) = (q.codecs[layer], &mut q.rows[layer]);
        let b = codec.bytes();
        let mut vals = vec![0f32; hd];
        for (r, &at) in places.iter().enumerate() {
            for h in 0..n {
                let src = r * w + h * hd..r * w + (h + 1) * hd;
                if !head[r] {
                    let dst = &mut rows[(at * n + h) * b..][..b];
                    codec.encode(&k[src.clone()], &v[src], Precision::F32, dst)?;
                    continue;
                }
                // A head block's row: bf16, the value in the accumulation domain.
                let o = (at - q.head_row0) * w + h * hd;
                for (d, x) in q.head_k[layer][o..o + hd].iter_mut().zip(&k[src.clone()]) {
                    *d = bf16::from_f32(*x);
                }
                vals.copy_from_slice(&v[src]);
                codec.to_accumulation(&mut vals)?;
                for (d, x) in q.head_v[layer][o..o + hd].iter_mut().zip(&vals) {
                    *d = bf16::from_f32(*x);
                }
            }
        }
        Ok(())
    }
}
