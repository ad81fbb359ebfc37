//! Source positions kept per source subtask in a directory of the job's
//! storage (`<dir>/subtask-<i>.json`, the checkpoint's `SourcePositions`
//! format), read back merged: the at-most-once read marks
//! (`read_marks.rs`) and the recorded start positions
//! (`start_positions.rs`), which differ in how they merge.

use crate::checkpoint::Location;
use crate::error::{Error, Result};
use crate::source::SourcePositions;

/// Writes `subtask`'s positions, durably; `what` names them in errors.
pub(super) async fn save(dir: &Location, subtask: u32, positions: &SourcePositions, what: &str) -> Result<()> {
    let bytes = serde_json::to_vec(positions).map_err(|e| Error::Job(format!("encoding {what}: {e}")))?;
    dir.put_durable(&format!("subtask-{subtask}.json"), bytes).await
}

/// Every subtask's positions, folded by `merge`. An object that does not
/// parse is an error naming it, with `unreadable`'s advice, never skipped.
pub(super) async fn load(dir: &Location, merge: fn(&mut SourcePositions, SourcePositions), unreadable: impl Fn(&serde_json::Error) -> String) -> Result<SourcePositions> {
    let mut merged = SourcePositions::default();
    for name in dir.list_objects("").await? {
        if !name.ends_with(".json") {
            continue;
        }
        let Some(bytes) = dir.get(&name).await? else { continue };
        let positions: SourcePositions = serde_json::from_slice(&bytes)
            .map_err(|e| Error::BadCheckpoint { location: format!("{}/{name}", dir.display), message: unreadable(&e) })?;
        merge(&mut merged, positions);
    }
    Ok(merged)
}
