//! The restart loop of `weir run`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::listeners::Listeners;
use super::progress::Progress;
use super::run_info::RunInfo;
use super::run_lease::RunLease;
use super::run_lock::{Holder, RunLock};
use crate::checkpoint::{CheckpointStorage, Location};

/// The lock file of `weir run` in the job's state directory.
pub const RUN_LOCK: &str = "run.lock";
use crate::control::{self, JobStatus};
use crate::error::{Error, Result};
use crate::plan;
pub use crate::worker::restore::RestoreFrom;
use crate::worker::restore::RestoredState;
use crate::worker::Cluster;
use weir_api::PipelineSpec;

/// Exit code of a worker that met an error a restart cannot fix (bad input,
/// an unusable checkpoint): the supervisor stops instead of restarting.
pub const EXIT_FATAL: i32 = 3;

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub pipeline: PathBuf,
    pub state_dir: String,
    pub restore: Option<RestoreFrom>,
    pub parallelism: Option<u32>,
    pub workers: Option<u32>,
    pub allow_non_restored_state: bool,
    /// Restarts in a row without a new completed checkpoint before giving up.
    pub max_restarts: u32,
    /// Passed to the workers (`weir worker --job-id`).
    pub job_id: Option<String>,
}

/// What a finished run reports.
pub struct RunSummary {
    pub status: JobStatus,
    pub restarts: u32,
    pub elapsed: Duration,
}

/// Loads and checks the pipeline, applying a parallelism override.
pub fn load_pipeline(path: &std::path::Path, parallelism: Option<u32>) -> Result<(PipelineSpec, weir_api::pipeline::PipelineSource)> {
    let (mut spec, src) = PipelineSpec::from_file(path)?;
    if let Some(p) = parallelism {
        if p == 0 || p > spec.max_parallelism {
            return Err(Error::Job(format!("--parallelism {p}: expected 1 to max_parallelism ({})", spec.max_parallelism)));
        }
        spec.parallelism = p;
    }
    Ok((spec, src))
}

#[cfg(test)]
fn free_addr() -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(Error::io("finding a free port"))?;
    l.local_addr().map_err(Error::io("finding a free port"))
}

fn random_hex(bytes: usize) -> String {
    (0..bytes).map(|_| format!("{:02x}", rand::random::<u8>())).collect()
}

pub async fn run(opts: RunOptions) -> Result<RunSummary> {
    let started = Instant::now();
    let (spec, src) = load_pipeline(&opts.pipeline, opts.parallelism)?;
    let plan_for_checks = plan::plan(&spec, &src)?;
    let storage = CheckpointStorage::open(&opts.state_dir, &spec.name, true)?;
    storage.check_writable().await?;
    let base_dir = std::env::current_dir().map_err(Error::io("current directory"))?;

    // An at-most-once job restores no snapshot: with `--restore latest` its
    // workers resume where the sources last read (`worker/read_marks.rs`).
    let at_most_once = spec.runtime_guarantee() == weir_api::Guarantee::AtMostOnce;
    let mut resume = at_most_once && opts.restore == Some(RestoreFrom::Latest);
    // Whether this run goes on with the job's history rather than start it
    // afresh: `--restore latest`, and every restart.
    let mut continues = !at_most_once && opts.restore == Some(RestoreFrom::Latest);
    if at_most_once {
        if let Some(RestoreFrom::Path(path)) = &opts.restore {
            return Err(crate::worker::at_most_once_refuses(path));
        }
    }
    // What to restore is checked before anything is written: a bad
    // snapshot or a running job leaves the state and output untouched.
    let mut restore = if at_most_once { None } else { resolve_restore(&opts, &storage, &spec, &plan_for_checks, true).await? };
    // One run of a job at a time: its state directory (and a file sink's
    // output directory) stay locked while any process of this run lives.
    let holder = Holder {
        job: spec.name.clone(),
        pid: std::process::id(),
        started_unix_ms: crate::checkpoint::now_unix_ms(),
        state_dir: opts.state_dir.clone(),
    };
    let mut locks = Vec::new();
    if let Some(dir) = &storage.job_root.local {
        std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
        locks.push(RunLock::acquire(&dir.join(RUN_LOCK), "state directory", &holder)?);
    }
    // Output in S3 has no kernel lock; the state's lease below covers the
    // usual case (one job, one state, one output).
    for f in spec.graph().sinks.iter().filter_map(|n| n.spec.clone().file()).filter(|f| !f.in_object_store()) {
        let out = base_dir.join(&f.path);
        std::fs::create_dir_all(&out).map_err(Error::io(format!("file sink: cannot create {}", out.display())))?;
        locks.push(RunLock::acquire(&out.join(format!(".weir-{}.lock", spec.name)), "output directory", &holder)?);
    }

    // Shared storage has no kernel lock (taken before `latest` is resolved
    // again below, like the locks): a lease there refuses a second
    // `weir run` of the job while this one lives.
    let mut lease = match &storage.job_root.local {
        None => Some(RunLease::acquire(&storage, &spec.name, &random_hex(8)).await?),
        Some(_) => None,
    };
    // Under the lock, `latest` cannot move any more; resolve it again in
    // case another run moved it in between.
    if opts.restore == Some(RestoreFrom::Latest) && !at_most_once {
        let now = resolve_restore(&opts, &storage, &spec, &plan_for_checks, false).await?;
        if now.as_ref().map(|l| &l.display) != restore.as_ref().map(|l| &l.display) {
            restore = resolve_restore(&opts, &storage, &spec, &plan_for_checks, true).await?;
        }
    }
    // The lineage of this run begins here: `latest` names its starting point
    // (or nothing, for a fresh start) until it completes a checkpoint, so a
    // restart after a crash resumes this run's own history, never the state
    // a previous run left behind. The supervisor claims a run epoch of its
    // own for this; each attempt's worker 0 claims the next one, and begins
    // from what it is given.
    let claim = storage.claim_run(&format!("weir-run-{}", random_hex(4))).await?;
    storage.begin_lineage(&claim, restore.as_ref()).await?;

    let workers = opts.workers.unwrap_or(spec.parallelism).clamp(1, spec.parallelism);
    let (guarantee, why) = spec.guarantee_and_reason();
    // Checkpoints are what the strongest sink needs; a weaker side sink
    // (several sinks) lowers what the job promises, not how it runs.
    let runtime = spec.runtime_guarantee();
    eprintln!(
        "running `{}`: parallelism {}, {} worker process{}, {}, guarantee {}{}",
        spec.name,
        spec.parallelism,
        workers,
        if workers == 1 { "" } else { "es" },
        match (spec.checkpoint.mode, runtime) {
            (_, weir_api::Guarantee::AtMostOnce) => format!(
                "no checkpoints (sinks publish every {})",
                spec.checkpoint.interval
            ),
            (weir_api::CheckpointMode::Unaligned, weir_api::Guarantee::ExactlyOnce) => {
                format!(
                    "unaligned checkpoints every {} (records in flight are checkpointed)",
                    spec.checkpoint.interval
                )
            }
            (weir_api::CheckpointMode::Aligned, weir_api::Guarantee::ExactlyOnce) =>
                match spec.checkpoint.alignment_timeout {
                    Some(t) => format!(
                        "aligned checkpoints every {}, unaligned when aligning takes over {t}",
                        spec.checkpoint.interval
                    ),
                    None => format!("aligned checkpoints every {}", spec.checkpoint.interval),
                },
            // At-least-once does not align barriers (see worker/gate.rs).
            _ => format!(
                "non-aligned checkpoints every {} (barriers are not aligned)",
                spec.checkpoint.interval
            ),
        },
        guarantee,
        match guarantee {
            weir_api::Guarantee::ExactlyOnce => String::new(),
            weir_api::Guarantee::AtLeastOnce => format!(" ({why}; records may repeat after a failure)"),
            weir_api::Guarantee::AtMostOnce => format!(" ({why}; records in flight at a failure are lost, none is repeated)"),
        }
    );
    eprintln!("state: {}", storage.job_root.display);

    // Everything is checked: from here on the state directory belongs to this run.
    storage.job_root.delete(crate::checkpoint::coordinator::FINAL_STATUS).await?;
    let token = random_hex(16);
    let mut progress = Progress::new();
    let mut restarts = 0u32;
    let mut failures_in_a_row = 0u32;
    let mut attempt = 0u32;
    loop {
        let run_id = format!("{}{:02}", random_hex(4), attempt % 100);
        // Held open until the workers have started: see `listeners`.
        let mut listeners = Listeners::default();
        let cluster = Cluster {
            run_id: run_id.clone(),
            workers: (0..workers).map(|_| listeners.bind_free()).collect::<Result<_>>()?,
            coordinator: listeners.bind_free()?,
            api: listeners.bind_free()?,
        };
        let cluster_json = serde_json::to_string(&cluster).map_err(|e| Error::Job(e.to_string()))?;
        let exe = std::env::current_exe().map_err(Error::io("locating the weir binary"))?;
        let mut children: Vec<Child> = Vec::new();
        for i in 0..workers {
            let mut cmd = Command::new(&exe);
            cmd.arg("worker")
                .arg("--pipeline")
                .arg(&opts.pipeline)
                .arg("--index")
                .arg(i.to_string())
                .arg("--cluster")
                .arg(&cluster_json)
                .arg("--state-dir")
                .arg(&storage_root_arg(&opts.state_dir))
                .arg("--base-dir")
                .arg(&base_dir)
                .arg("--parallelism")
                .arg(spec.parallelism.to_string())
                .args(crate::checkpoint::s3::settings().to_args())
                .arg(format!("--heartbeat-timeout={}ms", crate::worker::protocol::heartbeat_timeout().as_millis()))
                .env("WEIR_CONTROL_TOKEN", &token)
                .stdin(Stdio::null())
                .kill_on_drop(true);
            let inherit: Vec<_> = locks.iter().map(|l| l.keep_across_exec()).collect();
            let served = match i {
                0 => vec![cluster.workers[0], cluster.coordinator, cluster.api],
                _ => vec![cluster.workers[i as usize]],
            };
            let (inherited, keep_listeners) = listeners.for_worker(&served);
            cmd.env(super::listeners::ENV, inherited);
            if let Some(loc) = &restore {
                cmd.arg("--restore").arg(&loc.display);
            }
            // A restart before the first checkpoint continues this run's
            // history (`--restore latest` finding no checkpoint): unlike a
            // fresh start, its sources start where the first attempt's did.
            if resume || (continues && restore.is_none()) {
                cmd.arg("--restore").arg("latest");
            }
            if opts.allow_non_restored_state {
                cmd.arg("--allow-non-restored-state");
            }
            if let Some(id) = &opts.job_id {
                cmd.arg("--job-id").arg(id);
            }
            if progress.is_tty() && std::env::var_os("RUST_LOG").is_none() {
                cmd.env("RUST_LOG", "warn");
            }
            // Workers must not outlive the supervisor, however it dies.
            // A worker inherits the run locks, so they stay held until the
            // last process of the run is gone.
            unsafe {
                cmd.pre_exec(move || {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    for keep in &inherit {
                        keep()?;
                    }
                    keep_listeners()
                });
            }
            children.push(cmd.spawn().map_err(Error::io(format!("starting worker {i}")))?);
        }
        drop(listeners);
        let info = RunInfo {
            job: spec.name.clone(),
            supervisor_pid: std::process::id(),
            worker_pids: children.iter().filter_map(|c| c.id()).collect(),
            api: cluster.api,
            token: token.clone(),
            run_id: run_id.clone(),
            attempt,
        };
        info.write(&storage).await?;
        tracing::info!(attempt, run_id = %run_id, workers, restore = restore.as_ref().map(|l| l.display.clone()), "workers started");

        let checkpoint_before = latest_id(&storage).await;
        let attempt_started = Instant::now();
        let outcome = supervise(&mut children, cluster.api, &token, &mut progress, restarts).await;
        progress.finish_line();
        match outcome {
            Outcome::Finished(last_polled) => {
                let status = match storage.job_root.get(crate::checkpoint::coordinator::FINAL_STATUS).await? {
                    Some(b) => serde_json::from_slice(&b).unwrap_or(last_polled),
                    None => last_polled,
                };
                release(&mut lease).await;
                return Ok(RunSummary { status, restarts, elapsed: started.elapsed() });
            }
            Outcome::Interrupted => {
                release(&mut lease).await;
                return Err(Error::Job("interrupted".into()));
            }
            Outcome::Fatal(msg) => {
                release(&mut lease).await;
                return Err(Error::Fatal(msg));
            }
            Outcome::Failed(msg) => {
                restarts += 1;
                attempt += 1;
                // Without checkpoints to tell progress by, an at-most-once
                // attempt that ran a while made some.
                let progressed = match at_most_once {
                    true => attempt_started.elapsed() >= AT_MOST_ONCE_PROGRESS,
                    false => latest_id(&storage).await > checkpoint_before,
                };
                failures_in_a_row = if progressed { 1 } else { failures_in_a_row + 1 };
                if failures_in_a_row > opts.max_restarts {
                    return Err(Error::Job(format!("{msg}; gave up after {} restarts in a row without a completed checkpoint", opts.max_restarts)));
                }
                let backoff = Duration::from_millis(100u64 << (failures_in_a_row - 1).min(6));
                // `latest` belongs to this run's lineage (set at its start):
                // its newest checkpoint, or where the run started.
                let from = if at_most_once {
                    resume = true;
                    "where the sources last read (at-most-once: no state is restored)".to_string()
                } else {
                    restore = storage.latest().await?;
                    continues = true;
                    restore.as_ref().map(|l| l.display.clone()).unwrap_or_else(|| "the beginning (no checkpoint yet)".into())
                };
                eprintln!("{msg}; restarting in {:.1}s from {from} (restart {restarts})", backoff.as_secs_f64());
                tracing::warn!(restarts, backoff_ms = backoff.as_millis() as u64, from = %from, "restoring the job");
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

/// How long an at-most-once attempt must run for its failure not to count
/// as one more in a row (`--max-restarts`).
const AT_MOST_ONCE_PROGRESS: Duration = Duration::from_secs(10);

async fn release(lease: &mut Option<RunLease>) {
    if let Some(l) = lease.take() {
        l.release().await;
    }
}

/// Resolves `--restore` and checks that the snapshot fits the pipeline;
/// `say` reports the choice on stderr.
async fn resolve_restore(opts: &RunOptions, storage: &CheckpointStorage, spec: &PipelineSpec, plan: &plan::JobPlan, say: bool) -> Result<Option<Location>> {
    let Some(from) = &opts.restore else { return Ok(None) };
    let Some(loc) = from.resolve(storage).await? else {
        if say {
            eprintln!("no completed checkpoint of `{}` in {}: starting fresh", spec.name, storage.job_root.display);
        }
        return Ok(None);
    };
    if say {
        let r = RestoredState::load(loc.clone()).await?;
        r.check_compatible(plan, opts.allow_non_restored_state)?;
        r.verify_state_files().await?;
        eprintln!("restoring `{}` from {} {} ({})", spec.name, kind_name(&r), r.meta.checkpoint_id, loc.display);
    }
    Ok(Some(loc))
}

fn kind_name(r: &RestoredState) -> &'static str {
    match r.meta.kind {
        crate::checkpoint::SnapshotKind::Checkpoint => "checkpoint",
        crate::checkpoint::SnapshotKind::Savepoint => "savepoint",
    }
}

/// Workers resolve the state dir themselves; give them an absolute one.
fn storage_root_arg(state_dir: &str) -> String {
    if state_dir.contains("://") {
        return state_dir.to_string();
    }
    std::path::absolute(state_dir).map(|p| p.display().to_string()).unwrap_or_else(|_| state_dir.to_string())
}

async fn latest_id(storage: &CheckpointStorage) -> u64 {
    match storage.latest().await {
        Ok(Some(loc)) => loc.display.rsplit("chk-").next().and_then(|n| n.parse().ok()).unwrap_or(0),
        _ => 0,
    }
}

/// How long the other workers of a failed run may take to exit on their own
/// before they are killed (see `supervise`).
const FAILURE_GRACE: Duration = Duration::from_millis(500);

enum Outcome {
    Finished(JobStatus),
    Failed(String),
    Fatal(String),
    Interrupted,
}

async fn supervise(children: &mut Vec<Child>, api: SocketAddr, token: &str, progress: &mut Progress, restarts: u32) -> Outcome {
    let (exit_tx, mut exits) = mpsc::unbounded_channel::<(usize, std::io::Result<std::process::ExitStatus>)>();
    let mut waiting = Vec::new();
    for (i, mut child) in children.drain(..).enumerate() {
        let tx = exit_tx.clone();
        waiting.push(child.id());
        tokio::spawn(async move {
            let r = child.wait().await;
            let _ = tx.send((i, r));
        });
    }
    let kill_all = |pids: &Vec<Option<u32>>| {
        for pid in pids.iter().flatten() {
            unsafe {
                libc::kill(*pid as i32, libc::SIGKILL);
            }
        }
    };
    let total = waiting.len();
    let mut exited_ok = 0usize;
    let mut last_status = JobStatus::default();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    loop {
        let terminated = async {
            match &mut sigterm {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some((i, r)) = exits.recv() => {
                let code = r.as_ref().ok().and_then(|s| s.code());
                if code == Some(0) {
                    exited_ok += 1;
                    if exited_ok == total {
                        return Outcome::Finished(last_status);
                    }
                    continue;
                }
                // The worker that met a fatal error is not always the first
                // to exit: a peer that lost its connection to it may be
                // quicker. Let the others end on their own for a moment, so
                // that a fatal exit among them is seen, then kill the rest.
                // Every exit seen in that moment is reported: the first one
                // is often only a peer's "connection closed", and the cause
                // (a SIGTERM, an out-of-memory kill) is the second.
                let mut remaining = total - exited_ok - 1;
                let mut fatal = (code == Some(EXIT_FATAL)).then_some(i);
                let mut seen = vec![describe_exit(i, &r)];
                let grace = tokio::time::sleep(FAILURE_GRACE);
                tokio::pin!(grace);
                while remaining > 0 && fatal.is_none() {
                    tokio::select! {
                        exit = exits.recv() => match exit {
                            Some((j, r)) => {
                                remaining -= 1;
                                let code = r.as_ref().ok().and_then(|s| s.code());
                                if code == Some(EXIT_FATAL) {
                                    fatal = Some(j);
                                } else if code != Some(0) {
                                    seen.push(describe_exit(j, &r));
                                }
                            }
                            None => break,
                        },
                        _ = &mut grace => break,
                    }
                }
                kill_all(&waiting);
                // Collect the others so that no worker of this run survives the next start.
                while remaining > 0 {
                    if exits.recv().await.is_none() { break; }
                    remaining -= 1;
                }
                if let Some(j) = fatal {
                    return Outcome::Fatal(format!("worker {j} exited with code {EXIT_FATAL} (an error a restart cannot fix; see its message above)"));
                }
                return Outcome::Failed(seen.join(", then "));
            }
            _ = tick.tick() => {
                if let Ok((200, body)) = control::call(api, "GET", "/v1/status", token, None, Duration::from_millis(500)).await {
                    if let Ok(st) = serde_json::from_str::<JobStatus>(&body) {
                        progress.update(&st, restarts);
                        last_status = st;
                    }
                }
            }
            _ = tokio::signal::ctrl_c() => {
                kill_all(&waiting);
                return Outcome::Interrupted;
            }
            // SIGTERM (a service manager's stop, `kill`) ends the run as
            // Ctrl-C does.
            Some(()) = terminated => {
                kill_all(&waiting);
                return Outcome::Interrupted;
            }
        }
    }
}

/// Says how a worker ended, in the words of a process table: its exit code,
/// or the signal that killed it.
fn describe_exit(i: usize, r: &std::io::Result<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match r {
        Err(e) => format!("worker {i} could not be watched: {e}"),
        Ok(s) => match s.code() {
            Some(c) => format!("worker {i} exited with code {c}"),
            None => format!("worker {i} was killed by signal {}", s.signal().unwrap_or(0)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(script: &str) -> Child {
        Command::new("sh").args(["-c", script]).kill_on_drop(true).spawn().unwrap()
    }

    #[tokio::test]
    async fn a_fatal_exit_just_after_a_peer_failed_decides_the_outcome() {
        // Worker 1 loses its connection to worker 0 and exits 1 first; worker
        // 0, which met the fatal error, exits 3 a moment later.
        let mut children = vec![worker("sleep 0.2; exit 3"), worker("exit 1"), worker("sleep 30")];
        let api = free_addr().unwrap();
        let started = Instant::now();
        match supervise(&mut children, api, "token", &mut Progress::new(), 0).await {
            Outcome::Fatal(msg) => assert!(msg.contains("worker 0"), "{msg}"),
            Outcome::Failed(msg) => panic!("retried: {msg}"),
            _ => panic!("neither failed nor fatal"),
        }
        // The worker that would not exit on its own was killed after the grace.
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn without_a_fatal_exit_a_failure_is_retried_and_stragglers_are_killed() {
        let mut children = vec![worker("exit 1"), worker("sleep 30")];
        let started = Instant::now();
        assert!(matches!(supervise(&mut children, free_addr().unwrap(), "token", &mut Progress::new(), 0).await, Outcome::Failed(_)));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_failure_names_every_worker_that_ended_on_its_own_first_one_first() {
        // Worker 0 loses its connection to worker 1 and exits 1; worker 1,
        // stopped by a SIGTERM, exits 143 a moment later. The cause is the
        // second exit, so both are named; the straggler killed afterwards is not.
        let mut children = vec![worker("exit 1"), worker("sleep 0.1; exit 143"), worker("sleep 30")];
        match supervise(&mut children, free_addr().unwrap(), "token", &mut Progress::new(), 0).await {
            Outcome::Failed(msg) => assert_eq!(msg, "worker 0 exited with code 1, then worker 1 exited with code 143"),
            _ => panic!("not a retried failure"),
        }
    }
}
