//! The checks of a step's own settings, shared by both forms, and the checks
//! of a chain's steps (which read one another in order). A graph's
//! structure is checked in `graph/check.rs`.
//!
//! A chain's messages are the ones it has always had; in a graph the same
//! checks start their message with the step's name, because a graph's
//! steps are found by name rather than by position.

use std::collections::HashSet;

use super::{step_ids, Step, StepKind, WindowKind};
use crate::pipeline::join::At;
use crate::pipeline::{PipelineError, PipelineSource};

/// "`name`: " in a graph, nothing in a chain.
pub(in crate::pipeline) fn who(name: Option<&str>) -> String {
    name.map(|n| format!("`{n}`: ")).unwrap_or_default()
}

/// The chain form's steps: each reads the one before it, and the keyed
/// steps need a `key_by` somewhere before them.
pub(in crate::pipeline) fn validate_steps(steps: &[Step], src: &PipelineSource) -> Result<(), PipelineError> {
    let mut keyed = false;
    let mut ids = HashSet::new();
    for ((i, step), id) in steps.iter().enumerate().zip(step_ids(steps)) {
        let field = format!("steps[{i}].{}", step.kind.name());
        if !ids.insert(id.clone()) {
            return Err(src.invalid(&format!("steps[{i}].id"), format!("id `{id}` is used by two steps: expected unique ids")));
        }
        check_chain_step(step, i, src)?;
        let needs_key = || src.invalid(&field, format!("{} keeps state per key: expected a `key_by` step before it", step.kind.name()));
        if matches!(step.kind, StepKind::Window(_)) && !keyed {
            return Err(needs_key());
        }
        check_kind(&step.kind, src, &field, None)?;
        if step.kind.is_keyed_aggregate() && !keyed {
            return Err(needs_key());
        }
        match step.kind {
            StepKind::KeyBy(_) => keyed = true,
            StepKind::Broadcast => keyed = false,
            _ => {}
        }
    }
    Ok(())
}

/// A chain's step has no `name` or `input` (its input is the step before
/// it), so it cannot be a step that reads several inputs.
fn check_chain_step(step: &Step, i: usize, src: &PipelineSource) -> Result<(), PipelineError> {
    let written = [("name", step.name.is_some()), ("input", !step.input.is_empty())];
    if let Some((key, _)) = written.iter().find(|(_, is)| *is) {
        return Err(src.invalid(
            &format!("steps[{i}].{key}"),
            "a chain's steps each read the step before them: `name` and `input` are for a graph (`sources:` and `sinks:` instead of `source:` and `sink:`)",
        ));
    }
    let arity = step.kind.inputs();
    if !arity.accepts(1) {
        return Err(src.invalid(
            &format!("steps[{i}].{}", step.kind.name()),
            format!(
                "{} takes {}, but a chain's steps each read one, the step before them: write the pipeline as a graph (`sources:`, `steps:` with `name` and `input`, `sinks:`)",
                step.kind.name(),
                arity.describe()
            ),
        ));
    }
    Ok(())
}

/// The settings of one step that need nothing but the step: `field` is its
/// kind's path (`steps[2].window`), `name` its name in a graph.
pub(in crate::pipeline) fn check_kind(kind: &StepKind, src: &PipelineSource, field: &str, name: Option<&str>) -> Result<(), PipelineError> {
    let who = who(name);
    let at = At { src, field, name };
    match kind {
        StepKind::KeyBy(fields) if fields.is_empty() || fields.iter().any(|f| f.is_empty()) => {
            Err(src.invalid(field, format!("{who}expected a field name or a list of field names")))
        }
        StepKind::Filter(e) if e.trim().is_empty() => {
            Err(src.invalid(field, format!("{who}expected a SQL expression, e.g. `value % 2 = 0`")))
        }
        StepKind::Select(items) if items.is_empty() => {
            Err(src.invalid(field, format!("{who}expected a list of SQL expressions, e.g. [\"key\", \"value * 2 AS double\"]")))
        }
        StepKind::RunningCount(out) if out.is_empty() => {
            Err(src.invalid(field, format!("{who}expected the name of the field to add, e.g. `running_count: count`")))
        }
        StepKind::Window(w) => {
            check_window_shape(src, field, name, w.kind())?;
            if w.aggregates.is_empty() {
                return Err(src.invalid(&format!("{field}.aggregates"), format!("{who}expected at least one aggregate, e.g. `- count: n`")));
            }
            for (j, a) in w.aggregates.iter().enumerate() {
                if a.function().is_none() {
                    return Err(src.invalid(&format!("{field}.aggregates[{j}]"), format!("{who}expected exactly one of count, sum, min, max, avg")));
                }
            }
            match &w.late_records {
                Some(late) => late.validate(src, &format!("{field}.late_records")),
                None => Ok(()),
            }
        }
        StepKind::IntervalJoin(j) => j.validate(&at),
        StepKind::WindowJoin(j) => j.validate(&at),
        StepKind::Join(j) => j.validate(&at),
        StepKind::LookupJoin(j) => j.validate(&at),
        _ => Ok(()),
    }
}

/// Exactly one window shape, with sizes, slides and gaps that make sense.
pub(in crate::pipeline) fn check_window_shape(
    src: &PipelineSource,
    field: &str,
    name: Option<&str>,
    kind: Option<WindowKind>,
) -> Result<(), PipelineError> {
    let who = who(name);
    match kind {
        None => Err(src.invalid(field, format!("{who}expected one of `tumbling: SIZE`, `sliding: {{size, slide}}` or `session: {{gap}}`"))),
        Some(WindowKind::Session { gap: 0 }) => Err(src.invalid(&format!("{field}.session.gap"), format!("{who}expected a gap above 0"))),
        Some(WindowKind::Fixed { size, slide }) if size == 0 || slide == 0 => {
            Err(src.invalid(field, format!("{who}expected window sizes and slides above 0")))
        }
        Some(WindowKind::Fixed { size, slide }) if slide > size => Err(src.invalid(
            &format!("{field}.sliding.slide"),
            format!("{who}{slide}ms is longer than the window ({size}ms): records between windows would belong to none; expected at most the size"),
        )),
        _ => Ok(()),
    }
}
