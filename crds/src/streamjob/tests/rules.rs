//! The CRD's validation, evaluated locally on good and bad manifests.

use serde_json::{json, Value};

use super::*;

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
    for storage in ["hdfs://nn/x", "relative/dir", "file://relative", "s3://", "gs://key:secret@bucket/x", "az://c/x?sig=1", "abfs://c@evil.example.com/x"] {
        let bad = with(minimal(), "/spec/checkpoint/storage", json!(storage));
        cel_refuses(&bad, None, STORAGE_URI_MESSAGE);
    }
    for storage in ["/abs", "file:///abs", "s3://bucket/prefix", "gs://bucket/a/b", "az://container", "abfss://c@account.dfs.core.windows.net/x"] {
        assert!(storage.starts_with("file://") || crate::object_store_url::object_store_kind(storage).is_none_or(|k| k.is_ok()), "the runtime would refuse {storage}");
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
fn cel_refuses_an_s3_endpoint_that_is_not_a_server_url() {
    for endpoint in ["minio:9000", "http://minio:9000/weir", "ftp://minio", "http://"] {
        let bad = with(minimal(), "/spec/checkpoint/s3", json!({"endpoint": endpoint}));
        cel_refuses(&bad, None, S3_ENDPOINT_MESSAGE);
    }
    for endpoint in ["http://10.250.0.1:9000", "https://s3.eu-west-1.amazonaws.com", "http://[::1]:9000/"] {
        let good = with(minimal(), "/spec/checkpoint/s3", json!({"endpoint": endpoint, "credentialsSecret": "s3"}));
        assert_eq!(cel(&good, None), Ok(()), "{endpoint}");
    }
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

#[test]
fn cel_refuses_a_job_name_that_cannot_name_its_service() {
    let named = |name: &str| with(minimal(), "/metadata/name", json!(name));
    cel_refuses(&named(&"a".repeat(56)), None, "metadata.name must be at most 55 characters");
    for bad in ["2jobs", "my.job"] {
        cel_refuses(&named(bad), None, "metadata.name must consist of lowercase letters, digits and '-'");
    }
    assert_eq!(cel(&named(&"a".repeat(55)), None), Ok(()));
}

#[test]
fn the_schema_accepts_a_pod_template_without_containers_and_checks_the_ones_given() {
    let only_pod = with(minimal(), "/spec/podTemplate", json!({"spec": {"nodeSelector": {"disk": "ssd"}}}));
    assert_eq!(openapi_violations(&only_pod), Vec::<String>::new());
    let nameless = with(minimal(), "/spec/podTemplate", json!({"spec": {"containers": [{"image": "x"}]}}));
    let v = openapi_violations(&nameless);
    assert!(v.contains(&"spec.podTemplate.spec.containers[0].name: Required value".to_string()), "{v:?}");
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
fn the_schema_accepts_a_graph_pipeline_and_keeps_every_field_of_its_nodes() {
    let graph = with(minimal(), "/spec/pipeline", graph_pipeline(false));
    assert_eq!(openapi_violations(&graph), Vec::<String>::new());
    assert_eq!(cel(&graph, None), Ok(()));
    // Sources and sinks, like steps, have hand-written shapes: the API server
    // must keep their fields for the controller's check to see them.
    let pipeline = &openapi_schema()["properties"]["spec"]["properties"]["pipeline"]["properties"];
    for map in ["sources", "sinks"] {
        assert_eq!(pipeline[map]["type"], json!("object"), "{map}");
        assert_eq!(pipeline[map]["additionalProperties"]["x-kubernetes-preserve-unknown-fields"], json!(true), "{map}");
    }
    assert!(pipeline.get("required").is_none() || !pipeline["required"].to_string().contains("source"));
    assert!(parse(&graph).spec.validate_pipeline().unwrap().is_graph());
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
fn the_schema_refuses_parallelism_zero_and_an_empty_image_and_requires_storage() {
    let v = openapi_violations(&with(minimal(), "/spec/parallelism", json!(0)));
    assert!(
        v.iter()
            .any(|e| e.starts_with("spec.parallelism: Invalid value")),
        "{v:?}"
    );
    // No image is fine (the operator's default); an empty one is not.
    let mut no_image = minimal();
    no_image["spec"].as_object_mut().unwrap().remove("image");
    assert_eq!(openapi_violations(&no_image), Vec::<String>::new());
    let v = openapi_violations(&with(minimal(), "/spec/image", json!("")));
    assert!(v.iter().any(|e| e.starts_with("spec.image: Invalid value")), "{v:?}");
    let no_storage = with(minimal(), "/spec/checkpoint", json!({}));
    assert!(openapi_violations(&no_storage)
        .contains(&"spec.checkpoint.storage: Required value".to_string()));
}
