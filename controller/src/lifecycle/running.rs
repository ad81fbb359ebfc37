//! The job's pods run. Watches for failures and the end of the job, keeps
//! the checkpoint in status fresh, and starts what the spec asks for:
//! suspension, an upgrade, a restart or a savepoint (in that order).

use std::time::Duration;

use weir_api::streamjob::{JobState, SavepointReason, StreamJobStatus, UpgradeMode};

use super::rollback::{self, after_failure};
use super::run::{new_run, record_progress, LATEST};
use super::{human, savepoint, savepoint_retention, Cx, Finished, Recovering, Savepointing, State, Step, Suspending, Upgrading};
use weir_api::streamjob::RunStatus;
use crate::observe::RunHealth;

pub struct Running;

/// How often a running job's progress is read into status.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// How often a queued upgrade looks for a free slot (see `upgrade_slots`).
const UPGRADE_SLOT_POLL: Duration = Duration::from_secs(2);

/// How long the coordinator of a run whose pods all look Running may leave
/// the operator unanswered before the run counts as lost: longer than the
/// workers' own heartbeat timeout (5 s), so that when some worker survives
/// its report comes first.
pub const COORDINATOR_SILENCE_LIMIT: Duration = Duration::from_secs(8);

impl State for Running {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Running);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        let Some(run) = st.run.clone() else {
            // Status edited by hand or lost: start a run from the latest state.
            new_run(cx, st, Some(LATEST.into()), None);
            return Step::to::<Running, Recovering>().message("no run recorded in status: restoring from the latest checkpoint").requeue(Duration::ZERO);
        };
        // An upgrade on trial that is not healthy by its deadline goes back.
        if let Some(step) = rollback::when_due::<Running>(cx, st) {
            return step;
        }
        match cx.obs.health(&run) {
            RunHealth::Failed { reason, message, fatal } => return after_failure::<Running>(cx, st, &reason, &message, fatal),
            RunHealth::Finished => {
                return Step::to::<Running, Finished>()
                    .event("Finished", "every source ended and the final checkpoint committed")
                    .message("finished: every source ended and the final checkpoint committed");
            }
            RunHealth::Running { ips } => {
                // Workers report a silent peer; when the whole run sits on one
                // lost node nobody is left to, and the pods keep looking
                // Running until the node controller acts (40 s and more).
                let since = match (&cx.obs.coordinator, &cx.obs.coordinator_error) {
                    (None, Some(_)) => Some(run.coordinator_unreachable_since.clone().map(|t| t.0).unwrap_or(cx.now)),
                    _ => None,
                };
                if let Some(r) = st.run.as_mut() {
                    r.coordinator_unreachable_since = since.map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time);
                }
                if let (Some(since), Some(ip)) = (since, ips.first()) {
                    let silent = Duration::try_from(cx.now.duration_since(since)).unwrap_or_default();
                    if silent >= COORDINATOR_SILENCE_LIMIT {
                        let addr = std::net::SocketAddr::new(*ip, weir_api::control::CONTROL_PORT).to_string();
                        let why = cx.obs.coordinator_error.clone().unwrap_or_default();
                        // A refused token is no silent worker: its pods and
                        // node are fine, and the next run waits for them to go.
                        let m = if super::run::refused_certificate(&why) {
                            format!(
                                "the operator has refused the certificate of worker 0 ({addr}) for {:.1}s: {why}; {}",
                                silent.as_secs_f64(),
                                super::run::control_hint(&why)
                            )
                        } else if super::run::refused_token(&why) {
                            format!(
                                "worker 0 ({addr}) has refused the operator's control token for {:.1}s: {why}; {}",
                                silent.as_secs_f64(),
                                super::run::control_hint(&why)
                            )
                        } else {
                            format!(
                                "the operator could not reach the run's coordinator: {}; last error: {why} (a lost node, or a network rule: {})",
                                weir_api::control::silence_message(0, &addr, silent.as_secs_f64()),
                                super::CONTROL_REACH
                            )
                        };
                        return after_failure::<Running>(cx, st, "CoordinatorUnreachable", &m, false);
                    }
                    // A time, not a countdown: the status must not change at every reconcile.
                    let at = since.round(jiff::Unit::Second).unwrap_or(since);
                    let m = format!("running; the coordinator has not answered since {at}");
                    return Step::stay::<Running>().message(m.clone()).degraded("CoordinatorUnreachable", m).requeue(Duration::from_secs(1));
                }
            }
            RunHealth::Starting { .. } | RunHealth::NotCreated => {}
        }
        record_progress(cx, st);
        let disposed = savepoint_retention::forget_disposed(cx, st);
        let healthy = rollback::record_healthy(cx, st);
        let step = after_progress(cx, st, &run).notes(disposed);
        match healthy {
            Some(m) => step.event("UpgradeHealthy", m),
            None => step,
        }
    }
}

/// What a running job whose run is up does next.
fn after_progress(cx: &Cx, st: &mut StreamJobStatus, run: &RunStatus) -> Step {
    let spec = &cx.job.spec;

    // The watchdog on checkpoint progress: pods can all look healthy
    // while the job is stuck (a wedged subtask, storage that hangs).
    let mut stalling = None;
    // An at-most-once job takes no checkpoints: nothing to watch.
    let takes_checkpoints = !cx.validation.as_ref().is_ok_and(|v| v.runtime == weir_api::Guarantee::AtMostOnce);
    if let Some(limit) = spec.checkpoint.progress_limit().filter(|_| takes_checkpoints) {
        let since = st.last_checkpoint.as_ref().map(|c| c.time.0).filter(|t| *t > run.started_at.0).unwrap_or(run.started_at.0);
        let stalled = Duration::try_from(cx.now.duration_since(since)).unwrap_or_default();
        if stalled >= limit {
            let m = format!(
                "no checkpoint completed for {} (spec.checkpoint.progressTimeout {}): the run is stuck",
                human(stalled),
                human(limit)
            );
            return after_failure::<Running>(cx, st, "CheckpointsStalled", &m, false);
        }
        if stalled >= limit / 2 {
            stalling = Some(format!(
                "no checkpoint completed for {}; the job is restarted after {} without one (spec.checkpoint.progressTimeout)",
                human(stalled),
                human(limit)
            ));
        }
    }

    // A failed savepoint (upgrade or suspension) is retried after a pause,
    // never replaced by something weaker.
    if let Some(wait) = savepoint_retry_pause(cx, st) {
        let what = if spec.state == JobState::Suspended { "suspension" } else { "upgrade" };
        let why = st.last_failure.as_ref().map(|f| f.message.clone()).unwrap_or_default();
        let m = format!(
            "{what} not done: {why}; the job keeps running the previous spec; retrying in {}{}",
            human(wait),
            if what == "upgrade" { " (to upgrade without a savepoint, set upgradeMode: last-state or stateless)" } else { "" }
        );
        return Step::stay::<Running>().message(m.clone()).degraded("SavepointFailed", m).requeue(wait);
    }
    if spec.state == JobState::Suspended && !takes_checkpoints {
        // Nothing to keep: the pods stop, and a resumed job starts without state.
        return Step::to::<Running, Suspending>()
            .event("Suspending", "stopping the pods; the job is at-most-once and takes no savepoint")
            .message("suspending: stopping the pods (at-most-once: no savepoint)")
            .requeue(Duration::ZERO);
    }
    if spec.state == JobState::Suspended {
        let effects = savepoint::begin(cx, st, SavepointReason::Suspend);
        return Step::to::<Running, Suspending>()
            .effects(effects)
            .event("Suspending", "taking a savepoint before stopping the pods")
            .message("suspending: taking a savepoint")
            .requeue(Duration::from_millis(500));
    }
    // A generation that was rolled back is not tried again until the spec changes.
    let held = rollback::held_message(st).filter(|_| rollback::holds(cx, st));
    if cx.spec_hash != run.spec_hash && held.is_none() {
        if let Err(why) = &cx.validation {
            let m = format!("spec change not applied: {why}; the job keeps running the previous spec");
            return Step::stay::<Running>().message(m.clone()).degraded(why.reason, m).requeue(PROGRESS_INTERVAL);
        }
        if let Some(why) = cx.obs.upgrades.wait_reason() {
            let m = format!("spec change queued: {why}; the job keeps running the previous spec");
            return Step::stay::<Running>().message(m.clone()).degraded(weir_api::streamjob::ready_reasons::UPGRADE_QUEUED, m).requeue(UPGRADE_SLOT_POLL);
        }
        return upgrade(cx, st);
    }
    if spec.restart_trigger.is_some() && spec.restart_trigger != st.observed_restart_trigger {
        st.observed_restart_trigger = spec.restart_trigger.clone();
        new_run(cx, st, Some(LATEST.into()), None);
        return Step::to::<Running, Recovering>()
            .event("RestartRequested", "spec.restartTrigger changed: restarting from the latest completed checkpoint")
            .message("restarting from the latest completed checkpoint (spec.restartTrigger)")
            .requeue(Duration::ZERO);
    }
    if spec.savepoint_trigger.is_some() && spec.savepoint_trigger != st.observed_savepoint_trigger {
        let effects = savepoint::begin(cx, st, SavepointReason::Trigger);
        return Step::to::<Running, Savepointing>()
            .effects(effects)
            .event("SavepointRequested", "spec.savepointTrigger changed: taking a savepoint")
            .message("taking a savepoint (spec.savepointTrigger)")
            .requeue(Duration::from_millis(500));
    }
    if takes_checkpoints && savepoint_retention::periodic_due(cx, st, run) {
        let effects = savepoint::begin(cx, st, SavepointReason::Periodic);
        let every = spec.savepoints.interval.map(|i| human(i.get())).unwrap_or_default();
        return Step::to::<Running, Savepointing>()
            .effects(effects)
            .event("SavepointRequested", format!("taking the periodic savepoint (spec.savepoints.interval {every})"))
            .message("taking the periodic savepoint (spec.savepoints.interval)")
            .requeue(Duration::from_millis(500));
    }
    let disposals = savepoint::api_of(cx, st).map(|api| savepoint_retention::disposals(cx, st, api)).unwrap_or_default();
    let mut step = Step::stay::<Running>().requeue(PROGRESS_INTERVAL).effects(disposals);
    if spec.initial_savepoint.is_some() && spec.initial_savepoint != st.initial_savepoint {
        step = step.message("running; spec.initialSavepoint changed but applies only to a job's first deployment: to start from it, create a new StreamJob");
    } else if let Some(c) = &st.last_checkpoint {
        step = step.message(format!("running; checkpoint {} complete", c.id));
    }
    if let Some(held) = &held {
        let m = match &st.last_checkpoint {
            Some(c) => format!("running; checkpoint {} complete; {held}", c.id),
            None => format!("running; {held}"),
        };
        step = step.message(m);
    }
    if let Some(m) = stalling {
        step = step.degraded("CheckpointsStalled", m);
    } else if let Some(held) = held {
        step = step.degraded(weir_api::streamjob::ready_reasons::ROLLED_BACK, held);
    } else if st.restarts_in_a_row > 0 {
        let why = st.last_failure.as_ref().map(|f| f.message.clone()).unwrap_or_default();
        step = step.degraded("RecentRestart", format!("restarted after a failure and no checkpoint completed since: {why}"));
    }
    step
}

/// While a savepoint for the pending change failed recently, how long to wait.
fn savepoint_retry_pause(cx: &Cx, st: &StreamJobStatus) -> Option<Duration> {
    let f = st.last_failure.as_ref()?;
    if f.reason != "SavepointFailed" {
        return None;
    }
    let pending_change = cx.job.spec.state == JobState::Suspended || st.run.as_ref().is_some_and(|r| r.spec_hash != cx.spec_hash);
    if !pending_change {
        return None;
    }
    let pause = cx.job.spec.restart_backoff.max.get();
    let since = Duration::try_from(cx.now.duration_since(f.time.0)).unwrap_or_default();
    (since < pause).then(|| pause - since)
}

fn upgrade(cx: &Cx, st: &mut StreamJobStatus) -> Step {
    match cx.job.spec.upgrade_mode {
        UpgradeMode::Savepoint => {
            let effects = savepoint::begin(cx, st, SavepointReason::Upgrade);
            Step::to::<Running, Upgrading>()
                .effects(effects)
                .event("Upgrading", "spec changed: taking a savepoint, then the new pods restore from it")
                .message("upgrading: taking a savepoint")
                .requeue(Duration::from_millis(500))
        }
        UpgradeMode::LastState => {
            new_run(cx, st, Some(LATEST.into()), None);
            let (warning, trial) = rollback::open_trial(cx, st, None);
            let step = Step::to::<Running, Upgrading>()
                .event("Upgrading", format!("spec changed: stopping the pods; the new pods restore from the latest completed checkpoint (upgradeMode: last-state){trial}"))
                .message(format!("upgrading from the latest completed checkpoint{trial}"))
                .requeue(Duration::ZERO);
            unavailable(step, warning)
        }
        UpgradeMode::Stateless => {
            new_run(cx, st, None, None);
            let (warning, trial) = rollback::open_trial(cx, st, None);
            let step = Step::to::<Running, Upgrading>()
                .event("Upgrading", format!("spec changed: stopping the pods; the new pods start without state (upgradeMode: stateless){trial}"))
                .message(format!("upgrading: starting fresh (stateless){trial}"))
                .requeue(Duration::ZERO);
            unavailable(step, warning)
        }
    }
}

/// Adds the warning that rollback is enabled but this upgrade cannot be rolled back.
fn unavailable(step: Step, warning: Option<String>) -> Step {
    match warning {
        Some(w) => step.warning("RollbackUnavailable", w),
        None => step,
    }
}
