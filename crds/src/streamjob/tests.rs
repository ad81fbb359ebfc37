//! Behaviour of the StreamJob API: parsing, defaults, the pipeline check, the
//! generated CRD, and its rules evaluated locally (CEL with kube's `cel`
//! feature; the OpenAPI keywords CEL does not cover with a small checker below).

use serde_json::{json, Value};

use super::*;
use crate::pipeline::{CheckpointMode, Guarantee, PipelineError, PipelineSpec, StepKind};

const EXAMPLE: &str = include_str!("../../../examples/streamjob.yaml");

fn example_json() -> Value {
    serde_yaml::from_str(EXAMPLE).expect("the example is YAML")
}

fn parse(value: &Value) -> StreamJob {
    serde_json::from_value(value.clone()).expect("a StreamJob")
}

/// A manifest with only the required fields.
fn minimal() -> Value {
    json!({
        "apiVersion": "weir.dev/v1alpha1",
        "kind": "StreamJob",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {
            "image": "weir",
            "checkpoint": {"storage": "/data/checkpoints"},
            "pipeline": {
                "name": "m",
                "source": {"generator": {"events": 10}},
                "sink": {"blackhole": {}}
            }
        }
    })
}

fn with(mut value: Value, pointer: &str, v: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').expect("a pointer with a parent");
    value
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .expect("the parent exists")
        .insert(key.to_string(), v);
    value
}

// ---------------------------------------------------------------- parsing

#[test]
fn the_example_manifest_parses_with_the_fields_as_written() {
    let job = parse(&example_json());
    assert_eq!(job.metadata.name.as_deref(), Some("exactly-once"));
    assert_eq!(job.spec.image, "weir");
    assert_eq!(job.spec.parallelism, 2);
    assert_eq!(job.spec.checkpoint.interval.get().as_millis(), 500);
    assert_eq!(
        job.spec.checkpoint.storage,
        "file:///var/lib/weir/checkpoints"
    );
    assert_eq!(job.spec.guarantee, Some(Guarantee::ExactlyOnce));
}

#[test]
fn the_example_embeds_the_same_pipeline_as_the_weir_run_example() {
    let job = parse(&example_json());
    let embedded = job.spec.validate_pipeline().expect("a valid pipeline");
    let file = PipelineSpec::from_yaml(
        "exactly-once.yaml",
        include_str!("../../../examples/exactly-once.yaml"),
    )
    .expect("the weir run example is valid");
    assert_eq!(
        (
            &embedded.name,
            &embedded.source,
            &embedded.steps,
            &embedded.sink
        ),
        (&file.name, &file.source, &file.steps, &file.sink)
    );
    // The deployment settings come from the StreamJob's spec.
    assert_eq!(embedded.parallelism, 2);
    assert_eq!(embedded.checkpoint, file.checkpoint);
}

#[test]
fn defaults_apply_to_what_the_manifest_does_not_write() {
    let spec = parse(&minimal()).spec;
    assert_eq!(spec.parallelism, 1);
    assert_eq!(spec.max_parallelism, 128);
    assert_eq!(spec.upgrade_mode, UpgradeMode::Savepoint);
    assert_eq!(spec.state, JobState::Running);
    assert_eq!(spec.checkpoint.interval.to_string(), "1s");
    assert_eq!(spec.checkpoint.timeout.to_string(), "1m");
    assert_eq!(spec.checkpoint.mode, CheckpointMode::Aligned);
    assert_eq!(spec.checkpoint.retain, 3);
    assert_eq!(spec.restart_backoff, RestartBackoff::default());
    assert_eq!(spec.restart_backoff.limit, 10);
    assert!(spec.savepoint_on_delete);
    assert!(!spec.allow_non_restored_state);
    assert_eq!(spec.savepoint_timeout.to_string(), "5m");
    assert_eq!(
        (
            spec.guarantee,
            &spec.savepoint_trigger,
            &spec.initial_savepoint
        ),
        (None, &None, &None)
    );
}

#[test]
fn the_crd_schema_carries_the_same_defaults_as_the_types() {
    // The API server fills defaults from the schema, the controller from serde:
    // they must agree, or the same manifest means two things.
    let schema = openapi_schema();
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(spec["parallelism"]["default"], json!(1));
    assert_eq!(spec["maxParallelism"]["default"], json!(128));
    assert_eq!(spec["upgradeMode"]["default"], json!("savepoint"));
    assert_eq!(spec["savepointTimeout"]["default"], json!("5m"));
    assert_eq!(
        spec["checkpoint"]["properties"]["retain"]["default"],
        json!(3)
    );
    let defaulted = parse(&minimal()).spec;
    assert_eq!(
        spec["restartBackoff"]["default"],
        serde_json::to_value(&defaulted.restart_backoff).unwrap()
    );
}

#[test]
fn an_unknown_upgrade_mode_is_refused_when_parsing() {
    let bad = with(minimal(), "/spec/upgradeMode", json!("blue-green"));
    let err = serde_json::from_value::<StreamJob>(bad)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown variant `blue-green`") && err.contains("last-state"),
        "{err}"
    );
}

#[test]
fn a_malformed_duration_is_refused_when_parsing() {
    let bad = with(minimal(), "/spec/savepointTimeout", json!("5 parsecs"));
    let err = serde_json::from_value::<StreamJob>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown unit"), "{err}");
}

// ---------------------------------------------------------- the pipeline

#[test]
fn a_manifest_with_an_invalid_pipeline_still_deserializes_so_the_controller_can_report_it() {
    let bad = with(minimal(), "/spec/pipeline/steps", json!([{"explode": "x"}]));
    let job = parse(&bad);
    let err = job.spec.validate_pipeline().unwrap_err();
    assert!(err.to_string().contains("unknown step `explode`"), "{err}");
}

#[test]
fn pipeline_errors_carry_the_same_messages_as_weir_run() {
    // The same pipeline as a `weir run` file and embedded in a StreamJob.
    let cases = [
        "name: t\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - explode: x\nsink:\n  blackhole: {}\n",
        "name: t\nsource:\n  generator: {}\nsteps:\n  - running_count: n\nsink:\n  blackhole: {}\n",
        "name: t\nsource:\n  generator: {keys: 0}\nsink:\n  blackhole: {}\n",
        "name: 'no spaces'\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n",
    ];
    for text in cases {
        let file_err = PipelineSpec::from_yaml("p.yaml", text).unwrap_err();
        let pipeline: Value = serde_yaml::from_str(text).unwrap();
        let job = parse(&with(minimal(), "/spec/pipeline", pipeline));
        let job_err = job.spec.validate_pipeline().unwrap_err();
        assert_eq!(
            what_is_wrong(&job_err),
            what_is_wrong(&file_err),
            "\nfile: {file_err}\njob:  {job_err}"
        );
        assert!(
            job_err.to_string().starts_with(PIPELINE_ERROR_NAME),
            "{job_err}"
        );
    }
}

/// The part of a pipeline error that does not depend on where the text came from.
fn what_is_wrong(err: &PipelineError) -> String {
    match err {
        PipelineError::Invalid { field, message, .. } => format!("{field}: {message}"),
        // serde_yaml's message ends with the position in the text: drop it.
        PipelineError::Syntax { message, .. } => message
            .split(" at line")
            .next()
            .unwrap_or(message)
            .to_string(),
        other => other.to_string(),
    }
}

#[test]
fn spec_parallelism_and_checkpoint_settings_reach_the_pipeline() {
    let job = parse(&with(
        with(minimal(), "/spec/parallelism", json!(3)),
        "/spec/checkpoint",
        json!({"storage": "s3://bucket/jobs", "interval": "250ms", "retain": 5}),
    ));
    let p = job.spec.validate_pipeline().unwrap();
    assert_eq!((p.parallelism, p.max_parallelism), (3, 128));
    assert_eq!(p.checkpoint.interval.get().as_millis(), 250);
    assert_eq!(p.checkpoint.retain, 5);
}

#[test]
fn a_pipeline_parallelism_that_disagrees_with_the_spec_is_refused_and_one_that_agrees_is_kept() {
    let disagree = parse(&with(minimal(), "/spec/pipeline/parallelism", json!(4)));
    let err = disagree.spec.validate_pipeline().unwrap_err().to_string();
    assert!(
        err.contains("parallelism") && err.contains("spec.parallelism 1"),
        "{err}"
    );
    let agree = parse(&with(minimal(), "/spec/pipeline/parallelism", json!(1)));
    assert_eq!(agree.spec.validate_pipeline().unwrap().parallelism, 1);
    let checkpoint = parse(&with(
        minimal(),
        "/spec/pipeline/checkpoint",
        json!({"interval": "1s"}),
    ));
    let err = checkpoint.spec.validate_pipeline().unwrap_err().to_string();
    assert!(err.contains("spec.checkpoint"), "{err}");
}

#[test]
fn parallelism_above_max_parallelism_is_refused_by_the_pipeline_check_too() {
    // For specs that did not come through the API server (files, tests).
    let job = parse(&with(
        with(minimal(), "/spec/parallelism", json!(9)),
        "/spec/maxParallelism",
        json!(8),
    ));
    let err = job.spec.validate_pipeline().unwrap_err().to_string();
    assert!(err.contains("above max_parallelism 8"), "{err}");
}

#[test]
fn the_embedded_pipeline_round_trips_unchanged() {
    let job = parse(&example_json());
    let again: StreamJob = serde_json::from_value(serde_json::to_value(&job).unwrap()).unwrap();
    assert_eq!(job, again);
    assert_eq!(job.spec.pipeline.0, example_json()["spec"]["pipeline"]);
    let p = job.spec.validate_pipeline().unwrap();
    assert_eq!(p.steps[1].kind, StepKind::RunningCount("count".into()));
}

#[test]
fn a_requested_guarantee_the_pipeline_cannot_give_is_refused_not_claimed() {
    let stdout = with(minimal(), "/spec/pipeline/sink", json!({"stdout": {}}));
    let job = parse(&with(
        stdout.clone(),
        "/spec/guarantee",
        json!("exactly-once"),
    ));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(
        err.contains("spec: guarantee: the pipeline gives at-least-once"),
        "{err}"
    );
    let job = parse(&with(
        stdout.clone(),
        "/spec/guarantee",
        json!("at-least-once"),
    ));
    assert!(job.spec.validate().is_ok());
    // Unset: the job gives what the pipeline gives.
    assert!(parse(&stdout).spec.validate().is_ok());
}

#[test]
fn restart_backoff_initial_above_max_is_refused() {
    let job = parse(&with(
        minimal(),
        "/spec/restartBackoff",
        json!({"initial": "2m", "max": "1m"}),
    ));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(
        err.contains("restartBackoff.initial: 2m is above restartBackoff.max 1m"),
        "{err}"
    );
}

#[test]
fn the_example_passes_every_controller_check() {
    assert_eq!(
        parse(&example_json()).spec.validate().unwrap().parallelism,
        2
    );
}

// ------------------------------------------------------------ the status

#[test]
fn savepoint_history_keeps_only_the_newest_entries() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut status = StreamJobStatus::default();
    for id in 0..(SAVEPOINT_HISTORY_LIMIT as i64 + 5) {
        status.record_savepoint(SavepointRef {
            id,
            path: format!("/sp/{id}"),
            time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
            reason: SavepointReason::Trigger,
        });
    }
    assert_eq!(status.savepoint_history.len(), SAVEPOINT_HISTORY_LIMIT);
    assert_eq!(status.savepoint_history[0].id, 5);
    assert_eq!(
        status.last_savepoint.as_ref().map(|s| s.id),
        Some(SAVEPOINT_HISTORY_LIMIT as i64 + 4)
    );
}

// --------------------------------------------------------------- the CRD

fn crd_value() -> Value {
    serde_json::to_value(<StreamJob as kube::CustomResourceExt>::crd()).expect("the CRD serializes")
}

fn openapi_schema() -> Value {
    crd_value()["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

#[test]
fn the_checked_in_crd_manifest_matches_the_types() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("streamjob.yaml");
    let generated = crd_yaml().expect("the CRD renders");
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is out of date with crds/src/streamjob: regenerate it with `{REGENERATE}` (from the workspace root) and commit it",
        path.display()
    );
}

#[test]
fn the_crd_has_the_names_columns_and_status_subresource_kubectl_uses() {
    let crd = crd_value();
    let spec = &crd["spec"];
    assert_eq!(crd["metadata"]["name"], json!("streamjobs.weir.dev"));
    assert_eq!(spec["group"], json!("weir.dev"));
    assert_eq!(spec["scope"], json!("Namespaced"));
    assert_eq!(spec["names"]["shortNames"], json!(["sj"]));
    assert_eq!(spec["names"]["categories"], json!(["all"]));
    let version = &spec["versions"][0];
    assert_eq!(version["name"], json!("v1alpha1"));
    assert_eq!(version["subresources"]["status"], json!({}));
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .expect("printer columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        columns,
        [
            "Phase",
            "Parallelism",
            "Checkpoint",
            "Checkpoint-Age",
            "Restarts",
            "Age"
        ]
    );
}

#[test]
fn the_crd_schema_has_no_keyword_kubernetes_refuses_or_warns_about() {
    fn walk(v: &Value, path: &str, problems: &mut Vec<String>) {
        match v {
            Value::Object(obj) => {
                if obj.get("additionalProperties") == Some(&Value::Bool(false)) {
                    problems.push(format!("{path}: additionalProperties: false"));
                }
                if let Some(f) = obj.get("format").and_then(Value::as_str) {
                    if f.starts_with("uint") {
                        problems.push(format!("{path}: format {f}"));
                    }
                }
                for k in ["$ref", "allOf", "not", "uniqueItems"] {
                    if obj.contains_key(k) {
                        problems.push(format!("{path}: {k}"));
                    }
                }
                if obj.get("type") == Some(&json!("object"))
                    && !obj.contains_key("properties")
                    && !obj.contains_key("additionalProperties")
                    && obj.get("x-kubernetes-preserve-unknown-fields") != Some(&json!(true))
                    && obj.get("minProperties").is_some()
                {
                    problems.push(format!("{path}: fields of this object would be pruned"));
                }
                for (k, v) in obj {
                    walk(v, &format!("{path}/{k}"), problems);
                }
            }
            Value::Array(items) => items
                .iter()
                .enumerate()
                .for_each(|(i, v)| walk(v, &format!("{path}/{i}"), problems)),
            _ => {}
        }
    }
    let mut problems = Vec::new();
    walk(&openapi_schema(), "", &mut problems);
    assert!(problems.is_empty(), "{problems:#?}");
    let steps = &openapi_schema()["properties"]["spec"]["properties"]["pipeline"]["properties"]
        ["steps"]["items"];
    assert_eq!(
        steps["x-kubernetes-preserve-unknown-fields"],
        json!(true),
        "steps would lose their fields: {steps}"
    );
}

#[test]
fn the_crd_schema_declares_the_validation_rules() {
    // What the API server enforces, independent of the local CEL evaluation below.
    let schema = openapi_schema();
    let spec = &schema["properties"]["spec"];
    let rules = |v: &Value| -> Vec<String> {
        v["x-kubernetes-validations"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|r| r["rule"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(rules(spec).contains(&"self.parallelism <= self.maxParallelism".to_string()));
    assert!(rules(&spec["properties"]["maxParallelism"]).contains(&"self == oldSelf".to_string()));
    assert!(rules(&spec["properties"]["parallelism"]).contains(&"self >= 1".to_string()));
    assert!(
        rules(&spec["properties"]["checkpoint"]["properties"]["storage"])
            .contains(&STORAGE_URI_RULE.to_string())
    );
    assert_eq!(
        spec["properties"]["upgradeMode"]["enum"],
        json!(["stateless", "savepoint", "last-state"])
    );
    assert_eq!(
        spec["properties"]["state"]["enum"],
        json!(["running", "suspended"])
    );
    assert!(spec["properties"]["savepointTimeout"]["pattern"].is_string());
}

// ------------------------------------------------- rules, evaluated locally

/// Runs the CRD's CEL rules (`x-kubernetes-validations`) as the API server
/// would, with kube's `cel` feature (kube-cel); `old` makes it an update.
fn cel(object: &Value, old: Option<&Value>) -> Result<(), Vec<String>> {
    kube::core::cel::Validator::new()
        .validate(&openapi_schema(), object, old)
        .map_err(|errs| errs.iter().map(|e| e.to_string()).collect())
}

fn cel_refuses(object: &Value, old: Option<&Value>, expected: &str) {
    match cel(object, old) {
        Ok(()) => panic!("accepted, expected a refusal mentioning {expected:?}"),
        Err(errs) => assert!(
            errs.iter().any(|e| e.contains(expected)),
            "expected {expected:?} in {errs:#?}"
        ),
    }
}

#[test]
fn cel_rules_accept_the_example_and_the_minimal_manifest() {
    assert_eq!(cel(&example_json(), None), Ok(()));
    assert_eq!(cel(&minimal(), None), Ok(()));
    // An update that changes what may change.
    let scaled = with(example_json(), "/spec/parallelism", json!(4));
    assert_eq!(cel(&scaled, Some(&example_json())), Ok(()));
}

#[test]
fn cel_refuses_parallelism_zero_naming_the_field() {
    cel_refuses(
        &with(minimal(), "/spec/parallelism", json!(0)),
        None,
        "spec.parallelism: parallelism must be at least 1",
    );
}

#[test]
fn cel_refuses_parallelism_above_max_parallelism_naming_the_field() {
    let bad = with(
        with(minimal(), "/spec/parallelism", json!(9)),
        "/spec/maxParallelism",
        json!(8),
    );
    cel_refuses(&bad, None, "parallelism must be at most maxParallelism");
    // The default maxParallelism (128) applies when it is not written.
    cel_refuses(
        &with(minimal(), "/spec/parallelism", json!(129)),
        None,
        "parallelism must be at most maxParallelism",
    );
}

#[test]
fn cel_refuses_a_changed_max_parallelism_on_update() {
    let old = with(example_json(), "/spec/maxParallelism", json!(64));
    let new = with(example_json(), "/spec/maxParallelism", json!(256));
    cel_refuses(&new, Some(&old), "maxParallelism is immutable");
    // Writing the default explicitly is not a change.
    let explicit = with(example_json(), "/spec/maxParallelism", json!(128));
    assert_eq!(cel(&explicit, Some(&example_json())), Ok(()));
}

#[test]
fn cel_refuses_storage_without_a_known_scheme() {
    for storage in ["gs://bucket/x", "relative/dir", "file://relative", "s3://"] {
        let bad = with(minimal(), "/spec/checkpoint/storage", json!(storage));
        cel_refuses(&bad, None, STORAGE_URI_MESSAGE);
    }
    for storage in ["/abs", "file:///abs", "s3://bucket/prefix"] {
        let good = with(minimal(), "/spec/checkpoint/storage", json!(storage));
        assert_eq!(cel(&good, None), Ok(()), "{storage}");
    }
    let bad = with(
        minimal(),
        "/spec/initialSavepoint",
        json!("savepoints/sp-1"),
    );
    cel_refuses(&bad, None, STORAGE_URI_MESSAGE);
}

#[test]
fn cel_refuses_deployment_settings_written_twice_differently() {
    cel_refuses(
        &with(minimal(), "/spec/pipeline/parallelism", json!(4)),
        None,
        "pipeline.parallelism differs from spec.parallelism",
    );
    cel_refuses(
        &with(
            minimal(),
            "/spec/pipeline/checkpoint",
            json!({"interval": "1s"}),
        ),
        None,
        "go in spec.checkpoint",
    );
    assert_eq!(
        cel(
            &with(minimal(), "/spec/pipeline/parallelism", json!(1)),
            None
        ),
        Ok(())
    );
}

/// The OpenAPI keywords the API server checks before CEL (enum, pattern,
/// bounds, required), which kube-cel does not evaluate. A small subset
/// checker, enough for the keywords this schema uses.
fn schema_violations(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    if value.is_null() {
        return;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            out.push(format!(
                "{path}: Unsupported value: {value}: supported values: {allowed:?}"
            ));
        }
    }
    if let (Some(p), Some(s)) = (schema["pattern"].as_str(), value.as_str()) {
        let re = regex::Regex::new(p).expect("the schema's pattern compiles");
        if !re.is_match(s) {
            out.push(format!(
                "{path}: Invalid value: {value}: should match '{p}'"
            ));
        }
    }
    if let Some(n) = value.as_f64() {
        if schema["minimum"].as_f64().is_some_and(|m| n < m) {
            out.push(format!(
                "{path}: Invalid value: {n}: should be greater than or equal to {}",
                schema["minimum"]
            ));
        }
        if schema["maximum"].as_f64().is_some_and(|m| n > m) {
            out.push(format!(
                "{path}: Invalid value: {n}: should be less than or equal to {}",
                schema["maximum"]
            ));
        }
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if schema["minLength"].as_u64().is_some_and(|m| len < m)
            || schema["maxLength"].as_u64().is_some_and(|m| len > m)
        {
            out.push(format!("{path}: Invalid value: length {len}"));
        }
    }
    if let Some(obj) = value.as_object() {
        for r in schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !obj.contains_key(r) {
                out.push(format!("{path}.{r}: Required value"));
            }
        }
        for (k, v) in obj {
            let sub = &schema["properties"][k];
            if !sub.is_null() {
                schema_violations(sub, v, &format!("{path}.{k}"), out);
            } else if schema["additionalProperties"].is_object() {
                schema_violations(
                    &schema["additionalProperties"],
                    v,
                    &format!("{path}.{k}"),
                    out,
                );
            }
        }
    }
    if let Some(items) = value.as_array() {
        if schema["maxItems"]
            .as_u64()
            .is_some_and(|m| items.len() as u64 > m)
        {
            out.push(format!("{path}: Too many: {}", items.len()));
        }
        for (i, v) in items.iter().enumerate() {
            schema_violations(&schema["items"], v, &format!("{path}[{i}]"), out);
        }
    }
}

fn openapi_violations(object: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let schema = openapi_schema();
    schema_violations(
        &schema["properties"]["spec"],
        &object["spec"],
        "spec",
        &mut out,
    );
    out
}

#[test]
fn the_schema_accepts_the_example_and_the_minimal_manifest() {
    assert_eq!(openapi_violations(&example_json()), Vec::<String>::new());
    assert_eq!(openapi_violations(&minimal()), Vec::<String>::new());
}

#[test]
fn the_schema_refuses_an_unknown_upgrade_mode_and_state() {
    let v = openapi_violations(&with(minimal(), "/spec/upgradeMode", json!("blue-green")));
    assert!(
        v.iter()
            .any(|e| e.starts_with("spec.upgradeMode: Unsupported value")),
        "{v:?}"
    );
    let v = openapi_violations(&with(minimal(), "/spec/state", json!("paused")));
    assert!(
        v.iter()
            .any(|e| e.starts_with("spec.state: Unsupported value")),
        "{v:?}"
    );
}

#[test]
fn the_schema_refuses_malformed_durations() {
    for bad in ["500", "5 parsecs", "1d", "-1s", ""] {
        let v = openapi_violations(&with(minimal(), "/spec/checkpoint/interval", json!(bad)));
        assert!(
            v.iter()
                .any(|e| e.starts_with("spec.checkpoint.interval: Invalid value")),
            "{bad}: {v:?}"
        );
    }
    for good in ["500ms", "1.5s", "2m", "1h", "0s"] {
        assert_eq!(
            openapi_violations(&with(minimal(), "/spec/savepointTimeout", json!(good))),
            Vec::<String>::new(),
            "{good}"
        );
    }
}

#[test]
fn the_schema_refuses_parallelism_zero_and_requires_image_and_storage() {
    let v = openapi_violations(&with(minimal(), "/spec/parallelism", json!(0)));
    assert!(
        v.iter()
            .any(|e| e.starts_with("spec.parallelism: Invalid value")),
        "{v:?}"
    );
    let mut no_image = minimal();
    no_image["spec"].as_object_mut().unwrap().remove("image");
    assert!(openapi_violations(&no_image).contains(&"spec.image: Required value".to_string()));
    let no_storage = with(minimal(), "/spec/checkpoint", json!({}));
    assert!(openapi_violations(&no_storage)
        .contains(&"spec.checkpoint.storage: Required value".to_string()));
}
