//! Serving many requests at once: an engine thread owns the model and advances every
//! running request by one step (a prefill chunk or one generated token) per round, so
//! requests join and leave between steps (continuous batching). A bounded waiting queue,
//! a KV byte budget, per-request context limits, deadlines and cancellation keep one
//! client from holding up or breaking the others. The front end (crates/server) talks to
//! it through `Engine::submit` and the events each request's sink receives.

mod caches;
mod disk;
mod fed;
mod step;
mod worker;

use crate::model::Decoder;
use crate::sample::{SamplerConfig, TokenLogprobs};
use crate::{backend::Backend, Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Requests running (holding a KV cache) at once.
    pub max_batch: usize,
    /// Requests waiting for a place beyond which `submit` answers `Busy`.
    pub max_queue: usize,
    /// Most tokens (prompt and generated) one request may hold; capped by the model's.
    pub max_context: usize,
    /// Bytes the running requests' KV caches may take together; None: `auto_kv_memory`.
    pub kv_memory: Option<usize>,
    /// A request still running this long after it arrived fails with a timeout.
    pub request_timeout: Option<Duration>,
    /// Keep the prefix cache on disk too (serving/disk.rs), across restarts.
    pub prefix_cache_dir: Option<PrefixCacheDir>,
    /// Plan generated rows apart from prompt rows and compute them in calls of their own
    /// (`Backend::generated_rows_apart`); None: where the backend can and `max_batch` is 1
    /// (the only case they are faster yet). On a backend whose rows all take one arithmetic
    /// it changes only the plan (the tests run the planning both ways).
    pub generated_rows_apart: Option<bool>,
    /// Generated calls one fed run queues for a lone greedy request (serving/fed.rs:
    /// where generated rows go apart and the backend feeds steps, at most
    /// `backend::FEED_STEPS_MAX`); 0: none, every token a planned step's. 1 by default:
    /// runs of 8 measured no faster (H100, 1B shape: 2,083.9 against 2,091.9 tok/s at one
    /// stream) and would hand tokens out 8 at a time.
    pub fed_steps: usize,
}

/// The prefix cache's directory, and the model's fingerprint (kv::file::model_fingerprint)
/// its files must carry.
#[derive(Clone, Debug)]
pub struct PrefixCacheDir {
    pub dir: std::path::PathBuf,
    pub fingerprint: String,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 32,
            max_queue: 256,
            max_context: usize::MAX,
            kv_memory: None,
            request_timeout: Some(Duration::from_secs(600)),
            prefix_cache_dir: None,
            generated_rows_apart: None,
            fed_steps: 1,
        }
    }
}

/// One generation request, in token ids.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Most tokens to generate; None: until the request's context is full.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    /// Log-probabilities of each generated token and of the n most probable (≤
    /// `MAX_TOP_LOGPROBS`), when Some(n).
    pub logprobs: Option<usize>,
    /// Tokens that end the generation (not handed out): the model's end-of-turn ids.
    pub stop_tokens: Vec<u32>,
}

/// What a request's sink receives, in this order: `Started` once its prompt is in the
/// cache, a `Token` per generated token, then `Finished` or `Failed` (nothing after).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Started { prompt_tokens: usize, cached_tokens: usize },
    Token { id: u32, logprobs: Option<TokenLogprobs> },
    Finished { reason: Finish, usage: Usage },
    Failed(Failure),
}

/// Why a request failed, for the front end's status code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The request can never run here (its KV cache exceeds the server's whole budget).
    TooLarge,
    /// It ran past the request timeout.
    Timeout,
    /// The server shut down first.
    Shutdown,
    /// The engine's own failure (a device error).
    Internal,
}

impl Failure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Failure {
        Failure { kind, message: message.into() }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token (the caller's stop strings end a request by cancelling it).
    Stop,
    /// max_tokens generated, or the request's context full.
    Length,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the cache instead of being computed.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// Receives a request's events on the engine thread; returning false cancels the request
/// (the client is gone). It must not block.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full: try again after about this long.
    Busy { retry_after: Duration },
    /// The request cannot run (empty or too long prompt, bad sampling parameters).
    Invalid(String),
    /// The engine is shutting down or has stopped.
    Closed,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Busy { retry_after } => {
                write!(f, "the server is busy (queue full); retry after {} s", retry_after.as_secs().max(1))
            }
            SubmitError::Invalid(m) => f.write_str(m),
            SubmitError::Closed => f.write_str("the server is shutting down"),
        }
    }
}

/// The KV budget when none is given, once the model is loaded: half the device memory
/// still free on a GPU (the rest for activations, captured steps and other processes), a
/// quarter of the memory available on the CPU (`MemAvailable`; 4 GiB where it cannot be
/// read).
pub fn auto_kv_memory<B: Backend>(backend: &B) -> Result<usize> {
    if let Some(free) = backend.kv_memory_free()? {
        return Ok(free / 2);
    }
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<usize>().ok().map(|kib| kib * 1024)
    });
    Ok(avail.map_or(4 << 30, |b| b / 4))
}

/// The model's facts a front end needs.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// Most tokens one request may hold (the engine's max_context, capped by the model's).
    pub max_context: usize,
    /// Token ids the model scores.
    pub vocab: usize,
    /// The KV byte budget in force (the configured one, or `auto_kv_memory`'s).
    pub kv_memory: usize,
    /// The KV cache's scheme (`--kv`) and the bytes one cached token takes in it over every
    /// layer.
    pub kv_scheme: String,
    pub kv_bytes_per_token: usize,
    pub backend: &'static str,
}

/// Counters and gauges for /metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub waiting: usize,
    pub running: usize,
    pub requests_finished: u64,
    pub requests_failed: u64,
    /// Ended by `cancel` or by a sink that stopped listening.
    pub requests_cancelled: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    /// Times a running request gave its KV blocks back to make room (recomputed later).
    pub preemptions: u64,
    pub kv_bytes_used: usize,
    pub kv_bytes_budget: usize,
    /// The cache's scheme and the bytes a cached token takes in it (ModelInfo's).
    pub kv_scheme: String,
    pub kv_bytes_per_token: usize,
    /// Full-attention KV blocks held by running requests, and in the cache (idle cached
    /// blocks count as free: they are reclaimed when needed).
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Engine steps run, the seconds they took (admission, the forward call, sampling and
    /// handing tokens out), and of those the seconds in forward calls (the device's work and
    /// the read-back of its outputs): what a step costs beside its kernels.
    pub steps: u64,
    pub step_seconds: f64,
    pub forward_seconds: f64,
    /// Generated tokens that came from fed runs (serving/fed.rs: a lone greedy request's
    /// calls queued on the device ahead of the host).
    pub fed_tokens: u64,
}

/// Shared between the engine thread and its handles.
#[derive(Default)]
struct Shared {
    waiting: AtomicUsize,
    running: AtomicUsize,
    finished: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated: AtomicU64,
    preemptions: AtomicU64,
    kv_used: AtomicUsize,
    kv_blocks_used: AtomicUsize,
    kv_blocks_total: AtomicUsize,
    steps: AtomicU64,
    step_nanos: AtomicU64,
    forward_nanos: AtomicU64,
    fed_tokens: AtomicU64,
    closed: AtomicBool,
    /// Mean seconds a request has run, for Busy's retry_after (f64 bits).
    mean_secs: AtomicU64,
}

enum Msg {
    Submit(Job),
    Cancel(u64),
    Shutdown(Instant),
}

struct Job {
    id: u64,
    req: Request,
    sink: Sink,
    arrived: Instant,
    /// Whether the disk prefix cache was asked for its prompt already.
    disk_checked: bool,
}

/// The engine: a thread that owns the model. Dropping it shuts down at once (running
/// requests fail); `shutdown` gives them a grace period.
pub struct Engine {
    tx: mpsc::Sender<Msg>,
    shared: Arc<Shared>,
    cfg: EngineConfig,
    info: ModelInfo,
    next_id: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    /// Start the engine thread; `load` builds the model there (a device context stays on
    /// the thread that made it). Returns once the model is loaded, or its error.
    pub fn start<B, F>(load: F, cfg: EngineConfig) -> Result<Engine>
    where
        B: Backend + 'static,
        F: FnOnce() -> Result<Decoder<B>> + Send + 'static,
    {
        if cfg.max_batch == 0 || cfg.max_queue == 0 || cfg.max_context < 2 {
            return Err(Error::Invalid(format!(
                "engine: max_batch {} and max_queue {} must be ≥ 1, max_context {} ≥ 2",
                cfg.max_batch, cfg.max_queue, cfg.max_context
            )));
        }
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let (sh, c) = (shared.clone(), cfg.clone());
        let thread = std::thread::Builder::new()
            .name("ferrolm-engine".into())
            .spawn(move || {
                // The engine thread is the first worker of a pool of its own, as large as
                // the global one: its parallel regions (the CPU backend's, ~150 a step) then
                // start inside a pool instead of waking one from outside, ~10 µs each on few
                // cores. Without the pool they go to the global one, slower but correct.
                // (rayon keeps such a pool's other workers, idle, for the process's life:
                // one engine a server.)
                let _pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(rayon::current_num_threads())
                    .use_current_thread()
                    .build();
                let model = match load() {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let max_context = c.max_context.min(model.cfg.max_ctx);
                let kv_memory = match c.kv_memory.map_or_else(|| auto_kv_memory(&model.backend), Ok) {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let backend = model.backend.name();
                let info = ModelInfo {
                    max_context,
                    vocab: model.logits_width(),
                    kv_memory,
                    kv_scheme: model.kv_scheme().to_string(),
                    kv_bytes_per_token: model.kv_scheme().position_bytes(&model.cfg),
                    backend,
                };
                let cfg = EngineConfig { max_context, kv_memory: Some(kv_memory), ..c };
                let worker = match worker::Worker::new(&model, cfg, sh, rx) {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                if ready_tx.send(Ok(info)).is_err() {
                    return;
                }
                worker.run();
            })
            .map_err(|e| Error::Invalid(format!("starting the engine thread: {e}")))?;
        let info = match ready_rx.recv() {
            Ok(r) => r?,
            Err(_) => return Err(Error::Invalid("the engine thread stopped while loading the model".into())),
        };
        let cfg = EngineConfig { max_context: info.max_context, kv_memory: Some(info.kv_memory), ..cfg };
        Ok(Engine { tx, shared, cfg, info, next_id: AtomicU64::new(1), thread: Mutex::new(Some(thread)) })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queue a request; its events go to `sink`. Returns the request's id (for `cancel`).
    pub fn submit(&self, req: Request, sink: Sink) -> std::result::Result<u64, SubmitError> {
        self.check(&req)?;
        if self.shared.closed.load(Relaxed) {
            return Err(SubmitError::Closed);
        }
        if self.shared.waiting.load(Relaxed) >= self.cfg.max_queue {
            let mean = f64::from_bits(self.shared.mean_secs.load(Relaxed));
            return Err(SubmitError::Busy { retry_after: Duration::from_secs_f64(mean.clamp(1.0, 60.0)) });
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        self.shared.waiting.fetch_add(1, Relaxed);
        let job = Job { id, req, sink, arrived: Instant::now(), disk_checked: false };
        self.tx.send(Msg::Submit(job)).map_err(|_| {
            self.shared.waiting.fetch_sub(1, Relaxed);
            SubmitError::Closed
        })?;
        Ok(id)
    }

    fn check(&self, req: &Request) -> std::result::Result<(), SubmitError> {
        let bad = |m: String| Err(SubmitError::Invalid(m));
        let ctx = self.info.max_context;
        if req.prompt.is_empty() {
            return bad("the prompt is empty (no tokens)".into());
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.info.vocab) {
            return bad(format!("token id {t} is outside the vocabulary ({})", self.info.vocab));
        }
        let max_tokens = req.max_tokens.unwrap_or(1);
        if max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if req.prompt.len().saturating_add(max_tokens) > ctx {
            return bad(format!(
                "this model's context is {ctx} tokens; the prompt has {} and {max_tokens} more were requested",
                req.prompt.len()
            ));
        }
        if req.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return bad(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"));
        }
        req.sampler.validate().map_err(|e| SubmitError::Invalid(e.to_string()))
    }

    /// End a request now: its sink gets nothing more and its KV cache is freed.
    pub fn cancel(&self, id: u64) {
        let _ = self.tx.send(Msg::Cancel(id));
    }

    pub fn stats(&self) -> Stats {
        let s = &self.shared;
        // First (Acquire): the worker adds a step's forward time after its step counters.
        let forward_nanos = s.forward_nanos.load(Acquire);
        Stats {
            waiting: s.waiting.load(Relaxed),
            running: s.running.load(Relaxed),
            requests_finished: s.finished.load(Relaxed),
            requests_failed: s.failed.load(Relaxed),
            requests_cancelled: s.cancelled.load(Relaxed),
            prompt_tokens: s.prompt_tokens.load(Relaxed),
            cached_tokens: s.cached_tokens.load(Relaxed),
            generated_tokens: s.generated.load(Relaxed),
            preemptions: s.preemptions.load(Relaxed),
            kv_bytes_used: s.kv_used.load(Relaxed),
            kv_bytes_budget: self.info.kv_memory,
            kv_scheme: self.info.kv_scheme.clone(),
            kv_bytes_per_token: self.info.kv_bytes_per_token,
            kv_blocks_used: s.kv_blocks_used.load(Relaxed),
            kv_blocks_total: s.kv_blocks_total.load(Relaxed),
            forward_seconds: forward_nanos as f64 * 1e-9,
            steps: s.steps.load(Acquire),
            step_seconds: s.step_nanos.load(Acquire) as f64 * 1e-9,
            fed_tokens: s.fed_tokens.load(Relaxed),
        }
    }

    /// Stop taking requests, let the running ones finish within `grace` (then they fail),
    /// fail the waiting ones, and wait for the engine thread to end.
    pub fn shutdown(&self, grace: Duration) {
        self.shared.closed.store(true, Relaxed);
        let _ = self.tx.send(Msg::Shutdown(Instant::now() + grace));
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}
