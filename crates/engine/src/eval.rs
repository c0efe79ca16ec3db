//! Teacher-forced comparison of two models' next-token distributions over the same tokens
//! (`ferrolm kl`): KL(base ‖ model) at every position, as llama.cpp's `--kl-divergence`
//! reports it (mean, median, percentiles, max), the top-1 agreement, and both perplexities.
//! Both run the text in chunks of `ctx` tokens, each chunk from an empty cache.

use crate::backend::Backend;
use crate::kv::scheme::KvScheme;
use crate::kv::seq::SeqCache;
use crate::model::{Decoder, Logits};
use crate::{Error, Result};
use rayon::prelude::*;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct KlReport {
    /// The compared model's KV scheme.
    pub scheme: String,
    pub tokens: usize,
    /// Positions compared (each chunk's but its last).
    pub positions: usize,
    pub kl_mean: f64,
    pub kl_median: f64,
    pub kl_p90: f64,
    pub kl_p99: f64,
    pub kl_p999: f64,
    pub kl_max: f64,
    /// Positions where both models' most likely next token is the same, as a fraction.
    pub top1_agreement: f64,
    pub ppl_base: f64,
    pub ppl: f64,
}

/// Log-softmax of one row in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let lse = crate::sample::log_sum_exp(row, 1.0);
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// KL(p ‖ q) of two log-distributions (f64 sums; ≥ 0 up to rounding, clamped at 0).
fn kl(lp: &[f64], lq: &[f64]) -> f64 {
    lp.iter().zip(lq).map(|(a, b)| if *a == f64::NEG_INFINITY { 0.0 } else { a.exp() * (a - b) }).sum::<f64>().max(0.0)
}

/// Value at quantile q (0..=1) of sorted values, nearest rank.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// One model's KL and agreement per position against the base, and both NLLs.
#[derive(Default)]
struct Tally {
    kls: Vec<f64>,
    same: usize,
    nll_base: f64,
    nll: f64,
}

impl Tally {
    fn report(self, tokens: usize, scheme: String) -> KlReport {
        let n = self.kls.len() as f64;
        let mut sorted = self.kls.clone();
        sorted.sort_by(f64::total_cmp);
        let median = match sorted.len() % 2 {
            1 => sorted[sorted.len() / 2],
            _ => 0.5 * (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]),
        };
        KlReport {
            scheme,
            tokens,
            positions: self.kls.len(),
            kl_mean: self.kls.iter().sum::<f64>() / n,
            kl_median: median,
            kl_p90: quantile(&sorted, 0.90),
            kl_p99: quantile(&sorted, 0.99),
            kl_p999: quantile(&sorted, 0.999),
            kl_max: *sorted.last().expect("at least one position"),
            top1_agreement: self.same as f64 / n,
            ppl_base: (self.nll_base / n).exp(),
            ppl: (self.nll / n).exp(),
        }
    }
}

/// Compare each of `models` with `base` on `tokens` (the same tokenizer's ids) in chunks
/// of `ctx`, each with its own KV scheme (one model against itself with other caches, or
/// another quantization of it with the same cache); the base runs once per chunk for all
/// of them. One report per model, in order.
pub fn kl_divergence<A: Backend, B: Backend>(
    (base, base_kv): (&Decoder<A>, &KvScheme),
    models: &[(&Decoder<B>, KvScheme)],
    tokens: &[u32],
    ctx: usize,
    progress: bool,
) -> Result<Vec<KlReport>> {
    let vocab = base.logits_width();
    if let Some((m, _)) = models.iter().find(|(m, _)| m.logits_width() != vocab) {
        return Err(Error::Invalid(format!(
            "the base model predicts over {vocab} tokens and the model over {}: not the same vocabulary",
            m.logits_width()
        )));
    }
    if ctx < 2 || tokens.len() < 2 || models.is_empty() {
        return Err(Error::Invalid(format!(
            "kl needs chunks of 2 tokens or more (ctx {ctx}, {} tokens) and a model to compare",
            tokens.len()
        )));
    }
    let ctx = models.iter().fold(ctx.min(base.cfg.max_ctx), |c, (m, _)| c.min(m.cfg.max_ctx));
    let mut kb = SeqCache::with_layout(&base.backend, &base.cfg, ctx, base_kv, base.kv_start)?;
    let mut caches = models
        .iter()
        .map(|(m, kv)| SeqCache::with_layout(&m.backend, &m.cfg, ctx, kv, m.kv_start))
        .collect::<Result<Vec<_>>>()?;
    let mut tallies: Vec<Tally> = models.iter().map(|_| Tally::default()).collect();
    let bar = crate::progress::count_bar(progress, tokens.len() as u64, "tokens");
    for chunk in tokens.chunks(ctx) {
        bar.inc(chunk.len() as u64);
        if chunk.len() < 2 {
            break;
        }
        // Each chunk from empty caches (a sliding layer's blocks before its window are gone).
        kb.clear();
        let lb = base.forward(chunk, 0, &mut kb, Logits::All)?;
        for (((m, _), km), t) in models.iter().zip(&mut caches).zip(&mut tallies) {
            km.clear();
            let lm = m.forward(chunk, 0, km, Logits::All)?;
            // Positions in parallel (a 262k vocabulary makes this the slow part), summed in order.
            let rows: Vec<(f64, f64, f64, bool)> = lb
                .par_chunks_exact(vocab)
                .zip(lm.par_chunks_exact(vocab))
                .take(chunk.len() - 1)
                .enumerate()
                .map(|(i, (rb, rm))| {
                    let (pb, pm) = (log_softmax(rb), log_softmax(rm));
                    let target = chunk[i + 1] as usize;
                    (pb[target], pm[target], kl(&pb, &pm), crate::sample::argmax(rb) == crate::sample::argmax(rm))
                })
                .collect();
            for (lp_base, lp, k, same) in rows {
                t.nll_base -= lp_base;
                t.nll -= lp;
                t.kls.push(k);
                t.same += usize::from(same);
            }
        }
    }
    bar.finish_and_clear();
    Ok(tallies.into_iter().zip(models).map(|(t, (_, kv))| t.report(tokens.len(), kv.to_string())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_of_a_distribution_with_itself_is_zero_and_grows_apart() {
        let p = log_softmax(&[1.0, 2.0, 3.0, -1.0]);
        assert_eq!(kl(&p, &p), 0.0);
        let q = log_softmax(&[1.0, 2.0, 2.5, -1.0]);
        let r = log_softmax(&[3.0, 2.0, 1.0, -1.0]);
        assert!(kl(&p, &q) > 0.0 && kl(&p, &r) > kl(&p, &q));
        // By hand: p = (½, ½), q = (¼, ¾): ½·ln 2 + ½·ln(2/3).
        let (p2, q2) = ([0.5f64.ln(), 0.5f64.ln()], [0.25f64.ln(), 0.75f64.ln()]);
        assert!((kl(&p2, &q2) - (0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln())).abs() < 1e-12);
    }

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (quantile(&v, 0.5), quantile(&v, 0.99), quantile(&v, 0.999), quantile(&v, 0.0)),
            (50.0, 99.0, 100.0, 1.0)
        );
    }
}
