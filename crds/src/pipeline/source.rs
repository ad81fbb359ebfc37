//! Where records come from.

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use super::{PipelineError, PipelineSource};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceSpec {
    /// Deterministic events: event i has seq = i, key = i % keys, value = i.
    Generator(GeneratorSpec),
    /// JSON lines from a file or from every file of a directory, decoded strictly:
    /// one JSON object per line, only the schema's fields, each of its type.
    File(FileSourceSpec),
    /// JSON objects in the messages of a Kafka topic, offsets kept in checkpoints.
    Kafka(super::kafka::KafkaSourceSpec),
    /// JSON lines read from a TCP server (`address: HOST:PORT`), decoded
    /// like the file source's. A socket cannot replay what it sent before a
    /// failure, so a job reading one is at-most-once, and says so.
    Socket(SocketSourceSpec),
}

/// Newline-delimited JSON objects from a TCP server. Subtask 0 connects and
/// reads; the other subtasks of the source have nothing to read. The source
/// ends when the server closes the connection; a connection that cannot be
/// made or breaks fails the run, and the next run connects again and reads
/// what the server sends from then on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SocketSourceSpec {
    /// The server: `HOST:PORT` (`[IPv6]:PORT` for an IPv6 address).
    pub address: String,
    /// The fields of each line, in order, with their types.
    pub schema: Schema,
    /// Lines per record batch (a batch is emitted sooner when no more lines are waiting).
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// What a bad line does: `fail` (the default) or `skip` (left out, logged, counted).
    #[serde(default)]
    pub bad_lines: BadLines,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GeneratorSpec {
    /// How many events in total; without it the source never ends.
    #[serde(default)]
    pub events: Option<u64>,
    /// Number of distinct keys.
    #[serde(default = "default_keys")]
    pub keys: u64,
    /// Events per second over all subtasks; 0 means as fast as possible.
    #[serde(default)]
    pub rate: u64,
    /// Events per record batch.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
}

fn default_keys() -> u64 {
    1000
}

fn default_batch_size() -> u32 {
    1024
}

/// JSON lines, decoded strictly. Each non-blank line must hold exactly one JSON
/// object whose keys are fields of `schema`; a field that is absent or `null` is
/// null. Values are never converted: an `int64` field takes only a JSON integer
/// in range (no fraction, no exponent: `1.0` and `"42"` are refused), a
/// `float64` field any JSON number, a `string` field a JSON string, a `boolean`
/// field `true` or `false`. A line that breaks any of this is a bad line, and
/// `bad_lines` decides what happens to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSourceSpec {
    /// A file of JSON lines, or a directory whose files (in name order) are read.
    pub path: String,
    /// The fields of each line, in order, with their types.
    pub schema: Schema,
    /// Lines per record batch.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// What a bad line does: `fail` (the default) stops the job with an error
    /// naming the file, the line and the field; `skip` leaves the line out,
    /// logs it and counts it in the job's status (`records_skipped`).
    #[serde(default)]
    pub bad_lines: BadLines,
}

/// The policy for a line the file source cannot decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BadLines {
    /// The job fails at once (a restart would meet the same line again).
    #[default]
    Fail,
    /// The line is left out, logged with its file and line number, and counted.
    Skip,
}

/// Field names and types, in the order written.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Schema(pub Vec<(String, FieldType)>);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FieldType {
    Int64,
    Float64,
    String,
    Boolean,
}

impl SourceSpec {
    /// The source's name as the pipeline writes it.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceSpec::Generator(_) => "generator",
            SourceSpec::File(_) => "file",
            SourceSpec::Kafka(_) => "kafka",
            SourceSpec::Socket(_) => "socket",
        }
    }

    /// Whether the source can re-read records from a position kept in a checkpoint.
    pub fn replayable(&self) -> bool {
        match self {
            SourceSpec::Generator(_) | SourceSpec::File(_) | SourceSpec::Kafka(_) => true,
            SourceSpec::Socket(_) => false,
        }
    }

    /// Checks the connector's settings; `at` is the source's path (`source`,
    /// `sources.orders`), which every error's field starts with.
    pub(super) fn validate(&self, src: &PipelineSource, at: &str) -> Result<(), PipelineError> {
        match self {
            SourceSpec::Generator(g) => {
                if g.keys == 0 {
                    return Err(src.invalid(&format!("{at}.generator.keys"), "expected at least 1"));
                }
                if g.batch_size == 0 {
                    return Err(src.invalid(&format!("{at}.generator.batch_size"), "expected at least 1"));
                }
            }
            SourceSpec::File(f) => {
                if f.path.is_empty() {
                    return Err(src.invalid(&format!("{at}.file.path"), "expected a file or directory path"));
                }
                if f.schema.0.is_empty() {
                    return Err(src.invalid(&format!("{at}.file.schema"),
                        "expected at least one field, e.g. `schema: {id: int64, name: string}`",
                    ));
                }
                if f.batch_size == 0 {
                    return Err(src.invalid(&format!("{at}.file.batch_size"), "expected at least 1"));
                }
            }
            SourceSpec::Kafka(k) => k.validate(src, at)?,
            SourceSpec::Socket(sock) => {
                let port = sock.address.rsplit_once(':').map(|(host, port)| (host.trim_start_matches('[').trim_end_matches(']'), port));
                if !matches!(port, Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)) {
                    return Err(src.invalid(&format!("{at}.socket.address"),
                        format!("{:?}: expected HOST:PORT, e.g. `localhost:9000` or `[::1]:9000`", sock.address),
                    ));
                }
                if sock.schema.0.is_empty() {
                    return Err(src.invalid(&format!("{at}.socket.schema"),
                        "expected at least one field, e.g. `schema: {id: int64, name: string}`",
                    ));
                }
                if sock.batch_size == 0 {
                    return Err(src.invalid(&format!("{at}.socket.batch_size"), "expected at least 1"));
                }
            }
        }
        Ok(())
    }
}

impl Serialize for Schema {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Schema {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Schema;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map from field name to type (int64, float64, string, boolean)")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Schema, A::Error> {
                let mut fields: Vec<(String, FieldType)> = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if fields.iter().any(|(n, _)| *n == name) {
                        return Err(de::Error::custom(format!("field `{name}` is listed twice")));
                    }
                    let ty = map.next_value::<FieldType>()?;
                    fields.push((name, ty));
                }
                Ok(Schema(fields))
            }
        }
        d.deserialize_map(V)
    }
}

impl schemars::JsonSchema for Schema {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Schema".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "additionalProperties": { "type": "string", "enum": ["int64", "float64", "string", "boolean"] }
        })
    }
}
