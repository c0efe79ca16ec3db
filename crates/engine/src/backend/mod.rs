//! Compute backends. A model is written once against [`Backend`]; the CPU backend is the
//! reference implementation, CUDA implements the same ops with the same signatures.

pub mod cpu;
pub mod cuda;
pub mod sharded;

use crate::config::{Activation, ModelConfig};
use crate::kv::Span;
use crate::quant::Weight;
use crate::Result;

/// RoPE parameters shared by every layer (inverse frequencies per rotated pair).
#[derive(Clone, Debug)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub style: crate::config::RopeStyle,
    /// Positions are divided by this (linear scaling), 1.0 normally.
    pub linear: f32,
}

/// One decoder layer's weights. Norm gains are the factors applied (Gemma's 1 + w).
pub struct LayerWeights<'a, B: Backend> {
    pub attn_norm: &'a B::Vector,
    pub wq: &'a B::Mat,
    pub wk: &'a B::Mat,
    pub wv: &'a B::Mat,
    /// q/k/v biases (Qwen2).
    pub qkv_bias: Option<[&'a B::Vector; 3]>,
    /// RMSNorm gains `[hd]` of each q and k head, applied before RoPE (Qwen3, Gemma 3).
    pub qk_norm: Option<[&'a B::Vector; 2]>,
    pub wo: &'a B::Mat,
    /// RMSNorm of the attention output before the residual add (Gemma 3).
    pub post_attn_norm: Option<&'a B::Vector>,
    pub mlp_norm: &'a B::Vector,
    pub w_gate: &'a B::Mat,
    pub w_up: &'a B::Mat,
    pub w_down: &'a B::Mat,
    /// RMSNorm of the MLP output before the residual add (Gemma 3).
    pub post_mlp_norm: Option<&'a B::Vector>,
}

impl<B: Backend> LayerWeights<'_, B> {
    /// Whether the layer is a plain Llama one: no q/k norms and no post-norms.
    pub fn is_llama(&self) -> bool {
        self.qk_norm.is_none() && self.post_attn_norm.is_none() && self.post_mlp_norm.is_none()
    }
}

/// How a layer's queries attend: the factor scores are scaled by, and for a sliding-window
/// layer how many positions each query sees (its own included).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attend {
    pub scale: f32,
    pub window: Option<usize>,
}

impl Attend {
    /// Full causal attention scaled by head_dim^-½.
    pub fn causal(head_dim: usize) -> Attend {
        Attend { scale: 1.0 / (head_dim as f32).sqrt(), window: None }
    }
    /// The first position a query at `pos` attends to.
    pub fn first(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// A layer's scratch activations for m rows: xn `[m, d]` normed, q `[m, h·hd]`, k and v
/// `[m, kvh·hd]`, att `[m, h·hd]`, o `[m, d]`, gate, up and act `[m, f]`.
pub struct LayerScratch<'a, B: Backend> {
    pub xn: &'a mut B::Act,
    pub q: &'a mut B::Act,
    pub k: &'a mut B::Act,
    pub v: &'a mut B::Act,
    pub att: &'a mut B::Act,
    pub o: &'a mut B::Act,
    pub gate: &'a mut B::Act,
    pub up: &'a mut B::Act,
    pub act: &'a mut B::Act,
}

impl<B: Backend> LayerScratch<'_, B> {
    /// The same buffers for one more call.
    pub fn reborrow(&mut self) -> LayerScratch<'_, B> {
        LayerScratch {
            xn: &mut *self.xn,
            q: &mut *self.q,
            k: &mut *self.k,
            v: &mut *self.v,
            att: &mut *self.att,
            o: &mut *self.o,
            gate: &mut *self.gate,
            up: &mut *self.up,
            act: &mut *self.act,
        }
    }
}

/// One layer of a decode step: its weights, index (its KV cache), RoPE and shape.
pub struct DecodeLayer<'a, B: Backend> {
    pub weights: LayerWeights<'a, B>,
    pub index: usize,
    pub rope: &'a Rope,
    pub shape: LayerShape,
}

/// What a layer's ops need beyond its weights: query and kv heads, the norms' epsilon, the
/// MLP's activation and how the queries attend.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub eps: f32,
    pub act: Activation,
    pub attend: Attend,
}

/// What an activation's columns hold: the model's width, or a width tensor parallelism
/// splits between ranks (`sharded`): query heads, KV heads, FFN columns, the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    Model,
    Heads,
    KvHeads,
    Ffn,
    Vocab,
}

/// What a weight matrix is to tensor parallelism: the same on every rank, split by its
/// output rows (q/k/v, gate/up, the embedding and head), or by its input columns (the
/// output projections, whose ranks' sums an all-reduce adds; each sums `unit` columns at
/// a time, and a cut between ranks falls on a unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatKind {
    Whole,
    Rows(Width),
    Cols(Width, usize),
}

/// Largest k `Backend::top_k` takes (the CUDA kernel's limit is only the output size; this
/// keeps the read-back small).
pub const TOP_K_MAX: usize = 1024;

/// Most fed decode steps one `Backend::step_fed` call may run (and one `queue_read` read):
/// two such runs in flight must fit the CUDA backend's token history (FEED_HIST, 64).
pub const FEED_STEPS_MAX: usize = 16;

/// The ops a forward pass needs. Activations are row-major `[tokens, width]`. Ops return
/// errors because device launches can fail; the CPU's never do.
pub trait Backend: Sync {
    /// Activations `[rows, cols]` (f32 on the CPU).
    type Act;
    /// A weight matrix `[out, in]`, quantized or dense.
    type Mat;
    /// A 1-D weight (norm gains, biases).
    type Vector;
    /// KV storage of every layer in blocks of `kv::BLOCK` positions (`kv` module), shared
    /// by the sequences whose tables point into it.
    type Kv;

    fn name(&self) -> &'static str;
    /// Prompt tokens per forward call during prefill: bounds activation memory; a GPU
    /// wants enough rows to fill its matmul tiles.
    fn prefill_chunk(&self) -> usize {
        128
    }
    /// The device's name and memory (bytes in use, total), where the backend has its own.
    fn device_memory(&self) -> Result<Option<(String, usize, usize)>> {
        Ok(None)
    }
    /// Device bytes free for a KV cache, counted as the unsplit cache's bytes (a
    /// tensor-parallel backend: what every rank can hold of its share). None: no device
    /// memory of its own.
    fn kv_memory_free(&self) -> Result<Option<usize>> {
        Ok(self.device_memory()?.map(|(_, used, total)| total.saturating_sub(used)))
    }
    /// Measured device-to-device copy bandwidth (bytes read + written per second): the
    /// ceiling a decode step's weight streaming is judged against.
    fn copy_bandwidth(&self) -> Result<Option<f64>> {
        Ok(None)
    }
    fn matrix(&self, w: Weight) -> Result<Self::Mat>;
    /// `matrix` for a matrix of `kind`: tensor parallelism splits it by kind, and the CPU
    /// sums a `Cols` matrix's products in its units, one after another (so that the parts
    /// of a matrix cut between ranks at unit boundaries sum exactly as the whole does).
    fn matrix_as(&self, w: Weight, kind: MatKind) -> Result<Self::Mat> {
        let _ = kind;
        self.matrix(w)
    }
    /// `vector` for a vector of `width` values (the q/k/v biases split by heads).
    fn vector_as(&self, v: Vec<f32>, width: Width) -> Result<Self::Vector> {
        let _ = width;
        self.vector(v)
    }
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    /// Activations in the working precision (f32 on the CPU, bf16 on CUDA).
    fn act(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    /// f32 activations: the residual stream and logits.
    fn act_f32(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    /// `act` whose columns are `width` (tensor parallelism gives each rank its part).
    fn act_as(&self, rows: usize, cols: usize, width: Width) -> Result<Self::Act> {
        let _ = width;
        self.act(rows, cols)
    }
    /// `act_f32` whose columns are `width`.
    fn act_f32_as(&self, rows: usize, cols: usize, width: Width) -> Result<Self::Act> {
        let _ = width;
        self.act_f32(rows, cols)
    }
    /// A store of `blocks` for the model's layers.
    fn kv_store(&self, cfg: &ModelConfig, blocks: crate::kv::KvBlocks) -> Result<Self::Kv>;
    /// A store whose blocks hold `scheme`'s rows (kv::scheme); bf16 is `kv_store`. A
    /// backend without the scheme's kernels says so.
    fn kv_store_scheme(
        &self,
        cfg: &ModelConfig,
        blocks: crate::kv::KvBlocks,
        scheme: &crate::kv::scheme::KvScheme,
    ) -> Result<Self::Kv> {
        match scheme {
            crate::kv::scheme::KvScheme::Bf16 => self.kv_store(cfg, blocks),
            s => Err(crate::Error::Unsupported(format!("the KV scheme {s} on {}", self.name()))),
        }
    }
    /// The blocks a store holds.
    fn kv_blocks(&self, kv: &Self::Kv) -> crate::kv::KvBlocks;
    /// Bytes one store row of `layer` takes as `kv_export` writes it: every KV head's key,
    /// then every KV head's value, in bf16, or the quantized rows of kv::rows's layout
    /// (the same bytes on every backend, so a KV file moves between them).
    fn kv_row_bytes(&self, kv: &Self::Kv, layer: usize) -> usize;
    /// Append store rows `rows` of `layer` to `out` (`kv_row_bytes` each).
    fn kv_export(&self, kv: &Self::Kv, layer: usize, rows: &[usize], out: &mut Vec<u8>) -> Result<()>;
    /// Write rows as `kv_export` gave them (`data`, `kv_row_bytes` each) into store rows
    /// `rows` of `layer`.
    fn kv_import(&self, kv: &mut Self::Kv, layer: usize, rows: &[usize], data: &[u8]) -> Result<()>;

    /// Start a forward call: make `tokens` and the rows' places (`spans`, consecutive
    /// sequences) visible to the device ops (CUDA copies them from pinned host memory, so a
    /// captured graph replays with new values). `invariant`: every row's arithmetic must
    /// not depend on the call's other rows or row count (the serving engine's calls; a
    /// backend then skips its one-row and one-sequence fast paths).
    fn begin(&self, _tokens: &[u32], _spans: &[Span<'_>], _invariant: bool) -> Result<()> {
        Ok(())
    }
    /// `begin` for a call of generated rows (each a sequence's one row past its prompt,
    /// `generated_rows_apart`): invariant too, each row computed as the backend's decode
    /// step computes one token, whatever the call's other rows.
    fn begin_generated(&self, tokens: &[u32], spans: &[Span<'_>]) -> Result<()> {
        self.begin(tokens, spans, true)
    }
    /// A layer a forward call of `rows` rows will run, named one layer ahead (before the
    /// layer before it is queued; the first layer just before itself), so a backend may
    /// prepare `w` while that layer runs (CUDA's wgmma GEMM dequantizes the weights on a
    /// side stream, `CudaConfig::wgmma_ahead`). A hint: by default nothing; the results
    /// are the same either way.
    fn prepare_layer(&self, _w: &LayerWeights<'_, Self>, _rows: usize) -> Result<()>
    where
        Self: Sized,
    {
        Ok(())
    }
    /// Run one decode step `f`. A backend may capture it the first time under `key` and
    /// replay the capture afterwards (CUDA graphs); `f` must then launch the same work with
    /// the same buffers every time, only the staged token, position and block tables
    /// changing (`spans`: the step's one sequence, as `begin` takes it).
    fn step(&self, _key: u64, tokens: &[u32], spans: &[Span<'_>], f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = (tokens, spans);
        f()
    }
    /// The rows a serving engine's forward call of `m` rows runs as, where the backend
    /// captures and replays calls of that size (`forward_call`): it pads them to a few sizes
    /// (padding rows have token 0 and, past the spans' rows, write and attend nothing), and
    /// the spans' head rows the same way (`call_rows(spans)`). None: the call runs as it is.
    fn call_rows(&self, _m: usize) -> Option<usize> {
        None
    }
    /// Whether a serving call's generated rows (each request's tokens after its prompt) can
    /// take an arithmetic of their own, the decode step's, while prompt rows take the
    /// serving GEMMs': a row's kind, never its neighbours, then picks its arithmetic, so
    /// batch invariance holds, and the engine plans for it where it takes this
    /// (`EngineConfig::generated_rows_apart`: a generated row is a request's only row in a
    /// step, prefix-cache blocks holding generated rows serve only their own request,
    /// `Decoder::forward_generated_out` computes them). CUDA can: its decode step's kernels,
    /// batched over a call's rows, give each row its one-row bits, so one stream through the
    /// server runs the bench's decode kernels.
    fn generated_rows_apart(&self) -> bool {
        false
    }
    /// An identity of `kv` for `forward_call`'s key (a captured call bakes in its buffers).
    fn store_id(&self, _kv: &Self::Kv) -> u64 {
        0
    }
    /// Run a serving engine's forward call `f` (which begins the call itself, invariant,
    /// with these `tokens`, padded to `call_rows`, and `spans`). A backend may capture it
    /// the first time under (`key`, `store`) and the call's shape and replay the capture
    /// afterwards: `f` must launch the same work into the same buffers for the same key
    /// (`key` names the caller's buffers, `store` the KV store's `store_id`).
    fn forward_call(
        &self,
        _key: (u64, u64),
        _tokens: &[u32],
        _spans: &[Span<'_>],
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        f()
    }
    /// Drop what `step` (or `step_fed`) kept under `key`.
    fn forget(&self, _key: u64) {}
    /// Whether greedy decode steps can feed themselves (`step_fed`): each step's argmax
    /// becomes the next step's input on the device, so the host queues a step before it
    /// has read the token that step consumes and the device never waits on the host.
    fn feeds_steps(&self) -> bool {
        false
    }
    /// Queue the decode steps `f` launches (as `step`, captured under `key`; each ends in
    /// `argmax_fed`, which feeds the next), without waiting for them. The first one's input
    /// is `token` at the span's pos0 when given (the host's), else the previous fed step's
    /// argmax at the position after it. The span's tables hold the blocks of every step
    /// queued. `generated`: the steps are generated calls' (`begin_generated`: a serving
    /// engine's one-row calls, each step the bits such a call gives), else a session's.
    fn step_fed(
        &self,
        _key: u64,
        _token: Option<u32>,
        _spans: &[Span<'_>],
        _generated: bool,
        _f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        Err(crate::Error::Invalid(format!("the {} backend does not feed decode steps", self.name())))
    }
    /// `argmax`, also made the next fed step's input (see `step_fed`).
    fn argmax_fed(&self, x: &Self::Act, out: &mut Self::Act) -> Result<()> {
        self.argmax(x, out)
    }
    /// Queue a read, for `take_read(slot)`, of the tokens the `n` fed steps at positions
    /// `pos..pos + n` chose (the last one also x[0] of their argmax output `x`): after the
    /// work queued so far, without holding back the work queued after it. `n` is at most
    /// `FEED_STEPS_MAX`.
    fn queue_read(&self, _x: &Self::Act, _pos: usize, _n: usize, _slot: usize) -> Result<()> {
        Err(crate::Error::Invalid(format!("the {} backend does not queue reads", self.name())))
    }
    /// The tokens `queue_read` queued for `slot`, waiting for them.
    fn take_read(&self, _slot: usize) -> Result<Vec<u32>> {
        Err(crate::Error::Invalid(format!("the {} backend does not queue reads", self.name())))
    }
    /// out[i] = table[tokens[i]] · scale (out is the f32 residual stream)
    fn embed(&self, table: &Self::Mat, tokens: &[u32], scale: f32, out: &mut Self::Act) -> Result<()>;
    /// out = x / rms(x) · w, per row.
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, out: &mut Self::Act) -> Result<()>;
    /// x = x / rms(x) · w in place over each head of each row (head width w.len()): the
    /// q/k norms.
    fn rms_norm_heads(&self, x: &mut Self::Act, w: &Self::Vector, eps: f32) -> Result<()>;
    /// out = x · wᵀ  (x `[m, in]`, out `[m, out]`).
    fn matmul(&self, x: &Self::Act, w: &Self::Mat, out: &mut Self::Act) -> Result<()>;
    /// outs[i] = x · ws[i]ᵀ for several matrices sharing the input (q/k/v, gate/up), so a
    /// backend can run them as one launch / parallel region.
    fn matmul_many(&self, x: &Self::Act, ws: &[&Self::Mat], outs: &mut [&mut Self::Act]) -> Result<()>;
    /// x[i] += b, per row.
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector) -> Result<()>;
    /// Rotate each head of each row at its position (`spans`: each sequence's rows sit at
    /// its positions pos0..).
    fn rope(&self, x: &mut Self::Act, n_heads: usize, spans: &[Span<'_>], rope: &Rope) -> Result<()>;
    /// Write each sequence's k/v rows at its positions of `layer` into the store (through
    /// its table for the layer's kind: `attend.window` set means sliding), then causal
    /// attention of each query row over its own sequence's positions
    /// `attend.first(pos)..=pos`, scores scaled by `attend.scale`.
    /// q `[m, n_heads·hd]`, k/v `[m, n_kv·hd]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        spans: &[Span<'_>],
        attend: Attend,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// out = act(gate) · up (SwiGLU, GeGLU)
    fn glu(&self, gate: &Self::Act, up: &Self::Act, act: Activation, out: &mut Self::Act) -> Result<()>;
    /// x += y
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// Fused forms of the sequences a layer runs. The defaults compose the ops above (the
    /// reference); a backend overrides them where one launch can do the work of several.
    ///
    /// outs[i] = rms_norm(x)·ws[i]ᵀ. `xn` is scratch for the normalized rows (a fused
    /// backend may leave it untouched).
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul_many(
        &self,
        x: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        xn: &mut Self::Act,
        ws: &[&Self::Mat],
        outs: &mut [&mut Self::Act],
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_many(xn, ws, outs)
    }
    /// out = act(xn·gateᵀ) · (xn·upᵀ) with xn = rms_norm(x); xn, g and u are scratch.
    #[allow(clippy::too_many_arguments)]
    fn norm_glu(
        &self,
        x: &Self::Act,
        (norm, eps): (&Self::Vector, f32),
        xn: &mut Self::Act,
        (gate, up): (&Self::Mat, &Self::Mat),
        act: Activation,
        g: &mut Self::Act,
        u: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_many(xn, &[gate, up], &mut [g, u])?;
        self.glu(g, u, act, out)
    }
    /// x += y·wᵀ (x the f32 residual stream); tmp is scratch `[m, out]`.
    fn matmul_add(&self, y: &Self::Act, w: &Self::Mat, x: &mut Self::Act, tmp: &mut Self::Act) -> Result<()> {
        self.matmul(y, w, tmp)?;
        self.add(x, tmp)
    }
    /// x += rms_norm(y·wᵀ) (Gemma's post-norms); tmp and tmp2 are scratch `[m, out]`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_norm_add(
        &self,
        y: &Self::Act,
        w: &Self::Mat,
        (norm, eps): (&Self::Vector, f32),
        x: &mut Self::Act,
        tmp: &mut Self::Act,
        tmp2: &mut Self::Act,
    ) -> Result<()> {
        self.matmul(y, w, tmp)?;
        self.rms_norm(tmp, norm, eps, tmp2)?;
        self.add(x, tmp2)
    }
    /// RoPE on q (n_heads) and k (n_kv heads) at the rows' positions, then `attention`.
    /// Afterwards q and k hold either the rotated or the original values (a backend may
    /// rotate them on the fly): callers treat them as scratch.
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        q: &mut Self::Act,
        k: &mut Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        spans: &[Span<'_>],
        rope: &Rope,
        (n_heads, n_kv): (usize, usize),
        attend: Attend,
        out: &mut Self::Act,
    ) -> Result<()> {
        self.rope(q, n_heads, spans, rope)?;
        self.rope(k, n_kv, spans, rope)?;
        self.attention(q, k, v, kv, layer, spans, attend, out)
    }
    /// One layer for one token (x `[1, d]`, `spans` one row) at the staged position: the same math as
    /// the model's ops (`model::decoder::layer_ops`, the default). A backend overrides it with
    /// its decode step (CUDA: decode.rs's five launches).
    #[allow(clippy::too_many_arguments)]
    fn decode_layer(
        &self,
        w: &LayerWeights<'_, Self>,
        x: &mut Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        spans: &[Span<'_>],
        rope: &Rope,
        shape: LayerShape,
        s: LayerScratch<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        crate::model::decoder::layer_ops(self, w, x, kv, layer, spans, rope, shape, s)
    }
    /// Layers one after another for one token (x `[1, d]`), each as `decode_layer`. A
    /// backend may carry work from one layer into the next (CUDA: Gemma's post-norm adds
    /// folded into the next GEMV); x holds the residual when it returns. `spare` is a second
    /// `[1, d]` f32 buffer it may keep the residual in meanwhile.
    fn decode_layers(
        &self,
        layers: &[DecodeLayer<'_, Self>],
        (x, spare): (&mut Self::Act, &mut Self::Act),
        kv: &mut Self::Kv,
        spans: &[Span<'_>],
        mut s: LayerScratch<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        let _ = spare;
        for l in layers {
            self.decode_layer(&l.weights, x, kv, l.index, spans, l.rope, l.shape, s.reborrow())?;
        }
        Ok(())
    }
    /// The head of a greedy decode step: logits = head·n(x) for one row (n the RMSNorm with
    /// `norm`, xn scratch), then their argmax into out[0] (`argmax`, or `argmax_fed` when
    /// `feed`). A backend may find the argmax while it stores the logits.
    #[allow(clippy::too_many_arguments)]
    fn norm_head_argmax(
        &self,
        x: &Self::Act,
        (norm, eps): (&Self::Vector, f32),
        xn: &mut Self::Act,
        head: &Self::Mat,
        logits: &mut Self::Act,
        out: &mut Self::Act,
        feed: bool,
    ) -> Result<()> {
        self.norm_matmul_many(x, norm, eps, xn, &[head], &mut [logits])?;
        match feed {
            true => self.argmax_fed(logits, out),
            false => self.argmax(logits, out),
        }
    }
    /// out[0] = index of the largest value of row 0 of x (ties → lowest index), stored as
    /// f32 (exact for indices below 2²⁴), so greedy decoding reads back 4 bytes.
    fn argmax(&self, x: &Self::Act, out: &mut Self::Act) -> Result<()>;
    /// out[r] = index of the largest value of row r of x (ties → lowest index), as f32: the
    /// serving engine's greedy rows read back one value each. out f32 `[≥ x.rows, 1]`.
    fn argmax_rows(&self, x: &Self::Act, out: &mut Self::Act) -> Result<()>;
    /// The `k` largest of row 0 of x × inv_t by (value desc, index asc), as (index, value)
    /// f32 pairs in out[0..2k] (f32 `[1, ≥ 2k]`), in any order; 1 ≤ k ≤ x.cols, k ≤
    /// `TOP_K_MAX`. With `Sampler::sample_candidates` a sampled step then reads back 8·k
    /// bytes instead of the vocabulary's logits.
    fn top_k(&self, x: &Self::Act, k: usize, inv_t: f32, out: &mut Self::Act) -> Result<()>;
    /// Whether sessions should sample top-k through `top_k` (and read back k pairs) rather
    /// than read the logits back and select on the host.
    fn top_k_preferred(&self) -> bool {
        true
    }

    /// A new activation holding rows `[first, rows)` of x.
    fn slice_rows(&self, x: &Self::Act, first: usize) -> Result<Self::Act>;
    /// out row i = the row of x holding span i's last token (the call's rows are the spans'
    /// in turn, as `begin` took them); out's rows past the spans' get some row of x (a
    /// padded call's head rows).
    fn gather_last_rows(&self, x: &Self::Act, spans: &[Span<'_>], out: &mut Self::Act) -> Result<()>;
    /// Copy rows `[first, rows)` to the host as f32.
    fn read_rows(&self, x: &Self::Act, first: usize) -> Result<Vec<f32>>;
}

/// `Backend::gather_last_rows`'s argument checks (shared by the backends): x `[rows,
/// cols]`, `spans` spans whose last row is `last`, out `[out_rows, out_cols]`.
pub fn check_gather(
    rows: usize,
    cols: usize,
    spans: usize,
    last: Option<usize>,
    (out_rows, out_cols): (usize, usize),
) -> Result<()> {
    if out_cols != cols || out_rows < spans || last.is_some_and(|r| r >= rows) || rows == 0 {
        return Err(crate::Error::Invalid(format!(
            "gathering {spans} spans' last rows of [{rows}, {cols}] into [{out_rows}, {out_cols}]"
        )));
    }
    Ok(())
}

/// `Backend::argmax_rows`'s argument checks: x `[rows, cols]`, `out` values of output.
pub fn check_argmax_rows(rows: usize, cols: usize, out: usize) -> Result<()> {
    if cols == 0 || out < rows || cols >= 1 << 24 {
        return Err(crate::Error::Invalid(format!("argmax of [{rows}, {cols}] rows into {out} values")));
    }
    Ok(())
}

/// `Backend::top_k`'s argument checks (shared by the backends).
pub fn check_top_k(cols: usize, k: usize, out_cols: usize) -> Result<()> {
    if k == 0 || k > cols || k > TOP_K_MAX || out_cols < 2 * k {
        return Err(crate::Error::Invalid(format!(
            "top-k of {k} over {cols} values into {out_cols} outputs (need 1 ≤ k ≤ min(values, {TOP_K_MAX}), 2k outputs)"
        )));
    }
    Ok(())
}
