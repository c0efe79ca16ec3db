//! Prefill ops (many rows): matmuls on the tensor-core GEMM (gemm.rs) from a few tiles'
//! worth of tokens and on the row GEMV (affine.cu's qmv, dense.cu's dmv) below, RoPE with
//! the cache write in one launch, and attention over the cache (flash.rs, or split-K with
//! its merge for head dims flash attention is not compiled for).

use super::context::Order;
use super::device::Cuda;
use super::driver::KArg;
use super::elementwise::cfg;
use super::kernels;
use super::tensors::{CudaAct, CudaKv, CudaMat};
use crate::backend::{Attend, Rope};
use crate::config::RopeStyle;
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, LaunchConfig};

/// Activation rows from which a matmul runs on tensor cores (below, the GEMV reads the
/// weights fewer times than the GEMM's fixed 64-token tiles waste).
const GEMM_MIN_ROWS: usize = 16;

impl Cuda {
    /// `Backend::matmul` for any number of rows: out = x·wᵀ.
    pub(crate) fn matmul_rows(&self, x: &CudaAct, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
        if x.cols != w.cols() || out.cols != w.rows() || out.rows != x.rows {
            return Err(Error::Invalid(format!(
                "CUDA matmul shapes: x [{}, {}], w [{}, {}], out [{}, {}]",
                x.rows,
                x.cols,
                w.rows(),
                w.cols(),
                out.rows,
                out.cols
            )));
        }
        // An invariant call takes the GEMM (one kernel, each row's arithmetic independent of
        // the others') at every row count, or else the one-row-per-block qmv.
        let invariant = self.steps.invariant();
        if (x.rows >= GEMM_MIN_ROWS || invariant) && self.qgemm_supported(w) {
            return self.qgemm(x, w, out);
        }
        let xb = self.arg(x.bf16());
        let f32_out = out.is_f32();
        let (rows, cols, m) = (KArg::I32(w.rows() as i32), KArg::I32(w.cols() as i32), KArg::I32(x.rows as i32));
        // Eight activation rows per block from four rows on, so each weight chunk is read
        // m/8 times.
        let multi = x.rows >= 4 && !invariant && matches!(w, CudaMat::Affine { .. });
        let ty = if multi { x.rows.div_ceil(8) } else { x.rows };
        let c = cfg((w.rows().div_ceil(4) as u32, ty as u32), 128);
        match w {
            CudaMat::Affine { words, scales, biases, f, .. } => {
                // f = [qmv, qmv_f32, embed, qmv8, qmv8_f32]
                let k = &f[usize::from(f32_out) + if multi { 3 } else { 0 }];
                let args = [self.arg(words), scales.arg(self), biases.arg(self), xb, out.arg(self), rows, cols, m];
                self.launch(k, c, &args, Order::Serial, "matmul launch")
            }
            CudaMat::Dense { w, f, .. } => {
                // f = [dmv, dmv_f32, dembed]
                let args = [self.arg(w), xb, out.arg(self), rows, cols];
                self.launch(&f[usize::from(f32_out)], c, &args, Order::Serial, "matmul launch")
            }
        }
    }

    /// RoPE on q and k plus the cache write of k and v, one launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_kv(
        &self,
        q: &mut CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        heads: usize,
    ) -> Result<()> {
        let freqs = self.scratch.rope_freqs(self, rope)?;
        let f = self.plain_kernel("attention.cu", "rope_kv")?;
        let tables = self.steps.tables(self, kv.sliding(layer)?, "attention")?;
        let pos = self.steps.pos(self, "rope")?;
        let n = q.rows * (q.cols / 2 + kv.width / 2 + kv.width);
        let mut args = self.qkv_cache_args(q, (k, v), kv, layer).to_vec();
        args.extend([
            freqs,
            KArg::I32(q.rows as i32),
            KArg::I32(heads as i32),
            KArg::I32((kv.width / kv.head_dim) as i32),
            KArg::I32(kv.head_dim as i32),
            pos,
            KArg::F32(rope.linear),
            KArg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            tables[0],
            tables[1],
        ]);
        let c = cfg((n.div_ceil(256).min(4096) as u32, 1), 256);
        // Matches attention.cu's rope_kv; pos0 + rows ≤ max_seq is checked by the model.
        self.launch(&f, c, &args, Order::Overlap, "rope_kv launch")
    }

    /// Causal attention of q over the cache (this call's rows already written): split-K
    /// partials and their merge. The split count follows the cache size, so decode at depth
    /// fills the GPU with heads × splits blocks.
    pub(crate) fn attention_cached(
        &self,
        q: &CudaAct,
        kv: &CudaKv,
        layer: usize,
        attend: Attend,
        out: &mut CudaAct,
    ) -> Result<()> {
        self.attention_cached_from(q.arg(self), (q.rows, q.cols / kv.head_dim), kv, layer, attend, out)
    }

    /// `attention_cached` of the q at `q` (`rows` × `heads` heads, which may be `out`'s
    /// buffer: the splits read q before the merge writes out). A quantized store takes
    /// kv_quant.cu's kernels.
    pub(crate) fn attention_cached_from(
        &self,
        q: KArg,
        (rows, heads): (usize, usize),
        kv: &CudaKv,
        layer: usize,
        attend: Attend,
        out: &mut CudaAct,
    ) -> Result<()> {
        let pos = self.steps.pos(self, "attention")?;
        let hd = kv.head_dim;
        // A quantized store's blocks take qb heads of a KV group and cut each split into qb
        // parts (kv_quant.cu's attention_q): a head's partials are its splits' parts.
        let qb = match kv.quant {
            Some(_) => quant_heads_per_block(heads, kv.width / hd),
            None => 1,
        };
        // An engine call's graph fixes its split count (steps.rs `call`) and keeps its
        // scratch. A single row (a sequence's decode step: its dry pass, capture or eager
        // run alike) covers the whole store, since its graph replays at later positions, and
        // keeps its scratch too (made in the dry pass, not during the capture); another
        // capture covers the whole store with scratch of its own graph; other calls their
        // longest sequence (a shared store may be far larger). Splits past a row's length
        // are empty: its chunk is a function of its own length, not of the count.
        let (min_chunk, max_splits) = attention_chunking(&self.cfg);
        let (a, mg, store, merge_extra, head, max_splits) = match kv.quant {
            Some(_) => {
                let qa = self.quant_attention_kernels(kv, layer)?;
                let most = self.quant_max_splits(&qa.split, heads);
                (qa.split, qa.merge, qa.store, Some(qa.merge_extra), Some(qa.head), most)
            }
            None => {
                let store = [self.arg(&kv.k[layer]), self.arg(&kv.v[layer])];
                let a = self.plain_kernel("attention.cu", "attention_split")?;
                (a, self.plain_kernel("attention.cu", "attention_merge")?, store, None, None, max_splits)
            }
        };
        // The splits that cover every row of up to `span` positions (the quantized kernels'
        // chunk rule cuts fewer than attention.cu's).
        let splits_for = |span: usize| match kv.quant {
            Some(_) => quant_row_splits(span, min_chunk, qb, max_splits, self.cfg.quant_split_sqrt) * qb,
            None => attention_splits(span, &self.cfg),
        };
        let capturing = self.ctx.capturing.load(std::sync::atomic::Ordering::Relaxed);
        let whole = splits_for(kv.max_seq());
        let (splits, kept) = match (self.steps.call_splits(), rows == 1, capturing) {
            (0, true, _) => (whole, Some(self.scratch.attention(self, heads, whole, hd)?)),
            (0, false, true) => (whole, None),
            (0, false, false) => (splits_for(self.steps.end().clamp(1, kv.max_seq())), None),
            (n, _, _) => (n * qb, Some(self.scratch.attention(self, rows * heads, n * qb, hd)?)),
        };
        let slots = rows * heads * splits;
        let (ml, acc);
        let [ml_arg, acc_arg] = match kept {
            Some([kept_ml, kept_acc, _]) => [kept_ml, kept_acc],
            None => {
                ml = self.zeros::<f32>(2 * slots, "allocating attention scratch")?;
                acc = self.zeros::<f32>(slots * hd, "allocating attention scratch")?;
                [self.arg(&ml), self.arg(&acc)]
            }
        };
        let tables = self.steps.tables(self, kv.sliding(layer)?, "attention")?;
        let mut args = vec![
            q,
            store[0],
            store[1],
            ml_arg,
            acc_arg,
            KArg::I32(heads as i32),
            KArg::I32((kv.width / hd) as i32),
            KArg::I32(hd as i32),
            pos,
            KArg::I32(min_chunk as i32),
            KArg::I32(max_splits as i32),
        ];
        if head.is_some() {
            args.push(KArg::I32(self.cfg.quant_split_sqrt as i32));
        }
        args.extend([KArg::F32(attend.scale), KArg::I32(window_arg(attend)?), tables[0], tables[1]]);
        if let Some(head) = head {
            args.push(KArg::I32(qb as i32));
            args.extend(head);
        }
        let c = LaunchConfig {
            grid_dim: ((heads / qb) as u32, rows as u32, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // Matches attention.cu's attention_split; scratch sized [m, heads, splits]. The
        // quantized kernels wait (pdl_wait) for what the kernel before them wrote, so they
        // may launch while it ends; attention.cu's split and merge may not.
        let order = match kv.quant {
            Some(_) => Order::Overlap,
            None => Order::Serial,
        };
        self.launch(&a, c, &args, order, "attention launch")?;
        self.merge_splits(&mg, [ml_arg, acc_arg], out, (rows, heads, hd, splits), merge_extra, order)
        // Scratch made here is freed when this returns: cudarc frees it stream-ordered, after
        // the merge has read it.
    }

    /// attention.cu's attention_merge, or kv_quant.cu's attention_merge_q with `extra` (the
    /// store's table and the Hadamard scale): `rows` rows' `splits` partials per head
    /// ([rows, heads, splits], heads of `hd`) merged into `out`.
    pub(crate) fn merge_splits(
        &self,
        merge: &CudaFunction,
        [ml, acc]: [KArg; 2],
        out: &mut CudaAct,
        (rows, heads, hd, splits): (usize, usize, usize, usize),
        extra: Option<[KArg; 2]>,
        order: Order,
    ) -> Result<()> {
        let mut args = vec![
            ml,
            acc,
            self.arg(out.bf16()),
            KArg::I32(heads as i32),
            KArg::I32(hd as i32),
            KArg::I32(splits as i32),
        ];
        args.extend(extra.into_iter().flatten());
        let grid = cfg((heads as u32, rows as u32), hd as u32);
        self.launch(merge, grid, &args, order, "attention merge launch")
    }

    /// The prefill half of `Backend::rope_attention`: RoPE with the cache write, then
    /// flash attention (or the split-K kernels for other head dims and invariant calls).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prefill_attention(
        &self,
        q: &mut CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &mut CudaKv,
        layer: usize,
        rope: &Rope,
        n_heads: usize,
        attend: Attend,
        out: &mut CudaAct,
    ) -> Result<()> {
        if kv.quant.is_some() {
            let qa = q.arg(self);
            self.kv_encode(Some((qa, qa)), (k, v), kv, layer, Some(rope), None, n_heads)?;
            let flash = self.cfg.flash_quant_prefill && kernels::FLASH_HEAD_DIMS.contains(&kv.head_dim);
            return match flash && !self.steps.invariant() {
                true => self.flash_prefill(q, kv, layer, attend, out),
                false => self.attention_cached(q, kv, layer, attend, out),
            };
        }
        self.rope_kv(q, k, v, kv, layer, rope, n_heads)?;
        // Flash takes one sequence's consecutive rows, in tiles whose arithmetic a row
        // shares with its neighbours: not for an invariant call.
        if kernels::FLASH_HEAD_DIMS.contains(&kv.head_dim) && !self.steps.invariant() {
            self.flash_prefill(q, kv, layer, attend, out)
        } else {
            self.attention_cached(q, kv, layer, attend, out)
        }
    }
}

/// Splits that cover every row of a call whose longest span is `span` positions: a row
/// needs ceil(its span / its chunk) ≤ ceil(span / the smallest chunk), and at most the
/// most splits (attention.cu's chunk rule).
pub(crate) fn attention_splits(span: usize, cfg: &super::CudaConfig) -> usize {
    let (min_chunk, max_splits) = attention_chunking(cfg);
    span.div_ceil(min_chunk).clamp(1, max_splits)
}

/// Query heads per block of kv_quant.cu's attention_q (its QH, 4, at most): the largest
/// divisor of the GQA group that fits, so a block decodes each row once for them all.
pub(crate) fn quant_heads_per_block(heads: usize, n_kv: usize) -> usize {
    let group = (heads / n_kv.max(1)).max(1);
    (1..=4).rev().find(|d| group.is_multiple_of(*d)).unwrap_or(1)
}

/// Splits of kv_quant.cu's attention_q (each cut into qb parts) that cover every row of up
/// to `span` positions: a row's chunk is max(min_chunk · qb, ⌈its span / most⌉, ⌈k·√its
/// span⌉) (k = `CudaConfig::quant_split_sqrt`), so it needs at most ⌈span / (min_chunk ·
/// qb)⌉ splits while the first holds, at most `most` once the second does, and at most
/// ⌈√span / k⌉ (the smallest n with n²k² ≥ span) while the third does.
pub(crate) fn quant_row_splits(span: usize, min_chunk: usize, qb: usize, most: usize, k: usize) -> usize {
    let by_sqrt = match k {
        0 => usize::MAX,
        k => (1..).find(|n| n * n * k * k >= span).unwrap_or(1),
    };
    span.div_ceil(min_chunk * qb).min(by_sqrt).clamp(1, most.max(1))
}

/// The configuration's (smallest chunk, most splits), at least 1 each: the kernel's
/// doubling loop needs both positive.
pub(crate) fn attention_chunking(cfg: &super::CudaConfig) -> (usize, usize) {
    (cfg.attention_min_chunk.max(1), cfg.attention_max_splits.max(1))
}

/// A kernel's window argument: the positions a sliding-window query sees, 0 for all.
pub(crate) fn window_arg(attend: Attend) -> Result<i32> {
    match attend.window {
        None => Ok(0),
        Some(w) => i32::try_from(w)
            .ok()
            .filter(|&w| w > 0)
            .ok_or_else(|| crate::Error::Unsupported(format!("a sliding window of {w} positions on CUDA"))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::CudaConfig;
    use super::{attention_splits, quant_row_splits};

    /// kv_quant.cu's sqrt_chunk: ⌈k·√span⌉, the smallest c with c² ≥ k²·span (0 for k = 0).
    fn sqrt_chunk(k: usize, span: usize) -> usize {
        let t = k * k * span;
        let mut c = (t as f64).sqrt().ceil() as usize;
        while c * c < t {
            c += 1;
        }
        while c > 1 && (c - 1) * (c - 1) >= t {
            c -= 1;
        }
        c
    }

    /// kv_quant.cu's part_range: the splits a row of `span` positions uses.
    fn quant_need(span: usize, min_chunk: usize, qb: usize, most: usize, k: usize) -> usize {
        span.div_ceil((min_chunk * qb).max(span.div_ceil(most)).max(sqrt_chunk(k, span)))
    }

    #[test]
    fn a_rows_quantized_splits_cover_every_shorter_row() {
        for (min_chunk, k) in [16, 64, 256].into_iter().flat_map(|c| [0, 1, 7, 12, 20].map(move |k| (c, k))) {
            for (qb, most) in (1..=4).flat_map(|q| (1..=16).map(move |m| (q, m))) {
                let (mut need, mut tight) = (0, false);
                for end in 1..6000 {
                    need = need.max(quant_need(end, min_chunk, qb, most, k));
                    let splits = quant_row_splits(end, min_chunk, qb, most, k);
                    assert!(splits <= most);
                    assert!(
                        need <= splits,
                        "min chunk {min_chunk}, k {k}, qb {qb}, most {most}: span {end} needs {need}, {splits} launched"
                    );
                    // At most one split more than the longest row needs (⌈√span / k⌉ can
                    // exceed ⌈span / ⌈k·√span⌉⌉ by one).
                    assert!(splits <= need + 1, "span {end}: {splits} launched where {need} do");
                    tight |= need == splits;
                }
                assert!(tight, "min chunk {min_chunk}, k {k}, qb {qb}, most {most}: the bound is never reached");
            }
        }
    }

    #[test]
    fn the_square_root_floor_keeps_short_spans_to_few_splits() {
        // The 8B shape's quantized decode (4 query heads a block, one wave 12 splits) at the
        // default k: 3 splits at depth 1024, 6 at 4096, 12 from ~17,500 positions on.
        let k = CudaConfig::default().quant_split_sqrt;
        let splits = |span| quant_row_splits(span, 64, 4, 12, k);
        assert_eq!((splits(1216), splits(4288), splits(32960)), (3, 6, 12));
        assert_eq!(quant_row_splits(4288, 64, 4, 12, 0), 12);
    }

    /// attention.cu's chunk of a row with `span` positions.
    fn kernel_chunk(span: usize, cfg: &CudaConfig) -> usize {
        let mut chunk = cfg.attention_min_chunk;
        while chunk * cfg.attention_max_splits < span {
            chunk *= 2;
        }
        chunk
    }

    #[test]
    fn a_calls_splits_cover_each_of_its_rows() {
        for (min_chunk, max_splits) in [(16, 32), (32, 32), (64, 16), (64, 8), (256, 32), (1, 1)] {
            let cfg = CudaConfig {
                attention_min_chunk: min_chunk,
                attention_max_splits: max_splits,
                ..CudaConfig::default()
            };
            for end in 1..5000 {
                let splits = attention_splits(end, &cfg);
                assert!(splits <= max_splits);
                for span in (1..=end).step_by(7).chain([end]) {
                    let need = span.div_ceil(kernel_chunk(span, &cfg));
                    assert!(need <= splits, "span {span} needs {need} splits, a call to {end} launches {splits}");
                    // kv_quant.cu's attention_q, at any most splits up to the configured
                    // and 1 to 4 query heads a block.
                    for (most, qb) in (1..=max_splits).flat_map(|m| (1..=4).map(move |q| (m, q))) {
                        let chunk = (min_chunk * qb).max(span.div_ceil(most));
                        let need_q = span.div_ceil(chunk);
                        assert!(
                            need_q <= splits,
                            "quantized: span {span} at most {most} needs {need_q}, a call launches {splits}"
                        );
                    }
                }
            }
        }
    }
}
