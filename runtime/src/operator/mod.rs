//! Operators chained inside a stage: filter, select, keyed running
//! aggregates, windows and joins. An operator turns one record batch into at
//! most one record batch; the stateful ones also snapshot and restore their
//! state by key group. A join, the first operator of its stage, is told
//! which input each batch came from.
//!
//! Operators do not know about barriers, channels or storage: the subtask
//! loop calls `snapshot` at the aligned barrier and writes what it returns.

mod assign;
mod join;
mod restored_watermarks;
mod running;
mod window;

use arrow::array::{ArrayRef, AsArray, RecordBatch};
use arrow::compute::filter_record_batch;
use arrow::datatypes::SchemaRef;
use datafusion_common::DataFusionError;

use crate::error::{Error, Result};
use crate::plan::{CompiledExpr, OperatorKind, OperatorPlan};

pub use join::{IntervalJoin, LookupJoin, RegularJoin, WindowJoin};
pub use running::RunningAggregate;
pub use window::WindowAggregate;

/// Keyed state copied at a barrier. Taking the copy is the synchronous part
/// of a snapshot, the only one that holds up processing; [`Self::into_batch`]
/// finishes it (key groups, Arrow arrays) in the snapshot's asynchronous
/// task, beside encoding and writing.
pub struct StateCopy(Box<dyn FnOnce() -> Result<RecordBatch> + Send>);

impl StateCopy {
    /// State already in its snapshot form.
    pub fn ready(batch: RecordBatch) -> Self {
        StateCopy(Box::new(move || Ok(batch)))
    }

    /// State whose snapshot batch `finish` makes from an owned copy.
    pub fn deferred(finish: impl FnOnce() -> Result<RecordBatch> + Send + 'static) -> Self {
        StateCopy(Box::new(finish))
    }

    pub fn into_batch(self) -> Result<RecordBatch> {
        (self.0)()
    }
}

pub enum Operator {
    Filter { id: String, step: String, predicate: CompiledExpr },
    Select { id: String, step: String, exprs: Vec<CompiledExpr>, schema: SchemaRef },
    Running(RunningAggregate),
    Window(WindowAggregate),
    IntervalJoin(IntervalJoin),
    WindowJoin(WindowJoin),
    Join(RegularJoin),
    Lookup(LookupJoin),
}

impl Operator {
    /// An operator instance for one subtask.
    pub fn new(plan: &OperatorPlan, input_schema: &SchemaRef, subtask: u32, parallelism: u32, max_parallelism: u32) -> Result<Self> {
        Ok(match &plan.kind {
            OperatorKind::Filter(p) => Operator::Filter { id: plan.id.clone(), step: plan.step.clone(), predicate: p.clone() },
            OperatorKind::Select(exprs) => Operator::Select {
                id: plan.id.clone(),
                step: plan.step.clone(),
                exprs: exprs.clone(),
                schema: plan.output_schema.clone(),
            },
            OperatorKind::Running(r) => Operator::Running(RunningAggregate::new(
                plan.id.clone(),
                plan.step.clone(),
                r,
                input_schema,
                plan.output_schema.clone(),
                subtask,
                parallelism,
                max_parallelism,
            )?),
            OperatorKind::Window(w) => Operator::Window(WindowAggregate::new(
                plan.id.clone(),
                plan.step.clone(),
                w,
                input_schema,
                plan.output_schema.clone(),
                subtask,
                parallelism,
                max_parallelism,
            )?),
            OperatorKind::IntervalJoin(j) => Operator::IntervalJoin(IntervalJoin::new(
                plan.id.clone(),
                plan.step.clone(),
                j,
                plan.output_schema.clone(),
                subtask,
                parallelism,
                max_parallelism,
            )?),
            OperatorKind::WindowJoin(j) => Operator::WindowJoin(WindowJoin::new(
                plan.id.clone(),
                plan.step.clone(),
                j,
                plan.output_schema.clone(),
                subtask,
                parallelism,
                max_parallelism,
            )?),
            OperatorKind::Join(j) => Operator::Join(RegularJoin::new(
                plan.id.clone(),
                plan.step.clone(),
                j,
                plan.output_schema.clone(),
                subtask,
                parallelism,
                max_parallelism,
                join::wall_clock(),
            )?),
            OperatorKind::LookupJoin(l) => Operator::Lookup(LookupJoin::new(plan.id.clone(), plan.step.clone(), l, plan.output_schema.clone())),
        })
    }

    pub fn id(&self) -> &str {
        match self {
            Operator::Filter { id, .. } | Operator::Select { id, .. } => id,
            Operator::Running(r) => r.id(),
            Operator::Window(w) => w.id(),
            Operator::IntervalJoin(j) => j.id(),
            Operator::WindowJoin(j) => j.id(),
            Operator::Join(j) => j.id(),
            Operator::Lookup(l) => l.id(),
        }
    }

    /// Processes one batch of the stage's input `input`: only a join tells
    /// its inputs apart, every other operator reads them as one stream.
    pub fn process_input(&mut self, input: usize, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        match self {
            Operator::IntervalJoin(j) => j.process(input, batch),
            Operator::WindowJoin(j) => j.process(input, batch),
            Operator::Join(j) => j.process(input, batch),
            _ => self.process(batch),
        }
    }

    /// Connects what an operator reads outside the job (a lookup join's
    /// table) and checks it, before any record comes; `input` is the
    /// operator's input schema.
    pub async fn open(&mut self, input: &arrow::datatypes::Schema) -> Result<()> {
        match self {
            Operator::Lookup(l) => l.open(input).await,
            _ => Ok(()),
        }
    }

    /// As [`Operator::process_input`], awaiting an operator that reads
    /// outside the job (a lookup join).
    pub async fn process_async(&mut self, input: usize, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        match self {
            Operator::Lookup(l) => l.process(batch).await,
            _ => self.process_input(input, batch),
        }
    }

    /// Processes one batch; `None` when nothing is left of it.
    pub fn process(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        match self {
            Operator::Filter { step, predicate, .. } => {
                let mask = evaluate(step, predicate, &batch)?;
                let Some(mask) = mask.as_boolean_opt() else {
                    return Err(Error::Job(format!("{step}: `{}` gave {} instead of true or false", predicate.text, mask.data_type())));
                };
                let out = filter_record_batch(&batch, mask).map_err(Error::arrow(step.clone()))?;
                Ok((out.num_rows() > 0).then_some(out))
            }
            Operator::Select { step, exprs, schema, .. } => {
                let columns = exprs
                    .iter()
                    .enumerate()
                    .map(|(j, e)| evaluate(&format!("{step}[{j}]"), e, &batch))
                    .collect::<Result<Vec<_>>>()?;
                let out = RecordBatch::try_new(schema.clone(), columns).map_err(Error::arrow(step.clone()))?;
                Ok(Some(out))
            }
            Operator::Running(r) => r.process(batch).map(Some),
            Operator::Window(w) => w.process(batch),
            Operator::IntervalJoin(j) => j.process(0, batch),
            Operator::WindowJoin(j) => j.process(0, batch),
            Operator::Join(j) => j.process(0, batch),
            Operator::Lookup(l) => Err(Error::Job(format!("{}: a lookup join reads its table asynchronously: run it with `process_async`", l.id()))),
        }
    }

    /// The watermark advanced to `watermark`: what it fires, if anything.
    pub fn on_watermark(&mut self, watermark: i64) -> Result<Option<RecordBatch>> {
        match self {
            Operator::Window(w) => w.on_watermark(watermark),
            Operator::IntervalJoin(j) => j.on_watermark(watermark),
            Operator::WindowJoin(j) => j.on_watermark(watermark),
            _ => Ok(None),
        }
    }

    /// The watermark the operator passes on when its input's is
    /// `watermark`: the same, except for a join that outputs records
    /// behind it (see `join/interval.rs`).
    pub fn output_watermark(&self, watermark: i64) -> i64 {
        match self {
            Operator::IntervalJoin(j) => j.output_watermark(watermark),
            _ => watermark,
        }
    }

    /// Records dropped as late since the last call.
    pub fn take_late(&mut self) -> u64 {
        match self {
            Operator::Window(w) => w.take_late(),
            Operator::IntervalJoin(j) => j.take_late(),
            Operator::WindowJoin(j) => j.take_late(),
            _ => 0,
        }
    }

    /// A window's late records since the last call, for its late-records
    /// output (none without one).
    pub fn take_late_records(&mut self) -> Vec<RecordBatch> {
        match self {
            Operator::Window(w) => w.take_late_records(),
            _ => Vec::new(),
        }
    }

    /// The ids the operator keeps keyed state under in checkpoints (none
    /// when stateless; a join keeps one per side).
    pub fn state_ids(&self) -> Vec<String> {
        match self {
            Operator::Running(r) => vec![r.id().to_string()],
            Operator::Window(w) => vec![w.id().to_string()],
            Operator::IntervalJoin(j) => j.state_ids().to_vec(),
            Operator::WindowJoin(j) => j.state_ids().to_vec(),
            Operator::Join(j) => j.state_ids().to_vec(),
            Operator::Filter { .. } | Operator::Select { .. } | Operator::Lookup(_) => Vec::new(),
        }
    }

    /// Copies of the keyed state, taken at the barrier, under their ids.
    pub fn snapshot(&self) -> Result<Vec<(String, StateCopy)>> {
        Ok(match self {
            Operator::Running(r) => vec![(r.id().to_string(), r.copy_changed_after(None)?)],
            Operator::Window(w) => vec![(w.id().to_string(), StateCopy::ready(w.snapshot()?))],
            Operator::IntervalJoin(j) => j
                .snapshot()
                .into_iter()
                .map(|(id, copy)| {
                    let context = format!("{id} ({})", j.id());
                    (id, StateCopy::deferred(move || copy.into_batch(&context)))
                })
                .collect(),
            Operator::WindowJoin(j) => j
                .snapshot()
                .into_iter()
                .map(|(id, copy)| {
                    let context = format!("{id} ({})", j.id());
                    (id, StateCopy::deferred(move || copy.into_batch(&context)))
                })
                .collect(),
            Operator::Join(j) => j
                .snapshot()
                .into_iter()
                .map(|(id, copy)| {
                    let context = format!("{id} ({})", j.id());
                    (id, StateCopy::deferred(move || copy.into_batch(&context)))
                })
                .collect(),
            Operator::Filter { .. } | Operator::Select { .. } | Operator::Lookup(_) => Vec::new(),
        })
    }

    /// Whether the operator can snapshot only what changed. Running
    /// aggregates can (their state only grows and changes); windows always
    /// write all of theirs, which their firing keeps small.
    pub fn is_incremental(&self) -> bool {
        matches!(self, Operator::Running(_))
    }

    /// For an incremental operator: ends the current generation of changes
    /// (see [`RunningAggregate::cut`]) and returns the entries changed after
    /// generation `after` (all of them with `None`), and the generation cut.
    pub fn snapshot_changed_after(&mut self, after: Option<u32>) -> Result<Option<(StateCopy, u32)>> {
        match self {
            Operator::Running(r) => {
                let generation = r.cut();
                Ok(Some((r.copy_changed_after(after)?, generation)))
            }
            _ => Ok(None),
        }
    }

    /// Loads the part of a restored state batch, kept under `state_id` (one
    /// of [`Self::state_ids`]), that this subtask owns; `changes` for an
    /// incremental snapshot applied over the ones before it.
    pub fn restore(&mut self, state_id: &str, batch: &RecordBatch, location: &str, changes: bool) -> Result<()> {
        match self {
            Operator::Running(r) => r.restore(batch, location, changes),
            Operator::Window(w) => w.restore(batch, location),
            Operator::IntervalJoin(j) => j.restore(state_id, batch, location),
            Operator::WindowJoin(j) => j.restore(state_id, batch, location),
            Operator::Join(j) => j.restore(state_id, batch, location),
            Operator::Filter { .. } | Operator::Select { .. } | Operator::Lookup(_) => Ok(()),
        }
    }
}

/// Evaluates an expression on a whole batch. When that fails, the failure
/// is looked for record by record (only then: it costs one evaluation per
/// record), so that the error names the record a user has to fix.
fn evaluate(step: &str, expr: &CompiledExpr, batch: &RecordBatch) -> Result<ArrayRef> {
    let n = batch.num_rows();
    let whole = match expr.physical.evaluate(batch).and_then(|v| v.into_array(n)) {
        Ok(a) => return Ok(a),
        Err(e) => e,
    };
    for row in 0..n {
        let one = batch.slice(row, 1);
        if let Err(e) = expr.physical.evaluate(&one).and_then(|v| v.into_array(1)) {
            return Err(Error::Record {
                step: step.to_string(),
                message: format!("`{}` failed: {}", expr.text, evaluation_message(e)),
                record: record_json(batch, row),
                position: None,
            });
        }
    }
    // No single record fails on its own, so nothing says the next attempt
    // would fail the same way: leave it to a restart.
    Err(Error::Job(format!("{step}: `{}` failed on a batch of {n} records: {}", expr.text, evaluation_message(whole))))
}

/// DataFusion's message without its backtrace and its wrapping ("Arrow error:
/// Divide by zero error" becomes "Divide by zero error").
fn evaluation_message(e: DataFusionError) -> String {
    match e.find_root() {
        DataFusionError::ArrowError(a, _) => a.to_string(),
        other => other.strip_backtrace(),
    }
}

/// Longer records are cut here in error messages, which end up in logs and
/// Kubernetes events.
const RECORD_SHOWN: usize = 1000;

/// One row of a batch as a JSON object, for error messages.
pub(crate) fn record_json(batch: &RecordBatch, row: usize) -> String {
    let mut w = arrow::json::LineDelimitedWriter::new(Vec::new());
    let text = match w.write(&batch.slice(row, 1)).and_then(|_| w.finish()) {
        Ok(()) => String::from_utf8_lossy(&w.into_inner()).trim_end().to_string(),
        Err(e) => format!("(row {row} of the batch; cannot be shown as JSON: {e})"),
    };
    if text.len() <= RECORD_SHOWN {
        return text;
    }
    let mut cut = RECORD_SHOWN;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… ({} bytes)", &text[..cut], text.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use crate::expr::ExprCompiler;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    fn input() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, false),
            Field::new("d", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        RecordBatch::try_new(schema, vec![
            Arc::new(Int64Array::from(vec![10, 20, 30])),
            Arc::new(Int64Array::from(vec![2, 0, 5])),
            Arc::new(StringArray::from(vec!["1", "2", "three"])),
        ])
        .unwrap()
    }

    fn select(step: &str, items: &[&str]) -> Operator {
        let c = ExprCompiler::new(&input().schema()).unwrap();
        let (exprs, fields): (Vec<_>, Vec<_>) = items
            .iter()
            .map(|t| {
                let (physical, f) = c.select_item(step, t).unwrap();
                (CompiledExpr { text: t.to_string(), physical }, f)
            })
            .unzip();
        Operator::Select { id: "s".into(), step: step.into(), exprs, schema: crate::expr::select_schema(&fields) }
    }

    #[test]
    fn a_division_by_zero_in_a_select_is_fatal_and_names_the_step_the_expression_and_the_record() {
        let mut op = select("steps[1].select", &["n", "n / d AS q"]);
        let err = op.process(input()).unwrap_err();
        assert!(err.is_fatal(), "{err}");
        let text = err.to_string();
        assert!(text.starts_with("steps[1].select[1]: `n / d AS q` failed: "), "{text}");
        assert!(text.to_lowercase().contains("divide by zero"), "{text}");
        assert!(text.ends_with(r#"the record: {"n":20,"d":0,"s":"2"}"#), "{text}");
    }

    #[test]
    fn a_failed_cast_in_a_filter_is_fatal_and_names_the_record() {
        let schema = input().schema();
        let predicate = ExprCompiler::new(&schema).unwrap().filter("steps[0].filter", "CAST(s AS BIGINT) > 1").unwrap();
        let mut op = Operator::Filter {
            id: "f".into(),
            step: "steps[0].filter".into(),
            predicate: CompiledExpr { text: "CAST(s AS BIGINT) > 1".into(), physical: predicate },
        };
        let err = op.process(input()).unwrap_err();
        assert!(err.is_fatal(), "{err}");
        let text = err.to_string();
        assert!(text.starts_with("steps[0].filter: `CAST(s AS BIGINT) > 1` failed: "), "{text}");
        assert!(text.contains("three") && text.ends_with(r#"the record: {"n":30,"d":5,"s":"three"}"#), "{text}");
    }

    #[test]
    fn records_are_shown_shortened_when_long() {
        let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, false)]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(StringArray::from(vec!["é".repeat(5000)]))]).unwrap();
        let shown = record_json(&b, 0);
        assert!(shown.len() < RECORD_SHOWN + 40 && shown.ends_with("bytes)"), "{shown}");
    }
}
