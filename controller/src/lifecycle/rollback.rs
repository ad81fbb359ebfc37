//! `spec.upgrade.rollback`: an upgrade on trial, and the decision to roll
//! it back.
//!
//! A spec becomes *stable* once a run of it is healthy: every worker up and
//! a checkpoint completed after the run started (for a job that takes no
//! checkpoints: every worker up). The last stable spec is kept whole in
//! `status.lastStableSpec`, because the failed upgrade overwrites the
//! pipeline ConfigMap with its own spec.
//!
//! An upgrade of a running job with rollback enabled opens a trial
//! (`status.upgradeTrial`) when it decides the new run. The trial ends well
//! when the run is healthy; it ends in a rollback when the deadline passes
//! first, or when the new spec fails in a way a restart does not fix (a
//! fatal worker error, `spec.deployTimeout`, `restartBackoff.limit`): the
//! last stable spec is started again, once, and `status.rollback` keeps
//! the job from trying the rolled-back generation again until the spec
//! changes (a new `metadata.generation`).
//!
//! What the rollback restores follows the upgrade mode, as the upgrade did:
//! savepoint and last-state restore the job's newest state (`latest`), which
//! is the upgrade's savepoint or the checkpoint the upgrade restored, since
//! the new spec completed no checkpoint (or it would be healthy). `latest`,
//! not the savepoint's path: should a checkpoint of the new spec complete in
//! the instant before its pods stop, its output may be committed, and
//! restoring the older savepoint would write that output a second time.
//! Stateless starts the previous spec without state, as the upgrade started
//! the new one.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{RollbackRecord, StableSpec, StreamJobSpec, StreamJobStatus, UpgradeMode, UpgradeTrial};

use super::run::{new_run, LATEST};
use super::{human, Cx, RollingBack, Step, TransitionTo};

/// The reason of a rollback whose new spec was not healthy by the deadline.
pub const READINESS_TIMEOUT: &str = "ReadinessTimeout";

/// Whether the current generation is one that was rolled back: its spec
/// must not run (until a new generation).
pub(super) fn holds(cx: &Cx, st: &StreamJobStatus) -> bool {
    st.rollback.as_ref().is_some_and(|rb| match cx.job.metadata.generation {
        Some(g) => rb.generation == Some(g),
        None => rb.spec_hash == cx.spec_hash,
    })
}

/// Whether the run in status is up and has completed a checkpoint after it
/// started (or is up, for a job that takes no checkpoints).
pub(super) fn run_is_healthy(cx: &Cx, st: &StreamJobStatus) -> bool {
    let (Some(run), Some(c)) = (&st.run, &cx.obs.coordinator) else { return false };
    if c.run_id != run.id || !matches!(c.phase.as_str(), "running" | "finishing" | "finished") {
        return false;
    }
    if !takes_checkpoints(cx) {
        return true;
    }
    c.latest_checkpoint.as_ref().is_some_and(|chk| chk.completed_unix_ms as i64 > run.started_at.0.as_millisecond())
}

fn takes_checkpoints(cx: &Cx) -> bool {
    let at_most_once = cx.validation.as_ref().is_ok_and(|v| v.runtime == weir_api::Guarantee::AtMostOnce);
    !at_most_once && !cx.job.spec.checkpoint.interval.get().is_zero()
}

/// Called while the job runs: once its run is healthy, the run's spec is
/// the last stable one (when it is the current spec), and a trial ends
/// well. Returns the event to publish when a trial ended.
pub(super) fn record_healthy(cx: &Cx, st: &mut StreamJobStatus) -> Option<String> {
    if !run_is_healthy(cx, st) {
        return None;
    }
    let run = st.run.as_ref()?;
    if run.spec_hash == cx.spec_hash && cx.validation.is_ok() && !holds(cx, st) {
        let generation = cx.job.metadata.generation;
        let known = st.last_stable_spec.as_ref().is_some_and(|s| s.spec_hash == run.spec_hash && s.generation == generation);
        if !known {
            if let Ok(spec) = serde_json::to_string(&cx.job.spec) {
                st.last_stable_spec = Some(StableSpec { spec_hash: run.spec_hash.clone(), generation, spec });
            }
        }
    }
    let trial = st.upgrade_trial.take()?;
    let what = trial.generation.map(|g| format!("generation {g}")).unwrap_or_else(|| "the new spec".into());
    let proof = if takes_checkpoints(cx) { "every worker runs and a checkpoint completed" } else { "every worker runs" };
    Some(format!("{what} is healthy ({proof}): the upgrade is not rolled back"))
}

/// Opens a trial for the upgrade whose new run was just decided, when
/// `spec.upgrade.rollback` is enabled. `savepoint`: the upgrade's savepoint.
/// Returns a warning when rollback is enabled but impossible (no spec of the
/// job ran healthy yet), and the words to add to the upgrade's message.
pub(super) fn open_trial(cx: &Cx, st: &mut StreamJobStatus, savepoint: Option<String>) -> (Option<String>, String) {
    st.rollback = None;
    st.upgrade_trial = None;
    let settings = &cx.job.spec.upgrade.rollback;
    if !settings.enabled {
        return (None, String::new());
    }
    let stable = st.last_stable_spec.as_ref().filter(|s| st.run.as_ref().is_some_and(|r| r.spec_hash != s.spec_hash));
    if stable.is_none() {
        let why = if st.last_stable_spec.is_none() {
            "no spec of this job has run healthy yet (every worker up and a checkpoint completed)"
        } else {
            "the new run has the spec that ran last"
        };
        return (Some(format!("spec.upgrade.rollback is enabled, but this upgrade cannot be rolled back: {why}")), String::new());
    }
    let timeout = settings.readiness_timeout.get();
    let deadline = cx.now.checked_add(timeout).unwrap_or(cx.now);
    st.upgrade_trial = Some(UpgradeTrial {
        generation: cx.job.metadata.generation,
        spec_hash: cx.spec_hash.clone(),
        started_at: Time(cx.now),
        deadline: Time(deadline),
        savepoint,
    });
    let at = deadline.round(jiff::Unit::Second).unwrap_or(deadline);
    (None, format!("; rolled back unless healthy by {at} (spec.upgrade.rollback.readinessTimeout {})", settings.readiness_timeout))
}

/// The trial's deadline passed and the run is not healthy: the reason and
/// the message of the rollback.
pub(super) fn due(cx: &Cx, st: &StreamJobStatus) -> Option<(String, String)> {
    let trial = st.upgrade_trial.as_ref()?;
    if cx.now < trial.deadline.0 || run_is_healthy(cx, st) {
        return None;
    }
    let what = trial.generation.map(|g| format!("generation {g}")).unwrap_or_else(|| "the new spec".into());
    let waited = Duration::try_from(cx.now.duration_since(trial.started_at.0)).unwrap_or_default();
    let proof = if takes_checkpoints(cx) { "every worker running and a checkpoint completed" } else { "every worker running" };
    let now = st.message.clone().filter(|m| !m.is_empty()).map(|m| format!(" (last: {m})")).unwrap_or_default();
    Some((
        READINESS_TIMEOUT.into(),
        format!(
            "{what} did not become healthy ({proof}) within spec.upgrade.rollback.readinessTimeout {} ({} since its upgrade){now}",
            cx.job.spec.upgrade.rollback.readiness_timeout,
            human(waited)
        ),
    ))
}

/// Whether a failure of the run under trial that would fail the job (a
/// fatal error, the restart limit) rolls it back instead.
pub(super) fn instead_of_failure(cx: &Cx, st: &StreamJobStatus, fatal: bool) -> bool {
    st.upgrade_trial.is_some() && (fatal || st.restarts_in_a_row >= cx.job.spec.restart_backoff.limit)
}

/// Moves `S` to RollingBack: decides the run of the last stable spec and
/// records the rollback. `None` when there is nothing to roll back to
/// (the trial is closed then, and the caller goes on as without rollback).
pub(super) fn roll_back<S: TransitionTo<RollingBack>>(cx: &Cx, st: &mut StreamJobStatus, reason: &str, why: &str) -> Option<Step> {
    let trial = st.upgrade_trial.take()?;
    let stable = st.last_stable_spec.clone()?;
    let spec: StreamJobSpec = serde_json::from_str(&stable.spec).ok()?;
    let restore = match cx.job.spec.upgrade_mode {
        UpgradeMode::Stateless => None,
        UpgradeMode::Savepoint | UpgradeMode::LastState => Some(LATEST.to_string()),
    };
    let bad = st.run.as_ref().map(|r| r.spec_hash.clone()).unwrap_or_else(|| trial.spec_hash.clone());
    let from_words = match (cx.job.spec.upgrade_mode, &trial.savepoint) {
        (UpgradeMode::Stateless, _) => "without state, as the upgrade started the new spec (upgradeMode stateless took no savepoint)".to_string(),
        (_, Some(sp)) => format!("from the upgrade's savepoint {sp}"),
        (_, None) => match &st.last_checkpoint {
            Some(c) => format!("from the latest completed checkpoint {} (upgradeMode {} took no savepoint)", c.path, mode_word(cx.job.spec.upgrade_mode)),
            None => format!("from the job's newest state (upgradeMode {} took no savepoint)", mode_word(cx.job.spec.upgrade_mode)),
        },
    };
    let generation = cx.job.metadata.generation;
    let to = stable.generation.map(|g| format!("generation {g}")).unwrap_or_else(|| "the last spec that ran healthy".into());
    let message = format!("{why}; rolling back to {to}, {from_words}");
    new_run(cx, st, restore.clone(), None);
    if let Some(run) = st.run.as_mut() {
        run.spec_hash = stable.spec_hash.clone();
        run.generation = stable.generation;
        run.workers = spec.parallelism.max(1);
    }
    // A rollback is a new start of a spec that ran: the failures of the
    // rolled-back one do not count against it.
    st.restarts_in_a_row = 0;
    st.rollback = Some(RollbackRecord {
        generation,
        spec_hash: bad,
        to_generation: stable.generation,
        to_spec_hash: stable.spec_hash,
        restore_from: restore,
        reason: reason.into(),
        message: message.clone(),
        time: Time(cx.now),
    });
    Some(Step::to::<S, RollingBack>().warning("RollingBack", message.clone()).message(format!("rolling back: {message}")).requeue(Duration::ZERO))
}

/// The status line of a job that runs its last stable spec because the
/// current generation was rolled back.
pub(super) fn held_message(st: &StreamJobStatus) -> Option<String> {
    let rb = st.rollback.as_ref()?;
    let bad = rb.generation.map(|g| format!("generation {g}")).unwrap_or_else(|| "the current spec".into());
    let runs = rb.to_generation.map(|g| format!("generation {g}")).unwrap_or_else(|| "the last spec that ran healthy".into());
    Some(format!("{bad} was rolled back ({}: {}); {runs} runs; change the spec to try again", rb.reason, rb.message))
}

fn mode_word(m: UpgradeMode) -> &'static str {
    match m {
        UpgradeMode::Stateless => "stateless",
        UpgradeMode::Savepoint => "savepoint",
        UpgradeMode::LastState => "last-state",
    }
}

/// What a state whose run failed does with rollback in mind: a failure
/// that would fail the job (fatal, or past the restart limit) of a run
/// under trial rolls it back; anything else is [`super::run::after_failure`].
pub(super) fn after_failure<S>(cx: &Cx, st: &mut StreamJobStatus, reason: &str, message: &str, fatal: bool) -> Step
where
    S: TransitionTo<RollingBack> + TransitionTo<super::Recovering> + TransitionTo<super::Failed>,
{
    match on_failure::<S>(cx, st, reason, message, fatal) {
        Some(step) => step,
        None => super::run::after_failure::<S>(cx, st, reason, message, fatal),
    }
}

/// The rollback of a run under trial that failed in a way that would fail
/// the job; `None` when that is not the case (or there is nothing to roll
/// back to).
pub(super) fn on_failure<S: TransitionTo<RollingBack>>(cx: &Cx, st: &mut StreamJobStatus, reason: &str, message: &str, fatal: bool) -> Option<Step> {
    if instead_of_failure(cx, st, fatal) {
        let why = if fatal {
            format!("{message} (a restart does not fix this)")
        } else {
            format!("{message}; {} restarts in a row without a completed checkpoint (spec.restartBackoff.limit)", st.restarts_in_a_row)
        };
        let what = st.upgrade_trial.as_ref().and_then(|t| t.generation).map(|g| format!("generation {g}")).unwrap_or_else(|| "the new spec".into());
        let why = format!("{what} failed: {why}");
        st.last_failure = Some(weir_api::streamjob::Failure { time: Time(cx.now), reason: reason.into(), message: why.clone() });
        return roll_back::<S>(cx, st, reason, &why);
    }
    None
}

/// Rolls back when the trial's deadline passed (see [`due`]).
pub(super) fn when_due<S: TransitionTo<RollingBack>>(cx: &Cx, st: &mut StreamJobStatus) -> Option<Step> {
    let (reason, why) = due(cx, st)?;
    roll_back::<S>(cx, st, &reason, &why)
}
