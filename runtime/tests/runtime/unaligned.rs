//! Unaligned checkpoints and the alignment timeout: worker kills and
//! whole-tree kills with restores (also at another parallelism) give the
//! committed output of a failure-free run, with and without backpressure
//! (`WEIR_SLOW_SINK` slows the sink's stage down), and under backpressure
//! the checkpoints really hold records that were in flight.

use std::time::{Duration, Instant};

use crate::common::*;

/// The running count with `checkpoint` lines added to its checkpoint
/// section, and with the sink's stage slowed down by `slow` per batch.
fn counting(parallelism: u32, events: u64, rate: u64, checkpoint: &str, slow: Option<&str>) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 150ms\n{checkpoint}source:\n  generator:\n    events: {events}\n    keys: 97\n    rate: {rate}\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n"
    );
    let mut job = Job::with_pipeline(&yaml, events, 97);
    if let Some(d) = slow {
        job.env.push(("WEIR_SLOW_SINK".into(), d.into()));
    }
    job
}

fn holds_records_in_flight(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|files| files.flatten().any(|f| f.file_name().to_string_lossy().starts_with("in-flight-")))
}

/// How many retained checkpoints hold records that were in flight.
fn checkpoints_with_records_in_flight(job: &Job) -> usize {
    let Ok(dirs) = std::fs::read_dir(job.path("state/eo-test/checkpoints")) else { return 0 };
    dirs.flatten().filter(|d| holds_records_in_flight(&d.path())).count()
}

fn latest_holds_records_in_flight(job: &Job) -> bool {
    job.latest().is_some_and(|latest| holds_records_in_flight(std::path::Path::new(latest.trim_start_matches("file://"))))
}

/// Waits until a checkpoint of the running job holds records in flight (asserted).
pub fn wait_for_records_in_flight(job: &Job, child: &mut std::process::Child) {
    let until = Instant::now() + Duration::from_secs(30);
    while checkpoints_with_records_in_flight(job) == 0 && Instant::now() < until && child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(checkpoints_with_records_in_flight(job) > 0, "no checkpoint held records in flight");
}

#[test]
fn unaligned_checkpoints_keep_the_running_count_exactly_once_under_worker_kills() {
    let job = counting(3, 120_000, 30_000, "  mode: unaligned\n", None);
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("unaligned checkpoints every 150ms"), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn unaligned_checkpoints_under_backpressure_hold_records_in_flight_and_keep_exactly_once_under_worker_kills() {
    let job = counting(2, 100_000, 0, "  mode: unaligned\n", Some("10ms"));
    run_with_worker_kills(&job, 3, |child| wait_for_records_in_flight(&job, child));
    job.assert_exactly_once();
}

#[test]
fn aligned_checkpoints_with_an_alignment_timeout_turn_unaligned_under_backpressure_and_keep_exactly_once_under_worker_kills() {
    let job = counting(2, 100_000, 0, "  alignment_timeout: 20ms\n", Some("10ms"));
    let out = run_with_worker_kills(&job, 3, |child| wait_for_records_in_flight(&job, child));
    let err = stderr(&out);
    assert!(err.contains("aligned checkpoints every 150ms, unaligned when aligning takes over 20ms"), "{err}");
    job.assert_exactly_once();
}

/// Runs the job with `first` (then, should the latest checkpoint hold no
/// records in flight at the kill, with `--restore latest` at `parallelism`)
/// and kills the whole run once its latest checkpoint holds some.
fn kill_once_the_latest_checkpoint_holds_records_in_flight(job: &Job, first: &[&str], parallelism: &str) {
    let again = ["--restore", "latest", "--parallelism", parallelism];
    for attempt in 0..5 {
        let child = job.spawn(if attempt == 0 { first } else { &again });
        let until = Instant::now() + Duration::from_secs(20);
        let before = job.latest();
        while (job.latest() == before || !latest_holds_records_in_flight(job)) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        kill_group(child.id());
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "the job ended before it was killed:\n{}", stderr(&out));
        if latest_holds_records_in_flight(job) {
            return;
        }
    }
    panic!("the latest checkpoint never held records in flight at a kill");
}

#[test]
fn records_in_flight_in_an_unaligned_checkpoint_are_restored_at_another_parallelism_exactly_once() {
    let job = counting(3, 150_000, 0, "  mode: unaligned\n", Some("10ms"));
    // Parallelism 3, then its checkpoint (with records in flight) restored
    // at 2, and that run's restored at 4.
    kill_once_the_latest_checkpoint_holds_records_in_flight(&job, &[], "3");
    kill_once_the_latest_checkpoint_holds_records_in_flight(&job, &["--restore", "latest", "--parallelism", "2"], "2");
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "4"]), Duration::from_secs(240));
    let err = stderr(&out);
    assert!(out.status.success(), "the last run failed:\n{err}");
    assert!(err.contains("restoring `eo-test` from checkpoint"), "{err}");
    job.assert_exactly_once();
}

#[test]
fn records_in_flight_are_refused_by_a_graph_whose_stage_reads_them_otherwise_and_nothing_is_lost() {
    let job = counting(2, 150_000, 0, "  mode: unaligned\n", Some("10ms"));
    kill_once_the_latest_checkpoint_holds_records_in_flight(&job, &[], "2");
    // The same count behind a fan-out and a union: its stage 1 is a filter
    // reading the source forward, which cannot take the chain's records in
    // flight towards its stage 1 (the count).
    let graph = "name: eo-test\nparallelism: 2\ncheckpoint: {interval: 150ms}\n\
                 sources:\n  source: {generator: {events: 150000, keys: 97, rate: 0, batch_size: 256}}\n\
                 steps:\n  - {name: low, input: source, filter: \"key < 50\"}\n  - {name: high, input: source, filter: \"key >= 50\"}\n\
                 \x20 - {name: both, input: [low, high], union: {}}\n  - {name: keyed, input: both, key_by: key}\n\
                 \x20 - {name: running_count-0, input: keyed, running_count: count}\n\
                 sinks:\n  sink: {input: running_count-0, file: {path: out/eo, format: jsonl, guarantee: exactly-once}}\n";
    job.write_pipeline(graph);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest"]), Duration::from_secs(60));
    let err = stderr(&out);
    assert!(!out.status.success(), "the graph restored records in flight it cannot take:\n{err}");
    assert!(err.contains("holds records in flight towards stage 1 (`in-flight-1`), but stage 1 of this pipeline does not read one hash-partitioned input"), "{err}");
    // Refused, not lost: the pipeline it was taken with restores it exactly once.
    let chain = "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 150ms\n  mode: unaligned\nsource:\n  generator:\n    events: 150000\n    keys: 97\n    rate: 0\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n";
    job.write_pipeline(chain);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest"]), Duration::from_secs(240));
    assert!(out.status.success(), "the chain did not restore its own checkpoint:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn unaligned_settings_that_cannot_work_are_refused_naming_the_field() {
    let job = Job::with_pipeline(
        "name: eo-test\nguarantee: at-least-once\ncheckpoint:\n  mode: unaligned\nsource:\n  generator: {events: 10}\nsink:\n  blackhole: {}\n",
        0,
        0,
    );
    let err = assert_refused(&job.run(&[]));
    assert!(err.contains("checkpoint.mode") && err.contains("at-least-once"), "{err}");
    job.write_pipeline("name: eo-test\ncheckpoint:\n  mode: unaligned\n  alignment_timeout: 1s\nsource:\n  generator: {events: 10}\nsink:\n  blackhole: {}\n");
    let err = assert_refused(&job.run(&[]));
    assert!(err.contains("checkpoint.alignment_timeout"), "{err}");
}
