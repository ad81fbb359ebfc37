//! One planner per step kind: each resolves its step's fields and
//! expressions against the stream it reads and says what it outputs.
//!
//! A step planner knows the stream in front of it (schema, key, event time)
//! and nothing of stages: where stages begin and end is `stages.rs`' business.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion_physical_expr::expressions::Column;
use weir_api::pipeline::{PipelineSource, WindowKind, WindowSpec};
use weir_api::StepKind;

use super::{names, AggFn, CompiledExpr, OperatorKind, OperatorPlan, RunningPlan, WindowAggPlan, WindowFn, WindowPlan};
use crate::error::{Error, Result};
use crate::expr::{select_schema, ExprCompiler};
use crate::key_group::is_key_type;

/// What flows out of the last planned node: its records' schema and the
/// fields they were last partitioned by.
#[derive(Clone)]
pub(super) struct Stream {
    pub schema: SchemaRef,
    /// The fields of the nearest key_by upstream, if any.
    pub keys: Option<Vec<String>>,
    /// The field holding event time, when the sources read have it.
    pub event_time: Option<String>,
}

/// Where a step is written and what it may refer to, for its planner.
pub(super) struct StepAt<'a> {
    /// The operator id (the state id of stateful steps).
    pub id: String,
    /// The step's field in the pipeline (`steps[2].select`).
    pub field: String,
    pub src: &'a PipelineSource,
}

impl StepAt<'_> {
    pub(super) fn invalid(&self, msg: String) -> Error {
        Error::Pipeline(self.src.invalid(&self.field, msg))
    }

    /// An error at a field under the step's (`steps[0].interval_join.on[1]`).
    pub(super) fn invalid_at(&self, sub: &str, msg: String) -> Error {
        Error::Pipeline(self.src.invalid(&format!("{}.{sub}", self.field), msg))
    }

    fn operator(self, kind: OperatorKind, output_schema: &SchemaRef) -> OperatorPlan {
        OperatorPlan { id: self.id, step: self.field, kind, output_schema: output_schema.clone() }
    }
}

/// The columns of a key_by's fields, each of a type that can be hashed into
/// key groups.
pub(super) fn key_indices(stream: &Stream, fields: &[String], at: &StepAt) -> Result<Vec<usize>> {
    let schema = &stream.schema;
    let mut idx = Vec::new();
    for f in fields {
        let (pos, fld) = schema
            .column_with_name(f)
            .ok_or_else(|| at.invalid(format!("no field `{f}` to key by: expected one of {}", names(schema))))?;
        if !is_key_type(fld.data_type()) {
            return Err(at.invalid(format!("cannot key by `{f}` of type {}: expected int64, float64, string or boolean", fld.data_type())));
        }
        idx.push(pos);
    }
    Ok(idx)
}

/// Plans a step that runs as an operator (every kind but key_by), and
/// advances `stream` to its output.
pub(super) fn plan_operator(stream: &mut Stream, kind: &StepKind, at: StepAt) -> Result<OperatorPlan> {
    match kind {
        StepKind::Filter(text) => plan_filter(stream, text, at),
        StepKind::Select(items) => plan_select(stream, items, at),
        StepKind::Window(w) => plan_window(stream, w, at),
        StepKind::RunningCount(out) => plan_running(stream, AggFn::Count, None, out.clone(), at),
        StepKind::RunningSum(a) => plan_running(stream, AggFn::Sum, Some(&a.field), a.output.clone().unwrap_or(format!("sum_{}", a.field)), at),
        StepKind::RunningMin(a) => plan_running(stream, AggFn::Min, Some(&a.field), a.output.clone().unwrap_or(format!("min_{}", a.field)), at),
        StepKind::RunningMax(a) => plan_running(stream, AggFn::Max, Some(&a.field), a.output.clone().unwrap_or(format!("max_{}", a.field)), at),
        StepKind::KeyBy(_) | StepKind::Broadcast | StepKind::Union => {
            Err(at.invalid(format!("{} is an edge between stages, not an operator", kind.name())))
        }
        StepKind::LookupJoin(spec) => super::joins::plan_lookup_join(stream, spec, at),
        StepKind::IntervalJoin(_) | StepKind::WindowJoin(_) | StepKind::Join(_) => {
            Err(at.invalid(format!("{} reads two inputs: it starts a stage of its own", kind.name())))
        }
    }
}

fn plan_filter(stream: &mut Stream, text: &str, at: StepAt) -> Result<OperatorPlan> {
    let e = ExprCompiler::new(&stream.schema)?.filter(&at.field, text).map_err(|e| locate(at.src, &at.field, e))?;
    let kind = OperatorKind::Filter(CompiledExpr { text: text.to_string(), physical: e });
    Ok(at.operator(kind, &stream.schema))
}

fn plan_select(stream: &mut Stream, items: &[String], at: StepAt) -> Result<OperatorPlan> {
    let compiler = ExprCompiler::new(&stream.schema)?;
    let mut exprs = Vec::new();
    let mut fields: Vec<Arc<Field>> = Vec::new();
    for (j, item) in items.iter().enumerate() {
        let item_field = format!("{}[{j}]", at.field);
        let (e, f) = compiler.select_item(&item_field, item).map_err(|e| locate(at.src, &at.field, e))?;
        if fields.iter().any(|x| x.name() == f.name()) {
            return Err(at.invalid(format!("two items are named `{}`: expected unique names", f.name())));
        }
        // Records were routed by the key's value: a key field may be kept or
        // dropped, but not given a new value.
        if stream.keys.as_ref().is_some_and(|k| k.contains(f.name())) {
            let same = e.downcast_ref::<Column>().map(|c| c.name() == f.name()).unwrap_or(false);
            if !same {
                return Err(at.invalid(format!(
                    "`{}` is a key field of the preceding key_by and cannot be recomputed: name the new value differently",
                    f.name()
                )));
            }
        }
        exprs.push(CompiledExpr { text: item.clone(), physical: e });
        fields.push(f);
    }
    stream.schema = select_schema(&fields);
    Ok(at.operator(OperatorKind::Select(exprs), &stream.schema))
}

fn plan_window(stream: &mut Stream, w: &WindowSpec, at: StepAt) -> Result<OperatorPlan> {
    let schema = stream.schema.clone();
    let key_fields = stream.keys.clone().ok_or_else(|| at.invalid("expected a key_by step before a window".into()))?;
    let et = stream.event_time.clone().ok_or_else(|| at.invalid("expected `event_time` in the pipeline".into()))?;
    let mut key_indices = Vec::new();
    let mut fields: Vec<Arc<Field>> = Vec::new();
    for k in &key_fields {
        let (pos, f) = schema
            .column_with_name(k)
            .ok_or_else(|| at.invalid(format!("the key field `{k}` was dropped by an earlier select: keep it to window per key")))?;
        key_indices.push(pos);
        fields.push(Arc::new(f.clone()));
    }
    let (time_index, _) = schema
        .column_with_name(&et)
        .ok_or_else(|| at.invalid(format!("the event-time field `{et}` was dropped by an earlier select: keep it to window by it")))?;
    fields.push(Arc::new(Field::new("window_start", DataType::Int64, false)));
    fields.push(Arc::new(Field::new("window_end", DataType::Int64, false)));
    let mut aggregates = Vec::new();
    for (j, a) in w.aggregates.iter().enumerate() {
        let Some((name, input, output)) = a.function() else {
            return Err(at.invalid(format!("aggregates[{j}]: expected exactly one of count, sum, min, max, avg")));
        };
        let function = match name {
            "count" => WindowFn::Count,
            "sum" => WindowFn::Sum,
            "min" => WindowFn::Min,
            "max" => WindowFn::Max,
            _ => WindowFn::Avg,
        };
        let (input, input_type) = match input {
            None => (None, DataType::Int64),
            Some(name) => numeric_column(&schema, name, &at, &format!("aggregates[{j}]: "))?,
        };
        let output_type = if function == WindowFn::Avg { DataType::Float64 } else { input_type.clone() };
        if fields.iter().any(|f| f.name() == &output) {
            return Err(at.invalid(format!(
                "aggregates[{j}]: the output field `{output}` is already a field of the window's output: choose another name"
            )));
        }
        fields.push(Arc::new(Field::new(&output, output_type, function != WindowFn::Count)));
        aggregates.push(WindowAggPlan { function, input, input_type });
    }
    let (size_ms, slide_ms, session_gap_ms) = match w.kind() {
        Some(WindowKind::Fixed { size, slide }) => (size as i64, slide as i64, None),
        Some(WindowKind::Session { gap }) => (0, 0, Some(gap as i64)),
        None => return Err(at.invalid("expected one of `tumbling`, `sliding` or `session`".into())),
    };
    stream.schema = Arc::new(Schema::new(fields));
    let kind = OperatorKind::Window(WindowPlan {
        key_indices,
        time_index,
        size_ms,
        slide_ms,
        session_gap_ms,
        allowed_lateness_ms: w.allowed_lateness.get().as_millis() as i64,
        aggregates,
        late_records: w.late_records.clone(),
    });
    Ok(at.operator(kind, &stream.schema))
}

fn plan_running(stream: &mut Stream, function: AggFn, input: Option<&String>, output: String, at: StepAt) -> Result<OperatorPlan> {
    let schema = stream.schema.clone();
    let key_fields = stream.keys.clone().ok_or_else(|| at.invalid("expected a key_by step before a running aggregate".into()))?;
    let mut key_indices = Vec::new();
    for k in &key_fields {
        let (pos, _) = schema
            .column_with_name(k)
            .ok_or_else(|| at.invalid(format!("the key field `{k}` was dropped by an earlier select: keep it to aggregate per key")))?;
        key_indices.push(pos);
    }
    let (input, output_type) = match input {
        None => (None, DataType::Int64),
        Some(name) => numeric_column(&schema, name, &at, "")?,
    };
    if schema.column_with_name(&output).is_some() {
        return Err(at.invalid(format!("the output field `{output}` already exists: choose another name")));
    }
    let mut fields: Vec<Arc<Field>> = schema.fields().iter().cloned().collect();
    fields.push(Arc::new(Field::new(&output, output_type.clone(), function != AggFn::Count)));
    stream.schema = Arc::new(Schema::new(fields));
    let kind = OperatorKind::Running(RunningPlan { key_indices, function, input, output_type });
    Ok(at.operator(kind, &stream.schema))
}

/// The column an aggregate reads and its type, which must be int64 or
/// float64; errors start with `context` (which aggregate of the step).
fn numeric_column(schema: &Schema, name: &str, at: &StepAt, context: &str) -> Result<(Option<usize>, DataType)> {
    let (pos, f) = schema
        .column_with_name(name)
        .ok_or_else(|| at.invalid(format!("{context}no field `{name}`: expected one of {}", names(schema))))?;
    match f.data_type() {
        DataType::Int64 | DataType::Float64 => Ok((Some(pos), f.data_type().clone())),
        other => Err(at.invalid(format!("{context}`{name}` has type {other}: expected int64 or float64"))),
    }
}

/// Adds the file and line to an expression error.
fn locate(src: &PipelineSource, field: &str, e: Error) -> Error {
    match e {
        Error::Expression { expr, message, .. } => Error::Pipeline(src.invalid(field, format!("`{expr}`: {message}"))),
        other => other,
    }
}
