//! /metrics in the Prometheus text exposition format (version 0.0.4), written here rather
//! than through a metrics crate: a few counters, the engine's gauges and two histograms.

use ferrolm::serving::Stats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// How a generation request ended, one counter each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// A stop token or stop string.
    Stop,
    /// max_tokens or the context.
    Length,
    /// The client went away first.
    Cancelled,
    /// The engine failed it (timeout, shutdown, out of KV budget).
    Failed,
    /// Refused before it ran: a bad request (4xx other than 429).
    Invalid,
    /// Refused: the queue was full (429).
    Busy,
    /// Refused: the server is shutting down (503).
    Unavailable,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Cancelled => "cancelled",
            Outcome::Failed => "failed",
            Outcome::Invalid => "invalid",
            Outcome::Busy => "busy",
            Outcome::Unavailable => "unavailable",
        }
    }
}

/// Cumulative buckets as Prometheus wants them, in seconds.
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, secs: f64) {
        for (c, &b) in self.counts.iter_mut().zip(self.bounds) {
            if secs <= b {
                *c += 1;
            }
        }
        self.sum += secs;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

const TTFT_BOUNDS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const ITL_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

#[derive(Default)]
struct Counters {
    outcomes: BTreeMap<Outcome, u64>,
    responses: BTreeMap<u16, u64>,
}

pub struct Metrics {
    counters: Mutex<Counters>,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            counters: Mutex::default(),
            ttft: Mutex::new(Histogram::new(TTFT_BOUNDS)),
            itl: Mutex::new(Histogram::new(ITL_BOUNDS)),
        }
    }
}

/// A poisoned lock only means a panic elsewhere mid-update of plain numbers: keep counting.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    pub fn outcome(&self, o: Outcome) {
        *lock(&self.counters).outcomes.entry(o).or_default() += 1;
    }

    pub fn response(&self, status: u16) {
        *lock(&self.counters).responses.entry(status).or_default() += 1;
    }

    pub fn time_to_first_token(&self, d: Duration) {
        lock(&self.ttft).observe(d.as_secs_f64());
    }

    pub fn inter_token(&self, d: Duration) {
        lock(&self.itl).observe(d.as_secs_f64());
    }

    /// The whole exposition: this server's counters and histograms, the engine's stats.
    pub fn render(&self, s: &Stats) -> String {
        let mut out = String::new();
        let c = lock(&self.counters);
        header(&mut out, "ferrolm_requests_total", "counter", "Generation requests by how they ended.");
        for (o, n) in &c.outcomes {
            let _ = writeln!(out, "ferrolm_requests_total{{outcome=\"{}\"}} {n}", o.label());
        }
        header(&mut out, "ferrolm_http_responses_total", "counter", "HTTP responses by status code.");
        for (code, n) in &c.responses {
            let _ = writeln!(out, "ferrolm_http_responses_total{{code=\"{code}\"}} {n}");
        }
        drop(c);
        let values: [(&str, &str, &str, u64); 13] = [
            ("ferrolm_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", s.prompt_tokens),
            (
                "ferrolm_prompt_cached_tokens_total",
                "counter",
                "Prompt tokens whose KV came from the prefix cache.",
                s.cached_tokens,
            ),
            ("ferrolm_generation_tokens_total", "counter", "Tokens generated.", s.generated_tokens),
            ("ferrolm_engine_finished_total", "counter", "Requests the engine finished.", s.requests_finished),
            ("ferrolm_engine_failed_total", "counter", "Requests the engine failed or cancelled.", s.requests_failed),
            (
                "ferrolm_preemptions_total",
                "counter",
                "Times a running request gave its KV blocks back to be recomputed later.",
                s.preemptions,
            ),
            ("ferrolm_requests_waiting", "gauge", "Requests in the queue.", s.waiting as u64),
            ("ferrolm_requests_running", "gauge", "Requests in the running batch.", s.running as u64),
            (
                "ferrolm_kv_cache_bytes_used",
                "gauge",
                "KV cache bytes the running requests hold.",
                s.kv_bytes_used as u64,
            ),
            (
                "ferrolm_kv_blocks_used",
                "gauge",
                "KV cache blocks (32 positions, full-attention layers) the running requests hold.",
                s.kv_blocks_used as u64,
            ),
            (
                "ferrolm_kv_blocks_total",
                "gauge",
                "KV cache blocks in all (used, cached for prefixes, or free).",
                s.kv_blocks_total as u64,
            ),
            (
                "ferrolm_kv_cache_bytes_budget",
                "gauge",
                "KV cache bytes the running requests may hold.",
                s.kv_bytes_budget as u64,
            ),
            (
                "ferrolm_kv_cache_bytes_per_token",
                "gauge",
                "KV cache bytes one cached token takes over every layer, in the cache's scheme.",
                s.kv_bytes_per_token as u64,
            ),
        ];
        for (name, kind, help, v) in values {
            header(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {v}");
        }
        header(&mut out, "ferrolm_kv_cache_info", "gauge", "The KV cache's scheme (--kv), as a label.");
        let _ = writeln!(out, "ferrolm_kv_cache_info{{scheme=\"{}\"}} 1", s.kv_scheme);
        header(&mut out, "ferrolm_engine_steps_total", "counter", "Engine steps run.");
        let _ = writeln!(out, "ferrolm_engine_steps_total {}", s.steps);
        header(
            &mut out,
            "ferrolm_engine_fed_tokens_total",
            "counter",
            "Generated tokens from fed runs (a lone greedy request's calls queued ahead on the device).",
        );
        let _ = writeln!(out, "ferrolm_engine_fed_tokens_total {}", s.fed_tokens);
        let seconds = [
            ("ferrolm_engine_step_seconds_total", "Seconds the engine's steps took.", s.step_seconds),
            (
                "ferrolm_engine_forward_seconds_total",
                "Seconds of those in forward calls (device work and its read-back).",
                s.forward_seconds,
            ),
        ];
        for (name, help, v) in seconds {
            header(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {v}");
        }
        lock(&self.ttft).render(&mut out, "ferrolm_time_to_first_token_seconds", "From arrival to the first token.");
        lock(&self.itl).render(&mut out, "ferrolm_inter_token_latency_seconds", "Between consecutive tokens.");
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_counters_labelled() {
        let m = Metrics::default();
        m.time_to_first_token(Duration::from_millis(30));
        m.time_to_first_token(Duration::from_secs(100));
        m.outcome(Outcome::Stop);
        m.outcome(Outcome::Stop);
        m.response(429);
        let text = m.render(&Stats { running: 3, steps: 7, step_seconds: 0.5, ..Default::default() });
        for line in [
            "ferrolm_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "ferrolm_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "ferrolm_time_to_first_token_seconds_bucket{le=\"60\"} 1",
            "ferrolm_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2",
            "ferrolm_time_to_first_token_seconds_count 2",
            "ferrolm_requests_total{outcome=\"stop\"} 2",
            "ferrolm_http_responses_total{code=\"429\"} 1",
            "ferrolm_requests_running 3",
            "ferrolm_engine_steps_total 7",
            "ferrolm_engine_step_seconds_total 0.5",
            "ferrolm_engine_forward_seconds_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
