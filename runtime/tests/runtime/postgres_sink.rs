//! The PostgreSQL sink against a real server (Debian's PostgreSQL, a
//! throwaway cluster per test): SIGKILLs of workers and of whole process
//! trees at random moments leave the table equal to a failure-free run's,
//! in `two-phase-commit` and `write-ahead-log` modes row for row and in
//! `upsert` mode key for key;
//! rows of a checkpoint stay invisible until it completes (a savepoint's
//! are published when it completes); and a missing
//! table or column, a server without prepared transactions or a wrong
//! password stop the job at once with a message that names what is wrong
//! and never the password.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common::*;

const EVENT_COLUMNS: &str = "seq bigint, key bigint, value bigint, count bigint";

fn two_phase_job(pg: &postgres::Server, parallelism: u32, events: u64, keys: u64, interval: &str) -> Job {
    Job::counting(parallelism, events, keys, 30_000, interval).output_to_postgres(pg, "two-phase-commit", EVENT_COLUMNS)
}

fn write_ahead_job(pg: &postgres::Server, parallelism: u32, events: u64, keys: u64, interval: &str) -> Job {
    Job::counting(parallelism, events, keys, 30_000, interval).output_to_postgres(pg, "write-ahead-log", EVENT_COLUMNS)
}

/// Every log entry was written and deleted: nothing is left in the job's
/// `wal` directory once it finished.
fn assert_write_ahead_log_empty(job: &Job) {
    let left: Vec<_> = std::fs::read_dir(job.path("state/eo-test/wal")).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "log entries left after the job finished: {left:?}");
}

/// No prepared transaction of the job may outlive it: each is committed or
/// rolled back.
fn assert_no_prepared_transactions(pg: &postgres::Server) {
    let left = pg.prepared();
    assert!(left.is_empty(), "prepared transactions left after the job finished: {left:?}");
}

/// Runs `job` to its end while SIGKILLing a random worker four times.
fn run_with_worker_kills(job: &Job) {
    let mut child = job.spawn(&[]);
    let kills = kill_workers_while_running(job, &mut child, 4);
    let out = wait_with_timeout(child, Duration::from_secs(180));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    assert!(kills >= 2, "only {kills} kills happened before the job ended");
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
}

/// Runs `job` to its end with one crash between the completion of
/// checkpoint 3 and its commit.
fn run_with_a_crash_between_completion_and_commit(job: &Job) {
    let marker = job.path("fault-fired");
    let out = job.command(&[]).env("WEIR_FAULT", "after-complete@3").env("WEIR_FAULT_ONCE", &marker).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(marker.exists(), "the fault never fired");
}

#[test]
fn worker_kills_with_a_two_phase_commit_postgres_sink_keep_exactly_once() {
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 2, 120_000, 97, "150ms");
    run_with_worker_kills(&job);
    job.assert_exactly_once();
    assert_no_prepared_transactions(&pg);
}

#[test]
fn whole_tree_kills_then_restore_latest_at_another_parallelism_keep_the_table_exactly_once() {
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 3, 150_000, 53, "200ms");
    kill_trees_then_restore_latest(&job, 700..1500, Some("2"));
    job.assert_exactly_once();
    assert_no_prepared_transactions(&pg);
}

#[test]
fn a_crash_between_checkpoint_completion_and_commit_commits_the_transactions_on_restore() {
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 3, 60_000, 31, "100ms");
    run_with_a_crash_between_completion_and_commit(&job);
    job.assert_exactly_once();
    assert_no_prepared_transactions(&pg);
}

/// Without periodic checkpoints a savepoint is the only completion before
/// the end. It completes like a checkpoint: its rows are published then,
/// no transaction stays prepared because of it, and a crash after it
/// restarts from it (the lineage's latest), so its rows are not written a
/// second time by a replay from the beginning.
#[test]
fn a_savepoint_publishes_its_rows_when_it_completes_and_a_crash_after_it_writes_nothing_twice() {
    let pg = postgres::Server::start();
    let job = Job::counting(2, 90_000, 41, 20_000, "0s").output_to_postgres(&pg, "two-phase-commit", EVENT_COLUMNS);
    let table = job.pg_output.clone().unwrap().1;
    let child = job.spawn(&[]);
    let _savepoint = job.take_savepoint();
    let visible: u64 = pg.psql(&format!("SELECT count(*) FROM {table}")).trim().parse().unwrap();
    assert!(visible > 0, "the savepoint's rows are not visible once it completed");
    assert!(pg.prepared().is_empty(), "transactions stay prepared after the savepoint completed: {:?}", pg.prepared());
    job.assert_once_up_to_a_point();
    kill_group(child.id());
    let _ = child.wait_with_output();
    let out = job.run(&["--restore", "latest"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("from savepoint") || stderr(&out).contains("savepoints/sp-"), "the restart did not resume the savepoint:\n{}", stderr(&out));
    job.assert_exactly_once();
    assert_no_prepared_transactions(&pg);
}

/// A prepared transaction of a killed run that no snapshot references (a
/// checkpoint that never completed) is rolled back by the next run; one of
/// another job, or of another state of the same job id, is left alone.
#[test]
fn a_restore_rolls_back_its_states_unreferenced_prepared_transactions_and_leaves_other_jobs_and_states_alone() {
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 2, 40_000, 17, "200ms");
    let table = job.pg_output.clone().unwrap().1;
    set_identity(&job, "feedface");
    let others = ["weir:other-job:feedface:0000beef:0:7", "weir:eo-test:0badc0de:0000beef:0:7"];
    for (gid, seq) in [("weir:eo-test:feedface:0000dead:0:99", -1), (others[0], -2), (others[1], -3)] {
        pg.psql(&format!("BEGIN; INSERT INTO {table} VALUES ({seq}, 0, 0, 0); PREPARE TRANSACTION '{gid}'"));
    }
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut left = pg.prepared();
    left.sort();
    assert_eq!(left, vec![others[1].to_string(), others[0].to_string()]);
    for gid in others {
        pg.psql(&format!("ROLLBACK PREPARED '{gid}'"));
    }
    job.assert_exactly_once();
}

/// Gives the job's state the identity `id` before its first run.
fn set_identity(job: &Job, id: &str) {
    std::fs::create_dir_all(job.path("state/eo-test")).unwrap();
    std::fs::write(job.path("state/eo-test/identity"), id).unwrap();
}

/// Two jobs of one pipeline name (StreamJobs of one name in two
/// namespaces) write to one database under their job ids: a restore of one
/// rolls back its own unreferenced prepared transactions, never the
/// other's, which would lose rows the other has already checkpointed.
#[test]
fn jobs_of_one_pipeline_name_with_their_own_job_ids_leave_each_others_transactions_alone() {
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 2, 20_000, 17, "200ms");
    let table = job.pg_output.clone().unwrap().1;
    set_identity(&job, "feedface");
    for (gid, seq) in [("weir:team-a_eo-test:feedface:0000dead:0:99", -1), ("weir:team-b_eo-test:feedface:0000beef:0:7", -2), ("weir:eo-test:feedface:0000feed:0:5", -3)] {
        pg.psql(&format!("BEGIN; INSERT INTO {table} VALUES ({seq}, 0, 0, 0); PREPARE TRANSACTION '{gid}'"));
    }
    let out = job.run(&["--job-id", "team-a_eo-test"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut left = pg.prepared();
    left.sort();
    assert_eq!(left, vec!["weir:eo-test:feedface:0000feed:0:5".to_string(), "weir:team-b_eo-test:feedface:0000beef:0:7".to_string()]);
    for gid in left {
        pg.psql(&format!("ROLLBACK PREPARED '{gid}'"));
    }
    job.assert_exactly_once();
    let err = job.run(&["--job-id", "team a"]);
    assert!(!err.status.success() && stderr(&err).contains("--job-id") && stderr(&err).contains("expected 1 to 128 letters, digits, `-` or `_`"), "{}", stderr(&err));
}

/// Runs `job` until a crash after checkpoint 3 completed and before its
/// transactions committed, with no restart: they stay prepared.
fn crash_leaving_a_completed_checkpoint_prepared(job: &Job) {
    let out = job.command(&["--max-restarts", "0"]).env("WEIR_FAULT", "after-complete@3").output().unwrap();
    assert!(!out.status.success(), "the job did not crash:\n{}", stderr(&out));
    assert!(stderr(&out).contains("fault injection"), "{}", stderr(&out));
}

#[test]
fn two_states_of_one_job_id_sharing_a_database_never_roll_back_each_others_completed_transactions() {
    // Two state directories of job `eo-test` (two copies of a job, or job
    // ids that collide) write to one database. The first crashes after
    // checkpoint 3 completed, its transactions still prepared; the second
    // runs meanwhile. It must not roll them back as "unreferenced": the
    // first's restore would then find them gone and its rows lost.
    let pg = postgres::Server::start();
    let first = two_phase_job(&pg, 2, 40_000, 17, "200ms");
    crash_leaving_a_completed_checkpoint_prepared(&first);
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let prepared = sorted(pg.prepared());
    assert!(!prepared.is_empty(), "the crash left nothing prepared");
    let second = two_phase_job(&pg, 2, 10_000, 17, "200ms");
    let out = second.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    second.assert_exactly_once();
    assert_eq!(sorted(pg.prepared()), prepared, "the second state's run touched the first's prepared transactions");
    let out = first.run(&["--restore", "latest"]);
    assert!(out.status.success(), "{}", stderr(&out));
    first.assert_exactly_once();
    assert_no_prepared_transactions(&pg);
}

#[test]
fn two_states_of_one_job_id_sharing_a_database_never_delete_each_others_write_ahead_log_progress() {
    // The write-ahead-log mode's progress rows say which entries are in
    // the table. The first state crashes right after checkpoint 3's entry
    // was committed with its row, before its log file was deleted; the
    // second state of the same job id finishes meanwhile and cleans up its
    // own rows. Had it taken the first's for its own, the first's restore
    // would find no row and write checkpoint 3's entry a second time.
    let pg = postgres::Server::start();
    let first = write_ahead_job(&pg, 2, 40_000, 17, "200ms");
    let out = first.command(&["--max-restarts", "0"]).env("WEIR_FAULT", "after-wal-commit@3").output().unwrap();
    assert!(!out.status.success() && stderr(&out).contains("fault injection"), "the job did not crash:\n{}", stderr(&out));
    let second = write_ahead_job(&pg, 2, 10_000, 17, "200ms");
    let out = second.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    second.assert_exactly_once();
    let out = first.run(&["--restore", "latest"]);
    assert!(out.status.success(), "{}", stderr(&out));
    first.assert_exactly_once();
}

#[test]
fn a_completed_checkpoints_transaction_rolled_back_by_someone_else_is_a_fatal_error_naming_it() {
    // "Does not exist" is not taken for "committed": the server is asked.
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 1, 40_000, 17, "200ms");
    crash_leaving_a_completed_checkpoint_prepared(&job);
    let prepared = pg.prepared();
    let gid = prepared.iter().find(|g| g.ends_with(":3")).unwrap_or_else(|| panic!("checkpoint 3's transaction is not prepared: {prepared:?}")).clone();
    pg.psql(&format!("ROLLBACK PREPARED '{gid}'"));
    let out = wait_with_timeout(job.spawn(&["--restore", "latest"]), Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(3), "the restore did not fail at once:\n{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains(&gid) && err.contains("was rolled back") && err.contains("its rows are lost"), "{err}");
}

/// The write-ahead log needs no prepared transactions: this server has none.
#[test]
fn worker_kills_with_a_write_ahead_log_postgres_sink_keep_exactly_once() {
    let pg = postgres::Server::start_with(&["-c", "max_prepared_transactions=0"]);
    let job = write_ahead_job(&pg, 2, 120_000, 97, "150ms");
    run_with_worker_kills(&job);
    job.assert_exactly_once();
    assert_write_ahead_log_empty(&job);
    let writers: u64 = pg.psql("SELECT count(*) FROM weir_sink_progress").trim().parse().unwrap();
    assert!(writers > 0, "no log entry was acknowledged");
}

/// Acknowledgements do not pile up with time: after a run of many
/// checkpoints the progress table holds one row per subtask, each at the
/// newest checkpoint that subtask wrote.
#[test]
fn the_write_ahead_logs_progress_table_keeps_one_row_per_subtask_however_many_checkpoints() {
    let pg = postgres::Server::start();
    let job = write_ahead_job(&pg, 2, 150_000, 13, "50ms");
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    assert_write_ahead_log_empty(&job);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the run's summary");
    let completed = summary["checkpoints"].as_u64().unwrap_or_else(|| panic!("no checkpoints in the summary {summary}"));
    assert!(completed >= 20, "only {completed} checkpoints completed: too few to show that rows do not pile up");
    let rows = pg.psql("SELECT writer, checkpoint FROM weir_sink_progress ORDER BY writer");
    let rows: Vec<(String, u64)> = rows
        .lines()
        .map(|l| {
            let (w, c) = l.rsplit_once('|').unwrap_or_else(|| panic!("unexpected psql row {l:?}"));
            (w.trim().to_string(), c.trim().parse().unwrap())
        })
        .collect();
    assert_eq!(rows.len(), 2, "one row per subtask expected after {completed} checkpoints: {rows:?}");
    for (subtask, (writer, checkpoint)) in rows.iter().enumerate() {
        assert!(writer.starts_with("weir:eo-test:") && writer.ends_with(&format!(":{subtask}")), "{writer}");
        assert!(*checkpoint as f64 >= completed as f64 * 0.5, "subtask {subtask}'s mark {checkpoint} is far behind {completed} checkpoints");
    }
}

#[test]
fn whole_tree_kills_then_restore_latest_at_another_parallelism_keep_a_write_ahead_log_sink_exactly_once() {
    let pg = postgres::Server::start();
    let job = write_ahead_job(&pg, 2, 150_000, 53, "200ms");
    kill_trees_then_restore_latest(&job, 700..1500, Some("3"));
    job.assert_exactly_once();
    assert_write_ahead_log_empty(&job);
}

/// The checkpoint completed but its entry never reached the table: the
/// restore writes it, once.
#[test]
fn a_crash_between_checkpoint_completion_and_commit_writes_the_log_entry_on_restore() {
    let pg = postgres::Server::start();
    let job = write_ahead_job(&pg, 3, 60_000, 31, "100ms");
    run_with_a_crash_between_completion_and_commit(&job);
    job.assert_exactly_once();
    assert_write_ahead_log_empty(&job);
}

#[test]
fn restoring_a_checkpoint_into_a_table_of_another_schema_takes_its_written_entry_as_written() {
    // The final checkpoint's entry was written and acknowledged in the old
    // schema's progress table, then its log file deleted. Restored into a
    // table of a new schema, no acknowledgement of its writer is found: a
    // log file goes only once its rows committed, so the restore goes on,
    // says so, and writes nothing of it again.
    let pg = postgres::Server::start();
    let job = Job::counting(2, 6_000, 10, 0, "1s").output_to_postgres(&pg, "write-ahead-log", EVENT_COLUMNS);
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    let latest = job.latest().expect("a retained checkpoint");
    let (_, old) = job.pg_output.clone().unwrap();
    let moved = format!("moved.{old}");
    pg.psql(&format!("CREATE SCHEMA moved; CREATE TABLE {moved} ({EVENT_COLUMNS})"));
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replace(&format!("table: {old}\n"), &format!("table: {moved}\n")));
    let out = job.command(&["--restore", &latest]).env("RUST_LOG", "warn").output().unwrap();
    assert!(out.status.success(), "restoring {latest} into {moved} failed:\n{}", stderr(&out));
    assert!(stderr(&out).contains("taken as written"), "the restore did not say how it settled the entry:\n{}", stderr(&out));
    assert_eq!(pg.rows(&moved), Vec::<serde_json::Value>::new(), "the final checkpoint's rows were written again");
    assert_write_ahead_log_empty(&job);
}

#[test]
fn worker_kills_with_an_upsert_postgres_sink_leave_every_keys_final_row() {
    let pg = postgres::Server::start();
    let (events, keys) = (120_000u64, 97u64);
    let job = Job::counting(2, events, keys, 30_000, "150ms").output_to_postgres(&pg, "upsert", "key bigint PRIMARY KEY, seq bigint, value bigint, count bigint");
    run_with_worker_kills(&job);
    // A failure-free run leaves, per key, the version counted last: the
    // count of all its events. Which event came last depends on how the
    // source subtasks interleave, in any run, so only its key is checked.
    let rows: BTreeMap<i64, (i64, i64)> = job.committed_lines().iter().map(|r| (r["key"].as_i64().unwrap(), (r["seq"].as_i64().unwrap(), r["count"].as_i64().unwrap()))).collect();
    assert_eq!(rows.len() as u64, keys);
    for (key, (seq, count)) in rows {
        let n = (events as i64 - key + keys as i64 - 1) / keys as i64;
        assert_eq!(count, n, "count of key {key}");
        assert_eq!(seq % keys as i64, key, "the row of key {key} holds event {seq} of another key");
    }
}

#[test]
fn an_upsert_key_column_that_admits_null_is_refused_at_start_naming_it() {
    // UNIQUE without NOT NULL: a null key never conflicts, so every write
    // and every replay would add another row for it. Refused before
    // anything is written; the user's fix (NOT NULL) lets the job run.
    let pg = postgres::Server::start();
    let (events, keys) = (6_000u64, 13u64);
    let job = Job::counting(1, events, keys, 0, "150ms").output_to_postgres(&pg, "upsert", "key bigint UNIQUE, seq bigint, value bigint, count bigint");
    let table = job.pg_output.clone().unwrap().1;
    let err = run_failing(&job);
    assert!(err.contains("sink.postgres.key") && err.contains("key column key") && err.contains("NOT NULL"), "{err}");
    assert_eq!(pg.psql(&format!("SELECT count(*) FROM {table}")).trim(), "0", "rows were written before the refusal");
    pg.psql(&format!("ALTER TABLE {table} ALTER COLUMN key SET NOT NULL"));
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(job.committed_lines().len() as u64, keys, "one row per key");
}

pub(crate) fn run_failing(job: &Job) -> String {
    let start = Instant::now();
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(3), "the job did not fail at once as it should:\n{}", stderr(&out));
    assert!(start.elapsed() < Duration::from_secs(30), "the job kept restarting instead of failing: {:?}", start.elapsed());
    let err = stderr(&out);
    assert!(!err.contains(postgres::PASSWORD), "the password is in the output:\n{err}");
    err
}

#[test]
fn a_missing_table_or_column_fails_the_job_at_once_naming_it() {
    let pg = postgres::Server::start();
    let job = two_phase_job(&pg, 1, 1_000, 10, "200ms");
    let table = job.pg_output.clone().unwrap().1;
    pg.psql(&format!("DROP TABLE {table}"));
    let err = run_failing(&job);
    assert!(err.contains("sink.postgres.table") && err.contains(&format!("table {table} does not exist")), "{err}");

    pg.psql(&format!("CREATE TABLE {table} (seq bigint, key bigint, value bigint)"));
    let err = run_failing(&job);
    assert!(err.contains("has no column count"), "{err}");

    // The user fixes the table; the job runs.
    pg.psql(&format!("ALTER TABLE {table} ADD COLUMN count bigint"));
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn two_phase_commit_on_a_server_without_prepared_transactions_names_the_setting() {
    let pg = postgres::Server::start_with(&["-c", "max_prepared_transactions=0"]);
    let job = two_phase_job(&pg, 1, 1_000, 10, "200ms");
    let err = run_failing(&job);
    assert!(err.contains("max_prepared_transactions") && err.contains("mode: write-ahead-log"), "{err}");
}

#[test]
fn a_wrong_password_names_the_server_and_user_but_never_the_password() {
    let pg = postgres::Server::start();
    let mut job = two_phase_job(&pg, 1, 1_000, 10, "200ms");
    job.env.retain(|(k, _)| k != "PGPASSWORD");
    job.env.push(("PGPASSWORD".into(), "not-the-password-77".into()));
    let err = run_failing(&job);
    assert!(err.contains("password authentication failed") && err.contains(&format!("port {}", pg.port)) && err.contains("user weir"), "{err}");
    assert!(!err.contains("not-the-password-77"), "{err}");
}
