//! `StreamJob.spec`: what the user wants running.
//!
//! The CEL rules here run inside the API server, so a bad manifest is refused
//! at `kubectl apply` with a message naming the field, instead of being
//! accepted and failing later in the controller. What CEL cannot check (the
//! pipeline's inner validity) is [`StreamJobSpec::validate_pipeline`]'s job.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvFromSource, EnvVar, PodTemplateSpec, ResourceRequirements, Toleration,
};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::status::StreamJobStatus;
use super::validation::PipelineDocument;
use crate::pipeline::{CheckpointMode, Guarantee, HumanDuration, DEFAULT_MAX_PARALLELISM};

/// The largest `maxParallelism` the runtime accepts (the pipeline format's own bound).
pub const MAX_PARALLELISM_LIMIT: i32 = 32768;

/// The longest StreamJob name: the operator names the job's headless Service
/// `<name>-workers`, and a Service name is a DNS-1035 label of at most 63
/// characters. Every other derived name is longer-lived in a roomier format
/// (`<name>-pipeline`, `<name>-operator-token-<key id>`, pods `<name>-<run>-<index>`:
/// DNS subdomains of up to 253), and the name is also a label value (63).
pub const MAX_NAME_LENGTH: usize = 63 - "-workers".len();

/// The CEL rules on `metadata.name` (root of the CRD schema).
pub const NAME_LENGTH_RULE: &str = "size(self.metadata.name) <= 55";
pub const NAME_LENGTH_MESSAGE: &str = "metadata.name must be at most 55 characters: the operator names the job's Service <name>-workers (at most 63) and labels its pods weir.dev/job=<name>";
pub const NAME_SYNTAX_RULE: &str = "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')";
pub const NAME_SYNTAX_MESSAGE: &str = "metadata.name must consist of lowercase letters, digits and '-', start with a letter and end with a letter or digit (a DNS-1035 label): it names the job's Service <name>-workers";

/// The same checks as the CEL rules on `metadata.name`, for the controller
/// (a StreamJob created before the CRD had them, or by a test).
pub fn check_job_name(name: &str) -> Result<(), String> {
    if name.len() > MAX_NAME_LENGTH {
        return Err(format!("{NAME_LENGTH_MESSAGE}; {name:?} has {}", name.len()));
    }
    let bytes = name.as_bytes();
    let syntax = bytes.first().is_some_and(u8::is_ascii_lowercase)
        && bytes.last().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-');
    if !syntax {
        return Err(format!("{NAME_SYNTAX_MESSAGE}; got {name:?}"));
    }
    Ok(())
}

/// The worker container's resources when neither `spec.resources` nor the pod
/// template's `worker` container sets any: small requests, so that a job of a
/// few workers fits a small cluster, and a memory limit, so that a runaway
/// worker is killed and restored instead of starving its node. (Pods without
/// requests are BestEffort, the first to be evicted under pressure.)
pub const DEFAULT_CPU_REQUEST: &str = "100m";
pub const DEFAULT_MEMORY_REQUEST: &str = "256Mi";
pub const DEFAULT_MEMORY_LIMIT: &str = "1Gi";

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
// On the root, where CEL sees metadata.name. No fieldPath: the API server
// accepts only paths into the schema, which does not describe metadata.
#[kube(validation = Rule::new(NAME_LENGTH_RULE).message(NAME_LENGTH_MESSAGE))]
#[kube(validation = Rule::new(NAME_SYNTAX_RULE).message(NAME_SYNTAX_MESSAGE))]
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
    /// The pipeline, in the format `weir run` takes (source, steps, sink, or a graph's sources, steps, sinks; snake_case keys).
    /// Its parallelism and checkpoint settings come from this spec.
    pub pipeline: PipelineDocument,

    /// Container image of the weir worker. Default: the image the operator was
    /// installed with (the chart's workerImage, `--default-worker-image`), or the
    /// image of the pod template's `worker` container. A job with none of the three
    /// is not started; its status says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub image: Option<String>,

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

    /// CPU and memory of each worker container (core/v1 ResourceRequirements).
    /// Wins over the pod template's `worker` container resources. When neither
    /// sets any: requests cpu 100m and memory 256Mi, limit memory 1Gi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::k8s_schema::without_docs::<ResourceRequirements>")]
    pub resources: Option<ResourceRequirements>,

    /// ServiceAccount the worker pods run as (wins over the pod template's;
    /// default: the operator's --worker-service-account, else the namespace's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,

    /// Extra environment variables of the worker container (core/v1 EnvVar); on the
    /// same name they win over the pod template's. POD_IP, WEIR_CONTROL_TOKEN and
    /// WEIR_RUN_ID are the operator's and cannot be set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::k8s_schema::list_without_docs::<EnvVar>")]
    pub env: Vec<EnvVar>,

    /// Environment of the worker container from ConfigMaps and Secrets (core/v1
    /// EnvFromSource), after the pod template's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::k8s_schema::list_without_docs::<EnvFromSource>")]
    pub env_from: Vec<EnvFromSource>,

    /// Node labels the worker pods need; on the same key they win over the pod template's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Tolerations of the worker pods (core/v1 Toleration), added to the pod template's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::k8s_schema::list_without_docs::<Toleration>")]
    pub tolerations: Vec<Toleration>,

    /// Affinity of the worker pods (core/v1 Affinity); replaces the pod template's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::k8s_schema::without_docs::<Affinity>")]
    pub affinity: Option<Affinity>,

    /// Labels added to the worker pods; on the same key they win over the pod
    /// template's, and the operator's own labels win over both.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,

    /// Annotations added to the worker pods; on the same key they win over the pod template's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,

    /// A core/v1 PodTemplateSpec merged over the operator's worker pod, as in the
    /// Flink operator: labels and annotations; the pod's nodeSelector, tolerations,
    /// affinity, topologySpreadConstraints, priorityClassName, imagePullSecrets,
    /// securityContext, volumes, initContainers, and containers. The container named
    /// `worker` is merged into the worker container (its securityContext, env,
    /// envFrom, volumeMounts, resources, image, probes other than readiness); any other
    /// container is added as a sidecar, as written.
    ///
    /// The operator's part wins: the worker's command (the image's entrypoint) and
    /// args, its ports (6120 control, 6121 data, 6122 coordinator) and readiness
    /// probe, the env POD_IP, WEIR_CONTROL_TOKEN and WEIR_RUN_ID (and the job id
    /// `<namespace>_<name>` the sinks' writes carry), the volumes
    /// weir-pipeline and weir-tmp and the mount /etc/weir, the labels weir.dev/job,
    /// weir.dev/run, weir.dev/worker and app.kubernetes.io/{name,instance,managed-by},
    /// the pod's name, namespace, owner, and restartPolicy Never. The explicit spec
    /// fields above (image, resources, env, envFrom, nodeSelector, tolerations,
    /// affinity, podLabels, podAnnotations, serviceAccountName) win over the template.
    ///
    /// Security: without a template the pod meets the restricted Pod Security
    /// Standard (non-root UID/GID/fsGroup 65532, seccomp RuntimeDefault, read-only root
    /// filesystem, no privilege escalation, all capabilities dropped, an emptyDir at
    /// /tmp). A template's securityContext fields replace those defaults one by one;
    /// containers you add must meet the namespace's Pod Security level themselves.
    ///
    /// Storage: with `file://` (or plain path) checkpoint storage, or a file sink,
    /// every worker must see the same files, also after a pod moves to another node:
    /// the storage directory and the sink's directory (relative sink paths resolve
    /// under /var/lib/weir/jobs/<namespace>/<name>) must be on a volume mounted into
    /// the `worker` container that outlives the pod (a persistentVolumeClaim, usually
    /// ReadWriteMany; nfs, csi, hostPath and other non-ephemeral volumes count;
    /// emptyDir, ephemeral, configMap, secret, downwardAPI and projected do not). One
    /// PVC mounted at /var/lib/weir covers the storage file:///var/lib/weir/checkpoints
    /// and every relative sink path. A job without such a volume is not started; its
    /// status says what to add.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::k8s_schema::pod_template")]
    pub pod_template: Option<PodTemplateSpec>,

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

    /// How long a new run (first deploy, upgrade, recovery) may take to come up
    /// (pods scheduled and started, every worker joined) before the job is
    /// Failed with reason `DeployTimeout`: a volume claim that never binds, an
    /// image that never arrives or workers the operator cannot reach are
    /// reported, not waited for forever. Until then status says what the run
    /// waits for and when the deadline is.
    #[serde(default = "default_deploy_timeout")]
    pub deploy_timeout: HumanDuration,

    /// What happens to an upgrade (a spec change that needs new pods) whose
    /// new spec does not become healthy: `rollback`.
    #[serde(default)]
    pub upgrade: UpgradeSettings,

    /// Periodic savepoints, and how long the operator keeps the savepoints
    /// it took (periodic, requested, upgrade and suspend ones) before it
    /// disposes of them. Never forever: by default the newest 10 are kept.
    #[serde(default)]
    pub savepoints: SavepointSettings,

    /// TLS on the job's own connections: mutual TLS between its workers
    /// (data and coordinator connections) and HTTPS on their control
    /// endpoint, which the operator calls. Unset: plain TCP inside the
    /// cluster (each connection still proves it belongs to the run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<WorkerTls>,
}

/// `spec.tls`: where the job's certificate is. The operator checks the
/// workers' certificate against the CA it was installed with (the chart's
/// `workerTls.caConfigMap`), so it reads no Secret of the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerTls {
    /// A Secret in the job's namespace with `tls.crt`, `tls.key` and
    /// `ca.crt`, as cert-manager writes it, mounted into every worker. The
    /// certificate must carry the DNS name `<job>-workers.<namespace>.svc`
    /// and allow server and client authentication (or name no extended key
    /// usage at all); `ca.crt` is the CA the workers check each other's
    /// certificate against.
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"))]
    pub secret_name: String,
}

/// The most savepoints `spec.savepoints.maxCount` may keep.
pub const MAX_SAVEPOINT_COUNT: i32 = 100;

/// `spec.savepoints`, as the Flink operator's
/// `kubernetes.operator.periodic.savepoint.interval` and
/// `kubernetes.operator.savepoint.history.max.count` / `max.age`. Disposing
/// of a savepoint deletes its directory in checkpoint storage and what it
/// alone still held outside storage (prepared PostgreSQL transactions, log
/// entries of the write-ahead-log and Kafka sinks). The newest savepoint
/// and the one the current run restores from are never disposed of. A
/// savepoint is disposed of by the job's running coordinator, so a job
/// that is suspended or finished keeps its savepoints until it runs again
/// (or is deleted: then they are the user's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SavepointSettings {
    /// Take a savepoint this long after the latest one (or after the run
    /// started), without stopping the job. Unset: no periodic savepoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<HumanDuration>,
    /// Keep at most this many savepoints; older ones are disposed of.
    #[serde(default = "default_max_savepoints")]
    #[schemars(range(min = 1, max = MAX_SAVEPOINT_COUNT))]
    pub max_count: i32,
    /// Dispose of savepoints older than this (the newest is always kept).
    /// Unset: only maxCount bounds them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<HumanDuration>,
}

impl Default for SavepointSettings {
    fn default() -> Self {
        SavepointSettings { interval: None, max_count: default_max_savepoints(), max_age: None }
    }
}

fn default_max_savepoints() -> i32 {
    10
}

/// Settings of upgrades beyond `upgradeMode`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeSettings {
    /// Rolling back an upgrade whose new spec does not become healthy, as the
    /// Flink operator's `kubernetes.operator.deployment.rollback.enabled`.
    #[serde(default)]
    pub rollback: RollbackSettings,
}

/// `spec.upgrade.rollback`: an upgrade of a running job whose new spec does
/// not become healthy (every worker running and its first checkpoint
/// completed) within `readinessTimeout`, or fails in a way a restart does
/// not fix, is rolled back once to the last spec that ran healthy, restored
/// from the upgrade's savepoint (upgradeMode savepoint), the latest completed
/// checkpoint (last-state) or nothing (stateless). The new generation is not
/// tried again until the spec changes (a new metadata.generation); status
/// says `RolledBack` and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackSettings {
    /// Off by default: a new spec that does not become healthy is restarted
    /// with backoff and fails by deployTimeout or restartBackoff.limit.
    #[serde(default)]
    pub enabled: bool,
    /// How long the new spec has, from the moment its upgrade stops the old
    /// pods, to run every worker and complete its first checkpoint (a job
    /// that takes no checkpoints: to run every worker).
    #[serde(default = "default_readiness_timeout")]
    pub readiness_timeout: HumanDuration,
}

impl Default for RollbackSettings {
    fn default() -> Self {
        RollbackSettings { enabled: false, readiness_timeout: default_readiness_timeout() }
    }
}

/// Accepted checkpoint storage locations: `file:///abs/path`, a plain
/// absolute path (same as `file://`), or a prefix in an object store
/// (`s3://`, `gs://`, `az://`, `abfs[s]://`; see `object_store_url`). Other
/// schemes and relative paths are refused rather than failing at the first
/// checkpoint.
pub const STORAGE_URI_RULE: &str = r"self.startsWith('/') || self.startsWith('file:///') || self.matches('^(s3|gs|az|abfss?)://[^/?#@:]+(/[^?#]*)?$') || self.matches('^abfss?://[^/?#@:.]+@[a-z0-9]+[.](dfs|blob)[.]core[.]windows[.]net(/[^?#]*)?$')";
pub const STORAGE_URI_MESSAGE: &str =
    "expected file:///absolute/path, an absolute path, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX";

/// Checkpoint settings of a StreamJob (the pipeline format's `checkpoint`, plus storage).
#[derive(KubeSchema, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointSettings {
    /// Time between the start of two checkpoints, e.g. `500ms`, `10s`. `0s` turns periodic checkpoints off.
    #[serde(default = "default_interval")]
    pub interval: HumanDuration,
    #[serde(default)]
    pub mode: CheckpointMode,
    /// With `mode: aligned`: a subtask still aligning a checkpoint this long after it started
    /// takes it unaligned (its in-flight records go into the checkpoint). Unset: always aligned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alignment_timeout: Option<HumanDuration>,
    /// Running aggregates write only the keys that changed since their last checkpoint,
    /// into files checkpoints share under <storage>/<namespace>/<name>/shared/ (deleted
    /// when no retained checkpoint names them). Savepoints are always whole.
    #[serde(default)]
    pub incremental: bool,
    /// A checkpoint not complete after this long is abandoned; the job goes on.
    #[serde(default = "default_checkpoint_timeout")]
    pub timeout: HumanDuration,
    /// Where checkpoints and savepoints are written: file:///path, /path, s3://bucket/prefix,
    /// gs://bucket/prefix or az://container/prefix (the last two take their account and
    /// credentials from the standard variables of each cloud, set in spec.env).
    /// Each job writes under <storage>/<namespace>/<name>. A file:// or plain path must be
    /// on a volume every worker mounts and that outlives a pod (a PersistentVolumeClaim in
    /// spec.podTemplate, e.g. mounted at /var/lib/weir for file:///var/lib/weir/checkpoints);
    /// a job without one is not started, and its status says what to add.
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new(STORAGE_URI_RULE).message(STORAGE_URI_MESSAGE))]
    pub storage: String,
    /// How many completed checkpoints are kept; older ones are deleted.
    #[serde(default = "default_retain")]
    #[schemars(range(min = 1, max = 1000))]
    pub retain: i32,
    /// Where the S3 server of `s3://` storage (and of a file sink writing to `s3://`) is and where credentials come from.
    /// Unset: AWS S3, with credentials from the pod's environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Storage>,
    /// A running job that completes no checkpoint for this long (counted from
    /// its last completed checkpoint, or from the start of its run) is stuck:
    /// it is Degraded after half of it and restarted from the latest
    /// completed checkpoint after all of it. Unset: 20 intervals or 2
    /// timeouts, whichever is longer; no limit when the interval is `0s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_timeout: Option<HumanDuration>,
}

impl CheckpointSettings {
    /// How long a running job may go without a completed checkpoint;
    /// `None` when periodic checkpoints are off.
    pub fn progress_limit(&self) -> Option<std::time::Duration> {
        if self.interval.get().is_zero() {
            return None;
        }
        Some(match self.progress_timeout {
            Some(t) => t.get(),
            None => (self.interval.get() * 20).max(self.timeout.get() * 2),
        })
    }
}

/// The S3 (or S3-compatible: MinIO, Ceph, R2) server of `s3://` checkpoint storage.
/// Workers get these as WEIR_S3_* variables; credentials never leave the Secret
/// except as the worker container's AWS_* variables.
#[derive(KubeSchema, Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct S3Storage {
    /// The server's URL, e.g. `http://minio.storage.svc:9000`. Unset: AWS S3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    #[x_kube(validation = Rule::new(S3_ENDPOINT_RULE).message(S3_ENDPOINT_MESSAGE))]
    pub endpoint: Option<String>,
    /// The region requests are signed for. Unset: AWS_REGION of the pod, then us-east-1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9-]+$"))]
    pub region: Option<String>,
    /// Path-style requests (`http://host/bucket/key`, what MinIO expects); false for
    /// virtual-hosted style (`http://bucket.host/key`).
    #[serde(default = "default_true")]
    pub path_style: bool,
    /// A Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY, given to the worker container as those variables. Unset:
    /// credentials come from the pod's environment (a web identity token for
    /// IRSA-style roles, or variables in spec.env / spec.podTemplate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub credentials_secret: Option<String>,
}

pub const S3_ENDPOINT_RULE: &str =
    "self.matches('^https?://[^/?#]+/?$')";
pub const S3_ENDPOINT_MESSAGE: &str =
    "expected http://HOST[:PORT] or https://HOST[:PORT], without a path (the bucket belongs in storage: s3://bucket/prefix)";

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

/// Long enough for a large image pulled over a slow link and a volume
/// attached by a cloud provider; short enough that a stuck job is noticed.
pub const DEFAULT_DEPLOY_TIMEOUT_MS: u64 = 10 * 60_000;

fn default_deploy_timeout() -> HumanDuration {
    HumanDuration::from_millis(DEFAULT_DEPLOY_TIMEOUT_MS)
}

/// As the Flink operator's `kubernetes.operator.deployment.readiness.timeout`.
pub const DEFAULT_READINESS_TIMEOUT_MS: u64 = 5 * 60_000;

fn default_readiness_timeout() -> HumanDuration {
    HumanDuration::from_millis(DEFAULT_READINESS_TIMEOUT_MS)
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
