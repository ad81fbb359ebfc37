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
