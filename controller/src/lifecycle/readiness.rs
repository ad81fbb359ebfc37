//! Whether the generation the status judges runs: the `Ready` condition and
//! `deployedSpecHash`.
//!
//! GitOps tools and `kubectl wait --for=condition=Ready` read `Ready` at the
//! `observedGeneration` it carries as "this spec runs". So `Ready` is True
//! only while the pods run the spec of `metadata.generation` (the deployed
//! hash equals the hash of the current spec, the spec was not refused, every
//! worker is up and the job checkpoints). A change that is refused or whose
//! upgrade failed is False with a reason tools can match and a message that
//! says which generation runs instead and why the new one does not.

use weir_api::streamjob::{ready_reasons, JobState, Phase, StreamJobStatus};

use super::Cx;

/// The `Ready` condition to write.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Readiness {
    pub ready: bool,
    pub reason: String,
    pub message: String,
}

impl Readiness {
    fn not(reason: &str, message: String) -> Readiness {
        Readiness { ready: false, reason: reason.into(), message }
    }
}

/// Degraded reasons under which the pods may look up while the job makes
/// no progress: the run is not ready whatever its phase says.
const NOT_PROGRESSING: &[&str] = &["CheckpointsStalled", "CoordinatorUnreachable"];

/// Records what the pods run once a run is up. Only Running and
/// Savepointing (a manual savepoint) have `status.run` up: the other phases
/// are starting a run, stopping one, or have none.
pub(super) fn record_deployed(cx: &Cx, st: &mut StreamJobStatus, next: Option<Phase>) {
    if !matches!(next, Some(Phase::Running | Phase::Savepointing)) {
        return;
    }
    let Some(run) = &st.run else { return };
    if st.deployed_spec_hash.as_deref() != Some(run.spec_hash.as_str()) {
        st.deployed_spec_hash = Some(run.spec_hash.clone());
        st.deployed_generation = run.generation;
    }
    // A change of lifecycle fields only (upgradeMode, a trigger) needs no
    // new pods: the newest generation with the running spec is the one that
    // runs. A refused generation never runs, whatever its hash.
    if run.spec_hash == cx.spec_hash && cx.validation.is_ok() {
        st.deployed_generation = cx.job.metadata.generation;
    }
}

/// Judges `Ready` for the current generation after the step moved the job
/// to `next` with the Degraded condition `degraded`.
pub(super) fn judge(cx: &Cx, st: &StreamJobStatus, next: Option<Phase>, degraded: Option<&(String, String)>) -> Readiness {
    let this = match cx.job.metadata.generation {
        Some(g) => format!("generation {g}"),
        None => "the current spec".into(),
    };
    let message = st.message.clone().unwrap_or_default();
    // Old pods serve on while an upgrade's or a suspension's savepoint is
    // taken; after it, nothing runs until the new run is up.
    let old_pods_run = match next {
        Some(Phase::Running | Phase::Savepointing | Phase::Suspending) => st.run.is_some(),
        Some(Phase::Upgrading) => st.pending_savepoint.is_some(),
        _ => false,
    };
    let what_runs = match (old_pods_run, st.deployed_generation) {
        (false, _) => "no pods run".to_string(),
        (true, Some(g)) if Some(g) != cx.job.metadata.generation => format!("generation {g} keeps running"),
        (true, _) => "the previous spec keeps running".to_string(),
    };
    if let Err(why) = &cx.validation {
        return Readiness::not(ready_reasons::SPEC_REFUSED, format!("{this} is refused: {why}; {what_runs}"));
    }
    let failed_savepoint = st.last_failure.as_ref().filter(|f| f.reason == "SavepointFailed").map(|f| f.message.clone());
    match next {
        Some(Phase::Running | Phase::Savepointing) => {
            if cx.job.spec.state == JobState::Suspended {
                return match failed_savepoint {
                    Some(why) => Readiness::not(
                        ready_reasons::SUSPEND_FAILED,
                        format!("{this} asks for suspension, which failed: {why}; the job keeps running and the suspension is retried"),
                    ),
                    None => Readiness::not("Suspending", format!("{this} asks for suspension: {message}")),
                };
            }
            if st.deployed_spec_hash.as_deref() != Some(cx.spec_hash.as_str()) && super::rollback::holds(cx, st) {
                let why = super::rollback::held_message(st).unwrap_or_default();
                return Readiness::not(ready_reasons::ROLLED_BACK, format!("{this} does not run: {why}"));
            }
            if st.deployed_spec_hash.as_deref() != Some(cx.spec_hash.as_str()) {
                return match failed_savepoint {
                    Some(why) => Readiness::not(
                        ready_reasons::UPGRADE_FAILED,
                        format!("{this} does not run, its upgrade failed: {why}; {what_runs}; the upgrade is retried"),
                    ),
                    None => match degraded.filter(|(r, _)| r == ready_reasons::UPGRADE_QUEUED) {
                        Some((reason, m)) => Readiness::not(reason, format!("{this} does not run yet: {m}")),
                        None => Readiness::not(ready_reasons::UPGRADE_PENDING, format!("{this} does not run yet: its upgrade has not started; {what_runs}")),
                    },
                };
            }
            if let Some((reason, m)) = degraded.filter(|(r, _)| NOT_PROGRESSING.contains(&r.as_str())) {
                return Readiness::not(reason, format!("{this} runs but makes no progress: {m}"));
            }
            if let Some(trial) = &st.upgrade_trial {
                let at = trial.deadline.0.round(jiff::Unit::Second).unwrap_or(trial.deadline.0);
                return Readiness::not(
                    ready_reasons::AWAITING_CHECKPOINT,
                    format!("{this} runs but has not completed its first checkpoint yet; it is rolled back if it does not by {at} (spec.upgrade.rollback.readinessTimeout)"),
                );
            }
            Readiness { ready: true, reason: ready_reasons::RUNNING.into(), message: format!("{this} runs: {message}") }
        }
        Some(Phase::Upgrading) => Readiness::not("Upgrading", format!("{this} does not run yet ({what_runs}): {message}")),
        Some(phase) => Readiness::not(&format!("{phase:?}"), format!("{this} does not run ({what_runs}): {message}")),
        None => Readiness::not("Created", format!("{this} does not run yet: {message}")),
    }
}
