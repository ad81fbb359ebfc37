//! The client side of a job's control endpoint (see `weir_api::control`):
//! progress, membership and savepoints. Behind a trait so that reconcile
//! tests can answer for the workers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use weir_api::control::{ErrorBody, JobStatus, Membership, SavepointDisposal, SavepointDisposed, SavepointOutcome, SavepointRequest};

use crate::error::{Error, Result};

/// How the operator reaches one job's workers: the job's control token and,
/// with `spec.tls`, the DNS name their certificate carries (the endpoint is
/// then HTTPS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub token: String,
    pub tls_name: Option<String>,
}

impl Access {
    /// Plain HTTP with `token`.
    pub fn plain(token: impl Into<String>) -> Access {
        Access { token: token.into(), tls_name: None }
    }
}

/// What the operator asks of a job's workers.
pub trait WorkerApi: Send + Sync + 'static {
    /// The job's progress, from worker 0.
    fn status<'a>(&'a self, api: SocketAddr, to: &'a Access) -> BoxFuture<'a, Result<JobStatus>>;
    /// Gives one worker its run's membership (idempotent for the same run).
    fn put_membership<'a>(&'a self, worker: SocketAddr, to: &'a Access, membership: &'a Membership) -> BoxFuture<'a, Result<()>>;
    /// Asks worker 0 for a savepoint; asking again with the same id is safe.
    fn request_savepoint<'a>(&'a self, api: SocketAddr, to: &'a Access, request: &'a SavepointRequest) -> BoxFuture<'a, Result<SavepointOutcome>>;
    /// The outcome of a savepoint request; `None` when this run does not know the id.
    fn savepoint_outcome<'a>(&'a self, api: SocketAddr, to: &'a Access, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>>;
    /// Cancels a savepoint request; `None` when this run does not know the id.
    fn cancel_savepoint<'a>(&'a self, api: SocketAddr, to: &'a Access, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>>;
    /// Asks worker 0 to dispose of a savepoint; answers once it is done.
    fn dispose_savepoint<'a>(&'a self, api: SocketAddr, to: &'a Access, location: &'a str) -> BoxFuture<'a, Result<SavepointDisposed>>;
}

/// HTTP client with short timeouts: a reconcile must not hang on a worker.
pub struct HttpWorkerApi {
    plain: reqwest::Client,
    /// The CA the workers' certificates must lead to (`--worker-ca-file`).
    worker_ca: Option<Arc<RootCertStore>>,
    /// One HTTPS client per certificate name (one per job with `spec.tls`).
    tls: Mutex<HashMap<String, reqwest::Client>>,
}

fn client_error(message: String) -> Error {
    Error::Worker { addr: "-".into(), message }
}

fn builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(3))
        .pool_idle_timeout(Duration::from_secs(30))
        // Pod IPs are reached directly, whatever HTTP(S)_PROXY the
        // operator's environment has for the outside world.
        .no_proxy()
}

impl HttpWorkerApi {
    pub fn new() -> Result<HttpWorkerApi> {
        let plain = builder().build().map_err(|e| client_error(format!("cannot build HTTP client: {e}")))?;
        Ok(HttpWorkerApi { plain, worker_ca: None, tls: Mutex::new(HashMap::new()) })
    }

    /// Trusts the CA certificates (PEM) in `path` for jobs with `spec.tls`.
    pub fn with_worker_ca(mut self, path: &Path) -> Result<HttpWorkerApi> {
        let setting = |m: String| Error::Config(format!("--worker-ca-file {}: {m}", path.display()));
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| setting(format!("cannot be read as PEM certificates: {e}")))?;
        if certs.is_empty() {
            return Err(setting("holds no certificate (PEM `BEGIN CERTIFICATE` blocks expected)".into()));
        }
        let mut roots = RootCertStore::empty();
        for cert in certs {
            roots.add(cert).map_err(|e| setting(format!("a certificate is not a usable CA: {e}")))?;
        }
        self.worker_ca = Some(Arc::new(roots));
        Ok(self)
    }

    /// Whether jobs with `spec.tls` can be called.
    pub fn trusts_worker_ca(&self) -> bool {
        self.worker_ca.is_some()
    }

    /// The client for `to`: plain, or HTTPS checking the job's certificate name.
    fn client(&self, to: &Access) -> Result<reqwest::Client> {
        let Some(name) = &to.tls_name else { return Ok(self.plain.clone()) };
        let mut clients = self.tls.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(name) {
            return Ok(c.clone());
        }
        let Some(roots) = &self.worker_ca else {
            return Err(client_error("the job has spec.tls, but the operator trusts no CA for its workers (--worker-ca-file)".into()));
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let webpki = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| client_error(format!("the workers' CA: {e}")))?;
        let server_name = ServerName::try_from(name.clone()).map_err(|e| client_error(format!("`{name}` is no DNS name: {e}")))?;
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| client_error(format!("TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NamedWorker { webpki, name: server_name }))
            .with_no_client_auth();
        let client = builder().use_preconfigured_tls(config).build().map_err(|e| client_error(format!("cannot build HTTPS client: {e}")))?;
        // Bounded by the jobs there are; a deleted job's client is small.
        clients.insert(name.clone(), client.clone());
        Ok(client)
    }

    async fn send<T: serde::de::DeserializeOwned>(&self, addr: SocketAddr, req: reqwest::RequestBuilder) -> Result<(u16, Option<T>)> {
        let worker = |message: String| Error::Worker { addr: addr.to_string(), message };
        // reqwest's Display hides the cause (a refused certificate, say).
        let resp = req.send().await.map_err(|e| worker(chain(&e)))?;
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

    /// A request to `path` on the worker at `addr`, authorized for `to`.
    fn request(&self, method: reqwest::Method, addr: SocketAddr, path: &str, to: &Access) -> Result<reqwest::RequestBuilder> {
        let client = self.client(to).map_err(|e| match e {
            Error::Worker { message, .. } => Error::Worker { addr: addr.to_string(), message },
            e => e,
        })?;
        Ok(client.request(method, url(addr, path, to.tls_name.is_some())).bearer_auth(&to.token))
    }
}

/// An error and its causes, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Checks a worker's certificate against the workers' CA and the job's
/// name, whatever the URL's host: workers are called by pod IP, which no
/// certificate issued in advance names.
#[derive(Debug)]
struct NamedWorker {
    webpki: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NamedWorker {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _host: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        self.webpki.verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// The URL of `path` on a worker's control endpoint. A SocketAddr prints an
/// IPv6 address bracketed (`[fd00::5]:6120`), as a URL's authority needs.
fn url(addr: SocketAddr, path: &str, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{addr}{path}")
}

impl WorkerApi for HttpWorkerApi {
    fn status<'a>(&'a self, api: SocketAddr, to: &'a Access) -> BoxFuture<'a, Result<JobStatus>> {
        Box::pin(async move {
            let req = self.request(reqwest::Method::GET, api, "/v1/status", to)?;
            match self.send::<JobStatus>(api, req).await? {
                (_, Some(s)) => Ok(s),
                (code, None) => Err(Error::Worker { addr: api.to_string(), message: format!("HTTP {code} without a status") }),
            }
        })
    }

    fn put_membership<'a>(&'a self, worker: SocketAddr, to: &'a Access, membership: &'a Membership) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let req = self.request(reqwest::Method::PUT, worker, "/v1/membership", to)?.json(membership);
            self.send::<serde_json::Value>(worker, req).await.map(|_| ())
        })
    }

    fn request_savepoint<'a>(&'a self, api: SocketAddr, to: &'a Access, request: &'a SavepointRequest) -> BoxFuture<'a, Result<SavepointOutcome>> {
        Box::pin(async move {
            let req = self.request(reqwest::Method::POST, api, "/v1/savepoints", to)?.json(request);
            match self.send::<SavepointOutcome>(api, req).await? {
                (_, Some(o)) => Ok(o),
                (code, None) => Err(Error::Worker { addr: api.to_string(), message: format!("HTTP {code} without an outcome") }),
            }
        })
    }

    fn dispose_savepoint<'a>(&'a self, api: SocketAddr, to: &'a Access, location: &'a str) -> BoxFuture<'a, Result<SavepointDisposed>> {
        Box::pin(async move {
            // A whole directory is deleted (one request per object on S3): more than the usual 3 s.
            let body = SavepointDisposal { location: location.to_string() };
            let req = self.request(reqwest::Method::POST, api, "/v1/savepoint-disposals", to)?.timeout(Duration::from_secs(60)).json(&body);
            match self.send::<SavepointDisposed>(api, req).await? {
                (_, Some(d)) => Ok(d),
                (code, None) => Err(Error::Worker { addr: api.to_string(), message: format!("HTTP {code} without an answer") }),
            }
        })
    }

    fn savepoint_outcome<'a>(&'a self, api: SocketAddr, to: &'a Access, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>> {
        Box::pin(async move {
            let req = self.request(reqwest::Method::GET, api, &format!("/v1/savepoints/{request_id}"), to)?;
            Ok(self.send::<SavepointOutcome>(api, req).await?.1)
        })
    }

    fn cancel_savepoint<'a>(&'a self, api: SocketAddr, to: &'a Access, request_id: &'a str) -> BoxFuture<'a, Result<Option<SavepointOutcome>>> {
        Box::pin(async move {
            let req = self.request(reqwest::Method::DELETE, api, &format!("/v1/savepoints/{request_id}"), to)?;
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
        assert_eq!(url("10.0.0.5:6120".parse().unwrap(), "/v1/status", false), "http://10.0.0.5:6120/v1/status");
        assert_eq!(url("10.0.0.5:6120".parse().unwrap(), "/v1/status", true), "https://10.0.0.5:6120/v1/status");
        let v6 = url("[fd00:10::5]:6120".parse().unwrap(), "/v1/status", false);
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
        let got = HttpWorkerApi::new().unwrap().status(addr, &Access::plain("t0ken")).await.unwrap();
        assert_eq!(got, status);
        let head = server.await.unwrap();
        assert!(head.starts_with("GET /v1/status HTTP/1.1"), "{head}");
        assert!(head.to_ascii_lowercase().contains(&format!("host: [::1]:{}", addr.port())), "{head}");
    }

    /// A CA and a certificate it signed for `name`, made with openssl.
    fn certificates(name: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl").args(args).current_dir(dir.path()).output().unwrap();
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(&["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test CA"]);
        std::fs::write(dir.path().join("ext.cnf"), format!("subjectAltName=DNS:{name}\n")).unwrap();
        run(&["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=w"]);
        run(&["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf"]);
        dir
    }

    /// Serves HTTPS with the certificate in `dir`, answering each request with `body`.
    async fn https_worker(dir: &Path, body: String) -> SocketAddr {
        let chain: Vec<_> = CertificateDer::pem_file_iter(dir.join("tls.crt")).unwrap().map(|c| c.unwrap()).collect();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(dir.join("tls.key")).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let (acceptor, body) = (acceptor.clone(), body.clone());
                tokio::spawn(async move {
                    let Ok(mut conn) = acceptor.accept(tcp).await else { return };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        let Ok(n) = conn.read(&mut buf).await else { return };
                        if n == 0 {
                            return;
                        }
                        head.extend_from_slice(&buf[..n]);
                    }
                    let answer = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                    let _ = conn.write_all(answer.as_bytes()).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_tls_worker_is_called_by_ip_and_checked_by_the_jobs_name_and_the_ca() {
        let name = "j-workers.ns.svc";
        let ours = certificates(name);
        let status = JobStatus { job: "j".into(), run_id: "r-1".into(), phase: "running".into(), ..Default::default() };
        let addr = https_worker(ours.path(), serde_json::to_string(&status).unwrap()).await;
        let to = Access { token: "t0ken".into(), tls_name: Some(name.into()) };
        // Dialled by IP, checked by the job's name: answered.
        let api = HttpWorkerApi::new().unwrap().with_worker_ca(&ours.path().join("ca.crt")).unwrap();
        assert!(api.trusts_worker_ca());
        assert_eq!(api.status(addr, &to).await.unwrap(), status);
        // Another job's name: the certificate does not carry it.
        let other = Access { token: "t0ken".into(), tls_name: Some("k-workers.ns.svc".into()) };
        let err = api.status(addr, &other).await.unwrap_err().to_string();
        assert!(err.contains("certificate"), "{err}");
        // Another CA: refused before the token is sent.
        let theirs = certificates(name);
        let stranger = HttpWorkerApi::new().unwrap().with_worker_ca(&theirs.path().join("ca.crt")).unwrap();
        let err = stranger.status(addr, &to).await.unwrap_err().to_string();
        assert!(err.contains("certificate"), "{err}");
        // No CA at all: said so.
        let err = HttpWorkerApi::new().unwrap().status(addr, &to).await.unwrap_err().to_string();
        assert!(err.contains("trusts no CA"), "{err}");
        // A CA file that holds no certificate: the setting is named.
        std::fs::write(ours.path().join("empty.pem"), "").unwrap();
        let err = HttpWorkerApi::new().unwrap().with_worker_ca(&ours.path().join("empty.pem")).err().unwrap().to_string();
        assert!(err.contains("--worker-ca-file") && err.contains("no certificate"), "{err}");
    }
}
