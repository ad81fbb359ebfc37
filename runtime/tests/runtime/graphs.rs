//! Pipelines written as graphs (runtime/design/graphs.md): several sources,
//! fan-out, union and broadcast, under worker and whole-tree kills. Each
//! output is checked against the counting oracle of `common` (every seq
//! once, per key the counts 1..n), computed from the generator's rule
//! (`key = seq % keys`, `value = seq`), never from another weir run.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;

/// Two generators of the same events, the first keeping the even keys and
/// the second the odd ones (`keys` is even, so a key's parity is its seqs'),
/// merged by a union, then counted per key: the output is the counting
/// job's, every seq once.
fn two_sources_in_one_union(
    parallelism: u32,
    events: u64,
    keys: u64,
    rate: u64,
    interval: &str,
) -> Job {
    assert_eq!(keys % 2, 0);
    let generator =
        format!("generator: {{events: {events}, keys: {keys}, rate: {rate}, batch_size: 256}}");
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint: {{interval: {interval}}}\n\
         sources:\n  a: {{{generator}}}\n  b: {{{generator}}}\n\
         steps:\n  - {{name: evens, input: a, filter: \"key % 2 = 0\"}}\n  - {{name: odds, input: b, filter: \"key % 2 = 1\"}}\n\
         \x20 - {{name: both, input: [evens, odds], union: {{}}}}\n  - {{name: keyed, input: both, key_by: key}}\n\
         \x20 - {{name: counts, input: keyed, running_count: count}}\n\
         sinks:\n  out:\n    input: counts\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n"
    );
    Job::with_pipeline(&yaml, events, keys)
}

/// Four worker SIGKILLs at random moments, at least one restart, then the
/// counting oracle.
fn counts_every_event_once_under_worker_kills(job: &Job) {
    let out = run_with_worker_kills(job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_union_of_two_sources_counts_every_event_once_under_worker_kills() {
    let job = two_sources_in_one_union(2, 120_000, 98, 30_000, "150ms");
    counts_every_event_once_under_worker_kills(&job);
}

#[test]
fn a_union_of_two_sources_restores_after_whole_tree_kills_at_another_parallelism() {
    // 5 s of events; three rounds of at most 0.9 s each cannot finish it.
    let job = two_sources_in_one_union(2, 150_000, 54, 30_000, "200ms");
    kill_trees_then_restore_latest(&job, 400..900, Some("3"));
    job.assert_exactly_once();
}

#[test]
fn one_source_fanned_out_and_unioned_again_delivers_every_record_once_under_kills() {
    // The diamond: barriers reach the union over both paths, and aligned
    // checkpoints must neither deadlock nor let a record through twice.
    let yaml = "name: eo-test\nparallelism: 2\ncheckpoint: {interval: 150ms}\n\
                sources:\n  a: {generator: {events: 120000, keys: 64, rate: 30000, batch_size: 256}}\n\
                steps:\n  - {name: low, input: a, filter: \"key < 20\"}\n  - {name: high, input: a, filter: \"key >= 20\"}\n\
                \x20 - {name: both, input: [low, high], union: {}}\n  - {name: keyed, input: both, key_by: key}\n\
                \x20 - {name: counts, input: keyed, running_count: count}\n\
                sinks:\n  out:\n    input: counts\n    file: {path: out/eo, format: jsonl, guarantee: exactly-once}\n";
    let job = Job::with_pipeline(yaml, 120_000, 64);
    counts_every_event_once_under_worker_kills(&job);
}

#[test]
fn a_broadcast_delivers_every_record_to_every_subtask_once_under_kills() {
    let (parallelism, events) = (3u32, 60_000i64);
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint: {{interval: 150ms}}\n\
         sources:\n  a: {{generator: {{events: {events}, keys: 10, rate: 20000, batch_size: 256}}}}\n\
         steps:\n  - {{name: everywhere, input: a, broadcast: {{}}}}\n  - {{name: kept, input: everywhere, filter: \"seq >= 0\"}}\n\
         sinks:\n  out:\n    input: kept\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n"
    );
    let job = Job::with_pipeline(&yaml, events as u64, 10);
    run_with_worker_kills(&job, 3, |_| {});
    let mut copies: BTreeMap<i64, u32> = BTreeMap::new();
    for line in job.committed_lines() {
        let seq = line["seq"].as_i64().expect("seq");
        assert_eq!(line["key"].as_i64(), Some(seq % 10), "key of seq {seq}");
        *copies.entry(seq).or_default() += 1;
    }
    assert_eq!(
        copies.len() as i64,
        events,
        "committed {} distinct seqs of {events}",
        copies.len()
    );
    let wrong: Vec<_> = copies
        .iter()
        .filter(|(_, n)| **n != parallelism)
        .take(5)
        .collect();
    assert!(
        wrong.is_empty(),
        "seqs committed other than {parallelism} times (seq, times): {wrong:?}"
    );
}

#[test]
fn the_graph_example_runs_and_counts_each_key_from_its_one_source() {
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/graph.yaml"
    ))
    .unwrap();
    let job = Job::with_pipeline(
        &yaml
            .replace("name: graph", "name: eo-test")
            .replace("out/graph", "out/eo"),
        0,
        100,
    );
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", stderr(&out));
    // clicks: 200000 events, the even keys; views: 100000, the odd ones.
    let mut expected: BTreeMap<i64, i64> = BTreeMap::new();
    for seq in 0..200_000i64 {
        if seq % 2 == 0 {
            *expected.entry(seq % 100).or_default() += 1;
        }
    }
    for seq in 0..100_000i64 {
        if seq % 2 == 1 {
            *expected.entry(seq % 100).or_default() += 1;
        }
    }
    let mut last: BTreeMap<i64, i64> = BTreeMap::new();
    let lines = job.committed_lines();
    for l in &lines {
        let (key, count) = (l["key"].as_i64().unwrap(), l["count"].as_i64().unwrap());
        let top = last.entry(key).or_default();
        *top = (*top).max(count);
    }
    assert_eq!(lines.len() as i64, expected.values().sum::<i64>());
    assert_eq!(last, expected);
}

#[test]
fn the_join_example_runs_and_counts_every_pair_of_each_key_once() {
    let yaml = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/join.yaml")).unwrap();
    let job = Job::with_pipeline(&yaml.replace("name: join", "name: eo-test").replace("out/join", "out/eo"), 0, 100);
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", stderr(&out));
    // Per key, every order (seq < 4000) with every shipment (seq < 3000).
    let mut orders: BTreeMap<i64, i64> = BTreeMap::new();
    let mut shipments: BTreeMap<i64, i64> = BTreeMap::new();
    (0..4000i64).for_each(|seq| *orders.entry(seq % 1000).or_default() += 1);
    (0..3000i64).for_each(|seq| *shipments.entry(seq % 1000).or_default() += 1);
    let expected: BTreeMap<i64, i64> = orders.iter().map(|(k, n)| (*k, n * shipments.get(k).copied().unwrap_or(0))).collect();
    let mut last: BTreeMap<i64, i64> = BTreeMap::new();
    let lines = job.committed_lines();
    for l in &lines {
        let (key, pairs) = (l["key"].as_i64().unwrap(), l["pairs"].as_i64().unwrap());
        assert_eq!(l["shipments_key"].as_i64(), Some(key), "a pair of two keys: {l}");
        let top = last.entry(key).or_default();
        *top = (*top).max(pairs);
    }
    assert_eq!(lines.len() as i64, expected.values().sum::<i64>(), "one line per pair");
    assert_eq!(last, expected);
}

/// A busy generator and a Kafka topic nobody writes to, merged by a union
/// and counted per key in tumbling windows of event time: the quiet input
/// is idle after its `idle_timeout` and holds back neither the watermark
/// (windows of the busy input fire and are committed while the job runs)
/// nor the checkpoints (they complete at the interval).
#[test]
fn an_idle_kafka_source_beside_a_busy_one_holds_back_neither_checkpoints_nor_windows() {
    let broker = kafka::Broker::shared();
    let topic = kafka::topic("idle");
    broker.create_topic(&topic, 2);
    let (events, keys) = (60_000u64, 10i64);
    let yaml = format!(
        "name: eo-test\nparallelism: 2\ncheckpoint: {{interval: 200ms}}\n\
         sources:\n  busy:\n    generator: {{events: {events}, keys: {keys}, rate: 6000, batch_size: 10}}\n\
         \x20   event_time: {{field: value, max_out_of_orderness: 2s, idle_timeout: 500ms}}\n\
         \x20 quiet:\n    kafka: {{bootstrap_servers: \"{}\", topic: {topic}, schema: {{seq: int64, key: int64, value: int64}}}}\n\
         \x20   event_time: {{field: value, idle_timeout: 500ms}}\n\
         steps:\n  - {{name: both, input: [busy, quiet], union: {{}}}}\n  - {{name: keyed, input: both, key_by: key}}\n\
         \x20 - {{name: per_second, input: keyed, window: {{tumbling: 1s, aggregates: [{{count: n}}]}}}}\n\
         sinks:\n  out:\n    input: per_second\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n",
        broker.addr
    );
    let job = Job::with_pipeline(&yaml, events, keys as u64);
    let child = job.spawn(&[]);
    // The busy input's first three seconds of event time (3000 events)
    // take half a second to generate; their windows close once its
    // watermark (2 s behind) passes them, if the quiet input holds nothing back.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut lines = Vec::new();
    while std::time::Instant::now() < deadline {
        lines = job.committed_lines();
        if lines.iter().filter(|l| l["window_end"].as_i64().is_some_and(|e| e <= 3000)).count() >= 3 * keys as usize {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let checkpoints = job.latest().and_then(|l| l.rsplit("chk-").next().and_then(|n| n.parse::<u64>().ok()));
    kill_group(child.id());
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "the job reads an endless topic: it should still have been running");
    let mut got: BTreeMap<(i64, i64), Vec<i64>> = BTreeMap::new();
    for l in &lines {
        got.entry((l["key"].as_i64().unwrap(), l["window_start"].as_i64().unwrap())).or_default().push(l["n"].as_i64().unwrap());
    }
    for window in 0..3 {
        for key in 0..keys {
            // Window [1000w, 1000w + 1000) holds the seqs of its range, a
            // tenth of them per key.
            assert_eq!(got.get(&(key, window * 1000)), Some(&vec![100]), "key {key}, window {window}: committed once with its count while the quiet input was idle\n{}", stderr(&out));
        }
    }
    assert!(checkpoints.is_some_and(|n| n >= 3), "checkpoints completed while the quiet input was idle: latest {checkpoints:?}\n{}", stderr(&out));
}

/// A fast and a slow source (100× apart in rate, both about two seconds
/// long) in one union, counted per key: the fast one's even keys, the slow
/// one's odd keys. Logs at info, so that each checkpoint's duration is in
/// stderr.
fn fast_and_slow_union(checkpoint: &str, slow_stage: Option<&str>) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 200ms\n{checkpoint}\
         sources:\n  fast: {{generator: {{events: 40000, keys: 20, rate: 20000, batch_size: 100}}}}\n\
         \x20 slow: {{generator: {{events: 400, keys: 20, rate: 200, batch_size: 10}}}}\n\
         steps:\n  - {{name: evens, input: fast, filter: \"key % 2 = 0\"}}\n  - {{name: odds, input: slow, filter: \"key % 2 = 1\"}}\n\
         \x20 - {{name: both, input: [evens, odds], union: {{}}}}\n  - {{name: keyed, input: both, key_by: key}}\n\
         \x20 - {{name: counts, input: keyed, running_count: count}}\n\
         sinks:\n  out:\n    input: counts\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n"
    );
    let mut job = Job::with_pipeline(&yaml, 0, 20);
    job.env.push(("RUST_LOG".into(), "weir_runtime::checkpoint::coordinator=info,warn".into()));
    if let Some(slow) = slow_stage {
        job.env.push(("WEIR_SLOW_STAGE".into(), format!("2:{slow}")));
    }
    job
}

/// Every (key, count) from 1 to the key's number of events once: 2000
/// events per even key from `fast`, 20 per odd key from `slow`.
fn assert_fast_and_slow_counted_once(job: &Job) {
    let mut got: BTreeMap<(i64, i64), u32> = BTreeMap::new();
    for l in job.committed_lines() {
        *got.entry((l["key"].as_i64().unwrap(), l["count"].as_i64().unwrap())).or_default() += 1;
    }
    let mut expected = BTreeMap::new();
    for key in 0..20i64 {
        let events = if key % 2 == 0 { 40000 / 20 } else { 400 / 20 };
        for count in 1..=events {
            expected.insert((key, count), 1u32);
        }
    }
    assert_eq!(got.len(), expected.len(), "(key, count) pairs committed");
    assert_eq!(got, expected, "every count of every key once");
}

/// The durations of the checkpoints that completed, from the
/// coordinator's log lines.
fn checkpoint_durations_ms(stderr: &str) -> Vec<u64> {
    stderr
        .lines()
        .filter(|l| l.contains("checkpoint complete") && l.contains("kind=Checkpoint"))
        .filter_map(|l| l.split_whitespace().find_map(|f| f.strip_prefix("duration_ms=")).and_then(|v| v.parse().ok()))
        .collect()
}

#[test]
fn sources_100_times_apart_in_rate_complete_aligned_checkpoints_at_the_interval_and_unaligned_ones_under_backpressure() {
    let job = fast_and_slow_union("  mode: aligned\n", None);
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    let aligned = checkpoint_durations_ms(&stderr(&out));
    // About two seconds at 200 ms: the slow input does not hold the
    // barriers back, it only sends fewer records between them.
    assert!(aligned.len() >= 5, "aligned checkpoints completed: {aligned:?}\n{}", stderr(&out));
    assert!(aligned.iter().all(|d| *d < 2000), "aligned checkpoint durations (ms): {aligned:?}");
    assert_fast_and_slow_counted_once(&job);

    // Under backpressure (the union's stage slowed), unaligned checkpoints
    // overtake the queued records and keep them.
    // The fast input's 100 batches a second per subtask meet a stage that
    // takes 20 ms a batch: half the speed, so its channels fill.
    let job = fast_and_slow_union("  mode: unaligned\n", Some("20ms"));
    let mut child = job.spawn(&[]);
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let mut in_flight = false;
    while !in_flight && std::time::Instant::now() < until && child.try_wait().unwrap().is_none() {
        in_flight = crate::unaligned::latest_holds(&job, &["in-flight-2-"]);
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = wait_with_timeout(child, Duration::from_secs(120));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(in_flight, "no checkpoint held the fast input's records in flight: was there backpressure?");
    let unaligned = checkpoint_durations_ms(&stderr(&out));
    assert!(unaligned.len() >= 5, "unaligned checkpoints completed under backpressure: {unaligned:?}\n{}", stderr(&out));
    assert_fast_and_slow_counted_once(&job);
    println!("checkpoint durations (ms): aligned {aligned:?}; unaligned under backpressure {unaligned:?}");
}
