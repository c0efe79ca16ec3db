//! The forward-pass ops on CUDA: each launches one kernel from crates/engine/kernels/ (the
//! CPU backend is the reference each is tested against).

use super::device::{drv, ActBuf, Cuda, CudaAct, CudaKv, CudaMat, DevScales, KArg, ReadSlot, FEED_HIST};
use super::fused::{dev, scales_ptr, GemvIn, GemvOut};
use super::kernels;
use crate::backend::{Backend, Rope};
use crate::config::{ModelConfig, RopeStyle};
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, LaunchArgs, LaunchConfig, PushKernelArg};
use std::sync::atomic::Ordering::Relaxed;

fn cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0.max(1), grid.1.max(1), 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// Scales or biases as a kernel argument, whatever their precision.
pub(crate) fn push_scales<'a>(b: &mut LaunchArgs<'a>, s: &'a DevScales) {
    match s {
        DevScales::Half(v) => b.arg(v),
        DevScales::F32(v) => b.arg(v),
    };
}

/// Cached positions per attention split.
pub(crate) const ATTN_CHUNK: usize = 256;

/// Activation rows from which a matmul runs on tensor cores (below, the GEMV reads the
/// weights fewer times than the GEMM's fixed 64-token tiles waste).
const GEMM_MIN_ROWS: usize = 16;

/// Grid for a grid-stride element-wise kernel over n elements.
fn elems(n: usize) -> (u32, u32) {
    ((n.div_ceil(256)).min(4096) as u32, 1)
}

impl Cuda {
    fn simple(&self, file: &str, func: &str) -> Result<CudaFunction> {
        self.function(kernels::file(file), &[], func)
    }

    fn gemv(&self, x: &CudaAct, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
        let (rows, cols) = (w.rows() as i32, w.cols() as i32);
        if x.cols != w.cols() || out.cols != w.rows() || out.rows != x.rows {
            return Err(Error::Invalid(format!(
                "CUDA matmul shapes: x [{}, {}], w [{rows}, {cols}], out [{}, {}]",
                x.rows, x.cols, out.rows, out.cols
            )));
        }
        // One token: the decode GEMV (gemv.cu).
        if x.rows == 1 && self.gemv_fused(GemvIn::Bf16(x), &[w], &mut [&mut *out], GemvOut::Store)? {
            return Ok(());
        }
        // Prefill: tensor cores (gemm.cu) from a few tiles' worth of tokens.
        if x.rows >= GEMM_MIN_ROWS && self.qgemm_supported(w) {
            return self.qgemm(x, w, out);
        }
        let xb = x.bf16();
        let f32_out = matches!(out.buf, ActBuf::F32(_));
        let m = x.rows as i32;
        // Prefill: eight activation rows per block, so each weight chunk is read m/8 times.
        let multi = x.rows >= 4 && matches!(w, CudaMat::Affine { .. });
        let ty = if multi { x.rows.div_ceil(8) } else { x.rows };
        let c = cfg((w.rows().div_ceil(4) as u32, ty as u32), 128);
        let r = match (w, &mut out.buf) {
            (CudaMat::Affine { words, scales, biases, f, .. }, ob) => {
                let mut b = self.stream.launch_builder(&f[usize::from(f32_out) + if multi { 3 } else { 0 }]);
                b.arg(words);
                push_scales(&mut b, scales);
                push_scales(&mut b, biases);
                b.arg(xb);
                match ob {
                    ActBuf::Bf16(o) => b.arg(o),
                    ActBuf::F32(o) => b.arg(o),
                };
                b.arg(&rows).arg(&cols).arg(&m);
                // SAFETY: argument types and counts match affine.cu's qmv/qmv8 (+_f32); shapes checked above.
                unsafe { b.launch(c) }
            }
            (CudaMat::Dense { w, f, .. }, ob) => {
                let mut b = self.stream.launch_builder(&f[usize::from(f32_out)]);
                b.arg(w).arg(xb);
                match ob {
                    ActBuf::Bf16(o) => b.arg(o),
                    ActBuf::F32(o) => b.arg(o),
                };
                b.arg(&rows).arg(&cols);
                // SAFETY: argument types and counts match dense.cu's dmv/dmv_f32.
                unsafe { b.launch(c) }
            }
        };
        r.map(|_| ()).map_err(drv("matmul launch"))
    }
    /// Causal attention of q over the cache (this call's rows already written): split-K
    /// partials and their merge.
    fn attention_cached(&self, q: &CudaAct, kv: &CudaKv, layer: usize, out: &mut CudaAct) -> Result<()> {
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let p0 = &st.as_ref().ok_or_else(|| Error::Invalid("CUDA attention without a staged position".into()))?.pos_dev;
        // Split-K over the cache: the split count follows the cache size (fixed for a
        // captured graph), so decode at depth fills the GPU with heads × splits blocks.
        let hd = kv.head_dim as i32;
        let heads = (q.cols / kv.head_dim) as i32;
        let n_kv = (kv.width / kv.head_dim) as i32;
        let splits = kv.max_seq.div_ceil(ATTN_CHUNK);
        let slots = q.rows * heads as usize * splits;
        let mut ml = self.stream.alloc_zeros::<f32>(2 * slots).map_err(drv("allocating attention scratch"))?;
        let mut acc =
            self.stream.alloc_zeros::<f32>(slots * kv.head_dim).map_err(drv("allocating attention scratch"))?;
        let (chunk, nsplit) = (ATTN_CHUNK as i32, splits as i32);
        let a = self.simple("attention.cu", "attention_split")?;
        let mut b = self.stream.launch_builder(&a);
        b.arg(q.bf16()).arg(&kv.k[layer]).arg(&kv.v[layer]).arg(&mut ml).arg(&mut acc);
        b.arg(&heads).arg(&n_kv).arg(&hd).arg(p0).arg(&chunk);
        let c = LaunchConfig {
            grid_dim: (heads as u32, q.rows as u32, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches attention.cu's attention_split; scratch sized [m, heads, splits].
        unsafe { b.launch(c) }.map_err(drv("attention launch"))?;
        let mg = self.simple("attention.cu", "attention_merge")?;
        let mut bm = self.stream.launch_builder(&mg);
        bm.arg(&ml).arg(&acc).arg(out.bf16_mut()).arg(&heads).arg(&hd).arg(&nsplit);
        // SAFETY: matches attention.cu's attention_merge.
        unsafe { bm.launch(cfg((heads as u32, q.rows as u32), hd as u32)) }
            .map(|_| ())
            .map_err(drv("attention merge launch"))
    }
}

impl Backend for Cuda {
    type Act = CudaAct;
    type Mat = CudaMat;
    type Vector = cudarc::driver::CudaSlice<f32>;
    type Kv = CudaKv;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device_memory(&self) -> Result<Option<(String, usize, usize)>> {
        let (free, total) = self.ctx.mem_get_info().map_err(drv("reading memory use"))?;
        Ok(Some((self.device_name.clone(), total - free, total)))
    }
    fn copy_bandwidth(&self) -> Result<Option<f64>> {
        self.measure_copy_bandwidth().map(Some)
    }
    fn prefill_chunk(&self) -> usize {
        // 64-token GEMM tiles: 512 rows give small models' matmuls enough blocks, and a
        // 1B model's MLP activations stay ~25 MB.
        512
    }
    fn matrix(&self, w: crate::quant::Weight) -> Result<CudaMat> {
        Cuda::matrix(self, w)
    }
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector> {
        self.upload(&v, "uploading a vector")
    }
    fn act(&self, rows: usize, cols: usize) -> Result<CudaAct> {
        let buf = self.stream.alloc_zeros::<u16>(rows * cols).map_err(drv("allocating activations"))?;
        Ok(CudaAct { rows, cols, buf: ActBuf::Bf16(buf) })
    }
    fn act_f32(&self, rows: usize, cols: usize) -> Result<CudaAct> {
        let buf = self.stream.alloc_zeros::<f32>(rows * cols).map_err(drv("allocating logits"))?;
        Ok(CudaAct { rows, cols, buf: ActBuf::F32(buf) })
    }
    fn kv_cache(&self, cfg: &ModelConfig, max_seq: usize) -> Result<CudaKv> {
        let width = cfg.n_kv_heads * cfg.head_dim;
        if !cfg.head_dim.is_multiple_of(32) || cfg.head_dim > 256 {
            return Err(Error::Unsupported(format!(
                "CUDA attention needs head_dim a multiple of 32 up to 256 ({})",
                cfg.head_dim
            )));
        }
        let layer = || self.stream.alloc_zeros::<u16>(max_seq * width).map_err(drv("allocating the KV cache"));
        let k = (0..cfg.n_layers).map(|_| layer()).collect::<Result<Vec<_>>>()?;
        let v = (0..cfg.n_layers).map(|_| layer()).collect::<Result<Vec<_>>>()?;
        Ok(CudaKv { max_seq, width, head_dim: cfg.head_dim, k, v })
    }
    fn kv_capacity(&self, kv: &CudaKv) -> usize {
        kv.max_seq
    }
    fn begin(&self, tokens: &[u32], pos0: usize) -> Result<()> {
        // A fed step's token and position are on the device already (the previous step's
        // argmax, or step_fed's own upload).
        if self.feeding.load(Relaxed) {
            return Ok(());
        }
        // While capturing, `step` has staged these values already; only the copies go in.
        if !self.capturing.load(Relaxed) {
            self.stage(tokens, pos0)?;
        }
        self.upload_staged()
    }
    fn step(&self, key: u64, tokens: &[u32], pos0: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        // Stage first: a new staging buffer drops stale graphs before we look one up.
        self.stage(tokens, pos0)?;
        if let Some(g) = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return g.0.launch().map_err(drv("replaying the decode graph"));
        }
        // Buffers created on first use (decode work, attention scratch, RoPE tables) and
        // kernels are made outside the graph: a dry pass of the step first.
        self.before_capture(f)?;
        self.capture_and_launch(key, f)
    }
    fn forget(&self, key: u64) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
    }
    /// On unless `FERROLM_CUDA_FEED=0` (every greedy step then waits for the host to read
    /// its token and stage the next: for comparisons).
    fn feeds_steps(&self) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("FERROLM_CUDA_FEED").map_or(true, |v| v != "0"))
    }
    fn step_fed(&self, key: u64, token: Option<u32>, pos0: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let captured = self.graphs.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&key);
        // Staging waits for the previous upload from the pinned buffer to finish.
        if let Some(t) = token {
            self.stage(&[t], pos0)?;
            self.upload_staged()?;
        }
        self.feeding.store(true, Relaxed);
        let r = match (captured, token) {
            (true, _) => self.graphs.lock().unwrap_or_else(|e| e.into_inner())[&key]
                .0
                .launch()
                .map_err(drv("replaying the fed decode graph")),
            // As in `step`, a pass before the capture; should its argmax have run and advanced
            // the device's token and position, this step's go back before the capture runs:
            // the host's, or (a run fed by the one before it, e.g. a generation's first
            // one-step tail after runs of 8) the device's own, kept before the pass.
            (false, Some(_)) => self
                .before_capture(f)
                .and_then(|()| self.upload_staged())
                .and_then(|()| self.capture_and_launch(key, f)),
            (false, None) => self
                .keep_fed_input(false)
                .and_then(|()| self.before_capture(f))
                .and_then(|()| self.keep_fed_input(true))
                .and_then(|()| self.capture_and_launch(key, f)),
        };
        self.feeding.store(false, Relaxed);
        r
    }
    fn queue_read(&self, _x: &CudaAct, pos: usize, n: usize, slot: usize) -> Result<()> {
        if n == 0 || n > crate::backend::FEED_STEPS_MAX {
            return Err(Error::Invalid(format!(
                "a queued read of {n} fed steps (1 to {} at once)",
                crate::backend::FEED_STEPS_MAX
            )));
        }
        // The fed steps' argmax also wrote their tokens to the device history at their
        // positions, which the steps after them do not touch for FEED_HIST − n steps. The
        // whole history is copied (256 bytes, one copy however the run wraps; the entries
        // later steps write meanwhile are not read) on the read stream once these steps are
        // done, and the main stream goes straight on to the next steps (a copy queued
        // between two steps' graphs delayed the second by its latency).
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let hist =
            &st.as_ref().ok_or_else(|| Error::Invalid("CUDA queued read without a staged step".into()))?.hist_dev;
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        while reads.len() <= slot {
            // Cached (not write-combined) pinned memory: the host reads it. SAFETY: written by
            // the copy below before `take_read` reads it.
            let copy = unsafe { self.ctx.alloc_pinned_with_flags::<i32>(FEED_HIST, 0) }
                .map_err(drv("allocating pinned memory"))?;
            // Spinning events: the host waits for each step's token, so wake-up latency counts.
            let copied = self.ctx.new_event(None).map_err(drv("creating an event"))?;
            let done = self.ctx.new_event(None).map_err(drv("creating an event"))?;
            reads.push(ReadSlot { hist: copy, run: (0, 0), copied, done });
        }
        // cudarc's own event tracking is off (see `Cuda::new`): these events order the copy
        // after the steps, and mark its completion for take_read.
        let r = &mut reads[slot];
        r.run = (pos, n);
        r.done.record(&self.stream).map_err(drv("queueing a read"))?;
        self.read_stream.wait(&r.done).map_err(drv("queueing a read"))?;
        self.read_stream.memcpy_dtoh(hist, &mut r.hist).map_err(drv("queueing a read"))?;
        r.copied.record(&self.read_stream).map_err(drv("queueing a read"))
    }
    fn take_read(&self, slot: usize) -> Result<Vec<u32>> {
        let reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        let r = reads.get(slot).ok_or_else(|| Error::Invalid(format!("read slot {slot} was never queued")))?;
        r.copied.synchronize().map_err(drv("waiting for a queued read"))?;
        let hist = r.hist.as_slice().map_err(drv("reading a queued read"))?;
        let (pos, n) = r.run;
        Ok((pos..pos + n).map(|p| hist[p % FEED_HIST] as u32).collect())
    }
    fn embed(&self, table: &CudaMat, tokens: &[u32], out: &mut CudaAct) -> Result<()> {
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let ids = &st
            .as_ref()
            .filter(|s| s.cap >= tokens.len())
            .ok_or_else(|| Error::Invalid("CUDA embed without staged tokens".into()))?
            .tok_dev;
        let cols = table.cols() as i32;
        let c = cfg((tokens.len() as u32, 1), 256);
        let ActBuf::F32(o) = &mut out.buf else {
            return Err(Error::Invalid("CUDA embed writes the f32 residual stream".into()));
        };
        let r = match table {
            CudaMat::Affine { words, scales, biases, f, .. } => {
                // With PDL (affine.cu's embed waits before it reads the token): a run of fed
                // steps in one graph overlaps each step's start with the last one's head.
                let args = [
                    dev(self, words),
                    KArg::Ptr(scales_ptr(self, scales)),
                    KArg::Ptr(scales_ptr(self, biases)),
                    dev(self, ids),
                    dev(self, o),
                    KArg::I32(cols),
                ];
                return self.launch(&f[2], c, &args, "embed launch");
            }
            CudaMat::Dense { w, f, .. } => {
                let mut b = self.stream.launch_builder(&f[2]);
                b.arg(w).arg(ids).arg(o).arg(&cols);
                // SAFETY: matches dense.cu's dembed.
                unsafe { b.launch(c) }
            }
        };
        r.map(|_| ()).map_err(drv("embed launch"))
    }
    fn rms_norm(&self, x: &CudaAct, w: &Self::Vector, eps: f32, out: &mut CudaAct) -> Result<()> {
        let cols = x.cols as i32;
        let f = match x.buf {
            ActBuf::F32(_) => self.simple("rmsnorm.cu", "rmsnorm")?,
            ActBuf::Bf16(_) => self.simple("rmsnorm.cu", "rmsnorm_bf16")?,
        };
        let mut b = self.stream.launch_builder(&f);
        match &x.buf {
            ActBuf::F32(v) => b.arg(v),
            ActBuf::Bf16(v) => b.arg(v),
        };
        b.arg(w).arg(out.bf16_mut()).arg(&cols).arg(&eps);
        // SAFETY: matches rmsnorm.cu's rmsnorm / rmsnorm_bf16 for the input's dtype.
        unsafe { b.launch(cfg((x.rows as u32, 1), 256)) }.map(|_| ()).map_err(drv("rmsnorm launch"))
    }
    fn matmul(&self, x: &CudaAct, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
        self.gemv(x, w, out)
    }
    fn matmul_many(&self, x: &CudaAct, ws: &[&CudaMat], outs: &mut [&mut CudaAct]) -> Result<()> {
        if self.gemv_fused(GemvIn::Bf16(x), ws, outs, GemvOut::Store)? {
            return Ok(());
        }
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            self.gemv(x, w, o)?;
        }
        Ok(())
    }
    fn add_bias(&self, x: &mut CudaAct, bias: &Self::Vector) -> Result<()> {
        let f = self.simple("elementwise.cu", "add_bias")?;
        let (cols, n) = (x.cols as i32, (x.rows * x.cols) as i32);
        let mut b = self.stream.launch_builder(&f);
        b.arg(x.bf16_mut()).arg(bias).arg(&cols).arg(&n);
        // SAFETY: matches elementwise.cu's add_bias.
        unsafe { b.launch(cfg(elems(n as usize), 256)) }.map(|_| ()).map_err(drv("add_bias launch"))
    }
    fn rope(&self, x: &mut CudaAct, n_heads: usize, pos0: usize, rope: &Rope) -> Result<()> {
        let freqs = self.rope_freqs_for(rope)?;
        let f = self.simple("rope.cu", "rope")?;
        let _ = pos0; // the kernel reads the staged position
        let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let p0 = &st.as_ref().ok_or_else(|| Error::Invalid("CUDA rope without a staged position".into()))?.pos_dev;
        let (rows, heads, hd) = (x.rows as i32, n_heads as i32, (x.cols / n_heads) as i32);
        let inter = i32::from(rope.style == RopeStyle::Interleaved);
        let n = x.rows * x.cols / 2;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x.bf16_mut()).arg(&freqs).arg(&rows).arg(&heads).arg(&hd).arg(p0).arg(&rope.linear).arg(&inter);
        // SAFETY: matches rope.cu.
        unsafe { b.launch(cfg(elems(n), 256)) }.map(|_| ()).map_err(drv("rope launch"))
    }
    fn attention(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        pos0: usize,
        out: &mut CudaAct,
    ) -> Result<()> {
        let w = self.simple("attention.cu", "kv_write")?;
        let _ = pos0; // the kernels read the staged position
        {
            let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
            let p0 =
                &st.as_ref().ok_or_else(|| Error::Invalid("CUDA attention without a staged position".into()))?.pos_dev;
            let (rows, width) = (k.rows as i32, kv.width as i32);
            let mut b = self.stream.launch_builder(&w);
            b.arg(&mut kv.k[layer]).arg(&mut kv.v[layer]).arg(k.bf16()).arg(v.bf16()).arg(&rows).arg(&width).arg(p0);
            // SAFETY: matches attention.cu's kv_write; pos0 + rows ≤ max_seq is checked by the model.
            unsafe { b.launch(cfg(elems(k.rows * kv.width), 256)) }.map_err(drv("kv_write launch"))?;
        }
        self.attention_cached(q, kv, layer, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        q: &mut CudaAct,
        k: &mut CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        pos0: usize,
        rope: &Rope,
        (n_heads, _n_kv): (usize, usize),
        out: &mut CudaAct,
    ) -> Result<()> {
        let _ = pos0; // the kernels read the staged position
        if q.rows == 1 {
            // RoPE and the cache write happen inside (q and k stay unrotated).
            return self.attention_decode(q, (k, v), kv, layer, rope, out);
        }
        self.rope_kv(q, k, v, kv, layer, rope, n_heads)?;
        if kernels::FLASH_HEAD_DIMS.contains(&kv.head_dim) {
            self.flash_prefill(q, kv, layer, out)
        } else {
            self.attention_cached(q, kv, layer, out)
        }
    }
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul_many(
        &self,
        x: &CudaAct,
        norm: &Self::Vector,
        eps: f32,
        xn: &mut CudaAct,
        ws: &[&CudaMat],
        outs: &mut [&mut CudaAct],
    ) -> Result<()> {
        self.fused_norm_matmul_many(x, norm, eps, xn, ws, outs)
    }
    #[allow(clippy::too_many_arguments)]
    fn norm_swiglu(
        &self,
        x: &CudaAct,
        norm: &Self::Vector,
        eps: f32,
        xn: &mut CudaAct,
        gate: &CudaMat,
        up: &CudaMat,
        g: &mut CudaAct,
        u: &mut CudaAct,
        out: &mut CudaAct,
    ) -> Result<()> {
        self.fused_norm_swiglu(x, norm, eps, xn, (gate, up), (g, u), out)
    }
    fn matmul_add(&self, y: &CudaAct, w: &CudaMat, x: &mut CudaAct, tmp: &mut CudaAct) -> Result<()> {
        self.fused_matmul_add(y, w, x, tmp)
    }
    fn attention_block(
        &self,
        x: &mut CudaAct,
        norm: (&Self::Vector, f32),
        w: (&CudaMat, &CudaMat, &CudaMat, &CudaMat),
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        scratch: (&mut CudaAct, &mut CudaAct, &mut CudaAct, &mut CudaAct),
    ) -> Result<bool> {
        self.fused_attention_block(x, norm, w, kv, layer, rope, scratch)
    }
    fn decode_layers(
        &self,
        layers: &[crate::backend::LayerWeights<'_, Self>],
        kv: &mut CudaKv,
        rope: &Rope,
        heads: (usize, usize),
        eps: f32,
        bufs: crate::backend::DecodeBufs<'_, Self>,
    ) -> Result<bool> {
        self.mk_decode_layers(layers, kv, rope, heads, eps, bufs)
    }
    fn o_proj_mlp(
        &self,
        att: &CudaAct,
        wo: &CudaMat,
        x: &mut CudaAct,
        (norm, eps): (&Self::Vector, f32),
        mlp: (&CudaMat, &CudaMat, &CudaMat),
        (xn, g, u, tmp): (&mut CudaAct, &mut CudaAct, &mut CudaAct, &mut CudaAct),
        act: &mut CudaAct,
    ) -> Result<()> {
        use super::ffn::LayerEndFusion;
        // Each fusion falls back to fewer fused launches where its kernel declines.
        let fusion = self.layer_end_fusion_for(x);
        if fusion == LayerEndFusion::OProjMlp && self.ffn_fused(x, Some((att, wo)), (norm, eps), mlp, act)? {
            return Ok(());
        }
        self.fused_matmul_add(att, wo, x, tmp)?;
        self.mlp(x, (norm, eps), mlp, (xn, g, u, tmp), act)
    }
    fn mlp(
        &self,
        x: &mut CudaAct,
        (norm, eps): (&Self::Vector, f32),
        mlp: (&CudaMat, &CudaMat, &CudaMat),
        (xn, g, u, tmp): (&mut CudaAct, &mut CudaAct, &mut CudaAct, &mut CudaAct),
        act: &mut CudaAct,
    ) -> Result<()> {
        use super::ffn::LayerEndFusion;
        // Each fusion falls back to the separate launches where its kernel declines.
        let fusion = self.layer_end_fusion_for(x);
        if fusion == LayerEndFusion::SplitK && self.ffn_splitk(x, (norm, eps), mlp, act)? {
            return Ok(());
        }
        if matches!(fusion, LayerEndFusion::Mlp | LayerEndFusion::OProjMlp)
            && self.ffn_fused(x, None, (norm, eps), mlp, act)?
        {
            return Ok(());
        }
        // Down's x staged by the SwiGLU launch (staged.rs), where the kernels cover it.
        if self.mlp_staged(x, (norm, eps), mlp, (&mut *u, &mut *tmp), act)? {
            return Ok(());
        }
        self.fused_norm_swiglu(x, norm, eps, xn, (mlp.0, mlp.1), (g, u), act)?;
        self.fused_matmul_add(act, mlp.2, x, tmp)
    }
    fn norm_head_argmax(
        &self,
        x: &CudaAct,
        (norm, eps): (&Self::Vector, f32),
        xn: &mut CudaAct,
        head: &CudaMat,
        logits: &mut CudaAct,
        out: &mut CudaAct,
        feed: bool,
    ) -> Result<()> {
        // The argmax found by the head launch itself (head.rs), where its kernel covers it.
        if self.head_argmax(x, norm, eps, head, logits, out, feed)? {
            return Ok(());
        }
        self.fused_norm_matmul_many(x, norm, eps, xn, &[head], &mut [logits])?;
        self.argmax_f32(logits, out, feed)
    }
    fn argmax(&self, x: &CudaAct, out: &mut CudaAct) -> Result<()> {
        self.argmax_f32(x, out, false)
    }
    fn argmax_fed(&self, x: &CudaAct, out: &mut CudaAct) -> Result<()> {
        self.argmax_f32(x, out, true)
    }
    /// On unless `FERROLM_CUDA_TOPK=0` (host sampling from read-back logits, for
    /// comparisons): the device top-k reads back 8·k bytes instead of the vocabulary.
    fn top_k_preferred(&self) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("FERROLM_CUDA_TOPK").map_or(true, |v| v != "0"))
    }
    fn top_k(&self, x: &CudaAct, k: usize, inv_t: f32, out: &mut CudaAct) -> Result<()> {
        crate::backend::check_top_k(x.cols, k, out.cols)?;
        self.top_k_f32(x, k, inv_t, out)
    }
    fn silu_mul(&self, gate: &CudaAct, up: &CudaAct, out: &mut CudaAct) -> Result<()> {
        let f = self.simple("elementwise.cu", "silu_mul")?;
        let n = (gate.rows * gate.cols) as i32;
        let mut b = self.stream.launch_builder(&f);
        b.arg(gate.bf16()).arg(up.bf16()).arg(out.bf16_mut()).arg(&n);
        // SAFETY: matches elementwise.cu's silu_mul.
        unsafe { b.launch(cfg(elems(n as usize), 256)) }.map(|_| ()).map_err(drv("silu_mul launch"))
    }
    fn add(&self, x: &mut CudaAct, y: &CudaAct) -> Result<()> {
        let n = (x.rows * x.cols) as i32;
        let f = match x.buf {
            ActBuf::F32(_) => self.simple("elementwise.cu", "add_f32_bf16")?,
            ActBuf::Bf16(_) => self.simple("elementwise.cu", "add_inplace")?,
        };
        let mut b = self.stream.launch_builder(&f);
        match &mut x.buf {
            ActBuf::F32(v) => b.arg(v),
            ActBuf::Bf16(v) => b.arg(v),
        };
        b.arg(y.bf16()).arg(&n);
        // SAFETY: matches elementwise.cu's add_f32_bf16 / add_inplace for x's dtype.
        unsafe { b.launch(cfg(elems(n as usize), 256)) }.map(|_| ()).map_err(drv("add launch"))
    }
    fn slice_rows(&self, x: &CudaAct, first: usize) -> Result<CudaAct> {
        let (s, e) = (first * x.cols, x.rows * x.cols);
        let buf = match &x.buf {
            ActBuf::Bf16(b) => ActBuf::Bf16(self.stream.clone_dtod(&b.slice(s..e)).map_err(drv("copying rows"))?),
            ActBuf::F32(b) => ActBuf::F32(self.stream.clone_dtod(&b.slice(s..e)).map_err(drv("copying rows"))?),
        };
        Ok(CudaAct { rows: x.rows - first, cols: x.cols, buf })
    }
    fn read_rows(&self, x: &CudaAct, first: usize) -> Result<Vec<f32>> {
        let (s, e) = (first * x.cols, x.rows * x.cols);
        Ok(match &x.buf {
            ActBuf::F32(b) => self.stream.clone_dtoh(&b.slice(s..e)).map_err(drv("reading results"))?,
            ActBuf::Bf16(b) => {
                let h: Vec<u16> = self.stream.clone_dtoh(&b.slice(s..e)).map_err(drv("reading results"))?;
                h.into_iter().map(|v| half::bf16::from_bits(v).to_f32()).collect()
            }
        })
    }
}
