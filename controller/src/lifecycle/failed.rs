//! The job stopped and will not restart by itself: an invalid spec, a worker
//! error a restart cannot fix, a run that did not come up by
//! spec.deployTimeout, or too many restarts in a row. Its pods are deleted
//! (a stuck one would hold its node, volume and quota for nothing; the
//! failure is in status.lastFailure). A new generation of the spec, a new
//! spec.restartTrigger, or the operator getting what it lacked starts it
//! again from its newest state.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, JobState, StreamJobStatus};

use super::run::{new_run, LATEST};
use super::{Cx, Deploying, Effect, State, Step};
use crate::desired::Refusal;
use crate::observe::PodState;

pub struct Failed;

impl State for Failed {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Failed);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        let spec = &cx.job.spec;
        let restart_asked = spec.restart_trigger.is_some() && spec.restart_trigger != st.observed_restart_trigger;
        // Any generation after the failure is a new start; so is a spec
        // other than the failed run's, also one pushed before the failure
        // (during the last recovery, while the run that failed was up).
        let new_generation = cx.job.metadata.generation != failed_at(st);
        // Not the generation a rollback gave up, though: that takes a change.
        let other_spec = cx.validation.is_ok() && !super::rollback::holds(cx, st) && st.run.as_ref().is_some_and(|r| r.spec_hash != cx.spec_hash);
        // A job refused for what the operator lacked (a default worker image,
        // a CA for the workers' certificates) starts once the operator has
        // it, without an edit of the spec.
        let refusal_gone = st.run.is_none()
            && cx.validation.is_ok()
            && st.last_failure.as_ref().is_some_and(|f| f.reason == Refusal::NO_WORKER_IMAGE || f.reason == Refusal::NO_WORKER_CA);
        // Pods already being deleted are not deleted again.
        let live = cx.obs.pods.iter().filter(|p| p.state != PodState::Terminating).count();
        if !(restart_asked || new_generation || other_spec || refusal_gone) || spec.state == JobState::Suspended {
            if live == 0 {
                return Step::stay::<Failed>();
            }
            return Step::stay::<Failed>().effect(Effect::DeleteAllPods).requeue(Duration::from_secs(1));
        }
        if let Err(why) = &cx.validation {
            st.observed_restart_trigger = spec.restart_trigger.clone();
            st.failed_generation = cx.job.metadata.generation;
            st.last_failure = Some(Failure { time: Time(cx.now), reason: why.reason.into(), message: why.message.clone() });
            let m = format!("not deployed: {why}");
            return Step::stay::<Failed>().warning(why.reason, why.message.clone()).message(m);
        }
        st.observed_restart_trigger = spec.restart_trigger.clone();
        st.restarts_in_a_row = 0;
        let restore = if st.run.is_none() {
            // Never deployed: this is the first deploy, whose triggers are
            // part of the manifest, not requests.
            st.observed_savepoint_trigger = spec.savepoint_trigger.clone();
            st.initial_savepoint = spec.initial_savepoint.clone();
            spec.initial_savepoint.clone()
        } else {
            Some(LATEST.into())
        };
        new_run(cx, st, restore, None);
        let why = if restart_asked {
            "spec.restartTrigger changed"
        } else if new_generation || other_spec {
            "the spec changed"
        } else if st.last_failure.as_ref().is_some_and(|f| f.reason == Refusal::NO_WORKER_CA) {
            "the operator now trusts a CA for the workers' certificates"
        } else {
            "the operator now has a worker image"
        };
        // The new run waits until the failed one's pods are gone.
        Step::to::<Failed, Deploying>()
            .event("Deploying", format!("{why}: starting again from the job's newest state"))
            .message(format!("{why}: deploying"))
            .requeue(Duration::ZERO)
    }
}

/// The generation the job failed at; a status written before
/// `failedGeneration` existed judges by the generation it last observed.
fn failed_at(st: &StreamJobStatus) -> Option<i64> {
    st.failed_generation.or(st.observed_generation)
}
