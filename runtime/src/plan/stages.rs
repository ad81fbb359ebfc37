//! Cuts a pipeline's graph into stages (runtime/design/graphs.md §2.3).
//!
//! The nodes are visited inputs first. A source starts a stage. A step
//! with one input is chained into its input's stage when it is that node's
//! only reader; otherwise it starts a stage of its own, fed by a forward
//! edge. A key_by or a broadcast is no operator: it is the kind of edge its
//! readers get (hash or broadcast), so each of them starts a stage. A union
//! starts a stage that reads every input; its gate merges them, so it has
//! no operator either. A join starts a stage reading both inputs over hash
//! edges on their keys, and is its first operator. The sink ends its input's stage as a chained step
//! would, or gets a stage of its own.
//!
//! A chain has no fan-out and no union, so it is cut exactly as before
//! graphs existed: one stage per key_by, plus one. The golden plans
//! (`golden/`) hold that.
//!
//! This module knows the graph's shape and the streams between nodes; what
//! each step computes is `steps.rs`' business.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{Field, Schema, SchemaRef};
use weir_api::pipeline::{Node, NodeRef, PipelineGraph, PipelineSource, SourceNode};
use weir_api::{SinkSpec, StepKind};

use super::joins;
use super::steps::{self, StepAt, Stream};
use super::{
    plan_event_time, source_schema, EdgeKind, OperatorPlan, OutEdge, SinkPlan, SourcePlan, StageInput,
    StageOutput, StagePlan,
};
use crate::error::{Error, Result};

/// What the readers of a node find.
#[derive(Clone)]
enum Output {
    /// The node is the last one of stage `stage` so far.
    Tail { stage: usize, stream: Stream },
    /// The node is a key_by or a broadcast of stage `stage`'s output.
    Edge {
        stage: usize,
        kind: EdgeKind,
        stream: Stream,
    },
}

/// A stage while nodes are still added to it.
struct Building {
    name: String,
    source: Option<SourcePlan>,
    inputs: Vec<StageInput>,
    input_schema: SchemaRef,
    operators: Vec<OperatorPlan>,
    edges: Vec<OutEdge>,
    sink: Option<SinkPlan>,
    output_schema: SchemaRef,
}

struct Cutting<'a> {
    graph: &'a PipelineGraph,
    src: &'a PipelineSource,
    stages: Vec<Building>,
    outputs: HashMap<&'a str, Output>,
}

/// The stages of `graph`, in the order their first node comes in the
/// graph's topological order; every edge goes to a later stage.
pub(super) fn build(graph: &PipelineGraph, src: &PipelineSource) -> Result<Vec<StagePlan>> {
    let mut cutting = Cutting {
        graph,
        src,
        stages: Vec::new(),
        outputs: HashMap::new(),
    };
    for node in graph.topological_order() {
        match node {
            NodeRef::Source(n) => cutting.source(n)?,
            NodeRef::Step(n) => cutting.step(n)?,
            NodeRef::Sink(n) => cutting.sink(n)?,
        }
    }
    Ok(cutting.finish())
}

impl<'a> Cutting<'a> {
    fn source(&mut self, node: &'a Node<SourceNode>) -> Result<()> {
        let schema = source_schema(&node.spec.spec);
        let event_time = plan_event_time(node, &schema, self.src)?;
        let stream = Stream {
            schema: schema.clone(),
            keys: None,
            event_time: event_time.as_ref().map(|e| e.field.clone()),
        };
        let source = SourcePlan {
            name: node.name.clone(),
            state_id: node.state_id.clone(),
            spec: node.spec.spec.clone(),
            event_time,
        };
        let stage = self.open(&node.name, Some(source), Vec::new(), schema);
        self.outputs
            .insert(&node.name, Output::Tail { stage, stream });
        Ok(())
    }

    fn step(&mut self, node: &'a Node<StepKind>) -> Result<()> {
        let at = StepAt {
            id: node.state_id.clone(),
            field: format!("{}.{}", node.path, node.spec.name()),
            src: self.src,
        };
        let output = match &node.spec {
            StepKind::KeyBy(fields) => {
                let (stage, mut stream) = self.tail_of(&node.name, input(node)?)?;
                let key_indices = steps::key_indices(&stream, fields, &at)?;
                stream.keys = Some(fields.clone());
                Output::Edge {
                    stage,
                    kind: EdgeKind::Hash { key_indices },
                    stream,
                }
            }
            StepKind::Broadcast => {
                let (stage, mut stream) = self.tail_of(&node.name, input(node)?)?;
                stream.keys = None;
                Output::Edge {
                    stage,
                    kind: EdgeKind::Broadcast,
                    stream,
                }
            }
            StepKind::Union => self.union(node)?,
            StepKind::IntervalJoin(spec) => self.join(node, |inputs| joins::plan_interval_join(inputs, spec, at))?,
            StepKind::WindowJoin(spec) => self.join(node, |inputs| joins::plan_window_join(inputs, spec, at))?,
            StepKind::Join(spec) => self.join(node, |inputs| joins::plan_regular_join(inputs, spec, at))?,
            kind => {
                let (stage, mut stream) = self.chained(&node.name, input(node)?)?;
                let op = steps::plan_operator(&mut stream, kind, at)?;
                let building = &mut self.stages[stage];
                building.output_schema = op.output_schema.clone();
                building.operators.push(op);
                Output::Tail { stage, stream }
            }
        };
        self.outputs.insert(&node.name, output);
        Ok(())
    }

    fn sink(&mut self, node: &'a Node<SinkSpec>) -> Result<()> {
        let (stage, _) = self.chained(&node.name, input(node)?)?;
        self.stages[stage].sink = Some(SinkPlan { name: node.name.clone(), state_id: node.state_id.clone(), spec: node.spec.clone() });
        Ok(())
    }

    /// A union reads every input over an edge of its own: hash after a
    /// key_by, else forward. Its records are keyed when every input is
    /// keyed by the same fields, and carry event time when every input does.
    fn union(&mut self, node: &'a Node<StepKind>) -> Result<Output> {
        let inputs: Vec<(usize, EdgeKind, Stream, String)> = node
            .inputs
            .iter()
            .map(|i| {
                let (from, kind, stream) = self.edge_from(i)?;
                Ok((from, kind, stream, self.edge_id(i, &node.name)))
            })
            .collect::<Result<_>>()?;
        let first = &inputs[0].2;
        let mut fields: Vec<Field> = first
            .schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        for (k, (_, _, stream, _)) in inputs.iter().enumerate().skip(1) {
            let invalid = |msg: String| {
                Error::Pipeline(self.src.invalid(&format!("{}.input[{k}]", node.path), msg))
            };
            let same = stream.schema.fields().len() == fields.len()
                && stream
                    .schema
                    .fields()
                    .iter()
                    .zip(&fields)
                    .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
            if !same {
                return Err(invalid(format!(
                    "`{}` has fields {} but `{}` has {}: a union takes inputs of one schema",
                    node.inputs[k],
                    field_list(&stream.schema),
                    node.inputs[0],
                    field_list(&first.schema)
                )));
            }
            if stream.event_time != first.event_time {
                let time = |t: &Option<String>| {
                    t.as_ref()
                        .map(|f| format!("event time in `{f}`"))
                        .unwrap_or_else(|| "no event time".into())
                };
                return Err(invalid(format!(
                    "`{}` has {} but `{}` has {}: a union's inputs carry event time in one field, or none does",
                    node.inputs[k],
                    time(&stream.event_time),
                    node.inputs[0],
                    time(&first.event_time)
                )));
            }
            // A field that may be null in one input may be null in the union.
            for (f, g) in fields.iter_mut().zip(stream.schema.fields()) {
                if g.is_nullable() {
                    *f = f.clone().with_nullable(true);
                }
            }
        }
        let keys = first
            .keys
            .clone()
            .filter(|k| inputs.iter().all(|(_, _, s, _)| s.keys.as_ref() == Some(k)));
        let schema: SchemaRef = Arc::new(Schema::new(fields));
        let stream = Stream {
            schema: schema.clone(),
            keys,
            event_time: first.event_time.clone(),
        };
        let stage = self.open(&node.name, None, inputs, schema);
        Ok(Output::Tail { stage, stream })
    }

    /// A join starts a stage that reads its two inputs over hash edges on
    /// their key fields, so that records of one key meet in one subtask;
    /// the join is that stage's first operator.
    fn join(&mut self, node: &'a Node<StepKind>, plan: impl FnOnce(joins::Inputs) -> Result<joins::PlannedJoin>) -> Result<Output> {
        let [left, right] = node.inputs.as_slice() else {
            return Err(Error::Job(format!("{}: `{}` was planned with {} inputs instead of two: was the pipeline checked?", node.path, node.name, node.inputs.len())));
        };
        let (from_left, left_kind, left_stream) = self.edge_from(left)?;
        let (from_right, right_kind, right_stream) = self.edge_from(right)?;
        if left_kind != EdgeKind::Forward || right_kind != EdgeKind::Forward {
            return Err(Error::Job(format!("{}: `{}` reads a key_by or a broadcast: was the pipeline checked?", node.path, node.name)));
        }
        let inputs = joins::Inputs { join: &node.name, left: (left, &left_stream), right: (right, &right_stream) };
        let planned = plan(inputs)?;
        let schema = left_stream.schema.clone();
        let edges = vec![
            (from_left, EdgeKind::Hash { key_indices: planned.left_keys }, left_stream, self.edge_id(left, &node.name)),
            (from_right, EdgeKind::Hash { key_indices: planned.right_keys }, right_stream, self.edge_id(right, &node.name)),
        ];
        let stage = self.open(&node.name, None, edges, schema);
        let building = &mut self.stages[stage];
        building.output_schema = planned.operator.output_schema.clone();
        building.operators.push(planned.operator);
        Ok(Output::Tail { stage, stream: planned.output })
    }

    /// The stage a one-input node runs in: its input's, when it is the
    /// input's only reader and not behind a key_by or broadcast; else a new
    /// stage reading the input over an edge.
    fn chained(&mut self, name: &str, input: &str) -> Result<(usize, Stream)> {
        let only_reader = self.graph.consumers(input).len() == 1;
        self.stage_after(name, input, only_reader)
    }

    /// The stage whose output a key_by or broadcast partitions: its
    /// input's stage (whoever else reads it), or, behind another key_by or
    /// broadcast, a new stage with no operators.
    fn tail_of(&mut self, name: &str, input: &str) -> Result<(usize, Stream)> {
        self.stage_after(name, input, true)
    }

    /// `input`'s stage when `join` and `input` ends one; else a new stage,
    /// named `name`, reading `input` over an edge.
    fn stage_after(&mut self, name: &str, input: &str, join: bool) -> Result<(usize, Stream)> {
        if let (true, Some(Output::Tail { stage, stream })) = (join, self.outputs.get(input)) {
            return Ok((*stage, stream.clone()));
        }
        let (from, kind, stream) = self.edge_from(input)?;
        let schema = stream.schema.clone();
        let edge_id = self.edge_id(input, name);
        let stage = self.open(name, None, vec![(from, kind, stream.clone(), edge_id)], schema);
        Ok((stage, stream))
    }

    /// The name of the edge from `input` to its reader `reader` (see
    /// `StageInput::edge_id`): `input` alone when it has one reader, so
    /// that a step inserted before the reader keeps the name.
    fn edge_id(&self, input: &str, reader: &str) -> String {
        if self.graph.consumers(input).len() == 1 {
            input.to_string()
        } else {
            format!("{input} to {reader}")
        }
    }

    /// How a new reader of `input` is fed: from which stage, over which edge.
    fn edge_from(&self, input: &str) -> Result<(usize, EdgeKind, Stream)> {
        match self.outputs.get(input) {
            Some(Output::Tail { stage, stream }) => Ok((*stage, EdgeKind::Forward, stream.clone())),
            Some(Output::Edge { stage, kind, stream }) => Ok((*stage, kind.clone(), stream.clone())),
            // The topological order visits inputs first, so only an
            // unchecked graph (an unknown input, a cycle) gets here.
            None => Err(Error::Job(format!("the planner reached a reader of `{input}` before `{input}`: was the pipeline checked?"))),
        }
    }

    /// A new stage reading `inputs` (from stage, edge kind, the stream on it).
    fn open(
        &mut self,
        name: &str,
        source: Option<SourcePlan>,
        inputs: Vec<(usize, EdgeKind, Stream, String)>,
        schema: SchemaRef,
    ) -> usize {
        let index = self.stages.len();
        let mut stage_inputs = Vec::with_capacity(inputs.len());
        for (k, (from, kind, stream, edge_id)) in inputs.into_iter().enumerate() {
            let keys = match &kind {
                EdgeKind::Hash { key_indices } => Some(key_indices.clone()),
                EdgeKind::Broadcast => None,
                EdgeKind::Forward => stream.keys.as_ref().and_then(|names| {
                    names.iter().map(|n| stream.schema.index_of(n).ok()).collect()
                }),
            };
            self.stages[from].edges.push(OutEdge {
                to_stage: index,
                input: k,
                kind: kind.clone(),
            });
            stage_inputs.push(StageInput {
                from_stage: from,
                schema: stream.schema,
                edge: kind,
                keys,
                edge_id,
            });
        }
        self.stages.push(Building {
            name: name.to_string(),
            source,
            inputs: stage_inputs,
            input_schema: schema.clone(),
            operators: Vec::new(),
            edges: Vec::new(),
            sink: None,
            output_schema: schema,
        });
        index
    }

    fn finish(self) -> Vec<StagePlan> {
        self.stages
            .into_iter()
            .enumerate()
            .map(|(index, b)| StagePlan {
                index,
                name: b.name,
                source: b.source,
                inputs: b.inputs,
                input_schema: b.input_schema,
                operators: b.operators,
                output: match b.sink {
                    Some(sink) => StageOutput::Sink(sink),
                    None => StageOutput::Edges(b.edges),
                },
                output_schema: b.output_schema,
            })
            .collect()
    }
}

/// The one input of a one-input node (a checked graph gives each one).
fn input<T>(node: &Node<T>) -> Result<&str> {
    match node.inputs.as_slice() {
        [one] => Ok(one),
        _ => Err(Error::Job(format!(
            "{}: `{}` was planned with {} inputs instead of one: was the pipeline checked?",
            node.path,
            node.name,
            node.inputs.len()
        ))),
    }
}

/// `(seq int64, key int64)`, as errors show a schema.
fn field_list(schema: &Schema) -> String {
    let f: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect();
    format!("({})", f.join(", "))
}
