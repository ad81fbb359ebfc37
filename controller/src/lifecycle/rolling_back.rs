//! A failed upgrade goes back to the last spec that ran healthy
//! (spec.upgrade.rollback; the decision is in `rollback.rs`). The run of
//! that spec starts like any other, within spec.deployTimeout; once it is up
//! the job runs again, with `status.rollback` and the RolledBack condition
//! saying which generation was given up and why. A rollback happens once:
//! should the run of the old spec fail, it recovers or fails like any run,
//! and is never rolled back itself.

use std::time::Duration;

use weir_api::streamjob::StreamJobStatus;

use super::run::{advance, after_failure, restored_from, Progress};
use super::{rollback, Cx, Finished, Running, State, Step};

pub struct RollingBack;

impl State for RollingBack {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::RollingBack);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        match advance(cx, st) {
            Progress::Waiting(w) => w.step::<RollingBack>("rolling back: "),
            Progress::Running => {
                let from = restored_from(cx);
                match rollback::held_message(st).filter(|_| rollback::holds(cx, st)) {
                    Some(held) => {
                        let m = format!("{held}; {from}");
                        Step::to::<RollingBack, Running>()
                            .warning("RolledBack", m.clone())
                            .message(format!("running; {m}"))
                            .degraded(weir_api::streamjob::ready_reasons::ROLLED_BACK, held)
                            .requeue(Duration::from_secs(2))
                    }
                    // The spec changed while the rollback started: its run took the new spec.
                    None => Step::to::<RollingBack, Running>().event("Running", format!("all workers run; {from}")).message(format!("running; {from}")).requeue(Duration::from_secs(2)),
                }
            }
            Progress::Finished => Step::to::<RollingBack, Finished>().message("finished: every source ended and the final checkpoint committed"),
            Progress::Failed { reason, message, fatal } => {
                after_failure::<RollingBack>(cx, st, &reason, &format!("the rollback's run failed: {message}"), fatal)
            }
        }
    }
}
