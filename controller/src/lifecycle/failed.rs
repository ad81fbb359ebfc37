//! The job stopped and will not restart by itself: an invalid spec, a worker
//! error a restart cannot fix, or too many restarts in a row. A change of the
//! spec or of spec.restartTrigger starts it again from its newest state.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, StreamJobStatus};

use super::run::{new_run, LATEST};
use super::{Cx, Deploying, State, Step};
use crate::desired::Refusal;

pub struct Failed;

impl State for Failed {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Failed);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        let spec = &cx.job.spec;
        let restart_asked = spec.restart_trigger.is_some() && spec.restart_trigger != st.observed_restart_trigger;
        let spec_changed = st.run.as_ref().map(|r| r.spec_hash != cx.spec_hash).unwrap_or(true)
            && st.observed_generation != cx.job.metadata.generation;
        // A job refused for what the operator lacked (a default worker image)
        // starts once the operator has it, without an edit of the spec.
        let refusal_gone = st.run.is_none()
            && cx.validation.is_ok()
            && st.last_failure.as_ref().is_some_and(|f| f.reason == Refusal::NO_WORKER_IMAGE);
        if !(restart_asked || spec_changed || refusal_gone) {
            return Step::stay::<Failed>();
        }
        if let Err(why) = &cx.validation {
            st.observed_restart_trigger = spec.restart_trigger.clone();
            st.last_failure = Some(Failure { time: Time(cx.now), reason: why.reason.into(), message: why.message.clone() });
            let m = format!("not deployed: {why}");
            return Step::stay::<Failed>().warning(why.reason, why.message.clone()).message(m);
        }
        st.observed_restart_trigger = spec.restart_trigger.clone();
        st.restarts_in_a_row = 0;
        let restore = if st.run.is_none() {
            st.initial_savepoint = spec.initial_savepoint.clone();
            spec.initial_savepoint.clone()
        } else {
            Some(LATEST.into())
        };
        new_run(cx, st, restore, None);
        let why = if restart_asked {
            "spec.restartTrigger changed"
        } else if spec_changed {
            "the spec changed"
        } else {
            "the operator now has a worker image"
        };
        Step::to::<Failed, Deploying>()
            .event("Deploying", format!("{why}: starting again from the job's newest state"))
            .message(format!("{why}: deploying"))
            .requeue(Duration::ZERO)
    }
}
