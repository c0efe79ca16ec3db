//! The server on the real SmolLM2-135M-Instruct file on the CPU, and a small HTTP/1.1
//! client over TcpStream (requests, chunked bodies, server-sent events).

#![allow(dead_code)] // each test binary uses a part of this

use ferrolm::backend::cpu::Cpu;
use ferrolm::model::Decoder;
use ferrolm::serving::{Engine, EngineConfig};
use ferrolm::tokenizer::{ChatMessage, Tokenizer};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

/// Chat templates render under a memory bound only with this allocator (as in the binary).
#[global_allocator]
static ALLOC: ferrolm::alloc_guard::GuardedAlloc = ferrolm::alloc_guard::GuardedAlloc;

pub fn model_path() -> PathBuf {
    let p = ferrolm::env::test_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run scripts/fetch-test-models.sh", p.display());
    p
}

pub fn tokenizer() -> Tokenizer {
    ferrolm::formats::load_with_tokenizer(&model_path(), false).expect("load SmolLM2").1
}

/// A server on 127.0.0.1 (port 0), its runtime and its shutdown handle.
pub struct TestServer {
    pub addr: SocketAddr,
    pub rt: tokio::runtime::Runtime,
    pub server: Option<ferrolm_server::Server>,
    pub stop: ferrolm_server::Shutdown,
}

pub const API_KEY: &str = "sk-test-key";

pub fn start(engine: EngineConfig, api_key: Option<&str>) -> TestServer {
    start_with(engine, api_key, Duration::from_secs(30))
}

pub fn start_with(engine: EngineConfig, api_key: Option<&str>, grace: Duration) -> TestServer {
    let (src, tok) = ferrolm::formats::load_with_tokenizer(&model_path(), false).expect("load SmolLM2");
    let engine = Engine::start(
        move || {
            let mut src = src;
            Decoder::load(Cpu, &mut src)
        },
        engine,
    )
    .expect("start the engine");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let cfg = ferrolm_server::Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        model_name: "smollm2-test".into(),
        api_key: api_key.map(String::from),
        shutdown_grace: grace,
        ..Default::default()
    };
    let server = rt.block_on(ferrolm_server::start(engine, tok, cfg)).expect("bind");
    TestServer { addr: server.local_addr(), stop: server.shutdown_handle(), server: Some(server), rt }
}

impl TestServer {
    /// Shut down and wait until it has stopped.
    pub fn shutdown(&mut self) {
        self.stop.trigger();
        if let Some(s) = self.server.take() {
            self.rt.block_on(s.wait());
        }
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The events of a server-sent event stream, which must end with `data: [DONE]`.
    pub fn events(&self) -> Vec<Value> {
        let text = self.text();
        let mut blocks: Vec<&str> = text.split("\n\n").filter(|b| !b.is_empty()).collect();
        assert_eq!(blocks.pop(), Some("data: [DONE]"), "the stream must end with [DONE]: {text}");
        blocks
            .iter()
            .map(|b| {
                let data = b.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data line: {b:?}"));
                serde_json::from_str(data).unwrap_or_else(|e| panic!("bad chunk {data:?}: {e}"))
            })
            .collect()
    }
}

/// The raw request's bytes: headers for `body`, with `Connection: close`.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (k, v) in headers {
        r += &format!("{k}: {v}\r\n");
    }
    r += &format!("Content-Length: {}\r\n\r\n", body.len());
    let mut bytes = r.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s
}

/// Send raw bytes, read the whole response.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Resp {
    parse(&exchange(addr, bytes, false))
}

/// Send `bytes` (from a thread of its own, so that an answer the server gives before it has
/// read everything, e.g. a 413, is heard) and read until the server closes. `close_write`:
/// end the sending side after the bytes (a request cut short).
pub fn exchange(addr: SocketAddr, bytes: &[u8], close_write: bool) -> Vec<u8> {
    let mut s = connect(addr);
    let mut w = s.try_clone().unwrap();
    let bytes = bytes.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&bytes);
        if close_write {
            let _ = w.shutdown(std::net::Shutdown::Write);
        }
    });
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            // A server that closes with our bytes unread resets the connection after its answer.
            Err(_) if !out.is_empty() => break,
            Err(e) => panic!("reading the response: {e}"),
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    out
}

pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    raw(addr, &request_bytes(method, path, headers, body))
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
}

pub fn post_auth(addr: SocketAddr, path: &str, key: &str, body: &Value) -> Resp {
    let auth = format!("Bearer {key}");
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json"), ("Authorization", &auth)],
        body.to_string().as_bytes(),
    )
}

pub fn parse(raw: &[u8]) -> Resp {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect();
    let rest = &raw[split + 4..];
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_vec() };
    Resp { status, headers, body }
}

/// A chunked body's data (the whole body has been read).
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").expect("chunk size line");
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

/// The chat prompt's token count as the server should build it.
pub fn chat_prompt_tokens(tok: &Tokenizer, msgs: &[ChatMessage]) -> usize {
    tok.encode_chat(&tok.apply_chat_template(msgs, true).unwrap()).unwrap().len()
}

/// A raw prompt's token count as the server should build it (BOS as the model adds it).
pub fn text_prompt_tokens(tok: &Tokenizer, text: &str) -> usize {
    usize::from(tok.add_bos_default()) + tok.encode(text, false).unwrap().len()
}

/// A number from /metrics: the line `name value` (name with its labels).
pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let m = get(addr, "/metrics");
    assert_eq!(m.status, 200);
    m.text()
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Poll until `f` holds, for at most `secs`; whether it did.
pub fn eventually(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// The content of a chat stream's chunks, joined, and its finish reason.
pub fn chat_stream_text(events: &[Value]) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for e in events {
        for c in e["choices"].as_array().unwrap() {
            text += c["delta"]["content"].as_str().unwrap_or("");
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}

/// The text of a completions stream's chunks, joined, and its finish reason.
pub fn completion_stream_text(events: &[Value]) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for e in events {
        for c in e["choices"].as_array().unwrap() {
            text += c["text"].as_str().unwrap();
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}
