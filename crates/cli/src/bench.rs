//! `bench`: median prefill and decode tokens/s over repeated runs (optionally at a context
//! depth), peak memory, and on a GPU the device memory used, the effective weight bandwidth
//! of decode (weight bytes read per token × tokens/s) and its ratio to the device's measured
//! copy bandwidth.

use crate::{load, ModelArg};
use anyhow::{bail, Result};
use clap::Args;
use ferrolm::generate::Session;
use ferrolm::sample::{Sampler, SamplerConfig};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    kv: crate::KvArg,
    /// Prompt length (tokens) for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated for the decode measurement (EOS ignored).
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Context already in the cache before the measured prompt (tokens, prefilled untimed):
    /// prefill and decode speed at depth, as llama-bench's -d.
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// Sample the decode tokens at this temperature (0 = greedy, as llama-bench) ...
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// ... from the k best (0 = all): what a sampled step costs over a greedy one.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Number of measured runs (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

const TEXT: &str = "The history of computing is a story of layered abstractions. Engineers built \
relays, then vacuum tubes, then transistors, and each layer hid the one below it. Compilers \
turned symbols into machine code; operating systems shared one machine among many programs. \
Today a language model predicts the next word from the words before it, one token at a time, \
and the speed of that loop is set by how fast the weights can be read from memory. ";

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Peak resident set size of this process (Linux: VmHWM), in bytes.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.prompt_tokens == 0 || a.gen_tokens == 0 || a.repeats == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repeats must be at least 1");
    }
    SamplerConfig { temperature: a.temperature, ..Default::default() }.validate()?;
    let t0 = std::time::Instant::now();
    crate::with_model!(load::model_with_kv(&a.model, &a.kv)?, l => bench_on(l, a, t0))
}

/// `t0`: when the command started (load time and load-to-first-token are measured from it).
fn bench_on<B: ferrolm::backend::Backend>(l: load::Loaded<B>, a: BenchArgs, t0: std::time::Instant) -> Result<()> {
    let load_secs = t0.elapsed().as_secs_f64();
    let mut first_token_secs = None;
    let ctx = a.depth + a.prompt_tokens + a.gen_tokens;
    if ctx > l.model.cfg.max_ctx {
        bail!(
            "--depth + --prompt-tokens + --gen-tokens = {ctx} exceeds the model's context of {}",
            l.model.cfg.max_ctx
        );
    }
    let one = l.tokenizer.encode(TEXT, false)?;
    let text: Vec<u32> = one.iter().cycle().take(a.depth + a.prompt_tokens).copied().collect();
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    let kv_token_bytes = l.model.kv_scheme().position_bytes(&l.model.cfg);
    let kv_bytes = ctx * kv_token_bytes;
    // A warm-up run, then the timed ones.
    let bar = ferrolm::progress::count_bar(load::progress(), a.repeats as u64 + 1, "runs");
    for run in 0..=a.repeats {
        bar.inc(1);
        let mut s = Session::new(&l.model, ctx)?;
        if a.depth > 0 {
            s.feed(&text[..a.depth])?; // the context, untimed
        }
        let mut sampler =
            Sampler::new(SamplerConfig { temperature: a.temperature, top_k: a.top_k, seed: 1, ..Default::default() });
        let st = s.generate(&text, a.gen_tokens, &mut sampler, &[], |_| {
            // The first run's first token: load, the prompt's prefill (kernels compiled or
            // taken from the cache on first use), the first sample.
            first_token_secs.get_or_insert_with(|| t0.elapsed().as_secs_f64());
            Ok(true)
        })?;
        if run > 0 {
            pre.push(st.prefill_tps());
            dec.push(st.decode_tps());
        }
    }
    bar.finish_and_clear();
    let threads = rayon::current_num_threads();
    let (p, d) = (median(&mut pre), median(&mut dec));
    let rss = peak_rss();
    let backend = &l.model.backend;
    let mem = backend.device_memory()?; // after the runs: weights, caches, scratch
    let copy_bw = backend.copy_bandwidth()?;
    let wbytes = l.model.decode_weight_bytes;
    let eff_bw = wbytes as f64 * d;
    if a.json {
        let j = serde_json::json!({
            "backend": l.model.backend.name(),
            "threads": threads,
            "tensor_parallel": a.model.tensor_parallel,
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "repeats": a.repeats,
            "prefill_tps": p,
            "decode_tps": d,
            "prefill_runs": pre,
            "decode_runs": dec,
            "peak_rss_bytes": rss,
            "model_file_bytes": l.file_bytes,
            "kv_cache_bytes": kv_bytes,
            "kv_scheme": l.model.kv_scheme().to_string(),
            "kv_start": l.model.kv_start(),
            "kv_bytes_per_token": kv_token_bytes,
            "synthetic": l.synthetic,
            "depth": a.depth,
            "load_seconds": load_secs,
            "first_token_seconds": first_token_secs,
            "temperature": a.temperature,
            "top_k": a.top_k,
            "device": mem.as_ref().map(|m| m.0.clone()),
            "device_memory_used_bytes": mem.as_ref().map(|m| m.1),
            "device_memory_total_bytes": mem.as_ref().map(|m| m.2),
            "decode_weight_bytes_per_token": wbytes,
            "effective_bandwidth_bytes_per_s": eff_bw,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "bandwidth_ratio": copy_bw.map(|c| eff_bw / c),
        });
        println!("{j}");
    } else {
        if let Some(name) = &l.synthetic {
            println!("model SYNTHETIC weights ({name}): report these numbers as measured on synthetic weights");
        }
        println!(
            "backend {}{}  threads {threads}  depth {}  prompt {}  gen {}  repeats {}",
            backend.name(),
            match a.model.tensor_parallel {
                1 => String::new(),
                n => format!(" over {n} tensor-parallel ranks"),
            },
            a.depth,
            a.prompt_tokens,
            a.gen_tokens,
            a.repeats
        );
        println!("prefill {p:.1} tok/s (median)   decode {d:.1} tok/s (median)");
        println!(
            "load {load_secs:.2} s, first token {:.2} s after start (first run, {}-token prompt{})",
            first_token_secs.unwrap_or(f64::NAN),
            a.prompt_tokens,
            if a.depth > 0 { " after the depth" } else { "" }
        );
        if let Some((name, used, total)) = &mem {
            println!("device {name}: {:.0} MiB used of {:.0} MiB", *used as f64 / 1048576.0, *total as f64 / 1048576.0);
        }
        print!(
            "decode reads {:.1} MiB of weights per token: {:.3} TB/s effective",
            wbytes as f64 / 1048576.0,
            eff_bw / 1e12
        );
        match copy_bw {
            Some(c) => println!(", {:.1}% of the measured copy bandwidth {:.3} TB/s", 100.0 * eff_bw / c, c / 1e12),
            None => println!(),
        }
        if let Some(r) = rss {
            println!(
                "peak RSS {:.1} MiB = {:.2}× (model file {:.1} MiB + KV cache {:.1} MiB, {} at {kv_token_bytes} B/token)",
                r as f64 / 1048576.0,
                r as f64 / (l.file_bytes + kv_bytes as u64) as f64,
                l.file_bytes as f64 / 1048576.0,
                kv_bytes as f64 / 1048576.0,
                l.model.kv_scheme(),
            );
        }
    }
    Ok(())
}
