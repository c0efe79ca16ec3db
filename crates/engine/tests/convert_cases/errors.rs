//! Bad directories and mismatched MLX quantization: errors that name the fault.

use super::{config_json, err_of, placeholder_tokenizer, tiny_dir, write_dir, RawTensor, HIDDEN, LLAMA};
use ferrolm::formats::mlx_write::write_mlx_dir;
use ferrolm::formats::safetensors::load_dir;
use ferrolm::quant::scheme::{apply, QuantScheme};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

fn expect_load_err(dir: &Path, needle: &str) {
    let e = err_of(load_dir(dir, false));
    assert!(e.contains(needle), "error {e:?} should mention {needle:?}");
}

#[test]
fn bad_directories_are_errors_naming_the_fault() {
    let (d, raw) = tiny_dir(LLAMA);
    let p = d.path();
    std::fs::remove_file(p.join("config.json")).unwrap();
    expect_load_err(p, "config.json is missing");

    let mut cfg = config_json(LLAMA);
    cfg["model_type"] = json!("gpt2");
    std::fs::write(p.join("config.json"), cfg.to_string()).unwrap();
    expect_load_err(p, "\"gpt2\"");

    let fresh = |edit: &dyn Fn(&mut BTreeMap<String, RawTensor>)| {
        let d = tempfile::tempdir().unwrap();
        let mut t = raw.clone();
        edit(&mut t);
        write_dir(d.path(), &config_json(LLAMA), &t, 1);
        d
    };
    let d = fresh(&|t| {
        t.remove("model.layers.1.mlp.gate_proj.weight");
    });
    expect_load_err(d.path(), "model.layers.1.mlp.gate_proj.weight is missing");
    let d = fresh(&|t| {
        let e = t.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
        e.1 = vec![HIDDEN, 32];
    });
    expect_load_err(d.path(), "model.layers.0.self_attn.k_proj.weight: shape [64, 32]");
    let d = fresh(&|t| {
        let v = t["model.norm.weight"].clone();
        t.insert("model.layers.0.self_attn.o_proj.bias".into(), v);
    });
    expect_load_err(d.path(), "unexpected tensor(s) for this config: model.layers.0.self_attn.o_proj.bias");
    // A quantized-looking module with no quantization in config.json.
    let d = fresh(&|t| {
        let v = t["model.norm.weight"].clone();
        t.insert("model.layers.0.mlp.up_proj.scales".into(), v.clone());
        t.insert("model.layers.0.mlp.up_proj.biases".into(), v);
    });
    expect_load_err(d.path(), "model.layers.0.mlp.up_proj is quantized but config.json");

    // Truncated file: the error names it.
    let (d, _) = tiny_dir(LLAMA);
    let f = d.path().join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.set_len(len - 100).unwrap();
    expect_load_err(d.path(), "model.safetensors: invalid safetensors file");
    std::fs::remove_file(&f).unwrap();
    expect_load_err(d.path(), "no model*.safetensors files");
}

#[test]
fn mlx_quantized_mismatches_are_errors() {
    let (d, _) = tiny_dir(LLAMA);
    let mut src = load_dir(d.path(), false).unwrap();
    apply(&mut src, &QuantScheme::parse("4").unwrap(), false).unwrap();
    let out = tempfile::tempdir().unwrap();
    write_mlx_dir(&src, out.path(), &placeholder_tokenizer(), false).unwrap();
    let cfg_path = out.path().join("config.json");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    // Claim 8 bits for one module: its packed shape no longer fits.
    let mut c = cfg.clone();
    c["quantization"]["model.layers.1.mlp.up_proj"] = json!({"group_size": 64, "bits": 8});
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    expect_load_err(out.path(), "model.layers.1.mlp.up_proj.weight: quantized weight is U32 [128, 8]");
    // Claim a module is dense while its scales are there.
    let mut c = cfg.clone();
    c["quantization"]["lm_head"] = json!(false);
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    expect_load_err(out.path(), "lm_head is quantized but config.json");
    // Non-MLX quantization is refused by name.
    let mut c = cfg.clone();
    c.as_object_mut().unwrap().remove("quantization");
    c["quantization_config"] = json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    expect_load_err(out.path(), "quant_method \"gptq\"");
}
