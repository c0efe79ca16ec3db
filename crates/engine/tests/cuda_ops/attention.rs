//! Attention on CUDA against the CPU's: cache write and causal attention over prefill and
//! decode steps, with and without RoPE fused in, sliding windows included.

use super::{bf, check, cpu, gpu, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::backend::{Attend, Backend, Rope};
use ferrolm::config::RopeStyle;
use ferrolm::kv::{blocks_for, InOrder};

/// An attention-only model shape: `heads`/`n_kv` heads of `hd`, `layers` layers.
pub fn attn_cfg(heads: usize, n_kv: usize, hd: usize, layers: usize, style: RopeStyle) -> ferrolm::config::ModelConfig {
    ferrolm::config::ModelConfig {
        hidden: heads * hd,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        ffn: 64,
        vocab: 8,
        max_ctx: 1 << 20,
        rope_style: style,
        tie_embeddings: true,
        ..Default::default()
    }
}

/// One `attention` call (cache write + causal attention) on both backends with fresh random
/// q/k/v for `m` rows at `pos`: the GPU output, the CPU reference, and the GPU q.
pub fn attention_both(
    r: &mut Rng,
    kvg: &mut ferrolm::backend::cuda::CudaKv,
    kvc: &mut <Cpu as Backend>::Kv,
    (heads, n_kv, hd): (usize, usize, usize),
    m: usize,
    pos: usize,
    attend: Attend,
) -> (ferrolm::backend::cuda::CudaAct, Vec<f32>, ferrolm::backend::cuda::CudaAct) {
    let (g, c) = (gpu(), Cpu);
    let q = bf(&r.v(m * heads * hd, 1.0));
    let k = bf(&r.v(m * n_kv * hd, 1.0));
    let v = bf(&r.v(m * n_kv * hd, 1.0));
    let qg = g.act_from(m, heads * hd, &q).unwrap();
    let mut og = g.act_poisoned(m, heads * hd, false).unwrap();
    let t = InOrder::new(g.kv_blocks(kvg));
    g.begin(&[], &[t.span(pos, m)], false).unwrap();
    let (kg, vg) = (g.act_from(m, n_kv * hd, &k).unwrap(), g.act_from(m, n_kv * hd, &v).unwrap());
    g.attention(&qg, &kg, &vg, kvg, 0, &[t.span(pos, m)], attend, &mut og).unwrap();
    let mut oc = c.act(m, heads * hd).unwrap();
    let (qc, kc, vc) = (cpu(m, heads * hd, q), cpu(m, n_kv * hd, k), cpu(m, n_kv * hd, v));
    c.attention(&qc, &kc, &vc, kvc, 0, &[t.span(pos, m)], attend, &mut oc).unwrap();
    (og, oc.data, qg)
}

/// One `rope_attention` call (RoPE, cache write, causal attention) on `g` and the CPU with
/// fresh random q/k/v for `m` rows at `pos` of layer 1: the GPU output and the CPU's.
pub fn rope_attention_both(
    g: &Cuda,
    r: &mut Rng,
    (kvg, kvc): (&mut ferrolm::backend::cuda::CudaKv, &mut <Cpu as Backend>::Kv),
    (heads, n_kv, hd): (usize, usize, usize),
    rope: &Rope,
    (m, pos): (usize, usize),
    attend: Attend,
) -> (Vec<f32>, Vec<f32>) {
    let c = Cpu;
    let q = bf(&r.v(m * heads * hd, 1.0));
    let k = bf(&r.v(m * n_kv * hd, 1.0));
    let v = bf(&r.v(m * n_kv * hd, 1.0));
    let mut og = g.act_poisoned(m, heads * hd, false).unwrap();
    let t = InOrder::new(g.kv_blocks(kvg));
    let at = [t.span(pos, m)];
    g.begin(&[], &at, false).unwrap();
    let (mut qg, mut kg) = (g.act_from(m, heads * hd, &q).unwrap(), g.act_from(m, n_kv * hd, &k).unwrap());
    let vg = g.act_from(m, n_kv * hd, &v).unwrap();
    g.rope_attention(&mut qg, &mut kg, &vg, kvg, 1, &at, rope, (heads, n_kv), attend, &mut og).unwrap();
    let mut oc = c.act(m, heads * hd).unwrap();
    let (mut qc, mut kc, vc) = (cpu(m, heads * hd, q), cpu(m, n_kv * hd, k), cpu(m, n_kv * hd, v));
    c.rope_attention(&mut qc, &mut kc, &vc, kvc, 1, &at, rope, (heads, n_kv), attend, &mut oc).unwrap();
    (g.read_rows(&og, 0).unwrap(), oc.data)
}

#[test]
fn attention_matches_cpu_prefill_and_decode() {
    let (g, c) = (gpu(), Cpu);
    let mut r = Rng::seeded();
    for (heads, n_kv, hd) in [(9, 3, 64), (32, 8, 64), (16, 2, 128)] {
        let cfg = attn_cfg(heads, n_kv, hd, 1, RopeStyle::Half);
        // a small cache (one split), then a large one (several splits, some past the length)
        for (cache, steps) in [(64, vec![37usize, 1, 1, 1]), (1100, vec![300, 1, 1, 513, 1])] {
            let mut kvg = g.kv_store(&cfg, blocks_for(&cfg, cache)).unwrap();
            let mut kvc = c.kv_store(&cfg, blocks_for(&cfg, cache)).unwrap();
            let mut pos = 0;
            for m in steps {
                let attend = Attend::causal(hd);
                let (og, want, _) = attention_both(&mut r, &mut kvg, &mut kvc, (heads, n_kv, hd), m, pos, attend);
                check(
                    &format!("attention {heads}/{n_kv}x{hd} cache{cache} m{m} pos{pos}"),
                    &g.read_rows(&og, 0).unwrap(),
                    &want,
                    1e-2,
                );
                pos += m;
            }
        }
    }
}

/// RoPE + cache write + attention (one launch each on CUDA for a single token) against the
/// CPU's rope, rope, attention, over prefill and decode steps: with the defaults (one query
/// head a decode block at these depths), then with a GQA group's heads a block at every
/// depth (the tensor cores at head dims 64 and 128, CUDA cores at the others).
#[test]
fn rope_attention_matches_cpu() {
    let grouped = CudaConfig { attention_query_heads: 4, attention_mma_positions: 0, ..CudaConfig::default() };
    let grouped = Cuda::with_config(0, grouped).unwrap();
    for (name, g) in [("one head a block", gpu()), ("a group's heads a block", &grouped)] {
        rope_attention_cases(name, g);
    }
}

fn rope_attention_cases(name: &str, g: &Cuda) {
    let c = Cpu;
    let mut r = Rng::seeded();
    let (short, tail): (&[usize], &[usize]) = (&[300, 1, 1, 200, 1, 1], &[1; 12]);
    // Caches over 1 024 positions split into single blocks merged through global memory by
    // the last one (deep: many splits); shorter ones into one cluster per head, merged in
    // rank 0's shared memory (directly for head dims up to 128; 256 the two-level way),
    // including splits with no position yet (the decode-only tail from position 0).
    // The last cases are sliding-window layers (Gemma 3's 270M shape among them) with their
    // own query scale: windows shorter than a prefill chunk, than a split, and crossing
    // splits, clusters and flash tiles.
    let causal = |hd: usize| Attend::causal(hd);
    let window = |w: usize, scale: f32| Attend { scale, window: Some(w) };
    let cases = [
        (9, 3, 64, RopeStyle::Half, 8192, &[300, 1, 1, 5700, 1, 1][..], causal(64)),
        (32, 8, 64, RopeStyle::Interleaved, 1100, short, causal(64)),
        (16, 2, 128, RopeStyle::Half, 1100, short, causal(128)),
        (32, 8, 64, RopeStyle::Half, 640, short, causal(64)),
        (16, 2, 128, RopeStyle::Interleaved, 1024, short, causal(128)),
        (8, 8, 32, RopeStyle::Half, 512, tail, causal(32)),
        (4, 2, 256, RopeStyle::Half, 512, tail, causal(256)),
        (4, 1, 256, RopeStyle::Half, 1100, &[600, 1, 1, 300, 1][..], window(512, 0.0625)),
        (9, 3, 64, RopeStyle::Half, 8192, &[300, 1, 1, 5700, 1, 1][..], window(1000, 0.2)),
        (16, 2, 128, RopeStyle::Interleaved, 640, short, window(37, 0.1)),
        (8, 8, 32, RopeStyle::Half, 512, tail, window(5, 0.3)),
    ];
    for (heads, n_kv, hd, style, cache, steps, attend) in cases {
        let cfg = attn_cfg(heads, n_kv, hd, 2, style);
        let rope = Rope { inv_freq: cfg.rope_inv_freq(), style, linear: 1.0 };
        let mut kvg = g.kv_store(&cfg, blocks_for(&cfg, cache)).unwrap();
        let mut kvc = c.kv_store(&cfg, blocks_for(&cfg, cache)).unwrap();
        let mut pos = 0;
        for &m in steps {
            let (got, want) =
                rope_attention_both(g, &mut r, (&mut kvg, &mut kvc), (heads, n_kv, hd), &rope, (m, pos), attend);
            let what =
                format!("rope_attention ({name}) {heads}/{n_kv}x{hd} {style:?} cache {cache} m{m} pos{pos} {attend:?}");
            check(&what, &got, &want, 1e-2);
            pos += m;
        }
    }
}
