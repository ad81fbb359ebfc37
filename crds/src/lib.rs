//! The API that the operator and the runtime share.
//!
//! Today this is the pipeline format (`weir run PIPELINE.yaml` and, later, the
//! `pipeline` field of a StreamJob). The crate deliberately knows nothing about
//! how a pipeline is executed: it parses, checks what can be checked without an
//! expression engine, and reports errors that name the file, the line and the
//! field.
//!
//! `streamjob` is the Kubernetes custom resource the operator reconciles; it
//! embeds the pipeline format unchanged. `control` holds the wire types of a
//! job's HTTP control endpoint (membership, status, savepoints).
//! `object_store_url` is the one check of an object-store location.

pub mod control;
pub mod object_store_url;
pub mod pipeline;
pub mod streamjob;

pub use pipeline::{
    BadLines, BadMessages, CheckpointMode, CheckpointSpec, FileSinkSpec, FileSourceSpec, GeneratorSpec, Guarantee,
    KafkaSinkSpec, KafkaSourceSpec, PipelineError, PipelineSpec, PostgresMode, PostgresSinkSpec, SinkContract, SinkSpec, SocketSourceSpec, SourceSpec, Step, StepKind,
};
