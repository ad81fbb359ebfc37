//! Where results go, and with which guarantee.

use serde::{Deserialize, Serialize};

use super::postgres_sink::{PostgresMode, PostgresSinkSpec};
use super::{PipelineError, PipelineSource};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SinkSpec {
    /// Files under a directory; exactly-once by two-phase commit.
    File(FileSinkSpec),
    /// Rows of a PostgreSQL table; exactly-once by two-phase commit,
    /// through a write-ahead log, or by upserts on a key.
    Postgres(PostgresSinkSpec),
    /// Messages of a Kafka topic; exactly-once by Kafka transactions
    /// committed when a checkpoint completes, or at-least-once.
    Kafka(super::kafka::KafkaSinkSpec),
    /// Lines on standard output; records may repeat after a failure.
    Stdout(StdoutSinkSpec),
    /// Drops every record (for benchmarks).
    Blackhole(BlackholeSinkSpec),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSinkSpec {
    /// Output directory, relative to the directory the job is started in,
    /// or `s3://BUCKET/PREFIX` (each file is staged under a hidden name at
    /// the checkpoint and copied to its final name when the checkpoint
    /// completes).
    pub path: String,
    #[serde(default)]
    pub format: FileFormat,
    #[serde(default = "exactly_once")]
    pub guarantee: Guarantee,
    /// A new file starts once the current one holds this many bytes
    /// (default 128 MiB, at most 4 GiB for `s3://` output); a new file also
    /// starts at every checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_file_bytes: Option<u64>,
}

/// Where `max_file_bytes` is not set.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 128 << 20;
/// The largest `max_file_bytes` for `s3://` output: a file is published by
/// one server-side copy, which S3 allows up to 5 GiB, and a file may pass
/// `max_file_bytes` by one batch.
pub const MAX_S3_FILE_BYTES: u64 = 4 << 30;

impl FileSinkSpec {
    /// The size at which the sink starts a new file.
    pub fn max_file_bytes(&self) -> u64 {
        self.max_file_bytes.unwrap_or(DEFAULT_MAX_FILE_BYTES)
    }

    /// The output is in S3 (`s3://…`) rather than in a directory.
    pub fn is_s3(&self) -> bool {
        self.path.starts_with("s3://")
    }
}

pub(super) fn exactly_once() -> Guarantee {
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
    /// The file sink's settings, when this is one.
    pub fn file(self) -> Option<FileSinkSpec> {
        match self {
            SinkSpec::File(f) => Some(f),
            _ => None,
        }
    }

    /// The sink's name as the pipeline writes it.
    pub fn kind(&self) -> &'static str {
        match self {
            SinkSpec::File(_) => "file",
            SinkSpec::Postgres(_) => "postgres",
            SinkSpec::Kafka(_) => "kafka",
            SinkSpec::Stdout(_) => "stdout",
            SinkSpec::Blackhole(_) => "blackhole",
        }
    }

    pub fn guarantee(&self) -> Guarantee {
        match self {
            SinkSpec::File(f) => f.guarantee,
            // Upserts replay to the same final rows: exactly-once for each
            // key's final row (the mode's doc says what a reader may see
            // meanwhile).
            SinkSpec::Postgres(p) => match p.mode {
                PostgresMode::TwoPhaseCommit | PostgresMode::WriteAheadLog | PostgresMode::Upsert => Guarantee::ExactlyOnce,
            },
            SinkSpec::Kafka(k) => k.guarantee,
            SinkSpec::Stdout(_) => Guarantee::AtLeastOnce,
            // Nothing reaches an external system, so nothing can be duplicated.
            SinkSpec::Blackhole(_) => Guarantee::ExactlyOnce,
        }
    }

    pub(super) fn validate(&self, src: &PipelineSource) -> Result<(), PipelineError> {
        if let SinkSpec::Postgres(p) = self {
            p.validate(src)?;
        }
        if let SinkSpec::File(f) = self {
            if f.path.is_empty() {
                return Err(src.invalid("sink.file.path", "expected a directory path or s3://BUCKET/PREFIX"));
            }
            if let Some((scheme, rest)) = f.path.split_once("://") {
                if scheme != "s3" {
                    return Err(src.invalid(
                        "sink.file.path",
                        format!("{:?}: unsupported scheme {scheme}://; expected a directory path or s3://BUCKET/PREFIX", f.path),
                    ));
                }
                let bucket = rest.split('/').next().unwrap_or_default();
                if bucket.is_empty() || rest.contains(['?', '#', '@']) {
                    return Err(src.invalid(
                        "sink.file.path",
                        format!("{:?}: expected s3://BUCKET/PREFIX (a bucket, then an optional prefix; no user, query or fragment)", f.path),
                    ));
                }
            }
            if f.max_file_bytes == Some(0) {
                return Err(src.invalid("sink.file.max_file_bytes", "expected a size in bytes above 0"));
            }
            if f.is_s3() && f.max_file_bytes() > MAX_S3_FILE_BYTES {
                return Err(src.invalid(
                    "sink.file.max_file_bytes",
                    format!("{} bytes is too big for s3:// output: expected at most {MAX_S3_FILE_BYTES} (4 GiB; S3 copies at most 5 GiB in one request)", f.max_file_bytes()),
                ));
            }
        }
        Ok(())
    }
}
