//! The Kafka source and sink settings.
//!
//! `properties` passes further librdkafka settings through, except those the
//! connector owns: they have fields of their own, or exactly-once depends on
//! them. TLS and SASL are librdkafka's own settings (`security.protocol`,
//! `ssl.*`, `sasl.*`); the secret ones (passwords, private keys) are refused
//! in `properties` and come from environment variables named in
//! `properties_from_env` instead, so that no pipeline file or StreamJob
//! holds them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::source::Schema;
use super::{Guarantee, HumanDuration, PipelineError, PipelineSource};

/// Records from the partitions of one topic, each message value one JSON
/// object decoded like a line of the file source. Partitions are spread over
/// the subtasks; each partition's offset is part of every checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSourceSpec {
    /// Brokers to bootstrap from: `host:port`, comma-separated.
    pub bootstrap_servers: String,
    pub topic: String,
    /// The fields of each message value, in order, with their types.
    pub schema: Schema,
    /// Where a partition is read from when no checkpoint has a position for
    /// it (the job's first start, or a partition added since): `earliest`
    /// (the default), `latest`, or `timestamp` (the first message at or
    /// after `start_timestamp`).
    #[serde(default)]
    pub start: StartPosition,
    /// Milliseconds since the Unix epoch, for `start: timestamp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<i64>,
    /// `never` (the default): the source runs until the job is stopped.
    /// `end`: each partition is read until the consumer reaches its end
    /// (for read_committed, the last committed message), then the job
    /// finishes once every partition has.
    #[serde(default)]
    pub stop: StopPosition,
    /// `read_committed` (the default) sees only messages of committed
    /// transactions, so a job reading another job's exactly-once output
    /// never sees records that were rolled back; `read_uncommitted` sees all.
    #[serde(default)]
    pub isolation: Isolation,
    /// What a message that is not one JSON object of the schema does:
    /// `fail` (the default) stops the job naming topic, partition and
    /// offset; `skip` leaves it out, logs and counts it
    /// (`records_skipped`); `dead_letter` also copies it to
    /// `dead_letter_topic`, at least once, with headers naming where it
    /// came from and why.
    #[serde(default)]
    pub bad_messages: BadMessages,
    /// The topic bad messages are copied to under `bad_messages: dead_letter`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_topic: Option<String>,
    /// Messages per record batch, at most.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// Messages per second over all subtasks, at most; 0 (the default)
    /// reads as fast as the job keeps up. Throttles a backfill so that it
    /// does not crowd out other work.
    #[serde(default)]
    pub rate: u64,
    /// Further librdkafka consumer settings, e.g. `fetch.max.bytes`, or TLS
    /// and SASL: `security.protocol: SASL_SSL`, `sasl.mechanism`,
    /// `sasl.username`, `ssl.ca.location` (secrets: `properties_from_env`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,

    /// librdkafka settings whose values are secrets, read from environment
    /// variables when the job starts: setting → variable, e.g.
    /// `sasl.password: KAFKA_PASSWORD` (on Kubernetes, set the variable from
    /// a Secret with `spec.env[].valueFrom.secretKeyRef`). Values are never
    /// logged or shown in errors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties_from_env: BTreeMap<String, String>,
}

fn default_batch_size() -> u32 {
    1024
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StartPosition {
    #[default]
    Earliest,
    Latest,
    /// At `start_timestamp`.
    Timestamp,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopPosition {
    #[default]
    Never,
    End,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    #[default]
    ReadCommitted,
    ReadUncommitted,
}

impl Isolation {
    /// librdkafka's `isolation.level` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "read_committed",
            Isolation::ReadUncommitted => "read_uncommitted",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BadMessages {
    #[default]
    Fail,
    Skip,
    /// Copied to `dead_letter_topic`, then skipped.
    DeadLetter,
}

/// Records as JSON objects in the message values of one topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkSpec {
    /// Brokers to bootstrap from: `host:port`, comma-separated.
    pub bootstrap_servers: String,
    pub topic: String,
    /// `exactly-once` (the default): each subtask writes a checkpoint's
    /// records in one Kafka transaction, committed when the checkpoint
    /// completes; read_committed consumers see each record once.
    /// `at-least-once`: records are flushed at every checkpoint and may
    /// repeat after a failure.
    #[serde(default = "exactly_once")]
    pub guarantee: Guarantee,
    /// A field whose value becomes the message key (messages of one key go
    /// to one partition). Without it messages have no key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Kafka's `transaction.timeout.ms`: a transaction open longer is
    /// aborted by the broker. It must exceed `checkpoint.interval` plus
    /// `checkpoint.timeout` (a transaction stays open that long), and the
    /// broker's `transaction.max.timeout.ms` (15 minutes by default) bounds it.
    #[serde(default = "default_transaction_timeout")]
    pub transaction_timeout: HumanDuration,
    /// Where an exactly-once sink records, inside each transaction, which
    /// checkpoint the transaction belongs to. Recovery reads it to tell a
    /// transaction that committed from one that must be written again.
    /// Created with one partition if missing.
    #[serde(default = "default_progress_topic")]
    pub progress_topic: String,
    /// Further librdkafka producer settings, e.g. `linger.ms`, or TLS and
    /// SASL as in the Kafka source.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,

    /// librdkafka settings whose values are secrets, read from environment
    /// variables when the job starts: setting → variable, e.g.
    /// `sasl.password: KAFKA_PASSWORD` (on Kubernetes, set the variable from
    /// a Secret with `spec.env[].valueFrom.secretKeyRef`). Values are never
    /// logged or shown in errors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties_from_env: BTreeMap<String, String>,
}

fn exactly_once() -> Guarantee {
    Guarantee::ExactlyOnce
}

fn default_transaction_timeout() -> HumanDuration {
    HumanDuration::from_millis(10 * 60 * 1000)
}

fn default_progress_topic() -> String {
    "weir-sink-progress".into()
}

/// Settings the connectors own: a field sets them, or exactly-once needs
/// their value.
const SOURCE_OWNED: &[(&str, &str)] = &[
    ("bootstrap.servers", "use `bootstrap_servers`"),
    ("isolation.level", "use `isolation`"),
    ("enable.auto.commit", "offsets live in checkpoints"),
    ("enable.auto.offset.store", "offsets live in checkpoints"),
    ("auto.offset.reset", "use `start`"),
    ("enable.partition.eof", "use `stop`"),
    ("group.id", "partitions are assigned by weir, not by a consumer group"),
];

const SINK_OWNED: &[(&str, &str)] = &[
    ("bootstrap.servers", "use `bootstrap_servers`"),
    ("transactional.id", "weir derives it from the job, the subtask and the topic"),
    ("transaction.timeout.ms", "use `transaction_timeout`"),
    ("enable.idempotence", "weir sets it"),
    ("acks", "weir needs acks=all"),
];

/// librdkafka settings whose values are secrets: refused in `properties`,
/// where they would sit in the pipeline file or the StreamJob.
const SECRET_SETTINGS: &[&str] = &[
    "sasl.password",
    "sasl.oauthbearer.client.secret",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl.keystore.password",
    "ssl_key",
];

fn validate_properties(
    src: &PipelineSource,
    field: &str,
    properties: &BTreeMap<String, String>,
    from_env: &BTreeMap<String, String>,
    owned: &[(&str, &str)],
) -> Result<(), PipelineError> {
    for key in properties.keys().chain(from_env.keys()) {
        let place = if properties.contains_key(key) { "properties" } else { "properties_from_env" };
        if let Some((_, why)) = owned.iter().find(|(k, _)| k == key) {
            return Err(src.invalid(&format!("{field}.{place}.{key}"), format!("weir sets `{key}` itself: {why}")));
        }
    }
    for key in properties.keys() {
        if SECRET_SETTINGS.contains(&key.as_str()) {
            return Err(src.invalid(
                &format!("{field}.properties.{key}"),
                format!("`{key}` is a secret and must not be written in the pipeline: name an environment variable that holds it in `properties_from_env` ({key}: VARIABLE; on Kubernetes, set the variable from a Secret)"),
            ));
        }
        if from_env.contains_key(key) {
            return Err(src.invalid(&format!("{field}.properties.{key}"), "is also in properties_from_env: set it in one of the two"));
        }
    }
    for (key, var) in from_env {
        let ok = var.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(src.invalid(&format!("{field}.properties_from_env.{key}"), format!("{var:?} is not an environment variable name: expected letters, digits and `_`, not starting with a digit")));
        }
    }
    Ok(())
}

fn validate_address(src: &PipelineSource, field: &str, servers: &str) -> Result<(), PipelineError> {
    let bad = servers.split(',').map(str::trim).find(|s| match s.rsplit_once(':') {
        Some((host, port)) => host.is_empty() || port.parse::<u16>().is_err(),
        None => true,
    });
    if servers.trim().is_empty() || bad.is_some() {
        return Err(src.invalid(
            &format!("{field}.bootstrap_servers"),
            format!("{servers:?}: expected HOST:PORT, or several separated by commas"),
        ));
    }
    Ok(())
}

fn validate_topic(src: &PipelineSource, field: &str, topic: &str) -> Result<(), PipelineError> {
    let ok = !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !ok {
        return Err(src.invalid(
            field,
            format!("{topic:?} is not a Kafka topic name: expected 1 to 249 letters, digits, `.`, `_` or `-`"),
        ));
    }
    Ok(())
}

impl KafkaSourceSpec {
    /// `at` is the source's path (`source`, `sources.orders`).
    pub(super) fn validate(&self, src: &PipelineSource, at: &str) -> Result<(), PipelineError> {
        validate_address(src, &format!("{at}.kafka"), &self.bootstrap_servers)?;
        validate_topic(src, &format!("{at}.kafka.topic"), &self.topic)?;
        if self.schema.0.is_empty() {
            return Err(src.invalid(&format!("{at}.kafka.schema"), "expected at least one field, e.g. `schema: {id: int64, name: string}`"));
        }
        if self.batch_size == 0 {
            return Err(src.invalid(&format!("{at}.kafka.batch_size"), "expected at least 1"));
        }
        match (self.bad_messages, &self.dead_letter_topic) {
            (BadMessages::DeadLetter, Some(topic)) => {
                validate_topic(src, &format!("{at}.kafka.dead_letter_topic"), topic)?;
                if *topic == self.topic {
                    return Err(src.invalid(&format!("{at}.kafka.dead_letter_topic"), "expected another topic than the one read"));
                }
            }
            (BadMessages::DeadLetter, None) => {
                return Err(src.invalid(&format!("{at}.kafka.dead_letter_topic"), "`bad_messages: dead_letter` needs the topic to copy bad messages to"))
            }
            (_, Some(_)) => {
                return Err(src.invalid(&format!("{at}.kafka.dead_letter_topic"), "is only used with `bad_messages: dead_letter`"));
            }
            (_, None) => {}
        }
        match (self.start, self.start_timestamp) {
            (StartPosition::Timestamp, Some(t)) if t >= 0 => {}
            (StartPosition::Timestamp, Some(_)) => {
                return Err(src.invalid(&format!("{at}.kafka.start_timestamp"), "expected milliseconds since the Unix epoch, at least 0"));
            }
            (StartPosition::Timestamp, None) => {
                return Err(src.invalid(&format!("{at}.kafka.start_timestamp"), "`start: timestamp` needs the time to start at, in milliseconds since the Unix epoch"));
            }
            (_, Some(_)) => return Err(src.invalid(&format!("{at}.kafka.start_timestamp"), "is only used with `start: timestamp`")),
            (_, None) => {}
        }
        validate_properties(src, &format!("{at}.kafka"), &self.properties, &self.properties_from_env, SOURCE_OWNED)
    }
}

impl KafkaSinkSpec {
    /// `checkpoint_interval` and `checkpoint_timeout` bound how long a
    /// transaction stays open.
    pub(super) fn validate(&self, src: &PipelineSource, at: &str, checkpoint_interval: HumanDuration, checkpoint_timeout: HumanDuration) -> Result<(), PipelineError> {
        validate_address(src, &format!("{at}.kafka"), &self.bootstrap_servers)?;
        validate_topic(src, &format!("{at}.kafka.topic"), &self.topic)?;
        validate_topic(src, &format!("{at}.kafka.progress_topic"), &self.progress_topic)?;
        if self.progress_topic == self.topic {
            return Err(src.invalid(&format!("{at}.kafka.progress_topic"), "expected another topic than the output topic"));
        }
        if self.guarantee == Guarantee::AtMostOnce {
            return Err(src.invalid(&format!("{at}.kafka.guarantee"), "expected exactly-once or at-least-once"));
        }
        if self.key.as_deref() == Some("") {
            return Err(src.invalid(&format!("{at}.kafka.key"), "expected a field name"));
        }
        // A transaction opens at one barrier and commits when the next
        // checkpoint completes: that one is triggered up to an interval (or
        // the previous checkpoint's timeout) later and takes up to a
        // timeout itself. (After a declined checkpoint it stays open
        // longer; if the broker aborts it then, the commit fails, and the
        // restore writes the interval again from the sink's log.)
        let open = checkpoint_interval.get().max(checkpoint_timeout.get()) + checkpoint_timeout.get();
        if self.guarantee == Guarantee::ExactlyOnce && self.transaction_timeout.get() <= open {
            return Err(src.invalid(
                &format!("{at}.kafka.transaction_timeout"),
                format!(
                    "{} is not longer than the longer of checkpoint.interval ({checkpoint_interval}) and checkpoint.timeout ({checkpoint_timeout}), \
                     plus checkpoint.timeout: the broker would abort a transaction before its checkpoint can complete. Raise transaction_timeout \
                     (at most the broker's transaction.max.timeout.ms) or lower the checkpoint settings",
                    self.transaction_timeout
                ),
            ));
        }
        if self.transaction_timeout.get().as_millis() > i32::MAX as u128 {
            return Err(src.invalid(&format!("{at}.kafka.transaction_timeout"), "expected at most 24 days (Kafka keeps it in 32-bit milliseconds)"));
        }
        validate_properties(src, &format!("{at}.kafka"), &self.properties, &self.properties_from_env, SINK_OWNED)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PipelineSpec, SinkSpec, SourceSpec};
    use super::*;

    fn parse(source: &str, sink: &str) -> Result<PipelineSpec, String> {
        let text = format!("name: t\nsource:\n  kafka:\n    bootstrap_servers: 127.0.0.1:9092\n    topic: in\n    schema: {{n: int64}}\n{source}sink:\n  kafka:\n    bootstrap_servers: 127.0.0.1:9092\n    topic: out\n{sink}");
        PipelineSpec::from_yaml("p.yaml", &text).map_err(|e| e.to_string())
    }

    #[test]
    fn unwritten_settings_default_to_exactly_once_read_committed_and_failing_on_bad_messages() {
        let spec = parse("", "").unwrap();
        let SourceSpec::Kafka(source) = spec.source.as_ref().unwrap() else { panic!("not a kafka source") };
        assert_eq!((source.start, source.stop, source.isolation, source.bad_messages), (StartPosition::Earliest, StopPosition::Never, Isolation::ReadCommitted, BadMessages::Fail));
        let SinkSpec::Kafka(sink) = spec.sink.as_ref().unwrap() else { panic!("not a kafka sink") };
        assert_eq!(sink.guarantee, Guarantee::ExactlyOnce);
        assert_eq!(sink.transaction_timeout.get().as_secs(), 600);
        assert_eq!(sink.progress_topic, "weir-sink-progress");
        assert_eq!(spec.guarantee(), Guarantee::ExactlyOnce);
    }

    #[test]
    fn an_at_least_once_sink_makes_the_job_at_least_once() {
        let spec = parse("", "    guarantee: at-least-once\n").unwrap();
        assert_eq!(spec.guarantee(), Guarantee::AtLeastOnce);
        let err = parse("", "    guarantee: at-most-once\n").unwrap_err();
        assert!(err.contains("sink.kafka.guarantee"), "{err}");
    }

    #[test]
    fn settings_weir_owns_are_refused_in_properties_naming_the_setting_to_use() {
        let err = parse("    properties: {group.id: mine}\n", "").unwrap_err();
        assert!(err.contains("source.kafka.properties.group.id") && err.contains("assigned by weir"), "{err}");
        let err = parse("", "    properties: {transaction.timeout.ms: '1000'}\n").unwrap_err();
        assert!(err.contains("sink.kafka.properties.transaction.timeout.ms") && err.contains("transaction_timeout"), "{err}");
        let err = parse("    properties: {sasl.password: hunter2}\n", "").unwrap_err();
        assert!(err.contains("source.kafka.properties.sasl.password") && err.contains("properties_from_env") && !err.contains("hunter2"), "{err}");
        let err = parse("", "    properties_from_env: {transactional.id: TID}\n").unwrap_err();
        assert!(err.contains("sink.kafka.properties_from_env.transactional.id"), "{err}");
        assert!(parse("    properties: {fetch.max.bytes: '1048576'}\n", "    properties: {linger.ms: '5'}\n").is_ok());
    }

    #[test]
    fn tls_and_sasl_settings_pass_and_their_secrets_come_from_named_environment_variables() {
        let tls = "    properties: {security.protocol: SASL_SSL, sasl.mechanism: SCRAM-SHA-512, sasl.username: weir, ssl.ca.location: /etc/kafka/ca.pem}\n    properties_from_env: {sasl.password: KAFKA_PASSWORD}\n";
        assert!(parse(tls, tls).is_ok());
        let err = parse("    properties_from_env: {sasl.password: 9LIVES}\n", "").unwrap_err();
        assert!(err.contains("source.kafka.properties_from_env.sasl.password") && err.contains("not an environment variable name"), "{err}");
        let err = parse("", "    properties: {sasl.username: a}\n    properties_from_env: {sasl.username: USER}\n").unwrap_err();
        assert!(err.contains("sink.kafka.properties.sasl.username") && err.contains("one of the two"), "{err}");
    }

    #[test]
    fn a_dead_letter_policy_or_a_timestamp_start_without_its_value_is_refused() {
        let err = parse("    bad_messages: dead_letter\n", "").unwrap_err();
        assert!(err.contains("source.kafka.dead_letter_topic"), "{err}");
        let err = parse("    bad_messages: dead_letter\n    dead_letter_topic: in\n", "").unwrap_err();
        assert!(err.contains("another topic"), "{err}");
        assert!(parse("    bad_messages: dead_letter\n    dead_letter_topic: errors\n", "").is_ok());
        let err = parse("    start: timestamp\n", "").unwrap_err();
        assert!(err.contains("source.kafka.start_timestamp"), "{err}");
        let err = parse("    start_timestamp: 5\n", "").unwrap_err();
        assert!(err.contains("only used with `start: timestamp`"), "{err}");
        assert!(parse("    start: timestamp\n    start_timestamp: 1764547200000\n", "").is_ok());
    }

    #[test]
    fn bad_addresses_and_topic_names_are_refused_naming_the_field() {
        let text = "name: t\nsource:\n  kafka:\n    bootstrap_servers: localhost\n    topic: in\n    schema: {n: int64}\nsink:\n  blackhole: {}\n";
        let err = PipelineSpec::from_yaml("p.yaml", text).unwrap_err().to_string();
        assert!(err.contains("source.kafka.bootstrap_servers") && err.contains("HOST:PORT"), "{err}");
        let err = parse("", "    progress_topic: out\n").unwrap_err();
        assert!(err.contains("sink.kafka.progress_topic"), "{err}");
        let text = "name: t\nsource:\n  kafka:\n    bootstrap_servers: a:1\n    topic: 'bad topic'\n    schema: {n: int64}\nsink:\n  blackhole: {}\n";
        let err = PipelineSpec::from_yaml("p.yaml", text).unwrap_err().to_string();
        assert!(err.contains("source.kafka.topic") && err.contains("not a Kafka topic name"), "{err}");
    }

    #[test]
    fn a_transaction_timeout_within_two_checkpoint_durations_is_refused_naming_both_settings() {
        let text = "name: t\ncheckpoint: {interval: 10s, timeout: 50s}\nsource:\n  generator: {}\nsink:\n  kafka:\n    bootstrap_servers: a:1\n    topic: out\n    transaction_timeout: 100s\n";
        let err = PipelineSpec::from_yaml("p.yaml", text).unwrap_err().to_string();
        assert!(err.contains("sink.kafka.transaction_timeout") && err.contains("checkpoint.interval (10s)") && err.contains("checkpoint.timeout (50s)"), "{err}");
        assert!(PipelineSpec::from_yaml("p.yaml", &text.replace("100s\n", "101s\n")).is_ok());
        // At least once, no transaction stays open.
        assert!(PipelineSpec::from_yaml("p.yaml", &text.replace("    transaction_timeout", "    guarantee: at-least-once\n    transaction_timeout")).is_ok());
    }
}
