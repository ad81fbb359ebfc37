//! Crash points for failure tests: a worker started with
//! `WEIR_FAULT=<point>@<checkpoint id>` aborts (a crash, like SIGKILL) when it
//! reaches that point of that checkpoint (`<point>@<id>+`: of that
//! checkpoint or a later one, for points a checkpoint may pass by, such as
//! the Kafka sink's `after-marker`, reached only by a subtask that wrote
//! records in the interval). `WEIR_FAULT_ONCE=<file>` makes the
//! fault fire once per file, so the restored run goes on. Random kills hit
//! the narrow windows (during alignment, between completion and commit)
//! rarely; these points hit them every time.
//!
//! Points: `mid-alignment` (a barrier has arrived on some inputs only),
//! `after-ack` (a subtask acknowledged, the checkpoint is not complete),
//! `after-complete` (the coordinator wrote the metadata and pointer, no sink
//! has committed), `before-commit` (a sink got the completion, did not rename),
//! `after-sink-commit` (a sink subtask committed; with several sinks, the
//! others may not have).
//! The exactly-once Kafka sink adds `after-marker` (the progress marker is
//! flushed in the open transaction, the log entry not complete) and
//! `before-sink-commit` (the checkpoint completed, its transaction is not
//! committed). Unaligned checkpoints add `mid-recording` (a subtask has
//! snapshotted and is draining the records in flight towards it).
//! The PostgreSQL sink adds, in `two-phase-commit` mode, `mid-transaction`
//! (rows of the interval after checkpoint N's barrier are in the open
//! transaction, not prepared) and `after-prepare` (checkpoint N's
//! transaction is prepared, the subtask has not acknowledged); in
//! `write-ahead-log` mode, `after-wal-write` (checkpoint N's entry and its
//! acknowledgement are written in a transaction not yet committed) and
//! `after-wal-commit` (committed, the log file not yet deleted).
//!
//! `WEIR_SLOW_SINK=<duration>` makes every subtask of the sink's stage wait
//! that long before each batch it takes in: backpressure on demand, for
//! tests and benchmarks of checkpoints under backpressure.
//! `WEIR_SLOW_STAGE=<stage>:<duration>` does the same for another stage.
//! `WEIR_SLOW_SHARED_WRITE=<checkpoint>:<duration>` delays every write of a
//! shared state file (incremental checkpoints) of that checkpoint: a slow
//! store under which the checkpoint is abandoned mid-write.
//! `WEIR_SLOW_SINK_COMMIT=<checkpoint>:<duration>` delays the Kafka sink's
//! commit of that checkpoint's transaction: later checkpoints complete
//! while it is in flight.
//! `WEIR_FAILING_PUT=<text>` makes every write to storage of an object whose
//! path contains `<text>` fail, as a store that answers 500 or 403 does;
//! with `WEIR_FAILING_PUT_ONCE=<file>` only the first such write of all the
//! processes sharing `<file>` fails (a restore that took the same
//! checkpoint id again would otherwise fail the same way forever).
//! `WEIR_SLOW_SAVEPOINT_POLL=<duration>` makes `weir savepoint` wait that
//! long, instead of 100 ms, before it asks the job how its savepoint went:
//! a stopped job is then gone before the answer is read.

use std::sync::OnceLock;

/// The configured fault: its point, its checkpoint id, and whether a later
/// checkpoint's point fires too (`<id>+`).
fn configured() -> &'static Option<(String, u64, bool)> {
    static FAULT: OnceLock<Option<(String, u64, bool)>> = OnceLock::new();
    FAULT.get_or_init(|| {
        let spec = std::env::var("WEIR_FAULT").ok()?;
        let (point, id) = spec.split_once('@')?;
        let (id, or_later) = match id.strip_suffix('+') {
            Some(id) => (id, true),
            None => (id, false),
        };
        Some((point.to_string(), id.parse().ok()?, or_later))
    })
}

/// Aborts the process if the configured fault is `point` at `checkpoint_id`.
pub fn crash_point(point: &str, checkpoint_id: u64) {
    let Some((p, id, or_later)) = configured() else { return };
    if p != point || !(*id == checkpoint_id || (*or_later && checkpoint_id > *id)) {
        return;
    }
    if let Ok(marker) = std::env::var("WEIR_FAULT_ONCE") {
        if std::fs::OpenOptions::new().write(true).create_new(true).open(&marker).is_err() {
            return; // fired already
        }
    }
    eprintln!("fault injection: crashing at {point} of checkpoint {checkpoint_id}");
    std::process::abort();
}

/// How long a subtask of stage `stage` waits before each batch
/// (`WEIR_SLOW_STAGE`); none when unset or set for another stage.
pub fn slow_stage(stage: usize) -> Option<std::time::Duration> {
    static SLOW: OnceLock<Option<(usize, std::time::Duration)>> = OnceLock::new();
    let (slow, d) = (*SLOW.get_or_init(|| {
        let text = std::env::var("WEIR_SLOW_STAGE").ok()?;
        let (s, d) = text.split_once(':')?;
        Some((s.parse().ok()?, weir_api::pipeline::HumanDuration::parse(d).ok()?.get()))
    }))?;
    (slow == stage).then_some(d)
}

/// How long a subtask of the sink's stage waits before each batch (`WEIR_SLOW_SINK`); none when unset.
pub fn slow_sink() -> Option<std::time::Duration> {
    static SLOW: OnceLock<Option<std::time::Duration>> = OnceLock::new();
    *SLOW.get_or_init(|| {
        let text = std::env::var("WEIR_SLOW_SINK").ok()?;
        let d = weir_api::pipeline::HumanDuration::parse(&text).ok()?;
        Some(d.get())
    })
}

/// How long `weir savepoint` waits between asking how its savepoint went
/// (`WEIR_SLOW_SAVEPOINT_POLL`); none when unset.
pub fn slow_savepoint_poll() -> Option<std::time::Duration> {
    let text = std::env::var("WEIR_SLOW_SAVEPOINT_POLL").ok()?;
    Some(weir_api::pipeline::HumanDuration::parse(&text).ok()?.get())
}

/// Waits before a shared state file of `checkpoint_id` is written, when
/// `WEIR_SLOW_SHARED_WRITE` names that checkpoint.
pub async fn slow_shared_write(checkpoint_id: u64) {
    static SLOW: OnceLock<Option<(u64, std::time::Duration)>> = OnceLock::new();
    delay_of(&SLOW, "WEIR_SLOW_SHARED_WRITE", checkpoint_id, "slow shared write injected").await;
}

/// Waits before the Kafka sink commits the transaction of `checkpoint_id`,
/// when `WEIR_SLOW_SINK_COMMIT` names that checkpoint: a commit still in
/// flight when later checkpoints complete.
pub async fn slow_sink_commit(checkpoint_id: u64) {
    static SLOW: OnceLock<Option<(u64, std::time::Duration)>> = OnceLock::new();
    delay_of(&SLOW, "WEIR_SLOW_SINK_COMMIT", checkpoint_id, "slow sink commit injected").await;
}

/// Sleeps when the variable `var` (`<checkpoint>:<duration>`, read once
/// into `slow`) names `checkpoint_id`, saying so with `what`.
async fn delay_of(slow: &OnceLock<Option<(u64, std::time::Duration)>>, var: &str, checkpoint_id: u64, what: &str) {
    let slow = *slow.get_or_init(|| {
        let text = std::env::var(var).ok()?;
        let (id, d) = text.split_once(':')?;
        Some((id.parse().ok()?, weir_api::pipeline::HumanDuration::parse(d).ok()?.get()))
    });
    if let Some((id, d)) = slow {
        if id == checkpoint_id {
            tracing::warn!(checkpoint_id, delay_ms = d.as_millis() as u64, "{what}");
            tokio::time::sleep(d).await;
        }
    }
}

/// Why a write of the object at `path` fails, when `WEIR_FAILING_PUT`
/// names it (see the module's documentation).
pub fn failing_put(path: &str) -> Option<String> {
    static FAILING: OnceLock<Option<String>> = OnceLock::new();
    let text = FAILING.get_or_init(|| std::env::var("WEIR_FAILING_PUT").ok().filter(|t| !t.is_empty())).as_deref()?;
    if !path.contains(text) {
        return None;
    }
    if let Ok(marker) = std::env::var("WEIR_FAILING_PUT_ONCE") {
        if std::fs::OpenOptions::new().write(true).create_new(true).open(&marker).is_err() {
            return None; // failed once already
        }
    }
    tracing::warn!(path, "failing write injected");
    Some(format!("injected failure (WEIR_FAILING_PUT={text})"))
}
