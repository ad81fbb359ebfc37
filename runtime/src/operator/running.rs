//! Keyed running aggregates (count, sum, min, max): each record gets the
//! aggregate of its key so far, itself included.
//!
//! State is a hash map from key to accumulator. A single non-null int64 key
//! (the common case) is stored as the integer itself; any other key is stored
//! in Arrow's row format, which is compact and hashable. Snapshots are Arrow
//! record batches `(key_group, key columns..., acc)`, so a restore at another
//! parallelism keeps exactly the key groups of its range.

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Float64Builder, Int64Array, Int64Builder, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, UInt32Type};
use arrow::row::{RowConverter, SortField};

use crate::error::{Error, Result};
use crate::key_group::{groups_of_subtask, key_groups};
use crate::plan::{AggFn, RunningPlan};

type FastMap<K, V> = HashMap<K, V, ahash::RandomState>;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Acc {
    Empty,
    I(i64),
    F(f64),
}

enum KeyTable {
    Int64(FastMap<i64, Acc>),
    Rows { converter: RowConverter, map: FastMap<Box<[u8]>, Acc> },
}

pub struct RunningAggregate {
    id: String,
    key_indices: Vec<usize>,
    key_fields: Vec<Arc<Field>>,
    function: AggFn,
    input: Option<usize>,
    output_type: DataType,
    output_schema: SchemaRef,
    max_parallelism: u32,
    groups: RangeInclusive<u32>,
    table: KeyTable,
}

impl RunningAggregate {
    pub fn new(
        id: String,
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
            key_indices: plan.key_indices.clone(),
            key_fields,
            function: plan.function,
            input: plan.input,
            output_type: plan.output_type.clone(),
            output_schema,
            max_parallelism,
            groups: groups_of_subtask(subtask, parallelism, max_parallelism),
            table,
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

    fn update(function: AggFn, acc: &mut Acc, value: Acc) {
        *acc = match (function, *acc, value) {
            (AggFn::Count, Acc::I(n), _) => Acc::I(n + 1),
            (AggFn::Count, _, _) => Acc::I(1),
            (_, a, Acc::Empty) => a,
            (_, Acc::Empty, v) => v,
            (AggFn::Sum, Acc::I(a), Acc::I(v)) => Acc::I(a.wrapping_add(v)),
            (AggFn::Sum, Acc::F(a), Acc::F(v)) => Acc::F(a + v),
            (AggFn::Min, Acc::I(a), Acc::I(v)) => Acc::I(a.min(v)),
            (AggFn::Min, Acc::F(a), Acc::F(v)) => Acc::F(a.min(v)),
            (AggFn::Max, Acc::I(a), Acc::I(v)) => Acc::I(a.max(v)),
            (AggFn::Max, Acc::F(a), Acc::F(v)) => Acc::F(a.max(v)),
            (_, a, _) => a,
        };
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
        let mut out = Vec::with_capacity(n);
        match &mut self.table {
            KeyTable::Int64(map) => {
                let keys = batch.column(self.key_indices[0]).as_primitive::<Int64Type>();
                for (r, k) in keys.values().iter().enumerate() {
                    let acc = map.entry(*k).or_insert(Acc::Empty);
                    Self::update(f, acc, values(r));
                    out.push(*acc);
                }
            }
            KeyTable::Rows { converter, map } => {
                let cols: Vec<ArrayRef> = self.key_indices.iter().map(|&i| batch.column(i).clone()).collect();
                let rows = converter.convert_columns(&cols).map_err(Error::arrow(format!("{}: keys", self.id)))?;
                for r in 0..n {
                    let key = rows.row(r);
                    let acc = match map.get_mut(key.as_ref()) {
                        Some(a) => a,
                        None => map.entry(key.as_ref().into()).or_insert(Acc::Empty),
                    };
                    Self::update(f, acc, values(r));
                    out.push(*acc);
                }
            }
        }
        let column = accs_to_array(&self.output_type, out.into_iter());
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

    /// A copy of the state, taken synchronously at the barrier; writing it
    /// out happens elsewhere while processing goes on.
    pub fn snapshot(&self) -> Result<RecordBatch> {
        let ctx = || format!("{}: snapshot", self.id);
        let (key_columns, accs): (Vec<ArrayRef>, Vec<Acc>) = match &self.table {
            KeyTable::Int64(map) => {
                let keys: Int64Array = map.keys().copied().collect();
                (vec![Arc::new(keys)], map.values().copied().collect())
            }
            KeyTable::Rows { converter, map } => {
                let parser = converter.parser();
                let rows: Vec<_> = map.keys().map(|k| parser.parse(k)).collect();
                let cols = converter.convert_rows(rows).map_err(Error::arrow(ctx()))?;
                (cols, map.values().copied().collect())
            }
        };
        let rows = accs.len();
        let groups = key_groups(&key_columns, rows, self.max_parallelism)?;
        let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt32Array::from(groups))];
        columns.extend(key_columns);
        columns.push(accs_to_array(&self.output_type, accs.into_iter()));
        RecordBatch::try_new(self.snapshot_schema(), columns).map_err(Error::arrow(ctx()))
    }

    /// Loads the rows of `batch` whose key group this subtask owns.
    pub fn restore(&mut self, batch: &RecordBatch) -> Result<()> {
        let expected = self.snapshot_schema();
        let found = batch.schema();
        let same = found.fields().len() == expected.fields().len()
            && found.fields().iter().zip(expected.fields().iter()).all(|(a, b)| a.data_type() == b.data_type());
        if !same {
            return Err(Error::Job(format!(
                "state of `{}` does not fit this pipeline: the checkpoint has columns ({}) but the step now keeps ({}); give the changed step a new id to start its state fresh",
                self.id,
                describe(&found),
                describe(&expected)
            )));
        }
        let groups = batch.column(0).as_primitive::<UInt32Type>();
        let nkeys = self.key_fields.len();
        let key_columns: Vec<ArrayRef> = (1..=nkeys).map(|i| batch.column(i).clone()).collect();
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
        match &mut self.table {
            KeyTable::Int64(map) => {
                let keys = key_columns[0].as_primitive::<Int64Type>();
                for r in 0..batch.num_rows() {
                    if self.groups.contains(&groups.value(r)) {
                        map.insert(keys.value(r), acc_at(r));
                    }
                }
            }
            KeyTable::Rows { converter, map } => {
                let rows = converter.convert_columns(&key_columns).map_err(Error::arrow(format!("{}: restore", self.id)))?;
                for r in 0..batch.num_rows() {
                    if self.groups.contains(&groups.value(r)) {
                        map.insert(rows.row(r).as_ref().into(), acc_at(r));
                    }
                }
            }
        }
        Ok(())
    }
}

fn describe(s: &Schema) -> String {
    s.fields().iter().map(|f| format!("{} {}", f.name(), f.data_type())).collect::<Vec<_>>().join(", ")
}

fn accs_to_array(ty: &DataType, accs: impl Iterator<Item = Acc>) -> ArrayRef {
    match ty {
        DataType::Float64 => {
            let mut b = Float64Builder::new();
            for a in accs {
                match a {
                    Acc::F(v) => b.append_value(v),
                    Acc::I(v) => b.append_value(v as f64),
                    Acc::Empty => b.append_null(),
                }
            }
            Arc::new(b.finish()) as ArrayRef
        }
        _ => {
            let mut b = Int64Builder::new();
            for a in accs {
                match a {
                    Acc::I(v) => b.append_value(v),
                    Acc::F(v) => b.append_value(v as i64),
                    Acc::Empty => b.append_null(),
                }
            }
            Arc::new(b.finish())
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
        RunningAggregate::new("c".into(), &plan, &gen_schema(), out, subtask, parallelism, 16).unwrap()
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
    fn a_snapshot_restored_at_another_parallelism_keeps_every_count_once() {
        let mut op = count_op(0, 1);
        let keys: Vec<i64> = (0..200).map(|i| i % 50).collect();
        op.process(batch(keys)).unwrap();
        let snap = op.snapshot().unwrap();
        let mut restored = Vec::new();
        for s in 0..3 {
            let mut o = count_op(s, 3);
            o.restore(&snap).unwrap();
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
        let mut op = RunningAggregate::new("m".into(), &plan, &schema, out.clone(), 0, 1, 8).unwrap();
        let b = RecordBatch::try_new(schema.clone(), vec![
            Arc::new(StringArray::from(vec!["a", "b", "a"])),
            Arc::new(Float64Array::from(vec![Some(1.0), None, Some(0.5)])),
        ]).unwrap();
        let r = op.process(b.clone()).unwrap();
        let m = r.column(2).as_primitive::<Float64Type>();
        assert_eq!((m.value(0), m.is_null(1), m.value(2)), (1.0, true, 1.0));
        let mut again = RunningAggregate::new("m".into(), &plan, &schema, out, 0, 1, 8).unwrap();
        again.restore(&op.snapshot().unwrap()).unwrap();
        let r = again.process(b).unwrap();
        assert_eq!(r.column(2).as_primitive::<Float64Type>().value(0), 1.0);
    }
}
