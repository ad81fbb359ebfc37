//! Throughput and checkpoint overhead of the runtime, measured end to end
//! through the real `weir run` (worker processes, loopback TCP, checkpoints
//! to local disk). Prints a table; configurations are interleaved round by
//! round so that machine noise hits them alike, and medians are reported.
//!
//! Pipeline: generator (rate 0) → key_by key → running_count → blackhole.
//!
//! Usage: weir-bench [--events N] [--rounds R] [--weir PATH]
//!
//! `weir-bench recovery` times recovery after a worker kill; `weir-bench
//! operator` measures the operator (see `operator.rs`); `weir-bench storage`
//! compares checkpoints to local disk and to S3 (see `storage.rs`);
//! `weir-bench sinks` the exactly-once sinks (see `sinks.rs`);
//! `weir-bench kafka-flink` Kafka → Kafka beside Apache Flink (see
//! `kafka_flink.rs`);
//! `weir-bench checkpoint-cost` checkpoints of a million keys (see
//! `checkpoint_cost.rs`); `weir-bench backpressure` aligned vs unaligned
//! checkpoints under backpressure (see `backpressure.rs`); `weir-bench
//! joins` the interval, window and regular joins (see `joins.rs`);
//! `weir-bench tls` two pod-mode workers over plain TCP and with `spec.tls`'s
//! mutual TLS (see `tls.rs`).

mod backpressure;
mod checkpoint_cost;
mod joins;
mod kafka_flink;
mod operator;
mod kafka;
mod sinks;
mod storage;
mod tls;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

struct Config {
    parallelism: u32,
    interval: &'static str,
}

struct Sample {
    wall_s: f64,
    cpu_s: f64,
    checkpoints: u64,
}

fn children_cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn weir_binary(arg: Option<String>) -> Result<PathBuf> {
    if let Some(p) = arg.or_else(|| std::env::var("WEIR_BIN").ok()) {
        return Ok(PathBuf::from(p));
    }
    target_binary("weir", "cargo build --release -p weir-runtime` or pass `--weir PATH")
}

/// A binary of this workspace's release build.
fn target_binary(name: &str, build: &str) -> Result<PathBuf> {
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let p = target.join("release").join(name);
    if !p.exists() {
        bail!("{} does not exist: build it with `{build}`", p.display());
    }
    Ok(p)
}

fn run_once(weir: &PathBuf, cfg: &Config, events: u64, batch: u32) -> Result<Sample> {
    let dir = tempfile_dir()?;
    let yaml = format!(
        "name: bench\nparallelism: {}\ncheckpoint:\n  interval: {}\nsource:\n  generator:\n    events: {events}\n    keys: 1000\n    rate: 0\n    batch_size: {batch}\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  blackhole: {{}}\n",
        cfg.parallelism, cfg.interval
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    let cpu0 = children_cpu_seconds();
    let t0 = Instant::now();
    let out = Command::new(weir).current_dir(&dir).args(["run", "p.yaml", "--state-dir", "state"]).env("RUST_LOG", "warn").output().context("running weir")?;
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu_s = children_cpu_seconds() - cpu0;
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        bail!("weir run failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).context("reading the run summary")?;
    if summary["records_out"].as_u64() != Some(events) {
        bail!("the run processed {} of {events} events", summary["records_out"]);
    }
    Ok(Sample { wall_s, cpu_s, checkpoints: summary["checkpoints"].as_u64().unwrap_or(0) })
}

fn tempfile_dir() -> Result<PathBuf> {
    let p = std::env::temp_dir().join(format!("weir-bench-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&p)?;
    Ok(p)
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// The median of `v`; 0 when empty.
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The job's status through `weir status`, if it answers.
fn status(weir: &PathBuf, dir: &PathBuf) -> Option<serde_json::Value> {
    let out = Command::new(weir).current_dir(dir).args(["status", "--state-dir", "state"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// Recovery time: from SIGKILL of one worker to the first checkpoint
/// completed (and so output committed) by the restored run.
fn recovery(weir: &PathBuf, runs: usize, interval: &str) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let mut times = Vec::new();
    for run in 0..runs {
        let dir = tempfile_dir()?;
        let yaml = format!(
            "name: recovery\nparallelism: 2\ncheckpoint:\n  interval: {interval}\nsource:\n  generator:\n    keys: 1000\n    rate: 100000\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out\n"
        );
        std::fs::write(dir.join("p.yaml"), yaml)?;
        let mut child = Command::new(weir)
            .current_dir(&dir)
            .args(["run", "p.yaml", "--state-dir", "state"])
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()?;
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let (before, run_before) = loop {
            if Instant::now() > deadline {
                bail!("the job never completed two checkpoints");
            }
            if let Some(st) = status(weir, &dir) {
                if let Some(id) = st["latest_checkpoint"]["id"].as_u64().filter(|&id| id >= 2) {
                    break (id, st["run_id"].as_str().unwrap_or_default().to_string());
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let info: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("state/recovery/run.json"))?)?;
        let victim = info["worker_pids"][run % 2].as_u64().context("worker pid")? as i32;
        let t0 = Instant::now();
        unsafe { libc::kill(victim, libc::SIGKILL) };
        let recovered = loop {
            if t0.elapsed() > std::time::Duration::from_secs(60) {
                bail!("no checkpoint completed within 60 s after the kill");
            }
            if let Some(st) = status(weir, &dir) {
                let run_id = st["run_id"].as_str().unwrap_or_default();
                if run_id != run_before && st["latest_checkpoint"]["id"].as_u64().unwrap_or(0) > before {
                    break t0.elapsed().as_secs_f64();
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!("run {}/{runs}: {recovered:.2} s", run + 1);
        times.push(recovered);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!("recovery from a worker kill to the first checkpoint committed by the restored run (parallelism 2, checkpoints every {interval}, {runs} runs)");
    println!("| median | min | max |");
    println!("|---|---|---|");
    println!("| {:.2} s | {:.2} s | {:.2} s |", median(times.clone()), times[0], times[times.len() - 1]);
    Ok(())
}

fn main() -> Result<()> {
    let mut events: u64 = 20_000_000;
    let mut rounds = 3;
    let mut batch = 1024;
    let mut weir = None;
    let mut mode_recovery = false;
    let mut interval = "500ms".to_string();
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("operator") {
        args.next();
        return match operator::parse(args)? {
            Some(o) => operator::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("sinks") {
        args.next();
        return match sinks::parse(args)? {
            Some(o) => sinks::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("kafka-flink") {
        args.next();
        return match kafka_flink::parse(args)? {
            Some(o) => kafka_flink::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("checkpoint-cost") {
        args.next();
        return match checkpoint_cost::parse(args)? {
            Some(o) => checkpoint_cost::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("joins") {
        args.next();
        return match joins::parse(args)? {
            Some(o) => joins::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("backpressure") {
        args.next();
        return match backpressure::parse(args)? {
            Some(o) => backpressure::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("tls") {
        args.next();
        return match tls::parse(args)? {
            Some(o) => tls::run(&o),
            None => Ok(()),
        };
    }
    if args.peek().map(String::as_str) == Some("storage") {
        args.next();
        return match storage::parse(args)? {
            Some(o) => storage::run(&o),
            None => Ok(()),
        };
    }
    while let Some(a) = args.next() {
        match a.as_str() {
            "--events" => events = args.next().context("--events N")?.parse()?,
            "--rounds" => rounds = args.next().context("--rounds R")?.parse()?,
            "--batch-size" => batch = args.next().context("--batch-size N")?.parse()?,
            "--weir" => weir = args.next(),
            "recovery" => mode_recovery = true,
            "--interval" => interval = args.next().context("--interval DURATION")?,
            "-h" | "--help" => {
                println!("weir-bench: throughput of generator -> key_by -> running_count -> blackhole\nweir-bench recovery: time from a worker kill to the restored run's first completed checkpoint\nweir-bench operator: the operator's memory and reconcile latency with many StreamJobs (see weir-bench operator --help)\nweir-bench storage: checkpoints to local disk vs. S3 (MinIO), side by side (see weir-bench storage --help)\nweir-bench sinks: the exactly-once sinks side by side: file, PostgreSQL in each mode, Kafka (see weir-bench sinks --help)\nweir-bench kafka-flink: Kafka → key_by → count → exactly-once Kafka, weir beside Apache Flink on one broker (see weir-bench kafka-flink --help)\nweir-bench checkpoint-cost: checkpoint duration and size with a million keys, throughput with checkpoints every second vs none (see weir-bench checkpoint-cost --help)\nweir-bench backpressure: checkpoint duration aligned vs unaligned, with and without backpressure (see weir-bench backpressure --help)\nweir-bench joins: interval, window and regular joins, records per second and state size, checkpoints every second vs off (see weir-bench joins --help)\nweir-bench tls: two pod-mode workers over plain TCP and with spec.tls's mutual TLS, side by side (see weir-bench tls --help)\n\nOptions:\n  --interval D     checkpoint interval for `recovery` (default 500ms); --rounds is the number of kills\n  --events N       events per run (default 20000000)\n  --rounds R       runs per configuration; medians are reported (default 3)\n  --batch-size N   generator batch size (default 1024)\n  --weir PATH      the weir binary (default: $CARGO_TARGET_DIR/release/weir)");
                return Ok(());
            }
            other => bail!("unknown argument {other}; see --help"),
        }
    }
    let weir = weir_binary(weir)?;
    if mode_recovery {
        return recovery(&weir, rounds, &interval);
    }
    let configs = [
        Config { parallelism: 1, interval: "0s" },
        Config { parallelism: 1, interval: "1s" },
        Config { parallelism: 2, interval: "0s" },
        Config { parallelism: 2, interval: "1s" },
    ];
    let mut samples: Vec<Vec<Sample>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, cfg) in configs.iter().enumerate() {
            eprintln!("round {}/{rounds}: parallelism {} checkpoints {} ...", round + 1, cfg.parallelism, cfg.interval);
            samples[i].push(run_once(&weir, cfg, events, batch)?);
        }
    }
    println!("events per run: {events}, generator batch size: {batch}, rounds: {rounds}, cores: {}", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    println!("| parallelism | checkpoints | records/s (wall) | records per CPU-second | CPU cores used | checkpoints taken | throughput vs. off |");
    println!("|---|---|---|---|---|---|---|");
    let mut base = 0.0;
    for (i, cfg) in configs.iter().enumerate() {
        let rate = median(samples[i].iter().map(|s| events as f64 / s.wall_s).collect());
        let per_cpu = median(samples[i].iter().map(|s| events as f64 / s.cpu_s).collect());
        let cores = median(samples[i].iter().map(|s| s.cpu_s / s.wall_s).collect());
        let ckpts = median(samples[i].iter().map(|s| s.checkpoints as f64).collect());
        if cfg.interval == "0s" {
            base = rate;
        }
        let vs = if cfg.interval == "0s" { "-".to_string() } else { format!("{:+.1}%", (rate / base - 1.0) * 100.0) };
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.0} | {} |",
            cfg.parallelism,
            if cfg.interval == "0s" { "off" } else { "every 1s" },
            rate,
            per_cpu,
            cores,
            ckpts,
            vs
        );
    }
    Ok(())
}
