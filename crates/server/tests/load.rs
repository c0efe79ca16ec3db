//! Many clients at once: concurrent greedy requests give the texts each gives alone, a
//! client that leaves mid-stream frees its place while others go on, a full queue answers
//! 429 with Retry-After, and a shutdown lets requests in flight finish (or fail after the
//! grace period) before the server stops.

mod common;

use common::*;
use ferrolm::serving::EngineConfig;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const COUNTING: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,";

fn completion(addr: SocketAddr, prompt: &str, max_tokens: usize) -> Resp {
    post(addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
}

fn text_of(r: &Resp) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn concurrent_greedy_requests_match_alone() {
    let s = start(EngineConfig::default(), None);
    let prompts: Vec<String> = (0..16).map(|i| format!("Fact number {i} about the ocean:")).collect();
    let alone: Vec<String> = prompts.iter().map(|p| text_of(&completion(s.addr, p, 10))).collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = prompts.iter().map(|p| sc.spawn(move || text_of(&completion(s.addr, p, 10)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    // Not all the same text: the requests really differ.
    assert!(alone.iter().any(|t| t != &alone[0]));
}

/// Read a streamed response until `n` data events have come; the stream stays open.
fn open_stream(addr: SocketAddr, body: &Value, n: usize) -> std::net::TcpStream {
    let mut s = connect(addr);
    s.write_all(&request_bytes("POST", "/v1/completions", &[], body.to_string().as_bytes())).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < n {
        let k = s.read(&mut buf).expect("stream bytes");
        assert!(k > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..k]);
    }
    assert!(seen.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&seen));
    s
}

#[test]
fn a_client_leaving_is_cancelled() {
    let s = start(EngineConfig::default(), None);
    // Counting goes on and on (greedy): 8,000 tokens take a minute or more here, so only
    // the cancel can end it within the 20 s waited below.
    let long = json!({"prompt": COUNTING, "max_tokens": 8000, "temperature": 0, "stream": true});
    let stream = open_stream(s.addr, &long, 3);
    let other = std::thread::spawn(move || completion(s.addr, "The capital of Italy is", 12));
    std::thread::sleep(Duration::from_millis(200));
    drop(stream);
    let r = other.join().unwrap();
    assert_eq!(r.json()["usage"]["completion_tokens"], 12, "{}", r.text());
    // The engine drops the leaver long before its 8,000 tokens.
    let gone = eventually(20, || {
        metric(s.addr, "ferrolm_requests_running") == 0.0
            && metric(s.addr, "ferrolm_requests_total{outcome=\"cancelled\"}") == 1.0
    });
    assert!(gone, "{}", get(s.addr, "/metrics").text());
    // A client that leaves while waiting for a whole (not streamed) answer is dropped too.
    let mut c = connect(s.addr);
    let whole = json!({"prompt": COUNTING, "max_tokens": 8000, "temperature": 0});
    c.write_all(&request_bytes("POST", "/v1/completions", &[], whole.to_string().as_bytes())).unwrap();
    assert!(eventually(20, || metric(s.addr, "ferrolm_requests_running") == 1.0));
    std::thread::sleep(Duration::from_millis(300));
    drop(c);
    let gone = eventually(20, || {
        metric(s.addr, "ferrolm_requests_running") == 0.0
            && metric(s.addr, "ferrolm_requests_total{outcome=\"cancelled\"}") == 2.0
    });
    assert!(gone, "{}", get(s.addr, "/metrics").text());
    assert_eq!(metric(s.addr, "ferrolm_kv_cache_bytes_used"), 0.0);
    assert_eq!(metric(s.addr, "ferrolm_kv_blocks_used"), 0.0);
    // And it still serves.
    assert!(!text_of(&completion(s.addr, "Hello", 3)).is_empty());
}

#[test]
fn a_full_queue_answers_429() {
    let s = start(EngineConfig { max_batch: 1, max_queue: 1, ..Default::default() }, None);
    let responses: Vec<Resp> = std::thread::scope(|sc| {
        let handles: Vec<_> =
            (0..5).map(|i| sc.spawn(move || completion(s.addr, &format!("{COUNTING} {i}"), 64))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let busy: Vec<&Resp> = responses.iter().filter(|r| r.status == 429).collect();
    let done = responses.iter().filter(|r| r.status == 200).count();
    assert!(!busy.is_empty() && done >= 1, "{:?}", responses.iter().map(|r| r.status).collect::<Vec<_>>());
    assert_eq!(busy.len() + done, 5);
    for r in busy {
        let secs: u64 = r.header("retry-after").expect("Retry-After").parse().unwrap();
        assert!(secs >= 1);
        let e = r.json()["error"].clone();
        assert_eq!((e["type"].as_str(), e["code"].as_str()), (Some("rate_limit_error"), Some("rate_limit_exceeded")));
    }
    assert_eq!(metric(s.addr, "ferrolm_requests_total{outcome=\"busy\"}"), (5 - done) as f64);
}

#[test]
fn shutdown_lets_requests_in_flight_finish() {
    let mut s = start(EngineConfig::default(), None);
    let addr = s.addr;
    let inflight = std::thread::spawn(move || completion(addr, COUNTING, 96));
    let stream = std::thread::spawn(move || {
        let body = json!({"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 80, "temperature": 0, "stream": true, "ignore_eos": true});
        post(addr, "/v1/chat/completions", &body)
    });
    assert!(eventually(30, || metric(addr, "ferrolm_requests_running") == 2.0), "both requests should be running");
    s.shutdown();
    let r = inflight.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 96);
    let events = stream.join().unwrap().events();
    assert_eq!(chat_stream_text(&events).1.as_deref(), Some("length"));
    // Stopped: nothing listens any more.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

#[test]
fn shutdown_fails_what_outlives_the_grace_period() {
    let mut s = start_with(EngineConfig::default(), None, Duration::from_secs(1));
    let addr = s.addr;
    let long = std::thread::spawn(move || completion(addr, COUNTING, 4000));
    assert!(eventually(30, || metric(addr, "ferrolm_requests_running") == 1.0));
    let t = Instant::now();
    s.shutdown();
    assert!(t.elapsed() < Duration::from_secs(10), "shutdown took {:?}", t.elapsed());
    let r = long.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("shut down"));
}

/// The resident memory of this process (the server runs in it), bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// 64 streaming clients at once, twice, against 16 places and a queue of 24: every request
/// either streams all its tokens to `[DONE]` or gets a clean 429 with Retry-After; the
/// server's counts add up to what the clients saw (nothing lost); afterwards nothing runs
/// or waits, every KV block is back, and the second wave leaves the process no larger than
/// the first did (no leak per request).
#[test]
fn sixty_four_streaming_clients_complete_or_get_429() {
    let s = start(EngineConfig { max_batch: 16, max_queue: 24, ..Default::default() }, None);
    let wave = |w: usize| -> (usize, usize) {
        let responses: Vec<Resp> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..64)
                .map(|i| {
                    let body = json!({"prompt": format!("Item {w}-{i} of the list:"), "max_tokens": 8,
                        "temperature": 0, "ignore_eos": true, "stream": true,
                        "stream_options": {"include_usage": true}});
                    sc.spawn(move || post(s.addr, "/v1/completions", &body))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (mut done, mut busy) = (0, 0);
        for r in &responses {
            match r.status {
                200 => {
                    let events = r.events();
                    assert_eq!(completion_stream_text(&events).1.as_deref(), Some("length"), "{}", r.text());
                    let usage = events.iter().rev().find(|e| e["usage"].is_object()).expect("a usage chunk");
                    assert_eq!(usage["usage"]["completion_tokens"], 8, "{}", r.text());
                    assert!(r.text().trim_end().ends_with("data: [DONE]"), "{}", r.text());
                    done += 1;
                }
                429 => {
                    assert!(r.header("retry-after").is_some(), "429 without Retry-After");
                    busy += 1;
                }
                other => panic!("status {other}: {}", r.text()),
            }
        }
        (done, busy)
    };
    let started = Instant::now();
    let (done1, busy1) = wave(0);
    let after_first = rss();
    let (done2, busy2) = wave(1);
    assert!(started.elapsed() < Duration::from_secs(300), "two waves took {:?}", started.elapsed());
    eprintln!("waves: {done1} + {done2} streamed, {busy1} + {busy2} answered 429");
    assert_eq!((done1 + busy1, done2 + busy2), (64, 64));
    assert!(done1 >= 16 && done2 >= 16, "completed {done1} and {done2} of 64");
    let finished = metric(s.addr, "ferrolm_requests_total{outcome=\"length\"}");
    let rejected = metric(s.addr, "ferrolm_requests_total{outcome=\"busy\"}");
    assert_eq!((finished, rejected), ((done1 + done2) as f64, (busy1 + busy2) as f64));
    assert!(eventually(10, || metric(s.addr, "ferrolm_requests_running") == 0.0
        && metric(s.addr, "ferrolm_requests_waiting") == 0.0));
    assert_eq!(metric(s.addr, "ferrolm_kv_blocks_used"), 0.0);
    let grown = rss().saturating_sub(after_first);
    assert!(grown < 64 << 20, "the second wave grew the process by {} MiB", grown >> 20);
}
