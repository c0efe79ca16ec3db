//! The synchronization probe (kernels/sync_probe.cu): what a grid barrier, a phase's x
//! staging after one, a cluster barrier and a cluster exchange cost on this device, the
//! numbers a persistent decode kernel's design rests on (docs/perf-log.md, session 7);
//! and the weight-stream probe (kernels/stream_probe.cu). The PDL release probe is in
//! release_probe.rs. Moved out of the engine (crates/engine/src/backend/cuda/probe.rs) into
//! the lab: methods of `Lab`, launching through the engine's `Context::launch`.

use crate::{drv, kernels, Lab};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{DevicePtr, LaunchConfig};
use ferrolm::backend::cuda::{KArg, Order};
use ferrolm::{Error, Result};

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

impl Lab<'_> {
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
        let f = self.function(kernels::sync_probe(), &[], "sync_probe")?;
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
                1 => self.launch(&f, c, &args, Order::Overlap, "sync probe launch")?,
                cs => self.launch(&f, c, &args, Order::OverlapClustered(cs), "sync probe launch")?,
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

/// One run of the weight-stream probe (kernels/stream_probe.cu): a token's weight bytes,
/// streamed by every SM's producer warp through a shared-memory ring while the consumer
/// warps stop at grid barriers between phases.
#[derive(Debug, Clone)]
pub struct StreamProbe {
    /// One token's phases in order: (weight bytes over the whole grid, a grid barrier after).
    pub segments: Vec<(usize, bool)>,
    /// Tokens per timed launch.
    pub tokens: usize,
    /// Bytes per bulk copy (a ring stage).
    pub chunk: usize,
    /// Ring stages (chunk · stages bytes of shared memory per block).
    pub stages: usize,
    /// Consumers read every landed byte from shared memory (and sum it for the check).
    pub work: bool,
    /// After each barrier the consumers spin this long before reading on (a phase's chain).
    pub delay_ns: u32,
    /// The spin sleeps (__nanosleep steps to its deadline) instead of a busy clock loop: a
    /// chain bound by latency, whose warps take no issue slots from the producer.
    pub spin_sleep: bool,
    /// The grid barriers count and poll without release/acquire (no fence; timing only).
    pub relaxed_barriers: bool,
    /// 0: the barriers are grid-wide; g: each is met by groups of g consecutive blocks only.
    pub barrier_group: usize,
    /// 0: no clusters; c: the grid in clusters of c blocks, each barrier the cluster's only
    /// (mbarriers at cluster scope: an exchange through DSMEM).
    pub cluster: usize,
    /// 0: one block per SM; n: n blocks only (n SMs streaming, the rest idle: how fast one
    /// SM pulls when the memory system is not the limit).
    pub blocks: usize,
    /// Lanes of the producer warp that issue the bulk copies, stage g by lane g mod this
    /// (1, or 2; 0 means 1).
    pub producers: usize,
    /// false: the segments' barriers are only the spin, each block's own stall (how much of
    /// a stall the ring hides when no block waits for another).
    pub grid_barriers: bool,
    /// The producer warp's 32 lanes copy 16-byte pieces (cp.async) instead of one lane
    /// issuing a bulk copy (TMA) per stage.
    pub lanes_copy: bool,
    /// The consumers never touch the ring (only the barriers and spins), and the producer
    /// reuses a stage once its last copy has landed: the stream decoupled by construction
    /// (bulk copies only; no sum to check).
    pub free_run: bool,
    /// Stage waits poll (mbarrier.test_wait) instead of try_wait, which may suspend.
    pub poll: bool,
    /// Each grid barrier is instead an all-to-all exchange of a 16-word-per-block vector
    /// by tagged words (stream_probe.cu's sp_tag_exchange; with grid barriers only).
    pub tagged: bool,
    /// The consumers do a 4-bit GEMV's math on the landed rows instead of the byte sum,
    /// with x staged from each tagged exchange's payloads (stream_probe.cu's `work` 3): the
    /// chain after an exchange measured, not spun. Tagged exchanges or no barriers only.
    pub dots: bool,
    /// Per segment, how many blocks (the first ones) stream it, 0 for all; empty: all
    /// (e.g. attention's cached K/V on the few blocks that attend).
    pub segment_blocks: Vec<usize>,
}

/// Per barrier of one traced token, averaged over the blocks and the token's barriers
/// (stream_probe.cu's trace).
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamTrace {
    /// From a block's arrival at a barrier to its release (µs).
    pub barrier_us: f64,
    /// From the end of the spin to the next stage's landing, where a segment follows (µs).
    pub data_wait_us: f64,
    /// Stages the producer had issued ahead of the consumers at the release.
    pub issued_ahead: f64,
    /// Of those, how many had landed.
    pub landed_ahead: f64,
    /// Releases at which every stage of the ring had landed (the producer stalled).
    pub ring_full: f64,
    /// The spin after the release, by %globaltimer (µs).
    pub spin_us: f64,
    /// The SM clock over the spins (their clock64 cycles over their %globaltimer time, MHz):
    /// a spin of n cycles lasts n over this, not over the nominal clock.
    pub spin_mhz: f64,
}

/// Which side of the traced launch finished last, per token of it (µs from the block's
/// start, means over the blocks, divided by the launch's tokens).
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamEnds {
    /// The producer's last copy landed.
    pub producer_us: f64,
    /// The consumers were done (their last barrier and spin included).
    pub consumers_us: f64,
}

/// How unevenly the blocks of the traced token reach its barriers: per barrier, each block's
/// arrival against the median arrival (µs). A stream whose SMs pull unequal shares of the
/// memory system makes every barrier wait for the slowest; if the same SMs are always the
/// late ones, work split by measured SM speed (or taken dynamically) would shorten it.
#[derive(Debug, Clone, Default)]
pub struct StreamSkew {
    /// Mean over barriers of (last arrival − median arrival).
    pub last_us: f64,
    /// Mean over barriers of (median arrival − first arrival).
    pub first_us: f64,
    /// Correlation over blocks of the mean lateness at even barriers with that at odd ones:
    /// near 1 when the late blocks are always the same, near 0 when lateness is random.
    pub corr: f64,
    /// The latest blocks on average: (SM, mean lateness µs), latest first (8 at most).
    pub latest: Vec<(u32, f64)>,
}

/// What one stream probe measured.
pub struct StreamRun {
    pub us_per_token: f64,
    /// Bytes streamed per token (each segment rounded up to 16 bytes per block).
    pub bytes_per_token: usize,
    /// The consumers' wrapping sum of every u32 they read over one token, and what the
    /// host expects (equal when `work`; 0 and 0 otherwise).
    pub sum: u32,
    pub want: u32,
    /// The last run's middle token, traced (none for a probe without barriers).
    pub trace: Option<StreamTrace>,
    /// The traced launch's producer and consumer end times.
    pub ends: StreamEnds,
    /// Blocks that streamed (one per SM each).
    pub blocks: usize,
    /// The traced token's arrival skew at its barriers (none without barriers).
    pub skew: Option<StreamSkew>,
}

/// Barriers per block the trace keeps (a token of five per layer has 81).
const TRACE_MAX: usize = 96;
/// u64 per traced barrier (stream_probe.cu's SP_REC).
const REC: usize = 8;
/// u64 per block after the barrier records: start, producer done, consumers done, SM
/// (stream_probe.cu's SP_ENDS).
const ENDS: usize = 4;
/// A tagged exchange's words per block, and the most words one of the 256 consumer threads
/// polls (stream_probe.cu's SP_XW, SP_XPER): the grid it covers.
const XW: usize = 16;
const XPER: usize = 9;
/// Bytes per row in dot mode (stream_probe.cu's SP_ROW): 4096 nibbles against x's 1024
/// int8 words (SP_XWORDS).
const DOT_ROW: usize = 2048;

/// x's word k in dot mode (stream_probe.cu's sp_x_word).
fn x_word(k: u32) -> i32 {
    (k.wrapping_mul(2_654_435_761) ^ 0x5bd1_e995) as i32
}

/// DP4A: c plus the dot of a's and b's four signed bytes.
fn dp4a(a: i32, b: i32, c: i32) -> i32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    (0..4).fold(c, |c, i| c.wrapping_add(i32::from(a[i] as i8) * i32::from(b[i] as i8)))
}

/// One row's dot in dot mode, as stream_probe.cu's sp_row_dot computes it (any order gives
/// the same wrapping sum): half group g of 16 bytes (4 words) at lane-major positions, its
/// nibble dots scaled by g % 7 + 1 and its x sum biased by g % 5.
fn row_dot(row: &[u32], x: &[i32]) -> i32 {
    let mut r = 0i32;
    for (piece, words) in row.chunks_exact(4).enumerate() {
        let (mut q4, mut xsum) = (0i32, 0i32);
        for (q, &w) in words.iter().enumerate() {
            let wi = piece * 4 + q;
            let (lo, hi) = (x[2 * wi], x[2 * wi + 1]);
            q4 = dp4a((w & 0x0F0F_0F0F) as i32, lo, q4);
            q4 = dp4a(((w >> 4) & 0x0F0F_0F0F) as i32, hi, q4);
            xsum = xsum.wrapping_add(dp4a(lo, 0x0101_0101, 0)).wrapping_add(dp4a(hi, 0x0101_0101, 0));
        }
        let g = (piece / 2) as i32;
        r = r.wrapping_add(q4.wrapping_mul(g % 7 + 1)).wrapping_add((g % 5).wrapping_mul(xsum));
    }
    r
}

fn fold_trace(rec: &[u64], stages: usize) -> Option<StreamTrace> {
    let recs: Vec<&[u64]> = rec.chunks_exact(REC).filter(|r| r[0] != 0).collect();
    if recs.is_empty() {
        return None;
    }
    let n = recs.len() as f64;
    let mean = |f: &dyn Fn(&[u64]) -> f64| recs.iter().map(|r| f(r)).sum::<f64>() / n;
    let waits: Vec<f64> = recs.iter().filter(|r| r[3] != 0).map(|r| r[3].saturating_sub(r[2]) as f64 / 1e3).collect();
    Some(StreamTrace {
        barrier_us: mean(&|r| r[1].saturating_sub(r[0]) as f64 / 1e3),
        data_wait_us: waits.iter().sum::<f64>() / waits.len().max(1) as f64,
        issued_ahead: mean(&|r| r[4] as f64),
        landed_ahead: mean(&|r| r[5] as f64),
        ring_full: mean(&|r| f64::from(u8::from(r[5] as usize >= stages))),
        spin_us: mean(&|r| r[2].saturating_sub(r[6]) as f64 / 1e3),
        spin_mhz: {
            let ns: u64 = recs.iter().map(|r| r[2].saturating_sub(r[6])).sum();
            recs.iter().map(|r| r[7]).sum::<u64>() as f64 * 1e3 / ns.max(1) as f64
        },
    })
}

/// The per-block [start, producer done, consumers done, SM] records after the barrier
/// records.
fn fold_ends(ends: &[u64], tokens: usize) -> StreamEnds {
    let n = (ends.len() / ENDS).max(1) as f64 * tokens.max(1) as f64;
    let side = |i: usize| ends.chunks_exact(ENDS).map(|e| e[i].saturating_sub(e[0]) as f64 / 1e3).sum::<f64>() / n;
    StreamEnds { producer_us: side(1), consumers_us: side(2) }
}

/// Arrival skew over the barriers every block recorded (`rec`: blocks × TRACE_MAX records;
/// `sms`: each block's SM).
fn fold_skew(rec: &[u64], sms: &[u32]) -> Option<StreamSkew> {
    let blocks = sms.len();
    let at = |b: usize, k: usize| rec[(b * TRACE_MAX + k) * REC];
    let nk = (0..TRACE_MAX).take_while(|&k| (0..blocks).all(|b| at(b, k) != 0)).count();
    if blocks < 2 || nk < 2 {
        return None;
    }
    let (mut last, mut first) = (0.0, 0.0);
    let mut late = vec![[0.0f64; 2]; blocks];
    for k in 0..nk {
        let mut a: Vec<u64> = (0..blocks).map(|b| at(b, k)).collect();
        a.sort_unstable();
        let med = a[blocks / 2] as f64;
        last += (a[blocks - 1] as f64 - med) / 1e3;
        first += (med - a[0] as f64) / 1e3;
        for (b, l) in late.iter_mut().enumerate() {
            l[k % 2] += (at(b, k) as f64 - med) / 1e3;
        }
    }
    let halves = [nk.div_ceil(2) as f64, (nk / 2) as f64];
    let (x, y): (Vec<f64>, Vec<f64>) = late.iter().map(|l| (l[0] / halves[0], l[1] / halves[1])).unzip();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (mx, my) = (mean(&x), mean(&y));
    let cov: f64 = x.iter().zip(&y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let var = |v: &[f64], m: f64| v.iter().map(|a| (a - m) * (a - m)).sum::<f64>();
    let corr = cov / (var(&x, mx) * var(&y, my)).sqrt().max(f64::MIN_POSITIVE);
    let mut latest: Vec<(u32, f64)> = late.iter().zip(sms).map(|(l, &sm)| (sm, (l[0] + l[1]) / nk as f64)).collect();
    latest.sort_by(|a, b| b.1.total_cmp(&a.1));
    latest.truncate(8);
    Some(StreamSkew { last_us: last / nk as f64, first_us: first / nk as f64, corr, latest })
}

/// The stream probe's weights (and their host copy, for the expected sums), kept across
/// runs: making and uploading 700 MB per run would cost more than the runs.
pub struct StreamWeights {
    words: Vec<u32>,
    dev: cudarc::driver::CudaSlice<u32>,
}

/// Slack beyond a layout's bytes when the weights are made, so that layouts with more
/// segments (each rounded up to 16 bytes per block) fit the same buffer.
const STREAM_SLACK_PER_BLOCK: usize = 16 * 128;

/// Word i of the probe's weight buffer.
fn stream_word(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ (i >> 13) as u32
}

impl Lab<'_> {
    /// Time the weight stream: (one launch of tokens + 1 − one of 1) / tokens, median of
    /// three, so launch costs cancel; one block of 8 consumer warps and a producer warp per SM.
    /// `weights` is made on first use (or when a layout outgrows it) and kept for later runs.
    pub fn stream_probe(&self, p: &StreamProbe, weights: &mut Option<StreamWeights>) -> Result<StreamRun> {
        // One block per SM, or the first `blocks` SMs' worth (each SM's own ingest limit).
        let blocks = if p.blocks == 0 { self.sms } else { p.blocks };
        if blocks > self.sms {
            return Err(Error::Unsupported(format!("stream probe: {blocks} blocks on {} SMs", self.sms)));
        }
        if !self.clusters {
            // clusters: sm_90+, as the bulk copies and expect_tx the probe is built on
            return Err(Error::Unsupported(format!("stream probe: bulk copies need sm_90 or newer ({})", self.arch)));
        }
        if p.dots && (!p.work || p.free_run || !p.chunk.is_multiple_of(DOT_ROW)) {
            return Err(Error::Unsupported(format!(
                "stream probe: row dots read every stage (work, not free-running) of whole {DOT_ROW}-byte rows (chunk {})",
                p.chunk
            )));
        }
        if p.dots && p.segments.iter().any(|s| s.1) && !(p.tagged && p.grid_barriers) {
            return Err(Error::Unsupported("stream probe: row dots take x from tagged exchanges (or none)".into()));
        }
        if p.free_run && (p.work || p.lanes_copy) {
            return Err(Error::Unsupported("stream probe: a free-running stream is read by no one".into()));
        }
        if p.chunk == 0 || !p.chunk.is_multiple_of(16) || p.stages == 0 || p.stages > 64 {
            return Err(Error::Unsupported(format!("stream probe: {} stages of {} bytes", p.stages, p.chunk)));
        }
        let ring = p.chunk * p.stages;
        // More than half an SM's shared memory (one block per SM), within what a block may have.
        let smem = ring.max(120 * 1024);
        // (+ the kernel's static shared memory: barriers, sums, dot mode's 2 × 4 KB of x)
        if smem + 10240 > self.smem_optin {
            return Err(Error::Unsupported(format!("stream probe: a {ring}-byte ring on this device")));
        }
        // Segment s: bytes per block, rounded up to 16 (to whole rows in dot mode), laid out
        // one after the other.
        let unit = if p.dots { DOT_ROW } else { 16 };
        if !p.segment_blocks.is_empty()
            && (p.segment_blocks.len() != p.segments.len() || p.segment_blocks.iter().any(|&b| b > blocks))
        {
            return Err(Error::Unsupported(format!(
                "stream probe: block counts for {} of {} segments, or over {blocks} blocks",
                p.segment_blocks.len(),
                p.segments.len()
            )));
        }
        let mut segs = Vec::new();
        let mut layout = Vec::new();
        let mut off = 0usize;
        for (s, &(bytes, barrier)) in p.segments.iter().enumerate() {
            let few = p.segment_blocks.get(s).copied().unwrap_or(0);
            let streamers = if few == 0 { blocks } else { few };
            let per = bytes.div_ceil(streamers).div_ceil(unit) * unit;
            layout.push((off, per * streamers));
            segs.push(off as i64);
            let kind: i64 = match (barrier, p.grid_barriers, p.tagged) {
                (false, ..) => 0,
                (true, true, false) => 1,
                (true, false, _) => 2,
                (true, true, true) => 3,
            };
            segs.push(per as i64 | (kind << 32));
            segs.push(few as i64);
            off += per * streamers;
        }
        if p.producers > 2 || (p.producers > 1 && p.lanes_copy) {
            return Err(Error::Unsupported(format!(
                "stream probe: {} producer lanes (1 or 2, bulk copies only)",
                p.producers
            )));
        }
        if p.cluster > 8 {
            // larger clusters need the non-portable cluster size attribute, not set here
            return Err(Error::Unsupported(format!("stream probe: clusters of {} (8 at most)", p.cluster)));
        }
        if p.cluster > 0 && (p.barrier_group > 0 || !p.grid_barriers) {
            return Err(Error::Unsupported(format!(
                "stream probe: clusters of {} with barrier groups or spins alone",
                p.cluster
            )));
        }
        if p.tagged && (p.cluster > 0 || p.barrier_group > 0 || !p.grid_barriers || blocks > XPER * 256 / XW) {
            return Err(Error::Unsupported(format!(
                "stream probe: tagged exchanges replace grid barriers (no clusters, groups or spins alone; ≤ {} blocks)",
                XPER * 256 / XW
            )));
        }
        if p.barrier_group > blocks {
            return Err(Error::Unsupported(format!("stream probe: barrier groups of {} blocks", p.barrier_group)));
        }
        let groups = if p.barrier_group == 0 { 1 } else { blocks.div_ceil(p.barrier_group) };
        let barriers = if p.grid_barriers { p.segments.iter().filter(|s| s.1).count() } else { 0 };
        if weights.as_ref().is_none_or(|w| w.words.len() < off / 4) {
            *weights = None; // the old buffer goes first
            let words: Vec<u32> = (0..(off + STREAM_SLACK_PER_BLOCK * blocks) / 4).map(stream_word).collect();
            let dev = self.upload(&words, "stream probe weights")?;
            *weights = Some(StreamWeights { words, dev });
        }
        let Some(w) = weights.as_ref() else { unreachable!("made above") };
        let want = if p.dots {
            // Every row of every block's segments against x (the same x at every phase: the
            // payloads it comes from are the exchanged words' indices).
            let x: Vec<i32> = (0..(DOT_ROW / 2) as u32).map(x_word).collect();
            let rows = layout.iter().flat_map(|&(o, bytes)| (0..bytes / DOT_ROW).map(move |r| o + r * DOT_ROW));
            let token = rows.fold(0u32, |a, r| a.wrapping_add(row_dot(&w.words[r / 4..(r + DOT_ROW) / 4], &x) as u32));
            token.wrapping_mul(p.tokens as u32 + 1)
        } else if p.work {
            w.words[..off / 4].iter().fold(0u32, |a, &x| a.wrapping_add(x)).wrapping_mul(p.tokens as u32 + 1)
        } else {
            0
        };
        let w = &w.dev;
        let segs_d = self.upload(&segs, "stream probe segments")?;
        let mut counters = self
            .stream
            .alloc_zeros::<i32>((p.tokens + 1) * barriers.max(1) * groups)
            .map_err(drv("stream probe counters"))?;
        let mut out = self.stream.alloc_zeros::<u32>(1).map_err(drv("stream probe sum"))?;
        // The tagged exchanges' two vectors (stream_probe.cu's SP_XW words per block each).
        let mut xvec = self.stream.alloc_zeros::<u64>(2 * XW * blocks).map_err(drv("stream probe vectors"))?;
        let mut trace_d =
            self.stream.alloc_zeros::<u64>(blocks * (TRACE_MAX * REC + ENDS)).map_err(drv("stream probe trace"))?;
        let f = self.function(kernels::stream_probe(), &[], "stream_probe")?;
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(drv("stream probe attributes"))?;
        // 8 consumer warps and the producer warp (SP_NW + 1), one block per SM.
        let c =
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (9 * 32, 1, 1), shared_mem_bytes: smem as u32 };
        if p.cluster > 0 {
            // The clusters must all run at once, or the token's time is two waves' (on the
            // H200, 33 clusters of 4 one-block-per-SM blocks do not: not every GPC holds a
            // whole number of them).
            let fit = self.max_active_clusters(&f, c, p.cluster as u32)?;
            if fit * p.cluster < blocks {
                return Err(Error::Unsupported(format!(
                    "stream probe: {} clusters of {} at once, not all {blocks} blocks",
                    fit, p.cluster
                )));
            }
        }
        let khz = self
            .ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map_err(drv("reading the SM clock"))?;
        let delay_cycles = (u64::from(p.delay_ns) * khz as u64 / 1_000_000).min(i32::MAX as u64) as i32;
        // The timed runs record nothing; the last run traces its middle token.
        let mut run = |n: usize, traced: bool| -> Result<f64> {
            self.stream.memset_zeros(&mut counters).map_err(drv("stream probe counters"))?;
            self.stream.memset_zeros(&mut trace_d).map_err(drv("stream probe trace"))?;
            self.stream.memset_zeros(&mut out).map_err(drv("stream probe sum"))?;
            self.stream.memset_zeros(&mut xvec).map_err(drv("stream probe vectors"))?;
            self.stream.synchronize().map_err(drv("stream probe"))?;
            let args = [
                KArg::Ptr(w.device_ptr(&self.stream).0),
                KArg::Ptr(segs_d.device_ptr(&self.stream).0),
                KArg::I32(p.segments.len() as i32),
                KArg::I32(n as i32),
                KArg::I32(p.chunk as i32),
                KArg::I32(p.stages as i32),
                KArg::I32(if p.free_run {
                    2
                } else if p.dots {
                    3
                } else {
                    i32::from(p.work)
                }),
                KArg::I32(delay_cycles),
                KArg::I32(i32::from(p.spin_sleep)),
                KArg::I32(i32::from(p.relaxed_barriers)),
                KArg::I32(p.barrier_group as i32),
                KArg::I32(p.cluster as i32),
                KArg::I32(i32::from(p.lanes_copy)),
                KArg::I32(i32::from(p.poll)),
                KArg::I32(p.producers.max(1) as i32),
                KArg::Ptr(counters.device_ptr(&self.stream).0),
                KArg::Ptr(xvec.device_ptr(&self.stream).0),
                KArg::Ptr(out.device_ptr(&self.stream).0),
                KArg::Ptr(if traced { trace_d.device_ptr(&self.stream).0 } else { 0 }),
                KArg::I32((n / 2) as i32),
                KArg::I32(TRACE_MAX as i32),
            ];
            let t = std::time::Instant::now();
            match p.cluster {
                0 => self.launch(&f, c, &args, Order::Overlap, "stream probe launch")?,
                cs => self.launch(&f, c, &args, Order::OverlapClustered(cs as u32), "stream probe launch")?,
            }
            self.stream.synchronize().map_err(drv("stream probe"))?;
            Ok(t.elapsed().as_secs_f64() * 1e6)
        };
        run(1, false)?; // compiled, loaded, warm
        let mut per_token: Vec<f64> = (0..3)
            .map(|_| Ok((run(p.tokens + 1, false)? - run(1, false)?) / p.tokens as f64))
            .collect::<Result<_>>()?;
        per_token.sort_by(f64::total_cmp);
        run(p.tokens + 1, true)?;
        let sum = self.stream.clone_dtoh(&out).map_err(drv("reading the stream probe"))?[0];
        let rec = self.stream.clone_dtoh(&trace_d).map_err(drv("reading the stream probe's trace"))?;
        let (rec, ends) = rec.split_at(blocks * TRACE_MAX * REC);
        let trace = fold_trace(rec, p.stages);
        let sms: Vec<u32> = ends.chunks_exact(ENDS).map(|e| e[3] as u32).collect();
        let skew = fold_skew(rec, &sms);
        let ends = fold_ends(ends, p.tokens + 1);
        Ok(StreamRun { us_per_token: per_token[1], bytes_per_token: off, sum, want, trace, ends, blocks, skew })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_folds_to_means_over_recorded_barriers() {
        // Two recorded barriers (ns), one empty slot, 4 stages: the second released with
        // the whole ring landed and no segment after it (no landing time).
        let rec = [
            1_000, 2_000, 3_000, 3_500, 4, 1, 2_500, 1_000, //
            10_000, 13_000, 13_000, 0, 4, 4, 13_000, 0, //
            0, 0, 0, 0, 0, 0, 0, 0,
        ];
        let t = fold_trace(&rec, 4).unwrap();
        assert_eq!(t.barrier_us, 2.0);
        assert_eq!(t.data_wait_us, 0.5);
        assert_eq!(t.issued_ahead, 4.0);
        assert_eq!(t.landed_ahead, 2.5);
        assert_eq!(t.ring_full, 0.5);
        assert_eq!(t.spin_us, 0.25);
        assert_eq!(t.spin_mhz, 2000.0); // 1 000 cycles in 500 ns
        assert!(fold_trace(&[0; 16], 4).is_none());
    }

    #[test]
    fn the_ends_fold_to_per_token_means_over_blocks() {
        // Two blocks, a launch of 2 tokens: producers done 4 and 6 µs in, consumers 8 and 10.
        let e = fold_ends(&[1_000, 5_000, 9_000, 7, 2_000, 8_000, 12_000, 9], 2);
        assert_eq!(e.producer_us, 2.5);
        assert_eq!(e.consumers_us, 4.5);
    }

    #[test]
    fn the_skew_names_the_blocks_that_arrive_last() {
        // Three blocks (SMs 5, 6, 7), two barriers: block 2 arrives 3 µs after the median
        // at both, block 0 1 µs before it.
        let mut rec = vec![0u64; 3 * TRACE_MAX * REC];
        for (b, arr) in [[9_000u64, 19_000], [10_000, 20_000], [13_000, 23_000]].iter().enumerate() {
            for (k, &t) in arr.iter().enumerate() {
                rec[(b * TRACE_MAX + k) * REC] = t;
            }
        }
        let s = fold_skew(&rec, &[5, 6, 7]).unwrap();
        assert_eq!(s.last_us, 3.0);
        assert_eq!(s.first_us, 1.0);
        assert_eq!(s.latest[0], (7, 3.0));
        assert_eq!(s.latest[2], (5, -1.0));
        assert!(s.corr > 0.99, "the same blocks late at both barriers: {}", s.corr);
        assert!(fold_skew(&rec[..], &[5]).is_none());
    }
}
