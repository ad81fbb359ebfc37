//! At-most-once: how far the sources have read, recorded before they emit.
//!
//! An at-most-once job takes no checkpoints, so nothing would tell a new run
//! where to resume, and starting over would repeat everything. Instead each
//! source subtask reads a few batches ahead, writes the positions *after*
//! them here (durably), and only then emits them. A new run resumes at the
//! marks: a record is emitted by at most one run, and what was read ahead,
//! in flight or unwritten at a failure is lost. That is the contract.
//!
//! One object per source subtask (`read-marks/subtask-<i>.json`, the
//! checkpoint's `SourcePositions` format; `read-marks-<id>/` for a source of
//! a graph whose state id is not `source`). Positions only grow, so a restore
//! merges every object by taking each split's furthest position: a rescaled
//! run, or a superseded run that writes late, can only move a mark forward
//! (more loss), never back (a repeat).
//!
//! Deliberately does not know checkpoints: an at-most-once run never
//! restores one, and a checkpoint never reads these.

use crate::checkpoint::{CheckpointStorage, Location};
use crate::error::Result;
use crate::source::SourcePositions;

const DIR: &str = "read-marks";

/// The directory of the source with state id `source`.
fn dir(source: &str) -> String {
    if source == "source" { DIR.to_string() } else { format!("{DIR}-{source}") }
}

#[derive(Clone)]
pub struct ReadMarks {
    dir: Location,
    subtask: u32,
}

impl ReadMarks {
    pub fn new(storage: &CheckpointStorage, source: &str, subtask: u32) -> ReadMarks {
        ReadMarks { dir: storage.dir(&dir(source)), subtask }
    }

    /// Records `positions` as read: once this returns, no run reads before them.
    pub async fn save(&self, positions: &SourcePositions) -> Result<()> {
        super::subtask_positions::save(&self.dir, self.subtask, positions, "read marks").await
    }

    /// Every subtask's marks, merged: each split at its furthest position.
    /// A mark that cannot be read is an error naming the object, never a
    /// silent start from the beginning (which would repeat records).
    pub async fn load(storage: &CheckpointStorage, source: &str) -> Result<SourcePositions> {
        super::subtask_positions::load(&storage.dir(&dir(source)), merge, |e| {
            format!("the read marks of an at-most-once job do not parse ({e}); delete the file to resume from the other subtasks' marks, or start without --restore to read from the beginning")
        })
        .await
    }

    /// Forgets every mark: a fresh start reads from the beginning.
    pub async fn clear(storage: &CheckpointStorage, sources: &[String]) -> Result<()> {
        for source in sources {
            storage.dir(&dir(source)).delete_all().await?;
        }
        Ok(())
    }
}

fn merge(into: &mut SourcePositions, marks: SourcePositions) {
    for (split, pos) in marks.splits {
        if into.splits.get(&split).is_some_and(|p| *p >= pos) {
            continue;
        }
        into.splits.insert(split.clone(), pos);
        match marks.files.get(&split) {
            Some(m) => into.files.insert(split.clone(), *m),
            None => into.files.remove(&split),
        };
        match marks.skipped.get(&split) {
            Some(n) => into.skipped.insert(split, *n),
            None => into.skipped.remove(&split),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marks(splits: &[(&str, u64)]) -> SourcePositions {
        SourcePositions { splits: splits.iter().map(|(s, p)| (s.to_string(), *p)).collect(), ..Default::default() }
    }

    #[test]
    fn merged_marks_keep_each_split_at_its_furthest_position() {
        let mut m = SourcePositions::default();
        merge(&mut m, marks(&[("generator-0", 10), ("generator-1", 5)]));
        // An older subtask's object (before a rescale) lags behind.
        merge(&mut m, marks(&[("generator-0", 4), ("generator-2", 7)]));
        merge(&mut m, marks(&[("generator-1", 9)]));
        assert_eq!(m, marks(&[("generator-0", 10), ("generator-1", 9), ("generator-2", 7)]));
    }

    #[tokio::test]
    async fn marks_saved_by_subtasks_load_merged_per_source_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        assert_eq!(ReadMarks::load(&storage, "source").await.unwrap(), SourcePositions::default());
        ReadMarks::new(&storage, "source", 0).save(&marks(&[("generator-0", 3)])).await.unwrap();
        ReadMarks::new(&storage, "source", 1).save(&marks(&[("generator-1", 8)])).await.unwrap();
        ReadMarks::new(&storage, "source", 0).save(&marks(&[("generator-0", 6)])).await.unwrap();
        assert_eq!(ReadMarks::load(&storage, "source").await.unwrap(), marks(&[("generator-0", 6), ("generator-1", 8)]));
        // Two generators of one graph name their splits alike: each keeps its own marks.
        ReadMarks::new(&storage, "b", 0).save(&marks(&[("generator-0", 1)])).await.unwrap();
        assert_eq!(ReadMarks::load(&storage, "b").await.unwrap(), marks(&[("generator-0", 1)]));
        assert_eq!(ReadMarks::load(&storage, "source").await.unwrap(), marks(&[("generator-0", 6), ("generator-1", 8)]));

        storage.dir(DIR).put("subtask-2.json", b"{\"splits\":".to_vec()).await.unwrap();
        let err = ReadMarks::load(&storage, "source").await.unwrap_err().to_string();
        assert!(err.contains("read-marks/subtask-2.json") && err.contains("do not parse"), "{err}");

        ReadMarks::clear(&storage, &["source".into(), "b".into()]).await.unwrap();
        assert_eq!(ReadMarks::load(&storage, "source").await.unwrap(), SourcePositions::default());
        assert_eq!(ReadMarks::load(&storage, "b").await.unwrap(), SourcePositions::default());
    }
}
