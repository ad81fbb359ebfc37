//! The metadata file of a checkpoint or savepoint: written last, after every
//! subtask's state, so that its presence means the checkpoint is complete.
//!
//! Format: pretty JSON, then a line `crc32:XXXXXXXX` over the JSON bytes. A
//! truncated or altered file fails the checksum and is reported as such, never
//! half-read. State files are listed with their size and CRC-32, checked
//! before they are decoded.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const METADATA_FILE: &str = "_metadata";
const FORMAT: &str = "weir-checkpoint";
const VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    Checkpoint,
    Savepoint,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateFile {
    /// File name inside the checkpoint's directory.
    pub name: String,
    pub size: u64,
    pub crc32: u32,
}

/// The state one subtask kept for one operator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorSubtaskState {
    pub subtask: u32,
    /// Small state kept in the metadata itself (source positions, pending sink files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<serde_json::Value>,
    /// Keyed state in an Arrow IPC file beside the metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<StateFile>,
    /// Keyed state of an incremental checkpoint: files in the job's
    /// `shared/` directory, shared with other checkpoints, a full snapshot
    /// first and then the changes after it, applied in this order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared: Vec<StateFile>,
}

/// A subtask's acknowledgement of a checkpoint: the state of each of its operators.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SubtaskAck {
    pub stage: usize,
    pub subtask: u32,
    pub operators: Vec<(String, OperatorSubtaskState)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    pub format: String,
    pub version: u32,
    pub job: String,
    pub checkpoint_id: u64,
    pub kind: SnapshotKind,
    pub created_unix_ms: u64,
    pub parallelism: u32,
    pub max_parallelism: u32,
    /// Taken after every source had ended: restoring it finishes the job.
    pub is_final: bool,
    /// Operator id -> the state of each subtask that ran it.
    pub operators: BTreeMap<String, Vec<OperatorSubtaskState>>,
}

impl CheckpointMetadata {
    pub fn new(job: &str, checkpoint_id: u64, kind: SnapshotKind, parallelism: u32, max_parallelism: u32, is_final: bool) -> Self {
        CheckpointMetadata {
            format: FORMAT.into(),
            version: VERSION,
            job: job.into(),
            checkpoint_id,
            kind,
            created_unix_ms: now_unix_ms(),
            parallelism,
            max_parallelism,
            is_final,
            operators: BTreeMap::new(),
        }
    }

    pub fn add(&mut self, ack: SubtaskAck) {
        for (op, state) in ack.operators {
            self.operators.entry(op).or_default().push(state);
        }
        for states in self.operators.values_mut() {
            states.sort_by_key(|s| s.subtask);
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(self).unwrap_or_default();
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(format!("\ncrc32:{crc:08x}\n").as_bytes());
        out
    }

    /// Decodes and checks a metadata file; `location` is only used in errors.
    pub fn decode(location: &str, bytes: &[u8]) -> Result<Self> {
        let bad = |message: String| Error::BadCheckpoint { location: location.into(), message };
        let text = std::str::from_utf8(bytes).map_err(|_| bad("the metadata file is not UTF-8 text: it is corrupted".into()))?;
        let trimmed = text.trim_end_matches('\n');
        let (json, crc_line) = trimmed
            .rsplit_once('\n')
            .ok_or_else(|| bad("the metadata file is truncated (no checksum line)".into()))?;
        let expected = crc_line
            .strip_prefix("crc32:")
            .and_then(|h| u32::from_str_radix(h.trim(), 16).ok())
            .ok_or_else(|| bad("the metadata file is truncated or corrupted (its last line is not a checksum)".into()))?;
        let actual = crc32fast::hash(json.as_bytes());
        if actual != expected {
            return Err(bad(format!("the metadata file is corrupted: checksum {actual:08x}, expected {expected:08x}")));
        }
        let meta: CheckpointMetadata = serde_json::from_str(json).map_err(|e| bad(format!("the metadata cannot be read: {e}")))?;
        if meta.format != FORMAT {
            return Err(bad(format!("format `{}` is not {FORMAT}", meta.format)));
        }
        if meta.version != VERSION {
            return Err(bad(format!("format version {} is not supported (this weir reads version {VERSION})", meta.version)));
        }
        Ok(meta)
    }
}

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> CheckpointMetadata {
        let mut m = CheckpointMetadata::new("job", 7, SnapshotKind::Checkpoint, 2, 128, false);
        m.add(SubtaskAck {
            stage: 0,
            subtask: 1,
            operators: vec![("source".into(), OperatorSubtaskState { subtask: 1, inline: Some(serde_json::json!({"a": 1})), file: None, shared: Vec::new() })],
        });
        m
    }

    #[test]
    fn metadata_round_trips() {
        let m = meta();
        assert_eq!(CheckpointMetadata::decode("x", &m.encode()).unwrap(), m);
    }

    #[test]
    fn a_truncated_metadata_file_is_reported_not_half_read() {
        let bytes = meta().encode();
        for cut in [0, 10, bytes.len() / 2, bytes.len() - 5] {
            let err = CheckpointMetadata::decode("chk-7", &bytes[..cut]).unwrap_err().to_string();
            assert!(err.contains("chk-7") && (err.contains("truncated") || err.contains("corrupted")), "{cut}: {err}");
        }
    }

    #[test]
    fn a_flipped_byte_fails_the_checksum() {
        let mut bytes = meta().encode();
        let i = bytes.iter().position(|&b| b == b'7').unwrap();
        bytes[i] = b'8';
        let err = CheckpointMetadata::decode("chk-7", &bytes).unwrap_err().to_string();
        assert!(err.contains("checksum"), "{err}");
    }
}
