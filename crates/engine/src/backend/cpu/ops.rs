//! Element-wise and per-row CPU ops: RMSNorm, RoPE, SwiGLU/GeGLU, residual add, embedding gather.

use crate::backend::Rope;
use crate::config::{Activation, RopeStyle};

/// out = x · rsqrt(mean(x²) + eps) · w, per row of width w.len() (f32 throughout, as HF).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = g * (v * r);
        }
    }
}

/// Rotate every head of every row; row i is at position positions[i]. Angles are computed
/// in f32 as pos·inv_freq, the way the reference implementations do.
pub fn rope(x: &mut [f32], row_width: usize, n_heads: usize, positions: impl IntoIterator<Item = usize>, rope: &Rope) {
    let hd = row_width / n_heads;
    let half = hd / 2;
    let mut cs = vec![(0f32, 0f32); half];
    for (row, p) in x.chunks_exact_mut(row_width).zip(positions) {
        let pos = p as f32 / rope.linear;
        for (c, &f) in cs.iter_mut().zip(&rope.inv_freq) {
            let a = pos * f;
            *c = (a.cos(), a.sin());
        }
        for head in row.chunks_exact_mut(hd) {
            for (j, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match rope.style {
                    RopeStyle::Interleaved => (2 * j, 2 * j + 1),
                    RopeStyle::Half => (j, j + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// out = act(gate) · up
pub fn glu(gate: &[f32], up: &[f32], act: Activation, out: &mut [f32]) {
    let f = match act {
        Activation::Silu => silu,
        Activation::GeluTanh => gelu_tanh,
    };
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = f(g) * u;
    }
}

pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// gelu's tanh approximation, ½·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))), as PyTorch's
/// `gelu(approximate="tanh")`.
pub fn gelu_tanh(g: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)).tanh())
}

pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// x[row] += b for every row.
pub fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        add(row, b);
    }
}

/// out[i] = table[tokens[i]] · scale (dequantized row).
pub fn embed(table: &super::CpuMat, tokens: &[u32], scale: f32, out: &mut [f32]) {
    let d = table.cols();
    for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(d)) {
        table.row_f32(t as usize, row);
        if scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= scale);
        }
    }
}
