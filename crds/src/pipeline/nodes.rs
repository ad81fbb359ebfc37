//! The entries of a graph's `sources:` and `sinks:` maps.
//!
//! Each is written as one connector key, exactly as the chain form's
//! `source:` / `sink:`, beside `event_time` (a source) or `input` (a sink):
//!
//! ```yaml
//! sources:
//!   orders:
//!     kafka: {bootstrap_servers: kafka:9092, topic: orders, schema: {id: int64}}
//!     event_time: {field: ts}
//! sinks:
//!   audit:
//!     input: orders
//!     stdout: {}
//! ```
//!
//! The serde code is written by hand, as for steps, so that an unknown key
//! names the known ones and a second connector is refused by name.

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use super::{EventTimeSpec, SinkSpec, SourceSpec};

/// One source of a graph: a connector and, optionally, its event time.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceNode {
    pub spec: SourceSpec,
    /// Each source of a graph has its own event time (the chain form's
    /// top-level `event_time` belongs to its one source).
    pub event_time: Option<EventTimeSpec>,
}

/// One sink of a graph: the node it writes, and a connector.
#[derive(Debug, Clone, PartialEq)]
pub struct SinkNode {
    pub spec: SinkSpec,
    /// The name of the source or step whose records the sink writes.
    pub input: String,
}

const SOURCE_KINDS: &[&str] = &["generator", "file", "kafka", "socket"];
const SINK_KINDS: &[&str] = &["file", "postgres", "kafka", "stdout", "blackhole"];

fn source_of<'de, A: de::MapAccess<'de>>(kind: &str, map: &mut A) -> Result<Option<SourceSpec>, A::Error> {
    Ok(Some(match kind {
        "generator" => SourceSpec::Generator(map.next_value()?),
        "file" => SourceSpec::File(map.next_value()?),
        "kafka" => SourceSpec::Kafka(map.next_value()?),
        "socket" => SourceSpec::Socket(map.next_value()?),
        _ => return Ok(None),
    }))
}

fn sink_of<'de, A: de::MapAccess<'de>>(kind: &str, map: &mut A) -> Result<Option<SinkSpec>, A::Error> {
    Ok(Some(match kind {
        "file" => SinkSpec::File(map.next_value()?),
        "postgres" => SinkSpec::Postgres(map.next_value()?),
        "kafka" => SinkSpec::Kafka(map.next_value()?),
        "stdout" => SinkSpec::Stdout(map.next_value()?),
        "blackhole" => SinkSpec::Blackhole(map.next_value()?),
        _ => return Ok(None),
    }))
}

impl<'de> Deserialize<'de> for SourceNode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = SourceNode;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a source: a map with one of the keys {} and an optional event_time", SOURCE_KINDS.join(", "))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<SourceNode, A::Error> {
                let mut event_time = None;
                let mut spec: Option<SourceSpec> = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "event_time" {
                        event_time = Some(map.next_value()?);
                        continue;
                    }
                    let Some(parsed) = source_of(&key, &mut map)? else {
                        return Err(de::Error::custom(format!(
                            "unknown source key `{key}`, expected one of {} or event_time",
                            SOURCE_KINDS.join(", ")
                        )));
                    };
                    if let Some(prev) = &spec {
                        return Err(de::Error::custom(format!(
                            "a source has both `{}` and `{}`: write each source under a name of its own",
                            prev.kind(),
                            parsed.kind()
                        )));
                    }
                    spec = Some(parsed);
                }
                let spec = spec.ok_or_else(|| de::Error::custom(format!("a source needs one of {}", SOURCE_KINDS.join(", "))))?;
                Ok(SourceNode { spec, event_time })
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for SinkNode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = SinkNode;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a sink: a map with `input` and one of the keys {}", SINK_KINDS.join(", "))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<SinkNode, A::Error> {
                let mut input = None;
                let mut spec: Option<SinkSpec> = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "input" {
                        input = Some(map.next_value::<String>()?);
                        continue;
                    }
                    let Some(parsed) = sink_of(&key, &mut map)? else {
                        return Err(de::Error::custom(format!(
                            "unknown sink key `{key}`, expected input and one of {}",
                            SINK_KINDS.join(", ")
                        )));
                    };
                    if let Some(prev) = &spec {
                        return Err(de::Error::custom(format!(
                            "a sink has both `{}` and `{}`: write each sink under a name of its own",
                            prev.kind(),
                            parsed.kind()
                        )));
                    }
                    spec = Some(parsed);
                }
                let spec = spec.ok_or_else(|| de::Error::custom(format!("a sink needs one of {}", SINK_KINDS.join(", "))))?;
                let input = input.ok_or_else(|| de::Error::custom("a sink needs `input`: the name of the source or step it writes"))?;
                Ok(SinkNode { spec, input })
            }
        }
        d.deserialize_map(V)
    }
}

impl Serialize for SourceNode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        match &self.spec {
            SourceSpec::Generator(g) => m.serialize_entry("generator", g)?,
            SourceSpec::File(f) => m.serialize_entry("file", f)?,
            SourceSpec::Kafka(k) => m.serialize_entry("kafka", k)?,
            SourceSpec::Socket(sock) => m.serialize_entry("socket", sock)?,
        }
        if let Some(et) = &self.event_time {
            m.serialize_entry("event_time", et)?;
        }
        m.end()
    }
}

impl Serialize for SinkNode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("input", &self.input)?;
        match &self.spec {
            SinkSpec::File(f) => m.serialize_entry("file", f)?,
            SinkSpec::Postgres(p) => m.serialize_entry("postgres", p)?,
            SinkSpec::Kafka(k) => m.serialize_entry("kafka", k)?,
            SinkSpec::Stdout(o) => m.serialize_entry("stdout", o)?,
            SinkSpec::Blackhole(b) => m.serialize_entry("blackhole", b)?,
        }
        m.end()
    }
}

// Like `Step`'s, the schemas say only "an object with at least one key":
// the API server keeps every field (`x-kubernetes-preserve-unknown-fields`,
// added by `kubernetes_compatible`), and the controller's parse names what is
// wrong, with the same messages as `weir run`.
impl schemars::JsonSchema for SourceNode {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SourceNode".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "description": "One source of a graph: one of the keys generator, file, kafka, socket, and an optional event_time",
            "minProperties": 1
        })
    }
}

impl schemars::JsonSchema for SinkNode {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SinkNode".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "description": "One sink of a graph: input (the source or step it writes) and one of the keys file, postgres, kafka, stdout, blackhole",
            "minProperties": 2
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_node_reads_its_connector_and_event_time_and_names_the_known_keys() {
        let node: SourceNode = serde_yaml::from_str("generator: {keys: 3}\nevent_time: {field: value}\n").unwrap();
        assert_eq!(node.spec.kind(), "generator");
        assert_eq!(node.event_time.as_ref().map(|e| e.field.as_str()), Some("value"));
        assert_eq!(serde_yaml::from_str::<SourceNode>(&serde_yaml::to_string(&node).unwrap()).unwrap(), node);
        let err = serde_yaml::from_str::<SourceNode>("kafak: {}\n").unwrap_err().to_string();
        assert!(err.contains("unknown source key `kafak`, expected one of generator, file, kafka, socket or event_time"), "{err}");
        let err = serde_yaml::from_str::<SourceNode>("generator: {}\nsocket: {address: a:1, schema: {a: int64}}\n").unwrap_err().to_string();
        assert!(err.contains("both `generator` and `socket`"), "{err}");
        let err = serde_yaml::from_str::<SourceNode>("event_time: {field: value}\n").unwrap_err().to_string();
        assert!(err.contains("a source needs one of generator, file, kafka, socket"), "{err}");
    }

    #[test]
    fn a_sink_node_needs_an_input_and_one_connector() {
        let node: SinkNode = serde_yaml::from_str("input: counts\nfile: {path: out}\n").unwrap();
        assert_eq!((node.input.as_str(), node.spec.kind()), ("counts", "file"));
        assert_eq!(serde_yaml::from_str::<SinkNode>(&serde_yaml::to_string(&node).unwrap()).unwrap(), node);
        let err = serde_yaml::from_str::<SinkNode>("stdout: {}\n").unwrap_err().to_string();
        assert!(err.contains("a sink needs `input`"), "{err}");
        let err = serde_yaml::from_str::<SinkNode>("input: a\nprint: {}\n").unwrap_err().to_string();
        assert!(err.contains("unknown sink key `print`, expected input and one of file, postgres, kafka, stdout, blackhole"), "{err}");
    }
}
