//! The PostgreSQL sink: one row per record in a table the user declares.
//!
//! Two of the sink contracts, chosen by `mode`:
//!
//! - `two_phase.rs`: exactly-once by two-phase commit. A subtask's rows of
//!   one checkpoint interval are one transaction, prepared at the barrier
//!   (`PREPARE TRANSACTION` under a global id naming job, run, subtask and
//!   checkpoint) and committed (`COMMIT PREPARED`) when the checkpoint
//!   completes. A prepared transaction survives the process, so a restore
//!   commits the restored checkpoint's transactions and rolls back the job's
//!   others that no retained snapshot references.
//! - `write_ahead.rs`: exactly-once through a write-ahead log. A
//!   checkpoint's records go to a log file in checkpoint storage at the
//!   barrier and into the table, with an acknowledgement row in the same
//!   transaction, when the checkpoint completes.
//! - `upsert.rs`: idempotent writes. Rows go out at once as `INSERT … ON
//!   CONFLICT (key) DO UPDATE`; a replay after a failure rewrites the same
//!   rows, so every key's final row is exactly-once while earlier versions
//!   may be seen again meanwhile.
//!
//! This module holds what they share: the connection (password only from
//! `PGPASSWORD`; TLS as libpq's `sslmode`, `sslrootcert`, `sslcert` and
//! `sslkey` set it, in `tls.rs`), the check of the table against the records' schema at
//! start (so a missing table or column is an error naming it before any row
//! is written), and the `INSERT … SELECT … FROM unnest(…)` that writes a
//! whole record batch as one statement with one array per column.
//!
//! Deliberately does not know barriers, checkpoints' storage or the
//! coordinator: like every sink it is told `pre_commit(id)` and `commit(id)`.

mod tls;
mod two_phase;
mod upsert;
mod write_ahead;

use std::str::FromStr;
use std::time::Duration;

use arrow::array::{ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type, Int64Type, Schema};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls};
use weir_api::PostgresSinkSpec;

pub use two_phase::{discard_unreferenced, TwoPhaseCommit};
pub use upsert::Upsert;
pub use write_ahead::{discard_after_end, LogEntry, WriteAheadLog};

use crate::error::{Error, Result};

/// The environment variable the password is read from (libpq's own).
pub const PASSWORD_ENV: &str = "PGPASSWORD";

/// Opens a connection to the sink's database. `purpose` says which of the
/// subtask's connections it is, for errors. TLS as libpq sets it (see
/// `tls.rs`).
pub(crate) async fn connect(spec: &PostgresSinkSpec, purpose: &str) -> Result<Client> {
    connect_to(&spec.connection, "sink.postgres.connection", "postgres sink", purpose).await
}

/// Opens a connection by a libpq connection string written at `setting`
/// (named in errors, as is `who`: the sink or a lookup join's step).
pub(crate) async fn connect_to(connection: &str, setting: &str, who: &str, purpose: &str) -> Result<Client> {
    let at_setting = |e: Error| match e {
        Error::Plan { message, .. } => Error::Plan { context: setting.to_string(), message },
        e => e,
    };
    let (rest, tls) = tls::split(connection).map_err(at_setting)?;
    let mut config = tokio_postgres::Config::from_str(&rest)
        .map_err(|e| Error::Plan { context: setting.to_string(), message: format!("cannot be read as a libpq connection string: {e}") })?;
    if let Ok(password) = std::env::var(PASSWORD_ENV) {
        config.password(password);
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    config.ssl_mode(tls.tokio_mode());
    let connect_failed = |e: tokio_postgres::Error| {
        let context = format!("{who}: connecting ({purpose}) to {} with sslmode={}", describe_target(&config), tls.mode);
        // A certificate refused now is refused after a restart too.
        if tls::refused_certificate(&e) {
            return Error::Plan {
                context: setting.to_string(),
                message: format!("{context}: {}; check sslrootcert and the host name the server's certificate is for", message_of(&e)),
            };
        }
        Error::Postgres { context, code: e.code().map(|c| c.code().to_string()), message: message_of(&e) }
    };
    match tls.client_config().map_err(at_setting)? {
        None => {
            let (client, connection) = config.connect(NoTls).await.map_err(connect_failed)?;
            tokio::spawn(drive(connection));
            Ok(client)
        }
        Some(client_config) => {
            let (client, connection) = config.connect(tokio_postgres_rustls::MakeRustlsConnect::new(client_config)).await.map_err(connect_failed)?;
            tokio::spawn(drive(connection));
            Ok(client)
        }
    }
}

/// Runs a connection's I/O until the client is dropped or the server goes.
async fn drive<S, T>(connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if let Err(e) = connection.await {
        tracing::warn!(error = %message_of(&e), "postgres sink: connection lost");
    }
}

/// Where a connection goes, without anything secret: hosts, ports, database, user.
fn describe_target(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    let ports: Vec<String> = config.get_ports().iter().map(|p| p.to_string()).collect();
    format!(
        "host {} port {} database {} as user {}",
        if hosts.is_empty() { "(none)".into() } else { hosts.join(",") },
        if ports.is_empty() { "5432".into() } else { ports.join(",") },
        config.get_dbname().unwrap_or("(default)"),
        config.get_user().unwrap_or("(none)"),
    )
}

/// A server error's own words (message, detail, hint) rather than
/// tokio-postgres' generic "db error".
pub(crate) fn message_of(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut m = db.message().to_string();
            if let Some(d) = db.detail() {
                m.push_str(&format!(" ({d})"));
            }
            if let Some(h) = db.hint() {
                m.push_str(&format!("; hint: {h}"));
            }
            m
        }
        None => {
            let mut m = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                m.push_str(&format!(": {s}"));
                source = s.source();
            }
            m
        }
    }
}

/// Wraps a query's error with what the sink was doing.
pub(crate) fn failed(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> Error {
    let context = context.into();
    move |e| Error::Postgres { context, code: e.code().map(|c| c.code().to_string()), message: message_of(&e) }
}

/// The prefix of every global id (prepared transaction, log entry) of job
/// `job`: `weir:<job>:`, followed by `<run>:<subtask>:<checkpoint>`.
pub(crate) fn job_prefix(job: &str) -> String {
    format!("weir:{job}:")
}

/// `name` as a quoted identifier: case kept, quotes doubled.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `text` as a quoted string literal (global transaction ids are literals,
/// not parameters, in PREPARE/COMMIT/ROLLBACK PREPARED).
pub(crate) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The table and the columns the records go to, checked against the server.
pub(crate) struct Table {
    /// Quoted, as it goes into SQL.
    pub sql_name: String,
    /// As the user wrote it, for messages.
    pub name: String,
    /// The records' fields, in order, with the array type each travels as.
    pub columns: Vec<(String, &'static str)>,
}

impl Table {
    /// Checks that the table exists and has a column for every field of
    /// `schema`, and that every field has a type the sink can write.
    pub async fn check(client: &Client, spec: &PostgresSinkSpec, schema: &Schema) -> Result<Table> {
        let sql_name = spec.table.split('.').map(quote_ident).collect::<Vec<_>>().join(".");
        let mut columns = Vec::new();
        for field in schema.fields() {
            let array_type = array_type(field.data_type()).ok_or_else(|| Error::Plan {
                context: "sink.postgres".into(),
                message: format!("field `{}` is of type {}, which the postgres sink cannot write (it writes integers, floats, strings and booleans)", field.name(), field.data_type()),
            })?;
            columns.push((field.name().clone(), array_type));
        }
        let oid: Option<u32> = client
            .query_one("SELECT to_regclass($1)::oid", &[&sql_name])
            .await
            .map_err(failed(format!("postgres sink: looking up table {}", spec.table)))?
            .get(0);
        let Some(oid) = oid else {
            return Err(Error::Plan {
                context: "sink.postgres.table".into(),
                message: format!("table {} does not exist in the database (or the user cannot see it); create it with a column for each field: {}", spec.table, field_list(schema)),
            });
        };
        let rows = client
            .query("SELECT attname::text FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped ORDER BY attnum", &[&oid])
            .await
            .map_err(failed(format!("postgres sink: reading the columns of {}", spec.table)))?;
        let have: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        let missing: Vec<&str> = columns.iter().map(|(c, _)| c.as_str()).filter(|c| !have.iter().any(|h| h == c)).collect();
        if !missing.is_empty() {
            return Err(Error::Plan {
                context: "sink.postgres.table".into(),
                message: format!("table {} has no column {} for the records' field{} of that name (its columns: {})", spec.table, missing.join(", "), if missing.len() > 1 { "s" } else { "" }, have.join(", ")),
            });
        }
        for key in &spec.key {
            if !columns.iter().any(|(c, _)| c == key) {
                return Err(Error::Plan {
                    context: "sink.postgres.key".into(),
                    message: format!("`{key}` is not a field of the records that reach the sink (they have {})", field_list(schema)),
                });
            }
        }
        Ok(Table { sql_name, name: spec.table.clone(), columns })
    }

    /// `INSERT INTO t (c…) SELECT c… FROM unnest($1::T[], …) AS u(c…)`.
    pub fn insert_from_arrays(&self) -> String {
        let cols = self.column_list();
        let arrays: Vec<String> = self.columns.iter().enumerate().map(|(i, (_, t))| format!("${}::{t}", i + 1)).collect();
        format!("INSERT INTO {} ({cols}) SELECT {cols} FROM unnest({}) AS u({cols})", self.sql_name, arrays.join(", "))
    }

    pub fn column_list(&self) -> String {
        self.columns.iter().map(|(c, _)| quote_ident(c)).collect::<Vec<_>>().join(", ")
    }
}

fn field_list(schema: &Schema) -> String {
    schema.fields().iter().map(|f| format!("{} ({})", f.name(), f.data_type())).collect::<Vec<_>>().join(", ")
}

/// The PostgreSQL array type a column of `t` is sent as.
fn array_type(t: &DataType) -> Option<&'static str> {
    Some(match t {
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 | DataType::UInt8 | DataType::UInt16 | DataType::UInt32 => "int8[]",
        DataType::Float16 | DataType::Float32 | DataType::Float64 => "float8[]",
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "text[]",
        DataType::Boolean => "bool[]",
        _ => return None,
    })
}

/// One array parameter per column of `batch`, in the order of
/// [`Table::insert_from_arrays`]. Nulls stay nulls.
pub(crate) fn column_arrays(batch: &RecordBatch) -> Result<Vec<Box<dyn ToSql + Sync + Send>>> {
    let mut out: Vec<Box<dyn ToSql + Sync + Send>> = Vec::with_capacity(batch.num_columns());
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        let cast = |to: &DataType| -> Result<ArrayRef> { arrow::compute::cast(column, to).map_err(Error::arrow(format!("postgres sink: field `{}`", field.name()))) };
        match array_type(field.data_type()) {
            Some("int8[]") => {
                let a = cast(&DataType::Int64)?;
                out.push(Box::new(a.as_primitive::<Int64Type>().iter().collect::<Vec<Option<i64>>>()));
            }
            Some("float8[]") => {
                let a = cast(&DataType::Float64)?;
                out.push(Box::new(a.as_primitive::<Float64Type>().iter().collect::<Vec<Option<f64>>>()));
            }
            Some("text[]") => {
                let a = cast(&DataType::Utf8)?;
                out.push(Box::new(a.as_string::<i32>().iter().map(|s| s.map(String::from)).collect::<Vec<Option<String>>>()));
            }
            Some("bool[]") => {
                out.push(Box::new(column.as_boolean().iter().collect::<Vec<Option<bool>>>()));
            }
            _ => {
                return Err(Error::Plan {
                    context: "sink.postgres".into(),
                    message: format!("field `{}` is of type {}, which the postgres sink cannot write", field.name(), field.data_type()),
                })
            }
        }
    }
    Ok(out)
}

/// Borrowed views of [`column_arrays`], as `execute` takes them.
pub(crate) fn params(arrays: &[Box<dyn ToSql + Sync + Send>]) -> Vec<&(dyn ToSql + Sync)> {
    arrays.iter().map(|a| a.as_ref() as &(dyn ToSql + Sync)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::Field;

    fn table(fields: &[(&str, DataType)]) -> Table {
        Table {
            sql_name: "\"public\".\"Counts\"".into(),
            name: "public.Counts".into(),
            columns: fields.iter().map(|(n, t)| (n.to_string(), array_type(t).unwrap())).collect(),
        }
    }

    #[test]
    fn one_insert_statement_takes_one_array_per_column() {
        let t = table(&[("key", DataType::Int64), ("name", DataType::Utf8), ("ok", DataType::Boolean)]);
        assert_eq!(
            t.insert_from_arrays(),
            "INSERT INTO \"public\".\"Counts\" (\"key\", \"name\", \"ok\") SELECT \"key\", \"name\", \"ok\" FROM unnest($1::int8[], $2::text[], $3::bool[]) AS u(\"key\", \"name\", \"ok\")"
        );
    }

    #[test]
    fn identifiers_and_literals_are_quoted_so_no_name_can_end_the_statement() {
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
        assert_eq!(quote_literal("a'b"), "'a''b'");
    }

    #[test]
    fn narrow_integers_and_floats_travel_as_their_wide_types_and_nulls_stay_null() {
        use arrow::array::{Float32Array, Int32Array, StringArray};
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, true), Field::new("b", DataType::Float32, true), Field::new("c", DataType::Utf8, true)]));
        let batch = RecordBatch::try_new(
            schema,
            vec![Arc::new(Int32Array::from(vec![Some(1), None])), Arc::new(Float32Array::from(vec![Some(0.5), None])), Arc::new(StringArray::from(vec![None, Some("x")]))],
        )
        .unwrap();
        let arrays = column_arrays(&batch).unwrap();
        assert_eq!(format!("{:?}", arrays[0]), "[Some(1), None]");
        assert_eq!(format!("{:?}", arrays[1]), "[Some(0.5), None]");
        assert_eq!(format!("{:?}", arrays[2]), "[None, Some(\"x\")]");
    }

    use std::sync::Arc;
}
