//! Waiting for a savepoint the operator asked for. The request id is in
//! `status.pendingSavepoint` before the request is sent, so asking again
//! (after a restart, or because the coordinator did not know it yet) can
//! never take a second savepoint.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use weir_api::control::{CheckpointStatus, SavepointState};
use weir_api::streamjob::{PendingSavepoint, SavepointReason, SavepointRef, StreamJobStatus};

use super::{human, Cx, Effect};
use crate::observe::RunHealth;

pub(super) enum Wait {
    Pending { effects: Vec<Effect>, message: String },
    Completed(CheckpointStatus),
    Failed(String),
}

/// Starts a savepoint: records the request before it is sent.
pub(super) fn begin(cx: &Cx, st: &mut StreamJobStatus, reason: SavepointReason) -> Vec<Effect> {
    let request_id = format!("{}-{:?}-{}", st.run.as_ref().map(|r| r.id.as_str()).unwrap_or("none"), reason, cx.now.as_millisecond()).to_lowercase();
    st.pending_savepoint = Some(PendingSavepoint { reason, triggered_at: Time(cx.now), request_id: Some(request_id.clone()) });
    request(cx, st, request_id, reason)
}

fn stops_the_job(reason: SavepointReason) -> bool {
    // An upgrade, suspension or deletion restores from this savepoint (or keeps
    // it as the last word): no checkpoint may commit output after it.
    !matches!(reason, SavepointReason::Trigger | SavepointReason::Periodic)
}

fn request(cx: &Cx, st: &StreamJobStatus, request_id: String, reason: SavepointReason) -> Vec<Effect> {
    match api_of(cx, st) {
        Some(api) => vec![Effect::RequestSavepoint { api, request_id, stop: stops_the_job(reason) }],
        None => Vec::new(),
    }
}

/// The control endpoint of the run's coordinator (worker 0), while every worker runs.
pub(super) fn api_of(cx: &Cx, st: &StreamJobStatus) -> Option<std::net::SocketAddr> {
    let run = st.run.as_ref()?;
    match cx.obs.health(run) {
        RunHealth::Running { ips } => ips.first().map(|ip| std::net::SocketAddr::new(*ip, weir_api::control::CONTROL_PORT)),
        _ => None,
    }
}

/// Where the pending savepoint stands.
pub(super) fn wait(cx: &Cx, st: &StreamJobStatus) -> Wait {
    let Some(pending) = &st.pending_savepoint else {
        return Wait::Failed("no savepoint was requested".into());
    };
    let timeout = cx.job.spec.savepoint_timeout.get();
    let waited = Duration::try_from(cx.now.duration_since(pending.triggered_at.0)).unwrap_or_default();
    match &cx.obs.savepoint {
        Some(Some(o)) if o.state == SavepointState::Completed => match &o.savepoint {
            Some(sp) => return Wait::Completed(sp.clone()),
            None => return Wait::Failed("the coordinator reported completion without a location".into()),
        },
        Some(Some(o)) if o.state == SavepointState::Failed => {
            return Wait::Failed(o.error.clone().unwrap_or_else(|| "the coordinator gave no reason".into()))
        }
        _ => {}
    }
    if waited > timeout {
        return Wait::Failed(format!("not complete after {} (spec.savepointTimeout)", human(timeout)));
    }
    let effects = match (&cx.obs.savepoint, &pending.request_id) {
        // Unknown to the coordinator: not sent yet, or lost with a restart of ours.
        (Some(None), Some(id)) => request(cx, st, id.clone(), pending.reason),
        _ => Vec::new(),
    };
    let message = format!("waiting for the {} savepoint ({} of {})", reason_word(pending.reason), human(waited), human(timeout));
    Wait::Pending { effects, message }
}

/// Gives up on the pending savepoint (failed, timed out, or its stop taken
/// back): clears it, and tells the coordinator, so that a stopping
/// savepoint that completes after all, or did unseen, does not leave the
/// job stopped while it shows Running.
pub(super) fn give_up(cx: &Cx, st: &mut StreamJobStatus) -> Vec<Effect> {
    let Some(pending) = st.pending_savepoint.take() else { return Vec::new() };
    match (api_of(cx, st), pending.request_id) {
        (Some(api), Some(request_id)) => vec![Effect::CancelSavepoint { api, request_id }],
        _ => Vec::new(),
    }
}

/// Records a completed savepoint and clears the pending request.
pub(super) fn record(cx: &Cx, st: &mut StreamJobStatus, sp: &CheckpointStatus) -> String {
    let reason = st.pending_savepoint.take().map(|p| p.reason).unwrap_or(SavepointReason::Trigger);
    let time = jiff::Timestamp::from_millisecond(sp.completed_unix_ms as i64).unwrap_or(cx.now);
    let forgotten = st.record_savepoint(SavepointRef { id: sp.id as i64, path: sp.location.clone(), time: Time(time), reason });
    let mut m = format!("{} savepoint {} complete: {}", reason_word(reason), sp.id, sp.location);
    if !forgotten.is_empty() {
        let paths: Vec<&str> = forgotten.iter().map(|s| s.path.as_str()).collect();
        m.push_str(&format!("; no longer listed (more than {} not disposed of), left in storage: {}", weir_api::streamjob::SAVEPOINT_HISTORY_LIMIT, paths.join(", ")));
    }
    m
}

pub(super) fn reason_word(r: SavepointReason) -> &'static str {
    match r {
        SavepointReason::Trigger => "requested",
        SavepointReason::Upgrade => "upgrade",
        SavepointReason::Suspend => "suspend",
        SavepointReason::Delete => "final",
        SavepointReason::Periodic => "periodic",
    }
}
