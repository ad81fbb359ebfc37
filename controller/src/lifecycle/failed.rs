//! The job stopped and will not restart by itself: an invalid spec, a worker
//! error a restart cannot fix, or too many restarts in a row. A change of the
//! spec or of spec.restartTrigger starts it again from its newest state.

use std::time::Duration;

use weir_api::streamjob::StreamJobStatus;

use super::run::{new_run, LATEST};
use super::{Cx, Deploying, State, Step};

pub struct Failed;

impl State for Failed {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Failed);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        let spec = &cx.job.spec;
        let restart_asked = spec.restart_trigger.is_some() && spec.restart_trigger != st.observed_restart_trigger;
        let spec_changed = st.run.as_ref().map(|r| r.spec_hash != cx.spec_hash).unwrap_or(true)
            && st.observed_generation != cx.job.metadata.generation;
        if !(restart_asked || spec_changed) {
            return Step::stay::<Failed>();
        }
        if let Err(why) = &cx.validation {
            st.observed_restart_trigger = spec.restart_trigger.clone();
            let m = format!("not deployed: {why}");
            return Step::stay::<Failed>().warning("InvalidSpec", why.clone()).message(m);
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
        let why = if restart_asked { "spec.restartTrigger changed" } else { "the spec changed" };
        Step::to::<Failed, Deploying>()
            .event("Deploying", format!("{why}: starting again from the job's newest state"))
            .message(format!("{why}: deploying"))
            .requeue(Duration::ZERO)
    }
}
