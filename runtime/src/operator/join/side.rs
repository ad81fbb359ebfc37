//! The rows one input of a join keeps: per key, in event-time order, each
//! as Arrow row-format bytes of the input's schema (compact, and turned back
//! into columns only for the output and snapshots).
//!
//! A side knows nothing of the other side or of when its rows may go: the
//! join decides that and calls [`Side::expire_through`].

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use arrow::row::{RowConverter, Rows, SortField};

use super::super::running::canonical_keys;
use crate::error::{Error, Result};
use crate::key_group::key_groups;
use crate::plan::JoinSide;

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

/// A kept row, and whether it found a partner (a left outer join outputs
/// the rows that did not once they can no longer).
#[derive(Clone)]
pub(super) struct Stored {
    pub row: Box<[u8]>,
    pub matched: bool,
}

/// How a join reads one input: its rows and keys in Arrow's row format.
pub(super) struct SideFormat {
    pub plan: JoinSide,
    rows_format: RowConverter,
    keys_format: RowConverter,
}

impl SideFormat {
    pub fn new(plan: &JoinSide, context: &str) -> Result<SideFormat> {
        let rows_format = row_format(&plan.schema, context)?;
        let key_fields = plan.key_indices.iter().map(|&i| SortField::new(plan.schema.field(i).data_type().clone())).collect();
        let keys_format = RowConverter::new(key_fields).map_err(Error::arrow(format!("{context}: key columns")))?;
        Ok(SideFormat { plan: plan.clone(), rows_format, keys_format })
    }

    pub fn arrive(&self, batch: &RecordBatch, context: &str) -> Result<Arrived> {
        let key_columns = canonical_keys(&self.plan.key_indices.iter().map(|&i| batch.column(i).clone()).collect::<Vec<_>>());
        let keys = self.keys_format.convert_columns(&key_columns).map_err(Error::arrow(format!("{context}: keys")))?;
        let rows = self.rows_format.convert_columns(batch.columns()).map_err(Error::arrow(format!("{context}: rows")))?;
        Ok(Arrived { keys, rows, key_columns })
    }

    /// Rows back as the input's columns.
    pub fn columns<'a>(&self, rows: impl Iterator<Item = &'a [u8]>, context: &str) -> Result<Vec<ArrayRef>> {
        let parser = self.rows_format.parser();
        self.rows_format.convert_rows(rows.map(|r| parser.parse(r))).map_err(Error::arrow(format!("{context}: output")))
    }

    /// The input's columns of a snapshot batch (after its first `skip`
    /// columns), in the forms a join reads them.
    pub fn restored(&self, batch: &RecordBatch, skip: usize, context: &str) -> Result<(RecordBatch, Arrived)> {
        let n = self.plan.schema.fields().len();
        let fields: Vec<ArrayRef> = batch.columns()[skip..skip + n].to_vec();
        let input = RecordBatch::try_new(self.plan.schema.clone(), fields).map_err(Error::arrow(format!("{context}: restore")))?;
        let arrived = self.arrive(&input, context)?;
        Ok((input, arrived))
    }
}

pub(super) struct Side {
    pub format: SideFormat,
    /// Key → (event time, arrival number) → row.
    by_key: FastMap<Box<[u8]>, BTreeMap<(i64, u64), Stored>>,
    /// (event time, arrival number) → key: which rows go first.
    by_time: BTreeMap<(i64, u64), Box<[u8]>>,
    next: u64,
    /// Whether snapshots carry the `matched` column (a left outer join's left).
    keeps_matched: bool,
}

/// A batch of one input in the forms a join reads it.
pub(super) struct Arrived {
    pub keys: Rows,
    pub rows: Rows,
    /// The canonical key columns (float keys by value), for key groups.
    pub key_columns: Vec<ArrayRef>,
}

impl Side {
    pub fn new(plan: &JoinSide, keeps_matched: bool, context: &str) -> Result<Side> {
        Ok(Side {
            format: SideFormat::new(plan, context)?,
            by_key: FastMap::default(),
            by_time: BTreeMap::new(),
            next: 0,
            keeps_matched,
        })
    }

    /// Rows kept.
    pub fn len(&self) -> usize {
        self.by_time.len()
    }

    pub fn insert(&mut self, key: &[u8], time: i64, row: Box<[u8]>, matched: bool) {
        let seq = self.next;
        self.next += 1;
        self.by_key.entry(key.into()).or_default().insert((time, seq), Stored { row, matched });
        self.by_time.insert((time, seq), key.into());
    }

    /// The rows of `key` whose time is in `times`.
    pub fn matching(&mut self, key: &[u8], times: RangeInclusive<i64>) -> impl Iterator<Item = &mut Stored> {
        let (lo, hi) = times.into_inner();
        self.by_key
            .get_mut(key)
            .filter(|_| lo <= hi)
            .into_iter()
            .flat_map(move |rows| rows.range_mut((lo, 0)..=(hi, u64::MAX)).map(|(_, s)| s))
    }

    /// Removes and returns the rows whose time is at most `time`, oldest first.
    pub fn expire_through(&mut self, time: i64) -> Vec<Stored> {
        let rest = match time.checked_add(1) {
            Some(after) => self.by_time.split_off(&(after, 0)),
            None => BTreeMap::new(),
        };
        let gone = std::mem::replace(&mut self.by_time, rest);
        let mut out = Vec::with_capacity(gone.len());
        for (at, key) in gone {
            let Some(rows) = self.by_key.get_mut(&key) else { continue };
            if let Some(s) = rows.remove(&at) {
                out.push(s);
            }
            if rows.is_empty() {
                self.by_key.remove(&key);
            }
        }
        out
    }

    /// The columns of this side's snapshot: the key group, the input's
    /// fields, and `matched` when kept.
    pub fn snapshot_schema(&self) -> Schema {
        let mut fields = vec![Arc::new(Field::new("key_group", DataType::UInt32, false))];
        fields.extend(self.format.plan.schema.fields().iter().cloned());
        if self.keeps_matched {
            fields.push(Arc::new(Field::new("matched", DataType::Boolean, false)));
        }
        Schema::new(fields)
    }

    /// A copy of the kept rows, made into a snapshot batch by
    /// [`SideCopy::into_batch`] outside the subtask's loop.
    pub fn copy(&self, metadata: HashMap<String, String>, max_parallelism: u32) -> SideCopy {
        let rows = self.by_key.values().flat_map(|rows| rows.values().map(|s| (s.row.clone(), s.matched))).collect();
        SideCopy {
            rows,
            plan: self.format.plan.clone(),
            schema: Arc::new(self.snapshot_schema().with_metadata(metadata)),
            keeps_matched: self.keeps_matched,
            max_parallelism,
        }
    }

    /// Keeps the rows of a snapshot batch whose key group is in `groups`.
    /// The groups are computed again from the keys rather than read from
    /// the batch, so that float keys land where they hash today.
    pub fn restore(&mut self, batch: &RecordBatch, groups: &RangeInclusive<u32>, max_parallelism: u32, context: &str) -> Result<()> {
        let n = self.format.plan.schema.fields().len();
        let (input, arrived) = self.format.restored(batch, 1, context)?;
        let of = key_groups(&arrived.key_columns, input.num_rows(), max_parallelism)?;
        let time_index = self.format.plan.time_index.ok_or_else(|| Error::Job(format!("{context}: planned without event time")))?;
        let Some(times) = input.column(time_index).as_primitive_opt::<Int64Type>() else {
            return Err(Error::Job(format!("{context}: the restored event-time column is not int64")));
        };
        let matched = self.keeps_matched.then(|| batch.column(n + 1).as_boolean().clone());
        for r in 0..input.num_rows() {
            if !groups.contains(&of[r]) || times.is_null(r) {
                continue;
            }
            let m = matched.as_ref().is_some_and(|m| m.value(r));
            self.insert(arrived.keys.row(r).as_ref(), times.value(r), arrived.rows.row(r).as_ref().into(), m);
        }
        Ok(())
    }
}

/// One side's rows as copied at a barrier.
pub struct SideCopy {
    rows: Vec<(Box<[u8]>, bool)>,
    plan: JoinSide,
    schema: SchemaRef,
    keeps_matched: bool,
    max_parallelism: u32,
}

impl SideCopy {
    pub fn into_batch(self, context: &str) -> Result<RecordBatch> {
        let format = row_format(&self.plan.schema, context)?;
        let parser = format.parser();
        let columns = format.convert_rows(self.rows.iter().map(|(r, _)| parser.parse(r))).map_err(Error::arrow(format!("{context}: snapshot")))?;
        let keys = canonical_keys(&self.plan.key_indices.iter().map(|&i| columns[i].clone()).collect::<Vec<_>>());
        let groups = key_groups(&keys, self.rows.len(), self.max_parallelism)?;
        let mut out: Vec<ArrayRef> = vec![Arc::new(UInt32Array::from(groups))];
        out.extend(columns);
        if self.keeps_matched {
            out.push(Arc::new(BooleanArray::from(self.rows.iter().map(|(_, m)| *m).collect::<Vec<_>>())));
        }
        RecordBatch::try_new(self.schema, out).map_err(Error::arrow(format!("{context}: snapshot")))
    }
}

pub(super) fn row_format(schema: &Schema, context: &str) -> Result<RowConverter> {
    RowConverter::new(schema.fields().iter().map(|f| SortField::new(f.data_type().clone())).collect()).map_err(Error::arrow(format!("{context}: row format")))
}

/// Whether any key column of row `r` is null: such a record matches nothing.
pub(super) fn has_null_key(key_columns: &[ArrayRef], r: usize) -> bool {
    key_columns.iter().any(|c| c.is_null(r))
}

/// Whether a snapshot batch has the columns a side keeps now.
pub(super) fn fits(found: &Schema, expected: &Schema) -> bool {
    found.fields().len() == expected.fields().len() && found.fields().iter().zip(expected.fields().iter()).all(|(a, b)| a.data_type() == b.data_type())
}
