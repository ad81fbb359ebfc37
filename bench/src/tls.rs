//! `weir-bench tls`: what `spec.tls` costs. Two `weir worker` processes in
//! pod mode (as the operator starts them) on loopback addresses run
//! generator → key_by → running_count → blackhole at parallelism 2, so half
//! of the records cross the data connection between them; once over plain
//! TCP and once with `--tls-dir` (mutual TLS on the data and coordinator
//! connections, HTTPS on the control endpoint), alternating round by round.
//! The operator's part (the membership) is sent with curl, over HTTPS to
//! the TLS workers. Certificates are made with openssl.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const TOKEN: &str = "weir-bench-tls-token";
const NAME: &str = "bench-workers.bench.svc";

pub struct Options {
    events: u64,
    rounds: usize,
    weir: Option<String>,
}

pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>> {
    let mut o = Options { events: 20_000_000, rounds: 3, weir: None };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--events" => o.events = args.next().context("--events N")?.parse()?,
            "--rounds" => o.rounds = args.next().context("--rounds R")?.parse()?,
            "--weir" => o.weir = args.next(),
            "-h" | "--help" => {
                println!(
                    "weir-bench tls: throughput and CPU of a job of two pod-mode workers over plain TCP and with spec.tls's mutual TLS, side by side\n\n\
                     Options:\n  --events N   events per run (default 20000000)\n  --rounds R   runs per configuration; medians are reported (default 3)\n  --weir PATH  the weir binary (default: $CARGO_TARGET_DIR/release/weir)"
                );
                return Ok(None);
            }
            other => bail!("unknown argument {other:?} (see weir-bench tls --help)"),
        }
    }
    Ok(Some(o))
}

struct Sample {
    wall_s: f64,
    cpu_s: f64,
}

pub fn run(o: &Options) -> Result<()> {
    let weir = super::weir_binary(o.weir.clone())?;
    let certs = super::tempfile_dir()?;
    certificates(&certs)?;
    let mut plain = Vec::new();
    let mut tls = Vec::new();
    for round in 0..o.rounds {
        for with_tls in [false, true] {
            let s = run_once(&weir, o.events, with_tls.then_some(certs.as_path()), round)?;
            eprintln!("round {}: {} {:.2} s, {:.2} CPU-s", round + 1, if with_tls { "tls  " } else { "plain" }, s.wall_s, s.cpu_s);
            if with_tls { tls.push(s) } else { plain.push(s) }
        }
    }
    let _ = std::fs::remove_dir_all(&certs);
    println!("| connections | events/s | events per CPU-s | CPU-s |");
    println!("|---|---:|---:|---:|");
    let row = |name: &str, v: &[Sample]| {
        let wall = super::median(v.iter().map(|s| s.wall_s).collect());
        let cpu = super::median(v.iter().map(|s| s.cpu_s).collect());
        println!("| {name} | {:.0} | {:.0} | {cpu:.2} |", o.events as f64 / wall, o.events as f64 / cpu);
        (wall, cpu)
    };
    let (pw, pc) = row("plain TCP", &plain);
    let (tw, tc) = row("mutual TLS (spec.tls)", &tls);
    println!("\nTLS / plain: throughput {:.2}, CPU per event {:.2} (medians of {} rounds, {} events each)", pw / tw, tc / pc, o.rounds, o.events);
    Ok(())
}

/// A CA and a certificate it signed for NAME, as cert-manager lays out a Secret.
fn certificates(dir: &Path) -> Result<()> {
    let run = |args: &[&str]| -> Result<()> {
        let out = Command::new("openssl").args(args).current_dir(dir).output().context("running openssl")?;
        if !out.status.success() {
            bail!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    run(&["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=weir bench CA"])?;
    std::fs::write(dir.join("ext.cnf"), format!("subjectAltName=DNS:{NAME}\nextendedKeyUsage=serverAuth,clientAuth\n"))?;
    run(&["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=bench"])?;
    run(&["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf"])
}

/// Kills the workers of a run that did not finish.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn run_once(weir: &PathBuf, events: u64, tls: Option<&Path>, round: usize) -> Result<Sample> {
    let dir = super::tempfile_dir()?;
    let yaml = format!(
        "name: bench\nparallelism: 2\ncheckpoint:\n  interval: 1s\nsource:\n  generator:\n    events: {events}\n    keys: 1000\n    rate: 0\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  blackhole: {{}}\n"
    );
    std::fs::write(dir.join("p.yaml"), yaml)?;
    // A fresh pair of loopback addresses per run: the previous run's ports may linger.
    let net = 1 + (round * 2 + tls.is_some() as usize) % 250;
    let ips = [format!("127.45.{net}.1"), format!("127.45.{net}.2")];
    let run_id = format!("bench-{round}-{}", if tls.is_some() { "tls" } else { "plain" });
    let cpu0 = super::children_cpu_seconds();
    let t0 = Instant::now();
    let mut workers = Workers(Vec::new());
    for (i, ip) in ips.iter().enumerate() {
        let mut cmd = Command::new(weir);
        cmd.current_dir(&dir)
            .args(["worker", "--pipeline", "p.yaml", "--index", &i.to_string(), "--control-addr", ip, "--state-dir", "state"])
            .env("WEIR_CONTROL_TOKEN", TOKEN)
            .env("WEIR_RUN_ID", &run_id)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("worker-{i}.log")))?);
        if let Some(certs) = tls {
            cmd.arg("--tls-dir").arg(certs).args(["--tls-server-name", NAME]);
        }
        workers.0.push(cmd.spawn().context("starting a worker")?);
    }
    let membership = serde_json::json!({
        "run_id": run_id,
        "workers": [format!("{}:6121", ips[0]), format!("{}:6121", ips[1])],
        "coordinator": format!("{}:6122", ips[0]),
        "api": format!("{}:6120", ips[0]),
    })
    .to_string();
    for ip in &ips {
        put_membership(ip, &membership, tls)?;
    }
    for (i, c) in workers.0.iter_mut().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            let log = std::fs::read_to_string(dir.join(format!("worker-{i}.log"))).unwrap_or_default();
            bail!("worker {i} exited with {status}:\n{log}");
        }
    }
    workers.0.clear();
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu_s = super::children_cpu_seconds() - cpu0;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Sample { wall_s, cpu_s })
}

/// What the operator does: PUT /v1/membership, retried until the worker listens.
fn put_membership(ip: &str, body: &str, tls: Option<&Path>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut curl = Command::new("curl");
        curl.args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", "-X", "PUT"])
            .args(["-H", &format!("Authorization: Bearer {TOKEN}"), "-H", "Content-Type: application/json", "--data", body]);
        match tls {
            Some(certs) => curl.arg("--cacert").arg(certs.join("ca.crt")).args(["--resolve", &format!("{NAME}:6120:{ip}"), &format!("https://{NAME}:6120/v1/membership")]),
            None => curl.arg(format!("http://{ip}:6120/v1/membership")),
        };
        let out = curl.output().context("running curl")?;
        if String::from_utf8_lossy(&out.stdout) == "200" {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{ip} did not take its membership: HTTP {} {}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
