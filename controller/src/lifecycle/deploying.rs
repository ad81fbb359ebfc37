//! The first run of a job (or a resumed one) is starting.

use std::time::Duration;

use weir_api::streamjob::{Failure, StreamJobStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::run::{advance, begin_recovery, restored_from, Progress};
use super::{Cx, Failed, Finished, Recovering, Running, State, Step};

pub struct Deploying;

impl State for Deploying {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Deploying);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        match advance(cx, st) {
            Progress::Waiting { effects, message, requeue } => Step::stay::<Deploying>().effects(effects).message(message).requeue(requeue),
            Progress::Running => {
                let from = restored_from(cx);
                Step::to::<Deploying, Running>().event("Running", format!("all workers run; {from}")).message(format!("running; {from}")).requeue(Duration::from_secs(2))
            }
            Progress::Finished => Step::to::<Deploying, Finished>().message("finished: every source ended and the final checkpoint committed"),
            Progress::Failed { reason, message, fatal: true } => {
                st.last_failure = Some(Failure { time: Time(cx.now), reason: reason.clone(), message: message.clone() });
                Step::to::<Deploying, Failed>().warning(&reason, message.clone()).message(message)
            }
            Progress::Failed { reason, message, .. } => match begin_recovery(cx, st, &reason, &message) {
                Ok(m) => Step::to::<Deploying, Recovering>().warning(&reason, m.clone()).message(m).requeue(Duration::ZERO),
                Err(m) => Step::to::<Deploying, Failed>().warning("RestartLimitReached", m.clone()).message(m),
            },
        }
    }
}
