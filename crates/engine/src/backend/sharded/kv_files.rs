//! KV rows of split caches in the unsplit cache's form (`Backend::kv_export`), so a KV
//! file moves between any number of ranks and the unsplit model: a bf16 row is every KV
//! head's key then every KV head's value; a quantized row is every KV head's unit (its key
//! then its value). A KV head held by several ranks (replicated) is written once, from
//! the first, and read into each.

use super::{Collective, Sharded, ShardedKv};
use crate::backend::Backend;
use crate::kv::BLOCK;
use crate::{Error, Result};

impl<B: Backend, C: Collective<B>> Sharded<B, C> {
    /// KV heads in the unsplit model.
    fn kv_heads(&self) -> usize {
        self.plan.ranks.iter().map(|s| s.kv_heads.end).max().unwrap_or(0)
    }

    /// Whether rank r writes its KV heads (no rank before it holds them).
    fn writes_heads(&self, r: usize) -> bool {
        self.plan.ranks[..r].iter().all(|s| s.kv_heads.end <= self.plan.ranks[r].kv_heads.start)
    }

    /// Whether store row `row` of `layer` is kept in bf16 (`--kv-start`'s head rows, or
    /// every row of a bf16 store).
    fn bf16_row(&self, kv: &ShardedKv<B::Kv>, layer: usize, row: usize) -> bool {
        let full = self.ranks[0].kv_blocks(&kv.parts[0]).full;
        !kv.quantized || (!kv.sliding[layer] && row >= full * BLOCK)
    }

    /// Bytes of one KV head of a row: (bf16 rows, quantized rows) of `layer`.
    fn head_bytes(&self, kv: &ShardedKv<B::Kv>, layer: usize) -> (usize, usize) {
        let s = &self.plan.ranks[0];
        let quant = self.ranks[0].kv_row_bytes(&kv.parts[0], layer) / s.kv_heads.len().max(1);
        (4 * self.head_dim, quant)
    }

    pub(super) fn row_bytes(&self, kv: &ShardedKv<B::Kv>, layer: usize) -> usize {
        let (bf, quant) = self.head_bytes(kv, layer);
        self.kv_heads() * if kv.quantized { quant } else { bf }
    }

    pub(super) fn export_rows(
        &self,
        kv: &ShardedKv<B::Kv>,
        layer: usize,
        rows: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let mut parts = vec![];
        for (b, k) in self.ranks.iter().zip(&kv.parts) {
            let mut v = vec![];
            b.kv_export(k, layer, rows, &mut v)?;
            parts.push(v);
        }
        let (bf, quant) = self.head_bytes(kv, layer);
        let mut at = vec![0usize; parts.len()];
        for &row in rows {
            let bf16 = self.bf16_row(kv, layer, row);
            // (bytes of the rank's row, and of a half of it: keys or values, in bf16)
            let size = |r: usize| self.plan.ranks[r].kv_heads.len() * if bf16 { bf } else { quant };
            let halves: &[(usize, usize)] = if bf16 { &[(0, 2), (1, 2)] } else { &[(0, 1)] };
            for &(half, of) in halves {
                for (r, p) in parts.iter().enumerate() {
                    if self.writes_heads(r) {
                        let n = size(r) / of;
                        out.extend_from_slice(&p[at[r] + half * n..at[r] + (half + 1) * n]);
                    }
                }
            }
            for (r, a) in at.iter_mut().enumerate() {
                *a += size(r);
            }
        }
        Ok(())
    }

    pub(super) fn import_rows(
        &self,
        kv: &mut ShardedKv<B::Kv>,
        layer: usize,
        rows: &[usize],
        data: &[u8],
    ) -> Result<()> {
        let (bf, quant) = self.head_bytes(kv, layer);
        let n_kv = self.kv_heads();
        let mut parts = vec![vec![]; self.ranks.len()];
        let mut at = 0;
        for &row in rows {
            let bf16 = self.bf16_row(kv, layer, row);
            let head = if bf16 { bf } else { quant };
            let whole = data
                .get(at..at + n_kv * head)
                .ok_or_else(|| Error::Invalid(format!("KV rows of layer {layer}: {} bytes, too few", data.len())))?;
            at += n_kv * head;
            for (s, p) in self.plan.ranks.iter().zip(parts.iter_mut()) {
                let (h0, h1) = (s.kv_heads.start, s.kv_heads.end);
                match bf16 {
                    // Keys of every head, then values: the rank's heads of each half.
                    true => {
                        let half = n_kv * head / 2;
                        for base in [0, half] {
                            p.extend_from_slice(&whole[base + h0 * head / 2..base + h1 * head / 2]);
                        }
                    }
                    false => p.extend_from_slice(&whole[h0 * head..h1 * head]),
                }
            }
        }
        if at != data.len() {
            return Err(Error::Invalid(format!("KV rows of layer {layer}: {} bytes, expected {at}", data.len())));
        }
        for ((b, k), p) in self.ranks.iter().zip(kv.parts.iter_mut()).zip(&parts) {
            b.kv_import(k, layer, rows, p)?;
        }
        Ok(())
    }
}
