//! Element-wise and per-row CPU ops: RMSNorm, RoPE, SwiGLU, residual add, embedding gather.

use crate::backend::Rope;
use crate::config::RopeStyle;
use crate::quant::Weight;

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

/// Rotate every head of every row; row i is at position pos0 + i. Angles are computed in
/// f32 as pos·inv_freq, the way the reference implementations do.
pub fn rope(x: &mut [f32], row_width: usize, n_heads: usize, pos0: usize, rope: &Rope) {
    let hd = row_width / n_heads;
    let half = hd / 2;
    let mut cs = vec![(0f32, 0f32); half];
    for (i, row) in x.chunks_exact_mut(row_width).enumerate() {
        let pos = (pos0 + i) as f32 / rope.linear;
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

/// out = silu(gate) · up
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
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

/// out[i] = table[tokens[i]] (dequantized row).
pub fn embed(table: &Weight, tokens: &[u32], out: &mut [f32]) {
    let d = table.cols();
    for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(d)) {
        table.row_f32(t as usize, row);
    }
}
