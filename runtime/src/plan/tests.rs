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
    let StageOutput::Edges(edges) = &p.stages[0].output else { panic!("stage 0 ends in the sink") };
    assert!(matches!(edges.as_slice(), [OutEdge { to_stage: 1, input: 0, kind: EdgeKind::Hash { key_indices } }] if key_indices == &vec![1]));
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
fn a_lookup_join_is_chained_after_its_input_adds_its_columns_renaming_a_taken_name_and_refuses_float_keys() {
    let text = "name: t\nsources:\n  a: {generator: {}, event_time: {field: value}}\nsteps:\n  - {name: j, input: a, lookup_join: {on: key, postgres: {connection: host=h, table: t, key: [id], columns: {n: string, value: float64}}, cache: {max_rows: 10, ttl: 1m}, missing: keep}}\n  - {name: k, input: j, key_by: key}\n  - {name: w, input: k, window: {tumbling: 1s, aggregates: [{count: c}]}}\nsinks:\n  out: {input: w, blackhole: {}}\n";
    let p = plan_text(text).unwrap();
    let described = p.describe();
    assert_eq!(p.stages.len(), 2, "a lookup join chains with its input, and the window reads the event time it passed on: {described}");
    assert!(described.contains("(seq Int64, key Int64, value Int64), event time `value` out of order by 0 ms\n  j (steps[0].lookup_join): lookup join"), "{described}");
    assert!(described.contains("lookup join on [key] = postgres t [id] adding [n, value], at most 10 keys cached for 60000 ms, keeping a record without a row"), "{described}");
    assert!(described.contains("(seq Int64, key Int64, value Int64, n Utf8?, j_value Float64?)"), "{described}");
    let float_key = text.replace("on: key,", "on: score,").replace("generator: {}", "file: {path: x, schema: {score: float64, value: int64}}");
    let err = plan_text(&float_key).err().map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(err, "p.yaml:5: steps[0].lookup_join.on[0]: `j`: `score` is float64: a lookup key must be int64, string or boolean");
}

/// Two file sources with event time, joined by `join` (a YAML map).
fn join_text(a: &str, b: &str, join: &str) -> String {
    format!(
        "name: t\nsources:\n  orders:\n    file: {{path: o, schema: {{{a}}}}}\n    event_time: {{field: ts}}\n  payments:\n    file: {{path: p, schema: {{{b}}}}}\n    event_time: {{field: ts}}\nsteps:\n  - {{name: matched, input: [orders, payments], interval_join: {join}}}\nsinks:\n  out: {{input: matched, blackhole: {{}}}}\n"
    )
}

#[test]
fn an_interval_join_reads_both_inputs_by_hash_on_their_keys_and_renames_the_right_fields_that_clash() {
    let text = join_text("id: int64, amount: float64, ts: int64", "order: int64, ts: int64, payments_x: string", "{on: id, right_on: order, between: {lower: 0s, upper: 1h}, type: left_outer}");
    let p = plan_text(&text).unwrap();
    let join = &p.stages[2];
    assert_eq!(join.inputs.iter().map(|i| (i.from_stage, i.edge.clone())).collect::<Vec<_>>(), [(0, EdgeKind::Hash { key_indices: vec![0] }), (1, EdgeKind::Hash { key_indices: vec![0] })]);
    let fields: Vec<String> = join.output_schema.fields().iter().map(|f| format!("{}{}", f.name(), if f.is_nullable() { "?" } else { "" })).collect();
    assert_eq!(fields, ["id?", "amount?", "ts?", "order?", "payments_ts?", "payments_x?"]);
    assert!(p.stateful_operator_ids().contains(&"matched.left".to_string()) && p.stateful_operator_ids().contains(&"matched.right".to_string()));
    let described = p.describe();
    assert!(described.contains("stage 2 (`matched`) reads stage 0 by hash [id] (id Int64?, amount Float64?, ts Int64?) and stage 1 by hash [order] (order Int64?"), "{described}");
    assert!(described.contains("interval join (left outer) on [id] = [order], payments.ts in [orders.ts +0 ms, +3600000 ms]"), "{described}");
}

#[test]
fn a_regular_join_needs_no_event_time_and_its_output_has_none() {
    let text = "name: t\nsources:\n  a: {generator: {}}\n  b: {generator: {}}\nsteps:\n  - {name: j, input: [a, b], join: {on: key, ttl: 1h}}\nsinks:\n  out: {input: j, blackhole: {}}\n";
    let p = plan_text(text).unwrap();
    let join = &p.stages[2];
    assert_eq!(join.inputs.iter().map(|i| i.from_stage).collect::<Vec<_>>(), [0, 1]);
    assert!(join.inputs.iter().all(|i| matches!(i.edge, EdgeKind::Hash { .. })), "both inputs by hash");
    assert!(p.stateful_operator_ids().contains(&"j.left".to_string()) && p.stateful_operator_ids().contains(&"j.right".to_string()));
    let described = p.describe();
    assert!(described.contains("join on [key] = [key], each record kept 3600000 ms after it arrived"), "{described}");
    let windowed = text.replace("sinks:", "  - {name: w, input: j, window: {tumbling: 1s, aggregates: [{count: n}]}}\nsinks:").replace("input: j, blackhole", "input: w, blackhole");
    let err = plan_text(&windowed).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("steps[1].window") && err.contains("event time"), "a window after a regular join is refused for want of event time: {err}");
}

#[test]
fn interval_join_errors_name_the_field_and_say_what_was_expected() {
    let err = |a: &str, b: &str, join: &str| plan_text(&join_text(a, b, join)).err().map(|e| e.to_string()).unwrap_or_default();
    let between = "between: {lower: 0s, upper: 1s}";
    assert_eq!(
        err("id: int64, ts: int64", "id: string, ts: int64", &format!("{{on: id, {between}}}")),
        "p.yaml:10: steps[0].interval_join.on[0]: `matched`: `id` is int64 in `orders` but `id` is string in `payments`: join keys must have one type"
    );
    assert_eq!(
        err("id: int64, ts: int64", "order: int64, ts: int64", &format!("{{on: id, {between}}}")),
        "p.yaml:10: steps[0].interval_join.on[0]: `matched`: `payments` has no field `id`: expected one of order, ts"
    );
    assert_eq!(
        err("id: int64, ts: int64, payments_ts: int64", "id: int64, ts: int64", &format!("{{on: id, {between}}}")),
        "p.yaml:10: steps[0].interval_join: `matched`: right field `ts` would become `payments_ts`, which is taken: select it under another name before the join"
    );
    let untimed = "name: t\nsources:\n  a: {generator: {}, event_time: {field: value}}\n  b: {generator: {}}\nsteps:\n  - {name: j, input: [a, b], interval_join: {on: key, between: {lower: 0s, upper: 1s}}}\nsinks:\n  out: {input: j, blackhole: {}}\n";
    let e = plan_text(untimed).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.starts_with("p.yaml:6: steps[0].interval_join: `j` works by event time, but it reads the source `b`, which has none"), "{e}");
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
    let source = plan.stages[0].source.as_ref().unwrap();
    assert_eq!((source.state_id.as_str(), plan.sinks().next().unwrap().state_id.as_str()), ("clicks", "out"));
    assert_eq!(plan.stateful_operator_ids(), ["clicks", "out", "in-flight-1", "per_key"]);
    let err = plan_text(&text("nope")).unwrap_err().to_string();
    assert!(err.starts_with("p.yaml:5: sources.clicks.event_time.field: the source has no field `nope`"), "{err}");
}

#[test]
fn a_fan_out_gets_forward_edges_and_a_union_reads_each_input_over_its_own() {
    let text = "name: t\nsources:\n  a: {generator: {}}\nsteps:\n  - {name: x, input: a, filter: value > 3}\n  - {name: y, input: a, filter: value < 3}\n  - {name: xy, input: [x, y], union: {}}\n  - {name: keyed, input: xy, key_by: key}\n  - {name: n, input: keyed, running_count: n}\nsinks:\n  out: {input: n, blackhole: {}}\n";
    let plan = plan_text(text).unwrap();
    let shape: Vec<(String, Vec<(usize, EdgeKind)>)> =
        plan.stages.iter().map(|s| (s.name.clone(), s.inputs.iter().map(|i| (i.from_stage, i.edge.clone())).collect())).collect();
    let hash = EdgeKind::Hash { key_indices: vec![1] };
    assert_eq!(
        shape,
        [
            ("a".to_string(), vec![]),
            ("x".to_string(), vec![(0, EdgeKind::Forward)]),
            ("y".to_string(), vec![(0, EdgeKind::Forward)]),
            ("xy".to_string(), vec![(1, EdgeKind::Forward), (2, EdgeKind::Forward)]),
            ("n".to_string(), vec![(3, hash)]),
        ]
    );
    assert!(plan.stages[3].operators.is_empty(), "the gate merges a union's inputs");
    assert!(matches!(plan.stages[4].output, StageOutput::Sink(_)));
    assert_eq!(plan.stateful_operator_ids(), ["a", "out", "in-flight-1", "in-flight-2", "in-flight-3", "in-flight-3.1", "in-flight-4", "n"]);
    // Records in flight are kept per input, under the edge's name: a node
    // with several readers names the reader too.
    let edges: Vec<Vec<(&str, Option<Vec<usize>>)>> =
        plan.stages.iter().map(|s| s.inputs.iter().map(|i| (i.edge_id.as_str(), i.keys.clone())).collect()).collect();
    assert_eq!(
        edges,
        [vec![], vec![("a to x", None)], vec![("a to y", None)], vec![("x", None), ("y", None)], vec![("keyed", Some(vec![1]))]]
    );
}

#[test]
fn a_forward_edge_carrying_a_keyed_stream_names_its_keys_for_a_rescaled_restore() {
    let text = "name: t\nsources:\n  a: {generator: {}}\nsteps:\n  - {name: keyed, input: a, key_by: key}\n  - {name: n, input: keyed, running_count: n}\n  - {name: x, input: n, filter: n > 3}\n  - {name: y, input: n, filter: n < 3}\n  - {name: xy, input: [x, y], union: {}}\nsinks:\n  out: {input: xy, blackhole: {}}\n";
    let plan = plan_text(text).unwrap();
    let x = plan.stages.iter().find(|s| s.name == "x").unwrap();
    assert_eq!((x.inputs[0].edge.clone(), x.inputs[0].keys.clone()), (EdgeKind::Forward, Some(vec![1])));
    let xy = plan.stages.iter().find(|s| s.name == "xy").unwrap();
    assert_eq!(xy.inputs.iter().map(|i| i.keys.clone()).collect::<Vec<_>>(), [Some(vec![1]), Some(vec![1])]);
}

#[test]
fn a_union_of_two_sources_keeps_keys_and_event_time_they_share_and_a_window_reads_them() {
    let text = "name: t\nsources:\n  a: {generator: {}, event_time: {field: value}}\n  b: {generator: {}, event_time: {field: value}}\nsteps:\n  - {name: ka, input: a, key_by: key}\n  - {name: kb, input: b, key_by: key}\n  - {name: both, input: [ka, kb], union: {}}\n  - {name: w, input: both, window: {tumbling: 1s, aggregates: [{count: c}]}}\nsinks:\n  out: {input: w, blackhole: {}}\n";
    let plan = plan_text(text).unwrap();
    assert_eq!(plan.sources().map(|(stage, s)| (stage, s.name.as_str())).collect::<Vec<_>>(), [(0, "a"), (1, "b")]);
    let union = &plan.stages[2];
    assert!(union.inputs.iter().all(|i| i.edge == EdgeKind::Hash { key_indices: vec![1] }));
    assert_eq!(union.operators[0].id, "w");
}

#[test]
fn a_union_of_other_schemas_or_event_times_is_refused_naming_the_input() {
    let text = |b: &str| format!("name: t\nsources:\n  a: {{generator: {{}}}}\n  b: {b}\nsteps:\n  - {{name: both, input: [a, b], union: {{}}}}\nsinks:\n  out: {{input: both, blackhole: {{}}}}\n");
    let err = plan_text(&text("{file: {path: x, schema: {seq: int64, key: string, value: int64}}}")).unwrap_err().to_string();
    assert_eq!(err, "p.yaml:6: steps[0].input[1]: `b` has fields (seq Int64, key Utf8, value Int64) but `a` has (seq Int64, key Int64, value Int64): a union takes inputs of one schema");
    let err = plan_text(&text("{generator: {}, event_time: {field: value}}")).unwrap_err().to_string();
    assert!(err.ends_with("`b` has event time in `value` but `a` has no event time: a union's inputs carry event time in one field, or none does"), "{err}");
    // Fields that differ only in whether they may be null make one union, whose fields may be.
    let plan = plan_text(&text("{file: {path: x, schema: {seq: int64, key: int64, value: int64}}}")).unwrap();
    assert!(plan.stages[2].input_schema.fields().iter().all(|f| f.is_nullable()));
}

#[test]
fn a_broadcast_sends_to_every_subtask_of_its_readers() {
    let text = "name: t\nsources:\n  a: {generator: {}}\nsteps:\n  - {name: all, input: a, broadcast: {}}\n  - {name: big, input: all, filter: value > 3}\nsinks:\n  out: {input: big, blackhole: {}}\n";
    let plan = plan_text(text).unwrap();
    assert_eq!(plan.stages.len(), 2);
    assert_eq!(plan.stages[1].inputs[0].edge, EdgeKind::Broadcast);
    assert!(plan.describe().contains("  broadcast into stage 1\nstage 1 (`big`) reads stage 0 broadcast (seq Int64, key Int64, value Int64)\n"), "{}", plan.describe());
}
