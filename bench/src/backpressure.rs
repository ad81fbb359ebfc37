//! Checkpoints under backpressure: `weir-bench backpressure` runs generator
//! → key_by → running_count → blackhole (a million keys by default) through
//! the real `weir run` with aligned checkpoints, unaligned ones, and aligned
//! ones that turn unaligned after an alignment timeout, full and
//! incremental, each without backpressure (a rate-limited generator) and
//! with heavy backpressure (an unthrottled generator in front of a sink
//! slowed down by `WEIR_SLOW_SINK`). Prints checkpoint durations (p50, p99,
//! max, from the coordinator's "checkpoint complete" log lines: trigger to
//! metadata written), how many completed, the keyed state each checkpoint
//! wrote and the records in flight the unaligned ones wrote.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::checkpoint_cost::{durations_ms, percentile, written_per_checkpoint};

pub struct Options {
    weir: PathBuf,
    rounds: usize,
    events: u64,
    keys: u64,
    slow_sink: String,
}

/// Events per second of the generator without backpressure.
const RATE: u64 = 200_000;

const HELP: &str = "weir-bench backpressure: checkpoint duration aligned vs unaligned, with and without backpressure

Options:
  --events N       events per run (default 2000000)
  --keys N         distinct keys of the running count (default 1000000)
  --slow-sink D    what the sink waits after each batch under backpressure (default 20ms)
  --rounds R       runs per configuration, interleaved (default 1)
  --weir PATH      the weir binary (default: $CARGO_TARGET_DIR/release/weir)";

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let (mut weir, mut rounds, mut events, mut keys, mut slow_sink) =
        (None, 1, 2_000_000, 1_000_000, "20ms".to_string());
    while let Some(a) = args.next() {
        match a.as_str() {
            "--events" => {
                events = args
                    .next()
                    .context("--events N")?
                    .parse()
                    .context("--events expects a number")?
            }
            "--rounds" => {
                rounds = args
                    .next()
                    .context("--rounds R")?
                    .parse()
                    .context("--rounds expects a number")?
            }
            "--keys" => {
                keys = args
                    .next()
                    .context("--keys N")?
                    .parse()
                    .context("--keys expects a number")?
            }
            "--slow-sink" => slow_sink = args.next().context("--slow-sink DURATION")?,
            "--weir" => weir = args.next(),
            "-h" | "--help" => {
                println!("{HELP}");
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench backpressure --help"),
        }
    }
    if events == 0 || rounds == 0 || keys == 0 {
        bail!("--events, --keys and --rounds must be above 0");
    }
    Ok(Some(Options {
        weir: super::weir_binary(weir)?,
        rounds,
        events,
        keys,
        slow_sink,
    }))
}

struct Config {
    mode: &'static str,
    /// Extra lines of the pipeline's `checkpoint` section.
    checkpoint: &'static str,
    incremental: bool,
    backpressure: bool,
}

#[derive(Default)]
struct Sample {
    wall_s: f64,
    durations_ms: Vec<f64>,
    state_bytes: Vec<u64>,
    in_flight_bytes: Vec<u64>,
}

fn run_once(o: &Options, c: &Config) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    // Without backpressure the generator is held to RATE events/s.
    let rate = if c.backpressure { 0 } else { RATE };
    let yaml = format!(
        "name: bp\nparallelism: 2\ncheckpoint:\n  interval: 1s\n  retain: 1000\n  incremental: {}\n{}source:\n  generator:\n    events: {}\n    keys: {}\n    rate: {rate}\n    batch_size: 1024\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  blackhole: {{}}\n",
        c.incremental, c.checkpoint, o.events, o.keys
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    let mut cmd = Command::new(&o.weir);
    cmd.current_dir(&dir)
        .args(["run", "p.yaml", "--state-dir", "state"])
        .env("RUST_LOG", "weir_runtime::checkpoint=info,warn");
    if c.backpressure {
        cmd.env("WEIR_SLOW_SINK", &o.slow_sink);
    }
    let t0 = Instant::now();
    let out = cmd.output().context("running weir")?;
    let wall_s = t0.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("weir run failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    // The final checkpoint (always aligned, after the input ended) is not a periodic one.
    let mut durations_ms = durations_ms(&String::from_utf8_lossy(&out.stderr));
    durations_ms.pop();
    let checkpoints = dir.join("state/bp/checkpoints");
    let in_flight_bytes = sizes(&checkpoints, true);
    let state_bytes = if c.incremental {
        written_per_checkpoint(&dir.join("state/bp/shared"))
    } else {
        sizes(&checkpoints, false)
    };
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Sample {
        wall_s,
        durations_ms,
        state_bytes,
        in_flight_bytes,
    })
}

/// Per retained checkpoint, the bytes of its in-flight record files
/// (`in_flight`) or of its other files.
fn sizes(dir: &Path, in_flight: bool) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| {
            std::fs::read_dir(e.path())
                .map(|files| {
                    files
                        .flatten()
                        .filter(|f| {
                            f.file_name().to_string_lossy().starts_with("in-flight-") == in_flight
                        })
                        .filter_map(|f| f.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0)
        })
        .collect()
}

pub fn run(o: &Options) -> Result<()> {
    let config = |mode, checkpoint, incremental, backpressure| Config {
        mode,
        checkpoint,
        incremental,
        backpressure,
    };
    let configs = [
        config("aligned", "", false, false),
        config("aligned", "", true, false),
        config("unaligned", "  mode: unaligned\n", false, false),
        config("unaligned", "  mode: unaligned\n", true, false),
        config("aligned", "", false, true),
        config("aligned", "", true, true),
        config("unaligned", "  mode: unaligned\n", false, true),
        config("unaligned", "  mode: unaligned\n", true, true),
        config(
            "aligned, unaligned after 200ms",
            "  alignment_timeout: 200ms\n",
            false,
            true,
        ),
    ];
    let mut samples: Vec<Vec<Sample>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..o.rounds {
        for (i, c) in configs.iter().enumerate() {
            eprintln!(
                "round {}/{}: {}, {}, {} ...",
                round + 1,
                o.rounds,
                c.mode,
                if c.incremental { "incremental" } else { "full" },
                if c.backpressure {
                    "backpressure"
                } else {
                    "no backpressure"
                }
            );
            samples[i].push(run_once(o, c)?);
        }
    }
    println!(
        "events per run: {}, keys: {}, parallelism 2, checkpoints every 1s, slow sink under backpressure: {} per batch, rounds: {}, cores: {}",
        o.events,
        o.keys,
        o.slow_sink,
        o.rounds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| checkpoints | snapshots | backpressure | run time (median) | checkpoints completed | duration p50 | duration p99 | duration max | keyed state written (median per checkpoint) | in-flight records written (max per checkpoint) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (c, s) in configs.iter().zip(&samples) {
        let mut d: Vec<f64> = s
            .iter()
            .flat_map(|x| x.durations_ms.iter().copied())
            .collect();
        let state = super::median(
            s.iter()
                .flat_map(|x| x.state_bytes.iter().map(|&b| b as f64))
                .collect(),
        );
        let in_flight = s
            .iter()
            .flat_map(|x| x.in_flight_bytes.iter().copied())
            .max()
            .unwrap_or(0);
        println!(
            "| {} | {} | {} | {:.1} s | {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} MB | {:.2} MB |",
            c.mode,
            if c.incremental { "incremental" } else { "full" },
            if c.backpressure {
                format!("slow sink ({})", o.slow_sink)
            } else {
                format!("none ({RATE} events/s)")
            },
            super::median(s.iter().map(|x| x.wall_s).collect()),
            d.len(),
            percentile(&mut d, 0.5),
            percentile(&mut d, 0.99),
            percentile(&mut d, 1.0),
            state / 1e6,
            in_flight as f64 / 1e6,
        );
    }
    Ok(())
}
