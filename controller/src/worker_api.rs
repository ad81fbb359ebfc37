//! The client side of a job's control endpoint (see `weir_api::control`):
//! progress, membership and savepoints. Behind a trait so that reconcile
//! tests can answer for the workers.

use std::net::SocketAddr;
use std::time::Duration;

use futures::future::BoxFuture;
use weir_api::control::{ErrorBody, JobStatus, Membership, SavepointDisposal, SavepointDisposed, SavepointOutcome, SavepointRequest};

use crate::error::{Error, Result};

/// What the operator asks of a job's workers.
pub trait WorkerApi: Send + Sync + 'static {
    /// The job's progress, from worker 0.
    fn status<'a>(&'a self, api: SocketAddr, token: &'a str) -> BoxFuture<'a, Result<JobStatus>>;
    /// Gives one worker its run's membership (idempotent for the same run).
    fn put_membership<'a>(&'a self, worker: SocketAddr, token: &'a str, membership: &'a Membership) -> BoxFuture<'a, Result<()>>;
    /// Asks worker 0 for a savepoint; asking again with the same id is safe.
    fn request_savepoint<'a>(&'a self, api: SocketAddr, token: &'a str, request: &'a SavepointRequest) -> BoxFuture<'a, Result<SavepointOutcome>>;
    /// The outcome of a savepoint request; `None` when this run does not know the id.
    fn savepoint_outcome<'a>(&'a self, api: SocketAddr, token: &'a str, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>>;
    /// Cancels a savepoint request; `None` when this run does not know the id.
    fn cancel_savepoint<'a>(&'a self, api: SocketAddr, token: &'a str, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>>;
    /// Asks worker 0 to dispose of a savepoint; answers once it is done.
    fn dispose_savepoint<'a>(&'a self, api: SocketAddr, token: &'a str, location: &'a str) -> BoxFuture<'a, Result<SavepointDisposed>>;
}

/// HTTP client with short timeouts: a reconcile must not hang on a worker.
pub struct HttpWorkerApi {
    http: reqwest::Client,
}

impl HttpWorkerApi {
    pub fn new() -> Result<HttpWorkerApi> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(500))
            .timeout(Duration::from_secs(3))
            .pool_idle_timeout(Duration::from_secs(30))
            // Pod IPs are reached directly, whatever HTTP(S)_PROXY the
            // operator's environment has for the outside world.
            .no_proxy()
            .build()
            .map_err(|e| Error::Worker { addr: "-".into(), message: format!("cannot build HTTP client: {e}") })?;
        Ok(HttpWorkerApi { http })
    }

    async fn send<T: serde::de::DeserializeOwned>(&self, addr: SocketAddr, req: reqwest::RequestBuilder) -> Result<(u16, Option<T>)> {
        let worker = |message: String| Error::Worker { addr: addr.to_string(), message };
        let resp = req.send().await.map_err(|e| worker(e.to_string()))?;
        let code = resp.status().as_u16();
        let body = resp.bytes().await.map_err(|e| worker(e.to_string()))?;
        if (200..300).contains(&code) {
            if body.is_empty() {
                return Ok((code, None));
            }
            let value = serde_json::from_slice(&body).map_err(|e| worker(format!("unexpected answer: {e}")))?;
            return Ok((code, Some(value)));
        }
        if code == 404 {
            return Ok((code, None));
        }
        let message = serde_json::from_slice::<ErrorBody>(&body)
            .map(|b| b.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
        Err(worker(format!("HTTP {code}: {message}")))
    }
}

/// The URL of `path` on a worker's control endpoint. A SocketAddr prints an
/// IPv6 address bracketed (`[fd00::5]:6120`), as a URL's authority needs.
fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

impl WorkerApi for HttpWorkerApi {
    fn status<'a>(&'a self, api: SocketAddr, token: &'a str) -> BoxFuture<'a, Result<JobStatus>> {
        Box::pin(async move {
            let req = self.http.get(url(api, "/v1/status")).bearer_auth(token);
            match self.send::<JobStatus>(api, req).await? {
                (_, Some(s)) => Ok(s),
                (code, None) => Err(Error::Worker { addr: api.to_string(), message: format!("HTTP {code} without a status") }),
            }
        })
    }

    fn put_membership<'a>(&'a self, worker: SocketAddr, token: &'a str, membership: &'a Membership) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let req = self.http.put(url(worker, "/v1/membership")).bearer_auth(token).json(membership);
            self.send::<serde_json::Value>(worker, req).await.map(|_| ())
        })
    }

    fn request_savepoint<'a>(&'a self, api: SocketAddr, token: &'a str, request: &'a SavepointRequest) -> BoxFuture<'a, Result<SavepointOutcome>> {
        Box::pin(async move {
            let req = self.http.post(url(api, "/v1/savepoints")).bearer_auth(token).json(request);
            match self.send::<SavepointOutcome>(api, req).await? {
                (_, Some(o)) => Ok(o),
                (code, None) => Err(Error::Worker { addr: api.to_string(), message: format!("HTTP {code} without an outcome") }),
            }
        })
    }

    fn dispose_savepoint<'a>(&'a self, api: SocketAddr, token: &'a str, location: &'a str) -> BoxFuture<'a, Result<SavepointDisposed>> {
        Box::pin(async move {
            // A whole directory is deleted (one request per object on S3): more than the usual 3 s.
            let body = SavepointDisposal { location: location.to_string() };
            let req = self.http.post(url(api, "/v1/savepoint-disposals")).bearer_auth(token).timeout(Duration::from_secs(60)).json(&body);
            match self.send::<SavepointDisposed>(api, req).await? {
                (_, Some(d)) => Ok(d),
                (code, None) => Err(Error::Worker { addr: api.to_string(), message: format!("HTTP {code} without an answer") }),
            }
        })
    }

    fn savepoint_outcome<'a>(&'a self, api: SocketAddr, token: &'a str, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>> {
        Box::pin(async move {
            let req = self.http.get(url(api, &format!("/v1/savepoints/{request_id}"))).bearer_auth(token);
            Ok(self.send::<SavepointOutcome>(api, req).await?.1)
        })
    }

    fn cancel_savepoint<'a>(&'a self, api: SocketAddr, token: &'a str, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>> {
        Box::pin(async move {
            let req = self.http.delete(url(api, &format!("/v1/savepoints/{request_id}"))).bearer_auth(token);
            Ok(self.send::<SavepointOutcome>(api, req).await?.1)
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn urls_of_ipv4_and_ipv6_workers_are_valid() {
        assert_eq!(url("10.0.0.5:6120".parse().unwrap(), "/v1/status"), "http://10.0.0.5:6120/v1/status");
        let v6 = url("[fd00:10::5]:6120".parse().unwrap(), "/v1/status");
        assert_eq!(v6, "http://[fd00:10::5]:6120/v1/status");
        let parsed = reqwest::Url::parse(&v6).unwrap();
        assert_eq!((parsed.host_str(), parsed.port()), (Some("[fd00:10::5]"), Some(6120)));
    }

    /// Serves one request on `listener` with `body`; returns the request's head.
    async fn answer_once(listener: tokio::net::TcpListener, body: String) -> String {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request ended early");
            head.extend_from_slice(&buf[..n]);
        }
        let answer = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        conn.write_all(answer.as_bytes()).await.unwrap();
        String::from_utf8_lossy(&head).into_owned()
    }

    #[tokio::test]
    async fn the_coordinator_of_an_ipv6_pod_is_asked_at_its_bracketed_address() {
        // ::1 stands for an IPv6 pod IP.
        let Ok(listener) = tokio::net::TcpListener::bind("[::1]:0").await else {
            eprintln!("no IPv6 loopback here; skipped");
            return;
        };
        let addr = listener.local_addr().unwrap();
        let status = JobStatus { job: "j".into(), run_id: "r-1".into(), phase: "running".into(), ..Default::default() };
        let server = tokio::spawn(answer_once(listener, serde_json::to_string(&status).unwrap()));
        let got = HttpWorkerApi::new().unwrap().status(addr, "t0ken").await.unwrap();
        assert_eq!(got, status);
        let head = server.await.unwrap();
        assert!(head.starts_with("GET /v1/status HTTP/1.1"), "{head}");
        assert!(head.to_ascii_lowercase().contains(&format!("host: [::1]:{}", addr.port())), "{head}");
    }
}
