//! The job lifecycle as an explicit state machine.
//!
//! Each phase of `status.phase` is a state with its own file; a state's `step`
//! looks at the StreamJob and what was observed and returns a [`Step`]: the
//! next phase, the effects to carry out and the events to publish. A step can
//! only name a next phase its state may go to: `Step::to::<From, To>()`
//! compiles only where `From: TransitionTo<To>`, so the transition table below
//! is the whole graph.
//!
//! [`decide`] is pure. The reconciler writes the status it returns *before*
//! carrying out the effects, and every effect is idempotent given that status
//! (pods are named by run, savepoint requests carry an id), so an operator
//! restarted between the two continues without repeating anything that
//! matters: a savepoint it already asked for is awaited, not taken twice.

pub use upgrade_slots::{count as upgrade_slots, in_flight as upgrade_in_flight, UpgradeSlots};

mod created;
mod deadline;
mod deleting;
mod deploying;
mod failed;
mod finished;
mod recovering;
mod readiness;
mod rollback;
mod rolling_back;
mod run;
mod running;
mod savepoint;
mod savepoint_retention;
mod savepointing;
mod status;
mod suspended;
mod suspending;
mod upgrade_slots;
mod upgrading;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::time::Duration;

use jiff::Timestamp;
use weir_api::control::Membership;
use weir_api::streamjob::{Phase, StreamJob, StreamJobStatus};

use crate::desired::{self, Refusal, WorkerSettings};
use crate::observe::Observed;
use crate::spec_hash::spec_hash;

pub use created::Created;
pub use run::{CONTROL_REACH, REFUSED_POD};
pub use deleting::Deleting;
pub use deploying::Deploying;
pub use failed::Failed;
pub use finished::Finished;
pub use recovering::Recovering;
pub use rolling_back::RollingBack;
pub use running::Running;
pub use savepointing::Savepointing;
pub use suspended::Suspended;
pub use suspending::Suspending;
pub use upgrading::Upgrading;

/// A lifecycle state. `PHASE` is what `status.phase` shows (`None`: the job
/// was never reconciled).
pub trait State {
    const PHASE: Option<Phase>;
    fn step(cx: &Cx, st: &mut StreamJobStatus) -> Step;
}

/// `From: TransitionTo<To>` allows a step of `From` to move the job to `To`.
pub trait TransitionTo<To: State>: State {}

macro_rules! transitions {
    ($($from:ty => [$($to:ty),*];)*) => {
        $($(impl TransitionTo<$to> for $from {})*)*
    };
}

// The whole lifecycle graph. Every state may go to Deleting (a deletion can
// start at any time); Deleting is terminal.
transitions! {
    Created => [Deploying, Suspended, Failed, Deleting];
    Deploying => [Running, Recovering, Failed, Finished, Deleting];
    Running => [Savepointing, Upgrading, RollingBack, Recovering, Suspending, Finished, Failed, Deleting];
    Savepointing => [Running, Recovering, Failed, Deleting];
    Upgrading => [Running, RollingBack, Recovering, Failed, Finished, Deleting];
    RollingBack => [Running, Recovering, Failed, Finished, Deleting];
    Recovering => [Running, RollingBack, Failed, Finished, Deleting];
    Suspending => [Suspended, Running, Recovering, Failed, Deleting];
    Suspended => [Deploying, Deleting];
    Failed => [Deploying, Deleting];
    Finished => [Deploying, Deleting];
}

/// What a step wants done after its status is written.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Apply the pipeline ConfigMap, the workers' Service, the control token
    /// Secret (only when absent) and the pods of `status.run`.
    CreateRun,
    /// Delete every pod of the job that does not belong to `status.run`.
    DeleteOtherPods,
    /// Delete every pod of the job.
    DeleteAllPods,
    /// Give every worker of the run its membership.
    SendMembership { membership: Membership, workers: Vec<SocketAddr> },
    /// Ask the coordinator for a savepoint (same id: same savepoint).
    RequestSavepoint { api: SocketAddr, request_id: String, stop: bool },
    /// Tell the coordinator nobody waits for this savepoint any more: a
    /// stopping one must not leave the job stopped (the runtime resumes
    /// checkpointing, even if it completed meanwhile).
    CancelSavepoint { api: SocketAddr, request_id: String },
    /// Ask the coordinator to dispose of a savepoint `spec.savepoints` no
    /// longer keeps (idempotent: a savepoint already gone is reported done).
    DisposeSavepoint { api: SocketAddr, location: String },
    /// Let the API server delete the StreamJob.
    RemoveFinalizer,
}

/// An event to publish on the StreamJob.
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

/// One state's answer.
#[derive(Debug, Clone)]
pub struct Step {
    next: Option<Phase>,
    effects: Vec<Effect>,
    notes: Vec<Note>,
    requeue: Duration,
    message: Option<String>,
    degraded: Option<(String, String)>,
}

impl Step {
    fn new(next: Option<Phase>) -> Step {
        Step { next, effects: Vec::new(), notes: Vec::new(), requeue: Duration::from_secs(300), message: None, degraded: None }
    }

    /// Stay in state `S`.
    pub fn stay<S: State>() -> Step {
        Step::new(S::PHASE)
    }

    /// Move from `F` to `T`; compiles only for transitions in the table.
    pub fn to<F: TransitionTo<T>, T: State>() -> Step {
        Step::new(T::PHASE)
    }

    pub fn effect(mut self, e: Effect) -> Step {
        self.effects.push(e);
        self
    }

    pub fn effects(mut self, e: impl IntoIterator<Item = Effect>) -> Step {
        self.effects.extend(e);
        self
    }

    pub fn event(mut self, reason: &str, message: impl Into<String>) -> Step {
        self.notes.push(Note { warning: false, reason: reason.into(), message: message.into() });
        self
    }

    pub fn notes(mut self, notes: impl IntoIterator<Item = Note>) -> Step {
        self.notes.extend(notes);
        self
    }

    pub fn warning(mut self, reason: &str, message: impl Into<String>) -> Step {
        self.notes.push(Note { warning: true, reason: reason.into(), message: message.into() });
        self
    }

    /// Look again after `d` (watch events on the job and its pods come sooner).
    pub fn requeue(mut self, d: Duration) -> Step {
        self.requeue = d;
        self
    }

    /// The one-line status message.
    pub fn message(mut self, m: impl Into<String>) -> Step {
        self.message = Some(m.into());
        self
    }

    /// Sets the Degraded condition (reason, message) for this step.
    pub fn degraded(mut self, reason: &str, message: impl Into<String>) -> Step {
        self.degraded = Some((reason.into(), message.into()));
        self
    }
}

/// What a state step sees.
pub struct Cx<'a> {
    pub job: &'a StreamJob,
    pub obs: &'a Observed,
    pub now: Timestamp,
    /// Hash of the current spec's pod-shaping fields.
    pub spec_hash: String,
    /// The spec's validation: what its pipeline promises and how it runs,
    /// or why it cannot run.
    pub validation: Result<Validated, Refusal>,
    /// The operator's default worker image, when the job's pods run it
    /// (the job names no image of its own).
    pub default_image: Option<String>,
}

/// What a valid spec's pipeline promises and how it runs.
#[derive(Debug, Clone)]
pub struct Validated {
    /// What the job promises: the weakest guarantee of its sinks.
    pub guarantee: weir_api::Guarantee,
    /// What sets it, in words.
    pub reason: String,
    /// The sink that sets it, when the sinks get different ones.
    pub decided_by: Option<String>,
    /// What the job runs at: the strongest guarantee of its sinks
    /// (at-most-once only when every sink is: then no checkpoints).
    pub runtime: weir_api::Guarantee,
}

/// The outcome of one reconcile's decision.
#[derive(Debug, Clone)]
pub struct Decision {
    pub status: StreamJobStatus,
    pub effects: Vec<Effect>,
    pub notes: Vec<Note>,
    pub requeue: Duration,
    /// (from, to, time spent in `from`) when the phase changed.
    pub transition: Option<(Option<Phase>, Phase, Duration)>,
}

/// Decides the next status and effects of `job` from what was observed;
/// `settings` are the operator's (the default worker image, ...).
pub fn decide(job: &StreamJob, obs: &Observed, settings: &WorkerSettings) -> Decision {
    let validation = validate(job, settings);
    let image = desired::worker_image(job, settings);
    // The default is used when neither the spec nor its pod template names an image.
    let default_image = image.clone().filter(|_| desired::worker_image(job, &WorkerSettings { default_image: None, ..settings.clone() }).is_none());
    let cx = Cx { job, obs, now: obs.now, spec_hash: spec_hash(&job.spec, image.as_deref()), validation, default_image };
    let mut st = job.status.clone().unwrap_or_default();
    crate::spec_hash::migrate(&mut st, &job.spec, image.as_deref(), &cx.spec_hash);
    let before = st.phase;
    // A rollback holds its generation back only while that generation is
    // the current one: any change of the spec is tried again.
    if st.rollback.is_some() && !rollback::holds(&cx, &st) {
        st.rollback = None;
    }
    let step = if job.metadata.deletion_timestamp.is_some() {
        match before {
            Some(Phase::Deleting) => Deleting::step(&cx, &mut st),
            _ => to_deleting(before),
        }
    } else {
        match before {
            None => Created::step(&cx, &mut st),
            Some(Phase::Deploying) => Deploying::step(&cx, &mut st),
            Some(Phase::Running) => Running::step(&cx, &mut st),
            Some(Phase::Savepointing) => Savepointing::step(&cx, &mut st),
            Some(Phase::Upgrading) => Upgrading::step(&cx, &mut st),
            Some(Phase::RollingBack) => RollingBack::step(&cx, &mut st),
            Some(Phase::Recovering) => Recovering::step(&cx, &mut st),
            Some(Phase::Suspending) => Suspending::step(&cx, &mut st),
            Some(Phase::Suspended) => Suspended::step(&cx, &mut st),
            Some(Phase::Failed) => Failed::step(&cx, &mut st),
            Some(Phase::Finished) => Finished::step(&cx, &mut st),
            Some(Phase::Deleting) => Deleting::step(&cx, &mut st),
        }
    };
    // An upgrade is on trial only while the job upgrades, runs or recovers:
    // a suspension, a failure or a deletion ends it. While it is, the next
    // look comes no later than its deadline.
    let mut step = step;
    if !matches!(step.next.or(before), Some(Phase::Upgrading | Phase::Running | Phase::Recovering)) {
        st.upgrade_trial = None;
    }
    if let Some(t) = &st.upgrade_trial {
        let left = Duration::try_from(t.deadline.0.duration_since(cx.now)).unwrap_or_default();
        step.requeue = step.requeue.min(left.max(Duration::from_millis(100)));
    }
    // Recorded on every reconcile, so that the list empties once they are gone.
    // Any run's: a pod of the current run can be abandoned too (suspended beside a lost node).
    st.abandoned_pods = obs.abandoned_pods(None);
    status::finish(&cx, st, before, step)
}

/// Everything checked before a job's pods are created: the spec and its
/// pipeline (what `weir run` checks, plus what CEL cannot), then what the
/// pods need ([`desired::check`]: a worker image, shared storage).
pub fn validate(job: &StreamJob, settings: &WorkerSettings) -> Result<Validated, Refusal> {
    let pipeline = job.spec.validate().map_err(|e| Refusal::invalid(e.to_string()))?;
    // What the runtime does not run yet (joins; see runtime/design/graphs.md
    // §6) is refused here, once, rather than by every worker of every run
    // the job would start.
    let graph = pipeline.runnable_graph().map_err(|e| Refusal::invalid(format!("{}: {e}", weir_api::streamjob::PIPELINE_ERROR_NAME)))?;
    let sinks: Vec<&weir_api::SinkSpec> = graph.sinks.iter().map(|s| &s.spec).collect();
    desired::check(job, &sinks, settings)?;
    let (guarantee, reason) = pipeline.guarantee_and_reason();
    Ok(Validated { guarantee, reason, decided_by: pipeline.guarantee_decided_by(), runtime: pipeline.runtime_guarantee() })
}

/// Deletion can start in any state; the move is still checked per state.
fn to_deleting(from: Option<Phase>) -> Step {
    let step = match from {
        None => Step::to::<Created, Deleting>(),
        Some(Phase::Deploying) => Step::to::<Deploying, Deleting>(),
        Some(Phase::Running) => Step::to::<Running, Deleting>(),
        Some(Phase::Savepointing) => Step::to::<Savepointing, Deleting>(),
        Some(Phase::Upgrading) => Step::to::<Upgrading, Deleting>(),
        Some(Phase::RollingBack) => Step::to::<RollingBack, Deleting>(),
        Some(Phase::Recovering) => Step::to::<Recovering, Deleting>(),
        Some(Phase::Suspending) => Step::to::<Suspending, Deleting>(),
        Some(Phase::Suspended) => Step::to::<Suspended, Deleting>(),
        Some(Phase::Failed) => Step::to::<Failed, Deleting>(),
        Some(Phase::Finished) => Step::to::<Finished, Deleting>(),
        Some(Phase::Deleting) => Step::stay::<Deleting>(),
    };
    step.message("deleting: deciding about the final savepoint").requeue(Duration::ZERO)
}

/// `d` as a short human duration (`1.5s`, `2m`).
pub(crate) fn human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 120_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else {
        format!("{}m", ms / 60_000)
    }
}
