//! spec.upgrade.rollback: an upgrade whose new spec does not become healthy
//! (every worker up, a checkpoint completed) by the readiness deadline, or
//! fails in a way a restart does not fix, goes back once to the last spec
//! that ran healthy; status says RolledBack and why, and the rolled-back
//! generation is not tried again until the spec changes.

use std::time::Duration;

use weir_api::control::{CheckpointStatus, SavepointOutcome, SavepointState};
use weir_api::pipeline::HumanDuration;
use weir_api::streamjob::{Phase, StreamJobSpec, StreamJobStatus, UpgradeMode};

use super::{condition, effects, exited, savepoint_requests, World};
use crate::lifecycle::rollback::READINESS_TIMEOUT;
use crate::lifecycle::{Decision, Effect};
use crate::testing::JobBuilder;

const SAVEPOINT: &str = "/cp/savepoints/sp-9";

/// A job with rollback on and two minutes for a new spec to become healthy.
fn with_rollback() -> JobBuilder {
    JobBuilder::new("j").spec(|s| {
        s.upgrade.rollback.enabled = true;
        s.upgrade.rollback.readiness_timeout = HumanDuration::from_millis(120_000);
    })
}

/// A running job whose run completed checkpoint 1: its spec is stable.
fn healthy(job: JobBuilder) -> World {
    let mut w = World::running(job.build());
    w.advance(Duration::from_secs(1));
    w.checkpoint(1);
    w.step();
    assert!(status(&w).last_stable_spec.is_some(), "a run that checkpointed makes its spec the last stable one");
    w
}

/// `kubectl apply` of a change: the API server bumps the generation.
fn apply(w: &mut World, f: impl FnOnce(&mut StreamJobSpec)) {
    f(&mut w.job.spec);
    w.job.metadata.generation = Some(w.job.metadata.generation.unwrap_or(1) + 1);
}

fn status(w: &World) -> StreamJobStatus {
    w.job.status.clone().unwrap()
}

/// Takes the upgrade savepoint the operator asks for.
fn complete_savepoint(w: &mut World, d: &Decision) -> Decision {
    let id = savepoint_requests(std::slice::from_ref(d))[0].0.clone();
    w.savepoint = Some(Some(SavepointOutcome {
        request_id: id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id: 9, location: SAVEPOINT.into(), completed_unix_ms: w.now.as_millisecond() as u64, duration_ms: 2 }),
        error: None,
    }));
    let d = w.step();
    w.savepoint = None;
    d
}

/// Applies a bad image and upgrades with a savepoint until the new run's
/// pods exist (and never start: the image does not exist).
fn bad_upgrade(w: &mut World) {
    apply(w, |s| s.image = Some("weir:no-such-tag".into()));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    complete_savepoint(w, &d);
    w.step(); // the old pods go
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    assert_eq!(status(w).run.unwrap().generation, Some(2));
}

fn warnings(ds: &[Decision], reason: &str) -> Vec<String> {
    ds.iter().flat_map(|d| d.notes.iter()).filter(|n| n.warning && n.reason == reason).map(|n| n.message.clone()).collect()
}

fn events(ds: &[Decision], reason: &str) -> Vec<String> {
    ds.iter().flat_map(|d| d.notes.iter()).filter(|n| n.reason == reason).map(|n| n.message.clone()).collect()
}

#[test]
fn an_upgrade_not_healthy_by_the_readiness_timeout_is_rolled_back_to_the_previous_spec_from_its_savepoint() {
    let mut w = healthy(with_rollback());
    let stable = status(&w).last_stable_spec.unwrap();
    let old_hash = status(&w).run.unwrap().spec_hash;
    assert_eq!(stable.spec_hash, old_hash);
    bad_upgrade(&mut w);
    let trial = status(&w).upgrade_trial.expect("the upgrade is on trial");
    assert_eq!(trial.generation, Some(2));
    assert_eq!(trial.savepoint.as_deref(), Some(SAVEPOINT));
    // The pods wait for an image that never comes; before the deadline, nothing.
    w.advance(Duration::from_secs(119));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    assert!(d.status.message.unwrap().contains("waiting"));
    w.advance(Duration::from_secs(1));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    let st = d.status.clone();
    assert!(st.upgrade_trial.is_none());
    let rb = st.rollback.clone().expect("the rollback is recorded");
    assert_eq!((rb.generation, rb.to_generation, rb.reason.as_str()), (Some(2), Some(1), READINESS_TIMEOUT));
    assert_ne!(rb.spec_hash, old_hash);
    assert_eq!(rb.to_spec_hash, old_hash);
    let run = st.run.unwrap();
    assert_eq!((run.spec_hash.as_str(), run.generation, run.workers), (old_hash.as_str(), Some(1), 2), "the run is of the last stable spec");
    // The job's newest state: the upgrade's savepoint, since the new spec completed no checkpoint.
    assert_eq!(run.restore_from.as_deref(), Some("latest"));
    let said = warnings(std::slice::from_ref(&d), "RollingBack");
    assert_eq!(said.len(), 1);
    assert!(said[0].contains("generation 2 did not become healthy") && said[0].contains("readinessTimeout 2m"), "{}", said[0]);
    assert!(said[0].contains("rolling back to generation 1") && said[0].contains(SAVEPOINT), "{}", said[0]);
    let (_, reason, _) = condition(&d, "Degraded");
    assert_eq!(reason, READINESS_TIMEOUT);
    // The bad pods go, the old spec's pods come, from the stable spec kept in status.
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::DeleteOtherPods]);
    let d = w.step();
    assert_eq!(d.effects, vec![Effect::CreateRun]);
    let run = status(&w).run.unwrap();
    let (built, same) = crate::desired::job_for_run(&w.job, &run, crate::desired::stable_spec_of(&status(&w), &run), &w.settings);
    assert!(same, "the rollback's pods are built from the stable spec");
    assert_eq!(built.spec.image.as_deref(), Some("weir"), "the stable spec's image, not the bad one");
    w.pods_run();
    let ds = w.until(Phase::Running);
    let d = ds.last().unwrap();
    let rolled = warnings(&ds, "RolledBack");
    assert_eq!(rolled.len(), 1);
    assert!(rolled[0].contains("generation 2 was rolled back") && rolled[0].contains("generation 1 runs"), "{}", rolled[0]);
    let (ready, reason, message) = condition(d, "Ready");
    assert_eq!((ready.as_str(), reason.as_str()), ("False", "RolledBack"), "{message}");
    assert!(message.contains("generation 2 does not run") && message.contains("change the spec to try again"), "{message}");
    let (degraded, reason, _) = condition(d, "Degraded");
    assert_eq!((degraded.as_str(), reason.as_str()), ("True", "RolledBack"));
    assert_eq!(d.status.deployed_generation, Some(1));
    assert_eq!(d.status.deployed_spec_hash.as_deref(), Some(old_hash.as_str()));
    assert_eq!(d.status.observed_generation, Some(2), "the status judges generation 2, and says it does not run");
}

#[test]
fn a_rolled_back_generation_is_not_tried_again_until_the_spec_changes() {
    let mut w = healthy(with_rollback());
    bad_upgrade(&mut w);
    w.advance(Duration::from_secs(121));
    w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    w.step();
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    let old_run = w.run_id();
    // Many reconciles later: the old spec keeps running, no savepoint, no new run.
    let mut ds = Vec::new();
    for _ in 0..20 {
        w.advance(Duration::from_secs(30));
        w.checkpoint(2);
        ds.push(w.step());
    }
    assert_eq!(w.phase(), Some(Phase::Running));
    assert_eq!(w.run_id(), old_run);
    assert!(effects(&ds).is_empty(), "no upgrade of the rolled-back generation: {:?}", effects(&ds));
    let message = status(&w).message.unwrap();
    assert!(message.contains("generation 2 was rolled back") && message.contains("checkpoint 2 complete"), "{message}");
    // A failure of the old spec restarts the old spec, not the rolled-back one.
    let hash = status(&w).run.unwrap().spec_hash;
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    assert_eq!(status(&w).run.unwrap().spec_hash, hash);
    assert!(status(&w).rollback.is_some());
    w.advance(Duration::from_secs(2));
    w.step();
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    assert_eq!(status(&w).run.unwrap().spec_hash, hash);
    // A fixed spec is a new generation: tried with a savepoint, on trial again.
    apply(&mut w, |s| s.image = Some("weir:fixed".into()));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    assert_eq!(savepoint_requests(std::slice::from_ref(&d)).len(), 1);
    assert!(d.status.rollback.is_none(), "the rollback speaks only for the generation it gave up");
    let (_, reason, _) = condition(&d, "Ready");
    assert_eq!(reason, "Upgrading");
}

#[test]
fn a_rolled_back_job_that_finishes_stays_finished() {
    let mut w = healthy(with_rollback());
    bad_upgrade(&mut w);
    w.advance(Duration::from_secs(121));
    w.step();
    w.step();
    w.step();
    w.pods_run();
    w.until(Phase::Running);
    for p in w.pods.iter_mut() {
        *p = exited(p.clone(), 0);
    }
    w.step();
    assert_eq!(w.phase(), Some(Phase::Finished));
    for _ in 0..3 {
        let d = w.step();
        assert_eq!(w.phase(), Some(Phase::Finished), "not run again for the rolled-back generation");
        assert!(d.effects.is_empty());
    }
    // A new generation runs it again.
    apply(&mut w, |s| s.image = Some("weir:fixed".into()));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Deploying));
}

#[test]
fn a_new_spec_that_fails_in_a_way_a_restart_does_not_fix_is_rolled_back_at_once() {
    let mut w = healthy(with_rollback());
    bad_upgrade(&mut w);
    w.pods_run();
    // The worker refuses the new pipeline (EXIT_FATAL): no point in waiting for the deadline.
    w.pods[0] = exited(w.pods[0].clone(), crate::observe::EXIT_FATAL);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    let rb = d.status.rollback.clone().unwrap();
    assert_eq!(rb.reason, "WorkerFatalError");
    assert!(rb.message.contains("generation 2 failed") && rb.message.contains("a restart does not fix this"), "{}", rb.message);
    assert_eq!(d.status.restarts, 0, "a rollback is no restart");
    // The rollback itself is not rolled back: if the old spec fails too, it is Failed.
    w.step();
    w.step();
    w.pods_run();
    w.pods[1] = exited(w.pods[1].clone(), crate::observe::EXIT_FATAL);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert!(d.status.message.unwrap().contains("the rollback's run failed"));
    // Failed waits for a change: neither the rolled-back spec nor the old one is started again.
    w.pods.clear();
    for _ in 0..3 {
        w.advance(Duration::from_secs(60));
        let d = w.step();
        assert_eq!(w.phase(), Some(Phase::Failed));
        assert!(d.effects.is_empty());
    }
}

#[test]
fn a_deploy_timeout_under_trial_rolls_back_instead_of_failing_the_job() {
    let mut w = healthy(with_rollback().spec(|s| s.deploy_timeout = HumanDuration::from_millis(60_000)));
    bad_upgrade(&mut w);
    w.advance(Duration::from_secs(60));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    assert_eq!(d.status.rollback.unwrap().reason, crate::lifecycle::deadline::DEPLOY_TIMEOUT);
}

#[test]
fn a_new_spec_restarting_until_the_deadline_is_rolled_back_from_recovering() {
    let mut w = healthy(with_rollback());
    bad_upgrade(&mut w);
    w.pods_run();
    w.pods[0] = exited(w.pods[0].clone(), 1);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Recovering));
    assert!(status(&w).upgrade_trial.is_some(), "a restart of the new spec stays on trial");
    w.advance(Duration::from_secs(120));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    assert_eq!(d.status.rollback.unwrap().reason, READINESS_TIMEOUT);
}

#[test]
fn without_rollback_a_bad_upgrade_behaves_as_before_and_fails_by_the_deploy_timeout() {
    let mut w = healthy(JobBuilder::new("j"));
    bad_upgrade(&mut w);
    assert!(status(&w).upgrade_trial.is_none());
    w.advance(Duration::from_secs(5 * 60));
    w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading), "no readiness deadline without rollback");
    w.advance(Duration::from_secs(5 * 60));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Failed));
    assert_eq!(d.status.last_failure.unwrap().reason, crate::lifecycle::deadline::DEPLOY_TIMEOUT);
    assert!(d.status.rollback.is_none());
}

#[test]
fn a_healthy_upgrade_is_not_rolled_back_and_becomes_the_stable_spec() {
    let mut w = healthy(with_rollback());
    apply(&mut w, |s| s.parallelism = 3);
    let d = w.step();
    complete_savepoint(&mut w, &d);
    w.step();
    w.step();
    w.pods_run();
    let ds = w.until(Phase::Running);
    // Up, but no checkpoint yet: not Ready, and still on trial.
    let (ready, reason, message) = condition(ds.last().unwrap(), "Ready");
    assert_eq!((ready.as_str(), reason.as_str()), ("False", "AwaitingCheckpoint"), "{message}");
    assert!(status(&w).upgrade_trial.is_some());
    w.advance(Duration::from_secs(30));
    w.checkpoint(10);
    let d = w.step();
    assert!(d.status.upgrade_trial.is_none());
    assert_eq!(events(std::slice::from_ref(&d), "UpgradeHealthy").len(), 1);
    let stable = d.status.last_stable_spec.clone().unwrap();
    assert_eq!((stable.generation, stable.spec_hash.as_str()), (Some(2), d.status.run.as_ref().unwrap().spec_hash.as_str()));
    let (ready, _, _) = condition(&d, "Ready");
    assert_eq!(ready, "True");
    // Long past the deadline: nothing happens.
    w.advance(Duration::from_secs(600));
    w.checkpoint(11);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.effects.is_empty() && d.status.rollback.is_none());
}

#[test]
fn without_a_savepoint_the_rollback_restores_as_the_upgrade_did_and_says_so() {
    // last-state: the latest completed checkpoint, which the new spec never passed.
    let mut w = healthy(with_rollback().spec(|s| s.upgrade_mode = UpgradeMode::LastState));
    apply(&mut w, |s| s.image = Some("weir:no-such-tag".into()));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Upgrading));
    assert!(d.status.message.unwrap().contains("rolled back unless healthy by"));
    assert_eq!(status(&w).upgrade_trial.unwrap().savepoint, None);
    w.step();
    w.step();
    w.advance(Duration::from_secs(120));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    let rb = d.status.rollback.unwrap();
    assert_eq!(rb.restore_from.as_deref(), Some("latest"));
    assert!(rb.message.contains("from the latest completed checkpoint /cp/chk-1 (upgradeMode last-state took no savepoint)"), "{}", rb.message);

    // stateless: the old spec starts without state, as the upgrade started the new one.
    let mut w = healthy(with_rollback().spec(|s| s.upgrade_mode = UpgradeMode::Stateless));
    apply(&mut w, |s| s.image = Some("weir:no-such-tag".into()));
    w.step();
    w.step();
    w.step();
    w.advance(Duration::from_secs(120));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::RollingBack));
    let rb = d.status.rollback.unwrap();
    assert_eq!(rb.restore_from, None);
    assert_eq!(d.status.run.unwrap().restore_from, None);
    assert!(rb.message.contains("without state") && rb.message.contains("stateless took no savepoint"), "{}", rb.message);
}

#[test]
fn rollback_enabled_on_a_job_that_never_ran_healthy_says_the_upgrade_cannot_be_rolled_back() {
    // Up, but no checkpoint completed: no stable spec.
    let mut w = World::running(with_rollback().build());
    assert!(status(&w).last_stable_spec.is_none());
    apply(&mut w, |s| s.image = Some("weir:no-such-tag".into()));
    let d = w.step();
    let d = complete_savepoint(&mut w, &d);
    let said = warnings(std::slice::from_ref(&d), "RollbackUnavailable");
    assert_eq!(said.len(), 1);
    assert!(said[0].contains("no spec of this job has run healthy yet"), "{}", said[0]);
    assert!(status(&w).upgrade_trial.is_none());
}

#[test]
fn rollback_settings_are_no_pod_change() {
    let mut w = healthy(JobBuilder::new("j"));
    apply(&mut w, |s| {
        s.upgrade.rollback.enabled = true;
        s.upgrade.rollback.readiness_timeout = HumanDuration::from_millis(30_000);
    });
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.effects.is_empty());
    let (ready, _, _) = condition(&d, "Ready");
    assert_eq!(ready, "True");
}
