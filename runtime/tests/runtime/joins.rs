//! Joins of two streams (runtime/design/graphs.md §4) under worker kills,
//! whole-tree kills with a rescaled restore, and unaligned checkpoints.
//! The committed output is checked against the join's definition computed
//! over the input files the test wrote (a nested loop; windows assigned by
//! brute force), never against another weir run: every expected pair
//! exactly once, nothing else.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::*;
use crate::unaligned::kill_once_the_latest_checkpoint_holds;

/// An order: (seq, id, ts). A payment: (pseq, order, ts).
type Row = (i64, i64, i64);

/// Orders and the payments of some of them, as a shop's two topics would
/// hold them: an order every 2 ms on one of `ids` ids (so an id comes back
/// far outside any interval), paid zero to two times around its time, each
/// input written out of order by up to 50 ms over `files` files.
struct Inputs {
    orders: Vec<Row>,
    payments: Vec<Row>,
}

impl Inputs {
    fn new(seed: u64, orders: i64, ids: i64) -> Inputs {
        let mut rng = StdRng::seed_from_u64(seed);
        let orders: Vec<Row> = (0..orders).map(|seq| (seq, seq % ids, 1_000_000 + seq * 2 + rng.random_range(0..20))).collect();
        let mut payments = Vec::new();
        for &(_, id, ts) in &orders {
            for _ in 0..rng.random_range(0..3) {
                payments.push((payments.len() as i64, id, ts + rng.random_range(-30..60)));
            }
        }
        Inputs { orders, payments }
    }

    /// Writes each input as JSON lines in `files` files of consecutive
    /// time ranges (a subtask of the file source reads its files one after
    /// the other, in name order), each file out of order by up to 50 ms.
    fn write(&self, job: &Job, files: usize) {
        let mut rng = StdRng::seed_from_u64(7);
        for (dir, rows, fields) in [("in/orders", &self.orders, ["seq", "id", "ts"]), ("in/payments", &self.payments, ["pseq", "order", "ts"])] {
            std::fs::create_dir_all(job.path(dir)).unwrap();
            let mut by_time: Vec<&Row> = rows.iter().collect();
            by_time.sort_by_key(|r| r.2);
            for (k, part) in by_time.chunks(by_time.len().div_ceil(files)).enumerate() {
                let mut lines: Vec<(i64, String)> = part
                    .iter()
                    .map(|r| (r.2 - rng.random_range(0..=50), format!("{{\"{}\": {}, \"{}\": {}, \"{}\": {}}}", fields[0], r.0, fields[1], r.1, fields[2], r.2)))
                    .collect();
                lines.sort();
                let text: String = lines.into_iter().map(|(_, l)| l + "\n").collect();
                std::fs::write(job.path(&format!("{dir}/part-{k}.jsonl")), text).unwrap();
            }
        }
    }

    /// The interval join by its definition: every (order, payment) of one
    /// id with `payment.ts ∈ [order.ts + lower, order.ts + upper]`, and
    /// with `left_outer` every order without one (payment `None`).
    fn nested_loop(&self, lower: i64, upper: i64, left_outer: bool) -> BTreeMap<(i64, Option<i64>), u32> {
        let mut by_id: HashMap<i64, Vec<&Row>> = HashMap::new();
        for p in &self.payments {
            by_id.entry(p.1).or_default().push(p);
        }
        let mut out = BTreeMap::new();
        for o in &self.orders {
            let mut found = false;
            for p in by_id.get(&o.1).into_iter().flatten() {
                if p.2 >= o.2 + lower && p.2 <= o.2 + upper {
                    *out.entry((o.0, Some(p.0))).or_insert(0) += 1;
                    found = true;
                }
            }
            if left_outer && !found {
                *out.entry((o.0, None)).or_insert(0) += 1;
            }
        }
        out
    }
}

/// The window join by its definition: each record of either input assigned
/// its tumbling window of `size` ms, or its session of `gap` ms merged over
/// the times of both inputs of its id (sessions that only touch stay
/// apart); per id and window every order paired with every payment.
fn window_pairs(inputs: &Inputs, size: Option<i64>, gap: Option<i64>) -> BTreeMap<(i64, i64, i64, i64), u32> {
    // (id, time, order seq or none, payment seq or none)
    let mut all: Vec<(i64, i64, Option<i64>, Option<i64>)> = inputs.orders.iter().map(|o| (o.1, o.2, Some(o.0), None)).collect();
    all.extend(inputs.payments.iter().map(|p| (p.1, p.2, None, Some(p.0))));
    all.sort();
    let mut windows: BTreeMap<(i64, i64, i64), (Vec<i64>, Vec<i64>)> = BTreeMap::new();
    let mut session: Option<(i64, i64, i64)> = None;
    let mut members: Vec<(Option<i64>, Option<i64>)> = Vec::new();
    let close = |s: (i64, i64, i64), members: &mut Vec<(Option<i64>, Option<i64>)>, windows: &mut BTreeMap<_, (Vec<i64>, Vec<i64>)>| {
        let w = windows.entry(s).or_default();
        for (o, p) in members.drain(..) {
            w.0.extend(o);
            w.1.extend(p);
        }
    };
    for (id, t, o, p) in all {
        match (size, gap) {
            (Some(size), _) => {
                let start = t.div_euclid(size) * size;
                let w = windows.entry((id, start, start + size)).or_default();
                w.0.extend(o);
                w.1.extend(p);
            }
            (None, Some(gap)) => {
                match session {
                    Some((sid, start, end)) if sid == id && t < end => session = Some((id, start, end.max(t + gap))),
                    _ => {
                        if let Some(s) = session {
                            close(s, &mut members, &mut windows);
                        }
                        session = Some((id, t, t + gap));
                    }
                }
                members.push((o, p));
            }
            _ => unreachable!(),
        }
    }
    if let Some(s) = session {
        close(s, &mut members, &mut windows);
    }
    let mut out = BTreeMap::new();
    for ((_, start, end), (orders, payments)) in windows {
        for o in &orders {
            for p in &payments {
                *out.entry((*o, *p, start, end)).or_insert(0) += 1;
            }
        }
    }
    out
}

/// Checks a window join's committed output against `expected`: every
/// (order, payment, window) once, nothing else.
fn assert_window_output(job: &Job, expected: &BTreeMap<(i64, i64, i64, i64), u32>) {
    let mut got: BTreeMap<(i64, i64, i64, i64), u32> = BTreeMap::new();
    for l in job.committed_lines() {
        let field = |f: &str| l[f].as_i64().unwrap_or_else(|| panic!("no {f} in {l}"));
        *got.entry((field("seq"), field("pseq"), field("window_start"), field("window_end"))).or_insert(0) += 1;
    }
    let twice: Vec<_> = got.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(twice.is_empty(), "pairs committed more than once (pair, times): {twice:?}");
    let missing: Vec<_> = expected.keys().filter(|k| !got.contains_key(k)).take(5).collect();
    let extra: Vec<_> = got.keys().filter(|k| !expected.contains_key(k)).take(5).collect();
    assert!(missing.is_empty() && extra.is_empty(), "{} pairs expected, {} committed; missing {missing:?}, extra {extra:?}", expected.len(), got.len());
}

/// The job: both inputs with event time (out of order by at most 100 ms),
/// joined into `matched` and written exactly once to `out/eo`. The join's
/// stage (2) is slowed by `slow` per batch so that the job outlives its kills.
fn interval_join_job(parallelism: u32, inputs: &Inputs, join: &str, checkpoint: &str, slow: &str) -> Job {
    join_job(parallelism, inputs, &format!("interval_join: {join}"), checkpoint, slow)
}

/// As [`interval_join_job`], with any join step (`kind: {settings}`).
fn join_job(parallelism: u32, inputs: &Inputs, join: &str, checkpoint: &str, slow: &str) -> Job {
    let source = |dir: &str, schema: &str| {
        format!("    file: {{path: {dir}, schema: {{{schema}}}, batch_size: 100}}\n    event_time: {{field: ts, max_out_of_orderness: 100ms}}\n")
    };
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 150ms\n{checkpoint}\
         sources:\n  orders:\n{}  payments:\n{}\
         steps:\n  - {{name: matched, input: [orders, payments], {join}}}\n\
         sinks:\n  out:\n    input: matched\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n",
        source("in/orders", "seq: int64, id: int64, ts: int64"),
        source("in/payments", "pseq: int64, order: int64, ts: int64"),
    );
    let mut job = Job::with_pipeline(&yaml, 0, 0);
    inputs.write(&job, 4);
    job.env.push(("WEIR_SLOW_STAGE".into(), format!("2:{slow}")));
    job
}

/// Checks the committed output against `expected`: each line's fields are
/// the order's and the payment's (the payment's `ts` renamed), and every
/// expected pair is there once, nothing else.
fn assert_output(job: &Job, inputs: &Inputs, expected: &BTreeMap<(i64, Option<i64>), u32>) {
    let mut got: BTreeMap<(i64, Option<i64>), u32> = BTreeMap::new();
    for l in job.committed_lines() {
        let seq = l["seq"].as_i64().unwrap_or_else(|| panic!("no seq in {l}"));
        let order = inputs.orders[seq as usize];
        assert_eq!((l["id"].as_i64(), l["ts"].as_i64()), (Some(order.1), Some(order.2)), "{l}");
        let pseq = l["pseq"].as_i64();
        if let Some(p) = pseq {
            let payment = inputs.payments[p as usize];
            assert_eq!((l["order"].as_i64(), l["payments_ts"].as_i64()), (Some(payment.1), Some(payment.2)), "{l}");
        } else {
            assert!(l["order"].is_null() && l["payments_ts"].is_null(), "an unmatched order has null payment fields: {l}");
        }
        *got.entry((seq, pseq)).or_insert(0) += 1;
    }
    let twice: Vec<_> = got.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(twice.is_empty(), "pairs committed more than once (pair, times): {twice:?}");
    let missing: Vec<_> = expected.keys().filter(|k| !got.contains_key(k)).take(5).collect();
    let extra: Vec<_> = got.keys().filter(|k| !expected.contains_key(k)).take(5).collect();
    assert!(missing.is_empty() && extra.is_empty(), "{} pairs expected, {} committed; missing {missing:?}, extra {extra:?}", expected.len(), got.len());
}

#[test]
fn an_interval_join_outputs_every_pair_once_under_worker_kills() {
    let inputs = Inputs::new(1, 24_000, 500);
    let (lower, upper) = (-10, 40);
    let job = interval_join_job(2, &inputs, "{on: id, right_on: order, between: {lower: -10ms, upper: 40ms}}", "", "15ms");
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    let expected = inputs.nested_loop(lower, upper, false);
    assert!(expected.len() > 10_000, "the input pairs too little to prove anything: {}", expected.len());
    assert_output(&job, &inputs, &expected);
}

#[test]
fn a_left_outer_interval_join_restores_after_whole_tree_kills_at_another_parallelism() {
    let inputs = Inputs::new(2, 24_000, 500);
    let job = interval_join_job(2, &inputs, "{on: id, right_on: order, between: {lower: 0s, upper: 30ms}, type: left_outer}", "", "20ms");
    kill_trees_then_restore_latest(&job, 500..1000, Some("3"));
    let expected = inputs.nested_loop(0, 30, true);
    assert!(expected.keys().filter(|(_, p)| p.is_none()).count() > 1000, "too few orders unmatched to prove the outer part");
    assert_output(&job, &inputs, &expected);
}

#[test]
fn an_interval_join_under_unaligned_checkpoints_keeps_both_inputs_records_in_flight_and_restores_them_at_another_parallelism() {
    let inputs = Inputs::new(3, 24_000, 500);
    let job = interval_join_job(3, &inputs, "{on: id, right_on: order, between: {lower: -20ms, upper: 20ms}, type: left_outer}", "  mode: unaligned\n", "10ms");
    kill_once_the_latest_checkpoint_holds(&job, &[], "3", &["in-flight-2-", "in-flight-2.1-", "matched.left-", "matched.right-"]);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "2"]), Duration::from_secs(240));
    assert!(out.status.success(), "the rescaled run failed:\n{}", stderr(&out));
    assert_output(&job, &inputs, &inputs.nested_loop(-20, 20, true));
}

#[test]
fn a_tumbling_window_join_outputs_every_pair_of_each_window_once_under_worker_kills() {
    let inputs = Inputs::new(4, 24_000, 500);
    let job = join_job(2, &inputs, "window_join: {on: id, right_on: order, tumbling: 100ms}", "", "15ms");
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    let expected = window_pairs(&inputs, Some(100), None);
    assert!(expected.len() > 10_000, "the input pairs too little to prove anything: {}", expected.len());
    assert_window_output(&job, &expected);
}

#[test]
fn a_session_window_join_restores_after_whole_tree_kills_at_another_parallelism() {
    let inputs = Inputs::new(5, 24_000, 500);
    let job = join_job(2, &inputs, "window_join: {on: id, right_on: order, session: {gap: 25ms}}", "", "20ms");
    kill_trees_then_restore_latest(&job, 500..1000, Some("3"));
    let expected = window_pairs(&inputs, None, Some(25));
    assert!(expected.len() > 10_000, "the input pairs too little to prove anything: {}", expected.len());
    assert_window_output(&job, &expected);
}

/// The regular join by its definition: every (order, payment) of one id,
/// whatever their times (nothing here outlives the one-hour TTL).
fn every_pair_of_one_id(inputs: &Inputs) -> BTreeMap<(i64, Option<i64>), u32> {
    inputs.nested_loop(i64::MIN / 4, i64::MAX / 4, false)
}

#[test]
fn a_regular_join_outputs_every_pair_of_one_key_once_under_worker_kills() {
    let inputs = Inputs::new(6, 16_000, 4_000);
    let job = join_job(2, &inputs, "join: {on: id, right_on: order, ttl: 1h}", "", "15ms");
    let out = run_with_worker_kills(&job, 4, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    let expected = every_pair_of_one_id(&inputs);
    assert!(expected.len() > 10_000, "the input pairs too little to prove anything: {}", expected.len());
    assert_output(&job, &inputs, &expected);
}

#[test]
fn a_regular_join_restores_its_kept_rows_after_whole_tree_kills_at_another_parallelism() {
    let inputs = Inputs::new(7, 16_000, 4_000);
    let job = join_job(2, &inputs, "join: {on: id, right_on: order, ttl: 1h}", "", "20ms");
    // The first checkpoint waits for its barriers behind the slowed
    // batches (about 0.5 s), so each round lives past it.
    kill_trees_then_restore_latest(&job, 1000..1800, Some("3"));
    assert_output(&job, &inputs, &every_pair_of_one_id(&inputs));
}

#[test]
fn a_regular_join_under_unaligned_checkpoints_restores_its_in_flight_records_at_another_parallelism() {
    let inputs = Inputs::new(8, 16_000, 4_000);
    let job = join_job(3, &inputs, "join: {on: id, right_on: order, ttl: 1h}", "  mode: unaligned\n", "10ms");
    kill_once_the_latest_checkpoint_holds(&job, &[], "3", &["in-flight-2-", "in-flight-2.1-", "matched.left-", "matched.right-"]);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "2"]), Duration::from_secs(240));
    assert!(out.status.success(), "the rescaled run failed:\n{}", stderr(&out));
    assert_output(&job, &inputs, &every_pair_of_one_id(&inputs));
}

/// Every join kind as a `join_job` step, with the oracle of its output.
fn join_kinds(inputs: &Inputs) -> Vec<(&'static str, Box<dyn Fn(&Job)>)> {
    let (a, b, c) = (inputs.nested_loop(-10, 40, true), window_pairs(inputs, Some(100), None), every_pair_of_one_id(inputs));
    let inputs_of = |inputs: &Inputs| Inputs { orders: inputs.orders.clone(), payments: inputs.payments.clone() };
    let (i1, i2) = (inputs_of(inputs), inputs_of(inputs));
    vec![
        ("interval_join: {on: id, right_on: order, between: {lower: -10ms, upper: 40ms}, type: left_outer}", Box::new(move |job: &Job| assert_output(job, &i1, &a))),
        ("window_join: {on: id, right_on: order, tumbling: 100ms}", Box::new(move |job: &Job| assert_window_output(job, &b))),
        ("join: {on: id, right_on: order, ttl: 1h}", Box::new(move |job: &Job| assert_output(job, &i2, &c))),
    ]
}

#[test]
fn every_join_kind_under_an_alignment_timeout_outputs_each_expected_row_once_under_worker_kills() {
    let inputs = Inputs::new(9, 12_000, 2_000);
    for (join, check) in join_kinds(&inputs) {
        let job = join_job(2, &inputs, join, "  alignment_timeout: 5ms\n", "15ms");
        let out = run_with_worker_kills(&job, 3, |_| {});
        assert!(stderr(&out).contains("restarting"), "{join}: no restart was reported:\n{}", stderr(&out));
        check(&job);
    }
}

#[test]
fn a_window_join_under_unaligned_checkpoints_restores_its_in_flight_records_at_another_parallelism() {
    let inputs = Inputs::new(10, 24_000, 500);
    let job = join_job(3, &inputs, "window_join: {on: id, right_on: order, tumbling: 100ms}", "  mode: unaligned\n", "10ms");
    kill_once_the_latest_checkpoint_holds(&job, &[], "3", &["in-flight-2-", "in-flight-2.1-", "matched.left-", "matched.right-"]);
    let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", "2"]), Duration::from_secs(240));
    assert!(out.status.success(), "the rescaled run failed:\n{}", stderr(&out));
    assert_window_output(&job, &window_pairs(&inputs, Some(100), None));
}

#[test]
fn every_join_kind_checkpointed_at_parallelism_4_restores_at_2_and_at_6_exactly_once() {
    let inputs = Inputs::new(11, 12_000, 2_000);
    for (join, check) in join_kinds(&inputs) {
        for to in ["2", "6"] {
            let job = join_job(4, &inputs, join, "", "20ms");
            let child = job.spawn(&[]);
            std::thread::sleep(Duration::from_millis(1200));
            kill_group(child.id());
            let killed = child.wait_with_output().unwrap();
            assert!(!killed.status.success(), "{join}: the job ended before it was killed; make it longer");
            let out = wait_with_timeout(job.spawn(&["--restore", "latest", "--parallelism", to]), Duration::from_secs(240));
            assert!(out.status.success(), "{join} at {to}: {}", stderr(&out));
            assert!(stderr(&out).contains("restoring `eo-test` from checkpoint"), "{join} at {to}: nothing was restored:\n{}", stderr(&out));
            check(&job);
        }
    }
}

#[test]
fn a_savepoint_of_a_join_restores_into_the_graph_with_a_stateless_step_added_and_a_removed_join_is_refused_unless_allowed() {
    let inputs = Inputs::new(12, 12_000, 2_000);
    let job = join_job(2, &inputs, "join: {on: id, right_on: order, ttl: 1h}", "", "20ms");
    let child = job.spawn(&[]);
    let sp = job.take_savepoint_with(&["--stop"]);
    let out = wait_with_timeout(child, Duration::from_secs(60));
    assert!(out.status.success(), "{}", stderr(&out));
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();

    // A filter that keeps everything after the join: the join's state ids
    // do not move, and the job ends with every pair once.
    let added = yaml
        .replace("sinks:\n", "  - {name: kept, input: matched, filter: \"seq >= 0\"}\nsinks:\n")
        .replace("input: matched\n", "input: kept\n");
    job.write_pipeline(&added);
    let out = wait_with_timeout(job.spawn(&["--restore", &sp]), Duration::from_secs(120));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_output(&job, &inputs, &every_pair_of_one_id(&inputs));

    // The join removed (orders filtered to the sink, payments to a
    // blackhole): its two states are refused by name and nothing is
    // touched, unless the user allows dropping them.
    let without = yaml
        .replace("  - {name: matched, input: [orders, payments], join: {on: id, right_on: order, ttl: 1h}}\n", "  - {name: kept, input: orders, filter: \"seq >= 0\"}\n")
        .replace("input: matched\n", "input: kept\n")
        .replace("sinks:\n", "sinks:\n  side: {input: payments, blackhole: {}}\n");
    job.write_pipeline(&without);
    let before = tree_digest(job.dir.path());
    let err = assert_refused(&job.run(&["--restore", &sp]));
    assert!(err.contains("matched.left") && err.contains("no longer has") && err.contains("--allow-non-restored-state"), "{err}");
    assert_eq!(tree_digest(job.dir.path()), before, "a refused restore changed files");
    let out = job.run(&["--restore", &sp, "--allow-non-restored-state"]);
    assert!(out.status.success(), "allowed, the job goes on without the join: {}", stderr(&out));
}
