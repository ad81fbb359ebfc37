//! The interval join: pairs of a left and a right record of one key with
//! `right.t ∈ [left.t + lower, left.t + upper]` by event time, inner or
//! left outer.
//!
//! A record that arrives probes the other side's kept rows of its key in
//! its time range and outputs a pair for each, then is kept for as long as
//! a record of the other side may still pair with it: a left row until the
//! watermark reaches `t + upper`, a right row until it reaches `t − lower`
//! (the watermark W promises that no record with a time ≤ W follows). So
//! every pair is output once, when its second record arrives, and the kept
//! state is bounded by the watermark. A left outer join outputs a left row
//! that never found a partner, with null right fields, when it goes.
//!
//! A record whose time is at or behind the watermark broke that promise: it
//! is late, counted and dropped, as Flink's interval join drops it.
//!
//! The output carries the left's event time. A pair is output when its
//! second record arrives, so its left time may be up to `upper` behind the
//! watermark then; the join therefore forwards `W − max(upper, 0)` as its
//! own watermark (Flink's SQL interval join holds its watermark back the
//! same way), and a left outer row, output before the watermark that
//! expires it is forwarded, is on time as well.
//!
//! The snapshot is one batch per side (`<id>.left`, `<id>.right`):
//! `key_group`, the side's fields and, for a left outer join's left side,
//! `matched`, with the watermark in the schema metadata as windows keep it
//! (and per key group, for a rescaled restore: [`RestoredWatermarks`]).

use std::ops::RangeInclusive;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, UInt32Array};
use arrow::datatypes::{Int64Type, SchemaRef};

use super::super::record_json;
use super::super::restored_watermarks::{self, RestoredWatermarks, WATERMARK_KEY};
use super::super::running::describe;
use super::side::{fits, has_null_key, Side, SideCopy};
use crate::error::{Error, Result};
use crate::key_group::{groups_of_subtask, key_groups};
use crate::plan::IntervalJoinPlan;

pub struct IntervalJoin {
    id: String,
    step: String,
    lower: i64,
    upper: i64,
    left_outer: bool,
    left: Side,
    right: Side,
    output_schema: SchemaRef,
    max_parallelism: u32,
    groups: RangeInclusive<u32>,
    watermark: i64,
    restored: RestoredWatermarks,
    late: u64,
}

/// A pair to output: the left row and the right one (none for a left outer
/// row that found no partner).
type Pair = (Box<[u8]>, Option<Box<[u8]>>);

impl IntervalJoin {
    pub fn new(id: String, step: String, plan: &IntervalJoinPlan, output_schema: SchemaRef, subtask: u32, parallelism: u32, max_parallelism: u32) -> Result<Self> {
        Ok(IntervalJoin {
            left: Side::new(&plan.left, plan.left_outer, &step)?,
            right: Side::new(&plan.right, false, &step)?,
            id,
            step,
            lower: plan.lower_ms,
            upper: plan.upper_ms,
            left_outer: plan.left_outer,
            output_schema,
            max_parallelism,
            groups: groups_of_subtask(subtask, parallelism, max_parallelism),
            watermark: i64::MIN,
            restored: RestoredWatermarks::default(),
            late: 0,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn take_late(&mut self) -> u64 {
        std::mem::take(&mut self.late)
    }

    /// Rows kept, left and right.
    pub fn kept(&self) -> (usize, usize) {
        (self.left.len(), self.right.len())
    }

    /// The watermark the join forwards when its inputs' is `watermark`.
    pub fn output_watermark(&self, watermark: i64) -> i64 {
        match watermark {
            i64::MAX => i64::MAX,
            w => w.saturating_sub(self.upper.max(0)),
        }
    }

    /// A batch of input `input` (0 left, 1 right): the pairs it completes.
    pub fn process(&mut self, input: usize, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let is_left = input == 0;
        let side = if is_left { &self.left } else { &self.right };
        let time_index = side.format.plan.time_index.ok_or_else(|| Error::Job(format!("{}: planned without event time", self.step)))?;
        let arrived = side.format.arrive(&batch, &self.step)?;
        let Some(times) = batch.column(time_index).as_primitive_opt::<Int64Type>() else {
            return Err(Error::Job(format!("{}: the event-time column is {}, not int64", self.step, batch.column(time_index).data_type())));
        };
        // Only after a rescaled restore do key groups differ in watermark.
        let groups = match self.restored.is_active() {
            true => Some(key_groups(&arrived.key_columns, batch.num_rows(), self.max_parallelism)?),
            false => None,
        };
        let mut pairs: Vec<Pair> = Vec::new();
        for r in 0..batch.num_rows() {
            if times.is_null(r) {
                return Err(Error::Record {
                    step: self.step.clone(),
                    message: "the event-time field is null: a join by time needs every record's time".into(),
                    record: record_json(&batch, r),
                    position: None,
                });
            }
            let t = times.value(r);
            let watermark = groups.as_ref().map_or(self.watermark, |g| self.restored.of(g[r], self.watermark));
            if t <= watermark {
                self.late += 1;
                continue;
            }
            let row: Box<[u8]> = arrived.rows.row(r).as_ref().into();
            // SQL's rule: a null key equals nothing, not even another null.
            if has_null_key(&arrived.key_columns, r) {
                if is_left && self.left_outer {
                    pairs.push((row, None));
                }
                continue;
            }
            let key = arrived.keys.row(r);
            if is_left {
                let from = t.saturating_add(self.lower);
                let to = t.saturating_add(self.upper);
                let before = pairs.len();
                for partner in self.right.matching(key.as_ref(), from..=to) {
                    pairs.push((row.clone(), Some(partner.row.clone())));
                }
                let matched = pairs.len() > before;
                if to > watermark {
                    self.left.insert(key.as_ref(), t, row, matched);
                } else if self.left_outer && !matched {
                    // No right record can come for it any more.
                    pairs.push((row, None));
                }
            } else {
                let from = t.saturating_sub(self.upper);
                let to = t.saturating_sub(self.lower);
                for partner in self.left.matching(key.as_ref(), from..=to) {
                    partner.matched = true;
                    pairs.push((partner.row.clone(), Some(row.clone())));
                }
                if to > watermark {
                    self.right.insert(key.as_ref(), t, row, false);
                }
            }
        }
        self.output(pairs)
    }

    /// The watermark advanced: rows no record can pair with any more go
    /// (a left outer join outputs its unmatched left rows then).
    pub fn on_watermark(&mut self, watermark: i64) -> Result<Option<RecordBatch>> {
        if watermark <= self.watermark {
            return Ok(None);
        }
        self.watermark = watermark;
        self.restored.forget_below(watermark);
        let gone = self.left.expire_through(watermark.saturating_sub(self.upper));
        self.right.expire_through(watermark.saturating_add(self.lower));
        if !self.left_outer {
            return Ok(None);
        }
        self.output(gone.into_iter().filter(|s| !s.matched).map(|s| (s.row, None)).collect())
    }

    fn output(&self, pairs: Vec<Pair>) -> Result<Option<RecordBatch>> {
        if pairs.is_empty() {
            return Ok(None);
        }
        let mut columns: Vec<ArrayRef> = self.left.format.columns(pairs.iter().map(|(l, _)| l.as_ref()), &self.step)?;
        let right: Vec<ArrayRef> = self.right.format.columns(pairs.iter().filter_map(|(_, r)| r.as_deref()), &self.step)?;
        if pairs.iter().all(|(_, r)| r.is_some()) {
            columns.extend(right);
        } else {
            // Rows without a partner take a null index: null right fields.
            let mut next = 0u32;
            let at: UInt32Array = pairs
                .iter()
                .map(|(_, r)| {
                    r.as_ref().map(|_| {
                        next += 1;
                        next - 1
                    })
                })
                .collect();
            for c in right {
                columns.push(arrow::compute::take(c.as_ref(), &at, None).map_err(Error::arrow(format!("{}: output", self.step)))?);
            }
        }
        RecordBatch::try_new(self.output_schema.clone(), columns).map(Some).map_err(Error::arrow(format!("{}: output", self.step)))
    }

    /// The ids the two sides are kept under.
    pub fn state_ids(&self) -> [String; 2] {
        [format!("{}.left", self.id), format!("{}.right", self.id)]
    }

    /// Copies of both sides, taken at the barrier.
    pub fn snapshot(&self) -> Vec<(String, SideCopy)> {
        let metadata: std::collections::HashMap<String, String> = [
            (WATERMARK_KEY.to_string(), self.watermark.to_string()),
            (restored_watermarks::KEY.to_string(), self.restored.encode(&self.groups, self.watermark)),
        ]
        .into();
        let [left, right] = self.state_ids();
        vec![
            (left, self.left.copy(metadata.clone(), self.max_parallelism)),
            (right, self.right.copy(metadata, self.max_parallelism)),
        ]
    }

    /// Loads one side's snapshot batch (`state_id` says which): the rows of
    /// this subtask's key groups, and their watermarks.
    pub fn restore(&mut self, state_id: &str, batch: &RecordBatch, location: &str) -> Result<()> {
        let side = if state_id.ends_with(".left") { &mut self.left } else { &mut self.right };
        let expected = side.snapshot_schema();
        let found = batch.schema();
        let watermark = found.metadata().get(WATERMARK_KEY).and_then(|w| w.parse::<i64>().ok());
        let (true, Some(watermark)) = (fits(&found, &expected), watermark) else {
            return Err(Error::BadCheckpoint {
                location: location.to_string(),
                message: format!(
                    "the state `{state_id}` ({}) does not fit this pipeline: the checkpoint has columns ({}) but the join now keeps ({}) and a watermark; give the changed step a new id to start its state fresh",
                    self.step,
                    describe(&found),
                    describe(&expected)
                ),
            });
        };
        let entries = match found.metadata().get(restored_watermarks::KEY) {
            Some(text) => restored_watermarks::parse(text).ok_or_else(|| Error::BadCheckpoint {
                location: location.to_string(),
                message: format!("the state `{state_id}` names its key groups' watermarks as `{text}`: expected `start-end:watermark` entries separated by `;`"),
            })?,
            None => vec![(0..=u32::MAX, watermark)],
        };
        side.restore(batch, &self.groups, self.max_parallelism, &self.step)?;
        self.restored.add(&self.groups, &entries);
        self.watermark = self.restored.lowest();
        self.restored.forget_below(self.watermark);
        Ok(())
    }
}
