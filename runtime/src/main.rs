//! The `weir` command: run pipelines locally, and the worker entry point
//! that pods and the local supervisor start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use weir_runtime::checkpoint::CheckpointStorage;
use weir_api::control::{SavepointOutcome, SavepointRequest, SavepointState, CONTROL_PORT};
use weir_api::pipeline::HumanDuration;
use weir_runtime::control::{self, JobStatus};
use weir_runtime::local::{self, RestoreFrom, RunOptions};
use weir_runtime::worker::{self, Cluster, Placement, WorkerConfig};
use weir_runtime::{plan, Error};

#[derive(Parser)]
#[command(name = "weir", version, about = "Run streaming pipelines with exactly-once checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    s3: S3Args,
    /// A worker or coordinator that sends nothing on its control connection for this long is lost (frozen,
    /// cut off, its node gone): the run fails and is restored from the latest checkpoint.
    #[arg(long, global = true, env = "WEIR_HEARTBEAT_TIMEOUT", value_name = "DURATION", default_value = "5s", value_parser = parse_heartbeat_timeout)]
    heartbeat_timeout: std::time::Duration,
}

fn parse_heartbeat_timeout(text: &str) -> Result<std::time::Duration, String> {
    let d = weir_api::pipeline::HumanDuration::parse(text)?.get();
    if d < std::time::Duration::from_millis(100) {
        return Err(format!("{text} is too short: at least 100ms, a few seconds in practice"));
    }
    Ok(d)
}

/// Where `s3://` locations are. Credentials are never flags: they come from
/// the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a web
/// identity token file and role for IRSA-style roles).
#[derive(clap::Args)]
struct S3Args {
    /// The S3-compatible server of s3:// locations, e.g. http://127.0.0.1:9000 for MinIO [default: AWS S3].
    #[arg(long, global = true, env = "WEIR_S3_ENDPOINT", value_name = "URL")]
    s3_endpoint: Option<String>,
    /// The region requests to s3:// locations are signed for [default: AWS_REGION, then us-east-1].
    #[arg(long, global = true, env = "WEIR_S3_REGION", value_name = "REGION")]
    s3_region: Option<String>,
    /// Path-style requests (http://host/bucket/key), as MinIO expects; false for virtual-hosted style (http://bucket.host/key).
    #[arg(long, global = true, env = "WEIR_S3_PATH_STYLE", value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    s3_path_style: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline on this machine as worker processes, restoring it after failures.
    #[command(after_help = "Exit codes: 0 the job finished; 3 an error a restart cannot fix (a bad pipeline or checkpoint, \
a record a step fails on), reported by the first attempt; 1 anything else (e.g. --max-restarts exhausted).")]
    Run {
        /// The pipeline file (YAML).
        pipeline: PathBuf,
        /// Where checkpoints and savepoints are kept: a directory, a file:// URL or s3://BUCKET/PREFIX (see --s3-endpoint).
        #[arg(long, default_value = "weir-state")]
        state_dir: String,
        /// Resume from `latest` (the latest completed checkpoint; fresh if none) or from a checkpoint or savepoint directory.
        #[arg(long, value_name = "latest|PATH")]
        restore: Option<String>,
        /// Run at this parallelism instead of the pipeline's (rescales restored state).
        #[arg(long)]
        parallelism: Option<u32>,
        /// Number of worker processes (default: one per subtask).
        #[arg(long)]
        workers: Option<u32>,
        /// Restore even if the checkpoint has state for steps the pipeline no longer has (that state is dropped).
        #[arg(long)]
        allow_non_restored_state: bool,
        /// Give up after this many restarts in a row without a new completed checkpoint.
        #[arg(long, default_value_t = 10)]
        max_restarts: u32,
        /// The name this job's writes carry outside weir: PostgreSQL's prepared transactions and progress rows,
        /// Kafka's transactional ids and progress markers, output file names [default: the pipeline's name]. Jobs
        /// writing to one database, topic or directory need different ones; the operator sets NAMESPACE_NAME.
        #[arg(long, env = "WEIR_JOB_ID", value_parser = parse_job_id)]
        job_id: Option<String>,
    },
    /// Check a pipeline and print its plan (stages, schemas, exchanges and state ids) without running it.
    #[command(after_help = "The state ids are what a savepoint holds: a pipeline whose stateful steps keep their \
ids restores from a savepoint of this one. Exit codes: 0 the pipeline plans; 3 it does not (the error names the file, \
line and field).")]
    Plan {
        /// The pipeline file (YAML).
        pipeline: PathBuf,
        /// Plan at this parallelism instead of the pipeline's.
        #[arg(long)]
        parallelism: Option<u32>,
    },
    /// Take a savepoint of a running local job and print its path.
    Savepoint {
        #[arg(long, default_value = "weir-state")]
        state_dir: String,
        /// The job's name (needed when the state directory holds several jobs).
        #[arg(long)]
        job: Option<String>,
        /// Stop the job with this savepoint: no output is committed after it, and the job ends (`weir run` exits 0). Resume with `weir run --restore PATH`.
        #[arg(long)]
        stop: bool,
        /// Instead of taking a savepoint, dispose of the job's savepoint at PATH (as `weir savepoint` printed it): its directory goes, and what only it still held outside storage (prepared PostgreSQL transactions, sink log entries). Refused for anything but a savepoint of this job, and for the job's latest snapshot. Needs the job running.
        #[arg(long, value_name = "PATH", conflicts_with = "stop")]
        dispose: Option<String>,
    },
    /// Show the status of a running local job.
    Status {
        #[arg(long, default_value = "weir-state")]
        state_dir: String,
        #[arg(long)]
        job: Option<String>,
    },
    /// Inspect checkpoints and savepoints.
    Checkpoints {
        #[command(subcommand)]
        command: CheckpointsCommand,
    },
    /// Run one worker process (started by `weir run` or by the operator).
    #[command(hide = true, long_about = WORKER_ABOUT)]
    Worker {
        /// The pipeline file (YAML).
        #[arg(long)]
        pipeline: PathBuf,
        /// This worker's index: it hosts subtask INDEX of every stage (and INDEX + workers, ...).
        #[arg(long)]
        index: u32,
        /// Local mode: the run's membership as JSON (what `weir run` passes). Without it the worker runs in pod mode.
        #[arg(long, value_name = "JSON")]
        cluster: Option<String>,
        /// Pod mode: where to serve the control endpoint: IP (port 6120), IP:PORT or
        /// [IPv6]:PORT [default: 0.0.0.0:6120]. The operator passes the pod's IP alone,
        /// which works for IPv4 and IPv6 pods alike.
        #[arg(long, value_name = "ADDR", conflicts_with = "cluster", value_parser = parse_control_addr)]
        control_addr: Option<SocketAddr>,
        /// Pod mode: give up (exit 1) when no membership arrives within this time.
        #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
        membership_timeout: Duration,
        /// Where checkpoints and savepoints are kept (a directory or a URL such as file:///state).
        #[arg(long)]
        state_dir: String,
        /// Relative paths of sources and sinks are resolved against this directory [default: the current directory].
        #[arg(long)]
        base_dir: Option<PathBuf>,
        /// Run at this parallelism instead of the pipeline's.
        #[arg(long)]
        parallelism: Option<u32>,
        /// `latest` (the latest completed checkpoint in --state-dir, fresh if none) or a checkpoint or savepoint location.
        #[arg(long, value_name = "latest|LOCATION")]
        restore: Option<String>,
        /// Restore even if the checkpoint has state for steps the pipeline no longer has.
        #[arg(long)]
        allow_non_restored_state: bool,
        /// With `--restore latest`: fail (exit 3) instead of starting fresh when --state-dir holds no state of the
        /// job at all. The operator passes it once the job has completed a checkpoint, so that lost storage or a
        /// wrong bucket never silently restarts a job from scratch.
        #[arg(long)]
        expect_state: bool,
        /// The name this job's writes carry outside weir: PostgreSQL's prepared transactions and progress rows,
        /// Kafka's transactional ids and progress markers, output file names [default: the pipeline's name]. Jobs
        /// writing to one database, topic or directory need different ones; the operator sets NAMESPACE_NAME.
        #[arg(long, env = "WEIR_JOB_ID", value_parser = parse_job_id)]
        job_id: Option<String>,
        /// TLS on the run's data and coordinator connections (mutual) and, in pod mode, on the control
        /// endpoint: a directory holding tls.crt, tls.key and ca.crt (a cert-manager Secret's layout).
        #[arg(long, value_name = "DIR", requires = "tls_server_name")]
        tls_dir: Option<PathBuf>,
        /// With --tls-dir: the DNS name every worker's certificate carries, which peers check (the operator
        /// passes <job>-workers.<namespace>.svc).
        #[arg(long, value_name = "NAME", requires = "tls_dir")]
        tls_server_name: Option<String>,
    },
}

#[derive(Subcommand)]
enum CheckpointsCommand {
    /// List the checkpoints and savepoints of the jobs in a state directory.
    List {
        #[arg(long, default_value = "weir-state")]
        state_dir: String,
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

const WORKER_ABOUT: &str = "Run one worker process of a job (started by `weir run` or by the operator).

Local mode (--cluster JSON): the membership is given; worker 0 serves the job's
control endpoint at the membership's `api` address.

Pod mode (no --cluster): the worker serves its control endpoint at --control-addr
(an IP, IPv4 or IPv6, with or without a port) at once and waits for
`PUT /v1/membership` (the operator sends it once every worker pod has an IP).
/healthz needs no token; every other route needs `Authorization: Bearer
$WEIR_CONTROL_TOKEN`, and in pod mode the worker refuses to start without that
variable. Worker 0 answers /v1/status and /v1/savepoints
for the job; the other workers answer /v1/status for themselves.

TLS (--tls-dir, --tls-server-name): the data and coordinator connections use
mutual TLS with the directory's certificate, checked against its ca.crt and the
server name; in pod mode the control endpoint is HTTPS with that certificate.

Environment: WEIR_CONTROL_TOKEN (the job's token), WEIR_RUN_ID (pod mode: accept
only this run's membership), WEIR_LOG_JSON (JSON logs), RUST_LOG (log filter).

Exit codes: 0 the job finished; 3 an error a restart cannot fix (bad pipeline,
unusable checkpoint, missing token, a record a step fails on, a pending output
file that is gone); 1 anything else (a lost peer, no membership
in time): restore the job from the latest checkpoint.";

fn parse_control_addr(text: &str) -> Result<SocketAddr, String> {
    weir_api::control::parse_listen_addr(text, CONTROL_PORT)
}

/// A job id goes into file names, Kafka transactional ids and PostgreSQL's
/// transaction ids (at most 200 bytes with the run, subtask and checkpoint),
/// so it has a pipeline name's syntax: no `.`, which ends the job's part of
/// an output file's name.
fn parse_job_id(text: &str) -> Result<String, String> {
    let ok = !text.is_empty() && text.len() <= 128 && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!("{text:?}: expected 1 to 128 letters, digits, `-` or `_`"))
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    HumanDuration::parse(text).map(HumanDuration::get)
}

fn init_tracing(json: bool) {
    // On a terminal the progress line says what the info logs would; keep it clean.
    let default = if std::io::IsTerminal::is_terminal(&std::io::stderr()) && !json { "warn" } else { "info" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// How a worker process ended without an error.
enum Ended {
    Done,
    /// By SIGTERM. In a pod the worker is PID 1, for which the kernel
    /// ignores a signal without a handler: without this, every pod
    /// deletion waited out the whole grace period.
    Terminated,
}

/// Resolves when the process receives SIGTERM (never, if no handler can
/// be installed).
async fn terminated() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut sigterm) => {
            sigterm.recv().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "no SIGTERM handler: a pod deletion waits for its grace period");
            std::future::pending::<()>().await
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let s3 = weir_runtime::checkpoint::s3::S3Settings {
        endpoint: cli.s3.s3_endpoint.clone(),
        region: cli.s3.s3_region.clone(),
        path_style: cli.s3.s3_path_style,
    };
    if let Err(e) = weir_runtime::checkpoint::s3::configure(s3) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    weir_runtime::worker::protocol::configure_heartbeat_timeout(cli.heartbeat_timeout);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Worker { pipeline, index, cluster, control_addr, membership_timeout, state_dir, base_dir, parallelism, restore, allow_non_restored_state, expect_state, job_id, tls_dir, tls_server_name } => {
            init_tracing(std::env::var_os("WEIR_LOG_JSON").is_some());
            let token = std::env::var("WEIR_CONTROL_TOKEN").unwrap_or_default();
            if cluster.is_none() && token.is_empty() {
                tracing::error!(
                    worker = index,
                    "WEIR_CONTROL_TOKEN is unset or empty: in pod mode the worker needs the job's control token, \
                     or anyone who can reach its control endpoint could set its membership"
                );
                return ExitCode::from(local::EXIT_FATAL as u8);
            }
            let result = runtime.block_on(async {
                let (spec, src) = local::load_pipeline(&pipeline, parallelism)?;
                let plan = plan::plan(&spec, &src)?;
                let placement = match cluster {
                    Some(json) => Placement::Local(serde_json::from_str::<Cluster>(&json).map_err(|e| Error::Job(format!("--cluster: {e}")))?),
                    None => Placement::Pod {
                        control_addr: control_addr.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], CONTROL_PORT))),
                        membership_timeout,
                        run_id: std::env::var("WEIR_RUN_ID").ok().filter(|r| !r.is_empty()),
                    },
                };
                let base_dir = match base_dir {
                    Some(d) => d,
                    None => std::env::current_dir().map_err(Error::io("current directory"))?,
                };
                let restore = restore.as_deref().map(RestoreFrom::parse);
                let tls = match (&tls_dir, &tls_server_name) {
                    (Some(dir), Some(name)) => {
                        let tls = weir_runtime::worker::tls::JobTls::load(dir, name)?;
                        tracing::info!(worker = index, dir = %dir.display(), server_name = %name, "TLS on: mutual on data and coordinator connections, HTTPS on the control endpoint");
                        Some(Arc::new(tls))
                    }
                    _ => None,
                };
                let config = WorkerConfig { plan: Arc::new(plan), index, placement, state_dir, restore, allow_non_restored_state, expect_state, base_dir, token, job_id, tls };
                tokio::select! {
                    r = worker::run(config) => r.map(|()| Ended::Done),
                    () = terminated() => Ok(Ended::Terminated),
                }
            });
            // Do not wait for blocked tasks (a peer that is gone) on the way out.
            runtime.shutdown_timeout(Duration::from_millis(100));
            match result {
                Ok(Ended::Done) => ExitCode::SUCCESS,
                Ok(Ended::Terminated) => {
                    // Like a kill, which every path of the job survives: what
                    // the open checkpoint wrote is never completed, and the
                    // job restores from its latest completed checkpoint.
                    tracing::info!(worker = index, "SIGTERM: the worker leaves at once; the job restores from its latest completed checkpoint");
                    if std::path::Path::new(TERMINATION_LOG).exists() {
                        let _ = std::fs::write(TERMINATION_LOG, "the worker was stopped by SIGTERM (its pod was deleted or evicted)");
                    }
                    ExitCode::from(128 + 15)
                }
                Err(e) => {
                    tracing::error!(worker = index, error = %e, "worker failed");
                    // On Kubernetes the kubelet puts this file's content in the
                    // pod's status, where the operator reads why the run failed.
                    if std::path::Path::new(TERMINATION_LOG).exists() {
                        let _ = std::fs::write(TERMINATION_LOG, e.to_string().chars().take(2048).collect::<String>());
                    }
                    if e.is_fatal() {
                        ExitCode::from(local::EXIT_FATAL as u8)
                    } else {
                        ExitCode::FAILURE
                    }
                }
            }
        }
        command => {
            init_tracing(false);
            match runtime.block_on(run_command(command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    // Scripts tell "fix something first" from "may work if run again".
                    if e.downcast_ref::<Error>().is_some_and(Error::is_fatal) {
                        ExitCode::from(local::EXIT_FATAL as u8)
                    } else {
                        ExitCode::FAILURE
                    }
                }
            }
        }
    }
}

/// The container's termination message file (terminationMessagePath's default).
const TERMINATION_LOG: &str = "/dev/termination-log";

/// Calls a running local job's control endpoint and decodes a 2xx answer.
async fn call_job<T: serde::de::DeserializeOwned>(run: &local::RunInfo, method: &str, path: &str, body: Option<&[u8]>, timeout: Duration) -> anyhow::Result<T> {
    let (code, answer) = control::call(run.api, method, path, &run.token, body, timeout)
        .await
        .with_context(|| format!("job `{}` does not answer: is it still running?", run.job))?;
    if !(200..300).contains(&code) {
        let reason = serde_json::from_str::<weir_api::control::ErrorBody>(&answer).map(|e| e.error).unwrap_or_else(|_| answer.trim().to_string());
        anyhow::bail!("{method} {path} of job `{}` failed ({code}): {reason}", run.job);
    }
    serde_json::from_str(&answer).with_context(|| format!("unexpected answer from job `{}`", run.job))
}

/// Requests a savepoint and polls its outcome until it is decided.
async fn take_savepoint(run: &local::RunInfo, state_dir: &str, stop: bool, within: Duration) -> anyhow::Result<weir_api::control::CheckpointStatus> {
    let deadline = Instant::now() + within;
    let asked_unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    // The id makes asking again safe: a retry never takes a second savepoint.
    let request_id = format!("cli-{:016x}", rand::random::<u64>());
    let body = serde_json::to_vec(&SavepointRequest { request_id: Some(request_id.clone()), stop })?;
    let mut outcome: SavepointOutcome = call_job(run, "POST", "/v1/savepoints", Some(&body), Duration::from_secs(10)).await?;
    let poll = weir_runtime::fault::slow_savepoint_poll().unwrap_or(Duration::from_millis(100));
    while outcome.state == SavepointState::Pending {
        if Instant::now() >= deadline {
            anyhow::bail!("savepoint {request_id} of `{}` is still pending after {}s", run.job, within.as_secs());
        }
        tokio::time::sleep(poll).await;
        outcome = match call_job(run, "GET", &format!("/v1/savepoints/{request_id}"), None, Duration::from_secs(10)).await {
            Ok(o) => o,
            // A local job stopped with a savepoint ends at once, and its
            // control endpoint with it, maybe before the answer was read:
            // its final status says how it ended.
            Err(e) if stop => return stopped_since(state_dir, run, asked_unix_ms).await?.ok_or(e),
            Err(e) => return Err(e),
        };
    }
    match (outcome.state, outcome.savepoint) {
        (SavepointState::Completed, Some(sp)) => Ok(sp),
        (SavepointState::Completed, None) => anyhow::bail!("savepoint {request_id} of `{}` completed without a location", run.job),
        _ => anyhow::bail!("savepoint of `{}` failed: {}", run.job, outcome.error.unwrap_or_else(|| "no reason given".into())),
    }
}

/// The savepoint the job `run` stopped with, if its final status says it
/// was stopped by a savepoint completed after `since_unix_ms`.
async fn stopped_since(state_dir: &str, run: &local::RunInfo, since_unix_ms: u64) -> anyhow::Result<Option<weir_api::control::CheckpointStatus>> {
    let storage = CheckpointStorage::open(state_dir, &run.job, false)?;
    let Some(bytes) = storage.job_root.get(weir_runtime::checkpoint::coordinator::FINAL_STATUS).await? else { return Ok(None) };
    let st: JobStatus = serde_json::from_slice(&bytes).context("reading the final status")?;
    Ok(st.last_savepoint.filter(|sp| st.phase == "stopped" && sp.completed_unix_ms >= since_unix_ms))
}

async fn run_command(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { pipeline, state_dir, restore, parallelism, workers, allow_non_restored_state, max_restarts, job_id } => {
            let restore = restore.as_deref().map(RestoreFrom::parse);
            let summary = local::run(RunOptions { pipeline, state_dir, restore, parallelism, workers, allow_non_restored_state, max_restarts, job_id }).await?;
            let st = &summary.status;
            let stopped_with = (st.phase == "stopped").then(|| st.last_savepoint.as_ref().map(|s| s.location.clone())).flatten();
            if let Some(sp) = &stopped_with {
                eprintln!("stopped `{}` with savepoint {sp}; resume with `weir run --restore {sp}`", st.job);
            }
            // Skipped input is said in the human line too: it is data the output lacks.
            let skipped = match st.records_skipped {
                0 => String::new(),
                n => format!(", {n} bad input records skipped"),
            } + &match st.records_late {
                0 => String::new(),
                n => format!(", {n} late records dropped by windows"),
            };
            eprintln!(
                "{} `{}` in {:.1}s: {} records in, {} records out{skipped}, {} checkpoints, last checkpoint {}, {} restarts",
                if stopped_with.is_some() { "stopped" } else { "finished" },
                st.job,
                summary.elapsed.as_secs_f64(),
                st.records_in,
                st.records_out,
                st.checkpoints_completed,
                st.latest_checkpoint.as_ref().map(|c| c.id.to_string()).unwrap_or_else(|| "none".into()),
                summary.restarts
            );
            // One machine-readable line for scripts and benchmarks.
            println!("{}", serde_json::json!({
                "job": st.job, "records_in": st.records_in, "records_out": st.records_out,
                "records_skipped": st.records_skipped, "records_late": st.records_late,
                "elapsed_s": summary.elapsed.as_secs_f64(), "restarts": summary.restarts,
                "checkpoints": st.checkpoints_completed,
                "last_checkpoint": st.latest_checkpoint.as_ref().map(|c| c.id),
                "stopped_with_savepoint": stopped_with,
            }));
            Ok(())
        }
        Command::Plan { pipeline, parallelism } => {
            let (spec, src) = local::load_pipeline(&pipeline, parallelism)?;
            let plan = plan::plan(&spec, &src)?;
            print!("{}", plan.describe());
            Ok(())
        }
        Command::Savepoint { state_dir, job, dispose: Some(location), .. } => {
            let run = local::find_run(&state_dir, job.as_deref()).await?;
            let body = serde_json::to_vec(&weir_api::control::SavepointDisposal { location })?;
            let done: weir_api::control::SavepointDisposed = call_job(&run, "POST", "/v1/savepoint-disposals", Some(&body), Duration::from_secs(600)).await?;
            let what = if done.existed { "disposed of" } else { "already gone" };
            eprintln!("savepoint {} of `{}` {what}", done.location, run.job);
            Ok(())
        }
        Command::Savepoint { state_dir, job, stop, dispose: None } => {
            let run = local::find_run(&state_dir, job.as_deref()).await?;
            let sp = take_savepoint(&run, &state_dir, stop, Duration::from_secs(600)).await?;
            let how = if stop { "; the job stops" } else { "" };
            eprintln!("savepoint {} of `{}` complete in {} ms{how}", sp.id, run.job, sp.duration_ms);
            println!("{}", sp.location);
            Ok(())
        }
        Command::Status { state_dir, job } => {
            let run = local::find_run(&state_dir, job.as_deref()).await?;
            let st: JobStatus = match call_job(&run, "GET", "/v1/status", None, Duration::from_secs(5)).await {
                Ok(st) => st,
                Err(e) => {
                    // A job that has finished no longer answers; its last status is kept.
                    let storage = CheckpointStorage::open(&state_dir, &run.job, false)?;
                    match storage.job_root.get(weir_runtime::checkpoint::coordinator::FINAL_STATUS).await? {
                        Some(b) => serde_json::from_slice(&b).context("reading the final status")?,
                        None => return Err(e),
                    }
                }
            };
            println!("{}", serde_json::to_string_pretty(&st)?);
            Ok(())
        }
        Command::Checkpoints { command: CheckpointsCommand::List { state_dir, job, json } } => {
            let root = weir_runtime::checkpoint::Location::parse(&state_dir, false)?;
            let jobs = match job {
                Some(j) => vec![j],
                None => root.list_dirs("").await?,
            };
            let mut all = Vec::new();
            for j in &jobs {
                let storage = CheckpointStorage::open(&state_dir, j, false)?;
                for s in storage.list().await? {
                    // Sizes are listed only here: retention, which lists after
                    // every checkpoint, has no use for them.
                    let size = storage.dir(&s.dir).size().await.unwrap_or(0);
                    all.push((j.clone(), s, size));
                }
            }
            if json {
                let v: Vec<_> = all.iter().map(|(j, s, size)| serde_json::json!({"job": j, "snapshot": s, "size_bytes": size})).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            if all.is_empty() {
                eprintln!("no checkpoints or savepoints in {state_dir}");
                return Ok(());
            }
            println!("{:<16} {:<10} {:>6} {:<10} {:>10}  {:<7} {}", "JOB", "KIND", "ID", "STATE", "SIZE", "LATEST", "PATH");
            for (j, s, size) in all {
                println!(
                    "{:<16} {:<10} {:>6} {:<10} {:>10}  {:<7} {}",
                    j,
                    format!("{:?}", s.kind).to_lowercase(),
                    s.id,
                    if s.complete { "complete" } else { "incomplete" },
                    size,
                    if s.is_latest { "*" } else { "" },
                    s.location
                );
            }
            Ok(())
        }
        Command::Worker { .. } => unreachable!("handled in main"),
    }
}
