//! A state file written while its records arrive: each record batch is
//! encoded (Arrow IPC file format, as [`crate::worker::restore::encode_state`]
//! writes it whole) and handed to a multipart upload as it comes, so a
//! sink's log entry of one checkpoint interval costs a few upload parts of
//! memory instead of the whole interval, and most of its writing is done
//! before the barrier arrives.
//!
//! On local disk the upload is object_store's: parts go into a staging file
//! `<name>#<n>` that `finish` renames to `<name>` and then fsyncs, like
//! [`Location::put_durable`]. A writer dropped unfinished (its job failed,
//! the process died) leaves that staging file, which the sinks' log clean-up
//! already removes as the remains of a cut-off write.

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
use arrow::ipc::writer::FileWriter;
use object_store::{ObjectStoreExt, WriteMultipart};

use super::{Location, StateFile};
use crate::error::{Error, Result};

/// Bytes per upload part: S3's smallest part size.
const PART_SIZE: usize = 5 * 1024 * 1024;
/// Parts in flight at once; the writer waits for one to land before
/// buffering more, so memory stays at about `PART_SIZE * (PARTS_IN_FLIGHT + 1)`.
const PARTS_IN_FLIGHT: usize = 2;

pub struct StateFileWriter {
    location: Location,
    name: String,
    encoder: FileWriter<Vec<u8>>,
    upload: WriteMultipart,
    size: u64,
    crc: crc32fast::Hasher,
}

impl StateFileWriter {
    /// Starts `name` in `location` for batches of `schema`.
    pub async fn start(location: &Location, name: &str, schema: &Schema) -> Result<StateFileWriter> {
        let path = location.object_path(name);
        let context = format!("{}/{name}", location.display);
        let upload = location.store.put_multipart(&path).await.map_err(Error::storage(context))?;
        let encoder = FileWriter::try_new(Vec::new(), schema).map_err(Error::arrow("encoding a state file"))?;
        let mut writer = StateFileWriter {
            location: location.clone(),
            name: name.to_string(),
            encoder,
            upload: WriteMultipart::new_with_chunk_size(upload, PART_SIZE),
            size: 0,
            crc: crc32fast::Hasher::new(),
        };
        writer.hand_over();
        Ok(writer)
    }

    fn context(&self) -> String {
        format!("{}/{}", self.location.display, self.name)
    }

    /// Moves what the encoder has produced into the upload. The encoder
    /// counts the offsets of its blocks itself, so its buffer can be
    /// emptied between batches.
    fn hand_over(&mut self) {
        let bytes = std::mem::take(self.encoder.get_mut());
        self.size += bytes.len() as u64;
        self.crc.update(&bytes);
        self.upload.put(bytes::Bytes::from(bytes));
    }

    /// Appends one batch; waits while too many parts are still uploading.
    pub async fn append(&mut self, batch: &RecordBatch) -> Result<()> {
        self.encoder.write(batch).map_err(Error::arrow("encoding a state file"))?;
        self.hand_over();
        let context = self.context();
        self.upload.wait_for_capacity(PARTS_IN_FLIGHT).await.map_err(Error::storage(context))
    }

    /// Ends the file, waits until it is stored (and, on local disk,
    /// fsynced), and returns what the metadata records about it.
    pub async fn finish(mut self) -> Result<StateFile> {
        self.encoder.finish().map_err(Error::arrow("encoding a state file"))?;
        self.hand_over();
        let context = self.context();
        // A failing store (fault injection) refuses the file when it is complete.
        if let Some(why) = crate::fault::failing_put(self.location.object_path(&self.name).as_ref()) {
            let _ = self.upload.abort().await;
            return Err(Error::storage(context)(object_store::Error::Generic { store: "weir", source: why.into() }));
        }
        self.upload.finish().await.map_err(Error::storage(context))?;
        self.location.sync_local(&self.name).await?;
        Ok(StateFile { name: self.name, size: self.size, crc32: self.crc.finalize() })
    }

    /// Gives the file up: what was uploaded is removed.
    pub async fn abort(self) {
        if let Err(e) = self.upload.abort().await {
            tracing::debug!(file = %format!("{}/{}", self.location.display, self.name), error = %e, "a state file given up could not be removed; the log clean-up removes it later");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field};

    use super::*;
    use crate::worker::restore::{decode_state, encode_state};

    fn batch(from: i64, n: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("seq", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(from..from + n))]).unwrap()
    }

    #[tokio::test]
    async fn batches_written_as_they_come_read_back_like_a_state_file_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let location = Location::parse(&dir.path().display().to_string(), true).unwrap();
        // More than two parts, so that the upload's back pressure is used.
        let batches: Vec<RecordBatch> = (0..40).map(|i| batch(i * 50_000, 50_000)).collect();
        let mut writer = StateFileWriter::start(&location, "entry.arrow", &batches[0].schema()).await.unwrap();
        for b in &batches {
            writer.append(b).await.unwrap();
        }
        let file = writer.finish().await.unwrap();
        assert!(file.size > 3 * PART_SIZE as u64, "{} bytes", file.size);
        let bytes = location.read_state_file(&file).await.unwrap();
        assert_eq!(decode_state("entry.arrow", bytes.to_vec()).unwrap(), batches);

        // An empty file is a valid state file too.
        let writer = StateFileWriter::start(&location, "empty.arrow", &batches[0].schema()).await.unwrap();
        let empty = writer.finish().await.unwrap();
        assert!(decode_state("empty.arrow", location.read_state_file(&empty).await.unwrap().to_vec()).unwrap().is_empty());
        // And the whole-file encoder reads back the same way.
        let whole = location.put_state_file("whole.arrow", encode_state(&batch(0, 10)).unwrap()).await.unwrap();
        assert_eq!(decode_state("whole.arrow", location.read_state_file(&whole).await.unwrap().to_vec()).unwrap(), vec![batch(0, 10)]);
    }

    #[tokio::test]
    async fn a_writer_given_up_or_dropped_leaves_no_file_under_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let location = Location::parse(&dir.path().display().to_string(), true).unwrap();
        let mut writer = StateFileWriter::start(&location, "given-up.arrow", &batch(0, 1).schema()).await.unwrap();
        writer.append(&batch(0, 100)).await.unwrap();
        writer.abort().await;
        let mut dropped = StateFileWriter::start(&location, "dropped.arrow", &batch(0, 1).schema()).await.unwrap();
        dropped.append(&batch(0, 100)).await.unwrap();
        drop(dropped);
        assert_eq!(location.get("given-up.arrow").await.unwrap(), None);
        assert_eq!(location.get("dropped.arrow").await.unwrap(), None);
        let names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert!(!names.iter().any(|n| n.starts_with("given-up")), "an aborted upload leaves nothing: {names:?}");
        assert!(names.iter().all(|n| !n.starts_with("dropped") || n.contains('#')), "a dropped one leaves only its staging file: {names:?}");
    }
}
