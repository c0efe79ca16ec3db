//! The engine thread: admits waiting requests while the batch and the KV budget have room,
//! then advances each running request by one step per round (a prefill chunk, or one
//! token), handing its events to its sink.

use super::{EngineConfig, Event, Failure, FailureKind, Finish, Job, Msg, Shared, Usage};
use crate::backend::Backend;
use crate::generate::Session;
use crate::model::Decoder;
use crate::sample::Sampler;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// A running request.
struct Seq<'m, B: Backend> {
    job: Job,
    session: Session<'m, B>,
    sampler: Sampler,
    /// Prompt, then the generated tokens.
    history: Vec<u32>,
    /// Prompt tokens in the cache so far.
    fed: usize,
    /// Most tokens it may generate.
    max_tokens: usize,
    generated: usize,
    /// Logits after the last token in the cache, not yet sampled.
    logits: Option<Vec<f32>>,
    kv_bytes: usize,
}

/// How a request left the batch.
enum End {
    Finished(Finish),
    Failed(Failure),
    /// Cancelled, or its sink refused an event: nobody listens any more.
    Gone,
}

fn shutdown() -> Failure {
    Failure::new(FailureKind::Shutdown, "the server shut down before the request finished")
}

fn shutting_down() -> Failure {
    Failure::new(FailureKind::Shutdown, "the server is shutting down")
}

fn internal(e: crate::Error) -> End {
    End::Failed(Failure::new(FailureKind::Internal, e.to_string()))
}

pub(super) struct Worker<'m, B: Backend> {
    model: &'m Decoder<B>,
    cfg: EngineConfig,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Msg>,
    waiting: VecDeque<Job>,
    running: Vec<Seq<'m, B>>,
    /// Set by a shutdown: running requests still going then fail.
    deadline: Option<Instant>,
    /// KV bytes one position takes (every layer, K and V, bf16).
    token_bytes: usize,
    /// The KV byte budget (resolved by Engine::start).
    kv_memory: usize,
}

impl<'m, B: Backend> Worker<'m, B> {
    pub(super) fn new(model: &'m Decoder<B>, cfg: EngineConfig, shared: Arc<Shared>, rx: mpsc::Receiver<Msg>) -> Self {
        let c = &model.cfg;
        let token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2;
        let kv_memory = cfg.kv_memory.unwrap_or(0);
        Worker {
            model,
            cfg,
            shared,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            deadline: None,
            token_bytes,
            kv_memory,
        }
    }

    pub(super) fn run(mut self) {
        loop {
            if !self.receive() {
                break;
            }
            self.admit();
            self.round();
            self.publish();
            if self.deadline.is_some() && self.running.is_empty() {
                break;
            }
        }
        for job in std::mem::take(&mut self.waiting) {
            self.fail_job(job, shutting_down());
        }
        for s in std::mem::take(&mut self.running) {
            self.end(s, End::Failed(shutdown()));
        }
        self.publish();
    }

    /// Take the messages that arrived; wait for one when there is nothing to run. False
    /// when every handle is gone and nothing runs.
    fn receive(&mut self) -> bool {
        let idle = self.running.is_empty() && self.waiting.is_empty() && self.deadline.is_none();
        if idle {
            match self.rx.recv() {
                Ok(m) => self.handle(m),
                Err(_) => return false,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(m) => self.handle(m),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.deadline.get_or_insert_with(Instant::now);
                    return true;
                }
            }
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Submit(job) if self.deadline.is_some() => self.fail_job(job, shutting_down()),
            Msg::Submit(job) => self.waiting.push_back(job),
            Msg::Cancel(id) => {
                if let Some(i) = self.waiting.iter().position(|j| j.id == id) {
                    self.waiting.remove(i);
                    self.shared.waiting.fetch_sub(1, Relaxed);
                    self.shared.cancelled.fetch_add(1, Relaxed);
                }
                if let Some(i) = self.running.iter().position(|s| s.job.id == id) {
                    let s = self.running.swap_remove(i);
                    self.end(s, End::Gone);
                }
            }
            Msg::Shutdown(at) => {
                self.deadline = Some(at);
                for job in std::mem::take(&mut self.waiting) {
                    self.fail_job(job, shutting_down());
                }
            }
        }
    }

    /// Move waiting requests into the batch, in arrival order, while it and the KV budget
    /// have room for them.
    fn admit(&mut self) {
        let used: usize = self.running.iter().map(|s| s.kv_bytes).sum();
        let mut free = self.kv_memory.saturating_sub(used);
        while self.running.len() < self.cfg.max_batch {
            let Some(job) = self.waiting.front() else { break };
            let max_tokens = job.req.max_tokens.unwrap_or(usize::MAX).min(self.cfg.max_context - job.req.prompt.len());
            let cap = job.req.prompt.len() + max_tokens;
            let kv_bytes = cap * self.token_bytes;
            if kv_bytes > self.kv_memory {
                let job = self.waiting.pop_front().expect("front exists");
                let msg = format!(
                    "the request needs {kv_bytes} bytes of KV cache ({cap} tokens), more than the server's budget of {}",
                    self.kv_memory
                );
                self.fail_job(job, Failure::new(FailureKind::TooLarge, msg));
                continue;
            }
            if kv_bytes > free {
                break;
            }
            let job = self.waiting.pop_front().expect("front exists");
            match Session::new(self.model, cap) {
                Ok(session) => {
                    self.shared.waiting.fetch_sub(1, Relaxed);
                    free -= kv_bytes;
                    let sampler = Sampler::new(job.req.sampler.clone());
                    let history = job.req.prompt.clone();
                    self.running.push(Seq {
                        job,
                        session,
                        sampler,
                        history,
                        fed: 0,
                        max_tokens,
                        generated: 0,
                        logits: None,
                        kv_bytes,
                    });
                }
                Err(e) => {
                    let msg = format!("allocating the request's KV cache: {e}");
                    self.fail_job(job, Failure::new(FailureKind::Internal, msg))
                }
            }
        }
    }

    /// One step of every running request; those that end leave the batch.
    fn round(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            let end = match self.timed_out(&self.running[i], now) {
                Some(f) => Some(End::Failed(f)),
                None => self.step(i),
            };
            match end {
                Some(e) => {
                    let s = self.running.swap_remove(i);
                    self.end(s, e);
                }
                None => i += 1,
            }
        }
    }

    fn timed_out(&self, s: &Seq<'m, B>, now: Instant) -> Option<Failure> {
        if self.deadline.is_some_and(|d| now >= d) {
            return Some(shutdown());
        }
        let limit = self.cfg.request_timeout?;
        (now.duration_since(s.job.arrived) > limit).then(|| {
            Failure::new(FailureKind::Timeout, format!("the request timed out after {} s", limit.as_secs_f64()))
        })
    }

    /// Advance request i by one prefill chunk or one token.
    fn step(&mut self, i: usize) -> Option<End> {
        let chunk = self.model.backend.prefill_chunk();
        let s = &mut self.running[i];
        let prompt_len = s.job.req.prompt.len();
        if s.fed < prompt_len {
            let end = (s.fed + chunk).min(prompt_len);
            match s.session.feed(&s.job.req.prompt[..end]) {
                Ok((logits, _)) => s.logits = Some(logits),
                Err(e) => return Some(internal(e)),
            }
            s.fed = end;
            if end < prompt_len {
                return None;
            }
            let started = Event::Started { prompt_tokens: prompt_len, cached_tokens: 0 };
            if !(s.job.sink)(started) {
                return Some(End::Gone);
            }
        }
        let mut logits = match s.logits.take() {
            Some(l) => l,
            None => {
                let last = *s.history.last().expect("a prompt is never empty");
                match s.session.step(last) {
                    Ok(l) => l,
                    Err(e) => return Some(internal(e)),
                }
            }
        };
        let (id, logprobs) = match s.job.req.logprobs {
            Some(n) => {
                let (id, lp) = s.sampler.sample_logprobs(&mut logits, &s.history, prompt_len, n);
                (id, Some(lp))
            }
            None => (s.sampler.sample_output(&mut logits, &s.history, prompt_len), None),
        };
        s.generated += 1;
        self.shared.generated.fetch_add(1, Relaxed);
        if s.job.req.stop_tokens.contains(&id) {
            return Some(End::Finished(Finish::Stop));
        }
        if !(s.job.sink)(Event::Token { id, logprobs }) {
            return Some(End::Gone);
        }
        s.history.push(id);
        (s.generated >= s.max_tokens).then_some(End::Finished(Finish::Length))
    }

    /// A request leaves the batch (the caller has removed it from `running`): the
    /// counters and gauges first, then its last event, so that whoever hears it sees the
    /// request gone from the stats; then its cache goes back.
    fn end(&self, mut s: Seq<'m, B>, end: End) {
        let usage = Usage { prompt_tokens: s.job.req.prompt.len(), cached_tokens: 0, completion_tokens: s.generated };
        let sh = &self.shared;
        sh.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Relaxed);
        let secs = s.job.arrived.elapsed().as_secs_f64();
        let mean = f64::from_bits(sh.mean_secs.load(Relaxed));
        sh.mean_secs.store((if mean == 0.0 { secs } else { 0.9 * mean + 0.1 * secs }).to_bits(), Relaxed);
        let event = match end {
            End::Finished(reason) => {
                sh.finished.fetch_add(1, Relaxed);
                Event::Finished { reason, usage }
            }
            End::Failed(f) => {
                sh.failed.fetch_add(1, Relaxed);
                Event::Failed(f)
            }
            End::Gone => {
                sh.cancelled.fetch_add(1, Relaxed);
                self.publish();
                return;
            }
        };
        self.publish();
        (s.job.sink)(event);
        // s drops here: the session hands its cache back.
    }

    /// A request that never ran (it was waiting, or came during shutdown).
    fn fail_job(&self, mut job: Job, f: Failure) {
        (job.sink)(Event::Failed(f));
        self.shared.waiting.fetch_sub(1, Relaxed);
        self.shared.failed.fetch_add(1, Relaxed);
    }

    fn publish(&self) {
        let sh = &self.shared;
        sh.running.store(self.running.len(), Relaxed);
        sh.kv_used.store(self.running.iter().map(|s| s.kv_bytes).sum(), Relaxed);
    }
}
