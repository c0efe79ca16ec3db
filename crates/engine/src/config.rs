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
        }
    }
}

impl ModelConfig {
    /// Check the shape is self-consistent; errors name the field.
    pub fn validate(&self, src: &str) -> Result<()> {
        let bad = |m: String| Err(Error::format(src, m));
        if self.hidden == 0 || self.n_layers == 0 || self.n_heads == 0 || self.vocab == 0 || self.ffn == 0 {
            return bad(format!("config has a zero dimension: {self:?}"));
        }
        // Bounds far above any real model (Llama 3.1 405B: 126 layers, hidden 16384, ffn
        // 53248; Gemma 3: vocab 262144), checked before anything is allocated from them.
        for (field, value, max) in [
            ("layer count", self.n_layers, 1 << 10),
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
        Ok(())
    }

    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let arch_name = g.req_str("general.architecture")?;
        let (arch, rope_style) = match arch_name {
            "llama" | "mistral" | "minicpm5" => (Arch::Llama, RopeStyle::Interleaved),
            "qwen2" => (Arch::Qwen2, RopeStyle::Half),
            other => {
                return Err(Error::format(
                    &g.path,
                    format!("general.architecture {other:?} is not supported (llama, mistral, qwen2)"),
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
        let cfg = ModelConfig {
            arch,
            hidden,
            n_layers: g.req_u64(&k("block_count"))? as usize,
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
        };
        cfg.validate(&g.path.display().to_string())?;
        Ok(cfg)
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
            other => {
                return Err(Error::format(
                    path,
                    format!("model_type {other:?} is not supported (llama, mistral, qwen2)"),
                ))
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
        let cfg = ModelConfig {
            arch,
            hidden,
            n_layers: u("num_hidden_layers")?,
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
            tie_embeddings: j.get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || j.get("attention_bias").and_then(|v| v.as_bool()).unwrap_or(false),
        };
        cfg.validate(&src)?;
        Ok(cfg)
    }

    /// Inverse frequencies per rotated pair (head_dim/2 of them), with Llama 3 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / d);
                match &self.llama3_scaling {
                    None => f as f32,
                    Some(s) => llama3_scale(f, s) as f32,
                }
            })
            .collect()
    }
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
