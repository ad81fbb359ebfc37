//! `StreamJob.status`: what the controller observed and decided.
//!
//! The controller writes every lifecycle transition here *before* acting on
//! it, so the status must hold enough to continue after an operator restart
//! (which trigger values were already handled, which savepoint is awaited).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::pipeline::Guarantee;

/// How many savepoints `savepointHistory` lists at most: `spec.savepoints.maxCount`
/// at its largest plus a margin for savepoints not disposed of yet. Older entries are dropped from
/// status (not from storage) so that the object stays small.
pub const SAVEPOINT_HISTORY_LIMIT: usize = crate::streamjob::spec::MAX_SAVEPOINT_COUNT as usize + 20;

/// Condition types the controller sets. Each condition's
/// `observedGeneration` is the `metadata.generation` it judges.
pub mod condition_types {
    /// True only while the spec of the judged generation runs: every worker
    /// up and the job checkpointing. `kubectl wait --for=condition=Ready`
    /// after a change therefore returns once the change runs.
    pub const READY: &str = "Ready";
    /// A deploy, upgrade, savepoint, suspension or recovery is under way.
    pub const PROGRESSING: &str = "Progressing";
    /// Something needs attention: failed savepoint, restarts, invalid pipeline.
    pub const DEGRADED: &str = "Degraded";
}

/// Reasons of a False `Ready` condition that tools may act on (an Argo CD
/// health check, alerts). Other reasons name the phase (`Deploying`,
/// `Upgrading`, `Recovering`, ...) or the failure (`CheckpointsStalled`).
pub mod ready_reasons {
    /// The spec of the judged generation runs.
    pub const RUNNING: &str = "Running";
    /// The judged generation was refused (invalid pipeline, no worker
    /// image, no shared volume); what ran before keeps running, if anything.
    pub const SPEC_REFUSED: &str = "SpecRefused";
    /// The upgrade to the judged generation failed (its savepoint failed or
    /// timed out); the previous spec keeps running and the upgrade is retried.
    pub const UPGRADE_FAILED: &str = "UpgradeFailed";
    /// The judged generation differs from the running one and its upgrade
    /// has not started yet.
    pub const UPGRADE_PENDING: &str = "UpgradePending";
    /// The judged generation waits for an upgrade slot: as many other jobs
    /// are upgrading as the operator lets upgrade at once
    /// (`--max-concurrent-upgrades`); the previous spec keeps running.
    pub const UPGRADE_QUEUED: &str = "UpgradeQueued";
    /// The judged generation was rolled back (spec.upgrade.rollback): it did
    /// not become healthy in time, or failed; the last spec that ran healthy
    /// runs instead, and the judged generation is not tried again until the
    /// spec changes.
    pub const ROLLED_BACK: &str = "RolledBack";
    /// The judged generation runs but has not completed its first checkpoint
    /// yet: with spec.upgrade.rollback it is rolled back if it does not by
    /// the deadline in `status.upgradeTrial`.
    pub const AWAITING_CHECKPOINT: &str = "AwaitingCheckpoint";
    /// The judged generation asks for suspension and its savepoint failed;
    /// the job keeps running and the suspension is retried.
    pub const SUSPEND_FAILED: &str = "SuspendFailed";
}

#[derive(KubeSchema, Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,

    /// Ready, Progressing and Degraded, each with a reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// When the job entered its current phase; bounds waits and feeds the
    /// transition-duration metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_since: Option<Time>,

    /// The run (set of worker pods) the controller started last. Written before
    /// its pods are created, so a restarted controller finds them by `run.id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunStatus>,

    /// The metadata.generation this status judges: the conditions say whether
    /// that generation's spec runs, and if not, why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Hash of the spec the job's pods run, written when a run comes up (every
    /// worker joined). It stays while the job is stopped, naming what ran
    /// last. A different hash of the current spec means an upgrade is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployed_spec_hash: Option<String>,

    /// The metadata.generation whose spec the job's pods run (the newest
    /// generation with that spec hash): when it is below
    /// `observedGeneration`, the latest change does not run yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployed_generation: Option<i64>,

    /// The guarantee the deployed pipeline gives (the weakest of its
    /// `guarantee` setting, its source and its sink).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guarantee: Option<Guarantee>,

    /// What sets `guarantee`: the part of the pipeline that weakens it, or
    /// that every part allows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guarantee_reason: Option<String>,

    /// The sink whose guarantee is the job's, when its sinks get different
    /// ones (a job promises its weakest sink's; each sink keeps its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guarantee_decided_by: Option<String>,

    /// The latest completed checkpoint, as reported by the job's coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<CheckpointRef>,

    /// The latest completed savepoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_savepoint: Option<SavepointRef>,

    /// The savepoints the operator took and has not disposed of, newest last
    /// (see spec.savepoints).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = SAVEPOINT_HISTORY_LIMIT))]
    pub savepoint_history: Vec<SavepointRef>,

    /// A savepoint the controller triggered and has not seen complete or fail yet;
    /// after an operator restart it is awaited, not triggered again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_savepoint: Option<PendingSavepoint>,

    /// The spec.initialSavepoint the first run started from; a later change to
    /// spec.initialSavepoint does not apply to an existing job (status says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_savepoint: Option<String>,

    /// The spec.savepointTrigger value last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_savepoint_trigger: Option<String>,

    /// The spec.restartTrigger value last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_restart_trigger: Option<String>,

    /// Restarts after failures since the job was created.
    #[serde(default)]
    pub restarts: i32,

    /// Restarts since a checkpoint last completed; past spec.restartBackoff.limit the job is Failed.
    #[serde(default)]
    pub restarts_in_a_row: i32,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<Failure>,

    /// The metadata.generation the job had when it became Failed: any newer
    /// generation (a fixed spec, also one pushed during the last recovery)
    /// starts it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_generation: Option<i64>,

    /// The last spec that ran healthy (every worker up and a checkpoint
    /// completed): what a failed upgrade rolls back to (spec.upgrade.rollback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stable_spec: Option<StableSpec>,

    /// An upgrade whose new spec has not proven healthy yet, with
    /// spec.upgrade.rollback enabled: it is rolled back unless its run comes
    /// up and completes a checkpoint by `deadline`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade_trial: Option<UpgradeTrial>,

    /// The generation that was rolled back, why, and to what. Kept while that
    /// generation is the current one: the operator does not try it again
    /// until the spec changes (a new metadata.generation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<RollbackRecord>,

    /// Pods of earlier runs that did not go away when deleted (their node is
    /// lost or cut off, their processes frozen). New runs do not wait for
    /// them: the run fence in the job's storage keeps them from completing a
    /// checkpoint or committing output. They disappear from the API when
    /// their node comes back or is removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub abandoned_pods: Vec<String>,

    /// One line for humans: what is happening, or what to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The lifecycle phases (the controller's state machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Phase {
    Deploying,
    Running,
    Savepointing,
    Upgrading,
    /// A failed upgrade goes back to the last spec that ran healthy.
    RollingBack,
    Recovering,
    Suspending,
    Suspended,
    Failed,
    Finished,
    Deleting,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointRef {
    pub id: i64,
    /// Location in checkpoint storage.
    pub path: String,
    /// When the checkpoint completed.
    pub time: Time,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SavepointRef {
    pub id: i64,
    pub path: String,
    pub time: Time,
    /// Why it was taken.
    pub reason: SavepointReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SavepointReason {
    /// spec.savepointTrigger changed.
    Trigger,
    Upgrade,
    Suspend,
    Delete,
    /// spec.savepoints.interval passed.
    Periodic,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingSavepoint {
    pub reason: SavepointReason,
    /// When it was triggered; with spec.savepointTimeout this bounds the wait.
    pub triggered_at: Time,
    /// The coordinator's id for the request, when it returned one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// One run of the job: its worker pods, labelled `weir.dev/run=<id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunStatus {
    /// Unique per run; also names the run's output files.
    pub id: String,
    /// Counts runs of this StreamJob, from 1.
    pub number: i64,
    /// Hash of the spec the run's pods were built from.
    pub spec_hash: String,
    /// The metadata.generation of that spec, when the run was decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// What the run restores from: a savepoint or checkpoint location, `latest`
    /// (the latest completed checkpoint, or a fresh start when there is none),
    /// or nothing (a fresh start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<String>,
    /// How many worker pods the run has (one per subtask index).
    pub workers: i32,
    /// Set before the pods are created: from then on a missing pod is a failure.
    #[serde(default)]
    pub pods_created: bool,
    /// When the pods were (last) created: with spec.deployTimeout this bounds
    /// the wait for the run to come up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_created_at: Option<Time>,
    /// The pods are not created before this time (restart backoff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<Time>,
    /// When the controller decided on this run.
    pub started_at: Time,
    /// Times in a row the API server refused to create the run's objects
    /// (Pod Security admission, a quota, a webhook, an invalid pod template).
    /// Each refusal is reported, and the objects are created again after
    /// spec.restartBackoff, or at once when the spec changes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refusals: i32,
    /// What the API server said the last time it refused the run's objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_refusal: Option<String>,
    /// The run restores `latest` of a job that has completed a checkpoint:
    /// when the storage holds no state of the job at all (lost, the wrong
    /// bucket or prefix), its workers fail instead of starting from scratch.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expect_state: bool,
    /// Nodes the run's pods must not be scheduled to (a required node
    /// affinity): those holding pods of an earlier run that never went away
    /// (see `abandonedPods`). Such a node is lost or frozen, but may still
    /// look Ready to the scheduler for a while (the node controller notices
    /// after 40 s).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub avoid_nodes: Vec<String>,
    /// Set on a run started because the previous one could not be scheduled
    /// while it avoided `avoidNodes` (no other node had room): this run
    /// avoids no node.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub avoid_nodes_relaxed: bool,
    /// Pods of the previous run whose workers stopped sending heartbeats
    /// (the previous run failed naming them): once deleted, this run does
    /// not wait for them to go, and avoids their nodes. Frozen or cut off,
    /// they cannot pass the run fence in storage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub silent_pods: Vec<String>,
    /// Since when the coordinator has not answered the operator while every
    /// pod of the run looked Running (its node lost with all the run's
    /// pods, so no worker is left to report it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_unreachable_since: Option<Time>,
    /// The operator's default worker image the run's pods were built with,
    /// when the job names no image of its own: a finished job is not run
    /// again just because that default changed (an operator upgrade).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_image: Option<String>,
}

impl RunStatus {
    /// A run just decided: nothing of it happened yet (no pods, refusals,
    /// avoided nodes or silences). The caller sets what it knows beyond that.
    pub fn decided(id: String, number: i64, spec_hash: String, workers: i32, started_at: Time) -> RunStatus {
        RunStatus {
            id,
            number,
            spec_hash,
            generation: None,
            restore_from: None,
            workers,
            pods_created: false,
            pods_created_at: None,
            not_before: None,
            started_at,
            refusals: 0,
            last_refusal: None,
            expect_state: false,
            avoid_nodes: Vec::new(),
            avoid_nodes_relaxed: false,
            silent_pods: Vec::new(),
            coordinator_unreachable_since: None,
            default_image: None,
        }
    }
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// A spec that ran healthy, kept whole so that a rollback can build its pods
/// again after the pipeline ConfigMap was overwritten by the failed upgrade.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StableSpec {
    /// The hash of its pod-shaping fields (as `run.specHash`).
    pub spec_hash: String,
    /// The newest metadata.generation that ran with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The spec, as JSON.
    pub spec: String,
}

/// An upgrade on trial (spec.upgrade.rollback).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeTrial {
    /// The generation being tried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The hash of its spec.
    pub spec_hash: String,
    /// When its upgrade decided the new run (the old pods start stopping).
    pub started_at: Time,
    /// The run must be healthy (every worker up, a checkpoint completed) by then.
    pub deadline: Time,
    /// The upgrade's savepoint, when it took one (upgradeMode savepoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub savepoint: Option<String>,
}

/// A rollback: the generation that was given up and the spec that runs instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackRecord {
    /// The generation rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The hash of its spec.
    pub spec_hash: String,
    /// The generation of the spec rolled back to (the last that ran healthy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_generation: Option<i64>,
    /// The hash of that spec.
    pub to_spec_hash: String,
    /// What the rollback restores: a location, `latest`, or nothing (fresh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<String>,
    /// Why: `ReadinessTimeout`, or the failure a restart does not fix.
    pub reason: String,
    pub message: String,
    /// When it was decided.
    pub time: Time,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    pub time: Time,
    /// Machine-readable, e.g. PodFailed, PodEvicted, SavepointFailed, InvalidPipeline.
    pub reason: String,
    pub message: String,
}

impl StreamJobStatus {
    /// Records a completed savepoint as the latest and appends it to the history,
    /// dropping the oldest entries beyond SAVEPOINT_HISTORY_LIMIT; returns those,
    /// which nobody will dispose of any more (they stay in storage).
    pub fn record_savepoint(&mut self, savepoint: SavepointRef) -> Vec<SavepointRef> {
        self.savepoint_history.push(savepoint.clone());
        let excess = self
            .savepoint_history
            .len()
            .saturating_sub(SAVEPOINT_HISTORY_LIMIT);
        self.last_savepoint = Some(savepoint);
        self.savepoint_history.drain(..excess).collect()
    }
}
