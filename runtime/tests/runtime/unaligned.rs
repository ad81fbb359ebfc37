//! Unaligned checkpoints and the alignment timeout: worker kills and
//! whole-tree kills with restores (also at another parallelism) give the
//! committed output of a failure-free run, with and without backpressure
//! (`WEIR_SLOW_SINK` slows the sink's stage down), and under backpressure
//! the checkpoints really hold records that were in flight. A union keeps
//! the records in flight towards each of its inputs apart, and restores
//! them, re-partitioned by each input's edge, at another parallelism.

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

/// Whether checkpoint directory `dir` holds a state file of each of `states` (file name prefixes).
fn holds_states(dir: &std::path::Path, states: &[&str]) -> bool {
    let names: Vec<String> = std::fs::read_dir(dir).map(|files| files.flatten().map(|f| f.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default();
    states.iter().all(|s| names.iter().any(|n| n.starts_with(s)))
}

fn holds_records_in_flight(dir: &std::path::Path) -> bool {
    holds_states(dir, &["in-flight-"])
}

/// How many retained checkpoints hold records that were in flight.
fn checkpoints_with_records_in_flight(job: &Job) -> usize {
    let Ok(dirs) = std::fs::read_dir(job.path("state/eo-test/checkpoints")) else { return 0 };
    dirs.flatten().filter(|d| holds_records_in_flight(&d.path())).count()
}

pub fn latest_holds(job: &Job, states: &[&str]) -> bool {
    job.latest().is_some_and(|latest| holds_states(std::path::Path::new(latest.trim_start_matches("file://")), states))
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
    kill_once_the_latest_checkpoint_holds(job, first, parallelism, &["in-flight-"]);
}

/// As above, once the latest checkpoint holds a file of each of `states`.
pub fn kill_once_the_latest_checkpoint_holds(job: &Job, first: &[&str], parallelism: &str, states: &[&str]) {
    let again = ["--restore", "latest", "--parallelism", parallelism];
    for attempt in 0..5 {
        let child = job.spawn(if attempt == 0 { first } else { &again });
        let until = Instant::now() + Duration::from_secs(20);
        let before = job.latest();
        while (job.latest() == before || !latest_holds(job, states)) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        kill_group(child.id());
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "the job ended before it was killed:\n{}", stderr(&out));
        if latest_holds(job, states) {
            return;
        }
    }
    panic!("the latest checkpoint never held {states:?} at a kill");
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
    assert!(
        err.contains("holds records in flight towards stage 1 (`in-flight-1`) on the edge `key_by-0`, but that input of stage 1 of this pipeline is the edge `source to "),
        "{err}"
    );
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

/// Two generators of the same events, the first keeping the even keys and
/// the second the odd ones, merged by a union and counted per key: every
/// seq once, as the counting oracle wants. `keyed` puts a key_by on each
/// input before the union (its stage then reads two hash inputs and counts
/// there); otherwise the union reads its two sources' stages forward and
/// the count follows a key_by after it. Stage 2 is the union's in both,
/// slowed down by `slow` per batch.
fn union_of_two_sources(parallelism: u32, events: u64, checkpoint: &str, keyed: bool, slow: &str) -> Job {
    let generator = format!("generator: {{events: {events}, keys: 98, rate: 0, batch_size: 256}}");
    let (inputs, keys) = if keyed {
        ("  - {name: ka, input: evens, key_by: key}\n  - {name: kb, input: odds, key_by: key}\n  - {name: both, input: [ka, kb], union: {}}\n", "")
    } else {
        ("  - {name: both, input: [evens, odds], union: {}}\n", "  - {name: keyed, input: both, key_by: key}\n")
    };
    let counted = if keyed { "both" } else { "keyed" };
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 150ms\n{checkpoint}\
         sources:\n  a: {{{generator}}}\n  b: {{{generator}}}\n\
         steps:\n  - {{name: evens, input: a, filter: \"key % 2 = 0\"}}\n  - {{name: odds, input: b, filter: \"key % 2 = 1\"}}\n\
         {inputs}{keys}  - {{name: counts, input: {counted}, running_count: count}}\n\
         sinks:\n  out:\n    input: counts\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n"
    );
    let mut job = Job::with_pipeline(&yaml, events, 98);
    job.env.push(("WEIR_SLOW_STAGE".into(), format!("2:{slow}")));
    job
}

/// The records in flight towards each of the union's two inputs.
const BOTH_INPUTS_IN_FLIGHT: [&str; 2] = ["in-flight-2-", "in-flight-2.1-"];

#[test]
fn a_union_of_two_hash_inputs_keeps_each_inputs_records_in_flight_and_restores_them_at_3_then_2_then_4_exactly_once() {
    let job = union_of_two_sources(3, 150_000, "  mode: unaligned\n", true, "10ms");
    kill_once_the_latest_checkpoint_holds(&job, &[], "3", &BOTH_INPUTS_IN_FLIGHT);
    kill_once_the_latest_checkpoint_holds(&job, &["--restore", "latest", "--parallelism", "2"], "2", &BOTH_INPUTS_IN_FLIGHT);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "4"]), Duration::from_secs(240));
    assert!(out.status.success(), "the last run failed:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_union_of_two_forward_inputs_keeps_each_inputs_records_in_flight_and_restores_them_at_another_parallelism() {
    let job = union_of_two_sources(2, 120_000, "  mode: unaligned\n", false, "10ms");
    kill_once_the_latest_checkpoint_holds(&job, &[], "2", &BOTH_INPUTS_IN_FLIGHT);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "3"]), Duration::from_secs(240));
    assert!(out.status.success(), "the rescaled run failed:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_union_under_an_alignment_timeout_turns_unaligned_under_backpressure_and_keeps_exactly_once_under_worker_kills() {
    let job = union_of_two_sources(2, 100_000, "  alignment_timeout: 20ms\n", false, "10ms");
    run_with_worker_kills(&job, 3, |child| {
        let until = Instant::now() + Duration::from_secs(30);
        while !latest_holds(&job, &BOTH_INPUTS_IN_FLIGHT) && Instant::now() < until && child.try_wait().unwrap().is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(latest_holds(&job, &BOTH_INPUTS_IN_FLIGHT), "no checkpoint held records in flight on both inputs");
    });
    job.assert_exactly_once();
}

#[test]
fn a_broadcasts_records_in_flight_restore_at_their_parallelism_and_are_refused_at_another() {
    let (parallelism, events) = (2u32, 60_000i64);
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 150ms\n  mode: unaligned\n\
         sources:\n  a: {{generator: {{events: {events}, keys: 10, rate: 0, batch_size: 256}}}}\n\
         steps:\n  - {{name: everywhere, input: a, broadcast: {{}}}}\n  - {{name: kept, input: everywhere, filter: \"seq >= 0\"}}\n\
         sinks:\n  out:\n    input: kept\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n"
    );
    let mut job = Job::with_pipeline(&yaml, events as u64, 10);
    job.env.push(("WEIR_SLOW_STAGE".into(), "1:10ms".into()));
    kill_once_the_latest_checkpoint_holds(&job, &[], "2", &["in-flight-1-"]);
    // Each subtask had processed a prefix of its own copy: no other
    // parallelism can take the copies, and the restore says so.
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "3"]), Duration::from_secs(60));
    let err = stderr(&out);
    assert!(!out.status.success(), "a broadcast's records in flight restored at another parallelism:\n{err}");
    assert!(err.contains("on a broadcast edge (`in-flight-1`)") && err.contains("restore at parallelism 2 or from a savepoint"), "{err}");
    // Refused, not lost: at its own parallelism every record reaches every subtask once.
    let out = wait_with_timeout(job.spawn(&["--restore", "latest"]), Duration::from_secs(240));
    assert!(out.status.success(), "the restore at parallelism 2 failed:\n{}", stderr(&out));
    let mut copies: std::collections::BTreeMap<i64, u32> = std::collections::BTreeMap::new();
    for line in job.committed_lines() {
        *copies.entry(line["seq"].as_i64().expect("seq")).or_default() += 1;
    }
    assert_eq!(copies.len() as i64, events, "committed {} distinct seqs of {events}", copies.len());
    let wrong: Vec<_> = copies.iter().filter(|(_, n)| **n != parallelism).take(5).collect();
    assert!(wrong.is_empty(), "seqs committed other than {parallelism} times (seq, times): {wrong:?}");
}
