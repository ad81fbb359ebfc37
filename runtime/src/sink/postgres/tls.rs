//! TLS of the PostgreSQL sink, set the way libpq sets it: `sslmode`,
//! `sslrootcert`, `sslcert` and `sslkey` in the connection string.
//!
//! tokio-postgres reads only `sslmode` disable, prefer and require, and
//! leaves certificates to the TLS connector it is given. So this module
//! takes the four settings out of the connection string, hands the rest to
//! tokio-postgres, and builds a rustls client configuration (through
//! `tokio-postgres-rustls`) that gives each mode libpq's meaning:
//!
//! | `sslmode`        | encrypted                  | server certificate checked                  |
//! |------------------|----------------------------|---------------------------------------------|
//! | `disable`        | no                         | —                                           |
//! | `prefer` (default) | when the server offers it | only against `sslrootcert`, when given     |
//! | `require`        | yes                        | only against `sslrootcert`, when given      |
//! | `verify-ca`      | yes                        | signed by a CA of `sslrootcert`             |
//! | `verify-full`    | yes                        | signed by a CA of `sslrootcert`, for the host |
//!
//! `sslcert` and `sslkey` (PEM files) present a client certificate. Files
//! are read when the sink connects, so a Secret mounted into the pod works.
//!
//! Deliberately does not know the sink's modes or tables: it only turns a
//! connection string into a configuration and a connector.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode;

use crate::error::{Error, Result};

const SETTING: &str = "sink.postgres.connection";

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl Mode {
    fn parse(value: &str) -> Result<Mode> {
        Ok(match value {
            "disable" => Mode::Disable,
            "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            // libpq's `allow` tries without TLS first; nothing here needs it.
            other => return Err(plan(format!("sslmode={other}: expected disable, prefer, require, verify-ca or verify-full"))),
        })
    }

    /// What tokio-postgres is told: whether TLS may, or must, be used.
    fn tokio_mode(self) -> SslMode {
        match self {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Disable => "disable",
            Mode::Prefer => "prefer",
            Mode::Require => "require",
            Mode::VerifyCa => "verify-ca",
            Mode::VerifyFull => "verify-full",
        })
    }
}

/// The TLS settings of a connection string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tls {
    pub mode: Mode,
    pub root_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

fn plan(message: String) -> Error {
    Error::Plan { context: SETTING.into(), message }
}

/// Splits a libpq connection string (`key=value …` or a `postgresql://`
/// URL) into what tokio-postgres reads and the TLS settings. The first
/// part keeps every other setting as written.
pub fn split(connection: &str) -> Result<(String, Tls)> {
    let trimmed = connection.trim_start();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        split_url(trimmed)
    } else {
        split_key_values(connection)
    }
}

impl Tls {
    fn set(&mut self, key: &str, value: String) -> Result<()> {
        match key {
            "sslmode" => self.mode = Mode::parse(&value)?,
            "sslrootcert" => self.root_cert = Some(value.into()),
            "sslcert" => self.client_cert = Some(value.into()),
            "sslkey" => self.client_key = Some(value.into()),
            _ => unreachable!("only TLS keys are set"),
        }
        Ok(())
    }

    /// The mode tokio-postgres is configured with.
    pub fn tokio_mode(&self) -> SslMode {
        self.mode.tokio_mode()
    }

    /// The rustls configuration of these settings, or `None` for
    /// `sslmode=disable`. Reads the certificate files.
    pub fn client_config(&self) -> Result<Option<ClientConfig>> {
        if self.mode == Mode::Disable {
            return Ok(None);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| plan(format!("TLS: {e}")))?;
        let roots = self.root_cert.as_deref().map(read_roots).transpose()?;
        let builder = match (self.mode, roots) {
            (Mode::VerifyFull, Some(roots)) => builder.with_root_certificates(roots),
            (_, Some(roots)) => {
                let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| plan(format!("sslrootcert: {e}")))?;
                builder.dangerous().with_custom_certificate_verifier(Arc::new(SignedByRoot(webpki)))
            }
            (Mode::VerifyCa | Mode::VerifyFull, None) => {
                return Err(plan(format!(
                    "sslmode={} checks the server's certificate, so it needs sslrootcert=FILE: the CA certificates (PEM) to check it against",
                    self.mode
                )))
            }
            (_, None) => builder.dangerous().with_custom_certificate_verifier(Arc::new(Unchecked(provider))),
        };
        let config = match (&self.client_cert, &self.client_key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert, "sslcert")?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| plan(format!("sslkey={}: no private key could be read from it (PEM expected): {e}", key.display())))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| plan(format!("sslcert/sslkey: {e}")))?
            }
            (Some(_), None) => return Err(plan("sslcert is set without sslkey: a client certificate needs its private key".into())),
            (None, Some(_)) => return Err(plan("sslkey is set without sslcert: a private key needs its client certificate".into())),
        };
        Ok(Some(config))
    }
}

fn read_certs(path: &Path, setting: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| plan(format!("{setting}={}: cannot be read as PEM certificates: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(plan(format!("{setting}={}: holds no certificate (PEM `BEGIN CERTIFICATE` blocks expected)", path.display())));
    }
    Ok(certs)
}

fn read_roots(path: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path, "sslrootcert")? {
        roots.add(cert).map_err(|e| plan(format!("sslrootcert={}: a certificate is not a usable CA: {e}", path.display())))?;
    }
    Ok(roots)
}

/// `verify-ca`, and `prefer`/`require` with `sslrootcert`: the chain must
/// lead to a given CA; the name in the certificate is not compared with
/// the host (libpq's meaning).
#[derive(Debug)]
struct SignedByRoot(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for SignedByRoot {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. })) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without `sslrootcert`: encrypted, the
/// certificate not checked, as libpq does. The handshake's signatures are
/// still verified, so the session is bound to the certificate presented.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(&self, _: &CertificateDer<'_>, _: &[CertificateDer<'_>], _: &ServerName<'_>, _: &[u8], _: UnixTime) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Whether a connection failed because this client refused the server's
/// certificate (rustls' error, somewhere down the error's sources).
pub fn refused_certificate(e: &tokio_postgres::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        let rustls_error = s.downcast_ref::<rustls::Error>().or_else(|| s.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()).and_then(|inner| inner.downcast_ref::<rustls::Error>()));
        if matches!(rustls_error, Some(rustls::Error::InvalidCertificate(_))) {
            return true;
        }
        source = s.source();
    }
    false
}

const TLS_KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// `postgresql://user@host:port/db?sslmode=verify-full&sslrootcert=/ca.pem`:
/// the TLS parameters leave the query, the rest stays as written.
fn split_url(url: &str) -> Result<(String, Tls)> {
    let mut tls = Tls::default();
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), tls));
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if TLS_KEYS.contains(&key) {
            let value: String = url::form_urlencoded::parse(format!("v={value}").as_bytes()).map(|(_, v)| v.into_owned()).next().unwrap_or_default();
            tls.set(key, value)?;
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    Ok((rest, tls))
}

/// `host=h port=5432 sslmode='verify-full' …`, with libpq's quoting:
/// a value is a run of non-space characters or single-quoted, and `\`
/// escapes the next character in either. The kept pairs are written back
/// quoted, which tokio-postgres reads the same way.
fn split_key_values(text: &str) -> Result<(String, Tls)> {
    let mut tls = Tls::default();
    let mut kept = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(plan(format!("`{key}` has no `=value` (expected key=value pairs separated by spaces)")));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\'') => break,
                    Some('\\') => value.extend(chars.next()),
                    Some(c) => value.push(c),
                    None => return Err(plan(format!("the value of `{key}` opens a quote that is never closed"))),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        if TLS_KEYS.contains(&key.as_str()) {
            tls.set(&key, value)?;
        } else {
            kept.push(format!("{key}='{}'", value.replace('\\', "\\\\").replace('\'', "\\'")));
        }
    }
    Ok((kept.join(" "), tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_leave_a_key_value_string_and_the_rest_is_kept() {
        let (rest, tls) = split("host=db.example port=5432 sslmode=verify-full sslrootcert='/etc/ca dir/ca.pem' user=weir").unwrap();
        assert_eq!(rest, "host='db.example' port='5432' user='weir'");
        assert_eq!(tls.mode, Mode::VerifyFull);
        assert_eq!(tls.root_cert.as_deref(), Some(Path::new("/etc/ca dir/ca.pem")));
        let config: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(config.get_user(), Some("weir"));
    }

    #[test]
    fn quotes_and_backslashes_in_kept_values_survive_the_round_trip() {
        let (rest, _) = split(r"application_name='it\'s a \\ job' dbname = weir").unwrap();
        let config: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(config.get_application_name(), Some(r"it's a \ job"));
        assert_eq!(config.get_dbname(), Some("weir"));
    }

    #[test]
    fn tls_settings_leave_a_url_and_the_rest_of_its_query_is_kept() {
        let (rest, tls) = split("postgresql://weir@db:5432/weir?sslmode=verify-ca&application_name=w&sslrootcert=%2Fca.pem").unwrap();
        assert_eq!(rest, "postgresql://weir@db:5432/weir?application_name=w");
        assert_eq!(tls.mode, Mode::VerifyCa);
        assert_eq!(tls.root_cert.as_deref(), Some(Path::new("/ca.pem")));
        let (rest, tls) = split("postgres://db/weir").unwrap();
        assert_eq!((rest.as_str(), tls.mode), ("postgres://db/weir", Mode::Prefer));
    }

    #[test]
    fn an_unknown_sslmode_or_a_broken_string_is_an_error_naming_the_setting() {
        let e = split("host=db sslmode=strict").unwrap_err().to_string();
        assert!(e.contains("sink.postgres.connection") && e.contains("sslmode=strict") && e.contains("verify-full"), "{e}");
        let e = split("host=db dbname='weir").unwrap_err().to_string();
        assert!(e.contains("quote") && e.contains("dbname"), "{e}");
        let e = split("host=db weir").unwrap_err().to_string();
        assert!(e.contains("`weir` has no `=value`"), "{e}");
    }

    #[test]
    fn verifying_modes_without_a_root_certificate_are_refused_before_connecting() {
        let (_, tls) = split("host=db sslmode=verify-full").unwrap();
        let e = tls.client_config().unwrap_err().to_string();
        assert!(e.contains("sslmode=verify-full") && e.contains("sslrootcert"), "{e}");
        let (_, tls) = split("host=db sslmode=require sslcert=/c.pem").unwrap();
        let e = tls.client_config().unwrap_err().to_string();
        assert!(e.contains("sslcert is set without sslkey"), "{e}");
    }

    #[test]
    fn a_missing_root_certificate_file_is_named() {
        let (_, tls) = split("host=db sslmode=verify-ca sslrootcert=/nonexistent/ca.pem").unwrap();
        let e = tls.client_config().unwrap_err().to_string();
        assert!(e.contains("sslrootcert=/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn disable_needs_no_tls_configuration_and_require_needs_no_files() {
        let (_, tls) = split("host=db sslmode=disable").unwrap();
        assert!(tls.client_config().unwrap().is_none());
        assert_eq!(tls.tokio_mode(), SslMode::Disable);
        let (_, tls) = split("host=db sslmode=require").unwrap();
        assert!(tls.client_config().unwrap().is_some());
        assert_eq!(tls.tokio_mode(), SslMode::Require);
    }
}
