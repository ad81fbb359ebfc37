//! Kafka → engine → Kafka, weir beside Apache Flink on the same broker and
//! topics (issue 33): JSON messages `{"seq","key","value"}` are read
//! read_committed, keyed by `key`, counted per key, and written as
//! `{"seq","key","value","count"}` to a topic, exactly-once, with
//! checkpoints every second. Flink runs the same job in a MiniCluster
//! (`bench/flink/`); weir runs it with `weir run`, exactly-once and, as a
//! row of its own, at-least-once. A last row is the broker's own limit on
//! this machine: a plain consumer and producer in one process copying the
//! same messages from topic to topic.
//!
//! Engines alternate within a round (the first one changes every round)
//! so that machine noise hits them alike. Every run's output is read back
//! read_committed and checked against the input: every key's counts are
//! exactly 1..n and there are as many records as events.
//!
//! With `--intervals 1s,30s` weir's exactly-once job also runs with longer
//! checkpoint intervals: its sink writes an interval's records to its log
//! as they come, so its peak RSS should not grow with the interval.
//!
//! Usage: weir-bench kafka-flink [--events N] [--keys K] [--rounds R]
//! [--parallelism 1,2] [--intervals 1s,30s] [--no-flink] [--weir PATH]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;

pub struct Options {
    events: u64,
    keys: u64,
    rounds: usize,
    parallelism: Vec<u32>,
    partitions: i32,
    /// Checkpoint intervals of weir's exactly-once job; the first is every
    /// other engine's.
    intervals: Vec<String>,
    flink: bool,
    weir: Option<String>,
}

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let mut o = Options { events: 2_000_000, keys: 1000, rounds: 2, parallelism: vec![1, 2], partitions: 2, intervals: vec!["1s".into()], flink: true, weir: None };
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--events" => o.events = value("--events")?.parse().context("--events: expected a number")?,
            "--keys" => o.keys = value("--keys")?.parse().context("--keys: expected a number")?,
            "--rounds" => o.rounds = value("--rounds")?.parse().context("--rounds: expected a number")?,
            "--partitions" => o.partitions = value("--partitions")?.parse().context("--partitions: expected a number")?,
            "--parallelism" => {
                o.parallelism = value("--parallelism")?
                    .split(',')
                    .map(|p| p.trim().parse::<u32>().with_context(|| format!("--parallelism: `{p}` is not a number (expected a list such as 1,2)")))
                    .collect::<Result<_>>()?
            }
            "--intervals" => {
                o.intervals = value("--intervals")?.split(',').map(|i| i.trim().to_string()).collect();
                for i in &o.intervals {
                    // weir's own parser judges it in full when the job starts.
                    let number = i.trim_end_matches(|c: char| c.is_ascii_alphabetic());
                    if number.is_empty() || number.len() == i.len() || number.parse::<f64>().is_err() {
                        bail!("--intervals: `{i}` is not a duration such as 500ms, 1s or 30s");
                    }
                }
            }
            "--no-flink" => o.flink = false,
            "--weir" => o.weir = Some(value("--weir")?),
            "-h" | "--help" => {
                println!(
                    "weir-bench kafka-flink: Kafka → key_by → running count → exactly-once Kafka, weir beside Apache Flink (bench/flink) on one local broker\n\n\
                     Options:\n  --events N         messages in the input topic (default 2000000)\n  --keys K           distinct keys (default 1000)\n  --rounds R         rounds; engines alternate within each (default 2); means are reported\n  --parallelism L    parallelisms to run, comma-separated (default 1,2)\n  --partitions P     partitions of the input and output topics (default 2)\n  --intervals L      checkpoint intervals of weir exactly-once, comma-separated (default 1s);\n                     the first is also Flink's and weir at-least-once's (Flink's is 1s)\n  --no-flink         weir and the broker's limit only\n  --weir PATH        the weir binary (default: $CARGO_TARGET_DIR/release/weir)"
                );
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench kafka-flink --help"),
        }
    }
    if o.intervals.first().is_none_or(|i| i != "1s") && o.flink {
        bail!("--intervals: the first interval must be 1s, Flink's (or pass --no-flink)");
    }
    if o.parallelism.is_empty() || o.parallelism.contains(&0) {
        bail!("--parallelism: expected positive numbers");
    }
    Ok(Some(o))
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Engine {
    Flink,
    /// With the checkpoint interval of this index in `--intervals`.
    WeirExactlyOnce(usize),
    WeirAtLeastOnce,
    /// A plain consumer and producer: what the broker allows.
    Broker,
}

impl Engine {
    fn name(self, o: &Options) -> String {
        match self {
            Engine::Flink => "flink exactly-once".into(),
            Engine::WeirExactlyOnce(0) if o.intervals.len() == 1 => "weir exactly-once".into(),
            Engine::WeirExactlyOnce(i) => format!("weir exactly-once, checkpoints every {}", o.intervals[i]),
            Engine::WeirAtLeastOnce => "weir at-least-once".into(),
            Engine::Broker => "plain consumer → producer".into(),
        }
    }

    /// The engine's checkpoint interval.
    fn interval(self, o: &Options) -> &str {
        match self {
            Engine::WeirExactlyOnce(i) => &o.intervals[i],
            _ => &o.intervals[0],
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Sample {
    /// Seconds the job ran (Flink: from submission, without its JVM start).
    wall_s: f64,
    /// CPU seconds of the engine's whole process tree.
    cpu_s: f64,
    /// The largest sum of the resident sets of the engine's processes.
    peak_rss_mb: f64,
}

pub fn run(o: &Options) -> Result<()> {
    let weir = super::weir_binary(o.weir.clone())?;
    let flink = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("flink/run");
    if o.flink && !flink.exists() {
        bail!("{} is missing; pass --no-flink to run without Flink", flink.display());
    }
    let port = free_port_pair()?;
    let broker = super::kafka::start(port)?;
    let input = "bench-in";
    broker.create_topic(input, o.partitions)?;
    eprintln!("filling {input} with {} events over {} keys ...", o.events, o.keys);
    broker.produce_events(input, o.events, o.keys, o.partitions)?;

    let mut engines = vec![Engine::WeirExactlyOnce(0), Engine::WeirAtLeastOnce];
    engines.extend((1..o.intervals.len()).map(Engine::WeirExactlyOnce));
    if o.flink {
        engines.insert(0, Engine::Flink);
    }
    let mut samples: HashMap<(u32, Engine), Vec<Sample>> = HashMap::new();
    let mut run_no = 0;
    for round in 0..o.rounds {
        for &p in &o.parallelism {
            let mut order = engines.clone();
            let n = order.len();
            order.rotate_left(round % n);
            for engine in order {
                run_no += 1;
                let output = format!("bench-out-{run_no}");
                broker.create_topic(&output, o.partitions)?;
                eprintln!("round {}/{}: parallelism {p}, {} ...", round + 1, o.rounds, engine.name(o));
                let sample = match engine {
                    Engine::Flink => run_flink(&flink, &broker.bootstrap, input, &output, p, run_no)?,
                    _ => run_weir(&weir, engine, engine.interval(o), &broker.bootstrap, input, &output, p)?,
                };
                check_output(&broker.bootstrap, &output, o.events, o.keys).with_context(|| format!("{} at parallelism {p}", engine.name(o)))?;
                eprintln!("  {:.0} records/s, {:.1} CPU-s, peak RSS {:.0} MB", o.events as f64 / sample.wall_s, sample.cpu_s, sample.peak_rss_mb);
                samples.entry((p, engine)).or_default().push(sample);
            }
        }
        let output = format!("bench-out-{}", run_no + 1);
        run_no += 1;
        broker.create_topic(&output, o.partitions)?;
        eprintln!("round {}/{}: {} ...", round + 1, o.rounds, Engine::Broker.name(o));
        samples.entry((0, Engine::Broker)).or_default().push(copy_topic(&broker.bootstrap, input, &output, o.events)?);
    }
    print_table(o, &samples);
    Ok(())
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn print_table(o: &Options, samples: &HashMap<(u32, Engine), Vec<Sample>>) {
    let stat = |key: (u32, Engine)| -> Option<(f64, f64, f64)> {
        let s = samples.get(&key)?;
        let rate = mean(&s.iter().map(|s| o.events as f64 / s.wall_s).collect::<Vec<_>>());
        let per_cpu = mean(&s.iter().map(|s| o.events as f64 / s.cpu_s.max(1e-9)).collect::<Vec<_>>());
        let rss = s.iter().map(|s| s.peak_rss_mb).fold(0.0, f64::max);
        Some((rate, per_cpu, rss))
    };
    println!(
        "events: {}, keys: {}, input and output topics of {} partitions, checkpoints every 1s unless said, rounds: {} (means; peak RSS the largest), cores: {}",
        o.events,
        o.keys,
        o.partitions,
        o.rounds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| parallelism | engine | records/s (wall) | CPU-s per run | records per CPU-second | peak RSS, MB (process tree) | ÷ Flink, wall | ÷ Flink, per CPU-second | ÷ Flink, RSS |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &p in &o.parallelism {
        let flink = stat((p, Engine::Flink));
        let weir_rows = [Engine::Flink, Engine::WeirExactlyOnce(0), Engine::WeirAtLeastOnce].into_iter().chain((1..o.intervals.len()).map(Engine::WeirExactlyOnce));
        for engine in weir_rows {
            let Some((rate, per_cpu, rss)) = stat((p, engine)) else { continue };
            let cpu = mean(&samples[&(p, engine)].iter().map(|s| s.cpu_s).collect::<Vec<_>>());
            let vs = |x: f64, f: f64| if engine == Engine::Flink { "-".to_string() } else { format!("{:.2}×", x / f) };
            let (w, c, r) = match flink {
                Some((fr, fc, frss)) => (vs(rate, fr), vs(per_cpu, fc), vs(rss, frss)),
                None => ("-".into(), "-".into(), "-".into()),
            };
            println!("| {p} | {} | {rate:.0} | {cpu:.1} | {per_cpu:.0} | {rss:.0} | {w} | {c} | {r} |", engine.name(o));
        }
    }
    if let Some((rate, per_cpu, rss)) = stat((0, Engine::Broker)) {
        let cpu = mean(&samples[&(0, Engine::Broker)].iter().map(|s| s.cpu_s).collect::<Vec<_>>());
        println!("| - | {} | {rate:.0} | {cpu:.1} | {per_cpu:.0} | {rss:.0} | | | |", Engine::Broker.name(o));
    }
}

fn weir_pipeline(engine: Engine, interval: &str, bootstrap: &str, input: &str, output: &str, parallelism: u32) -> String {
    let guarantee = match engine {
        Engine::WeirAtLeastOnce => "\n    guarantee: at-least-once".to_string(),
        _ => format!("\n    progress_topic: {output}-progress"),
    };
    format!(
        "name: kafka-bench\nparallelism: {parallelism}\ncheckpoint:\n  interval: {interval}\nsource:\n  kafka:\n    bootstrap_servers: {bootstrap}\n    topic: {input}\n    schema: {{seq: int64, key: int64, value: int64}}\n    stop: end\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  kafka:\n    bootstrap_servers: {bootstrap}\n    topic: {output}\n    key: key{guarantee}\n"
    )
}

fn run_weir(weir: &Path, engine: Engine, interval: &str, bootstrap: &str, input: &str, output: &str, parallelism: u32) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    std::fs::write(dir.join("p.yaml"), weir_pipeline(engine, interval, bootstrap, input, output, parallelism))?;
    let mut command = Command::new(weir);
    command.current_dir(&dir).args(["run", "p.yaml", "--state-dir", "state"]).env("RUST_LOG", "warn");
    let measured = run_measured(command, "weir run");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(measured?.1)
}

fn run_flink(script: &Path, bootstrap: &str, input: &str, output: &str, parallelism: u32, run_no: usize) -> Result<Sample> {
    let mut command = Command::new(script);
    command.args(["--bootstrap", bootstrap, "--input", input, "--output", output, "--parallelism", &parallelism.to_string(), "--run-id", &format!("bench-{}-{run_no}", std::process::id())]);
    let (stdout, sample) = run_measured(command, "bench/flink/run")?;
    let stdout = String::from_utf8_lossy(&stdout);
    let line = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("bench/flink/run printed no JSON line")?;
    let report: serde_json::Value = serde_json::from_str(line).with_context(|| format!("bench/flink/run printed `{line}`"))?;
    // Flink's own figure: from job submission, without the JVM's start.
    let wall_s = report["submit_to_end_s"].as_f64().context("the Flink report has no submit_to_end_s")?;
    Ok(Sample { wall_s, ..sample })
}

/// Runs `command` to its end, measuring its wall time, the CPU time and
/// the peak resident set of its process tree; returns its stdout.
fn run_measured(mut command: Command, what: &str) -> Result<(Vec<u8>, Sample)> {
    let cpu0 = super::children_cpu_seconds();
    let t0 = Instant::now();
    let child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("starting {what}"))?;
    let rss = RssSampler::start(child.id());
    let out = child.wait_with_output().with_context(|| format!("running {what}"))?;
    let sample = Sample { wall_s: t0.elapsed().as_secs_f64(), peak_rss_mb: rss.stop(), cpu_s: super::children_cpu_seconds() - cpu0 };
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((out.stdout, sample))
}

/// Samples the summed resident set of a process and its descendants.
struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<f64>,
}

impl RssSampler {
    fn start(root: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0u64;
            while !flag.load(Ordering::Relaxed) {
                peak = peak.max(tree_rss_kb(root));
                std::thread::sleep(Duration::from_millis(50));
            }
            peak as f64 / 1024.0
        });
        RssSampler { stop, thread }
    }

    fn stop(self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(0.0)
    }
}

/// The resident set, in KiB, of `root` and every process below it.
fn tree_rss_kb(root: u32) -> u64 {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut rss: HashMap<u32, u64> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else { continue };
        let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<u64>().ok());
        if let Some(ppid) = field("PPid:") {
            children.entry(ppid as u32).or_default().push(pid);
        }
        rss.insert(pid, field("VmRSS:").unwrap_or(0));
    }
    let (mut total, mut stack) = (0, vec![root]);
    while let Some(p) = stack.pop() {
        total += rss.get(&p).copied().unwrap_or(0);
        stack.extend(children.get(&p).into_iter().flatten());
    }
    total
}

/// Reads `topic` read_committed to its end and checks it against the
/// input: `events` records, and every key's counts exactly 1..n, where n
/// is how many of the `events` input events have that key.
fn check_output(bootstrap: &str, topic: &str, events: u64, keys: u64) -> Result<()> {
    let mut counts: HashMap<i64, Vec<u64>> = HashMap::new();
    let mut total = 0u64;
    super::kafka::read_committed_to_end(bootstrap, topic, |payload| {
        let v: serde_json::Value = serde_json::from_slice(payload).context("an output message is not JSON")?;
        let (key, count) = (v["key"].as_i64(), v["count"].as_u64());
        let (Some(key), Some(count)) = (key, count) else { bail!("an output message lacks key or count: {v}") };
        counts.entry(key).or_default().push(count);
        total += 1;
        Ok(())
    })?;
    if total != events {
        bail!("{topic} holds {total} committed records, expected {events}");
    }
    for key in 0..keys.min(events) {
        let expected = events / keys + u64::from(key < events % keys);
        let mut c = counts.remove(&(key as i64)).unwrap_or_default();
        c.sort_unstable();
        if c.len() as u64 != expected || c.iter().enumerate().any(|(i, n)| *n != i as u64 + 1) {
            bail!("key {key}: {} records with counts {:?}…, expected counts 1..{expected}", c.len(), &c[..c.len().min(5)]);
        }
    }
    if let Some(k) = counts.keys().next() {
        bail!("{topic} holds records of key {k}, which the input does not have");
    }
    Ok(())
}

/// The broker's limit: one process consumes `input` and produces every
/// message to `output` unchanged (idempotent producer, acks=all, no
/// transactions), timed until the last one is acknowledged.
fn copy_topic(bootstrap: &str, input: &str, output: &str, events: u64) -> Result<Sample> {
    let start_cpu = process_cpu_seconds();
    let t0 = Instant::now();
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let mut copied = 0u64;
    super::kafka::read_committed_to_end(bootstrap, input, |payload| {
        super::kafka::send(&producer, BaseRecord::<(), [u8]>::to(output).payload(payload)).with_context(|| format!("producing to {output}"))?;
        copied += 1;
        Ok(())
    })?;
    producer.flush(Duration::from_secs(120)).context("flushing the copy")?;
    let wall_s = t0.elapsed().as_secs_f64();
    if copied != events {
        bail!("the plain consumer read {copied} messages, expected {events}");
    }
    let peak_rss_mb = own_peak_rss_mb();
    Ok(Sample { wall_s, cpu_s: process_cpu_seconds() - start_cpu, peak_rss_mb })
}

fn process_cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn own_peak_rss_mb() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u.ru_maxrss as f64 / 1024.0
}

/// A pair of free loopback ports below the range tests hand out.
fn free_port_pair() -> Result<u16> {
    for offset in 0..400u16 {
        let p = 15_000 + ((std::process::id() as u16).wrapping_mul(7).wrapping_add(offset * 11)) % 4_900;
        let ok = [p, p + 1].iter().all(|q| std::net::TcpListener::bind(("127.0.0.1", *q)).is_ok());
        if ok {
            return Ok(p);
        }
    }
    bail!("no free pair of loopback ports between 15000 and 19900")
}
