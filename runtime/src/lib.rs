//! weir's streaming runtime: plans a pipeline, runs it as worker processes
//! with barrier checkpoints, and restores it after failures. See
//! ARCHITECTURE.md at the repository root for the map.

pub mod checkpoint;
pub mod control;
pub mod error;
pub mod exchange;
pub mod expr;
pub mod fault;
pub mod kafka;
pub mod key_group;
pub mod local;
pub mod operator;
pub mod plan;
pub mod sink;
pub mod source;
pub mod worker;

pub use error::{Error, Result};
