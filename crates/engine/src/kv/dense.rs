//! Dense KV cache: bf16 storage, f32 math. Layout per layer: `[max_seq, n_kv·hd]`.

use half::bf16;

pub struct DenseKv {
    pub max_seq: usize,
    /// n_kv_heads · head_dim
    pub width: usize,
    pub head_dim: usize,
    pub k: Vec<Vec<bf16>>,
    pub v: Vec<Vec<bf16>>,
}

impl DenseKv {
    pub fn new(n_layers: usize, max_seq: usize, n_kv_heads: usize, head_dim: usize) -> DenseKv {
        let width = n_kv_heads * head_dim;
        // Poison-free zero init; positions past the written length are never read.
        let layer = || vec![bf16::ZERO; max_seq * width];
        DenseKv {
            max_seq,
            width,
            head_dim,
            k: (0..n_layers).map(|_| layer()).collect(),
            v: (0..n_layers).map(|_| layer()).collect(),
        }
    }

    /// Store rows `[m, width]` of k and v at positions pos0.. of `layer`.
    pub fn write(&mut self, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let s = pos0 * self.width;
        for (d, x) in self.k[layer][s..s + k.len()].iter_mut().zip(k) {
            *d = bf16::from_f32(*x);
        }
        for (d, x) in self.v[layer][s..s + v.len()].iter_mut().zip(v) {
            *d = bf16::from_f32(*x);
        }
    }

    pub fn byte_size(&self) -> usize {
        2 * self.k.len() * self.max_seq * self.width * 2
    }
}
