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
fn a_chain_and_the_same_path_written_as_a_graph_plan_alike() {
    let chain = "name: t\nevent_time: {field: value}\nsource:\n  generator: {}\nsteps:\n  - filter: value > 3\n  - key_by: key\n  - running_count: n\n    id: counts\n  - window: {tumbling: 1s, aggregates: [{count: c}]}\nsink:\n  blackhole: {}\n";
    // Named as the chain's nodes are (source, step ids, sink), written out of order.
    let graph = "name: t\nsources:\n  source:\n    generator: {}\n    event_time: {field: value}\nsteps:\n  - {name: key_by-0, input: filter-0, key_by: key}\n  - {name: filter-0, input: source, filter: value > 3}\n  - {name: counts, input: key_by-0, running_count: n}\n  - {name: window-0, input: counts, window: {tumbling: 1s, aggregates: [{count: c}]}}\nsinks:\n  sink:\n    input: window-0\n    blackhole: {}\n";
    let (chain, graph) = (plan_text(chain).unwrap(), plan_text(graph).unwrap());
    // Only where the filter is written differs.
    assert_eq!(graph.describe().replace("steps[1].filter", "steps[0].filter"), chain.describe());
    assert_eq!(graph.stateful_operator_ids(), ["source", "sink", "in-flight-1", "counts", "window-0"]);
}

#[test]
fn a_graph_names_its_source_and_sink_state_and_its_event_time_field_under_the_source() {
    let text = |field: &str| format!("name: t\nsources:\n  clicks:\n    generator: {{}}\n    event_time: {{field: {field}}}\nsteps:\n  - {{name: keyed, input: clicks, key_by: key}}\n  - {{name: per_key, input: keyed, window: {{tumbling: 1s, aggregates: [{{count: c}}]}}}}\nsinks:\n  out:\n    input: per_key\n    blackhole: {{}}\n");
    let plan = plan_text(&text("value")).unwrap();
    assert_eq!((plan.source.state_id.as_str(), plan.sink.state_id.as_str()), ("clicks", "out"));
    assert_eq!(plan.stateful_operator_ids(), ["clicks", "out", "in-flight-1", "per_key"]);
    let err = plan_text(&text("nope")).unwrap_err().to_string();
    assert!(err.starts_with("p.yaml:5: sources.clicks.event_time.field: the source has no field `nope`"), "{err}");
}

#[test]
fn a_graph_that_is_not_one_path_is_refused_naming_the_node() {
    let text = "name: t\nsources:\n  a: {generator: {}}\nsteps:\n  - {name: x, input: a, filter: value > 3}\n  - {name: y, input: a, filter: value > 4}\n  - {name: xy, input: [x, y], union: {}}\nsinks:\n  out: {input: xy, blackhole: {}}\n";
    let err = plan_text(text).unwrap_err().to_string();
    assert!(err.starts_with("p.yaml:6: steps[1]: `x` and `y` both read `a`: fan-out is not planned yet"), "{err}");
}
