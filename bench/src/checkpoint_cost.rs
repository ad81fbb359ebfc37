//! What checkpoints cost with a large keyed state: `weir-bench
//! checkpoint-cost` runs generator → key_by → running_count → blackhole
//! with a million keys (or `--keys N`) through the real `weir run`, with
//! checkpoints off and every second, rounds interleaved, and prints a table
//! of throughput, checkpoint duration (p50, p99, max, from the
//! coordinator's "checkpoint complete" log lines: trigger to metadata
//! written) and what each checkpoint wrote (full: the retained checkpoint
//! directories; incremental: the shared files, by the checkpoint that
//! wrote them).
//!
//! Two workloads, each with full and with incremental checkpoints: every
//! key changing between checkpoints (rate 0: the generator cycles through
//! all keys many times a second) and a sparse one (a rate at which about a
//! tenth of the keys change per interval), where an incremental snapshot
//! writes less.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

pub struct Options {
    weir: PathBuf,
    keys: u64,
    events: u64,
    rounds: usize,
    parallelism: u32,
}

const HELP: &str = "weir-bench checkpoint-cost: checkpoint duration and size with a large keyed state, and throughput with checkpoints every second vs none

Options:
  --keys N         distinct keys of the running count (default 1000000)
  --events N       events per dense run (default 100000000)
  --rounds R       runs per configuration, interleaved (default 3)
  --parallelism P  subtasks (default 2)
  --weir PATH      the weir binary (default: $CARGO_TARGET_DIR/release/weir)";

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let (mut weir, mut keys, mut events, mut rounds, mut parallelism) = (None, 1_000_000, 100_000_000, 3, 2);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--keys" => keys = args.next().context("--keys N")?.parse().context("--keys expects a number")?,
            "--events" => events = args.next().context("--events N")?.parse().context("--events expects a number")?,
            "--rounds" => rounds = args.next().context("--rounds R")?.parse().context("--rounds expects a number")?,
            "--parallelism" => parallelism = args.next().context("--parallelism P")?.parse().context("--parallelism expects a number")?,
            "--weir" => weir = args.next(),
            "-h" | "--help" => {
                println!("{HELP}");
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench checkpoint-cost --help"),
        }
    }
    if keys == 0 || events == 0 || rounds == 0 || parallelism == 0 {
        bail!("--keys, --events, --rounds and --parallelism must be above 0");
    }
    Ok(Some(Options { weir: super::weir_binary(weir)?, keys, events, rounds, parallelism }))
}

struct Workload {
    name: &'static str,
    interval: &'static str,
    /// Generator rate (0: as fast as it goes).
    rate: u64,
    incremental: bool,
}

#[derive(Default)]
struct Sample {
    records_per_s: f64,
    /// CPU seconds of every process of the run per million records.
    cpu_s_per_m: f64,
    durations_ms: Vec<f64>,
    sizes: Vec<u64>,
    checkpoints: u64,
}

fn run_once(o: &Options, w: &Workload) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    // The sparse run lasts about 20 intervals.
    let events = if w.rate == 0 { o.events } else { w.rate * 20 };
    let yaml = format!(
        "name: cost\nparallelism: {}\ncheckpoint:\n  interval: {}\n  retain: 5\n  incremental: {}\nsource:\n  generator:\n    events: {events}\n    keys: {}\n    rate: {}\n    batch_size: 1024\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  blackhole: {{}}\n",
        o.parallelism, w.interval, w.incremental, o.keys, w.rate
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    let t0 = Instant::now();
    let cpu0 = super::children_cpu_seconds();
    let out = Command::new(&o.weir)
        .current_dir(&dir)
        .args(["run", "p.yaml", "--state-dir", "state"])
        .env("RUST_LOG", "weir_runtime::checkpoint=info,warn")
        .output()
        .context("running weir")?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = super::children_cpu_seconds() - cpu0;
    if !out.status.success() {
        bail!("weir run failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).context("reading the run summary")?;
    if summary["records_out"].as_u64() != Some(events) {
        bail!("the run processed {} of {events} events", summary["records_out"]);
    }
    let durations_ms = durations_ms(&String::from_utf8_lossy(&out.stderr));
    let sizes = if w.incremental { written_per_checkpoint(&dir.join("state/cost/shared")) } else { checkpoint_sizes(&dir.join("state/cost/checkpoints")) };
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Sample { records_per_s: events as f64 / wall, cpu_s_per_m: cpu / (events as f64 / 1e6), durations_ms, sizes, checkpoints: summary["checkpoints"].as_u64().unwrap_or(0) })
}

/// The duration of every completed checkpoint, from the coordinator's
/// "checkpoint complete" log lines (trigger to metadata written), in order;
/// the run must log `weir_runtime::checkpoint` at info.
pub fn durations_ms(log: &str) -> Vec<f64> {
    log.lines()
        .filter(|l| l.contains("checkpoint complete"))
        .filter_map(|l| l.split_whitespace().find_map(|f| f.strip_prefix("duration_ms=")).and_then(|v| v.parse().ok()))
        .collect()
}

/// Incremental checkpoints: the bytes each checkpoint wrote, from the
/// shared files still there (their names end in `-chk<id>.arrow`).
pub fn written_per_checkpoint(shared: &Path) -> Vec<u64> {
    let mut by_id: std::collections::BTreeMap<u64, u64> = Default::default();
    for f in std::fs::read_dir(shared).into_iter().flatten().flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        let Some(id) = name.rsplit_once("-chk").and_then(|(_, r)| r.strip_suffix(".arrow")).and_then(|n| n.parse::<u64>().ok()) else { continue };
        *by_id.entry(id).or_default() += f.metadata().map(|m| m.len()).unwrap_or(0);
    }
    by_id.into_values().collect()
}

/// The bytes of each retained checkpoint directory.
pub fn checkpoint_sizes(dir: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .map(|e| std::fs::read_dir(e.path()).map(|files| files.flatten().filter_map(|f| f.metadata().ok()).map(|m| m.len()).sum()).unwrap_or(0))
        .collect()
}

pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

pub fn run(o: &Options) -> Result<()> {
    // About a tenth of the keys change per one-second interval.
    let sparse = (o.keys / 10).max(1);
    let workloads = [
        Workload { name: "every key changes", interval: "0s", rate: 0, incremental: false },
        Workload { name: "every key changes", interval: "1s", rate: 0, incremental: false },
        Workload { name: "every key changes", interval: "1s", rate: 0, incremental: true },
        Workload { name: "a tenth of the keys change", interval: "1s", rate: sparse, incremental: false },
        Workload { name: "a tenth of the keys change", interval: "1s", rate: sparse, incremental: true },
    ];
    let mut samples: Vec<Vec<Sample>> = workloads.iter().map(|_| Vec::new()).collect();
    for round in 0..o.rounds {
        for (i, w) in workloads.iter().enumerate() {
            eprintln!("round {}/{}: {}, checkpoints {}{} ...", round + 1, o.rounds, w.name, w.interval, if w.incremental { " incremental" } else { "" });
            samples[i].push(run_once(o, w)?);
        }
    }
    println!(
        "keys: {}, parallelism: {}, events per dense run: {}, rounds: {}, cores: {}",
        o.keys,
        o.parallelism,
        o.events,
        o.rounds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| workload | checkpoints | records/s (median) | throughput vs. off | CPU-s per million records (median) | CPU vs. off | checkpoints completed | duration p50 | duration p99 | duration max | written per checkpoint (median) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    // "vs. off" is the median over rounds of each round's ratio to the run
    // without checkpoints just before it: the machine's speed drifts
    // between rounds more than checkpoints change it.
    let off = &samples[0];
    let paired = |s: &[Sample], f: fn(&Sample) -> f64| super::median(s.iter().zip(off).map(|(x, o)| f(x) / f(o)).collect());
    for (w, s) in workloads.iter().zip(&samples) {
        let rate = super::median(s.iter().map(|x| x.records_per_s).collect());
        let cpu = super::median(s.iter().map(|x| x.cpu_s_per_m).collect());
        let (vs, cpu_vs) = if w.interval == "0s" {
            ("-".to_string(), "-".to_string())
        } else if w.rate == 0 {
            (format!("{:+.1}%", (paired(s, |x| x.records_per_s) - 1.0) * 100.0), format!("{:+.1}%", (paired(s, |x| x.cpu_s_per_m) - 1.0) * 100.0))
        } else {
            (format!("(rate-limited to {}/s)", w.rate), "-".to_string())
        };
        let mut durations: Vec<f64> = s.iter().flat_map(|x| x.durations_ms.iter().copied()).collect();
        let sizes = super::median(s.iter().flat_map(|x| x.sizes.iter().map(|b| *b as f64)).collect());
        let completed: u64 = s.iter().map(|x| x.checkpoints).sum();
        let (p50, p99, max) = (percentile(&mut durations, 0.5), percentile(&mut durations, 0.99), percentile(&mut durations, 1.0));
        // A bounded job takes a final checkpoint even with checkpoints off;
        // its figures are not those of periodic checkpoints.
        let timing = if w.interval == "0s" { "- | - | - | -".to_string() } else { format!("{p50:.0} ms | {p99:.0} ms | {max:.0} ms | {:.1} MB", sizes / 1e6) };
        println!(
            "| {} | {} | {:.0} | {vs} | {cpu:.3} | {cpu_vs} | {completed} | {timing} |",
            w.name,
            match (w.interval, w.incremental) {
                ("0s", _) => "off".to_string(),
                (i, false) => format!("every {i}, full"),
                (i, true) => format!("every {i}, incremental"),
            },
            rate,
        );
    }
    Ok(())
}
