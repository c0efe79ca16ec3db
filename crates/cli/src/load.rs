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
    /// The shape's name when the weights are synthetic (random).
    pub synthetic: Option<String>,
}

/// Show progress bars only when stderr is a terminal.
pub fn progress() -> bool {
    std::io::stderr().is_terminal()
}

pub fn source(model: Option<&str>) -> Result<(ModelSource, Tokenizer)> {
    let path = hub::resolve(model)?;
    let (src, tok) = formats::load_with_tokenizer(&path, progress())?;
    // Give the tokenizer's and the GGUF header's freed build memory back to the OS before
    // the process settles (glibc keeps small freed chunks otherwise).
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free heap pages.
    unsafe {
        libc::malloc_trim(0);
    }
    Ok((src, tok))
}

pub fn model(arg: &crate::ModelArg) -> Result<Loaded> {
    let (mut src, tokenizer) = source(arg.model.as_deref())?;
    if let Some(s) = &arg.quantize {
        ferrolm::quant::scheme::apply(&mut src, &ferrolm::quant::scheme::QuantScheme::parse(s)?, progress())?;
    }
    let (file_bytes, synthetic) = (src.file_bytes, src.synthetic.take());
    let model = Llama::load(Cpu, &mut src)?;
    Ok(Loaded { model, tokenizer, file_bytes, synthetic })
}
