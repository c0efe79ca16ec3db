//! The decode step: one token through a decoder layer in five launches (a Llama one; a Gemma 3
//! one too, its post-norm adds folded into the next GEMV's input), chained by
//! programmatic dependent launch (each kernel's weight loads overlap the previous kernel's
//! tail) and captured once per session into a CUDA graph that every later step replays
//! (steps.rs).
//!
//! Budget (H200, the Llama-3.2-1B shape at 4 bits, 695.1 MB per token, docs/perf.md): half
//! the measured copy bandwidth would be 325.9 µs per token, 18.0 µs per layer after the
//! head and the embedding. Today a layer's path is ~26.8 µs (q/k/v 4.15, attention 6.28, o
//! 4.51, gate/up 7.07, down 4.78 µs in the kernel timeline), 39% of copy bandwidth; with
//! every layer weight free the same launches still take ~22 µs: dependent latency (the
//! release, x from L2, the staging, the stores), not bytes, sets the pace.

use super::context::Order;
use super::device::Cuda;
use super::driver::KArg;
use super::gemv::{staged_x_fits, x_staging, GemvExtra, GemvIn, GemvOut, WARPS};
use super::kernels;
use super::tensors::{CudaAct, CudaKv, CudaMat};
use crate::backend::{Attend, Backend, DecodeLayer, LayerScratch, LayerShape, LayerWeights, Rope};
use crate::config::{Activation, RopeStyle};
use crate::model::decoder::project_add;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, LaunchConfig};
use std::sync::atomic::Ordering::Relaxed;

/// The q and k norms' gains and their epsilon.
pub(crate) type QkNorm<'a> = ([&'a CudaSlice<f32>; 2], f32);

/// Cached positions per decode attention split: small, so even a short context spreads
/// over many blocks (heads × splits), each a few loads deep.
const DECODE_CHUNK: usize = 64;
/// Most splits attention_decode.cu's merge holds (SPLITS_MAX there).
const DECODE_SPLITS_MAX: usize = 1024;
/// Most blocks of a decode attention cluster (8: the portable cluster size).
pub(crate) const ATTN_CLUSTER_MAX: usize = 8;

/// How attention_decode splits a head's positions: query heads, heads a block, positions
/// per split (the smallest split for attention_decode_rows) and the cluster size.
#[derive(Clone, Copy)]
pub(crate) struct DecodeSplit {
    pub heads: usize,
    pub qb: usize,
    pub chunk: usize,
    pub cluster: usize,
}

/// A post-norm add carried into the next launch: the residual is `x + rmsnorm(o)·gain`
/// with o the scratch output of the last GEMV (decode_layers).
type Pending<'a> = Option<&'a CudaSlice<f32>>;

impl Cuda {
    /// A decode step's layers. Gemma 3's (post-norms after attention and MLP) run as five
    /// launches each instead of seven: a post-norm add is not a launch of its own but
    /// folded into the next GEMV's input staging (gemv.cu's input p), the attention's into
    /// gate/up and the MLP's into the next layer's q/k/v, the residual moving between x and
    /// `spare` (a block of the GEMV writes the completed one while every block reads the
    /// other). The last layer's is added after the loop. Other layers: `decode_layer`.
    pub(crate) fn decode_layers(
        &self,
        layers: &[DecodeLayer<'_, Cuda>],
        (x, spare): (&mut CudaAct, &mut CudaAct),
        kv: &mut CudaKv,
        mut s: LayerScratch<'_, Cuda>,
    ) -> Result<()> {
        let mut pending: Pending = None;
        for l in layers {
            let w = &l.weights;
            let eps = l.shape.eps;
            match (w.post_attn_norm, w.post_mlp_norm) {
                (Some(pa), Some(pm)) if self.cfg.post_norm_fold && w.qkv_bias.is_none() => {
                    self.decode_layer_folded(l, (&mut *x, &mut *spare), pending, kv, pa, s.reborrow())?;
                    pending = Some(pm);
                }
                _ => {
                    if let Some(g) = pending.take() {
                        self.rms_norm_add_into(spare, s.o, g, eps, x)?;
                    }
                    self.decode_layer(w, x, kv, l.index, l.rope, l.shape, s.reborrow())?;
                }
            }
        }
        if let (Some(g), Some(l)) = (pending, layers.last()) {
            self.rms_norm_add_into(spare, s.o, g, l.shape.eps, x)?;
        }
        Ok(())
    }

    /// A Gemma 3 layer in five launches, the residual in `x` (`pending` None) or in `spare`
    /// with the previous layer's post-MLP add pending; on return it is in `spare` with this
    /// layer's post-MLP add pending (the down output in o):
    /// 1. q/k/v (gemv_pb, or gemv_nb with nothing pending), the completed residual to x;
    /// 2. attention_decode;
    /// 3. o stored;
    /// 4. gate/up GeGLU (gemv_pg), x + rmsnorm(o)·pa to spare;
    /// 5. down stored.
    fn decode_layer_folded(
        &self,
        l: &DecodeLayer<'_, Cuda>,
        (x, spare): (&mut CudaAct, &mut CudaAct),
        pending: Pending,
        kv: &mut CudaKv,
        pa: &CudaSlice<f32>,
        s: LayerScratch<'_, Cuda>,
    ) -> Result<()> {
        let (w, eps) = (&l.weights, l.shape.eps);
        let qkv = [w.wq, w.wk, w.wv];
        match pending {
            Some(g) => {
                let outs = &mut [&mut *s.q, &mut *s.k, &mut *s.v];
                self.post_norm_gemv((&*spare, &*s.o, g), x, (w.attn_norm, eps), (&qkv, outs), s.xn)?
            }
            None => self.norm_matmul_many(x, w.attn_norm, eps, s.xn, &qkv, &mut [&mut *s.q, &mut *s.k, &mut *s.v])?,
        }
        let qk_norm = w.qk_norm.map(|n| (n, eps));
        self.attention_decode(s.q, (s.k, s.v), kv, l.index, (l.rope, l.shape.attend, qk_norm), s.att)?;
        self.matmul(s.att, w.wo, s.o)?;
        let glu = GemvOut::Glu(l.shape.act);
        let post = GemvIn::Post((&*x, &*s.o, pa), &*spare, w.mlp_norm, eps);
        let fused = self.cfg.decode_fused_glu;
        if fused && self.gemv(post, &[w.w_gate, w.w_up], &mut [&mut *s.act, &mut *s.up], glu, GemvExtra::None)? {
            self.post_norm_folds.fetch_add(1, Relaxed);
        } else {
            self.rms_norm_add_into(x, s.o, pa, eps, spare)?;
            self.norm_glu(spare, (w.mlp_norm, eps), s.xn, (w.w_gate, w.w_up), l.shape.act, s.gate, s.up, s.act)?;
        }
        self.matmul(s.act, w.w_down, s.o)
    }

    /// outs = ws · rmsnorm(out) with out = x + rmsnorm(y)·post (the residual, written), in
    /// one launch where gemv.cu's input p covers it; else rmsnorm_add, then the normed
    /// products (xn scratch).
    #[allow(clippy::type_complexity)]
    fn post_norm_gemv(
        &self,
        (x, y, post): (&CudaAct, &CudaAct, &CudaSlice<f32>),
        out: &mut CudaAct,
        (norm, eps): (&CudaSlice<f32>, f32),
        (ws, outs): (&[&CudaMat], &mut [&mut CudaAct]),
        xn: &mut CudaAct,
    ) -> Result<()> {
        if self.gemv(GemvIn::Post((x, y, post), out, norm, eps), ws, outs, GemvOut::Store, GemvExtra::None)? {
            self.post_norm_folds.fetch_add(1, Relaxed);
            return Ok(());
        }
        self.rms_norm_add_into(x, y, post, eps, out)?;
        self.norm_matmul_many(out, norm, eps, xn, ws, outs)
    }

    /// One layer for one token, top to bottom: x += o(attention(q, k, v)) with q/k/v from
    /// rmsnorm(x), then x += down(silu(gate(n(x))) · up(n(x))). The GEMV steps are the
    /// backend's one-row ops (ops.rs): where gemv.cu has no kernel for a weight format
    /// (dense or mixed formats, inputs over 24K wide) they run as the unfused ops, the same
    /// math. Qwen3's and Gemma's extra norms and Gemma's GeGLU run as their own launches.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_layer(
        &self,
        w: &LayerWeights<'_, Cuda>,
        x: &mut CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        shape: LayerShape,
        s: LayerScratch<'_, Cuda>,
    ) -> Result<()> {
        let eps = shape.eps;
        // 1. gemv_nb_r*: q, k, v = (wq, wk, wv)·rmsnorm(x), one launch for the three.
        self.norm_matmul_many(x, w.attn_norm, eps, s.xn, &[w.wq, w.wk, w.wv], &mut [s.q, s.k, s.v])?;
        // (Qwen2) add_bias ×3: the q/k/v biases.
        if let Some([bq, bk, bv]) = w.qkv_bias {
            self.add_bias(s.q, bq)?;
            self.add_bias(s.k, bk)?;
            self.add_bias(s.v, bv)?;
        }
        // 2. attention_decode: the q/k norms (Qwen3, Gemma 3), RoPE of q and the new k, the
        //    cache write, split-K attention over the cache and the splits' merge.
        let qk_norm = w.qk_norm.map(|n| (n, eps));
        self.attention_decode(s.q, (s.k, s.v), kv, layer, (rope, shape.attend, qk_norm), s.att)?;
        // 3. gemv_ba_r*: x += att·woᵀ (Gemma: the output normed first).
        project_add(self, (s.att, w.wo), w.post_attn_norm.map(|n| (n, eps)), x, (s.o, s.xn))?;
        // 4 and 5: the MLP.
        let mlp = (w.w_gate, w.w_up, w.w_down);
        if w.post_mlp_norm.is_none() {
            return self.decode_mlp(x, (w.mlp_norm, eps), mlp, shape.act, (s.xn, s.gate, s.up, s.o), s.act);
        }
        self.norm_glu(x, (w.mlp_norm, eps), s.xn, (w.w_gate, w.w_up), shape.act, s.gate, s.up, s.act)?;
        project_add(self, (s.act, w.w_down), w.post_mlp_norm.map(|n| (n, eps)), x, (s.o, s.xn))
    }

    /// A decode layer's MLP, x += down(act(gate(n(x))) · up(n(x))) for one row (SwiGLU or
    /// GeGLU), `out` the gated product, xn, g, u and o scratch:
    /// 4. gemv_nz_r4 (GeGLU: ny): out = act(gate·n(x)) · (up·n(x)), also written as down's
    ///    staged int16 x image; 5. gemv_qa_r*: x += out·downᵀ, x copied in from the image;
    ///    or, where staging does not apply, 4. gemv_ns_r4 (ng) and 5. gemv_ba_r*.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub fn decode_mlp(
        &self,
        x: &mut CudaAct,
        (norm, eps): (&CudaSlice<f32>, f32),
        (gate, up, down): (&CudaMat, &CudaMat, &CudaMat),
        act: Activation,
        (xn, g, u, o): (&mut CudaAct, &mut CudaAct, &mut CudaAct, &mut CudaAct),
        out: &mut CudaAct,
    ) -> Result<()> {
        if self.decode_mlp_staged(x, (norm, eps), (gate, up, down), act, &mut *u, &mut *out)? {
            return Ok(());
        }
        self.norm_glu(x, (norm, eps), xn, (gate, up), act, g, u, out)?;
        self.matmul_add(out, down, x, o)
    }

    /// Steps 4 and 5 with down's x staged by the gate/up launch (x_staged.cuh): down's blocks
    /// copy the image in after their release instead of each quantizing the whole input.
    /// Bit-identical to the unstaged launches. Only where down's own staging is heavy: each
    /// of its threads would quantize at least two 8-value parts (the 1B's 8192-wide down,
    /// +3%); SmolLM2's 1536-wide one lost 7% so (H200, docs/perf-log.md). False, nothing
    /// launched, where it does not apply.
    fn decode_mlp_staged(
        &self,
        x: &mut CudaAct,
        (norm, eps): (&CudaSlice<f32>, f32),
        (gate, up, down): (&CudaMat, &CudaMat, &CudaMat),
        act: Activation,
        u: &mut CudaAct,
        out: &mut CudaAct,
    ) -> Result<bool> {
        let ffn = gate.rows();
        let one_format = match (gate, up, down) {
            (
                CudaMat::Affine { defines: g, .. },
                CudaMat::Affine { defines: up, .. },
                CudaMat::Affine { defines: d, .. },
            ) => g == up && g == d,
            _ => false,
        };
        let int16_x = self.cfg.gemv_int16_x;
        if !self.cfg.staged_x
            || !self.cfg.decode_fused_glu
            || !one_format
            || !staged_x_fits(ffn, int16_x)
            || down.cols() != ffn
        {
            return Ok(false);
        }
        if ffn < 16 * 32 * WARPS {
            return Ok(false);
        }
        // One image a row (a generated call's rows: gemv_tokens).
        let image = self.scratch.staged_x(self, x_staging(ffn, int16_x).1 * x.rows)?;
        let gate_up = [gate, up];
        let norm_in = GemvIn::Norm(x, norm, eps);
        if !self.gemv(norm_in, &gate_up, &mut [&mut *out, u], GemvOut::Glu(act), GemvExtra::StageInto(image))? {
            return Ok(false);
        }
        // The gated launch wrote out too: should no staged down kernel fit, the plain one
        // reads that.
        let staged = GemvIn::Staged { image, cols: ffn };
        if !self.gemv(staged, &[down], &mut [&mut *x], GemvOut::Add, GemvExtra::None)? {
            let plain = self.gemv(GemvIn::Bf16(out), &[down], &mut [&mut *x], GemvOut::Add, GemvExtra::None)?;
            if !plain {
                return Err(Error::Invalid("CUDA decode MLP: down GEMV not covered after a staged SwiGLU".into()));
            }
        }
        self.staged_x_launches.fetch_add(1, Relaxed);
        Ok(true)
    }

    /// The head of a greedy step, gemv_nm_r4: logits = head·rmsnorm(x) for one row, stored,
    /// and their argmax into out[0] (with `feed`, also the next fed step's token and
    /// position), one launch: each warp keeps the best row it stored. The same reductions
    /// and tie rule as sample.cu's argmax, so the same token. False, nothing launched,
    /// where it does not apply.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_argmax(
        &self,
        x: &CudaAct,
        norm: &CudaSlice<f32>,
        eps: f32,
        head: &CudaMat,
        logits: &mut CudaAct,
        out: &mut CudaAct,
        feed: bool,
    ) -> Result<bool> {
        if !self.cfg.head_argmax || x.rows != 1 || logits.rows != 1 {
            return Ok(false);
        }
        if !out.is_f32() {
            return Err(Error::Invalid("CUDA argmax writes an f32 output".into()));
        }
        let [pv, pi, done, tok, pos, hist] = self.argmax_sink(feed)?;
        let sink = [out.arg(self), pv, pi, done, tok, pos, hist];
        let fused =
            self.gemv(GemvIn::Norm(x, norm, eps), &[head], &mut [logits], GemvOut::Store, GemvExtra::Argmax(sink))?;
        if fused {
            self.head_argmax_launches.fetch_add(1, Relaxed);
        }
        Ok(fused)
    }

    /// attention_decode (one query row): the q/k norms (gains and eps, where the layer has
    /// them), RoPE of q and of the new k, the cache write of the new k/v, attention over the
    /// cache and the split merge (through a cluster's shared memory for short caches, global
    /// memory for deep ones). q, k, v unrotated.
    pub(crate) fn attention_decode(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &mut CudaKv,
        layer: usize,
        (rope, attend, qk_norm): (&Rope, Attend, Option<QkNorm>),
        out: &mut CudaAct,
    ) -> Result<()> {
        if let Some(([qn, kn], _)) = qk_norm {
            if qn.len() != kv.head_dim || kn.len() != kv.head_dim {
                return Err(Error::Invalid(format!(
                    "q/k norms of {} and {} for head_dim {}",
                    qn.len(),
                    kn.len(),
                    kv.head_dim
                )));
            }
        }
        if self.steps.generated() {
            return self.attention_decode_rows(q, (k, v), kv, layer, (rope, attend, qk_norm), out);
        }
        let heads = q.cols / kv.head_dim;
        if kv.quant.is_some() {
            if self.cfg.fused_quant_decode && kv.head_dim <= super::kv_quant::FUSED_HEAD_DIM_MAX {
                return self.attention_decode_quant(q, (k, v), kv, layer, (rope, attend, qk_norm), out);
            }
            // q rotated into `out`, which the merge overwrites once the splits have read it.
            let q_rot = out.arg(self);
            self.kv_encode(Some((q.arg(self), q_rot)), (k, v), kv, layer, Some(rope), qk_norm, heads)?;
            return self.attention_cached_from(q_rot, (1, heads), kv, layer, attend, out);
        }
        let n_kv = kv.width / kv.head_dim;
        // Query heads per block: one on CUDA cores by default, where up to 4 of a GQA group
        // per block (each K/V row read once for all of them) give each lane 4× the scoring
        // chain on a quarter of the blocks and measured slower. Deep caches at head dims 64
        // and 128 take the group's heads a block on the tensor cores: faster from ~16K
        // cached; below, a quarter of the one-head grid leaves SMs idle.
        let group = heads / n_kv;
        let mma = matches!(kv.head_dim, 64 | 128) && kv.max_seq() >= self.cfg.attention_mma_positions;
        let most = if mma { 4 } else { self.cfg.attention_query_heads };
        let qb = (1..=most).rev().find(|d| group.is_multiple_of(*d)).unwrap_or(1);
        // Deep caches score a round's positions together (SCORE_BATCH): faster at 8K cached,
        // slower at 512. Beside a q/k/v GEMV of at least half the SMs' blocks, a deep cache's
        // kernel is the register-capped one (ATT_CAP): twice its blocks fit beside q/k/v's.
        let deep = kv.max_seq() > kernels::ATTN_DEEP_POSITIONS;
        let qkv_rows = (heads + 2 * n_kv) * kv.head_dim;
        let capped = deep && qb == 1 && qkv_rows / 32 >= self.sms / 2;
        let defines = kernels::attention_decode_defines(qb, deep, capped);
        let f = self.function(kernels::file("attention_decode.cu"), &defines, "attention_decode")?;
        // Positions per split: 64, or more where the blocks would not all be resident at
        // once (a second wave would start only as the first ends) or the merge's shared
        // memory would overflow.
        let resident = f.occupancy_max_active_blocks_per_multiprocessor(128, 0, None).unwrap_or(3).max(1) as usize;
        let max_splits = (resident * self.sms / (heads / qb)).clamp(1, DECODE_SPLITS_MAX);
        let chunk = DECODE_CHUNK.max(kv.max_seq().div_ceil(max_splits));
        let splits = kv.max_seq().div_ceil(chunk);
        // Up to 8 · 128 positions: one cluster of up to 8 blocks per head merging through
        // shared memory. Deeper caches keep one wave of single blocks merging through global
        // memory (clusters there did not all fit one wave: 1B at 8191 cached 28 → 54 µs).
        let clustered = self.clusters && self.cfg.attention_clusters && !deep && splits > 1;
        let (cs, splits, chunk) = match clustered {
            true => {
                let cs = ATTN_CLUSTER_MAX.min(splits);
                (cs, cs, kv.max_seq().div_ceil(cs))
            }
            false => (1, splits, chunk),
        };
        let scratch = self.scratch.attention(self, heads, splits, kv.head_dim)?;
        let split = DecodeSplit { heads, qb, chunk, cluster: cs };
        let mut args =
            self.attention_decode_args(q, (k, v), kv, layer, (rope, attend, qk_norm), out, scratch, split)?;
        // One sequence: its table at offset 0.
        args.push(self.steps.tables(self, kv.sliding(layer)?, "attention")?[0]);
        let c = LaunchConfig {
            grid_dim: ((heads / qb) as u32, 1, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // Matches attention_decode.cu; scratch sized [heads, splits] for this cache, `done`
        // (one counter per block column) zeroed at allocation and reset by the kernel.
        let order = if cs > 1 { Order::OverlapClustered(cs as u32) } else { Order::Overlap };
        self.launch(&f, c, &args, order, "attention_decode launch")
    }

    /// attention_decode's and attention_decode_rows' arguments up to the block tables: q,
    /// k, v and the caches, RoPE, the split scratch and output, the head counts, the
    /// positions, the split and cluster sizes, the scale and window, and the q/k norms.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_decode_args(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &CudaKv,
        layer: usize,
        (rope, attend, qk_norm): (&Rope, Attend, Option<QkNorm>),
        out: &CudaAct,
        [ml, acc, done]: [KArg; 3],
        split: DecodeSplit,
    ) -> Result<Vec<KArg>> {
        let freqs = self.scratch.rope_freqs(self, rope)?;
        let pos = self.steps.pos(self, "attention")?;
        let mut args = self.qkv_cache_args(q, (k, v), kv, layer).to_vec();
        args.extend([
            freqs,
            KArg::F32(rope.linear),
            KArg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            ml,
            acc,
            out.arg(self),
            done,
            KArg::I32(split.heads as i32),
            KArg::I32((kv.width / kv.head_dim) as i32),
            KArg::I32(kv.head_dim as i32),
            KArg::I32(split.qb as i32),
            pos,
            KArg::I32(split.chunk as i32),
            KArg::I32(split.cluster as i32),
            KArg::F32(attend.scale),
            KArg::I32(super::prefill::window_arg(attend)?),
        ]);
        match qk_norm {
            Some(([qn, kn], eps)) => args.extend([self.arg(qn), self.arg(kn), KArg::F32(eps)]),
            None => args.extend([KArg::Ptr(0), KArg::Ptr(0), KArg::F32(0.0)]),
        }
        Ok(args)
    }

    /// q, k, v and layer's K and V caches: the first arguments of rope_kv and
    /// attention_decode.
    pub(crate) fn qkv_cache_args(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &CudaKv,
        layer: usize,
    ) -> [KArg; 5] {
        [q.arg(self), k.arg(self), v.arg(self), self.arg(&kv.k[layer]), self.arg(&kv.v[layer])]
    }
}
