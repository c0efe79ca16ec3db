//! Saving a session's cache to a KV file and continuing from it (kv::persist): exactly the
//! tokens uninterrupted generation gives, for every scheme, and for Gemma 3's sliding
//! layers past their window; files of another scheme, model or context are refused.

use ferrolm::backend::cpu::Cpu;
use ferrolm::generate::Session;
use ferrolm::kv::scheme::KvScheme;
use ferrolm::model::Decoder;
use ferrolm::sample::{Sampler, SamplerConfig};
use ferrolm::tokenizer::Tokenizer;
use std::path::Path;

/// The model, its tokenizer and its fingerprint.
fn load(path: &Path) -> (Decoder<Cpu>, Tokenizer, String) {
    let (mut src, tok) = ferrolm::formats::load_with_tokenizer(path, false).unwrap();
    let fp = ferrolm::kv::file::model_fingerprint(&src, &tok);
    (Decoder::load(Cpu, &mut src).unwrap(), tok, fp)
}

fn smollm2() -> std::path::PathBuf {
    ferrolm::env::test_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Greedy tokens after `prompt` from session `s`.
fn greedy(s: &mut Session<'_, Cpu>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = vec![];
    s.generate(prompt, n, &mut Sampler::new(SamplerConfig::default()), &[], |t| {
        out.push(t);
        Ok(true)
    })
    .unwrap();
    out
}

/// Generate `first` tokens, save, restore into a new session, generate the rest: the same
/// tokens as one uninterrupted generation, and only the prompt's last token computed again.
fn save_restore_continue(model: &Decoder<Cpu>, fp: &str, prompt: &[u32], ctx: usize, first: usize, n: usize) {
    let file = tempfile::tempdir().unwrap();
    let path = file.path().join("c.kv");
    let whole = greedy(&mut Session::new(model, ctx).unwrap(), prompt, n);
    let mut s = Session::new(model, ctx).unwrap();
    let head = greedy(&mut s, prompt, first);
    s.save_cache(&path, fp).unwrap();
    let held = s.tokens.len();
    drop(s);
    let mut s = Session::new(model, ctx).unwrap();
    assert_eq!(s.restore_cache(&path, fp).unwrap(), Some(held));
    let mut more = prompt.to_vec();
    more.extend(&head);
    let mut tail = vec![];
    let st = s
        .generate(&more, n - first, &mut Sampler::new(SamplerConfig::default()), &[], |t| {
            tail.push(t);
            Ok(true)
        })
        .unwrap();
    assert_eq!(st.prefilled, 1, "{}: the restored cache held all but the last token", model.kv_scheme());
    assert_eq!([head, tail].concat(), whole, "{}", model.kv_scheme());
}

#[test]
fn a_saved_cache_continues_as_uninterrupted_generation_in_every_scheme() {
    let (mut model, tok, fp) = load(&smollm2());
    let prompt = tok.encode("The history of the Roman Empire begins with", true).unwrap();
    for scheme in ["bf16", "affine:8", "affine:4", "turbo", "turbo:k4v2", "turbo:k5v5", "turbo:k2v8"] {
        model.set_kv_scheme(KvScheme::parse(scheme).unwrap()).unwrap();
        save_restore_continue(&model, &fp, &prompt, 256, 12, 40);
    }
    // Per-layer bits (`--kv affine:FILE`): 8 and 4 bits alternating over the layers.
    let bits = (0..model.cfg.n_layers).map(|l| if l % 2 == 0 { 8 } else { 4 }).collect();
    model.set_kv_scheme(KvScheme::Affine(bits)).unwrap();
    save_restore_continue(&model, &fp, &prompt, 256, 12, 40);
}

/// Gemma 3 270M: 600 positions, past the sliding layers' window of 512, in a session that
/// keeps only the window: the file holds the window's blocks and the restored session
/// continues as the uninterrupted one.
#[test]
fn a_saved_cache_past_the_sliding_window_continues() {
    let path = ferrolm::env::test_models_dir().join("gemma-3-270m-q4_k_m.gguf");
    let (model, tok, fp) = load(&path);
    let text = include_str!("../../../tools/corpus/kjv-genesis-1-24.txt");
    let prompt: Vec<u32> = tok.encode(text, true).unwrap()[..590].to_vec();
    save_restore_continue(&model, &fp, &prompt, 2048, 6, 16);
}

#[test]
fn foreign_files_are_refused_and_a_missing_one_is_none() {
    let (mut model, tok, fp) = load(&smollm2());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kv");
    let prompt = tok.encode("Once upon a time", true).unwrap();
    let mut s = Session::new(&model, 64).unwrap();
    assert_eq!(s.restore_cache(&path, &fp).unwrap(), None, "a missing file");
    greedy(&mut s, &prompt, 8);
    s.save_cache(&path, &fp).unwrap();
    let err = |s: &mut Session<'_, Cpu>, fp: &str| s.restore_cache(&path, fp).unwrap_err().to_string();
    assert!(err(&mut s, "0123456789abcdef").contains("another model"));
    // A context too small for its tokens.
    assert!(err(&mut Session::new(&model, 8).unwrap(), &fp).contains("more than the context"));
    // The session is empty after a refusal and generates as a new one.
    assert!(s.tokens.is_empty());
    drop(s);
    model.set_kv_scheme(KvScheme::parse("turbo").unwrap()).unwrap();
    let e = Session::new(&model, 64).unwrap().restore_cache(&path, &fp).unwrap_err().to_string();
    assert!(e.contains("bf16") && e.contains("turbo:k8v3"), "{e}");
    // A damaged payload byte.
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    model.set_kv_scheme(KvScheme::Bf16).unwrap();
    let e = Session::new(&model, 64).unwrap().restore_cache(&path, &fp).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
}

/// `--kv-start`: a cache whose first 32 positions are bf16 beside quantized ones saves,
/// restores and continues exactly (the file past the boundary), and a file saved with
/// another `--kv-start` is refused by name.
#[test]
fn a_saved_cache_with_leading_bf16_positions_continues() {
    let (mut model, tok, fp) = load(&smollm2());
    let prompt = tok.encode("The history of the Roman Empire begins with", true).unwrap();
    for scheme in ["turbo", "affine:4"] {
        model.set_kv_scheme(KvScheme::parse(scheme).unwrap()).unwrap();
        model.set_kv_start(20).unwrap();
        assert_eq!(model.kv_start(), 32, "whole blocks");
        save_restore_continue(&model, &fp, &prompt, 256, 30, 50);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kv");
    let mut s = Session::new(&model, 128).unwrap();
    greedy(&mut s, &prompt, 30);
    s.save_cache(&path, &fp).unwrap();
    drop(s);
    assert_eq!(ferrolm::kv::file::read_header(&path).unwrap().kv_start, 32);
    model.set_kv_start(0).unwrap();
    let e = Session::new(&model, 128).unwrap().restore_cache(&path, &fp).unwrap_err().to_string();
    assert!(e.contains("first 32 positions in bf16"), "{e}");
}
