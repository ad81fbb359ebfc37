//! `run.json` in the job's storage: how to reach a running local job (the
//! control API's address and token, the process ids), for `weir savepoint`,
//! `weir status` and for tests that kill processes. It holds the token, so
//! only its owner may read it (0600).

use serde::{Deserialize, Serialize};

use crate::checkpoint::{CheckpointStorage, Location};
use crate::error::{Error, Result};

pub const RUN_INFO: &str = "run.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunInfo {
    pub job: String,
    pub supervisor_pid: u32,
    pub worker_pids: Vec<u32>,
    pub api: std::net::SocketAddr,
    pub token: String,
    pub run_id: String,
    pub attempt: u32,
}

impl RunInfo {
    pub async fn write(&self, storage: &CheckpointStorage) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| Error::Job(e.to_string()))?;
        storage.job_root.put_private(RUN_INFO, bytes).await
    }
}

/// The run info of `job` under `state_dir`, or of the only job there when `job` is None.
pub async fn find_run(state_dir: &str, job: Option<&str>) -> Result<RunInfo> {
    let root = Location::parse(state_dir, false)?;
    let job = match job {
        Some(j) => j.to_string(),
        None => {
            let jobs = root.list_dirs("").await?;
            let mut with_runs = Vec::new();
            for j in jobs {
                if root.child(&j).get(RUN_INFO).await?.is_some() {
                    with_runs.push(j);
                }
            }
            match with_runs.len() {
                1 => with_runs.remove(0),
                0 => return Err(Error::StateDir { dir: state_dir.into(), message: "no job has run here: start one with `weir run`".into() }),
                _ => return Err(Error::StateDir { dir: state_dir.into(), message: format!("holds several jobs ({}): choose one with --job", with_runs.join(", ")) }),
            }
        }
    };
    let bytes = root.child(&job).get(RUN_INFO).await?.ok_or_else(|| Error::StateDir {
        dir: state_dir.into(),
        message: format!("job `{job}` has no run information: is it running with this --state-dir?"),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| Error::StateDir { dir: state_dir.into(), message: format!("{RUN_INFO} of `{job}` is damaged: {e}") })
}
