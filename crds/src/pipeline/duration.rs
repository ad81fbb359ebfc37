//! Durations written the way people write them: `500ms`, `10s`, `2m`, `1h`.

use std::fmt;
use std::time::Duration;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(Duration);

impl HumanDuration {
    pub const fn from_millis(ms: u64) -> Self {
        HumanDuration(Duration::from_millis(ms))
    }

    pub fn get(self) -> Duration {
        self.0
    }

    pub fn is_zero(self) -> bool {
        self.0.is_zero()
    }

    /// Parses `<number><unit>` with unit one of ms, s, m, h.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let value: f64 = num.parse().map_err(|_| {
            format!("`{text}` is not a duration: expected a number and a unit, e.g. 500ms, 10s, 2m")
        })?;
        let ms = match unit.trim() {
            "ms" => value,
            "s" => value * 1e3,
            "m" | "min" => value * 60e3,
            "h" => value * 3600e3,
            "" => return Err(format!("`{text}` has no unit: expected ms, s, m or h, e.g. {value}s")),
            other => return Err(format!("`{text}` has an unknown unit `{other}`: expected ms, s, m or h")),
        };
        if !ms.is_finite() || !(0.0..=1e12).contains(&ms) {
            return Err(format!("`{text}` is out of range"));
        }
        Ok(HumanDuration(Duration::from_micros((ms * 1e3) as u64)))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(3_600_000) && ms > 0 {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms.is_multiple_of(60_000) && ms > 0 {
            write!(f, "{}m", ms / 60_000)
        } else if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        HumanDuration::parse(&text).map_err(de::Error::custom)
    }
}

impl schemars::JsonSchema for HumanDuration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^[0-9]+(\\.[0-9]+)?(ms|s|m|min|h)$",
            "description": "A duration such as 500ms, 10s, 2m or 1h"
        })
    }
}

/// A duration that may be negative (`-5s`), for bounds relative to a
/// record's time such as an interval join's `between: {lower: -5s, upper: 1h}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignedDuration {
    pub negative: bool,
    pub magnitude: HumanDuration,
}

impl SignedDuration {
    /// The duration in milliseconds, below 0 when negative.
    pub fn millis(self) -> i64 {
        let ms = self.magnitude.get().as_millis() as i64;
        if self.negative { -ms } else { ms }
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim().strip_prefix('-') {
            Some(rest) => Ok(SignedDuration { negative: true, magnitude: HumanDuration::parse(rest)? }),
            None => Ok(SignedDuration { negative: false, magnitude: HumanDuration::parse(text)? }),
        }
    }
}

impl fmt::Display for SignedDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.negative && !self.magnitude.is_zero() { "-" } else { "" };
        write!(f, "{sign}{}", self.magnitude)
    }
}

impl Serialize for SignedDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for SignedDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        SignedDuration::parse(&text).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_people_write() {
        assert_eq!(HumanDuration::parse("500ms").unwrap().get(), Duration::from_millis(500));
        assert_eq!(HumanDuration::parse("1.5s").unwrap().get(), Duration::from_millis(1500));
        assert_eq!(HumanDuration::parse("2m").unwrap().get(), Duration::from_secs(120));
        assert_eq!(HumanDuration::parse("0s").unwrap().get(), Duration::ZERO);
    }

    #[test]
    fn rejects_a_duration_without_unit_and_says_which_units_exist() {
        let err = HumanDuration::parse("500").unwrap_err();
        assert!(err.contains("no unit"), "{err}");
        let err = HumanDuration::parse("5 parsecs").unwrap_err();
        assert!(err.contains("unknown unit"), "{err}");
    }

    #[test]
    fn a_signed_duration_reads_and_writes_its_sign() {
        let d = SignedDuration::parse("-1.5s").unwrap();
        assert_eq!((d.millis(), d.to_string()), (-1500, "-1500ms".to_string()));
        assert_eq!(SignedDuration::parse("2m").unwrap().millis(), 120_000);
        assert_eq!(SignedDuration::parse("-0s").unwrap().to_string(), "0s");
        assert!(SignedDuration::parse("--1s").is_err());
    }

    #[test]
    fn displays_in_the_largest_whole_unit() {
        assert_eq!(HumanDuration::from_millis(500).to_string(), "500ms");
        assert_eq!(HumanDuration::from_millis(120_000).to_string(), "2m");
    }
}
