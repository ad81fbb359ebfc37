//! Event-time windows per key (tumbling, sliding, session), fired by the watermark.
//!
//! A record with event time `t` belongs to every window `[start, start +
//! size)` with `start` a multiple of `slide` and `start <= t < start + size`;
//! with sessions, to `[t, t + gap)` merged with every session of its key
//! that it overlaps (their accumulators combined, as Flink's merging
//! windows do; unlike Flink, sessions that only touch stay apart, so that
//! results never depend on when the watermark came: `assign::session_of`).
//! State is one accumulator row per (window, key); a window fires when the
//! watermark reaches `end - 1` (every record it can hold has arrived, as the
//! watermark promises) and is dropped once the watermark passes `end - 1 +
//! allowed_lateness`. A record only for dropped windows is late: counted,
//! not processed. A record within the lateness updates its fired window,
//! which fires again with the new result (as Flink's event-time trigger does).
//!
//! The watermark itself is state: the subtask's last watermark is kept in
//! the snapshot (schema metadata `weir.watermark`, and per key group
//! `weir.key_group_watermarks`), because after a restore the inputs'
//! watermarks arrive only with their first messages, and a record that was
//! late before the failure must be late again, or a window that fired and
//! was dropped would fire a second time. A rescaled restore judges each key
//! group by the watermark it had ([`restored_watermarks`]).
//!
//! Snapshots are Arrow batches `(key_group, keys…, window_start, window_end,
//! fired, accumulators…)`, restored by key group like the running aggregates.

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Float64Builder, Int64Array, Int64Builder, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, UInt32Type};
use arrow::row::{RowConverter, SortField};

use super::assign::{fixed_windows, session_of, WindowKey};
use super::record_json;
use super::running::{canonical_keys, describe};
use crate::error::{Error, Result};
use crate::key_group::{groups_of_subtask, key_groups};
use crate::plan::{WindowFn, WindowPlan};

use super::restored_watermarks::{self, RestoredWatermarks};

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

use super::restored_watermarks::WATERMARK_KEY;

/// One aggregate's accumulator. Sums and counts of int64 are checked.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Acc {
    Empty,
    I(i64),
    F(f64),
    /// Average: sum and count of the non-null values.
    Avg(f64, i64),
}


/// One key's accumulators in one window, and whether they were output.
#[derive(Clone)]
struct Entry {
    fired: bool,
    accs: Vec<Acc>,
}

#[derive(Default)]
struct Pane {
    keys: FastMap<Box<[u8]>, Entry>,
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
    /// Session windows: each key's sessions as (start, end).
    sessions: FastMap<Box<[u8]>, std::collections::BTreeSet<(i64, i64)>>,
    watermark: i64,
    /// After a restore: key groups whose old subtask was further on.
    restored: RestoredWatermarks,
    /// Records dropped as late since the last call of `take_late`.
    late: u64,
    /// With a late-records output: the late records since the last call of
    /// `take_late_records`.
    late_records: Option<Vec<RecordBatch>>,
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
            sessions: FastMap::default(),
            watermark: i64::MIN,
            restored: RestoredWatermarks::default(),
            late: 0,
            late_records: plan.late_records.is_some().then(Vec::new),
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Late records dropped since the last call.
    pub fn take_late(&mut self) -> u64 {
        std::mem::take(&mut self.late)
    }

    /// With a late-records output, the late records themselves since the
    /// last call, as they came in.
    pub fn take_late_records(&mut self) -> Vec<RecordBatch> {
        self.late_records.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether a window ending at `end` is past its lateness at `watermark`.
    fn is_dropped(&self, end: i64, watermark: i64) -> bool {
        (end - 1).saturating_add(self.plan.allowed_lateness_ms) <= watermark
    }

    /// Adds a batch to its windows; returns the results that records
    /// arriving after their window's end (within the allowed lateness) changed.
    pub fn process(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let key_columns = canonical_keys(&self.plan.key_indices.iter().map(|&i| batch.column(i).clone()).collect::<Vec<_>>());
        let rows = self.converter.convert_columns(&key_columns).map_err(Error::arrow(format!("{}: keys", self.step)))?;
        let times = batch.column(self.plan.time_index).as_primitive::<Int64Type>();
        let mut refire: Vec<(WindowKey, Box<[u8]>)> = Vec::new();
        let mut late_rows: Vec<u32> = Vec::new();
        // Only after a rescaled restore do key groups differ in watermark.
        let groups = if self.restored.is_active() { Some(key_groups(&key_columns, batch.num_rows(), self.max_parallelism)?) } else { None };
        for r in 0..batch.num_rows() {
            let watermark = groups.as_ref().map_or(self.watermark, |g| self.restored.of(g[r], self.watermark));
            if times.is_null(r) {
                return Err(Error::Record {
                    step: self.step.clone(),
                    message: "the event-time field is null: every record needs a time to be put in a window".into(),
                    record: record_json(&batch, r),
                    position: None,
                });
            }
            let t = times.value(r);
            let key: Box<[u8]> = rows.row(r).as_ref().into();
            let values: Vec<Acc> = self.plan.aggregates.iter().map(|a| a.input.map_or(Acc::Empty, |i| value_at(batch.column(i), r))).collect();
            let windows = match self.plan.session_gap_ms {
                Some(gap) => {
                    let step = self.step.clone();
                    let overflow = || Error::Record {
                        step: step.clone(),
                        message: "merging sessions overflows an int64 count or sum".into(),
                        record: record_json(&batch, r),
                        position: None,
                    };
                    self.merge_session(&key, t, gap, watermark, overflow)?.into_iter().collect()
                }
                None => self.fixed_windows(t, watermark),
            };
            if windows.is_empty() {
                self.late += 1;
                // Row indices are only worth keeping when a late output
                // takes them; otherwise the record is counted and dropped.
                if self.late_records.is_some() {
                    late_rows.push(r as u32);
                }
                continue;
            }
            for w in windows {
                let entry = self.windows.entry(w).or_default().keys.entry(key.clone()).or_insert_with(|| Entry { fired: false, accs: vec![Acc::Empty; values.len()] });
                for (k, agg) in self.plan.aggregates.iter().enumerate() {
                    entry.accs[k] = update(agg.function, entry.accs[k], values[k]).ok_or_else(|| Error::Record {
                        step: self.step.clone(),
                        message: format!("the int64 {} of a window overflows", if agg.function == WindowFn::Count { "count" } else { "sum" }),
                        record: record_json(&batch, r),
                        position: None,
                    })?;
                }
                // The watermark has passed the window's end: as in Flink's
                // event-time trigger, it fires again at once with the record.
                if w.0 - 1 <= watermark {
                    entry.fired = true;
                    refire.push((w, key.clone()));
                }
            }
        }
        if let (Some(late), false) = (&mut self.late_records, late_rows.is_empty()) {
            let rows = UInt32Array::from(late_rows);
            late.push(arrow::compute::take_record_batch(&batch, &rows).map_err(Error::arrow(format!("{}: late records", self.step)))?);
        }
        if refire.is_empty() {
            return Ok(None);
        }
        refire.sort();
        refire.dedup();
        let mut out = Vec::with_capacity(refire.len());
        for (w, key) in refire {
            if let Some(e) = self.windows.get(&w).and_then(|p| p.keys.get(&key)) {
                out.push((w, key, e.accs.clone()));
            }
        }
        self.results(out).map(Some)
    }

    /// The fixed windows of time `t` that are not past their lateness.
    fn fixed_windows(&self, t: i64, watermark: i64) -> Vec<WindowKey> {
        fixed_windows(t, self.plan.size_ms, self.plan.slide_ms).filter(|(end, _)| !self.is_dropped(*end, watermark)).collect()
    }

    /// Puts time `t` into `key`'s session: `[t, t + gap)` merged with every
    /// session of the key it overlaps, their accumulators
    /// combined into the merged one. `None`: a session of its own that is
    /// already past its lateness (the record is late).
    fn merge_session(&mut self, key: &[u8], t: i64, gap: i64, watermark: i64, overflow: impl Fn() -> Error) -> Result<Option<WindowKey>> {
        let ((start, end), overlapping) = session_of(self.sessions.get(key), t, gap);
        if overlapping.is_empty() && self.is_dropped(end, watermark) {
            return Ok(None);
        }
        let mut merged: Option<Entry> = None;
        for (s, e) in &overlapping {
            let Some(pane) = self.windows.get_mut(&(*e, *s)) else { continue };
            let Some(entry) = pane.keys.remove(key) else { continue };
            if pane.keys.is_empty() {
                self.windows.remove(&(*e, *s));
            }
            // A merged session is a new window: whatever its parts showed,
            // it fires (again) once the watermark passes its end.
            merged = Some(match merged {
                None => Entry { fired: false, accs: entry.accs },
                Some(m) => Entry {
                    fired: false,
                    accs: m.accs.iter().zip(&entry.accs).zip(&self.plan.aggregates).map(|((a, b), agg)| merge(agg.function, *a, *b).ok_or_else(&overflow)).collect::<Result<_>>()?,
                },
            });
        }
        let set = self.sessions.entry(key.into()).or_default();
        for o in &overlapping {
            set.remove(o);
        }
        set.insert((start, end));
        if let Some(m) = merged {
            self.windows.entry((end, start)).or_default().keys.insert(key.into(), m);
        }
        Ok(Some((end, start)))
    }

    /// The watermark advanced: fires the windows it completes and drops the
    /// ones past their lateness. Returns the results, if any.
    pub fn on_watermark(&mut self, watermark: i64) -> Result<Option<RecordBatch>> {
        if watermark <= self.watermark {
            return Ok(None);
        }
        self.watermark = watermark;
        self.restored.forget_below(watermark);
        let mut out = Vec::new();
        for (&(end, start), pane) in self.windows.range_mut(..=(watermark.saturating_add(1), i64::MAX)) {
            if end - 1 > watermark {
                continue;
            }
            for (key, entry) in pane.keys.iter_mut().filter(|(_, e)| !e.fired) {
                entry.fired = true;
                out.push(((end, start), key.clone(), entry.accs.clone()));
            }
        }
        let lateness = self.plan.allowed_lateness_ms;
        let gone: Vec<WindowKey> = self.windows.range(..=(watermark.saturating_sub(lateness).saturating_add(1), i64::MAX)).map(|(w, _)| *w).filter(|(end, _)| (end - 1).saturating_add(lateness) <= watermark).collect();
        for w in gone {
            if let Some(pane) = self.windows.remove(&w) {
                if self.plan.session_gap_ms.is_some() {
                    for key in pane.keys.keys() {
                        if let Some(set) = self.sessions.get_mut(key) {
                            set.remove(&(w.1, w.0));
                            if set.is_empty() {
                                self.sessions.remove(key);
                            }
                        }
                    }
                }
            }
        }
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
            self.windows.iter().flat_map(|(w, p)| p.keys.iter().map(move |(k, e)| (w, e.fired, k, &e.accs))).collect();
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
        let metadata = [
            (WATERMARK_KEY.to_string(), self.watermark.to_string()),
            (restored_watermarks::KEY.to_string(), self.restored.encode(&self.groups, self.watermark)),
        ];
        let schema = self.snapshot_schema().with_metadata(metadata.into());
        RecordBatch::try_new(Arc::new(schema), columns).map_err(Error::arrow(ctx()))
    }

    /// Loads the rows of `batch` whose key group this subtask owns, and the
    /// watermark of each of its key groups: the subtask starts at the
    /// smallest of them.
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
        let entries = match found.metadata().get(restored_watermarks::KEY) {
            Some(text) => restored_watermarks::parse(text).ok_or_else(|| Error::BadCheckpoint {
                location: location.to_string(),
                message: format!("the state of `{}` names its key groups' watermarks as `{text}`: expected `start-end:watermark` entries separated by `;`", self.id),
            })?,
            // Snapshots of earlier versions: one watermark for every key group.
            None => vec![(0..=u32::MAX, watermark)],
        };
        self.restored.add(&self.groups, &entries);
        self.watermark = self.restored.lowest();
        self.restored.forget_below(self.watermark);
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
            let (start, end) = (starts.value(r), ends.value(r));
            let key: Box<[u8]> = rows.row(r).as_ref().into();
            if self.plan.session_gap_ms.is_some() {
                self.sessions.entry(key.clone()).or_default().insert((start, end));
            }
            self.windows.entry((end, start)).or_default().keys.insert(key, Entry { fired: fired.value(r), accs });
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

/// Two accumulators of one key combined (sessions merging); `None` on an
/// int64 overflow.
fn merge(function: WindowFn, a: Acc, b: Acc) -> Option<Acc> {
    Some(match (function, a, b) {
        (_, x, Acc::Empty) | (_, Acc::Empty, x) => x,
        (WindowFn::Count, Acc::I(x), Acc::I(y)) | (WindowFn::Sum, Acc::I(x), Acc::I(y)) => Acc::I(x.checked_add(y)?),
        (WindowFn::Sum, Acc::F(x), Acc::F(y)) => Acc::F(x + y),
        (WindowFn::Avg, Acc::Avg(s1, c1), Acc::Avg(s2, c2)) => Acc::Avg(s1 + s2, c1 + c2),
        (_, x, y) => update(function, x, y)?,
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
