//! The single-kernel ops every phase uses: embedding lookup, RMSNorm (of rows and of q/k
//! heads), biases, RoPE, the SwiGLU/GeGLU product, residual adds, and the KV cache write (kernels/rmsnorm.cu, rope.cu,
//! elementwise.cu, affine.cu's and dense.cu's embed, attention.cu's kv_write).

use super::context::Order;
use super::device::Cuda;
use super::driver::KArg;
use super::kernels;
use super::tensors::{ActBuf, CudaAct, CudaKv, CudaMat};
use crate::backend::Rope;
use crate::config::{Activation, RopeStyle};
use crate::kv::Span;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, LaunchConfig};

pub(crate) fn cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0.max(1), grid.1.max(1), 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// Grid for a grid-stride element-wise kernel over n elements.
pub(crate) fn elems(n: usize) -> (u32, u32) {
    ((n.div_ceil(256)).min(4096) as u32, 1)
}

impl Cuda {
    /// One of the kernels compiled without defines, from `file`.
    pub(crate) fn plain_kernel(&self, file: &str, func: &str) -> Result<cudarc::driver::CudaFunction> {
        self.function(kernels::file(file), &[], func)
    }

    /// `Backend::embed`: out[i] = table[staged token i] into the f32 residual stream. The
    /// affine embed waits (PDL) before it reads the token: a run of fed steps in one graph
    /// overlaps each step's start with the last one's head.
    /// The embedding of the staged tokens, table row = id − `first` (zeros for ids the
    /// table's rows do not hold: a tensor-parallel rank's part of the vocabulary).
    pub fn embed_rows(
        &self,
        table: &CudaMat,
        tokens: usize,
        scale: f32,
        out: &mut CudaAct,
        first: usize,
    ) -> Result<()> {
        let (ids, _) = self.steps.inputs(self, tokens, "embed")?;
        if !out.is_f32() {
            return Err(Error::Invalid("CUDA embed writes the f32 residual stream".into()));
        }
        let cols = KArg::I32(table.cols() as i32);
        let (first, count) = (KArg::I32(first as i32), KArg::I32(table.rows() as i32));
        let c = cfg((tokens as u32, 1), 256);
        match table {
            CudaMat::Affine { words, scales, biases, f, .. } => {
                let args = [
                    self.arg(words),
                    scales.arg(self),
                    biases.arg(self),
                    ids,
                    out.arg(self),
                    cols,
                    KArg::F32(scale),
                    first,
                    count,
                ];
                self.launch(&f[2], c, &args, Order::Overlap, "embed launch")
            }
            CudaMat::Dense { w, f, .. } => {
                let args = [self.arg(w), ids, out.arg(self), cols, KArg::F32(scale), first, count];
                self.launch(&f[2], c, &args, Order::Serial, "embed launch")
            }
        }
    }

    /// `Backend::rms_norm`, per row of f32 or bf16 x into bf16.
    pub(crate) fn rms_norm_rows(&self, x: &CudaAct, w: &CudaSlice<f32>, eps: f32, out: &mut CudaAct) -> Result<()> {
        let name = if x.is_f32() { "rmsnorm" } else { "rmsnorm_bf16" };
        let f = self.plain_kernel("rmsnorm.cu", name)?;
        let args = [x.arg(self), self.arg(w), self.arg(out.bf16_mut()), KArg::I32(x.cols as i32), KArg::F32(eps)];
        self.launch(&f, cfg((x.rows as u32, 1), 256), &args, Order::Serial, "rmsnorm launch")
    }

    /// `Backend::rms_norm_heads`: each `w.len()`-wide head of bf16 x normalized in place.
    pub(crate) fn rms_norm_heads_rows(&self, x: &mut CudaAct, w: &CudaSlice<f32>, eps: f32) -> Result<()> {
        let hd = w.len();
        if hd == 0 || !x.cols.is_multiple_of(hd) {
            return Err(Error::Invalid(format!("head norm of width {hd} over rows of {}", x.cols)));
        }
        let f = self.plain_kernel("rmsnorm.cu", "rmsnorm_heads")?;
        let heads = (x.rows * x.cols / hd) as u32;
        let args = [self.arg(x.bf16_mut()), self.arg(w), KArg::I32(hd as i32), KArg::F32(eps)];
        self.launch(&f, cfg((heads, 1), 256), &args, Order::Serial, "rmsnorm_heads launch")
    }

    /// x += rmsnorm(y)·w per row: the f32 residual stream and a bf16 block output (Gemma's
    /// post-norms, `Backend::matmul_norm_add`'s second half).
    pub(crate) fn rms_norm_add_rows(&self, y: &CudaAct, w: &CudaSlice<f32>, eps: f32, x: &mut CudaAct) -> Result<()> {
        let xp = x.arg(self);
        self.rms_norm_add_launch(xp, (xp, x), y, w, eps)
    }

    /// out = x + rmsnorm(y)·w per row (x, out: the f32 residual in two buffers).
    pub(crate) fn rms_norm_add_into(
        &self,
        x: &CudaAct,
        y: &CudaAct,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaAct,
    ) -> Result<()> {
        if x.rows != out.rows || x.cols != out.cols || !x.is_f32() {
            return Err(Error::Invalid(format!(
                "CUDA norm-add of [{}, {}] into [{}, {}]",
                x.rows, x.cols, out.rows, out.cols
            )));
        }
        self.rms_norm_add_launch(out.arg(self), (x.arg(self), out), y, w, eps)
    }

    fn rms_norm_add_launch(
        &self,
        out: KArg,
        (xp, x): (KArg, &CudaAct),
        y: &CudaAct,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<()> {
        if !x.is_f32() || y.is_f32() || x.rows != y.rows || x.cols != y.cols || w.len() != y.cols {
            return Err(Error::Invalid(format!(
                "CUDA norm-add of [{}, {}] into [{}, {}] with {} gains (bf16 into the f32 residual)",
                y.rows,
                y.cols,
                x.rows,
                x.cols,
                w.len()
            )));
        }
        let f = self.plain_kernel("rmsnorm.cu", "rmsnorm_add")?;
        let args = [out, xp, self.arg(y.bf16()), self.arg(w), KArg::I32(y.cols as i32), KArg::F32(eps)];
        self.launch(&f, cfg((y.rows as u32, 1), 256), &args, Order::Overlap, "rmsnorm_add launch")
    }

    /// `Backend::add_bias`: x[i] += b per row.
    pub(crate) fn add_bias_rows(&self, x: &mut CudaAct, bias: &CudaSlice<f32>) -> Result<()> {
        let f = self.plain_kernel("elementwise.cu", "add_bias")?;
        let n = x.rows * x.cols;
        let args = [self.arg(x.bf16_mut()), self.arg(bias), KArg::I32(x.cols as i32), KArg::I32(n as i32)];
        self.launch(&f, cfg(elems(n), 256), &args, Order::Serial, "add_bias launch")
    }

    /// `Backend::rope` at the staged position.
    pub(crate) fn rope_rows(&self, x: &mut CudaAct, n_heads: usize, rope: &Rope) -> Result<()> {
        let freqs = self.scratch.rope_freqs(self, rope)?;
        let f = self.plain_kernel("rope.cu", "rope")?;
        let pos = self.steps.pos(self, "rope")?;
        let inter = i32::from(rope.style == RopeStyle::Interleaved);
        let n = x.rows * x.cols / 2;
        let args = [
            self.arg(x.bf16_mut()),
            freqs,
            KArg::I32(x.rows as i32),
            KArg::I32(n_heads as i32),
            KArg::I32((x.cols / n_heads) as i32),
            pos,
            KArg::F32(rope.linear),
            KArg::I32(inter),
        ];
        self.launch(&f, cfg(elems(n), 256), &args, Order::Serial, "rope launch")
    }

    /// `Backend::glu`: out = act(gate) · up.
    pub(crate) fn glu_rows(&self, gate: &CudaAct, up: &CudaAct, act: Activation, out: &mut CudaAct) -> Result<()> {
        let name = match act {
            Activation::Silu => "silu_mul",
            Activation::GeluTanh => "gelu_mul",
        };
        let f = self.plain_kernel("elementwise.cu", name)?;
        let n = gate.rows * gate.cols;
        let args = [gate.arg(self), up.arg(self), self.arg(out.bf16_mut()), KArg::I32(n as i32)];
        self.launch(&f, cfg(elems(n), 256), &args, Order::Serial, "glu launch")
    }

    /// `Backend::add`: x += y (x f32 or bf16, y bf16).
    pub(crate) fn add_rows(&self, x: &mut CudaAct, y: &CudaAct) -> Result<()> {
        let n = x.rows * x.cols;
        let name = if x.is_f32() { "add_f32_bf16" } else { "add_inplace" };
        let f = self.plain_kernel("elementwise.cu", name)?;
        let args = [x.arg(self), self.arg(y.bf16()), KArg::I32(n as i32)];
        self.launch(&f, cfg(elems(n), 256), &args, Order::Serial, "add launch")
    }

    /// k/v rows into layer's store at the staged rows' positions, through their sequences'
    /// tables (which hold those blocks: checked by the model).
    pub(crate) fn kv_write(&self, k: &CudaAct, v: &CudaAct, kv: &mut CudaKv, layer: usize) -> Result<()> {
        let f = self.plain_kernel("attention.cu", "kv_write")?;
        let tables = self.steps.tables(self, kv.sliding(layer)?, "attention")?;
        let pos = self.steps.pos(self, "attention")?;
        let args = [
            self.arg(&kv.k[layer]),
            self.arg(&kv.v[layer]),
            self.arg(k.bf16()),
            self.arg(v.bf16()),
            KArg::I32(k.rows as i32),
            KArg::I32(kv.width as i32),
            pos,
            tables[0],
            tables[1],
        ];
        self.launch(&f, cfg(elems(k.rows * kv.width), 256), &args, Order::Serial, "kv_write launch")
    }

    /// Rows `[first, rows)` of x as a new activation.
    pub(crate) fn copy_rows(&self, x: &CudaAct, first: usize) -> Result<CudaAct> {
        use super::driver::drv;
        let (s, e) = (first * x.cols, x.rows * x.cols);
        let buf = match &x.buf {
            ActBuf::Bf16(b) => ActBuf::Bf16(self.stream.clone_dtod(&b.slice(s..e)).map_err(drv("copying rows"))?),
            ActBuf::F32(b) => ActBuf::F32(self.stream.clone_dtod(&b.slice(s..e)).map_err(drv("copying rows"))?),
        };
        Ok(CudaAct { rows: x.rows - first, cols: x.cols, buf })
    }

    /// `Backend::gather_last_rows`: out row i = x row sel[i] with the head rows `begin`
    /// staged (each span's last row, then row 0), one launch for bf16 and f32 rows.
    pub(crate) fn gather_last_rows(&self, x: &CudaAct, spans: &[Span<'_>], out: &mut CudaAct) -> Result<()> {
        let last = crate::kv::span_ends(spans).last().copied();
        crate::backend::check_gather(x.rows, x.cols, spans.len(), last, (out.rows, out.cols))?;
        if x.is_f32() != out.is_f32() {
            return Err(Error::Invalid("CUDA gather_last_rows between bf16 and f32 activations".into()));
        }
        let sel = self.steps.head_rows(self, out.rows)?;
        let units = x.cols * if x.is_f32() { 2 } else { 1 }; // 16-bit units a row
        let f = self.plain_kernel("elementwise.cu", "gather_rows")?;
        let args = [x.arg(self), sel, out.arg(self), KArg::I32(out.rows as i32), KArg::I32(units as i32)];
        // Matches elementwise.cu's gather_rows; the staged head rows cover out's rows.
        self.launch(&f, cfg(elems(out.rows * units), 256), &args, Order::Serial, "gather_rows launch")
    }
}
