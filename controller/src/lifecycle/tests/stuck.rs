//! No stuck state without a deadline and a reason: a run that does not come
//! up is reported with what it waits for and fails by spec.deployTimeout;
//! runs and pods are decided from one spec; Failed deletes its pods and a
//! new generation starts it again; triggers in a new manifest are part of
//! its first deploy.

use std::time::Duration;

use k8s_openapi::api::core::v1::PodCondition;
use weir_api::pipeline::HumanDuration;
use weir_api::streamjob::{Phase, RunStatus};

use super::{condition, exited, World};
use crate::lifecycle::deadline::{deadline, DEPLOY_TIMEOUT};
use crate::lifecycle::Effect;
use crate::testing::JobBuilder;

const UNBOUND: &str = "0/2 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: 0/2 nodes are available";

/// A job whose run must be up within 2 minutes.
fn two_minutes() -> JobBuilder {
    JobBuilder::new("j").spec(|s| s.deploy_timeout = HumanDuration::from_millis(120_000))
}

/// The run's pods wait for a volume claim that does not bind.
fn claim_unbound(w: &mut World) {
    for p in w.pods.iter_mut() {
        p.status.as_mut().unwrap().conditions = Some(vec![PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some(UNBOUND.into()),
            ..Default::default()
        }]);
    }
}

/// `kubectl apply` of a change: the API server bumps the generation.
fn apply(w: &mut World, f: impl FnOnce(&mut weir_api::streamjob::StreamJobSpec)) {
    f(&mut w.job.spec);
    w.job.metadata.generation = Some(w.job.metadata.generation.unwrap_or(1) + 1);
}

fn run(w: &World) -> RunStatus {
    w.job.status.as_ref().unwrap().run.clone().unwrap()
}

fn current_hash(w: &World) -> String {
    let image = crate::desired::worker_image(&w.job, &w.settings);
    crate::spec_hash::spec_hash(&w.job.spec, image.as_deref())
}

#[test]
fn the_deploy_deadline_counts_from_the_creation_of_the_pods_not_from_the_decision() {
    let w = World::new(JobBuilder::new("j").build());
    let mut r = RunStatus { generation: Some(1), ..RunStatus::decided("r".into(), 1, "h".into(), 1, k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(w.now)) };
    let minute = Duration::from_secs(60);
    assert_eq!(deadline(&r, minute), None, "a backoff, old pods going, an operator down: no deploy time yet");
    let created = w.now.checked_add(Duration::from_secs(30)).unwrap();
    r.pods_created = true;
    r.pods_created_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(created));
    assert_eq!(deadline(&r, minute), Some(created.checked_add(minute).unwrap()));
    r.pods_created = false;
    assert_eq!(deadline(&r, minute), None, "refused pods are tried again later, with a deadline of their own");
}

#[test]
fn a_pending_pod_is_reported_with_what_it_waits_for_and_the_deadline() {
    let mut w = World::new(two_minutes().build());
    w.until(Phase::Deploying);
    w.step();
    let due = w.now.checked_add(Duration::from_secs(120)).unwrap();
    claim_unbound(&mut w);
    w.advance(Duration::from_secs(5));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
    let message = d.status.message.clone().unwrap();
    assert!(message.contains("unbound immediate PersistentVolumeClaims"), "{message}");
    assert!(message.contains(&format!("deadline {due} (spec.deployTimeout 2m)")), "{message}");
    assert!(d.requeue <= Duration::from_secs(115), "looks again by the deadline: {:?}", d.requeue);
    // The message is a fixed time: a later look writes nothing new.
    w.advance(Duration::from_secs(5));
    assert_eq!(w.step().status.message.unwrap(), message);
}

#[test]
fn a_run_not_up_by_its_deploy_timeout_fails_the_job_with_the_reason_and_its_pods_are_deleted() {
    let mut w = World::new(two_minutes().build());
    w.until(Phase::Deploying);
    w.step();
    claim_unbound(&mut w);
    w.advance(Duration::from_secs(119));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying), "not before the deadline");
    w.advance(Duration::from_secs(1));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    let failure = d.status.last_failure.clone().unwrap();
    assert_eq!(failure.reason, DEPLOY_TIMEOUT);
    assert!(failure.message.contains("did not come up within spec.deployTimeout (2m)") && failure.message.contains("unbound immediate"), "{}", failure.message);
    assert_eq!(d.status.restarts, 0, "a restart cannot bind a claim");
    let (status, reason, _) = condition(&d, "Degraded");
    assert_eq!((status.as_str(), reason.as_str()), ("True", DEPLOY_TIMEOUT));
    let (ready, _, _) = condition(&d, "Ready");
    assert_eq!(ready, "False");
    // Failed keeps no pod: they would hold their node and volume forever.
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods]);
    assert!(w.pods.is_empty());
    assert!(w.step().effects.is_empty(), "nothing left to delete");
    assert_eq!(w.phase(), Some(Phase::Failed));
}

#[test]
fn a_joining_run_the_operator_cannot_reach_says_why_and_what_it_must_reach() {
    let mut w = World::new(two_minutes().build());
    w.until(Phase::Deploying);
    w.step();
    w.pods_run();
    w.coordinator = None;
    w.coordinator_error = Some("worker 127.0.1.1:6120: error sending request: operation timed out".into());
    w.step();
    w.advance(Duration::from_secs(3));
    let d = w.step();
    assert!(!d.status.message.clone().unwrap().contains("cannot reach"), "a worker takes a moment to listen");
    w.advance(Duration::from_secs(6));
    let d = w.step();
    let (status, reason, message) = condition(&d, "Degraded");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "ControlEndpointUnreachable"));
    assert!(message.contains("cannot reach worker 0's control endpoint 127.0.1.1:6120") && message.contains("operation timed out"), "{message}");
    assert!(message.contains("port 6120") && message.contains("NetworkPolicy"), "says what the operator must reach: {message}");
    assert!(d.status.message.unwrap().contains("deadline"), "and until when");
    w.advance(Duration::from_secs(120));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.status.last_failure.unwrap().message.contains("cannot reach worker 0's control endpoint"));
}

#[test]
fn a_spec_change_while_the_pods_are_pending_replaces_them_with_a_run_of_the_new_spec() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    w.step();
    claim_unbound(&mut w);
    w.step();
    let old = run(&w);
    // The fix: another parallelism (and, say, another claim).
    apply(&mut w, |s| s.parallelism = 3);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteOtherPods], "the old spec's pods go first");
    let new = run(&w);
    assert_eq!((new.number, new.workers, new.generation), (old.number + 1, 3, Some(2)));
    assert_eq!(new.spec_hash, current_hash(&w), "the run is of the spec its pods are built from");
    assert_eq!(new.restore_from, old.restore_from);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    assert_eq!(w.pods.len(), 3);
    w.pods_run();
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!((d.status.deployed_spec_hash.clone(), d.status.deployed_generation), (Some(current_hash(&w)), Some(2)));
    assert_eq!(d.status.restarts, 0, "a replaced run is no failure");
}

#[test]
fn a_spec_change_before_the_pods_are_created_is_taken_by_the_pending_run() {
    let mut w = World::running(JobBuilder::new("j").spec(|s| s.restart_backoff.initial = HumanDuration::from_millis(30_000)).build());
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    w.step();
    assert!(w.pods.is_empty() && !run(&w).pods_created, "waiting out the backoff");
    apply(&mut w, |s| s.parallelism = 3);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun], "a fixed spec is tried at once");
    let r = run(&w);
    assert_eq!((r.workers, r.generation, r.spec_hash.clone()), (3, Some(2), current_hash(&w)));
    assert_eq!(w.pods.len(), 3, "as many pods as the run has workers");
}

#[test]
fn a_spec_change_after_the_workers_got_their_membership_waits_for_the_upgrade() {
    let mut w = World::new(JobBuilder::new("j").build());
    w.until(Phase::Deploying);
    w.step();
    w.pods_run();
    w.coordinator = None;
    w.step();
    let before = run(&w);
    apply(&mut w, |s| s.parallelism = 3);
    let d = w.step();
    assert!(matches!(&d.effects[..], [Effect::SendMembership { .. }]), "{:?}", d.effects);
    assert_eq!(run(&w).id, before.id, "the run keeps its spec; Running upgrades it");
}

#[test]
fn a_recovery_never_runs_a_spec_the_operator_refused() {
    let mut w = World::running(JobBuilder::new("j").build());
    let deployed = run(&w);
    apply(&mut w, |s| {
        s.parallelism = 3;
        s.pipeline.0["steps"] = serde_json::json!([{"explode": "x"}]);
    });
    w.step();
    assert_eq!(w.phase(), Some(Phase::Running), "the refused change is not applied");
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    let r = run(&w);
    assert_ne!(r.id, deployed.id);
    assert_eq!((r.spec_hash.clone(), r.generation, r.workers), (deployed.spec_hash.clone(), deployed.generation, 2), "the deployed spec, not the refused one");
    assert_eq!(w.job.status.as_ref().unwrap().deployed_spec_hash.as_deref(), Some(deployed.spec_hash.as_str()));
    w.advance(Duration::from_secs(60));
    w.step();
    let d = w.step();
    assert!(d.effects.contains(&Effect::CreateRun), "{:?}", d.effects);
    assert_eq!(w.pods.len(), 2);
}

#[test]
fn failed_deletes_the_pods_of_the_run_that_failed() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 3);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteAllPods], "worker 1 would wait for a peer that never comes");
}

#[test]
fn any_new_generation_starts_a_failed_job_again() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 3);
    w.step();
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed), "nothing new: it stays");
    // A change that shapes no pod (the backoff) still is the user acting.
    apply(&mut w, |s| s.restart_backoff.limit = 20);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
}

#[test]
fn a_fix_pushed_while_the_last_recovery_ran_starts_the_failed_job_again() {
    let mut w = World::running(JobBuilder::new("j").spec(|s| s.restart_backoff.limit = 1).build());
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    w.advance(Duration::from_secs(60));
    w.step();
    w.step();
    w.pods_run();
    w.coordinator = None;
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering), "the workers join");
    let failing = run(&w);
    // The fix arrives while the recovered run is joining; it fails before the upgrade.
    apply(&mut w, |s| {
        s.pod_labels.insert("fixed".into(), "yes".into());
    });
    w.step();
    assert_eq!(run(&w).id, failing.id);
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert_eq!(w.job.status.as_ref().unwrap().failed_generation, Some(2));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying), "the spec that failed is not the current one: {:?}", d.status.message);
    assert_eq!(run(&w).spec_hash, current_hash(&w));
}

#[test]
fn a_failed_job_whose_new_generation_is_refused_says_so_once_and_stays() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.pods[0] = exited(w.pods[0].clone(), 3);
    w.step();
    w.step();
    apply(&mut w, |s| s.pipeline.0["steps"] = serde_json::json!([{"explode": "x"}]));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert_eq!(d.notes.len(), 1, "one warning");
    let d = w.step();
    assert!(d.notes.is_empty() && d.effects.is_empty(), "no warning at every reconcile: {:?}", d.notes);
}

#[test]
fn triggers_in_a_new_manifest_are_part_of_the_first_deploy_not_requests() {
    let job = JobBuilder::new("j")
        .spec(|s| {
            s.savepoint_trigger = Some("s1".into());
            s.restart_trigger = Some("r1".into());
        })
        .build();
    let mut w = World::running(job);
    let run_id = w.run_id();
    for _ in 0..3 {
        let d = w.step();
        assert!(d.effects.is_empty(), "{:?}", d.effects);
    }
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!(w.run_id(), run_id, "no restart");
    let st = w.job.status.clone().unwrap();
    assert_eq!((st.observed_savepoint_trigger.as_deref(), st.observed_restart_trigger.as_deref()), (Some("s1"), Some("r1")));
    // A new value later is a request.
    w.job.spec.savepoint_trigger = Some("s2".into());
    w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
}

#[test]
fn a_network_rule_that_cuts_the_operator_off_is_named_at_the_restart_and_while_the_next_run_joins() {
    let mut w = World::running(two_minutes().build());
    // A default-deny NetworkPolicy arrives: the operator's requests time out.
    w.coordinator = None;
    w.coordinator_error = Some("worker 127.0.1.1:6120: error sending request: operation timed out".into());
    w.step();
    w.advance(Duration::from_secs(9));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    let failure = d.status.last_failure.unwrap().message;
    assert!(failure.contains("a network rule") && failure.contains("port 6120"), "{failure}");
    // The next run's pods run but cannot be given their membership.
    w.advance(Duration::from_secs(60));
    w.step();
    w.step();
    w.pods_run();
    w.coordinator = None;
    w.step();
    w.advance(Duration::from_secs(9));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    let (_, reason, message) = condition(&d, "Degraded");
    assert_eq!(reason, "ControlEndpointUnreachable", "not 'joining' with no reason: {message}");
    let shown = d.status.message.unwrap();
    assert!(shown.starts_with("recovering: workers of run 2 joining: the operator cannot reach worker 0's control endpoint") && shown.contains("deadline"), "{shown}");
}

#[test]
fn a_pod_stuck_creating_its_container_names_that_and_where_to_look_not_containers_not_ready() {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
    let mut w = World::new(two_minutes().build());
    w.until(Phase::Deploying);
    w.step();
    // Scheduled; the volume cannot attach (Multi-Attach), which only the pod's events say.
    for p in w.pods.iter_mut() {
        let st = p.status.as_mut().unwrap();
        st.conditions = Some(vec![
            PodCondition { type_: "Ready".into(), status: "False".into(), reason: Some("ContainersNotReady".into()), message: Some("containers with unready status: [worker]".into()), ..Default::default() },
            PodCondition { type_: "PodScheduled".into(), status: "True".into(), ..Default::default() },
        ]);
        st.container_statuses = Some(vec![ContainerStatus {
            name: "worker".into(),
            state: Some(ContainerState { waiting: Some(ContainerStateWaiting { reason: Some("ContainerCreating".into()), message: None }), ..Default::default() }),
            ..Default::default()
        }]);
    }
    let d = w.step();
    let message = d.status.message.unwrap();
    assert!(message.contains("ContainerCreating (its events say why: kubectl describe pod j-"), "{message}");
    assert!(!message.contains("unready status"), "{message}");
    w.advance(Duration::from_secs(120));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
}
