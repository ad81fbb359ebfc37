//! A Kafka broker for `weir-bench sinks` (the project's `e2e/kafka/broker`,
//! Apache Kafka in KRaft mode), topics, the input of the Kafka → Kafka
//! row, and the read-back count that checks a run delivered every record
//! once.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

pub struct Broker {
    dir: PathBuf,
    script: PathBuf,
    pub bootstrap: String,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = Command::new(&self.script).arg("stop").arg("--dir").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn start(port: u16) -> Result<Broker> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../e2e/kafka/broker");
    let dir = super::tempfile_dir()?;
    let out = Command::new(&script)
        .arg("start")
        .arg("--dir")
        .arg(&dir)
        .args(["--port", &port.to_string(), "--controller-port", &(port + 1).to_string()])
        .output()
        .context("running e2e/kafka/broker")?;
    let broker = Broker { dir, script, bootstrap: format!("127.0.0.1:{port}") };
    if !out.status.success() {
        bail!("e2e/kafka/broker start failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(broker)
}

impl Broker {
    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap);
        c
    }

    pub fn create_topic(&self, name: &str, partitions: i32) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.config().create()?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
        for r in rt.block_on(admin.create_topics([&NewTopic::new(name, partitions, TopicReplication::Fixed(1))], &AdminOptions::new()))? {
            r.map_err(|(t, e)| anyhow::anyhow!("creating topic {t}: {e}"))?;
        }
        Ok(())
    }

    /// `events` JSON messages `{"seq","key","value"}` (what the generator
    /// source makes), spread over `partitions` by key, acknowledged by the
    /// broker before this returns.
    pub fn produce_events(&self, topic: &str, events: u64, keys: u64, partitions: i32) -> Result<()> {
        let producer: BaseProducer = self.config().set("linger.ms", "20").set("queue.buffering.max.messages", "1000000").create()?;
        for seq in 0..events {
            let key = seq % keys.max(1);
            let value = format!(r#"{{"seq":{seq},"key":{key},"value":{seq}}}"#);
            let record = BaseRecord::<(), str>::to(topic).payload(&value).partition((key % partitions as u64) as i32);
            send(&producer, record).with_context(|| format!("producing the input to {topic}"))?;
        }
        producer.flush(Duration::from_secs(120)).with_context(|| format!("flushing the input to {topic}"))?;
        Ok(())
    }

    /// Messages a read_committed consumer reads from `topic`, start to end.
    pub fn count_committed(&self, topic: &str) -> Result<u64> {
        let mut n = 0u64;
        read_committed_to_end(&self.bootstrap, topic, |_| {
            n += 1;
            Ok(())
        })?;
        Ok(n)
    }
}

/// Sends `record`, waiting while the producer's queue is full.
pub fn send<K: rdkafka::message::ToBytes + ?Sized, P: rdkafka::message::ToBytes + ?Sized>(producer: &BaseProducer, mut record: BaseRecord<'_, K, P>) -> Result<()> {
    loop {
        match producer.send(record) {
            Ok(()) => break,
            Err((KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull), r)) => {
                record = r;
                producer.poll(Duration::from_millis(5));
            }
            Err((e, _)) => bail!("{e}"),
        }
    }
    producer.poll(Duration::ZERO);
    Ok(())
}

/// Reads `topic` read_committed from its start to its end, handing each
/// message's value to `each`.
pub fn read_committed_to_end(bootstrap: &str, topic: &str, mut each: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("group.id", "weir-bench")
        // As weir's source does: librdkafka's 1 s default pause after a
        // full local queue leaves a fast reader idle.
        .set("fetch.queue.backoff.ms", "10")
        .create()?;
    let partitions = consumer.fetch_metadata(Some(topic), Duration::from_secs(30))?.topics()[0].partitions().len() as i32;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut ended = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while ended.len() < partitions as usize {
        if Instant::now() > deadline {
            bail!("reading {topic} back did not reach its end");
        }
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                ended.insert(p);
            }
            Some(Err(e)) => bail!("reading {topic} back: {e}"),
            Some(Ok(m)) => each(m.payload().unwrap_or_default())?,
        }
    }
    Ok(())
}
