//! Sources: where records enter the job, and how far each subtask has read.
//!
//! A source's work is divided into splits that do not depend on the
//! parallelism (a generator has `max_parallelism` interleaved sequences, a
//! file source one split per file). A subtask reads the splits it owns, and
//! its checkpointed state is the position in each of them, so a job restored
//! at another parallelism hands each split, with its position, to its new
//! owner. A source never emits a record twice from the same position.

mod file;
mod generator;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use serde::{Deserialize, Serialize};
use weir_api::SourceSpec;

use crate::error::{Error, Result};

pub use file::FileReader;
pub use generator::GeneratorReader;

/// The checkpointed positions of the splits one subtask owned.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SourcePositions {
    pub splits: BTreeMap<String, u64>,
}

pub enum SourceReader {
    Generator(GeneratorReader),
    File(FileReader),
}

/// What to do next.
#[derive(Debug)]
pub enum Poll {
    Batch(RecordBatch),
    /// Rate-limited: nothing may be emitted before this much time has passed.
    Wait(Duration),
    Finished,
}

impl SourceReader {
    /// Opens the splits `subtask` owns, at the positions of `restored` (the
    /// states of every subtask of the checkpoint, in any order).
    pub fn open(
        spec: &SourceSpec,
        schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        max_parallelism: u32,
        restored: &[SourcePositions],
        base_dir: &Path,
    ) -> Result<Self> {
        let mut positions = BTreeMap::new();
        for r in restored {
            for (split, pos) in &r.splits {
                if positions.insert(split.clone(), *pos).is_some() {
                    return Err(Error::Job(format!("checkpoint has split `{split}` of the source twice")));
                }
            }
        }
        Ok(match spec {
            SourceSpec::Generator(g) => SourceReader::Generator(GeneratorReader::new(g, schema, subtask, parallelism, max_parallelism, &positions)?),
            SourceSpec::File(f) => SourceReader::File(FileReader::new(f, schema, subtask, parallelism, &positions, base_dir)?),
        })
    }

    pub fn poll(&mut self) -> Result<Poll> {
        match self {
            SourceReader::Generator(g) => Ok(g.poll()),
            SourceReader::File(f) => f.poll(),
        }
    }

    pub fn positions(&self) -> SourcePositions {
        match self {
            SourceReader::Generator(g) => g.positions(),
            SourceReader::File(f) => f.positions(),
        }
    }
}
