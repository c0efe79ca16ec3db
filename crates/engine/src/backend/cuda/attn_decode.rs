//! Decode attention (one query row, kernels/attention_decode.cu): RoPE of q and of the new
//! k, the cache write of the new k/v, and attention over the cache with its split merge
//! (through a cluster's shared memory, or global memory for deep caches), in one launch.

use super::device::{drv, Cuda, CudaAct, CudaKv, KArg};
use super::fused::dev;
use super::kernels;
use crate::backend::Rope;
use crate::config::RopeStyle;
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;

/// Cached positions per decode attention split: small, so even a short context spreads
/// over many blocks (heads × splits), each a few loads deep.
const DECODE_CHUNK: usize = 64;
/// Most splits attention_decode.cu's merge holds (SPLITS_MAX there).
const DECODE_SPLITS_MAX: usize = 1024;

/// Most blocks of a decode attention cluster (8: the portable cluster size).
const ATTN_CLUSTER_MAX: usize = 8;

/// Most blocks per decode attention cluster: ATTN_CLUSTER_MAX by default (sm_90+), or
/// `FERROLM_ATTN_CLUSTER=N` with N in 2..=8 (fewer, longer splits: a tuning knob), or 0
/// (`FERROLM_ATTN_CLUSTER=0`: every split merges through global memory, for comparisons
/// and older GPUs' path).
fn attention_cluster_max() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| match std::env::var("FERROLM_ATTN_CLUSTER").ok().and_then(|v| v.parse::<usize>().ok()) {
        Some(0) => 0,
        Some(n) if (2..=ATTN_CLUSTER_MAX).contains(&n) => n,
        _ => ATTN_CLUSTER_MAX,
    })
}

/// Most query heads of a GQA group per decode attention block: 1, or 2..=4 with
/// `FERROLM_ATTN_QB` (see `attention_decode`).
fn attention_qb_max() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("FERROLM_ATTN_QB").ok().and_then(|v| v.parse().ok()).unwrap_or(1).clamp(1, 4))
}

impl Cuda {
    /// Decode attention (one query row) with RoPE of q and of the new k, the cache write of
    /// the new k/v, and the split merge: one launch. q, k, v are the unrotated projections.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_decode(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        out: &mut CudaAct,
    ) -> Result<()> {
        let heads = q.cols / kv.head_dim;
        let n_kv = kv.width / kv.head_dim;
        // Query heads per block: one, at every depth (the op kernel is compiled for it:
        // QB_MAX). Up to 4 of a GQA group per block read each K/V row once for all of them,
        // but give each lane 4× the scoring chain on a quarter of the blocks: one head per
        // block measured faster at 2K, 8K and 16K cached (1B 1 485 → 1 691, 1 267 → 1 424,
        // 1 032 → 1 144 tok/s; SmolLM2 at 7 424 1 083 → 1 318; H200, docs/perf.md, session
        // 10): the group's blocks read the same rows at about the same time, from L2.
        // `FERROLM_ATTN_QB` (2..=4) allows more (for comparisons; tested by gpu-check).
        let group = heads / n_kv;
        let qb = (1..=attention_qb_max()).rev().find(|d| group.is_multiple_of(*d)).unwrap_or(1);
        // Caches deeper than one cluster covers take several rounds of positions per split:
        // there, scoring a round's positions together (SCORE_BATCH) measured faster (1B at
        // 8191 cached 23.6 → 22.2 µs), and slower at 512 cached (6.4 → 7.0 µs; H200, perf.md).
        let deep = kv.max_seq > kernels::ATTN_DEEP_POSITIONS;
        // Registers for exactly qb query heads (QB_MAX): the kernel compiled for 4 spilled at
        // qb = 1 (168 registers, the 3-blocks-per-SM cap), and the registers saved hold a
        // second round of K/V loads issued before the wait (attention_decode.cuh, KV_AHEAD).
        // A deep cache's kernel beside a q/k/v GEMV of at least half the SMs' blocks (32
        // rows each; the 1B's 3 072 rows: 96 of 132) is the register-capped one (ATT_CAP):
        // twice its blocks fit beside q/k/v's, and four per SM (1B at depth 8192 +1.6%;
        // SmolLM2's 960-row q/k/v, 30 blocks, lost 0.8% with it; H200, docs/perf.md).
        let qkv_rows = (heads + 2 * n_kv) * kv.head_dim;
        let capped = deep && qb == 1 && qkv_rows / 32 >= self.sms / 2;
        let defines = kernels::attention_decode_defines(qb, deep, capped);
        let f = self.function(kernels::file("attention_decode.cu"), &defines, "attention_decode")?;
        // Positions per split: 64, or more where the blocks would not all be resident at
        // once (a second wave would start only as the first ends; longer splits keep more
        // loads in flight instead) or the merge's shared memory would overflow.
        let resident = f.occupancy_max_active_blocks_per_multiprocessor(128, 0, None).unwrap_or(3).max(1) as usize;
        let max_splits = (resident * self.sms / (heads / qb)).clamp(1, DECODE_SPLITS_MAX);
        let chunk = DECODE_CHUNK.max(kv.max_seq.div_ceil(max_splits));
        let splits = kv.max_seq.div_ceil(chunk);
        // A cache of up to 8 · 128 positions: one cluster of up to 8 blocks per head, whose
        // splits merge through shared memory into the output (no global round trip; splits
        // of up to 128 positions: a second load round costs less than the global merge).
        // Deeper caches keep one wave of single blocks merging through global memory:
        // clusters there (7 of 7 splits per head at 8K) did not all fit one wave and the
        // 1B attention at 8191 cached went 28 → 54 µs (H200, docs/perf.md).
        let one_cluster = !deep && splits > 1;
        let (cs, splits, chunk) = match self.clusters && attention_cluster_max() > 0 && one_cluster {
            true => {
                let cs = attention_cluster_max().min(splits);
                (cs, cs, kv.max_seq.div_ceil(cs))
            }
            false => (1, splits, chunk),
        };
        let freqs = self.rope_freqs_for(rope)?;
        let mut scratch = self.attn_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let key = (heads * splits, kv.head_dim);
        if let std::collections::hash_map::Entry::Vacant(e) = scratch.entry(key) {
            let ml = self.stream.alloc_zeros::<f32>(2 * key.0).map_err(drv("allocating attention scratch"))?;
            let acc =
                self.stream.alloc_zeros::<f32>(key.0 * kv.head_dim).map_err(drv("allocating attention scratch"))?;
            let done = self.stream.alloc_zeros::<i32>(heads).map_err(drv("allocating attention scratch"))?;
            e.insert((ml, acc, done));
        }
        let (ml, acc, done) = scratch.get_mut(&key).expect("inserted above");
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let p0 = &st.as_ref().ok_or_else(|| Error::Invalid("CUDA attention without a staged position".into()))?.pos_dev;
        let (h, nkv, hd, qbi, chunk) = (heads as i32, n_kv as i32, kv.head_dim as i32, qb as i32, chunk as i32);
        let mut args = self.qkv_cache_args(q, (k, v), kv, layer).to_vec();
        args.extend([
            KArg::Ptr(freqs),
            KArg::F32(rope.linear),
            KArg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            dev(self, ml),
            dev(self, acc),
            dev(self, out.bf16()),
            dev(self, done),
            KArg::I32(h),
            KArg::I32(nkv),
            KArg::I32(hd),
            KArg::I32(qbi),
            dev(self, p0),
            KArg::I32(chunk),
            KArg::I32(cs as i32),
        ]);
        let c = LaunchConfig {
            grid_dim: ((heads / qb) as u32, 1, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // Matches attention_decode.cu; scratch sized [heads, splits] for this cache, `done`
        // (one counter per block column) zeroed at allocation and reset by the kernel.
        match cs {
            1 => self.launch(&f, c, &args, "attention launch"),
            _ => self.launch_clustered(&f, c, &args, "attention launch", cs as u32),
        }
    }
}
