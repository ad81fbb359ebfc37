//! How a step is read and written. By hand rather than derived, so that an
//! unknown step names the known ones and two kinds in one step are refused
//! by name.

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use super::{Step, StepKind, KINDS};

/// `key_by: key` or `key_by: [a, b]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(f) => vec![f],
            OneOrMany::Many(fs) => fs,
        }
    }
}

/// A field written as one name or a list of names (`on: id`, `on: [a, b]`).
pub(in crate::pipeline) fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(OneOrMany::deserialize(d)?.into_vec())
}

/// [`one_or_many`] for an optional field (`right_on`).
pub(in crate::pipeline) fn some_one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    Ok(Some(OneOrMany::deserialize(d)?.into_vec()))
}

/// An empty map (`union: {}`): the kinds that have no settings yet.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoSettings {}

fn kind_of<'de, A: de::MapAccess<'de>>(key: &str, map: &mut A) -> Result<StepKind, A::Error> {
    Ok(match key {
        "key_by" => StepKind::KeyBy(map.next_value::<OneOrMany>()?.into_vec()),
        "filter" => StepKind::Filter(map.next_value()?),
        "select" => StepKind::Select(map.next_value()?),
        "running_count" => StepKind::RunningCount(map.next_value()?),
        "running_sum" => StepKind::RunningSum(map.next_value()?),
        "running_min" => StepKind::RunningMin(map.next_value()?),
        "running_max" => StepKind::RunningMax(map.next_value()?),
        "window" => StepKind::Window(map.next_value()?),
        "union" => map.next_value::<NoSettings>().map(|_| StepKind::Union)?,
        "broadcast" => map.next_value::<NoSettings>().map(|_| StepKind::Broadcast)?,
        "interval_join" => StepKind::IntervalJoin(map.next_value()?),
        "window_join" => StepKind::WindowJoin(map.next_value()?),
        "join" => StepKind::Join(map.next_value()?),
        "lookup_join" => StepKind::LookupJoin(map.next_value()?),
        other => {
            return Err(de::Error::custom(format!(
                "unknown step `{other}`, expected one of {}",
                KINDS.join(", ")
            )))
        }
    })
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Step;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a step: a map with one of the keys {}", KINDS.join(", "))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Step, A::Error> {
                let (mut id, mut name, mut input) = (None, None, Vec::new());
                let mut kind: Option<StepKind> = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "id" => id = Some(map.next_value::<String>()?),
                        "name" => name = Some(map.next_value::<String>()?),
                        "input" => input = map.next_value::<OneOrMany>()?.into_vec(),
                        _ => {
                            let parsed = kind_of(&key, &mut map)?;
                            if let Some(prev) = &kind {
                                return Err(de::Error::custom(format!(
                                    "a step has both `{}` and `{}`: write each step as its own list item",
                                    prev.name(),
                                    parsed.name()
                                )));
                            }
                            kind = Some(parsed);
                        }
                    }
                }
                let kind = kind.ok_or_else(|| {
                    de::Error::custom(format!("a step needs one of {}", KINDS.join(", ")))
                })?;
                Ok(Step { id, name, input, kind })
            }
        }
        d.deserialize_map(V)
    }
}

impl Serialize for Step {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        if let Some(name) = &self.name {
            m.serialize_entry("name", name)?;
        }
        match &self.input[..] {
            [] => {}
            [one] => m.serialize_entry("input", one)?,
            many => m.serialize_entry("input", many)?,
        }
        if let Some(id) = &self.id {
            m.serialize_entry("id", id)?;
        }
        let empty = serde_json::Map::new();
        match &self.kind {
            StepKind::KeyBy(f) => m.serialize_entry("key_by", f)?,
            StepKind::Filter(e) => m.serialize_entry("filter", e)?,
            StepKind::Select(e) => m.serialize_entry("select", e)?,
            StepKind::RunningCount(o) => m.serialize_entry("running_count", o)?,
            StepKind::RunningSum(a) => m.serialize_entry("running_sum", a)?,
            StepKind::RunningMin(a) => m.serialize_entry("running_min", a)?,
            StepKind::RunningMax(a) => m.serialize_entry("running_max", a)?,
            StepKind::Window(w) => m.serialize_entry("window", w)?,
            StepKind::Union => m.serialize_entry("union", &empty)?,
            StepKind::Broadcast => m.serialize_entry("broadcast", &empty)?,
            StepKind::IntervalJoin(j) => m.serialize_entry("interval_join", j)?,
            StepKind::WindowJoin(j) => m.serialize_entry("window_join", j)?,
            StepKind::Join(j) => m.serialize_entry("join", j)?,
            StepKind::LookupJoin(j) => m.serialize_entry("lookup_join", j)?,
        }
        m.end()
    }
}

impl schemars::JsonSchema for Step {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Step".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "object",
            "description": "One step: a map with one of the keys key_by, filter, select, running_count, running_sum, running_min, running_max, window, union, broadcast, interval_join, window_join, join, lookup_join, an optional id and, in a graph, its name and input",
            "minProperties": 1,
            "maxProperties": 4
        })
    }
}
