//! Which spec changes need new pods. The hash covers the fields the pods are
//! built from; lifecycle fields (upgrade mode, desired state, triggers,
//! backoff, savepoint settings, initialSavepoint) change what the operator
//! does, not what runs, so editing them never restarts a job.

use sha2::{Digest, Sha256};
use weir_api::streamjob::StreamJobSpec;

/// Spec fields that do not shape the pods.
const LIFECYCLE_FIELDS: &[&str] = &[
    "upgradeMode",
    "state",
    "savepointTrigger",
    "restartTrigger",
    "initialSavepoint",
    "restartBackoff",
    "savepointOnDelete",
    "savepointTimeout",
    "deployTimeout",
    "upgrade",
];

/// A stable hash (hex, 16 characters) of the pod-shaping part of the spec.
/// `image` is the image the workers run ([`crate::desired::worker_image`]):
/// for a job that names none, the operator's default counts as the spec's,
/// so that a new default (an operator upgrade) upgrades the job the way a
/// changed `spec.image` would, savepoint first, instead of slipping into the
/// next restart. A job with `spec.image` hashes as it always did.
pub fn spec_hash(spec: &StreamJobSpec, image: Option<&str>) -> String {
    let mut value = serde_json::to_value(spec).unwrap_or_default();
    if let Some(obj) = value.as_object_mut() {
        for f in LIFECYCLE_FIELDS {
            obj.remove(*f);
        }
        if let (false, Some(image)) = (obj.contains_key("image"), image) {
            obj.insert("image".into(), image.into());
        }
    }
    // serde_json's map is ordered by key unless `preserve_order` is on, and then
    // it follows the struct's field order: stable either way for one build.
    let canonical = canonical_json(&value);
    let digest = Sha256::digest(canonical.as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// JSON with object keys sorted at every level, so that the hash does not
/// depend on map order.
fn canonical_json(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .iter()
                .map(|k| format!("{}:{}", serde_json::Value::String((*k).clone()), canonical_json(&map[*k])))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        Value::Array(items) => format!("[{}]", items.iter().map(canonical_json).collect::<Vec<_>>().join(",")),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::JobBuilder;

    #[test]
    fn lifecycle_fields_do_not_change_the_hash() {
        let a = JobBuilder::new("j").build();
        let mut b = a.clone();
        b.spec.savepoint_trigger = Some("x".into());
        b.spec.restart_trigger = Some("y".into());
        b.spec.state = weir_api::streamjob::JobState::Suspended;
        b.spec.upgrade_mode = weir_api::streamjob::UpgradeMode::Stateless;
        assert_eq!(spec_hash(&a.spec, None), spec_hash(&b.spec, None));
    }

    #[test]
    fn parallelism_pipeline_and_image_change_the_hash() {
        let a = JobBuilder::new("j").build();
        let h = spec_hash(&a.spec, None);
        let mut b = a.clone();
        b.spec.parallelism = 3;
        assert_ne!(h, spec_hash(&b.spec, None));
        let mut c = a.clone();
        c.spec.image = Some("weir:2".into());
        assert_ne!(h, spec_hash(&c.spec, None));
        let mut d = a.clone();
        d.spec.pipeline.0["steps"] = serde_json::json!([{"filter": "value > 1"}]);
        assert_ne!(h, spec_hash(&d.spec, None));
        let mut e = a.clone();
        e.spec.pod_template.get_or_insert_with(Default::default).metadata = Some(Default::default());
        e.spec.pod_template.as_mut().unwrap().metadata.as_mut().unwrap().labels = Some([("team".to_string(), "data".to_string())].into());
        assert_ne!(h, spec_hash(&e.spec, None), "the pod template shapes the pods");
        assert_eq!(h.len(), 16);
    }

    #[test]
    fn the_operators_default_image_counts_only_for_a_job_without_one() {
        let named = JobBuilder::new("j").build();
        assert_eq!(spec_hash(&named.spec, Some("weir:1")), spec_hash(&named.spec, Some("weir:2")), "spec.image wins");
        let unnamed = JobBuilder::new("j").spec(|s| s.image = None).build();
        assert_ne!(spec_hash(&unnamed.spec, Some("weir:1")), spec_hash(&unnamed.spec, Some("weir:2")), "a new default upgrades the job");
        let mut explicit = unnamed.clone();
        explicit.spec.image = Some("weir:1".into());
        assert_eq!(spec_hash(&unnamed.spec, Some("weir:1")), spec_hash(&explicit.spec, None), "the same image, the same pods");
    }
}
