//! The prefill GEMM on Hopper's warpgroup MMA (kernels/gemm_wgmma.cu): the affine weights
//! dequantized into a bf16 copy first (gemm.cu's dequant_bf16, the values every quantized
//! GEMM multiplies by), then 128 tokens × 128 rows a block through a six-stage cp.async
//! ring. Its outputs have the tiled kernel's bits (cuda_parity's gemm tests), so Auto may
//! take it for any call it serves: from [`WGMMA_MIN_M`] tokens on sm_90 devices, with
//! `CudaConfig::gemm_wgmma`, outside graph captures, cols a multiple of 64, matrices of
//! `CudaConfig::wgmma_min_weights` weights and more.
//!
//! The copy lives in one scratch buffer for every call (`Scratch::wgmma_weights`): as
//! large as the largest matrix it served (a GLU's gate and up together: 235 MB on an 8B
//! model). With `CudaConfig::wgmma_ahead`, a prefill's layers are dequantized one layer
//! ahead on the side stream instead ([`Ahead`]), and the GEMMs read those copies.

use super::context::Order;
use super::device::Cuda;
use super::driver::{drv, KArg};
use super::gemm::{same_format, QgemmKernel};
use super::kernels;
use super::tensors::{ActBuf, CudaAct, CudaMat};
use crate::backend::LayerWeights;
use crate::config::Activation;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, LaunchConfig};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Fewest tokens Auto gives the wgmma kernel: below, the dequantization pass weighs more
/// than the faster multiply gains (8B shapes on an H100 at 512 tokens: 1.20-1.37x the
/// wide tiles with the pass counted, docs/perf.md).
pub const WGMMA_MIN_M: usize = 512;
const FILE: &str = "gemm_wgmma.cu";
/// Tokens and weight rows per block (the kernel's WG_BM, WG_BN).
const TILE: usize = 128;
/// cols must be a multiple of this (one ring step).
const COLS_MULTIPLE: usize = 64;
/// The ring's dynamic shared memory: six stages of a 32 KiB x and w tile pair, and 1 KiB
/// to align them (the kernel's WG_SMEM).
const SMEM_BYTES: usize = 6 * 2 * TILE * 128 + 1024;
/// The GLU form's copy interleaves gate and up by this many rows (half a tile).
const GLU_HALF: usize = TILE / 2;
/// Blocks of the grid-stride dequantization per SM (256 threads each).
const DEQUANT_BLOCKS_PER_SM: usize = 16;
/// Copies in an `Ahead` slot start at multiples of this many values (1 KiB).
const AHEAD_ALIGN: usize = 512;

/// Words a thread of the pass ahead dequantizes (`PassBlocks::Short`): 8 KiB of weights a
/// block.
const AHEAD_WORDS_A_THREAD: usize = 8;

/// How many blocks a dequantization pass launches.
#[derive(Clone, Copy)]
enum PassBlocks {
    /// This many grid-stride blocks an SM.
    PerSm(usize),
    /// Short blocks, `AHEAD_WORDS_A_THREAD` words a thread: the pass ahead, on the side
    /// stream at the lowest priority (the main stream has the highest). The GEMM's block
    /// holds an SM's whole register file (256 threads at 255 registers), so nothing runs
    /// beside it; a freed SM goes to a waiting GEMM block first, and a pass block holds
    /// one for microseconds: the pass fills the SMs a launch leaves free (the 8B's
    /// 128-tile launches leave 4 of an H100's 132, k's and v's ~100), wave tails and the
    /// gaps between launches. 8B pp512 on an H100: +10% over two resident grid-stride
    /// blocks an SM at the default priority, which held their SMs for the whole pass
    /// (docs/perf.md).
    Short,
}

/// A dequantization pass: the stream it runs on and its blocks.
type Pass<'a> = (&'a CudaStream, PassBlocks);

/// A copy's matrices: the device addresses of their words (gate's and up's for a GLU's
/// interleaved copy, up's 0 for one matrix).
type CopyKey = (u64, u64);

/// A prefill's layers dequantized one layer ahead (`CudaConfig::wgmma_ahead`): two slots,
/// the next layer's copies written into one on the side stream while the current layer's
/// GEMMs read the other's. `Backend::prepare_layer` fills them; a GEMM whose copy is in a
/// slot waits for that slot's pass (once) and reads it, any other dequantizes as before.
#[derive(Default)]
pub(crate) struct Ahead {
    slots: [Option<Slot>; 2],
    /// The slot the next layer's copies go to.
    next: usize,
}

struct Slot {
    /// The side stream, which writes `buf`.
    side: Arc<CudaStream>,
    buf: CudaSlice<u16>,
    /// Each copy's matrices and its offset in `buf` (values).
    copies: Vec<(CopyKey, usize)>,
    /// Recorded on the main stream before the copies are written, after the GEMMs that
    /// read the slot's previous copies: the side stream waits for it.
    free: CudaEvent,
    /// Recorded on the side stream after the copies are written.
    ready: CudaEvent,
    /// Whether the main stream already waits for `ready`.
    joined: bool,
}

impl Drop for Slot {
    /// `buf` is freed in the main stream's order: the side stream's pass into it must be
    /// over first (a pass whose copies no GEMM waited for, when a call stopped early).
    fn drop(&mut self) {
        if let Err(e) = self.side.synchronize() {
            eprintln!("ferrolm: waiting for the weights dequantized ahead: {e}");
        }
    }
}

impl Ahead {
    /// Forget every copy (a forward call begins: the matrices of later calls may be others
    /// at the same addresses).
    pub(crate) fn forget(&mut self) {
        self.slots.iter_mut().flatten().for_each(|s| s.copies.clear());
    }
}

impl Cuda {
    /// Whether a call of m tokens over a [rows, cols] matrix runs on the wgmma kernel as
    /// `kernel` asks: named, it must (an error where it cannot); Auto, where it serves and
    /// the configuration lets it (`gemm_wgmma`, `wgmma_min_weights`).
    pub(super) fn takes_wgmma(&self, kernel: QgemmKernel, m: usize, (rows, cols): (usize, usize)) -> Result<bool> {
        let runs = kernels::runs_on(FILE, &self.arch);
        let fits = cols.is_multiple_of(COLS_MULTIPLE);
        match kernel {
            QgemmKernel::Wgmma if !runs => {
                Err(Error::Unsupported(format!("the wgmma qgemm runs on sm_90 devices, not {}", self.arch)))
            }
            QgemmKernel::Wgmma if !fits => {
                Err(Error::Unsupported(format!("the wgmma qgemm needs cols a multiple of {COLS_MULTIPLE}, not {cols}")))
            }
            QgemmKernel::Wgmma => Ok(true),
            QgemmKernel::Auto => {
                let large = rows * cols >= self.cfg.wgmma_min_weights;
                Ok(self.cfg.gemm_wgmma && runs && fits && large && m >= WGMMA_MIN_M && !self.capturing.load(Relaxed))
            }
            _ => Ok(false),
        }
    }

    /// x += y·wᵀ (each product rounded to bf16 first: `Backend::matmul_add`'s bits) on the
    /// wgmma kernel, the add in its epilogue (no product stored and read back), for an f32
    /// residual x where Auto takes the kernel and the fallback's product `tmp` would be
    /// bf16 (the same rounding); false where it does not (nothing done).
    pub(super) fn matmul_add_wgmma(&self, y: &CudaAct, w: &CudaMat, x: &mut CudaAct, tmp: &CudaAct) -> Result<bool> {
        let (rows, cols) = (w.rows(), w.cols());
        let fits = matches!(w, CudaMat::Affine { .. })
            && matches!((&y.buf, &x.buf, &tmp.buf), (ActBuf::Bf16(_), ActBuf::F32(_), ActBuf::Bf16(_)))
            && y.cols == cols
            && x.cols == rows
            && x.rows == y.rows
            && [rows, cols, y.rows].iter().all(|&v| i32::try_from(v).is_ok());
        if !(fits && self.takes_wgmma(QgemmKernel::Auto, y.rows, (rows, cols))?) {
            return Ok(false);
        }
        self.qgemm_wgmma(y, (w, None), x, true)?;
        Ok(true)
    }

    /// out = x·wᵀ, or with `glu` = (up, act) out = act(x·wᵀ)·(x·upᵀ), on the wgmma kernel;
    /// with `add`, out (f32) += x·wᵀ rounded to bf16. Shapes, formats and sizes as
    /// qgemm_as / qgemm_glu_as / matmul_add_wgmma checked them.
    pub(super) fn qgemm_wgmma(
        &self,
        x: &CudaAct,
        (w, glu): (&CudaMat, Option<(&CudaMat, Activation)>),
        out: &mut CudaAct,
        add: bool,
    ) -> Result<()> {
        let (rows, cols, m) = (w.rows(), w.cols(), x.rows);
        let ActBuf::Bf16(xb) = &x.buf else {
            return Err(Error::Invalid("CUDA qgemm takes bf16 activations, not f32".into()));
        };
        let (name, row_blocks, act) = match (glu, &out.buf, add) {
            (None, ActBuf::Bf16(_), false) => ("qgemm_wgmma", rows.div_ceil(TILE), None),
            (None, ActBuf::F32(_), false) => ("qgemm_wgmma_f32", rows.div_ceil(TILE), None),
            (None, ActBuf::F32(_), true) => ("qgemm_wgmma_add", rows.div_ceil(TILE), None),
            (Some((_, act)), ActBuf::Bf16(_), false) => ("qgemm_wgmma_glu", rows.div_ceil(GLU_HALF), Some(act)),
            _ => return Err(Error::Invalid("the wgmma qgemm adds into f32 only, and its GLU form writes bf16".into())),
        };
        if row_blocks > 65535 {
            return Err(Error::Unsupported(format!("the wgmma qgemm over {rows} rows")));
        }
        let up = glu.map(|(up, _)| up);
        let copy = match self.copy_made_ahead(self.copy_key(w, up))? {
            Some(copy) => copy,
            None => {
                let copy = self.scratch.wgmma_weights(&self.ctx, copy_len(w, up.is_some()))?;
                self.dequant_copy(w, up, copy, self.whole_pass(&self.stream))?;
                copy
            }
        };
        let mut args = vec![
            copy,
            self.arg(xb),
            out.arg(self),
            KArg::I32(rows as i32),
            KArg::I32(cols as i32),
            KArg::I32(m as i32),
        ];
        if let Some(act) = act {
            args.push(KArg::I32(i32::from(act == Activation::GeluTanh)));
        }
        let f = self.function(kernels::file(FILE), &[], name)?;
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM_BYTES as i32)
            .map_err(drv("allowing the wgmma qgemm its shared memory"))?;
        let cfg = LaunchConfig {
            grid_dim: (m.div_ceil(TILE) as u32, row_blocks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SMEM_BYTES as u32,
        };
        // Matches gemm_wgmma.cu's entry `name` (bf16 copy, x, out, rows, cols, m[, act]).
        self.launch(&f, cfg, &args, Order::Serial, "qgemm_wgmma launch")
    }

    /// A dequantization pass on `stream` with nothing beside it (just before its GEMM, or
    /// the first layer's ahead): the whole GPU.
    fn whole_pass<'a>(&self, stream: &'a CudaStream) -> Pass<'a> {
        (stream, PassBlocks::PerSm(DEQUANT_BLOCKS_PER_SM))
    }

    /// The copy of `w` (with `up`, the GLU form's interleaved copy) at `copy`, made by
    /// `pass` (the main stream's, or the side stream's ahead).
    fn dequant_copy(&self, w: &CudaMat, up: Option<&CudaMat>, copy: KArg, pass: Pass<'_>) -> Result<()> {
        match up {
            None => self.dequant_bf16(w, copy, (0, 0), pass),
            Some(up) => {
                self.dequant_bf16(w, copy, (GLU_HALF, 0), pass)?;
                self.dequant_bf16(up, copy, (GLU_HALF, 1), pass)
            }
        }
    }

    /// `w` dequantized into the bf16 copy at `copy` (gemm.cu's dequant_bf16) by `pass`:
    /// row r at row r, or with (half, up) = (64, u) interleaved for the GLU form.
    fn dequant_bf16(&self, w: &CudaMat, copy: KArg, (half, up): (usize, usize), pass: Pass<'_>) -> Result<()> {
        let CudaMat::Affine { words, scales, biases, defines, rows, cols, .. } = w else {
            return Err(Error::Unsupported("the wgmma qgemm needs affine-quantized weights".into()));
        };
        let f = self.function(kernels::file("gemm.cu"), defines, "dequant_bf16")?;
        let args = [
            self.arg(words),
            scales.arg(self),
            biases.arg(self),
            copy,
            KArg::I32(*rows as i32),
            KArg::I32(*cols as i32),
            KArg::I32(half as i32),
            KArg::I32(up as i32),
        ];
        let (stream, blocks) = pass;
        let blocks = match blocks {
            PassBlocks::PerSm(per_sm) => self.sms * per_sm,
            PassBlocks::Short => words.len().div_ceil(256 * AHEAD_WORDS_A_THREAD),
        };
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_in(stream, &f, cfg, &args, Order::Serial, "dequant_bf16 launch")
    }

    /// `w` dequantized into `copy` as the wgmma GEMM's copy (row r at row r), for
    /// crates/lab's forms of the ring.
    #[cfg(feature = "lab")]
    pub fn wgmma_dequant_into(&self, w: &CudaMat, copy: &mut CudaSlice<u16>) -> Result<()> {
        if copy.len() < copy_len(w, false) {
            return Err(Error::Invalid(format!(
                "a copy of {} values for a [{}, {}] matrix",
                copy.len(),
                w.rows(),
                w.cols()
            )));
        }
        self.dequant_copy(w, None, self.arg(copy), self.whole_pass(&self.stream))
    }

    /// Which matrices a copy of `w` (with `up`: the GLU form's) holds.
    fn copy_key(&self, w: &CudaMat, up: Option<&CudaMat>) -> CopyKey {
        let addr = |m: &CudaMat| match m {
            CudaMat::Affine { words, .. } => match self.arg(words) {
                KArg::Ptr(p) => p,
                _ => 0,
            },
            CudaMat::Dense { .. } => 0,
        };
        (addr(w), up.map_or(0, addr))
    }

    /// The copy with `key` a pass ahead made, once the main stream waits for that pass.
    fn copy_made_ahead(&self, key: CopyKey) -> Result<Option<KArg>> {
        let mut ahead = self.scratch.wgmma_ahead.lock().unwrap_or_else(|e| e.into_inner());
        for slot in ahead.slots.iter_mut().flatten() {
            let Some(&(_, at)) = slot.copies.iter().find(|(k, _)| *k == key) else { continue };
            if !slot.joined {
                self.stream.wait(&slot.ready).map_err(drv("waiting for the weights dequantized ahead"))?;
                slot.joined = true;
            }
            let KArg::Ptr(base) = self.arg(&slot.buf) else { unreachable!("a buffer's argument is its address") };
            self.wgmma_ahead_hits.fetch_add(1, Relaxed);
            return Ok(Some(KArg::Ptr(base + 2 * at as u64)));
        }
        Ok(None)
    }

    /// `Backend::prepare_layer`: the copies of layer `w`'s matrices that the wgmma GEMM
    /// will take at `m` rows, made on the side stream into the next `Ahead` slot once the
    /// main stream's work queued so far (the GEMMs reading that slot's last copies) is done.
    /// Nothing without `CudaConfig::wgmma_ahead`, inside a capture or in a dry pass.
    pub(super) fn prepare_wgmma_layer(&self, w: &LayerWeights<'_, Cuda>, m: usize) -> Result<()> {
        if !self.cfg.wgmma_ahead || self.capturing.load(Relaxed) || self.in_dry_pass() {
            return Ok(());
        }
        let (plan, len) = self.layer_copies(w, m)?;
        if plan.is_empty() {
            return Ok(());
        }
        let mut ahead = self.scratch.wgmma_ahead.lock().unwrap_or_else(|e| e.into_inner());
        // The call's first layer: nothing runs beside its pass (the GEMMs wait for it), so
        // it takes the whole GPU.
        let first = ahead.slots.iter().flatten().all(|s| s.copies.is_empty());
        let pass = if first { self.whole_pass(&self.side_stream) } else { (&*self.side_stream, PassBlocks::Short) };
        let i = ahead.next;
        ahead.next ^= 1;
        let slot = self.ahead_slot(&mut ahead.slots[i], len)?;
        slot.copies.clear();
        slot.joined = false;
        let what = "ordering the weights dequantized ahead";
        slot.free.record(&self.stream).map_err(drv(what))?;
        self.side_stream.wait(&slot.free).map_err(drv(what))?;
        let KArg::Ptr(base) = self.arg(&slot.buf) else { unreachable!("a buffer's argument is its address") };
        for &((a, up), key, at) in &plan {
            self.dequant_copy(a, up, KArg::Ptr(base + 2 * at as u64), pass)?;
            slot.copies.push((key, at));
        }
        slot.ready.record(&self.side_stream).map_err(drv(what))
    }

    /// The copies a layer's GEMMs at m rows take (q, k, v, o, gate and up as the GLU form
    /// reads them where the prefill fuses it, down), each with its key and where it starts
    /// in a slot, and the values the slot needs for them all.
    #[allow(clippy::type_complexity)]
    fn layer_copies<'a>(
        &self,
        w: &LayerWeights<'a, Cuda>,
        m: usize,
    ) -> Result<(Vec<((&'a CudaMat, Option<&'a CudaMat>), CopyKey, usize)>, usize)> {
        let pair = self.cfg.prefill_fused_glu && same_format(w.w_gate, w.w_up);
        let mut calls: Vec<(&CudaMat, Option<&CudaMat>)> = vec![(w.wq, None), (w.wk, None), (w.wv, None), (w.wo, None)];
        match pair {
            true => calls.push((w.w_gate, Some(w.w_up))),
            false => calls.extend([(w.w_gate, None), (w.w_up, None)]),
        }
        calls.push((w.w_down, None));
        let mut plan = Vec::with_capacity(calls.len());
        let mut at = 0;
        for (a, up) in calls {
            if matches!(a, CudaMat::Affine { .. }) && self.takes_wgmma(QgemmKernel::Auto, m, (a.rows(), a.cols()))? {
                plan.push(((a, up), self.copy_key(a, up), at));
                at = (at + copy_len(a, up.is_some())).next_multiple_of(AHEAD_ALIGN);
            }
        }
        Ok((plan, at))
    }

    /// Slot `slot`, made or grown to hold `n` values.
    fn ahead_slot<'s>(&self, slot: &'s mut Option<Slot>, n: usize) -> Result<&'s mut Slot> {
        if slot.as_ref().is_none_or(|s| s.buf.len() < n) {
            *slot = None;
            let event = || self.ctx.ctx.new_event(None).map_err(drv("creating an event"));
            let buf = self.ctx.zeros(n, "allocating the weights dequantized ahead")?;
            let side = self.side_stream.clone();
            *slot = Some(Slot { side, buf, copies: Vec::new(), free: event()?, ready: event()?, joined: false });
        }
        Ok(slot.as_mut().expect("set above"))
    }
}

/// Values in a copy of `w` (the GLU form's: gate's and up's rows, each padded to a whole
/// half tile).
fn copy_len(w: &CudaMat, glu: bool) -> usize {
    let rows = if glu { 2 * w.rows().div_ceil(GLU_HALF) * GLU_HALF } else { w.rows() };
    rows * w.cols()
}
