//! spec.savepoints: periodic savepoints and the disposal of those no longer kept.

use std::time::Duration;

use weir_api::control::{CheckpointStatus, SavepointOutcome, SavepointState};
use weir_api::streamjob::{Phase, SavepointReason};

use super::{effects, savepoint_requests, World};
use crate::lifecycle::{Decision, Effect};
use crate::observe::DisposalOutcome;
use crate::testing::JobBuilder;

const MINUTE: Duration = Duration::from_secs(60);

/// Time passes while the job checkpoints (a checkpoint just completed).
fn pass(w: &mut World, d: Duration) {
    w.advance(d);
    let id = w.now.as_second() as u64;
    w.checkpoint(id);
}

fn with_savepoints(interval: Option<&str>, max_count: u32, max_age: Option<&str>) -> World {
    let job = JobBuilder::new("j")
        .spec(|s| {
            s.savepoints.interval = interval.map(|i| weir_api::pipeline::HumanDuration::parse(i).unwrap());
            s.savepoints.max_count = max_count as i32;
            s.savepoints.max_age = max_age.map(|a| weir_api::pipeline::HumanDuration::parse(a).unwrap());
        })
        .build();
    World::running(job)
}

/// Completes the pending savepoint as `/cp/savepoints/sp-<id>-1`, then
/// steps until the job runs again; returns the decisions.
fn complete(w: &mut World, id: u64) -> Vec<Decision> {
    let request_id = w.job.status.as_ref().unwrap().pending_savepoint.as_ref().unwrap().request_id.clone().unwrap();
    w.savepoint = Some(Some(SavepointOutcome {
        request_id,
        state: SavepointState::Completed,
        savepoint: Some(CheckpointStatus { id, location: path(id), completed_unix_ms: w.now.as_millisecond() as u64, duration_ms: 1 }),
        error: None,
    }));
    let ds = w.until(Phase::Running);
    w.savepoint = None;
    ds
}

fn path(id: u64) -> String {
    format!("/cp/savepoints/sp-{id}-1")
}

fn disposals(ds: &[Decision]) -> Vec<String> {
    effects(ds)
        .into_iter()
        .filter_map(|e| match e {
            Effect::DisposeSavepoint { location, .. } => Some(location),
            _ => None,
        })
        .collect()
}

fn listed(w: &World) -> Vec<String> {
    w.job.status.as_ref().unwrap().savepoint_history.iter().map(|s| s.path.clone()).collect()
}

/// Takes `n` periodic savepoints, ids 1..=n, an interval (10 min) apart.
fn take_periodic(w: &mut World, n: u64) {
    for id in 1..=n {
        pass(w, 10 * MINUTE);
        let d = w.step();
        assert_eq!(w.phase(), Some(Phase::Savepointing), "savepoint {id} is due: {:?}", d.status.message);
        complete(w, id);
    }
}

#[test]
fn periodic_savepoints_are_taken_an_interval_apart_without_stopping_the_job() {
    let mut w = with_savepoints(Some("10m"), 10, None);
    let run = w.run_id();
    pass(&mut w, 9 * MINUTE);
    let d = w.step();
    assert!(savepoint_requests(std::slice::from_ref(&d)).is_empty(), "not due before the interval");
    pass(&mut w, MINUTE);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
    let requests = savepoint_requests(std::slice::from_ref(&d));
    assert_eq!(requests.len(), 1);
    assert!(!requests[0].1, "a periodic savepoint does not stop the job");
    assert!(d.notes.iter().any(|n| n.reason == "SavepointRequested" && n.message.contains("periodic")));
    complete(&mut w, 1);
    let st = w.job.status.clone().unwrap();
    assert_eq!(st.savepoint_history.len(), 1);
    assert_eq!(st.savepoint_history[0].reason, SavepointReason::Periodic);
    assert_eq!(w.run_id(), run, "the same run goes on");
    // The next one counts from the savepoint just taken.
    pass(&mut w, 9 * MINUTE);
    assert!(savepoint_requests(&[w.step()]).is_empty());
    pass(&mut w, MINUTE);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
}

#[test]
fn a_failed_periodic_savepoint_is_tried_again_an_interval_later_not_at_once() {
    let mut w = with_savepoints(Some("10m"), 10, None);
    pass(&mut w, 10 * MINUTE);
    w.step();
    let request_id = w.job.status.as_ref().unwrap().pending_savepoint.as_ref().unwrap().request_id.clone().unwrap();
    w.savepoint = Some(Some(SavepointOutcome { request_id, state: SavepointState::Failed, savepoint: None, error: Some("storage said 403".into()) }));
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Running));
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "SavepointFailed" && n.message.contains("next periodic savepoint")), "{:?}", d.notes);
    w.savepoint = None;
    pass(&mut w, MINUTE);
    assert!(savepoint_requests(&[w.step()]).is_empty(), "a failing savepoint is not retried at every reconcile");
    pass(&mut w, 9 * MINUTE);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
}

#[test]
fn savepoints_beyond_max_count_are_disposed_of_oldest_first_and_leave_the_list_only_once_disposed() {
    let mut w = with_savepoints(Some("10m"), 2, None);
    take_periodic(&mut w, 4);
    assert_eq!(listed(&w), [path(1), path(2), path(3), path(4)], "listed until disposed of");
    let d = w.step();
    assert_eq!(disposals(std::slice::from_ref(&d)), [path(1), path(2)]);
    assert_eq!(listed(&w).len(), 4);
    // Only the disposal that was done takes a savepoint off the list.
    w.disposals = vec![(path(1), DisposalOutcome::Disposed)];
    let d = w.step();
    assert_eq!(listed(&w), [path(2), path(3), path(4)]);
    assert!(d.notes.iter().any(|n| !n.warning && n.reason == "SavepointDisposed" && n.message.contains(&path(1))), "{:?}", d.notes);
    assert_eq!(disposals(std::slice::from_ref(&d)), [path(2)], "the other is asked for again");
    w.disposals.push((path(2), DisposalOutcome::Disposed));
    let d = w.step();
    assert_eq!(listed(&w), [path(3), path(4)]);
    assert!(disposals(std::slice::from_ref(&d)).is_empty());
    assert_eq!(w.job.status.as_ref().unwrap().last_savepoint.as_ref().unwrap().path, path(4));
}

#[test]
fn the_newest_savepoint_and_the_one_the_run_restored_from_are_never_disposed_of() {
    let mut w = with_savepoints(Some("10m"), 10, Some("15m"));
    take_periodic(&mut w, 3);
    // The run restores from savepoint 1 (as after an upgrade from it).
    w.job.status.as_mut().unwrap().run.as_mut().unwrap().restore_from = Some(path(1));
    pass(&mut w, 5 * MINUTE);
    // Savepoint 1 is 25 min old, 2 is 15 min, 3 (the newest) 5 min: only 2 is
    // past maxAge and free to go... and 15 min is not past 15m.
    assert!(disposals(&[w.step()]).is_empty());
    pass(&mut w, MINUTE);
    assert_eq!(disposals(&[w.step()]), [path(2)]);
    // Much later every savepoint is past maxAge; the newest still stays.
    w.job.status.as_mut().unwrap().run.as_mut().unwrap().restore_from = None;
    w.job.spec.savepoints.interval = None;
    pass(&mut w, 600 * MINUTE);
    assert_eq!(disposals(&[w.step()]), [path(1), path(2)]);
}

#[test]
fn a_savepoint_refused_as_none_of_the_jobs_leaves_the_list_with_a_warning() {
    let mut w = with_savepoints(Some("10m"), 1, None);
    take_periodic(&mut w, 2);
    assert_eq!(disposals(&[w.step()]), [path(1)]);
    w.disposals = vec![(path(1), DisposalOutcome::Refused("HTTP 400: no savepoint of this job".into()))];
    let d = w.step();
    assert_eq!(listed(&w), [path(2)]);
    assert!(d.notes.iter().any(|n| n.warning && n.reason == "SavepointNotDisposed" && n.message.contains("HTTP 400")), "{:?}", d.notes);
}

#[test]
fn a_periodic_savepoint_leaves_a_savepoint_trigger_changed_meanwhile_to_be_acted_on() {
    let mut w = with_savepoints(Some("10m"), 10, None);
    pass(&mut w, 10 * MINUTE);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
    w.job.spec.savepoint_trigger = Some("now".into());
    complete(&mut w, 1);
    let d = w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing), "the trigger asks for its own savepoint: {:?}", d.status.message);
    assert_eq!(w.job.status.as_ref().unwrap().pending_savepoint.as_ref().unwrap().reason, SavepointReason::Trigger);
}

#[test]
fn without_settings_no_periodic_savepoint_is_taken_and_ten_are_kept() {
    let mut w = with_savepoints(None, 10, None);
    pass(&mut w, 1000 * MINUTE);
    assert!(savepoint_requests(&[w.step()]).is_empty());
    assert_eq!(w.job.spec.savepoints, weir_api::streamjob::SavepointSettings::default(), "maxCount 10 is the default");
}

#[test]
fn a_job_that_finishes_while_its_periodic_savepoint_is_pending_is_finished_without_waiting_for_it() {
    let mut w = with_savepoints(Some("10m"), 10, None);
    pass(&mut w, 10 * MINUTE);
    w.step();
    assert_eq!(w.phase(), Some(Phase::Savepointing));
    for p in w.pods.iter_mut() {
        *p = crate::testing::exited(p.clone(), 0);
    }
    w.coordinator = None;
    w.until(Phase::Finished);
    assert!(w.job.status.as_ref().unwrap().pending_savepoint.is_none());
}
