//! Turns a state's [`Step`] into the status to write: the phase and when it
//! changed, conditions, the message, and the transition event. Every
//! condition judges `metadata.generation`; `readiness` decides `Ready`.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use weir_api::streamjob::{condition_types, Phase, StreamJobStatus};

use super::{readiness, Cx, Decision, Note, Step};

pub(super) fn finish(cx: &Cx, mut st: StreamJobStatus, before: Option<Phase>, step: Step) -> Decision {
    let now = cx.now;
    let next = step.next.or(before);
    let mut notes = step.notes;
    let mut transition = None;
    if next != before {
        if let Some(to) = next {
            let spent = st
                .phase_since
                .as_ref()
                .map(|t| Duration::try_from(now.duration_since(t.0)).unwrap_or_default())
                .unwrap_or_default();
            transition = Some((before, to, spent));
            st.phase_since = Some(Time(now));
            // The first note of a transition step says why; it becomes the event.
            if notes.is_empty() {
                notes.push(Note { warning: to == Phase::Failed, reason: format!("{to:?}"), message: step.message.clone().unwrap_or_default() });
            }
        }
    }
    st.phase = next;
    if next == Some(Phase::Failed) && before != Some(Phase::Failed) {
        // What a newer generation is compared with: only a change made after
        // the failure starts the job again (the Failed state).
        st.failed_generation = cx.job.metadata.generation;
    }
    if let Some(m) = step.message {
        st.message = Some(m);
    }
    if let Ok(v) = &cx.validation {
        st.guarantee = Some(v.guarantee);
        st.guarantee_reason = Some(v.reason.clone());
        st.guarantee_decided_by = v.decided_by.clone();
    }
    // The status judges the generation just read: kubectl wait and Argo CD
    // take a condition at an older observedGeneration as not yet judged.
    st.observed_generation = cx.job.metadata.generation;
    let generation = st.observed_generation;
    readiness::record_deployed(cx, &mut st, next);
    let phase = next.map(|p| format!("{p:?}")).unwrap_or_else(|| "Created".into());
    let message = st.message.clone().unwrap_or_default();
    let degraded = match (step.degraded, next, &cx.validation) {
        (Some(d), _, _) => Some(d),
        (None, Some(Phase::Failed), _) => {
            let reason = st.last_failure.as_ref().map(|f| f.reason.clone()).unwrap_or_else(|| "Failed".into());
            Some((reason, message.clone()))
        }
        (None, Some(Phase::RollingBack), _) => {
            let reason = st.rollback.as_ref().map(|r| r.reason.clone()).unwrap_or_else(|| "RollingBack".into());
            Some((reason, message.clone()))
        }
        // A refused generation needs attention in every phase, also while
        // the previous spec keeps running or a run of it is starting.
        (None, _, Err(why)) => Some((why.reason.to_string(), format!("spec not applied: {why}"))),
        _ => None,
    };
    let ready = readiness::judge(cx, &st, next, degraded.as_ref());
    set_condition(&mut st.conditions, condition_types::READY, ready.ready, &ready.reason, &ready.message, generation, now);
    let progressing = matches!(
        next,
        Some(Phase::Deploying | Phase::Savepointing | Phase::Upgrading | Phase::RollingBack | Phase::Recovering | Phase::Suspending | Phase::Deleting)
    );
    set_condition(&mut st.conditions, condition_types::PROGRESSING, progressing, &phase, &message, generation, now);
    match &degraded {
        Some((reason, m)) => set_condition(&mut st.conditions, condition_types::DEGRADED, true, reason, m, generation, now),
        None => set_condition(&mut st.conditions, condition_types::DEGRADED, false, "Healthy", "", generation, now),
    }
    Decision { status: st, effects: step.effects, notes, requeue: step.requeue, transition }
}

/// Sets a condition; `lastTransitionTime` moves only when the status flips.
fn set_condition(conds: &mut Vec<Condition>, type_: &str, on: bool, reason: &str, message: &str, generation: Option<i64>, now: Timestamp) {
    let status = if on { "True" } else { "False" }.to_string();
    let reason = reason_token(reason);
    match conds.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(now);
                c.status = status;
            }
            c.reason = reason;
            c.message = message.to_string();
            c.observed_generation = generation;
        }
        None => conds.push(Condition {
            type_: type_.to_string(),
            status,
            reason,
            message: message.to_string(),
            last_transition_time: Time(now),
            observed_generation: generation,
        }),
    }
}

/// Condition reasons must be CamelCase tokens.
fn reason_token(reason: &str) -> String {
    let token: String = reason.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    if token.is_empty() || !token.starts_with(|c: char| c.is_ascii_alphabetic()) {
        "Unknown".into()
    } else {
        token
    }
}
