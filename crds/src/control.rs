//! The wire types of a job's HTTP control endpoint, shared by the runtime
//! (which serves it) and the operator and CLI (which call it).
//!
//! Every worker process serves the endpoint. Only the coordinator's host
//! (worker 0) answers for the job (progress, savepoints); before a worker has
//! its membership, it answers `PUT /v1/membership` and health checks only.
//! Every call but `GET /healthz` needs `Authorization: Bearer <token>`, the
//! per-job token the operator keeps in a Secret.
//!
//! Routes:
//! - `GET  /healthz` → `ok` (no token).
//! - `GET  /v1/status` → [`JobStatus`].
//! - `PUT  /v1/membership` with a [`Membership`] → 200 when accepted or when the
//!   same run is already set, 409 when another run was set before, 400 when it
//!   does not fit this worker (e.g. fewer workers than its index).
//! - `POST /v1/savepoints` with an optional [`SavepointRequest`] → 202 with a
//!   [`SavepointOutcome`]. Posting a request id again returns that request's
//!   outcome instead of taking a second savepoint, so a caller that restarted
//!   can ask again safely. 503 while the job is not running yet.
//! - `GET  /v1/savepoints/{request_id}` → [`SavepointOutcome`], 404 when unknown
//!   to this run.
//! - `DELETE /v1/savepoints/{request_id}` cancels that request (see the runtime).
//! - `POST /v1/savepoint-disposals` with a [`SavepointDisposal`] → 200 with a
//!   [`SavepointDisposed`] once the savepoint's directory and what it alone held
//!   outside storage are gone (again: 200, `existed: false`); 400 when the
//!   location is no savepoint of this job, 409 when it is the job's latest
//!   snapshot (a failure restores from it), 503 while the job is not running.
//!
//! Field names are snake_case (these are not Kubernetes objects).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Port of the control endpoint in a worker pod.
pub const CONTROL_PORT: u16 = 6120;
/// Port of a worker pod's data (exchange) listener.
pub const DATA_PORT: u16 = 6121;
/// Port of the coordinator's worker-control listener (worker 0's pod only).
pub const COORDINATOR_PORT: u16 = 6122;

/// Parses a listen address given as `IP:PORT`, `[IPv6]:PORT`, or a bare `IP`
/// (IPv4 or IPv6, bracketed or not), which gets `default_port`.
///
/// A bare IP is what pods can pass: the kubelet expands `$(POD_IP)` to the
/// pod's address, and `$(POD_IP):6120` is no socket address when that is
/// IPv6 (`fd00::5:6120` reads as one IPv6 address). So the operator passes
/// `$(POD_IP)` alone and the port is the standard one.
pub fn parse_listen_addr(text: &str, default_port: u16) -> Result<SocketAddr, String> {
    let t = text.trim();
    if let Ok(addr) = t.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let bare = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(t);
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok(SocketAddr::new(ip, default_port)),
        Err(_) => Err(format!(
            "{text:?} is not an address: expected IP, IP:PORT or [IPv6]:PORT (e.g. 10.0.0.5, 10.0.0.5:{default_port}, fd00::5 or [fd00::5]:{default_port})"
        )),
    }
}

/// Where every process of one run (attempt) of a job listens. Workers learn it
/// from whoever starts them (the local supervisor, or the operator), never from DNS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// Unique per run of the job; names its output files and keeps
    /// connections of an earlier run out.
    pub run_id: String,
    /// The data address of each worker, by index.
    pub workers: Vec<SocketAddr>,
    /// The coordinator's control address (hosted by worker 0).
    pub coordinator: SocketAddr,
    /// The HTTP control endpoint of the job (hosted by worker 0).
    pub api: SocketAddr,
}

impl Membership {
    /// The membership of pods with these IPs (by worker index), using the standard ports.
    pub fn of_pods(run_id: impl Into<String>, pod_ips: &[std::net::IpAddr]) -> Option<Membership> {
        let first = *pod_ips.first()?;
        Some(Membership {
            run_id: run_id.into(),
            workers: pod_ips.iter().map(|ip| SocketAddr::new(*ip, DATA_PORT)).collect(),
            coordinator: SocketAddr::new(first, COORDINATOR_PORT),
            api: SocketAddr::new(first, CONTROL_PORT),
        })
    }

    /// Subtask `subtask` of every stage runs in worker `subtask % workers` (slot sharing).
    pub fn worker_of(&self, subtask: u32) -> u32 {
        subtask % self.workers.len().max(1) as u32
    }
}

/// A completed checkpoint or savepoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStatus {
    pub id: u64,
    /// Where it is stored; a savepoint's location can be given to `--restore`
    /// and to `spec.initialSavepoint` as is.
    pub location: String,
    pub completed_unix_ms: u64,
    pub duration_ms: u64,
}

/// The job as its coordinator sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub job: String,
    pub run_id: String,
    /// awaiting-membership, starting, running, finishing, finished
    pub phase: String,
    pub guarantee: String,
    /// What sets `guarantee` (see `PipelineSpec::guarantee_and_reason`).
    #[serde(default)]
    pub guarantee_reason: String,
    pub parallelism: u32,
    pub records_in: u64,
    pub records_out: u64,
    /// Input lines a source left out under its bad-line policy (`bad_lines:
    /// skip`), counted over the job's life: the count restored with the
    /// checkpoint plus what this run skipped since. Absent from older workers.
    #[serde(default)]
    pub records_skipped: u64,
    /// Records a window dropped because they came after the watermark had
    /// passed their windows' end and allowed lateness, in this run.
    #[serde(default)]
    pub records_late: u64,
    pub latest_checkpoint: Option<CheckpointStatus>,
    pub last_savepoint: Option<CheckpointStatus>,
    pub checkpoint_in_progress: Option<u64>,
    pub checkpoints_completed: u64,
    pub checkpoints_failed: u64,
    pub last_checkpoint_failure: Option<String>,
    /// The checkpoint or savepoint this run started from; `None` for a fresh start.
    pub restored_from: Option<String>,
}

/// Asks the coordinator to dispose of one of its job's savepoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavepointDisposal {
    /// The savepoint's location, as the savepoint's outcome gave it.
    pub location: String,
}

/// A disposal that is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavepointDisposed {
    pub location: String,
    /// False when nothing was left to delete (disposed of before).
    pub existed: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavepointRequest {
    /// Chosen by the caller so that asking again after a restart does not take a
    /// second savepoint. Generated when absent.
    #[serde(default)]
    pub request_id: Option<String>,
    /// Stop-with-savepoint: once the savepoint completes, the coordinator takes
    /// no further checkpoint, so no output is committed after it. The operator
    /// asks for this before an upgrade, a suspension or a deletion, because the
    /// next run restores from this savepoint.
    #[serde(default)]
    pub stop: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SavepointState {
    Pending,
    Completed,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavepointOutcome {
    pub request_id: String,
    pub state: SavepointState,
    /// Set when completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub savepoint: Option<CheckpointStatus>,
    /// Set when failed: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The error body of every non-2xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_of_pods_puts_the_coordinator_and_api_on_worker_zero() {
        let ips: Vec<std::net::IpAddr> = vec!["10.0.0.5".parse().unwrap(), "10.0.0.6".parse().unwrap()];
        let m = Membership::of_pods("run-1", &ips).unwrap();
        assert_eq!(m.workers, vec!["10.0.0.5:6121".parse().unwrap(), "10.0.0.6:6121".parse().unwrap()]);
        assert_eq!(m.coordinator, "10.0.0.5:6122".parse().unwrap());
        assert_eq!(m.api, "10.0.0.5:6120".parse().unwrap());
        assert_eq!(m.worker_of(3), 1);
        assert!(Membership::of_pods("run-1", &[]).is_none());
    }

    #[test]
    fn membership_of_ipv6_pods_brackets_every_address() {
        let ips: Vec<std::net::IpAddr> = vec!["fd00:10::5".parse().unwrap(), "fd00:10::6".parse().unwrap()];
        let m = Membership::of_pods("run-1", &ips).unwrap();
        assert_eq!(m.api.to_string(), "[fd00:10::5]:6120");
        assert_eq!(m.coordinator.to_string(), "[fd00:10::5]:6122");
        assert_eq!(m.workers[1].to_string(), "[fd00:10::6]:6121");
        // What the worker reads back from the JSON the operator sends.
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"[fd00:10::6]:6121\""), "{json}");
        let back: Membership = serde_json::from_str(&json).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn a_listen_address_is_an_ip_with_or_without_a_port_ipv4_and_ipv6() {
        let p = |s| parse_listen_addr(s, CONTROL_PORT);
        assert_eq!(p("10.0.0.5").unwrap(), "10.0.0.5:6120".parse().unwrap());
        assert_eq!(p("10.0.0.5:7000").unwrap(), "10.0.0.5:7000".parse().unwrap());
        assert_eq!(p("0.0.0.0:6120").unwrap(), "0.0.0.0:6120".parse().unwrap());
        // An unbracketed IPv6 address is the whole address, never IP:PORT.
        assert_eq!(p("fd00::5:6120").unwrap(), SocketAddr::new("fd00::5:6120".parse().unwrap(), 6120));
        assert_eq!(p("fd00::5").unwrap(), "[fd00::5]:6120".parse().unwrap());
        assert_eq!(p("[fd00::5]").unwrap(), "[fd00::5]:6120".parse().unwrap());
        assert_eq!(p("[fd00::5]:7000").unwrap(), "[fd00::5]:7000".parse().unwrap());
        assert_eq!(p("::").unwrap(), "[::]:6120".parse().unwrap());
        for bad in ["", "pod-0", "10.0.0.5:", "10.0.0.5:99999", "[10.0.0.5]:1:2", "$(POD_IP):6120"] {
            let e = p(bad).unwrap_err();
            assert!(e.contains("expected IP, IP:PORT or [IPv6]:PORT"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_status_without_records_skipped_reads_as_none_skipped() {
        let st = JobStatus { job: "j".into(), records_skipped: 7, ..Default::default() };
        let mut v = serde_json::to_value(&st).unwrap();
        assert_eq!(v["records_skipped"], 7);
        v.as_object_mut().unwrap().remove("records_skipped");
        let old: JobStatus = serde_json::from_value(v).unwrap();
        assert_eq!(old.records_skipped, 0);
    }

    #[test]
    fn a_savepoint_request_without_an_id_parses() {
        let r: SavepointRequest = serde_json::from_str("{}").unwrap();
        assert_eq!(r.request_id, None);
        let o: SavepointOutcome = serde_json::from_str(r#"{"request_id":"a","state":"pending"}"#).unwrap();
        assert_eq!(o.state, SavepointState::Pending);
    }
}

/// How a run fails when worker `worker` (at `addr`) stopped sending
/// heartbeats for `timeout_secs`: the operator reads the worker index back
/// with [`silent_worker`] to stop waiting for that worker's pod.
pub fn silence_message(worker: u32, addr: &str, timeout_secs: f64) -> String {
    format!("worker {worker} ({addr}) sent nothing for {timeout_secs:.1}s (the heartbeat timeout): it is frozen, cut off, or its node is lost")
}

/// The worker a failure message of [`silence_message`] names.
pub fn silent_worker(message: &str) -> Option<u32> {
    let at = message.find(") sent nothing for ")?;
    let start = message[..at].rfind("worker ")?;
    let rest = &message[start + "worker ".len()..at];
    rest.split(' ').next()?.parse().ok()
}

#[cfg(test)]
mod silence_tests {
    use super::*;

    #[test]
    fn the_silent_worker_is_read_back_from_a_failure_message() {
        let m = silence_message(3, "10.244.1.7:6120", 5.0);
        assert_eq!(silent_worker(&m), Some(3));
        assert_eq!(silent_worker(&format!("Error: run failed: lost the coordinator: {}", silence_message(0, "[fd00::1]:6120", 2.5))), Some(0));
        assert_eq!(silent_worker("worker 2 exited with code 1"), None);
        assert_eq!(silent_worker("worker x (a) sent nothing for 1s"), None);
    }
}
