//! The config.json forms current tools write: Transformers 5's `rope_parameters` (the RoPE
//! base and scaling live only there), mlx-lm 0.32's per-module quantization entries with
//! null `group_size` / `bits` (they inherit the default), quantization modes other than
//! affine (refused, naming the module), and RoPE bases and epsilons that are not finite
//! positive numbers (refused, naming the field); whole configs as Transformers 5 writes them
//! (scripts/hf-corpus.sh checks the models behind them against Transformers' NLL).

use ferrolm::config::ModelConfig;
use ferrolm::formats::safetensors::QuantConfig;
use serde_json::{json, Value};
use std::path::Path;

/// A small Llama config.json with `extra`'s fields merged in (null removes a field).
fn config(extra: Value) -> Value {
    let mut j = json!({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5
    });
    for (k, v) in extra.as_object().unwrap() {
        match v {
            Value::Null => j.as_object_mut().unwrap().remove(k),
            _ => j.as_object_mut().unwrap().insert(k.clone(), v.clone()),
        };
    }
    j
}

fn load(j: &Value) -> ferrolm::Result<ModelConfig> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, j.to_string()).unwrap();
    ModelConfig::from_hf_json(&path)
}

#[test]
fn transformers5_rope_parameters_give_the_base_and_scaling() {
    let c = load(&config(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}))).unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.llama3_scaling, None);
    let llama3 = json!({"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
    }});
    let c = load(&config(llama3)).unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    let s = c.llama3_scaling.expect("llama3 scaling from rope_parameters");
    assert_eq!((s.factor, s.original_max_position), (32.0, 8192.0));
    let linear = json!({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}});
    let c = load(&config(linear)).unwrap();
    assert_eq!((c.rope_theta, c.rope_linear), (1e6, 2.0));
    // Per attention kind (Gemma 3's form): the full-attention layers' parameters.
    let kinds = json!({"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
    }});
    assert_eq!(load(&config(kinds)).unwrap().rope_theta, 1e6);
    // The older fields still work, and without either the base is Hugging Face's 10000.
    assert_eq!(load(&config(json!({"rope_theta": 250000.0}))).unwrap().rope_theta, 250000.0);
    assert_eq!(load(&config(json!({}))).unwrap().rope_theta, 10000.0);
    let err = load(&config(json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}))).unwrap_err();
    assert!(err.to_string().contains("yarn"), "{err}");
}

#[test]
fn rope_bases_and_epsilons_must_be_finite_and_positive() {
    for (extra, field) in [
        (json!({"rope_theta": 0.0}), "rope_theta"),
        (json!({"rope_theta": -10000.0}), "rope_theta"),
        (json!({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}), "rope_theta"),
        (json!({"rms_norm_eps": 0.0}), "rms_norm_eps"),
        (json!({"rms_norm_eps": -1e-6}), "rms_norm_eps"),
        (json!({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}), "scaling factor"),
        (json!({"rope_theta": "big"}), "rope_theta"),
    ] {
        let err = load(&config(extra.clone())).expect_err(&extra.to_string()).to_string();
        assert!(err.contains(field), "{extra}: {err}");
    }
}

fn quant(j: Value) -> ferrolm::Result<Option<QuantConfig>> {
    QuantConfig::from_config(&json!({ "quantization": j }), Path::new("config.json"))
}

#[test]
fn mlx_null_group_size_and_bits_inherit_the_default() {
    // What `mlx_lm convert -q --quant-predicate mixed_4_6` writes.
    let q = quant(json!({
        "group_size": 64, "bits": 4, "mode": "affine",
        "model.layers.0.mlp.down_proj": {"group_size": null, "bits": 6},
        "model.layers.0.self_attn.v_proj": {"bits": 6, "group_size": null, "mode": "affine"},
        "model.layers.1.mlp.down_proj": {"group_size": 32, "bits": null},
        "lm_head": false
    }))
    .unwrap()
    .unwrap();
    assert_eq!(q.default, Some((4, 64)));
    assert_eq!(q.overrides["model.layers.0.mlp.down_proj"], Some((6, 64)));
    assert_eq!(q.overrides["model.layers.0.self_attn.v_proj"], Some((6, 64)));
    assert_eq!(q.overrides["model.layers.1.mlp.down_proj"], Some((4, 32)));
    assert_eq!(q.overrides["lm_head"], None);
    // A null default is mlx-lm's own (group 64).
    let q = quant(json!({"group_size": null, "bits": 8})).unwrap().unwrap();
    assert_eq!(q.default, Some((8, 64)));
}

#[test]
fn quantization_modes_other_than_affine_are_refused_by_name() {
    let err = quant(json!({"group_size": 32, "bits": 4, "mode": "mxfp4"})).unwrap_err().to_string();
    assert!(err.contains("quantization.mode") && err.contains("mxfp4"), "{err}");
    let err = quant(json!({
        "group_size": 64, "bits": 4,
        "model.layers.3.mlp.up_proj": {"group_size": 32, "bits": 4, "mode": "nvfp4"}
    }))
    .unwrap_err()
    .to_string();
    assert!(err.contains("quantization.model.layers.3.mlp.up_proj.mode") && err.contains("nvfp4"), "{err}");
    let err = quant(json!({"group_size": 64, "bits": "four"})).unwrap_err().to_string();
    assert!(err.contains("quantization.bits"), "{err}");
}

/// A sharded checkpoint's index may only name plain file names in the model directory:
/// `../x`, absolute paths and subdirectories are refused before any file is opened.
#[test]
fn safetensors_index_shards_stay_inside_the_model_directory() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config(json!({})).to_string()).unwrap();
    let outside = root.path().join("outside.safetensors");
    std::fs::write(&outside, b"not read").unwrap();
    for shard in ["../outside.safetensors", outside.to_str().unwrap(), "sub/model.safetensors"] {
        let index = json!({"weight_map": {"model.embed_tokens.weight": shard}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let err = ferrolm::formats::safetensors::load_dir(&dir, false).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("not a file name in the model directory"), "{shard}: {err}");
    }
}

/// Absurd hyperparameters are refused, naming the field and value, before anything is
/// allocated from them.
#[test]
fn absurd_hyperparameters_are_refused_by_name() {
    for (extra, want) in [
        (json!({"num_hidden_layers": 100000}), "layer count 100000"),
        (json!({"hidden_size": 1u64 << 40}), "hidden size 1099511627776"),
        (json!({"num_attention_heads": 1u64 << 20, "num_key_value_heads": 1}), "attention heads 1048576"),
        (json!({"head_dim": 1u64 << 20}), "head_dim 1048576"),
        (json!({"head_dim": 0}), "head_dim is 0"),
        (json!({"intermediate_size": 1u64 << 34}), "feed-forward size 17179869184"),
        (json!({"vocab_size": 1u64 << 30}), "vocabulary size 1073741824"),
        (json!({"max_position_embeddings": 1u64 << 40}), "context length 1099511627776"),
    ] {
        let err = load(&config(extra.clone())).expect_err(&extra.to_string()).to_string();
        assert!(err.contains(want), "{extra}: {err}");
    }
}

/// A sliding window applies to every layer of a Mistral config that has one, and to no
/// layer of a Qwen config whose `use_sliding_window` is false (Qwen2.5 writes both).
#[test]
fn sliding_windows_apply_where_the_config_means_them() {
    use ferrolm::config::AttnKind;
    let mistral = load(&config(json!({"model_type": "mistral", "sliding_window": 4096}))).unwrap();
    assert_eq!((mistral.sliding_window, mistral.layer_kinds.clone()), (4096, vec![AttnKind::Sliding; 2]));
    let none = load(&config(json!({"model_type": "mistral", "sliding_window": null}))).unwrap();
    assert!(none.layer_kinds.is_empty() && none.sliding_window == 0);
    let qwen = json!({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": false});
    let qwen = load(&config(qwen)).unwrap();
    assert!(qwen.layer_kinds.is_empty() && qwen.sliding_window == 0, "{:?}", qwen.layer_kinds);
    let e = load(&config(json!({"model_type": "qwen2", "use_sliding_window": true}))).unwrap_err().to_string();
    assert!(e.contains("use_sliding_window"), "{e}");
    // Gemma 3 from Transformers 5's fields.
    let gemma = json!({
        "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    });
    let g = load(&config(gemma)).unwrap();
    assert_eq!(g.layer_kinds, vec![AttnKind::Sliding, AttnKind::Full]);
    assert_eq!((g.sliding_window, g.rope_theta, g.rope_local_theta, g.attn_scale()), (8, 1e6, Some(1e4), 0.25));
}

/// The config.json Transformers 5.24 writes for a Gemma 3 text model (scripts/hf-corpus.sh's
/// tiny one, with the 4B-27B's linear scaling on the global layers), field for field: it
/// loads with its window, layer types, query scale and per-kind RoPE; the same with
/// `use_bidirectional_attention: true` (EmbeddingGemma, an encoder) is refused by name,
/// where it used to load as a causal decoder and compute other numbers than Transformers.
#[test]
fn transformers5_gemma3_config_loads_and_bidirectional_attention_is_refused() {
    use ferrolm::config::AttnKind;
    let mut j = json!({
        "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": null, "dtype": "float32",
        "eos_token_id": 2, "final_logit_softcapping": null, "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 128, "initializer_range": 0.02, "intermediate_size": 320,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "max_position_embeddings": 4096, "model_type": "gemma3_text", "num_attention_heads": 4,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": null, "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-06, "rope_parameters": {
            "full_attention": {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 32, "tie_word_embeddings": true, "transformers_version": "5.24.0",
        "use_bidirectional_attention": false, "use_cache": true, "vocab_size": 49152
    });
    let c = load(&j).unwrap();
    use AttnKind::{Full, Sliding};
    assert_eq!(c.layer_kinds, vec![Sliding, Sliding, Full, Sliding]);
    assert_eq!((c.sliding_window, c.head_dim, c.attn_scale(), c.tie_embeddings), (32, 32, 0.125, true));
    assert_eq!((c.rope_theta, c.rope_linear, c.rope_local_theta), (1e6, 8.0, Some(1e4)));
    j["use_bidirectional_attention"] = json!(true);
    let err = load(&j).unwrap_err().to_string();
    assert!(err.contains("use_bidirectional_attention"), "{err}");
}

/// Transformers 5's Qwen2 config has no `attention_bias` (the q/k/v biases are implied),
/// no head_dim, `layer_types` all full, `sliding_window: null`, and any RoPE scaling only
/// in `rope_parameters`.
#[test]
fn transformers5_qwen2_config_loads() {
    let j = json!({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": null, "dtype": "float32",
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02,
        "intermediate_size": 320, "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"],
        "max_position_embeddings": 4096, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 4,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": null, "rms_norm_eps": 1e-06,
        "rope_parameters": {"factor": 4.0, "rope_theta": 1000000.0, "rope_type": "linear"}, "sliding_window": null,
        "tie_word_embeddings": false, "transformers_version": "5.24.0", "use_cache": true,
        "use_sliding_window": false, "vocab_size": 49152
    });
    let c = load(&j).unwrap();
    assert!(c.qkv_bias && !c.tie_embeddings && c.sliding_window == 0);
    assert!(c.layer_kinds.iter().all(|k| *k == ferrolm::config::AttnKind::Full));
    assert_eq!((c.head_dim, c.rope_theta, c.rope_linear), (32, 1e6, 4.0));
}
