use k8s_openapi::api::core::v1::EnvVar;
use weir_api::streamjob::RunStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::testing::JobBuilder;

fn run(restore: Option<&str>) -> RunStatus {
    RunStatus { restore_from: restore.map(String::from), ..RunStatus::decided("01234567-3".into(), 3, "h".into(), 2, Time(jiff::Timestamp::UNIX_EPOCH)) }
}

fn settings() -> WorkerSettings {
    WorkerSettings::default()
}

fn worker(pod: &Pod) -> &k8s_openapi::api::core::v1::Container {
    &pod.spec.as_ref().unwrap().containers[0]
}

fn env_value(c: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<String> {
    c.env.as_ref().unwrap().iter().find(|e| e.name == name).map(|e| e.value.clone().unwrap_or_default())
}

/// A run after a node was lost: its workers must fail on empty storage
/// rather than start fresh, and must not be placed on the lost node, whose
/// kubelet cannot start them (it may still look Ready to the scheduler).
#[test]
fn a_run_after_a_lost_node_expects_state_and_avoids_that_node_in_every_affinity_term() {
    let job = JobBuilder::new("wc")
        .spec(|s| {
            s.affinity = Some(serde_json::from_value(serde_json::json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}
            ]}}})).unwrap())
        })
        .build();
    let mut r = run(Some("latest"));
    r.expect_state = true;
    r.avoid_nodes = vec!["node-1".into()];
    let pod = worker_pod(&job, &r, 0, &settings()).unwrap();
    let args = worker(&pod).args.clone().unwrap().join(" ");
    assert!(args.contains("--restore latest --expect-state"), "{args}");
    let terms = pod.spec.unwrap().affinity.unwrap().node_affinity.unwrap().required_during_scheduling_ignored_during_execution.unwrap().node_selector_terms;
    assert_eq!(terms.len(), 2, "the user's alternatives stay alternatives");
    for t in &terms {
        let f = &t.match_fields.as_ref().unwrap()[0];
        assert_eq!((f.key.as_str(), f.operator.as_str(), f.values.clone().unwrap()), ("metadata.name", "NotIn", vec!["node-1".to_string()]));
        assert_eq!(t.match_expressions.as_ref().unwrap().len(), 1, "the user's expression is kept");
    }
    // Without a user affinity the exclusion is the only term; without nodes to avoid, nothing is added.
    let plain = JobBuilder::new("wc").build();
    let pod = worker_pod(&plain, &r, 0, &settings()).unwrap();
    assert_eq!(pod.spec.unwrap().affinity.unwrap().node_affinity.unwrap().required_during_scheduling_ignored_during_execution.unwrap().node_selector_terms.len(), 1);
    let pod = worker_pod(&plain, &run(None), 0, &settings()).unwrap();
    assert!(pod.spec.as_ref().unwrap().affinity.is_none());
    assert!(!worker(&pod).args.clone().unwrap().join(" ").contains("--expect-state"));
}

#[test]
fn a_worker_pod_waits_for_membership_on_its_pod_ip_and_restores_as_the_run_says() {
    let job = JobBuilder::new("wc").build();
    let pod = worker_pod(&job, &run(Some("latest")), 1, &settings()).unwrap();
    assert_eq!(pod.metadata.name.as_deref(), Some("wc-3-1"));
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels["weir.dev/run"], "01234567-3");
    assert_eq!(labels["weir.dev/worker"], "1");
    let spec = pod.spec.unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let c = &spec.containers[0];
    let args = c.args.clone().unwrap().join(" ");
    // The IP alone: `$(POD_IP):6120` is no address when the pod IP is IPv6.
    assert!(args.contains("--control-addr $(POD_IP) "), "{args}");
    assert!(args.contains("--index 1"));
    assert!(args.contains("--restore latest"));
    assert!(args.contains("--state-dir file:///var/lib/weir/checkpoints/jobs/wc"), "{args}");
    assert!(args.contains("--base-dir /var/lib/weir/jobs/jobs/wc"), "{args}");
    // Unique in the cluster, unlike the pipeline's name.
    assert!(args.contains("--job-id jobs_wc"), "{args}");
    let env = c.env.clone().unwrap();
    let token = env.iter().find(|e| e.name == "WEIR_CONTROL_TOKEN").unwrap();
    assert_eq!(token.value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap().name, "wc-operator-token");
    assert_eq!(pod.metadata.owner_references.unwrap()[0].kind, "StreamJob");
}

/// The workers read their token from the Secret the operator creates:
/// both are named after the operator's control key, so a new key never
/// leaves pods reading a Secret of the old one.
#[test]
fn the_token_secret_and_the_pods_reference_to_it_are_named_after_the_control_key() {
    let job = JobBuilder::new("wc").build();
    let key = crate::control_key::ControlKey::from_bytes(&[3u8; 32]).unwrap();
    let with_key = WorkerSettings { control_key_id: Some(key.id()), ..settings() };
    let secret = token_secret(&job, &key.token("uid"), &with_key).unwrap();
    let pod = worker_pod(&job, &run(None), 0, &with_key).unwrap();
    let env = worker(&pod).env.clone().unwrap();
    let reference = env.iter().find(|e| e.name == "WEIR_CONTROL_TOKEN").unwrap().value_from.clone().unwrap().secret_key_ref.unwrap();
    assert_eq!(reference.name, secret.metadata.name.clone().unwrap());
    assert_eq!(reference.name, format!("wc-operator-token-{}", key.id()));
    assert_eq!(secret.data.unwrap()[crate::names::TOKEN_KEY].0, key.token("uid").into_bytes());
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
    let pod = worker_pod(&job, &run(None), 0, &WorkerSettings { service_account: Some("weir-worker".into()), ..settings() }).unwrap();
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
fn a_runs_pods_are_built_from_the_spec_it_was_decided_on_even_when_the_current_one_differs() {
    let deployed = JobBuilder::new("wc").build();
    let cm = pipeline_config_map(&deployed).unwrap();
    let stored = spec_of_config_map(&cm).expect("the ConfigMap keeps the spec");
    assert_eq!(stored, deployed.spec);
    let mut r = run(Some("latest"));
    r.spec_hash = crate::spec_hash::spec_hash(&deployed.spec, worker_image(&deployed, &settings()).as_deref());
    // The current spec is another one (refused, say): the run keeps the deployed one.
    let current = JobBuilder::new("wc").spec(|s| s.parallelism = 3).build();
    let (built, same) = job_for_run(&current, &r, Some(stored.clone()), &settings());
    assert!(same);
    assert_eq!(built.spec.parallelism, 2);
    assert_eq!(built.metadata, current.metadata, "the same object, another spec");
    // The current spec is the run's: taken as it is.
    let (built, same) = job_for_run(&deployed, &r, None, &settings());
    assert!(same && built.spec == deployed.spec);
    // Neither: said so (the reconciler logs it), and the current spec is all there is.
    let (built, same) = job_for_run(&current, &r, None, &settings());
    assert!(!same && built.spec.parallelism == 3);
}

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

#[test]
fn without_a_template_a_worker_pod_meets_the_restricted_pod_security_standard() {
    let job = JobBuilder::new("wc").spec(|s| s.pod_template = None).build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    let spec = pod.spec.as_ref().unwrap();
    let psc = serde_json::to_value(spec.security_context.as_ref().unwrap()).unwrap();
    assert_eq!(
        psc,
        json!({"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}})
    );
    let c = worker(&pod);
    let sc = serde_json::to_value(c.security_context.as_ref().unwrap()).unwrap();
    assert_eq!(sc, json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true}));
    // The root filesystem is read-only: /tmp is an emptyDir, the pipeline a read-only ConfigMap.
    let mounts: Vec<(String, String)> = c.volume_mounts.iter().flatten().map(|m| (m.name.clone(), m.mount_path.clone())).collect();
    assert_eq!(mounts, [("weir-pipeline".to_string(), "/etc/weir".to_string()), ("weir-tmp".to_string(), "/tmp".to_string())]);
    let volumes = spec.volumes.as_ref().unwrap();
    assert!(volumes.iter().any(|v| v.name == "weir-tmp" && v.empty_dir.is_some()));
    assert!(volumes.iter().any(|v| v.name == "weir-pipeline" && v.config_map.as_ref().unwrap().name == "wc-pipeline"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(spec.enable_service_links, Some(false));
    assert_eq!(c.command, None, "the image's entrypoint runs the operator's args");
}

#[test]
fn a_job_without_resources_gets_small_requests_and_a_memory_limit_not_best_effort() {
    let job = JobBuilder::new("wc").build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    let r = serde_json::to_value(worker(&pod).resources.as_ref().unwrap()).unwrap();
    assert_eq!(r, json!({"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}));
    // An empty resources block is no choice either.
    let job = JobBuilder::new("wc").spec(|s| s.resources = Some(Default::default())).build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    assert_eq!(serde_json::to_value(worker(&pod).resources.as_ref().unwrap()).unwrap(), r);
}

#[test]
fn the_worker_uid_can_be_left_to_the_platform() {
    let job = JobBuilder::new("wc").build();
    let pod = worker_pod(&job, &run(None), 0, &WorkerSettings { uid: None, ..settings() }).unwrap();
    let psc = pod.spec.unwrap().security_context.unwrap();
    assert_eq!((psc.run_as_user, psc.run_as_group, psc.fs_group), (None, None, None));
    assert_eq!(psc.run_as_non_root, Some(true), "still never root");
}

/// A template that sets everything the merge rules speak about.
fn templated() -> StreamJob {
    JobBuilder::new("wc")
        .spec(|s| s.image = None)
        .pod_template(|t| {
            *t = json!({
                "metadata": {"labels": {"team": "template", "tier": "batch", "weir.dev/run": "forged", "app.kubernetes.io/name": "other"},
                             "annotations": {"a": "template", "b": "template"}},
                "spec": {
                    "nodeSelector": {"disk": "hdd", "zone": "a"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
                    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}],
                    "priorityClassName": "streaming",
                    "imagePullSecrets": [{"name": "registry"}],
                    "serviceAccountName": "template-sa",
                    "restartPolicy": "Always",
                    "securityContext": {"runAsUser": 1000, "supplementalGroups": [5]},
                    "volumes": [
                        {"name": "weir-data", "persistentVolumeClaim": {"claimName": "weir-data"}},
                        {"name": "weir-pipeline", "emptyDir": {}},
                        {"name": "cache", "emptyDir": {}},
                    ],
                    "initContainers": [{"name": "init", "image": "busybox"}],
                    "containers": [
                        {"name": "log-shipper", "image": "shipper:1"},
                        {
                            "name": "worker",
                            "image": "weir:template",
                            "command": ["sh", "-c"],
                            "args": ["evil"],
                            "ports": [{"containerPort": 9999}],
                            "env": [{"name": "FOO", "value": "template"}, {"name": "BAR", "value": "template"}, {"name": "WEIR_CONTROL_TOKEN", "value": "forged"}],
                            "envFrom": [{"configMapRef": {"name": "template-env"}}],
                            "resources": {"requests": {"cpu": "2"}},
                            "securityContext": {"readOnlyRootFilesystem": false},
                            "livenessProbe": {"tcpSocket": {"port": 6120}},
                            "volumeMounts": [
                                {"name": "weir-data", "mountPath": "/var/lib/weir"},
                                {"name": "cache", "mountPath": "/etc/weir"},
                                {"name": "cache", "mountPath": "/cache"},
                            ],
                        },
                    ],
                },
            });
        })
        .build()
}

#[test]
fn the_pod_template_reaches_the_worker_pod() {
    let pod = worker_pod(&templated(), &run(None), 0, &settings()).unwrap();
    let labels = pod.metadata.labels.as_ref().unwrap();
    assert_eq!((labels["team"].as_str(), labels["tier"].as_str()), ("template", "batch"));
    assert_eq!(pod.metadata.annotations.as_ref().unwrap()["a"], "template");
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.node_selector.as_ref().unwrap()["disk"], "hdd");
    assert_eq!(spec.tolerations.as_ref().unwrap()[0].key.as_deref(), Some("dedicated"));
    assert!(spec.affinity.as_ref().unwrap().pod_anti_affinity.is_some());
    assert_eq!(spec.topology_spread_constraints.as_ref().unwrap()[0].topology_key, "kubernetes.io/hostname");
    assert_eq!(spec.priority_class_name.as_deref(), Some("streaming"));
    assert_eq!(spec.image_pull_secrets.as_ref().unwrap()[0].name, "registry");
    assert_eq!(spec.service_account_name.as_deref(), Some("template-sa"));
    assert_eq!(spec.init_containers.as_ref().unwrap()[0].name, "init");
    // The worker first, the sidecar as written.
    let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["worker", "log-shipper"]);
    assert_eq!(spec.containers[1].image.as_deref(), Some("shipper:1"));
    // Pod security: the template's fields replace the defaults one by one.
    let psc = spec.security_context.as_ref().unwrap();
    assert_eq!((psc.run_as_user, psc.run_as_group, psc.run_as_non_root), (Some(1000), Some(65532), Some(true)));
    assert_eq!(psc.supplemental_groups, Some(vec![5]));
    let c = worker(&pod);
    assert_eq!(c.image.as_deref(), Some("weir:template"), "the template's image, as the spec names none");
    assert_eq!(env_value(c, "BAR").as_deref(), Some("template"));
    assert_eq!(c.resources.as_ref().unwrap().requests.as_ref().unwrap()["cpu"].0, "2");
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!((sc.read_only_root_filesystem, sc.allow_privilege_escalation), (Some(false), Some(false)));
    assert!(c.liveness_probe.is_some());
    assert_eq!(c.env_from.as_ref().unwrap()[0].config_map_ref.as_ref().unwrap().name, "template-env");
    let mounts: Vec<&str> = c.volume_mounts.iter().flatten().map(|m| m.mount_path.as_str()).collect();
    assert_eq!(mounts, ["/etc/weir", "/tmp", "/var/lib/weir", "/cache"]);
}

#[test]
fn what_the_operator_owns_wins_over_the_pod_template() {
    let pod = worker_pod(&templated(), &run(None), 0, &settings()).unwrap();
    let labels = pod.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["weir.dev/run"], "01234567-3");
    assert_eq!(labels["app.kubernetes.io/name"], "weir");
    assert_eq!(labels["weir.dev/job"], "wc");
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    let c = worker(&pod);
    assert_eq!(c.command, None);
    assert_eq!(c.args.as_ref().unwrap()[0], "worker");
    let ports: Vec<i32> = c.ports.iter().flatten().map(|p| p.container_port).collect();
    assert_eq!(ports, [6120, 6121, 6122]);
    let token: Vec<_> = c.env.iter().flatten().filter(|e| e.name == "WEIR_CONTROL_TOKEN").collect();
    assert_eq!(token.len(), 1);
    assert!(token[0].value.is_none() && token[0].value_from.is_some(), "from the job's Secret, not the template");
    assert_eq!(c.env.as_ref().unwrap()[0].name, "POD_IP", "first, so that the user's variables can use $(POD_IP)");
    assert!(c.readiness_probe.as_ref().unwrap().http_get.is_some());
    // /etc/weir is the pipeline's, and the volume named weir-pipeline is the ConfigMap.
    let etc: Vec<_> = c.volume_mounts.iter().flatten().filter(|m| m.mount_path == "/etc/weir").collect();
    assert_eq!((etc.len(), etc[0].name.as_str()), (1, "weir-pipeline"));
    let pipeline: Vec<_> = spec.volumes.iter().flatten().filter(|v| v.name == "weir-pipeline").collect();
    assert_eq!(pipeline.len(), 1);
    assert!(pipeline[0].config_map.is_some());
}

#[test]
fn explicit_spec_fields_win_over_the_pod_template() {
    let mut job = templated();
    let s = &mut job.spec;
    s.image = Some("weir:spec".into());
    s.pod_labels.insert("team".into(), "spec".into());
    s.pod_annotations.insert("b".into(), "spec".into());
    s.node_selector.insert("disk".into(), "ssd".into());
    s.tolerations.push(serde_json::from_value(json!({"key": "spot", "operator": "Exists"})).unwrap());
    s.affinity = Some(serde_json::from_value(json!({"nodeAffinity": {}})).unwrap());
    s.env.push(serde_json::from_value(json!({"name": "FOO", "value": "spec"})).unwrap());
    s.env_from.push(serde_json::from_value(json!({"secretRef": {"name": "spec-env"}})).unwrap());
    s.resources = Some(serde_json::from_value(json!({"requests": {"cpu": "500m"}})).unwrap());
    s.service_account_name = Some("spec-sa".into());
    let pod = worker_pod(&job, &run(None), 0, &WorkerSettings { default_image: Some("weir:default".into()), ..settings() }).unwrap();
    let meta = &pod.metadata;
    assert_eq!(meta.labels.as_ref().unwrap()["team"], "spec");
    assert_eq!(meta.labels.as_ref().unwrap()["tier"], "batch", "template labels the spec does not name stay");
    assert_eq!(meta.annotations.as_ref().unwrap()["a"], "template");
    assert_eq!(meta.annotations.as_ref().unwrap()["b"], "spec");
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.node_selector.as_ref().unwrap()["disk"], "ssd");
    assert_eq!(spec.node_selector.as_ref().unwrap()["zone"], "a");
    let tolerations: Vec<_> = spec.tolerations.iter().flatten().filter_map(|t| t.key.as_deref()).collect();
    assert_eq!(tolerations, ["dedicated", "spot"]);
    assert!(spec.affinity.as_ref().unwrap().node_affinity.is_some() && spec.affinity.as_ref().unwrap().pod_anti_affinity.is_none());
    assert_eq!(spec.service_account_name.as_deref(), Some("spec-sa"));
    let c = worker(&pod);
    assert_eq!(c.image.as_deref(), Some("weir:spec"));
    assert_eq!(env_value(c, "FOO").as_deref(), Some("spec"));
    assert_eq!(c.env.iter().flatten().filter(|e| e.name == "FOO").count(), 1, "no duplicate names");
    let from: Vec<_> = c.env_from.iter().flatten().map(|e| e.config_map_ref.as_ref().map(|r| r.name.clone()).or(e.secret_ref.as_ref().map(|r| r.name.clone())).unwrap()).collect();
    assert_eq!(from, ["template-env", "spec-env"]);
    assert_eq!(c.resources.as_ref().unwrap().requests.as_ref().unwrap()["cpu"].0, "500m");
}

#[test]
fn the_image_is_the_specs_else_the_templates_else_the_operators_default() {
    let with_default = WorkerSettings { default_image: Some("localhost/weir:0.1.0".into()), ..settings() };
    let none = JobBuilder::new("wc").spec(|s| s.image = None).build();
    assert_eq!(worker_image(&none, &with_default).as_deref(), Some("localhost/weir:0.1.0"));
    assert_eq!(worker_image(&none, &settings()), None);
    assert!(worker_pod(&none, &run(None), 0, &settings()).is_err(), "no image, no pod");
    let pod = worker_pod(&none, &run(None), 0, &with_default).unwrap();
    assert_eq!(worker(&pod).image.as_deref(), Some("localhost/weir:0.1.0"));
    let mut templated = templated();
    templated.spec.image = None;
    assert_eq!(worker_image(&templated, &with_default).as_deref(), Some("weir:template"));
    let named = JobBuilder::new("wc").build();
    assert_eq!(worker_image(&named, &with_default).as_deref(), Some("weir"));
}

#[test]
fn a_template_can_bring_its_own_tmp_and_its_own_token_mount_setting() {
    let job = JobBuilder::new("wc")
        .pod_template(|t| {
            t["spec"]["automountServiceAccountToken"] = json!(true);
            t["spec"]["volumes"].as_array_mut().unwrap().push(json!({"name": "scratch", "emptyDir": {"medium": "Memory"}}));
            t["spec"]["containers"][0]["volumeMounts"].as_array_mut().unwrap().push(json!({"name": "scratch", "mountPath": "/tmp"}));
        })
        .build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.automount_service_account_token, Some(true));
    assert!(!spec.volumes.iter().flatten().any(|v| v.name == "weir-tmp"));
    let tmp: Vec<_> = worker(&pod).volume_mounts.iter().flatten().filter(|m| m.mount_path == "/tmp").collect();
    assert_eq!((tmp.len(), tmp[0].name.as_str()), (1, "scratch"));
}

#[test]
fn the_network_policy_admits_the_operator_to_the_control_port_and_only_the_jobs_workers_to_the_data_ports() {
    let job = JobBuilder::new("wc").build();
    let settings = NetworkPolicySettings {
        namespace: "weir-system".into(),
        pod_labels: [("app.kubernetes.io/name".to_string(), "weir-operator".to_string())].into(),
    };
    let np = serde_json::to_value(network_policy(&job, &settings).unwrap()).unwrap();
    assert_eq!(np["metadata"]["name"], "wc-workers");
    assert_eq!(np["metadata"]["ownerReferences"][0]["kind"], "StreamJob");
    assert_eq!(np["spec"]["podSelector"], json!({"matchLabels": {"weir.dev/job": "wc"}}));
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress"]));
    assert_eq!(
        np["spec"]["ingress"],
        json!([
            {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "weir-system"}},
                       "podSelector": {"matchLabels": {"app.kubernetes.io/name": "weir-operator"}}}],
             "ports": [{"port": 6120, "protocol": "TCP"}]},
            {"from": [{"podSelector": {"matchLabels": {"weir.dev/job": "wc"}}}],
             "ports": [{"port": 6121, "protocol": "TCP"}, {"port": 6122, "protocol": "TCP"}]},
        ])
    );
}

#[test]
fn s3_storage_reaches_the_workers_as_settings_and_secret_references_never_as_values() {
    let job = JobBuilder::new("wc")
        .spec(|s| {
            s.checkpoint.storage = "s3://bucket/prefix".into();
            s.checkpoint.s3 = Some(weir_api::streamjob::S3Storage {
                endpoint: Some("http://minio.storage.svc:9000".into()),
                region: Some("eu-west-1".into()),
                path_style: true,
                credentials_secret: Some("minio-credentials".into()),
            });
            s.env.push(EnvVar { name: "WEIR_S3_REGION".into(), value: Some("local".into()), ..Default::default() });
        })
        .build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    let c = worker(&pod);
    assert!(c.args.clone().unwrap().join(" ").contains("--state-dir s3://bucket/prefix/jobs/wc"));
    assert_eq!(env_value(c, "WEIR_S3_ENDPOINT").as_deref(), Some("http://minio.storage.svc:9000"));
    assert_eq!(env_value(c, "WEIR_S3_PATH_STYLE").as_deref(), Some("true"));
    // The user's variable replaces the operator's, once.
    let env = c.env.clone().unwrap();
    let regions: Vec<_> = env.iter().filter(|e| e.name == "WEIR_S3_REGION").collect();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].value.as_deref(), Some("local"));
    for key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
        let e = env.iter().find(|e| e.name == key).unwrap_or_else(|| panic!("{key} missing"));
        assert!(e.value.is_none(), "{key} carries a value");
        let r = e.value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
        assert_eq!((r.name.as_str(), r.key.as_str()), ("minio-credentials", key));
    }
}

#[test]
fn s3_settings_are_not_given_to_a_job_whose_storage_is_a_volume() {
    let job = JobBuilder::new("wc")
        .spec(|s| s.checkpoint.s3 = Some(weir_api::streamjob::S3Storage { endpoint: Some("http://m:9000".into()), ..Default::default() }))
        .build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    assert_eq!(env_value(worker(&pod), "WEIR_S3_ENDPOINT"), None);
}

/// `spec.tls`: the Secret is mounted read-only beside (not inside) the
/// pipeline's directory, the worker is told where it is and which name the
/// certificate carries, and the kubelet probes over HTTPS.
#[test]
fn a_job_with_tls_mounts_its_certificate_and_probes_over_https() {
    let job = JobBuilder::new("wc").spec(|s| s.tls = Some(weir_api::streamjob::WorkerTls { secret_name: "wc-tls".into() })).build();
    let pod = worker_pod(&job, &run(None), 0, &settings()).unwrap();
    let c = worker(&pod);
    let args = c.args.clone().unwrap();
    let after = |flag: &str| args.iter().position(|a| a == flag).map(|i| args[i + 1].clone());
    assert_eq!(after("--tls-dir").as_deref(), Some(TLS_DIR));
    assert_eq!(after("--tls-server-name"), Some(format!("wc-workers.{}.svc", job.namespace().unwrap())));
    let mount = c.volume_mounts.as_ref().unwrap().iter().find(|m| m.mount_path == TLS_DIR).unwrap();
    assert_eq!(mount.read_only, Some(true));
    let volume = pod.spec.as_ref().unwrap().volumes.as_ref().unwrap().iter().find(|v| v.name == mount.name).unwrap();
    assert_eq!(volume.secret.as_ref().unwrap().secret_name.as_deref(), Some("wc-tls"));
    assert!(!TLS_DIR.starts_with(&format!("{}/", crate::names::PIPELINE_DIR)));
    assert_eq!(c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap().scheme.as_deref(), Some("HTTPS"));

    // Without spec.tls: none of it.
    let plain = worker_pod(&JobBuilder::new("wc").build(), &run(None), 0, &settings()).unwrap();
    let c = worker(&plain);
    assert!(!c.args.as_ref().unwrap().iter().any(|a| a.starts_with("--tls")));
    assert_eq!(c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap().scheme, None);
}
