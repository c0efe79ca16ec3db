//! The engine thread: admits waiting requests while the batch and the KV cache have room,
//! then runs one step per round over every running request together (continuous
//! batching): each decoding request's next token and prefill chunks of the others, up to
//! a step's row budget, in one forward call. A greedy request running alone past its
//! prompt takes fed runs instead (fed.rs).

use super::caches::Caches;
use super::disk::DiskPrefixes;
use super::fed::FedRun;
use super::{EngineConfig, Event, Failure, FailureKind, Finish, Job, Msg, Shared, Usage};
use crate::backend::Backend;
use crate::kv::paged::SeqKv;
use crate::kv::BLOCK;
use crate::model::{Decoder, RowOut};
use crate::sample::Sampler;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// An admitted request.
pub(super) struct Seq {
    pub(super) job: Job,
    sampler: Sampler,
    /// Prompt, then the generated tokens.
    pub(super) history: Vec<u32>,
    pub(super) prompt_len: usize,
    /// Most tokens it may generate.
    pub(super) max_tokens: usize,
    pub(super) generated: usize,
    /// Prompt tokens found in the prefix cache when it was first admitted.
    cached: usize,
    /// Whether `Started` went out.
    started: bool,
    /// None while preempted (its cache given back; recomputed when readmitted).
    pub(super) place: Option<SeqKv>,
}

impl Seq {
    /// Positions its KV cache holds.
    pub(super) fn written(&self) -> usize {
        self.place.as_ref().map_or(0, |p| p.len)
    }

    /// Positions to compute before its next token can be sampled.
    pub(super) fn pending(&self) -> usize {
        self.history.len() - self.written()
    }

    /// Whether its cache holds its whole prompt: its rows from here on are generated rows.
    pub(super) fn past_prompt(&self) -> bool {
        self.written() >= self.prompt_len
    }

    /// Whether its next token needs the logits: it samples, penalizes or reports
    /// log-probabilities (else the argmax is the token: `Sampler::plain_greedy`).
    pub(super) fn wants_logits(&self) -> bool {
        self.job.req.logprobs.is_some() || !self.sampler.plain_greedy()
    }
}

/// How a request left.
pub(super) enum End {
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

pub(super) struct Worker<'m, B: Backend> {
    pub(super) model: &'m Decoder<B>,
    cfg: EngineConfig,
    pub(super) shared: Arc<Shared>,
    rx: mpsc::Receiver<Msg>,
    waiting: VecDeque<Job>,
    /// In admission order (the youngest is preempted first).
    pub(super) running: Vec<Seq>,
    /// Preempted when blocks ran out; readmitted before anything waiting.
    pub(super) preempted: VecDeque<Seq>,
    pub(super) caches: Caches<B>,
    /// Most rows one step computes (decode rows always fit; prefill chunks fill the rest).
    pub(super) step_rows: usize,
    /// Generated rows are planned apart from prompt rows (`Backend::generated_rows_apart`):
    /// one a request a step, and prefix-cache blocks holding them keyed by where they start.
    pub(super) rows_apart: bool,
    /// Set by a shutdown: running requests still going then fail.
    deadline: Option<Instant>,
    /// The prefix cache on disk, when there is one (disk.rs).
    disk: Option<DiskPrefixes>,
    /// Generated calls a fed run queues (fed.rs; `EngineConfig::fed_steps`), and the run
    /// queued and not read yet.
    pub(super) fed_steps: usize,
    pub(super) fed: Option<FedRun>,
}

/// Whether generated rows go apart by default: where the backend computes them so and
/// the engine runs one request at a time. The batched decode kernels beat the serving
/// GEMMs only at one row so far (H200, 1B shape: one stream 1,512.7 against 593.6 tok/s;
/// 8 streams 3,119.4 against 3,625.1, 32 streams 4,911.3 against 7,842.3; docs/perf.md).
fn default_rows_apart<B: Backend>(model: &Decoder<B>, cfg: &EngineConfig) -> bool {
    model.backend.generated_rows_apart() && cfg.max_batch <= 1
}

impl<'m, B: Backend> Worker<'m, B> {
    pub(super) fn new(
        model: &'m Decoder<B>,
        cfg: EngineConfig,
        shared: Arc<Shared>,
        rx: mpsc::Receiver<Msg>,
    ) -> crate::Result<Self> {
        // A step's rows bound how long the decodes batched with a prompt wait for it: at
        // most CALL_ROWS (512) prompt rows a step, however large a session's prefill chunk.
        let step_rows = model.backend.prefill_chunk().min(crate::kv::CALL_ROWS);
        let caches = Caches::new(model, cfg.kv_memory.unwrap_or(0), cfg.max_batch, step_rows)?;
        let scheme = model.kv_scheme().to_string();
        let disk = cfg.prefix_cache_dir.clone().map(|d| DiskPrefixes::open(d, &scheme)).transpose()?;
        let rows_apart = cfg.generated_rows_apart.unwrap_or_else(|| default_rows_apart(model, &cfg));
        let fed_steps = cfg.fed_steps.min(crate::backend::FEED_STEPS_MAX);
        Ok(Worker {
            model,
            cfg,
            shared,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            caches,
            step_rows,
            rows_apart,
            deadline: None,
            disk,
            fed_steps,
            fed: None,
        })
    }

    pub(super) fn run(mut self) {
        loop {
            if !self.receive() {
                break;
            }
            let t = Instant::now();
            self.expire();
            self.admit();
            let cost = self.fed_round().or_else(|| self.step());
            self.publish();
            if let Some(c) = cost {
                // The step's counters before its forward time (Release; `stats` loads the
                // forward time first, Acquire), so a reader never sees more forward time than
                // step time.
                self.shared.steps.fetch_add(c.steps as u64, Release);
                self.shared.step_nanos.fetch_add(t.elapsed().as_nanos() as u64, Release);
                self.shared.forward_nanos.fetch_add(c.nanos, Release);
            }
            if self.deadline.is_some() && self.running.is_empty() && self.preempted.is_empty() {
                break;
            }
        }
        for job in std::mem::take(&mut self.waiting) {
            self.fail_job(job, shutting_down());
        }
        let left: Vec<Seq> = self.running.drain(..).chain(self.preempted.drain(..)).collect();
        for s in left {
            self.end(s, End::Failed(shutdown()));
        }
        self.publish();
    }

    /// Take the messages that arrived; wait for one when there is nothing to run. False
    /// when every handle is gone and nothing runs.
    fn receive(&mut self) -> bool {
        let idle =
            self.running.is_empty() && self.preempted.is_empty() && self.waiting.is_empty() && self.deadline.is_none();
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
                    let s = self.running.remove(i);
                    self.end(s, End::Gone);
                }
                if let Some(i) = self.preempted.iter().position(|s| s.job.id == id) {
                    let s = self.preempted.remove(i).expect("found above");
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

    /// Fail the requests past the shutdown deadline or their timeout.
    fn expire(&mut self) {
        let now = Instant::now();
        let failure = |s: &Seq| -> Option<Failure> {
            if self.deadline.is_some_and(|d| now >= d) {
                return Some(shutdown());
            }
            let limit = self.cfg.request_timeout?;
            (now.duration_since(s.job.arrived) > limit).then(|| {
                Failure::new(FailureKind::Timeout, format!("the request timed out after {} s", limit.as_secs_f64()))
            })
        };
        let mut ended = vec![];
        for queue in [0, 1] {
            let mut i = 0;
            loop {
                let s = match queue {
                    0 => self.running.get(i),
                    _ => self.preempted.get(i),
                };
                let Some(s) = s else { break };
                match failure(s) {
                    Some(f) => {
                        let s = match queue {
                            0 => self.running.remove(i),
                            _ => self.preempted.remove(i).expect("exists"),
                        };
                        ended.push((s, f));
                    }
                    None => i += 1,
                }
            }
        }
        for (s, f) in ended {
            self.end(s, End::Failed(f));
        }
    }

    /// Readmit preempted requests, then move waiting ones in, in arrival order, while the
    /// batch and the cache have room for them.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(s) = self.preempted.front() else { break };
            let Some(place) = self.caches.admit(&s.history, self.generated_from(s.prompt_len)) else { return };
            let mut s = self.preempted.pop_front().expect("front exists");
            s.place = Some(place);
            self.running.push(s);
        }
        while self.running.len() < self.cfg.max_batch {
            self.load_prefix_from_disk();
            let Some(job) = self.waiting.front() else { break };
            let prompt_len = job.req.prompt.len();
            let max_tokens = job.req.max_tokens.unwrap_or(usize::MAX).min(self.cfg.max_context - prompt_len);
            let cap = prompt_len + max_tokens;
            if !self.caches.fits(cap) {
                let job = self.waiting.pop_front().expect("front exists");
                let (_, total) = self.caches.bytes();
                let msg = format!(
                    "the request needs a KV cache of {cap} tokens, more than the server's budget of {total} bytes holds"
                );
                self.fail_job(job, Failure::new(FailureKind::TooLarge, msg));
                continue;
            }
            let Some(place) = self.caches.admit(&job.req.prompt, self.generated_from(prompt_len)) else { break };
            let job = self.waiting.pop_front().expect("front exists");
            self.shared.waiting.fetch_sub(1, Relaxed);
            let cached = place.len;
            self.running.push(Seq {
                sampler: Sampler::new(job.req.sampler.clone()),
                history: job.req.prompt.clone(),
                prompt_len,
                max_tokens,
                generated: 0,
                cached,
                started: false,
                place: Some(place),
                job,
            });
        }
    }

    /// Where a request's generated rows start, for its prefix-cache keys: after its prompt
    /// when they take an arithmetic of their own, else nowhere (`usize::MAX`).
    fn generated_from(&self, prompt_len: usize) -> usize {
        if self.rows_apart {
            prompt_len
        } else {
            usize::MAX
        }
    }

    /// The first waiting request's prompt, once: blocks of it the disk prefix cache holds
    /// beyond the memory's go into the memory cache (disk.rs).
    fn load_prefix_from_disk(&mut self) {
        let Some(disk) = &self.disk else { return };
        let Some(job) = self.waiting.front_mut().filter(|j| !j.disk_checked) else { return };
        job.disk_checked = true;
        let prompt = job.req.prompt.clone();
        if let Err(e) = disk.load(self.model, &mut self.caches, &prompt, self.step_rows) {
            tracing::warn!("prefix cache on disk: {e}; computing the prompt");
        }
    }

    /// Request i's prefill is done: save its prompt's shareable blocks to the disk prefix
    /// cache when it computed some of them (disk.rs).
    fn save_prefix_to_disk(&mut self, i: usize) {
        let s = &self.running[i];
        let (Some(disk), Some(place)) = (&mut self.disk, &s.place) else { return };
        if s.cached >= s.prompt_len.saturating_sub(1) / BLOCK * BLOCK {
            return;
        }
        if let Err(e) = disk.save(self.model, &self.caches, place, &s.history[..s.prompt_len]) {
            tracing::warn!("prefix cache on disk: {e}");
        }
    }

    /// Preempt the youngest running request: its cache goes back (its full blocks stay in
    /// the prefix cache) and it waits to be readmitted and recomputed.
    pub(super) fn preempt_youngest(&mut self) {
        if let Some(mut s) = self.running.pop() {
            if let Some(p) = s.place.take() {
                self.caches.free(p);
            }
            self.shared.preemptions.fetch_add(1, Relaxed);
            self.preempted.push_front(s);
        }
    }

    /// The logits after a request's last token are in `logits`: sample its next token and
    /// hand it out. Some(end) when the request ends.
    /// The next token of request i from its last row's output (`step::forward` asked for
    /// logits exactly where the request samples from them).
    pub(super) fn sample(&mut self, i: usize, row: RowOut) -> Option<End> {
        if !self.running[i].started {
            self.save_prefix_to_disk(i);
        }
        let s = &mut self.running[i];
        if !s.started {
            s.started = true;
            let started = Event::Started { prompt_tokens: s.prompt_len, cached_tokens: s.cached };
            if !(s.job.sink)(started) {
                return Some(End::Gone);
            }
        }
        let (id, logprobs) = match (row, s.job.req.logprobs) {
            (RowOut::Token(id), _) => (id, None),
            (RowOut::Logits(mut logits), Some(n)) => {
                let (id, lp) = s.sampler.sample_logprobs(&mut logits, &s.history, s.prompt_len, n);
                (id, Some(lp))
            }
            (RowOut::Logits(mut logits), None) => {
                (s.sampler.sample_output(&mut logits, &s.history, s.prompt_len), None)
            }
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

    /// A request leaves (the caller has removed it from its queue): the counters and
    /// gauges first, then its last event, so that whoever hears it sees the request gone
    /// from the stats.
    pub(super) fn end(&mut self, mut s: Seq, end: End) {
        if let Some(p) = s.place.take() {
            self.caches.free(p);
        }
        let usage = Usage { prompt_tokens: s.prompt_len, cached_tokens: s.cached, completion_tokens: s.generated };
        let sh = &self.shared;
        sh.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Relaxed);
        sh.cached_tokens.fetch_add(usage.cached_tokens as u64, Relaxed);
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
        sh.kv_used.store(self.caches.bytes().0, Relaxed);
        let (used, total) = self.caches.blocks();
        sh.kv_blocks_used.store(used, Relaxed);
        sh.kv_blocks_total.store(total, Relaxed);
    }
}
