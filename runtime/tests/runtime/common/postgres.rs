//! A real PostgreSQL for the sink tests: Debian's server binaries, a
//! throwaway cluster (`initdb`) in a temporary directory on a free loopback
//! port, one per test, stopped and deleted when the test drops it. Password
//! authentication over TCP, as a database a job writes to would have; tests
//! read tables with `psql`, as a user would.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const USER: &str = "weir";
pub const PASSWORD: &str = "weir-pg-secret-41d7";
pub const DATABASE: &str = "weir";

/// The server's binaries: `$WEIR_PG_BIN`, else the newest Debian installs.
fn bin_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("WEIR_PG_BIN") {
        return p.into();
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_string_lossy().parse().ok()?, e.path().join("bin"))))
        .filter(|(_, p)| p.join("initdb").exists())
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p).unwrap_or_else(|| panic!("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): scripts/test installs Debian's `postgresql`, or set WEIR_PG_BIN"))
}

/// initdb and the server refuse to run as root: as root, they run as nobody.
fn as_server_user(program: PathBuf) -> Command {
    if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// The certificates of [`Server::start_tls`], made with the `openssl` tool.
pub struct Certificates {
    /// The CA that signed the server's certificate (PEM).
    pub ca: PathBuf,
    /// A CA that signed nothing of this server.
    pub other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

impl Certificates {
    fn create(dir: &std::path::Path) -> Certificates {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl").args(args).current_dir(dir).output().expect("running openssl (scripts/test installs it)");
            assert!(out.status.success(), "openssl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        for ca in ["ca", "other-ca"] {
            let (key, pem, subj) = (format!("{ca}.key"), format!("{ca}.pem"), format!("/CN=weir test {ca}"));
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &pem, "-days", "3", "-subj", &subj]);
            args.extend(["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
            openssl(&args);
        }
        let mut args = vec!["req"];
        args.extend(ec);
        args.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]);
        openssl(&args);
        std::fs::write(dir.join("server.ext"), "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n").unwrap();
        openssl(&["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.pem", "-days", "3", "-extfile", "server.ext"]);
        // The server refuses a key others can read, and runs as nobody when
        // the tests run as root.
        let key = dir.join("server.key");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&key, Some(65534), Some(65534)).unwrap();
        }
        Certificates { ca: dir.join("ca.pem"), other_ca: dir.join("other-ca.pem"), server_cert: dir.join("server.pem"), server_key: key }
    }
}

pub struct Server {
    dir: tempfile::TempDir,
    pub port: u16,
    child: Option<Child>,
}

impl Server {
    /// A server that allows prepared transactions (two-phase commit).
    pub fn start() -> Server {
        Server::start_with(&["-c", "max_prepared_transactions=64"])
    }

    /// A server with extra `postgres` arguments (`-c name=value`).
    pub fn start_with(settings: &[&str]) -> Server {
        Server::start_in(tempfile::tempdir().unwrap(), settings, None)
    }

    /// A server that takes TCP connections only over TLS (`hostssl` in
    /// pg_hba.conf; a plain connection is rejected), with a certificate for
    /// the name `localhost` only (not for 127.0.0.1) signed by
    /// [`Certificates::ca`].
    pub fn start_tls() -> (Server, Certificates) {
        let dir = tempfile::tempdir().unwrap();
        let certs = Certificates::create(&dir.path().join("tls"));
        let settings = [
            "-c".to_string(),
            "max_prepared_transactions=64".into(),
            "-c".into(),
            "ssl=on".into(),
            "-c".into(),
            format!("ssl_cert_file={}", certs.server_cert.display()),
            "-c".into(),
            format!("ssl_key_file={}", certs.server_key.display()),
        ];
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\nhostnossl all all 127.0.0.1/32 reject\n";
        (Server::start_in(dir, &settings, Some(hba)), certs)
    }

    fn start_in(dir: tempfile::TempDir, settings: &[&str], hba: Option<&str>) -> Server {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, PASSWORD).unwrap();
        std::fs::set_permissions(&pwfile, std::fs::Permissions::from_mode(0o644)).unwrap();
        let data = dir.path().join("data");
        let out = as_server_user(bin_dir().join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args(["-U", USER, "--auth-host=scram-sha-256", "--auth-local=trust", "--no-sync", "-E", "UTF8", "--locale=C"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .output()
            .expect("running initdb");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        if let Some(hba) = hba {
            std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        }
        let mut server = Server { dir, port: 0, child: None };
        for _ in 0..5 {
            server.port = super::free_port();
            let child = as_server_user(bin_dir().join("postgres"))
                .arg("-D")
                .arg(&data)
                .args(["-p", &server.port.to_string(), "-k"])
                .arg(server.dir.path())
                .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
                .args(settings)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting postgres");
            server.child = Some(child);
            if server.wait_ready() {
                server.psql(&format!("CREATE DATABASE {DATABASE}"));
                return server;
            }
            server.stop();
        }
        panic!("PostgreSQL did not start on any of 5 ports");
    }

    fn wait_ready(&mut self) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some()) {
                return false;
            }
            let ok = Command::new(bin_dir().join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGQUIT: immediate shutdown, the children go with the postmaster.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGQUIT);
            }
            let _ = c.wait();
        }
    }

    /// The sink's `connection` setting for this server (no password).
    pub fn connection(&self) -> String {
        format!("host=127.0.0.1 port={} dbname={DATABASE} user={USER}", self.port)
    }

    /// The environment a job needs to log in.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![("PGPASSWORD".into(), PASSWORD.into())]
    }

    /// Runs SQL with psql over TCP in the job's database (the `postgres`
    /// database for `CREATE DATABASE`) and returns its unaligned output;
    /// panics on any error.
    pub fn psql(&self, sql: &str) -> String {
        let out = self.try_psql(sql);
        match out {
            Ok(text) => text,
            Err(e) => panic!("psql {sql:?} failed: {e}"),
        }
    }

    pub fn try_psql(&self, sql: &str) -> Result<String, String> {
        try_psql_at(self.port, sql)
    }

    /// Every row of `table` as a JSON object.
    pub fn rows(&self, table: &str) -> Vec<serde_json::Value> {
        rows_at(self.port, table)
    }

    /// The global ids of the prepared transactions still waiting.
    pub fn prepared(&self) -> Vec<String> {
        self.psql("SELECT gid FROM pg_prepared_xacts").lines().filter(|l| !l.is_empty()).map(String::from).collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// [`Server::try_psql`] for the server on `port`.
pub fn try_psql_at(port: u16, sql: &str) -> Result<String, String> {
    let db = if sql.starts_with("CREATE DATABASE") { "postgres" } else { DATABASE };
    let out = Command::new(bin_dir().join("psql"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", USER, "-d", db, "-v", "ON_ERROR_STOP=1", "-X", "-A", "-t", "-c", sql])
        .env("PGPASSWORD", PASSWORD)
        .output()
        .expect("running psql");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).to_string())
    }
}

/// [`Server::rows`] for the server on `port`.
pub fn rows_at(port: u16, table: &str) -> Vec<serde_json::Value> {
    let text = try_psql_at(port, &format!("SELECT row_to_json(t) FROM {table} t")).unwrap_or_else(|e| panic!("reading {table}: {e}"));
    text.lines().filter(|l| !l.is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
}
