//! The generated CRD manifest: names, columns, keywords Kubernetes accepts, rules declared.

use serde_json::{json, Value};

use super::*;

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

#[test]
fn the_crd_fits_kubectls_client_side_apply_annotation() {
    // `kubectl apply` without --server-side keeps the whole object, as
    // compact JSON, in the last-applied-configuration annotation, and the
    // API server refuses annotations over 256 KiB in total. The embedded
    // Kubernetes types' own documentation would break that (see k8s_schema).
    let json = serde_json::to_string(&crd_value()).unwrap();
    assert!(json.len() < 200 * 1024, "the CRD is {} bytes as JSON", json.len());
}

#[test]
fn the_pod_template_schema_is_a_pod_template_trimmed_to_fit() {
    let spec = &openapi_schema()["properties"]["spec"]["properties"];
    let template = &spec["podTemplate"];
    assert!(template["description"].as_str().unwrap().contains("The operator's part wins"));
    let metadata = template["properties"]["metadata"]["properties"].as_object().unwrap();
    assert_eq!(metadata.keys().collect::<Vec<_>>(), ["annotations", "labels"]);
    let pod = &template["properties"]["spec"];
    assert!(pod.get("required").is_none(), "containers are optional in a template");
    for field in ["containers", "initContainers", "volumes", "securityContext", "topologySpreadConstraints", "imagePullSecrets", "priorityClassName", "tolerations", "affinity"] {
        assert!(pod["properties"][field].is_object(), "{field}");
    }
    assert!(pod["properties"]["ephemeralContainers"].is_null(), "refused on create anyway");
    let container = &pod["properties"]["containers"]["items"];
    assert_eq!(container["required"], json!(["name"]));
    assert!(container["properties"]["description"].is_null() && container.get("description").is_none());
    // Nested documentation is gone; the fields' own doc comments stay.
    let quantity = &spec["resources"]["properties"]["limits"]["additionalProperties"];
    assert_eq!(quantity, &json!({"x-kubernetes-int-or-string": true}));
    assert!(spec["resources"]["description"].as_str().unwrap().contains("requests cpu 100m and memory 256Mi, limit memory 1Gi"));
}

#[test]
fn the_rules_on_the_root_name_no_field_path() {
    // The API server accepts a rule's fieldPath only into the schema, and the
    // schema does not describe metadata: ".metadata.name" makes the whole
    // CRD invalid ("must be a valid path").
    let root = &openapi_schema()["x-kubernetes-validations"];
    let rules: Vec<&str> = root.as_array().expect("root rules").iter().filter_map(|r| r["rule"].as_str()).collect();
    assert_eq!(rules, [NAME_LENGTH_RULE, NAME_SYNTAX_RULE]);
    assert!(root.as_array().unwrap().iter().all(|r| r.get("fieldPath").is_none()));
}
