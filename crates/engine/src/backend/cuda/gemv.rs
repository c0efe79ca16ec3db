//! The decode GEMV (one token, kernels/gemv.cu): up to three matrices sharing an input in
//! one launch (q/k/v), the RMSNorm folded into the load of its input, SwiGLU or GeGLU of
//! gate and up in one launch, the residual add in the store, x staged once per persistent block as
//! int16 for DP2A. Each kernel is named by input, output and rows per warp (`kernel`).
//! Its batched form (`gemv_tokens`: the same kernels compiled with NT tokens a block) gives
//! each of several tokens exactly the bits the one-token launch gives it alone.

use super::device::Cuda;
use super::driver::KArg;
use super::kernels;
use super::tensors::{ActBuf, CudaAct, CudaMat};
use crate::config::Activation;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};

/// How the GEMV reads its input.
pub(crate) enum GemvIn<'a> {
    /// bf16 activations `[1, cols]`.
    Bf16(&'a CudaAct),
    /// The f32 residual stream, RMS-normalized with these gains and eps on load.
    Norm(&'a CudaAct, &'a CudaSlice<f32>, f32),
    /// `cols` values already staged by their producer (x_staged.cuh), at this address.
    Staged { image: KArg, cols: usize },
    /// `Norm` of the residual x + rmsnorm(y)·post (a post-norm add still pending, Gemma's),
    /// which the launch also writes to `out`: (x, y, post), out, gains, eps.
    Post((&'a CudaAct, &'a CudaAct, &'a CudaSlice<f32>), &'a CudaAct, &'a CudaSlice<f32>, f32),
}

/// Widest residual a `GemvIn::Post` launch takes: x_stage.cuh's held gains (8 values × 2
/// parts × 256 threads).
const POST_MAX_COLS: usize = 8 * 2 * 32 * WARPS;

/// What the GEMV does with its dot products.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum GemvOut {
    /// Store into each matrix's output (bf16 or f32, the output's type).
    Store,
    /// Add into the f32 residual stream.
    Add,
    /// act(mat 0) · mat 1 into one bf16 output (SwiGLU, GeGLU).
    Glu(Activation),
}

/// What a launch does beyond its mode.
#[derive(Clone, Copy)]
pub(crate) enum GemvExtra {
    None,
    /// SwiGLU that also writes its output as the next GEMV's staged x image (this address).
    StageInto(KArg),
    /// A one-matrix f32 store (the head) that also finds the argmax of what it stores:
    /// argmax.cuh's sink (out, partials, done counter, then a fed step's token, position
    /// and history, or nulls).
    Argmax([KArg; 7]),
}

/// Most blocks of a head GEMV fused with its argmax (its partials' scratch size): as many
/// as `grid` gives, 8 per SM at most.
pub(crate) const ARGMAX_FUSED_BLOCKS_PER_SM: usize = 8;

/// Largest input width whose bf16 copy fits the 48 KB of shared memory a launch gets
/// without opting in.
const MAX_COLS: usize = 24 * 1024;

/// Most shared memory a batched GEMV block stages its tokens' x in (opted in past 48 KB;
/// every sm_80+ GPU allows a block 99 KB or more): fewer tokens a block where they would
/// not fit.
const BATCH_SMEM_MAX: usize = 96 * 1024;

/// 16-byte weight loads per lane per tile (LIF in gemv.cu; half per matrix for SwiGLU).
const LOADS: usize = 8;

/// Warps per block (NW in gemv.cu). 8 measured best at the 1B shape: each block stages x
/// (from L2) once, so fewer, larger blocks read less of it (4 and 16 warps: docs/perf.md).
pub(crate) const WARPS: usize = 8;

/// The kernel for (input, output, rows per warp, K slices): input b bf16, n normed f32,
/// q staged image, p normed f32 with a pending post-norm add; output b bf16, f f32, a
/// residual add, s SwiGLU, z SwiGLU staging the next x, m f32 with the argmax. None: not
/// compiled.
fn kernel(input: char, out: char, r: usize, ks: usize) -> Option<&'static str> {
    Some(match (input, out, r, ks) {
        ('b', 'b', 1, 1) => "gemv_bb_r1",
        ('b', 'b', 2, 1) => "gemv_bb_r2",
        ('b', 'b', 4, 1) => "gemv_bb_r4",
        ('b', 'f', 1, 1) => "gemv_bf_r1",
        ('b', 'f', 2, 1) => "gemv_bf_r2",
        ('b', 'f', 4, 1) => "gemv_bf_r4",
        ('b', 'a', 1, 1) => "gemv_ba_r1",
        ('b', 'a', 2, 1) => "gemv_ba_r2",
        ('b', 'a', 4, 1) => "gemv_ba_r4",
        ('b', 'a', 2, 2) => "gemv_ba_r2k2",
        ('n', 'b', 1, 1) => "gemv_nb_r1",
        ('n', 'b', 2, 1) => "gemv_nb_r2",
        ('n', 'b', 4, 1) => "gemv_nb_r4",
        ('n', 'f', 1, 1) => "gemv_nf_r1",
        ('n', 'f', 2, 1) => "gemv_nf_r2",
        ('n', 'f', 4, 1) => "gemv_nf_r4",
        ('n', 's', 1, 1) => "gemv_ns_r1",
        ('n', 's', 2, 1) => "gemv_ns_r2",
        ('n', 's', 4, 1) => "gemv_ns_r4",
        ('n', 'g', 1, 1) => "gemv_ng_r1",
        ('n', 'g', 2, 1) => "gemv_ng_r2",
        ('n', 'g', 4, 1) => "gemv_ng_r4",
        ('n', 'z', 4, 1) => "gemv_nz_r4",
        ('n', 'y', 4, 1) => "gemv_ny_r4",
        ('n', 'm', 4, 1) => "gemv_nm_r4",
        ('p', 'b', 1, 1) => "gemv_pb_r1",
        ('p', 'b', 2, 1) => "gemv_pb_r2",
        ('p', 'b', 4, 1) => "gemv_pb_r4",
        ('p', 'g', 1, 1) => "gemv_pg_r1",
        ('p', 'g', 2, 1) => "gemv_pg_r2",
        ('p', 'g', 4, 1) => "gemv_pg_r4",
        ('q', 'a', 1, 1) => "gemv_qa_r1",
        ('q', 'a', 2, 1) => "gemv_qa_r2",
        ('q', 'a', 4, 1) => "gemv_qa_r4",
        ('q', 'a', 2, 2) => "gemv_qa_r2k2",
        _ => return None,
    })
}

/// Rows per warp: more rows reuse each x chunk more, but leave fewer warps. At least as
/// many as keep a lane's tile of `loads` loads (per matrix) within a row's chunks (`chunks`
/// 16-byte chunks per row): a 2048-wide 4-bit row is 64 chunks, 2 per lane, so a one-row
/// tile of 8 would leave 3/4 of its loads empty.
pub(crate) fn rows_per_warp(total_rows: usize, chunks: usize, loads: usize) -> usize {
    let by_rows = match total_rows {
        n if n >= 16384 => 4,
        n if n >= 8192 => 2,
        _ => 1,
    };
    let per_lane = chunks.div_ceil(32).clamp(1, loads);
    by_rows.max(loads / per_lane).min(4)
}

/// Rows per warp `r` for a GEMV that adds into the residual (o, down), halved while its
/// blocks (`rows` / (`nw`·r)) would number under a quarter of the SMs: SmolLM2's o and down
/// (576 rows) at 2 instead of 4 measured 2 097 against 1 981 tok/s; the 1B's (2048 rows)
/// are fastest as they are (H200, docs/perf-log.md).
pub(crate) fn spread_rows(rows: usize, r: usize, nw: usize, sms: usize) -> usize {
    let mut r = r;
    while r > 1 && rows.div_ceil(nw * r) < sms / 4 {
        r /= 2;
    }
    r
}

/// Whether `cols` inputs can be staged by their producer (x_staged.cuh): int16 x, in whole
/// 16-byte pieces (cols % 128 == 0).
pub(crate) fn staged_x_fits(cols: usize, int16_x: bool) -> bool {
    cols.is_multiple_of(128) && x_staging(cols, int16_x).0
}

/// How the GEMV stages an input of `cols` values in shared memory: (XQ, bytes). int16 x
/// with DP2A (gemv.cu's XQ) needs whole 32-value x blocks and room for the block scales
/// and sums beside x; else bf16 x.
pub(crate) fn x_staging(cols: usize, int16_x: bool) -> (bool, usize) {
    let xq_bytes = 2 * cols + cols / 32 * 4 + cols / 16 * 4;
    match cols.is_multiple_of(32) && xq_bytes <= 2 * MAX_COLS && int16_x {
        true => (true, xq_bytes),
        false => (false, cols * 2),
    }
}

impl Cuda {
    /// Rows per warp and K slices of a GEMV of `mode` over `rows` output rows (SwiGLU: per
    /// matrix) of `chunks` 16-byte chunks each. A one-matrix store spreads its rows as an
    /// add does (Gemma's post-normed o, 640 rows: 1 742 → 1 770 tok/s), q/k/v do not
    /// (SmolLM2's 960 rows spread: 2 381 → 2 227 tok/s; H200, docs/perf-log.md). SwiGLU at 4: ptxas gives gemv_ns_r4 128
    /// registers against 154 at r2, so two blocks fit per SM (1B +3%). An add at one row
    /// per warp over rows of a multiple of 64 chunks (the 1B's down) goes to 2 rows over
    /// two K slices: each x chunk read from shared memory serves 2 rows (1B +2.6%; H200,
    /// docs/perf-log.md).
    fn gemv_shape(&self, mode: GemvOut, matrices: usize, rows: usize, chunks: usize) -> (usize, usize) {
        let r = match mode {
            GemvOut::Glu(_) => 4,
            GemvOut::Store if matrices > 1 => rows_per_warp(rows, chunks, LOADS),
            GemvOut::Store | GemvOut::Add => spread_rows(rows, rows_per_warp(rows, chunks, LOADS), WARPS, self.sms),
        };
        match (mode, r) {
            (GemvOut::Add, 1) if self.cfg.gemv_k_slices && chunks.is_multiple_of(64) => (2, 2),
            _ => (r, 1),
        }
    }

    /// Rows per warp of a one-matrix GEMV store over `rows` × `cols` weights of `bits`:
    /// crates/lab's batched GEMV runs the same tiles, so that each token gets these bits.
    #[cfg(feature = "lab")]
    pub fn gemv_store_rows_per_warp(&self, rows: usize, cols: usize, bits: usize) -> usize {
        self.gemv_shape(GemvOut::Store, 1, rows, cols * bits / 128).0
    }

    /// Persistent GEMV blocks: as many as are resident on the GPU at once (registers
    /// decide: 2-5 per SM), each looping over row blocks with x staged once. More would
    /// queue behind the first wave and finish last.
    fn gemv_grid(&self, f: &CudaFunction, threads: u32, smem: usize) -> usize {
        let resident = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None).unwrap_or(2).max(1);
        self.sms * resident as usize
    }

    /// One decode GEMV over up to three matrices sharing the input, with what `extra`
    /// adds. Ok(false), nothing launched, where gemv.cu has no kernel for the case (several
    /// rows, dense or mixed weight formats, inputs over 24K wide): the caller runs the
    /// unfused ops, the same math.
    pub(crate) fn gemv(
        &self,
        input: GemvIn,
        mats: &[&CudaMat],
        outs: &mut [&mut CudaAct],
        mode: GemvOut,
        extra: GemvExtra,
    ) -> Result<bool> {
        // An invariant call's rows go through the GEMM whatever their count, but a generated
        // call's through the decode GEMV, batched over its rows (`gemv_tokens`).
        if self.steps.generated() {
            let tokens = outs.first().map_or(1, |o| o.rows);
            return self.gemv_tokens(input, mats, outs, mode, extra, tokens);
        }
        if self.steps.invariant() {
            return Ok(false);
        }
        self.gemv_tokens(input, mats, outs, mode, extra, 1)
    }

    /// `gemv` over `tokens` rows (every input and output `[tokens, …]`; a staged image
    /// input holds `tokens` images), each row's outputs the bits `gemv` gives that row
    /// alone, whatever `tokens` is: one token runs `gemv`'s kernels, more run them compiled
    /// with NT tokens a block (gemv.cu), NT the most of `CudaConfig::gemv_batch_tokens`
    /// that divides `tokens` and whose x fits a block's shared memory. Ok(false) where
    /// `gemv` has no kernel, and for the head's argmax form (one token's).
    fn gemv_tokens(
        &self,
        input: GemvIn,
        mats: &[&CudaMat],
        outs: &mut [&mut CudaAct],
        mode: GemvOut,
        extra: GemvExtra,
        tokens: usize,
    ) -> Result<bool> {
        if tokens > 1 && matches!(extra, GemvExtra::Argmax(_)) {
            return Ok(false);
        }
        let Some(p) = self.gemv_plan(input, mats, outs, mode, extra, tokens)? else { return Ok(false) };
        let threads = 32 * WARPS as u32;
        if p.smem > 48 * 1024 {
            p.f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, p.smem as i32)
                .map_err(super::driver::drv("batched GEMV shared memory"))?;
        }
        let groups = tokens / p.nt.max(1);
        // Persistent blocks, one wave of them shared among the token groups (rounded down:
        // a block past the wave would run after it, alone).
        let blocks = p.blocks.min((self.gemv_grid(&p.f, threads, p.smem) / groups).max(1));
        if matches!(extra, GemvExtra::Argmax(_)) && blocks > ARGMAX_FUSED_BLOCKS_PER_SM * self.sms {
            return Err(Error::Invalid(format!("CUDA head argmax: {blocks} blocks for its partials' scratch")));
        }
        let c = LaunchConfig {
            grid_dim: (blocks as u32, groups as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: p.smem as u32,
        };
        self.launch(&p.f, c, &p.args, super::context::Order::Overlap, "decode GEMV launch")?;
        Ok(true)
    }

    /// Tokens a block of a batched GEMV over `tokens` rows of `cols` inputs stages (gemv.cu's
    /// NT): the most of `gemv_batch_tokens` (a power of two) dividing `tokens` whose images
    /// fit `BATCH_SMEM_MAX`; 0 for one token (the one-token kernels).
    fn gemv_block_tokens(&self, tokens: usize, image: usize) -> usize {
        if tokens <= 1 {
            return 0;
        }
        let mut nt = self.cfg.gemv_batch_tokens.max(1).next_power_of_two();
        while nt > 1 && (!tokens.is_multiple_of(nt) || nt * image > BATCH_SMEM_MAX) {
            nt /= 2;
        }
        nt
    }

    /// The kernel, its arguments, the row blocks and the shared memory of a `gemv_launch`
    /// over `tokens` rows; None where no kernel covers it.
    fn gemv_plan(
        &self,
        input: GemvIn,
        mats: &[&CudaMat],
        outs: &mut [&mut CudaAct],
        mode: GemvOut,
        extra: GemvExtra,
        tokens: usize,
    ) -> Result<Option<GemvPlan>> {
        let int16_x = self.cfg.gemv_int16_x;
        let (cols_in, xp, in_ok) = match input {
            GemvIn::Bf16(x) => (x.cols, x.arg(self), x.rows == tokens && !x.is_f32()),
            GemvIn::Norm(x, ..) => (x.cols, x.arg(self), x.rows == tokens && x.is_f32()),
            GemvIn::Staged { image, cols } => (cols, image, staged_x_fits(cols, int16_x)),
            GemvIn::Post((x, y, post), out, ..) => {
                let same = |a: &CudaAct| a.rows == tokens && a.cols == x.cols;
                let ok = same(x) && same(y) && same(out) && x.is_f32() && out.is_f32() && !y.is_f32();
                (x.cols, x.arg(self), ok && post.len() == x.cols && x.cols <= POST_MAX_COLS)
            }
        };
        if !in_ok || cols_in > MAX_COLS || mats.is_empty() || mats.len() > 3 || mats.len() != outs.len() {
            return Ok(None);
        }
        let glu = matches!(mode, GemvOut::Glu(_));
        let Some(CudaMat::Affine { defines, bits, .. }) = mats.first().copied() else { return Ok(None) };
        for (m, o) in mats.iter().zip(outs.iter()) {
            let CudaMat::Affine { defines: d, cols, rows, .. } = m else { return Ok(None) };
            let out_ok = matches!(
                (mode, &o.buf),
                (GemvOut::Add, ActBuf::F32(_)) | (GemvOut::Store, _) | (GemvOut::Glu(_), ActBuf::Bf16(_))
            );
            if d != defines || *cols != cols_in || o.rows != tokens || !out_ok {
                return Ok(None);
            }
            if !glu && o.cols != *rows {
                return Err(Error::Invalid(format!("CUDA GEMV: output of {} columns for {rows} rows", o.cols)));
            }
        }
        // One output type per launch (the kernel's store is per variant).
        let f32_out = outs[0].is_f32();
        if outs.iter().any(|o| o.is_f32() != f32_out) {
            return Ok(None);
        }
        if glu && (mats.len() != 2 || mats[0].rows() != mats[1].rows() || outs[0].cols != mats[0].rows()) {
            return Ok(None);
        }
        let launched_rows: usize = if glu { mats[0].rows() } else { mats.iter().map(|m| m.rows()).sum() };
        let (r, ks) = self.gemv_shape(mode, mats.len(), launched_rows, cols_in * *bits as usize / 128);
        let in_kind = match input {
            GemvIn::Norm(..) => 'n',
            GemvIn::Post(..) => 'p',
            GemvIn::Bf16(_) => 'b',
            GemvIn::Staged { .. } => 'q',
        };
        let out_kind = match (mode, f32_out, extra) {
            (GemvOut::Store, true, GemvExtra::Argmax(_)) if mats.len() == 1 => 'm',
            (GemvOut::Glu(Activation::Silu), _, GemvExtra::StageInto(_)) if launched_rows.is_multiple_of(WARPS * r) => {
                'z'
            }
            (GemvOut::Glu(Activation::GeluTanh), _, GemvExtra::StageInto(_))
                if launched_rows.is_multiple_of(WARPS * r) =>
            {
                'y'
            }
            (_, _, GemvExtra::Argmax(_) | GemvExtra::StageInto(_)) => return Ok(None),
            (GemvOut::Glu(Activation::Silu), ..) => 's',
            (GemvOut::Glu(Activation::GeluTanh), ..) => 'g',
            (GemvOut::Add, ..) => 'a',
            (GemvOut::Store, true, _) => 'f',
            (GemvOut::Store, false, _) => 'b',
        };
        let Some(name) = kernel(in_kind, out_kind, r, ks) else { return Ok(None) };
        let (xq, smem) = x_staging(cols_in, int16_x);
        if matches!(input, GemvIn::Staged { .. }) && !xq {
            return Ok(None);
        }
        let nt = self.gemv_block_tokens(tokens, smem.next_multiple_of(16));
        let mut gd = defines.to_vec();
        gd.push(format!("XQ={}", u8::from(xq)));
        if nt > 0 {
            gd.push(format!("NT={nt}"));
        }
        let f = self.function(kernels::file("gemv.cu"), &gd, name)?;
        // Arguments: (w, scales, biases, out, rows) × 3, then x, gains, eps, cols. Unused
        // matrix slots repeat the first with 0 rows; a staging SwiGLU takes its image as
        // slot 2's output.
        let mut args: Vec<KArg> = Vec::with_capacity(26);
        let mut blocks = 0;
        for i in 0..3 {
            let (m, o) = if i < mats.len() { (mats[i], &*outs[i]) } else { (mats[0], &*outs[0]) };
            let CudaMat::Affine { words, scales, biases, rows, .. } = m else { unreachable!("checked above") };
            let n = if i < mats.len() { *rows } else { 0 };
            let out = match (i, extra) {
                (2, GemvExtra::StageInto(img)) => img,
                _ => o.arg(self),
            };
            args.extend([self.arg(words), scales.arg(self), biases.arg(self), out, KArg::I32(n as i32)]);
            if !glu || i == 0 {
                blocks += n.div_ceil(WARPS / ks * r);
            }
        }
        let (gains, eps) = match input {
            GemvIn::Norm(_, w, eps) | GemvIn::Post(_, _, w, eps) => (self.arg(w), eps),
            GemvIn::Bf16(_) | GemvIn::Staged { .. } => (xp, 0.0f32),
        };
        args.extend([xp, gains, KArg::F32(eps), KArg::I32(cols_in as i32)]);
        if let GemvIn::Post((_, y, post), out, ..) = input {
            args.extend([y.arg(self), self.arg(post), out.arg(self)]);
        }
        if let GemvExtra::Argmax(sink) = extra {
            args.extend(sink);
        }
        // A batched block's token images start on 16-byte boundaries (gemv.cu's x_image).
        let smem = if nt > 0 { nt * smem.next_multiple_of(16) } else { smem };
        Ok(Some(GemvPlan { f, args, blocks, smem, nt }))
    }
}

/// A GEMV launch's kernel, arguments, row blocks, shared memory and tokens a block (0: the
/// one-token kernels).
struct GemvPlan {
    f: CudaFunction,
    args: Vec<KArg>,
    blocks: usize,
    smem: usize,
    nt: usize,
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

    #[test]
    fn every_named_gemv_kernel_is_in_gemv_cu() {
        let src = [
            kernels::file("gemv.cu").src,
            super::super::nvrtc::HEADERS.iter().find(|h| h.0 == "x_staged.cuh").unwrap().1,
        ]
        .concat();
        for i in ['b', 'n', 'q', 'p'] {
            for o in ['b', 'f', 'a', 's', 'g', 'z', 'y', 'm'] {
                for (r, ks) in [(1, 1), (2, 1), (4, 1), (2, 2)] {
                    if let Some(name) = kernel(i, o, r, ks) {
                        let short = &name[5..];
                        let macro_form = format!("gemv_{}{}_r##R", i, o);
                        assert!(src.contains(name) || (ks == 1 && src.contains(&macro_form)), "{name} ({short})");
                    }
                }
            }
        }
    }
}
