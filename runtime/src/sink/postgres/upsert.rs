//! Idempotent writes into PostgreSQL: upserts on a declared key.
//!
//! Every batch is one statement, committed at once:
//! `INSERT … SELECT DISTINCT ON (key) … ON CONFLICT (key) DO UPDATE`. A batch
//! may carry several versions of a row; `DISTINCT ON` over the batch's
//! order keeps the last one, because PostgreSQL refuses to update one row
//! twice in one statement. After a failure the job replays from its last
//! checkpoint and writes the same versions again in the same order per key,
//! so each key's final row is the one a failure-free run leaves. Meanwhile
//! a reader may see an earlier version of a row again: intermediate
//! versions are at-least-once. One subtask must write every version of a
//! row (the key should be what the pipeline keys by), or two subtasks' races
//! decide which version is last.
//!
//! The sink keeps no state: a barrier needs nothing, since every write has
//! committed before the next record is taken.
//!
//! A NULL never conflicts with another NULL in a unique constraint, so a key
//! column that admits NULL would get another row for the null key at every
//! write and every replay: such a table is refused at start (its key
//! columns must be NOT NULL, as a primary key's are), and a record whose
//! key is null is a fatal error naming the column and the record.

use arrow::array::{Array, RecordBatch};
use arrow::datatypes::Schema;
use tokio_postgres::{Client, Statement};
use weir_api::PostgresSinkSpec;

use super::{column_arrays, connect, failed, params, quote_ident, Table};
use crate::error::{Error, Result};

pub struct Upsert {
    client: Client,
    statement: Statement,
    table: Table,
    key: Vec<String>,
}

impl Upsert {
    pub async fn open(spec: &PostgresSinkSpec, schema: &Schema) -> Result<Self> {
        let client = connect(spec, "writer").await?;
        let table = Table::check(&client, spec, schema).await?;
        refuse_nullable_key_columns(&client, &table, &spec.key).await?;
        let sql = upsert_statement(&table, &spec.key);
        // Preparing checks what the table check cannot: that the key
        // matches a unique constraint, and that the column types take the values.
        let statement = client.prepare(&sql).await.map_err(failed(format!("postgres sink: preparing the upsert into {} on key ({})", table.name, spec.key.join(", "))))?;
        tracing::info!(table = %table.name, key = ?spec.key, "postgres sink: upserts; each key's final row is exactly-once, earlier versions may be seen again after a failure");
        Ok(Upsert { client, statement, table, key: spec.key.clone() })
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if let Some(e) = null_key(batch, &self.key) {
            return Err(e);
        }
        let arrays = column_arrays(batch)?;
        self.client
            .execute(&self.statement, &params(&arrays))
            .await
            .map_err(failed(format!("postgres sink: upserting {} rows into {}", batch.num_rows(), self.table.name)))?;
        Ok(())
    }
}

/// Refuses key columns that admit NULL: a null key would be a new row at
/// every write instead of one row updated.
async fn refuse_nullable_key_columns(client: &Client, table: &Table, key: &[String]) -> Result<()> {
    let rows = client
        .query(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped AND NOT attnotnull AND attname = ANY($2) ORDER BY attnum",
            &[&table.sql_name, &key],
        )
        .await
        .map_err(failed(format!("postgres sink: reading the key columns of {}", table.name)))?;
    let nullable: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    if nullable.is_empty() {
        return Ok(());
    }
    Err(Error::Plan {
        context: "sink.postgres.key".into(),
        message: format!(
            "key column{} {} of table {} admit{} NULL: a NULL key never conflicts in a unique constraint, so every write and every replay would add another row for it; declare {} NOT NULL (a PRIMARY KEY is)",
            if nullable.len() > 1 { "s" } else { "" },
            nullable.join(", "),
            table.name,
            if nullable.len() > 1 { "" } else { "s" },
            if nullable.len() > 1 { "them" } else { "it" },
        ),
    })
}

/// The error for the first record of `batch` whose key has a null, if any.
fn null_key(batch: &RecordBatch, key: &[String]) -> Option<Error> {
    for column in key {
        let array = batch.column_by_name(column)?;
        if array.null_count() == 0 {
            continue;
        }
        let row = (0..array.len()).find(|&r| array.is_null(r))?;
        return Some(Error::Record {
            step: "sink.postgres.key".into(),
            message: format!("the key column `{column}` is null; an upsert needs every key column set"),
            record: crate::operator::record_json(batch, row),
            position: None,
        });
    }
    None
}

/// The statement that writes one batch: the last version of each key in
/// the batch, inserted or updated.
fn upsert_statement(table: &Table, key: &[String]) -> String {
    let cols = table.column_list();
    let key_list = key.iter().map(|k| quote_ident(k)).collect::<Vec<_>>().join(", ");
    let arrays: Vec<String> = table.columns.iter().enumerate().map(|(i, (_, t))| format!("${}::{t}", i + 1)).collect();
    let updates: Vec<String> = table
        .columns
        .iter()
        .filter(|(c, _)| !key.contains(c))
        .map(|(c, _)| format!("{q} = EXCLUDED.{q}", q = quote_ident(c)))
        .collect();
    let on_conflict = if updates.is_empty() { "DO NOTHING".to_string() } else { format!("DO UPDATE SET {}", updates.join(", ")) };
    format!(
        "INSERT INTO {table} ({cols}) SELECT {cols} FROM (SELECT DISTINCT ON ({key_list}) {cols} FROM unnest({arrays}) WITH ORDINALITY AS u({cols}, weir_row) ORDER BY {key_list}, weir_row DESC) AS latest ON CONFLICT ({key_list}) {on_conflict}",
        table = table.sql_name,
        arrays = arrays.join(", "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_version_of_each_key_in_a_batch_is_the_one_written() {
        let table = Table { sql_name: "\"t\"".into(), name: "t".into(), columns: vec![("key".into(), "int8[]"), ("count".into(), "int8[]")] };
        assert_eq!(
            upsert_statement(&table, &["key".into()]),
            "INSERT INTO \"t\" (\"key\", \"count\") SELECT \"key\", \"count\" FROM (SELECT DISTINCT ON (\"key\") \"key\", \"count\" FROM unnest($1::int8[], $2::int8[]) WITH ORDINALITY AS u(\"key\", \"count\", weir_row) ORDER BY \"key\", weir_row DESC) AS latest ON CONFLICT (\"key\") DO UPDATE SET \"count\" = EXCLUDED.\"count\""
        );
    }

    #[test]
    fn a_record_with_a_null_key_is_named_with_its_column() {
        use arrow::array::Int64Array;
        use arrow::datatypes::{DataType, Field};
        use std::sync::Arc;
        let schema = Arc::new(Schema::new(vec![Field::new("key", DataType::Int64, true), Field::new("count", DataType::Int64, true)]));
        let batch = RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![Some(1), None])), Arc::new(Int64Array::from(vec![Some(5), Some(7)]))]).unwrap();
        let e = null_key(&batch, &["key".into()]).expect("a null key is an error");
        assert!(e.is_fatal());
        let text = e.to_string();
        assert!(text.contains("`key` is null") && text.contains("\"count\":7"), "{text}");
        assert!(null_key(&batch.slice(0, 1), &["key".into()]).is_none());
    }

    #[test]
    fn a_table_of_key_columns_only_inserts_what_is_missing() {
        let table = Table { sql_name: "\"t\"".into(), name: "t".into(), columns: vec![("key".into(), "int8[]")] };
        assert!(upsert_statement(&table, &["key".into()]).ends_with("ON CONFLICT (\"key\") DO NOTHING"));
    }
}
