use serde_json::json;

use super::*;
use crate::testing::JobBuilder;

fn checked(job: &StreamJob) -> Result<(), Refusal> {
    let pipeline = job.spec.validate().expect("a valid pipeline");
    check(job, &[pipeline.sink.as_ref().unwrap()], &WorkerSettings::default())
}

fn refused(job: &StreamJob) -> Refusal {
    checked(job).expect_err("refused")
}

/// The builder's job without its pod template (no volume at all).
fn bare() -> JobBuilder {
    JobBuilder::new("j").spec(|s| s.pod_template = None)
}

#[test]
fn one_claim_at_var_lib_weir_covers_the_example_storage_and_relative_sink_paths() {
    // The builder's job: file:///var/lib/weir/checkpoints, sink `out`, a PVC at /var/lib/weir.
    assert_eq!(checked(&JobBuilder::new("j").build()), Ok(()));
}

#[test]
fn file_storage_without_a_volume_is_refused_saying_what_to_add() {
    let r = refused(&bare().spec(|s| s.pipeline.0["sink"] = json!({"blackhole": {}})).build());
    assert_eq!(r.reason, "SharedVolumeMissing");
    assert!(r.message.starts_with("checkpoint storage file:///var/lib/weir/checkpoints (this job's directory /var/lib/weir/checkpoints/jobs/j) is on no volume"), "{}", r.message);
    assert!(r.message.contains("persistentVolumeClaim: {claimName: weir-data}"), "{}", r.message);
    assert!(r.message.contains("mountPath: /var/lib/weir"), "{}", r.message);
}

#[test]
fn a_file_sink_outside_a_shared_volume_is_refused() {
    // Storage in S3 needs no volume, but the sink's pending files do.
    let r = refused(&bare().spec(|s| s.checkpoint.storage = "s3://bucket/cp".into()).build());
    assert_eq!(r.reason, "SharedVolumeMissing");
    assert!(r.message.starts_with("the file sink's directory \"out\" (/var/lib/weir/jobs/jobs/j/out) is on no volume"), "{}", r.message);
    // An absolute path under /tmp is on the pod's emptyDir, lost with the pod.
    let r = refused(&JobBuilder::new("j").spec(|s| s.pipeline.0["sink"]["file"]["path"] = json!("/tmp/out")).build());
    assert!(r.message.contains("is on volume \"weir-tmp\" at /tmp, an emptyDir, lost with the pod"), "{}", r.message);
    // `..` is resolved before looking for the volume.
    let r = refused(&JobBuilder::new("j").spec(|s| s.pipeline.0["sink"]["file"]["path"] = json!("../../../../../../tmp/x")).build());
    assert!(r.message.contains("(/tmp/x)"), "{}", r.message);
}

#[test]
fn object_storage_and_a_sink_without_files_need_no_volume() {
    let job = bare()
        .spec(|s| {
            s.checkpoint.storage = "s3://bucket/cp".into();
            s.pipeline.0["sink"] = json!({"blackhole": {}});
        })
        .build();
    assert_eq!(checked(&job), Ok(()));
}

#[test]
fn azure_and_google_storage_and_output_need_no_volume() {
    for (storage, output) in [("az://container/cp", "az://container/out"), ("gs://bucket/cp", "gs://bucket/out"), ("abfss://c@acct.dfs.core.windows.net/cp", "s3://b/out")] {
        let job = bare()
            .spec(|s| {
                s.checkpoint.storage = storage.into();
                s.pipeline.0["sink"]["file"]["path"] = json!(output);
            })
            .build();
        assert_eq!(checked(&job), Ok(()), "{storage} with output in {output}");
    }
}

#[test]
fn an_empty_dir_a_read_only_mount_or_a_nested_empty_dir_does_not_count() {
    let on = |volume: serde_json::Value, mounts: serde_json::Value| {
        JobBuilder::new("j")
            .pod_template(|t| {
                t["spec"]["volumes"] = json!([volume, {"name": "scratch", "emptyDir": {}}]);
                t["spec"]["containers"][0]["volumeMounts"] = mounts;
            })
            .build()
    };
    let empty = on(json!({"name": "weir-data", "emptyDir": {}}), json!([{"name": "weir-data", "mountPath": "/var/lib/weir"}]));
    assert!(refused(&empty).message.contains("is on volume \"weir-data\" at /var/lib/weir, an emptyDir, lost with the pod"));
    let pvc = json!({"name": "weir-data", "persistentVolumeClaim": {"claimName": "weir-data"}});
    let read_only = on(pvc.clone(), json!([{"name": "weir-data", "mountPath": "/var/lib/weir", "readOnly": true}]));
    assert!(refused(&read_only).message.contains("mounted read-only at /var/lib/weir"));
    // The deepest mount decides: an emptyDir over the checkpoints hides the claim.
    let shadowed = on(pvc.clone(), json!([{"name": "weir-data", "mountPath": "/var/lib/weir"}, {"name": "scratch", "mountPath": "/var/lib/weir/checkpoints/"}]));
    assert!(refused(&shadowed).message.contains("is on volume \"scratch\" at /var/lib/weir/checkpoints/"));
    let ephemeral = on(
        json!({"name": "weir-data", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"]}}}}),
        json!([{"name": "weir-data", "mountPath": "/var/lib/weir"}]),
    );
    assert!(refused(&ephemeral).message.contains("a generic ephemeral volume"));
    // A prefix of the name is not a parent directory.
    let sibling = on(pvc, json!([{"name": "weir-data", "mountPath": "/var/lib/we"}]));
    assert!(refused(&sibling).message.contains("is on no volume"));
}

#[test]
fn claims_network_and_host_filesystems_count() {
    for volume in [
        json!({"name": "weir-data", "persistentVolumeClaim": {"claimName": "weir-data"}}),
        json!({"name": "weir-data", "nfs": {"server": "nfs.example", "path": "/exports/weir"}}),
        json!({"name": "weir-data", "hostPath": {"path": "/srv/weir"}}),
        json!({"name": "weir-data", "csi": {"driver": "efs.csi.aws.com"}}),
    ] {
        let job = JobBuilder::new("j").pod_template(|t| t["spec"]["volumes"] = json!([volume])).build();
        assert_eq!(checked(&job), Ok(()), "{volume}");
    }
    // Mounted exactly at the storage directory's parent, with a trailing slash.
    let job = JobBuilder::new("j")
        .spec(|s| s.pipeline.0["sink"] = json!({"blackhole": {}}))
        .pod_template(|t| t["spec"]["containers"][0]["volumeMounts"] = json!([{"name": "weir-data", "mountPath": "/var/lib/weir/checkpoints/"}]))
        .build();
    assert_eq!(checked(&job), Ok(()));
}

#[test]
fn a_job_without_any_image_is_refused_and_the_operators_default_fills_in() {
    let job = JobBuilder::new("j").spec(|s| s.image = None).build();
    let pipeline = job.spec.validate().unwrap();
    let r = check(&job, &[pipeline.sink.as_ref().unwrap()], &WorkerSettings::default()).unwrap_err();
    assert_eq!(r.reason, "NoWorkerImage");
    assert!(r.message.contains("set spec.image"), "{}", r.message);
    let with_default = WorkerSettings { default_image: Some("localhost/weir:0.1.0".into()), ..WorkerSettings::default() };
    assert_eq!(check(&job, &[pipeline.sink.as_ref().unwrap()], &with_default), Ok(()));
}

#[test]
fn a_name_that_cannot_name_the_jobs_service_is_refused() {
    for name in ["a".repeat(56), "1job".to_string(), "my.job".to_string()] {
        let mut job = JobBuilder::new("j").build();
        job.metadata.name = Some(name.clone());
        let r = refused(&job);
        assert_eq!(r.reason, "InvalidSpec", "{name}");
        assert!(r.message.contains("metadata.name"), "{}", r.message);
    }
    let mut job = JobBuilder::new("j").build();
    job.metadata.name = Some("a".repeat(55));
    assert_eq!(checked(&job), Ok(()));
}

#[test]
fn a_job_with_tls_is_refused_while_the_operator_trusts_no_worker_ca() {
    let job = JobBuilder::new("j").spec(|s| s.tls = Some(weir_api::streamjob::WorkerTls { secret_name: "j-tls".into() })).build();
    let r = refused(&job);
    assert_eq!(r.reason, "NoWorkerCA");
    assert!(r.message.contains("spec.tls") && r.message.contains("workerTls.caConfigMap"), "{}", r.message);
    let pipeline = job.spec.validate().unwrap();
    let trusting = WorkerSettings { worker_ca: true, ..WorkerSettings::default() };
    assert_eq!(check(&job, &[pipeline.sink.as_ref().unwrap()], &trusting), Ok(()));
}
