//! Compute backends. A model is written once against [`Backend`]; the CPU backend is the
//! reference implementation, CUDA implements the same ops with the same signatures.

pub mod cpu;
pub mod cuda;

use crate::config::ModelConfig;
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

/// The ops a forward pass needs. Activations are row-major `[tokens, width]`. Ops return
/// errors because device launches can fail; the CPU's never do.
pub trait Backend: Sync {
    /// Activations `[rows, cols]` (f32 on the CPU).
    type Act;
    /// A weight matrix `[out, in]`, quantized or dense.
    type Mat;
    /// A 1-D weight (norm gains, biases).
    type Vector;
    /// The KV cache of one sequence: all layers, preallocated to a maximum length.
    type Kv;

    fn name(&self) -> &'static str;
    fn matrix(&self, w: Weight) -> Result<Self::Mat>;
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    /// Activations in the working precision (f32 on the CPU, bf16 on CUDA).
    fn act(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    /// f32 activations: the residual stream and logits.
    fn act_f32(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    fn kv_cache(&self, cfg: &ModelConfig, max_seq: usize) -> Result<Self::Kv>;
    /// Number of positions the cache holds.
    fn kv_capacity(&self, kv: &Self::Kv) -> usize;

    /// out[i] = table[tokens[i]] (out is the f32 residual stream)
    fn embed(&self, table: &Self::Mat, tokens: &[u32], out: &mut Self::Act) -> Result<()>;
    /// out = x / rms(x) · w, per row.
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, out: &mut Self::Act) -> Result<()>;
    /// out = x · wᵀ  (x `[m, in]`, out `[m, out]`).
    fn matmul(&self, x: &Self::Act, w: &Self::Mat, out: &mut Self::Act) -> Result<()>;
    /// outs[i] = x · ws[i]ᵀ for several matrices sharing the input (q/k/v, gate/up), so a
    /// backend can run them as one launch / parallel region.
    fn matmul_many(&self, x: &Self::Act, ws: &[&Self::Mat], outs: &mut [&mut Self::Act]) -> Result<()>;
    /// x[i] += b, per row.
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector) -> Result<()>;
    /// Rotate each head of each row; row i sits at position pos0 + i.
    fn rope(&self, x: &mut Self::Act, n_heads: usize, pos0: usize, rope: &Rope) -> Result<()>;
    /// Write k/v rows at positions pos0.. of `layer` into the cache, then causal attention
    /// of q over positions 0..=pos. q `[m, n_heads·hd]`, k/v `[m, n_kv·hd]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        pos0: usize,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// out = silu(gate) · up
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act, out: &mut Self::Act) -> Result<()>;
    /// x += y
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// A new activation holding rows `[first, rows)` of x.
    fn slice_rows(&self, x: &Self::Act, first: usize) -> Result<Self::Act>;
    /// Copy rows `[first, rows)` to the host as f32.
    fn read_rows(&self, x: &Self::Act, first: usize) -> Result<Vec<f32>>;
}
