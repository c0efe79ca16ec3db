//! `Backend` for CUDA: each op hands its work to the phase that runs it (decode.rs for one
//! token, prefill.rs and gemm.rs / flash.rs for many, elementwise.rs, sampling.rs, steps.rs
//! for staging and graphs). The CPU backend is the reference each is tested against.

use super::device::Cuda;
use super::driver::drv;
use super::gemv::{GemvExtra, GemvIn, GemvOut};
use super::tensors::{ActBuf, CudaAct, CudaKv, CudaMat};
use crate::backend::{Attend, Backend, DecodeLayer, LayerScratch, LayerShape, LayerWeights, Rope};
use crate::config::{Activation, ModelConfig};
use crate::kv::scheme::KvScheme;
use crate::kv::{KvBlocks, Span};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;

impl Backend for Cuda {
    type Act = CudaAct;
    type Mat = CudaMat;
    type Vector = CudaSlice<f32>;
    type Kv = CudaKv;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device_memory(&self) -> Result<Option<(String, usize, usize)>> {
        let (free, total) = self.ctx.ctx.mem_get_info().map_err(drv("reading memory use"))?;
        Ok(Some((self.device_name.clone(), total - free, total)))
    }
    fn copy_bandwidth(&self) -> Result<Option<f64>> {
        self.measure_copy_bandwidth().map(Some)
    }
    fn prefill_chunk(&self) -> usize {
        self.cfg.prefill_chunk
    }
    fn matrix(&self, w: crate::quant::Weight) -> Result<CudaMat> {
        self.ctx.matrix(w)
    }
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector> {
        self.upload(&v, "uploading a vector")
    }
    fn act(&self, rows: usize, cols: usize) -> Result<CudaAct> {
        Ok(CudaAct { rows, cols, buf: ActBuf::Bf16(self.zeros(rows * cols, "allocating activations")?) })
    }
    fn act_f32(&self, rows: usize, cols: usize) -> Result<CudaAct> {
        Ok(CudaAct { rows, cols, buf: ActBuf::F32(self.zeros(rows * cols, "allocating logits")?) })
    }
    fn kv_store(&self, cfg: &ModelConfig, blocks: KvBlocks) -> Result<CudaKv> {
        self.kv_store_bf16(cfg, blocks, true)
    }
    fn kv_store_scheme(&self, cfg: &ModelConfig, blocks: KvBlocks, scheme: &KvScheme) -> Result<CudaKv> {
        match scheme {
            KvScheme::Bf16 => self.kv_store(cfg, blocks),
            s => self.kv_store_quant(cfg, blocks, s),
        }
    }
    fn kv_blocks(&self, kv: &CudaKv) -> KvBlocks {
        kv.blocks
    }
    fn kv_row_bytes(&self, kv: &CudaKv, layer: usize) -> usize {
        kv.row_bytes(layer)
    }
    fn kv_export(&self, kv: &CudaKv, layer: usize, rows: &[usize], out: &mut Vec<u8>) -> Result<()> {
        kv.export(self, layer, rows, out)
    }
    fn kv_import(&self, kv: &mut CudaKv, layer: usize, rows: &[usize], data: &[u8]) -> Result<()> {
        kv.import(self, layer, rows, data)
    }
    fn begin(&self, tokens: &[u32], spans: &[Span<'_>], invariant: bool) -> Result<()> {
        self.scratch.wgmma_ahead.lock().unwrap_or_else(|e| e.into_inner()).forget();
        self.steps.begin(self, tokens, spans, (invariant, false))
    }
    fn begin_generated(&self, tokens: &[u32], spans: &[Span<'_>]) -> Result<()> {
        self.steps.begin(self, tokens, spans, (true, true))
    }
    fn prepare_layer(&self, w: &crate::backend::LayerWeights<'_, Self>, rows: usize) -> Result<()> {
        self.prepare_wgmma_layer(w, rows)
    }
    /// Generated rows take the decode step's kernels, batched (decode_rows.rs).
    fn generated_rows_apart(&self) -> bool {
        true
    }
    fn step(&self, key: u64, tokens: &[u32], spans: &[Span<'_>], f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        one_sequence(spans)?;
        self.steps.step(self, key, tokens, spans, f)
    }
    fn call_rows(&self, m: usize) -> Option<usize> {
        self.captures_calls_of(m).then(|| m.next_power_of_two())
    }
    fn store_id(&self, kv: &CudaKv) -> u64 {
        kv.id
    }
    fn forward_call(
        &self,
        key: (u64, u64),
        tokens: &[u32],
        spans: &[Span<'_>],
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        match self.captures_calls_of(tokens.len()) {
            true => self.steps.call(self, key, tokens, spans, f),
            false => f(),
        }
    }
    fn forget(&self, key: u64) {
        self.steps.forget(key)
    }
    fn feeds_steps(&self) -> bool {
        self.cfg.feed_steps
    }
    fn step_fed(
        &self,
        key: u64,
        token: Option<u32>,
        spans: &[Span<'_>],
        generated: bool,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let s = one_sequence(spans)?;
        self.steps.step_fed(self, (key, generated), token, s, f)
    }
    fn queue_read(&self, _x: &CudaAct, pos: usize, n: usize, slot: usize) -> Result<()> {
        self.steps.queue_read(self, pos, n, slot)
    }
    fn take_read(&self, slot: usize) -> Result<Vec<u32>> {
        self.steps.take_read(slot)
    }
    fn embed(&self, table: &CudaMat, tokens: &[u32], scale: f32, out: &mut CudaAct) -> Result<()> {
        self.embed_rows(table, tokens.len(), scale, out, 0)
    }
    fn rms_norm(&self, x: &CudaAct, w: &Self::Vector, eps: f32, out: &mut CudaAct) -> Result<()> {
        self.rms_norm_rows(x, w, eps, out)
    }
    fn rms_norm_heads(&self, x: &mut CudaAct, w: &Self::Vector, eps: f32) -> Result<()> {
        self.rms_norm_heads_rows(x, w, eps)
    }
    /// One row on the decode GEMV (gemv_bb / gemv_bf), else prefill.rs.
    fn matmul(&self, x: &CudaAct, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
        if self.gemv(GemvIn::Bf16(x), &[w], &mut [&mut *out], GemvOut::Store, GemvExtra::None)? {
            return Ok(());
        }
        self.matmul_rows(x, w, out)
    }
    fn matmul_many(&self, x: &CudaAct, ws: &[&CudaMat], outs: &mut [&mut CudaAct]) -> Result<()> {
        if self.gemv(GemvIn::Bf16(x), ws, outs, GemvOut::Store, GemvExtra::None)? {
            return Ok(());
        }
        // Matrices of different formats (mixed-bit models): one launch each, one row still
        // on the decode GEMV.
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, w, o)?;
        }
        Ok(())
    }
    fn add_bias(&self, x: &mut CudaAct, bias: &Self::Vector) -> Result<()> {
        self.add_bias_rows(x, bias)
    }
    fn rope(&self, x: &mut CudaAct, n_heads: usize, _spans: &[Span<'_>], rope: &Rope) -> Result<()> {
        self.rope_rows(x, n_heads, rope) // at the staged position
    }
    fn attention(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        _spans: &[Span<'_>],
        attend: Attend,
        out: &mut CudaAct,
    ) -> Result<()> {
        match kv.quant {
            Some(_) => self.kv_encode(None, (k, v), kv, layer, None, None, q.cols / kv.head_dim)?,
            None => self.kv_write(k, v, kv, layer)?,
        }
        self.attention_cached(q, kv, layer, attend, out)
    }
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        q: &mut CudaAct,
        k: &mut CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        _spans: &[Span<'_>],
        rope: &Rope,
        (n_heads, _n_kv): (usize, usize),
        attend: Attend,
        out: &mut CudaAct,
    ) -> Result<()> {
        // One row outside an invariant call, or a generated call's rows (batched:
        // decode_rows.rs): RoPE and the cache write happen inside (q and k stay unrotated).
        match (q.rows == 1 && !self.steps.invariant()) || self.steps.generated() {
            true => self.attention_decode(q, (k, v), kv, layer, (rope, attend, None), out),
            false => self.prefill_attention(q, (k, v), kv, layer, rope, n_heads, attend, out),
        }
    }
    /// One row: the norm folded into the decode GEMV (gemv_nb / gemv_nf).
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
        if self.gemv(GemvIn::Norm(x, norm, eps), ws, outs, GemvOut::Store, GemvExtra::None)? {
            return Ok(());
        }
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_many(xn, ws, outs)
    }
    /// One row: gemv_ns / gemv_ng (the norm folded in, SwiGLU / GeGLU in the store); else
    /// the gate and up products, then `glu`.
    #[allow(clippy::too_many_arguments)]
    fn norm_glu(
        &self,
        x: &CudaAct,
        (norm, eps): (&Self::Vector, f32),
        xn: &mut CudaAct,
        (gate, up): (&CudaMat, &CudaMat),
        act: Activation,
        g: &mut CudaAct,
        u: &mut CudaAct,
        out: &mut CudaAct,
    ) -> Result<()> {
        let norm_in = GemvIn::Norm(x, norm, eps);
        let glu = GemvOut::Glu(act);
        if self.cfg.decode_fused_glu
            && self.gemv(norm_in, &[gate, up], &mut [&mut *out, &mut *u], glu, GemvExtra::None)?
        {
            return Ok(());
        }
        // An invariant call's rows take the fused GEMM whatever their count.
        if (x.rows > 1 || self.steps.invariant()) && self.cfg.prefill_fused_glu {
            self.rms_norm(x, norm, eps, xn)?;
            if self.qgemm_glu(xn, (gate, up), act, out)? {
                return Ok(());
            }
            self.matmul_many(xn, &[gate, up], &mut [&mut *g, &mut *u])?;
            return self.glu_rows(g, u, act, out);
        }
        self.norm_matmul_many(x, norm, eps, xn, &[gate, up], &mut [&mut *g, &mut *u])?;
        self.glu_rows(g, u, act, out)
    }
    /// One row: gemv_ba (the add in the store).
    fn matmul_add(&self, y: &CudaAct, w: &CudaMat, x: &mut CudaAct, tmp: &mut CudaAct) -> Result<()> {
        if self.gemv(GemvIn::Bf16(y), &[w], &mut [&mut *x], GemvOut::Add, GemvExtra::None)?
            || self.matmul_add_wgmma(y, w, x, tmp)?
        {
            return Ok(());
        }
        self.matmul(y, w, tmp)?;
        self.add(x, tmp)
    }
    /// The product (one row: the decode GEMV's store), then rmsnorm_add: the norm and the
    /// residual add in one launch.
    fn matmul_norm_add(
        &self,
        y: &CudaAct,
        w: &CudaMat,
        (norm, eps): (&Self::Vector, f32),
        x: &mut CudaAct,
        tmp: &mut CudaAct,
        _tmp2: &mut CudaAct,
    ) -> Result<()> {
        self.matmul(y, w, tmp)?;
        self.rms_norm_add_rows(tmp, norm, eps, x)
    }
    #[allow(clippy::too_many_arguments)]
    fn decode_layer(
        &self,
        w: &LayerWeights<'_, Self>,
        x: &mut CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        _spans: &[Span<'_>],
        rope: &Rope,
        shape: LayerShape,
        s: LayerScratch<'_, Self>,
    ) -> Result<()> {
        Cuda::decode_layer(self, w, x, kv, layer, rope, shape, s)
    }
    fn decode_layers(
        &self,
        layers: &[DecodeLayer<'_, Self>],
        (x, spare): (&mut CudaAct, &mut CudaAct),
        kv: &mut CudaKv,
        _spans: &[Span<'_>],
        s: LayerScratch<'_, Self>,
    ) -> Result<()> {
        Cuda::decode_layers(self, layers, (x, spare), kv, s)
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
        if self.head_argmax(x, norm, eps, head, logits, out, feed)? {
            return Ok(());
        }
        self.norm_matmul_many(x, norm, eps, xn, &[head], &mut [logits])?;
        self.argmax_f32(logits, out, feed)
    }
    fn argmax(&self, x: &CudaAct, out: &mut CudaAct) -> Result<()> {
        self.argmax_f32(x, out, false)
    }
    fn argmax_rows(&self, x: &CudaAct, out: &mut CudaAct) -> Result<()> {
        self.argmax_rows_f32(x, out)
    }
    fn argmax_fed(&self, x: &CudaAct, out: &mut CudaAct) -> Result<()> {
        self.argmax_f32(x, out, true)
    }
    fn top_k_preferred(&self) -> bool {
        self.cfg.device_top_k
    }
    fn top_k(&self, x: &CudaAct, k: usize, inv_t: f32, out: &mut CudaAct) -> Result<()> {
        crate::backend::check_top_k(x.cols, k, out.cols)?;
        self.top_k_f32(x, k, inv_t, out)
    }
    fn glu(&self, gate: &CudaAct, up: &CudaAct, act: Activation, out: &mut CudaAct) -> Result<()> {
        self.glu_rows(gate, up, act, out)
    }
    fn add(&self, x: &mut CudaAct, y: &CudaAct) -> Result<()> {
        self.add_rows(x, y)
    }
    fn slice_rows(&self, x: &CudaAct, first: usize) -> Result<CudaAct> {
        self.copy_rows(x, first)
    }
    fn gather_last_rows(&self, x: &CudaAct, spans: &[Span<'_>], out: &mut CudaAct) -> Result<()> {
        self.gather_last_rows(x, spans, out)
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

impl Cuda {
    /// Whether serving calls of `m` rows are captured and replayed (`call_rows`,
    /// `forward_call`): with `call_graphs`, up to the few-token GEMM's rows.
    fn captures_calls_of(&self, m: usize) -> bool {
        self.cfg.call_graphs && m <= super::SMALL_M
    }
}

/// A captured step's one sequence.
fn one_sequence<'a>(spans: &'a [Span<'a>]) -> Result<&'a Span<'a>> {
    match spans {
        [s] => Ok(s),
        _ => Err(Error::Unsupported(format!("CUDA captures decode steps of one sequence ({} given)", spans.len()))),
    }
}
