//! Jobs with several sinks (runtime/design/graphs.md §5): a checkpoint
//! commits every sink's output or none, so each sink holds every record
//! exactly once under worker kills, whole-tree kills and a crash between
//! one sink's commit and another's. Each output is checked against the
//! counting oracle of `common`, computed from the generator's rule.

use crate::common::*;

/// The running count per key, written to `out/eo` (sink `main`) and to the
/// second sink `copy`, whose YAML (under `copy:`) is given.
fn counted_into_two_sinks(parallelism: u32, events: u64, keys: u64, rate: u64, copy: &str) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint: {{interval: 150ms}}\n\
         sources:\n  a: {{generator: {{events: {events}, keys: {keys}, rate: {rate}, batch_size: 256}}}}\n\
         steps:\n  - {{name: keyed, input: a, key_by: key}}\n  - {{name: counts, input: keyed, running_count: count}}\n\
         sinks:\n  main:\n    input: counts\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n\
         \x20 copy:\n    input: counts\n{copy}"
    );
    Job::with_pipeline(&yaml, events, keys)
}

const FILE_COPY: &str = "    file: {path: out/copy, format: jsonl, guarantee: exactly-once}\n";

/// A table for the counting job's records, and the `copy:` sink writing to it in two-phase-commit mode.
fn postgres_copy(pg: &postgres::Server) -> (String, String) {
    let table = format!("copy_{}", std::process::id());
    pg.psql(&format!("DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (seq bigint, key bigint, value bigint, count bigint)"));
    let sink = format!("    postgres: {{connection: \"{}\", table: {table}, mode: two-phase-commit}}\n", pg.connection());
    (table, sink)
}

#[test]
fn two_file_sinks_each_hold_every_record_once_under_worker_kills() {
    let job = counted_into_two_sinks(2, 120_000, 97, 30_000, FILE_COPY);
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    job.assert_exactly_once();
    job.assert_exactly_once_of(&job.committed_lines_in("out/copy"));
}

#[test]
fn two_file_sinks_restore_after_whole_tree_kills_at_another_parallelism() {
    let job = counted_into_two_sinks(2, 150_000, 54, 30_000, FILE_COPY);
    kill_trees_then_restore_latest(&job, 400..900, Some("3"));
    job.assert_exactly_once();
    job.assert_exactly_once_of(&job.committed_lines_in("out/copy"));
}

#[test]
fn a_file_sink_and_a_two_phase_postgres_sink_commit_the_same_checkpoints_under_kills() {
    let pg = postgres::Server::start();
    let (table, copy) = postgres_copy(&pg);
    let mut job = counted_into_two_sinks(2, 120_000, 97, 30_000, &copy);
    job.env.extend(pg.env());
    run_with_worker_kills(&job, 3, |_| {});
    job.assert_exactly_once();
    job.assert_exactly_once_of(&pg.rows(&table));
    assert!(pg.prepared().is_empty(), "transactions stay prepared: {:?}", pg.prepared());
}

/// A file sink and a two-phase PostgreSQL sink, the process tree crashed
/// once at `point` of checkpoint 3 and restarted: both outputs hold every
/// record once (never one sink's checkpoint without the other's), nothing
/// stays prepared.
fn crash_two_sinks_at(pg: &postgres::Server, point: &str) {
    let (table, copy) = postgres_copy(pg);
    let mut job = counted_into_two_sinks(2, 60_000, 97, 20_000, &copy);
    job.env.extend(pg.env());
    let marker = job.path("fault-fired");
    let out = job.command(&[]).env("WEIR_FAULT", format!("{point}@3")).env("WEIR_FAULT_ONCE", &marker).output().unwrap();
    assert!(out.status.success(), "crash at {point}: {}", stderr(&out));
    assert!(marker.exists(), "the fault at {point} never fired");
    assert!(stderr(&out).contains("restarting"), "crash at {point}: no restart was reported:\n{}", stderr(&out));
    job.assert_exactly_once();
    job.assert_exactly_once_of(&pg.rows(&table));
    assert!(pg.prepared().is_empty(), "crash at {point}: transactions stay prepared: {:?}", pg.prepared());
}

#[test]
fn a_crash_after_one_sink_committed_a_checkpoint_and_before_the_other_did_leaves_both_exactly_once() {
    let pg = postgres::Server::start();
    crash_two_sinks_at(&pg, "after-sink-commit");
}

#[test]
fn a_crash_at_each_point_of_a_checkpoint_leaves_a_file_sink_and_a_postgres_sink_both_exactly_once() {
    let pg = postgres::Server::start();
    for point in ["mid-alignment", "mid-transaction", "after-prepare", "after-ack", "after-complete", "before-commit"] {
        crash_two_sinks_at(&pg, point);
    }
}

#[test]
fn a_stdout_sink_beside_a_file_sink_makes_the_job_at_least_once_and_the_file_stays_exactly_once() {
    let job = counted_into_two_sinks(2, 60_000, 97, 20_000, "    stdout: {}\n");
    let out = run_with_worker_kills(&job, 2, |_| {});
    let err = stderr(&out);
    assert!(err.contains("guarantee at-least-once"), "{err}");
    assert!(err.contains(", aligned checkpoints every 150ms, guarantee at-least-once"), "the file sink still needs aligned checkpoints:\n{err}");
    assert!(err.contains("the stdout sink `copy` is at-least-once"), "the reason names the sink that decides it:\n{err}");
    job.assert_exactly_once();
}

/// Sinks `main` and `copy` (whose records carry `copied`) of the counting
/// job, both exactly-once into one new topic and one progress topic of the
/// shared broker; returns the job and the topic.
fn counted_into_one_kafka_topic_twice(events: u64, rate: u64) -> (Job, String) {
    let broker = kafka::Broker::shared();
    let topic = kafka::topic("two-sinks");
    broker.create_topic(&topic, 3);
    let kafka = format!(
        "    kafka: {{bootstrap_servers: \"{}\", topic: {topic}, key: key, guarantee: exactly-once, progress_topic: {topic}-progress}}\n",
        broker.addr
    );
    let yaml = format!(
        "name: eo-test\nparallelism: 2\ncheckpoint: {{interval: 150ms}}\n\
         sources:\n  a: {{generator: {{events: {events}, keys: 97, rate: {rate}, batch_size: 256}}}}\n\
         steps:\n  - {{name: keyed, input: a, key_by: key}}\n  - {{name: counts, input: keyed, running_count: count}}\n\
         \x20 - {{name: marked, input: counts, select: [seq, key, value, count, \"seq AS copied\"]}}\n\
         sinks:\n  main:\n    input: counts\n{kafka}  copy:\n    input: marked\n{kafka}"
    );
    (Job::with_pipeline(&yaml, events, 97), topic)
}

#[test]
fn two_exactly_once_kafka_sinks_on_one_topic_keep_their_transactions_apart_under_kills() {
    // Both write to one topic and one progress topic: their transactional
    // ids, progress markers and logs must not be taken for each other's.
    let broker = kafka::Broker::shared();
    let (job, topic) = counted_into_one_kafka_topic_twice(60_000, 20_000);
    run_with_worker_kills(&job, 3, |_| {});
    let (copies, mains): (Vec<_>, Vec<_>) = broker.committed_records(&topic).into_iter().partition(|r| r.get("copied").is_some());
    job.assert_exactly_once_of(&mains);
    job.assert_exactly_once_of(&copies);
    let dirs: Vec<String> = std::fs::read_dir(job.path("state/eo-test")).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    for own in ["kafka-transactional-ids-main", "kafka-transactional-ids-copy"] {
        assert!(dirs.iter().any(|d| d == own), "no {own} in the job's storage: {dirs:?}");
    }
}

#[test]
fn a_crash_after_a_progress_marker_with_two_kafka_sinks_on_one_progress_topic_restores_without_waiting_for_the_transaction_timeout() {
    // The crash leaves transactions with progress markers open. Each
    // worker hosts a subtask of both sinks and opens them one after
    // another; a restoring subtask reads the progress topic, so an open
    // transaction of the other sink's earlier run, in this worker or the
    // other, held it back until the broker aborted it: ten minutes (the
    // default transaction_timeout), a deadlock to the user.
    let broker = kafka::Broker::shared();
    let (mut job, topic) = counted_into_one_kafka_topic_twice(60_000, 15_000);
    let marker = job.path("fault-fired");
    job.env.push(("WEIR_FAULT".into(), "after-marker@2".into()));
    job.env.push(("WEIR_FAULT_ONCE".into(), marker.to_string_lossy().into_owned()));
    let started = std::time::Instant::now();
    let child = job.spawn(&[]);
    let out = wait_with_timeout(child, std::time::Duration::from_secs(150));
    let err = stderr(&out);
    assert!(out.status.success(), "weir run failed:\n{err}");
    assert!(marker.exists(), "the fault never fired:\n{err}");
    assert!(err.contains("restarting"), "no restart was reported:\n{err}");
    println!("finished in {:?} with a crash after a progress marker", started.elapsed());
    let (copies, mains): (Vec<_>, Vec<_>) = broker.committed_records(&topic).into_iter().partition(|r| r.get("copied").is_some());
    job.assert_exactly_once_of(&mains);
    job.assert_exactly_once_of(&copies);
}
