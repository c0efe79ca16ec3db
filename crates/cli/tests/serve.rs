//! `ferrolm serve` end to end: it prints where it listens, takes its key from
//! FERROLM_API_KEY, answers, and exits 0 on SIGTERM; bad flags are one-line errors.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

fn smollm2() -> String {
    let p = ferrolm::env::test_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run scripts/fetch-test-models.sh", p.display());
    p.to_string_lossy().into_owned()
}

/// Start `ferrolm serve` and read the address from its first line of stdout.
fn serve(args: &[&str], key_env: &str) -> (Child, SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["serve", "--model", &smollm2(), "--device", "cpu", "--port", "0"])
        .args(args)
        .env("FERROLM_API_KEY", key_env)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run ferrolm serve");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().parse().unwrap_or_else(|_| panic!("{line:?}"));
    (child, addr)
}

/// One HTTP/1.1 exchange; the status and the body.
fn http(addr: SocketAddr, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

#[test]
fn serve_answers_and_exits_0_on_sigterm() {
    let (mut child, addr) = serve(&["--kv-memory", "256MiB", "--max-batch", "2", "--kv", "turbo"], "sk-from-env");
    assert_eq!(http(addr, "GET", "/v1/models", None, "").0, 401);
    let (status, body) = http(addr, "GET", "/v1/models", Some("sk-from-env"), "");
    assert_eq!(status, 200);
    assert!(body.contains("\"id\":\"SmolLM2-135M-Instruct.Q4_1\""), "{body}");
    let req = r#"{"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}"#;
    let (status, body) = http(addr, "POST", "/v1/completions", Some("sk-from-env"), req);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"completion_tokens\":4"), "{body}");
    let (_, metrics) = http(addr, "GET", "/metrics", None, "");
    assert!(metrics.contains(&format!("ferrolm_kv_cache_bytes_budget {}", 256 << 20)), "{metrics}");
    // turbo:k8v3 over SmolLM2's 30 layers of 3 KV heads of 64: 100 bytes a head (bf16: 256).
    assert!(metrics.contains("ferrolm_kv_cache_bytes_per_token 9000\n"), "{metrics}");
    assert!(metrics.contains("ferrolm_kv_cache_info{scheme=\"turbo:k8v3\"} 1"), "{metrics}");
    // SAFETY: signalling the child this test started.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

/// `--tensor-parallel 3` (simulated CPU ranks): the server answers with the unsplit
/// model's greedy completion.
#[test]
fn a_server_over_tensor_parallel_ranks_answers_as_the_whole_model() {
    let req = r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}"#;
    let mut texts = vec![];
    for tp in ["1", "3"] {
        let (mut child, addr) = serve(&["--kv-memory", "64MiB", "--max-batch", "2", "--tensor-parallel", tp], "");
        let (status, body) = http(addr, "POST", "/v1/completions", None, req);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        texts.push(v["choices"][0]["text"].as_str().unwrap().to_string());
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert!(!texts[0].is_empty());
    assert_eq!(texts[0], texts[1]);
}

/// `--prefix-cache-dir`: a prompt served once is found again after a restart (its
/// blocks cached, the same completion).
#[test]
fn the_prefix_cache_dir_outlives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let prompt = "The lighthouse keeper wrote in his log every evening: the weather, the ships that \
        passed, the birds that rested on the rail, and the colour of the sea at dusk. One evening";
    let req = format!(r#"{{"prompt": "{prompt}", "max_tokens": 6, "temperature": 0}}"#);
    let mut bodies = vec![];
    for _ in 0..2 {
        let (mut child, addr) = serve(&["--kv-memory", "64MiB", "--prefix-cache-dir", d], "");
        let (status, body) = http(addr, "POST", "/v1/completions", None, &req);
        assert_eq!(status, 200, "{body}");
        bodies.push(body);
        // SAFETY: signalling the child this test started.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        assert_eq!(child.wait().unwrap().code(), Some(0));
    }
    let json = |b: &str| serde_json::from_str::<serde_json::Value>(b).unwrap();
    let (cold, warm) = (json(&bodies[0]), json(&bodies[1]));
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{cold}");
    assert!(warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 32, "{warm}");
    assert_eq!(cold["choices"][0]["text"], warm["choices"][0]["text"]);
}

#[test]
fn bad_serve_flags_are_errors() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ferrolm"))
            .arg("serve")
            .args(args)
            .env_remove("FERROLM_API_KEY")
            .output()
            .unwrap()
    };
    let o = run(&["--kv-memory", "12XB"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown unit"));
    let o = run(&["--model", &smollm2(), "--device", "cpu", "--kv", "turbo:k8v6"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("v6"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&["--model", &smollm2(), "--device", "tpu"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--device tpu"));
    let o = run(&["--model", &smollm2(), "--device", "cpu", "--host", "127.0.0.1", "--port", "1", "--max-batch", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("max_batch"));
}
