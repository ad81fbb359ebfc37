//! `Named<T>`: a YAML map from a name to a `T`, kept in the order written.
//!
//! A graph's `sources:` and `sinks:` are written as maps so that each name is
//! written once, beside what it names. The order is kept because it is the
//! order errors are found and reported in, and a name written twice is
//! refused rather than silently replaced by the second one (as `source::Schema`
//! does for fields).

use std::fmt;
use std::marker::PhantomData;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, PartialEq)]
pub struct Named<T>(pub Vec<(String, T)>);

impl<T> Default for Named<T> {
    fn default() -> Self {
        Named(Vec::new())
    }
}

impl<T> Named<T> {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The entries in the order written.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.0.iter().map(|(name, value)| (name.as_str(), value))
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

impl<T: Serialize> Serialize for Named<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            m.serialize_entry(name, value)?;
        }
        m.end()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Named<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> de::Visitor<'de> for V<T> {
            type Value = Named<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map from a name to its settings")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Named<T>, A::Error> {
                let mut entries: Vec<(String, T)> = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if entries.iter().any(|(n, _)| *n == name) {
                        return Err(de::Error::custom(format!("`{name}` is written twice: expected each name once")));
                    }
                    let value = map.next_value::<T>()?;
                    entries.push((name, value));
                }
                Ok(Named(entries))
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

impl<T: schemars::JsonSchema> schemars::JsonSchema for Named<T> {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        format!("Named_{}", T::schema_name()).into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let value = generator.subschema_for::<T>();
        schemars::json_schema!({
            "type": "object",
            "additionalProperties": value
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Named;

    #[test]
    fn names_keep_the_order_written_and_a_name_written_twice_is_refused() {
        let named: Named<u32> = serde_yaml::from_str("b: 1\na: 2\nc: 3\n").unwrap();
        assert_eq!(named.iter().map(|(n, _)| n).collect::<Vec<_>>(), ["b", "a", "c"]);
        assert_eq!(named.get("a"), Some(&2));
        assert_eq!(serde_yaml::to_string(&named).unwrap(), "b: 1\na: 2\nc: 3\n");
        let err = serde_yaml::from_str::<Named<u32>>("a: 1\nb: 2\na: 3\n").unwrap_err().to_string();
        assert!(err.contains("`a` is written twice"), "{err}");
    }
}
