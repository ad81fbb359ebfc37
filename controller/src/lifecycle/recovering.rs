//! After a failure (or spec.restartTrigger): the whole job restarts from the
//! latest completed checkpoint, after the backoff the status records.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, StreamJobStatus};

use super::run::{advance, begin_recovery, restored_from, Progress};
use super::{rollback, Cx, Failed, Finished, Running, State, Step};

pub struct Recovering;

impl State for Recovering {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Recovering);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        if let Some(step) = rollback::when_due::<Recovering>(cx, st) {
            return step;
        }
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
            Progress::Failed { reason, message, fatal } => match rollback::on_failure::<Recovering>(cx, st, &reason, &message, fatal) {
                Some(step) => step,
                None => failed(cx, st, reason, message, fatal),
            },
        }
    }
}

/// A failure of the recovering run that does not roll it back: fatal ones
/// fail the job, others restart it (or fail it past the restart limit).
fn failed(cx: &Cx, st: &mut StreamJobStatus, reason: String, message: String, fatal: bool) -> Step {
    if fatal {
        st.last_failure = Some(Failure { time: Time(cx.now), reason: reason.clone(), message: message.clone() });
        return Step::to::<Recovering, Failed>().warning(&reason, message.clone()).message(message);
    }
    match begin_recovery(cx, st, &reason, &message) {
        Ok(m) => Step::stay::<Recovering>().warning(&reason, m.clone()).message(m).requeue(Duration::ZERO),
        Err(m) => Step::to::<Recovering, Failed>().warning("RestartLimitReached", m.clone()).message(m),
    }
}
