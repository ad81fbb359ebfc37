//! Golden plans: the planner's output for the examples and for pipelines of
//! every step kind, as `JobPlan::describe` prints it, compared with the text
//! kept in `golden/`. Stages, schemas and state ids decide whether a
//! savepoint restores, so a change to any of them must be a reviewed diff.
//!
//! `WEIR_BLESS=1 cargo test -p weir-runtime --lib plan::golden` rewrites the
//! files; review the diff before committing it.

use std::path::PathBuf;

use weir_api::pipeline::PipelineSource;
use weir_api::PipelineSpec;

fn golden(name: &str, file: &str, text: &str) {
    let src = PipelineSource { file: file.into(), text: text.into() };
    let spec = PipelineSpec::from_source(&src).unwrap_or_else(|e| panic!("{name}: {e}"));
    let described = super::plan(&spec, &src).unwrap_or_else(|e| panic!("{name}: {e}")).describe();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/plan/golden").join(format!("{name}.txt"));
    if std::env::var_os("WEIR_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &described).unwrap();
        return;
    }
    let kept = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (WEIR_BLESS=1 writes it)", path.display()));
    assert_eq!(described, kept, "the plan of {name} changed (golden file {})", path.display());
}

fn example(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_exactly_once_example_plans_as_kept() {
    golden("exactly-once", "examples/exactly-once.yaml", &example("exactly-once.yaml"));
}

#[test]
fn the_windows_example_plans_as_kept() {
    golden("windows", "examples/windows.yaml", &example("windows.yaml"));
}

#[test]
fn the_streamjob_examples_pipeline_plans_as_kept() {
    let job: serde_yaml::Value = serde_yaml::from_str(&example("streamjob.yaml")).unwrap();
    let pipeline = serde_yaml::to_string(&job["spec"]["pipeline"]).unwrap();
    golden("streamjob", "examples/streamjob.yaml", &pipeline);
}

#[test]
fn the_graph_example_plans_as_kept() {
    golden("graph", "examples/graph.yaml", &example("graph.yaml"));
}

#[test]
fn the_join_example_plans_as_kept() {
    golden("join", "examples/join.yaml", &example("join.yaml"));
}

#[test]
fn a_graph_of_fan_out_union_and_broadcast_plans_as_kept() {
    golden(
        "fan-out-union-broadcast",
        "graph.yaml",
        "name: shapes\nparallelism: 3\n\
         sources:\n  a: {generator: {}, event_time: {field: value, idle_timeout: 5s}}\n  b: {file: {path: in, schema: {seq: int64, key: int64, value: int64}}, event_time: {field: value}}\n\
         steps:\n  - {name: big, input: a, filter: value > 10}\n  - {name: small, input: a, filter: value <= 10}\n\
         \x20 - {name: kb, input: b, key_by: key}\n  - {name: all, input: [big, small, kb], union: {}}\n\
         \x20 - {name: everywhere, input: all, broadcast: {}}\n  - {name: renamed, input: everywhere, select: [seq, key, value, \"value * 2 AS twice\"]}\n\
         sinks:\n  out: {input: renamed, blackhole: {}}\n",
    );
}

#[test]
fn the_lifecycle_tests_pipeline_plans_as_kept() {
    // runtime/tests/runtime/lifecycle's pipeline_yaml, with its filter.
    golden(
        "lifecycle",
        "lifecycle.yaml",
        "name: eo-test\nparallelism: 2\nmax_parallelism: 128\ncheckpoint:\n  interval: 100ms\n  incremental: true\n  mode: unaligned\n\
         source:\n  generator:\n    events: 1000\n    keys: 10\n    rate: 0\n    batch_size: 100\n\
         steps:\n  - filter: \"seq >= 0\"\n  - key_by: key\n  - running_count: count\n    id: counts\n\
         sink:\n  file:\n    path: out/eo\n",
    );
}

#[test]
fn a_pipeline_of_every_step_kind_plans_as_kept() {
    golden(
        "every-step",
        "every-step.yaml",
        "name: every-step\nevent_time: {field: ts, max_out_of_orderness: 2s, idle_timeout: 10s}\n\
         source:\n  file:\n    path: in\n    schema: {ts: int64, user: string, amount: float64, ok: boolean}\n\
         steps:\n  - filter: ok\n  - select: [ts, user, amount, \"amount * 2 AS double\"]\n\
         \x20 - key_by: user\n  - running_sum: {field: amount}\n  - running_min: {field: double, as: least}\n\
         \x20 - running_max: {field: amount}\n  - running_count: n\n\
         \x20 - key_by: [user, n]\n  - window: {session: {gap: 30s}, allowed_lateness: 1s, late_records: {path: late}, aggregates: [{min: {field: n, as: least_n}}, {max: {field: amount, as: most}}, {sum: {field: least, as: all}}]}\n\
         sink:\n  blackhole: {}\n",
    );
}

#[test]
fn a_sliding_window_pipeline_plans_as_kept() {
    golden(
        "sliding",
        "sliding.yaml",
        "name: sliding\nevent_time: {field: value}\nsource:\n  generator: {}\n\
         steps:\n  - key_by: [key]\n  - window: {sliding: {size: 10s, slide: 5s}, aggregates: [{count: c}, {avg: {field: seq, as: mean}}]}\n\
         sink:\n  stdout: {}\n",
    );
}
