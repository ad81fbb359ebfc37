//! The job's control endpoint (HTTP, served by the process that hosts the
//! coordinator): status for progress lines and the operator, and savepoints
//! on request. Every call but `/healthz` needs the job's bearer token, so
//! nothing else that can reach the port can trigger a savepoint.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};

// One definition of the JSON on the wire, shared with the operator.
pub use weir_api::control::{CheckpointStatus, JobStatus};

pub type SharedStatus = Arc<Mutex<JobStatus>>;

pub enum ApiRequest {
    Savepoint(oneshot::Sender<Result<CheckpointStatus, String>>),
}

#[derive(Clone)]
struct ApiState {
    token: Arc<String>,
    status: SharedStatus,
    requests: mpsc::Sender<ApiRequest>,
}

fn authorized(state: &ApiState, headers: &HeaderMap) -> bool {
    let expected = format!("Bearer {}", state.token);
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(|v| constant_time_eq(v.as_bytes(), expected.as_bytes()))
        .unwrap_or(false)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn error(code: StatusCode, message: &str) -> Response {
    (code, Json(serde_json::json!({ "error": message }))).into_response()
}

async fn get_status(State(s): State<ApiState>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    }
    let st = s.status.lock().map(|g| g.clone()).unwrap_or_default();
    Json(st).into_response()
}

async fn post_savepoint(State(s): State<ApiState>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    }
    let (tx, rx) = oneshot::channel();
    if s.requests.send(ApiRequest::Savepoint(tx)).await.is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the job is stopping");
    }
    match rx.await {
        Ok(Ok(sp)) => Json(sp).into_response(),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, &e),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "the job stopped before the savepoint completed"),
    }
}

/// Serves the API until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, token: String, status: SharedStatus, requests: mpsc::Sender<ApiRequest>) -> Result<()> {
    let state = ApiState { token: Arc::new(token), status, requests };
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1/status", get(get_status))
        .route("/v1/savepoints", post(post_savepoint))
        .with_state(state);
    axum::serve(listener, app).await.map_err(Error::io("control API"))
}

/// A minimal HTTP/1.1 client for the control API (the CLI and the local
/// supervisor talk to it on loopback).
pub async fn call(addr: SocketAddr, method: &str, path: &str, token: &str, timeout: std::time::Duration) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.map_err(Error::io(format!("control API at {addr}")))?;
        let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.map_err(Error::io(format!("control API at {addr}")))?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.map_err(Error::io(format!("control API at {addr}")))?;
        let text = String::from_utf8_lossy(&buf).to_string();
        let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        let body = if text.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(&body) } else { body };
        Ok((code, body))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| Error::Network { peer: addr.to_string(), message: "control API did not answer in time".into() })?
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}
