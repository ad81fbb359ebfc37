//! The delivery guarantee as a setting: a job that asks for at-least-once
//! does not align barriers, says so, and after worker kills has delivered
//! every event at least once (repeats counted, not refused). A job that asks
//! for at-most-once, or reads a socket, takes no checkpoints, says so, and
//! after the same kills has delivered no event twice (losses counted).

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
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

#[test]
fn an_at_most_once_job_repeats_no_event_after_worker_kills_and_counts_its_losses() {
    let job = Job::counting(3, 60_000, 30, 15_000, "200ms");
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    job.write_pipeline(&yaml.replacen("parallelism:", "guarantee: at-most-once\nparallelism:", 1));
    let mut child = job.spawn(&[]);
    let kills = kill_workers_while_running(&job, &mut child, 4);
    let out = wait_with_timeout(child, Duration::from_secs(180));
    let err = stderr(&out);
    assert!(out.status.success(), "weir run failed:\n{err}");
    assert!(kills >= 2, "only {kills} kills happened before the job ended");
    assert!(
        err.contains("no checkpoints (sinks publish every 200ms), guarantee at-most-once (the job's `guarantee` setting asks for at-most-once"),
        "the job did not say what it promises:\n{err}"
    );
    assert!(err.contains("where the sources last read"), "restarts resume at the read marks:\n{err}");
    let mut seen: HashMap<i64, u32> = HashMap::new();
    for l in job.committed_lines() {
        *seen.entry(l["seq"].as_i64().unwrap()).or_default() += 1;
    }
    let repeated: Vec<i64> = seen.iter().filter(|(_, n)| **n > 1).map(|(s, _)| *s).take(10).collect();
    assert!(repeated.is_empty(), "events delivered twice under at-most-once, e.g. {repeated:?}");
    let lost = job.events - seen.len() as u64;
    assert!(seen.keys().all(|s| (0..job.events as i64).contains(s)));
    // Nothing was read twice, and the job went on after every kill.
    assert!(lost < job.events / 2, "{lost} of {} events lost after {kills} kills", job.events);
    let checkpoints = std::fs::read_dir(job.path("state/eo-test/checkpoints")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(checkpoints, 0, "an at-most-once job wrote checkpoints");
    println!("at-most-once after {kills} kills: {} events delivered once, {lost} lost", seen.len());

    // Running it again resumes where the sources stopped: at the end.
    let again = job.run(&["--restore", "latest"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(job.committed_lines().len(), seen.len(), "a re-run read the input again");
    // A snapshot path cannot be restored: that would repeat what followed it.
    let refused = job.run(&["--restore", "state/eo-test/checkpoints/chk-1"]);
    let err = assert_refused(&refused);
    assert!(err.contains("the job is at-most-once: it restores no checkpoint or savepoint"), "{err}");
}

/// A socket server that sends `first` lines, waits for a word from the
/// test, sends `second` more and closes.
fn serve_lines(first: std::ops::Range<u64>, second: std::ops::Range<u64>) -> (String, std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let lines = |r: std::ops::Range<u64>| r.map(|i| format!("{{\"id\":{i},\"name\":\"n{i}\"}}\n")).collect::<String>();
        s.write_all(lines(first).as_bytes()).unwrap();
        let _ = wait.recv_timeout(Duration::from_secs(60));
        s.write_all(lines(second).as_bytes()).unwrap();
    });
    (address, go, server)
}

#[test]
fn a_socket_source_job_says_it_is_at_most_once_refuses_savepoints_and_reads_until_the_server_closes() {
    let (address, go, server) = serve_lines(0..1000, 1000..2500);
    let yaml = format!(
        "name: eo-test\nparallelism: 2\ncheckpoint:\n  interval: 100ms\nsource:\n  socket:\n    address: \"{address}\"\n    schema: {{id: int64, name: string}}\n    batch_size: 100\nsteps:\n  - key_by: id\nsink:\n  file:\n    path: out/eo\n    format: jsonl\n"
    );
    let job = Job::with_pipeline(&yaml, 2500, 0);
    let child = job.spawn(&[]);

    // What it promises, while it runs: in its status.
    let start = std::time::Instant::now();
    let status = loop {
        assert!(start.elapsed() < Duration::from_secs(30), "no status with every line of the first part published");
        std::thread::sleep(Duration::from_millis(200));
        let out = job.weir(&["status", "--state-dir", &job.state]).output().unwrap();
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else { continue };
        // Published without any checkpoint: the sink flushes every interval.
        if v["records_out"].as_u64() == Some(1000) && job.committed_lines().len() == 1000 {
            break v;
        }
    };
    assert_eq!(status["guarantee"], "at-most-once", "{status}");
    let why = status["guarantee_reason"].as_str().unwrap();
    assert!(why.contains("the socket source cannot replay what it read before a failure"), "{why}");
    assert!(status["latest_checkpoint"].is_null(), "{status}");
    let sp = job.weir(&["savepoint", "--state-dir", &job.state]).output().unwrap();
    assert!(!sp.status.success());
    assert!(stderr(&sp).contains("the job is at-most-once: it takes no checkpoints or savepoints"), "{}", stderr(&sp));

    go.send(()).unwrap();
    server.join().unwrap();
    let out = wait_with_timeout(child, Duration::from_secs(60));
    let err = stderr(&out);
    assert!(out.status.success(), "the job did not end with the connection:\n{err}");
    assert!(err.contains("guarantee at-most-once (the socket source cannot replay"), "{err}");
    let mut ids: Vec<i64> = job.committed_lines().iter().map(|l| l["id"].as_i64().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, (0..2500).collect::<Vec<_>>());
}
