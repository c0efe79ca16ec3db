//! POST /v1/chat/completions and /v1/completions: read the body, build the prompt, hand the
//! request to the engine, then answer with one JSON body or a server-sent event stream.

use crate::error::ApiError;
use crate::generation::{self, End, Generation, Submitted};
use crate::params::{self, Common};
use crate::shapes::{Api, Meta};
use crate::{prompt, App};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use ferrolm::serving::{Failure, FailureKind, Request};
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Completions' default max_tokens when the request gives none (OpenAI's); chat has none.
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;
/// Stream chunks buffered for a slow reader before the stream waits for it.
const STREAM_BUFFER: usize = 64;

pub async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(app, Api::Chat, body).await
}

pub async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(app, Api::Completion, body).await
}

/// A request ready for the engine.
struct Prepared {
    prompt: Vec<u32>,
    max_tokens: usize,
    common: Common,
}

async fn complete(app: Arc<App>, api: Api, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    let prepared = match prepare(&app, api, body).await {
        Ok(p) => p,
        Err(e) => {
            app.metrics.outcome(crate::metrics::Outcome::Invalid);
            return e.into_response();
        }
    };
    let req = Request {
        prompt: prepared.prompt,
        max_tokens: Some(prepared.max_tokens),
        sampler: prepared.common.sampler.clone(),
        logprobs: prepared.common.logprobs,
        stop_tokens: if prepared.common.ignore_eos { vec![] } else { app.tok.stop_ids().to_vec() },
    };
    let submitted = match generation::submit(&app, req, arrived) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let meta = Meta {
        id: format!("{}{:016x}{:08x}", api.id_prefix(), rand::random::<u64>(), rand::random::<u32>()),
        created: unix_now(),
        model: app.model.clone(),
    };
    if prepared.common.stream {
        return stream(app, api, submitted, prepared.common, meta);
    }
    match whole(&app, api, submitted, &prepared.common, &meta).await {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Parse the body and build the prompt, on a blocking thread: a chat template may take
/// up to its time limit and a long prompt's tokenization real time.
async fn prepare(app: &Arc<App>, api: Api, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let body = body.map_err(|r| ApiError::body(r.status(), r.body_text()))?;
    let a = app.clone();
    let (prompt, common, param) = tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
        let obj = params::parse_object(&body)?;
        match api {
            Api::Chat => {
                let p = params::chat(&obj)?;
                Ok((prompt::chat(&a.tok, a.template, &p.messages)?, p.common, "messages"))
            }
            Api::Completion => {
                let p = params::completion(&obj)?;
                Ok((prompt::completion(&a.tok, &p.prompt)?, p.common, "prompt"))
            }
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the prompt: {e}")))??;
    let default = (api == Api::Completion).then_some(COMPLETION_DEFAULT_MAX_TOKENS);
    let context = app.engine.info().max_context;
    let max_tokens = prompt::max_tokens(prompt.len(), common.max_tokens, default, context, param)?;
    Ok(Prepared { prompt, max_tokens, common })
}

/// A failure the engine reports, by its kind: a request too large for the KV budget is
/// the client's (400); a timeout 504; a shutdown 503; anything else the server's fault.
fn engine_failure(app: &App, f: Failure) -> ApiError {
    match f.kind {
        FailureKind::TooLarge => ApiError::invalid("max_tokens", f.message),
        FailureKind::Timeout => ApiError::timeout(f.message),
        FailureKind::Shutdown => ApiError::unavailable(f.message),
        FailureKind::Internal if app.closing.load(Relaxed) => ApiError::unavailable(f.message),
        FailureKind::Internal => ApiError::internal(f.message),
    }
}

/// The answer as one JSON body, once the generation has ended.
async fn whole(app: &App, api: Api, s: Submitted, common: &Common, meta: &Meta) -> Result<String, ApiError> {
    let mut g = Generation::new(app, s, common.stop.clone());
    let (mut text, mut tokens) = (String::new(), Vec::new());
    while let Some(step) = g.next().await {
        text += &step.text;
        tokens.extend(step.tokens);
        match step.end {
            None => {}
            Some(End::Done { reason, usage }) => {
                log_done(api, meta, &g, &usage, reason);
                let logprobs = common.logprobs.map(|_| tokens.as_slice());
                return Ok(api.response(meta, &text, logprobs, reason, &usage).to_string());
            }
            Some(End::Failed(f)) => {
                let e = engine_failure(app, f);
                tracing::info!(id = %meta.id, route = api.route(), status = e.status.as_u16(), error = %e.message);
                return Err(e);
            }
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

/// The answer as server-sent events: a task turns the engine's events into chunks; the
/// response body reads them. When the client goes away the body is dropped, the task's
/// sends fail, and its `Generation` drops, cancelling the request in the engine.
fn stream(app: Arc<App>, api: Api, s: Submitted, common: Common, meta: Meta) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(STREAM_BUFFER);
    tokio::spawn(async move {
        let mut g = Generation::new(&app, s, common.stop.clone());
        // Nothing to do when the client is gone: dropping `g` cancels the request.
        let _ = stream_events(&app, api, &mut g, &common, &meta, &tx).await;
    });
    let chunks =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx)) });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(chunks))
        .into_response()
}

/// Sends the stream's chunks; Err when the client has gone away.
async fn stream_events(
    app: &App,
    api: Api,
    g: &mut Generation<'_>,
    common: &Common,
    meta: &Meta,
    tx: &mpsc::Sender<Bytes>,
) -> Result<(), ()> {
    let usage = common.include_usage;
    if let Some(c) = api.opening_chunk(meta, usage) {
        send(tx, &c).await?;
    }
    loop {
        let step = tokio::select! {
            s = g.next() => s,
            // Notice a client that left while its request waits or computes.
            _ = tx.closed() => return Err(()),
        };
        let Some(step) = step else { break };
        if !step.text.is_empty() || !step.tokens.is_empty() {
            let logprobs = common.logprobs.map(|_| step.tokens.as_slice());
            send(tx, &api.text_chunk(meta, &step.text, logprobs, usage)).await?;
        }
        match step.end {
            None => {}
            Some(End::Done { reason, usage: u }) => {
                send(tx, &api.finish_chunk(meta, reason, usage)).await?;
                if usage {
                    send(tx, &api.usage_chunk(meta, &u)).await?;
                }
                log_done(api, meta, g, &u, reason);
                break;
            }
            Some(End::Failed(f)) => {
                let e = engine_failure(app, f);
                tracing::info!(id = %meta.id, route = api.route(), status = e.status.as_u16(), error = %e.message, "stream failed");
                send(tx, &e.body_json()).await?;
                break;
            }
        }
    }
    tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.map_err(|_| ())
}

async fn send(tx: &mpsc::Sender<Bytes>, v: &serde_json::Value) -> Result<(), ()> {
    tx.send(Bytes::from(format!("data: {v}\n\n"))).await.map_err(|_| ())
}

/// The request's one log line.
fn log_done(api: Api, meta: &Meta, g: &Generation, u: &ferrolm::serving::Usage, finish: &str) {
    tracing::info!(
        id = %meta.id,
        engine_id = g.id(),
        route = api.route(),
        status = 200,
        prompt_tokens = u.prompt_tokens,
        cached_tokens = u.cached_tokens,
        completion_tokens = u.completion_tokens,
        finish,
        ms = g.elapsed().as_millis() as u64,
    );
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
