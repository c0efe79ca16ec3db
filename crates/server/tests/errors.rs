//! Every class of bad request gets its 4xx and an OpenAI error body naming the field, and
//! the server goes on serving everyone else; bearer-token auth on /v1.

mod common;

use common::*;
use ferrolm::serving::EngineConfig;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::OnceLock;

const CONTEXT: usize = 256;

fn addr() -> SocketAddr {
    static S: OnceLock<TestServer> = OnceLock::new();
    S.get_or_init(|| start(EngineConfig { max_context: CONTEXT, ..Default::default() }, Some(API_KEY))).addr
}

/// The response is `status` with an OpenAI error body; returns the error object.
fn expect_error(r: &Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    assert!(r.header("content-type").unwrap().starts_with("application/json"));
    let e = r.json()["error"].clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    assert!(e["type"].is_string(), "{e}");
    for k in ["param", "code"] {
        assert!(e.as_object().unwrap().contains_key(k), "{k} missing: {e}");
    }
    e
}

fn post_raw(path: &str, body: &[u8]) -> Resp {
    let auth = format!("Bearer {API_KEY}");
    request(addr(), "POST", path, &[("Authorization", &auth), ("Content-Type", "application/json")], body)
}

fn user(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

#[test]
fn bad_bodies_are_400s_naming_the_field() {
    let chat = "/v1/chat/completions";
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        (chat, json!({"messages": []}), Some("messages")),
        (chat, json!({}), Some("messages")),
        (chat, json!({"messages": [{"role": "wizard", "content": "hi"}]}), Some("messages")),
        (chat, json!({"messages": [{"role": "user"}]}), Some("messages")),
        (
            chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            Some("messages"),
        ),
        (chat, json!({"messages": user("hi"), "max_tokens": 0}), Some("max_tokens")),
        (chat, json!({"messages": user("hi"), "max_tokens": -1}), Some("max_tokens")),
        (chat, json!({"messages": user("hi"), "max_tokens": "ten"}), Some("max_tokens")),
        (chat, json!({"messages": user("hi"), "max_tokens": CONTEXT}), Some("max_tokens")),
        (chat, json!({"messages": user("hi"), "max_completion_tokens": 100000}), Some("max_tokens")),
        (chat, json!({"messages": user("hi"), "temperature": -0.5}), Some("temperature")),
        (chat, json!({"messages": user("hi"), "temperature": "warm"}), Some("temperature")),
        (chat, json!({"messages": user("hi"), "top_p": 0}), Some("top_p")),
        (chat, json!({"messages": user("hi"), "top_p": 2}), Some("top_p")),
        (chat, json!({"messages": user("hi"), "presence_penalty": 5}), Some("presence_penalty")),
        (chat, json!({"messages": user("hi"), "stop": ["a", "b", "c", "d", "e"]}), Some("stop")),
        (chat, json!({"messages": user("hi"), "stop": [1]}), Some("stop")),
        (chat, json!({"messages": user("hi"), "n": 3}), Some("n")),
        (chat, json!({"messages": user("hi"), "stream": 1}), Some("stream")),
        (chat, json!({"messages": user("hi"), "logprobs": true, "top_logprobs": 50}), Some("top_logprobs")),
        (chat, json!({"messages": user(&"word ".repeat(400))}), Some("messages")),
        ("/v1/completions", json!({"prompt": (0..300).collect::<Vec<u32>>()}), Some("prompt")),
        ("/v1/completions", json!({"prompt": [1, 2, 99999999]}), None),
        ("/v1/completions", json!({"prompt": ""}), Some("prompt")),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), Some("prompt")),
        ("/v1/completions", json!({"prompt": {"text": "x"}}), Some("prompt")),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": 21}), Some("logprobs")),
        ("/v1/completions", json!({"prompt": "hi", "echo": true}), Some("echo")),
    ];
    for (path, body, param) in cases {
        let e = expect_error(&post_raw(path, body.to_string().as_bytes()), 400);
        assert_eq!(e["param"].as_str(), param, "{body}: {e}");
        assert_eq!(e["type"], "invalid_request_error");
    }
}

#[test]
fn bodies_that_are_not_json() {
    for body in [&b"{\"messages\": ["[..], b"not json", b"[1, 2]", b"\xff\xfe{}", b""] {
        let e = expect_error(&post_raw("/v1/chat/completions", body), 400);
        assert!(e["param"].is_null());
    }
    let e = expect_error(&post_raw("/v1/chat/completions", b"{\"messages\": \"\xc3\x28\"}"), 400);
    assert!(e["message"].as_str().unwrap().contains("UTF-8"), "{e}");
}

/// A control character in an echoed value comes back escaped (and JSON-encoded).
#[test]
fn echoed_values_are_escaped() {
    let body = json!({"messages": [{"role": "bad\u{1b}[31m\nrole", "content": "x"}]});
    let r = post_raw("/v1/chat/completions", body.to_string().as_bytes());
    let e = expect_error(&r, 400);
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("bad\\u{1b}[31m\\nrole"), "{msg}");
    assert!(!msg.chars().any(char::is_control));
    assert!(!r.text().chars().any(|c| c.is_control() && c != '\n'));
}

#[test]
fn routes_methods_and_size_limits() {
    let auth = format!("Bearer {API_KEY}");
    let e = expect_error(&request(addr(), "GET", "/v1/nothing", &[("Authorization", &auth)], b""), 404);
    assert_eq!(e["code"], "not_found");
    expect_error(&get(addr(), "/nope"), 404);
    expect_error(&request(addr(), "GET", "/v1/chat/completions", &[("Authorization", &auth)], b""), 405);
    expect_error(&request(addr(), "DELETE", "/v1/completions", &[("Authorization", &auth)], b""), 405);
    expect_error(&request(addr(), "POST", "/health", &[], b""), 405);
    // 9 MiB announced: refused from the header, before the body is read.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: {auth}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        9 << 20
    );
    expect_error(&raw(addr(), head.as_bytes()), 413);
    // A body of 9 MiB sent whole, and one sent in chunks with no length.
    let big = json!({"prompt": "a ".repeat(9 << 19)}).to_string();
    expect_error(&post_raw("/v1/completions", big.as_bytes()), 413);
    let mut chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: {auth}\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for piece in big.as_bytes().chunks(1 << 20) {
        chunked.extend(format!("{:x}\r\n", piece.len()).bytes());
        chunked.extend(piece);
        chunked.extend(b"\r\n");
    }
    chunked.extend(b"0\r\n\r\n");
    expect_error(&raw(addr(), &chunked), 413);
}

#[test]
fn api_key_is_required_on_v1() {
    let body = json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0});
    let r = post(addr(), "/v1/completions", &body);
    let e = expect_error(&r, 401);
    assert_eq!(e["code"], "invalid_api_key");
    expect_error(&post_auth(addr(), "/v1/completions", "sk-wrong-key", &body), 401);
    expect_error(&post_auth(addr(), "/v1/completions", &API_KEY[..API_KEY.len() - 1], &body), 401);
    let basic =
        request(addr(), "POST", "/v1/completions", &[("Authorization", "Basic abc")], body.to_string().as_bytes());
    expect_error(&basic, 401);
    expect_error(&get(addr(), "/v1/models"), 401);
    assert_eq!(post_auth(addr(), "/v1/completions", API_KEY, &body).status, 200);
    let models = request(addr(), "GET", "/v1/models", &[("Authorization", &format!("bearer {API_KEY}"))], b"");
    assert_eq!(models.status, 200);
    // Health and metrics stay open (load balancers and scrapers carry no key).
    assert_eq!(get(addr(), "/health").status, 200);
    assert_eq!(get(addr(), "/metrics").status, 200);
}

/// After every kind of bad request above, well-formed ones still work.
#[test]
fn the_server_keeps_serving() {
    for _ in 0..3 {
        let _ = post_raw("/v1/chat/completions", b"{\"messages\": [");
        let _ = post_raw("/v1/completions", b"\xff");
        exchange(addr(), b"GARBAGE / HTTP/9.9\r\n\r\n", true);
        exchange(addr(), b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{", true);
        exchange(addr(), b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", true);
    }
    let r = post_auth(
        addr(),
        "/v1/chat/completions",
        API_KEY,
        &json!({"messages": user("Say hi."), "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["choices"][0]["message"]["content"].is_string());
}

/// The engine's failures by kind: a request whose KV cache exceeds the server's whole
/// budget is the client's (400, max_tokens); one past the request timeout a 504.
#[test]
fn engine_failures_get_their_status() {
    let body = |n: usize| json!({"messages": user("hi"), "max_tokens": n}).to_string();
    let post = |addr, b: &str| {
        request(addr, "POST", "/v1/chat/completions", &[("Content-Type", "application/json")], b.as_bytes())
    };
    // SmolLM2: 30 layers × K and V × 3 kv heads × 64 × 2 bytes = 23 040 bytes a token; a
    // budget of 200 tokens, less than the prompt and 200 more.
    let small = start(EngineConfig { max_context: CONTEXT, kv_memory: Some(200 * 23_040), ..Default::default() }, None);
    let e = expect_error(&post(small.addr, &body(200)), 400);
    assert_eq!(e["param"], "max_tokens", "{e}");
    assert!(e["message"].as_str().unwrap().contains("KV cache"), "{e}");
    assert_eq!(post(small.addr, &body(4)).status, 200, "a request within the budget runs");
    let hasty = start(EngineConfig { request_timeout: Some(std::time::Duration::ZERO), ..Default::default() }, None);
    let e = expect_error(&post(hasty.addr, &body(8)), 504);
    assert_eq!(e["code"], "timeout", "{e}");
}
