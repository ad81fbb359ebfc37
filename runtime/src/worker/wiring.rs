//! The channels between a worker's subtasks and its peers': one per edge
//! of the plan, upstream subtask and downstream subtask. A channel between
//! subtasks of one worker is an in-process queue; one between workers is a
//! data connection (handshake, then Arrow IPC frames) that ends in the same
//! kind of queue on the accepting side.
//!
//! A forward edge connects subtask i to subtask i only; slot sharing puts
//! both on one worker, so it never crosses a process. Hash and broadcast
//! edges connect every upstream subtask to every downstream one.
//!
//! This module knows the plan's edges and the network; it does not know
//! what flows (records, barriers): that is the subtasks' and the gate's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use futures::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};

use super::handshake;
use super::protocol::{self, Cluster};
use super::subtask::{EdgeOut, Route};
use crate::error::{Error, Result};
use crate::exchange::frame::{
    codec, decode_hello, encode_hello, FrameDecoder, FrameEncoder, Hello,
};
use crate::exchange::partition::Partitioner;
use crate::exchange::{Message, CHANNEL_CAPACITY};
use crate::plan::{EdgeKind, JobPlan, StageOutput};

/// A channel into a subtask: (stage, input, downstream subtask, upstream subtask).
pub(super) type ChannelKey = (usize, usize, u32, u32);
pub(super) type Routes = HashMap<ChannelKey, mpsc::Sender<Message>>;

/// A gate's channels, each with the stage input it belongs to.
pub(super) type GateChannels = Vec<(usize, mpsc::Receiver<Message>)>;

/// The receiving ends of every hosted subtask's inputs, and the sending
/// ends, split by whether the upstream subtask is on this worker.
pub(super) struct Inputs {
    /// (stage, subtask) → its channels, each with its stage input, input 0's first.
    pub gates: HashMap<(usize, u32), GateChannels>,
    pub local: Routes,
    pub remote: Routes,
}

/// The upstream subtasks an edge connects to downstream subtask `to`.
fn upstream_of(edge: &EdgeKind, to: u32, parallelism: u32) -> Vec<u32> {
    match edge {
        EdgeKind::Forward => vec![to],
        EdgeKind::Hash { .. } | EdgeKind::Broadcast => (0..parallelism).collect(),
    }
}

/// Channels into every input of every hosted subtask.
pub(super) fn inputs(plan: &JobPlan, cluster: &Cluster, worker: u32, hosted: &[u32]) -> Inputs {
    let p = plan.spec.parallelism;
    let mut inputs = Inputs {
        gates: HashMap::new(),
        local: HashMap::new(),
        remote: HashMap::new(),
    };
    for stage in plan.stages.iter().filter(|s| !s.inputs.is_empty()) {
        for &j in hosted {
            let mut rxs = Vec::new();
            for (k, input) in stage.inputs.iter().enumerate() {
                for i in upstream_of(&input.edge, j, p) {
                    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
                    rxs.push((k, rx));
                    let routes = if cluster.worker_of(i) == worker {
                        &mut inputs.local
                    } else {
                        &mut inputs.remote
                    };
                    routes.insert((stage.index, k, j, i), tx);
                }
            }
            inputs.gates.insert((stage.index, j), rxs);
        }
    }
    inputs
}

/// What connects a worker's outputs to its peers.
pub(super) struct Connecting<'a> {
    pub plan: &'a JobPlan,
    pub cluster: &'a Cluster,
    pub worker: u32,
    pub run_key: &'a handshake::RunKey,
    pub within: Duration,
    /// Why a connection's writer gave up, when it was not the network: a
    /// record it cannot encode fails the worker with that error, not with
    /// the "downstream went away" its subtask sees.
    pub encode_failure: Arc<Mutex<Option<Error>>>,
}

impl Connecting<'_> {
    /// The edges out of every hosted subtask of every stage that does not
    /// end in the sink: local routes taken from `local`, remote ones
    /// connected now.
    pub async fn outputs(
        &self,
        hosted: &[u32],
        local: &mut Routes,
    ) -> Result<HashMap<(usize, u32), Vec<EdgeOut>>> {
        let (p, max_p) = (self.plan.spec.parallelism, self.plan.spec.max_parallelism);
        let mut outputs = HashMap::new();
        for stage in &self.plan.stages {
            let StageOutput::Edges(edges) = &stage.output else {
                continue;
            };
            for &i in hosted {
                let mut outs = Vec::with_capacity(edges.len());
                for edge in edges {
                    let targets: Vec<u32> = match edge.kind {
                        EdgeKind::Forward => vec![i],
                        _ => (0..p).collect(),
                    };
                    let mut senders = Vec::with_capacity(targets.len());
                    for j in targets {
                        let key = (edge.to_stage, edge.input, j, i);
                        let sender = match local.remove(&key) {
                            Some(tx) => tx,
                            None if self.cluster.worker_of(j) == self.worker => {
                                return Err(Error::Job(format!(
                                    "no local route for stage {} input {} {i}->{j}",
                                    edge.to_stage, edge.input
                                )))
                            }
                            None => self.connect(key, &stage.output_schema).await?,
                        };
                        senders.push(sender);
                    }
                    let route = match &edge.kind {
                        EdgeKind::Forward => Route::Forward,
                        EdgeKind::Hash { key_indices } => {
                            Route::Hash(Partitioner::new(key_indices.clone(), p, max_p))
                        }
                        EdgeKind::Broadcast => Route::Broadcast,
                    };
                    outs.push(EdgeOut { route, senders });
                }
                outputs.insert((stage.index, i), outs);
            }
        }
        Ok(outputs)
    }

    /// A data connection for channel `key` to the worker hosting its
    /// downstream subtask, fed by the returned queue.
    async fn connect(
        &self,
        (stage, input, to, from): ChannelKey,
        schema: &SchemaRef,
    ) -> Result<mpsc::Sender<Message>> {
        let addr = self.cluster.workers[self.cluster.worker_of(to) as usize];
        let stream = protocol::connect(addr, self.within).await?;
        let hello = Hello {
            run_id: self.cluster.run_id.clone(),
            stage,
            input,
            from,
            to,
        };
        let stream = handshake::offer(
            stream,
            self.run_key,
            &encode_hello(&hello),
            &addr.to_string(),
        )
        .await?;
        let mut out = FramedWrite::new(stream, codec());
        let (tx, mut rx) = mpsc::channel::<Message>(CHANNEL_CAPACITY);
        let mut encoder = FrameEncoder::new(schema)?;
        let encode_failure = self.encode_failure.clone();
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                let end = matches!(msg, Message::End);
                let frames = match encoder.encode(&msg) {
                    Ok(f) => f,
                    Err(e) => {
                        // Kept before `rx` is dropped, so it is there
                        // when the subtask finds its downstream gone.
                        tracing::error!(error = %e, "cannot encode a message");
                        let mut failure = encode_failure.lock().unwrap_or_else(|p| p.into_inner());
                        if failure.is_none() {
                            *failure = Some(e);
                        }
                        return;
                    }
                };
                for frame in frames {
                    if let Err(e) = out.feed(frame).await {
                        tracing::debug!(peer = %addr, error = %e, "data connection closed");
                        return;
                    }
                }
                if let Err(e) = SinkExt::<bytes::Bytes>::flush(&mut out).await {
                    tracing::debug!(peer = %addr, error = %e, "data connection closed");
                    return;
                }
                if end {
                    return;
                }
            }
        });
        Ok(tx)
    }
}

/// The schema each channel's batches must have, by (stage, input).
pub(super) fn input_schemas(plan: &JobPlan) -> HashMap<(usize, usize), SchemaRef> {
    let mut schemas = HashMap::new();
    for stage in &plan.stages {
        for (k, input) in stage.inputs.iter().enumerate() {
            schemas.insert((stage.index, k), input.schema.clone());
        }
    }
    schemas
}

/// Accepts data connections and feeds each into its subtask's input channel.
pub(super) async fn accept_data(
    listener: TcpListener,
    run_id: String,
    run_key: handshake::RunKey,
    routes: Routes,
    input_schemas: HashMap<(usize, usize), SchemaRef>,
    accepted: mpsc::UnboundedSender<Result<()>>,
) {
    let input_schemas = Arc::new(input_schemas);
    let routes = Arc::new(Mutex::new(routes));
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let routes = routes.clone();
        let accepted = accepted.clone();
        let run_id = run_id.clone();
        let run_key = run_key.clone();
        let input_schemas = input_schemas.clone();
        tokio::spawn(async move {
            let peer = peer.to_string();
            // Proved before the channel is looked at: a stranger must not be
            // able to fail the run by naming a channel that does not exist.
            let (stream, hello) = match handshake::accept(stream, &run_key, &peer)
                .await
                .and_then(|(link, body)| Ok((link, decode_hello(&peer, &body)?)))
            {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "rejected a data connection");
                    return;
                }
            };
            if hello.run_id != run_id {
                tracing::warn!(%peer, "rejected a data connection of another run");
                return;
            }
            let mut frames = FramedRead::new(stream, codec());
            let tx = routes
                .lock()
                .ok()
                .and_then(|mut r| r.remove(&(hello.stage, hello.input, hello.to, hello.from)));
            let Some(tx) = tx else {
                let _ = accepted.send(Err(Error::Protocol {
                    peer,
                    message: format!("unexpected channel {hello:?}"),
                }));
                return;
            };
            let _ = accepted.send(Ok(()));
            let Some(expected) = input_schemas.get(&(hello.stage, hello.input)).cloned() else {
                return;
            };
            let mut decoder = FrameDecoder::new(&peer);
            while let Some(frame) = frames.next().await {
                let msg = match frame
                    .map_err(|e| Error::Network {
                        peer: peer.clone(),
                        message: e.to_string(),
                    })
                    .and_then(|f| decoder.decode(f.freeze()))
                {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(error = %e, "data connection failed");
                        return; // dropping tx tells the subtask its input vanished
                    }
                };
                if let Message::Batch(b) = &msg {
                    // Operators index columns by position: a batch of another shape is a protocol error.
                    if b.schema().fields() != expected.fields() {
                        tracing::warn!(%peer, "data connection sent a batch of the wrong schema");
                        return;
                    }
                }
                let end = matches!(msg, Message::End);
                if tx.send(msg).await.is_err() || end {
                    return;
                }
            }
        });
    }
}
