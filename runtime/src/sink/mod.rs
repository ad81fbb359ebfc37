//! Sinks: where results leave the job, and when they become visible.
//!
//! The contract with the subtask loop: `write` during a checkpoint interval,
//! `pre_commit` at the aligned barrier (everything written so far becomes
//! durable and pending; what it returns is the sink's checkpointed state),
//! `commit` when the coordinator says that checkpoint completed. A sink does
//! not know about barriers or the coordinator.

mod file;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use arrow::array::RecordBatch;
use arrow::json::LineDelimitedWriter;
use weir_api::SinkSpec;

use crate::error::{Error, Result};

pub use file::{FileSink, FileSinkState, PendingFile};

pub enum SinkWriter {
    File(FileSink),
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
/// in-progress files of the job that no retained snapshot references.
pub fn clean_up_after_finish(spec: &SinkSpec, job: &str, run_id: &str, keep: &HashSet<String>, base_dir: &Path) -> Result<()> {
    match spec {
        SinkSpec::File(f) => file::discard_unreferenced(&base_dir.join(&f.path), job, run_id, keep),
        _ => Ok(()),
    }
}

impl SinkWriter {
    pub fn open(spec: &SinkSpec, job: &str, subtask: u32, run_id: &str, restore: SinkRestore, base_dir: &Path) -> Result<Self> {
        Ok(match spec {
            SinkSpec::File(f) => SinkWriter::File(FileSink::open(f, job, subtask, run_id, restore, base_dir)?),
            SinkSpec::Stdout(_) => SinkWriter::Stdout,
            SinkSpec::Blackhole(_) => SinkWriter::Blackhole,
        })
    }

    pub fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        match self {
            SinkWriter::File(f) => f.write(batch),
            SinkWriter::Stdout => {
                let mut out = std::io::stdout().lock();
                let mut w = LineDelimitedWriter::new(&mut out);
                w.write(batch).map_err(Error::arrow("stdout sink"))?;
                w.finish().map_err(Error::arrow("stdout sink"))?;
                Ok(())
            }
            SinkWriter::Blackhole => Ok(()),
        }
    }

    /// Makes everything written so far durable and pending on `checkpoint_id`.
    pub fn pre_commit(&mut self, checkpoint_id: u64) -> Result<Option<FileSinkState>> {
        match self {
            SinkWriter::File(f) => f.pre_commit(checkpoint_id).map(Some),
            SinkWriter::Stdout => {
                std::io::stdout().flush().map_err(Error::io("stdout sink"))?;
                Ok(None)
            }
            SinkWriter::Blackhole => Ok(None),
        }
    }

    /// Publishes what was pending on checkpoints up to `checkpoint_id`.
    pub fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        match self {
            SinkWriter::File(f) => f.commit(checkpoint_id),
            _ => Ok(()),
        }
    }
}
