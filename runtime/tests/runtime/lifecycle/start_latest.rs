//! Kafka `start: latest` under random crashes, most of them before the first
//! checkpoint, while a producer keeps writing.
//!
//! `latest` is resolved once for a job's history, when its first run opens
//! the topic: every record produced after that moment is read exactly once,
//! none produced before the job started is read at all, whatever dies and
//! restarts in between (a worker, which `weir run` restores, or the whole
//! process tree, restarted with `--restore latest`). A restart that resolved
//! `latest` again would skip what was produced while it was down; one that
//! fell back to `earliest` would read what came before the start.
//!
//! The oracle is the producer's own count: it numbers its records `n`
//! (partition `n % 2`) and knows which it had sent when the job was spawned
//! and when the first run had recorded its start for both partitions.
//! Seeds work as in the other randomized lifecycle tests
//! (`WEIR_LIFECYCLE_SEED`, `WEIR_LIFECYCLE_SEQUENCES`).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::*;

const PARTITIONS: i64 = 2;
/// Records per delivery (a multiple of `PARTITIONS`): one delivery may be in
/// flight at any moment, delivered or not.
const BATCH: i64 = 20;

/// Numbers records into the topic until stopped, `BATCH` at a time; `sent`
/// is one past the last delivered record.
struct Producer {
    sent: Arc<AtomicI64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Producer {
    fn start(topic: &str, first: i64) -> Producer {
        let (sent, stop) = (Arc::new(AtomicI64::new(first)), Arc::new(AtomicBool::new(false)));
        let (s, st, topic) = (sent.clone(), stop.clone(), topic.to_string());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                let n = s.load(Ordering::SeqCst);
                let batch: Vec<(i32, String)> = (n..n + BATCH).map(|n| ((n % PARTITIONS) as i32, format!(r#"{{"n":{n}}}"#))).collect();
                kafka::produce(&topic, &batch, None);
                s.store(n + BATCH, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Producer { sent, stop, thread: Some(thread) }
    }

    fn sent(&self) -> i64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Stops producing; returns one past the last record sent.
    fn finish(&mut self) -> i64 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.sent()
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.finish();
    }
}

/// How many distinct splits the recorded start positions of the job cover
/// (`<state>/eo-test/source-start/subtask-*.json`).
fn recorded_start_splits(job: &Job) -> usize {
    let mut splits = std::collections::HashSet::new();
    for e in std::fs::read_dir(job.path("state/eo-test/source-start")).into_iter().flatten().flatten() {
        let Ok(text) = std::fs::read_to_string(e.path()) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { continue };
        splits.extend(v["splits"].as_object().into_iter().flat_map(|o| o.keys().cloned()));
    }
    splits.len()
}

/// The smallest `n >= from` of partition `p`.
fn first_of_partition_from(p: i64, from: i64) -> i64 {
    from + (p - from.rem_euclid(PARTITIONS)).rem_euclid(PARTITIONS)
}

/// Starts `weir run` (info logs) with its output in `runs/<n>.stderr` of the job directory.
fn spawn(job: &Job, n: usize, extra: &[&str]) -> KillOnDrop {
    use std::os::unix::process::CommandExt;
    let logs = job.path("runs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut c = job.command(extra);
    c.env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(logs.join(format!("{n:02}.stderr"))).unwrap())
        .process_group(0);
    KillOnDrop::new(c.spawn().unwrap())
}

/// Asks for a stopping savepoint until one is taken; the last refusal otherwise.
fn stop_with_savepoint(job: &Job) -> Result<String, String> {
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(300));
        let out = job.weir(&["savepoint", "--state-dir", "state", "--stop"]).output().unwrap();
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).trim().to_string());
        }
        last = stderr(&out);
    }
    Err(format!("no stopping savepoint could be taken in 30 s; the last attempt said: {last}"))
}

fn run_one(seed: u64) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let parallelism: u32 = rng.random_range(1..=3);
    let interval_ms = [300, 1000, 3000][rng.random_range(0..3)];
    let kills: Vec<(u64, bool)> = (0..rng.random_range(1..=4)).map(|_| (rng.random_range(0..1500), rng.random_bool(0.5))).collect();
    println!("  parallelism {parallelism}, checkpoint interval {interval_ms} ms, kills (after ms, whole tree): {kills:?}");

    let topic = kafka::topic("latest-lifecycle");
    kafka::create_topic(&topic, PARTITIONS as i32);
    let mut producer = Producer::start(&topic, 0);
    std::thread::sleep(Duration::from_millis(200));
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: {interval_ms}ms\nsource:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    schema: {{n: int64}}\n    start: latest\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n",
        kafka::bootstrap()
    );
    let job = Job::with_pipeline(&yaml, 0, 1);
    drive(&job, &mut producer, kills).map_err(|e| {
        // The job directory goes with `job`: a copy keeps its logs.
        let kept = std::env::temp_dir().join(format!("weir-start-latest-{seed}"));
        let _ = std::process::Command::new("cp").arg("-a").arg(job.dir.path()).arg(&kept).status();
        format!("{e}\n  job directory kept (logs in runs/): {}", kept.display())
    })
}

/// Runs the job through `kills` while `producer` writes, stops it with a
/// savepoint, and checks what it committed.
fn drive(job: &Job, producer: &mut Producer, kills: Vec<(u64, bool)>) -> Result<(), String> {
    let before_spawn = producer.sent();
    let mut runs = 0;
    let mut run = spawn(job, runs, &[]);
    let start = Instant::now();
    while recorded_start_splits(job) < PARTITIONS as usize {
        if start.elapsed() > Duration::from_secs(30) {
            return Err("the first run never recorded where it starts".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // The delivery in flight now may have landed before the start was
    // resolved; every later one was sent after it.
    let resolved_by = producer.sent() + BATCH;
    println!("  {before_spawn} records sent before the spawn; every one from {resolved_by} on was sent after the start was recorded");

    for (after_ms, tree) in kills {
        std::thread::sleep(Duration::from_millis(after_ms));
        if tree {
            println!("  killing the process tree, restarting with --restore latest");
            run.kill();
            runs += 1;
            run = spawn(job, runs, &["--restore", "latest"]);
        } else if let Some((pids, run_id)) = job.worker_pids() {
            println!("  killing worker {} of {run_id}", pids[0]);
            kill(pids[0]);
            let t = Instant::now();
            while job.worker_pids().is_none_or(|(_, r)| r == run_id) {
                if t.elapsed() > Duration::from_secs(30) {
                    return Err("weir run did not restart the killed worker's job".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    // Everything sent is read and committed, then the job stops.
    let end = producer.finish();
    let last = |p: i64| first_of_partition_from(p, end - PARTITIONS);
    let t = Instant::now();
    loop {
        let got = values_of(job);
        if (0..PARTITIONS).all(|p| got.iter().any(|&n| n == last(p))) {
            break;
        }
        if t.elapsed() > Duration::from_secs(60) || run.try_wait().is_some() {
            return Err(format!("the last records sent ({}, {}) were never committed; {} committed", last(0), last(1), got.len()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop_with_savepoint(job)?;
    if !run.wait_for(Duration::from_secs(30)).is_some_and(|s| s.success()) {
        return Err("the job did not stop with its savepoint".into());
    }

    let got = values_of(job);
    for p in 0..PARTITIONS {
        let mine: Vec<i64> = got.iter().copied().filter(|n| n % PARTITIONS == p).collect();
        let (Some(&first), Some(&max)) = (mine.first(), mine.last()) else { return Err(format!("partition {p}: nothing committed")) };
        let expected: Vec<i64> = (first..=max).step_by(PARTITIONS as usize).collect();
        if mine != expected {
            let dup = mine.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
            let gap = expected.iter().find(|n| mine.binary_search(n).is_err());
            return Err(format!("partition {p}: not every record from {first} to {max} once (first repeated: {dup:?}, first missing: {gap:?})"));
        }
        if first < first_of_partition_from(p, before_spawn) {
            return Err(format!("partition {p}: starts at {first}, sent before the job started ({before_spawn} were): `latest` was not honoured"));
        }
        let must = first_of_partition_from(p, resolved_by);
        if first > must {
            return Err(format!("partition {p}: starts at {first}, but {must} was sent after the first run recorded its start: records were skipped"));
        }
        if max != last(p) {
            return Err(format!("partition {p}: ends at {max}, the last sent was {}", last(p)));
        }
    }
    println!("  {} records, each once, from the first run's start on", got.len());
    Ok(())
}

fn values_of(job: &Job) -> Vec<i64> {
    let mut v: Vec<i64> = job.committed_lines().iter().filter_map(|l| l["n"].as_i64()).collect();
    v.sort();
    v
}

#[test]
fn random_crashes_before_and_after_the_first_checkpoint_with_start_latest_skip_and_repeat_nothing() {
    let seed = super::env_u64("WEIR_LIFECYCLE_SEED").unwrap_or_else(|| rand::random::<u32>() as u64);
    let sequences = super::env_u64("WEIR_LIFECYCLE_SEQUENCES").unwrap_or(2);
    let reproduce = "cargo test --release --workspace --test runtime lifecycle::start_latest";
    let mut failures = Vec::new();
    for k in 0..sequences {
        let s = seed.wrapping_add(k);
        println!("sequence {}/{sequences}: seed {s} (alone: WEIR_LIFECYCLE_SEED={s} WEIR_LIFECYCLE_SEQUENCES=1 {reproduce})", k + 1);
        match run_one(s) {
            Ok(()) => println!("sequence seed {s}: ok"),
            Err(e) => {
                println!("FAILED sequence seed {s}: {e}");
                failures.push(format!("seed {s}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {sequences} sequences failed:\n{}", failures.len(), failures.join("\n"));
}
