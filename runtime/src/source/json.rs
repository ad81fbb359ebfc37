//! Strict decoding of JSON lines into Arrow columns.
//!
//! serde_json parses each line straight into typed cells (no intermediate
//! `Value` or map), and only a line that decoded completely is appended to
//! the column builders, so a bad line leaves the batch as it was. What is
//! accepted: exactly one JSON object per line; only the schema's fields, each
//! at most once; `int64` a JSON integer in range (no fraction or exponent),
//! `float64` any JSON number, `string` a JSON string, `boolean` `true` or
//! `false`; an absent field or `null` is null. Nothing is converted: `1.9` and
//! `"42"` are not int64 values.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanBuilder, Float64Builder, Int64Builder, RecordBatch, StringBuilder};
use arrow::datatypes::{DataType, SchemaRef};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Unexpected, Visitor};

use crate::error::{Error, Result};

/// Why a line was not decoded: `message` names the field when there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct BadLine {
    /// 1-based, in bytes, where the decoder noticed.
    pub column: usize,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Int64,
    Float64,
    String,
    Boolean,
}

impl Kind {
    fn expected(self) -> &'static str {
        match self {
            Kind::Int64 => "an int64 (a JSON integer, without fraction or exponent)",
            Kind::Float64 => "a float64 (a JSON number)",
            Kind::String => "a string (a JSON string)",
            Kind::Boolean => "a boolean (true or false)",
        }
    }
}

/// One field's value in the line being decoded.
#[derive(Debug, Clone, Copy)]
enum Cell {
    Absent,
    Null,
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A range of the decoder's string scratch buffer.
    Str(usize, usize),
}

enum Column {
    Int64(Int64Builder),
    Float64(Float64Builder),
    String(StringBuilder),
    Boolean(BooleanBuilder),
}

struct Fields {
    names: Vec<String>,
    kinds: Vec<Kind>,
    index: HashMap<String, usize>,
}

pub struct LineDecoder {
    fields: Fields,
    cells: Vec<Cell>,
    scratch: String,
    columns: Vec<Column>,
    rows: usize,
}

impl LineDecoder {
    pub fn new(schema: &SchemaRef) -> Result<LineDecoder> {
        let mut kinds = Vec::new();
        let mut columns = Vec::new();
        for f in schema.fields() {
            let (kind, column) = match f.data_type() {
                DataType::Int64 => (Kind::Int64, Column::Int64(Int64Builder::new())),
                DataType::Float64 => (Kind::Float64, Column::Float64(Float64Builder::new())),
                DataType::Utf8 => (Kind::String, Column::String(StringBuilder::new())),
                DataType::Boolean => (Kind::Boolean, Column::Boolean(BooleanBuilder::new())),
                other => {
                    return Err(Error::Plan {
                        context: "file source".into(),
                        message: format!("field `{}` has type {other}, which JSON lines cannot give", f.name()),
                    })
                }
            };
            kinds.push(kind);
            columns.push(column);
        }
        let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let index = names.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect();
        Ok(LineDecoder { cells: vec![Cell::Absent; names.len()], fields: Fields { names, kinds, index }, scratch: String::new(), columns, rows: 0 })
    }

    /// Rows decoded since the last [`LineDecoder::finish`].
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Decodes one line (a trailing newline is ignored) and appends it, or
    /// leaves the batch untouched and says why not.
    pub fn push_line(&mut self, mut line: &[u8]) -> Result<(), BadLine> {
        while let [rest @ .., b'\n' | b'\r'] = line {
            line = rest;
        }
        self.cells.fill(Cell::Absent);
        self.scratch.clear();
        let mut de = serde_json::Deserializer::from_slice(line);
        let seed = ObjectSeed { fields: &self.fields, cells: &mut self.cells, scratch: &mut self.scratch };
        seed.deserialize(&mut de).map_err(|e| bad_line(&e, false))?;
        de.end().map_err(|e| bad_line(&e, true))?;
        for (cell, column) in self.cells.iter().zip(&mut self.columns) {
            match (column, *cell) {
                (Column::Int64(b), Cell::Int(v)) => b.append_value(v),
                (Column::Float64(b), Cell::Float(v)) => b.append_value(v),
                (Column::Boolean(b), Cell::Bool(v)) => b.append_value(v),
                (Column::String(b), Cell::Str(from, to)) => b.append_value(&self.scratch[from..to]),
                (Column::Int64(b), _) => b.append_null(),
                (Column::Float64(b), _) => b.append_null(),
                (Column::Boolean(b), _) => b.append_null(),
                (Column::String(b), _) => b.append_null(),
            }
        }
        self.rows += 1;
        Ok(())
    }

    /// The rows decoded so far as a batch; the decoder starts a new one.
    pub fn finish(&mut self, schema: &SchemaRef) -> Result<RecordBatch> {
        let arrays: Vec<ArrayRef> = self
            .columns
            .iter_mut()
            .map(|c| match c {
                Column::Int64(b) => Arc::new(b.finish()) as ArrayRef,
                Column::Float64(b) => Arc::new(b.finish()),
                Column::String(b) => Arc::new(b.finish()),
                Column::Boolean(b) => Arc::new(b.finish()),
            })
            .collect();
        self.rows = 0;
        RecordBatch::try_new(schema.clone(), arrays).map_err(Error::arrow("file source: building a batch"))
    }
}

/// serde_json's error without its " at line 1 column N" (the line is the
/// caller's to name, the column is kept apart).
fn bad_line(e: &serde_json::Error, after_object: bool) -> BadLine {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let text = text.strip_suffix(&suffix).unwrap_or(&text);
    let message = if after_object {
        "more follows the object: expected exactly one JSON object per line".to_string()
    } else {
        match e.classify() {
            serde_json::error::Category::Data => text.to_string(),
            _ => format!("malformed JSON: {text}"),
        }
    };
    BadLine { column: e.column(), message }
}

/// How a value that does not fit is named in a message.
struct Found<'a>(Unexpected<'a>);

impl fmt::Display for Found<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.0 {
            Unexpected::Bool(b) => write!(f, "{b}"),
            Unexpected::Unsigned(u) => write!(f, "{u}"),
            Unexpected::Signed(i) => write!(f, "{i}"),
            Unexpected::Float(x) => write!(f, "{x:?}"),
            Unexpected::Str(s) => write!(f, "the string {:?}", Shortened(s)),
            Unexpected::Unit => f.write_str("null"),
            Unexpected::Seq => f.write_str("an array"),
            Unexpected::Map => f.write_str("an object"),
            other => write!(f, "{other}"),
        }
    }
}

/// A string cut to a length that fits in a log line.
struct Shortened<'a>(&'a str);

impl fmt::Debug for Shortened<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        const MAX: usize = 40;
        match self.0.char_indices().nth(MAX) {
            Some((at, _)) => write!(f, "{:?}…", &self.0[..at]),
            None => write!(f, "{:?}", self.0),
        }
    }
}

/// The whole line: one object.
struct ObjectSeed<'a> {
    fields: &'a Fields,
    cells: &'a mut [Cell],
    scratch: &'a mut String,
}

impl ObjectSeed<'_> {
    fn not_an_object<E: de::Error>(found: Unexpected) -> E {
        E::custom(format!("expected a JSON object, found {}", Found(found)))
    }
}

impl<'de> DeserializeSeed<'de> for ObjectSeed<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ObjectSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(i) = map.next_key_seed(KeySeed(self.fields))? {
            let name = &self.fields.names[i];
            if !matches!(self.cells[i], Cell::Absent) {
                return Err(de::Error::custom(format!("field `{name}` appears twice")));
            }
            self.cells[i] = map.next_value_seed(ValueSeed { name, kind: self.fields.kinds[i], scratch: &mut *self.scratch })?;
        }
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        Err(Self::not_an_object(Unexpected::Bool(v)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        Err(Self::not_an_object(Unexpected::Signed(v)))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        Err(Self::not_an_object(Unexpected::Unsigned(v)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        Err(Self::not_an_object(Unexpected::Float(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        Err(Self::not_an_object(Unexpected::Str(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(Self::not_an_object(Unexpected::Unit))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(Self::not_an_object(Unexpected::Seq))
    }
}

/// A key of the line's object: the index of its schema field.
struct KeySeed<'a>(&'a Fields);

impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
    type Value = usize;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_> {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<usize, E> {
        self.0.index.get(key).copied().ok_or_else(|| {
            E::custom(format!("unknown field {:?}, not in the schema (fields: {})", Shortened(key), self.0.names.join(", ")))
        })
    }
}

/// The value of field `name`, of type `kind`.
struct ValueSeed<'a> {
    name: &'a str,
    kind: Kind,
    scratch: &'a mut String,
}

impl ValueSeed<'_> {
    fn wrong<E: de::Error>(&self, found: Unexpected) -> E {
        E::custom(format!("field `{}`: expected {}, found {}", self.name, self.kind.expected(), Found(found)))
    }
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Cell;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Cell, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Cell;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} for field `{}`", self.kind.expected(), self.name)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Cell, E> {
        Ok(Cell::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Cell, E> {
        Ok(Cell::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Cell, E> {
        match self.kind {
            Kind::Boolean => Ok(Cell::Bool(v)),
            _ => Err(self.wrong(Unexpected::Bool(v))),
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Cell, E> {
        match self.kind {
            Kind::Int64 => Ok(Cell::Int(v)),
            Kind::Float64 => Ok(Cell::Float(v as f64)),
            _ => Err(self.wrong(Unexpected::Signed(v))),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Cell, E> {
        match self.kind {
            Kind::Int64 => match i64::try_from(v) {
                Ok(v) => Ok(Cell::Int(v)),
                Err(_) => Err(E::custom(format!("field `{}`: {v} is out of range for an int64 (at most {})", self.name, i64::MAX))),
            },
            Kind::Float64 => Ok(Cell::Float(v as f64)),
            _ => Err(self.wrong(Unexpected::Unsigned(v))),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Cell, E> {
        // serde_json gives integers below i64::MIN as f64 too: they are out of
        // range for an int64 either way.
        match self.kind {
            Kind::Float64 => Ok(Cell::Float(v)),
            _ => Err(self.wrong(Unexpected::Float(v))),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Cell, E> {
        match self.kind {
            Kind::String => {
                let from = self.scratch.len();
                self.scratch.push_str(v);
                Ok(Cell::Str(from, self.scratch.len()))
            }
            _ => Err(self.wrong(Unexpected::Str(v))),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Cell, A::Error> {
        Err(self.wrong(Unexpected::Seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Cell, A::Error> {
        Err(self.wrong(Unexpected::Map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Field, Float64Type, Int64Type, Schema};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, true),
            Field::new("x", DataType::Float64, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("b", DataType::Boolean, true),
        ]))
    }

    fn decode(line: &str) -> Result<RecordBatch, BadLine> {
        let mut d = LineDecoder::new(&schema()).unwrap();
        d.push_line(line.as_bytes())?;
        Ok(d.finish(&schema()).unwrap())
    }

    fn refused(line: &str) -> String {
        match decode(line) {
            Ok(b) => panic!("{line} was accepted: {b:?}"),
            Err(e) => e.message,
        }
    }

    #[test]
    fn each_type_takes_its_own_json_type() {
        let b = decode(r#"{"n": -9223372036854775808, "x": 3, "s": "a\"b", "b": false}"#).unwrap();
        assert_eq!(b.column(0).as_primitive::<Int64Type>().value(0), i64::MIN);
        assert_eq!(b.column(1).as_primitive::<Float64Type>().value(0), 3.0);
        assert_eq!(b.column(2).as_string::<i32>().value(0), "a\"b");
        assert!(!b.column(3).as_boolean().value(0));
        let b = decode(r#"{"n": 9223372036854775807, "x": 1.5e300}"#).unwrap();
        assert_eq!(b.column(0).as_primitive::<Int64Type>().value(0), i64::MAX);
        assert_eq!(b.column(1).as_primitive::<Float64Type>().value(0), 1.5e300);
    }

    #[test]
    fn absent_fields_and_null_are_null() {
        let b = decode(r#"{"n": null, "s": null}"#).unwrap();
        assert_eq!(b.num_rows(), 1);
        for c in 0..4 {
            assert!(b.column(c).is_null(0), "column {c}");
        }
        let b = decode("{}").unwrap();
        assert!(b.column(0).is_null(0));
    }

    #[test]
    fn int64_takes_only_json_integers_in_range() {
        for (v, found) in [("1.9", "1.9"), ("1.0", "1.0"), ("1e2", "100.0"), ("\"42\"", "the string \"42\""), ("true", "true"), ("[1]", "an array")] {
            let msg = refused(&format!(r#"{{"n": {v}}}"#));
            assert!(msg.contains("field `n`") && msg.contains("expected an int64") && msg.contains(&format!("found {found}")), "{v}: {msg}");
        }
        let msg = refused(r#"{"n": 9223372036854775808}"#);
        assert!(msg.contains("field `n`") && msg.contains("out of range"), "{msg}");
        let msg = refused(r#"{"n": -9223372036854775809}"#);
        assert!(msg.contains("field `n`"), "{msg}");
    }

    #[test]
    fn float64_string_and_boolean_refuse_other_json_types() {
        let msg = refused(r#"{"x": "1.5"}"#);
        assert!(msg.contains("field `x`: expected a float64") && msg.contains("found the string \"1.5\""), "{msg}");
        let msg = refused(r#"{"s": 5}"#);
        assert!(msg.contains("field `s`: expected a string") && msg.contains("found 5"), "{msg}");
        let msg = refused(r#"{"s": {"a": 1}}"#);
        assert!(msg.contains("field `s`") && msg.contains("found an object"), "{msg}");
        let msg = refused(r#"{"b": "true"}"#);
        assert!(msg.contains("field `b`: expected a boolean") && msg.contains("found the string \"true\""), "{msg}");
        let msg = refused(r#"{"b": 1}"#);
        assert!(msg.contains("field `b`") && msg.contains("found 1"), "{msg}");
    }

    #[test]
    fn an_unknown_field_is_named_with_the_known_ones() {
        let msg = refused(r#"{"n": 1, "nn": 2}"#);
        assert!(msg.contains("unknown field \"nn\"") && msg.contains("n, x, s, b"), "{msg}");
    }

    #[test]
    fn a_field_given_twice_is_refused() {
        let msg = refused(r#"{"n": null, "n": 2}"#);
        assert!(msg.contains("field `n` appears twice"), "{msg}");
    }

    #[test]
    fn a_line_holds_exactly_one_object() {
        let e = decode(r#"{"n":1} {"n":2}"#).unwrap_err();
        assert!(e.message.contains("exactly one JSON object per line"), "{e:?}");
        assert_eq!(e.column, 9);
        for (line, found) in [("[1, 2]", "an array"), ("5", "5"), ("\"x\"", "the string \"x\""), ("null", "null")] {
            let msg = refused(line);
            assert!(msg.contains(&format!("expected a JSON object, found {found}")), "{line}: {msg}");
        }
    }

    #[test]
    fn malformed_json_is_named_with_its_column() {
        let e = decode(r#"{"n": 1,"#).unwrap_err();
        assert!(e.message.starts_with("malformed JSON: "), "{e:?}");
        assert!(!e.message.contains("line 1"), "{e:?}");
        let mut d = LineDecoder::new(&schema()).unwrap();
        let e = d.push_line(b"{\"s\": \"\xff\"}").unwrap_err();
        assert!(e.message.starts_with("malformed JSON"), "{e:?}");
    }

    #[test]
    fn a_bad_line_leaves_the_batch_as_it_was() {
        let mut d = LineDecoder::new(&schema()).unwrap();
        d.push_line(br#"{"n": 1, "s": "kept"}"#).unwrap();
        d.push_line(br#"{"n": 2, "s": "half", "x": "bad"}"#).unwrap_err();
        d.push_line(b"{\"n\": 3}\r\n").unwrap();
        assert_eq!(d.rows(), 2);
        let b = d.finish(&schema()).unwrap();
        assert_eq!(b.column(0).as_primitive::<Int64Type>().values().to_vec(), vec![1, 3]);
        assert_eq!(b.column(2).as_string::<i32>().value(0), "kept");
        assert!(b.column(2).is_null(1));
        assert_eq!(d.finish(&schema()).unwrap().num_rows(), 0);
    }
}
