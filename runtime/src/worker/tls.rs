//! TLS on a job's connections (`weir worker --tls-dir DIR --tls-server-name NAME`).
//!
//! The directory holds what cert-manager (and `kubectl create secret tls`
//! plus a CA) puts in a Secret: `tls.crt` (the job's certificate chain),
//! `tls.key` (its private key) and `ca.crt` (the CA that signed it). Every
//! worker of the job shows that one certificate; it must name `NAME` (the
//! operator passes `<job>-workers.<namespace>.svc`) as a DNS name, because
//! peers are reached by pod IP, which no certificate issued in advance can
//! name.
//!
//! - **Data and coordinator connections**: mutual TLS. The accepting side
//!   shows the certificate and requires one from the connecting side; each
//!   checks the other's against `ca.crt`, and the connector also checks that
//!   it names `NAME`. Inside the encrypted stream, the run handshake
//!   (`handshake.rs`) still proves that the peer is a process of this run:
//!   the CA may sign other jobs' certificates too.
//! - **The control endpoint**: TLS with the same certificate; a client
//!   shows none, because the bearer token is what admits it (the operator
//!   trusts the CA and checks `NAME`).
//!
//! The files are read once, when the worker starts: a renewed certificate
//! reaches the next run.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::error::{Error, Result};

/// A connection between two processes of a run: plain TCP, or TLS over it.
pub type Link = tokio_util::either::Either<TcpStream, tokio_rustls::TlsStream<TcpStream>>;

/// The files of a TLS directory, as cert-manager names them.
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
pub const CA_FILE: &str = "ca.crt";

/// The job's TLS settings, loaded once per worker process.
pub struct JobTls {
    peer_acceptor: TlsAcceptor,
    peer_connector: TlsConnector,
    control: Arc<ServerConfig>,
    name: ServerName<'static>,
}

impl std::fmt::Debug for JobTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobTls").field("name", &self.name).finish_non_exhaustive()
    }
}

fn setting(message: String) -> Error {
    Error::Plan { context: "--tls-dir".into(), message }
}

impl JobTls {
    /// Reads `tls.crt`, `tls.key` and `ca.crt` from `dir`; `name` is the DNS
    /// name every worker's certificate carries.
    pub fn load(dir: &Path, name: &str) -> Result<JobTls> {
        let file = |f: &str| dir.join(f);
        let chain = read_certs(&file(CERT_FILE))?;
        let key = PrivateKeyDer::from_pem_file(file(KEY_FILE))
            .map_err(|e| setting(format!("{}: no private key could be read from it (PEM expected): {e}", file(KEY_FILE).display())))?;
        let mut roots = RootCertStore::empty();
        for ca in read_certs(&file(CA_FILE))? {
            roots.add(ca).map_err(|e| setting(format!("{}: a certificate is not a usable CA: {e}", file(CA_FILE).display())))?;
        }
        let roots = Arc::new(roots);
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| Error::Plan { context: "--tls-server-name".into(), message: format!("`{name}` is no DNS name: {e}") })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = |e: rustls::Error| setting(format!("{} and {}: {e}", file(CERT_FILE).display(), file(KEY_FILE).display()));

        let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| setting(format!("{}: {e}", file(CA_FILE).display())))?;
        let peer_server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_client_cert_verifier(clients)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(tls)?;
        let peer_client = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(tls)?;
        let control = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(tls)?;
        Ok(JobTls {
            peer_acceptor: TlsAcceptor::from(Arc::new(peer_server)),
            peer_connector: TlsConnector::from(Arc::new(peer_client)),
            control: Arc::new(control),
            name,
        })
    }

    /// The accepting side of a data or coordinator connection.
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<Link> {
        Ok(Link::Right(self.peer_acceptor.accept(tcp).await?.into()))
    }

    /// The connecting side of a data or coordinator connection.
    pub async fn connect(&self, tcp: TcpStream) -> io::Result<Link> {
        Ok(Link::Right(self.peer_connector.connect(self.name.clone(), tcp).await?.into()))
    }

    /// The control endpoint's configuration.
    pub fn control(&self) -> Arc<ServerConfig> {
        self.control.clone()
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| setting(format!("{}: cannot be read as PEM certificates: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(setting(format!("{}: holds no certificate (PEM `BEGIN CERTIFICATE` blocks expected)", path.display())));
    }
    Ok(certs)
}

/// How long a client of the control endpoint may take over its TLS handshake.
const CONTROL_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The control endpoint's listener with TLS: handshakes run each in a task
/// of their own under a timeout, so a client that stalls in one holds up
/// no other.
pub struct ControlListener {
    ready: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl ControlListener {
    pub fn new(listener: TcpListener, config: Arc<ServerConfig>) -> io::Result<ControlListener> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(16);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!(error = %e, "control endpoint: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let (acceptor, ready) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(CONTROL_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = ready.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "control endpoint: TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "control endpoint: no TLS handshake within 5 s"),
                    }
                });
            }
        });
        Ok(ControlListener { ready, local })
    }
}

impl axum::serve::Listener for ControlListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accepting task never ends while this receiver lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A CA and a certificate it signed for `name`, written as a TLS
    /// directory (openssl, as the cluster scenario makes them).
    pub(crate) fn tls_dir(name: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl").args(args).current_dir(d).output().unwrap();
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(&["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=weir test CA"]);
        std::fs::write(d.join("ext.cnf"), format!("subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth,clientAuth\n")).unwrap();
        run(&["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=weir"]);
        run(&["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf"]);
        dir
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, a) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), a.unwrap().0)
    }

    #[tokio::test]
    async fn two_workers_of_one_job_talk_over_mutual_tls() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tls_dir("job-workers.ns.svc");
        let tls = JobTls::load(dir.path(), "job-workers.ns.svc").unwrap();
        let (c, a) = pair().await;
        let (connected, accepted) = tokio::join!(tls.connect(c), tls.accept(a));
        let (mut c, mut a) = (connected.unwrap(), accepted.unwrap());
        c.write_all(b"hello").await.unwrap();
        c.flush().await.unwrap();
        let mut got = [0u8; 5];
        a.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
    }

    #[tokio::test]
    async fn a_certificate_of_another_ca_or_name_is_refused() {
        let ours = tls_dir("job-workers.ns.svc");
        let theirs = tls_dir("job-workers.ns.svc");
        let ours = JobTls::load(ours.path(), "job-workers.ns.svc").unwrap();
        let stranger = JobTls::load(theirs.path(), "job-workers.ns.svc").unwrap();
        // A stranger's certificate, signed by another CA, connecting to us.
        let (c, a) = pair().await;
        let (_, accepted) = tokio::join!(stranger.connect(c), ours.accept(a));
        assert!(accepted.is_err());
        // Our certificate, but the connector expects another name.
        let same_ca = tls_dir("other-workers.ns.svc");
        let other_name = JobTls::load(same_ca.path(), "job-workers.ns.svc").unwrap();
        let (c, a) = pair().await;
        let theirs = JobTls::load(same_ca.path(), "other-workers.ns.svc").unwrap();
        let (connected, _) = tokio::join!(other_name.connect(c), theirs.accept(a));
        let err = connected.unwrap_err().to_string();
        assert!(err.contains("not valid for name") || err.contains("NotValidForName"), "{err}");
    }

    #[tokio::test]
    async fn a_plain_connection_gets_no_data_from_a_tls_worker() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tls_dir("job-workers.ns.svc");
        let tls = JobTls::load(dir.path(), "job-workers.ns.svc").unwrap();
        let (mut c, a) = pair().await;
        let (_, accepted) = tokio::join!(
            async {
                c.write_all(b"WEIR junk that is no TLS client hello").await.unwrap();
                let mut buf = Vec::new();
                let _ = c.read_to_end(&mut buf).await;
            },
            tls.accept(a)
        );
        assert!(accepted.is_err());
    }

    #[test]
    fn missing_or_broken_files_are_named() {
        let dir = tls_dir("job-workers.ns.svc");
        std::fs::write(dir.path().join(CA_FILE), "not a certificate").unwrap();
        let err = JobTls::load(dir.path(), "job-workers.ns.svc").unwrap_err().to_string();
        assert!(err.contains("ca.crt") && err.contains("no certificate"), "{err}");
        std::fs::remove_file(dir.path().join(KEY_FILE)).unwrap();
        let err = JobTls::load(dir.path(), "job-workers.ns.svc").unwrap_err().to_string();
        assert!(err.contains("tls.key"), "{err}");
        let dir = tls_dir("job-workers.ns.svc");
        let err = JobTls::load(dir.path(), "not a name!").unwrap_err().to_string();
        assert!(err.contains("--tls-server-name"), "{err}");
    }
}
