//! A real Azure Blob Storage emulator for the storage tests: Azurite,
//! installed from npm by `scripts/install-azurite` (scripts/test runs it),
//! started on a free loopback port with its data in a temporary directory,
//! one per test, and stopped when the test's last handle to it is dropped.
//!
//! weir reaches it the way it reaches Azure: an account name, its key and
//! the blob endpoint in the standard AZURE_* variables, requests signed
//! with the key. The tests read what weir wrote through `object_store`'s
//! Azure client, which signs the same way; only the container is created
//! by a request signed here, since no store client creates containers.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::azure::{MicrosoftAzure, MicrosoftAzureBuilder};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use super::server_process::ServerProcess;

/// Azurite's one account and its well-known key (public: Azurite's documentation prints it).
pub const ACCOUNT: &str = "devstoreaccount1";
pub const KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// `azurite-blob`: `$WEIR_AZURITE`, else the newest under the build cache.
fn binary() -> PathBuf {
    super::server_process::cached_program("WEIR_AZURITE", "npm", "azurite-", "node_modules/.bin/azurite-blob", "scripts/install-azurite")
}

/// Starts Azurite on `p.port` and waits until it listens.
fn spawn(p: &mut ServerProcess) -> Result<(), String> {
    let mut command = Command::new(binary());
    command
        .args(["--blobHost", "127.0.0.1", "--blobPort", &p.port.to_string(), "--silent", "--skipApiVersionCheck", "--location"])
        .arg(p.data.path());
    p.run_until_ready(command, "Azurite", |port| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
}

/// A running Azurite.
#[derive(Clone)]
pub struct Server {
    process: Arc<Mutex<ServerProcess>>,
    /// The account's blob endpoint, `http://127.0.0.1:PORT/devstoreaccount1`.
    pub endpoint: String,
}

impl Server {
    pub fn start() -> Server {
        let process = ServerProcess::start(spawn);
        let endpoint = format!("http://127.0.0.1:{}/{ACCOUNT}", process.port);
        Server { process: Arc::new(Mutex::new(process)), endpoint }
    }

    /// Creates a container and returns it.
    pub fn container(&self, name: &str) -> Container {
        // Azurite may accept connections a moment before it serves requests.
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let out = create_container(&self.endpoint, name);
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if text.trim() == "201" {
                break;
            }
            assert!(Instant::now() < until, "creating container {name}: HTTP {text} {}", String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(200));
        }
        Container { server: self.clone(), name: name.into() }
    }
}

/// One `Create Container` request, signed with the account key (Shared Key).
fn create_container(endpoint: &str, name: &str) -> std::process::Output {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    let version = "2021-08-06";
    // Verb, eleven empty standard headers, the x-ms- headers, then the
    // resource: the account and the URL's path, then its query.
    let to_sign = format!("PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container");
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &b64.decode(KEY).unwrap());
    let signature = b64.encode(ring::hmac::sign(&key, to_sign.as_bytes()).as_ref());
    Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT", "-H", "Content-Length: 0"])
        .args(["-H", &format!("x-ms-date: {date}"), "-H", &format!("x-ms-version: {version}")])
        .args(["-H", &format!("Authorization: SharedKey {ACCOUNT}:{signature}")])
        .arg(format!("{endpoint}/{name}?restype=container"))
        .output()
        .expect("running curl")
}

/// A container of a running server.
#[derive(Clone)]
pub struct Container {
    pub server: Server,
    pub name: String,
}

impl Container {
    /// `az://container/key`.
    pub fn url(&self, key: &str) -> String {
        format!("az://{}/{key}", self.name)
    }

    /// The key of an `az://` URL of this container.
    pub fn key_of<'a>(&self, url: &'a str) -> &'a str {
        url.strip_prefix(&format!("az://{}/", self.name)).expect("a URL of this container")
    }

    /// What `weir` needs to reach the server: the variables a pod or a
    /// shell set up for Azure tools has, with the account key `key`.
    pub fn env_with_key(&self, key: &str) -> Vec<(String, String)> {
        [
            ("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT),
            ("AZURE_STORAGE_ACCOUNT_KEY", key),
            ("AZURE_STORAGE_ENDPOINT", self.server.endpoint.as_str()),
            ("AZURE_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    pub fn env(&self) -> Vec<(String, String)> {
        self.env_with_key(KEY)
    }

    fn client(&self) -> MicrosoftAzure {
        MicrosoftAzureBuilder::new()
            .with_account(ACCOUNT)
            .with_access_key(KEY)
            .with_container_name(&self.name)
            .with_endpoint(self.server.endpoint.clone())
            .with_allow_http(true)
            .build()
            .expect("an Azure client for Azurite")
    }

    fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    }

    /// The blob at `key`, if there is one.
    pub fn get(&self, key: &str) -> Option<String> {
        let client = self.client();
        self.block_on(async {
            match client.get(&Path::from(key)).await {
                Ok(got) => Some(String::from_utf8_lossy(&got.bytes().await.expect("reading a blob")).to_string()),
                Err(object_store::Error::NotFound { .. }) => None,
                Err(e) => panic!("reading {key}: {e}"),
            }
        })
    }

    /// The keys under `prefix`, sorted.
    pub fn list(&self, prefix: &str) -> Vec<String> {
        use futures::TryStreamExt;
        let client = self.client();
        let mut keys: Vec<String> = self.block_on(async {
            let prefix = Path::from(prefix.trim_end_matches('/'));
            client.list(Some(&prefix)).map_ok(|m| m.location.to_string()).try_collect().await.expect("listing blobs")
        });
        keys.sort();
        keys
    }
}
