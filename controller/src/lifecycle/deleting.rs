//! The StreamJob is being deleted. With spec.savepointOnDelete and a running
//! job, a final savepoint is taken first, bounded by spec.savepointTimeout;
//! on timeout, failure, or a job that is not running, deletion proceeds at
//! once and an event says why. Deletion never waits for anything else.

use std::time::Duration;

use weir_api::streamjob::{Phase, SavepointReason, StreamJobStatus};

use super::savepoint::{self, Wait};
use super::{Cx, Deleting as This, Effect, State, Step};
use crate::observe::RunHealth;

pub struct Deleting;

impl State for Deleting {
    const PHASE: Option<Phase> = Some(Phase::Deleting);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        // The final savepoint is in status once taken: removing the finalizer
        // may need another try, never another savepoint.
        if st.pending_savepoint.is_none() && st.last_savepoint.as_ref().is_some_and(|s| s.reason == SavepointReason::Delete) {
            return done();
        }
        let running = st.run.as_ref().is_some_and(|r| matches!(cx.obs.health(r), RunHealth::Running { .. }));
        let pending_final = st.pending_savepoint.as_ref().is_some_and(|p| p.reason == SavepointReason::Delete);
        if !pending_final {
            if !cx.job.spec.savepoint_on_delete {
                return done().event("Deleted", "spec.savepointOnDelete is false: no final savepoint");
            }
            if !running {
                let m = "no final savepoint: the job was not running; its latest checkpoint and savepoints stay in storage";
                return done().warning("DeletedWithoutSavepoint", m);
            }
            let effects = savepoint::begin(cx, st, SavepointReason::Delete);
            return Step::stay::<This>()
                .effects(effects)
                .event("FinalSavepoint", "taking the final savepoint before deletion")
                .message("deleting: taking the final savepoint")
                .requeue(Duration::from_millis(500));
        }
        if !running {
            return done().warning("DeletedWithoutSavepoint", "the job stopped before the final savepoint completed; its latest checkpoint stays in storage");
        }
        match savepoint::wait(cx, st) {
            Wait::Pending { effects, message } => Step::stay::<This>().effects(effects).message(format!("deleting: {message}")).requeue(Duration::from_millis(500)),
            Wait::Completed(sp) => {
                let m = savepoint::record(cx, st, &sp);
                // Its own reason: events with one reason are aggregated into a
                // series that keeps the first note.
                done().event("FinalSavepointCompleted", m)
            }
            Wait::Failed(why) => done().warning("DeletedWithoutSavepoint", format!("final savepoint failed: {why}; deleting anyway")),
        }
    }
}

fn done() -> Step {
    Step::stay::<This>().effect(Effect::RemoveFinalizer).message("deleted").requeue(Duration::from_secs(60))
}
