//! The Kafka source and sink over TLS with SASL/SCRAM, against a real
//! broker whose second listener takes nothing else: Kafka → weir → Kafka
//! with worker kills is exactly once with the password read from an
//! environment variable; a wrong password, a certificate of another CA and
//! a missing variable stop the job at once with the reason, and never with
//! the password.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::kafka::run_with_worker_kills;

/// The environment variable the jobs' `properties_from_env` names.
const PASSWORD_VAR: &str = "WEIR_TEST_KAFKA_PASSWORD";

/// One broker with a SASL_SSL listener for these tests (a static is never
/// dropped: the broker's watchdog stops it when the test process ends).
fn broker() -> &'static kafka::PrivateBroker {
    static BROKER: OnceLock<kafka::PrivateBroker> = OnceLock::new();
    BROKER.get_or_init(kafka::PrivateBroker::start_with_sasl_ssl)
}

/// `job`'s Kafka source and sink moved from the broker's plain listener
/// to its SASL_SSL one, with `ca` as the trusted CA.
fn over_sasl_ssl(mut job: Job, broker: &kafka::PrivateBroker, ca: &std::path::Path, password: &str) -> Job {
    let secure = broker.sasl_ssl();
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    let plain = format!("    bootstrap_servers: {}\n", broker.addr);
    assert!(yaml.contains(&plain), "the pipeline does not use the broker's plain listener");
    let settings = format!(
        "    bootstrap_servers: {}\n    properties:\n      security.protocol: SASL_SSL\n      sasl.mechanism: SCRAM-SHA-512\n      sasl.username: {}\n      ssl.ca.location: {}\n    properties_from_env:\n      sasl.password: {PASSWORD_VAR}\n",
        secure.addr,
        secure.user,
        ca.display()
    );
    job.write_pipeline(&yaml.replace(&plain, &settings));
    job.env.push((PASSWORD_VAR.into(), password.into()));
    job
}

#[test]
fn kafka_to_kafka_over_sasl_ssl_with_worker_kills_is_exactly_once() {
    let broker = broker();
    let plain = broker.client();
    let secure = broker.sasl_ssl();
    let job = Job::counting(2, 30_000, 40, 0, "200ms").input_from_kafka_on(&plain, 3, 10_000).output_to_kafka_on(&plain, "exactly-once");
    let job = over_sasl_ssl(job, broker, &secure.ca, secure.password);
    let log = run_with_worker_kills(&job);
    assert!(!log.contains(secure.password), "the password is in the job's output");
    // Read back through the plain listener, as any read_committed consumer.
    job.assert_exactly_once();
    job.assert_no_open_transaction();
}

/// Runs `job`, which must fail without restarting; returns its stderr.
fn run_refused(job: &Job) -> String {
    let start = Instant::now();
    let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(120));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "the job did not fail as it should:\n{err}");
    assert!(start.elapsed() < Duration::from_secs(75), "the job kept retrying instead of failing: {:?}\n{err}", start.elapsed());
    err
}

fn copy_job(broker: &kafka::PrivateBroker) -> Job {
    Job::counting(1, 100, 10, 0, "200ms").input_from_kafka_on(&broker.client(), 1, 0)
}

#[test]
fn a_wrong_password_or_an_unknown_ca_stops_the_job_with_the_reason_and_never_the_password() {
    let broker = broker();
    let secure = broker.sasl_ssl();

    let err = run_refused(&over_sasl_ssl(copy_job(broker), broker, &secure.ca, "not-the-password-91"));
    assert!(err.contains("refused the connection") && err.contains("Authentication failed"), "{err}");
    assert!(!err.contains("not-the-password-91") && !err.contains(secure.password), "{err}");

    let err = run_refused(&over_sasl_ssl(copy_job(broker), broker, &secure.other_ca, secure.password));
    assert!(err.contains("refused the connection") && err.contains("certificate verify failed"), "{err}");
}

#[test]
fn a_secret_setting_whose_variable_is_not_set_is_named_before_connecting() {
    let broker = broker();
    let secure = broker.sasl_ssl();
    let mut job = over_sasl_ssl(copy_job(broker), broker, &secure.ca, secure.password);
    job.env.retain(|(k, _)| k != PASSWORD_VAR);
    let err = run_refused(&job);
    assert!(err.contains(&format!("source.kafka.properties_from_env.sasl.password: the environment variable {PASSWORD_VAR} is not set")), "{err}");
}
