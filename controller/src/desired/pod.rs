//! A worker pod: one per worker index of a run.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector, Pod, PodSpec, Probe,
    SecretKeySelector, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use weir_api::control::{CONTROL_PORT, COORDINATOR_PORT, DATA_PORT};
use weir_api::streamjob::{RunStatus, StreamJob};

use super::{job_labels, owner, state_dir};
use crate::error::Result;
use crate::names;

/// Operator-wide settings that shape worker pods.
#[derive(Debug, Clone, Default)]
pub struct WorkerSettings {
    /// ServiceAccount of worker pods when the StreamJob names none.
    pub service_account: Option<String>,
}

pub fn worker_pod(job: &StreamJob, run: &RunStatus, index: u32, settings: &WorkerSettings) -> Result<Pod> {
    let spec = &job.spec;
    let name = job.name_any();
    // The user's labels first, so that the operator's own win on conflict.
    let mut labels: BTreeMap<String, String> = spec.pod_labels.clone();
    labels.extend(job_labels(job));
    labels.insert(names::RUN_LABEL.into(), run.id.clone());
    labels.insert(names::WORKER_LABEL.into(), index.to_string());

    let mut args = vec![
        "worker".to_string(),
        "--pipeline".into(),
        format!("{}/{}", names::PIPELINE_DIR, names::PIPELINE_KEY),
        "--index".into(),
        index.to_string(),
        // $(POD_IP) is expanded by the kubelet: the worker listens on its own
        // pod IP, which is also what the membership names.
        "--control-addr".into(),
        format!("$(POD_IP):{CONTROL_PORT}"),
        "--state-dir".into(),
        state_dir(job),
        "--base-dir".into(),
        names::work_dir(&job.namespace().unwrap_or_else(|| "default".into()), &name),
    ];
    if let Some(from) = &run.restore_from {
        args.push("--restore".into());
        args.push(from.clone());
    }
    if spec.allow_non_restored_state {
        args.push("--allow-non-restored-state".into());
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
                secret_key_ref: Some(SecretKeySelector { name: names::token_secret(&name), key: names::TOKEN_KEY.into(), optional: Some(false) }),
                ..Default::default()
            }),
            ..Default::default()
        },
        EnvVar { name: "WEIR_LOG_JSON".into(), value: Some("1".into()), ..Default::default() },
        EnvVar { name: "WEIR_RUN_ID".into(), value: Some(run.id.clone()), ..Default::default() },
    ];
    // The operator's variables come first so that a user's cannot shadow the token.
    env.extend(spec.env.iter().filter(|e| !matches!(e.name.as_str(), "POD_IP" | "WEIR_CONTROL_TOKEN" | "WEIR_RUN_ID")).cloned());

    let port = |name: &str, port: u16| ContainerPort { name: Some(name.into()), container_port: port.into(), ..Default::default() };
    let container = Container {
        name: "worker".into(),
        image: Some(spec.image.clone()),
        args: Some(args),
        env: Some(env),
        env_from: (!spec.env_from.is_empty()).then(|| spec.env_from.clone()),
        ports: Some(vec![port("control", CONTROL_PORT), port("data", DATA_PORT), port("coordinator", COORDINATOR_PORT)]),
        resources: spec.resources.clone(),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction { path: Some("/healthz".into()), port: IntOrString::Int(CONTROL_PORT.into()), ..Default::default() }),
            period_seconds: Some(2),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount { name: "pipeline".into(), mount_path: names::PIPELINE_DIR.into(), read_only: Some(true), ..Default::default() }]),
        ..Default::default()
    };
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(names::pod(&name, run.number, index)),
            namespace: job.namespace(),
            labels: Some(labels),
            annotations: (!spec.pod_annotations.is_empty()).then(|| spec.pod_annotations.clone()),
            owner_references: Some(vec![owner(job)?]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            // A worker's exit ends its run; the operator restores the whole job.
            restart_policy: Some("Never".into()),
            service_account_name: spec.service_account_name.clone().or_else(|| settings.service_account.clone()),
            // Workers never call the Kubernetes API.
            automount_service_account_token: Some(false),
            node_selector: (!spec.node_selector.is_empty()).then(|| spec.node_selector.clone()),
            tolerations: (!spec.tolerations.is_empty()).then(|| spec.tolerations.clone()),
            affinity: spec.affinity.clone(),
            termination_grace_period_seconds: Some(10),
            volumes: Some(vec![Volume {
                name: "pipeline".into(),
                config_map: Some(ConfigMapVolumeSource { name: names::pipeline_config_map(&name), ..Default::default() }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    })
}
