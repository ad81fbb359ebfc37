//! The window join against its definition computed by brute force: every
//! record assigned its windows (sessions merged over the times of both
//! sides of a key), and per key and window every left record paired with
//! every right one; on seeded random input out of order within the
//! watermark's bound, with snapshots restored at random points into another
//! number of subtasks.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::WindowJoin;
use crate::key_group::{key_groups, subtask_for_group};
use crate::plan::{JoinSide, WindowJoinPlan};

const MAX_P: u32 = 128;

fn side_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::Int64, false),
        Field::new("key", DataType::Int64, false),
        Field::new("t", DataType::Int64, false),
    ]))
}

fn plan(size: i64, slide: i64, gap: Option<i64>) -> (WindowJoinPlan, SchemaRef) {
    let side = |name: &str| JoinSide { name: name.into(), schema: side_schema(), key_indices: vec![1], time_index: Some(2) };
    let mut fields: Vec<Field> = side_schema().fields().iter().map(|f| f.as_ref().clone()).collect();
    for f in side_schema().fields() {
        fields.push(Field::new(format!("b_{}", f.name()), f.data_type().clone(), false));
    }
    fields.push(Field::new("window_start", DataType::Int64, false));
    fields.push(Field::new("window_end", DataType::Int64, false));
    let p = WindowJoinPlan { left: side("a"), right: side("b"), size_ms: size, slide_ms: slide, session_gap_ms: gap };
    (p, Arc::new(Schema::new(fields)))
}

/// (seq, key, time).
type Rec = (i64, i64, i64);
/// (left seq, right seq, window start, window end).
type Out = (i64, i64, i64, i64);

fn batch(rows: &[Rec]) -> RecordBatch {
    RecordBatch::try_new(side_schema(), vec![
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
    ])
    .unwrap()
}

/// The windows of every record, by brute force: fixed windows from every
/// multiple of `slide`; sessions from the sorted times of each key.
fn windows_of(records: &[(usize, Rec)], size: i64, slide: i64, gap: Option<i64>) -> Vec<(usize, Rec, i64, i64)> {
    let mut out = Vec::new();
    match gap {
        None => {
            for &(side, r) in records {
                let mut start = (r.2 - size).div_euclid(slide) * slide;
                while start <= r.2 {
                    if r.2 < start + size {
                        out.push((side, r, start, start + size));
                    }
                    start += slide;
                }
            }
        }
        Some(gap) => {
            let mut by_key: BTreeMap<i64, Vec<(usize, Rec)>> = BTreeMap::new();
            for &(side, r) in records {
                by_key.entry(r.1).or_default().push((side, r));
            }
            for (_, mut rs) in by_key {
                rs.sort_by_key(|(_, r)| r.2);
                let mut session: Vec<(usize, Rec)> = Vec::new();
                let mut end = i64::MIN;
                for (side, r) in rs {
                    // Sessions that only touch stay apart (`assign::session_of`).
                    if !session.is_empty() && r.2 >= end {
                        let start = session[0].1 .2;
                        out.extend(session.drain(..).map(|(s, r)| (s, r, start, end)));
                    }
                    end = if session.is_empty() { r.2 + gap } else { end.max(r.2 + gap) };
                    session.push((side, r));
                }
                let start = session[0].1 .2;
                out.extend(session.drain(..).map(|(s, r)| (s, r, start, end)));
            }
        }
    }
    out
}

fn brute_force(records: &[(usize, Rec)], size: i64, slide: i64, gap: Option<i64>) -> BTreeMap<Out, u32> {
    let assigned = windows_of(records, size, slide, gap);
    let mut out = BTreeMap::new();
    for (ls, l, s1, e1) in &assigned {
        for (rs, r, s2, e2) in &assigned {
            if *ls == 0 && *rs == 1 && l.1 == r.1 && (s1, e1) == (s2, e2) {
                *out.entry((l.0, r.0, *s1, *e1)).or_insert(0) += 1;
            }
        }
    }
    out
}

struct Subtasks {
    ops: Vec<WindowJoin>,
    plan: WindowJoinPlan,
    schema: SchemaRef,
    out: BTreeMap<Out, u32>,
}

impl Subtasks {
    fn new(plan: &WindowJoinPlan, schema: &SchemaRef, p: u32) -> Subtasks {
        let ops = (0..p).map(|j| WindowJoin::new("w".into(), "steps[0].window_join".into(), plan, schema.clone(), j, p, MAX_P).unwrap()).collect();
        Subtasks { ops, plan: plan.clone(), schema: schema.clone(), out: BTreeMap::new() }
    }

    fn take(&mut self, out: Option<RecordBatch>) {
        let Some(b) = out else { return };
        let c = |i: usize| b.column(i).as_primitive::<Int64Type>().clone();
        let (seq, b_seq, start, end) = (c(0), c(3), c(6), c(7));
        for r in 0..b.num_rows() {
            *self.out.entry((seq.value(r), b_seq.value(r), start.value(r), end.value(r))).or_insert(0) += 1;
        }
    }

    fn feed(&mut self, input: usize, rows: &[Rec]) {
        let p = self.ops.len() as u32;
        let b = batch(rows);
        let groups = key_groups(&[b.column(1).clone()], b.num_rows(), MAX_P).unwrap();
        for j in 0..p {
            let mine: Vec<Rec> = rows.iter().zip(&groups).filter(|(_, g)| subtask_for_group(**g, p, MAX_P) == j).map(|(r, _)| *r).collect();
            if !mine.is_empty() {
                let out = self.ops[j as usize].process(input, batch(&mine)).unwrap();
                self.take(out);
            }
        }
    }

    fn watermark(&mut self, w: i64) {
        for k in 0..self.ops.len() {
            let out = self.ops[k].on_watermark(w).unwrap();
            self.take(out);
        }
    }

    fn rescale(self, p: u32) -> Subtasks {
        let snapshots: Vec<(String, RecordBatch)> =
            self.ops.iter().flat_map(|op| op.snapshot()).map(|(id, copy)| (id.clone(), copy.into_batch(&id).unwrap())).collect();
        let mut next = Subtasks::new(&self.plan, &self.schema, p);
        for op in &mut next.ops {
            for (id, b) in &snapshots {
                op.restore(id, b, "chk-1").unwrap();
            }
        }
        next.out = self.out;
        next
    }
}

#[test]
fn the_window_join_outputs_what_brute_force_does_once_for_tumbling_sliding_and_session_windows_through_rescaled_restores() {
    for seed in 0..45u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (size, slide, gap) = match seed % 3 {
            0 => {
                let s = rng.random_range(5..40);
                (s, s, None)
            }
            1 => {
                let slide = rng.random_range(3..15);
                (slide * rng.random_range(1..4), slide, None)
            }
            _ => (0, 0, Some(rng.random_range(2..12))),
        };
        let disorder = rng.random_range(0..=15);
        let (plan, schema) = plan(size, slide, gap);
        let mut records: Vec<(usize, Rec)> =
            (0..300).map(|i| (rng.random_range(0..2), (i as i64, rng.random_range(0..5), i as i64 / 3 + rng.random_range(0..=disorder)))).collect();
        let expected = brute_force(&records, size, slide, gap);
        records.sort_by_cached_key(|(_, r)| r.2 - rng.random_range(0..=disorder));
        let mut subtasks = Subtasks::new(&plan, &schema, rng.random_range(1..=3));
        let mut max_time = i64::MIN;
        for chunk in records.chunks(rng.random_range(1..=7)) {
            for input in 0..2 {
                let rows: Vec<Rec> = chunk.iter().filter(|(s, _)| *s == input).map(|(_, r)| *r).collect();
                if !rows.is_empty() {
                    subtasks.feed(input, &rows);
                }
            }
            max_time = max_time.max(chunk.iter().map(|(_, r)| r.2).max().unwrap());
            subtasks.watermark(max_time - 2 * disorder - 1);
            if rng.random_ratio(1, 10) {
                subtasks = subtasks.rescale(rng.random_range(1..=4));
            }
        }
        subtasks.watermark(i64::MAX);
        let missing: Vec<_> = expected.iter().filter(|(k, n)| subtasks.out.get(k) != Some(n)).take(5).collect();
        let extra: Vec<_> = subtasks.out.iter().filter(|(k, n)| expected.get(k) != Some(n)).take(5).collect();
        assert!(missing.is_empty() && extra.is_empty(), "seed {seed}: size {size}, slide {slide}, gap {gap:?}: missing {missing:?}, extra {extra:?}");
        assert!(subtasks.ops.iter().all(|op| op.kept() == 0), "seed {seed}: the end of input closes every window");
        assert_eq!(subtasks.ops.iter_mut().map(|op| op.take_late()).sum::<u64>(), 0, "seed {seed}");
    }
}

#[test]
fn a_record_only_for_closed_windows_is_late_counted_and_joins_nothing() {
    let (plan, schema) = plan(10, 10, None);
    let mut subtasks = Subtasks::new(&plan, &schema, 1);
    subtasks.feed(0, &[(1, 1, 3)]);
    subtasks.feed(1, &[(2, 1, 5)]);
    subtasks.watermark(9);
    assert_eq!(subtasks.out, BTreeMap::from([((1, 2, 0, 10), 1)]));
    subtasks.feed(1, &[(3, 1, 8), (4, 1, 12)]);
    assert_eq!(subtasks.ops[0].take_late(), 1);
    subtasks.feed(0, &[(5, 1, 15)]);
    subtasks.watermark(i64::MAX);
    assert_eq!(subtasks.out, BTreeMap::from([((1, 2, 0, 10), 1), ((5, 4, 10, 20), 1)]));
}
