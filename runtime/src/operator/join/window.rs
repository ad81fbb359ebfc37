//! The window join: both inputs assigned to the same event-time windows
//! (tumbling, sliding, or sessions merged over the records of both sides),
//! and when the watermark closes a window (reaches `end − 1`), every left
//! record of a key paired with every right record of that key in it, with
//! `window_start` and `window_end`; then the window is dropped. As Flink's
//! window join, it is an inner join.
//!
//! A record only for windows the watermark closed already is late: counted
//! and dropped (there is no allowed lateness for joins). A null key pairs
//! with nothing. The output has no event time: pairs leave behind the
//! watermark, as a window's results do, and the watermark passes on as it is.
//!
//! The snapshot is one batch per side (`<id>.left`, `<id>.right`):
//! `key_group, window_start, window_end` and the side's fields, with the
//! watermarks in the schema metadata as windows keep them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};

use super::super::assign::{fixed_windows, session_of, WindowKey};
use super::super::record_json;
use super::super::restored_watermarks::{self, RestoredWatermarks, WATERMARK_KEY};
use super::super::running::{canonical_keys, describe};
use super::side::{fits, has_null_key, row_format, SideFormat};
use crate::error::{Error, Result};
use crate::key_group::{groups_of_subtask, key_groups};
use crate::plan::{JoinSide, WindowJoinPlan};

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

/// One key's rows of both sides in one window.
#[derive(Default)]
struct Pane {
    rows: [Vec<Box<[u8]>>; 2],
}

pub struct WindowJoin {
    id: String,
    step: String,
    plan: WindowJoinPlan,
    sides: [SideFormat; 2],
    windows: BTreeMap<WindowKey, FastMap<Box<[u8]>, Pane>>,
    /// Session windows: each key's sessions as (start, end).
    sessions: FastMap<Box<[u8]>, BTreeSet<(i64, i64)>>,
    output_schema: SchemaRef,
    max_parallelism: u32,
    groups: RangeInclusive<u32>,
    watermark: i64,
    restored: RestoredWatermarks,
    late: u64,
}

impl WindowJoin {
    pub fn new(id: String, step: String, plan: &WindowJoinPlan, output_schema: SchemaRef, subtask: u32, parallelism: u32, max_parallelism: u32) -> Result<Self> {
        Ok(WindowJoin {
            sides: [SideFormat::new(&plan.left, &step)?, SideFormat::new(&plan.right, &step)?],
            id,
            step,
            plan: plan.clone(),
            windows: BTreeMap::new(),
            sessions: FastMap::default(),
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

    /// Rows kept, over both sides and every window.
    pub fn kept(&self) -> usize {
        self.windows.values().flat_map(|panes| panes.values()).map(|p| p.rows[0].len() + p.rows[1].len()).sum()
    }

    /// A batch of input `input` (0 left, 1 right): its rows go into their
    /// windows; nothing is output before a window closes.
    pub fn process(&mut self, input: usize, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let side = input.min(1);
        let format = &self.sides[side];
        let time_index = format.plan.time_index.ok_or_else(|| Error::Job(format!("{}: planned without event time", self.step)))?;
        let arrived = format.arrive(&batch, &self.step)?;
        let Some(times) = batch.column(time_index).as_primitive_opt::<Int64Type>() else {
            return Err(Error::Job(format!("{}: the event-time column is {}, not int64", self.step, batch.column(time_index).data_type())));
        };
        let groups = match self.restored.is_active() {
            true => Some(key_groups(&arrived.key_columns, batch.num_rows(), self.max_parallelism)?),
            false => None,
        };
        for r in 0..batch.num_rows() {
            if times.is_null(r) {
                return Err(Error::Record {
                    step: self.step.clone(),
                    message: "the event-time field is null: every record needs a time to be put in a window".into(),
                    record: record_json(&batch, r),
                    position: None,
                });
            }
            if has_null_key(&arrived.key_columns, r) {
                continue;
            }
            let t = times.value(r);
            let watermark = groups.as_ref().map_or(self.watermark, |g| self.restored.of(g[r], self.watermark));
            let key: Box<[u8]> = arrived.keys.row(r).as_ref().into();
            let row: Box<[u8]> = arrived.rows.row(r).as_ref().into();
            let windows: Vec<WindowKey> = match self.plan.session_gap_ms {
                Some(gap) => self.merge_session(&key, t, gap, watermark).into_iter().collect(),
                None => fixed_windows(t, self.plan.size_ms, self.plan.slide_ms).filter(|(end, _)| end - 1 > watermark).collect(),
            };
            if windows.is_empty() {
                self.late += 1;
                continue;
            }
            for w in windows {
                self.windows.entry(w).or_default().entry(key.clone()).or_default().rows[side].push(row.clone());
            }
        }
        Ok(None)
    }

    /// `key`'s session for a record at `t`, its earlier sessions' rows
    /// moved into it; `None` when it would be a session of its own that
    /// the watermark closed already (the record is late).
    fn merge_session(&mut self, key: &[u8], t: i64, gap: i64, watermark: i64) -> Option<WindowKey> {
        let ((start, end), overlapping) = session_of(self.sessions.get(key), t, gap);
        if overlapping.is_empty() && end - 1 <= watermark {
            return None;
        }
        let mut merged = Pane::default();
        for (s, e) in &overlapping {
            let Some(panes) = self.windows.get_mut(&(*e, *s)) else { continue };
            if let Some(pane) = panes.remove(key) {
                let [left, right] = pane.rows;
                merged.rows[0].extend(left);
                merged.rows[1].extend(right);
            }
            if panes.is_empty() {
                self.windows.remove(&(*e, *s));
            }
        }
        let set = self.sessions.entry(key.into()).or_default();
        for o in &overlapping {
            set.remove(o);
        }
        set.insert((start, end));
        let pane = self.windows.entry((end, start)).or_default().entry(key.into()).or_default();
        for side in 0..2 {
            pane.rows[side].extend(std::mem::take(&mut merged.rows[side]));
        }
        Some((end, start))
    }

    /// The watermark advanced: every window it closes outputs its pairs and goes.
    pub fn on_watermark(&mut self, watermark: i64) -> Result<Option<RecordBatch>> {
        if watermark <= self.watermark {
            return Ok(None);
        }
        self.watermark = watermark;
        self.restored.forget_below(watermark);
        // Closed: end − 1 ≤ W, that is every window before (W + 2, MIN).
        let open = match watermark.checked_add(2) {
            Some(bound) => self.windows.split_off(&(bound, i64::MIN)),
            None => BTreeMap::new(),
        };
        let closed = std::mem::replace(&mut self.windows, open);
        let mut pairs: Vec<(&[u8], &[u8], i64, i64)> = Vec::new();
        for (&(end, start), panes) in &closed {
            for (key, pane) in panes {
                if self.plan.session_gap_ms.is_some() {
                    if let Some(set) = self.sessions.get_mut(key) {
                        set.remove(&(start, end));
                        if set.is_empty() {
                            self.sessions.remove(key);
                        }
                    }
                }
                for l in &pane.rows[0] {
                    for r in &pane.rows[1] {
                        pairs.push((l, r, start, end));
                    }
                }
            }
        }
        if pairs.is_empty() {
            return Ok(None);
        }
        let mut columns = self.sides[0].columns(pairs.iter().map(|p| p.0), &self.step)?;
        columns.extend(self.sides[1].columns(pairs.iter().map(|p| p.1), &self.step)?);
        columns.push(Arc::new(Int64Array::from_iter_values(pairs.iter().map(|p| p.2))));
        columns.push(Arc::new(Int64Array::from_iter_values(pairs.iter().map(|p| p.3))));
        RecordBatch::try_new(self.output_schema.clone(), columns).map(Some).map_err(Error::arrow(format!("{}: output", self.step)))
    }

    /// The ids the two sides are kept under.
    pub fn state_ids(&self) -> [String; 2] {
        [format!("{}.left", self.id), format!("{}.right", self.id)]
    }

    fn snapshot_schema(side: &JoinSide) -> Schema {
        let mut fields = vec![
            Arc::new(Field::new("key_group", DataType::UInt32, false)),
            Arc::new(Field::new("window_start", DataType::Int64, false)),
            Arc::new(Field::new("window_end", DataType::Int64, false)),
        ];
        fields.extend(side.schema.fields().iter().cloned());
        Schema::new(fields)
    }

    /// Copies of both sides' rows, made into snapshot batches by
    /// [`WindowSideCopy::into_batch`] outside the subtask's loop.
    pub fn snapshot(&self) -> Vec<(String, WindowSideCopy)> {
        let metadata: HashMap<String, String> = [
            (WATERMARK_KEY.to_string(), self.watermark.to_string()),
            (restored_watermarks::KEY.to_string(), self.restored.encode(&self.groups, self.watermark)),
        ]
        .into();
        self.state_ids()
            .into_iter()
            .enumerate()
            .map(|(side, id)| {
                let rows = self
                    .windows
                    .iter()
                    .flat_map(|(&(end, start), panes)| panes.values().flat_map(move |p| p.rows[side].iter().map(move |r| (start, end, r.clone()))))
                    .collect();
                let plan = if side == 0 { &self.plan.left } else { &self.plan.right };
                let schema = Arc::new(Self::snapshot_schema(plan).with_metadata(metadata.clone()));
                (id, WindowSideCopy { rows, plan: plan.clone(), schema, max_parallelism: self.max_parallelism })
            })
            .collect()
    }

    /// Loads one side's snapshot batch (`state_id` says which): the rows of
    /// this subtask's key groups into their windows, and the watermarks.
    pub fn restore(&mut self, state_id: &str, batch: &RecordBatch, location: &str) -> Result<()> {
        let side = if state_id.ends_with(".left") { 0 } else { 1 };
        let expected = Self::snapshot_schema(&self.sides[side].plan);
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
        let (input, arrived) = self.sides[side].restored(batch, 3, &self.step)?;
        let of = key_groups(&arrived.key_columns, input.num_rows(), self.max_parallelism)?;
        let starts = batch.column(1).as_primitive::<Int64Type>();
        let ends = batch.column(2).as_primitive::<Int64Type>();
        for r in 0..input.num_rows() {
            if !self.groups.contains(&of[r]) {
                continue;
            }
            let (start, end) = (starts.value(r), ends.value(r));
            let key: Box<[u8]> = arrived.keys.row(r).as_ref().into();
            if self.plan.session_gap_ms.is_some() {
                self.sessions.entry(key.clone()).or_default().insert((start, end));
            }
            self.windows.entry((end, start)).or_default().entry(key).or_default().rows[side].push(arrived.rows.row(r).as_ref().into());
        }
        self.restored.add(&self.groups, &entries);
        self.watermark = self.restored.lowest();
        self.restored.forget_below(self.watermark);
        Ok(())
    }
}

/// One side's rows of a window join as copied at a barrier.
pub struct WindowSideCopy {
    rows: Vec<(i64, i64, Box<[u8]>)>,
    plan: JoinSide,
    schema: SchemaRef,
    max_parallelism: u32,
}

impl WindowSideCopy {
    pub fn into_batch(self, context: &str) -> Result<RecordBatch> {
        let format = row_format(&self.plan.schema, context)?;
        let parser = format.parser();
        let columns = format.convert_rows(self.rows.iter().map(|(_, _, r)| parser.parse(r))).map_err(Error::arrow(format!("{context}: snapshot")))?;
        let keys = canonical_keys(&self.plan.key_indices.iter().map(|&i| columns[i].clone()).collect::<Vec<_>>());
        let groups = key_groups(&keys, self.rows.len(), self.max_parallelism)?;
        let mut out: Vec<ArrayRef> = vec![
            Arc::new(UInt32Array::from(groups)),
            Arc::new(Int64Array::from_iter_values(self.rows.iter().map(|r| r.0))),
            Arc::new(Int64Array::from_iter_values(self.rows.iter().map(|r| r.1))),
        ];
        out.extend(columns);
        RecordBatch::try_new(self.schema, out).map_err(Error::arrow(format!("{context}: snapshot")))
    }
}
