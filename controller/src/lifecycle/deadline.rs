//! `spec.deployTimeout`: a run that does not come up (pods unschedulable,
//! a volume claim that never binds, an image that never arrives, workers
//! the operator cannot reach) fails the job by a deadline instead of
//! waiting forever, and until then status says what it waits for and when
//! the deadline is.

use std::time::Duration;

use jiff::Timestamp;
use weir_api::streamjob::RunStatus;

use super::run::Progress;
use super::Cx;

/// The reason of the failure and of the Degraded condition.
pub const DEPLOY_TIMEOUT: &str = "DeployTimeout";

/// When `run` must be up: `timeout` after its pods were created. Before
/// that the operator itself holds the run (a backoff, the previous run's
/// pods going away, an operator that was down), which is no deploy time.
pub(super) fn deadline(run: &RunStatus, timeout: Duration) -> Option<Timestamp> {
    let from = run.pods_created_at.as_ref().filter(|_| run.pods_created)?.0;
    Some(from.checked_add(timeout).unwrap_or(from))
}

/// Bounds a run that is still waiting: past its deadline it is a failure a
/// restart does not fix (the job is Failed, its pods deleted, and a new
/// generation or restartTrigger starts it again); before it, the message
/// names the deadline and the next look comes no later than it.
pub(super) fn bound(cx: &Cx, run: Option<&RunStatus>, progress: Progress) -> Progress {
    let Some(run) = run else { return progress };
    let Progress::Waiting(mut w) = progress else { return progress };
    let written = cx.job.spec.deploy_timeout;
    let timeout = written.get();
    let Some(at) = deadline(run, timeout) else { return Progress::Waiting(w) };
    if cx.now >= at {
        return Progress::Failed {
            reason: DEPLOY_TIMEOUT.into(),
            message: format!(
                "run {} did not come up within spec.deployTimeout ({written}): {}; its pods are deleted; fix the cause, then change the spec or spec.restartTrigger to deploy again",
                run.number,
                w.message
            ),
            fatal: true,
        };
    }
    // A time, not a countdown: the status must not change at every reconcile.
    let shown = at.round(jiff::Unit::Second).unwrap_or(at);
    w.message = format!("{}; deadline {shown} (spec.deployTimeout {written})", w.message);
    let left = Duration::try_from(at.duration_since(cx.now)).unwrap_or_default();
    w.requeue = w.requeue.min(left.max(Duration::from_millis(100)));
    Progress::Waiting(w)
}
