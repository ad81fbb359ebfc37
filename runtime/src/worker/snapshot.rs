//! The asynchronous part of a subtask's snapshot: what it copied at the
//! barrier becomes state files, and the checkpoint is acknowledged to the
//! coordinator with their handles, or declined with the reason. Records keep
//! flowing through the subtask meanwhile.
//!
//! Incremental checkpoints keep a chain of shared state files per stateful
//! operator ([`Incremental`]); a checkpoint writes the changes since the
//! chain's last file, or a new full snapshot (see [`Chain::wants_full`]).
//!
//! This module knows state copies, storage and the coordinator's messages;
//! it does not know barriers, alignment, channels or sinks.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use tokio::sync::{mpsc, oneshot};

use super::protocol::ToCoordinator;
use super::restore::encode_state;
use crate::checkpoint::storage::Location;
use crate::checkpoint::{OperatorSubtaskState, StateFile, SubtaskAck};
use crate::error::{Error, Result};
use crate::operator::StateCopy;

/// Incremental checkpoints: per stateful operator of the subtask, the
/// chain of shared state files its next checkpoint builds on. It is locked
/// from a barrier until that checkpoint's files are written, so that every
/// snapshot knows whether the one before it was written: changes of a
/// snapshot whose file was never written go into the next one again. A
/// barrier that finds it still locked takes a whole snapshot outside the
/// chains.
#[derive(Clone)]
pub struct Incremental {
    pub(super) run_id: String,
    pub(super) chains: Arc<tokio::sync::Mutex<HashMap<String, Chain>>>,
}

impl Incremental {
    pub fn new(run_id: &str) -> Incremental {
        Incremental { run_id: run_id.to_string(), chains: Default::default() }
    }
}

#[derive(Clone, Default)]
pub(super) struct Chain {
    /// A full snapshot, then files of changes, oldest first.
    files: Vec<StateFile>,
    /// The generation of changes the last file covers.
    pub(super) covered: Option<u32>,
    base_bytes: u64,
    change_bytes: u64,
}

impl Chain {
    /// At most this many files of changes follow a full snapshot: a restore
    /// reads them all.
    const MAX_CHANGES: usize = 16;

    /// A new full snapshot is due: none yet, too many files of changes, or
    /// changes as big as the full state (then a full one costs no more).
    pub(super) fn wants_full(&self) -> bool {
        self.files.is_empty() || self.files.len() > Self::MAX_CHANGES || self.change_bytes >= self.base_bytes
    }

    /// The chain once `file` (a full snapshot when `full`) is written.
    fn then(self, file: StateFile, full: bool, generation: u32) -> Chain {
        let mut next = if full { Chain { base_bytes: file.size, ..Chain::default() } } else { self };
        if !full {
            next.change_bytes += file.size;
        }
        next.files.push(file);
        next.covered = Some(generation);
        next
    }
}

/// The chains of an incremental checkpoint, locked by its barrier (`None`
/// when they were busy: then nothing is written into them), and where
/// their files go.
pub(super) struct Chains {
    pub guard: Option<tokio::sync::OwnedMutexGuard<HashMap<String, Chain>>>,
    pub run_id: String,
    pub dir: Location,
}

/// One operator's part of an incremental checkpoint: its copy (changes, or
/// the whole state when `full`) and the chain it extends.
pub(super) struct Changes {
    pub op: String,
    pub copy: StateCopy,
    pub full: bool,
    pub generation: u32,
    pub chain: Chain,
}

/// Everything a subtask's snapshot still has to write.
pub(super) struct SnapshotWrite {
    pub checkpoint_id: u64,
    pub stage: usize,
    pub subtask: u32,
    /// The checkpoint's directory.
    pub dir: Location,
    /// States kept in the metadata itself (source positions, sink state).
    pub inline: Vec<(String, OperatorSubtaskState)>,
    /// Whole keyed states, one file each in the checkpoint's directory.
    pub keyed: Vec<(String, StateCopy)>,
    pub changes: Vec<Changes>,
    pub chains: Option<Chains>,
    /// Unaligned: the records in flight, once every input gave its barrier.
    pub in_flight: Option<oneshot::Receiver<Vec<RecordBatch>>>,
    pub to_coordinator: mpsc::UnboundedSender<ToCoordinator>,
}

impl SnapshotWrite {
    /// Writes, then acknowledges (or declines) the checkpoint.
    pub async fn run(self) {
        let (id, stage, subtask, to_coordinator) = (self.checkpoint_id, self.stage, self.subtask, self.to_coordinator.clone());
        match self.write().await {
            Ok(operators) => {
                let _ = to_coordinator.send(ToCoordinator::Ack { checkpoint_id: id, ack: SubtaskAck { stage, subtask, operators } });
                if stage > 0 {
                    // Let the ack leave the process before the crash.
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    crate::fault::crash_point("after-ack", id);
                }
            }
            Err(e) => {
                let _ = to_coordinator.send(ToCoordinator::Decline { checkpoint_id: id, reason: format!("stage {stage} subtask {subtask}: {e}") });
            }
        }
    }

    async fn write(self) -> Result<Vec<(String, OperatorSubtaskState)>> {
        let (id, index) = (self.checkpoint_id, self.subtask);
        let mut operators = self.inline;
        let mut keyed = self.keyed;
        if let Some(rx) = self.in_flight {
            let batches = rx.await.map_err(|_| Error::Job("the records in flight were not recorded".into()))?;
            if let Some(first) = batches.first() {
                let all = arrow::compute::concat_batches(&first.schema(), &batches).map_err(Error::arrow("records in flight"))?;
                keyed.push((crate::plan::channel_state_id(self.stage), StateCopy::ready(all)));
            }
        }
        if let Some(Chains { mut guard, run_id, dir }) = self.chains {
            for Changes { op, copy, full, generation, chain } in self.changes {
                let file = dir.put_state_file(&format!("{op}-{index}-{run_id}-chk{id}.arrow"), encode(copy).await?).await?;
                let next = chain.then(file, full, generation);
                operators.push((op.clone(), OperatorSubtaskState { subtask: index, inline: None, file: None, shared: next.files.clone() }));
                if let Some(guard) = &mut guard {
                    guard.insert(op, next);
                }
            }
        }
        for (op, copy) in keyed {
            let file = self.dir.put_state_file(&format!("{op}-{index}.arrow"), encode(copy).await?).await?;
            operators.push((op, OperatorSubtaskState { subtask: index, inline: None, file: Some(file), shared: Vec::new() }));
        }
        Ok(operators)
    }
}

/// Finishes a state copy and encodes it on a blocking thread: tens of
/// milliseconds of CPU for a million keys that would otherwise hold up a
/// runtime thread, and with it whatever subtask is scheduled there.
async fn encode(copy: StateCopy) -> Result<Vec<u8>> {
    tokio::task::spawn_blocking(move || encode_state(&copy.into_batch()?))
        .await
        .map_err(|e| Error::Job(format!("encoding state: {e}")))?
}

