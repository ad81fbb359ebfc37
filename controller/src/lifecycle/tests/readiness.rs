//! What `Ready` says about a change, as `kubectl wait --for=condition=Ready`
//! and Argo CD read it: True at a generation only once that generation's
//! spec runs, False with a reason and a message when it is refused or its
//! upgrade failed.

use std::time::Duration;

use weir_api::control::{CheckpointStatus, SavepointOutcome, SavepointState};
use weir_api::streamjob::{JobState, Phase, StreamJobSpec, UpgradeMode};

use super::{condition, savepoint_requests, World};
use crate::lifecycle::Decision;
use crate::testing::JobBuilder;

/// `kubectl apply` of a change: the API server bumps the generation.
fn apply(w: &mut World, f: impl FnOnce(&mut StreamJobSpec)) {
    f(&mut w.job.spec);
    let generation = w.job.metadata.generation.unwrap_or(1);
    w.job.metadata.generation = Some(generation + 1);
}

/// The hash of the spec as it stands in `w`.
fn current_hash(w: &World) -> String {
    let image = crate::desired::worker_image(&w.job, &w.settings);
    crate::spec_hash::spec_hash(&w.job.spec, image.as_deref())
}

/// Ready's (status, reason, message, observedGeneration).
fn ready(d: &Decision) -> (String, String, String, Option<i64>) {
    let (status, reason, message) = condition(d, "Ready");
    let generation = d.status.conditions.iter().find(|c| c.type_ == "Ready").and_then(|c| c.observed_generation);
    (status, reason, message, generation)
}

/// What `kubectl wait --for=condition=Ready` concludes from the status.
fn wait_returns(w: &World) -> bool {
    let st = w.job.status.as_ref().expect("a status");
    st.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True" && c.observed_generation >= w.job.metadata.generation)
}

fn completed(request_id: String, id: u64) -> Option<Option<SavepointOutcome>> {
    Some(Some(SavepointOutcome {
        request_id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id, location: format!("/cp/savepoints/sp-{id}"), completed_unix_ms: 1, duration_ms: 2 }),
        error: None,
    }))
}

#[test]
fn a_first_deploy_is_ready_and_names_its_spec_hash_only_once_every_worker_runs() {
    let mut w = World::new(JobBuilder::new("j").build());
    let d = w.step();
    assert_eq!(ready(&d).0, "False");
    assert_eq!(ready(&d).1, "Deploying");
    assert_eq!(d.status.deployed_spec_hash, None, "nothing runs yet");
    w.step();
    w.pods_run();
    let d = w.until(Phase::Running).pop().unwrap();
    assert_eq!(ready(&d).0, "True");
    assert_eq!(ready(&d).3, Some(1));
    assert_eq!(d.status.deployed_spec_hash, Some(current_hash(&w)));
    assert_eq!(d.status.deployed_generation, Some(1));
}

#[test]
fn a_refused_change_keeps_ready_false_at_the_new_generation_and_names_the_generation_that_runs() {
    let mut w = World::running(JobBuilder::new("j").build());
    let running_hash = current_hash(&w);
    apply(&mut w, |s| s.pipeline.0["sink"] = serde_json::json!({"nowhere": {}}));
    for _ in 0..3 {
        let d = w.step();
        assert_eq!(w.phase(), Some(Phase::Running), "the previous spec keeps running");
        let (status, reason, message, generation) = ready(&d);
        assert_eq!((status.as_str(), reason.as_str(), generation), ("False", "SpecRefused", Some(2)));
        assert!(message.contains("generation 2 is refused") && message.contains("generation 1 keeps running"), "{message}");
        assert_eq!(d.status.observed_generation, Some(2), "the status judges the new generation");
        assert_eq!(d.status.deployed_spec_hash.as_deref(), Some(running_hash.as_str()));
        assert_eq!(d.status.deployed_generation, Some(1));
        assert_eq!(condition(&d, "Degraded").0, "True");
        assert!(!wait_returns(&w), "kubectl wait times out on a refused change");
    }
}

#[test]
fn a_refused_change_of_lifecycle_fields_only_is_not_ready_either() {
    let mut w = World::running(JobBuilder::new("j").build());
    // Backoff bounds in the wrong order: no pod-shaping field changes.
    apply(&mut w, |s| s.restart_backoff.initial = weir_api::pipeline::HumanDuration::from_millis(3_600_000));
    let d = w.step();
    assert_eq!(ready(&d).1, "SpecRefused", "{}", ready(&d).2);
    assert_eq!(d.status.deployed_generation, Some(1), "a refused generation never runs");
}

#[test]
fn an_upgrade_is_not_ready_until_the_new_spec_runs_and_then_names_the_new_hash() {
    let mut w = World::running(JobBuilder::new("j").build());
    let old_hash = current_hash(&w);
    apply(&mut w, |s| s.parallelism = 3);
    let new_hash = current_hash(&w);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    let (status, reason, message, generation) = ready(&d);
    assert_eq!((status.as_str(), reason.as_str(), generation), ("False", "Upgrading", Some(2)));
    assert!(message.contains("generation 2 does not run yet") && message.contains("generation 1 keeps running"), "{message}");
    let id = savepoint_requests(std::slice::from_ref(&d))[0].0.clone();
    w.savepoint = completed(id, 9);
    let mut steps = vec![w.step()];
    w.savepoint = None;
    steps.push(w.step()); // the old pods go
    steps.push(w.step()); // the new ones are created
    w.pods_run();
    steps.extend(w.until(Phase::Running));
    let (done, upgrading) = steps.split_last().unwrap();
    for d in upgrading {
        assert_eq!(ready(d).0, "False", "{:?}: {}", d.status.phase, ready(d).2);
        assert_eq!(d.status.deployed_spec_hash.as_deref(), Some(old_hash.as_str()), "the old spec is what ran last");
    }
    assert!(ready(&upgrading[1]).2.contains("no pods run"), "{}", ready(&upgrading[1]).2);
    assert_eq!((ready(done).0.as_str(), ready(done).1.as_str(), ready(done).3), ("True", "Running", Some(2)));
    assert_eq!(done.status.deployed_spec_hash, Some(new_hash));
    assert_eq!(done.status.deployed_generation, Some(2));
    assert!(wait_returns(&w));
}

#[test]
fn a_failed_upgrade_savepoint_is_not_ready_with_the_reason_until_the_upgrade_runs() {
    let mut w = World::running(JobBuilder::new("j").build());
    apply(&mut w, |s| s.parallelism = 3);
    let d = w.step();
    let id = savepoint_requests(std::slice::from_ref(&d))[0].0.clone();
    w.savepoint = Some(Some(SavepointOutcome { request_id: id, state: SavepointState::Failed, savepoint: None, error: Some("checkpoint declined by subtask 1".into()) }));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running), "the old spec keeps running");
    let (status, reason, message, generation) = ready(&d);
    assert_eq!((status.as_str(), reason.as_str(), generation), ("False", "UpgradeFailed", Some(2)));
    assert!(message.contains("declined") && message.contains("generation 1 keeps running") && message.contains("generation 2"), "{message}");
    assert_eq!(condition(&d, "Degraded").1, "SavepointFailed");
    // While the retry waits, nothing changes that.
    w.savepoint = None;
    let d = w.step();
    assert_eq!(ready(&d).1, "UpgradeFailed");
    assert!(!wait_returns(&w));
}

#[test]
fn a_spec_change_while_the_upgrade_limit_is_taken_keeps_the_old_spec_running_not_ready_until_a_slot_frees() {
    let mut w = World::running(JobBuilder::new("j").build());
    w.upgrades = crate::lifecycle::UpgradeSlots { taken: 2, limit: Some(2) };
    let run = w.run_id();
    apply(&mut w, |s| s.parallelism = 3);
    for _ in 0..3 {
        let d = w.step();
        assert_eq!(w.phase(), Some(Phase::Running), "the old spec keeps running");
        assert!(savepoint_requests(std::slice::from_ref(&d)).is_empty(), "no upgrade savepoint while queued");
        let (status, reason, message, generation) = ready(&d);
        assert_eq!((status.as_str(), reason.as_str(), generation), ("False", "UpgradeQueued", Some(2)));
        assert!(message.contains("2 other jobs are upgrading") && message.contains("at most 2"), "{message}");
        assert!(d.requeue <= std::time::Duration::from_secs(2), "a queued upgrade looks again soon");
        assert!(!wait_returns(&w));
    }
    assert_eq!(w.run_id(), run);
    // A slot frees: the upgrade goes ahead as any other.
    w.upgrades.taken = 1;
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    assert_eq!(savepoint_requests(std::slice::from_ref(&d)).len(), 1);
    assert!(crate::lifecycle::upgrade_in_flight(&d.status), "it now takes a slot itself");
}

#[test]
fn a_manual_savepoint_keeps_the_job_ready() {
    let mut w = World::running(JobBuilder::new("j").build());
    let since = w.job.status.as_ref().unwrap().conditions.iter().find(|c| c.type_ == "Ready").unwrap().last_transition_time.clone();
    apply(&mut w, |s| s.savepoint_trigger = Some("one".into()));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
    assert_eq!((ready(&d).0.as_str(), ready(&d).3), ("True", Some(2)), "{}", ready(&d).2);
    assert_eq!(d.status.deployed_generation, Some(2), "a trigger needs no new pods");
    let id = savepoint_requests(std::slice::from_ref(&d))[0].0.clone();
    w.savepoint = completed(id, 4);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    let c = d.status.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!((c.status.as_str(), &c.last_transition_time), ("True", &since), "Ready never flipped");
}

#[test]
fn a_change_of_lifecycle_fields_only_is_ready_at_the_new_generation_at_once() {
    let mut w = World::running(JobBuilder::new("j").build());
    apply(&mut w, |s| s.upgrade_mode = UpgradeMode::LastState);
    let d = w.step();
    assert_eq!((ready(&d).0.as_str(), ready(&d).3), ("True", Some(2)));
    assert_eq!(d.status.deployed_generation, Some(2));
    assert!(wait_returns(&w));
}

#[test]
fn a_suspended_job_is_not_ready() {
    let mut w = World::running(JobBuilder::new("j").build());
    apply(&mut w, |s| s.state = JobState::Suspended);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Suspending));
    assert_eq!(ready(&d).0, "False");
    let id = savepoint_requests(std::slice::from_ref(&d))[0].0.clone();
    w.savepoint = completed(id, 5);
    let d = w.until(Phase::Suspended).pop().unwrap();
    assert_eq!((ready(&d).0.as_str(), ready(&d).1.as_str()), ("False", "Suspended"));
}

#[test]
fn a_job_whose_checkpoints_stall_is_not_ready() {
    let job = JobBuilder::new("j").spec(|s| s.checkpoint.progress_timeout = Some(weir_api::pipeline::HumanDuration::from_millis(60_000))).build();
    let mut w = World::running(job);
    w.advance(Duration::from_secs(31));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!((ready(&d).0.as_str(), ready(&d).1.as_str()), ("False", "CheckpointsStalled"));
}
