//! The attention half of a one-token decode layer as one launch (kernels/attention_block.cuh):
//! q/k/v from the normalized residual, RoPE, the cache write, attention and x += o·att, in
//! thread-block clusters that each take some of a kv group's query heads. It replaces three
//! op-path launches (q/k/v GEMV, attention, o GEMV) and their two boundaries, and measured
//! slower than them (1B 1 567 vs 2 033 tok/s, H200, docs/perf.md session 9), so it is off:
//! `FERROLM_ATTN_BLOCK=1` or `set_attention_block` turns it on; where it does not apply
//! (dense or mixed weights, the shapes `attention_block_plan` checks, no clusters) the op
//! path runs.

use super::device::{drv, ActBuf, Cuda, CudaAct, CudaKv, CudaMat, KArg};
use super::fused::{act_ptr, dev, scales_ptr, x_staging, MAX_COLS};
use super::kernels;
use crate::backend::Rope;
use crate::config::RopeStyle;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};
use std::sync::atomic::Ordering::Relaxed;

/// Cluster sizes tried, largest first (16 is non-portable; the H200 runs it).
const CLUSTERS: [usize; 4] = [16, 8, 4, 2];

/// `FERROLM_ATTN_BLOCK_CS=N` (N of CLUSTERS): that cluster size only (a tuning knob).
fn forced_cluster() -> Option<usize> {
    static N: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("FERROLM_ATTN_BLOCK_CS").ok().and_then(|v| v.parse().ok()).filter(|n| CLUSTERS.contains(n))
    })
}

/// Off unless `FERROLM_ATTN_BLOCK=1`.
pub(super) fn attention_block_default() -> bool {
    std::env::var("FERROLM_ATTN_BLOCK").is_ok_and(|v| v == "1")
}

impl Cuda {
    /// Whether one-token decode layers run their attention half as one launch where it applies.
    pub fn attention_block_on(&self) -> bool {
        self.attn_block.load(Relaxed)
    }

    /// Choose the attention block or the op path (tests compare both on one device).
    pub fn set_attention_block(&self, on: bool) {
        self.attn_block.store(on, Relaxed);
        self.decode_path_changed();
    }

    /// Attention block launches so far (queued or captured).
    pub fn attention_block_launches(&self) -> usize {
        self.attn_block_launches.load(Relaxed)
    }

    /// `Backend::attention_block` for one row: x += wo·attention(q, k, v) with q/k/v =
    /// (wq, wk, wv)·norm(x), RoPE and the cache write inside. Ok(false) where it does not
    /// apply: the caller runs the op path.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fused_attention_block(
        &self,
        x: &mut CudaAct,
        (gains, eps): (&CudaSlice<f32>, f32),
        (wq, wk, wv, wo): (&CudaMat, &CudaMat, &CudaMat, &CudaMat),
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        (q, k, v, att): (&mut CudaAct, &mut CudaAct, &mut CudaAct, &mut CudaAct),
    ) -> Result<bool> {
        if !self.attention_block_on() || !self.clusters || x.rows != 1 {
            return Ok(false);
        }
        let (
            CudaMat::Affine { defines, rows: qrows, cols: hidden, bits, group, .. },
            CudaMat::Affine { defines: dk, rows: krows, cols: kcols, .. },
            CudaMat::Affine { defines: dv, rows: vrows, cols: vcols, .. },
            CudaMat::Affine { defines: dout, rows: orows, cols: ocols_all, .. },
        ) = (wq, wk, wv, wo)
        else {
            return Ok(false);
        };
        let (hidden, bits, group, hd) = (*hidden, *bits as usize, *group, kv.head_dim);
        let (heads, n_kv) = (qrows / hd, kv.width / hd);
        let same_format = defines == dk && defines == dv && defines == dout;
        let shapes = (*krows, *vrows, *kcols, *vcols, *orows, *ocols_all)
            == (kv.width, kv.width, hidden, hidden, hidden, *qrows);
        let bufs = matches!(
            (&x.buf, &q.buf, &k.buf, &v.buf, &att.buf),
            (ActBuf::F32(_), ActBuf::Bf16(_), ActBuf::Bf16(_), ActBuf::Bf16(_), ActBuf::Bf16(_))
        ) && x.cols == hidden
            && (q.cols, k.cols, v.cols, att.cols) == (*qrows, kv.width, kv.width, *qrows);
        if !same_format || !shapes || !bufs || n_kv == 0 || !heads.is_multiple_of(n_kv) || hidden > MAX_COLS {
            return Ok(false);
        }
        let deep = kv.max_seq > kernels::ATTN_DEEP_POSITIONS;
        let (xq, smem_x) = x_staging(hidden);
        let shape = BlockShape { heads, n_kv, hd, hidden, bits, group, xq, deep };
        let Some(plan) = self.attention_block_plan(defines, &shape, smem_x)? else {
            return Ok(false);
        };
        let Plan { cs, hs, .. } = plan;
        let f = self.function(kernels::file("gemv.cu"), &plan.defines, "attention_block")?;
        let mut scratch = self.attn_block_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let key = (n_kv * hs, hidden);
        if let std::collections::hash_map::Entry::Vacant(e) = scratch.entry(key) {
            let part =
                self.stream.alloc_zeros::<f32>(key.0 * hidden).map_err(drv("allocating attention block partials"))?;
            let done =
                self.stream.alloc_zeros::<i32>(CLUSTERS[0]).map_err(drv("allocating attention block counters"))?;
            e.insert((part, done));
        }
        let (part, done) = &scratch[&key];
        let freqs = self.rope_freqs_for(rope)?;
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let p0 = &st.as_ref().ok_or_else(|| Error::Invalid("CUDA attention without a staged position".into()))?.pos_dev;
        let mut args: Vec<KArg> = Vec::with_capacity(36);
        for m in [wq, wk, wv, wo] {
            let CudaMat::Affine { words, scales, biases, .. } = m else { unreachable!("checked above") };
            args.extend([dev(self, words), KArg::Ptr(scales_ptr(self, scales)), KArg::Ptr(scales_ptr(self, biases))]);
        }
        args.extend([
            KArg::Ptr(act_ptr(self, x)),
            KArg::Ptr(gains.device_ptr(&self.stream).0),
            KArg::F32(eps),
            KArg::I32(hidden as i32),
            KArg::Ptr(act_ptr(self, q)),
            KArg::Ptr(act_ptr(self, k)),
            KArg::Ptr(act_ptr(self, v)),
            KArg::Ptr(act_ptr(self, att)),
            dev(self, &kv.k[layer]),
            dev(self, &kv.v[layer]),
            KArg::Ptr(freqs),
            KArg::F32(rope.linear),
            KArg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            dev(self, part),
            dev(self, done),
            KArg::I32(heads as i32),
            KArg::I32(n_kv as i32),
            KArg::I32(hd as i32),
            dev(self, p0),
            KArg::I32(kv.max_seq.div_ceil(cs) as i32),
            KArg::I32(cs as i32),
            KArg::I32(hs as i32),
        ]);
        let c = LaunchConfig {
            grid_dim: ((n_kv * hs * cs) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        // Matches attention_block.cuh's attention_block; `done` zeroed at allocation and
        // reset by the kernel; pos0 + 1 ≤ max_seq is checked by the model.
        self.launch_clustered(&f, c, &args, "attention block launch", cs as u32)?;
        self.attn_block_launches.fetch_add(1, Relaxed);
        Ok(true)
    }

    /// How the attention block runs a shape: the largest cluster size (of CLUSTERS) that
    /// splits the hidden rows evenly, with the most clusters per kv group (hs, dividing the
    /// GQA group, at most ~2 blocks per SM, at most 4 query heads per cluster), such that
    /// every cluster runs at once (one waiting for a second wave would stall the step: the
    /// H200 holds 15 clusters of 8 one-per-SM blocks, not 16); None where no plan fits.
    /// Chosen once per shape (the occupancy queries are not free).
    fn attention_block_plan(&self, format: &[String], s: &BlockShape, smem_x: usize) -> Result<Option<Plan>> {
        let mut key = format.to_vec();
        key.push(format!("{s:?}"));
        if let Some(p) = self.attn_block_plans.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(p.clone());
        }
        let mut found = None;
        for c in candidates(s, self.sms, forced_cluster()) {
            let defines = kernels::attention_block_defines(format, s.xq, c.qc, s.deep, c.r);
            let f = self.function(kernels::file("gemv.cu"), &defines, "attention_block")?;
            f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                .map_err(drv("attention block cluster size"))?;
            let smem = smem_x.max(c.smem_o);
            let lc = LaunchConfig {
                grid_dim: ((s.n_kv * c.hs * c.cs) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // A size the device refuses is not an error here: try the next.
            if self.max_active_clusters(&f, lc, c.cs as u32).unwrap_or(0) >= s.n_kv * c.hs {
                found = Some(Plan { cs: c.cs, hs: c.hs, smem, defines });
                break;
            }
        }
        self.attn_block_plans.lock().unwrap_or_else(|e| e.into_inner()).insert(key, found.clone());
        Ok(found)
    }
}

/// A launch shape the kernel can run, before the device says whether its clusters fit:
/// clusters of `cs` blocks, `hs` per kv group with `qc` query heads each, `r` q/k/v rows
/// per warp, `smem_o` bytes to stage the heads' o columns.
#[derive(Debug, PartialEq)]
struct Candidate {
    cs: usize,
    hs: usize,
    qc: usize,
    r: usize,
    smem_o: usize,
}

/// The shapes to try, best first: the largest cluster size (of CLUSTERS, or only `forced`)
/// that splits the hidden rows evenly, then the most clusters per kv group (dividing the
/// GQA group, at most ~2 blocks per SM), where attend() and the o phase fit: a head of 64,
/// 128 or 256 dims over 8-dim lane parts, registers for up to 4 query heads; the heads' o
/// columns whole groups and 16-byte chunks (at most 32 per row), staged like the q/k/v
/// input (the same XQ choice).
fn candidates(s: &BlockShape, sms: usize, forced: Option<usize>) -> Vec<Candidate> {
    let qb = s.heads / s.n_kv;
    let mut out = Vec::new();
    if ![64, 128, 256].contains(&s.hd) || s.bits < 2 {
        return out;
    }
    for cs in CLUSTERS.into_iter().filter(|cs| s.hidden.is_multiple_of(*cs) && forced.is_none_or(|f| f == *cs)) {
        for hs in (1..=qb).rev().filter(|h| qb.is_multiple_of(*h) && s.n_kv * h * cs <= 2 * sms) {
            let qc = qb / hs;
            let ocols = qc * s.hd;
            let (xq_o, smem_o) = x_staging(ocols);
            let fits = qc <= 4
                && ocols.is_multiple_of(s.group)
                && (ocols * s.bits).is_multiple_of(128)
                && ocols * s.bits / 128 <= 32
                && xq_o == s.xq;
            if fits {
                // q/k/v rows per warp: a rank's rows over its 4 warps, in one step or few.
                let per_warp = (qc * s.hd + 2 * s.hd).div_ceil(cs * 4);
                let r = [4, 2, 1].into_iter().find(|r| *r <= per_warp).unwrap_or(1);
                out.push(Candidate { cs, hs, qc, r, smem_o });
            }
        }
    }
    out
}

/// What decides an attention block plan besides the weight format.
#[derive(Debug)]
struct BlockShape {
    heads: usize,
    n_kv: usize,
    hd: usize,
    hidden: usize,
    bits: usize,
    group: usize,
    xq: bool,
    deep: bool,
}

/// An attention block launch's shape: clusters of `cs` blocks, `hs` clusters per kv group,
/// `smem` bytes of dynamic shared memory, the kernel's defines.
#[derive(Clone)]
pub(crate) struct Plan {
    cs: usize,
    hs: usize,
    smem: usize,
    defines: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(heads: usize, n_kv: usize, hidden: usize, bits: usize, group: usize) -> BlockShape {
        BlockShape { heads, n_kv, hd: 64, hidden, bits, group, xq: true, deep: false }
    }

    #[test]
    fn candidates_for_real_shapes() {
        let first =
            |s: &BlockShape, forced| candidates(s, 132, forced).into_iter().next().map(|c| (c.cs, c.hs, c.qc, c.r));
        // Llama-3.2-1B (32/8 heads, 4-bit g64): two clusters of 16 per kv group, 2 heads
        // each, q/k/v in one step of 4 rows per warp; 8 KV heads × 4 × 16 would be 512 blocks.
        assert_eq!(first(&shape(32, 8, 2048, 4, 64), None), Some((16, 2, 2, 4)));
        // SmolLM2 (9/3 heads, Q4_1 as group 32): a cluster per query head.
        assert_eq!(first(&shape(9, 3, 576, 4, 32), None), Some((16, 3, 1, 2)));
        // A forced cluster size is the only one tried.
        assert!(candidates(&shape(32, 8, 2048, 4, 64), 132, Some(8)).iter().all(|c| c.cs == 8));
        // Query heads per cluster never exceed attend()'s registers (4), and o's columns
        // stay whole groups: 128-wide groups need 2 heads of 64 per cluster.
        for c in candidates(&shape(32, 8, 2048, 4, 128), 132, None) {
            assert!(c.qc <= 4 && (c.qc * 64) % 128 == 0, "{c:?}");
        }
        // Head dims attend() does not take, and 1-bit weights: nothing.
        assert!(candidates(&BlockShape { hd: 96, ..shape(32, 8, 3072, 4, 64) }, 132, None).is_empty());
        assert!(candidates(&shape(32, 8, 2048, 1, 64), 132, None).is_empty());
    }
}
