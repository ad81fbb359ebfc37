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
mod json;
mod kafka;
mod socket;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use serde::{Deserialize, Serialize};
use weir_api::SourceSpec;

use crate::error::{Error, Result};

pub use file::{FileMark, FileReader};
pub use generator::GeneratorReader;

/// The checkpointed positions of the splits one subtask owned.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SourcePositions {
    pub splits: BTreeMap<String, u64>,
    /// For file splits read past their start: line number, skipped lines and
    /// a fingerprint of the file at the position. Absent in checkpoints taken
    /// before it existed (and for generators), which restore without checks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, FileMark>,
    /// For Kafka partitions: bad messages left out before the position, so
    /// that `records_skipped` survives restores.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub skipped: BTreeMap<String, u64>,
}

pub enum SourceReader {
    Generator(GeneratorReader),
    File(FileReader),
    Kafka(kafka::KafkaReader),
    Socket(socket::SocketReader),
}

/// Which split each row of the last batch came from, for per-split watermarks.
pub enum RowSplits {
    /// Every row from this split.
    All(String),
    /// Row i from split `each[i]`.
    Each(Vec<String>),
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
    /// states of every subtask of the checkpoint, in any order). Without
    /// them, a Kafka partition starts where `started` says (where this
    /// history first started it, `worker/start_positions.rs`), else where
    /// `start` says.
    pub fn open(
        spec: &SourceSpec,
        schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        max_parallelism: u32,
        restored: &[SourcePositions],
        started: &SourcePositions,
        base_dir: &Path,
    ) -> Result<Self> {
        let mut positions = SourcePositions::default();
        for r in restored {
            for (split, pos) in &r.splits {
                if positions.splits.insert(split.clone(), *pos).is_some() {
                    return Err(Error::Job(format!("checkpoint has split `{split}` of the source twice")));
                }
            }
            positions.files.extend(r.files.iter().map(|(k, v)| (k.clone(), *v)));
            positions.skipped.extend(r.skipped.iter().map(|(k, v)| (k.clone(), *v)));
        }
        Ok(match spec {
            SourceSpec::Generator(g) => SourceReader::Generator(GeneratorReader::new(g, schema, subtask, parallelism, max_parallelism, &positions.splits)?),
            SourceSpec::File(f) => SourceReader::File(FileReader::new(f, schema, subtask, parallelism, &positions, base_dir)?),
            // A first start (nothing restored) applies `start`; a restore
            // starts partitions its checkpoint lacks at their beginning.
            SourceSpec::Kafka(k) => {
                let restored = (!restored.is_empty()).then_some(&positions);
                SourceReader::Kafka(kafka::KafkaReader::new(k, schema, subtask, parallelism, restored, started)?)
            }
            SourceSpec::Socket(s) => SourceReader::Socket(socket::SocketReader::new(s, schema, subtask)?),
        })
    }

    pub fn poll(&mut self) -> Result<Poll> {
        match self {
            SourceReader::Generator(g) => Ok(g.poll()),
            SourceReader::File(f) => f.poll(),
            SourceReader::Kafka(k) => k.poll(),
            SourceReader::Socket(s) => s.poll(),
        }
    }

    /// Where the rows of the batch `poll` returned last came from.
    pub fn last_batch_splits(&self) -> RowSplits {
        match self {
            SourceReader::Generator(g) => RowSplits::All(g.last_split()),
            SourceReader::File(f) => RowSplits::All(f.last_split()),
            SourceReader::Kafka(k) => RowSplits::Each(k.last_row_splits()),
            SourceReader::Socket(_) => RowSplits::All("socket".into()),
        }
    }

    /// The splits being read now, which a per-split watermark waits for: a
    /// generator's and a Kafka source's unfinished splits (read side by
    /// side), a file source's current file (files are read one after the
    /// other, so one not started yet holds nothing back).
    pub fn active_splits(&self) -> Vec<String> {
        match self {
            SourceReader::Generator(g) => g.active_splits(),
            SourceReader::File(f) => f.active_splits(),
            SourceReader::Kafka(k) => k.active_splits(),
            SourceReader::Socket(_) => vec!["socket".into()],
        }
    }

    /// Input records left out (bad lines under `bad_lines: skip`) since the
    /// last call; the first call also counts those of the restored positions,
    /// so that the job's total survives restores and rescaling.
    pub fn take_skipped(&mut self) -> u64 {
        match self {
            SourceReader::Generator(_) => 0,
            SourceReader::File(f) => f.take_skipped(),
            SourceReader::Kafka(k) => k.take_skipped(),
            SourceReader::Socket(s) => s.take_skipped(),
        }
    }

    /// The positions a checkpoint keeps; a source that copies records
    /// elsewhere (Kafka's dead-letter topic) makes the copies durable first.
    pub fn positions(&self) -> Result<SourcePositions> {
        match self {
            SourceReader::Generator(g) => Ok(g.positions()),
            SourceReader::File(f) => Ok(f.positions()),
            SourceReader::Kafka(k) => k.positions(),
            SourceReader::Socket(s) => Ok(s.positions()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_of_a_checkpoint_without_file_marks_still_read() {
        let old: SourcePositions = serde_json::from_str(r#"{"splits":{"file:a.jsonl":42}}"#).unwrap();
        assert_eq!(old.splits["file:a.jsonl"], 42);
        assert!(old.files.is_empty());
    }

    #[test]
    fn generator_positions_are_written_as_before() {
        let p = SourcePositions { splits: [("generator-0".to_string(), 5)].into(), ..Default::default() };
        assert_eq!(serde_json::to_string(&p).unwrap(), r#"{"splits":{"generator-0":5}}"#);
    }
}
