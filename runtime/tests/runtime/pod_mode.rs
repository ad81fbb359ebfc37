//! `weir worker` in pod mode, as the operator drives it: the workers start
//! without peers, serve their control endpoints on their own (loopback) IPs
//! and standard ports, get their membership by HTTP, and are restored by
//! starting a new set with `--restore`. Each test uses its own 127.42.x.0/24
//! addresses so that tests can run in parallel.

use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use weir_api::control::{JobStatus, Membership, SavepointOutcome, SavepointState, CONTROL_PORT};

const TOKEN: &str = "pod-mode-test-token";

/// One set of worker processes ("pods") of one run; killed when dropped.
struct Pods {
    ips: Vec<IpAddr>,
    children: Vec<Option<Child>>,
    logs: Vec<std::path::PathBuf>,
    /// With `--tls-dir`: how the operator calls them (HTTPS, the CA and name).
    tls: Option<ControlTls>,
}

impl Pods {
    /// Starts one worker per IP (`127.42.<net>.<index + 1>`) in pod mode, for
    /// run `run_id` (passed as the operator does, in `WEIR_RUN_ID`).
    fn start(job: &Job, net: u8, run_id: &str, extra: &[&str]) -> Pods {
        let ips: Vec<IpAddr> = (0..2u8).map(|i| IpAddr::from([127, 42, net, i + 1])).collect();
        Pods::start_on(job, ips, &net.to_string(), run_id, extra)
    }

    /// Starts one worker per IP; `tag` names their logs.
    fn start_on(job: &Job, ips: Vec<IpAddr>, tag: &str, run_id: &str, extra: &[&str]) -> Pods {
        let mut children = Vec::new();
        let mut logs = Vec::new();
        for (i, ip) in ips.iter().enumerate() {
            let log = job.path(&format!("worker-{tag}-{i}.log"));
            let file = std::fs::File::create(&log).unwrap();
            let child = Command::new(WEIR)
                .current_dir(job.dir.path())
                .args(["worker", "--pipeline", "pipeline.yaml", "--index", &i.to_string()])
                // As the operator passes it: the pod's IP alone (the kubelet
                // expands $(POD_IP)); the port is the standard one.
                .args(["--control-addr", &ip.to_string()])
                .args(if extra.contains(&"--state-dir") { &[][..] } else { &["--state-dir", "state"][..] })
                .args(["--membership-timeout", "60s"])
                .args(extra)
                .env("WEIR_CONTROL_TOKEN", TOKEN)
                .env("WEIR_RUN_ID", run_id)
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(file)
                .spawn()
                .unwrap();
            children.push(Some(child));
            logs.push(log);
        }
        let tls = extra.iter().position(|a| *a == "--tls-dir").map(|i| {
            let name = extra.iter().position(|a| *a == "--tls-server-name").map(|n| extra[n + 1]).expect("--tls-server-name with --tls-dir");
            ControlTls::new(&job.dir.path().join(extra[i + 1]).join("ca.crt"), name)
        });
        let pods = Pods { ips, children, logs, tls };
        for i in 0..pods.ips.len() {
            pods.wait_healthy(i);
        }
        pods
    }

    fn control(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.ips[i], CONTROL_PORT)
    }

    /// One request to worker `i`'s control endpoint, as the operator makes it.
    fn http(&self, i: usize, method: &str, path: &str, body: Option<&str>) -> Option<(u16, String)> {
        match &self.tls {
            None => http(self.control(i), method, path, body),
            Some(tls) => tls.call(self.control(i), method, path, body),
        }
    }

    fn logs(&self) -> String {
        self.logs.iter().map(|l| format!("--- {}\n{}", l.display(), std::fs::read_to_string(l).unwrap_or_default())).collect()
    }

    fn wait_healthy(&self, i: usize) {
        let start = Instant::now();
        while self.http(i, "GET", "/healthz", None).map(|(c, _)| c) != Some(200) {
            assert!(start.elapsed() < Duration::from_secs(15), "worker {i} never became healthy:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn membership(&self, run_id: &str) -> Membership {
        Membership::of_pods(run_id, &self.ips).unwrap()
    }

    /// What the operator does once every pod has an IP.
    fn put_membership(&self, run_id: &str) {
        let body = serde_json::to_string(&self.membership(run_id)).unwrap();
        for i in 0..self.ips.len() {
            let (code, answer) = self.http(i, "PUT", "/v1/membership", Some(&body)).unwrap();
            assert_eq!(code, 200, "membership of worker {i}: {answer}");
        }
    }

    fn status(&self, i: usize) -> JobStatus {
        let (code, body) = self.http(i, "GET", "/v1/status", None).expect("status");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// The status of worker `i` once it has started its part of run `run_id`
    /// (it resolves `--restore` first).
    fn status_of_run(&self, i: usize, run_id: &str) -> JobStatus {
        let start = Instant::now();
        loop {
            let st = self.status(i);
            if st.run_id == run_id {
                return st;
            }
            assert!(start.elapsed() < Duration::from_secs(15), "worker {i} never started run {run_id}: {st:?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until worker 0 reports the job running with some records through.
    fn wait_running(&self, min_records: u64) {
        let start = Instant::now();
        loop {
            let st = self.status(0);
            if st.phase == "running" && st.records_in >= min_records {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "the job did not get going: {st:?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Takes a savepoint through the asynchronous API and returns its location.
    fn savepoint(&self, request_id: &str, stop: bool) -> String {
        let body = format!("{{\"request_id\": \"{request_id}\", \"stop\": {stop}}}");
        let (code, answer) = self.http(0, "POST", "/v1/savepoints", Some(&body)).unwrap();
        assert_eq!(code, 202, "{answer}");
        let start = Instant::now();
        loop {
            let (code, answer) = self.http(0, "GET", &format!("/v1/savepoints/{request_id}"), None).unwrap();
            assert_eq!(code, 200, "{answer}");
            let o: SavepointOutcome = serde_json::from_str(&answer).unwrap();
            match o.state {
                SavepointState::Completed => {
                    // Asking again returns the same savepoint instead of taking another.
                    let (code, again) = self.http(0, "POST", "/v1/savepoints", Some(&body)).unwrap();
                    assert_eq!(code, 202);
                    assert_eq!(serde_json::from_str::<SavepointOutcome>(&again).unwrap(), o);
                    return o.savepoint.expect("a completed savepoint has a location").location;
                }
                SavepointState::Failed => panic!("savepoint failed: {o:?}\n{}", self.logs()),
                SavepointState::Pending => {
                    assert!(start.elapsed() < Duration::from_secs(30), "savepoint still pending:\n{}", self.logs());
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) every process of the set, as a
    /// partitioned node or a paused VM does to a run.
    fn signal_all(&self, signal: i32) {
        for child in self.children.iter().flatten() {
            unsafe {
                libc::kill(child.id() as i32, signal);
            }
        }
    }

    fn pid(&self, i: usize) -> u32 {
        self.children[i].as_ref().expect("a running worker").id()
    }

    fn kill(&mut self, i: usize) -> ExitStatus {
        let mut child = self.children[i].take().unwrap();
        kill(child.id());
        child.wait().unwrap()
    }

    fn wait(&mut self, i: usize, limit: Duration) -> ExitStatus {
        let mut child = self.children[i].take().unwrap();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!("worker {i} did not exit within {limit:?}:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Both workers exit 0: the job finished.
    fn wait_finished(&mut self) {
        for i in 0..self.children.len() {
            let status = self.wait(i, Duration::from_secs(120));
            assert!(status.success(), "worker {i}: {status}\n{}", self.logs());
        }
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        for mut child in self.children.drain(..).flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The operator's side of a control endpoint with TLS: the job's CA and
/// the name its certificate carries.
struct ControlTls {
    connector: tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
}

impl ControlTls {
    fn new(ca: &std::path::Path, name: &str) -> ControlTls {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        ControlTls { connector: tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)), name: rustls::pki_types::ServerName::try_from(name.to_string()).unwrap() }
    }

    /// One HTTPS request; `None` when no TLS connection came about.
    fn call(&self, addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Option<(u16, String)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
            let mut s = tokio::time::timeout(Duration::from_secs(5), self.connector.connect(self.name.clone(), tcp)).await.ok()?.ok()?;
            let body = body.unwrap_or_default();
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            s.write_all(head.as_bytes()).await.ok()?;
            s.flush().await.ok()?;
            let mut answer = Vec::new();
            // A TLS peer that closes without close_notify is still an answer.
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
            let text = String::from_utf8_lossy(&answer).into_owned();
            let (head, body) = text.split_once("\r\n\r\n")?;
            let code = head.split_whitespace().nth(1)?.parse().ok()?;
            Some((code, body.to_string()))
        })
    }
}

/// A CA and a certificate it signed for `name` (server and client
/// authentication), written to `dir` as cert-manager lays out a Secret.
fn tls_dir(dir: &std::path::Path, name: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=weir test CA"]);
    std::fs::write(dir.join("ext.cnf"), format!("subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth,clientAuth\n")).unwrap();
    run(&["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=weir"]);
    run(&["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf"]);
}

/// One request with the runtime's own client.
fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Option<(u16, String)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(weir_runtime::control::call(addr, method, path, TOKEN, body.map(str::as_bytes), Duration::from_secs(5))).ok()
}

#[test]
fn pod_mode_workers_get_their_membership_over_http_and_finish_exactly_once() {
    let job = Job::counting(2, 20_000, 17, 0, "100ms");
    let mut pods = Pods::start(&job, 1, "pod-run-1", &[]);
    for i in 0..2 {
        let st = pods.status(i);
        assert_eq!((st.phase.as_str(), st.job.as_str()), ("awaiting-membership", "eo-test"));
    }
    // Worker 1 first: the job cannot start (and end) before worker 0 has its membership too.
    let mine = serde_json::to_string(&pods.membership("pod-run-1")).unwrap();
    let other = serde_json::to_string(&pods.membership("pod-run-2")).unwrap();
    // Not the run this pod was started for.
    let (code, answer) = http(pods.control(1), "PUT", "/v1/membership", Some(&other)).unwrap();
    assert_eq!(code, 400, "{answer}");
    for _ in 0..2 {
        // The operator may repeat itself after a restart.
        assert_eq!(http(pods.control(1), "PUT", "/v1/membership", Some(&mine)).unwrap().0, 200);
    }
    let (code, answer) = http(pods.control(1), "PUT", "/v1/membership", Some(&other)).unwrap();
    assert_eq!(code, 409, "{answer}");
    assert!(answer.contains("pod-run-1") && answer.contains("pod-run-2"), "{answer}");
    // The worker takes the run over asynchronously after the 200; wait for it.
    assert_eq!(pods.status_of_run(1, "pod-run-1").run_id, "pod-run-1");
    pods.put_membership("pod-run-1");
    pods.wait_finished();
    job.assert_exactly_once();
    assert!(std::fs::read_to_string(job.path("state/eo-test/finished.json")).unwrap().contains("\"phase\": \"finished\""));
}

#[test]
fn after_a_savepoint_and_a_lost_worker_a_new_set_restores_latest_exactly_once() {
    let job = Job::counting(2, 100_000, 23, 20_000, "100ms");
    let mut first = Pods::start(&job, 2, "pod-run-a", &[]);
    first.put_membership("pod-run-a");
    first.wait_running(10_000);
    let savepoint = first.savepoint("sp-request-1", false);
    assert!(std::path::Path::new(&savepoint).join("_metadata").exists(), "{savepoint}");
    assert_eq!(first.status(0).last_savepoint.map(|s| s.location), Some(savepoint));
    let st = first.status(1);
    assert_eq!((st.run_id.as_str(), st.phase.as_str()), ("pod-run-a", "running"));
    // Let a checkpoint complete after the savepoint, then lose worker 1: worker 0 fails the run.
    let after = first.status(0).checkpoints_completed;
    let start = Instant::now();
    while first.status(0).checkpoints_completed <= after {
        assert!(start.elapsed() < Duration::from_secs(20), "no checkpoint completed:\n{}", first.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill(1);
    let survivor = first.wait(0, Duration::from_secs(30));
    assert_eq!(survivor.code(), Some(1), "worker 0 after losing worker 1:\n{}", first.logs());
    assert!(job.committed_lines().len() < 100_000, "the job finished before the failure; make it longer");

    let latest = job.latest().expect("a latest checkpoint");
    let mut second = Pods::start(&job, 3, "pod-run-b", &["--restore", "latest"]);
    second.put_membership("pod-run-b");
    let st = second.status_of_run(0, "pod-run-b");
    let restored = st.restored_from.expect("restored from the latest checkpoint");
    assert!(restored.ends_with(latest.trim()), "{restored} is not {latest}");
    assert_eq!(st.run_id, "pod-run-b");
    second.wait_finished();
    job.assert_exactly_once();
}

/// A zombie: the run's processes are frozen mid-run (its node partitioned or
/// paused), a newer run restores the job and goes on, then the old processes
/// wake up. The fence in storage stops them: the old coordinator completes no
/// checkpoint, no old sink commits, and the output is exactly once.
#[test]
fn a_frozen_run_that_wakes_up_after_a_newer_run_took_over_commits_nothing() {
    let job = Job::counting(2, 150_000, 29, 20_000, "100ms");
    // A long heartbeat timeout for the old run: on waking up, its processes
    // must meet the fence, not merely notice that time passed.
    let mut old = Pods::start(&job, 9, "zombie-run-a", &["--heartbeat-timeout", "60s"]);
    old.put_membership("zombie-run-a");
    old.wait_running(10_000);
    let start = Instant::now();
    while old.status(0).checkpoints_completed < 2 {
        assert!(start.elapsed() < Duration::from_secs(20), "no checkpoint completed:\n{}", old.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    old.signal_all(libc::SIGSTOP);
    let mut new = Pods::start(&job, 10, "zombie-run-b", &["--restore", "latest"]);
    new.put_membership("zombie-run-b");
    let st = new.status_of_run(0, "zombie-run-b");
    assert!(st.restored_from.is_some(), "the new run started fresh: {st:?}");
    // The new run completes a checkpoint of its own before the old one wakes.
    let start = Instant::now();
    while new.status(0).checkpoints_completed < 1 {
        assert!(start.elapsed() < Duration::from_secs(20), "the new run completed no checkpoint:\n{}", new.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    old.signal_all(libc::SIGCONT);
    let coordinator = old.wait(0, Duration::from_secs(30));
    assert_eq!(coordinator.code(), Some(3), "the old coordinator after waking up:\n{}", old.logs());
    assert!(old.logs().contains("superseded by run zombie-run-b"), "{}", old.logs());
    let _ = old.wait(1, Duration::from_secs(30));
    new.wait_finished();
    job.assert_exactly_once();
    // In storage: every checkpoint directory names the run that owns it, and
    // no checkpoint of the old run completed after the new run's first one.
    let mut completed: Vec<(u64, String)> = Vec::new();
    for entry in std::fs::read_dir(job.path("state/eo-test/checkpoints")).unwrap().flatten() {
        let dir = entry.path();
        let (Some(id), Ok(owner)) = (
            dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("chk-")).and_then(|n| n.parse::<u64>().ok()),
            std::fs::read_to_string(dir.join("_owner")),
        ) else {
            continue;
        };
        if dir.join("_metadata").exists() {
            let owner: serde_json::Value = serde_json::from_str(&owner).unwrap();
            completed.push((id, owner["run_id"].as_str().unwrap().to_string()));
        }
    }
    let first_new = completed.iter().filter(|(_, r)| r == "zombie-run-b").map(|(id, _)| *id).min().expect("the new run's checkpoints");
    let late: Vec<_> = completed.iter().filter(|(id, r)| r == "zombie-run-a" && *id > first_new).collect();
    assert!(late.is_empty(), "the old run completed checkpoints after the new run began: {late:?}");
}

/// The operator passes `--expect-state` once the job has completed a
/// checkpoint: if the storage then holds nothing of the job (lost, emptied,
/// the wrong bucket), the run fails naming the storage instead of silently
/// starting from scratch, and nothing is written.
#[test]
fn restoring_latest_from_storage_without_any_state_of_the_job_fails_when_state_is_expected() {
    let job = Job::counting(2, 10_000, 10, 0, "100ms");
    let mut pods = Pods::start(&job, 11, "lost-storage", &["--restore", "latest", "--expect-state"]);
    pods.put_membership("lost-storage");
    let status = pods.wait(0, Duration::from_secs(30));
    assert_eq!(status.code(), Some(3), "worker 0:\n{}", pods.logs());
    assert!(pods.logs().contains("holds no state of it at all"), "{}", pods.logs());
    assert!(job.committed_lines().is_empty(), "the job started from scratch");
}

/// Any pod of a cluster can reach a worker's data and coordinator ports. A
/// stranger that knows the run id (it is in the pods' labels) but not the
/// job's token is turned away before anything else it says is read: it can
/// neither feed records in, nor fail the run, nor make a worker buffer what
/// it sends, nor replay what a real worker said on another connection.
#[test]
fn a_stranger_on_the_data_and_coordinator_ports_is_turned_away_and_the_run_goes_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use weir_api::control::{COORDINATOR_PORT, DATA_PORT};
    use weir_runtime::exchange::frame::{encode_hello, Hello};
    use weir_runtime::worker::handshake::{offer, run_key};
    use weir_runtime::worker::protocol::ToCoordinator;
    use weir_runtime::worker::tls::Link;
    // 10 s of events: the job still runs when the strangers are done.
    let job = Job::counting(2, 200_000, 17, 20_000, "100ms");
    let mut pods = Pods::start(&job, 12, "stranger-run", &[]);
    pods.put_membership("stranger-run");
    pods.wait_running(5_000);
    let peak_before: Vec<u64> = (0..2).map(|i| peak_rss_kib(pods.pid(i))).collect();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut held = Vec::new();
        for ip in &pods.ips {
            // A channel that does not exist, under another token's key: if it
            // were read, it would fail the run.
            let stream = tokio::net::TcpStream::connect((*ip, DATA_PORT)).await.unwrap();
            let hello = Hello { run_id: "stranger-run".into(), stage: 7, input: 0, from: 9, to: 9 };
            held.push(offer(stream, &run_key("not-the-token", "stranger-run"), &encode_hello(&hello), "w").await.unwrap());
            // Junk: a frame length of 256 MiB, then as many bytes as the
            // worker takes within a second.
            let mut stream = tokio::net::TcpStream::connect((*ip, DATA_PORT)).await.unwrap();
            let _ = stream.write_all(&(256u32 << 20).to_be_bytes()).await;
            let junk = vec![0xa5u8; 1 << 20];
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            let mut sent = 0usize;
            while let Ok(Ok(())) = tokio::time::timeout_at(deadline, stream.write_all(&junk)).await {
                sent += junk.len();
                if sent >= 256 << 20 {
                    break;
                }
            }
            // Silence: the worker drops it after its handshake timeout.
            held.push(Link::Left(tokio::net::TcpStream::connect((*ip, DATA_PORT)).await.unwrap()));
        }
        let stream = tokio::net::TcpStream::connect((pods.ips[0], COORDINATOR_PORT)).await.unwrap();
        let hello = ToCoordinator::Hello { worker: 1, run_id: "stranger-run".into(), restored_from: None };
        let mut stream = offer(stream, &run_key("not-the-token", "stranger-run"), &serde_json::to_vec(&hello).unwrap(), "c").await.unwrap();
        // The coordinator hangs up: it reads nothing more from a stranger.
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
        assert!(rest.is_empty(), "the coordinator answered a stranger: {rest:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(held);
    });
    // What a worker holds for strangers stays small: the junk was not buffered.
    for (i, before) in peak_before.iter().enumerate() {
        let after = peak_rss_kib(pods.pid(i));
        assert!(after < before + 64 * 1024, "worker {i}'s peak RSS went from {before} KiB to {after} KiB");
    }
    pods.wait_finished();
    job.assert_exactly_once();
    let logs = pods.logs();
    assert!(logs.contains("rejected a data connection") && logs.contains("without this run's proof"), "{logs}");
    assert!(logs.contains("a hello of 268435456 bytes: expected at most"), "{logs}");
    assert!(logs.contains("ignoring a connection to the coordinator"), "{logs}");
}

/// The peak resident set of process `pid` (VmHWM), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap()
}

#[test]
fn a_stopping_savepoint_location_from_the_api_restores_as_given_exactly_once() {
    // A stopping savepoint is the run's last snapshot: nothing is committed
    // after it, so restoring it must reproduce the output exactly. The state
    // directory is a file:// URL, the form a cluster's storage takes.
    let job = Job::counting(2, 100_000, 19, 20_000, "100ms");
    let state_url = format!("file://{}", job.path("state").display());
    let mut first = Pods::start(&job, 4, "pod-run-x", &["--state-dir", &state_url, "--restore", "latest"]);
    first.put_membership("pod-run-x");
    first.wait_running(10_000);
    assert_eq!(first.status(0).restored_from, None, "nothing to restore yet: a fresh start");
    let start = Instant::now();
    while first.status(0).checkpoints_completed == 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "no checkpoint completed:\n{}", first.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    let savepoint = first.savepoint("upgrade-1", true);
    let st = first.status(0);
    std::thread::sleep(Duration::from_millis(600));
    let later = first.status(0);
    assert_eq!((later.checkpoints_completed, later.checkpoint_in_progress), (st.checkpoints_completed, None), "a checkpoint after the stopping savepoint");
    let committed = job.committed_lines().len();
    assert!(committed > 0 && committed < 100_000, "{committed} lines committed");
    first.kill(0);
    let survivor = first.wait(1, Duration::from_secs(30));
    assert_eq!(survivor.code(), Some(1), "worker 1 after losing worker 0:\n{}", first.logs());
    assert!(first.logs().contains("starting fresh"), "{}", first.logs());

    let mut second = Pods::start(&job, 5, "pod-run-y", &["--state-dir", &state_url, "--restore", &savepoint]);
    second.put_membership("pod-run-y");
    assert_eq!(second.status_of_run(1, "pod-run-y").restored_from.as_deref(), Some(savepoint.as_str()));
    second.wait_finished();
    job.assert_exactly_once();
}

/// A pod stopped with a savepoint stays until the operator deletes it, and a
/// deleted job is never resumed: worker 0 deletes, before it reports the
/// stop committed, the leftovers of earlier runs that retention left unprotected during the
/// run, and keeps this run's own (a cancelled stop resumes the run).
#[test]
fn a_pod_stopped_with_a_savepoint_cleans_up_earlier_runs_leftovers_while_it_waits_to_be_deleted() {
    let job = Job::counting(2, 100_000, 29, 20_000, "100ms");
    let mut first = Pods::start(&job, 6, "pod-run-c1", &[]);
    first.put_membership("pod-run-c1");
    first.wait_running(5_000);
    first.kill(0);
    assert_eq!(first.wait(1, Duration::from_secs(30)).code(), Some(1), "worker 1 after losing worker 0:\n{}", first.logs());

    let mut second = Pods::start(&job, 7, "pod-run-c2", &["--restore", "latest"]);
    second.put_membership("pod-run-c2");
    second.wait_running(5_000);
    // Planted after the start's own clean-up, as retention would leave them
    // by retiring the last checkpoint that referenced them.
    let earlier = job.path("out/eo/.part-eo-test.pod-run-c1-000-000999.jsonl.inprogress");
    let own = job.path("out/eo/.part-eo-test.pod-run-c2-001-000999.jsonl.inprogress");
    let other_state = job.path("out/eo/.part-eo-test.feedface00-000-000999.jsonl.inprogress");
    for f in [&earlier, &own, &other_state] {
        std::fs::write(f, "{\"seq\": 1}\n").unwrap();
    }
    // The operator deletes the pods once the stop is reported complete, so
    // the clean-up is done by then.
    let savepoint = second.savepoint("delete-1", true);
    assert!(!earlier.exists(), "the earlier run's leftover is still there after the stop:\n{}", second.logs());
    assert!(second.children.iter_mut().flatten().all(|c| c.try_wait().unwrap().is_none()), "the pods must wait to be deleted:\n{}", second.logs());
    assert!(own.exists(), "the stopped run's own file was deleted, though the stop may be cancelled");
    assert!(other_state.exists(), "a file of a run this state never had was deleted");
    drop(second);

    let mut third = Pods::start(&job, 8, "pod-run-c3", &["--restore", &savepoint]);
    third.put_membership("pod-run-c3");
    third.wait_finished();
    job.assert_exactly_once();
    assert!(!own.exists(), "the next run discards the stopped run's leftover");
}

#[test]
fn a_worker_on_an_ipv6_pod_ip_serves_joins_and_finishes() {
    // ::1 stands for an IPv6 pod IP: the control address is given bare, the
    // membership carries bracketed [::1]:port addresses for data and coordinator.
    let job = Job::counting(1, 2_000, 5, 0, "200ms");
    let ips = vec![IpAddr::from(std::net::Ipv6Addr::LOCALHOST)];
    let mut pods = Pods::start_on(&job, ips, "v6", "pod-run-v6", &[]);
    assert_eq!(pods.control(0).to_string(), "[::1]:6120");
    pods.put_membership("pod-run-v6");
    pods.wait_finished();
    job.assert_exactly_once();
}

#[test]
fn pod_mode_refuses_to_start_without_a_token_and_gives_up_without_a_membership() {
    let job = Job::counting(2, 1_000, 5, 0, "1s");
    let base = ["worker", "--pipeline", "pipeline.yaml", "--index", "0", "--state-dir", "state"];
    for token in [None, Some("")] {
        let mut cmd = Command::new(WEIR);
        cmd.current_dir(job.dir.path()).args(base).args(["--control-addr", "127.42.6.1:6120"]).env_remove("WEIR_CONTROL_TOKEN");
        if let Some(t) = token {
            cmd.env("WEIR_CONTROL_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
        assert!(stderr(&out).contains("WEIR_CONTROL_TOKEN"), "{}", stderr(&out));
    }
    let out = Command::new(WEIR)
        .current_dir(job.dir.path())
        .args(base)
        .args(["--control-addr", "127.42.6.2:6120", "--membership-timeout", "300ms"])
        .env("WEIR_CONTROL_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("no membership arrived within 300ms"), "{}", stderr(&out));
}

/// `--tls-dir`, as the operator starts a job with `spec.tls`: the control
/// endpoint answers only HTTPS, the data and coordinator ports only mutual
/// TLS with a certificate of the job's CA (a process that holds the token
/// but no certificate, or one of another CA, is turned away), and a lost
/// worker is restored by a new set over TLS, exactly once.
#[test]
fn with_tls_only_the_jobs_certificate_gets_in_and_a_lost_worker_is_restored_exactly_once() {
    use weir_api::control::{COORDINATOR_PORT, DATA_PORT};
    use weir_runtime::worker::handshake::{offer, run_key};
    use weir_runtime::worker::tls::JobTls;
    // 20 s of events: the refusals below take some 10 s (a plain peer is
    // dropped after the handshake timeout), and the job must still run after.
    let job = Job::counting(2, 400_000, 23, 20_000, "100ms");
    let name = "eo-test-workers.jobs.svc";
    tls_dir(&job.path("tls"), name);
    tls_dir(&job.path("other-ca"), name);
    let tls_args = ["--tls-dir", "tls", "--tls-server-name", name];
    let mut first = Pods::start(&job, 14, "tls-run-a", &tls_args);
    // Plain HTTP gets no answer from a TLS control endpoint.
    assert_ne!(http(first.control(0), "GET", "/healthz", None).map(|(c, _)| c), Some(200));
    first.put_membership("tls-run-a");
    first.wait_running(10_000);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let key = run_key(TOKEN, "tls-run-a");
        for port in [DATA_PORT, COORDINATOR_PORT] {
            // The token without TLS: no challenge comes, the worker waits for a TLS hello.
            let stream = tokio::net::TcpStream::connect((first.ips[0], port)).await.unwrap();
            assert!(offer(stream, &key, b"{}", "t").await.is_err(), "port {port} let in a plain connection");
            // The token and a certificate of another CA, for the right name.
            let mixed = job.path("mixed");
            std::fs::create_dir_all(&mixed).unwrap();
            for f in ["tls.crt", "tls.key"] {
                std::fs::copy(job.path("other-ca").join(f), mixed.join(f)).unwrap();
            }
            std::fs::copy(job.path("tls/ca.crt"), mixed.join("ca.crt")).unwrap();
            let stranger = std::sync::Arc::new(JobTls::load(&mixed, name).unwrap());
            let stream = tokio::net::TcpStream::connect((first.ips[0], port)).await.unwrap();
            let refused = match offer(stream, &key.clone().with_tls(Some(stranger)), b"{}", "t").await {
                Err(_) => true,
                // TLS 1.3: the client may finish before the server refuses its certificate; then nothing follows.
                Ok(mut link) => {
                    use tokio::io::AsyncReadExt;
                    let mut rest = Vec::new();
                    matches!(tokio::time::timeout(Duration::from_secs(5), link.read_to_end(&mut rest)).await, Ok(Err(_)) | Ok(Ok(0)))
                }
            };
            assert!(refused, "port {port} let in a certificate of another CA");
        }
    });

    // Lose worker 1 after a checkpoint: a new set restores latest, over TLS.
    let after = first.status(0).checkpoints_completed;
    let start = Instant::now();
    while first.status(0).checkpoints_completed <= after {
        assert!(start.elapsed() < Duration::from_secs(20), "no checkpoint completed:\n{}", first.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill(1);
    let survivor = first.wait(0, Duration::from_secs(30));
    assert_eq!(survivor.code(), Some(1), "worker 0 after losing worker 1:\n{}", first.logs());
    assert!(job.committed_lines().len() < 400_000, "the job finished before the failure; make it longer");
    let logs = first.logs();
    assert!(logs.contains("TLS on"), "{logs}");
    let mut restore_args = vec!["--restore", "latest"];
    restore_args.extend(tls_args);
    let mut second = Pods::start(&job, 15, "tls-run-b", &restore_args);
    second.put_membership("tls-run-b");
    assert!(second.status_of_run(0, "tls-run-b").restored_from.is_some());
    second.wait_finished();
    job.assert_exactly_once();
}
