//! Shared pieces of the end-to-end tests of `weir run`: pipelines in a
//! temporary directory, the real binary, and the exactly-once oracle.

#![allow(dead_code)]

pub mod azurite;
pub mod kafka;
pub mod minio;
pub mod postgres;
pub mod server_process;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const WEIR: &str = env!("CARGO_BIN_EXE_weir");

pub struct Job {
    pub dir: tempfile::TempDir,
    pub events: u64,
    pub keys: u64,
    /// `--state-dir` of every command: `state` in the job's directory, or
    /// an `s3://` location (see [`Job::on_s3`]).
    pub state: String,
    /// Variables every `weir` command of the job gets (the S3 server's
    /// endpoint and credentials).
    pub env: Vec<(String, String)>,
    /// The S3 server of an `s3://` state, to read `run.json` from.
    pub s3: Option<minio::Bucket>,
    /// The file sink's output when it is in S3 (see [`Job::output_on_s3`]):
    /// the bucket and the key prefix.
    pub s3_output: Option<(minio::Bucket, String)>,
    /// The Azurite container of an `az://` state (see [`Job::on_azure`]).
    pub az: Option<azurite::Container>,
    /// The file sink's output when it is in Azure (see [`Job::output_on_azure`]).
    pub az_output: Option<(azurite::Container, String)>,
    /// The sink's table when it writes to PostgreSQL (see
    /// [`Job::output_to_postgres`]): the server's port and the table.
    pub pg_output: Option<(u16, String)>,
    /// The sink's broker and topic when it writes to Kafka (see
    /// [`Job::output_to_kafka`]).
    pub kafka_output: Option<(kafka::Broker, String)>,
}

impl Job {
    /// A generator → key_by → running_count → file pipeline.
    pub fn counting(parallelism: u32, events: u64, keys: u64, rate: u64, interval: &str) -> Job {
        let yaml = format!(
            "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: {interval}\n  mode: aligned\nsource:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: {rate}\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n"
        );
        Job::with_pipeline(&yaml, events, keys)
    }

    /// A job of any pipeline named `eo-test` whose sink writes to `out/eo`
    /// (what `worker_pids` and `committed_lines` expect).
    pub fn with_pipeline(yaml: &str, events: u64, keys: u64) -> Job {
        let mut dir = tempfile::tempdir().unwrap();
        // For a post-mortem of a failed run: its state, output and logs stay.
        if std::env::var_os("WEIR_TEST_KEEP").is_some() {
            dir.disable_cleanup(true);
            println!("WEIR_TEST_KEEP: the job's directory {} stays", dir.path().display());
        }
        let job = Job { dir, events, keys, state: "state".into(), env: Vec::new(), s3: None, s3_output: None, az: None, az_output: None, pg_output: None, kafka_output: None };
        job.write_pipeline(yaml);
        job
    }

    /// Keeps this job's checkpoints and savepoints in `bucket` (under a
    /// prefix of its own) instead of on local disk.
    pub fn on_s3(mut self, bucket: &minio::Bucket) -> Job {
        self.state = bucket.url(&format!("state-{}", rand_suffix()));
        self.env = bucket.env();
        self.s3 = Some(bucket.clone());
        self
    }

    /// Writes the file sink's output to `bucket` (under a prefix of its
    /// own) instead of `out/eo`: the pipeline's sink path becomes `s3://…`.
    pub fn output_on_s3(mut self, bucket: &minio::Bucket) -> Job {
        let prefix = format!("out-{}/eo", rand_suffix());
        let yaml = std::fs::read_to_string(self.path("pipeline.yaml")).unwrap();
        assert!(yaml.contains("path: out/eo\n"), "the pipeline's sink does not write to out/eo");
        self.write_pipeline(&yaml.replace("path: out/eo\n", &format!("path: {}\n", bucket.url(&prefix))));
        if self.env.is_empty() {
            self.env = bucket.env();
        }
        self.s3_output = Some((bucket.clone(), prefix));
        self
    }

    /// Keeps this job's checkpoints and savepoints in an Azure `container`
    /// (under a prefix of its own) instead of on local disk.
    pub fn on_azure(mut self, container: &azurite::Container) -> Job {
        self.state = container.url(&format!("state-{}", rand_suffix()));
        self.env = container.env();
        self.az = Some(container.clone());
        self
    }

    /// Writes the file sink's output to an Azure `container` (under a prefix
    /// of its own) instead of `out/eo`: the sink path becomes `az://…`.
    pub fn output_on_azure(mut self, container: &azurite::Container) -> Job {
        let prefix = format!("out-{}/eo", rand_suffix());
        let yaml = std::fs::read_to_string(self.path("pipeline.yaml")).unwrap();
        assert!(yaml.contains("path: out/eo\n"), "the pipeline's sink does not write to out/eo");
        self.write_pipeline(&yaml.replace("path: out/eo\n", &format!("path: {}\n", container.url(&prefix))));
        if self.env.is_empty() {
            self.env = container.env();
        }
        self.az_output = Some((container.clone(), prefix));
        self
    }

    /// Writes the sink's output to a new table of `server` instead of
    /// `out/eo`: `mode` is the postgres sink's mode, `columns` the table's
    /// columns (`seq`, `key`, `value`, `count` with their constraints).
    pub fn output_to_postgres(mut self, server: &postgres::Server, mode: &str, columns: &str) -> Job {
        let table = format!("eo_{}", rand_suffix());
        server.psql(&format!("CREATE TABLE {table} ({columns})"));
        let yaml = std::fs::read_to_string(self.path("pipeline.yaml")).unwrap();
        let file_sink = "sink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n";
        assert!(yaml.contains(file_sink), "the pipeline's sink is not the file sink of out/eo");
        let key = if mode == "upsert" { "\n    key: [key]" } else { "" };
        self.write_pipeline(&yaml.replace(file_sink, &format!("sink:\n  postgres:\n    connection: {}\n    table: {table}\n    mode: {mode}{key}\n", server.connection())));
        self.env.extend(server.env());
        self.pg_output = Some((server.port, table));
        self
    }

    /// Writes the sink's output to a new topic of the shared test broker
    /// (three partitions, keyed by `key`) instead of `out/eo`, with `guarantee`.
    pub fn output_to_kafka(self, guarantee: &str) -> Job {
        self.output_to_kafka_on(&kafka::Broker::shared(), guarantee)
    }

    /// [`Job::output_to_kafka`] on `broker`.
    pub fn output_to_kafka_on(mut self, broker: &kafka::Broker, guarantee: &str) -> Job {
        let topic = kafka::topic("eo-out");
        broker.create_topic(&topic, 3);
        let yaml = std::fs::read_to_string(self.path("pipeline.yaml")).unwrap();
        let file_sink = "sink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n";
        assert!(yaml.contains(file_sink), "the pipeline's sink is not the file sink of out/eo");
        let sink = format!("sink:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    key: key\n    guarantee: {guarantee}\n    progress_topic: {topic}-progress\n", broker.addr);
        self.write_pipeline(&yaml.replace(file_sink, &sink));
        self.kafka_output = Some((broker.clone(), topic));
        self
    }

    /// Reads the events from a new topic of the shared test broker with
    /// `partitions` partitions, filled with the generator's events before
    /// the job starts, instead of from the generator, at most `rate`
    /// messages per second (0: unlimited); the source stops at the end of
    /// every partition.
    pub fn input_from_kafka(self, partitions: i32, rate: u64) -> Job {
        self.input_from_kafka_on(&kafka::Broker::shared(), partitions, rate)
    }

    /// [`Job::input_from_kafka`] on `broker`.
    pub fn input_from_kafka_on(self, broker: &kafka::Broker, partitions: i32, rate: u64) -> Job {
        let topic = kafka::topic("eo-in");
        broker.create_topic(&topic, partitions);
        broker.produce_events(&topic, self.events, self.keys, partitions);
        let yaml = std::fs::read_to_string(self.path("pipeline.yaml")).unwrap();
        let start = yaml.find("source:\n  generator:\n").expect("the pipeline reads the generator");
        let end = start + yaml[start..].find("steps:").expect("steps follow the source");
        let source = format!(
            "source:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    schema: {{seq: int64, key: int64, value: int64}}\n    stop: end\n    batch_size: 256\n    rate: {rate}\n",
            broker.addr
        );
        self.write_pipeline(&format!("{}{source}{}", &yaml[..start], &yaml[end..]));
        self
    }

    /// Fails if an open transaction holds any partition of the Kafka output
    /// (a sink that left one behind blocks every read_committed reader).
    pub fn assert_no_open_transaction(&self) {
        let (broker, topic) = self.kafka_output.as_ref().expect("the job writes to Kafka");
        for t in [topic.clone(), format!("{topic}-progress")] {
            let held = broker.partitions_held_after(&t, Duration::from_secs(20));
            assert!(held.is_empty(), "open transactions hold partitions {held:?} of {t}");
        }
    }

    /// The keys of every object under the output's prefix in S3 or Azure (markers included).
    pub fn output_keys(&self) -> Vec<String> {
        if let Some((container, prefix)) = &self.az_output {
            return container.list(&format!("{prefix}/"));
        }
        let (bucket, prefix) = self.s3_output.as_ref().expect("the output is in an object store");
        bucket.list(&format!("{prefix}/"))
    }

    /// The object at `key` of the output's store.
    fn output_object(&self, key: &str) -> Option<String> {
        match (&self.az_output, &self.s3_output) {
            (Some((container, _)), _) => container.get(key),
            (None, Some((bucket, _))) => bucket.get(key),
            (None, None) => panic!("the output is not in an object store"),
        }
    }

    /// The multipart uploads still open under the S3 output's prefix.
    pub fn open_uploads(&self) -> Vec<String> {
        let (bucket, prefix) = self.s3_output.as_ref().expect("the output is in S3");
        bucket.open_uploads(&format!("{prefix}/"))
    }

    /// Takes a savepoint of the running job (retrying until it is up, 30 s
    /// at most) and returns its location as `weir savepoint` prints it.
    pub fn take_savepoint(&self) -> String {
        self.take_savepoint_with(&[])
    }

    /// [`Job::take_savepoint`] with more `weir savepoint` arguments (`--stop`).
    pub fn take_savepoint_with(&self, extra: &[&str]) -> String {
        let start = Instant::now();
        let mut last = String::new();
        loop {
            assert!(start.elapsed() < Duration::from_secs(30), "no savepoint could be taken; the last attempt said: {last}");
            std::thread::sleep(Duration::from_millis(300));
            let out = self.weir(&["savepoint", "--state-dir", &self.state]).args(extra).output().unwrap();
            if out.status.success() {
                return String::from_utf8_lossy(&out.stdout).trim().to_string();
            }
            last = stderr(&out);
        }
    }

    /// The location of the lineage's latest snapshot, as `weir checkpoints
    /// list --json` marks it; `None` when the lineage has none.
    /// Waits (at most 30 s) until the job has completed a checkpoint.
    pub fn wait_for_first_checkpoint(&self) {
        let start = Instant::now();
        while self.latest().is_none() {
            assert!(start.elapsed() < Duration::from_secs(30), "no first checkpoint in 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn latest(&self) -> Option<String> {
        let out = self.weir(&["checkpoints", "list", "--json", "--state-dir", &self.state]).output().unwrap();
        assert!(out.status.success(), "weir checkpoints list failed: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()?.iter().map(|e| &e["snapshot"]).find(|s| s["is_latest"].as_bool() == Some(true)).and_then(|s| s["location"].as_str().map(String::from))
    }

    /// `--state-dir STATE`, for any command that reads the job's state.
    pub fn state_args(&self) -> [&str; 2] {
        ["--state-dir", &self.state]
    }

    /// Replaces `pipeline.yaml`: what a user does to change a job between runs.
    /// Atomically and only when it changes: `weir run` reads the file again
    /// for every restart, and must never see it half written.
    pub fn write_pipeline(&self, yaml: &str) {
        let path = self.path("pipeline.yaml");
        if std::fs::read_to_string(&path).is_ok_and(|old| old == yaml) {
            return;
        }
        std::fs::write(self.path(".pipeline.yaml.new"), yaml).unwrap();
        std::fs::rename(self.path(".pipeline.yaml.new"), path).unwrap();
    }

    /// Any `weir` subcommand, run in the job's directory.
    pub fn weir(&self, args: &[&str]) -> Command {
        let mut c = Command::new(WEIR);
        c.current_dir(self.dir.path()).args(args).env("RUST_LOG", "warn").envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn command(&self, extra: &[&str]) -> Command {
        let mut c = Command::new(WEIR);
        c.current_dir(self.dir.path()).arg("run").arg("pipeline.yaml").args(["--state-dir", &self.state]).args(extra);
        // WEIR_TEST_RUST_LOG=info shows a test's job in detail.
        c.env("RUST_LOG", std::env::var("WEIR_TEST_RUST_LOG").unwrap_or_else(|_| "warn".into())).envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    pub fn spawn(&self, extra: &[&str]) -> Child {
        use std::os::unix::process::CommandExt;
        let mut c = self.command(extra);
        c.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        let mut child = c.spawn().unwrap();
        drain_output(&mut child);
        child
    }

    pub fn run(&self, extra: &[&str]) -> Output {
        self.command(extra).output().unwrap()
    }

    /// The pids of the current run's workers, once they are up.
    pub fn worker_pids(&self) -> Option<(Vec<u32>, String)> {
        let text = match (&self.s3, &self.az) {
            (Some(bucket), _) => bucket.get(&format!("{}/eo-test/run.json", bucket.key_of(&self.state)))?,
            (None, Some(container)) => container.get(&format!("{}/eo-test/run.json", container.key_of(&self.state)))?,
            (None, None) => std::fs::read_to_string(self.path("state/eo-test/run.json")).ok()?,
        };
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let pids = v["worker_pids"].as_array()?.iter().filter_map(|p| p.as_u64().map(|p| p as u32)).collect();
        Some((pids, v["run_id"].as_str()?.to_string()))
    }

    /// Committed output: every line of every file whose name does not begin with `.`.
    pub fn committed_lines(&self) -> Vec<serde_json::Value> {
        if let Some((port, table)) = &self.pg_output {
            return postgres::rows_at(*port, table);
        }
        if let Some((broker, topic)) = &self.kafka_output {
            return broker.committed_records(topic);
        }
        let mut out = Vec::new();
        if self.s3_output.is_some() || self.az_output.is_some() {
            for key in self.output_keys() {
                if key.rsplit('/').next().is_some_and(|name| name.starts_with('.')) {
                    continue;
                }
                let text = self.output_object(&key).unwrap_or_else(|| panic!("{key} was listed but cannot be read"));
                for line in text.lines() {
                    out.push(serde_json::from_str(line).unwrap_or_else(|err| panic!("bad line {line:?} in {key}: {err}")));
                }
            }
            return out;
        }
        self.committed_lines_in("out/eo")
    }

    /// The committed JSON lines of a local file output at `rel` (files
    /// whose names begin with `.` are in progress, not committed).
    pub fn committed_lines_in(&self, rel: &str) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(self.path(rel)) else { return out };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            for line in std::fs::read_to_string(e.path()).unwrap().lines() {
                out.push(serde_json::from_str(line).unwrap_or_else(|err| panic!("bad line {line:?} in {:?}: {err}", e.path())));
            }
        }
        out
    }

    /// The exactly-once oracle: every seq once, and per key the counts 1..n once each.
    /// The events absent from `seqs`, as ranges of seq with the keys they
    /// hold: a lost transaction misses a time slice of some keys, a source
    /// that skipped misses a run of one partition's keys.
    fn missing(&self, seqs: &HashSet<i64>) -> String {
        let mut ranges: Vec<(i64, i64, BTreeSet<i64>)> = Vec::new();
        for seq in (0..self.events as i64).filter(|s| !seqs.contains(s)) {
            let key = seq % self.keys as i64;
            match ranges.last_mut() {
                Some((_, end, keys)) if seq - *end <= self.keys as i64 => {
                    *end = seq;
                    keys.insert(key);
                }
                _ => ranges.push((seq, seq, BTreeSet::from([key]))),
            }
        }
        ranges.iter().map(|(from, to, keys)| format!("seq {from}..={to} of keys {keys:?}")).collect::<Vec<_>>().join("; ")
    }

    /// The oracle of a job that stopped part way: every seq at most once,
    /// and per key the counts 1..n once each (a key's events up to a point
    /// of the input, none missing before it). Returns how many events.
    pub fn assert_once_up_to_a_point(&self) -> usize {
        self.once_per_key_of(&self.committed_lines()).0.len()
    }

    pub fn assert_exactly_once(&self) {
        let lines = self.committed_lines();
        if let Some((broker, topic)) = &self.kafka_output {
            let seqs: HashSet<i64> = lines.iter().filter_map(|l| l["seq"].as_i64()).collect();
            if seqs.len() as u64 != self.events {
                println!("{}", self.kafka_whereabouts(broker, topic, &seqs));
            }
        }
        self.assert_exactly_once_of(&lines);
    }

    /// What open transactions hold now in the Kafka output and its
    /// progress topic, and which progress markers did not commit: what a
    /// run that hangs waits for.
    pub fn kafka_transactions_now(&self) -> String {
        let (broker, topic) = self.kafka_output.as_ref().expect("the job writes to Kafka");
        let progress = format!("{topic}-progress");
        let markers = |isolation: &str| -> BTreeMap<i64, String> { broker.read_all(&progress, isolation).into_iter().map(|m| (m.offset, m.key.unwrap_or_default())).collect() };
        let committed_markers = markers("read_committed");
        let uncommitted: Vec<String> = markers("read_uncommitted").into_iter().filter(|(o, _)| !committed_markers.contains_key(o)).map(|(o, k)| format!("{k}@{o}")).collect();
        format!(
            "partitions an open transaction holds: {:?} of {topic}, {:?} of {progress}; progress markers not committed: {uncommitted:?}",
            broker.partitions_held_by_open_transactions(topic),
            broker.partitions_held_by_open_transactions(&progress)
        )
    }

    /// Where the records missing from the committed output of `topic` are
    /// when aborted transactions are read too: in a transaction that was
    /// aborted (or never ended), or nowhere (never produced, or lost).
    fn kafka_whereabouts(&self, broker: &kafka::Broker, topic: &str, committed: &HashSet<i64>) -> String {
        let all = broker.read_all(topic, "read_uncommitted");
        let mut found: BTreeMap<i64, Vec<String>> = BTreeMap::new();
        for m in &all {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&m.value) else { continue };
            if let Some(seq) = v["seq"].as_i64().filter(|s| !committed.contains(s)) {
                found.entry(seq).or_default().push(format!("p{}@{} count {}", m.partition, m.offset, v["count"]));
            }
        }
        let missing = (0..self.events as i64).filter(|s| !committed.contains(s)).count();
        let sample: Vec<String> = found.iter().take(12).map(|(seq, at)| format!("seq {seq}: {}", at.join(", "))).collect();
        // Held partitions hide everything after an open transaction's first
        // record, committed or not; the progress markers of transactions
        // that did not commit say which checkpoints' transactions were lost.
        format!(
            "{missing} seqs missing from the committed output of {topic} ({}); read_uncommitted finds {} of them ({} messages in all): {}\n{}",
            self.missing(committed),
            found.len(),
            all.len(),
            sample.join("; "),
            self.kafka_transactions_now()
        )
    }

    /// The exactly-once oracle over `lines`, the committed output of one of
    /// the job's sinks (a job with several checks each).
    pub fn assert_exactly_once_of(&self, lines: &[serde_json::Value]) {
        let (seqs, per_key) = self.once_per_key_of(lines);
        assert_eq!(seqs.len() as u64, self.events, "committed {} of {} events; missing {}", seqs.len(), self.events, self.missing(&seqs));
        for (key, n) in per_key {
            let expected = (self.events as i64 - key + self.keys as i64 - 1) / self.keys as i64;
            assert_eq!(n, expected, "events of key {key}");
        }
    }

    /// What both oracles check: every committed seq once, with its key and
    /// value, and per key the counts 1..n once each (none missing before
    /// the key's last). The seqs, and n per key.
    fn once_per_key_of(&self, lines: &[serde_json::Value]) -> (HashSet<i64>, BTreeMap<i64, i64>) {
        let mut seqs = HashSet::new();
        let mut counts: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
        for l in lines {
            let seq = l["seq"].as_i64().expect("seq");
            assert!(seqs.insert(seq), "seq {seq} committed twice");
            let key = l["key"].as_i64().expect("key");
            assert_eq!(key, seq % self.keys as i64, "key of seq {seq}");
            assert_eq!(l["value"].as_i64(), Some(seq));
            counts.entry(key).or_default().push(l["count"].as_i64().expect("count"));
        }
        let per_key = counts
            .into_iter()
            .map(|(key, mut c)| {
                c.sort();
                let n = c.len() as i64;
                if c != (1..=n).collect::<Vec<_>>() {
                    // The missing and repeated counts, not both lists: CI keeps only the end of a long failure.
                    let have: HashSet<i64> = c.iter().copied().collect();
                    let missing: Vec<i64> = (1..=*c.last().unwrap_or(&0)).filter(|x| !have.contains(x)).collect();
                    let repeated: Vec<i64> = c.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
                    panic!("counts of key {key}: an event of it is missing before its last one: {n} counts up to {:?}, missing {missing:?}, repeated {repeated:?}", c.last());
                }
                (key, n)
            })
            .collect();
        (seqs, per_key)
    }
}

/// A free loopback port below the kernel's ephemeral range (32768 and up
/// by default). A port from `bind(":0")` is an ephemeral one: while a
/// server is stopped to be restarted, the kernel may hand its port to
/// another test's `bind(":0")` (a worker's, or another MinIO's), and the
/// restarted server then fails to bind while the health check answers from
/// the other one (seen: a job whose bucket vanished under it). Ports are
/// handed out in sequence from a random start, so that no two servers of
/// one test process (tests run as threads) are ever given the same port,
/// even while one of them is stopped.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let _ = NEXT.compare_exchange(0, 20_000 + rand::random::<u32>() % 10_000, Ordering::SeqCst, Ordering::SeqCst);
    loop {
        let port = (20_000 + (NEXT.fetch_add(1, Ordering::SeqCst) - 20_000) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A short random suffix for names that must not collide between tests.
pub fn rand_suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// Kills a random worker of the current run `kills` times, at random moments;
/// every other kill waits for a checkpoint to be in progress first.
/// Runs the job, lets `before_kills` look at it first, kills a worker
/// `kills` times at random moments ([`kill_workers_while_running`]), and
/// checks that the job then finished after at least two of them.
pub fn run_with_worker_kills(job: &Job, kills: usize, before_kills: impl FnOnce(&mut Child)) -> Output {
    let mut child = job.spawn(&[]);
    before_kills(&mut child);
    let done = kill_workers_while_running(job, &mut child, kills);
    let out = wait_with_timeout(child, Duration::from_secs(240));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    assert!(done >= 2, "only {done} kills happened before the job ended");
    out
}

pub fn kill_workers_while_running(job: &Job, child: &mut std::process::Child, kills: usize) -> usize {
    use rand::Rng;
    let mut rng = rand::rng();
    let mut done = 0;
    let mut last_run = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while done < kills && Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(150..600)));
        let Some((pids, run)) = job.worker_pids() else { continue };
        if run == last_run || pids.is_empty() {
            continue; // wait for the restarted run
        }
        if done % 2 == 1 {
            // Aim at a checkpoint in flight: status says so through the control API.
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until {
                let out = job.weir(&["status", "--state-dir", &job.state]).output().unwrap();
                if String::from_utf8_lossy(&out.stdout).contains("\"checkpoint_in_progress\": ") && !String::from_utf8_lossy(&out.stdout).contains("\"checkpoint_in_progress\": null") {
                    break;
                }
            }
        }
        let victim = pids[rng.random_range(0..pids.len())];
        kill(victim);
        last_run = run;
        done += 1;
    }
    done
}

/// Starts the job and SIGKILLs its whole process tree after a random time
/// in `alive_ms`, three times, each run after the first with `--restore
/// latest` (the second restore also at parallelism `rescale`, if given);
/// then lets a last restored run finish and checks that it restored from a
/// checkpoint (the last kill waits for one to exist). The job must
/// outlive three such rounds.
pub fn kill_trees_then_restore_latest(job: &Job, alive_ms: std::ops::Range<u64>, rescale: Option<&str>) -> Output {
    use rand::Rng;
    let mut rng = rand::rng();
    let mut restore_args: Vec<&str> = Vec::new();
    for round in 0..3 {
        let child = job.spawn(&restore_args);
        std::thread::sleep(Duration::from_millis(rng.random_range(alive_ms.clone())));
        // Kills before the first checkpoint are a path of their own, but on
        // a loaded machine all three could come before it, and then nothing
        // is restored; the last round therefore waits for one.
        let until = Instant::now() + Duration::from_secs(30);
        while round == 2 && job.latest().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        kill_group(child.id());
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "round {round}: the job ended before it was killed; make it longer");
        restore_args = vec!["--restore", "latest"];
        if let (Some(p), 1) = (rescale, round) {
            restore_args.extend(["--parallelism", p]);
        }
    }
    let out = wait_with_timeout(job.spawn(&restore_args), Duration::from_secs(180));
    assert!(out.status.success(), "final run failed:\n{}", stderr(&out));
    assert!(stderr(&out).contains("restoring `eo-test` from checkpoint"), "{}", stderr(&out));
    out
}

pub fn kill(pid: u32) {
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

pub fn kill_group(pgid: u32) {
    unsafe {
        libc::killpg(pgid as i32, libc::SIGKILL);
    }
}

type Drained = (std::thread::JoinHandle<Vec<u8>>, std::thread::JoinHandle<Vec<u8>>);

/// Readers of spawned children's stdout and stderr, by pid.
fn drained() -> &'static std::sync::Mutex<std::collections::HashMap<u32, Drained>> {
    static DRAINED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<u32, Drained>>> = std::sync::OnceLock::new();
    DRAINED.get_or_init(Default::default)
}

/// Reads a child's stdout and stderr while it runs: a child that writes
/// more than a pipe holds (64 KiB, e.g. a client library logging every
/// failed connection while a broker is down) would otherwise block on its
/// next write until the test reads, and seem to hang.
fn drain_output(child: &mut Child) {
    fn read_all(mut r: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    }
    let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else { return };
    drained().lock().unwrap().insert(child.id(), (read_all(out), read_all(err)));
}

/// Waits for `child` and collects what it printed.
fn output_of(mut child: Child) -> Output {
    let Some((out, err)) = drained().lock().unwrap().remove(&child.id()) else { return child.wait_with_output().unwrap() };
    let status = child.wait().unwrap();
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// Waits for a child with a deadline; kills its group on timeout.
pub fn wait_with_timeout(child: Child, limit: Duration) -> Output {
    wait_with_timeout_explained(child, limit, String::new)
}

/// [`wait_with_timeout`], and on timeout `explain` says, before the run is
/// killed, what the test bed holds that the run may have waited for.
pub fn wait_with_timeout_explained(mut child: Child, limit: Duration, explain: impl FnOnce() -> String) -> Output {
    let start = Instant::now();
    loop {
        if let Some(_) = child.try_wait().unwrap() {
            return output_of(child);
        }
        if start.elapsed() > limit {
            let why = explain();
            kill_group(child.id());
            let out = output_of(child);
            panic!("weir run did not finish within {limit:?}; {why}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Checks that `weir` stopped with a fatal error (exit code 3) and never
/// retried it, and returns its standard error: a refusal before the run.
pub fn assert_refused(out: &Output) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(!err.contains("restarting"), "a deterministic failure was retried:\n{err}");
    err
}

/// [`assert_refused`] for a failure met while running: the job says it
/// cannot be restarted.
pub fn assert_fatal_at_once(out: &Output) -> String {
    let err = assert_refused(out);
    assert!(err.contains("cannot be restarted"), "{err}");
    err
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Every file under `dir` with its size and a hash of its content: two
/// listings are equal iff the trees are byte-identical.
pub fn tree_digest(dir: &Path) -> BTreeMap<PathBuf, (u64, u64)> {
    use std::hash::{Hash, Hasher};
    snapshot_tree(dir)
        .into_keys()
        .filter_map(|p| {
            let bytes = std::fs::read(&p).ok()?;
            let mut h = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut h);
            Some((p, (bytes.len() as u64, h.finish())))
        })
        .collect()
}

/// Copies the tree under `from` to `to` (created), keeping its layout.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

/// A spawned process group (`weir run` and its workers) that is killed when
/// dropped, so that no test path, a panic included, leaves processes behind.
/// The group is killed once, at the moment its leader is found to have ended
/// (orphaned workers go with it), and never after, so that a process group id
/// reused by the system is never hit.
pub struct KillOnDrop {
    child: Child,
    status: Option<std::process::ExitStatus>,
}

impl KillOnDrop {
    pub fn new(child: Child) -> Self {
        KillOnDrop { child, status: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has ended.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        if self.status.is_none() {
            if let Some(s) = self.child.try_wait().unwrap() {
                kill_group(self.child.id());
                self.status = Some(s);
            }
        }
        self.status
    }

    /// Waits up to `limit`; `None` if it is still running then (it is left running).
    pub fn wait_for(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the whole group (if still running) and returns the exit status.
    pub fn kill(&mut self) -> std::process::ExitStatus {
        if self.status.is_none() {
            kill_group(self.child.id());
            self.status = Some(self.child.wait().unwrap());
        }
        self.status.unwrap()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.status.is_none() {
            kill_group(self.child.id());
            let _ = self.child.wait();
        }
    }
}

/// A listing of every file under `dir` with its size and modification time.
pub fn snapshot_tree(dir: &Path) -> BTreeMap<PathBuf, (u64, std::time::SystemTime)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                out.insert(e.path(), (m.len(), m.modified().unwrap()));
            }
        }
    }
    out
}
