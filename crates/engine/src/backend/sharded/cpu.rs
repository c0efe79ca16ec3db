//! Simulated ranks on the CPU, in one process: the exchanges are copies, and the
//! all-reduce continues rank r−1's sums through rank r's part (`matmul_continue`), so the
//! ranks' sum is, bit for bit, the unsharded product's: a tensor-parallel CPU model gives
//! exactly the logits of the whole one.

use super::Collective;
use crate::backend::cpu::matmul::{matmul_continue, matmul_many};
use crate::backend::cpu::{Cpu, CpuAct, CpuMat};
use crate::backend::Backend;
use crate::{Error, Result};

/// The CPU's collective: ranks in order.
pub struct InOrder;

impl Collective<Cpu> for InOrder {
    fn embed(
        &self,
        ranks: &[Cpu],
        tables: &[&CpuMat],
        firsts: &[usize],
        tokens: &[u32],
        scale: f32,
        xs: &mut [&mut CpuAct],
    ) -> Result<()> {
        let d = xs[0].cols;
        let mut row = CpuAct { rows: 1, cols: d, data: vec![0.0; d] };
        for (i, &t) in tokens.iter().enumerate() {
            // The rank whose part of the vocabulary holds t.
            let r = (0..ranks.len())
                .rev()
                .find(|&r| firsts[r] <= t as usize && (t as usize) < firsts[r] + tables[r].rows())
                .ok_or_else(|| Error::Invalid(format!("token id {t} is outside every rank's vocabulary")))?;
            ranks[r].embed(tables[r], &[t - firsts[r] as u32], scale, &mut row)?;
            for x in xs.iter_mut() {
                x.data[i * d..(i + 1) * d].copy_from_slice(&row.data);
            }
        }
        Ok(())
    }

    fn row_parallel(&self, _: &[Cpu], ys: &[&CpuAct], ws: &[&CpuMat], outs: &mut [&mut CpuAct]) -> Result<()> {
        let (m, n) = (ys[0].rows, ws[0].rows());
        let mut sum = vec![0f32; m * n];
        matmul_many(&ys[0].data, m, &[ws[0]], &mut [&mut sum]);
        for (y, w) in ys.iter().zip(ws).skip(1) {
            matmul_continue(&y.data, m, w, &mut sum);
        }
        for o in outs.iter_mut() {
            o.data.copy_from_slice(&sum);
        }
        Ok(())
    }
}
