//! A generated call's rows (`Backend::begin_generated`: each a sequence's one row past its
//! prompt) through the decode step's kernels, batched over the rows so that each row gets
//! the bits it gets alone: the GEMVs as gemv.rs's `gemv_tokens` (each weight tile meets
//! every row's x in registers), attention as attention_decode.cu's attention_decode_rows
//! (each row at its own position, through its own block table, its splits a function of
//! its own span, merged in a cluster as the bench's short caches are). A call of one row is
//! the bench's decode step but for attention's splits, which there follow the session's
//! cache size.

use super::decode::{DecodeSplit, QkNorm};
use super::device::Cuda;
use super::kernels;
use super::tensors::{CudaAct, CudaKv};
use crate::backend::{Attend, Rope};
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;

impl Cuda {
    /// attention_decode for each of q's rows (a generated call's), at the staged positions
    /// and block tables: the q/k norms, RoPE of q and the new k, the cache write, attention
    /// and the split merge. A quantized store takes its serving path instead (kv_encode, then
    /// the split-K attention), invariant as well.
    pub(crate) fn attention_decode_rows(
        &self,
        q: &CudaAct,
        (k, v): (&CudaAct, &CudaAct),
        kv: &mut CudaKv,
        layer: usize,
        (rope, attend, qk_norm): (&Rope, Attend, Option<QkNorm>),
        out: &mut CudaAct,
    ) -> Result<()> {
        let (hd, rows) = (kv.head_dim, q.rows);
        let heads = q.cols / hd;
        if k.rows != rows || v.rows != rows || out.rows != rows {
            return Err(Error::Invalid(format!("CUDA decode attention over {rows} rows: k, v or out of other rows")));
        }
        if kv.quant.is_some() {
            let q_rot = out.arg(self);
            self.kv_encode(Some((q.arg(self), q_rot)), (k, v), kv, layer, Some(rope), qk_norm, heads)?;
            return self.attention_cached_from(q_rot, (rows, heads), kv, layer, attend, out);
        }
        let defines = kernels::attention_decode_defines(1, false, false);
        let f = self.function(kernels::file("attention_decode.cu"), &defines, "attention_decode_rows")?;
        let (min_chunk, most) = super::prefill::attention_chunking(&self.cfg);
        // A cluster of splits merging in shared memory covers a row of up to cs · 2 ·
        // min_chunk positions (attention_decode's short caches merge so).
        let cs = match self.clusters && self.cfg.attention_clusters {
            true => super::decode::ATTN_CLUSTER_MAX,
            false => 1,
        };
        let most = most.next_multiple_of(cs);
        // Per row: [heads, most] partials and one done counter per head.
        let scratch = self.scratch.attention(self, heads * rows, most, hd)?;
        let [tables, row_tab] = self.steps.tables(self, kv.sliding(layer)?, "attention")?;
        // attention_decode's arguments with the smallest split and the cluster size where
        // attention_decode takes its chunk and cluster size; then the row tables.
        let split = DecodeSplit { heads, qb: 1, chunk: min_chunk, cluster: cs };
        let mut args =
            self.attention_decode_args(q, (k, v), kv, layer, (rope, attend, qk_norm), out, scratch, split)?;
        args.extend([tables, row_tab]);
        let c = LaunchConfig {
            grid_dim: (heads as u32, rows as u32, most as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let order = match cs {
            1 => super::context::Order::Overlap,
            _ => super::context::Order::OverlapClustered(cs as u32),
        };
        self.launch(&f, c, &args, order, "attention_decode_rows launch")
    }
}
