//! S3 and S3-compatible object stores (MinIO, Ceph, R2) for checkpoint and
//! savepoint storage: `s3://bucket/prefix`.
//!
//! Where the store is (endpoint, region, addressing style) is a setting of
//! the process, given once by `weir` flags or `WEIR_S3_*` variables and the
//! same for every location it opens, because a job keeps all its snapshots
//! in one store and the operator starts every worker with the same settings.
//!
//! Credentials are deliberately not settings: they come only from the
//! environment the way the AWS SDKs take them (`AWS_ACCESS_KEY_ID` and
//! `AWS_SECRET_ACCESS_KEY`, a web identity token for IRSA-style roles, the
//! container or instance metadata endpoints), so they never appear on a
//! command line, in a pod spec's arguments, in status or in an error.

use std::sync::OnceLock;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::ClientOptions;

/// Where the S3 store of this process is. Every field is optional: without
/// any, `s3://` locations reach AWS S3 in the region of the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct S3Settings {
    /// `http(s)://host:port` of an S3-compatible server; AWS when absent.
    pub endpoint: Option<String>,
    /// The region to sign requests for (`AWS_REGION` when absent, then us-east-1).
    pub region: Option<String>,
    /// `https://host/bucket/key` (true) or `https://bucket.host/key` (false).
    /// Path style is what MinIO and most S3-compatible servers expect.
    pub path_style: bool,
}

/// The variables AWS tools read an endpoint from, the S3-specific one first
/// (as the AWS SDKs and CLI do); `AWS_ENDPOINT` is object_store's own.
pub const ENDPOINT_VARIABLES: [&str; 3] = ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"];

/// Checks an endpoint given by `setting` (a flag or a variable, which the
/// message names so that the user knows what to change).
fn validate_endpoint(e: &str, setting: &str) -> Result<(), String> {
    let url = url::Url::parse(e).map_err(|err| format!("S3 endpoint ({setting}) {e:?} is not a URL: {err}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(format!("S3 endpoint ({setting}) {e:?}: expected http://HOST[:PORT] or https://HOST[:PORT]"));
    }
    if url.path() != "/" && !url.path().is_empty() {
        return Err(format!("S3 endpoint ({setting}) {e:?} has a path; the bucket and prefix belong in the s3:// location"));
    }
    Ok(())
}

impl S3Settings {
    /// Without an endpoint of weir's own, the one the standard AWS variables
    /// name (see [`ENDPOINT_VARIABLES`]), so that a shell or pod set up for the
    /// AWS CLI against MinIO works as it is. `var` reads the environment.
    pub fn with_standard_endpoint(mut self, var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        if self.endpoint.is_some() {
            return Ok(self);
        }
        for name in ENDPOINT_VARIABLES {
            if let Some(e) = var(name).filter(|e| !e.is_empty()) {
                validate_endpoint(&e, name)?;
                self.endpoint = Some(e);
                break;
            }
        }
        Ok(self)
    }

    /// Checks the settings a user gave; the message names the flag's variable.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(e) = &self.endpoint {
            validate_endpoint(e, "--s3-endpoint / WEIR_S3_ENDPOINT")?;
        }
        if let Some(r) = &self.region {
            if r.is_empty() || !r.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                return Err(format!("S3 region (--s3-region / WEIR_S3_REGION) {r:?}: expected a region name such as us-east-1"));
            }
        }
        Ok(())
    }

    /// The arguments that give a child process these settings.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(e) = &self.endpoint {
            args.extend(["--s3-endpoint".to_string(), e.clone()]);
        }
        if let Some(r) = &self.region {
            args.extend(["--s3-region".to_string(), r.clone()]);
        }
        args.push(format!("--s3-path-style={}", self.path_style));
        args
    }
}

static SETTINGS: OnceLock<S3Settings> = OnceLock::new();

/// Sets this process's S3 settings; the first call wins (the `weir` command
/// calls it once, before it opens any location).
pub fn configure(settings: S3Settings) -> Result<(), String> {
    settings.validate()?;
    let settings = settings.with_standard_endpoint(|name| std::env::var(name).ok())?;
    let _ = SETTINGS.set(settings);
    Ok(())
}

/// This process's S3 settings (path style and nothing else when never configured).
pub fn settings() -> S3Settings {
    SETTINGS.get().cloned().unwrap_or(S3Settings { path_style: true, ..Default::default() })
}

/// The S3 client of `url` (`s3://bucket/...`). Requests are retried as
/// every store's are ([`super::stores::retry`]).
pub(crate) fn amazon_s3(url: &url::Url) -> Result<AmazonS3, String> {
    let s = settings();
    let mut builder = AmazonS3Builder::from_env()
        .with_url(url.as_str())
        .with_virtual_hosted_style_request(!s.path_style)
        .with_retry(super::stores::retry())
        .with_client_options(ClientOptions::new().with_connect_timeout(Duration::from_secs(5)).with_timeout(Duration::from_secs(60)));
    if let Some(e) = &s.endpoint {
        builder = builder.with_endpoint(e).with_allow_http(e.starts_with("http://"));
    }
    if let Some(r) = &s.region {
        builder = builder.with_region(r);
    } else if std::env::var_os("AWS_REGION").is_none() && std::env::var_os("AWS_DEFAULT_REGION").is_none() {
        builder = builder.with_region("us-east-1");
    }
    // The builder's errors name the setting that is wrong, never a secret.
    builder.build().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_with_a_path_is_refused_naming_the_setting() {
        let s = S3Settings { endpoint: Some("http://127.0.0.1:9000/bucket".into()), ..Default::default() };
        let err = s.validate().unwrap_err();
        assert!(err.contains("WEIR_S3_ENDPOINT") && err.contains("has a path"), "{err}");
    }

    #[test]
    fn endpoint_must_be_http_or_https() {
        for bad in ["127.0.0.1:9000", "ftp://host", "not a url"] {
            let s = S3Settings { endpoint: Some(bad.into()), ..Default::default() };
            assert!(s.validate().is_err(), "{bad} was accepted");
        }
        let ok = S3Settings { endpoint: Some("http://[::1]:9000".into()), region: Some("eu-west-1".into()), path_style: true };
        ok.validate().unwrap();
    }

    #[test]
    fn the_standard_aws_endpoint_variables_are_used_s3_specific_first_and_weirs_own_wins() {
        let env = |pairs: &'static [(&'static str, &'static str)]| move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
        let none = S3Settings::default();
        let got = none.clone().with_standard_endpoint(env(&[("AWS_ENDPOINT_URL", "http://minio:9000"), ("AWS_ENDPOINT_URL_S3", "http://s3only:9000")])).unwrap();
        assert_eq!(got.endpoint.as_deref(), Some("http://s3only:9000"));
        let got = none.clone().with_standard_endpoint(env(&[("AWS_ENDPOINT", "http://old:9000"), ("AWS_ENDPOINT_URL_S3", "")])).unwrap();
        assert_eq!(got.endpoint.as_deref(), Some("http://old:9000"));
        let own = S3Settings { endpoint: Some("http://weir:9000".into()), ..Default::default() };
        assert_eq!(own.clone().with_standard_endpoint(env(&[("AWS_ENDPOINT_URL", "http://minio:9000")])).unwrap(), own);
        assert_eq!(none.clone().with_standard_endpoint(env(&[])).unwrap(), none);
    }

    #[test]
    fn a_bad_standard_endpoint_variable_is_refused_naming_it() {
        let err = S3Settings::default().with_standard_endpoint(|n| (n == "AWS_ENDPOINT_URL").then(|| "minio:9000".to_string())).unwrap_err();
        assert!(err.contains("(AWS_ENDPOINT_URL)") && err.contains("expected http://HOST[:PORT]"), "{err}");
    }

    #[test]
    fn settings_survive_the_trip_to_a_child_process_as_arguments() {
        let s = S3Settings { endpoint: Some("http://10.0.0.1:9000".into()), region: Some("local".into()), path_style: false };
        assert_eq!(s.to_args(), ["--s3-endpoint", "http://10.0.0.1:9000", "--s3-region", "local", "--s3-path-style=false"]);
    }
}
