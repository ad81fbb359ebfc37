use super::*;
use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{Float64Type, Int64Type};

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::Int64, false),
        Field::new("key", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("Mixed", DataType::Int64, false),
    ]))
}

fn batch() -> RecordBatch {
    RecordBatch::try_new(schema(), vec![
        Arc::new(Int64Array::from(vec![0, 1, 2, 3])),
        Arc::new(Int64Array::from(vec![10, 11, 12, 13])),
        Arc::new(StringArray::from(vec![Some("  alpha "), Some("beta"), None, Some("gamma")])),
        Arc::new(Int64Array::from(vec![5, 6, 7, 8])),
    ])
    .unwrap()
}

fn compiler() -> ExprCompiler {
    ExprCompiler::new(&schema()).unwrap()
}

/// The filter's verdict for each of the four rows.
fn rows_kept(text: &str) -> Vec<bool> {
    let f = compiler().filter("f", text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let mask = f.evaluate(&batch()).unwrap().into_array(4).unwrap();
    let mask = mask.as_boolean();
    (0..4).map(|i| mask.is_valid(i) && mask.value(i)).collect()
}

/// A select item's values for the four rows.
fn values(text: &str) -> (FieldRef, ArrayRef) {
    let (e, f) = compiler().select_item("s", text).unwrap_or_else(|e| panic!("{text}: {e}"));
    (f, e.evaluate(&batch()).unwrap().into_array(4).unwrap())
}

fn error(text: &str) -> String {
    match compiler().select_item("steps[2].select[0]", text) {
        Ok(_) => panic!("`{text}` compiled"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_filter_is_evaluated_on_a_whole_batch() {
    assert_eq!(rows_kept("seq % 2 = 0 AND key > 10.5"), vec![false, false, true, false]);
}

#[test]
fn select_items_get_their_alias_or_column_name() {
    let (f, out) = values("key * 2 + abs(seq) AS double");
    assert_eq!(f.name(), "double");
    assert_eq!(out.as_primitive::<Int64Type>().values().to_vec(), vec![20, 23, 26, 29]);
    let (f, _) = values("seq");
    assert_eq!(f.name(), "seq");
}

#[test]
fn an_unknown_column_is_named_in_the_error_with_the_columns_there_are() {
    let err = compiler().filter("steps[1].filter", "nope > 1").unwrap_err().to_string();
    assert!(err.contains("steps[1].filter") && err.contains("nope") && err.contains("seq, key, name, Mixed"), "{err}");
}

#[test]
fn a_non_boolean_filter_is_rejected() {
    let err = compiler().filter("f", "seq + 1").unwrap_err().to_string();
    assert!(err.contains("true or false"), "{err}");
}

#[test]
fn trailing_garbage_is_rejected() {
    assert!(compiler().filter("f", "seq > 1 seq").is_err());
    assert!(error("seq + 1").contains("AS name"));
}

#[test]
fn unquoted_names_are_case_insensitive_and_quoted_names_exact() {
    // `user` is a function to SQL when written without parentheses; a column here.
    let user = Arc::new(Schema::new(vec![Field::new("user", DataType::Utf8, false)]));
    let (_, f) = ExprCompiler::new(&user).unwrap().select_item("s", "user").unwrap();
    assert_eq!(f.name(), "user");
    assert_eq!(rows_kept("SEQ >= 2"), vec![false, false, true, true]);
    assert_eq!(rows_kept("\"Mixed\" > 6"), vec![false, false, true, true]);
    let err = error("mixed AS m");
    assert!(err.contains("unknown column `mixed`") && err.contains("\"Mixed\""), "{err}");
}

#[test]
fn mixed_numeric_types_are_coerced_as_datafusion_does() {
    let (f, out) = values("seq / 2.0 AS half");
    assert_eq!(f.data_type(), &DataType::Float64);
    assert_eq!(out.as_primitive::<Float64Type>().values().to_vec(), vec![0.0, 0.5, 1.0, 1.5]);
    assert_eq!(rows_kept("seq BETWEEN 0.5 AND 2"), vec![false, true, true, false]);
    assert_eq!(rows_kept("seq IN (1, 3.0)"), vec![false, true, false, true]);
    assert_eq!(rows_kept("NOT (seq <> 2)"), vec![false, false, true, false]);
    let (f, out) = values("CASE WHEN seq > 1 THEN seq ELSE 0.5 END AS c");
    assert_eq!(f.data_type(), &DataType::Float64);
    assert_eq!(out.as_primitive::<Float64Type>().values().to_vec(), vec![0.5, 0.5, 2.0, 3.0]);
    let (_, out) = values("CASE seq WHEN 1 THEN 'one' WHEN 2.0 THEN 'two' END AS c");
    let out = out.as_string::<i32>();
    assert_eq!((out.is_null(0), out.value(1), out.value(2), out.is_null(3)), (true, "one", "two", true));
}

#[test]
fn negative_literals_reach_the_bounds_of_bigint() {
    let (_, out) = values("-9223372036854775808 + seq AS low");
    assert_eq!(out.as_primitive::<Int64Type>().value(0), i64::MIN);
    let (_, out) = values("-seq AS neg");
    assert_eq!(out.as_primitive::<Int64Type>().values().to_vec(), vec![0, -1, -2, -3]);
}

#[test]
fn strings_match_like_and_the_sql_forms_of_string_functions_work() {
    assert_eq!(rows_kept("name LIKE '%a'"), vec![false, true, false, true]);
    assert_eq!(rows_kept("name ILIKE 'BE%'"), vec![false, true, false, false]);
    assert_eq!(rows_kept("name IS NULL"), vec![false, false, true, false]);
    let (_, out) = values("upper(TRIM(name)) || '!' AS shout");
    assert_eq!(out.as_string::<i32>().value(0), "ALPHA!");
    let (_, out) = values("SUBSTRING(name FROM 2 FOR 3) AS part");
    assert_eq!(out.as_string::<i32>().value(1), "eta");
    let (_, out) = values("CAST(POSITION('m' IN name) AS BIGINT) AS at");
    assert_eq!(out.as_primitive::<Int64Type>().value(3), 3);
    let (_, out) = values("coalesce(name, 'none') AS n");
    assert_eq!(out.as_string::<i32>().value(2), "none");
    let (_, out) = values("CAST(nvl2(name, 1, 0) AS BIGINT) AS has_name");
    assert_eq!(out.as_primitive::<Int64Type>().values().to_vec(), vec![1, 1, 0, 1]);
    let (f, _) = values("arrow_cast(seq, 'Int32') AS small");
    assert_eq!(f.data_type(), &DataType::Int32);
}

#[test]
fn math_functions_and_casts_work() {
    let (_, out) = values("CEIL(seq / 2.0) AS c");
    assert_eq!(out.as_primitive::<Float64Type>().values().to_vec(), vec![0.0, 1.0, 1.0, 2.0]);
    let (_, out) = values("round(CAST(seq AS DOUBLE) / 3, 2) AS r");
    assert_eq!(out.as_primitive::<Float64Type>().value(1), 0.33);
    let (f, _) = values("CAST(seq AS INT) AS i");
    assert_eq!(f.data_type(), &DataType::Int32);
    let (f, out) = values("TRY_CAST(name AS BIGINT) AS n");
    assert_eq!(f.data_type(), &DataType::Int64);
    assert!(out.is_null(0));
}

#[test]
fn a_function_with_a_different_result_on_replay_is_refused() {
    for f in ["random()", "uuid()"] {
        let err = error(&format!("{f} AS r"));
        assert!(err.contains("replayed") && err.contains(f.trim_end_matches("()")), "{err}");
    }
}

#[test]
fn unsupported_constructs_are_named() {
    let err = error("foo(seq) AS x");
    assert!(err.contains("unknown function `foo`"), "{err}");
    let err = error("(SELECT 1) AS x");
    assert!(err.contains("subqueries"), "{err}");
    let err = error("CAST(seq AS DECIMAL(10, 2)) AS x");
    assert!(err.contains("CAST to DECIMAL") && err.contains("BIGINT"), "{err}");
    let err = error("t.seq AS x");
    assert!(err.contains("qualified names"), "{err}");
    let err = error("sum(seq) OVER () AS x");
    assert!(err.contains("window functions"), "{err}");
}

#[test]
fn type_errors_name_the_operator_and_the_types() {
    let err = compiler().filter("f", "NOT seq").unwrap_err().to_string();
    assert!(err.contains("NOT takes a boolean") && err.contains("Int64"), "{err}");
    let err = error("-name AS n");
    assert!(err.contains("minus") && err.contains("Utf8"), "{err}");
}
