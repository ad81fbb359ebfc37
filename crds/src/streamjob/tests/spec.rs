//! Parsing, defaults, the pipeline check and status helpers.

use serde_json::{json, Value};

use super::*;
use crate::pipeline::{CheckpointMode, Guarantee, PipelineError, PipelineSpec, StepKind};

// ---------------------------------------------------------------- parsing

#[test]
fn the_example_manifest_parses_with_the_fields_as_written() {
    let job = parse(&example_json());
    assert_eq!(job.metadata.name.as_deref(), Some("exactly-once"));
    assert_eq!(job.spec.image, None, "the operator's default worker image");
    // One claim at /var/lib/weir, mounted into the worker container.
    let template = job.spec.pod_template.as_ref().expect("a pod template");
    let pod = template.spec.as_ref().unwrap();
    let claim = pod.volumes.as_ref().unwrap()[0].persistent_volume_claim.as_ref().unwrap();
    assert_eq!(claim.claim_name, "weir-data");
    assert_eq!(pod.containers[0].name, "worker");
    assert_eq!(pod.containers[0].volume_mounts.as_ref().unwrap()[0].mount_path, "/var/lib/weir");
    assert_eq!(job.spec.parallelism, 2);
    assert_eq!(job.spec.checkpoint.interval.get().as_millis(), 500);
    assert_eq!(
        job.spec.checkpoint.storage,
        "file:///var/lib/weir/checkpoints"
    );
    assert_eq!(job.spec.guarantee, Some(Guarantee::ExactlyOnce));
}

#[test]
fn the_example_embeds_the_same_pipeline_as_the_weir_run_example() {
    let job = parse(&example_json());
    let mut embedded = job.spec.validate_pipeline().expect("a valid pipeline");
    let file = PipelineSpec::from_yaml(
        "exactly-once.yaml",
        include_str!("../../../../examples/exactly-once.yaml"),
    )
    .expect("the weir run example is valid");
    // Only the pace differs: the cluster example runs at a quarter of the
    // local one's rate, long enough to watch checkpoints advance in `kubectl get sj`.
    match (embedded.source.as_mut().unwrap(), file.source.as_ref().unwrap()) {
        (crate::SourceSpec::Generator(e), crate::SourceSpec::Generator(f)) => {
            assert!(e.rate > 0 && e.rate < f.rate, "the cluster example is the slower one");
            e.rate = f.rate;
        }
        other => panic!("both examples use the generator, got {other:?}"),
    }
    assert_eq!(
        (
            &embedded.name,
            &embedded.source,
            &embedded.steps,
            &embedded.sink
        ),
        (&file.name, &file.source, &file.steps, &file.sink)
    );
    // The deployment settings come from the StreamJob's spec.
    assert_eq!(embedded.parallelism, 2);
    assert_eq!(embedded.checkpoint, file.checkpoint);
}

#[test]
fn defaults_apply_to_what_the_manifest_does_not_write() {
    let spec = parse(&minimal()).spec;
    assert_eq!(spec.parallelism, 1);
    assert_eq!(spec.max_parallelism, 128);
    assert_eq!(spec.upgrade_mode, UpgradeMode::Savepoint);
    assert_eq!(spec.state, JobState::Running);
    assert_eq!(spec.checkpoint.interval.to_string(), "1s");
    assert_eq!(spec.checkpoint.timeout.to_string(), "1m");
    assert_eq!(spec.checkpoint.mode, CheckpointMode::Aligned);
    assert_eq!(spec.checkpoint.retain, 3);
    assert_eq!(spec.restart_backoff, RestartBackoff::default());
    assert_eq!(spec.restart_backoff.limit, 10);
    assert!(spec.savepoint_on_delete);
    assert!(!spec.allow_non_restored_state);
    assert_eq!(spec.savepoint_timeout.to_string(), "5m");
    assert_eq!(spec.deploy_timeout.to_string(), "10m");
    assert!(!spec.upgrade.rollback.enabled, "rollback is opt-in, as in the Flink operator");
    assert_eq!(spec.upgrade.rollback.readiness_timeout.to_string(), "5m");
    assert_eq!(
        (
            spec.guarantee,
            &spec.savepoint_trigger,
            &spec.initial_savepoint
        ),
        (None, &None, &None)
    );
}

#[test]
fn the_crd_schema_carries_the_same_defaults_as_the_types() {
    // The API server fills defaults from the schema, the controller from serde:
    // they must agree, or the same manifest means two things.
    let schema = openapi_schema();
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(spec["parallelism"]["default"], json!(1));
    assert_eq!(spec["maxParallelism"]["default"], json!(128));
    assert_eq!(spec["upgradeMode"]["default"], json!("savepoint"));
    assert_eq!(spec["savepointTimeout"]["default"], json!("5m"));
    assert_eq!(
        spec["checkpoint"]["properties"]["retain"]["default"],
        json!(3)
    );
    let defaulted = parse(&minimal()).spec;
    assert_eq!(
        spec["restartBackoff"]["default"],
        serde_json::to_value(&defaulted.restart_backoff).unwrap()
    );
}

#[test]
fn an_unknown_upgrade_mode_is_refused_when_parsing() {
    let bad = with(minimal(), "/spec/upgradeMode", json!("blue-green"));
    let err = serde_json::from_value::<StreamJob>(bad)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown variant `blue-green`") && err.contains("last-state"),
        "{err}"
    );
}

#[test]
fn a_malformed_duration_is_refused_when_parsing() {
    let bad = with(minimal(), "/spec/savepointTimeout", json!("5 parsecs"));
    let err = serde_json::from_value::<StreamJob>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown unit"), "{err}");
}

// ---------------------------------------------------------- the pipeline

#[test]
fn a_manifest_with_an_invalid_pipeline_still_deserializes_so_the_controller_can_report_it() {
    let bad = with(minimal(), "/spec/pipeline/steps", json!([{"explode": "x"}]));
    let job = parse(&bad);
    let err = job.spec.validate_pipeline().unwrap_err();
    assert!(err.to_string().contains("unknown step `explode`"), "{err}");
}

#[test]
fn a_cyclic_graph_is_refused_by_the_pipeline_check_naming_the_step() {
    let job = parse(&with(minimal(), "/spec/pipeline", graph_pipeline(true)));
    match job.spec.validate_pipeline() {
        Err(PipelineError::Invalid { file, field, message, .. }) => {
            assert_eq!((file.as_str(), field.as_str()), ("spec.pipeline", "steps[0].input"));
            assert_eq!(message, "`x` → `y` → `x` is a cycle: the steps of a pipeline form a DAG");
        }
        other => panic!("expected the cycle, got {other:?}"),
    }
    let valid = parse(&with(minimal(), "/spec/pipeline", graph_pipeline(false)));
    assert_eq!(valid.spec.validate().unwrap().graph().sinks[0].inputs, ["y"]);
}

#[test]
fn a_pipeline_that_is_not_a_map_says_what_it_should_hold() {
    let job = parse(&with(minimal(), "/spec/pipeline", json!("source: x")));
    let err = job.spec.validate_pipeline().unwrap_err().to_string();
    assert!(err.contains("expected a map with name, source(s), steps and sink(s)"), "{err}");
}

#[test]
fn pipeline_errors_carry_the_same_messages_as_weir_run() {
    // The same pipeline as a `weir run` file and embedded in a StreamJob.
    let cases = [
        "name: t\nsource:\n  generator: {}\nsteps:\n  - key_by: key\n  - explode: x\nsink:\n  blackhole: {}\n",
        "name: t\nsource:\n  generator: {}\nsteps:\n  - running_count: n\nsink:\n  blackhole: {}\n",
        "name: t\nsource:\n  generator: {keys: 0}\nsink:\n  blackhole: {}\n",
        "name: 'no spaces'\nsource:\n  generator: {}\nsink:\n  blackhole: {}\n",
    ];
    for text in cases {
        let file_err = PipelineSpec::from_yaml("p.yaml", text).unwrap_err();
        let pipeline: Value = serde_yaml::from_str(text).unwrap();
        let job = parse(&with(minimal(), "/spec/pipeline", pipeline));
        let job_err = job.spec.validate_pipeline().unwrap_err();
        assert_eq!(
            what_is_wrong(&job_err),
            what_is_wrong(&file_err),
            "\nfile: {file_err}\njob:  {job_err}"
        );
        assert!(
            job_err.to_string().starts_with(PIPELINE_ERROR_NAME),
            "{job_err}"
        );
    }
}

/// The part of a pipeline error that does not depend on where the text came from.
fn what_is_wrong(err: &PipelineError) -> String {
    match err {
        PipelineError::Invalid { field, message, .. } => format!("{field}: {message}"),
        // serde_yaml's message ends with the position in the text: drop it.
        PipelineError::Syntax { message, .. } => message
            .split(" at line")
            .next()
            .unwrap_or(message)
            .to_string(),
        other => other.to_string(),
    }
}

#[test]
fn spec_parallelism_and_checkpoint_settings_reach_the_pipeline() {
    let job = parse(&with(
        with(minimal(), "/spec/parallelism", json!(3)),
        "/spec/checkpoint",
        json!({"storage": "s3://bucket/jobs", "interval": "250ms", "retain": 5}),
    ));
    let p = job.spec.validate_pipeline().unwrap();
    assert_eq!((p.parallelism, p.max_parallelism), (3, 128));
    assert_eq!(p.checkpoint.interval.get().as_millis(), 250);
    assert_eq!(p.checkpoint.retain, 5);
}

#[test]
fn a_pipeline_parallelism_that_disagrees_with_the_spec_is_refused_and_one_that_agrees_is_kept() {
    let disagree = parse(&with(minimal(), "/spec/pipeline/parallelism", json!(4)));
    let err = disagree.spec.validate_pipeline().unwrap_err().to_string();
    assert!(
        err.contains("parallelism") && err.contains("spec.parallelism 1"),
        "{err}"
    );
    let agree = parse(&with(minimal(), "/spec/pipeline/parallelism", json!(1)));
    assert_eq!(agree.spec.validate_pipeline().unwrap().parallelism, 1);
    let checkpoint = parse(&with(
        minimal(),
        "/spec/pipeline/checkpoint",
        json!({"interval": "1s"}),
    ));
    let err = checkpoint.spec.validate_pipeline().unwrap_err().to_string();
    assert!(err.contains("spec.checkpoint"), "{err}");
}

#[test]
fn parallelism_above_max_parallelism_is_refused_by_the_pipeline_check_too() {
    // For specs that did not come through the API server (files, tests).
    let job = parse(&with(
        with(minimal(), "/spec/parallelism", json!(9)),
        "/spec/maxParallelism",
        json!(8),
    ));
    let err = job.spec.validate_pipeline().unwrap_err().to_string();
    assert!(err.contains("above max_parallelism 8"), "{err}");
}

#[test]
fn the_embedded_pipeline_round_trips_unchanged() {
    let job = parse(&example_json());
    let again: StreamJob = serde_json::from_value(serde_json::to_value(&job).unwrap()).unwrap();
    assert_eq!(job, again);
    assert_eq!(job.spec.pipeline.0, example_json()["spec"]["pipeline"]);
    let p = job.spec.validate_pipeline().unwrap();
    assert_eq!(p.steps[1].kind, StepKind::RunningCount("count".into()));
}

#[test]
fn a_requested_guarantee_the_pipeline_cannot_give_is_refused_not_claimed() {
    let stdout = with(minimal(), "/spec/pipeline/sink", json!({"stdout": {}}));
    let job = parse(&with(
        stdout.clone(),
        "/spec/guarantee",
        json!("exactly-once"),
    ));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(
        err.contains("spec: guarantee: the pipeline gives at-least-once"),
        "{err}"
    );
    let job = parse(&with(
        stdout.clone(),
        "/spec/guarantee",
        json!("at-least-once"),
    ));
    assert!(job.spec.validate().is_ok());
    // Unset: the job gives what the pipeline gives.
    assert!(parse(&stdout).spec.validate().is_ok());
}

#[test]
fn an_at_most_once_job_must_upgrade_statelessly() {
    let socket = with(
        minimal(),
        "/spec/pipeline/source",
        json!({"socket": {"address": "events.feeds.svc:9000", "schema": {"id": "int64"}}}),
    );
    let err = parse(&socket).spec.validate().unwrap_err().to_string();
    assert!(
        err.contains("spec: upgradeMode: the job is at-most-once (the socket source cannot replay")
            && err.contains("expected upgradeMode: stateless"),
        "{err}"
    );
    let stateless = parse(&with(socket, "/spec/upgradeMode", json!("stateless")));
    assert_eq!(
        stateless.spec.validate().unwrap().guarantee(),
        Guarantee::AtMostOnce
    );
}

#[test]
fn restart_backoff_initial_above_max_is_refused() {
    let job = parse(&with(
        minimal(),
        "/spec/restartBackoff",
        json!({"initial": "2m", "max": "1m"}),
    ));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(
        err.contains("restartBackoff.initial: 2m is above restartBackoff.max 1m"),
        "{err}"
    );
}

#[test]
fn a_deploy_timeout_of_zero_is_refused_naming_the_field() {
    let job = parse(&with(minimal(), "/spec/deployTimeout", json!("0s")));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(err.contains("deployTimeout: expected a duration above 0"), "{err}");
    let job = parse(&with(minimal(), "/spec/deployTimeout", json!("90s")));
    assert_eq!(job.spec.deploy_timeout.get(), std::time::Duration::from_secs(90));
    assert!(job.spec.validate().is_ok());
}

#[test]
fn rollback_settings_parse_and_a_readiness_timeout_of_zero_is_refused_naming_the_field() {
    let job = parse(&with(minimal(), "/spec/upgrade", json!({"rollback": {"enabled": true, "readinessTimeout": "0s"}})));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(err.contains("upgrade.rollback.readinessTimeout: expected a duration above 0"), "{err}");
    let job = parse(&with(minimal(), "/spec/upgrade", json!({"rollback": {"enabled": true, "readinessTimeout": "90s"}})));
    assert!(job.spec.upgrade.rollback.enabled);
    assert_eq!(job.spec.upgrade.rollback.readiness_timeout.get(), std::time::Duration::from_secs(90));
    assert!(job.spec.validate().is_ok());
    let job = parse(&with(minimal(), "/spec/upgrade", json!({"rollback": {"enabled": true}})));
    assert_eq!(job.spec.upgrade.rollback.readiness_timeout.to_string(), "5m");
}

#[test]
fn a_deploy_timeout_that_is_no_duration_is_refused_naming_the_field() {
    let value = with(minimal(), "/spec/deployTimeout", json!("ten minutes"));
    let err = serde_json::from_value::<StreamJob>(value).unwrap_err().to_string();
    assert!(err.contains("deployTimeout") || err.contains("is not a duration"), "{err}");
}

#[test]
fn a_savepoint_timeout_shorter_than_two_checkpoint_timeouts_is_refused_naming_both() {
    let job = parse(&with(minimal(), "/spec/savepointTimeout", json!("90s")));
    let err = job.spec.validate().unwrap_err().to_string();
    assert!(
        err.contains("savepointTimeout: 90s is below twice checkpoint.timeout (1m)")
            && err.contains("expected at least 2m"),
        "{err}"
    );
    let job = parse(&with(
        with(minimal(), "/spec/savepointTimeout", json!("90s")),
        "/spec/checkpoint/timeout",
        json!("45s"),
    ));
    assert!(job.spec.validate().is_ok());
}

#[test]
fn the_example_passes_every_controller_check() {
    assert_eq!(
        parse(&example_json()).spec.validate().unwrap().parallelism,
        2
    );
}

// ------------------------------------------------------------ the status

#[test]
fn savepoint_history_keeps_only_the_newest_entries() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut status = StreamJobStatus::default();
    for id in 0..(SAVEPOINT_HISTORY_LIMIT as i64 + 5) {
        status.record_savepoint(SavepointRef {
            id,
            path: format!("/sp/{id}"),
            time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
            reason: SavepointReason::Trigger,
        });
    }
    assert_eq!(status.savepoint_history.len(), SAVEPOINT_HISTORY_LIMIT);
    assert_eq!(status.savepoint_history[0].id, 5);
    assert_eq!(
        status.last_savepoint.as_ref().map(|s| s.id),
        Some(SAVEPOINT_HISTORY_LIMIT as i64 + 4)
    );
}

#[test]
fn a_job_name_must_fit_the_jobs_service_name_and_a_label_value() {
    assert_eq!(MAX_NAME_LENGTH, 55);
    assert_eq!(NAME_LENGTH_RULE, format!("size(self.metadata.name) <= {MAX_NAME_LENGTH}"));
    for good in ["a", "exactly-once", "job2", &"a".repeat(55)] {
        assert_eq!(check_job_name(good), Ok(()), "{good}");
    }
    for bad in [&"a".repeat(56), "2jobs", "my.job", "Job", "job-", "", "jöb"] {
        assert!(check_job_name(bad).unwrap_err().starts_with("metadata.name must"), "{bad:?}");
    }
}

#[test]
fn a_pod_template_with_only_pod_fields_parses_and_keeps_them() {
    let job = parse(&with(
        minimal(),
        "/spec/podTemplate",
        json!({"metadata": {"labels": {"team": "data"}}, "spec": {"nodeSelector": {"disk": "ssd"}, "priorityClassName": "streaming"}}),
    ));
    let t = job.spec.pod_template.unwrap();
    assert_eq!(t.metadata.unwrap().labels.unwrap()["team"], "data");
    let spec = t.spec.unwrap();
    assert!(spec.containers.is_empty());
    assert_eq!(spec.priority_class_name.as_deref(), Some("streaming"));
}

#[test]
fn the_checkpoint_mode_and_alignment_timeout_of_the_spec_reach_the_pipeline() {
    let job = parse(&with(
        minimal(),
        "/spec/checkpoint/alignmentTimeout",
        serde_json::json!("250ms"),
    ));
    let pipeline = job.spec.validate().unwrap();
    assert_eq!(
        pipeline.checkpoint.unaligned_after(),
        Some(std::time::Duration::from_millis(250))
    );
    let job = parse(&with(
        minimal(),
        "/spec/checkpoint/mode",
        serde_json::json!("unaligned"),
    ));
    assert_eq!(
        job.spec.validate().unwrap().checkpoint.mode,
        CheckpointMode::Unaligned
    );
    let both = with(
        with(
            minimal(),
            "/spec/checkpoint/mode",
            serde_json::json!("unaligned"),
        ),
        "/spec/checkpoint/alignmentTimeout",
        serde_json::json!("1s"),
    );
    let err = parse(&both).spec.validate().unwrap_err();
    assert!(err.to_string().contains("alignment_timeout"), "{err}");
}

#[test]
fn savepoint_settings_parse_with_ten_kept_by_default_and_bad_values_are_refused_naming_the_field() {
    let job = parse(&minimal());
    assert_eq!((job.spec.savepoints.interval, job.spec.savepoints.max_count, job.spec.savepoints.max_age), (None, 10, None));
    let job = parse(&with(minimal(), "/spec/savepoints", json!({"interval": "30m", "maxCount": 3, "maxAge": "24h"})));
    assert_eq!(job.spec.savepoints.interval.unwrap().get(), std::time::Duration::from_secs(1800));
    assert_eq!(job.spec.savepoints.max_count, 3);
    assert!(job.spec.validate().is_ok());
    for (settings, expected) in [
        (json!({"interval": "500ms"}), "savepoints.interval: 500ms is too short: expected at least 1s"),
        (json!({"maxCount": 0}), "savepoints.maxCount: 0 is out of range: expected 1 to 100"),
        (json!({"maxCount": 101}), "savepoints.maxCount: 101 is out of range: expected 1 to 100"),
        (json!({"maxAge": "0s"}), "savepoints.maxAge: expected a duration above 0"),
    ] {
        let job = parse(&with(minimal(), "/spec/savepoints", settings));
        let err = job.spec.validate().unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
}
