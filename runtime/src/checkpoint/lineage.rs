//! A job's lineage in storage, and the fence that stops a superseded run.
//!
//! Every run of a job (each `weir run` attempt, each set of pods the operator
//! starts) first **claims a run epoch**: it creates `lineage/<epoch>/claim`
//! with a create-only put (`PutMode::Create`: a hard link on local disk,
//! `If-None-Match: *` on S3), one above the highest epoch it lists. Exactly
//! one run gets each epoch, and epochs are claimed in order, so a run that
//! finds `lineage/<its epoch + 1>/claim` knows that a newer run exists.
//!
//! The lineage's "latest" is not one pointer that is overwritten (a frozen
//! run that wakes up could overwrite it after a newer run moved it) but a log
//! of create-only records, each in the directory of the run that wrote it:
//!
//! ```text
//! lineage/<epoch>/claim          {"run_id": …}: this run exists
//! lineage/<epoch>/start          where the run began: a snapshot dir, a location, or empty (fresh)
//! lineage/<epoch>/chk-<id>       the run completed checkpoint <id>
//! ```
//!
//! `latest` is read from the **newest run that has a `start`**: its newest
//! checkpoint record, else its start. Records of older runs are ignored, so a
//! superseded run that completes a checkpoint late changes nothing a newer
//! run, or the run after it, restores.
//!
//! Why a superseded run can never publish output: a run writes a checkpoint's
//! record and *then* checks the fence (no newer claim) before it tells any
//! sink to commit. A newer run claims *before* it resolves what to restore.
//! If the old run's check passed, its record was written before the newer
//! claim, so the newer run restores that checkpoint (or a later one) and its
//! output is the newer run's own history. If the check failed, nothing was
//! committed: the pending files stay pending. Checkpoint directories are owned
//! the same way (`chk-<id>/_owner`, create-only, before the trigger), so two
//! runs never write state files into one directory.

use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use super::metadata::now_unix_ms;
use super::storage::{CheckpointStorage, Location};
use crate::error::{Error, Result};

const LINEAGE: &str = "lineage";
/// The single pointer that older versions overwrote; read when no run of
/// the job has started a lineage yet, so their state directories restore.
const LEGACY_LATEST: &str = "checkpoints/_latest";
const OWNER: &str = "_owner";

/// A run's claim on the job's state: the epoch it holds and who it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunClaim {
    pub epoch: u64,
    pub run_id: String,
}

fn epoch_dir(epoch: u64) -> String {
    format!("{LINEAGE}/{epoch:020}")
}

impl Location {
    /// Creates an object only if it does not exist (durable on local disk,
    /// like [`Location::put_durable`]); `false` when it already exists.
    pub async fn create_durable(&self, name: &str, bytes: Vec<u8>) -> Result<bool> {
        let path = self.object_path(name);
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        match self.store.put_opts(&path, PutPayload::from(bytes), opts).await {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => return Ok(false),
            Err(e) => return Err(Error::storage(format!("{}/{name}", self.display))(e)),
        }
        self.sync_local(name).await?;
        Ok(true)
    }

    /// Whether an object exists.
    pub async fn exists(&self, name: &str) -> Result<bool> {
        match self.store.head(&self.object_path(name)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(Error::storage(format!("{}/{name}", self.display))(e)),
        }
    }
}

impl CheckpointStorage {
    /// Claims the next run epoch for `run_id`. Called by the one process of
    /// a run that completes checkpoints (worker 0), before it resolves what
    /// to restore, and by `weir run` before its first attempt.
    pub async fn claim_run(&self, run_id: &str) -> Result<RunClaim> {
        let body = serde_json::json!({ "run_id": run_id, "claimed_unix_ms": now_unix_ms() });
        for _ in 0..64 {
            let epoch = self.epochs().await?.last().map_or(1, |e| e + 1);
            let name = format!("{}/claim", epoch_dir(epoch));
            if self.job_root.create_durable(&name, body.to_string().into_bytes()).await? {
                tracing::info!(epoch, run_id, "claimed the job's run epoch");
                return Ok(RunClaim { epoch, run_id: run_id.into() });
            }
            // A retried request whose first try succeeded also ends up here:
            // the claim is ours if it names this run.
            if self.claim_holder(epoch).await?.as_deref() == Some(run_id) {
                return Ok(RunClaim { epoch, run_id: run_id.into() });
            }
        }
        Err(Error::StateDir {
            dir: self.job_root.display.clone(),
            message: "could not claim a run epoch: other runs of this job keep claiming them at the same time".into(),
        })
    }

    /// Fails with [`Error::Fenced`] once a newer run has claimed the job.
    pub async fn check_fence(&self, claim: &RunClaim) -> Result<()> {
        let next = claim.epoch + 1;
        if !self.job_root.exists(&format!("{}/claim", epoch_dir(next))).await? {
            return Ok(());
        }
        let newer = self.claim_holder(next).await?.unwrap_or_else(|| "unknown".into());
        Err(Error::Fenced { run_id: claim.run_id.clone(), epoch: claim.epoch, newer, location: self.job_root.display.clone() })
    }

    /// Starts this run's lineage at `start` (the snapshot it restores, or
    /// nothing for a fresh start). From then on `latest` is this run's: its
    /// start until it completes a checkpoint. A run that restores a snapshot
    /// writes this before any sink commits that snapshot's pending files, so
    /// a later restore never goes back to an older checkpoint.
    pub async fn begin_lineage(&self, claim: &RunClaim, start: Option<&Location>) -> Result<()> {
        let pointer = start.map(|l| self.pointer_to(l)).unwrap_or_default();
        let name = format!("{}/start", epoch_dir(claim.epoch));
        if !self.job_root.create_durable(&name, format!("{pointer}\n").into_bytes()).await? {
            let existing = self.job_root.get(&name).await?.map(|b| String::from_utf8_lossy(&b).trim().to_string());
            if existing.as_deref() != Some(pointer.as_str()) {
                return Err(Error::StateDir {
                    dir: self.job_root.display.clone(),
                    message: format!("run epoch {} already started its lineage elsewhere", claim.epoch),
                });
            }
        }
        // A newer run may have claimed in between; then it resolves its own
        // start after its claim and never reads this one.
        self.check_fence(claim).await
    }

    /// Records that `claim`'s run completed the checkpoint in `rel_dir`, then
    /// checks the fence: only when this returns Ok may sinks be told to commit.
    pub(super) async fn record_completed(&self, claim: &RunClaim, id: u64, rel_dir: &str) -> Result<()> {
        let name = format!("{}/chk-{id:020}", epoch_dir(claim.epoch));
        self.job_root.create_durable(&name, format!("{rel_dir}\n").into_bytes()).await?;
        self.check_fence(claim).await
    }

    /// Makes `rel_dir` this run's before anything is written into it; `false`
    /// when another run owns it (that run's id must not be reused).
    pub async fn own_dir(&self, claim: &RunClaim, rel_dir: &str) -> Result<bool> {
        let dir = self.dir(rel_dir);
        let body = serde_json::to_vec(claim).unwrap_or_default();
        if dir.create_durable(OWNER, body.clone()).await? {
            return Ok(true);
        }
        Ok(dir.get(OWNER).await?.is_some_and(|b| b == body))
    }

    /// The pointer text of the lineage's newest state: a snapshot directory
    /// relative to the job (`checkpoints/chk-7`), a location elsewhere, or
    /// `None` (no state: a fresh lineage, or nothing ever ran).
    pub async fn latest_pointer(&self) -> Result<Option<String>> {
        // Old runs' records may be deleted while this reads them (see
        // `forget_older_records`); a missing record means: read again.
        for _ in 0..5 {
            match self.try_latest_pointer().await? {
                Resolution::Pointer(p) => return Ok(p.filter(|p| !p.is_empty())),
                Resolution::Moved => continue,
            }
        }
        Err(Error::StateDir { dir: self.job_root.display.clone(), message: "the job's lineage keeps changing while it is read".into() })
    }

    async fn try_latest_pointer(&self) -> Result<Resolution> {
        for epoch in self.epochs().await?.into_iter().rev() {
            let dir = epoch_dir(epoch);
            let names = self.job_root.list_objects(&dir).await?;
            let newest = names.iter().filter(|n| n.starts_with("chk-")).max();
            let record = match newest {
                Some(n) => n.as_str(),
                None if names.iter().any(|n| n == "start") => "start",
                // Claimed but never started: that run did nothing.
                None => continue,
            };
            return match self.job_root.get(&format!("{dir}/{record}")).await? {
                Some(bytes) => Ok(Resolution::Pointer(Some(self.parse_pointer(&format!("{dir}/{record}"), &bytes)?))),
                None => Ok(Resolution::Moved),
            };
        }
        match self.job_root.get(LEGACY_LATEST).await? {
            Some(bytes) => Ok(Resolution::Pointer(Some(self.parse_pointer(LEGACY_LATEST, &bytes)?))),
            None => Ok(Resolution::Pointer(None)),
        }
    }

    fn parse_pointer(&self, record: &str, bytes: &[u8]) -> Result<String> {
        let corrupted = || Error::BadCheckpoint {
            location: format!("{}/{record}", self.job_root.display),
            message: "the lineage record is corrupted: expected the directory of a checkpoint or savepoint".into(),
        };
        let text = std::str::from_utf8(bytes).map_err(|_| corrupted())?.trim();
        let ok = text.is_empty()
            || text.starts_with("checkpoints/chk-")
            || text.starts_with("savepoints/sp-")
            || text.starts_with('/')
            || text.starts_with("file://")
            || weir_api::object_store_url::object_store_kind(text).is_some_and(|k| k.is_ok());
        if !ok || text.contains('\n') {
            return Err(Error::BadCheckpoint {
                location: format!("{}/{record}", self.job_root.display),
                message: format!("the lineage record is corrupted (`{}`)", text.chars().take(80).collect::<String>()),
            });
        }
        Ok(text.to_string())
    }

    /// A pointer to `location`: relative when it is inside this job's storage.
    fn pointer_to(&self, location: &Location) -> String {
        let root = format!("{}/", self.job_root.display.trim_end_matches('/'));
        match location.display.strip_prefix(&root) {
            Some(rel) if rel.starts_with("checkpoints/chk-") || rel.starts_with("savepoints/sp-") => rel.to_string(),
            _ => location.display.clone(),
        }
    }

    /// Whether any run of the job ever left a trace here: a lineage, or the
    /// pointer of an older version.
    pub async fn has_lineage(&self) -> Result<bool> {
        Ok(!self.epochs().await?.is_empty() || self.job_root.exists(LEGACY_LATEST).await?)
    }

    /// The claimed epochs, ascending.
    async fn epochs(&self) -> Result<Vec<u64>> {
        let mut epochs: Vec<u64> = self.job_root.list_dirs(LINEAGE).await?.iter().filter_map(|d| d.parse().ok()).collect();
        epochs.sort_unstable();
        Ok(epochs)
    }

    /// The ids of every run that claimed this state (claims are never
    /// deleted). Output a run leaves behind carries its run id, so this is
    /// what makes a leftover this state's to clean up: another state of the
    /// same job id (a second job of one name sharing the output) has runs
    /// of its own.
    pub async fn claimed_runs(&self) -> Result<std::collections::HashSet<String>> {
        let mut runs = std::collections::HashSet::new();
        for epoch in self.epochs().await? {
            runs.extend(self.claim_holder(epoch).await?);
        }
        Ok(runs)
    }

    async fn claim_holder(&self, epoch: u64) -> Result<Option<String>> {
        let Some(bytes) = self.job_root.get(&format!("{}/claim", epoch_dir(epoch))).await? else { return Ok(None) };
        Ok(serde_json::from_slice::<serde_json::Value>(&bytes).ok().and_then(|v| v["run_id"].as_str().map(String::from)))
    }

    /// Deletes what `latest` can no longer read: this run's own checkpoint
    /// records but the newest, and with `older_runs` the records of runs
    /// older than `claim`'s (their claims stay: they are the fence). A run
    /// asks for the older runs once, so that a job restarted many times does
    /// not list every old run at every checkpoint. Best effort.
    pub async fn forget_older_records(&self, claim: &RunClaim, older_runs: bool) -> Result<()> {
        let epochs = if older_runs { self.epochs().await? } else { vec![claim.epoch] };
        for epoch in epochs {
            let dir = epoch_dir(epoch);
            let names = self.job_root.list_objects(&dir).await?;
            let newest = names.iter().filter(|n| n.starts_with("chk-")).max().cloned();
            for name in names {
                let stale = if epoch < claim.epoch {
                    name != "claim"
                } else {
                    epoch == claim.epoch && name.starts_with("chk-") && Some(&name) != newest.as_ref()
                };
                if stale {
                    self.job_root.delete(&format!("{dir}/{name}")).await?;
                }
            }
        }
        Ok(())
    }
}

enum Resolution {
    Pointer(Option<String>),
    /// A record listed a moment ago is gone: a newer run cleaned up.
    Moved,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage(dir: &std::path::Path) -> CheckpointStorage {
        CheckpointStorage::open(&dir.display().to_string(), "job", true).unwrap()
    }

    #[tokio::test]
    async fn each_run_claims_the_next_epoch_and_an_older_run_is_fenced() {
        let tmp = tempfile::tempdir().unwrap();
        let s = storage(tmp.path());
        let a = s.claim_run("run-a").await.unwrap();
        s.check_fence(&a).await.unwrap();
        let b = s.claim_run("run-b").await.unwrap();
        assert_eq!((a.epoch, b.epoch), (1, 2));
        let err = s.check_fence(&a).await.unwrap_err();
        assert!(matches!(err, Error::Fenced { .. }) && err.to_string().contains("run-b"), "{err}");
        s.check_fence(&b).await.unwrap();
    }

    #[tokio::test]
    async fn latest_is_the_newest_started_runs_newest_record_whatever_older_runs_write_later() {
        let tmp = tempfile::tempdir().unwrap();
        let s = storage(tmp.path());
        assert_eq!(s.latest_pointer().await.unwrap(), None);
        let old = s.claim_run("old").await.unwrap();
        s.begin_lineage(&old, None).await.unwrap();
        s.record_completed(&old, 3, "checkpoints/chk-3").await.unwrap();
        assert_eq!(s.latest_pointer().await.unwrap().as_deref(), Some("checkpoints/chk-3"));

        let new = s.claim_run("new").await.unwrap();
        // Claimed but not started: still the old run's history.
        assert_eq!(s.latest_pointer().await.unwrap().as_deref(), Some("checkpoints/chk-3"));
        s.begin_lineage(&new, Some(&s.dir("checkpoints/chk-3"))).await.unwrap();
        // The old run wakes up and completes checkpoint 4: it is fenced, and
        // its record changes nothing.
        assert!(matches!(s.record_completed(&old, 4, "checkpoints/chk-4").await, Err(Error::Fenced { .. })));
        assert_eq!(s.latest_pointer().await.unwrap().as_deref(), Some("checkpoints/chk-3"));
        s.record_completed(&new, 5, "checkpoints/chk-5").await.unwrap();
        s.record_completed(&new, 10, "checkpoints/chk-10").await.unwrap();
        assert_eq!(s.latest_pointer().await.unwrap().as_deref(), Some("checkpoints/chk-10"), "ids compare as numbers");
        s.forget_older_records(&new, true).await.unwrap();
        assert_eq!(s.latest_pointer().await.unwrap().as_deref(), Some("checkpoints/chk-10"));
        assert!(s.check_fence(&old).await.is_err(), "the fence outlives the cleanup");
    }

    #[tokio::test]
    async fn a_fresh_start_hides_the_previous_runs_state() {
        let tmp = tempfile::tempdir().unwrap();
        let s = storage(tmp.path());
        let first = s.claim_run("first").await.unwrap();
        s.begin_lineage(&first, None).await.unwrap();
        s.record_completed(&first, 1, "checkpoints/chk-1").await.unwrap();
        let second = s.claim_run("second").await.unwrap();
        s.begin_lineage(&second, None).await.unwrap();
        assert_eq!(s.latest_pointer().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_directory_is_owned_by_one_run_only() {
        let tmp = tempfile::tempdir().unwrap();
        let s = storage(tmp.path());
        let a = s.claim_run("a").await.unwrap();
        let b = s.claim_run("b").await.unwrap();
        assert!(s.own_dir(&a, "checkpoints/chk-1").await.unwrap());
        assert!(s.own_dir(&a, "checkpoints/chk-1").await.unwrap(), "owning again is fine");
        assert!(!s.own_dir(&b, "checkpoints/chk-1").await.unwrap());
    }

    #[tokio::test]
    async fn a_damaged_record_is_a_bad_checkpoint_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let s = storage(tmp.path());
        let a = s.claim_run("a").await.unwrap();
        s.begin_lineage(&a, None).await.unwrap();
        s.record_completed(&a, 1, "checkpoints/chk-1").await.unwrap();
        let record = tmp.path().join("job/lineage/00000000000000000001/chk-00000000000000000001");
        std::fs::write(&record, b"\xff\xfe garbage").unwrap();
        let err = s.latest_pointer().await.unwrap_err();
        assert!(err.to_string().contains("lineage/00000000000000000001/chk-"), "{err}");
    }

    #[tokio::test]
    async fn a_state_directory_of_an_older_version_still_resolves_its_latest() {
        let tmp = tempfile::tempdir().unwrap();
        let s = storage(tmp.path());
        s.job_root.put(LEGACY_LATEST, b"checkpoints/chk-4\n".to_vec()).await.unwrap();
        assert_eq!(s.latest_pointer().await.unwrap().as_deref(), Some("checkpoints/chk-4"));
    }
}
