//! One `weir run` of a job at a time on shared storage (`s3://`), where there
//! is no kernel lock to hold: the run keeps a lease object, `run.lease` in the
//! job's storage, fresh (renewed every [`RENEW`]), and a second `weir run`
//! that finds a fresh lease of a live holder is refused with a message naming
//! it. A lease of a holder on this host whose process is gone, or one not
//! renewed for [`EXPIRY`], is stale and taken over.
//!
//! The lease is what makes a mistake visible; it is not what keeps the output
//! exactly once. Two runs that start at the same moment can both take it; the
//! run fence in storage (`checkpoint/lineage.rs`) then stops the older one
//! before it commits anything. The expiry compares wall clocks of two
//! machines, so it assumes they agree to within a few seconds.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::run_lock::pid_alive;
use crate::checkpoint::{now_unix_ms, CheckpointStorage, Location};
use crate::error::{Error, Result};

pub const RUN_LEASE: &str = "run.lease";
const RENEW: Duration = Duration::from_secs(2);
const EXPIRY: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseBody {
    job: String,
    host: String,
    pid: u32,
    lease_id: String,
    started_unix_ms: u64,
    renewed_unix_ms: u64,
}

/// A held lease; renewed in the background until released or dropped.
pub struct RunLease {
    root: Location,
    lease_id: String,
    renewal: tokio::task::JoinHandle<()>,
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "unknown".into())
}

impl RunLease {
    /// Takes the job's lease, or says who holds it.
    pub async fn acquire(storage: &CheckpointStorage, job: &str, lease_id: &str) -> Result<RunLease> {
        let root = storage.job_root.clone();
        let host = host_name();
        if let Some(bytes) = root.get(RUN_LEASE).await? {
            // A lease that cannot be read is treated as stale: it names no one.
            if let Ok(other) = serde_json::from_slice::<LeaseBody>(&bytes) {
                let age_ms = now_unix_ms().saturating_sub(other.renewed_unix_ms);
                let holder_gone = other.host == host && !pid_alive(other.pid);
                if age_ms < EXPIRY.as_millis() as u64 && !holder_gone {
                    return Err(Error::AlreadyRunning {
                        message: format!(
                            "job `{job}` is already running on this state storage ({}): `weir run` pid {} on host {} started at unix time {} and renewed its lease {:.1}s ago; \
                             two runs of one job would commit every record twice. Stop that run first (a run that died leaves a lease that expires {}s after its last renewal)",
                            root.display,
                            other.pid,
                            other.host,
                            other.started_unix_ms / 1000,
                            age_ms as f64 / 1000.0,
                            EXPIRY.as_secs()
                        ),
                    });
                }
            }
        }
        let mut body = LeaseBody {
            job: job.into(),
            host,
            pid: std::process::id(),
            lease_id: lease_id.into(),
            started_unix_ms: now_unix_ms(),
            renewed_unix_ms: now_unix_ms(),
        };
        write(&root, &body).await?;
        let renew_root = root.clone();
        let renewal = tokio::spawn(async move {
            loop {
                tokio::time::sleep(RENEW).await;
                body.renewed_unix_ms = now_unix_ms();
                if let Err(e) = write(&renew_root, &body).await {
                    tracing::warn!(error = %e, "could not renew the run lease");
                }
            }
        });
        Ok(RunLease { root, lease_id: lease_id.into(), renewal })
    }

    /// Stops renewing and deletes the lease if it is still this run's.
    pub async fn release(self) {
        self.renewal.abort();
        let ours = match self.root.get(RUN_LEASE).await {
            Ok(Some(b)) => serde_json::from_slice::<LeaseBody>(&b).is_ok_and(|l| l.lease_id == self.lease_id),
            _ => false,
        };
        if ours {
            let _ = self.root.delete(RUN_LEASE).await;
        }
    }
}

impl Drop for RunLease {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

async fn write(root: &Location, body: &LeaseBody) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(body).map_err(|e| Error::Job(e.to_string()))?;
    root.put(RUN_LEASE, bytes).await
}
