//! Build a `tokenizers::Tokenizer` from GGUF metadata (`tokenizer.ggml.*`).
//!
//! Two vocabulary kinds, as llama.cpp names them in `tokenizer.ggml.model`:
//! - `gpt2`: byte-level BPE with explicit merges. How text is cut into words before BPE depends
//!   on the model family, named by `tokenizer.ggml.pre`; we rebuild the pre-tokenizer that
//!   family's own tokenizer.json uses (the one its merges were learned with).
//! - `llama`: a SentencePiece vocabulary (tokens + scores). We turn it into BPE with byte
//!   fallback, deriving merges from the scores the way Hugging Face's converter does, so the
//!   result is the tokenizer the model ships on the Hub.
//!
//! Control (type 3) and unknown (type 2) tokens become special added tokens, user-defined
//! (type 4) ones plain added tokens: both are matched whole in the text, as llama.cpp does.

use super::Specials;
use crate::formats::gguf::{GgufFile, MetaValue};
use crate::{Error, Result};
use std::collections::HashMap;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Replace, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

// llama.cpp token types (tokenizer.ggml.token_type).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// GPT-2's word regex (the one ByteLevel applies with use_regex = true).
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's regex, as written in its tokenizer.json.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's regex: like Llama 3 but single digits.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken regex.
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k (GPT-4o) regex, also used by Llama 4.
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer, plus what the caller needs that tokenizers does not keep.
pub(super) struct Built {
    pub hf: tokenizers::Tokenizer,
    pub specials: Specials,
    /// Extra end-of-generation ids the file names (eot / eom).
    pub extra_stops: Vec<u32>,
}

pub(super) fn build(g: &GgufFile) -> Result<Built> {
    let ferr = |msg: String| Error::format(&g.path, msg);
    let tokens = g.str_array("tokenizer.ggml.tokens")?;
    if tokens.is_empty() {
        return Err(ferr("metadata tokenizer.ggml.tokens: empty vocabulary".into()));
    }
    let n = tokens.len();
    let types = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; n],
        Some(v) => int_array(g, "tokenizer.ggml.token_type", v, n)?,
    };
    let model = g.req_str("tokenizer.ggml.model")?;
    let id = |key: &str| -> Result<Option<u32>> {
        match g.opt_u64(key)? {
            Some(i) if (i as usize) < n => Ok(Some(i as u32)),
            Some(i) => Err(ferr(format!("metadata {key} = {i} is outside the vocabulary ({n} tokens)"))),
            None => Ok(None),
        }
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    let pad = id("tokenizer.ggml.padding_token_id")?;
    let mut extra_stops = Vec::new();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        extra_stops.extend(id(key)?);
    }

    // Gemma files spell whitespace-run tokens with real spaces ("  ") and mark them
    // user-defined. transformers' GGUF loader (our reference) respells them "▁▁" so BPE builds
    // them from "▁" pieces, as ordinary vocabulary; we do the same. This differs from llama.cpp
    // (which matches them whole, longest first) only on runs longer than the longest such token.
    let arch = g.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
    let gemma = model == "llama" && arch.starts_with("gemma");
    let respelled: Vec<std::borrow::Cow<str>> = tokens
        .iter()
        .map(|&t| {
            if gemma && t.contains(' ') && t.trim().is_empty() {
                "\u{2581}".repeat(t.chars().count()).into()
            } else {
                t.into()
            }
        })
        .collect();
    let spelled: Vec<&str> = respelled.iter().map(|t| t.as_ref()).collect();

    let (mut hf, default_add_bos) = match model {
        "gpt2" => (byte_level(g, &spelled)?, pre_defaults_bos(g)?),
        "llama" => (sentencepiece(g, &spelled, unk, gemma)?, true),
        other => {
            return Err(Error::Unsupported(format!(
                "{}: tokenizer.ggml.model = \"{other}\" (supported: gpt2, llama)",
                g.path.display()
            )))
        }
    };

    // Added tokens: matched whole before the model sees the text.
    let mut special = Vec::new();
    let mut plain = Vec::new();
    for (i, (&tok, &ty)) in spelled.iter().zip(&types).enumerate() {
        let t = AddedToken::from(tok, false).normalized(false);
        if ty == TYPE_CONTROL || ty == TYPE_UNKNOWN || Some(i as u32) == unk {
            special.push(t.special(true));
        } else if ty == TYPE_USER_DEFINED && tok == tokens[i] {
            plain.push(t);
        }
    }
    // One call each: every call rebuilds the matcher over all added tokens. (tokenizers
    // before 0.23 also compared each new token with every one already added: quadratic, 37 s
    // of a 1B GGUF's load on an H200 host for synth_gguf.py's 79k user-defined padding tokens.)
    hf.add_special_tokens(special).map_err(|e| tk_err(g, "special tokens", e))?;
    hf.add_tokens(plain).map_err(|e| tk_err(g, "user-defined tokens", e))?;

    let name = |i: Option<u32>| i.map(|i| tokens[i as usize].to_string());
    let specials = Specials {
        bos_id: bos,
        eos_id: eos,
        bos: name(bos),
        eos: name(eos),
        unk: name(unk),
        pad: name(pad),
        add_bos: g.opt_bool("tokenizer.ggml.add_bos_token").unwrap_or(default_add_bos),
        add_eos: g.opt_bool("tokenizer.ggml.add_eos_token").unwrap_or(false),
    };
    if specials.add_bos || specials.add_eos {
        // `encode` adds BOS/EOS itself; the post-processor is for tokenizer.json written from
        // `hf()` (ferrolm convert), so that file adds them as the GGUF says.
        hf.with_post_processor(Some(post_processor(g, &specials)?));
    }
    Ok(Built { hf, specials, extra_stops })
}

fn post_processor(g: &GgufFile, s: &Specials) -> Result<TemplateProcessing> {
    let bos = s.bos.clone().zip(s.bos_id).filter(|_| s.add_bos);
    let eos = s.eos.clone().zip(s.eos_id).filter(|_| s.add_eos);
    let specials: Vec<(String, u32)> = bos.iter().chain(&eos).cloned().collect();
    let wrap = |seq: &str| {
        let (b, e) = (bos.iter().map(|t| t.0.as_str()), eos.iter().map(|t| t.0.as_str()));
        b.chain([seq]).chain(e).collect::<Vec<_>>().join(" ")
    };
    let single = wrap("$A");
    let pair = format!("{single} {}", wrap("$B:1"));
    TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| tk_err(g, "post-processor template", e))?
        .special_tokens(specials)
        .build()
        .map_err(|e| tk_err(g, "post-processor template", e))
}

fn int_array(g: &GgufFile, key: &str, v: &MetaValue, n: usize) -> Result<Vec<i64>> {
    let bad = || Error::format(&g.path, format!("metadata {key}: not an array of {n} integers"));
    let a = v.as_array().filter(|a| a.len() == n).ok_or_else(bad)?;
    a.iter()
        .map(|x| match *x {
            MetaValue::I32(v) => Ok(v as i64),
            MetaValue::I64(v) => Ok(v),
            _ => x.as_u64().map(|v| v as i64).ok_or_else(bad),
        })
        .collect()
}

fn f64_array(g: &GgufFile, key: &str, n: usize) -> Result<Vec<f64>> {
    let bad = || Error::format(&g.path, format!("metadata {key}: missing or not {n} numbers"));
    let a = g.get(key).and_then(|v| v.as_array()).filter(|a| a.len() == n).ok_or_else(bad)?;
    a.iter().map(|x| x.as_f64().ok_or_else(bad)).collect()
}

fn vocab_map(tokens: &[&str]) -> Vocab {
    // A spelling listed twice (seen in some converted vocabularies) maps to its last id, as
    // llama.cpp's text→token map and transformers' vocab dict both do.
    tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect()
}

fn tk_err(g: &GgufFile, what: &str, e: impl std::fmt::Display) -> Error {
    Error::format(&g.path, format!("{what}: {e}"))
}

/// llama.cpp turns BOS on by default for some byte-level families (Llama 3 and relatives).
fn pre_defaults_bos(g: &GgufFile) -> Result<bool> {
    let pre = pre_name(g)?;
    Ok(matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe"))
}

fn pre_name(g: &GgufFile) -> Result<&str> {
    // Files written before the key existed get llama.cpp's "default" splitting.
    Ok(match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(_) => g.req_str("tokenizer.ggml.pre")?,
    })
}

fn split(g: &GgufFile, re: &str) -> Result<PreTokenizerWrapper> {
    let s = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
        .map_err(|e| tk_err(g, "pre-tokenizer regex", e))?;
    Ok(s.into())
}

/// Regex splits followed by the byte-level mapping (no regex of its own).
fn splits_then_bytes(g: &GgufFile, res: &[&str]) -> Result<PreTokenizerWrapper> {
    let mut v = res.iter().map(|r| split(g, r)).collect::<Result<Vec<_>>>()?;
    v.push(ByteLevel::new(false, true, false).into());
    Ok(PreSequence::new(v).into())
}

/// The pre-tokenizer (and normalizer) of a `tokenizer.ggml.pre` family, plus whether its BPE
/// ignores merges for words that are already whole tokens (Llama 3 sets this).
fn byte_level_pre(g: &GgufFile) -> Result<(PreTokenizerWrapper, Option<NormalizerWrapper>, bool)> {
    let pre = pre_name(g)?;
    Ok(match pre {
        "gpt-2" | "mpt" | "olmo" | "jais" => (ByteLevel::new(false, true, true).into(), None, false),
        // SmolLM/StarCoder: every digit on its own, then GPT-2 words (SmolLM2's tokenizer.json
        // is Digits(individual_digits) + ByteLevel; llama.cpp splits on \p{N} first: the same).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            let seq = PreSequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]);
            (seq.into(), None, false)
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
            (splits_then_bytes(g, &[LLAMA3_SPLIT])?, None, true)
        }
        // Qwen2's tokenizer.json normalizes to NFC before splitting.
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => {
            (splits_then_bytes(g, &[QWEN2_SPLIT])?, Some(NFC.into()), false)
        }
        "tekken" => (splits_then_bytes(g, &[TEKKEN_SPLIT])?, None, false),
        "gpt-4o" | "llama4" => (splits_then_bytes(g, &[GPT4O_SPLIT])?, None, false),
        // llama.cpp's fallback for vocabularies it could not identify: punctuation runs, GPT-2
        // words, digit runs, then groups of three ASCII digits.
        "default" => {
            (splits_then_bytes(g, &[r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"])?, None, false)
        }
        other => {
            return Err(Error::format(
                &g.path,
                format!(
                    "tokenizer.ggml.pre = \"{other}\" is not a pre-tokenizer ferrolm knows \
                     (known: gpt-2, smollm, starcoder, llama-bpe, llama3, qwen2, tekken, \
                     gpt-4o, default and their aliases)"
                ),
            ))
        }
    })
}

/// `tokenizer.ggml.merges`: "left right" strings, best first.
fn parse_merges(g: &GgufFile) -> Result<Vec<(String, String)>> {
    let raw = g.str_array("tokenizer.ggml.merges")?;
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            let (a, b) = m.split_once(' ').ok_or_else(|| {
                Error::format(&g.path, format!("metadata tokenizer.ggml.merges[{i}] = {m:?} is not \"left right\""))
            })?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect()
}

fn byte_level(g: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let merges = parse_merges(g)?;
    let (pre, norm, ignore_merges) = byte_level_pre(g)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_map(tokens), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| tk_err(g, "tokenizer.ggml.merges", e))?;
    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_normalizer(norm).map_err(|e| tk_err(g, "normalizer", e))?;
    hf.with_pre_tokenizer(Some(pre));
    hf.with_decoder(Some(ByteLevel::new(false, true, true)));
    Ok(hf)
}

/// SentencePiece vocabulary → BPE with byte fallback.
fn sentencepiece(g: &GgufFile, tokens: &[&str], unk: Option<u32>, gemma: bool) -> Result<tokenizers::Tokenizer> {
    let n = tokens.len();
    let merges = if g.get("tokenizer.ggml.merges").is_some() {
        parse_merges(g)?
    } else {
        // Gemma's scores do not follow its merge order for the tokens that are not ordinary
        // pieces (control, user-defined and byte tokens all share a score); its file order
        // does, so rank by position (transformers' Gemma rule).
        let scores =
            if gemma { (0..n).map(|i| -(i as f64)).collect() } else { f64_array(g, "tokenizer.ggml.scores", n)? };
        merges_from_scores(tokens, &scores)
    };
    let mut b = BPE::builder().vocab_and_merges(vocab_map(tokens), merges).byte_fallback(true).fuse_unk(true);
    if let Some(u) = unk {
        b = b.unk_token(tokens[u as usize].to_string());
    }
    let bpe = b.build().map_err(|e| tk_err(g, "tokenizer.ggml.scores", e))?;
    // add_space_prefix: SentencePiece's add_dummy_prefix. llama.cpp's default is on.
    let prefix = g.opt_bool("tokenizer.ggml.add_space_prefix").unwrap_or(true);
    let scheme = if prefix { PrependScheme::First } else { PrependScheme::Never };
    let mut dec: Vec<DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ").map_err(|e| tk_err(g, "decoder", e))?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if prefix {
        // The dummy prefix added on encode is dropped again on decode.
        dec.push(Strip::new(' ', 1, 0).into());
    }
    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', scheme, false)));
    hf.with_decoder(Some(DecoderSequence::new(dec)));
    Ok(hf)
}

/// Longest token (in chars) that merges are derived for. Every cut of a token is hashed, so a
/// token costs its length squared: a hostile vocabulary of long tokens would make the build
/// take hours. Real SentencePiece vocabularies stay far below (Gemma 3's longest: 31 chars);
/// a longer token stays in the vocabulary (encoded as itself where it is an added token,
/// decoded always), only no merge produces it.
const MERGE_PIECE_CHARS: usize = 128;

/// Merges implied by a scored vocabulary: every way to cut a token into two tokens is a merge,
/// ranked by the whole token's score (higher first), then by longer left and right pieces, then
/// by vocabulary order. This is Hugging Face's rule (transformers `generate_merges`), so BPE
/// here agrees with the tokenizer.json the model ships. Tokens over `MERGE_PIECE_CHARS`
/// chars are left out.
pub(super) fn merges_from_scores(tokens: &[&str], scores: &[f64]) -> Vec<(String, String)> {
    let mut ids: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        ids.insert(t, i); // last id wins, as in vocab_map
    }
    // (score, left chars, right chars, token id, left id, right id, left, right)
    struct M<'a> {
        score: f64,
        ll: usize,
        lr: usize,
        tok: usize,
        il: usize,
        ir: usize,
        l: &'a str,
        r: &'a str,
    }
    let mut all = Vec::new();
    for (tok, t) in tokens.iter().enumerate() {
        if ids[t] != tok {
            continue; // a duplicate spelling: only its last id is a vocabulary entry
        }
        let nchars = t.chars().count();
        if nchars > MERGE_PIECE_CHARS {
            continue;
        }
        for (k, (cut, _)) in t.char_indices().enumerate().skip(1) {
            let (l, r) = t.split_at(cut);
            if let (Some(&il), Some(&ir)) = (ids.get(l), ids.get(r)) {
                all.push(M { score: scores[tok], ll: k, lr: nchars - k, tok, il, ir, l, r });
            }
        }
    }
    all.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.ll.cmp(&a.ll))
            .then(b.lr.cmp(&a.lr))
            .then(a.tok.cmp(&b.tok))
            .then((a.il, a.ir).cmp(&(b.il, b.ir)))
    });
    all.into_iter().map(|m| (m.l.to_string(), m.r.to_string())).collect()
}
