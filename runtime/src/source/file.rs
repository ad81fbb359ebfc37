//! JSON lines from a file, or from every regular file of a directory (in name
//! order, names beginning with `.` skipped). Each file is a split; its
//! position is a byte offset, so a restored job resumes at the first line not
//! yet covered by the checkpoint. Files are expected not to change while the
//! job reads them.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use arrow::datatypes::SchemaRef;
use arrow::json::reader::{Decoder, ReaderBuilder};
use weir_api::FileSourceSpec;

use super::{Poll, SourcePositions};
use crate::error::{Error, Result};

struct Split {
    id: String,
    path: PathBuf,
    offset: u64,
    done: bool,
}

pub struct FileReader {
    splits: Vec<Split>,
    current: Option<(usize, BufReader<File>)>,
    decoder: Decoder,
    schema: SchemaRef,
    batch_size: usize,
    /// The lines of the batch being read, and where each starts in the file.
    lines: Vec<u8>,
    starts: Vec<(u64, usize)>,
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

impl FileReader {
    pub fn new(
        spec: &FileSourceSpec,
        schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        positions: &BTreeMap<String, u64>,
        base_dir: &Path,
    ) -> Result<Self> {
        let root = base_dir.join(&spec.path);
        let files = list_files(&root)?;
        let mut splits = Vec::new();
        for (i, path) in files.into_iter().enumerate() {
            if i as u32 % parallelism != subtask {
                continue;
            }
            let id = format!("file:{}", path.strip_prefix(&root).unwrap_or(&path).display());
            let offset = positions.get(&id).copied().unwrap_or(0);
            splits.push(Split { id, path, offset, done: false });
        }
        let decoder = ReaderBuilder::new(schema.clone())
            .with_batch_size(spec.batch_size as usize)
            .build_decoder()
            .map_err(Error::arrow("file source: schema"))?;
        Ok(FileReader { splits, current: None, decoder, schema, batch_size: spec.batch_size as usize, lines: Vec::new(), starts: Vec::new() })
    }

    pub fn poll(&mut self) -> Result<Poll> {
        loop {
            let (i, reader) = match &mut self.current {
                Some(c) => (c.0, &mut c.1),
                None => {
                    let Some(i) = self.splits.iter().position(|s| !s.done) else { return Ok(Poll::Finished) };
                    let split = &self.splits[i];
                    let mut f = File::open(&split.path).map_err(|e| Error::SourceFile { path: split.path.clone(), message: format!("cannot open: {e}") })?;
                    f.seek(SeekFrom::Start(split.offset)).map_err(|e| Error::SourceFile { path: split.path.clone(), message: e.to_string() })?;
                    self.current = Some((i, BufReader::with_capacity(1 << 16, f)));
                    continue;
                }
            };
            self.lines.clear();
            self.starts.clear();
            while self.starts.len() < self.batch_size {
                let split = &mut self.splits[i];
                let before = self.lines.len();
                let n = reader
                    .read_until(b'\n', &mut self.lines)
                    .map_err(|e| Error::SourceFile { path: split.path.clone(), message: e.to_string() })?;
                if n == 0 {
                    split.done = true;
                    break;
                }
                let start = split.offset;
                split.offset += n as u64;
                if self.lines[before..].iter().all(|b| b.is_ascii_whitespace()) {
                    self.lines.truncate(before);
                    continue;
                }
                if self.lines.last() != Some(&b'\n') {
                    self.lines.push(b'\n');
                }
                self.starts.push((start, before));
            }
            let split = &self.splits[i];
            let done = split.done;
            let decoded = self.decoder.decode(&self.lines).and_then(|_| self.decoder.flush());
            let batch = match decoded {
                Ok(b) => b,
                Err(e) => return Err(self.locate_bad_line(i, e)),
            };
            if done {
                self.current = None;
            }
            if let Some(b) = batch {
                if b.num_rows() > 0 {
                    return Ok(Poll::Batch(b));
                }
            }
        }
    }

    /// Finds which line of the failed batch is bad, to name its byte offset.
    fn locate_bad_line(&self, split: usize, batch_error: arrow::error::ArrowError) -> Error {
        let path = self.splits[split].path.clone();
        for (k, &(offset, at)) in self.starts.iter().enumerate() {
            let end = self.starts.get(k + 1).map(|&(_, next)| next).unwrap_or(self.lines.len());
            let Ok(mut one) = ReaderBuilder::new(self.schema.clone()).build_decoder() else { break };
            if let Err(e) = one.decode(&self.lines[at..end]).and_then(|_| one.flush()) {
                return Error::SourceFile { path, message: format!("line at byte {offset}: {e}") };
            }
        }
        Error::SourceFile { path, message: batch_error.to_string() }
    }

    pub fn positions(&self) -> SourcePositions {
        SourcePositions { splits: self.splits.iter().map(|s| (s.id.clone(), s.offset)).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    use weir_api::pipeline::{FieldType, SourceSpec};
    use weir_api::pipeline::source::Schema;

    fn spec(path: &str) -> FileSourceSpec {
        FileSourceSpec { path: path.into(), schema: Schema(vec![("n".into(), FieldType::Int64), ("s".into(), FieldType::String)]), batch_size: 2 }
    }

    fn values(r: &mut FileReader) -> Vec<i64> {
        let mut out = Vec::new();
        while let Poll::Batch(b) = r.poll().unwrap() {
            out.extend(b.column(0).as_primitive::<Int64Type>().values().iter());
        }
        out
    }

    #[test]
    fn resumes_at_the_byte_offset_of_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.jsonl"), "{\"n\":1,\"s\":\"x\"}\n{\"n\":2}\n\n{\"n\":3,\"s\":\"y\"}\n{\"n\":4}").unwrap();
        let sp = spec("a.jsonl");
        let schema = crate::plan::source_schema(&SourceSpec::File(sp.clone()));
        let mut r = FileReader::new(&sp, schema.clone(), 0, 1, &BTreeMap::new(), dir.path()).unwrap();
        let Poll::Batch(b) = r.poll().unwrap() else { panic!() };
        assert_eq!(b.num_rows(), 2);
        let pos = r.positions();
        let mut again = FileReader::new(&sp, schema, 0, 1, &pos.splits, dir.path()).unwrap();
        assert_eq!(values(&mut again), vec![3, 4]);
    }

    #[test]
    fn a_bad_line_names_the_file_and_byte() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.jsonl"), "{\"n\":1}\n{\"n\":\"not a number\"}\n").unwrap();
        let sp = spec("a.jsonl");
        let schema = crate::plan::source_schema(&SourceSpec::File(sp.clone()));
        let mut r = FileReader::new(&sp, schema, 0, 1, &BTreeMap::new(), dir.path()).unwrap();
        let err = r.poll().unwrap_err().to_string();
        assert!(err.contains("a.jsonl") && err.contains("byte 8"), "{err}");
    }
}
