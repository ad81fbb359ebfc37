//! The lookup join: each record joined with the rows of a PostgreSQL table
//! whose key columns equal the record's `on` fields (Flink's lookup join on
//! a JDBC table). One input, chained like a filter; nothing checkpointed.
//!
//! Per batch, the distinct keys that are not cached (or whose cached rows
//! are older than the cache's `ttl`) are fetched in one statement (keys as
//! arrays, `unnest … WITH ORDINALITY` joined with the table), and a key
//! without a row is cached as having none. The cache holds at most
//! `max_rows` keys, the oldest inserted leaving first. A record pairs with
//! every row of its key; one without a row is dropped (`missing: drop`)
//! or kept with null columns (`missing: keep`); a null key has no row.
//!
//! The table is read as it is when a batch is processed: a replay after a
//! failure may see rows changed since, as in Flink. Exactly-once holds for
//! what the job itself writes; the table is outside the checkpoint.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{Array, ArrayBuilder, ArrayRef, AsArray, BooleanBuilder, Float64Builder, Int64Builder, RecordBatch, StringBuilder, UInt32Array};
use arrow::compute::take;
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::plan::{user_type, LookupPlan};
use crate::sink::{connect_to_postgres, postgres_failed, quote_ident};

/// One key field's value; floats are refused as lookup keys when planning.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum KeyValue {
    Int(i64),
    Str(String),
    Bool(bool),
}

/// One added column's value in a row read from the table.
#[derive(Clone, Debug)]
enum Value {
    Null,
    Int(i64),
    Float(f64),
    Str(String),
    Bool(bool),
}

type Key = Vec<KeyValue>;
/// The rows of one key (none for a key the table does not have).
type Rows = Arc<Vec<Vec<Value>>>;

/// Keys to their rows, each with the time it was read; at most `max_rows`
/// keys, evicted in the order they were inserted.
struct Cache {
    rows: HashMap<Key, (Instant, u64, Rows)>,
    order: VecDeque<(Key, u64)>,
    next: u64,
    max_rows: usize,
    ttl: Duration,
}

impl Cache {
    fn get(&self, key: &Key, now: Instant) -> Option<&Rows> {
        self.rows.get(key).filter(|(read, ..)| now.saturating_duration_since(*read) < self.ttl).map(|(_, _, rows)| rows)
    }

    fn insert(&mut self, key: Key, rows: Rows, now: Instant) {
        let seq = self.next;
        self.next += 1;
        self.rows.insert(key.clone(), (now, seq, rows));
        self.order.push_back((key, seq));
        while self.rows.len() > self.max_rows {
            let Some((oldest, seq)) = self.order.pop_front() else { break };
            // A key read again since has a newer entry further back.
            if self.rows.get(&oldest).is_some_and(|(_, s, _)| *s == seq) {
                self.rows.remove(&oldest);
            }
        }
        if self.order.len() > 2 * self.rows.len() + 1024 {
            let rows = &self.rows;
            self.order.retain(|(k, seq)| rows.get(k).is_some_and(|(_, s, _)| s == seq));
        }
    }
}

pub struct LookupJoin {
    id: String,
    step: String,
    plan: LookupPlan,
    output_schema: SchemaRef,
    client: Option<Client>,
    /// The records' key types (int64, string or boolean), known at `open`.
    key_types: Vec<DataType>,
    query: String,
    cache: Cache,
    queries: u64,
}

impl LookupJoin {
    pub fn new(id: String, step: String, plan: &LookupPlan, output_schema: SchemaRef) -> LookupJoin {
        let cache = Cache {
            rows: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            max_rows: plan.max_rows.max(1),
            ttl: Duration::from_millis(plan.ttl_ms),
        };
        LookupJoin { id, step, plan: plan.clone(), output_schema, client: None, key_types: Vec::new(), query: String::new(), cache, queries: 0 }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Statements sent to the table so far (one per batch with keys to read).
    pub fn queries(&self) -> u64 {
        self.queries
    }

    /// Keys in the cache now.
    pub fn cached_keys(&self) -> usize {
        self.cache.rows.len()
    }

    fn refused(&self, setting: &str, message: String) -> Error {
        Error::Plan { context: format!("{}.{setting}", self.step), message: format!("`{}`: {message}", self.id) }
    }

    /// Connects and checks that the table has the key columns and the added
    /// ones, each of a type read as declared, before any record comes.
    pub async fn open(&mut self, input: &arrow::datatypes::Schema) -> Result<()> {
        let who = format!("{} (`{}`)", self.step, self.id);
        let client = connect_to_postgres(&self.plan.connection, &format!("{}.postgres.connection", self.step), &who, "lookup").await?;
        let table = &self.plan.table;
        let sql_name = table.split('.').map(quote_ident).collect::<Vec<_>>().join(".");
        let oid: Option<u32> = client
            .query_one("SELECT to_regclass($1)::oid", &[&sql_name])
            .await
            .map_err(postgres_failed(format!("{who}: looking up table {table}")))?
            .get(0);
        let Some(oid) = oid else {
            return Err(self.refused("postgres.table", format!("table {table} does not exist in the database (or the user cannot see it)")));
        };
        let rows = client
            .query("SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped ORDER BY attnum", &[&oid])
            .await
            .map_err(postgres_failed(format!("{who}: reading the columns of {table}")))?;
        let have: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let type_of = |column: &str, setting: &str| {
            have.iter().find(|(c, _)| c == column).map(|(_, t)| t.clone()).ok_or_else(|| {
                let names: Vec<&str> = have.iter().map(|(c, _)| c.as_str()).collect();
                self.refused(setting, format!("table {table} has no column `{column}` (its columns: {})", names.join(", ")))
            })
        };
        for (j, (column, &index)) in self.plan.key_columns.iter().zip(&self.plan.key_indices).enumerate() {
            let setting = format!("postgres.key[{j}]");
            let pg = type_of(column, &setting)?;
            let field = input.field(index);
            if !reads_as(&pg, field.data_type(), true) {
                return Err(self.refused(
                    &setting,
                    format!("key column `{column}` of {table} is {pg}, which does not compare with `{}` ({}): expected {}", field.name(), user_type(field.data_type()), expected(field.data_type())),
                ));
            }
        }
        for (column, data_type) in &self.plan.columns {
            let setting = format!("postgres.columns.{column}");
            let pg = type_of(column, &setting)?;
            if !reads_as(&pg, data_type, false) {
                return Err(self.refused(&setting, format!("column `{column}` of {table} is {pg}, which is not read as {}: expected {}", user_type(data_type), expected(data_type))));
            }
        }
        self.key_types = self.plan.key_indices.iter().map(|&i| input.field(i).data_type().clone()).collect();
        self.query = self.lookup_query(&sql_name);
        self.client = Some(client);
        Ok(())
    }

    /// `SELECT k.i, t.c… FROM unnest($1::T[], …) WITH ORDINALITY AS
    /// k(k0, …, i) JOIN table t ON t.key0 = k.k0 AND …`: the rows of every
    /// requested key, each tagged with its key's place in the request.
    fn lookup_query(&self, sql_name: &str) -> String {
        let arrays: Vec<String> = self.key_types.iter().enumerate().map(|(j, t)| format!("${}::{}[]", j + 1, sql_type(t))).collect();
        let names: Vec<String> = (0..self.plan.key_indices.len()).map(|j| format!("k{j}")).collect();
        let on: Vec<String> = self.plan.key_columns.iter().enumerate().map(|(j, c)| format!("t.{} = k.k{j}", quote_ident(c))).collect();
        let columns: Vec<String> = self.plan.columns.iter().map(|(c, t)| format!("t.{}::{}", quote_ident(c), sql_type(t))).collect();
        format!(
            "SELECT k.i, {} FROM unnest({}) WITH ORDINALITY AS k({}, i) JOIN {sql_name} t ON {}",
            columns.join(", "),
            arrays.join(", "),
            names.join(", "),
            on.join(" AND ")
        )
    }

    /// The batch's records, each with the rows of its key.
    pub async fn process(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let keys = self.keys_of(&batch)?;
        let now = Instant::now();
        let mut wanted: Vec<Key> = Vec::new();
        let mut seen: HashSet<&Key> = HashSet::new();
        for key in keys.iter().flatten() {
            if self.cache.get(key, now).is_none() && seen.insert(key) {
                wanted.push(key.clone());
            }
        }
        let fetched = if wanted.is_empty() { HashMap::new() } else { self.fetch(wanted).await? };
        let mut indices: Vec<u32> = Vec::new();
        let mut added: Vec<Option<&Vec<Value>>> = Vec::new();
        for (r, key) in keys.iter().enumerate() {
            let rows = key.as_ref().and_then(|k| fetched.get(k).or_else(|| self.cache.get(k, now)));
            match rows {
                Some(rows) if !rows.is_empty() => {
                    for row in rows.iter() {
                        indices.push(r as u32);
                        added.push(Some(row));
                    }
                }
                _ if self.plan.keep_missing => {
                    indices.push(r as u32);
                    added.push(None);
                }
                _ => {}
            }
        }
        let out = if indices.is_empty() { None } else { Some(self.output(&batch, &indices, &added)?) };
        for (key, rows) in fetched {
            self.cache.insert(key, rows, now);
        }
        Ok(out)
    }

    fn output(&self, batch: &RecordBatch, indices: &[u32], added: &[Option<&Vec<Value>>]) -> Result<RecordBatch> {
        let indices = UInt32Array::from(indices.to_vec());
        let mut columns: Vec<ArrayRef> =
            batch.columns().iter().map(|c| take(c, &indices, None)).collect::<std::result::Result<_, _>>().map_err(Error::arrow(format!("{}: output", self.step)))?;
        for (j, (_, data_type)) in self.plan.columns.iter().enumerate() {
            fn value<'a>(row: &Option<&'a Vec<Value>>, j: usize) -> &'a Value {
                row.map_or(&Value::Null, |r| &r[j])
            }
            let column: ArrayRef = match data_type {
                DataType::Int64 => {
                    let mut b = Int64Builder::with_capacity(added.len());
                    added.iter().for_each(|r| b.append_option(if let Value::Int(v) = value(r, j) { Some(*v) } else { None }));
                    Arc::new(b.finish())
                }
                DataType::Float64 => {
                    let mut b = Float64Builder::with_capacity(added.len());
                    added.iter().for_each(|r| b.append_option(if let Value::Float(v) = value(r, j) { Some(*v) } else { None }));
                    Arc::new(b.finish())
                }
                DataType::Boolean => {
                    let mut b = BooleanBuilder::with_capacity(added.len());
                    added.iter().for_each(|r| b.append_option(if let Value::Bool(v) = value(r, j) { Some(*v) } else { None }));
                    Arc::new(b.finish())
                }
                _ => {
                    let mut b = StringBuilder::new();
                    added.iter().for_each(|r| b.append_option(if let Value::Str(v) = value(r, j) { Some(v.as_str()) } else { None }));
                    debug_assert_eq!(b.len(), added.len());
                    Arc::new(b.finish())
                }
            };
            columns.push(column);
        }
        RecordBatch::try_new(self.output_schema.clone(), columns).map_err(Error::arrow(format!("{}: output", self.step)))
    }

    /// Each record's key, `None` where a key field is null.
    fn keys_of(&self, batch: &RecordBatch) -> Result<Vec<Option<Key>>> {
        let mut keys: Vec<Option<Key>> = vec![Some(Vec::with_capacity(self.plan.key_indices.len())); batch.num_rows()];
        for &index in &self.plan.key_indices {
            let column = batch.column(index);
            for (r, key) in keys.iter_mut().enumerate() {
                if column.is_null(r) {
                    *key = None;
                }
                let Some(key) = key else { continue };
                key.push(match column.data_type() {
                    DataType::Int64 => KeyValue::Int(column.as_primitive::<Int64Type>().value(r)),
                    DataType::Utf8 => KeyValue::Str(column.as_string::<i32>().value(r).to_string()),
                    DataType::Boolean => KeyValue::Bool(column.as_boolean().value(r)),
                    other => return Err(Error::Job(format!("{}: a lookup key of type {other} reached the join", self.step))),
                });
            }
        }
        Ok(keys)
    }

    /// Reads the rows of `wanted` in one statement; a key without rows maps
    /// to none.
    async fn fetch(&mut self, wanted: Vec<Key>) -> Result<HashMap<Key, Rows>> {
        let client = self.client.as_ref().ok_or_else(|| Error::Job(format!("{}: the lookup join was not opened", self.step)))?;
        let mut params: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
        for (j, key_type) in self.key_types.iter().enumerate() {
            let param: Box<dyn ToSql + Sync + Send> = match key_type {
                DataType::Int64 => Box::new(wanted.iter().map(|k| if let KeyValue::Int(v) = k[j] { v } else { 0 }).collect::<Vec<i64>>()),
                DataType::Boolean => Box::new(wanted.iter().map(|k| matches!(k[j], KeyValue::Bool(true))).collect::<Vec<bool>>()),
                _ => Box::new(wanted.iter().map(|k| if let KeyValue::Str(v) = &k[j] { v.clone() } else { String::new() }).collect::<Vec<String>>()),
            };
            params.push(param);
        }
        let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect();
        let rows = client
            .query(&self.query, &refs)
            .await
            .map_err(postgres_failed(format!("{} (`{}`): reading {} keys from {}", self.step, self.id, wanted.len(), self.plan.table)))?;
        self.queries += 1;
        let mut found: Vec<Vec<Vec<Value>>> = vec![Vec::new(); wanted.len()];
        for row in rows {
            let read_failed = |e: tokio_postgres::Error| Error::Job(format!("{}: reading a row of {}: {e}", self.step, self.plan.table));
            let place: i64 = row.try_get(0).map_err(read_failed)?;
            let Some(rows) = place.checked_sub(1).and_then(|p| usize::try_from(p).ok()).and_then(|p| found.get_mut(p)) else {
                return Err(Error::Job(format!("{}: {} answered for key {place} of {}", self.step, self.plan.table, wanted.len())));
            };
            let mut values = Vec::with_capacity(self.plan.columns.len());
            for (j, (_, data_type)) in self.plan.columns.iter().enumerate() {
                let at = j + 1;
                values.push(match data_type {
                    DataType::Int64 => row.try_get::<_, Option<i64>>(at).map_err(read_failed)?.map_or(Value::Null, Value::Int),
                    DataType::Float64 => row.try_get::<_, Option<f64>>(at).map_err(read_failed)?.map_or(Value::Null, Value::Float),
                    DataType::Boolean => row.try_get::<_, Option<bool>>(at).map_err(read_failed)?.map_or(Value::Null, Value::Bool),
                    _ => row.try_get::<_, Option<String>>(at).map_err(read_failed)?.map_or(Value::Null, Value::Str),
                });
            }
            rows.push(values);
        }
        Ok(wanted.into_iter().zip(found).map(|(k, rows)| (k, Arc::new(rows))).collect())
    }
}

/// The SQL type a value of `t` travels as.
fn sql_type(t: &DataType) -> &'static str {
    match t {
        DataType::Int64 => "int8",
        DataType::Float64 => "float8",
        DataType::Boolean => "bool",
        DataType::Utf8 => "text",
        _ => "unknown",
    }
}

/// The PostgreSQL types a field of `t` is read from (or, for a key,
/// compared with).
fn expected(t: &DataType) -> &'static str {
    match t {
        DataType::Int64 => "smallint, integer or bigint",
        DataType::Float64 => "real, double precision, numeric or an integer type",
        DataType::Boolean => "boolean",
        _ => "text, character varying or character",
    }
}

/// Whether a column of PostgreSQL type `pg` (as `format_type` names it) is
/// read as `t`, or for a key compares with it without a cast.
fn reads_as(pg: &str, t: &DataType, key: bool) -> bool {
    let integer = matches!(pg, "smallint" | "integer" | "bigint");
    match t {
        DataType::Int64 => integer,
        DataType::Float64 => !key && (integer || matches!(pg, "real" | "double precision") || pg.starts_with("numeric")),
        DataType::Boolean => pg == "boolean",
        _ => pg == "text" || pg.starts_with("character varying") || pg.starts_with("character"),
    }
}
