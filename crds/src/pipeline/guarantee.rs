//! What a pipeline can promise: the weakest of the job's `guarantee`
//! setting, its sources (a source that cannot replay makes it
//! at-most-once) and its sinks (each sink's contract).
//!
//! A chain's reason reads as it always has. A graph's names the source or
//! sink that weakens it. With several sinks each gets its own guarantee
//! (the weakest of the setting, the sources upstream of it and its own
//! contract); the job promises the weakest of them, but runs at the
//! strongest, so that a side sink with a weaker contract (stdout) does
//! not weaken the others (runtime/design/graphs.md §5.2).

use super::{Guarantee, PipelineSpec};

impl PipelineSpec {
    /// The weakest guarantee of the job's setting, its sources and its sinks:
    /// what the job can promise.
    pub fn guarantee(&self) -> Guarantee {
        self.guarantee_and_reason().0
    }

    /// [`PipelineSpec::guarantee`] and what sets it, in words for the
    /// job's status: the part that weakens it, or that all parts allow it.
    pub fn guarantee_and_reason(&self) -> (Guarantee, String) {
        match self.chain() {
            Some(chain) => self.chain_guarantee(chain.source, chain.sink),
            None => self.graph_guarantee(),
        }
    }

    fn chain_guarantee(&self, source: &super::SourceSpec, sink: &super::SinkSpec) -> (Guarantee, String) {
        let from_source = if source.replayable() { Guarantee::ExactlyOnce } else { Guarantee::AtMostOnce };
        let effective = self.guarantee.min(from_source).min(sink.guarantee());
        let reason = if effective == Guarantee::ExactlyOnce {
            format!(
                "the job asks for exactly-once, its source replays from checkpoints and its {} sink {}",
                sink.kind(),
                sink.contract().describe()
            )
        } else if from_source == effective {
            format!("the {} source cannot replay what it read before a failure", source.kind())
        } else if self.guarantee == effective {
            format!("the job's `guarantee` setting asks for {effective}")
        } else {
            format!("the {} sink is {effective}: it {}", sink.kind(), sink.contract().describe())
        };
        (effective, reason)
    }

    /// As a chain's, over every source and sink; the reason names the
    /// first source or sink (in the order written) at the weakest level.
    fn graph_guarantee(&self) -> (Guarantee, String) {
        let graph = self.graph();
        let unreplayable = graph.sources.iter().find(|s| !s.spec.spec.replayable());
        let weakest_sink = graph.sinks.iter().min_by_key(|s| s.spec.guarantee());
        let from_source = if unreplayable.is_some() { Guarantee::AtMostOnce } else { Guarantee::ExactlyOnce };
        let from_sinks = weakest_sink.map(|s| s.spec.guarantee()).unwrap_or(Guarantee::ExactlyOnce);
        let effective = self.guarantee.min(from_source).min(from_sinks);
        let reason = match (unreplayable, weakest_sink) {
            _ if effective == Guarantee::ExactlyOnce => {
                "the job asks for exactly-once, its sources replay from checkpoints and every sink is exactly-once".to_string()
            }
            (Some(s), _) if from_source == effective => {
                format!("the {} source `{}` cannot replay what it read before a failure", s.spec.spec.kind(), s.name)
            }
            _ if self.guarantee == effective => format!("the job's `guarantee` setting asks for {effective}"),
            (_, Some(s)) => format!("the {} sink `{}` is {effective}: it {}", s.spec.kind(), s.name, s.spec.contract().describe()),
            (_, None) => format!("the job is {effective}"),
        };
        (effective, reason)
    }

    /// Each sink's name and the guarantee it gets: the weakest of the
    /// job's setting, the sources upstream of it (a source that cannot
    /// replay makes it at-most-once) and its own contract.
    pub fn sink_guarantees(&self) -> Vec<(String, Guarantee)> {
        let graph = self.graph();
        graph
            .sinks
            .iter()
            .map(|sink| {
                let mut seen: Vec<&str> = Vec::new();
                let mut todo: Vec<&str> = sink.inputs.iter().map(String::as_str).collect();
                let mut from_sources = Guarantee::ExactlyOnce;
                while let Some(name) = todo.pop() {
                    if seen.contains(&name) {
                        continue;
                    }
                    seen.push(name);
                    match graph.node(name) {
                        Some(super::NodeRef::Source(s)) if !s.spec.spec.replayable() => from_sources = Guarantee::AtMostOnce,
                        Some(node) => todo.extend(node.inputs().iter().map(String::as_str)),
                        None => {}
                    }
                }
                (sink.name.clone(), self.guarantee.min(from_sources).min(sink.spec.guarantee()))
            })
            .collect()
    }

    /// The sink that decides the job's guarantee when its sinks get
    /// different ones: the first by name of those at the weakest. `None`
    /// for one sink, or several that all get the same.
    pub fn guarantee_decided_by(&self) -> Option<String> {
        let mut sinks = self.sink_guarantees();
        let weakest = sinks.iter().map(|(_, g)| *g).min()?;
        if sinks.iter().all(|(_, g)| *g == weakest) {
            return None;
        }
        sinks.sort();
        sinks.into_iter().find(|(_, g)| *g == weakest).map(|(name, _)| name)
    }

    /// The guarantee the job runs at: the strongest any sink gets.
    /// Checkpoints are aligned when some sink is exactly-once, and the job
    /// runs without checkpoints (at-most-once) only when every sink is
    /// at-most-once. For one sink it is [`PipelineSpec::guarantee`].
    pub fn runtime_guarantee(&self) -> Guarantee {
        self.sink_guarantees().into_iter().map(|(_, g)| g).max().unwrap_or_else(|| self.guarantee())
    }
}
