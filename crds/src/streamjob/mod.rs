//! The `StreamJob` custom resource (`weir.dev/v1alpha1`): the operator's API.
//!
//! - `spec.rs`: what the user wants (and the CEL rules the API server enforces),
//! - `status.rs`: what the controller observed,
//! - `validation.rs`: the embedded pipeline and the checks CEL cannot do.
//!
//! `crds/streamjob.yaml` is generated from these types by `crdgen`; a test
//! fails when it is out of date.

mod k8s_schema;
mod spec;
mod status;
mod validation;

use kube::CustomResourceExt;

pub use spec::{
    check_job_name, CheckpointSettings, JobState, RestartBackoff, RollbackSettings, StreamJob,
    SavepointSettings, StreamJobSpec, UpgradeMode, UpgradeSettings, WorkerTls, MAX_SAVEPOINT_COUNT, DEFAULT_READINESS_TIMEOUT_MS, DEFAULT_CPU_REQUEST, DEFAULT_MEMORY_LIMIT, DEFAULT_MEMORY_REQUEST,
    MAX_NAME_LENGTH, MAX_PARALLELISM_LIMIT, NAME_LENGTH_MESSAGE, NAME_LENGTH_RULE,
    NAME_SYNTAX_MESSAGE, NAME_SYNTAX_RULE, S3Storage, S3_ENDPOINT_MESSAGE, S3_ENDPOINT_RULE,
    STORAGE_URI_MESSAGE, STORAGE_URI_RULE,
};
pub use status::{
    condition_types, ready_reasons, CheckpointRef, Failure, PendingSavepoint, Phase, RollbackRecord, RunStatus,
    SavepointReason, SavepointRef, StableSpec, StreamJobStatus, UpgradeTrial, SAVEPOINT_HISTORY_LIMIT,
};
pub use validation::{PipelineDocument, PIPELINE_ERROR_NAME};

/// The command that regenerates the checked-in CRD manifest.
pub const REGENERATE: &str = "cargo run -p weir-api --bin crdgen > crds/streamjob.yaml";

/// The CRD manifest as YAML, exactly as checked in at `crds/streamjob.yaml`.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(&StreamJob::crd())?;
    Ok(format!(
        "# Generated from crds/src/streamjob by `{REGENERATE}`. Do not edit.\n{body}"
    ))
}

#[cfg(test)]
mod tests;
