//! No pods run. `spec.state: running` resumes the job from its newest state
//! (the suspend savepoint, or a later checkpoint if there is one).
//!
//! The savepoint is named explicitly: a savepoint is no record of the job's
//! lineage (it is the user's to keep, move or delete, so failover never
//! depends on one), and `latest` would pass it over and go back to the
//! checkpoint before it, replaying what the savepoint had already taken in
//! and leaving its pending output behind.

use std::time::Duration;

use weir_api::streamjob::{JobState, SavepointReason, StreamJobStatus};

use super::run::{new_run, LATEST};
use super::{Cx, Deploying, Effect, State, Step};

pub struct Suspended;

impl State for Suspended {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Suspended);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        if cx.job.spec.state == JobState::Suspended {
            let step = Step::stay::<Suspended>();
            // Pods that appear while suspended (left over) are stopped.
            return if cx.obs.live_pods() == 0 { step } else { step.effect(Effect::DeleteAllPods).requeue(Duration::from_secs(1)) };
        }
        if let Err(why) = &cx.validation {
            let m = format!("not resumed: {why}");
            return Step::stay::<Suspended>().message(m.clone()).degraded(why.reason, m);
        }
        // A job created suspended has never run: it starts from spec.initialSavepoint.
        let restore = if st.run.is_none() {
            st.initial_savepoint = cx.job.spec.initial_savepoint.clone();
            cx.job.spec.initial_savepoint.clone()
        } else {
            Some(resume_point(st))
        };
        let from = restore.clone().map(|r| if r == LATEST { "its latest savepoint or checkpoint".to_string() } else { r }).unwrap_or_else(|| "a fresh start".into());
        new_run(cx, st, restore, None);
        Step::to::<Suspended, Deploying>()
            .event("Resuming", format!("spec.state is running: restoring from {from}"))
            .message(format!("resuming from {from}"))
            .requeue(Duration::ZERO)
    }
}

/// The suspend savepoint when it is the job's newest state, else `latest`.
fn resume_point(st: &StreamJobStatus) -> String {
    match (&st.last_savepoint, &st.last_checkpoint) {
        (Some(sp), checkpoint) if sp.reason == SavepointReason::Suspend && checkpoint.as_ref().is_none_or(|c| sp.id > c.id) => sp.path.clone(),
        _ => LATEST.into(),
    }
}
