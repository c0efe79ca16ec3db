//! The decode MLP with down's x staged by its producer (kernels/x_staged.cuh): the SwiGLU
//! GEMV writes act both as bf16 (the `act` output) and as the image the down GEMV's shared
//! memory holds (int16 x, block scales, sums), so down's blocks copy it in after their
//! release instead of each quantizing the whole 8192-wide input (the 1B shape: 264 blocks
//! per launch, ~2 µs after the release; docs/perf.md, session 11). Bit-identical to the
//! separate launches (same values, same 32-value blocks); `FERROLM_GEMV_STAGED=0` or
//! `Cuda::set_staged_x(false)` turns it off (tests compare the two on one device).

use super::device::{drv, Cuda, CudaAct, CudaMat};
use super::fused::{gemv_warps, x_staging, GemvExtra, GemvIn, GemvOut};
use crate::Result;
use cudarc::driver::CudaSlice;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// An input vector of `cols` values as the SwiGLU GEMV writes it for the down GEMV (int16
/// x, block scales and sums: the decode GEMV's shared-memory image, x_staged.cuh), one per
/// width; kept for the process (captured graphs point at it).
pub(crate) struct StagedX {
    pub(crate) buf: CudaSlice<u8>,
    pub(crate) cols: usize,
}

/// Whether `cols` inputs can be staged by their producer (x_staged.cuh): int16 x (XQ), in
/// whole 16-byte pieces (cols % 128 == 0).
pub(super) fn staged_x_fits(cols: usize) -> bool {
    cols.is_multiple_of(128) && x_staging(cols).0
}

/// On unless `FERROLM_GEMV_STAGED=0` (for A/B runs and the GPU tests' second pass).
pub(super) fn staged_x_default() -> bool {
    std::env::var("FERROLM_GEMV_STAGED").map_or(true, |v| v != "0")
}

impl Cuda {
    /// Whether the decode MLP stages down's x in its SwiGLU GEMV.
    pub fn staged_x(&self) -> bool {
        self.staged_x_on.load(Relaxed)
    }

    /// Turn producer-staged x on or off (tests compare the two on one device).
    pub fn set_staged_x(&self, on: bool) {
        self.staged_x_on.store(on, Relaxed);
        self.decode_path_changed();
    }

    /// Staged MLPs queued or captured (tests check that the staged path ran).
    pub fn staged_x_launches(&self) -> usize {
        self.staged_x_launches.load(Relaxed)
    }

    /// The staged image for `cols` inputs, made on first use (outside any capture: in the
    /// pass a decode step gets before its capture, `Cuda::before_capture`) and kept.
    fn staged_image(&self, cols: usize) -> Result<Arc<StagedX>> {
        let mut m = self.staged_x.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = m.get(&cols) {
            return Ok(s.clone());
        }
        // The image is the GEMV's XQ shared-memory layout: x_staging's bytes (x_staged.cuh's
        // staged_bytes).
        let buf: CudaSlice<u8> =
            self.stream.alloc_zeros(x_staging(cols).1).map_err(drv("allocating a staged x image"))?;
        let s = Arc::new(StagedX { buf, cols });
        m.insert(cols, s.clone());
        Ok(s)
    }

    /// x += down(silu(gate(n(x))) · up(n(x))) for one row, down reading its x as the SwiGLU
    /// launch staged it; `act` gets the SwiGLU output as well, `u` is scratch. Ok(false)
    /// (nothing launched) where the kernels do not cover the case: the caller then runs
    /// the separate launches.
    pub(crate) fn mlp_staged(
        &self,
        x: &mut CudaAct,
        (norm, eps): (&CudaSlice<f32>, f32),
        (gate, up, down): (&CudaMat, &CudaMat, &CudaMat),
        (u, tmp): (&mut CudaAct, &mut CudaAct),
        act: &mut CudaAct,
    ) -> Result<bool> {
        // One weight format for the three (the image's layout is the consumer's BITS, and the
        // producer is compiled with its own), and a width the image covers.
        let same_format = match (gate, up, down) {
            (
                CudaMat::Affine { defines: dg, .. },
                CudaMat::Affine { defines: du, .. },
                CudaMat::Affine { defines: dd, .. },
            ) => dg == du && dg == dd,
            _ => false,
        };
        let ffn = gate.rows();
        if !self.staged_x() || x.rows != 1 || !same_format || !staged_x_fits(ffn) || down.cols() != ffn {
            return Ok(false);
        }
        // Only where down's own staging is heavy: each of its threads would quantize at
        // least two 8-value parts. H200, same call: the 1B's 8192-wide down 2 269 / 2 249
        // tok/s staged against 2 202 / 2 202; SmolLM2's 1536-wide one (under one part per
        // thread) 2 061 / 2 060 against 2 225 / 2 204, where gate/up's staging epilogue
        // (a block barrier, warp 0 quantizing the step) costs more than down saves
        // (docs/perf.md, session 12).
        if ffn < 16 * 32 * gemv_warps() {
            return Ok(false);
        }
        let img = self.staged_image(ffn)?;
        let staged = self.gemv_launch(
            GemvIn::Norm(x, norm, eps),
            &[gate, up],
            &mut [&mut *act, &mut *u],
            GemvOut::Swiglu,
            GemvExtra::StageInto(&img),
        )?;
        if !staged {
            return Ok(false);
        }
        // The SwiGLU launch wrote act too: should down's staged kernel decline, the plain
        // one reads that.
        if !self.gemv_fused(GemvIn::Staged(&img), &[down], &mut [x], GemvOut::Add)? {
            self.fused_matmul_add(act, down, x, tmp)?;
        }
        self.staged_x_launches.fetch_add(1, Relaxed);
        Ok(true)
    }
}
