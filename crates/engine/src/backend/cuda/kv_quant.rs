//! Quantized KV stores on CUDA (`--kv affine:B`, `--kv turbo:…`; kernels/kv_quant.cu): the
//! store holds kv::rows's rows (the CPU's bytes, so KV files move between backends),
//! written by kv_encode (RoPE, the q/k norms and the encoding in one launch, bit-exact with
//! RowCodec::encode) and read by attention_q, the split-K attention of attention.cu
//! dequantizing in its inner loop, whose merge undoes TurboQuant's value rotation once per
//! output head. Every path (decode, prefill, batched and invariant calls) takes these two
//! kernels (bf16's fused decode attention reads bf16 only), but a single decode row (head
//! dims up to 128, `CudaConfig::fused_quant_decode`) runs both as attention_q_decode before
//! the merge, and prefill with `CudaConfig::flash_quant_prefill` (the default) runs flash
//! attention over dequantized tiles (flash.rs), then `unrotate_rows`.

use super::context::Order;
use super::decode::QkNorm;
use super::device::Cuda;
use super::driver::KArg;
use super::kernels;
use super::prefill::{attention_chunking, quant_heads_per_block, quant_row_splits, window_arg};
use super::tensors::{CudaAct, CudaKv};
use crate::backend::{Attend, Rope};
use crate::config::{ModelConfig, RopeStyle};
use crate::kv::rows::RowCodec;
use crate::kv::scheme::KvScheme;
use crate::kv::{turboquant as tq, KvBlocks, BLOCK};
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};

/// Head dims kv_quant.cu takes (a lane's dims stay within one group).
pub const QUANT_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The largest head dim attention_q_decode takes: its 128 threads encode a head, one
/// thread per dim. Larger heads (Gemma 3's 256) decode through the three kernels.
pub(crate) const FUSED_HEAD_DIM_MAX: usize = 128;

/// The quantized half of a `CudaKv`.
pub(crate) struct QuantKv {
    pub(crate) codecs: Vec<RowCodec>,
    /// Per layer: its store rows × KV heads × `codecs[layer].bytes()` bytes.
    pub(crate) rows: Vec<CudaSlice<u8>>,
    /// The sign words, centroids and boundaries kv_quant.cu reads (zeros for affine).
    pub(crate) table: CudaSlice<u32>,
    /// The first store row of the head blocks (`--kv-start`: blocks.full · BLOCK).
    pub(crate) head_row0: usize,
    /// Per full layer (None for a sliding one, or with no head blocks): the head blocks'
    /// keys and values, `[head·BLOCK, width]` bf16, the values in the accumulation domain.
    pub(crate) head: Vec<Option<(CudaSlice<u16>, CudaSlice<u16>)>>,
}

impl QuantKv {
    /// Bytes of one store row of `layer` (every KV head's row).
    pub(crate) fn row_bytes(&self, layer: usize, n_kv: usize) -> usize {
        n_kv * self.codecs[layer].bytes()
    }

    /// Whether store row `row` of `layer` is a head block's (bf16).
    pub(crate) fn is_head(&self, layer: usize, row: usize) -> bool {
        row >= self.head_row0 && self.head.get(layer).is_some_and(Option::is_some)
    }

    /// The kernels' head-block arguments of `layer`: keys, values (null for none), first row.
    pub(crate) fn head_args(&self, ctx: &Cuda, layer: usize) -> [KArg; 3] {
        let (k, v) = match &self.head[layer] {
            Some((k, v)) => (ctx.arg(k), ctx.arg(v)),
            None => (KArg::Ptr(0), KArg::Ptr(0)),
        };
        [k, v, KArg::I32(i32::try_from(self.head_row0).unwrap_or(i32::MAX))]
    }
}

/// attention_q and attention_merge_q for one layer, with their arguments: the store's (in
/// place of attention_split's k and v caches), the merge's appended ones, and the head
/// blocks' (attention_q's last).
pub(crate) struct QuantAttention {
    pub(crate) split: CudaFunction,
    pub(crate) merge: CudaFunction,
    pub(crate) store: [KArg; 2],
    pub(crate) merge_extra: [KArg; 2],
    pub(crate) head: [KArg; 3],
}

/// 1/√hd as the Walsh-Hadamard transform scales by it (turboquant::hadamard).
fn hadamard_scale(hd: usize) -> f32 {
    (1.0 / (hd as f64).sqrt()) as f32
}

/// The table kv_quant.cu reads: 8 sign words, 256 centroids, 255 boundaries.
fn scheme_table(scheme: &KvScheme, hd: usize) -> Result<Vec<u32>> {
    let mut t = vec![0u32; 8 + 256 + 255];
    if let KvScheme::Turbo { value_bits, .. } = scheme {
        let signs = tq::sign_words(hd)?;
        t[..signs.len()].copy_from_slice(&signs);
        let (cents, bounds) = tq::value_table(*value_bits)
            .ok_or_else(|| Error::Unsupported(format!("TurboQuant values of {value_bits} bits")))?;
        t[8..8 + cents.len()].copy_from_slice(cents);
        t[8 + 256..8 + 256 + bounds.len()].copy_from_slice(bounds);
    }
    Ok(t)
}

impl Cuda {
    /// `Backend::kv_store_scheme` for a quantized scheme.
    pub(crate) fn kv_store_quant(&self, cfg: &ModelConfig, blocks: KvBlocks, scheme: &KvScheme) -> Result<CudaKv> {
        scheme.check(cfg)?;
        let hd = cfg.head_dim;
        if !QUANT_HEAD_DIMS.contains(&hd) {
            return Err(Error::Unsupported(format!(
                "the KV scheme {scheme} on CUDA needs a head dim of 64, 128 or 256; this model's is {hd}"
            )));
        }
        let codecs = (0..cfg.n_layers)
            .map(|l| RowCodec::new(scheme, l, hd)?.ok_or_else(|| Error::Invalid("bf16 is not quantized".into())))
            .collect::<Result<Vec<_>>>()?;
        let mut kv = self.kv_store_bf16(cfg, blocks, false)?;
        let rows = (0..cfg.n_layers)
            .map(|l| {
                let n = if kv.sliding[l] { blocks.sliding } else { blocks.full } * BLOCK;
                self.zeros::<u8>(n * cfg.n_kv_heads * codecs[l].bytes(), "allocating the KV cache")
            })
            .collect::<Result<Vec<_>>>()?;
        for (l, c) in codecs.iter().enumerate() {
            self.function(kernels::file("kv_quant.cu"), &quant_defines(c), "attention_q").map_err(|e| {
                Error::Unsupported(format!("the KV scheme {scheme} (layer {l}) on CUDA: its kernels: {e}"))
            })?;
        }
        let table = self.upload(&scheme_table(scheme, hd)?, "uploading the KV scheme's tables")?;
        let width = cfg.n_kv_heads * hd;
        if i32::try_from((blocks.full + blocks.head) * BLOCK).is_err() {
            return Err(Error::Unsupported(format!("a CUDA KV store of {} blocks", blocks.full + blocks.head)));
        }
        let head = (0..cfg.n_layers)
            .map(|l| match blocks.head > 0 && !kv.sliding[l] {
                true => {
                    let n = blocks.head * BLOCK * width;
                    Ok(Some((
                        self.zeros::<u16>(n, "allocating the KV cache")?,
                        self.zeros::<u16>(n, "allocating the KV cache")?,
                    )))
                }
                false => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        kv.quant = Some(QuantKv { codecs, rows, table, head_row0: blocks.full * BLOCK, head });
        Ok(kv)
    }

    fn quant_function<'a>(&self, kv: &'a CudaKv, layer: usize, name: &str) -> Result<(CudaFunction, &'a QuantKv)> {
        let qk =
            kv.quant.as_ref().ok_or_else(|| Error::Invalid("a bf16 KV store given to a quantized kernel".into()))?;
        let codec = qk.codecs.get(layer).ok_or_else(|| {
            Error::Invalid(format!("CUDA KV store: layer {layer} of a {}-layer store", qk.codecs.len()))
        })?;
        Ok((self.function(kernels::file("kv_quant.cu"), &quant_defines(codec), name)?, qk))
    }

    /// This call's k/v rows encoded into `layer`'s quantized store at the staged positions,
    /// after the k norm (`norms`) and RoPE (`rope`) where given; with `q` = (input, output)
    /// q's heads get the same norm and RoPE into the output (which may be the input).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn kv_encode(
        &self,
        q: Option<(KArg, KArg)>,
        (k, v): (&CudaAct, &CudaAct),
        kv: &mut CudaKv,
        layer: usize,
        rope: Option<&Rope>,
        norms: Option<QkNorm>,
        heads: usize,
    ) -> Result<()> {
        let (hd, n_kv) = (kv.head_dim, kv.width / kv.head_dim);
        let tables = self.steps.tables(self, kv.sliding(layer)?, "attention")?;
        let pos = self.steps.pos(self, "attention")?;
        let (f, qk) = self.quant_function(kv, layer, "kv_encode")?;
        let (q_in, q_out) = q.unwrap_or((KArg::Ptr(0), KArg::Ptr(0)));
        let (freqs, linear, interleaved) = match rope {
            Some(r) => (self.scratch.rope_freqs(self, r)?, r.linear, r.style == RopeStyle::Interleaved),
            None => (KArg::Ptr(0), 1.0, false),
        };
        let (qn, kn, eps) = match norms {
            Some(([qn, kn], eps)) => (self.arg(qn), self.arg(kn), eps),
            None => (KArg::Ptr(0), KArg::Ptr(0), 0.0),
        };
        let args = [
            q_in,
            q_out,
            self.arg(k.bf16()),
            self.arg(v.bf16()),
            self.arg(&qk.rows[layer]),
            self.arg(&qk.table),
            freqs,
            KArg::F32(linear),
            KArg::I32(i32::from(interleaved)),
            qn,
            kn,
            KArg::F32(eps),
            KArg::I32(heads as i32),
            KArg::I32(n_kv as i32),
            KArg::I32(hd as i32),
            KArg::F32(hadamard_scale(hd)),
            pos,
            tables[0],
            tables[1],
        ];
        let args: Vec<KArg> = args.into_iter().chain(qk.head_args(self, layer)).collect();
        let c = LaunchConfig {
            grid_dim: (k.rows as u32, (heads + n_kv) as u32, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(&f, c, &args, Order::Overlap, "kv_encode launch")
    }

    /// TurboQuant's value rotation undone on every head of `x` (flash prefill's output).
    pub(crate) fn unrotate_rows(&self, x: &mut CudaAct, kv: &CudaKv, layer: usize) -> Result<()> {
        let (f, qk) = self.quant_function(kv, layer, "unrotate_rows")?;
        let hd = kv.head_dim;
        let args = [x.arg(self), KArg::I32(hd as i32), self.arg(&qk.table), KArg::F32(hadamard_scale(hd))];
        let c = LaunchConfig {
            grid_dim: ((x.rows * x.cols / hd) as u32, 1, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(&f, c, &args, Order::Serial, "unrotate_rows launch")
    }

    /// attention_q's most splits of a row: as many as make one wave of a sequence's blocks
    /// (heads · splits of them, as many per SM as fit), at most the configured most, so that
    /// a call's grid (prefill.rs attention_splits) covers every row. One wave measured
    /// fastest: 8B shape, turbo:k8v3 at depth 32768, 12 splits 226 tok/s against 9 (the
    /// power-of-two chunks' count there) 192 and 24 200 (docs/kv.md).
    pub(crate) fn quant_max_splits(&self, split: &CudaFunction, heads: usize) -> usize {
        let resident = split.occupancy_max_active_blocks_per_multiprocessor(128, 0, None).unwrap_or(3).max(1) as usize;
        (resident * self.sms / heads.max(1)).clamp(1, self.cfg.attention_max_splits.max(1))
    }

    /// A decode row over a quantized store in two launches: kv_quant.cu's attention_q_decode
    /// (the q/k norms and RoPE, the new row's encoding and attention: kv_encode's and
    /// attention_q's work and partials), then attention_merge_q. q, k, v unrotated.
    pub(crate) fn attention_decode_quant(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &mut CudaKv,
        layer: usize,
        (rope, attend, qk_norm): (&Rope, Attend, Option<QkNorm>),
        out: &mut CudaAct,
    ) -> Result<()> {
        let (hd, n_kv, heads) = (kv.head_dim, kv.width / kv.head_dim, q.cols / kv.head_dim);
        if hd > FUSED_HEAD_DIM_MAX {
            return Err(Error::Invalid(format!("attention_q_decode takes head dims up to 128, not {hd}")));
        }
        let (f, qk) = self.quant_function(kv, layer, "attention_q_decode")?;
        let qb = quant_heads_per_block(heads, n_kv);
        let (min_chunk, _) = attention_chunking(&self.cfg);
        let most = self.quant_max_splits(&f, heads);
        // attention_cached_from's splits and scratch for one row.
        let splits = match self.steps.call_splits() {
            0 => quant_row_splits(kv.max_seq(), min_chunk, qb, most, self.cfg.quant_split_sqrt),
            n => n,
        } * qb;
        let [ml, acc, _] = self.scratch.attention(self, heads, splits, hd)?;
        let (qn, kn, eps) = match qk_norm {
            Some(([qn, kn], eps)) => (self.arg(qn), self.arg(kn), eps),
            None => (KArg::Ptr(0), KArg::Ptr(0), 0.0),
        };
        let mut args = vec![
            q.arg(self),
            k.arg(self),
            v.arg(self),
            self.arg(&qk.rows[layer]),
            self.arg(&qk.table),
            self.scratch.rope_freqs(self, rope)?,
            KArg::F32(rope.linear),
            KArg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            qn,
            kn,
            KArg::F32(eps),
            ml,
            acc,
            KArg::I32(heads as i32),
            KArg::I32(n_kv as i32),
            KArg::I32(hd as i32),
            self.steps.pos(self, "attention")?,
            KArg::I32(min_chunk as i32),
            KArg::I32(most as i32),
            KArg::I32(self.cfg.quant_split_sqrt as i32),
            KArg::F32(attend.scale),
            KArg::I32(window_arg(attend)?),
            // One sequence: its table at offset 0.
            self.steps.tables(self, kv.sliding(layer)?, "attention")?[0],
            KArg::I32(qb as i32),
            KArg::F32(hadamard_scale(hd)),
        ];
        args.extend(qk.head_args(self, layer));
        let grid = LaunchConfig {
            grid_dim: ((heads / qb) as u32, 1, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // Scratch sized [heads, splits], the merge's as attention_cached_from's.
        self.launch(&f, grid, &args, Order::Overlap, "attention_q_decode launch")?;
        let (merge, extra) = self.quant_merge(kv, layer)?;
        self.merge_splits(&merge, [ml, acc], out, (1, heads, hd, splits), Some(extra), Order::Overlap)
    }

    /// attention_merge_q for `layer` and its arguments after attention_merge's: the store's
    /// table and the Hadamard scale.
    fn quant_merge(&self, kv: &CudaKv, layer: usize) -> Result<(CudaFunction, [KArg; 2])> {
        let (merge, qk) = self.quant_function(kv, layer, "attention_merge_q")?;
        Ok((merge, [self.arg(&qk.table), KArg::F32(hadamard_scale(kv.head_dim))]))
    }

    /// attention_q's and attention_merge_q's functions and their arguments for `layer`.
    pub(crate) fn quant_attention_kernels(&self, kv: &CudaKv, layer: usize) -> Result<QuantAttention> {
        let (split, qk) = self.quant_function(kv, layer, "attention_q")?;
        let (merge, merge_extra) = self.quant_merge(kv, layer)?;
        Ok(QuantAttention {
            split,
            merge,
            store: [self.arg(&qk.rows[layer]), self.arg(&qk.table)],
            merge_extra,
            head: qk.head_args(self, layer),
        })
    }
}

/// -D defines of the kv_quant.cu build for `codec`'s rows.
pub fn quant_defines(codec: &RowCodec) -> Vec<String> {
    let (turbo, kbits, signed, vbits) = codec.kernel_format();
    kernels::kv_quant_defines(turbo, kbits, signed, vbits)
}
