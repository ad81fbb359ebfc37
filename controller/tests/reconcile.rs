//! Reconciles against a mocked API server (tower-test): the requests the
//! operator makes, in order. Proves the ordering rules no pure test can:
//! the finalizer comes first, status is written before anything is created
//! or deleted, and nothing else is touched.

use std::net::SocketAddr;
use std::sync::Arc;

use futures::future::BoxFuture;
use http::{Request, Response};
use kube::client::Body;
use kube::Client;
use serde_json::{json, Value};
use weir_api::control::{JobStatus, Membership, SavepointOutcome, SavepointRequest};
use weir_api::streamjob::StreamJob;
use weir_controller::context::Context;
use weir_controller::desired::WorkerSettings;
use weir_controller::metrics::Metrics;
use weir_controller::worker_api::{Access, WorkerApi};

/// Workers that are never reached in these tests.
struct NoWorkers;

impl WorkerApi for NoWorkers {
    fn status<'a>(&'a self, api: SocketAddr, _: &'a Access) -> BoxFuture<'a, weir_controller::Result<JobStatus>> {
        Box::pin(async move { Err(weir_controller::Error::Worker { addr: api.to_string(), message: "unreachable in this test".into() }) })
    }
    fn put_membership<'a>(&'a self, w: SocketAddr, _: &'a Access, _: &'a Membership) -> BoxFuture<'a, weir_controller::Result<()>> {
        Box::pin(async move { Err(weir_controller::Error::Worker { addr: w.to_string(), message: "unreachable".into() }) })
    }
    fn request_savepoint<'a>(&'a self, a: SocketAddr, _: &'a Access, _: &'a SavepointRequest) -> BoxFuture<'a, weir_controller::Result<SavepointOutcome>> {
        Box::pin(async move { Err(weir_controller::Error::Worker { addr: a.to_string(), message: "unreachable".into() }) })
    }
    fn savepoint_outcome<'a>(&'a self, a: SocketAddr, _: &'a Access, _: &'a str) -> BoxFuture<'a, weir_controller::Result<Option<SavepointOutcome>>> {
        Box::pin(async move { Err(weir_controller::Error::Worker { addr: a.to_string(), message: "unreachable".into() }) })
    }
    fn cancel_savepoint<'a>(&'a self, a: SocketAddr, _: &'a Access, _: &'a str) -> BoxFuture<'a, weir_controller::Result<Option<SavepointOutcome>>> {
        Box::pin(async move { Err(weir_controller::Error::Worker { addr: a.to_string(), message: "unreachable".into() }) })
    }
    fn dispose_savepoint<'a>(&'a self, a: SocketAddr, _: &'a Access, _: &'a str) -> BoxFuture<'a, weir_controller::Result<weir_api::control::SavepointDisposed>> {
        Box::pin(async move { Err(weir_controller::Error::Worker { addr: a.to_string(), message: "unreachable".into() }) })
    }
}

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn context() -> (Arc<Context>, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "jobs");
    let ctx = Context::new(client, Arc::new(NoWorkers), Arc::new(Metrics::new()), WorkerSettings::default(), Some("test".into()));
    (Arc::new(ctx), handle)
}

fn job(finalizer: bool, status: Option<Value>) -> StreamJob {
    with_pipeline(finalizer, status, json!({
        "name": "j",
        "source": {"generator": {"events": 100, "keys": 10}},
        "steps": [{"key_by": "key"}, {"running_count": "count"}],
        "sink": {"file": {"path": "out", "format": "jsonl"}}
    }))
}

fn with_pipeline(finalizer: bool, status: Option<Value>, pipeline: Value) -> StreamJob {
    let mut j = json!({
        "apiVersion": "weir.dev/v1alpha1",
        "kind": "StreamJob",
        "metadata": {"name": "j", "namespace": "jobs", "uid": "0123456789abcdef", "generation": 1, "resourceVersion": "7"},
        "spec": {
            "image": "weir",
            "parallelism": 2,
            "checkpoint": {"storage": "file:///var/lib/weir/checkpoints"},
            "pipeline": pipeline,
            "podTemplate": {"spec": {
                "volumes": [{"name": "weir-data", "persistentVolumeClaim": {"claimName": "weir-data"}}],
                "containers": [{"name": "worker", "volumeMounts": [{"name": "weir-data", "mountPath": "/var/lib/weir"}]}]
            }}
        }
    });
    if finalizer {
        j["metadata"]["finalizers"] = json!(["weir.dev/savepoint-on-delete"]);
    }
    if let Some(s) = status {
        j["status"] = s;
    }
    serde_json::from_value(j).unwrap()
}

/// The next request, checked by method and path; answered with `answer` (status, body).
async fn expect(handle: &mut Handle, method: &str, path: &str, code: u16, answer: Value) -> Value {
    let (m, p, sent) = next(handle, |_, _| (code, answer.clone())).await;
    assert!(m == method && p.ends_with(path), "expected {method} {path}, got {m} {p}");
    sent
}

fn empty_pods() -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []})
}

#[tokio::test]
async fn a_new_job_gets_the_finalizer_before_anything_else() {
    let (ctx, mut handle) = context();
    let j = Arc::new(job(false, None));
    let server = tokio::spawn(async move {
        let sent = expect(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j", 200, serde_json::to_value(job(true, None)).unwrap()).await;
        // A JSON patch (a merge patch would replace other controllers'
        // finalizers): applied to the job as read, it adds the finalizer.
        let patch: json_patch::Patch = serde_json::from_value(sent).expect("a JSON patch");
        let mut read = serde_json::to_value(job(false, None)).unwrap();
        json_patch::patch(&mut read, &patch).unwrap();
        assert_eq!(read["metadata"]["finalizers"], json!(["weir.dev/savepoint-on-delete"]));
        handle
    });
    weir_controller::reconcile::reconcile(j, ctx).await.unwrap();
    let mut handle = server.await.unwrap();
    assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "nothing else before the finalizer is in place");
}

#[tokio::test]
async fn status_says_deploying_before_any_pod_is_created() {
    let (ctx, mut handle) = context();
    let server = tokio::spawn(async move {
        expect(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", 200, empty_pods()).await;
        let sent = expect(&mut handle, "PATCH", "/apis/weir.dev/v1alpha1/namespaces/jobs/streamjobs/j/status", 200, serde_json::to_value(job(true, None)).unwrap()).await;
        assert_eq!(sent["status"]["phase"], "Deploying");
        assert_eq!(sent["status"]["run"]["podsCreated"], false);
        expect(&mut handle, "POST", "/apis/events.k8s.io/v1/namespaces/jobs/events", 201, json!({})).await;
        handle
    });
    weir_controller::reconcile::reconcile(Arc::new(job(true, None)), ctx).await.unwrap();
    let mut handle = server.await.unwrap();
    assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "no object is created in the step that decides the run");
}

#[tokio::test]
async fn a_cyclic_graph_gets_its_error_in_status_and_no_pod_is_created() {
    let (ctx, mut handle) = context();
    let cyclic = json!({
        "name": "j",
        "sources": {"gen": {"generator": {"events": 100, "keys": 10}}},
        "steps": [
            {"name": "a", "input": ["gen", "b"], "union": {}},
            {"name": "b", "input": "a", "filter": "value > 1"}
        ],
        "sinks": {"out": {"input": "a", "file": {"path": "out"}}}
    });
    let j = with_pipeline(true, None, cyclic);
    let server = tokio::spawn(async move {
        expect(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", 200, empty_pods()).await;
        let sent = expect(&mut handle, "PATCH", "/streamjobs/j/status", 200, serde_json::to_value(job(true, None)).unwrap()).await;
        assert_eq!(sent["status"]["phase"], "Failed");
        let message = sent["status"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("steps[0].input[1]: `a` → `b` → `a` is a cycle"), "{message}");
        expect(&mut handle, "POST", "/apis/events.k8s.io/v1/namespaces/jobs/events", 201, json!({})).await;
        handle
    });
    weir_controller::reconcile::reconcile(Arc::new(j), ctx).await.unwrap();
    let mut handle = server.await.unwrap();
    assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "no pod, Service or ConfigMap is created");
}

/// The next request, answered by `answer(method, path)` (status, body);
/// returns method, path and the body sent.
async fn next(handle: &mut Handle, answer: impl Fn(&str, &str) -> (u16, Value)) -> (String, String, Value) {
    let (req, send) = handle.next_request().await.expect("the reconciler made no further request");
    let (method, path) = (req.method().to_string(), req.uri().path().to_string());
    let body = req.into_body().collect_bytes().await.unwrap();
    let sent: Value = if body.is_empty() { Value::Null } else { serde_json::from_slice(&body).unwrap() };
    let (code, body) = answer(&method, &path);
    send.send_response(Response::builder().status(code).body(Body::from(serde_json::to_vec(&body).unwrap())).unwrap());
    (method, path, sent)
}

#[tokio::test]
async fn the_run_is_marked_created_in_status_then_token_pipeline_and_service_then_the_pods_are_applied() {
    let (ctx, mut handle) = context();
    let status = json!({
        "phase": "Deploying",
        "run": {"id": "01234567-1", "number": 1, "specHash": "x", "workers": 2, "podsCreated": false, "startedAt": "2026-11-29T12:00:00Z"},
        "restarts": 0, "restartsInARow": 0
    });
    let j = job(true, Some(status));
    let server = tokio::spawn(async move {
        expect(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", 200, empty_pods()).await;
        let sent = expect(&mut handle, "PATCH", "/streamjobs/j/status", 200, serde_json::to_value(job(true, None)).unwrap()).await;
        assert_eq!(sent["status"]["run"]["podsCreated"], true, "status first");
        // Then the token Secret (created, never read: its token is derived
        // from the operator's key), the pipeline ConfigMap, the Service and
        // the two pods, in whatever order the operator sends them, answered
        // as they come.
        let answer = |method: &str, path: &str| -> (u16, Value) {
            let name = path.rsplit('/').next().unwrap_or_default().to_string();
            if method == "GET" {
                (404, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}))
            } else if method == "POST" && path.ends_with("/secrets") {
                (201, json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "j-operator-token"}}))
            } else {
                let kind = match path.split('/').rev().nth(1) {
                    Some("secrets") => "Secret",
                    Some("configmaps") => "ConfigMap",
                    Some("services") => "Service",
                    _ => "Pod",
                };
                (200, json!({"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}))
            }
        };
        let mut seen = Vec::new();
        for _ in 0..5 {
            seen.push(next(&mut handle, answer).await);
        }
        let at = |method: &str, path: &str| {
            seen.iter().position(|(m, p, _)| m == method && p == &format!("/api/v1/namespaces/jobs/{path}")).unwrap_or_else(|| panic!("no {method} {path} in {:?}", seen.iter().map(|(m, p, _)| format!("{m} {p}")).collect::<Vec<_>>()))
        };
        let (secret, cm, svc) = (at("POST", "secrets"), at("PATCH", "configmaps/j-pipeline"), at("PATCH", "services/j-workers"));
        assert_eq!(seen[secret].2["metadata"]["name"], "j-operator-token");
        assert_eq!(seen[secret].2["metadata"]["ownerReferences"][0]["kind"], "StreamJob");
        let token = seen[secret].2["data"]["token"].as_str().expect("the token in the Secret");
        assert_eq!(token.len(), 88, "64 hex characters, base64-encoded: {token}");
        assert!(seen[cm].2["data"]["pipeline.yaml"].as_str().unwrap().contains("parallelism: 2"));
        for i in 0..2 {
            let pod = at("PATCH", &format!("pods/j-1-{i}"));
            assert!(pod > secret && pod > cm && pod > svc, "pod {i} was applied before its token, pipeline or Service");
            assert_eq!(seen[pod].2["metadata"]["labels"]["weir.dev/run"], "01234567-1");
        }
        handle
    });
    weir_controller::reconcile::reconcile(Arc::new(j), ctx).await.unwrap();
    let mut handle = server.await.unwrap();
    assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "nothing else");
}

#[tokio::test]
async fn a_failed_pod_is_recorded_as_recovering_before_the_old_run_is_deleted() {
    let (ctx, mut handle) = context();
    let status = json!({
        "phase": "Running",
        "run": {"id": "01234567-1", "number": 1, "specHash": "x", "workers": 2, "podsCreated": true, "startedAt": "2026-11-29T12:00:00Z"},
        "restarts": 0, "restartsInARow": 0
    });
    let pod = |i: u32, phase: &str| json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("j-1-{i}"), "namespace": "jobs", "labels": {"weir.dev/job": "j", "weir.dev/run": "01234567-1", "weir.dev/worker": i.to_string()}},
        "status": {"phase": phase, "podIP": format!("127.0.1.{}", i + 1)}
    });
    let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [pod(0, "Running"), pod(1, "Failed")]});
    let j = job(true, Some(status));
    let listed = pods.clone();
    let server = tokio::spawn(async move {
        expect(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", 200, listed).await;
        let sent = expect(&mut handle, "PATCH", "/streamjobs/j/status", 200, serde_json::to_value(job(true, None)).unwrap()).await;
        assert_eq!(sent["status"]["phase"], "Recovering");
        assert_eq!(sent["status"]["restarts"], 1);
        assert_eq!(sent["status"]["run"]["restoreFrom"], "latest");
        assert_eq!(sent["status"]["run"]["number"], 2);
        // A warning event says why; then nothing is deleted in this step
        // (the next step deletes the old pods, then waits the backoff).
        expect(&mut handle, "POST", "/apis/events.k8s.io/v1/namespaces/jobs/events", 201, json!({})).await;
        (handle, sent["status"].clone())
    });
    weir_controller::reconcile::reconcile(Arc::new(j), ctx.clone()).await.unwrap();
    let (mut handle, recovering) = server.await.unwrap();
    assert!(futures::poll!(Box::pin(handle.next_request())).is_pending());

    // The next reconcile deletes the old run's pods, from the list it decided on.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let server = tokio::spawn(async move {
        loop {
            let answer = |method: &str, _: &str| match method {
                "GET" => (200, pods.clone()),
                "DELETE" => (200, json!({"kind": "Status", "apiVersion": "v1", "status": "Success"})),
                _ => (200, serde_json::to_value(job(true, None)).unwrap()),
            };
            let (m, p, _) = next(&mut handle, answer).await;
            record.lock().unwrap().push(format!("{m} {p}"));
        }
    });
    weir_controller::reconcile::reconcile(Arc::new(job(true, Some(recovering))), ctx).await.unwrap();
    server.abort();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.iter().filter(|r| r.starts_with("GET ")).count(), 1, "one list of the pods: {seen:?}");
    for i in 0..2 {
        assert!(seen.contains(&format!("DELETE /api/v1/namespaces/jobs/pods/j-1-{i}")), "pod j-1-{i} deleted: {seen:?}");
    }
}

/// `kubectl apply` of a pipeline the operator refuses, while generation 1
/// runs: the status written judges generation 2 as not Ready, says why, and
/// nothing of the running job is touched, so `kubectl wait
/// --for=condition=Ready` times out instead of returning on the old spec.
#[tokio::test]
async fn a_refused_change_is_written_as_not_ready_at_its_generation_and_the_running_job_is_left_alone() {
    let (ctx, mut handle) = context();
    let status = json!({
        "phase": "Running",
        "observedGeneration": 1,
        "deployedSpecHash": "x",
        "deployedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Running", "message": "generation 1 runs", "observedGeneration": 1, "lastTransitionTime": "2026-11-29T12:00:00Z"}],
        "run": {"id": "01234567-1", "number": 1, "specHash": "x", "generation": 1, "workers": 2, "podsCreated": true, "startedAt": "2026-11-29T12:00:00Z"},
        "restarts": 0, "restartsInARow": 0
    });
    let mut j = with_pipeline(true, Some(status), json!({
        "name": "j",
        "source": {"generator": {"events": 100, "keys": 10}},
        "steps": [{"explode": "key"}],
        "sink": {"file": {"path": "out", "format": "jsonl"}}
    }));
    j.metadata.generation = Some(2);
    let pod = |i: u32| json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("j-1-{i}"), "namespace": "jobs", "labels": {"weir.dev/job": "j", "weir.dev/run": "01234567-1", "weir.dev/worker": i.to_string()}},
        "status": {"phase": "Running", "podIP": format!("127.0.1.{}", i + 1)}
    });
    let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [pod(0), pod(1)]});
    let server = tokio::spawn(async move {
        expect(&mut handle, "GET", "/api/v1/namespaces/jobs/pods", 200, pods).await;
        // The coordinator is asked how the run does, with the job's token,
        // which the operator derives: no Secret is read.
        let sent = expect(&mut handle, "PATCH", "/streamjobs/j/status", 200, serde_json::to_value(job(true, None)).unwrap()).await;
        (handle, sent["status"].clone())
    });
    weir_controller::reconcile::reconcile(Arc::new(j), ctx).await.unwrap();
    let (mut handle, st) = server.await.unwrap();
    assert!(futures::poll!(Box::pin(handle.next_request())).is_pending(), "no pod is deleted or created");
    assert_eq!(st["phase"], "Running");
    assert_eq!(st["observedGeneration"], 2);
    assert_eq!((&st["deployedSpecHash"], &st["deployedGeneration"]), (&json!("x"), &json!(1)), "generation 1 still runs");
    let ready = st["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").expect("a Ready condition").clone();
    assert_eq!((&ready["status"], &ready["reason"], &ready["observedGeneration"]), (&json!("False"), &json!("SpecRefused"), &json!(2)));
    let message = ready["message"].as_str().unwrap();
    assert!(message.contains("generation 2 is refused") && message.contains("explode") && message.contains("generation 1 keeps running"), "{message}");
}
