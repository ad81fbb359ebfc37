//! Where a job's sources first started, for sources whose start depends on
//! the moment (Kafka's `start: latest` or `timestamp` resolve to the end of
//! the topic, or to an offset by time, when the source opens).
//!
//! A run that dies before its first checkpoint leaves nothing in the
//! lineage to restore, and its restart starts fresh: resolving `latest`
//! again there would skip whatever was produced in between, although the
//! first run may have read (and lost) it. So a source that starts fresh
//! records the positions it resolved here (durably) before it emits
//! anything, and a restart of the same history (`--restore latest` that
//! finds no checkpoint; `weir run` restarts this way) starts there. A
//! deliberate fresh start (no `--restore`) forgets them first.
//!
//! One object per source subtask (`source-start/subtask-<i>.json`, the
//! checkpoint's `SourcePositions` format; `source-start-<id>/` for a source
//! of a graph whose state id is not `source`, since two sources may name
//! their splits alike); a restart at another
//! parallelism merges them, taking each split's earliest position.
//! Deliberately does not know checkpoints: once a checkpoint holds the
//! positions, a restore never reads these.

use crate::checkpoint::CheckpointStorage;
use crate::error::Result;
use crate::source::SourcePositions;

const DIR: &str = "source-start";

/// The directory of the source with state id `source`.
fn dir(source: &str) -> String {
    if source == "source" { DIR.to_string() } else { format!("{DIR}-{source}") }
}

/// Records where `subtask`'s splits start: before it emits anything.
pub async fn save(storage: &CheckpointStorage, source: &str, subtask: u32, positions: &SourcePositions) -> Result<()> {
    super::subtask_positions::save(&storage.dir(&dir(source)), subtask, positions, "start positions").await
}

/// Every subtask's recorded start, merged: each split at its earliest
/// position. A record that cannot be read is an error naming it, never a
/// silent new start (which could skip records).
pub async fn load(storage: &CheckpointStorage, source: &str) -> Result<SourcePositions> {
    super::subtask_positions::load(&storage.dir(&dir(source)), merge, |e| {
        format!("the recorded start positions of the job's sources do not parse ({e}); delete the file, or start without --restore to resolve the sources' start again")
    })
    .await
}

/// Forgets the recorded start: a deliberate fresh start resolves it again.
pub async fn clear(storage: &CheckpointStorage, sources: &[String]) -> Result<()> {
    for source in sources {
        storage.dir(&dir(source)).delete_all().await?;
    }
    Ok(())
}

fn merge(into: &mut SourcePositions, start: SourcePositions) {
    for (split, pos) in start.splits {
        let earliest = into.splits.get(&split).map_or(pos, |p| (*p).min(pos));
        into.splits.insert(split, earliest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(splits: &[(&str, u64)]) -> SourcePositions {
        SourcePositions { splits: splits.iter().map(|(s, p)| (s.to_string(), *p)).collect(), ..Default::default() }
    }

    #[tokio::test]
    async fn a_recorded_start_is_read_back_merged_at_each_splits_earliest_and_forgotten_by_clear() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        assert!(load(&storage, "source").await.unwrap().splits.is_empty());
        save(&storage, "source", 0, &positions(&[("kafka:t:0", 7), ("kafka:t:2", 3)])).await.unwrap();
        save(&storage, "source", 1, &positions(&[("kafka:t:1", 9), ("kafka:t:2", 5)])).await.unwrap();
        save(&storage, "other", 0, &positions(&[("kafka:t:0", 1)])).await.unwrap();
        assert_eq!(load(&storage, "source").await.unwrap().splits, positions(&[("kafka:t:0", 7), ("kafka:t:1", 9), ("kafka:t:2", 3)]).splits);
        assert_eq!(load(&storage, "other").await.unwrap().splits, positions(&[("kafka:t:0", 1)]).splits);
        clear(&storage, &["source".into(), "other".into()]).await.unwrap();
        assert!(load(&storage, "source").await.unwrap().splits.is_empty());
        assert!(load(&storage, "other").await.unwrap().splits.is_empty());
    }

    #[tokio::test]
    async fn a_damaged_record_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        storage.dir(DIR).put("subtask-0.json", b"{not json".to_vec()).await.unwrap();
        let e = load(&storage, "source").await.unwrap_err().to_string();
        assert!(e.contains("source-start/subtask-0.json"), "{e}");
    }
}
