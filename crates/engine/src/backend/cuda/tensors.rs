//! The device forms of weights, activations and the KV cache, and their uploads.

use super::context::Context;
use super::driver::{drv, KArg};
use super::kernels;
use crate::config::ModelConfig;
use crate::kv::KvBlocks;
use crate::quant::{AffineTensor, DenseData, DenseTensor, Scales, Weight};
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr};
use half::bf16;

/// Scales or biases on the device, in their source precision.
pub enum DevScales {
    Half(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

pub enum CudaMat {
    Affine {
        rows: usize,
        cols: usize,
        words: CudaSlice<u32>,
        scales: DevScales,
        biases: DevScales,
        /// [qmv, qmv_f32, embed, qmv8, qmv8_f32]
        f: [CudaFunction; 5],
        bits: u32,
        group: usize,
        /// The -D defines this weight's kernels are compiled with (bits, group, scale dtype).
        defines: Vec<String>,
    },
    /// bf16 weights; f = [dmv, dmv_f32, dembed]
    Dense { rows: usize, cols: usize, w: CudaSlice<u16>, f: [CudaFunction; 3] },
}

impl CudaMat {
    pub fn rows(&self) -> usize {
        match self {
            CudaMat::Affine { rows, .. } | CudaMat::Dense { rows, .. } => *rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            CudaMat::Affine { cols, .. } | CudaMat::Dense { cols, .. } => *cols,
        }
    }
}

pub enum ActBuf {
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// Activations `[rows, cols]`: bf16 (f32 for logits).
pub struct CudaAct {
    pub rows: usize,
    pub cols: usize,
    pub buf: ActBuf,
}

impl CudaAct {
    pub(crate) fn bf16(&self) -> &CudaSlice<u16> {
        match &self.buf {
            ActBuf::Bf16(b) => b,
            ActBuf::F32(_) => panic!("CUDA op given f32 activations where bf16 are required"),
        }
    }
    pub(crate) fn bf16_mut(&mut self) -> &mut CudaSlice<u16> {
        match &mut self.buf {
            ActBuf::Bf16(b) => b,
            ActBuf::F32(_) => panic!("CUDA op given f32 activations where bf16 are required"),
        }
    }
    pub(crate) fn arg(&self, ctx: &Context) -> KArg {
        KArg::Ptr(match &self.buf {
            ActBuf::Bf16(v) => v.device_ptr(&ctx.stream).0,
            ActBuf::F32(v) => v.device_ptr(&ctx.stream).0,
        })
    }
    pub(crate) fn is_f32(&self) -> bool {
        matches!(self.buf, ActBuf::F32(_))
    }
}

/// The KV store: per layer `[blocks·BLOCK, n_kv·hd]` bf16 for K and for V, over the full
/// blocks or (a sliding-window layer) the sliding ones, or (a quantized scheme, `quant`)
/// kv::rows's rows instead; kernels find a position's row through the staged block table
/// of the layer's kind (kv_row in common.cuh).
pub struct CudaKv {
    /// Distinct per store made: engine calls' graphs bake in its buffers (steps.rs `call`).
    pub(crate) id: u64,
    pub blocks: crate::kv::KvBlocks,
    /// Whether each layer is a sliding-window one.
    pub sliding: Vec<bool>,
    pub width: usize,
    pub head_dim: usize,
    /// Empty when `quant` holds the rows.
    pub k: Vec<CudaSlice<u16>>,
    pub v: Vec<CudaSlice<u16>>,
    pub(crate) quant: Option<super::kv_quant::QuantKv>,
}

impl CudaKv {
    /// Most positions one sequence can hold (every full block): what fixes the attention
    /// kernels' split counts, so a captured step stays valid as its sequence grows.
    pub(crate) fn max_seq(&self) -> usize {
        (self.blocks.full + self.blocks.head) * crate::kv::BLOCK
    }

    /// `Backend::kv_row_bytes`.
    pub(crate) fn row_bytes(&self, layer: usize) -> usize {
        match &self.quant {
            Some(q) if layer < q.codecs.len() => q.row_bytes(layer, self.width / self.head_dim),
            _ => 4 * self.width,
        }
    }

    fn check_rows(&self, layer: usize, rows: &[usize]) -> Result<()> {
        let (stored, head) = match &self.quant {
            Some(q) => (
                q.rows.get(layer).map_or(0, |r| r.len() / self.row_bytes(layer)),
                q.head
                    .get(layer)
                    .and_then(Option::as_ref)
                    .map_or(0..0, |(k, _)| q.head_row0..q.head_row0 + k.len() / self.width),
            ),
            None => (self.k.get(layer).map_or(0, |k| k.len() / self.width), 0..0),
        };
        match rows.iter().all(|&r| r < stored || head.contains(&r)) {
            true => Ok(()),
            false => Err(Error::Invalid(format!("KV rows past layer {layer}'s {stored} rows"))),
        }
    }

    /// Bytes of store row `r` of `layer` in `export`'s form (a head block's: bf16).
    fn row_bytes_at(&self, layer: usize, r: usize) -> usize {
        match &self.quant {
            Some(q) if q.is_head(layer, r) => 4 * self.width,
            _ => self.row_bytes(layer),
        }
    }

    /// Maximal runs of consecutive store rows of one kind (quantized or head blocks) in
    /// `rows`: (first, count, head).
    fn runs_by_kind(&self, layer: usize, rows: &[usize]) -> Vec<(usize, usize, bool)> {
        let mut out: Vec<(usize, usize, bool)> = Vec::new();
        for &r in rows {
            let head = self.quant.as_ref().is_some_and(|q| q.is_head(layer, r));
            match out.last_mut() {
                Some((a, n, h)) if *a + *n == r && *h == head => *n += 1,
                _ => out.push((r, 1, head)),
            }
        }
        out
    }

    /// bf16 rows `a..a + n` of `k` and `v` read back as export's bytes (key then value each).
    fn read_bf16(
        ctx: &Context,
        (k, v): (&CudaSlice<u16>, &CudaSlice<u16>),
        (a, n, w): (usize, usize, usize),
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let read = |buf: &CudaSlice<u16>| ctx.stream.clone_dtoh(&buf.slice(a * w..(a + n) * w));
        let (k, v) = (read(k).map_err(drv("reading the KV cache"))?, read(v).map_err(drv("reading the KV cache"))?);
        for i in 0..n {
            for x in k[i * w..(i + 1) * w].iter().chain(&v[i * w..(i + 1) * w]) {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(())
    }

    /// export's bytes of `n` rows into bf16 rows `a..a + n` of `k` and `v`.
    fn write_bf16(
        ctx: &Context,
        (k, v): (&mut CudaSlice<u16>, &mut CudaSlice<u16>),
        (a, n, w): (usize, usize, usize),
        data: &[u8],
    ) -> Result<()> {
        let (mut hk, mut hv) = (Vec::with_capacity(n * w), Vec::with_capacity(n * w));
        for row in data.chunks_exact(4 * w) {
            let (rk, rv) = row.split_at(2 * w);
            hk.extend(rk.chunks_exact(2).map(|x| u16::from_le_bytes([x[0], x[1]])));
            hv.extend(rv.chunks_exact(2).map(|x| u16::from_le_bytes([x[0], x[1]])));
        }
        let span = a * w..(a + n) * w;
        ctx.stream.memcpy_htod(&hk, &mut k.slice_mut(span.clone())).map_err(drv("writing the KV cache"))?;
        ctx.stream.memcpy_htod(&hv, &mut v.slice_mut(span)).map_err(drv("writing the KV cache"))
    }

    /// `Backend::kv_export`: each row's key then value, bf16 little-endian (or the quantized
    /// rows as stored, a head block's row as bf16); a run of consecutive rows is one copy.
    pub(crate) fn export(&self, ctx: &Context, layer: usize, rows: &[usize], out: &mut Vec<u8>) -> Result<()> {
        self.check_rows(layer, rows)?;
        let w = self.width;
        for (a, n, head) in self.runs_by_kind(layer, rows) {
            match &self.quant {
                Some(q) if head => {
                    let (k, v) = q.head[layer].as_ref().expect("a head row has head blocks");
                    Self::read_bf16(ctx, (k, v), (a - q.head_row0, n, w), out)?;
                }
                Some(q) => {
                    let b = self.row_bytes(layer);
                    let bytes = ctx.stream.clone_dtoh(&q.rows[layer].slice(a * b..(a + n) * b));
                    out.extend(bytes.map_err(drv("reading the KV cache"))?);
                }
                None => Self::read_bf16(ctx, (&self.k[layer], &self.v[layer]), (a, n, w), out)?,
            }
        }
        Ok(())
    }

    /// `Backend::kv_import`: `data` as `export` gives it into `rows` of `layer`.
    pub(crate) fn import(&mut self, ctx: &Context, layer: usize, rows: &[usize], data: &[u8]) -> Result<()> {
        self.check_rows(layer, rows)?;
        let want: usize = rows.iter().map(|&r| self.row_bytes_at(layer, r)).sum();
        if data.len() != want {
            return Err(Error::Invalid(format!("{} bytes for {} KV rows of {want} bytes", data.len(), rows.len())));
        }
        let (w, b) = (self.width, self.row_bytes(layer));
        let mut at = 0;
        for (a, n, head) in self.runs_by_kind(layer, rows) {
            match &mut self.quant {
                Some(q) if head => {
                    let r0 = a - q.head_row0;
                    let (k, v) = q.head[layer].as_mut().expect("a head row has head blocks");
                    Self::write_bf16(ctx, (k, v), (r0, n, w), &data[at..at + n * 4 * w])?;
                    at += n * 4 * w;
                }
                Some(q) => {
                    let dst = &mut q.rows[layer].slice_mut(a * b..(a + n) * b);
                    ctx.stream.memcpy_htod(&data[at..at + n * b], dst).map_err(drv("writing the KV cache"))?;
                    at += n * b;
                }
                None => {
                    Self::write_bf16(
                        ctx,
                        (&mut self.k[layer], &mut self.v[layer]),
                        (a, n, w),
                        &data[at..at + n * 4 * w],
                    )?;
                    at += n * 4 * w;
                }
            }
        }
        ctx.stream.synchronize().map_err(drv("writing the KV cache"))
    }

    /// Whether `layer` is a sliding-window layer (which table its kernels take).
    pub(crate) fn sliding(&self, layer: usize) -> Result<bool> {
        self.sliding.get(layer).copied().ok_or_else(|| {
            Error::Invalid(format!("CUDA KV store: layer {layer} of a {}-layer store", self.sliding.len()))
        })
    }
}

impl Context {
    /// A store of `blocks` for `cfg`'s layers, its bf16 K and V allocated where `bf16`
    /// (a quantized store adds its rows: kv_quant.rs).
    pub(crate) fn kv_store_bf16(&self, cfg: &ModelConfig, blocks: KvBlocks, bf16: bool) -> Result<CudaKv> {
        let width = cfg.n_kv_heads * cfg.head_dim;
        if !cfg.head_dim.is_multiple_of(32) || cfg.head_dim > 256 {
            return Err(Error::Unsupported(format!(
                "CUDA attention needs head_dim a multiple of 32 up to 256 ({})",
                cfg.head_dim
            )));
        }
        let sliding: Vec<bool> = (0..cfg.n_layers).map(|i| crate::kv::is_sliding(cfg, i)).collect();
        let rows = |s: bool| if s { blocks.sliding } else { blocks.full } * crate::kv::BLOCK;
        let layer = |s: &bool| self.zeros::<u16>(rows(*s) * width, "allocating the KV cache");
        let (k, v) = match bf16 {
            true => {
                (sliding.iter().map(layer).collect::<Result<_>>()?, sliding.iter().map(layer).collect::<Result<_>>()?)
            }
            false => (vec![], vec![]),
        };
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(CudaKv { id, blocks, sliding, width, head_dim: cfg.head_dim, k, v, quant: None })
    }
}

impl DevScales {
    /// The scales' device pointer as a kernel argument.
    pub fn arg(&self, ctx: &Context) -> KArg {
        KArg::Ptr(match self {
            DevScales::Half(v) => v.device_ptr(&ctx.stream).0,
            DevScales::F32(v) => v.device_ptr(&ctx.stream).0,
        })
    }
}

/// The width a bit width without CUDA kernels runs at: the next one with kernels.
fn widened_bits(bits: u32) -> Option<u32> {
    match bits {
        3 => Some(4),
        5 | 6 => Some(8),
        _ => None,
    }
}

impl Context {
    fn scales(&self, s: &Scales) -> Result<DevScales> {
        Ok(match s {
            Scales::F16(v) => DevScales::Half(self.upload(bytemuck::cast_slice::<_, u16>(v), "uploading scales")?),
            Scales::BF16(v) => DevScales::Half(self.upload(bytemuck::cast_slice::<_, u16>(v), "uploading scales")?),
            Scales::F32(v) => DevScales::F32(self.upload(v, "uploading scales")?),
        })
    }

    pub fn matrix(&self, w: Weight) -> Result<CudaMat> {
        match w {
            Weight::Affine(a) => self.affine(&a),
            Weight::Dense(d) => self.dense(&d),
        }
    }

    fn affine(&self, a: &AffineTensor) -> Result<CudaMat> {
        // 3/5/6-bit streams cross word boundaries and have no kernels of their own: 3-bit
        // runs as 4-bit, 5/6-bit as 8-bit (exact, same scales; more bytes per weight), said
        // once per process.
        if let Some(wide) = widened_bits(a.bits).filter(|_| kernels::AFFINE_GROUPS.contains(&a.group)) {
            static NOTE: std::sync::Once = std::sync::Once::new();
            NOTE.call_once(|| {
                eprintln!("ferrolm: CUDA runs 3-bit weights as 4-bit and 5/6-bit as 8-bit (same values, more bytes)")
            });
            return self.affine(&a.widen(wide)?);
        }
        if !kernels::AFFINE_BITS.contains(&a.bits) || !kernels::AFFINE_GROUPS.contains(&a.group) {
            return Err(Error::Unsupported(format!(
                "{}-bit weights with group {} on CUDA (supported: 2–8 bits, groups 16–128)",
                a.bits, a.group
            )));
        }
        // 16-byte chunks of a row must hold whole values: cols·bits a multiple of 128.
        if !(a.cols * a.bits as usize).is_multiple_of(128) {
            return Err(Error::Unsupported(format!("CUDA GEMV needs cols·bits divisible by 128 (cols {})", a.cols)));
        }
        // One scale type per kernel: where scales and biases differ (legacy blocks whose
        // −k·d overflowed f16 keep f32 biases) both go up as f32, exactly.
        let (scales, biases) = if a.scales.dtype() == a.biases.dtype() {
            (a.scales.clone(), a.biases.clone())
        } else {
            (Scales::F32(a.scales.to_f32_vec()), Scales::F32(a.biases.to_f32_vec()))
        };
        let defines = kernels::affine_defines(a.bits, a.group, scales.dtype());
        let file = kernels::file("affine.cu");
        let f = [
            self.function(file, &defines, "qmv")?,
            self.function(file, &defines, "qmv_f32")?,
            self.function(file, &defines, "embed")?,
            self.function(file, &defines, "qmv8")?,
            self.function(file, &defines, "qmv8_f32")?,
        ];
        Ok(CudaMat::Affine {
            rows: a.rows,
            cols: a.cols,
            words: self.upload(&a.packed, "uploading weights")?,
            scales: self.scales(&scales)?,
            biases: self.scales(&biases)?,
            f,
            bits: a.bits,
            group: a.group,
            defines,
        })
    }

    fn dense(&self, d: &DenseTensor) -> Result<CudaMat> {
        if !d.cols.is_multiple_of(8) {
            return Err(Error::Unsupported(format!("dense CUDA GEMV needs cols divisible by 8 (cols {})", d.cols)));
        }
        let bits: Vec<u16> = match &d.data {
            DenseData::BF16(v) => bytemuck::cast_slice(v).to_vec(),
            _ => d.to_f32_vec().into_iter().map(|x| bf16::from_f32(x).to_bits()).collect(),
        };
        let file = kernels::file("dense.cu");
        let f = [
            self.function(file, &[], "dmv")?,
            self.function(file, &[], "dmv_f32")?,
            self.function(file, &[], "dembed")?,
        ];
        Ok(CudaMat::Dense { rows: d.rows, cols: d.cols, w: self.upload(&bits, "uploading weights")?, f })
    }
}

impl Context {
    /// bf16 activations holding `data` (rounded to bf16), for tests and tools.
    pub fn act_from(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaAct> {
        let bits: Vec<u16> = data.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        Ok(CudaAct { rows, cols, buf: ActBuf::Bf16(self.upload(&bits, "uploading activations")?) })
    }
    /// f32 activations holding `data` (the residual stream's precision).
    pub fn act_from_f32(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaAct> {
        Ok(CudaAct { rows, cols, buf: ActBuf::F32(self.upload(data, "uploading activations")?) })
    }
    /// Activations filled with NaN, so elements a kernel fails to write show up.
    pub fn act_poisoned(&self, rows: usize, cols: usize, f32_out: bool) -> Result<CudaAct> {
        let n = rows * cols;
        let buf = if f32_out {
            ActBuf::F32(self.upload(&vec![f32::NAN; n], "poisoning")?)
        } else {
            ActBuf::Bf16(self.upload(&vec![0x7fc0u16; n], "poisoning")?)
        };
        Ok(CudaAct { rows, cols, buf })
    }
}
