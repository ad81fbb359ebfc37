//! The control router over real HTTP on loopback, with the client the CLI uses.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc;
use weir_api::control::{ErrorBody, Membership, SavepointOutcome, SavepointState};

use super::*;

const TOKEN: &str = "s3cret";

async fn start(control: Control) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, control));
    addr
}

fn worker(index: u32) -> Control {
    Control::new(TOKEN.into(), index, 2, JobStatus { job: "j".into(), phase: "awaiting-membership".into(), ..Default::default() })
}

async fn req(addr: SocketAddr, method: &str, path: &str, token: &str, body: Option<&str>) -> (u16, String) {
    call(addr, method, path, token, body.map(str::as_bytes), Duration::from_secs(5)).await.unwrap()
}

fn membership(run_id: &str, workers: usize) -> Membership {
    let ips: Vec<std::net::IpAddr> = (0..workers).map(|i| format!("10.0.0.{}", i + 1).parse().unwrap()).collect();
    Membership::of_pods(run_id, &ips).unwrap()
}

fn json(m: &Membership) -> String {
    serde_json::to_string(m).unwrap()
}

fn error_of(body: &str) -> String {
    serde_json::from_str::<ErrorBody>(body).unwrap_or_else(|e| panic!("not an ErrorBody ({e}): {body}")).error
}

#[tokio::test]
async fn every_route_but_healthz_needs_the_token() {
    let control = worker(0);
    let addr = start(control.clone()).await;
    assert_eq!(req(addr, "GET", "/healthz", "", None).await, (200, "ok".into()));
    for (method, path, body) in [
        ("GET", "/v1/status", None),
        ("PUT", "/v1/membership", Some(json(&membership("r", 2)))),
        ("POST", "/v1/savepoints", None),
        ("GET", "/v1/savepoints/x", None),
        ("GET", "/v1/nothing-here", None),
    ] {
        for token in ["", "wrong", "s3cre", "s3cret2"] {
            let (code, answer) = req(addr, method, path, token, body.as_deref()).await;
            assert_eq!(code, 401, "{method} {path} with token {token:?}: {answer}");
            assert!(error_of(&answer).contains("bearer token"));
        }
    }
    let (code, answer) = req(addr, "GET", "/v1/status", TOKEN, None).await;
    assert_eq!(code, 200);
    let st: JobStatus = serde_json::from_str(&answer).unwrap();
    assert_eq!(st.phase, "awaiting-membership");
    assert_eq!(req(addr, "GET", "/v1/nothing-here", TOKEN, None).await.0, 404);
    // The refused PUTs set nothing.
    assert!(tokio::time::timeout(Duration::from_millis(50), control.membership()).await.is_err());
}

#[tokio::test]
async fn an_empty_token_lets_nobody_in() {
    let addr = start(Control::new(String::new(), 0, 1, JobStatus::default())).await;
    assert_eq!(req(addr, "GET", "/v1/status", "", None).await.0, 401);
}

#[tokio::test]
async fn a_membership_is_accepted_once_and_then_only_the_same_one() {
    let control = worker(1);
    let addr = start(control.clone()).await;
    let first = membership("run-a", 2);
    let (code, answer) = req(addr, "PUT", "/v1/membership", TOKEN, Some(&json(&first))).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(tokio::time::timeout(Duration::from_secs(1), control.membership()).await.unwrap(), first);
    // The operator may send it again (it restarted, or lost the answer).
    assert_eq!(req(addr, "PUT", "/v1/membership", TOKEN, Some(&json(&first))).await.0, 200);

    let (code, answer) = req(addr, "PUT", "/v1/membership", TOKEN, Some(&json(&membership("run-b", 2)))).await;
    assert_eq!(code, 409);
    let e = error_of(&answer);
    assert!(e.contains("run-a") && e.contains("run-b"), "{e}");
    // Same run, other addresses: still another membership.
    let mut moved = first.clone();
    moved.coordinator = "10.9.9.9:6122".parse().unwrap();
    assert_eq!(req(addr, "PUT", "/v1/membership", TOKEN, Some(&json(&moved))).await.0, 409);
    assert_eq!(control.membership().await, first);
}

#[tokio::test]
async fn a_membership_that_does_not_fit_is_refused_with_400() {
    let control = worker(1);
    let addr = start(control.clone()).await;
    let mut empty = membership("r", 1);
    empty.workers.clear();
    let mut slash = membership("r", 2);
    slash.run_id = "../../etc".into();
    for (body, expect) in [
        (json(&membership("r", 1)), "worker 1 but the membership has 1 worker"),
        (json(&empty), "no workers"),
        (json(&membership("r", 3)), "parallelism is 2"),
        (json(&slash), "run_id"),
        ("{\"run_id\": 5}".to_string(), "expected a membership"),
        (String::new(), "expected a membership"),
    ] {
        let (code, answer) = req(addr, "PUT", "/v1/membership", TOKEN, Some(&body)).await;
        assert_eq!(code, 400, "{body}: {answer}");
        assert!(error_of(&answer).contains(expect), "{body}: {answer}");
    }
    // None of them was taken: a fitting one still is, of the expected run only.
    control.expect_run("r".into());
    let (code, answer) = req(addr, "PUT", "/v1/membership", TOKEN, Some(&json(&membership("other-run", 2)))).await;
    assert_eq!(code, 400);
    assert!(error_of(&answer).contains("started for run `r`, not run `other-run`"), "{answer}");
    assert_eq!(req(addr, "PUT", "/v1/membership", TOKEN, Some(&json(&membership("r", 2)))).await.0, 200);
}

#[tokio::test]
async fn the_same_savepoint_request_id_takes_one_savepoint() {
    let control = worker(0);
    let addr = start(control.clone()).await;
    let (code, answer) = req(addr, "POST", "/v1/savepoints", TOKEN, None).await;
    assert_eq!((code, error_of(&answer).as_str()), (503, "the job is not running yet"));

    let (tx, mut rx) = mpsc::channel(16);
    control.serve_savepoints(tx);
    let body = r#"{"request_id": "op-1"}"#;
    for _ in 0..3 {
        let (code, answer) = req(addr, "POST", "/v1/savepoints", TOKEN, Some(body)).await;
        assert_eq!(code, 202, "{answer}");
        let o: SavepointOutcome = serde_json::from_str(&answer).unwrap();
        assert_eq!((o.request_id.as_str(), o.state), ("op-1", SavepointState::Pending));
    }
    assert!(matches!(rx.try_recv(), Ok(ApiRequest::Savepoint { request_id, stop: false }) if request_id == "op-1"));
    assert!(rx.try_recv().is_err(), "a second savepoint was queued for the same request id");

    let sp = CheckpointStatus { id: 4, location: "/state/j/savepoints/sp-4-1".into(), completed_unix_ms: 1, duration_ms: 2 };
    control.savepoint_book().complete("op-1", sp.clone());
    let (code, answer) = req(addr, "GET", "/v1/savepoints/op-1", TOKEN, None).await;
    assert_eq!(code, 200);
    let o: SavepointOutcome = serde_json::from_str(&answer).unwrap();
    assert_eq!((o.state, o.savepoint), (SavepointState::Completed, Some(sp)));
    let (code, answer) = req(addr, "POST", "/v1/savepoints", TOKEN, Some(body)).await;
    assert_eq!(code, 202);
    assert_eq!(serde_json::from_str::<SavepointOutcome>(&answer).unwrap().state, SavepointState::Completed);
    assert!(rx.try_recv().is_err());

    // Without an id, one is made up and returned.
    let (code, answer) = req(addr, "POST", "/v1/savepoints", TOKEN, Some("{}")).await;
    assert_eq!(code, 202);
    let generated = serde_json::from_str::<SavepointOutcome>(&answer).unwrap().request_id;
    assert!(matches!(rx.try_recv(), Ok(ApiRequest::Savepoint { request_id, stop: false }) if request_id == generated));
    control.savepoint_book().fail(&generated, "declined by worker 1: boom");
    let (_, answer) = req(addr, "GET", &format!("/v1/savepoints/{generated}"), TOKEN, None).await;
    let o: SavepointOutcome = serde_json::from_str(&answer).unwrap();
    assert_eq!((o.state, o.error.as_deref()), (SavepointState::Failed, Some("declined by worker 1: boom")));

    // A stopping savepoint is passed on as such.
    let (code, _) = req(addr, "POST", "/v1/savepoints", TOKEN, Some(r#"{"request_id": "upgrade-1", "stop": true}"#)).await;
    assert_eq!(code, 202);
    assert!(matches!(rx.try_recv(), Ok(ApiRequest::Savepoint { request_id, stop: true }) if request_id == "upgrade-1"));

    let (code, answer) = req(addr, "POST", "/v1/savepoints", TOKEN, Some(r#"{"request_id": "a b/c"}"#)).await;
    assert_eq!(code, 400, "{answer}");
}

#[tokio::test]
async fn an_unknown_savepoint_request_is_404() {
    let control = worker(0);
    let (tx, _rx) = mpsc::channel(1);
    control.serve_savepoints(tx);
    let addr = start(control).await;
    let (code, answer) = req(addr, "GET", "/v1/savepoints/never-asked", TOKEN, None).await;
    assert_eq!(code, 404);
    assert!(error_of(&answer).contains("never-asked"));
}

#[tokio::test]
async fn a_cancelled_savepoint_request_reaches_the_coordinator_and_an_unknown_one_is_404() {
    let control = worker(0);
    let (tx, mut rx) = mpsc::channel(4);
    control.serve_savepoints(tx);
    let addr = start(control.clone()).await;
    let (code, answer) = req(addr, "DELETE", "/v1/savepoints/never-asked", TOKEN, None).await;
    assert_eq!(code, 404, "{answer}");
    assert_eq!(req(addr, "POST", "/v1/savepoints", TOKEN, Some(r#"{"request_id": "suspend-1", "stop": true}"#)).await.0, 202);
    assert!(matches!(rx.recv().await, Some(ApiRequest::Savepoint { stop: true, .. })));
    // The coordinator abandons it and answers.
    let book = control.savepoint_book();
    let coordinator = tokio::spawn(async move {
        match rx.recv().await {
            Some(ApiRequest::Cancel { request_id, done }) => {
                book.fail(&request_id, "cancelled by its requester; the job goes on");
                let _ = done.send(());
                request_id
            }
            _ => String::new(),
        }
    });
    let (code, answer) = req(addr, "DELETE", "/v1/savepoints/suspend-1", TOKEN, None).await;
    assert_eq!(coordinator.await.unwrap(), "suspend-1");
    assert_eq!(code, 200, "{answer}");
    let o: SavepointOutcome = serde_json::from_str(&answer).unwrap();
    assert_eq!((o.state, o.error.as_deref()), (SavepointState::Failed, Some("cancelled by its requester; the job goes on")));
}

#[tokio::test]
async fn a_savepoint_request_to_a_stopped_coordinator_fails_instead_of_hanging() {
    let control = worker(0);
    let (tx, rx) = mpsc::channel(1);
    control.serve_savepoints(tx);
    drop(rx);
    let addr = start(control).await;
    let (code, answer) = req(addr, "POST", "/v1/savepoints", TOKEN, Some(r#"{"request_id":"late"}"#)).await;
    assert_eq!(code, 202);
    assert_eq!(serde_json::from_str::<SavepointOutcome>(&answer).unwrap().state, SavepointState::Failed);
}

#[tokio::test]
async fn workers_other_than_zero_point_savepoint_callers_at_worker_zero() {
    let control = worker(1);
    control.savepoints_elsewhere("10.0.0.1:6120".parse().unwrap());
    let addr = start(control).await;
    for (method, path) in [("POST", "/v1/savepoints"), ("GET", "/v1/savepoints/x")] {
        let (code, answer) = req(addr, method, path, TOKEN, None).await;
        assert_eq!(code, 503);
        assert_eq!(error_of(&answer), "savepoints are served by worker 0 at 10.0.0.1:6120");
    }
}

#[tokio::test]
async fn a_savepoint_is_disposed_of_once_the_run_completed_a_checkpoint_and_a_checkpoint_never_is() {
    use crate::checkpoint::CheckpointStorage;
    use crate::worker::clean_up::{AtStop, Outputs, SavepointDisposal};
    let dir = tempfile::tempdir().unwrap();
    let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "j", true).unwrap();
    for rel in ["savepoints/sp-2-100", "checkpoints/chk-3"] {
        storage.dir(rel).put("_metadata", b"{}".to_vec()).await.unwrap();
    }
    let savepoint = storage.dir("savepoints/sp-2-100").display;
    let checkpoint = storage.dir("checkpoints/chk-3").display;
    let control = worker(0);
    let addr = start(control.clone()).await;
    let body = |location: &str| serde_json::json!({ "location": location }).to_string();
    let (code, answer) = req(addr, "POST", "/v1/savepoint-disposals", TOKEN, Some(&body(&savepoint))).await;
    assert_eq!((code, error_of(&answer).as_str()), (503, "the job is not running yet"));

    let at = AtStop { outputs: Outputs { sinks: Vec::new(), late_records: Vec::new() }, job: "j".into(), run_id: "r".into(), base_dir: dir.path().into(), storage };
    control.serve_disposals(SavepointDisposal { at });
    let (code, answer) = req(addr, "POST", "/v1/savepoint-disposals", TOKEN, Some(&body(&savepoint))).await;
    assert_eq!(code, 503, "{answer}");
    assert!(error_of(&answer).contains("completed no checkpoint yet"), "{answer}");
    assert!(dir.path().join("j/savepoints/sp-2-100/_metadata").exists());

    control.status().lock().unwrap().checkpoints_completed = 1;
    let (code, answer) = req(addr, "POST", "/v1/savepoint-disposals", TOKEN, Some(&body(&checkpoint))).await;
    assert_eq!(code, 400, "{answer}");
    assert!(error_of(&answer).contains("no savepoint of this job"), "{answer}");
    assert!(dir.path().join("j/checkpoints/chk-3/_metadata").exists(), "a checkpoint is never disposed of");
    let (code, answer) = req(addr, "POST", "/v1/savepoint-disposals", TOKEN, Some("{}")).await;
    assert_eq!(code, 400, "{answer}");
    assert!(error_of(&answer).contains("location"), "{answer}");
    for existed in [true, false] {
        let (code, answer) = req(addr, "POST", "/v1/savepoint-disposals", TOKEN, Some(&body(&savepoint))).await;
        assert_eq!(code, 200, "{answer}");
        let done: weir_api::control::SavepointDisposed = serde_json::from_str(&answer).unwrap();
        assert_eq!((done.location.as_str(), done.existed), (savepoint.as_str(), existed));
    }
    assert!(!dir.path().join("j/savepoints/sp-2-100").exists());
}
