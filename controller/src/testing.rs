//! Builders for test objects: a StreamJob with sensible defaults, pods in a
//! given state, and what a coordinator answers.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus, Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use weir_api::streamjob::{StreamJob, StreamJobSpec, StreamJobStatus};

use crate::names;

pub struct JobBuilder {
    job: StreamJob,
}

impl JobBuilder {
    pub fn new(name: &str) -> JobBuilder {
        let spec: StreamJobSpec = serde_json::from_value(serde_json::json!({
            "image": "weir",
            "parallelism": 2,
            "checkpoint": {"storage": "file:///var/lib/weir/checkpoints", "interval": "500ms"},
            "pipeline": {
                "name": name,
                "source": {"generator": {"events": 1000, "keys": 10}},
                "steps": [{"key_by": "key"}, {"running_count": "count"}],
                "sink": {"file": {"path": "out", "format": "jsonl"}},
            },
            // Shared storage for the checkpoints and the sink's files, as a
            // file:// job needs (see desired::check).
            "podTemplate": {"spec": {
                "volumes": [{"name": "weir-data", "persistentVolumeClaim": {"claimName": "weir-data"}}],
                "containers": [{"name": "worker", "volumeMounts": [{"name": "weir-data", "mountPath": "/var/lib/weir"}]}],
            }},
        }))
        .expect("the test spec is valid");
        let mut job = StreamJob::new(name, spec);
        job.metadata = ObjectMeta {
            name: Some(name.into()),
            namespace: Some("jobs".into()),
            uid: Some("0123456789abcdef".into()),
            generation: Some(1),
            finalizers: Some(vec![names::FINALIZER.into()]),
            ..Default::default()
        };
        JobBuilder { job }
    }

    /// The spec's pod template, edited as JSON.
    pub fn pod_template(mut self, f: impl FnOnce(&mut serde_json::Value)) -> JobBuilder {
        let mut value = serde_json::to_value(&self.job.spec.pod_template).expect("a template serializes");
        f(&mut value);
        self.job.spec.pod_template = serde_json::from_value(value).expect("a pod template");
        self
    }

    pub fn spec(mut self, f: impl FnOnce(&mut StreamJobSpec)) -> JobBuilder {
        f(&mut self.job.spec);
        self
    }

    pub fn status(mut self, status: StreamJobStatus) -> JobBuilder {
        self.job.status = Some(status);
        self
    }

    pub fn generation(mut self, g: i64) -> JobBuilder {
        self.job.metadata.generation = Some(g);
        self
    }

    pub fn deleting(mut self) -> JobBuilder {
        self.job.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::now()));
        self
    }

    pub fn build(self) -> StreamJob {
        self.job
    }
}

/// A worker pod of `run` in `phase` with `ip`.
pub fn pod(job: &str, run: &str, index: u32, phase: &str, ip: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(format!("{job}-{run}-{index}")),
            namespace: Some("jobs".into()),
            labels: Some(BTreeMap::from([
                (names::JOB_LABEL.to_string(), job.to_string()),
                (names::RUN_LABEL.to_string(), run.to_string()),
                (names::WORKER_LABEL.to_string(), index.to_string()),
            ])),
            ..Default::default()
        },
        spec: None,
        status: Some(PodStatus { phase: Some(phase.into()), pod_ip: ip.map(String::from), ..Default::default() }),
    }
}

/// A pod whose container exited with `code`.
pub fn exited(mut pod: Pod, code: i32) -> Pod {
    let status = pod.status.get_or_insert_with(Default::default);
    status.phase = Some(if code == 0 { "Succeeded" } else { "Failed" }.into());
    status.container_statuses = Some(vec![ContainerStatus {
        name: "worker".into(),
        state: Some(ContainerState {
            terminated: Some(ContainerStateTerminated { exit_code: code, reason: Some(if code == 0 { "Completed" } else { "Error" }.into()), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }]);
    pod
}
