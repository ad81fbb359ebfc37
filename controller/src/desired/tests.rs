use weir_api::streamjob::RunStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::testing::JobBuilder;

fn run(restore: Option<&str>) -> RunStatus {
    RunStatus {
        id: "01234567-3".into(),
        number: 3,
        spec_hash: "h".into(),
        restore_from: restore.map(String::from),
        workers: 2,
        pods_created: false,
        not_before: None,
        started_at: Time(jiff::Timestamp::UNIX_EPOCH),
    }
}

#[test]
fn a_worker_pod_waits_for_membership_on_its_pod_ip_and_restores_as_the_run_says() {
    let job = JobBuilder::new("wc").build();
    let pod = worker_pod(&job, &run(Some("latest")), 1, &WorkerSettings::default()).unwrap();
    assert_eq!(pod.metadata.name.as_deref(), Some("wc-3-1"));
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels["weir.dev/run"], "01234567-3");
    assert_eq!(labels["weir.dev/worker"], "1");
    let spec = pod.spec.unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let c = &spec.containers[0];
    let args = c.args.clone().unwrap().join(" ");
    assert!(args.contains("--control-addr $(POD_IP):6120"), "{args}");
    assert!(args.contains("--index 1"));
    assert!(args.contains("--restore latest"));
    assert!(args.contains("--state-dir file:///var/lib/weir/checkpoints/jobs/wc"), "{args}");
    let env = c.env.clone().unwrap();
    let token = env.iter().find(|e| e.name == "WEIR_CONTROL_TOKEN").unwrap();
    assert_eq!(token.value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap().name, "wc-control-token");
    assert_eq!(pod.metadata.owner_references.unwrap()[0].kind, "StreamJob");
}

#[test]
fn user_pod_settings_reach_the_pod_but_cannot_replace_the_operators_labels_or_token() {
    let job = JobBuilder::new("wc")
        .spec(|s| {
            s.pod_labels.insert("weir.dev/run".into(), "mine".into());
            s.pod_labels.insert("team".into(), "data".into());
            s.env.push(serde_json::from_value(serde_json::json!({"name": "WEIR_CONTROL_TOKEN", "value": "x"})).unwrap());
            s.env.push(serde_json::from_value(serde_json::json!({"name": "FOO", "value": "bar"})).unwrap());
            s.node_selector.insert("disk".into(), "ssd".into());
            s.service_account_name = Some("jobs-sa".into());
        })
        .build();
    let pod = worker_pod(&job, &run(None), 0, &WorkerSettings { service_account: Some("weir-worker".into()) }).unwrap();
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels["weir.dev/run"], "01234567-3");
    assert_eq!(labels["team"], "data");
    let spec = pod.spec.unwrap();
    assert_eq!(spec.service_account_name.as_deref(), Some("jobs-sa"));
    assert_eq!(spec.node_selector.unwrap()["disk"], "ssd");
    let env = spec.containers[0].env.clone().unwrap();
    assert_eq!(env.iter().filter(|e| e.name == "WEIR_CONTROL_TOKEN").count(), 1);
    assert!(env.iter().any(|e| e.name == "FOO"));
    assert!(!spec.containers[0].args.clone().unwrap().contains(&"--restore".to_string()));
}

#[test]
fn the_pipeline_config_map_carries_the_specs_parallelism_and_checkpoint_settings() {
    let job = JobBuilder::new("wc").build();
    let cm = pipeline_config_map(&job).unwrap();
    let yaml = &cm.data.unwrap()["pipeline.yaml"];
    let parsed = weir_api::PipelineSpec::from_yaml("cm", yaml).unwrap();
    assert_eq!(parsed.parallelism, 2);
    assert_eq!(parsed.checkpoint.interval.get(), std::time::Duration::from_millis(500));
}

#[test]
fn tokens_are_long_and_different() {
    let (a, b) = (new_token(), new_token());
    assert_eq!(a.len(), 64);
    assert_ne!(a, b);
}
