//! What the timings binary (src/bin/timings.rs) builds on: random inputs, the parity check
//! against the CPU backend, and the time per launch of ops captured into a graph.

use ferrolm::backend::cpu::CpuAct;
use ferrolm::backend::cuda::Cuda;
use ferrolm::config::{ModelConfig, RopeStyle};
use ferrolm::{Error, Result};

/// xorshift64: uniform values in [-1, 1), from a seed that is printed (to rerun a case).
pub struct Rng(u64);

impl Rng {
    /// Seeded from the clock, or `seed`; says which.
    pub fn new(seed: Option<u64>) -> Rng {
        let t = seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        eprintln!("seed {t}");
        Rng(t | 1)
    }
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// `n` values in [-s, s).
    pub fn v(&mut self, n: usize, s: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * s).collect()
    }
}

/// `v` rounded to bf16 (what a bf16 activation holds).
pub fn bf(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
}

/// A CPU activation holding `data`.
pub fn cpu(rows: usize, cols: usize, data: Vec<f32>) -> CpuAct {
    CpuAct { rows, cols, data }
}

/// ‖got − want‖ / ‖want‖.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().max(1e-30);
    (num / den).sqrt()
}

/// Parity checks of a run: each one printed; the failed ones kept for the exit status.
#[derive(Default)]
pub struct Checks {
    /// Skip every check, and say so (timing a kernel variant that computes something
    /// else, e.g. a memory-only GEMV, by `FERROLM_KERNEL_DIR`).
    pub timing_only: bool,
    pub failed: Vec<String>,
}

impl Checks {
    /// `got` against the CPU reference `want`: same length, finite (a NaN is an unwritten
    /// element of a poisoned output), relative error at most `tol`.
    pub fn check(&mut self, what: &str, got: &[f32], want: &[f32], tol: f64) {
        if self.timing_only {
            eprintln!("{what}: parity NOT checked (--timing-only)");
            return;
        }
        let fail = if got.len() != want.len() {
            Some(format!("{what}: length {} against {}", got.len(), want.len()))
        } else if !got.iter().all(|v| v.is_finite()) {
            Some(format!("{what}: NaN/inf in output (unwritten element?)"))
        } else {
            let e = rel_err(got, want);
            eprintln!("{what}: rel err {e:.2e}");
            (e > tol).then(|| format!("{what}: rel err {e:.2e} > {tol:.0e}"))
        };
        if let Some(f) = fail {
            eprintln!("FAILED: {f}");
            self.failed.push(f);
        }
    }
}

/// An attention-only model shape: `heads`/`n_kv` heads of `hd`, `layers` layers.
pub fn attn_cfg(heads: usize, n_kv: usize, hd: usize, layers: usize, style: RopeStyle) -> ModelConfig {
    ModelConfig {
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

fn drv(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    crate::drv(what)
}

/// Median over 5 replays of the mean µs per call of `f(i)` over `n` calls (i = 0..n)
/// captured into one graph (after a warm-up replay): launch gaps and PDL overlap counted
/// as a decode step's graph has them. `f(0)` runs once first, outside the capture, so that
/// kernels are loaded (a load cannot be captured).
pub fn graph_time(g: &Cuda, n: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<f64> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    f(0)?;
    g.stream.synchronize().map_err(drv("warm-up"))?;
    g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(drv("capture"))?;
    // The capture ends whatever the calls do.
    let calls = (0..n).try_for_each(&mut *f);
    let graph = g.stream.end_capture(CUgraphInstantiate_flags(0)).map_err(drv("capture"))?;
    calls?;
    let graph = graph.ok_or_else(|| Error::Invalid("the capture made no graph".into()))?;
    graph.launch().map_err(drv("graph launch"))?;
    g.stream.synchronize().map_err(drv("graph launch"))?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        graph.launch().map_err(drv("graph launch"))?;
        g.stream.synchronize().map_err(drv("graph launch"))?;
        times.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// Mean ms per call of `f` over `iters` calls queued back to back (after one warm-up).
pub fn stream_time(g: &Cuda, iters: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    g.stream.synchronize().map_err(drv("warm-up"))?;
    let t = std::time::Instant::now();
    for _ in 0..iters {
        f()?;
    }
    g.stream.synchronize().map_err(drv("timed calls"))?;
    Ok(t.elapsed().as_secs_f64() / iters as f64 * 1e3)
}

/// One timed launch: µs and the rate over the weight bytes it reads.
pub fn report(what: &str, us: f64, bytes: usize) {
    println!("{what}: {us:.2} µs per launch, {:.0} GB/s of weights", bytes as f64 / us / 1e3);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_keep_what_failed() {
        let mut c = Checks::default();
        c.check("same", &[1.0, 2.0], &[1.0, 2.0], 1e-2);
        c.check("off", &[1.0, 3.0], &[1.0, 2.0], 1e-2);
        c.check("unwritten", &[f32::NAN, 2.0], &[1.0, 2.0], 1e-2);
        c.check("short", &[1.0], &[1.0, 2.0], 1e-2);
        assert_eq!(c.failed.len(), 3, "{:?}", c.failed);
        assert!(c.failed[0].starts_with("off"));
        let mut t = Checks { timing_only: true, ..Default::default() };
        t.check("off", &[1.0, 3.0], &[1.0, 2.0], 1e-2);
        assert!(t.failed.is_empty());
    }

    #[test]
    fn the_rng_stays_in_range_and_repeats_from_a_seed() {
        let (mut a, mut b) = (Rng::new(Some(7)), Rng::new(Some(7)));
        let (va, vb) = (a.v(1000, 2.0), b.v(1000, 2.0));
        assert_eq!(va, vb);
        assert!(va.iter().all(|x| (-2.0..2.0).contains(x)));
    }
}
