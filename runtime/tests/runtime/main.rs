//! The runtime's end-to-end tests, one module per theme, linked into one test
//! binary: each separate binary would compile `common` again and link
//! DataFusion again, which cost minutes of every cold build for nothing.
//!
//! Run one theme with `cargo test --release --workspace --test runtime <module>::`,
//! for example `--test runtime postgres_sink::`.

mod common;

mod azure_storage;
mod bad_input;
mod exactly_once;
mod graphs;
mod guarantees;
mod joins;
mod incremental;
mod kafka;
mod kafka_security;
mod lifecycle;
mod lifecycle_paths;
mod lookup;
mod pipelines;
mod pod_mode;
mod postgres_crash_points;
mod postgres_sink;
mod postgres_tls;
mod s3_storage;
mod savepoint_compat;
mod several_sinks;
mod unaligned;
mod windows;
