//! The file sink in a directory, exactly-once by two-phase commit.
//!
//! Records go to an in-progress file whose name begins with `.`, opened at the
//! first record after a barrier. When it reaches `max_file_bytes` it is
//! synced and closed and the next record opens another. At the barrier the
//! open file is flushed, synced and closed, and every file closed since the
//! last barrier becomes pending on that checkpoint (phase one; the pending list
//! is the sink's checkpointed state). When the checkpoint completes, pending
//! files are renamed to their final names (phase two). Renaming is atomic and
//! idempotent: a file already renamed is skipped, so a commit repeated after a
//! restore does no harm. On restore, the pending files of the restored
//! checkpoint are committed (the checkpoint completed, though the notification
//! may have been lost), and in-progress files that no checkpoint references
//! are deleted: they hold records that will be produced again.
//!
//! Names carry the run id of the attempt that wrote them, so no attempt ever
//! overwrites another's files. With `guarantee: at-least-once` files are
//! committed at the barrier instead, without waiting for the checkpoint.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use serde::{Deserialize, Serialize};
use weir_api::{FileSinkSpec, Guarantee};

use super::{SinkRestore, SinkState};
use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PendingFile {
    pub checkpoint: u64,
    /// In-progress name, relative to the sink's directory.
    pub temp: String,
    /// Final name, relative to the sink's directory.
    #[serde(rename = "final")]
    pub final_name: String,
    /// For `s3://` output: the hidden object holding the whole file, which
    /// committing copies to `final` (`temp` is then the name of the marker
    /// of the upload that wrote it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<String>,
}


struct OpenFile {
    writer: BufWriter<File>,
    temp: String,
    final_name: String,
    bytes: u64,
}

pub struct FileSink {
    dir: PathBuf,
    job: String,
    subtask: u32,
    run_id: String,
    next_file: u64,
    exactly_once: bool,
    max_file_bytes: u64,
    current: Option<OpenFile>,
    /// Files rolled by size since the last barrier: synced and closed,
    /// pending on the next checkpoint.
    closed: Vec<(String, String)>,
    pending: Vec<PendingFile>,
}

const TEMP_PREFIX: &str = ".part-";
const TEMP_SUFFIX: &str = ".inprogress";

impl FileSink {
    pub fn open(spec: &FileSinkSpec, job: &str, subtask: u32, run_id: &str, restore: SinkRestore, base_dir: &Path) -> Result<Self> {
        let dir = base_dir.join(&spec.path);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("file sink: cannot create {}", dir.display())))?;
        let sink = FileSink {
            dir,
            job: job.to_string(),
            subtask,
            run_id: run_id.to_string(),
            next_file: 0,
            exactly_once: spec.guarantee == Guarantee::ExactlyOnce,
            max_file_bytes: spec.max_file_bytes(),
            current: None,
            closed: Vec::new(),
            pending: Vec::new(),
        };
        let pending: Vec<PendingFile> = restore.mine.into_iter().flat_map(|s| s.pending).collect();
        for p in &pending {
            sink.commit_file(p)?;
        }
        if !pending.is_empty() {
            sink.sync_dir()?;
        }
        if let Some(keep) = restore.keep {
            sink.discard_unreferenced(keep, restore.runs)?;
        }
        Ok(sink)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if self.current.is_none() {
            let stem = format!("part-{}.{}-{:03}-{:06}", self.job, self.run_id, self.subtask, self.next_file);
            self.next_file += 1;
            let temp = format!(".{stem}.jsonl{TEMP_SUFFIX}");
            let path = self.path(&temp);
            let f = File::create(&path).map_err(Error::io(format!("file sink: cannot create {}", path.display())))?;
            self.current = Some(OpenFile {
                writer: BufWriter::with_capacity(1 << 16, f),
                temp,
                final_name: format!("{stem}.jsonl"),
                bytes: 0,
            });
        }
        if let Some(c) = &mut self.current {
            let lines = super::encode_jsonl(batch).map_err(Error::arrow(format!("file sink: writing {}", c.temp)))?;
            c.writer.write_all(&lines).map_err(Error::io(format!("file sink: writing {}", c.temp)))?;
            c.bytes += lines.len() as u64;
            if c.bytes >= self.max_file_bytes {
                self.close_current()?;
            }
        }
        Ok(())
    }

    /// Flushes, syncs and closes the current file, which then waits for the next barrier.
    fn close_current(&mut self) -> Result<()> {
        if let Some(c) = self.current.take() {
            let file = c.writer.into_inner().map_err(|e| Error::io(format!("file sink: flushing {}", c.temp))(e.into_error()))?;
            file.sync_data().map_err(Error::io(format!("file sink: syncing {}", c.temp)))?;
            self.closed.push((c.temp, c.final_name));
        }
        Ok(())
    }

    pub fn pre_commit(&mut self, checkpoint_id: u64) -> Result<SinkState> {
        self.close_current()?;
        for (temp, final_name) in std::mem::take(&mut self.closed) {
            let p = PendingFile { checkpoint: checkpoint_id, temp, final_name, staged: None };
            if self.exactly_once {
                self.pending.push(p);
            } else {
                self.commit_file(&p)?;
            }
        }
        Ok(SinkState { pending: self.pending.clone(), ..SinkState::default() })
    }

    pub fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        let (ready, later): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|p| p.checkpoint <= checkpoint_id);
        self.pending = later;
        for p in &ready {
            self.commit_file(p)?;
        }
        if !ready.is_empty() {
            self.sync_dir()?;
        }
        Ok(())
    }

    /// Renames one pending file; already renamed is success, neither name present is data loss.
    fn commit_file(&self, p: &PendingFile) -> Result<()> {
        let (temp, fin) = (self.path(&p.temp), self.path(&p.final_name));
        match std::fs::rename(&temp, &fin) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && fin.exists() => Ok(()),
            // Every later restore of the checkpoint would find the same: fatal.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::LostPendingFile {
                temp: temp.display().to_string(),
                final_name: fin.display().to_string(),
                checkpoint: p.checkpoint,
            }),
            Err(e) => Err(Error::Io {
                context: format!(
                    "file sink: committing {} (checkpoint {}) failed; the file holds records of a completed checkpoint",
                    temp.display(),
                    p.checkpoint
                ),
                source: e,
            }),
        }
    }

    fn sync_dir(&self) -> Result<()> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(Error::io(format!("file sink: syncing directory {}", self.dir.display())))
    }

    /// Deletes in-progress files of this job's earlier attempts that no
    /// retained snapshot references (`keep`: every pending file of every
    /// complete checkpoint and savepoint, and of the one being restored).
    /// Only files named for this job are touched (job names have no `.`, so
    /// the prefix `.part-<job>.` is this job's alone); the current
    /// attempt's files are never touched, and with `runs` only files of
    /// those runs (this state's) are.
    fn discard_unreferenced(&self, keep: &HashSet<String>, runs: Option<&HashSet<String>>) -> Result<()> {
        discard_unreferenced(&self.dir, &self.job, &self.run_id, keep, runs)
    }
}

/// Deletes the in-progress files of job `job` in `dir` that are not of run
/// `run_id` and not in `keep` (see [`FileSink::discard_unreferenced`]).
/// Also called once a job has finished: a checkpoint whose metadata was
/// written just before its run died (so the run restarted from the one
/// before) keeps its files only until retention deletes it.
pub fn discard_unreferenced(dir: &Path, job: &str, run_id: &str, keep: &HashSet<String>, runs: Option<&HashSet<String>>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(Error::io(format!("file sink: listing {}", dir.display())))?;
    let job = format!("{TEMP_PREFIX}{job}.");
    let current = format!("{job}{run_id}-");
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name.strip_prefix(&job).is_some_and(|rest| super::written_by(rest, runs));
        if ours && name.ends_with(TEMP_SUFFIX) && !name.starts_with(&current) && !keep.contains(name.as_str()) {
            tracing::info!(file = %name, "discarding in-progress file of a checkpoint that never completed");
            std::fs::remove_file(entry.path()).map_err(Error::io(format!("file sink: removing {name}")))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn batch(v: Vec<i64>) -> RecordBatch {
        let s = Arc::new(Schema::new(vec![Field::new("seq", DataType::Int64, false)]));
        RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(v))]).unwrap()
    }

    fn spec() -> FileSinkSpec {
        FileSinkSpec { path: "out".into(), format: Default::default(), guarantee: Guarantee::ExactlyOnce, max_file_bytes: None }
    }

    fn visible(dir: &Path) -> Vec<String> {
        let mut lines: Vec<String> = std::fs::read_dir(dir.join("out"))
            .unwrap()
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .flat_map(|e| std::fs::read_to_string(e.path()).unwrap().lines().map(String::from).collect::<Vec<_>>())
            .collect();
        lines.sort();
        lines
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir.join("out"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with('.'))
            .collect();
        names.sort();
        names
    }

    fn fresh(job: &str, run: &str, dir: &Path) -> FileSink {
        FileSink::open(&spec(), job, 0, run, SinkRestore::default(), dir).unwrap()
    }

    #[test]
    fn records_become_visible_only_when_their_checkpoint_completes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = fresh("job", "r1", dir.path());
        s.write(&batch(vec![1, 2])).unwrap();
        s.pre_commit(1).unwrap();
        s.write(&batch(vec![3])).unwrap();
        assert!(visible(dir.path()).is_empty());
        s.commit(1).unwrap();
        assert_eq!(visible(dir.path()), vec![r#"{"seq":1}"#, r#"{"seq":2}"#]);
        s.commit(1).unwrap();
    }

    #[test]
    fn a_restore_commits_the_checkpoints_pending_files_and_drops_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = fresh("job", "r1", dir.path());
        s.write(&batch(vec![1])).unwrap();
        let state = s.pre_commit(1).unwrap();
        s.write(&batch(vec![2])).unwrap();
        s.pre_commit(2).unwrap(); // checkpoint 2 never completes
        s.write(&batch(vec![3])).unwrap();
        drop(s); // the process dies before the commit notification of 1 arrives
        let keep: HashSet<String> = state.pending.iter().map(|p| p.temp.clone()).collect();
        let restored = FileSink::open(&spec(), "job", 0, "r2", SinkRestore { mine: vec![state.clone()], keep: Some(&keep), parallelism: 1, snapshot_log: None, runs: None }, dir.path()).unwrap();
        assert_eq!(visible(dir.path()), vec![r#"{"seq":1}"#]);
        assert!(leftovers(dir.path()).is_empty(), "{:?}", leftovers(dir.path()));
        drop(restored);
        // Restoring the same checkpoint twice is harmless: the commit is idempotent.
        FileSink::open(&spec(), "job", 0, "r3", SinkRestore { mine: vec![state], keep: Some(&keep), parallelism: 1, snapshot_log: None, runs: None }, dir.path()).unwrap();
        assert_eq!(visible(dir.path()), vec![r#"{"seq":1}"#]);
    }

    #[test]
    fn a_fresh_attempt_removes_the_in_progress_files_of_an_attempt_that_crashed_before_any_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = fresh("job", "r1", dir.path());
        s.write(&batch(vec![1])).unwrap();
        drop(s); // crashed before its first checkpoint
        assert_eq!(leftovers(dir.path()).len(), 1);
        let keep = HashSet::new();
        FileSink::open(&spec(), "job", 0, "r2", SinkRestore { mine: vec![], keep: Some(&keep), parallelism: 1, snapshot_log: None, runs: None }, dir.path()).unwrap();
        assert!(leftovers(dir.path()).is_empty(), "{:?}", leftovers(dir.path()));
    }

    #[test]
    fn cleanup_keeps_the_files_another_snapshot_references_and_every_file_of_other_jobs() {
        let dir = tempfile::tempdir().unwrap();
        // Job "a" takes a savepoint (2) after checkpoint 1, then crashes.
        let mut a = fresh("a", "r1", dir.path());
        a.write(&batch(vec![1])).unwrap();
        let c1 = a.pre_commit(1).unwrap();
        a.commit(1).unwrap();
        a.write(&batch(vec![2])).unwrap();
        let sp2 = a.pre_commit(2).unwrap();
        a.write(&batch(vec![3])).unwrap();
        drop(a);
        // Jobs "a-b" and "ab" write to the same directory (names that share a prefix with "a").
        let mut other = fresh("a-b", "r9", dir.path());
        other.write(&batch(vec![7])).unwrap();
        other.pre_commit(5).unwrap();
        let mut third = fresh("ab", "r8", dir.path());
        third.write(&batch(vec![8])).unwrap();
        drop(third);
        let before_other: Vec<String> = leftovers(dir.path()).into_iter().filter(|n| !n.starts_with(".part-a.")).collect();
        // "a" restores checkpoint 1: the savepoint's file must survive, the crashed tail must go.
        let keep: HashSet<String> = c1.pending.iter().chain(sp2.pending.iter()).map(|p| p.temp.clone()).collect();
        FileSink::open(&spec(), "a", 0, "r2", SinkRestore { mine: vec![c1], keep: Some(&keep), parallelism: 1, snapshot_log: None, runs: None }, dir.path()).unwrap();
        let after = leftovers(dir.path());
        let sp_file = &sp2.pending.last().unwrap().temp;
        assert!(after.contains(sp_file), "the savepoint's in-progress file was deleted: {after:?}");
        assert_eq!(after.iter().filter(|n| n.starts_with(".part-a.")).count(), 1, "{after:?}");
        let after_other: Vec<String> = after.into_iter().filter(|n| !n.starts_with(".part-a.")).collect();
        assert_eq!(after_other, before_other, "files of other jobs were touched");
        // The savepoint is still restorable: its pending file commits.
        let keep2: HashSet<String> = sp2.pending.iter().map(|p| p.temp.clone()).collect();
        FileSink::open(&spec(), "a", 0, "r3", SinkRestore { mine: vec![sp2], keep: Some(&keep2), parallelism: 1, snapshot_log: None, runs: None }, dir.path()).unwrap();
        assert!(visible(dir.path()).contains(&r#"{"seq":2}"#.to_string()));
    }

    #[test]
    fn cleanup_touches_only_files_of_the_runs_of_its_own_state() {
        // Two states of one job id share the directory: r1 is this state's
        // run that crashed, t1 the other state's run with a pending file of
        // a checkpoint it completed.
        let dir = tempfile::tempdir().unwrap();
        let mut mine = fresh("job", "r1", dir.path());
        mine.write(&batch(vec![1])).unwrap();
        drop(mine);
        let mut twin = fresh("job", "t1", dir.path());
        twin.write(&batch(vec![2])).unwrap();
        let twins = twin.pre_commit(1).unwrap();
        drop(twin);
        let runs: HashSet<String> = ["r1".to_string(), "r2".to_string()].into();
        let keep = HashSet::new();
        FileSink::open(&spec(), "job", 0, "r2", SinkRestore { mine: vec![], keep: Some(&keep), runs: Some(&runs), parallelism: 1, snapshot_log: None }, dir.path()).unwrap();
        assert_eq!(leftovers(dir.path()), vec![twins.pending[0].temp.clone()]);
    }

    #[test]
    fn files_roll_at_max_file_bytes_and_all_wait_for_their_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        // Each line `{"seq":N}\n` is 10 bytes: two lines fill a file of 20.
        let spec = FileSinkSpec { max_file_bytes: Some(20), ..spec() };
        let mut s = FileSink::open(&spec, "job", 0, "r1", SinkRestore::default(), dir.path()).unwrap();
        for i in 0..5 {
            s.write(&batch(vec![i])).unwrap();
        }
        let state = s.pre_commit(1).unwrap();
        assert_eq!(state.pending.len(), 3, "{state:?}");
        assert!(visible(dir.path()).is_empty(), "a rolled file became visible before its checkpoint completed");
        s.commit(1).unwrap();
        assert_eq!(visible(dir.path()).len(), 5);
        let files = std::fs::read_dir(dir.path().join("out")).unwrap().flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count();
        assert_eq!(files, 3);
    }

    #[test]
    fn a_pending_file_gone_under_both_names_is_a_fatal_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = fresh("job", "r1", dir.path());
        s.write(&batch(vec![1])).unwrap();
        let state = s.pre_commit(1).unwrap();
        std::fs::remove_file(dir.path().join("out").join(&state.pending[0].temp)).unwrap();
        let err = s.commit(1).unwrap_err();
        assert!(err.is_fatal(), "{err}");
        assert!(err.to_string().contains(&state.pending[0].temp) && err.to_string().contains("checkpoint 1"), "{err}");
    }
}
