//! A generated call's rows (`Backend::begin_generated`) through the decode step's kernels,
//! batched: each row's outputs are the bits the one-row decode ops give that row alone, at
//! any row count (tokens a GEMV block stages: 1, 2, 4 or 8), for every fused GEMV form of a
//! Llama layer at the 1B shape and in another weight format: q/k/v with the norm staged,
//! o and down adding into the residual (down over two K slices), gate/up with SwiGLU and
//! GeGLU, the MLP with down's input staged by gate/up, and the head.

use super::{gpu, Rng};
use ferrolm::backend::cuda::{Cuda, CudaMat};
use ferrolm::backend::Backend;
use ferrolm::config::Activation;
use ferrolm::quant::{AffineTensor, ScaleDtype, Weight};

/// A layer's matrices and the head: q, k, v, o, gate, up, down, head.
struct Mats(Vec<CudaMat>);

/// Every output of the ops over `b` rows of inputs `x` (f32 residual rows, d wide), `ya`
/// (bf16, d) and `yf` (bf16, f), flattened, in op order.
fn outputs(g: &Cuda, m: &Mats, norm: &[f32], (x, ya, yf): (&[f32], &[f32], &[f32]), b: usize) -> Vec<Vec<f32>> {
    let [wq, wk, wv, wo, wg, wu, wd, wh] = &m.0[..] else { unreachable!() };
    let (d, f) = (x.len() / b, yf.len() / b);
    let ng = g.vector(norm.to_vec()).unwrap();
    let rows = |n: usize, f32_out: bool| g.act_poisoned(b, n, f32_out).unwrap();
    let xg = g.act_from_f32(b, d, x).unwrap();
    let mut xn = g.act(b, d).unwrap();
    let mut out = vec![];
    // norm → q/k/v, one launch
    let (mut q, mut k, mut v) = (rows(wq.rows(), false), rows(wk.rows(), false), rows(wv.rows(), false));
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[wq, wk, wv], &mut [&mut q, &mut k, &mut v]).unwrap();
    out.extend([&q, &k, &v].map(|a| g.read_rows(a, 0).unwrap()));
    // o and down adding into the residual
    let mut tmp = g.act(b, d).unwrap();
    for (w, y) in [(wo, ya), (wd, yf)] {
        let yg = g.act_from(b, y.len() / b, y).unwrap();
        let mut r = g.act_from_f32(b, d, x).unwrap();
        g.matmul_add(&yg, w, &mut r, &mut tmp).unwrap();
        out.push(g.read_rows(&r, 0).unwrap());
    }
    // norm → gate/up → SwiGLU, GeGLU
    for act in [Activation::Silu, Activation::GeluTanh] {
        let (mut gt, mut up, mut o) = (g.act(b, f).unwrap(), g.act(b, f).unwrap(), rows(f, false));
        g.norm_glu(&xg, (&ng, 1e-5), &mut xn, (wg, wu), act, &mut gt, &mut up, &mut o).unwrap();
        out.push(g.read_rows(&o, 0).unwrap());
    }
    // the MLP, down's input staged by gate/up where the shape allows it
    let mut r = g.act_from_f32(b, d, x).unwrap();
    let (mut gt, mut up, mut o) = (g.act(b, f).unwrap(), g.act(b, f).unwrap(), rows(f, false));
    let before = g.staged_x_launches();
    g.decode_mlp(&mut r, (&ng, 1e-5), (wg, wu, wd), Activation::Silu, (&mut xn, &mut gt, &mut up, &mut tmp), &mut o)
        .unwrap();
    assert_eq!(g.staged_x_launches() - before, usize::from(f >= 4096), "staged MLP at {b} rows");
    out.extend([g.read_rows(&r, 0).unwrap(), g.read_rows(&o, 0).unwrap()]);
    // the final norm → head (f32 logits)
    let mut logits = rows(wh.rows(), true);
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[wh], &mut [&mut logits]).unwrap();
    out.push(g.read_rows(&logits, 0).unwrap());
    out
}

#[test]
fn generated_rows_get_the_one_row_decode_bits() {
    // A device of its own: a generated call leaves its mode set until the next begin.
    let g = Cuda::new(0).unwrap();
    let _ = gpu();
    let mut r = Rng::seeded();
    // (d, kv width, ffn, vocab, bits, group, scales): the 1B shape, and 8-bit weights.
    let shapes = [(2048, 512, 8192, 32768, 4, 64, ScaleDtype::BF16), (576, 192, 1536, 4096, 8, 32, ScaleDtype::F16)];
    for (d, kvd, f, vocab, bits, group, dt) in shapes {
        let mut mat = |rows: usize, cols: usize| {
            let w = AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, bits, group, dt).unwrap();
            g.matrix(Weight::Affine(w)).unwrap()
        };
        let dims = [(d, d), (kvd, d), (kvd, d), (d, d), (f, d), (f, d), (d, f), (vocab, d)];
        let m = Mats(dims.iter().map(|&(rows, cols)| mat(rows, cols)).collect());
        let norm = r.v(d, 1.0);
        for b in [2, 3, 6, 8, 16] {
            let name = format!("d{d} q{bits}, {b} rows");
            let (x, ya, yf) = (r.v(b * d, 20.0), super::bf(&r.v(b * d, 1.0)), super::bf(&r.v(b * f, 1.0)));
            g.begin_generated(&[], &[]).unwrap();
            let batched = outputs(&g, &m, &norm, (&x, &ya, &yf), b);
            for i in 0..b {
                g.begin(&[], &[], false).unwrap();
                let one = |v: &[f32], w: usize| v[i * w..(i + 1) * w].to_vec();
                let alone = outputs(&g, &m, &norm, (&one(&x, d), &one(&ya, d), &one(&yf, f)), 1);
                for (k, (a, bt)) in alone.iter().zip(&batched).enumerate() {
                    let w = a.len();
                    let got = &bt[i * w..(i + 1) * w];
                    let same = a.iter().zip(got).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same, "{name}: output {k} of row {i} differs from the row alone");
                }
            }
        }
    }
}
