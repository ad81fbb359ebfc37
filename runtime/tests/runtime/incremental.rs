//! Incremental checkpoints: only the keys that changed are written, files
//! are shared by the checkpoints whose chains name them and deleted when no
//! retained checkpoint does, and worker kills and whole-tree kills with a
//! restore at another parallelism keep every event once.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use crate::common::*;

fn counting(parallelism: u32, events: u64, keys: u64, rate: u64) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 150ms\n  incremental: true\n  retain: 3\nsource:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: {rate}\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n"
    );
    Job::with_pipeline(&yaml, events, keys)
}

/// The metadata of every retained checkpoint, by id.
fn retained(job: &Job) -> BTreeMap<u64, serde_json::Value> {
    let mut out = BTreeMap::new();
    let Ok(dirs) = std::fs::read_dir(job.path("state/eo-test/checkpoints")) else { return out };
    for d in dirs.flatten() {
        let Ok(text) = std::fs::read_to_string(d.path().join("_metadata")) else { continue };
        // Pretty JSON, then a checksum line; one being written is skipped.
        let Some((json, _)) = text.rsplit_once("\ncrc32:") else { continue };
        let Ok(meta) = serde_json::from_str::<serde_json::Value>(json) else { continue };
        out.insert(meta["checkpoint_id"].as_u64().unwrap_or_default(), meta);
    }
    out
}

/// Each retained checkpoint's chain of shared files of `op` (name, size), per subtask.
fn chains(meta: &serde_json::Value, op: &str) -> Vec<Vec<(String, u64)>> {
    meta["operators"][op]
        .as_array()
        .map(|subtasks| {
            subtasks
                .iter()
                .map(|s| s["shared"].as_array().into_iter().flatten().map(|f| (f["name"].as_str().unwrap().to_string(), f["size"].as_u64().unwrap())).collect())
                .collect()
        })
        .unwrap_or_default()
}

/// Checks that `shared/` holds exactly the files the retained checkpoints name.
fn assert_shared_files_are_the_referenced_ones(job: &Job) {
    let named: HashSet<String> = retained(job).values().flat_map(|m| chains(m, "running_count-0")).flatten().map(|(n, _)| n).collect();
    assert!(!named.is_empty(), "no retained checkpoint names a shared file");
    let present = shared_files(job);
    let left: Vec<_> = present.difference(&named).collect();
    let missing: Vec<_> = named.difference(&present).collect();
    assert!(left.is_empty() && missing.is_empty(), "shared files no retained checkpoint names: {left:?}; named but missing: {missing:?}");
}

fn shared_files(job: &Job) -> HashSet<String> {
    std::fs::read_dir(job.path("state/eo-test/shared")).map(|d| d.flatten().map(|f| f.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default()
}

#[test]
fn incremental_checkpoints_write_only_the_changed_keys_and_share_the_rest() {
    // 20,000 keys, of which about 1,500 change per 150 ms interval.
    let job = counting(2, 100_000, 20_000, 10_000);
    let mut child = job.spawn(&[]);
    // Look while it runs (the final checkpoint may start a new chain). The
    // first 2 s add keys, so changes are as big as the state; after that a
    // checkpoint of about 10,000 keys per subtask should be followed by
    // files of about 750.
    let mut chains_seen = Vec::new();
    let mut found = None;
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while found.is_none() && std::time::Instant::now() < until && child.try_wait().unwrap().is_none() {
        for meta in retained(&job).values() {
            for chain in chains(meta, "running_count-0") {
                if chain.len() >= 3 && chain[1..].iter().all(|(_, size)| *size < chain[0].1 / 4) {
                    found = Some(chain.clone());
                }
                chains_seen.push(chain);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(found.is_some(), "no checkpoint wrote only a small file of changes over a full snapshot: {:?}", chains_seen.last());
    let out = wait_with_timeout(child, Duration::from_secs(120));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    // Reference counting: what is left in shared/ is exactly what the
    // retained checkpoints name, and every file they name is there.
    assert_shared_files_are_the_referenced_ones(&job);
}

#[test]
fn incremental_checkpoints_keep_exactly_once_under_worker_kills() {
    let job = counting(3, 120_000, 5_000, 30_000);
    run_with_worker_kills(&job, 4, |_| {});
    job.assert_exactly_once();
    // Nothing of the killed runs is left behind.
    assert_shared_files_are_the_referenced_ones(&job);
}

#[test]
fn incremental_checkpoints_restored_at_another_parallelism_after_tree_kills_keep_exactly_once() {
    let job = counting(3, 150_000, 20_000, 30_000);
    kill_trees_then_restore_latest(&job, 600..1200, Some("2"));
    job.assert_exactly_once();
    assert_shared_files_are_the_referenced_ones(&job);
}

#[test]
fn a_checkpoint_abandoned_while_its_shared_files_are_written_leaves_every_later_checkpoint_restorable() {
    // A slow store: checkpoint 4's shared files take 1.5 s to write, longer
    // than the checkpoint timeout, so it is abandoned mid-write while the
    // job goes on checkpointing and retention keeps only the newest one.
    // A chain may only move with a completed checkpoint: no later
    // checkpoint may name checkpoint 4's file, or a file retention deleted.
    let yaml = "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 150ms\n  timeout: 500ms\n  incremental: true\n  retain: 1\nsource:\n  generator:\n    events: 200000\n    keys: 2000\n    rate: 20000\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n";
    let mut job = Job::with_pipeline(yaml, 200_000, 2_000);
    job.env.push(("WEIR_SLOW_SHARED_WRITE".into(), "4:1500ms".into()));
    let child = job.spawn(&[]);
    let newest = || retained(&job).keys().copied().max().unwrap_or(0);
    let start = std::time::Instant::now();
    while newest() < 20 {
        assert!(start.elapsed() < Duration::from_secs(60), "checkpoint 20 never completed (newest {})", newest());
        std::thread::sleep(Duration::from_millis(50));
    }
    kill_group(child.id());
    let _ = child.wait_with_output();
    let named: Vec<String> = retained(&job).values().flat_map(|m| chains(m, "running_count-0")).flatten().map(|(n, _)| n).collect();
    assert!(!named.iter().any(|n| n.ends_with("-chk4.arrow")), "a completed checkpoint names the abandoned checkpoint 4's file: {named:?}");
    let present = shared_files(&job);
    let missing: Vec<_> = named.iter().filter(|n| !present.contains(*n)).collect();
    assert!(missing.is_empty(), "the latest checkpoint names shared files that are gone: {missing:?}");
    let out = wait_with_timeout(job.spawn(&["--restore", "latest"]), Duration::from_secs(120));
    assert!(out.status.success(), "restoring the latest checkpoint failed:\n{}", stderr(&out));
    job.assert_exactly_once();
}
