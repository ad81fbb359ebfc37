//! Steps between the source and the sink.
//!
//! A step is written as a one-entry map whose key is the kind of step
//! (`- filter: "value > 10"`), optionally with an `id` beside it that keeps the
//! step's state matched across pipeline changes (`- running_count: n` /
//! `  id: counts`).

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use super::{PipelineError, PipelineSource};

#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Stable id matching this step's state in checkpoints and savepoints.
    pub id: Option<String>,
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
        let ms = |d: &super::HumanDuration| d.get().as_millis() as u64;
        match (&self.tumbling, &self.sliding, &self.session) {
            (Some(t), None, None) => Some(WindowKind::Fixed { size: ms(t), slide: ms(t) }),
            (None, Some(s), None) => Some(WindowKind::Fixed { size: ms(&s.size), slide: ms(&s.slide) }),
            (None, None, Some(s)) => Some(WindowKind::Session { gap: ms(&s.gap) }),
            _ => None,
        }
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

pub(super) fn validate_steps(steps: &[Step], src: &PipelineSource) -> Result<(), PipelineError> {
    let mut keyed = false;
    let mut ids = std::collections::HashSet::new();
    for ((i, step), id) in steps.iter().enumerate().zip(step_ids(steps)) {
        let field = format!("steps[{i}].{}", step.kind.name());
        if !ids.insert(id.clone()) {
            return Err(src.invalid(&format!("steps[{i}].id"), format!("id `{id}` is used by two steps: expected unique ids")));
        }
        match &step.kind {
            StepKind::KeyBy(fields) => {
                if fields.is_empty() || fields.iter().any(|f| f.is_empty()) {
                    return Err(src.invalid(&field, "expected a field name or a list of field names"));
                }
                keyed = true;
            }
            StepKind::Filter(e) if e.trim().is_empty() => {
                return Err(src.invalid(&field, "expected a SQL expression, e.g. `value % 2 = 0`"));
            }
            StepKind::Select(items) if items.is_empty() => {
                return Err(src.invalid(&field, "expected a list of SQL expressions, e.g. [\"key\", \"value * 2 AS double\"]"));
            }
            StepKind::RunningCount(out) if out.is_empty() => {
                return Err(src.invalid(&field, "expected the name of the field to add, e.g. `running_count: count`"));
            }
            StepKind::Window(w) => {
                if !keyed {
                    return Err(src.invalid(&field, "window keeps state per key: expected a `key_by` step before it"));
                }
                match w.kind() {
                    None => return Err(src.invalid(&field, "expected one of `tumbling: SIZE`, `sliding: {size, slide}` or `session: {gap}`")),
                    Some(WindowKind::Session { gap: 0 }) => return Err(src.invalid(&format!("{field}.session.gap"), "expected a gap above 0")),
                    Some(WindowKind::Fixed { size, slide }) if size == 0 || slide == 0 => {
                        return Err(src.invalid(&field, "expected window sizes and slides above 0"));
                    }
                    Some(WindowKind::Fixed { size, slide }) if slide > size => {
                        return Err(src.invalid(&format!("{field}.sliding.slide"), format!("{slide}ms is longer than the window ({size}ms): records between windows would belong to none; expected at most the size")));
                    }
                    _ => {}
                }
                if w.aggregates.is_empty() {
                    return Err(src.invalid(&format!("{field}.aggregates"), "expected at least one aggregate, e.g. `- count: n`"));
                }
                for (j, a) in w.aggregates.iter().enumerate() {
                    if a.function().is_none() {
                        return Err(src.invalid(&format!("{field}.aggregates[{j}]"), "expected exactly one of count, sum, min, max, avg"));
                    }
                }
                if let Some(late) = &w.late_records {
                    late.validate(src, &format!("{field}.late_records"))?;
                }
            }
            kind if kind.is_keyed_aggregate() && !keyed => {
                return Err(src.invalid(
                    &field,
                    format!("{} keeps state per key: expected a `key_by` step before it", kind.name()),
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// `key_by: key` or `key_by: [a, b]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Step;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a step: a map with one of the keys {}", KINDS.join(", "))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Step, A::Error> {
                let mut id = None;
                let mut kind: Option<StepKind> = None;
                while let Some(key) = map.next_key::<String>()? {
                    let parsed = match key.as_str() {
                        "id" => {
                            id = Some(map.next_value::<String>()?);
                            continue;
                        }
                        "key_by" => StepKind::KeyBy(match map.next_value::<OneOrMany>()? {
                            OneOrMany::One(f) => vec![f],
                            OneOrMany::Many(fs) => fs,
                        }),
                        "filter" => StepKind::Filter(map.next_value()?),
                        "select" => StepKind::Select(map.next_value()?),
                        "running_count" => StepKind::RunningCount(map.next_value()?),
                        "running_sum" => StepKind::RunningSum(map.next_value()?),
                        "running_min" => StepKind::RunningMin(map.next_value()?),
                        "running_max" => StepKind::RunningMax(map.next_value()?),
                        "window" => StepKind::Window(map.next_value()?),
                        other => {
                            return Err(de::Error::custom(format!(
                                "unknown step `{other}`, expected one of {}",
                                KINDS.join(", ")
                            )))
                        }
                    };
                    if let Some(prev) = &kind {
                        return Err(de::Error::custom(format!(
                            "a step has both `{}` and `{}`: write each step as its own list item",
                            prev.name(),
                            parsed.name()
                        )));
                    }
                    kind = Some(parsed);
                }
                let kind = kind.ok_or_else(|| {
                    de::Error::custom(format!("a step needs one of {}", KINDS.join(", ")))
                })?;
                Ok(Step { id, kind })
            }
        }
        d.deserialize_map(V)
    }
}

impl Serialize for Step {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        if let Some(id) = &self.id {
            m.serialize_entry("id", id)?;
        }
        match &self.kind {
            StepKind::KeyBy(f) => m.serialize_entry("key_by", f)?,
            StepKind::Filter(e) => m.serialize_entry("filter", e)?,
            StepKind::Select(e) => m.serialize_entry("select", e)?,
            StepKind::RunningCount(o) => m.serialize_entry("running_count", o)?,
            StepKind::RunningSum(a) => m.serialize_entry("running_sum", a)?,
            StepKind::RunningMin(a) => m.serialize_entry("running_min", a)?,
            StepKind::RunningMax(a) => m.serialize_entry("running_max", a)?,
            StepKind::Window(w) => m.serialize_entry("window", w)?,
        }
        m.end()
    }
}

impl schemars::JsonSchema for Step {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Step".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "description": "One step: a map with one of the keys key_by, filter, select, running_count, running_sum, running_min, running_max, window, and an optional id",
            "minProperties": 1,
            "maxProperties": 2
        })
    }
}
