//! How a worker comes to know its run: given on the command line (`weir
//! run`), or sent by the operator to the control endpoint the worker serves
//! from the start (a pod, whose peers' IPs exist only once every pod does).
//! Also resolves `--restore` once the run is known.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

use super::restore::RestoredState;
use super::{bind, run_job, Cluster, WorkerConfig};
use crate::checkpoint::{CheckpointStorage, RunClaim};
use crate::control::{self, Control, JobStatus};
use crate::error::{Error, Result};

/// How a worker learns its membership and where it serves its control endpoint.
#[derive(Debug, Clone)]
pub enum Placement {
    /// `weir run`: the membership is given; worker 0 serves the endpoint at its `api`.
    Local(Cluster),
    /// A pod: serve the endpoint at `control_addr` at once, then wait (at most
    /// `membership_timeout`) for `PUT /v1/membership`; of run `run_id` only, if given.
    Pod { control_addr: SocketAddr, membership_timeout: Duration, run_id: Option<String> },
}

/// Runs the worker: obtains its membership, then runs its part of the job
/// until the job finishes (Ok) or the run fails.
pub async fn run(cfg: WorkerConfig) -> Result<()> {
    let spec = &cfg.plan.spec;
    let (guarantee, guarantee_reason) = spec.guarantee_and_reason();
    let control = Control::new(
        cfg.token.clone(),
        cfg.index,
        spec.parallelism,
        JobStatus {
            job: spec.name.clone(),
            phase: "awaiting-membership".into(),
            guarantee: guarantee.to_string(),
            guarantee_reason,
            parallelism: spec.parallelism,
            ..Default::default()
        },
    );
    let cluster = match &cfg.placement {
        Placement::Local(cluster) => {
            control.offer_membership(cluster.clone()).map_err(|r| Error::Job(format!("--cluster: {}", r.message)))?;
            if cfg.index == 0 {
                // The local supervisor speaks plain HTTP over loopback.
                spawn_control(bind(cluster.api).await?, control.clone(), None)?;
            }
            cluster.clone()
        }
        Placement::Pod { control_addr, membership_timeout, run_id } => {
            if let Some(run_id) = run_id {
                control.expect_run(run_id.clone());
            }
            spawn_control(bind(*control_addr).await?, control.clone(), cfg.tls.as_ref().map(|t| t.control()))?;
            let scheme = if cfg.tls.is_some() { "https" } else { "http" };
            tracing::info!(worker = cfg.index, addr = %control_addr, scheme, "control endpoint up; waiting for the membership (PUT /v1/membership)");
            let m = tokio::time::timeout(*membership_timeout, control.membership()).await.map_err(|_| {
                Error::Job(format!(
                    "no membership arrived within {}: the operator sends it with PUT /v1/membership to {control_addr} once every worker pod has an IP",
                    humane(*membership_timeout)
                ))
            })?;
            if cfg.index == 0 && m.api.port() != control_addr.port() {
                tracing::warn!(api = %m.api, control = %control_addr, "the membership's api is not this control endpoint; savepoints and status are served here only");
            }
            m
        }
    };
    run_job(&cfg, &cluster, control).await
}

/// An at-most-once run restores no snapshot (it would replay what came
/// after it): with `--restore latest` its sources resume at their read
/// marks (`read_marks.rs`), without `--restore` worker 0 forgets the marks
/// before any source starts, and a snapshot path is refused.
async fn at_most_once_start(cfg: &WorkerConfig, storage: &CheckpointStorage, run_id: &str) -> Result<(Option<RestoredState>, Option<RunClaim>)> {
    if let Some(super::RestoreFrom::Path(path)) = &cfg.restore {
        return Err(at_most_once_refuses(path));
    }
    let claim = if cfg.index == 0 { Some(storage.claim_run(run_id).await?) } else { None };
    if let Some(claim) = &claim {
        storage.begin_lineage(claim, None).await?;
        if cfg.restore.is_none() {
            let sources = source_ids(cfg);
            super::ReadMarks::clear(storage, &sources).await?;
            super::start_positions::clear(storage, &sources).await?;
        }
    }
    Ok((None, claim))
}

/// The state ids of the job's sources, which name their directories.
fn source_ids(cfg: &WorkerConfig) -> Vec<String> {
    cfg.plan.sources().map(|(_, s)| s.state_id.clone()).collect()
}

/// The refusal of `--restore PATH` for an at-most-once job.
pub fn at_most_once_refuses(path: &str) -> Error {
    Error::Plan {
        context: format!("--restore {path}"),
        message: "the job is at-most-once: it restores no checkpoint or savepoint, because that would repeat what came after it; \
                  use --restore latest to resume where its sources last read, or no --restore to start from the beginning"
            .into(),
    }
}

fn spawn_control(listener: TcpListener, control: Control, tls: Option<std::sync::Arc<rustls::ServerConfig>>) -> Result<()> {
    let serving = match tls {
        None => futures::future::Either::Left(control::serve(listener, control)),
        Some(config) => {
            let listener = super::tls::ControlListener::new(listener, config).map_err(Error::io("the control endpoint's listener"))?;
            futures::future::Either::Right(control::serve_tls(listener, control))
        }
    };
    tokio::spawn(async move {
        if let Err(e) = serving.await {
            tracing::error!(error = %e, "the control endpoint stopped");
        }
    });
    Ok(())
}

fn humane(d: Duration) -> String {
    weir_api::pipeline::HumanDuration::from_millis(d.as_millis() as u64).to_string()
}

/// Resolves `--restore` now that the run is known: `latest` means the latest
/// completed checkpoint at this moment, fresh when there is none.
///
/// Worker 0 first claims the run's epoch (the fence, `checkpoint/lineage.rs`)
/// and only then resolves: a run it supersedes can complete no checkpoint it
/// would not see. It returns the claim, which its coordinator holds.
pub(super) async fn restore_state(cfg: &WorkerConfig, storage: &CheckpointStorage, run_id: &str) -> Result<(Option<RestoredState>, Option<RunClaim>)> {
    if cfg.plan.spec.runtime_guarantee() == weir_api::Guarantee::AtMostOnce {
        return at_most_once_start(cfg, storage, run_id).await;
    }
    // Asked before the claim, which is itself a trace of the job.
    let had_state = !cfg.expect_state || storage.has_lineage().await?;
    let claim = if cfg.index == 0 { Some(storage.claim_run(run_id).await?) } else { None };
    let Some(from) = &cfg.restore else {
        // A fresh start begins a new lineage: a restart of this run with
        // `--restore latest` before its first checkpoint must start from the
        // beginning again, not from an older run's state.
        if let Some(claim) = &claim {
            storage.begin_lineage(claim, None).await?;
            // Before any worker says Ready, hence before any source opens.
            super::start_positions::clear(storage, &source_ids(cfg)).await?;
        }
        return Ok((None, claim));
    };
    let Some(location) = from.resolve(storage).await? else {
        if !had_state {
            return Err(Error::BadCheckpoint {
                location: storage.job_root.display.clone(),
                message: "the job has completed checkpoints, but this storage holds no state of it at all (no lineage, no checkpoint): \
                          was the storage lost or emptied, or does the job point at the wrong bucket, prefix or credentials? \
                          Starting from scratch would reprocess and republish everything, so the job stops here; \
                          restore it from a savepoint or checkpoint location, or create it anew to start fresh"
                    .into(),
            });
        }
        tracing::info!(worker = cfg.index, "no completed checkpoint in {}; starting fresh", storage.job_root.display);
        if let Some(claim) = &claim {
            storage.begin_lineage(claim, None).await?;
        }
        return Ok((None, claim));
    };
    let r = RestoredState::load(location).await?;
    r.check_compatible(&cfg.plan, cfg.allow_non_restored_state)?;
    // Worker 0 starts the lineage at this snapshot before any sink commits
    // its pending files (sinks commit only after the coordinator it hosts
    // starts the run), and only once every state file has been read and
    // checked: a damaged snapshot must fail the restore without becoming
    // `latest`.
    if let Some(claim) = &claim {
        r.verify_state_files().await?;
        storage.begin_lineage(claim, Some(&r.location)).await?;
    }
    tracing::info!(worker = cfg.index, checkpoint = r.meta.checkpoint_id, location = %r.location.display, "restoring");
    Ok((Some(r), claim))
}

