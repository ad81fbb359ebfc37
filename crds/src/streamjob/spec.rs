//! `StreamJob.spec`: what the user wants running.
//!
//! The CEL rules here run inside the API server, so a bad manifest is refused
//! at `kubectl apply` with a message naming the field, instead of being
//! accepted and failing later in the controller. What CEL cannot check (the
//! pipeline's inner validity) is [`StreamJobSpec::validate_pipeline`]'s job.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvFromSource, EnvVar, ResourceRequirements, Toleration,
};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::status::StreamJobStatus;
use super::validation::PipelineDocument;
use crate::pipeline::{CheckpointMode, Guarantee, HumanDuration, DEFAULT_MAX_PARALLELISM};

/// The largest `maxParallelism` the runtime accepts (the pipeline format's own bound).
pub const MAX_PARALLELISM_LIMIT: i32 = 32768;

// clippy reads the repeated `type_` of the printcolumn(...) groups as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
/// A streaming job: a pipeline, how many subtasks run it, where its
/// checkpoints go, and how it is upgraded, suspended and recovered.
#[derive(CustomResource, KubeSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "weir.dev",
    version = "v1alpha1",
    kind = "StreamJob",
    namespaced,
    shortname = "sj",
    category = "all",
    status = "StreamJobStatus",
    derive = "PartialEq",
    doc = "A streaming job run by the weir operator: a pipeline, its parallelism, checkpoint storage and lifecycle settings",
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Lifecycle phase"
    ),
    printcolumn(
        name = "Parallelism",
        type_ = "integer",
        json_path = ".spec.parallelism",
        description = "Subtasks per step"
    ),
    printcolumn(
        name = "Checkpoint",
        type_ = "integer",
        json_path = ".status.lastCheckpoint.id",
        description = "Latest completed checkpoint"
    ),
    printcolumn(
        name = "Checkpoint-Age",
        type_ = "date",
        json_path = ".status.lastCheckpoint.time",
        description = "When the latest checkpoint completed"
    ),
    printcolumn(
        name = "Restarts",
        type_ = "integer",
        json_path = ".status.restarts",
        description = "Restarts after failures"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self.parallelism <= self.maxParallelism")
    .message("parallelism must be at most maxParallelism (the number of key groups)")
    .field_path(".parallelism"))]
// The pipeline format has its own parallelism/max_parallelism/checkpoint so that
// `weir run` files are self-contained; in a StreamJob they live in the spec
// (where printer columns and CEL rules can see them). A pasted pipeline may keep
// them only if they agree, so that no value is silently ignored.
#[x_kube(validation = Rule::new("!has(self.pipeline.parallelism) || self.pipeline.parallelism == self.parallelism")
    .message("pipeline.parallelism differs from spec.parallelism: set it once, in spec.parallelism")
    .field_path(".pipeline.parallelism"))]
#[x_kube(validation = Rule::new("!has(self.pipeline.max_parallelism) || self.pipeline.max_parallelism == self.maxParallelism")
    .message("pipeline.max_parallelism differs from spec.maxParallelism: set it once, in spec.maxParallelism")
    .field_path(".pipeline.max_parallelism"))]
#[x_kube(validation = Rule::new("!has(self.pipeline.checkpoint)")
    .message("checkpoint settings of a StreamJob go in spec.checkpoint, not spec.pipeline.checkpoint")
    .field_path(".pipeline.checkpoint"))]
#[serde(rename_all = "camelCase")]
pub struct StreamJobSpec {
    /// The pipeline, in the format `weir run` takes (source, steps, sink; snake_case keys).
    /// Its parallelism and checkpoint settings come from this spec.
    pub pipeline: PipelineDocument,

    /// Container image of the weir worker.
    #[schemars(length(min = 1))]
    pub image: String,

    /// Subtasks per step; between 1 and maxParallelism. A change rescales the job from its state.
    #[serde(default = "default_parallelism")]
    #[schemars(range(min = 1, max = 32768))]
    #[x_kube(validation = Rule::new("self >= 1").message("parallelism must be at least 1"))]
    pub parallelism: i32,

    /// Number of key groups: the upper bound for parallelism. Fixed for the life of the job,
    /// because it decides which key lives in which group of the saved state.
    #[serde(default = "default_max_parallelism")]
    #[schemars(range(min = 1, max = 32768))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 32768").message("maxParallelism must be between 1 and 32768"))]
    #[x_kube(validation = Rule::new("self == oldSelf")
        .message("maxParallelism is immutable: it fixes how state is split into key groups; create a new StreamJob (restored from a savepoint) to change it"))]
    pub max_parallelism: i32,

    /// CPU and memory of each worker container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// ServiceAccount the worker pods run as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,

    /// Extra environment variables of the worker container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,

    /// Environment from ConfigMaps and Secrets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_from: Vec<EnvFromSource>,

    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// Labels added to the worker pods (the operator's own labels win on conflict).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,

    /// Annotations added to the worker pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,

    /// Where and how often checkpoints are taken.
    pub checkpoint: CheckpointSettings,

    /// The delivery guarantee the job must give. The controller refuses to run a
    /// pipeline whose source and sink cannot give it, instead of claiming it.
    /// Unset: whatever the pipeline gives, reported in status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guarantee: Option<Guarantee>,

    /// How a spec change reaches running workers.
    #[serde(default)]
    pub upgrade_mode: UpgradeMode,

    /// Desired state: `suspended` takes a savepoint and stops the pods.
    #[serde(default)]
    pub state: JobState,

    /// Any new value asks for one savepoint, taken without stopping the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub savepoint_trigger: Option<String>,

    /// Any new value asks for one restart from the latest completed checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_trigger: Option<String>,

    /// Savepoint (storage URI or absolute path) the job starts from when it is first
    /// deployed. Later changes are not applied to a running job; status says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new(STORAGE_URI_RULE).message(STORAGE_URI_MESSAGE))]
    pub initial_savepoint: Option<String>,

    /// Start even when some state in the savepoint belongs to no step of the new pipeline
    /// (that state is dropped). Off by default so that a renamed step id does not lose state silently.
    #[serde(default)]
    pub allow_non_restored_state: bool,

    /// Backoff between restarts after failures.
    #[serde(default)]
    pub restart_backoff: RestartBackoff,

    /// Take a final savepoint before the job is deleted (bounded by savepointTimeout;
    /// deletion proceeds without it on timeout, and an event says so).
    #[serde(default = "default_true")]
    pub savepoint_on_delete: bool,

    /// How long to wait for a savepoint (upgrade, suspend, delete) before giving up on it.
    #[serde(default = "default_savepoint_timeout")]
    pub savepoint_timeout: HumanDuration,
}

/// Accepted checkpoint storage locations: `file:///abs/path`, `s3://bucket/prefix`, or
/// a plain absolute path (same as `file://`). Other schemes (gs://, az://, relative
/// paths) are refused rather than failing at the first checkpoint.
pub const STORAGE_URI_RULE: &str =
    "self.startsWith('/') || self.startsWith('file:///') || (self.startsWith('s3://') && size(self) > 5)";
pub const STORAGE_URI_MESSAGE: &str =
    "expected file:///absolute/path, s3://bucket/prefix or an absolute path";

/// Checkpoint settings of a StreamJob (the pipeline format's `checkpoint`, plus storage).
#[derive(KubeSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointSettings {
    /// Time between the start of two checkpoints, e.g. `500ms`, `10s`. `0s` turns periodic checkpoints off.
    #[serde(default = "default_interval")]
    pub interval: HumanDuration,
    #[serde(default)]
    pub mode: CheckpointMode,
    /// A checkpoint not complete after this long is abandoned; the job goes on.
    #[serde(default = "default_checkpoint_timeout")]
    pub timeout: HumanDuration,
    /// Where checkpoints and savepoints are written: file:///path, s3://bucket/prefix or /path.
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new(STORAGE_URI_RULE).message(STORAGE_URI_MESSAGE))]
    pub storage: String,
    /// How many completed checkpoints are kept; older ones are deleted.
    #[serde(default = "default_retain")]
    #[schemars(range(min = 1, max = 1000))]
    pub retain: i32,
}

/// How a spec change reaches the running job.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum UpgradeMode {
    /// Start fresh: state is dropped.
    Stateless,
    /// Take a savepoint, stop, restore the new pods from it. Never falls back to a weaker mode.
    #[default]
    Savepoint,
    /// Stop and restore from the latest completed checkpoint.
    LastState,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    #[default]
    Running,
    Suspended,
}

/// Exponential backoff between restarts after failures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestartBackoff {
    /// Wait before the first restart; doubled after each failure in a row.
    #[serde(default = "default_backoff_initial")]
    pub initial: HumanDuration,
    /// Upper bound of the wait.
    #[serde(default = "default_backoff_max")]
    pub max: HumanDuration,
    /// Restarts in a row (without a checkpoint completing in between) before the job is Failed.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0))]
    pub limit: i32,
}

impl Default for RestartBackoff {
    fn default() -> Self {
        RestartBackoff {
            initial: default_backoff_initial(),
            max: default_backoff_max(),
            limit: default_backoff_limit(),
        }
    }
}

fn default_parallelism() -> i32 {
    1
}

fn default_max_parallelism() -> i32 {
    DEFAULT_MAX_PARALLELISM as i32
}

fn default_true() -> bool {
    true
}

fn default_savepoint_timeout() -> HumanDuration {
    HumanDuration::from_millis(5 * 60_000)
}

// Same defaults as the pipeline format, so that a job behaves the same under `weir run`.
fn default_interval() -> HumanDuration {
    HumanDuration::from_millis(1000)
}

fn default_checkpoint_timeout() -> HumanDuration {
    HumanDuration::from_millis(60_000)
}

fn default_retain() -> i32 {
    3
}

fn default_backoff_initial() -> HumanDuration {
    HumanDuration::from_millis(1000)
}

fn default_backoff_max() -> HumanDuration {
    HumanDuration::from_millis(60_000)
}

fn default_backoff_limit() -> i32 {
    10
}
