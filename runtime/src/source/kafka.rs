//! Records from a Kafka topic. Each partition is a split (`kafka:TOPIC:P`)
//! whose position is the offset of the next message to read; partition `p`
//! belongs to subtask `p % parallelism`, so a restore at another parallelism
//! hands each partition, with its offset, to its new owner.
//!
//! Partitions are assigned by weir, not by a consumer group: offsets live
//! only in checkpoints, and nothing is committed to Kafka. A partition that
//! no checkpoint mentions starts where `start` says on the job's first
//! start, and at its earliest offset after a restore (it was added since the
//! checkpoint, so all of it is new to the job).
//!
//! The consumer reads `read_committed` by default: messages of aborted
//! transactions are never seen, and neither are messages of open ones, so a
//! job reading another job's exactly-once output sees each record once.
//!
//! A message value is decoded like a line of the file source (`json.rs`).
//! One that does not decode fails the job naming topic, partition and
//! offset, or is skipped and counted, or is copied to a dead-letter topic
//! (flushed before every checkpoint's positions are taken, so a copy is
//! never lost; a restore may copy it again).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};
use weir_api::pipeline::kafka::{BadMessages, KafkaSourceSpec, StartPosition, StopPosition};

use super::json::LineDecoder;
use super::{Poll, SourcePositions};
use crate::error::{Error, Result};
use crate::kafka::{self, Deliveries, Scope, UserSettings, REQUEST_TIMEOUT};

/// How long an idle source waits before asking the consumer again.
const IDLE_WAIT: Duration = Duration::from_millis(5);

/// How long the source rides out brokers it cannot reach before it fails
/// the job (which then restores from its latest checkpoint). librdkafka
/// reports a lost connection as an error and reconnects by itself: a
/// broker restarted (a rolling upgrade) must not restart every job reading
/// from it, while brokers gone for good must not leave a job that looks
/// healthy and reads nothing.
const OUTAGE_LIMIT: Duration = Duration::from_secs(60);

/// Errors of a streak further apart than this are two outages: librdkafka
/// retries a lost broker at most `reconnect.backoff.max.ms` (10 s) apart
/// and reports every failed attempt.
const OUTAGE_GAP: Duration = Duration::from_secs(15);

/// A streak of connection errors without a message or a partition end
/// between them, begun when every broker was down.
#[derive(Debug, Clone, Copy)]
struct Outage {
    since: std::time::Instant,
    last: std::time::Instant,
}

impl Outage {
    /// The streak `outage` continued by an error at `now`, or a new one if
    /// the error says every broker is down. One broker lost among others
    /// begins none: its partitions' leadership moves to the others, and a
    /// broker down for long (a slow rolling upgrade) must not fail the job.
    fn continued(outage: Option<Outage>, now: std::time::Instant, all_down: bool) -> Option<Outage> {
        match outage {
            Some(o) if now.duration_since(o.last) < OUTAGE_GAP => Some(Outage { since: o.since, last: now }),
            _ if all_down => Some(Outage { since: now, last: now }),
            _ => None,
        }
    }
}

/// Errors librdkafka recovers from by itself: a broker connection lost or
/// refused (the broker restarts), or every broker's at once.
fn reconnects_by_itself(e: &KafkaError) -> bool {
    matches!(e.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::BrokerTransportFailure | rdkafka::types::RDKafkaErrorCode::AllBrokersDown))
}

/// librdkafka consumer settings whose defaults weir changes; the
/// pipeline's `properties` still win. Once the local queue holds
/// `queued.min.messages` of a partition (or `queued.max.messages.kbytes`
/// in all), librdkafka postpones that partition's next fetch by
/// `fetch.queue.backoff.ms`, 1 s by default: a job that drains the queue
/// sooner then sits idle for the rest of that second. Measured on one
/// local broker (bench/RESULTS.md, issue 33): 2 M messages read at
/// parallelism 1 took 10.5–13.7 s with the default and 2.4 s with 10 ms.
/// A smaller queue reads as fast and keeps the worker's resident set
/// smaller (42 MB instead of 71 MB in the same run).
const CONSUMER_DEFAULTS: [(&str, &str); 3] = [("fetch.queue.backoff.ms", "10"), ("queued.min.messages", "20000"), ("queued.max.messages.kbytes", "16384")];

pub struct KafkaReader {
    consumer: BaseConsumer<kafka::Quiet>,
    topic: String,
    schema: SchemaRef,
    decoder: LineDecoder,
    batch_size: usize,
    /// Owned partition → offset of the next message to read.
    offsets: BTreeMap<i32, i64>,
    /// Owned partitions read to their end (`stop: end` only).
    ended: BTreeSet<i32>,
    stop_at_end: bool,
    bad_messages: BadMessages,
    dead_letter: Option<ThreadedProducer<Deliveries>>,
    dead_letter_topic: String,
    /// Owned partition → messages skipped (or sent to the dead-letter
    /// topic) before its offset; kept in checkpoints.
    skipped: BTreeMap<i32, u64>,
    /// Skips not yet reported through `take_skipped`.
    unreported: u64,
    /// This subtask's share of `rate` (messages per second; 0: unlimited).
    rate: f64,
    started: std::time::Instant,
    /// Messages consumed since `started`.
    consumed: u64,
    /// The partition of each row decoded for the batch being built, and of
    /// the last batch returned.
    row_partitions: Vec<i32>,
    last_rows: Vec<i32>,
    /// The brokers the consumer is reconnecting to, while it is.
    outage: Option<Outage>,
}

fn split_id(topic: &str, partition: i32) -> String {
    format!("kafka:{topic}:{partition}")
}

impl KafkaReader {
    pub fn new(spec: &KafkaSourceSpec, schema: SchemaRef, subtask: u32, parallelism: u32, restored: Option<&SourcePositions>, started: &SourcePositions) -> Result<Self> {
        let topic = spec.topic.clone();
        let context = format!("kafka source {} topic {topic}", spec.bootstrap_servers);
        let config = consumer_config(spec, subtask)?;
        let consumer: BaseConsumer<kafka::Quiet> = config.create_with_context(kafka::Quiet).map_err(|e| kafka::error(&context, e))?;

        let metadata = match consumer.fetch_metadata(Some(&topic), REQUEST_TIMEOUT) {
            Ok(m) => m,
            Err(e) => {
                // A consumer's logs and errors wait in its queue until it is
                // polled: serve them, so that a refused password or
                // certificate is known when the failure is told.
                let until = std::time::Instant::now() + Duration::from_millis(200);
                while std::time::Instant::now() < until && consumer.poll(Duration::from_millis(20)).is_some() {}
                return Err(kafka::error(&context, e));
            }
        };
        let partitions = match metadata.topics().iter().find(|t| t.name() == topic) {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => t.partitions().len() as i32,
            Some(t) => {
                let why = t.error().map(|e| format!("{:?}", rdkafka::types::RDKafkaErrorCode::from(e))).unwrap_or_else(|| "it has no partitions".into());
                return Err(Error::Kafka {
                    context,
                    message: format!("the topic cannot be read ({why}); create it, or check `source.kafka.topic`"),
                    fatal: true,
                });
            }
            None => return Err(Error::Kafka { context, message: "the brokers do not know the topic; check `source.kafka.topic`".into(), fatal: true }),
        };

        let mut offsets = BTreeMap::new();
        let mut skipped = BTreeMap::new();
        let mut unreported = 0;
        for p in (0..partitions).filter(|p| *p as u32 % parallelism == subtask) {
            let id = split_id(&topic, p);
            let recorded = if restored.is_none() { started.splits.get(&id) } else { None };
            let offset = match restored.and_then(|r| r.splits.get(&id)).or(recorded) {
                Some(&o) => i64::try_from(o).map_err(|_| Error::BadCheckpoint { location: id.clone(), message: format!("offset {o} is out of range") })?,
                None => {
                    let (low, high) = consumer.fetch_watermarks(&topic, p, REQUEST_TIMEOUT).map_err(|e| kafka::error(&context, e))?;
                    match (restored.is_some(), spec.start) {
                        (true, _) | (false, StartPosition::Earliest) => low,
                        (false, StartPosition::Latest) => high,
                        (false, StartPosition::Timestamp) => offset_for_time(&consumer, &topic, p, spec.start_timestamp.unwrap_or(0), high).map_err(|e| kafka::error(&context, e))?,
                    }
                }
            };
            let s = restored.and_then(|r| r.skipped.get(&id)).copied().unwrap_or(0);
            unreported += s;
            skipped.insert(p, s);
            offsets.insert(p, offset);
        }
        let mut assignment = TopicPartitionList::new();
        for (&p, &o) in &offsets {
            assignment.add_partition_offset(&topic, p, Offset::Offset(o)).map_err(|e| kafka::error(&context, e))?;
        }
        consumer.assign(&assignment).map_err(|e| kafka::error(&context, e))?;
        tracing::info!(topic = %topic, subtask, partitions = ?offsets, isolation = spec.isolation.as_str(), "kafka source assigned");

        let dead_letter = match spec.bad_messages {
            BadMessages::DeadLetter => {
                let mut config = kafka::client_config(&spec.bootstrap_servers, &format!("weir-dead-letter-{subtask}"), user_settings(spec), Scope::Connection)?;
                config.set("acks", "all").set("enable.idempotence", "true");
                Some(config.create_with_context(Deliveries::default()).map_err(|e| kafka::error(&context, e))?)
            }
            _ => None,
        };
        Ok(KafkaReader {
            consumer,
            decoder: LineDecoder::new(&schema)?,
            schema,
            topic,
            batch_size: spec.batch_size as usize,
            offsets,
            ended: BTreeSet::new(),
            stop_at_end: spec.stop == StopPosition::End,
            bad_messages: spec.bad_messages,
            dead_letter_topic: spec.dead_letter_topic.clone().unwrap_or_default(),
            dead_letter,
            skipped,
            unreported,
            rate: spec.rate as f64 / parallelism as f64,
            started: std::time::Instant::now(),
            consumed: 0,
            row_partitions: Vec::new(),
            last_rows: Vec::new(),
            outage: None,
        })
    }

    fn context(&self) -> String {
        format!("kafka source topic {}", self.topic)
    }

    pub fn poll(&mut self) -> Result<Poll> {
        let mut limit = self.batch_size;
        if self.rate > 0.0 {
            let allowed = (self.started.elapsed().as_secs_f64() * self.rate) as u64 + 1;
            if self.consumed >= allowed {
                return Ok(Poll::Wait(Duration::from_secs_f64((self.consumed + 1 - allowed) as f64 / self.rate).max(Duration::from_millis(1))));
            }
            limit = limit.min((allowed - self.consumed) as usize);
        }
        let mut consumed = 0;
        while consumed < limit && self.decoder.rows() < self.batch_size {
            let Some(next) = self.consumer.poll(Duration::ZERO) else { break };
            consumed += 1;
            let msg = match next {
                Ok(msg) => msg,
                Err(e) if reconnects_by_itself(&e) => {
                    let all_down = e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::AllBrokersDown);
                    self.outage = Outage::continued(self.outage, std::time::Instant::now(), all_down);
                    let since = self.outage.map(|o| o.since);
                    if since.is_none_or(|t| t.elapsed() < OUTAGE_LIMIT) && !kafka::refused_recently() {
                        // librdkafka's own warnings (rate-limited) tell of it.
                        break;
                    }
                    // Fatal when the brokers refused the connection (TLS, SASL).
                    return Err(match kafka::error(self.context(), e) {
                        Error::Kafka { context, message, fatal: false } => Error::Kafka {
                            context,
                            message: format!("{message}: no broker reachable for {} s", since.map_or(0, |t| t.elapsed().as_secs())),
                            fatal: false,
                        },
                        other => other,
                    });
                }
                Err(KafkaError::PartitionEOF(p)) => {
                    self.outage = None;
                    if self.stop_at_end && self.offsets.contains_key(&p) && self.ended.insert(p) {
                        // Messages that arrive later are not this run's to read.
                        let mut tpl = TopicPartitionList::new();
                        tpl.add_partition(&self.topic, p);
                        self.consumer.pause(&tpl).map_err(|e| kafka::error(self.context(), e))?;
                        tracing::info!(topic = %self.topic, partition = p, offset = self.offsets[&p], "kafka source read the partition to its end");
                    }
                    continue;
                }
                Err(e) => {
                    let fatal_offset = e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::OffsetOutOfRange);
                    let mut err = kafka::error(self.context(), e);
                    if fatal_offset {
                        err = Error::Kafka {
                            context: self.context(),
                            message: format!(
                                "an offset to resume from is no longer in the topic (deleted by retention?): positions {:?}; restore a newer snapshot or start the job afresh",
                                self.offsets
                            ),
                            fatal: true,
                        };
                    }
                    return Err(err);
                }
            };
            self.consumed += 1;
            self.outage = None;
            let (p, offset) = (msg.partition(), msg.offset());
            if self.ended.contains(&p) || !self.offsets.contains_key(&p) {
                continue;
            }
            let decoded = match msg.payload() {
                Some(value) => self.decoder.push_line(value).map_err(|bad| format!("column {}: {}", bad.column, bad.message)),
                None => Err("the message has no value".to_string()),
            };
            if let Err(why) = decoded {
                match self.bad_messages {
                    BadMessages::Fail => {
                        return Err(Error::Kafka {
                            context: self.context(),
                            message: format!(
                                "the message at partition {p} offset {offset} is not a JSON object of the schema: {why} (set `bad_messages: skip` or `dead_letter` to go on without it)"
                            ),
                            fatal: true,
                        });
                    }
                    BadMessages::Skip => tracing::warn!(topic = %self.topic, partition = p, offset, reason = %why, "kafka source skipped a bad message"),
                    BadMessages::DeadLetter => {
                        let topic = &self.dead_letter_topic;
                        let producer = self.dead_letter.as_ref().expect("a dead-letter producer exists for bad_messages: dead_letter");
                        let (partition, offset_text) = (p.to_string(), offset.to_string());
                        let headers = OwnedHeaders::new()
                            .insert(Header { key: "weir.source.topic", value: Some(self.topic.as_bytes()) })
                            .insert(Header { key: "weir.source.partition", value: Some(partition.as_bytes()) })
                            .insert(Header { key: "weir.source.offset", value: Some(offset_text.as_bytes()) })
                            .insert(Header { key: "weir.error", value: Some(why.as_bytes()) });
                        let mut record = BaseRecord::<[u8], [u8]>::to(topic).headers(headers);
                        if let Some(v) = msg.payload() {
                            record = record.payload(v);
                        }
                        if let Some(k) = msg.key() {
                            record = record.key(k);
                        }
                        producer.send(record).map_err(|(e, _)| kafka::error(format!("kafka source dead-letter topic {topic}"), e))?;
                        tracing::warn!(topic = %self.topic, partition = p, offset, dead_letter = %topic, reason = %why, "kafka source sent a bad message to the dead-letter topic");
                    }
                }
                *self.skipped.entry(p).or_default() += 1;
                self.unreported += 1;
            } else {
                self.row_partitions.push(p);
            }
            self.offsets.insert(p, offset + 1);
        }
        if self.decoder.rows() > 0 {
            self.last_rows = std::mem::take(&mut self.row_partitions);
            return Ok(Poll::Batch(self.decoder.finish(&self.schema)?));
        }
        if self.stop_at_end && self.ended.len() == self.offsets.len() {
            return Ok(Poll::Finished);
        }
        Ok(Poll::Wait(if consumed > 0 { Duration::ZERO } else { IDLE_WAIT }))
    }

    pub fn last_row_splits(&self) -> Vec<String> {
        self.last_rows.iter().map(|p| split_id(&self.topic, *p)).collect()
    }

    pub fn active_splits(&self) -> Vec<String> {
        self.offsets.keys().filter(|p| !self.ended.contains(p)).map(|p| split_id(&self.topic, *p)).collect()
    }

    pub fn take_skipped(&mut self) -> u64 {
        std::mem::take(&mut self.unreported)
    }

    /// The offsets to checkpoint. Copies to the dead-letter topic are
    /// flushed first: a checkpoint must not move past a bad message whose
    /// copy could still be lost.
    pub fn positions(&self) -> Result<SourcePositions> {
        if let Some(p) = &self.dead_letter {
            let context = "kafka source dead-letter topic";
            p.flush(REQUEST_TIMEOUT).map_err(|e| kafka::error(context, e))?;
            if let Some(failure) = p.context().take_failure() {
                return Err(Error::Kafka { context: context.into(), message: failure, fatal: false });
            }
        }
        let mut positions = SourcePositions::default();
        for (&p, &o) in &self.offsets {
            let id = split_id(&self.topic, p);
            let s = self.skipped.get(&p).copied().unwrap_or(0);
            if s > 0 {
                positions.skipped.insert(id.clone(), s);
            }
            positions.splits.insert(id, o as u64);
        }
        Ok(positions)
    }
}

/// The consumer's settings: weir's defaults, the user's, then those weir owns.
fn consumer_config(spec: &KafkaSourceSpec, subtask: u32) -> Result<rdkafka::ClientConfig> {
    let mut config = kafka::client_config(&spec.bootstrap_servers, &format!("weir-source-{subtask}"), user_settings(spec), Scope::All)?;
    for (key, value) in CONSUMER_DEFAULTS {
        if !spec.properties.contains_key(key) {
            config.set(key, value);
        }
    }
    config
        .set("isolation.level", spec.isolation.as_str())
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        // librdkafka wants a group even for assigned partitions; weir
        // never joins it nor commits offsets to it.
        .set("group.id", "weir-source")
        // A checkpoint's offset that retention has deleted since is an
        // error, not a silent jump to another offset.
        .set("auto.offset.reset", "error");
    Ok(config)
}

/// The offset of the first message at or after `ts`, or `high` when there is none.
fn offset_for_time(consumer: &BaseConsumer<kafka::Quiet>, topic: &str, partition: i32, ts: i64, high: i64) -> Result<i64, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(ts))?;
    let found = consumer.offsets_for_times(tpl, REQUEST_TIMEOUT)?;
    Ok(match found.find_partition(topic, partition).map(|e| e.offset()) {
        Some(Offset::Offset(o)) => o,
        _ => high,
    })
}

/// The source's own librdkafka settings.
fn user_settings(spec: &KafkaSourceSpec) -> UserSettings<'_> {
    UserSettings { field: "source.kafka", properties: &spec.properties, from_env: &spec.properties_from_env }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_begins_when_every_broker_is_down_and_ends_after_a_quiet_gap() {
        let t0 = std::time::Instant::now();
        assert!(Outage::continued(None, t0, false).is_none(), "one broker lost among others is no outage");
        let first = Outage::continued(None, t0, true).unwrap();
        let later = Outage::continued(Some(first), t0 + Duration::from_secs(10), false).unwrap();
        assert_eq!((later.since, later.last), (t0, t0 + Duration::from_secs(10)), "a reconnect attempt 10 s after the last continues it");
        let much_later = Outage::continued(Some(later), t0 + Duration::from_secs(26), false);
        assert!(much_later.is_none(), "16 s without an error ended it: {much_later:?}");
        let again = Outage::continued(Some(later), t0 + Duration::from_secs(26), true).unwrap();
        assert_eq!(again.since, t0 + Duration::from_secs(26), "every broker down again begins a new one");
        assert!(reconnects_by_itself(&KafkaError::MessageConsumption(rdkafka::types::RDKafkaErrorCode::AllBrokersDown)));
        assert!(!reconnects_by_itself(&KafkaError::MessageConsumption(rdkafka::types::RDKafkaErrorCode::OffsetOutOfRange)));
    }

    fn spec(properties: &[(&str, &str)]) -> KafkaSourceSpec {
        let yaml = format!(
            "bootstrap_servers: 127.0.0.1:9092\ntopic: t\nschema: {{seq: int64}}\nproperties: {{{}}}\n",
            properties.iter().map(|(k, v)| format!("{k}: '{v}'")).collect::<Vec<_>>().join(", ")
        );
        serde_yaml::from_str(&yaml).unwrap()
    }

    #[test]
    fn the_consumer_fetches_again_within_milliseconds_unless_the_pipeline_says_otherwise() {
        let config = consumer_config(&spec(&[]), 0).unwrap();
        assert_eq!(config.get("fetch.queue.backoff.ms"), Some("10"), "librdkafka's 1 s default leaves a fast job idle");
        assert_eq!(config.get("queued.max.messages.kbytes"), Some("16384"));
        let config = consumer_config(&spec(&[("fetch.queue.backoff.ms", "250"), ("queued.min.messages", "5000")]), 0).unwrap();
        assert_eq!(config.get("fetch.queue.backoff.ms"), Some("250"));
        assert_eq!(config.get("queued.min.messages"), Some("5000"));
        assert_eq!(config.get("isolation.level"), Some("read_committed"));
    }
}
