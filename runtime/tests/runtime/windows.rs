//! Event-time windows: results computed independently here, compared with
//! what the job committed after worker kills (every window of every key
//! exactly once, with the right aggregates), and late records dropped,
//! counted and, within the allowed lateness, folded into a second firing.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;

/// A generator whose `value` (= seq) is the event time in milliseconds. Its
/// subtasks deal events from 8 interleaved splits in batches of 16, so
/// event times come up to 8 × 16 ms out of order; 200 ms of allowed
/// out-of-orderness means no record is late.
fn windowed(parallelism: u32, events: u64, keys: u64, rate: u64) -> Job {
    windowed_checkpointing(parallelism, events, keys, rate, "")
}

/// [`windowed`] with `checkpoint` lines added to its checkpoint section.
fn windowed_checkpointing(parallelism: u32, events: u64, keys: u64, rate: u64, checkpoint: &str) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\nmax_parallelism: 8\ncheckpoint:\n  interval: 200ms\n{checkpoint}event_time:\n  field: value\n  max_out_of_orderness: 200ms\n\
source:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: {rate}\n    batch_size: 16\n\
steps:\n  - key_by: key\n  - window:\n      tumbling: 1s\n      aggregates:\n        - count: n\n        - sum: {{field: seq, as: total}}\n        - max: {{field: seq, as: last}}\n\
sink:\n  file:\n    path: out/eo\n    format: jsonl\n"
    );
    Job::with_pipeline(&yaml, events, keys)
}

/// (key, window_start) → (count, sum, max), from the events alone.
fn expected_windows(events: u64, keys: u64) -> BTreeMap<(i64, i64), (i64, i64, i64)> {
    let mut out: BTreeMap<(i64, i64), (i64, i64, i64)> = BTreeMap::new();
    for i in 0..events as i64 {
        let w = out.entry((i % keys as i64, i - i % 1000)).or_insert((0, 0, i64::MIN));
        w.0 += 1;
        w.1 += i;
        w.2 = w.2.max(i);
    }
    out
}

fn committed_windows(job: &Job) -> BTreeMap<(i64, i64), Vec<(i64, i64, i64)>> {
    let mut out: BTreeMap<(i64, i64), Vec<(i64, i64, i64)>> = BTreeMap::new();
    for l in job.committed_lines() {
        let (start, end) = (l["window_start"].as_i64().unwrap(), l["window_end"].as_i64().unwrap());
        assert_eq!(end - start, 1000, "{l}");
        out.entry((l["key"].as_i64().unwrap(), start))
            .or_default()
            .push((l["n"].as_i64().unwrap(), l["total"].as_i64().unwrap(), l["last"].as_i64().unwrap()));
    }
    out
}

fn assert_every_window_once(job: &Job) {
    let expected = expected_windows(job.events, job.keys);
    let committed = committed_windows(job);
    let twice: Vec<_> = committed.iter().filter(|(_, v)| v.len() > 1).take(5).collect();
    assert!(twice.is_empty(), "windows committed more than once: {twice:?}");
    let missing: Vec<_> = expected.keys().filter(|k| !committed.contains_key(k)).take(5).collect();
    assert!(missing.is_empty(), "windows never committed (of {}): {missing:?}", expected.len());
    for (k, want) in &expected {
        assert_eq!(&committed[k][0], want, "window {k:?}");
    }
    assert_eq!(committed.len(), expected.len());
}

#[test]
fn tumbling_windows_over_out_of_order_events_fire_once_each_without_failures() {
    let job = windowed(2, 20_000, 7, 0);
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["records_late"], 0, "{summary}");
    assert_every_window_once(&job);
}

#[test]
fn tumbling_windows_survive_worker_kills_exactly_once() {
    let job = windowed(3, 60_000, 30, 15_000);
    let out = run_with_worker_kills(&job, 4, |_| {});
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(summary["records_late"], 0, "records were late after a restore: {summary}\n{}", stderr(&out));
    assert_every_window_once(&job);
}

#[test]
fn tumbling_windows_survive_worker_kills_exactly_once_with_unaligned_checkpoints() {
    // No backpressure: unaligned snapshots then find few records in flight,
    // and the watermark's progress, not a queue, decides what fires.
    let job = windowed_checkpointing(3, 60_000, 30, 15_000, "  mode: unaligned\n");
    let out = run_with_worker_kills(&job, 4, |_| {});
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(summary["records_late"], 0, "records were late after a restore: {summary}\n{}", stderr(&out));
    assert_every_window_once(&job);
}

/// Worker kills of a windowed job whose sink stage is slowed down by
/// `slow` per batch, with `checkpoint` settings.
fn windows_survive_worker_kills_with(checkpoint: &str, slow: &str) {
    let mut job = windowed_checkpointing(3, 40_000, 30, 0, checkpoint);
    job.env.push(("WEIR_SLOW_SINK".into(), slow.into()));
    let out = run_with_worker_kills(&job, 3, |child| crate::unaligned::wait_for_records_in_flight(&job, child));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(summary["records_late"], 0, "records were late after a restore: {summary}\n{}", stderr(&out));
    assert_every_window_once(&job);
}

#[test]
fn tumbling_windows_survive_worker_kills_exactly_once_with_unaligned_checkpoints_under_backpressure() {
    windows_survive_worker_kills_with("  mode: unaligned\n", "2ms");
}

#[test]
fn tumbling_windows_survive_worker_kills_exactly_once_when_alignment_times_out_under_backpressure() {
    windows_survive_worker_kills_with("  alignment_timeout: 10ms\n", "2ms");
}

#[test]
fn late_records_are_counted_and_dropped_or_within_the_lateness_fire_the_window_again() {
    // One subtask, in this order: times 100 and 900 fill [0, 1000); 1500
    // moves the watermark to 1499, which fires it; 950 is then late but
    // within 600 ms of lateness, so the window fires again with it; 2700
    // moves the watermark past 999 + 600, and 10 is dropped and counted.
    let lines = [(1, 100), (1, 900), (1, 1500), (1, 950), (1, 2700), (1, 10)];
    let job = Job::with_pipeline(
        "name: eo-test\nevent_time:\n  field: t\nsource:\n  file:\n    path: in.jsonl\n    schema: {key: int64, t: int64}\n    batch_size: 1\n\
steps:\n  - key_by: key\n  - window:\n      tumbling: 1s\n      allowed_lateness: 600ms\n      aggregates:\n        - count: n\n        - min: {field: t, as: first}\n      late_records: {path: out/late, format: jsonl}\n\
sink:\n  file:\n    path: out/eo\n    format: jsonl\n",
        0,
        0,
    );
    let text: String = lines.iter().map(|(k, t)| format!("{{\"key\":{k},\"t\":{t}}}\n")).collect();
    std::fs::write(job.path("in.jsonl"), text).unwrap();
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["records_late"], 1, "{summary}");
    assert!(stderr(&out).contains("1 late records dropped by windows"), "{}", stderr(&out));
    let mut got: Vec<(i64, i64, i64)> = job
        .committed_lines()
        .iter()
        .map(|l| (l["window_start"].as_i64().unwrap(), l["n"].as_i64().unwrap(), l["first"].as_i64().unwrap()))
        .collect();
    got.sort();
    assert_eq!(got, vec![(0, 2, 100), (0, 3, 100), (1000, 1, 1500), (2000, 1, 2700)]);
    // The dropped record, whole, in the late-records output.
    assert_eq!(job.committed_lines_in("out/late"), vec![serde_json::json!({"key": 1, "t": 10})]);
}

/// Two files of events one millisecond apart per line, five keys, with a
/// straggler 1.5 s behind every 41st line: late or not depending on how
/// far the window's watermark (the slower file's) has come.
fn stragglers(job: &Job, lines: i64) -> BTreeMap<(i64, i64), i64> {
    std::fs::create_dir_all(job.path("in")).unwrap();
    let mut expected: BTreeMap<(i64, i64), i64> = BTreeMap::new();
    for f in 0..2 {
        let mut text = String::new();
        for i in 0..lines {
            let mut line = |t: i64, id: i64| {
                text.push_str(&format!("{{\"key\":{},\"t\":{t},\"f\":{f},\"id\":{id}}}\n", i % 5));
                *expected.entry((i % 5, t - t % 1000)).or_default() += 1;
            };
            line(i, 2 * i);
            if i >= 1500 && i % 41 == 0 {
                line(i - 1500, 2 * i + 1);
            }
        }
        std::fs::write(job.path(&format!("in/{f}.jsonl")), text).unwrap();
    }
    expected
}

/// A job whose window runs in a stage of its own (a key_by follows it), so
/// that its late-records output commits with the checkpoints like a sink
/// of a stage that is not the sink's; with the straggler input it expects.
fn late_records_job() -> (Job, BTreeMap<(i64, i64), i64>) {
    let job = Job::with_pipeline(
        "name: eo-test\nparallelism: 2\nmax_parallelism: 8\ncheckpoint:\n  interval: 200ms\nevent_time:\n  field: t\n  max_out_of_orderness: 200ms\n\
source:\n  file:\n    path: in\n    schema: {key: int64, t: int64, f: int64, id: int64}\n    batch_size: 16\n\
steps:\n  - key_by: key\n  - window:\n      tumbling: 1s\n      aggregates:\n        - count: n\n      late_records: {path: out/late, format: jsonl}\n  - key_by: window_start\n\
sink:\n  file:\n    path: out/eo\n    format: jsonl\n",
        0,
        0,
    );
    let expected = stragglers(&job, 30_000);
    (job, expected)
}

/// Every record once: in its window's count, or in the late output.
fn assert_every_record_counted_or_late_once(job: &Job, expected: &BTreeMap<(i64, i64), i64>) {
    let mut windows: BTreeMap<(i64, i64), Vec<i64>> = BTreeMap::new();
    for l in job.committed_lines() {
        windows.entry((l["key"].as_i64().unwrap(), l["window_start"].as_i64().unwrap())).or_default().push(l["n"].as_i64().unwrap());
    }
    let twice: Vec<_> = windows.iter().filter(|(_, v)| v.len() > 1).take(5).collect();
    assert!(twice.is_empty(), "windows committed more than once: {twice:?}");
    let mut late: BTreeMap<(i64, i64), i64> = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    let late_lines = job.committed_lines_in("out/late");
    for l in &late_lines {
        let (f, id, t) = (l["f"].as_i64().unwrap(), l["id"].as_i64().unwrap(), l["t"].as_i64().unwrap());
        assert!(seen.insert((f, id)), "a late record committed twice: {l}");
        *late.entry((l["key"].as_i64().unwrap(), t - t % 1000)).or_default() += 1;
    }
    assert!(late_lines.len() > 100, "only {} late records: the test does not test them", late_lines.len());
    for (k, want) in expected {
        let counted = windows.get(k).map_or(0, |v| v[0]);
        let dropped = late.get(k).copied().unwrap_or(0);
        assert_eq!(counted + dropped, *want, "window {k:?}: {counted} counted + {dropped} late");
    }
    assert!(windows.keys().chain(late.keys()).all(|k| expected.contains_key(k)), "output for a window without input");
}

#[test]
fn late_records_go_to_their_output_exactly_once_under_worker_kills() {
    let (mut job, expected) = late_records_job();
    // The window's stage is slowed down so that the job lasts for the kills.
    job.env.push(("WEIR_SLOW_STAGE".into(), "1:2ms".into()));
    run_with_worker_kills(&job, 3, |_| {});
    assert_every_record_counted_or_late_once(&job, &expected);
}

#[test]
fn late_records_go_to_their_output_exactly_once_after_crashes_at_the_narrow_points() {
    // Random kills rarely hit between a barrier and its completion, or
    // between completion and commit; these crash points hit them.
    for point in ["after-ack", "before-commit"] {
        let (job, expected) = late_records_job();
        let marker = job.path("fault-fired");
        let mut cmd = job.command(&[]);
        cmd.env("WEIR_FAULT", format!("{point}@3")).env("WEIR_FAULT_ONCE", &marker).env("WEIR_SLOW_STAGE", "1:1ms");
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{point}: {}", stderr(&out));
        assert!(marker.exists(), "the fault at {point} never fired");
        assert!(stderr(&out).contains("restarting"), "{point}: {}", stderr(&out));
        assert_every_record_counted_or_late_once(&job, &expected);
    }
}

#[test]
fn a_window_without_event_time_is_refused_naming_the_step() {
    let job = Job::with_pipeline(
        "name: eo-test\nsource:\n  generator: {events: 10}\nsteps:\n  - key_by: key\n  - window:\n      tumbling: 1s\n      aggregates: [{count: n}]\nsink:\n  blackhole: {}\n",
        0,
        0,
    );
    let err = assert_refused(&job.run(&[]));
    assert!(err.contains("steps[1].window") && err.contains("event_time"), "{err}");
}

#[test]
fn windows_and_running_counts_checkpointed_at_parallelism_4_continue_at_2_and_then_at_6_exactly_once() {
    // A running count after the window: a key's windows fire in order, so
    // the one starting at s is its (s / 1000 + 1)-th, and a count lost or
    // repeated in a rescale shows in every later window of the key.
    let (events, keys) = (60_000, 30);
    let yaml = format!(
        "name: eo-test\nparallelism: 4\nmax_parallelism: 8\ncheckpoint:\n  interval: 200ms\nevent_time:\n  field: value\n  max_out_of_orderness: 200ms\n\
source:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: 15000\n    batch_size: 16\n\
steps:\n  - key_by: key\n  - window:\n      tumbling: 1s\n      aggregates:\n        - count: n\n        - sum: {{field: seq, as: total}}\n        - max: {{field: seq, as: last}}\n  - running_count: windows_so_far\n\
sink:\n  file:\n    path: out/eo\n    format: jsonl\n"
    );
    let job = Job::with_pipeline(&yaml, events, keys);
    let mut args: Vec<&str> = Vec::new();
    for (round, parallelism) in ["2", "6"].into_iter().enumerate() {
        let child = job.spawn(&args);
        std::thread::sleep(Duration::from_millis(1300));
        kill_group(child.id());
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "round {round}: the job ended before it was killed");
        assert!(job.latest().is_some(), "round {round}: no checkpoint to restore");
        args = vec!["--restore", "latest", "--parallelism", parallelism];
    }
    let out = wait_with_timeout(job.spawn(&args), Duration::from_secs(180));
    let err = stderr(&out);
    assert!(out.status.success(), "the run at parallelism 6 failed:\n{err}");
    assert!(err.contains("restoring `eo-test` from checkpoint") && err.contains("parallelism 6"), "{err}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(summary["records_late"], 0, "{summary}");
    assert_every_window_once(&job);
    for l in job.committed_lines() {
        let (start, so_far) = (l["window_start"].as_i64().unwrap(), l["windows_so_far"].as_i64().unwrap());
        assert_eq!(so_far, start / 1000 + 1, "the running count of key {}'s windows: {l}", l["key"]);
    }
}

/// Sessions per key (gap 100 ms) over the generator with every third second
/// filtered out, so each key has a session per two seconds of events.
fn sessions_job(parallelism: u32, events: u64, keys: u64, rate: u64) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\nmax_parallelism: 8\ncheckpoint:\n  interval: 200ms\nevent_time:\n  field: value\n  max_out_of_orderness: 200ms\n\
source:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: {rate}\n    batch_size: 16\n\
steps:\n  - filter: (value / 1000) % 3 <> 2\n  - key_by: key\n  - window:\n      session: {{gap: 100ms}}\n      aggregates:\n        - count: n\n        - sum: {{field: seq, as: total}}\n        - max: {{field: seq, as: last}}\n\
sink:\n  file:\n    path: out/eo\n    format: jsonl\n"
    );
    Job::with_pipeline(&yaml, events, keys)
}

/// (key, start) → (end, count, sum, max) of every session, from the events alone.
fn expected_sessions(events: u64, keys: u64) -> BTreeMap<(i64, i64), (i64, i64, i64, i64)> {
    let mut out = BTreeMap::new();
    for k in 0..keys as i64 {
        let times: Vec<i64> = (0..events as i64).filter(|i| i % keys as i64 == k && (i / 1000) % 3 != 2).collect();
        let mut i = 0;
        while i < times.len() {
            let start = times[i];
            let (mut n, mut sum) = (0, 0);
            let mut j = i;
            while j < times.len() && (j == i || times[j] - times[j - 1] < 100) {
                n += 1;
                sum += times[j];
                j += 1;
            }
            out.insert((k, start), (times[j - 1] + 100, n, sum, times[j - 1]));
            i = j;
        }
    }
    out
}

#[test]
fn session_windows_survive_worker_kills_exactly_once() {
    let job = sessions_job(3, 60_000, 30, 15_000);
    let out = run_with_worker_kills(&job, 4, |_| {});
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(summary["records_late"], 0, "{summary}");
    let mut committed: BTreeMap<(i64, i64), Vec<(i64, i64, i64, i64)>> = BTreeMap::new();
    for l in job.committed_lines() {
        let v = |f: &str| l[f].as_i64().unwrap();
        committed.entry((v("key"), v("window_start"))).or_default().push((v("window_end"), v("n"), v("total"), v("last")));
    }
    let expected = expected_sessions(job.events, job.keys);
    assert!(expected.len() >= 30 * 10, "the input makes too few sessions: {}", expected.len());
    let twice: Vec<_> = committed.iter().filter(|(_, v)| v.len() > 1).take(5).collect();
    assert!(twice.is_empty(), "sessions committed more than once: {twice:?}");
    for (k, want) in &expected {
        assert_eq!(committed.get(k).map(|v| v[0]), Some(*want), "session {k:?}");
    }
    assert_eq!(committed.len(), expected.len());
}
