//! `spec.savepoints`: when a running job takes its next periodic
//! savepoint, which savepoints it no longer keeps, and the bookkeeping of
//! their disposal.
//!
//! A savepoint leaves `status.savepointHistory` only once the job's
//! coordinator said it disposed of it (directory and what it alone held
//! outside storage): until then it is listed, and asked for again on the
//! next reconcile, so an operator restarted in between loses nothing. The
//! decisions here are pure; the reconciler carries out the
//! [`Effect::DisposeSavepoint`]s and reports their outcomes back through
//! [`crate::observe::Observed::disposals`].

use std::time::Duration;

use weir_api::streamjob::{RunStatus, SavepointRef, StreamJobStatus};

use super::{human, Cx, Effect, Note};
use crate::observe::DisposalOutcome;

/// At most this many disposals are asked for per reconcile: each deletes a
/// whole directory (one request per object on S3) while the job's
/// reconcile waits, and a lowered maxCount must neither flood the
/// coordinator nor hold up the job's failure detection.
const DISPOSALS_PER_RECONCILE: usize = 2;

/// Whether the periodic savepoint is due: `spec.savepoints.interval` after
/// the latest savepoint, the run's start or a failed savepoint, whichever
/// is latest (a failing savepoint is tried again an interval later, not at
/// every reconcile).
pub(super) fn periodic_due(cx: &Cx, st: &StreamJobStatus, run: &RunStatus) -> bool {
    let Some(interval) = cx.job.spec.savepoints.interval else { return false };
    if st.pending_savepoint.is_some() {
        return false;
    }
    let failed = st.last_failure.as_ref().filter(|f| f.reason == "SavepointFailed").map(|f| f.time.0);
    let since = [st.last_savepoint.as_ref().map(|s| s.time.0), Some(run.started_at.0), failed].into_iter().flatten().max().unwrap_or(run.started_at.0);
    Duration::try_from(cx.now.duration_since(since)).is_ok_and(|waited| waited >= interval.get())
}

/// The savepoints `spec.savepoints` no longer keeps, oldest first: beyond
/// the newest `maxCount`, or older than `maxAge`. Never the newest one,
/// nor one a run or rollback restores from.
pub(super) fn expired<'a>(cx: &Cx, st: &'a StreamJobStatus) -> Vec<&'a SavepointRef> {
    let settings = &cx.job.spec.savepoints;
    let mut by_age: Vec<&SavepointRef> = st.savepoint_history.iter().collect();
    by_age.sort_by_key(|s| (s.time.0, s.id));
    let Some(newest) = by_age.last().map(|s| s.path.clone()) else { return Vec::new() };
    let beyond_count = by_age.len().saturating_sub(settings.max_count.max(1) as usize);
    let protected = |path: &str| {
        path == newest
            || st.run.as_ref().and_then(|r| r.restore_from.as_deref()) == Some(path)
            || st.upgrade_trial.as_ref().and_then(|t| t.savepoint.as_deref()) == Some(path)
            || st.rollback.as_ref().and_then(|r| r.restore_from.as_deref()) == Some(path)
    };
    by_age
        .into_iter()
        .enumerate()
        .filter(|(i, s)| {
            let too_old = settings
                .max_age
                .is_some_and(|age| Duration::try_from(cx.now.duration_since(s.time.0)).is_ok_and(|a| a > age.get()));
            *i < beyond_count || too_old
        })
        .map(|(_, s)| s)
        .filter(|s| !protected(&s.path))
        .collect()
}

/// The disposals to ask the coordinator at `api` for.
pub(super) fn disposals(cx: &Cx, st: &StreamJobStatus, api: std::net::SocketAddr) -> Vec<Effect> {
    expired(cx, st).into_iter().take(DISPOSALS_PER_RECONCILE).map(|s| Effect::DisposeSavepoint { api, location: s.path.clone() }).collect()
}

/// Takes the savepoints whose disposal ended out of the history, with an
/// event each. A savepoint the coordinator refused as none of the job's
/// (its storage changed since) leaves the list too, with a warning: it
/// stays where it is, for the user.
pub(super) fn forget_disposed(cx: &Cx, st: &mut StreamJobStatus) -> Vec<Note> {
    let mut notes = Vec::new();
    st.savepoint_history.retain(|s| match cx.obs.disposals.iter().find(|(path, _)| *path == s.path) {
        Some((_, DisposalOutcome::Disposed)) => {
            let m = format!("savepoint {} ({}) disposed of: spec.savepoints keeps {}", s.id, s.path, kept(cx));
            notes.push(Note { warning: false, reason: "SavepointDisposed".into(), message: m });
            false
        }
        Some((_, DisposalOutcome::Refused(why))) => {
            let m = format!("savepoint {} ({}) is no longer listed and was not deleted: {why}", s.id, s.path);
            notes.push(Note { warning: true, reason: "SavepointNotDisposed".into(), message: m });
            false
        }
        None => true,
    });
    notes
}

fn kept(cx: &Cx) -> String {
    let s = &cx.job.spec.savepoints;
    match s.max_age {
        Some(age) => format!("the newest {} for at most {}", s.max_count, human(age.get())),
        None => format!("the newest {}", s.max_count),
    }
}
