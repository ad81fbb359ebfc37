//! The settings of the steps that read more than one stream or a table:
//! `interval_join`, `window_join`, `join` and `lookup_join`, and their checks
//! that need no schema (which fields exist and their types are the runtime
//! planner's to check).
//!
//! `on` names the left input's fields, `right_on` the right input's (the same
//! names when it is not written). The output holds the left fields, then the
//! right ones; a right field whose name is taken is renamed
//! `<right input>_<field>` (a lookup's `<step>_<column>`).

use serde::{Deserialize, Serialize};

use super::duration::SignedDuration;
use super::postgres_sink::{check_connection, check_table};
use super::source::Schema;
use super::step::{check_window_shape, one_or_many, some_one_or_many, who};
use super::{HumanDuration, PipelineError, PipelineSource, SessionWindow, SlidingWindow, WindowKind};

/// Pairs of records of the same key whose times are close:
/// `right.t ∈ [left.t + lower, left.t + upper]` by event time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntervalJoinSpec {
    #[serde(deserialize_with = "one_or_many")]
    pub on: Vec<String>,
    #[serde(default, deserialize_with = "some_one_or_many", skip_serializing_if = "Option::is_none")]
    pub right_on: Option<Vec<String>>,
    pub between: Between,
    /// `inner` (the default) or `left_outer`: a left record that found no
    /// right one is emitted with null right fields once its interval has passed.
    #[serde(rename = "type", default)]
    pub join_type: IntervalJoinType,
}

/// The bounds of an interval join, relative to the left record's time; they may be negative.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Between {
    pub lower: SignedDuration,
    pub upper: SignedDuration,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IntervalJoinType {
    #[default]
    Inner,
    LeftOuter,
}

/// Pairs of records of the same key in the same event-time window (the
/// window shapes of a `window` step: exactly one of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowJoinSpec {
    #[serde(deserialize_with = "one_or_many")]
    pub on: Vec<String>,
    #[serde(default, deserialize_with = "some_one_or_many", skip_serializing_if = "Option::is_none")]
    pub right_on: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tumbling: Option<HumanDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding: Option<SlidingWindow>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionWindow>,
}

impl WindowJoinSpec {
    /// The kind of window, when exactly one of `tumbling`, `sliding`, `session` is written.
    pub fn kind(&self) -> Option<WindowKind> {
        super::step::window_kind(&self.tumbling, &self.sliding, &self.session)
    }
}

/// A regular inner join: every pair of records of the same key, whenever
/// they arrive. Each record is kept `ttl` after it arrived (processing
/// time), so that the state stays bounded; `ttl` has no default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinSpec {
    #[serde(deserialize_with = "one_or_many")]
    pub on: Vec<String>,
    #[serde(default, deserialize_with = "some_one_or_many", skip_serializing_if = "Option::is_none")]
    pub right_on: Option<Vec<String>>,
    pub ttl: HumanDuration,
}

/// Each record joined with the row of a PostgreSQL table whose `key`
/// columns equal the record's `on` fields; rows are cached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupJoinSpec {
    #[serde(deserialize_with = "one_or_many")]
    pub on: Vec<String>,
    pub postgres: LookupTable,
    pub cache: LookupCache,
    /// A record whose key has no row: `drop` (the default) or `keep` (with null columns).
    #[serde(default)]
    pub missing: Missing,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupTable {
    /// As the PostgreSQL sink's: no password (it comes from `PGPASSWORD`).
    pub connection: String,
    /// `NAME` or `SCHEMA.NAME`.
    pub table: String,
    /// The columns matched against `on`, in the same order.
    pub key: Vec<String>,
    /// The columns added to each record, with their types.
    pub columns: Schema,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupCache {
    /// At most this many keys are cached (oldest first out).
    pub max_rows: u64,
    /// A cached row (or a cached miss) is read again after this long.
    pub ttl: HumanDuration,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Missing {
    #[default]
    Drop,
    Keep,
}

/// Where a check reports: the pipeline, the kind's field (`steps[0].join`)
/// and, in a graph, the step's name that starts each message.
pub(super) struct At<'a> {
    pub src: &'a PipelineSource,
    pub field: &'a str,
    pub name: Option<&'a str>,
}

impl At<'_> {
    fn invalid(&self, sub: &str, message: &str) -> PipelineError {
        self.src.invalid(&format!("{}.{sub}", self.field), format!("{}{message}", who(self.name)))
    }
}

/// `on` names at least one field; `right_on`, when written, as many.
fn check_keys(at: &At, on: &[String], right_on: Option<&Vec<String>>) -> Result<(), PipelineError> {
    if on.is_empty() || on.iter().any(|f| f.is_empty()) {
        return Err(at.invalid("on", "a join needs the fields it joins on"));
    }
    match right_on {
        Some(r) if r.len() != on.len() || r.iter().any(|f| f.is_empty()) => Err(at.invalid(
            "right_on",
            &format!("expected as many fields as `on` ({}), got {}", on.len(), r.len()),
        )),
        _ => Ok(()),
    }
}

impl IntervalJoinSpec {
    pub(super) fn validate(&self, at: &At) -> Result<(), PipelineError> {
        check_keys(at, &self.on, self.right_on.as_ref())?;
        let Between { lower, upper } = &self.between;
        if lower.millis() > upper.millis() {
            return Err(at.invalid("between", &format!("lower ({lower}) is above upper ({upper}): expected lower ≤ upper")));
        }
        Ok(())
    }
}

impl WindowJoinSpec {
    pub(super) fn validate(&self, at: &At) -> Result<(), PipelineError> {
        check_keys(at, &self.on, self.right_on.as_ref())?;
        check_window_shape(at.src, at.field, at.name, self.kind())
    }
}

impl JoinSpec {
    pub(super) fn validate(&self, at: &At) -> Result<(), PipelineError> {
        check_keys(at, &self.on, self.right_on.as_ref())?;
        if self.ttl.is_zero() {
            return Err(at.invalid("ttl", "expected a duration above 0: each record is kept this long after it arrived"));
        }
        Ok(())
    }
}

impl LookupJoinSpec {
    pub(super) fn validate(&self, at: &At) -> Result<(), PipelineError> {
        check_keys(at, &self.on, None)?;
        let table = &self.postgres;
        check_connection(at.src, &format!("{}.postgres.connection", at.field), &table.connection)?;
        check_table(at.src, &format!("{}.postgres.table", at.field), &table.table)?;
        if table.key.len() != self.on.len() || table.key.iter().any(|c| c.is_empty()) {
            return Err(at.invalid(
                "postgres.key",
                &format!("expected as many key columns as `on` has fields ({}), got {}", self.on.len(), table.key.len()),
            ));
        }
        if table.columns.0.is_empty() {
            return Err(at.invalid("postgres.columns", "expected at least one column to add, e.g. `columns: {name: string}`"));
        }
        if self.cache.max_rows == 0 {
            return Err(at.invalid("cache.max_rows", "expected at least 1"));
        }
        if self.cache.ttl.is_zero() {
            return Err(at.invalid("cache.ttl", "expected a duration above 0: how long a cached row is used before it is read again"));
        }
        Ok(())
    }
}
