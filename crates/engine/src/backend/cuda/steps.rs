//! A forward call's inputs on the device and the CUDA graphs of decode steps and engine
//! calls: the token ids, positions, block tables and head rows staged in pinned memory and
//! copied by the call itself (so a captured call replays with new values), each session's
//! step captured once under its key and replayed, the serving engine's calls captured per
//! padded size, fed steps (each greedy step's argmax becomes the next one's input on the
//! device), and the queued reads of the tokens fed steps chose.

use super::context::Context;
use super::driver::{drv, KArg};
use crate::kv::Span;
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Keys of engine calls' graphs (`Steps::call`) have this bit; sessions' keys stay below.
const CALL_TAG: u64 = 1 << 63;

/// Fed steps' tokens the device keeps (sample.cu's FEED_HIST): the host reads a run of
/// steps' tokens while later steps run, at most two runs (2·FEED_STEPS_MAX steps) behind.
pub(crate) const FEED_HIST: usize = 64;
const _: () = assert!(2 * crate::backend::FEED_STEPS_MAX <= FEED_HIST);

/// Where a queued read of fed steps' tokens lands: a pinned (cached: the host reads it)
/// copy of the whole token history (256 bytes: one copy, where the run's slice of it may
/// wrap; entries that later steps write meanwhile are not read), the run's first position
/// and length, the event its copy records and the event that marks its steps done on the
/// main stream.
struct ReadSlot {
    hist: PinnedHostSlice<i32>,
    run: (usize, usize),
    copied: CudaEvent,
    done: CudaEvent,
}

/// A captured graph, owned behind `Steps::graphs`' mutex.
struct Graph(CudaGraph);
// SAFETY: CUDA graph handles may be used from any thread once the context is bound (cudarc
// binds it on every call); ferrolm only touches them under `Steps::graphs`' mutex.
unsafe impl Send for Graph {}

/// The staged inputs of a forward call.
struct Staged {
    cap: usize,
    /// Entries of each block table (the full layers', the sliding layers'), copied whole
    /// (a captured step's copy has a fixed size); past a table's end, -1.
    tab_cap: usize,
    tab_host: [PinnedHostSlice<i32>; 2],
    tab_dev: [CudaSlice<i32>; 2],
    /// The staged call's largest position + 1 (its longest sequence).
    end: usize,
    /// Each row's offset of its sequence's table in `tab_dev` (per kind).
    row_tab_host: [PinnedHostSlice<i32>; 2],
    row_tab_dev: [CudaSlice<i32>; 2],
    tok_host: PinnedHostSlice<i32>,
    tok_dev: CudaSlice<i32>,
    pos_host: PinnedHostSlice<i32>,
    pos_dev: CudaSlice<i32>,
    /// The rows the head reads: each sequence's last row, then 0 (`Backend::gather_last_rows`).
    sel_host: PinnedHostSlice<i32>,
    sel_dev: CudaSlice<i32>,
    /// The tokens fed steps chose, at their position modulo FEED_HIST (sample.cu's argmax).
    hist_dev: CudaSlice<i32>,
    /// Recorded after each direct upload of the staged values; `stage` waits for it.
    uploaded: CudaEvent,
    /// A fed step's token and position, kept while its capture's dry pass runs.
    fed_kept: CudaSlice<i32>,
}

#[derive(Default)]
pub(crate) struct Steps {
    staged: Mutex<Option<Staged>>,
    /// Captured decode steps by session key, and how many were captured (tests check reuse).
    graphs: Mutex<HashMap<u64, Graph>>,
    captures: AtomicUsize,
    /// Set while a fed step is queued or captured: its token and position are on the
    /// device already, so `begin` copies nothing.
    feeding: AtomicBool,
    /// The call under way is invariant (`Backend::begin`; a call of several sequences is):
    /// no one-row GEMV, fused decode attention or flash.
    invariant: AtomicBool,
    /// The invariant call under way computes generated rows (`Backend::begin_generated`):
    /// its GEMVs and attention take the decode step's kernels, batched over its rows.
    generated: AtomicBool,
    /// Attention splits of the engine call under way (`call`): fixed per captured graph, so
    /// the split kernels take this count and kept scratch. 0 outside such calls.
    call_splits: AtomicUsize,
    reads: Mutex<Vec<ReadSlot>>,
}

impl Steps {
    /// Decode steps captured so far (each a graph instantiated).
    pub(crate) fn captures(&self) -> usize {
        self.captures.load(Relaxed)
    }

    /// The device addresses of the staged (token ids, position): what the ops read.
    /// `tokens` is how many ids the caller reads.
    pub(crate) fn inputs(&self, ctx: &Context, tokens: usize, what: &str) -> Result<(KArg, KArg)> {
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st
            .as_ref()
            .filter(|s| s.cap >= tokens)
            .ok_or_else(|| Error::Invalid(format!("CUDA {what} without staged tokens")))?;
        Ok((ctx.arg(&s.tok_dev), ctx.arg(&s.pos_dev)))
    }

    /// The staged position's device address.
    pub(crate) fn pos(&self, ctx: &Context, what: &str) -> Result<KArg> {
        self.inputs(ctx, 0, what).map(|(_, p)| p)
    }

    pub(crate) fn invariant(&self) -> bool {
        self.invariant.load(Relaxed)
    }

    /// Whether the call under way computes generated rows (`generated` above).
    pub(crate) fn generated(&self) -> bool {
        self.generated.load(Relaxed)
    }

    /// The engine call's attention splits (`call`), 0 outside one.
    pub(crate) fn call_splits(&self) -> usize {
        self.call_splits.load(Relaxed)
    }

    /// The staged head rows' device address (`Backend::gather_last_rows`), for `rows` rows.
    pub(crate) fn head_rows(&self, ctx: &Context, rows: usize) -> Result<KArg> {
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st
            .as_ref()
            .filter(|s| s.cap >= rows)
            .ok_or_else(|| Error::Invalid(format!("CUDA gather of {rows} head rows without staged rows")))?;
        Ok(ctx.arg(&s.sel_dev))
    }

    /// The staged call's longest sequence (its largest position + 1).
    pub(crate) fn end(&self) -> usize {
        self.staged.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map_or(0, |s| s.end)
    }

    /// The staged block tables' device address (the sliding layers' or the full ones') and
    /// the rows' offsets into them. A call of one sequence has its table at offset 0.
    pub(crate) fn tables(&self, ctx: &Context, sliding: bool, what: &str) -> Result<[KArg; 2]> {
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_ref().ok_or_else(|| Error::Invalid(format!("CUDA {what} without staged block tables")))?;
        Ok([ctx.arg(&s.tab_dev[sliding as usize]), ctx.arg(&s.row_tab_dev[sliding as usize])])
    }

    /// Where a fed step's argmax writes the next step's input: (token, position, token
    /// history).
    pub(crate) fn feed_args(&self, ctx: &Context) -> Result<[KArg; 3]> {
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_ref().ok_or_else(|| Error::Invalid("CUDA fed argmax without a staged step".into()))?;
        Ok([ctx.arg(&s.tok_dev), ctx.arg(&s.pos_dev), ctx.arg(&s.hist_dev)])
    }

    /// Write the call's tokens, each row's position and table offsets (unless `tables_only`:
    /// a fed step's token and position are on the device), the head rows and the spans'
    /// block tables (concatenated, per kind) into the pinned staging buffers. Tokens past
    /// the spans' rows are a padded call's: position -1 (they write and attend nothing).
    /// The buffers grow (dropping the captured graphs that point at the old ones) when a
    /// call has more rows or tables.
    fn stage(&self, ctx: &Context, tokens: &[u32], spans: &[Span<'_>], tables_only: bool) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let rows = tokens.len().max(spans.iter().map(|s| s.rows).sum());
        let tab_len = [false, true].map(|k| spans.iter().map(|s| s.table(k).len()).sum::<usize>());
        let tab_len = tab_len[0].max(tab_len[1]);
        if st.as_ref().is_none_or(|s| s.cap < rows || s.tab_cap < tab_len) {
            // A queued read (a speculative step's, never taken) may still copy from the old
            // token history on the read stream: let it finish before the history is freed.
            ctx.read_stream.synchronize().map_err(drv("waiting for queued reads"))?;
            let cap = rows.next_power_of_two().max(128);
            let tab_cap = tab_len.next_power_of_two().max(64);
            // SAFETY (each pinned buffer): written below before any copy reads it.
            let pinned = |n: usize| unsafe { ctx.ctx.alloc_pinned::<i32>(n) }.map_err(drv("allocating pinned memory"));
            let uploaded = ctx.ctx.new_event(None).map_err(drv("creating an event"))?;
            let staged = Staged {
                cap,
                end: 0,
                tab_cap,
                tab_host: [pinned(tab_cap)?, pinned(tab_cap)?],
                tab_dev: [
                    ctx.zeros(tab_cap, "allocating block tables")?,
                    ctx.zeros(tab_cap, "allocating block tables")?,
                ],
                row_tab_host: [pinned(cap)?, pinned(cap)?],
                row_tab_dev: [ctx.zeros(cap, "allocating table offsets")?, ctx.zeros(cap, "allocating table offsets")?],
                tok_host: pinned(cap)?,
                tok_dev: ctx.zeros(cap, "allocating token ids")?,
                pos_host: pinned(cap)?,
                pos_dev: ctx.zeros(cap, "allocating positions")?,
                sel_host: pinned(cap)?,
                sel_dev: ctx.zeros(cap, "allocating head rows")?,
                hist_dev: ctx.zeros(FEED_HIST, "allocating the token history")?,
                uploaded,
                fed_kept: ctx.zeros(2, "allocating a fed step's kept input")?,
            };
            self.graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
            *st = Some(staged);
        }
        let s = st.as_mut().expect("set above");
        // The last direct upload (not a graph's) may still be queued: it reads these
        // buffers when it runs. cudarc's own tracking of that is off (Context::new).
        s.uploaded.synchronize().map_err(drv("waiting for the last upload"))?;
        if !tables_only {
            s.end = spans.iter().map(|sp| sp.pos0 + sp.rows).max().unwrap_or(0);
            let th = s.tok_host.as_mut_slice().map_err(drv("writing token ids"))?;
            for (d, &t) in th.iter_mut().zip(tokens) {
                *d = t as i32;
            }
            let ph = s.pos_host.as_mut_slice().map_err(drv("writing positions"))?;
            let positions = spans.iter().flat_map(|sp| (sp.pos0..sp.pos0 + sp.rows).map(|p| p as i32));
            for (d, p) in ph[..rows].iter_mut().zip(positions.chain(std::iter::repeat(-1))) {
                *d = p;
            }
            let sh = s.sel_host.as_mut_slice().map_err(drv("writing head rows"))?;
            let ends = crate::kv::span_ends(spans).into_iter().map(|r| r as i32);
            for (d, r) in sh.iter_mut().zip(ends.chain(std::iter::repeat(0))) {
                *d = r;
            }
            for (k, host) in s.row_tab_host.iter_mut().enumerate() {
                let h = host.as_mut_slice().map_err(drv("writing table offsets"))?;
                let mut off = 0;
                let offsets = spans.iter().flat_map(|sp| {
                    let o = off;
                    off += sp.table(k == 1).len();
                    std::iter::repeat_n(o as i32, sp.rows)
                });
                for (d, o) in h[..rows].iter_mut().zip(offsets.chain(std::iter::repeat(0))) {
                    *d = o;
                }
            }
        }
        for (k, host) in s.tab_host.iter_mut().enumerate() {
            let h = host.as_mut_slice().map_err(drv("writing block tables"))?;
            h.fill(-1);
            let entries = spans.iter().flat_map(|sp| sp.table(k == 1));
            for (d, &b) in h.iter_mut().zip(entries) {
                *d = b as i32; // NO_BLOCK (u32::MAX) is -1
            }
        }
        Ok(())
    }

    /// Enqueue the staged values' copies to the device.
    fn upload_staged(&self, ctx: &Context) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_mut().ok_or_else(|| Error::Invalid("CUDA forward without staged tokens".into()))?;
        ctx.stream.memcpy_htod(&s.tok_host, &mut s.tok_dev).map_err(drv("copying token ids"))?;
        ctx.stream.memcpy_htod(&s.pos_host, &mut s.pos_dev).map_err(drv("copying positions"))?;
        ctx.stream.memcpy_htod(&s.sel_host, &mut s.sel_dev).map_err(drv("copying head rows"))?;
        copy_up(ctx, &s.row_tab_host, &mut s.row_tab_dev, "copying table offsets")?;
        copy_up(ctx, &s.tab_host, &mut s.tab_dev, "copying block tables")?;
        // Not inside a capture: the event would then mark a graph node, not this upload.
        if !ctx.capturing.load(Relaxed) {
            s.uploaded.record(&ctx.stream).map_err(drv("recording the upload"))?;
        }
        Ok(())
    }

    /// Enqueue the staged block tables' copies alone (a fed run's: its tokens and
    /// positions are on the device), recorded as an upload.
    fn upload_staged_tables(&self, ctx: &Context) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_mut().ok_or_else(|| Error::Invalid("CUDA fed step without staged tables".into()))?;
        copy_up(ctx, &s.tab_host, &mut s.tab_dev, "copying block tables")?;
        s.uploaded.record(&ctx.stream).map_err(drv("recording the upload"))
    }

    /// Keep (`restore` false) or put back (true) the device's token and position of a fed
    /// step whose input only the device has (the previous fed step's argmax wrote it): its
    /// capture's dry pass must not advance them. Queued on the stream, in order.
    fn keep_fed_input(&self, ctx: &Context, restore: bool) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_mut().ok_or_else(|| Error::Invalid("a fed decode step without staged buffers".into()))?;
        let what = || drv("keeping a fed step's input");
        let (tok, pos, kept) = (&mut s.tok_dev, &mut s.pos_dev, &mut s.fed_kept);
        match restore {
            false => {
                ctx.stream.memcpy_dtod(&tok.slice(0..1), &mut kept.slice_mut(0..1)).map_err(what())?;
                ctx.stream.memcpy_dtod(&pos.slice(0..1), &mut kept.slice_mut(1..2)).map_err(what())
            }
            true => {
                ctx.stream.memcpy_dtod(&kept.slice(0..1), &mut tok.slice_mut(0..1)).map_err(what())?;
                ctx.stream.memcpy_dtod(&kept.slice(1..2), &mut pos.slice_mut(0..1)).map_err(what())
            }
        }
    }

    /// Capture `f`'s launches as the graph for `key`, keep it and launch it once.
    fn capture_and_launch(&self, ctx: &Context, key: u64, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        ctx.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("starting capture"))?;
        ctx.capturing.store(true, Relaxed);
        let r = f();
        ctx.capturing.store(false, Relaxed);
        let g = ctx.stream.end_capture(CUgraphInstantiate_flags(0));
        r?;
        let g = g
            .map_err(drv("capturing the decode step"))?
            .ok_or_else(|| Error::Invalid("CUDA capture produced no graph".into()))?;
        g.launch().map_err(drv("launching the decode graph"))?;
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).insert(key, Graph(g));
        self.captures.fetch_add(1, Relaxed);
        Ok(())
    }

    /// `Backend::begin`: stage and copy this call's tokens and position, unless a fed step's
    /// are on the device already or a capture (whose `step` staged them) only needs the copies.
    /// `Backend::begin` (`generated`: `Backend::begin_generated`, an invariant call too).
    pub(crate) fn begin(
        &self,
        ctx: &Context,
        tokens: &[u32],
        spans: &[Span<'_>],
        (invariant, generated): (bool, bool),
    ) -> Result<()> {
        if self.feeding.load(Relaxed) {
            return Ok(());
        }
        if !ctx.capturing.load(Relaxed) {
            self.invariant.store(invariant || generated || spans.len() > 1, Relaxed);
            self.generated.store(generated, Relaxed);
            self.stage(ctx, tokens, spans, false)?;
        }
        self.upload_staged(ctx)
    }

    /// `Backend::step`: replay the step captured under `key`, or a dry pass of `f` (buffers
    /// and kernels made outside the graph), then its capture.
    pub(crate) fn step(
        &self,
        ctx: &Context,
        key: u64,
        tokens: &[u32],
        spans: &[Span<'_>],
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // Stage first: a new staging buffer drops stale graphs before we look one up.
        self.invariant.store(false, Relaxed);
        self.generated.store(false, Relaxed);
        self.stage(ctx, tokens, spans, false)?;
        self.replay_or_capture(ctx, key, f)
    }

    /// Replay the graph kept under `key`, or make it: a dry pass of `f` (buffers and kernels
    /// made outside the graph), then its capture and launch.
    fn replay_or_capture(&self, ctx: &Context, key: u64, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if let Some(g) = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return g.0.launch().map_err(drv("replaying a captured graph"));
        }
        ctx.dry_pass(f)?;
        self.capture_and_launch(ctx, key, f)
    }

    /// `Backend::forward_call`: an engine call of `tokens` (padded to a captured size, the
    /// spans covering its first rows) replayed from its graph, or a dry pass and its capture.
    /// The graph's key joins the caller's `key` (whose buffers the graph uses), the store's
    /// id and the attention split count (enough for the longest sequence, to a power of
    /// two): what a graph bakes in besides the staged values.
    pub(crate) fn call(
        &self,
        ctx: &super::device::Cuda,
        (key, store): (u64, u64),
        tokens: &[u32],
        spans: &[Span<'_>],
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        self.invariant.store(true, Relaxed);
        self.stage(ctx, tokens, spans, false)?;
        let splits = super::prefill::attention_splits(self.end(), &ctx.cfg).next_power_of_two();
        let key =
            CALL_TAG | (store & 0xffff) << 44 | u64::from(splits.trailing_zeros()) << 36 | (key & ((1 << 36) - 1));
        self.call_splits.store(splits, Relaxed);
        let r = self.replay_or_capture(ctx, key, f);
        self.call_splits.store(0, Relaxed);
        r
    }

    pub(crate) fn forget(&self, key: u64) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
    }

    /// `Backend::step_fed` (`generated`: the steps are generated calls', invariant).
    pub(crate) fn step_fed(
        &self,
        ctx: &Context,
        (key, generated): (u64, bool),
        token: Option<u32>,
        span: &Span<'_>,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // Staging waits for the previous upload from the pinned buffers to finish, and a new
        // staging buffer drops stale graphs before we look one up. The tables go up before
        // the run's graph (which copies nothing: its inputs are on the device); they only
        // gain blocks for later positions while an earlier run is queued (a sliding layer's
        // blocks go back a run late: kv::seq::SeqCache).
        let t: &[u32] = match &token {
            Some(t) => std::slice::from_ref(t),
            None => &[],
        };
        // The host's token sits at the span's first position (one row: the run's first).
        let first = Span { rows: 1, ..*span };
        // Set here: `begin` returns at once while a fed step is queued.
        self.invariant.store(generated, Relaxed);
        self.generated.store(generated, Relaxed);
        self.stage(ctx, t, &[first], token.is_none())?;
        match token {
            Some(_) => self.upload_staged(ctx)?,
            None => self.upload_staged_tables(ctx)?,
        }
        let captured = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&key);
        self.feeding.store(true, Relaxed);
        let r = match (captured, token) {
            (true, _) => self.graphs.lock().unwrap_or_else(|e| e.into_inner())[&key]
                .0
                .launch()
                .map_err(drv("replaying the fed decode graph")),
            // As in `step`, a dry pass before the capture; the input goes back before the
            // capture runs: the host's, or (a run fed by the one before it) the device's
            // own, kept before the pass.
            (false, Some(_)) => ctx
                .dry_pass(f)
                .and_then(|()| self.upload_staged(ctx))
                .and_then(|()| self.capture_and_launch(ctx, key, f)),
            (false, None) => self
                .keep_fed_input(ctx, false)
                .and_then(|()| ctx.dry_pass(f))
                .and_then(|()| self.keep_fed_input(ctx, true))
                .and_then(|()| self.capture_and_launch(ctx, key, f)),
        };
        self.feeding.store(false, Relaxed);
        r
    }

    /// `Backend::queue_read`. The fed steps' argmax also wrote their tokens to the device
    /// history at their positions, which the steps after them do not touch for FEED_HIST − n
    /// steps. The whole history is copied (256 bytes, one copy however the run wraps) on
    /// the read stream once these steps are done, and the main stream goes straight on to
    /// the next steps (a copy queued between two steps' graphs delayed the second by its
    /// latency).
    pub(crate) fn queue_read(&self, ctx: &Context, pos: usize, n: usize, slot: usize) -> Result<()> {
        if n == 0 || n > crate::backend::FEED_STEPS_MAX {
            return Err(Error::Invalid(format!(
                "a queued read of {n} fed steps (1 to {} at once)",
                crate::backend::FEED_STEPS_MAX
            )));
        }
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let hist =
            &st.as_ref().ok_or_else(|| Error::Invalid("CUDA queued read without a staged step".into()))?.hist_dev;
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        while reads.len() <= slot {
            // Cached (not write-combined) pinned memory: the host reads it. SAFETY: written by
            // the copy below before `take_read` reads it.
            let copy = unsafe { ctx.ctx.alloc_pinned_with_flags::<i32>(FEED_HIST, 0) }
                .map_err(drv("allocating pinned memory"))?;
            // Spinning events: the host waits for each step's token, so wake-up latency counts.
            let copied = ctx.ctx.new_event(None).map_err(drv("creating an event"))?;
            let done = ctx.ctx.new_event(None).map_err(drv("creating an event"))?;
            reads.push(ReadSlot { hist: copy, run: (0, 0), copied, done });
        }
        // cudarc's own event tracking is off (Context::new): these events order the copy
        // after the steps, and mark its completion for take_read.
        let r = &mut reads[slot];
        r.run = (pos, n);
        r.done.record(&ctx.stream).map_err(drv("queueing a read"))?;
        ctx.read_stream.wait(&r.done).map_err(drv("queueing a read"))?;
        ctx.read_stream.memcpy_dtoh(hist, &mut r.hist).map_err(drv("queueing a read"))?;
        r.copied.record(&ctx.read_stream).map_err(drv("queueing a read"))
    }

    /// `Backend::take_read`.
    pub(crate) fn take_read(&self, slot: usize) -> Result<Vec<u32>> {
        let reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        let r = reads.get(slot).ok_or_else(|| Error::Invalid(format!("read slot {slot} was never queued")))?;
        r.copied.synchronize().map_err(drv("waiting for a queued read"))?;
        let hist = r.hist.as_slice().map_err(drv("reading a queued read"))?;
        let (pos, n) = r.run;
        Ok((pos..pos + n).map(|p| hist[p % FEED_HIST] as u32).collect())
    }
}

/// Enqueue copies of staged pinned buffers (one per table kind) to their device twins.
fn copy_up(ctx: &Context, host: &[PinnedHostSlice<i32>; 2], dev: &mut [CudaSlice<i32>; 2], what: &str) -> Result<()> {
    for (h, d) in host.iter().zip(dev.iter_mut()) {
        ctx.stream.memcpy_htod(h, d).map_err(drv(what))?;
    }
    Ok(())
}
