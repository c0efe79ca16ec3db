//! The synchronization probe (kernels/sync_probe.cu): what a grid barrier, a phase's x
//! staging after one, a cluster barrier and a cluster exchange cost on this device, the
//! numbers a persistent decode kernel's design rests on (docs/perf.md, session 7).

use super::device::{drv, Cuda, KArg};
use super::kernels;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{DevicePtr, LaunchConfig};

/// One synchronization primitive, repeated by every block of the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncProbe {
    /// A grid barrier over one block per SM.
    GridBarrier,
    /// A grid barrier, then each block reads a 2048-float vector and `parts` partials
    /// through L2, sums them and reduces the squares over the block.
    GridBarrierStaging { parts: usize },
    /// A barrier over one thread-block cluster of `cluster` blocks.
    ClusterBarrier { cluster: u32 },
    /// Each block of a cluster reduces its slice of the blocks' 2048-float vectors through
    /// distributed shared memory, between two cluster barriers.
    ClusterExchange { cluster: u32 },
}

/// One probe run: the time per round and each block's checksum.
pub struct ProbeRun {
    pub us_per_round: f64,
    /// The blocks' sums after one round (for the caller to check).
    pub out: Vec<f32>,
}

/// Value i of the probe's vector p: integers in [-2, 2], so every sum the kernel forms (up
/// to 2048 squares of sums of 33 vectors: below 2²⁴) is exact in any order.
pub fn probe_value(p: usize, i: usize) -> f32 {
    ((i + p) % 5) as f32 - 2.0
}

impl Cuda {
    /// Time `rounds` rounds of `probe`: (one launch of rounds + 1 − one of 1) / rounds, the
    /// median of three, so launch costs cancel.
    pub fn sync_probe(&self, probe: SyncProbe, rounds: usize) -> Result<ProbeRun> {
        let (mode, parts, cluster) = match probe {
            SyncProbe::GridBarrierStaging { parts } if parts > 32 => {
                return Err(Error::Unsupported(format!("sync probe: {parts} partial vectors (at most 32)")))
            }
            SyncProbe::GridBarrier => (0, 0, 1),
            SyncProbe::GridBarrierStaging { parts } => (1, parts, 1),
            SyncProbe::ClusterBarrier { cluster } => (2, 0, cluster),
            SyncProbe::ClusterExchange { cluster } => (3, 0, cluster),
        };
        if cluster > 1 && (!self.clusters || !2048usize.is_multiple_of(cluster as usize) || cluster > 16) {
            return Err(Error::Unsupported(format!("sync probe: clusters of {cluster} on this device")));
        }
        let f = self.function(kernels::file("sync_probe.cu"), &[], "sync_probe")?;
        // More than half an SM's shared memory: one block per SM.
        let smem = 120 * 1024;
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .and_then(|_| f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
            .map_err(drv("sync probe attributes"))?;
        // Grid modes: every SM; cluster modes: one cluster (its cost does not depend on the others).
        let blocks = if cluster > 1 { cluster as usize } else { self.sms };
        let vals: Vec<f32> = (0..=parts).flat_map(|p| (0..2048).map(move |i| probe_value(p, i))).collect();
        let vecs = self.upload(&vals, "sync probe vectors")?;
        let out = self.stream.alloc_zeros::<f32>(blocks).map_err(drv("sync probe output"))?;
        let mut counters = self.stream.alloc_zeros::<i32>(rounds + 1).map_err(drv("sync probe counters"))?;
        let mut run = |n: usize| -> Result<f64> {
            self.stream.memset_zeros(&mut counters).map_err(drv("sync probe counters"))?;
            self.stream.synchronize().map_err(drv("sync probe"))?;
            let args = [
                KArg::I32(mode),
                KArg::I32(n as i32),
                KArg::Ptr(counters.device_ptr(&self.stream).0),
                KArg::Ptr(vecs.device_ptr(&self.stream).0),
                KArg::I32(parts as i32),
                KArg::Ptr(out.device_ptr(&self.stream).0),
            ];
            let c = LaunchConfig { grid_dim: (1, 1, blocks as u32), block_dim: (256, 1, 1), shared_mem_bytes: smem };
            let t = std::time::Instant::now();
            match cluster {
                1 => self.launch(&f, c, &args, "sync probe launch")?,
                cs => self.launch_clustered(&f, c, &args, "sync probe launch", cs)?,
            }
            self.stream.synchronize().map_err(drv("sync probe"))?;
            Ok(t.elapsed().as_secs_f64() * 1e6)
        };
        run(1)?; // compiled, loaded, warm
        let mut per_round: Vec<f64> =
            (0..3).map(|_| Ok((run(rounds + 1)? - run(1)?) / rounds as f64)).collect::<Result<_>>()?;
        per_round.sort_by(f64::total_cmp);
        run(1)?;
        let out = self.stream.clone_dtoh(&out).map_err(drv("reading the sync probe"))?;
        Ok(ProbeRun { us_per_round: per_round[1], out })
    }
}
