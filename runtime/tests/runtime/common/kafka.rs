//! A real Kafka broker for the tests, and what a test does with it: create
//! topics, produce JSON messages (plain, in committed or in aborted
//! transactions), and read a topic back as a consumer would.
//!
//! `scripts/test` starts one broker (`e2e/kafka/broker`) and passes its
//! address in `WEIR_TEST_KAFKA`; without it, the first test that needs a
//! broker starts one in a temporary directory, with a watchdog that stops
//! it when the test process exits. Tests share the broker and keep apart by
//! topic names of their own.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Headers;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::rand_suffix;

const TIMEOUT: Duration = Duration::from_secs(30);

pub fn bootstrap() -> &'static str {
    static BROKER: OnceLock<String> = OnceLock::new();
    BROKER.get_or_init(|| match std::env::var("WEIR_TEST_KAFKA") {
        Ok(addr) if !addr.is_empty() => addr,
        _ => start_broker(),
    })
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn start_broker() -> String {
    let dir = std::env::temp_dir().join(format!("weir-test-kafka-{}", rand_suffix()));
    let port = super::free_port();
    let controller = super::free_port();
    let script = repo().join("e2e/kafka/broker");
    let out = Command::new(&script)
        .args(["start", "--dir", dir.to_str().unwrap(), "--port", &port.to_string(), "--controller-port", &controller.to_string()])
        .output()
        .expect("run e2e/kafka/broker");
    assert!(out.status.success(), "e2e/kafka/broker start failed:\n{}", String::from_utf8_lossy(&out.stderr));
    // Stops the broker once this test process is gone, however it ends.
    let watchdog = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; '{script}' stop --dir '{dir}'; rm -rf '{dir}'",
        pid = std::process::id(),
        script = script.display(),
        dir = dir.display()
    );
    Command::new("setsid").args(["bash", "-c", &watchdog]).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("start the broker's watchdog");
    format!("127.0.0.1:{port}")
}

fn config() -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap());
    c
}

/// A topic name no other test uses.
pub fn topic(what: &str) -> String {
    format!("{what}-{}", rand_suffix())
}

pub fn create_topic(name: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = config().create().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let results = rt.block_on(admin.create_topics([&NewTopic::new(name, partitions, TopicReplication::Fixed(1))], &AdminOptions::new())).unwrap();
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("creating topic {t}: {e}"));
    }
}

/// Sends `(partition, value)` messages and waits until all are delivered.
/// With `transaction: Some(commit)` they go in one transaction, committed
/// or aborted.
pub fn produce(topic: &str, messages: &[(i32, String)], transaction: Option<bool>) {
    let mut c = config();
    if transaction.is_some() {
        c.set("transactional.id", format!("weir-test-{}", rand_suffix()));
    }
    let producer: BaseProducer = c.create().unwrap();
    if transaction.is_some() {
        producer.init_transactions(TIMEOUT).unwrap();
        producer.begin_transaction().unwrap();
    }
    for (p, value) in messages {
        loop {
            match producer.send(BaseRecord::<(), str>::to(topic).partition(*p).payload(value)) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull), _)) => {
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => panic!("producing to {topic}: {e}"),
            }
        }
        producer.poll(Duration::ZERO);
    }
    match transaction {
        Some(true) => producer.commit_transaction(TIMEOUT).unwrap(),
        Some(false) => {
            producer.flush(TIMEOUT).unwrap();
            producer.abort_transaction(TIMEOUT).unwrap();
        }
        None => producer.flush(TIMEOUT).unwrap(),
    }
}

/// The generator's events (`seq`, `key = seq % keys`, `value = seq`) as
/// JSON messages; a key's events go to partition `key % partitions`, in
/// order, so that per-key order survives any parallelism.
pub fn produce_events(topic: &str, events: u64, keys: u64, partitions: i32) {
    let messages: Vec<(i32, String)> = (0..events)
        .map(|seq| {
            let key = seq % keys;
            ((key % partitions as u64) as i32, format!(r#"{{"seq":{seq},"key":{key},"value":{seq}}}"#))
        })
        .collect();
    for chunk in messages.chunks(50_000) {
        produce(topic, chunk, None);
    }
}

/// A message as a reader sees it.
#[derive(Debug, Clone)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: String,
    pub headers: BTreeMap<String, String>,
}

/// Everything in `topic` that a consumer of `isolation` reads, from the
/// beginning to the end of every partition.
pub fn read_all(topic: &str, isolation: &str) -> Vec<Read> {
    let consumer: BaseConsumer = config().set("isolation.level", isolation).set("enable.partition.eof", "true").set("enable.auto.commit", "false").set("group.id", "weir-test").create().unwrap();
    let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT).unwrap();
    let partitions = metadata.topics()[0].partitions().len() as i32;
    assert!(partitions > 0, "topic {topic} does not exist");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut ended = std::collections::HashSet::new();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while ended.len() < partitions as usize {
        assert!(Instant::now() < deadline, "reading {topic} did not reach the end of every partition");
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                ended.insert(p);
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            Some(Ok(m)) => {
                ended.remove(&m.partition());
                let headers = m
                    .headers()
                    .map(|h| h.iter().map(|h| (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned())).collect())
                    .unwrap_or_default();
                out.push(Read {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    value: String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned(),
                    headers,
                });
            }
        }
    }
    out
}

/// The records of `topic` that a read_committed consumer sees, as JSON.
pub fn committed_records(topic: &str) -> Vec<serde_json::Value> {
    read_all(topic, "read_committed")
        .into_iter()
        .map(|m| serde_json::from_str(&m.value).unwrap_or_else(|e| panic!("message {} of {topic} is not JSON: {e}", m.offset)))
        .collect()
}
