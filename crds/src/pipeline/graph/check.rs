//! The structural checks of a pipeline graph, before any process starts:
//! one form only, names, inputs, arity, cycles, nodes nobody reads, keyed
//! steps, join inputs, event time and outputs. Checks that need schemas
//! (union schemas, join key types) are the runtime planner's.
//!
//! Errors name the field (`steps[3].input[1]`) and start with the node's
//! name, since a graph's nodes are found by name.

use std::collections::HashMap;

use super::{Node, NodeRef, PipelineGraph};
use crate::pipeline::step::{check_kind, Arity};
use crate::pipeline::{PipelineError, PipelineSource, PipelineSpec, SinkSpec, StepKind, WindowSpec};

/// A pipeline is a chain (`source:` + `sink:`) or a graph (`sources:` +
/// `sinks:`), and a graph's event time is written on its sources.
pub(in crate::pipeline) fn check_form(spec: &PipelineSpec, src: &PipelineSource) -> Result<(), PipelineError> {
    let chain = spec.source.is_some() || spec.sink.is_some();
    if chain && spec.is_graph() {
        return Err(src.invalid("sources", "a pipeline has `source:` + `sink:` (a chain) or `sources:` + `sinks:` (a graph), not both"));
    }
    let missing = if !chain && !spec.is_graph() {
        Some(("source", "expected `source:` and `sink:` (a chain) or `sources:` and `sinks:` (a graph)"))
    } else if chain && spec.source.is_none() {
        Some(("source", "a chain reads one `source:`"))
    } else if chain && spec.sink.is_none() {
        Some(("sink", "a chain writes to one `sink:`"))
    } else if spec.is_graph() && spec.sources.is_empty() {
        Some(("sources", "a graph reads at least one source"))
    } else if spec.is_graph() && spec.sinks.is_empty() {
        Some(("sinks", "a graph writes to at least one sink"))
    } else {
        None
    };
    if let Some((field, expected)) = missing {
        return Err(src.invalid(field, format!("missing: {expected}")));
    }
    if spec.is_graph() && spec.event_time.is_some() {
        return Err(src.invalid("event_time", "a graph's sources each have their own; move it to sources.<name>.event_time"));
    }
    Ok(())
}

impl PipelineSpec {
    /// Checks the pipeline's structure: the form, and for a graph every
    /// check of the design's table (graphs.md §1.4), in the order below.
    /// A chain's structure is checked by the chain's own checks, with the
    /// messages it has always had.
    pub fn validate_graph(&self, src: &PipelineSource) -> Result<(), PipelineError> {
        check_form(self, src)?;
        if !self.is_graph() {
            return Ok(());
        }
        let graph = self.graph();
        check_names(&graph, self, src)?;
        check_inputs(&graph, src)?;
        check_cycles(&graph, src)?;
        check_read(&graph, src)?;
        for step in &graph.steps {
            check_kind(&step.spec, src, &kind_field(step), Some(&step.name))?;
        }
        check_keys(&graph, src)?;
        check_event_time(&graph, src)?;
        for source in &graph.sources {
            source.spec.spec.validate(src, &source.path)?;
        }
        for sink in &graph.sinks {
            sink.spec.validate(src, &sink.path, &self.checkpoint)?;
        }
        check_outputs(&graph, src)
    }
}

/// `steps[2].window`: where a step's settings are.
fn kind_field(step: &Node<StepKind>) -> String {
    format!("{}.{}", step.path, step.spec.name())
}

/// The field of a node's `k`th input: `steps[3].input[1]`, or
/// `steps[3].input` when it reads one node (as a sink always does).
fn input_field(node: NodeRef, k: usize) -> String {
    match node.inputs().len() {
        1 => format!("{}.input", node.path()),
        _ => format!("{}.input[{k}]", node.path()),
    }
}

const MAX_NAME: usize = 63;
const RESERVED: [&str; 2] = ["in-flight-", "late-records-"];

/// Why `name` cannot name a node, if it cannot: names become state ids and
/// parts of storage paths, so they are kept to what is safe in both.
fn bad_name(name: &str) -> Option<String> {
    let mut chars = name.chars();
    let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !well_formed {
        Some("expected a letter, then letters, digits, - or _".into())
    } else if name.len() > MAX_NAME {
        Some(format!("expected at most {MAX_NAME} characters"))
    } else if RESERVED.iter().any(|r| name.starts_with(r)) {
        Some("names starting with in-flight- or late-records- are the runtime's own state ids".into())
    } else {
        None
    }
}

/// Every name and written id is well formed, every name names one node,
/// and every state id belongs to one node.
fn check_names(graph: &PipelineGraph, spec: &PipelineSpec, src: &PipelineSource) -> Result<(), PipelineError> {
    let bad = |field: &str, what: &str, name: &str| bad_name(name).map(|why| src.invalid(field, format!("`{name}` is not {what}: {why}")));
    for node in graph.sources.iter().map(NodeRef::Source).chain(graph.sinks.iter().map(NodeRef::Sink)) {
        if let Some(e) = bad(node.path(), "a node name", node.name()) {
            return Err(e);
        }
    }
    for (node, step) in graph.steps.iter().zip(&spec.steps) {
        if let Some(e) = step.name.as_deref().and_then(|n| bad(&format!("{}.name", node.path), "a node name", n)) {
            return Err(e);
        }
        if let Some(e) = step.id.as_deref().and_then(|id| bad(&format!("{}.id", node.path), "an id", id)) {
            return Err(e);
        }
    }
    let mut names: HashMap<&str, &str> = HashMap::new();
    let mut state_ids: HashMap<&str, &str> = HashMap::new();
    for node in graph.nodes() {
        if let Some(other) = names.insert(node.name(), node.path()) {
            return Err(src.invalid(node.path(), format!("`{}` is also the name of {other}: expected each name once", node.name())));
        }
        if let Some(other) = state_ids.insert(node.state_id(), node.path()) {
            return Err(src.invalid(
                &format!("{}.id", node.path()),
                format!("`{}`: id `{}` is also the state id of {other}: expected unique ids", node.name(), node.state_id()),
            ));
        }
    }
    Ok(())
}

/// Every step names its inputs, every input is a source or a step, and
/// every step reads as many inputs as its kind takes.
fn check_inputs(graph: &PipelineGraph, src: &PipelineSource) -> Result<(), PipelineError> {
    let readable: Vec<&str> = graph.sources.iter().map(|s| s.name.as_str()).chain(graph.steps.iter().map(|s| s.name.as_str())).collect();
    let readers = graph.steps.iter().map(NodeRef::Step).chain(graph.sinks.iter().map(NodeRef::Sink));
    for node in readers {
        if node.inputs().is_empty() {
            return Err(src.invalid(&format!("{}.input", node.path()), "missing: a step of a graph names its input(s)"));
        }
        for (k, input) in node.inputs().iter().enumerate() {
            if graph.sinks.iter().any(|s| s.name == *input) {
                return Err(src.invalid(&input_field(node, k), format!("`{input}` is a sink: nothing reads from a sink")));
            }
            if !readable.contains(&input.as_str()) {
                return Err(src.invalid(
                    &input_field(node, k),
                    format!("`{input}`: no such source or step: expected one of {}", readable.join(", ")),
                ));
            }
        }
        if let NodeRef::Step(step) = node {
            let arity = step.spec.inputs();
            if !arity.accepts(step.inputs.len()) {
                return Err(src.invalid(
                    &format!("{}.input", step.path),
                    format!("`{}`: {} takes {}, got {}", step.name, step.spec.name(), arity.describe(), step.inputs.len()),
                ));
            }
        }
    }
    Ok(())
}

/// The steps form a DAG. A cycle is reported from its step written first,
/// in the direction records would flow.
fn check_cycles(graph: &PipelineGraph, src: &PipelineSource) -> Result<(), PipelineError> {
    let Some(cycle) = find_cycle(graph) else { return Ok(()) };
    let first = &graph.steps[cycle[0]];
    let flow: Vec<String> = std::iter::once(cycle[0])
        .chain(cycle[1..].iter().rev().copied())
        .chain(std::iter::once(cycle[0]))
        .map(|i| format!("`{}`", graph.steps[i].name))
        .collect();
    let reads = &graph.steps[cycle.get(1).copied().unwrap_or(cycle[0])].name;
    let k = first.inputs.iter().position(|i| i == reads).unwrap_or_default();
    Err(src.invalid(
        &input_field(NodeRef::Step(first), k),
        format!("{} is a cycle: the steps of a pipeline form a DAG", flow.join(" → ")),
    ))
}

/// A cycle as step indices, each reading the next and the last reading the
/// first, starting at the one written first. Every step Kahn's order leaves
/// out reads another one it leaves out, so walking such inputs from any of
/// them comes round to a step already seen: that loop is a cycle.
fn find_cycle(graph: &PipelineGraph) -> Option<Vec<usize>> {
    let ordered: Vec<&str> = graph.topological_order().iter().map(|n| n.name()).collect();
    let left: Vec<usize> = (0..graph.steps.len()).filter(|&i| !ordered.contains(&graph.steps[i].name.as_str())).collect();
    let mut walk = vec![*left.first()?];
    loop {
        let here = &graph.steps[*walk.last()?];
        let next = here.inputs.iter().find_map(|input| left.iter().copied().find(|&j| graph.steps[j].name == *input))?;
        if let Some(start) = walk.iter().position(|&i| i == next) {
            let mut cycle = walk.split_off(start);
            let first = cycle.iter().enumerate().min_by_key(|(_, i)| **i).map(|(at, _)| at).unwrap_or_default();
            cycle.rotate_left(first);
            return Some(cycle);
        }
        walk.push(next);
    }
}

/// Every source and step is read by something: output nobody reads is a
/// mistake, not a way to discard records (`blackhole` is that).
fn check_read(graph: &PipelineGraph, src: &PipelineSource) -> Result<(), PipelineError> {
    let producers = graph.sources.iter().map(NodeRef::Source).chain(graph.steps.iter().map(NodeRef::Step));
    for node in producers {
        if graph.consumers(node.name()).is_empty() {
            let name = node.name();
            return Err(src.invalid(
                node.path(),
                format!("`{name}`: nothing reads its output: add a sink with `input: {name}`, or remove it"),
            ));
        }
    }
    Ok(())
}

/// The fields each node's records are partitioned by, if any: a key_by's,
/// a join's left keys, a union's when all its inputs share them, and a
/// one-input step's input's (a broadcast's none).
fn keys_of(graph: &PipelineGraph) -> HashMap<&str, Option<&[String]>> {
    let mut keys: HashMap<&str, Option<&[String]>> = HashMap::new();
    for node in graph.topological_order() {
        let NodeRef::Step(step) = node else {
            keys.insert(node.name(), None);
            continue;
        };
        let of = |input: &String| keys.get(input.as_str()).copied().flatten();
        let k = match &step.spec {
            StepKind::KeyBy(fields) => Some(fields.as_slice()),
            StepKind::Broadcast => None,
            StepKind::Union => {
                let first = step.inputs.first().and_then(of);
                first.filter(|f| step.inputs.iter().all(|i| of(i) == Some(*f)))
            }
            kind => match kind.join_keys() {
                Some((left, _)) => Some(left),
                None => step.inputs.first().and_then(of),
            },
        };
        keys.insert(&step.name, k);
    }
    keys
}

/// Steps that keep state per key read keyed records; joins read the
/// records before any key_by, since they partition by `on` themselves.
fn check_keys(graph: &PipelineGraph, src: &PipelineSource) -> Result<(), PipelineError> {
    let keys = keys_of(graph);
    for step in &graph.steps {
        let keyed = step.inputs.first().and_then(|i| keys.get(i.as_str()).copied().flatten()).is_some();
        if step.spec.is_keyed_aggregate() && !keyed {
            return Err(src.invalid(
                &kind_field(step),
                format!("`{}` keeps state per key: expected its input to be a key_by (or keyed)", step.name),
            ));
        }
        if step.spec.inputs() != Arity::Two {
            continue;
        }
        for (k, input) in step.inputs.iter().enumerate() {
            if let Some(NodeRef::Step(Node { spec: StepKind::KeyBy(_), .. })) = graph.node(input) {
                return Err(src.invalid(
                    &input_field(NodeRef::Step(step), k),
                    format!("`{input}` is a key_by: a join partitions its inputs by `on` itself; name its input instead"),
                ));
            }
        }
    }
    Ok(())
}

/// Windows and the joins by time fire by event time: every source they
/// read, however far upstream, has `event_time`.
fn check_event_time(graph: &PipelineGraph, src: &PipelineSource) -> Result<(), PipelineError> {
    for step in &graph.steps {
        if !matches!(step.spec, StepKind::Window(_) | StepKind::WindowJoin(_) | StepKind::IntervalJoin(_)) {
            continue;
        }
        if let Some(source) = upstream_sources(graph, step).into_iter().find(|s| s.spec.event_time.is_none()) {
            return Err(src.invalid(
                &kind_field(step),
                format!(
                    "`{}` works by event time, but it reads the source `{}`, which has none: expected `event_time: {{field: <int64 field, epoch milliseconds>}}` in {}",
                    step.name, source.name, source.path
                ),
            ));
        }
    }
    Ok(())
}

/// The sources whose records reach `step`, in the order written.
fn upstream_sources<'a>(graph: &'a PipelineGraph, step: &Node<StepKind>) -> Vec<&'a Node<crate::pipeline::SourceNode>> {
    let mut seen: Vec<&str> = Vec::new();
    let mut todo: Vec<&str> = step.inputs.iter().map(String::as_str).collect();
    while let Some(name) = todo.pop() {
        if seen.contains(&name) {
            continue;
        }
        seen.push(name);
        if let Some(node) = graph.node(name) {
            todo.extend(node.inputs().iter().map(String::as_str));
        }
    }
    graph.sources.iter().filter(|s| seen.contains(&s.name.as_str())).collect()
}

/// Every file sink and late-records output has a directory of its own: a
/// sink cleaning up after a failure takes the files of its job in its
/// directory for its own.
fn check_outputs(graph: &PipelineGraph, src: &PipelineSource) -> Result<(), PipelineError> {
    let same = |p: &str| p.trim_start_matches("./").trim_end_matches('/').to_string();
    let mut outputs: Vec<(String, String)> = Vec::new();
    for sink in &graph.sinks {
        let SinkSpec::File(f) = &sink.spec else { continue };
        let field = format!("{}.file.path", sink.path);
        if let Some((_, other)) = outputs.iter().find(|(o, _)| *o == same(&f.path)) {
            return Err(src.invalid(&field, format!("{:?} is also `{other}`: expected a directory of its own for each file sink", f.path)));
        }
        outputs.push((same(&f.path), field));
    }
    for step in &graph.steps {
        let StepKind::Window(WindowSpec { late_records: Some(late), .. }) = &step.spec else { continue };
        let field = format!("{}.late_records.path", kind_field(step));
        if let Some((_, other)) = outputs.iter().find(|(o, _)| *o == same(&late.path)) {
            return Err(src.invalid(&field, format!("{:?} is also `{other}`: expected a directory of its own for late records", late.path)));
        }
        outputs.push((same(&late.path), field));
    }
    Ok(())
}
