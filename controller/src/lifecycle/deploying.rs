//! The first run of a job (or a resumed one) is starting.

use std::time::Duration;

use weir_api::streamjob::StreamJobStatus;

use super::run::{advance, after_failure, restored_from, Progress};
use super::{Cx, Finished, Running, State, Step};

pub struct Deploying;

impl State for Deploying {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Deploying);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        match advance(cx, st) {
            Progress::Waiting(w) => w.step::<Deploying>(""),
            Progress::Running => {
                let from = restored_from(cx);
                Step::to::<Deploying, Running>().event("Running", format!("all workers run; {from}")).message(format!("running; {from}")).requeue(Duration::from_secs(2))
            }
            Progress::Finished => Step::to::<Deploying, Finished>().message("finished: every source ended and the final checkpoint committed"),
            Progress::Failed { reason, message, fatal } => after_failure::<Deploying>(cx, st, &reason, &message, fatal),
        }
    }
}
