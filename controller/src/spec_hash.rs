//! Which spec changes need new pods. The hash covers the fields the pods are
//! built from; lifecycle fields (upgrade mode, desired state, triggers,
//! backoff, savepoint settings, initialSavepoint) change what the operator
//! does, not what runs, so editing them never restarts a job. Fields at
//! their defaults are left out, so that a release that adds a defaulted
//! field hashes every existing spec as before: otherwise the field's
//! default, serialized into every spec, would upgrade every job at once
//! when the operator is upgraded. Hashes of the earlier scheme, which
//! kept the defaults, are rewritten once ([`migrate`]).

use serde_json::Value;
use sha2::{Digest, Sha256};
use weir_api::streamjob::{StreamJobSpec, StreamJobStatus};

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
    "savepoints",
];

/// A stable hash (hex, 16 characters) of the pod-shaping part of the spec.
/// `image` is the image the workers run ([`crate::desired::worker_image`]):
/// for a job that names none, the operator's default counts as the spec's,
/// so that a new default (an operator upgrade) upgrades the job the way a
/// changed `spec.image` would, savepoint first, instead of slipping into the
/// next restart. A job with `spec.image` hashes as it always did.
pub fn spec_hash(spec: &StreamJobSpec, image: Option<&str>) -> String {
    let value = serde_json::to_value(spec).unwrap_or_default();
    hash_of(without_defaults(value), image)
}

/// The hash of the earlier scheme, fields at their defaults included.
fn legacy_spec_hash(spec: &StreamJobSpec, image: Option<&str>) -> String {
    hash_of(serde_json::to_value(spec).unwrap_or_default(), image)
}

fn hash_of(mut value: Value, image: Option<&str>) -> String {
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

/// Members taken as they are: the pipeline document is kept as written,
/// and the pod template is Kubernetes' own type, which serializes only
/// what was given.
const AS_WRITTEN: &[&str] = &["pipeline", "podTemplate"];

/// `spec` (a serialized [`StreamJobSpec`]) without the fields whose value
/// is what the spec would get without them. Found by trial, one field at a
/// time, outer fields first: whatever the defaults are, they come from the
/// deserializer itself.
fn without_defaults(spec: Value) -> Value {
    let mut paths = Vec::new();
    object_paths(&spec, &mut Vec::new(), &mut paths);
    let mut out = spec;
    for path in paths {
        if lookup(&out, &path).is_none() {
            continue;
        }
        let mut trial = out.clone();
        remove(&mut trial, &path);
        let Ok(back) = serde_json::from_value::<StreamJobSpec>(trial.clone()).and_then(serde_json::to_value) else { continue };
        if lookup(&back, &path) == lookup(&out, &path) {
            out = trial;
        }
    }
    out
}

/// Every path to an object member, parents before their members.
fn object_paths(value: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Value::Object(map) = value {
        for (k, v) in map {
            if at.is_empty() && AS_WRITTEN.contains(&k.as_str()) {
                continue;
            }
            at.push(k.clone());
            out.push(at.clone());
            object_paths(v, at, out);
            at.pop();
        }
    }
}

fn lookup<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, k| v.as_object()?.get(k))
}

fn remove(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else { return };
    let parent = parents.iter().try_fold(value, |v, k| v.as_object_mut()?.get_mut(k));
    if let Some(Value::Object(map)) = parent {
        map.remove(last);
    }
}

/// Rewrites the hashes in `status` that the earlier scheme computed for
/// `spec` (and, for the last stable spec, for the spec it keeps) to this
/// scheme's, so that the operator release that changed the scheme does not
/// take every job for changed. `current` is `spec_hash(spec, image)`, which
/// the caller has; a status whose hashes are all `current` (every job once
/// migrated and running its spec) costs no other hash. Whether anything
/// changed.
pub fn migrate(status: &mut StreamJobStatus, spec: &StreamJobSpec, image: Option<&str>, current: &str) -> bool {
    let mut hashes: Vec<&mut String> = Vec::new();
    hashes.extend(status.deployed_spec_hash.as_mut());
    if let Some(run) = status.run.as_mut() {
        hashes.push(&mut run.spec_hash);
    }
    if let Some(trial) = status.upgrade_trial.as_mut() {
        hashes.push(&mut trial.spec_hash);
    }
    if let Some(rb) = status.rollback.as_mut() {
        hashes.push(&mut rb.spec_hash);
        hashes.push(&mut rb.to_spec_hash);
    }
    let mut renamed: Vec<(String, String)> = Vec::new();
    if let Some(stable) = status.last_stable_spec.as_mut() {
        if stable.spec_hash != current {
            if let Ok(stable_spec) = serde_json::from_str::<StreamJobSpec>(&stable.spec) {
                renamed.push((legacy_spec_hash(&stable_spec, image), spec_hash(&stable_spec, image)));
            }
        }
        hashes.push(&mut stable.spec_hash);
    }
    if hashes.iter().all(|h| h.as_str() == current) {
        return false;
    }
    renamed.push((legacy_spec_hash(spec, image), current.to_string()));
    renamed.retain(|(old, new)| old != new);
    let mut changed = false;
    for hash in hashes {
        if let Some((_, new)) = renamed.iter().find(|(old, _)| old == hash) {
            *hash = new.clone();
            changed = true;
        }
    }
    changed
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
        b.spec.savepoints.max_count = 3;
        b.spec.savepoints.interval = Some(weir_api::pipeline::HumanDuration::from_millis(60_000));
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
    fn a_field_a_later_release_adds_with_a_default_leaves_every_hash_as_it_was() {
        // A later release serializes its new field, at its default, into
        // every spec; the hash leaves out what equals the default, so this
        // one's hash of the same spec is the later one's. Simulated: a spec
        // serialized with every field, against one holding only what
        // differs from the defaults.
        let job = JobBuilder::new("j").spec(|s| s.parallelism = 3).build();
        let full = serde_json::to_value(&job.spec).unwrap();
        let stripped = without_defaults(full.clone());
        assert!(stripped.get("parallelism").is_some(), "a set field stays: {stripped}");
        assert!(stripped.get("allowNonRestoredState").is_none(), "a default is left out: {stripped}");
        assert!(full.get("allowNonRestoredState").is_some(), "the serialized spec has it");
        let mut later = full.clone();
        later.as_object_mut().unwrap().insert("futureField".into(), serde_json::json!({"setting": 7}));
        let with_future = |v: Value| {
            let mut v = without_defaults(v);
            // What the later release finds to be its default.
            if v.get("futureField") == Some(&serde_json::json!({"setting": 7})) {
                v.as_object_mut().unwrap().remove("futureField");
            }
            v
        };
        assert_eq!(hash_of(with_future(later), None), spec_hash(&job.spec, None));
        let mut changed = job.clone();
        changed.spec.checkpoint.retain += 1;
        assert_ne!(spec_hash(&changed.spec, None), spec_hash(&job.spec, None), "a nested setting off its default counts");
    }

    #[test]
    fn hashes_of_the_earlier_scheme_in_status_are_rewritten_once_and_others_kept() {
        use weir_api::streamjob::{RunStatus, StableSpec};
        let job = JobBuilder::new("j").build();
        let (legacy, new) = (legacy_spec_hash(&job.spec, Some("weir:1")), spec_hash(&job.spec, Some("weir:1")));
        assert_ne!(legacy, new, "the schemes differ for a spec with defaults");
        let mut status = StreamJobStatus {
            deployed_spec_hash: Some(legacy.clone()),
            run: Some(RunStatus::decided("r-1".into(), 1, legacy.clone(), 1, k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::from_second(1_800_000_000).unwrap()))),
            last_stable_spec: Some(StableSpec { spec_hash: legacy.clone(), generation: Some(1), spec: serde_json::to_string(&job.spec).unwrap() }),
            ..Default::default()
        };
        assert!(migrate(&mut status, &job.spec, Some("weir:1"), &new));
        assert_eq!(status.deployed_spec_hash.as_deref(), Some(new.as_str()));
        assert_eq!(status.run.as_ref().unwrap().spec_hash, new);
        assert_eq!(status.last_stable_spec.as_ref().unwrap().spec_hash, new);
        assert!(!migrate(&mut status, &job.spec, Some("weir:1"), &new), "once");
        // A hash of another spec (a change the user made) stays, so the
        // change still upgrades the job.
        let mut other = StreamJobStatus { deployed_spec_hash: Some("0123456789abcdef".into()), ..Default::default() };
        assert!(!migrate(&mut other, &job.spec, Some("weir:1"), &new));
        assert_eq!(other.deployed_spec_hash.as_deref(), Some("0123456789abcdef"));
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
