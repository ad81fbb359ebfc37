//! Event-time windows per key (tumbling and sliding), fired by the watermark.
//!
//! A record with event time `t` belongs to every window `[start, start +
//! size)` with `start` a multiple of `slide` and `start <= t < start + size`.
//! State is one accumulator row per (window, key); a window fires when the
//! watermark reaches `end - 1` (every record it can hold has arrived, as the
//! watermark promises) and is dropped once the watermark passes `end - 1 +
//! allowed_lateness`. A record only for dropped windows is late: counted,
//! not processed. A record within the lateness updates its fired window,
//! which fires again with the new result (as Flink's event-time trigger does).
//!
//! The watermark itself is state: the subtask's last watermark is kept in
//! the snapshot (schema metadata `weir.watermark`), because after a restore
//! the inputs' watermarks arrive only with their first messages, and a record
//! that was late before the failure must be late again, or a window that
//! fired and was dropped would fire a second time. Every subtask of the
//! stage holds the same watermark at an aligned barrier (each gets every
//! upstream watermark before the barrier), so a rescaled restore loses nothing
//! by taking the largest.
//!
//! Snapshots are Arrow batches `(key_group, keys…, window_start, window_end,
//! fired, accumulators…)`, restored by key group like the running aggregates.

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Float64Builder, Int64Array, Int64Builder, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, UInt32Type};
use arrow::row::{RowConverter, SortField};

use super::record_json;
use super::running::{canonical_keys, describe};
use crate::error::{Error, Result};
use crate::key_group::{groups_of_subtask, key_groups};
use crate::plan::{WindowFn, WindowPlan};

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

const WATERMARK_KEY: &str = "weir.watermark";

/// One aggregate's accumulator. Sums and counts of int64 are checked.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Acc {
    Empty,
    I(i64),
    F(f64),
    /// Average: sum and count of the non-null values.
    Avg(f64, i64),
}

/// A window: (end, start), ordered by end so that firing walks a prefix.
type WindowKey = (i64, i64);

#[derive(Default)]
struct Pane {
    fired: bool,
    keys: FastMap<Box<[u8]>, Vec<Acc>>,
}

pub struct WindowAggregate {
    id: String,
    step: String,
    plan: WindowPlan,
    key_fields: Vec<Arc<Field>>,
    converter: RowConverter,
    output_schema: SchemaRef,
    max_parallelism: u32,
    groups: RangeInclusive<u32>,
    windows: BTreeMap<WindowKey, Pane>,
    watermark: i64,
    /// Records dropped as late since the last call of `take_late`.
    late: u64,
}

impl WindowAggregate {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        step: String,
        plan: &WindowPlan,
        input_schema: &SchemaRef,
        output_schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        max_parallelism: u32,
    ) -> Result<Self> {
        let key_fields: Vec<Arc<Field>> = plan.key_indices.iter().map(|&i| input_schema.fields()[i].clone()).collect();
        let converter = RowConverter::new(key_fields.iter().map(|f| SortField::new(f.data_type().clone())).collect())
            .map_err(Error::arrow(format!("{id}: key columns")))?;
        Ok(WindowAggregate {
            id,
            step,
            plan: plan.clone(),
            key_fields,
            converter,
            output_schema,
            max_parallelism,
            groups: groups_of_subtask(subtask, parallelism, max_parallelism),
            windows: BTreeMap::new(),
            watermark: i64::MIN,
            late: 0,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Late records dropped since the last call.
    pub fn take_late(&mut self) -> u64 {
        std::mem::take(&mut self.late)
    }

    fn is_dropped(&self, end: i64) -> bool {
        (end - 1).saturating_add(self.plan.allowed_lateness_ms) <= self.watermark
    }

    /// Adds a batch to its windows; returns the updated results of fired
    /// windows that late records (within the allowed lateness) changed.
    pub fn process(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let key_columns = canonical_keys(&self.plan.key_indices.iter().map(|&i| batch.column(i).clone()).collect::<Vec<_>>());
        let rows = self.converter.convert_columns(&key_columns).map_err(Error::arrow(format!("{}: keys", self.step)))?;
        let times = batch.column(self.plan.time_index).as_primitive::<Int64Type>();
        let (size, slide) = (self.plan.size_ms, self.plan.slide_ms);
        let mut refire: Vec<(WindowKey, Box<[u8]>)> = Vec::new();
        for r in 0..batch.num_rows() {
            if times.is_null(r) {
                return Err(Error::Record {
                    step: self.step.clone(),
                    message: "the event-time field is null: every record needs a time to be put in a window".into(),
                    record: record_json(&batch, r),
                    position: None,
                });
            }
            let t = times.value(r);
            let mut start = t - t.rem_euclid(slide);
            let mut taken = false;
            while start > t - size {
                let end = start + size;
                if !self.is_dropped(end) {
                    taken = true;
                    let key: Box<[u8]> = rows.row(r).as_ref().into();
                    let pane = self.windows.entry((end, start)).or_default();
                    let fired = pane.fired;
                    let accs = pane.keys.entry(key.clone()).or_insert_with(|| vec![Acc::Empty; self.plan.aggregates.len()]);
                    for (k, agg) in self.plan.aggregates.iter().enumerate() {
                        let value = match agg.input {
                            None => Acc::Empty,
                            Some(i) => value_at(batch.column(i), r),
                        };
                        accs[k] = update(agg.function, accs[k], value).ok_or_else(|| Error::Record {
                            step: self.step.clone(),
                            message: format!("the int64 {} of a window overflows", if agg.function == WindowFn::Count { "count" } else { "sum" }),
                            record: record_json(&batch, r),
                            position: None,
                        })?;
                    }
                    if fired {
                        refire.push(((end, start), key));
                    }
                }
                start -= slide;
            }
            if !taken {
                self.late += 1;
            }
        }
        if refire.is_empty() {
            return Ok(None);
        }
        refire.sort();
        refire.dedup();
        let mut out = Vec::with_capacity(refire.len());
        for (w, key) in refire {
            if let Some(accs) = self.windows.get(&w).and_then(|p| p.keys.get(&key)) {
                out.push((w, key, accs.clone()));
            }
        }
        self.results(out).map(Some)
    }

    /// The watermark advanced: fires the windows it completes and drops the
    /// ones past their lateness. Returns the results, if any.
    pub fn on_watermark(&mut self, watermark: i64) -> Result<Option<RecordBatch>> {
        if watermark <= self.watermark {
            return Ok(None);
        }
        self.watermark = watermark;
        let mut out = Vec::new();
        for (&(end, start), pane) in self.windows.range_mut(..=(watermark.saturating_add(1), i64::MAX)) {
            if pane.fired || end - 1 > watermark {
                continue;
            }
            pane.fired = true;
            for (key, accs) in &pane.keys {
                out.push(((end, start), key.clone(), accs.clone()));
            }
        }
        let lateness = self.plan.allowed_lateness_ms;
        self.windows.retain(|&(end, _), _| (end - 1).saturating_add(lateness) > watermark);
        if out.is_empty() {
            return Ok(None);
        }
        self.results(out).map(Some)
    }

    /// Output records: keys, window_start, window_end, aggregates.
    fn results(&self, rows: Vec<(WindowKey, Box<[u8]>, Vec<Acc>)>) -> Result<RecordBatch> {
        let ctx = || format!("{}: window results", self.step);
        let parser = self.converter.parser();
        let keys = self.converter.convert_rows(rows.iter().map(|(_, k, _)| parser.parse(k))).map_err(Error::arrow(ctx()))?;
        let mut columns: Vec<ArrayRef> = keys;
        columns.push(Arc::new(Int64Array::from_iter_values(rows.iter().map(|((_, s), _, _)| *s))));
        columns.push(Arc::new(Int64Array::from_iter_values(rows.iter().map(|((e, _), _, _)| *e))));
        for (k, agg) in self.plan.aggregates.iter().enumerate() {
            columns.push(result_column(agg.function, &agg.input_type, rows.iter().map(|(_, _, a)| a[k])));
        }
        RecordBatch::try_new(self.output_schema.clone(), columns).map_err(Error::arrow(ctx()))
    }

    fn snapshot_schema(&self) -> Schema {
        let mut fields = vec![Arc::new(Field::new("key_group", DataType::UInt32, false))];
        fields.extend(self.key_fields.iter().cloned());
        fields.push(Arc::new(Field::new("window_start", DataType::Int64, false)));
        fields.push(Arc::new(Field::new("window_end", DataType::Int64, false)));
        fields.push(Arc::new(Field::new("fired", DataType::Boolean, false)));
        for (k, agg) in self.plan.aggregates.iter().enumerate() {
            match agg.function {
                WindowFn::Avg => {
                    fields.push(Arc::new(Field::new(format!("acc{k}_sum"), DataType::Float64, true)));
                    fields.push(Arc::new(Field::new(format!("acc{k}_count"), DataType::Int64, true)));
                }
                WindowFn::Count => fields.push(Arc::new(Field::new(format!("acc{k}"), DataType::Int64, true))),
                _ => fields.push(Arc::new(Field::new(format!("acc{k}"), agg.input_type.clone(), true))),
            }
        }
        Schema::new(fields)
    }

    /// A copy of the state and the watermark, taken at the barrier.
    pub fn snapshot(&self) -> Result<RecordBatch> {
        let ctx = || format!("{}: snapshot", self.id);
        let entries: Vec<(&WindowKey, bool, &Box<[u8]>, &Vec<Acc>)> =
            self.windows.iter().flat_map(|(w, p)| p.keys.iter().map(move |(k, a)| (w, p.fired, k, a))).collect();
        let parser = self.converter.parser();
        let key_columns = self.converter.convert_rows(entries.iter().map(|(_, _, k, _)| parser.parse(k))).map_err(Error::arrow(ctx()))?;
        let groups = key_groups(&key_columns, entries.len(), self.max_parallelism)?;
        let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt32Array::from(groups))];
        columns.extend(key_columns);
        columns.push(Arc::new(Int64Array::from_iter_values(entries.iter().map(|((_, s), ..)| *s))));
        columns.push(Arc::new(Int64Array::from_iter_values(entries.iter().map(|((e, _), ..)| *e))));
        columns.push(Arc::new(BooleanArray::from(entries.iter().map(|(_, f, ..)| *f).collect::<Vec<_>>())));
        for (k, agg) in self.plan.aggregates.iter().enumerate() {
            let accs = entries.iter().map(|(.., a)| a[k]);
            match agg.function {
                WindowFn::Avg => {
                    let mut sums = Float64Builder::new();
                    let mut counts = Int64Builder::new();
                    for a in accs {
                        match a {
                            Acc::Avg(s, c) => {
                                sums.append_value(s);
                                counts.append_value(c);
                            }
                            _ => {
                                sums.append_null();
                                counts.append_null();
                            }
                        }
                    }
                    columns.push(Arc::new(sums.finish()));
                    columns.push(Arc::new(counts.finish()));
                }
                WindowFn::Count => columns.push(acc_column(&DataType::Int64, accs)),
                _ => columns.push(acc_column(&agg.input_type, accs)),
            }
        }
        let schema = self.snapshot_schema().with_metadata([(WATERMARK_KEY.to_string(), self.watermark.to_string())].into());
        RecordBatch::try_new(Arc::new(schema), columns).map_err(Error::arrow(ctx()))
    }

    /// Loads the rows of `batch` whose key group this subtask owns, and the
    /// watermark (the largest of the restored subtasks').
    pub fn restore(&mut self, batch: &RecordBatch, location: &str) -> Result<()> {
        let expected = self.snapshot_schema();
        let found = batch.schema();
        let same = found.fields().len() == expected.fields().len()
            && found.fields().iter().zip(expected.fields().iter()).all(|(a, b)| a.data_type() == b.data_type());
        let watermark = found.metadata().get(WATERMARK_KEY).and_then(|w| w.parse::<i64>().ok());
        let (true, Some(watermark)) = (same, watermark) else {
            return Err(Error::BadCheckpoint {
                location: location.to_string(),
                message: format!(
                    "the state of `{}` ({}) does not fit this pipeline: the checkpoint has columns ({}) but the window now keeps ({}) and a watermark; give the changed step a new id to start its state fresh",
                    self.id,
                    self.step,
                    describe(&found),
                    describe(&expected)
                ),
            });
        };
        self.watermark = self.watermark.max(watermark);
        let nkeys = self.key_fields.len();
        let key_columns = canonical_keys(&(1..=nkeys).map(|i| batch.column(i).clone()).collect::<Vec<_>>());
        let groups = batch.column(0).as_primitive::<UInt32Type>();
        let rows = self.converter.convert_columns(&key_columns).map_err(Error::arrow(format!("{}: restore", self.id)))?;
        let starts = batch.column(nkeys + 1).as_primitive::<Int64Type>();
        let ends = batch.column(nkeys + 2).as_primitive::<Int64Type>();
        let fired = batch.column(nkeys + 3).as_boolean();
        for r in 0..batch.num_rows() {
            if !self.groups.contains(&groups.value(r)) {
                continue;
            }
            let mut col = nkeys + 4;
            let mut accs = Vec::with_capacity(self.plan.aggregates.len());
            for agg in &self.plan.aggregates {
                if agg.function == WindowFn::Avg {
                    let (s, c) = (batch.column(col), batch.column(col + 1));
                    accs.push(if s.is_null(r) { Acc::Empty } else { Acc::Avg(s.as_primitive::<Float64Type>().value(r), c.as_primitive::<Int64Type>().value(r)) });
                    col += 2;
                } else {
                    accs.push(value_at(batch.column(col), r));
                    col += 1;
                }
            }
            let pane = self.windows.entry((ends.value(r), starts.value(r))).or_default();
            pane.fired |= fired.value(r);
            pane.keys.insert(rows.row(r).as_ref().into(), accs);
        }
        Ok(())
    }
}

fn value_at(col: &ArrayRef, r: usize) -> Acc {
    if col.is_null(r) {
        Acc::Empty
    } else if let Some(a) = col.as_primitive_opt::<Int64Type>() {
        Acc::I(a.value(r))
    } else {
        Acc::F(col.as_primitive::<Float64Type>().value(r))
    }
}

/// The accumulator after one more value; `None` on an int64 overflow.
fn update(function: WindowFn, acc: Acc, value: Acc) -> Option<Acc> {
    Some(match (function, acc, value) {
        (WindowFn::Count, Acc::I(n), _) => Acc::I(n.checked_add(1)?),
        (WindowFn::Count, _, _) => Acc::I(1),
        (_, a, Acc::Empty) => a,
        (WindowFn::Avg, Acc::Avg(s, c), v) => Acc::Avg(s + as_f64(v), c + 1),
        (WindowFn::Avg, _, v) => Acc::Avg(as_f64(v), 1),
        (_, Acc::Empty, v) => v,
        (WindowFn::Sum, Acc::I(a), Acc::I(v)) => Acc::I(a.checked_add(v)?),
        (WindowFn::Sum, Acc::F(a), Acc::F(v)) => Acc::F(a + v),
        (WindowFn::Min, Acc::I(a), Acc::I(v)) => Acc::I(a.min(v)),
        (WindowFn::Min, Acc::F(a), Acc::F(v)) => Acc::F(a.min(v)),
        (WindowFn::Max, Acc::I(a), Acc::I(v)) => Acc::I(a.max(v)),
        (WindowFn::Max, Acc::F(a), Acc::F(v)) => Acc::F(a.max(v)),
        (_, a, _) => a,
    })
}

fn as_f64(v: Acc) -> f64 {
    match v {
        Acc::I(i) => i as f64,
        Acc::F(f) => f,
        _ => 0.0,
    }
}

/// An accumulator column of int64 or float64 values (null for empty).
fn acc_column(ty: &DataType, accs: impl Iterator<Item = Acc>) -> ArrayRef {
    match ty {
        DataType::Float64 => {
            let mut b = Float64Builder::new();
            for a in accs {
                match a {
                    Acc::F(v) => b.append_value(v),
                    _ => b.append_null(),
                }
            }
            Arc::new(b.finish())
        }
        _ => {
            let mut b = Int64Builder::new();
            for a in accs {
                match a {
                    Acc::I(v) => b.append_value(v),
                    _ => b.append_null(),
                }
            }
            Arc::new(b.finish())
        }
    }
}

/// A result column: averages as float64, the rest as accumulated.
fn result_column(function: WindowFn, input_type: &DataType, accs: impl Iterator<Item = Acc>) -> ArrayRef {
    match function {
        WindowFn::Avg => {
            let mut b = Float64Builder::new();
            for a in accs {
                match a {
                    Acc::Avg(s, c) if c > 0 => b.append_value(s / c as f64),
                    _ => b.append_null(),
                }
            }
            Arc::new(b.finish())
        }
        WindowFn::Count => acc_column(&DataType::Int64, accs),
        _ => acc_column(input_type, accs),
    }
}

#[cfg(test)]
mod tests;
