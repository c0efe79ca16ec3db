//! Flash-attention prefill vs the CPU reference.

use super::{bf, check, gpu, Rng};
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::{Attend, Backend};
use ferrolm::config::{ModelConfig, RopeStyle};
use ferrolm::kv::{blocks_for, InOrder};

fn config(heads: usize, n_kv: usize, hd: usize) -> ModelConfig {
    super::attn_cfg(heads, n_kv, hd, 1, RopeStyle::Half)
}

/// Each step writes its k/v rows with the GPU `attention` op (the split-K kernels), then
/// `flash_prefill` over the same cache must match the CPU attention of the same rows.
#[test]
fn flash_prefill_matches_cpu() {
    let (g, c) = (gpu(), Cpu);
    let mut r = Rng::seeded();
    // Full causal attention, then sliding windows (with a query scale of their own) shorter
    // than a key tile, than a query block, and longer than the first prompt.
    let windows = [None, Some(5), Some(100), Some(120)];
    for ((heads, n_kv, hd), window) in
        [(9, 3, 64), (32, 8, 64), (16, 2, 128), (8, 1, 256)].into_iter().flat_map(|s| windows.map(|w| (s, w)))
    {
        let cfg = config(heads, n_kv, hd);
        let attend = Attend { scale: window.map_or(1.0 / (hd as f32).sqrt(), |_| 0.09), window };
        // A short prompt (one partial 64-row block); a prompt of several blocks, a decode row,
        // then a chunk after that context (pos0 301: key tiles straddle the diagonal); a lone
        // row at depth 100.
        for steps in [vec![37usize], vec![300, 1, 200], vec![100, 1]] {
            let mut kvg = g.kv_store(&cfg, blocks_for(&cfg, 512)).unwrap();
            let mut kvc = c.kv_store(&cfg, blocks_for(&cfg, 512)).unwrap();
            let mut pos = 0;
            for m in steps {
                let (split, want, qg) =
                    super::attention_both(&mut r, &mut kvg, &mut kvc, (heads, n_kv, hd), m, pos, attend);
                let what = format!("{heads}/{n_kv}x{hd} m{m} pos{pos} window {window:?}");
                // the cache writer and the reference kernels agree first
                check(&format!("split-K attention {what}"), &g.read_rows(&split, 0).unwrap(), &want, 1e-2);
                let mut og = g.act_poisoned(m, heads * hd, false).unwrap();
                g.flash_prefill(&qg, &kvg, 0, attend, &mut og).unwrap();
                check(&format!("flash_prefill {what}"), &g.read_rows(&og, 0).unwrap(), &want, 1e-2);
                pos += m;
            }
        }
    }
}

#[test]
fn flash_prefill_refuses_what_it_cannot_run() {
    let g = gpu();
    let mut r = Rng::seeded();
    // head_dim 96: the cache is fine, flash_attention.cu is not compiled for it.
    let kv = g.kv_store(&config(4, 2, 96), blocks_for(&config(4, 2, 96), 64)).unwrap();
    let q = g.act_from(3, 4 * 96, &bf(&r.v(3 * 4 * 96, 1.0))).unwrap();
    g.begin(&[], &[InOrder::new(g.kv_blocks(&kv)).span(0, 3)], false).unwrap();
    let e =
        g.flash_prefill(&q, &kv, 0, Attend::causal(96), &mut g.act_poisoned(3, 4 * 96, false).unwrap()).unwrap_err();
    assert!(matches!(e, ferrolm::Error::Unsupported(_)), "{e}");
    let kv = g.kv_store(&config(6, 2, 64), blocks_for(&config(6, 2, 64), 64)).unwrap();
    let q = g.act_from(3, 6 * 64, &bf(&r.v(3 * 6 * 64, 1.0))).unwrap();
    // out of the wrong shape, a layer the cache lacks, f32 output, heads not a multiple of n_kv
    assert!(g.flash_prefill(&q, &kv, 0, Attend::causal(64), &mut g.act_poisoned(2, 6 * 64, false).unwrap()).is_err());
    assert!(g.flash_prefill(&q, &kv, 1, Attend::causal(64), &mut g.act_poisoned(3, 6 * 64, false).unwrap()).is_err());
    assert!(g.flash_prefill(&q, &kv, 0, Attend::causal(64), &mut g.act_poisoned(3, 6 * 64, true).unwrap()).is_err());
    let q5 = g.act_from(3, 5 * 64, &bf(&r.v(3 * 5 * 64, 1.0))).unwrap();
    assert!(g.flash_prefill(&q5, &kv, 0, Attend::causal(64), &mut g.act_poisoned(3, 5 * 64, false).unwrap()).is_err());
}
