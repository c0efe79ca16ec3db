//! Fed runs: a lone plain-greedy request past its prompt decodes in runs of one-row
//! generated calls that feed each call's argmax to the next on the device
//! (`Decoder::queue_generated_fed`), the next run queued before the host reads the tokens
//! of the one before it, so the device never waits on the host between tokens: one
//! stream through the server runs as `ferrolm bench` decodes. Each call is the generated
//! call the request would get in any step (the same bits, batch invariance holds); a run
//! queued past a token that ends the request is dropped unread, its cache positions past
//! the request's committed ones.

use super::worker::{End, Worker};
use super::{Failure, FailureKind};
use crate::backend::Backend;
use crate::kv::Span;
use crate::model::RowOut;
use std::sync::atomic::Ordering::Relaxed;

/// A fed run queued on the device and not read yet: its request, first position, calls
/// and read slot.
pub(super) struct FedRun {
    id: u64,
    pos: usize,
    n: usize,
    slot: usize,
}

/// What a round computed: the forward work's nanoseconds and the engine steps it ran.
pub(super) struct StepCost {
    pub(super) nanos: u64,
    pub(super) steps: usize,
}

impl<B: Backend> Worker<'_, B> {
    /// A round of fed runs: queue the next run (the first one's input is the request's
    /// last token, a later one's the run before it), then read and hand out the tokens of
    /// the run before it. A run left queued when its request no longer runs alone (another
    /// joined) is read without a next one. None: this round is a planned step's.
    pub(super) fn fed_round(&mut self) -> Option<StepCost> {
        let lone = self.fed_candidate();
        // A run of a request that left (cancelled, expired) is dropped unread.
        let prev = self.fed.take().filter(|r| self.running.iter().any(|s| s.job.id == r.id));
        if prev.is_none() && lone.is_none() {
            return None;
        }
        let t = std::time::Instant::now();
        let cost = |steps| Some(StepCost { nanos: t.elapsed().as_nanos() as u64, steps });
        let cur = match prev {
            Some(r) => r,
            None => {
                let i = lone?;
                match self.queue_run(i, None) {
                    Ok(Some(r)) => r,
                    Ok(None) => return None,
                    Err(e) => {
                        self.fail_running(i, &e);
                        return cost(0);
                    }
                }
            }
        };
        // The next run goes in behind this one before this one is read.
        if let Some(i) = lone {
            match self.queue_run(i, Some(&cur)) {
                Ok(next) => self.fed = next,
                Err(e) => {
                    self.fail_running(i, &e);
                    return cost(0);
                }
            }
        }
        let steps = self.take_run(cur);
        cost(steps)
    }

    /// Running request i fails on a device error (and so does its fed run, if any).
    pub(super) fn fail_running(&mut self, i: usize, e: &crate::Error) {
        self.fed = None;
        let s = self.running.remove(i);
        self.end(s, End::Failed(Failure::new(FailureKind::Internal, e.to_string())));
    }

    /// The running request a fed run may serve: the only one, past its prompt with its next
    /// token to compute, greedy without logits, where generated rows go apart and the
    /// backend feeds steps.
    fn fed_candidate(&self) -> Option<usize> {
        let qualifies = self.fed_steps > 0 && self.rows_apart && self.model.backend.feeds_steps();
        if !qualifies || self.running.len() != 1 || !self.preempted.is_empty() {
            return None;
        }
        let s = &self.running[0];
        (s.past_prompt() && s.pending() == 1 && !s.wants_logits()).then_some(0)
    }

    /// Queue request i's next run: after `prev` (fed by its last call) or at the request's
    /// next position (its last token the input), as many calls as it may still generate
    /// (at most `fed_steps`), its blocks reserved. None: nothing to queue (no tokens left,
    /// or no blocks: a planned step then preempts).
    fn queue_run(&mut self, i: usize, prev: Option<&FedRun>) -> crate::Result<Option<FedRun>> {
        let s = &mut self.running[i];
        let (pos, produced) = match prev {
            Some(r) => (r.pos + r.n, s.generated + r.n),
            None => (s.written(), s.generated),
        };
        let n = self.fed_steps.min(s.max_tokens.saturating_sub(produced));
        let place = s.place.as_mut().expect("running requests hold a place");
        if n == 0 || self.caches.reserve(place, pos + n).is_err() {
            return Ok(None);
        }
        let token = match prev {
            Some(_) => None,
            None => Some(s.history[pos]),
        };
        let slot = prev.map_or(0, |r| 1 - r.slot);
        let span = Span { rows: n, pos0: pos, full: &place.full, sliding: &place.sliding };
        self.model.queue_generated_fed(token, span, &mut self.caches.store, slot)?;
        Ok(Some(FedRun { id: s.job.id, pos, n, slot }))
    }

    /// Read a run's tokens and hand them out in order, each committing the position it was
    /// computed from; the run's calls past a token that ends the request are dropped (and
    /// so is whatever run was queued after it). The steps read.
    fn take_run(&mut self, run: FedRun) -> usize {
        let tokens = self.model.backend.take_read(run.slot);
        let Some(i) = self.running.iter().position(|s| s.job.id == run.id) else { return 0 };
        let tokens = match tokens {
            Ok(t) => t,
            Err(e) => {
                self.fail_running(i, &e);
                return 0;
            }
        };
        for (j, &id) in tokens.iter().enumerate() {
            self.shared.fed_tokens.fetch_add(1, Relaxed);
            let s = &mut self.running[i];
            let place = s.place.as_mut().expect("running requests hold a place");
            self.caches.commit(place, &s.history, run.pos + j + 1);
            if let Some(end) = self.sample(i, RowOut::Token(id)) {
                self.fed = None;
                let s = self.running.remove(i);
                self.end(s, end);
                return j + 1;
            }
        }
        tokens.len()
    }
}
