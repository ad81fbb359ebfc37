//! Schemas of the Kubernetes types the spec embeds (`podTemplate`,
//! `resources`, `env`, `affinity`, ...), made to fit a CRD.
//!
//! k8s-openapi's schemas carry the full upstream documentation of every
//! nested field (a `Quantity` alone has 2 KB of it). Inlined into the CRD for
//! a whole PodTemplateSpec that would make the manifest several hundred KB,
//! too big for `kubectl apply`'s client-side `last-applied-configuration`
//! annotation (256 KiB) and slow for every client that downloads the schema.
//! So nested descriptions are dropped (the field's own doc comment stays:
//! `kubectl explain` shows it, and the upstream documentation is one link
//! away), and the pod template's schema is trimmed to what a template can
//! carry (see [`pod_template`]).

use k8s_openapi::api::core::v1::PodTemplateSpec;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{json, Value};

/// `T`'s schema without the descriptions of its nested fields.
pub(super) fn without_docs<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    let mut value = T::json_schema(generator).to_value();
    strip_descriptions(&mut value);
    Schema::try_from(value).unwrap_or_default()
}

/// `Option<Vec<T>>` / `Vec<T>` as an array of `T` without nested descriptions.
pub(super) fn list_without_docs<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    let items = without_docs::<T>(generator).to_value();
    Schema::try_from(json!({"type": "array", "items": items})).unwrap_or_default()
}

/// The schema of `spec.podTemplate`: core/v1 PodTemplateSpec, with
/// - `metadata` cut down to `labels` and `annotations` (the operator names,
///   places and owns its pods; other metadata is refused by kubectl's
///   strict field validation, or pruned);
/// - `spec.containers` optional (a template may only set, say, a
///   nodeSelector; a container named `worker` is merged into the operator's);
/// - no `ephemeralContainers` (the API server refuses them when a pod is
///   created anyway);
/// - no nested descriptions.
pub(super) fn pod_template(generator: &mut SchemaGenerator) -> Schema {
    let mut value = PodTemplateSpec::json_schema(generator).to_value();
    strip_descriptions(&mut value);
    if let Some(props) = value.get_mut("properties").and_then(Value::as_object_mut) {
        let string_map = json!({"type": "object", "additionalProperties": {"type": "string"}});
        props.insert(
            "metadata".into(),
            json!({
                "type": "object",
                "description": "Labels and annotations added to every worker pod (spec.podLabels and spec.podAnnotations win on the same key, the operator's own weir.dev/* and app.kubernetes.io/* labels win over both). Nothing else: the operator names and owns its pods.",
                "properties": {"labels": string_map, "annotations": string_map},
            }),
        );
        if let Some(spec) = props.get_mut("spec").and_then(Value::as_object_mut) {
            spec.remove("required");
            spec.insert(
                "description".into(),
                "A core/v1 PodSpec merged with the operator's worker pod; see spec.podTemplate.".into(),
            );
            if let Some(p) = spec.get_mut("properties").and_then(Value::as_object_mut) {
                p.remove("ephemeralContainers");
            }
        }
    }
    Schema::try_from(value).unwrap_or_default()
}

/// Removes every `description` of a schema tree. The walk follows the
/// schema keywords, so a property that happens to be *named* `description`
/// (a key of `properties`) is kept.
fn strip_descriptions(schema: &mut Value) {
    let Value::Object(obj) = schema else { return };
    obj.remove("description");
    if let Some(Value::Object(props)) = obj.get_mut("properties") {
        props.values_mut().for_each(strip_descriptions);
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(sub) = obj.get_mut(key) {
            strip_descriptions(sub);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(subs)) = obj.get_mut(key) {
            subs.iter_mut().for_each(strip_descriptions);
        }
    }
}
