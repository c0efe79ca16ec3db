//! The hostile-file corpus, one class at a time: mutated config.json, safetensors files,
//! tokenizer.json and chat templates. Every case must end, within a deadline, in a clean
//! error that names the file, or in a correct result; never a panic or a hang. (Mutated
//! GGUFs: gguf_errors.rs; FIFOs, devices and oversize text inputs: hostile_files.rs.)
//! Each test prints its case count.

use ferrolm::config::ModelConfig;
use ferrolm::formats::gguf::GgufFile;
use ferrolm::tokenizer::{ChatMessage, Tokenizer};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

// Chat templates render here as in the CLI: under the memory guard.
#[global_allocator]
static ALLOC: ferrolm::alloc_guard::GuardedAlloc = ferrolm::alloc_guard::GuardedAlloc;

/// `f` on a thread, caught: Ok(its result), or Err("PANIC …" / "HANG …").
fn guarded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            format!("PANIC {}", msg.unwrap_or_default())
        });
        let _ = tx.send(r);
    });
    rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| Err("HANG: no answer in 30 s".into()))
}

/// Failures collected over a class's cases.
#[derive(Default)]
struct Corpus {
    failures: Vec<String>,
    cases: usize,
}

impl Corpus {
    /// One case: `r` is the outcome (Ok: a correct result; Err: the error text); an error
    /// must name `file` (the CLI prints it on one line, control characters escaped).
    fn case(&mut self, name: &str, file: &str, r: Result<Result<(), String>, String>) {
        self.cases += 1;
        match r {
            Err(p) => self.failures.push(format!("{name}: {p}")),
            Ok(Err(m)) if !m.contains(file) => self.failures.push(format!("{name}: error {m:?} does not name {file}")),
            Ok(_) => {}
        }
    }
    fn finish(self, class: &str, min: usize) {
        eprintln!("{class}: {} cases", self.cases);
        assert!(self.cases >= min, "{class}: only {} cases", self.cases);
        assert!(self.failures.is_empty(), "{class}: {} failures:\n{}", self.failures.len(), self.failures.join("\n"));
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A valid small config of each family.
fn configs() -> Vec<Value> {
    let llama = json!({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0
    });
    let mut gemma = llama.clone();
    let g = gemma.as_object_mut().unwrap();
    g.insert("model_type".into(), json!("gemma3_text"));
    g.insert("head_dim".into(), json!(16));
    g.insert("sliding_window".into(), json!(8));
    g.insert("query_pre_attn_scalar".into(), json!(16));
    g.insert("layer_types".into(), json!(["sliding_attention", "full_attention"]));
    g.insert(
        "rope_parameters".into(),
        json!({"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}),
    );
    let mut qwen = llama.clone();
    qwen.as_object_mut().unwrap().insert("model_type".into(), json!("qwen3"));
    vec![llama, gemma, qwen]
}

/// Every field of each family's config.json set to hostile values (negative, zero, huge,
/// fractional, wrong types, absent): ModelConfig::from_hf_json errs naming config.json or
/// gives a config that validates.
#[test]
fn mutated_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let bad = [
        json!(-1),
        json!(0),
        json!(1u64 << 62),
        json!(1e30),
        json!(-1e30),
        json!(2.5),
        json!("64"),
        json!(null),
        json!([]),
        json!({}),
        json!(true),
        json!([1, 2]),
    ];
    let mut c = Corpus::default();
    for (k, base) in configs().into_iter().enumerate() {
        let fields: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
        for f in fields {
            for (i, v) in bad.iter().enumerate() {
                let mut j = base.clone();
                j.as_object_mut().unwrap().insert(f.clone(), v.clone());
                let p = write(dir.path(), "config.json", j.to_string().as_bytes());
                let r = guarded(move || match ModelConfig::from_hf_json(&p) {
                    Ok(cfg) => cfg.validate("config.json").map_err(|e| format!("accepted, then invalid: {e}")),
                    Err(e) => Err(e.to_string()),
                });
                c.case(&format!("config {k} {f} = {v} ({i})"), "config.json", r);
            }
            let mut j = base.clone();
            j.as_object_mut().unwrap().remove(&f);
            let p = write(dir.path(), "config.json", j.to_string().as_bytes());
            let r = guarded(move || ModelConfig::from_hf_json(&p).map(|_| ()).map_err(|e| e.to_string()));
            c.case(&format!("config {k} without {f}"), "config.json", r);
        }
        // Byte-level damage to the text.
        let text = base.to_string().into_bytes();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(k as u64);
        for i in 0..40 {
            let mut b = text.clone();
            match i % 2 {
                0 => b.truncate(rng.gen_range(0..text.len())),
                _ => b[rng.gen_range(0..text.len())] = rng.gen(),
            }
            let p = write(dir.path(), "config.json", &b);
            let r = guarded(move || ModelConfig::from_hf_json(&p).map(|_| ()).map_err(|e| e.to_string()));
            c.case(&format!("config {k} damaged {i}"), "config.json", r);
        }
    }
    c.finish("config.json", 400);
}

/// A tiny dense model directory: config.json and model.safetensors (f32).
fn tiny_dir(dir: &Path) -> Vec<u8> {
    let cfg = &configs()[0];
    write(dir, "config.json", cfg.to_string().as_bytes());
    let (d, f, v, kv) = (64usize, 128usize, 256usize, 32usize);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![("model.embed_tokens.weight".into(), vec![v, d])];
    for l in 0..2 {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        shapes.extend([
            (n("input_layernorm.weight"), vec![d]),
            (n("self_attn.q_proj.weight"), vec![d, d]),
            (n("self_attn.k_proj.weight"), vec![kv, d]),
            (n("self_attn.v_proj.weight"), vec![kv, d]),
            (n("self_attn.o_proj.weight"), vec![d, d]),
            (n("post_attention_layernorm.weight"), vec![d]),
            (n("mlp.gate_proj.weight"), vec![f, d]),
            (n("mlp.up_proj.weight"), vec![f, d]),
            (n("mlp.down_proj.weight"), vec![d, f]),
        ]);
    }
    shapes.extend([("model.norm.weight".into(), vec![d]), ("lm_head.weight".into(), vec![v, d])]);
    let data: Vec<Vec<u8>> = shapes.iter().map(|(_, s)| vec![0x3c; 4 * s.iter().product::<usize>()]).collect(); // 0.0116 as f32
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((n, s), b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    let bytes = safetensors::serialize(views, &None).unwrap();
    write(dir, "model.safetensors", &bytes);
    bytes
}

/// The safetensors file of a small model directory damaged: its header length, header JSON
/// (random flips, hostile entries: unknown dtypes, overflowing shapes, offsets out of range,
/// reversed, overlapping), truncations and random data bytes. `formats::load` errs naming
/// the directory or model.safetensors, or loads (data bytes are just values).
#[test]
fn mutated_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let ok = tiny_dir(dir.path());
    let m = dir.path().to_path_buf();
    let load = move || ferrolm::formats::load(&m, false).map(|_| ()).map_err(|e| e.to_string());
    assert!(guarded(load.clone()).unwrap().is_ok(), "the base directory loads");
    let hlen = u64::from_le_bytes(ok[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&ok[8..8 + hlen]).unwrap();
    let mut c = Corpus::default();
    // Errors name the directory (a tensor the damage renamed is "missing" from it) or the
    // file in it.
    let named = dir.path().display().to_string();
    let run = |c: &mut Corpus, name: String, bytes: Vec<u8>| {
        write(dir.path(), "model.safetensors", &bytes);
        c.case(&name, &named, guarded(load.clone()));
    };
    for (i, n) in [0u64, 1, 7, hlen as u64 - 1, hlen as u64 + 1, ok.len() as u64, u64::MAX, 1 << 40].iter().enumerate()
    {
        let mut b = ok.clone();
        b[..8].copy_from_slice(&n.to_le_bytes());
        run(&mut c, format!("header length {n} ({i})"), b);
    }
    let with_header = |h: &Value| {
        let mut s = h.to_string().into_bytes();
        while !s.len().is_multiple_of(8) {
            s.push(b' ');
        }
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend(s);
        b.extend_from_slice(&ok[8 + hlen..]);
        b
    };
    let name = "model.layers.0.mlp.up_proj.weight";
    let entry = header[name].clone();
    let end = entry["data_offsets"][1].as_u64().unwrap();
    let hostile = [
        json!({"dtype": "Q9_K", "shape": entry["shape"], "data_offsets": entry["data_offsets"]}),
        json!({"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": entry["data_offsets"]}),
        json!({"dtype": "F32", "shape": [u64::MAX, 2], "data_offsets": entry["data_offsets"]}),
        json!({"dtype": "F32", "shape": entry["shape"], "data_offsets": [end, end - 4]}),
        json!({"dtype": "F32", "shape": entry["shape"], "data_offsets": [0, u64::MAX]}),
        json!({"dtype": "F32", "shape": entry["shape"], "data_offsets": [1u64 << 50, (1u64 << 50) + 65536]}),
        json!({"dtype": "F32", "shape": entry["shape"], "data_offsets": [0, 64]}),
        json!({"dtype": "F32", "shape": [-1, 64], "data_offsets": entry["data_offsets"]}),
        json!({"dtype": "F32", "shape": "big", "data_offsets": entry["data_offsets"]}),
        json!({"dtype": "F32", "shape": entry["shape"]}),
        json!(null),
        json!([1, 2, 3]),
    ];
    for (i, e) in hostile.iter().enumerate() {
        let mut h = header.clone();
        h[name] = e.clone();
        run(&mut c, format!("hostile entry {i}: {e}"), with_header(&h));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for i in 0..150 {
        let mut b = ok.clone();
        let at = if i < 100 { rng.gen_range(8..8 + hlen) } else { rng.gen_range(8 + hlen..ok.len()) };
        b[at] = rng.gen();
        run(&mut c, format!("flip {i} at {at}"), b);
    }
    for i in 0..30 {
        let keep = rng.gen_range(0..ok.len());
        run(&mut c, format!("truncated {i} at {keep}"), ok[..keep].to_vec());
    }
    c.finish("safetensors", 200);
}

/// A small real tokenizer.json (the tiny SentencePiece GGUF's, through `tokenizers`).
fn tokenizer_json() -> String {
    let g = GgufFile::open(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/tiny_spm.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let json = tok.hf().to_string(false).unwrap();
    json
}

/// tokenizer.json damaged (truncations, flips, hostile structure) and chat templates that
/// loop, recurse, raise or grow: loading and encoding, or rendering, err naming the file or
/// give a result; never a panic or a hang.
#[test]
fn mutated_tokenizers_and_templates() {
    let dir = tempfile::tempdir().unwrap();
    let base = tokenizer_json();
    write(dir.path(), "tokenizer.json", base.as_bytes());
    let d = dir.path().to_path_buf();
    let try_dir = move || -> Result<(), String> {
        let tok = Tokenizer::from_dir(&d).map_err(|e| e.to_string())?;
        tok.encode("Hello <s> world, ünïcode 🦀 and numbers 12345", true).map_err(|e| e.to_string())?;
        let msgs = [ChatMessage { role: "user".into(), content: "hi".into() }];
        match tok.chat_template() {
            Some(_) => tok.apply_chat_template(&msgs, true).map(|_| ()).map_err(|e| e.to_string()),
            None => Ok(()),
        }
    };
    assert!(guarded(try_dir.clone()).unwrap().is_ok(), "the base tokenizer loads");
    let mut c = Corpus::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let b = base.as_bytes();
    for i in 0..80 {
        let mut m = b.to_vec();
        match i % 2 {
            0 => m.truncate(rng.gen_range(0..b.len())),
            _ => {
                for _ in 0..rng.gen_range(1..4) {
                    m[rng.gen_range(0..b.len())] = rng.gen();
                }
            }
        }
        write(dir.path(), "tokenizer.json", &m);
        c.case(&format!("tokenizer.json damaged {i}"), "tokenizer.json", guarded(try_dir.clone()));
    }
    let j: Value = serde_json::from_str(&base).unwrap();
    let structural: Vec<(&str, Value)> = vec![
        ("/model/type", json!("Nonexistent")),
        ("/model/vocab", json!([["a", "x"]])),
        ("/model/vocab", json!({})),
        ("/model/unk_id", json!(1u64 << 40)),
        ("/added_tokens", json!([{"id": 4_000_000_000u64, "content": "<big>", "special": true}])),
        ("/added_tokens", json!("none")),
        ("/normalizer", json!({"type": "Unknown"})),
        ("/pre_tokenizer", json!({"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated"})),
        ("/decoder", json!(7)),
    ];
    for (i, (ptr, v)) in structural.into_iter().enumerate() {
        let mut m = j.clone();
        if let Some(slot) = m.pointer_mut(ptr) {
            *slot = v;
        } else {
            continue;
        }
        write(dir.path(), "tokenizer.json", m.to_string().as_bytes());
        c.case(&format!("tokenizer.json {ptr} ({i})"), "tokenizer.json", guarded(try_dir.clone()));
    }
    write(dir.path(), "tokenizer.json", base.as_bytes());
    let templates = [
        "{% for i in range(100000000) %}x{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(3000000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}",
        "{{ raise_exception('no') }}",
        "{{ messages[99]['content'] }}",
        "{{ messages | tojson(indent=100000000) }}",
        "{% if %}",
        "{{ undefined_function() }}",
        "{{ strftime_now('%Y' * 1000) }}",
    ];
    for (i, t) in templates.iter().enumerate() {
        let cfg = json!({"chat_template": t, "bos_token": "<s>", "eos_token": "</s>"});
        write(dir.path(), "tokenizer_config.json", cfg.to_string().as_bytes());
        c.case(&format!("template {i}: {t}"), "", guarded(try_dir.clone()));
    }
    c.finish("tokenizer and templates", 90);
}

/// A directory with the tiny tokenizer.json and `template` as its chat_template.jinja.
fn template_dir(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tokenizer.json", tokenizer_json().as_bytes());
    write(dir.path(), "chat_template.jinja", template.as_bytes());
    dir
}

/// Templates that double a string or a list 45 times (2⁴⁵ bytes: through a namespace, or a
/// macro's recursion) err naming the memory bound within seconds, on one line, and the
/// process goes on rendering: SmolLM2's real template gives transformers' text after each.
#[test]
fn templates_that_double_stop_at_the_memory_bound() {
    assert!(ferrolm::alloc_guard::GuardedAlloc::installed());
    let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens");
    let real = std::fs::read_to_string(goldens.join("smollm2_tokenizer/chat_template.jinja")).unwrap();
    let real_dir = template_dir(&real);
    let real = Tokenizer::from_dir(real_dir.path()).unwrap();
    let golden: Value =
        serde_json::from_slice(&std::fs::read(goldens.join("tokenizer_smollm2.json")).unwrap()).unwrap();
    let check_real = || {
        for c in golden["chat"].as_array().unwrap() {
            let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            let got = real.apply_chat_template(&msgs, c["add_generation_prompt"].as_bool().unwrap()).unwrap();
            assert_eq!(got, c["text"].as_str().unwrap());
        }
    };
    check_real();
    let doubling = [
        "{% set ns = namespace(s='x') %}{% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(45) %}{% set ns.l = (ns.l + ns.l)|list %}{% endfor %}{{ ns.l|length }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(45) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|join|length }}",
        "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}{{ f('x', 45) }}",
    ];
    for t in doubling {
        let dir = template_dir(t);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let start = Instant::now();
        let msgs = [ChatMessage { role: "user".into(), content: "hi".into() }];
        let r = guarded(move || tok.apply_chat_template(&msgs, true).map_err(|e| e.to_string()));
        let e = r.unwrap().unwrap_err();
        assert!(e.ends_with("chat template: used more than 256 MiB while rendering"), "{t}: {e}");
        assert!(e.contains(&dir.path().display().to_string()) && !e.contains('\n'), "{e}");
        assert!(start.elapsed() < Duration::from_secs(10), "{t}: {:?}", start.elapsed());
        check_real();
    }
}

/// A SentencePiece vocabulary of long tokens (each of whose cuts the merge derivation would
/// hash) builds in bounded time, and still encodes and decodes.
#[test]
fn a_vocabulary_of_long_tokens_builds_quickly() {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into(), "\u{2581}".into(), "a".into()];
    tokens.extend((0..3000).map(|i| format!("{}{i}", "a".repeat(8000))));
    let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
    let mut w = ferrolm::formats::gguf_write::GgufWriter::new();
    w.string("general.architecture", "llama")
        .string("tokenizer.ggml.model", "llama")
        .string_array("tokenizer.ggml.tokens", &tokens)
        .f32_array("tokenizer.ggml.scores", &scores)
        .u32("tokenizer.ggml.unknown_token_id", 0)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2);
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "long.gguf", &w.to_bytes().unwrap());
    let r = guarded(move || -> Result<(), String> {
        let tok =
            Tokenizer::from_gguf(&GgufFile::open(&path).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        let ids = tok.encode("aaa a", false).map_err(|e| e.to_string())?;
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&[5]).map_err(|e| e.to_string())?.len(), 8001);
        Ok(())
    });
    assert_eq!(r, Ok(Ok(())));
}
