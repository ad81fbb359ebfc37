//! One run of a job at a time: `weir run` holds an exclusive `flock` on
//! `run.lock` in the job's state directory, and one on `.weir-<job>.lock` in
//! a file sink's output directory, for as long as any process of the run is
//! alive.
//!
//! The lock is the kernel's, not a file's existence: it is released when the
//! last process holding it dies, however it dies, so a crashed run never
//! leaves a stale lock behind. The descriptors are inherited by the worker
//! processes (see [`RunLock::keep_across_exec`]), so a supervisor killed with
//! SIGKILL keeps the job locked until its workers are gone too; a new run
//! cannot start while an old worker could still write a checkpoint or commit
//! output. The file's content only names the holder, for the refusal message.
//!
//! Deliberately local: object stores have no such lock. On shared storage a
//! lease refuses a second run (`run_lease.rs`), and the run fence in storage
//! (`checkpoint/lineage.rs`) keeps any superseded run from committing.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Who holds a lock: written into the lock file for the next one to read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Holder {
    pub job: String,
    pub pid: u32,
    pub started_unix_ms: u64,
    pub state_dir: String,
}

/// An exclusive lock held by this process (and, once spawned, its workers).
pub struct RunLock {
    file: File,
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock at `path` or says who holds it. `what` names the
    /// directory's role for the message ("state directory", "output directory").
    pub fn acquire(path: &Path, what: &str, holder: &Holder) -> Result<RunLock> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(Error::io(format!("opening the run lock {}", path.display())))?;
        // A holder that has just died may still have workers on their way
        // out (SIGKILL is delivered, the descriptors are not closed yet):
        // wait a moment for those, never for a live holder.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(Error::io(format!("locking {}", path.display()))(err));
            }
            let other = read_holder(&mut file);
            let holder_alive = other.as_ref().map(|h| pid_alive(h.pid)).unwrap_or(true);
            if holder_alive || Instant::now() >= deadline {
                return Err(Error::AlreadyRunning { message: refusal(path, what, holder, other.as_ref()) });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = serde_json::to_vec_pretty(holder).map_err(|e| Error::Job(e.to_string()))?;
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(&text))
            .map_err(Error::io(format!("writing the run lock {}", path.display())))?;
        Ok(RunLock { file, path: path.to_path_buf() })
    }

    /// Lets a child process inherit the lock: call in `pre_exec` (after fork,
    /// before exec). The child then holds the same lock until it exits.
    pub fn keep_across_exec(&self) -> impl Fn() -> std::io::Result<()> + Send + Sync + 'static {
        let fd = self.file.as_raw_fd();
        move || super::keep_open_across_exec(fd)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

/// Whether a process with this pid exists on this host.
pub(super) fn pid_alive(pid: u32) -> bool {
    let r = unsafe { libc::kill(pid as i32, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn refusal(path: &Path, what: &str, me: &Holder, other: Option<&Holder>) -> String {
    let dir = path.parent().map(|p| p.display().to_string()).unwrap_or_default();
    match other {
        Some(h) => {
            let since = h.started_unix_ms / 1000;
            let same_state = h.state_dir == me.state_dir;
            format!(
                "job `{}` is already running on this {what} ({dir}): `weir run` pid {} started at unix time {since}{}; \
                 two runs of one job would commit every record twice. Stop that run first{}",
                h.job,
                h.pid,
                if same_state { String::new() } else { format!(" with --state-dir {}", h.state_dir) },
                if what == "state directory" {
                    format!(" (`weir status --state-dir {}` shows it), or use another --state-dir", me.state_dir)
                } else {
                    ", or give this job another sink path".to_string()
                }
            )
        }
        None => format!("job `{}` is already running on this {what} ({dir}): another process holds {}; stop it first", me.job, path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: u32) -> Holder {
        Holder { job: "j".into(), pid, started_unix_ms: 0, state_dir: "s".into() }
    }

    #[test]
    fn a_second_lock_of_a_live_holder_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.lock");
        let first = RunLock::acquire(&path, "state directory", &holder(std::process::id())).unwrap();
        let e = RunLock::acquire(&path, "state directory", &holder(1)).err().unwrap().to_string();
        assert!(e.contains("already running") && e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        // A child another test forks in this process holds a copy of the
        // descriptor (so the lock) until it execs: allow it a moment.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while let Err(e) = RunLock::acquire(&path, "state directory", &holder(2)) {
            assert!(std::time::Instant::now() < deadline, "the lock stayed taken after its holder let go: {e}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    fn a_lock_file_left_by_a_dead_run_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.lock");
        std::fs::write(&path, serde_json::to_vec(&holder(999_999_999)).unwrap()).unwrap();
        RunLock::acquire(&path, "state directory", &holder(std::process::id())).unwrap();
    }
}
