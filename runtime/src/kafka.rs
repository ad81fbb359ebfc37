//! What the Kafka source and sink share: client settings, a producer
//! context that remembers failed deliveries, and how librdkafka's errors map
//! to the runtime's.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::Message;

use crate::error::Error;

/// How long a metadata or offset request may take before the attempt fails
/// (and the job is restarted by its supervisor).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The user's settings of a Kafka source or sink: `properties`, and the
/// secret ones named in `properties_from_env`.
#[derive(Clone, Copy)]
pub struct UserSettings<'a> {
    /// `source.kafka` or `sink.kafka`, for errors.
    pub field: &'static str,
    pub properties: &'a BTreeMap<String, String>,
    pub from_env: &'a BTreeMap<String, String>,
}

/// Which of the user's settings a client takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// All of them: the source's consumer, the sink's producers.
    All,
    /// Only how to reach and log in to the brokers (`security.protocol`,
    /// `ssl.*`, `sasl.*` and the secrets): the clients weir adds beside
    /// them (the dead-letter producer, the sink's admin client and
    /// progress reader), which a consumer's or producer's tuning does not fit.
    Connection,
}

fn is_connection_setting(key: &str) -> bool {
    key == "security.protocol" || key.starts_with("ssl.") || key.starts_with("ssl_") || key.starts_with("sasl.")
}

/// Settings every weir client has, then the user's (which the pipeline
/// parser has already checked for settings weir owns). The secrets are
/// read from their environment variables here; a missing one is an error
/// naming the setting and the variable, never a value.
pub fn client_config(bootstrap_servers: &str, client_id: &str, user: UserSettings<'_>, scope: Scope) -> Result<ClientConfig, Error> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap_servers).set("client.id", client_id);
    for (k, v) in user.properties {
        if scope == Scope::All || is_connection_setting(k) {
            config.set(k, v);
        }
    }
    for (k, var) in user.from_env {
        let value = std::env::var(var).map_err(|e| Error::Plan {
            context: format!("{}.properties_from_env.{k}", user.field),
            message: match e {
                std::env::VarError::NotPresent => format!("the environment variable {var} is not set (on Kubernetes: spec.env with valueFrom.secretKeyRef)"),
                std::env::VarError::NotUnicode(_) => format!("the environment variable {var} is not UTF-8 text"),
            },
        })?;
        config.set(k, value);
    }
    Ok(config)
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

impl ClientContext for Deliveries {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_line(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        log_error(error, reason);
    }
}

/// The context of weir's consumers: librdkafka's logs and errors go
/// through the same rate limit as the producers'.
#[derive(Default)]
pub struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_line(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        log_error(error, reason);
    }
}

impl ConsumerContext for Quiet {}

/// How often one kind of librdkafka complaint is logged. While a broker is
/// away every client (a sink subtask has several producers) reports every
/// failed reconnect, several a second; the job itself notices through its
/// requests and restarts, so one line per kind per interval says enough.
const COMPLAINT_INTERVAL: Duration = Duration::from_secs(10);

/// Whether a complaint of `kind` may be logged now; if so, how many of its
/// kind were held back since the last one.
fn admit(kind: &str) -> Option<u64> {
    static LAST: OnceLock<Mutex<HashMap<String, (Instant, u64)>>> = OnceLock::new();
    let mut last = lock(LAST.get_or_init(Default::default));
    let now = Instant::now();
    match last.get_mut(kind) {
        Some((at, held)) if now.duration_since(*at) < COMPLAINT_INTERVAL => {
            *held += 1;
            None
        }
        Some((at, held)) => {
            let n = *held;
            *at = now;
            *held = 0;
            Some(n)
        }
        None => {
            last.insert(kind.to_string(), (now, 0));
            Some(0)
        }
    }
}

fn held_back(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} more like it in the last {}s not shown)", COMPLAINT_INTERVAL.as_secs())
    }
}

fn log_line(level: RDKafkaLogLevel, fac: &str, message: &str) {
    // The broker thread logs a failed connection before it marks the
    // broker down, so a request that fails because of it finds the refusal
    // remembered; the error callback may come a moment after that request.
    if fac == "FAIL" && is_refusal(message) {
        remember_refusal(message.to_string());
    }
    let important = matches!(level, RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error);
    if !important && !matches!(level, RDKafkaLogLevel::Warning) {
        tracing::debug!(target: "librdkafka", facility = fac, "{message}");
        return;
    }
    let Some(n) = admit(fac) else { return };
    // A failed connection is logged at error level by librdkafka; for the
    // job it is a retry, and the request that gives up is the error.
    if important && fac != "FAIL" {
        tracing::error!(target: "librdkafka", facility = fac, "{message}{}", held_back(n));
    } else {
        tracing::warn!(target: "librdkafka", facility = fac, "{message}{}", held_back(n));
    }
}

/// The last authentication or TLS failure librdkafka reported in this
/// process. librdkafka reports it only to the error callback, and the
/// request that was waiting for the broker then just times out; with this,
/// that timeout is reported as what it is, and as fatal, since a restart
/// would meet the same refusal. (librdkafka never puts a password in it.)
/// Only a recent refusal counts, and of TLS errors only a certificate that
/// failed verification: a broker restarting mid-handshake is no refusal.
static REFUSAL: Mutex<Option<(Instant, String)>> = Mutex::new(None);

fn remember_refusal(why: String) {
    *lock(&REFUSAL) = Some((Instant::now(), why));
}

/// Whether the brokers refused a connection of this process lately: a lost
/// connection is then no broker restarting.
pub fn refused_recently() -> bool {
    lock(&REFUSAL).as_ref().is_some_and(|(at, _)| at.elapsed() < 2 * REQUEST_TIMEOUT)
}

/// A failed connection that a retry would meet again: the brokers refused
/// the password, or this client refused the brokers' certificate.
fn is_refusal(message: &str) -> bool {
    message.contains("SASL authentication error") || (message.contains("SSL handshake failed") && message.contains("certificate"))
}

fn log_error(error: KafkaError, reason: &str) {
    let code = error.rdkafka_error_code();
    // The source asks for partition ends (`stop: end`) and reads them from
    // its poll; they are no error.
    if code == Some(RDKafkaErrorCode::PartitionEOF) {
        return;
    }
    let refused = match code {
        Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed) => true,
        Some(RDKafkaErrorCode::SSL) => reason.contains("certificate"),
        _ => false,
    };
    if refused {
        remember_refusal(format!("{error}: {reason}"));
    }
    let kind = code.map(|c| format!("{c:?}")).unwrap_or_else(|| "other".into());
    let Some(n) = admit(&kind) else { return };
    let transient = matches!(code, Some(RDKafkaErrorCode::BrokerTransportFailure | RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::BrokerNotAvailable | RDKafkaErrorCode::RequestTimedOut));
    if transient {
        tracing::warn!(target: "librdkafka", "{error}: {reason}{}", held_back(n));
    } else {
        tracing::error!(target: "librdkafka", "{error}: {reason}{}", held_back(n));
    }
}

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
    let code = e.rdkafka_error_code();
    let refused = matches!(code, Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed));
    let waited = matches!(
        code,
        Some(RDKafkaErrorCode::RequestTimedOut | RDKafkaErrorCode::OperationTimedOut | RDKafkaErrorCode::BrokerTransportFailure | RDKafkaErrorCode::AllBrokersDown)
    );
    let recent = || refused_recently().then(|| lock(&REFUSAL).clone().map(|(_, r)| r)).flatten();
    let mut refusal = recent();
    // Producers and admin clients serve their callbacks on threads of
    // their own, which may tell the refusal a moment after the request
    // that failed because of it. A failure path: the short wait is cheap.
    let give_up = Instant::now() + Duration::from_millis(300);
    while !fatal && waited && refusal.is_none() && Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(20));
        refusal = recent();
    }
    if !fatal && (refused || (waited && refusal.is_some())) {
        let why = refusal.map(|r| format!(": {r}")).unwrap_or_default();
        return Error::Kafka {
            context: context.into(),
            message: format!("{e}, after the brokers refused the connection{why}; check the TLS and SASL settings (security.protocol, ssl.*, sasl.*, properties_from_env)"),
            fatal: true,
        };
    }
    Error::Kafka { context: context.into(), message: e.to_string(), fatal }
}
