//! Synthetic models: the exact shapes of real models with seeded random weights, so speed
//! and memory can be measured at sizes we cannot download. The output is gibberish; every
//! number measured on one must say it was measured on synthetic weights.
//!
//! How the weights are drawn (`scale` times a unit normal, rounded to bf16 as a bf16
//! checkpoint would be), so that activations look like a trained model's through every layer:
//! - `q/k/v/gate/up_proj`: N(0, 1/in): a unit-RMS input gives unit-RMS outputs.
//! - `o_proj`, `down_proj`: N(0, 1/in) · 0.5, a small residual-branch gain: each layer adds
//!   an update smaller than the stream, which grows steadily with depth to RMS ≈ 0.6·√L
//!   (2.4 at 16 layers, 3.4 at 32) instead of exploding or staying at the embedding's scale.
//! - `embed_tokens`: N(0, 0.02²), the usual initialization and about a trained model's scale.
//! - `lm_head`: N(0, (2.5/√hidden)²), and `model.norm` gains ≈ 1; with tied embeddings the
//!   final norm's gains are ≈ 2.5/(0.02·√hidden) instead. Either way the logits have std
//!   ≈ 2.5, a next-token entropy a few nats below uniform (peaked like a trained model's,
//!   neither uniform nor one-hot). Keeping the embedding small next to the grown residual
//!   matters for tied models: otherwise the input token's own logit (|e_t|²) wins and
//!   greedy decoding repeats the prompt's last token forever.
//! - norm gains: their centre times 1 + N(0, 0.02²); biases (no named shape has them)
//!   N(0, 0.02²). Gemma's shapes scale the embedding rows by √hidden, so theirs are drawn
//!   √hidden times smaller (the stream starts at the same 0.02), and their gain tensors
//!   hold the gain less 1 (Gemma's convention).
//!
//! Quantized schemes draw the same bf16 values and quantize them with MLX's rule, row
//! block by row block, straight into the packed form: the result is bit for bit what
//! `convert --quantize` would make of the `bf16` synthetic model, and no dense copy of a
//! whole tensor (let alone the model) is ever held. Drawing q values directly would be
//! faster, but this costs ≈ 10 ns of CPU per parameter, spread over every core (estimated:
//! about a second for a 1B model on 16 cores), and it gives the q histograms and scales of
//! real quantized weights.
//!
//! Determinism: value j of tensor `name` is a function of (seed, name, j) only: ChaCha8
//! keyed by the seed, stream = FNV-1a hash of the name, positioned at word 2j. Blocks are
//! drawn in parallel in any order and the bytes are the same on every machine and thread
//! count; the unit normal uses integer ops and one multiply (see [`unit_normal`]).

use super::safetensors::expected_shapes;
use super::{names, ModelSource, TensorMap, TokenizerSource};
use crate::config::{Arch, Llama3Scaling, ModelConfig};
use crate::quant::affine::{check_scheme, quantize_group, set_q};
use crate::quant::scheme::QuantScheme;
use crate::quant::{AffineTensor, DenseData, DenseTensor, ScaleDtype, Scales, Weight};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::path::PathBuf;

const NAMES: [&str; 8] = [
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "minicpm5-1b",
    "gemma-3-270m",
    "gemma-3-1b",
    "qwen3-0.6b",
];

/// Std of the logits the output head is scaled for (see the module doc).
const LOGIT_STD: f32 = 2.5;
/// Std of the token embeddings.
const EMBED_STD: f32 = 0.02;
/// Gain of the layers' output projections (o_proj, down_proj) over N(0, 1/in).
const BRANCH_GAIN: f32 = 0.5;
/// Relative std of the norm gains around their centre.
const GAIN_JITTER: f32 = 0.02;
/// Values per parallel work item: small enough to spread a tensor over every core and keep
/// per-thread scratch in cache, large enough that scheduling costs nothing.
const BLOCK_VALUES: usize = 1 << 16;

/// The synthetic model names, in the order of the docs.
pub fn names() -> &'static [&'static str] {
    &NAMES
}

/// The shape of synthetic model `name`; an error lists the known names.
pub fn config(name: &str) -> Result<ModelConfig> {
    let llama3 = |factor| {
        Some(Llama3Scaling { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192.0 })
    };
    let base = ModelConfig::default();
    let cfg = match name {
        // HuggingFaceTB/SmolLM2-135M(-Instruct)
        "smollm2-135m" => ModelConfig {
            hidden: 576,
            n_layers: 30,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
            max_ctx: 8192,
            rope_theta: 100000.0,
            tie_embeddings: true,
            ..base
        },
        // meta-llama/Llama-3.2-1B(-Instruct)
        "llama-3.2-1b" => ModelConfig {
            hidden: 2048,
            n_layers: 16,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 128256,
            max_ctx: 131072,
            rope_theta: 500000.0,
            llama3_scaling: llama3(32.0),
            tie_embeddings: true,
            ..base
        },
        // meta-llama/Llama-3.1-8B(-Instruct)
        "llama-3.1-8b" => ModelConfig {
            hidden: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            vocab: 128256,
            max_ctx: 131072,
            rope_theta: 500000.0,
            llama3_scaling: llama3(8.0),
            ..base
        },
        // meta-llama/Llama-3.1-70B(-Instruct): tensor parallelism's large shape
        "llama-3.1-70b" => ModelConfig {
            hidden: 8192,
            n_layers: 80,
            n_heads: 64,
            n_kv_heads: 8,
            head_dim: 128,
            ffn: 28672,
            vocab: 128256,
            max_ctx: 131072,
            rope_theta: 500000.0,
            llama3_scaling: llama3(8.0),
            ..base
        },
        // google/gemma-3-270m(-it) and google/gemma-3-1b(-it)
        "gemma-3-270m" => gemma3(640, 18, 2048),
        "gemma-3-1b" => gemma3(1152, 26, 6912),
        // Qwen/Qwen3-0.6B
        "qwen3-0.6b" => ModelConfig {
            arch: Arch::Qwen3,
            hidden: 1024,
            n_layers: 28,
            n_heads: 16,
            n_kv_heads: 8,
            head_dim: 128,
            ffn: 3072,
            vocab: 151936,
            max_ctx: 40960,
            rms_eps: 1e-6,
            rope_theta: 1000000.0,
            tie_embeddings: true,
            qk_norm: true,
            ..base
        },
        // MiniCPM5 1B: a plain Llama.
        "minicpm5-1b" => ModelConfig {
            hidden: 1536,
            n_layers: 24,
            n_heads: 16,
            n_kv_heads: 2,
            head_dim: 128,
            ffn: 4608,
            vocab: 130560,
            max_ctx: 32768,
            rms_eps: 1e-6,
            rope_theta: 5000000.0,
            ..base
        },
        other => {
            return Err(Error::Invalid(format!("unknown synthetic model {other:?} (known: {})", NAMES.join(", "))))
        }
    };
    Ok(cfg)
}

/// A Gemma 3 text shape: 4 query heads and 1 kv head of 256, a 262 144-token tied
/// vocabulary, 32K context, RoPE bases 1e6 and (sliding layers) 1e4, windows of 512.
fn gemma3(hidden: usize, n_layers: usize, ffn: usize) -> ModelConfig {
    ModelConfig {
        hidden,
        n_layers,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
        ffn,
        vocab: 262144,
        max_ctx: 32768,
        rms_eps: 1e-6,
        rope_theta: 1000000.0,
        tie_embeddings: true,
        ..ModelConfig::default()
    }
    .gemma3(512, Some(256.0))
}

/// Synthetic model `name` with every matrix in `scheme` (see the module doc).
pub fn build(name: &str, scheme: &QuantScheme, seed: u64, progress: bool) -> Result<ModelSource> {
    build_config(name, &config(name)?, scheme, seed, progress)
}

/// Random weights for any Llama-family shape, recorded as synthetic model `label` (tests use
/// reduced variants of the named shapes). Tensors present in both `cfg` and a variant of it
/// with fewer layers are identical: values depend on the tensor's name, not on the model.
pub fn build_config(
    label: &str,
    cfg: &ModelConfig,
    scheme: &QuantScheme,
    seed: u64,
    progress: bool,
) -> Result<ModelSource> {
    let path = PathBuf::from(format!("synthetic:{label}"));
    cfg.validate(&path.display().to_string())?;
    let shapes: Vec<(String, Vec<usize>)> =
        expected_shapes(cfg).into_iter().filter(|(name, _)| !(cfg.tie_embeddings && name == names::LM_HEAD)).collect();
    let total: u64 = shapes.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
    let bar = crate::progress::bar(progress, total, "generating");
    // Tensors in parallel, and blocks of rows within each (nested rayon): big tensors keep
    // every core busy, small ones do not wait for each other.
    let made: Vec<(String, Weight)> = shapes
        .into_par_iter()
        .map(|(name, shape)| {
            let (rows, cols) = if let [r, c] = shape[..] { (r, c) } else { (1, shape.iter().product()) };
            let spec = Spec { name: &name, rows, cols, dist: dist(&name, rows, cols, cfg), seed };
            let w = match scheme.target(&name, cfg) {
                Some((bits, group)) => spec.affine(bits, group),
                None => Ok(spec.dense()),
            }
            .map_err(|e| Error::Invalid(format!("{}: tensor {name} [{rows}, {cols}]: {e}", path.display())))?;
            bar.inc((rows * cols) as u64);
            Ok((name, w))
        })
        .collect::<Result<_>>()?;
    bar.finish_and_clear();
    let tensors: TensorMap = made.into_iter().collect();
    let file_bytes = tensors.values().map(|w| w.byte_size() as u64).sum();
    Ok(ModelSource {
        path,
        format: "synthetic",
        config: cfg.clone(),
        tensors,
        tokenizer: TokenizerSource::Synthetic { vocab: cfg.vocab },
        // Nothing is on disk; this is what writing it would take.
        file_bytes,
        synthetic: Some(label.to_string()),
        tokenizer_vocab: None,
    })
}

/// SmolLM2's tokenizer (from the default model's GGUF, fetched on first use) with its chat
/// template, padded to `vocab` ids with `<|synthetic_N|>` entries ([`pad_tokenizer`]).
pub fn tokenizer(vocab: usize) -> Result<Tokenizer> {
    let path = crate::hub::default_model()?;
    let base = Tokenizer::from_gguf(&super::gguf::GgufFile::open(&path)?)?;
    pad_tokenizer(&base, vocab)
}

/// `base` padded to `vocab` ids; id i ≥ base's size is spelled `<|synthetic_i|>`.
pub fn pad_tokenizer(base: &Tokenizer, vocab: usize) -> Result<Tokenizer> {
    base.padded(vocab, |i| format!("<|synthetic_{i}|>"))
}

/// What a tensor's values are drawn from.
#[derive(Clone, Copy)]
enum Dist {
    /// N(0, std²)
    Normal(f32),
    /// centre · (1 + N(0, GAIN_JITTER²)) − offset (offset 1 for Gemma's gains, stored as w
    /// for a gain of 1 + w)
    Gain(f32, f32),
}

fn dist(name: &str, rows: usize, cols: usize, cfg: &ModelConfig) -> Dist {
    let fan_in = 1.0 / (cols as f32).sqrt();
    let offset = if cfg.norm_plus_one { 1.0 } else { 0.0 };
    // Gemma multiplies the embedding rows by √hidden: draw them that much smaller, so the
    // stream starts at EMBED_STD as in every other shape.
    let embed_std = EMBED_STD / cfg.embed_scale;
    if name == names::NORM && cfg.tie_embeddings {
        // The head is the embedding: scale its input so the logits still have LOGIT_STD.
        Dist::Gain(LOGIT_STD / (embed_std * (cfg.hidden as f32).sqrt()), offset)
    } else if name.ends_with(".bias") {
        // q/k/v biases (Qwen2-style shapes): small, like the embeddings.
        Dist::Normal(EMBED_STD)
    } else if rows == 1 {
        Dist::Gain(1.0, offset)
    } else if name == names::EMBED {
        Dist::Normal(embed_std)
    } else if name == names::LM_HEAD {
        Dist::Normal(LOGIT_STD * fan_in)
    } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        Dist::Normal(BRANCH_GAIN * fan_in)
    } else {
        Dist::Normal(fan_in)
    }
}

/// ≈ N(0, 1) from 64 random bits: the sum of four 16-bit uniforms (Irwin–Hall, n = 4),
/// centred and scaled to unit variance. Integer adds and one f32 multiply, so it is the same
/// on every machine (Box–Muller's ln/cos are not correctly rounded and differ between
/// libms). The shape is close to normal (kurtosis 2.7 vs 3) with tails cut at ±3.46σ.
#[inline]
fn unit_normal(bits: u64) -> f32 {
    // Mean 4 · 65535/2; variance 4 · (65536² − 1)/12, std 37837.227.
    const INV_STD: f32 = 1.0 / 37837.227;
    let s = (bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) + (bits >> 48);
    // s < 2^18: exact in f32, as is the subtraction; one rounding in the multiply.
    (s as f32 - 131070.0) * INV_STD
}

/// FNV-1a, 64-bit: a fixed hash (std's hashers may change between releases).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// One tensor to generate.
struct Spec<'a> {
    name: &'a str,
    rows: usize,
    cols: usize,
    dist: Dist,
    seed: u64,
}

impl Spec<'_> {
    /// Rows per work item.
    fn block_rows(&self) -> usize {
        (BLOCK_VALUES / self.cols).max(1)
    }

    /// Values from flat index `first` on into `out`, rounded to bf16 (kept as f32).
    fn fill(&self, first: usize, out: &mut [f32]) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(fnv1a(self.name));
        // Each value takes one u64 = two 32-bit words of the stream.
        rng.set_word_pos(2 * first as u128);
        let (mean, std) = match self.dist {
            Dist::Normal(s) => (0.0, s),
            Dist::Gain(c, offset) => (c - offset, c * GAIN_JITTER),
        };
        // In batches: a bulk fill is a copy out of ChaCha's buffer, next_u64 a branch per value.
        let mut buf = [0u64; 256];
        for chunk in out.chunks_mut(buf.len()) {
            let bits = &mut buf[..chunk.len()];
            rng.fill(bits);
            for (x, &b) in chunk.iter_mut().zip(bits.iter()) {
                *x = bf16::from_f32(mean + std * unit_normal(b)).to_f32();
            }
        }
    }

    /// Dense bf16.
    fn dense(&self) -> Weight {
        let (rows, cols) = (self.rows, self.cols);
        let br = self.block_rows();
        let mut data = vec![bf16::ZERO; rows * cols];
        data.par_chunks_mut(br * cols).enumerate().for_each(|(b, chunk)| {
            let mut vals = vec![0f32; chunk.len()];
            self.fill(b * br * cols, &mut vals);
            chunk.iter_mut().zip(&vals).for_each(|(o, &v)| *o = bf16::from_f32(v));
        });
        Weight::Dense(DenseTensor { rows, cols, data: DenseData::BF16(data) })
    }

    /// Affine at (bits, group) with bf16 scales: [`AffineTensor::quantize`] of the bf16
    /// values, done a block of rows at a time.
    fn affine(&self, bits: u32, group: usize) -> Result<Weight> {
        let (rows, cols) = (self.rows, self.cols);
        check_scheme(bits, group, cols)?;
        let (wpr, gpr, br) = (cols * bits as usize / 32, cols / group, self.block_rows());
        let mut packed = vec![0u32; rows * wpr];
        let mut scales = vec![bf16::ZERO; rows * gpr];
        let mut biases = vec![bf16::ZERO; rows * gpr];
        packed
            .par_chunks_mut(br * wpr)
            .zip(scales.par_chunks_mut(br * gpr))
            .zip(biases.par_chunks_mut(br * gpr))
            .enumerate()
            .for_each(|(b, ((words, sc), bi))| {
                let n = words.len() / wpr;
                let mut vals = vec![0f32; n * cols];
                let mut q = vec![0u32; group];
                self.fill(b * br * cols, &mut vals);
                for (r, (row, words)) in vals.chunks(cols).zip(words.chunks_mut(wpr)).enumerate() {
                    for (g, v) in row.chunks(group).enumerate() {
                        let (s, o) = quantize_group(v, bits, ScaleDtype::BF16, &mut q);
                        sc[r * gpr + g] = bf16::from_f32(s);
                        bi[r * gpr + g] = bf16::from_f32(o);
                        for (j, &qv) in q.iter().enumerate() {
                            set_q(words, bits, g * group + j, qv);
                        }
                    }
                }
            });
        Ok(Weight::Affine(AffineTensor::new(
            rows,
            cols,
            bits,
            group,
            packed,
            Scales::BF16(scales),
            Scales::BF16(biases),
        )?))
    }
}
