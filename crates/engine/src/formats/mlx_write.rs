//! Write a [`ModelSource`] as an MLX model directory that `mlx_lm.load` reads, and that
//! [`super::safetensors::load_dir`] reads back bit for bit:
//!
//! - `config.json`: Hugging Face fields for `model_type` llama / qwen2, plus `quantization`
//!   (and its copy `quantization_config`, as mlx-lm writes) when any tensor is affine: the
//!   most common (bits, group) as default, an entry per module that differs, and `false` for
//!   matrices left dense; `ferrolm_synthetic` naming the shape when the weights are random
//!   ([`super::synthetic`]).
//! - `model.safetensors` (or `model-0000i-of-0000n.safetensors` + index past
//!   [`MAX_SHARD_BYTES`]): an affine `<m>` as `<m>.weight` (u32 `[out, in·bits/32]`),
//!   `<m>.scales`, `<m>.biases` (`[out, in/group]`, their dtype); dense tensors as they are.
//! - `tokenizer.json`, `tokenizer_config.json` from [`TokenizerFiles`].
//!
//! GGUF sources (`RopeStyle::Interleaved`) have q/k rows in ggml's order; they are put back
//! in Hugging Face order here, so the output is a plain rotate-half checkpoint.

use super::safetensors::{is_matrix_name, QuantConfig, QuantParams, SYNTHETIC_KEY};
use super::{names, ModelSource};
use crate::config::{Arch, AttnKind, ModelConfig, RopeStyle};
use crate::quant::{AffineTensor, DenseData, DenseTensor, Scales, Weight};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use ::safetensors::tensor::View;
use ::safetensors::Dtype;
use indicatif::ProgressBar;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// mlx-lm's shard size (`save_model`'s default max_file_size_gb = 5).
pub const MAX_SHARD_BYTES: u64 = 5 << 30;

/// The tokenizer files to write next to the weights, as JSON text.
pub struct TokenizerFiles {
    pub tokenizer_json: String,
    pub tokenizer_config_json: String,
}

/// tokenizer.json + tokenizer_config.json (chat template, BOS/EOS, add_bos_token) for `tok`,
/// which [`Tokenizer::from_dir`] and transformers read back as the same tokenizer.
pub fn tokenizer_files(tok: &Tokenizer) -> Result<TokenizerFiles> {
    let tokenizer_json = tok
        .hf()
        .to_string(false)
        .map_err(|e| Error::Invalid(format!("{}: serializing tokenizer.json: {e}", tok.source())))?;
    let mut cfg = json!({
        "add_bos_token": tok.add_bos_default(),
        "add_eos_token": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = tok.chat_template() {
        cfg["chat_template"] = t.into();
    }
    if let Some(b) = tok.bos_token() {
        cfg["bos_token"] = b.into();
    }
    if let Some(e) = tok.eos_token() {
        cfg["eos_token"] = e.into();
    }
    let tokenizer_config_json = serde_json::to_string_pretty(&cfg)
        .map_err(|e| Error::Invalid(format!("{}: serializing tokenizer_config.json: {e}", tok.source())))?;
    Ok(TokenizerFiles { tokenizer_json, tokenizer_config_json })
}

/// Write `src` as an MLX directory at `out` (created; must not exist or be empty).
pub fn write_mlx_dir(src: &ModelSource, out: &Path, tok: &TokenizerFiles, progress: bool) -> Result<()> {
    write_mlx_dir_sharded(src, out, tok, progress, MAX_SHARD_BYTES)
}

/// [`write_mlx_dir`] with a chosen shard size (a shard holds at least one tensor).
pub fn write_mlx_dir_sharded(
    src: &ModelSource,
    out: &Path,
    tok: &TokenizerFiles,
    progress: bool,
    max_shard_bytes: u64,
) -> Result<()> {
    let cfg = &src.config;
    if src.tensors.contains_key("rope_freqs") {
        return Err(Error::Unsupported(format!(
            "{}: tensor rope_freqs (Llama 3 RoPE scaling stored as a tensor) has no config.json form; convert from the Hugging Face checkpoint instead",
            src.path.display()
        )));
    }
    // Un-permute q/k for GGUF sources; everything else is written as it is.
    let mut fixed: BTreeMap<&str, Weight> = BTreeMap::new();
    if cfg.rope_style == RopeStyle::Interleaved {
        for (name, w) in &src.tensors {
            let heads = if name.contains("self_attn.q_proj.") {
                cfg.n_heads
            } else if name.contains("self_attn.k_proj.") {
                cfg.n_kv_heads
            } else {
                continue;
            };
            let w = unpermute_rows(w, heads, name.ends_with(".bias"))
                .map_err(|m| Error::format(&src.path, format!("tensor {name}: {m}")))?;
            fixed.insert(name, w);
        }
    }
    let tensors: Vec<(&str, &Weight)> = src
        .tensors
        .iter()
        // A tied model's head is the embedding; mlx-lm would reject a stored copy.
        .filter(|(n, _)| !(cfg.tie_embeddings && n.as_str() == names::LM_HEAD))
        .map(|(n, w)| (n.as_str(), fixed.get(n.as_str()).unwrap_or(w)))
        .collect();
    let quant = quant_config(&tensors);
    let mut config =
        hf_config_json(cfg, quant.as_ref()).map_err(|m| Error::Unsupported(format!("{}: {m}", src.path.display())))?;
    if let Some(name) = &src.synthetic {
        config[SYNTHETIC_KEY] = name.as_str().into();
    }

    if out.exists() {
        let empty = out.is_dir() && std::fs::read_dir(out).map_err(|e| Error::io(out, e))?.next().is_none();
        if !empty {
            return Err(Error::Invalid(format!("{}: already exists and is not an empty directory", out.display())));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;

    let total: u64 = tensors.iter().map(|(_, w)| w.byte_size() as u64).sum();
    let bar = crate::progress::bar(progress, total, "writing");
    let mut shards: Vec<Vec<(String, Out)>> = vec![vec![]];
    let mut shard_bytes = 0u64;
    for (name, w) in &tensors {
        let views = views(name, w, &bar).map_err(|m| Error::format(&src.path, format!("tensor {name}: {m}")))?;
        let n = w.byte_size() as u64;
        if shard_bytes > 0 && shard_bytes + n > max_shard_bytes {
            shards.push(vec![]);
            shard_bytes = 0;
        }
        shard_bytes += n;
        if let Some(s) = shards.last_mut() {
            s.extend(views);
        }
    }
    let meta = Some(HashMap::from([("format".to_string(), "mlx".to_string())]));
    let n_shards = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.into_iter().enumerate() {
        let file = if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n_shards)
        };
        for (name, _) in &shard {
            weight_map.insert(name.clone(), Value::String(file.clone()));
        }
        let path = out.join(&file);
        ::safetensors::serialize_to_file(shard, &meta, &path)
            .map_err(|e| Error::format(&path, format!("writing safetensors: {e}")))?;
    }
    bar.finish_and_clear();
    if n_shards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_json(&out.join("model.safetensors.index.json"), &index)?;
    }
    write_json(&out.join("config.json"), &config)?;
    write_text(&out.join("tokenizer.json"), &tok.tokenizer_json)?;
    write_text(&out.join("tokenizer_config.json"), &tok.tokenizer_config_json)?;
    Ok(())
}

fn write_text(path: &Path, s: &str) -> Result<()> {
    std::fs::write(path, s).map_err(|e| Error::io(path, e))
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let s = serde_json::to_string_pretty(v).map_err(|e| Error::format(path, format!("serializing JSON: {e}")))?;
    write_text(path, &s)
}

/// The `quantization` block: default = the most common (bits, group) (ties → fewer bits),
/// an override per affine matrix that differs, `false` per dense matrix. `None` when nothing
/// is quantized.
fn quant_config(tensors: &[(&str, &Weight)]) -> Option<QuantConfig> {
    let mut count: BTreeMap<QuantParams, usize> = BTreeMap::new();
    for (_, w) in tensors {
        if let Weight::Affine(t) = w {
            *count.entry((t.bits, t.group)).or_default() += 1;
        }
    }
    let default = count.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))).map(|(p, _)| *p)?;
    let mut overrides = BTreeMap::new();
    for (name, w) in tensors {
        if !is_matrix_name(name) {
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap_or(name).to_string();
        match w {
            Weight::Affine(t) if (t.bits, t.group) == default => {}
            Weight::Affine(t) => {
                overrides.insert(module, Some((t.bits, t.group)));
            }
            Weight::Dense(_) => {
                overrides.insert(module, None);
            }
        }
    }
    Some(QuantConfig { default: Some(default), overrides })
}

/// Round an f32 through its shortest decimal form, so 1e-5f32 is written as 1e-05 rather
/// than 9.999999747378752e-06 (both read back as the same f32).
fn num(x: f32) -> Value {
    let v: f64 = x.to_string().parse().unwrap_or(x as f64);
    serde_json::Number::from_f64(v).map(Value::Number).unwrap_or(Value::Null)
}

/// Hugging Face config.json for this model (the fields mlx-lm's llama/qwen2 `ModelArgs` read).
pub fn hf_config_json(cfg: &ModelConfig, quant: Option<&QuantConfig>) -> std::result::Result<Value, String> {
    let (model_type, arch) = match cfg.arch {
        Arch::Llama if cfg.qkv_bias => return Err("a llama model with only q/k/v biases has no mlx-lm form".into()),
        Arch::Llama => ("llama", "LlamaForCausalLM"),
        Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
        Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
        Arch::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
    };
    if cfg.arch == Arch::Qwen2 && cfg.head_dim * cfg.n_heads != cfg.hidden {
        return Err(format!(
            "qwen2 with head_dim {} ≠ hidden/heads: mlx-lm's qwen2 has no head_dim field",
            cfg.head_dim
        ));
    }
    let mut j = json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.max_ctx,
        "rms_norm_eps": num(cfg.rms_eps),
        "rope_theta": num(cfg.rope_theta),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
    });
    if cfg.arch == Arch::Gemma3 {
        j["hidden_activation"] = json!("gelu_pytorch_tanh");
        j.as_object_mut().map(|o| o.remove("hidden_act"));
        j["query_pre_attn_scalar"] = num(cfg.query_pre_attn_scalar.unwrap_or(cfg.head_dim as f32));
        j["rope_local_base_freq"] = num(cfg.rope_local_theta.unwrap_or(cfg.rope_theta));
    }
    if !cfg.layer_kinds.is_empty() {
        j["sliding_window"] = json!(cfg.sliding_window);
        let types: Vec<&str> = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                AttnKind::Full => "full_attention",
                AttnKind::Sliding => "sliding_attention",
            })
            .collect();
        j["layer_types"] = json!(types);
        // mlx-lm's gemma3_text reads the period of the global layers.
        if let Some(p) =
            (1..=cfg.n_layers).find(|&p| ModelConfig::interleaved_kinds(cfg.n_layers, p) == cfg.layer_kinds)
        {
            j["sliding_window_pattern"] = json!(p);
        }
    }
    if let Some(s) = &cfg.llama3_scaling {
        j["rope_scaling"] = json!({
            "rope_type": "llama3",
            "factor": num(s.factor),
            "low_freq_factor": num(s.low_freq_factor),
            "high_freq_factor": num(s.high_freq_factor),
            "original_max_position_embeddings": s.original_max_position as u64,
        });
    } else if cfg.rope_linear != 1.0 {
        j["rope_scaling"] = json!({"type": "linear", "factor": num(cfg.rope_linear)});
    }
    if let Some(q) = quant {
        j["quantization"] = q.to_json();
        j["quantization_config"] = q.to_json();
    }
    Ok(j)
}

/// One safetensors entry, borrowing the tensor's bytes; `data()` ticks the progress bar
/// because the writer calls it exactly once per tensor, as it writes.
struct Out<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
    bar: &'a ProgressBar,
}

impl View for Out<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        self.bar.inc(self.data.len() as u64);
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn scale_view<'a>(s: &'a Scales, shape: Vec<usize>, bar: &'a ProgressBar) -> Out<'a> {
    let (dtype, data): (Dtype, &[u8]) = match s {
        Scales::F16(v) => (Dtype::F16, bytemuck::cast_slice(v)),
        Scales::BF16(v) => (Dtype::BF16, bytemuck::cast_slice(v)),
        Scales::F32(v) => (Dtype::F32, bytemuck::cast_slice(v)),
    };
    Out { dtype, shape, data: Cow::Borrowed(data), bar }
}

/// The safetensors entries for one tensor (three for an affine matrix).
fn views<'a>(name: &str, w: &'a Weight, bar: &'a ProgressBar) -> std::result::Result<Vec<(String, Out<'a>)>, String> {
    match w {
        Weight::Affine(t) => {
            if !is_matrix_name(name) {
                return Err("only matrices can be written quantized".into());
            }
            let m = name.strip_suffix(".weight").unwrap_or(name);
            let gshape = vec![t.rows, t.groups_per_row()];
            let packed = Out {
                dtype: Dtype::U32,
                shape: vec![t.rows, t.words_per_row()],
                data: Cow::Borrowed(bytemuck::cast_slice(&t.packed)),
                bar,
            };
            Ok(vec![
                (name.to_string(), packed),
                (format!("{m}.scales"), scale_view(&t.scales, gshape.clone(), bar)),
                (format!("{m}.biases"), scale_view(&t.biases, gshape, bar)),
            ])
        }
        Weight::Dense(d) => {
            let shape = if is_matrix_name(name) {
                vec![d.rows, d.cols]
            } else if d.rows == 1 {
                vec![d.cols]
            } else {
                return Err(format!("expected a vector, got [{}, {}]", d.rows, d.cols));
            };
            let (dtype, data): (Dtype, &[u8]) = match &d.data {
                DenseData::F32(v) => (Dtype::F32, bytemuck::cast_slice(v)),
                DenseData::F16(v) => (Dtype::F16, bytemuck::cast_slice(v)),
                DenseData::BF16(v) => (Dtype::BF16, bytemuck::cast_slice(v)),
            };
            Ok(vec![(name.to_string(), Out { dtype, shape, data: Cow::Borrowed(data), bar })])
        }
    }
}

/// Undo GGUF's llama q/k permutation. The converter reshapes rows as
/// `[heads, 2, D/2]`, swaps the last two axes and flattens, so Hugging Face row
/// `h·D + j·D/2 + i` sits at ggml row `h·D + 2i + j`. Moving whole rows is exact on
/// quantized data (groups run along the input dim). A 1-D bias is permuted the same way.
pub fn unpermute_rows(w: &Weight, heads: usize, is_bias: bool) -> std::result::Result<Weight, String> {
    let n = if is_bias { w.cols() } else { w.rows() };
    if heads == 0 || !n.is_multiple_of(2 * heads) {
        return Err(format!("{n} rows do not split into {heads} heads of even size"));
    }
    let d = n / heads;
    let src_of = |r: usize| {
        let (h, k) = (r / d, r % d);
        let (j, i) = (k / (d / 2), k % (d / 2));
        h * d + 2 * i + j
    };
    match w {
        Weight::Dense(t) if is_bias => {
            if t.rows != 1 {
                return Err(format!("bias is [{}, {}], expected a vector", t.rows, t.cols));
            }
            Ok(Weight::Dense(DenseTensor { rows: 1, cols: t.cols, data: gather_dense(&t.data, 1, n, src_of) }))
        }
        Weight::Dense(t) => Ok(Weight::Dense(DenseTensor {
            rows: t.rows,
            cols: t.cols,
            data: gather_dense(&t.data, t.cols, n, src_of),
        })),
        Weight::Affine(_) if is_bias => Err("a quantized bias".into()),
        Weight::Affine(t) => {
            let gpr = t.groups_per_row();
            let packed = gather(&t.packed, t.words_per_row(), n, src_of);
            let s = gather_scales(&t.scales, gpr, n, src_of);
            let b = gather_scales(&t.biases, gpr, n, src_of);
            AffineTensor::new(t.rows, t.cols, t.bits, t.group, packed, s, b)
                .map(Weight::Affine)
                .map_err(|e| e.to_string())
        }
    }
}

/// Rows of `width` elements: output row r is input row `src_of(r)`.
fn gather<T: Copy>(v: &[T], width: usize, n: usize, src_of: impl Fn(usize) -> usize) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for r in 0..n {
        let s = src_of(r);
        out.extend_from_slice(&v[s * width..(s + 1) * width]);
    }
    out
}

fn gather_dense(d: &DenseData, width: usize, n: usize, f: impl Fn(usize) -> usize) -> DenseData {
    match d {
        DenseData::F32(v) => DenseData::F32(gather(v, width, n, f)),
        DenseData::F16(v) => DenseData::F16(gather(v, width, n, f)),
        DenseData::BF16(v) => DenseData::BF16(gather(v, width, n, f)),
    }
}

fn gather_scales(s: &Scales, width: usize, n: usize, f: impl Fn(usize) -> usize) -> Scales {
    match s {
        Scales::F32(v) => Scales::F32(gather(v, width, n, f)),
        Scales::F16(v) => Scales::F16(gather(v, width, n, f)),
        Scales::BF16(v) => Scales::BF16(gather(v, width, n, f)),
    }
}
