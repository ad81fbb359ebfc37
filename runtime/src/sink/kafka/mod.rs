//! The Kafka sink: each record one message, its value the record as a JSON
//! object, its key the value of the `key` field when one is declared.
//!
//! `exactly-once` (`transactional.rs`) writes each checkpoint interval in
//! one Kafka transaction per subtask, committed when the checkpoint
//! completes; `at-least-once` flushes at every barrier and may repeat
//! records after a failure.

mod transactional;

use std::time::Duration;

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use weir_api::KafkaSinkSpec;

use crate::error::{Error, Result};
use crate::kafka::{self, Deliveries, Scope, UserSettings, REQUEST_TIMEOUT};
use crate::sink::encode_jsonl;

pub use transactional::{discard_after_end, KafkaLogEntry, Transactional};
pub(crate) use transactional::IDS_DIR;

/// Messages of one batch, ready to send: values are JSON objects.
struct Messages {
    values: Vec<u8>,
    /// Byte ranges of `values`, one per record.
    ranges: Vec<(usize, usize)>,
    keys: Option<Vec<Option<String>>>,
}

impl Messages {
    fn encode(batch: &RecordBatch, key: Option<usize>) -> Result<Messages> {
        let values = encode_jsonl(batch).map_err(Error::arrow("kafka sink: encoding records"))?;
        let mut ranges = Vec::with_capacity(batch.num_rows());
        let mut start = 0;
        for (i, b) in values.iter().enumerate() {
            if *b == b'\n' {
                ranges.push((start, i));
                start = i + 1;
            }
        }
        let keys = match key {
            None => None,
            Some(k) => {
                let column = batch.column(k);
                let formatter = ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default()).map_err(Error::arrow("kafka sink: formatting keys"))?;
                Some((0..batch.num_rows()).map(|i| column.is_valid(i).then(|| formatter.value(i).to_string())).collect())
            }
        };
        Ok(Messages { values, ranges, keys })
    }

    fn record<'a>(&'a self, topic: &'a str, i: usize) -> BaseRecord<'a, str, [u8]> {
        let (from, to) = self.ranges[i];
        let record = BaseRecord::to(topic).payload(&self.values[from..to]);
        match self.keys.as_ref().and_then(|k| k[i].as_deref()) {
            Some(key) => record.key(key),
            None => record,
        }
    }
}

/// Sends every record of `batch`, waiting while librdkafka's queue is full.
async fn send_batch(producer: &ThreadedProducer<Deliveries>, topic: &str, key: Option<usize>, batch: &RecordBatch) -> Result<()> {
    let messages = Messages::encode(batch, key)?;
    for i in 0..messages.ranges.len() {
        loop {
            match producer.send(messages.record(topic, i)) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => tokio::time::sleep(Duration::from_millis(2)).await,
                Err((e, _)) => return Err(kafka::error(format!("kafka sink topic {topic}"), e)),
            }
        }
    }
    Ok(())
}

/// The index of the key field in the records, checked at start.
fn key_index(spec: &KafkaSinkSpec, schema: &Schema) -> Result<Option<usize>> {
    match &spec.key {
        None => Ok(None),
        Some(k) => schema.index_of(k).map(Some).map_err(|_| Error::Plan {
            context: "sink.kafka.key".into(),
            message: format!(
                "`{k}` is not a field of the records reaching the sink; they have {}",
                schema.fields().iter().map(|f| format!("`{}`", f.name())).collect::<Vec<_>>().join(", ")
            ),
        }),
    }
}

/// A producer of the sink's settings; `transactional_id` makes it
/// transactional (and it reports its progress markers' offsets).
fn producer(spec: &KafkaSinkSpec, client_id: &str, transactional_id: Option<&str>) -> Result<ThreadedProducer<Deliveries>> {
    let mut config = kafka::client_config(&spec.bootstrap_servers, client_id, user_settings(spec), Scope::All)?;
    config.set("acks", "all").set("enable.idempotence", "true");
    if let Some(id) = transactional_id {
        config.set("transactional.id", id).set("transaction.timeout.ms", spec.transaction_timeout.get().as_millis().to_string());
    }
    let context = match transactional_id {
        Some(_) => Deliveries::with_markers(&spec.progress_topic),
        None => Deliveries::default(),
    };
    config.create_with_context(context).map_err(|e| kafka::error(format!("kafka sink {}", spec.bootstrap_servers), e))
}

/// Waits until everything sent has reached the brokers, and fails if
/// anything was dropped.
fn flush(producer: &ThreadedProducer<Deliveries>, context: &str) -> Result<()> {
    tokio::task::block_in_place(|| flush_promptly(producer)).map_err(|e| kafka::error(context, e))?;
    match producer.context().take_failure() {
        Some(failure) => Err(Error::Kafka { context: context.into(), message: failure, fatal: false }),
        None => Ok(()),
    }
}

/// `producer.flush`, without its wait of up to 100 ms after the last
/// delivery: rdkafka's flush polls the producer's event queue in 100 ms
/// waits, and the ThreadedProducer's own thread, polling the same queue,
/// takes the delivery reports it waits for. A barrier flushes, so that
/// wait stalled every checkpoint of a sink subtask by 100 ms. Here the
/// producer's thread alone serves the reports, and this only checks, every
/// millisecond, whether librdkafka still holds messages.
fn flush_promptly(producer: &ThreadedProducer<Deliveries>) -> std::result::Result<(), KafkaError> {
    let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
    loop {
        match producer.flush(Duration::ZERO) {
            Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            other => return other,
        }
    }
}

/// The at-least-once Kafka sink: records are sent as they come and flushed
/// at every barrier, so a completed checkpoint's records are all in the
/// topic; those sent after it are sent again by a restore.
pub struct AtLeastOnce {
    producer: ThreadedProducer<Deliveries>,
    topic: String,
    key: Option<usize>,
}

impl AtLeastOnce {
    pub async fn open(spec: &KafkaSinkSpec, schema: &Schema, job: &str, subtask: u32) -> Result<Self> {
        let key = key_index(spec, schema)?;
        let producer = producer(spec, &format!("weir-{job}-{subtask}"), None)?;
        check_topic(&producer, spec, &spec.topic).await?;
        Ok(AtLeastOnce { producer, topic: spec.topic.clone(), key })
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        send_batch(&self.producer, &self.topic, self.key, batch).await
    }

    pub fn pre_commit(&mut self) -> Result<()> {
        flush(&self.producer, &format!("kafka sink topic {}", self.topic))
    }
}

/// Fails at start, naming the setting, when the topic does not exist.
async fn check_topic(producer: &ThreadedProducer<Deliveries>, spec: &KafkaSinkSpec, topic: &str) -> Result<()> {
    let metadata = tokio::task::block_in_place(|| producer.client().fetch_metadata(Some(topic), REQUEST_TIMEOUT))
        .map_err(|e| kafka::error(format!("kafka sink {}", spec.bootstrap_servers), e))?;
    let known = metadata.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty());
    if !known {
        return Err(Error::Kafka {
            context: format!("kafka sink {}", spec.bootstrap_servers),
            message: format!("topic {topic} does not exist; create it, or check `sink.kafka.topic`"),
            fatal: true,
        });
    }
    Ok(())
}

/// The sink's own librdkafka settings.
pub(crate) fn user_settings(spec: &KafkaSinkSpec) -> UserSettings<'_> {
    UserSettings { field: "sink.kafka", properties: &spec.properties, from_env: &spec.properties_from_env }
}
