//! Where results go, and with which guarantee.

use serde::{Deserialize, Serialize};

use super::{PipelineError, PipelineSource};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SinkSpec {
    /// Files under a directory; exactly-once by two-phase commit.
    File(FileSinkSpec),
    /// Lines on standard output; records may repeat after a failure.
    Stdout(StdoutSinkSpec),
    /// Drops every record (for benchmarks).
    Blackhole(BlackholeSinkSpec),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSinkSpec {
    /// Output directory, relative to the directory the job is started in.
    pub path: String,
    #[serde(default)]
    pub format: FileFormat,
    #[serde(default = "exactly_once")]
    pub guarantee: Guarantee,
}

fn exactly_once() -> Guarantee {
    Guarantee::ExactlyOnce
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StdoutSinkSpec {}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BlackholeSinkSpec {}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FileFormat {
    /// One JSON object per line.
    #[default]
    Jsonl,
}

/// Consistency levels, weakest first, so that `min` gives the weakest part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Guarantee {
    AtMostOnce,
    AtLeastOnce,
    ExactlyOnce,
}

impl std::fmt::Display for Guarantee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Guarantee::AtMostOnce => "at-most-once",
            Guarantee::AtLeastOnce => "at-least-once",
            Guarantee::ExactlyOnce => "exactly-once",
        })
    }
}

impl SinkSpec {
    pub fn guarantee(&self) -> Guarantee {
        match self {
            SinkSpec::File(f) => f.guarantee,
            SinkSpec::Stdout(_) => Guarantee::AtLeastOnce,
            // Nothing reaches an external system, so nothing can be duplicated.
            SinkSpec::Blackhole(_) => Guarantee::ExactlyOnce,
        }
    }

    pub(super) fn validate(&self, src: &PipelineSource) -> Result<(), PipelineError> {
        if let SinkSpec::File(f) = self {
            if f.path.is_empty() {
                return Err(src.invalid("sink.file.path", "expected a directory path"));
            }
            if f.guarantee == Guarantee::AtMostOnce {
                return Err(src.invalid(
                    "sink.file.guarantee",
                    "expected exactly-once or at-least-once",
                ));
            }
        }
        Ok(())
    }
}
