//! Shared pieces of the end-to-end tests of `weir run`: pipelines in a
//! temporary directory, the real binary, and the exactly-once oracle.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const WEIR: &str = env!("CARGO_BIN_EXE_weir");

pub struct Job {
    pub dir: tempfile::TempDir,
    pub events: u64,
    pub keys: u64,
}

impl Job {
    /// A generator → key_by → running_count → file pipeline.
    pub fn counting(parallelism: u32, events: u64, keys: u64, rate: u64, interval: &str) -> Job {
        let dir = tempfile::tempdir().unwrap();
        let yaml = format!(
            "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: {interval}\n  mode: aligned\nsource:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: {rate}\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n"
        );
        std::fs::write(dir.path().join("pipeline.yaml"), yaml).unwrap();
        Job { dir, events, keys }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn command(&self, extra: &[&str]) -> Command {
        let mut c = Command::new(WEIR);
        c.current_dir(self.dir.path()).arg("run").arg("pipeline.yaml").args(["--state-dir", "state"]).args(extra);
        c.env("RUST_LOG", "warn");
        c
    }

    pub fn spawn(&self, extra: &[&str]) -> Child {
        use std::os::unix::process::CommandExt;
        let mut c = self.command(extra);
        c.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        c.spawn().unwrap()
    }

    pub fn run(&self, extra: &[&str]) -> Output {
        self.command(extra).output().unwrap()
    }

    /// The pids of the current run's workers, once they are up.
    pub fn worker_pids(&self) -> Option<(Vec<u32>, String)> {
        let text = std::fs::read_to_string(self.path("state/eo-test/run.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let pids = v["worker_pids"].as_array()?.iter().filter_map(|p| p.as_u64().map(|p| p as u32)).collect();
        Some((pids, v["run_id"].as_str()?.to_string()))
    }

    /// Committed output: every line of every file whose name does not begin with `.`.
    pub fn committed_lines(&self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let dir = self.path("out/eo");
        let Ok(entries) = std::fs::read_dir(&dir) else { return out };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            for line in std::fs::read_to_string(e.path()).unwrap().lines() {
                out.push(serde_json::from_str(line).unwrap_or_else(|err| panic!("bad line {line:?} in {:?}: {err}", e.path())));
            }
        }
        out
    }

    /// The exactly-once oracle: every seq once, and per key the counts 1..n once each.
    pub fn assert_exactly_once(&self) {
        let lines = self.committed_lines();
        let mut seqs = HashSet::new();
        let mut counts: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
        for l in &lines {
            let seq = l["seq"].as_i64().expect("seq");
            assert!(seqs.insert(seq), "seq {seq} committed twice");
            let key = l["key"].as_i64().expect("key");
            assert_eq!(key, seq % self.keys as i64, "key of seq {seq}");
            assert_eq!(l["value"].as_i64(), Some(seq));
            counts.entry(key).or_default().push(l["count"].as_i64().expect("count"));
        }
        assert_eq!(seqs.len() as u64, self.events, "committed {} of {} events", seqs.len(), self.events);
        for (key, mut c) in counts {
            c.sort();
            let n = c.len() as i64;
            assert_eq!(c, (1..=n).collect::<Vec<_>>(), "counts of key {key}");
            let expected = (self.events as i64 - key + self.keys as i64 - 1) / self.keys as i64;
            assert_eq!(n, expected, "events of key {key}");
        }
    }
}

pub fn kill(pid: u32) {
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

pub fn kill_group(pgid: u32) {
    unsafe {
        libc::killpg(pgid as i32, libc::SIGKILL);
    }
}

/// Waits for a child with a deadline; kills its group on timeout.
pub fn wait_with_timeout(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if let Some(_) = child.try_wait().unwrap() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            kill_group(child.id());
            let out = child.wait_with_output().unwrap();
            panic!("weir run did not finish within {limit:?}; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// A listing of every file under `dir` with its size and modification time.
pub fn snapshot_tree(dir: &Path) -> BTreeMap<PathBuf, (u64, std::time::SystemTime)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                out.insert(e.path(), (m.len(), m.modified().unwrap()));
            }
        }
    }
    out
}
