//! Checkpoints: what is in one (metadata), where it is kept (storage), and
//! who decides when one is taken and complete (the coordinator).

pub mod coordinator;
pub mod lineage;
pub mod metadata;
pub mod s3;
pub mod savepoints;
pub mod state_file_writer;
pub mod storage;
pub(crate) mod stores;

pub use metadata::{now_unix_ms, CheckpointMetadata, OperatorSubtaskState, SnapshotKind, StateFile, SubtaskAck};
pub use lineage::RunClaim;
pub use savepoints::SavepointBook;
pub use state_file_writer::StateFileWriter;
pub use storage::{CheckpointStorage, Disposal, Location};
