//! The exactly-once sinks side by side: the file sink on local disk, the
//! PostgreSQL sink in each of its modes and the Kafka sink (exactly-once,
//! and at-least-once for the price of exactly-once), on the same pipeline,
//! interleaved round by round so that machine noise hits them alike; and
//! the canonical end-to-end case, Kafka source → exactly-once Kafka sink,
//! reading the same events from a topic filled before the run (outside
//! the time measured).
//!
//! A throwaway PostgreSQL (Debian's binaries, `initdb` in a temporary
//! directory, run as nobody when the bench runs as root) and a Kafka broker
//! (`e2e/kafka/broker`) are started for the run and removed after it.
//!
//! Usage: weir-bench sinks [--events N] [--keys K] [--rounds R]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub struct Options {
    events: u64,
    keys: u64,
    rounds: usize,
}

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let mut o = Options { events: 2_000_000, keys: 10_000, rounds: 3 };
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<u64> { args.next().with_context(|| format!("{name} N"))?.parse().with_context(|| format!("{name}: expected a number")) };
        match a.as_str() {
            "--events" => o.events = num("--events")?,
            "--keys" => o.keys = num("--keys")?,
            "--rounds" => o.rounds = num("--rounds")? as usize,
            "-h" | "--help" => {
                println!(
                    "weir-bench sinks: the exactly-once sinks side by side (file on local disk; PostgreSQL two-phase-commit, write-ahead-log, upsert; Kafka exactly-once and at-least-once; Kafka source → Kafka exactly-once)\n\nOptions:\n  --events N    events per run (default 2000000)\n  --keys K      distinct keys (default 10000; the upsert table's rows)\n  --rounds R    runs per sink (default 3); medians are reported"
                );
                return Ok(None);
            }
            other => bail!("unknown argument {other}; see weir-bench sinks --help"),
        }
    }
    Ok(Some(o))
}

const PASSWORD: &str = "weir-bench";

struct Postgres {
    child: Child,
    port: u16,
    bin: PathBuf,
    dir: PathBuf,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGQUIT);
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn pg_bin() -> Result<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_string_lossy().parse().ok()?, e.path().join("bin"))))
        .filter(|(_, p)| p.join("initdb").exists())
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p).context("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)")
}

fn as_server_user(program: PathBuf) -> Command {
    if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn start_postgres() -> Result<Postgres> {
    use std::os::unix::fs::PermissionsExt;
    let bin = pg_bin()?;
    let dir = super::tempfile_dir()?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
    std::fs::write(dir.join("pw"), PASSWORD)?;
    std::fs::set_permissions(dir.join("pw"), std::fs::Permissions::from_mode(0o644))?;
    let out = as_server_user(bin.join("initdb"))
        .arg("-D")
        .arg(dir.join("data"))
        .args(["-U", "weir", "--auth-host=scram-sha-256", "--auth-local=trust", "--no-sync", "-E", "UTF8", "--locale=C"])
        .arg(format!("--pwfile={}", dir.join("pw").display()))
        .output()?;
    if !out.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let port = 20_000 + (std::process::id() % 10_000) as u16;
    // Durable commits, as a database that jobs write to runs.
    let child = as_server_user(bin.join("postgres"))
        .arg("-D")
        .arg(dir.join("data"))
        .args(["-p", &port.to_string(), "-k"])
        .arg(&dir)
        .args(["-c", "listen_addresses=127.0.0.1", "-c", "max_prepared_transactions=16", "-c", "shared_buffers=256MB"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pg = Postgres { child, port, bin, dir };
    let start = Instant::now();
    while !Command::new(pg.bin.join("pg_isready")).args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()]).status()?.success() {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("PostgreSQL did not start on port {port}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    pg.psql("postgres", "CREATE DATABASE bench")?;
    Ok(pg)
}

impl Postgres {
    fn psql(&self, db: &str, sql: &str) -> Result<String> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "weir", "-d", db, "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .env("PGPASSWORD", PASSWORD)
            .output()?;
        if !out.status.success() {
            bail!("psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

struct Sample {
    wall_s: f64,
    checkpoints: u64,
}

const SINKS: [&str; 8] = [
    "file (local disk)",
    "postgres two-phase-commit",
    "postgres write-ahead-log",
    "postgres upsert",
    "kafka exactly-once",
    "kafka at-least-once",
    "kafka source → kafka exactly-once",
    "kafka source → kafka at-least-once",
];

/// The first of the rows that read their input from Kafka instead of the
/// generator (exactly-once, then at-least-once).
const KAFKA_TO_KAFKA: usize = 6;

fn run_once(weir: &PathBuf, o: &Options, pg: &Postgres, broker: &super::kafka::Broker, which: usize, round: usize) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    let table = format!("t{which}_{round}");
    let columns = if which == 3 { "key bigint PRIMARY KEY, seq bigint, value bigint, count bigint" } else { "seq bigint, key bigint, value bigint, count bigint" };
    if (1..=3).contains(&which) {
        pg.psql("bench", &format!("CREATE TABLE {table} ({columns})"))?;
    }
    if which >= 4 {
        broker.create_topic(&table, 2)?;
    }
    let source = if which >= KAFKA_TO_KAFKA {
        let input = format!("{table}-in");
        broker.create_topic(&input, 2)?;
        broker.produce_events(&input, o.events, o.keys, 2)?;
        format!(
            "kafka:\n    bootstrap_servers: {}\n    topic: {input}\n    schema: {{seq: int64, key: int64, value: int64}}\n    stop: end\n    batch_size: 1024",
            broker.bootstrap
        )
    } else {
        format!("generator:\n    events: {}\n    keys: {}\n    rate: 0\n    batch_size: 1024", o.events, o.keys)
    };
    let connection = format!("host=127.0.0.1 port={} dbname=bench user=weir", pg.port);
    let sink = match which {
        0 => "file:\n    path: out\n    guarantee: exactly-once".to_string(),
        1 => format!("postgres:\n    connection: {connection}\n    table: {table}\n    mode: two-phase-commit"),
        2 => format!("postgres:\n    connection: {connection}\n    table: {table}\n    mode: write-ahead-log"),
        3 => format!("postgres:\n    connection: {connection}\n    table: {table}\n    mode: upsert\n    key: [key]"),
        4 | KAFKA_TO_KAFKA => format!("kafka:\n    bootstrap_servers: {}\n    topic: {table}\n    key: key\n    progress_topic: {table}-progress", broker.bootstrap),
        _ => format!("kafka:\n    bootstrap_servers: {}\n    topic: {table}\n    key: key\n    guarantee: at-least-once", broker.bootstrap),
    };
    let yaml = format!(
        "name: sinks\nparallelism: 2\ncheckpoint:\n  interval: 1s\nsource:\n  {source}\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  {sink}\n"
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    let t0 = Instant::now();
    let out = Command::new(weir)
        .current_dir(&dir)
        .args(["run", "p.yaml", "--state-dir", "state"])
        .env("PGPASSWORD", PASSWORD)
        .env("RUST_LOG", "warn")
        .output()
        .context("running weir")?;
    let wall_s = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        bail!("weir run with the {} sink failed: {}", SINKS[which], String::from_utf8_lossy(&out.stderr));
    }
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).context("reading the run summary")?;
    if which >= 4 {
        let read = broker.count_committed(&table)?;
        if read != o.events {
            bail!("a read_committed consumer read {read} messages from the {} sink, expected {}", SINKS[which], o.events);
        }
    } else if which > 0 {
        let rows: u64 = pg.psql("bench", &format!("SELECT count(*) FROM {table}"))?.parse()?;
        let expected = if which == 3 { o.keys.min(o.events) } else { o.events };
        if rows != expected {
            bail!("the {} sink left {rows} rows, expected {expected}", SINKS[which]);
        }
        pg.psql("bench", &format!("DROP TABLE {table}"))?;
    }
    Ok(Sample { wall_s, checkpoints: summary["checkpoints"].as_u64().unwrap_or(0) })
}

pub fn run(o: &Options) -> Result<()> {
    let weir = super::weir_binary(None)?;
    let pg = start_postgres()?;
    let broker = super::kafka::start(pg.port + 1)?;
    let mut samples: Vec<Vec<Sample>> = (0..SINKS.len()).map(|_| Vec::new()).collect();
    for round in 0..o.rounds {
        for (i, name) in SINKS.iter().enumerate() {
            eprintln!("round {}/{}: {name} ...", round + 1, o.rounds);
            samples[i].push(run_once(&weir, o, &pg, &broker, i, round)?);
        }
    }
    println!("events per run: {}, keys: {}, parallelism 2, checkpoints every 1s to local disk, rounds: {}; PostgreSQL {} with durable commits and a one-node Kafka 4.4 broker (topics of 2 partitions) on the same machine; the Kafka → Kafka rows read the same events from a topic filled before the run", o.events, o.keys, o.rounds, pg.psql("bench", "SHOW server_version")?);
    println!("| sink | records/s (wall, median) | checkpoints | throughput vs. file |");
    println!("|---|---|---|---|");
    let mut base = 0.0;
    for (i, name) in SINKS.iter().enumerate() {
        let rate = super::median(samples[i].iter().map(|s| o.events as f64 / s.wall_s).collect());
        let checkpoints = super::median(samples[i].iter().map(|s| s.checkpoints as f64).collect());
        if i == 0 {
            base = rate;
        }
        let vs = if i == 0 { "-".to_string() } else { format!("{:+.1}%", (rate / base - 1.0) * 100.0) };
        println!("| {name} | {rate:.0} | {checkpoints:.0} | {vs} |");
    }
    Ok(())
}
