//! The lookup join (runtime/design/graphs.md §4) against a real PostgreSQL:
//! every record with the rows the test inserted for its key, exactly once
//! under worker kills and whole-tree kills with a rescaled restore; the
//! cache's TTL and bound on the operator itself; and a table or column that
//! does not fit refused before any record, naming the setting.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema};
use weir_runtime::operator::LookupJoin;
use weir_runtime::plan::LookupPlan;

use crate::common::postgres::Server;
use crate::common::*;

const KEYS: i64 = 500;
const EVENTS: u64 = 200_000;

/// The rows the table holds for `id`: none for a multiple of 3, two for
/// `id % 50 == 1`, else one; `tier` is null for a multiple of 7. As
/// (name, tier, value).
fn rows_of(id: i64) -> Vec<(String, Option<i64>, f64)> {
    if id % 3 == 0 {
        return Vec::new();
    }
    let tier = (id % 7 != 0).then_some(id % 4);
    let mut rows = vec![(format!("c{id}"), tier, id as f64 * 0.5)];
    if id % 50 == 1 {
        rows.push((format!("c{id}-b"), tier, -1.0));
    }
    rows
}

/// A table `customers (id integer, name text, tier bigint, value double
/// precision)` holding [`rows_of`] every id below [`KEYS`].
fn customers(pg: &Server) {
    let mut values = Vec::new();
    for id in 0..KEYS {
        for (name, tier, value) in rows_of(id) {
            values.push(format!("({id}, '{name}', {}, {value})", tier.map_or("NULL".into(), |t| t.to_string())));
        }
    }
    pg.psql(&format!(
        "CREATE TABLE customers (id integer, name text, tier bigint, value double precision); INSERT INTO customers VALUES {};",
        values.join(", ")
    ));
}

/// Generated orders (`key` is the customer) joined with their customers
/// and written exactly once to `out/eo`; the join's stage is slowed so
/// that the job outlives its kills.
fn lookup_job(pg: &Server, parallelism: u32, events: u64, missing: &str) -> Job {
    lookup_job_with(pg, parallelism, events, missing, "")
}

/// As [`lookup_job`], with more `checkpoint:` settings (indented lines).
fn lookup_job_with(pg: &Server, parallelism: u32, events: u64, missing: &str, checkpoint: &str) -> Job {
    let yaml = format!(
        "name: eo-test\nparallelism: {parallelism}\ncheckpoint:\n  interval: 150ms\n{checkpoint}\
         sources:\n  orders:\n    generator: {{events: {events}, keys: {KEYS}, rate: 0, batch_size: 200}}\n\
         steps:\n  - name: enriched\n    input: orders\n    lookup_join:\n      on: key\n      postgres: {{connection: \"{}\", table: customers, key: [id], columns: {{name: string, tier: int64, value: float64}}}}\n      cache: {{max_rows: 100, ttl: 1h}}\n      missing: {missing}\n\
         sinks:\n  out:\n    input: enriched\n    file: {{path: out/eo, format: jsonl, guarantee: exactly-once}}\n",
        pg.connection()
    );
    let mut job = Job::with_pipeline(&yaml, events, KEYS as u64);
    job.env.extend(pg.env());
    job.env.push(("WEIR_SLOW_STAGE".into(), "0:10ms".into()));
    job
}

/// Checks the committed output: every order once with each of its
/// customer's rows (and, with `keep`, once with nulls when it has none),
/// the generator's `value` kept and the table's renamed `enriched_value`.
fn assert_enriched(job: &Job, events: u64, keep: bool) {
    let mut expected: BTreeMap<(i64, Option<String>), u32> = BTreeMap::new();
    for seq in 0..events as i64 {
        let rows = rows_of(seq % KEYS);
        if rows.is_empty() && keep {
            expected.insert((seq, None), 1);
        }
        for (name, ..) in rows {
            expected.insert((seq, Some(name)), 1);
        }
    }
    let mut got: BTreeMap<(i64, Option<String>), u32> = BTreeMap::new();
    for l in job.committed_lines() {
        let seq = l["seq"].as_i64().unwrap_or_else(|| panic!("no seq in {l}"));
        assert_eq!((l["key"].as_i64(), l["value"].as_i64()), (Some(seq % KEYS), Some(seq)), "the record's own fields: {l}");
        let name = l["name"].as_str().map(str::to_string);
        let row = rows_of(seq % KEYS).into_iter().find(|r| Some(&r.0) == name.as_ref());
        match &row {
            Some((_, tier, value)) => assert_eq!((l["tier"].as_i64(), l["enriched_value"].as_f64()), (*tier, Some(*value)), "the table's columns: {l}"),
            None => assert!(l["tier"].is_null() && l["enriched_value"].is_null() && name.is_none(), "a record without a row has null columns: {l}"),
        }
        *got.entry((seq, name)).or_insert(0) += 1;
    }
    let twice: Vec<_> = got.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(twice.is_empty(), "records committed more than once (record, times): {twice:?}");
    let missing: Vec<_> = expected.keys().filter(|k| !got.contains_key(k)).take(5).collect();
    let extra: Vec<_> = got.keys().filter(|k| !expected.contains_key(k)).take(5).collect();
    assert!(missing.is_empty() && extra.is_empty(), "{} records expected, {} committed; missing {missing:?}, extra {extra:?}", expected.len(), got.len());
}

#[test]
fn a_lookup_join_adds_each_records_rows_once_under_worker_kills() {
    let pg = Server::start();
    customers(&pg);
    let job = lookup_job(&pg, 2, EVENTS, "drop");
    let out = run_with_worker_kills(&job, 3, |_| {});
    assert!(stderr(&out).contains("restarting"), "no restart was reported:\n{}", stderr(&out));
    assert_enriched(&job, EVENTS, false);
}

#[test]
fn a_lookup_join_under_unaligned_checkpoints_and_under_an_alignment_timeout_adds_each_records_rows_once_under_worker_kills() {
    let pg = Server::start();
    customers(&pg);
    for checkpoint in ["  mode: unaligned\n", "  alignment_timeout: 5ms\n"] {
        let job = lookup_job_with(&pg, 2, EVENTS, "drop", checkpoint);
        let out = run_with_worker_kills(&job, 3, |_| {});
        assert!(stderr(&out).contains("restarting"), "{checkpoint}: no restart was reported:\n{}", stderr(&out));
        assert_enriched(&job, EVENTS, false);
    }
}

#[test]
fn a_lookup_join_keeping_records_without_a_row_restores_after_whole_tree_kills_at_another_parallelism() {
    let pg = Server::start();
    customers(&pg);
    let job = lookup_job(&pg, 2, EVENTS, "keep");
    kill_trees_then_restore_latest(&job, 1000..1800, Some("3"));
    assert_enriched(&job, EVENTS, true);
}

#[test]
fn a_table_or_column_that_does_not_fit_is_refused_before_any_record_naming_the_setting() {
    let pg = Server::start();
    customers(&pg);
    pg.psql("CREATE TABLE named (id text, name text)");
    let run = |from: &str, to: &str| {
        let job = lookup_job(&pg, 1, 1000, "drop");
        job.write_pipeline(&std::fs::read_to_string(job.path("pipeline.yaml")).unwrap().replace(from, to));
        let out = wait_with_timeout(job.spawn(&[]), Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(3), "a table that does not fit is an error a restart cannot fix:\n{}", stderr(&out));
        assert!(job.committed_lines().is_empty(), "nothing was written");
        stderr(&out)
    };
    let e = run("table: customers", "table: nobody");
    assert!(e.contains("steps[0].lookup_join.postgres.table: `enriched`: table nobody does not exist"), "{e}");
    let e = run("name: string,", "nickname: string,");
    assert!(e.contains("steps[0].lookup_join.postgres.columns.nickname: `enriched`: table customers has no column `nickname`"), "{e}");
    let e = run("name: string,", "name: int64,");
    assert!(e.contains("postgres.columns.name: `enriched`: column `name` of customers is text, which is not read as int64"), "{e}");
    let e = run("table: customers", "table: named");
    assert!(e.contains("postgres.key[0]: `enriched`: key column `id` of named is text, which does not compare with `key` (int64)"), "{e}");
}

/// A lookup join of `(key int64)` records with `customers`, on the
/// operator itself.
fn operator(pg: &Server, max_rows: usize, ttl_ms: u64) -> (LookupJoin, Arc<Schema>) {
    let input = Arc::new(Schema::new(vec![Field::new("key", DataType::Int64, true)]));
    let plan = LookupPlan {
        key_indices: vec![0],
        // The operator is built here, not from a pipeline (which refuses
        // a password in it): the password goes in the connection string.
        connection: format!("{} password={}", pg.connection(), crate::common::postgres::PASSWORD),
        table: "customers".into(),
        key_columns: vec!["id".into()],
        columns: vec![("name".into(), DataType::Utf8)],
        max_rows,
        ttl_ms,
        keep_missing: false,
    };
    let output = Arc::new(Schema::new(vec![Field::new("key", DataType::Int64, true), Field::new("name", DataType::Utf8, true)]));
    (LookupJoin::new("enriched".into(), "steps[0].lookup_join".into(), &plan, output), input)
}

fn names(out: Option<RecordBatch>) -> Vec<(i64, String)> {
    let Some(b) = out else { return Vec::new() };
    let (keys, names) = (b.column(0).as_primitive::<Int64Type>(), b.column(1).as_string::<i32>());
    (0..b.num_rows()).map(|r| (keys.value(r), names.value(r).to_string())).collect()
}

#[test]
fn a_changed_row_is_seen_once_its_cached_copy_is_older_than_the_ttl_and_the_cache_never_holds_more_than_max_rows() {
    let pg = Server::start();
    customers(&pg);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (mut join, input) = operator(&pg, 10, 1500);
        join.open(&input).await.unwrap();
        let batch = |keys: Vec<i64>| RecordBatch::try_new(input.clone(), vec![Arc::new(Int64Array::from(keys))]).unwrap();
        assert_eq!(names(join.process(batch(vec![2, 2, 3])).await.unwrap()), [(2, "c2".to_string()), (2, "c2".to_string())]);
        assert_eq!(join.queries(), 1, "one statement for a batch's keys");
        pg.psql("UPDATE customers SET name = 'renamed' WHERE id = 2");
        assert_eq!(names(join.process(batch(vec![2, 3])).await.unwrap()), [(2, "c2".to_string())], "within the TTL the cached row (and the cached miss) is used");
        assert_eq!(join.queries(), 1);
        tokio::time::sleep(Duration::from_millis(1600)).await;
        assert_eq!(names(join.process(batch(vec![2])).await.unwrap()), [(2, "renamed".to_string())], "after the TTL the row is read again");
        assert_eq!(join.queries(), 2);
        let many: Vec<i64> = (100..160).collect();
        let out = names(join.process(batch(many.clone())).await.unwrap());
        let expected: Vec<(i64, String)> = many.iter().flat_map(|&k| rows_of(k).into_iter().map(move |r| (k, r.0))).collect();
        assert_eq!(out, expected, "a batch of more keys than the cache holds is joined whole");
        assert_eq!(join.queries(), 3);
        assert!(join.cached_keys() <= 10, "{} keys cached, at most 10", join.cached_keys());
    });
}
