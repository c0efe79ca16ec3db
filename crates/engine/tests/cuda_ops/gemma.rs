//! Two Gemma 3 layers (the 270M's shapes, 4-bit weights) through CUDA's decode path against
//! the CPU's `layer_ops`: the q/k norms folded into decode attention, the post-norm adds
//! folded into the next GEMV's staging (gate/up, the second layer's q/k/v) with the last
//! one after the layers, GeGLU in the gate/up GEMV's store, a sliding window shorter than
//! the context, and the prefill ops (m > 1) before it.

use super::{gpu, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::{Attend, Backend, DecodeLayer, LayerScratch, LayerShape, LayerWeights, Rope};
use ferrolm::config::{Activation, RopeStyle};
use ferrolm::kv::{blocks_for, InOrder};
use ferrolm::model::decoder::layer_ops;
use ferrolm::quant::{AffineTensor, ScaleDtype, Weight};

const D: usize = 640;
const HEADS: usize = 4;
const HD: usize = 256;
const FFN: usize = 2048;

/// One layer's weights on backend B: norms (attn, q, k, post-attn, pre-MLP, post-MLP) and
/// matrices (q, k, v, o, gate, up, down).
struct Layer<B: Backend> {
    norms: Vec<B::Vector>,
    mats: Vec<B::Mat>,
}

impl<B: Backend> Layer<B> {
    fn new(b: &B, norms: &[Vec<f32>], mats: &[Weight]) -> Self {
        Layer {
            norms: norms.iter().map(|n| b.vector(n.clone()).unwrap()).collect(),
            mats: mats.iter().map(|w| b.matrix(w.clone()).unwrap()).collect(),
        }
    }
    fn weights(&self) -> LayerWeights<'_, B> {
        let (n, m) = (&self.norms, &self.mats);
        LayerWeights {
            attn_norm: &n[0],
            wq: &m[0],
            wk: &m[1],
            wv: &m[2],
            qkv_bias: None,
            qk_norm: Some([&n[1], &n[2]]),
            wo: &m[3],
            post_attn_norm: Some(&n[3]),
            mlp_norm: &n[4],
            w_gate: &m[4],
            w_up: &m[5],
            w_down: &m[6],
            post_mlp_norm: Some(&n[5]),
        }
    }
}

/// m rows' scratch on backend B.
fn scratch<B: Backend>(b: &B, m: usize) -> Vec<B::Act> {
    [D, HEADS * HD, HD, HD, HEADS * HD, D, FFN, FFN, FFN].iter().map(|&c| b.act(m, c).unwrap()).collect()
}

/// The layers one after another on x at pos0: `layer_ops` (m > 1) or `decode_layers`
/// (m = 1: on CUDA the post-norm adds carried from layer to layer).
fn run<B: Backend>(
    b: &B,
    ls: &[Layer<B>],
    x: &mut B::Act,
    kv: &mut B::Kv,
    pos0: usize,
    rope: &Rope,
    shape: LayerShape,
) {
    let m = b.read_rows(x, 0).unwrap().len() / D;
    let t = InOrder::new(b.kv_blocks(kv));
    let at = [t.span(pos0, m)];
    b.begin(&vec![0; m], &at, false).unwrap();
    let mut s = scratch(b, m);
    let [xn, q, k, v, att, o, gate, up, act] = &mut s[..] else { unreachable!() };
    let mut s = LayerScratch { xn, q, k, v, att, o, gate, up, act };
    let layers: Vec<DecodeLayer<'_, B>> =
        ls.iter().enumerate().map(|(index, l)| DecodeLayer { weights: l.weights(), index, rope, shape }).collect();
    match m {
        1 => b.decode_layers(&layers, (x, &mut b.act_f32(1, D).unwrap()), kv, &at, s).unwrap(),
        _ => {
            for l in &layers {
                layer_ops(b, &l.weights, x, kv, l.index, &at, rope, shape, s.reborrow()).unwrap();
            }
        }
    }
}

#[test]
fn gemma3_layer_decode_matches_cpu() {
    let (g, c, mut r) = (gpu(), Cpu, Rng::seeded());
    let q4 = |r: &mut Rng, rows: usize, cols: usize| {
        Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, 4, 32, ScaleDtype::F16).unwrap())
    };
    let (mut lg, mut lc) = (vec![], vec![]);
    for _ in 0..2 {
        let mats: Vec<Weight> = [(HEADS * HD, D), (HD, D), (HD, D), (D, HEADS * HD), (FFN, D), (FFN, D), (D, FFN)]
            .iter()
            .map(|&(a, b)| q4(&mut r, a, b))
            .collect();
        let norms: Vec<Vec<f32>> =
            [D, HD, HD, D, D, D].iter().map(|&n| r.v(n, 0.3).into_iter().map(|v| 1.0 + v).collect()).collect();
        lg.push(Layer::new(g, &norms, &mats));
        lc.push(Layer::new(&c, &norms, &mats));
    }
    let cfg = super::attn_cfg(HEADS, 1, HD, 2, RopeStyle::Half);
    let folds = g.post_norm_folds();
    let rope = Rope { inv_freq: cfg.rope_inv_freq(), style: RopeStyle::Half, linear: 1.0 };
    for window in [None, Some(9)] {
        let attend = Attend { scale: 0.0625, window };
        let shape = LayerShape { heads: HEADS, kv_heads: 1, eps: 1e-6, act: Activation::GeluTanh, attend };
        let (mut kvg, mut kvc) =
            (g.kv_store(&cfg, blocks_for(&cfg, 64)).unwrap(), c.kv_store(&cfg, blocks_for(&cfg, 64)).unwrap());
        let mut pos = 0;
        for m in [20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] {
            let x = r.v(m * D, 3.0);
            let mut xg = g.act_from_f32(m, D, &x).unwrap();
            let mut xc = super::cpu(m, D, x.clone());
            run(g, &lg, &mut xg, &mut kvg, pos, &rope, shape);
            run(&c, &lc, &mut xc, &mut kvc, pos, &rope, shape);
            // The layer's update (the residual itself is exact).
            let delta = |v: Vec<f32>| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
            let what = format!("Gemma 3 layers, window {window:?}, m{m} at {pos}");
            super::check(&what, &delta(g.read_rows(&xg, 0).unwrap()), &delta(xc.data), 2e-2);
            pos += m;
        }
    }
    // Three folds a decode step (gate/up twice, the second layer's q/k/v), 12 steps per window.
    assert_eq!(g.post_norm_folds() - folds, 2 * 12 * 3, "post-norm folds taken");
}
