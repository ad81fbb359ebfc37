//! Joins: `weir-bench joins` runs two generators (orders and payments, event
//! time in `value`) joined on `key` into a blackhole through the real `weir
//! run`, for the interval, window and regular joins, with checkpoints off
//! and every second, rounds interleaved. Prints input records per second,
//! pairs out, the CPU per million input records, checkpoint durations and
//! the join's state as the checkpoints wrote it (the largest retained
//! checkpoint directory: the last one, taken at the end of the input, holds
//! nothing of a join whose watermark expired everything).
//!
//! Shapes, each about one pair per input record so that the kinds compare:
//! an interval join of ±1 s on 1000 keys (a record pairs with the other
//! side's records of its key 1000 seqs before, at and after it: three
//! pairs), a tumbling window join of 1 s on 1000 keys (one order and one
//! payment per key and window), and a regular join on unique keys with a
//! one-hour TTL (one pair per key; state grows with the input).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::checkpoint_cost::{checkpoint_sizes, durations_ms, percentile};

pub struct Options {
    weir: PathBuf,
    events: u64,
    rounds: usize,
    parallelism: u32,
}

const HELP: &str = "weir-bench joins: interval, window and regular joins of two generators, records per second and state size, checkpoints every second vs off

Options:
  --events N       events per source and run (default 1000000)
  --rounds R       runs per configuration, interleaved (default 3)
  --parallelism P  subtasks (default 2)
  --weir PATH      the weir binary (default: $CARGO_TARGET_DIR/release/weir)";

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let (mut weir, mut events, mut rounds, mut parallelism) = (None, 1_000_000, 3, 2);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--events" => events = args.next().context("--events N")?.parse().context("--events expects a number")?,
            "--rounds" => rounds = args.next().context("--rounds R")?.parse().context("--rounds expects a number")?,
            "--parallelism" => parallelism = args.next().context("--parallelism P")?.parse().context("--parallelism expects a number")?,
            "--weir" => weir = args.next(),
            "-h" | "--help" => {
                println!("{HELP}");
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench joins --help"),
        }
    }
    if events == 0 || rounds == 0 || parallelism == 0 {
        bail!("--events, --rounds and --parallelism must be above 0");
    }
    Ok(Some(Options { weir: super::weir_binary(weir)?, events, rounds, parallelism }))
}

struct Kind {
    name: &'static str,
    step: &'static str,
    /// Keys of both generators: 0 for as many as events (unique keys).
    keys: u64,
}

const KINDS: [Kind; 3] = [
    Kind { name: "interval join ±1 s", step: "interval_join: {on: key, between: {lower: -1s, upper: 1s}}", keys: 1000 },
    Kind { name: "window join, tumbling 1 s", step: "window_join: {on: key, tumbling: 1s}", keys: 1000 },
    Kind { name: "regular join, TTL 1 h", step: "join: {on: key, ttl: 1h}", keys: 0 },
];

#[derive(Default)]
struct Sample {
    records_per_s: f64,
    pairs: u64,
    cpu_s_per_m: f64,
    durations_ms: Vec<f64>,
    sizes: Vec<u64>,
}

fn run_once(o: &Options, kind: &Kind, interval: &str) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    let keys = if kind.keys == 0 { o.events } else { kind.keys };
    let source = format!("    generator: {{events: {}, keys: {keys}, rate: 0, batch_size: 1024}}\n    event_time: {{field: value, max_out_of_orderness: 1s}}\n", o.events);
    let yaml = format!(
        "name: joins\nparallelism: {}\ncheckpoint:\n  interval: {interval}\n  retain: 3\nsources:\n  orders:\n{source}  payments:\n{source}\
         steps:\n  - {{name: pairs, input: [orders, payments], {}}}\nsinks:\n  out: {{input: pairs, blackhole: {{}}}}\n",
        o.parallelism, kind.step
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    let cpu0 = super::children_cpu_seconds();
    let t0 = Instant::now();
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
    let input = 2 * o.events;
    if summary["records_in"].as_u64() != Some(input) {
        bail!("{}: the run read {} of {input} records", kind.name, summary["records_in"]);
    }
    let durations_ms = durations_ms(&String::from_utf8_lossy(&out.stderr));
    let sizes = if interval == "0s" { Vec::new() } else { checkpoint_sizes(&dir.join("state/joins/checkpoints")) };
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Sample {
        records_per_s: input as f64 / wall,
        pairs: summary["records_out"].as_u64().unwrap_or(0),
        cpu_s_per_m: cpu / (input as f64 / 1e6),
        durations_ms,
        sizes,
    })
}

pub fn run(o: &Options) -> Result<()> {
    let configs: Vec<(&Kind, &str)> = KINDS.iter().flat_map(|k| [(k, "0s"), (k, "1s")]).collect();
    let mut samples: Vec<Vec<Sample>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..o.rounds {
        for (i, (kind, interval)) in configs.iter().enumerate() {
            eprintln!("round {}/{}: {}, checkpoints {interval} ...", round + 1, o.rounds, kind.name);
            samples[i].push(run_once(o, kind, interval)?);
        }
    }
    println!(
        "events per source: {}, parallelism: {}, rounds: {}, cores: {}",
        o.events,
        o.parallelism,
        o.rounds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| join | checkpoints | input records/s (median) | throughput vs. off | pairs out | CPU-s per million input records | duration p50 | duration max | largest checkpoint (median) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (i, (kind, interval)) in configs.iter().enumerate() {
        let s = &samples[i];
        let rate = super::median(s.iter().map(|x| x.records_per_s).collect());
        let cpu = super::median(s.iter().map(|x| x.cpu_s_per_m).collect());
        // Each round's ratio to the run without checkpoints just before it:
        // the machine drifts between rounds more than checkpoints cost.
        let vs = if *interval == "0s" {
            "-".to_string()
        } else {
            let off = &samples[i - 1];
            format!("{:+.1}%", (super::median(s.iter().zip(off).map(|(x, o)| x.records_per_s / o.records_per_s).collect()) - 1.0) * 100.0)
        };
        let mut durations: Vec<f64> = s.iter().flat_map(|x| x.durations_ms.iter().copied()).collect();
        let timing = if *interval == "0s" {
            "- | - | -".to_string()
        } else {
            let size = super::median(s.iter().map(|x| x.sizes.iter().copied().max().unwrap_or(0) as f64).collect());
            format!("{:.0} ms | {:.0} ms | {:.1} MB", percentile(&mut durations, 0.5), percentile(&mut durations, 1.0), size / 1e6)
        };
        println!(
            "| {} | {} | {rate:.0} | {vs} | {} | {cpu:.3} | {timing} |",
            kind.name,
            if *interval == "0s" { "off" } else { "every 1s" },
            s.first().map_or(0, |x| x.pairs),
        );
    }
    Ok(())
}
