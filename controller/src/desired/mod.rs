//! The objects a StreamJob's run consists of, built purely from the
//! StreamJob, its run and the operator's settings. The reconciler applies
//! them with server-side apply; nothing here talks to the API server.

mod check;
mod pod;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::ByteString;
use kube::{Resource, ResourceExt};
use weir_api::control::{CONTROL_PORT, COORDINATOR_PORT, DATA_PORT};
use weir_api::streamjob::{RunStatus, StreamJob, StreamJobSpec};

use crate::error::{Error, Result};
use crate::names;

pub use check::{check, Refusal};
pub use pod::{default_resources, worker_image, worker_pod, WorkerSettings, DEFAULT_UID, OWNED_ENV, PIPELINE_VOLUME, TLS_DIR, TMP_DIR, TMP_VOLUME, WORKER_CONTAINER, tls_server_name};

/// Labels of every object a job owns.
pub fn job_labels(job: &StreamJob) -> BTreeMap<String, String> {
    BTreeMap::from([
        (names::JOB_LABEL.to_string(), job.name_any()),
        ("app.kubernetes.io/name".to_string(), "weir".to_string()),
        ("app.kubernetes.io/instance".to_string(), job.name_any()),
        ("app.kubernetes.io/managed-by".to_string(), crate::FIELD_MANAGER.to_string()),
    ])
}

/// Owned objects are garbage-collected with the StreamJob.
pub fn owner(job: &StreamJob) -> Result<OwnerReference> {
    job.controller_owner_ref(&()).ok_or_else(|| Error::Build { object: job.name_any(), message: "the StreamJob has no uid yet".into() })
}

fn meta(job: &StreamJob, name: String) -> Result<ObjectMeta> {
    Ok(ObjectMeta {
        name: Some(name),
        namespace: job.namespace(),
        labels: Some(job_labels(job)),
        owner_references: Some(vec![owner(job)?]),
        ..Default::default()
    })
}

/// The pipeline file the workers read (spec.pipeline with the spec's
/// parallelism and checkpoint settings), and the spec it was made from
/// ([`names::SPEC_KEY`], see [`spec_of_config_map`]).
pub fn pipeline_config_map(job: &StreamJob) -> Result<ConfigMap> {
    let build = |e: String| Error::Build { object: names::pipeline_config_map(&job.name_any()), message: e };
    let yaml = job.spec.effective_pipeline_yaml().map_err(|e| build(e.to_string()))?;
    let spec = serde_json::to_string(&job.spec).map_err(|e| build(e.to_string()))?;
    Ok(ConfigMap {
        metadata: meta(job, names::pipeline_config_map(&job.name_any()))?,
        data: Some(BTreeMap::from([(names::PIPELINE_KEY.to_string(), yaml), (names::SPEC_KEY.to_string(), spec)])),
        ..Default::default()
    })
}

/// The StreamJob to build `run`'s objects from, so that a run's pods are
/// always of the spec the run was decided on: `job` when its spec is the
/// run's (by hash), else `job` with the spec the pipeline ConfigMap keeps
/// (`stored`: the last run whose pods were created, which is the spec
/// deployed). A run is decided on another spec than the current one only
/// while the current one is refused ([`crate::lifecycle`] never runs a
/// refused spec). The flag says whether the result's hash is the run's:
/// without a stored spec (a ConfigMap of an older operator) the current
/// spec is all there is.
pub fn job_for_run(job: &StreamJob, run: &RunStatus, stored: Option<StreamJobSpec>, settings: &WorkerSettings) -> (StreamJob, bool) {
    let hash = |j: &StreamJob| crate::spec_hash::spec_hash(&j.spec, worker_image(j, settings).as_deref());
    if hash(job) == run.spec_hash {
        return (job.clone(), true);
    }
    let Some(spec) = stored else { return (job.clone(), false) };
    let mut deployed = job.clone();
    deployed.spec = spec;
    let same = hash(&deployed) == run.spec_hash;
    (deployed, same)
}

/// The last spec that ran healthy, kept in status, when `run` is of it (a
/// rollback's run; see `lifecycle/rollback.rs`).
pub fn stable_spec_of(status: &weir_api::streamjob::StreamJobStatus, run: &RunStatus) -> Option<StreamJobSpec> {
    let stable = status.last_stable_spec.as_ref().filter(|s| s.spec_hash == run.spec_hash)?;
    serde_json::from_str(&stable.spec).ok()
}

/// The spec a pipeline ConfigMap was made from; `None` for one made before
/// the spec was kept there, or one that does not parse.
pub fn spec_of_config_map(cm: &ConfigMap) -> Option<weir_api::streamjob::StreamJobSpec> {
    let text = cm.data.as_ref()?.get(names::SPEC_KEY)?;
    serde_json::from_str(text).ok()
}

/// The Secret holding the job's control token. Created once: the token must
/// not change while workers hold it.
pub fn token_secret(job: &StreamJob, token: &str, settings: &WorkerSettings) -> Result<Secret> {
    Ok(Secret {
        metadata: meta(job, names::token_secret(&job.name_any(), settings.control_key_id.as_deref()))?,
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(names::TOKEN_KEY.to_string(), ByteString(token.as_bytes().to_vec()))])),
        ..Default::default()
    })
}

/// A headless Service over the job's workers: a stable name for people and
/// tools to find the pods. Workers themselves never resolve it.
pub fn workers_service(job: &StreamJob) -> Result<Service> {
    let port = |name: &str, port: u16| ServicePort { name: Some(name.into()), port: port.into(), ..Default::default() };
    Ok(Service {
        metadata: meta(job, names::service(&job.name_any()))?,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(BTreeMap::from([(names::JOB_LABEL.to_string(), job.name_any())])),
            ports: Some(vec![port("control", CONTROL_PORT), port("data", DATA_PORT), port("coordinator", COORDINATOR_PORT)]),
            publish_not_ready_addresses: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Where the operator runs, for the NetworkPolicy that lets only it reach
/// the workers' control port (`--worker-network-policy`).
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkPolicySettings {
    /// The operator's namespace.
    pub namespace: String,
    /// Labels that select the operator's pods there.
    pub pod_labels: BTreeMap<String, String>,
}

/// A NetworkPolicy over the job's workers: their control port (6120) only
/// from the operator's pods, their data and coordinator ports (6121, 6122)
/// only from the job's own workers, nothing else. A NetworkPolicy cannot say
/// "pods with the same label value", so each job gets its own.
pub fn network_policy(job: &StreamJob, settings: &NetworkPolicySettings) -> Result<NetworkPolicy> {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let workers = LabelSelector { match_labels: Some(BTreeMap::from([(names::JOB_LABEL.to_string(), job.name_any())])), ..Default::default() };
    let ports = |ps: &[u16]| -> Vec<NetworkPolicyPort> {
        ps.iter().map(|p| NetworkPolicyPort { port: Some(IntOrString::Int((*p).into())), protocol: Some("TCP".into()), ..Default::default() }).collect()
    };
    let operator = NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([("kubernetes.io/metadata.name".to_string(), settings.namespace.clone())])),
            ..Default::default()
        }),
        pod_selector: Some(LabelSelector { match_labels: Some(settings.pod_labels.clone()), ..Default::default() }),
        ..Default::default()
    };
    let peers = NetworkPolicyPeer { pod_selector: Some(workers.clone()), ..Default::default() };
    Ok(NetworkPolicy {
        metadata: meta(job, names::network_policy(&job.name_any()))?,
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(workers),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule { from: Some(vec![operator]), ports: Some(ports(&[CONTROL_PORT])) },
                NetworkPolicyIngressRule { from: Some(vec![peers]), ports: Some(ports(&[DATA_PORT, COORDINATOR_PORT])) },
            ]),
            ..Default::default()
        }),
    })
}

/// Where a job's checkpoints go: its own directory under the storage URI, so
/// that jobs sharing a storage location never see each other's state.
pub fn state_dir(job: &StreamJob) -> String {
    let base = job.spec.checkpoint.storage.trim_end_matches('/');
    format!("{base}/{}/{}", job.namespace().unwrap_or_else(|| "default".into()), job.name_any())
}

#[cfg(test)]
mod tests;
