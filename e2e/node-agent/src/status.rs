//! Pod status from the state of its processes: phase, conditions and
//! containerStatuses, as the kubelet reports them. Pure: the pod task keeps
//! the state, this turns it into the `status` of a JSON merge patch.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq)]
pub enum CState {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started: Timestamp,
    },
    Terminated {
        exit_code: i32,
        reason: String,
        started: Timestamp,
        finished: Timestamp,
    },
}

#[derive(Debug, Clone)]
pub struct Ctr {
    pub name: String,
    pub image: String,
    pub image_id: String,
    pub state: CState,
    pub last: Option<CState>,
    pub restart_count: i32,
    pub pid: Option<u32>,
    /// Readiness (probe passed, or no readiness probe); counts only while
    /// running.
    pub ready: bool,
}

impl Ctr {
    pub fn is_ready(&self) -> bool {
        self.ready && matches!(self.state, CState::Running { .. })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            Some("Never") => Self::Never,
            Some("OnFailure") => Self::OnFailure,
            _ => Self::Always,
        }
    }

    pub fn restarts(self, exit_code: i32) -> bool {
        match self {
            Self::Always => true,
            Self::OnFailure => exit_code != 0,
            Self::Never => false,
        }
    }
}

/// The exit reason the kubelet gives.
pub fn exit_reason(code: i32) -> &'static str {
    if code == 0 {
        "Completed"
    } else {
        "Error"
    }
}

/// Pod phase. `config_error` (an unknown image, a missing Secret) fails the
/// pod: there is nothing to retry against on this node.
pub fn phase(
    policy: RestartPolicy,
    ctrs: &[Ctr],
    config_error: bool,
    deleting: bool,
) -> &'static str {
    if config_error {
        return "Failed";
    }
    let terminal: Vec<i32> = ctrs
        .iter()
        .filter_map(|c| match &c.state {
            CState::Terminated { exit_code, .. } if deleting || !policy.restarts(*exit_code) => {
                Some(*exit_code)
            }
            _ => None,
        })
        .collect();
    if !ctrs.is_empty() && terminal.len() == ctrs.len() {
        return if terminal.iter().all(|c| *c == 0) {
            "Succeeded"
        } else {
            "Failed"
        };
    }
    let started = ctrs.iter().any(|c| {
        matches!(c.state, CState::Running { .. })
            || c.last.is_some()
            || matches!(c.state, CState::Terminated { .. })
    });
    if started {
        "Running"
    } else {
        "Pending"
    }
}

fn time(t: Timestamp) -> Time {
    Time(t)
}

fn state(s: &CState) -> ContainerState {
    match s {
        CState::Waiting { reason, message } => ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some(reason.clone()),
                message: message.clone(),
            }),
            ..Default::default()
        },
        CState::Running { started } => ContainerState {
            running: Some(ContainerStateRunning {
                started_at: Some(time(*started)),
            }),
            ..Default::default()
        },
        CState::Terminated {
            exit_code,
            reason,
            started,
            finished,
        } => ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: *exit_code,
                reason: Some(reason.clone()),
                started_at: Some(time(*started)),
                finished_at: Some(time(*finished)),
                ..Default::default()
            }),
            ..Default::default()
        },
    }
}

pub fn container_status(c: &Ctr) -> ContainerStatus {
    let running = matches!(c.state, CState::Running { .. });
    ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone(),
        image_id: c.image_id.clone(),
        container_id: c.pid.map(|p| format!("weir-process://{p}")),
        ready: c.is_ready(),
        started: Some(running),
        restart_count: c.restart_count,
        state: Some(state(&c.state)),
        last_state: Some(c.last.as_ref().map(state).unwrap_or_default()),
        ..Default::default()
    }
}

/// Conditions, keeping a condition's lastTransitionTime while its status
/// does not change.
pub fn conditions(
    prev: &[PodCondition],
    want: &[(&str, bool)],
    now: Timestamp,
) -> Vec<PodCondition> {
    want.iter()
        .map(|(ty, ok)| {
            let status = if *ok { "True" } else { "False" };
            let since = prev
                .iter()
                .find(|c| c.type_ == *ty && c.status == status)
                .and_then(|c| c.last_transition_time.clone())
                .unwrap_or(time(now));
            PodCondition {
                type_: ty.to_string(),
                status: status.into(),
                last_transition_time: Some(since),
                ..Default::default()
            }
        })
        .collect()
}

pub struct StatusInput<'a> {
    pub policy: RestartPolicy,
    pub ctrs: &'a [Ctr],
    /// Reason and message of an error that fails the pod (ErrImagePull...).
    pub error: Option<(&'a str, &'a str)>,
    pub deleting: bool,
    pub pod_ip: &'a str,
    pub host_ip: &'a str,
    pub start_time: Timestamp,
    pub prev_conditions: &'a [PodCondition],
    pub now: Timestamp,
}

/// The `status` object of a JSON merge patch of pods/status. Lists replace
/// the old ones whole; reason/message are nulled when there is no error.
pub fn build_status(i: &StatusInput) -> Value {
    let phase = phase(i.policy, i.ctrs, i.error.is_some(), i.deleting);
    let ready = !i.ctrs.is_empty() && i.ctrs.iter().all(Ctr::is_ready) && !i.deleting;
    let conds = conditions(
        i.prev_conditions,
        &[
            ("PodReadyToStartContainers", true),
            ("Initialized", true),
            ("Ready", ready),
            ("ContainersReady", ready),
            ("PodScheduled", true),
        ],
        i.now,
    );
    let statuses: Vec<ContainerStatus> = i.ctrs.iter().map(container_status).collect();
    json!({
        "phase": phase,
        "reason": i.error.map(|e| e.0),
        "message": i.error.map(|e| e.1),
        "conditions": conds,
        "containerStatuses": statuses,
        "podIP": i.pod_ip,
        "podIPs": [{"ip": i.pod_ip}],
        "hostIP": i.host_ip,
        "hostIPs": [{"ip": i.host_ip}],
        "startTime": time(i.start_time),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn ctr(state: CState) -> Ctr {
        Ctr {
            name: "main".into(),
            image: "weir".into(),
            image_id: "/bin/weir".into(),
            state,
            last: None,
            restart_count: 0,
            pid: None,
            ready: true,
        }
    }

    fn term(code: i32) -> CState {
        CState::Terminated {
            exit_code: code,
            reason: exit_reason(code).into(),
            started: ts(0),
            finished: ts(5),
        }
    }

    fn waiting() -> CState {
        CState::Waiting {
            reason: "ContainerCreating".into(),
            message: None,
        }
    }

    #[test]
    fn phases() {
        use RestartPolicy::*;
        let running = ctr(CState::Running { started: ts(0) });
        assert_eq!(phase(Always, &[ctr(waiting())], false, false), "Pending");
        assert_eq!(
            phase(Always, std::slice::from_ref(&running), false, false),
            "Running"
        );
        assert_eq!(phase(Never, &[ctr(term(0))], false, false), "Succeeded");
        assert_eq!(phase(Never, &[ctr(term(3))], false, false), "Failed");
        assert_eq!(phase(OnFailure, &[ctr(term(0))], false, false), "Succeeded");
        // Restarting: still Running.
        assert_eq!(phase(OnFailure, &[ctr(term(1))], false, false), "Running");
        assert_eq!(phase(Always, &[ctr(term(0))], false, false), "Running");
        let mut backoff = ctr(CState::Waiting {
            reason: "CrashLoopBackOff".into(),
            message: None,
        });
        backoff.last = Some(term(1));
        assert_eq!(phase(Always, &[backoff], false, false), "Running");
        // Mixed: one still runs.
        assert_eq!(
            phase(Never, &[ctr(term(0)), running], false, false),
            "Running"
        );
        assert_eq!(phase(Always, &[ctr(waiting())], true, false), "Failed");
        // Deleted pods do not restart: Always + exit 0 is terminal then.
        assert_eq!(phase(Always, &[ctr(term(0))], false, true), "Succeeded");
        assert_eq!(phase(Always, &[ctr(term(137))], false, true), "Failed");
    }

    #[test]
    fn restart_policy() {
        assert!(RestartPolicy::parse(None).restarts(0));
        assert!(RestartPolicy::parse(Some("OnFailure")).restarts(1));
        assert!(!RestartPolicy::parse(Some("OnFailure")).restarts(0));
        assert!(!RestartPolicy::parse(Some("Never")).restarts(1));
    }

    #[test]
    fn running_pod_status() {
        let mut c = ctr(CState::Running { started: ts(10) });
        c.restart_count = 2;
        c.last = Some(term(1));
        c.pid = Some(42);
        let s = build_status(&StatusInput {
            policy: RestartPolicy::Always,
            ctrs: &[c],
            error: None,
            deleting: false,
            pod_ip: "127.0.1.1",
            host_ip: "127.0.0.1",
            start_time: ts(0),
            prev_conditions: &[],
            now: ts(20),
        });
        assert_eq!(s["phase"], "Running");
        assert_eq!(s["podIP"], "127.0.1.1");
        assert_eq!(s["podIPs"][0]["ip"], "127.0.1.1");
        assert_eq!(s["hostIP"], "127.0.0.1");
        assert!(s["reason"].is_null());
        assert_eq!(s["startTime"], "2027-01-15T08:00:00Z");
        let cs = &s["containerStatuses"][0];
        assert_eq!(cs["name"], "main");
        assert_eq!(cs["ready"], true);
        assert_eq!(cs["started"], true);
        assert_eq!(cs["restartCount"], 2);
        assert_eq!(cs["containerID"], "weir-process://42");
        assert!(cs["state"]["running"]["startedAt"].is_string());
        assert_eq!(cs["lastState"]["terminated"]["exitCode"], 1);
        let conds = s["conditions"].as_array().unwrap();
        for ty in ["PodScheduled", "Initialized", "ContainersReady", "Ready"] {
            let c = conds.iter().find(|c| c["type"] == ty).unwrap();
            assert_eq!(c["status"], "True", "{ty}");
        }
    }

    #[test]
    fn not_ready_until_the_probe_passes() {
        let mut c = ctr(CState::Running { started: ts(0) });
        c.ready = false;
        let input = |c: &[Ctr]| {
            build_status(&StatusInput {
                policy: RestartPolicy::Always,
                ctrs: c,
                error: None,
                deleting: false,
                pod_ip: "127.0.1.1",
                host_ip: "127.0.0.1",
                start_time: ts(0),
                prev_conditions: &[],
                now: ts(1),
            })
        };
        let s = input(std::slice::from_ref(&c));
        assert_eq!(s["phase"], "Running");
        assert_eq!(s["containerStatuses"][0]["ready"], false);
        assert_eq!(s["containerStatuses"][0]["started"], true);
        assert!(s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["type"] == "Ready" && x["status"] == "False"));
        c.ready = true;
        let s = input(&[c]);
        assert!(s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["type"] == "Ready" && x["status"] == "True"));
    }

    #[test]
    fn image_error_fails_the_pod() {
        let c = ctr(CState::Waiting {
            reason: "ErrImagePull".into(),
            message: Some("no".into()),
        });
        let s = build_status(&StatusInput {
            policy: RestartPolicy::Always,
            ctrs: &[c],
            error: Some(("ErrImagePull", "image nginx is not available")),
            deleting: false,
            pod_ip: "127.0.1.1",
            host_ip: "127.0.0.1",
            start_time: ts(0),
            prev_conditions: &[],
            now: ts(0),
        });
        assert_eq!(s["phase"], "Failed");
        assert_eq!(s["reason"], "ErrImagePull");
        assert_eq!(
            s["containerStatuses"][0]["state"]["waiting"]["reason"],
            "ErrImagePull"
        );
        assert_eq!(s["containerStatuses"][0]["ready"], false);
        let ready = s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()
            .clone();
        assert_eq!(ready["status"], "False");
    }

    #[test]
    fn transition_time_kept_while_status_unchanged() {
        let first = conditions(&[], &[("Ready", true)], ts(0));
        let again = conditions(&first, &[("Ready", true)], ts(50));
        assert_eq!(again[0].last_transition_time, Some(Time(ts(0))));
        let flipped = conditions(&again, &[("Ready", false)], ts(60));
        assert_eq!(flipped[0].last_transition_time, Some(Time(ts(60))));
    }
}
