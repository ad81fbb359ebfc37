//! The interval join against a nested loop over every left and right record
//! (the definition of the join), on seeded random input out of order within
//! the watermark's bound, with snapshots restored at random points into
//! another number of subtasks.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{Array, AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::IntervalJoin;
use crate::key_group::{key_groups, subtask_for_group};
use crate::plan::{IntervalJoinPlan, JoinSide};

const MAX_P: u32 = 128;

fn side_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::Int64, false),
        Field::new("key", DataType::Int64, true),
        Field::new("t", DataType::Int64, false),
    ]))
}

fn plan(lower: i64, upper: i64, left_outer: bool) -> (IntervalJoinPlan, SchemaRef) {
    let side = |name: &str| JoinSide { name: name.into(), schema: side_schema(), key_indices: vec![1], time_index: Some(2) };
    let mut fields: Vec<Field> = side_schema().fields().iter().map(|f| f.as_ref().clone()).collect();
    for f in side_schema().fields() {
        fields.push(Field::new(format!("b_{}", f.name()), f.data_type().clone(), left_outer || f.is_nullable()));
    }
    (IntervalJoinPlan { left: side("a"), right: side("b"), lower_ms: lower, upper_ms: upper, left_outer }, Arc::new(Schema::new(fields)))
}

/// One record of a side: (seq, key, time); key `None` is a null key.
type Rec = (i64, Option<i64>, i64);

fn batch(rows: &[Rec]) -> RecordBatch {
    RecordBatch::try_new(side_schema(), vec![
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
        Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())),
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
    ])
    .unwrap()
}

/// The output as (left seq, right seq or none), with the left time of each.
fn pairs(out: &RecordBatch) -> Vec<((i64, Option<i64>), i64)> {
    let seq = out.column(0).as_primitive::<Int64Type>();
    let t = out.column(2).as_primitive::<Int64Type>();
    let b_seq = out.column(3).as_primitive::<Int64Type>();
    (0..out.num_rows()).map(|r| ((seq.value(r), (!b_seq.is_null(r)).then(|| b_seq.value(r))), t.value(r))).collect()
}

/// The join by its definition: every pair of one (non-null) key in the
/// interval, and with `left_outer` every left record without one.
fn nested_loop(left: &[Rec], right: &[Rec], lower: i64, upper: i64, left_outer: bool) -> BTreeMap<(i64, Option<i64>), u32> {
    let mut out = BTreeMap::new();
    for l in left {
        let mut found = false;
        for r in right {
            if l.1.is_some() && l.1 == r.1 && r.2 >= l.2 + lower && r.2 <= l.2 + upper {
                *out.entry((l.0, Some(r.0))).or_insert(0) += 1;
                found = true;
            }
        }
        if left_outer && !found {
            *out.entry((l.0, None)).or_insert(0) += 1;
        }
    }
    out
}

/// The subtasks of a join at some parallelism, fed as the exchange would:
/// each record to the subtask of its key group, every watermark to all.
struct Subtasks {
    ops: Vec<IntervalJoin>,
    plan: IntervalJoinPlan,
    schema: SchemaRef,
    out: BTreeMap<(i64, Option<i64>), u32>,
    /// The watermark the join forwarded last: every output record's time
    /// must be above it, or a window downstream would drop it as late.
    forwarded: i64,
}

impl Subtasks {
    fn new(plan: &IntervalJoinPlan, schema: &SchemaRef, p: u32) -> Subtasks {
        let ops = (0..p).map(|j| IntervalJoin::new("j".into(), "steps[0].interval_join".into(), plan, schema.clone(), j, p, MAX_P).unwrap()).collect();
        Subtasks { ops, plan: plan.clone(), schema: schema.clone(), out: BTreeMap::new(), forwarded: i64::MIN }
    }

    fn take(&mut self, out: Option<RecordBatch>) {
        for (pair, t) in out.map(|b| pairs(&b)).unwrap_or_default() {
            assert!(t > self.forwarded, "{pair:?} at {t} is behind the forwarded watermark {}", self.forwarded);
            *self.out.entry(pair).or_insert(0) += 1;
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
        self.forwarded = self.forwarded.max(self.ops[0].output_watermark(w));
    }

    /// Snapshots every subtask and restores the state into `p` new ones.
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
        next.forwarded = self.forwarded;
        next
    }
}

#[test]
fn the_interval_join_outputs_what_a_nested_loop_does_once_through_out_of_order_input_and_rescaled_restores() {
    for seed in 0..40u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let lower = rng.random_range(-30..=10);
        let upper = lower + rng.random_range(0..=40);
        let left_outer = seed % 2 == 1;
        let disorder = rng.random_range(0..=20);
        let (plan, schema) = plan(lower, upper, left_outer);
        // Records in time order with a few null keys, then shuffled within
        // `disorder` so that none is behind the watermark.
        let mut records: Vec<(usize, Rec)> = (0..400)
            .map(|i| {
                let key = if rng.random_ratio(1, 30) { None } else { Some(rng.random_range(0..6)) };
                (rng.random_range(0..2), (i as i64, key, i as i64 / 2 + rng.random_range(0..=disorder)))
            })
            .collect();
        let (left, right): (Vec<_>, Vec<_>) = records.iter().cloned().partition(|(side, _)| *side == 0);
        let left: Vec<Rec> = left.into_iter().map(|(_, r)| r).collect();
        let right: Vec<Rec> = right.into_iter().map(|(_, r)| r).collect();
        let expected = nested_loop(&left, &right, lower, upper, left_outer);
        records.sort_by_cached_key(|(_, r)| r.2 - rng.random_range(0..=disorder));
        let mut subtasks = Subtasks::new(&plan, &schema, rng.random_range(1..=3));
        let mut max_time = i64::MIN;
        for chunk in records.chunks(rng.random_range(1..=9)) {
            for input in 0..2 {
                let rows: Vec<Rec> = chunk.iter().filter(|(s, _)| *s == input).map(|(_, r)| *r).collect();
                if !rows.is_empty() {
                    subtasks.feed(input, &rows);
                }
            }
            max_time = max_time.max(chunk.iter().map(|(_, r)| r.2).max().unwrap());
            // Nothing still to come is older than this.
            subtasks.watermark(max_time - 2 * disorder - 1);
            if rng.random_ratio(1, 12) {
                subtasks = subtasks.rescale(rng.random_range(1..=4));
            }
        }
        subtasks.watermark(i64::MAX);
        assert_eq!(subtasks.out, expected, "seed {seed}: lower {lower}, upper {upper}, left outer {left_outer}");
        assert!(subtasks.ops.iter().all(|op| op.kept() == (0, 0)), "seed {seed}: the end of input expires every row");
        assert_eq!(subtasks.ops.iter_mut().map(|op| op.take_late()).sum::<u64>(), 0, "seed {seed}");
    }
}

#[test]
fn a_record_behind_the_watermark_is_late_counted_and_pairs_with_nothing() {
    let (plan, schema) = plan(0, 10, true);
    let mut subtasks = Subtasks::new(&plan, &schema, 1);
    subtasks.feed(1, &[(1, Some(7), 100)]);
    subtasks.watermark(100);
    subtasks.feed(0, &[(2, Some(7), 95), (3, Some(7), 101)]);
    assert_eq!(subtasks.ops[0].take_late(), 1);
    subtasks.watermark(i64::MAX);
    // The late left record is neither paired nor output as unmatched.
    assert_eq!(subtasks.out, BTreeMap::from([((3, None), 1)]));
}

#[test]
fn rows_are_kept_only_while_a_partner_may_still_arrive() {
    let (plan, schema) = plan(-5, 10, false);
    let mut subtasks = Subtasks::new(&plan, &schema, 1);
    subtasks.feed(0, &[(1, Some(1), 100)]);
    subtasks.feed(1, &[(2, Some(1), 103)]);
    assert_eq!(subtasks.ops[0].kept(), (1, 1));
    // The right row pairs with left times in [103 - 10, 103 + 5]: it goes
    // once the watermark reaches 108; the left one at 110.
    subtasks.watermark(107);
    assert_eq!(subtasks.ops[0].kept(), (1, 1));
    subtasks.watermark(108);
    assert_eq!(subtasks.ops[0].kept(), (1, 0));
    subtasks.watermark(110);
    assert_eq!(subtasks.ops[0].kept(), (0, 0));
    assert_eq!(subtasks.out, BTreeMap::from([((1, Some(2)), 1)]));
    assert_eq!(subtasks.ops[0].output_watermark(110), 100, "held back by upper");
}

#[test]
fn a_snapshot_of_other_columns_is_refused_naming_the_state() {
    let (plan_a, schema) = plan(0, 10, false);
    let (plan_b, _) = plan(0, 10, true);
    let mut inner = Subtasks::new(&plan_a, &schema, 1);
    inner.feed(0, &[(1, Some(1), 5)]);
    let snap = inner.ops[0].snapshot();
    let (id, copy) = snap.into_iter().next().unwrap();
    let b = copy.into_batch(&id).unwrap();
    let mut outer = IntervalJoin::new("j".into(), "steps[0].interval_join".into(), &plan_b, schema, 0, 1, MAX_P).unwrap();
    let err = outer.restore(&id, &b, "chk-3").unwrap_err().to_string();
    assert!(err.contains("`j.left` (steps[0].interval_join) does not fit") && err.contains("give the changed step a new id"), "{err}");
}
