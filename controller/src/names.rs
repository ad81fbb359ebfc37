//! Names and labels of the objects the operator creates for a StreamJob.
//! Everything a job owns carries `weir.dev/job=<name>`; worker pods also
//! carry the run id and their worker index, which is how a restarted
//! operator recognises the pods of the run its status names.

/// On every object owned by a StreamJob.
pub const JOB_LABEL: &str = "weir.dev/job";
/// On worker pods: the run (attempt) they belong to.
pub const RUN_LABEL: &str = "weir.dev/run";
/// On worker pods: the worker index (which subtasks the pod hosts).
pub const WORKER_LABEL: &str = "weir.dev/worker";
/// The operator's finalizer: the final savepoint before deletion.
pub const FINALIZER: &str = "weir.dev/savepoint-on-delete";

/// Key of the pipeline file in the job's ConfigMap.
pub const PIPELINE_KEY: &str = "pipeline.yaml";
/// Key of the pipeline ConfigMap holding the StreamJob spec its pipeline
/// was made from: the spec of the last run whose pods were created, from
/// which the next run's pods are built while the current spec is refused.
pub const SPEC_KEY: &str = "streamjob-spec.json";
/// Where the pipeline ConfigMap is mounted in worker pods.
pub const PIPELINE_DIR: &str = "/etc/weir";
/// Key of the control token in the job's Secret.
pub const TOKEN_KEY: &str = "token";
/// Under this directory each job gets its own working directory
/// (`<WORK_ROOT>/<namespace>/<job>`): relative sink and source paths of its
/// pipeline resolve there, so two jobs never write into each other's files.
pub const WORK_ROOT: &str = "/var/lib/weir/jobs";

pub fn work_dir(namespace: &str, job: &str) -> String {
    format!("{WORK_ROOT}/{namespace}/{job}")
}

/// The job id the workers' sinks write under (`weir worker --job-id`):
/// namespace and name, unique in the cluster. Both are DNS labels, which
/// have no `_`, so the two cannot be told apart wrongly.
pub fn job_id(namespace: &str, job: &str) -> String {
    format!("{namespace}_{job}")
}

pub fn pipeline_config_map(job: &str) -> String {
    format!("{job}-pipeline")
}

/// The job's control token Secret, named after the operator's control key
/// (see [`crate::control_key::ControlKey::id`]). Not `-control-token`, the
/// name of the random tokens operators before the control key stored and
/// read back: a job from then keeps that Secret (deleted with the job), and
/// its next run gets this one.
pub fn token_secret(job: &str, control_key_id: Option<&str>) -> String {
    match control_key_id {
        Some(id) => format!("{job}-operator-token-{id}"),
        None => format!("{job}-operator-token"),
    }
}

pub fn service(job: &str) -> String {
    format!("{job}-workers")
}

pub fn network_policy(job: &str) -> String {
    format!("{job}-workers")
}

pub fn pod(job: &str, run_number: i64, index: u32) -> String {
    format!("{job}-{run_number}-{index}")
}

/// The label selector of every pod of a job.
pub fn job_selector(job: &str) -> String {
    format!("{JOB_LABEL}={job}")
}
