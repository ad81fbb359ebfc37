use super::*;
use crate::plan::WindowAggPlan;

fn input_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("t", DataType::Int64, true),
        Field::new("v", DataType::Int64, true),
    ]))
}

fn output_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("window_start", DataType::Int64, false),
        Field::new("window_end", DataType::Int64, false),
        Field::new("n", DataType::Int64, false),
        Field::new("total", DataType::Int64, true),
        Field::new("mean", DataType::Float64, true),
    ]))
}

fn plan(size: i64, slide: i64, lateness: i64) -> WindowPlan {
    let agg = |function, input: Option<usize>| WindowAggPlan { function, input, input_type: DataType::Int64 };
    WindowPlan {
        key_indices: vec![0],
        time_index: 1,
        size_ms: size,
        slide_ms: slide,
        session_gap_ms: None,
        allowed_lateness_ms: lateness,
        aggregates: vec![agg(WindowFn::Count, None), agg(WindowFn::Sum, Some(2)), agg(WindowFn::Avg, Some(2))],
        late_records: None,
    }
}

fn window(plan: &WindowPlan, subtask: u32, parallelism: u32) -> WindowAggregate {
    WindowAggregate::new("window-0".into(), "steps[1].window".into(), plan, &input_schema(), output_schema(), subtask, parallelism, 16).unwrap()
}

fn batch(rows: &[(i64, i64, i64)]) -> RecordBatch {
    RecordBatch::try_new(
        input_schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
        ],
    )
    .unwrap()
}

/// (key, start, end, count, sum), sorted.
fn results(b: Option<RecordBatch>) -> Vec<(i64, i64, i64, i64, i64)> {
    let Some(b) = b else { return Vec::new() };
    let col = |i: usize| b.column(i).as_primitive::<Int64Type>().clone();
    let (k, s, e, n, t) = (col(0), col(1), col(2), col(3), col(4));
    let mut out: Vec<_> = (0..b.num_rows()).map(|r| (k.value(r), s.value(r), e.value(r), n.value(r), t.value(r))).collect();
    out.sort();
    out
}

#[test]
fn a_tumbling_window_fires_once_the_watermark_reaches_its_last_millisecond() {
    let mut w = window(&plan(10, 10, 0), 0, 1);
    assert!(w.process(batch(&[(1, 3, 1), (2, 9, 5), (1, 12, 2), (1, 0, 4)])).unwrap().is_none());
    assert!(results(w.on_watermark(8).unwrap()).is_empty(), "the window [0,10) may still get a record at 9");
    assert_eq!(results(w.on_watermark(9).unwrap()), vec![(1, 0, 10, 2, 5), (2, 0, 10, 1, 5)]);
    assert!(results(w.on_watermark(15).unwrap()).is_empty());
    assert_eq!(results(w.on_watermark(i64::MAX).unwrap()), vec![(1, 10, 20, 1, 2)]);
}

#[test]
fn a_sliding_window_counts_a_record_in_every_window_that_holds_it() {
    let mut w = window(&plan(10, 5, 0), 0, 1);
    w.process(batch(&[(1, 7, 1), (1, 12, 1)])).unwrap();
    assert_eq!(
        results(w.on_watermark(i64::MAX).unwrap()),
        vec![(1, 0, 10, 1, 1), (1, 5, 15, 2, 2), (1, 10, 20, 1, 1)]
    );
}

#[test]
fn with_a_late_records_output_the_late_records_come_out_as_they_came_in() {
    let mut p = plan(10, 10, 0);
    p.late_records = Some(weir_api::FileSinkSpec { path: "late".into(), format: Default::default(), guarantee: weir_api::Guarantee::ExactlyOnce, max_file_bytes: None });
    let mut w = window(&p, 0, 1);
    w.process(batch(&[(1, 3, 1)])).unwrap();
    w.on_watermark(10).unwrap();
    w.process(batch(&[(1, 5, 100), (2, 12, 7), (3, 9, 300)])).unwrap();
    assert_eq!(w.take_late(), 2);
    let late = w.take_late_records();
    let rows: Vec<(i64, i64, i64)> = late
        .iter()
        .flat_map(|b| {
            let col = |i: usize| b.column(i).as_primitive::<Int64Type>().values().to_vec();
            let (k, t, v) = (col(0), col(1), col(2));
            (0..b.num_rows()).map(move |r| (k[r], t[r], v[r]))
        })
        .collect();
    assert_eq!(rows, vec![(1, 5, 100), (3, 9, 300)], "every late record whole, in input order; the one on time is not among them");
    assert!(w.take_late_records().is_empty(), "taken once");
    // Without the output nothing is kept.
    let mut plain = window(&plan(10, 10, 0), 0, 1);
    plain.on_watermark(10).unwrap();
    plain.process(batch(&[(1, 5, 100)])).unwrap();
    assert_eq!(plain.take_late(), 1);
    assert!(plain.take_late_records().is_empty());
}

#[test]
fn a_record_for_a_fired_window_is_late_counted_and_dropped() {
    let mut w = window(&plan(10, 10, 0), 0, 1);
    w.process(batch(&[(1, 3, 1)])).unwrap();
    w.on_watermark(10).unwrap();
    assert!(w.process(batch(&[(1, 5, 100)])).unwrap().is_none());
    assert_eq!(w.take_late(), 1);
    assert!(results(w.on_watermark(i64::MAX).unwrap()).is_empty(), "the late record opened no window");
}

#[test]
fn within_the_allowed_lateness_a_late_record_fires_its_window_again_with_the_new_result() {
    let mut w = window(&plan(10, 10, 5), 0, 1);
    w.process(batch(&[(1, 3, 1)])).unwrap();
    assert_eq!(results(w.on_watermark(9).unwrap()), vec![(1, 0, 10, 1, 1)]);
    assert_eq!(results(w.process(batch(&[(1, 4, 10)])).unwrap()), vec![(1, 0, 10, 2, 11)]);
    assert_eq!(w.take_late(), 0);
    w.on_watermark(14).unwrap();
    w.process(batch(&[(1, 5, 1)])).unwrap();
    assert_eq!(w.take_late(), 1, "past the lateness the window is gone");
}

#[test]
fn a_restore_at_another_parallelism_keeps_every_window_and_the_watermark() {
    let p = plan(10, 10, 0);
    let mut before = window(&p, 0, 1);
    let rows: Vec<(i64, i64, i64)> = (0..40).map(|k| (k, 15, k)).chain([(3, 2, 1)]).collect();
    before.process(batch(&rows)).unwrap();
    // The window [0,10) fired before the checkpoint.
    assert_eq!(results(before.on_watermark(12).unwrap()), vec![(3, 0, 10, 1, 1)]);
    let snapshot = before.snapshot().unwrap();
    let mut all = Vec::new();
    for s in 0..3 {
        let mut after = window(&p, s, 3);
        after.restore(&snapshot, "chk-1").unwrap();
        // A record for the fired window is as late as it was, in every subtask.
        after.process(batch(&[(3, 1, 1)])).unwrap();
        assert_eq!(after.take_late(), 1);
        all.extend(results(after.on_watermark(i64::MAX).unwrap()));
    }
    all.sort();
    assert_eq!(all, (0..40).map(|k| (k, 10, 20, 1, k)).collect::<Vec<_>>());
}

/// A key of key group at most 7 (`low`) or at least 8 of 16.
fn key_in_half(low: bool) -> i64 {
    (0..).find(|k| {
        let g = crate::key_group::key_groups(&[Arc::new(Int64Array::from(vec![*k])) as ArrayRef], 1, 16).unwrap()[0];
        (g < 8) == low
    })
    .unwrap()
}

#[test]
fn a_merging_restore_of_unaligned_snapshots_judges_each_key_group_by_its_own_watermark() {
    // An unaligned barrier found subtask 0 at watermark 30 and subtask 1 at
    // 5: its record at 7 was still in flight, and is replayed after the
    // restore into one subtask. It must count; a record at 8 for subtask
    // 0's key, whose window fired and was dropped, must stay late.
    let p = plan(10, 10, 0);
    let (a, b) = (key_in_half(true), key_in_half(false));
    let mut ahead = window(&p, 0, 2);
    ahead.process(batch(&[(a, 5, 1), (a, 15, 1)])).unwrap();
    assert_eq!(results(ahead.on_watermark(30).unwrap()).len(), 2);
    let mut behind = window(&p, 1, 2);
    behind.process(batch(&[(b, 5, 1)])).unwrap();
    assert!(results(behind.on_watermark(5).unwrap()).is_empty());
    let mut merged = window(&p, 0, 1);
    merged.restore(&ahead.snapshot().unwrap(), "chk-1/0").unwrap();
    merged.restore(&behind.snapshot().unwrap(), "chk-1/1").unwrap();
    merged.process(batch(&[(b, 7, 1), (a, 8, 1)])).unwrap();
    assert_eq!(merged.take_late(), 1, "only the record of the key group that was at 30 is late");
    // Snapshotted again before the watermark passes 30: still judged so.
    let mut again = window(&p, 0, 1);
    again.restore(&merged.snapshot().unwrap(), "chk-2/0").unwrap();
    again.process(batch(&[(a, 9, 1)])).unwrap();
    assert_eq!(again.take_late(), 1);
    assert_eq!(results(again.on_watermark(i64::MAX).unwrap()), vec![(b, 0, 10, 2, 2)]);
}

#[test]
fn a_null_event_time_fails_naming_the_record() {
    let mut w = window(&plan(10, 10, 0), 0, 1);
    let b = RecordBatch::try_new(
        input_schema(),
        vec![Arc::new(Int64Array::from(vec![1])), Arc::new(Int64Array::from(vec![None])), Arc::new(Int64Array::from(vec![1]))],
    )
    .unwrap();
    let err = w.process(b).unwrap_err();
    assert!(err.is_fatal() && err.to_string().contains("event-time field is null"), "{err}");
}

fn sessions(gap: i64, lateness: i64) -> WindowPlan {
    WindowPlan { size_ms: 0, slide_ms: 0, session_gap_ms: Some(gap), ..plan(1, 1, lateness) }
}

#[test]
fn records_closer_than_the_gap_are_one_session_and_a_bridging_record_merges_two_but_a_session_that_only_touches_stays_apart() {
    let mut w = window(&sessions(10, 0), 0, 1);
    w.process(batch(&[(1, 0, 1), (1, 5, 2), (1, 30, 4), (2, 3, 8)])).unwrap();
    // [20,30) only touches [30,40); then [14,24) bridges [0,15) and [20,30).
    w.process(batch(&[(1, 20, 16), (1, 14, 32)])).unwrap();
    assert_eq!(results(w.on_watermark(38).unwrap()), vec![(1, 0, 30, 4, 51), (2, 3, 13, 1, 8)]);
    assert_eq!(results(w.on_watermark(39).unwrap()), vec![(1, 30, 40, 1, 4)]);
    assert!(results(w.on_watermark(i64::MAX).unwrap()).is_empty());
}

#[test]
fn a_late_record_opening_a_session_of_its_own_is_dropped_but_one_extending_a_live_session_is_not() {
    let mut w = window(&sessions(10, 5), 0, 1);
    w.process(batch(&[(1, 100, 1)])).unwrap();
    assert_eq!(results(w.on_watermark(112).unwrap()), vec![(1, 100, 110, 1, 1)]);
    // Within the lateness: merged into the fired session, which now ends
    // later and fires again when the watermark gets there.
    assert!(w.process(batch(&[(1, 105, 2)])).unwrap().is_none());
    assert_eq!(results(w.on_watermark(114).unwrap()), vec![(1, 100, 115, 2, 3)]);
    w.process(batch(&[(1, 50, 7)])).unwrap();
    assert_eq!(w.take_late(), 1, "a session [50,60) is long past");
}

#[test]
fn sessions_restore_at_another_parallelism_and_keep_merging() {
    let p = sessions(10, 0);
    let mut before = window(&p, 0, 1);
    before.process(batch(&(0..20).map(|k| (k, 0, 1)).collect::<Vec<_>>())).unwrap();
    let snapshot = before.snapshot().unwrap();
    let mut all = Vec::new();
    for s in 0..2 {
        let mut after = window(&p, s, 2);
        after.restore(&snapshot, "chk-1").unwrap();
        after.process(batch(&(0..20).map(|k| (k, 8, 2)).collect::<Vec<_>>())).unwrap();
        all.extend(results(after.on_watermark(i64::MAX).unwrap()));
    }
    all.sort();
    // Each subtask merges only its own keys (the others' state it does not hold).
    let mine: Vec<_> = all.iter().filter(|r| r.3 == 2).cloned().collect();
    assert_eq!(mine, (0..20).map(|k| (k, 0, 18, 2, 3)).collect::<Vec<_>>());
}
