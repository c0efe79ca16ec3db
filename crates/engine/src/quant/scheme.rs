//! Quantization schemes for `convert`, and [`apply`], which requantizes a [`ModelSource`].
//!
//! Scheme strings:
//! - `bf16`: every tensor dense bf16 (quantized ones dequantized, f32/f16 rounded to bf16;
//!   norms and biases too, as `mlx_lm.convert --dtype bfloat16` does).
//! - `B` or `B:gG` (B in 2,3,4,5,6,8; G in 16,32,64,128; default G = 64 as in mlx-lm):
//!   every matrix (embedding, projections, lm_head) affine at B bits, group G.
//! - `mixed:L,H` or `mixed:L,H:gG`: mlx-lm's `mixed_L_H` recipe (convert.py
//!   `mixed_quant_predicate_builder`, modelled on llama.cpp's Q4_K_M). With N layers, layer i
//!   "uses more bits" when `i < N/8 || i >= 7N/8 || (i − N/8) % 3 == 2` (integer division).
//!   At H bits: `v_proj` and `down_proj` of those layers, and `lm_head`; everything else at
//!   L bits. One addition: when the embeddings are tied, `embed_tokens` is the output head
//!   and gets H bits (as llama.cpp does for a tied `token_embd`; mlx-lm would give it L).
//!
//! In the quantizing schemes 1-D tensors (norms, biases) are left as they are. A dense matrix
//! is quantized with MLX's rule ([`AffineTensor::quantize`]) with scales in its own dtype:
//! f16/bf16 sources keep f16/bf16 scales, and f32 sources get f32 scales, as mlx-lm does
//! (it quantizes in the weight dtype and only casts when asked to with `--dtype`). A matrix
//! that is already affine at the target bits and group is kept bit for bit; at any other
//! target it is dequantized into its scale dtype (as mlx-lm's dequantize does) and requantized
//! with that scale dtype, which adds the new scheme's rounding error on top of the old one.

use super::affine::{check_scheme, get_q, round_to, BITS, GROUPS};
use super::{AffineTensor, DenseData, DenseTensor, ScaleDtype, Weight};
use crate::config::ModelConfig;
use crate::formats::safetensors::is_matrix_name;
use crate::formats::{names, ModelSource};
use crate::{Error, Result};
use half::bf16;
use rayon::prelude::*;

/// mlx-lm's default affine group size.
pub const DEFAULT_GROUP: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantScheme {
    Bf16,
    Uniform { bits: u32, group: usize },
    Mixed { low: u32, high: u32, group: usize },
}

impl std::str::FromStr for QuantScheme {
    type Err = Error;
    fn from_str(s: &str) -> Result<QuantScheme> {
        QuantScheme::parse(s)
    }
}

impl std::fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantScheme::Bf16 => write!(f, "bf16"),
            QuantScheme::Uniform { bits, group } => write!(f, "{bits}:g{group}"),
            QuantScheme::Mixed { low, high, group } => write!(f, "mixed:{low},{high}:g{group}"),
        }
    }
}

impl QuantScheme {
    /// Parse "bf16", "4", "8:g32", "mixed:4,8", "mixed:3,6:g32".
    pub fn parse(s: &str) -> Result<QuantScheme> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "quantization scheme {s:?}: {why} (expected bf16, B, B:gG or mixed:L,H[:gG] with B in 2,3,4,5,6,8 and G in 16,32,64,128)"
            ))
        };
        let t = s.trim();
        if t.eq_ignore_ascii_case("bf16") {
            return Ok(QuantScheme::Bf16);
        }
        let (body, group) = match t.rsplit_once(":g") {
            Some((b, g)) => (b, g.parse::<usize>().map_err(|_| bad("bad group"))?),
            None => (t, DEFAULT_GROUP),
        };
        if !GROUPS.contains(&group) {
            return Err(bad(&format!("group {group} is not supported")));
        }
        let bits = |x: &str| -> Result<u32> {
            let b = x.trim().parse::<u32>().map_err(|_| bad("bad bit width"))?;
            if BITS.contains(&b) {
                Ok(b)
            } else {
                Err(bad(&format!("{b} bits is not supported")))
            }
        };
        if let Some(pair) = body.strip_prefix("mixed:") {
            let (l, h) = pair.split_once(',').ok_or_else(|| bad("mixed needs L,H"))?;
            let (low, high) = (bits(l)?, bits(h)?);
            if low >= high {
                return Err(bad("mixed:L,H needs L < H"));
            }
            return Ok(QuantScheme::Mixed { low, high, group });
        }
        Ok(QuantScheme::Uniform { bits: bits(body)?, group })
    }

    /// The (bits, group) this scheme gives tensor `name`; `None` when it is left alone
    /// (1-D tensors, and everything under `bf16`, which converts rather than quantizes).
    pub fn target(&self, name: &str, cfg: &ModelConfig) -> Option<(u32, usize)> {
        if !is_matrix_name(name) {
            return None;
        }
        match *self {
            QuantScheme::Bf16 => None,
            QuantScheme::Uniform { bits, group } => Some((bits, group)),
            QuantScheme::Mixed { low, high, group } => {
                let hi = name == names::LM_HEAD
                    || (name == names::EMBED && cfg.tie_embeddings)
                    || layer_index(name).is_some_and(|i| {
                        (name.ends_with("self_attn.v_proj.weight") || name.ends_with("mlp.down_proj.weight"))
                            && uses_more_bits(i, cfg.n_layers)
                    });
                Some((if hi { high } else { low }, group))
            }
        }
    }
}

/// mlx-lm's `use_more_bits` for layer `i` of `n` (see the module doc).
pub fn uses_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

fn layer_index(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// Requantize every tensor of `src` to `scheme` in place (tensors in parallel).
pub fn apply(src: &mut ModelSource, scheme: &QuantScheme, progress: bool) -> Result<()> {
    let cfg = src.config.clone();
    let total: u64 = src.tensors.values().map(|w| w.byte_size() as u64).sum();
    let bar = crate::progress::bar(progress, total, "quantizing");
    let path = src.path.clone();
    src.tensors.par_iter_mut().try_for_each(|(name, w)| {
        let n = w.byte_size() as u64;
        convert_one(name, w, scheme, &cfg).map_err(|e| Error::format(&path, format!("tensor {name}: {e}")))?;
        bar.inc(n);
        Ok::<(), Error>(())
    })?;
    bar.finish_and_clear();
    Ok(())
}

fn convert_one(name: &str, w: &mut Weight, scheme: &QuantScheme, cfg: &ModelConfig) -> Result<()> {
    let (rows, cols) = (w.rows(), w.cols());
    if *scheme == QuantScheme::Bf16 {
        if !matches!(w, Weight::Dense(DenseTensor { data: DenseData::BF16(_), .. })) {
            let v = w.to_f32_vec();
            let data = DenseData::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect());
            *w = Weight::Dense(DenseTensor { rows, cols, data });
        }
        return Ok(());
    }
    let Some((bits, group)) = scheme.target(name, cfg) else {
        return Ok(());
    };
    check_scheme(bits, group, cols)
        .map_err(|e| Error::Invalid(format!("[{rows}, {cols}] cannot take {scheme}: {e}")))?;
    let dtype = match w {
        Weight::Affine(t) if t.bits == bits && t.group == group => return Ok(()),
        Weight::Affine(t) => t.scales.dtype(),
        Weight::Dense(d) => match d.data {
            DenseData::F32(_) => ScaleDtype::F32,
            DenseData::F16(_) => ScaleDtype::F16,
            DenseData::BF16(_) => ScaleDtype::BF16,
        },
    };
    let v = match w {
        Weight::Affine(t) => dequantize_like_mlx(t),
        Weight::Dense(d) => d.to_f32_vec(),
    };
    *w = Weight::Affine(AffineTensor::quantize(&v, rows, cols, bits, group, dtype)?);
    Ok(())
}

/// Dequantize as `mx.dequantize` does: in the scale dtype, rounding after the multiply and
/// after the add. Requantizing from these values (rather than exact f32 ones) makes our
/// output equal mlx-lm's dequantize → quantize bit for bit; the f32 values would put
/// min/max on the other side of a tie in some groups and flip the sign of their scale.
fn dequantize_like_mlx(t: &AffineTensor) -> Vec<f32> {
    let dtype = t.scales.dtype();
    let gpr = t.groups_per_row();
    let mut out = vec![0f32; t.rows * t.cols];
    for (r, row) in out.chunks_mut(t.cols).enumerate() {
        let words = t.row_words(r);
        for (i, x) in row.iter_mut().enumerate() {
            let g = r * gpr + i / t.group;
            let q = get_q(words, t.bits, i) as f32;
            let sq = round_to(t.scales.get(g) * q, dtype);
            *x = round_to(sq + t.biases.get(g), dtype);
        }
    }
    out
}
