//! Exactly-once under failure: worker processes and whole `weir run` process
//! trees are killed with SIGKILL at random moments, and the committed output
//! must equal what a failure-free run gives.

use std::time::Duration;

use crate::common::*;

fn worker_kills_keep_exactly_once(parallelism: u32) {
    let job = Job::counting(parallelism, 120_000, 97, 30_000, "150ms");
    let out = run_with_worker_kills(&job, 4, |_| {});
    let err = stderr(&out);
    assert!(err.contains("restarting"), "no restart was reported:\n{err}");
    job.assert_exactly_once();
}

#[test]
fn worker_kills_keep_exactly_once_at_parallelism_1() {
    worker_kills_keep_exactly_once(1);
}

#[test]
fn worker_kills_keep_exactly_once_at_parallelism_2() {
    worker_kills_keep_exactly_once(2);
}

#[test]
fn worker_kills_keep_exactly_once_at_parallelism_4() {
    worker_kills_keep_exactly_once(4);
}

/// Kills the whole process tree of `weir run` a few times and resumes each
/// time with `--restore latest` (and, with `rescale`, at another parallelism).
fn tree_kills_keep_exactly_once(parallelism: u32, rescale: Option<&str>) {
    // 5 s of events; three rounds of at most 0.9 s each cannot finish it.
    let job = Job::counting(parallelism, 150_000, 53, 30_000, "200ms");
    kill_trees_then_restore_latest(&job, 400..900, rescale);
    job.assert_exactly_once();
    let leftovers: Vec<_> = std::fs::read_dir(job.path("out/eo")).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".inprogress")).collect();
    assert!(leftovers.is_empty(), "in-progress files left after the job finished: {leftovers:?}");
}

#[test]
fn whole_tree_kills_then_restore_latest_keep_exactly_once_at_parallelism_2() {
    tree_kills_keep_exactly_once(2, None);
}

#[test]
fn whole_tree_kills_then_restore_latest_at_another_parallelism_keep_exactly_once() {
    tree_kills_keep_exactly_once(3, Some("2"));
}

#[test]
fn a_worker_stopped_by_sigterm_leaves_at_once_and_the_job_restores_exactly_once() {
    // As a pod's PID 1 a worker without a handler ignores SIGTERM, and a
    // pod deletion waits its whole grace period; with it the worker leaves
    // at once, like a kill, and the job goes on from its latest checkpoint.
    let job = Job::counting(2, 120_000, 31, 30_000, "150ms");
    let child = job.spawn(&[]);
    job.wait_for_first_checkpoint();
    let (pids, _) = job.worker_pids().expect("the workers' pids");
    unsafe {
        libc::kill(pids[1] as i32, libc::SIGTERM);
    }
    let out = wait_with_timeout(child, Duration::from_secs(60));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("worker 1 exited with code 143"), "the worker did not leave through its SIGTERM handler:\n{err}");
    assert!(err.contains("restarting"), "no restart was reported:\n{err}");
    job.assert_exactly_once();
}

#[test]
fn a_failure_free_run_commits_every_event_once_and_exits_zero() {
    let job = Job::counting(3, 20_000, 10, 0, "100ms");
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["records_in"], 20_000);
    assert_eq!(summary["records_out"], 20_000);
}

#[test]
fn restore_latest_without_a_checkpoint_starts_fresh_and_says_so() {
    let job = Job::counting(1, 1_000, 10, 0, "1s");
    let out = job.run(&["--restore", "latest"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("starting fresh"), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_savepoint_of_a_running_job_is_listed_and_restorable() {
    let job = Job::counting(2, 60_000, 20, 20_000, "300ms");
    let child = job.spawn(&[]);
    let path = job.take_savepoint();
    assert!(std::path::Path::new(&path).join("_metadata").exists(), "{path}");
    let list = job.weir(&["checkpoints", "list", "--state-dir", &job.state]).output().unwrap();
    let table = String::from_utf8_lossy(&list.stdout);
    assert!(table.lines().any(|l| l.contains("savepoint") && l.contains("complete") && l.contains(&path)), "{table}");
    kill_group(child.id());
    let _ = child.wait_with_output();
    let out = job.run(&["--restore", &path]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("from savepoint"), "{}", stderr(&out));
    // Restoring an older snapshot replays what came after it: every event is
    // there, and the savepoint's own state continues the counts.
    let seqs: std::collections::HashSet<i64> = job.committed_lines().iter().map(|l| l["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs.len(), 60_000);
}

/// Crashes a worker at a chosen point of checkpoint 3 (once), and checks
/// that the restored run still commits every event exactly once.
fn crash_at(point: &str) {
    let job = Job::counting(3, 60_000, 31, 30_000, "100ms");
    let marker = job.path("fault-fired");
    let mut cmd = job.command(&[]);
    cmd.env("WEIR_FAULT", format!("{point}@3")).env("WEIR_FAULT_ONCE", &marker);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(marker.exists(), "the fault at {point} never fired");
    assert!(stderr(&out).contains("restarting"), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_crash_during_barrier_alignment_keeps_exactly_once() {
    crash_at("mid-alignment");
}

#[test]
fn a_crash_after_acknowledging_keeps_exactly_once() {
    crash_at("after-ack");
}

#[test]
fn a_crash_between_checkpoint_completion_and_commit_keeps_exactly_once() {
    crash_at("after-complete");
}

#[test]
fn a_crash_in_the_sink_before_it_commits_keeps_exactly_once() {
    crash_at("before-commit");
}

/// A frozen process (SIGSTOP: a paused VM, a process stuck in the kernel, a
/// node cut off) keeps its TCP connections open, so only heartbeats notice
/// it. Freezes worker `victim` once the job runs; the run must fail within
/// the heartbeat timeout and be restored, with output exactly once.
fn a_frozen_worker_is_found_by_heartbeats(victim: usize) {
    let job = Job::counting(2, 120_000, 37, 30_000, "100ms");
    let child = job.spawn(&["--heartbeat-timeout", "1s"]);
    let start = std::time::Instant::now();
    let pids = loop {
        if let Some((pids, _)) = job.worker_pids().filter(|(p, _)| p.len() == 2) {
            break pids;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the workers never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(1200));
    unsafe {
        libc::kill(pids[victim] as i32, libc::SIGSTOP);
    }
    let out = wait_with_timeout(child, Duration::from_secs(120));
    let err = stderr(&out);
    assert!(out.status.success(), "weir run failed:\n{err}");
    assert!(err.contains("sent nothing for 1.0s"), "the frozen worker was not found by the heartbeat timeout:\n{err}");
    assert!(err.contains("restarting"), "no restart was reported:\n{err}");
    job.assert_exactly_once();
}

#[test]
fn a_frozen_worker_is_found_by_the_coordinators_heartbeat_timeout_and_the_job_recovers_exactly_once() {
    a_frozen_worker_is_found_by_heartbeats(1);
}

#[test]
fn a_frozen_coordinator_is_found_by_the_workers_heartbeat_timeout_and_the_job_recovers_exactly_once() {
    a_frozen_worker_is_found_by_heartbeats(0);
}
