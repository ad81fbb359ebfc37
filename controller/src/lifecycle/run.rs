//! Starting a run (a set of worker pods) and following it until it runs.
//! Deploying, Upgrading and Recovering share this: a state decides *what* to
//! start (`new_run`, written to status first), [`advance`] starts it.
//!
//! The one rule that keeps two runs from overlapping lives here: the pods of
//! a new run are created only when no pod of any other run is left, except
//! pods abandoned on a lost node (still there `ABANDON_AFTER` after their
//! deletion): those are recorded in status and not waited for, because the
//! run fence in storage keeps a superseded run from committing anything.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::control::{Membership, CONTROL_PORT};
use weir_api::streamjob::{Failure, RunStatus, StreamJobStatus};

use super::{human, Cx, Effect};
use crate::observe::{Rejection, RunHealth};

/// Restore from the latest completed checkpoint or savepoint of the job (the
/// worker falls back to a fresh start, or to the initial savepoint, when the
/// job has none yet).
pub const LATEST: &str = "latest";

/// How long a run's pods may be unschedulable while they avoid the nodes of
/// abandoned pods before the run is started again without avoiding any.
pub const RELAX_AVOIDANCE_AFTER: Duration = Duration::from_secs(10);

/// Decides a new run of the current spec; its pods are created by [`advance`].
/// A spec the operator refuses is never run: while it is refused (a pod
/// failed under a refused change, a restart asked for), the new run keeps
/// the spec of the run before it, which is what was deployed.
pub(super) fn new_run(cx: &Cx, st: &mut StreamJobStatus, restore_from: Option<String>, not_before: Option<jiff::Timestamp>) {
    let number = st.run.as_ref().map(|r| r.number + 1).unwrap_or(1);
    // Nor is a generation that was rolled back (until the spec changes).
    let held_back = cx.validation.is_err() || super::rollback::holds(cx, st);
    let (spec_hash, generation, workers, default_image) = match (held_back, &st.run) {
        (true, Some(before)) => (before.spec_hash.clone(), before.generation, before.workers, before.default_image.clone()),
        _ => (cx.spec_hash.clone(), cx.job.metadata.generation, cx.job.spec.parallelism.max(1), cx.default_image.clone()),
    };
    let uid = cx.job.metadata.uid.as_deref().unwrap_or("local");
    let short: String = uid.chars().filter(|c| c.is_ascii_alphanumeric()).take(8).collect();
    st.run = Some(RunStatus {
        generation,
        not_before: not_before.map(Time),
        // Once a checkpoint completed, `latest` finding no state at all means
        // the storage was lost or is the wrong one, not a first start.
        expect_state: restore_from.as_deref() == Some(LATEST) && st.last_checkpoint.is_some(),
        restore_from,
        default_image,
        ..RunStatus::decided(format!("{short}-{number}"), number, spec_hash, workers, Time(cx.now))
    });
}

pub(super) enum Progress {
    Waiting(Waiting),
    Running,
    Finished,
    Failed { reason: String, message: String, fatal: bool },
}

/// The run is not up yet: what to do meanwhile.
pub(super) struct Waiting {
    effects: Vec<Effect>,
    pub(super) message: String,
    pub(super) requeue: Duration,
    /// A Warning event (reason, message).
    warning: Option<(String, String)>,
    /// The Degraded condition (reason, message) while waiting.
    degraded: Option<(String, String)>,
}

impl Waiting {
    fn new(effects: Vec<Effect>, message: impl Into<String>, requeue: Duration) -> Progress {
        Progress::Waiting(Waiting { effects, message: message.into(), requeue, warning: None, degraded: None })
    }

    /// Stay in `S`; the status message starts with `prefix`.
    pub(super) fn step<S: super::State>(self, prefix: &str) -> super::Step {
        let mut step = super::Step::stay::<S>().effects(self.effects).message(format!("{prefix}{}", self.message)).requeue(self.requeue);
        if let Some((reason, message)) = self.warning {
            step = step.warning(&reason, message);
        }
        if let Some((reason, message)) = self.degraded {
            step = step.degraded(&reason, message);
        }
        step
    }
}

/// One step of bringing `status.run` up, within `spec.deployTimeout`.
pub(super) fn advance(cx: &Cx, st: &mut StreamJobStatus) -> Progress {
    let progress = advance_run(cx, st);
    super::deadline::bound(cx, st.run.as_ref(), progress)
}

fn advance_run(cx: &Cx, st: &mut StreamJobStatus) -> Progress {
    if let Some(replaced) = take_current_spec(cx, st) {
        return replaced;
    }
    let Some(run) = st.run.as_mut() else {
        return Progress::Failed { reason: "NoRun".into(), message: "no run to deploy".into(), fatal: false };
    };
    let others = cx.obs.pods_of_other_runs(Some(&run.id));
    if others > 0 {
        return Waiting::new(
            vec![Effect::DeleteOtherPods],
            format!("stopping {others} pod(s) of the previous run before run {} starts", run.number),
            Duration::from_millis(500),
        );
    }
    let mine = cx.obs.pods.len();
    if let Some(r) = cx.obs.rejected.as_ref().filter(|r| run.pods_created && r.run_id == run.id) {
        return refused(cx, run, r, mine);
    }
    if !run.pods_created {
        if run.refusals > 0 && mine > 0 {
            // Some pods were created before one was refused: gone before the next try.
            return Waiting::new(vec![Effect::DeleteAllPods], format!("removing {mine} pod(s) of run {} created before the refusal", run.number), Duration::from_millis(500));
        }
        if let Some(t) = &run.not_before {
            if t.0 > cx.now {
                let wait = Duration::try_from(t.0.duration_since(cx.now)).unwrap_or_default();
                // A time, not a countdown: the message must not change from
                // one reconcile to the next, or every reconcile would write
                // the status, whose watch event triggers the next reconcile.
                let at = t.0.round(jiff::Unit::Second).unwrap_or(t.0);
                let Some(refusal) = run.last_refusal.clone().filter(|_| run.refusals > 0) else {
                    return Waiting::new(Vec::new(), format!("restarting at {at} (backoff)"), wait);
                };
                let m = format!("{refusal}; creating the pods again at {at}");
                let mut w = Waiting { effects: Vec::new(), message: m.clone(), requeue: wait, warning: None, degraded: None };
                w.degraded = Some((refusal_reason(run).into(), m));
                return Progress::Waiting(w);
            }
        }
        run.pods_created = true;
        run.pods_created_at = Some(Time(cx.now));
        run.avoid_nodes = if run.avoid_nodes_relaxed { Vec::new() } else { cx.obs.abandoned_nodes(Some(&run.id)) };
        let from = run.restore_from.as_deref().map(|r| format!(", restoring from {r}")).unwrap_or_else(|| ", fresh start".into());
        let message = format!("creating {} worker pod(s) of run {}{from}", run.workers, run.number);
        let abandoned = cx.obs.abandoned_pods(Some(&run.id));
        let mut waiting = Waiting { effects: vec![Effect::CreateRun], message, requeue: Duration::from_secs(1), warning: None, degraded: None };
        if !abandoned.is_empty() {
            // Safe because no pod of an older run can pass the run fence in storage.
            waiting.warning = Some((
                "AbandonedPods".into(),
                format!(
                    "run {} starts without waiting for pod(s) {} of an earlier run, still there {} s after their deletion (lost node, or frozen), and avoids node(s) {}; the run fence keeps them from committing anything",
                    run.number,
                    abandoned.join(", "),
                    crate::observe::ABANDON_AFTER.as_secs(),
                    if run.avoid_nodes.is_empty() { "theirs".to_string() } else { run.avoid_nodes.join(", ") }
                ),
            ));
        }
        return Progress::Waiting(waiting);
    }
    let run = run.clone();
    match cx.obs.health(&run) {
        RunHealth::NotCreated => Waiting::new(vec![Effect::CreateRun], "creating worker pods", Duration::from_secs(1)),
        // Pod changes wake the reconciler (it watches the pods it owns).
        RunHealth::Starting { .. } if !run.avoid_nodes.is_empty() && cx.obs.unschedulable_for(&run.id).is_some_and(|w| w >= RELAX_AVOIDANCE_AFTER) => {
            // No other node has room: a node that merely looked lost (a slow
            // kubelet) must not keep the job from running at all.
            let m = format!(
                "the pods of run {} cannot be scheduled away from {} for {} s; starting run {} without avoiding any node",
                run.number,
                run.avoid_nodes.join(", "),
                RELAX_AVOIDANCE_AFTER.as_secs(),
                run.number + 1
            );
            new_run(cx, st, run.restore_from.clone(), None);
            if let Some(r) = st.run.as_mut() {
                r.avoid_nodes_relaxed = true;
            }
            Progress::Waiting(Waiting { effects: vec![Effect::DeleteOtherPods], message: m.clone(), requeue: Duration::from_millis(500), warning: Some(("AvoidanceRelaxed".into(), m)), degraded: None })
        }
        RunHealth::Starting { waiting_for } => {
            Waiting::new(Vec::new(), format!("waiting for {}", waiting_for.unwrap_or_else(|| "the worker pods".into())), Duration::from_secs(5))
        }
        RunHealth::Finished => Progress::Finished,
        RunHealth::Failed { reason, message, fatal } => Progress::Failed { reason, message, fatal },
        RunHealth::Running { ips } => {
            let joined = cx
                .obs
                .coordinator
                .as_ref()
                .is_some_and(|c| c.run_id == run.id && matches!(c.phase.as_str(), "running" | "finishing" | "finished"));
            if joined {
                return Progress::Running;
            }
            // Until the coordinator runs, (re)send the membership to every worker:
            // it is idempotent, and a worker that missed it would wait forever.
            let Some(membership) = Membership::of_pods(run.id.clone(), &ips) else {
                return Waiting::new(Vec::new(), "waiting for pod IPs", Duration::from_millis(500));
            };
            let workers = ips.iter().map(|ip| SocketAddr::new(*ip, CONTROL_PORT)).collect();
            let phase = cx.obs.coordinator.as_ref().map(|c| c.phase.clone()).unwrap_or_else(|| "not answering yet".into());
            let mut waiting = Waiting {
                effects: vec![Effect::SendMembership { membership, workers }],
                message: format!("workers of run {} joining (coordinator: {phase})", run.number),
                requeue: Duration::from_millis(300),
                warning: None,
                degraded: None,
            };
            if let Some(why) = ips.first().and_then(|ip| unreachable_while_joining(cx, st, *ip)) {
                waiting.message = format!("workers of run {} joining: {why}", run.number);
                waiting.degraded = Some((CONTROL_UNREACHABLE.into(), why));
            }
            Progress::Waiting(waiting)
        }
    }
}

/// The Degraded reason while the operator cannot reach a joining run's
/// worker 0 (a NetworkPolicy that denies the operator, a firewall).
pub const CONTROL_UNREACHABLE: &str = "ControlEndpointUnreachable";

/// What the operator must reach, said wherever it cannot.
pub const CONTROL_REACH: &str = "the operator must be able to connect to port 6120 (control) of every worker pod: allow it in any NetworkPolicy that selects the workers (see the chart README, Ports and NetworkPolicy)";

/// Whether the control endpoint's answer was a refusal of the operator's
/// token (HTTP 401): the worker runs and is reachable.
pub(super) fn refused_token(error: &str) -> bool {
    error.contains("HTTP 401")
}

/// Whether the operator refused the worker's TLS certificate (`spec.tls`):
/// the worker runs and is reachable, its certificate is wrong for the job.
pub(super) fn refused_certificate(error: &str) -> bool {
    error.contains("invalid peer certificate") || error.contains("trusts no CA")
}

/// What to do about a control endpoint that did not answer the operator,
/// by its last error: a refused token is no network problem.
pub fn control_hint(error: &str) -> &'static str {
    if refused_certificate(error) {
        "the workers' certificate (spec.tls) was refused: it must carry the DNS name <job>-workers.<namespace>.svc and be signed by the CA the operator trusts (the chart's workerTls.caConfigMap); workers read it when they start, so after fixing the Secret or the CA start a new run (spec.restartTrigger)"
    } else if refused_token(error) {
        "the run's workers hold another control token than the one the operator derives from its control key (a run started by an operator from before the control key, or the job's token Secret changed by hand); the job restarts from its latest checkpoint, and the new run's workers get the operator's token"
    } else {
        CONTROL_REACH
    }
}

/// Whether the operator has failed to reach worker 0's control endpoint
/// for longer than a worker takes to start listening, and if so why, in
/// words: without it the workers never get their membership, and the run
/// would sit joining until its deadline with no reason in status. The
/// first failed attempt is recorded in `run.coordinatorUnreachableSince`.
fn unreachable_while_joining(cx: &Cx, st: &mut StreamJobStatus, worker0: std::net::IpAddr) -> Option<String> {
    let run = st.run.as_mut()?;
    let since = match (&cx.obs.coordinator, &cx.obs.coordinator_error) {
        (None, Some(_)) => Some(run.coordinator_unreachable_since.as_ref().map(|t| t.0).unwrap_or(cx.now)),
        _ => None,
    };
    run.coordinator_unreachable_since = since.map(Time);
    let since = since?;
    let waited = Duration::try_from(cx.now.duration_since(since)).unwrap_or_default();
    if waited < super::running::COORDINATOR_SILENCE_LIMIT {
        return None;
    }
    let addr = SocketAddr::new(worker0, CONTROL_PORT);
    let at = since.round(jiff::Unit::Second).unwrap_or(since);
    let error = cx.obs.coordinator_error.clone().unwrap_or_default();
    Some(format!("the operator cannot reach worker 0's control endpoint {addr} since {at} ({error}), so the workers get no membership; {}", control_hint(&error)))
}

/// Runs and pods are decided from one spec. A run decided on an older spec
/// whose workers have not started (no membership sent yet) takes the
/// current spec when the operator accepts it: a run whose pods are not
/// created yet is decided again in place (a fixed spec is tried at once,
/// not after a backoff); one whose pods exist is replaced by a run of the
/// current spec, since none of its workers has touched the job's state.
/// Otherwise the run keeps its spec, and the reconciler builds its pods
/// from that spec (the one `run.specHash` names), never from another.
fn take_current_spec(cx: &Cx, st: &mut StreamJobStatus) -> Option<Progress> {
    let held_back = super::rollback::holds(cx, st);
    let run = st.run.as_mut()?;
    if run.spec_hash == cx.spec_hash || cx.validation.is_err() || held_back {
        return None;
    }
    if !run.pods_created {
        run.spec_hash = cx.spec_hash.clone();
        run.generation = cx.job.metadata.generation;
        run.workers = cx.job.spec.parallelism.max(1);
        run.not_before = None;
        return None;
    }
    let finishing = cx.obs.pods.iter().any(|p| p.run.as_deref() == Some(run.id.as_str()) && p.state == crate::observe::PodState::Succeeded);
    if finishing || !matches!(cx.obs.health(run), RunHealth::Starting { .. }) {
        return None;
    }
    let number = run.number;
    let restore = run.restore_from.clone();
    new_run(cx, st, restore, None);
    let generation = cx.job.metadata.generation.map(|g| format!(" (generation {g})")).unwrap_or_default();
    let m = format!("the spec changed{generation} while run {number} was starting: its pods are replaced by run {} of the new spec", number + 1);
    Some(Progress::Waiting(Waiting { effects: vec![Effect::DeleteOtherPods], message: m.clone(), requeue: Duration::from_millis(500), warning: Some(("RunReplaced".into(), m)), degraded: None }))
}

/// The API server refused to create the run's objects (Pod Security
/// admission, a quota, a webhook, an invalid pod template): that is what
/// status and a Warning event say, not that pods went missing. Nothing ran,
/// so nothing is restored and no restart is counted; the objects are created
/// again after `restartBackoff` (doubling, at most its max), or at once when
/// the spec changes.
fn refused(cx: &Cx, run: &mut RunStatus, r: &Rejection, mine: usize) -> Progress {
    let backoff = &cx.job.spec.restart_backoff;
    run.refusals += 1;
    run.pods_created = false;
    let wait = backoff_delay(backoff.initial.get(), backoff.max.get(), run.refusals);
    run.not_before = Some(Time(cx.now.checked_add(wait).unwrap_or(cx.now)));
    run.last_refusal = Some(r.message.clone());
    let m = format!("{}; creating the pods again in {} (or at once when the spec changes)", r.message, human(wait));
    let effects = if mine > 0 { vec![Effect::DeleteAllPods] } else { Vec::new() };
    Progress::Waiting(Waiting {
        effects,
        message: m.clone(),
        requeue: wait,
        warning: Some((r.reason.clone(), m.clone())),
        degraded: Some((r.reason.clone(), m)),
    })
}

/// The Degraded reason while a refused run waits for its next try.
fn refusal_reason(run: &RunStatus) -> &'static str {
    match run.last_refusal.as_deref() {
        Some(m) if m.starts_with(REFUSED_POD) => "PodRejected",
        _ => "RunNotCreated",
    }
}

/// How the message of a refused worker pod starts (see the reconciler).
pub const REFUSED_POD: &str = "the API server refused worker pod";

/// Records a failure and decides the restarted run, with exponential backoff.
/// `Err` when the job restarted `restartBackoff.limit` times in a row without
/// completing a checkpoint: it is Failed then.
pub(super) fn begin_recovery(cx: &Cx, st: &mut StreamJobStatus, reason: &str, message: &str) -> Result<String, String> {
    st.restarts += 1;
    st.restarts_in_a_row += 1;
    st.last_failure = Some(Failure { time: Time(cx.now), reason: reason.into(), message: message.into() });
    let backoff = &cx.job.spec.restart_backoff;
    if st.restarts_in_a_row > backoff.limit {
        return Err(format!(
            "{message}; gave up after {} restarts in a row without a completed checkpoint (spec.restartBackoff.limit {}): fix the cause, then change spec.restartTrigger to start again",
            st.restarts_in_a_row - 1,
            backoff.limit
        ));
    }
    let wait = backoff_delay(backoff.initial.get(), backoff.max.get(), st.restarts_in_a_row);
    let not_before = cx.now.checked_add(wait).unwrap_or(cx.now);
    // The worker the failure names as silent (frozen, cut off, its node
    // lost): its pod will not confirm its deletion soon, and need not.
    // Its node is frozen or lost, and with it every pod of the run there.
    let silent: Vec<String> = (|| {
        let index = weir_api::control::silent_worker(message)?;
        let old = st.run.as_ref()?.id.clone();
        let pods: Vec<&crate::observe::PodView> = cx.obs.pods.iter().filter(|p| p.run.as_deref() == Some(old.as_str())).collect();
        let pod = pods.iter().find(|p| p.index == Some(index))?;
        let mut names: Vec<String> = match &pod.node {
            Some(node) => pods.iter().filter(|p| p.node.as_ref() == Some(node)).map(|p| p.name.clone()).collect(),
            None => vec![pod.name.clone()],
        };
        names.sort();
        Some(names)
    })()
    .unwrap_or_default();
    new_run(cx, st, Some(LATEST.into()), Some(not_before));
    if let Some(run) = st.run.as_mut() {
        run.silent_pods = silent;
    }
    Ok(format!("{message}; restoring the job from the latest completed checkpoint in {} (restart {})", human(wait), st.restarts))
}

/// `initial` doubled for each failure in a row after the first, at most `max`.
pub(super) fn backoff_delay(initial: Duration, max: Duration, in_a_row: i32) -> Duration {
    let doublings = (in_a_row.max(1) - 1).min(30) as u32;
    initial.saturating_mul(1u32 << doublings).min(max)
}

/// When the latest checkpoint in status completed after `run` started, the
/// run made progress: failures before it no longer count as "in a row".
pub(super) fn made_progress(st: &StreamJobStatus) -> bool {
    match (&st.last_checkpoint, &st.run) {
        (Some(c), Some(r)) => c.time.0 > r.started_at.0,
        _ => false,
    }
}

/// Copies the coordinator's latest checkpoint into status; resets the
/// failures-in-a-row count once the run completed a checkpoint.
pub(super) fn record_progress(cx: &Cx, st: &mut StreamJobStatus) {
    let (Some(c), Some(run)) = (&cx.obs.coordinator, &st.run) else { return };
    if c.run_id != run.id {
        return;
    }
    if let Some(chk) = &c.latest_checkpoint {
        let time = jiff::Timestamp::from_millisecond(chk.completed_unix_ms as i64).unwrap_or(cx.now);
        st.last_checkpoint = Some(weir_api::streamjob::CheckpointRef { id: chk.id as i64, path: chk.location.clone(), time: Time(time) });
    }
    if made_progress(st) {
        st.restarts_in_a_row = 0;
    }
}

/// What a run that just came up restored from, in words (for events).
pub(super) fn restored_from(cx: &Cx) -> String {
    match cx.obs.coordinator.as_ref().and_then(|c| c.restored_from.clone()) {
        Some(from) => format!("restored from {from}"),
        None => "no completed checkpoint or savepoint to restore from: started fresh".into(),
    }
}

/// What a state does when its run failed: an error a restart cannot fix fails
/// the job at once; anything else restarts it with backoff, or fails it past
/// the restart limit. Every state that watches a run uses this, so the rule
/// lives in one place.
pub(super) fn after_failure<S>(cx: &Cx, st: &mut StreamJobStatus, reason: &str, message: &str, fatal: bool) -> super::Step
where
    S: super::TransitionTo<super::Recovering> + super::TransitionTo<super::Failed>,
{
    use super::{Failed, Recovering, Step};
    if fatal {
        st.last_failure = Some(Failure { time: Time(cx.now), reason: reason.into(), message: message.into() });
        return Step::to::<S, Failed>().warning(reason, message).message(message);
    }
    match begin_recovery(cx, st, reason, message) {
        Ok(m) => Step::to::<S, Recovering>().warning(reason, m.clone()).message(m).requeue(Duration::ZERO),
        Err(m) => Step::to::<S, Failed>().warning("RestartLimitReached", m.clone()).message(m),
    }
}
