//! A worker pod: one per worker index of a run.
//!
//! Three layers, the later winning: the StreamJob's `spec.podTemplate`, its
//! explicit pod fields (`image`, `resources`, `env`, `nodeSelector`, ...),
//! and what the operator must own for the run to work (command and args,
//! ports, the token and run env, the run labels, restartPolicy, owner). The
//! pod is restricted-Pod-Security by default; a template's securityContext
//! fields replace the defaults one by one.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector, Pod, PodSecurityContext, Probe, ResourceRequirements, SeccompProfile, SecretKeySelector, SecretVolumeSource,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use weir_api::control::{CONTROL_PORT, COORDINATOR_PORT, DATA_PORT};
use weir_api::streamjob::{RunStatus, StreamJob, DEFAULT_CPU_REQUEST, DEFAULT_MEMORY_LIMIT, DEFAULT_MEMORY_REQUEST};

use super::{job_labels, owner, state_dir};
use crate::error::{Error, Result};
use crate::names;

/// The container that runs `weir worker`; a template container of this
/// name is merged into it (the Flink operator's convention for its main container).
pub const WORKER_CONTAINER: &str = "worker";
/// The volume of the pipeline ConfigMap, mounted read-only at [`names::PIPELINE_DIR`].
pub const PIPELINE_VOLUME: &str = "weir-pipeline";
/// An emptyDir at [`TMP_DIR`]: the root filesystem is read-only, and
/// libraries expect a writable /tmp. (The worker itself writes only to its
/// checkpoint storage and its sink's directory.)
pub const TMP_VOLUME: &str = "weir-tmp";
pub const TMP_DIR: &str = "/tmp";
/// The UID, GID and fsGroup worker pods run as by default (the images' user).
pub const DEFAULT_UID: i64 = 65532;

/// Environment variables only the operator sets: a template's or the spec's
/// are dropped, so that nobody can shadow the token or the run.
pub const OWNED_ENV: &[&str] = &["POD_IP", "WEIR_CONTROL_TOKEN", "WEIR_RUN_ID"];

/// Operator-wide settings that shape worker pods.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// ServiceAccount of worker pods when the StreamJob names none.
    pub service_account: Option<String>,
    /// The worker image of StreamJobs that name none (`--default-worker-image`).
    pub default_image: Option<String>,
    /// runAsUser, runAsGroup and fsGroup of worker pods; `None`: left to the
    /// platform (OpenShift assigns each namespace its own range).
    pub uid: Option<i64>,
    /// With `Some`, every job gets a NetworkPolicy (see [`super::network_policy`]).
    pub network_policy: Option<super::NetworkPolicySettings>,
    /// The id of the operator's control key ([`crate::control_key::ControlKey::id`]),
    /// which names the job's token Secret.
    pub control_key_id: Option<String>,
    /// Whether the operator trusts a CA for the workers' certificates
    /// (`--worker-ca-file`): without one it cannot call a job with
    /// `spec.tls`, so such a job is refused before any pod starts.
    pub worker_ca: bool,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings { service_account: None, default_image: None, uid: Some(DEFAULT_UID), network_policy: None, control_key_id: None, worker_ca: false }
    }
}

/// Where a worker finds the job's certificate (`spec.tls`).
/// Beside the pipeline's directory, not in it: a mount point inside a
/// ConfigMap volume would have to be made in a read-only directory.
pub const TLS_DIR: &str = "/etc/weir-tls";
const TLS_VOLUME: &str = "weir-tls";

/// The DNS name every worker's certificate must carry: the workers'
/// Service, which peers and the operator check, since they reach pods by IP.
pub fn tls_server_name(job: &StreamJob) -> String {
    format!("{}.{}.svc", names::service(&job.name_any()), job.namespace().unwrap_or_else(|| "default".into()))
}

/// The image the job's workers run: `spec.image`, else the image of the pod
/// template's `worker` container, else the operator's default; `None` when
/// there is none of the three.
pub fn worker_image(job: &StreamJob, settings: &WorkerSettings) -> Option<String> {
    let nonempty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
    nonempty(&job.spec.image)
        .or_else(|| nonempty(&template_worker(job).and_then(|c| c.image)))
        .or_else(|| nonempty(&settings.default_image))
}

fn template_worker(job: &StreamJob) -> Option<Container> {
    job.spec.pod_template.as_ref()?.spec.as_ref()?.containers.iter().find(|c| c.name == WORKER_CONTAINER).cloned()
}

pub fn worker_pod(job: &StreamJob, run: &RunStatus, index: u32, settings: &WorkerSettings) -> Result<Pod> {
    let spec = &job.spec;
    let name = job.name_any();
    let image = worker_image(job, settings).ok_or_else(|| Error::Build {
        object: names::pod(&name, run.number, index),
        message: "no worker image: set spec.image, or install the operator with a default worker image".into(),
    })?;
    let template = spec.pod_template.clone().unwrap_or_default();
    let template_meta = template.metadata.unwrap_or_default();
    let mut pod = template.spec.unwrap_or_default();

    // Template, then the spec's fields, then the operator's labels.
    let mut labels = template_meta.labels.unwrap_or_default();
    labels.extend(spec.pod_labels.clone());
    labels.extend(job_labels(job));
    labels.insert(names::RUN_LABEL.into(), run.id.clone());
    labels.insert(names::WORKER_LABEL.into(), index.to_string());
    let mut annotations = template_meta.annotations.unwrap_or_default();
    annotations.extend(spec.pod_annotations.clone());

    // The worker first (kubectl logs and exec pick the first container),
    // then the template's other containers as sidecars.
    let mut containers = std::mem::take(&mut pod.containers);
    let from_template = containers.iter().position(|c| c.name == WORKER_CONTAINER).map(|i| containers.remove(i));
    let token_secret = names::token_secret(&job.name_any(), settings.control_key_id.as_deref());
    let worker = worker_container(job, run, index, image, from_template.unwrap_or_default(), token_secret);
    let own_tmp = worker.volume_mounts.iter().flatten().any(|m| m.name == TMP_VOLUME);
    containers.insert(0, worker);
    pod.containers = containers;

    let mut volumes = vec![Volume {
        name: PIPELINE_VOLUME.into(),
        config_map: Some(ConfigMapVolumeSource { name: names::pipeline_config_map(&name), ..Default::default() }),
        ..Default::default()
    }];
    if own_tmp {
        volumes.push(Volume { name: TMP_VOLUME.into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() });
    }
    if let Some(tls) = &spec.tls {
        volumes.push(Volume {
            name: TLS_VOLUME.into(),
            secret: Some(SecretVolumeSource { secret_name: Some(tls.secret_name.clone()), optional: Some(false), ..Default::default() }),
            ..Default::default()
        });
    }
    volumes.extend(pod.volumes.take().unwrap_or_default().into_iter().filter(|v| v.name != PIPELINE_VOLUME && v.name != TMP_VOLUME && v.name != TLS_VOLUME));
    pod.volumes = Some(volumes);

    // A worker's exit ends its run; the operator restores the whole job.
    pod.restart_policy = Some("Never".into());
    pod.service_account_name = spec.service_account_name.clone().or(pod.service_account_name).or_else(|| settings.service_account.clone());
    // Workers never call the Kubernetes API (a sidecar that does may ask for a token).
    pod.automount_service_account_token = pod.automount_service_account_token.or(Some(false));
    let mut node_selector = pod.node_selector.take().unwrap_or_default();
    node_selector.extend(spec.node_selector.clone());
    pod.node_selector = (!node_selector.is_empty()).then_some(node_selector);
    let mut tolerations = pod.tolerations.take().unwrap_or_default();
    tolerations.extend(spec.tolerations.iter().cloned());
    pod.tolerations = (!tolerations.is_empty()).then_some(tolerations);
    pod.affinity = avoid_nodes(spec.affinity.clone().or(pod.affinity), &run.avoid_nodes);
    pod.termination_grace_period_seconds = pod.termination_grace_period_seconds.or(Some(10));
    // Workers find each other by IP, never by Service environment variables.
    pod.enable_service_links = pod.enable_service_links.or(Some(false));
    pod.security_context = Some(overlay(restricted_pod_security(settings.uid), pod.security_context.take()));

    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(names::pod(&name, run.number, index)),
            namespace: job.namespace(),
            labels: Some(labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            owner_references: Some(vec![owner(job)?]),
            ..Default::default()
        },
        spec: Some(pod),
        status: None,
    })
}

/// Adds "not on these nodes" to every term of the required node affinity
/// (terms are alternatives, so each must exclude them), or makes it the only
/// term. A requirement: measured, a mere preference lost to the scheduler's
/// resource balancing, which put a new pod on the frozen node, where it never
/// started. If no other node has room, the lifecycle starts the run again
/// without avoiding (`avoidNodesRelaxed`). By field (`metadata.name`), not by
/// the hostname label, which need not equal the node's name.
fn avoid_nodes(affinity: Option<Affinity>, nodes: &[String]) -> Option<Affinity> {
    if nodes.is_empty() {
        return affinity;
    }
    // The API server allows one value per node field requirement: one each.
    let exclude: Vec<NodeSelectorRequirement> =
        nodes.iter().map(|n| NodeSelectorRequirement { key: "metadata.name".into(), operator: "NotIn".into(), values: Some(vec![n.clone()]) }).collect();
    let mut affinity = affinity.unwrap_or_default();
    let node_affinity = affinity.node_affinity.get_or_insert_with(Default::default);
    let required = node_affinity.required_during_scheduling_ignored_during_execution.get_or_insert_with(Default::default);
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(NodeSelectorTerm::default());
    }
    for term in &mut required.node_selector_terms {
        term.match_fields.get_or_insert_with(Vec::new).extend(exclude.iter().cloned());
    }
    Some(affinity)
}

/// The worker container: `base` (the template's `worker` container, or an
/// empty one) with the operator's and the spec's parts put in.
fn worker_container(job: &StreamJob, run: &RunStatus, index: u32, image: String, base: Container, token_secret: String) -> Container {
    let spec = &job.spec;
    let name = job.name_any();
    let mut c = base;
    c.name = WORKER_CONTAINER.into();
    c.image = Some(image);
    // The image's entrypoint (`weir`) runs the operator's arguments.
    c.command = None;
    let mut args = vec![
        "worker".to_string(),
        "--pipeline".into(),
        format!("{}/{}", names::PIPELINE_DIR, names::PIPELINE_KEY),
        "--index".into(),
        index.to_string(),
        // $(POD_IP) is expanded by the kubelet: the worker listens on its own
        // pod IP, which is also what the membership names. The IP alone (the
        // worker adds the standard port): `$(POD_IP):6120` is no address
        // when the pod IP is IPv6.
        "--control-addr".into(),
        "$(POD_IP)".into(),
        "--state-dir".into(),
        state_dir(job),
        "--base-dir".into(),
        names::work_dir(&job.namespace().unwrap_or_else(|| "default".into()), &name),
        // What the sinks' writes carry outside weir (prepared transactions,
        // transactional ids, file names): the pipeline's name alone would be
        // shared by StreamJobs of one name in two namespaces, which would
        // then take each other's transactions for their own.
        "--job-id".into(),
        names::job_id(&job.namespace().unwrap_or_else(|| "default".into()), &name),
    ];
    if let Some(from) = &run.restore_from {
        args.push("--restore".into());
        args.push(from.clone());
    }
    if run.expect_state {
        args.push("--expect-state".into());
    }
    if spec.allow_non_restored_state {
        args.push("--allow-non-restored-state".into());
    }
    if spec.tls.is_some() {
        args.extend(["--tls-dir".into(), TLS_DIR.into(), "--tls-server-name".into(), tls_server_name(job)]);
    }
    c.args = Some(args);
    let port = |name: &str, port: u16| ContainerPort { name: Some(name.into()), container_port: port.into(), protocol: Some("TCP".into()), ..Default::default() };
    c.ports = Some(vec![port("control", CONTROL_PORT), port("data", DATA_PORT), port("coordinator", COORDINATOR_PORT)]);
    c.env = Some(worker_env(job, run, c.env.take().unwrap_or_default(), token_secret));
    let mut env_from = c.env_from.take().unwrap_or_default();
    env_from.extend(spec.env_from.iter().cloned());
    c.env_from = (!env_from.is_empty()).then_some(env_from);
    c.resources = [spec.resources.clone(), c.resources.take()].into_iter().flatten().find(|r| !is_empty(r)).or_else(|| Some(default_resources()));
    c.readiness_probe = Some(Probe {
        // With TLS the kubelet probes over HTTPS (it checks no certificate).
        http_get: Some(HTTPGetAction {
            path: Some("/healthz".into()),
            port: IntOrString::Int(CONTROL_PORT.into()),
            scheme: spec.tls.as_ref().map(|_| "HTTPS".into()),
            ..Default::default()
        }),
        period_seconds: Some(2),
        ..Default::default()
    });
    // The pipeline at /etc/weir is the operator's; /tmp is an emptyDir unless
    // the template mounts something there itself (a bigger or memory-backed one).
    let theirs: Vec<VolumeMount> = c
        .volume_mounts
        .take()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.mount_path.trim_end_matches('/') != names::PIPELINE_DIR && m.name != PIPELINE_VOLUME && m.name != TMP_VOLUME && m.name != TLS_VOLUME && m.mount_path.trim_end_matches('/') != TLS_DIR)
        .collect();
    let mut mounts = vec![VolumeMount { name: PIPELINE_VOLUME.into(), mount_path: names::PIPELINE_DIR.into(), read_only: Some(true), ..Default::default() }];
    if spec.tls.is_some() {
        mounts.push(VolumeMount { name: TLS_VOLUME.into(), mount_path: TLS_DIR.into(), read_only: Some(true), ..Default::default() });
    }
    if !theirs.iter().any(|m| m.mount_path.trim_end_matches('/') == TMP_DIR) {
        mounts.push(VolumeMount { name: TMP_VOLUME.into(), mount_path: TMP_DIR.into(), ..Default::default() });
    }
    mounts.extend(theirs);
    c.volume_mounts = Some(mounts);
    c.security_context = Some(overlay(restricted_container_security(), c.security_context.take()));
    // The worker is the main container, never a (native) sidecar.
    c.restart_policy = None;
    c
}

/// The worker's environment: the operator's variables first (so that later
/// ones can refer to `$(POD_IP)`), then the template's, replaced on the same
/// name by the spec's. `OWNED_ENV` names from either are dropped.
fn worker_env(job: &StreamJob, run: &RunStatus, template: Vec<EnvVar>, token_secret: String) -> Vec<EnvVar> {
    let mut user: Vec<EnvVar> = Vec::new();
    for e in template.into_iter().chain(job.spec.env.iter().cloned()) {
        if OWNED_ENV.contains(&e.name.as_str()) {
            continue;
        }
        match user.iter_mut().find(|u| u.name == e.name) {
            Some(existing) => *existing = e,
            None => user.push(e),
        }
    }
    let mut env = vec![
        EnvVar {
            name: "POD_IP".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector { field_path: "status.podIP".into(), ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        },
        EnvVar {
            name: "WEIR_CONTROL_TOKEN".into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector { name: token_secret, key: names::TOKEN_KEY.into(), optional: Some(false) }),
                ..Default::default()
            }),
            ..Default::default()
        },
        EnvVar { name: "WEIR_RUN_ID".into(), value: Some(run.id.clone()), ..Default::default() },
    ];
    env.extend(s3_env(job).into_iter().filter(|e| !user.iter().any(|u| u.name == e.name)));
    // JSON logs unless the user says otherwise.
    if !user.iter().any(|e| e.name == "WEIR_LOG_JSON") {
        env.push(EnvVar { name: "WEIR_LOG_JSON".into(), value: Some("1".into()), ..Default::default() });
    }
    env.extend(user);
    env
}

/// Where `s3://` storage is (WEIR_S3_*) and the credentials from the Secret
/// the job names (AWS_*, by reference: the operator never reads the Secret).
/// Only for `s3://` storage or a file sink writing to `s3://` (one S3 server
/// for both); variables the user sets come after and win.
fn s3_env(job: &StreamJob) -> Vec<EnvVar> {
    let s3_output = job.spec.pipeline.0.pointer("/sink/file/path").and_then(|p| p.as_str()).is_some_and(|p| p.starts_with("s3://"));
    let Some(s3) = job.spec.checkpoint.s3.as_ref().filter(|_| job.spec.checkpoint.storage.starts_with("s3://") || s3_output) else {
        return Vec::new();
    };
    let value = |name: &str, v: String| EnvVar { name: name.into(), value: Some(v), ..Default::default() };
    let mut env = Vec::new();
    if let Some(e) = &s3.endpoint {
        env.push(value("WEIR_S3_ENDPOINT", e.clone()));
    }
    if let Some(r) = &s3.region {
        env.push(value("WEIR_S3_REGION", r.clone()));
    }
    env.push(value("WEIR_S3_PATH_STYLE", s3.path_style.to_string()));
    if let Some(secret) = &s3.credentials_secret {
        for key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
            env.push(EnvVar {
                name: key.into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector { name: secret.clone(), key: key.into(), optional: Some(false) }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    env
}

fn is_empty(r: &ResourceRequirements) -> bool {
    r.limits.as_ref().is_none_or(BTreeMap::is_empty) && r.requests.as_ref().is_none_or(BTreeMap::is_empty) && r.claims.as_ref().is_none_or(Vec::is_empty)
}

/// Resources of a worker whose job gives none (see weir_api's defaults).
pub fn default_resources() -> ResourceRequirements {
    let q = |s: &str| Quantity(s.into());
    ResourceRequirements {
        requests: Some(BTreeMap::from([("cpu".into(), q(DEFAULT_CPU_REQUEST)), ("memory".into(), q(DEFAULT_MEMORY_REQUEST))])),
        limits: Some(BTreeMap::from([("memory".into(), q(DEFAULT_MEMORY_LIMIT))])),
        ..Default::default()
    }
}

/// The pod part of the restricted Pod Security Standard, with the images'
/// numeric user (`uid`; `None`: the platform assigns one).
fn restricted_pod_security(uid: Option<i64>) -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: uid,
        run_as_group: uid,
        // Volumes that support it (a PVC's, an emptyDir) are made writable for the group.
        fs_group: uid,
        seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..Default::default() }),
        ..Default::default()
    }
}

/// The container part of the restricted Pod Security Standard.
fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), ..Default::default() }),
        read_only_root_filesystem: Some(true),
        ..Default::default()
    }
}

/// `defaults` with every field `theirs` sets replaced by theirs (one level
/// deep: a template's `seccompProfile` replaces the default one whole).
fn overlay<T: Serialize + DeserializeOwned + Clone>(defaults: T, theirs: Option<T>) -> T {
    let Some(theirs) = theirs else { return defaults };
    let (Ok(serde_json::Value::Object(mut base)), Ok(serde_json::Value::Object(top))) = (serde_json::to_value(&defaults), serde_json::to_value(&theirs)) else {
        return theirs;
    };
    for (k, v) in top {
        if !v.is_null() {
            base.insert(k, v);
        }
    }
    serde_json::from_value(serde_json::Value::Object(base)).unwrap_or(theirs)
}
