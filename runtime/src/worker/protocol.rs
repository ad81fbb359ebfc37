//! The control protocol between workers and the job's coordinator: JSON in
//! length-delimited frames over one TCP connection per worker.

use std::net::SocketAddr;

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
    Ack { checkpoint_id: u64, ack: SubtaskAck },
    Decline { checkpoint_id: u64, reason: String },
    SourceFinished { subtask: u32 },
    Metrics {
        records_in: u64,
        records_out: u64,
        #[serde(default)]
        records_skipped: u64,
    },
    Finished,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    Start,
    Trigger(Barrier),
    Complete { checkpoint_id: u64 },
    Abort { checkpoint_id: u64 },
    Shutdown,
    /// The job was stopped with savepoint `savepoint_id` and ends here
    /// (local mode): stop processing, commit nothing more, exit 0.
    Stopped { savepoint_id: u64 },
}

pub type ControlStream = Framed<TcpStream, tokio_util::codec::LengthDelimitedCodec>;

pub fn framed(stream: TcpStream) -> ControlStream {
    let _ = stream.set_nodelay(true);
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
