//! The delivery guarantee as a setting: a job that asks for at-least-once
//! does not align barriers, says so, and after worker kills has delivered
//! every event at least once (repeats counted, not refused).

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;

#[test]
fn an_at_least_once_job_delivers_every_event_after_worker_kills_and_says_so() {
    let job = Job::counting(3, 60_000, 30, 15_000, "200ms");
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replacen("parallelism:", "guarantee: at-least-once\nparallelism:", 1));
    let mut child = job.spawn(&[]);
    let kills = kill_workers_while_running(&job, &mut child, 4);
    let out = wait_with_timeout(child, Duration::from_secs(180));
    let err = stderr(&out);
    assert!(out.status.success(), "weir run failed:\n{err}");
    assert!(kills >= 2, "only {kills} kills happened before the job ended");
    assert!(
        err.contains("non-aligned checkpoints") && err.contains("guarantee at-least-once (the job's `guarantee` setting asks for at-least-once"),
        "the job did not say what it promises:\n{err}"
    );
    let mut seen: HashMap<i64, u32> = HashMap::new();
    for l in job.committed_lines() {
        *seen.entry(l["seq"].as_i64().unwrap()).or_default() += 1;
    }
    let missing: Vec<i64> = (0..job.events as i64).filter(|s| !seen.contains_key(s)).take(10).collect();
    assert!(missing.is_empty(), "events lost under at-least-once, e.g. {missing:?}");
    let repeated = seen.values().filter(|n| **n > 1).count();
    println!("at-least-once after {kills} kills: {} events, {repeated} delivered more than once", seen.len());
}
