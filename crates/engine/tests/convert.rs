//! Hugging Face / MLX directory import, quantization schemes and the MLX writer, on tiny
//! random models built here (no Python, no downloads), plus one check on the real SmolLM2
//! GGUF when it is present.

use ferrolm::config::{Arch, RopeStyle};
use ferrolm::formats::mlx_write::{write_mlx_dir, write_mlx_dir_sharded, TokenizerFiles};
use ferrolm::formats::safetensors::load_dir;
use ferrolm::formats::{self, ModelSource};
use ferrolm::quant::scheme::{apply, QuantScheme};
use ferrolm::quant::{DenseData, DenseTensor, Weight};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

#[path = "convert_cases/errors.rs"]
mod errors;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const FFN: usize = 128;
const VOCAB: usize = 96;
const LAYERS: usize = 2;

/// (dtype, shape, little-endian bytes)
type RawTensor = (Dtype, Vec<usize>, Vec<u8>);

#[derive(Clone, Copy)]
struct Tiny {
    model_type: &'static str,
    dtype: Dtype,
    tied: bool,
    /// Store lm_head.weight even when tied (some checkpoints do).
    store_head: bool,
}

const LLAMA: Tiny = Tiny { model_type: "llama", dtype: Dtype::BF16, tied: false, store_head: true };
const QWEN2: Tiny = Tiny { model_type: "qwen2", dtype: Dtype::F16, tied: false, store_head: true };
const TIED: Tiny = Tiny { model_type: "llama", dtype: Dtype::F32, tied: true, store_head: false };

fn config_json(t: Tiny) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": t.model_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": FFN,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": t.tied,
    })
}

fn encode(dt: Dtype, v: &[f32]) -> Vec<u8> {
    match dt {
        Dtype::F32 => bytemuck::cast_slice(v).to_vec(),
        Dtype::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        Dtype::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        _ => unreachable!("test encodes floats only"),
    }
}

/// The tensors of a tiny model, names spelled out here (not taken from the library).
fn tiny_tensors(t: Tiny, seed: u64) -> BTreeMap<String, RawTensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut m = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>, center: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| center + rng.gen_range(-0.1..0.1)).collect();
        m.insert(name, (t.dtype, shape, encode(t.dtype, &v)));
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    put("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN], 0.0);
    put("model.norm.weight".into(), vec![HIDDEN], 1.0);
    if t.store_head {
        put("lm_head.weight".into(), vec![VOCAB, HIDDEN], 0.0);
    }
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}.");
        put(format!("{p}input_layernorm.weight"), vec![HIDDEN], 1.0);
        put(format!("{p}post_attention_layernorm.weight"), vec![HIDDEN], 1.0);
        put(format!("{p}self_attn.q_proj.weight"), vec![q, HIDDEN], 0.0);
        put(format!("{p}self_attn.k_proj.weight"), vec![kv, HIDDEN], 0.0);
        put(format!("{p}self_attn.v_proj.weight"), vec![kv, HIDDEN], 0.0);
        put(format!("{p}self_attn.o_proj.weight"), vec![HIDDEN, q], 0.0);
        put(format!("{p}mlp.gate_proj.weight"), vec![FFN, HIDDEN], 0.0);
        put(format!("{p}mlp.up_proj.weight"), vec![FFN, HIDDEN], 0.0);
        put(format!("{p}mlp.down_proj.weight"), vec![HIDDEN, FFN], 0.0);
        if t.model_type == "qwen2" {
            put(format!("{p}self_attn.q_proj.bias"), vec![q], 0.0);
            put(format!("{p}self_attn.k_proj.bias"), vec![kv], 0.0);
            put(format!("{p}self_attn.v_proj.bias"), vec![kv], 0.0);
        }
    }
    m
}

/// Write config.json and the tensors, in `shards` files (+ index when more than one).
fn write_dir(dir: &Path, config: &Value, tensors: &BTreeMap<String, RawTensor>, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut weight_map = serde_json::Map::new();
    for s in 0..shards {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", s + 1)
        };
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| i % shards == s)
            .map(|(_, (n, (dt, shape, b)))| {
                weight_map.insert(n.clone(), json!(file));
                (n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.join(&file)).unwrap();
    }
    if shards > 1 {
        let index = json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

fn tiny_dir(t: Tiny) -> (tempfile::TempDir, BTreeMap<String, RawTensor>) {
    let d = tempfile::tempdir().unwrap();
    let tensors = tiny_tensors(t, 7);
    write_dir(d.path(), &config_json(t), &tensors, 1);
    (d, tensors)
}

fn decode(dt: Dtype, b: &[u8]) -> Vec<f32> {
    match dt {
        Dtype::F32 => bytemuck::pod_collect_to_vec(b),
        Dtype::F16 => b.chunks(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => b.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => unreachable!(),
    }
}

/// Bit-exact equality of two weights (same variant, dtype, shape, bits, values).
fn assert_same(name: &str, a: &Weight, b: &Weight) {
    assert_eq!(a.describe(), b.describe(), "{name}");
    assert_eq!((a.rows(), a.cols()), (b.rows(), b.cols()), "{name}");
    if let (Weight::Affine(x), Weight::Affine(y)) = (a, b) {
        assert_eq!(x.packed, y.packed, "{name} packed");
        assert_eq!(x.scales.dtype(), y.scales.dtype(), "{name}");
        let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(x.scales.to_f32_vec()), bits(y.scales.to_f32_vec()), "{name}");
        assert_eq!(bits(x.biases.to_f32_vec()), bits(y.biases.to_f32_vec()), "{name}");
    }
    let (va, vb) = (a.to_f32_vec(), b.to_f32_vec());
    assert!(va.iter().zip(&vb).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} values differ");
}

fn assert_same_source(a: &ModelSource, b: &ModelSource) {
    let ka: Vec<&String> = a.tensors.keys().collect();
    let kb: Vec<&String> = b.tensors.keys().collect();
    assert_eq!(ka, kb);
    for (n, w) in &a.tensors {
        assert_same(n, w, &b.tensors[n]);
    }
}

fn placeholder_tokenizer() -> TokenizerFiles {
    // Placeholder only: these tests check weights and config, not tokenization.
    TokenizerFiles { tokenizer_json: "{}".into(), tokenizer_config_json: "{}".into() }
}

fn err_of<T>(r: ferrolm::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn loads_tiny_llama_exactly() {
    let (d, raw) = tiny_dir(LLAMA);
    let src = formats::load(d.path(), false).unwrap();
    assert_eq!(src.format, "hf");
    let c = &src.config;
    assert_eq!((c.arch, c.hidden, c.n_layers, c.n_heads), (Arch::Llama, 64, 2, 4));
    assert_eq!((c.n_kv_heads, c.head_dim, c.ffn, c.vocab), (2, 16, 128, 96));
    assert_eq!(c.rope_style, RopeStyle::Half);
    assert!(!c.tie_embeddings && !c.qkv_bias);
    assert_eq!(src.tensors.len(), raw.len());
    for (name, (dt, shape, bytes)) in &raw {
        let w = &src.tensors[name];
        let (rows, cols) = if shape.len() == 1 { (1, shape[0]) } else { (shape[0], shape[1]) };
        assert_eq!((w.rows(), w.cols()), (rows, cols), "{name}");
        assert_eq!(w.describe(), "bf16", "{name}");
        assert_eq!(w.to_f32_vec(), decode(*dt, bytes), "{name}");
    }
}

#[test]
fn loads_qwen2_biases_and_tied_models() {
    let (d, raw) = tiny_dir(QWEN2);
    let src = load_dir(d.path(), false).unwrap();
    assert_eq!(src.config.arch, Arch::Qwen2);
    assert!(src.config.qkv_bias);
    let b = &src.tensors["model.layers.1.self_attn.k_proj.bias"];
    assert_eq!((b.rows(), b.cols(), b.describe().as_str()), (1, 32, "f16"));
    let (dt, _, bytes) = &raw["model.layers.1.self_attn.k_proj.bias"];
    assert_eq!(b.to_f32_vec(), decode(*dt, bytes));

    let (d, _) = tiny_dir(TIED);
    let src = load_dir(d.path(), false).unwrap();
    assert!(src.config.tie_embeddings);
    assert!(!src.tensors.contains_key("lm_head.weight"));

    // No lm_head and no tie_word_embeddings flag: the head is the embedding.
    let mut cfg = config_json(TIED);
    cfg.as_object_mut().unwrap().remove("tie_word_embeddings");
    let d = tempfile::tempdir().unwrap();
    write_dir(d.path(), &cfg, &tiny_tensors(TIED, 1), 1);
    assert!(load_dir(d.path(), false).unwrap().config.tie_embeddings);

    // Tied but a copy of lm_head stored: dropped, as mlx-lm's sanitize does.
    let t = Tiny { store_head: true, ..TIED };
    let d = tempfile::tempdir().unwrap();
    write_dir(d.path(), &config_json(t), &tiny_tensors(t, 1), 1);
    let src = load_dir(d.path(), false).unwrap();
    assert!(src.config.tie_embeddings && !src.tensors.contains_key("lm_head.weight"));
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let tensors = tiny_tensors(QWEN2, 3);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_dir(a.path(), &config_json(QWEN2), &tensors, 1);
    write_dir(b.path(), &config_json(QWEN2), &tensors, 3);
    // A stray file outside the index must not be read.
    std::fs::write(b.path().join("consolidated.safetensors"), b"junk").unwrap();
    let (sa, sb) = (load_dir(a.path(), false).unwrap(), load_dir(b.path(), false).unwrap());
    assert_same_source(&sa, &sb);
    assert_eq!(sb.file_bytes, {
        let mut n = 0;
        for i in 1..=3 {
            let f = b.path().join(format!("model-{i:05}-of-00003.safetensors"));
            n += std::fs::metadata(f).unwrap().len();
        }
        n
    });
}

#[test]
fn parses_schemes() {
    let p = |s: &str| QuantScheme::parse(s);
    assert_eq!(p("bf16").unwrap(), QuantScheme::Bf16);
    assert_eq!(p("4").unwrap(), QuantScheme::Uniform { bits: 4, group: 64 });
    assert_eq!(p("8:g32").unwrap(), QuantScheme::Uniform { bits: 8, group: 32 });
    let m = QuantScheme::Mixed { low: 4, high: 8, group: 64 };
    assert_eq!(p("mixed:4,8").unwrap(), m);
    assert_eq!(p(&m.to_string()).unwrap(), m);
    for bad in ["7", "4:g48", "mixed:8,4", "mixed:4", "q4", "", "4:gx"] {
        assert!(p(bad).is_err(), "{bad:?} should not parse");
    }
}

/// Every element within one quantization step (|scale|) of the source, plus what rounding
/// the stored scale and bias to their dtype can add (scale error times up to 2^bits − 1).
fn assert_within_one_step(name: &str, orig: &[f32], w: &Weight) {
    let Weight::Affine(t) = w else { panic!("{name} is not quantized") };
    let ulp = match t.scales.dtype().name() {
        "bf16" => 2f32.powi(-8),
        "f16" => 2f32.powi(-11),
        _ => 0.0,
    };
    let n_bins = ((1u32 << t.bits) - 1) as f32;
    let d = t.dequantize();
    let gpr = t.groups_per_row();
    for (i, (&x, &y)) in orig.iter().zip(&d).enumerate() {
        let (r, c) = (i / t.cols, i % t.cols);
        let g = r * gpr + c / t.group;
        let (s, b) = (t.scales.get(g).abs(), t.biases.get(g).abs());
        let bound = s * (1.0 + n_bins * ulp) + b * ulp + 1e-6;
        assert!((x - y).abs() <= bound, "{name}[{i}]: {x} vs {y}, bound {bound}");
    }
}

#[test]
fn uniform_schemes_quantize_matrices_only() {
    for (scheme, bits, group) in [("4", 4, 64), ("8", 8, 64), ("4:g32", 4, 32), ("3:g32", 3, 32)] {
        let (d, _) = tiny_dir(LLAMA);
        let mut src = load_dir(d.path(), false).unwrap();
        let orig = load_dir(d.path(), false).unwrap();
        apply(&mut src, &QuantScheme::parse(scheme).unwrap(), false).unwrap();
        for (name, w) in &src.tensors {
            if name.ends_with("norm.weight") {
                assert_same(name, w, &orig.tensors[name]);
                continue;
            }
            let Weight::Affine(t) = w else { panic!("{scheme}: {name} left dense") };
            assert_eq!((t.bits, t.group), (bits, group), "{name}");
            assert_eq!(t.scales.dtype().name(), "bf16", "{name}: scales keep the source dtype");
            assert_within_one_step(name, &orig.tensors[name].to_f32_vec(), w);
        }
    }
}

#[test]
fn eight_bits_beat_four_and_f32_sources_keep_f32_scales() {
    let (d, _) = tiny_dir(TIED);
    let orig = load_dir(d.path(), false).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    let x = orig.tensors[name].to_f32_vec();
    let mut err = vec![];
    for scheme in ["4", "8"] {
        let mut src = load_dir(d.path(), false).unwrap();
        apply(&mut src, &QuantScheme::parse(scheme).unwrap(), false).unwrap();
        let w = &src.tensors[name];
        assert_eq!(w.describe(), format!("q{scheme} g64 f32"));
        let y = w.to_f32_vec();
        err.push(x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max));
    }
    // 0.2-wide groups: a 4-bit step is 0.2/15, an 8-bit step 0.2/255.
    assert!(err[0] < 0.2 / 15.0 * 1.01 && err[1] < 0.2 / 255.0 * 1.01, "{err:?}");
    assert!(err[1] * 8.0 < err[0], "{err:?}");
}

#[test]
fn mixed_scheme_follows_the_documented_rule() {
    let bits_of = |src: &ModelSource, n: &str| match &src.tensors[n] {
        Weight::Affine(t) => t.bits,
        _ => 0,
    };
    let scheme = QuantScheme::parse("mixed:4,8").unwrap();
    // Two layers: N/8 = 0 and 7N/8 = 1, so layer 1 uses more bits and layer 0 does not.
    let (d, _) = tiny_dir(LLAMA);
    let mut src = load_dir(d.path(), false).unwrap();
    apply(&mut src, &scheme, false).unwrap();
    for (n, want) in [
        ("model.embed_tokens.weight", 4),
        ("lm_head.weight", 8),
        ("model.layers.0.self_attn.v_proj.weight", 4),
        ("model.layers.0.mlp.down_proj.weight", 4),
        ("model.layers.1.self_attn.v_proj.weight", 8),
        ("model.layers.1.mlp.down_proj.weight", 8),
        ("model.layers.1.self_attn.q_proj.weight", 4),
        ("model.layers.1.mlp.up_proj.weight", 4),
    ] {
        assert_eq!(bits_of(&src, n), want, "{n}");
    }
    // Tied: the embedding is the output head and gets the high bits.
    let (d, _) = tiny_dir(TIED);
    let mut src = load_dir(d.path(), false).unwrap();
    apply(&mut src, &scheme, false).unwrap();
    assert_eq!(bits_of(&src, "model.embed_tokens.weight"), 8);
    // mlx-lm's layer rule on a 32-layer model: 0-3, 28-31, and every third from 6.
    let more: Vec<usize> = (0..32).filter(|&i| ferrolm::quant::scheme::uses_more_bits(i, 32)).collect();
    assert_eq!(more, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
}

#[test]
fn requantize_and_bf16() {
    let (d, _) = tiny_dir(QWEN2);
    let name = "model.layers.0.self_attn.o_proj.weight";
    let mut a = load_dir(d.path(), false).unwrap();
    apply(&mut a, &QuantScheme::parse("4").unwrap(), false).unwrap();
    let q4 = a.tensors[name].clone();
    // Same scheme again: kept bit for bit.
    apply(&mut a, &QuantScheme::parse("4").unwrap(), false).unwrap();
    assert_same(name, &q4, &a.tensors[name]);
    // 4 → 8: dequantized and requantized, within one 8-bit step of the 4-bit values.
    apply(&mut a, &QuantScheme::parse("8:g32").unwrap(), false).unwrap();
    assert_eq!(a.tensors[name].describe(), "q8 g32 f16");
    assert_within_one_step(name, &q4.to_f32_vec(), &a.tensors[name]);
    // bf16: every tensor dense bf16, quantized ones dequantized then rounded.
    let before = a.tensors[name].to_f32_vec();
    apply(&mut a, &QuantScheme::Bf16, false).unwrap();
    for (n, w) in &a.tensors {
        assert_eq!(w.describe(), "bf16", "{n}");
    }
    let after = a.tensors[name].to_f32_vec();
    assert!(before.iter().zip(&after).all(|(x, y)| bf16::from_f32(*x).to_f32() == *y));
}

#[test]
fn scheme_errors_name_the_tensor() {
    let (d, _) = tiny_dir(LLAMA);
    let mut src = load_dir(d.path(), false).unwrap();
    // hidden 64 is not a multiple of group 128.
    let e = err_of(apply(&mut src, &QuantScheme::parse("4:g128").unwrap(), false));
    assert!(e.contains("tensor model.") || e.contains("tensor lm_head"), "{e}");
    assert!(e.contains("128"), "{e}");
}

fn roundtrip(src: &ModelSource) -> (tempfile::TempDir, ModelSource) {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("mlx");
    write_mlx_dir(src, &dir, &placeholder_tokenizer(), false).unwrap();
    let back = load_dir(&dir, false).unwrap();
    (out, back)
}

#[test]
fn mlx_roundtrip_is_bit_exact() {
    for (t, scheme) in [
        (LLAMA, "4"),
        (LLAMA, "mixed:4,8"),
        (QWEN2, "8:g32"),
        (QWEN2, "mixed:3,6:g32"),
        (TIED, "mixed:4,8"),
        (TIED, "bf16"),
        (LLAMA, "none"),
    ] {
        let (d, _) = tiny_dir(t);
        let mut src = load_dir(d.path(), false).unwrap();
        if scheme != "none" {
            apply(&mut src, &QuantScheme::parse(scheme).unwrap(), false).unwrap();
        }
        let (_out, back) = roundtrip(&src);
        assert_eq!(back.config, src.config, "{scheme}");
        assert_eq!(back.format, if scheme == "none" || scheme == "bf16" { "hf" } else { "mlx" });
        assert_same_source(&src, &back);
    }
}

#[test]
fn mlx_config_has_per_module_overrides() {
    let (d, _) = tiny_dir(LLAMA);
    let mut src = load_dir(d.path(), false).unwrap();
    apply(&mut src, &QuantScheme::parse("mixed:4,8").unwrap(), false).unwrap();
    // One matrix left dense: it must be written as `false`.
    let up = "model.layers.0.mlp.up_proj.weight";
    let v = src.tensors[up].to_f32_vec();
    let data = DenseData::F32(v);
    src.tensors.insert(up.into(), Weight::Dense(DenseTensor { rows: FFN, cols: HIDDEN, data }));
    let out = tempfile::tempdir().unwrap();
    write_mlx_dir(&src, out.path(), &placeholder_tokenizer(), false).unwrap();
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap()).unwrap();
    let q = &cfg["quantization"];
    assert_eq!(q, &cfg["quantization_config"]);
    assert_eq!((q["bits"].as_u64(), q["group_size"].as_u64()), (Some(4), Some(64)));
    let hi = json!({"group_size": 64, "bits": 8, "mode": "affine"});
    assert_eq!(q["lm_head"], hi);
    assert_eq!(q["model.layers.1.self_attn.v_proj"], hi);
    assert_eq!(q["model.layers.1.mlp.down_proj"], hi);
    assert_eq!(q["model.layers.0.mlp.up_proj"], json!(false));
    assert!(q.get("model.layers.0.mlp.down_proj").is_none());
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["rms_norm_eps"].as_f64(), Some(1e-5));
    let back = load_dir(out.path(), false).unwrap();
    assert_same_source(&src, &back);
    assert_eq!(back.tensors[up].describe(), "f32");
}

#[test]
fn sharded_mlx_write_reads_back() {
    let (d, _) = tiny_dir(QWEN2);
    let mut src = load_dir(d.path(), false).unwrap();
    apply(&mut src, &QuantScheme::parse("4:g32").unwrap(), false).unwrap();
    let out = tempfile::tempdir().unwrap();
    write_mlx_dir_sharded(&src, out.path(), &placeholder_tokenizer(), false, 8 << 10).unwrap();
    assert!(out.path().join("model.safetensors.index.json").is_file());
    assert!(!out.path().join("model.safetensors").exists());
    assert_same_source(&src, &load_dir(out.path(), false).unwrap());
    // Writing over a non-empty directory is refused.
    let e = err_of(write_mlx_dir(&src, out.path(), &placeholder_tokenizer(), false));
    assert!(e.contains("not an empty directory"), "{e}");
}

/// GGUF's llama converter: `w.reshape(heads, 2, D/2, cols).swapaxes(1, 2)`, i.e. ggml row
/// h·D + 2i + j holds Hugging Face row h·D + j·D/2 + i.
fn gguf_permute(w: &Weight, heads: usize) -> Weight {
    let Weight::Dense(t) = w else { unreachable!() };
    let (rows, cols) = (t.rows, t.cols);
    let d = rows / heads;
    let hf = t.to_f32_vec();
    let mut g = vec![0f32; hf.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let (dst, src) = (h * d + 2 * i + j, h * d + j * d / 2 + i);
                g[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
            }
        }
    }
    let data = DenseData::F32(g);
    Weight::Dense(DenseTensor { rows, cols, data })
}

#[test]
fn gguf_order_is_unpermuted_on_write() {
    for scheme in [None, Some("4:g32")] {
        let (d, _) = tiny_dir(TIED);
        let mut hf = load_dir(d.path(), false).unwrap();
        let mut gg = load_dir(d.path(), false).unwrap();
        gg.config.rope_style = RopeStyle::Interleaved;
        for i in 0..LAYERS {
            for (p, heads) in [("q_proj", HEADS), ("k_proj", KV_HEADS)] {
                let n = format!("model.layers.{i}.self_attn.{p}.weight");
                let w = gguf_permute(&gg.tensors[&n], heads);
                assert!(w.to_f32_vec() != hf.tensors[&n].to_f32_vec());
                gg.tensors.insert(n, w);
            }
        }
        if let Some(s) = scheme {
            let s = QuantScheme::parse(s).unwrap();
            apply(&mut hf, &s, false).unwrap();
            apply(&mut gg, &s, false).unwrap();
        }
        let (_o, back) = roundtrip(&gg);
        assert_eq!(back.config.rope_style, RopeStyle::Half);
        assert_same_source(&hf, &back);
    }
}

/// The real SmolLM2 GGUF → MLX directory → back: identical except q/k rows, which come back
/// in Hugging Face order. FERROLM_MLX_OUT=dir keeps the output (for
/// tools/oracle/mlx_load_check.py; its tokenizer files are placeholders) and
/// FERROLM_MLX_SCHEME=mixed:4,8 (etc.) requantizes before writing.
#[test]
fn smollm2_gguf_to_mlx_dir() {
    let home = std::env::var("HOME").unwrap_or_default();
    let gguf = Path::new(&home).join(".cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() {
        eprintln!("skipping: {} not found", gguf.display());
        return;
    }
    let mut src = formats::load(&gguf, false).unwrap();
    let (scheme, out) = ferrolm::env::mlx_check();
    if let Some(s) = scheme {
        apply(&mut src, &QuantScheme::parse(&s).unwrap(), false).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = out.unwrap_or_else(|| tmp.path().join("smollm2-mlx"));
    write_mlx_dir(&src, &out, &placeholder_tokenizer(), false).unwrap();
    let back = load_dir(&out, false).unwrap();
    assert_eq!(back.config.rope_style, RopeStyle::Half);
    assert!(back.config.tie_embeddings);
    assert_eq!(back.tensors.len(), src.tensors.len());
    for (n, w) in &src.tensors {
        let b = &back.tensors[n];
        let heads = if n.contains("q_proj") {
            src.config.n_heads
        } else if n.contains("k_proj") {
            src.config.n_kv_heads
        } else {
            assert_same(n, w, b);
            continue;
        };
        assert_eq!(w.describe(), b.describe(), "{n}");
        // Row r of the output is ggml row h·D + 2i + j for r = h·D + j·D/2 + i.
        let d = w.rows() / heads;
        let (mut x, mut y) = (vec![0f32; w.cols()], vec![0f32; w.cols()]);
        for r in 0..w.rows() {
            let (h, k) = (r / d, r % d);
            w.row_f32(h * d + 2 * (k % (d / 2)) + k / (d / 2), &mut x);
            b.row_f32(r, &mut y);
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "{n} row {r}");
        }
    }
}
