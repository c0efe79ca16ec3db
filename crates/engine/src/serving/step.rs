//! One engine step: which rows of which requests it computes, their blocks, the forward
//! call(s), then a token for every request whose pending positions are all computed.

use super::caches::Caches;
use super::fed::StepCost;
use super::worker::{Seq, Worker};
use crate::backend::Backend;
use crate::model::RowOut;
use crate::Result;

impl<B: Backend> Worker<'_, B> {
    /// One step over the running requests; those that end leave. Its forward call's
    /// nanoseconds, or None when nothing was planned.
    pub(super) fn step(&mut self) -> Option<StepCost> {
        let plan = self.plan();
        if plan.is_empty() {
            return None;
        }
        let t = std::time::Instant::now();
        let outs = forward(self.model, &mut self.caches, &self.running, &plan, self.rows_apart);
        let cost = StepCost { nanos: t.elapsed().as_nanos() as u64, steps: 1 };
        let outs = match outs {
            Ok(l) => l,
            Err(e) => {
                // A device error: every request of the step fails, the others go on.
                let mut idx: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                idx.sort_unstable_by_key(|&i| std::cmp::Reverse(i));
                for i in idx {
                    self.fail_running(i, &e);
                }
                return Some(cost);
            }
        };
        let mut ended = vec![];
        for (&(i, rows), row) in plan.iter().zip(outs) {
            let s = &mut self.running[i];
            let place = s.place.as_mut().expect("planned requests hold a place");
            let upto = place.len + rows;
            self.caches.commit(place, &s.history, upto);
            if upto == s.history.len() {
                if let Some(end) = self.sample(i, row) {
                    ended.push((i, end));
                }
            }
        }
        ended.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        for (i, end) in ended {
            let s = self.running.remove(i);
            self.end(s, end);
        }
        Some(cost)
    }

    /// The step's rows: (request, rows) with every decoding request's one row first, then
    /// prefill chunks in admission order while the row budget lasts (one at least), each
    /// with its blocks reserved. When blocks run out the youngest request is preempted.
    /// With generated rows apart (`rows_apart`) a request past its prompt (decoding, or
    /// recomputing its generated tokens after a preemption) takes one generated row a step,
    /// and a prompt chunk stops at the prompt's end.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        let mut plan: Vec<(usize, usize)> = vec![];
        let apart = self.rows_apart;
        let decoding = |s: &Seq| match apart {
            true => s.past_prompt(),
            false => s.pending() == 1 && s.generated > 0,
        };
        for (i, s) in self.running.iter().enumerate() {
            if decoding(s) {
                plan.push((i, 1));
            }
        }
        let mut used = plan.len();
        for (i, s) in self.running.iter().enumerate() {
            if decoding(s) || (used >= self.step_rows && !plan.is_empty()) {
                continue;
            }
            let prompt_left = match apart {
                true => s.prompt_len - s.written(),
                false => usize::MAX,
            };
            let rows = s.pending().min(prompt_left).min(self.step_rows.saturating_sub(used).max(1));
            plan.push((i, rows));
            used += rows;
        }
        let mut k = 0;
        while k < plan.len() {
            let (i, rows) = plan[k];
            let s = &mut self.running[i];
            let place = s.place.as_mut().expect("running requests hold a place");
            let upto = place.len + rows;
            if self.caches.reserve(place, upto).is_ok() {
                k += 1;
                continue;
            }
            // The youngest is the last one running: preempting it shifts no index.
            let victim = self.running.len() - 1;
            if let Some(at) = plan.iter().position(|&(j, _)| j == victim) {
                plan.remove(at);
                if at < k {
                    k -= 1;
                }
            }
            self.preempt_youngest();
        }
        plan.sort_unstable();
        plan
    }
}

/// Run the plan: what each request's last planned row gives, in plan order: its logits
/// where it samples from them, else (a plain greedy request, or a prompt chunk that is not
/// its last) the argmax the device found. One forward call, or with generated rows apart
/// (`apart`) two: the prompt rows', and the generated rows' (`forward_generated_out`).
fn forward<B: Backend>(
    model: &crate::model::Decoder<B>,
    caches: &mut Caches<B>,
    running: &[Seq],
    plan: &[(usize, usize)],
    apart: bool,
) -> Result<Vec<RowOut>> {
    let (gen, prompt): (Vec<usize>, Vec<usize>) =
        (0..plan.len()).partition(|&k| apart && running[plan[k].0].past_prompt());
    let mut outs: Vec<Option<RowOut>> = vec![None; plan.len()];
    for (part, gen_call) in [(prompt, false), (gen, true)] {
        if part.is_empty() {
            continue;
        }
        let mut tokens = Vec::with_capacity(part.iter().map(|&k| plan[k].1).sum());
        let mut spans = Vec::with_capacity(part.len());
        let mut logits = Vec::with_capacity(part.len());
        for &k in &part {
            let (i, rows) = plan[k];
            let s = &running[i];
            let kv = s.place.as_ref().expect("planned requests hold a place");
            tokens.extend_from_slice(&s.history[kv.len..kv.len + rows]);
            spans.push(kv.span(rows));
            logits.push(kv.len + rows == s.history.len() && s.wants_logits());
        }
        let got = match gen_call {
            true => model.forward_generated_out(&tokens, &spans, &mut caches.store, &logits)?,
            false => model.forward_spans_out(&tokens, &spans, &mut caches.store, &logits)?,
        };
        for (k, o) in part.into_iter().zip(got) {
            outs[k] = Some(o);
        }
    }
    Ok(outs.into_iter().map(|o| o.expect("every planned request is in one call")).collect())
}
