//! The PDL release probe (kernels/sync_probe.cu's pdl_primary / pdl_dependent): when a
//! dependent kernel's blocks are released relative to the end of the primary they wait on,
//! and whether loads issued before the release land before it. A method of `Lab`,
//! launching through the engine's `Context::launch`.

use crate::{drv, kernels, Lab};
use cudarc::driver::{DevicePtr, LaunchConfig};
use ferrolm::backend::cuda::{KArg, Order};
use ferrolm::{Error, Result};

/// One PDL release measurement (kernels/sync_probe.cu's pdl_primary / pdl_dependent).
#[derive(Debug, Clone, Copy)]
pub struct ReleaseRun {
    /// Median over blocks and rounds of (the block's release − the primary's last block
    /// end), µs.
    pub release_us: f64,
    /// The same for the last block of each round (what a kernel's chain waits for), median.
    pub last_release_us: f64,
    /// Median of (loads landed − release) over blocks, µs (negative: landed before it).
    pub landed_after_us: f64,
}

impl Lab<'_> {
    /// The PDL release when each dependent block has `loads` (≤ 16) 16-byte loads per
    /// thread of cold memory in flight, issued `lead_ns` before the primary ends; `l2`:
    /// L2 prefetches instead of loads. `rounds` launch pairs.
    pub fn pdl_release_probe(&self, loads: usize, l2: bool, lead_ns: u64, rounds: usize) -> Result<ReleaseRun> {
        if !self.pdl || loads > 16 {
            return Err(Error::Unsupported("PDL release probe: needs PDL (sm_90) and at most 16 loads".into()));
        }
        let prim = self.function(kernels::sync_probe(), &[], "pdl_primary")?;
        let dep = self.function(kernels::sync_probe(), &[], "pdl_dependent")?;
        let blocks = self.sms;
        let per_round = blocks * 256 * 16; // uint4 per round: 64 KB per block
        let rotate = 16; // rounds of distinct memory (138 MB on 132 SMs, over twice L2): each round's loads are cold
        let junk = self.stream.alloc_zeros::<u32>(4 * per_round * rotate).map_err(drv("release probe memory"))?;
        let ends = self.stream.alloc_zeros::<u64>(blocks).map_err(drv("release probe ends"))?;
        let times = self.stream.alloc_zeros::<u64>(2 * blocks).map_err(drv("release probe times"))?;
        let out = self.stream.alloc_zeros::<u32>(1).map_err(drv("release probe out"))?;
        let (mut rel, mut last, mut landed) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rounds + 1 {
            // The device clock: a primary launch with an end in the past returns at once
            // and records the time.
            let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            self.launch(
                &prim,
                one,
                &[KArg::Ptr(0), KArg::Ptr(ends.device_ptr(&self.stream).0)],
                Order::Overlap,
                "release probe clock",
            )?;
            let t = self.stream.clone_dtoh(&ends).map_err(drv("release probe clock"))?[0];
            let end_ns = t + 200_000; // 200 µs ahead: both kernels launched and resident by then
            let issue = end_ns - lead_ns;
            let junk_at = junk.device_ptr(&self.stream).0 + (16 * per_round * (r % rotate)) as u64;
            let c = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let prim_args = [KArg::Ptr(end_ns), KArg::Ptr(ends.device_ptr(&self.stream).0)];
            self.launch(&prim, c, &prim_args, Order::Overlap, "release probe")?;
            let args = [
                KArg::Ptr(junk_at),
                KArg::I32(loads as i32),
                KArg::I32(i32::from(l2)),
                KArg::Ptr(issue),
                KArg::Ptr(times.device_ptr(&self.stream).0),
                KArg::Ptr(out.device_ptr(&self.stream).0),
            ];
            self.launch(&dep, c, &args, Order::Overlap, "release probe")?;
            self.stream.synchronize().map_err(drv("release probe"))?;
            if r == 0 {
                continue; // compiled, loaded, warm
            }
            let e = self.stream.clone_dtoh(&ends).map_err(drv("release probe ends"))?;
            let tm = self.stream.clone_dtoh(&times).map_err(drv("release probe times"))?;
            let end = *e.iter().max().expect("blocks") as f64;
            let mut last_r = f64::MIN;
            for b in 0..blocks {
                let (t1, t2) = (tm[2 * b] as f64, tm[2 * b + 1] as f64);
                rel.push((t1 - end) / 1e3);
                landed.push((t2 - t1) / 1e3);
                last_r = last_r.max((t1 - end) / 1e3);
            }
            last.push(last_r);
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Ok(ReleaseRun { release_us: med(&mut rel), last_release_us: med(&mut last), landed_after_us: med(&mut landed) })
    }
}
