//! Model file formats: GGUF files, Hugging Face and MLX safetensors directories.
//!
//! Every importer produces a [`ModelSource`]: a [`ModelConfig`], a [`TensorMap`] keyed by
//! canonical (Hugging Face) tensor names, and where the tokenizer lives. GGUF keeps its
//! q/k row order (rotate adjacent pairs, `RopeStyle::Interleaved`); everything else uses
//! Hugging Face's rotate-half order.

pub mod gguf;
pub mod gguf_names;
pub mod gguf_write;
pub mod mlx_write;
pub mod safetensors;
pub mod synthetic;

use crate::config::ModelConfig;
use crate::quant::Weight;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Tensors by canonical name. 1-D tensors (norms, biases) are `Weight::Dense` with rows = 1.
pub type TensorMap = BTreeMap<String, Weight>;

pub enum TokenizerSource {
    /// GGUF metadata (`tokenizer.ggml.*`), read from this file.
    Gguf(PathBuf),
    /// A directory with tokenizer.json (+ tokenizer_config.json).
    Dir(PathBuf),
    /// A synthetic model's: SmolLM2's tokenizer padded to `vocab` ids ([`synthetic::tokenizer`]).
    Synthetic { vocab: usize },
}

pub struct ModelSource {
    pub path: PathBuf,
    /// "gguf", "mlx", "hf".
    pub format: &'static str,
    pub config: ModelConfig,
    pub tensors: TensorMap,
    pub tokenizer: TokenizerSource,
    /// Size of the model file(s) on disk.
    pub file_bytes: u64,
    /// `Some(name)` when the weights are random ([`synthetic`]): generated here, or read
    /// from a directory whose config.json has `"ferrolm_synthetic": name`. Numbers measured
    /// on such a model must say so.
    pub synthetic: Option<String>,
    /// The tokenizer's vocabulary size, where it is known and smaller than the embedding's
    /// (a padded vocabulary, as Qwen checkpoints have): the head then scores only those ids,
    /// so an id with no token is never sampled.
    pub tokenizer_vocab: Option<usize>,
}

impl ModelSource {
    pub fn take(&mut self, name: &str) -> Result<Weight> {
        self.tensors.remove(name).ok_or_else(|| Error::format(&self.path, format!("tensor {name} is missing")))
    }
}

/// Open a model: a .gguf file, or a directory holding config.json + *.safetensors.
pub fn load(path: &Path, progress: bool) -> Result<ModelSource> {
    if path.is_dir() {
        safetensors::load_dir(path, progress)
    } else if path.exists() {
        gguf_names::load_gguf(path, progress)
    } else {
        Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory")))
    }
}

/// Open a model and its tokenizer. A GGUF file is parsed once for both, tokenizer first,
/// so the tokenizer's build garbage is freed before the weights are allocated.
pub fn load_with_tokenizer(path: &Path, progress: bool) -> Result<(ModelSource, crate::tokenizer::Tokenizer)> {
    if path.is_file() {
        let mut g = gguf::GgufFile::open(path)?;
        let tok = crate::tokenizer::Tokenizer::from_gguf(&g)?;
        g.forget_tokenizer();
        let mut src = gguf_names::from_file(&g, progress)?;
        src.tokenizer_vocab = Some(tok.vocab_size());
        return Ok((src, tok));
    }
    let mut src = load(path, progress)?;
    let tok = crate::tokenizer::Tokenizer::load(&src.tokenizer)?;
    src.tokenizer_vocab = Some(tok.vocab_size());
    Ok((src, tok))
}

/// Canonical tensor names (Hugging Face Llama layout).
pub mod names {
    pub const EMBED: &str = "model.embed_tokens.weight";
    pub const NORM: &str = "model.norm.weight";
    pub const LM_HEAD: &str = "lm_head.weight";
    pub fn layer(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }
}
