//! What a StreamJob must satisfy before any of its pods is created, beyond
//! what the CRD's schema and CEL rules and the pipeline check already refuse:
//! a worker image, and shared storage for whatever the workers write that a
//! restart must find again.
//!
//! The storage check runs on the pod the operator would create (template
//! merged), so it sees exactly the volumes a worker would have. A path is
//! covered by the mount with the longest mountPath at or above it; that
//! mount's volume must outlive the pod (an emptyDir or a generic ephemeral
//! volume is gone when the pod moves to another node, and with it the
//! checkpoints or the pending sink files a restore must commit).

use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::{Pod, Volume};
use kube::ResourceExt;
use weir_api::streamjob::{RunStatus, StreamJob};
use weir_api::{FileSinkSpec, SinkSpec};

use super::{state_dir, worker_image, worker_pod, WorkerSettings, WORKER_CONTAINER};
use crate::names;

/// Why a job is not started: a condition reason and a message that says
/// what to change. Shown in status and a Warning event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub const INVALID_SPEC: &'static str = "InvalidSpec";
    pub const NO_WORKER_IMAGE: &'static str = "NoWorkerImage";
    pub const SHARED_VOLUME_MISSING: &'static str = "SharedVolumeMissing";
    pub const NO_WORKER_CA: &'static str = "NoWorkerCA";

    pub fn invalid(message: impl Into<String>) -> Refusal {
        Refusal { reason: Refusal::INVALID_SPEC, message: message.into() }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Checks `job` (whose pipeline is valid, `sinks` its sinks) against the
/// operator's `settings`.
pub fn check(job: &StreamJob, sinks: &[&SinkSpec], settings: &WorkerSettings) -> Result<(), Refusal> {
    weir_api::streamjob::check_job_name(&job.name_any()).map_err(Refusal::invalid)?;
    if worker_image(job, settings).is_none() {
        return Err(Refusal {
            reason: Refusal::NO_WORKER_IMAGE,
            message: "no worker image: set spec.image (or the image of a container named worker in spec.podTemplate), or install the operator with a default worker image (the chart's workerImage, --default-worker-image)".into(),
        });
    }
    if job.spec.tls.is_some() && !settings.worker_ca {
        return Err(Refusal {
            reason: Refusal::NO_WORKER_CA,
            message: "spec.tls is set, but the operator trusts no CA for the workers' certificates, so it could not call their HTTPS control endpoint: \
                      install it with the chart's workerTls.caConfigMap (a ConfigMap in the operator's namespace holding the CA as ca.crt; \
                      --worker-ca-file), or remove spec.tls"
                .into(),
        });
    }
    let run = RunStatus::decided("check".into(), 1, String::new(), 1, k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH));
    let pod = worker_pod(job, &run, 0, settings).map_err(|e| Refusal::invalid(e.to_string()))?;
    let storage = &job.spec.checkpoint.storage;
    if let Some(dir) = local_path(&state_dir(job)) {
        let what = format!("checkpoint storage {storage} (this job's directory {})", dir.display());
        shared(&pod, &dir, &what, "checkpoints")?;
    }
    // Output in S3 needs no volume: pending uploads live in the bucket.
    for sink in sinks {
        match sink {
            SinkSpec::File(f @ FileSinkSpec { path, .. }) if !f.in_object_store() => {
                let work = names::work_dir(&job.namespace().unwrap_or_else(|| "default".into()), &job.name_any());
                let dir = normalize(&Path::new(&work).join(path));
                let what = format!("the file sink's directory {path:?} ({})", dir.display());
                shared(&pod, &dir, &what, "pending output files")?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// The local directory of a storage location: `file:///x` and `/x` are
/// `/x`; object storage (`s3://`) is `None`.
fn local_path(storage: &str) -> Option<PathBuf> {
    let path = storage.strip_prefix("file://").unwrap_or(storage);
    path.starts_with('/').then(|| normalize(Path::new(path)))
}

/// `path` with `.` and `..` resolved lexically (there is no filesystem to ask).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(part) => out.push(part),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Whether `dir` is on a writable volume of the worker container that
/// outlives the pod; `what` and `holds` word the refusal.
fn shared(pod: &Pod, dir: &Path, what: &str, holds: &str) -> Result<(), Refusal> {
    let spec = pod.spec.as_ref();
    let worker = spec.and_then(|s| s.containers.iter().find(|c| c.name == WORKER_CONTAINER));
    let mount = worker
        .and_then(|c| c.volume_mounts.as_ref())
        .into_iter()
        .flatten()
        .filter(|m| dir.starts_with(normalize(Path::new(&m.mount_path))))
        .max_by_key(|m| normalize(Path::new(&m.mount_path)).components().count());
    let add = "add a PersistentVolumeClaim (ReadWriteMany when workers run on several nodes) to spec.podTemplate and mount it at or above that directory in the worker container, e.g. \
spec.podTemplate.spec.volumes: [{name: weir-data, persistentVolumeClaim: {claimName: weir-data}}] and \
spec.podTemplate.spec.containers: [{name: worker, volumeMounts: [{name: weir-data, mountPath: /var/lib/weir}]}] \
(one claim at /var/lib/weir holds storage file:///var/lib/weir/checkpoints and every relative sink path)";
    let refuse = |problem: String| Refusal {
        reason: Refusal::SHARED_VOLUME_MISSING,
        message: format!("{what} {problem}; every worker must see the same {holds}, also after a pod is restarted on another node: {add}"),
    };
    let Some(mount) = mount else {
        return Err(refuse("is on no volume of the worker pod (only its read-only root filesystem)".into()));
    };
    if mount.read_only == Some(true) {
        return Err(refuse(format!("is on volume {:?}, mounted read-only at {}", mount.name, mount.mount_path)));
    }
    let volume = spec.and_then(|s| s.volumes.as_ref()).into_iter().flatten().find(|v| v.name == mount.name);
    match volume.map(kind) {
        Some(Kind::Lasting) => Ok(()),
        Some(Kind::PodLocal(kind)) => Err(refuse(format!("is on volume {:?} at {}, {kind}", mount.name, mount.mount_path))),
        None => Err(refuse(format!("is on volume {:?} at {}, which the pod does not declare", mount.name, mount.mount_path))),
    }
}

enum Kind {
    /// Outlives the pod: a claim, a network or host filesystem.
    Lasting,
    /// Lost with the pod, or read-only: what it is.
    PodLocal(&'static str),
}

fn kind(v: &Volume) -> Kind {
    match v {
        Volume { empty_dir: Some(_), .. } => Kind::PodLocal("an emptyDir, lost with the pod"),
        Volume { ephemeral: Some(_), .. } => Kind::PodLocal("a generic ephemeral volume, deleted with the pod"),
        Volume { config_map: Some(_), .. } => Kind::PodLocal("a configMap volume (read-only)"),
        Volume { secret: Some(_), .. } => Kind::PodLocal("a secret volume (read-only)"),
        Volume { downward_api: Some(_), .. } => Kind::PodLocal("a downwardAPI volume (read-only)"),
        Volume { projected: Some(_), .. } => Kind::PodLocal("a projected volume (read-only)"),
        Volume { git_repo: Some(_), .. } => Kind::PodLocal("a gitRepo volume, lost with the pod"),
        Volume { image: Some(_), .. } => Kind::PodLocal("an image volume (read-only)"),
        _ => Kind::Lasting,
    }
}

#[cfg(test)]
mod tests;
