//! Steps between the sources and the sinks.
//!
//! A step is written as a map with one key naming the kind of step
//! (`- filter: "value > 10"`), optionally with an `id` beside it that keeps the
//! step's state matched across pipeline changes (`- running_count: n` /
//! `  id: counts`). In a graph a step also has a `name` and names its
//! `input` (one, or a list for the steps that read several).
//!
//! `yaml.rs` reads and writes steps; `check.rs` holds the checks of a
//! step's own settings and the chain form's checks.

mod check;
mod yaml;

use serde::{Deserialize, Serialize};

pub(super) use yaml::{one_or_many, some_one_or_many};
pub(super) use check::{check_kind, check_window_shape, validate_steps, who};
pub use super::join::{
    Between, IntervalJoinSpec, IntervalJoinType, JoinSpec, LookupCache, LookupJoinSpec, LookupTable, Missing, WindowJoinSpec,
};

#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Stable id matching this step's state in checkpoints and savepoints.
    pub id: Option<String>,
    /// The step's name in a graph, which other steps and sinks name as
    /// their input. A chain's steps have none.
    pub name: Option<String>,
    /// The names of the nodes the step reads, in order (a join: left, then
    /// right). A chain's steps have none: each reads the one before it.
    pub input: Vec<String>,
    pub kind: StepKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StepKind {
    /// Partition the stream by these fields; following aggregates are per key.
    KeyBy(Vec<String>),
    /// Keep the records for which the SQL expression is true.
    Filter(String),
    /// Replace each record by these SQL expressions (`expr` or `expr AS name`).
    Select(Vec<String>),
    /// Add a field (named by the value) counting the records of this key so far.
    RunningCount(String),
    RunningSum(AggregateSpec),
    RunningMin(AggregateSpec),
    RunningMax(AggregateSpec),
    /// Event-time windows per key, fired by the watermark.
    Window(WindowSpec),
    /// The records of every input, as they come (`union: {}`); the inputs
    /// have one schema.
    Union,
    /// Every record to every subtask of the steps that read this one
    /// (`broadcast: {}`): like `key_by`, it only says how records move.
    Broadcast,
    IntervalJoin(IntervalJoinSpec),
    WindowJoin(WindowJoinSpec),
    Join(JoinSpec),
    LookupJoin(LookupJoinSpec),
}

/// How many inputs a kind of step reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    One,
    /// Left and right.
    Two,
    TwoOrMore,
}

impl Arity {
    pub fn accepts(self, n: usize) -> bool {
        match self {
            Arity::One => n == 1,
            Arity::Two => n == 2,
            Arity::TwoOrMore => n >= 2,
        }
    }

    /// As the end of "`union` takes …".
    pub fn describe(self) -> &'static str {
        match self {
            Arity::One => "one input",
            Arity::Two => "two inputs (left, right)",
            Arity::TwoOrMore => "at least two inputs",
        }
    }
}

/// Event-time windows of each key: `tumbling: 10s`, or `sliding: {size:
/// 10s, slide: 5s}`. A window `[start, end)` holds the records whose event
/// time is in it; it fires (one output record per key: the key fields,
/// `window_start`, `window_end` in epoch milliseconds, and the aggregates)
/// once the watermark reaches `end - 1`. A record for a window that has
/// fired and is older than `allowed_lateness` is late: dropped and counted
/// (`records_late`), and written to `late_records` when that is set; within
/// the lateness it updates the window, which fires again with the new
/// result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowSpec {
    /// Back-to-back windows of this length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tumbling: Option<super::HumanDuration>,
    /// Overlapping windows of `size`, one starting every `slide`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding: Option<SlidingWindow>,
    /// A window per key per burst of activity: records less than `gap`
    /// apart are one session, which ends `gap` after its last record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionWindow>,
    /// How long after a window fired a late record still updates it (default 0s).
    #[serde(default = "zero", skip_serializing_if = "is_zero")]
    pub allowed_lateness: super::HumanDuration,
    /// What each window computes: `- count: n`, `- sum: {field: v, as: total}`
    /// (and `min`, `max`, `avg`).
    pub aggregates: Vec<WindowAggregate>,
    /// A side output for late records, as they came into the window step:
    /// files under a directory or `s3://` prefix of their own, committed
    /// with the job's checkpoints like the file sink (`{path: out/late,
    /// format: jsonl}`). Without it late records are only counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub late_records: Option<super::FileSinkSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionWindow {
    pub gap: super::HumanDuration,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindow {
    pub size: super::HumanDuration,
    pub slide: super::HumanDuration,
}

/// One aggregate of a window; exactly one of its keys is written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowAggregate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sum: Option<AggregateSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<AggregateSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<AggregateSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avg: Option<AggregateSpec>,
}

fn zero() -> super::HumanDuration {
    super::HumanDuration::from_millis(0)
}

fn is_zero(d: &super::HumanDuration) -> bool {
    d.is_zero()
}

impl WindowAggregate {
    /// The function's name and its field (`None` for count) and output name,
    /// when exactly one is written.
    pub fn function(&self) -> Option<(&'static str, Option<&str>, String)> {
        let written: Vec<(&'static str, Option<&str>, String)> = [
            self.count.as_ref().map(|n| ("count", None, n.clone())),
            self.sum.as_ref().map(|a| ("sum", Some(a.field.as_str()), a.output.clone().unwrap_or_else(|| format!("sum_{}", a.field)))),
            self.min.as_ref().map(|a| ("min", Some(a.field.as_str()), a.output.clone().unwrap_or_else(|| format!("min_{}", a.field)))),
            self.max.as_ref().map(|a| ("max", Some(a.field.as_str()), a.output.clone().unwrap_or_else(|| format!("max_{}", a.field)))),
            self.avg.as_ref().map(|a| ("avg", Some(a.field.as_str()), a.output.clone().unwrap_or_else(|| format!("avg_{}", a.field)))),
        ]
        .into_iter()
        .flatten()
        .collect();
        match &written[..] {
            [one] => Some(one.clone()),
            _ => None,
        }
    }
}

/// Which windows a record falls in, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowKind {
    /// Aligned windows of `size`, one starting every `slide` (tumbling: slide = size).
    Fixed { size: u64, slide: u64 },
    /// Sessions closing after `gap` without a record.
    Session { gap: u64 },
}

impl WindowSpec {
    /// The kind of window, when exactly one of `tumbling`, `sliding`, `session` is written.
    pub fn kind(&self) -> Option<WindowKind> {
        window_kind(&self.tumbling, &self.sliding, &self.session)
    }
}

/// The kind of window of a window or window join.
pub(in crate::pipeline) fn window_kind(
    tumbling: &Option<super::HumanDuration>,
    sliding: &Option<SlidingWindow>,
    session: &Option<SessionWindow>,
) -> Option<WindowKind> {
    let ms = |d: &super::HumanDuration| d.get().as_millis() as u64;
    match (tumbling, sliding, session) {
        (Some(t), None, None) => Some(WindowKind::Fixed { size: ms(t), slide: ms(t) }),
        (None, Some(s), None) => Some(WindowKind::Fixed { size: ms(&s.size), slide: ms(&s.slide) }),
        (None, None, Some(s)) => Some(WindowKind::Session { gap: ms(&s.gap) }),
        _ => None,
    }
}

/// A running aggregate of one field: `{field: value, as: total}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregateSpec {
    pub field: String,
    #[serde(rename = "as", default)]
    pub output: Option<String>,
}

const KINDS: &[&str] = &[
    "key_by",
    "filter",
    "select",
    "running_count",
    "running_sum",
    "running_min",
    "running_max",
    "window",
    "union",
    "broadcast",
    "interval_join",
    "window_join",
    "join",
    "lookup_join",
];

impl StepKind {
    /// The name the step is written with.
    pub fn name(&self) -> &'static str {
        match self {
            StepKind::KeyBy(_) => "key_by",
            StepKind::Filter(_) => "filter",
            StepKind::Select(_) => "select",
            StepKind::RunningCount(_) => "running_count",
            StepKind::RunningSum(_) => "running_sum",
            StepKind::RunningMin(_) => "running_min",
            StepKind::RunningMax(_) => "running_max",
            StepKind::Window(_) => "window",
            StepKind::Union => "union",
            StepKind::Broadcast => "broadcast",
            StepKind::IntervalJoin(_) => "interval_join",
            StepKind::WindowJoin(_) => "window_join",
            StepKind::Join(_) => "join",
            StepKind::LookupJoin(_) => "lookup_join",
        }
    }

    /// How many inputs the step reads.
    pub fn inputs(&self) -> Arity {
        match self {
            StepKind::Union => Arity::TwoOrMore,
            StepKind::IntervalJoin(_) | StepKind::WindowJoin(_) | StepKind::Join(_) => Arity::Two,
            _ => Arity::One,
        }
    }

    pub fn is_keyed_aggregate(&self) -> bool {
        matches!(
            self,
            StepKind::RunningCount(_)
                | StepKind::RunningSum(_)
                | StepKind::RunningMin(_)
                | StepKind::RunningMax(_)
                | StepKind::Window(_)
        )
    }

    /// A step that only says how records move to the steps that read it.
    pub fn is_partitioning(&self) -> bool {
        matches!(self, StepKind::KeyBy(_) | StepKind::Broadcast)
    }

    /// The fields a join of two inputs partitions both inputs by, left and right.
    pub fn join_keys(&self) -> Option<(&[String], &[String])> {
        let (on, right_on) = match self {
            StepKind::IntervalJoin(j) => (&j.on, &j.right_on),
            StepKind::WindowJoin(j) => (&j.on, &j.right_on),
            StepKind::Join(j) => (&j.on, &j.right_on),
            _ => return None,
        };
        Some((on, right_on.as_deref().unwrap_or(on)))
    }
}

/// The id of each step, in order: the `id` written beside it, or
/// `<kind>-<n>` where `n` counts the earlier steps of the same kind from 0
/// (`running_count-0`). A derived id survives adding, removing or moving
/// stateless steps and steps of other kinds, so a savepoint still restores
/// after such a change; adding or removing a step of the same kind before
/// it renames it, which is when a written `id` is needed.
pub fn step_ids(steps: &[Step]) -> Vec<String> {
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    steps
        .iter()
        .map(|step| {
            let n = seen.entry(step.kind.name()).or_default();
            let derived = format!("{}-{n}", step.kind.name());
            *n += 1;
            step.id.clone().unwrap_or(derived)
        })
        .collect()
}
