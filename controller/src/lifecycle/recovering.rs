//! After a failure (or spec.restartTrigger): the whole job restarts from the
//! latest completed checkpoint, after the backoff the status records.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, StreamJobStatus};

use super::run::{advance, begin_recovery, restored_from, Progress};
use super::{Cx, Failed, Finished, Running, State, Step};

pub struct Recovering;

impl State for Recovering {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Recovering);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        match advance(cx, st) {
            Progress::Waiting(w) => w.step::<Recovering>("recovering: "),
            Progress::Running => {
                let from = restored_from(cx);
                Step::to::<Recovering, Running>()
                    .event("Recovered", format!("all workers run again; {from}"))
                    .message(format!("running; {from}"))
                    .requeue(Duration::from_secs(2))
            }
            Progress::Finished => Step::to::<Recovering, Finished>().message("finished: every source ended and the final checkpoint committed"),
            Progress::Failed { reason, message, fatal: true } => {
                st.last_failure = Some(Failure { time: Time(cx.now), reason: reason.clone(), message: message.clone() });
                Step::to::<Recovering, Failed>().warning(&reason, message.clone()).message(message)
            }
            Progress::Failed { reason, message, .. } => match begin_recovery(cx, st, &reason, &message) {
                Ok(m) => Step::stay::<Recovering>().warning(&reason, m.clone()).message(m).requeue(Duration::ZERO),
                Err(m) => Step::to::<Recovering, Failed>().warning("RestartLimitReached", m.clone()).message(m),
            },
        }
    }
}
