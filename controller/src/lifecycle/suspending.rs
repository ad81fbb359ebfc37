//! spec.state became `suspended`: savepoint, then stop the pods. If the
//! savepoint fails the job keeps running (status says why) and the
//! suspension is retried after a pause.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, JobState, StreamJobStatus};

use super::run::{after_failure, record_progress};
use super::savepoint::{self, Wait};
use super::{Cx, Effect, Running, State, Step, Suspended};
use crate::observe::RunHealth;

pub struct Suspending;

impl State for Suspending {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Suspending);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        if st.pending_savepoint.is_none() {
            // The savepoint is done: stop every pod, then the job is suspended.
            // Abandoned pods (a lost node) are not waited for: see `ABANDON_AFTER`.
            if cx.obs.live_pods() == 0 {
                return Step::to::<Suspending, Suspended>()
                    .event("Suspended", "pods stopped; resume with spec.state: running")
                    .message(match &st.last_savepoint {
                        Some(sp) => format!("suspended at savepoint {}; set spec.state to running to resume from it", sp.id),
                        None => "suspended; set spec.state to running to resume".into(),
                    });
            }
            return Step::stay::<Suspending>().effect(Effect::DeleteAllPods).message("suspending: stopping the pods").requeue(Duration::from_millis(500));
        }
        if cx.job.spec.state == JobState::Running {
            let cancel = savepoint::give_up(cx, st);
            return Step::to::<Suspending, Running>().effects(cancel).event("SuspendCancelled", "spec.state is running again before the suspension completed").message("running (suspension cancelled)");
        }
        if let Some(run) = st.run.clone() {
            if let RunHealth::Failed { reason, message, fatal } = cx.obs.health(&run) {
                st.pending_savepoint = None;
                return after_failure::<Suspending>(cx, st, &reason, &format!("{message}, before the suspend savepoint completed"), fatal);
            }
        }
        record_progress(cx, st);
        match savepoint::wait(cx, st) {
            Wait::Pending { effects, message } => Step::stay::<Suspending>().effects(effects).message(format!("suspending: {message}")).requeue(Duration::from_millis(500)),
            Wait::Completed(sp) => {
                let m = savepoint::record(cx, st, &sp);
                Step::stay::<Suspending>()
                    .effect(Effect::DeleteAllPods)
                    .event("SavepointCompleted", format!("{m}; stopping the pods"))
                    .message(format!("suspending: {m}; stopping the pods"))
                    .requeue(Duration::from_millis(500))
            }
            Wait::Failed(why) => {
                let cancel = savepoint::give_up(cx, st);
                let m = format!("suspend savepoint failed: {why}");
                st.last_failure = Some(Failure { time: Time(cx.now), reason: "SavepointFailed".into(), message: m.clone() });
                Step::to::<Suspending, Running>().effects(cancel).warning("SavepointFailed", format!("{m}; the job keeps running; the suspension is retried")).message(m).requeue(Duration::from_secs(1))
            }
        }
    }
}
