//! The Kafka source and sink against a real broker (Apache Kafka in KRaft
//! mode, `e2e/kafka/broker`): SIGKILLs of workers and of whole process
//! trees leave the output equal to a failure-free run's, Kafka to file,
//! generator to Kafka and Kafka to Kafka; a crash at each point of a
//! checkpoint (alignment, acknowledgement, after the progress marker,
//! between completion and commit, before the sink's commit) keeps Kafka to
//! Kafka exactly once and leaves no open transaction; a broker down at
//! start and frozen mid-run costs no record and does not flood the log,
//! and neither do freezes of the broker at random moments (never a stop or
//! a kill mid-transaction: a single unreplicated broker loses commit
//! markers then, see `broker_freezes_at_random_moments_...`);
//! a crash between a checkpoint's completion and its transaction's commit
//! still delivers that checkpoint once; offsets move to new owners on a
//! rescaled restore; read_committed
//! hides aborted transactions; start positions (for a first start only: a
//! restore resumes at its offsets), bad-message policies and bad settings
//! behave as documented.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::*;

/// Runs `job` to its end while SIGKILLing a random worker four times.
pub(crate) fn run_with_worker_kills(job: &Job) -> String {
    let mut child = job.spawn(&[]);
    let kills = kill_workers_while_running(job, &mut child, 4);
    let out = wait_with_timeout(child, Duration::from_secs(240));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    assert!(kills >= 2, "only {kills} kills happened before the job ended");
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    stderr(&out)
}

/// Every log entry of the exactly-once Kafka sink was settled and deleted.
fn assert_sink_log_empty(job: &Job) {
    let left: Vec<_> = std::fs::read_dir(job.path("state/eo-test/wal")).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "log entries left after the job finished: {left:?}");
}

#[test]
fn worker_kills_with_a_kafka_source_keep_exactly_once() {
    let job = Job::counting(3, 40_000, 60, 0, "200ms").input_from_kafka(4, 15_000);
    run_with_worker_kills(&job);
    job.assert_exactly_once();
}

#[test]
fn worker_kills_with_an_exactly_once_kafka_sink_keep_exactly_once() {
    let job = Job::counting(3, 40_000, 60, 15_000, "200ms").output_to_kafka("exactly-once");
    let err = run_with_worker_kills(&job);
    // On a failure below, the job's own account of its runs.
    println!("{err}");
    job.assert_no_open_transaction();
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
}

#[test]
fn kafka_to_kafka_with_worker_kills_is_exactly_once_for_a_read_committed_reader() {
    let job = Job::counting(2, 40_000, 60, 0, "200ms").input_from_kafka(4, 15_000).output_to_kafka("exactly-once");
    run_with_worker_kills(&job);
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
    job.assert_no_open_transaction();
}

#[test]
fn a_crash_between_completion_and_commit_writes_that_checkpoint_again_exactly_once() {
    // The crash leaves checkpoint 3's transaction open: the restore fences
    // it (the broker aborts it), finds no progress marker, and writes the
    // checkpoint's records again from the sink's log.
    // Long enough (4 s) that checkpoint 3 comes before the end under load.
    let job = Job::counting(2, 40_000, 40, 10_000, "200ms").output_to_kafka("exactly-once");
    let marker = job.path("fault-fired");
    let out = job.command(&[]).env("WEIR_FAULT", "after-complete@3").env("WEIR_FAULT_ONCE", &marker).env("RUST_LOG", "info").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(marker.exists(), "the fault never fired");
    assert!(stderr(&out).contains("writing again the records of a completed checkpoint"), "no checkpoint was written again:\n{}", stderr(&out));
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
}

#[test]
fn a_crash_while_a_commit_is_in_flight_writes_that_checkpoint_again_from_the_next_ones_state() {
    // Checkpoint 3's commit waits (a slow broker) while the next interval
    // goes on in another transaction, and checkpoint 4 completes meanwhile;
    // then the job crashes. Checkpoint 4's state must still name
    // checkpoint 3's transaction, which never committed: the restore
    // writes it again. A sink that forgot it once its commit had started
    // would lose its records.
    let job = Job::counting(2, 40_000, 40, 10_000, "200ms").output_to_kafka("exactly-once");
    let marker = job.path("fault-fired");
    let out = job
        .command(&[])
        .env("WEIR_SLOW_SINK_COMMIT", "3:10s")
        .env("WEIR_FAULT", "after-complete@4")
        .env("WEIR_FAULT_ONCE", &marker)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(marker.exists(), "the fault never fired");
    assert!(stderr(&out).contains("slow sink commit injected"), "checkpoint 3 was never committed slowly:\n{}", stderr(&out));
    assert!(stderr(&out).contains("writing again the records of a completed checkpoint"), "no checkpoint was written again:\n{}", stderr(&out));
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
    job.assert_no_open_transaction();
}

#[test]
fn a_stop_savepoint_taken_while_a_commit_is_in_flight_carries_its_log_entry_and_resumes_exactly_once() {
    // Checkpoint 3's commit waits (a slow broker) while later checkpoints
    // complete; the stop savepoint comes meanwhile. Its state names the
    // committing transaction too, so it must carry that transaction's log
    // entry: the file may be deleted only once no snapshot can name it.
    // The stop is reported only after every commit is done.
    let mut job = Job::counting(2, 120_000, 20, 15_000, "200ms").output_to_kafka("exactly-once");
    job.env.push(("WEIR_SLOW_SINK_COMMIT".into(), "3:4s".into()));
    let child = job.spawn(&[]);
    let start = std::time::Instant::now();
    let checkpoint_id = |location: &str| location.rsplit("chk-").next().and_then(|id| id.trim_end_matches('/').parse::<u64>().ok());
    while job.latest().as_deref().and_then(checkpoint_id).is_none_or(|id| id < 5) {
        assert!(start.elapsed() < Duration::from_secs(30), "checkpoint 5 never completed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(start.elapsed() < Duration::from_secs(4), "checkpoint 3's commit was no longer in flight: the test proves nothing");
    let sp = job.take_savepoint_with(&["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    let carried: Vec<_> = std::fs::read_dir(std::path::Path::new(&sp).join("wal")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(carried.len() > 2, "the savepoint carries only {carried:?}, not the entries of the transactions still committing");
    job.assert_no_open_transaction();
    // Whatever the job's own log still holds, the savepoint needs none of it.
    let _ = std::fs::remove_dir_all(job.path("state/eo-test/wal"));
    resume_exactly_once(&job, &sp);
    assert_sink_log_empty(&job);
}

#[test]
fn a_restore_of_a_worker_hosting_several_sink_subtasks_takes_seconds_not_the_transaction_timeout() {
    // One worker hosts both sink subtasks. The crash leaves both subtasks'
    // transactions of checkpoint 3 open. Subtask 0 settles its entry by
    // reading the progress topic read_committed, which subtask 1's open
    // transaction holds back: every earlier transaction of the worker's
    // subtasks must be fenced before any is settled, or the restore waits
    // for the transaction timeout (3 minutes here).
    let job = Job::counting(2, 30_000, 40, 10_000, "200ms").output_to_kafka("exactly-once");
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    let progress = yaml.lines().find(|l| l.trim_start().starts_with("progress_topic:")).unwrap().to_string();
    job.write_pipeline(&yaml.replace(&progress, &format!("{progress}\n    transaction_timeout: 3m")));
    let marker = job.path("fault-fired");
    let started = std::time::Instant::now();
    let out = job.command(&["--workers", "1"]).env("WEIR_FAULT", "after-complete@3").env("WEIR_FAULT_ONCE", &marker).env("RUST_LOG", "info").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(marker.exists(), "the fault never fired");
    assert!(started.elapsed() < Duration::from_secs(60), "the job took {:?}: its restore waited on a transaction of its own", started.elapsed());
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
    job.assert_no_open_transaction();
}

/// Kafka to Kafka with one crash at `point` of checkpoint 3.
fn kafka_to_kafka_crash_at(point: &str) {
    // Checkpoint 3 or the first after it that reaches the point. On a
    // broker still loading its transaction coordinator checkpoints slow
    // down, and a final checkpoint with no records in its interval passes
    // `after-marker` by (seen in CI: 3 checkpoints in 29 s, the fault never
    // fired). A run the fault missed proves nothing about the crash, so it
    // is checked and then tried again with a new job, three times at most.
    for attempt in 1..=3 {
        let job = Job::counting(2, 30_000, 40, 0, "200ms").input_from_kafka(3, 2_500).output_to_kafka("exactly-once");
        let marker = job.path("fault-fired");
        let out = job.command(&[]).env("WEIR_FAULT", format!("{point}@3+")).env("WEIR_FAULT_ONCE", &marker).output().unwrap();
        assert!(out.status.success(), "crash at {point}: {}", stderr(&out));
        job.assert_exactly_once();
        if !marker.exists() {
            assert!(attempt < 3, "the fault at {point} never fired in 3 runs; the last:\n{}", stderr(&out));
            eprintln!("the fault at {point} never fired (attempt {attempt}); trying again:\n{}", stderr(&out));
            continue;
        }
        assert!(stderr(&out).contains("restarting"), "crash at {point}: no restart was reported:\n{}", stderr(&out));
        assert_sink_log_empty(&job);
        job.assert_no_open_transaction();
        return;
    }
}

#[test]
fn a_crash_during_alignment_or_after_acknowledging_keeps_kafka_to_kafka_exactly_once() {
    kafka_to_kafka_crash_at("mid-alignment");
    kafka_to_kafka_crash_at("after-ack");
}

#[test]
fn a_crash_after_the_progress_marker_before_its_log_entry_aborts_that_transaction() {
    // Checkpoint 3 never completes (its log entry, hence its
    // acknowledgement, was never written): the restore fences the slot, the
    // broker aborts the marker with the records, and the source replays them.
    kafka_to_kafka_crash_at("after-marker");
}

#[test]
fn a_crash_in_the_sink_before_it_commits_a_completed_checkpoint_keeps_exactly_once() {
    kafka_to_kafka_crash_at("after-complete");
    kafka_to_kafka_crash_at("before-sink-commit");
    kafka_to_kafka_crash_at("before-commit");
}

/// The broker is down when the job starts, comes up, freezes mid-run and
/// goes on: the job waits for it (or restarts, with backoff, where a
/// request timed out) and the output is exactly once. (Mid-run it is
/// frozen, not stopped: see `broker_freezes_at_random_moments_...`.)
#[test]
fn a_broker_down_at_start_and_frozen_mid_run_costs_no_record() {
    let broker = kafka::PrivateBroker::start();
    let job = Job::counting(2, 30_000, 40, 0, "200ms").input_from_kafka_on(&broker.client(), 3, 3_000).output_to_kafka_on(&broker.client(), "exactly-once");
    broker.stop();
    let child = job.spawn(&["--max-restarts", "30"]);
    std::thread::sleep(Duration::from_secs(4));
    broker.resume();
    // Until output is committed (the job got going), then freeze it.
    let start = std::time::Instant::now();
    // (Read without waiting for open transactions: a running job always has one.)
    while broker.client().read_all(job.kafka_output.as_ref().unwrap().1.as_str(), "read_committed").is_empty() {
        assert!(start.elapsed() < Duration::from_secs(90), "no output committed after the broker came up");
        std::thread::sleep(Duration::from_millis(300));
    }
    broker.freeze();
    std::thread::sleep(Duration::from_secs(3));
    broker.thaw();
    let out = wait_with_timeout(child, Duration::from_secs(240));
    let err = stderr(&out);
    assert!(out.status.success(), "weir run failed:\n{err}");
    // The clients' complaints about the missing broker are rate-limited:
    // a line per kind every 10 s, not one per client per reconnect.
    let complaints = err.lines().filter(|l| l.contains("librdkafka")).count();
    println!("{complaints} lines from librdkafka in {} lines:\n{err}", err.lines().count());
    assert!(complaints < 100, "{complaints} lines from librdkafka flood the log:\n{err}");
    // An open transaction would hide later records from the read below.
    job.assert_no_open_transaction();
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
}

/// Freezes of the only broker at random moments (while records are read,
/// written, marked, committed or settled on restore), each of a random
/// length up to 8 s (SIGSTOP, then SIGCONT: a long GC pause, a network cut),
/// shorter than the broker's session, so that its controller never fences it:
/// the job rides them out (the source waits for the broker; a request
/// waits up to its 30 s timeout) or restarts through them, and every record
/// lands once.
///
/// Never a stop or a kill of this broker while transactions commit: a
/// single broker without replicas, stopped (SIGTERM) or killed at random
/// moments, was seen to leave a partition without the commit marker of a
/// transaction its coordinator had logged as CompleteCommit (an open
/// transaction holding the progress topic for the whole transaction
/// timeout), and killed, to cut markers it had written (records lost, or
/// aborted records committed later by the same producer); and a freeze
/// past its session, after which its controller fenced it, the same. That breaks
/// every Kafka transaction, not only weir's; Kafka keeps them by
/// replication. `WEIR_OUTAGE_SEED` repeats a run; the seed is printed first.
#[test]
fn broker_freezes_at_random_moments_keep_kafka_to_kafka_exactly_once() {
    use rand::{Rng, SeedableRng};
    let seed = std::env::var("WEIR_OUTAGE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random::<u64>);
    println!("WEIR_OUTAGE_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let broker = kafka::PrivateBroker::start();
    // At 700 records a second the job reads for about a minute, longer than
    // four freezes take.
    let job = Job::counting(2, 40_000, 40, 0, "200ms").input_from_kafka_on(&broker.client(), 3, 700).output_to_kafka_on(&broker.client(), "exactly-once");
    let mut child = job.spawn(&["--max-restarts", "60"]);
    let mut outages = Vec::new();
    for _ in 0..4 {
        let up = Duration::from_millis(rng.random_range(300..3_000));
        std::thread::sleep(up);
        if child.try_wait().unwrap().is_some() {
            break;
        }
        let down = Duration::from_millis(rng.random_range(200..8_000));
        broker.freeze();
        std::thread::sleep(down);
        broker.thaw();
        outages.push((up.as_millis(), down.as_millis()));
        // Said as they happen: a run that hangs is killed before the end.
        println!("seed {seed}: freeze {} (up ms, frozen ms): {:?}", outages.len(), outages.last().unwrap());
    }
    let out = wait_with_timeout_explained(child, Duration::from_secs(300), || job.kafka_transactions_now());
    let err = stderr(&out);
    println!("seed {seed}: freezes (up ms, frozen ms) {outages:?}\n{err}");
    assert!(out.status.success(), "seed {seed}: weir run failed:\n{err}");
    assert!(outages.len() >= 2, "seed {seed}: the job ended after {} freezes", outages.len());
    job.assert_no_open_transaction();
    job.assert_exactly_once();
    assert_sink_log_empty(&job);
}

#[test]
fn whole_tree_kills_then_a_rescaled_restore_hand_each_partition_its_offset() {
    let job = Job::counting(3, 60_000, 60, 0, "200ms").input_from_kafka(5, 10_000);
    let out = kill_trees_then_restore_latest(&job, 700..1500, Some("2"));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn an_at_least_once_kafka_sink_delivers_every_record_after_worker_kills() {
    let job = Job::counting(2, 20_000, 40, 10_000, "200ms").output_to_kafka("at-least-once");
    run_with_worker_kills(&job);
    let records = job.committed_lines();
    let mut seen: HashMap<i64, u32> = HashMap::new();
    for r in &records {
        *seen.entry(r["seq"].as_i64().unwrap()).or_default() += 1;
    }
    assert_eq!(seen.len() as u64, job.events, "every event at least once");
    let repeated = seen.values().filter(|n| **n > 1).count();
    println!("at-least-once: {} records for {} events, {repeated} events repeated", records.len(), job.events);
}

/// A pipeline reading `topic` into `out/eo` unchanged, with `extra` source settings.
fn copy_job(topic: &str, schema: &str, extra: &str) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: 1\ncheckpoint:\n  interval: 200ms\nsource:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    schema: {schema}\n    stop: end\n{extra}sink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n",
        kafka::bootstrap()
    );
    Job::with_pipeline(&yaml, 0, 1)
}

fn values(job: &Job, field: &str) -> Vec<i64> {
    let mut v: Vec<i64> = job.committed_lines().iter().map(|l| l[field].as_i64().unwrap()).collect();
    v.sort();
    v
}

fn numbered(range: std::ops::Range<i64>) -> Vec<(i32, String)> {
    range.map(|n| (0, format!(r#"{{"n":{n}}}"#))).collect()
}

#[test]
fn read_committed_never_sees_an_aborted_transaction_and_read_uncommitted_does() {
    let topic = kafka::topic("isolation");
    kafka::create_topic(&topic, 1);
    kafka::produce(&topic, &numbered(0..3), Some(true));
    kafka::produce(&topic, &numbered(3..6), Some(false));
    kafka::produce(&topic, &numbered(6..9), Some(true));
    kafka::produce(&topic, &numbered(9..10), None);

    let committed = copy_job(&topic, "{n: int64}", "");
    let out = committed.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(values(&committed, "n"), [0, 1, 2, 6, 7, 8, 9]);

    let uncommitted = copy_job(&topic, "{n: int64}", "    isolation: read_uncommitted\n");
    let out = uncommitted.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(values(&uncommitted, "n"), (0..10).collect::<Vec<_>>());
}

/// The check the sink tests make after a run sees an open transaction.
#[test]
fn an_open_transaction_holds_its_partition_until_it_ends() {
    let broker = kafka::Broker::shared();
    let topic = kafka::topic("open");
    broker.create_topic(&topic, 2);
    broker.produce(&topic, &numbered(0..3), Some(true));
    assert!(broker.partitions_held_by_open_transactions(&topic).is_empty());
    let open = broker.open_transaction(&topic, &numbered(3..5));
    assert_eq!(broker.partitions_held_by_open_transactions(&topic), [0]);
    rdkafka::producer::Producer::abort_transaction(&open, Duration::from_secs(30)).unwrap();
    // The abort returns once the coordinator decided it; its markers reach
    // the partition a moment later (seen: still held right after).
    assert_eq!(broker.partitions_held_after(&topic, Duration::from_secs(20)), Vec::<i32>::new());
}

#[test]
fn start_positions_apply_to_a_first_start() {
    let topic = kafka::topic("start");
    kafka::create_topic(&topic, 2);
    kafka::produce(&topic, &numbered(0..5), None);
    std::thread::sleep(Duration::from_millis(50));
    let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    std::thread::sleep(Duration::from_millis(50));
    let later: Vec<(i32, String)> = (5..10).map(|n| ((n % 2) as i32, format!(r#"{{"n":{n}}}"#))).collect();
    kafka::produce(&topic, &later, None);

    let earliest = copy_job(&topic, "{n: int64}", "");
    assert!(earliest.run(&[]).status.success());
    assert_eq!(values(&earliest, "n"), (0..10).collect::<Vec<_>>());

    let since = copy_job(&topic, "{n: int64}", &format!("    start: timestamp\n    start_timestamp: {t}\n"));
    let out = since.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(values(&since, "n"), (5..10).collect::<Vec<_>>());

    let latest = copy_job(&topic, "{n: int64}", "    start: latest\n");
    let out = latest.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(values(&latest, "n"), Vec::<i64>::new());
}

/// Waits (30 s at most) until the committed values of field `n` are `want`.
fn wait_for_values(job: &Job, want: &[i64]) {
    let start = std::time::Instant::now();
    while values(job, "n") != want {
        assert!(start.elapsed() < Duration::from_secs(30), "committed {:?}, expected {want:?}", values(job, "n"));
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_restore_resumes_at_the_checkpointed_offsets_whatever_the_start_position_says() {
    // `start` applies to a job's first start only; a restore resumes where
    // its snapshot stopped reading. Were `start: latest` applied again, the
    // records produced while the job was stopped would be skipped.
    let topic = kafka::topic("resume");
    kafka::create_topic(&topic, 2);
    kafka::produce(&topic, &numbered(0..5), None);
    let yaml = format!(
        "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 200ms\nsource:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    schema: {{n: int64}}\n    start: latest\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n",
        kafka::bootstrap()
    );
    let job = Job::with_pipeline(&yaml, 0, 1);
    let both = |r: std::ops::Range<i64>| r.map(|n| ((n % 2) as i32, format!(r#"{{"n":{n}}}"#))).collect::<Vec<_>>();
    let mut first = KillOnDrop::new(job.spawn(&[]));
    // The start position is resolved to offsets before the first checkpoint.
    job.wait_for_first_checkpoint();
    kafka::produce(&topic, &both(5..10), None);
    wait_for_values(&job, &(5..10).collect::<Vec<_>>());
    let savepoint = job.take_savepoint_with(&["--stop"]);
    assert!(first.wait_for(Duration::from_secs(30)).is_some_and(|s| s.success()), "the job did not stop with its savepoint");

    kafka::produce(&topic, &both(10..15), None);
    let mut resumed = KillOnDrop::new(job.spawn(&["--restore", &savepoint]));
    wait_for_values(&job, &(5..15).collect::<Vec<_>>());
    job.take_savepoint_with(&["--stop"]);
    assert!(resumed.wait_for(Duration::from_secs(30)).is_some_and(|s| s.success()), "the resumed job did not stop with its savepoint");
    assert_eq!(values(&job, "n"), (5..15).collect::<Vec<_>>(), "each record produced after the first start, once");
}

/// `records_in` of the running job, as `weir status` reports it.
fn records_in(job: &Job) -> u64 {
    let out = job.weir(&["status", "--state-dir", "state"]).output().unwrap();
    serde_json::from_slice::<serde_json::Value>(&out.stdout).ok().and_then(|s| s["records_in"].as_u64()).unwrap_or(0)
}

#[test]
fn a_run_that_dies_before_its_first_checkpoint_restarts_where_start_latest_first_resolved() {
    // `start: latest` is resolved once for a job's history: the first run
    // resolves it, reads, and dies before any checkpoint; the restart must
    // begin at the offsets the first run began at, not at the end of the
    // topic as it is by then, or what was produced in between is lost.
    let topic = kafka::topic("latest-once");
    kafka::create_topic(&topic, 2);
    kafka::produce(&topic, &numbered(0..5), None);
    let yaml = format!(
        "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 10m\nsource:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    schema: {{n: int64}}\n    start: latest\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n",
        kafka::bootstrap()
    );
    let job = Job::with_pipeline(&yaml, 0, 1);
    let both = |r: std::ops::Range<i64>| r.map(|n| ((n % 2) as i32, format!(r#"{{"n":{n}}}"#))).collect::<Vec<_>>();
    let mut run = KillOnDrop::new(job.spawn(&[]));
    // Produced until the first run has read some: its start is resolved.
    let start = std::time::Instant::now();
    let mut n = 5;
    while records_in(&job) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "the first run read nothing");
        kafka::produce(&topic, &both(n..n + 2), None);
        n += 2;
        std::thread::sleep(Duration::from_millis(200));
    }
    // Everything produced since its start is read: how much tells where it began.
    let mut read = records_in(&job);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = records_in(&job);
        if now == read {
            break;
        }
        read = now;
    }
    let first_start = n - read as i64;
    // Killed before any checkpoint (the interval is 10 minutes); more is
    // produced while the supervisor restarts it.
    let (pids, first_run) = job.worker_pids().unwrap();
    kill(pids[0]);
    kafka::produce(&topic, &both(n..n + 4), None);
    n += 4;
    let start = std::time::Instant::now();
    while job.worker_pids().is_none_or(|(_, run)| run == first_run) || records_in(&job) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "the job did not restart and read");
        std::thread::sleep(Duration::from_millis(100));
    }
    kafka::produce(&topic, &both(n..n + 4), None);
    n += 4;
    let start = std::time::Instant::now();
    while records_in(&job) < (n - first_start) as u64 {
        assert!(start.elapsed() < Duration::from_secs(30), "the restarted run read {} of the {} records from the first run's start", records_in(&job), n - first_start);
        std::thread::sleep(Duration::from_millis(100));
    }
    job.take_savepoint_with(&["--stop"]);
    assert!(run.wait_for(Duration::from_secs(30)).is_some_and(|s| s.success()), "the job did not stop with its savepoint");
    // What was produced before the first run resolved its start is not
    // read (that is `latest`); from there on every record, once.
    let got = values(&job, "n");
    assert_eq!(got, (first_start..n).collect::<Vec<_>>(), "every record from the first run's start on, once");
}

#[test]
fn bad_messages_fail_naming_partition_and_offset_or_are_skipped_and_counted_or_sent_to_a_dead_letter_topic() {
    let topic = kafka::topic("bad");
    kafka::create_topic(&topic, 1);
    let messages: Vec<(i32, String)> =
        [r#"{"n":0}"#, r#"{"n":1}"#, r#"{"n":"two"}"#, r#"{"n":3}"#, "not json", r#"{"n":5}"#].iter().map(|m| (0, m.to_string())).collect();
    kafka::produce(&topic, &messages, None);

    let fail = copy_job(&topic, "{n: int64}", "");
    let out = fail.run(&[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains(&topic) && err.contains("partition 0 offset 2"), "the error does not name topic, partition and offset:\n{err}");
    assert!(err.contains("`n`"), "the error does not name the field:\n{err}");
    assert!(!err.contains("restarting"), "a bad message is fatal, not worth a restart:\n{err}");

    let skip = copy_job(&topic, "{n: int64}", "    bad_messages: skip\n");
    let out = skip.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(values(&skip, "n"), [0, 1, 3, 5]);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the run's summary");
    assert_eq!(summary["records_skipped"], 2, "summary: {summary}");

    let dead = kafka::topic("dead-letter");
    kafka::create_topic(&dead, 1);
    let dlq = copy_job(&topic, "{n: int64}", &format!("    bad_messages: dead_letter\n    dead_letter_topic: {dead}\n"));
    let out = dlq.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(values(&dlq, "n"), [0, 1, 3, 5]);
    let copies = kafka::read_all(&dead, "read_committed");
    let got: Vec<(&str, &str)> = copies.iter().map(|m| (m.value.as_str(), m.headers["weir.source.offset"].as_str())).collect();
    assert_eq!(got, [(r#"{"n":"two"}"#, "2"), ("not json", "4")]);
    assert_eq!(copies[0].headers["weir.source.topic"], topic);
    assert!(copies[0].headers["weir.error"].contains("`n`"), "headers: {:?}", copies[0].headers);
}

#[test]
fn a_missing_topic_or_a_too_short_transaction_timeout_fails_at_once_naming_the_setting() {
    let missing = copy_job("no-such-topic-anywhere", "{n: int64}", "");
    let out = missing.run(&[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("no-such-topic-anywhere") && err.contains("source.kafka.topic"), "{err}");
    assert!(!err.contains("restarting"), "{err}");

    let job = Job::counting(1, 100, 10, 0, "30s").output_to_kafka("exactly-once");
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replace("    guarantee: exactly-once\n    progress_topic", "    guarantee: exactly-once\n    transaction_timeout: 60s\n    progress_topic"));
    let out = job.run(&[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("sink.kafka.transaction_timeout") && err.contains("checkpoint.interval (30s)") && err.contains("checkpoint.timeout (1m)"),
        "the error does not name both settings:\n{err}"
    );
}

/// The seqs a read_committed reader sees, with how often, after checking
/// that every record is the one a failure-free run writes.
fn committed_seq_counts(job: &Job) -> HashMap<i64, u32> {
    let mut seen: HashMap<i64, u32> = HashMap::new();
    for r in job.committed_lines() {
        let seq = r["seq"].as_i64().unwrap();
        assert_eq!(r["key"].as_i64(), Some(seq % job.keys as i64), "record {r}");
        *seen.entry(seq).or_default() += 1;
    }
    seen
}

#[test]
fn a_stop_with_savepoint_commits_its_transaction_and_resuming_it_writes_nothing_twice() {
    // A stop-with-savepoint publishes the interval up to it and leaves no
    // transaction open: read_committed readers of the topic (and of the
    // shared progress topic) are not held back, and a job never resumed
    // has published everything it read. Resuming writes nothing twice.
    let (job, sp) = stopped_with_a_savepoint();
    job.assert_no_open_transaction();
    let published = job.assert_once_up_to_a_point();
    assert!(published > 0 && (published as u64) < job.events, "published {published} of {} events", job.events);
    resume_exactly_once(&job, &sp);
    assert_sink_log_empty(&job);
}

/// A Kafka → Kafka job stopped with a savepoint after its first checkpoint,
/// and the savepoint's location.
fn stopped_with_a_savepoint() -> (Job, String) {
    let job = Job::counting(2, 120_000, 20, 15_000, "200ms").output_to_kafka("exactly-once");
    let child = job.spawn(&[]);
    job.wait_for_first_checkpoint();
    // Retries while the control endpoint is between two attempts of the run.
    let sp = job.take_savepoint_with(&["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    (job, sp)
}

/// Resumes `savepoint` and checks the output is exactly once.
fn resume_exactly_once(job: &Job, savepoint: &str) {
    let resumed = job.command(&["--restore", savepoint]).env("RUST_LOG", "info").stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let out = wait_with_timeout(resumed, Duration::from_secs(90));
    assert!(out.status.success(), "resuming the savepoint {savepoint} failed:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_stop_savepoint_moved_elsewhere_resumes_exactly_once_after_the_state_directory_is_gone() {
    // A savepoint is self-contained: it carries the log entries its state
    // names, so it restores after being moved and after the job's state
    // directory (and its `wal/`) is deleted; its own transaction was
    // committed by the stop and is settled by its marker, not written again.
    let (job, sp) = stopped_with_a_savepoint();
    let moved = job.path("elsewhere/kept-savepoint");
    std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
    std::fs::rename(&sp, &moved).unwrap();
    std::fs::remove_dir_all(job.path("state")).unwrap();
    resume_exactly_once(&job, moved.to_str().unwrap());
}

#[test]
fn a_savepoint_a_crash_and_then_restoring_the_savepoint_again_loses_nothing() {
    // A fork: the savepoint is restored after the job went on past it, so
    // what came after it may be written twice (identical records), but
    // nothing may be missing, and its own transaction is settled once.
    let job = Job::counting(2, 60_000, 20, 15_000, "300ms").output_to_kafka("exactly-once");
    let mut child = KillOnDrop::new(job.spawn(&[]));
    job.wait_for_first_checkpoint();
    let sp = job.take_savepoint();
    kill(job.worker_pids().unwrap().0[0]);
    std::thread::sleep(Duration::from_millis(1500));
    child.kill();
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(120));
    assert!(out.status.success(), "restoring the savepoint failed:\n{}", stderr(&out));
    let seen = committed_seq_counts(&job);
    assert_eq!(seen.len() as u64, job.events, "every event at least once after the fork");
    // Restoring it once more (a second fork from the same savepoint) still
    // finishes: its entries are settled by their markers, not by log files
    // that are gone by now.
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(120));
    assert!(out.status.success(), "restoring the savepoint a second time failed:\n{}", stderr(&out));
    assert_eq!(committed_seq_counts(&job).len() as u64, job.events);
}

#[test]
fn a_fresh_start_at_a_lower_parallelism_fences_the_transactions_a_crashed_run_left_open() {
    // A run killed before its first checkpoint leaves its transactions
    // open, and no checkpoint names their ids. A fresh start at parallelism
    // 1 has no subtask 1 or 2 to fence theirs by name; the ids recorded in
    // storage let subtask 0 fence them. Else every read_committed reader of
    // their partitions waits for the transaction timeout (10 minutes).
    let job = Job::counting(3, 20_000, 12, 4_000, "1m").output_to_kafka("exactly-once");
    let (broker, topic) = job.kafka_output.clone().unwrap();
    let mut first = KillOnDrop::new(job.spawn(&[]));
    let start = std::time::Instant::now();
    while broker.partitions_held_by_open_transactions(&topic).len() < 3 {
        assert!(start.elapsed() < Duration::from_secs(30), "the first run's transactions never held every partition");
        std::thread::sleep(Duration::from_millis(100));
    }
    first.kill();
    assert!(job.latest().is_none(), "the first run completed a checkpoint: the test needs it killed before one");
    let out = wait_with_timeout(job.spawn(&["--parallelism", "1"]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_no_open_transaction();
    job.assert_exactly_once();
}

#[test]
fn restoring_a_checkpoint_into_a_new_topic_settles_what_the_old_topic_got() {
    // The final checkpoint's transaction committed to the old topic and its
    // log file is gone; the new progress topic has no marker of it. That is
    // no lost record (a log file goes only once its records are committed):
    // the restore goes on, says so, and writes nothing of it again.
    let job = Job::counting(2, 6_000, 10, 0, "150ms").output_to_kafka("exactly-once");
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    let latest = job.latest().expect("a retained checkpoint");
    let (broker, old) = job.kafka_output.clone().unwrap();
    let new = kafka::topic("eo-out-new");
    broker.create_topic(&new, 3);
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replace(&old, &new));
    let out = job.command(&["--restore", &latest]).env("RUST_LOG", "warn").output().unwrap();
    assert!(out.status.success(), "restoring {latest} into topic {new} failed:\n{}", stderr(&out));
    assert!(stderr(&out).contains("taken as committed") && stderr(&out).contains(&old), "the restore did not say how it settled the old transaction:\n{}", stderr(&out));
    assert_eq!(broker.committed_records(&new), Vec::<serde_json::Value>::new(), "the final checkpoint's records were written again");
    assert_sink_log_empty(&job);
}

#[test]
fn kafka_to_postgres_in_each_mode_with_worker_kills_is_exactly_once() {
    let pg = postgres::Server::start();
    for mode in ["two-phase-commit", "write-ahead-log"] {
        let job = Job::counting(2, 40_000, 60, 0, "200ms")
            .input_from_kafka(4, 10_000)
            .output_to_postgres(&pg, mode, "seq bigint, key bigint, value bigint, count bigint");
        run_with_worker_kills(&job);
        job.assert_exactly_once();
    }
    let (events, keys) = (40_000u64, 60u64);
    let job = Job::counting(2, events, keys, 0, "200ms")
        .input_from_kafka(4, 10_000)
        .output_to_postgres(&pg, "upsert", "key bigint PRIMARY KEY, seq bigint, value bigint, count bigint");
    run_with_worker_kills(&job);
    // Each key's final row holds the count of all its events.
    let rows: Vec<serde_json::Value> = job.committed_lines();
    assert_eq!(rows.len() as u64, keys);
    for r in rows {
        let key = r["key"].as_i64().unwrap();
        let n = (events as i64 - key + keys as i64 - 1) / keys as i64;
        assert_eq!(r["count"].as_i64(), Some(n), "count of key {key}");
    }
    let left = pg.prepared();
    assert!(left.is_empty(), "prepared transactions left after the jobs finished: {left:?}");
}

#[test]
fn two_states_of_one_job_id_writing_one_topic_never_fence_each_other() {
    // Two copies of job `eo-test` (two state directories, or colliding job
    // ids) write to one topic at once. Transactional ids named by the job
    // id alone would be the same in both: each start would fence the
    // other's producers, and the two would restart each other in turn.
    let first = Job::counting(2, 20_000, 16, 8_000, "150ms").output_to_kafka("exactly-once");
    let second = Job::counting(2, 20_000, 16, 8_000, "150ms");
    second.write_pipeline(&std::fs::read_to_string(first.path("pipeline.yaml")).unwrap());
    let runs = [("first", first.spawn(&[])), ("second", second.spawn(&[]))];
    for (name, child) in runs {
        let out = wait_with_timeout(child, Duration::from_secs(120));
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert!(stderr(&out).contains(" 0 restarts"), "the {name} job was restarted (fenced by the other?):\n{}", stderr(&out));
    }
    let mut seen = std::collections::BTreeMap::<i64, u32>::new();
    for v in first.committed_lines() {
        assert_eq!(v["key"].as_i64(), v["seq"].as_i64().map(|s| s % 16), "{v}");
        *seen.entry(v["seq"].as_i64().unwrap()).or_default() += 1;
    }
    let wrong: Vec<_> = (0..20_000).filter(|s| seen.get(s) != Some(&2)).take(5).map(|s| (s, seen.get(&s).copied().unwrap_or(0))).collect();
    assert!(wrong.is_empty() && seen.len() == 20_000, "each job writes every event once: (seq, copies) {wrong:?}");
    first.assert_no_open_transaction();
}
