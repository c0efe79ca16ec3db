//! ModelConfig: the shape and hyper-parameters of a Llama-family model, read from GGUF
//! metadata or a Hugging Face / MLX config.json.

use crate::formats::gguf::GgufFile;
use crate::{Error, Result};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2, MiniCPM5 (plain Llama), Mistral.
    Llama,
    /// Qwen2: Llama with q/k/v biases.
    Qwen2,
    /// Qwen3: Llama with RMSNorm on each q/k head (no biases).
    Qwen3,
    /// Gemma 3 (text): embeddings scaled by √hidden, (1 + w) norm gains, norms before and
    /// after attention and the MLP, q/k norms, a GeGLU MLP, sliding-window and global layers
    /// with their own RoPE bases.
    Gemma3,
}

/// What the gated MLP applies to its gate before multiplying by up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// silu(g) = g·σ(g) (SwiGLU: Llama, Qwen).
    Silu,
    /// The tanh approximation of gelu (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// Which positions a layer's queries attend to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Every earlier position.
    Full,
    /// The last `sliding_window` positions (the query's own included).
    Sliding,
}

impl AttnKind {
    pub fn name(self) -> &'static str {
        match self {
            AttnKind::Full => "full",
            AttnKind::Sliding => "sliding",
        }
    }
}

/// How RoPE pairs dimensions. GGUF's llama conversion permutes q/k rows so ggml rotates
/// adjacent pairs (2i, 2i+1); Hugging Face rotates halves (i, i+d/2). Same math, other layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    Half,
}

/// Llama 3 frequency-dependent RoPE scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub max_ctx: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub llama3_scaling: Option<Llama3Scaling>,
    /// Linear position scaling (positions divided by this), 1.0 when absent.
    pub rope_linear: f32,
    pub tie_embeddings: bool,
    pub qkv_bias: bool,
    /// RMSNorm over each q and k head (head_dim gains) before RoPE: Qwen3, Gemma 3.
    pub qk_norm: bool,
    /// Gemma's norm gains: tensors hold w and the norm multiplies by 1 + w (Hugging Face
    /// and MLX files; a GGUF holds 1 + w and its importer subtracts the 1).
    pub norm_plus_one: bool,
    /// RMSNorms on the attention and MLP outputs before the residual adds, and a separate
    /// norm before the MLP (Gemma 3).
    pub post_norms: bool,
    pub activation: Activation,
    /// The embedding rows are multiplied by this (Gemma: √hidden).
    pub embed_scale: f32,
    /// Queries are scaled by query_pre_attn_scalar^-½ (Gemma); None = head_dim^-½.
    pub query_pre_attn_scalar: Option<f32>,
    /// Positions a sliding-window layer attends to, its own included (0: none).
    pub sliding_window: usize,
    /// Each layer's attention kind; empty = every layer full.
    pub layer_kinds: Vec<AttnKind>,
    /// RoPE base of the sliding-window layers, which use no scaling (Gemma 3's local base);
    /// None = the global rotation.
    pub rope_local_theta: Option<f32>,
}

/// A Llama with no shape yet (all dimensions 0, which `validate` rejects) and Hugging Face's
/// defaults for the rest (eps 1e-5, RoPE θ 10000 in half-split order, no scaling, untied
/// head, no q/k/v bias): the base that shapes are written on with `..Default::default()`.
impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Arch::Llama,
            hidden: 0,
            n_layers: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            ffn: 0,
            vocab: 0,
            max_ctx: 0,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            rope_style: RopeStyle::Half,
            llama3_scaling: None,
            rope_linear: 1.0,
            tie_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            norm_plus_one: false,
            post_norms: false,
            activation: Activation::Silu,
            embed_scale: 1.0,
            query_pre_attn_scalar: None,
            sliding_window: 0,
            layer_kinds: Vec::new(),
            rope_local_theta: None,
        }
    }
}

/// Most layers of any model ferrolm runs (Llama 3.1 405B has 126): checked as soon as the
/// count is read, before per-layer tables are built from it.
const MAX_LAYERS: usize = 1 << 10;

fn check_layers(n: usize, src: &str) -> Result<usize> {
    match n {
        0 => Err(Error::format(src, "layer count is 0")),
        n if n > MAX_LAYERS => {
            Err(Error::format(src, format!("layer count {n} is beyond any model ferrolm runs (at most {MAX_LAYERS})")))
        }
        n => Ok(n),
    }
}

impl ModelConfig {
    /// Check the shape is self-consistent; errors name the field.
    pub fn validate(&self, src: &str) -> Result<()> {
        let bad = |m: String| Err(Error::format(src, m));
        for (field, value) in [
            ("hidden size", self.hidden),
            ("layer count", self.n_layers),
            ("attention heads", self.n_heads),
            ("vocabulary size", self.vocab),
            ("feed-forward size", self.ffn),
        ] {
            if value == 0 {
                return bad(format!("{field} is 0"));
            }
        }
        // Bounds far above any real model (Llama 3.1 405B: 126 layers, hidden 16384, ffn
        // 53248; Gemma 3: vocab 262144), checked before anything is allocated from them.
        for (field, value, max) in [
            ("layer count", self.n_layers, MAX_LAYERS),
            ("hidden size", self.hidden, 1 << 16),
            ("attention heads", self.n_heads, 1 << 10),
            ("head_dim", self.head_dim, 1 << 10),
            ("feed-forward size", self.ffn, 1 << 20),
            ("vocabulary size", self.vocab, 1 << 22),
            ("context length", self.max_ctx, 1 << 24),
        ] {
            if value > max {
                return bad(format!("{field} {value} is beyond any model ferrolm runs (at most {max})"));
            }
        }
        if self.head_dim == 0 {
            return bad("head_dim is 0".into());
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!("n_heads {} is not a multiple of n_kv_heads {}", self.n_heads, self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd", self.head_dim));
        }
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !positive(self.rope_theta) {
            return bad(format!("RoPE base (rope_theta) {} is not a finite positive number", self.rope_theta));
        }
        if !positive(self.rms_eps) {
            return bad(format!("rms_norm_eps {} is not a finite positive number", self.rms_eps));
        }
        if !positive(self.rope_linear) {
            return bad(format!("RoPE linear scaling factor {} is not a finite positive number", self.rope_linear));
        }
        if !positive(self.embed_scale) {
            return bad(format!("embedding scale {} is not a finite positive number", self.embed_scale));
        }
        if let Some(s) = self.query_pre_attn_scalar.filter(|&s| !positive(s)) {
            return bad(format!("query_pre_attn_scalar {s} is not a finite positive number"));
        }
        if let Some(t) = self.rope_local_theta.filter(|&t| !positive(t)) {
            return bad(format!("local RoPE base {t} is not a finite positive number"));
        }
        if !self.layer_kinds.is_empty() && self.layer_kinds.len() != self.n_layers {
            return bad(format!("{} layer types for {} layers", self.layer_kinds.len(), self.n_layers));
        }
        if self.layer_kinds.contains(&AttnKind::Sliding) && self.sliding_window == 0 {
            return bad("sliding-window layers with a window of 0 positions".into());
        }
        if self.sliding_window > 1 << 24 {
            return bad(format!(
                "sliding window {} is beyond any model ferrolm runs (at most {})",
                self.sliding_window,
                1 << 24
            ));
        }
        Ok(())
    }

    /// Layer i's attention kind.
    pub fn layer_kind(&self, i: usize) -> AttnKind {
        self.layer_kinds.get(i).copied().unwrap_or(AttnKind::Full)
    }

    /// The factor queries are scaled by before the softmax.
    pub fn attn_scale(&self) -> f32 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.head_dim as f32).sqrt()
    }

    /// Gemma 3's layer pattern: every `period`-th layer global, the others sliding.
    pub fn interleaved_kinds(n_layers: usize, period: usize) -> Vec<AttnKind> {
        (0..n_layers)
            .map(|i| if period > 0 && (i + 1) % period == 0 { AttnKind::Full } else { AttnKind::Sliding })
            .collect()
    }

    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let arch_name = g.req_str("general.architecture")?;
        let (arch, rope_style) = match arch_name {
            "llama" | "mistral" | "minicpm5" => (Arch::Llama, RopeStyle::Interleaved),
            "qwen2" => (Arch::Qwen2, RopeStyle::Half),
            "qwen3" => (Arch::Qwen3, RopeStyle::Half),
            "gemma3" => (Arch::Gemma3, RopeStyle::Half),
            other => {
                return Err(Error::format(
                    &g.path,
                    format!("general.architecture {other:?} is not supported (llama, mistral, qwen2, qwen3, gemma3)"),
                ))
            }
        };
        let k = |s: &str| format!("{arch_name}.{s}");
        let hidden = g.req_u64(&k("embedding_length"))? as usize;
        let n_heads = g.req_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = g.opt_u64(&k("attention.head_count_kv"))?.unwrap_or(n_heads as u64) as usize;
        let head_dim = g.opt_u64(&k("attention.key_length"))?.map(|v| v as usize).unwrap_or(hidden / n_heads.max(1));
        let vocab = match g.opt_u64(&k("vocab_size"))? {
            Some(v) => v as usize,
            // The embedding's rows are the vocabulary (the tokenizer's metadata may be gone).
            None => g.tensor("token_embd.weight").and_then(|t| t.dims.get(1)).map(|&d| d as usize).unwrap_or(0),
        };
        let rope_linear = match g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
            Some("linear") => g.opt_f64(&k("rope.scaling.factor"))?.unwrap_or(1.0) as f32,
            Some("none") | None => 1.0,
            Some(other) => {
                return Err(Error::Unsupported(format!("{}: rope scaling type {other:?}", g.path.display())))
            }
        };
        let n_layers = check_layers(g.req_u64(&k("block_count"))? as usize, &g.path.display().to_string())?;
        let mut cfg = ModelConfig {
            arch,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn: g.req_u64(&k("feed_forward_length"))? as usize,
            vocab,
            max_ctx: g.opt_u64(&k("context_length"))?.unwrap_or(4096) as usize,
            rms_eps: g.opt_f64(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5) as f32,
            rope_theta: g.opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0) as f32,
            rope_style,
            // Llama 3 GGUFs carry the scaling as a `rope_freqs.weight` tensor instead.
            llama3_scaling: None,
            rope_linear,
            tie_embeddings: g.tensor("output.weight").is_none(),
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            ..Default::default()
        };
        if arch == Arch::Gemma3 {
            // llama.cpp's rules, which its GGUFs rely on: queries are scaled by head_dim^-½
            // except in the 27B (62 layers), whose query_pre_attn_scalar is hidden / heads.
            let scalar = (n_layers == 62).then(|| (hidden / n_heads.max(1)) as f32);
            cfg = cfg.gemma3(g.opt_u64(&k("attention.sliding_window"))?.unwrap_or(0) as usize, scalar);
        }
        cfg.validate(&g.path.display().to_string())?;
        Ok(cfg)
    }

    /// This shape as Gemma 3: its fixed traits, its sliding window and query_pre_attn_scalar,
    /// every sixth layer global and a local RoPE base of 10000 (what its configs and
    /// llama.cpp assume when they say nothing else).
    pub fn gemma3(self, window: usize, query_pre_attn_scalar: Option<f32>) -> ModelConfig {
        ModelConfig {
            arch: Arch::Gemma3,
            qk_norm: true,
            norm_plus_one: true,
            post_norms: true,
            activation: Activation::GeluTanh,
            embed_scale: (self.hidden as f32).sqrt(),
            sliding_window: window,
            query_pre_attn_scalar,
            layer_kinds: ModelConfig::interleaved_kinds(self.n_layers, 6),
            rope_local_theta: Some(10000.0),
            rope_style: RopeStyle::Half,
            ..self
        }
    }

    /// From a Hugging Face / MLX `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<ModelConfig> {
        let text = crate::files::read_text(path)?;
        let j: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))?;
        let src = path.display().to_string();
        let u = |key: &str| -> Result<usize> {
            j.get(key)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| Error::format(path, format!("field {key}: missing or not an integer")))
        };
        let f = |key: &str, d: f64| j.get(key).and_then(|v| v.as_f64()).unwrap_or(d) as f32;
        let model_type = j.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let arch = match model_type {
            "llama" | "mistral" | "minicpm5" | "smollm2" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3_text" => Arch::Gemma3,
            "gemma3" => {
                return Err(Error::Unsupported(format!(
                    "{src}: model_type \"gemma3\" is Gemma 3 with its vision tower; ferrolm runs the text-only \"gemma3_text\" checkpoints"
                )))
            }
            other => {
                return Err(Error::format(
                    path,
                    format!("model_type {other:?} is not supported (llama, mistral, qwen2, qwen3, gemma3_text)"),
                ))
            }
        };
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if j.get(key).is_some_and(|v| !v.is_null()) {
                return Err(Error::Unsupported(format!("{src}: {key} (logit soft-capping, Gemma 2)")));
            }
        }
        // Transformers 5 writes it in every Gemma 3 config; true (EmbeddingGemma) makes every
        // layer attend both ways, which a causal decoder would silently compute otherwise.
        if j.get("use_bidirectional_attention").and_then(|v| v.as_bool()) == Some(true) {
            return Err(Error::Unsupported(format!(
                "{src}: use_bidirectional_attention (an encoder such as EmbeddingGemma; ferrolm runs causal decoders)"
            )));
        }
        if j.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true) && arch != Arch::Gemma3 {
            return Err(Error::Unsupported(format!(
                "{src}: use_sliding_window (Qwen's sliding window on upper layers)"
            )));
        }
        let activation = match j.get("hidden_activation").or_else(|| j.get("hidden_act")).and_then(|v| v.as_str()) {
            None if arch == Arch::Gemma3 => Activation::GeluTanh,
            None | Some("silu") | Some("swish") => Activation::Silu,
            Some("gelu_pytorch_tanh") => Activation::GeluTanh,
            Some(other) => {
                return Err(Error::Unsupported(format!("{src}: MLP activation {other:?} (silu, gelu_pytorch_tanh)")))
            }
        };
        let hidden = u("hidden_size")?;
        let n_heads = u("num_attention_heads")?;
        // Transformers 5 keeps the RoPE base and scaling in `rope_parameters` (one object,
        // or one per attention kind); older configs in `rope_theta` and `rope_scaling`.
        let rope_params = j.get("rope_parameters").filter(|v| v.is_object()).map(|p| match p.get("full_attention") {
            Some(full) if full.is_object() => full,
            _ => p,
        });
        // Gemma 3's sliding layers have a base of their own (Transformers 4:
        // rope_local_base_freq; 5: rope_parameters.sliding_attention).
        let local_params = j.get("rope_parameters").and_then(|p| p.get("sliding_attention")).filter(|v| v.is_object());
        if let Some(ty) =
            local_params.and_then(|p| p.get("rope_type")).and_then(|v| v.as_str()).filter(|t| *t != "default")
        {
            return Err(Error::Unsupported(format!("{src}: rope type {ty:?} on sliding-window layers")));
        }
        let rope_local_theta = match (j.get("rope_local_base_freq"), local_params.and_then(|p| p.get("rope_theta"))) {
            (Some(t), _) if !t.is_null() => t.as_f64(),
            (_, Some(t)) => t.as_f64(),
            _ if arch == Arch::Gemma3 => Some(10000.0),
            _ => None,
        };
        let rope_theta = match (j.get("rope_theta"), rope_params.and_then(|p| p.get("rope_theta"))) {
            (Some(t), _) if !t.is_null() => t.as_f64(),
            (_, Some(t)) => t.as_f64(),
            _ => Some(10000.0),
        };
        let rope_theta = rope_theta.ok_or_else(|| Error::format(path, "rope_theta: not a number"))? as f32;
        let mut llama3_scaling = None;
        let mut rope_linear = 1.0;
        let scaling = j.get("rope_scaling").filter(|v| !v.is_null());
        // A `rope_parameters` without a type is the default rotation.
        let (scaling, untyped) = match scaling {
            Some(rs) => (Some(rs), ""),
            None => (rope_params, "default"),
        };
        if let Some(rs) = scaling {
            let ty = rs.get("rope_type").or_else(|| rs.get("type")).and_then(|v| v.as_str()).unwrap_or(untyped);
            let g = |k: &str, d: f64| rs.get(k).and_then(|v| v.as_f64()).unwrap_or(d) as f32;
            match ty {
                "llama3" => {
                    llama3_scaling = Some(Llama3Scaling {
                        factor: g("factor", 8.0),
                        low_freq_factor: g("low_freq_factor", 1.0),
                        high_freq_factor: g("high_freq_factor", 4.0),
                        original_max_position: g("original_max_position_embeddings", 8192.0),
                    })
                }
                "linear" => rope_linear = g("factor", 1.0),
                "default" => {}
                other => return Err(Error::Unsupported(format!("{src}: rope_scaling type {other:?}"))),
            }
        }
        let n_layers = check_layers(u("num_hidden_layers")?, &src)?;
        let gemma = arch == Arch::Gemma3;
        let mut cfg = ModelConfig {
            arch,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads: u("num_key_value_heads").unwrap_or(n_heads),
            head_dim: u("head_dim").unwrap_or(hidden / n_heads.max(1)),
            ffn: u("intermediate_size")?,
            vocab: u("vocab_size")?,
            max_ctx: u("max_position_embeddings").unwrap_or(4096),
            rms_eps: f("rms_norm_eps", 1e-5),
            rope_theta,
            rope_style: RopeStyle::Half,
            llama3_scaling,
            rope_linear,
            // Gemma's configs leave it out: tied by default.
            tie_embeddings: j.get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(gemma),
            qkv_bias: arch == Arch::Qwen2 || j.get("attention_bias").and_then(|v| v.as_bool()).unwrap_or(false),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            activation,
            ..Default::default()
        };
        let window = j.get("sliding_window").and_then(|v| v.as_u64()).map(|w| w as usize);
        if gemma {
            let scalar = j.get("query_pre_attn_scalar").and_then(|v| v.as_f64()).unwrap_or(256.0) as f32;
            cfg = cfg.gemma3(window.unwrap_or(4096), Some(scalar));
            cfg.activation = activation;
            cfg.rope_local_theta = rope_local_theta.map(|t| t as f32);
        }
        // Only Mistral slides every layer by its `sliding_window`; Qwen's configs carry one
        // with `use_sliding_window: false` (refused above when true).
        let windowed = window.is_some() && model_type == "mistral";
        cfg.layer_kinds = layer_kinds(&j, n_layers, windowed, gemma).map_err(|m| Error::format(path, m))?;
        if !gemma {
            cfg.sliding_window = window.filter(|_| cfg.layer_kinds.contains(&AttnKind::Sliding)).unwrap_or(0);
        }
        cfg.validate(&src)?;
        Ok(cfg)
    }

    /// Inverse frequencies per rotated pair (head_dim/2 of them), with Llama 3 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        inv_freq(self.rope_theta, self.head_dim)
            .map(|f| match &self.llama3_scaling {
                None => f as f32,
                Some(s) => llama3_scale(f, s) as f32,
            })
            .collect()
    }

    /// The sliding-window layers' own inverse frequencies (no scaling), where they have a
    /// base of their own.
    pub fn rope_local_inv_freq(&self) -> Option<Vec<f32>> {
        Some(inv_freq(self.rope_local_theta?, self.head_dim).map(|f| f as f32).collect())
    }
}

/// Each layer's attention kind from a config.json: `layer_types` where given, else Gemma 3's
/// `sliding_window_pattern` (default 6), else every layer sliding when there is a
/// `sliding_window` (Mistral), else none.
fn layer_kinds(
    j: &serde_json::Value,
    n_layers: usize,
    windowed: bool,
    gemma: bool,
) -> std::result::Result<Vec<AttnKind>, String> {
    if let Some(types) = j.get("layer_types").filter(|v| !v.is_null()) {
        let types = types.as_array().ok_or("layer_types: not a list")?;
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(AttnKind::Full),
                Some("sliding_attention") => Ok(AttnKind::Sliding),
                _ => Err(format!(
                    "layer_types: {} is not full_attention or sliding_attention",
                    crate::files::printable(&t.to_string())
                )),
            })
            .collect();
    }
    if gemma {
        let period = j.get("sliding_window_pattern").and_then(|v| v.as_u64()).unwrap_or(6) as usize;
        return Ok(ModelConfig::interleaved_kinds(n_layers, period));
    }
    Ok(if windowed { vec![AttnKind::Sliding; n_layers] } else { Vec::new() })
}

/// RoPE's unscaled inverse frequencies base^(-2i/d), i < d/2, in f64.
fn inv_freq(base: f32, head_dim: usize) -> impl Iterator<Item = f64> {
    let d = head_dim as f64;
    (0..head_dim / 2).map(move |i| 1.0 / (base as f64).powf(2.0 * i as f64 / d))
}

fn llama3_scale(freq: f64, s: &Llama3Scaling) -> f64 {
    let (factor, lo, hi, old) =
        (s.factor as f64, s.low_freq_factor as f64, s.high_freq_factor as f64, s.original_max_position as f64);
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    let (lo_wl, hi_wl) = (old / lo, old / hi);
    if wavelen < hi_wl {
        freq
    } else if wavelen > lo_wl {
        freq / factor
    } else {
        let smooth = (old / wavelen - lo) / (hi - lo);
        (1.0 - smooth) * freq / factor + smooth * freq
    }
}
