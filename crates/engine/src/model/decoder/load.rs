//! Loading a decoder's weights: each tensor handed to the backend with what it is to
//! tensor parallelism (a tensor-parallel backend cuts each rank's part from it there).

use super::{Decoder, Layer};
use crate::backend::{Backend, MatKind, Rope, Width};
use crate::config::ModelConfig;
use crate::formats::{names, ModelSource};
use crate::model::shard::FFN_UNIT;
use crate::quant::Weight;
use crate::{Error, Result};

fn vector(w: Weight, name: &str, len: usize, src: &ModelSource) -> Result<Vec<f32>> {
    let v = w.to_f32_vec();
    if v.len() != len {
        return Err(Error::format(&src.path, format!("tensor {name}: {} values, expected {len}", v.len())));
    }
    Ok(v)
}

/// The first `rows` rows of the head (the embedding when tied) of shape `shape`: a padded
/// vocabulary's scored part.
fn padded_head(src: &ModelSource, tied: bool, rows: usize, (vocab, d): (usize, usize)) -> Result<Weight> {
    let name = if tied { names::EMBED } else { names::LM_HEAD };
    let w = src.tensors.get(name).ok_or_else(|| Error::format(&src.path, format!("tensor {name} is missing")))?;
    if (w.rows(), w.cols()) != (vocab, d) {
        return Err(Error::format(
            &src.path,
            format!("tensor {name}: shape [{}, {}], expected [{vocab}, {d}]", w.rows(), w.cols()),
        ));
    }
    w.first_rows(rows)
}

/// Takes a model's weights out of its source and hands them to the backend, each with
/// what it is to tensor parallelism (`MatKind`), counting the bytes a decode step reads:
/// every matrix once (the embedding table only when it is also the head), norm gains aside.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    cfg: &'a ModelConfig,
    read: usize,
    /// Whether the embedding table is read whole per step (it is the head).
    embed_is_head: bool,
}

impl<B: Backend> Loader<'_, B> {
    fn mat(
        &mut self,
        src: &mut ModelSource,
        name: &str,
        (rows, cols): (usize, usize),
        kind: MatKind,
    ) -> Result<B::Mat> {
        let w = src.take(name)?;
        if name != names::EMBED || self.embed_is_head {
            self.read += w.byte_size();
        }
        if w.rows() != rows || w.cols() != cols {
            return Err(Error::format(
                &src.path,
                format!("tensor {name}: shape [{}, {}], expected [{rows}, {cols}]", w.rows(), w.cols()),
            ));
        }
        self.backend.matrix_as(w, kind).map_err(|e| match e {
            Error::Unsupported(m) => Error::Unsupported(format!("tensor {name}: {m}")),
            e => e,
        })
    }

    /// A 1-D weight; norm gains as applied (Gemma's tensors hold w for a gain of 1 + w).
    fn vec(&self, src: &mut ModelSource, name: &str, len: usize, width: Width) -> Result<B::Vector> {
        let w = src.take(name)?;
        let mut v = vector(w, name, len, src)?;
        if self.cfg.norm_plus_one && name.ends_with("norm.weight") {
            v.iter_mut().for_each(|g| *g += 1.0);
        }
        self.backend.vector_as(v, width)
    }

    /// The output projection's unit: whole heads, as few as its quantization allows a cut
    /// between.
    fn head_unit(&self, src: &ModelSource, name: &str) -> usize {
        let hd = self.cfg.head_dim;
        let cols = self.cfg.n_heads * hd;
        let w = src.tensors.get(name);
        (1..=self.cfg.n_heads)
            .map(|k| k * hd)
            .find(|&u| u == cols || (cols.is_multiple_of(u) && w.is_none_or(|w| w.cuts_at(u))))
            .unwrap_or(cols)
    }

    fn layer(&mut self, src: &mut ModelSource, i: usize) -> Result<Layer<B>> {
        let c = self.cfg;
        let (d, hd, f) = (c.hidden, c.head_dim, c.ffn);
        let (qd, kvd) = (c.n_heads * hd, c.n_kv_heads * hd);
        let n = |s: &str| names::layer(i, s);
        use MatKind::{Cols, Rows};
        use Width::{Ffn, Heads, KvHeads, Model};
        let bias = match c.qkv_bias {
            true => Some([
                self.vec(src, &n("self_attn.q_proj.bias"), qd, Heads)?,
                self.vec(src, &n("self_attn.k_proj.bias"), kvd, KvHeads)?,
                self.vec(src, &n("self_attn.v_proj.bias"), kvd, KvHeads)?,
            ]),
            false => None,
        };
        let qk_norm = match c.qk_norm {
            true => Some([
                self.vec(src, &n("self_attn.q_norm.weight"), hd, Model)?,
                self.vec(src, &n("self_attn.k_norm.weight"), hd, Model)?,
            ]),
            false => None,
        };
        // Gemma: post_attention_layernorm is the attention output's norm and the MLP has
        // its own pre-norm; in Llama the same name is the MLP's pre-norm.
        let (post_attn_norm, mlp_norm, post_mlp_norm) = match c.post_norms {
            true => (
                Some(self.vec(src, &n("post_attention_layernorm.weight"), d, Model)?),
                self.vec(src, &n("pre_feedforward_layernorm.weight"), d, Model)?,
                Some(self.vec(src, &n("post_feedforward_layernorm.weight"), d, Model)?),
            ),
            false => (None, self.vec(src, &n("post_attention_layernorm.weight"), d, Model)?, None),
        };
        let wo_name = n("self_attn.o_proj.weight");
        let wo_unit = self.head_unit(src, &wo_name);
        let down_unit = if f.is_multiple_of(FFN_UNIT) { FFN_UNIT } else { f };
        Ok(Layer {
            attn_norm: self.vec(src, &n("input_layernorm.weight"), d, Model)?,
            wq: self.mat(src, &n("self_attn.q_proj.weight"), (qd, d), Rows(Heads))?,
            wk: self.mat(src, &n("self_attn.k_proj.weight"), (kvd, d), Rows(KvHeads))?,
            wv: self.mat(src, &n("self_attn.v_proj.weight"), (kvd, d), Rows(KvHeads))?,
            bias,
            qk_norm,
            wo: self.mat(src, &wo_name, (d, qd), Cols(Heads, wo_unit))?,
            post_attn_norm,
            mlp_norm,
            w_gate: self.mat(src, &n("mlp.gate_proj.weight"), (f, d), Rows(Ffn))?,
            w_up: self.mat(src, &n("mlp.up_proj.weight"), (f, d), Rows(Ffn))?,
            w_down: self.mat(src, &n("mlp.down_proj.weight"), (d, f), Cols(Ffn, down_unit))?,
            post_mlp_norm,
            kind: c.layer_kind(i),
        })
    }
}

impl<B: Backend> Decoder<B> {
    /// Take the weights out of `src` (canonical names) and hand them to the backend (a
    /// tensor-parallel one splits them between its ranks).
    pub fn load(backend: B, src: &mut ModelSource) -> Result<Self> {
        let cfg = src.config.clone();
        let d = cfg.hidden;
        let tied = cfg.tie_embeddings || !src.tensors.contains_key(names::LM_HEAD);
        // A padded vocabulary (more embedding rows than the tokenizer has ids, as Qwen's):
        // the head scores only the tokenizer's ids, so no id without a token is sampled.
        let logits_width = src.tokenizer_vocab.map_or(cfg.vocab, |n| n.clamp(1, cfg.vocab));
        let padded_head = match logits_width < cfg.vocab {
            true => Some(padded_head(src, tied, logits_width, (cfg.vocab, d))?),
            false => None,
        };
        let mut l = Loader { backend: &backend, cfg: &cfg, read: 0, embed_is_head: tied && padded_head.is_none() };
        let vocab = MatKind::Rows(Width::Vocab);
        let embed = l.mat(src, names::EMBED, (cfg.vocab, d), vocab)?;
        let layers = (0..cfg.n_layers).map(|i| l.layer(src, i)).collect::<Result<Vec<_>>>()?;
        let norm = l.vec(src, names::NORM, d, Width::Model)?;
        let lm_head = match padded_head {
            Some(w) => {
                if !tied {
                    src.take(names::LM_HEAD)?; // the full head, replaced by its first rows
                }
                l.read += w.byte_size();
                Some(backend.matrix_as(w, vocab)?)
            }
            None if !tied => Some(l.mat(src, names::LM_HEAD, (cfg.vocab, d), vocab)?),
            None => None,
        };
        let decode_weight_bytes = l.read;
        let mut inv_freq = cfg.rope_inv_freq();
        // Llama 3 GGUFs store their frequency scaling as per-pair divisors.
        if let Some(w) = src.tensors.remove("rope_freqs") {
            let factors = vector(w, "rope_freqs.weight", inv_freq.len(), src)?;
            inv_freq.iter_mut().zip(factors).for_each(|(f, s)| *f /= s);
        }
        let rope = Rope { inv_freq, style: cfg.rope_style, linear: cfg.rope_linear };
        let rope_local =
            cfg.rope_local_inv_freq().map(|inv_freq| Rope { inv_freq, style: cfg.rope_style, linear: 1.0 });
        Ok(Decoder {
            cfg,
            backend,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            rope_local,
            logits_width,
            decode_weight_bytes,
            decode_work: std::sync::Mutex::new(Vec::new()),
            call_work: std::sync::Mutex::new(Vec::new()),
            session_pool: std::sync::Mutex::new(Vec::new()),
            kv_scheme: crate::kv::scheme::KvScheme::Bf16,
            kv_start: 0,
        })
    }
}
