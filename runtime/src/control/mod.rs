//! A worker's HTTP control endpoint, per the contract in `weir_api::control`.
//!
//! In pod mode every worker serves it from the start: before its membership
//! arrives (`PUT /v1/membership`) it answers health checks, membership and a
//! status in phase `awaiting-membership`. Worker 0 then answers for the job
//! (its coordinator's status and savepoints); the other workers answer with
//! their own small status and point savepoint callers at worker 0. Under
//! `weir run` only worker 0 serves it, at the membership's `api` address.
//!
//! Every route but `/healthz` needs the job's bearer token: whoever can set a
//! worker's membership decides where it sends its data.

mod client;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use tokio::sync::{mpsc, watch};
use weir_api::control::{ErrorBody, Membership, SavepointDisposal, SavepointDisposed, SavepointRequest};

use crate::checkpoint::savepoints::{Admission, SavepointBook};
use crate::checkpoint::Disposal;
use crate::worker::clean_up::SavepointDisposal as Disposer;
use crate::error::{Error, Result};

pub use client::call;
// One definition of the JSON on the wire, shared with the operator.
pub use weir_api::control::{CheckpointStatus, JobStatus};

pub type SharedStatus = Arc<Mutex<JobStatus>>;

/// What the control endpoint asks of the coordinator.
pub enum ApiRequest {
    /// Take a savepoint for this (newly admitted) request id; with `stop`, the
    /// run's last snapshot (no checkpoint commits output after it).
    Savepoint { request_id: String, stop: bool },
    /// Do not stop the job for this request: a queued or unfinished
    /// savepoint is abandoned; a stopping one that already completed stays
    /// usable and the job goes on taking checkpoints. Answered once done.
    Cancel { request_id: String, done: tokio::sync::oneshot::Sender<()> },
}

/// Who takes savepoints for this process.
enum Savepoints {
    /// No membership yet, or worker 0 before its coordinator runs.
    NotYet,
    Coordinator(mpsc::Sender<ApiRequest>),
    /// Another process: worker 0, at this API address.
    Elsewhere(SocketAddr),
}

/// The shared state of one worker's control endpoint.
#[derive(Clone)]
pub struct Control {
    inner: Arc<Inner>,
}

struct Inner {
    token: String,
    index: u32,
    parallelism: u32,
    membership: watch::Sender<Option<Membership>>,
    /// The run this worker was started for, when its starter says (a pod's `WEIR_RUN_ID`).
    expected_run: OnceLock<String>,
    status: SharedStatus,
    book: SavepointBook,
    savepoints: Mutex<Savepoints>,
    /// Worker 0's disposal of savepoints, once its run is under way.
    disposer: Mutex<Option<Arc<Disposer>>>,
}

/// Why a membership was refused, as an HTTP answer.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: StatusCode,
    pub message: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a plain read or assignment; a panic
    // elsewhere cannot leave the value half-changed.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Control {
    /// `status` is what `/v1/status` answers until the job sets more.
    pub fn new(token: String, index: u32, parallelism: u32, status: JobStatus) -> Control {
        Control {
            inner: Arc::new(Inner {
                token,
                index,
                parallelism,
                membership: watch::channel(None).0,
                expected_run: OnceLock::new(),
                status: Arc::new(Mutex::new(status)),
                book: SavepointBook::default(),
                savepoints: Mutex::new(Savepoints::NotYet),
                disposer: Mutex::new(None),
            }),
        }
    }

    /// Accept only the membership of this run: a pod is created for one run,
    /// and must not join another even if asked by mistake.
    pub fn expect_run(&self, run_id: String) {
        let _ = self.inner.expected_run.set(run_id);
    }

    pub fn status(&self) -> SharedStatus {
        self.inner.status.clone()
    }

    pub fn set_phase(&self, phase: &str) {
        lock(&self.inner.status).phase = phase.into();
    }

    pub fn savepoint_book(&self) -> SavepointBook {
        self.inner.book.clone()
    }

    /// This process hosts the coordinator: savepoint requests go to it.
    pub fn serve_savepoints(&self, coordinator: mpsc::Sender<ApiRequest>) {
        *lock(&self.inner.savepoints) = Savepoints::Coordinator(coordinator);
    }

    /// This process disposes of the job's savepoints (worker 0).
    pub(crate) fn serve_disposals(&self, disposer: Disposer) {
        *lock(&self.inner.disposer) = Some(Arc::new(disposer));
    }

    /// Savepoints are taken by worker 0, whose endpoint is at `api`.
    pub fn savepoints_elsewhere(&self, api: SocketAddr) {
        *lock(&self.inner.savepoints) = Savepoints::Elsewhere(api);
    }

    /// Accepts the membership of this worker's run: once, or the identical
    /// one again (200); another one after that is a conflict (409); one that
    /// does not fit this worker is refused (400). Checking and setting is one
    /// step, so two concurrent offers of different runs cannot both be accepted.
    pub fn offer_membership(&self, m: Membership) -> Result<(), Refusal> {
        let mut verdict = Ok(());
        self.inner.membership.send_if_modified(|current| match current {
            Some(same) if *same == m => false,
            Some(other) => {
                verdict = Err(Refusal {
                    code: StatusCode::CONFLICT,
                    message: format!("this worker already belongs to run `{}`; refusing the membership of run `{}`", other.run_id, m.run_id),
                });
                false
            }
            None => match self.fits(&m) {
                Ok(()) => {
                    *current = Some(m.clone());
                    true
                }
                Err(message) => {
                    verdict = Err(Refusal { code: StatusCode::BAD_REQUEST, message });
                    false
                }
            },
        });
        verdict
    }

    fn fits(&self, m: &Membership) -> Result<(), String> {
        let valid_id = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if m.run_id.is_empty() || m.run_id.len() > 128 || !m.run_id.chars().all(valid_id) {
            // The run id names output files: no path separators, nothing odd.
            return Err(format!("run_id `{}` must be 1 to 128 characters of A-Z a-z 0-9 - _ .", m.run_id.escape_debug()));
        }
        if let Some(expected) = self.inner.expected_run.get() {
            if *expected != m.run_id {
                return Err(format!("this worker was started for run `{expected}`, not run `{}`", m.run_id));
            }
        }
        let n = m.workers.len();
        if n == 0 {
            return Err("the membership has no workers".into());
        }
        if self.inner.index as usize >= n {
            return Err(format!("this is worker {} but the membership has {n} worker{}", self.inner.index, if n == 1 { "" } else { "s" }));
        }
        if n > self.inner.parallelism as usize {
            return Err(format!("the membership has {n} workers but the job's parallelism is {}: a worker would host no subtask", self.inner.parallelism));
        }
        Ok(())
    }

    /// Waits for the accepted membership.
    pub async fn membership(&self) -> Membership {
        let mut rx = self.inner.membership.subscribe();
        loop {
            if let Some(m) = rx.borrow_and_update().clone() {
                return m;
            }
            if rx.changed().await.is_err() {
                // Unreachable while `self` holds the sender; never panic on it.
                std::future::pending::<()>().await;
            }
        }
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        // An empty token would let anybody in: then nobody is.
        if self.inner.token.is_empty() {
            return false;
        }
        let expected = format!("Bearer {}", self.inner.token);
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(|v| constant_time_eq(v.as_bytes(), expected.as_bytes()))
            .unwrap_or(false)
    }
}

/// Compares secrets (control tokens) in constant time.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn error(code: StatusCode, message: impl Into<String>) -> Response {
    (code, Json(ErrorBody { error: message.into() })).into_response()
}

async fn require_token(State(c): State<Control>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" || c.authorized(req.headers()) {
        return next.run(req).await;
    }
    let mut r = error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    r
}

async fn get_status(State(c): State<Control>) -> Response {
    let st = lock(&c.inner.status).clone();
    Json(st).into_response()
}

async fn put_membership(State(c): State<Control>, body: Bytes) -> Response {
    let m: Membership = match serde_json::from_slice(&body) {
        Ok(m) => m,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("expected a membership as JSON: {e}")),
    };
    match c.offer_membership(m.clone()) {
        Ok(()) => {
            tracing::info!(run_id = %m.run_id, workers = m.workers.len(), "membership accepted");
            Json(m).into_response()
        }
        Err(r) => {
            tracing::warn!(run_id = %m.run_id, reason = %r.message, "membership refused");
            error(r.code, r.message)
        }
    }
}

/// Caller-chosen ids end up in a URL path and in logs: keep them plain.
fn valid_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

async fn post_savepoint(State(c): State<Control>, body: Bytes) -> Response {
    let req: SavepointRequest = if body.iter().all(u8::is_ascii_whitespace) {
        SavepointRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("expected a savepoint request as JSON: {e}")),
        }
    };
    let request_id = match req.request_id {
        Some(id) if valid_request_id(&id) => id,
        Some(id) => return error(StatusCode::BAD_REQUEST, format!("request_id `{}` must be 1 to 128 characters of A-Z a-z 0-9 - _ . :", id.escape_debug())),
        None => format!("sp-{:016x}", rand::random::<u64>()),
    };
    let coordinator = match &*lock(&c.inner.savepoints) {
        Savepoints::Coordinator(tx) => tx.clone(),
        Savepoints::NotYet => return error(StatusCode::SERVICE_UNAVAILABLE, "the job is not running yet"),
        Savepoints::Elsewhere(api) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("savepoints are served by worker 0 at {api}")),
    };
    let outcome = match c.inner.book.admit(&request_id) {
        Admission::Known(o) => o,
        Admission::Full => return error(StatusCode::SERVICE_UNAVAILABLE, "too many savepoints are pending; ask again later"),
        Admission::New(o) => {
            tracing::info!(%request_id, stop = req.stop, "savepoint requested");
            if coordinator.send(ApiRequest::Savepoint { request_id: request_id.clone(), stop: req.stop }).await.is_err() {
                let reason = "the job stopped before the savepoint could be taken";
                c.inner.book.fail(&request_id, reason);
                return (StatusCode::ACCEPTED, Json(c.inner.book.get(&request_id).unwrap_or(o))).into_response();
            }
            o
        }
    };
    (StatusCode::ACCEPTED, Json(outcome)).into_response()
}

async fn get_savepoint(State(c): State<Control>, path: Result<Path<String>, PathRejection>) -> Response {
    let Ok(Path(request_id)) = path else { return error(StatusCode::BAD_REQUEST, "the request id in the path is not valid UTF-8") };
    if let Savepoints::Elsewhere(api) = &*lock(&c.inner.savepoints) {
        return error(StatusCode::SERVICE_UNAVAILABLE, format!("savepoints are served by worker 0 at {api}"));
    }
    match c.inner.book.get(&request_id) {
        Some(o) => Json(o).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no savepoint request `{}` in this run", request_id.escape_debug())),
    }
}

/// Cancels a savepoint request (an operator that gave up waiting for a
/// stopping savepoint, or whose user took the stop back): the job must not
/// stay stopped for a request nobody waits for any more.
async fn delete_savepoint(State(c): State<Control>, path: Result<Path<String>, PathRejection>) -> Response {
    let Ok(Path(request_id)) = path else { return error(StatusCode::BAD_REQUEST, "the request id in the path is not valid UTF-8") };
    let coordinator = match &*lock(&c.inner.savepoints) {
        Savepoints::Coordinator(tx) => tx.clone(),
        Savepoints::NotYet => return error(StatusCode::SERVICE_UNAVAILABLE, "the job is not running yet"),
        Savepoints::Elsewhere(api) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("savepoints are served by worker 0 at {api}")),
    };
    if c.inner.book.get(&request_id).is_none() {
        return error(StatusCode::NOT_FOUND, format!("no savepoint request `{}` in this run", request_id.escape_debug()));
    }
    tracing::info!(%request_id, "savepoint request cancelled");
    let (done, answered) = tokio::sync::oneshot::channel();
    if coordinator.send(ApiRequest::Cancel { request_id: request_id.clone(), done }).await.is_ok() {
        // The coordinator answers at once; a run that ended meanwhile drops the sender.
        let _ = answered.await;
    }
    match c.inner.book.get(&request_id) {
        Some(o) => Json(o).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no savepoint request `{}` in this run", request_id.escape_debug())),
    }
}

/// Disposes of one savepoint of the job (see `weir_api::control`). Answers
/// once it is done: the operator removes the savepoint from its list only then.
async fn post_disposal(State(c): State<Control>, body: Bytes) -> Response {
    let req: SavepointDisposal = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("expected a savepoint disposal as JSON, {{\"location\": \"…\"}}: {e}")),
    };
    let disposer = lock(&c.inner.disposer).clone();
    let Some(disposer) = disposer else {
        return match &*lock(&c.inner.savepoints) {
            Savepoints::Elsewhere(api) => error(StatusCode::SERVICE_UNAVAILABLE, format!("savepoints are served by worker 0 at {api}")),
            _ => error(StatusCode::SERVICE_UNAVAILABLE, "the job is not running yet"),
        };
    };
    // Until the run completed a snapshot, its sinks may still be committing
    // what the snapshot it restored from names (perhaps a savepoint outside
    // this job's storage, which the clean-up cannot see), and a failure
    // would restore that snapshot again.
    if lock(&c.inner.status).checkpoints_completed == 0 {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the run has completed no checkpoint yet; savepoints are disposed of once it has");
    }
    tracing::info!(savepoint = %req.location, "savepoint disposal requested");
    match disposer.dispose(&req.location).await {
        Ok(existed) => Json(SavepointDisposed { location: req.location, existed }).into_response(),
        Err(Disposal::NotASavepoint(m)) => error(StatusCode::BAD_REQUEST, m),
        Err(Disposal::Latest(m)) => error(StatusCode::CONFLICT, m),
        Err(Disposal::Failed(e)) => {
            tracing::warn!(savepoint = %req.location, error = %e, "savepoint disposal failed");
            error(StatusCode::INTERNAL_SERVER_ERROR, format!("disposing of savepoint {} failed: {e}", req.location))
        }
    }
}

pub fn router(control: Control) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1/status", get(get_status))
        .route("/v1/membership", put(put_membership))
        .route("/v1/savepoints", post(post_savepoint))
        .route("/v1/savepoints/{request_id}", get(get_savepoint).delete(delete_savepoint))
        .route("/v1/savepoint-disposals", post(post_disposal))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async { error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this route") })
        // Outermost, so that it also guards the fallbacks: nothing is revealed without the token.
        .layer(middleware::from_fn_with_state(control.clone(), require_token))
        .with_state(control)
}

/// Serves the endpoint until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, control: Control) -> Result<()> {
    axum::serve(listener, router(control)).await.map_err(Error::io("control endpoint"))
}

/// Serves the endpoint over TLS (`weir worker --tls-dir`) until the process ends.
pub async fn serve_tls(listener: crate::worker::tls::ControlListener, control: Control) -> Result<()> {
    axum::serve(listener, router(control)).await.map_err(Error::io("control endpoint"))
}
