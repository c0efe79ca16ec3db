//! The API against the real SmolLM2-135M-Instruct on the CPU: whole and streamed answers
//! agree (greedy), usage counts the tokens, stop strings cut the text (one spanning two
//! tokens), log-probabilities come in OpenAI's shapes, and /v1/models, /health and
//! /metrics answer.

mod common;

use common::*;
use ferrolm::serving::EngineConfig;
use ferrolm::tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::OnceLock;

/// The test server's KV budget, which /metrics reports.
const KV_BUDGET: usize = 3 << 30;

/// One server for this file's tests (they run in parallel against it).
fn addr() -> SocketAddr {
    static S: OnceLock<TestServer> = OnceLock::new();
    S.get_or_init(|| start(EngineConfig { kv_memory: Some(KV_BUDGET), ..Default::default() }, None)).addr
}

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(tokenizer)
}

const QUESTION: &str = "What is the capital of France? Answer in one sentence.";

fn chat_body(extra: Value) -> Value {
    let mut b = json!({
        "model": "smollm2-test",
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": QUESTION}],
        "temperature": 0, "max_tokens": 24,
    });
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

fn completion_body(extra: Value) -> Value {
    let mut b =
        json!({"model": "smollm2-test", "prompt": "The three primary colors are", "temperature": 0, "max_tokens": 32});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

fn ok(r: Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn chat_whole_and_streamed_agree() {
    let whole = ok(post(addr(), "/v1/chat/completions", &chat_body(json!({}))));
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(whole["model"], "smollm2-test");
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["logprobs"], Value::Null);
    let text = choice["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text}");
    let msgs = [ChatMessage::new("system", "You are a helpful assistant."), ChatMessage::new("user", QUESTION)];
    let usage = &whole["usage"];
    assert_eq!(usage["prompt_tokens"], chat_prompt_tokens(tok(), &msgs));
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    match choice["finish_reason"].as_str().unwrap() {
        "length" => assert_eq!(usage["completion_tokens"], 24),
        "stop" => assert!(usage["completion_tokens"].as_u64().unwrap() <= 24),
        other => panic!("finish_reason {other}"),
    }

    let r = post(
        addr(),
        "/v1/chat/completions",
        &chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let id = events[0]["id"].as_str().unwrap();
    for e in &events {
        assert_eq!((e["id"].as_str(), e["object"].as_str()), (Some(id), Some("chat.completion.chunk")));
    }
    let (streamed, finish) = chat_stream_text(&events);
    assert_eq!(streamed, text);
    assert_eq!(finish.as_deref(), choice["finish_reason"].as_str());
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(&last["usage"], usage);
    assert!(events[..events.len() - 1].iter().all(|e| e["usage"].is_null()));
}

#[test]
fn completions_whole_and_streamed_agree() {
    let whole = ok(post(addr(), "/v1/completions", &completion_body(json!({}))));
    assert_eq!(whole["object"], "text_completion");
    assert!(whole["id"].as_str().unwrap().starts_with("cmpl-"));
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert_eq!(whole["usage"]["prompt_tokens"], text_prompt_tokens(tok(), "The three primary colors are"));
    if whole["choices"][0]["finish_reason"] == "length" {
        assert_eq!(whole["usage"]["completion_tokens"], 32);
    }

    let r = post(addr(), "/v1/completions", &completion_body(json!({"stream": true})));
    let events = r.events();
    assert!(events.iter().all(|e| e["object"] == "text_completion" && e.get("usage").is_none()));
    let (streamed, finish) = completion_stream_text(&events);
    assert_eq!(streamed, text);
    assert_eq!(finish.as_deref(), whole["choices"][0]["finish_reason"].as_str());

    // The same prompt as token ids gives the same text; no max_tokens means 16.
    let mut ids = Vec::new();
    if tok().add_bos_default() {
        ids.extend(tok().bos_id());
    }
    ids.extend(tok().encode("The three primary colors are", false).unwrap());
    let by_ids = ok(post(addr(), "/v1/completions", &json!({"prompt": ids, "temperature": 0})));
    assert_eq!(by_ids["usage"]["completion_tokens"], 16);
    let first16 = by_ids["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with(first16), "{first16:?} vs {text:?}");
}

/// Multi-turn conversations, content given as text parts, and a seeded sampler that
/// reproduces its text.
#[test]
fn conversations_parts_and_seeds() {
    let turns = json!([
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": [{"type": "text", "text": "Name another"}, {"type": "text", "text": "one."}]},
    ]);
    let r = ok(post(addr(), "/v1/chat/completions", &json!({"messages": turns, "temperature": 0, "max_tokens": 8})));
    let msgs = [
        ChatMessage::new("user", "Name a fruit."),
        ChatMessage::new("assistant", "Apple."),
        ChatMessage::new("user", "Name another\none."),
    ];
    assert_eq!(r["usage"]["prompt_tokens"], chat_prompt_tokens(tok(), &msgs));
    let as_string = json!([msgs[0], msgs[1], {"role": "user", "content": "Name another\none."}]);
    let same =
        ok(post(addr(), "/v1/chat/completions", &json!({"messages": as_string, "temperature": 0, "max_tokens": 8})));
    assert_eq!(same["choices"][0]["message"], r["choices"][0]["message"]);

    let sampled = |seed: u64| {
        let b =
            json!({"prompt": "Once upon a time", "temperature": 1.0, "top_p": 0.95, "seed": seed, "max_tokens": 12});
        ok(post(addr(), "/v1/completions", &b))["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert_eq!(sampled(7), sampled(7));

    // ignore_eos: the answer that ended at its end-of-turn token goes on to max_tokens.
    let short = ok(post(addr(), "/v1/chat/completions", &chat_body(json!({}))));
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "the greedy answer should end by itself");
    let long = ok(post(addr(), "/v1/chat/completions", &chat_body(json!({"ignore_eos": true}))));
    assert_eq!(
        (long["choices"][0]["finish_reason"].as_str(), long["usage"]["completion_tokens"].as_u64()),
        (Some("length"), Some(24))
    );
    let start = short["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(long["choices"][0]["message"]["content"].as_str().unwrap().starts_with(start));
}

/// A stop string that spans two tokens of the output: the last two characters of one and
/// the first two of the next, at a boundary where it first occurs.
fn spanning_stop(tokens: &[Value], text: &str) -> Option<String> {
    let mut at = 0;
    for w in tokens.windows(2) {
        let (a, b) = (w[0].as_str().unwrap(), w[1].as_str().unwrap());
        at += a.len();
        if at > 8 && a.len() >= 2 && b.len() >= 2 && a.is_ascii() && b.is_ascii() {
            let stop = format!("{}{}", &a[a.len() - 2..], &b[..2]);
            if text.find(&stop) == Some(at - 2) {
                return Some(stop);
            }
        }
    }
    None
}

#[test]
fn stop_strings_cut_the_text() {
    let full = ok(post(addr(), "/v1/completions", &completion_body(json!({"logprobs": 0}))));
    let text = full["choices"][0]["text"].as_str().unwrap();
    let tokens = full["choices"][0]["logprobs"]["tokens"].as_array().unwrap().clone();
    let spanning = spanning_stop(&tokens, text).expect("two neighbouring ASCII tokens in the output");
    // A word inside one token, the spanning string, and a list with one that never occurs.
    let word = text.split_whitespace().nth(2).unwrap().to_string();
    let full_tokens = full["usage"]["completion_tokens"].as_u64().unwrap();
    for stop in [json!(word), json!(spanning), json!(["never-occurs-🙂", spanning])] {
        let first = stop.as_array().map_or_else(|| stop.as_str().unwrap(), |a| a[1].as_str().unwrap());
        let want = &text[..text.find(first).unwrap()];
        let whole = ok(post(addr(), "/v1/completions", &completion_body(json!({"stop": stop}))));
        assert_eq!(whole["choices"][0]["text"], want, "stop {stop}");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop");
        assert!(whole["usage"]["completion_tokens"].as_u64().unwrap() < full_tokens);
        let r = post(addr(), "/v1/completions", &completion_body(json!({"stop": stop, "stream": true})));
        let (streamed, finish) = completion_stream_text(&r.events());
        assert_eq!((streamed.as_str(), finish.as_deref()), (want, Some("stop")), "stop {stop}");
    }
    // Chat streams too: a stop string taken from the greedy answer.
    let answer = ok(post(addr(), "/v1/chat/completions", &chat_body(json!({}))));
    let answer = answer["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let stop = "Paris";
    let r = post(addr(), "/v1/chat/completions", &chat_body(json!({"stop": [stop], "stream": true})));
    let (streamed, finish) = chat_stream_text(&r.events());
    assert_eq!((streamed.as_str(), finish.as_deref()), (&answer[..answer.find(stop).unwrap()], Some("stop")));
    // A stop string that does not occur changes nothing.
    let same = ok(post(addr(), "/v1/completions", &completion_body(json!({"stop": "zzzq"}))));
    assert_eq!(same["choices"][0]["text"], text);
    assert_eq!(same["choices"][0]["finish_reason"], full["choices"][0]["finish_reason"]);
}

fn check_entry(e: &Value) -> (&str, f64) {
    let token = e["token"].as_str().unwrap();
    let lp = e["logprob"].as_f64().unwrap();
    assert!(lp <= 0.0, "{e}");
    let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
    assert_eq!(bytes, token.as_bytes());
    (token, lp)
}

#[test]
fn chat_logprobs_shapes() {
    let r = ok(post(addr(), "/v1/chat/completions", &chat_body(json!({"logprobs": true, "top_logprobs": 3}))));
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    if r["choices"][0]["finish_reason"] == "length" {
        assert_eq!(content.len() as u64, r["usage"]["completion_tokens"].as_u64().unwrap());
    }
    let mut joined = String::new();
    for e in content {
        let (token, lp) = check_entry(e);
        joined += token;
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let tops: Vec<(&str, f64)> = top.iter().map(check_entry).collect();
        assert!(tops.windows(2).all(|w| w[0].1 >= w[1].1), "{top:?}");
        // Greedy: the chosen token is the most probable one.
        assert_eq!((tops[0].0, tops[0].1), (token, lp));
    }
    assert_eq!(joined, text);

    let s =
        post(addr(), "/v1/chat/completions", &chat_body(json!({"logprobs": true, "top_logprobs": 3, "stream": true})));
    let streamed: Vec<Value> = s
        .events()
        .iter()
        .flat_map(|e| e["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(&streamed, content);
}

#[test]
fn completion_logprobs_shapes() {
    let r = ok(post(addr(), "/v1/completions", &completion_body(json!({"logprobs": 2, "max_tokens": 12}))));
    let lp = &r["choices"][0]["logprobs"];
    let text = r["choices"][0]["text"].as_str().unwrap();
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), text);
    let n = tokens.len();
    assert_eq!((lp["token_logprobs"].as_array().unwrap().len(), lp["top_logprobs"].as_array().unwrap().len()), (n, n));
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset);
        offset += t.chars().count();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((1..=2).contains(&top.len()));
        let best = top.values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert_eq!(lp["token_logprobs"][i].as_f64().unwrap(), best);
        assert_eq!(top[*t].as_f64(), Some(best));
    }
}

#[test]
fn models_health_and_metrics() {
    let m = get(addr(), "/v1/models");
    assert_eq!(m.status, 200);
    let m = m.json();
    assert_eq!((m["object"].as_str(), m["data"][0]["id"].as_str()), (Some("list"), Some("smollm2-test")));
    assert_eq!(m["data"][0]["object"], "model");
    assert_eq!(get(addr(), "/v1/models/smollm2-test").json()["id"], "smollm2-test");
    assert_eq!(get(addr(), "/v1/models/other").status, 404);
    let h = get(addr(), "/health");
    assert_eq!((h.status, h.json()["status"].as_str()), (200, Some("ok")));

    let before = metric(addr(), "ferrolm_requests_total{outcome=\"length\"}");
    let tokens_before = metric(addr(), "ferrolm_generation_tokens_total");
    ok(post(
        addr(),
        "/v1/completions",
        &json!({"prompt": "One, two, three, four,", "max_tokens": 5, "temperature": 0}),
    ));
    assert!(metric(addr(), "ferrolm_requests_total{outcome=\"length\"}") > before);
    assert!(metric(addr(), "ferrolm_generation_tokens_total") >= tokens_before + 5.0);
    assert!(metric(addr(), "ferrolm_time_to_first_token_seconds_count") >= 1.0);
    assert!(metric(addr(), "ferrolm_inter_token_latency_seconds_count") >= 4.0);
    assert!(metric(addr(), "ferrolm_http_responses_total{code=\"200\"}") >= 1.0);
    assert_eq!(metric(addr(), "ferrolm_kv_cache_bytes_budget"), KV_BUDGET as f64);
    // The budget in 32-position blocks: SmolLM2's 30 layers × 3 kv heads × 64 × K and V, bf16.
    assert_eq!(metric(addr(), "ferrolm_kv_blocks_total"), (KV_BUDGET / (30 * 3 * 64 * 2 * 2 * 32)) as f64);
    let text = get(addr(), "/metrics").text();
    for name in [
        "ferrolm_requests_waiting ",
        "ferrolm_requests_running ",
        "ferrolm_kv_cache_bytes_used ",
        "ferrolm_prompt_cached_tokens_total ",
    ] {
        assert!(text.contains(name), "{name} missing");
    }
}
