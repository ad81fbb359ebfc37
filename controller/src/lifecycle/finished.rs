//! Every source ended and the final checkpoint committed. The pods are kept
//! (their logs); spec.restartTrigger or a spec change runs the job again
//! from its final state.

use std::time::Duration;

use weir_api::streamjob::{RunStatus, StreamJobStatus};

use super::run::{new_run, LATEST};
use super::{Cx, Deploying, State, Step};

pub struct Finished;

impl State for Finished {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Finished);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        let spec = &cx.job.spec;
        let restart_asked = spec.restart_trigger.is_some() && spec.restart_trigger != st.observed_restart_trigger;
        // Not by the generation a rollback gave up: the job finished on the
        // spec it went back to, and would only finish again, forever.
        // Nor by a new default worker image alone (an operator upgrade): the
        // spec is judged with the image the run had.
        let spec_changed = st.run.as_ref().is_some_and(|r| r.spec_hash != hash_with_the_runs_image(cx, r)) && !super::rollback::holds(cx, st);
        if !(restart_asked || spec_changed) || cx.validation.is_err() {
            return Step::stay::<Finished>();
        }
        st.observed_restart_trigger = spec.restart_trigger.clone();
        new_run(cx, st, Some(LATEST.into()), None);
        Step::to::<Finished, Deploying>()
            .event("Deploying", "running the finished job again from its final state")
            .message("deploying again from the final checkpoint")
            .requeue(Duration::ZERO)
    }
}

/// The current spec's hash with the default image the run was built with,
/// when both it and the current spec take the operator's default.
fn hash_with_the_runs_image(cx: &Cx, run: &RunStatus) -> String {
    match (&run.default_image, &cx.default_image) {
        (Some(then), Some(_)) => crate::spec_hash::spec_hash(&cx.job.spec, Some(then)),
        _ => cx.spec_hash.clone(),
    }
}
