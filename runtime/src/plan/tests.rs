use super::*;

fn plan_text(text: &str) -> Result<JobPlan> {
    let src = PipelineSource { file: "p.yaml".into(), text: text.into() };
    let spec = PipelineSpec::from_source(&src)?;
    plan(&spec, &src)
}

#[test]
fn key_by_splits_the_pipeline_into_stages() {
    let p = plan_text("name: t\nsource:\n  generator: {}\nsteps:\n  - filter: value > 3\n  - key_by: key\n  - running_count: count\nsink:\n  blackhole: {}\n").unwrap();
    assert_eq!(p.stages.len(), 2);
    assert_eq!(p.stages[0].operators.len(), 1);
    assert!(matches!(p.stages[0].output, StageOutput::Exchange { ref key_indices } if key_indices == &vec![1]));
    assert_eq!(p.stages[1].output_schema.field(3).name(), "count");
}

#[test]
fn an_expression_error_names_file_line_and_step() {
    let err = plan_text("name: t\nsource:\n  generator: {}\nsteps:\n  - filter: nope > 3\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
    assert!(err.starts_with("p.yaml:5: steps[0].filter"), "{err}");
    assert!(err.contains("nope"), "{err}");
}

#[test]
fn an_event_time_field_that_is_missing_or_not_int64_is_refused_naming_it() {
    let text = |field: &str| format!("name: t\nevent_time: {{field: {field}}}\nsource:\n  file:\n    path: x\n    schema: {{k: int64, s: string}}\nsink:\n  blackhole: {{}}\n");
    let err = plan_text(&text("s")).unwrap_err().to_string();
    assert!(err.contains("event_time.field") && err.contains("expected int64"), "{err}");
    let err = plan_text(&text("nope")).unwrap_err().to_string();
    assert!(err.contains("event_time.field") && err.contains("no field `nope`"), "{err}");
}

#[test]
fn a_window_outputs_keys_bounds_and_aggregates_and_refuses_a_dropped_time_field() {
    let p = plan_text("name: t\nevent_time: {field: value}\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - window: {tumbling: 1s, aggregates: [{count: n}, {avg: {field: seq, as: m}}]}\nsink:\n  blackhole: {}\n").unwrap();
    let names: Vec<_> = p.stages[1].output_schema.fields().iter().map(|f| f.name().clone()).collect();
    assert_eq!(names, ["key", "window_start", "window_end", "n", "m"]);
    assert_eq!(p.stages[1].output_schema.field(4).data_type(), &DataType::Float64);
    let err = plan_text("name: t\nevent_time: {field: value}\nsource:\n  generator: {}\nsteps:\n  - select: [seq, key]\n  - key_by: key\n  - window: {tumbling: 1s, aggregates: [{count: n}]}\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
    assert!(err.contains("steps[2].window") && err.contains("event-time field `value` was dropped"), "{err}");
}

#[test]
fn recomputing_a_key_after_key_by_is_rejected() {
    let err = plan_text("name: t\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - select: [\"key + 1 AS key\", value]\n  - running_count: n\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
    assert!(err.contains("cannot be recomputed"), "{err}");
}

#[test]
fn aggregating_a_string_field_is_rejected_with_the_type() {
    let err = plan_text("name: t\nsource:\n  file:\n    path: x\n    schema: {k: int64, s: string}\nsteps:\n  - key_by: k\n  - running_sum: {field: s}\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
    assert!(err.contains("expected int64 or float64"), "{err}");
}

#[test]
fn the_steps_not_planned_yet_are_refused_naming_the_field() {
    let text = "name: t\nsource:\n  generator: {}\nsteps:\n  - broadcast: {}\nsink:\n  blackhole: {}\n";
    let err = plan_text(text).err().map(|e| e.to_string());
    assert_eq!(err.as_deref(), Some("p.yaml:5: steps[0].broadcast: broadcast steps are not planned yet"));
}

#[test]
fn a_graph_is_refused_naming_the_field() {
    let text = "name: t\nsources:\n  a:\n    generator: {}\nsteps:\n  - {name: f, input: a, filter: value > 3}\nsinks:\n  out:\n    input: f\n    blackhole: {}\n";
    let err = plan_text(text).err().map(|e| e.to_string());
    assert_eq!(err.as_deref(), Some("p.yaml:2: sources: graph pipelines are not planned yet"));
}
