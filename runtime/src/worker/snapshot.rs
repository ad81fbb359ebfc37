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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow::array::RecordBatch;
use tokio::sync::{mpsc, oneshot};

use super::protocol::ToCoordinator;
use super::subtask::Notification;
use super::restore::encode_state;
use crate::checkpoint::storage::Location;
use crate::checkpoint::{OperatorSubtaskState, StateFile, SubtaskAck};
use crate::error::{Error, Result};
use crate::operator::StateCopy;

/// Incremental checkpoints: per stateful operator of the subtask, the
/// chain of shared state files its next checkpoint builds on.
///
/// A chain moves only with a completed checkpoint: a snapshot builds on the
/// chain of the newest completion the subtask heard of (`confirmed`), and
/// the chain it wrote is only proposed until its checkpoint completes. So a
/// snapshot never names the file of a checkpoint that was abandoned (which
/// retention deletes) or of a write still in progress, and the changes of
/// a checkpoint that did not complete go into the next file again. (The
/// coordinator refuses a checkpoint naming a file retention no longer
/// keeps, for a subtask that had not yet heard of a newer completion.)
#[derive(Clone)]
pub struct Incremental {
    run_id: String,
    book: Arc<std::sync::Mutex<ChainBook>>,
}

#[derive(Default)]
struct ChainBook {
    confirmed: HashMap<String, Chain>,
    /// The chains written by checkpoints not yet completed, by id.
    proposed: BTreeMap<u64, HashMap<String, Chain>>,
}

impl Incremental {
    pub fn new(run_id: &str) -> Incremental {
        Incremental { run_id: run_id.to_string(), book: Default::default() }
    }

    fn book(&self) -> std::sync::MutexGuard<'_, ChainBook> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The chain of `op` as the newest completed checkpoint left it.
    pub(super) fn confirmed(&self, op: &str) -> Chain {
        self.book().confirmed.get(op).cloned().unwrap_or_default()
    }

    fn propose(&self, checkpoint_id: u64, chains: HashMap<String, Chain>) {
        self.book().proposed.insert(checkpoint_id, chains);
    }

    /// A completed checkpoint confirms the chains it wrote (a savepoint
    /// wrote none); those of older checkpoints will never complete.
    pub(super) fn on_notification(&self, n: &Notification) {
        let mut book = self.book();
        match *n {
            Notification::Complete(id) => {
                if let Some(chains) = book.proposed.remove(&id) {
                    book.confirmed.extend(chains);
                }
                book.proposed.retain(|k, _| *k > id);
            }
            Notification::Abort(id) => {
                book.proposed.remove(&id);
            }
        }
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

/// The subtask's chains, which an incremental checkpoint proposes to
/// extend, and where their files go.
pub(super) struct Chains {
    pub book: Incremental,
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
    /// With the edge id of each input, to label them.
    pub in_flight: Option<(oneshot::Receiver<super::gate::InFlight>, Vec<String>)>,
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
        if let Some((rx, edges)) = self.in_flight {
            let batches = rx.await.map_err(|_| Error::Job("the records in flight were not recorded".into()))?;
            // One state per stage input: inputs have schemas and edges of
            // their own, and a restore re-partitions each by its edge.
            let mut per_input: std::collections::BTreeMap<usize, Vec<RecordBatch>> = Default::default();
            for (input, batch) in batches {
                per_input.entry(input).or_default().push(batch);
            }
            for (input, batches) in per_input {
                // Labelled with their edge, so that a restore into a
                // pipeline whose stage `stage` reads something else refuses
                // them rather than feeding them into the wrong place.
                let first = batches[0].schema();
                let edge = edges.get(input).cloned().unwrap_or_default();
                let metadata = [(crate::plan::IN_FLIGHT_EDGE.to_string(), edge)].into();
                let schema = std::sync::Arc::new(arrow::datatypes::Schema::new_with_metadata(first.fields().clone(), metadata));
                let all = arrow::compute::concat_batches(&schema, &batches).map_err(Error::arrow("records in flight"))?;
                keyed.push((crate::plan::channel_state_id(self.stage, input), StateCopy::ready(all)));
            }
        }
        if let Some(Chains { book, dir }) = self.chains {
            let mut proposed = HashMap::new();
            for Changes { op, copy, full, generation, chain } in self.changes {
                crate::fault::slow_shared_write(id).await;
                let file = dir.put_state_file(&format!("{op}-{index}-{}-chk{id}.arrow", book.run_id), encode(copy).await?).await?;
                let next = chain.then(file, full, generation);
                operators.push((op.clone(), OperatorSubtaskState { subtask: index, inline: None, file: None, shared: next.files.clone() }));
                proposed.insert(op, next);
            }
            // Before the acknowledgement: the completion may follow at once.
            book.propose(id, proposed);
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

