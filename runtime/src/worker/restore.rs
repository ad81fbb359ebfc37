//! Handing the state of a checkpoint to the subtasks of a new run, possibly
//! at another parallelism: source splits go to their new owners, keyed state
//! is read by key group range, pending sink files go to `old % new` (and
//! subtask 0 sees them all, to clean up).

use std::collections::HashSet;
use std::io::Cursor;

use arrow::array::RecordBatch;
use arrow::ipc::reader::FileReader;
use arrow::ipc::writer::FileWriter;

use crate::checkpoint::{CheckpointMetadata, CheckpointStorage, Location};
use crate::error::{Error, Result};
use crate::key_group::groups_of_subtask;
use super::gate::InFlight;
use crate::exchange::partition::Partitioner;
use crate::plan::{EdgeKind, JobPlan, StageInput, IN_FLIGHT_EDGE};
use crate::sink::SinkState;
use crate::source::SourcePositions;

/// What `--restore` names: `latest`, or a checkpoint or savepoint directory
/// (a path or URL, e.g. a savepoint's `location` as the API reports it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreFrom {
    Latest,
    Path(String),
}

impl RestoreFrom {
    pub fn parse(text: &str) -> RestoreFrom {
        if text == "latest" {
            RestoreFrom::Latest
        } else {
            RestoreFrom::Path(text.to_string())
        }
    }

    /// The directory to restore; `None` for `latest` when `storage` has no
    /// completed checkpoint yet (the caller starts fresh and says so).
    pub async fn resolve(&self, storage: &CheckpointStorage) -> Result<Option<Location>> {
        match self {
            RestoreFrom::Latest => storage.latest().await,
            RestoreFrom::Path(p) => Location::parse(p, false).map(Some),
        }
    }
}

pub struct RestoredState {
    pub meta: CheckpointMetadata,
    pub location: Location,
}

impl RestoredState {
    pub async fn load(location: Location) -> Result<Self> {
        let meta = location.read_metadata().await?;
        Ok(RestoredState { meta, location })
    }

    /// Checks that this checkpoint can be restored into `plan`.
    pub fn check_compatible(&self, plan: &JobPlan, allow_non_restored_state: bool) -> Result<()> {
        let bad = |message: String| Error::BadCheckpoint { location: self.location.display.clone(), message };
        if self.meta.max_parallelism != plan.spec.max_parallelism {
            return Err(bad(format!(
                "it was taken with max_parallelism {} but the pipeline says {}: max_parallelism is fixed for the life of a job",
                self.meta.max_parallelism, plan.spec.max_parallelism
            )));
        }
        let known = plan.stateful_operator_ids();
        let unknown: Vec<&String> = self.meta.operators.keys().filter(|id| !known.contains(id)).collect();
        if !unknown.is_empty() && !allow_non_restored_state {
            return Err(bad(format!(
                "it has state for {} that the pipeline no longer has; restore with --allow-non-restored-state to drop that state",
                unknown.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ")
            )));
        }
        Ok(())
    }

    /// Reads every state file of the snapshot and checks its size and CRC
    /// against the metadata: a damaged snapshot is refused before anything
    /// relies on it.
    pub async fn verify_state_files(&self) -> Result<()> {
        for s in self.meta.operators.values().flatten() {
            if let Some(file) = &s.file {
                self.location.read_state_file(file).await?;
            }
            for file in &s.shared {
                self.shared_dir().read_state_file(file).await?;
            }
        }
        Ok(())
    }

    /// The job's directory of shared state files (incremental checkpoints),
    /// beside its `checkpoints` directory.
    fn shared_dir(&self) -> Location {
        self.location.parent().parent().child(crate::checkpoint::storage::SHARED_DIR)
    }

    /// Every old source subtask's positions, kept under `state_id`.
    pub fn source_positions(&self, state_id: &str) -> Result<Vec<SourcePositions>> {
        self.inline_states(state_id).map(|v| v.into_iter().map(|(_, s)| s).collect())
    }

    /// Every old subtask's state of the output kept under `id` (the sink's,
    /// or a window's late records'), with its old subtask index.
    pub fn sink_states_of(&self, id: &str) -> Result<Vec<(u32, SinkState)>> {
        self.inline_states(id)
    }

    fn inline_states<T: for<'de> serde::Deserialize<'de>>(&self, op: &str) -> Result<Vec<(u32, T)>> {
        let mut out = Vec::new();
        for s in self.meta.operators.get(op).into_iter().flatten() {
            if let Some(v) = &s.inline {
                let parsed = serde_json::from_value(v.clone()).map_err(|e| Error::BadCheckpoint {
                    location: self.location.display.clone(),
                    message: format!("state of `{op}` subtask {} cannot be read: {e}", s.subtask),
                })?;
                out.push((s.subtask, parsed));
            }
        }
        Ok(out)
    }

    /// The keyed-state batches whose key group ranges overlap `subtask`'s,
    /// each with whether it holds changes to apply over the batches before
    /// it (the files of an incremental checkpoint after its full snapshot).
    pub async fn keyed_batches(&self, op: &str, subtask: u32, parallelism: u32) -> Result<Vec<(RecordBatch, bool)>> {
        let max = self.meta.max_parallelism;
        let mine = groups_of_subtask(subtask, parallelism, max);
        let mut out = Vec::new();
        for s in self.meta.operators.get(op).into_iter().flatten() {
            let theirs = groups_of_subtask(s.subtask, self.meta.parallelism, max);
            if theirs.end() < mine.start() || theirs.start() > mine.end() {
                continue;
            }
            if let Some(file) = &s.file {
                let bytes = self.location.read_state_file(file).await?;
                out.extend(decode_state(&format!("{}/{}", self.location.display, file.name), bytes.to_vec())?.into_iter().map(|b| (b, false)));
            }
            let shared = self.shared_dir();
            for (i, file) in s.shared.iter().enumerate() {
                let bytes = shared.read_state_file(file).await?;
                out.extend(decode_state(&format!("{}/{}", shared.display, file.name), bytes.to_vec())?.into_iter().map(|b| (b, i > 0)));
            }
        }
        Ok(out)
    }
}

impl RestoredState {
    /// The records that were in flight towards subtask `subtask` of stage
    /// `stage` when an unaligned checkpoint was taken, each with the stage
    /// input it was on, for the current parallelism. Each input is
    /// re-partitioned by its edge: keyed records go to the subtask that now
    /// owns their key group; unkeyed records on a forward edge go from old
    /// subtask s to s mod the parallelism (any subtask may process them);
    /// a broadcast's copies only restore at the parallelism they were
    /// taken at, since each subtask had processed a prefix of its own.
    pub async fn in_flight_batches(&self, plan: &JobPlan, stage: usize, subtask: u32) -> Result<InFlight> {
        let Some(stage_plan) = plan.stages.get(stage) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (k, input) in stage_plan.inputs.iter().enumerate() {
            let id = crate::plan::channel_state_id(stage, k);
            let batches = self.in_flight_of_input(&id, (stage, input), plan, subtask).await?;
            out.extend(batches.into_iter().map(|b| (k, b)));
        }
        Ok(out)
    }

    async fn in_flight_of_input(&self, id: &str, (stage, input): (usize, &StageInput), plan: &JobPlan, subtask: u32) -> Result<Vec<RecordBatch>> {
        let (p, max_p) = (plan.spec.parallelism, plan.spec.max_parallelism);
        let bad = |message: String| Error::BadCheckpoint { location: self.location.display.clone(), message };
        let batches: Vec<RecordBatch> = match (&input.keys, &input.edge) {
            (Some(_), _) => self.keyed_batches(id, subtask, p).await?.into_iter().map(|(b, _)| b).collect(),
            (None, EdgeKind::Broadcast) if self.meta.parallelism != p && self.meta.operators.contains_key(id) => {
                return Err(bad(format!(
                    "it holds records in flight on a broadcast edge (`{id}`), which restore only at the parallelism they were taken at ({}), not at {p}: restore at parallelism {} or from a savepoint (savepoints hold no records in flight)",
                    self.meta.parallelism, self.meta.parallelism
                )));
            }
            (None, _) => self.state_batches_of_old_subtasks(id, |old| old % p == subtask).await?,
        };
        let mut out = Vec::new();
        for batch in batches {
            // Checkpoints taken before edges had names come from chains,
            // whose every stage reads one hash input: those restore into
            // such an input only.
            let edge = batch.schema().metadata().get(IN_FLIGHT_EDGE).cloned();
            let fits_edge = match &edge {
                Some(edge) => *edge == input.edge_id,
                None => matches!(input.edge, EdgeKind::Hash { .. }) && plan.stages.get(stage).is_some_and(|s| s.inputs.len() == 1),
            };
            if !fits_edge {
                let was = edge.map_or_else(|| "an edge of a chain".to_string(), |e| format!("the edge `{e}`"));
                return Err(bad(format!(
                    "it holds records in flight towards stage {stage} (`{id}`) on {was}, but that input of stage {stage} of this pipeline is the edge `{}`: restore it into the pipeline it was taken with, or from a savepoint (savepoints hold no records in flight)",
                    input.edge_id
                )));
            }
            let expected = &input.schema;
            let fits = batch.schema().fields().len() == expected.fields().len()
                && batch.schema().fields().iter().zip(expected.fields().iter()).all(|(a, b)| a.data_type() == b.data_type());
            if !fits {
                return Err(bad(format!(
                    "it holds records in flight (`{id}`) of another shape than the pipeline's stage now takes on that input: restore it into the pipeline it was taken with, or from a savepoint (savepoints hold no records in flight)"
                )));
            }
            match &input.keys {
                Some(keys) => {
                    let partitioner = Partitioner::new(keys.clone(), p, max_p);
                    out.extend(partitioner.split(&batch)?.into_iter().filter(|(t, _)| *t == subtask as usize).map(|(_, b)| b));
                }
                None => out.push(batch),
            }
        }
        Ok(out)
    }

    /// The batches of state `op` written by the old subtasks `mine` picks.
    async fn state_batches_of_old_subtasks(&self, op: &str, mine: impl Fn(u32) -> bool) -> Result<Vec<RecordBatch>> {
        let mut out = Vec::new();
        for s in self.meta.operators.get(op).into_iter().flatten().filter(|s| mine(s.subtask)) {
            if let Some(file) = &s.file {
                let bytes = self.location.read_state_file(file).await?;
                out.extend(decode_state(&format!("{}/{}", self.location.display, file.name), bytes.to_vec())?);
            }
        }
        Ok(out)
    }
}

/// The in-progress files of the output kept under state id `output` (the
/// sink's, or a window's late records') that some snapshot may still
/// commit: the pending files of every complete checkpoint and savepoint in
/// `storage`, and of `restored` (which may live elsewhere). A snapshot
/// whose metadata cannot be read is not restorable and keeps nothing.
pub async fn referenced_sink_files(storage: &CheckpointStorage, restored: Option<&RestoredState>, output: &str) -> Result<HashSet<String>> {
    let mut keep = HashSet::new();
    let mut add = |meta: &CheckpointMetadata| {
        for s in meta.operators.get(output).into_iter().flatten() {
            if let Some(Ok(state)) = s.inline.as_ref().map(|v| serde_json::from_value::<SinkState>(v.clone())) {
                keep.extend(state.referenced());
            }
        }
    };
    if let Some(r) = restored {
        add(&r.meta);
    }
    for (_, meta) in storage.list_with_metadata().await? {
        if let Some(meta) = meta {
            add(&meta);
        }
    }
    Ok(keep)
}

pub fn encode_state(batch: &RecordBatch) -> Result<Vec<u8>> {
    // Sized for the batch up front: growing by doubling would copy tens of
    // megabytes several times for a large state.
    let capacity = batch.get_array_memory_size() + 64 * 1024;
    let mut w = FileWriter::try_new(Vec::with_capacity(capacity), &batch.schema()).map_err(Error::arrow("encoding state"))?;
    w.write(batch).map_err(Error::arrow("encoding state"))?;
    w.finish().map_err(Error::arrow("encoding state"))?;
    w.into_inner().map_err(Error::arrow("encoding state"))
}

pub fn decode_state(location: &str, bytes: Vec<u8>) -> Result<Vec<RecordBatch>> {
    let bad = |e: arrow::error::ArrowError| Error::BadCheckpoint { location: location.into(), message: format!("state file cannot be decoded: {e}") };
    let reader = FileReader::try_new(Cursor::new(bytes), None).map_err(bad)?;
    reader.collect::<Result<Vec<_>, _>>().map_err(bad)
}
