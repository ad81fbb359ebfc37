//! Bad input gets a clear error naming the file, field or setting, a non-zero
//! exit, and leaves the state directory and the output untouched.

use crate::common::*;

fn run_pipeline(yaml: &str, extra: &[&str]) -> (tempfile::TempDir, std::process::Output) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), yaml).unwrap();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml"]).args(extra).output().unwrap();
    (dir, out)
}

const GOOD: &str = "name: t\nsource:\n  generator: {events: 10}\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file: {path: out}\n";

#[test]
fn malformed_yaml_names_the_file_and_line() {
    let (_d, out) = run_pipeline("name: t\nsource: [\n  generator\n", &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("p.yaml") && err.contains("line"), "{err}");
}

#[test]
fn an_unknown_step_lists_the_known_ones() {
    let (_d, out) = run_pipeline(&GOOD.replace("running_count: count", "running_median: count"), &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("unknown step `running_median`") && err.contains("running_count") && err.contains("line 6"), "{err}");
}

#[test]
fn parallelism_zero_is_rejected_in_the_file_and_on_the_command_line() {
    let (_d, out) = run_pipeline(&format!("parallelism: 0\n{GOOD}"), &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("p.yaml:1: parallelism: expected an integer of at least 1"), "{}", stderr(&out));
    let (_d, out) = run_pipeline(GOOD, &["--parallelism", "0"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--parallelism 0"), "{}", stderr(&out));
}

#[test]
fn an_expression_on_a_missing_field_names_the_step() {
    let (_d, out) = run_pipeline(&GOOD.replace("  - key_by: key\n", "  - filter: valu > 3\n  - key_by: key\n"), &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("p.yaml:5: steps[0].filter") && err.contains("valu"), "{err}");
}

#[test]
fn a_state_dir_that_cannot_be_written_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), GOOD).unwrap();
    std::fs::write(dir.path().join("a-file"), "not a directory").unwrap();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml", "--state-dir", "a-file/state"]).output().unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("state directory a-file/state"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.path().join("a-file")).unwrap(), "not a directory");
}

#[test]
fn restore_from_something_that_is_not_a_checkpoint_fails_clearly() {
    let (dir, out) = run_pipeline(GOOD, &["--restore", "nowhere"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("is not a usable checkpoint") && err.contains("_metadata"), "{err}");
    std::fs::create_dir(dir.path().join("empty")).unwrap();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml", "--restore", "empty"]).output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no _metadata file"), "{}", stderr(&out));
}

/// A completed run leaves a checkpoint; then its metadata is damaged.
fn damaged_latest(damage: impl Fn(&mut Vec<u8>)) {
    let job = Job::counting(2, 5_000, 10, 0, "50ms");
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let latest = job.latest().expect("the run left a latest checkpoint");
    let latest = latest.rsplit('/').next().unwrap().to_string();
    let meta_path = job.path(&format!("state/eo-test/checkpoints/{latest}/_metadata"));
    let mut bytes = std::fs::read(&meta_path).unwrap();
    damage(&mut bytes);
    std::fs::write(&meta_path, &bytes).unwrap();
    let state_before = snapshot_tree(&job.path("state"));
    let out_before = snapshot_tree(&job.path("out"));
    let out = job.run(&["--restore", "latest"]);
    assert!(!out.status.success(), "restoring a damaged checkpoint succeeded");
    let err = stderr(&out);
    assert!(err.contains(latest.trim()) && (err.contains("truncated") || err.contains("corrupted")), "{err}");
    assert_eq!(snapshot_tree(&job.path("out")), out_before, "the output changed");
    let mut state_after = snapshot_tree(&job.path("state"));
    state_after.retain(|p, _| !p.ends_with("run.json"));
    let mut before = state_before;
    before.retain(|p, _| !p.ends_with("run.json"));
    assert_eq!(state_after, before, "the state directory changed");
}

#[test]
fn a_truncated_checkpoint_metadata_is_reported_and_nothing_is_touched() {
    damaged_latest(|b| b.truncate(b.len() / 2));
}

#[test]
fn a_corrupted_checkpoint_metadata_is_reported_and_nothing_is_touched() {
    damaged_latest(|b| {
        let i = b.iter().position(|&c| c == b'"').unwrap();
        b[i + 1] ^= 0x20;
    });
}

/// Runs `yaml` on input files written into a fresh directory; `weir run` may
/// restart it at most twice, so a wrongly retried failure ends quickly too.
fn run_on_files(yaml: &str, files: &[(&str, &str)]) -> (tempfile::TempDir, std::process::Output) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("in")).unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join("in").join(name), text).unwrap();
    }
    std::fs::write(dir.path().join("p.yaml"), yaml).unwrap();
    let out = std::process::Command::new(WEIR)
        .current_dir(dir.path())
        .args(["run", "p.yaml", "--max-restarts", "2"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (dir, out)
}

/// Every committed line under `out/`.
fn output_lines(dir: &std::path::Path) -> Vec<serde_json::Value> {
    let mut lines = Vec::new();
    for e in std::fs::read_dir(dir.join("out")).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        for line in std::fs::read_to_string(e.path()).unwrap().lines() {
            lines.push(serde_json::from_str(line).unwrap());
        }
    }
    lines
}

/// The failure is reported once, as fatal: no restart, exit code 3.

#[test]
fn a_division_by_zero_in_a_select_fails_at_once_naming_the_step_and_the_record() {
    // Two workers; the bad record is read by worker 1, so worker 0 (the
    // coordinator) loses it and exits too: the fatal exit must still decide.
    let yaml = "name: div\nparallelism: 2\nsource:\n  file:\n    path: in\n    schema: {n: int64, d: int64}\nsteps:\n  - select: [n, \"n / d AS q\"]\n  - key_by: n\n  - running_count: c\nsink:\n  file: {path: out}\n";
    let (_dir, out) = run_on_files(yaml, &[("a.jsonl", "{\"n\": 1, \"d\": 1}\n"), ("b.jsonl", "{\"n\": 10, \"d\": 2}\n{\"n\": 20, \"d\": 0}\n")]);
    let err = assert_fatal_at_once(&out);
    assert!(err.contains("steps[0].select[1]: `n / d AS q` failed"), "{err}");
    assert!(err.contains(r#"the record: {"n":20,"d":0}"#), "{err}");
}

#[test]
fn an_int64_running_sum_overflow_fails_at_once_naming_the_step_and_the_key() {
    let yaml = "name: sum\nsource:\n  file:\n    path: in\n    schema: {k: int64, v: int64}\nsteps:\n  - key_by: k\n  - running_sum: {field: v}\nsink:\n  file: {path: out}\n";
    let (dir, out) = run_on_files(yaml, &[("a.jsonl", "{\"k\": 1, \"v\": 9223372036854775807}\n{\"k\": 1, \"v\": 1}\n")]);
    let err = assert_fatal_at_once(&out);
    assert!(err.contains("steps[1].running_sum: the int64 sum of key {\"k\":1} overflows"), "{err}");
    for line in output_lines(dir.path()) {
        assert!(line["sum_v"].as_i64() != Some(i64::MIN), "a wrapped sum was committed: {line}");
    }
}

#[test]
fn negative_zero_and_zero_keys_share_one_running_count() {
    let yaml = "name: zeros\nparallelism: 2\nsource:\n  file:\n    path: in\n    schema: {x: float64, i: int64}\nsteps:\n  - key_by: x\n  - running_count: n\nsink:\n  file: {path: out}\n";
    let input = "{\"x\": 0.0, \"i\": 1}\n{\"x\": -0.0, \"i\": 2}\n{\"x\": 0.0, \"i\": 3}\n{\"x\": -0.0, \"i\": 4}\n";
    let (dir, out) = run_on_files(yaml, &[("a.jsonl", input)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut counts: Vec<i64> = output_lines(dir.path()).iter().map(|l| l["n"].as_i64().unwrap()).collect();
    counts.sort();
    assert_eq!(counts, vec![1, 2, 3, 4]);
}

#[test]
fn restored_state_that_does_not_fit_the_step_fails_at_once_naming_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let counting = "name: t\nsource:\n  generator: {events: 100}\nsteps:\n  - key_by: key\n  - running_count: agg\n    id: agg\nsink:\n  file: {path: out}\n";
    std::fs::write(dir.path().join("p.yaml"), counting).unwrap();
    let run = |extra: &[&str]| std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml", "--max-restarts", "2"]).args(extra).output().unwrap();
    let out = run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The same step id now keeps a float sum: its old int64 counts do not fit.
    let summing = "name: t\nsource:\n  generator: {events: 100}\nsteps:\n  - select: [key, \"CAST(value AS DOUBLE) AS v\"]\n  - key_by: key\n  - running_sum: {field: v}\n    id: agg\nsink:\n  file: {path: out}\n";
    std::fs::write(dir.path().join("p.yaml"), summing).unwrap();
    let out = run(&["--restore", "latest"]);
    let err = assert_fatal_at_once(&out);
    assert!(err.contains("is not a usable checkpoint") && err.contains("the state of `agg`") && err.contains("does not fit"), "{summing}\n{err}");
}

#[test]
fn a_pending_output_file_that_is_gone_fails_at_once_naming_it() {
    let job = Job::counting(1, 100_000, 10, 20_000, "100ms");
    // The first run crashes after checkpoint 2 completed, before its files are
    // renamed, and gives up; then the in-progress files are deleted.
    let out = job.command(&["--max-restarts", "0"]).env("WEIR_FAULT", "before-commit@2").output().unwrap();
    assert!(!out.status.success(), "{}", stderr(&out));
    let mut removed = 0;
    for e in std::fs::read_dir(job.path("out/eo")).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".inprogress") {
            std::fs::remove_file(e.path()).unwrap();
            removed += 1;
        }
    }
    assert!(removed > 0, "no in-progress file to remove");
    let out = job.run(&["--restore", "latest"]);
    let err = assert_fatal_at_once(&out);
    assert!(err.contains("(checkpoint 2) is gone, and so is its final name"), "{err}");
}

/// A file source over a line holding two JSON values (line 2) and a float in
/// an int64 field (line 4), into an exactly-once file sink.
fn lines_job(bad_lines: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "name: lines\ncheckpoint:\n  interval: 10s\nsource:\n  file:\n    path: in.jsonl\n    schema: {{n: int64}}\n    batch_size: 1\n{bad_lines}sink:\n  file: {{path: out}}\n"
    );
    std::fs::write(dir.path().join("p.yaml"), yaml).unwrap();
    std::fs::write(dir.path().join("in.jsonl"), "{\"n\":1}\n{\"n\":2} {\"n\":3}\n{\"n\":4}\n{\"n\":1.9}\n{\"n\":5}\n").unwrap();
    dir
}

fn committed(dir: &std::path::Path) -> Vec<i64> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir.join("out")).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        for line in std::fs::read_to_string(e.path()).unwrap().lines() {
            out.push(serde_json::from_str::<serde_json::Value>(line).unwrap()["n"].as_i64().unwrap());
        }
    }
    out.sort();
    out
}

#[test]
fn a_bad_input_line_fails_the_job_at_once_naming_file_line_and_field_and_commits_nothing() {
    let dir = lines_job("");
    let started = std::time::Instant::now();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml"]).output().unwrap();
    assert!(!out.status.success(), "a job with bad input lines succeeded: {}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("in.jsonl: line 2, column 9") && err.contains("exactly one JSON object per line"), "{err}");
    assert!(!err.contains("restarting"), "a bad line was retried: {err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "took {:?}", started.elapsed());
    assert_eq!(committed(dir.path()), Vec::<i64>::new(), "output was committed");

    // The coerced line is refused too, once the first one is fixed.
    std::fs::write(dir.path().join("in.jsonl"), "{\"n\":1}\n{\"n\":2}\n{\"n\":4}\n{\"n\":1.9}\n").unwrap();
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml"]).output().unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("in.jsonl: line 4") && err.contains("field `n`: expected an int64") && err.contains("found 1.9"), "{err}");
    assert_eq!(committed(dir.path()), Vec::<i64>::new(), "output was committed");
}

#[test]
fn bad_lines_skip_commits_the_good_lines_and_reports_how_many_were_skipped() {
    let dir = lines_job("    bad_lines: skip\n");
    let out = std::process::Command::new(WEIR).current_dir(dir.path()).args(["run", "p.yaml"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(committed(dir.path()), vec![1, 4, 5]);
    let summary: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(summary["records_skipped"], 2, "{summary}");
    assert_eq!(summary["records_in"], 3, "{summary}");
    let err = stderr(&out);
    assert!(err.contains("in.jsonl:2") && err.contains("in.jsonl:4"), "the skipped lines were not logged: {err}");
    assert!(err.contains("2 bad input records skipped"), "{err}");
}
