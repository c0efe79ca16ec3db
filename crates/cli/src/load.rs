//! Loading a model and its tokenizer for the commands.

use crate::hub;
use anyhow::Result;
use ferrolm::backend::cpu::Cpu;
use ferrolm::formats::{self, ModelSource};
use ferrolm::model::Llama;
use ferrolm::tokenizer::Tokenizer;
use std::io::IsTerminal;

pub struct Loaded {
    pub model: Llama<Cpu>,
    pub tokenizer: Tokenizer,
    pub file_bytes: u64,
}

/// Show progress bars only when stderr is a terminal.
pub fn progress() -> bool {
    std::io::stderr().is_terminal()
}

pub fn source(model: Option<&str>) -> Result<(ModelSource, Tokenizer)> {
    let path = hub::resolve(model)?;
    let src = formats::load(&path, progress())?;
    let tok = Tokenizer::load(&src.tokenizer)?;
    Ok((src, tok))
}

pub fn model(model: Option<&str>) -> Result<Loaded> {
    let (mut src, tokenizer) = source(model)?;
    let file_bytes = src.file_bytes;
    let model = Llama::load(Cpu, &mut src)?;
    Ok(Loaded { model, tokenizer, file_bytes })
}
