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
            if let RunHealth::Failed { reason, message, fatal } = cx.obs.health(&run) {
                // The savepoint is lost with the run; the trigger stays unobserved,
                // so the recovered job takes it.
                st.pending_savepoint = None;
                return after_failure::<Savepointing>(cx, st, &reason, &message, fatal);
            }
        }
        record_progress(cx, st);
        match savepoint::wait(cx, st) {
            Wait::Pending { effects, message } => Step::stay::<Savepointing>().effects(effects).message(message).requeue(Duration::from_millis(500)),
            Wait::Completed(sp) => {
                let m = savepoint::record(cx, st, &sp);
                st.observed_savepoint_trigger = cx.job.spec.savepoint_trigger.clone();
                Step::to::<Savepointing, Running>().event("SavepointCompleted", m.clone()).message(m).requeue(Duration::from_secs(2))
            }
            Wait::Failed(why) => {
                // One trigger value asks for one attempt; a new value asks again.
                let cancel = savepoint::give_up(cx, st);
                st.observed_savepoint_trigger = cx.job.spec.savepoint_trigger.clone();
                let m = format!("savepoint failed: {why}; the job keeps running; change spec.savepointTrigger to try again");
                st.last_failure = Some(Failure { time: Time(cx.now), reason: "SavepointFailed".into(), message: m.clone() });
                Step::to::<Savepointing, Running>().effects(cancel).warning("SavepointFailed", m.clone()).message(m).requeue(Duration::from_secs(2))
            }
        }
    }
}
