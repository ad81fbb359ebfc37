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
use datafusion_physical_expr::PhysicalExpr;
use weir_api::pipeline::{FieldType, PipelineSource};
use weir_api::pipeline::{Node, SourceNode};
use weir_api::{PipelineSpec, SourceSpec, StepKind};

use crate::error::{Error, Result};
use steps::{Stream, StepAt};

mod describe;
#[cfg(test)]
mod golden;
mod steps;

pub struct JobPlan {
    pub spec: PipelineSpec,
    pub source: SourcePlan,
    pub sink: SinkPlan,
    pub stages: Vec<StagePlan>,
    /// Where sources find event time, when the pipeline has it.
    pub event_time: Option<EventTimePlan>,
}

/// The job's source: what it reads and where its positions are kept.
#[derive(Clone, Debug)]
pub struct SourcePlan {
    pub name: String,
    /// Its positions' id in checkpoints: `source` in a chain, its name in a graph.
    pub state_id: String,
    pub spec: SourceSpec,
}

/// The job's sink: where it writes and where its pending output is kept.
#[derive(Clone, Debug)]
pub struct SinkPlan {
    pub name: String,
    /// Its pending output's id in checkpoints: `sink` in a chain, its name in a graph.
    pub state_id: String,
    pub spec: weir_api::SinkSpec,
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
        let mut ids = vec![self.source.state_id.clone(), self.sink.state_id.clone()];
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
///
/// Both forms of a pipeline are planned from its graph, which must be one
/// path so far. Steps are chained into one stage until a key_by, which ends
/// the stage with a hash exchange; the last stage ends in the sink.
pub fn plan(spec: &PipelineSpec, src: &PipelineSource) -> Result<JobPlan> {
    let graph = spec.graph();
    let path = graph.as_path().map_err(|e| Error::Pipeline(src.invalid(&e.field, e.message)))?;
    let source = source_schema(&path.source.spec.spec);
    let event_time = plan_event_time(path.source, &source, src)?;
    let mut stream = Stream { schema: source.clone(), keys: None };
    let mut stages = Vec::new();
    let mut stage_input = source;
    let mut operators: Vec<OperatorPlan> = Vec::new();
    for step in &path.steps {
        let field = format!("{}.{}", step.path, step.spec.name());
        let at = StepAt { id: step.state_id.clone(), field, src, event_time: event_time.as_ref() };
        if let StepKind::KeyBy(fields) = &step.spec {
            let key_indices = steps::key_indices(&stream, fields, &at)?;
            stages.push(StagePlan {
                index: stages.len(),
                input_schema: stage_input,
                operators: std::mem::take(&mut operators),
                output: StageOutput::Exchange { key_indices },
                output_schema: stream.schema.clone(),
            });
            stage_input = stream.schema.clone();
            stream.keys = Some(fields.clone());
        } else {
            operators.push(steps::plan_operator(&mut stream, &step.spec, at)?);
        }
    }
    stages.push(StagePlan {
        index: stages.len(),
        input_schema: stage_input,
        operators,
        output: StageOutput::Sink,
        output_schema: stream.schema,
    });
    let source = SourcePlan { name: path.source.name.clone(), state_id: path.source.state_id.clone(), spec: path.source.spec.spec.clone() };
    let sink = SinkPlan { name: path.sink.name.clone(), state_id: path.sink.state_id.clone(), spec: path.sink.spec.clone() };
    Ok(JobPlan { spec: spec.clone(), source, sink, stages, event_time })
}

/// Where the source's records carry their event time, checked against the
/// source's schema.
fn plan_event_time(source: &Node<SourceNode>, schema: &Schema, src: &PipelineSource) -> Result<Option<EventTimePlan>> {
    let Some(et) = &source.spec.event_time else { return Ok(None) };
    // A chain writes it at the top (`event_time`), a graph under its source.
    let field = if source.path == "source" { "event_time.field".to_string() } else { format!("{}.event_time.field", source.path) };
    let invalid = |msg: String| Error::Pipeline(src.invalid(&field, msg));
    let (column, f) = schema
        .column_with_name(&et.field)
        .ok_or_else(|| invalid(format!("the source has no field `{}`: expected one of {}", et.field, names(schema))))?;
    if f.data_type() != &DataType::Int64 {
        return Err(invalid(format!("`{}` has type {}: expected int64 (milliseconds since the Unix epoch)", et.field, f.data_type())));
    }
    Ok(Some(EventTimePlan {
        column,
        field: et.field.clone(),
        max_out_of_orderness_ms: et.max_out_of_orderness.get().as_millis() as i64,
        idle_timeout: et.idle_timeout.map(|d| d.get()),
    }))
}

fn names(schema: &Schema) -> String {
    schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests;
