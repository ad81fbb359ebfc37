//! Kafka → weir (key_by + running count) → PostgreSQL with one crash at
//! each point of a checkpoint that random kills rarely hit, in each of the
//! sink's three modes: during alignment, after the acknowledgement, between
//! the checkpoint's completion and the sink's commit, and the sink's own
//! points (rows in the open transaction, a prepared transaction not yet
//! acknowledged, a log entry written but not committed with its
//! acknowledgement, and committed but its log file not deleted). Each run
//! must end with the table a failure-free run leaves (row for row in
//! `two-phase-commit` and `write-ahead-log` mode, each key's final row in
//! `upsert` mode), no prepared transaction and no log entry left.
//!
//! The write-ahead log's duplicate window: the generic contract may write
//! one batch twice when a crash falls after the write and before its
//! acknowledgement. On PostgreSQL the acknowledgement commits in the same
//! transaction as the rows (the module documentation of
//! `sink/postgres/write_ahead.rs` says so), so `after-wal-write` must cost
//! no duplicate at all, and `after-wal-commit` must find the
//! acknowledgement and not write the entry again.

use std::collections::BTreeMap;

use crate::common::*;

const EVENTS: u64 = 24_000;
const KEYS: u64 = 40;

fn kafka_to_postgres(pg: &postgres::Server, mode: &str) -> Job {
    let columns = if mode == "upsert" { "key bigint PRIMARY KEY, seq bigint, value bigint, count bigint" } else { "seq bigint, key bigint, value bigint, count bigint" };
    Job::counting(2, EVENTS, KEYS, 0, "150ms").input_from_kafka(3, 6_000).output_to_postgres(pg, mode, columns)
}

/// Runs a new Kafka → PostgreSQL job in `mode` to its end with one crash
/// at `point` of checkpoint 3, and checks what every mode must leave.
fn crash_at(pg: &postgres::Server, mode: &str, point: &str) -> Job {
    let job = kafka_to_postgres(pg, mode);
    let marker = job.path("fault-fired");
    let out = job.command(&[]).env("WEIR_FAULT", format!("{point}@3")).env("WEIR_FAULT_ONCE", &marker).output().unwrap();
    assert!(out.status.success(), "{mode}, crash at {point}: {}", stderr(&out));
    assert!(marker.exists(), "{mode}: the fault at {point} never fired:\n{}", stderr(&out));
    assert!(stderr(&out).contains("restarting"), "{mode}, crash at {point}: no restart was reported:\n{}", stderr(&out));
    let left = pg.prepared();
    assert!(left.is_empty(), "{mode}, crash at {point}: prepared transactions left after the job finished: {left:?}");
    let log: Vec<_> = std::fs::read_dir(job.path("state/eo-test/wal")).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(log.is_empty(), "{mode}, crash at {point}: log entries left after the job finished: {log:?}");
    job
}

#[test]
fn a_crash_at_each_point_of_a_two_phase_commit_leaves_the_table_exactly_once() {
    let pg = postgres::Server::start();
    for point in ["mid-alignment", "mid-transaction", "after-prepare", "after-ack", "after-complete", "before-commit"] {
        let job = crash_at(&pg, "two-phase-commit", point);
        job.assert_exactly_once();
    }
}

#[test]
fn a_crash_at_each_point_of_the_write_ahead_log_leaves_the_table_exactly_once_even_in_its_duplicate_window() {
    let pg = postgres::Server::start();
    for point in ["mid-alignment", "after-ack", "after-complete", "before-commit", "after-wal-write", "after-wal-commit"] {
        let job = crash_at(&pg, "write-ahead-log", point);
        job.assert_exactly_once();
    }
}

#[test]
fn a_crash_at_each_point_of_an_upsert_sink_leaves_every_keys_final_row() {
    let pg = postgres::Server::start();
    for point in ["mid-alignment", "after-ack", "after-complete", "before-commit"] {
        let job = crash_at(&pg, "upsert", point);
        // Each key's final row holds the count of all its events.
        let rows: BTreeMap<i64, i64> = job.committed_lines().iter().map(|r| (r["key"].as_i64().unwrap(), r["count"].as_i64().unwrap())).collect();
        assert_eq!(rows.len() as u64, KEYS, "upsert, crash at {point}: keys in the table");
        for (key, count) in rows {
            let n = (EVENTS as i64 - key + KEYS as i64 - 1) / KEYS as i64;
            assert_eq!(count, n, "upsert, crash at {point}: count of key {key}");
        }
    }
}
