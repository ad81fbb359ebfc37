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

    #[error("connection to {peer}: {message}")]
    Network { peer: String, message: String },

    #[error("protocol error from {peer}: {message}")]
    Protocol { peer: String, message: String },

    /// Another run of the job holds its state or output directory.
    #[error("{message}")]
    AlreadyRunning { message: String },

    #[error("{0}")]
    Job(String),
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

    pub fn storage(location: impl Into<String>) -> impl FnOnce(object_store::Error) -> Error {
        let location = location.into();
        move |source| Error::Storage { location, source }
    }
}
