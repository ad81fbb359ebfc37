//! The pipeline format: a source, a list of steps, a sink, parallelism and
//! checkpoint settings, written in YAML. A pipeline is written either as a
//! chain (`source:`, `steps:`, `sink:`) or as a graph (`sources:` and `sinks:`
//! by name, steps naming their inputs); `graph.rs` reduces both to one form.
//!
//! Parsing is strict: unknown fields are rejected, and every error names the
//! file, the line and the field, and says what was expected. Checks that need
//! an expression engine (does `value % 2 = 0` type-check?) belong to the
//! runtime's planner, which reports them through [`PipelineError::Invalid`]
//! with the same location information.

mod duration;
mod graph;
mod guarantee;
mod join;
pub mod kafka;
mod locate;
mod named;
mod nodes;
mod postgres_sink;
mod sink;
pub mod source;
mod step;

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use duration::{HumanDuration, SignedDuration};
pub use graph::{Node, NodeRef, NotRunnable, PipelineGraph};
pub use named::Named;
pub use nodes::{SinkNode, SourceNode};
pub use kafka::{
    BadMessages, Isolation, KafkaSinkSpec, KafkaSourceSpec, StartPosition, StopPosition,
};
pub use postgres_sink::{PostgresMode, PostgresSinkSpec};
pub use sink::{FileFormat, FileSinkSpec, Guarantee, SinkContract, SinkSpec};
pub use source::{
    BadLines, FieldType, FileSourceSpec, GeneratorSpec, SocketSourceSpec, SourceSpec,
};
pub use step::{
    step_ids, AggregateSpec, Arity, Between, IntervalJoinSpec, IntervalJoinType, JoinSpec, LookupCache,
    LookupJoinSpec, LookupTable, Missing, SessionWindow, SlidingWindow, Step, StepKind, WindowAggregate,
    WindowJoinSpec, WindowKind, WindowSpec,
};

/// Keyed state is split into this many key groups unless the pipeline says
/// otherwise. It bounds the parallelism a job can ever be rescaled to, and it
/// is fixed for the life of a job (it decides which key lives in which group).
pub const DEFAULT_MAX_PARALLELISM: u32 = 128;

/// The whole pipeline, as written by the user: a chain (`source`, `steps`,
/// `sink`) or a graph (`sources`, `steps` with names and inputs, `sinks`).
/// Read it through [`PipelineSpec::graph`], or [`PipelineSpec::chain`]
/// where only the chain form is supported yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// The job's name: it names the job's directory in checkpoint storage.
    pub name: String,
    /// How many subtasks run each step.
    #[serde(default = "default_parallelism")]
    pub parallelism: u32,
    /// Number of key groups; the upper bound for `parallelism`, fixed for the life of the job.
    #[serde(default = "default_max_parallelism")]
    pub max_parallelism: u32,
    /// What the job promises: `exactly-once` (the default: aligned
    /// barriers, sinks commit with checkpoints) or `at-least-once` (no
    /// alignment, so no input waits for a slow one; a restore may repeat
    /// records) or `at-most-once` (no checkpoints and no replay: sources
    /// record how far they have read before they emit, sinks publish as
    /// they write, and a new run starts without state where the sources
    /// left off; records in flight at a failure are lost). The effective guarantee is the weakest of this, the
    /// source's and the sink's; the job's status says which and why.
    #[serde(default = "sink::exactly_once")]
    pub guarantee: Guarantee,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// Event time: which source field holds each record's time, and how
    /// watermarks follow it. Windows need it. A chain's only: a graph's
    /// sources each have their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_time: Option<EventTimeSpec>,
    /// A chain's one source.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_yaml::with::singleton_map")]
    #[schemars(with = "Option<SourceSpec>")]
    pub source: Option<SourceSpec>,
    /// A graph's sources by name: one connector key each, and an optional `event_time`.
    #[serde(default, skip_serializing_if = "Named::is_empty")]
    pub sources: Named<SourceNode>,
    /// A chain's steps in order, or a graph's steps, each with a `name` and its `input`.
    #[serde(default)]
    pub steps: Vec<Step>,
    /// A chain's one sink.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_yaml::with::singleton_map")]
    #[schemars(with = "Option<SinkSpec>")]
    pub sink: Option<SinkSpec>,
    /// A graph's sinks by name: `input` (the source or step written) and one connector key each.
    #[serde(default, skip_serializing_if = "Named::is_empty")]
    pub sinks: Named<SinkNode>,
}

/// The parts of a pipeline written as a chain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Chain<'a> {
    pub source: &'a SourceSpec,
    pub steps: &'a [Step],
    pub sink: &'a SinkSpec,
}

fn default_parallelism() -> u32 {
    1
}

fn default_max_parallelism() -> u32 {
    DEFAULT_MAX_PARALLELISM
}

/// Event time. Each source subtask's watermark is the largest event time
/// it has read minus `max_out_of_orderness`, minus 1 ms: it promises that no
/// record older than that comes any more. A subtask's watermark is the
/// smallest of its inputs' (an input idle for `idle_timeout` does not hold
/// it back), and windows fire by it. At the end of a bounded input the
/// watermark jumps to the end of time, firing every window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventTimeSpec {
    /// An int64 field of the source: milliseconds since the Unix epoch.
    pub field: String,
    /// How much out of order records may come (default 0s).
    #[serde(default = "no_duration")]
    pub max_out_of_orderness: HumanDuration,
    /// A source subtask that reads nothing for this long no longer holds the
    /// watermark back until it reads again (default: never idle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<HumanDuration>,
}

fn no_duration() -> HumanDuration {
    HumanDuration::from_millis(0)
}

/// How and how often checkpoints are taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Time between the start of two checkpoints, e.g. `500ms`, `10s`. `0s` turns periodic checkpoints off.
    #[serde(default = "default_interval")]
    pub interval: HumanDuration,
    #[serde(default)]
    pub mode: CheckpointMode,
    /// With `mode: aligned`: a subtask still aligning a checkpoint this
    /// long after it started switches to an unaligned snapshot of it
    /// (Flink's aligned-checkpoint timeout). Unset: always aligned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alignment_timeout: Option<HumanDuration>,
    /// Running aggregates write only the keys that changed since their
    /// last checkpoint (on a full snapshot, a new one after 16 of changes
    /// or when the changes are as big as it), into files the checkpoints
    /// share under `<state>/<job>/shared/`; a file is deleted when no
    /// retained checkpoint names it. Such checkpoints cannot be moved
    /// elsewhere; savepoints are always whole. Default false.
    #[serde(default)]
    pub incremental: bool,
    /// A checkpoint not complete after this long is abandoned; the job goes on.
    #[serde(default = "default_checkpoint_timeout")]
    pub timeout: HumanDuration,
    /// How many completed checkpoints are kept; older ones are deleted.
    #[serde(default = "default_retain")]
    pub retain: u32,
}

impl CheckpointSpec {
    /// How long a subtask aligns a periodic checkpoint before it takes it
    /// unaligned: zero for `mode: unaligned`, `None` when it never does.
    /// Savepoints and the final checkpoint are always aligned, so they hold
    /// no in-flight records and stay portable.
    pub fn unaligned_after(&self) -> Option<std::time::Duration> {
        match self.mode {
            CheckpointMode::Unaligned => Some(std::time::Duration::ZERO),
            CheckpointMode::Aligned => self.alignment_timeout.map(|t| t.get()),
        }
    }
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        CheckpointSpec {
            interval: default_interval(),
            mode: CheckpointMode::default(),
            alignment_timeout: None,
            incremental: false,
            timeout: default_checkpoint_timeout(),
            retain: default_retain(),
        }
    }
}

fn default_interval() -> HumanDuration {
    HumanDuration::from_millis(1000)
}

fn default_checkpoint_timeout() -> HumanDuration {
    HumanDuration::from_millis(60_000)
}

fn default_retain() -> u32 {
    3
}

/// Barrier handling on subtasks with several inputs.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointMode {
    /// Inputs that delivered barrier n are blocked until every input has.
    #[default]
    Aligned,
    /// Every subtask snapshots as soon as it hears of checkpoint n, and the
    /// records still in flight towards it (before barrier n on each input)
    /// are written into the checkpoint and replayed on restore: under
    /// backpressure a checkpoint waits for no queue to drain.
    Unaligned,
}

/// What went wrong with a pipeline file.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("cannot read pipeline file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The YAML does not have the pipeline's shape: serde_yaml's message names the field and the line.
    #[error("{file}: {message}")]
    Syntax { file: String, message: String },
    /// The YAML has the right shape but a value does not make sense.
    #[error("{file}{}: {field}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: String,
        line: Option<usize>,
        field: String,
        message: String,
    },
}

/// A pipeline together with where it came from, so that later checks (the
/// runtime's planner) can point at the right line.
#[derive(Debug, Clone)]
pub struct PipelineSource {
    pub file: String,
    pub text: String,
}

impl PipelineSource {
    /// Builds an error about `field` (a path such as `steps[2].filter`), with
    /// the line the field is on when it can be found.
    pub fn invalid(&self, field: &str, message: impl Into<String>) -> PipelineError {
        PipelineError::Invalid {
            file: self.file.clone(),
            line: locate::line_of(&self.text, field),
            field: field.to_string(),
            message: message.into(),
        }
    }
}

impl PipelineSpec {
    /// Reads and checks a pipeline file.
    pub fn from_file(path: &Path) -> Result<(PipelineSpec, PipelineSource), PipelineError> {
        let text = std::fs::read_to_string(path).map_err(|source| PipelineError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let src = PipelineSource {
            file: path.display().to_string(),
            text,
        };
        let spec = Self::from_source(&src)?;
        Ok((spec, src))
    }

    /// Parses and checks pipeline text; `src.file` is only used in messages.
    pub fn from_source(src: &PipelineSource) -> Result<PipelineSpec, PipelineError> {
        let spec: PipelineSpec =
            serde_yaml::from_str(&src.text).map_err(|e| PipelineError::Syntax {
                file: src.file.clone(),
                message: e.to_string(),
            })?;
        spec.validate(src)?;
        Ok(spec)
    }

    /// Parses pipeline text that has no file (e.g. the `pipeline` field of a StreamJob).
    pub fn from_yaml(name_for_errors: &str, text: &str) -> Result<PipelineSpec, PipelineError> {
        Self::from_source(&PipelineSource {
            file: name_for_errors.to_string(),
            text: text.to_string(),
        })
    }

    /// Checks that need more than one field, or the meaning of a value.
    pub fn validate(&self, src: &PipelineSource) -> Result<(), PipelineError> {
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(src.invalid(
                "name",
                format!(
                    "`{}` is not a valid job name: expected letters, digits, `-` or `_`",
                    self.name
                ),
            ));
        }
        if self.parallelism == 0 {
            return Err(src.invalid("parallelism", "expected an integer of at least 1, got 0"));
        }
        if self.max_parallelism == 0 || self.max_parallelism > 32768 {
            return Err(src.invalid(
                "max_parallelism",
                format!(
                    "expected an integer from 1 to 32768, got {}",
                    self.max_parallelism
                ),
            ));
        }
        if self.parallelism > self.max_parallelism {
            return Err(src.invalid(
                "parallelism",
                format!(
                    "parallelism {} is above max_parallelism {}: expected at most {}",
                    self.parallelism, self.max_parallelism, self.max_parallelism
                ),
            ));
        }
        if self.checkpoint.retain == 0 {
            return Err(src.invalid(
                "checkpoint.retain",
                "expected at least 1 (the latest completed checkpoint is always kept)",
            ));
        }
        if self.checkpoint.timeout.is_zero() {
            return Err(src.invalid("checkpoint.timeout", "expected a duration above 0"));
        }
        if self.checkpoint.alignment_timeout.is_some()
            && self.checkpoint.mode == CheckpointMode::Unaligned
        {
            return Err(src.invalid(
                "checkpoint.alignment_timeout",
                "applies to `mode: aligned` only (aligned checkpoints that switch to unaligned after it); `mode: unaligned` never aligns",
            ));
        }
        graph::check_form(self, src)?;
        if self.checkpoint.unaligned_after().is_some() && self.runtime_guarantee() != Guarantee::ExactlyOnce
        {
            let field = if self.checkpoint.mode == CheckpointMode::Unaligned {
                "checkpoint.mode"
            } else {
                "checkpoint.alignment_timeout"
            };
            return Err(src.invalid(
                field,
                format!(
                    "unaligned checkpoints are a way to keep exactly-once cheap under backpressure, but this job is {} ({}); remove the setting",
                    self.runtime_guarantee(),
                    self.guarantee_and_reason().1
                ),
            ));
        }
        match self.chain() {
            Some(chain) => self.validate_chain(chain, src),
            None => self.validate_graph(src),
        }
    }

    /// The checks of the chain form, with the messages they have always had.
    fn validate_chain(&self, chain: Chain, src: &PipelineSource) -> Result<(), PipelineError> {
        chain.source.validate(src, "source")?;
        chain.sink.validate(src, "sink", &self.checkpoint)?;
        step::validate_steps(chain.steps, src)?;
        // Each late-records output needs a directory of its own: a sink
        // cleaning up after a failure takes the files of its job in its
        // directory for its own.
        let same = |p: &str| p.trim_start_matches("./").trim_end_matches('/').to_string();
        let mut outputs: Vec<(String, String)> = Vec::new();
        if let SinkSpec::File(f) = chain.sink {
            outputs.push((same(&f.path), "sink.file.path".into()));
        }
        for (i, s) in chain.steps.iter().enumerate() {
            if let StepKind::Window(WindowSpec { late_records: Some(late), .. }) = &s.kind {
                let field = format!("steps[{i}].window.late_records.path");
                if let Some((_, other)) = outputs.iter().find(|(o, _)| *o == same(&late.path)) {
                    return Err(src.invalid(&field, format!("{:?} is also `{other}`: expected a directory of its own for late records", late.path)));
                }
                outputs.push((same(&late.path), field));
            }
        }
        if let Some(i) = chain.steps.iter().position(|s| matches!(s.kind, StepKind::Window(_))) {
            if self.event_time.is_none() {
                return Err(src.invalid(
                    &format!("steps[{i}].window"),
                    "windows fire by event time: expected `event_time: {field: <int64 field of the source, epoch milliseconds>}` in the pipeline",
                ));
            }
        }
        Ok(())
    }

    /// Whether the pipeline is written as a graph (`sources:` or `sinks:`).
    pub fn is_graph(&self) -> bool {
        !self.sources.is_empty() || !self.sinks.is_empty()
    }

    /// The source, steps and sink of a pipeline written as a chain; `None`
    /// for a graph (or a chain missing its source or sink, which
    /// validation refuses).
    pub fn chain(&self) -> Option<Chain<'_>> {
        match (&self.source, &self.sink) {
            (Some(source), Some(sink)) if !self.is_graph() => Some(Chain { source, steps: &self.steps, sink }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
