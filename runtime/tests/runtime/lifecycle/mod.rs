//! The randomized lifecycle test: model-based, in the Jepsen spirit.
//!
//! The kill tests in `exactly_once.rs` attack one job during one life. Users
//! do more: they re-run finished jobs, take savepoints and then crash, stop
//! with a savepoint and change the pipeline, restore old snapshots, rescale,
//! start a job twice by mistake, and keep snapshots around for months. This
//! test draws random sequences of such actions and faults from a seed, runs
//! them against the real `weir` binary, and after each sequence checks what a
//! user would check: the committed output (every event there, every record
//! right) and that every retained checkpoint and savepoint still restores.
//!
//! # Why a duplicate can be told from a bug
//!
//! The pipeline is generator → key_by key → running_count → exactly-once file
//! sink. The generator deals event i into split `i % max_parallelism`, and
//! gives it key `i % keys`. With `keys` a multiple of `max_parallelism`, all
//! events of one key come from one split, in order, through one FIFO path
//! (one source subtask, one channel to the key's counting subtask), so the
//! only correct count of event `seq` is `seq / keys + 1`, whatever the
//! parallelism, the restarts and the restores. Every committed record is then
//! a function of its seq (`a_failure_free_run_commits_exactly_the_records_the_oracle_expects`
//! checks this claim), and so a record committed twice is either a legitimate
//! replay (identical) or a bug.
//!
//! # The oracle
//!
//! After each sequence the job is run to its end and the committed output must
//! hold every seq `0..events`, every line must be exactly the expected record,
//! and no seq may be committed twice, except after a *fork*: restoring a
//! snapshot older than the lineage's newest state replays what came after it
//! (as in Flink), so the seqs already committed when a fork restore began may
//! be committed again (identical, which the line check already demands). No
//! in-progress file (`.`-prefixed) may be left once the job finished.
//!
//! # The model
//!
//! The model knows what a user knows: whether the job runs, and if not,
//! whether its lineage (the history of state one fresh start leads to)
//! finished, crashed (process tree killed: resume with `--restore latest`) or
//! was stopped with a savepoint (resume from it); which snapshots belong to
//! the current lineage (a re-run after deleting the output starts a new one,
//! and the old lineage's snapshots describe output that no longer exists);
//! which snapshots it damaged on purpose; and the seqs that may repeat.
//!
//! # Sinks
//!
//! The first test writes with the exactly-once file sink; the second draws,
//! per sequence, the exactly-once Kafka sink or the PostgreSQL sink in
//! `two-phase-commit` or `write-ahead-log` mode (`output.rs`), whose
//! recovery paths (fencing, progress markers, prepared transactions,
//! acknowledgements) then meet every action above.
//!
//! # Reproducing
//!
//! Every random choice, kill timings included, comes from one seeded RNG per
//! sequence, drawn up front as a plan. Timings still vary with the machine (a
//! kill may land before or after a checkpoint), so a rerun of a seed replays
//! the same actions, not necessarily the same interleaving. The seed is
//! printed first and in every failure. `WEIR_LIFECYCLE_SEED` fixes it,
//! `WEIR_LIFECYCLE_SEQUENCES` sets how many sequences run (sequence k uses
//! seed + k, so a failing sequence reruns alone with its own seed);
//! `WEIR_LIFECYCLE_FOCUS=<action>` (say `FailingStore`) skips the sequences
//! whose plan lacks that action; `scripts/soak-lifecycle` runs many.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use output::{Output, SinkKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

mod output;
mod start_latest;

const REPRODUCE: &str = "cargo test --release --workspace --test runtime lifecycle::random_lifecycles_keep";
const REPRODUCE_CONNECTORS: &str = "cargo test --release --workspace --test runtime lifecycle::random_lifecycles_with_connector";
const MAX_PARALLELISM: u32 = 8;
const JOB_DIR: &str = "state/eo-test";
/// Bound on any run that should end by itself. Ten restarts with backoff (a
/// job giving up) take about 35 s, so a run still going after this hangs.
const RUN_LIMIT: Duration = Duration::from_secs(90);

/// What may change in the pipeline between runs without breaking its state:
/// a stateless filter before `key_by` (the count keeps its state through its
/// `id`) and the checkpoint interval and mode (aligned, unaligned, or
/// aligned with an alignment timeout: a restore hands an unaligned
/// checkpoint's in-flight records to a job of any mode), whether
/// checkpoints are incremental, and whether the pipeline is written as a
/// chain or as the same path in graph form (whose nodes keep the chain's
/// state ids). None changes the output.
///
/// `pairs`, drawn once per sequence (it adds state the other forms lack),
/// makes the pipeline a graph with a join and two sinks: a second source
/// `b` generates the same events, an interval join pairs each event of
/// `source` with its twin in `b` (same key, same event time `value`), and
/// the pairs, cut back to `seq, key, value`, are keyed and counted into a
/// second exactly-once file sink `pairs` (`out/pairs`). Per key both join
/// inputs arrive in seq order, so pairs leave in seq order and the second
/// sink's only correct record is the first's: the same oracle judges both.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    filter: bool,
    interval_ms: u64,
    mode: Mode,
    incremental: bool,
    graph: bool,
    pairs: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Aligned,
    Unaligned,
    AlignmentTimeout,
}

impl Mode {
    fn draw(rng: &mut StdRng) -> Mode {
        [Mode::Aligned, Mode::Unaligned, Mode::AlignmentTimeout][rng.random_range(0..3)]
    }

    fn yaml(self) -> &'static str {
        match self {
            Mode::Aligned => "  mode: aligned\n",
            Mode::Unaligned => "  mode: unaligned\n",
            Mode::AlignmentTimeout => "  alignment_timeout: 5ms\n",
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Size {
    events: u64,
    keys: u64,
    /// Events per second of the generator (0: unlimited).
    rate: u64,
}

fn pipeline_yaml(size: Size, shape: Shape, parallelism: u32, sink: &str) -> String {
    let Size { events, keys, rate } = size;
    if shape.graph || shape.pairs {
        return graph_yaml(size, shape, parallelism, sink);
    }
    let filter = if shape.filter { "  - filter: \"seq >= 0\"\n" } else { "" };
    format!(
        "name: eo-test\nparallelism: {parallelism}\nmax_parallelism: {MAX_PARALLELISM}\ncheckpoint:\n  interval: {}ms\n  incremental: {}\n{}\
         source:\n  generator:\n    events: {events}\n    keys: {keys}\n    rate: {rate}\n    batch_size: 100\n\
         steps:\n{filter}  - key_by: key\n  - running_count: count\n    id: counts\n{sink}",
        shape.interval_ms,
        shape.incremental,
        shape.mode.yaml()
    )
}

/// `pipeline_yaml`'s pipeline as a graph: the source and sink named as a
/// chain's (`source`, `sink`) and the count named by its id, so that either
/// form restores the other's snapshots; the steps written out of order.
fn graph_yaml(size: Size, shape: Shape, parallelism: u32, sink: &str) -> String {
    let Size { events, keys, rate } = size;
    let (filter, keyed_input) = if shape.filter { ("  - {name: all, input: source, filter: \"seq >= 0\"}\n", "all") } else { ("", "source") };
    let sink_node: String = sink.strip_prefix("sink:\n").unwrap_or(sink).lines().map(|l| format!("  {l}\n")).collect();
    let generator = format!("    generator:\n      events: {events}\n      keys: {keys}\n      rate: {rate}\n      batch_size: 100\n");
    // The join's watermark stays far behind (no event is late, whatever
    // the order the splits interleave in); its state goes at the end.
    let (sources, pair_steps, pair_sink) = if shape.pairs {
        let timed = format!("{generator}    event_time: {{field: value, max_out_of_orderness: 1h}}\n");
        (
            format!("  source:\n{timed}  b:\n{timed}"),
            "  - {name: joined, input: [source, b], interval_join: {on: key, between: {lower: 0s, upper: 0s}}}\n\
             \x20 - {name: pair_fields, input: joined, select: [seq, key, value]}\n\
             \x20 - {name: pair_keys, input: pair_fields, key_by: key}\n\
             \x20 - {name: pair_counts, input: pair_keys, running_count: count}\n",
            "  pairs:\n    input: pair_counts\n    file:\n      path: out/pairs\n      format: jsonl\n      guarantee: exactly-once\n",
        )
    } else {
        (format!("  source:\n{generator}"), "", "")
    };
    format!(
        "name: eo-test\nparallelism: {parallelism}\nmax_parallelism: {MAX_PARALLELISM}\ncheckpoint:\n  interval: {}ms\n  incremental: {}\n{}\
         sources:\n{sources}\
         steps:\n  - {{name: counts, input: keyed, running_count: count}}\n{filter}  - {{name: keyed, input: {keyed_input}, key_by: key}}\n{pair_steps}\
         sinks:\n  sink:\n    input: counts\n{sink_node}{pair_sink}",
        shape.interval_ms,
        shape.incremental,
        shape.mode.yaml()
    )
}

/// Where the `pairs` sink of [`Shape::pairs`] writes, under the job's directory.
const PAIRS_DIR: &str = "out/pairs";

/// The `pairs` sink's output once the job finished: the oracle's records
/// (repeats only of `may_repeat`; any with `None`), and no in-progress
/// file that no snapshot references beyond those of `left_before`.
fn check_pairs(out: &Path, job_dir: &Path, size: Size, may_repeat: Option<&HashSet<i64>>, left_before: &BTreeSet<String>) -> Step {
    let lines = output::committed_files(out)?;
    check_output(&lines, size, may_repeat).map_err(|e| in_pairs(e, "once the job finished"))?;
    let referenced = referenced_in_progress(job_dir);
    let left: Vec<String> = in_progress_files(out).difference(left_before).filter(|f| !referenced.contains(*f)).cloned().collect();
    if !left.is_empty() {
        return Err(violation("no in-progress file that no snapshot references is left once the job finished", format!("{PAIRS_DIR}: {left:?}")));
    }
    Ok(())
}

/// A violation found in the `pairs` sink's output, said so.
fn in_pairs(e: Stop, when: &str) -> Stop {
    match e {
        Stop::Violation { invariant, detail } => violation(&format!("the joined pairs' sink, {when}: {invariant}"), detail),
        other => other,
    }
}

/// The only correct record for event `seq` (see the module comment).
fn expected_record(seq: i64, keys: u64) -> Value {
    let keys = keys as i64;
    json!({"seq": seq, "key": seq % keys, "value": seq, "count": seq / keys + 1})
}

/// Why a sequence stopped early.
#[derive(Debug)]
enum Stop {
    /// weir broke an invariant a user relies on.
    Violation { invariant: String, detail: String },
    /// The harness could not tell (e.g. the job ended before a fault could
    /// land in a way that matters); not counted as a failure.
    Inconclusive(String),
}

fn violation(invariant: &str, detail: impl Into<String>) -> Stop {
    Stop::Violation { invariant: invariant.into(), detail: detail.into() }
}

type Step = Result<(), Stop>;

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------
// The oracle

/// The output oracle. `may_repeat`: seqs that may be committed twice (those
/// committed when a fork restore began); `None`: any seq may repeat.
fn check_output(lines: &[(String, Value)], size: Size, may_repeat: Option<&HashSet<i64>>) -> Step {
    let mut seen: HashMap<i64, String> = HashMap::new();
    let mut wrong = Vec::new();
    let mut twice = Vec::new();
    for (file, v) in lines {
        let seq = v["seq"].as_i64().unwrap_or(-1);
        let expected = expected_record(seq, size.keys);
        if *v != expected || seq < 0 || seq as u64 >= size.events {
            wrong.push(format!("{file}: {v} but expected {expected}"));
            continue;
        }
        if let Some(first) = seen.insert(seq, file.clone()) {
            if !may_repeat.is_none_or(|m| m.contains(&seq)) {
                twice.push(format!("seq {seq} in {first} and {file}"));
            }
        }
    }
    if !wrong.is_empty() {
        return Err(violation(
            "every committed record is the one a failure-free run commits (count = seq / keys + 1)",
            format!("{} wrong records, e.g.:\n{}", wrong.len(), wrong[..wrong.len().min(5)].join("\n")),
        ));
    }
    if !twice.is_empty() {
        return Err(violation(
            "no event is committed twice, except events already committed when an older snapshot was restored",
            format!("{} events committed twice, e.g.:\n{}", twice.len(), twice[..twice.len().min(5)].join("\n")),
        ));
    }
    let missing: Vec<u64> = (0..size.events).filter(|s| !seen.contains_key(&(*s as i64))).collect();
    if !missing.is_empty() {
        return Err(violation(
            "every event is committed",
            format!("{} of {} events missing, e.g. seqs {:?}", missing.len(), size.events, &missing[..missing.len().min(10)]),
        ));
    }
    Ok(())
}

/// The events each generator split had emitted at a snapshot, from its
/// `_metadata` (`"splits": {"generator-<k>": n}`): split k's events are
/// seqs k, k + MAX_PARALLELISM, … `None` if the metadata does not say.
fn savepoint_read_positions(dir: &Path) -> Option<BTreeMap<i64, u64>> {
    fn collect(v: &Value, out: &mut BTreeMap<i64, u64>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x.as_object()) {
                        ("splits", Some(splits)) => {
                            for (name, n) in splits {
                                if let (Some(i), Some(n)) = (name.strip_prefix("generator-").and_then(|i| i.parse().ok()), n.as_u64()) {
                                    out.insert(i, n);
                                }
                            }
                        }
                        _ => collect(x, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(dir.join("_metadata")).ok()?;
    let json = text.trim_end().rsplit_once('\n').map(|(j, _)| j)?;
    let mut out = BTreeMap::new();
    collect(&serde_json::from_str(json).ok()?, &mut out);
    (!out.is_empty()).then_some(out)
}

/// One committed record (`at`: where it is) is the one a failure-free run
/// commits for its seq; its seq.
fn check_record(at: &str, v: &Value, size: Size) -> Result<i64, Stop> {
    let seq = v["seq"].as_i64().unwrap_or(-1);
    let expected = expected_record(seq, size.keys);
    if *v != expected || seq < 0 || seq as u64 >= size.events {
        return Err(violation("every committed record is the one a failure-free run commits (count = seq / keys + 1)", format!("{at}: {v} but expected {expected}")));
    }
    Ok(seq)
}

/// After a stop: each split's committed events (repeats aside) are its
/// first ones, none missing before the last, and, with the stop
/// savepoint's read positions, as many as it had read (at least as many
/// after a fork, which may have committed further before going back).
fn check_prefix_up_to(lines: &[(String, Value)], size: Size, read: Option<&BTreeMap<i64, u64>>, forked: bool) -> Step {
    let m = MAX_PARALLELISM as i64;
    let mut by_split: BTreeMap<i64, BTreeSet<i64>> = BTreeMap::new();
    for (at, v) in lines {
        let seq = check_record(at, v, size)?;
        by_split.entry(seq % m).or_default().insert(seq);
    }
    for split in 0..m {
        let seqs = by_split.remove(&split).unwrap_or_default();
        if let Some((e, _)) = seqs.iter().enumerate().find(|(e, s)| **s != split + *e as i64 * m) {
            return Err(violation(
                "a job stopped with a savepoint has published all it read up to it",
                format!("split {split}: seq {} is not committed, but {} later ones are", split + e as i64 * m, seqs.len() - e),
            ));
        }
        let Some(r) = read.map(|r| r.get(&split).copied().unwrap_or(0)) else { continue };
        let n = seqs.len() as u64;
        if n < r || (n > r && !forked) {
            return Err(violation(
                "a job stopped with a savepoint has published exactly what it read up to it",
                format!("split {split}: the savepoint had read {r} events, {n} are committed"),
            ));
        }
    }
    Ok(())
}

/// In-progress sink files some complete snapshot of the job still lists as
/// pending: they stay until that snapshot is restored (a savepoint taken just
/// before a crash keeps its files so that it remains restorable).
/// Also the sink log files (Kafka, write-ahead log) and the prepared
/// transactions (PostgreSQL) a snapshot references: they stay while it may
/// be restored.
fn referenced_in_progress(job_dir: &Path) -> BTreeSet<String> {
    referenced_in_progress_except(job_dir, None)
}

/// [`referenced_in_progress`] by every snapshot but `except` (a directory
/// name, `sp-…`): what a committed snapshot may not excuse.
fn referenced_in_progress_except(job_dir: &Path, except: Option<&str>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for sub in ["checkpoints", "savepoints"] {
        for snapshot in std::fs::read_dir(job_dir.join(sub)).into_iter().flatten().flatten() {
            if except.is_some_and(|e| snapshot.file_name().to_string_lossy() == e) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(snapshot.path().join("_metadata")) else { continue };
            // The metadata is JSON followed by a `crc32:` line.
            let json = text.trim_end().rsplit_once('\n').map(|(j, _)| j).unwrap_or("");
            let Ok(meta) = serde_json::from_str::<serde_json::Value>(json) else { continue };
            for state in ["sink", "pairs"].iter().flat_map(|sink| meta["operators"][sink].as_array().into_iter().flatten()) {
                for p in state["inline"]["pending"].as_array().into_iter().flatten() {
                    if let Some(t) = p["temp"].as_str() {
                        out.insert(t.to_string());
                    }
                }
                // The log files of the Kafka and write-ahead-log sinks, and
                // the PostgreSQL sink's prepared transactions.
                for e in ["kafka", "log"].iter().flat_map(|k| state["inline"][k].as_array().into_iter().flatten()) {
                    if let Some(name) = e["file"]["name"].as_str() {
                        out.insert(name.to_string());
                    }
                }
                for e in state["inline"]["transactions"].as_array().into_iter().flatten() {
                    if let Some(gid) = e["gid"].as_str() {
                        out.insert(gid.to_string());
                    }
                }
            }
        }
    }
    out
}

fn in_progress_files(out: &Path) -> BTreeSet<String> {
    std::fs::read_dir(out)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.ends_with(".inprogress")).collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Snapshots as `weir checkpoints list --json` shows them

#[derive(Debug, Clone)]
struct Snapshot {
    id: u64,
    kind: String,
    location: String,
    complete: bool,
    is_latest: bool,
}

fn list_snapshots(job: &Job) -> Vec<Snapshot> {
    let out = job.weir(&["checkpoints", "list", "--json", "--state-dir", "state"]).output().unwrap();
    assert!(out.status.success(), "weir checkpoints list failed: {}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v.as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let s = &e["snapshot"];
            Snapshot {
                id: s["id"].as_u64().unwrap_or(0),
                kind: s["kind"].as_str().unwrap_or("").to_lowercase(),
                location: s["location"].as_str().unwrap_or("").to_string(),
                complete: s["complete"].as_bool().unwrap_or(false),
                is_latest: s["is_latest"].as_bool().unwrap_or(false),
            }
        })
        .collect()
}

/// The snapshot id in a lineage pointer or a location (`chk-N`, `sp-N-ms`).
fn snapshot_id(text: &str) -> Option<u64> {
    let name = text.trim().trim_end_matches('/').rsplit('/').next()?;
    let digits = name.strip_prefix("chk-").or_else(|| name.strip_prefix("sp-"))?;
    digits.split('-').next()?.parse().ok()
}

fn arrow_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "arrow")).collect())
        .unwrap_or_default();
    files.sort();
    files
}

// ---------------------------------------------------------------------------
// Actions

/// One user action or fault, with every random parameter drawn up front.
#[derive(Debug, Clone)]
enum Action {
    /// Start the job as its state says (fresh, `--restore latest`, or from the
    /// stop savepoint), or let the running one run to its end.
    Start,
    /// Finish the job, delete its output, run it again without `--restore`
    /// (sometimes killing a worker before the new run's first checkpoint).
    ReRun { kill_worker: bool },
    /// SIGKILL one worker after a while, sometimes during a checkpoint.
    KillWorker { after_ms: u64, during_checkpoint: bool, victim: usize },
    /// SIGKILL `weir run` and all its workers; the next start restores latest.
    KillTree { after_ms: u64 },
    /// `weir savepoint` while the job runs.
    Savepoint { after_ms: u64 },
    /// `weir savepoint --stop`: the job must then exit 0 by itself.
    StopWithSavepoint { after_ms: u64 },
    /// `weir savepoint --dispose` of a savepoint on disk while the job runs:
    /// its directory goes (and what only it held outside storage); the
    /// job's latest snapshot is refused. Later restores of the others, and
    /// the output, must not notice.
    DisposeSavepoint { after_ms: u64, pick: usize },
    /// Restore a remembered savepoint or a retained checkpoint of the lineage.
    Restore { pick: usize, parallelism: u32 },
    /// Stop (crash or stop-with-savepoint) and restore at another parallelism.
    Rescale { parallelism: u32, via_savepoint: bool },
    /// Stop and restore with a compatible change of the pipeline.
    ChangePipeline { shape: Shape, via_savepoint: bool },
    /// Start a second `weir run` of the job while it runs: refused at once.
    SecondRun { after_ms: u64 },
    /// Damage a state file of a complete snapshot and restore it: it must fail
    /// at once, name the file and change nothing.
    Corrupt { pick: usize, file_pick: usize, offset_pick: u64 },
    /// `weir savepoint`, then SIGKILL the process tree at once, before the
    /// next checkpoint: the savepoint's interval is published once, whether
    /// the job resumes from it or (later, in a copy) it is restored again.
    SavepointThenCrash { after_ms: u64 },
    /// From now on the store is slow: every shared file of a checkpoint a
    /// few ids ahead takes `delay_ms` to write, longer than the checkpoint
    /// timeout, so that an incremental checkpoint is abandoned mid-write
    /// (the job is stopped and resumed with incremental checkpoints).
    SlowStore { ahead: u64, delay_ms: u64, via_savepoint: bool },
    /// A second job of the same name from a state directory of its own
    /// (`state-twin`), with a worker killed: to the same output directory
    /// (file sink; the output lock refuses two runs at once, so the job is
    /// crashed first and leaves its pending files there), or beside the
    /// running job to another table or topic of the same server. Each is
    /// exactly once; neither touches the other's transactions or files.
    TwinJob { kill_after_ms: u64 },
    /// From now on one write to storage fails (once, in all processes): an
    /// object of a checkpoint a few ids ahead, chosen by `object`
    /// ([`FailedPut`]), as a store answering 500 or 403 does (the job is
    /// stopped and resumed with the fault set).
    FailingStore { ahead: u64, object: FailedPut, via_savepoint: bool },
}

/// Which object of checkpoint N the failing store refuses.
#[derive(Debug, Clone, Copy)]
enum FailedPut {
    /// A shared state file (incremental checkpoints are turned on).
    SharedFile,
    /// The first file written in the checkpoint's directory: a subtask's
    /// state file, or the metadata when there is none.
    StateFile,
    /// The checkpoint's `_metadata`, written by the coordinator.
    Metadata,
    /// The lineage's record of the checkpoint, written after its metadata:
    /// the checkpoint looks complete on disk but was never completed.
    LineageRecord,
    /// A sink's log entry (the Kafka and write-ahead-log sinks'; the file
    /// sink has none, and nothing fails).
    SinkLog,
}

impl FailedPut {
    fn draw(rng: &mut StdRng) -> FailedPut {
        [FailedPut::SharedFile, FailedPut::StateFile, FailedPut::Metadata, FailedPut::LineageRecord, FailedPut::SinkLog][rng.random_range(0..5)]
    }

    /// What the object's path contains (`WEIR_FAILING_PUT`), for checkpoint `id`.
    fn pattern(self, id: u64) -> String {
        match self {
            FailedPut::SharedFile => format!("-chk{id}.arrow"),
            FailedPut::StateFile => format!("checkpoints/chk-{id}/"),
            FailedPut::Metadata => format!("checkpoints/chk-{id}/_metadata"),
            FailedPut::LineageRecord => format!("chk-{id:020}"),
            FailedPut::SinkLog => format!("-{id:012}.arrow"),
        }
    }
}

fn draw_plan(rng: &mut StdRng) -> Vec<Action> {
    let n = rng.random_range(3..=8);
    (0..n)
        .map(|_| match rng.random_range(0..24) {
            0..=1 => Action::Start,
            2 => Action::ReRun { kill_worker: rng.random_bool(0.5) },
            3..=6 => Action::KillWorker { after_ms: rng.random_range(0..1500), during_checkpoint: rng.random_bool(0.5), victim: rng.random_range(0..4) },
            7..=8 => Action::KillTree { after_ms: rng.random_range(100..1500) },
            9..=10 => Action::Savepoint { after_ms: rng.random_range(0..1200) },
            11 => Action::StopWithSavepoint { after_ms: rng.random_range(0..1200) },
            12..=13 => Action::Restore { pick: rng.random_range(0..64), parallelism: rng.random_range(1..=4) },
            14 => Action::Rescale { parallelism: rng.random_range(1..=4), via_savepoint: rng.random_bool(0.5) },
            15 => Action::ChangePipeline {
                shape: Shape { filter: rng.random_bool(0.5), interval_ms: [100, 150, 200, 300][rng.random_range(0..4)], mode: Mode::draw(rng), incremental: rng.random_bool(0.5), graph: rng.random_bool(0.5), pairs: false },
                via_savepoint: rng.random_bool(0.5),
            },
            16..=17 => Action::SecondRun { after_ms: rng.random_range(0..800) },
            18 => Action::SavepointThenCrash { after_ms: rng.random_range(0..1200) },
            19 => Action::SlowStore { ahead: rng.random_range(1..=4), delay_ms: rng.random_range(600..=1500), via_savepoint: rng.random_bool(0.5) },
            20 => Action::TwinJob { kill_after_ms: rng.random_range(100..1500) },
            21 => Action::FailingStore { ahead: rng.random_range(1..=4), object: FailedPut::draw(rng), via_savepoint: rng.random_bool(0.5) },
            22 => Action::DisposeSavepoint { after_ms: rng.random_range(0..1200), pick: rng.random_range(0..64) },
            _ => Action::Corrupt { pick: rng.random_range(0..64), file_pick: rng.random_range(0..64), offset_pick: rng.random() },
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq)]
enum Lineage {
    NotStarted,
    Running,
    Finished,
    /// The process tree was killed: the next start restores latest.
    Crashed,
    /// Stopped with this savepoint: the next start restores it.
    Stopped(String),
}

/// A `weir run` in progress.
struct Run {
    proc: KillOnDrop,
    stderr: PathBuf,
    label: String,
    /// The run id in `run.json` before this run started (stale: not this run's).
    stale_run_id: Option<String>,
    /// The attempt whose worker was last killed: wait for the next one.
    attacked_run_id: Option<String>,
}

struct Model<'a> {
    job: &'a Job,
    /// Where the sink writes in the current lineage.
    output: Output<'a>,
    size: Size,
    shape: Shape,
    parallelism: u32,
    stop_supported: bool,
    run: Option<Run>,
    lineage: Lineage,
    /// Snapshot ids up to this one belong to lineages before the last re-run.
    lineage_base: u64,
    abandoned: HashSet<String>,
    corrupted: HashSet<String>,
    may_repeat: HashSet<i64>,
    /// As `may_repeat`, for the `pairs` sink ([`Shape::pairs`]).
    may_repeat_pairs: HashSet<i64>,
    /// After a fork whose earlier output cannot be read whole (a prepared
    /// PostgreSQL transaction), any seq may repeat.
    any_may_repeat: bool,
    runs_started: u32,
    started: Instant,
    history: Vec<String>,
    /// Set by [`Action::SlowStore`]: (checkpoint id, delay in ms).
    slow_store: Option<(u64, u64)>,
    /// How many twin jobs ran ([`Action::TwinJob`]).
    twins: u32,
    /// Set by [`Action::FailingStore`]: (what the path contains, the marker
    /// file that makes it fail once).
    failing_put: Option<(String, PathBuf)>,
}

impl<'a> Model<'a> {
    fn note(&mut self, what: impl Into<String>) {
        let line = format!("[{:5.1}s] {}", self.started.elapsed().as_secs_f64(), what.into());
        println!("    {line}");
        self.history.push(line);
    }

    fn out_dir(&self) -> PathBuf {
        self.job.path("out/eo")
    }

    fn pipeline(&self) -> String {
        let yaml = pipeline_yaml(self.size, self.shape, self.parallelism, &self.output.sink_yaml());
        match self.slow_store {
            // A checkpoint timeout below the delay: the slow one is abandoned.
            Some((_, delay)) => yaml.replacen("checkpoint:\n", &format!("checkpoint:\n  timeout: {}ms\n", delay / 2), 1),
            None => yaml,
        }
    }

    fn current_run_id(&self) -> Option<String> {
        self.job.worker_pids().map(|(_, r)| r)
    }

    /// Spawns `weir run` with the model's pipeline; stdout and stderr go to
    /// files in `runs/` (a pipe nobody reads could block the supervisor).
    fn spawn_run(&mut self, restore: Option<&str>, label: &str) -> (KillOnDrop, PathBuf) {
        self.job.write_pipeline(&self.pipeline());
        self.runs_started += 1;
        let logs = self.job.path("runs");
        std::fs::create_dir_all(&logs).unwrap();
        let err = logs.join(format!("{:02}-{label}.stderr", self.runs_started));
        let out = logs.join(format!("{:02}-{label}.stdout", self.runs_started));
        let p = self.parallelism.to_string();
        let mut extra = vec!["--parallelism", p.as_str()];
        if let Some(r) = restore {
            extra.extend(["--restore", r]);
        }
        let mut c = self.job.command(&extra);
        if let Some((id, delay)) = self.slow_store {
            c.env("WEIR_SLOW_SHARED_WRITE", format!("{id}:{delay}ms"));
        }
        if let Some((pattern, once)) = &self.failing_put {
            c.env("WEIR_FAILING_PUT", pattern).env("WEIR_FAILING_PUT_ONCE", once);
        }
        c.envs(self.output.env()).stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .process_group(0);
        let what = format!("weir run --parallelism {}{}{}{} ({})", self.parallelism, if self.shape.filter { " +filter" } else { "" }, if self.shape.graph { " (graph)" } else { "" }, restore.map(|r| format!(" --restore {r}")).unwrap_or_default(), err.file_name().unwrap().to_string_lossy());
        self.note(what);
        (KillOnDrop::new(c.spawn().unwrap()), err)
    }

    fn start(&mut self, restore: Option<&str>, label: &str) {
        assert!(self.run.is_none());
        let stale_run_id = self.current_run_id();
        let (proc, stderr) = self.spawn_run(restore, label);
        self.run = Some(Run { proc, stderr, label: label.into(), stale_run_id, attacked_run_id: None });
        self.lineage = Lineage::Running;
    }

    /// Whether the lineage's latest is a snapshot of the current lineage.
    /// After a re-run it may still be the previous lineage's last checkpoint
    /// (when the re-run crashed before it began its own), whose output the
    /// user deleted: a crash before the new lineage's first checkpoint is then
    /// resumed by starting afresh, as a user would.
    fn lineage_has_a_checkpoint(&self) -> bool {
        self.job.latest().and_then(|l| snapshot_id(&l)).is_some_and(|id| id > self.lineage_base)
    }

    /// Starts the job the way its state calls for.
    fn start_lineage(&mut self) {
        match self.lineage.clone() {
            Lineage::Running => {}
            Lineage::NotStarted => self.start(None, "fresh"),
            Lineage::Stopped(sp) => self.start(Some(&sp), "from-stop-savepoint"),
            Lineage::Crashed | Lineage::Finished if self.lineage_has_a_checkpoint() => self.start(Some("latest"), "restore-latest"),
            // Nothing of this lineage was committed: start it again.
            Lineage::Crashed => self.start(None, "fresh-again"),
            // Unreachable in practice: a finished job has completed its final checkpoint.
            Lineage::Finished => self.note("finished without a checkpoint: nothing to restore"),
        }
    }

    /// Has the running `weir run` ended? Then checks that it ended well.
    fn reap(&mut self) -> Step {
        let Some(run) = &mut self.run else { return Ok(()) };
        let Some(status) = run.proc.try_wait() else { return Ok(()) };
        let run = self.run.take().unwrap();
        if status.success() {
            self.lineage = Lineage::Finished;
            self.note(format!("{} finished (exit 0)", run.label));
            Ok(())
        } else {
            Err(violation(
                "a run that nobody stops finishes with exit 0, whatever workers were killed",
                format!("{} exited with {status}; stderr ({}):\n{}", run.label, run.stderr.display(), tail(&run.stderr, 15)),
            ))
        }
    }

    fn running(&mut self) -> Result<bool, Stop> {
        self.reap()?;
        Ok(self.run.is_some())
    }

    /// Lets the running job run to its end.
    fn finish(&mut self) -> Step {
        if let Some(run) = &mut self.run {
            if run.proc.wait_for(RUN_LIMIT).is_none() {
                let run = self.run.take().unwrap();
                let stderr = run.stderr.clone();
                drop(run);
                return Err(violation("a bounded job ends", format!("still running after {RUN_LIMIT:?}; stderr:\n{}", tail(&stderr, 15))));
            }
        }
        self.reap()
    }

    /// Makes sure the job runs. A finished job is re-run (a user who wants it
    /// running again); otherwise it resumes as its state says.
    fn ensure_running(&mut self) -> Step {
        if self.running()? {
            return Ok(());
        }
        if self.lineage == Lineage::Finished {
            return self.re_run(false);
        }
        self.start_lineage();
        Ok(())
    }

    /// Sleeps while the job runs; false if it ended meanwhile.
    fn sleep_running(&mut self, ms: u64) -> Result<bool, Stop> {
        let until = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < until {
            if !self.running()? {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.running()
    }

    /// The current attempt's live workers (children of our `weir run`), once
    /// a new attempt has written `run.json`.
    fn live_workers(&mut self, within: Duration) -> Result<Option<(Vec<u32>, String)>, Stop> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if !self.running()? {
                return Ok(None);
            }
            let run = self.run.as_ref().unwrap();
            if let Some((pids, run_id)) = self.job.worker_pids() {
                if Some(&run_id) != run.stale_run_id.as_ref() && Some(&run_id) != run.attacked_run_id.as_ref() {
                    let mine: Vec<u32> = pids.into_iter().filter(|p| parent_of(*p) == Some(run.proc.pid())).collect();
                    if !mine.is_empty() {
                        return Ok(Some((mine, run_id)));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(None)
    }

    fn checkpoint_in_progress(&self) -> bool {
        let out = self.job.weir(&["status", "--state-dir", "state"]).output().unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        v["checkpoint_in_progress"].is_u64()
    }

    fn kill_worker(&mut self, during_checkpoint: bool, victim: usize) -> Step {
        let Some((pids, run_id)) = self.live_workers(Duration::from_secs(5))? else {
            self.note("no worker to kill: the job ended first");
            return Ok(());
        };
        let mut aimed = "";
        if during_checkpoint {
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until && !self.checkpoint_in_progress() {
                std::thread::sleep(Duration::from_millis(5));
            }
            aimed = " (aimed at a checkpoint in progress)";
        }
        let pid = pids[victim % pids.len()];
        if !self.running()? || parent_of(pid) != Some(self.run.as_ref().unwrap().proc.pid()) {
            self.note("no worker to kill: the job ended first");
            return Ok(());
        }
        kill(pid);
        self.run.as_mut().unwrap().attacked_run_id = Some(run_id.clone());
        self.note(format!("killed worker pid {pid} of attempt {run_id}{aimed}"));
        Ok(())
    }

    fn kill_tree(&mut self) {
        let mut run = self.run.take().unwrap();
        run.proc.kill();
        self.lineage = Lineage::Crashed;
        self.note(format!("killed the whole process tree of {}", run.label));
    }

    /// `weir savepoint [--stop]`, bounded; the location or why it failed.
    fn savepoint(&mut self, stop: bool) -> Result<String, String> {
        let mut args = vec!["savepoint", "--state-dir", "state"];
        if stop {
            args.push("--stop");
        }
        let dir = self.job.path("runs");
        let (out_path, err_path) = (dir.join("savepoint.stdout"), dir.join("savepoint.stderr"));
        let mut c = self.job.weir(&args);
        c.stdout(std::fs::File::create(&out_path).unwrap()).stderr(std::fs::File::create(&err_path).unwrap()).process_group(0);
        let mut p = KillOnDrop::new(c.spawn().unwrap());
        let status = p.wait_for(Duration::from_secs(30));
        let out = std::fs::read_to_string(&out_path).unwrap_or_default();
        let err = std::fs::read_to_string(&err_path).unwrap_or_default();
        match status {
            Some(s) if s.success() => Ok(out.trim().to_string()),
            Some(s) => Err(format!("{s}: {}", err.trim())),
            None => Err(format!("still waiting after 30s: {}", err.trim())),
        }
    }

    fn take_savepoint(&mut self) -> Step {
        match self.savepoint(false) {
            Ok(path) => {
                if !Path::new(&path).join("_metadata").exists() {
                    return Err(violation("a savepoint reported complete is complete", format!("{path} has no _metadata")));
                }
                self.note(format!("savepoint {path}"));
            }
            // A savepoint of a job that is finishing or restarting may fail; the job must go on.
            Err(e) => self.note(format!("savepoint not taken: {e}")),
        }
        Ok(())
    }

    /// Disposes of one of the savepoints on disk, as a user of `weir run` would.
    fn dispose_savepoint(&mut self, pick: usize) -> Step {
        let savepoints = || list_snapshots(self.job).into_iter().filter(|s| s.complete && s.kind == "savepoint").collect::<Vec<Snapshot>>();
        // Two at least, so that one is not the latest snapshot.
        for _ in savepoints().len()..2 {
            self.take_savepoint()?;
            if !self.sleep_running(300)? {
                break;
            }
        }
        let savepoints = savepoints();
        if savepoints.is_empty() {
            self.note("no savepoint to dispose of");
            return Ok(());
        }
        let s = savepoints[pick % savepoints.len()].clone();
        let out = self.job.weir(&["savepoint", "--state-dir", "state", "--dispose", &s.location]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if out.status.success() {
            if s.is_latest {
                return Err(violation("the job's latest snapshot is never disposed of", format!("{} was: {err}", s.location)));
            }
            if Path::new(&s.location).exists() {
                return Err(violation("a disposed savepoint is gone", format!("{} is still there: {err}", s.location)));
            }
            self.note(format!("disposed of savepoint {}", s.location));
        } else {
            // Right refusals: the latest snapshot, a run without a checkpoint
            // yet (it may still commit what it restored), a job that ended.
            self.note(format!("savepoint {} not disposed of: {err}", s.location));
        }
        Ok(())
    }

    /// Stop-with-savepoint; true if the job stopped with one.
    fn stop_with_savepoint(&mut self) -> Result<bool, Stop> {
        let path = match self.savepoint(true) {
            Ok(p) => p,
            Err(e) => {
                self.note(format!("stop-with-savepoint not taken: {e}"));
                return Ok(false);
            }
        };
        self.note(format!("stopped with savepoint {path}"));
        let run = self.run.as_mut().unwrap();
        match run.proc.wait_for(Duration::from_secs(30)) {
            Some(s) if s.success() => {
                self.run = None;
                self.check_stopped(&path)?;
                self.lineage = Lineage::Stopped(path);
                Ok(true)
            }
            Some(s) => Err(violation(
                "after stop-with-savepoint the job exits 0 by itself",
                format!("exited with {s}; stderr:\n{}", tail(&run.stderr, 15)),
            )),
            None => Err(violation("after stop-with-savepoint the job exits 0 by itself", "still running 30 s after the savepoint completed")),
        }
    }

    /// A job stopped with a savepoint, and perhaps never resumed, has
    /// published everything it read up to the savepoint and left nothing
    /// open: each key's committed events are all of its first ones (none
    /// missing before the last, which a stop whose interval stayed pending
    /// would show as a tail missing from the savepoint's read position),
    /// and nothing is pending, prepared or open that only the stop
    /// savepoint references.
    fn check_stopped(&mut self, savepoint: &str) -> Step {
        let lines = self.output.committed(self.job.dir.path())?;
        let read = savepoint_read_positions(Path::new(savepoint));
        let forked = self.any_may_repeat || !self.may_repeat.is_empty();
        check_prefix_up_to(&lines, self.size, read.as_ref(), forked)?;
        let name = Path::new(savepoint).file_name().map(|n| n.to_string_lossy().into_owned());
        self.output.check_nothing_open(self.job.dir.path(), &self.job.path(JOB_DIR), name.as_deref())?;
        if self.shape.pairs {
            // A pair is published once both its events were read; the
            // savepoint's read positions mix both sources', so only the
            // prefix is checked.
            let pairs = output::committed_files(&self.job.path(PAIRS_DIR))?;
            check_prefix_up_to(&pairs, self.size, None, forked).map_err(|e| in_pairs(e, "after a stop"))?;
            let excused = referenced_in_progress_except(&self.job.path(JOB_DIR), name.as_deref());
            let left: BTreeSet<String> = in_progress_files(&self.job.path(PAIRS_DIR)).difference(&excused).cloned().collect();
            if !left.is_empty() {
                return Err(violation("a job stopped with a savepoint leaves no in-progress file pending", format!("{PAIRS_DIR}: {left:?}")));
            }
        }
        self.note("the stop published everything up to its savepoint and left nothing open");
        Ok(())
    }

    /// See [`Action::TwinJob`].
    fn twin_job(&mut self, kill_after_ms: u64) -> Step {
        let file = matches!(self.output, Output::File);
        if file && self.running()? {
            self.kill_tree();
        } else if !file {
            self.ensure_running()?;
        }
        let target = if file { Output::File } else { self.output.fresh() };
        self.twins += 1;
        let n = self.twins;
        let shape = Shape { pairs: false, ..self.shape };
        std::fs::write(self.job.path("twin.yaml"), pipeline_yaml(self.size, shape, self.parallelism, &target.sink_yaml())).unwrap();
        let err = self.job.path(&format!("runs/twin-{n}.stderr"));
        std::fs::create_dir_all(self.job.path("runs")).unwrap();
        let mut twin = KillOnDrop::new(
            std::process::Command::new(WEIR)
                .current_dir(self.job.dir.path())
                .args(["run", "twin.yaml", "--state-dir", "state-twin"])
                .env("RUST_LOG", "warn")
                .envs(target.env())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&err).unwrap())
                .process_group(0)
                .spawn()
                .unwrap(),
        );
        self.note(format!("twin job {n}: same name, state-twin, {} (twin-{n}.stderr)", target.describe()));
        std::thread::sleep(Duration::from_millis(kill_after_ms));
        let info = std::fs::read_to_string(self.job.path("state-twin/eo-test/run.json")).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok());
        if let Some(pid) = info.and_then(|v| v["worker_pids"][0].as_u64()).map(|p| p as u32) {
            if parent_of(pid) == Some(twin.pid()) {
                kill(pid);
                self.note(format!("killed worker pid {pid} of the twin job"));
            }
        }
        match twin.wait_for(RUN_LIMIT) {
            Some(st) if st.success() => {}
            st => {
                let how = st.map(|s| s.to_string()).unwrap_or_else(|| format!("still running after {RUN_LIMIT:?}"));
                return Err(violation("a second job of one name from another state directory runs to its end", format!("{how}; stderr:\n{}", tail(&err, 15))));
            }
        }
        let twin_dir = self.job.path("state-twin/eo-test");
        let lines = match &target {
            Output::File => {
                // The twin's files, by its runs; moved away afterwards, as
                // a user would keep the two outputs apart to read them.
                let runs = claimed_runs(&twin_dir);
                let theirs = |name: &str| name.strip_prefix("part-eo-test.").and_then(|r| r.split_once('-')).is_some_and(|(run, _)| runs.contains(run));
                let moved = self.job.path(&format!("out/twin-{n}"));
                std::fs::create_dir_all(&moved).unwrap();
                for e in std::fs::read_dir(self.out_dir()).unwrap().flatten() {
                    if theirs(&e.file_name().to_string_lossy()) {
                        std::fs::rename(e.path(), moved.join(e.file_name())).unwrap();
                    }
                }
                output::committed_files(&moved)?
            }
            _ => target.committed(self.job.dir.path())?,
        };
        let checked = check_output(&lines, self.size, Some(&HashSet::new())).and_then(|()| match &target {
            Output::File => Ok(()),
            _ => target.check_nothing_left(self.job.dir.path(), &twin_dir),
        });
        checked.map_err(|e| match e {
            Stop::Violation { invariant, detail } => violation(&format!("a second job of one name sharing the output or server: {invariant}"), detail),
            other => other,
        })?;
        self.note(format!("twin job {n} wrote every event once"));
        Ok(())
    }

    /// Stops the running job (stop-with-savepoint or a crash), applies a
    /// change, and starts it again from where it stopped.
    fn upgrade(&mut self, via_savepoint: bool, change: impl FnOnce(&mut Self) -> String) -> Step {
        if self.running()? {
            let stopped = via_savepoint && self.stop_supported && self.stop_with_savepoint()?;
            if !stopped && self.running()? {
                self.kill_tree();
            }
        }
        let what = change(self);
        self.note(what);
        self.start_lineage();
        Ok(())
    }

    /// Snapshots of the current lineage that the model may restore.
    fn restorable(&self) -> Vec<Snapshot> {
        list_snapshots(self.job)
            .into_iter()
            .filter(|s| s.complete && !self.abandoned.contains(&s.location) && !self.corrupted.contains(&s.location) && s.id > self.lineage_base)
            .collect()
    }

    /// Is restoring `s` a fork? Only the lineage's newest state is not: the
    /// snapshot the lineage names as latest, or the savepoint the job was stopped with.
    /// Anything else counts as a fork, which only makes the oracle lenient.
    fn is_fork(&self, s: &Snapshot) -> bool {
        let stopped_with = matches!(&self.lineage, Lineage::Stopped(sp) if *sp == s.location);
        !(s.is_latest || stopped_with)
    }

    fn restore(&mut self, pick: usize, parallelism: u32) -> Step {
        self.finish()?;
        let candidates = self.restorable();
        if candidates.is_empty() {
            self.note("nothing to restore yet");
            return Ok(());
        }
        let s = candidates[pick % candidates.len()].clone();
        if self.is_fork(&s) {
            if self.shape.pairs {
                self.may_repeat_pairs.extend(output::committed_files(&self.job.path(PAIRS_DIR))?.iter().filter_map(|(_, v)| v["seq"].as_i64()));
            }
            match self.output.may_repeat_after_fork(self.job.dir.path())? {
                Some(before) => {
                    self.note(format!("fork: restoring {} {} (older than the lineage's newest state; {} events committed may repeat)", s.kind, s.id, before.len()));
                    self.may_repeat.extend(before);
                }
                None => {
                    self.note(format!("fork: restoring {} {} (older than the lineage's newest state; any event may repeat)", s.kind, s.id));
                    self.any_may_repeat = true;
                }
            }
        }
        self.parallelism = parallelism;
        self.start(Some(&s.location), &format!("restore-{}-{}", s.kind, s.id));
        Ok(())
    }

    /// Runs the finished job again on a fresh output directory: a new lineage.
    fn re_run(&mut self, kill_worker: bool) -> Step {
        self.finish()?;
        if self.lineage != Lineage::Finished {
            self.start_lineage();
            self.finish()?;
        }
        self.note(format!("re-run: the job finished; checking its output, deleting it ({}), running again without --restore", self.output.describe()));
        self.check_lineage_output()?;
        for s in list_snapshots(self.job) {
            self.lineage_base = self.lineage_base.max(s.id);
            self.abandoned.insert(s.location);
        }
        match self.output {
            Output::File => std::fs::remove_dir_all(self.out_dir()).unwrap(),
            _ => self.output = self.output.fresh(),
        }
        let _ = std::fs::remove_dir_all(self.job.path(PAIRS_DIR));
        self.may_repeat_pairs.clear();
        self.may_repeat.clear();
        self.any_may_repeat = false;
        self.lineage = Lineage::NotStarted;
        self.start(None, "re-run");
        if kill_worker {
            // Before the new run's first checkpoint, if the machine allows.
            self.kill_worker(false, 0)?;
        }
        Ok(())
    }

    fn second_run(&mut self) -> Step {
        let Some((_, run_id)) = self.live_workers(Duration::from_secs(5))? else {
            self.note("no second run: the job ended first");
            return Ok(());
        };
        let supervisor = self.run.as_ref().unwrap().proc.pid();
        // The same command again, as a user who forgot the first one would type it.
        let (mut second, err) = self.spawn_run(None, "second-run");
        let t0 = Instant::now();
        let ended = second.wait_for(Duration::from_secs(1));
        let first_alive = self.running()?;
        let ended = ended.or_else(|| if first_alive { second.wait_for(Duration::from_secs(2)) } else { None });
        let text = std::fs::read_to_string(&err).unwrap_or_default();
        match ended {
            Some(s) if !s.success() => {
                let named = text.contains("already running") || text.contains(&supervisor.to_string()) || text.contains(&run_id);
                if !named {
                    return Err(violation("a second run of a running job is refused naming the running one", format!("refused ({s}) without naming it:\n{text}")));
                }
                self.note(format!("second run refused after {} ms", t0.elapsed().as_millis()));
                Ok(())
            }
            _ if !first_alive => {
                second.kill();
                Err(Stop::Inconclusive("the first run ended while the second started".into()))
            }
            Some(s) => Err(violation("a second run of a running job is refused at once", format!("it ran to the end ({s}) beside the first; stderr:\n{}", tail(&err, 10)))),
            None => {
                second.kill();
                Err(violation(
                    "a second run of a running job is refused at once",
                    format!("still running 3 s after it started beside the running one; stderr:\n{}", tail(&err, 10)),
                ))
            }
        }
    }

    /// Digest of everything a failed restore must leave alone: every snapshot
    /// directory and the output.
    fn untouchable(&self) -> BTreeMap<PathBuf, (u64, u64)> {
        let mut d = tree_digest(&self.job.path(&format!("{JOB_DIR}/checkpoints")));
        d.extend(tree_digest(&self.job.path(&format!("{JOB_DIR}/savepoints"))));
        d.extend(tree_digest(&self.out_dir()));
        d
    }

    fn corrupt(&mut self, pick: usize, file_pick: usize, offset_pick: u64) -> Step {
        self.finish()?;
        // Not the snapshot the job resumes from next: the lineage must go on.
        let candidates: Vec<Snapshot> = self
            .restorable()
            .into_iter()
            .filter(|s| !s.is_latest && !matches!(&self.lineage, Lineage::Stopped(sp) if *sp == s.location))
            .filter(|s| !arrow_files(Path::new(&s.location)).is_empty())
            .collect();
        if candidates.is_empty() {
            self.note("no snapshot to damage");
            return Ok(());
        }
        let s = candidates[pick % candidates.len()].clone();
        let files = arrow_files(Path::new(&s.location));
        let file = &files[file_pick % files.len()];
        let mut bytes = std::fs::read(file).unwrap();
        let at = (offset_pick % bytes.len() as u64) as usize;
        for b in bytes.iter_mut().skip(at).take(4) {
            *b ^= 0xff;
        }
        std::fs::write(file, &bytes).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        self.note(format!("damaged {name} of {} {} at byte {at}", s.kind, s.id));
        self.corrupted.insert(s.location.clone());
        let before = self.untouchable();
        let (mut p, err) = self.spawn_run(Some(&s.location), "damaged");
        let status = p.wait_for(Duration::from_secs(60));
        drop(p);
        let text = std::fs::read_to_string(&err).unwrap_or_default();
        let invariant = "restoring a damaged snapshot fails at once (exit 3: not worth a restart; no restarts) naming the file";
        match status {
            None => return Err(violation(invariant, format!("still running after 60 s; stderr:\n{}", tail(&err, 15)))),
            Some(st) if st.code() != Some(3) || text.contains("restarting") => {
                return Err(violation(invariant, format!("{st}; stderr:\n{}", tail(&err, 15))));
            }
            Some(_) if !text.contains(&name) => return Err(violation(invariant, format!("the error does not name {name}:\n{}", tail(&err, 15)))),
            Some(_) => {}
        }
        let after = self.untouchable();
        if before != after {
            let changed: Vec<String> = before
                .keys()
                .chain(after.keys())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .filter(|k| before.get(*k) != after.get(*k))
                .map(|k| format!("{} {}", if !after.contains_key(k) { "deleted" } else if !before.contains_key(k) { "created" } else { "changed" }, k.display()))
                .take(10)
                .collect();
            return Err(violation("a failed restore changes no snapshot, no pointer and no output", changed.join("\n")));
        }
        self.note("the damaged snapshot was refused and nothing changed");
        Ok(())
    }

    fn check_lineage_output(&mut self) -> Step {
        let lines = self.output.committed(self.job.dir.path())?;
        check_output(&lines, self.size, (!self.any_may_repeat).then_some(&self.may_repeat))?;
        self.output.check_nothing_left(self.job.dir.path(), &self.job.path(JOB_DIR))?;
        if self.shape.pairs {
            check_pairs(&self.job.path(PAIRS_DIR), &self.job.path(JOB_DIR), self.size, Some(&self.may_repeat_pairs), &BTreeSet::new())?;
        }
        Ok(())
    }

    fn act(&mut self, a: &Action) -> Step {
        match a.clone() {
            Action::Start => {
                if self.running()? {
                    self.note("letting the job run to its end");
                    self.finish()
                } else {
                    self.start_lineage();
                    Ok(())
                }
            }
            Action::ReRun { kill_worker } => self.re_run(kill_worker),
            Action::KillWorker { after_ms, during_checkpoint, victim } => {
                self.ensure_running()?;
                if !self.sleep_running(after_ms)? {
                    self.note("the job ended before the kill");
                    return Ok(());
                }
                self.kill_worker(during_checkpoint, victim)
            }
            Action::KillTree { after_ms } => {
                self.ensure_running()?;
                if !self.sleep_running(after_ms)? {
                    self.note("the job ended before the kill");
                    return Ok(());
                }
                self.kill_tree();
                Ok(())
            }
            Action::Savepoint { after_ms } => {
                self.ensure_running()?;
                if self.sleep_running(after_ms)? {
                    self.take_savepoint()?;
                }
                Ok(())
            }
            Action::StopWithSavepoint { after_ms } => {
                if !self.stop_supported {
                    self.note("skipped: this weir has no `savepoint --stop`");
                    return Ok(());
                }
                self.ensure_running()?;
                if self.sleep_running(after_ms)? {
                    self.stop_with_savepoint()?;
                }
                Ok(())
            }
            Action::Restore { pick, parallelism } => self.restore(pick, parallelism),
            Action::Rescale { parallelism, via_savepoint } => self.upgrade(via_savepoint, |m| {
                m.parallelism = parallelism;
                format!("rescale to parallelism {parallelism}")
            }),
            Action::ChangePipeline { shape, via_savepoint } => self.upgrade(via_savepoint, |m| {
                m.shape = Shape { pairs: m.shape.pairs, ..shape };
                format!("change the pipeline: filter {}, checkpoint interval {} ms, {:?}, incremental {}", shape.filter, shape.interval_ms, shape.mode, shape.incremental)
            }),
            Action::SecondRun { after_ms } => {
                self.ensure_running()?;
                if self.sleep_running(after_ms)? {
                    self.second_run()?;
                }
                Ok(())
            }
            Action::DisposeSavepoint { after_ms, pick } => {
                self.ensure_running()?;
                if self.sleep_running(after_ms)? {
                    self.dispose_savepoint(pick)?;
                }
                Ok(())
            }
            Action::Corrupt { pick, file_pick, offset_pick } => self.corrupt(pick, file_pick, offset_pick),
            Action::SavepointThenCrash { after_ms } => {
                self.ensure_running()?;
                if self.sleep_running(after_ms)? {
                    self.take_savepoint()?;
                    if self.running()? {
                        self.kill_tree();
                    }
                }
                Ok(())
            }
            Action::TwinJob { kill_after_ms } => self.twin_job(kill_after_ms),
            Action::SlowStore { ahead, delay_ms, via_savepoint } => self.upgrade(via_savepoint, |m| {
                let newest = list_snapshots(m.job).iter().map(|s| s.id).max().unwrap_or(0);
                m.slow_store = Some((newest + ahead, delay_ms));
                m.shape.incremental = true;
                format!("slow store: checkpoint {}'s shared files take {delay_ms} ms to write, the checkpoint timeout is {} ms; incremental checkpoints", newest + ahead, delay_ms / 2)
            }),
            Action::FailingStore { ahead, object, via_savepoint } => self.upgrade(via_savepoint, |m| {
                let id = list_snapshots(m.job).iter().map(|s| s.id).max().unwrap_or(0) + ahead;
                let pattern = object.pattern(id);
                let once = m.job.path(&format!("failing-put-{}.once", m.runs_started));
                if matches!(object, FailedPut::SharedFile) {
                    m.shape.incremental = true;
                }
                m.failing_put = Some((pattern.clone(), once));
                format!("failing store: the first write of an object whose path contains {pattern:?} fails ({object:?}, checkpoint {id}); incremental {}", m.shape.incremental)
            }),
        }
    }

    /// The final run: the job resumes as its state says (`--restore latest`
    /// after a crash or a finished run, the stop savepoint after a stop) and
    /// runs to its end.
    fn run_to_end(&mut self) -> Step {
        self.finish()?;
        self.start_lineage();
        self.finish()
    }

    /// Every complete snapshot of the lineage restores: each is restored in a
    /// copy of the job directory (state and output), at a random parallelism,
    /// runs to its end, and the copy's output passes the oracle (any event may
    /// repeat: the job had finished, so every restore is a fork). A topic or
    /// table cannot be copied: the copy writes to a new one, which must then
    /// hold what the restore alone writes ([`output::check_restored_suffix`]).
    fn check_every_snapshot_restores(&mut self, rng: &mut StdRng) -> Step {
        let snapshots = self.restorable();
        self.note(format!("restoring each of {} retained snapshots in a copy", snapshots.len()));
        let fast = Size { rate: 0, ..self.size };
        for s in snapshots {
            let copy = tempfile::tempdir().unwrap();
            copy_tree(&self.job.path("state"), &copy.path().join("state"));
            let target = match self.output {
                Output::File => {
                    copy_tree(&self.out_dir(), &copy.path().join("out/eo"));
                    Output::File
                }
                _ => self.output.fresh(),
            };
            if self.shape.pairs {
                copy_tree(&self.job.path(PAIRS_DIR), &copy.path().join(PAIRS_DIR));
            }
            let pairs_left_before = in_progress_files(&copy.path().join(PAIRS_DIR));
            let _ = std::fs::remove_file(copy.path().join(JOB_DIR).join("run.json"));
            let root = std::fs::canonicalize(self.job.dir.path()).unwrap();
            let rel = Path::new(&s.location).strip_prefix(&root).or_else(|_| Path::new(&s.location).strip_prefix(self.job.dir.path())).unwrap();
            let location = copy.path().join(rel);
            let parallelism: u32 = rng.random_range(1..=4);
            std::fs::write(copy.path().join("pipeline.yaml"), pipeline_yaml(fast, self.shape, parallelism, &target.sink_yaml())).unwrap();
            let left_before = in_progress_files(&copy.path().join("out/eo"));
            let err = copy.path().join("restore.stderr");
            let mut p = KillOnDrop::new(
                std::process::Command::new(WEIR)
                    .current_dir(copy.path())
                    .args(["run", "pipeline.yaml", "--state-dir", "state", "--restore"])
                    .arg(&location)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&err).unwrap())
                    .env("RUST_LOG", "warn")
                    .envs(target.env())
                    .process_group(0)
                    .spawn()
                    .unwrap(),
            );
            let what = format!("{} {} ({}) at parallelism {parallelism}, {}", s.kind, s.id, s.location, target.describe());
            match p.wait_for(RUN_LIMIT) {
                Some(st) if st.success() => {}
                st => {
                    let how = st.map(|s| s.to_string()).unwrap_or_else(|| format!("still running after {RUN_LIMIT:?}"));
                    drop(p);
                    let kept = copy.keep();
                    return Err(violation(
                        "every retained checkpoint and savepoint restores",
                        format!("{what}: {how}; copy kept in {}; stderr:\n{}", kept.display(), tail(&kept.join("restore.stderr"), 15)),
                    ));
                }
            }
            let lines = target.committed(copy.path())?;
            let checked = match target {
                Output::File => check_output(&lines, self.size, None),
                _ => output::check_restored_suffix(&lines, self.size).and_then(|()| target.check_nothing_left(copy.path(), &copy.path().join(JOB_DIR))),
            };
            checked.map_err(|e| match e {
                Stop::Violation { invariant, detail } => violation(&format!("restoring a retained snapshot gives correct output: {invariant}"), format!("{what}: {detail}")),
                other => other,
            })?;
            if self.shape.pairs {
                check_pairs(&copy.path().join(PAIRS_DIR), &copy.path().join(JOB_DIR), self.size, None, &pairs_left_before)
                    .map_err(|e| in_pairs(e, &format!("restoring a retained snapshot, {what}")))?;
            }
            if let Output::File = target {
                let referenced = referenced_in_progress(&copy.path().join(JOB_DIR));
                let new_left: Vec<String> =
                    in_progress_files(&copy.path().join("out/eo")).difference(&left_before).filter(|f| !referenced.contains(*f)).cloned().collect();
                if !new_left.is_empty() {
                    return Err(violation("no in-progress file is left once the job finished", format!("after restoring {what}: {new_left:?}")));
                }
            }
            self.note(format!("{what} restores"));
        }
        Ok(())
    }
}

/// The run ids that claimed a job's state (`<job dir>/lineage/*/claim`):
/// its output files carry them.
fn claimed_runs(job_dir: &Path) -> HashSet<String> {
    std::fs::read_dir(job_dir.join("lineage"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("claim")).ok())
        .filter_map(|text| serde_json::from_str::<Value>(&text).ok()?["run_id"].as_str().map(String::from))
        .collect()
}

/// The parent pid of a process, from /proc: a pid in `run.json` is killed
/// only while it is a child of our `weir run` (never a reused pid).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name in parentheses: state, then the parent pid.
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?}: expected a number")))
}

/// One sequence: draw a plan, run it, run the job to its end, check the output
/// and every snapshot. Returns the history on failure. With `connectors`
/// (the test's PostgreSQL server) the sink is drawn among the connector
/// sinks, else it is the file sink.
fn run_sequence(seed: u64, stop_supported: bool, connectors: Option<&postgres::Server>) -> Result<(), (Stop, Vec<String>, PathBuf)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let keys = MAX_PARALLELISM as u64 * rng.random_range(2..=3);
    // 2.5 to 5 s of events: long enough for kills and savepoints to land mid-run.
    let size = Size { events: rng.random_range(20_000..=40_000), keys, rate: 8_000 };
    let shape = Shape { filter: rng.random_bool(0.3), interval_ms: [100, 150, 200, 300][rng.random_range(0..4)], mode: Mode::draw(&mut rng), incremental: rng.random_bool(0.5), graph: rng.random_bool(0.5), pairs: false };
    let parallelism = rng.random_range(1..=4);
    let plan = draw_plan(&mut rng);
    if let Ok(focus) = std::env::var("WEIR_LIFECYCLE_FOCUS") {
        if !plan.iter().any(|a| format!("{a:?}").starts_with(&focus)) {
            return Err((Stop::Inconclusive(format!("skipped: the plan has no {focus} (WEIR_LIFECYCLE_FOCUS)")), Vec::new(), PathBuf::new()));
        }
    }
    let kind = if connectors.is_some() { SinkKind::connector(rng.random_range(0..3)) } else { SinkKind::File };
    let output = Output::new(kind, connectors);
    // A join and a second sink (file sink sequences only: the oracle of a
    // connector sink reads one target).
    let shape = Shape { pairs: connectors.is_none() && rng.random_bool(0.5), ..shape };
    println!("  {} events, {} keys, parallelism {parallelism}, {shape:?}, {}; plan:", size.events, size.keys, output.describe());
    for (i, a) in plan.iter().enumerate() {
        println!("    {}. {a:?}", i + 1);
    }
    let job = Job::with_pipeline(&pipeline_yaml(size, shape, parallelism, &output.sink_yaml()), size.events, size.keys);
    let mut m = Model {
        job: &job,
        output,
        size,
        shape,
        parallelism,
        stop_supported,
        run: None,
        lineage: Lineage::NotStarted,
        lineage_base: 0,
        abandoned: HashSet::new(),
        corrupted: HashSet::new(),
        may_repeat: HashSet::new(),
        may_repeat_pairs: HashSet::new(),
        any_may_repeat: false,
        runs_started: 0,
        started: Instant::now(),
        history: Vec::new(),
        slow_store: None,
        twins: 0,
        failing_put: None,
    };
    let result = (|| {
        for (i, a) in plan.iter().enumerate() {
            m.note(format!("action {}: {a:?}", i + 1));
            m.act(a)?;
        }
        m.note("final run to the end");
        m.run_to_end()?;
        if let Some((pattern, once)) = m.failing_put.clone() {
            let fired = if once.exists() { "failed as injected" } else { "never came" };
            m.note(format!("the write of {pattern:?} {fired}"));
        }
        m.check_lineage_output()?;
        m.note("output ok");
        m.check_every_snapshot_restores(&mut rng)
    })();
    let history = std::mem::take(&mut m.history);
    drop(m); // kills whatever still runs
    // Sequences share the server and the job's name: what this one's
    // retained savepoints keep prepared goes with it, as when a user
    // disposes of a job, so that the next sequence starts clean.
    if let Some(server) = connectors {
        for gid in server.prepared() {
            server.psql(&format!("ROLLBACK PREPARED '{gid}'"));
        }
    }
    match result {
        Ok(()) => Ok(()),
        Err(stop) => {
            let kept = if matches!(stop, Stop::Violation { .. }) { job.dir.keep() } else { job.dir.path().to_path_buf() };
            Err((stop, history, kept))
        }
    }
}

#[test]
fn a_failure_free_run_commits_exactly_the_records_the_oracle_expects() {
    // The claim the lifecycle oracle stands on: with keys a multiple of
    // max_parallelism, count = seq / keys + 1 for every record, at any
    // parallelism, with or without the filter step.
    // With `pairs`, the joined pairs' counts are the same records.
    for (parallelism, filter, keys, pairs) in [(3, false, 16, false), (2, true, 24, false), (4, false, 24, false), (3, true, 16, true), (1, false, 24, true)] {
        let size = Size { events: 20_000, keys, rate: 0 };
        let shape = Shape { filter, interval_ms: 100, mode: Mode::Aligned, incremental: false, graph: false, pairs };
        let job = Job::with_pipeline(&pipeline_yaml(size, shape, parallelism, &Output::File.sink_yaml()), size.events, keys);
        let out = job.run(&[]);
        assert!(out.status.success(), "{}", stderr(&out));
        let lines = output::committed_files(&job.path("out/eo")).unwrap_or_else(|e| panic!("{e:?}"));
        if let Err(e) = check_output(&lines, size, Some(&HashSet::new())) {
            panic!("parallelism {parallelism}, filter {filter}, keys {keys}: {e:?}");
        }
        if pairs {
            let lines = output::committed_files(&job.path(PAIRS_DIR)).unwrap_or_else(|e| panic!("{e:?}"));
            if let Err(e) = check_output(&lines, size, Some(&HashSet::new())) {
                panic!("pairs, parallelism {parallelism}, filter {filter}, keys {keys}: {e:?}");
            }
        }
    }
}

#[test]
fn random_lifecycles_keep_exactly_once_and_every_snapshot_restorable() {
    run_sequences(REPRODUCE, 3, None);
}

/// The same lifecycles with the connector sinks: the exactly-once Kafka
/// sink and the PostgreSQL sink in `two-phase-commit` and
/// `write-ahead-log` mode, drawn per sequence. Their recovery paths
/// (fencing, progress markers, prepared transactions, acknowledgements)
/// meet re-runs, forks, rescales and savepoints here.
#[test]
fn random_lifecycles_with_connector_sinks_keep_exactly_once_and_every_snapshot_restorable() {
    let pg = postgres::Server::start();
    run_sequences(REPRODUCE_CONNECTORS, 2, Some(&pg));
}

/// Runs `WEIR_LIFECYCLE_SEQUENCES` sequences (default `default_sequences`)
/// from `WEIR_LIFECYCLE_SEED` (default random), printing how to reproduce
/// each with `reproduce`, and fails naming every failed seed.
fn run_sequences(reproduce: &str, default_sequences: u64, connectors: Option<&postgres::Server>) {
    let seed = env_u64("WEIR_LIFECYCLE_SEED").unwrap_or_else(|| rand::random::<u32>() as u64);
    let sequences = env_u64("WEIR_LIFECYCLE_SEQUENCES").unwrap_or(default_sequences);
    println!("seed {seed}; reproduce with: WEIR_LIFECYCLE_SEED={seed} {reproduce}");
    let help = std::process::Command::new(WEIR).args(["savepoint", "--help"]).output().unwrap();
    let stop_supported = String::from_utf8_lossy(&help.stdout).contains("--stop");
    if !stop_supported {
        println!("this weir has no `savepoint --stop`: stop-with-savepoint actions are skipped");
    }
    let mut failures = Vec::new();
    let started = Instant::now();
    for k in 0..sequences {
        let s = seed.wrapping_add(k);
        println!("sequence {}/{sequences}: seed {s} (alone: WEIR_LIFECYCLE_SEED={s} WEIR_LIFECYCLE_SEQUENCES=1 {reproduce})", k + 1);
        let t0 = Instant::now();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| run_sequence(s, stop_supported, connectors)));
        let took = t0.elapsed().as_secs_f64();
        match outcome {
            Ok(Ok(())) => println!("sequence seed {s}: ok in {took:.1}s"),
            Ok(Err((Stop::Inconclusive(why), _, _))) => println!("sequence seed {s}: inconclusive after {took:.1}s ({why})"),
            Ok(Err((Stop::Violation { invariant, detail }, history, dir))) => {
                let report = format!(
                    "FAILED sequence seed {s} (reproduce: WEIR_LIFECYCLE_SEED={s} WEIR_LIFECYCLE_SEQUENCES=1 {reproduce})\n  invariant: {invariant}\n  {}\n  job directory kept: {}\n  what happened:\n    {}",
                    detail.replace('\n', "\n  "),
                    dir.display(),
                    history.join("\n    ")
                );
                println!("{report}");
                failures.push(format!("seed {s}: {invariant}"));
            }
            Err(panic) => {
                let msg = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                println!("FAILED sequence seed {s}: the harness panicked: {msg}");
                failures.push(format!("seed {s}: harness panic: {msg}"));
            }
        }
    }
    println!("{sequences} sequences in {:.1}s, {} failed", started.elapsed().as_secs_f64(), failures.len());
    assert!(
        failures.is_empty(),
        "seed {seed}; reproduce with: WEIR_LIFECYCLE_SEED={seed} {reproduce}\n{} of {sequences} sequences failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
