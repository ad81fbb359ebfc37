//! The PostgreSQL sink's settings: which table, how to reach it, and which
//! of the sink contracts its writes follow.

use serde::{Deserialize, Serialize};

use super::{PipelineError, PipelineSource};

/// Rows of a PostgreSQL table: one row per record, a column per field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PostgresSinkSpec {
    /// How to reach the database, as libpq writes it: `host=H port=P
    /// dbname=D user=U` or `postgresql://U@H:P/D`. No password here: it
    /// comes from the environment variable `PGPASSWORD` (on Kubernetes, from a
    /// Secret: `spec.env` with `valueFrom.secretKeyRef`), so it is in no
    /// file, argument or message. TLS as in libpq: `sslmode` (`disable`,
    /// `prefer` (the default: TLS when the server offers it), `require`,
    /// `verify-ca`, `verify-full`), `sslrootcert` (the CA certificates, a PEM
    /// file; needed by the two `verify-` modes), `sslcert` and `sslkey` (a
    /// client certificate, PEM files, e.g. from a mounted Secret).
    pub connection: String,
    /// The table, `NAME` or `SCHEMA.NAME` (as written, case-sensitive). It
    /// must exist, with a column of the same name for every field of the
    /// records that reach the sink.
    pub table: String,
    #[serde(default)]
    pub mode: PostgresMode,
    /// `upsert` only: the columns of the table's primary key or of a unique
    /// constraint. Give the fields the pipeline keys by, so that one
    /// subtask writes every version of a row.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key: Vec<String>,
}

/// Which sink contract the writes follow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PostgresMode {
    /// Exactly-once: a subtask's rows of one checkpoint are one transaction,
    /// prepared (`PREPARE TRANSACTION`) at the barrier and committed (`COMMIT
    /// PREPARED`) when the checkpoint completes. Needs the server setting
    /// `max_prepared_transactions` above 0.
    #[default]
    TwoPhaseCommit,
    /// Exactly-once: a checkpoint's records go to a log in checkpoint
    /// storage at the barrier, and into the table when the checkpoint
    /// completes, in one transaction that moves the subtask's mark in
    /// `weir_sink_progress` (created in the table's schema; one row per
    /// subtask and run), which makes a repeated write a no-op. Nothing stays open in the database between
    /// checkpoints; every record is written twice.
    WriteAheadLog,
    /// Rows are written at once with `INSERT … ON CONFLICT (key) DO UPDATE`.
    /// Exactly-once for each key's final row; after a failure a reader may
    /// see an earlier version of a row again until the job has replayed
    /// past it.
    Upsert,
}

impl std::fmt::Display for PostgresMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PostgresMode::TwoPhaseCommit => "two-phase-commit",
            PostgresMode::Upsert => "upsert",
            PostgresMode::WriteAheadLog => "write-ahead-log",
        })
    }
}

impl PostgresSinkSpec {
    /// Checks the sink's settings; `at` is the sink's path (`sink`, `sinks.audit`).
    pub(super) fn validate(&self, src: &PipelineSource, at: &str) -> Result<(), PipelineError> {
        check_connection(src, &format!("{at}.postgres.connection"), &self.connection)?;
        check_table(src, &format!("{at}.postgres.table"), &self.table)?;
        match self.mode {
            PostgresMode::Upsert if self.key.is_empty() => Err(src.invalid(
                &format!("{at}.postgres.key"),
                "upsert needs the columns of the table's primary key or of a unique constraint, e.g. `key: [id]`",
            )),
            PostgresMode::TwoPhaseCommit | PostgresMode::WriteAheadLog if !self.key.is_empty() => Err(src.invalid(
                &format!("{at}.postgres.key"),
                "only `mode: upsert` uses a key; remove it, or set `mode: upsert`",
            )),
            _ => Ok(()),
        }
    }
}

/// A libpq connection string without a password (the sink's and a lookup
/// join's): the password comes from `PGPASSWORD`, so it is in no file or message.
pub(super) fn check_connection(src: &PipelineSource, field: &str, connection: &str) -> Result<(), PipelineError> {
    let connection = connection.trim();
    if connection.is_empty() {
        return Err(src.invalid(field, "expected `host=H port=P dbname=D user=U` or `postgresql://U@H:P/D`"));
    }
    if has_password(connection) {
        return Err(src.invalid(
            field,
            "contains a password: expected none here; set the environment variable PGPASSWORD instead (on Kubernetes from a Secret), so that it is in no file or message",
        ));
    }
    Ok(())
}

/// `NAME` or `SCHEMA.NAME`.
pub(super) fn check_table(src: &PipelineSource, field: &str, table: &str) -> Result<(), PipelineError> {
    let parts: Vec<&str> = table.split('.').collect();
    if parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(src.invalid(field, format!("{table:?}: expected NAME or SCHEMA.NAME")));
    }
    Ok(())
}

/// Whether a libpq connection string carries a password: a `password=`
/// keyword, or a URL whose user part has `user:password@`.
fn has_password(connection: &str) -> bool {
    if let Some(rest) = connection.strip_prefix("postgresql://").or_else(|| connection.strip_prefix("postgres://")) {
        let authority = rest.split(['/', '?']).next().unwrap_or_default();
        let userinfo = authority.rsplit_once('@').map(|(u, _)| u).unwrap_or_default();
        return userinfo.contains(':') || rest.contains("password=");
    }
    connection.split_whitespace().any(|kv| kv.trim_start().to_ascii_lowercase().starts_with("password"))
}

#[cfg(test)]
mod tests {
    use super::has_password;

    #[test]
    fn a_password_in_either_connection_form_is_found() {
        assert!(has_password("host=a user=b password=secret"));
        assert!(has_password("host=a user=b password = secret"));
        assert!(has_password("postgresql://u:secret@h:5432/db"));
        assert!(has_password("postgres://u@h/db?password=secret"));
        assert!(!has_password("host=a port=5432 dbname=d user=b"));
        assert!(!has_password("postgresql://u@h:5432/db"));
        assert!(!has_password("postgresql://h/db"));
    }
}
