//! The embedded pipeline: how it is stored, its schema in the CRD, and the
//! check the controller runs on it (the part CEL cannot do).
//!
//! The pipeline is kept as an untyped document, not a `PipelineSpec`: if a
//! StreamJob carrying an invalid pipeline (an unknown step, say) failed to
//! deserialize, the controller could not even read it to report the error in
//! its status; it would only log watch errors. So the document is parsed on
//! demand, by the same code and with the same messages as `weir run`.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::spec::StreamJobSpec;
use crate::pipeline::{PipelineError, PipelineSpec};

/// The `spec.pipeline` object as written in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PipelineDocument(pub Value);

/// The name pipeline errors are reported under (where `weir run` puts the file name).
pub const PIPELINE_ERROR_NAME: &str = "spec.pipeline";

impl schemars::JsonSchema for PipelineDocument {
    fn schema_name() -> Cow<'static, str> {
        "PipelineDocument".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let mut value = generator.subschema_for::<PipelineSpec>().to_value();
        // The pipeline format owns its defaults (serde defaults in PipelineSpec), and
        // the CEL rules must see whether parallelism/checkpoint were written at all;
        // defaults in the CRD would make the API server fill them in.
        strip(&mut value, "default");
        kubernetes_compatible(&mut value);
        if let Value::Object(obj) = &mut value {
            obj.insert(
                "description".into(),
                "The pipeline in the format `weir run` takes (snake_case keys); its inner validity is checked by the controller and reported in status".into(),
            );
        }
        // Only an object or a bool can fail to convert, and the value came from a schema.
        schemars::Schema::try_from(value).unwrap_or_default()
    }
}

/// Removes `keyword` from every object of the schema tree.
fn strip(value: &mut Value, keyword: &str) {
    match value {
        Value::Object(obj) => {
            obj.remove(keyword);
            obj.values_mut().for_each(|v| strip(v, keyword));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| strip(v, keyword)),
        _ => {}
    }
}

/// Adapts what the pipeline's schemars schema says to what Kubernetes accepts.
fn kubernetes_compatible(value: &mut Value) {
    match value {
        Value::Object(obj) => {
            // Kubernetes knows int32/int64 only and warns on every other format.
            if matches!(obj.get("format").and_then(Value::as_str), Some(f) if f.starts_with("uint"))
            {
                obj.remove("format");
            }
            // Kubernetes refuses `additionalProperties: false` (serde's
            // deny_unknown_fields on an empty struct such as `blackhole: {}`); an
            // object without properties already gets unknown fields pruned, or
            // refused under kubectl's strict field validation.
            let closed = obj.get("additionalProperties") == Some(&Value::Bool(false));
            if closed {
                obj.remove("additionalProperties");
            }
            // A step (`- key_by: key`) has a hand-written shape (one key out of
            // several, values of several types) and no `properties`. Without this
            // flag the API server prunes every field of a step; with it, the step
            // reaches the controller, whose pipeline check names what is wrong.
            if !closed
                && obj.get("type").and_then(Value::as_str) == Some("object")
                && !obj.contains_key("properties")
                && !obj.contains_key("additionalProperties")
                && !obj.contains_key("oneOf")
            {
                obj.insert(
                    "x-kubernetes-preserve-unknown-fields".into(),
                    Value::Bool(true),
                );
            }
            obj.values_mut().for_each(kubernetes_compatible);
        }
        Value::Array(items) => items.iter_mut().for_each(kubernetes_compatible),
        _ => {}
    }
}

impl StreamJobSpec {
    /// The pipeline this job runs, checked exactly as `weir run` checks a file:
    /// the document is rendered to YAML and parsed by [`PipelineSpec::from_yaml`],
    /// so messages are the same (field paths, expectations; lines refer to the
    /// rendered document). Parallelism, max parallelism and checkpoint settings
    /// come from the spec.
    pub fn validate_pipeline(&self) -> Result<PipelineSpec, PipelineError> {
        let text = self.effective_pipeline_yaml()?;
        PipelineSpec::from_yaml(PIPELINE_ERROR_NAME, &text)
    }

    /// The pipeline file the workers run: `spec.pipeline` with parallelism, max
    /// parallelism and checkpoint settings from the spec. Not validated; see
    /// [`Self::validate_pipeline`].
    pub fn effective_pipeline_yaml(&self) -> Result<String, PipelineError> {
        let Value::Object(written) = &self.pipeline.0 else {
            return Err(invalid(
                "",
                "expected a map with name, source(s), steps and sink(s)",
            ));
        };
        // CEL refuses these on the API server; they are checked again here because
        // the spec can also come from elsewhere (a file, a test, an old CRD).
        if let Some(v) = written.get("parallelism") {
            if v.as_i64() != Some(i64::from(self.parallelism)) {
                return Err(invalid(
                    "parallelism",
                    format!(
                        "{v} differs from spec.parallelism {}: set it once, in spec.parallelism",
                        self.parallelism
                    ),
                ));
            }
        }
        if let Some(v) = written.get("max_parallelism") {
            if v.as_i64() != Some(i64::from(self.max_parallelism)) {
                return Err(invalid(
                    "max_parallelism",
                    format!(
                    "{v} differs from spec.maxParallelism {}: set it once, in spec.maxParallelism",
                    self.max_parallelism
                ),
                ));
            }
        }
        if written.contains_key("checkpoint") {
            return Err(invalid(
                "checkpoint",
                "checkpoint settings of a StreamJob go in spec.checkpoint",
            ));
        }
        let mut effective: Map<String, Value> = written.clone();
        effective.insert("parallelism".into(), self.parallelism.into());
        effective.insert("max_parallelism".into(), self.max_parallelism.into());
        let c = &self.checkpoint;
        let mut checkpoint = serde_json::json!({
            "interval": c.interval.to_string(),
            "mode": c.mode,
            "timeout": c.timeout.to_string(),
            "retain": c.retain,
        });
        if let Some(t) = &c.alignment_timeout {
            checkpoint["alignment_timeout"] = t.to_string().into();
        }
        if c.incremental {
            checkpoint["incremental"] = true.into();
        }
        effective.insert("checkpoint".into(), checkpoint);
        serde_yaml::to_string(&Value::Object(effective)).map_err(|e| PipelineError::Syntax {
            file: PIPELINE_ERROR_NAME.into(),
            message: e.to_string(),
        })
    }
}

impl StreamJobSpec {
    /// Everything the controller checks before it deploys (what CEL cannot):
    /// the pipeline ([`Self::validate_pipeline`]), that the pipeline can give
    /// the requested guarantee, and that the backoff bounds are ordered.
    /// Errors name the spec field; the controller reports them in status and
    /// an event instead of deploying.
    pub fn validate(&self) -> Result<PipelineSpec, PipelineError> {
        let pipeline = self.validate_pipeline()?;
        if let Some(wanted) = self.guarantee {
            let gives = pipeline.guarantee();
            if gives < wanted {
                // Never run a job that claims more than its source and sink can give.
                return Err(spec_invalid(
                    "guarantee",
                    format!("the pipeline gives {gives} (the weakest of its source and sink), below the requested {wanted}: change the sink or source, or ask for {gives}"),
                ));
            }
        }
        if pipeline.runtime_guarantee() == crate::Guarantee::AtMostOnce && self.upgrade_mode != super::UpgradeMode::Stateless {
            let (_, why) = pipeline.guarantee_and_reason();
            // Savepoint and last-state upgrades restore a snapshot, and an
            // at-most-once job takes none: refused here, not by a failing upgrade.
            return Err(spec_invalid(
                "upgradeMode",
                format!(
                    "the job is at-most-once ({why}): it takes no checkpoints or savepoints to upgrade from; expected upgradeMode: stateless"
                ),
            ));
        }
        let backoff = &self.restart_backoff;
        if backoff.initial > backoff.max {
            return Err(spec_invalid(
                "restartBackoff.initial",
                format!(
                    "{} is above restartBackoff.max {}: expected at most {}",
                    backoff.initial, backoff.max, backoff.max
                ),
            ));
        }
        if self.deploy_timeout.is_zero() {
            return Err(spec_invalid(
                "deployTimeout",
                "expected a duration above 0, such as 10m",
            ));
        }
        if self.upgrade.rollback.readiness_timeout.is_zero() {
            return Err(spec_invalid(
                "upgrade.rollback.readinessTimeout",
                "expected a duration above 0, such as 5m",
            ));
        }
        if let Some(interval) = self.savepoints.interval.filter(|i| i.get() < std::time::Duration::from_secs(1)) {
            return Err(spec_invalid(
                "savepoints.interval",
                format!("{interval} is too short: expected at least 1s (a savepoint is a whole copy of the job's state)"),
            ));
        }
        if !(1..=super::spec::MAX_SAVEPOINT_COUNT).contains(&self.savepoints.max_count) {
            return Err(spec_invalid(
                "savepoints.maxCount",
                format!("{} is out of range: expected 1 to {}", self.savepoints.max_count, super::spec::MAX_SAVEPOINT_COUNT),
            ));
        }
        if self.savepoints.max_age.is_some_and(|a| a.is_zero()) {
            return Err(spec_invalid(
                "savepoints.maxAge",
                "expected a duration above 0, such as 24h (unset: only maxCount bounds the savepoints)",
            ));
        }
        if self.savepoint_timeout.is_zero() {
            return Err(spec_invalid(
                "savepointTimeout",
                "expected a duration above 0",
            ));
        }
        // A savepoint waits for a checkpoint in flight, then may take up to
        // checkpoint.timeout itself. An operator that gave up sooner would
        // cancel savepoints the runtime is still allowed to complete.
        let least = self.checkpoint.timeout.get() * 2;
        if self.savepoint_timeout.get() < least {
            return Err(spec_invalid(
                "savepointTimeout",
                format!(
                    "{} is below twice checkpoint.timeout ({}): a savepoint may wait for a checkpoint in flight and then take up to checkpoint.timeout itself; expected at least {}",
                    self.savepoint_timeout,
                    self.checkpoint.timeout,
                    crate::pipeline::HumanDuration::from_millis(least.as_millis() as u64)
                ),
            ));
        }
        Ok(pipeline)
    }
}

/// An error about a field of the spec outside the pipeline.
fn spec_invalid(field: &str, message: impl Into<String>) -> PipelineError {
    PipelineError::Invalid {
        file: "spec".into(),
        line: None,
        field: field.into(),
        message: message.into(),
    }
}

fn invalid(field: &str, message: impl Into<String>) -> PipelineError {
    PipelineError::Invalid {
        file: PIPELINE_ERROR_NAME.into(),
        line: None,
        field: field.into(),
        message: message.into(),
    }
}
