//! The file sink in an object store (`s3://BUCKET/PREFIX`,
//! `az://CONTAINER/PREFIX`, `gs://BUCKET/PREFIX`), exactly-once by
//! two-phase commit over staged objects. What follows says S3; Azure's
//! block blobs (uncommitted blocks, then a block list) and Google's XML
//! multipart uploads are the same protocol under other names, and
//! `object_store` speaks each.
//!
//! S3 has no rename, so the directory sink's in-progress file becomes a
//! multipart upload of a hidden staging object `.<final name>.staged`:
//! records are buffered and uploaded in parts of at least 5 MiB as they
//! come (S3's minimum for every part but the last, a few at a time while
//! records keep coming). At the barrier the rest goes up as the last part
//! and the upload is completed: the staged object holds the whole file and
//! becomes pending on that checkpoint (phase one; hidden names are skipped
//! by readers of the prefix). When the checkpoint completes, the staged
//! object is copied to its final name by one server-side copy, which makes
//! it appear at once, and then deleted (phase two). Committing is
//! idempotent: a staged object already copied and deleted is found under
//! its final name.
//!
//! Why not publish by completing the upload at commit, as Flink's S3 sink
//! does? Because a completion cut off half-way must be repeatable from
//! what is left, and it is not everywhere: MinIO deletes the parts'
//! metadata before it moves them, so a client killed during the request
//! (a worker killed at the wrong moment) leaves an upload that can be
//! neither completed nor found under its final name, and the checkpoint's
//! records are lost. A copy cut off half-way leaves its source whole and
//! is simply done again. The price is one server-side copy of every file.
//!
//! No store lists a prefix's open uploads through `object_store`, so each
//! upload has a marker object `.<final name>.upload` holding its id, written
//! right after the upload is created and deleted once the file is
//! committed. The markers play the part of the directory sink's
//! in-progress files: a restore aborts the uploads and deletes the staged
//! objects of markers no retained snapshot references, and a snapshot's
//! `keep` set names markers. An upload created just before a crash, whose
//! marker was never written, is left to the bucket's lifecycle rule
//! (`AbortIncompleteMultipartUpload`; see the README). Azure has no upload
//! to abort: its uncommitted blocks expire on their own within a week, and
//! its upload ids are empty.
//!
//! Names carry the run id, as in the directory sink, so no run ever writes
//! another's objects; a fenced (superseded) run never receives a completion.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::RecordBatch;
use object_store::multipart::PartId;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use weir_api::{FileSinkSpec, Guarantee};

use super::file::PendingFile;
use super::SinkState;
use super::SinkRestore;
use crate::checkpoint::stores::StagingStore;
use crate::error::{Error, Result};

/// S3's smallest part (but the last; also Google's). Bigger parts mean fewer requests and
/// more memory: one buffer of this size per sink subtask.
const PART_SIZE: usize = 5 << 20;
/// Parts uploading at once per file beyond the one being filled: the sink
/// goes on encoding records while they travel (measured: waiting for each
/// part made the sink 2.7 times slower than on local disk); memory is one
/// part buffer per part in flight.
const PARTS_IN_FLIGHT: usize = 2;
const MARKER_PREFIX: &str = ".part-";
const MARKER_SUFFIX: &str = ".upload";
const STAGED_SUFFIX: &str = ".staged";

/// The staging object of the file named `final_name`.
fn staged_name(final_name: &str) -> String {
    format!(".{final_name}{STAGED_SUFFIX}")
}

/// The marker holding the upload id of the file named `final_name`.
fn marker_name(final_name: &str) -> String {
    format!(".{final_name}{MARKER_SUFFIX}")
}

/// The bucket and prefix the sink writes to.
pub(crate) struct Output {
    store: Arc<dyn StagingStore>,
    prefix: Path,
    display: String,
}

impl Output {
    pub(crate) fn open(url: &str) -> Result<Output> {
        let bad = |m: String| Error::Fatal(format!("file sink path {url:?}: {m}"));
        let parsed = url::Url::parse(url).map_err(|e| bad(format!("not a valid URL: {e}")))?;
        let store = crate::checkpoint::stores::open(&parsed).map_err(|e| bad(format!("cannot use this location: {e}")))?;
        let prefix = Path::from_url_path(parsed.path()).map_err(|e| bad(format!("not a valid object path: {e}")))?;
        Ok(Output { store, prefix, display: url.trim_end_matches('/').to_string() })
    }

    fn path(&self, name: &str) -> Path {
        self.prefix.clone().join(name)
    }

    /// A request that failed: fatal when retrying cannot help (no such
    /// bucket, credentials refused), otherwise worth a restore.
    fn error(&self, doing: String, e: object_store::Error) -> Error {
        let text = e.to_string();
        let refused = matches!(e, object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. })
            || ["NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ContainerNotFound", "AuthenticationFailed", "AuthorizationFailure"]
                .iter()
                .any(|c| text.contains(c));
        if refused {
            Error::Fatal(format!("file sink {}: {doing}: {e}", self.display))
        } else {
            Error::Output { location: format!("{} ({doing})", self.display), source: e }
        }
    }
}

/// An upload being written.
struct Upload {
    final_name: String,
    /// The object being uploaded: the file's staging object.
    staged: String,
    id: String,
    /// ETags of the parts uploaded, in order.
    parts: Vec<String>,
    /// Parts on their way, oldest first: (what, ETag or error).
    in_flight: std::collections::VecDeque<tokio::task::JoinHandle<std::result::Result<String, (String, object_store::Error)>>>,
    next_part: usize,
    buf: Vec<u8>,
    bytes: u64,
}

pub struct ObjectFileSink {
    out: Output,
    job: String,
    subtask: u32,
    run_id: String,
    next_file: u64,
    exactly_once: bool,
    max_file_bytes: u64,
    current: Option<Upload>,
    /// Final names of the files rolled by size since the last barrier, staged.
    closed: Vec<String>,
    pending: Vec<PendingFile>,
}

impl ObjectFileSink {
    pub async fn open(spec: &FileSinkSpec, job: &str, subtask: u32, run_id: &str, restore: SinkRestore<'_>) -> Result<Self> {
        let sink = ObjectFileSink {
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
            sink.commit_staged(p).await?;
        }
        if let Some(keep) = restore.keep {
            discard_unreferenced(&sink.out, &sink.job, &sink.run_id, keep, restore.runs).await?;
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
        let marker = marker_name(&final_name);
        let staged = staged_name(&final_name);
        let id = self
            .out
            .store
            .create_multipart(&self.out.path(&staged))
            .await
            .map_err(|e| self.out.error(format!("starting the upload of {staged}"), e))?;
        self.out
            .store
            .put(&self.out.path(&marker), PutPayload::from(id.clone().into_bytes()))
            .await
            .map_err(|e| self.out.error(format!("writing {marker}"), e))?;
        Ok(Upload {
            final_name,
            staged,
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
        let (store, path, id, index) = (self.out.store.clone(), self.out.path(&c.staged), c.id.clone(), c.next_part);
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

    /// Uploads the rest of the current file as its last part, waits for
    /// every part and completes the upload: the file is then staged, whole,
    /// and waits for the next barrier. A completion cut off here only fails
    /// this checkpoint; a restore aborts the upload through its marker.
    async fn close_current(&mut self) -> Result<()> {
        if let Some(mut c) = self.current.take() {
            if !c.buf.is_empty() || c.next_part == 0 {
                self.start_part(&mut c);
            }
            while !c.in_flight.is_empty() {
                self.finish_oldest_part(&mut c).await?;
            }
            let parts = c.parts.into_iter().map(|content_id| PartId { content_id }).collect();
            self.out
                .store
                .complete_multipart(&self.out.path(&c.staged), &c.id, parts)
                .await
                .map_err(|e| self.out.error(format!("completing the upload of {}", c.staged), e))?;
            self.closed.push(c.final_name);
        }
        Ok(())
    }

    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<SinkState> {
        self.close_current().await?;
        for final_name in std::mem::take(&mut self.closed) {
            let p = PendingFile { checkpoint: checkpoint_id, temp: marker_name(&final_name), staged: Some(staged_name(&final_name)), final_name };
            if self.exactly_once {
                self.pending.push(p);
            } else {
                self.commit_staged(&p).await?;
            }
        }
        Ok(SinkState { pending: self.pending.clone(), ..SinkState::default() })
    }

    /// Publishes the files of every checkpoint up to `checkpoint_id`, all
    /// copies at once; what fails stays pending, to be retried by a restore.
    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        let (ready, later): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|p| p.checkpoint <= checkpoint_id);
        self.pending = later;
        let results = futures::future::join_all(ready.iter().map(|p| self.commit_staged(p))).await;
        let mut first_error = None;
        let mut failed = Vec::new();
        for (p, r) in ready.into_iter().zip(results) {
            if let Err(e) = r {
                failed.push(p);
                first_error.get_or_insert(e);
            }
        }
        self.pending.splice(0..0, failed);
        first_error.map_or(Ok(()), Err)
    }

    /// Publishes one pending file: copies its staged object to the final
    /// name, then deletes the staged object and the marker. A staged object
    /// gone while the final one is there was committed before; both gone is
    /// data loss.
    async fn commit_staged(&self, p: &PendingFile) -> Result<()> {
        let Some(staged) = &p.staged else {
            return Err(Error::Fatal(format!(
                "file sink {}: the checkpoint's pending file {} was written to a directory, not to an object store; was the sink's path changed from a directory to a URL? Restore a snapshot taken with this path, or start without one",
                self.out.display, p.final_name
            )));
        };
        let (from, to) = (self.out.path(staged), self.out.path(&p.final_name));
        match self.out.store.copy(&from, &to).await {
            Ok(()) => {}
            Err(object_store::Error::NotFound { .. }) => match self.out.store.head(&to).await {
                Ok(_) => {} // committed before
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(Error::LostPendingFile {
                        temp: format!("{}/{staged}", self.out.display),
                        final_name: format!("{}/{}", self.out.display, p.final_name),
                        checkpoint: p.checkpoint,
                    });
                }
                Err(e) => return Err(self.out.error(format!("looking for {} (checkpoint {})", p.final_name, p.checkpoint), e)),
            },
            Err(e) => return Err(self.out.error(format!("copying {staged} to {} (checkpoint {})", p.final_name, p.checkpoint), e)),
        }
        delete_if_there(&self.out, &from).await?;
        delete_if_there(&self.out, &self.out.path(&p.temp)).await
    }
}

fn no_such_upload(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. }) || e.to_string().contains("NoSuchUpload")
}

/// Aborts the uploads of job `job` under `out` that are not of run `run_id`
/// and whose markers are not in `keep`, and deletes their staged objects
/// and markers (see the directory sink's `discard_unreferenced`). Also
/// deletes staged objects whose marker is gone: a killed run's completion
/// can land after a newer run discarded its marker (the server finishes a
/// request whose client died), and nothing else would ever find them.
pub(crate) async fn discard_unreferenced(out: &Output, job: &str, run_id: &str, keep: &HashSet<String>, runs: Option<&HashSet<String>>) -> Result<()> {
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
        let ours = name.strip_prefix(&job).is_some_and(|rest| super::written_by(rest, runs));
        if !ours || name.starts_with(&current) {
            continue;
        }
        if let Some(stem) = name.strip_suffix(STAGED_SUFFIX) {
            if !keep.contains(&format!("{stem}{MARKER_SUFFIX}")) {
                tracing::info!(file = %name, "deleting a staged file no snapshot references");
                delete_if_there(out, &object.location).await?;
            }
            continue;
        }
        if !name.ends_with(MARKER_SUFFIX) || keep.contains(name.as_str()) {
            continue;
        }
        let final_name = &name[1..name.len() - MARKER_SUFFIX.len()];
        let staged = staged_name(final_name);
        let id = match out.store.get(&object.location).await {
            Ok(got) => got.bytes().await.map_err(|e| out.error(format!("reading {name}"), e))?,
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(out.error(format!("reading {name}"), e)),
        };
        let id = String::from_utf8_lossy(&id).trim().to_string();
        tracing::info!(file = %final_name, upload = %id, "discarding the file of a checkpoint that never completed");
        match out.store.abort_multipart(&out.path(&staged), &id).await {
            Ok(()) => {}
            Err(e) if no_such_upload(&e) => {}
            Err(e) => return Err(out.error(format!("aborting the upload of {staged}"), e)),
        }
        // The staged object first: a marker is the only way to find it.
        delete_if_there(out, &out.path(&staged)).await?;
        delete_if_there(out, &object.location).await?;
    }
    Ok(())
}

async fn delete_if_there(out: &Output, path: &Path) -> Result<()> {
    match out.store.delete(path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(out.error(format!("deleting {path}"), e)),
    }
}
