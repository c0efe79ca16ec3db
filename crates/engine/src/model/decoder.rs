//! The decoder family: Llama 2/3, SmolLM2, MiniCPM5 (plain Llama), Mistral, Qwen2 (q/k/v
//! biases), Qwen3 (q/k norms), Gemma 3 (q/k norms, post-norms, GeGLU, scaled embeddings,
//! sliding-window layers with their own RoPE base). One forward pass, top to bottom.
//! Shapes: m = tokens in this call, d = hidden, h/kvh = query/kv heads, hd = head dim,
//! f = ffn width, V = vocab.

use crate::backend::{Attend, Backend, DecodeLayer, LayerScratch, LayerShape, LayerWeights, Rope, Width};
use crate::config::{AttnKind, ModelConfig};
use crate::kv::paged::NO_BLOCK;
use crate::kv::seq::SeqCache;
use crate::kv::{KvBlocks, Span, BLOCK, CALL_ROWS};
use crate::{Error, Result};

mod calls;
mod load;
pub use calls::RowOut;

pub struct Layer<B: Backend> {
    attn_norm: B::Vector,              // [d]
    wq: B::Mat,                        // [h·hd, d]
    wk: B::Mat,                        // [kvh·hd, d]
    wv: B::Mat,                        // [kvh·hd, d]
    bias: Option<[B::Vector; 3]>,      // q/k/v biases (Qwen2)
    qk_norm: Option<[B::Vector; 2]>,   // [hd] each (Qwen3, Gemma 3)
    wo: B::Mat,                        // [d, h·hd]
    post_attn_norm: Option<B::Vector>, // [d] (Gemma 3)
    mlp_norm: B::Vector,               // [d]
    w_gate: B::Mat,                    // [f, d]
    w_up: B::Mat,                      // [f, d]
    w_down: B::Mat,                    // [d, f]
    post_mlp_norm: Option<B::Vector>,  // [d] (Gemma 3)
    kind: AttnKind,
}

impl<B: Backend> Layer<B> {
    fn weights(&self) -> LayerWeights<'_, B> {
        LayerWeights {
            attn_norm: &self.attn_norm,
            wq: &self.wq,
            wk: &self.wk,
            wv: &self.wv,
            qkv_bias: self.bias.as_ref().map(|[q, k, v]| [q, k, v]),
            qk_norm: self.qk_norm.as_ref().map(|[q, k]| [q, k]),
            wo: &self.wo,
            post_attn_norm: self.post_attn_norm.as_ref(),
            mlp_norm: &self.mlp_norm,
            w_gate: &self.w_gate,
            w_up: &self.w_up,
            w_down: &self.w_down,
            post_mlp_norm: self.post_mlp_norm.as_ref(),
        }
    }
}

pub struct Decoder<B: Backend> {
    pub cfg: ModelConfig,
    pub backend: B,
    embed: B::Mat, // [V, d]
    layers: Vec<Layer<B>>,
    norm: B::Vector,         // [d]
    lm_head: Option<B::Mat>, // [V, d]; None = tied to embed
    rope: Rope,
    /// The sliding-window layers' rotation, where it differs (Gemma 3's local base).
    rope_local: Option<Rope>,
    /// Logits per position: the vocabulary, or the tokenizer's part of a padded one.
    logits_width: usize,
    /// Weight bytes one decode step reads (all matrices; the embedding table when tied).
    pub decode_weight_bytes: usize,
    /// The decode (one-token) buffers, kept between steps.
    decode_work: std::sync::Mutex<Vec<Work<B>>>,
    /// Serving calls' buffers by padded size, kept for the captured calls that use them
    /// (calls.rs).
    call_work: std::sync::Mutex<Vec<calls::CallWork<B>>>,
    /// Finished generation sessions' caches and step buffers, for the next (generate.rs).
    pub(crate) session_pool: std::sync::Mutex<Vec<crate::generate::SessionParts<B>>>,
    /// How sessions' and the serving engine's caches store keys and values (kv_cache.rs).
    pub(crate) kv_scheme: crate::kv::scheme::KvScheme,
    /// Leading positions kept in bf16 in a quantized cache (`--kv-start`, whole blocks).
    pub(crate) kv_start: usize,
}

/// Where a forward call's head writes: its logits buffer, and (greedy steps) the argmax's
/// buffer and whether it feeds the next step.
type HeadOut<'a, B> = (Option<&'a mut <B as Backend>::Act>, Option<(&'a mut <B as Backend>::Act, bool)>);

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position: `[V]` (generation).
    Last,
    /// Every position: `[m, V]` (teacher forcing, perplexity).
    All,
    /// Stop before layer n and return the residual stream `[m, d]` (bisecting a backend
    /// against the reference layer by layer).
    Hidden(usize),
}

impl<B: Backend> Decoder<B> {
    /// Logits per position (`cfg.vocab`, or the tokenizer's ids of a padded vocabulary).
    pub fn logits_width(&self) -> usize {
        self.logits_width
    }

    /// Run `tokens` at positions pos0.. through the model, appending to the cache (pos0 at
    /// most its length). Returns logits `[V]` (Last) or `[m, V]` (All).
    pub fn forward(&self, tokens: &[u32], pos0: usize, kv: &mut SeqCache<B>, which: Logits) -> Result<Vec<f32>> {
        if tokens.len() > CALL_ROWS && kv.windowed() {
            return self.forward_split(tokens, pos0, kv, which);
        }
        let rows = match which {
            Logits::All => tokens.len(),
            Logits::Last => 1,
            Logits::Hidden(_) => {
                return self.forward_into(tokens, pos0, kv, which, None).map(|v| v.unwrap_or_default())
            }
        };
        let mut logits = self.backend.act_f32_as(rows, self.logits_width, Width::Vocab)?; // [rows, V]
        self.forward_into(tokens, pos0, kv, which, Some(&mut logits))?;
        self.backend.read_rows(&logits, 0)
    }

    /// `forward` as consecutive calls of CALL_ROWS tokens at most (the same logits: each
    /// call attends to what the ones before cached), their rows joined.
    fn forward_split(&self, tokens: &[u32], pos0: usize, kv: &mut SeqCache<B>, which: Logits) -> Result<Vec<f32>> {
        let mut out = vec![];
        let n = tokens.len().div_ceil(CALL_ROWS);
        for (i, chunk) in tokens.chunks(CALL_ROWS).enumerate() {
            let rows = self.forward(chunk, pos0 + i * CALL_ROWS, kv, which)?;
            match which {
                Logits::Last if i + 1 < n => {}
                _ => out.extend(rows),
            }
        }
        Ok(out)
    }

    /// The forward pass proper, writing logits into `logits` on the device (so a decode step
    /// can be captured and replayed); `Logits::Hidden` returns the residual stream instead.
    pub fn forward_into(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut SeqCache<B>,
        which: Logits,
        logits: Option<&mut B::Act>,
    ) -> Result<Option<Vec<f32>>> {
        self.forward_seq(tokens, pos0, kv, which, logits, None)
    }

    /// `forward_into` for a greedy step: the last position's logits into `logits` and their
    /// argmax into `out` (`Backend::norm_head_argmax`, which may find it as the head stores
    /// the logits; fed to the next step on the device when `feed`).
    pub fn forward_argmax(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut SeqCache<B>,
        logits: &mut B::Act,
        out: &mut B::Act,
        feed: bool,
    ) -> Result<()> {
        self.forward_seq(tokens, pos0, kv, Logits::Last, Some(logits), Some((out, feed))).map(|_| ())
    }

    fn forward_seq(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut SeqCache<B>,
        which: Logits,
        logits: Option<&mut B::Act>,
        argmax: Option<(&mut B::Act, bool)>,
    ) -> Result<Option<Vec<f32>>> {
        let m = tokens.len();
        kv.prepare(pos0, m)?;
        let r = {
            let (store, span) = kv.span(pos0, m);
            self.forward_impl(tokens, &[span], store, which, (logits, argmax))
        };
        if r.is_ok() {
            kv.advance(pos0 + m);
        }
        r
    }

    /// Refuse a call without tokens, with a token outside the vocabulary, whose spans do
    /// not cover its tokens or whose tables do not hold every block it writes or attends
    /// (an error, never an out-of-range index in a kernel).
    fn check_call(&self, tokens: &[u32], spans: &[Span<'_>], blocks: KvBlocks) -> Result<()> {
        let m = tokens.len();
        if m == 0 {
            return Err(Error::Invalid("forward: no tokens".into()));
        }
        self.check_vocab(tokens)?;
        self.check_spans(m, spans, blocks)
    }

    /// Refuse a token outside the vocabulary.
    fn check_vocab(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.cfg.vocab;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&t) => Err(Error::Invalid(format!("token id {t} is outside the vocabulary ({vocab})"))),
            None => Ok(()),
        }
    }

    /// Refuse spans that do not cover a call's m rows, or whose tables do not hold every
    /// block the call writes or attends.
    fn check_spans(&self, m: usize, spans: &[Span<'_>], blocks: KvBlocks) -> Result<()> {
        let c = &self.cfg;
        if spans.iter().map(|s| s.rows).sum::<usize>() != m || spans.iter().any(|s| s.rows == 0) {
            return Err(Error::Invalid(format!("forward: {} spans do not cover {m} tokens", spans.len())));
        }
        let sliding_layers = crate::kv::sliding_layers(c);
        let (sliding, full) = (sliding_layers > 0, sliding_layers < c.n_layers);
        for s in spans {
            let end = s.pos0 + s.rows;
            if end > c.max_ctx {
                return Err(Error::Invalid(format!(
                    "{} tokens at position {} exceed the model's context of {} tokens",
                    s.rows, s.pos0, c.max_ctx
                )));
            }
            let last = end.div_ceil(BLOCK);
            let held = |t: &[u32], from: usize, n: usize| {
                t.len() >= last && t[from..last].iter().all(|&b| b != NO_BLOCK && (b as usize) < n)
            };
            let window_from = (s.pos0 + 1).saturating_sub(c.sliding_window) / BLOCK;
            // The full layers' ids: the main blocks, then the bf16 head blocks (`--kv-start`).
            if (full && !held(s.full, 0, blocks.full + blocks.head))
                || (sliding && !held(s.sliding, window_from, blocks.sliding))
            {
                return Err(Error::Invalid(format!(
                    "forward: the block tables do not hold positions {}..{end}",
                    s.pos0
                )));
            }
        }
        Ok(())
    }

    fn forward_impl(
        &self,
        tokens: &[u32],
        spans: &[Span<'_>],
        kv: &mut B::Kv,
        which: Logits,
        out: HeadOut<'_, B>,
    ) -> Result<Option<Vec<f32>>> {
        let (b, c, m) = (&self.backend, &self.cfg, tokens.len());
        self.check_call(tokens, spans, b.kv_blocks(kv))?;
        b.begin(tokens, spans, false)?;
        // Decode reuses its buffers (a captured step must find the same ones on every
        // replay, and allocations would be graph nodes); prefill allocates per call. The
        // pool only grows (calls on several threads at once), so no buffer a captured graph
        // points at is ever freed.
        let one_row = m == 1;
        let cached = match one_row {
            true => self.decode_work.lock().unwrap_or_else(|e| e.into_inner()).pop(),
            false => None,
        };
        let mut w = match cached {
            Some(w) => w,
            None => Work::new(b, c, m, one_row)?,
        };
        let r = self.layers_into(tokens, spans, kv, which, out, &mut w);
        if one_row {
            self.decode_work.lock().unwrap_or_else(|e| e.into_inner()).push(w);
        }
        r
    }

    /// The layers, then the final norm and the head into `logits` (and their argmax, when
    /// asked: (out, fed)).
    fn layers_into(
        &self,
        tokens: &[u32],
        spans: &[Span<'_>],
        kv: &mut B::Kv,
        which: Logits,
        (logits, argmax): HeadOut<'_, B>,
        w: &mut Work<B>,
    ) -> Result<Option<Vec<f32>>> {
        let (b, c, m) = (&self.backend, &self.cfg, tokens.len());
        // The layers before the one whose input is wanted (Logits::Hidden), or all.
        let stop = match which {
            Logits::Hidden(li) => li.min(self.layers.len()),
            _ => self.layers.len(),
        };
        self.run_layers((tokens, spans), kv, stop, w, m == 1)?;
        // Only the rows whose logits are wanted go through the final norm and the head:
        // every row, or the sequence's last.
        let rows = match which {
            Logits::All => m,
            Logits::Last => 1,
            Logits::Hidden(_) => return b.read_rows(&w.x, 0).map(Some),
        };
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = logits.ok_or_else(|| Error::Invalid("forward_into: no logits buffer".into()))?;
        let tail;
        let x = match rows == m {
            true => &w.x,
            false => {
                tail = b.slice_rows(&w.x, m - 1)?;
                &tail
            }
        };
        if w.last.is_none() {
            w.last = Some(b.act(rows, c.hidden)?);
        }
        let last = w.last.as_mut().expect("set above");
        match argmax {
            // [1, V], and its argmax [1]
            Some((out, feed)) if rows == 1 => {
                b.norm_head_argmax(x, (&self.norm, c.rms_eps), last, head, logits, out, feed)?
            }
            Some(_) => return Err(Error::Invalid("forward: an argmax of several rows".into())),
            None => b.norm_matmul_many(x, &self.norm, c.rms_eps, last, &[head], &mut [logits])?, // [rows, V]
        }
        Ok(None)
    }

    /// The embedding and the first `stop` layers over the call's rows, into w.x: with
    /// `decode` (one token, or a generated call's rows; w with the spare residual) through
    /// the backend's decode step.
    fn run_layers(
        &self,
        (tokens, spans): (&[u32], &[Span<'_>]),
        kv: &mut B::Kv,
        stop: usize,
        w: &mut Work<B>,
        decode: bool,
    ) -> Result<()> {
        let (b, c) = (&self.backend, &self.cfg);
        b.embed(&self.embed, tokens, c.embed_scale, &mut w.x)?;
        let layers = self.layer_list(stop);
        let (x, spare, mut s) = w.scratch();
        match (decode, spare) {
            // The backend's decode step, the same math as layer_ops (CUDA:
            // backend/cuda/decode.rs).
            (true, Some(spare)) => b.decode_layers(&layers, (x, spare), kv, spans, s.reborrow()),
            _ => {
                let rows = tokens.len();
                for (i, l) in layers.iter().enumerate() {
                    if i == 0 {
                        b.prepare_layer(&l.weights, rows)?;
                    }
                    if let Some(next) = layers.get(i + 1) {
                        b.prepare_layer(&next.weights, rows)?;
                    }
                    layer_ops(b, &l.weights, x, kv, l.index, spans, l.rope, l.shape, s.reborrow())?;
                }
                Ok(())
            }
        }
    }

    /// The first `stop` layers with their weights, shapes and rotations.
    fn layer_list(&self, stop: usize) -> Vec<DecodeLayer<'_, B>> {
        let c = &self.cfg;
        let full = Attend { scale: c.attn_scale(), window: None };
        let shape =
            LayerShape { heads: c.n_heads, kv_heads: c.n_kv_heads, eps: c.rms_eps, act: c.activation, attend: full };
        let sliding = LayerShape { attend: Attend { window: Some(c.sliding_window), ..full }, ..shape };
        self.layers[..stop]
            .iter()
            .enumerate()
            .map(|(li, l)| {
                let (shape, rope) = match l.kind {
                    AttnKind::Full => (shape, &self.rope),
                    AttnKind::Sliding => (sliding, self.rope_local.as_ref().unwrap_or(&self.rope)),
                };
                DecodeLayer { weights: l.weights(), index: li, rope, shape }
            })
            .collect()
    }
}

/// One decoder layer as the backend's ops, for the m rows of the residual stream x at
/// their sequences' positions (`spans`): x += [post-norm] o_proj(attention(rope([norm] q), rope([norm] k), v))
/// with q/k/v = proj(norm(x)) (+ biases), then the gated MLP
/// x += [post-norm] down(act(gate(norm(x))) · up(norm(x))). The bracketed norms are
/// Gemma's and Qwen3's.
#[allow(clippy::too_many_arguments)]
pub fn layer_ops<B: Backend>(
    b: &B,
    w: &LayerWeights<'_, B>,
    x: &mut B::Act,
    kv: &mut B::Kv,
    layer: usize,
    spans: &[Span<'_>],
    rope: &Rope,
    shape: LayerShape,
    mut s: LayerScratch<'_, B>,
) -> Result<()> {
    let eps = shape.eps;
    attend(b, w, x, kv, layer, spans, rope, shape, s.reborrow())?;
    let LayerScratch { xn, att, o, gate, up, act, .. } = s;
    project_add(b, (att, w.wo), w.post_attn_norm.map(|n| (n, eps)), x, (o, xn))?;
    b.norm_glu(x, (w.mlp_norm, eps), xn, (w.w_gate, w.w_up), shape.act, gate, up, act)?;
    project_add(b, (act, w.w_down), w.post_mlp_norm.map(|n| (n, eps)), x, (o, xn))
}

/// A layer's attention up to its output projection: s.att = attention(rope([norm] q),
/// rope([norm] k), v) with q/k/v = proj(norm(x)) (+ biases).
#[allow(clippy::too_many_arguments)]
pub fn attend<B: Backend>(
    b: &B,
    w: &LayerWeights<'_, B>,
    x: &B::Act,
    kv: &mut B::Kv,
    layer: usize,
    spans: &[Span<'_>],
    rope: &Rope,
    shape: LayerShape,
    s: LayerScratch<'_, B>,
) -> Result<()> {
    let LayerScratch { xn, q, k, v, att, .. } = s;
    let eps = shape.eps;
    b.norm_matmul_many(x, w.attn_norm, eps, xn, &[w.wq, w.wk, w.wv], &mut [&mut *q, &mut *k, &mut *v])?;
    if let Some([bq, bk, bv]) = w.qkv_bias {
        b.add_bias(q, bq)?;
        b.add_bias(k, bk)?;
        b.add_bias(v, bv)?;
    }
    if let Some([qn, kn]) = w.qk_norm {
        b.rms_norm_heads(q, qn, eps)?;
        b.rms_norm_heads(k, kn, eps)?;
    }
    b.rope_attention(q, k, v, kv, layer, spans, rope, (shape.heads, shape.kv_heads), shape.attend, att)
}

/// A block's output projection into the residual: x += y·wᵀ, RMS-normed first where the
/// layer has a post-norm (Gemma). tmp and tmp2 are scratch `[m, out]`.
pub fn project_add<B: Backend>(
    b: &B,
    (y, w): (&B::Act, &B::Mat),
    post_norm: Option<(&B::Vector, f32)>,
    x: &mut B::Act,
    (tmp, tmp2): (&mut B::Act, &mut B::Act),
) -> Result<()> {
    match post_norm {
        Some(norm) => b.matmul_norm_add(y, w, norm, x, tmp, tmp2),
        None => b.matmul_add(y, w, x, tmp),
    }
}

/// One forward call's activations for m tokens.
pub struct Work<B: Backend> {
    x: B::Act,             // [m, d] residual stream, f32 on every backend
    spare: Option<B::Act>, // [1, d] f32, decode_layers' second residual buffer (m = 1)
    xn: B::Act,            // [m, d] normed
    q: B::Act,             // [m, h·hd]
    k: B::Act,             // [m, kvh·hd]
    v: B::Act,             // [m, kvh·hd]
    att: B::Act,           // [m, h·hd]
    o: B::Act,             // [m, d]
    gate: B::Act,          // [m, f]
    up: B::Act,            // [m, f]
    act: B::Act,           // [m, f]
    last: Option<B::Act>,  // [rows of logits, d] normed input of the head
}

impl<B: Backend> Work<B> {
    /// The residual stream, the spare residual (decode) and the layers' scratch.
    fn scratch(&mut self) -> (&mut B::Act, Option<&mut B::Act>, LayerScratch<'_, B>) {
        let Work { x, spare, xn, q, k, v, att, o, gate, up, act, last: _ } = self;
        let s = LayerScratch { xn, q, k, v, att, o, gate, up, act };
        (x, spare.as_mut(), s)
    }

    /// `decode`: the decode path's buffers (with the spare residual): one row, or a
    /// generated call's rows.
    fn new(b: &B, c: &ModelConfig, m: usize, decode: bool) -> Result<Self> {
        let (d, qd, kvd) = (c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        Ok(Work {
            x: b.act_f32(m, d)?,
            spare: if decode { Some(b.act_f32(m, d)?) } else { None },
            xn: b.act(m, d)?,
            q: b.act_as(m, qd, Width::Heads)?,
            k: b.act_as(m, kvd, Width::KvHeads)?,
            v: b.act_as(m, kvd, Width::KvHeads)?,
            att: b.act_as(m, qd, Width::Heads)?,
            o: b.act(m, d)?,
            gate: b.act_as(m, c.ffn, Width::Ffn)?,
            up: b.act_as(m, c.ffn, Width::Ffn)?,
            act: b.act_as(m, c.ffn, Width::Ffn)?,
            last: None,
        })
    }
}
