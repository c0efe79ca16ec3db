//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition, presence and
//! frequency penalties, log-probabilities.
//! Seeded (ChaCha8) so a given seed reproduces the same text on every machine.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off. Drops tokens whose probability is below min_p × the top probability.
    pub min_p: f32,
    /// 1.0 = off. HF rule: a seen token's logit is divided by p if positive, else multiplied.
    pub repetition_penalty: f32,
    /// How many recent tokens the penalty looks at (0 = all).
    pub penalty_window: usize,
    /// OpenAI's: subtracted once from the logit of every token the output holds (0 = off).
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit per time the output holds it (0 = off).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            penalty_window: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |m: &str| Err(crate::Error::Invalid(m.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top-p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition penalty must be > 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) || !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("presence and frequency penalties must be in [-2, 2]");
        }
        Ok(())
    }
}

/// Log-probabilities of one sampled position (`Sampler::sample_logprobs`).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// The most probable tokens' (id, log-probability), best first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    pub cfg: SamplerConfig,
    rng: ChaCha8Rng,
    cand: Vec<(u32, f32)>,
}

/// Index of the largest value; ties go to the lowest index (as torch.argmax).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// ln Σ exp(v·scale), from the largest term (f64 sums): the log-softmax's normalizer.
pub fn log_sum_exp(v: &[f32], scale: f32) -> f64 {
    let max = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b * scale));
    max as f64 + v.iter().map(|&l| ((l * scale - max) as f64).exp()).sum::<f64>().ln()
}

/// Candidate order: higher (scaled) logit first, ties to the lower token id.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// A candidate ordered by `by_logit` (the heap's greatest is the worst kept).
struct Cand((u32, f32));
impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        by_logit(&self.0, &o.0).is_eq()
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        by_logit(&self.0, &o.0)
    }
}

/// The `k` best of `logits` × `inv_t` by (value desc, index asc), best first, into `out`.
/// One pass keeping the best k in a heap whose top is the worst kept: most candidates lose
/// one comparison against it. (A 128K vocabulary: ~0.1 ms, not the ~0.35 ms of collecting
/// and selecting; this runs once per sampled token.)
pub fn top_k_into(logits: &[f32], k: usize, inv_t: f32, out: &mut Vec<(u32, f32)>) {
    let mut heap = std::collections::BinaryHeap::with_capacity(k + 1);
    for cd in logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t)) {
        if heap.len() < k {
            heap.push(Cand(cd));
        } else if heap.peek().is_some_and(|w: &Cand| by_logit(&cd, &w.0).is_lt()) {
            heap.pop();
            heap.push(Cand(cd));
        }
    }
    out.clear();
    out.extend(heap.into_sorted_vec().into_iter().map(|w| w.0));
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Sampler { cfg, rng, cand: Vec::new() }
    }

    /// Pick the next token from `logits` (modified in place by the penalty).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.sample_output(logits, history, history.len())
    }

    /// `sample` where `history[output..]` is what the model generated so far: the presence
    /// and frequency penalties count those tokens (the repetition penalty all of history).
    pub fn sample_output(&mut self, logits: &mut [f32], history: &[u32], output: usize) -> u32 {
        self.penalize(logits, history, output.min(history.len()));
        self.pick(logits)
    }

    /// `sample_output`, with the chosen token's log-probability and the `n` most probable
    /// tokens' (best first, ties to the lower id) under the distribution sampled from: the
    /// penalized logits at the temperature (1 when greedy), before top-k/top-p/min-p cut it.
    pub fn sample_logprobs(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        output: usize,
        n: usize,
    ) -> (u32, TokenLogprobs) {
        self.penalize(logits, history, output.min(history.len()));
        let inv_t = if self.cfg.temperature > 0.0 { 1.0 / self.cfg.temperature } else { 1.0 };
        let lse = log_sum_exp(logits, inv_t);
        let lp = |l: f32| (l as f64 * inv_t as f64 - lse) as f32;
        let mut top = Vec::new();
        if n > 0 {
            top_k_into(logits, n.min(logits.len()), 1.0, &mut top);
        }
        let top = top.into_iter().map(|(i, l)| (i, lp(l))).collect();
        let id = self.pick(logits);
        (id, TokenLogprobs { logprob: lp(logits[id as usize]), top })
    }

    /// The repetition penalty over (the window of) history, then presence and frequency
    /// over history[output..].
    fn penalize(&self, logits: &mut [f32], history: &[u32], output: usize) {
        let c = &self.cfg;
        if c.repetition_penalty != 1.0 {
            let start = if c.penalty_window == 0 { 0 } else { history.len().saturating_sub(c.penalty_window) };
            let mut seen = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / c.repetition_penalty } else { *l * c.repetition_penalty };
                }
            }
        }
        if c.presence_penalty != 0.0 || c.frequency_penalty != 0.0 {
            let mut seen = history[output..].to_vec();
            seen.sort_unstable();
            for run in seen.chunk_by(|a, b| a == b) {
                if let Some(l) = logits.get_mut(run[0] as usize) {
                    *l -= c.presence_penalty + c.frequency_penalty * run.len() as f32;
                }
            }
        }
    }

    /// The draw from penalized logits.
    fn pick(&mut self, logits: &[f32]) -> u32 {
        let c = &self.cfg;
        if c.temperature == 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / c.temperature;
        if c.top_k > 0 && c.top_k < logits.len() {
            let mut cand = std::mem::take(&mut self.cand);
            top_k_into(logits, c.top_k, inv_t, &mut cand);
            self.cand = cand;
        } else {
            self.cand.clear();
            self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t)));
            self.cand.sort_unstable_by(by_logit);
        }
        self.finish()
    }

    /// Sample from top-k candidates found elsewhere (e.g. on the GPU: `Backend::top_k`):
    /// (token, logit × 1/temperature) pairs, in any order. With the same candidates this
    /// draws exactly what `sample` draws (same order, same arithmetic, same random draw).
    /// Only for configurations `top_k_on_device` accepts.
    pub fn sample_candidates(&mut self, cand: &[(u32, f32)]) -> u32 {
        assert!(!cand.is_empty(), "sample_candidates needs at least one candidate");
        self.cand.clear();
        self.cand.extend_from_slice(cand);
        self.cand.sort_unstable_by(by_logit);
        self.finish()
    }

    /// Can `sample` be split into a device top-k plus `sample_candidates`? Sampling (not
    /// greedy), no penalty (it would change the logits first), and top-k set below the
    /// vocabulary and at most `max_k` (what the device kernel handles).
    pub fn top_k_on_device(&self, vocab: usize, max_k: usize) -> bool {
        let c = &self.cfg;
        c.temperature > 0.0 && !self.penalized() && c.top_k > 0 && c.top_k < vocab && c.top_k <= max_k
    }

    /// Greedy without penalties: the token is the logits' argmax (`argmax`), nothing else.
    pub fn plain_greedy(&self) -> bool {
        self.cfg.temperature == 0.0 && !self.penalized()
    }

    /// Whether a penalty changes the logits before the draw.
    pub fn penalized(&self) -> bool {
        let c = &self.cfg;
        c.repetition_penalty != 1.0 || c.presence_penalty != 0.0 || c.frequency_penalty != 0.0
    }

    /// Softmax over `cand` (sorted best first), top-p and min-p cuts, one random draw.
    fn finish(&mut self) -> u32 {
        let c = &self.cfg;
        // softmax over the survivors
        let max = self.cand[0].1;
        let mut sum = 0f64;
        for cd in self.cand.iter_mut() {
            cd.1 = (cd.1 - max).exp();
            sum += cd.1 as f64;
        }
        let mut keep = self.cand.len();
        if c.top_p < 1.0 {
            let mut cum = 0f64;
            for (i, cd) in self.cand.iter().enumerate() {
                cum += cd.1 as f64 / sum;
                if cum >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if c.min_p > 0.0 {
            // the top candidate has weight exp(0) = 1
            keep = keep.min(self.cand.iter().take_while(|cd| cd.1 >= c.min_p).count().max(1));
        }
        self.cand.truncate(keep);
        let total: f64 = self.cand.iter().map(|cd| cd.1 as f64).sum();
        let mut r = self.rng.gen::<f64>() * total;
        for cd in &self.cand {
            r -= cd.1 as f64;
            if r < 0.0 {
                return cd.0;
            }
        }
        self.cand[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0, 2.9]
    }

    /// The top-k candidates, best first, as collect + select_nth + sort finds them.
    fn top_k_reference(logits: &[f32], k: usize, inv_t: f32) -> Vec<(u32, f32)> {
        let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t)).collect();
        c.select_nth_unstable_by(k - 1, by_logit);
        c.truncate(k);
        c.sort_unstable_by(by_logit);
        c
    }

    #[test]
    fn heap_top_k_equals_select_and_sort_with_ties() {
        let mut seed = 3u64;
        for (n, levels) in [(1000, 7.0), (5000, 1000.0), (50, 3.0)] {
            // coarse values: many exact ties, which the order breaks by token id
            let l: Vec<f32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / 16777216.0 * levels).floor() - levels / 2.0
                })
                .collect();
            for k in [1, 2, 40, 49] {
                for temperature in [0.7f32, 1.0, 1.3] {
                    let cfg = SamplerConfig { temperature, top_k: k, seed: 9, ..Default::default() };
                    let mut s = Sampler::new(cfg.clone());
                    s.sample(&mut l.clone(), &[]);
                    // `sample` leaves the survivors of top-k/top-p/min-p in `cand`, best first;
                    // with top_p and min_p off that is the whole top-k set.
                    let want = top_k_reference(&l, k, 1.0 / temperature);
                    let got: Vec<(u32, f32)> = s.cand.iter().map(|&(i, _)| (i, l[i as usize] / temperature)).collect();
                    assert_eq!(
                        got.iter().map(|c| c.0).collect::<Vec<_>>(),
                        want.iter().map(|c| c.0).collect::<Vec<_>>(),
                        "n {n} k {k} t {temperature}"
                    );
                }
            }
        }
    }

    #[test]
    fn candidates_from_elsewhere_draw_what_sample_draws() {
        let mut seed = 11u64;
        let l: Vec<f32> = (0..3000)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / 16777216.0 * 200.0).floor() / 10.0 // ties
            })
            .collect();
        for (top_k, top_p, min_p, temperature) in [(40, 1.0, 0.0, 0.8), (5, 0.9, 0.0, 1.0), (200, 0.95, 0.05, 1.3)] {
            let cfg = SamplerConfig { temperature, top_k, top_p, min_p, seed: 5, ..Default::default() };
            let (mut a, mut b) = (Sampler::new(cfg.clone()), Sampler::new(cfg));
            assert!(a.top_k_on_device(l.len(), 1024));
            let mut cand = Vec::new();
            top_k_into(&l, top_k, 1.0 / temperature, &mut cand);
            cand.reverse(); // any order
            let want: Vec<u32> = (0..100).map(|_| a.sample(&mut l.clone(), &[])).collect();
            let got: Vec<u32> = (0..100).map(|_| b.sample_candidates(&cand)).collect();
            assert_eq!(got, want, "top_k {top_k} top_p {top_p} min_p {min_p}");
            assert!(want.iter().any(|&t| t != want[0]), "the draws vary");
        }
        let off = |c: SamplerConfig| Sampler::new(c).top_k_on_device(3000, 1024);
        let base = SamplerConfig { temperature: 1.0, top_k: 40, ..Default::default() };
        assert!(!off(SamplerConfig { temperature: 0.0, ..base.clone() }));
        assert!(!off(SamplerConfig { repetition_penalty: 1.1, ..base.clone() }));
        assert!(!off(SamplerConfig { top_k: 0, ..base.clone() }));
        assert!(!off(SamplerConfig { top_k: 2000, ..base.clone() }));
        assert!(!off(SamplerConfig { top_k: 3000, ..base }));
    }

    #[test]
    fn presence_and_frequency_penalties_count_only_the_output() {
        // token 1 (3.0) is in the prompt only: untouched; token 5 (2.9) twice in the output
        let cfg = SamplerConfig { presence_penalty: 0.2, frequency_penalty: 0.3, ..Default::default() };
        let mut l = logits();
        assert_eq!(Sampler::new(cfg.clone()).sample_output(&mut l, &[1, 5, 5], 1), 1);
        assert!((l[5] - (2.9 - 0.2 - 0.6)).abs() < 1e-6 && l[1] == 3.0);
        // token 1 in the output once: 3.0 - 0.5 < 2.9
        let mut l = logits();
        assert_eq!(Sampler::new(cfg.clone()).sample_output(&mut l, &[0, 1], 1), 5);
        assert!(SamplerConfig { presence_penalty: 2.5, ..cfg }.validate().is_err());
    }

    #[test]
    fn logprobs_are_the_log_softmax_at_the_temperature() {
        let l = logits();
        for temperature in [0.0f32, 0.7] {
            let t = if temperature == 0.0 { 1.0 } else { temperature as f64 };
            let z: f64 = l.iter().map(|&v| (v as f64 / t).exp()).sum();
            let want = |i: usize| ((l[i] as f64 / t).exp() / z).ln() as f32;
            let mut s = Sampler::new(SamplerConfig { temperature, seed: 4, ..Default::default() });
            let (id, lp) = s.sample_logprobs(&mut l.clone(), &[], 0, 3);
            assert!((lp.logprob - want(id as usize)).abs() < 1e-5);
            assert_eq!(lp.top.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 5, 2]);
            for &(i, v) in &lp.top {
                assert!((v - want(i as usize)).abs() < 1e-5, "token {i}: {v} vs {}", want(i as usize));
            }
        }
        // the same draws as without log-probabilities
        let cfg = SamplerConfig { temperature: 1.0, seed: 3, ..Default::default() };
        let (mut a, mut b) = (Sampler::new(cfg.clone()), Sampler::new(cfg));
        for _ in 0..50 {
            assert_eq!(a.sample(&mut logits(), &[]), b.sample_logprobs(&mut logits(), &[], 0, 0).0);
        }
    }

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&mut logits(), &[]), 1);
    }

    #[test]
    fn repetition_penalty_moves_greedy_choice() {
        let cfg = SamplerConfig { repetition_penalty: 1.5, ..Default::default() };
        let mut s = Sampler::new(cfg);
        assert_eq!(s.sample(&mut logits(), &[1]), 5);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproduces() {
        let cfg = SamplerConfig { temperature: 1.0, top_k: 1, ..Default::default() };
        let mut s = Sampler::new(cfg);
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits(), &[]), 1);
        }
        let cfg = SamplerConfig { temperature: 1.0, seed: 7, ..Default::default() };
        let run = |cfg: &SamplerConfig| {
            let mut s = Sampler::new(cfg.clone());
            (0..50).map(|_| s.sample(&mut logits(), &[])).collect::<Vec<_>>()
        };
        let a = run(&cfg);
        assert_eq!(a, run(&cfg));
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 should not always pick one token");
        let other = run(&SamplerConfig { seed: 8, ..cfg.clone() });
        assert_ne!(a, other);
    }

    #[test]
    fn top_p_and_min_p_restrict_the_support() {
        // probs ∝ exp(l): token 1 (3.0), 5 (2.9), 2 (2.5) hold most of the mass
        let cfg = SamplerConfig { temperature: 1.0, top_p: 0.5, seed: 1, ..Default::default() };
        let mut s = Sampler::new(cfg);
        for _ in 0..200 {
            let t = s.sample(&mut logits(), &[]);
            assert!(t == 1 || t == 5, "top-p 0.5 sampled {t}");
        }
        let cfg = SamplerConfig { temperature: 1.0, min_p: 0.6, seed: 2, ..Default::default() };
        let mut s = Sampler::new(cfg);
        for _ in 0..200 {
            let t = s.sample(&mut logits(), &[]);
            assert!([1, 5, 2].contains(&t), "min-p 0.6 sampled {t}");
        }
    }
}
