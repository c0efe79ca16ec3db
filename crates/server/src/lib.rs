//! ferrolm's OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions (JSON or
//! server-sent events), /v1/models, /health and /metrics, over the serving engine
//! (`ferrolm::serving::Engine`), which owns the model on its own thread and runs every
//! request in one continuous batch.
//!
//! `start` binds and serves in the background of the current tokio runtime;
//! `Server::shutdown_handle` stops it gracefully (no new connections; requests in flight
//! finish within the grace period, then the engine stops).

mod error;
mod generation;
mod holdback;
mod metrics;
mod params;
mod prompt;
mod routes;
mod shapes;

pub use error::ApiError;

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ferrolm::serving::Engine;
use ferrolm::tokenizer::Tokenizer;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Clone, Debug)]
pub struct Config {
    pub addr: SocketAddr,
    /// The id /v1/models lists and responses name.
    pub model_name: String,
    /// When set, every /v1 route wants `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// How long requests in flight may run on after a shutdown begins.
    pub shutdown_grace: Duration,
    /// Largest request body, in bytes (413 beyond).
    pub body_limit: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            model_name: "ferrolm".into(),
            api_key: None,
            shutdown_grace: Duration::from_secs(30),
            body_limit: 8 << 20,
        }
    }
}

/// What every handler shares.
struct App {
    engine: Arc<Engine>,
    tok: Tokenizer,
    model: String,
    api_key: Option<String>,
    metrics: metrics::Metrics,
    /// When the server started (unix seconds): /v1/models' `created`.
    created: u64,
    template: prompt::Template,
    /// See `generation::token_text`.
    primer: Option<u32>,
    /// A shutdown has begun: /health says so, engine failures are 503s.
    closing: AtomicBool,
    body_limit: usize,
}

/// A running server. It stops when a `Shutdown` handle triggers, or when it and every
/// handle are dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Shutdown,
    task: tokio::task::JoinHandle<()>,
}

/// Begins a graceful shutdown; clone it into a signal handler.
#[derive(Clone)]
pub struct Shutdown(Arc<watch::Sender<bool>>);

impl Shutdown {
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

impl Server {
    /// The address it listens on (the port the OS chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shutdown_handle(&self) -> Shutdown {
        self.stop.clone()
    }

    /// Wait until a shutdown has finished: connections closed, engine stopped.
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Bind `cfg.addr` and serve `engine` in a task of the current tokio runtime.
pub async fn start(engine: Engine, tok: Tokenizer, cfg: Config) -> std::io::Result<Server> {
    let listener = tokio::net::TcpListener::bind(cfg.addr).await?;
    let addr = listener.local_addr()?;
    // Once, at start (a template that hangs is stopped by its own time limit).
    let template = prompt::Template::probe(&tok);
    let app = Arc::new(App {
        engine: Arc::new(engine),
        primer: generation::primer(&tok),
        tok,
        model: cfg.model_name,
        api_key: cfg.api_key.filter(|k| !k.is_empty()),
        metrics: metrics::Metrics::default(),
        created: routes::unix_now(),
        template,
        closing: AtomicBool::new(false),
        body_limit: cfg.body_limit,
    });
    let (tx, rx) = watch::channel(false);
    let router = router(app.clone());
    let task = tokio::spawn(serve(listener, router, app, rx, cfg.shutdown_grace));
    tracing::info!("listening on http://{addr}");
    Ok(Server { addr, stop: Shutdown(Arc::new(tx)), task })
}

/// Serve until told to stop, then: no new connections, the engine stops (requests in
/// flight get `grace` to finish), and connections still open past the grace (and a few
/// seconds to send their last bytes) are dropped.
async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    app: Arc<App>,
    stop: watch::Receiver<bool>,
    grace: Duration,
) {
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        // A dropped handle counts as a stop.
        let _ = rx.wait_for(|&s| s).await;
    };
    let server = axum::serve(listener, router).with_graceful_shutdown(stopped(stop.clone()));
    let mut serving = tokio::spawn(async move { server.await });
    tokio::select! {
        _ = &mut serving => return,
        _ = stopped(stop) => {}
    }
    tracing::info!("shutting down: requests in flight have {} s to finish", grace.as_secs_f64());
    app.closing.store(true, Relaxed);
    let engine = app.engine.clone();
    let engine_stopped = tokio::task::spawn_blocking(move || engine.shutdown(grace));
    if tokio::time::timeout(grace + Duration::from_secs(5), &mut serving).await.is_err() {
        tracing::warn!("connections still open after the grace period: closing them");
        serving.abort();
    }
    let _ = engine_stopped.await;
    tracing::info!("stopped");
}

fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(app.body_limit))
        .layer(middleware::from_fn_with_state(app.clone(), refuse_large_bodies))
        .layer(middleware::from_fn_with_state(app.clone(), count))
        .with_state(app)
}

/// Counts every response by status; logs the refused ones (a generation logs its own line).
async fn count(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let r = next.run(req).await;
    app.metrics.response(r.status().as_u16());
    if r.status().is_client_error() || r.status().is_server_error() {
        tracing::info!(%method, path = %ferrolm::files::printable(&path), status = r.status().as_u16());
    }
    r
}

/// 413 at once for a body announced larger than the limit; one sent without a length is
/// cut at the limit as it is read (`DefaultBodyLimit`).
async fn refuse_large_bodies(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let announced = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = announced.filter(|&n| n > app.body_limit as u64) {
        let msg = format!("the request body has {n} bytes, more than the limit of {}", app.body_limit);
        return ApiError::body(StatusCode::PAYLOAD_TOO_LARGE, msg).into_response();
    }
    next.run(req).await
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
        match given {
            None => {
                return ApiError::unauthorized("no API key given: send Authorization: Bearer <key>").into_response()
            }
            Some(k) if !same_secret(k.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key").into_response()
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// Equal, in a time that depends on the lengths only (not on where the bytes differ).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| std::hint::black_box(acc | (x ^ y)));
    diff == 0
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.closing.load(Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, json_body(&json!({"status": "shutting down"}))).into_response();
    }
    json_body(&json!({"status": "ok"})).into_response()
}

fn json_body(v: &serde_json::Value) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string())
}

fn model_json(app: &App) -> serde_json::Value {
    let info = app.engine.info();
    json!({
        "id": app.model, "object": "model", "created": app.created, "owned_by": "ferrolm",
        "max_model_len": info.max_context, "backend": info.backend,
    })
}

async fn models(State(app): State<Arc<App>>) -> Response {
    json_body(&json!({"object": "list", "data": [model_json(&app)]})).into_response()
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id != app.model {
        return ApiError::not_found(format!("no model {}", error::quote(&id))).into_response();
    }
    json_body(&model_json(&app)).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.metrics.render(&app.engine.stats());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route {}", error::quote(req.uri().path())))
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

#[cfg(test)]
mod tests {
    #[test]
    fn secrets_compare_whole() {
        assert!(super::same_secret(b"sk-abc", b"sk-abc"));
        assert!(!super::same_secret(b"sk-abc", b"sk-abd"));
        assert!(!super::same_secret(b"sk-abc", b"sk-ab"));
    }
}
