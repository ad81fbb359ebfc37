//! Checkpoint storage through `object_store`: a local directory today, any
//! object store tomorrow. Nothing here assumes a file system path beyond
//! turning a user's plain path into a location.
//!
//! Layout under `<state dir>/<job>/`:
//!
//! ```text
//! checkpoints/chk-<id>/<operator>-<subtask>.arrow   keyed state (Arrow IPC)
//! checkpoints/chk-<id>/_owner                        the run that may write here (create-only, first)
//! checkpoints/chk-<id>/_metadata                     written last
//! lineage/<epoch>/{claim,start,chk-<id>}             runs, their fence and "latest" (see `lineage.rs`)
//! savepoints/sp-<id>-<unix ms>/...                   same layout, never deleted by weir
//! run.json                                           how to reach the running job (local mode; 0600)
//! run.lock                                           held by the one `weir run` of the job (local mode)
//! run.lease                                          renewed by the one `weir run` of the job on shared storage (s3://)
//! ```
//!
//! Durability: on local disk, every state file, `_metadata` and lineage record is
//! fsynced (file and directory) before the next step relies on it, because
//! sinks fsync their commits: after a power loss the lineage must never lag
//! output that was already published on its strength.

use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::Serialize;

use super::lineage::RunClaim;
use super::metadata::{now_unix_ms, CheckpointMetadata, SnapshotKind, StateFile, METADATA_FILE};
use crate::error::{Error, Result};

/// A directory in some object store.
#[derive(Clone)]
pub struct Location {
    pub store: Arc<dyn ObjectStore>,
    pub prefix: Path,
    /// What the user sees and can pass back (`--restore`): a path or a URL.
    pub display: String,
    /// The directory on local disk, when the store is the local file system.
    pub local: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display)
    }
}

impl Location {
    /// A plain path (created if missing, when `create`) or a URL such as `file:///x`.
    pub fn parse(text: &str, create: bool) -> Result<Location> {
        let bad = |message: String| Error::StateDir { dir: text.into(), message };
        if text.contains("://") {
            let url = url::Url::parse(text).map_err(|e| bad(format!("not a valid URL: {e}")))?;
            if url.scheme() == "file" {
                let path = url.to_file_path().map_err(|_| bad("not a local file URL".into()))?;
                return Self::parse(&path.display().to_string(), create);
            }
            // The URL's shape first: a location that names a user or a query
            // is refused before anything could repeat it in a message.
            if let Some(Err(e)) = weir_api::object_store_url::object_store_kind(text) {
                return Err(bad(format!("{e}; or a path or file:///PATH")));
            }
            let store = super::stores::open(&url).map_err(|e| bad(format!("cannot use this location: {e}")))?;
            let store: Arc<dyn ObjectStore> = store;
            let prefix = Path::from_url_path(url.path()).map_err(|e| bad(format!("not a valid object path: {e}")))?;
            return Ok(Location { store, prefix, display: text.trim_end_matches('/').into(), local: None });
        }
        let path = std::path::Path::new(text);
        if create {
            std::fs::create_dir_all(path).map_err(|e| bad(format!("cannot create it: {e}")))?;
        }
        let abs = std::path::absolute(path).map_err(|e| bad(e.to_string()))?;
        let prefix = Path::from_absolute_path(&abs).map_err(|e| bad(e.to_string()))?;
        Ok(Location {
            store: Arc::new(LocalFileSystem::new().with_automatic_cleanup(true)),
            prefix,
            display: abs.display().to_string(),
            local: Some(abs),
        })
    }

    /// The directory this one is in.
    pub fn parent(&self) -> Location {
        let parts: Vec<_> = self.prefix.parts().collect();
        Location {
            store: self.store.clone(),
            prefix: Path::from_iter(parts[..parts.len().saturating_sub(1)].iter().cloned()),
            display: self.display.trim_end_matches('/').rsplit_once('/').map_or(String::new(), |(p, _)| p.to_string()),
            local: self.local.as_ref().and_then(|l| l.parent().map(|p| p.to_path_buf())),
        }
    }

    pub fn child(&self, name: &str) -> Location {
        Location {
            store: self.store.clone(),
            prefix: join(&self.prefix, name),
            display: format!("{}/{}", self.display.trim_end_matches('/'), name),
            local: self.local.as_ref().map(|l| l.join(name)),
        }
    }

    /// Writes one object and, on local disk, makes it durable: the file and
    /// its directory are fsynced, so the write survives a power loss.
    pub async fn put_durable(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        self.put(name, bytes).await?;
        self.sync_local(name).await
    }

    /// On local disk, fsyncs an object written a moment ago and its directory.
    pub(super) async fn sync_local(&self, name: &str) -> Result<()> {
        let Some(dir) = &self.local else { return Ok(()) };
        let file = dir.join(name);
        let context = format!("{}/{name}", self.display);
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            std::fs::File::open(&file)?.sync_all()?;
            if let Some(parent) = file.parent() {
                std::fs::File::open(parent)?.sync_all()?;
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::Job(format!("syncing {context}: {e}")))?
        .map_err(Error::io(format!("syncing {context}")))
    }

    /// Writes an object only its owner may read (mode 0600 on local disk):
    /// `run.json` holds the job's control token.
    pub async fn put_private(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let Some(dir) = &self.local else { return self.put(name, bytes).await };
        let (dir, name) = (dir.clone(), name.to_string());
        let context = format!("{}/{name}", self.display);
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::create_dir_all(&dir)?;
            // Written under a temporary name with its final mode from the
            // start, then renamed: the token is never readable by others.
            let temp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&temp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&temp, dir.join(&name))
        })
        .await
        .map_err(|e| Error::Job(format!("writing {context}: {e}")))?
        .map_err(Error::io(format!("writing {context}")))
    }

    fn path(&self, name: &str) -> Path {
        join(&self.prefix, name)
    }

    pub(super) fn object_path(&self, name: &str) -> Path {
        self.path(name)
    }

    pub async fn put(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let path = self.path(name);
        if let Some(why) = crate::fault::failing_put(path.as_ref()) {
            return Err(Error::storage(format!("{}/{name}", self.display))(object_store::Error::Generic { store: "weir", source: why.into() }));
        }
        self.store
            .put(&path, PutPayload::from(bytes))
            .await
            .map_err(Error::storage(format!("{}/{name}", self.display)))?;
        Ok(())
    }

    pub async fn get(&self, name: &str) -> Result<Option<Bytes>> {
        match self.store.get(&self.path(name)).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(Error::storage(format!("{}/{name}", self.display)))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Error::storage(format!("{}/{name}", self.display))(e)),
        }
    }

    /// Deletes one object; a missing one is not an error.
    pub async fn delete(&self, name: &str) -> Result<()> {
        match self.store.delete(&self.path(name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Error::storage(format!("{}/{name}", self.display))(e)),
        }
    }

    /// Writes a state file and returns what the metadata records about it.
    pub async fn put_state_file(&self, name: &str, bytes: Vec<u8>) -> Result<StateFile> {
        let handle = StateFile { name: name.into(), size: bytes.len() as u64, crc32: crc32fast::hash(&bytes) };
        self.put_durable(name, bytes).await?;
        Ok(handle)
    }

    /// Reads a state file back, checking that it is the file the metadata describes.
    pub async fn read_state_file(&self, file: &StateFile) -> Result<Bytes> {
        let where_ = format!("{}/{}", self.display, file.name);
        let bytes = self
            .get(&file.name)
            .await?
            .ok_or_else(|| Error::BadCheckpoint { location: where_.clone(), message: "the state file is missing".into() })?;
        if bytes.len() as u64 != file.size || crc32fast::hash(&bytes) != file.crc32 {
            return Err(Error::BadCheckpoint {
                location: where_,
                message: format!("the state file is damaged: {} bytes, expected {} with CRC {:08x}", bytes.len(), file.size, file.crc32),
            });
        }
        Ok(bytes)
    }

    /// The metadata of the checkpoint in this directory.
    pub async fn read_metadata(&self) -> Result<CheckpointMetadata> {
        let bytes = self.get(METADATA_FILE).await?.ok_or_else(|| Error::BadCheckpoint {
            location: self.display.clone(),
            message: format!("there is no {METADATA_FILE} file: expected the directory of a completed checkpoint or savepoint (see `weir checkpoints list`)"),
        })?;
        CheckpointMetadata::decode(&self.display, &bytes)
    }

    pub async fn delete_all(&self) -> Result<()> {
        self.delete_all_but(None).await
    }

    /// Deletes everything under this directory except the object `keep`.
    ///
    /// A snapshot's `_metadata` goes first: it is what makes the snapshot
    /// complete, so a deletion cut short (a kill, a failed request) leaves an
    /// incomplete snapshot that nothing restores, never a complete-looking
    /// one missing a state file. Listings come in no promised order.
    pub async fn delete_all_but(&self, keep: Option<&str>) -> Result<()> {
        let mut objects: Vec<_> = self
            .store
            .list(Some(&self.prefix))
            .try_collect()
            .await
            .map_err(Error::storage(self.display.clone()))?;
        objects.sort_by_key(|o| o.location.filename() != Some(METADATA_FILE));
        let keep = keep.map(|k| self.path(k));
        for o in objects.into_iter().filter(|o| Some(&o.location) != keep.as_ref()) {
            self.store.delete(&o.location).await.map_err(Error::storage(self.display.clone()))?;
        }
        // The listing above hides the local store's staging files.
        let Some(dir) = self.local.clone() else { return Ok(()) };
        tokio::task::spawn_blocking(move || sweep_local_staging(&dir))
            .await
            .map_err(|e| Error::Job(format!("deleting {}: {e}", self.display)))?
            .map_err(Error::io(format!("deleting {}", self.display)))
    }

    /// On local disk, the staging files directly in this directory (see
    /// [`is_local_staging`]); none elsewhere.
    pub async fn local_staging_files(&self) -> Result<Vec<String>> {
        let Some(dir) = self.local.clone() else { return Ok(Vec::new()) };
        tokio::task::spawn_blocking(move || -> std::io::Result<Vec<String>> {
            match std::fs::read_dir(&dir) {
                Ok(entries) => Ok(entries.flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|n| is_local_staging(n)).collect()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(e),
            }
        })
        .await
        .map_err(|e| Error::Job(format!("listing {}: {e}", self.display)))?
        .map_err(Error::io(format!("listing {}", self.display)))
    }

    /// Deletes staging file `name` of this local directory; a missing one is
    /// not an error.
    pub async fn delete_local_staging(&self, name: &str) -> Result<()> {
        let Some(dir) = &self.local else { return Ok(()) };
        match tokio::fs::remove_file(dir.join(name)).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(format!("deleting {}/{name}", self.display))(e)),
            _ => Ok(()),
        }
    }

    /// Names of the immediate subdirectories.
    pub async fn list_dirs(&self, sub: &str) -> Result<Vec<String>> {
        let listing = self.listing(sub).await?;
        Ok(listing.common_prefixes.iter().filter_map(|p| p.filename().map(String::from)).collect())
    }

    /// Names of the objects directly in directory `sub`.
    pub async fn list_objects(&self, sub: &str) -> Result<Vec<String>> {
        let listing = self.listing(sub).await?;
        Ok(listing.objects.iter().filter_map(|o| o.location.filename().map(String::from)).collect())
    }

    /// One level of directory `sub`: its objects and its subdirectories.
    async fn listing(&self, sub: &str) -> Result<object_store::ListResult> {
        self.store.list_with_delimiter(Some(&self.path(sub))).await.map_err(Error::storage(format!("{}/{sub}", self.display)))
    }

    /// Total size of the objects under this directory.
    pub async fn size(&self) -> Result<u64> {
        let objects: Vec<_> = self.store.list(Some(&self.prefix)).try_collect().await.map_err(Error::storage(self.display.clone()))?;
        Ok(objects.iter().map(|o| o.size).sum())
    }
}

/// Whether `name` is a staging file of object_store's local store
/// (`<name>#<digits>`): it writes an object there and renames it, so a
/// write cut off by a kill leaves one. The store's listings hide such files
/// and its `delete` refuses their names; they are found and removed with
/// the file system instead.
/// The checkpoint that wrote a shared state file
/// (`<op>-<subtask>-<run>-chk<id>.arrow`).
pub fn shared_file_checkpoint(name: &str) -> Option<u64> {
    name.rsplit_once("-chk").and_then(|(_, rest)| rest.strip_suffix(".arrow")).and_then(|n| n.parse::<u64>().ok())
}

pub fn is_local_staging(name: &str) -> bool {
    name.rsplit_once('#').is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the staging files under `dir`, recursively, then each directory
/// left empty (as the store's automatic cleanup would have, had the staging
/// file not been there). A directory still holding an object stays.
fn sweep_local_staging(dir: &std::path::Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        if e.file_type()?.is_dir() {
            sweep_local_staging(&e.path())?;
        } else if e.file_name().to_str().is_some_and(is_local_staging) {
            match std::fs::remove_file(e.path()) {
                Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err),
                _ => {}
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
    Ok(())
}

fn join(prefix: &Path, name: &str) -> Path {
    let mut p = prefix.clone();
    for part in name.split('/').filter(|s| !s.is_empty()) {
        p = p.clone().join(part);
    }
    p
}

/// Where incremental checkpoints keep their state files, under the job's
/// directory: a file is shared by every checkpoint whose chain names it.
pub const SHARED_DIR: &str = "shared";

/// The object holding the identity of a job's state ([`CheckpointStorage::identity`]).
const IDENTITY: &str = "identity";

/// One job's checkpoints and savepoints.
#[derive(Clone, Debug)]
pub struct CheckpointStorage {
    pub job_root: Location,
}

/// Why a savepoint was not disposed of.
#[derive(Debug)]
pub enum Disposal {
    /// The location names no savepoint of this job.
    NotASavepoint(String),
    /// It is the job's latest snapshot.
    Latest(String),
    /// Storage failed.
    Failed(Error),
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    pub id: u64,
    pub kind: SnapshotKind,
    pub dir: String,
    pub location: String,
    /// Complete: the metadata is there and readable.
    pub complete: bool,
    pub created_unix_ms: Option<u64>,
    pub is_latest: bool,
}

/// The smallest id above every one of `snapshots` ([`CheckpointStorage::next_id`]).
pub fn next_id_after<'a>(snapshots: impl Iterator<Item = &'a SnapshotInfo>) -> u64 {
    snapshots.map(|s| s.id).max().map_or(1, |m| m + 1)
}

impl CheckpointStorage {
    /// The storage of `job` under a state directory (a path or URL).
    pub fn open(state_dir: &str, job: &str, create: bool) -> Result<Self> {
        let root = Location::parse(state_dir, create)?;
        Ok(CheckpointStorage { job_root: root.child(job) })
    }

    /// Fails with a clear message when the state directory cannot be written.
    pub async fn check_writable(&self) -> Result<()> {
        let probe = format!(".probe-{}", std::process::id());
        self.job_root.put(&probe, b"probe".to_vec()).await.map_err(|e| Error::StateDir {
            dir: self.job_root.display.clone(),
            message: format!("is not writable: {e}"),
        })?;
        let _ = self.job_root.store.delete(&join(&self.job_root.prefix, &probe)).await;
        Ok(())
    }

    pub fn checkpoint_dir(id: u64) -> String {
        format!("checkpoints/chk-{id}")
    }

    pub fn savepoint_dir(id: u64) -> String {
        format!("savepoints/sp-{id}-{}", now_unix_ms())
    }

    pub fn dir(&self, rel: &str) -> Location {
        self.job_root.child(rel)
    }

    /// Completes a snapshot (checkpoint or savepoint) for `claim`'s run:
    /// metadata last, then the lineage record. Fails with [`Error::Fenced`], before
    /// or after writing, once a newer run has claimed the job; the caller must
    /// then not let any sink commit.
    pub async fn complete(&self, rel_dir: &str, meta: &CheckpointMetadata, claim: &RunClaim) -> Result<Location> {
        self.check_fence(claim).await?;
        let dir = self.dir(rel_dir);
        dir.put_durable(METADATA_FILE, meta.encode()).await?;
        // Savepoints too: a crash after one restores it (or a later
        // checkpoint), whose output the sinks commit as soon as it completes.
        self.record_completed(claim, meta.checkpoint_id, rel_dir).await?;
        Ok(dir)
    }

    /// The newest state of the job's lineage: the latest checkpoint the
    /// newest started run completed, or the snapshot that run began from
    /// (see [`Self::begin_lineage`]); `None` when it began fresh.
    pub async fn latest(&self) -> Result<Option<Location>> {
        let Some(rel) = self.latest_pointer().await? else { return Ok(None) };
        if rel.starts_with("checkpoints/chk-") || rel.starts_with("savepoints/sp-") {
            return Ok(Some(self.dir(&rel)));
        }
        Location::parse(&rel, false).map(Some)
    }

    /// Every checkpoint and savepoint directory, oldest first.
    pub async fn list(&self) -> Result<Vec<SnapshotInfo>> {
        Ok(self.list_with_metadata().await?.into_iter().map(|(info, _)| info).collect())
    }

    /// Every checkpoint and savepoint directory, oldest first, with the
    /// metadata of the complete ones.
    pub async fn list_with_metadata(&self) -> Result<Vec<(SnapshotInfo, Option<CheckpointMetadata>)>> {
        let latest = self.latest_pointer().await?;
        let mut out = Vec::new();
        for (sub, kind, prefix) in [("checkpoints", SnapshotKind::Checkpoint, "chk-"), ("savepoints", SnapshotKind::Savepoint, "sp-")] {
            for name in self.job_root.list_dirs(sub).await? {
                let Some(id) = name.strip_prefix(prefix).and_then(|r| r.split('-').next()).and_then(|n| n.parse::<u64>().ok()) else { continue };
                let rel = format!("{sub}/{name}");
                let loc = self.dir(&rel);
                let meta = loc.read_metadata().await.ok();
                let info = SnapshotInfo {
                    id,
                    kind,
                    is_latest: latest.as_deref() == Some(rel.as_str()),
                    dir: rel,
                    complete: meta.is_some(),
                    created_unix_ms: meta.as_ref().map(|m| m.created_unix_ms),
                    location: loc.display,
                };
                out.push((info, meta));
            }
        }
        out.sort_by_key(|(s, _)| (s.id, s.kind == SnapshotKind::Savepoint));
        Ok(out)
    }

    /// The identity of this job's state: a random id created with it (a
    /// create-only `identity` object) and kept for its life. What the job
    /// leaves outside weir and cleans up by prefix (the PostgreSQL sink's
    /// prepared transactions and progress rows) carries it beside the job
    /// id, so that two states of one job id sharing a database (two state
    /// directories, or a job id that collides) never take each other's
    /// writes for their own.
    pub async fn identity(&self) -> Result<String> {
        for _ in 0..3 {
            if let Some(bytes) = self.job_root.get(IDENTITY).await? {
                let id = std::str::from_utf8(&bytes).map(str::trim).unwrap_or_default();
                if id.is_empty() || id.len() > 32 || !id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
                    return Err(Error::BadCheckpoint {
                        location: format!("{}/{IDENTITY}", self.job_root.display),
                        message: "the job state's identity is damaged: expected 1 to 32 lowercase letters or digits".into(),
                    });
                }
                return Ok(id.to_string());
            }
            let id: String = (0..4).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
            self.job_root.create_durable(IDENTITY, id.into_bytes()).await?;
        }
        Err(Error::StateDir { dir: self.job_root.display.clone(), message: format!("its `{IDENTITY}` object keeps disappearing") })
    }

    /// The smallest id above every id ever used, so that no new checkpoint
    /// reuses the directory of an abandoned one.
    pub async fn next_id(&self) -> Result<u64> {
        Ok(next_id_after(self.list().await?.iter()))
    }

    /// The directory (`savepoints/sp-…`) of this job's savepoint at
    /// `location`, as a savepoint's outcome gives it; `None` for anything
    /// else (a checkpoint, another job's savepoint, a path inside one).
    pub fn savepoint_dir_of(&self, location: &str) -> Option<String> {
        let location = location.trim_end_matches('/');
        let (_, name) = location.rsplit_once('/')?;
        let mut parts = name.strip_prefix("sp-")?.split('-');
        let numbers = parts.by_ref().take(2).filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).count();
        if numbers != 2 || parts.next().is_some() {
            return None;
        }
        let rel = format!("savepoints/{name}");
        (self.dir(&rel).display.trim_end_matches('/') == location).then_some(rel)
    }

    /// Deletes this job's savepoint at `location` (see
    /// [`Self::savepoint_dir_of`]), `_metadata` first so that a deletion cut
    /// short leaves nothing that restores. Refused for the job's latest
    /// snapshot: a run that fails before its first checkpoint restores from
    /// it. Returns whether there was anything to delete.
    pub async fn dispose_savepoint(&self, location: &str) -> std::result::Result<bool, Disposal> {
        let Some(rel) = self.savepoint_dir_of(location) else {
            return Err(Disposal::NotASavepoint(format!(
                "`{}` is no savepoint of this job: expected {}/savepoints/sp-<id>-<time>",
                location.escape_debug(),
                self.job_root.display
            )));
        };
        match self.latest_pointer().await {
            Ok(Some(latest)) if latest == rel => {
                return Err(Disposal::Latest(format!(
                    "savepoint {location} is the job's latest snapshot: a failure before the next checkpoint restores from it; dispose of it once a checkpoint has completed"
                )))
            }
            Ok(_) => {}
            Err(e) => return Err(Disposal::Failed(e)),
        }
        let dir = self.dir(&rel);
        let existed = !self.job_root.list_objects(&rel).await.map_err(Disposal::Failed)?.is_empty()
            || !self.job_root.list_dirs(&rel).await.map_err(Disposal::Failed)?.is_empty();
        dir.delete_all().await.map_err(Disposal::Failed)?;
        Ok(existed)
    }

    /// Deletes all but the newest `retain` completed checkpoints, and every
    /// abandoned (incomplete) checkpoint or savepoint older than the newest
    /// completed checkpoint. Completed savepoints are never deleted here.
    pub async fn apply_retention(&self, retain: usize) -> Result<()> {
        let list = self.list().await?;
        let checkpoints: Vec<_> = list.iter().filter(|s| s.kind == SnapshotKind::Checkpoint).collect();
        let complete: Vec<_> = checkpoints.iter().filter(|s| s.complete).collect();
        let newest = complete.last().map(|s| s.id).unwrap_or(0);
        let keep_from = complete.len().saturating_sub(retain);
        for (i, s) in complete.iter().enumerate() {
            if i < keep_from && !s.is_latest {
                self.dir(&s.dir).delete_all().await?;
            }
        }
        for s in checkpoints.iter().filter(|s| !s.complete && s.id < newest) {
            self.dir(&s.dir).delete_all().await?;
        }
        // A savepoint cut off by a failure never completes, and nobody
        // lists it to dispose of it: once a later checkpoint completed it
        // can no longer be in progress (one snapshot at a time, ids rise).
        for s in list.iter().filter(|s| s.kind == SnapshotKind::Savepoint && !s.complete && s.id < newest) {
            tracing::info!(savepoint = %s.location, "deleting a savepoint that never completed");
            self.dir(&s.dir).delete_all().await?;
        }
        self.discard_unreferenced_shared(newest).await
    }

    /// Deletes the shared state files (of incremental checkpoints) that no
    /// complete checkpoint references, of checkpoints up to `newest`: a
    /// newer one may be in progress, its files not referenced yet. This is
    /// the reference count: a file lives as long as a retained checkpoint
    /// names it.
    async fn discard_unreferenced_shared(&self, newest: u64) -> Result<()> {
        let shared = self.dir(SHARED_DIR);
        let names = self.job_root.list_objects(SHARED_DIR).await?;
        let staging = shared.local_staging_files().await?;
        if names.is_empty() && staging.is_empty() {
            return Ok(());
        }
        let mut referenced = std::collections::HashSet::new();
        for (info, meta) in self.list_with_metadata().await? {
            let Some(meta) = meta else { continue };
            if info.kind != SnapshotKind::Checkpoint {
                continue;
            }
            for s in meta.operators.values().flatten() {
                referenced.extend(s.shared.iter().map(|f| f.name.clone()));
            }
        }
        let id_of = shared_file_checkpoint;
        for name in names {
            if id_of(&name).is_some_and(|id| id <= newest) && !referenced.contains(&name) {
                shared.delete(&name).await?;
            }
        }
        // A write cut off by a kill leaves the local store's staging file
        // (`<name>#<n>`): garbage, whoever names `<name>`, once its
        // checkpoint can no longer be in progress.
        for name in staging {
            let file = name.rsplit_once('#').map_or(name.as_str(), |(f, _)| f);
            if id_of(file).is_some_and(|id| id <= newest) {
                shared.delete_local_staging(&name).await?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_states_identity_is_created_once_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let id = storage.identity().await.unwrap();
        assert_eq!(storage.identity().await.unwrap(), id);
        let other = CheckpointStorage::open(dir.path().join("other").to_str().unwrap(), "job", true).unwrap();
        assert_ne!(other.identity().await.unwrap(), id, "two states of one job share an identity");
        std::fs::write(dir.path().join("job").join(IDENTITY), "not:an:id").unwrap();
        assert!(storage.identity().await.unwrap_err().to_string().contains("identity is damaged"));
    }

    #[test]
    fn staging_names_are_those_the_local_store_writes() {
        assert!(is_local_staging("running_count-0-0-2becc7ad03-chk10.arrow#1"));
        assert!(is_local_staging("x#42"));
        for name in ["x#", "x#a1", "x", "x#1a"] {
            assert!(!is_local_staging(name), "{name}");
        }
    }

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[tokio::test]
    async fn retention_removes_the_staging_files_of_writes_a_kill_cut_off_but_not_of_a_checkpoint_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let shared = storage.dir(SHARED_DIR);
        shared.put("a-chk3.arrow", b"unreferenced".to_vec()).await.unwrap();
        let on_disk = dir.path().join("job").join(SHARED_DIR);
        std::fs::write(on_disk.join("a-chk3.arrow#1"), b"cut off").unwrap();
        std::fs::write(on_disk.join("a-chk9.arrow#2"), b"being written").unwrap();
        // The store's own listing does not see them: that is the point.
        assert_eq!(storage.job_root.list_objects(SHARED_DIR).await.unwrap(), ["a-chk3.arrow"]);
        storage.discard_unreferenced_shared(5).await.unwrap();
        assert_eq!(names(&on_disk), ["a-chk9.arrow#2"]);
    }

    #[tokio::test]
    async fn a_savepoint_is_disposed_of_only_by_its_own_location_and_never_while_it_is_the_latest() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        for rel in ["savepoints/sp-3-1700", "savepoints/sp-5-1800", "checkpoints/chk-4"] {
            storage.dir(rel).put(METADATA_FILE, b"{}".to_vec()).await.unwrap();
            storage.dir(&format!("{rel}/wal-sink")).put("entry.arrow", b"log copy".to_vec()).await.unwrap();
        }
        let location = |rel: &str| storage.dir(rel).display;
        // Anything but a savepoint directory of this job is refused, and kept.
        let other = CheckpointStorage::open(dir.path().join("elsewhere").to_str().unwrap(), "job", true).unwrap();
        for bad in [location("checkpoints/chk-4"), location("savepoints/sp-3-1700/wal-sink"), other.dir("savepoints/sp-3-1700").display, location("savepoints/sp-x-1")] {
            assert!(matches!(storage.dispose_savepoint(&bad).await, Err(Disposal::NotASavepoint(m)) if m.contains("no savepoint of this job")), "{bad}");
        }
        assert!(dir.path().join("job/checkpoints/chk-4/_metadata").exists());
        // The job's latest snapshot (a run restored from it and completed nothing since) stays.
        let claim = storage.claim_run("run-a").await.unwrap();
        storage.begin_lineage(&claim, Some(&storage.dir("savepoints/sp-5-1800"))).await.unwrap();
        assert_eq!(storage.latest_pointer().await.unwrap().as_deref(), Some("savepoints/sp-5-1800"));
        assert!(matches!(storage.dispose_savepoint(&location("savepoints/sp-5-1800")).await, Err(Disposal::Latest(_))));
        // Another one goes whole, log copies included; a second disposal finds nothing.
        assert!(storage.dispose_savepoint(&format!("{}/", location("savepoints/sp-3-1700"))).await.unwrap());
        assert!(!dir.path().join("job/savepoints/sp-3-1700").exists());
        assert!(!storage.dispose_savepoint(&location("savepoints/sp-3-1700")).await.unwrap());
        assert!(dir.path().join("job/savepoints/sp-5-1800/wal-sink/entry.arrow").exists());
    }

    #[tokio::test]
    async fn retention_deletes_a_savepoint_cut_off_before_a_later_checkpoint_but_keeps_completed_and_newer_ones() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let complete = |id: u64, kind: SnapshotKind| CheckpointMetadata::new("job", id, kind, 1, 128, false).encode();
        storage.dir("savepoints/sp-1-10").put(METADATA_FILE, complete(1, SnapshotKind::Savepoint)).await.unwrap();
        storage.dir("savepoints/sp-2-20").put("state.arrow", b"cut off".to_vec()).await.unwrap();
        storage.dir("checkpoints/chk-3").put(METADATA_FILE, complete(3, SnapshotKind::Checkpoint)).await.unwrap();
        storage.dir("savepoints/sp-4-40").put("state.arrow", b"in progress".to_vec()).await.unwrap();
        storage.apply_retention(1).await.unwrap();
        let left = names(&dir.path().join("job/savepoints"));
        assert_eq!(left, ["sp-1-10", "sp-4-40"]);
    }

    #[tokio::test]
    async fn deleting_a_snapshot_directory_removes_staging_files_and_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let chk = storage.dir("checkpoints/chk-4");
        chk.put("state.arrow", b"state".to_vec()).await.unwrap();
        let on_disk = dir.path().join("job/checkpoints/chk-4");
        std::fs::create_dir_all(on_disk.join("sub")).unwrap();
        std::fs::write(on_disk.join("sub/other.arrow#7"), b"cut off").unwrap();
        chk.delete_all().await.unwrap();
        assert!(!on_disk.exists(), "left: {:?}", names(&on_disk));
    }

    /// The in-memory store, except that deleting the object named `fails`
    /// fails (a request refused, a process killed mid-deletion).
    #[derive(Debug)]
    struct OneDeleteFails {
        inner: object_store::memory::InMemory,
        fails: &'static str,
    }

    impl std::fmt::Display for OneDeleteFails {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "in-memory store whose delete of {} fails", self.fails)
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for OneDeleteFails {
        async fn put_opts(&self, location: &Path, payload: PutPayload, opts: object_store::PutOptions) -> object_store::Result<object_store::PutResult> {
            self.inner.put_opts(location, payload, opts).await
        }
        async fn put_multipart_opts(&self, location: &Path, opts: object_store::PutMultipartOptions) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.inner.put_multipart_opts(location, opts).await
        }
        async fn get_opts(&self, location: &Path, options: object_store::GetOptions) -> object_store::Result<object_store::GetResult> {
            self.inner.get_opts(location, options).await
        }
        fn delete_stream(
            &self,
            locations: futures::stream::BoxStream<'static, object_store::Result<Path>>,
        ) -> futures::stream::BoxStream<'static, object_store::Result<Path>> {
            let fails = self.fails;
            let inner = self.inner.clone();
            Box::pin(locations.and_then(move |p| {
                let inner = inner.clone();
                async move {
                    if p.filename() == Some(fails) {
                        return Err(object_store::Error::Generic { store: "test", source: "refused".into() });
                    }
                    inner.delete(&p).await.map(|()| p)
                }
            }))
        }
        fn list(&self, prefix: Option<&Path>) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
            self.inner.list(prefix)
        }
        async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<object_store::ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }
        async fn copy_opts(&self, from: &Path, to: &Path, options: object_store::CopyOptions) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }

    #[tokio::test]
    async fn a_snapshot_deletion_cut_short_leaves_it_incomplete_never_complete_without_a_state_file() {
        // `Counts-0.arrow` lists before `_metadata` (uppercase sorts first).
        let store = Arc::new(OneDeleteFails { inner: object_store::memory::InMemory::new(), fails: "Counts-1.arrow" });
        let chk = Location { store: store.clone(), prefix: Path::from("job/checkpoints/chk-3"), display: "mem://job/checkpoints/chk-3".into(), local: None };
        for name in ["Counts-0.arrow", "Counts-1.arrow", METADATA_FILE, "source-0.arrow"] {
            chk.put(name, b"x".to_vec()).await.unwrap();
        }
        assert!(chk.delete_all().await.is_err(), "the refused delete is reported");
        let left = chk.list_objects("").await.unwrap();
        assert!(!left.iter().any(|n| n == METADATA_FILE), "`_metadata` went first, so the snapshot is incomplete: {left:?}");
    }
}
