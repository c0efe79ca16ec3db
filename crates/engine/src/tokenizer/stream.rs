//! Decoding: token ids → bytes → text, whole or streamed.
//!
//! Every token's bytes are worked out once, from the tokenizer's decoder (byte-level or
//! SentencePiece-style), so decoding is a table lookup and streaming can tell exactly where a
//! UTF-8 character is still incomplete. `Tokenizer::decode` runs the same streaming state
//! machine over all ids, so the streamed pieces always add up to `decode()`.

use super::Tokenizer;
use crate::{Error, Result};
use serde_json::Value;

/// What the decoder does to the start of the text.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum FirstPiece {
    Keep,
    /// `Strip(' ', n, 0)` after `Fuse`: drop up to n leading spaces of the whole text.
    StripSpaces(usize),
    /// `Metaspace` with a prepend scheme: the first token's `▁` become nothing, not spaces.
    DropMetaspace,
}

/// Per-token bytes and the decoder rules that are not per-token.
pub(super) struct Pieces {
    bytes: Vec<u8>,
    /// `offs[id]..offs[id + 1]` is token id's slice of `bytes`.
    offs: Vec<usize>,
    /// Special added tokens: never printed.
    skip: Vec<bool>,
    first: FirstPiece,
    byte_fallback: bool,
}

/// GPT-2's printable alias for each byte (byte-level BPE spells tokens with these).
fn byte_aliases() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            b as char
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("below U+0200")
        };
    }
    out
}

fn byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

enum Rule {
    ByteLevel,
    Pieces { metaspace: bool, byte_fallback: bool, first: FirstPiece },
}

/// Read the decoder's shape from its serialized form (the tokenizer.json schema).
fn rule(file: &str, decoder: Option<Value>) -> Result<Rule> {
    let unsupported = |what: &str| {
        Error::Unsupported(format!(
            "{file}: tokenizer decoder {what} (supported: ByteLevel, or SentencePiece-style \
             Replace/ByteFallback/Fuse/Strip/Metaspace)"
        ))
    };
    let d = decoder.ok_or_else(|| unsupported("missing"))?;
    let steps = match d["type"].as_str() {
        Some("Sequence") => d["decoders"].as_array().cloned().unwrap_or_default(),
        _ => vec![d],
    };
    let kinds: Vec<&str> = steps.iter().filter_map(|s| s["type"].as_str()).collect();
    if kinds == ["ByteLevel"] {
        return Ok(Rule::ByteLevel);
    }
    let (mut metaspace, mut byte_fallback, mut first) = (false, false, FirstPiece::Keep);
    for s in &steps {
        match s["type"].as_str().unwrap_or("?") {
            "Replace" if s["pattern"]["String"] == "\u{2581}" && s["content"] == " " => metaspace = true,
            "ByteFallback" => byte_fallback = true,
            "Fuse" => {}
            "Strip" if s["content"] == " " && s["stop"] == 0 => {
                first = FirstPiece::StripSpaces(s["start"].as_u64().unwrap_or(0) as usize)
            }
            "Metaspace" if s["replacement"] == "\u{2581}" => {
                metaspace = true;
                if s["prepend_scheme"] != "never" {
                    first = FirstPiece::DropMetaspace;
                }
            }
            _ => return Err(unsupported(&s.to_string())),
        }
    }
    Ok(Rule::Pieces { metaspace, byte_fallback, first })
}

impl Pieces {
    pub(super) fn new(hf: &tokenizers::Tokenizer, file: &str) -> Result<Pieces> {
        let dec = hf
            .get_decoder()
            .map(serde_json::to_value)
            .transpose()
            .map_err(|e| Error::format(file, format!("decoder: {e}")))?;
        let rule = rule(file, dec)?;
        let added = hf.get_added_tokens_decoder();
        let n = added.keys().map(|&i| i as usize + 1).chain([hf.get_vocab_size(false)]).max().unwrap_or(0);
        let aliases = byte_aliases();
        let mut from_alias = std::collections::HashMap::new();
        for (b, c) in aliases.iter().enumerate() {
            from_alias.insert(*c, b as u8);
        }
        let mut p = Pieces {
            bytes: Vec::new(),
            offs: Vec::with_capacity(n + 1),
            skip: vec![false; n],
            first: FirstPiece::Keep,
            byte_fallback: false,
        };
        p.offs.push(0);
        for id in 0..n as u32 {
            let tok = hf.id_to_token(id).unwrap_or_default();
            match &rule {
                // Mirrors tokenizers' ByteLevel decoder: a token spelled entirely in byte
                // aliases is those bytes; any other token is its own UTF-8.
                Rule::ByteLevel => {
                    let mapped: Option<Vec<u8>> = tok.chars().map(|c| from_alias.get(&c).copied()).collect();
                    p.bytes.extend(mapped.unwrap_or_else(|| tok.as_bytes().to_vec()));
                }
                Rule::Pieces { metaspace, byte_fallback, .. } => match byte_token(&tok).filter(|_| *byte_fallback) {
                    Some(b) => p.bytes.push(b),
                    None if *metaspace => p.bytes.extend(tok.replace('\u{2581}', " ").bytes()),
                    None => p.bytes.extend(tok.bytes()),
                },
            }
            p.offs.push(p.bytes.len());
        }
        for (id, t) in added.iter() {
            p.skip[*id as usize] = t.special;
        }
        if let Rule::Pieces { first, byte_fallback, .. } = rule {
            p.first = first;
            p.byte_fallback = byte_fallback;
        }
        Ok(p)
    }

    pub(super) fn len(&self) -> usize {
        self.skip.len()
    }
}

/// Turns generated ids into text as they arrive. `push` returns the text completed by this
/// token; bytes of a character that is not finished yet are held back until it is.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    /// Bytes not yet returned: an unfinished UTF-8 sequence at most.
    pending: Vec<u8>,
    /// No printable token seen yet (the decoder's start-of-text rule still applies).
    at_first: bool,
    /// No byte returned yet, and leading spaces stripped so far.
    at_start: bool,
    stripped: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder { tok, pending: Vec::new(), at_first: true, at_start: true, stripped: 0 }
    }

    pub fn push(&mut self, id: u32) -> Result<String> {
        let p = &self.tok.pieces;
        let i = id as usize;
        if i >= p.len() {
            return Err(Error::Invalid(format!("token id {id} is outside the vocabulary ({} tokens)", p.len())));
        }
        if p.skip[i] {
            return Ok(String::new());
        }
        let piece = &p.bytes[p.offs[i]..p.offs[i + 1]];
        if std::mem::take(&mut self.at_first) && p.first == FirstPiece::DropMetaspace {
            let tok = self.tok.hf().id_to_token(id).unwrap_or_default();
            match byte_token(&tok).filter(|_| p.byte_fallback) {
                Some(b) => self.take(&[b]),
                None => self.take(tok.replace('\u{2581}', "").as_bytes()),
            }
        } else {
            self.take(piece);
        }
        Ok(self.drain(false))
    }

    /// Everything still held back; an unfinished character becomes U+FFFD.
    pub fn finish(&mut self) -> Result<String> {
        Ok(self.drain(true))
    }

    fn take(&mut self, bytes: &[u8]) {
        let mut bytes = bytes;
        if let FirstPiece::StripSpaces(n) = self.tok.pieces.first {
            while self.at_start && self.stripped < n && bytes.first() == Some(&b' ') {
                bytes = &bytes[1..];
                self.stripped += 1;
            }
        }
        if !bytes.is_empty() {
            self.at_start = false;
        }
        self.pending.extend_from_slice(bytes);
    }

    /// The longest prefix of `pending` that is decided, as `String::from_utf8_lossy` would
    /// write it: invalid bytes become U+FFFD at once; an incomplete tail waits unless `all`.
    fn drain(&mut self, all: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // `good` is the prefix from_utf8 just validated.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(k) => {
                            out.push('\u{FFFD}');
                            rest = &bad[k..];
                        }
                        None if all => {
                            out.push('\u{FFFD}');
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }
}
