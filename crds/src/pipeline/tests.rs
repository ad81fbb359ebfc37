use super::*;

fn parse(text: &str) -> Result<PipelineSpec, PipelineError> {
    PipelineSpec::from_yaml("test.yaml", text)
}

const MINIMAL: &str = "name: t\nsource:\n  generator:\n    events: 10\nsink:\n  blackhole: {}\n";

#[test]
fn the_checked_in_example_parses_with_every_field_as_written() {
    let text = include_str!("../../../examples/exactly-once.yaml");
    let spec = parse(text).unwrap();
    assert_eq!(spec.name, "exactly-once");
    assert_eq!(spec.parallelism, 4);
    assert_eq!(spec.checkpoint.interval.get().as_millis(), 500);
    let SourceSpec::Generator(g) = spec.source.as_ref().unwrap() else { panic!("not a generator") };
    assert_eq!((g.events, g.keys, g.rate), (Some(1_000_000), 1000, 200_000));
    assert_eq!(spec.steps[0].kind, StepKind::KeyBy(vec!["key".into()]));
    assert_eq!(spec.steps[1].kind, StepKind::RunningCount("count".into()));
    assert_eq!(spec.guarantee(), Guarantee::ExactlyOnce);
}

#[test]
fn the_windows_example_parses_with_its_window_and_event_time() {
    let spec = parse(include_str!("../../../examples/windows.yaml")).unwrap();
    let et = spec.event_time.as_ref().unwrap();
    assert_eq!((et.field.as_str(), et.max_out_of_orderness.get().as_millis()), ("value", 200));
    let StepKind::Window(w) = &spec.steps[1].kind else { panic!("not a window") };
    assert_eq!(w.kind(), Some(WindowKind::Fixed { size: 1000, slide: 1000 }));
    assert_eq!(w.aggregates.len(), 3);
}

#[test]
fn a_window_needs_exactly_one_kind_and_sane_sizes_each_error_naming_the_field() {
    let window = |w: &str| parse(&format!("name: t\nevent_time: {{field: value}}\nsource:\n  generator: {{}}\nsteps:\n  - key_by: key\n  - window: {w}\nsink:\n  blackhole: {{}}\n"));
    for (w, expected) in [
        ("{aggregates: [{count: n}]}", "steps[1].window: expected one of `tumbling: SIZE`"),
        ("{tumbling: 1s, session: {gap: 1s}, aggregates: [{count: n}]}", "expected one of `tumbling: SIZE`"),
        ("{sliding: {size: 1s, slide: 2s}, aggregates: [{count: n}]}", "steps[1].window.sliding.slide"),
        ("{session: {gap: 0s}, aggregates: [{count: n}]}", "steps[1].window.session.gap"),
        ("{tumbling: 1s, aggregates: []}", "steps[1].window.aggregates: expected at least one"),
        ("{tumbling: 1s, aggregates: [{count: n, sum: {field: v}}]}", "steps[1].window.aggregates[0]: expected exactly one"),
    ] {
        let err = window(w).unwrap_err().to_string();
        assert!(err.contains(expected), "{w}: {err}");
    }
    let err = parse("name: t\nsource:\n  generator: {}\nsteps:\n  - window: {tumbling: 1s, aggregates: [{count: n}]}\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
    assert!(err.contains("expected a `key_by` step before it"), "{err}");
}

#[test]
fn late_records_need_a_directory_of_their_own_each_error_naming_the_field() {
    let job = |late: &str, sink: &str| {
        parse(&format!(
            "name: t\nevent_time: {{field: value}}\nsource:\n  generator: {{}}\nsteps:\n  - key_by: key\n  - window: {{tumbling: 1s, aggregates: [{{count: n}}], late_records: {late}}}\nsink:\n  {sink}\n"
        ))
    };
    let spec = job("{path: out/late, format: jsonl}", "file: {path: out/eo}").unwrap();
    let StepKind::Window(w) = &spec.steps[1].kind else { panic!("not a window") };
    assert_eq!(w.late_records.as_ref().map(|l| l.path.as_str()), Some("out/late"));
    for (late, sink, expected) in [
        ("{path: out/eo/}", "file: {path: ./out/eo}", "steps[1].window.late_records.path: \"out/eo/\" is also `sink.file.path`"),
        ("{path: \"\"}", "blackhole: {}", "steps[1].window.late_records.path: expected a directory path"),
        ("{path: \"hdfs://b/late\"}", "blackhole: {}", "steps[1].window.late_records.path: \"hdfs://b/late\": unsupported scheme"),
        ("{path: out/late, max_file_bytes: 0}", "blackhole: {}", "steps[1].window.late_records.max_file_bytes"),
        ("{path: out/late, colour: red}", "blackhole: {}", "colour"),
    ] {
        let err = job(late, sink).unwrap_err().to_string();
        assert!(err.contains(expected), "{late}: {err}");
    }
}

#[test]
fn defaults_fill_what_is_not_written() {
    let spec = parse(MINIMAL).unwrap();
    assert_eq!(spec.parallelism, 1);
    assert_eq!(spec.max_parallelism, DEFAULT_MAX_PARALLELISM);
    assert_eq!(spec.checkpoint.retain, 3);
}

#[test]
fn parallelism_zero_is_rejected_with_its_line() {
    let err = parse("name: t\nparallelism: 0\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("test.yaml:2: parallelism"), "{msg}");
    assert!(msg.contains("at least 1"), "{msg}");
}

#[test]
fn parallelism_above_max_parallelism_is_rejected() {
    let err = parse("name: t\nparallelism: 9\nmax_parallelism: 8\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap_err();
    assert!(err.to_string().contains("above max_parallelism 8"), "{err}");
}

#[test]
fn an_unknown_step_names_the_step_the_line_and_the_known_steps() {
    let err = parse("name: t\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - explode: x\nsink:\n  blackhole: {}\n").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("unknown step `explode`"), "{msg}");
    assert!(msg.contains("line 6"), "{msg}");
    assert!(msg.contains("running_count"), "{msg}");
}

#[test]
fn unknown_fields_are_rejected_not_ignored() {
    let err = parse("name: t\nparalelism: 2\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("unknown field `paralelism`"), "{msg}");
    let err = parse("name: t\nsource:\n  generator: {evnts: 3}\nsink:\n  blackhole: {}\n").unwrap_err();
    assert!(err.to_string().contains("unknown field `evnts`"), "{err}");
}

#[test]
fn malformed_yaml_is_a_syntax_error_with_a_line() {
    let err = parse("name: t\nsource: [\n").unwrap_err();
    assert!(matches!(err, PipelineError::Syntax { .. }), "{err}");
    assert!(err.to_string().contains("line"), "{err}");
}

#[test]
fn a_running_aggregate_without_key_by_is_rejected() {
    let err = parse("name: t\nsource:\n  generator: {}\nsteps:\n  - running_count: n\nsink:\n  blackhole: {}\n").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("steps[0].running_count"), "{msg}");
    assert!(msg.contains("key_by"), "{msg}");
    assert!(msg.contains(":5:"), "{msg}");
}

#[test]
fn a_bad_duration_names_the_field() {
    let err = parse("name: t\ncheckpoint:\n  interval: 5 parsecs\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("checkpoint") && msg.contains("line 3") && msg.contains("unknown unit"), "{msg}");
}

#[test]
fn unaligned_mode_and_the_alignment_timeout_parse_and_an_unknown_mode_names_the_known_ones() {
    let spec = parse("name: t\ncheckpoint:\n  mode: unaligned\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap();
    assert_eq!(
        spec.checkpoint.unaligned_after(),
        Some(std::time::Duration::ZERO)
    );
    let spec = parse("name: t\ncheckpoint:\n  alignment_timeout: 300ms\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap();
    assert_eq!(
        spec.checkpoint.unaligned_after(),
        Some(std::time::Duration::from_millis(300))
    );
    let err = parse("name: t\ncheckpoint:\n  mode: sideways\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap_err();
    assert!(
        err.to_string().contains("aligned") && err.to_string().contains("unaligned"),
        "{err}"
    );
}

#[test]
fn unaligned_checkpoints_of_a_job_that_is_not_exactly_once_are_refused_naming_the_setting() {
    let err = parse(
        "name: t\ncheckpoint:\n  mode: unaligned\nsource:\n  generator: {}\nsink:\n  stdout: {}\n",
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("checkpoint.mode") && err.to_string().contains("at-least-once"),
        "{err}"
    );
    let err = parse("name: t\ncheckpoint:\n  mode: unaligned\n  alignment_timeout: 1s\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n").unwrap_err();
    assert!(
        err.to_string().contains("checkpoint.alignment_timeout"),
        "{err}"
    );
}

#[test]
fn stdout_sink_lowers_the_job_guarantee_to_at_least_once() {
    let spec = parse("name: t\nsource:\n  generator: {}\nsink:\n  stdout: {}\n").unwrap();
    assert_eq!(spec.guarantee(), Guarantee::AtLeastOnce);
}

#[test]
fn the_effective_guarantee_is_the_weakest_part_and_says_which() {
    let spec = |head: &str, sink: &str| parse(&format!("name: t\n{head}source:\n  generator: {{}}\nsink:\n  {sink}\n"));
    let (g, why) = spec("", "file: {path: out}").unwrap().guarantee_and_reason();
    assert_eq!((g, why.contains("exactly-once")), (Guarantee::ExactlyOnce, true), "{why}");
    let (g, why) = spec("guarantee: at-least-once\n", "file: {path: out}").unwrap().guarantee_and_reason();
    assert_eq!(g, Guarantee::AtLeastOnce);
    assert!(why.contains("`guarantee` setting"), "{why}");
    let (g, why) = spec("", "stdout: {}").unwrap().guarantee_and_reason();
    assert_eq!(g, Guarantee::AtLeastOnce);
    assert!(why.contains("stdout sink"), "{why}");
    let (g, why) = spec("guarantee: at-most-once\n", "file: {path: out}").unwrap().guarantee_and_reason();
    assert_eq!(g, Guarantee::AtMostOnce);
    assert!(why.contains("`guarantee` setting asks for at-most-once"), "{why}");
}

#[test]
fn every_sink_states_its_contract_and_the_reason_names_it() {
    let spec = |sink: &str| parse(&format!("name: t\nsource:\n  generator: {{}}\nsink:\n  {sink}\n")).unwrap();
    let pg = |mode: &str| format!("postgres: {{connection: host=db, table: t, mode: {mode}{}}}", if mode == "upsert" { ", key: [k]" } else { "" });
    let cases = [
        ("file: {path: out}".to_string(), SinkContract::TwoPhaseCommit, Guarantee::ExactlyOnce, "two-phase commit"),
        ("file: {path: out, guarantee: at-least-once}".to_string(), SinkContract::FlushAtBarrier, Guarantee::AtLeastOnce, "publishes at each barrier"),
        (pg("two-phase-commit"), SinkContract::TwoPhaseCommit, Guarantee::ExactlyOnce, "two-phase commit"),
        (pg("write-ahead-log"), SinkContract::WriteAheadLog, Guarantee::ExactlyOnce, "write-ahead log"),
        (pg("upsert"), SinkContract::Idempotent, Guarantee::ExactlyOnce, "each key's final row is exactly-once"),
        ("kafka: {bootstrap_servers: b:9092, topic: t}".to_string(), SinkContract::TwoPhaseCommit, Guarantee::ExactlyOnce, "two-phase commit"),
        ("kafka: {bootstrap_servers: b:9092, topic: t, guarantee: at-least-once}".to_string(), SinkContract::FlushAtBarrier, Guarantee::AtLeastOnce, "a replay after a failure publishes again"),
        ("stdout: {}".to_string(), SinkContract::WriteThrough, Guarantee::AtLeastOnce, "writes as it goes"),
        ("blackhole: {}".to_string(), SinkContract::Discard, Guarantee::ExactlyOnce, "discards"),
    ];
    for (sink, contract, guarantee, said) in cases {
        let spec = spec(&sink);
        assert_eq!(spec.sink.as_ref().unwrap().contract(), contract, "{sink}");
        let (g, why) = spec.guarantee_and_reason();
        assert_eq!(g, guarantee, "{sink}");
        assert!(why.contains(said), "{sink}: {why}");
    }
}

#[test]
fn a_socket_source_makes_the_job_at_most_once_and_says_why() {
    let text = "name: t\nsource:\n  socket:\n    address: localhost:9000\n    schema: {id: int64}\nsink:\n  file: {path: out}\n";
    let spec = parse(text).unwrap();
    let SourceSpec::Socket(s) = spec.source.as_ref().unwrap() else { panic!("not a socket source") };
    assert_eq!((s.address.as_str(), s.batch_size), ("localhost:9000", 1024));
    let (g, why) = spec.guarantee_and_reason();
    assert_eq!(g, Guarantee::AtMostOnce);
    assert!(why.contains("socket source cannot replay"), "{why}");
    // Asking for more does not make it so.
    let (g, _) = parse(&text.replace("name: t\n", "name: t\nguarantee: exactly-once\n")).unwrap().guarantee_and_reason();
    assert_eq!(g, Guarantee::AtMostOnce);
}

#[test]
fn a_socket_address_without_a_port_is_refused_naming_the_field() {
    for bad in ["localhost", "localhost:", ":9000", "localhost:0", "localhost:99999", "[::1]"] {
        let text = format!("name: t\nsource:\n  socket:\n    address: \"{bad}\"\n    schema: {{id: int64}}\nsink:\n  blackhole: {{}}\n");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("source.socket.address") && err.contains("HOST:PORT"), "{bad}: {err}");
    }
    let ok = "name: t\nsource:\n  socket:\n    address: \"[::1]:9000\"\n    schema: {id: int64}\nsink:\n  blackhole: {}\n";
    parse(ok).unwrap();
}

#[test]
fn steps_round_trip_through_yaml_with_their_ids() {
    let text = "name: t\nsource:\n  file:\n    path: in.jsonl\n    schema: {a: int64, b: string}\nsteps:\n  - filter: a > 1\n  - key_by: [a, b]\n  - running_sum: {field: a, as: total}\n    id: sums\nsink:\n  blackhole: {}\n";
    let spec = parse(text).unwrap();
    assert_eq!(spec.steps[2].id.as_deref(), Some("sums"));
    let again = parse(&serde_yaml::to_string(&spec).unwrap()).unwrap();
    assert_eq!(spec, again);
}

#[test]
fn a_derived_step_id_survives_added_stateless_steps_and_steps_of_other_kinds() {
    let steps = |body: &str| parse(&format!("name: t\nsource:\n  generator: {{}}\nsteps:\n{body}sink:\n  blackhole: {{}}\n")).unwrap().steps;
    let before = step_ids(&steps("  - key_by: key\n  - running_count: n\n  - running_sum: {field: value}\n"));
    assert_eq!(before, ["key_by-0", "running_count-0", "running_sum-0"]);
    // A filter in front and a running_max before the sum rename nothing
    // that keeps state of the same kind.
    let after = step_ids(&steps("  - filter: value > 0\n  - key_by: key\n  - running_count: n\n  - running_max: {field: value}\n  - running_sum: {field: value}\n"));
    assert_eq!(after, ["filter-0", "key_by-0", "running_count-0", "running_max-0", "running_sum-0"]);
    // A second step of a kind is numbered after the first; a written id wins.
    let ids = step_ids(&steps("  - key_by: key\n  - running_count: a\n  - running_count: b\n    id: second\n  - running_count: c\n"));
    assert_eq!(ids, ["key_by-0", "running_count-0", "second", "running_count-2"]);
}

#[test]
fn the_file_source_fails_on_bad_lines_unless_told_to_skip_them() {
    let file = |extra: &str| format!("name: t\nsource:\n  file:\n    path: in.jsonl\n    schema: {{a: int64}}\n{extra}sink:\n  blackhole: {{}}\n");
    let SourceSpec::File(f) = parse(&file("")).unwrap().source.unwrap() else { panic!("not a file source") };
    assert_eq!(f.bad_lines, BadLines::Fail);
    let SourceSpec::File(f) = parse(&file("    bad_lines: skip\n")).unwrap().source.unwrap() else { panic!("not a file source") };
    assert_eq!(f.bad_lines, BadLines::Skip);
    let err = parse(&file("    bad_lines: ignore\n")).unwrap_err().to_string();
    assert!(err.contains("source.file.bad_lines") && err.contains("line 6") && err.contains("`ignore`") && err.contains("`skip`"), "{err}");
}

#[test]
fn s3_output_files_bigger_than_one_server_side_copy_are_rejected_naming_the_field() {
    let sink = |size: u64| format!("name: t\nsource:\n  generator: {{}}\nsink:\n  file:\n    path: s3://bucket/out\n    max_file_bytes: {size}\n");
    let err = parse(&sink(5 << 30)).unwrap_err().to_string();
    assert!(err.contains("sink.file.max_file_bytes") && err.contains("at most 4294967296"), "{err}");
    parse(&sink(4 << 30)).unwrap();
    // A directory has no such limit.
    parse(&sink(5 << 30).replace("s3://bucket/out", "out")).unwrap();
}

#[test]
fn a_postgres_sink_defaults_to_two_phase_commit_and_promises_exactly_once() {
    let spec = parse("name: t\nsource:\n  generator: {}\nsink:\n  postgres:\n    connection: host=127.0.0.1 dbname=d user=u\n    table: public.counts\n").unwrap();
    let SinkSpec::Postgres(p) = spec.sink.as_ref().unwrap() else { panic!("not a postgres sink") };
    assert_eq!(p.mode, PostgresMode::TwoPhaseCommit);
    assert_eq!(spec.guarantee(), Guarantee::ExactlyOnce);
}

#[test]
fn a_postgres_sink_refuses_a_password_an_upsert_without_key_and_a_bad_table_naming_the_field() {
    for (sink, field, says) in [
        ("connection: host=h user=u password=hunter2\n    table: t", "sink.postgres.connection", "PGPASSWORD"),
        ("connection: postgresql://u:hunter2@h/d\n    table: t", "sink.postgres.connection", "PGPASSWORD"),
        ("connection: host=h\n    table: t\n    mode: upsert", "sink.postgres.key", "primary key"),
        ("connection: host=h\n    table: t\n    key: [id]", "sink.postgres.key", "mode: upsert"),
        ("connection: host=h\n    table: a.b.c", "sink.postgres.table", "SCHEMA.NAME"),
    ] {
        let err = parse(&format!("name: t\nsource:\n  generator: {{}}\nsink:\n  postgres:\n    {sink}\n")).unwrap_err().to_string();
        assert!(err.contains(field) && err.contains(says), "{sink}: {err}");
        assert!(!err.contains("hunter2"), "the password is in the message: {err}");
    }
}

#[test]
fn an_unknown_postgres_mode_names_the_known_ones() {
    let err = parse("name: t\nsource:\n  generator: {}\nsink:\n  postgres:\n    connection: host=h\n    table: t\n    mode: eventually\n").unwrap_err().to_string();
    assert!(err.contains("two-phase-commit") && err.contains("upsert"), "{err}");
}

#[test]
fn a_chain_refuses_the_steps_that_read_two_inputs_and_checks_the_settings_of_the_others() {
    let err = parse("name: t\nsource:\n  generator: {}\nsteps:\n  - union: {}\nsink:\n  blackhole: {}\n").unwrap_err().to_string();
    assert_eq!(err, "test.yaml:5: steps[0].union: union takes at least two inputs, but a chain's steps each read one, the step before them: write the pipeline as a graph (`sources:`, `steps:` with `name` and `input`, `sinks:`)");
    let lookup = |cache: &str| parse(&format!("name: t\nsource:\n  generator: {{}}\nsteps:\n  - lookup_join:\n      on: key\n      postgres: {{connection: host=h, table: t, key: [id], columns: {{n: string}}}}\n      cache: {cache}\nsink:\n  blackhole: {{}}\n"));
    let spec = lookup("{max_rows: 9, ttl: 1s}").unwrap();
    assert_eq!(step_ids(&spec.steps), ["lookup_join-0"]);
    assert_eq!(parse(&serde_yaml::to_string(&spec).unwrap()).unwrap(), spec);
    let err = lookup("{max_rows: 0, ttl: 1s}").unwrap_err().to_string();
    assert_eq!(err, "test.yaml:8: steps[0].lookup_join.cache.max_rows: expected at least 1");
}
