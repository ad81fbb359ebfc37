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
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::message::Headers;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::rand_suffix;

const TIMEOUT: Duration = Duration::from_secs(30);

/// The address of the broker the tests share.
pub fn bootstrap() -> &'static str {
    static BROKER: OnceLock<String> = OnceLock::new();
    BROKER.get_or_init(|| match std::env::var("WEIR_TEST_KAFKA") {
        Ok(addr) if !addr.is_empty() => addr,
        _ => {
            let broker = PrivateBroker::start();
            let addr = broker.addr.clone();
            // Lives as long as the test process; the watchdog stops it.
            std::mem::forget(broker);
            addr
        }
    })
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A broker of one test's own, for tests that stop and start it: started
/// in a temporary directory, stopped (and its directory removed) on drop,
/// or by a watchdog once the test process is gone however it ended.
pub struct PrivateBroker {
    pub addr: String,
    dir: PathBuf,
    port: u16,
    controller: u16,
    /// The port of the SASL_SSL listener, if it has one.
    sasl_ssl: Option<u16>,
}

/// Where and how to reach the SASL_SSL listener of a [`PrivateBroker`].
pub struct SaslSsl {
    pub addr: String,
    /// The CA that signed the broker's certificate.
    pub ca: PathBuf,
    /// A CA that signed nothing of the broker.
    pub other_ca: PathBuf,
    pub user: &'static str,
    pub password: &'static str,
}

impl PrivateBroker {
    pub fn start() -> PrivateBroker {
        Self::start_with(None)
    }

    /// A broker with a second listener that takes only TLS with SASL
    /// (SCRAM-SHA-512 or PLAIN) beside the plain one the tests use.
    pub fn start_with_sasl_ssl() -> PrivateBroker {
        Self::start_with(Some(super::free_port()))
    }

    /// The SASL_SSL listener (see `e2e/kafka/broker --help`).
    pub fn sasl_ssl(&self) -> SaslSsl {
        let port = self.sasl_ssl.expect("the broker was started with start_with_sasl_ssl");
        SaslSsl {
            addr: format!("127.0.0.1:{port}"),
            ca: self.dir.join("tls/ca.pem"),
            other_ca: self.dir.join("tls/other-ca.pem"),
            user: "weir",
            password: "weir-kafka-test-secret",
        }
    }

    fn start_with(sasl_ssl: Option<u16>) -> PrivateBroker {
        let dir = std::env::temp_dir().join(format!("weir-test-kafka-{}", rand_suffix()));
        let port = super::free_port();
        let broker = PrivateBroker { addr: format!("127.0.0.1:{port}"), dir, port, controller: super::free_port(), sasl_ssl };
        broker.resume();
        let watchdog = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; '{script}' stop --dir '{dir}'; [ -n \"$WEIR_TEST_KEEP\" ] || rm -rf '{dir}'",
            pid = std::process::id(),
            script = Self::script().display(),
            dir = broker.dir.display()
        );
        Command::new("setsid").args(["bash", "-c", &watchdog]).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("start the broker's watchdog");
        broker
    }

    fn script() -> PathBuf {
        repo().join("e2e/kafka/broker")
    }

    /// Starts the broker again on its ports and data (the first call formats
    /// the storage); returns once it serves.
    pub fn resume(&self) {
        let mut command = Command::new(Self::script());
        // Flushed on every write: a stop that ends in a kill (after 120 s)
        // loses less (see `e2e/kafka/broker --help`).
        command.args(["start", "--dir", self.dir.to_str().unwrap(), "--port", &self.port.to_string(), "--controller-port", &self.controller.to_string(), "--flush-every-write"]);
        if let Some(port) = self.sasl_ssl {
            command.args(["--sasl-ssl-port", &port.to_string()]).env_remove("WEIR_KAFKA_SASL_PASSWORD");
        }
        let out = command
            .output()
            .expect("run e2e/kafka/broker");
        assert!(out.status.success(), "e2e/kafka/broker start failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }

    /// Stops the broker; its data stays for [`PrivateBroker::resume`].
    pub fn stop(&self) {
        let out = Command::new(Self::script()).args(["stop", "--dir", self.dir.to_str().unwrap()]).output().expect("run e2e/kafka/broker");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "e2e/kafka/broker stop failed:\n{err}");
        // Killed, the broker may lose acknowledged writes: what the test
        // checks afterwards would judge Kafka, not weir.
        assert!(!err.contains("killing it"), "the test broker did not stop cleanly and was killed:\n{err}");
    }

    /// Freezes the broker (SIGSTOP): it holds its connections and answers
    /// nothing, as a broker in a long GC pause or cut off by the network,
    /// until [`PrivateBroker::thaw`]. Unlike a kill it loses nothing: a
    /// SIGKILLed broker without replicas was seen to truncate transaction
    /// markers it had written (see `e2e/kafka/broker --help`), an outage no
    /// client can make up for and Kafka gives no guarantee through.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = std::fs::read_to_string(self.dir.join("broker.pid")).expect("the broker's pid file");
        let out = Command::new("kill").args([signal, pid.trim()]).output().expect("run kill");
        assert!(out.status.success(), "kill {signal} {pid} failed");
    }

    pub fn client(&self) -> Broker {
        Broker { addr: self.addr.clone() }
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        let _ = Command::new(Self::script()).args(["stop", "--dir", self.dir.to_str().unwrap()]).output();
        if std::env::var_os("WEIR_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// What a test does with a broker: create topics, produce, read back.
#[derive(Clone, Debug)]
pub struct Broker {
    pub addr: String,
}

impl Broker {
    /// The broker the tests share.
    pub fn shared() -> Broker {
        Broker { addr: bootstrap().to_string() }
    }

    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.addr);
        c
    }

    pub fn create_topic(&self, name: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = self.config().create().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let results = rt.block_on(admin.create_topics([&NewTopic::new(name, partitions, TopicReplication::Fixed(1))], &AdminOptions::new())).unwrap();
        for r in results {
            r.unwrap_or_else(|(t, e)| panic!("creating topic {t}: {e}"));
        }
    }

    /// Sends `(partition, value)` messages and waits until all are delivered.
    /// With `transaction: Some(commit)` they go in one transaction, committed
    /// or aborted.
    pub fn produce(&self, topic: &str, messages: &[(i32, String)], transaction: Option<bool>) {
        let mut c = self.config();
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
    pub fn produce_events(&self, topic: &str, events: u64, keys: u64, partitions: i32) {
        let messages: Vec<(i32, String)> = (0..events)
            .map(|seq| {
                let key = seq % keys;
                ((key % partitions as u64) as i32, format!(r#"{{"seq":{seq},"key":{key},"value":{seq}}}"#))
            })
            .collect();
        for chunk in messages.chunks(50_000) {
            self.produce(topic, chunk, None);
        }
    }

    /// Everything in `topic` that a consumer of `isolation` reads, from the
    /// beginning to the end of every partition.
    pub fn read_all(&self, topic: &str, isolation: &str) -> Vec<Read> {
        let consumer: BaseConsumer = self.config().set("isolation.level", isolation).set("enable.partition.eof", "true").set("enable.auto.commit", "false").set("group.id", "weir-test").create().unwrap();
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
                // Connections a restarted broker dropped: librdkafka reconnects
                // on its own, as it does for any consumer (the deadline above
                // still bounds the read).
                Some(Err(KafkaError::MessageConsumption(RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::BrokerTransportFailure))) => {}
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

    /// The partitions of `topic` whose last stable offset trails the high
    /// watermark: an open transaction holds back their read_committed
    /// readers. (ListOffsets answers a read_committed consumer with the
    /// last stable offset.)
    pub fn partitions_held_by_open_transactions(&self, topic: &str) -> Vec<i32> {
        let consumer = |isolation: &str| -> BaseConsumer { self.config().set("isolation.level", isolation).set("group.id", "weir-test").create().unwrap() };
        let (committed, uncommitted) = (consumer("read_committed"), consumer("read_uncommitted"));
        let metadata = uncommitted.fetch_metadata(Some(topic), TIMEOUT).unwrap();
        let partitions = metadata.topics()[0].partitions().len() as i32;
        assert!(partitions > 0, "topic {topic} does not exist");
        (0..partitions)
            .filter(|p| {
                let (_, stable) = committed.fetch_watermarks(topic, *p, TIMEOUT).unwrap();
                let (_, high) = uncommitted.fetch_watermarks(topic, *p, TIMEOUT).unwrap();
                stable < high
            })
            .collect()
    }

    /// Begins a transaction, sends `messages` in it and flushes them, and
    /// returns the producer with the transaction still open (dropping it
    /// leaves the transaction to the broker's timeout; abort it instead).
    pub fn open_transaction(&self, topic: &str, messages: &[(i32, String)]) -> BaseProducer {
        let producer: BaseProducer = self.config().set("transactional.id", format!("weir-test-{}", rand_suffix())).create().unwrap();
        producer.init_transactions(TIMEOUT).unwrap();
        producer.begin_transaction().unwrap();
        for (p, value) in messages {
            producer.send(BaseRecord::<(), str>::to(topic).partition(*p).payload(value)).map_err(|(e, _)| e).unwrap();
        }
        producer.flush(TIMEOUT).unwrap();
        producer
    }

    /// The partitions of `topic` that open transactions still hold after
    /// up to `patience`. A producer's commit returns once the coordinator
    /// has decided it; the commit markers reach the partitions a moment
    /// later, and until then the transaction holds back read_committed
    /// readers (seen: a broker just restarted took long enough that a read
    /// right after the job missed the final checkpoint's records). A
    /// transaction nobody ends holds its partitions for its whole timeout.
    pub fn partitions_held_after(&self, topic: &str, patience: Duration) -> Vec<i32> {
        let deadline = Instant::now() + patience;
        loop {
            let held = self.partitions_held_by_open_transactions(topic);
            if held.is_empty() || Instant::now() > deadline {
                return held;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The records of `topic` that a read_committed consumer sees, as JSON,
    /// once committed transactions are visible (see
    /// [`Broker::partitions_held_after`]; a transaction still open after
    /// that does not stop the read, and `Job::assert_no_open_transaction`
    /// reports it).
    pub fn committed_records(&self, topic: &str) -> Vec<serde_json::Value> {
        // Commit markers are written after the commit returns, and a busy
        // machine (CI, two tests at once) has kept them back for seconds.
        self.partitions_held_after(topic, Duration::from_secs(60));
        self.read_all(topic, "read_committed")
            .into_iter()
            .map(|m| serde_json::from_str(&m.value).unwrap_or_else(|e| panic!("message {} of {topic} is not JSON: {e}", m.offset)))
            .collect()
    }
}

/// A topic name no other test uses.
pub fn topic(what: &str) -> String {
    format!("{what}-{}", rand_suffix())
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


pub fn create_topic(name: &str, partitions: i32) {
    Broker::shared().create_topic(name, partitions)
}

pub fn produce(topic: &str, messages: &[(i32, String)], transaction: Option<bool>) {
    Broker::shared().produce(topic, messages, transaction)
}

pub fn read_all(topic: &str, isolation: &str) -> Vec<Read> {
    Broker::shared().read_all(topic, isolation)
}

