//! Exactly-once into PostgreSQL by two-phase commit.
//!
//! The first record after a barrier opens a transaction on the subtask's
//! writing connection; every batch is one `INSERT` into it. At the barrier
//! the transaction is prepared under a global id
//! `weir:<job>:<run>:<subtask>:<checkpoint>` (phase one): from then on it
//! survives this process and the server's restarts, holding its rows
//! invisible. The id is the sink's checkpointed state. When the checkpoint
//! completes, a second connection commits it with `COMMIT PREPARED` (phase
//! two; the first connection is already writing the next interval's
//! transaction, and a connection inside a transaction cannot commit a
//! prepared one).
//!
//! Committing again is harmless: a transaction that is no longer prepared
//! was committed by an earlier attempt, because weir rolls back only
//! transactions that no retained snapshot references. That is proven, not
//! assumed: the state keeps each transaction's id (`txid_current()`), and a
//! `COMMIT PREPARED` that finds nothing asks the server (`txid_status`).
//! One that was rolled back (by a database administrator, or by a run of
//! another state sharing the job id, before ids were scoped by the state's
//! identity) is the fatal error naming it, never a silent loss of its rows.
//! The global ids carry the job id and its state's identity
//! (`weir:<job>:<identity>:<run>:<subtask>:<checkpoint>`), and a restore
//! rolls back only ids of its own state. On restore, the
//! restored checkpoint's transactions are committed before anything new is
//! written, and subtask 0 rolls back the job's prepared transactions of
//! other runs that no retained snapshot references (they hold records that
//! will be produced again). A transaction that was open but not prepared
//! when its process died is rolled back by the server when the connection
//! drops.

use std::collections::HashSet;

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
use tokio_postgres::{Client, Statement};
use weir_api::PostgresSinkSpec;

use super::{column_arrays, connect, failed, job_prefix, params, quote_literal, Table};
use crate::error::{Error, Result};
use crate::sink::{PendingTransaction, SinkRestore, SinkState};

/// PostgreSQL's limit on a global transaction id, in bytes.
const MAX_GID_BYTES: usize = 200;

pub struct TwoPhaseCommit {
    /// Holds the open transaction of the current interval.
    writer: Client,
    /// Commits prepared transactions while `writer` is in the next one.
    committer: Client,
    insert: Statement,
    table: Table,
    job: String,
    subtask: u32,
    run_id: String,
    /// A transaction is open on `writer`.
    open: bool,
    /// The checkpoint of the last barrier: the open transaction holds
    /// records of the interval after it.
    last_barrier: u64,
    /// Prepared, waiting for their checkpoint to complete.
    pending: Vec<PendingTransaction>,
}

impl TwoPhaseCommit {
    pub async fn open(spec: &PostgresSinkSpec, schema: &Schema, job: &str, subtask: u32, run_id: &str, restore: SinkRestore<'_>) -> Result<Self> {
        let gid_bytes = format!("{}{run_id}:{subtask}:{}", job_prefix(job), u64::MAX).len();
        if gid_bytes > MAX_GID_BYTES {
            return Err(Error::Plan {
                context: "name".into(),
                message: format!("the job's name is too long for the postgres sink's transaction ids ({gid_bytes} bytes, PostgreSQL allows {MAX_GID_BYTES}); expected a shorter name"),
            });
        }
        let writer = connect(spec, "writer").await?;
        let committer = connect(spec, "committer").await?;
        let limit: String = committer
            .query_one("SHOW max_prepared_transactions", &[])
            .await
            .map_err(failed("postgres sink: reading max_prepared_transactions"))?
            .get(0);
        if limit.trim() == "0" {
            return Err(Error::Plan {
                context: "sink.postgres.mode".into(),
                message: "two-phase-commit needs the server setting max_prepared_transactions above 0 (it is 0, which disables PREPARE TRANSACTION); set it to at least twice the job's parallelism in postgresql.conf and restart the server, or use `mode: write-ahead-log`, which needs none".into(),
            });
        }
        let table = Table::check(&writer, spec, schema).await?;
        let insert = writer.prepare(&table.insert_from_arrays()).await.map_err(failed(format!("postgres sink: preparing the insert into {}", table.name)))?;
        let sink = TwoPhaseCommit {
            writer,
            committer,
            insert,
            table,
            job: job.to_string(),
            subtask,
            run_id: run_id.to_string(),
            open: false,
            last_barrier: 0,
            pending: Vec::new(),
        };
        // The restored checkpoint completed (its commit notification may
        // have been lost): its transactions are committed first.
        for t in restore.mine.iter().flat_map(|s| &s.transactions) {
            commit_prepared(&sink.committer, t).await?;
        }
        if let Some(keep) = restore.keep {
            discard_prepared(&sink.committer, &sink.job, &sink.run_id, keep).await?;
        }
        Ok(sink)
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if !self.open {
            self.writer.batch_execute("BEGIN").await.map_err(failed("postgres sink: beginning a transaction"))?;
            self.open = true;
        }
        let arrays = column_arrays(batch)?;
        self.writer
            .execute(&self.insert, &params(&arrays))
            .await
            .map_err(failed(format!("postgres sink: inserting {} rows into {}", batch.num_rows(), self.table.name)))?;
        // Rows in an open transaction, not prepared: a crash here must
        // leave nothing of them (the server rolls the transaction back).
        crate::fault::crash_point("mid-transaction", self.last_barrier);
        Ok(())
    }

    /// Phase one: prepares the interval's transaction, which then waits for
    /// checkpoint `checkpoint_id` to complete.
    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<SinkState> {
        if self.open {
            let gid = format!("{}{}:{}:{checkpoint_id}", job_prefix(&self.job), self.run_id, self.subtask);
            let xid: i64 = self
                .writer
                .query_one("SELECT txid_current()", &[])
                .await
                .map_err(failed(format!("postgres sink: reading the transaction id of checkpoint {checkpoint_id}")))?
                .get(0);
            self.writer
                .batch_execute(&format!("PREPARE TRANSACTION {}", quote_literal(&gid)))
                .await
                .map_err(failed(format!("postgres sink: preparing the transaction of checkpoint {checkpoint_id}")))?;
            self.open = false;
            self.pending.push(PendingTransaction { checkpoint: checkpoint_id, gid, xid: Some(xid) });
            // Prepared but not acknowledged: the checkpoint cannot complete,
            // so the restore must roll this transaction back.
            crate::fault::crash_point("after-prepare", checkpoint_id);
        }
        self.last_barrier = checkpoint_id;
        Ok(SinkState { transactions: self.pending.clone(), ..SinkState::default() })
    }

    /// Phase two: commits the transactions pending on checkpoints up to `checkpoint_id`.
    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        while let Some(t) = self.pending.first() {
            if t.checkpoint > checkpoint_id {
                break;
            }
            commit_prepared(&self.committer, t).await?;
            self.pending.remove(0);
        }
        Ok(())
    }
}

/// `COMMIT PREPARED`, done at most once whatever happens: a transaction
/// that is no longer prepared was committed before.
async fn commit_prepared(client: &Client, t: &PendingTransaction) -> Result<()> {
    match client.batch_execute(&format!("COMMIT PREPARED {}", quote_literal(&t.gid))).await {
        Ok(()) => Ok(()),
        // undefined_object: "prepared transaction with identifier … does not exist".
        Err(e) if e.code().is_some_and(|c| c.code() == "42704") => settled(client, t).await,
        Err(e) => Err(failed(format!("postgres sink: committing transaction {} of checkpoint {}", t.gid, t.checkpoint))(e)),
    }
}

/// A transaction that is no longer prepared: committed (by an earlier
/// attempt) is fine; rolled back is data loss, and fatal.
async fn settled(client: &Client, t: &PendingTransaction) -> Result<()> {
    let Some(xid) = t.xid else {
        // A checkpoint of an older version: nothing to ask by.
        tracing::debug!(gid = %t.gid, "already committed");
        return Ok(());
    };
    let status: Option<String> = client
        .query_one("SELECT txid_status($1)", &[&xid])
        .await
        .map_err(failed(format!("postgres sink: asking the server about transaction {} of checkpoint {}", t.gid, t.checkpoint)))?
        .get(0);
    match status.as_deref() {
        Some("committed") => {
            tracing::debug!(gid = %t.gid, xid, "already committed");
            Ok(())
        }
        Some("aborted") => Err(Error::Fatal(format!(
            "postgres sink: the prepared transaction {} of checkpoint {}, which completed, was rolled back (transaction {xid}), not committed: its rows are lost. \
             Something outside this job's state rolled it back: a ROLLBACK PREPARED, or another state of the same job id sharing the database. \
             Restore an earlier checkpoint or savepoint of the job to write them again",
            t.gid, t.checkpoint
        ))),
        // Older than the server's commit log: its fate can no longer be read.
        None => {
            tracing::warn!(gid = %t.gid, xid, "postgres sink: a restored transaction is no longer prepared and too old for the server to tell whether it committed; it is taken as committed");
            Ok(())
        }
        Some(other) => Err(Error::Postgres {
            context: format!("postgres sink: committing transaction {} of checkpoint {}", t.gid, t.checkpoint),
            code: None,
            message: format!("it is no longer prepared, and the server says it is {other}"),
        }),
    }
}

/// Rolls back the prepared transactions of job `job` that are not of run
/// `run_id` and that no retained snapshot references (`keep`).
async fn discard_prepared(client: &Client, job: &str, run_id: &str, keep: &HashSet<String>) -> Result<()> {
    let rows = client
        .query("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, $1)", &[&job_prefix(job)])
        .await
        .map_err(failed("postgres sink: listing prepared transactions"))?;
    let current = format!("{}{run_id}:", job_prefix(job));
    for row in rows {
        let gid: String = row.get(0);
        if gid.starts_with(&current) || keep.contains(&gid) {
            continue;
        }
        tracing::info!(gid = %gid, "rolling back the prepared transaction of a checkpoint that never completed");
        match client.batch_execute(&format!("ROLLBACK PREPARED {}", quote_literal(&gid))).await {
            // Gone meanwhile: another cleanup got there first.
            Err(e) if !e.code().is_some_and(|c| c.code() == "42704") => return Err(failed(format!("postgres sink: rolling back {gid}"))(e)),
            _ => {}
        }
    }
    Ok(())
}

/// Once a job has finished: rolls back its prepared transactions that no
/// retained snapshot references (see [`discard_prepared`]).
pub async fn discard_unreferenced(spec: &PostgresSinkSpec, job: &str, run_id: &str, keep: &HashSet<String>) -> Result<()> {
    let client = connect(spec, "clean-up").await?;
    discard_prepared(&client, job, run_id, keep).await
}
