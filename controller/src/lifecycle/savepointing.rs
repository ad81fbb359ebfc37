//! A savepoint asked for with spec.savepointTrigger; the job keeps running.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, StreamJobStatus};

use super::run::{after_failure, record_progress};
use super::savepoint::{self, Wait};
use super::{Cx, Running, State, Step};
use crate::observe::RunHealth;

pub struct Savepointing;

impl State for Savepointing {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Savepointing);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        if let Some(run) = st.run.clone() {
            match cx.obs.health(&run) {
                RunHealth::Failed { reason, message, fatal } => {
                    // The savepoint is lost with the run; the trigger stays unobserved,
                    // so the recovered job takes it.
                    st.pending_savepoint = None;
                    return after_failure::<Savepointing>(cx, st, &reason, &message, fatal);
                }
                RunHealth::Finished => {
                    // Every source ended first: nobody is left to take it, and
                    // the final checkpoint holds everything. Running sees the end.
                    observe_trigger(cx, st);
                    st.pending_savepoint = None;
                    return Step::to::<Savepointing, Running>().message("the job finished before the savepoint could be taken").requeue(Duration::ZERO);
                }
                _ => {}
            }
        }
        record_progress(cx, st);
        match savepoint::wait(cx, st) {
            Wait::Pending { effects, message } => Step::stay::<Savepointing>().effects(effects).message(message).requeue(Duration::from_millis(500)),
            Wait::Completed(sp) => {
                observe_trigger(cx, st);
                let m = savepoint::record(cx, st, &sp);
                Step::to::<Savepointing, Running>().event("SavepointCompleted", m.clone()).message(m).requeue(Duration::from_secs(2))
            }
            Wait::Failed(why) => {
                // One trigger value asks for one attempt; a new value asks again.
                let again = match st.pending_savepoint.as_ref().map(|p| p.reason) {
                    Some(weir_api::streamjob::SavepointReason::Periodic) => "the next periodic savepoint is taken an interval from now",
                    _ => "change spec.savepointTrigger to try again",
                };
                observe_trigger(cx, st);
                let cancel = savepoint::give_up(cx, st);
                let m = format!("savepoint failed: {why}; the job keeps running; {again}");
                st.last_failure = Some(Failure { time: Time(cx.now), reason: "SavepointFailed".into(), message: m.clone() });
                Step::to::<Savepointing, Running>().effects(cancel).warning("SavepointFailed", m.clone()).message(m).requeue(Duration::from_secs(2))
            }
        }
    }
}

/// A savepoint asked for by spec.savepointTrigger answers the trigger's
/// current value; a periodic one answers none, so that a trigger changed
/// while it was taken is still acted on.
fn observe_trigger(cx: &Cx, st: &mut StreamJobStatus) {
    if st.pending_savepoint.as_ref().is_none_or(|p| p.reason != weir_api::streamjob::SavepointReason::Periodic) {
        st.observed_savepoint_trigger = cx.job.spec.savepoint_trigger.clone();
    }
}
