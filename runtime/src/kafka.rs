//! What the Kafka source and sink share: client settings, a producer
//! context that remembers failed deliveries, and how librdkafka's errors map
//! to the runtime's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::Message;

use crate::error::Error;

/// How long a metadata or offset request may take before the attempt fails
/// (and the job is restarted by its supervisor).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Settings every weir client has, then the user's `properties` (which the
/// pipeline parser has already checked for settings weir owns).
pub fn client_config(bootstrap_servers: &str, client_id: &str, properties: &BTreeMap<String, String>) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap_servers).set("client.id", client_id);
    for (k, v) in properties {
        config.set(k, v);
    }
    config
}

/// A producer context that keeps the first failed delivery, so that a flush
/// can tell "everything reached the broker" from "something was dropped",
/// and the offsets of messages delivered to `marker_topic` (the Kafka
/// sink's progress markers). librdkafka reports a delivery only to this
/// callback.
#[derive(Default)]
pub struct Deliveries {
    failed: Mutex<Option<String>>,
    marker_topic: Option<String>,
    markers: Mutex<HashMap<String, i64>>,
}

impl Deliveries {
    /// Also remembers the offsets of messages delivered to `topic`, by key.
    pub fn with_markers(topic: &str) -> Self {
        Deliveries { marker_topic: Some(topic.to_string()), ..Deliveries::default() }
    }

    /// The first delivery that failed since the last call, if any.
    pub fn take_failure(&self) -> Option<String> {
        lock(&self.failed).take()
    }

    /// The offset of the delivered marker with key `key`, once.
    pub fn marker_offset(&self, key: &str) -> Option<i64> {
        lock(&self.markers).remove(key)
    }
}

/// A poisoned lock still holds consistent data here: each update is one assignment.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Err((e, msg)) => {
                let mut failed = lock(&self.failed);
                if failed.is_none() {
                    *failed = Some(format!("a message to {} partition {} was not delivered: {e}", msg.topic(), msg.partition()));
                }
            }
            Ok(msg) if self.marker_topic.as_deref() == Some(msg.topic()) => {
                if let Some(key) = msg.key().and_then(|k| std::str::from_utf8(k).ok()) {
                    lock(&self.markers).insert(key.to_string(), msg.offset());
                }
            }
            Ok(_) => {}
        }
    }
}

/// The runtime's error for a failed Kafka request. Errors that a restart
/// would meet again (a missing topic, a refused setting, an authorization
/// failure) are fatal; the rest (brokers away, timeouts) are worth a restart.
pub fn error(context: impl Into<String>, e: KafkaError) -> Error {
    let fatal = match &e {
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) => true,
        other => matches!(
            other.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed
                    | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                    | RDKafkaErrorCode::InvalidConfig
                    | RDKafkaErrorCode::InvalidTransactionTimeout
                    | RDKafkaErrorCode::UnknownTopicOrPartition
                    | RDKafkaErrorCode::UnknownTopic
                    | RDKafkaErrorCode::InvalidTopic
                    | RDKafkaErrorCode::MessageSizeTooLarge
            )
        ),
    };
    Error::Kafka { context: context.into(), message: e.to_string(), fatal }
}
