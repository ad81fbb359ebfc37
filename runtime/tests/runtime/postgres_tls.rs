//! The PostgreSQL sink over TLS against a real server that takes only TLS
//! connections, with `sslmode`, `sslrootcert` and the host name set in the
//! connection string as libpq users set them: a verified connection writes
//! the table exactly once; a certificate of another CA, a certificate for
//! another name under `verify-full`, or `sslmode=disable` stop the job at
//! once with the reason, and never with the password.

use crate::common::*;
use crate::postgres_sink::run_failing;

/// A two-phase-commit job into `pg` whose connection string ends in `tls`
/// and names the server as `host` (its address is always 127.0.0.1).
fn job_over_tls(pg: &postgres::Server, host: &str, tls: &str) -> Job {
    let job = Job::counting(2, 20_000, 17, 20_000, "150ms").output_to_postgres(pg, "two-phase-commit", "seq bigint, key bigint, value bigint, count bigint");
    let yaml = std::fs::read_to_string(job.path("pipeline.yaml")).unwrap();
    let plain = format!("connection: {}", pg.connection());
    assert!(yaml.contains(&plain), "the pipeline does not hold {plain:?}");
    let connection = format!("host={host} hostaddr=127.0.0.1 port={} dbname={} user={} {tls}", pg.port, postgres::DATABASE, postgres::USER);
    job.write_pipeline(&yaml.replace(&plain, &format!("connection: {connection}")));
    job
}

#[test]
fn verify_full_against_the_servers_ca_writes_the_table_exactly_once() {
    let (pg, certs) = postgres::Server::start_tls();
    let job = job_over_tls(&pg, "localhost", &format!("sslmode=verify-full sslrootcert={}", certs.ca.display()));
    let out = job.run(&[]);
    assert!(out.status.success(), "the job failed over TLS:\n{}", stderr(&out));
    job.assert_exactly_once();
    assert!(pg.prepared().is_empty(), "prepared transactions left: {:?}", pg.prepared());
}

#[test]
fn a_plain_connection_to_a_tls_only_server_fails_naming_the_sslmode_and_the_servers_reason() {
    let (pg, _certs) = postgres::Server::start_tls();
    let err = run_failing(&job_over_tls(&pg, "localhost", "sslmode=disable"));
    assert!(err.contains("sslmode=disable") && err.contains("no encryption"), "{err}");
}

#[test]
fn a_certificate_of_another_ca_or_for_another_name_is_refused_with_the_reason() {
    let (pg, certs) = postgres::Server::start_tls();
    let err = run_failing(&job_over_tls(&pg, "localhost", &format!("sslmode=verify-full sslrootcert={}", certs.other_ca.display())));
    assert!(err.contains("sslmode=verify-full") && err.contains("invalid peer certificate") && err.contains("UnknownIssuer"), "{err}");

    // The certificate names localhost, not 127.0.0.1: verify-full refuses
    // it, verify-ca (the chain only, as libpq) and require (encryption
    // only) accept it.
    let err = run_failing(&job_over_tls(&pg, "127.0.0.1", &format!("sslmode=verify-full sslrootcert={}", certs.ca.display())));
    assert!(err.contains("invalid peer certificate") && err.contains("not valid for name \"127.0.0.1\""), "{err}");
    for tls in [format!("sslmode=verify-ca sslrootcert={}", certs.ca.display()), "sslmode=require".to_string()] {
        let job = job_over_tls(&pg, "127.0.0.1", &tls);
        let out = job.run(&[]);
        assert!(out.status.success(), "{tls}: the job failed:\n{}", stderr(&out));
        job.assert_exactly_once();
    }
}

#[test]
fn verify_full_without_a_root_certificate_is_refused_before_connecting() {
    let (pg, _certs) = postgres::Server::start_tls();
    let err = run_failing(&job_over_tls(&pg, "localhost", "sslmode=verify-full"));
    assert!(err.contains("sink.postgres.connection") && err.contains("needs sslrootcert"), "{err}");
}
