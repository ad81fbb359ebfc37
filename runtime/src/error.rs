//! The runtime's one error type. Every variant says what was being done, so
//! that a message read in a log names the file, the checkpoint or the peer.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Pipeline(#[from] weir_api::PipelineError),

    #[error("{context}: {message}")]
    Plan { context: String, message: String },

    #[error("checkpoint storage {location}: {source}")]
    Storage {
        location: String,
        #[source]
        source: object_store::Error,
    },

    #[error("{location} is not a usable checkpoint: {message}")]
    BadCheckpoint { location: String, message: String },

    #[error("state directory {dir}: {message}")]
    StateDir { dir: String, message: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{context}: {source}")]
    Arrow {
        context: String,
        #[source]
        source: arrow::error::ArrowError,
    },

    #[error("expression `{expr}` in {field}: {message}")]
    Expression {
        field: String,
        expr: String,
        message: String,
    },

    #[error("source file {path}: {message}")]
    SourceFile { path: PathBuf, message: String },

    /// A line of a source that is not a file (a socket) that the source
    /// cannot decode, under `bad_lines: fail`.
    #[error("{source_name}: {message}")]
    SourceLine { source_name: String, message: String },

    #[error("connection to {peer}: {message}")]
    Network { peer: String, message: String },

    #[error("protocol error from {peer}: {message}")]
    Protocol { peer: String, message: String },

    /// Another run of the job holds its state or output directory.
    #[error("{message}")]
    AlreadyRunning { message: String },

    /// A step failed on one record (division by zero, a failed cast, an
    /// overflow). The same record meets the same step after every restore, so
    /// this is fatal; the message says which step, and which record.
    #[error("{step}: {message}; the record: {record}{}", position.as_ref().map(|p| format!(" (read from {p})")).unwrap_or_default())]
    Record {
        /// The step's field in the pipeline, e.g. `steps[1].select`.
        step: String,
        message: String,
        /// The offending record as JSON (shortened if long).
        record: String,
        /// Where the source read it, when known.
        position: Option<String>,
    },

    /// A record too big for one frame of the exchange; smaller batches are
    /// split, but one record cannot be.
    #[error("{context}: one record takes {bytes} bytes encoded, more than the exchange's frame limit of {limit} bytes")]
    RecordTooLarge { context: String, bytes: usize, limit: usize },

    /// A pending sink file of a completed checkpoint is gone under both its
    /// in-progress and its final name: its records are lost, and every
    /// restore of that checkpoint would find the same.
    #[error("file sink: {temp} (checkpoint {checkpoint}) is gone, and so is its final name {final_name}: the records of a completed checkpoint are lost; was the output directory cleaned while the job ran?")]
    LostPendingFile { temp: String, final_name: String, checkpoint: u64 },

    /// A write-ahead log entry of a completed checkpoint is gone before it
    /// was written to its target: its records are lost.
    #[error("sink: the log entry {location} of completed checkpoint {checkpoint} is gone before its records reached their target; were the job's checkpoints cleaned while it ran?")]
    LostLogEntry { location: String, checkpoint: u64 },

    /// The file sink's object store (`s3://` output) failed a request; it
    /// is retried by restoring the job.
    #[error("file sink {location}: {source}")]
    Output {
        location: String,
        #[source]
        source: object_store::Error,
    },

    /// The PostgreSQL sink's server refused or failed a request. `code` is
    /// the SQLSTATE when the server answered.
    #[error("{context}: {message}{}", code.as_ref().map(|c| format!(" (SQLSTATE {c})")).unwrap_or_default())]
    Postgres { context: String, code: Option<String>, message: String },

    /// A Kafka client failed or was refused; `fatal` when a restart would
    /// meet the same (a missing topic, a bad message under `fail`).
    #[error("{context}: {message}")]
    Kafka { context: String, message: String, fatal: bool },

    /// A newer run of the job has claimed its state: this run is superseded
    /// (its node was cut off, its processes frozen, or another `weir run`
    /// took over) and must not complete a checkpoint or commit output.
    #[error("run {run_id} (run epoch {epoch}) of this job was superseded by run {newer}, which claimed the job's state in {location}; this run stops without committing anything")]
    Fenced { run_id: String, epoch: u64, newer: String, location: String },

    /// The local supervisor gave up at once on a worker's fatal error.
    #[error("the job failed and cannot be restarted: {0}")]
    Fatal(String),

    #[error("{0}")]
    Job(String),

    /// A subtask's peer is gone: a downstream subtask dropped its channel,
    /// or an input closed before its end of stream. Mostly the echo of
    /// another subtask's failure, whose own error is the one to report.
    #[error("{0}")]
    PeerGone(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    pub fn arrow(context: impl Into<String>) -> impl FnOnce(arrow::error::ArrowError) -> Error {
        let context = context.into();
        move |source| Error::Arrow { context, source }
    }

    /// Whether a restart would meet this error again: bad input, a bad
    /// pipeline, an unusable checkpoint, a record a step cannot process. The
    /// worker exits with `EXIT_FATAL` for these, and whoever supervises it
    /// (`weir run`, the operator) stops instead of restoring the job. Anything
    /// else (a lost peer, storage that did not answer) is worth a restart.
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::Pipeline(_)
            | Error::Plan { .. }
            | Error::Expression { .. }
            | Error::SourceFile { .. }
            | Error::SourceLine { .. }
            | Error::BadCheckpoint { .. }
            | Error::StateDir { .. }
            | Error::Record { .. }
            | Error::RecordTooLarge { .. }
            | Error::LostPendingFile { .. }
            | Error::LostLogEntry { .. }
            | Error::AlreadyRunning { .. }
            | Error::Fenced { .. }
            | Error::Fatal(_) => true,
            // What the server refuses for the data or the declarations
            // (data exceptions, constraint violations, a wrong table, type,
            // privilege or password) it refuses again after a restart; a
            // lost connection, a deadlock or a server shutting down is
            // worth one.
            Error::Kafka { fatal, .. } => *fatal,
            Error::Postgres { code: Some(code), .. } => matches!(&code[..2.min(code.len())], "22" | "23" | "28" | "42"),
            Error::Storage { .. }
            | Error::Output { .. }
            | Error::Io { .. }
            | Error::Arrow { .. }
            | Error::Network { .. }
            | Error::Protocol { .. }
            | Error::Postgres { .. }
            | Error::Job(_)
            | Error::PeerGone(_) => false,
        }
    }

    pub fn storage(location: impl Into<String>) -> impl FnOnce(object_store::Error) -> Error {
        let location = location.into();
        move |source| Error::Storage { location, source }
    }
}
