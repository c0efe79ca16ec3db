//! The prefill GEMM on Hopper's warpgroup MMA (kernels/gemm_wgmma.cu): the affine weights
//! dequantized into a bf16 copy first (gemm.cu's dequant_bf16, the values every quantized
//! GEMM multiplies by), then 128 tokens × 128 rows a block through a six-stage cp.async
//! ring. Its outputs have the tiled kernel's bits (cuda_parity's gemm tests), so Auto may
//! take it for any call it serves: from [`WGMMA_MIN_M`] tokens on sm_90 devices, with
//! `CudaConfig::gemm_wgmma`, outside graph captures, cols a multiple of 64.
//!
//! The copy lives in one scratch buffer for every call (`Scratch::wgmma_weights`): as
//! large as the largest matrix it served (a GLU's gate and up together: 235 MB on an 8B
//! model).

use super::context::Order;
use super::device::Cuda;
use super::driver::{drv, KArg};
use super::gemm::QgemmKernel;
use super::kernels;
use super::tensors::{ActBuf, CudaAct, CudaMat};
use crate::config::Activation;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::LaunchConfig;
use std::sync::atomic::Ordering::Relaxed;

/// Fewest tokens Auto gives the wgmma kernel: below, the dequantization pass weighs more
/// than the faster multiply gains (8B shapes on an H100 at 512 tokens: 1.20-1.37x the
/// wide tiles with the pass counted, docs/perf.md).
pub const WGMMA_MIN_M: usize = 512;
const FILE: &str = "gemm_wgmma.cu";
/// Tokens and weight rows per block (the kernel's WG_BM, WG_BN).
const TILE: usize = 128;
/// cols must be a multiple of this (one ring step).
const COLS_MULTIPLE: usize = 64;
/// The ring's dynamic shared memory: six stages of a 32 KiB x and w tile pair, and 1 KiB
/// to align them (the kernel's WG_SMEM).
const SMEM_BYTES: usize = 6 * 2 * TILE * 128 + 1024;
/// The GLU form's copy interleaves gate and up by this many rows (half a tile).
const GLU_HALF: usize = TILE / 2;
/// Blocks of the grid-stride dequantization per SM (256 threads each).
const DEQUANT_BLOCKS_PER_SM: usize = 16;

impl Cuda {
    /// Whether a call of m tokens over cols runs on the wgmma kernel as `kernel` asks: named,
    /// it must (an error where it cannot); Auto, where it serves and the configuration lets it.
    pub(super) fn takes_wgmma(&self, kernel: QgemmKernel, m: usize, cols: usize) -> Result<bool> {
        let runs = kernels::runs_on(FILE, &self.arch);
        let fits = cols.is_multiple_of(COLS_MULTIPLE);
        match kernel {
            QgemmKernel::Wgmma if !runs => {
                Err(Error::Unsupported(format!("the wgmma qgemm runs on sm_90 devices, not {}", self.arch)))
            }
            QgemmKernel::Wgmma if !fits => {
                Err(Error::Unsupported(format!("the wgmma qgemm needs cols a multiple of {COLS_MULTIPLE}, not {cols}")))
            }
            QgemmKernel::Wgmma => Ok(true),
            QgemmKernel::Auto => {
                Ok(self.cfg.gemm_wgmma && runs && fits && m >= WGMMA_MIN_M && !self.capturing.load(Relaxed))
            }
            _ => Ok(false),
        }
    }

    /// out = x·wᵀ, or with `glu` = (up, act) out = act(x·wᵀ)·(x·upᵀ), on the wgmma kernel.
    /// Shapes, formats and sizes as qgemm_as / qgemm_glu_as checked them.
    pub(super) fn qgemm_wgmma(
        &self,
        x: &CudaAct,
        (w, glu): (&CudaMat, Option<(&CudaMat, Activation)>),
        out: &mut CudaAct,
    ) -> Result<()> {
        let (rows, cols, m) = (w.rows(), w.cols(), x.rows);
        let ActBuf::Bf16(xb) = &x.buf else {
            return Err(Error::Invalid("CUDA qgemm takes bf16 activations, not f32".into()));
        };
        let (name, row_blocks, act) = match (glu, &out.buf) {
            (None, ActBuf::Bf16(_)) => ("qgemm_wgmma", rows.div_ceil(TILE), None),
            (None, ActBuf::F32(_)) => ("qgemm_wgmma_f32", rows.div_ceil(TILE), None),
            (Some((_, act)), ActBuf::Bf16(_)) => ("qgemm_wgmma_glu", rows.div_ceil(GLU_HALF), Some(act)),
            (Some(_), ActBuf::F32(_)) => return Err(Error::Invalid("the GLU qgemm writes bf16".into())),
        };
        if row_blocks > 65535 {
            return Err(Error::Unsupported(format!("the wgmma qgemm over {rows} rows")));
        }
        let copy_rows = if glu.is_some() { 2 * rows.div_ceil(GLU_HALF) * GLU_HALF } else { rows };
        let copy = self.scratch.wgmma_weights(&self.ctx, copy_rows * cols)?;
        match glu {
            None => self.dequant_bf16(w, copy, (0, 0))?,
            Some((up, _)) => {
                self.dequant_bf16(w, copy, (GLU_HALF, 0))?;
                self.dequant_bf16(up, copy, (GLU_HALF, 1))?;
            }
        }
        let f = self.function(kernels::file(FILE), &[], name)?;
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM_BYTES as i32)
            .map_err(drv("allowing the wgmma qgemm its shared memory"))?;
        let mut args = vec![
            copy,
            self.arg(xb),
            out.arg(self),
            KArg::I32(rows as i32),
            KArg::I32(cols as i32),
            KArg::I32(m as i32),
        ];
        if let Some(act) = act {
            args.push(KArg::I32(i32::from(act == Activation::GeluTanh)));
        }
        let cfg = LaunchConfig {
            grid_dim: (m.div_ceil(TILE) as u32, row_blocks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SMEM_BYTES as u32,
        };
        // Matches gemm_wgmma.cu's entry `name` (bf16 copy, x, out, rows, cols, m[, act]).
        self.launch(&f, cfg, &args, Order::Serial, "qgemm_wgmma launch")
    }

    /// `w` dequantized into the bf16 copy at `copy` (gemm.cu's dequant_bf16): row r at row
    /// r, or with (half, up) = (64, u) interleaved for the GLU form.
    fn dequant_bf16(&self, w: &CudaMat, copy: KArg, (half, up): (usize, usize)) -> Result<()> {
        let CudaMat::Affine { words, scales, biases, defines, rows, cols, .. } = w else {
            return Err(Error::Unsupported("the wgmma qgemm needs affine-quantized weights".into()));
        };
        let f = self.function(kernels::file("gemm.cu"), defines, "dequant_bf16")?;
        let args = [
            self.arg(words),
            scales.arg(self),
            biases.arg(self),
            copy,
            KArg::I32(*rows as i32),
            KArg::I32(*cols as i32),
            KArg::I32(half as i32),
            KArg::I32(up as i32),
        ];
        let blocks = (self.sms * DEQUANT_BLOCKS_PER_SM) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(&f, cfg, &args, Order::Serial, "dequant_bf16 launch")
    }
}
