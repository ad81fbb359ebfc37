//! Opening a source subtask: where it starts reading, which is the
//! restored checkpoint's positions under the source's state id, else (an
//! at-most-once job resuming) its read marks, else (a source whose start
//! depends on the moment) the start its history first recorded.
//!
//! Each source of a graph keeps its own positions, read marks and recorded
//! start, named by its state id: two sources may name their splits alike.

use arrow::datatypes::SchemaRef;
use tokio::sync::mpsc;
use weir_api::SourceSpec;

use super::read_marks::ReadMarks;
use super::restore::RestoredState;
use super::start_positions;
use super::subtask::{Input, ReadAhead};
use super::WorkerConfig;
use crate::checkpoint::CheckpointStorage;
use crate::error::Result;
use crate::exchange::Barrier;
use crate::plan::SourcePlan;
use crate::source::{SourcePositions, SourceReader};

pub(super) struct SourceOpening<'a> {
    pub cfg: &'a WorkerConfig,
    pub storage: &'a CheckpointStorage,
    pub restored: Option<&'a RestoredState>,
    pub at_most_once: bool,
}

impl SourceOpening<'_> {
    /// Subtask `subtask` of `source`, reading batches of `schema`, told of
    /// checkpoints on `triggers`.
    pub async fn open(
        &self,
        source: &SourcePlan,
        schema: SchemaRef,
        subtask: u32,
        triggers: mpsc::UnboundedReceiver<Barrier>,
    ) -> Result<Input> {
        let spec = &self.cfg.plan.spec;
        let id = source.state_id.as_str();
        let positions = match self.restored {
            Some(r) => r.source_positions(id)?,
            // An at-most-once run that resumes starts where the sources last
            // read; nothing read yet is a first start (Kafka's `start` applies).
            None if self.at_most_once && self.cfg.restore.is_some() => {
                let marks = ReadMarks::load(self.storage, id).await?;
                if marks.splits.is_empty() {
                    Vec::new()
                } else {
                    vec![marks]
                }
            }
            None => Vec::new(),
        };
        // A fresh start of a source whose start depends on the moment goes on
        // where this history first started (`start_positions.rs`).
        let started_on_clock = positions.is_empty() && matches!(source.spec, SourceSpec::Kafka(_));
        let started = if started_on_clock {
            start_positions::load(self.storage, id).await?
        } else {
            SourcePositions::default()
        };
        let reader = SourceReader::open(
            &source.spec,
            schema,
            subtask,
            spec.parallelism,
            spec.max_parallelism,
            &positions,
            &started,
            &self.cfg.base_dir,
        )?;
        if started_on_clock {
            start_positions::save(self.storage, id, subtask, &reader.positions()?).await?;
        }
        let ahead = self
            .at_most_once
            .then(|| ReadAhead::new(ReadMarks::new(self.storage, id, subtask)));
        Ok(Input::Source {
            reader,
            triggers,
            ahead,
            state_id: source.state_id.clone(),
        })
    }
}
