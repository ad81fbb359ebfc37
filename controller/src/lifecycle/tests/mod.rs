//! The lifecycle on hand-made observations: each test is one behaviour a
//! user relies on, several of them the Flink operator's reported problems.

use std::time::Duration;

use jiff::Timestamp;
use weir_api::control::{CheckpointStatus, JobStatus, SavepointOutcome, SavepointState};
use weir_api::streamjob::{CheckpointRef, JobState, Phase, SavepointReason, StreamJob, UpgradeMode};

use super::{decide, Decision, Effect};
use crate::desired::WorkerSettings;
use crate::observe::{Observed, PodView, Rejection, START_GRACE};
use crate::testing::{exited, pod, JobBuilder};

mod readiness;
mod rollback;
mod savepoints;
mod stuck;

/// A job and the world around it, advanced one reconcile at a time.
struct World {
    job: StreamJob,
    now: Timestamp,
    pods: Vec<k8s_openapi::api::core::v1::Pod>,
    coordinator: Option<JobStatus>,
    /// Why the coordinator did not answer (with `coordinator` None).
    coordinator_error: Option<String>,
    /// Nodes whose kubelet does not answer the operator's probe.
    kubelets_gone: Vec<std::net::IpAddr>,
    savepoint: Option<Option<SavepointOutcome>>,
    /// What the reconciler saw when it last created the run's objects.
    rejected: Option<Rejection>,
    settings: WorkerSettings,
    /// The other jobs' upgrades in flight and the limit.
    upgrades: crate::lifecycle::UpgradeSlots,
    /// Savepoint disposals carried out, as the reconciler reports them.
    disposals: Vec<(String, crate::observe::DisposalOutcome)>,
}

impl World {
    fn new(job: StreamJob) -> World {
        World {
            job,
            now: Timestamp::from_second(1_800_000_000).unwrap(),
            pods: Vec::new(),
            coordinator: None,
            coordinator_error: None,
            kubelets_gone: Vec::new(),
            savepoint: None,
            rejected: None,
            settings: WorkerSettings::default(),
            upgrades: Default::default(),
            disposals: Vec::new(),
        }
    }

    fn step(&mut self) -> Decision {
        let mut obs = Observed::at(self.now);
        obs.pods = self.pods.iter().map(PodView::of).collect();
        obs.coordinator = self.coordinator.clone();
        obs.coordinator_error = self.coordinator_error.clone();
        obs.kubelets_gone = self.kubelets_gone.clone();
        obs.savepoint = self.savepoint.clone();
        obs.rejected = self.rejected.clone();
        obs.upgrades = self.upgrades;
        obs.disposals = self.disposals.clone();
        // As the reconciler's observation takes it from status.
        obs.silent = self.job.status.as_ref().and_then(|s| s.run.as_ref()).map(|r| r.silent_pods.clone()).unwrap_or_default();
        let d = decide(&self.job, &obs, &self.settings);
        self.job.status = Some(d.status.clone());
        // What the effects would do to the pods.
        for e in &d.effects {
            match e {
                Effect::CreateRun => {
                    let run = d.status.run.clone().unwrap();
                    for i in 0..run.workers as u32 {
                        let mut p = pod(&self.name(), &run.id, i, "Pending", None);
                        p.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(self.now));
                        self.pods.push(p);
                    }
                }
                Effect::DeleteAllPods => self.pods.clear(),
                Effect::DeleteOtherPods => {
                    let keep = d.status.run.as_ref().map(|r| r.id.clone());
                    self.pods.retain(|p| p.metadata.labels.as_ref().and_then(|l| l.get(crate::names::RUN_LABEL)) == keep.as_ref());
                }
                _ => {}
            }
        }
        d
    }

    fn name(&self) -> String {
        self.job.metadata.name.clone().unwrap()
    }

    fn phase(&self) -> Option<Phase> {
        self.job.status.as_ref().and_then(|s| s.phase)
    }

    fn run_id(&self) -> String {
        self.job.status.as_ref().unwrap().run.as_ref().unwrap().id.clone()
    }

    /// The run's pods start and get IPs; the coordinator runs.
    fn pods_run(&mut self) {
        let run = self.run_id();
        for (i, p) in self.pods.iter_mut().enumerate() {
            let st = p.status.as_mut().unwrap();
            st.phase = Some("Running".into());
            st.pod_ip = Some(format!("127.0.1.{}", i + 1));
        }
        self.coordinator = Some(JobStatus { run_id: run, phase: "running".into(), ..Default::default() });
    }

    fn advance(&mut self, d: Duration) {
        self.now = self.now.checked_add(d).unwrap();
    }

    /// Steps until the phase is `phase` (at most 10 reconciles).
    fn until(&mut self, phase: Phase) -> Vec<Decision> {
        let mut out = Vec::new();
        for _ in 0..10 {
            let d = self.step();
            out.push(d);
            if self.phase() == Some(phase) {
                return out;
            }
        }
        panic!("never reached {phase:?}; at {:?}: {:?}", self.phase(), self.job.status.as_ref().and_then(|s| s.message.clone()));
    }

    fn running(job: StreamJob) -> World {
        let mut w = World::new(job);
        w.until(Phase::Deploying);
        w.step(); // creates the pods
        w.pods_run();
        w.until(Phase::Running);
        w
    }

    /// The same world after `kubectl delete` of the job.
    fn deleted(mut self) -> World {
        self.job.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()));
        self
    }

    fn checkpoint(&mut self, id: u64) {
        let ms = self.now.as_millisecond() as u64;
        if let Some(c) = self.coordinator.as_mut() {
            c.latest_checkpoint = Some(CheckpointStatus { id, location: format!("/cp/chk-{id}"), completed_unix_ms: ms, duration_ms: 5 });
        }
    }
}

fn effects(ds: &[Decision]) -> Vec<Effect> {
    ds.iter().flat_map(|d| d.effects.clone()).collect()
}

fn savepoint_requests(ds: &[Decision]) -> Vec<(String, bool)> {
    effects(ds)
        .into_iter()
        .filter_map(|e| match e {
            Effect::RequestSavepoint { request_id, stop, .. } => Some((request_id, stop)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_new_job_records_its_run_before_creating_pods_and_runs_once_the_coordinator_does() {
    let mut w = World::new(JobBuilder::new("j").build());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    let run = d.status.run.clone().unwrap();
    assert!(!run.pods_created && d.effects.is_empty(), "the run is written to status before any pod exists");
    assert_eq!(run.workers, 2);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    assert!(d.status.run.as_ref().unwrap().pods_created);
    // Pods run: membership is sent to every worker until the coordinator runs.
    for p in w.pods.iter_mut() {
        p.status.as_mut().unwrap().phase = Some("Running".into());
    }
    w.pods[0].status.as_mut().unwrap().pod_ip = Some("127.0.1.1".into());
    w.pods[1].status.as_mut().unwrap().pod_ip = Some("127.0.1.2".into());
    let d = w.step();
    match &d.effects[..] {
        [Effect::SendMembership { membership, workers }] => {
            assert_eq!(workers.len(), 2);
            assert_eq!(membership.run_id, run.id);
            assert_eq!(membership.api, "127.0.1.1:6120".parse().unwrap());
        }
        other => panic!("expected membership, got {other:?}"),
    }
    assert_eq!(w.phase(), Some(Phase::Deploying));
    w.pods_run();
    w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    let st = w.job.status.clone().unwrap();
    assert!(st.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    assert!(st.message.unwrap().contains("started fresh"), "a job with nothing to restore says so");
}

#[test]
fn an_invalid_pipeline_is_reported_in_status_and_an_event_not_deployed() {
    let job = JobBuilder::new("j").spec(|s| s.pipeline.0["steps"] = serde_json::json!([{"explode": "x"}])).build();
    let mut w = World::new(job);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.effects.is_empty());
    let msg = d.status.message.unwrap();
    assert!(msg.contains("steps[0]") || msg.contains("explode"), "{msg}");
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "InvalidSpec"));
    assert!(d.status.conditions.iter().any(|c| c.type_ == "Degraded" && c.status == "True"));
    // Still Failed on the next reconcile, without a crash loop or new events.
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.notes.is_empty());
}

/// The builder's job with its pipeline written as a graph: `steps` between
/// the source `gen` and the file sink `out`.
fn graph_job(steps: serde_json::Value, sink_input: &str) -> StreamJob {
    let pipeline = serde_json::json!({
        "name": "j",
        "sources": {"gen": {"generator": {"events": 1000, "keys": 10}}},
        "steps": steps,
        "sinks": {"out": {"input": sink_input, "file": {"path": "out"}}},
    });
    JobBuilder::new("j").spec(|s| s.pipeline.0 = pipeline).build()
}

#[test]
fn a_cyclic_graph_is_reported_in_status_and_an_event_not_deployed() {
    let steps = serde_json::json!([
        {"name": "evens", "input": ["gen", "odds"], "union": {}},
        {"name": "odds", "input": "evens", "filter": "value % 2 = 1"},
    ]);
    let mut w = World::new(graph_job(steps, "evens"));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.effects.is_empty(), "nothing is created: {:?}", d.effects);
    let msg = d.status.message.unwrap();
    assert!(msg.contains("steps[0].input[1]: `evens` → `odds` → `evens` is a cycle: the steps of a pipeline form a DAG"), "{msg}");
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "InvalidSpec"));
}

#[test]
fn a_graph_with_fan_out_and_union_or_a_lookup_join_deploys_like_a_chain() {
    let steps = serde_json::json!([
        {"name": "big", "input": "gen", "filter": "value > 3"},
        {"name": "small", "input": "gen", "filter": "value < 3"},
        {"name": "both", "input": ["big", "small"], "union": {}},
    ]);
    let mut w = World::new(graph_job(steps, "both"));
    let mut chain = World::new(JobBuilder::new("j").build());
    for _ in 0..2 {
        let (d, c) = (w.step(), chain.step());
        assert_eq!(w.phase(), chain.phase(), "{:?}", d.status.message);
        assert_eq!(d.effects.len(), c.effects.len(), "a graph is deployed like a chain: {:?}", d.effects);
    }
    assert_eq!(w.phase(), Some(Phase::Deploying));
    let steps = serde_json::json!([
        {"name": "pairs", "input": "gen", "lookup_join": {"on": "key", "postgres": {"connection": "host=h", "table": "t", "key": ["id"], "columns": {"n": "string"}}, "cache": {"max_rows": 10, "ttl": "1m"}}},
    ]);
    let mut w = World::new(graph_job(steps, "pairs"));
    let mut chain = World::new(JobBuilder::new("j").build());
    for _ in 0..2 {
        let (d, c) = (w.step(), chain.step());
        assert_eq!(w.phase(), chain.phase(), "{:?}", d.status.message);
        assert_eq!(d.effects.len(), c.effects.len(), "a lookup join is deployed like a chain: {:?}", d.effects);
    }
    assert_eq!(w.phase(), Some(Phase::Deploying));
}

#[test]
fn a_failed_worker_restores_the_whole_job_from_the_latest_checkpoint_after_a_backoff() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.checkpoint(7);
    w.step();
    let old_run = w.run_id();
    w.pods[1] = exited(w.pods[1].clone(), 137);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    let st = d.status.clone();
    assert_eq!(st.restarts, 1);
    assert_eq!(st.last_failure.as_ref().unwrap().reason, "PodFailed");
    let run = st.run.unwrap();
    assert_ne!(run.id, old_run);
    assert_eq!(run.restore_from.as_deref(), Some("latest"));
    assert!(run.expect_state, "after checkpoint 7, storage without any state of the job must fail the run, not start it fresh");
    assert_eq!(st.last_checkpoint.unwrap().id, 7);
    // Old pods go first; no new pod before they are gone and the backoff passed.
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteOtherPods]);
    let d = w.step();
    assert!(!d.effects.contains(&Effect::CreateRun), "backoff of 1s not over yet");
    assert!(d.status.message.unwrap().contains("backoff"));
    w.advance(Duration::from_millis(1100));
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    w.pods_run();
    if let Some(c) = w.coordinator.as_mut() {
        c.restored_from = Some("/cp/chk-7".into());
    }
    let ds = w.until(Phase::Running);
    assert!(ds.last().unwrap().notes.iter().any(|n| n.reason == "Recovered" && n.message.contains("chk-7")));
}

#[test]
fn new_pods_never_start_while_pods_of_the_previous_run_remain() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 1);
    // The other old pod is stuck terminating: it must be gone before anything new starts.
    w.step();
    w.advance(Duration::from_secs(120));
    for _ in 0..5 {
        let mut obs_pods = w.pods.clone();
        let d = w.step();
        assert!(!d.effects.contains(&Effect::CreateRun));
        // The deletion does not take effect (pod stuck): restore it.
        obs_pods.retain(|_| true);
        w.pods = obs_pods;
    }
    w.pods.clear();
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
}

/// A worker says why it gave up (its termination message): the operator's
/// failure names it, e.g. the peer its heartbeats stopped coming from.
#[test]
fn a_failed_runs_status_carries_the_workers_own_words() {
    let mut w = World::running(JobBuilder::new("j").build());
    let mut failed = exited(w.pods[1].clone(), 1);
    let t = failed.status.as_mut().unwrap().container_statuses.as_mut().unwrap()[0].state.as_mut().unwrap().terminated.as_mut().unwrap();
    t.message = Some("lost the coordinator: 10.0.0.7:6122 sent nothing for 5.0s (the heartbeat timeout): it is frozen, cut off, or its node is lost".into());
    w.pods[1] = failed;
    let d = w.step();
    let failure = d.status.last_failure.unwrap();
    assert!(failure.message.contains("sent nothing for 5.0s") && failure.message.contains("exit code 1"), "{}", failure.message);
}

/// A pod on a lost node (or whose processes are frozen) never confirms its
/// deletion. After `ABANDON_AFTER` the next run starts anyway, the pod is
/// listed in status and a warning says why that is safe (the run fence).
#[test]
fn a_pod_of_the_old_run_stuck_terminating_on_a_lost_node_is_recorded_and_not_waited_for() {
    use crate::observe::ABANDON_AFTER;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    // Worker 1 failed (it lost its peer); worker 0's node is gone, so its pod stays.
    w.pods[1] = exited(w.pods[1].clone(), 1);
    let mut stuck = w.pods[0].clone();
    stuck.spec = Some(k8s_openapi::api::core::v1::PodSpec { node_name: Some("node-1".into()), ..Default::default() });
    let deleted_at = w.now;
    stuck.metadata.deletion_timestamp = Some(Time(deleted_at.checked_add(Duration::from_secs(10)).unwrap()));
    stuck.metadata.deletion_grace_period_seconds = Some(10);
    let stuck_name = stuck.metadata.name.clone().unwrap();
    let mut created_at = None;
    for _ in 0..120 {
        let d = w.step();
        // The deletion never takes effect: the pod is still there, terminating.
        if !w.pods.iter().any(|p| p.metadata.name.as_deref() == Some(&stuck_name)) {
            w.pods.push(stuck.clone());
        }
        if d.effects.contains(&Effect::CreateRun) {
            assert_ne!(w.run_id(), old_run);
            assert_eq!(d.status.abandoned_pods, vec![stuck_name.clone()]);
            assert_eq!(d.status.run.as_ref().unwrap().avoid_nodes, vec!["node-1".to_string()], "the new run must not land on the lost node");
            assert!(d.notes.iter().any(|n| n.warning && n.reason == "AbandonedPods" && n.message.contains(&stuck_name) && n.message.contains("fence")));
            created_at = Some(w.now);
            break;
        }
        w.advance(Duration::from_millis(250));
    }
    let created_at = created_at.expect("the new run never started beside the abandoned pod");
    // Counted from the deletion deadline (request + 10 s grace): a live kubelet has killed the pod by then.
    let waited = Duration::try_from(created_at.duration_since(deleted_at)).unwrap();
    let grace = Duration::from_secs(10);
    assert!(waited >= grace + ABANDON_AFTER, "started {waited:?} after the deletion, before the pod counted as abandoned");
    assert!(waited < grace + ABANDON_AFTER + Duration::from_secs(3), "waited {waited:?} for an abandoned pod");
    // Once the node is back and the pod gone, the list empties.
    w.pods.retain(|p| p.metadata.name.as_deref() != Some(&stuck_name));
    let d = w.step();
    assert!(d.status.abandoned_pods.is_empty());
}

/// Worker 0 heard nothing from worker 1 for the heartbeat timeout and the
/// run failed naming it: worker 1's node is frozen or lost, so its pod will
/// not confirm its deletion. The next run does not wait for it at all (not
/// even the deletion deadline) and avoids its node.
#[test]
fn a_pod_the_failed_run_names_as_silent_is_not_waited_for() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    let mut failed = exited(w.pods[0].clone(), 1);
    let t = failed.status.as_mut().unwrap().container_statuses.as_mut().unwrap()[0].state.as_mut().unwrap().terminated.as_mut().unwrap();
    t.message = Some(format!("run failed: {}", weir_api::control::silence_message(1, "10.0.0.8:6120", 5.0)));
    w.pods[0] = failed;
    let mut silent = w.pods[1].clone();
    silent.spec = Some(k8s_openapi::api::core::v1::PodSpec { node_name: Some("node-2".into()), ..Default::default() });
    let silent_name = silent.metadata.name.clone().unwrap();
    let failed_at = w.now;
    let mut started = None;
    for _ in 0..80 {
        let d = w.step();
        if !w.pods.iter().any(|p| p.metadata.name.as_deref() == Some(&silent_name)) {
            // Deleted, but its kubelet never confirms it.
            let mut stuck = silent.clone();
            stuck.metadata.deletion_timestamp = Some(Time(w.now.checked_add(Duration::from_secs(10)).unwrap()));
            stuck.metadata.deletion_grace_period_seconds = Some(10);
            w.pods.push(stuck);
        }
        if d.effects.contains(&Effect::CreateRun) {
            let run = d.status.run.clone().unwrap();
            assert_ne!(run.id, old_run);
            assert_eq!(run.silent_pods, vec![silent_name.clone()]);
            assert_eq!(run.avoid_nodes, vec!["node-2".to_string()], "the new run must not land on the silent worker's node");
            started = Some(w.now);
            break;
        }
        w.advance(Duration::from_millis(250));
    }
    let started = started.expect("the new run waited for the silent worker's pod");
    let waited = Duration::try_from(started.duration_since(failed_at)).unwrap();
    assert!(waited < Duration::from_secs(5), "waited {waited:?}: the deletion deadline (10 s) must not count for a silent worker");
}

/// If the nodes of abandoned pods were the only ones with room (one node,
/// merely slow), the run that avoids them cannot be scheduled; after
/// `RELAX_AVOIDANCE_AFTER` it is started again without avoiding any node.
#[test]
fn a_run_unschedulable_away_from_avoided_nodes_is_started_again_without_avoiding_them() {
    use super::run::RELAX_AVOIDANCE_AFTER;
    use k8s_openapi::api::core::v1::PodCondition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[1] = exited(w.pods[1].clone(), 1);
    let mut stuck = w.pods[0].clone();
    stuck.spec = Some(k8s_openapi::api::core::v1::PodSpec { node_name: Some("node-1".into()), ..Default::default() });
    stuck.metadata.deletion_timestamp = Some(Time(w.now));
    stuck.metadata.deletion_grace_period_seconds = Some(0);
    let stuck_name = stuck.metadata.name.clone().unwrap();
    let keep_stuck = |w: &mut World| {
        if !w.pods.iter().any(|p| p.metadata.name.as_deref() == Some(&stuck_name)) {
            w.pods.push(stuck.clone());
        }
    };
    let mut avoiding_run = None;
    for _ in 0..40 {
        let d = w.step();
        keep_stuck(&mut w);
        if d.effects.contains(&Effect::CreateRun) {
            avoiding_run = Some(w.run_id());
            break;
        }
        w.advance(Duration::from_millis(500));
    }
    let avoiding_run = avoiding_run.expect("no run started beside the abandoned pod");
    assert_eq!(w.job.status.as_ref().unwrap().run.as_ref().unwrap().avoid_nodes, vec!["node-1".to_string()]);
    // Its pods cannot be scheduled.
    for p in w.pods.iter_mut().filter(|p| p.metadata.name.as_deref() != Some(&stuck_name)) {
        p.status.as_mut().unwrap().conditions = Some(vec![PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some("0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector.".into()),
            ..Default::default()
        }]);
    }
    let d = w.step();
    assert_eq!(w.run_id(), avoiding_run, "unschedulable a moment ago: still waited for");
    assert!(!d.effects.contains(&Effect::DeleteOtherPods));
    w.advance(RELAX_AVOIDANCE_AFTER + Duration::from_secs(1));
    let d = w.step();
    assert_ne!(w.run_id(), avoiding_run);
    assert!(d.status.run.as_ref().unwrap().avoid_nodes_relaxed);
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "AvoidanceRelaxed" && n.message.contains("node-1")), "{:?}", d.notes);
    let mut created = false;
    for _ in 0..10 {
        let d = w.step();
        keep_stuck(&mut w);
        if d.effects.contains(&Effect::CreateRun) {
            assert!(d.status.run.as_ref().unwrap().avoid_nodes.is_empty(), "the relaxed run avoids nothing");
            created = true;
            break;
        }
    }
    assert!(created, "the relaxed run was never created");
}

/// Suspension does not wait for an abandoned pod either.
#[test]
fn a_suspension_completes_beside_a_pod_abandoned_on_a_lost_node() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.state = JobState::Suspended;
    let d = w.step();
    let (id, _) = savepoint_requests(std::slice::from_ref(&d))[0].clone();
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 4, location: "/cp/sp-4".into(), completed_unix_ms: 1, duration_ms: 1 }),
        error: None,
    }));
    let mut stuck = w.pods[0].clone();
    stuck.metadata.deletion_timestamp = Some(Time(w.now));
    stuck.metadata.deletion_grace_period_seconds = Some(0);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods]);
    w.savepoint = None;
    w.coordinator = None;
    // The pod on the lost node stays; first it is waited for, then not.
    w.pods = vec![stuck.clone()];
    w.step();
    assert_eq!(w.phase(), Some(Phase::Suspending), "a pod deleted a moment ago is waited for");
    w.advance(crate::observe::ABANDON_AFTER + Duration::from_secs(1));
    w.pods = vec![stuck];
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Suspended));
    assert_eq!(d.status.abandoned_pods.len(), 1);
}

#[test]
fn a_savepoint_mode_upgrade_stops_the_job_with_a_savepoint_and_restores_the_new_spec_from_it() {
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    w.job.spec.parallelism = 3;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    let reqs = savepoint_requests(std::slice::from_ref(&d));
    assert_eq!(reqs.len(), 1);
    assert!(reqs[0].1, "an upgrade savepoint stops the job: nothing may commit after it");
    assert_eq!(d.status.pending_savepoint.as_ref().unwrap().reason, SavepointReason::Upgrade);
    assert_eq!(w.run_id(), old_run, "old pods keep running while the savepoint is taken");
    let id = reqs[0].0.clone();
    w.savepoint = Some(Some(SavepointOutcome { request_id: id.clone(), state: SavepointState::Pending, savepoint: None, error: None }));
    let d = w.step();
    assert!(d.effects.is_empty(), "a known request is awaited, not sent again");
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 9, location: "/cp/savepoints/sp-9".into(), completed_unix_ms: 1, duration_ms: 2 }),
        error: None,
    }));
    let d = w.step();
    let st = d.status.clone();
    assert_eq!(st.last_savepoint.as_ref().unwrap().id, 9);
    let run = st.run.unwrap();
    assert_ne!(run.id, old_run);
    assert_eq!(run.restore_from.as_deref(), Some("/cp/savepoints/sp-9"));
    assert_eq!(run.workers, 3);
    w.savepoint = None;
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteOtherPods]);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    assert_eq!(w.pods.len(), 3);
    w.pods_run();
    let ds = w.until(Phase::Running);
    assert!(ds.last().unwrap().transition.is_some());
}

#[test]
fn a_failed_upgrade_savepoint_keeps_the_old_job_running_and_never_falls_back() {
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    w.job.spec.pipeline.0["steps"] = serde_json::json!([{"key_by": "key"}, {"running_sum": {"field": "value", "as": "total"}}]);
    let d = w.step();
    let id = savepoint_requests(std::slice::from_ref(&d))[0].0.clone();
    w.savepoint = Some(Some(SavepointOutcome { request_id: id, state: SavepointState::Failed, savepoint: None, error: Some("checkpoint declined by subtask 1".into()) }));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!(w.run_id(), old_run, "the old pods were not touched");
    assert!(!d.effects.iter().any(|e| matches!(e, Effect::DeleteOtherPods | Effect::DeleteAllPods | Effect::CreateRun)));
    let msg = d.status.message.clone().unwrap();
    assert!(msg.contains("declined") && msg.contains("keeps running the previous spec"), "{msg}");
    assert!(d.status.conditions.iter().any(|c| c.type_ == "Degraded" && c.status == "True"));
    // Later reconciles wait, then retry with a savepoint again (never last-state).
    w.savepoint = None;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.effects.is_empty());
    w.advance(Duration::from_secs(61));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    assert_eq!(savepoint_requests(std::slice::from_ref(&d)).len(), 1);
    assert_eq!(w.run_id(), old_run);
}

#[test]
fn an_upgrade_savepoint_that_never_completes_gives_up_after_the_savepoint_timeout_and_cancels_it() {
    let mut w = World::running(JobBuilder::new("j").spec(|s| {
        s.savepoint_timeout = weir_api::pipeline::HumanDuration::from_millis(30_000);
        s.checkpoint.timeout = weir_api::pipeline::HumanDuration::from_millis(5_000);
    }).build());
    w.job.spec.parallelism = 1;
    w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    w.advance(Duration::from_secs(20));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    w.advance(Duration::from_secs(11));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.status.pending_savepoint.is_none());
    assert!(d.status.message.clone().unwrap().contains("savepointTimeout"));
    assert_eq!(cancelled_savepoints(std::slice::from_ref(&d)).len(), 1, "the runtime is told: a stop it completes later must not leave the job stopped");
}

fn cancelled_savepoints(ds: &[Decision]) -> Vec<String> {
    effects(ds)
        .into_iter()
        .filter_map(|e| match e {
            Effect::CancelSavepoint { request_id, .. } => Some(request_id),
            _ => None,
        })
        .collect()
}

#[test]
fn a_suspension_taken_back_before_its_savepoint_completes_cancels_the_stop_in_the_runtime() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.state = JobState::Suspended;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Suspending));
    let (id, stop) = savepoint_requests(std::slice::from_ref(&d))[0].clone();
    assert!(stop);
    w.job.spec.state = JobState::Running;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!(cancelled_savepoints(std::slice::from_ref(&d)), vec![id]);
    assert!(d.status.pending_savepoint.is_none());
}

#[test]
fn after_an_operator_restart_a_requested_savepoint_is_asked_again_with_the_same_id() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.parallelism = 1;
    let d = w.step();
    let id = savepoint_requests(std::slice::from_ref(&d))[0].0.clone();
    // The request may never have reached the coordinator (operator died): it says "unknown".
    w.savepoint = Some(None);
    let d = w.step();
    assert_eq!(savepoint_requests(std::slice::from_ref(&d)), vec![(id.clone(), true)], "same id: the coordinator takes at most one savepoint");
    assert_eq!(d.status.pending_savepoint.unwrap().request_id.unwrap(), id);
}

#[test]
fn last_state_and_stateless_upgrades_restore_from_the_latest_checkpoint_or_nothing() {
    for (mode, restore) in [(UpgradeMode::LastState, Some("latest")), (UpgradeMode::Stateless, None)] {
        let mut w = World::running(JobBuilder::new("j").spec(|s| s.upgrade_mode = mode).build());
        w.job.spec.image = Some("weir:2".into());
        let d = w.step();
        assert_eq!(w.phase(), Some(Phase::Upgrading));
        assert!(savepoint_requests(std::slice::from_ref(&d)).is_empty());
        assert_eq!(d.status.run.unwrap().restore_from.as_deref(), restore);
    }
}

#[test]
fn a_failed_deploy_during_an_upgrade_does_not_leave_the_job_upgrading() {
    let mut w = World::running(JobBuilder::new("j").spec(|s| s.upgrade_mode = UpgradeMode::LastState).build());
    w.job.spec.image = Some("no-such-image".into());
    w.until(Phase::Upgrading);
    w.step(); // delete old pods
    w.step(); // create
    for p in w.pods.iter_mut() {
        waiting(p, "ErrImagePull", "pull access denied for no-such-image");
    }
    // The kubelet retries a pull; so does the operator, for a while.
    w.advance(START_GRACE - Duration::from_secs(1));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    assert!(w.job.status.as_ref().unwrap().message.as_ref().unwrap().contains("pull access denied"), "status says what the pods wait for");
    w.advance(Duration::from_secs(1));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    let message = w.job.status.as_ref().unwrap().message.clone().unwrap();
    assert!(message.contains("could not start within 60 s: ErrImagePull"), "{message}");
}

/// The worker container of `p` waits with `reason`.
fn waiting(p: &mut k8s_openapi::api::core::v1::Pod, reason: &str, message: &str) {
    p.status.as_mut().unwrap().container_statuses = Some(vec![k8s_openapi::api::core::v1::ContainerStatus {
        name: "worker".into(),
        state: Some(k8s_openapi::api::core::v1::ContainerState {
            waiting: Some(k8s_openapi::api::core::v1::ContainerStateWaiting { reason: Some(reason.into()), message: Some(message.into()) }),
            ..Default::default()
        }),
        ..Default::default()
    }]);
}

#[test]
fn a_worker_waiting_a_moment_for_its_secret_starts_without_a_restart() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    w.step(); // creates the pods
    waiting(&mut w.pods[1], "CreateContainerConfigError", "secret \"j-operator-token\" not found");
    w.advance(Duration::from_secs(2));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying), "no restart for a Secret that is a moment late");
    assert_eq!(w.job.status.as_ref().unwrap().restarts, 0);
    // The kubelet retried and the container started.
    w.pods[1].status.as_mut().unwrap().container_statuses = None;
    w.pods_run();
    w.until(Phase::Running);
    assert_eq!(w.job.status.as_ref().unwrap().restarts, 0);
}

#[test]
fn the_start_grace_counts_from_when_the_pod_was_scheduled() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    w.step(); // creates the pods
    // No node for two minutes (one is being added), then scheduled.
    w.advance(Duration::from_secs(120));
    let scheduled = k8s_openapi::api::core::v1::PodCondition {
        type_: "PodScheduled".into(),
        status: "True".into(),
        last_transition_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(w.now)),
        ..Default::default()
    };
    w.pods[0].status.as_mut().unwrap().conditions = Some(vec![scheduled]);
    waiting(&mut w.pods[0], "ErrImagePull", "registry did not answer");
    w.advance(Duration::from_secs(10));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying), "10 s of pulling is within the grace");
    w.advance(START_GRACE);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
}

#[test]
fn an_image_that_cannot_exist_fails_the_run_at_once() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    w.step(); // creates the pods
    waiting(&mut w.pods[0], "InvalidImageName", "couldn't parse image name");
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
}

#[test]
fn restarts_in_a_row_beyond_the_limit_fail_the_job_and_a_restart_trigger_starts_it_again() {
    let mut w = World::running(JobBuilder::new("j").spec(|s| s.restart_backoff.limit = 2).build());
    for round in 0..3 {
        let run = w.run_id();
        for p in w.pods.iter_mut().filter(|p| p.metadata.labels.as_ref().unwrap()[crate::names::RUN_LABEL] == run) {
            *p = exited(p.clone(), 1);
        }
        w.step();
        if round < 2 {
            assert_eq!(w.phase(), Some(Phase::Recovering), "round {round}");
            w.advance(Duration::from_secs(120));
            w.step();
            w.step();
            w.pods_run();
            w.until(Phase::Running);
        }
    }
    assert_eq!(w.phase(), Some(Phase::Failed));
    let st = w.job.status.clone().unwrap();
    assert!(st.message.unwrap().contains("restartTrigger"));
    w.job.spec.restart_trigger = Some("1".into());
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    assert_eq!(w.job.status.as_ref().unwrap().restarts_in_a_row, 0);
}

#[test]
fn a_completed_checkpoint_resets_the_failures_in_a_row() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    w.advance(Duration::from_secs(5));
    w.step();
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    assert_eq!(w.job.status.as_ref().unwrap().restarts_in_a_row, 1);
    w.advance(Duration::from_secs(1));
    w.checkpoint(3);
    w.step();
    let st = w.job.status.clone().unwrap();
    assert_eq!(st.restarts_in_a_row, 0);
    assert_eq!(st.restarts, 1);
}

#[test]
fn a_worker_exiting_with_a_fatal_error_fails_the_job_without_restarts() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 3);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert_eq!(d.status.restarts, 0);
    assert!(d.status.message.unwrap().contains("exit code 3"));
}

#[test]
fn suspend_takes_a_savepoint_stops_the_pods_and_resume_restores() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.state = JobState::Suspended;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Suspending));
    let (id, stop) = savepoint_requests(std::slice::from_ref(&d))[0].clone();
    assert!(stop);
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 4, location: "/cp/sp-4".into(), completed_unix_ms: 1, duration_ms: 1 }),
        error: None,
    }));
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods]);
    w.savepoint = None;
    w.coordinator = None;
    w.step();
    assert_eq!(w.phase(), Some(Phase::Suspended));
    assert_eq!(w.job.status.as_ref().unwrap().last_savepoint.as_ref().unwrap().reason, SavepointReason::Suspend);
    // Resumed from the suspend savepoint itself, not from the checkpoint
    // before it (`latest` knows checkpoints only).
    let suspended = w.job.clone();
    w.job.spec.state = JobState::Running;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    assert_eq!(d.status.run.unwrap().restore_from.as_deref(), Some("/cp/sp-4"));
    // A checkpoint newer than the savepoint (status edited, or a suspension
    // whose savepoint is older than the last checkpoint) wins: `latest`.
    w.job = suspended;
    let status = w.job.status.as_mut().unwrap();
    status.last_checkpoint = Some(CheckpointRef { id: 9, path: "/cp/chk-9".into(), time: status.last_savepoint.as_ref().unwrap().time.clone() });
    w.job.spec.state = JobState::Running;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    assert_eq!(d.status.run.unwrap().restore_from.as_deref(), Some("latest"));
}

#[test]
fn a_savepoint_trigger_takes_one_savepoint_without_stopping_the_job() {
    let mut w = World::running(JobBuilder::new("j").build());
    let run = w.run_id();
    w.job.spec.savepoint_trigger = Some("a".into());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
    let (id, stop) = savepoint_requests(std::slice::from_ref(&d))[0].clone();
    assert!(!stop, "a triggered savepoint does not stop the job");
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 5, location: "/cp/sp-5".into(), completed_unix_ms: 1, duration_ms: 1 }),
        error: None,
    }));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    w.savepoint = None;
    let d = w.step();
    assert!(d.effects.is_empty(), "one trigger value, one savepoint");
    let st = d.status;
    assert_eq!(st.savepoint_history.len(), 1);
    assert_eq!(st.observed_savepoint_trigger.as_deref(), Some("a"));
    assert_eq!(w.run_id(), run);
}

#[test]
fn a_restart_trigger_restarts_from_the_latest_checkpoint_without_counting_a_failure() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.restart_trigger = Some("r1".into());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    assert_eq!(d.status.restarts, 0);
    assert_eq!(d.status.run.unwrap().restore_from.as_deref(), Some("latest"));
}

#[test]
fn deletion_takes_a_final_savepoint_then_lets_the_job_go() {
    let w0 = World::running(JobBuilder::new("j").build());
    let mut w = w0.deleted();
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deleting));
    let d = w.step();
    let (id, stop) = savepoint_requests(std::slice::from_ref(&d))[0].clone();
    assert!(stop);
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 8, location: "/cp/sp-8".into(), completed_unix_ms: 1, duration_ms: 1 }),
        error: None,
    }));
    let d = w.step();
    assert!(d.effects.contains(&Effect::RemoveFinalizer));
    assert!(d.notes.iter().any(|n| n.reason == "FinalSavepointCompleted" && n.message.contains("sp-8")));
}

#[test]
fn deletion_never_waits_past_the_savepoint_timeout() {
    let w0 = World::running(JobBuilder::new("j").spec(|s| {
        s.savepoint_timeout = weir_api::pipeline::HumanDuration::from_millis(10_000);
        s.checkpoint.timeout = weir_api::pipeline::HumanDuration::from_millis(5_000);
    }).build());
    let mut w = w0.deleted();
    w.step();
    w.step();
    w.advance(Duration::from_secs(11));
    let d = w.step();
    assert!(d.effects.contains(&Effect::RemoveFinalizer));
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "DeletedWithoutSavepoint" && n.message.contains("savepointTimeout")));
}

#[test]
fn deletion_while_the_job_restarts_does_not_wait_for_it() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    w = w.deleted();
    w.step();
    let d = w.step();
    assert!(d.effects.contains(&Effect::RemoveFinalizer));
    assert!(d.notes.iter().any(|n| n.reason == "DeletedWithoutSavepoint"));
}

#[test]
fn an_initial_savepoint_is_used_once_and_a_later_change_is_reported_not_applied() {
    let job = JobBuilder::new("j").spec(|s| s.initial_savepoint = Some("/cp/sp-1".into())).build();
    let mut w = World::new(job);
    let d = w.step();
    assert_eq!(d.status.run.unwrap().restore_from.as_deref(), Some("/cp/sp-1"));
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    w.job.spec.initial_savepoint = Some("/cp/sp-2".into());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.effects.is_empty());
    assert!(d.status.message.unwrap().contains("initialSavepoint"));
}

#[test]
fn a_finished_job_stays_finished() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods = w.pods.iter().map(|p| exited(p.clone(), 0)).collect();
    w.step();
    assert_eq!(w.phase(), Some(Phase::Finished));
    let d = w.step();
    assert!(d.effects.is_empty());
    assert_eq!(w.phase(), Some(Phase::Finished));
}

#[test]
fn a_finished_job_on_the_default_image_is_not_run_again_when_the_default_changes_but_is_when_its_spec_does() {
    let mut w = World::new(JobBuilder::new("j").spec(|s| s.image = None).build());
    w.settings.default_image = Some("localhost/weir:0.1.0".into());
    w.until(Phase::Deploying);
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    assert_eq!(w.job.status.as_ref().unwrap().run.as_ref().unwrap().default_image.as_deref(), Some("localhost/weir:0.1.0"));
    w.pods = w.pods.iter().map(|p| exited(p.clone(), 0)).collect();
    w.until(Phase::Finished);
    // helm upgrade of the operator with a new worker image.
    w.settings.default_image = Some("localhost/weir:0.2.0".into());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Finished), "{:?}", d.status.message);
    assert!(d.effects.is_empty());
    // A change of the spec itself runs it again, on the new default.
    w.job.spec.parallelism = 3;
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    assert_eq!(w.job.status.as_ref().unwrap().run.as_ref().unwrap().default_image.as_deref(), Some("localhost/weir:0.2.0"));
}

#[test]
fn an_invalid_spec_change_keeps_the_running_job_and_says_why() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.pipeline.0["sink"] = serde_json::json!({"nowhere": {}});
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.effects.is_empty());
    assert!(d.status.message.unwrap().contains("spec change not applied"));
}

#[test]
fn a_retried_deletion_after_the_final_savepoint_does_not_take_another() {
    let w0 = World::running(JobBuilder::new("j").build());
    let mut w = w0.deleted();
    w.step();
    let d = w.step();
    let (id, _) = savepoint_requests(std::slice::from_ref(&d))[0].clone();
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 8, location: "/cp/sp-8".into(), completed_unix_ms: 1, duration_ms: 1 }),
        error: None,
    }));
    w.step();
    // Removing the finalizer failed (a conflict); the next reconcile only retries that.
    w.savepoint = Some(None);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::RemoveFinalizer]);
    assert!(savepoint_requests(std::slice::from_ref(&d)).is_empty());
}

#[test]
fn a_fatal_worker_error_while_a_savepoint_is_pending_fails_the_job_instead_of_restarting_it() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.job.spec.savepoint_trigger = Some("a".into());
    w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
    w.pods[0] = exited(w.pods[0].clone(), 3);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert_eq!(d.status.restarts, 0);
    assert!(d.status.pending_savepoint.is_none());
}

fn condition(d: &Decision, type_: &str) -> (String, String, String) {
    let c = d.status.conditions.iter().find(|c| c.type_ == type_).unwrap_or_else(|| panic!("no {type_} condition"));
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

#[test]
fn file_storage_without_a_shared_volume_is_refused_in_status_and_an_event_and_a_volume_starts_the_job() {
    let job = JobBuilder::new("j").spec(|s| s.pod_template = None).build();
    let mut w = World::new(job);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.effects.is_empty(), "nothing is created");
    let (status, reason, message) = condition(&d, "Degraded");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "SharedVolumeMissing"));
    assert!(message.contains("spec.podTemplate.spec.volumes"), "{message}");
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "SharedVolumeMissing" && n.message.contains("persistentVolumeClaim")));
    assert_eq!(w.step().notes, Vec::new(), "said once");
    // The user adds the claim: the job deploys.
    w.job = JobBuilder::new("j").generation(2).status(w.job.status.clone().unwrap()).build();
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
}

#[test]
fn a_job_without_an_image_starts_once_the_operator_has_a_default() {
    let mut w = World::new(JobBuilder::new("j").spec(|s| s.image = None).build());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert_eq!(condition(&d, "Degraded").1, "NoWorkerImage");
    assert!(d.status.message.unwrap().contains("set spec.image"));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed), "still no image");
    // The operator restarted with --default-worker-image; the spec is unchanged.
    w.settings.default_image = Some("localhost/weir:0.1.0".into());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    assert!(d.notes.iter().any(|n| n.message.contains("the operator now has a worker image")), "{:?}", d.notes);
}

#[test]
fn a_job_with_tls_starts_once_the_operator_trusts_a_worker_ca() {
    let mut w = World::new(JobBuilder::new("j").spec(|s| s.tls = Some(weir_api::streamjob::WorkerTls { secret_name: "j-tls".into() })).build());
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.effects.is_empty(), "nothing is created");
    assert_eq!(condition(&d, "Degraded").1, "NoWorkerCA");
    assert!(d.status.message.unwrap().contains("workerTls.caConfigMap"));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed), "still no CA");
    // The operator restarted with --worker-ca-file; the spec is unchanged.
    w.settings.worker_ca = true;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    assert!(d.notes.iter().any(|n| n.message.contains("now trusts a CA")), "{:?}", d.notes);
}

/// What the reconciler records when the API server refuses the run's pods.
fn refused_by_pod_security(w: &World) -> Rejection {
    Rejection {
        run_id: w.run_id(),
        reason: "PodRejected".into(),
        message: format!(
            "{} j-1-0 (403 Forbidden): pods \"j-1-0\" is forbidden: violates PodSecurity \"restricted:latest\": allowPrivilegeEscalation != false",
            super::REFUSED_POD
        ),
    }
}

#[test]
fn a_pod_the_api_server_refuses_is_reported_as_refused_and_retried_with_backoff_not_restarted() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    // The API server said 403: no pod exists.
    w.pods.clear();
    w.rejected = Some(refused_by_pod_security(&w));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying), "not a failure of the job: nothing ran");
    assert_eq!((d.status.restarts, d.status.last_failure.is_none()), (0, true));
    let run = d.status.run.clone().unwrap();
    assert!(!run.pods_created && run.refusals == 1);
    assert!(run.last_refusal.as_deref().unwrap().contains("violates PodSecurity"));
    let (status, reason, message) = condition(&d, "Degraded");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "PodRejected"));
    assert!(message.contains("violates PodSecurity \"restricted:latest\"") && message.contains("again in 1.0s"), "{message}");
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "PodRejected" && n.message.contains("allowPrivilegeEscalation")));
    assert!(!d.effects.contains(&Effect::CreateRun));
    // During the backoff: still Degraded, nothing created, no new event.
    let d = w.step();
    assert!(d.effects.is_empty() && d.notes.is_empty());
    assert_eq!(condition(&d, "Degraded").1, "PodRejected");
    assert!(d.status.message.unwrap().contains("violates PodSecurity"));
    // After it: created again (the reconciler forgets the refusal when it tries).
    w.advance(Duration::from_millis(1100));
    w.rejected = None;
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    // Refused again: the wait doubles.
    w.pods.clear();
    w.rejected = Some(refused_by_pod_security(&w));
    let d = w.step();
    assert_eq!(d.status.run.as_ref().unwrap().refusals, 2);
    assert!(d.status.message.unwrap().contains("again in 2.0s"));
    // Accepted at last: the job runs, no restart was ever counted.
    w.advance(Duration::from_secs(3));
    w.rejected = None;
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    assert_eq!(w.job.status.as_ref().unwrap().restarts, 0);
    assert_eq!(condition(&w.step(), "Degraded").0, "False");
}

#[test]
fn a_spec_change_retries_a_refused_run_at_once() {
    let mut w = World::new(JobBuilder::new("j").spec(|s| s.restart_backoff.initial = weir_api::pipeline::HumanDuration::from_millis(30_000)).build());
    w.until(Phase::Deploying);
    w.step();
    w.pods.clear();
    w.rejected = Some(refused_by_pod_security(&w));
    w.step();
    w.rejected = None;
    assert!(!w.step().effects.contains(&Effect::CreateRun), "waiting 30 s");
    // The user fixes the pod template.
    w.job.spec.pod_labels.insert("fixed".into(), "yes".into());
    w.job.metadata.generation = Some(2);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun], "no wait for the backoff");
    assert_eq!(d.status.run.unwrap().spec_hash, crate::spec_hash::spec_hash(&w.job.spec, Some("weir")), "the run takes the new spec");
    assert_eq!(w.phase(), Some(Phase::Deploying));
}

#[test]
fn pods_created_before_one_was_refused_are_removed_before_the_next_try() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    w.step();
    // A quota let worker 0 in and refused worker 1.
    w.pods.truncate(1);
    let admitted = w.pods.clone();
    w.rejected = Some(Rejection { run_id: w.run_id(), reason: "PodRejected".into(), message: format!("{} j-1-1 (403 Forbidden): exceeded quota", super::REFUSED_POD) });
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods], "the pod that got in holds the quota");
    w.rejected = None;
    w.advance(Duration::from_secs(2));
    // Still terminating: no new pods until it is gone.
    w.pods = admitted;
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods]);
    w.pods.clear();
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
}

#[test]
fn a_refused_recovery_is_not_counted_as_another_failure() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[1] = exited(w.pods[1].clone(), 137);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    w.step(); // old pods go
    w.advance(Duration::from_secs(2));
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    w.pods.clear();
    w.rejected = Some(refused_by_pod_security(&w));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    assert_eq!(d.status.restarts, 1, "the one failure, no second one for the refusal");
    assert!(d.status.message.unwrap().starts_with("recovering: the API server refused worker pod"));
}

#[test]
fn waiting_out_a_backoff_leaves_the_status_as_it_is() {
    // Every status write triggers the next reconcile (the watch): a status
    // that changed with the clock would be written over and over.
    let mut w = World::running(JobBuilder::new("j").spec(|s| s.restart_backoff.initial = weir_api::pipeline::HumanDuration::from_millis(10_000)).build());
    w.pods[1] = exited(w.pods[1].clone(), 137);
    w.step();
    w.step(); // old pods go
    let waiting = w.step().status;
    assert!(waiting.message.as_deref().unwrap().contains("backoff"), "{:?}", waiting.message);
    w.advance(Duration::from_millis(300));
    assert_eq!(w.step().status, waiting, "a restart backoff");
    // A refused run waits the same way.
    w.advance(Duration::from_secs(11));
    assert_eq!(w.step().effects, vec![Effect::CreateRun]);
    w.pods.clear();
    w.rejected = Some(refused_by_pod_security(&w));
    w.step();
    w.rejected = None;
    let waiting = w.step().status;
    w.advance(Duration::from_millis(300));
    assert_eq!(w.step().status, waiting, "a refusal's backoff");
}

/// Pods can look healthy while checkpoints stop completing (a wedged
/// subtask, storage that hangs): the job is Degraded after half of
/// `spec.checkpoint.progressTimeout` and restored after all of it.
#[test]
fn a_job_whose_checkpoints_stop_completing_is_degraded_then_restarted() {
    let job = JobBuilder::new("j").spec(|s| s.checkpoint.progress_timeout = Some(weir_api::pipeline::HumanDuration::from_millis(60_000))).build();
    let mut w = World::running(job);
    let old_run = w.run_id();
    for id in 1..=3 {
        w.advance(Duration::from_secs(5));
        w.checkpoint(id);
        let d = w.step();
        assert!(!d.status.conditions.iter().any(|c| c.type_ == "Degraded" && c.status == "True"), "degraded while checkpoints complete");
    }
    w.advance(Duration::from_secs(31));
    let d = w.step();
    let (status, reason, message) = condition(&d, "Degraded");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "CheckpointsStalled"), "{message}");
    assert_eq!(w.phase(), Some(Phase::Running));
    w.advance(Duration::from_secs(30));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    assert_ne!(w.run_id(), old_run);
    let failure = d.status.last_failure.unwrap();
    assert_eq!(failure.reason, "CheckpointsStalled");
    assert!(failure.message.contains("progressTimeout"), "{}", failure.message);
}

/// Without periodic checkpoints (interval 0s) there is no progress to watch.
#[test]
fn a_job_without_periodic_checkpoints_is_never_restarted_for_lack_of_them() {
    let job = JobBuilder::new("j").spec(|s| s.checkpoint.interval = weir_api::pipeline::HumanDuration::from_millis(0)).build();
    let mut w = World::running(job);
    let run = w.run_id();
    for _ in 0..10 {
        w.advance(Duration::from_secs(600));
        w.step();
    }
    assert_eq!((w.phase(), w.run_id()), (Some(Phase::Running), run));
}

/// Every pod of the run was on one node that is lost: no worker is left to
/// report a silent peer, and the pods look Running in the API for 40 s and
/// more. The coordinator not answering the operator for
/// `COORDINATOR_SILENCE_LIMIT` fails the run, and the next one starts at
/// once beside the pods of that node and away from it.
#[test]
fn a_run_whose_coordinator_stops_answering_the_operator_is_restored_without_waiting_for_its_pods() {
    use super::running::COORDINATOR_SILENCE_LIMIT;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    for p in w.pods.iter_mut() {
        p.spec = Some(k8s_openapi::api::core::v1::PodSpec { node_name: Some("node-1".into()), ..Default::default() });
    }
    let lost: Vec<_> = w.pods.clone();
    w.coordinator = None;
    w.coordinator_error = Some("connect timed out".into());
    let lost_at = w.now;
    // A moment of silence is no failure.
    w.advance(Duration::from_secs(2));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!(condition(&d, "Degraded").1, "CoordinatorUnreachable");
    let mut started = None;
    for _ in 0..80 {
        w.advance(Duration::from_millis(500));
        let d = w.step();
        // Deleted, they never go: their kubelet is gone.
        for p in &lost {
            if !w.pods.iter().any(|q| q.metadata.name == p.metadata.name) {
                let mut stuck = p.clone();
                stuck.metadata.deletion_timestamp = Some(Time(w.now.checked_add(Duration::from_secs(10)).unwrap()));
                w.pods.push(stuck);
            }
        }
        if d.effects.contains(&Effect::CreateRun) {
            let run = d.status.run.clone().unwrap();
            assert_ne!(run.id, old_run);
            assert_eq!(run.silent_pods.len(), 2, "{:?}", run.silent_pods);
            assert_eq!(run.avoid_nodes, vec!["node-1".to_string()]);
            assert_eq!(d.status.last_failure.as_ref().unwrap().reason, "CoordinatorUnreachable");
            started = Some(w.now);
            break;
        }
    }
    let waited = Duration::try_from(started.expect("no new run").duration_since(lost_at)).unwrap();
    assert!(waited < COORDINATOR_SILENCE_LIMIT + Duration::from_secs(4), "the new run started {waited:?} after the coordinator went silent");
}

/// A run of a job with spec.tls whose workers show a certificate the
/// operator refuses (not for the job's name, or of another CA): status says
/// what the certificate must be, not "a network rule".
#[test]
fn a_run_whose_certificate_the_operator_refuses_says_what_the_certificate_must_be() {
    use super::running::COORDINATOR_SILENCE_LIMIT;
    let mut w = World::running(JobBuilder::new("j").build());
    w.coordinator = None;
    w.coordinator_error = Some("worker control endpoint at 127.0.1.1:6120: error sending request for url (https://127.0.1.1:6120/v1/status): client error (Connect): invalid peer certificate: NotValidForName".into());
    w.step();
    w.advance(COORDINATOR_SILENCE_LIMIT + Duration::from_secs(1));
    let d = w.step();
    let failure = d.status.last_failure.as_ref().expect("a failure");
    assert_eq!(failure.reason, "CoordinatorUnreachable");
    assert!(failure.message.contains("refused the certificate of worker 0") && failure.message.contains("<job>-workers.<namespace>.svc"), "{}", failure.message);
    assert!(!failure.message.contains("network rule"), "{}", failure.message);
}

/// A run whose workers refuse the operator's token (started by an operator
/// from before the control key, whose tokens were random and read back
/// from Secrets): status says that, not "a network rule", and the job
/// restarts from its latest checkpoint, where the new run's workers get
/// the derived token.
#[test]
fn a_run_whose_workers_refuse_the_operators_token_says_so_and_restarts_from_its_latest_checkpoint() {
    use super::running::COORDINATOR_SILENCE_LIMIT;
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    w.coordinator = None;
    w.coordinator_error = Some("worker control endpoint at 127.0.1.1:6120: HTTP 401 Unauthorized: missing or wrong bearer token".into());
    w.step();
    w.advance(COORDINATOR_SILENCE_LIMIT + Duration::from_secs(1));
    let d = w.step();
    let failure = d.status.last_failure.as_ref().expect("a failure");
    assert_eq!(failure.reason, "CoordinatorUnreachable");
    assert!(failure.message.contains("HTTP 401") && failure.message.contains("another control token"), "{}", failure.message);
    assert!(failure.message.contains("refused the operator's control token"), "{}", failure.message);
    assert!(!failure.message.contains("network rule") && !failure.message.contains("sent nothing"), "{}", failure.message);
    assert_eq!(d.status.run.as_ref().unwrap().restore_from.as_deref(), Some("latest"));
    assert!(d.status.run.as_ref().unwrap().silent_pods.is_empty(), "its pods are not lost: the next run waits for them to go");
    assert_ne!(d.status.run.as_ref().unwrap().id, old_run);
}

/// A node killed outright (its processes gone at once, so worker 1's
/// connections closed instead of going silent): worker 1's pod is deleted
/// but never goes, and its kubelet no longer takes connections. The next
/// run starts without waiting for the deletion deadline, away from that node.
#[test]
fn a_pod_on_a_node_whose_kubelet_is_gone_is_not_waited_for() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut w = World::running(JobBuilder::new("j").build());
    let old_run = w.run_id();
    let mut failed = exited(w.pods[0].clone(), 1);
    let t = failed.status.as_mut().unwrap().container_statuses.as_mut().unwrap()[0].state.as_mut().unwrap().terminated.as_mut().unwrap();
    t.message = Some("Error: worker 1 was lost (connection closed)".into());
    w.pods[0] = failed;
    let mut lost = w.pods[1].clone();
    lost.spec = Some(k8s_openapi::api::core::v1::PodSpec { node_name: Some("node-2".into()), ..Default::default() });
    lost.status.as_mut().unwrap().host_ip = Some("10.0.0.2".into());
    w.pods[1] = lost.clone();
    w.kubelets_gone = vec!["10.0.0.2".parse().unwrap()];
    let failed_at = w.now;
    let mut started = None;
    for _ in 0..80 {
        let d = w.step();
        if !w.pods.iter().any(|p| p.metadata.name == lost.metadata.name) {
            let mut stuck = lost.clone();
            stuck.metadata.deletion_timestamp = Some(Time(w.now.checked_add(Duration::from_secs(10)).unwrap()));
            w.pods.push(stuck);
        }
        if d.effects.contains(&Effect::CreateRun) {
            let run = d.status.run.clone().unwrap();
            assert_ne!(run.id, old_run);
            assert_eq!(run.avoid_nodes, vec!["node-2".to_string()]);
            started = Some(w.now);
            break;
        }
        w.advance(Duration::from_millis(250));
    }
    let waited = Duration::try_from(started.expect("the new run waited for the lost node's pod").duration_since(failed_at)).unwrap();
    assert!(waited < Duration::from_secs(5), "waited {waited:?} for a pod whose kubelet is gone");
}

fn at_most_once_job() -> StreamJob {
    JobBuilder::new("j")
        .spec(|s| {
            s.pipeline.0["guarantee"] = serde_json::json!("at-most-once");
            s.upgrade_mode = UpgradeMode::Stateless;
            s.checkpoint.progress_timeout = Some(weir_api::pipeline::HumanDuration::from_millis(60_000));
        })
        .build()
}

/// An at-most-once job completes no checkpoint by design: the progress
/// watchdog must not take that for a stuck run.
#[test]
fn an_at_most_once_job_is_never_restarted_for_lack_of_checkpoints() {
    let mut w = World::running(at_most_once_job());
    let run = w.run_id();
    for _ in 0..10 {
        w.advance(Duration::from_secs(60));
        let d = w.step();
        assert!(!d.status.conditions.iter().any(|c| c.type_ == "Degraded" && c.status == "True"), "{:?}", d.status.conditions);
    }
    assert_eq!((w.phase(), w.run_id()), (Some(Phase::Running), run));
}

/// Suspending an at-most-once job asks for no savepoint (it would be
/// refused): the pods stop and the job is suspended.
#[test]
fn an_at_most_once_job_suspends_without_a_savepoint() {
    let mut w = World::running(at_most_once_job());
    w.job.spec.state = JobState::Suspended;
    let ds = w.until(Phase::Suspending);
    assert!(savepoint_requests(&ds).is_empty(), "{:?}", effects(&ds));
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods]);
    w.pods.clear();
    w.coordinator = None;
    w.until(Phase::Suspended);
}

/// A socket cannot replay: the StreamJob's status says the job is
/// at-most-once and why, whatever the pipeline asked for.
#[test]
fn a_socket_source_job_shows_at_most_once_and_why_in_its_status() {
    let job = JobBuilder::new("j")
        .spec(|s| {
            s.pipeline.0["source"] = serde_json::json!({"socket": {"address": "feed.events.svc:9000", "schema": {"id": "int64"}}});
            s.upgrade_mode = UpgradeMode::Stateless;
        })
        .build();
    let w = World::running(job);
    let st = w.job.status.clone().unwrap();
    assert_eq!(st.guarantee, Some(weir_api::Guarantee::AtMostOnce));
    let why = st.guarantee_reason.unwrap();
    assert!(why.contains("socket source cannot replay"), "{why}");
}

/// A job with several sinks promises its weakest sink's guarantee and its
/// status names that sink; it still takes checkpoints for the others.
#[test]
fn a_job_with_a_stdout_sink_beside_a_file_sink_names_the_sink_that_decides_its_guarantee() {
    let job = JobBuilder::new("j")
        .spec(|s| {
            s.pipeline.0 = serde_json::json!({
                "name": "j",
                "sources": {"events": {"generator": {"events": 1000, "keys": 10}}},
                "steps": [{"name": "keyed", "input": "events", "key_by": "key"}, {"name": "counts", "input": "keyed", "running_count": "count"}],
                "sinks": {
                    "files": {"input": "counts", "file": {"path": "out", "format": "jsonl"}},
                    "debug": {"input": "counts", "stdout": {}},
                },
            });
        })
        .build();
    let w = World::running(job);
    let st = w.job.status.clone().unwrap();
    assert_eq!(st.guarantee, Some(weir_api::Guarantee::AtLeastOnce));
    assert_eq!(st.guarantee_decided_by.as_deref(), Some("debug"));
    let why = st.guarantee_reason.unwrap();
    assert!(why.contains("stdout sink `debug`"), "{why}");
}
