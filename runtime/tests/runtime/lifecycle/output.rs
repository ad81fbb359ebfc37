//! Where a lifecycle sequence's sink writes, and how the oracle reads it
//! back: the exactly-once file sink (`out/eo` in the job's directory), the
//! exactly-once Kafka sink (a topic of the test broker, read by a
//! read_committed consumer), or the PostgreSQL sink in `two-phase-commit`
//! or `write-ahead-log` mode (a table of the test's server).
//!
//! What a user deletes to run a finished job again is the directory, the
//! topic or the table: a re-run moves to a new one. The same goes for the
//! check that every snapshot restores, which restores into a copy of the
//! state: a file output is copied with it, a topic or table cannot be, so
//! the copy writes to a new one and the oracle checks what a restore alone
//! must write there (see [`check_restored_suffix`]).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::Path;

use serde_json::Value;

use super::{violation, Size, Step, Stop};
use crate::common::*;

/// The sinks a sequence may write with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SinkKind {
    File,
    Kafka,
    PostgresTwoPhaseCommit,
    PostgresWriteAheadLog,
}

impl SinkKind {
    /// One of the connector sinks.
    pub fn connector(pick: usize) -> SinkKind {
        [SinkKind::Kafka, SinkKind::PostgresTwoPhaseCommit, SinkKind::PostgresWriteAheadLog][pick % 3]
    }
}

/// The sink's target in the current lineage.
pub enum Output<'a> {
    File,
    Kafka { broker: kafka::Broker, topic: String },
    Postgres { server: &'a postgres::Server, mode: &'static str, table: String },
}

impl<'a> Output<'a> {
    /// A new, empty target of `kind` (a new topic or table).
    pub fn new(kind: SinkKind, pg: Option<&'a postgres::Server>) -> Output<'a> {
        let server = || pg.expect("a PostgreSQL sink needs the test's server");
        match kind {
            SinkKind::File => Output::File,
            SinkKind::Kafka => {
                let broker = kafka::Broker::shared();
                let topic = kafka::topic("lifecycle");
                broker.create_topic(&topic, 3);
                Output::Kafka { broker, topic }
            }
            SinkKind::PostgresTwoPhaseCommit | SinkKind::PostgresWriteAheadLog => {
                let server = server();
                let table = format!("lifecycle_{}", rand_suffix());
                server.psql(&format!("CREATE TABLE {table} (seq bigint, key bigint, value bigint, count bigint)"));
                let mode = if kind == SinkKind::PostgresTwoPhaseCommit { "two-phase-commit" } else { "write-ahead-log" };
                Output::Postgres { server, mode, table }
            }
        }
    }

    pub fn kind(&self) -> SinkKind {
        match self {
            Output::File => SinkKind::File,
            Output::Kafka { .. } => SinkKind::Kafka,
            Output::Postgres { mode: "two-phase-commit", .. } => SinkKind::PostgresTwoPhaseCommit,
            Output::Postgres { .. } => SinkKind::PostgresWriteAheadLog,
        }
    }

    /// A new target of the same kind: what a re-run writes to.
    pub fn fresh(&self) -> Output<'a> {
        let pg = match self {
            Output::Postgres { server, .. } => Some(*server),
            _ => None,
        };
        Output::new(self.kind(), pg)
    }

    pub fn describe(&self) -> String {
        match self {
            Output::File => "file sink to out/eo".into(),
            Output::Kafka { topic, .. } => format!("exactly-once Kafka sink to topic {topic}"),
            Output::Postgres { mode, table, .. } => format!("PostgreSQL sink ({mode}) to table {table}"),
        }
    }

    /// The `sink:` section of the pipeline.
    pub fn sink_yaml(&self) -> String {
        match self {
            Output::File => "sink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n".into(),
            Output::Kafka { broker, topic } => format!(
                "sink:\n  kafka:\n    bootstrap_servers: {}\n    topic: {topic}\n    key: key\n    guarantee: exactly-once\n    progress_topic: {topic}-progress\n",
                broker.addr
            ),
            Output::Postgres { server, mode, table } => format!("sink:\n  postgres:\n    connection: {}\n    table: {table}\n    mode: {mode}\n", server.connection()),
        }
    }

    /// The variables the job needs to reach the target (credentials).
    pub fn env(&self) -> Vec<(String, String)> {
        match self {
            Output::Postgres { server, .. } => server.env(),
            _ => Vec::new(),
        }
    }

    /// The committed records, each with where it is (a file, a partition,
    /// the table). `root` is the job's directory, for the file sink.
    pub fn committed(&self, root: &Path) -> Result<Vec<(String, Value)>, Stop> {
        match self {
            Output::File => committed_files(&root.join("out/eo")),
            Output::Kafka { broker, topic } => Ok(broker.committed_records(topic).into_iter().map(|v| (topic.clone(), v)).collect()),
            Output::Postgres { server, table, .. } => Ok(server.rows(table).into_iter().map(|v| (table.clone(), v)).collect()),
        }
    }

    /// The seqs a fork restore may commit again: those committed when it
    /// begins, and also what a crashed run left pending for a completed
    /// checkpoint (the restored run may settle it either way). For Kafka
    /// that is every record on the topic, open or aborted transactions
    /// included; a prepared PostgreSQL transaction cannot be read, so with
    /// PostgreSQL `None`: after a fork any seq may repeat.
    pub fn may_repeat_after_fork(&self, root: &Path) -> Result<Option<HashSet<i64>>, Stop> {
        match self {
            Output::File => Ok(Some(committed_files(&root.join("out/eo"))?.iter().filter_map(|(_, v)| v["seq"].as_i64()).collect())),
            Output::Kafka { broker, topic } => Ok(Some(
                broker.read_all(topic, "read_uncommitted").iter().filter_map(|m| serde_json::from_str::<Value>(&m.value).ok()?["seq"].as_i64()).collect(),
            )),
            Output::Postgres { .. } => Ok(None),
        }
    }

    /// What a finished job must not leave behind: in-progress files that no
    /// snapshot references (file), a transaction open on the topic or its
    /// progress topic (Kafka), a prepared transaction that no snapshot
    /// references (PostgreSQL), an entry
    /// of the sink's log that no snapshot references (Kafka, write-ahead
    /// log). `job_dir` is the job's state directory.
    pub fn check_nothing_left(&self, root: &Path, job_dir: &Path) -> Step {
        match self {
            Output::File => {
                let referenced = super::referenced_in_progress(job_dir);
                let left: BTreeSet<String> = super::in_progress_files(&root.join("out/eo")).difference(&referenced).cloned().collect();
                if !left.is_empty() {
                    return Err(violation("no in-progress file that no snapshot references is left once the job finished", format!("{left:?}")));
                }
                Ok(())
            }
            Output::Kafka { broker, topic } => {
                for t in [topic.clone(), format!("{topic}-progress")] {
                    let held = broker.partitions_held_after(&t, std::time::Duration::from_secs(20));
                    if !held.is_empty() {
                        return Err(violation("no transaction of the job stays open on the broker once it finished", format!("partitions {held:?} of {t}")));
                    }
                }
                check_log_empty(job_dir)
            }
            Output::Postgres { server, .. } => {
                // A savepoint whose commit a kill prevented keeps its
                // transactions prepared while it may be restored.
                let referenced = super::referenced_in_progress(job_dir);
                let prepared: Vec<String> = server.prepared().into_iter().filter(|g| g.starts_with("weir:") && !referenced.contains(g)).collect();
                if !prepared.is_empty() {
                    return Err(violation("no prepared transaction that no retained snapshot references is left once the job finished", format!("{prepared:?}")));
                }
                check_log_empty(job_dir)
            }
        }
    }
}

impl Output<'_> {
    /// What a job stopped with savepoint `stop` (its directory name) must
    /// not leave: an in-progress file (file), a transaction open on the
    /// topic or its progress topic (Kafka), a prepared transaction (PostgreSQL)
    /// that only the stop savepoint, or no snapshot, references. The stop
    /// savepoint committed its own; an older savepoint that a kill kept
    /// from committing may still hold its.
    pub fn check_nothing_open(&self, root: &Path, job_dir: &Path, stop: Option<&str>) -> Step {
        let excused = super::referenced_in_progress_except(job_dir, stop);
        match self {
            Output::File => {
                let left: BTreeSet<String> = super::in_progress_files(&root.join("out/eo")).difference(&excused).cloned().collect();
                if !left.is_empty() {
                    return Err(violation("a job stopped with a savepoint leaves no in-progress file pending", format!("{left:?}")));
                }
            }
            Output::Kafka { broker, topic } => {
                for t in [topic.clone(), format!("{topic}-progress")] {
                    let held = broker.partitions_held_after(&t, std::time::Duration::from_secs(5));
                    if !held.is_empty() {
                        return Err(violation("a job stopped with a savepoint leaves no transaction open on the broker", format!("partitions {held:?} of {t}")));
                    }
                }
            }
            Output::Postgres { server, .. } => {
                let prepared: Vec<String> = server.prepared().into_iter().filter(|g| g.starts_with("weir:") && !excused.contains(g)).collect();
                if !prepared.is_empty() {
                    return Err(violation("a job stopped with a savepoint leaves no transaction prepared", format!("{prepared:?}")));
                }
            }
        }
        Ok(())
    }
}

/// The sink's log of records kept with the checkpoints (Kafka, write-ahead
/// log) holds, once the job finished, only entries some retained snapshot
/// references (a savepoint whose transaction a kill left uncommitted needs
/// its entry to be restored), and no staging file of a cut-off write.
fn check_log_empty(job_dir: &Path) -> Step {
    let referenced = super::referenced_in_progress(job_dir);
    let left: Vec<String> = std::fs::read_dir(job_dir.join("wal"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !referenced.contains(n)).collect())
        .unwrap_or_default();
    if !left.is_empty() {
        return Err(violation("the sink's log holds only entries a retained snapshot references once the job finished", format!("{left:?}")));
    }
    Ok(())
}

/// Committed lines of an output directory, each with the file it is in.
pub fn committed_files(out: &Path) -> Result<Vec<(String, Value)>, Stop> {
    let mut lines = Vec::new();
    let Ok(entries) = std::fs::read_dir(out) else { return Ok(lines) };
    let mut names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
    names.sort();
    for name in names.into_iter().filter(|n| !n.starts_with('.')) {
        let text = std::fs::read_to_string(out.join(&name)).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            let v = serde_json::from_str(line)
                .map_err(|e| violation("every committed line is a whole record", format!("{name} line {}: {e}: {line:?}", i + 1)))?;
            lines.push((name.clone(), v));
        }
    }
    Ok(lines)
}

/// The oracle of a snapshot restored into a new topic or table: every
/// record is the one a failure-free run commits, and each key's seqs are a
/// suffix of the key's events, in steps of `keys`, none twice, up to the
/// key's last event. All of one key's events come from one split in order
/// (see the lifecycle module), so a restore replays exactly the key's
/// events after the snapshot's read position, plus, for a sink that keeps
/// a checkpoint's records to write them again, the snapshot's own interval
/// just before it: contiguous either way. A gap is a lost record, a repeat
/// a duplicate, a missing tail an early end.
pub fn check_restored_suffix(lines: &[(String, Value)], size: Size) -> Step {
    let keys = size.keys as i64;
    let mut by_key: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (at, v) in lines {
        let seq = super::check_record(at, v, size)?;
        by_key.entry(seq % keys).or_default().push(seq);
    }
    for (key, mut seqs) in by_key {
        seqs.sort();
        let last = (size.events as i64 - 1 - key) / keys * keys + key;
        let bad = seqs.windows(2).find(|w| w[1] - w[0] != keys).map(|w| format!("seq {} then {}", w[0], w[1]));
        if let Some(bad) = bad.or_else(|| (seqs.last() != Some(&last)).then(|| format!("the last seq is {:?}, not {last}", seqs.last()))) {
            return Err(violation(
                "a restored snapshot writes each key's events after its read position once, none lost, to the end",
                format!("key {key}: {bad} ({} seqs from {})", seqs.len(), seqs[0]),
            ));
        }
    }
    Ok(())
}
