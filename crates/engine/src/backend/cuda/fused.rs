//! The fused decode ops (one token): RMSNorm folded into the GEMV that consumes it, q/k/v
//! in one launch, gate/up/SwiGLU in one launch, the residual add in the o/down GEMV's
//! epilogue (kernels/gemv.cu); RoPE with the cache write in one launch (kernels/
//! attention.cu; decode attention with its split merge: attn_decode.rs). A decode step is then 6 launches per
//! layer instead of 16: at SmolLM2 size the step is launch-bound, so that is the speed.
//! Anything these kernels do not cover (several rows, dense weights, mixed formats) goes
//! through the unfused ops, which are the same math.

use super::device::{drv, ActBuf, Cuda, CudaAct, CudaKv, CudaMat, DevScales, KArg};
pub(super) use super::gemv_ring::GEMV_RING_DEFAULT;
use super::gemv_ring::{ring_aligned, ring_plan, RingShape};
use super::kernels;
use super::staged::{staged_x_fits, StagedX};
use crate::backend::{Backend, Rope};
use crate::config::RopeStyle;
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig};

/// How the fused GEMV reads its input.
pub(crate) enum GemvIn<'a> {
    /// bf16 activations `[1, cols]`.
    Bf16(&'a CudaAct),
    /// The f32 residual stream, RMS-normalized with these gains and eps on load.
    Norm(&'a CudaAct, &'a CudaSlice<f32>, f32),
    /// `cols` values already staged by their producer (`StagedX`, x_staged.cuh).
    Staged(&'a StagedX),
}

/// What a decode GEMV launch does beyond its mode (gemv.cu's OUT 4 and 5).
#[derive(Clone, Copy)]
pub(crate) enum GemvExtra<'a> {
    None,
    /// SwiGLU that also writes its output as the next GEMV's staged x (staged.rs).
    StageInto(&'a StagedX),
    /// A one-matrix f32 store (the head) that also finds the argmax of what it stores:
    /// argmax.cuh's sink (out, partials, done counter, then a fed step's token, position
    /// and history, or nulls), for at most `ARGMAX_FUSED_BLOCKS_PER_SM` blocks per SM.
    Argmax([KArg; 7]),
}

/// Most blocks of a head GEMV fused with its argmax (its partials' scratch size): as many
/// as `gemv_grid` gives, 8 per SM at most.
const ARGMAX_FUSED_BLOCKS_PER_SM: usize = 8;

/// What the fused GEMV does with its dot products.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemvOut {
    /// Store into each matrix's output (bf16 or f32, the output's type).
    Store,
    /// Add into the f32 residual stream.
    Add,
    /// silu(mat 0) · mat 1 into one bf16 output.
    Swiglu,
}

/// Most blocks the argmax kernel uses (its scratch size).
const ARGMAX_BLOCKS: usize = 128;

/// Largest input width whose bf16 copy fits the 48 KB of shared memory a launch gets
/// without opting in.
pub(super) const MAX_COLS: usize = 24 * 1024;

/// A device buffer as a kernel argument.
pub(super) fn dev<T>(c: &Cuda, s: &CudaSlice<T>) -> KArg {
    KArg::Ptr(s.device_ptr(&c.stream).0)
}

pub(super) fn scales_ptr(c: &Cuda, s: &DevScales) -> u64 {
    match s {
        DevScales::Half(v) => v.device_ptr(&c.stream).0,
        DevScales::F32(v) => v.device_ptr(&c.stream).0,
    }
}

pub(super) fn act_ptr(c: &Cuda, a: &CudaAct) -> u64 {
    match &a.buf {
        ActBuf::Bf16(v) => v.device_ptr(&c.stream).0,
        ActBuf::F32(v) => v.device_ptr(&c.stream).0,
    }
}

/// 16-byte weight loads per lane per GEMV tile (LIF in gemv.cu; half of them per matrix
/// for SwiGLU's two).
pub(super) const GEMV_LOADS: usize = 8;

/// Warps per GEMV block (NW in gemv.cu): 8, or 4 or 16 with `FERROLM_GEMV_WARPS` (for
/// tuning). 8 measured best at the 1B shape (H200, docs/perf.md): each block stages x (from
/// L2) once, so fewer, larger blocks read less of it; the 128K-row head alone was 7% faster
/// at 4, less than the layers' gain.
pub(super) fn gemv_warps() -> usize {
    static NW: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *NW.get_or_init(|| match std::env::var("FERROLM_GEMV_WARPS").as_deref() {
        Ok("4") => 4,
        Ok("16") => 16,
        _ => 8,
    })
}

/// Rows per warp: more rows reuse each x chunk more, but leave fewer warps. At least as
/// many as keep a lane's tile of `loads` loads (per matrix) within a row's chunks (`chunks`
/// 16-byte chunks per row): a 2048-wide 4-bit row is 64 chunks, 2 per lane, so a one-row
/// tile of 8 would leave 3/4 of its loads empty. `FERROLM_GEMV_R` forces a value (for
/// tuning).
pub(super) fn rows_per_warp(total_rows: usize, chunks: usize, loads: usize) -> usize {
    if let Some(r) = forced_rows_per_warp() {
        return r;
    }
    let by_rows = match total_rows {
        n if n >= 16384 => 4,
        n if n >= 8192 => 2,
        _ => 1,
    };
    let per_lane = chunks.div_ceil(32).clamp(1, loads);
    by_rows.max(loads / per_lane).min(4)
}

/// Rows per warp for gate/up (SwiGLU): 4, unless `FERROLM_GEMV_R` forces one. ptxas gives
/// gemv_ns_r4 128 registers against 154 for r2 (sm_90, 4-bit g64), so two blocks fit per
/// SM instead of one. H200, same call: 1B (synthetic) 2 154 / 2 159 tok/s against 2 091 /
/// 2 108 at r2; SmolLM2's gate/up (576 wide) was at 4 already (docs/perf.md, session 11).
fn swiglu_rows_per_warp() -> usize {
    forced_rows_per_warp().unwrap_or(4)
}

/// Rows per warp and K slices (gemv.cu's KS) for a decode GEMV: one that adds into the
/// residual at 1 row per warp (the 1B shape's down; rows of a multiple of 64 chunks, 2048
/// wide and up at 4-bit) goes to 2 rows per warp over two slices, the same rows per block
/// with each x chunk read from shared memory for 2 rows. H200, same call, 1B (synthetic): 2 194 / 2 203 tok/s against
/// 2 138 / 2 134 without (docs/perf.md, session 11); SmolLM2's 1536-wide down stays as it
/// was. `FERROLM_GEMV_KS=0` turns it off (for A/B runs and the GPU tests' second pass).
pub(super) fn k_slices(mode: GemvOut, r: usize, chunks: usize, nw: usize) -> (usize, usize) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("FERROLM_GEMV_KS").map_or(true, |v| v != "0"));
    match (mode, r) {
        (GemvOut::Add, 1)
            if on && chunks.is_multiple_of(64) && nw.is_multiple_of(2) && forced_rows_per_warp().is_none() =>
        {
            (2, 2)
        }
        _ => (r, 1),
    }
}

/// `FERROLM_GEMV_R` (1, 2 or 4): rows per warp for every decode GEMV, for tuning.
fn forced_rows_per_warp() -> Option<usize> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| {
        std::env::var("FERROLM_GEMV_R").ok().and_then(|v| v.parse().ok()).filter(|r| [1, 2, 4].contains(r))
    })
}

/// Rows per warp `r` for a GEMV that adds into the residual (o, down), halved while its
/// blocks (`rows` / (`nw`·r)) would number under a quarter of the SMs: SmolLM2's o and down
/// (576 rows) at 2 instead of 4 measured 2 097 against 1 981 tok/s, while the 1B's (2048
/// rows, 64 blocks at 4 for o, down at 1) are fastest as they are (2 050 against 1 998 with
/// both at 2; H200, docs/perf.md, session 9).
pub(super) fn spread_rows(rows: usize, r: usize, nw: usize, sms: usize) -> usize {
    let mut r = r;
    while r > 1 && rows.div_ceil(nw * r) < sms / 4 {
        r /= 2;
    }
    r
}

/// Which decode GEMVs `spread_rows` applies to: `FERROLM_GEMV_SPREAD=0` none, `1` the add
/// GEMVs (the default), `2` every one (a tuning knob; at SmolLM2 it also moves q/k/v's
/// 960 rows from 4 rows per warp to 2).
fn gemv_spread() -> u8 {
    static S: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *S.get_or_init(|| match std::env::var("FERROLM_GEMV_SPREAD").as_deref() {
        Ok("0") => 0,
        Ok("2") => 2,
        _ => 1,
    })
}

/// Rows per warp for the GEMVs that add into the residual (o, down) when
/// `FERROLM_GEMV_R_ADD` is 1, 2 or 4 (a tuning knob: o's 64 blocks leave half the SMs idle
/// at the 1B shape); else `rows_per_warp`'s choice.
fn add_rows_per_warp() -> Option<usize> {
    static R: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *R.get_or_init(|| {
        std::env::var("FERROLM_GEMV_R_ADD").ok().and_then(|v| v.parse().ok()).filter(|r| [1, 2, 4].contains(r))
    })
}

/// How the decode GEMV stages an input of `cols` values in shared memory: (XQ, bytes).
/// int16 x with DP2A (gemv.cu's XQ) needs whole 32-value x blocks and room for the block
/// scales and sums beside x; else bf16 x.
pub(super) fn x_staging(cols: usize) -> (bool, usize) {
    let xq_bytes = 2 * cols + cols / 32 * 4 + cols / 16 * 4;
    match cols.is_multiple_of(32) && xq_bytes <= 2 * MAX_COLS && gemv_int16_x() {
        true => (true, xq_bytes),
        false => (false, cols * 2),
    }
}

/// gemv.cu's defines for a weight format's (bits, group, scale) `defines`: the x staging
/// (XQ) and the warps per block where not the default.
pub(super) fn gemv_defines(defines: &[String], xq: bool) -> Vec<String> {
    let mut d = defines.to_vec();
    d.push(format!("XQ={}", u8::from(xq)));
    if gemv_warps() != 8 {
        d.push(format!("NW={}", gemv_warps()));
    }
    d
}

/// Whether the decode GEMV stages x as int16 blocks and uses DP2A (gemv.cu's XQ; the
/// default) or multiplies bf16 x in f32; `FERROLM_GEMV_XQ=0` picks the latter (for
/// comparisons; both stay tested).
fn gemv_int16_x() -> bool {
    static XQ: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *XQ.get_or_init(|| std::env::var("FERROLM_GEMV_XQ").map_or(true, |v| v != "0"))
}

impl Cuda {
    /// One fused decode GEMV over up to three matrices sharing the input. Ok(false) when the
    /// kernels do not cover the case (the caller then runs the unfused ops).
    pub(crate) fn gemv_fused(
        &self,
        input: GemvIn,
        mats: &[&CudaMat],
        outs: &mut [&mut CudaAct],
        mode: GemvOut,
    ) -> Result<bool> {
        self.gemv_launch(input, mats, outs, mode, GemvExtra::None)
    }

    /// `gemv_fused` with what `extra` adds: a SwiGLU launch that also stages the next
    /// GEMV's x (gemv.cu's OUT 4; the caller checked the formats), or a head that also
    /// finds its argmax (OUT 5). Ok(false) where the kernels do not cover it.
    pub(crate) fn gemv_launch(
        &self,
        input: GemvIn,
        mats: &[&CudaMat],
        outs: &mut [&mut CudaAct],
        mode: GemvOut,
        extra: GemvExtra,
    ) -> Result<bool> {
        let stage_into = match extra {
            GemvExtra::StageInto(img) => Some(img),
            _ => None,
        };
        let argmax = matches!(extra, GemvExtra::Argmax(_));
        // The input's (width, address), whether it is normalized on load or arrives staged.
        let (cols_in, xp, in_ok) = match input {
            GemvIn::Bf16(x) => (x.cols, act_ptr(self, x), x.rows == 1 && matches!(x.buf, ActBuf::Bf16(_))),
            GemvIn::Norm(x, ..) => (x.cols, act_ptr(self, x), x.rows == 1 && matches!(x.buf, ActBuf::F32(_))),
            GemvIn::Staged(s) => (s.cols, s.buf.device_ptr(&self.stream).0, staged_x_fits(s.cols)),
        };
        let staged_in = matches!(input, GemvIn::Staged(_));
        if !in_ok || cols_in > MAX_COLS || mats.is_empty() || mats.len() > 3 || mats.len() != outs.len() {
            return Ok(false);
        }
        if (staged_in || !matches!(extra, GemvExtra::None)) && self.gemv_ring() {
            return Ok(false); // the ring-fed kernels are plain GEMVs
        }
        let Some(CudaMat::Affine { defines, .. }) = mats.first().copied() else { return Ok(false) };
        for (m, o) in mats.iter().zip(outs.iter()) {
            let CudaMat::Affine { defines: d, cols, rows, .. } = m else { return Ok(false) };
            let out_ok = matches!(
                (mode, &o.buf),
                (GemvOut::Add, ActBuf::F32(_)) | (GemvOut::Store, _) | (GemvOut::Swiglu, ActBuf::Bf16(_))
            );
            if d != defines || *cols != cols_in || o.rows != 1 || !out_ok {
                return Ok(false);
            }
            if mode != GemvOut::Swiglu && o.cols != *rows {
                return Err(Error::Invalid(format!("CUDA GEMV: output of {} columns for {rows} rows", o.cols)));
            }
        }
        // One output type per launch (the kernel's store is per variant).
        let f32_out = matches!(outs[0].buf, ActBuf::F32(_));
        if outs.iter().any(|o| matches!(o.buf, ActBuf::F32(_)) != f32_out) {
            return Ok(false);
        }
        if mode == GemvOut::Swiglu
            && (mats.len() != 2 || mats[0].rows() != mats[1].rows() || outs[0].cols != mats[0].rows())
        {
            return Ok(false);
        }
        let launched_rows: usize =
            if mode == GemvOut::Swiglu { mats[0].rows() } else { mats.iter().map(|m| m.rows()).sum() };
        let CudaMat::Affine { bits, .. } = mats[0] else { unreachable!("checked above") };
        let chunks = cols_in * *bits as usize / 128;
        let r = self.gemv_rows_per_warp(mode, launched_rows, chunks);
        // A staging SwiGLU is compiled at 4 rows per warp (gemv.cu's gemv_nz_r4), its block
        // steps whole 32-value x blocks of an image as wide as its rows.
        if let Some(img) = stage_into {
            let nw = gemv_warps();
            let fits = mode == GemvOut::Swiglu && r == 4 && (nw * r).is_multiple_of(32);
            if !fits || img.cols != launched_rows || !launched_rows.is_multiple_of(nw * r) {
                return Ok(false);
            }
        }
        // The fused argmax is compiled for a head: one matrix, f32 logits, 4 rows per warp.
        if argmax && (mode != GemvOut::Store || !f32_out || mats.len() != 1 || r != 4) {
            return Ok(false);
        }
        let out_kind = match (mode, f32_out) {
            (GemvOut::Store, true) if argmax => "m",
            (GemvOut::Swiglu, _) if stage_into.is_some() => "z",
            (GemvOut::Swiglu, _) => "s",
            (GemvOut::Add, _) => "a",
            (GemvOut::Store, true) => "f",
            (GemvOut::Store, false) => "b",
        };
        let (xq, smem) = x_staging(cols_in);
        let nw = gemv_warps();
        let plan = match self.gemv_ring() && mats.iter().all(|m| ring_aligned(self, m)) {
            true => {
                let CudaMat::Affine { group, scales: scales0, .. } = mats[0] else { unreachable!("checked above") };
                let shape = RingShape {
                    rows: &mats.iter().map(|m| m.rows()).collect::<Vec<_>>(),
                    cols: cols_in,
                    bits: *bits as usize,
                    group: *group,
                    scale_bytes: if matches!(scales0, DevScales::F32(_)) { 4 } else { 2 },
                    two: mode == GemvOut::Swiglu,
                };
                ring_plan(&shape, r, nw, xq, self.sms)
            }
            false => None,
        };
        let (r, ks) = match plan {
            Some(p) => (p.r, 1),
            None => k_slices(mode, r, chunks, nw),
        };
        let kind = if plan.is_some() { "gemvr" } else { "gemv" };
        let slices = if ks > 1 { format!("k{ks}") } else { String::new() };
        let in_kind = match input {
            GemvIn::Norm(..) => "n",
            GemvIn::Bf16(_) => "b",
            GemvIn::Staged(_) => "q",
        };
        let name = format!("{kind}_{in_kind}{out_kind}_r{r}{slices}");
        let mut gd = gemv_defines(defines, xq);
        if plan.is_some() {
            gd.push("RING=1".into()); // ring-fed kernels are a variant of their own (gemv.cu)
        }
        let f = self.function(kernels::file("gemv.cu"), &gd, &name)?;
        // Kernel arguments: (w, scales, biases, out, rows) × 3, then x, gains, eps, cols.
        // Unused matrix slots repeat the first with 0 rows; a staging SwiGLU (OUT 4) takes
        // its image as slot 2's output.
        let mut args: Vec<KArg> = Vec::with_capacity(19);
        let mut blocks = 0;
        for i in 0..3 {
            let (m, o) = if i < mats.len() { (mats[i], &*outs[i]) } else { (mats[0], &*outs[0]) };
            let CudaMat::Affine { words, scales, biases, rows, .. } = m else { unreachable!("checked above") };
            let n = if i < mats.len() { *rows } else { 0 };
            args.extend([
                dev(self, words),
                KArg::Ptr(scales_ptr(self, scales)),
                KArg::Ptr(scales_ptr(self, biases)),
                match (i, stage_into) {
                    (2, Some(img)) => KArg::Ptr(img.buf.device_ptr(&self.stream).0),
                    _ => KArg::Ptr(act_ptr(self, o)),
                },
                KArg::I32(n as i32),
            ]);
            if mode != GemvOut::Swiglu || i == 0 {
                blocks += n.div_ceil(nw / ks * r);
            }
        }
        let (gains, eps) = match input {
            GemvIn::Norm(_, w, eps) => (w.device_ptr(&self.stream).0, eps),
            GemvIn::Bf16(_) | GemvIn::Staged(_) => (xp, 0.0f32),
        };
        args.extend([KArg::Ptr(xp), KArg::Ptr(gains), KArg::F32(eps), KArg::I32(cols_in as i32)]);
        if let GemvExtra::Argmax(sink) = extra {
            args.extend(sink);
        }
        if let Some(plan) = plan {
            self.launch_gemv_ring(&f, plan, &mut args, nw)?;
            return Ok(true);
        }
        let threads = 32 * nw as u32;
        let blocks = blocks.min(self.gemv_grid(&f, threads, smem));
        if argmax && blocks > ARGMAX_FUSED_BLOCKS_PER_SM * self.sms {
            return Err(Error::Invalid(format!("CUDA head argmax: {blocks} blocks for its partials' scratch")));
        }
        let c =
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
        self.launch(&f, c, &args, "fused GEMV launch")?;
        Ok(true)
    }

    /// Rows per warp of the decode GEMV with `rows` output rows (SwiGLU: per matrix) of
    /// `chunks` 16-byte chunks each, before `k_slices`: what `gemv_fused` launches, and the
    /// fused layer end (ffn.rs) must match.
    pub(super) fn gemv_rows_per_warp(&self, mode: GemvOut, rows: usize, chunks: usize) -> usize {
        let mut r = match mode {
            GemvOut::Swiglu => swiglu_rows_per_warp(),
            _ => rows_per_warp(rows, chunks, GEMV_LOADS),
        };
        let spread = match gemv_spread() {
            2 => true,
            1 => mode == GemvOut::Add,
            _ => false,
        };
        if spread {
            r = spread_rows(rows, r, gemv_warps(), self.sms);
        }
        if mode == GemvOut::Add {
            r = add_rows_per_warp().unwrap_or(r);
        }
        r
    }

    /// Persistent GEMV blocks: as many as are resident on the GPU at once (registers decide:
    /// 2-5 per SM), each looping over row blocks with x staged once. More would queue behind
    /// the first wave and finish last. `FERROLM_GEMV_BPS` caps the blocks per SM (for tuning).
    pub(super) fn gemv_grid(&self, f: &CudaFunction, threads: u32, smem: usize) -> usize {
        static PER_SM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let per_sm_cap = *PER_SM.get_or_init(|| {
            std::env::var("FERROLM_GEMV_BPS").ok().and_then(|v| v.parse().ok()).unwrap_or(8usize).max(1)
        });
        let resident = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None).unwrap_or(2).max(1);
        self.sms * per_sm_cap.min(resident as usize)
    }

    /// q, k, v and layer's K and V caches: the first arguments of rope_kv and attention_decode.
    pub(super) fn qkv_cache_args(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &CudaKv,
        layer: usize,
    ) -> [KArg; 5] {
        [
            dev(self, q.bf16()),
            dev(self, k.bf16()),
            dev(self, v.bf16()),
            dev(self, &kv.k[layer]),
            dev(self, &kv.v[layer]),
        ]
    }

    /// RoPE on q and k plus the cache write of k and v, one launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_kv(
        &self,
        q: &mut CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        heads: usize,
    ) -> Result<()> {
        let freqs = self.rope_freqs_for(rope)?;
        let f = self.function(kernels::file("attention.cu"), &[], "rope_kv")?;
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let p0 = &st.as_ref().ok_or_else(|| Error::Invalid("CUDA rope without a staged position".into()))?.pos_dev;
        let (rows, h, nkv, hd) = (q.rows as i32, heads as i32, (kv.width / kv.head_dim) as i32, kv.head_dim as i32);
        let inter = i32::from(rope.style == RopeStyle::Interleaved);
        let n = q.rows * (q.cols / 2 + kv.width / 2 + kv.width);
        let mut args = self.qkv_cache_args(q, (k, v), kv, layer).to_vec();
        args.extend([
            KArg::Ptr(freqs),
            KArg::I32(rows),
            KArg::I32(h),
            KArg::I32(nkv),
            KArg::I32(hd),
            dev(self, p0),
            KArg::F32(rope.linear),
            KArg::I32(inter),
        ]);
        let c = LaunchConfig {
            grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Matches attention.cu's rope_kv; pos0 + rows ≤ max_seq is checked by the model.
        self.launch(&f, c, &args, "rope_kv launch")
    }

    /// argmax of row 0 of f32 `x` into out[0] as f32; with `feed`, also into the staged
    /// token id with the staged position advanced (the next fed step's input).
    pub(crate) fn argmax_f32(&self, x: &CudaAct, out: &mut CudaAct, feed: bool) -> Result<()> {
        let (ActBuf::F32(xv), ActBuf::F32(ov)) = (&x.buf, &mut out.buf) else {
            return Err(Error::Invalid("CUDA argmax reads f32 logits into an f32 output".into()));
        };
        let f = self.function(kernels::file("sample.cu"), &[], "argmax")?;
        let n = x.cols as i32;
        // ~2K values per block: enough blocks to stream a 128K vocabulary in parallel.
        let blocks = x.cols.div_ceil(2048).clamp(1, ARGMAX_BLOCKS);
        let [pv, pi, done, feed_tok, feed_pos, feed_hist] = self.argmax_sink_args(feed)?;
        let args = [dev(self, xv), KArg::I32(n), dev(self, ov), pv, pi, done, feed_tok, feed_pos, feed_hist];
        let c = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // Matches sample.cu's argmax.
        self.launch(&f, c, &args, "argmax launch")
    }

    /// A greedy step's argmax sink after its output (argmax.cuh's ArgmaxSink): the blocks'
    /// partials and done counter, one scratch for sample.cu's argmax and the head's fused
    /// one (sized for either's grid; launches on one stream, each last block resets the
    /// counter), made on first use; then with `feed` the staged token, position and token
    /// history the next fed step reads, else nulls.
    pub(super) fn argmax_sink_args(&self, feed: bool) -> Result<[KArg; 6]> {
        let mut scratch = self.argmax_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.is_none() {
            let n = ARGMAX_BLOCKS.max(ARGMAX_FUSED_BLOCKS_PER_SM * self.sms);
            let v = self.stream.alloc_zeros::<f32>(n).map_err(drv("allocating argmax scratch"))?;
            let i = self.stream.alloc_zeros::<i32>(n).map_err(drv("allocating argmax scratch"))?;
            let d = self.stream.alloc_zeros::<i32>(1).map_err(drv("allocating argmax scratch"))?;
            *scratch = Some((v, i, d));
        }
        let (pv, pi, done) = scratch.as_ref().expect("set above");
        let parts = [dev(self, pv), dev(self, pi), dev(self, done)];
        if !feed {
            return Ok([parts[0], parts[1], parts[2], KArg::Ptr(0), KArg::Ptr(0), KArg::Ptr(0)]);
        }
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_ref().ok_or_else(|| Error::Invalid("CUDA fed argmax without a staged step".into()))?;
        Ok([parts[0], parts[1], parts[2], dev(self, &s.tok_dev), dev(self, &s.pos_dev), dev(self, &s.hist_dev)])
    }

    /// The k best of row 0 of f32 `x` × inv_t as (index, value) pairs into out (sample.cu's
    /// top_k; arguments checked by the caller).
    pub(crate) fn top_k_f32(&self, x: &CudaAct, k: usize, inv_t: f32, out: &mut CudaAct) -> Result<()> {
        let (ActBuf::F32(xv), ActBuf::F32(ov)) = (&x.buf, &mut out.buf) else {
            return Err(Error::Invalid("CUDA top-k reads f32 logits into an f32 output".into()));
        };
        let f = self.function(kernels::file("sample.cu"), &[], "top_k")?;
        let n = x.cols;
        let (blocks, per) = top_k_split(n, k);
        let mut scratch = self.top_k_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.is_none() {
            let key = self.stream.alloc_zeros::<u32>(TOP_K_CAP).map_err(drv("allocating top-k scratch"))?;
            let idx = self.stream.alloc_zeros::<i32>(TOP_K_CAP).map_err(drv("allocating top-k scratch"))?;
            let done = self.stream.alloc_zeros::<i32>(1).map_err(drv("allocating top-k scratch"))?;
            *scratch = Some((key, idx, done));
        }
        let (ck, ci, done) = scratch.as_mut().expect("set above");
        let args = [
            dev(self, xv),
            KArg::I32(n as i32),
            KArg::F32(inv_t),
            KArg::I32(k as i32),
            KArg::I32(per as i32),
            KArg::I32(TOP_K_CAP as i32),
            dev(self, ck),
            dev(self, ci),
            dev(self, done),
            dev(self, ov),
        ];
        let c = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: (TOP_K_CAP * 4) as u32,
        };
        // Matches sample.cu's top_k: blocks · k ≤ TOP_K_CAP candidates (top_k_split), done
        // zeroed at allocation and reset by the kernel.
        self.launch(&f, c, &args, "top-k launch")
    }
}

/// Keys sample.cu's top_k holds in shared memory (a slice in phase 1, all candidates in
/// phase 2), and the candidate scratch's size: 43 KB, within the 48 KB a launch gets.
const TOP_K_CAP: usize = 11008;

/// (blocks, values per block) for top-k of k over n: slices of ~1K values spread a 128K
/// vocabulary over ~128 SMs, as long as the blocks' k candidates each fit TOP_K_CAP
/// together; each slice longer than k unless one block takes everything.
fn top_k_split(n: usize, k: usize) -> (usize, usize) {
    let blocks = (TOP_K_CAP / k).min(n.div_ceil(1024)).max(1);
    let per = n.div_ceil(blocks);
    if per <= k {
        return (1, n);
    }
    (n.div_ceil(per), per)
}

/// The decode-path overrides of `Backend`'s fused ops (called from ops.rs's impl).
impl Cuda {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fused_norm_matmul_many(
        &self,
        x: &CudaAct,
        norm: &CudaSlice<f32>,
        eps: f32,
        xn: &mut CudaAct,
        ws: &[&CudaMat],
        outs: &mut [&mut CudaAct],
    ) -> Result<()> {
        if self.gemv_fused(GemvIn::Norm(x, norm, eps), ws, outs, GemvOut::Store)? {
            return Ok(());
        }
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_many(xn, ws, outs)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fused_norm_swiglu(
        &self,
        x: &CudaAct,
        norm: &CudaSlice<f32>,
        eps: f32,
        xn: &mut CudaAct,
        (gate, up): (&CudaMat, &CudaMat),
        (g, u): (&mut CudaAct, &mut CudaAct),
        out: &mut CudaAct,
    ) -> Result<()> {
        if self.gemv_fused(GemvIn::Norm(x, norm, eps), &[gate, up], &mut [&mut *out, &mut *u], GemvOut::Swiglu)? {
            return Ok(());
        }
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_many(xn, &[gate, up], &mut [g, u])?;
        self.silu_mul(g, u, out)
    }

    pub(crate) fn fused_matmul_add(&self, y: &CudaAct, w: &CudaMat, x: &mut CudaAct, tmp: &mut CudaAct) -> Result<()> {
        if self.gemv_fused(GemvIn::Bf16(y), &[w], &mut [x], GemvOut::Add)? {
            return Ok(());
        }
        self.matmul(y, w, tmp)?;
        self.add(x, tmp)
    }
}

impl Cuda {
    /// Device-to-device copy bandwidth: median of 5 copies of up to 4 GiB (a quarter of free
    /// memory on smaller GPUs), counting bytes read and written.
    pub fn measure_copy_bandwidth(&self) -> Result<f64> {
        let (free, _) = self.ctx.mem_get_info().map_err(drv("reading memory use"))?;
        let bytes = (4usize << 30).min(free / 4) & !0xffff;
        let src = self.stream.alloc_zeros::<u8>(bytes).map_err(drv("allocating the copy benchmark"))?;
        let mut dst = self.stream.alloc_zeros::<u8>(bytes).map_err(drv("allocating the copy benchmark"))?;
        let mut times = Vec::new();
        for i in 0..6 {
            let t = std::time::Instant::now();
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv("copying"))?;
            self.stream.synchronize().map_err(drv("copying"))?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64()); // the first copy warms up
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(2.0 * bytes as f64 / times[times.len() / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_gemvs_spread_small_row_counts() {
        // SmolLM2's o and down (576 rows) go from 4 rows per warp to 2; the 1B's stay.
        assert_eq!(spread_rows(576, 4, 8, 132), 2);
        assert_eq!(spread_rows(2048, 4, 8, 132), 4);
        assert_eq!(spread_rows(2048, 1, 8, 132), 1);
        assert_eq!(spread_rows(64, 4, 8, 132), 1);
    }

    /// top_k_split's promises to sample.cu's top_k: every value in a slice, at most
    /// TOP_K_CAP candidates, and slices longer than k unless one block takes everything
    /// (so only the last slice writes fewer than k).
    #[test]
    fn top_k_split_covers_and_fits() {
        for n in [1, 7, 1000, 1024, 1025, 5000, 49152, 128256, 262144] {
            for k in [1, 2, 40, 1000, 1024].into_iter().filter(|&k| k <= n) {
                let (blocks, per) = top_k_split(n, k);
                assert!(blocks >= 1 && (blocks - 1) * per < n && blocks * per >= n, "n {n} k {k}: {blocks} × {per}");
                assert!(blocks * k <= TOP_K_CAP, "n {n} k {k}: {blocks} blocks of {k}");
                assert!(blocks == 1 || per > k, "n {n} k {k}: slices of {per}");
            }
        }
        assert_eq!(top_k_split(128256, 40), (126, 1018));
    }
}
