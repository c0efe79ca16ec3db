//! Tokenizer: text ↔ token ids, and chat templates.
//!
//! Built on the `tokenizers` crate. A GGUF file's vocabulary (`tokenizer.ggml.*`) is turned
//! into the same `tokenizers::Tokenizer` the model ships as tokenizer.json ([`gguf_vocab`]);
//! a Hugging Face directory is read as is ([`hf_dir`]). Decoding goes through a per-token byte
//! table so streamed output never splits a UTF-8 character ([`stream`]). Chat templates are
//! rendered with minijinja the way transformers renders them ([`chat`]).

mod chat;
mod gguf_vocab;
mod hf_dir;
mod stream;

pub use stream::StreamDecoder;

use crate::formats::gguf::GgufFile;
use crate::formats::TokenizerSource;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Special tokens and the model's defaults for adding them.
#[derive(Clone, Debug, Default)]
struct Specials {
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    bos: Option<String>,
    eos: Option<String>,
    unk: Option<String>,
    pad: Option<String>,
    add_bos: bool,
    add_eos: bool,
}

pub struct Tokenizer {
    /// One tokenizer for both modes: `encode` switches special-token matching per call.
    /// (A second copy for plain text would cost ~8 MB on a 49k vocabulary, a tenth of
    /// SmolLM2's weights.)
    hf: std::sync::Mutex<tokenizers::Tokenizer>,
    /// The file or directory it came from, for error messages.
    source: String,
    specials: Specials,
    stop_ids: Vec<u32>,
    chat_template: Option<String>,
    pieces: stream::Pieces,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.specials.bos)
            .field("eos", &self.specials.eos)
            .field("add_bos", &self.specials.add_bos)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    pub fn load(src: &TokenizerSource) -> Result<Tokenizer> {
        match src {
            TokenizerSource::Gguf(path) => Tokenizer::from_gguf(&GgufFile::open(path)?),
            TokenizerSource::Dir(dir) => Tokenizer::from_dir(dir),
            TokenizerSource::Synthetic { vocab } => crate::formats::synthetic::tokenizer(*vocab),
        }
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let b = gguf_vocab::build(g)?;
        let template = match g.get("tokenizer.chat_template") {
            None => g
                .get("general.architecture")
                .and_then(|a| a.as_str())
                .and_then(chat::builtin_template)
                .map(String::from),
            Some(_) => Some(g.req_str("tokenizer.chat_template")?.to_string()),
        };
        Tokenizer::assemble(b.hf, g.path.display().to_string(), b.specials, &b.extra_stops, template)
    }

    /// tokenizer.json + tokenizer_config.json (chat template, special tokens, add_bos_token);
    /// special_tokens_map.json, config.json and generation_config.json fill in what those lack.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let d = hf_dir::read(dir)?;
        Tokenizer::assemble(d.hf, dir.display().to_string(), d.specials, &d.extra_stops, d.chat_template)
    }

    fn assemble(
        hf: tokenizers::Tokenizer,
        source: String,
        specials: Specials,
        extra_stops: &[u32],
        chat_template: Option<String>,
    ) -> Result<Tokenizer> {
        if specials.add_bos && specials.bos_id.is_none() {
            return Err(Error::format(&source, "adds a BOS token but names none"));
        }
        if specials.add_eos && specials.eos_id.is_none() {
            return Err(Error::format(&source, "adds an EOS token but names none"));
        }
        let pieces = stream::Pieces::new(&hf, &source)?;
        let n = pieces.len() as u32;
        if let Some(bad) = [specials.bos_id, specials.eos_id]
            .into_iter()
            .flatten()
            .chain(extra_stops.iter().copied())
            .find(|&i| i >= n)
        {
            return Err(Error::format(
                &source,
                format!("special token id {bad} is outside the vocabulary ({n} tokens)"),
            ));
        }
        let stop_ids = chat::stop_ids(&hf, specials.eos_id, extra_stops, chat_template.as_deref());
        Ok(Tokenizer { hf: std::sync::Mutex::new(hf), source, specials, stop_ids, chat_template, pieces })
    }

    /// special=false: no BOS/EOS, and text that looks like a special token is plain text.
    /// special=true: special-token text maps to its token, and BOS (EOS) is added where the
    /// model adds one by default.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let mut hf = self.hf();
        // Special-token text in user input stays text (transformers' split_special_tokens).
        hf.set_encode_special_tokens(!special);
        // The post-processor is bypassed (add_special_tokens = false): BOS/EOS are ours to add,
        // so they are added exactly once whatever tokenizer.json's template says.
        let enc = hf
            .encode_fast(text, false)
            .map_err(|e| Error::Invalid(format!("{}: encoding failed: {e}", self.source)))?;
        let s = &self.specials;
        let mut ids = Vec::with_capacity(enc.len() + 2);
        if special && s.add_bos {
            ids.extend(s.bos_id);
        }
        ids.extend_from_slice(enc.get_ids());
        if special && s.add_eos {
            ids.extend(s.eos_id);
        }
        Ok(ids)
    }

    /// A rendered chat template's ids: special tokens parsed, nothing added (the template
    /// writes its own BOS where the model wants one), as Transformers' apply_chat_template.
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>> {
        let mut hf = self.hf();
        hf.set_encode_special_tokens(false);
        let enc = hf
            .encode_fast(text, false)
            .map_err(|e| Error::Invalid(format!("{}: encoding failed: {e}", self.source)))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are not printed.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut d = StreamDecoder::new(self);
        let mut out = String::new();
        for &id in ids {
            out += &d.push(id)?;
        }
        out += &d.finish()?;
        Ok(out)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.specials.bos_id
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.specials.eos_id
    }
    pub fn add_bos_default(&self) -> bool {
        self.specials.add_bos
    }
    /// EOS plus the end-of-turn tokens the chat template writes, without repeats.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
    pub fn bos_token(&self) -> Option<&str> {
        self.specials.bos.as_deref()
    }
    pub fn eos_token(&self) -> Option<&str> {
        self.specials.eos.as_deref()
    }
    /// The file or directory this tokenizer was read from (for messages).
    pub fn source(&self) -> &str {
        &self.source
    }
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf().token_to_id(token)
    }

    /// This tokenizer with its vocabulary extended to `vocab` ids, id i ≥ the current size
    /// spelled `name(i)`, for a model whose embedding has more rows than the tokenizer has
    /// tokens (synthetic models). The new ids are entries of the BPE vocabulary, not added
    /// tokens: no merge produces them, so encoding never does (and does not pay for
    /// matching tens of thousands of added tokens in every text), while decoding prints
    /// their spelling, so a model that samples them shows it. Only BPE models extend.
    pub fn padded(&self, vocab: usize, name: impl Fn(usize) -> String) -> Result<Tokenizer> {
        let have = self.vocab_size();
        if vocab < have {
            return Err(Error::Invalid(format!(
                "{}: cannot pad {have} tokens down to a vocabulary of {vocab}",
                self.source
            )));
        }
        let source = format!("{} (padded to {vocab} tokens)", self.source);
        let err = |m: String| Error::format(&source, m);
        let mut j = serde_json::to_value(&*self.hf()).map_err(|e| err(format!("serializing: {e}")))?;
        let model = &mut j["model"];
        if model["type"] != "BPE" {
            return Err(Error::Unsupported(format!(
                "{source}: padding a {} tokenizer model (only BPE)",
                model["type"]
            )));
        }
        let map = model["vocab"].as_object_mut().ok_or_else(|| err("model.vocab is not an object".into()))?;
        for id in have..vocab {
            let t = name(id);
            if map.insert(t.clone(), id.into()).is_some() {
                return Err(err(format!("padding token {t:?} is already in the vocabulary")));
            }
        }
        let bytes = serde_json::to_vec(&j).map_err(|e| err(format!("serializing: {e}")))?;
        let hf = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| err(format!("rebuilding: {e}")))?;
        let t = Tokenizer::assemble(hf, source, self.specials.clone(), &self.stop_ids, self.chat_template.clone())?;
        if t.vocab_size() != vocab {
            return Err(Error::format(
                &t.source,
                format!("padded to {} tokens, expected {vocab} (ids are not contiguous)", t.vocab_size()),
            ));
        }
        Ok(t)
    }

    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        chat::apply(self, messages, add_generation_prompt)
    }

    /// The underlying tokenizer, e.g. to write tokenizer.json. Held locked while in use.
    pub fn hf(&self) -> std::sync::MutexGuard<'_, tokenizers::Tokenizer> {
        // A panic while encoding cannot leave the tokenizer half-modified: recover the guard.
        let mut g = self.hf.lock().unwrap_or_else(|e| e.into_inner());
        g.set_encode_special_tokens(false);
        g
    }
}
