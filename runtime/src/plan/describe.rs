//! The plan as text: one block per stage with its input, its operators and
//! its output, then the state ids a snapshot of the job holds.
//!
//! The text is what `weir plan` prints and what the planner's golden tests
//! compare, so that a change of stages, schemas or state ids (which decide
//! whether a savepoint still restores) shows up in review as a diff.

use std::fmt::Write;

use arrow::datatypes::Schema;

use super::{AggFn, EdgeKind, JobPlan, JoinSide, OperatorKind, OperatorPlan, StageInput, StageOutput, StagePlan, WindowFn, WindowPlan};

impl JobPlan {
    /// The plan as text, stable for a given pipeline.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        let stages = self.stages.len();
        let _ = writeln!(
            out,
            "job {}: {stages} stage{} at parallelism {} (max {})",
            self.spec.name,
            if stages == 1 { "" } else { "s" },
            self.spec.parallelism,
            self.spec.max_parallelism
        );
        for stage in &self.stages {
            self.describe_input(&mut out, stage);
            let mut input = stage.input_schema.as_ref();
            for op in &stage.operators {
                let _ = writeln!(out, "  {} ({}): {} -> {}", op.id, op.step, operator(op, input), fields(&op.output_schema));
                input = op.output_schema.as_ref();
            }
            match &stage.output {
                StageOutput::Edges(edges) => {
                    for e in edges {
                        let into = if e.input == 0 { format!("stage {}", e.to_stage) } else { format!("stage {} as input {}", e.to_stage, e.input) };
                        let _ = match &e.kind {
                            EdgeKind::Hash { key_indices } => writeln!(out, "  hash by [{}] into {into}", columns(input, key_indices)),
                            EdgeKind::Forward => writeln!(out, "  forward into {into}"),
                            EdgeKind::Broadcast => writeln!(out, "  broadcast into {into}"),
                        };
                    }
                }
                // A chain's one sink is `sink`, and its line is as it always was.
                StageOutput::Sink(sink) if sink.name == "sink" => {
                    let _ = writeln!(out, "  writes sink {} {}", sink.spec.kind(), fields(&stage.output_schema));
                }
                StageOutput::Sink(sink) => {
                    let _ = writeln!(out, "  writes sink `{}` ({}) {}", sink.name, sink.spec.kind(), fields(&stage.output_schema));
                }
            }
        }
        let _ = writeln!(out, "state ids: {}", self.stateful_operator_ids().join(", "));
        out
    }
}

impl JobPlan {
    /// The stage's first line: what it reads. A chain's stages read "source
    /// <kind>" and "the exchange", as they always have.
    fn describe_input(&self, out: &mut String, stage: &StagePlan) {
        let i = stage.index;
        if let Some(source) = &stage.source {
            let kind = source.spec.kind();
            let what = if source.name == "source" { kind.to_string() } else { format!("`{}` ({kind})", source.name) };
            let _ = write!(out, "stage {i} reads source {what} {}", fields(&stage.input_schema));
            if let Some(et) = &source.event_time {
                let _ = write!(out, ", event time `{}` out of order by {} ms", et.field, et.max_out_of_orderness_ms);
                if let Some(idle) = et.idle_timeout {
                    let _ = write!(out, ", idle after {} ms", idle.as_millis());
                }
            }
            out.push('\n');
            return;
        }
        if let [StageInput { from_stage, edge: EdgeKind::Hash { .. }, .. }] = stage.inputs.as_slice() {
            if *from_stage + 1 == i {
                let _ = writeln!(out, "stage {i} reads the exchange {}", fields(&stage.input_schema));
                return;
            }
        }
        // A join reads its inputs apart, each of its own schema.
        let apart = stage.operators.first().is_some_and(|o| o.kind.reads_inputs_apart());
        let inputs: Vec<String> = stage
            .inputs
            .iter()
            .map(|input| {
                let how = match &input.edge {
                    EdgeKind::Hash { key_indices } => format!("by hash [{}]", columns(&input.schema, key_indices)),
                    EdgeKind::Forward => "forward".into(),
                    EdgeKind::Broadcast => "broadcast".into(),
                };
                match apart {
                    true => format!("stage {} {how} {}", input.from_stage, fields(&input.schema)),
                    false => format!("stage {} {how}", input.from_stage),
                }
            })
            .collect();
        match apart {
            true => writeln!(out, "stage {i} (`{}`) reads {}", stage.name, inputs.join(" and ")),
            false => writeln!(out, "stage {i} (`{}`) reads {} {}", stage.name, inputs.join(" and "), fields(&stage.input_schema)),
        }
        .ok();
    }
}

/// What an operator does, with columns named as its input has them.
fn operator(op: &OperatorPlan, input: &Schema) -> String {
    match &op.kind {
        OperatorKind::Filter(e) => format!("filter `{}`", e.text),
        OperatorKind::Select(items) => {
            format!("select {}", items.iter().map(|e| format!("`{}`", e.text)).collect::<Vec<_>>().join(", "))
        }
        OperatorKind::Running(r) => {
            let f = match r.function {
                AggFn::Count => "count",
                AggFn::Sum => "sum",
                AggFn::Min => "min",
                AggFn::Max => "max",
            };
            let of = r.input.map(|c| format!(" of {}", column(input, c))).unwrap_or_default();
            format!("running {f}{of} per [{}]", columns(input, &r.key_indices))
        }
        OperatorKind::Window(w) => window(w, input),
        OperatorKind::IntervalJoin(j) => {
            let keys = |side: &JoinSide| columns(&side.schema, &side.key_indices);
            format!(
                "interval join{} on [{}] = [{}], {}.{} in [{}.{} {:+} ms, {:+} ms]",
                if j.left_outer { " (left outer)" } else { "" },
                keys(&j.left),
                keys(&j.right),
                j.right.name,
                time_column(&j.right),
                j.left.name,
                time_column(&j.left),
                j.lower_ms,
                j.upper_ms
            )
        }
        OperatorKind::WindowJoin(j) => {
            let keys = |side: &JoinSide| columns(&side.schema, &side.key_indices);
            let shape = match j.session_gap_ms {
                Some(gap) => format!("session windows, gap {gap} ms"),
                None if j.size_ms == j.slide_ms => format!("tumbling windows of {} ms", j.size_ms),
                None => format!("sliding windows of {} ms every {} ms", j.size_ms, j.slide_ms),
            };
            let time = |side: &JoinSide| format!("{}.{}", side.name, time_column(side));
            format!("window join on [{}] = [{}], {shape} on {} and {}", keys(&j.left), keys(&j.right), time(&j.left), time(&j.right))
        }
        OperatorKind::Join(j) => {
            let keys = |side: &JoinSide| columns(&side.schema, &side.key_indices);
            format!("join on [{}] = [{}], each record kept {} ms after it arrived", keys(&j.left), keys(&j.right), j.ttl_ms)
        }
        OperatorKind::LookupJoin(l) => format!(
            "lookup join on [{}] = postgres {} [{}] adding [{}], at most {} keys cached for {} ms, {} a record without a row",
            columns(input, &l.key_indices),
            l.table,
            l.key_columns.join(", "),
            l.columns.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>().join(", "),
            l.max_rows,
            l.ttl_ms,
            if l.keep_missing { "keeping" } else { "dropping" }
        ),
    }
}

/// A join side's event-time column, by name.
fn time_column(side: &JoinSide) -> String {
    side.time_index.map(|i| column(&side.schema, i)).unwrap_or_else(|| "(no event time)".into())
}

fn window(w: &WindowPlan, input: &Schema) -> String {
    let shape = match w.session_gap_ms {
        Some(gap) => format!("session window, gap {gap} ms"),
        None if w.size_ms == w.slide_ms => format!("tumbling window of {} ms", w.size_ms),
        None => format!("sliding window of {} ms every {} ms", w.size_ms, w.slide_ms),
    };
    let aggs: Vec<String> = w
        .aggregates
        .iter()
        .map(|a| {
            let f = match a.function {
                WindowFn::Count => "count",
                WindowFn::Sum => "sum",
                WindowFn::Min => "min",
                WindowFn::Max => "max",
                WindowFn::Avg => "avg",
            };
            match a.input {
                Some(c) => format!("{f}({})", column(input, c)),
                None => format!("{f}(*)"),
            }
        })
        .collect();
    let mut text = format!(
        "{shape} on {} per [{}], lateness {} ms: {}",
        column(input, w.time_index),
        columns(input, &w.key_indices),
        w.allowed_lateness_ms,
        aggs.join(", ")
    );
    if let Some(late) = &w.late_records {
        let _ = write!(text, ", late records to {}", late.path);
    }
    text
}

/// `(name type, …)`, with `?` after the type of a field that may be null.
fn fields(schema: &Schema) -> String {
    let f: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| format!("{} {}{}", f.name(), f.data_type(), if f.is_nullable() { "?" } else { "" }))
        .collect();
    format!("({})", f.join(", "))
}

fn column(schema: &Schema, i: usize) -> String {
    schema.fields().get(i).map(|f| f.name().clone()).unwrap_or_else(|| format!("#{i}"))
}

fn columns(schema: &Schema, indices: &[usize]) -> String {
    indices.iter().map(|&i| column(schema, i)).collect::<Vec<_>>().join(", ")
}
