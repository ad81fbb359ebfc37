//! Moving records between subtasks: messages, the hash partitioner, and the
//! TCP frames used when two subtasks live in different processes.
//!
//! Every input of a subtask is a bounded channel of [`Message`]s whatever the
//! distance: a local upstream sends into it directly, a remote one through a
//! TCP connection of its own whose reader feeds it. A full channel stops the
//! reader, TCP flow control stops the remote writer, and the writer's full
//! channel stops the upstream subtask: backpressure reaches the sources.
//! One connection per (upstream, downstream) pair keeps a blocked input (during
//! barrier alignment) from stalling the others.

pub mod frame;
pub mod partition;

use arrow::array::RecordBatch;
use serde::{Deserialize, Serialize};

/// How many messages a channel buffers before its sender waits.
pub const CHANNEL_CAPACITY: usize = 8;

/// A checkpoint barrier, travelling in-band with the records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Barrier {
    pub checkpoint_id: u64,
    pub savepoint: bool,
    /// The last barrier: every source has ended and sends end-of-stream after it.
    pub is_final: bool,
    /// Where state goes, relative to the job's storage root.
    pub dir: String,
    /// A savepoint that stops the job: a source emits nothing after it
    /// until the next barrier (which only comes if this one was abandoned),
    /// so that no sink opens a transaction or a file after it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stop: bool,
}

#[derive(Debug)]
pub enum Message {
    Batch(RecordBatch),
    Barrier(Barrier),
    /// The upstream subtask will send nothing more.
    End,
    /// Event time: no record older than this (epoch ms) follows from this upstream.
    Watermark(i64),
    /// The upstream has nothing to send for a while: its watermark holds nothing back until it sends another.
    Idle,
}
