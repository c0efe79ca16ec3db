//! Generation sessions: a KV cache plus the tokens it holds, prompt prefix reuse across
//! chat turns, and the sample loop shared by `generate`, `chat` and `bench`.

use crate::backend::Backend;
use crate::kv::seq::SeqCache;
use crate::model::{Decoder, Logits};
use crate::sample::Sampler;
use crate::{Error, Result};
use std::time::Instant;

pub struct Session<'m, B: Backend> {
    pub model: &'m Decoder<B>,
    /// Always Some but in `drop`, which hands it to the model's session pool.
    kv: Option<SeqCache<B>>,
    /// Decode logits `[1, V]`, kept on the device across steps (a captured step writes here).
    logits: Option<B::Act>,
    /// The greedy step's token id `[1, 1]` (f32), on the device.
    argmax: Option<B::Act>,
    /// The top-k step's (k, 1/temperature bits) and its (index, value) pairs `[1, 2k]`.
    top_k: Option<(usize, u32, B::Act)>,
    /// Identifies this session's captured decode step in the backend.
    id: u64,
    /// Greedy decode steps one fed run queues (`Backend::step_fed`): `feed_steps()`, or
    /// `set_feed_steps`.
    feed_steps: usize,
    /// Tokens whose K/V are in the cache, in position order.
    pub tokens: Vec<u32>,
}

#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually computed (the rest were reused from the cache).
    pub prefilled: usize,
    pub generated: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub stopped_by_eos: bool,
}

impl GenStats {
    pub fn prefill_tps(&self) -> f64 {
        self.prefilled as f64 / self.prefill_secs.max(1e-9)
    }
    /// Decode tokens/s counts the steps after the first sampled token (each is one forward).
    pub fn decode_tps(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// What a finished session leaves to the next one of the same capacity (`Decoder`'s session
/// pool): its cache, its step buffers and its id, so the backend's captured decode steps,
/// which point at those buffers and are keyed by that id, replay for the next session
/// instead of being captured again. On CUDA a capture (a dry pass, the capture, the graph's
/// instantiation) cost every new session's generation 2% of the 1B's 128-token decode speed
/// (H200, docs/perf-log.md), paid by each bench repeat and each new conversation.
pub(crate) struct SessionParts<B: Backend> {
    kv: SeqCache<B>,
    logits: Option<B::Act>,
    argmax: Option<B::Act>,
    top_k: Option<(usize, u32, B::Act)>,
    id: u64,
}

/// Finished sessions' parts a model keeps (each holds a whole KV cache; `FERROLM_SESSION_POOL`).
fn session_pool_max() -> usize {
    crate::env::session_pool()
}

/// Greedy decode steps a fed run captures and queues at once (one CUDA graph of that many
/// steps, each step's argmax feeding the next on the device), so that the gap between two
/// graphs' launches is paid once per run instead of once per token; the host gets the run's
/// tokens together. `FERROLM_FEED_STEPS` (1: a graph per step). A generation's last tokens,
/// fewer than a run, go one step at a time.
fn feed_steps() -> usize {
    crate::env::feed_steps()
}

impl<'m, B: Backend> Session<'m, B> {
    /// A session with an empty cache of `max_seq` positions (capped by the model's context):
    /// a finished session's parts of that capacity if the model keeps one, else new ones.
    pub fn new(model: &'m Decoder<B>, max_seq: usize) -> Result<Self> {
        let max_seq = max_seq.min(model.cfg.max_ctx).max(1);
        let pooled = {
            let mut pool = model.session_pool.lock().unwrap_or_else(|e| e.into_inner());
            // The last one in of this capacity: a model's caches differ in nothing else yet
            // (a per-session cache format would have to join this match).
            let i = pool.iter().rposition(|p| p.kv.capacity() == max_seq);
            i.map(|i| pool.swap_remove(i))
        };
        let p = match pooled {
            Some(mut p) => {
                p.kv.clear();
                p
            }
            None => {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                SessionParts { kv: model.new_cache(max_seq)?, logits: None, argmax: None, top_k: None, id }
            }
        };
        Ok(Session {
            model,
            kv: Some(p.kv),
            logits: p.logits,
            argmax: p.argmax,
            top_k: p.top_k,
            id: p.id,
            feed_steps: feed_steps(),
            tokens: Vec::new(),
        })
    }

    /// Identifies the session's parts: a session that took a finished one's parts has its id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Greedy decode steps one fed run queues (1 to `FEED_STEPS_MAX`): see `feed_steps()`.
    pub fn set_feed_steps(&mut self, n: usize) -> Result<()> {
        if !(1..=crate::backend::FEED_STEPS_MAX).contains(&n) {
            return Err(Error::Invalid(format!(
                "{n} fed decode steps at once (1 to {})",
                crate::backend::FEED_STEPS_MAX
            )));
        }
        self.feed_steps = n;
        Ok(())
    }

    /// Save the cache and the tokens it holds to a KV file (kv::persist), atomically.
    /// `fingerprint`: kv::file::model_fingerprint of the model.
    pub fn save_cache(&self, path: &std::path::Path, fingerprint: &str) -> Result<()> {
        let kv = self.kv.as_ref().expect("a live session has its cache");
        crate::kv::persist::save(self.model, kv, &self.tokens, fingerprint, path)
    }

    /// Replace the cache with the one saved at `path`; how many tokens it holds, or None
    /// (and the session unchanged) when there is no file. A later `feed` computes only
    /// what its prompt adds to them.
    pub fn restore_cache(&mut self, path: &std::path::Path, fingerprint: &str) -> Result<Option<usize>> {
        let kv = self.kv.as_mut().expect("a live session has its cache");
        let restored = crate::kv::persist::restore(self.model, kv, fingerprint, path);
        match restored {
            Ok(Some(tokens)) => {
                self.tokens = tokens;
                Ok(Some(self.tokens.len()))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                // A refused file may have stopped a restore midway: start empty.
                self.kv.as_mut().expect("a live session has its cache").clear();
                self.tokens.clear();
                Err(e)
            }
        }
    }

    pub fn capacity(&self) -> usize {
        self.kv.as_ref().expect("a live session has its cache").capacity()
    }

    /// Make the cache hold exactly `prompt`, computing only what differs from what it holds
    /// now. Returns the logits after the last prompt token and how many tokens were computed.
    pub fn feed(&mut self, prompt: &[u32]) -> Result<(Vec<f32>, usize)> {
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty (no tokens)".into()));
        }
        if prompt.len() > self.capacity() {
            return Err(Error::Invalid(format!(
                "the prompt has {} tokens, more than the context of {} tokens",
                prompt.len(),
                self.capacity()
            )));
        }
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        // Recompute at least the last token: its logits are what we return; all of them
        // when the sliding layers no longer hold the window before the common part.
        let mut start = common.min(prompt.len() - 1);
        let kv = self.kv.as_mut().expect("a live session has its cache");
        if !kv.can_resume(start) {
            kv.clear();
            start = 0;
        }
        self.tokens.truncate(start);
        // Long prompts go through in chunks: activations stay bounded (a 512-token chunk of
        // a 1B model would hold ~100 MB of MLP activations) at no cost in speed.
        let mut logits = Vec::new();
        for chunk in prompt[start..].chunks(self.model.backend.prefill_chunk()) {
            let kv = self.kv.as_mut().expect("a live session has its cache");
            logits = self.model.forward(chunk, self.tokens.len(), kv, Logits::Last)?;
            self.tokens.extend_from_slice(chunk);
        }
        Ok((logits, prompt.len() - start))
    }

    /// Append one token and return the logits that follow it. The step's launches go
    /// through `Backend::step`, so CUDA captures them once and replays a graph.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        self.run_step(token, StepEnd::Logits)?;
        self.model.backend.read_rows(self.logits.as_ref().expect("set by run_step"), 0)
    }

    /// Append one token and return the greedy (argmax) next token, computed on the device:
    /// a step then reads back 4 bytes instead of the vocabulary's logits.
    pub fn step_greedy(&mut self, token: u32) -> Result<u32> {
        self.run_step(token, StepEnd::Argmax)?;
        let id = self.model.backend.read_rows(self.argmax.as_ref().expect("set by run_step"), 0)?;
        Ok(id[0] as u32)
    }

    /// Append one token and return the k best next tokens as (token, logit × inv_t), found
    /// on the device (`Backend::top_k`), for `Sampler::sample_candidates`: a step reads
    /// back 8·k bytes instead of the vocabulary's logits.
    pub fn step_top_k(&mut self, token: u32, k: usize, inv_t: f32) -> Result<Vec<(u32, f32)>> {
        let b = &self.model.backend;
        crate::backend::check_top_k(self.model.logits_width(), k, 2 * k)?;
        if self.top_k.as_ref().is_none_or(|t| (t.0, t.1) != (k, inv_t.to_bits())) {
            // A new k or temperature is a new capture (both are baked into its launch).
            b.forget(self.key(StepEnd::TopK, 1));
            self.top_k = Some((k, inv_t.to_bits(), b.act_f32(1, 2 * k)?));
        }
        self.run_step(token, StepEnd::TopK)?;
        let v = b.read_rows(&self.top_k.as_ref().expect("set above").2, 0)?;
        Ok(v[..2 * k].chunks(2).map(|p| (p[0] as u32, p[1])).collect())
    }

    /// Queue `n` greedy steps fed on the device (`Backend::step_fed`) at positions
    /// `pos..pos + n`: the first one's input is `token`, or (None) the argmax of the last
    /// step queued before them, and each later one's the argmax of the step before it. The
    /// caller appends the inputs to `tokens` once it has read and accepted them. The steps'
    /// argmaxes are read back through `queue_read(.., slot)`.
    fn queue_fed(&mut self, token: Option<u32>, pos: usize, n: usize, slot: usize) -> Result<()> {
        if pos + n > self.capacity() {
            return Err(Error::Invalid(format!("the context of {} tokens is full", self.capacity())));
        }
        let b = &self.model.backend;
        self.ensure_step_buffers()?;
        let key = self.key(StepEnd::Fed, n);
        let (model, kv) = (self.model, self.kv.as_mut().expect("a live session has its cache"));
        let logits = self.logits.as_mut().expect("set above");
        let argmax = self.argmax.as_mut().expect("set above");
        // The cache's blocks are taken here: a replayed capture does not run the closure.
        kv.prepare(pos, n)?;
        let (full, sliding) = kv.tables();
        let span = crate::kv::Span { rows: n, pos0: pos, full: &full, sliding: &sliding };
        // The token value matters only to the host staging of a given token (a fed step's
        // embedding reads the device's copy); its count sets the step's shape.
        b.step_fed(key, token, &[span], false, &mut || {
            (0..n).try_for_each(|i| {
                model.forward_argmax(&[token.unwrap_or(0)], pos + i, kv, &mut *logits, &mut *argmax, true)
            })
        })?;
        kv.advance(pos + n);
        b.queue_read(argmax, pos, n, slot)
    }

    /// Steps the fed run queued at `pos` takes, `generated` tokens having been accepted
    /// (the one it consumes included): a whole run while `max_tokens` and the context leave
    /// room for one, else one step (no step runs past what the generation can use).
    fn fed_run(&self, generated: usize, max_tokens: usize, pos: usize) -> usize {
        let n = self.feed_steps;
        match generated + n <= max_tokens && pos + n <= self.capacity() {
            true => n,
            false => 1,
        }
    }

    /// Greedy generation with fed steps: while the host reads and hands out a run's tokens,
    /// the run consuming the last of them is already queued on the device (speculatively:
    /// if a token stops generation, the steps after it are dropped and their cache slots,
    /// past `tokens`, are overwritten by whatever is fed next). `first` is the token sampled
    /// from the prompt.
    fn generate_fed(
        &mut self,
        first: u32,
        max_tokens: usize,
        stop: &[u32],
        st: &mut GenStats,
        on_token: &mut impl FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        // Count and hand out token t; false when the generation ends with it (a stop token,
        // not handed out; on_token saying stop; max_tokens reached).
        let mut accept = |st: &mut GenStats, t: u32| -> Result<bool> {
            st.generated += 1;
            if stop.contains(&t) {
                st.stopped_by_eos = true;
                return Ok(false);
            }
            Ok(on_token(t)? && st.generated < max_tokens)
        };
        let mut tok = first;
        let mut slot = 0;
        let mut queued = 0; // steps of the queued run consuming `tok` (0: none queued)
        loop {
            if !accept(st, tok)? || self.tokens.len() >= self.capacity() {
                return Ok(());
            }
            let pos = self.tokens.len();
            let n = match queued {
                0 => {
                    let n = self.fed_run(st.generated, max_tokens, pos);
                    self.queue_fed(Some(tok), pos, n, slot)?;
                    n
                }
                n => n,
            };
            self.tokens.push(tok);
            // The next run (consuming this run's last token) goes in before the read when it
            // may be needed at all; the generation goes on only if it is.
            let (generated, next) = (st.generated + n, pos + n);
            queued = 0;
            if generated < max_tokens && next < self.capacity() {
                queued = self.fed_run(generated, max_tokens, next);
                self.queue_fed(None, next, queued, slot ^ 1)?;
            }
            let toks = self.model.backend.take_read(slot)?;
            slot ^= 1;
            let (&last, inputs) = toks
                .split_last()
                .filter(|_| toks.len() == n)
                .ok_or_else(|| Error::Invalid(format!("a fed run of {n} steps read back {} tokens", toks.len())))?;
            // This run's steps after its first consumed these.
            for &t in inputs {
                if !accept(st, t)? {
                    return Ok(());
                }
                self.tokens.push(t);
            }
            tok = last;
        }
    }

    /// This session's capture of `steps` decode steps ending in `end`.
    fn key(&self, end: StepEnd, steps: usize) -> u64 {
        debug_assert!(steps <= crate::backend::FEED_STEPS_MAX);
        self.id << 7 | (steps as u64) << 2 | end as u64
    }

    /// The decode step's logits and argmax buffers, made on first use.
    fn ensure_step_buffers(&mut self) -> Result<()> {
        if self.logits.is_none() {
            self.logits =
                Some(self.model.backend.act_f32_as(1, self.model.logits_width(), crate::backend::Width::Vocab)?);
            self.argmax = Some(self.model.backend.act_f32(1, 1)?);
        }
        Ok(())
    }

    fn run_step(&mut self, token: u32, end: StepEnd) -> Result<()> {
        let pos = self.tokens.len();
        if pos >= self.capacity() {
            return Err(Error::Invalid(format!("the context of {} tokens is full", self.capacity())));
        }
        let b = &self.model.backend;
        self.ensure_step_buffers()?;
        let key = self.key(end, 1);
        let (model, kv) = (self.model, self.kv.as_mut().expect("a live session has its cache"));
        let logits = self.logits.as_mut().expect("set above");
        let argmax = self.argmax.as_mut().expect("set above");
        let mut top_k = self.top_k.as_mut();
        // The cache's blocks are taken here: a replayed capture does not run the closure.
        kv.prepare(pos, 1)?;
        let (full, sliding) = kv.tables();
        let span = crate::kv::Span { rows: 1, pos0: pos, full: &full, sliding: &sliding };
        // Each ending is its own capture (the last launch differs).
        b.step(key, &[token], &[span], &mut || {
            let logits_only = |logits: &mut B::Act, kv: &mut SeqCache<B>| {
                model.forward_into(&[token], pos, kv, Logits::Last, Some(logits)).map(|_| ())
            };
            match (end, top_k.as_deref_mut()) {
                (StepEnd::Logits, _) => logits_only(logits, kv),
                (StepEnd::Argmax, _) => model.forward_argmax(&[token], pos, kv, &mut *logits, &mut *argmax, false),
                (StepEnd::Fed, _) => Err(Error::Invalid("fed steps are queued by queue_fed".into())),
                (StepEnd::TopK, Some((k, inv_t, out))) => {
                    logits_only(logits, kv)?;
                    b.top_k(logits, *k, f32::from_bits(*inv_t), out)
                }
                (StepEnd::TopK, None) => Err(Error::Invalid("top-k step without its output buffer".into())),
            }
        })?;
        kv.advance(pos + 1);
        self.tokens.push(token);
        Ok(())
    }

    /// Feed `prompt`, then sample up to `max_tokens` tokens, calling `on_token` for each
    /// (return false to stop). Stops at any of `stop` (not passed to `on_token`) or when
    /// the context is full.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        sampler: &mut Sampler,
        stop: &[u32],
        mut on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<GenStats> {
        let mut st = GenStats { prompt_tokens: prompt.len(), ..Default::default() };
        let t0 = Instant::now();
        let (mut logits, prefilled) = self.feed(prompt)?;
        st.prefilled = prefilled;
        st.prefill_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut history = prompt.to_vec();
        // Greedy without penalties needs no logits on the host: the device picks the token.
        // Top-k sampling needs only the k best: the device finds them, the host draws.
        let greedy = sampler.plain_greedy();
        let b = &self.model.backend;
        let top_k =
            b.top_k_preferred() && sampler.top_k_on_device(self.model.logits_width(), crate::backend::TOP_K_MAX);
        if greedy && b.feeds_steps() && max_tokens > 0 {
            let first = sampler.sample(&mut logits, &history);
            self.generate_fed(first, max_tokens, stop, &mut st, &mut on_token)?;
            st.decode_secs = t1.elapsed().as_secs_f64();
            return Ok(st);
        }
        let mut next = None;
        while st.generated < max_tokens {
            let tok = match next.take() {
                Some(t) => t,
                None => sampler.sample(&mut logits, &history),
            };
            st.generated += 1;
            if stop.contains(&tok) {
                st.stopped_by_eos = true;
                break;
            }
            history.push(tok);
            // The last token is not fed back: a following `feed` recomputes it if needed.
            if !on_token(tok)? || st.generated == max_tokens || self.tokens.len() >= self.capacity() {
                break;
            }
            if greedy {
                next = Some(self.step_greedy(tok)?);
            } else if top_k {
                let cand = self.step_top_k(tok, sampler.cfg.top_k, 1.0 / sampler.cfg.temperature)?;
                next = Some(sampler.sample_candidates(&cand));
            } else {
                logits = self.step(tok)?;
            }
        }
        st.decode_secs = t1.elapsed().as_secs_f64();
        Ok(st)
    }
}

/// How a decode step ends (each is its own captured graph).
#[derive(Clone, Copy, PartialEq, Eq)]
enum StepEnd {
    /// f32 logits left on the device for `read_rows`.
    Logits = 0,
    /// The argmax token id.
    Argmax = 1,
    /// The k best (index, value) pairs.
    TopK = 2,
    /// The argmax, fed to the next step on the device (`Backend::step_fed`).
    Fed = 3,
}

impl<B: Backend> Drop for Session<'_, B> {
    /// The parts go to the model's pool (captured steps kept), or, with the pool full, the
    /// captured steps are dropped with them.
    fn drop(&mut self) {
        let Some(kv) = self.kv.take() else { return };
        let parts = SessionParts {
            kv,
            logits: self.logits.take(),
            argmax: self.argmax.take(),
            top_k: self.top_k.take(),
            id: self.id,
        };
        let mut pool = self.model.session_pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < session_pool_max() {
            pool.push(parts);
            return;
        }
        drop(pool);
        for end in [StepEnd::Logits, StepEnd::Argmax, StepEnd::TopK] {
            self.model.backend.forget(self.key(end, 1));
        }
        // Fed runs of one step (a generation's tail) and of every run length used.
        for steps in 1..=crate::backend::FEED_STEPS_MAX {
            self.model.backend.forget(self.key(StepEnd::Fed, steps));
        }
    }
}

/// Teacher-forced evaluation of `tokens` in chunks of `ctx`: each chunk starts from an
/// empty cache; within a chunk position i predicts token i+1 from all earlier tokens of
/// the chunk.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Perplexity {
    pub tokens: usize,
    pub ppl: f64,
    pub targets: Vec<u32>,
    pub nll: Vec<f32>,
    pub argmax: Vec<u32>,
}

/// Teacher-forced NLL of `tokens` in chunks of `ctx`, each from an empty cache; a progress
/// bar over the tokens on stderr when `progress` (a terminal).
pub fn perplexity<B: Backend>(
    model: &Decoder<B>,
    tokens: &[u32],
    ctx: usize,
    kv_scheme: &crate::kv::scheme::KvScheme,
    progress: bool,
) -> Result<Perplexity> {
    if ctx < 2 {
        return Err(Error::Invalid(format!("--ctx {ctx}: need at least 2 tokens per chunk")));
    }
    if tokens.len() < 2 {
        return Err(Error::Invalid(format!("{} tokens: perplexity needs at least 2", tokens.len())));
    }
    let ctx = ctx.min(model.cfg.max_ctx);
    let vocab = model.logits_width();
    let mut out = Perplexity { tokens: tokens.len(), ..Default::default() };
    let mut kv = crate::kv::seq::SeqCache::with_layout(&model.backend, &model.cfg, ctx, kv_scheme, model.kv_start)?;
    let bar = crate::progress::count_bar(progress, tokens.len() as u64, "tokens");
    for chunk in tokens.chunks(ctx) {
        bar.inc(chunk.len() as u64);
        if chunk.len() < 2 {
            break;
        }
        // Each chunk from an empty cache: a sliding layer has given back its blocks before
        // the window, which a forward from position 0 would otherwise find gone.
        kv.clear();
        let logits = model.forward(chunk, 0, &mut kv, Logits::All)?;
        for (i, row) in logits.chunks_exact(vocab).take(chunk.len() - 1).enumerate() {
            let target = chunk[i + 1];
            let lse = crate::sample::log_sum_exp(row, 1.0);
            out.nll.push((lse - row[target as usize] as f64) as f32);
            out.targets.push(target);
            out.argmax.push(crate::sample::argmax(row));
        }
    }
    bar.finish_and_clear();
    let mean = out.nll.iter().map(|&v| v as f64).sum::<f64>() / out.nll.len() as f64;
    out.ppl = mean.exp();
    Ok(out)
}
