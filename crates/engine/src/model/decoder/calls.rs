//! The serving engine's forward calls: several sequences' rows in one call (continuous
//! batching), each sequence's last row through the head. A row's logits do not depend on
//! the call's other rows (the backends compute rows independently), so a backend may pad a
//! call to a size it captured (`Backend::call_rows`) and replay it (`forward_call`); the
//! buffers such a call uses are kept here per padded size. A call of generated rows
//! (`forward_generated_out`: one row a sequence, each past its prompt) runs them through
//! the backend's decode step (`Backend::begin_generated`, `decode_layers`).

use super::{Decoder, Work};
use crate::backend::Backend;
use crate::kv::Span;
use crate::Result;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Keys of fed runs of generated calls (`queue_generated_fed`): apart from sessions'
/// (`Session::key`) and from engine calls' (the CUDA backend's own tag, bit 63).
const FED_KEY: u64 = 1 << 62;

/// What a serving call gives a sequence: its last row's logits, or only their argmax (a
/// greedy request without log-probabilities or penalties needs nothing else, and the
/// device finds it: one value read back instead of the vocabulary's).
#[derive(Clone, Debug, PartialEq)]
pub enum RowOut {
    Token(u32),
    Logits(Vec<f32>),
}

/// One padded call size's buffers: the layers' (for `rows` rows) and the head's (for
/// `heads` rows): the gathered residual rows, their norm, the logits and their argmax.
pub(crate) struct CallWork<B: Backend> {
    /// Names these buffers in a captured call's key.
    id: u64,
    rows: usize,
    heads: usize,
    /// A generated call's (its work has the decode step's spare residual).
    generated: bool,
    work: Work<B>,
    tail: B::Act,   // [heads, d] f32
    normed: B::Act, // [heads, d]
    logits: B::Act, // [heads, V] f32
    argmax: B::Act, // [heads, 1] f32
}

impl<B: Backend> CallWork<B> {
    fn new(model: &Decoder<B>, (rows, heads): (usize, usize), generated: bool) -> Result<Self> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let (b, d) = (&model.backend, model.cfg.hidden);
        Ok(CallWork {
            id: NEXT_ID.fetch_add(1, Relaxed),
            rows,
            heads,
            generated,
            work: Work::new(b, &model.cfg, rows, generated)?,
            tail: b.act_f32(heads, d)?,
            normed: b.act(heads, d)?,
            logits: b.act_f32_as(heads, model.logits_width, crate::backend::Width::Vocab)?,
            argmax: b.act_f32(heads, 1)?,
        })
    }
}

impl<B: Backend> Decoder<B> {
    /// One forward call over several sequences (continuous batching): `tokens` holds each
    /// span's rows in turn, their K/V going into `store` through the spans' tables. Returns
    /// the logits of each span's last row, `[spans, V]`.
    pub fn forward_spans(&self, tokens: &[u32], spans: &[Span<'_>], store: &mut B::Kv) -> Result<Vec<f32>> {
        let mut logits = Vec::with_capacity(spans.len() * self.logits_width);
        for out in self.forward_spans_out(tokens, spans, store, &vec![true; spans.len()])? {
            match out {
                RowOut::Logits(l) => logits.extend(l),
                RowOut::Token(_) => return Err(crate::Error::Invalid("forward_spans: a row without logits".into())),
            }
        }
        Ok(logits)
    }

    /// `forward_spans` where span i's last row comes back as its logits where `logits[i]`,
    /// else as their argmax (ties to the lowest index, as `sample::argmax`).
    pub fn forward_spans_out(
        &self,
        tokens: &[u32],
        spans: &[Span<'_>],
        store: &mut B::Kv,
        logits: &[bool],
    ) -> Result<Vec<RowOut>> {
        self.call_out(tokens, spans, store, logits, false)
    }

    /// `forward_spans_out` over generated rows: one row a span, each a sequence's row past
    /// its prompt, computed as the backend's decode step computes one token (the same bits
    /// in any call; `Backend::generated_rows_apart`).
    pub fn forward_generated_out(
        &self,
        tokens: &[u32],
        spans: &[Span<'_>],
        store: &mut B::Kv,
        logits: &[bool],
    ) -> Result<Vec<RowOut>> {
        if spans.iter().any(|s| s.rows != 1) {
            return Err(crate::Error::Invalid("a generated call of spans other than one row".into()));
        }
        self.call_out(tokens, spans, store, logits, true)
    }

    fn call_out(
        &self,
        tokens: &[u32],
        spans: &[Span<'_>],
        store: &mut B::Kv,
        logits: &[bool],
        generated: bool,
    ) -> Result<Vec<RowOut>> {
        let b = &self.backend;
        if logits.len() != spans.len() {
            return Err(crate::Error::Invalid(format!("{} spans, {} outputs asked", spans.len(), logits.len())));
        }
        self.check_call(tokens, spans, b.kv_blocks(store))?;
        let (m, n) = (tokens.len(), spans.len());
        // A captured size's buffers are kept (its graph points at them); a call the backend
        // runs as it comes gets its own.
        let captured = b.call_rows(m).zip(b.call_rows(n));
        let (rows, heads) = captured.unwrap_or((m, n));
        let padded: Vec<u32>;
        let tokens = match rows > m {
            true => {
                padded = tokens.iter().copied().chain(std::iter::repeat(0)).take(rows).collect();
                &padded[..]
            }
            false => tokens,
        };
        let mut w = match captured {
            Some(_) => self.take_call_work((rows, heads), generated)?,
            None => CallWork::new(self, (rows, heads), generated)?,
        };
        let key = (w.id, b.store_id(store));
        let r = b.forward_call(key, tokens, spans, &mut || self.call_body((tokens, spans), store, &mut w, false));
        let read = |w: &CallWork<B>| -> Result<(Vec<f32>, Vec<f32>)> {
            let ids = b.read_rows(&w.argmax, 0)?;
            let rows = match logits.contains(&true) {
                true => b.read_rows(&w.logits, 0)?,
                false => vec![],
            };
            Ok((ids, rows))
        };
        let out = r.and_then(|()| read(&w));
        if captured.is_some() {
            self.call_work.lock().unwrap_or_else(|e| e.into_inner()).push(w);
        }
        let (ids, rows) = out?;
        let v = self.logits_width;
        Ok((0..n)
            .map(|i| match logits[i] {
                true => RowOut::Logits(rows[i * v..(i + 1) * v].to_vec()),
                false => RowOut::Token(ids[i] as u32),
            })
            .collect())
    }

    /// What `forward_spans` launches: begin the call (invariant, or generated), the layers,
    /// then each span's last row through the final norm and the head, and the logits'
    /// argmax (with `feed`, a one-row generated call's, made the next fed step's input).
    fn call_body(
        &self,
        (tokens, spans): (&[u32], &[Span<'_>]),
        kv: &mut B::Kv,
        w: &mut CallWork<B>,
        feed: bool,
    ) -> Result<()> {
        let b = &self.backend;
        match w.generated {
            true => b.begin_generated(tokens, spans)?,
            false => b.begin(tokens, spans, true)?,
        }
        self.run_layers((tokens, spans), kv, self.layers.len(), &mut w.work, w.generated)?;
        b.gather_last_rows(&w.work.x, spans, &mut w.tail)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if w.generated && w.heads == 1 {
            // One generated row: the decode step's head, which may find the argmax as it
            // stores the logits (CUDA: the same logits and token as the two launches below).
            let (normed, logits, argmax) = (&mut w.normed, &mut w.logits, &mut w.argmax);
            return b.norm_head_argmax(&w.tail, (&self.norm, self.cfg.rms_eps), normed, head, logits, argmax, feed);
        }
        if feed {
            return Err(crate::Error::Invalid("a fed call of several rows".into()));
        }
        b.norm_matmul_many(&w.tail, &self.norm, self.cfg.rms_eps, &mut w.normed, &[head], &mut [&mut w.logits])?;
        b.argmax_rows(&w.logits, &mut w.argmax)
    }

    /// Queue `span.rows` one-row generated calls of one sequence at positions `span.pos0..`,
    /// fed on the device (`Backend::step_fed`): the first one's input is `token`, or (None)
    /// the argmax of the fed call queued last, each later one's the argmax of the call
    /// before it. Each call is `forward_generated_out`'s for that row (the same bits); their
    /// argmaxes are read back through `Backend::take_read(slot)`. The span's tables hold
    /// the blocks of every call queued.
    pub fn queue_generated_fed(
        &self,
        token: Option<u32>,
        span: Span<'_>,
        store: &mut B::Kv,
        slot: usize,
    ) -> Result<()> {
        let (b, n) = (&self.backend, span.rows);
        if n == 0 || n > crate::backend::FEED_STEPS_MAX {
            return Err(crate::Error::Invalid(format!("a fed run of {n} calls")));
        }
        self.check_vocab(token.as_slice())?;
        self.check_spans(n, &[span], b.kv_blocks(store))?;
        let mut w = self.take_call_work((1, 1), true)?;
        // A captured run bakes in these buffers, the store's and its length.
        let key = FED_KEY | (b.store_id(store) & 0xffff) << 36 | (w.id & 0xff_ffff) << 8 | n as u64;
        let token_in = [token.unwrap_or(0)];
        let r = b.step_fed(key, token, &[span], true, &mut || {
            (0..n).try_for_each(|i| {
                let row = Span { rows: 1, pos0: span.pos0 + i, ..span };
                self.call_body((&token_in, &[row]), store, &mut w, true)
            })
        });
        let r = r.and_then(|()| b.queue_read(&w.argmax, span.pos0, n, slot));
        self.call_work.lock().unwrap_or_else(|e| e.into_inner()).push(w);
        r
    }

    /// Kept buffers of this size and kind, or new ones.
    fn take_call_work(&self, (rows, heads): (usize, usize), generated: bool) -> Result<CallWork<B>> {
        let mut pool = self.call_work.lock().unwrap_or_else(|e| e.into_inner());
        match pool.iter().position(|w| (w.rows, w.heads, w.generated) == (rows, heads, generated)) {
            Some(i) => Ok(pool.swap_remove(i)),
            None => CallWork::new(self, (rows, heads), generated),
        }
    }
}
