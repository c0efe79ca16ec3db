//! The attention block (attention_block.cuh: q/k/v, RoPE, the cache write, attention and
//! the o projection's residual add in one launch of kv-group clusters) against the CPU's
//! composition of the same ops, at the SmolLM2 and Llama-3.2-1B attention shapes, over
//! decode steps after a prefill, on a short and a deep cache.

use super::{attn_cfg, bf, check, cpu, gpu, other_decode_path_matches_cpu, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::{Backend, Rope};
use ferrolm::config::RopeStyle;
use ferrolm::quant::{AffineTensor, ScaleDtype, Weight};

#[test]
fn attention_block_matches_cpu() {
    let (g, c) = (gpu(), Cpu);
    let mut r = Rng::seeded();
    let before = g.attention_block_on();
    g.set_attention_block(true);
    let launched = g.attention_block_launches();
    // (heads, kv heads, head dim, RoPE, weight format, cache, prefilled positions)
    let cases = [
        (9, 3, 64, RopeStyle::Half, (4, 32, ScaleDtype::F16), 1100, 300),
        (32, 8, 64, RopeStyle::Interleaved, (4, 64, ScaleDtype::BF16), 1100, 300),
        (9, 3, 64, RopeStyle::Half, (8, 64, ScaleDtype::BF16), 8192, 5000),
    ];
    for (heads, n_kv, hd, style, (bits, group, dt), cache, fill) in cases {
        let name = format!("{heads}/{n_kv}x{hd} q{bits} g{group} {dt:?} cache {cache}");
        let cfg = attn_cfg(heads, n_kv, hd, 2, style);
        let hidden = cfg.hidden;
        let rope = Rope { inv_freq: cfg.rope_inv_freq(), style, linear: 1.0 };
        let mut mat = |rows: usize, cols: usize| {
            let w = AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, bits, group, dt).unwrap();
            let w = Weight::Affine(w);
            (g.matrix(w.clone()).unwrap(), w)
        };
        let (qd, kvd) = (heads * hd, n_kv * hd);
        let (wq, wk, wv, wo) = (mat(qd, hidden), mat(kvd, hidden), mat(kvd, hidden), mat(hidden, qd));
        let norm = r.v(hidden, 1.0);
        let ng = g.vector(norm.clone()).unwrap();
        let mut kvg = g.kv_cache(&cfg, cache).unwrap();
        let mut kvc = c.kv_cache(&cfg, cache).unwrap();
        let layer = 1;
        // The cached positions, through both backends' own ops.
        let (q, k, v) = (bf(&r.v(fill * qd, 1.0)), bf(&r.v(fill * kvd, 1.0)), bf(&r.v(fill * kvd, 1.0)));
        g.begin(&[], 0).unwrap();
        let (mut qg, mut kg) = (g.act_from(fill, qd, &q).unwrap(), g.act_from(fill, kvd, &k).unwrap());
        let mut og = g.act(fill, qd).unwrap();
        let vg = g.act_from(fill, kvd, &v).unwrap();
        g.rope_attention(&mut qg, &mut kg, &vg, &mut kvg, layer, 0, &rope, (heads, n_kv), &mut og).unwrap();
        let (mut qc, mut kc, mut oc) = (cpu(fill, qd, q), cpu(fill, kvd, k), c.act(fill, qd).unwrap());
        c.rope_attention(&mut qc, &mut kc, &cpu(fill, kvd, v), &mut kvc, layer, 0, &rope, (heads, n_kv), &mut oc)
            .unwrap();
        // Decode steps: each reads the k/v the step before wrote to the cache.
        for pos in fill..fill + 3 {
            let x = r.v(hidden, 20.0); // the f32 residual stream
            let mut xg = g.act_from_f32(1, hidden, &x).unwrap();
            let (mut q1, mut k1, mut v1) = (
                g.act_poisoned(1, qd, false).unwrap(),
                g.act_poisoned(1, kvd, false).unwrap(),
                g.act_poisoned(1, kvd, false).unwrap(),
            );
            let mut att = g.act_poisoned(1, qd, false).unwrap();
            g.begin(&[], pos).unwrap();
            let ws = (&wq.0, &wk.0, &wv.0, &wo.0);
            let scratch = (&mut q1, &mut k1, &mut v1, &mut att);
            let taken = g.attention_block(&mut xg, (&ng, 1e-5), ws, &mut kvg, layer, &rope, scratch).unwrap();
            assert!(taken, "{name}: the attention block declined");
            let mut xc = cpu(1, hidden, x.clone());
            let (mut xn, mut tmp) = (c.act(1, hidden).unwrap(), c.act(1, hidden).unwrap());
            let (mut q1c, mut k1c, mut v1c) = (c.act(1, qd).unwrap(), c.act(1, kvd).unwrap(), c.act(1, kvd).unwrap());
            let mut attc = c.act(1, qd).unwrap();
            let qkv = [&wq.1, &wk.1, &wv.1];
            c.norm_matmul_many(&xc, &norm, 1e-5, &mut xn, &qkv, &mut [&mut q1c, &mut k1c, &mut v1c]).unwrap();
            c.rope_attention(&mut q1c, &mut k1c, &v1c, &mut kvc, layer, pos, &rope, (heads, n_kv), &mut attc).unwrap();
            c.matmul_add(&attc, &wo.1, &mut xc, &mut tmp).unwrap();
            check(
                &format!("attention block: attention {name} pos {pos}"),
                &g.read_rows(&att, 0).unwrap(),
                &attc.data,
                1e-2,
            );
            // The residual itself is exact: compare what was added to it.
            let delta = |v: Vec<f32>| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
            let got = delta(g.read_rows(&xg, 0).unwrap());
            check(&format!("attention block: x += o·att {name} pos {pos}"), &got, &delta(xc.data), 1e-2);
        }
    }
    g.set_attention_block(before);
    assert!(g.attention_block_launches() >= launched + 9, "every step took the attention block");
}

/// SmolLM2 decode steps through the attention block against the CPU (and beside the op
/// path): its o projection sums each row over the clusters' partials, so it is not the op
/// path bit for bit, but must meet the model parity bar and be deterministic.
#[test]
fn attention_block_decode_matches_cpu() {
    other_decode_path_matches_cpu("attention block", &|g, on| g.set_attention_block(on), &|g| {
        g.attention_block_launches()
    });
}
