//! Sinks: where results leave the job, and when they become visible.
//!
//! The contract with the subtask loop: `write` during a checkpoint interval,
//! `pre_commit` at the aligned barrier (everything written so far becomes
//! durable and pending; what it returns is the sink's checkpointed state),
//! `commit` when the coordinator says that checkpoint completed. A sink does
//! not know about barriers or the coordinator.
//!
//! The file sink has two homes: a directory (`file.rs`: in-progress files
//! renamed at commit) and S3 (`s3_file.rs`: hidden objects staged at the
//! barrier, copied to their final names at commit). Both keep what is pending in the same [`FileSinkState`], so a
//! checkpoint does not care which one wrote it.

mod file;
mod s3_file;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use arrow::array::RecordBatch;
use arrow::json::LineDelimitedWriter;
use weir_api::SinkSpec;

use crate::error::{Error, Result};

pub use file::{FileSink, FileSinkState, PendingFile};
pub use s3_file::S3FileSink;

pub enum SinkWriter {
    File(FileSink),
    S3File(S3FileSink),
    Stdout,
    Blackhole,
}

/// What a sink subtask receives when it starts.
#[derive(Default)]
pub struct SinkRestore<'a> {
    /// States of the restored snapshot's old subtasks this subtask takes
    /// over: their pending output is committed before anything new is written.
    pub mine: Vec<FileSinkState>,
    /// Given to subtask 0 only: the in-progress files some retained snapshot
    /// still references. It discards the job's other in-progress files, which
    /// hold records that will be produced again.
    pub keep: Option<&'a HashSet<String>>,
}

/// Once a job has finished (its final checkpoint committed): deletes the
/// in-progress files (aborts the uploads) of the job that no retained
/// snapshot references.
pub async fn clean_up_after_finish(spec: &SinkSpec, job: &str, run_id: &str, keep: &HashSet<String>, base_dir: &Path) -> Result<()> {
    match spec {
        SinkSpec::File(f) if f.is_s3() => s3_file::discard_unreferenced(&s3_file::Output::open(&f.path)?, job, run_id, keep).await,
        SinkSpec::File(f) => file::discard_unreferenced(&base_dir.join(&f.path), job, run_id, keep),
        _ => Ok(()),
    }
}

/// Records as JSON lines, one object per line.
pub(crate) fn encode_jsonl(batch: &RecordBatch) -> std::result::Result<Vec<u8>, arrow::error::ArrowError> {
    let mut w = LineDelimitedWriter::new(Vec::with_capacity(batch.num_rows() * 32));
    w.write(batch)?;
    w.finish()?;
    Ok(w.into_inner())
}

impl SinkWriter {
    pub async fn open(spec: &SinkSpec, job: &str, subtask: u32, run_id: &str, restore: SinkRestore<'_>, base_dir: &Path) -> Result<Self> {
        Ok(match spec {
            SinkSpec::File(f) if f.is_s3() => SinkWriter::S3File(S3FileSink::open(f, job, subtask, run_id, restore).await?),
            SinkSpec::File(f) => SinkWriter::File(FileSink::open(f, job, subtask, run_id, restore, base_dir)?),
            SinkSpec::Stdout(_) => SinkWriter::Stdout,
            SinkSpec::Blackhole(_) => SinkWriter::Blackhole,
        })
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        match self {
            SinkWriter::File(f) => f.write(batch),
            SinkWriter::S3File(f) => f.write(batch).await,
            SinkWriter::Stdout => {
                let lines = encode_jsonl(batch).map_err(Error::arrow("stdout sink"))?;
                std::io::stdout().lock().write_all(&lines).map_err(Error::io("stdout sink"))
            }
            SinkWriter::Blackhole => Ok(()),
        }
    }

    /// Makes everything written so far durable and pending on `checkpoint_id`.
    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<Option<FileSinkState>> {
        match self {
            SinkWriter::File(f) => f.pre_commit(checkpoint_id).map(Some),
            SinkWriter::S3File(f) => f.pre_commit(checkpoint_id).await.map(Some),
            SinkWriter::Stdout => {
                std::io::stdout().flush().map_err(Error::io("stdout sink"))?;
                Ok(None)
            }
            SinkWriter::Blackhole => Ok(None),
        }
    }

    /// Publishes what was pending on checkpoints up to `checkpoint_id`.
    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        match self {
            SinkWriter::File(f) => f.commit(checkpoint_id),
            SinkWriter::S3File(f) => f.commit(checkpoint_id).await,
            _ => Ok(()),
        }
    }
}
