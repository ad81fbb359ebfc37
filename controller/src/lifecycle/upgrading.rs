//! A spec change is being rolled out: in savepoint mode first the savepoint
//! (the old pods keep running), then the new run restored from it. If the
//! savepoint fails the old job keeps running and status says why: the
//! upgrade never falls back silently to a weaker mode.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::streamjob::{Failure, StreamJobStatus};

use super::rollback::{self, after_failure};
use super::run::{advance, new_run, record_progress, restored_from, Progress};
use super::savepoint::{self, Wait};
use super::{Cx, Finished, Running, State, Step};
use crate::observe::RunHealth;

pub struct Upgrading;

impl State for Upgrading {
    const PHASE: Option<weir_api::streamjob::Phase> = Some(weir_api::streamjob::Phase::Upgrading);

    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step {
        if st.pending_savepoint.is_some() {
            return await_savepoint(cx, st);
        }
        if let Some(step) = rollback::when_due::<Upgrading>(cx, st) {
            return step;
        }
        match advance(cx, st) {
            Progress::Waiting(w) => w.step::<Upgrading>("upgrading: "),
            Progress::Running => {
                let from = restored_from(cx);
                Step::to::<Upgrading, Running>()
                    .event("Upgraded", format!("the new spec runs; {from}"))
                    .message(format!("running the new spec; {from}"))
                    .requeue(Duration::from_secs(2))
            }
            Progress::Finished => Step::to::<Upgrading, Finished>().message("finished: every source ended and the final checkpoint committed"),
            Progress::Failed { reason, message, fatal } => {
                after_failure::<Upgrading>(cx, st, &reason, &format!("the upgraded job failed: {message}"), fatal)
            }
        }
    }
}

fn await_savepoint(cx: &Cx, st: &mut StreamJobStatus) -> Step {
    if let Some(run) = st.run.clone() {
        if let RunHealth::Failed { reason, message, fatal } = cx.obs.health(&run) {
            // The old pods died before the savepoint completed. The newest
            // consistent state is the latest checkpoint; say so loudly.
            st.pending_savepoint = None;
            let m = format!("{message}, before the upgrade savepoint completed; the new spec starts from the latest completed checkpoint instead");
            let step = super::run::after_failure::<Upgrading>(cx, st, &reason, &m, fatal);
            // The new spec's run restores from the latest checkpoint: an upgrade all the same.
            let (warning, _) = rollback::open_trial(cx, st, None);
            return match warning {
                Some(w) => step.warning("RollbackUnavailable", w),
                None => step,
            };
        }
    }
    record_progress(cx, st);
    match savepoint::wait(cx, st) {
        Wait::Pending { effects, message } => Step::stay::<Upgrading>().effects(effects).message(format!("upgrading: {message}")).requeue(Duration::from_millis(500)),
        Wait::Completed(sp) => {
            let m = savepoint::record(cx, st, &sp);
            new_run(cx, st, Some(sp.location.clone()), None);
            let (warning, trial) = rollback::open_trial(cx, st, Some(sp.location.clone()));
            let step = Step::stay::<Upgrading>()
                .event("SavepointCompleted", format!("{m}; stopping the old pods, then starting the new spec from it{trial}"))
                .message(format!("upgrading: {m}; stopping the old pods{trial}"))
                .requeue(Duration::ZERO);
            match warning {
                Some(w) => step.warning("RollbackUnavailable", w),
                None => step,
            }
        }
        Wait::Failed(why) => {
            let cancel = savepoint::give_up(cx, st);
            let m = format!("upgrade savepoint failed: {why}");
            st.last_failure = Some(Failure { time: Time(cx.now), reason: "SavepointFailed".into(), message: m.clone() });
            let shown = format!("{m}; the job keeps running the previous spec (the upgrade is retried; to upgrade without a savepoint set upgradeMode: last-state)");
            Step::to::<Upgrading, Running>().effects(cancel).warning("SavepointFailed", shown.clone()).message(shown.clone()).degraded("SavepointFailed", shown).requeue(Duration::from_secs(1))
        }
    }
}

