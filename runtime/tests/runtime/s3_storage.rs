//! Checkpoints and savepoints on S3, against a real MinIO: SIGKILLs at
//! random moments keep the committed output equal to a failure-free run's
//! as they do on local disk, the server may restart under a running job,
//! and bad storage (a missing bucket, wrong credentials) fails at once with
//! a message that names the location and never a secret.

use std::time::{Duration, Instant};

use crate::common::*;

fn bucket() -> minio::Bucket {
    minio::Server::start().bucket("weir")
}

/// The keys of a job's snapshots of one kind (`checkpoints` or `savepoints`).
fn snapshot_keys(job: &Job, bucket: &minio::Bucket, kind: &str) -> Vec<String> {
    bucket.list(&format!("{}/eo-test/{kind}/", bucket.key_of(&job.state)))
}

#[test]
fn worker_kills_with_s3_checkpoints_keep_exactly_once() {
    let bucket = bucket();
    let job = Job::counting(2, 120_000, 97, 30_000, "150ms").on_s3(&bucket);
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    job.assert_exactly_once();
    let keys = snapshot_keys(&job, &bucket, "checkpoints");
    assert!(keys.iter().any(|k| k.ends_with("/_metadata")), "no completed checkpoint in the bucket: {keys:?}");
    let lineage = snapshot_keys(&job, &bucket, "lineage");
    assert!(lineage.iter().any(|k| k.contains("/chk-")), "no lineage record in the bucket: {lineage:?}");
    assert!(!job.path("state").exists(), "an s3:// job wrote state to local disk");
}

#[test]
fn whole_tree_kills_then_restore_latest_from_s3_keep_exactly_once() {
    let bucket = bucket();
    let job = Job::counting(2, 150_000, 53, 30_000, "200ms").on_s3(&bucket);
    let out = kill_trees_then_restore_latest(&job, 700..1500, None);
    assert!(stderr(&out).contains("s3://weir/"), "the restore does not name the S3 checkpoint:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_savepoint_on_s3_is_listed_and_restorable() {
    let bucket = bucket();
    let job = Job::counting(2, 60_000, 20, 20_000, "300ms").on_s3(&bucket);
    let mut child = KillOnDrop::new(job.spawn(&[]));
    let path = job.take_savepoint();
    assert!(path.starts_with("s3://weir/"), "the savepoint is not in the bucket: {path}");
    assert!(bucket.get(&format!("{}/_metadata", bucket.key_of(&path))).is_some(), "{path} has no _metadata");
    let list = job.weir(&["checkpoints", "list", "--state-dir", &job.state]).output().unwrap();
    let table = String::from_utf8_lossy(&list.stdout);
    assert!(table.lines().any(|l| l.contains("savepoint") && l.contains("complete") && l.contains(&path)), "{table}");
    child.kill();
    let out = job.run(&["--restore", &path]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("from savepoint"), "{}", stderr(&out));
    let seqs: std::collections::HashSet<i64> = job.committed_lines().iter().map(|l| l["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs.len(), 60_000);
}

/// S3 has no kernel lock: the run's lease in the bucket refuses a second
/// `weir run` of the job (from another directory, as from another machine),
/// naming the one that runs; the first run goes on untouched.
#[test]
fn a_second_run_of_a_job_on_the_same_s3_state_is_refused_naming_the_first() {
    let bucket = bucket();
    let first = Job::counting(2, 90_000, 31, 20_000, "200ms").on_s3(&bucket);
    let mut running = KillOnDrop::new(first.spawn(&[]));
    first.take_savepoint();
    let mut second = Job::counting(2, 90_000, 31, 20_000, "200ms").on_s3(&bucket);
    second.state = first.state.clone();
    for restore in [None, Some("latest")] {
        let out = second.run(restore.map(|r| vec!["--restore", r]).unwrap_or_default().as_slice());
        assert!(!out.status.success(), "a second run started beside the first");
        let err = stderr(&out);
        assert!(err.contains("already running") && err.contains(&format!("pid {}", running.pid())), "{err}");
        assert!(second.committed_lines().is_empty(), "the refused run wrote output");
    }
    let status = running.wait_for(Duration::from_secs(120)).expect("the first run did not end");
    assert!(status.success(), "the first run failed after the refused ones");
    first.assert_exactly_once();
    assert!(bucket.get(&format!("{}/eo-test/run.lease", bucket.key_of(&first.state))).is_none(), "the finished run left its lease");
}

#[test]
fn a_store_restarted_under_a_running_job_costs_no_record() {
    let bucket = bucket();
    // About 6 s of events at 100 ms checkpoints: the store is gone for 3 s of them.
    let job = Job::counting(2, 180_000, 41, 30_000, "100ms").on_s3(&bucket);
    let child = job.spawn(&[]);
    std::thread::sleep(Duration::from_millis(1500));
    bucket.server.stop();
    std::thread::sleep(Duration::from_secs(3));
    bucket.server.restart();
    let out = wait_with_timeout(child, Duration::from_secs(180));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    job.assert_exactly_once();
}

#[test]
fn a_store_gone_longer_than_the_checkpoint_timeout_fails_checkpoints_and_the_job_recovers() {
    let bucket = bucket();
    let yaml = "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 100ms\n  timeout: 1s\n  mode: aligned\nsource:\n  generator:\n    events: 240000\n    keys: 29\n    rate: 30000\n    batch_size: 256\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n";
    let job = Job::with_pipeline(yaml, 240_000, 29).on_s3(&bucket);
    let child = job.spawn(&[]);
    std::thread::sleep(Duration::from_millis(1500));
    bucket.server.stop();
    std::thread::sleep(Duration::from_secs(6));
    bucket.server.restart();
    let out = wait_with_timeout(child, Duration::from_secs(240));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    let err = stderr(&out);
    // The outage was felt: checkpoints were abandoned or could not even be
    // started (the store refused the directory's owner record), or the run
    // restarted; and the job went on.
    assert!(
        err.contains("checkpoint abandoned")
            || err.contains("checkpoint not started")
            || err.contains("longer than the checkpoint timeout")
            || err.contains("restarting"),
        "the outage left no trace:\n{err}"
    );
    job.assert_exactly_once();
}

#[test]
fn a_missing_bucket_fails_at_once_naming_the_location() {
    let bucket = bucket();
    let mut job = Job::counting(1, 1_000, 10, 0, "1s").on_s3(&bucket);
    job.state = "s3://no-such-bucket/state".into();
    let start = Instant::now();
    let out = job.run(&[]);
    assert!(!out.status.success(), "weir run succeeded without a bucket");
    let err = stderr(&out);
    assert!(err.contains("s3://no-such-bucket/state"), "the error does not name the location:\n{err}");
    assert!(err.to_lowercase().contains("bucket"), "the error does not say the bucket is missing:\n{err}");
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?} to fail", start.elapsed());
    assert!(job.committed_lines().is_empty());
}

#[test]
fn wrong_credentials_fail_at_once_and_the_secret_is_never_printed() {
    let bucket = bucket();
    let mut job = Job::counting(1, 1_000, 10, 0, "1s").on_s3(&bucket);
    let secret = "not-the-secret-7c1e2d";
    for (k, v) in job.env.iter_mut() {
        if k == "AWS_SECRET_ACCESS_KEY" {
            *v = secret.into();
        }
    }
    let start = Instant::now();
    let out = job.run(&[]);
    assert!(!out.status.success(), "weir run succeeded with wrong credentials");
    let err = stderr(&out);
    assert!(err.contains(&job.state), "the error does not name the location:\n{err}");
    assert!(!err.contains(secret), "the secret access key was printed:\n{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains(secret));
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?} to fail", start.elapsed());
}

#[test]
fn an_s3_endpoint_that_is_not_a_url_is_refused_naming_the_setting() {
    let job = Job::counting(1, 1_000, 10, 0, "1s");
    let out = job.weir(&["run", "pipeline.yaml", "--state-dir", "s3://b/p", "--s3-endpoint", "127.0.0.1:9000"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--s3-endpoint"), "{}", stderr(&out));
}

#[test]
fn the_endpoint_of_aws_endpoint_url_is_used_as_the_aws_cli_would() {
    // A shell set up for the AWS CLI against MinIO: no weir setting at all.
    let bucket = bucket();
    let mut job = Job::counting(2, 20_000, 10, 0, "100ms").on_s3(&bucket);
    for (k, _) in job.env.iter_mut().filter(|(k, _)| k == "WEIR_S3_ENDPOINT") {
        *k = "AWS_ENDPOINT_URL".into();
    }
    let out = job.run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    assert!(!snapshot_keys(&job, &bucket, "checkpoints").is_empty(), "no checkpoint in the bucket");

    let mut bad = Job::counting(1, 1_000, 10, 0, "1s");
    bad.env = vec![("AWS_ENDPOINT_URL".into(), "127.0.0.1:9000".into())];
    let out = bad.weir(&["run", "pipeline.yaml", "--state-dir", "s3://b/p"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("S3 endpoint (AWS_ENDPOINT_URL) \"127.0.0.1:9000\""), "{}", stderr(&out));
}

// ---- Exactly-once output in S3 (files staged at the barrier, copied to their final names at checkpoint completion)

/// The key a marker's upload writes to: the file's staging object.
fn staged_key(marker: &str) -> String {
    format!("{}.staged", marker.strip_suffix(".upload").expect("a marker key"))
}

/// Polls the output prefix while a job runs and remembers every upload
/// marker it sees, so that the end of a test can check that each of their
/// uploads was completed or aborted (MinIO lists open uploads by exact key
/// only, so the keys must be known).
struct MarkerWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<std::collections::BTreeSet<String>>,
}

impl MarkerWatch {
    fn start(job: &Job) -> MarkerWatch {
        let (bucket, prefix) = job.s3_output.clone().expect("output in S3");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                seen.extend(bucket.list(&format!("{prefix}/")).into_iter().filter(|k| k.ends_with(".upload")));
                std::thread::sleep(Duration::from_millis(100));
            }
            seen
        });
        MarkerWatch { stop, thread }
    }

    /// The keys of every upload seen during the run.
    fn finish(self) -> Vec<String> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap().iter().map(|m| staged_key(m)).collect()
    }
}

/// What a user checks after a run that ended: no marker or staged objects
/// left, and no multipart upload of the run left open (S3 would bill for
/// its parts).
fn assert_no_upload_left(job: &Job, uploads: &[String]) {
    assert!(!uploads.is_empty(), "no upload marker was ever seen: the watch saw nothing");
    let hidden: Vec<String> = job.output_keys().into_iter().filter(|k| k.ends_with(".upload") || k.ends_with(".staged")).collect();
    assert!(hidden.is_empty(), "markers or staged files left behind: {hidden:?}");
    let (bucket, _) = job.s3_output.as_ref().unwrap();
    let open: Vec<String> = uploads.iter().flat_map(|k| bucket.open_uploads(k)).collect();
    assert!(open.is_empty(), "{} of {} uploads left open, e.g. {:?}", open.len(), uploads.len(), &open[..open.len().min(3)]);
}

#[test]
fn worker_kills_with_s3_output_keep_exactly_once_and_leave_no_upload_open() {
    let bucket = bucket();
    let job = Job::counting(2, 120_000, 89, 30_000, "150ms").on_s3(&bucket).output_on_s3(&bucket);
    let watch = MarkerWatch::start(&job);
    let mut child = job.spawn(&[]);
    // The helper that lists open uploads must see one while the job runs,
    // or the final check that none is left could not fail.
    let (b, prefix) = job.s3_output.clone().unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    let open_seen = loop {
        let markers: Vec<String> = b.list(&format!("{prefix}/")).into_iter().filter(|k| k.ends_with(".upload")).collect();
        let open = markers.iter().any(|m| !b.open_uploads(&staged_key(m)).is_empty());
        if open || Instant::now() > until {
            break open;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(open_seen, "no open upload was ever listed while the job ran");
    let kills = kill_workers_while_running(&job, &mut child, 4);
    let out = wait_with_timeout(child, Duration::from_secs(180));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    assert!(kills >= 2, "only {kills} kills happened before the job ended");
    job.assert_exactly_once();
    assert_no_upload_left(&job, &watch.finish());
    assert!(!job.path("out").exists(), "an s3:// sink wrote to local disk");
}

#[test]
fn whole_tree_kills_then_restore_latest_with_s3_output_keep_exactly_once() {
    let bucket = bucket();
    let job = Job::counting(2, 150_000, 61, 30_000, "200ms").on_s3(&bucket).output_on_s3(&bucket);
    let watch = MarkerWatch::start(&job);
    kill_trees_then_restore_latest(&job, 700..1500, Some("3"));
    job.assert_exactly_once();
    assert_no_upload_left(&job, &watch.finish());
}

/// Records come faster than checkpoints: files roll at `max_file_bytes`
/// and are uploaded in several 5 MiB parts (the records' order across
/// parts is what the exactly-once check reads back), and still appear
/// only at completion.
#[test]
fn big_output_rolls_by_size_into_multipart_objects_exactly_once() {
    let bucket = bucket();
    let max = 12u64 << 20;
    let yaml = format!("name: eo-test\nparallelism: 1\ncheckpoint:\n  interval: 4s\n  mode: aligned\nsource:\n  generator:\n    events: 700000\n    keys: 101\n    rate: 0\n    batch_size: 1024\nsteps:\n  - key_by: key\n  - running_count: count\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n    guarantee: exactly-once\n    max_file_bytes: {max}\n");
    let job = Job::with_pipeline(&yaml, 700_000, 101).on_s3(&bucket).output_on_s3(&bucket);
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(180));
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    job.assert_exactly_once();
    let (b, prefix) = job.s3_output.as_ref().unwrap();
    let committed: Vec<String> = job.output_keys().into_iter().filter(|k| !k.rsplit('/').next().unwrap_or_default().starts_with('.')).collect();
    let sizes: Vec<usize> = committed.iter().map(|k| b.get(k).unwrap().len()).collect();
    let several_parts = sizes.iter().filter(|&&s| s > 2 * (5 << 20)).count();
    assert!(several_parts >= 2, "expected files of three parts or more, got sizes {sizes:?} under {prefix}");
    assert!(sizes.iter().all(|&s| (s as u64) < max + (1 << 20)), "a file grew past max_file_bytes: {sizes:?}");
}

/// Stop with a savepoint, then resume from it: the savepoint's staged
/// files are published by the resumed run, and nothing hidden is left.
#[test]
fn stop_with_a_savepoint_then_resume_publishes_its_staged_files_once() {
    let bucket = bucket();
    let job = Job::counting(2, 60_000, 20, 15_000, "200ms").output_on_s3(&bucket);
    let child = job.spawn(&[]);
    job.wait_for_first_checkpoint();
    let out = job.weir(&["savepoint", "--state-dir", &job.state, "--stop"]).output().unwrap();
    assert!(out.status.success(), "weir savepoint --stop failed: {}", stderr(&out));
    let sp = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = wait_with_timeout(child, Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    let staged_at_stop: Vec<String> = job.output_keys().into_iter().filter(|k| k.ends_with(".staged")).collect();
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    job.assert_exactly_once();
    let hidden: Vec<String> = job.output_keys().into_iter().filter(|k| k.ends_with(".upload") || k.ends_with(".staged")).collect();
    assert!(hidden.is_empty(), "left behind: {hidden:?} (staged at the stop: {staged_at_stop:?})");
}

/// A killed run's upload completion can reach the server after a newer
/// run discarded the upload's marker, leaving a staged file that no marker
/// names. The next run deletes such files of its job, and only those.
#[test]
fn staged_files_of_older_runs_that_no_snapshot_needs_are_deleted_and_other_jobs_files_kept() {
    let bucket = bucket();
    let job = Job::counting(1, 20_000, 10, 0, "200ms").output_on_s3(&bucket);
    let (b, prefix) = job.s3_output.clone().unwrap();
    let out = job.run(&[]);
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    // A staged file of an earlier run of this job's state that no snapshot
    // needs (an upload cut off by a crash); one of another job; one of
    // another state of this job id (a run this state never had).
    let claim = a_claimed_run(&job);
    let orphan = format!("{prefix}/.part-eo-test.{claim}-000-000003.jsonl.staged");
    let other_job = format!("{prefix}/.part-other.{claim}-000-000003.jsonl.staged");
    let other_state = format!("{prefix}/.part-eo-test.feedface00-000-000003.jsonl.staged");
    for key in [&orphan, &other_job, &other_state] {
        b.put(key, "{\"seq\": 1}\n");
    }
    // Resuming the finished job ends it again, and it cleans up.
    let out = job.run(&["--restore", "latest"]);
    assert!(out.status.success(), "weir run failed:\n{}", stderr(&out));
    let keys = job.output_keys();
    assert!(!keys.contains(&orphan), "the orphaned staged file is still there: {keys:?}");
    assert!(keys.contains(&other_job), "another job's staged file was deleted: {keys:?}");
    assert!(keys.contains(&other_state), "another state's staged file was deleted: {keys:?}");
    job.assert_exactly_once();
}

/// A run id that claimed the job's (local) state.
fn a_claimed_run(job: &Job) -> String {
    let lineage = job.path("state/eo-test/lineage");
    let claim = std::fs::read_dir(&lineage).unwrap().flatten().find_map(|e| std::fs::read_to_string(e.path().join("claim")).ok()).unwrap_or_else(|| panic!("no claim under {}", lineage.display()));
    let claim: serde_json::Value = serde_json::from_str(&claim).unwrap();
    claim["run_id"].as_str().unwrap().to_string()
}

#[test]
fn s3_output_in_a_missing_bucket_fails_at_once_naming_the_path() {
    let bucket = bucket();
    let job = Job::counting(1, 5_000, 10, 0, "200ms").output_on_s3(&bucket);
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replace("s3://weir/", "s3://no-such-output-bucket/"));
    let start = Instant::now();
    let out = job.run(&[]);
    assert!(!out.status.success(), "weir run succeeded without the output bucket");
    let err = stderr(&out);
    assert!(err.contains("s3://no-such-output-bucket/"), "the error does not name the output:\n{err}");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?} to fail", start.elapsed());
}
