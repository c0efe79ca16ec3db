//! Flash-attention prefill on tensor cores (kernels/flash_attention.cu).
//!
//! Causal GQA attention of many query rows over the bf16 KV cache, flash-attention-2 style:
//! one block per 64 query rows and head streams the cached keys and values in tiles through
//! shared memory, with Q·Kᵀ and P·V on the tensor cores (mma.sync m16n8k16, f32 accumulation)
//! and an online softmax in f32. The probabilities go to the P·V product as bf16 (about 2⁻⁹
//! relative each, well inside the 1e-2 parity tolerance).
//!
//! What it runs: head_dim 64, 128 or 256 ([`kernels::FLASH_HEAD_DIMS`]), any number of query
//! rows, any GQA grouping. It only reads the cache: the caller writes this call's keys and
//! values first (attention.cu's kv_write), and the model keeps pos0 + m ≤ the cache size.

use super::context::Order;
use super::device::Cuda;
use super::driver::KArg;
use super::kernels;
use super::tensors::{ActBuf, CudaAct, CudaKv};
use crate::backend::Attend;
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;

/// Query rows per block (flash_attention.cu's BQ).
const TILE_ROWS: usize = 64;
/// Threads per block (flash_attention.cu's NT).
const THREADS: u32 = 128;

impl Cuda {
    /// out = causal attention of q `[m, heads·hd]` (rows at positions pos0.., pos0 as staged by
    /// `begin`; `attend`'s scale and window) over layer `layer` of `kv`, which must already
    /// hold positions 0..pos0+m;
    /// out bf16 `[m, heads·hd]`. Query head h reads kv head h / (heads / n_kv).
    pub fn flash_prefill(
        &self,
        q: &CudaAct,
        kv: &CudaKv,
        layer: usize,
        attend: Attend,
        out: &mut CudaAct,
    ) -> Result<()> {
        let hd = kv.head_dim;
        if !kernels::FLASH_HEAD_DIMS.contains(&hd) {
            return Err(Error::Unsupported(format!(
                "CUDA flash attention for head_dim {hd} (compiled for {:?})",
                kernels::FLASH_HEAD_DIMS
            )));
        }
        let layers = kv.sliding.len();
        if layer >= layers {
            return Err(Error::Invalid(format!("CUDA flash attention: layer {layer} of a {layers}-layer cache")));
        }
        let n_kv = kv.width / hd;
        if q.cols != out.cols || q.rows != out.rows || !q.cols.is_multiple_of(hd) || n_kv == 0 {
            return Err(Error::Invalid(format!(
                "CUDA flash attention shapes: q [{}, {}], out [{}, {}], head_dim {hd}, cache width {}",
                q.rows, q.cols, out.rows, out.cols, kv.width
            )));
        }
        let heads = q.cols / hd;
        if heads == 0 || !heads.is_multiple_of(n_kv) {
            return Err(Error::Invalid(format!(
                "CUDA flash attention: {heads} query heads do not group over {n_kv} kv heads"
            )));
        }
        if q.rows > kv.max_seq() {
            return Err(Error::Invalid(format!(
                "CUDA flash attention: {} query rows in a {}-position cache",
                q.rows,
                kv.max_seq()
            )));
        }
        let (ActBuf::Bf16(qb), ActBuf::Bf16(ob)) = (&q.buf, &mut out.buf) else {
            return Err(Error::Invalid("CUDA flash attention takes and gives bf16 activations, not f32".into()));
        };
        if q.rows == 0 {
            return Ok(());
        }
        // grid.y is the head (at most 65535); the kernel takes the sizes as int.
        if heads > 65535 || i32::try_from(q.rows).is_err() {
            return Err(Error::Unsupported(format!("CUDA flash attention: {heads} heads, {} rows", q.rows)));
        }
        // A quantized store: its rows and table in place of K and V, the tiles dequantized.
        // A quantized store: its rows and table in place of K and V, then its head blocks'.
        let (defines, store, rotated) = match &kv.quant {
            Some(qk) => {
                let defines = kernels::flash_kv_quant_defines(hd, &super::kv_quant::quant_defines(&qk.codecs[layer]));
                let store =
                    [self.arg(&qk.rows[layer]), self.arg(&qk.table)].into_iter().chain(qk.head_args(self, layer));
                (defines, store.collect::<Vec<_>>(), qk.codecs[layer].kernel_format().0)
            }
            None => (vec![format!("HD={hd}")], vec![self.arg(&kv.k[layer]), self.arg(&kv.v[layer])], false),
        };
        let func = self.function(kernels::file("flash_attention.cu"), &defines, "flash_prefill")?;
        let pos = self.steps.pos(self, "flash attention")?;
        let (m_i, heads_i, n_kv_i) = (q.rows as i32, heads as i32, n_kv as i32);
        let cfg = LaunchConfig {
            grid_dim: (q.rows.div_ceil(TILE_ROWS) as u32, heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = vec![self.arg(qb)];
        args.extend(store);
        args.extend([
            self.arg(ob),
            KArg::I32(m_i),
            KArg::I32(heads_i),
            KArg::I32(n_kv_i),
            pos,
            KArg::F32(attend.scale),
            KArg::I32(super::prefill::window_arg(attend)?),
            self.steps.tables(self, kv.sliding(layer)?, "attention")?[0], // one sequence: offset 0
        ]);
        // Matches flash_attention.cu's flash_prefill; the cache holds pos0 + m positions.
        self.launch(&func, cfg, &args, Order::Serial, "flash_prefill launch")?;
        match rotated {
            true => self.unrotate_rows(out, kv, layer),
            false => Ok(()),
        }
    }
}
