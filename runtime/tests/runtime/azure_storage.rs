//! Checkpoints, savepoints and file-sink output in Azure Blob Storage,
//! against a real Azurite reached the way Azure is (an account name, its
//! key and the blob endpoint in the standard AZURE_* variables): SIGKILLs
//! at random moments keep the committed output exactly once, as on local
//! disk and in S3; nothing staged is left; bad storage fails at once with a
//! message that names the location and never the key.

use std::time::{Duration, Instant};

use crate::common::*;

fn container() -> azurite::Container {
    azurite::Server::start().container("weir")
}

/// What a user checks after a run that ended: no upload marker and no
/// staged file left in the output (Azure has no open upload to list: its
/// uncommitted blocks expire by themselves).
fn assert_nothing_hidden_left(job: &Job) {
    let hidden: Vec<String> = job.output_keys().into_iter().filter(|k| k.ends_with(".upload") || k.ends_with(".staged")).collect();
    assert!(hidden.is_empty(), "markers or staged files left behind: {hidden:?}");
}

#[test]
fn worker_kills_with_azure_checkpoints_and_output_keep_exactly_once() {
    let container = container();
    let job = Job::counting(2, 120_000, 89, 30_000, "150ms").on_azure(&container).output_on_azure(&container);
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    job.assert_exactly_once();
    assert_nothing_hidden_left(&job);
    let checkpoints = container.list(&format!("{}/eo-test/checkpoints/", container.key_of(&job.state)));
    assert!(checkpoints.iter().any(|k| k.ends_with("/_metadata")), "no completed checkpoint in the container: {checkpoints:?}");
    assert!(!job.path("state").exists() && !job.path("out").exists(), "an az:// job wrote state or output to local disk");
}

#[test]
fn whole_tree_kills_then_restore_latest_from_azure_at_another_parallelism_keep_exactly_once() {
    let container = container();
    let job = Job::counting(2, 150_000, 61, 30_000, "200ms").on_azure(&container).output_on_azure(&container);
    let out = kill_trees_then_restore_latest(&job, 700..1500, Some("3"));
    assert!(stderr(&out).contains("az://weir/"), "the restore does not name the Azure checkpoint:\n{}", stderr(&out));
    job.assert_exactly_once();
    assert_nothing_hidden_left(&job);
}

/// Stop with a savepoint in Azure, then resume from it: the savepoint's
/// staged files are published by the resumed run, exactly once.
#[test]
fn a_stop_with_a_savepoint_in_azure_resumes_from_it_exactly_once() {
    let container = container();
    let job = Job::counting(2, 60_000, 20, 15_000, "200ms").on_azure(&container).output_on_azure(&container);
    let child = job.spawn(&[]);
    job.wait_for_first_checkpoint();
    let out = job.weir(&["savepoint", "--state-dir", &job.state, "--stop"]).output().unwrap();
    assert!(out.status.success(), "weir savepoint --stop failed: {}", stderr(&out));
    let sp = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(sp.starts_with("az://weir/"), "the savepoint is not in the container: {sp}");
    assert!(container.get(&format!("{}/_metadata", container.key_of(&sp))).is_some(), "{sp} has no _metadata");
    let out = wait_with_timeout(child, Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("from savepoint"), "{}", stderr(&out));
    job.assert_exactly_once();
    assert_nothing_hidden_left(&job);
}

/// Records come faster than checkpoints: files roll at `max_file_bytes`
/// and go up as several blocks each, and still appear only at completion.
#[test]
fn big_output_rolls_by_size_into_blobs_of_several_blocks_exactly_once() {
    let container = container();
    let max = 12u64 << 20;
    let yaml = format!("name: eo-test\nparallelism: 1\ncheckpoint:\n  interval: 4s\n  mode: aligned\nsource:\n  generator:\n    events: 700000\n    keys: 101\n    rate: 0\n    batch_size: 1024\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n    max_file_bytes: {max}\n");
    let job = Job::with_pipeline(&yaml, 700_000, 101).on_azure(&container).output_on_azure(&container);
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(180));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    job.assert_exactly_once();
    let committed: Vec<String> = job.output_keys().into_iter().filter(|k| !k.rsplit('/').next().unwrap_or_default().starts_with('.')).collect();
    let sizes: Vec<usize> = committed.iter().map(|k| container.get(k).unwrap().len()).collect();
    assert!(sizes.iter().filter(|&&s| s > 2 * (5 << 20)).count() >= 2, "expected files of three blocks or more, got sizes {sizes:?}");
    assert!(sizes.iter().all(|&s| (s as u64) < max + (1 << 20)), "a file grew past max_file_bytes: {sizes:?}");
}

#[test]
fn a_missing_container_fails_at_once_naming_the_location() {
    let container = container();
    let mut job = Job::counting(1, 1_000, 10, 0, "1s").on_azure(&container);
    job.state = "az://no-such-container/state".into();
    let start = Instant::now();
    let out = job.run(&[]);
    assert!(!out.status.success(), "weir run succeeded without a container");
    let err = stderr(&out);
    assert!(err.contains("az://no-such-container/state"), "the error does not name the location:\n{err}");
    assert!(err.contains("ContainerNotFound"), "the error does not say the container is missing:\n{err}");
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?} to fail", start.elapsed());
}

#[test]
fn a_wrong_account_key_fails_at_once_and_the_key_is_never_printed() {
    let container = container();
    // A well-formed key that is not the account's.
    let wrong = "bm90LXRoZS1rZXktb2YtdGhpcy1hY2NvdW50LTdjMWUyZA==";
    for output in [false, true] {
        let mut job = Job::counting(1, 1_000, 10, 0, "1s");
        job = if output { job.output_on_azure(&container) } else { job.on_azure(&container) };
        job.env = container.env_with_key(wrong);
        let start = Instant::now();
        let out = job.run(&[]);
        assert!(!out.status.success(), "weir run succeeded with a wrong key");
        let err = stderr(&out);
        assert!(err.contains("az://weir/"), "the error does not name the location:\n{err}");
        assert!(err.contains("AuthorizationFailure") || err.contains("AuthenticationFailed") || err.contains("403"), "the error does not say the key was refused:\n{err}");
        assert!(!err.contains(wrong) && !String::from_utf8_lossy(&out.stdout).contains(wrong), "the key was printed:\n{err}");
        assert!(start.elapsed() < Duration::from_secs(60), "took {:?} to fail", start.elapsed());
    }
}

#[test]
fn an_azure_location_without_an_account_says_which_variables_to_set() {
    let job = Job::counting(1, 1_000, 10, 0, "1s");
    let out = job.weir(&["run", "pipeline.yaml", "--state-dir", "az://weir/state"]).env_remove("AZURE_STORAGE_ACCOUNT_NAME").output().unwrap();
    assert!(!out.status.success(), "weir run succeeded without an account");
    let err = stderr(&out);
    assert!(err.contains("az://weir/state") && err.contains("AZURE_STORAGE_ACCOUNT_NAME"), "{err}");
}
