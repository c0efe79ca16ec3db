//! The head with its argmax in one launch (gemv.cu's gemv_nm_r4, argmax.cuh): a greedy
//! decode step's logits are stored as before, and each warp keeps the best row it stored,
//! so the step needs no separate argmax launch to read 128K logits back from L2 (the 1B
//! shape's argmax path was 5.9 µs of a ~490 µs step: its release and its reads; trace,
//! docs/perf.md, session 12). The same reductions and tie rule as sample.cu's argmax, so
//! the token is the same. `FERROLM_HEAD_ARGMAX=0` or `Cuda::set_head_argmax(false)` turns
//! it off.

use super::device::{ActBuf, Cuda, CudaAct, CudaMat};
use super::fused::{dev, GemvExtra, GemvIn, GemvOut};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;
use std::sync::atomic::Ordering::Relaxed;

/// On unless `FERROLM_HEAD_ARGMAX=0` (for A/B runs).
pub(super) fn head_argmax_default() -> bool {
    std::env::var("FERROLM_HEAD_ARGMAX").map_or(true, |v| v != "0")
}

impl Cuda {
    /// Whether a greedy step's argmax is found by the head GEMV itself.
    pub fn head_argmax_fused(&self) -> bool {
        self.head_argmax_on.load(Relaxed)
    }

    /// Turn the fused head argmax on or off (tests compare the two on one device).
    pub fn set_head_argmax(&self, on: bool) {
        self.head_argmax_on.store(on, Relaxed);
        self.decode_path_changed();
    }

    /// Fused head argmax launches queued or captured (tests check that it ran).
    pub fn head_argmax_launches(&self) -> usize {
        self.head_argmax_launches.load(Relaxed)
    }

    /// logits = head·n(x) for one row, and their argmax into out[0] (as f32; with `feed`
    /// also the next fed step's token and position, as `argmax_f32`), in one launch.
    /// Ok(false) (nothing launched) where the kernel does not cover the case.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_argmax(
        &self,
        x: &CudaAct,
        norm: &CudaSlice<f32>,
        eps: f32,
        head: &CudaMat,
        logits: &mut CudaAct,
        out: &mut CudaAct,
        feed: bool,
    ) -> Result<bool> {
        if !self.head_argmax_fused() || x.rows != 1 || logits.rows != 1 {
            return Ok(false);
        }
        let ActBuf::F32(ov) = &out.buf else {
            return Err(Error::Invalid("CUDA argmax writes an f32 output".into()));
        };
        let [pv, pi, done, tok, pos, hist] = self.argmax_sink_args(feed)?;
        let sink = [dev(self, ov), pv, pi, done, tok, pos, hist];
        let fused = self.gemv_launch(
            GemvIn::Norm(x, norm, eps),
            &[head],
            &mut [logits],
            GemvOut::Store,
            GemvExtra::Argmax(sink),
        )?;
        if fused {
            self.head_argmax_launches.fetch_add(1, Relaxed);
        }
        Ok(fused)
    }
}
