//! The CPU backend: f32 activations, quantized weights used in place (rayon over rows),
//! paged bf16 KV store. It is also the reference every other backend is tested against.

pub mod attention;
pub mod kv;
pub mod matmul;
pub mod octets;
pub mod ops;
pub mod qdot;
#[cfg(target_arch = "x86_64")]
pub mod qdot_octets;
pub mod simd;

use super::{check_top_k, Attend, Backend, Rope};
use crate::config::{Activation, ModelConfig};
use crate::kv::{KvBlocks, Span};
use crate::quant::Weight;
use crate::Result;
use kv::CpuKv;
pub use matmul::CpuMat;

/// Row-major f32 activations `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct CpuAct {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

pub struct Cpu;

/// Rows from which the CPU's row-wise ops (GLU, x's quantization) run in parallel: below,
/// the fork and join would cost about what they save.
pub const PAR_ROWS: usize = 4;

impl Backend for Cpu {
    type Act = CpuAct;
    type Mat = CpuMat;
    type Vector = Vec<f32>;
    type Kv = CpuKv;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn matrix(&self, w: Weight) -> Result<CpuMat> {
        Ok(CpuMat::new(w))
    }
    fn matrix_as(&self, w: Weight, kind: super::MatKind) -> Result<CpuMat> {
        Ok(match kind {
            super::MatKind::Cols(_, unit) => CpuMat::in_units(w, unit),
            _ => CpuMat::new(w),
        })
    }
    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }
    fn act(&self, rows: usize, cols: usize) -> Result<CpuAct> {
        Ok(CpuAct { rows, cols, data: vec![0.0; rows * cols] })
    }
    fn act_f32(&self, rows: usize, cols: usize) -> Result<CpuAct> {
        self.act(rows, cols)
    }
    fn kv_store(&self, cfg: &ModelConfig, blocks: KvBlocks) -> Result<CpuKv> {
        Ok(CpuKv::new(cfg, blocks))
    }
    fn kv_store_scheme(
        &self,
        cfg: &ModelConfig,
        blocks: KvBlocks,
        scheme: &crate::kv::scheme::KvScheme,
    ) -> Result<CpuKv> {
        CpuKv::with_scheme(cfg, blocks, scheme)
    }
    fn kv_blocks(&self, kv: &CpuKv) -> KvBlocks {
        kv.blocks
    }
    fn kv_row_bytes(&self, kv: &CpuKv, layer: usize) -> usize {
        kv.row_bytes(layer)
    }
    fn kv_export(&self, kv: &CpuKv, layer: usize, rows: &[usize], out: &mut Vec<u8>) -> Result<()> {
        kv.export(layer, rows, out)
    }
    fn kv_import(&self, kv: &mut CpuKv, layer: usize, rows: &[usize], data: &[u8]) -> Result<()> {
        kv.import(layer, rows, data)
    }
    fn embed(&self, table: &CpuMat, tokens: &[u32], scale: f32, out: &mut CpuAct) -> Result<()> {
        ops::embed(table, tokens, scale, &mut out.data);
        Ok(())
    }
    fn rms_norm(&self, x: &CpuAct, w: &Vec<f32>, eps: f32, out: &mut CpuAct) -> Result<()> {
        ops::rms_norm(&x.data, w, eps, &mut out.data);
        Ok(())
    }
    fn rms_norm_heads(&self, x: &mut CpuAct, w: &Vec<f32>, eps: f32) -> Result<()> {
        let x = &mut x.data;
        let mut row = vec![0f32; w.len()];
        for head in x.chunks_exact_mut(w.len()) {
            row.copy_from_slice(head);
            ops::rms_norm(&row, w, eps, head);
        }
        Ok(())
    }
    fn matmul(&self, x: &CpuAct, w: &CpuMat, out: &mut CpuAct) -> Result<()> {
        matmul::matmul_many(&x.data, x.rows, &[w], &mut [&mut out.data]);
        Ok(())
    }
    fn matmul_many(&self, x: &CpuAct, ws: &[&CpuMat], outs: &mut [&mut CpuAct]) -> Result<()> {
        let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|a| a.data.as_mut_slice()).collect();
        matmul::matmul_many(&x.data, x.rows, ws, &mut o);
        Ok(())
    }
    fn add_bias(&self, x: &mut CpuAct, b: &Vec<f32>) -> Result<()> {
        ops::add_bias(&mut x.data, b);
        Ok(())
    }
    fn rope(&self, x: &mut CpuAct, n_heads: usize, spans: &[Span<'_>], rope: &Rope) -> Result<()> {
        let positions = spans.iter().flat_map(|s| s.pos0..s.pos0 + s.rows);
        ops::rope(&mut x.data, x.cols, n_heads, positions, rope);
        Ok(())
    }
    fn attention(
        &self,
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        kv: &mut CpuKv,
        layer: usize,
        spans: &[Span<'_>],
        attend: Attend,
        out: &mut CpuAct,
    ) -> Result<()> {
        kv.write(layer, spans, &k.data, &v.data)?;
        let hd = kv.head_dim;
        attention::attention(&q.data, (q.rows, q.cols / hd, hd), kv, layer, spans, attend, &mut out.data)
    }
    fn glu(&self, gate: &CpuAct, up: &CpuAct, act: Activation, out: &mut CpuAct) -> Result<()> {
        // Row by row in parallel where there are rows enough: alone it is a serial stretch
        // of every batched step (an exp a value) while the other cores wait.
        let w = gate.cols;
        if gate.rows >= PAR_ROWS {
            use rayon::prelude::*;
            let rows = out.data.par_chunks_mut(w).zip(gate.data.par_chunks(w)).zip(up.data.par_chunks(w));
            rows.for_each(|((o, g), u)| ops::glu(g, u, act, o));
        } else {
            ops::glu(&gate.data, &up.data, act, &mut out.data);
        }
        Ok(())
    }
    fn add(&self, x: &mut CpuAct, y: &CpuAct) -> Result<()> {
        ops::add(&mut x.data, &y.data);
        Ok(())
    }
    fn argmax(&self, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        out.data[0] = crate::sample::argmax(&x.data[..x.cols]) as f32;
        Ok(())
    }
    fn top_k(&self, x: &CpuAct, k: usize, inv_t: f32, out: &mut CpuAct) -> Result<()> {
        check_top_k(x.cols, k, out.cols)?;
        let mut cand = Vec::with_capacity(k);
        crate::sample::top_k_into(&x.data[..x.cols], k, inv_t, &mut cand);
        for (i, (t, v)) in cand.into_iter().enumerate() {
            out.data[2 * i] = t as f32;
            out.data[2 * i + 1] = v;
        }
        Ok(())
    }
    fn slice_rows(&self, x: &CpuAct, first: usize) -> Result<CpuAct> {
        Ok(CpuAct { rows: x.rows - first, cols: x.cols, data: x.data[first * x.cols..].to_vec() })
    }
    fn argmax_rows(&self, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        crate::backend::check_argmax_rows(x.rows, x.cols, out.rows * out.cols)?;
        for (o, row) in out.data.iter_mut().zip(x.data.chunks_exact(x.cols)) {
            *o = crate::sample::argmax(row) as f32;
        }
        Ok(())
    }
    fn gather_last_rows(&self, x: &CpuAct, spans: &[Span<'_>], out: &mut CpuAct) -> Result<()> {
        let ends = crate::kv::span_ends(spans);
        crate::backend::check_gather(x.rows, x.cols, spans.len(), ends.last().copied(), (out.rows, out.cols))?;
        let c = x.cols;
        for (i, o) in out.data.chunks_exact_mut(c).enumerate() {
            let r = ends.get(i).copied().unwrap_or(0);
            o.copy_from_slice(&x.data[r * c..(r + 1) * c]);
        }
        Ok(())
    }
    fn read_rows(&self, x: &CpuAct, first: usize) -> Result<Vec<f32>> {
        Ok(x.data[first * x.cols..].to_vec())
    }
}
