//! The normal form both ways of writing a pipeline reduce to: named
//! sources, steps and sinks, each naming the nodes it reads.
//!
//! A chain (`source:`, `steps:`, `sink:`) becomes the graph whose source is
//! named `source`, whose steps are named by their ids (`filter-0`,
//! `running_count-0`, or the written `id`), each reading the node before
//! it, and whose sink `sink` reads the last step. A node's name is its state
//! id unless it has a written `id`, so a chain and the same pipeline written
//! as a graph keep their state under the same ids, and a savepoint of one
//! restores into the other.
//!
//! The runtime and the controller read pipelines only through this form. `check.rs` holds
//! the structural checks of the graph form.

mod check;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};

use super::{step_ids, PipelineSpec, SinkSpec, SourceNode, StepKind};

pub(super) use check::check_form;

/// One node of the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Node<T> {
    /// What other nodes name it by: the key under `sources:`/`sinks:`, a
    /// step's `name` (else its id); `source`, the step ids and `sink` in a chain.
    pub name: String,
    /// Where its state is kept in checkpoints: a step's written `id`, else the name.
    pub state_id: String,
    /// Where it is written, for errors: `source` / `sources.orders`, `steps[3]`, `sink` / `sinks.audit`.
    pub path: String,
    /// The names of the nodes it reads, in order (a join: left, then right).
    pub inputs: Vec<String>,
    pub spec: T,
}

/// A pipeline as named nodes; see the module documentation.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineGraph {
    pub sources: Vec<Node<SourceNode>>,
    pub steps: Vec<Node<StepKind>>,
    pub sinks: Vec<Node<SinkSpec>>,
}

/// A node of any kind, borrowed from a [`PipelineGraph`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NodeRef<'a> {
    Source(&'a Node<SourceNode>),
    Step(&'a Node<StepKind>),
    Sink(&'a Node<SinkSpec>),
}

impl<'a> NodeRef<'a> {
    pub fn name(self) -> &'a str {
        match self {
            NodeRef::Source(n) => &n.name,
            NodeRef::Step(n) => &n.name,
            NodeRef::Sink(n) => &n.name,
        }
    }

    pub fn state_id(self) -> &'a str {
        match self {
            NodeRef::Source(n) => &n.state_id,
            NodeRef::Step(n) => &n.state_id,
            NodeRef::Sink(n) => &n.state_id,
        }
    }

    pub fn path(self) -> &'a str {
        match self {
            NodeRef::Source(n) => &n.path,
            NodeRef::Step(n) => &n.path,
            NodeRef::Sink(n) => &n.path,
        }
    }

    pub fn inputs(self) -> &'a [String] {
        match self {
            NodeRef::Source(n) => &n.inputs,
            NodeRef::Step(n) => &n.inputs,
            NodeRef::Sink(n) => &n.inputs,
        }
    }
}

/// Why a graph cannot run (yet): where (a field) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotRunnable {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for NotRunnable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl PipelineGraph {
    /// What the runtime cannot run: a graph without a sink.
    pub fn check_runnable(&self) -> Result<(), NotRunnable> {
        if self.sinks.is_empty() {
            return Err(NotRunnable { field: "sinks".into(), message: "expected a sink".into() });
        }
        Ok(())
    }

    /// Every node in the order written: sources, steps, sinks.
    pub fn nodes(&self) -> impl Iterator<Item = NodeRef<'_>> {
        let sources = self.sources.iter().map(NodeRef::Source);
        let steps = self.steps.iter().map(NodeRef::Step);
        sources.chain(steps).chain(self.sinks.iter().map(NodeRef::Sink))
    }

    /// The first node with this name.
    pub fn node(&self, name: &str) -> Option<NodeRef<'_>> {
        self.nodes().find(|n| n.name() == name)
    }

    /// The nodes that read `name`, in the order written.
    pub fn consumers(&self, name: &str) -> Vec<NodeRef<'_>> {
        self.nodes().filter(|n| n.inputs().iter().any(|i| i == name)).collect()
    }

    /// Every node after the nodes it reads (Kahn's algorithm); among the
    /// nodes ready at once, by name, so that the order does not change when
    /// lines of the pipeline are reordered. Nodes on a cycle, or reading one,
    /// are left out (a validated pipeline has none).
    pub fn topological_order(&self) -> Vec<NodeRef<'_>> {
        let nodes: Vec<NodeRef> = self.nodes().collect();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, n) in nodes.iter().enumerate() {
            index.entry(n.name()).or_insert(i);
        }
        // Edges from each node to its readers, one per input naming it.
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        let mut waiting: Vec<usize> = vec![0; nodes.len()];
        for (i, n) in nodes.iter().enumerate() {
            for from in n.inputs().iter().filter_map(|input| index.get(input.as_str())) {
                readers[*from].push(i);
                waiting[i] += 1;
            }
        }
        let mut ready: BTreeSet<(&str, usize)> =
            nodes.iter().enumerate().filter(|(i, _)| waiting[*i] == 0).map(|(i, n)| (n.name(), i)).collect();
        let mut order = Vec::with_capacity(nodes.len());
        while let Some((_, i)) = ready.pop_first() {
            order.push(nodes[i]);
            for &r in &readers[i] {
                waiting[r] -= 1;
                if waiting[r] == 0 {
                    ready.insert((nodes[r].name(), r));
                }
            }
        }
        order
    }
}

impl PipelineSpec {
    /// What the runtime runs of a checked pipeline: its graph without
    /// joins, so far. The controller refuses the rest once, rather
    /// than every worker of every run.
    pub fn runnable_graph(&self) -> Result<PipelineGraph, NotRunnable> {
        let graph = self.graph();
        graph.check_runnable()?;
        Ok(graph)
    }

    /// The pipeline as a graph, whichever form it is written in. Total: an
    /// unchecked pipeline gives the nodes it has (a chain without a sink
    /// gives a graph without sinks).
    pub fn graph(&self) -> PipelineGraph {
        if self.is_graph() {
            self.graph_as_written()
        } else {
            self.graph_of_chain()
        }
    }

    fn graph_of_chain(&self) -> PipelineGraph {
        let node = |name: &str, inputs: Vec<String>| (name.to_string(), name.to_string(), inputs);
        let sources: Vec<Node<SourceNode>> = self
            .source
            .iter()
            .map(|s| {
                let (name, state_id, inputs) = node("source", Vec::new());
                let spec = SourceNode { spec: s.clone(), event_time: self.event_time.clone() };
                Node { name, state_id, path: "source".into(), inputs, spec }
            })
            .collect();
        let mut previous = sources.first().map(|s| s.name.clone());
        let mut steps = Vec::with_capacity(self.steps.len());
        for ((i, step), id) in self.steps.iter().enumerate().zip(step_ids(&self.steps)) {
            let (name, state_id, inputs) = node(&id, previous.iter().cloned().collect());
            steps.push(Node { name, state_id, path: format!("steps[{i}]"), inputs, spec: step.kind.clone() });
            previous = Some(id);
        }
        let sinks = self
            .sink
            .iter()
            .map(|s| {
                let (name, state_id, inputs) = node("sink", previous.iter().cloned().collect());
                Node { name, state_id, path: "sink".into(), inputs, spec: s.clone() }
            })
            .collect();
        PipelineGraph { sources, steps, sinks }
    }

    fn graph_as_written(&self) -> PipelineGraph {
        let sources = self
            .sources
            .iter()
            .map(|(name, s)| Node {
                name: name.to_string(),
                state_id: name.to_string(),
                path: format!("sources.{name}"),
                inputs: Vec::new(),
                spec: s.clone(),
            })
            .collect();
        // An unnamed step is named like a chain's step (its id, else
        // `<kind>-<n>`), so that it can still be read by that name.
        let steps = self
            .steps
            .iter()
            .enumerate()
            .zip(step_ids(&self.steps))
            .map(|((i, step), id)| {
                let name = step.name.clone().unwrap_or_else(|| id.clone());
                let state_id = step.id.clone().unwrap_or_else(|| name.clone());
                Node { name, state_id, path: format!("steps[{i}]"), inputs: step.input.clone(), spec: step.kind.clone() }
            })
            .collect();
        let sinks = self
            .sinks
            .iter()
            .map(|(name, s)| Node {
                name: name.to_string(),
                state_id: name.to_string(),
                path: format!("sinks.{name}"),
                inputs: vec![s.input.clone()],
                spec: s.spec.clone(),
            })
            .collect();
        PipelineGraph { sources, steps, sinks }
    }
}
