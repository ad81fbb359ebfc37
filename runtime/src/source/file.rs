//! JSON lines from a file, or from every regular file of a directory (in name
//! order, names beginning with `.` skipped). Each file is a split; its
//! position is a byte offset, so a restored job resumes at the first line not
//! yet covered by the checkpoint. Files are expected not to change while the
//! job reads them; they may grow between runs (appended lines are read on
//! restore), but a file replaced or rewritten after a checkpoint is refused on
//! restore, since its byte offset would point into other lines.
//!
//! Decoding is strict (see `json.rs`): a line that is not exactly one JSON
//! object of the schema's fields and types is a bad line, which fails the job
//! or, with `bad_lines: skip`, is left out, logged and counted.
//!
//! A split's position also keeps its line number (so that errors after a
//! restore name the right line without reading the file from the start), the
//! lines it skipped, and a fingerprint of the bytes read (see [`FileMark`]).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use serde::{Deserialize, Serialize};
use weir_api::{BadLines, FileSourceSpec};

use super::json::LineDecoder;
use super::{Poll, SourcePositions};
use crate::error::{Error, Result};

/// How many bytes of a file's start, and of the bytes before a split's offset,
/// the fingerprint covers.
const FINGERPRINT_WINDOW: usize = 4096;

/// What a checkpoint keeps of a file split besides its byte offset.
///
/// The fingerprint is content only (CRC-32 of the file's first bytes and of
/// the bytes just before the offset), not inode or modification time, so that
/// a checkpoint restores on another machine or after the input was copied.
/// It tells a file that was appended to (same bytes before the offset) from
/// one that was replaced, truncated or rewritten; a rewrite that keeps both
/// windows byte for byte is not detected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileMark {
    /// Lines before the offset, blank ones included: the next line read is line `line + 1`.
    pub line: u64,
    /// Bad lines before the offset that `bad_lines: skip` left out.
    pub skipped: u64,
    pub head_len: u32,
    pub head_crc: u32,
    pub tail_len: u32,
    pub tail_crc: u32,
}

/// The bytes a fingerprint is computed over, kept while a split is read.
#[derive(Default)]
struct Window {
    head: Vec<u8>,
    /// The last bytes read; between one and two windows long, trimmed in bulk.
    tail: Vec<u8>,
}

impl Window {
    fn push(&mut self, bytes: &[u8]) {
        if self.head.len() < FINGERPRINT_WINDOW {
            let n = (FINGERPRINT_WINDOW - self.head.len()).min(bytes.len());
            self.head.extend_from_slice(&bytes[..n]);
        }
        if bytes.len() >= FINGERPRINT_WINDOW {
            self.tail.clear();
            self.tail.extend_from_slice(&bytes[bytes.len() - FINGERPRINT_WINDOW..]);
            return;
        }
        self.tail.extend_from_slice(bytes);
        if self.tail.len() > 2 * FINGERPRINT_WINDOW {
            self.tail.drain(..self.tail.len() - FINGERPRINT_WINDOW);
        }
    }

    /// The fingerprint fields of a mark (`line` and `skipped` are the split's).
    fn mark(&self, line: u64, skipped: u64) -> FileMark {
        let tail = &self.tail[self.tail.len().saturating_sub(FINGERPRINT_WINDOW)..];
        FileMark {
            line,
            skipped,
            head_len: self.head.len() as u32,
            head_crc: crc32fast::hash(&self.head),
            tail_len: tail.len() as u32,
            tail_crc: crc32fast::hash(tail),
        }
    }

    /// Reads the window of the file at `path` for a position at `offset`.
    fn read(path: &Path, file: &mut File, offset: u64) -> Result<Window> {
        let err = |e: std::io::Error| Error::SourceFile { path: path.into(), message: format!("cannot read: {e}") };
        let len = file.metadata().map_err(err)?.len();
        if len < offset {
            return Err(Error::SourceFile {
                path: path.into(),
                message: format!(
                    "the file has {len} bytes but the checkpoint read it up to byte {offset}: it was truncated or replaced after the checkpoint. {}",
                    REPLACED_ADVICE
                ),
            });
        }
        let n = (FINGERPRINT_WINDOW as u64).min(offset) as usize;
        let mut head = vec![0; n];
        file.seek(SeekFrom::Start(0)).and_then(|_| file.read_exact(&mut head)).map_err(err)?;
        let mut tail = vec![0; n];
        file.seek(SeekFrom::Start(offset - n as u64)).and_then(|_| file.read_exact(&mut tail)).map_err(err)?;
        Ok(Window { head, tail })
    }
}

const REPLACED_ADVICE: &str = "Resuming at the checkpoint's byte offset would skip or repeat records. Put the file the checkpoint read back, \
     or run the job without restoring this checkpoint (start it fresh, or restore another checkpoint)";

/// Counts the newlines in the first `offset` bytes: the line number of a
/// position restored from a checkpoint that did not keep it.
fn count_lines(path: &Path, file: &mut File, offset: u64) -> Result<u64> {
    let err = |e: std::io::Error| Error::SourceFile { path: path.into(), message: format!("cannot read: {e}") };
    file.seek(SeekFrom::Start(0)).map_err(err)?;
    let mut limited = BufReader::with_capacity(1 << 16, Read::take(&mut *file, offset));
    let mut lines = 0;
    loop {
        let buf = limited.fill_buf().map_err(err)?;
        if buf.is_empty() {
            return Ok(lines);
        }
        lines += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        let n = buf.len();
        limited.consume(n);
    }
}

struct Split {
    id: String,
    path: PathBuf,
    /// Byte offset of the first line not yet read.
    offset: u64,
    /// The split's mark at `offset` while it is not being read (restored,
    /// verified, or computed when its end was reached).
    mark: FileMark,
    /// While the split is read: the bytes its mark will be computed over.
    window: Option<Window>,
    done: bool,
}

impl Split {
    fn mark(&self) -> FileMark {
        match &self.window {
            Some(w) => w.mark(self.mark.line, self.mark.skipped),
            None => self.mark,
        }
    }

    /// `file` at the split's offset is the file the position was taken on.
    fn verify(&self, file: &mut File, expected: Option<&FileMark>) -> Result<Window> {
        let window = Window::read(&self.path, file, self.offset)?;
        if let Some(expected) = expected {
            let found = window.mark(expected.line, expected.skipped);
            let differs = if found.head_len != expected.head_len || found.head_crc != expected.head_crc {
                Some(format!("its first {} bytes differ", expected.head_len))
            } else if found.tail_len != expected.tail_len || found.tail_crc != expected.tail_crc {
                Some(format!("the {} bytes before byte {} differ", expected.tail_len, self.offset))
            } else {
                None
            };
            if let Some(differs) = differs {
                return Err(Error::SourceFile {
                    path: self.path.clone(),
                    message: format!(
                        "this is not the file the checkpoint read ({differs}): it was replaced or rewritten after the checkpoint. {REPLACED_ADVICE}"
                    ),
                });
            }
        }
        Ok(window)
    }
}

/// Logs skipped lines: each of the first few, then at most one line every
/// few seconds with how many were skipped meanwhile.
pub(super) struct SkipLog {
    logged: u64,
    last: Option<Instant>,
    unlogged: u64,
}

impl SkipLog {
    const FIRST: u64 = 10;
    const EVERY: Duration = Duration::from_secs(5);

    pub(super) fn new() -> SkipLog {
        SkipLog { logged: 0, last: None, unlogged: 0 }
    }

    /// Logs a skipped line of `origin` (a file's path, a socket's address),
    /// the first ten and then one per five seconds.
    pub(super) fn skipped(&mut self, origin: &dyn std::fmt::Display, line: u64, message: &str) {
        let now = Instant::now();
        if self.logged < Self::FIRST || self.last.is_none_or(|t| now.duration_since(t) >= Self::EVERY) {
            tracing::warn!(
                source = %origin,
                line,
                skipped_without_message = self.unlogged,
                "bad line skipped (bad_lines: skip): {origin}:{line}: {message}"
            );
            self.logged += 1;
            self.last = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
    }
}

pub struct FileReader {
    splits: Vec<Split>,
    current: Option<(usize, BufReader<File>)>,
    decoder: LineDecoder,
    schema: SchemaRef,
    batch_size: usize,
    bad_lines: BadLines,
    /// The line being read (reused).
    line: Vec<u8>,
    /// The split the last batch came from.
    last: usize,
    /// Skipped lines not yet taken by [`FileReader::take_skipped`]; starts
    /// with those of the restored positions.
    unreported_skipped: u64,
    skip_log: SkipLog,
}

fn list_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::SourceFile { path: path.into(), message: format!("cannot read: {e}") })?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    let entries = std::fs::read_dir(path).map_err(|e| Error::SourceFile { path: path.into(), message: format!("cannot list: {e}") })?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::SourceFile { path: path.into(), message: e.to_string() })?;
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| Error::SourceFile { path: path.into(), message: format!("cannot open: {e}") })
}

impl FileReader {
    /// Opens the splits `subtask` owns at the restored `positions`, and
    /// refuses (fatally) a file that is not the one the checkpoint read.
    pub fn new(
        spec: &FileSourceSpec,
        schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        positions: &SourcePositions,
        base_dir: &Path,
    ) -> Result<Self> {
        let root = base_dir.join(&spec.path);
        let files = list_files(&root)?;
        let mut splits = Vec::new();
        let mut unreported_skipped = 0;
        for (i, path) in files.into_iter().enumerate() {
            if i as u32 % parallelism != subtask {
                continue;
            }
            let id = format!("file:{}", path.strip_prefix(&root).unwrap_or(&path).display());
            let offset = positions.splits.get(&id).copied().unwrap_or(0);
            let restored = positions.files.get(&id);
            let mut split = Split { id, path, offset, mark: restored.copied().unwrap_or_default(), window: None, done: false };
            if offset > 0 {
                let mut file = open(&split.path)?;
                let window = split.verify(&mut file, restored)?;
                if restored.is_none() {
                    // A checkpoint from before marks were kept: nothing to
                    // compare, but the line number can be recovered.
                    tracing::warn!(file = %split.path.display(), offset, "the checkpoint has no fingerprint of this file; it is resumed unchecked");
                    split.mark = window.mark(count_lines(&split.path, &mut file, offset)?, 0);
                }
            }
            unreported_skipped += split.mark.skipped;
            splits.push(split);
        }
        Ok(FileReader {
            splits,
            current: None,
            decoder: LineDecoder::new(&schema)?,
            schema,
            batch_size: spec.batch_size.max(1) as usize,
            bad_lines: spec.bad_lines,
            line: Vec::new(),
            unreported_skipped,
            skip_log: SkipLog::new(),
            last: 0,
        })
    }

    fn start(&mut self, i: usize) -> Result<()> {
        let split = &mut self.splits[i];
        let mut file = open(&split.path)?;
        let window = if split.offset > 0 {
            let mark = split.mark;
            split.verify(&mut file, Some(&mark))?
        } else {
            Window::default()
        };
        file.seek(SeekFrom::Start(split.offset)).map_err(|e| Error::SourceFile { path: split.path.clone(), message: e.to_string() })?;
        split.window = Some(window);
        self.current = Some((i, BufReader::with_capacity(1 << 16, file)));
        Ok(())
    }

    pub fn poll(&mut self) -> Result<Poll> {
        loop {
            if self.current.is_none() {
                let Some(i) = self.splits.iter().position(|s| !s.done) else { return Ok(Poll::Finished) };
                self.start(i)?;
            }
            let FileReader { splits, current, decoder, schema, batch_size, bad_lines, line, unreported_skipped, skip_log, last } = self;
            let Some((i, reader)) = current.as_mut() else { continue };
            let idx = *i;
            let split = &mut splits[*i];
            while decoder.rows() < *batch_size {
                line.clear();
                let n = reader.read_until(b'\n', line).map_err(|e| Error::SourceFile { path: split.path.clone(), message: e.to_string() })?;
                if n == 0 {
                    split.mark = split.mark();
                    split.window = None;
                    split.done = true;
                    *current = None;
                    break;
                }
                split.offset += n as u64;
                split.mark.line += 1;
                if let Some(w) = &mut split.window {
                    w.push(line);
                }
                if line.iter().all(|b| b.is_ascii_whitespace()) {
                    continue;
                }
                if let Err(bad) = decoder.push_line(line) {
                    let number = split.mark.line;
                    match bad_lines {
                        BadLines::Fail => {
                            return Err(Error::SourceFile {
                                path: split.path.clone(),
                                message: format!(
                                    "line {number}, column {}: {} (the source's `bad_lines: skip` would leave such lines out and count them)",
                                    bad.column, bad.message
                                ),
                            })
                        }
                        BadLines::Skip => {
                            split.mark.skipped += 1;
                            *unreported_skipped += 1;
                            skip_log.skipped(&split.path.display(), number, &format!("column {}: {}", bad.column, bad.message));
                        }
                    }
                }
            }
            if decoder.rows() > 0 {
                *last = idx;
                return Ok(Poll::Batch(decoder.finish(schema)?));
            }
        }
    }

    /// Bad lines skipped since the last call (at first: with those the
    /// restored positions counted).
    pub fn take_skipped(&mut self) -> u64 {
        std::mem::take(&mut self.unreported_skipped)
    }

    pub fn last_split(&self) -> String {
        self.splits.get(self.last).map(|s| s.id.clone()).unwrap_or_default()
    }

    pub fn active_splits(&self) -> Vec<String> {
        self.current.as_ref().map(|(i, _)| vec![self.splits[*i].id.clone()]).unwrap_or_default()
    }

    pub fn positions(&self) -> SourcePositions {
        SourcePositions {
            splits: self.splits.iter().map(|s| (s.id.clone(), s.offset)).collect(),
            // A split not yet read has nothing to check.
            files: self.splits.iter().filter(|s| s.offset > 0).map(|s| (s.id.clone(), s.mark())).collect(),
            skipped: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests;
