//! The regular (unbounded) inner join: every pair of a left and a right
//! record of one key, output when the second of them arrives, whatever their
//! times. As both inputs are insert-only, so is the output (appends).
//!
//! Nothing in the input says when a key is done, so each record is kept a
//! time-to-live after it arrived, by processing time (Flink's state TTL,
//! `OnCreateAndWrite`): a record whose partner arrives later than `ttl`
//! after it pairs with nothing. Rows past their TTL go before every batch
//! and are left out of every snapshot; a restored row keeps the time it
//! arrived, so a restore does not make it younger. Which pairs form when a
//! partner comes near the TTL depends on the wall clock, so a replay after a
//! failure may pair differently there; well inside the TTL the join is exact.
//!
//! The snapshot is one batch per side (`<id>.left`, `<id>.right`):
//! `key_group`, the side's fields and `stored_unix_ms`.

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};

use super::super::running::{canonical_keys, describe};
use super::side::{fits, has_null_key, row_format, SideFormat};
use crate::error::{Error, Result};
use crate::key_group::{groups_of_subtask, key_groups};
use crate::plan::{JoinSide, RegularJoinPlan};

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;
/// A kept row: (arrival sequence, arrival time, row bytes).
type KeptRow = (u64, i64, Box<[u8]>);
/// A (left, right) pair of row bytes.
type Pair = (Box<[u8]>, Box<[u8]>);

/// Milliseconds since the Unix epoch; the join's notion of "now", a
/// function so that tests can move time.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The wall clock.
pub fn wall_clock() -> Clock {
    Arc::new(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64))
}

/// One input's kept rows: per key the rows with the time they arrived, and
/// an index by that time for expiry.
#[derive(Default)]
struct Kept {
    by_key: FastMap<Box<[u8]>, Vec<KeptRow>>,
    by_arrival: BTreeMap<(i64, u64), Box<[u8]>>,
    next: u64,
}

impl Kept {
    fn insert(&mut self, key: &[u8], stored: i64, row: Box<[u8]>) {
        let seq = self.next;
        self.next += 1;
        self.by_key.entry(key.into()).or_default().push((seq, stored, row));
        self.by_arrival.insert((stored, seq), key.into());
    }

    /// Removes the rows that arrived at or before `time`.
    fn expire_through(&mut self, time: i64) {
        let rest = match time.checked_add(1) {
            Some(after) => self.by_arrival.split_off(&(after, 0)),
            None => BTreeMap::new(),
        };
        for ((_, seq), key) in std::mem::replace(&mut self.by_arrival, rest) {
            if let Some(rows) = self.by_key.get_mut(&key) {
                rows.retain(|(s, ..)| *s != seq);
                if rows.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
    }

    fn len(&self) -> usize {
        self.by_arrival.len()
    }
}

pub struct RegularJoin {
    id: String,
    step: String,
    ttl_ms: i64,
    sides: [SideFormat; 2],
    kept: [Kept; 2],
    output_schema: SchemaRef,
    max_parallelism: u32,
    groups: RangeInclusive<u32>,
    clock: Clock,
}

impl RegularJoin {
    #[allow(clippy::too_many_arguments)]
    pub fn new(id: String, step: String, plan: &RegularJoinPlan, output_schema: SchemaRef, subtask: u32, parallelism: u32, max_parallelism: u32, clock: Clock) -> Result<Self> {
        Ok(RegularJoin {
            sides: [SideFormat::new(&plan.left, &step)?, SideFormat::new(&plan.right, &step)?],
            id,
            step,
            ttl_ms: plan.ttl_ms,
            kept: Default::default(),
            output_schema,
            max_parallelism,
            groups: groups_of_subtask(subtask, parallelism, max_parallelism),
            clock,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Rows kept, left and right.
    pub fn kept(&self) -> (usize, usize) {
        (self.kept[0].len(), self.kept[1].len())
    }

    /// A batch of input `input` (0 left, 1 right): the pairs it completes
    /// with the other side's rows that are still within their TTL.
    pub fn process(&mut self, input: usize, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let (this, other) = if input == 0 { (0, 1) } else { (1, 0) };
        let now = (self.clock)();
        let oldest_kept = now.saturating_sub(self.ttl_ms);
        for kept in &mut self.kept {
            kept.expire_through(oldest_kept);
        }
        let arrived = self.sides[this].arrive(&batch, &self.step)?;
        let mut pairs: Vec<Pair> = Vec::new();
        for r in 0..batch.num_rows() {
            if has_null_key(&arrived.key_columns, r) {
                continue;
            }
            let key = arrived.keys.row(r);
            let row: Box<[u8]> = arrived.rows.row(r).as_ref().into();
            for (_, _, partner) in self.kept[other].by_key.get(key.as_ref()).into_iter().flatten() {
                pairs.push(if this == 0 { (row.clone(), partner.clone()) } else { (partner.clone(), row.clone()) });
            }
            self.kept[this].insert(key.as_ref(), now, row);
        }
        if pairs.is_empty() {
            return Ok(None);
        }
        let mut columns = self.sides[0].columns(pairs.iter().map(|p| p.0.as_ref()), &self.step)?;
        columns.extend(self.sides[1].columns(pairs.iter().map(|p| p.1.as_ref()), &self.step)?);
        RecordBatch::try_new(self.output_schema.clone(), columns).map(Some).map_err(Error::arrow(format!("{}: output", self.step)))
    }

    /// The ids the two sides are kept under.
    pub fn state_ids(&self) -> [String; 2] {
        [format!("{}.left", self.id), format!("{}.right", self.id)]
    }

    fn snapshot_schema(side: &JoinSide) -> Schema {
        let mut fields = vec![Arc::new(Field::new("key_group", DataType::UInt32, false))];
        fields.extend(side.schema.fields().iter().cloned());
        fields.push(Arc::new(Field::new("stored_unix_ms", DataType::Int64, false)));
        Schema::new(fields)
    }

    /// Copies of both sides' rows within their TTL, made into snapshot
    /// batches by [`KeptCopy::into_batch`] outside the subtask's loop.
    pub fn snapshot(&self) -> Vec<(String, KeptCopy)> {
        let oldest_kept = (self.clock)().saturating_sub(self.ttl_ms);
        self.state_ids()
            .into_iter()
            .enumerate()
            .map(|(side, id)| {
                let rows = self.kept[side]
                    .by_key
                    .values()
                    .flatten()
                    .filter(|(_, stored, _)| *stored > oldest_kept)
                    .map(|(_, stored, row)| (*stored, row.clone()))
                    .collect();
                let plan = self.sides[side].plan.clone();
                let schema = Arc::new(Self::snapshot_schema(&plan));
                (id, KeptCopy { rows, plan, schema, max_parallelism: self.max_parallelism })
            })
            .collect()
    }

    /// Loads one side's snapshot batch (`state_id` says which): the rows of
    /// this subtask's key groups, with the time each arrived.
    pub fn restore(&mut self, state_id: &str, batch: &RecordBatch, location: &str) -> Result<()> {
        let side = if state_id.ends_with(".left") { 0 } else { 1 };
        let expected = Self::snapshot_schema(&self.sides[side].plan);
        let found = batch.schema();
        if !fits(&found, &expected) {
            return Err(Error::BadCheckpoint {
                location: location.to_string(),
                message: format!(
                    "the state `{state_id}` ({}) does not fit this pipeline: the checkpoint has columns ({}) but the join now keeps ({}); give the changed step a new id to start its state fresh",
                    self.step,
                    describe(&found),
                    describe(&expected)
                ),
            });
        }
        let (input, arrived) = self.sides[side].restored(batch, 1, &self.step)?;
        let of = key_groups(&arrived.key_columns, input.num_rows(), self.max_parallelism)?;
        let stored = batch.column(batch.num_columns() - 1).as_primitive::<Int64Type>();
        for r in 0..input.num_rows() {
            if self.groups.contains(&of[r]) {
                self.kept[side].insert(arrived.keys.row(r).as_ref(), stored.value(r), arrived.rows.row(r).as_ref().into());
            }
        }
        Ok(())
    }
}

/// One side's rows of a regular join as copied at a barrier.
pub struct KeptCopy {
    rows: Vec<(i64, Box<[u8]>)>,
    plan: JoinSide,
    schema: SchemaRef,
    max_parallelism: u32,
}

impl KeptCopy {
    pub fn into_batch(self, context: &str) -> Result<RecordBatch> {
        let format = row_format(&self.plan.schema, context)?;
        let parser = format.parser();
        let columns = format.convert_rows(self.rows.iter().map(|(_, r)| parser.parse(r))).map_err(Error::arrow(format!("{context}: snapshot")))?;
        let keys = canonical_keys(&self.plan.key_indices.iter().map(|&i| columns[i].clone()).collect::<Vec<_>>());
        let groups = key_groups(&keys, self.rows.len(), self.max_parallelism)?;
        let mut out: Vec<ArrayRef> = vec![Arc::new(UInt32Array::from(groups))];
        out.extend(columns);
        out.push(Arc::new(Int64Array::from_iter_values(self.rows.iter().map(|r| r.0))));
        RecordBatch::try_new(self.schema, out).map_err(Error::arrow(format!("{context}: snapshot")))
    }
}
