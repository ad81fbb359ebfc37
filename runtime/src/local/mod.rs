//! `weir run`: the local supervisor. It plays the operator's part on one
//! machine: starts the worker processes on loopback, and when one dies,
//! stops the others and restores the whole job from the latest completed
//! checkpoint, with backoff. It also draws the progress line.

pub(crate) mod listeners;
mod progress;
mod run_info;
mod run_lease;
mod run_lock;
mod supervisor;

pub use run_info::{find_run, RunInfo};
pub use run_lock::{Holder, RunLock};
pub use supervisor::{load_pipeline, run, RestoreFrom, RunOptions, RunSummary, EXIT_FATAL};

/// Clears close-on-exec on `fd` so that a worker inherits it (the run lock,
/// the listeners). Called in a `pre_exec` closure, in the child between
/// fork and exec, where only async-signal-safe calls belong: `fcntl` is one.
fn keep_open_across_exec(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // Safety: fcntl on a descriptor number has no memory effects; a closed
    // or wrong number only makes it fail, which is returned.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
