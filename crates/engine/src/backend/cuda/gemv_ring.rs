//! Which decode GEMVs run ring-fed (kernels/gemv_ring.cuh: bulk copies of whole row steps
//! into a shared-memory ring, issued before the kernel waits for its input) and with what
//! shape: rows per warp, ring stages, shared memory and grid.
//!
//! The shape is chosen so that two such blocks fit on one SM (≤ 128 registers per thread
//! by the kernel's launch bounds, ≤ `RING_SMEM` bytes of shared memory each): the next
//! GEMV's block then starts beside the running one and streams its weights meanwhile.

use super::device::{drv, Cuda, CudaMat, KArg};
use super::fused::scales_ptr;
use crate::Result;
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig};

/// Ring-fed GEMVs unless `FERROLM_GEMV_RING=0`.
pub(super) const GEMV_RING_DEFAULT: bool = false;

/// Dynamic shared memory per block: half an SM's 228 KB, less the 1 KB the driver reserves
/// per block and the kernel's static shared memory (reduction scratch and barriers).
const RING_SMEM: usize = 113 * 1024 - 512;

/// A stage holds one row step; smaller steps (fewer rows per warp) give more stages.
const RING_STAGE_MAX: usize = 40 * 1024;

/// The kernel's stage count bound (RING_STAGES_MAX in gemv_ring.cuh).
const RING_STAGES_MAX: usize = 8;

/// How one decode GEMV runs ring-fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RingPlan {
    /// Rows per warp (the kernel's R).
    pub r: usize,
    pub stages: usize,
    pub smem: usize,
    pub grid: usize,
}

/// Bytes of x staged before the ring (ring_x_bytes in gemv_ring.cuh).
pub(super) fn ring_x_bytes(cols: usize, xq: bool) -> usize {
    let b = if xq { 2 * cols + cols / 32 * 4 + cols / 16 * 4 } else { 2 * cols };
    b.div_ceil(128) * 128
}

/// Whether every matrix's last, partial step of `rb` rows copies its scales (`srow` bytes a
/// row) in whole 16-byte pieces, as bulk copies need.
pub(super) fn whole_scale_pieces(rows: &[usize], rb: usize, srow: usize) -> bool {
    rows.iter().all(|n| ((n % rb) * srow).is_multiple_of(16))
}

/// The matrices of one decode GEMV launch, as the ring plan sees them.
pub(super) struct RingShape<'a> {
    /// Rows of each matrix (SwiGLU: gate and up, equal).
    pub rows: &'a [usize],
    pub cols: usize,
    pub bits: usize,
    pub group: usize,
    pub scale_bytes: usize,
    /// SwiGLU's pair: one step covers both matrices.
    pub two: bool,
}

/// The plan for `m`, with `r0` the rows per warp the register-fed kernel would use, `warps`
/// per block, `xq` the x staging, `sms` on the device. None where a step does not fit the
/// ring twice or a copy would break the 16-byte rules (then the register-fed kernel runs).
pub(super) fn ring_plan(m: &RingShape, r0: usize, warps: usize, xq: bool, sms: usize) -> Option<RingPlan> {
    if !(m.cols * m.bits).is_multiple_of(128) || !m.cols.is_multiple_of(m.group) {
        return None;
    }
    let rowbytes = m.cols * m.bits / 8;
    let srow = m.scale_bytes * (m.cols / m.group);
    let nm = if m.two { 2 } else { 1 };
    let xb = ring_x_bytes(m.cols, xq);
    // Of the rows per warp from r0 down, the one that keeps the most bytes in flight (ties:
    // more rows, which reuse each x chunk more).
    let mut best: Option<(usize, RingPlan)> = None;
    let mut r = r0.max(1);
    loop {
        let rb = warps * r;
        let stage = (nm * rb * (rowbytes + 2 * srow)).div_ceil(128) * 128;
        let steps: usize = if m.two { m.rows[0].div_ceil(rb) } else { m.rows.iter().map(|n| n.div_ceil(rb)).sum() };
        let pieces_ok = whole_scale_pieces(m.rows, rb, srow);
        if stage <= RING_STAGE_MAX && pieces_ok && xb + 2 * stage <= RING_SMEM && steps > 0 {
            let grid = steps.min(sms);
            let per_block = steps.div_ceil(grid);
            let stages = ((RING_SMEM - xb) / stage).min(RING_STAGES_MAX).min(per_block);
            let in_flight = stages * stage;
            if best.is_none_or(|(b, _)| in_flight > b) {
                best = Some((in_flight, RingPlan { r, stages, smem: xb + stages * stage, grid }));
            }
        }
        if r == 1 {
            return best.map(|(_, p)| p);
        }
        r /= 2;
    }
}

impl Cuda {
    /// Whether decode GEMVs run ring-fed where they fit.
    pub fn gemv_ring(&self) -> bool {
        self.gemv_ring.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Choose ring-fed or register-fed decode GEMVs (tests compare both on one device);
    /// ring-fed needs sm_90's bulk copies (`clusters`: the same devices), else it stays off.
    pub fn set_gemv_ring(&self, on: bool) {
        self.gemv_ring.store(on && self.clusters, std::sync::atomic::Ordering::Relaxed);
        self.decode_path_changed();
    }

    /// Launch ring-fed GEMV `f` (`args`: gemv.cu's GEMV_ARGS) with `plan`.
    pub(super) fn launch_gemv_ring(
        &self,
        f: &CudaFunction,
        plan: RingPlan,
        args: &mut Vec<KArg>,
        warps: usize,
    ) -> Result<()> {
        // Above 48 KB of dynamic shared memory must be asked for; the carveout preference
        // keeps the SM's shared memory at its largest so a second block fits beside.
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, plan.smem as i32)
            .and_then(|_| f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
            .map_err(drv("ring GEMV shared memory"))?;
        args.push(KArg::I32(plan.stages as i32));
        let c = LaunchConfig {
            grid_dim: (plan.grid as u32, 1, 1),
            block_dim: (32 * (warps as u32 + 1), 1, 1), // and the producer warp
            shared_mem_bytes: plan.smem as u32,
        };
        self.launch(f, c, args, "ring GEMV launch")
    }
}

/// Whether a matrix's device buffers meet the bulk copies' 16-byte alignment.
pub(super) fn ring_aligned(c: &Cuda, m: &CudaMat) -> bool {
    let CudaMat::Affine { words, scales, biases, .. } = m else { return false };
    [words.device_ptr(&c.stream).0, scales_ptr(c, scales), scales_ptr(c, biases)].iter().all(|a| a % 16 == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(rows: &[usize], cols: usize, two: bool, r0: usize) -> Option<RingPlan> {
        let m = RingShape { rows, cols, bits: 4, group: 64, scale_bytes: 2, two };
        ring_plan(&m, r0, 8, true, 132)
    }

    #[test]
    fn ring_plans_for_the_1b_decode_gemvs() {
        // q/k/v: 96 steps of 32 rows, one per block, all of it issued before the wait
        assert_eq!(
            plan(&[2048, 512, 512], 2048, false, 4),
            Some(RingPlan { r: 4, stages: 1, smem: 4864 + 36864, grid: 96 })
        );
        // gate/up: 8-row steps of both matrices, 5 in flight (92 KB) beat 2 of 16 rows (72 KB)
        assert_eq!(
            plan(&[8192, 8192], 2048, true, 2),
            Some(RingPlan { r: 1, stages: 5, smem: 4864 + 5 * 18432, grid: 132 })
        );
        // down: 8192-wide x (19 KB staged) leaves room for two 36 KB steps
        assert_eq!(
            plan(&[2048], 8192, false, 1),
            Some(RingPlan { r: 1, stages: 2, smem: 19456 + 2 * 36864, grid: 132 })
        );
        // every plan fits twice on an SM
        for p in [plan(&[128256], 2048, false, 4), plan(&[2048], 2048, false, 4)].into_iter().flatten() {
            assert!(p.smem <= RING_SMEM && p.stages >= 1 && p.stages <= RING_STAGES_MAX, "{p:?}");
        }
    }

    #[test]
    fn ring_plan_refuses_what_it_cannot_copy() {
        // 16-wide rows: 8 bytes of 4-bit weights, not a 16-byte chunk
        assert_eq!(plan(&[64], 16, false, 1), None);
        // a last step of 3 rows × 2 scales × 2 bytes = 12 bytes: not whole 16-byte pieces
        let m = RingShape { rows: &[67], cols: 128, bits: 4, group: 64, scale_bytes: 2, two: false };
        assert_eq!(ring_plan(&m, 1, 8, true, 132), None);
        // a step too large for two stages (x of 24K columns takes half the budget)
        assert_eq!(plan(&[4096], 24576, false, 1), None);
    }
}
