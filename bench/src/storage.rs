//! Checkpoint storage side by side: the same job with checkpoints every
//! second to local disk and to S3 (a real MinIO on loopback, started here),
//! rounds interleaved. Reports throughput and the duration of each completed
//! checkpoint, as `weir status` reports it while the job runs.
//!
//! With `--output file` the job also writes every record through the
//! exactly-once file sink, to local disk beside local checkpoints and to
//! S3 (multipart uploads) beside S3 checkpoints.
//!
//! Usage: weir-bench storage [--events N] [--keys K] [--rounds R] [--output blackhole|file] [--minio PATH]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const ACCESS_KEY: &str = "weir-bench";
const SECRET_KEY: &str = "weir-bench-secret-71c2";

pub struct Options {
    events: u64,
    keys: u64,
    rounds: usize,
    /// Also write every record through the file sink (to the same storage).
    file_output: bool,
    minio: Option<PathBuf>,
}

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let mut o = Options { events: 100_000_000, keys: 100_000, rounds: 3, file_output: false, minio: None };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--events" => o.events = args.next().context("--events N")?.parse()?,
            "--keys" => o.keys = args.next().context("--keys K")?.parse()?,
            "--rounds" => o.rounds = args.next().context("--rounds R")?.parse()?,
            "--minio" => o.minio = Some(args.next().context("--minio PATH")?.into()),
            "--output" => {
                o.file_output = match args.next().as_deref() {
                    Some("file") => true,
                    Some("blackhole") => false,
                    other => bail!("--output {}: expected blackhole or file", other.unwrap_or("")),
                }
            }
            "-h" | "--help" => {
                println!(
                    "weir-bench storage: the same job (generator -> key_by -> running_count -> blackhole, checkpoints every 1s)\n\
                     with checkpoints to local disk and to S3 (MinIO on loopback), rounds interleaved; prints throughput and\n\
                     checkpoint durations.\n\nOptions:\n  --events N    events per run (default 100000000)\n  --keys K      distinct keys, i.e. the size of the state (default 100000)\n  \
                     --rounds R    runs per storage (default 3)\n  --output O    blackhole (default) or file: every record also goes through the exactly-once\n                file sink, on local disk or in S3 beside the checkpoints\n  --minio PATH  the MinIO binary (default: the newest $WEIR_CACHE/k8s/minio-*/bin/minio, built by e2e/build-binaries minio)"
                );
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench storage --help"),
        }
    }
    Ok(Some(o))
}

fn minio_binary(given: Option<&PathBuf>) -> Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let cache = std::env::var_os("WEIR_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/weir"));
    let mut found: Vec<PathBuf> = std::fs::read_dir(cache.join("k8s"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("minio-"))
        .map(|e| e.path().join("bin/minio"))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().with_context(|| format!("no MinIO under {}/k8s/minio-*/bin: run `e2e/build-binaries minio` or pass --minio", cache.display()))
}

struct Minio {
    child: Child,
    endpoint: String,
    _data: PathBuf,
}

impl Drop for Minio {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._data);
    }
}

fn start_minio(binary: &PathBuf) -> Result<Minio> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let data = super::tempfile_dir()?;
    let child = Command::new(binary)
        .args(["server", "--quiet", "--address"])
        .arg(format!("127.0.0.1:{port}"))
        .arg(&data)
        .env("MINIO_ROOT_USER", ACCESS_KEY)
        .env("MINIO_ROOT_PASSWORD", SECRET_KEY)
        .env("MINIO_BROWSER", "off")
        .env("MINIO_UPDATE", "off")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let minio = Minio { child, endpoint: format!("http://127.0.0.1:{port}"), _data: data };
    let start = Instant::now();
    while !Command::new("curl").args(["-sf", "-o", "/dev/null"]).arg(format!("{}/minio/health/ready", minio.endpoint)).status()?.success() {
        if start.elapsed() > Duration::from_secs(60) {
            bail!("MinIO did not become ready within 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let made = Command::new("curl")
        .args(["-sf", "-X", "PUT", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user"])
        .arg(format!("{ACCESS_KEY}:{SECRET_KEY}"))
        .arg(format!("{}/bench", minio.endpoint))
        .status()?;
    if !made.success() {
        bail!("creating the bucket failed");
    }
    Ok(minio)
}

struct Sample {
    wall_s: f64,
    durations_ms: Vec<f64>,
}

fn run_once(weir: &PathBuf, o: &Options, state: &str, output: &str, minio: &Minio) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    let sink = if o.file_output { format!("file:\n    path: {output}\n    guarantee: exactly-once") } else { "blackhole: {}".to_string() };
    let yaml = format!(
        "name: storage\nparallelism: 2\ncheckpoint:\n  interval: 1s\nsource:\n  generator:\n    events: {}\n    keys: {}\n    rate: 0\n    batch_size: 1024\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  {sink}\n",
        o.events, o.keys
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    let env = [
        ("WEIR_S3_ENDPOINT", minio.endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        ("RUST_LOG", "warn"),
    ];
    let t0 = Instant::now();
    let mut child = Command::new(weir)
        .current_dir(&dir)
        .args(["run", "p.yaml", "--state-dir", state])
        .envs(env)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("running weir")?;
    let mut durations = std::collections::BTreeMap::new();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        let out = Command::new(weir).current_dir(&dir).args(["status", "--state-dir", state]).envs(env).output()?;
        if let Ok(st) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            let c = &st["latest_checkpoint"];
            if let (Some(id), Some(ms)) = (c["id"].as_u64(), c["duration_ms"].as_u64()) {
                durations.insert(id, ms as f64);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    if !status.success() {
        bail!("weir run with state in {state} failed");
    }
    Ok(Sample { wall_s, durations_ms: durations.into_values().collect() })
}

pub fn run(o: &Options) -> Result<()> {
    let weir = super::weir_binary(None)?;
    let minio = start_minio(&minio_binary(o.minio.as_ref())?)?;
    let local_root = super::tempfile_dir()?;
    let local = local_root.join("state").display().to_string();
    let mut samples: [Vec<Sample>; 2] = [Vec::new(), Vec::new()];
    for round in 0..o.rounds {
        for (i, name) in ["local disk", "S3 (MinIO)"].iter().enumerate() {
            eprintln!("round {}/{}: {name} ...", round + 1, o.rounds);
            let (state, output) = if i == 0 {
                (format!("{local}/{round}"), format!("{}/out/{round}", local_root.display()))
            } else {
                (format!("s3://bench/state/{round}"), format!("s3://bench/out/{round}"))
            };
            samples[i].push(run_once(&weir, o, &state, &output, &minio)?);
            if i == 0 {
                let _ = std::fs::remove_dir_all(&output);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&local_root);
    let sink = if o.file_output { "exactly-once file sink on the same storage" } else { "blackhole sink" };
    println!("events per run: {}, keys: {}, parallelism 2, checkpoints every 1s, {sink}, rounds: {}", o.events, o.keys, o.rounds);
    println!("| storage | records/s (wall) | checkpoints seen | checkpoint duration median | p90 | max | throughput vs. local |");
    println!("|---|---|---|---|---|---|---|");
    let mut base = 0.0;
    for (i, name) in ["local disk", "S3 (MinIO)"].iter().enumerate() {
        let rate = super::median(samples[i].iter().map(|s| o.events as f64 / s.wall_s).collect());
        let mut all: Vec<f64> = samples[i].iter().flat_map(|s| s.durations_ms.iter().copied()).collect();
        all.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| all.get(((all.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
        if i == 0 {
            base = rate;
        }
        let vs = if i == 0 { "-".to_string() } else { format!("{:+.1}%", (rate / base - 1.0) * 100.0) };
        println!("| {name} | {rate:.0} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {vs} |", all.len(), pct(0.5), pct(0.9), pct(1.0));
    }
    Ok(())
}
