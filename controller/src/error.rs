//! The operator's one error type. Errors about a user's StreamJob are not
//! errors here: they become status and events. These are the failures of a
//! reconcile itself (the API server or a worker did not answer), retried
//! with a short delay.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error("Kubernetes API: {action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },

    #[error("StreamJob has no namespace (it is a namespaced resource)")]
    NoNamespace,

    #[error("building {object}: {message}")]
    Build { object: String, message: String },

    #[error("worker control endpoint at {addr}: {message}")]
    Worker { addr: String, message: String },

    /// A setting of the operator itself that cannot be used (it does not start).
    #[error("{0}")]
    Config(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a kube error with what the operator was doing.
    pub fn kube(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let action = action.into();
        move |source| Error::Kube { action, source }
    }

    /// A short label for the errors metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "kube",
            Error::NoNamespace => "no_namespace",
            Error::Build { .. } => "build",
            Error::Worker { .. } => "worker",
            Error::Config(_) => "config",
        }
    }
}
