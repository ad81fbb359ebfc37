//! A real S3 server for the storage tests: MinIO built from its Go module by
//! `e2e/build-binaries minio`, started on a free loopback port with its data
//! in a temporary directory, one per test, and stopped when the test's last
//! handle to it is dropped. Tests talk to it with curl's SigV4 signing, as a
//! user would with any S3 client; weir talks to it through object_store.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use super::server_process::ServerProcess;

pub const ACCESS_KEY: &str = "weir-test";
pub const SECRET_KEY: &str = "weir-test-secret-9f3c";

/// The MinIO binary: `$WEIR_MINIO`, else the newest under the build cache.
fn binary() -> PathBuf {
    super::server_process::cached_program("WEIR_MINIO", "k8s", "minio-", "bin/minio", "e2e/build-binaries minio")
}

/// Starts MinIO on `p.port` and waits until it answers as ours.
fn spawn(p: &mut ServerProcess) -> Result<(), String> {
    let mut command = Command::new(binary());
    command
        .args(["server", "--quiet", "--address"])
        .arg(format!("127.0.0.1:{}", p.port))
        .arg(p.data.path())
        .env("MINIO_ROOT_USER", ACCESS_KEY)
        .env("MINIO_ROOT_PASSWORD", SECRET_KEY)
        .env("MINIO_BROWSER", "off")
        .env("MINIO_UPDATE", "off");
    p.run_until_ready(command, "MinIO", |port| {
        Command::new("curl")
            .args(["-sf", "-o", "/dev/null"])
            .arg(format!("http://127.0.0.1:{port}/minio/health/ready"))
            .status()
            .is_ok_and(|s| s.success())
    })?;
    check_identity(p)
}

/// Whether the server answering on our port is ours: a bucket created
/// through it must appear in our data directory. A server that is
/// alive but still waiting for the port (another test's server holds
/// it) would otherwise pass the health check with the other's answer
/// (seen: a job that found no bucket at its first request).
fn check_identity(p: &mut ServerProcess) -> Result<(), String> {
    let probe = format!("identity-{:08x}", rand::random::<u32>());
    let endpoint = format!("http://127.0.0.1:{}", p.port);
    let made = curl(&endpoint, &["-f", "-X", "PUT"], &format!("/{probe}")).status.success();
    let ours = made && p.data.path().join(&probe).is_dir();
    let _ = curl(&endpoint, &["-X", "DELETE"], &format!("/{probe}"));
    if ours {
        return Ok(());
    }
    p.stop();
    Err(format!("the server answering on port {} is not ours (its bucket is not in our data directory)", p.port))
}

/// A running MinIO.
#[derive(Clone)]
pub struct Server {
    process: Arc<Mutex<ServerProcess>>,
    pub endpoint: String,
}

impl Server {
    pub fn start() -> Server {
        let process = ServerProcess::start(spawn);
        let endpoint = format!("http://127.0.0.1:{}", process.port);
        Server { process: Arc::new(Mutex::new(process)), endpoint }
    }

    /// Stops the server (SIGKILL: what a crash or a lost node looks like to clients).
    pub fn stop(&self) {
        self.process.lock().unwrap().stop();
    }

    /// Starts it again on the same port and data.
    pub fn restart(&self) {
        let mut p = self.process.lock().unwrap();
        p.stop();
        if let Err(e) = spawn(&mut p) {
            panic!("restarting: {e}");
        }
    }

    /// Creates a bucket and returns it.
    pub fn bucket(&self, name: &str) -> Bucket {
        let out = curl(&self.endpoint, &["-X", "PUT"], &format!("/{name}"));
        assert!(out.status.success(), "creating bucket {name}: {}", String::from_utf8_lossy(&out.stderr));
        Bucket { server: self.clone(), name: name.into() }
    }
}

/// A bucket of a running server.
#[derive(Clone)]
pub struct Bucket {
    pub server: Server,
    pub name: String,
}

impl Bucket {
    /// `s3://bucket/key`.
    pub fn url(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.name)
    }

    /// The key of an `s3://` URL of this bucket.
    pub fn key_of<'a>(&self, url: &'a str) -> &'a str {
        url.strip_prefix(&format!("s3://{}/", self.name)).expect("a URL of this bucket")
    }

    /// What `weir` needs to reach the server.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("WEIR_S3_ENDPOINT", self.server.endpoint.as_str()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", "us-east-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The object at `key`, if there is one.
    pub fn get(&self, key: &str) -> Option<String> {
        let out = curl(&self.server.endpoint, &["-f"], &format!("/{}/{key}", self.name));
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).to_string())
    }

    /// Writes an object.
    pub fn put(&self, key: &str, body: &str) {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), body).unwrap();
        let path = file.path().to_str().unwrap();
        let out = curl(&self.server.endpoint, &["-f", "-T", path], &format!("/{}/{key}", self.name));
        assert!(out.status.success(), "writing {key}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// The keys under `prefix`, sorted.
    pub fn list(&self, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            // Query values percent-encoded, as SigV4's canonical request has them.
            let mut query = format!("/{}?list-type=2&prefix={}", self.name, prefix.replace('/', "%2F"));
            if let Some(t) = &token {
                query.push_str(&format!("&continuation-token={}", t.replace('+', "%2B").replace('/', "%2F").replace('=', "%3D")));
            }
            let out = curl(&self.server.endpoint, &["-f"], &query);
            assert!(out.status.success(), "listing {prefix}: {}", String::from_utf8_lossy(&out.stderr));
            let xml = String::from_utf8_lossy(&out.stdout).to_string();
            keys.extend(between_all(&xml, "<Key>", "</Key>"));
            token = between_all(&xml, "<NextContinuationToken>", "</NextContinuationToken>").pop();
            if token.is_none() {
                break;
            }
        }
        keys.sort();
        keys
    }
}

impl Bucket {
    /// The keys of the multipart uploads under `prefix` that were neither
    /// completed nor aborted (what S3 bills for and a lifecycle rule would
    /// have to clean up). MinIO matches `prefix` as a whole key only.
    pub fn open_uploads(&self, prefix: &str) -> Vec<String> {
        // Query parameters sorted: curl signs them in the order given.
        let out = curl(&self.server.endpoint, &["-f"], &format!("/{}?prefix={}&uploads=", self.name, prefix.replace('/', "%2F")));
        assert!(out.status.success(), "listing uploads under {prefix}: {}", String::from_utf8_lossy(&out.stderr));
        between_all(&String::from_utf8_lossy(&out.stdout), "<Key>", "</Key>")
    }
}

fn between_all(text: &str, open: &str, close: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(open) {
        rest = &rest[i + open.len()..];
        let Some(j) = rest.find(close) else { break };
        out.push(rest[..j].replace("&amp;", "&"));
        rest = &rest[j + close.len()..];
    }
    out
}

/// One signed request to the server.
fn curl(endpoint: &str, extra: &[&str], path: &str) -> std::process::Output {
    Command::new("curl")
        .args(["-sS", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user"])
        .arg(format!("{ACCESS_KEY}:{SECRET_KEY}"))
        .args(extra)
        .arg(format!("{endpoint}{path}"))
        .output()
        .expect("running curl")
}
