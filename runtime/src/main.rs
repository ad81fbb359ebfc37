//! The `weir` command: run pipelines locally, and the worker entry point
//! that pods and the local supervisor start.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use weir_runtime::checkpoint::CheckpointStorage;
use weir_runtime::control::{self, CheckpointStatus, JobStatus};
use weir_runtime::local::{self, RestoreFrom, RunOptions};
use weir_runtime::worker::{self, Cluster, WorkerConfig};
use weir_runtime::{plan, Error};

#[derive(Parser)]
#[command(name = "weir", version, about = "Run streaming pipelines with exactly-once checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline on this machine as worker processes, restoring it after failures.
    Run {
        /// The pipeline file (YAML).
        pipeline: PathBuf,
        /// Where checkpoints and savepoints are kept (a directory or a file:// URL).
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
    },
    /// Take a savepoint of a running local job and print its path.
    Savepoint {
        #[arg(long, default_value = "weir-state")]
        state_dir: String,
        /// The job's name (needed when the state directory holds several jobs).
        #[arg(long)]
        job: Option<String>,
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
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        pipeline: PathBuf,
        #[arg(long)]
        index: u32,
        /// The run's membership as JSON.
        #[arg(long)]
        cluster: String,
        #[arg(long)]
        state_dir: String,
        #[arg(long)]
        base_dir: PathBuf,
        #[arg(long)]
        parallelism: Option<u32>,
        #[arg(long)]
        restore: Option<String>,
        #[arg(long)]
        allow_non_restored_state: bool,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Worker { pipeline, index, cluster, state_dir, base_dir, parallelism, restore, allow_non_restored_state } => {
            init_tracing(std::env::var_os("WEIR_LOG_JSON").is_some());
            let result = runtime.block_on(async {
                let (spec, src) = local::load_pipeline(&pipeline, parallelism)?;
                let plan = plan::plan(&spec, &src)?;
                let cluster: Cluster = serde_json::from_str(&cluster).map_err(|e| Error::Job(format!("--cluster: {e}")))?;
                let token = std::env::var("WEIR_CONTROL_TOKEN").unwrap_or_default();
                worker::run(WorkerConfig { plan: Arc::new(plan), index, cluster, state_dir, restore, allow_non_restored_state, base_dir, token }).await
            });
            // Do not wait for blocked tasks (a peer that is gone) on the way out.
            runtime.shutdown_timeout(Duration::from_millis(100));
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(worker = index, error = %e, "worker failed");
                    if is_fatal(&e) {
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
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Calls a running local job's control API and decodes the answer.
async fn ask_job<T: serde::de::DeserializeOwned>(
    state_dir: &str,
    job: Option<&str>,
    method: &str,
    path: &str,
    timeout: Duration,
) -> anyhow::Result<(local::RunInfo, T)> {
    let run = local::find_run(state_dir, job).await?;
    let (code, body) = control::call(run.api, method, path, &run.token, timeout)
        .await
        .with_context(|| format!("job `{}` does not answer: is it still running?", run.job))?;
    if code != 200 {
        anyhow::bail!("{method} {path} of job `{}` failed: {}", run.job, body.trim());
    }
    let answer = serde_json::from_str(&body).with_context(|| format!("unexpected answer from job `{}`", run.job))?;
    Ok((run, answer))
}

/// Errors that a restart would meet again.
fn is_fatal(e: &Error) -> bool {
    matches!(e, Error::Pipeline(_) | Error::Plan { .. } | Error::Expression { .. } | Error::SourceFile { .. } | Error::BadCheckpoint { .. } | Error::StateDir { .. })
}

async fn run_command(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { pipeline, state_dir, restore, parallelism, workers, allow_non_restored_state, max_restarts } => {
            let restore = restore.map(|r| if r == "latest" { RestoreFrom::Latest } else { RestoreFrom::Path(r) });
            let summary = local::run(RunOptions { pipeline, state_dir, restore, parallelism, workers, allow_non_restored_state, max_restarts }).await?;
            let st = &summary.status;
            eprintln!(
                "finished `{}` in {:.1}s: {} records in, {} records out, {} checkpoints, last checkpoint {}, {} restarts",
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
                "elapsed_s": summary.elapsed.as_secs_f64(), "restarts": summary.restarts,
                "checkpoints": st.checkpoints_completed,
                "last_checkpoint": st.latest_checkpoint.as_ref().map(|c| c.id),
            }));
            Ok(())
        }
        Command::Savepoint { state_dir, job } => {
            let (run, sp): (_, CheckpointStatus) = ask_job(&state_dir, job.as_deref(), "POST", "/v1/savepoints", Duration::from_secs(600)).await?;
            eprintln!("savepoint {} of `{}` complete in {} ms", sp.id, run.job, sp.duration_ms);
            println!("{}", sp.location);
            Ok(())
        }
        Command::Status { state_dir, job } => {
            let st: JobStatus = match ask_job(&state_dir, job.as_deref(), "GET", "/v1/status", Duration::from_secs(5)).await {
                Ok((_, st)) => st,
                Err(e) => {
                    // A job that has finished no longer answers; its last status is kept.
                    let run = local::find_run(&state_dir, job.as_deref()).await?;
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
