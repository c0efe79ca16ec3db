//! Tokenizer parity with transformers (goldens from tools/oracle/tokenizer_golden.py) on the
//! real SmolLM2-135M-Instruct GGUF, streaming decode, directory loading and error paths.
//!
//! The model is read from `$FERROLM_MODELS` (default `~/.cache/ferrolm/models/`); these tests
//! FAIL when it is missing rather than skip.

use ferrolm::formats::gguf::GgufFile;
use ferrolm::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

// Templates render here as in the CLI: under the memory guard (the chat goldens below then
// show that it changes no real template's output).
#[global_allocator]
static ALLOC: ferrolm::alloc_guard::GuardedAlloc = ferrolm::alloc_guard::GuardedAlloc;

fn models_dir() -> PathBuf {
    ferrolm::env::test_models_dir()
}

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens")
}

fn smollm2() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = models_dir().join(MODEL);
        assert!(path.exists(), "{} is missing: these tests need the SmolLM2 GGUF (set FERROLM_MODELS)", path.display());
        Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
    })
}

fn load_golden(name: &str) -> Value {
    let p = goldens().join(format!("tokenizer_{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn golden() -> &'static Value {
    static G: OnceLock<Value> = OnceLock::new();
    G.get_or_init(|| load_golden("smollm2"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn cases() -> &'static [Value] {
    golden()["encode"].as_array().unwrap()
}

fn cases_of(g: &Value) -> &[Value] {
    g["encode"].as_array().unwrap()
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

/// Every golden case encodes to transformers' ids, with and without special-token matching.
fn check_ids(tok: &Tokenizer) {
    assert!(cases().len() >= 20);
    check_ids_of(tok, golden());
}

fn check_ids_of(tok: &Tokenizer, g: &Value) {
    for c in cases_of(g) {
        let text = c["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), ids(&c["ids_special"]), "special: {text:?}");
        assert_eq!(tok.encode(text, false).unwrap(), ids(&c["ids_plain"]), "plain: {text:?}");
    }
}

fn check_chat(tok: &Tokenizer) {
    assert!(golden()["chat"].as_array().unwrap().len() >= 4);
    check_chat_of(tok, golden());
}

fn check_chat_of(tok: &Tokenizer, g: &Value) {
    for c in g["chat"].as_array().unwrap() {
        let gen = c["add_generation_prompt"].as_bool().unwrap();
        let got = tok.apply_chat_template(&messages(&c["messages"]), gen).unwrap();
        assert_eq!(got, c["text"].as_str().unwrap(), "messages {}", c["messages"]);
    }
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}

#[test]
fn smollm2_ids_match_transformers() {
    check_ids(smollm2());
}

#[test]
fn smollm2_special_text_is_plain_without_special() {
    let tok = smollm2();
    let t = "<|im_start|>user";
    let with = tok.encode(t, true).unwrap();
    let without = tok.encode(t, false).unwrap();
    assert_eq!(with[0], 1, "<|im_start|> is token 1");
    assert!(!without.contains(&1), "user text must not produce <|im_start|>: {without:?}");
    assert_eq!(tok.decode(&without).unwrap(), t);
}

#[test]
fn smollm2_metadata() {
    let tok = smollm2();
    let g = golden();
    assert_eq!(tok.vocab_size(), g["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!(tok.bos_id(), Some(g["bos_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.bos_token(), g["bos_token"].as_str());
    assert_eq!(tok.eos_token(), g["eos_token"].as_str());
    assert_eq!(tok.add_bos_default(), g["add_bos"].as_bool().unwrap());
    // <|im_end|> is both EOS and the template's end of turn: listed once.
    assert_eq!(tok.stop_ids(), &[2]);
    assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
}

#[test]
fn smollm2_decode_matches_transformers_and_round_trips() {
    let tok = smollm2();
    for c in cases() {
        let text = c["text"].as_str().unwrap();
        let sp = tok.decode(&ids(&c["ids_special"])).unwrap();
        assert_eq!(sp, c["decode_special"].as_str().unwrap(), "{text:?}");
        let plain = tok.decode(&ids(&c["ids_plain"])).unwrap();
        assert_eq!(plain, c["decode_plain"].as_str().unwrap(), "{text:?}");
        assert_eq!(plain, text, "plain encoding must round-trip");
    }
    let bad = tok.decode(&[5, 1_000_000]).unwrap_err().to_string();
    assert!(bad.contains("1000000"), "{bad}");
}

#[test]
fn smollm2_chat_template_matches_transformers() {
    assert!(ferrolm::alloc_guard::GuardedAlloc::installed());
    check_chat(smollm2());
}

/// The SentencePiece path (tokenizer.ggml.model = "llama"): a 400-piece SentencePiece BPE
/// vocabulary with byte fallback and a user-defined token, against transformers' tokenizer for
/// the same GGUF.
#[test]
fn sentencepiece_vocab_matches_transformers() {
    let g = load_golden("tiny_spm");
    let tok = Tokenizer::from_gguf(&GgufFile::open(goldens().join("tiny_spm.gguf")).unwrap()).unwrap();
    assert_eq!(tok.vocab_size(), 400);
    assert!(tok.add_bos_default());
    assert_eq!((tok.bos_token(), tok.eos_token()), (Some("<s>"), Some("</s>")));
    check_ids_of(&tok, &g);
    check_chat_of(&tok, &g);
    for c in cases_of(&g) {
        for (key, dec) in [("ids_special", "decode_special"), ("ids_plain", "decode_plain")] {
            let ids = ids(&c[key]);
            assert_eq!(tok.decode(&ids).unwrap(), c[dec].as_str().unwrap(), "{:?}", c["text"]);
            let mut d = StreamDecoder::new(&tok);
            let mut out = String::new();
            for &id in &ids {
                let piece = d.push(id).unwrap();
                assert!(!piece.contains('\u{FFFD}'), "partial char streamed in {:?}", c["text"]);
                out += &piece;
            }
            assert_eq!(out + &d.finish().unwrap(), c[dec].as_str().unwrap());
        }
    }
    // tokenizer.json written from it (as `ferrolm convert` does) carries BOS in its
    // post-processor, so a bare directory gets the same ids and BOS default back.
    let dir = tempfile::tempdir().unwrap();
    tok.hf().save(dir.path().join("tokenizer.json"), false).unwrap();
    let back = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(back.add_bos_default());
    assert_eq!((back.bos_id(), back.bos_token()), (Some(1), Some("<s>")));
    check_ids_of(&back, &g);

    // "<s>" typed by a user is text; the same text with special=true is the BOS token.
    let plain = tok.encode("<s>", false).unwrap();
    assert!(!plain.contains(&1) && plain.len() > 1, "{plain:?}");
}

#[test]
fn stream_decoder_never_splits_characters() {
    let tok = smollm2();
    let mut held_back = 0;
    for c in cases() {
        for key in ["ids_special", "ids_plain"] {
            let ids = ids(&c[key]);
            let mut d = StreamDecoder::new(tok);
            let mut out = String::new();
            for &id in &ids {
                let piece = d.push(id).unwrap();
                // The golden texts are valid UTF-8: a U+FFFD could only be a split character.
                assert!(!piece.contains('\u{FFFD}'), "partial char streamed in {:?}", c["text"]);
                let alone = tok.decode(&[id]).unwrap();
                if piece.is_empty() && alone.contains('\u{FFFD}') {
                    held_back += 1;
                }
                out += &piece;
            }
            out += &d.finish().unwrap();
            assert_eq!(out, tok.decode(&ids).unwrap(), "{:?}", c["text"]);
        }
    }
    // The emoji / CJK / Devanagari cases contain tokens that end mid-character.
    assert!(held_back > 5, "only {held_back} tokens were held back");
}

#[test]
fn stream_decoder_emoji_split_across_tokens() {
    let tok = smollm2();
    let text = "🦀 rust 🦀";
    let ids = tok.encode(text, false).unwrap();
    // The crab is not one token: its four bytes come in several pieces.
    let crab = ids.iter().take_while(|&&i| !tok.decode(&[i]).unwrap().contains("rust")).count();
    assert!(crab >= 2, "🦀 should span several tokens: {ids:?}");
    let mut d = StreamDecoder::new(tok);
    let pieces: Vec<String> = ids.iter().map(|&i| d.push(i).unwrap()).collect();
    assert!(pieces[..crab - 1].iter().all(|p| p.is_empty()), "{pieces:?}");
    assert!(pieces[crab - 1].starts_with('🦀'), "{pieces:?}");
    assert_eq!(pieces.concat() + &d.finish().unwrap(), text);

    // Stopping mid-character: finish() writes U+FFFD, exactly as decode() of the same ids.
    let mut d = StreamDecoder::new(tok);
    assert_eq!(d.push(ids[0]).unwrap(), "");
    let tail = d.finish().unwrap();
    assert_eq!(tail, "\u{FFFD}");
    assert_eq!(tail, tok.decode(&ids[..1]).unwrap());
}

/// A directory like transformers saves: its tokenizer_config.json and chat_template.jinja,
/// and tokenizer.json written from our GGUF-built tokenizer (the real one is 3.5 MB).
fn saved_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    smollm2().hf().save(dir.path().join("tokenizer.json"), false).unwrap();
    for f in ["tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(goldens().join("smollm2_tokenizer").join(f), dir.path().join(f)).unwrap();
    }
    dir
}

#[test]
fn from_dir_matches_gguf_and_transformers() {
    let dir = saved_dir();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    check_ids(&tok);
    check_chat(&tok);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert!(!tok.add_bos_default());
    assert_eq!(tok.stop_ids(), &[2]);
    assert_eq!(tok.vocab_size(), 49152);
}

#[test]
fn from_dir_config_fallbacks_and_template_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    smollm2().hf().save(p.join("tokenizer.json"), false).unwrap();
    // No tokenizer_config.json: ids come from config.json / generation_config.json, the
    // template from chat_template.json.
    std::fs::write(p.join("config.json"), r#"{"bos_token_id": 1, "eos_token_id": 2}"#).unwrap();
    std::fs::write(p.join("generation_config.json"), r#"{"eos_token_id": [2, 0]}"#).unwrap();
    let t = r#"{% if messages|length > 1 %}{{ raise_exception('only one message, please') }}{% endif %}{{ messages[0].content.strip() | tojson }} {{ strftime_now('%Y') | length }}"#;
    std::fs::write(p.join("chat_template.json"), serde_json::json!({ "chat_template": t }).to_string()).unwrap();
    let tok = Tokenizer::from_dir(p).unwrap();
    assert_eq!((tok.bos_id(), tok.bos_token()), (Some(1), Some("<|im_start|>")));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.stop_ids(), &[2, 0]);
    let one = [ChatMessage::new("user", "  «é» \"q\"\n")];
    assert_eq!(tok.apply_chat_template(&one, false).unwrap(), "\"«é» \\\"q\\\"\" 4");
    let two = [one[0].clone(), one[0].clone()];
    let e = tok.apply_chat_template(&two, false).unwrap_err().to_string();
    assert!(e.contains("only one message, please"), "{e}");
    assert!(e.contains("chat template"), "{e}");

    std::fs::write(p.join("chat_template.jinja"), "{% for m in messages %}").unwrap();
    let tok = Tokenizer::from_dir(p).unwrap();
    let e = tok.apply_chat_template(&one, false).unwrap_err().to_string();
    assert!(e.contains("chat template"), "{e}");
}

#[test]
fn from_dir_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");

    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3").unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json") && e.contains("not a valid"), "{e}");

    let dir = saved_dir();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{oops").unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json"), "{e}");
}

/// A minimal GGUF v3 file with the given string / string-array metadata and no tensors.
fn write_gguf(path: &Path, kv: &[(&str, Result<&str, &[&str]>)]) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    for (k, v) in kv {
        s(&mut b, k);
        match v {
            Ok(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
            Err(xs) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((xs.len() as u64).to_le_bytes());
                for x in xs.iter() {
                    s(&mut b, x);
                }
            }
        }
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn gguf_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notok.gguf");
    write_gguf(&p, &[("general.architecture", Ok("llama"))]);
    let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.tokens") && e.contains("notok.gguf"), "{e}");

    let vocab: &[&str] = &["a", "b", "ab"];
    let merges: &[&str] = &["a b"];
    let p = dir.path().join("pre.gguf");
    write_gguf(
        &p,
        &[
            ("tokenizer.ggml.model", Ok("gpt2")),
            ("tokenizer.ggml.pre", Ok("weird-pre")),
            ("tokenizer.ggml.tokens", Err(vocab)),
            ("tokenizer.ggml.merges", Err(merges)),
        ],
    );
    let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.pre") && e.contains("weird-pre"), "{e}");

    let p = dir.path().join("model.gguf");
    write_gguf(&p, &[("tokenizer.ggml.model", Ok("bert")), ("tokenizer.ggml.tokens", Err(vocab))]);
    let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("bert"), "{e}");

    let bad: &[&str] = &["ab"];
    let p = dir.path().join("badmerge.gguf");
    write_gguf(
        &p,
        &[
            ("tokenizer.ggml.model", Ok("gpt2")),
            ("tokenizer.ggml.pre", Ok("gpt-2")),
            ("tokenizer.ggml.tokens", Err(vocab)),
            ("tokenizer.ggml.merges", Err(bad)),
        ],
    );
    let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges[0]"), "{e}");

    // A gpt2 vocabulary without merges.
    let p = dir.path().join("nomerges.gguf");
    write_gguf(&p, &[("tokenizer.ggml.model", Ok("gpt2")), ("tokenizer.ggml.tokens", Err(vocab))]);
    let e = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");
}

/// Gemma 3 270M's SentencePiece vocabulary (262k pieces, byte fallback, whitespace runs and
/// HTML tags as user-defined tokens) against transformers' tokenizer for the same GGUF.
#[test]
fn gemma3_vocab_matches_transformers() {
    let path = models_dir().join("gemma-3-270m-q4_k_m.gguf");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let g = load_golden("gemma3");
    assert_eq!(tok.vocab_size(), 262_144);
    assert!(tok.add_bos_default());
    assert_eq!((tok.bos_id(), tok.bos_token()), (Some(2), Some("<bos>")));
    assert_eq!(tok.eos_token(), Some("<eos>"));
    // No chat template in this file: every end-of-turn marker the vocabulary has stops.
    let eot = tok.token_to_id("<end_of_turn>").unwrap();
    assert_eq!(tok.stop_ids(), &[1, eot]);
    check_ids_of(&tok, &g);
    for c in cases_of(&g) {
        for (key, dec) in [("ids_special", "decode_special"), ("ids_plain", "decode_plain")] {
            let ids = ids(&c[key]);
            let want = c[dec].as_str().unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), want, "{:?}", c["text"]);
            let mut d = StreamDecoder::new(&tok);
            let mut out = String::new();
            for &id in &ids {
                let piece = d.push(id).unwrap();
                assert!(!piece.contains('\u{FFFD}'), "partial char streamed in {:?}", c["text"]);
                out += &piece;
            }
            assert_eq!(out + &d.finish().unwrap(), want);
        }
    }
}
