//! From the pipeline as written to the physical plan: stages of chained
//! operators joined by edges, with every schema and expression resolved
//! before any process starts.
//!
//! A stage is what one subtask runs in one task: its input (a source, or the
//! edges from the stages it reads), its operators called one after the
//! other, and its output (edges into other stages, or the sink). A forward
//! edge goes from subtask i to subtask i, which slot sharing keeps in one
//! process; hash (`key_by`) and broadcast edges cross processes.
//! `stages.rs` decides where stages begin and end.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion_physical_expr::PhysicalExpr;
use weir_api::pipeline::{FieldType, PipelineSource};
use weir_api::pipeline::{Node, SourceNode};
use weir_api::{PipelineSpec, SourceSpec};

use crate::error::{Error, Result};

mod describe;
#[cfg(test)]
mod golden;
mod joins;
mod stages;
mod steps;

pub(crate) use joins::user_type;

pub struct JobPlan {
    pub spec: PipelineSpec,
    /// In the order of the graph's nodes (inputs first); a stage only reads
    /// stages before it.
    pub stages: Vec<StagePlan>,
}

/// A source: what it reads, where its positions are kept, and where its
/// records carry their event time.
#[derive(Clone, Debug)]
pub struct SourcePlan {
    pub name: String,
    /// Its positions' id in checkpoints: `source` in a chain, its name in a graph.
    pub state_id: String,
    pub spec: SourceSpec,
    pub event_time: Option<EventTimePlan>,
}

/// The job's sink: where it writes and where its pending output is kept.
#[derive(Clone, Debug)]
pub struct SinkPlan {
    pub name: String,
    /// Its pending output's id in checkpoints: `sink` in a chain, its name in a graph.
    pub state_id: String,
    pub spec: weir_api::SinkSpec,
}

/// A source's event-time column and how its watermarks follow it.
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
    /// The name of the node the stage starts with, for logs and errors.
    pub name: String,
    /// Set for a stage that reads a source (and then has no inputs).
    pub source: Option<SourcePlan>,
    /// The edges the stage reads, input k from `inputs[k]`; all of one
    /// schema (a union merges them; joins come later).
    pub inputs: Vec<StageInput>,
    /// What the first operator reads: the source's or the inputs' schema.
    pub input_schema: SchemaRef,
    pub operators: Vec<OperatorPlan>,
    pub output: StageOutput,
    pub output_schema: SchemaRef,
}

/// One input of a stage: the stage it reads and how records are routed.
#[derive(Clone, Debug)]
pub struct StageInput {
    pub from_stage: usize,
    /// The records' schema: the upstream stage's output.
    pub schema: SchemaRef,
    pub edge: EdgeKind,
    /// The key fields (indices into `schema`) when the records on this
    /// edge are keyed: a hash edge's own keys, or the keys of a keyed
    /// stream that a forward edge carries. A rescaled restore re-partitions
    /// the records that were in flight on the edge by them.
    pub keys: Option<Vec<usize>>,
    /// What flows on the edge, by a name that stays when stages are
    /// renumbered: the node whose output it carries, and the reader when
    /// that node has several. Records in flight on an edge restore only
    /// into an input of the same name (`in_flight_edge` below).
    pub edge_id: String,
}

/// The schema metadata key under which a checkpoint's records in flight
/// name the edge they were on.
pub const IN_FLIGHT_EDGE: &str = "weir.in_flight_edge";

/// How an upstream subtask's records reach the downstream subtasks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EdgeKind {
    /// Subtask i to subtask i, in one process.
    Forward,
    /// To the subtask owning each record's key group, by these columns of
    /// the upstream stage's output.
    Hash { key_indices: Vec<usize> },
    /// Every record to every subtask.
    Broadcast,
}

/// An edge out of a stage, as its reader's input `input` sees it.
#[derive(Clone, Debug)]
pub struct OutEdge {
    pub to_stage: usize,
    pub input: usize,
    pub kind: EdgeKind,
}

pub enum StageOutput {
    /// Into the stages that read this one, each record once per edge.
    Edges(Vec<OutEdge>),
    /// Into a sink of the job (a job may have several, each ending a stage).
    Sink(SinkPlan),
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
    /// The first operator of its stage: it reads the stage's two inputs
    /// (left, right) apart.
    IntervalJoin(IntervalJoinPlan),
    /// Like the interval join, the first operator of its stage.
    WindowJoin(WindowJoinPlan),
    /// A regular join, likewise.
    Join(RegularJoinPlan),
    /// A lookup join: one input, chained like a filter, no state.
    LookupJoin(LookupPlan),
}

impl OperatorKind {
    /// Whether the operator reads its stage's inputs apart (a join), rather
    /// than one stream that a union merged.
    pub fn reads_inputs_apart(&self) -> bool {
        matches!(self, OperatorKind::IntervalJoin(_) | OperatorKind::WindowJoin(_) | OperatorKind::Join(_))
    }
}

impl OperatorPlan {
    /// The ids the operator keeps state under in checkpoints: its own for
    /// an aggregate, one per side for a join (`<id>.left`, `<id>.right`;
    /// node names cannot hold a `.`, so these never clash with another
    /// node's), none when stateless.
    pub fn state_ids(&self) -> Vec<String> {
        match &self.kind {
            OperatorKind::Running(_) | OperatorKind::Window(_) => vec![self.id.clone()],
            OperatorKind::IntervalJoin(_) | OperatorKind::WindowJoin(_) | OperatorKind::Join(_) => vec![format!("{}.left", self.id), format!("{}.right", self.id)],
            OperatorKind::Filter(_) | OperatorKind::Select(_) | OperatorKind::LookupJoin(_) => Vec::new(),
        }
    }
}

/// One input of a join: its records' schema, the key columns it is
/// partitioned and matched by, and its event-time column.
#[derive(Clone, Debug)]
pub struct JoinSide {
    /// The input's node, as the output's renamed fields and errors name it.
    pub name: String,
    pub schema: SchemaRef,
    pub key_indices: Vec<usize>,
    /// The event-time column, for the joins by time.
    pub time_index: Option<usize>,
}

/// Pairs of a left and a right record of one key with `right.t` in
/// `[left.t + lower_ms, left.t + upper_ms]`.
#[derive(Clone, Debug)]
pub struct IntervalJoinPlan {
    pub left: JoinSide,
    pub right: JoinSide,
    pub lower_ms: i64,
    pub upper_ms: i64,
    /// A left record that found no right one is output with null right
    /// fields once its interval has passed.
    pub left_outer: bool,
}

/// Pairs of a left and a right record of one key in one event-time window,
/// output when the watermark closes the window.
#[derive(Clone, Debug)]
pub struct WindowJoinPlan {
    pub left: JoinSide,
    pub right: JoinSide,
    /// Fixed windows (tumbling, sliding); both 0 for sessions.
    pub size_ms: i64,
    pub slide_ms: i64,
    /// Session windows, merged over the records of both sides.
    pub session_gap_ms: Option<i64>,
}

/// Every pair of a left and a right record of one key, output when the
/// second of them arrives; each record is kept `ttl_ms` after it arrived.
#[derive(Clone, Debug)]
pub struct RegularJoinPlan {
    pub left: JoinSide,
    pub right: JoinSide,
    pub ttl_ms: i64,
}

/// Each record joined with the rows of a PostgreSQL table whose key
/// columns equal the record's `on` fields, fetched per batch for the keys
/// not cached. The output is the record's fields, then `columns`.
#[derive(Clone, Debug)]
pub struct LookupPlan {
    /// The records' key columns (int64, string or boolean), in `key` order.
    pub key_indices: Vec<usize>,
    pub connection: String,
    /// As written (`NAME` or `SCHEMA.NAME`).
    pub table: String,
    /// The table's key columns, matched against `key_indices` in order.
    pub key_columns: Vec<String>,
    /// The table's columns added to each record, with the type each is read as.
    pub columns: Vec<(String, DataType)>,
    pub max_rows: usize,
    pub ttl_ms: u64,
    /// A record without a row: kept with null columns (`missing: keep`),
    /// else dropped.
    pub keep_missing: bool,
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
/// were in flight towards input `input` of stage `stage`. Input 0 keeps the
/// name it had before stages had several inputs, so that checkpoints of
/// chains taken then still restore.
pub fn channel_state_id(stage: usize, input: usize) -> String {
    match input {
        0 => format!("in-flight-{stage}"),
        k => format!("in-flight-{stage}.{k}"),
    }
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
    /// The job's sinks, in the order of their stages.
    pub fn sinks(&self) -> impl Iterator<Item = &SinkPlan> {
        self.stages.iter().filter_map(|s| match &s.output {
            StageOutput::Sink(sink) => Some(sink),
            StageOutput::Edges(_) => None,
        })
    }

    pub fn stage_count(&self) -> usize {
        self.stages.len()
    }

    /// The stages that read a source, with the source.
    pub fn sources(&self) -> impl Iterator<Item = (usize, &SourcePlan)> {
        self.stages.iter().filter_map(|s| s.source.as_ref().map(|src| (s.index, src)))
    }

    /// Every id a snapshot of the job keeps state under.
    pub fn stateful_operator_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.sources().map(|(_, s)| s.state_id.clone()).collect();
        ids.extend(self.sinks().map(|s| s.state_id.clone()));
        ids.extend(self.stages.iter().flat_map(|s| (0..s.inputs.len()).map(|k| channel_state_id(s.index, k))));
        for s in &self.stages {
            for o in &s.operators {
                ids.extend(o.state_ids());
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
                    Field::new(name, arrow_type(*ty), true)
                })
                .collect::<Vec<_>>(),
        )),
    }
}

/// Plans a parsed pipeline; errors point at the step's line through `src`.
///
/// Both forms of a pipeline are planned from their graph; `stages.rs` cuts
/// it into stages.
pub fn plan(spec: &PipelineSpec, src: &PipelineSource) -> Result<JobPlan> {
    let graph = spec.runnable_graph().map_err(|e| Error::Pipeline(src.invalid(&e.field, e.message)))?;
    let stages = stages::build(&graph, src)?;
    Ok(JobPlan { spec: spec.clone(), stages })
}

/// Where the source's records carry their event time, checked against the
/// source's schema.
pub(super) fn plan_event_time(source: &Node<SourceNode>, schema: &Schema, src: &PipelineSource) -> Result<Option<EventTimePlan>> {
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

/// The Arrow type of a field declared in a pipeline (a source's schema, a
/// lookup join's columns).
pub(crate) fn arrow_type(ty: FieldType) -> DataType {
    match ty {
        FieldType::Int64 => DataType::Int64,
        FieldType::Float64 => DataType::Float64,
        FieldType::String => DataType::Utf8,
        FieldType::Boolean => DataType::Boolean,
    }
}
