//! The graph form: its normal form, its YAML, and one test per structural
//! check (graphs.md §1.4), each asserting the line, the field and the message.

use super::*;
use crate::pipeline::{
    AggregateSpec, EventTimeSpec, FileFormat, FileSinkSpec, GeneratorSpec, Guarantee, HumanDuration, IntervalJoinType, Missing, PipelineError,
    PipelineSpec, SinkSpec, SourceSpec, WindowAggregate, WindowSpec,
};

fn parse(text: &str) -> Result<PipelineSpec, PipelineError> {
    PipelineSpec::from_yaml("g.yaml", text)
}

/// The line, field and message of the error `text` is refused with.
fn refused(text: &str) -> (Option<usize>, String, String) {
    match parse(text) {
        Err(PipelineError::Invalid { line, field, message, .. }) => (line, field, message),
        other => panic!("expected a refusal naming a field, got {other:?}"),
    }
}

fn node<T>(name: &str, path: &str, inputs: &[&str], spec: T) -> Node<T> {
    let inputs = inputs.iter().map(|i| i.to_string()).collect();
    Node { name: name.into(), state_id: name.into(), path: path.into(), inputs, spec }
}

fn generator(events: u64, keys: u64, rate: u64) -> SourceSpec {
    SourceSpec::Generator(GeneratorSpec { events: Some(events), keys, rate, batch_size: 1024 })
}

fn file_sink(path: &str) -> SinkSpec {
    SinkSpec::File(FileSinkSpec { path: path.into(), format: FileFormat::Jsonl, guarantee: Guarantee::ExactlyOnce, max_file_bytes: None })
}

fn exactly_once_graph(rate: u64) -> PipelineGraph {
    PipelineGraph {
        sources: vec![node("source", "source", &[], SourceNode { spec: generator(1_000_000, 1000, rate), event_time: None })],
        steps: vec![
            node("key_by-0", "steps[0]", &["source"], StepKind::KeyBy(vec!["key".into()])),
            node("running_count-0", "steps[1]", &["key_by-0"], StepKind::RunningCount("count".into())),
        ],
        sinks: vec![node("sink", "sink", &["running_count-0"], file_sink("out/exactly-once"))],
    }
}

#[test]
fn every_example_chain_reduces_to_the_graph_written_by_hand() {
    let spec = parse(include_str!("../../../../examples/exactly-once.yaml")).unwrap();
    assert_eq!(spec.graph(), exactly_once_graph(200_000));

    let job: crate::streamjob::StreamJob =
        serde_yaml::from_str(include_str!("../../../../examples/streamjob.yaml")).unwrap();
    assert_eq!(job.spec.validate_pipeline().unwrap().graph(), exactly_once_graph(50_000));

    let spec = parse(include_str!("../../../../examples/windows.yaml")).unwrap();
    let event_time = EventTimeSpec { field: "value".into(), max_out_of_orderness: HumanDuration::from_millis(200), idle_timeout: None };
    let aggregate = |field: &str, output: &str| Some(AggregateSpec { field: field.into(), output: Some(output.into()) });
    let window = WindowSpec {
        tumbling: Some(HumanDuration::from_millis(1000)),
        sliding: None,
        session: None,
        allowed_lateness: HumanDuration::from_millis(0),
        aggregates: vec![
            WindowAggregate { count: Some("events".into()), ..Default::default() },
            WindowAggregate { sum: aggregate("seq", "seq_total"), ..Default::default() },
            WindowAggregate { avg: aggregate("value", "mean_time"), ..Default::default() },
        ],
        late_records: None,
    };
    let by_hand = PipelineGraph {
        sources: vec![node("source", "source", &[], SourceNode { spec: generator(100_000, 10, 20_000), event_time: Some(event_time) })],
        steps: vec![
            node("key_by-0", "steps[0]", &["source"], StepKind::KeyBy(vec!["key".into()])),
            node("window-0", "steps[1]", &["key_by-0"], StepKind::Window(window)),
        ],
        sinks: vec![node("sink", "sink", &["window-0"], file_sink("out/windows"))],
    };
    assert_eq!(spec.graph(), by_hand);
}

#[test]
fn a_written_id_is_a_chain_steps_name_and_state_id() {
    let spec = parse("name: t\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - running_count: n\n    id: counts\nsink:\n  blackhole: {}\n").unwrap();
    let graph = spec.graph();
    assert_eq!((graph.steps[1].name.as_str(), graph.steps[1].state_id.as_str()), ("counts", "counts"));
    assert_eq!(graph.sinks[0].inputs, ["counts"]);
}

/// graphs.md §1.1, verbatim.
const DESIGN_EXAMPLE: &str = r#"name: orders
parallelism: 4
checkpoint: {interval: 5s, alignment_timeout: 200ms}
sources:                                   # map: name -> one connector key + optional event_time
  orders:
    kafka: {bootstrap_servers: kafka:9092, topic: orders,
            schema: {order_id: int64, customer: string, amount: float64, ts: int64}}
    event_time: {field: ts, max_out_of_orderness: 5s, idle_timeout: 30s}
  payments:
    kafka: {bootstrap_servers: kafka:9092, topic: payments,
            schema: {order_id: int64, paid: float64, ts: int64}}
    event_time: {field: ts, max_out_of_orderness: 5s, idle_timeout: 30s}
steps:                                     # list; each item: name, input, one kind key, optional id
  - name: matched
    input: [orders, payments]              # [left, right]
    interval_join: {on: [order_id], between: {lower: 0s, upper: 1h}, type: left_outer}
    # output: order_id, customer, amount, ts, payments_order_id, paid, payments_ts
  - {name: settled_only, input: matched, filter: "paid IS NOT NULL"}
  - {name: settled, input: settled_only, select: [order_id, customer, "'paid' AS status", ts]}
  - {name: open_only, input: matched, filter: "paid IS NULL"}
  - {name: open, input: open_only, select: [order_id, customer, "'open' AS status", ts]}
  - {name: statuses, input: [settled, open], union: {}}
  - {name: by_customer, input: statuses, key_by: customer}
  - name: hourly
    input: by_customer
    window: {tumbling: 1h, aggregates: [{count: orders}]}
sinks:                                     # map: name -> input + one connector key
  status_topic:
    input: statuses
    kafka: {bootstrap_servers: kafka:9092, topic: order-status, guarantee: exactly-once}
  hourly_table:
    input: hourly
    postgres: {connection: "host=pg dbname=shop user=weir", table: hourly_orders}
"#;

#[test]
fn the_design_example_parses_validates_and_keeps_its_names_inputs_and_paths() {
    let spec = parse(DESIGN_EXAMPLE).unwrap();
    assert!(spec.is_graph() && spec.chain().is_none());
    let graph = spec.graph();
    let nodes: Vec<(&str, &str, Vec<&str>)> =
        graph.nodes().map(|n| (n.name(), n.path(), n.inputs().iter().map(String::as_str).collect())).collect();
    assert_eq!(
        nodes,
        [
            ("orders", "sources.orders", vec![]),
            ("payments", "sources.payments", vec![]),
            ("matched", "steps[0]", vec!["orders", "payments"]),
            ("settled_only", "steps[1]", vec!["matched"]),
            ("settled", "steps[2]", vec!["settled_only"]),
            ("open_only", "steps[3]", vec!["matched"]),
            ("open", "steps[4]", vec!["open_only"]),
            ("statuses", "steps[5]", vec!["settled", "open"]),
            ("by_customer", "steps[6]", vec!["statuses"]),
            ("hourly", "steps[7]", vec!["by_customer"]),
            ("status_topic", "sinks.status_topic", vec!["statuses"]),
            ("hourly_table", "sinks.hourly_table", vec!["hourly"]),
        ]
    );
    assert!(graph.nodes().all(|n| n.state_id() == n.name()));
    let StepKind::IntervalJoin(join) = &graph.steps[0].spec else { panic!("not an interval join") };
    assert_eq!((join.between.upper.millis(), join.join_type), (3_600_000, IntervalJoinType::LeftOuter));
    assert_eq!(graph.sources[0].spec.event_time.as_ref().map(|e| e.field.as_str()), Some("ts"));
    assert_eq!(spec.guarantee(), Guarantee::ExactlyOnce);
}

#[test]
fn the_topological_order_reads_inputs_first_and_breaks_ties_by_name() {
    let graph = parse(DESIGN_EXAMPLE).unwrap().graph();
    let order: Vec<&str> = graph.topological_order().iter().map(|n| n.name()).collect();
    assert_eq!(
        order,
        [
            "orders", "payments", "matched", "open_only", "open", "settled_only", "settled", "statuses", "by_customer",
            "hourly", "hourly_table", "status_topic"
        ]
    );
}

#[test]
fn the_readme_graph_example_parses_and_validates() {
    let readme = include_str!("../../../../README.md");
    let start = readme.find("name: evens-and-odds").expect("the README has a graph example");
    let block = &readme[start..start + readme[start..].find("```").expect("the example's block ends")];
    let text: String = block.lines().map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l))).collect();
    let graph = parse(&text).unwrap().graph();
    assert_eq!(graph.sinks[0].inputs, ["counts"]);
}

#[test]
fn a_graph_pipeline_round_trips_through_yaml() {
    let spec = parse(DESIGN_EXAMPLE).unwrap();
    let text = serde_yaml::to_string(&spec).unwrap();
    assert!(!text.contains("source:") && !text.contains("sink:"), "{text}");
    assert_eq!(parse(&text).unwrap(), spec);
}

#[test]
fn singleton_map_reads_and_writes_an_optional_source_and_sink() {
    let chain = "name: t\nsource:\n  generator: {events: 3}\nsink:\n  stdout: {}\n";
    let spec: PipelineSpec = serde_yaml::from_str(chain).unwrap();
    assert!(matches!(spec.source, Some(SourceSpec::Generator(_))) && matches!(spec.sink, Some(SinkSpec::Stdout(_))));
    let text = serde_yaml::to_string(&spec).unwrap();
    assert!(text.contains("source:\n  generator:") && text.contains("sink:\n  stdout: {}"), "{text}");
    assert_eq!(serde_yaml::from_str::<PipelineSpec>(&text).unwrap(), spec);
    // Absent is None, and None is not written at all.
    let spec: PipelineSpec = serde_yaml::from_str(DESIGN_EXAMPLE).unwrap();
    assert_eq!((spec.source, spec.sink), (None, None));
    let text = serde_yaml::to_string(&parse(DESIGN_EXAMPLE).unwrap()).unwrap();
    assert!(!text.contains("source: null"), "{text}");
}

/// Two sources, a filter and a union into one sink; the row tests change one line of it.
const BASE: &str = "name: g
sources:
  a:
    generator: {}
  b:
    generator: {}
steps:
  - name: evens
    input: a
    filter: \"value % 2 = 0\"
  - name: both
    input: [evens, b]
    union: {}
sinks:
  out:
    input: both
    blackhole: {}
";

fn base(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "{from}");
    BASE.replacen(from, to, 1)
}

fn row(text: &str, line: usize, field: &str, message: &str) {
    assert_eq!(refused(text), (Some(line), field.to_string(), message.to_string()), "{text}");
}

#[test]
fn the_base_graph_is_valid() {
    let spec = parse(BASE).unwrap();
    assert_eq!(spec.graph().steps[1].inputs, ["evens", "b"]);
}

#[test]
fn a_pipeline_written_in_both_forms_is_refused() {
    let text = format!("{BASE}sink:\n  blackhole: {{}}\n");
    row(&text, 2, "sources", "a pipeline has `source:` + `sink:` (a chain) or `sources:` + `sinks:` (a graph), not both");
}

#[test]
fn a_pipeline_missing_its_sources_or_sinks_is_refused_naming_what_is_missing() {
    let none = refused("name: g\nsteps: []\n");
    assert_eq!(none, (None, "source".into(), "missing: expected `source:` and `sink:` (a chain) or `sources:` and `sinks:` (a graph)".into()));
    let no_sink = refused("name: g\nsource:\n  generator: {}\n");
    assert_eq!(no_sink, (None, "sink".into(), "missing: a chain writes to one `sink:`".into()));
    let graph = BASE.split("sinks:").next().unwrap().replace("  - name: both\n    input: [evens, b]\n    union: {}\n", "");
    assert_eq!(refused(&graph), (None, "sinks".into(), "missing: a graph writes to at least one sink".into()));
}

#[test]
fn event_time_at_the_top_of_a_graph_is_refused_pointing_at_the_sources() {
    let text = format!("{BASE}event_time: {{field: value}}\n");
    row(&text, 18, "event_time", "a graph's sources each have their own; move it to sources.<name>.event_time");
}

#[test]
fn a_bad_node_name_is_refused_naming_the_rule() {
    let rule = "expected a letter, then letters, digits, - or _";
    row(&base("name: evens", "name: ev.ens").replace("[evens,", "[ev.ens,"), 8, "steps[0].name", &format!("`ev.ens` is not a node name: {rule}"));
    row(&base("name: evens", "name: 0dd"), 8, "steps[0].name", &format!("`0dd` is not a node name: {rule}"));
    let long = "x".repeat(64);
    row(&base("name: evens", &format!("name: {long}")), 8, "steps[0].name", &format!("`{long}` is not a node name: expected at most 63 characters"));
    row(
        &base("  b:\n", "  in-flight-1:\n").replace("[evens, b]", "[evens, in-flight-1]"),
        5,
        "sources.in-flight-1",
        "`in-flight-1` is not a node name: names starting with in-flight- or late-records- are the runtime's own state ids",
    );
    row(&base("    union: {}\n", "    union: {}\n    id: late-records-x\n"), 14, "steps[1].id", "`late-records-x` is not an id: names starting with in-flight- or late-records- are the runtime's own state ids");
}

#[test]
fn a_name_or_state_id_used_twice_is_refused() {
    row(&base("  out:\n", "  a:\n"), 15, "sinks.a", "`a` is also the name of sources.a: expected each name once");
    row(
        &base("    union: {}\n", "    union: {}\n    id: evens\n"),
        14,
        "steps[1].id",
        "`both`: id `evens` is also the state id of steps[0]: expected unique ids",
    );
}

#[test]
fn a_graph_step_without_input_and_a_chain_step_with_one_are_refused() {
    row(&base("    input: a\n", ""), 8, "steps[0].input", "missing: a step of a graph names its input(s)");
    let chain = "name: t\nsource:\n  generator: {}\nsteps:\n  - filter: value > 1\n    input: source\nsink:\n  blackhole: {}\n";
    row(chain, 6, "steps[0].input", "a chain's steps each read the step before them: `name` and `input` are for a graph (`sources:` and `sinks:` instead of `source:` and `sink:`)");
}

#[test]
fn an_unknown_input_is_refused_listing_the_sources_and_steps() {
    row(&base("[evens, b]", "[evens, bb]"), 12, "steps[1].input[1]", "`bb`: no such source or step: expected one of a, b, evens, both");
    row(&base("    input: both\n", "    input: evns\n"), 16, "sinks.out.input", "`evns`: no such source or step: expected one of a, b, evens, both");
}

#[test]
fn an_input_that_is_a_sink_is_refused() {
    row(&base("[evens, b]", "[evens, out]"), 12, "steps[1].input[1]", "`out` is a sink: nothing reads from a sink");
}

#[test]
fn a_step_with_the_wrong_number_of_inputs_is_refused_naming_its_arity() {
    row(&base("[evens, b]", "[evens]"), 12, "steps[1].input", "`both`: union takes at least two inputs, got 1");
    row(&base("    input: a\n", "    input: [a, b]\n"), 9, "steps[0].input", "`evens`: filter takes one input, got 2");
}

#[test]
fn a_cycle_is_refused_naming_its_nodes() {
    let text = base("[evens, b]", "[evens, loop]").replace("sinks:", "  - name: loop\n    input: both\n    filter: \"true\"\nsinks:");
    row(&text, 12, "steps[1].input[1]", "`both` → `loop` → `both` is a cycle: the steps of a pipeline form a DAG");
    // A step reading itself is the smallest cycle.
    row(&base("    input: a\n", "    input: evens\n"), 9, "steps[0].input", "`evens` → `evens` is a cycle: the steps of a pipeline form a DAG");
}

#[test]
fn a_node_nothing_reads_is_refused() {
    let text = base("sinks:", "  - name: debug\n    input: a\n    filter: \"true\"\nsinks:");
    row(&text, 14, "steps[2]", "`debug`: nothing reads its output: add a sink with `input: debug`, or remove it");
    row(&base("[evens, b]", "[evens, a]"), 5, "sources.b", "`b`: nothing reads its output: add a sink with `input: b`, or remove it");
}

/// Two sources with event time joined by an interval join.
const JOIN: &str = "name: g
sources:
  orders:
    generator: {}
    event_time: {field: value}
  payments:
    generator: {}
    event_time: {field: value}
steps:
  - name: matched
    input: [orders, payments]
    interval_join:
      on: [key]
      between: {lower: 0s, upper: 1h}
sinks:
  out:
    input: matched
    blackhole: {}
";

fn join(from: &str, to: &str) -> String {
    assert!(JOIN.contains(from), "{from}");
    JOIN.replacen(from, to, 1)
}

#[test]
fn a_join_without_keys_or_with_bounds_out_of_order_is_refused_naming_the_setting() {
    parse(&join("lower: 0s", "lower: -5s")).unwrap();
    row(&join("on: [key]", "on: []"), 13, "steps[0].interval_join.on", "`matched`: a join needs the fields it joins on");
    row(&join("on: [key]", "on: [key, seq]\n      right_on: [key]"), 14, "steps[0].interval_join.right_on", "`matched`: expected as many fields as `on` (2), got 1");
    row(&join("lower: 0s", "lower: 2h"), 14, "steps[0].interval_join.between", "`matched`: lower (2h) is above upper (1h): expected lower ≤ upper");
    let regular = "    join:\n      on: key\n      ttl: 0s\n";
    let text = JOIN.replace("    interval_join:\n      on: [key]\n      between: {lower: 0s, upper: 1h}\n", regular);
    row(&text, 14, "steps[0].join.ttl", "`matched`: expected a duration above 0: each record is kept this long after it arrived");
    let err = parse(&text.replace("      ttl: 0s\n", "")).unwrap_err().to_string();
    assert!(err.contains("missing field `ttl`"), "{err}");
    let windowed = "    window_join:\n      on: key\n      sliding: {size: 1s, slide: 2s}\n";
    let text = JOIN.replace("    interval_join:\n      on: [key]\n      between: {lower: 0s, upper: 1h}\n", windowed);
    row(&text, 14, "steps[0].window_join.sliding.slide", "`matched`: 2000ms is longer than the window (1000ms): records between windows would belong to none; expected at most the size");
    let err = parse(&join("    interval_join:\n", "    union: {all: true}\n    interval_join:\n")).unwrap_err().to_string();
    assert!(err.contains("unknown field `all`"), "{err}");
}

#[test]
fn a_lookup_join_refuses_an_empty_cache_and_a_password_naming_the_setting() {
    let lookup = |cache: &str, connection: &str| {
        format!(
            "name: g\nsources:\n  orders:\n    generator: {{}}\nsteps:\n  - name: named\n    input: orders\n    lookup_join:\n      on: key\n      postgres:\n        connection: \"{connection}\"\n        table: customers\n        key: [id]\n        columns: {{name: string}}\n      cache: {cache}\nsinks:\n  out:\n    input: named\n    blackhole: {{}}\n"
        )
    };
    let spec = parse(&lookup("{max_rows: 10, ttl: 1m}", "host=pg")).unwrap();
    let StepKind::LookupJoin(l) = &spec.graph().steps[0].spec else { panic!("not a lookup join") };
    assert_eq!((l.missing, l.postgres.columns.0.len()), (Missing::Drop, 1));
    row(&lookup("{max_rows: 0, ttl: 1m}", "host=pg"), 15, "steps[0].lookup_join.cache.max_rows", "`named`: expected at least 1");
    row(&lookup("{max_rows: 1, ttl: 0s}", "host=pg"), 15, "steps[0].lookup_join.cache.ttl", "`named`: expected a duration above 0: how long a cached row is used before it is read again");
    let (_, field, message) = refused(&lookup("{max_rows: 1, ttl: 1s}", "host=pg password=hunter2"));
    assert_eq!(field, "steps[0].lookup_join.postgres.connection");
    assert!(message.contains("PGPASSWORD") && !message.contains("hunter2"), "{message}");
}

#[test]
fn a_keyed_step_reading_records_that_are_not_keyed_is_refused() {
    let text = "name: g\nsources:\n  orders:\n    generator: {}\n    event_time: {field: value}\nsteps:\n  - name: hourly\n    input: orders\n    window: {tumbling: 1h, aggregates: [{count: n}]}\nsinks:\n  out:\n    input: hourly\n    blackhole: {}\n";
    row(text, 9, "steps[0].window", "`hourly` keeps state per key: expected its input to be a key_by (or keyed)");
    // A join's output is keyed by its left keys, so a window may read it.
    let window = "  - name: hourly\n    input: matched\n    window: {tumbling: 1h, aggregates: [{count: n}]}\nsinks:\n  out:\n    input: hourly\n";
    parse(&join("sinks:\n  out:\n    input: matched\n", window)).unwrap();
}

#[test]
fn a_union_is_keyed_only_when_its_inputs_are_keyed_by_the_same_fields() {
    let text = |second: &str| {
        format!("name: g\nsources:\n  a:\n    generator: {{}}\n  b:\n    generator: {{}}\nsteps:\n  - {{name: ka, input: a, key_by: key}}\n  - {{name: kb, input: b, key_by: {second}}}\n  - {{name: both, input: [ka, kb], union: {{}}}}\n  - {{name: counts, input: both, running_count: n}}\nsinks:\n  out:\n    input: counts\n    blackhole: {{}}\n")
    };
    parse(&text("key")).unwrap();
    row(&text("value"), 11, "steps[3].running_count", "`counts` keeps state per key: expected its input to be a key_by (or keyed)");
}

#[test]
fn a_join_reading_a_key_by_is_refused() {
    let text = join("    input: [orders, payments]\n", "    input: [by_key, payments]\n")
        .replace("steps:\n", "steps:\n  - {name: by_key, input: orders, key_by: key}\n");
    row(&text, 12, "steps[1].input[0]", "`by_key` is a key_by: a join partitions its inputs by `on` itself; name its input instead");
}

#[test]
fn a_step_by_event_time_reading_a_source_without_it_is_refused() {
    row(
        &join("    event_time: {field: value}\n  payments:", "  payments:"),
        11,
        "steps[0].interval_join",
        "`matched` works by event time, but it reads the source `orders`, which has none: expected `event_time: {field: <int64 field, epoch milliseconds>}` in sources.orders",
    );
}

#[test]
fn two_file_outputs_in_one_directory_are_refused() {
    let text = base("  out:\n    input: both\n    blackhole: {}\n", "  one:\n    input: both\n    file: {path: out}\n  two:\n    input: evens\n    file: {path: ./out/}\n");
    row(&text, 20, "sinks.two.file.path", "\"./out/\" is also `sinks.one.file.path`: expected a directory of its own for each file sink");
}

#[test]
fn a_connector_setting_is_checked_at_its_graph_path() {
    row(&base("    generator: {}\n  b:", "    generator: {keys: 0}\n  b:"), 4, "sources.a.generator.keys", "expected at least 1");
    let (line, field, message) = refused(&base("    blackhole: {}\n", "    postgres: {connection: \"host=h password=x\", table: t}\n"));
    assert_eq!((line, field.as_str()), (Some(17), "sinks.out.postgres.connection"));
    assert!(message.contains("PGPASSWORD"), "{message}");
}

#[test]
fn a_graph_guarantee_names_the_weakest_source_or_sink() {
    let (g, why) = parse(&base("    blackhole: {}\n", "    stdout: {}\n")).unwrap().guarantee_and_reason();
    assert_eq!((g, why.as_str()), (Guarantee::AtLeastOnce, "the stdout sink `out` is at-least-once: it writes as it goes, so a replay after a failure writes again"));
    let socket = "    socket: {address: \"h:1\", schema: {value: int64}}\n";
    let (g, why) = parse(&base("    generator: {}\n  b:", &format!("{socket}  b:"))).unwrap().guarantee_and_reason();
    assert_eq!((g, why.as_str()), (Guarantee::AtMostOnce, "the socket source `a` cannot replay what it read before a failure"));
}

#[test]
fn several_sinks_every_join_and_unaligned_checkpoints_of_any_graph_run() {
    let runnable = |text: &str| parse(text).unwrap().runnable_graph().map(|_| ()).map_err(|e| e.to_string());
    let several = runnable("name: p\nsources:\n  a: {generator: {}}\nsinks:\n  one: {input: a, blackhole: {}}\n  two: {input: a, blackhole: {}}\n");
    assert_eq!(several, Ok(()));
    let join = "name: p\nsources:\n  a: {generator: {}}\n  b: {generator: {}}\nsteps:\n  - {name: j, input: [a, b], join: {on: [key], ttl: 1m}}\nsinks:\n  out: {input: j, blackhole: {}}\n";
    assert_eq!(runnable(join), Ok(()));
    let lookup = "name: p\nsources:\n  a: {generator: {}}\nsteps:\n  - {name: j, input: a, lookup_join: {on: key, postgres: {connection: host=h, table: t, key: [id], columns: {n: string}}, cache: {max_rows: 10, ttl: 1m}}}\nsinks:\n  out: {input: j, blackhole: {}}\n";
    assert_eq!(runnable(lookup), Ok(()));
    let union = |checkpoint: &str| {
        format!("name: p\n{checkpoint}sources:\n  a: {{generator: {{}}}}\n  b: {{generator: {{}}}}\nsteps:\n  - {{name: both, input: [a, b], union: {{}}}}\nsinks:\n  out: {{input: both, blackhole: {{}}}}\n")
    };
    assert_eq!(runnable(&union("")), Ok(()));
    assert_eq!(runnable(&union("checkpoint: {mode: unaligned}\n")), Ok(()));
    assert_eq!(runnable(&union("checkpoint: {alignment_timeout: 1s}\n")), Ok(()));
    // A chain is one path, whatever its checkpoints.
    assert_eq!(runnable("name: c\ncheckpoint: {mode: unaligned}\nsource: {generator: {}}\nsteps: [{key_by: key}, {running_count: n}]\nsink: {blackhole: {}}\n"), Ok(()));
}

#[test]
fn each_sink_gets_the_guarantee_of_what_is_upstream_of_it_and_the_job_runs_at_the_strongest() {
    let text = "name: p\nsources:\n  a: {generator: {}}\n  s:\n    socket: {address: \"127.0.0.1:9\", schema: {seq: int64}}\nsinks:\n  files: {input: a, file: {path: out, guarantee: exactly-once}}\n  debug: {input: a, stdout: {}}\n  raw: {input: s, file: {path: raw, guarantee: exactly-once}}\n";
    let spec = parse(text).unwrap();
    assert_eq!(
        spec.sink_guarantees(),
        [
            ("files".to_string(), Guarantee::ExactlyOnce),
            ("debug".to_string(), Guarantee::AtLeastOnce),
            ("raw".to_string(), Guarantee::AtMostOnce),
        ],
        "the socket is upstream of `raw` only"
    );
    assert_eq!(spec.guarantee(), Guarantee::AtMostOnce, "the job promises the weakest");
    assert_eq!(spec.guarantee_decided_by().as_deref(), Some("raw"));
    assert_eq!(spec.runtime_guarantee(), Guarantee::ExactlyOnce, "and runs at the strongest: `files` stays exactly-once");
    let one = parse("name: c\nsource: {generator: {}}\nsink: {stdout: {}}\n").unwrap();
    assert_eq!((one.guarantee(), one.runtime_guarantee(), one.guarantee_decided_by()), (Guarantee::AtLeastOnce, Guarantee::AtLeastOnce, None));
}
