//! Planners of the steps that read two streams: which fields each side is
//! partitioned and matched by, where each side's event time is, and the
//! output's fields (runtime/design/graphs.md §4.4).
//!
//! The output holds the left fields in order, then the right ones. A right
//! field whose name the output already has is renamed `<right input>_<field>`;
//! when that name is taken too, planning fails and says to rename the field
//! before the join. The output is keyed by the left key fields (records of
//! one key meet in one subtask, so a keyed step may read it without a
//! key_by) and carries event time in the left's field.
//!
//! Like `steps.rs`, this knows the streams in front of the step and nothing
//! of stages.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use weir_api::pipeline::{IntervalJoinSpec, IntervalJoinType, JoinSpec, LookupJoinSpec, Missing, WindowJoinSpec, WindowKind};

use super::steps::{StepAt, Stream};
use super::{names, IntervalJoinPlan, JoinSide, LookupPlan, OperatorKind, OperatorPlan, RegularJoinPlan, WindowJoinPlan};
use crate::error::Result;
use crate::key_group::is_key_type;

/// The two inputs of a join as the planner sees them (node name and
/// stream), and the join's own name, which starts every message.
pub(super) struct Inputs<'a> {
    pub join: &'a str,
    pub left: (&'a str, &'a Stream),
    pub right: (&'a str, &'a Stream),
}

/// A planned join: its operator, its output, and the key columns each
/// input is hash-partitioned by.
pub(super) struct PlannedJoin {
    pub operator: OperatorPlan,
    pub output: Stream,
    pub left_keys: Vec<usize>,
    pub right_keys: Vec<usize>,
}

pub(super) fn plan_interval_join(inputs: Inputs, spec: &IntervalJoinSpec, at: StepAt) -> Result<PlannedJoin> {
    let right_on = spec.right_on.as_deref().unwrap_or(&spec.on);
    let (left_keys, right_keys) = join_keys(&inputs, &spec.on, right_on, spec.right_on.is_some(), &at)?;
    let left_outer = spec.join_type == IntervalJoinType::LeftOuter;
    let left = side(inputs.join, inputs.left, left_keys.clone(), &at)?;
    let right = side(inputs.join, inputs.right, right_keys.clone(), &at)?;
    let schema = joined_schema(&inputs, left_outer, &at)?;
    let output = Stream {
        schema: schema.clone(),
        keys: Some(spec.on.clone()),
        event_time: inputs.left.1.event_time.clone(),
    };
    let plan = IntervalJoinPlan {
        left,
        right,
        lower_ms: spec.between.lower.millis(),
        upper_ms: spec.between.upper.millis(),
        left_outer,
    };
    let operator = OperatorPlan { id: at.id, step: at.field, kind: OperatorKind::IntervalJoin(plan), output_schema: schema };
    Ok(PlannedJoin { operator, output, left_keys, right_keys })
}

/// A window join: both inputs in the same windows, by their own event
/// time. Its output appends `window_start` and `window_end`, and carries no
/// event time: pairs leave when the watermark closes their window, behind
/// it, as a window's results do.
pub(super) fn plan_window_join(inputs: Inputs, spec: &WindowJoinSpec, at: StepAt) -> Result<PlannedJoin> {
    let right_on = spec.right_on.as_deref().unwrap_or(&spec.on);
    let (left_keys, right_keys) = join_keys(&inputs, &spec.on, right_on, spec.right_on.is_some(), &at)?;
    let left = side(inputs.join, inputs.left, left_keys.clone(), &at)?;
    let right = side(inputs.join, inputs.right, right_keys.clone(), &at)?;
    let mut fields: Vec<Field> = joined_schema(&inputs, false, &at)?.fields().iter().map(|f| f.as_ref().clone()).collect();
    for name in ["window_start", "window_end"] {
        if fields.iter().any(|f| f.name() == name) {
            return Err(at.invalid(format!("`{}`: the output already has a field `{name}`: select it under another name before the join", inputs.join)));
        }
        fields.push(Field::new(name, DataType::Int64, false));
    }
    let schema = Arc::new(Schema::new(fields));
    let (size_ms, slide_ms, session_gap_ms) = match spec.kind() {
        Some(WindowKind::Fixed { size, slide }) => (size as i64, slide as i64, None),
        Some(WindowKind::Session { gap }) => (0, 0, Some(gap as i64)),
        None => return Err(at.invalid(format!("`{}`: expected one of `tumbling`, `sliding` or `session`", inputs.join))),
    };
    let output = Stream { schema: schema.clone(), keys: Some(spec.on.clone()), event_time: None };
    let plan = WindowJoinPlan { left, right, size_ms, slide_ms, session_gap_ms };
    let operator = OperatorPlan { id: at.id, step: at.field, kind: OperatorKind::WindowJoin(plan), output_schema: schema };
    Ok(PlannedJoin { operator, output, left_keys, right_keys })
}

/// A regular join: every pair of one key, whenever its records arrive,
/// each kept `ttl` after it arrived. Its output has no event time (a pair
/// may be far behind the watermark) and is insert-only.
pub(super) fn plan_regular_join(inputs: Inputs, spec: &JoinSpec, at: StepAt) -> Result<PlannedJoin> {
    let right_on = spec.right_on.as_deref().unwrap_or(&spec.on);
    let (left_keys, right_keys) = join_keys(&inputs, &spec.on, right_on, spec.right_on.is_some(), &at)?;
    let keyed = |(name, stream): (&str, &Stream), key_indices: Vec<usize>| JoinSide { name: name.to_string(), schema: stream.schema.clone(), key_indices, time_index: None };
    let left = keyed(inputs.left, left_keys.clone());
    let right = keyed(inputs.right, right_keys.clone());
    let schema = joined_schema(&inputs, false, &at)?;
    let output = Stream { schema: schema.clone(), keys: Some(spec.on.clone()), event_time: None };
    let plan = RegularJoinPlan { left, right, ttl_ms: spec.ttl.get().as_millis() as i64 };
    let operator = OperatorPlan { id: at.id, step: at.field, kind: OperatorKind::Join(plan), output_schema: schema };
    Ok(PlannedJoin { operator, output, left_keys, right_keys })
}

/// A lookup join: the record's `on` fields (int64, string or boolean, so
/// that they compare with the table's key columns as PostgreSQL sees them),
/// then the table's `columns`, each nullable; a column whose name the
/// record has is renamed `<step name>_<column>`. Keys and event time pass
/// through: the join only adds fields.
pub(super) fn plan_lookup_join(stream: &mut Stream, spec: &LookupJoinSpec, at: StepAt) -> Result<OperatorPlan> {
    let mut key_indices = Vec::new();
    for (j, field) in spec.on.iter().enumerate() {
        let (index, f) = stream.schema.column_with_name(field).ok_or_else(|| {
            at.invalid_at(&format!("on[{j}]"), format!("`{}`: the input has no field `{field}`: expected one of {}", at.id, names(&stream.schema)))
        })?;
        if !matches!(f.data_type(), DataType::Int64 | DataType::Utf8 | DataType::Boolean) {
            return Err(at.invalid_at(
                &format!("on[{j}]"),
                format!("`{}`: `{field}` is {}: a lookup key must be int64, string or boolean", at.id, user_type(f.data_type())),
            ));
        }
        key_indices.push(index);
    }
    let mut fields: Vec<Arc<Field>> = stream.schema.fields().iter().cloned().collect();
    let mut columns = Vec::new();
    for (column, ty) in &spec.postgres.columns.0 {
        let data_type = super::arrow_type(*ty);
        let mut name = column.clone();
        if fields.iter().any(|f| f.name() == &name) {
            name = format!("{}_{column}", at.id);
            if fields.iter().any(|f| f.name() == &name) {
                return Err(at.invalid_at(
                    "postgres.columns",
                    format!("`{}`: column `{column}` would become `{name}`, which is taken: select the field under another name before the join", at.id),
                ));
            }
        }
        fields.push(Arc::new(Field::new(name, data_type.clone(), true)));
        columns.push((column.clone(), data_type));
    }
    stream.schema = Arc::new(Schema::new(fields));
    let plan = LookupPlan {
        key_indices,
        connection: spec.postgres.connection.clone(),
        table: spec.postgres.table.clone(),
        key_columns: spec.postgres.key.clone(),
        columns,
        max_rows: usize::try_from(spec.cache.max_rows).unwrap_or(usize::MAX),
        ttl_ms: spec.cache.ttl.get().as_millis() as u64,
        keep_missing: spec.missing == Missing::Keep,
    };
    Ok(OperatorPlan { id: at.id, step: at.field, kind: OperatorKind::LookupJoin(plan), output_schema: stream.schema.clone() })
}

/// The key columns of each side, pairwise of one type that hashes into key
/// groups (so that equal keys of both sides meet in one subtask).
fn join_keys(inputs: &Inputs, on: &[String], right_on: &[String], right_written: bool, at: &StepAt) -> Result<(Vec<usize>, Vec<usize>)> {
    let (left_name, left) = inputs.left;
    let (right_name, right) = inputs.right;
    let who = format!("`{}`: ", inputs.join);
    let mut out = (Vec::new(), Vec::new());
    for (i, (l, r)) in on.iter().zip(right_on).enumerate() {
        let (li, lf) = left
            .schema
            .column_with_name(l)
            .ok_or_else(|| at.invalid_at(&format!("on[{i}]"), format!("{who}`{left_name}` has no field `{l}`: expected one of {}", names(&left.schema))))?;
        let right_field = if right_written { format!("right_on[{i}]") } else { format!("on[{i}]") };
        let (ri, rf) = right
            .schema
            .column_with_name(r)
            .ok_or_else(|| at.invalid_at(&right_field, format!("{who}`{right_name}` has no field `{r}`: expected one of {}", names(&right.schema))))?;
        if lf.data_type() != rf.data_type() {
            return Err(at.invalid_at(
                &format!("on[{i}]"),
                format!("{who}`{l}` is {} in `{left_name}` but `{r}` is {} in `{right_name}`: join keys must have one type", user_type(lf.data_type()), user_type(rf.data_type())),
            ));
        }
        if !is_key_type(lf.data_type()) {
            return Err(at.invalid_at(&format!("on[{i}]"), format!("{who}cannot join on `{l}` of type {}: expected int64, float64, string or boolean", user_type(lf.data_type()))));
        }
        out.0.push(li);
        out.1.push(ri);
    }
    Ok(out)
}

/// One input as the join operator reads it; joins by time need its event time.
fn side(join: &str, (name, stream): (&str, &Stream), key_indices: Vec<usize>, at: &StepAt) -> Result<JoinSide> {
    let Some(field) = &stream.event_time else {
        return Err(at.invalid(format!(
            "`{join}`: `{name}` has no event time: a join by time needs it on both inputs (give the sources it reads an `event_time`)"
        )));
    };
    let (time_index, _) = stream.schema.column_with_name(field).ok_or_else(|| {
        at.invalid(format!("`{join}`: `{name}` no longer has its event-time field `{field}` (a select dropped it): keep it to join by time"))
    })?;
    Ok(JoinSide { name: name.to_string(), schema: stream.schema.clone(), key_indices, time_index: Some(time_index) })
}

/// The left fields, then the right ones renamed where they clash (and
/// nullable in a left outer join).
fn joined_schema(inputs: &Inputs, right_nullable: bool, at: &StepAt) -> Result<Arc<Schema>> {
    let (right_name, right) = inputs.right;
    let mut fields: Vec<Field> = inputs.left.1.schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    for f in right.schema.fields() {
        let taken = |name: &str, fields: &[Field]| fields.iter().any(|g| g.name() == name);
        let mut field = f.as_ref().clone();
        if taken(f.name(), &fields) {
            let renamed = format!("{right_name}_{}", f.name());
            if taken(&renamed, &fields) || right.schema.column_with_name(&renamed).is_some() {
                return Err(at.invalid(format!(
                    "`{}`: right field `{}` would become `{renamed}`, which is taken: select it under another name before the join",
                    inputs.join,
                    f.name()
                )));
            }
            field = field.with_name(renamed);
        }
        if right_nullable {
            field = field.with_nullable(true);
        }
        fields.push(field);
    }
    Ok(Arc::new(Schema::new(fields)))
}

/// A type as pipelines write it (`int64`, `string`).
pub(crate) fn user_type(t: &DataType) -> String {
    match t {
        DataType::Int64 => "int64".into(),
        DataType::Float64 => "float64".into(),
        DataType::Utf8 => "string".into(),
        DataType::Boolean => "boolean".into(),
        other => other.to_string(),
    }
}
