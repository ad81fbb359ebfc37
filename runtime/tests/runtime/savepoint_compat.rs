//! Savepoints across pipeline changes, moves and releases: a savepoint
//! restores into a pipeline that gained a stateless step, into another
//! directory, and (the golden savepoint) into every later release; state
//! the pipeline no longer has, a damaged savepoint and one of a future
//! format are refused with the reason, and the refusal touches nothing.

use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// Starts `job`, waits for its first checkpoint, stops it with a savepoint
/// and returns the savepoint's location.
fn stop_with_savepoint(job: &Job) -> String {
    let child = job.spawn(&[]);
    let sp = job.take_savepoint_with(&["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    sp
}

#[test]
fn a_savepoint_restores_into_a_pipeline_with_an_added_stateless_step() {
    let job = Job::counting(2, 60_000, 20, 15_000, "200ms");
    let sp = stop_with_savepoint(&job);
    // A filter that keeps everything, in front of the keyed count: the
    // count's derived id (`running_count-0`) does not move.
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replace("steps:\n", "steps:\n  - filter: value >= 0\n"));
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn state_of_a_removed_stateful_step_is_refused_naming_it_unless_allowed() {
    let job = Job::counting(1, 40_000, 10, 10_000, "200ms");
    let sp = stop_with_savepoint(&job);
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replace("  - running_count: count\n", ""));
    let before = tree_digest(job.dir.path());
    let err = assert_refused(&job.run(&["--restore", &sp]));
    assert!(err.contains("running_count-0") && err.contains("no longer has") && err.contains("--allow-non-restored-state"), "{err}");
    assert_eq!(tree_digest(job.dir.path()), before, "a refused restore changed files");
    // Allowed, the job goes on from the savepoint without the count.
    let out = job.run(&["--restore", &sp, "--allow-non-restored-state"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = job.committed_lines();
    let seqs: std::collections::HashSet<i64> = lines.iter().map(|l| l["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs.len(), 40_000, "every event once across both runs");
    assert!(lines.iter().any(|l| l.get("count").is_none()), "the second run still counted");
}

/// `Job::counting`'s pipeline written as a graph whose nodes have the
/// chain's names (`source`, the step ids, `sink`), or another source name.
fn counting_graph(parallelism: u32, events: u64, keys: u64, rate: u64, source: &str) -> String {
    format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 200ms\n  mode: aligned\n\
         sources:\n  {source}:\n    generator: {{events: {events}, keys: {keys}, rate: {rate}, batch_size: 256}}\n\
         steps:\n  - {{name: running_count-0, input: key_by-0, running_count: count}}\n  - {{name: key_by-0, input: {source}, key_by: key}}\n\
         sinks:\n  sink:\n    input: running_count-0\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n"
    )
}

#[test]
fn a_savepoint_of_a_chain_restores_into_the_same_path_written_as_a_graph_and_back() {
    let (events, keys, rate) = (90_000, 20, 15_000);
    let job = Job::counting(2, events, keys, rate, "200ms");
    let chain = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    let sp = stop_with_savepoint(&job);
    // The graph keeps its state under the chain's ids: the counts go on.
    job.write_pipeline(&counting_graph(2, events, keys, rate, "source"));
    let child = job.spawn(&["--restore", &sp]);
    let sp = job.take_savepoint_with(&["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    // And the graph's savepoint restores into the chain, at another parallelism.
    job.write_pipeline(&chain);
    let out = job.run(&["--restore", &sp, "--parallelism", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_graph_whose_source_has_another_name_than_the_savepoints_is_refused_naming_it() {
    let job = Job::counting(1, 40_000, 10, 10_000, "200ms");
    let sp = stop_with_savepoint(&job);
    job.write_pipeline(&counting_graph(1, 40_000, 10, 10_000, "events"));
    let before = tree_digest(job.dir.path());
    let err = assert_refused(&job.run(&["--restore", &sp]));
    assert!(err.contains("state for `source` that the pipeline no longer has") && err.contains("--allow-non-restored-state"), "{err}");
    assert_eq!(tree_digest(job.dir.path()), before, "a refused restore changed files");
}

/// Rewrites the metadata of the snapshot in `dir` through `edit`, with a
/// valid checksum: what a future release's savepoint looks like to this one.
fn rewrite_metadata(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("_metadata");
    let text = std::fs::read_to_string(&path).unwrap();
    let (json, _) = text.trim_end().rsplit_once('\n').unwrap();
    let mut meta: serde_json::Value = serde_json::from_str(json).unwrap();
    edit(&mut meta);
    let json = serde_json::to_string_pretty(&meta).unwrap();
    std::fs::write(&path, format!("{json}\ncrc32:{:08x}\n", crc32fast::hash(json.as_bytes()))).unwrap();
}

#[test]
fn a_future_version_or_a_damaged_savepoint_is_refused_and_nothing_is_touched() {
    let job = Job::counting(2, 40_000, 10, 10_000, "200ms");
    let sp = stop_with_savepoint(&job);
    let future = job.path("future-savepoint");
    copy_tree(Path::new(&sp), &future);
    rewrite_metadata(&future, |m| m["version"] = serde_json::json!(2));
    let truncated = job.path("truncated-savepoint");
    copy_tree(Path::new(&sp), &truncated);
    let state_file = std::fs::read_dir(&truncated).unwrap().flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|x| x == "arrow")).expect("the savepoint has a keyed state file");
    let bytes = std::fs::read(&state_file).unwrap();
    std::fs::write(&state_file, &bytes[..bytes.len() / 2]).unwrap();

    let before = tree_digest(job.dir.path());
    let err = assert_refused(&job.run(&["--restore", future.to_str().unwrap()]));
    assert!(err.contains("future-savepoint") && err.contains("format version 2") && err.contains("reads version 1"), "{err}");
    let err = assert_refused(&job.run(&["--restore", truncated.to_str().unwrap()]));
    let name = state_file.file_name().unwrap().to_string_lossy().to_string();
    assert!(err.contains("truncated-savepoint") && err.contains(&name), "{err}");
    assert_eq!(tree_digest(job.dir.path()), before, "a refused restore changed files");
    // The savepoint itself still restores, exactly once.
    let out = job.run(&["--restore", &sp]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_savepoint_moved_to_another_directory_restores_exactly_once() {
    let job = Job::counting(2, 60_000, 20, 15_000, "200ms");
    let sp = stop_with_savepoint(&job);
    let moved = job.path("elsewhere/kept-savepoint");
    std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
    std::fs::rename(&sp, &moved).unwrap();
    let out = job.run(&["--restore", moved.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn the_golden_savepoint_of_format_version_1_finishes_its_job_exactly_once() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/savepoint-v1");
    let yaml = std::fs::read_to_string(fixture.join("pipeline.yaml")).unwrap();
    let job = Job::with_pipeline(&yaml, 1000, 10);
    copy_tree(&fixture.join("out"), &job.path("out"));
    copy_tree(&fixture.join("savepoint"), &job.path("golden-savepoint"));
    let out = job.run(&["--restore", "golden-savepoint"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // With the output of the run that took the savepoint, every event once
    // and each key's counts 1..n: the counts went on from the savepoint's.
    job.assert_exactly_once();
    // So did the sums: in each key's order of arrival (its counts), every
    // total is the one before plus the event's value.
    let mut by_key: std::collections::BTreeMap<i64, Vec<(i64, i64, i64)>> = Default::default();
    for l in job.committed_lines() {
        let field = |f: &str| l[f].as_i64().unwrap_or_else(|| panic!("no {f} in {l}"));
        by_key.entry(field("key")).or_default().push((field("count"), field("value"), field("total")));
    }
    for (key, mut events) in by_key {
        events.sort();
        let mut total = 0;
        for (count, value, got) in events {
            total += value;
            assert_eq!(got, total, "total of key {key} at count {count}");
        }
    }
}

#[test]
fn the_golden_savepoint_of_a_graph_with_an_interval_join_finishes_its_job_exactly_once() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/savepoint-graph-v1");
    let yaml = std::fs::read_to_string(fixture.join("pipeline.yaml")).unwrap();
    let job = Job::with_pipeline(&yaml, 1000, 10);
    copy_tree(&fixture.join("out"), &job.path("out"));
    copy_tree(&fixture.join("savepoint"), &job.path("golden-savepoint"));
    let out = job.run(&["--restore", "golden-savepoint"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("restoring `golden-graph` from savepoint 6"), "{}", stderr(&out));
    // Every seq once, each key's counts 1..n: the counts and the join's
    // kept rows went on from the savepoint's. Each record of the union met
    // the record of `a` of its own seq, and no other.
    job.assert_exactly_once();
    for l in job.committed_lines() {
        assert_eq!((l["a_seq"].as_i64(), l["a_key"].as_i64(), l["a_value"].as_i64()), (l["seq"].as_i64(), l["key"].as_i64(), l["value"].as_i64()), "{l}");
    }
}
