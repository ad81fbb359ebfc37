//! A throwaway server of one test (MinIO, Azurite): a process on a free
//! loopback port with its data in a temporary directory, killed when the
//! test's last handle to it is dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server's program: `$variable` when set, else the newest
/// `<cache>/<dir>/<prefix>*/<path>` of the build cache (`$WEIR_CACHE`,
/// default ~/.cache/weir), where the project's scripts install it; the
/// panic says which script (`install`) to run.
pub fn cached_program(variable: &str, dir: &str, prefix: &str, path: &str, install: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(variable) {
        return p.into();
    }
    let cache = std::env::var_os("WEIR_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/weir"));
    let mut found: Vec<PathBuf> = std::fs::read_dir(cache.join(dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path().join(path))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!("no {path} under {}/{dir}/{prefix}*: install it with `{install}` (scripts/test does), or set {variable}", cache.display())
    })
}

pub struct ServerProcess {
    child: Option<Child>,
    pub port: u16,
    pub data: tempfile::TempDir,
}

impl ServerProcess {
    /// Starts a server on a free port: `spawn` starts it on `self.port`
    /// (see [`ServerProcess::run_until_ready`]); a port that turns out to be
    /// taken costs another try, five at most.
    pub fn start(spawn: impl Fn(&mut ServerProcess) -> Result<(), String>) -> ServerProcess {
        let mut process = ServerProcess { child: None, port: 0, data: tempfile::tempdir().unwrap() };
        for attempt in 1.. {
            process.port = super::free_port();
            match spawn(&mut process) {
                Ok(()) => break,
                Err(e) if attempt < 5 => eprintln!("{e}; trying another port"),
                Err(e) => panic!("{e}"),
            }
        }
        process
    }

    /// Runs `command` (output discarded) and waits until `ready` holds
    /// while the process still runs, 60 s at most; an error if it exited
    /// instead (its port taken). `what` names the server in messages.
    pub fn run_until_ready(&mut self, mut command: Command, what: &str, ready: impl Fn(u16) -> bool) -> Result<(), String> {
        let child = command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap_or_else(|e| panic!("starting {what}: {e}"));
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                return Err(format!("{what} on port {} exited ({status}); was the port taken?", self.port));
            }
            // Ours answered only if it is still alive (another server may hold the port).
            if ready(self.port) && self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none()) {
                return Ok(());
            }
            assert!(start.elapsed() < Duration::from_secs(60), "{what} did not become ready on port {} within 60 s", self.port);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the server (SIGKILL: what a crash or a lost node looks like to clients).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}
