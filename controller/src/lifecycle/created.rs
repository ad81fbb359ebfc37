//! A StreamJob the operator has not acted on yet.

use std::time::Duration;

use weir_api::streamjob::{Failure, JobState, StreamJobStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::run::new_run;
use super::{Cx, Deploying, Failed, State, Step, Suspended};

pub struct Created;

impl State for Created {
    const PHASE: Option<weir_api::streamjob::Phase> = None;

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        // Triggers already in the manifest are part of the first deploy, not
        // requests: a restart or a savepoint right after it would surprise.
        st.observed_savepoint_trigger = cx.job.spec.savepoint_trigger.clone();
        st.observed_restart_trigger = cx.job.spec.restart_trigger.clone();
        if let Err(why) = &cx.validation {
            // Reported in status and an event; never a crash loop.
            st.last_failure = Some(Failure { time: Time(cx.now), reason: why.reason.into(), message: why.message.clone() });
            return Step::to::<Created, Failed>()
                .warning(why.reason, why.message.clone())
                .message(format!("not deployed: {why}"));
        }
        if cx.job.spec.state == JobState::Suspended {
            return Step::to::<Created, Suspended>().message("created suspended: set spec.state to running to start");
        }
        st.initial_savepoint = cx.job.spec.initial_savepoint.clone();
        new_run(cx, st, cx.job.spec.initial_savepoint.clone(), None);
        let from = match &cx.job.spec.initial_savepoint {
            Some(sp) => format!("from savepoint {sp}"),
            None => "fresh".into(),
        };
        Step::to::<Created, Deploying>()
            .event("Deploying", format!("deploying {} worker(s), starting {from}", cx.job.spec.parallelism))
            .message(format!("deploying, starting {from}"))
            .requeue(Duration::ZERO)
    }
}
