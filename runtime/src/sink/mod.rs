//! Sinks: where results leave the job, and when they become visible.
//!
//! The contract with the subtask loop: `write` during a checkpoint interval,
//! `pre_commit` at the aligned barrier (everything written so far becomes
//! durable and pending; what it returns is the sink's checkpointed state),
//! `commit` when the coordinator says that checkpoint completed. A sink does
//! not know about barriers or the coordinator.
//!
//! The file sink has two homes: a directory (`file.rs`: in-progress files
//! renamed at commit) and an object store: S3, Azure Blob Storage or
//! Google Cloud Storage (`object_file.rs`: hidden objects staged at the
//! barrier, copied to their final names at commit). Both keep what is pending in the same [`SinkState`], so a
//! checkpoint does not care which one wrote it.
//!
//! The Kafka sink (`kafka/`) is exactly-once by Kafka transactions, with
//! each interval's records also logged in checkpoint storage so that a
//! transaction that never committed is written again on restore; or
//! at-least-once.
//!
//! The PostgreSQL sink (`postgres/`) is exactly-once by two-phase commit
//! (prepared transactions pending in the same [`SinkState`]), through a
//! write-ahead log (log entries in checkpoint storage, pending in the same
//! state), or by upserts on a key (no state).

mod file;
mod kafka;
mod postgres;
mod object_file;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
use arrow::json::LineDelimitedWriter;
use serde::{Deserialize, Serialize};
use weir_api::{Guarantee, PostgresMode, SinkSpec};

use crate::checkpoint::{CheckpointStorage, Location, StateFile};

use crate::error::{Error, Result};

pub use file::{FileSink, PendingFile};
pub use kafka::KafkaLogEntry;
pub use postgres::LogEntry;
pub(crate) use postgres::{connect_to as connect_to_postgres, failed as postgres_failed, quote_ident};
pub use object_file::ObjectFileSink;

/// Where a sink keeps what checkpoint storage holds for it: the PostgreSQL
/// sink's write-ahead log, under the job's directory.
pub(crate) const LOG_DIR: &str = "wal";

/// A sink subtask's checkpointed state: what it has made durable but not
/// yet published, per checkpoint. Part of the checkpoint format (inline
/// JSON in `_metadata`); `transactions` was added with a serde default, so
/// older checkpoints restore.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SinkState {
    /// The file sink's pending files.
    #[serde(default)]
    pub pending: Vec<PendingFile>,
    /// The PostgreSQL sink's prepared transactions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transactions: Vec<PendingTransaction>,
    /// The PostgreSQL sink's write-ahead log entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub log: Vec<LogEntry>,
    /// The Kafka sink's prepared transactions and their log entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kafka: Vec<KafkaLogEntry>,
    /// The Kafka sink's transactional ids: a restore fences them all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transactional_ids: Vec<String>,
}

impl SinkState {
    /// What a restore must not discard while this state may be restored:
    /// in-progress file names, global transaction ids, log files and the
    /// log entries' acknowledgement ids.
    pub fn referenced(self) -> impl Iterator<Item = String> {
        self.pending
            .into_iter()
            .map(|p| p.temp)
            .chain(self.transactions.into_iter().map(|t| t.gid))
            .chain(self.log.into_iter().flat_map(|e| [e.file.name, e.id]))
            .chain(self.kafka.into_iter().map(|e| e.file.name))
    }
}

/// A prepared transaction waiting for its checkpoint to complete.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PendingTransaction {
    pub checkpoint: u64,
    /// Its global id, as `PREPARE TRANSACTION` named it.
    pub gid: String,
    /// Its transaction id (`txid_current()`, epoch-extended), by which a
    /// restore that no longer finds it prepared asks the server whether it
    /// committed or was rolled back. Absent in checkpoints of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<i64>,
}

pub enum SinkWriter {
    File(FileSink),
    ObjectFile(ObjectFileSink),
    PostgresTwoPhase(postgres::TwoPhaseCommit),
    PostgresUpsert(postgres::Upsert),
    PostgresWriteAhead(postgres::WriteAheadLog),
    KafkaExactlyOnce(kafka::Transactional),
    KafkaAtLeastOnce(kafka::AtLeastOnce),
    Stdout,
    Blackhole,
}

/// What a sink subtask receives when it starts.
#[derive(Default)]
pub struct SinkRestore<'a> {
    /// States of the restored snapshot's old subtasks this subtask takes
    /// over: their pending output is committed before anything new is written.
    pub mine: Vec<SinkState>,
    /// Given to subtask 0 only: the in-progress files some retained snapshot
    /// still references. It discards the job's other in-progress files, which
    /// hold records that will be produced again.
    pub keep: Option<&'a HashSet<String>>,
    /// Given with `keep`: the runs of this job's state
    /// ([`CheckpointStorage::claimed_runs`]). A file sink discards only
    /// their leftovers: another state of the same job id may share the
    /// output and have pending files there. `None`: every run's.
    pub runs: Option<&'a HashSet<String>>,
    /// The job's parallelism in this run: subtasks of earlier runs at or
    /// above it are gone, and a sink cleans up what they may have left
    /// (the Kafka sink fences their transactional ids).
    pub parallelism: u32,
    /// The restored snapshot's own copies of the log entries it names
    /// (`<snapshot>/wal`; savepoints carry them, see
    /// [`copy_log_into_savepoint`]): where a log entry is read when the
    /// job's `wal/` does not have it.
    pub snapshot_log: Option<Location>,
}

/// Whether a leftover file of the job, `rest` being what follows
/// `<prefix><job>.` in its name (`<run>-…`), was written by one of `runs`
/// (see [`SinkRestore::runs`]).
pub(crate) fn written_by(rest: &str, runs: Option<&HashSet<String>>) -> bool {
    // Run ids are ours to choose but need not be free of `-`: match whole ids.
    runs.is_none_or(|runs| runs.iter().any(|run| rest.strip_prefix(run.as_str()).is_some_and(|after| after.starts_with('-'))))
}

/// Whether the run that cleans up its job's leftovers is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// It finished, or was stopped and its process exits: nothing of it
    /// will be written any more, so its own unreferenced files go too.
    Over,
    /// It was stopped with a savepoint but lives on (pod mode: the pods
    /// stay until the operator deletes them, and a cancelled stop resumes
    /// the job), so everything of its own is left for a later run.
    MayResume,
}

/// Once a job has finished or been stopped (the final checkpoint or the
/// stopping savepoint committed): deletes the in-progress files (aborts the
/// uploads), prepared transactions and log entries of the job that no
/// retained snapshot references. Retention may have retired, during the
/// run, the snapshots that protected an earlier run's leftovers; a job that
/// is never resumed must not keep them.
#[allow(clippy::too_many_arguments)]
pub async fn clean_up_after_end(spec: &SinkSpec, scope: &SinkScope, job: &str, run_id: &str, end: RunEnd, keep: &HashSet<String>, base_dir: &Path, storage: &CheckpointStorage) -> Result<()> {
    let log = storage.dir(&scope.log_dir());
    match spec {
        SinkSpec::File(f) if f.in_object_store() => {
            object_file::discard_unreferenced(&object_file::Output::open(&f.path)?, job, run_id, keep, Some(&storage.claimed_runs().await?)).await
        }
        SinkSpec::File(f) => file::discard_unreferenced(&base_dir.join(&f.path), job, run_id, keep, Some(&storage.claimed_runs().await?)),
        SinkSpec::Postgres(p) if p.mode == PostgresMode::TwoPhaseCommit => postgres::discard_unreferenced(p, &scope.external(job, storage).await?, run_id, keep).await,
        SinkSpec::Postgres(p) if p.mode == PostgresMode::WriteAheadLog => {
            postgres::discard_after_end(p, &log, &scope.external(job, storage).await?, run_id, end, keep).await
        }
        SinkSpec::Kafka(k) if k.guarantee == Guarantee::ExactlyOnce => kafka::discard_after_end(&log, run_id, end, keep).await,
        _ => Ok(()),
    }
}

/// A savepoint carries copies of the log entries its sink state names (the
/// Kafka sink's and the write-ahead log's records of its last interval) in
/// its own `wal/`, so that it restores when moved to another directory or
/// bucket, or after the job's `wal/` is gone: a savepoint is
/// self-contained. Called at a savepoint's barrier, after `pre_commit`.
pub(crate) async fn copy_log_into_savepoint(state: &SinkState, scope: &SinkScope, storage: &CheckpointStorage, savepoint_dir: &str) -> Result<()> {
    let log = scope.log_dir();
    let (from, to) = (storage.dir(&log), storage.dir(&format!("{savepoint_dir}/{log}")));
    for file in state.kafka.iter().map(|e| &e.file).chain(state.log.iter().map(|e| &e.file)) {
        let bytes = from.read_state_file(file).await?;
        to.put_durable(&file.name, bytes.to_vec()).await?;
    }
    Ok(())
}

/// Reads a log entry's records back from the job's `wal` directory, or
/// else from the restored snapshot's copy (`also`); only on failure does it
/// look again, to tell a lost entry from a damaged one.
pub(crate) async fn read_log_entry(log: &Location, also: Option<&Location>, file: &StateFile, checkpoint: u64) -> Result<(String, Vec<RecordBatch>)> {
    for place in std::iter::once(log).chain(also) {
        let location = format!("{}/{}", place.display, file.name);
        match place.read_state_file(file).await {
            Ok(bytes) => {
                let batches = crate::worker::restore::decode_state(&location, bytes.to_vec())?;
                return Ok((location, batches));
            }
            // A damaged entry is an error where it is; only a missing one
            // is looked for in the next place.
            Err(e) if place.get(&file.name).await?.is_some() => return Err(e),
            Err(_) => {}
        }
    }
    Err(Error::LostLogEntry { location: format!("{}/{}", log.display, file.name), checkpoint })
}

/// Deletes the log files of runs other than `run_id` that no retained
/// snapshot references (`keep`): their records will be produced again, and
/// no restore will write them. Without `run_id` (the job has finished, so
/// its last run has nothing pending either) every unreferenced file goes,
/// the entries of the last run's abandoned checkpoints among them.
pub(crate) async fn discard_unreferenced_log_files(log: &Location, run_id: Option<&str>, keep: &HashSet<String>, sink: &str) -> Result<()> {
    let current = run_id.map(|r| format!("{r}-"));
    for name in log.list_objects("").await? {
        let of_this_run = current.as_ref().is_some_and(|c| name.starts_with(c));
        if name.ends_with(".arrow") && !of_this_run && !keep.contains(&name) {
            tracing::info!(file = %name, sink, "discarding the log entry of a checkpoint that never completed");
            log.delete(&name).await?;
        }
    }
    // A write cut off by a kill leaves the local store's staging file,
    // which the listing above hides.
    for name in log.local_staging_files().await? {
        if !current.as_ref().is_some_and(|c| name.starts_with(c)) {
            tracing::info!(file = %name, sink, "discarding a log entry whose write was cut off");
            log.delete_local_staging(&name).await?;
        }
    }
    Ok(())
}

/// Records as JSON lines, one object per line.
pub(crate) fn encode_jsonl(batch: &RecordBatch) -> std::result::Result<Vec<u8>, arrow::error::ArrowError> {
    let mut w = LineDelimitedWriter::new(Vec::with_capacity(batch.num_rows() * 32));
    w.write(batch)?;
    w.finish()?;
    Ok(w.into_inner())
}

/// Whether `spec` is a Kafka sink that writes in transactions: its
/// restore reads a progress topic that earlier runs' open transactions
/// hold back ([`before_opening`]).
pub fn settles_kafka_transactions(spec: &SinkSpec) -> bool {
    matches!(spec, SinkSpec::Kafka(k) if k.guarantee == Guarantee::ExactlyOnce)
}

/// What a worker does before it opens any of its sink subtasks: the Kafka
/// exactly-once sink fences the transactions earlier runs of each hosted
/// subtask may have left open (`subtasks`: each with the restored states it
/// takes over), so that no subtask's restore waits on a sibling's.
/// `siblings` counts the worker's subtasks of every such sink: the worker
/// opens them one after another, and a restoring subtask reads the
/// progress topic, which a transaction an earlier run of a sibling left
/// open holds back until that sibling fences it, or for the whole
/// transaction timeout. Two sinks of a job share a progress topic unless
/// told otherwise, and a sibling of the other sink waiting the same way
/// in another worker made the wait a ten-minute deadlock. Alone, a
/// subtask fences its earlier runs as it opens.
pub async fn before_opening(spec: &SinkSpec, scope: &SinkScope, job: &str, (subtasks, siblings): (&[(u32, Vec<SinkState>)], usize), parallelism: u32, storage: &CheckpointStorage) -> Result<()> {
    match spec {
        SinkSpec::Kafka(k) if settles_kafka_transactions(spec) && siblings > 1 => {
            kafka::Transactional::fence_earlier_runs(k, &scope.external(job, storage).await?, subtasks, parallelism, &storage.dir(&scope.ids_dir())).await
        }
        _ => Ok(()),
    }
}

/// What keeps one sink's writes apart from every other sink's: of other
/// jobs, of other states of the same job, and of the job's other sinks.
/// The sink whose state id is `sink` (a chain's, and a graph's sink of that
/// name) has the names it always had, so that its checkpoints restore.
#[derive(Clone, Debug)]
pub struct SinkScope {
    /// The sink's state id.
    pub state_id: String,
}

impl SinkScope {
    pub fn of(state_id: &str) -> SinkScope {
        SinkScope { state_id: state_id.to_string() }
    }

    /// Appended to every name below, but the sink named `sink`'s.
    fn suffix(&self, separator: char) -> String {
        if self.state_id == "sink" {
            String::new()
        } else {
            format!("{separator}{}", self.state_id)
        }
    }

    /// What the PostgreSQL sink names its prepared transactions and
    /// progress rows by, and the Kafka sink its transactional ids and
    /// progress markers, and what they clean up and fence by: the job id,
    /// its state's identity and the sink (`<job>:<identity>~<sink>`), so
    /// that two states of one job id, or two sinks of one job, sharing a
    /// database or a topic leave each other's transactions alone.
    pub async fn external(&self, job: &str, storage: &CheckpointStorage) -> Result<String> {
        Ok(format!("{job}:{}{}", storage.identity().await?, self.suffix('~')))
    }

    /// The directory of the job's storage where the sink keeps its log
    /// entries (Kafka's records of an interval, the write-ahead log).
    pub fn log_dir(&self) -> String {
        format!("{LOG_DIR}{}", self.suffix('-'))
    }

    /// The directory where the Kafka sink records its transactional ids.
    pub fn ids_dir(&self) -> String {
        format!("{}{}", kafka::IDS_DIR, self.suffix('-'))
    }
}

impl SinkWriter {
    /// `schema` is the records' schema as they reach the sink; `storage`
    /// the job's checkpoint storage (for a write-ahead log).
    #[allow(clippy::too_many_arguments)]
    pub async fn open(spec: &SinkSpec, scope: &SinkScope, schema: &Schema, job: &str, subtask: u32, run_id: &str, restore: SinkRestore<'_>, base_dir: &Path, storage: &CheckpointStorage) -> Result<Self> {
        Ok(match spec {
            SinkSpec::Postgres(p) => match p.mode {
                PostgresMode::TwoPhaseCommit => {
                    SinkWriter::PostgresTwoPhase(postgres::TwoPhaseCommit::open(p, schema, &scope.external(job, storage).await?, subtask, run_id, restore).await?)
                }
                PostgresMode::Upsert => SinkWriter::PostgresUpsert(postgres::Upsert::open(p, schema).await?),
                PostgresMode::WriteAheadLog => {
                    let external = scope.external(job, storage).await?;
                    SinkWriter::PostgresWriteAhead(postgres::WriteAheadLog::open(p, schema, &external, subtask, run_id, storage.dir(&scope.log_dir()), restore).await?)
                }
            },
            SinkSpec::Kafka(k) if k.guarantee == Guarantee::ExactlyOnce => {
                let external = scope.external(job, storage).await?;
                let (log, ids) = (storage.dir(&scope.log_dir()), storage.dir(&scope.ids_dir()));
                SinkWriter::KafkaExactlyOnce(kafka::Transactional::open(k, schema, &external, subtask, run_id, (log, ids), restore).await?)
            }
            SinkSpec::Kafka(k) => SinkWriter::KafkaAtLeastOnce(kafka::AtLeastOnce::open(k, schema, job, subtask).await?),
            SinkSpec::File(f) if f.in_object_store() => SinkWriter::ObjectFile(ObjectFileSink::open(f, job, subtask, run_id, restore).await?),
            SinkSpec::File(f) => SinkWriter::File(FileSink::open(f, job, subtask, run_id, restore, base_dir)?),
            SinkSpec::Stdout(_) => SinkWriter::Stdout,
            SinkSpec::Blackhole(_) => SinkWriter::Blackhole,
        })
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        match self {
            SinkWriter::File(f) => f.write(batch),
            SinkWriter::ObjectFile(f) => f.write(batch).await,
            SinkWriter::PostgresTwoPhase(p) => p.write(batch).await,
            SinkWriter::PostgresUpsert(p) => p.write(batch).await,
            SinkWriter::PostgresWriteAhead(p) => {
                p.write(batch);
                Ok(())
            }
            SinkWriter::KafkaExactlyOnce(k) => k.write(batch).await,
            SinkWriter::KafkaAtLeastOnce(k) => k.write(batch).await,
            SinkWriter::Stdout => {
                let lines = encode_jsonl(batch).map_err(Error::arrow("stdout sink"))?;
                std::io::stdout().lock().write_all(&lines).map_err(Error::io("stdout sink"))
            }
            SinkWriter::Blackhole => Ok(()),
        }
    }

    /// Makes everything written so far durable and pending on `checkpoint_id`.
    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<Option<SinkState>> {
        match self {
            SinkWriter::File(f) => f.pre_commit(checkpoint_id).map(Some),
            SinkWriter::ObjectFile(f) => f.pre_commit(checkpoint_id).await.map(Some),
            SinkWriter::PostgresTwoPhase(p) => p.pre_commit(checkpoint_id).await.map(Some),
            // Every upsert committed when it was written.
            SinkWriter::PostgresUpsert(_) => Ok(None),
            SinkWriter::PostgresWriteAhead(p) => p.pre_commit(checkpoint_id).await.map(Some),
            SinkWriter::KafkaExactlyOnce(k) => k.pre_commit(checkpoint_id).await.map(Some),
            SinkWriter::KafkaAtLeastOnce(k) => k.pre_commit().map(|()| None),
            SinkWriter::Stdout => {
                std::io::stdout().flush().map_err(Error::io("stdout sink"))?;
                Ok(None)
            }
            SinkWriter::Blackhole => Ok(None),
        }
    }

    /// Starts publishing what was pending on checkpoints up to
    /// `checkpoint_id`, without waiting where the sink need not: the Kafka
    /// sink's transactions commit on threads of their own while the next
    /// interval's records go into another transaction. Returns whether some
    /// of it is still in flight; [`SinkWriter::next_committed`] tells when
    /// it is done. Other sinks publish before this returns.
    pub async fn start_commit(&mut self, checkpoint_id: u64) -> Result<bool> {
        match self {
            SinkWriter::KafkaExactlyOnce(k) => {
                k.start_commit(checkpoint_id);
                Ok(k.commits_in_flight())
            }
            other => other.commit(checkpoint_id).await.map(|()| false),
        }
    }

    /// Whether a commit [`SinkWriter::start_commit`] started is not done.
    pub fn commits_in_flight(&self) -> bool {
        matches!(self, SinkWriter::KafkaExactlyOnce(k) if k.commits_in_flight())
    }

    /// Waits for the oldest commit in flight to be done (forever when none
    /// is) and returns its checkpoint. Cancel-safe.
    pub async fn next_committed(&mut self) -> Result<u64> {
        match self {
            SinkWriter::KafkaExactlyOnce(k) => k.next_committed().await,
            _ => std::future::pending().await,
        }
    }

    /// Finishes what [`SinkWriter::next_committed`] left to do outside the
    /// wait for events: deletes the committed transactions' log entries.
    pub async fn after_committed(&mut self) -> Result<()> {
        match self {
            SinkWriter::KafkaExactlyOnce(k) => k.delete_committed_logs().await,
            _ => Ok(()),
        }
    }

    /// Publishes what was pending on checkpoints up to `checkpoint_id`.
    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        match self {
            SinkWriter::File(f) => f.commit(checkpoint_id),
            SinkWriter::ObjectFile(f) => f.commit(checkpoint_id).await,
            SinkWriter::PostgresTwoPhase(p) => p.commit(checkpoint_id).await,
            SinkWriter::PostgresWriteAhead(p) => p.commit(checkpoint_id).await,
            SinkWriter::KafkaExactlyOnce(k) => k.commit(checkpoint_id).await,
            _ => Ok(()),
        }
    }
}
