//! One request's generation as the HTTP side sees it: the engine's events, arriving
//! through an unbounded channel from the engine thread, turned into text (UTF-8 whole,
//! stop strings cut), log-probability entries, a finish reason and the usage. Dropping a
//! `Generation` before it ends cancels the request in the engine, so a client that goes
//! away frees its place in the batch and its KV cache.

use crate::error::ApiError;
use crate::holdback::{Holdback, TokenInfo};
use crate::metrics::Outcome;
use crate::App;
use ferrolm::sample::TokenLogprobs;
use ferrolm::serving::{Event, Failure, FailureKind, Finish, Request, Sink, SubmitError, Usage};
use ferrolm::tokenizer::{StreamDecoder, Tokenizer};
use std::time::Instant;
use tokio::sync::mpsc;

/// A request the engine accepted.
pub struct Submitted {
    id: u64,
    events: mpsc::UnboundedReceiver<Event>,
    arrived: Instant,
}

/// Hand `req` to the engine; its events come back through the returned receiver.
pub fn submit(app: &App, req: Request, arrived: Instant) -> Result<Submitted, ApiError> {
    let (tx, events) = mpsc::unbounded_channel();
    // Runs on the engine thread: never blocks; false (the receiver is gone) cancels.
    let sink: Sink = Box::new(move |ev| tx.send(ev).is_ok());
    match app.engine.submit(req, sink) {
        Ok(id) => Ok(Submitted { id, events, arrived }),
        Err(e) => {
            app.metrics.outcome(match e {
                SubmitError::Busy { .. } => Outcome::Busy,
                SubmitError::Invalid(_) => Outcome::Invalid,
                SubmitError::Closed => Outcome::Unavailable,
            });
            Err(e.into())
        }
    }
}

/// What a step of the generation adds.
pub struct Step {
    pub text: String,
    /// Entries of the tokens whose text this step completes (when logprobs were asked).
    pub tokens: Vec<TokenInfo>,
    pub end: Option<End>,
}

pub enum End {
    Done { reason: &'static str, usage: Usage },
    Failed(Failure),
}

pub struct Generation<'a> {
    app: &'a App,
    id: u64,
    events: mpsc::UnboundedReceiver<Event>,
    dec: StreamDecoder<'a>,
    hold: Holdback,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    ended: bool,
}

impl<'a> Generation<'a> {
    pub fn new(app: &'a App, s: Submitted, stops: Vec<String>) -> Self {
        Generation {
            app,
            id: s.id,
            events: s.events,
            dec: StreamDecoder::new(&app.tok),
            hold: Holdback::new(stops),
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            arrived: s.arrived,
            last_token: None,
            ended: false,
        }
    }

    /// The next piece of output; a step with `end` is the last, None after it.
    pub async fn next(&mut self) -> Option<Step> {
        while !self.ended {
            let step = match self.events.recv().await {
                None => self.failed(internal("the engine stopped before the request finished")),
                Some(Event::Started { prompt_tokens, cached_tokens }) => {
                    (self.prompt_tokens, self.cached_tokens) = (prompt_tokens, cached_tokens);
                    None
                }
                Some(Event::Token { id, logprobs }) => self.token(id, logprobs),
                Some(Event::Finished { reason, usage }) => self.finished(reason, usage),
                Some(Event::Failed(f)) => self.failed(f),
            };
            if step.is_some() {
                return step;
            }
        }
        None
    }

    fn token(&mut self, id: u32, logprobs: Option<TokenLogprobs>) -> Option<Step> {
        let now = Instant::now();
        match self.last_token.replace(now) {
            None => self.app.metrics.time_to_first_token(now - self.arrived),
            Some(t) => self.app.metrics.inter_token(now - t),
        }
        self.completion_tokens += 1;
        let piece = match self.dec.push(id) {
            Ok(p) => p,
            Err(e) => return self.failed(internal(e.to_string())),
        };
        let info = logprobs.map(|lp| token_info(&self.app.tok, self.app.primer, id, &lp));
        let r = self.hold.push(&piece, info);
        if r.stopped {
            // A stop string: the engine need not generate the rest.
            self.app.engine.cancel(self.id);
            let usage = Usage {
                prompt_tokens: self.prompt_tokens,
                cached_tokens: self.cached_tokens,
                completion_tokens: self.completion_tokens,
            };
            return Some(self.end(r.text, r.tokens, Outcome::Stop, End::Done { reason: "stop", usage }));
        }
        (!r.text.is_empty() || !r.tokens.is_empty()).then_some(Step { text: r.text, tokens: r.tokens, end: None })
    }

    fn finished(&mut self, reason: Finish, usage: Usage) -> Option<Step> {
        let tail = match self.dec.finish() {
            Ok(t) => t,
            Err(e) => return self.failed(internal(e.to_string())),
        };
        let mut r = self.hold.push(&tail, None);
        if !r.stopped {
            let rest = self.hold.finish();
            r.text += &rest.text;
            r.tokens.extend(rest.tokens);
        }
        let (outcome, reason) = match (r.stopped, reason) {
            (true, _) | (_, Finish::Stop) => (Outcome::Stop, "stop"),
            (false, Finish::Length) => (Outcome::Length, "length"),
        };
        Some(self.end(r.text, r.tokens, outcome, End::Done { reason, usage }))
    }

    fn failed(&mut self, f: Failure) -> Option<Step> {
        Some(self.end(String::new(), vec![], Outcome::Failed, End::Failed(f)))
    }

    fn end(&mut self, text: String, tokens: Vec<TokenInfo>, outcome: Outcome, end: End) -> Step {
        self.ended = true;
        self.app.metrics.outcome(outcome);
        Step { text, tokens, end: Some(end) }
    }

    /// The engine's id of the request (for the log line).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Time since the request arrived.
    pub fn elapsed(&self) -> std::time::Duration {
        self.arrived.elapsed()
    }
}

impl Drop for Generation<'_> {
    /// The client is gone (its connection closed, the handler dropped): stop the request.
    fn drop(&mut self) {
        if !self.ended {
            self.app.engine.cancel(self.id);
            self.app.metrics.outcome(Outcome::Cancelled);
        }
    }
}

fn internal(message: impl Into<String>) -> Failure {
    Failure::new(FailureKind::Internal, message)
}

fn token_info(tok: &Tokenizer, primer: Option<u32>, id: u32, lp: &TokenLogprobs) -> TokenInfo {
    TokenInfo {
        text: token_text(tok, primer, id),
        logprob: lp.logprob,
        top: lp.top.iter().map(|&(t, p)| (token_text(tok, primer, t), p)).collect(),
        offset: 0,
    }
}

/// A token's text on its own, as `logprobs` shows it: what the token adds after other text
/// (decoded after `primer`, a plain one-character token, so that a SentencePiece token
/// keeps the leading space a decoder drops at the start of a text). Bytes of an unfinished
/// character show as U+FFFD, as vLLM shows them; a special token shows its name.
pub fn token_text(tok: &Tokenizer, primer: Option<u32>, id: u32) -> String {
    let mut d = StreamDecoder::new(tok);
    if let Some(p) = primer {
        let _ = d.push(p);
    }
    let text = d.push(id).unwrap_or_default() + &d.finish().unwrap_or_default();
    if text.is_empty() {
        return tok.hf().id_to_token(id).unwrap_or_default();
    }
    text
}

/// A token that decodes to one ASCII letter whatever precedes it (see `token_text`).
pub fn primer(tok: &Tokenizer) -> Option<u32> {
    match tok.encode("a", false).ok()?.as_slice() {
        &[id] => Some(id),
        _ => None,
    }
}
