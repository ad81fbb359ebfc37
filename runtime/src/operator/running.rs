//! Keyed running aggregates (count, sum, min, max): each record gets the
//! aggregate of its key so far, itself included.
//!
//! State is a hash map from key to accumulator. A single non-null int64 key
//! (the common case) is stored as the integer itself; any other key is stored
//! in Arrow's row format, which is compact and hashable; float key columns
//! are made canonical first (-0.0 is 0.0, one NaN), as for key groups, so that
//! values that are equal as keys are one key. Snapshots are Arrow record
//! batches `(key_group, key columns..., acc)`, so a restore at another
//! parallelism keeps exactly the key groups of its range.
//!
//! Int64 counts and sums are checked: an overflow fails the job with an error
//! naming the step, the key and the record, never a wrapped number. Float
//! sums follow IEEE arithmetic (they reach infinity, not a wrong value).

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Float64Array, Int64Array, RecordBatch, UInt32Array};
use arrow::buffer::NullBuffer;
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, UInt32Type};
use arrow::row::{RowConverter, SortField};

use super::{StateCopy, record_json};
use crate::error::{Error, Result};
use crate::key_group::{canonical_f64, groups_of_subtask, key_groups};
use crate::plan::{AggFn, RunningPlan};

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Acc {
    Empty,
    I(i64),
    F(f64),
}

/// A key's accumulator and the generation (see [`RunningAggregate::cut`])
/// in which it last changed: what an incremental snapshot selects by.
#[derive(Clone, Copy, Debug)]
struct Entry {
    acc: Acc,
    changed: u32,
}

impl Entry {
    const EMPTY: Entry = Entry { acc: Acc::Empty, changed: 0 };
}

/// Keys copied at a barrier: int64 keys as they are (an array is made of
/// them later), any other key already as key columns.
enum KeyCopy {
    Int64(Vec<i64>),
    Columns(Vec<ArrayRef>),
}

enum KeyTable {
    Int64(FastMap<i64, Entry>),
    Rows { converter: RowConverter, map: FastMap<Box<[u8]>, Entry> },
}

pub struct RunningAggregate {
    id: String,
    /// The step's field in the pipeline, e.g. `steps[2].running_sum`.
    step: String,
    key_indices: Vec<usize>,
    key_fields: Vec<Arc<Field>>,
    function: AggFn,
    input: Option<usize>,
    output_type: DataType,
    output_schema: SchemaRef,
    max_parallelism: u32,
    groups: RangeInclusive<u32>,
    table: KeyTable,
    /// Entries changed from now on are marked with this.
    generation: u32,
}

impl RunningAggregate {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        step: String,
        plan: &RunningPlan,
        input_schema: &SchemaRef,
        output_schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        max_parallelism: u32,
    ) -> Result<Self> {
        let key_fields: Vec<Arc<Field>> = plan.key_indices.iter().map(|&i| input_schema.fields()[i].clone()).collect();
        let table = if key_fields.len() == 1 && key_fields[0].data_type() == &DataType::Int64 && !key_fields[0].is_nullable() {
            KeyTable::Int64(FastMap::default())
        } else {
            let converter = RowConverter::new(key_fields.iter().map(|f| SortField::new(f.data_type().clone())).collect())
                .map_err(Error::arrow(format!("{id}: key columns")))?;
            KeyTable::Rows { converter, map: FastMap::default() }
        };
        Ok(RunningAggregate {
            id,
            step,
            key_indices: plan.key_indices.clone(),
            key_fields,
            function: plan.function,
            input: plan.input,
            output_type: plan.output_type.clone(),
            output_schema,
            max_parallelism,
            groups: groups_of_subtask(subtask, parallelism, max_parallelism),
            table,
            generation: 1,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn key_count(&self) -> usize {
        match &self.table {
            KeyTable::Int64(m) => m.len(),
            KeyTable::Rows { map, .. } => map.len(),
        }
    }

    /// The accumulator after one more record with `value`; `None` when an
    /// int64 count or sum would overflow.
    fn update(function: AggFn, acc: Acc, value: Acc) -> Option<Acc> {
        Some(match (function, acc, value) {
            (AggFn::Count, Acc::I(n), _) => Acc::I(n.checked_add(1)?),
            (AggFn::Count, _, _) => Acc::I(1),
            (_, a, Acc::Empty) => a,
            (_, Acc::Empty, v) => v,
            (AggFn::Sum, Acc::I(a), Acc::I(v)) => Acc::I(a.checked_add(v)?),
            (AggFn::Sum, Acc::F(a), Acc::F(v)) => Acc::F(a + v),
            (AggFn::Min, Acc::I(a), Acc::I(v)) => Acc::I(a.min(v)),
            (AggFn::Min, Acc::F(a), Acc::F(v)) => Acc::F(a.min(v)),
            (AggFn::Max, Acc::I(a), Acc::I(v)) => Acc::I(a.max(v)),
            (AggFn::Max, Acc::F(a), Acc::F(v)) => Acc::F(a.max(v)),
            (_, a, _) => a,
        })
    }

    /// Two accumulators of one key combined (a restore meeting a key twice);
    /// `None` on int64 overflow.
    fn merge(function: AggFn, a: Acc, b: Acc) -> Option<Acc> {
        match (function, a, b) {
            (AggFn::Count, Acc::I(x), Acc::I(y)) => Some(Acc::I(x.checked_add(y)?)),
            (AggFn::Count, x, Acc::Empty) | (AggFn::Count, Acc::Empty, x) => Some(x),
            _ => Self::update(function, a, b),
        }
    }

    /// Appends the aggregate column to the batch.
    pub fn process(&mut self, batch: RecordBatch) -> Result<RecordBatch> {
        let n = batch.num_rows();
        let values: Box<dyn Fn(usize) -> Acc> = match self.input {
            None => Box::new(|_| Acc::Empty),
            Some(i) => {
                let col = batch.column(i).clone();
                match col.data_type() {
                    DataType::Int64 => Box::new(move |r| {
                        let a = col.as_primitive::<Int64Type>();
                        if a.is_null(r) { Acc::Empty } else { Acc::I(a.value(r)) }
                    }),
                    _ => Box::new(move |r| {
                        let a = col.as_primitive::<Float64Type>();
                        if a.is_null(r) { Acc::Empty } else { Acc::F(a.value(r)) }
                    }),
                }
            }
        };
        let f = self.function;
        let (step, key_indices) = (&self.step, &self.key_indices);
        let overflow = |r: usize, acc: Acc| overflow_error(step, key_indices, &batch, r, acc, values(r));
        let mut out = Vec::with_capacity(n);
        match &mut self.table {
            KeyTable::Int64(map) => {
                let keys = batch.column(self.key_indices[0]).as_primitive::<Int64Type>();
                for (r, k) in keys.values().iter().enumerate() {
                    let e = map.entry(*k).or_insert(Entry::EMPTY);
                    e.acc = Self::update(f, e.acc, values(r)).ok_or_else(|| overflow(r, e.acc))?;
                    e.changed = self.generation;
                    out.push(e.acc);
                }
            }
            KeyTable::Rows { converter, map } => {
                let cols: Vec<ArrayRef> = self.key_indices.iter().map(|&i| batch.column(i).clone()).collect();
                let rows = converter.convert_columns(&canonical_keys(&cols)).map_err(Error::arrow(format!("{}: keys", self.id)))?;
                for r in 0..n {
                    let key = rows.row(r);
                    let e = match map.get_mut(key.as_ref()) {
                        Some(e) => e,
                        None => map.entry(key.as_ref().into()).or_insert(Entry::EMPTY),
                    };
                    e.acc = Self::update(f, e.acc, values(r)).ok_or_else(|| overflow(r, e.acc))?;
                    e.changed = self.generation;
                    out.push(e.acc);
                }
            }
        }
        let column = accs_to_array(&self.output_type, &out);
        let mut columns = batch.columns().to_vec();
        columns.push(column);
        RecordBatch::try_new(self.output_schema.clone(), columns).map_err(Error::arrow(format!("{}: output", self.id)))
    }

    fn snapshot_schema(&self) -> SchemaRef {
        let mut fields = vec![Arc::new(Field::new("key_group", DataType::UInt32, false))];
        fields.extend(self.key_fields.iter().cloned());
        fields.push(Arc::new(Field::new("acc", self.output_type.clone(), true)));
        Arc::new(Schema::new(fields))
    }

    /// The whole state as a snapshot batch.
    pub fn snapshot(&self) -> Result<RecordBatch> {
        self.snapshot_changed_after(None)
    }

    /// Ends the current generation: entries changed until now carry the
    /// returned number, entries changed later a greater one.
    pub fn cut(&mut self) -> u32 {
        let g = self.generation;
        self.generation += 1;
        g
    }

    /// The entries changed in generations after `after` (all with `None`):
    /// an incremental snapshot, applied over the snapshots before it.
    pub fn snapshot_changed_after(&self, after: Option<u32>) -> Result<RecordBatch> {
        self.copy_changed_after(after)?.into_batch()
    }

    /// The synchronous part of [`Self::snapshot_changed_after`], taken at
    /// the barrier: one pass over the map copying keys and accumulators.
    /// Key groups and Arrow arrays are made from the copy later, in the
    /// snapshot's asynchronous task, so that processing waits only for the
    /// copy (a third of the whole with int64 keys).
    pub fn copy_changed_after(&self, after: Option<u32>) -> Result<StateCopy> {
        let ctx = move |id: &str| format!("{id}: snapshot");
        let selected = |e: &Entry| after.is_none_or(|a| e.changed > a);
        let (key_columns, accs): (KeyCopy, Vec<Acc>) = match &self.table {
            KeyTable::Int64(map) => {
                let mut keys = Vec::with_capacity(map.len());
                let mut accs = Vec::with_capacity(map.len());
                for (k, e) in map.iter().filter(|(_, e)| selected(e)) {
                    keys.push(*k);
                    accs.push(e.acc);
                }
                (KeyCopy::Int64(keys), accs)
            }
            KeyTable::Rows { converter, map } => {
                // Row keys borrow from the map: they become arrays now.
                let parser = converter.parser();
                let mut rows = Vec::with_capacity(map.len());
                let mut accs = Vec::with_capacity(map.len());
                for (k, e) in map.iter().filter(|(_, e)| selected(e)) {
                    rows.push(parser.parse(k));
                    accs.push(e.acc);
                }
                (KeyCopy::Columns(converter.convert_rows(rows).map_err(Error::arrow(ctx(&self.id)))?), accs)
            }
        };
        let (id, schema, output_type, max_parallelism) = (self.id.clone(), self.snapshot_schema(), self.output_type.clone(), self.max_parallelism);
        Ok(StateCopy::deferred(move || {
            let key_columns = match key_columns {
                KeyCopy::Int64(keys) => vec![Arc::new(Int64Array::from(keys)) as ArrayRef],
                KeyCopy::Columns(columns) => columns,
            };
            let groups = key_groups(&key_columns, accs.len(), max_parallelism)?;
            let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt32Array::from(groups))];
            columns.extend(key_columns);
            columns.push(accs_to_array(&output_type, &accs));
            RecordBatch::try_new(schema, columns).map_err(Error::arrow(ctx(&id)))
        }))
    }

    /// Loads the rows of `batch` whose key group this subtask owns. State that
    /// does not fit the step is an unusable checkpoint (`location`): every
    /// restore of it would fail alike. The rows of an incremental snapshot
    /// (`changes`) replace what an earlier one of the chain held.
    pub fn restore(&mut self, batch: &RecordBatch, location: &str, changes: bool) -> Result<()> {
        let expected = self.snapshot_schema();
        let found = batch.schema();
        let same = found.fields().len() == expected.fields().len()
            && found.fields().iter().zip(expected.fields().iter()).all(|(a, b)| a.data_type() == b.data_type());
        if !same {
            return Err(Error::BadCheckpoint {
                location: location.to_string(),
                message: format!(
                    "the state of `{}` ({}) does not fit this pipeline: the checkpoint has columns ({}) but the step now keeps ({}); give the changed step a new id to start its state fresh",
                    self.id,
                    self.step,
                    describe(&found),
                    describe(&expected)
                ),
            });
        }
        let nkeys = self.key_fields.len();
        let key_columns: Vec<ArrayRef> = canonical_keys(&(1..=nkeys).map(|i| batch.column(i).clone()).collect::<Vec<_>>());
        // Checkpoints from before float keys were made canonical may hold a
        // -0.0 or NaN key under the group of its old hash: the groups of float
        // keys are computed again rather than read.
        let recomputed;
        let groups: &[u32] = if self.key_fields.iter().any(|f| f.data_type() == &DataType::Float64) {
            recomputed = key_groups(&key_columns, batch.num_rows(), self.max_parallelism)?;
            &recomputed[..]
        } else {
            &batch.column(0).as_primitive::<UInt32Type>().values()[..]
        };
        let acc_col = batch.column(nkeys + 1);
        let acc_at = |r: usize| -> Acc {
            if acc_col.is_null(r) {
                Acc::Empty
            } else if let Some(a) = acc_col.as_primitive_opt::<Int64Type>() {
                Acc::I(a.value(r))
            } else {
                Acc::F(acc_col.as_primitive::<Float64Type>().value(r))
            }
        };
        let f = self.function;
        let too_big = |r: usize| Error::BadCheckpoint {
            location: location.to_string(),
            message: format!("the state of `{}` has two entries of one key that together overflow int64 (row {r})", self.id),
        };
        match &mut self.table {
            KeyTable::Int64(map) => {
                let keys = key_columns[0].as_primitive::<Int64Type>();
                for r in 0..batch.num_rows() {
                    if self.groups.contains(&groups[r]) {
                        map.insert(keys.value(r), Entry { acc: acc_at(r), changed: 0 });
                    }
                }
            }
            KeyTable::Rows { converter, map } => {
                let rows = converter.convert_columns(&key_columns).map_err(Error::arrow(format!("{}: restore", self.id)))?;
                for r in 0..batch.num_rows() {
                    if self.groups.contains(&groups[r]) {
                        // -0.0 and 0.0 were two keys in older checkpoints; now
                        // they are one, holding what both had counted.
                        let acc = match map.get(rows.row(r).as_ref()) {
                            Some(old) if !changes => Self::merge(f, old.acc, acc_at(r)).ok_or_else(|| too_big(r))?,
                            _ => acc_at(r),
                        };
                        map.insert(rows.row(r).as_ref().into(), Entry { acc, changed: 0 });
                    }
                }
            }
        }
        Ok(())
    }
}

/// The error for an int64 overflow at row `r`: the step, the key, the
/// numbers and the record. The same record overflows after every restore, so
/// the job stops instead of publishing a wrapped number.
fn overflow_error(step: &str, key_indices: &[usize], batch: &RecordBatch, r: usize, acc: Acc, value: Acc) -> Error {
    let key = batch.project(key_indices).map(|k| record_json(&k, r)).unwrap_or_else(|_| "?".into());
    let message = match (acc, value) {
        (Acc::I(a), Acc::I(v)) => format!("the int64 sum of key {key} overflows: {a} + {v} is out of range"),
        (Acc::I(a), _) => format!("the int64 count of key {key} overflows at {a} + 1"),
        _ => format!("the int64 aggregate of key {key} overflows"),
    };
    Error::Record { step: step.to_string(), message, record: record_json(batch, r), position: None }
}

/// Key columns with float values made canonical (see the module comment).
pub(super) fn canonical_keys(columns: &[ArrayRef]) -> Vec<ArrayRef> {
    columns
        .iter()
        .map(|c| match c.as_primitive_opt::<Float64Type>() {
            Some(a) => Arc::new(a.unary::<_, Float64Type>(canonical_f64)) as ArrayRef,
            None => c.clone(),
        })
        .collect()
}

pub(super) fn describe(s: &Schema) -> String {
    s.fields().iter().map(|f| format!("{} {}", f.name(), f.data_type())).collect::<Vec<_>>().join(", ")
}

/// The accumulators as an Arrow column, null where empty. Built from plain
/// vectors rather than a builder: this runs for every batch processed and
/// every snapshot, and a loop the compiler can vectorize is several times
/// faster than appending value by value.
fn accs_to_array(ty: &DataType, accs: &[Acc]) -> ArrayRef {
    let nulls = accs.iter().any(|a| matches!(a, Acc::Empty)).then(|| NullBuffer::from_iter(accs.iter().map(|a| !matches!(a, Acc::Empty))));
    match ty {
        DataType::Float64 => {
            let values: Vec<f64> = accs
                .iter()
                .map(|a| match *a {
                    Acc::F(v) => v,
                    Acc::I(v) => v as f64,
                    Acc::Empty => 0.0,
                })
                .collect();
            Arc::new(Float64Array::new(values.into(), nulls))
        }
        _ => {
            let values: Vec<i64> = accs
                .iter()
                .map(|a| match *a {
                    Acc::I(v) => v,
                    Acc::F(v) => v as i64,
                    Acc::Empty => 0,
                })
                .collect();
            Arc::new(Int64Array::new(values.into(), nulls))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, StringArray};

    fn gen_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("key", DataType::Int64, false),
            Field::new("value", DataType::Int64, false),
        ]))
    }

    fn count_op(subtask: u32, parallelism: u32) -> RunningAggregate {
        let out = Arc::new(Schema::new(vec![
            Field::new("key", DataType::Int64, false),
            Field::new("value", DataType::Int64, false),
            Field::new("count", DataType::Int64, false),
        ]));
        let plan = RunningPlan { key_indices: vec![0], function: AggFn::Count, input: None, output_type: DataType::Int64 };
        RunningAggregate::new("c".into(), "steps[1].running_count".into(), &plan, &gen_schema(), out, subtask, parallelism, 16).unwrap()
    }

    fn batch(keys: Vec<i64>) -> RecordBatch {
        let n = keys.len() as i64;
        RecordBatch::try_new(gen_schema(), vec![Arc::new(Int64Array::from(keys)), Arc::new(Int64Array::from_iter_values(0..n))]).unwrap()
    }

    fn counts(b: &RecordBatch) -> Vec<i64> {
        b.column(2).as_primitive::<Int64Type>().values().to_vec()
    }

    #[test]
    fn count_numbers_each_keys_records_from_one() {
        let mut op = count_op(0, 1);
        let out = op.process(batch(vec![1, 2, 1, 1, 2])).unwrap();
        assert_eq!(counts(&out), vec![1, 1, 2, 3, 2]);
        let out = op.process(batch(vec![2, 3])).unwrap();
        assert_eq!(counts(&out), vec![3, 1]);
    }

    #[test]
    fn an_incremental_snapshot_holds_only_the_keys_changed_since_the_one_it_builds_on() {
        let mut op = count_op(0, 1);
        op.process(batch((0..100).collect())).unwrap();
        let first = op.cut();
        let full = op.snapshot_changed_after(None).unwrap();
        assert_eq!(full.num_rows(), 100);
        op.process(batch(vec![3, 7, 3])).unwrap();
        let second = op.cut();
        let changes = op.snapshot_changed_after(Some(first)).unwrap();
        assert_eq!(changes.num_rows(), 2, "keys 3 and 7 changed");
        // The file of `changes` was lost: the next one builds on `first` again.
        op.process(batch(vec![50])).unwrap();
        op.cut();
        assert_eq!(op.snapshot_changed_after(Some(first)).unwrap().num_rows(), 3);
        assert_eq!(op.snapshot_changed_after(Some(second)).unwrap().num_rows(), 1);
        // The full snapshot and then the changes give the state back.
        let mut restored = count_op(0, 1);
        restored.restore(&full, "chk-1", false).unwrap();
        restored.restore(&changes, "chk-2", true).unwrap();
        let out = restored.process(batch(vec![3, 7, 8])).unwrap();
        assert_eq!(counts(&out), vec![4, 3, 2]);
    }

    #[test]
    fn a_snapshot_restored_at_another_parallelism_keeps_every_count_once() {
        let mut op = count_op(0, 1);
        let keys: Vec<i64> = (0..200).map(|i| i % 50).collect();
        op.process(batch(keys)).unwrap();
        let snap = op.snapshot().unwrap();
        let mut restored = Vec::new();
        for s in 0..3 {
            let mut o = count_op(s, 3);
            o.restore(&snap, "chk-1", false).unwrap();
            restored.push(o);
        }
        assert_eq!(restored.iter().map(|o| o.key_count()).sum::<usize>(), 50);
        // Every key continues at 5 in whichever subtask owns it.
        for k in 0..50i64 {
            let groups = key_groups(&[Arc::new(Int64Array::from(vec![k])) as ArrayRef], 1, 16).unwrap();
            let owner = crate::key_group::subtask_for_group(groups[0], 3, 16) as usize;
            let out = restored[owner].process(batch(vec![k])).unwrap();
            assert_eq!(counts(&out), vec![5], "key {k}");
        }
    }

    #[test]
    fn string_keys_use_the_row_format_and_survive_a_snapshot() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, true), Field::new("v", DataType::Float64, true)]));
        let out = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("v", DataType::Float64, true),
            Field::new("m", DataType::Float64, true),
        ]));
        let plan = RunningPlan { key_indices: vec![0], function: AggFn::Max, input: Some(1), output_type: DataType::Float64 };
        let mut op = RunningAggregate::new("m".into(), "steps[1].running_max".into(), &plan, &schema, out.clone(), 0, 1, 8).unwrap();
        let b = RecordBatch::try_new(schema.clone(), vec![
            Arc::new(StringArray::from(vec!["a", "b", "a"])),
            Arc::new(Float64Array::from(vec![Some(1.0), None, Some(0.5)])),
        ]).unwrap();
        let r = op.process(b.clone()).unwrap();
        let m = r.column(2).as_primitive::<Float64Type>();
        assert_eq!((m.value(0), m.is_null(1), m.value(2)), (1.0, true, 1.0));
        let mut again = RunningAggregate::new("m".into(), "steps[1].running_max".into(), &plan, &schema, out, 0, 1, 8).unwrap();
        again.restore(&op.snapshot().unwrap(), "chk-1", false).unwrap();
        let r = again.process(b).unwrap();
        assert_eq!(r.column(2).as_primitive::<Float64Type>().value(0), 1.0);
    }

    fn sum_op(key_type: DataType) -> (RunningAggregate, SchemaRef) {
        let schema = Arc::new(Schema::new(vec![Field::new("k", key_type.clone(), false), Field::new("v", DataType::Int64, true)]));
        let out = Arc::new(Schema::new(vec![
            Field::new("k", key_type, false),
            Field::new("v", DataType::Int64, true),
            Field::new("total", DataType::Int64, true),
        ]));
        let plan = RunningPlan { key_indices: vec![0], function: AggFn::Sum, input: Some(1), output_type: DataType::Int64 };
        (RunningAggregate::new("s".into(), "steps[1].running_sum".into(), &plan, &schema, out, 0, 1, 8).unwrap(), schema)
    }

    #[test]
    fn an_int64_sum_that_overflows_is_an_error_naming_the_step_and_key_not_a_wrapped_number() {
        for key_type in [DataType::Int64, DataType::Utf8] {
            let (mut op, schema) = sum_op(key_type.clone());
            let keys: ArrayRef = match key_type {
                DataType::Int64 => Arc::new(Int64Array::from(vec![7, 7])),
                _ => Arc::new(StringArray::from(vec!["seven", "seven"])),
            };
            let b = RecordBatch::try_new(schema, vec![keys, Arc::new(Int64Array::from(vec![i64::MAX, 1]))]).unwrap();
            let err = op.process(b).unwrap_err();
            assert!(err.is_fatal(), "{err}");
            let text = err.to_string();
            assert!(text.starts_with("steps[1].running_sum: "), "{text}");
            assert!(text.contains("9223372036854775807 + 1"), "{text}");
            let (key, record) = match key_type {
                DataType::Int64 => (r#"{"k":7}"#, r#"{"k":7,"v":1}"#),
                _ => (r#"{"k":"seven"}"#, r#"{"k":"seven","v":1}"#),
            };
            assert!(text.contains(&format!("key {key}")), "{text}");
            assert!(text.contains(&format!("the record: {record}")), "{text}");
        }
    }

    #[test]
    fn a_count_can_reach_the_largest_int64_but_not_beyond() {
        assert_eq!(RunningAggregate::update(AggFn::Count, Acc::I(i64::MAX - 1), Acc::Empty), Some(Acc::I(i64::MAX)));
        assert_eq!(RunningAggregate::update(AggFn::Count, Acc::I(i64::MAX), Acc::Empty), None);
        assert_eq!(RunningAggregate::update(AggFn::Sum, Acc::I(i64::MIN), Acc::I(-1)), None);
        assert_eq!(RunningAggregate::update(AggFn::Sum, Acc::F(f64::MAX), Acc::F(f64::MAX)), Some(Acc::F(f64::INFINITY)));
    }

    fn float_count_op() -> (RunningAggregate, SchemaRef) {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Float64, true)]));
        let out = Arc::new(Schema::new(vec![Field::new("k", DataType::Float64, true), Field::new("n", DataType::Int64, false)]));
        let plan = RunningPlan { key_indices: vec![0], function: AggFn::Count, input: None, output_type: DataType::Int64 };
        (RunningAggregate::new("n".into(), "steps[1].running_count".into(), &plan, &schema, out, 0, 1, 8).unwrap(), schema)
    }

    fn float_counts(op: &mut RunningAggregate, schema: &SchemaRef, keys: Vec<f64>) -> Vec<i64> {
        let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(Float64Array::from(keys))]).unwrap();
        op.process(b).unwrap().column(1).as_primitive::<Int64Type>().values().to_vec()
    }

    #[test]
    fn negative_zero_and_zero_are_one_key_and_so_are_all_nans() {
        let (mut op, schema) = float_count_op();
        let other_nan = f64::from_bits(0xfff8_0000_0000_0001);
        assert_eq!(float_counts(&mut op, &schema, vec![0.0, -0.0, f64::NAN, other_nan, -0.0, 1.0]), vec![1, 2, 1, 2, 3, 1]);
        assert_eq!(op.key_count(), 3);
        // Also after a snapshot and a restore.
        let (mut again, _) = float_count_op();
        again.restore(&op.snapshot().unwrap(), "chk-1", false).unwrap();
        assert_eq!(float_counts(&mut again, &schema, vec![-0.0, f64::NAN]), vec![4, 3]);
    }

    #[test]
    fn an_old_checkpoint_with_negative_zero_and_zero_as_two_keys_restores_them_as_one() {
        // Written before keys were canonical: -0.0 under the group of its own bits.
        let raw_group = |v: f64| (xxhash_rust::xxh3::xxh3_64_with_seed(&v.to_bits().to_le_bytes(), 0) % 8) as u32;
        let (op, schema) = float_count_op();
        let snapshot = RecordBatch::try_new(op.snapshot_schema(), vec![
            Arc::new(UInt32Array::from(vec![raw_group(0.0), raw_group(-0.0)])),
            Arc::new(Float64Array::from(vec![0.0, -0.0])),
            Arc::new(Int64Array::from(vec![2, 3])),
        ])
        .unwrap();
        let (mut restored, _) = float_count_op();
        restored.restore(&snapshot, "chk-1", false).unwrap();
        assert_eq!(restored.key_count(), 1);
        assert_eq!(float_counts(&mut restored, &schema, vec![-0.0]), vec![6]);
    }

    #[test]
    fn state_that_does_not_fit_the_step_is_an_unusable_checkpoint() {
        let mut counting = count_op(0, 1);
        counting.process(batch(vec![1, 2])).unwrap();
        let (mut floats, _) = float_count_op();
        let err = floats.restore(&counting.snapshot().unwrap(), "state/job/checkpoints/chk-3", false).unwrap_err();
        assert!(matches!(err, Error::BadCheckpoint { .. }) && err.is_fatal(), "{err}");
        let text = err.to_string();
        assert!(text.contains("chk-3") && text.contains("steps[1].running_count") && text.contains("new id"), "{text}");
    }
}
