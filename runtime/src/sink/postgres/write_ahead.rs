//! Exactly-once into PostgreSQL through a write-ahead log.
//!
//! Records of a checkpoint interval are kept in memory; at the barrier they
//! are written to the job's checkpoint storage as one log entry
//! (`<state>/<job>/wal/<run>-<subtask>-<checkpoint>.arrow`, Arrow IPC, size
//! and CRC recorded), and the entry is the sink's checkpointed state.
//! Nothing reaches the table before the checkpoint completes. Then the
//! entry is written in one transaction that also acknowledges it in the
//! progress table `weir_sink_progress` (in the table's schema): the
//! acknowledgement commits with the rows or not at all, so a crash at any
//! moment either left both or neither, and a retried entry that is
//! acknowledged is skipped. The window in which the generic write-ahead-log
//! sink may write a batch twice (after the write, before the
//! acknowledgement) does not exist on PostgreSQL: the database is
//! transactional, and the acknowledgement is part of the write.
//!
//! The acknowledgement is a high-water mark, not a row per entry: one row
//! per writer (job, run and subtask) holding the newest checkpoint whose
//! entry it wrote. A writer writes its entries in checkpoint order and
//! skips none, so "entry `c` of writer `w` is written" is exactly
//! `checkpoint(w) >= c`, and the table holds one row per subtask of each
//! run a retained snapshot still refers to, however long the job runs (a
//! row per entry grew by one row per subtask every checkpoint, 345,600 a
//! day at one-second checkpoints and parallelism 4).
//!
//! Unlike two-phase commit, nothing stays open in the database between the
//! barrier and the completion (no prepared transaction holding locks or the
//! vacuum horizon, no `max_prepared_transactions`); the price is that every
//! checkpoint's records are written twice, once to the log.
//!
//! Log files are deleted once written; on restore subtask 0 deletes the
//! job's log files and acknowledgements that no retained snapshot
//! references (records that will be produced again, entries no restore
//! will write again).

use std::collections::HashSet;

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use tokio_postgres::{Client, Statement};
use weir_api::PostgresSinkSpec;

use super::{column_arrays, connect, failed, job_prefix, params, quote_ident, Table};
use crate::checkpoint::{Location, StateFile};
use crate::error::{Error, Result};
use crate::sink::{SinkRestore, SinkState};
use crate::worker::restore::encode_state;

/// The progress table, created in the sink table's schema: per writer
/// (`weir:<job>:<run>:<subtask>`), the newest checkpoint whose log entry
/// is in the table.
pub const PROGRESS_TABLE: &str = "weir_sink_progress";

/// A log entry waiting for its checkpoint to complete.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LogEntry {
    pub checkpoint: u64,
    /// `weir:<job>:<run>:<subtask>:<checkpoint>`: its writer (all but the
    /// last part) and checkpoint, as acknowledged in the progress table.
    pub id: String,
    /// The entry's file in the job's `wal` directory.
    pub file: StateFile,
}

pub struct WriteAheadLog {
    client: Client,
    insert: Statement,
    acknowledge: Statement,
    is_acknowledged: Statement,
    table: Table,
    log: Location,
    /// The restored snapshot's copies of its log entries.
    restored_log: Option<Location>,
    schema: SchemaRef,
    job: String,
    subtask: u32,
    run_id: String,
    /// Records since the last barrier.
    buffer: Vec<RecordBatch>,
    /// Entries written to the log, not yet to the table; their records
    /// stay in memory too, so a commit does not read them back.
    pending: Vec<(LogEntry, Option<RecordBatch>)>,
}

impl LogEntry {
    /// The writer whose progress row acknowledges this entry:
    /// `weir:<job>:<run>:<subtask>`.
    fn writer(&self) -> &str {
        writer_of(&self.id)
    }
}

/// An entry id without its checkpoint: the writer's key in the progress table.
fn writer_of(id: &str) -> &str {
    id.rsplit_once(':').map_or(id, |(writer, _)| writer)
}

impl WriteAheadLog {
    pub async fn open(spec: &PostgresSinkSpec, schema: &Schema, job: &str, subtask: u32, run_id: &str, log: Location, restore: SinkRestore<'_>) -> Result<Self> {
        let client = connect(spec, "writer").await?;
        let table = Table::check(&client, spec, schema).await?;
        let progress = progress_table(spec);
        let create = format!("CREATE TABLE IF NOT EXISTS {progress} (writer text PRIMARY KEY, checkpoint bigint NOT NULL, written_at timestamptz NOT NULL DEFAULT now())");
        if let Err(e) = client.batch_execute(&create).await {
            // `IF NOT EXISTS` does not cover another subtask creating it at
            // the same moment (the catalog answers 23505, 42P07 or 42710):
            // what counts is whether the table exists now.
            let exists: Option<u32> = client
                .query_one("SELECT to_regclass($1)::oid", &[&progress])
                .await
                .map_err(failed(format!("postgres sink: looking up the progress table {progress}")))?
                .get(0);
            if exists.is_none() {
                return Err(failed(format!("postgres sink: creating the progress table {progress} (write-ahead-log mode needs it; grant CREATE on the schema or create it as `{create}`)"))(e));
            }
        }
        let insert = client.prepare(&table.insert_from_arrays()).await.map_err(failed(format!("postgres sink: preparing the insert into {}", table.name)))?;
        // Moves the writer's mark up to the entry's checkpoint; no row
        // changes when the mark is there already (the entry was written).
        // A concurrent writer of the same entry waits on the row lock and
        // then sees the mark moved.
        let acknowledge = client
            .prepare(&format!(
                "INSERT INTO {progress} AS p (writer, checkpoint) VALUES ($1, $2) \
                 ON CONFLICT (writer) DO UPDATE SET checkpoint = EXCLUDED.checkpoint, written_at = now() \
                 WHERE p.checkpoint < EXCLUDED.checkpoint"
            ))
            .await
            .map_err(failed(format!("postgres sink: preparing the acknowledgement in {progress}")))?;
        let is_acknowledged = client
            .prepare(&format!("SELECT 1 FROM {progress} WHERE writer = $1 AND checkpoint >= $2"))
            .await
            .map_err(failed(format!("postgres sink: preparing the acknowledgement lookup in {progress}")))?;
        let mut sink = WriteAheadLog {
            client,
            insert,
            acknowledge,
            is_acknowledged,
            table,
            log,
            restored_log: restore.snapshot_log.clone(),
            schema: std::sync::Arc::new(schema.clone()),
            job: job.to_string(),
            subtask,
            run_id: run_id.to_string(),
            buffer: Vec::new(),
            pending: Vec::new(),
        };
        // The restored checkpoint completed: its entries are written (again,
        // harmlessly) before anything new.
        for entry in restore.mine.iter().flat_map(|s| &s.log) {
            sink.write_entry(entry, None).await?;
        }
        if let Some(keep) = restore.keep {
            discard_unreferenced(&sink.client, &sink.log, &progress, job, run_id, keep, false).await?;
        }
        Ok(sink)
    }

    pub fn write(&mut self, batch: &RecordBatch) {
        if batch.num_rows() > 0 {
            self.buffer.push(batch.clone());
        }
    }

    /// The interval's records become a log entry pending on `checkpoint_id`.
    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<SinkState> {
        if !self.buffer.is_empty() {
            let batch = arrow::compute::concat_batches(&self.schema, &self.buffer).map_err(Error::arrow("postgres sink: collecting the log entry"))?;
            self.buffer.clear();
            let name = format!("{}-{:03}-{checkpoint_id:012}.arrow", self.run_id, self.subtask);
            let file = self.log.put_state_file(&name, encode_state(&batch)?).await?;
            let id = format!("{}{}:{}:{checkpoint_id}", job_prefix(&self.job), self.run_id, self.subtask);
            self.pending.push((LogEntry { checkpoint: checkpoint_id, id, file }, Some(batch)));
        }
        Ok(SinkState { log: self.pending.iter().map(|(e, _)| e.clone()).collect(), ..SinkState::default() })
    }

    /// Writes the entries pending on checkpoints up to `checkpoint_id`.
    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        while self.pending.first().is_some_and(|(e, _)| e.checkpoint <= checkpoint_id) {
            let (entry, batch) = self.pending.remove(0);
            self.write_entry(&entry, batch).await?;
        }
        Ok(())
    }

    /// Writes one entry and its acknowledgement in one transaction, unless
    /// it is acknowledged already; then deletes its log file. Without the
    /// records in memory (a restore) the file is read only when the entry
    /// is not acknowledged: a written entry's file may be gone.
    async fn write_entry(&mut self, entry: &LogEntry, batch: Option<RecordBatch>) -> Result<()> {
        let context = |what: &str| format!("postgres sink: {what} log entry {} (checkpoint {})", entry.id, entry.checkpoint);
        let batch = match batch {
            Some(b) => Some(b),
            None => {
                let written = self
                    .client
                    .query_opt(&self.is_acknowledged, &[&entry.writer(), &checkpoint_param(entry)?])
                    .await
                    .map_err(failed(context("looking up")))?;
                match written {
                    Some(_) => None,
                    None => match self.read_entry(entry).await {
                        Err(Error::LostLogEntry { location, checkpoint }) => {
                            // A log file goes only once its rows committed.
                            // With no acknowledgement of its writer at all
                            // (the target's schema changed, or a run of the
                            // job that no longer retains this snapshot
                            // cleaned them), that is the only fact left; an
                            // older acknowledgement of the writer proves
                            // the entry was not written, and its rows lost.
                            let any = self.client.query_opt(&self.is_acknowledged, &[&entry.writer(), &0i64]).await.map_err(failed(context("looking up")))?;
                            if any.is_some() {
                                return Err(Error::LostLogEntry { location, checkpoint });
                            }
                            tracing::warn!(
                                entry = %entry.id,
                                log = %location,
                                "postgres sink: a log entry of the restored checkpoint is taken as written: its log file is gone, which happens only once its rows are committed, and its writer has no acknowledgement in the progress table (the target changed, or another run of the job cleaned them)"
                            );
                            None
                        }
                        r => Some(r?),
                    },
                }
            }
        };
        if let Some(batch) = batch {
            let tx = self.client.transaction().await.map_err(failed(context("beginning the transaction of")))?;
            if tx.execute(&self.acknowledge, &[&entry.writer(), &checkpoint_param(entry)?]).await.map_err(failed(context("acknowledging")))? == 0 {
                tracing::debug!(entry = %entry.id, "log entry written before");
            } else {
                let arrays = column_arrays(&batch)?;
                tx.execute(&self.insert, &params(&arrays))
                    .await
                    .map_err(failed(format!("postgres sink: inserting {} rows of log entry {} into {}", batch.num_rows(), entry.id, self.table.name)))?;
            }
            // The generic write-ahead log's duplicate window (written, not
            // acknowledged): here the rows and their acknowledgement are
            // in one uncommitted transaction, so a crash loses both.
            crate::fault::crash_point("after-wal-write", entry.checkpoint);
            tx.commit().await.map_err(failed(context("committing")))?;
            // Written and acknowledged, the log file not deleted: a restore
            // finds the acknowledgement and skips the entry.
            crate::fault::crash_point("after-wal-commit", entry.checkpoint);
        }
        self.log.delete(&entry.file.name).await
    }

    async fn read_entry(&self, entry: &LogEntry) -> Result<RecordBatch> {
        let (location, batches) = crate::sink::read_log_entry(&self.log, self.restored_log.as_ref(), &entry.file, entry.checkpoint).await?;
        arrow::compute::concat_batches(&self.schema, &batches)
            .map_err(|e| Error::BadCheckpoint { location, message: format!("the log entry does not have the records' schema: {e}") })
    }
}

/// The entry's checkpoint as PostgreSQL's `bigint`.
fn checkpoint_param(entry: &LogEntry) -> Result<i64> {
    i64::try_from(entry.checkpoint).map_err(|_| Error::Postgres {
        context: format!("postgres sink: log entry {}", entry.id),
        code: None,
        message: format!("checkpoint {} does not fit PostgreSQL's bigint", entry.checkpoint),
    })
}

/// Deletes job `job`'s log files of runs other than `run_id` that no
/// retained snapshot references (`keep`), and the progress rows of writers
/// none of whose entries a retained snapshot references: no restore will
/// write those entries again.
/// `finished`: the job has ended, and the last run's own unreferenced log
/// files (of abandoned checkpoints) go too.
async fn discard_unreferenced(client: &Client, log: &Location, progress: &str, job: &str, run_id: &str, keep: &HashSet<String>, finished: bool) -> Result<()> {
    crate::sink::discard_unreferenced_log_files(log, (!finished).then_some(run_id), keep, "postgres").await?;
    let writers: HashSet<&str> = keep.iter().filter(|k| k.starts_with("weir:")).map(|k| writer_of(k)).collect();
    let writers: Vec<&str> = writers.into_iter().collect();
    client
        .execute(
            &format!("DELETE FROM {progress} WHERE starts_with(writer, $1) AND NOT starts_with(writer, $2) AND NOT (writer = ANY($3))"),
            &[&job_prefix(job), &format!("{}{run_id}:", job_prefix(job)), &writers],
        )
        .await
        .map_err(failed(format!("postgres sink: deleting progress rows no snapshot needs from {progress}")))?;
    Ok(())
}

/// Once a job has finished or been stopped: [`discard_unreferenced`] on a
/// connection of its own; the run's own entries too if it is over.
pub async fn discard_after_end(spec: &PostgresSinkSpec, log: &Location, job: &str, run_id: &str, end: crate::sink::RunEnd, keep: &HashSet<String>) -> Result<()> {
    let client = connect(spec, "clean-up").await?;
    discard_unreferenced(&client, log, &progress_table(spec), job, run_id, keep, end == crate::sink::RunEnd::Over).await
}

/// The progress table's name in SQL: in the sink table's schema.
fn progress_table(spec: &PostgresSinkSpec) -> String {
    match spec.table.split_once('.') {
        Some((schema, _)) => format!("{}.{}", quote_ident(schema), quote_ident(PROGRESS_TABLE)),
        None => quote_ident(PROGRESS_TABLE),
    }
}

#[cfg(test)]
mod tests {
    use super::writer_of;

    #[test]
    fn an_entry_is_acknowledged_under_its_writer_without_the_checkpoint() {
        assert_eq!(writer_of("weir:job:0a1b:2:17"), "weir:job:0a1b:2");
        // A job name may contain colons; the checkpoint is always last.
        assert_eq!(writer_of("weir:a:b:0a1b:0:3"), "weir:a:b:0a1b:0");
    }
}
