//! Behaviour of the StreamJob API, by concern: `spec` (parsing, defaults, the
//! pipeline check, status helpers), `crd` (the generated manifest), `rules`
//! (the CRD's validation evaluated locally: CEL with kube's `cel` feature, and
//! the OpenAPI keywords CEL does not cover with a small checker).

mod crd;
mod rules;
mod spec;

use serde_json::{json, Value};

use super::*;

const EXAMPLE: &str = include_str!("../../../../examples/streamjob.yaml");

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

/// A graph pipeline as a StreamJob carries it: a filter of one source
/// into one sink, or (`cyclic`) two steps reading each other.
fn graph_pipeline(cyclic: bool) -> Value {
    let steps = if cyclic {
        json!([{"name": "x", "input": "y", "filter": "value > 1"}, {"name": "y", "input": ["x", "a"], "union": {}}])
    } else {
        json!([{"name": "y", "input": "a", "filter": "value > 1"}])
    };
    json!({
        "name": "m",
        "sources": {"a": {"generator": {"events": 10}, "event_time": {"field": "value"}}},
        "steps": steps,
        "sinks": {"out": {"input": "y", "blackhole": {}}}
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

fn crd_value() -> Value {
    serde_json::to_value(<StreamJob as kube::CustomResourceExt>::crd()).expect("the CRD serializes")
}

fn openapi_schema() -> Value {
    crd_value()["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}
