//! The regular join against a hash join of everything both inputs hold,
//! through snapshots restored at random points into another number of
//! subtasks, and its time-to-live on a clock the test moves.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use arrow::array::{AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{Clock, RegularJoin};
use crate::key_group::{key_groups, subtask_for_group};
use crate::plan::{JoinSide, RegularJoinPlan};

const MAX_P: u32 = 128;

fn side_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("seq", DataType::Int64, false), Field::new("key", DataType::Int64, true)]))
}

fn plan(ttl_ms: i64) -> (RegularJoinPlan, SchemaRef) {
    let side = |name: &str| JoinSide { name: name.into(), schema: side_schema(), key_indices: vec![1], time_index: None };
    let schema = Arc::new(Schema::new(vec![
        Field::new("seq", DataType::Int64, false),
        Field::new("key", DataType::Int64, true),
        Field::new("b_seq", DataType::Int64, false),
        Field::new("b_key", DataType::Int64, true),
    ]));
    (RegularJoinPlan { left: side("a"), right: side("b"), ttl_ms }, schema)
}

/// (seq, key); a key `None` is null.
type Rec = (i64, Option<i64>);

fn batch(rows: &[Rec]) -> RecordBatch {
    RecordBatch::try_new(side_schema(), vec![
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
        Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())),
    ])
    .unwrap()
}

struct Subtasks {
    ops: Vec<RegularJoin>,
    plan: RegularJoinPlan,
    schema: SchemaRef,
    clock: Clock,
    out: BTreeMap<(i64, i64), u32>,
}

impl Subtasks {
    fn new(plan: &RegularJoinPlan, schema: &SchemaRef, p: u32, clock: &Clock) -> Subtasks {
        let ops = (0..p).map(|j| RegularJoin::new("j".into(), "steps[0].join".into(), plan, schema.clone(), j, p, MAX_P, clock.clone()).unwrap()).collect();
        Subtasks { ops, plan: plan.clone(), schema: schema.clone(), clock: clock.clone(), out: BTreeMap::new() }
    }

    fn feed(&mut self, input: usize, rows: &[Rec]) {
        let p = self.ops.len() as u32;
        let b = batch(rows);
        let groups = key_groups(&[b.column(1).clone()], b.num_rows(), MAX_P).unwrap();
        for j in 0..p {
            let mine: Vec<Rec> = rows.iter().zip(&groups).filter(|(_, g)| subtask_for_group(**g, p, MAX_P) == j).map(|(r, _)| *r).collect();
            if mine.is_empty() {
                continue;
            }
            if let Some(out) = self.ops[j as usize].process(input, batch(&mine)).unwrap() {
                let (a, b) = (out.column(0).as_primitive::<Int64Type>().clone(), out.column(2).as_primitive::<Int64Type>().clone());
                assert_eq!(out.column(1).as_primitive::<Int64Type>().values(), out.column(3).as_primitive::<Int64Type>().values(), "pairs of one key");
                for r in 0..out.num_rows() {
                    *self.out.entry((a.value(r), b.value(r))).or_insert(0) += 1;
                }
            }
        }
    }

    fn rescale(self, p: u32) -> Subtasks {
        let snapshots: Vec<(String, RecordBatch)> =
            self.ops.iter().flat_map(|op| op.snapshot()).map(|(id, copy)| (id.clone(), copy.into_batch(&id).unwrap())).collect();
        let mut next = Subtasks::new(&self.plan, &self.schema, p, &self.clock);
        for op in &mut next.ops {
            for (id, b) in &snapshots {
                op.restore(id, b, "chk-1").unwrap();
            }
        }
        next.out = self.out;
        next
    }
}

fn clock_at(now: &Arc<AtomicI64>) -> Clock {
    let now = now.clone();
    Arc::new(move || now.load(Ordering::SeqCst))
}

#[test]
fn the_regular_join_outputs_what_a_hash_join_does_once_through_rescaled_restores_when_nothing_outlives_its_ttl() {
    for seed in 0..30u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (plan, schema) = plan(3_600_000);
        let records: Vec<(usize, Rec)> =
            (0..300).map(|i| (rng.random_range(0..2), (i as i64, if rng.random_ratio(1, 25) { None } else { Some(rng.random_range(0..8)) }))).collect();
        let mut expected = BTreeMap::new();
        for (ls, l) in &records {
            for (rs, r) in &records {
                if *ls == 0 && *rs == 1 && l.1.is_some() && l.1 == r.1 {
                    *expected.entry((l.0, r.0)).or_insert(0u32) += 1;
                }
            }
        }
        let now = Arc::new(AtomicI64::new(1_000));
        let mut subtasks = Subtasks::new(&plan, &schema, rng.random_range(1..=3), &clock_at(&now));
        for chunk in records.chunks(rng.random_range(1..=9)) {
            for input in 0..2 {
                let rows: Vec<Rec> = chunk.iter().filter(|(s, _)| *s == input).map(|(_, r)| *r).collect();
                if !rows.is_empty() {
                    subtasks.feed(input, &rows);
                }
            }
            now.fetch_add(rng.random_range(0..50), Ordering::SeqCst);
            if rng.random_ratio(1, 10) {
                subtasks = subtasks.rescale(rng.random_range(1..=4));
            }
        }
        assert_eq!(subtasks.out, expected, "seed {seed}");
    }
}

#[test]
fn a_record_pairs_only_with_partners_that_arrive_within_its_ttl_and_a_restored_row_keeps_its_age() {
    let (plan, schema) = plan(1000);
    let now = Arc::new(AtomicI64::new(0));
    let mut s = Subtasks::new(&plan, &schema, 1, &clock_at(&now));
    s.feed(0, &[(1, Some(7))]);
    now.store(999, Ordering::SeqCst);
    s.feed(1, &[(2, Some(7))]);
    // Exactly `ttl` after it arrived, the left record is gone.
    now.store(1000, Ordering::SeqCst);
    s.feed(1, &[(3, Some(7))]);
    assert_eq!(s.out, BTreeMap::from([((1, 2), 1)]));
    assert_eq!(s.ops[0].kept(), (0, 2));
    // Restored rows keep the time they arrived: at 1999 the right record
    // of 999 is gone, the one of 1000 is not.
    let mut s = s.rescale(2);
    now.store(1999, Ordering::SeqCst);
    s.feed(0, &[(4, Some(7))]);
    assert_eq!(s.out, BTreeMap::from([((1, 2), 1), ((4, 3), 1)]));
    assert!(s.ops.iter().all(|op| op.kept().1 <= 1), "expired rows are gone from the state");
}
