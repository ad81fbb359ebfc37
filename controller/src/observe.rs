//! What a reconcile looks at: the job's pods, classified relative to the run
//! its status names, and the coordinator's answers. Classification is pure so
//! that the lifecycle can be tested on hand-made pods.

use std::net::IpAddr;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use weir_api::control::{JobStatus, SavepointOutcome};
use weir_api::streamjob::RunStatus;

use crate::desired::WORKER_CONTAINER;
use crate::names::{RUN_LABEL, WORKER_LABEL};

/// Exit code of a worker for errors a restart cannot fix (bad pipeline,
/// unusable checkpoint); the runtime's `EXIT_FATAL`.
pub const EXIT_FATAL: i32 = 3;

/// Waiting reasons that mean a container will not start without a change.
const START_FAILURES: &[&str] = &["InvalidImageName", "ErrImageNeverPull", "CrashLoopBackOff"];

/// Waiting reasons the kubelet keeps retrying, which often pass by
/// themselves: a registry that did not answer, a Secret or ConfigMap the pod
/// reads that was not there yet or could not be read. A pod waiting for one
/// of these is a failure only once it has waited [`START_GRACE`]; before
/// that, restarting the whole job would cost more than the wait.
const START_TROUBLE: &[&str] = &["ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "CreateContainerError"];

/// How long past its deletion deadline (deletionTimestamp: the request plus
/// the grace period, when a live kubelet kills the container) a pod may
/// still be there before nobody waits for it any more. A pod past that is on
/// a lost or cut-off node, or frozen. Measured on a loaded CI machine,
/// healthy pods took more than 3 s after the request to go, so this counts
/// from the deadline, with a margin. Not waiting is safe because of the run
/// fence in storage, which such a pod can never pass.
pub const ABANDON_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// The kubelet's port, probed on the node of a pod that is being deleted.
pub const KUBELET_PORT: u16 = 10250;

/// How long a worker pod may be stuck on a [`START_TROUBLE`] reason, counted
/// from the pod's creation or, when later, its scheduling, before its run
/// counts as failed.
pub const START_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq)]
pub enum PodState {
    /// Not running yet; the reason when the pod says one (e.g. Unschedulable).
    Pending { reason: Option<String> },
    Running,
    /// Not started, for a reason the kubelet retries (see [`START_TROUBLE`]).
    Stuck { reason: String },
    Succeeded,
    Failed { reason: String, exit_code: Option<i32> },
    /// Being deleted (by someone, or evicted).
    Terminating,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    pub name: String,
    pub run: Option<String>,
    pub index: Option<u32>,
    pub ip: Option<IpAddr>,
    pub state: PodState,
    /// Since when the pod has been trying to start: its creationTimestamp,
    /// or the time it was scheduled when that is later.
    pub created: Option<Timestamp>,
    /// When a live kubelet must have killed it (deletionTimestamp), if it
    /// is being deleted.
    pub deletion_deadline: Option<Timestamp>,
    /// The node it was scheduled to.
    pub node: Option<String>,
    /// The IP of that node (the kubelet's address).
    pub host_ip: Option<IpAddr>,
    /// The scheduler found no node for it (PodScheduled False, Unschedulable).
    pub unschedulable: bool,
    /// The name its worker's certificate carries (`--tls-server-name`), when
    /// the pod was built with `spec.tls`: its control endpoint is HTTPS. From
    /// the pod, not the spec, which may have changed since.
    pub tls_name: Option<String>,
}

impl PodView {
    pub fn of(pod: &Pod) -> PodView {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let status = pod.status.clone().unwrap_or_default();
        let ip = status.pod_ip.as_deref().and_then(|s| s.parse().ok());
        // By name: the kubelet lists container statuses sorted by name, so
        // with a sidecar from the pod template the first may not be the worker.
        let container = status
            .container_statuses
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.name == WORKER_CONTAINER).or(cs.first()))
            .cloned();
        let terminated = container.as_ref().and_then(|c| c.state.as_ref()).and_then(|s| s.terminated.clone());
        let waiting = container.as_ref().and_then(|c| c.state.as_ref()).and_then(|s| s.waiting.clone());
        let state = if pod.metadata.deletion_timestamp.is_some() {
            PodState::Terminating
        } else {
            match status.phase.as_deref() {
                Some("Succeeded") => PodState::Succeeded,
                Some("Failed") => PodState::Failed {
                    reason: terminated
                        .as_ref()
                        .and_then(termination_reason)
                        .or(status.reason.clone())
                        .unwrap_or_else(|| "Failed".into()),
                    exit_code: terminated.as_ref().map(|t| t.exit_code),
                },
                _ => match (&waiting, &terminated) {
                    (Some(w), _) if w.reason.as_deref().is_some_and(|r| START_FAILURES.contains(&r)) => PodState::Failed {
                        reason: w.reason.clone().unwrap_or_default(),
                        exit_code: None,
                    },
                    (Some(w), _) if w.reason.as_deref().is_some_and(|r| START_TROUBLE.contains(&r)) => PodState::Stuck {
                        reason: match &w.message {
                            Some(m) => format!("{}: {m}", w.reason.as_deref().unwrap_or_default()),
                            None => w.reason.clone().unwrap_or_default(),
                        },
                    },
                    // restartPolicy Never: a terminated container ends the pod; the
                    // phase may lag behind the container state.
                    (_, Some(t)) if t.exit_code == 0 => PodState::Succeeded,
                    (_, Some(t)) => PodState::Failed {
                        reason: termination_reason(t).unwrap_or_else(|| "Error".into()),
                        exit_code: Some(t.exit_code),
                    },
                    _ if status.phase.as_deref() == Some("Running") => PodState::Running,
                    _ => PodState::Pending { reason: pending_reason(pod, &status, waiting.as_ref()) },
                },
            }
        };
        PodView {
            name: pod.metadata.name.clone().unwrap_or_default(),
            run: labels.get(RUN_LABEL).cloned(),
            index: labels.get(WORKER_LABEL).and_then(|i| i.parse().ok()),
            ip,
            state,
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            host_ip: status.host_ip.as_deref().and_then(|s| s.parse().ok()),
            tls_name: pod
                .spec
                .as_ref()
                .and_then(|s| s.containers.iter().find(|c| c.name == WORKER_CONTAINER))
                .and_then(|c| c.args.as_ref())
                .and_then(|args| args.iter().position(|a| a == "--tls-server-name").and_then(|i| args.get(i + 1)).cloned()),
            unschedulable: status
                .conditions
                .as_ref()
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))),
            deletion_deadline: pod.metadata.deletion_timestamp.as_ref().map(|t| t.0),
            // A pod that waited to be scheduled (a node being added) has
            // only been trying to start since it was scheduled.
            created: {
                let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
                let scheduled = status
                    .conditions
                    .as_ref()
                    .and_then(|cs| cs.iter().find(|c| c.type_ == "PodScheduled" && c.status == "True"))
                    .and_then(|c| c.last_transition_time.as_ref())
                    .map(|t| t.0);
                created.max(scheduled)
            },
        }
    }
}

/// Why a pod has not started, in the words that help: the scheduler's
/// (an unbound claim, no node with room) while it is not scheduled; once
/// it is, the worker container's waiting reason (`ContainerCreating` while
/// a volume attaches or an image is pulled, whose details only the pod's
/// events carry, so the message says where to look) rather than the
/// `ContainersNotReady` every starting pod has.
fn pending_reason(pod: &Pod, status: &k8s_openapi::api::core::v1::PodStatus, waiting: Option<&k8s_openapi::api::core::v1::ContainerStateWaiting>) -> Option<String> {
    let conditions = status.conditions.as_deref().unwrap_or_default();
    let words = |c: &k8s_openapi::api::core::v1::PodCondition| c.message.clone().or(c.reason.clone());
    let unscheduled = conditions.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False").and_then(words);
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let container = waiting.and_then(|w| {
        let reason = w.reason.as_deref()?;
        Some(match w.message.as_deref().filter(|m| !m.is_empty()) {
            Some(m) => format!("{reason}: {m}"),
            None => format!("{reason} (its events say why: kubectl describe pod {name})"),
        })
    });
    let other = conditions.iter().find(|c| c.status == "False" && c.reason.is_some()).and_then(words);
    unscheduled.or(container).or(other)
}

/// The container's reason, with the worker's own words when it wrote them
/// (a worker writes its error to the termination message before it exits).
fn termination_reason(t: &k8s_openapi::api::core::v1::ContainerStateTerminated) -> Option<String> {
    match (t.reason.as_deref(), t.message.as_deref().map(str::trim).filter(|m| !m.is_empty())) {
        (Some(r), Some(m)) => Some(format!("{r}: {m}")),
        (None, Some(m)) => Some(m.to_string()),
        (r, None) => r.map(String::from),
    }
}

/// How the current run's pods are doing.
#[derive(Debug, Clone, PartialEq)]
pub enum RunHealth {
    /// No pod of the run exists (not created yet).
    NotCreated,
    /// Some pods are not running yet (or have no IP).
    Starting { waiting_for: Option<String> },
    /// Every worker runs and has an IP (by worker index).
    Running { ips: Vec<IpAddr> },
    /// Every worker exited 0: the job finished.
    Finished,
    /// A worker failed, was deleted or is missing.
    Failed { reason: String, message: String, fatal: bool },
}

/// The API server refused to create an object of a run (seen by the
/// reconcile that tried, reported by the next one).
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    /// The run whose objects were refused.
    pub run_id: String,
    /// `PodRejected` (the API server refused a worker pod: admission, quota,
    /// a webhook, an invalid pod), or `RunNotCreated` (any other failure to
    /// create the run's objects).
    pub reason: String,
    /// What was refused and the API server's words.
    pub message: String,
}

/// Everything a reconcile observed.
#[derive(Debug, Clone)]
pub struct Observed {
    pub now: Timestamp,
    pub pods: Vec<PodView>,
    /// The coordinator's answer, when the run's pods run and it answered.
    pub coordinator: Option<JobStatus>,
    /// Why the coordinator did not answer, when it was asked.
    pub coordinator_error: Option<String>,
    /// The outcome of the pending savepoint request: `Some(None)` when the
    /// coordinator does not know the request (not sent yet, or another run).
    pub savepoint: Option<Option<SavepointOutcome>>,
    /// The last attempt to create the objects of the run in status was refused.
    pub rejected: Option<Rejection>,
    /// Pods whose workers a failed run named as silent (`status.run.silentPods`):
    /// abandoned as soon as they are being deleted.
    pub silent: Vec<String>,
    /// Nodes (by IP) of pods being deleted whose kubelet refused or did not
    /// take a TCP connection: killed or cut off, it will not confirm any
    /// deletion, so their pods are abandoned at once.
    pub kubelets_gone: Vec<IpAddr>,
    /// The other jobs' upgrades in flight, and how many may be.
    pub upgrades: crate::lifecycle::UpgradeSlots,
    /// Savepoint disposals this operator carried out (by location) whose
    /// outcome the status does not show yet.
    pub disposals: Vec<(String, DisposalOutcome)>,
}

/// How a savepoint disposal ended.
#[derive(Debug, Clone, PartialEq)]
pub enum DisposalOutcome {
    /// Its directory and what it alone held are gone.
    Disposed,
    /// The coordinator refused it for good (no savepoint of this job).
    Refused(String),
}

impl Observed {
    pub fn at(now: Timestamp) -> Observed {
        Observed { now, pods: Vec::new(), coordinator: None, coordinator_error: None, savepoint: None, rejected: None, silent: Vec::new(), kubelets_gone: Vec::new(), upgrades: Default::default(), disposals: Vec::new() }
    }

    /// Pods that do not belong to `run` (an earlier run, or stray), except
    /// the abandoned ones (see [`Self::abandoned_pods`]).
    pub fn pods_of_other_runs(&self, run: Option<&str>) -> usize {
        self.pods.iter().filter(|p| p.run.as_deref() != run || run.is_none()).filter(|p| !self.is_abandoned(p)).count()
    }

    /// Pods of other runs than `run` still there [`ABANDON_AFTER`] past
    /// their deletion deadline.
    pub fn abandoned_pods(&self, run: Option<&str>) -> Vec<String> {
        let mut names: Vec<String> =
            self.pods.iter().filter(|p| p.run.as_deref() != run || run.is_none()).filter(|p| self.is_abandoned(p)).map(|p| p.name.clone()).collect();
        names.sort();
        names
    }

    /// The nodes of the pods [`Self::abandoned_pods`] names.
    pub fn abandoned_nodes(&self, run: Option<&str>) -> Vec<String> {
        let abandoned = self.abandoned_pods(run);
        let mut nodes: Vec<String> = self.pods.iter().filter(|p| abandoned.contains(&p.name)).filter_map(|p| p.node.clone()).collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// How long the longest-waiting unschedulable pod of `run` has existed.
    pub fn unschedulable_for(&self, run: &str) -> Option<std::time::Duration> {
        self.pods
            .iter()
            .filter(|p| p.run.as_deref() == Some(run) && p.unschedulable)
            .filter_map(|p| p.created.map(|c| std::time::Duration::try_from(self.now.duration_since(c)).unwrap_or_default()))
            .max()
    }

    /// Pods of any run that are not abandoned.
    pub fn live_pods(&self) -> usize {
        self.pods.iter().filter(|p| !self.is_abandoned(p)).count()
    }

    /// Deleted, and either silent (its worker stopped sending heartbeats,
    /// so its kubelet is unlikely to confirm the deletion soon), on a node
    /// whose kubelet is gone, or still there [`ABANDON_AFTER`] past its
    /// deletion deadline.
    fn is_abandoned(&self, pod: &PodView) -> bool {
        pod.state == PodState::Terminating
            && (self.silent.contains(&pod.name)
                || pod.host_ip.is_some_and(|ip| self.kubelets_gone.contains(&ip))
                || pod
                    .deletion_deadline
                    .is_some_and(|t| std::time::Duration::try_from(self.now.duration_since(t)).is_ok_and(|waited| waited >= ABANDON_AFTER)))
    }

    pub fn health(&self, run: &RunStatus) -> RunHealth {
        let mine: Vec<&PodView> = self.pods.iter().filter(|p| p.run.as_deref() == Some(run.id.as_str())).collect();
        if mine.is_empty() && !run.pods_created {
            return RunHealth::NotCreated;
        }
        let workers = run.workers.max(0) as u32;
        let mut ips = Vec::with_capacity(workers as usize);
        let mut waiting_for = None;
        let mut finished = 0;
        for index in 0..workers {
            let Some(pod) = mine.iter().find(|p| p.index == Some(index)) else {
                if run.pods_created {
                    return RunHealth::Failed {
                        reason: "PodMissing".into(),
                        message: format!("worker {index}'s pod is gone (deleted or evicted)"),
                        fatal: false,
                    };
                }
                waiting_for.get_or_insert_with(|| format!("worker {index}'s pod to be created"));
                continue;
            };
            match &pod.state {
                PodState::Failed { reason, exit_code } => {
                    let fatal = *exit_code == Some(EXIT_FATAL);
                    let code = exit_code.map(|c| format!(" with exit code {c}")).unwrap_or_default();
                    let hint = if fatal { " (an error a restart cannot fix: see the pod's log)" } else { "" };
                    return RunHealth::Failed {
                        reason: if fatal { "WorkerFatalError".into() } else { "PodFailed".into() },
                        message: format!("worker {index} (pod {}) failed{code}: {reason}{hint}", pod.name),
                        fatal,
                    };
                }
                PodState::Stuck { reason } => {
                    // A pod of unknown age counts as stuck for too long.
                    // (A creation time after `now`, clock skew, counts as no wait.)
                    let waited = pod.created.map(|c| std::time::Duration::try_from(self.now.duration_since(c)).unwrap_or_default());
                    match waited {
                        Some(w) if w < START_GRACE => {
                            waiting_for.get_or_insert_with(|| format!("pod {}: {reason}", pod.name));
                        }
                        _ => {
                            return RunHealth::Failed {
                                reason: "PodFailed".into(),
                                message: format!("worker {index} (pod {}) could not start within {} s: {reason}", pod.name, START_GRACE.as_secs()),
                                fatal: false,
                            }
                        }
                    }
                }
                PodState::Terminating => {
                    return RunHealth::Failed {
                        reason: "PodDeleted".into(),
                        message: format!("worker {index}'s pod {} is being deleted or evicted", pod.name),
                        fatal: false,
                    }
                }
                PodState::Succeeded => finished += 1,
                PodState::Running => match pod.ip {
                    Some(ip) => ips.push(ip),
                    None => {
                        waiting_for.get_or_insert_with(|| format!("an IP for pod {}", pod.name));
                    }
                },
                PodState::Pending { reason } => {
                    waiting_for.get_or_insert_with(|| match reason {
                        Some(r) => format!("pod {}: {r}", pod.name),
                        None => format!("pod {} to start", pod.name),
                    });
                }
            }
        }
        if workers > 0 && finished == workers {
            RunHealth::Finished
        } else if waiting_for.is_none() && finished == 0 && ips.len() == workers as usize {
            RunHealth::Running { ips }
        } else if finished > 0 && waiting_for.is_none() {
            // Workers finish one after another; the run is done when all are.
            RunHealth::Starting { waiting_for: Some("the remaining workers to finish".into()) }
        } else {
            RunHealth::Starting { waiting_for }
        }
    }
}
