//! GGUF → ModelSource: ggml tensor names mapped to canonical names, blocks imported into
//! the affine format one tensor at a time (pages released as we go to bound peak RSS).

use super::gguf::GgufFile;
use super::{ModelSource, TensorMap, TokenizerSource};
use crate::config::{Arch, ModelConfig};
use crate::quant::ggml;
use crate::quant::{DenseData, DenseTensor, Weight};
use crate::{Error, Result};
use std::path::Path;

/// Canonical name for a ggml tensor name of a model of `arch`; `None` for tensors the model
/// does not use.
pub fn canonical(name: &str, arch: Arch) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        "rope_freqs.weight" => Some("rope_freqs"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (idx, tail) = rest.split_once('.')?;
    let i: usize = idx.parse().ok()?;
    let hf = match tail {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        // Gemma's norm after attention, then its own before the MLP; Llama's pre-MLP norm
        // has the name of the first.
        "post_attention_norm.weight" => "post_attention_layernorm.weight",
        "ffn_norm.weight" if arch == Arch::Gemma3 => "pre_feedforward_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "post_ffw_norm.weight" => "post_feedforward_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{i}.{hf}"))
}

pub fn load_gguf(path: &Path, progress: bool) -> Result<ModelSource> {
    from_file(&GgufFile::open(path)?, progress)
}

/// Import every tensor of an opened GGUF file.
pub fn from_file(g: &GgufFile, progress: bool) -> Result<ModelSource> {
    let path = g.path.as_path();
    let config = ModelConfig::from_gguf(g)?;
    let total: u64 = g.tensors.iter().map(|t| t.len as u64).sum();
    let bar = crate::progress::bar(progress, total, "loading");
    let mut tensors = TensorMap::new();
    for t in &g.tensors {
        let Some(name) = canonical(&t.name, config.arch) else {
            bar.inc(t.len as u64);
            continue;
        };
        let (rows, cols) = t.matrix_shape();
        let mut w = ggml::import(t.ty, g.data(t), rows, cols)
            .map_err(|e| Error::format(path, format!("tensor {}: {e}", t.name)))?;
        if config.norm_plus_one && name.ends_with("norm.weight") {
            w = unit_offset_removed(w);
        }
        g.release(t);
        tensors.insert(name, w);
        bar.inc(t.len as u64);
    }
    bar.finish_and_clear();
    Ok(ModelSource {
        path: path.to_path_buf(),
        format: "gguf",
        config,
        tensors,
        tokenizer: TokenizerSource::Gguf(path.to_path_buf()),
        file_bytes: g.file_size() as u64,
        synthetic: None,
        tokenizer_vocab: None,
    })
}

/// A Gemma norm gain as its GGUF stores it (1 + w, llama.cpp's conversion adds the 1) back
/// to the canonical w.
fn unit_offset_removed(w: Weight) -> Weight {
    let (rows, cols) = (w.rows(), w.cols());
    let data = w.to_f32_vec().into_iter().map(|g| g - 1.0).collect();
    Weight::Dense(DenseTensor { rows, cols, data: DenseData::F32(data) })
}
