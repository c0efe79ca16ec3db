//! The MLP half of a decode layer as one launch (gemv.cu's `ffn`, FFN=1 variants): norm → gate/up → SwiGLU, then down + residual add, with the blocks counting
//! themselves in between the phases instead of a kernel boundary, so down's first weight
//! tiles stream while the slowest blocks finish gate/up. The first step toward a
//! persistent decode kernel; off unless `FERROLM_FFN_FUSED=1` (or `set_ffn_fused`) until it
//! has been measured against the two launches it replaces.

use super::device::{drv, ActBuf, Cuda, CudaAct, CudaMat, KArg};
use super::fused::{dev, gemv_warps, rows_per_warp, scales_ptr, x_staging, GEMV_LOADS};
use super::kernels;
use crate::Result;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};
use std::sync::atomic::Ordering::Relaxed;

impl Cuda {
    /// Whether `Backend::mlp` runs decode rows as one fused launch.
    pub fn ffn_fused_enabled(&self) -> bool {
        self.ffn_fused.load(Relaxed)
    }

    /// Turn the fused MLP launch on or off (tests compare both on one device).
    pub fn set_ffn_fused(&self, on: bool) {
        self.ffn_fused.store(on, Relaxed);
    }

    /// x += down(silu(gate(n(x))) · up(n(x))) for one row, n the RMSNorm with `gains`, as
    /// one launch; `act` gets the SwiGLU output. Ok(false) when the kernels do not cover
    /// the case (the caller then runs the two launches).
    pub fn ffn_fused(
        &self,
        x: &mut CudaAct,
        gains: &CudaSlice<f32>,
        eps: f32,
        (gate, up, down): (&CudaMat, &CudaMat, &CudaMat),
        act: &mut CudaAct,
    ) -> Result<bool> {
        let (
            CudaMat::Affine { defines, words: wg, scales: sg, biases: bg, rows: ffn, cols: hidden, bits, .. },
            CudaMat::Affine { defines: du, words: wu, scales: su, biases: bu, rows: ffn_u, cols: hidden_u, .. },
            CudaMat::Affine { defines: dd, words: wd, scales: sd, biases: bd, rows: hidden_d, cols: ffn_d, .. },
        ) = (gate, up, down)
        else {
            return Ok(false);
        };
        let shapes_ok = (ffn, hidden) == (ffn_u, hidden_u) && (hidden, ffn) == (hidden_d, ffn_d);
        let bufs_ok = matches!((&x.buf, &act.buf), (ActBuf::F32(_), ActBuf::Bf16(_)))
            && (x.rows, x.cols, act.rows, act.cols) == (1, *hidden, 1, *ffn);
        let (xq_in, smem_in) = x_staging(*hidden);
        let (xq_act, smem_act) = x_staging(*ffn);
        // One XQ define serves both phases' staging.
        if !shapes_ok || !bufs_ok || defines != du || defines != dd || xq_in != xq_act {
            return Ok(false);
        }
        let ru = rows_per_warp(*ffn, hidden * *bits as usize / 128, GEMV_LOADS / 2);
        let rd = rows_per_warp(*hidden, ffn * *bits as usize / 128, GEMV_LOADS);
        let nw = gemv_warps();
        let mut defines = defines.clone();
        defines.push(format!("XQ={}", u8::from(xq_in)));
        defines.extend(["FFN=1".into(), format!("FFN_RU={ru}"), format!("FFN_RD={rd}")]);
        if nw != 8 {
            defines.push(format!("NW={nw}"));
        }
        let f = self.function(kernels::file("gemv.cu"), &defines, "ffn")?;
        let smem = smem_in.max(smem_act);
        let threads = 32 * nw as u32;
        // Every block must be resident at once (they wait for each other): never more than
        // the occupancy allows, which gemv_grid's cap already is.
        let steps = ffn.div_ceil(nw * ru).max(hidden.div_ceil(nw * rd));
        let blocks = steps.min(self.gemv_grid(&f, threads, smem));
        let mut sync = self.ffn_sync.lock().unwrap_or_else(|e| e.into_inner());
        if sync.is_none() {
            *sync = Some(self.stream.alloc_zeros::<i32>(2).map_err(drv("allocating the MLP counters"))?);
        }
        let sync = sync.as_ref().expect("set above");
        let (ActBuf::F32(xv), ActBuf::Bf16(av)) = (&x.buf, &act.buf) else { unreachable!("checked above") };
        let args = [
            dev(self, wg),
            KArg::Ptr(scales_ptr(self, sg)),
            KArg::Ptr(scales_ptr(self, bg)),
            dev(self, wu),
            KArg::Ptr(scales_ptr(self, su)),
            KArg::Ptr(scales_ptr(self, bu)),
            dev(self, wd),
            KArg::Ptr(scales_ptr(self, sd)),
            KArg::Ptr(scales_ptr(self, bd)),
            dev(self, xv),
            KArg::Ptr(gains.device_ptr(&self.stream).0),
            KArg::F32(eps),
            KArg::I32(*hidden as i32),
            dev(self, av),
            KArg::I32(*ffn as i32),
            dev(self, sync),
        ];
        let c =
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
        // Matches gemv.cu's FFN_ARGS; the counters are zeroed at allocation and reset by
        // the kernel's last block.
        self.launch(&f, c, &args, "fused MLP launch")?;
        Ok(true)
    }
}
