//! The control protocol between workers and the job's coordinator: JSON in
//! length-delimited frames over one TCP connection per worker.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use crate::checkpoint::SubtaskAck;
use crate::error::{Error, Result};
use crate::exchange::frame::codec;
use crate::exchange::Barrier;

/// Where every process of one run listens: the wire type the operator sends
/// (`PUT /v1/membership`) and the local supervisor passes as `--cluster`.
pub use weir_api::control::Membership as Cluster;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToCoordinator {
    /// `restored_from`: the checkpoint this worker restores, checked by the
    /// coordinator against its own.
    Hello {
        worker: u32,
        run_id: String,
        #[serde(default)]
        restored_from: Option<String>,
    },
    Ready,
    /// Every subtask of the worker is open: its state restored and its sink
    /// recovered. No checkpoint is triggered before every worker says so,
    /// because a sink's recovery may wait for what other subtasks' sinks
    /// leave open once they take part in a checkpoint (the Kafka sink reads
    /// its progress markers up to a point no open transaction may hold back).
    Running,
    Ack { checkpoint_id: u64, ack: SubtaskAck },
    Decline { checkpoint_id: u64, reason: String },
    /// `stage`: which source's subtask (absent from a worker of before graphs: 0).
    SourceFinished {
        #[serde(default)]
        stage: usize,
        subtask: u32,
    },
    /// Every committing subtask of the worker (sinks, late-record outputs)
    /// has committed this stopping savepoint: the coordinator reports it
    /// complete once every worker has said so.
    Committed { checkpoint_id: u64 },
    Metrics {
        records_in: u64,
        records_out: u64,
        #[serde(default)]
        records_skipped: u64,
        #[serde(default)]
        records_late: u64,
    },
    Finished,
    /// Sent every [`heartbeat_interval`]: a worker that sends nothing for
    /// [`heartbeat_timeout`] is frozen, cut off or on a lost node.
    Heartbeat,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    /// The coordinator's side of the heartbeat.
    Heartbeat,
    Start,
    Trigger(Barrier),
    Complete { checkpoint_id: u64 },
    Abort { checkpoint_id: u64 },
    Shutdown,
    /// The job was stopped with savepoint `savepoint_id` and ends here
    /// (local mode): stop processing, commit nothing more, exit 0.
    Stopped { savepoint_id: u64 },
}

/// How long a peer on the control connection may send nothing before it
/// counts as lost, unless configured (`--heartbeat-timeout`).
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

static HEARTBEAT_TIMEOUT: OnceLock<Duration> = OnceLock::new();

/// Sets this process's heartbeat timeout; the first call wins (`main`).
pub fn configure_heartbeat_timeout(timeout: Duration) {
    let _ = HEARTBEAT_TIMEOUT.set(timeout);
}

/// A worker or coordinator that sends nothing for this long is lost: the
/// run fails and is restored, without waiting for a TCP timeout (minutes)
/// or, on Kubernetes, for the node controller (40 s) and eviction (5 min).
pub fn heartbeat_timeout() -> Duration {
    HEARTBEAT_TIMEOUT.get().copied().unwrap_or(DEFAULT_HEARTBEAT_TIMEOUT)
}

/// How often each side sends a heartbeat: five per timeout, so that one
/// late message is no failure.
pub fn heartbeat_interval() -> Duration {
    (heartbeat_timeout() / 5).max(Duration::from_millis(20))
}

/// Why a silent peer (worker `worker` at `addr`) counts as lost, for the
/// run's failure message; the operator reads the worker back from it.
pub fn silence(worker: u32, addr: &str) -> String {
    weir_api::control::silence_message(worker, addr, heartbeat_timeout().as_secs_f64())
}

pub type ControlStream = Framed<super::tls::Link, tokio_util::codec::LengthDelimitedCodec>;

pub fn framed(stream: super::tls::Link) -> ControlStream {
    Framed::new(stream, codec())
}

pub async fn send<T: Serialize>(conn: &mut ControlStream, msg: &T, peer: &str) -> Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(|e| Error::Protocol { peer: peer.into(), message: e.to_string() })?;
    conn.send(bytes::Bytes::from(bytes)).await.map_err(|e| Error::Network { peer: peer.into(), message: e.to_string() })
}

/// The next message; `None` when the peer closed the connection.
pub async fn recv<T: for<'de> Deserialize<'de>>(conn: &mut ControlStream, peer: &str) -> Result<Option<T>> {
    match conn.next().await {
        None => Ok(None),
        Some(Err(e)) => Err(Error::Network { peer: peer.into(), message: e.to_string() }),
        Some(Ok(frame)) => serde_json::from_slice(&frame)
            .map(Some)
            .map_err(|e| Error::Protocol { peer: peer.into(), message: format!("bad control message: {e}") }),
    }
}

/// Connects to the coordinator at `addr` as a process of the run that
/// `key` belongs to (see `handshake`), and says hello.
pub async fn join_coordinator(addr: SocketAddr, key: &super::handshake::RunKey, hello: &ToCoordinator, within: std::time::Duration) -> Result<ControlStream> {
    let peer = addr.to_string();
    let stream = connect(addr, within).await?;
    let body = serde_json::to_vec(hello).map_err(|e| Error::Protocol { peer: peer.clone(), message: e.to_string() })?;
    let link = super::handshake::offer(stream, key, &body, &peer).await?;
    Ok(framed(link))
}

/// Connects, retrying while the peer is starting.
pub async fn connect(addr: SocketAddr, within: std::time::Duration) -> Result<TcpStream> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(Error::Network { peer: addr.to_string(), message: format!("cannot connect: {e}") })
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
}
