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
    /// or a prefix in an object store: `s3://BUCKET/PREFIX`,
    /// `gs://BUCKET/PREFIX` or `az://CONTAINER/PREFIX` (each file is staged
    /// under a hidden name at the checkpoint and copied to its final name
    /// when the checkpoint completes).
    pub path: String,
    #[serde(default)]
    pub format: FileFormat,
    #[serde(default = "exactly_once")]
    pub guarantee: Guarantee,
    /// A new file starts once the current one holds this many bytes
    /// (default 128 MiB, at most 4 GiB in an object store); a new file also
    /// starts at every checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_file_bytes: Option<u64>,
}

/// Where `max_file_bytes` is not set.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 128 << 20;
/// The largest `max_file_bytes` for output to an object store: a file is
/// published by one server-side copy, which S3 allows up to 5 GiB (the
/// least of the stores), and a file may pass `max_file_bytes` by one batch.
pub const MAX_OBJECT_FILE_BYTES: u64 = 4 << 30;

impl FileSinkSpec {
    /// The size at which the sink starts a new file.
    pub fn max_file_bytes(&self) -> u64 {
        self.max_file_bytes.unwrap_or(DEFAULT_MAX_FILE_BYTES)
    }

    /// Checks the settings of a file output at `field` (`sink.file`, or a
    /// window's `late_records`).
    pub(super) fn validate(&self, src: &PipelineSource, field: &str) -> Result<(), PipelineError> {
        if self.path.is_empty() {
            return Err(src.invalid(&format!("{field}.path"), format!("expected a directory path or {}", crate::object_store_url::OBJECT_STORE_FORMS)));
        }
        if let Some(Err(e)) = crate::object_store_url::object_store_kind(&self.path) {
            return Err(src.invalid(&format!("{field}.path"), format!("{:?}: {e}", self.path)));
        }
        if self.max_file_bytes == Some(0) {
            return Err(src.invalid(&format!("{field}.max_file_bytes"), "expected a size in bytes above 0"));
        }
        if self.in_object_store() && self.max_file_bytes() > MAX_OBJECT_FILE_BYTES {
            return Err(src.invalid(
                &format!("{field}.max_file_bytes"),
                format!("{} bytes is too big for output to an object store: expected at most {MAX_OBJECT_FILE_BYTES} (4 GiB; S3 copies at most 5 GiB in one request)", self.max_file_bytes()),
            ));
        }
        Ok(())
    }

    /// The output is in an object store (`s3://`, `gs://`, `az://`…) rather than in a directory.
    pub fn in_object_store(&self) -> bool {
        crate::object_store_url::object_store_kind(&self.path).is_some()
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

/// How a sink keeps its output consistent with the checkpoints: the
/// textbook sink contracts. Every sink states one ([`SinkSpec::contract`])
/// and its guarantee follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkContract {
    /// Pre-commit at the barrier, commit when the checkpoint completes,
    /// commit again harmlessly on recovery, abort what no completed
    /// checkpoint references (the file sink, PostgreSQL `two-phase-commit`,
    /// the exactly-once Kafka sink).
    TwoPhaseCommit,
    /// A checkpoint's records are kept with the checkpoint and written to
    /// the target only once it completes, each write acknowledged durably
    /// so that recovery neither loses nor repeats it (PostgreSQL
    /// `write-ahead-log`).
    WriteAheadLog,
    /// Writes keyed so that replaying them converges (PostgreSQL `upsert`):
    /// each key's final state exactly once, earlier versions at least once.
    Idempotent,
    /// Output is made durable at each barrier and visible at once: a replay
    /// after a failure writes it again (at-least-once file and Kafka sinks).
    FlushAtBarrier,
    /// Output is written as it is produced (stdout): a replay writes it again.
    WriteThrough,
    /// Nothing leaves the job (blackhole), so nothing can be repeated.
    Discard,
}

impl SinkContract {
    pub fn guarantee(self) -> Guarantee {
        match self {
            SinkContract::TwoPhaseCommit | SinkContract::WriteAheadLog | SinkContract::Idempotent | SinkContract::Discard => Guarantee::ExactlyOnce,
            SinkContract::FlushAtBarrier | SinkContract::WriteThrough => Guarantee::AtLeastOnce,
        }
    }

    /// What the sink does, as the end of "its sink …" in a guarantee's reason.
    pub fn describe(self) -> &'static str {
        match self {
            SinkContract::TwoPhaseCommit => "commits with the checkpoints (two-phase commit)",
            SinkContract::WriteAheadLog => "writes each checkpoint's records once it completes (write-ahead log)",
            SinkContract::Idempotent => {
                "upserts on its key (idempotent writes): each key's final row is exactly-once, while an earlier version of a row may be seen again after a failure"
            }
            SinkContract::FlushAtBarrier => "publishes at each barrier, so a replay after a failure publishes again",
            SinkContract::WriteThrough => "writes as it goes, so a replay after a failure writes again",
            SinkContract::Discard => "discards every record",
        }
    }
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

    /// Which sink contract this sink follows; its guarantee follows from it.
    pub fn contract(&self) -> SinkContract {
        match self {
            SinkSpec::File(f) if f.guarantee == Guarantee::ExactlyOnce => SinkContract::TwoPhaseCommit,
            SinkSpec::File(_) => SinkContract::FlushAtBarrier,
            SinkSpec::Postgres(p) => match p.mode {
                PostgresMode::TwoPhaseCommit => SinkContract::TwoPhaseCommit,
                PostgresMode::WriteAheadLog => SinkContract::WriteAheadLog,
                PostgresMode::Upsert => SinkContract::Idempotent,
            },
            // Kafka transactions are the two phases; the records of each
            // interval are also logged with the checkpoint, so that a
            // transaction another process left uncommitted can be written
            // again (librdkafka cannot resume it).
            SinkSpec::Kafka(k) if k.guarantee == Guarantee::ExactlyOnce => SinkContract::TwoPhaseCommit,
            SinkSpec::Kafka(_) => SinkContract::FlushAtBarrier,
            SinkSpec::Stdout(_) => SinkContract::WriteThrough,
            SinkSpec::Blackhole(_) => SinkContract::Discard,
        }
    }

    pub fn guarantee(&self) -> Guarantee {
        self.contract().guarantee()
    }

    /// Checks the connector's settings; `at` is the sink's path (`sink`,
    /// `sinks.audit`). A Kafka sink's transaction timeout is checked against
    /// the checkpoint settings, which only the whole pipeline knows.
    pub(super) fn validate(&self, src: &PipelineSource, at: &str, checkpoint: &super::CheckpointSpec) -> Result<(), PipelineError> {
        match self {
            SinkSpec::Postgres(p) => p.validate(src, at),
            SinkSpec::File(f) => f.validate(src, &format!("{at}.file")),
            SinkSpec::Kafka(k) => k.validate(src, at, checkpoint.interval, checkpoint.timeout),
            SinkSpec::Stdout(_) | SinkSpec::Blackhole(_) => Ok(()),
        }
    }
}
