//! From the pipeline as written to the physical plan: stages of chained
//! operators separated by key_by exchanges, with every schema and expression
//! resolved before any process starts.
//!
//! A stage is what one subtask runs in one task: its input (the source, or the
//! exchange from the previous stage), its operators called one after the
//! other, and its output (a hash-partitioned exchange, or the sink). Forward
//! edges never cross a process; only `key_by` does.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion_physical_expr::expressions::Column;
use datafusion_physical_expr::PhysicalExpr;
use weir_api::pipeline::{FieldType, PipelineSource};
use weir_api::{PipelineSpec, SourceSpec, StepKind};

use crate::error::{Error, Result};
use crate::expr::{select_schema, ExprCompiler};
use crate::key_group::is_key_type;

pub const SOURCE_ID: &str = "source";
pub const SINK_ID: &str = "sink";

pub struct JobPlan {
    pub spec: PipelineSpec,
    pub stages: Vec<StagePlan>,
    /// Where sources find event time, when the pipeline has it.
    pub event_time: Option<EventTimePlan>,
}

/// The source's event-time column and how its watermarks follow it.
#[derive(Clone, Debug)]
pub struct EventTimePlan {
    /// The column in the source's schema (int64, epoch milliseconds).
    pub column: usize,
    pub field: String,
    pub max_out_of_orderness_ms: i64,
    pub idle_timeout: Option<std::time::Duration>,
}

pub struct StagePlan {
    pub index: usize,
    pub input_schema: SchemaRef,
    pub operators: Vec<OperatorPlan>,
    pub output: StageOutput,
    pub output_schema: SchemaRef,
}

pub enum StageOutput {
    /// Hash-partition by these columns of `output_schema` into the next stage.
    Exchange { key_indices: Vec<usize> },
    Sink,
}

pub struct OperatorPlan {
    pub id: String,
    /// The step's field in the pipeline (`steps[2].select`), for errors at run time.
    pub step: String,
    pub kind: OperatorKind,
    pub output_schema: SchemaRef,
}

pub enum OperatorKind {
    Filter(CompiledExpr),
    Select(Vec<CompiledExpr>),
    Running(RunningPlan),
    Window(WindowPlan),
}

/// A window function over one column (none for count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowFn {
    Count,
    Sum,
    Min,
    Max,
    Avg,
}

#[derive(Clone, Debug)]
pub struct WindowAggPlan {
    pub function: WindowFn,
    pub input: Option<usize>,
    /// The input column's type (int64 or float64); int64 for count.
    pub input_type: DataType,
}

#[derive(Clone, Debug)]
pub struct WindowPlan {
    pub key_indices: Vec<usize>,
    /// The event-time column in this operator's input.
    pub time_index: usize,
    /// Fixed windows (tumbling, sliding); both 0 for sessions.
    pub size_ms: i64,
    pub slide_ms: i64,
    /// Session windows: the gap that closes a session.
    pub session_gap_ms: Option<i64>,
    pub allowed_lateness_ms: i64,
    pub aggregates: Vec<WindowAggPlan>,
    /// Where late records go besides being counted (a file output).
    pub late_records: Option<weir_api::FileSinkSpec>,
}

/// A compiled expression and the text it was written as, which errors
/// during evaluation quote.
#[derive(Clone)]
pub struct CompiledExpr {
    pub text: String,
    pub physical: Arc<dyn PhysicalExpr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AggFn {
    Count,
    Sum,
    Min,
    Max,
}

pub struct RunningPlan {
    pub key_indices: Vec<usize>,
    pub function: AggFn,
    /// The aggregated column; none for count.
    pub input: Option<usize>,
    pub output_type: DataType,
}

impl std::fmt::Debug for JobPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobPlan").field("job", &self.spec.name).field("stages", &self.stages.len()).finish()
    }
}

/// The state id under which an unaligned checkpoint keeps the records that
/// were in flight towards stage `stage` (every stage but the first has inputs).
pub fn channel_state_id(stage: usize) -> String {
    format!("in-flight-{stage}")
}

/// The state id under which checkpoints keep the side output of window
/// `op`'s late records (its pending files, like the sink's).
pub fn late_records_id(op: &str) -> String {
    format!("late-records-{op}")
}

impl JobPlan {
    /// Every window of the plan with a late-records output: (stage,
    /// position among the stage's operators, operator id, output).
    pub fn late_records_outputs(&self) -> Vec<(usize, usize, String, weir_api::FileSinkSpec)> {
        let mut out = Vec::new();
        for (i, s) in self.stages.iter().enumerate() {
            for (k, o) in s.operators.iter().enumerate() {
                if let OperatorKind::Window(WindowPlan { late_records: Some(spec), .. }) = &o.kind {
                    out.push((i, k, o.id.clone(), spec.clone()));
                }
            }
        }
        out
    }
}

impl JobPlan {
    /// The columns stage `stage`'s input is partitioned by (the key of the
    /// exchange before it); `None` for the first stage.
    pub fn input_key_indices(&self, stage: usize) -> Option<&[usize]> {
        match &self.stages.get(stage.checked_sub(1)?)?.output {
            StageOutput::Exchange { key_indices } => Some(key_indices),
            StageOutput::Sink => None,
        }
    }

    pub fn stage_count(&self) -> usize {
        self.stages.len()
    }

    /// Every operator id that keeps state, with the stage it runs in.
    pub fn stateful_operator_ids(&self) -> Vec<String> {
        let mut ids = vec![SOURCE_ID.to_string(), SINK_ID.to_string()];
        ids.extend((1..self.stages.len()).map(channel_state_id));
        for s in &self.stages {
            for o in &s.operators {
                if matches!(o.kind, OperatorKind::Running(_) | OperatorKind::Window(_)) {
                    ids.push(o.id.clone());
                }
                if let OperatorKind::Window(WindowPlan { late_records: Some(_), .. }) = &o.kind {
                    ids.push(late_records_id(&o.id));
                }
            }
        }
        ids
    }
}

pub fn source_schema(spec: &SourceSpec) -> SchemaRef {
    match spec {
        SourceSpec::Generator(_) => Arc::new(Schema::new(vec![
            Field::new("seq", DataType::Int64, false),
            Field::new("key", DataType::Int64, false),
            Field::new("value", DataType::Int64, false),
        ])),
        SourceSpec::File(weir_api::FileSourceSpec { schema, .. })
        | SourceSpec::Kafka(weir_api::KafkaSourceSpec { schema, .. })
        | SourceSpec::Socket(weir_api::SocketSourceSpec { schema, .. }) => Arc::new(Schema::new(
            schema
                .0
                .iter()
                .map(|(name, ty)| {
                    let dt = match ty {
                        FieldType::Int64 => DataType::Int64,
                        FieldType::Float64 => DataType::Float64,
                        FieldType::String => DataType::Utf8,
                        FieldType::Boolean => DataType::Boolean,
                    };
                    Field::new(name, dt, true)
                })
                .collect::<Vec<_>>(),
        )),
    }
}

/// Plans a parsed pipeline; errors point at the step's line through `src`.
pub fn plan(spec: &PipelineSpec, src: &PipelineSource) -> Result<JobPlan> {
    let Some(chain) = spec.chain() else {
        return Err(Error::Pipeline(src.invalid("sources", "graph pipelines are not planned yet")));
    };
    let mut stages = Vec::new();
    let mut schema = source_schema(chain.source);
    let mut stage_input = schema.clone();
    let mut operators: Vec<OperatorPlan> = Vec::new();
    let mut keys: Option<Vec<String>> = None;

    let event_time = match &spec.event_time {
        None => None,
        Some(et) => {
            let invalid = |msg: String| Error::Pipeline(src.invalid("event_time.field", msg));
            let (column, f) = schema
                .column_with_name(&et.field)
                .ok_or_else(|| invalid(format!("the source has no field `{}`: expected one of {}", et.field, names(&schema))))?;
            if f.data_type() != &DataType::Int64 {
                return Err(invalid(format!("`{}` has type {}: expected int64 (milliseconds since the Unix epoch)", et.field, f.data_type())));
            }
            Some(EventTimePlan {
                column,
                field: et.field.clone(),
                max_out_of_orderness_ms: et.max_out_of_orderness.get().as_millis() as i64,
                idle_timeout: et.idle_timeout.map(|d| d.get()),
            })
        }
    };
    let ids = weir_api::pipeline::step_ids(&spec.steps);
    for ((i, step), id) in spec.steps.iter().enumerate().zip(ids) {
        let field = format!("steps[{i}].{}", step.kind.name());
        let invalid = |msg: String| Error::Pipeline(src.invalid(&field, msg));
        match &step.kind {
            StepKind::KeyBy(fields) => {
                let mut idx = Vec::new();
                for f in fields {
                    let (pos, fld) = schema.column_with_name(f).ok_or_else(|| {
                        invalid(format!("no field `{f}` to key by: expected one of {}", names(&schema)))
                    })?;
                    if !is_key_type(fld.data_type()) {
                        return Err(invalid(format!(
                            "cannot key by `{f}` of type {}: expected int64, float64, string or boolean",
                            fld.data_type()
                        )));
                    }
                    idx.push(pos);
                }
                stages.push(StagePlan {
                    index: stages.len(),
                    input_schema: stage_input.clone(),
                    operators: std::mem::take(&mut operators),
                    output: StageOutput::Exchange { key_indices: idx },
                    output_schema: schema.clone(),
                });
                stage_input = schema.clone();
                keys = Some(fields.clone());
            }
            StepKind::Filter(text) => {
                let e = ExprCompiler::new(&schema)?.filter(&field, text).map_err(|e| locate(src, &field, e))?;
                let kind = OperatorKind::Filter(CompiledExpr { text: text.clone(), physical: e });
                operators.push(OperatorPlan { id, step: field.clone(), kind, output_schema: schema.clone() });
            }
            StepKind::Select(items) => {
                let compiler = ExprCompiler::new(&schema)?;
                let mut exprs = Vec::new();
                let mut fields = Vec::new();
                for (j, item) in items.iter().enumerate() {
                    let item_field = format!("{field}[{j}]");
                    let (e, f) = compiler.select_item(&item_field, item).map_err(|e| locate(src, &field, e))?;
                    if fields.iter().any(|x: &Arc<Field>| x.name() == f.name()) {
                        return Err(invalid(format!("two items are named `{}`: expected unique names", f.name())));
                    }
                    // Records were routed by the key's value: a key field may
                    // be kept or dropped, but not given a new value.
                    if let Some(k) = &keys {
                        if k.contains(f.name()) {
                            let same = e.downcast_ref::<Column>().map(|c| c.name() == f.name()).unwrap_or(false);
                            if !same {
                                return Err(invalid(format!(
                                    "`{}` is a key field of the preceding key_by and cannot be recomputed: name the new value differently",
                                    f.name()
                                )));
                            }
                        }
                    }
                    exprs.push(CompiledExpr { text: item.clone(), physical: e });
                    fields.push(f);
                }
                schema = select_schema(&fields);
                operators.push(OperatorPlan { id, step: field.clone(), kind: OperatorKind::Select(exprs), output_schema: schema.clone() });
            }
            StepKind::Window(w) => {
                let key_fields = keys.clone().ok_or_else(|| invalid("expected a key_by step before a window".into()))?;
                let et = event_time.as_ref().ok_or_else(|| invalid("expected `event_time` in the pipeline".into()))?;
                let mut key_indices = Vec::new();
                let mut fields: Vec<Arc<Field>> = Vec::new();
                for k in &key_fields {
                    let (pos, f) = schema.column_with_name(k).ok_or_else(|| {
                        invalid(format!("the key field `{k}` was dropped by an earlier select: keep it to window per key"))
                    })?;
                    key_indices.push(pos);
                    fields.push(Arc::new(f.clone()));
                }
                let (time_index, _) = schema.column_with_name(&et.field).ok_or_else(|| {
                    invalid(format!("the event-time field `{}` was dropped by an earlier select: keep it to window by it", et.field))
                })?;
                fields.push(Arc::new(Field::new("window_start", DataType::Int64, false)));
                fields.push(Arc::new(Field::new("window_end", DataType::Int64, false)));
                let mut aggregates = Vec::new();
                for (j, a) in w.aggregates.iter().enumerate() {
                    let Some((name, input, output)) = a.function() else {
                        return Err(invalid(format!("aggregates[{j}]: expected exactly one of count, sum, min, max, avg")));
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
                        Some(name) => {
                            let (pos, f) = schema.column_with_name(name).ok_or_else(|| {
                                invalid(format!("aggregates[{j}]: no field `{name}`: expected one of {}", names(&schema)))
                            })?;
                            match f.data_type() {
                                DataType::Int64 | DataType::Float64 => (Some(pos), f.data_type().clone()),
                                other => return Err(invalid(format!("aggregates[{j}]: `{name}` has type {other}: expected int64 or float64"))),
                            }
                        }
                    };
                    let output_type = if function == WindowFn::Avg { DataType::Float64 } else { input_type.clone() };
                    if fields.iter().any(|f| f.name() == &output) {
                        return Err(invalid(format!("aggregates[{j}]: the output field `{output}` is already a field of the window's output: choose another name")));
                    }
                    fields.push(Arc::new(Field::new(&output, output_type, function != WindowFn::Count)));
                    aggregates.push(WindowAggPlan { function, input, input_type });
                }
                let (size, slide, session_gap) = match w.kind() {
                    Some(weir_api::pipeline::WindowKind::Fixed { size, slide }) => (size as i64, slide as i64, None),
                    Some(weir_api::pipeline::WindowKind::Session { gap }) => (0, 0, Some(gap as i64)),
                    None => return Err(invalid("expected one of `tumbling`, `sliding` or `session`".into())),
                };
                schema = Arc::new(Schema::new(fields));
                operators.push(OperatorPlan {
                    id,
                    step: field.clone(),
                    kind: OperatorKind::Window(WindowPlan {
                        key_indices,
                        time_index,
                        size_ms: size,
                        slide_ms: slide,
                        session_gap_ms: session_gap,
                        allowed_lateness_ms: w.allowed_lateness.get().as_millis() as i64,
                        aggregates,
                        late_records: w.late_records.clone(),
                    }),
                    output_schema: schema.clone(),
                });
            }
            StepKind::Union
            | StepKind::Broadcast
            | StepKind::IntervalJoin(_)
            | StepKind::WindowJoin(_)
            | StepKind::Join(_)
            | StepKind::LookupJoin(_) => {
                return Err(invalid(format!("{} steps are not planned yet", step.kind.name())));
            }
            kind => {
                let key_fields = keys.clone().ok_or_else(|| invalid("expected a key_by step before a running aggregate".into()))?;
                let mut key_indices = Vec::new();
                for k in &key_fields {
                    let (pos, _) = schema.column_with_name(k).ok_or_else(|| {
                        invalid(format!("the key field `{k}` was dropped by an earlier select: keep it to aggregate per key"))
                    })?;
                    key_indices.push(pos);
                }
                let (function, input, output) = match kind {
                    StepKind::RunningCount(out) => (AggFn::Count, None, out.clone()),
                    StepKind::RunningSum(a) => (AggFn::Sum, Some(a.field.clone()), a.output.clone().unwrap_or(format!("sum_{}", a.field))),
                    StepKind::RunningMin(a) => (AggFn::Min, Some(a.field.clone()), a.output.clone().unwrap_or(format!("min_{}", a.field))),
                    StepKind::RunningMax(a) => (AggFn::Max, Some(a.field.clone()), a.output.clone().unwrap_or(format!("max_{}", a.field))),
                    _ => unreachable!("every other step kind is matched above"),
                };
                let (input_idx, output_type) = match &input {
                    None => (None, DataType::Int64),
                    Some(name) => {
                        let (pos, f) = schema.column_with_name(name).ok_or_else(|| {
                            invalid(format!("no field `{name}`: expected one of {}", names(&schema)))
                        })?;
                        match f.data_type() {
                            DataType::Int64 | DataType::Float64 => (Some(pos), f.data_type().clone()),
                            other => return Err(invalid(format!("`{name}` has type {other}: expected int64 or float64"))),
                        }
                    }
                };
                if schema.column_with_name(&output).is_some() {
                    return Err(invalid(format!("the output field `{output}` already exists: choose another name")));
                }
                let mut fields: Vec<Arc<Field>> = schema.fields().iter().cloned().collect();
                fields.push(Arc::new(Field::new(&output, output_type.clone(), function != AggFn::Count)));
                schema = Arc::new(Schema::new(fields));
                operators.push(OperatorPlan {
                    id,
                    step: field.clone(),
                    kind: OperatorKind::Running(RunningPlan { key_indices, function, input: input_idx, output_type }),
                    output_schema: schema.clone(),
                });
            }
        }
    }
    stages.push(StagePlan {
        index: stages.len(),
        input_schema: stage_input,
        operators,
        output: StageOutput::Sink,
        output_schema: schema,
    });
    Ok(JobPlan { spec: spec.clone(), stages, event_time })
}

fn names(schema: &Schema) -> String {
    schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", ")
}

/// Adds the file and line to an expression error.
fn locate(src: &PipelineSource, field: &str, e: Error) -> Error {
    match e {
        Error::Expression { expr, message, .. } => Error::Pipeline(src.invalid(field, format!("`{expr}`: {message}"))),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_text(text: &str) -> Result<JobPlan> {
        let src = PipelineSource { file: "p.yaml".into(), text: text.into() };
        let spec = PipelineSpec::from_source(&src)?;
        plan(&spec, &src)
    }

    #[test]
    fn key_by_splits_the_pipeline_into_stages() {
        let p = plan_text("name: t\nsource:\n  generator: {}\nsteps:\n  - filter: value > 3\n  - key_by: key\n  - running_count: count\nsink:\n  blackhole: {}\n").unwrap();
        assert_eq!(p.stages.len(), 2);
        assert_eq!(p.stages[0].operators.len(), 1);
        assert!(matches!(p.stages[0].output, StageOutput::Exchange { ref key_indices } if key_indices == &vec![1]));
        assert_eq!(p.stages[1].output_schema.field(3).name(), "count");
    }

    #[test]
    fn an_expression_error_names_file_line_and_step() {
        let err = plan_text("name: t\nsource:\n  generator: {}\nsteps:\n  - filter: nope > 3\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
        assert!(err.starts_with("p.yaml:5: steps[0].filter"), "{err}");
        assert!(err.contains("nope"), "{err}");
    }

    #[test]
    fn an_event_time_field_that_is_missing_or_not_int64_is_refused_naming_it() {
        let text = |field: &str| format!("name: t\nevent_time: {{field: {field}}}\nsource:\n  file:\n    path: x\n    schema: {{k: int64, s: string}}\nsink:\n  blackhole: {{}}\n");
        let err = plan_text(&text("s")).unwrap_err().to_string();
        assert!(err.contains("event_time.field") && err.contains("expected int64"), "{err}");
        let err = plan_text(&text("nope")).unwrap_err().to_string();
        assert!(err.contains("event_time.field") && err.contains("no field `nope`"), "{err}");
    }

    #[test]
    fn a_window_outputs_keys_bounds_and_aggregates_and_refuses_a_dropped_time_field() {
        let p = plan_text("name: t\nevent_time: {field: value}\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - window: {tumbling: 1s, aggregates: [{count: n}, {avg: {field: seq, as: m}}]}\nsink:\n  blackhole: {}\n").unwrap();
        let names: Vec<_> = p.stages[1].output_schema.fields().iter().map(|f| f.name().clone()).collect();
        assert_eq!(names, ["key", "window_start", "window_end", "n", "m"]);
        assert_eq!(p.stages[1].output_schema.field(4).data_type(), &DataType::Float64);
        let err = plan_text("name: t\nevent_time: {field: value}\nsource:\n  generator: {}\nsteps:\n  - select: [seq, key]\n  - key_by: key\n  - window: {tumbling: 1s, aggregates: [{count: n}]}\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
        assert!(err.contains("steps[2].window") && err.contains("event-time field `value` was dropped"), "{err}");
    }

    #[test]
    fn recomputing_a_key_after_key_by_is_rejected() {
        let err = plan_text("name: t\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - select: [\"key + 1 AS key\", value]\n  - running_count: n\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
        assert!(err.contains("cannot be recomputed"), "{err}");
    }

    #[test]
    fn aggregating_a_string_field_is_rejected_with_the_type() {
        let err = plan_text("name: t\nsource:\n  file:\n    path: x\n    schema: {k: int64, s: string}\nsteps:\n  - key_by: k\n  - running_sum: {field: s}\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
        assert!(err.contains("expected int64 or float64"), "{err}");
    }

    #[test]
    fn the_steps_not_planned_yet_are_refused_naming_the_field() {
        let text = "name: t\nsource:\n  generator: {}\nsteps:\n  - broadcast: {}\nsink:\n  blackhole: {}\n";
        let err = plan_text(text).err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("p.yaml:5: steps[0].broadcast: broadcast steps are not planned yet"));
    }

    #[test]
    fn a_graph_is_refused_naming_the_field() {
        let text = "name: t\nsources:\n  a:\n    generator: {}\nsteps:\n  - {name: f, input: a, filter: value > 3}\nsinks:\n  out:\n    input: f\n    blackhole: {}\n";
        let err = plan_text(text).err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("p.yaml:2: sources: graph pipelines are not planned yet"));
    }
}
