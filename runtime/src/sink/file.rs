//! The file sink, exactly-once by two-phase commit.
//!
//! Records go to an in-progress file whose name begins with `.`, opened at the
//! first record after a barrier. At the barrier the file is flushed, synced and
//! closed, and becomes pending on that checkpoint (phase one; the pending list
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
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use arrow::json::LineDelimitedWriter;
use serde::{Deserialize, Serialize};
use weir_api::{FileSinkSpec, Guarantee};

use super::SinkRestore;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PendingFile {
    pub checkpoint: u64,
    /// In-progress name, relative to the sink's directory.
    pub temp: String,
    /// Final name, relative to the sink's directory.
    #[serde(rename = "final")]
    pub final_name: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FileSinkState {
    pub pending: Vec<PendingFile>,
}

struct OpenFile {
    writer: LineDelimitedWriter<BufWriter<File>>,
    temp: String,
    final_name: String,
}

pub struct FileSink {
    dir: PathBuf,
    subtask: u32,
    run_id: String,
    next_file: u64,
    exactly_once: bool,
    current: Option<OpenFile>,
    pending: Vec<PendingFile>,
}

const TEMP_PREFIX: &str = ".part-";
const TEMP_SUFFIX: &str = ".inprogress";

impl FileSink {
    pub fn open(spec: &FileSinkSpec, subtask: u32, run_id: &str, restore: Option<SinkRestore>, base_dir: &Path) -> Result<Self> {
        let dir = base_dir.join(&spec.path);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("file sink: cannot create {}", dir.display())))?;
        let sink = FileSink {
            dir,
            subtask,
            run_id: run_id.to_string(),
            next_file: 0,
            exactly_once: spec.guarantee == Guarantee::ExactlyOnce,
            current: None,
            pending: Vec::new(),
        };
        if let Some(r) = restore {
            let pending: Vec<PendingFile> = r.mine.into_iter().flat_map(|s| s.pending).collect();
            for p in &pending {
                sink.commit_file(p)?;
            }
            sink.sync_dir()?;
            if let Some(all) = r.all {
                sink.discard_unreferenced(all)?;
            }
        }
        Ok(sink)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if self.current.is_none() {
            let stem = format!("part-{}-{:03}-{:06}", self.run_id, self.subtask, self.next_file);
            self.next_file += 1;
            let temp = format!(".{stem}.jsonl{TEMP_SUFFIX}");
            let path = self.path(&temp);
            let f = File::create(&path).map_err(Error::io(format!("file sink: cannot create {}", path.display())))?;
            self.current = Some(OpenFile {
                writer: LineDelimitedWriter::new(BufWriter::with_capacity(1 << 16, f)),
                temp,
                final_name: format!("{stem}.jsonl"),
            });
        }
        if let Some(c) = &mut self.current {
            c.writer.write(batch).map_err(Error::arrow(format!("file sink: writing {}", c.temp)))?;
        }
        Ok(())
    }

    pub fn pre_commit(&mut self, checkpoint_id: u64) -> Result<FileSinkState> {
        if let Some(mut c) = self.current.take() {
            c.writer.finish().map_err(Error::arrow(format!("file sink: finishing {}", c.temp)))?;
            let buf = c.writer.into_inner();
            let file = buf.into_inner().map_err(|e| Error::io(format!("file sink: flushing {}", c.temp))(e.into_error()))?;
            file.sync_data().map_err(Error::io(format!("file sink: syncing {}", c.temp)))?;
            let p = PendingFile { checkpoint: checkpoint_id, temp: c.temp, final_name: c.final_name };
            if self.exactly_once {
                self.pending.push(p);
            } else {
                self.commit_file(&p)?;
            }
        }
        Ok(FileSinkState { pending: self.pending.clone() })
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
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::LostPendingFile { temp, final_name: fin, checkpoint: p.checkpoint }),
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

    /// Deletes in-progress files of earlier attempts that the restored
    /// checkpoint does not reference. Only files with this sink's own naming
    /// pattern are touched; the current attempt's files are never touched.
    fn discard_unreferenced(&self, all: &[FileSinkState]) -> Result<()> {
        let keep: HashSet<&str> = all.iter().flat_map(|s| s.pending.iter().map(|p| p.temp.as_str())).collect();
        let entries = std::fs::read_dir(&self.dir).map_err(Error::io(format!("file sink: listing {}", self.dir.display())))?;
        let mine = format!("{TEMP_PREFIX}{}-", self.run_id);
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with(TEMP_PREFIX) && name.ends_with(TEMP_SUFFIX) && !name.starts_with(&mine) && !keep.contains(name.as_str()) {
                tracing::info!(file = %name, "discarding in-progress file of a checkpoint that never completed");
                std::fs::remove_file(entry.path()).map_err(Error::io(format!("file sink: removing {name}")))?;
            }
        }
        Ok(())
    }
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
        FileSinkSpec { path: "out".into(), format: Default::default(), guarantee: Guarantee::ExactlyOnce }
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

    #[test]
    fn records_become_visible_only_when_their_checkpoint_completes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = FileSink::open(&spec(), 0, "r1", None, dir.path()).unwrap();
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
        let mut s = FileSink::open(&spec(), 0, "r1", None, dir.path()).unwrap();
        s.write(&batch(vec![1])).unwrap();
        let state = s.pre_commit(1).unwrap();
        s.write(&batch(vec![2])).unwrap();
        s.pre_commit(2).unwrap(); // checkpoint 2 never completes
        s.write(&batch(vec![3])).unwrap();
        drop(s); // the process dies before the commit notification of 1 arrives
        let all = vec![state.clone()];
        let restored = FileSink::open(&spec(), 0, "r2", Some(SinkRestore { mine: vec![state.clone()], all: Some(&all) }), dir.path()).unwrap();
        assert_eq!(visible(dir.path()), vec![r#"{"seq":1}"#]);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("out")).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with('.')).collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        drop(restored);
        // Restoring the same checkpoint twice is harmless: the commit is idempotent.
        FileSink::open(&spec(), 0, "r3", Some(SinkRestore { mine: vec![state], all: Some(&all) }), dir.path()).unwrap();
        assert_eq!(visible(dir.path()), vec![r#"{"seq":1}"#]);
    }

    #[test]
    fn a_pending_file_gone_under_both_names_is_a_fatal_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = FileSink::open(&spec(), 0, "r1", None, dir.path()).unwrap();
        s.write(&batch(vec![1])).unwrap();
        let state = s.pre_commit(1).unwrap();
        std::fs::remove_file(dir.path().join("out").join(&state.pending[0].temp)).unwrap();
        let err = s.commit(1).unwrap_err();
        assert!(err.is_fatal(), "{err}");
        assert!(err.to_string().contains(&state.pending[0].temp) && err.to_string().contains("checkpoint 1"), "{err}");
    }
}
