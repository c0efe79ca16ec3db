//! Tensor parallelism on GPUs (backend::sharded over NCCL): a one-rank communicator on one
//! GPU gives the plain model's logits and tokens; on a machine with two GPUs, two ranks
//! agree with one (top token on ≥ 98% of positions, mean KL ≤ 2e-3, issue 31's bar).

use super::{check, smollm2_cuda};
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::backend::sharded::{Nccl, Sharded};
use ferrolm::model::{Decoder, Logits};

fn smollm2_ranks(n: usize) -> Decoder<Sharded<Cuda, Nccl>> {
    let path = ferrolm::hub::default_model().expect("SmolLM2 in the model cache");
    let mut src = ferrolm::formats::load(&path, false).unwrap();
    let ranks: Vec<Cuda> = (0..n).map(|r| Cuda::new(r).unwrap()).collect();
    let comm = Nccl::new(&ranks).unwrap();
    Decoder::load(Sharded::new(ranks, &src.config, comm).unwrap(), &mut src).unwrap()
}

fn prompt() -> Vec<u32> {
    (0..61u32).map(|i| (i * 7919 + 13) % 49152).collect()
}

/// Greedy tokens after the prompt, one forward call a step.
fn greedy<B: ferrolm::backend::Backend>(m: &Decoder<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache(prompt.len() + n).unwrap();
    let mut logits = m.forward(prompt, 0, &mut cache, Logits::Last).unwrap();
    let mut out = vec![];
    for i in 0..n {
        let t = ferrolm::sample::argmax(&logits) as u32;
        out.push(t);
        logits = m.forward(&[t], prompt.len() + i, &mut cache, Logits::Last).unwrap();
    }
    out
}

/// Mean KL(p ‖ q) over rows of logits and the share of rows with the same top token.
fn kl_and_agreement(p: &[f32], q: &[f32], v: usize) -> (f64, f64) {
    let soft = |r: &[f32]| {
        let m = r.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let z: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum();
        r.iter().map(|&x| (x as f64 - m).exp() / z).collect::<Vec<_>>()
    };
    let (mut kl, mut same, rows) = (0.0, 0usize, p.len() / v);
    for (a, b) in p.chunks(v).zip(q.chunks(v)) {
        let (pa, pb) = (soft(a), soft(b));
        kl += pa.iter().zip(&pb).map(|(x, y)| if *x > 0.0 { x * (x / y.max(1e-300)).ln() } else { 0.0 }).sum::<f64>();
        same += usize::from(ferrolm::sample::argmax(a) == ferrolm::sample::argmax(b));
    }
    (kl / rows as f64, same as f64 / rows as f64)
}

#[test]
fn one_rank_over_nccl_is_the_plain_model() {
    let plain = smollm2_cuda(CudaConfig::default());
    let tp = smollm2_ranks(1);
    let p = prompt();
    let want = plain.forward(&p, 0, &mut plain.new_cache(64).unwrap(), Logits::All).unwrap();
    let got = tp.forward(&p, 0, &mut tp.new_cache(64).unwrap(), Logits::All).unwrap();
    check("one rank: prompt logits", &got, &want, 1e-3);
    assert_eq!(greedy(&tp, &p, 12), greedy(&plain, &p, 12), "one rank: greedy tokens");
}

#[test]
fn two_ranks_agree_with_one() {
    let gpus = cudarc::driver::CudaContext::device_count().unwrap_or(0);
    if gpus < 2 {
        eprintln!("two_ranks_agree_with_one: {gpus} GPU(s) here, needs 2: not run");
        return;
    }
    let plain = smollm2_cuda(CudaConfig::default());
    let tp = smollm2_ranks(2);
    let p = prompt();
    let want = plain.forward(&p, 0, &mut plain.new_cache(64).unwrap(), Logits::All).unwrap();
    let got = tp.forward(&p, 0, &mut tp.new_cache(64).unwrap(), Logits::All).unwrap();
    let (kl, same) = kl_and_agreement(&want, &got, plain.logits_width());
    eprintln!("two ranks against one: mean KL {kl:.2e}, same top token {:.1}%", 100.0 * same);
    assert!(kl <= 2e-3 && same >= 0.98, "mean KL {kl}, same top token {same}");
}
