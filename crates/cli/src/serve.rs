//! `serve`: the OpenAI-compatible HTTP server (crates/server) over the serving engine.

use crate::{load, ModelArg};
use anyhow::{Context, Result};
use clap::Args;
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::cuda::Cuda;
use ferrolm::model::Decoder;
use ferrolm::serving::{Engine, EngineConfig, PrefixCacheDir};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    kv: crate::KvArg,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests generating at once (each holds a KV cache). 1 on CUDA: each token through
    /// the decode step's kernels, the fastest single stream.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Requests waiting for a place; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Most tokens (prompt and generated) one request may hold (default: the model's, at
    /// most 4096, as generate's --ctx). A request without max_tokens reserves this much KV
    /// cache while it runs.
    #[arg(long)]
    max_context: Option<usize>,
    /// Bytes the running requests' KV caches may take together: plain bytes or with a
    /// suffix K, M, G (powers of 1000) or KiB, MiB, GiB (powers of 1024).
    /// Default: half the GPU memory free after loading the model, or a quarter of the
    /// memory available on the CPU.
    #[arg(long, value_parser = parse_bytes)]
    kv_memory: Option<usize>,
    /// Keep the prefix cache in DIR too (made if missing): prompts' KV blocks saved as KV
    /// files when their prefill is done, and found again by later requests, after a
    /// restart too. The directory grows with every distinct prompt; delete files to trim it.
    #[arg(long, value_name = "DIR")]
    prefix_cache_dir: Option<std::path::PathBuf>,
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long, env = "FERROLM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A request still running this many seconds after it arrived fails (0: no limit).
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// On SIGTERM or SIGINT, seconds requests in flight may take to finish.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
}

/// The engine caps it by the model's context.
const DEFAULT_MAX_CONTEXT: usize = 4096;

/// `4GiB`, `512M`, `1000000`: a byte count (K, M, G powers of 1000; KiB, MiB, GiB of 1024).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("unknown unit {other:?}: use K, M, G, KiB, MiB or GiB")),
    };
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a byte count (e.g. 4GiB, 512M, 1000000)"))?;
    let bytes = n * scale;
    if !(bytes >= 1.0 && bytes < usize::MAX as f64) {
        return Err(format!("{s:?}: give at least one byte"));
    }
    Ok(bytes as usize)
}

/// The id the server gives the model: a repo id as given, else the file's or directory's
/// name (SmolLM2-135M-Instruct.Q4_1 for the default model).
fn model_name(model: Option<&str>) -> Result<String> {
    let path = match model {
        Some(m) if !std::path::Path::new(m).exists() => return Ok(m.to_string()),
        Some(m) => std::path::PathBuf::from(m),
        None => ferrolm::hub::default_model()?,
    };
    let name = if path.is_dir() { path.file_name() } else { path.file_stem() };
    Ok(name.map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned()))
}

pub fn serve(a: ServeArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    let cuda = load::device_is_cuda(&a.model.device)?;
    let scheme = a.kv.scheme()?;
    let kv_start = a.kv.kv_start;
    let (src, tokenizer) = load::prepared_source(&a.model)?;
    let fingerprint = ferrolm::kv::file::model_fingerprint(&src, &tokenizer);
    let cfg = EngineConfig {
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        max_context: a.max_context.unwrap_or(DEFAULT_MAX_CONTEXT),
        kv_memory: a.kv_memory,
        request_timeout: (a.request_timeout > 0).then(|| Duration::from_secs(a.request_timeout)),
        prefix_cache_dir: a.prefix_cache_dir.clone().map(|dir| PrefixCacheDir { dir, fingerprint }),
        generated_rows_apart: ferrolm::env::generated_rows_apart(),
        fed_steps: ferrolm::env::serve_feed_steps(),
    };
    // The model is built on the engine's thread, which keeps it (and a device context).
    let n = load::rank_count(&a.model)?;
    // Devices' contexts are made on the engine's thread, which keeps them.
    let shape = src.config.clone();
    let job = EngineJob { src, scheme, kv_start, cfg };
    let engine = match (n, cuda) {
        (1, true) => {
            job.start(|| Cuda::new(0)).context("loading the model on CUDA (use --device cpu to run on the CPU)")?
        }
        (1, false) => job.start(|| Ok(Cpu))?,
        (n, true) => {
            job.start(move || load::cuda_ranks(n, &shape)).with_context(|| format!("--tensor-parallel {n} on CUDA"))?
        }
        (n, false) => {
            let ranks = load::cpu_ranks(n, &shape).with_context(|| format!("--tensor-parallel {n}"))?;
            job.start(move || Ok(ranks))?
        }
    };
    let info = engine.info().clone();
    let server_cfg = ferrolm_server::Config {
        addr: SocketAddr::new(a.host, a.port),
        model_name: model_name(a.model.model.as_deref())?,
        api_key: a.api_key.filter(|k| !k.is_empty()),
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        ..Default::default()
    };
    let name = server_cfg.model_name.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    rt.block_on(async move {
        let server = ferrolm_server::start(engine, tokenizer, server_cfg)
            .await
            .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
        // One line on stdout for scripts that wait for the server (and read its port).
        println!(
            "ferrolm serve: {name} ({}, context {}, KV {} {} B/token, budget {} MiB) on http://{}",
            info.backend,
            info.max_context,
            info.kv_scheme,
            info.kv_bytes_per_token,
            info.kv_memory >> 20,
            server.local_addr()
        );
        let stop = server.shutdown_handle();
        tokio::spawn(async move {
            stop_signal().await;
            stop.trigger();
        });
        server.wait().await;
        Ok(())
    })
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn stop_signal() {
    let term = async {
        #[cfg(unix)]
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
            return;
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// What the serving engine's thread builds the model from.
struct EngineJob {
    src: ferrolm::formats::ModelSource,
    scheme: ferrolm::kv::scheme::KvScheme,
    kv_start: usize,
    cfg: EngineConfig,
}

impl EngineJob {
    /// Start the engine on a backend `backend()` makes on its thread.
    fn start<B, F>(self, backend: F) -> ferrolm::Result<Engine>
    where
        B: ferrolm::backend::Backend + 'static,
        F: FnOnce() -> ferrolm::Result<B> + Send + 'static,
    {
        let EngineJob { mut src, scheme, kv_start, cfg } = self;
        Engine::start(
            move || {
                let mut m = Decoder::load(backend()?, &mut src)?;
                m.set_kv_scheme(scheme)?;
                m.set_kv_start(kv_start)?;
                Ok(m)
            },
            cfg,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512_000_000));
        assert_eq!(parse_bytes("1.5kib"), Ok(1536));
        assert_eq!(parse_bytes("2 MiB"), Ok(2 << 20));
        for bad in ["", "G", "4 TB", "-1", "0", "1e9"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
