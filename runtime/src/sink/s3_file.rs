//! The file sink in S3 (`s3://BUCKET/PREFIX`), exactly-once by two-phase
//! commit over multipart uploads.
//!
//! S3 has no rename, so the in-progress file of the directory sink becomes a
//! multipart upload of the final object: records are buffered and uploaded
//! in parts of at least 5 MiB as they come (S3's minimum for every part but
//! the last, a few at a time while records keep coming); at the barrier the
//! rest goes up as the last part, every part is waited for, and the
//! upload, with its id and the parts' ETags, becomes pending on that
//! checkpoint (phase one; nothing is visible in the bucket yet). When the
//! checkpoint completes, the upload is completed and the object appears
//! under its final name at once (phase two). Completing is idempotent for
//! us: an upload completed before (the notification was lost, the
//! checkpoint is restored twice) is found under its final name.
//!
//! S3 cannot list a prefix's open uploads through `object_store`, so each
//! upload has a marker object `.<final name>.upload` holding its id, written
//! right after the upload is created and deleted once it is completed. The
//! markers play the part of the directory sink's in-progress files: a
//! restore aborts the uploads of markers no retained snapshot references,
//! and a snapshot's `keep` set names markers. An upload created just before
//! a crash, whose marker was never written, is left to the bucket's
//! lifecycle rule (`AbortIncompleteMultipartUpload`; see the README).
//!
//! Names carry the run id, as in the directory sink, so no run ever writes
//! another's objects; a fenced (superseded) run never receives a completion.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::RecordBatch;
use object_store::aws::AmazonS3;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use weir_api::{FileSinkSpec, Guarantee};

use super::file::{FileSinkState, PendingFile, PendingUpload};
use super::SinkRestore;
use crate::error::{Error, Result};

/// S3's smallest part (but the last). Bigger parts mean fewer requests and
/// more memory: one buffer of this size per sink subtask.
const PART_SIZE: usize = 5 << 20;
/// Parts uploading at once per file beyond the one being filled: the sink
/// goes on encoding records while they travel (measured: waiting for each
/// part made the sink 2.7 times slower than on local disk); memory is one
/// part buffer per part in flight.
const PARTS_IN_FLIGHT: usize = 2;
const MARKER_PREFIX: &str = ".part-";
const MARKER_SUFFIX: &str = ".upload";

/// The bucket and prefix the sink writes to.
pub(crate) struct Output {
    store: Arc<AmazonS3>,
    prefix: Path,
    display: String,
}

impl Output {
    pub(crate) fn open(url: &str) -> Result<Output> {
        let bad = |m: String| Error::Fatal(format!("file sink path {url:?}: {m}"));
        let parsed = url::Url::parse(url).map_err(|e| bad(format!("not a valid URL: {e}")))?;
        let store = crate::checkpoint::s3::amazon_s3(&parsed).map_err(|e| bad(format!("cannot use this S3 location: {e}")))?;
        let prefix = Path::from_url_path(parsed.path()).map_err(|e| bad(format!("not a valid object path: {e}")))?;
        Ok(Output { store: Arc::new(store), prefix, display: url.trim_end_matches('/').to_string() })
    }

    fn path(&self, name: &str) -> Path {
        self.prefix.clone().join(name)
    }

    /// A request that failed: fatal when retrying cannot help (no such
    /// bucket, credentials refused), otherwise worth a restore.
    fn error(&self, doing: String, e: object_store::Error) -> Error {
        let text = e.to_string();
        let refused = matches!(e, object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. })
            || ["NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"].iter().any(|c| text.contains(c));
        if refused {
            Error::Fatal(format!("file sink {}: {doing}: {e}", self.display))
        } else {
            Error::Output { location: format!("{} ({doing})", self.display), source: e }
        }
    }
}

/// An upload being written.
struct Upload {
    marker: String,
    final_name: String,
    id: String,
    /// ETags of the parts uploaded, in order.
    parts: Vec<String>,
    /// Parts on their way, oldest first: (what, ETag or error).
    in_flight: std::collections::VecDeque<tokio::task::JoinHandle<std::result::Result<String, (String, object_store::Error)>>>,
    next_part: usize,
    buf: Vec<u8>,
    bytes: u64,
}

pub struct S3FileSink {
    out: Output,
    job: String,
    subtask: u32,
    run_id: String,
    next_file: u64,
    exactly_once: bool,
    max_file_bytes: u64,
    current: Option<Upload>,
    /// Uploads rolled by size since the last barrier, every part uploaded.
    closed: Vec<(String, String, PendingUpload)>,
    pending: Vec<PendingFile>,
}

impl S3FileSink {
    pub async fn open(spec: &FileSinkSpec, job: &str, subtask: u32, run_id: &str, restore: SinkRestore<'_>) -> Result<Self> {
        let sink = S3FileSink {
            out: Output::open(&spec.path)?,
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
        for p in restore.mine.iter().flat_map(|s| &s.pending) {
            sink.commit_upload(p).await?;
        }
        if let Some(keep) = restore.keep {
            discard_unreferenced(&sink.out, &sink.job, &sink.run_id, keep).await?;
        }
        Ok(sink)
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let lines = super::encode_jsonl(batch).map_err(Error::arrow(format!("file sink {}: encoding records", self.out.display)))?;
        if self.current.is_none() {
            self.current = Some(self.start_upload().await?);
        }
        let (full, rolled) = match &mut self.current {
            Some(c) => {
                c.buf.extend_from_slice(&lines);
                c.bytes += lines.len() as u64;
                (c.buf.len() >= PART_SIZE, c.bytes >= self.max_file_bytes)
            }
            None => (false, false),
        };
        if rolled {
            self.close_current().await?;
        } else if full {
            if let Some(mut c) = self.current.take() {
                self.upload_part(&mut c).await?;
                self.current = Some(c);
            }
        }
        Ok(())
    }

    async fn start_upload(&mut self) -> Result<Upload> {
        let stem = format!("part-{}.{}-{:03}-{:06}", self.job, self.run_id, self.subtask, self.next_file);
        self.next_file += 1;
        let final_name = format!("{stem}.jsonl");
        let marker = format!(".{final_name}{MARKER_SUFFIX}");
        let id = self
            .out
            .store
            .create_multipart(&self.out.path(&final_name))
            .await
            .map_err(|e| self.out.error(format!("starting the upload of {final_name}"), e))?;
        self.out
            .store
            .put(&self.out.path(&marker), PutPayload::from(id.clone().into_bytes()))
            .await
            .map_err(|e| self.out.error(format!("writing {marker}"), e))?;
        Ok(Upload {
            marker,
            final_name,
            id,
            parts: Vec::new(),
            in_flight: Default::default(),
            next_part: 0,
            buf: Vec::with_capacity(PART_SIZE + (1 << 16)),
            bytes: 0,
        })
    }

    /// Sends the buffer as the next part, without waiting for it.
    fn start_part(&self, c: &mut Upload) {
        let data = PutPayload::from(std::mem::replace(&mut c.buf, Vec::with_capacity(PART_SIZE + (1 << 16))));
        let (store, path, id, index) = (self.out.store.clone(), self.out.path(&c.final_name), c.id.clone(), c.next_part);
        let what = format!("uploading part {} of {}", index + 1, c.final_name);
        c.next_part += 1;
        c.in_flight.push_back(tokio::spawn(async move { store.put_part(&path, &id, index, data).await.map(|p| p.content_id).map_err(|e| (what, e)) }));
    }

    /// Waits for the oldest part on its way.
    async fn finish_oldest_part(&self, c: &mut Upload) -> Result<()> {
        let Some(task) = c.in_flight.pop_front() else { return Ok(()) };
        match task.await {
            Ok(Ok(etag)) => {
                c.parts.push(etag);
                Ok(())
            }
            Ok(Err((what, e))) => Err(self.out.error(what, e)),
            Err(e) => Err(Error::Job(format!("file sink {}: a part upload stopped: {e}", self.out.display))),
        }
    }

    /// Sends a full buffer as a part; waits only when too many are on their way.
    async fn upload_part(&self, c: &mut Upload) -> Result<()> {
        self.start_part(c);
        while c.in_flight.len() > PARTS_IN_FLIGHT {
            self.finish_oldest_part(c).await?;
        }
        Ok(())
    }

    /// Uploads the rest of the current file as its last part and waits for
    /// every part; the upload then waits for the next barrier.
    async fn close_current(&mut self) -> Result<()> {
        if let Some(mut c) = self.current.take() {
            if !c.buf.is_empty() || c.next_part == 0 {
                self.start_part(&mut c);
            }
            while !c.in_flight.is_empty() {
                self.finish_oldest_part(&mut c).await?;
            }
            self.closed.push((c.marker, c.final_name, PendingUpload { id: c.id, parts: c.parts }));
        }
        Ok(())
    }

    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<FileSinkState> {
        self.close_current().await?;
        for (marker, final_name, upload) in std::mem::take(&mut self.closed) {
            let p = PendingFile { checkpoint: checkpoint_id, temp: marker, final_name, upload: Some(upload) };
            if self.exactly_once {
                self.pending.push(p);
            } else {
                self.commit_upload(&p).await?;
            }
        }
        Ok(FileSinkState { pending: self.pending.clone() })
    }

    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        let (ready, later): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|p| p.checkpoint <= checkpoint_id);
        self.pending = later;
        for (i, p) in ready.iter().enumerate() {
            if let Err(e) = self.commit_upload(p).await {
                // Keep what is not committed yet: the error may be retried.
                self.pending.splice(0..0, ready[i..].iter().cloned());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Completes one pending upload; completed before is success, neither
    /// the upload nor the object present is data loss.
    async fn commit_upload(&self, p: &PendingFile) -> Result<()> {
        let Some(upload) = &p.upload else {
            return Err(Error::Fatal(format!(
                "file sink {}: the checkpoint's pending file {} was written to a directory, not to S3; was the sink's path changed from a directory to s3://? Restore a snapshot taken with this path, or start without one",
                self.out.display, p.final_name
            )));
        };
        let path = self.out.path(&p.final_name);
        let parts = upload.parts.iter().map(|e| PartId { content_id: e.clone() }).collect();
        if let Err(e) = self.out.store.complete_multipart(&path, &upload.id, parts).await {
            match self.out.store.head(&path).await {
                Ok(_) => {} // completed before
                Err(object_store::Error::NotFound { .. }) if no_such_upload(&e) => {
                    return Err(Error::LostPendingFile {
                        temp: format!("{}/{} (upload {})", self.out.display, p.temp, upload.id),
                        final_name: format!("{}/{}", self.out.display, p.final_name),
                        checkpoint: p.checkpoint,
                    });
                }
                Err(_) => return Err(self.out.error(format!("completing the upload of {} (checkpoint {})", p.final_name, p.checkpoint), e)),
            }
        }
        match self.out.store.delete(&self.out.path(&p.temp)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.out.error(format!("deleting {}", p.temp), e)),
        }
    }
}

fn no_such_upload(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. }) || e.to_string().contains("NoSuchUpload")
}

/// Aborts the uploads of job `job` under `out` that are not of run `run_id`
/// and whose markers are not in `keep`, and deletes their markers (see the
/// directory sink's `discard_unreferenced`).
pub(crate) async fn discard_unreferenced(out: &Output, job: &str, run_id: &str, keep: &HashSet<String>) -> Result<()> {
    let listing = out
        .store
        .list_with_delimiter(Some(&out.prefix))
        .await
        .map_err(|e| match e {
            // Listing a prefix finds nothing rather than nothing found: a 404 is the bucket.
            object_store::Error::NotFound { .. } => Error::Fatal(format!("file sink {}: the bucket does not exist: {e}", out.display)),
            e => out.error("listing the output's upload markers".into(), e),
        })?;
    let job = format!("{MARKER_PREFIX}{job}.");
    let current = format!("{job}{run_id}-");
    for object in listing.objects {
        let Some(name) = object.location.filename().map(str::to_string) else { continue };
        if !name.starts_with(&job) || !name.ends_with(MARKER_SUFFIX) || name.starts_with(&current) || keep.contains(name.as_str()) {
            continue;
        }
        let final_name = &name[1..name.len() - MARKER_SUFFIX.len()];
        let id = match out.store.get(&object.location).await {
            Ok(got) => got.bytes().await.map_err(|e| out.error(format!("reading {name}"), e))?,
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(out.error(format!("reading {name}"), e)),
        };
        let id = String::from_utf8_lossy(&id).trim().to_string();
        tracing::info!(file = %final_name, upload = %id, "aborting the upload of a checkpoint that never completed");
        match out.store.abort_multipart(&out.path(final_name), &id).await {
            Ok(()) => {}
            Err(e) if no_such_upload(&e) => {}
            Err(e) => return Err(out.error(format!("aborting the upload of {final_name}"), e)),
        }
        match out.store.delete(&object.location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(out.error(format!("deleting {name}"), e)),
        }
    }
    Ok(())
}
