//! `weir-bench operator`: memory (RSS) and reconcile latency of the operator
//! with N StreamJobs against a real, local API server (`e2e/cluster`).
//!
//! For each N: a fresh control plane without a node (worker pods stay
//! Pending, so the operator's own work is measured, not waits on workers),
//! the CRD, the `weir-controller` binary as a local process, N StreamJobs
//! created at once; then the time until every job is handled (phase
//! Deploying, `status.run.podsCreated`, both worker pods exist), and a steady
//! state in which RSS is sampled every second from /proc. Reconcile counts
//! and latency come from the operator's own /metrics; the latency
//! percentiles are histogram bucket bounds.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub struct Options {
    pub jobs: Vec<usize>,
    pub steady: Duration,
    pub controllers: Vec<PathBuf>,
    pub cluster_dir: PathBuf,
    pub namespaces: usize,
    pub timeout: Duration,
    pub log_dir: PathBuf,
}

pub const HELP: &str = "weir-bench operator: the operator's RSS and reconcile latency with N StreamJobs on a local API server (e2e/cluster with WEIR_NODES=0, no node)

Options:
  --jobs N[,N...]        numbers of StreamJobs, one fresh cluster each (default 100,1000)
  --steady SECONDS       steady-state time after all jobs are handled (default 45)
  --controller PATH      the weir-controller binary (default: $CARGO_TARGET_DIR/release/weir-controller);
                         may be given more than once to compare binaries in one run
  --namespaces K         spread the jobs over K namespaces (default 4)
  --cluster-dir DIR      WEIR_CLUSTER_DIR of the benchmark's cluster (default /tmp/weir-bench-cluster)
  --timeout SECONDS      give up when the jobs are not all handled by then (default 900)
  --log-dir DIR          where the operator's logs are kept (default /tmp/weir-bench-logs)";

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let mut o = Options {
        jobs: vec![100, 1000],
        steady: Duration::from_secs(45),
        controllers: Vec::new(),
        cluster_dir: PathBuf::from("/tmp/weir-bench-cluster"),
        namespaces: 4,
        timeout: Duration::from_secs(900),
        log_dir: PathBuf::from("/tmp/weir-bench-logs"),
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--jobs" => {
                o.jobs = args.next().context("--jobs N[,N...]")?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>().context("--jobs N[,N...]")?
            }
            "--steady" => o.steady = Duration::from_secs(args.next().context("--steady SECONDS")?.parse()?),
            "--controller" => o.controllers.push(PathBuf::from(args.next().context("--controller PATH")?)),
            "--namespaces" => o.namespaces = args.next().context("--namespaces K")?.parse()?,
            "--cluster-dir" => o.cluster_dir = PathBuf::from(args.next().context("--cluster-dir DIR")?),
            "--timeout" => o.timeout = Duration::from_secs(args.next().context("--timeout SECONDS")?.parse()?),
            "--log-dir" => o.log_dir = PathBuf::from(args.next().context("--log-dir DIR")?),
            "-h" | "--help" => {
                println!("{HELP}");
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench operator --help"),
        }
    }
    if o.jobs.is_empty() || o.jobs.contains(&0) || o.namespaces == 0 {
        bail!("--jobs needs positive numbers and --namespaces at least 1");
    }
    if o.controllers.is_empty() {
        o.controllers.push(crate::target_binary("weir-controller", "cargo build --release -p weir-controller")?);
    }
    for c in &o.controllers {
        if !c.exists() {
            bail!("{} does not exist", c.display());
        }
    }
    Ok(Some(o))
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn progress(msg: impl AsRef<str>) {
    eprintln!("operator-bench: {}", msg.as_ref());
}

/// What one measurement produced.
struct Outcome {
    jobs: usize,
    controller: String,
    created_s: f64,
    handled_s: f64,
    reconciles: u64,
    /// Reconciles skipped because the watch had not shown the operator's own
    /// last write yet (a metric only newer controllers have).
    skipped_stale: u64,
    errors: u64,
    error_kinds: BTreeMap<String, u64>,
    handling: Histogram,
    steady: Histogram,
    steady_s: f64,
    rss_steady_mib: f64,
    rss_peak_mib: f64,
    cpu_handling_s: f64,
    cpu_steady_s: f64,
    /// Requests the operator made, by verb and resource: (count, seconds
    /// the API server spent on them), from the API server's metrics.
    requests: BTreeMap<String, (u64, f64)>,
    /// Most sockets the operator had open at once (its connections to the
    /// API server: one per request in flight, HTTP/1.1).
    max_sockets: usize,
}

pub fn run(o: &Options) -> Result<()> {
    let kubectl = kubectl()?;
    std::fs::create_dir_all(&o.log_dir)?;
    let mut outcomes = Vec::new();
    for &n in &o.jobs {
        for controller in &o.controllers {
            outcomes.push(measure(o, &kubectl, controller, n)?);
        }
    }
    print_table(o, &outcomes);
    Ok(())
}

fn kubectl() -> Result<PathBuf> {
    let out = Command::new(repo_root().join("e2e/build-binaries"))
        .arg("kubernetes")
        .stderr(Stdio::inherit())
        .output()
        .context("running e2e/build-binaries")?;
    if !out.status.success() {
        bail!("e2e/build-binaries kubernetes failed");
    }
    let dir = String::from_utf8(out.stdout)?.lines().next().context("e2e/build-binaries printed no directory")?.trim().to_string();
    Ok(PathBuf::from(dir).join("kubectl"))
}

/// The cluster and the operator of one measurement; dropping it stops both.
struct Bench {
    cluster_dir: PathBuf,
    kubeconfig: PathBuf,
    kubectl: PathBuf,
    operator: Option<Child>,
}

impl Bench {
    fn up(cluster_dir: &Path, kubectl: &Path) -> Result<Bench> {
        cluster(cluster_dir, "down")?; // a fresh cluster every time
        let out = Command::new(repo_root().join("e2e/cluster"))
            .arg("up")
            .env("WEIR_CLUSTER_DIR", cluster_dir)
            .env("WEIR_NODES", "0")
            .stderr(Stdio::inherit())
            .output()
            .context("running e2e/cluster up")?;
        let mut bench = Bench { cluster_dir: cluster_dir.to_path_buf(), kubeconfig: PathBuf::new(), kubectl: kubectl.to_path_buf(), operator: None };
        if !out.status.success() {
            bail!("e2e/cluster up failed (logs in {}/logs)", cluster_dir.display());
        }
        let stdout = String::from_utf8(out.stdout)?;
        let line = stdout.lines().rev().find(|l| l.starts_with("export KUBECONFIG=")).context("e2e/cluster up printed no KUBECONFIG")?;
        bench.kubeconfig = PathBuf::from(line.trim_start_matches("export KUBECONFIG=").trim_matches(|c| c == '\'' || c == '"'));
        Ok(bench)
    }

    fn kubectl(&self) -> Command {
        let mut c = Command::new(&self.kubectl);
        c.env("KUBECONFIG", &self.kubeconfig);
        c
    }

    fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl().args(args).output().context("running kubectl")?;
        if !out.status.success() {
            bail!("kubectl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?)
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if let Some(mut child) = self.operator.take() {
            stop(&mut child);
        }
        if let Err(e) = cluster(&self.cluster_dir, "down") {
            progress(format!("warning: {e:#}"));
        }
    }
}

fn cluster(dir: &Path, cmd: &str) -> Result<()> {
    let status = Command::new(repo_root().join("e2e/cluster"))
        .arg(cmd)
        .env("WEIR_CLUSTER_DIR", dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("running e2e/cluster {cmd}"))?;
    if !status.success() {
        bail!("e2e/cluster {cmd} failed for {}", dir.display());
    }
    Ok(())
}

/// SIGTERM, then SIGKILL after 10 s.
fn stop(child: &mut Child) {
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// GET over plain HTTP with curl (which e2e/cluster needs anyway).
fn http_get(url: &str) -> Result<String> {
    let out = Command::new("curl").args(["-sf", "--max-time", "10", url]).output().context("running curl")?;
    if !out.status.success() {
        bail!("GET {url} failed");
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The jobs as one multi-document YAML per namespace: examples/streamjob.yaml
/// with distinct names.
fn manifests(n: usize, namespaces: usize) -> Result<Vec<(String, String)>> {
    let example = std::fs::read_to_string(repo_root().join("examples/streamjob.yaml"))?;
    let body = &example[example.find("apiVersion:").context("examples/streamjob.yaml has no apiVersion")?..];
    let anchor = "metadata:\n  name: exactly-once\n";
    if !body.contains(anchor) {
        bail!("examples/streamjob.yaml changed: no `{anchor}`");
    }
    let mut docs: Vec<(String, String)> = (0..namespaces).map(|k| (format!("bench-{k}"), String::new())).collect();
    for i in 0..n {
        let (ns, yaml) = &mut docs[i % namespaces];
        yaml.push_str("---\n");
        yaml.push_str(&body.replacen(anchor, &format!("metadata:\n  name: job-{i:05}\n  namespace: {ns}\n"), 1));
    }
    Ok(docs)
}

/// Jobs whose two worker pods exist (pod names are `<job>-<run>-<index>`).
fn jobs_with_pods(bench: &Bench, workers: usize) -> Result<usize> {
    // The table form: the API server prints it, so far less than the full pods.
    let out = bench.kubectl_ok(&["get", "pods", "-A", "-l", "weir.dev/job", "--no-headers", "--chunk-size=0"])?;
    let mut per_job: HashMap<String, usize> = HashMap::new();
    for line in out.lines() {
        let mut cols = line.split_whitespace();
        let (Some(ns), Some(pod)) = (cols.next(), cols.next()) else { continue };
        let mut parts = pod.rsplitn(3, '-');
        let (_, _, Some(job)) = (parts.next(), parts.next(), parts.next()) else { continue };
        *per_job.entry(format!("{ns}/{job}")).or_default() += 1;
    }
    Ok(per_job.values().filter(|&&c| c >= workers).count())
}

/// Jobs in phase Deploying whose status says their pods were created.
fn jobs_deploying(bench: &Bench) -> Result<usize> {
    let out = bench.kubectl_ok(&["get", "streamjobs", "-A", "-o", "jsonpath={range .items[*]}{.status.phase} {.status.run.podsCreated}{\"\\n\"}{end}"])?;
    Ok(out.lines().filter(|l| l.trim() == "Deploying true").count())
}

/// VmRSS and VmHWM of a process, in KiB.
fn rss_kib(pid: u32) -> Result<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        let line = s.lines().find(|l| l.starts_with(name)).with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        Ok(line[name.len()..].trim().trim_end_matches("kB").trim().parse()?)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// User + system CPU seconds of a process.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = &s[s.rfind(')').context("bad /proc/pid/stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((f[11].parse::<f64>()? + f[12].parse::<f64>()?) / ticks)
}

fn measure(o: &Options, kubectl: &Path, controller: &Path, n: usize) -> Result<Outcome> {
    let label = controller.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| controller.display().to_string());
    progress(format!("{n} jobs, {label}: starting a cluster in {}", o.cluster_dir.display()));
    let mut bench = Bench::up(&o.cluster_dir, kubectl)?;
    bench.kubectl_ok(&["apply", "-f", &repo_root().join("crds/streamjob.yaml").display().to_string()])?;
    // Retried: right after the apply, `wait` can fail to find the CRD.
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = bench.kubectl_ok(&["wait", "--for", "condition=established", "--timeout=60s", "crd/streamjobs.weir.dev"]) {
        if Instant::now() > deadline {
            return Err(e);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let docs = manifests(n, o.namespaces)?;
    for (ns, _) in &docs {
        bench.kubectl_ok(&["create", "namespace", ns])?;
    }
    let api_before = api_requests(&bench)?;

    let port = free_port()?;
    let log_path = o.log_dir.join(format!("operator-{n}-{}.log", controller.file_name().and_then(|f| f.to_str()).unwrap_or("controller")));
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(controller)
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .env("KUBECONFIG", &bench.kubeconfig)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {label}"))?;
    let pid = child.id();
    bench.operator = Some(child);
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while http_get(&format!("{base}/readyz")).is_err() {
        if let Some(Ok(Some(status))) = bench.operator.as_mut().map(|c| c.try_wait()) {
            bail!("the operator exited ({status}); its log: {}", log_path.display());
        }
        if Instant::now() > deadline {
            bail!("the operator was not ready within 60 s; its log: {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Let the watches start (the controller is idle: there are no jobs yet).
    std::thread::sleep(Duration::from_secs(2));
    let (rss_idle, _) = rss_kib(pid)?;
    progress(format!("operator ready (pid {pid}, RSS {:.1} MiB); creating {n} StreamJobs in {} namespaces", rss_idle as f64 / 1024.0, o.namespaces));

    // Create: one kubectl per namespace, in parallel.
    let cpu0 = cpu_seconds(pid)?;
    let t0 = Instant::now();
    let mut creators = Vec::new();
    for (_, yaml) in &docs {
        let mut c = bench.kubectl().args(["create", "-f", "-"]).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
        c.stdin.take().context("kubectl stdin")?.write_all(yaml.as_bytes())?;
        creators.push(c);
    }
    for c in creators {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            bail!("kubectl create failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
    }
    let created_s = t0.elapsed().as_secs_f64();
    progress(format!("created {n} StreamJobs in {created_s:.1} s; waiting until every job is handled"));

    // Wait until handled: pods first (cheap), then the statuses.
    let mut last_report = Instant::now();
    let mut max_sockets = 0;
    let handled_s = loop {
        if let Some(Ok(Some(status))) = bench.operator.as_mut().map(|c| c.try_wait()) {
            bail!("the operator exited ({status}); its log: {}", log_path.display());
        }
        if t0.elapsed() > o.timeout {
            bail!("not all {n} jobs were handled within {} s; the operator's log: {}", o.timeout.as_secs(), log_path.display());
        }
        max_sockets = max_sockets.max(sockets(pid));
        let with_pods = jobs_with_pods(&bench, 2).unwrap_or(0);
        let deploying = if with_pods >= n { jobs_deploying(&bench).unwrap_or(0) } else { 0 };
        let at = t0.elapsed().as_secs_f64();
        if with_pods >= n && deploying >= n {
            break at;
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            let rss = rss_kib(pid).map(|(r, _)| r as f64 / 1024.0).unwrap_or(0.0);
            progress(format!("{at:.0} s: {with_pods}/{n} jobs have their pods, RSS {rss:.1} MiB, {} sockets open", sockets(pid)));
            last_report = Instant::now();
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    let cpu1 = cpu_seconds(pid)?;
    let at_handled = Metrics::parse(&http_get(&format!("{base}/metrics"))?);
    progress(format!("all {n} jobs handled after {handled_s:.1} s; steady state for {} s", o.steady.as_secs()));

    // Steady state: sample RSS every second.
    let t1 = Instant::now();
    let mut samples = Vec::new();
    while t1.elapsed() < o.steady {
        std::thread::sleep(Duration::from_secs(1));
        samples.push(rss_kib(pid)?.0);
        max_sockets = max_sockets.max(sockets(pid));
        if samples.len() % 15 == 0 {
            progress(format!("steady {} s: RSS {:.1} MiB", samples.len(), *samples.last().unwrap_or(&0) as f64 / 1024.0));
        }
    }
    let steady_s = t1.elapsed().as_secs_f64();
    let end = Metrics::parse(&http_get(&format!("{base}/metrics"))?);
    let cpu2 = cpu_seconds(pid)?;
    let (_, hwm) = rss_kib(pid)?;
    let api_after = api_requests(&bench)?;
    if let Some(mut child) = bench.operator.take() {
        stop(&mut child);
    }
    drop(bench);
    progress(format!("{n} jobs: done; the operator's log is {}", log_path.display()));

    let mut requests = BTreeMap::new();
    for (k, (c, t)) in api_after {
        let (c0, t0) = api_before.get(&k).copied().unwrap_or((0, 0.0));
        if c > c0 {
            requests.insert(k, (c - c0, t - t0));
        }
    }
    let rss = crate::median(samples.iter().map(|&s| s as f64 / 1024.0).collect());
    Ok(Outcome {
        jobs: n,
        controller: label,
        created_s,
        handled_s,
        reconciles: end.value("weir_operator_reconciles_total"),
        skipped_stale: end.value("weir_operator_reconciles_skipped_stale_total"),
        errors: end.sum("weir_operator_reconcile_errors_total"),
        error_kinds: end.by_label("weir_operator_reconcile_errors_total", "kind"),
        handling: at_handled.histogram("weir_operator_reconcile_duration_seconds"),
        steady: end.histogram("weir_operator_reconcile_duration_seconds").minus(&at_handled.histogram("weir_operator_reconcile_duration_seconds")),
        steady_s,
        rss_steady_mib: rss,
        rss_peak_mib: hwm as f64 / 1024.0,
        cpu_handling_s: cpu1 - cpu0,
        cpu_steady_s: cpu2 - cpu1,
        requests,
        max_sockets,
    })
}

/// The API server's request counts and the time it spent on them, by
/// "VERB resource[/subresource]". Left out: what the benchmark itself does
/// (cluster-wide lists, creating the jobs and namespaces), the scheduler's
/// pods/status and the control plane's own bookkeeping.
fn api_requests(bench: &Bench) -> Result<BTreeMap<String, (u64, f64)>> {
    let text = bench.kubectl_ok(&["get", "--raw", "/metrics"])?;
    let m = Metrics::parse(&text);
    let mut out: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    for s in m.samples.iter() {
        let counter = s.name == "apiserver_request_total";
        if !counter && s.name != "apiserver_request_duration_seconds_sum" {
            continue;
        }
        let l = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
        let (verb, resource, sub, scope) = (l("verb"), l("resource"), l("subresource"), l("scope"));
        if resource.is_empty() || matches!(verb.as_str(), "WATCH" | "WATCHLIST") || scope == "cluster" {
            continue;
        }
        let bench_own = (resource == "streamjobs" && verb == "POST") || resource == "namespaces";
        // GET streamjobs: the garbage collector checking the owners of the
        // jobs' objects; LIST limitranges: the LimitRanger admission plugin.
        let control_plane = (resource == "pods" && sub == "status")
            || (resource == "streamjobs" && verb == "GET")
            || matches!(resource.as_str(), "limitranges" | "leases" | "endpointslices" | "endpoints" | "serviceaccounts" | "clusterroles" | "clusterrolebindings" | "roles" | "rolebindings");
        if bench_own || control_plane {
            continue;
        }
        let key = if sub.is_empty() { format!("{verb} {resource}") } else { format!("{verb} {resource}/{sub}") };
        let e = out.entry(key).or_default();
        if counter {
            e.0 += s.value as u64;
        } else {
            e.1 += s.value;
        }
    }
    Ok(out)
}

/// Open sockets of a process (its TCP connections and listeners).
fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.filter_map(|e| e.ok()).filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))).count())
        .unwrap_or(0)
}

struct Sample {
    name: String,
    labels: HashMap<String, String>,
    value: f64,
}

/// The Prometheus text format, as much as needed here.
struct Metrics {
    samples: Vec<Sample>,
}

impl Metrics {
    fn parse(text: &str) -> Metrics {
        let mut samples = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (head, value) = match line.rfind('}') {
                Some(i) => (&line[..=i], line[i + 1..].trim()),
                None => match line.split_once(' ') {
                    Some((h, v)) => (h, v.trim()),
                    None => continue,
                },
            };
            let value = value.split_whitespace().next().unwrap_or("");
            let Ok(value) = value.parse::<f64>() else { continue };
            let (name, labels) = match head.split_once('{') {
                Some((n, rest)) => (n.to_string(), parse_labels(rest.trim_end_matches('}'))),
                None => (head.to_string(), HashMap::new()),
            };
            samples.push(Sample { name, labels, value });
        }
        Metrics { samples }
    }

    fn value(&self, name: &str) -> u64 {
        self.samples.iter().find(|s| s.name == name).map(|s| s.value as u64).unwrap_or(0)
    }

    fn sum(&self, name: &str) -> u64 {
        self.samples.iter().filter(|s| s.name == name).map(|s| s.value as u64).sum()
    }

    fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, u64> {
        self.samples.iter().filter(|s| s.name == name).map(|s| (s.labels.get(label).cloned().unwrap_or_default(), s.value as u64)).collect()
    }

    fn histogram(&self, name: &str) -> Histogram {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, u64)> = self
            .samples
            .iter()
            .filter(|s| s.name == bucket)
            .filter_map(|s| {
                let le = s.labels.get("le")?;
                let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((bound, s.value as u64))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let sum = self.samples.iter().find(|s| s.name == format!("{name}_sum")).map(|s| s.value).unwrap_or(0.0);
        Histogram { buckets, sum }
    }
}

fn parse_labels(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = s;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 2..];
        let mut end = 0;
        let bytes = after.as_bytes();
        while end < bytes.len() && !(bytes[end] == b'"' && (end == 0 || bytes[end - 1] != b'\\')) {
            end += 1;
        }
        out.insert(key, after[..end].to_string());
        rest = after.get(end + 1..).unwrap_or("");
    }
    out
}

/// Cumulative buckets (upper bound, count) and the sum of observations.
#[derive(Clone)]
struct Histogram {
    buckets: Vec<(f64, u64)>,
    sum: f64,
}

impl Histogram {
    fn count(&self) -> u64 {
        self.buckets.last().map(|b| b.1).unwrap_or(0)
    }

    fn minus(&self, earlier: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, c)| (le, c.saturating_sub(earlier.buckets.iter().find(|b| b.0 == le).map(|b| b.1).unwrap_or(0))))
            .collect();
        Histogram { buckets, sum: self.sum - earlier.sum }
    }

    /// The upper bound of the bucket holding quantile `q`.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        self.buckets.iter().find(|b| b.1 >= rank).map(|b| b.0)
    }

    fn mean(&self) -> Option<f64> {
        let c = self.count();
        (c > 0).then(|| self.sum / c as f64)
    }
}

fn ms(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v.is_infinite() => "> top bucket".into(),
        Some(v) if v < 0.01 => format!("{:.2} ms", v * 1000.0),
        Some(v) if v < 1.0 => format!("{:.1} ms", v * 1000.0),
        Some(v) => format!("{v:.2} s"),
    }
}

fn print_table(o: &Options, outs: &[Outcome]) {
    let several = o.controllers.len() > 1;
    println!(
        "weir-controller against a local kube-apiserver without a node (worker pods stay Pending); {} namespaces; steady state {} s; cores: {}",
        o.namespaces,
        o.steady.as_secs(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("reconcile latency: p50/p99 are histogram bucket upper bounds (le); \"handling\" = from the start until every job is handled, \"steady\" = the steady-state window after it");
    println!();
    print!("| jobs |");
    if several {
        print!(" controller |");
    }
    println!(" created in | all handled after (after the last create) | jobs handled/s | reconciles (handling + steady) | stale skips | errors | handling p50 / p99 (mean) | steady p50 / p99 (mean) | steady reconciles/s | CPU s handling / steady | RSS steady (MiB) | RSS peak (MiB) |");
    print!("|---|");
    if several {
        print!("---|");
    }
    println!("---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in outs {
        print!("| {} |", r.jobs);
        if several {
            print!(" {} |", r.controller);
        }
        println!(
            " {:.1} s | {:.1} s ({:.1} s) | {:.1} | {} ({} + {}) | {} | {} | {} / {} ({}) | {} / {} ({}) | {:.1} | {:.1} / {:.1} | {:.1} | {:.1} |",
            r.created_s,
            r.handled_s,
            r.handled_s - r.created_s,
            r.jobs as f64 / r.handled_s,
            r.reconciles,
            r.handling.count(),
            r.steady.count(),
            r.skipped_stale,
            r.errors,
            ms(r.handling.quantile(0.5)),
            ms(r.handling.quantile(0.99)),
            ms(r.handling.mean()),
            ms(r.steady.quantile(0.5)),
            ms(r.steady.quantile(0.99)),
            ms(r.steady.mean()),
            r.steady.count() as f64 / r.steady_s,
            r.cpu_handling_s,
            r.cpu_steady_s,
            r.rss_steady_mib,
            r.rss_peak_mib,
        );
    }
    println!();
    println!("API requests per job during the measurement (handling + steady state) and the API server's mean time per request, from its metrics");
    println!("(left out: the benchmark's own requests, the scheduler's pods/status, the garbage collector's GETs; events include the scheduler's FailedScheduling events):");
    println!();
    let mut keys: Vec<&String> = outs.iter().flat_map(|r| r.requests.keys()).collect();
    keys.sort();
    keys.dedup();
    print!("| request |");
    for r in outs {
        if several {
            print!(" {} jobs, {}: per job / mean |", r.jobs, r.controller);
        } else {
            print!(" {} jobs: per job / mean |", r.jobs);
        }
    }
    println!();
    print!("|---|");
    for _ in outs {
        print!("---|");
    }
    println!();
    for k in keys {
        print!("| {k} |");
        for r in outs {
            let (c, t) = r.requests.get(k).copied().unwrap_or((0, 0.0));
            let mean = if c > 0 { ms(Some(t / c as f64)) } else { "-".into() };
            print!(" {:.1} / {mean} |", c as f64 / r.jobs as f64);
        }
        println!();
    }
    print!("| most sockets open at once |");
    for r in outs {
        print!(" {} |", r.max_sockets);
    }
    println!();
    for r in outs.iter().filter(|r| r.errors > 0) {
        eprintln!("{} jobs: reconcile errors by kind: {:?}", r.jobs, r.error_kinds);
    }
}
