use super::*;
use arrow::array::{Array, AsArray};
use arrow::datatypes::Int64Type;
use weir_api::pipeline::source::Schema;
use weir_api::pipeline::{FieldType, SourceSpec};

fn spec(batch_size: u32, bad_lines: BadLines) -> FileSourceSpec {
    FileSourceSpec {
        path: "a.jsonl".into(),
        schema: Schema(vec![("n".into(), FieldType::Int64), ("s".into(), FieldType::String)]),
        batch_size,
        bad_lines,
    }
}

fn reader(dir: &Path, sp: &FileSourceSpec, positions: &SourcePositions) -> Result<FileReader> {
    let schema = crate::plan::source_schema(&SourceSpec::File(sp.clone()));
    FileReader::new(sp, schema, 0, 1, positions, dir)
}

/// Every `n` read until the end (nulls as -1), or the first error.
fn values(r: &mut FileReader) -> Result<Vec<i64>> {
    let mut out = Vec::new();
    while let Poll::Batch(b) = r.poll()? {
        let col = b.column(0).as_primitive::<Int64Type>();
        out.extend((0..col.len()).map(|i| if col.is_null(i) { -1 } else { col.value(i) }));
    }
    Ok(out)
}

fn first_error(dir: &Path, text: &str, batch_size: u32) -> String {
    std::fs::write(dir.join("a.jsonl"), text).unwrap();
    let mut r = reader(dir, &spec(batch_size, BadLines::Fail), &SourcePositions::default()).unwrap();
    match values(&mut r) {
        Ok(v) => panic!("{text:?} was read without an error: {v:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn resumes_at_the_byte_offset_of_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), "{\"n\":1,\"s\":\"x\"}\n{\"n\":2}\n\n{\"n\":3,\"s\":\"y\"}\n{\"n\":4}").unwrap();
    let sp = spec(2, BadLines::Fail);
    let mut r = reader(dir.path(), &sp, &SourcePositions::default()).unwrap();
    let Poll::Batch(b) = r.poll().unwrap() else { panic!() };
    assert_eq!(b.num_rows(), 2);
    let mut again = reader(dir.path(), &sp, &r.positions()).unwrap();
    assert_eq!(values(&mut again).unwrap(), vec![3, 4]);
}

#[test]
fn a_bad_line_names_the_file_the_line_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let err = first_error(dir.path(), "{\"n\":1}\n{\"n\":\"not a number\"}\n", 2);
    assert!(err.contains("a.jsonl: line 2, column") && err.contains("field `n`") && err.contains("expected an int64"), "{err}");
    assert!(err.contains("bad_lines: skip"), "the error does not say how to skip: {err}");
}

#[test]
fn a_second_value_on_a_line_is_an_error_not_a_dropped_record() {
    let dir = tempfile::tempdir().unwrap();
    let err = first_error(dir.path(), "{\"n\":1} {\"n\":2}\n{\"n\":3}\n", 1);
    assert!(err.contains("a.jsonl: line 1, column 9") && err.contains("exactly one JSON object per line"), "{err}");
}

#[test]
fn mistyped_values_are_errors_not_conversions() {
    let dir = tempfile::tempdir().unwrap();
    for (line, found) in [("{\"n\":1.9}", "found 1.9"), ("{\"n\":\"42\"}", "found the string \"42\""), ("{\"n\":1,\"s\":5}", "found 5")] {
        let err = first_error(dir.path(), &format!("{{\"n\":0}}\n{line}\n"), 10);
        assert!(err.contains("line 2") && err.contains(found), "{line}: {err}");
    }
}

#[test]
fn a_misspelled_field_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let err = first_error(dir.path(), "{\"n\":1,\"ss\":\"x\"}\n", 10);
    assert!(err.contains("line 1") && err.contains("unknown field \"ss\"") && err.contains("fields: n, s"), "{err}");
}

#[test]
fn lines_that_are_not_one_json_object_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (line, expected) in [("[1]", "expected a JSON object, found an array"), ("{\"n\":", "malformed JSON"), ("\"n\"", "found the string")] {
        let err = first_error(dir.path(), &format!("{line}\n"), 10);
        assert!(err.contains("line 1") && err.contains(expected), "{line}: {err}");
    }
}

#[test]
fn absent_fields_and_null_are_read_as_null() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), "{\"n\":null}\n{\"s\":\"x\"}\n{}\n").unwrap();
    let mut r = reader(dir.path(), &spec(10, BadLines::Fail), &SourcePositions::default()).unwrap();
    assert_eq!(values(&mut r).unwrap(), vec![-1, -1, -1]);
}

const SIX_LINES: &str = "{\"n\":1}\n{\"n\":2}\n\n{\"n\":3}\n{\"n\":4}\n{\"n\":1.5}\n";

#[test]
fn line_numbers_after_a_restore_count_from_the_start_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), SIX_LINES).unwrap();
    let sp = spec(2, BadLines::Fail);
    let mut r = reader(dir.path(), &sp, &SourcePositions::default()).unwrap();
    assert!(matches!(r.poll().unwrap(), Poll::Batch(_)));
    let positions = r.positions();
    assert_eq!(positions.files["file:"].line, 2);
    let err = values(&mut reader(dir.path(), &sp, &positions).unwrap()).unwrap_err().to_string();
    assert!(err.contains("line 6,"), "{err}");
}

#[test]
fn line_numbers_after_a_restore_from_a_checkpoint_without_marks_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), SIX_LINES).unwrap();
    let sp = spec(2, BadLines::Fail);
    let mut r = reader(dir.path(), &sp, &SourcePositions::default()).unwrap();
    assert!(matches!(r.poll().unwrap(), Poll::Batch(_)));
    let mut old = r.positions();
    old.files.clear();
    let mut again = reader(dir.path(), &sp, &old).unwrap();
    assert_eq!(again.positions(), r.positions(), "the mark is rebuilt from the file");
    let err = values(&mut again).unwrap_err().to_string();
    assert!(err.contains("line 6,"), "{err}");
}

#[test]
fn skipped_lines_are_left_out_and_counted_across_a_restore() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), "{\"n\":1}\n{\"n\":1.9}\n{\"n\":3}\n{\"n\":4} {\"n\":5}\n{\"n\":6}\n").unwrap();
    let sp = spec(2, BadLines::Skip);
    let mut r = reader(dir.path(), &sp, &SourcePositions::default()).unwrap();
    let Poll::Batch(b) = r.poll().unwrap() else { panic!() };
    assert_eq!(b.column(0).as_primitive::<Int64Type>().values().to_vec(), vec![1, 3]);
    assert_eq!(r.take_skipped(), 1);
    assert_eq!(r.take_skipped(), 0);
    let positions = r.positions();
    assert_eq!(positions.files["file:"].skipped, 1);
    let mut again = reader(dir.path(), &sp, &positions).unwrap();
    assert_eq!(again.take_skipped(), 1, "a restored reader reports the skips its checkpoint counted");
    assert_eq!(values(&mut again).unwrap(), vec![6]);
    assert_eq!(again.take_skipped(), 1);
    assert_eq!(again.positions().files["file:"].skipped, 2);
}

/// A reader at the end of a file of `lines` numbered lines, and its positions.
fn read_all(dir: &Path, lines: usize) -> SourcePositions {
    let text: String = (0..lines).map(|i| format!("{{\"n\":{i},\"s\":\"line {i:06}\"}}\n")).collect();
    std::fs::write(dir.join("a.jsonl"), text).unwrap();
    let mut r = reader(dir, &spec(100, BadLines::Fail), &SourcePositions::default()).unwrap();
    assert_eq!(values(&mut r).unwrap().len(), lines);
    r.positions()
}

fn restore_error(dir: &Path, positions: &SourcePositions) -> String {
    match reader(dir, &spec(100, BadLines::Fail), positions) {
        Ok(_) => panic!("the changed file was accepted"),
        Err(e) => {
            assert!(matches!(e, Error::SourceFile { .. }), "{e:?}");
            e.to_string()
        }
    }
}

#[test]
fn a_file_replaced_after_a_checkpoint_is_refused_on_restore() {
    let dir = tempfile::tempdir().unwrap();
    let positions = read_all(dir.path(), 3);
    let text = std::fs::read_to_string(dir.path().join("a.jsonl")).unwrap();
    std::fs::write(dir.path().join("a.jsonl"), text.replace("line 000001", "line 999999")).unwrap();
    let err = restore_error(dir.path(), &positions);
    assert!(err.contains("a.jsonl") && err.contains("not the file the checkpoint read") && err.contains("restore another checkpoint"), "{err}");
}

#[test]
fn a_file_truncated_after_a_checkpoint_is_refused_on_restore() {
    let dir = tempfile::tempdir().unwrap();
    let positions = read_all(dir.path(), 3);
    std::fs::write(dir.path().join("a.jsonl"), "{\"n\":1}\n").unwrap();
    let err = restore_error(dir.path(), &positions);
    assert!(err.contains("a.jsonl") && err.contains("truncated or replaced"), "{err}");
}

#[test]
fn a_large_file_rewritten_at_its_start_or_before_the_offset_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let positions = read_all(dir.path(), 2000);
    let original = std::fs::read_to_string(dir.path().join("a.jsonl")).unwrap();
    for changed in ["line 000000", "line 001999"] {
        std::fs::write(dir.path().join("a.jsonl"), original.replace(changed, "line 777777")).unwrap();
        let err = restore_error(dir.path(), &positions);
        assert!(err.contains("not the file the checkpoint read"), "{changed}: {err}");
    }
}

#[test]
fn the_fingerprint_kept_while_reading_is_the_one_read_back_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..2000).map(|i| format!("{{\"n\":{i}}}\n")).collect();
    std::fs::write(dir.path().join("a.jsonl"), &text).unwrap();
    let sp = spec(700, BadLines::Fail);
    let mut r = reader(dir.path(), &sp, &SourcePositions::default()).unwrap();
    for _ in 0..2 {
        assert!(matches!(r.poll().unwrap(), Poll::Batch(_)));
        let positions = r.positions();
        let offset = positions.splits["file:"];
        assert!(offset > FINGERPRINT_WINDOW as u64);
        let path = dir.path().join("a.jsonl");
        let from_file = Window::read(&path, &mut File::open(&path).unwrap(), offset).unwrap();
        let mark = positions.files["file:"];
        assert_eq!(from_file.mark(mark.line, mark.skipped), mark);
    }
}

#[test]
fn a_file_appended_to_after_a_checkpoint_resumes_with_the_new_lines() {
    let dir = tempfile::tempdir().unwrap();
    let positions = read_all(dir.path(), 3);
    let mut text = std::fs::read_to_string(dir.path().join("a.jsonl")).unwrap();
    text.push_str("{\"n\":10}\n{\"n\":11}\n");
    std::fs::write(dir.path().join("a.jsonl"), text).unwrap();
    let mut r = reader(dir.path(), &spec(100, BadLines::Fail), &positions).unwrap();
    assert_eq!(values(&mut r).unwrap(), vec![10, 11]);
    assert_eq!(r.positions().files["file:"].line, 5);
}
