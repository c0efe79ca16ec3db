//! Dense KV cache: bf16 storage, f32 math. Layout per layer: `[slots, n_kv·hd]`, position p
//! in row p mod slots (`super::layer_slots`: every position, or a sliding layer's ring).

use half::bf16;

pub struct DenseKv {
    pub max_seq: usize,
    /// n_kv_heads · head_dim
    pub width: usize,
    pub head_dim: usize,
    /// Rows of each layer's cache.
    pub slots: Vec<usize>,
    pub k: Vec<Vec<bf16>>,
    pub v: Vec<Vec<bf16>>,
}

impl DenseKv {
    /// Every layer holding all max_seq positions.
    pub fn new(n_layers: usize, max_seq: usize, n_kv_heads: usize, head_dim: usize) -> DenseKv {
        DenseKv::with_slots(vec![max_seq; n_layers], max_seq, n_kv_heads, head_dim)
    }

    /// Layer i holding `slots[i]` rows (≤ max_seq).
    pub fn with_slots(slots: Vec<usize>, max_seq: usize, n_kv_heads: usize, head_dim: usize) -> DenseKv {
        let width = n_kv_heads * head_dim;
        // Poison-free zero init; positions past the written length are never read.
        let layer = |s: usize| vec![bf16::ZERO; s * width];
        DenseKv {
            max_seq,
            width,
            head_dim,
            k: slots.iter().map(|&s| layer(s)).collect(),
            v: slots.iter().map(|&s| layer(s)).collect(),
            slots,
        }
    }

    /// Row of position p in `layer`'s cache.
    pub fn slot(&self, layer: usize, p: usize) -> usize {
        p % self.slots[layer]
    }

    /// Store rows `[m, width]` of k and v at positions pos0.. of `layer`.
    pub fn write(&mut self, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let w = self.width;
        for (r, (kr, vr)) in k.chunks_exact(w).zip(v.chunks_exact(w)).enumerate() {
            let s = self.slot(layer, pos0 + r) * w;
            for (d, x) in self.k[layer][s..s + w].iter_mut().zip(kr) {
                *d = bf16::from_f32(*x);
            }
            for (d, x) in self.v[layer][s..s + w].iter_mut().zip(vr) {
                *d = bf16::from_f32(*x);
            }
        }
    }

    pub fn byte_size(&self) -> usize {
        2 * self.slots.iter().sum::<usize>() * self.width * 2
    }
}
