//! Hugging Face and MLX safetensors directories → [`ModelSource`].
//!
//! A directory holds `config.json` and the weights: the shards named by
//! `model.safetensors.index.json` when it exists, else every `model*.safetensors` (the glob
//! mlx-lm uses, so a stray `consolidated.safetensors` next to them is not read twice). Files
//! are memory-mapped; each tensor is converted on its own and its pages released right away,
//! so peak memory stays near one model size.
//!
//! MLX quantized checkpoints store a quantized linear or embedding `<m>` as `<m>.weight`
//! (u32, `[out, in·bits/32]`), `<m>.scales` and `<m>.biases` (`[out, in/group]`, in the
//! weight dtype), described by config.json `quantization` (or `quantization_config`):
//! `{"group_size": 64, "bits": 4, "mode": "affine", "<m>": {"group_size": g, "bits": b} | false}`.
//! As in mlx-lm, a module is quantized exactly when `<m>.scales` exists; its bits/group come
//! from its override, else the default.

use super::{names, ModelSource, TensorMap, TokenizerSource};
use crate::config::ModelConfig;
use crate::quant::affine::check_scheme;
use crate::quant::{AffineTensor, DenseData, DenseTensor, Scales, Weight};
use crate::{Error, Result};
use ::safetensors::tensor::TensorView;
use ::safetensors::{Dtype, SafeTensors};
use memmap2::Mmap;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// config.json key that marks a directory's weights as synthetic (random), naming the
/// shape they were drawn for; written by the MLX writer, read back into `ModelSource::synthetic`.
pub const SYNTHETIC_KEY: &str = "ferrolm_synthetic";

/// `(bits, group)` of an affine tensor.
pub type QuantParams = (u32, usize);

/// config.json `quantization`: the default and per-module overrides (`None` = left dense).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantConfig {
    pub default: Option<QuantParams>,
    /// Keyed by module path, e.g. "model.layers.0.mlp.down_proj" or "lm_head".
    pub overrides: BTreeMap<String, Option<QuantParams>>,
}

impl QuantConfig {
    /// Read `quantization` (or `quantization_config`) from a parsed config.json; `None` when
    /// the checkpoint is not quantized. Non-MLX schemes (GPTQ, AWQ, fp8…) are unsupported.
    pub fn from_config(j: &Value, file: &Path) -> Result<Option<QuantConfig>> {
        let q = match (j.get("quantization"), j.get("quantization_config")) {
            (Some(q), _) if !q.is_null() => q,
            (_, Some(q)) if !q.is_null() => {
                if let Some(m) = q.get("quant_method") {
                    return Err(Error::Unsupported(format!(
                        "{}: quantization_config.quant_method {m} (only MLX affine checkpoints load)",
                        file.display()
                    )));
                }
                q
            }
            _ => return Ok(None),
        };
        let obj =
            q.as_object().ok_or_else(|| Error::format(file, format!("quantization: expected an object, got {q}")))?;
        let default = if obj.contains_key("bits") || obj.contains_key("group_size") {
            Some(params(q, "quantization", file, MLX_AFFINE_DEFAULT)?)
        } else {
            check_mode(q, "quantization", file)?;
            None
        };
        // Per-module entries that leave bits or group_size null (mlx-lm's mixed predicates
        // write `"group_size": null`) take the checkpoint's default.
        let inherit = default.unwrap_or(MLX_AFFINE_DEFAULT);
        let mut overrides = BTreeMap::new();
        for (k, v) in obj {
            if matches!(k.as_str(), "bits" | "group_size" | "mode") {
                continue;
            }
            let p = match v {
                Value::Bool(false) => None,
                Value::Object(_) => Some(params(v, &format!("quantization.{k}"), file, inherit)?),
                // Unknown scalar keys (e.g. a future flag) do not name a module; skip them.
                _ => continue,
            };
            overrides.insert(canonical_name(k).unwrap_or_else(|| k.clone()), p);
        }
        Ok(Some(QuantConfig { default, overrides }))
    }

    /// The JSON object mlx-lm writes: default params plus one entry per override.
    pub fn to_json(&self) -> Value {
        let p = |(bits, group): QuantParams| json!({"group_size": group, "bits": bits, "mode": "affine"});
        let mut m = match self.default.map(p) {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        for (k, v) in &self.overrides {
            m.insert(k.clone(), v.map(p).unwrap_or(Value::Bool(false)));
        }
        Value::Object(m)
    }
}

/// mlx-lm's affine defaults (bits, group), for a `quantization` block whose fields are
/// null or absent.
const MLX_AFFINE_DEFAULT: QuantParams = (4, 64);

/// A `mode` other than affine (mxfp4, nvfp4, …) is refused, naming the module.
fn check_mode(v: &Value, field: &str, file: &Path) -> Result<()> {
    match v.get("mode") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if m == "affine" => Ok(()),
        Some(m) => Err(Error::Unsupported(format!(
            "{}: {field}.mode {m} is not supported (ferrolm loads affine quantization only)",
            file.display()
        ))),
    }
}

/// `{"group_size": g, "bits": b, "mode"?: "affine"}` → (b, g), a null or absent field
/// taking `inherit`'s; errors name `field`.
fn params(v: &Value, field: &str, file: &Path, inherit: QuantParams) -> Result<QuantParams> {
    check_mode(v, field, file)?;
    let get = |k: &str, d: u64| match v.get(k) {
        None | Some(Value::Null) => Ok(d),
        Some(x) => x.as_u64().ok_or_else(|| Error::format(file, format!("{field}.{k}: {x} is not an integer"))),
    };
    Ok((get("bits", u64::from(inherit.0))? as u32, get("group_size", inherit.1 as u64)? as usize))
}

/// Canonical name for a checkpoint name; `None` for tensors to drop (precomputed RoPE
/// frequencies, which the model recomputes). Vision-language checkpoints nest the text
/// model under `language_model.`; strip that so the names match a plain causal LM.
pub fn canonical_name(raw: &str) -> Option<String> {
    if raw.contains("rotary_emb.inv_freq") {
        return None;
    }
    if let Some(rest) = raw.strip_prefix("language_model.") {
        return Some(rest.to_string());
    }
    if let Some(rest) = raw.strip_prefix("model.language_model.") {
        return Some(format!("model.{rest}"));
    }
    Some(raw.to_string())
}

/// True for the 2-D weights that quantization applies to (embedding, projections, head).
pub fn is_matrix_name(name: &str) -> bool {
    name == names::EMBED || name == names::LM_HEAD || name.ends_with("_proj.weight")
}

/// Every tensor a model with this config has, with its safetensors shape (`lm_head.weight`
/// included; the loader treats it as optional).
pub fn expected_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv) = (cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
    let mut v = vec![(names::EMBED.to_string(), vec![cfg.vocab, h])];
    for i in 0..cfg.n_layers {
        let l = |s: &str| names::layer(i, s);
        v.push((l("input_layernorm.weight"), vec![h]));
        v.push((l("self_attn.q_proj.weight"), vec![q, h]));
        v.push((l("self_attn.k_proj.weight"), vec![kv, h]));
        v.push((l("self_attn.v_proj.weight"), vec![kv, h]));
        if cfg.qkv_bias {
            v.push((l("self_attn.q_proj.bias"), vec![q]));
            v.push((l("self_attn.k_proj.bias"), vec![kv]));
            v.push((l("self_attn.v_proj.bias"), vec![kv]));
        }
        if cfg.qk_norm {
            v.push((l("self_attn.q_norm.weight"), vec![cfg.head_dim]));
            v.push((l("self_attn.k_norm.weight"), vec![cfg.head_dim]));
        }
        v.push((l("self_attn.o_proj.weight"), vec![h, q]));
        v.push((l("post_attention_layernorm.weight"), vec![h]));
        if cfg.post_norms {
            v.push((l("pre_feedforward_layernorm.weight"), vec![h]));
            v.push((l("post_feedforward_layernorm.weight"), vec![h]));
        }
        v.push((l("mlp.gate_proj.weight"), vec![cfg.ffn, h]));
        v.push((l("mlp.up_proj.weight"), vec![cfg.ffn, h]));
        v.push((l("mlp.down_proj.weight"), vec![h, cfg.ffn]));
    }
    v.push((names::NORM.to_string(), vec![h]));
    v.push((names::LM_HEAD.to_string(), vec![cfg.vocab, h]));
    v
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// A tensor found in a shard, not yet converted.
struct Raw<'a> {
    shard: usize,
    view: TensorView<'a>,
}

/// Open a Hugging Face or MLX model directory.
pub fn load_dir(dir: &Path, progress: bool) -> Result<ModelSource> {
    let config_path = dir.join("config.json");
    if !config_path.exists() {
        return Err(Error::format(dir, "config.json is missing"));
    }
    let mut config = ModelConfig::from_hf_json(&config_path)?;
    let cfg_json: Value = serde_json::from_str(&crate::files::read_text(&config_path)?)
        .map_err(|e| Error::format(&config_path, format!("invalid JSON: {e}")))?;
    let quant = QuantConfig::from_config(&cfg_json, &config_path)?;
    let synthetic = match cfg_json.get(SYNTHETIC_KEY) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(Error::format(&config_path, format!("{SYNTHETIC_KEY}: expected a model name, found {other}")))
        }
    };

    let (files, index) = weight_files(dir)?;
    let mut shards = Vec::with_capacity(files.len());
    for path in files {
        let f = crate::files::open(&path)?;
        // SAFETY: read-only private mapping; the checkpoint must not be modified while loading.
        let mmap = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&path, e))?;
        shards.push(Shard { path, mmap });
    }
    let mut parsed = Vec::with_capacity(shards.len());
    for s in &shards {
        parsed.push(
            SafeTensors::deserialize(&s.mmap)
                .map_err(|e| Error::format(&s.path, format!("invalid safetensors file: {e}")))?,
        );
    }
    let mut raw: HashMap<String, Raw> = HashMap::new();
    for (i, st) in parsed.iter().enumerate() {
        for (name, view) in st.tensors() {
            let Some(canon) = canonical_name(&name) else {
                continue;
            };
            if let Some(prev) = raw.insert(canon.clone(), Raw { shard: i, view }) {
                return Err(Error::format(
                    &shards[i].path,
                    format!("tensor {canon} also appears in {}", shards[prev.shard].path.display()),
                ));
            }
        }
    }
    if let Some(index) = index {
        check_index(dir, &index, &raw, &shards)?;
    }

    let total: u64 = shards.iter().map(|s| s.mmap.len() as u64).sum();
    let bar = crate::progress::bar(progress, total, "loading");
    let mut tensors = TensorMap::new();
    let mut take = |name: &str| -> Option<Raw> {
        let r = raw.remove(name)?;
        bar.inc(r.view.data().len() as u64);
        Some(r)
    };
    let mut lm_head_present = false;
    for (name, shape) in expected_shapes(&config) {
        let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        let weight = take(&name);
        let (scales, biases) = if shape.len() == 2 {
            (take(&format!("{module}.scales")), take(&format!("{module}.biases")))
        } else {
            (None, None)
        };
        if name == names::LM_HEAD {
            lm_head_present = weight.is_some();
            // A tied model's head is the embedding; mlx-lm drops a stored copy the same way.
            if config.tie_embeddings || weight.is_none() {
                continue;
            }
        }
        let Some(weight) = weight else {
            return Err(Error::format(dir, format!("tensor {name} is missing")));
        };
        let path = &shards[weight.shard].path;
        let w = match (scales, biases) {
            (None, None) => {
                if let Some(Some(_)) = quant.as_ref().and_then(|q| q.overrides.get(&module)) {
                    return Err(Error::format(
                        path,
                        format!("config.json quantizes {module} but {module}.scales is missing"),
                    ));
                }
                dense(&weight.view, &shape).map_err(|m| tensor_err(path, &name, m))?
            }
            (Some(s), Some(b)) => {
                let p = quant.as_ref().and_then(|q| q.overrides.get(&module).copied().unwrap_or(q.default));
                let Some(p) = p else {
                    return Err(Error::format(
                        path,
                        format!("{module} is quantized but config.json gives it no bits/group_size (quantization.{module} or a default)"),
                    ));
                };
                affine(&weight.view, &s.view, &b.view, &shape, p).map_err(|m| tensor_err(path, &name, m))?
            }
            (Some(_), None) => return Err(Error::format(path, format!("tensor {module}.biases is missing"))),
            (None, Some(_)) => return Err(Error::format(path, format!("tensor {module}.scales is missing"))),
        };
        release(&shards[weight.shard].mmap, weight.view.data());
        tensors.insert(name, w);
    }
    if !lm_head_present {
        config.tie_embeddings = true;
    }
    if !raw.is_empty() {
        let mut left: Vec<(&String, &Raw)> = raw.iter().collect();
        left.sort_by(|a, b| a.0.cmp(b.0));
        let list: Vec<&str> = left.iter().take(5).map(|(n, _)| n.as_str()).collect();
        return Err(Error::format(
            &shards[left[0].1.shard].path,
            format!("unexpected tensor(s) for this config: {} ({} in all)", list.join(", "), left.len()),
        ));
    }
    bar.finish_and_clear();
    let quantized = tensors.values().any(|w| matches!(w, Weight::Affine(_)));
    Ok(ModelSource {
        path: dir.to_path_buf(),
        format: if quantized || quant.is_some() { "mlx" } else { "hf" },
        config,
        tensors,
        tokenizer: TokenizerSource::Dir(dir.to_path_buf()),
        file_bytes: total,
        synthetic,
        tokenizer_vocab: None,
    })
}

fn tensor_err(path: &Path, name: &str, msg: String) -> Error {
    Error::format(path, format!("tensor {name}: {msg}"))
}

/// The weight files and, for sharded checkpoints, the index's tensor → file map.
#[allow(clippy::type_complexity)]
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<BTreeMap<String, String>>)> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.is_file() {
        let text = crate::files::read_text(&index_path)?;
        let j: Value =
            serde_json::from_str(&text).map_err(|e| Error::format(&index_path, format!("invalid JSON: {e}")))?;
        let map = j
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::format(&index_path, "weight_map: missing or not an object"))?;
        let mut index = BTreeMap::new();
        for (k, v) in map {
            let f = v.as_str().ok_or_else(|| Error::format(&index_path, format!("weight_map.{k}: not a file name")))?;
            index.insert(k.clone(), f.to_string());
        }
        let mut files: Vec<String> = index.values().cloned().collect();
        files.sort();
        files.dedup();
        let mut paths = Vec::with_capacity(files.len());
        for f in files {
            let p = shard_path(dir, &f, &index_path)?;
            if !p.is_file() {
                return Err(Error::format(&index_path, format!("shard {f} is listed but missing")));
            }
            paths.push(p);
        }
        return Ok((paths, Some(index)));
    }
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut paths = Vec::new();
    for e in rd {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("model") && name.ends_with(".safetensors") {
            paths.push(e.path());
        }
    }
    if paths.is_empty() {
        return Err(Error::format(dir, "no model*.safetensors files (and no model.safetensors.index.json)"));
    }
    paths.sort();
    Ok((paths, None))
}

/// A shard the index names, inside the model directory: a plain file name (no directory,
/// `..` or absolute path), so that a hostile index cannot make ferrolm read other files.
/// (Symlinked shards, as the Hugging Face cache makes them, are fine: only the name counts.)
fn shard_path(dir: &Path, name: &str, index_path: &Path) -> Result<PathBuf> {
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(_)), None) => Ok(dir.join(name)),
        _ => Err(Error::format(
            index_path,
            format!("weight_map names the shard {name:?}, which is not a file name in the model directory"),
        )),
    }
}

/// Every tensor the index lists must be in the file it names (a stale index is an error,
/// not a silent mix of two checkpoints).
fn check_index(
    dir: &Path,
    index: &BTreeMap<String, String>,
    raw: &HashMap<String, Raw>,
    shards: &[Shard],
) -> Result<()> {
    for (name, file) in index {
        let Some(canon) = canonical_name(name) else {
            continue;
        };
        let found = raw.get(&canon).map(|r| &shards[r.shard].path);
        if found != Some(&dir.join(file)) {
            return Err(Error::format(
                dir.join("model.safetensors.index.json"),
                format!("tensor {name} is listed in {file} but is not there"),
            ));
        }
    }
    Ok(())
}

/// Tell the kernel we are done with a tensor's pages (see `GgufFile::release`).
fn release(mmap: &Mmap, data: &[u8]) {
    let page = 4096;
    let start = data.as_ptr() as usize - mmap.as_ptr() as usize;
    let s = start.div_ceil(page) * page;
    let e = (start + data.len()) / page * page;
    if e > s {
        // SAFETY: private read-only file mapping; dropped pages are re-read from the file.
        let _ = unsafe { mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, s, e - s) };
    }
}

fn dense(v: &TensorView, shape: &[usize]) -> std::result::Result<Weight, String> {
    if v.shape() != shape {
        return Err(format!("shape {:?}, expected {shape:?}", v.shape()));
    }
    let (rows, cols) = match shape {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => return Err(format!("unexpected rank {}", shape.len())),
    };
    let b = v.data();
    let data = match v.dtype() {
        Dtype::F32 => DenseData::F32(bytemuck::pod_collect_to_vec(b)),
        Dtype::F16 => DenseData::F16(bytemuck::pod_collect_to_vec(b)),
        Dtype::BF16 => DenseData::BF16(bytemuck::pod_collect_to_vec(b)),
        d => return Err(format!("dtype {d:?} (expected F32, F16 or BF16)")),
    };
    Ok(Weight::Dense(DenseTensor { rows, cols, data }))
}

fn scales(v: &TensorView, what: &str, shape: &[usize]) -> std::result::Result<Scales, String> {
    if v.shape() != shape {
        return Err(format!("{what} shape {:?}, expected {shape:?}", v.shape()));
    }
    let b = v.data();
    Ok(match v.dtype() {
        Dtype::F32 => Scales::F32(bytemuck::pod_collect_to_vec(b)),
        Dtype::F16 => Scales::F16(bytemuck::pod_collect_to_vec(b)),
        Dtype::BF16 => Scales::BF16(bytemuck::pod_collect_to_vec(b)),
        d => return Err(format!("{what} dtype {d:?} (expected F32, F16 or BF16)")),
    })
}

fn affine(
    w: &TensorView,
    s: &TensorView,
    b: &TensorView,
    shape: &[usize],
    (bits, group): QuantParams,
) -> std::result::Result<Weight, String> {
    let (rows, cols) = (shape[0], shape[1]);
    check_scheme(bits, group, cols).map_err(|e| format!("{bits}-bit g{group}: {e}"))?;
    let packed_shape = [rows, cols * bits as usize / 32];
    if w.dtype() != Dtype::U32 || w.shape() != packed_shape {
        return Err(format!(
            "quantized weight is {:?} {:?}, expected U32 {packed_shape:?} for [{rows}, {cols}] at {bits} bits",
            w.dtype(),
            w.shape()
        ));
    }
    let gshape = [rows, cols / group];
    let sc = scales(s, "scales", &gshape)?;
    let bi = scales(b, "biases", &gshape)?;
    if sc.dtype() != bi.dtype() {
        return Err(format!("scales are {} but biases are {}", sc.dtype().name(), bi.dtype().name()));
    }
    let packed = bytemuck::pod_collect_to_vec(w.data());
    AffineTensor::new(rows, cols, bits, group, packed, sc, bi).map(Weight::Affine).map_err(|e| e.to_string())
}
