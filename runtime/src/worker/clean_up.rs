//! What worker 0 deletes once a job has finished or been stopped with a
//! savepoint: the leftovers of earlier runs (in-progress files, prepared
//! transactions, log entries) that no retained snapshot references any
//! more. A run's start discards what was unreferenced then; retention,
//! running during the run, can retire the last snapshot that protected an
//! earlier run's leftover, and a job that is never resumed (deleted, or
//! stopped for good) would keep it forever.

use std::path::{Path, PathBuf};

use weir_api::FileSinkSpec;

use crate::checkpoint::CheckpointStorage;
use crate::error::Result;
use crate::plan::late_records_id;
use crate::sink::{RunEnd, SinkScope};
use weir_api::SinkSpec;

/// The outputs worker 0 cleans up: the job's sinks and the files of late
/// records its windows write.
#[derive(Clone)]
pub(crate) struct Outputs {
    /// Each sink's state id (where checkpoints keep its pending output) and spec.
    pub sinks: Vec<(String, SinkSpec)>,
    /// (window operator id, its late records' file output)
    pub late_records: Vec<(String, FileSinkSpec)>,
}

/// Cleans up every output of the job for run `run_id`, which ended as `end`.
pub(crate) async fn clean_up_after_end(outputs: &Outputs, job: &str, run_id: &str, end: RunEnd, base_dir: &Path, storage: &CheckpointStorage) -> Result<()> {
    for (state_id, spec) in &outputs.sinks {
        let keep = super::restore::referenced_sink_files(storage, None, state_id).await?;
        crate::sink::clean_up_after_end(spec, &SinkScope::of(state_id), job, run_id, end, &keep, base_dir, storage).await?;
    }
    for (op, output) in &outputs.late_records {
        let state_id = late_records_id(op);
        let keep = super::restore::referenced_sink_files(storage, None, &state_id).await?;
        crate::sink::clean_up_after_end(&SinkSpec::File(output.clone()), &SinkScope::of(&state_id), job, run_id, end, &keep, base_dir, storage).await?;
    }
    Ok(())
}

/// Worker 0's clean-up after a stop in pod mode, where the run may resume
/// (a cancelled stop): everything of this run is left alone.
pub(crate) struct AtStop {
    pub outputs: Outputs,
    pub job: String,
    pub run_id: String,
    pub base_dir: PathBuf,
    pub storage: CheckpointStorage,
}

impl AtStop {
    /// A failure is only logged: the stop's own output is committed, and the
    /// next run of the job cleans up what is left.
    pub(crate) async fn run(&self) {
        if let Err(e) = clean_up_after_end(&self.outputs, &self.job, &self.run_id, RunEnd::MayResume, &self.base_dir, &self.storage).await {
            tracing::warn!(error = %e, "cleaning up after the stop failed; the next run of the job cleans up instead");
        }
    }
}

/// Worker 0's disposal of its job's savepoints, for the control endpoint's
/// `POST /v1/savepoint-disposals` (the operator disposes of the savepoints
/// `spec.savepoints` no longer keeps). A savepoint holds, besides its
/// directory, what its sink state names outside storage: prepared
/// PostgreSQL transactions and log entries in the job's `wal-<sink>/`.
/// Once the directory is gone, the job's clean-up runs as at a stop that may
/// resume: what no retained snapshot references any more goes, except
/// anything of the running run, whose checkpoints may name it next.
pub(crate) struct SavepointDisposal {
    pub at: AtStop,
}

impl SavepointDisposal {
    pub(crate) async fn dispose(&self, location: &str) -> std::result::Result<bool, crate::checkpoint::Disposal> {
        let existed = self.at.storage.dispose_savepoint(location).await?;
        tracing::info!(savepoint = %location, existed, "savepoint disposed of; cleaning up what it alone held");
        clean_up_after_end(&self.at.outputs, &self.at.job, &self.at.run_id, RunEnd::MayResume, &self.at.base_dir, &self.at.storage)
            .await
            .map_err(crate::checkpoint::Disposal::Failed)?;
        Ok(existed)
    }
}
