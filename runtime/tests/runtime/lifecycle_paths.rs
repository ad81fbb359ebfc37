//! The paths users walk besides a single run: re-runs, a savepoint followed by
//! a crash, two runs at once, jobs sharing an output directory, stopping with
//! a savepoint. Each test is the regression test of one exactly-once hole
//! found on these paths (issue 9); the randomized lifecycle test walks them
//! in random combinations.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use crate::common::*;

/// Waits until `weir status` shows a completed checkpoint (or a savepoint works).
fn status_json(job: &Job) -> Option<serde_json::Value> {
    let out = std::process::Command::new(WEIR).current_dir(job.dir.path()).args(["status", "--state-dir", "state"]).output().ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn latest_checkpoint_id(job: &Job) -> Option<u64> {
    status_json(job)?["latest_checkpoint"]["id"].as_u64()
}

fn savepoint(job: &Job, extra: &[&str]) -> String {
    let out = std::process::Command::new(WEIR).current_dir(job.dir.path()).args(["savepoint", "--state-dir", "state"]).args(extra).output().unwrap();
    assert!(out.status.success(), "weir savepoint failed: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn in_progress_files(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.ends_with(".inprogress")).collect())
        .unwrap_or_default()
}

#[test]
fn a_rerun_that_crashes_before_its_first_checkpoint_restarts_from_its_own_beginning() {
    // The first run finishes and leaves its checkpoints behind.
    let job = Job::counting(2, 20_000, 10, 0, "100ms");
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The user clears the output and runs the job again, without --restore;
    // slowly, with a first checkpoint far away, and a worker dies early.
    std::fs::remove_dir_all(job.path("out/eo")).unwrap();
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap().replace("interval: 100ms", "interval: 30s").replace("rate: 0", "rate: 10000");
    std::fs::write(job.path("pipeline.yaml"), yaml).unwrap();
    let first_run = job.worker_pids().map(|(_, run)| run);
    let mut child = job.spawn(&[]);
    wait_for("the second run's workers", Duration::from_secs(20), || {
        job.worker_pids().is_some_and(|(p, run)| !p.is_empty() && Some(run) != first_run) && status_json(&job).is_some_and(|s| s["records_in"].as_u64() > Some(0))
    });
    assert_eq!(latest_checkpoint_id(&job), None, "the rerun completed a checkpoint too early for this test");
    kill(job.worker_pids().unwrap().0[1]);
    let _ = child.try_wait();
    let out = wait_with_timeout(child, Duration::from_secs(60));
    assert!(out.status.success(), "the rerun failed:\n{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("restarting in") && err.contains("from the beginning"), "the restart must start the rerun over:\n{err}");
    job.assert_exactly_once();
    assert!(in_progress_files(&job.path("out/eo")).is_empty(), "{:?}", in_progress_files(&job.path("out/eo")));
}

#[test]
fn restore_latest_after_a_fresh_run_crashed_before_its_first_checkpoint_starts_fresh() {
    let job = Job::counting(1, 5_000, 10, 0, "100ms");
    assert!(job.run(&[]).status.success());
    std::fs::remove_dir_all(job.path("out/eo")).unwrap();
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap().replace("interval: 100ms", "interval: 30s").replace("rate: 0", "rate: 10000");
    std::fs::write(job.path("pipeline.yaml"), yaml).unwrap();
    let first_run = job.worker_pids().map(|(_, run)| run);
    let child = job.spawn(&[]);
    // run.json of the first run is still there: wait for the second run's.
    wait_for("the second run's workers", Duration::from_secs(20), || job.worker_pids().is_some_and(|(p, run)| !p.is_empty() && Some(run) != first_run));
    kill_group(child.id());
    let _ = child.wait_with_output();
    // `latest` of the new lineage is nothing: the old run's state must not come back.
    let out = wait_with_timeout(job.spawn(&["--restore", "latest"]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("starting fresh"), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_savepoint_followed_by_a_crash_stays_restorable() {
    let job = Job::counting(2, 60_000, 20, 15_000, "700ms");
    let mut child = job.spawn(&[]);
    wait_for("a first checkpoint", Duration::from_secs(30), || latest_checkpoint_id(&job).is_some());
    let sp = savepoint(&job, &[]);
    // Crash before the next checkpoint completes: the savepoint completed
    // like a checkpoint (its output is published), so the run restarts
    // from it, not from the checkpoint before it, which would publish the
    // interval up to the savepoint a second time.
    kill(job.worker_pids().unwrap().0[0]);
    let _ = child.try_wait();
    wait_for("the restarted run", Duration::from_secs(30), || status_json(&job).is_some_and(|s| s["restored_from"].is_string() && s["phase"] == "running"));
    let restored = status_json(&job).unwrap()["restored_from"].as_str().unwrap().to_string();
    assert!(restored.contains("savepoints/sp-"), "the restarted run restored {restored}, not the savepoint {sp}");
    job.assert_once_up_to_a_point();
    kill_group(child.id());
    let _ = child.wait_with_output();
    // The savepoint restores; every event is there (restoring an older
    // snapshot replays what came after it, so some may be there twice).
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(120));
    assert!(out.status.success(), "restoring the savepoint failed:\n{}", stderr(&out));
    assert!(!stderr(&out).contains("restarting"), "{}", stderr(&out));
    let seqs: std::collections::HashSet<i64> = job.committed_lines().iter().map(|l| l["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs.len(), 60_000);
}

#[test]
fn a_second_run_of_a_running_job_is_refused_naming_the_first() {
    let job = Job::counting(2, 40_000, 10, 20_000, "200ms");
    let child = job.spawn(&[]);
    wait_for("the first run", Duration::from_secs(20), || job.worker_pids().is_some());
    let started = Instant::now();
    let second = job.run(&[]);
    assert!(!second.status.success(), "a second run of the same job started");
    assert!(started.elapsed() < Duration::from_secs(10), "the refusal took {:?}", started.elapsed());
    let err = stderr(&second);
    assert!(err.contains("already running") && err.contains(&format!("pid {}", child.id())), "{err}");
    // The same job with another state directory but the same output is refused too.
    let third = std::process::Command::new(WEIR).current_dir(job.dir.path()).args(["run", "pipeline.yaml", "--state-dir", "state-2"]).output().unwrap();
    assert!(!third.status.success());
    assert!(stderr(&third).contains("already running on this output directory"), "{}", stderr(&third));
    let out = wait_with_timeout(child, Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn two_jobs_sharing_an_output_directory_each_commit_everything_once() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = |name: &str| {
        format!(
            "name: {name}\nparallelism: 2\ncheckpoint:\n  interval: 150ms\nsource:\n  generator: {{events: 30000, keys: 7, rate: 15000, batch_size: 256}}\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file: {{path: out/shared}}\n"
        )
    };
    // `share` and `share-b`: one name is a prefix of the other.
    std::fs::write(dir.path().join("a.yaml"), yaml("share")).unwrap();
    std::fs::write(dir.path().join("b.yaml"), yaml("share-b")).unwrap();
    let spawn = |p: &str| {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(WEIR)
            .current_dir(dir.path())
            .args(["run", p, "--state-dir", "state"])
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let a = spawn("a.yaml");
    let b = spawn("b.yaml");
    // Job `share-b` crashes twice; its restores clean up after themselves only.
    for _ in 0..2 {
        let run = dir.path().join("state/share-b/run.json");
        wait_for("share-b running", Duration::from_secs(20), || std::fs::read_to_string(&run).is_ok());
        std::thread::sleep(Duration::from_millis(600));
        let info: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&run).unwrap()).unwrap();
        kill(info["worker_pids"][0].as_u64().unwrap() as u32);
        std::thread::sleep(Duration::from_millis(300));
    }
    for (name, child) in [("share", a), ("share-b", b)] {
        let out = wait_with_timeout(child, Duration::from_secs(120));
        assert!(out.status.success(), "{name}: {}", stderr(&out));
    }
    for name in ["share", "share-b"] {
        let mut seqs = std::collections::HashSet::new();
        for e in std::fs::read_dir(dir.path().join("out/shared")).unwrap().flatten() {
            let file = e.file_name().to_string_lossy().to_string();
            if !file.starts_with(&format!("part-{name}.")) {
                continue;
            }
            for line in std::fs::read_to_string(e.path()).unwrap().lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                assert!(seqs.insert(v["seq"].as_i64().unwrap()), "{name}: seq {} twice", v["seq"]);
            }
        }
        assert_eq!(seqs.len(), 30_000, "{name}");
    }
    assert!(in_progress_files(&dir.path().join("out/shared")).is_empty());
}

#[test]
fn a_stop_with_savepoint_never_resumed_publishes_everything_up_to_it_and_leaves_nothing_pending() {
    // `weir savepoint --stop` (or a delete) that nobody resumes: what the
    // job read up to the savepoint must be visible, once, with no file left
    // pending.
    let job = Job::counting(2, 200_000, 20, 20_000, "300ms");
    let child = job.spawn(&[]);
    wait_for("a first checkpoint", Duration::from_secs(30), || latest_checkpoint_id(&job).is_some());
    std::thread::sleep(Duration::from_millis(150));
    let sp = savepoint(&job, &["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(20));
    assert!(out.status.success(), "{}", stderr(&out));
    let pending = in_progress_files(&job.path("out/eo"));
    assert!(pending.is_empty(), "the stop left output pending: {pending:?}");
    let published = job.assert_once_up_to_a_point();
    assert!(published > 0 && (published as u64) < job.events, "published {published} of {} events", job.events);
    // Resuming later writes nothing twice.
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn stop_with_a_savepoint_ends_a_bounded_local_job_and_the_savepoint_resumes_it() {
    let job = Job::counting(2, 60_000, 20, 15_000, "200ms");
    let child = job.spawn(&[]);
    wait_for("a first checkpoint", Duration::from_secs(30), || latest_checkpoint_id(&job).is_some());
    let sp = savepoint(&job, &["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(20));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!("stopped `eo-test` with savepoint {sp}")), "{}", stderr(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["stopped_with_savepoint"].as_str(), Some(sp.as_str()));
    // Nothing was committed after the savepoint: resuming from it gives every event exactly once.
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_stop_whose_job_is_gone_before_the_answer_is_read_still_reports_its_savepoint() {
    // A stopped local job ends at once, and its control endpoint with it;
    // here `weir savepoint --stop` asks how it went only after 2 s, when the
    // job is surely gone (CI once lost that race against the usual 100 ms).
    let job = Job::counting(1, 60_000, 20, 15_000, "200ms");
    let child = job.spawn(&[]);
    wait_for("a first checkpoint", Duration::from_secs(30), || latest_checkpoint_id(&job).is_some());
    let out = job.weir(&["savepoint", "--stop", "--state-dir", &job.state]).env("WEIR_SLOW_SAVEPOINT_POLL", "2s").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let sp = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let run = wait_with_timeout(child, Duration::from_secs(20));
    assert!(run.status.success(), "{}", stderr(&run));
    assert!(stderr(&run).contains(&format!("stopped `eo-test` with savepoint {sp}")), "the CLI named {sp:?}:\n{}", stderr(&run));
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn run_json_holding_the_control_token_is_readable_only_by_its_owner() {
    let job = Job::counting(1, 30_000, 10, 15_000, "200ms");
    let child = job.spawn(&[]);
    wait_for("run.json", Duration::from_secs(20), || job.worker_pids().is_some());
    let mode = std::fs::metadata(job.path("state/eo-test/run.json")).unwrap().permissions().mode();
    kill_group(child.id());
    let _ = child.wait_with_output();
    assert_eq!(mode & 0o077, 0, "run.json has mode {mode:o}");
}

/// After a power loss the lineage must not lag output already published on its
/// strength: the metadata and the lineage records are fsynced like the sink's commits.
/// Checked by tracing the real system calls (strace, installed by scripts/test).
#[test]
fn checkpoint_metadata_and_the_latest_pointer_are_fsynced() {
    let job = Job::counting(1, 3_000, 10, 0, "100ms");
    let trace = job.path("fsync.trace");
    let out = std::process::Command::new("strace")
        .current_dir(job.dir.path())
        .args(["-f", "-y", "-e", "trace=fsync,fdatasync", "-o"])
        .arg(&trace)
        .arg(WEIR)
        .args(["run", "pipeline.yaml", "--state-dir", "state"])
        .output()
        .expect("strace is needed for this test (scripts/test installs it)");
    assert!(out.status.success(), "{}", stderr(&out));
    let calls = std::fs::read_to_string(&trace).unwrap();
    for what in ["/_metadata>", "/start>", "/chk-00000000000000000001>", ".arrow>"] {
        assert!(calls.lines().any(|l| l.contains("fsync(") && l.contains(what)), "no fsync of {what}:\n{calls}");
    }
}

/// The run ids that claimed a job's state (`<state>/eo-test/lineage/*/claim`).
fn runs_of_state(job: &Job, state: &str) -> std::collections::HashSet<String> {
    let lineage = job.path(&format!("{state}/eo-test/lineage"));
    std::fs::read_dir(lineage)
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("claim")).ok())
        .filter_map(|text| serde_json::from_str::<serde_json::Value>(&text).ok()?["run_id"].as_str().map(String::from))
        .collect()
}

/// Each committed seq of the files in `out/eo` written by `runs`, counted.
fn seqs_written_by(job: &Job, runs: &std::collections::HashSet<String>) -> std::collections::BTreeMap<i64, u32> {
    let mut seqs = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(job.path("out/eo")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(run) = name.strip_prefix("part-eo-test.").and_then(|rest| rest.split_once('-')).map(|(run, _)| run.to_string()) else { continue };
        if runs.contains(&run) {
            for line in std::fs::read_to_string(e.path()).unwrap().lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                *seqs.entry(v["seq"].as_i64().unwrap()).or_insert(0) += 1;
            }
        }
    }
    seqs
}

#[test]
fn a_second_state_of_one_job_sharing_the_output_never_discards_the_others_pending_files() {
    // Two jobs of one name write to one output directory from two state
    // directories, one after the other (the output lock refuses them side
    // by side). The first crashes between a checkpoint's completion and
    // its commit: that checkpoint's files stay pending for its restore.
    // The second must not take them for leftovers of its own runs, or the
    // first one's restore finds them gone.
    let job = Job::counting(2, 30_000, 16, 15_000, "150ms");
    let crashed = job.command(&["--max-restarts", "0"]).env("WEIR_FAULT", "after-complete@3").output().unwrap();
    assert!(!crashed.status.success(), "the fault did not stop the first job: {}", stderr(&crashed));
    let pending = || std::fs::read_dir(job.path("out/eo")).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".inprogress")).count();
    assert!(pending() > 0, "the crash left no pending file to protect");
    let twin = job.weir(&["run", "pipeline.yaml", "--state-dir", "state-twin"]).output().unwrap();
    assert!(twin.status.success(), "the second job: {}", stderr(&twin));
    let resumed = job.run(&["--restore", "latest"]);
    assert!(resumed.status.success(), "the first job's restore: {}", stderr(&resumed));
    for state in ["state", "state-twin"] {
        let seqs = seqs_written_by(&job, &runs_of_state(&job, state));
        let twice: Vec<_> = seqs.iter().filter(|(_, n)| **n > 1).map(|(s, _)| *s).take(5).collect();
        assert!(twice.is_empty(), "{state}: seqs committed twice, e.g. {twice:?}");
        assert_eq!(seqs.len(), 30_000, "{state}: every event once");
    }
}
