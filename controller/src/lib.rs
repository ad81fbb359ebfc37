//! The weir operator: reconciles each `StreamJob` into the worker pods of the
//! runtime, takes savepoints before upgrades, restores the job after pod
//! failures, and reports progress in the StreamJob's status.
//!
//! A reconcile is four steps, each its own module:
//! 1. observe ([`observe`]): the job's pods and, when its pods run, the job's
//!    progress from its coordinator's control endpoint ([`worker_api`]);
//! 2. decide ([`lifecycle`]): a pure function of the StreamJob and what was
//!    observed that returns the new status, the effects and the events;
//!    one state of the lifecycle per file, transitions checked by the type system;
//! 3. write the status (server-side apply) *before* acting, so that an operator
//!    restarted at any point continues from what it decided;
//! 4. act ([`reconcile`]): apply the desired objects ([`desired`], pure
//!    builders), delete pods, push membership, request savepoints. Every
//!    effect is idempotent given the status.
//!
//! Deliberately does not know: Arrow, DataFusion, the checkpoint format or its
//! storage. It links only `weir-api` and talks to workers over HTTP.

pub mod context;
pub mod control_key;
pub mod desired;
pub mod error;
pub mod lifecycle;
pub mod metrics;
pub mod names;
pub mod observe;
pub mod pod_cache;
pub mod reconcile;
pub mod server;
pub mod spec_hash;
pub mod worker_api;

#[cfg(test)]
pub mod testing;

pub use error::{Error, Result};

/// The field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "weir-controller";
