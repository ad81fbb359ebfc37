//! A worker process: hosts slot `index` (subtask `index` of every stage, and
//! more when there are fewer workers than subtasks), wires its channels to
//! the other workers, and runs its subtasks until the job finishes or fails.
//! Worker 0 also hosts the coordinator and answers for the job on the
//! control endpoint.
//!
//! The same code runs under `weir run` (local processes) and in pods. A
//! worker learns its peers' addresses from its membership, never from DNS:
//! `weir run` passes it on the command line ([`Placement::Local`]); in a pod
//! ([`Placement::Pod`]) the worker serves its control endpoint first and waits
//! for the operator to `PUT /v1/membership`, since pod IPs are only known once
//! every pod exists. It treats the loss of any peer as the end of the run;
//! whoever started it (the local supervisor or the operator) restores the job
//! from the latest completed checkpoint.

mod clean_up;
pub mod gate;
pub mod handshake;
pub mod protocol;
mod read_marks;
mod snapshot;
pub mod restore;
pub(crate) mod start_positions;
mod start;
pub mod subtask;
mod subtask_positions;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::task::JoinSet;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::checkpoint::coordinator::{self, CoordinatorConfig};
use crate::checkpoint::CheckpointStorage;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::exchange::frame::{codec, decode_hello, encode_hello, FrameDecoder, FrameEncoder, Hello};
use crate::exchange::partition::Partitioner;
use crate::exchange::{Barrier, Message, CHANNEL_CAPACITY};
use crate::operator::Operator;
use crate::plan::{JobPlan, OperatorKind, StageOutput, WindowPlan};
use crate::sink::{SinkRestore, SinkState, SinkWriter};
use crate::source::{SourcePositions, SourceReader};

pub use protocol::Cluster;
pub use start::{at_most_once_refuses, run, Placement};
use protocol::{ToCoordinator, ToWorker};
use restore::RestoreFrom;
use start::restore_state;
use gate::{Alignment, InputGate, Unaligning};
use weir_api::{Guarantee, SinkSpec, SourceSpec};
use read_marks::ReadMarks;
use subtask::{AtMostOnce, Counters, Incremental, Input, LateRecords, Notification, Output, ReadAhead, SourceClock, Subtask};

pub struct WorkerConfig {
    pub plan: Arc<JobPlan>,
    pub index: u32,
    pub placement: Placement,
    pub state_dir: String,
    pub restore: Option<RestoreFrom>,
    pub allow_non_restored_state: bool,
    /// `--restore latest` of a storage without any state of the job fails
    /// instead of starting fresh (see `weir worker --expect-state`).
    pub expect_state: bool,
    /// Relative paths of sources and sinks are resolved against this directory.
    pub base_dir: PathBuf,
    pub token: String,
    /// The name the sinks' writes carry outside weir (`weir worker
    /// --job-id`); the pipeline's name when unset.
    pub job_id: Option<String>,
}

const CONNECT_WITHIN: Duration = Duration::from_secs(30);

type Routes = HashMap<(usize, u32, u32), mpsc::Sender<Message>>;

/// Runs this worker's part of run `cluster` until the job finishes or the run fails.
async fn run_job(cfg: &WorkerConfig, cluster: &Cluster, control: Control) -> Result<()> {
    let plan = cfg.plan.clone();
    let spec = &plan.spec;
    let (source, sink) = (&plan.source, &plan.sink);
    let (p, max_p) = (spec.parallelism, spec.max_parallelism);
    let index = cfg.index;
    let storage = CheckpointStorage::open(&cfg.state_dir, &spec.name, true)?;
    // Sinks name their writes outside weir by this: two jobs of one
    // pipeline name writing to one database or topic must not take each
    // other's prepared transactions or transactional ids for their own.
    let job_id = cfg.job_id.as_deref().unwrap_or(&spec.name);
    let (restored, claim) = restore_state(cfg, &storage, &cluster.run_id).await?;
    let restored_from = restored.as_ref().map(|r| r.location.display.clone());
    {
        let status = control.status();
        let mut st = status.lock().unwrap_or_else(|e| e.into_inner());
        st.run_id = cluster.run_id.clone();
        st.phase = "starting".into();
        st.restored_from = restored_from.clone();
    }
    // Worker 0's phase is the coordinator's; the others report their own.
    let set_phase = |phase: &str| {
        if index != 0 {
            control.set_phase(phase);
        }
    };

    // At-most-once takes no checkpoints: the coordinator only runs the
    // final barrier (which flushes the sinks) and refuses savepoints.
    let at_most_once = spec.guarantee() == Guarantee::AtMostOnce;
    // A local run's processes exit after a stop; pods stay until deleted.
    let ends_after_stop = matches!(cfg.placement, Placement::Local(_));
    let mut coordinator_task = None;
    if index == 0 {
        let Some(claim) = claim else { return Err(Error::Job("worker 0 started without a claim on the job's state".into())) };
        let control_listener = bind(cluster.coordinator).await?;
        let (api_tx, api_rx) = mpsc::channel(16);
        control.serve_savepoints(api_tx);
        let status = control.status();
        let ccfg = CoordinatorConfig {
            job: spec.name.clone(),
            run_id: cluster.run_id.clone(),
            run_key: handshake::run_key(&cfg.token, &cluster.run_id),
            parallelism: p,
            max_parallelism: max_p,
            stages: plan.stage_count(),
            workers: cluster.workers.len(),
            interval: if at_most_once { Duration::ZERO } else { spec.checkpoint.interval.get() },
            snapshots: !at_most_once,
            timeout: spec.checkpoint.timeout.get(),
            retain: spec.checkpoint.retain as usize,
            storage: storage.clone(),
            savepoints: control.savepoint_book(),
            restored_from: restored_from.clone(),
            end_after_stop: ends_after_stop,
            claim,
        };
        coordinator_task = Some(tokio::spawn(coordinator::run(ccfg, control_listener, api_rx, status)));
    } else {
        control.savepoints_elsewhere(cluster.api);
    }
    let data_listener = bind(cluster.workers[index as usize]).await?;

    // The coordinator connection: a writer fed by a channel, and a reader
    // that dispatches triggers to sources and notifications to sinks.
    let coordinator_peer = cluster.coordinator.to_string();
    let run_key = handshake::run_key(&cfg.token, &cluster.run_id);
    let hello = ToCoordinator::Hello { worker: index, run_id: cluster.run_id.clone(), restored_from };
    let conn = protocol::join_coordinator(cluster.coordinator, &run_key, &hello, CONNECT_WITHIN).await?;
    let (mut conn_tx, mut conn_rx) = conn.split::<bytes::Bytes>();
    let (to_coord, mut to_coord_rx) = mpsc::unbounded_channel::<ToCoordinator>();
    tokio::spawn(async move {
        while let Some(msg) = to_coord_rx.recv().await {
            let Ok(bytes) = serde_json::to_vec(&msg) else { continue };
            if conn_tx.send(bytes::Bytes::from(bytes)).await.is_err() {
                break;
            }
        }
    });
    let heartbeats = to_coord.clone();
    tokio::spawn(async move {
        while heartbeats.send(ToCoordinator::Heartbeat).is_ok() {
            tokio::time::sleep(protocol::heartbeat_interval()).await;
        }
    });
    let hosted: Vec<u32> = (0..p).filter(|s| cluster.worker_of(*s) == index).collect();
    let mut trigger_txs = Vec::new();
    let mut trigger_rxs = HashMap::new();
    for &j in &hosted {
        let (tx, rx) = mpsc::unbounded_channel::<Barrier>();
        trigger_txs.push(tx);
        trigger_rxs.insert(j, rx);
    }
    // Unaligned checkpoints: every subtask with inputs hears of a periodic
    // checkpoint from the coordinator directly, ahead of any queue.
    let unaligned_after = if at_most_once || spec.guarantee() != Guarantee::ExactlyOnce { None } else { spec.checkpoint.unaligned_after() };
    let mut notice_txs = Vec::new();
    let mut notice_rxs = HashMap::new();
    if unaligned_after.is_some() {
        for stage in 1..plan.stage_count() {
            for &j in &hosted {
                let (tx, rx) = mpsc::unbounded_channel::<Barrier>();
                notice_txs.push(tx);
                notice_rxs.insert((stage, j), rx);
            }
        }
    }
    let (notify_tx, _) = broadcast::channel::<Notification>(256);
    let mut sink_notifications: HashMap<u32, broadcast::Receiver<Notification>> = hosted.iter().map(|&j| (j, notify_tx.subscribe())).collect();
    // Subtasks that write late records commit them as a sink does; those
    // of stages other than the sink's hear of completions on their own.
    // So does every subtask under incremental checkpoints: its chains of
    // state files move when their checkpoint completes.
    let late_outputs = plan.late_records_outputs();
    let job_outputs = clean_up::Outputs { sink: sink.spec.clone(), sink_state_id: sink.state_id.clone(), late_records: late_outputs.iter().map(|(_, _, op, output)| (op.clone(), output.clone())).collect() };
    let incremental = spec.checkpoint.incremental && !at_most_once;
    let mut stage_notifications: HashMap<(usize, u32), broadcast::Receiver<Notification>> = HashMap::new();
    for (stage, plan_stage) in plan.stages.iter().enumerate() {
        let writes_late = late_outputs.iter().any(|(s, ..)| *s == stage);
        if (writes_late || incremental) && !matches!(plan_stage.output, StageOutput::Sink) {
            for &j in &hosted {
                stage_notifications.insert((stage, j), notify_tx.subscribe());
            }
        }
    }
    // What each subtask has committed (`u64::MAX` for one that commits
    // nothing): a stopping savepoint is reported to the coordinator as
    // committed once every one has reached it.
    let mut committed_txs: HashMap<(usize, u32), watch::Sender<u64>> = HashMap::new();
    let mut committed_rxs = Vec::new();
    for stage in 0..plan.stage_count() {
        for &j in &hosted {
            let (tx, rx) = watch::channel(0u64);
            committed_txs.insert((stage, j), tx);
            committed_rxs.push(rx);
        }
    }
    let (start_tx, start_rx) = oneshot::channel::<()>();
    let shutdown = Arc::new(Notify::new());
    let stopped = Arc::new(Notify::new());
    let (lost_tx, mut lost_rx) = mpsc::channel::<String>(1);
    {
        let shutdown = shutdown.clone();
        let stopped = stopped.clone();
        // A pod stays after a stop until the operator deletes it (or the
        // stop is cancelled and the job goes on), so worker 0 cleans up once
        // its sinks committed the stopping savepoint, before it says so:
        // the operator deletes the pods only after that.
        let clean_up_at_stop = (index == 0 && !ends_after_stop).then(|| {
            Arc::new(clean_up::AtStop { outputs: job_outputs.clone(), job: job_id.to_string(), run_id: cluster.run_id.clone(), base_dir: cfg.base_dir.clone(), storage: storage.clone() })
        });
        let mut start_tx = Some(start_tx);
        let to_coord = to_coord.clone();
        let mut stop_savepoint = None;
        tokio::spawn(async move {
            loop {
                let Ok(next) = tokio::time::timeout(protocol::heartbeat_timeout(), conn_rx.next()).await else {
                    let _ = lost_tx.send(format!("lost the coordinator: {}", protocol::silence(0, &coordinator_peer))).await;
                    return;
                };
                let msg = match next {
                    Some(Ok(frame)) => serde_json::from_slice::<ToWorker>(&frame).map_err(|e| e.to_string()),
                    Some(Err(e)) => Err(e.to_string()),
                    None => Err("connection closed".into()),
                };
                match msg {
                    Ok(ToWorker::Heartbeat) => {}
                    Ok(ToWorker::Start) => {
                        if let Some(tx) = start_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(ToWorker::Trigger(b)) => {
                        if b.stop {
                            stop_savepoint = Some(b.checkpoint_id);
                        }
                        if !b.savepoint && !b.is_final {
                            notice_txs.iter().for_each(|t| {
                                let _ = t.send(b.clone());
                            });
                        }
                        trigger_txs.iter().for_each(|t| {
                            let _ = t.send(b.clone());
                        })
                    }
                    Ok(ToWorker::Complete { checkpoint_id }) => {
                        let _ = notify_tx.send(Notification::Complete(checkpoint_id));
                        if stop_savepoint == Some(checkpoint_id) {
                            let (mut rxs, to_coord, clean_up_at_stop) = (committed_rxs.clone(), to_coord.clone(), clean_up_at_stop.clone());
                            tokio::spawn(async move {
                                for rx in &mut rxs {
                                    // A subtask that ended has nothing left to commit.
                                    let _ = rx.wait_for(|c| *c >= checkpoint_id).await;
                                }
                                if let Some(c) = clean_up_at_stop {
                                    c.run().await;
                                }
                                let _ = to_coord.send(ToCoordinator::Committed { checkpoint_id });
                            });
                        }
                    }
                    Ok(ToWorker::Abort { checkpoint_id }) => {
                        let _ = notify_tx.send(Notification::Abort(checkpoint_id));
                    }
                    Ok(ToWorker::Shutdown) => {
                        shutdown.notify_one();
                        return;
                    }
                    Ok(ToWorker::Stopped { savepoint_id }) => {
                        tracing::info!(savepoint = savepoint_id, "the job was stopped with a savepoint");
                        stopped.notify_one();
                    }
                    Err(e) => {
                        let _ = lost_tx.send(format!("lost the coordinator at {coordinator_peer}: {e}")).await;
                        return;
                    }
                }
            }
        });
    }

    // Channels into the subtasks of stages after the first, one per upstream subtask.
    let stages = plan.stage_count();
    let mut gates: HashMap<(usize, u32), Vec<mpsc::Receiver<Message>>> = HashMap::new();
    let mut local_routes: Routes = HashMap::new();
    let mut remote_routes: Routes = HashMap::new();
    for stage in 1..stages {
        for &j in &hosted {
            let mut rxs = Vec::new();
            for i in 0..p {
                let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
                rxs.push(rx);
                if cluster.worker_of(i) == index {
                    local_routes.insert((stage, j, i), tx);
                } else {
                    remote_routes.insert((stage, j, i), tx);
                }
            }
            gates.insert((stage, j), rxs);
        }
    }
    let expected_remote = remote_routes.len();
    let (accepted_tx, mut accepted_rx) = mpsc::unbounded_channel::<Result<()>>();
    let input_schemas: Vec<_> = plan.stages.iter().map(|s| s.input_schema.clone()).collect();
    tokio::spawn(accept_data(data_listener, cluster.run_id.clone(), run_key.clone(), remote_routes, input_schemas, accepted_tx));

    // Why a data connection's writer gave up, when it was not the network: a
    // record it cannot encode fails the worker with that error, not with the
    // "downstream went away" its subtask sees.
    let encode_failure: Arc<Mutex<Option<Error>>> = Arc::default();
    // Outputs of the hosted subtasks of every stage but the last.
    let mut outputs: HashMap<(usize, u32), Vec<mpsc::Sender<Message>>> = HashMap::new();
    for stage in 0..stages.saturating_sub(1) {
        let schema = plan.stages[stage].output_schema.clone();
        for &i in &hosted {
            let mut senders = Vec::new();
            for j in 0..p {
                let w = cluster.worker_of(j);
                if w == index {
                    let tx = local_routes
                        .remove(&(stage + 1, j, i))
                        .ok_or_else(|| Error::Job(format!("no local route for stage {} {i}->{j}", stage + 1)))?;
                    senders.push(tx);
                } else {
                    let addr = cluster.workers[w as usize];
                    let mut stream = protocol::connect(addr, CONNECT_WITHIN).await?;
                    let hello = Hello { run_id: cluster.run_id.clone(), stage: stage + 1, from: i, to: j };
                    handshake::offer(&mut stream, &run_key, &encode_hello(&hello), &addr.to_string()).await?;
                    let mut out = FramedWrite::new(stream, codec());
                    let (tx, mut rx) = mpsc::channel::<Message>(CHANNEL_CAPACITY);
                    let mut encoder = FrameEncoder::new(&schema)?;
                    let encode_failure = encode_failure.clone();
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
                    senders.push(tx);
                }
            }
            outputs.insert((stage, i), senders);
        }
    }
    let deadline = tokio::time::Instant::now() + CONNECT_WITHIN;
    for _ in 0..expected_remote {
        match tokio::time::timeout_at(deadline, accepted_rx.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(e))) => return Err(e),
            _ => return Err(Error::Job(format!("worker {index}: not every upstream connected within {CONNECT_WITHIN:?}"))),
        }
    }

    let _ = to_coord.send(ToCoordinator::Ready);
    tokio::select! {
        r = start_rx => r.map_err(|_| Error::Job("the coordinator went away before the start".into()))?,
        reason = lost(&mut lost_rx) => return Err(Error::Job(reason)),
    }
    set_phase("running");

    // Build and start the subtasks.
    let counters = Arc::new(Counters::default());
    let source_positions = match &restored {
        Some(r) => r.source_positions(&source.state_id)?,
        // An at-most-once run that resumes starts where the sources last
        // read; nothing read yet is a first start (Kafka's `start` applies).
        None if at_most_once && cfg.restore.is_some() => {
            let marks = ReadMarks::load(&storage).await?;
            if marks.splits.is_empty() { Vec::new() } else { vec![marks] }
        }
        None => Vec::new(),
    };
    // A fresh start of a source whose start depends on the moment goes on
    // where this history first started (`start_positions.rs`).
    let started_on_clock = matches!(source.spec, SourceSpec::Kafka(_));
    let started = if source_positions.is_empty() && started_on_clock { start_positions::load(&storage).await? } else { SourcePositions::default() };
    let sink_states = match &restored {
        Some(r) => r.sink_states_of(&sink.state_id)?,
        None => Vec::new(),
    };
    // Subtask 0 of the sink cleans up after earlier attempts; it must keep
    // whatever any retained snapshot (or the restored one) still references.
    let keep = if hosted.contains(&0) { Some(restore::referenced_sink_files(&storage, restored.as_ref(), &sink.state_id).await?) } else { None };
    let own_runs = if hosted.contains(&0) { Some(storage.claimed_runs().await?) } else { None };
    // Alignment is what exactly-once costs; a job promising less skips it.
    let alignment = if spec.guarantee() == Guarantee::ExactlyOnce { Alignment::Aligned } else { Alignment::Tracked };
    let mine = |j: u32| -> Vec<SinkState> { sink_states.iter().filter(|(old, _)| old % p == j).map(|(_, s)| s.clone()).collect() };
    let hosted_sinks: Vec<(u32, Vec<SinkState>)> = hosted.iter().map(|&j| (j, mine(j))).collect();
    crate::sink::before_opening(&sink.spec, job_id, &hosted_sinks, p, &storage).await?;
    let mut tasks = JoinSet::new();
    for (stage_index, stage) in plan.stages.iter().enumerate() {
        for &j in &hosted {
            let input = if stage_index == 0 {
                let reader = SourceReader::open(&source.spec, stage.input_schema.clone(), j, p, max_p, &source_positions, &started, &cfg.base_dir)?;
                if source_positions.is_empty() && started_on_clock {
                    start_positions::save(&storage, j, &reader.positions()?).await?;
                }
                let triggers = trigger_rxs.remove(&j).ok_or_else(|| Error::Job("source triggers taken twice".into()))?;
                let ahead = at_most_once.then(|| ReadAhead::new(ReadMarks::new(&storage, j)));
                Input::Source { reader, triggers, ahead, state_id: source.state_id.clone() }
            } else {
                let rxs = gates.remove(&(stage_index, j)).ok_or_else(|| Error::Job("input gate taken twice".into()))?;
                let mut gate = InputGate::new(format!("stage {stage_index} subtask {j}"), rxs, alignment);
                if let (Some(after), Some(notices)) = (unaligned_after, notice_rxs.remove(&(stage_index, j))) {
                    gate = gate.unaligned(Unaligning { after, notices });
                }
                if let Some(r) = &restored {
                    gate = gate.with_restored(r.in_flight_batches(&plan, stage_index, j).await?);
                }
                Input::Gate(gate)
            };
            let mut operators = Vec::new();
            let mut late_records = Vec::new();
            let mut schema = stage.input_schema.clone();
            for (k, op_plan) in stage.operators.iter().enumerate() {
                let mut op = Operator::new(op_plan, &schema, j, p, max_p)?;
                if let (Some(r), true) = (&restored, op.is_stateful()) {
                    for (batch, changes) in r.keyed_batches(op_plan.id.as_str(), j, p).await? {
                        op.restore(&batch, &r.location.display, changes)?;
                    }
                }
                if let OperatorKind::Window(WindowPlan { late_records: Some(output), .. }) = &op_plan.kind {
                    let state_id = crate::plan::late_records_id(&op_plan.id);
                    let states = match &restored {
                        Some(r) => r.sink_states_of(&state_id)?,
                        None => Vec::new(),
                    };
                    let keep = if j == 0 { Some(restore::referenced_sink_files(&storage, restored.as_ref(), &state_id).await?) } else { None };
                    let restore = SinkRestore { mine: states.iter().filter(|(old, _)| old % p == j).map(|(_, s)| s.clone()).collect(), keep: keep.as_ref(), runs: own_runs.as_ref(), parallelism: p, snapshot_log: None };
                    let sink = SinkWriter::open(&SinkSpec::File(output.clone()), &schema, job_id, j, &cluster.run_id, restore, &cfg.base_dir, &storage).await?;
                    late_records.push(LateRecords { operator: k, state_id, sink });
                }
                schema = op_plan.output_schema.clone();
                operators.push(op);
            }
            let output = match &stage.output {
                StageOutput::Sink => {
                    let restore = SinkRestore {
                        mine: mine(j),
                        keep: if j == 0 { keep.as_ref() } else { None },
                        runs: if j == 0 { own_runs.as_ref() } else { None },
                        parallelism: p,
                        snapshot_log: restored.as_ref().map(|r| r.location.child(crate::sink::LOG_DIR)),
                    };
                    let writer = SinkWriter::open(&sink.spec, &schema, job_id, j, &cluster.run_id, restore, &cfg.base_dir, &storage).await?;
                    let notifications = sink_notifications.remove(&j).ok_or_else(|| Error::Job("sink notifications taken twice".into()))?;
                    Output::Sink { sink: writer, notifications, state_id: sink.state_id.clone() }
                }
                StageOutput::Exchange { key_indices } => Output::Exchange {
                    partitioner: Partitioner::new(key_indices.clone(), p, max_p),
                    senders: outputs.remove(&(stage_index, j)).ok_or_else(|| Error::Job("outputs taken twice".into()))?,
                },
            };
            let subtask = Subtask {
                stage: stage_index,
                index: j,
                input,
                operators,
                output,
                to_coordinator: to_coord.clone(),
                storage: storage.clone(),
                counters: counters.clone(),
                at_most_once: at_most_once.then(|| AtMostOnce { flush_every: spec.checkpoint.interval.get() }),
                clock: if stage_index == 0 { plan.event_time.clone().map(SourceClock::new) } else { None },
                incremental: incremental.then(|| Incremental::new(&cluster.run_id)),
                late_records,
                notifications: stage_notifications.remove(&(stage_index, j)),
                committed: committed_txs.remove(&(stage_index, j)).ok_or_else(|| Error::Job("commit progress taken twice".into()))?,
            };
            tasks.spawn(subtask.run());
        }
    }
    drop(sink_notifications);
    drop(stage_notifications);
    tracing::info!(worker = index, subtasks = tasks.len(), "worker running");
    let _ = to_coord.send(ToCoordinator::Running);

    let metrics_counters = counters.clone();
    let metrics_tx = to_coord.clone();
    let metrics = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let msg = ToCoordinator::Metrics {
                records_in: metrics_counters.records_in.load(std::sync::atomic::Ordering::Relaxed),
                records_out: metrics_counters.records_out.load(std::sync::atomic::Ordering::Relaxed),
                records_skipped: metrics_counters.records_skipped.load(std::sync::atomic::Ordering::Relaxed),
                records_late: metrics_counters.records_late.load(std::sync::atomic::Ordering::Relaxed),
            };
            if metrics_tx.send(msg).is_err() {
                return;
            }
        }
    });

    let coordinator_failed = async {
        match coordinator_task {
            Some(t) => match t.await {
                Ok(Ok(())) => std::future::pending().await,
                Ok(Err(e)) => e,
                Err(e) => Error::Job(format!("coordinator crashed: {e}")),
            },
            None => std::future::pending().await,
        }
    };
    tokio::pin!(coordinator_failed);
    let mut ending = "finished";
    loop {
        tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => {
                    let e = encode_failure.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or(e);
                    if e.is_fatal() {
                        return Err(e);
                    }
                    // A subtask that saw the coordinator's channels close
                    // fails only as a consequence: the connection task
                    // queued the cause (silence, a closed connection) before
                    // it dropped them, so that cause is the one reported.
                    let e = lost_rx.try_recv().map(Error::Job).unwrap_or(e);
                    return Err(prefer_fatal(&mut tasks, e).await);
                }
                Some(Err(e)) => return Err(Error::Job(format!("a subtask crashed: {e}"))),
                None => break,
            },
            // Stopped with a savepoint: nothing after it may be committed
            // (no checkpoint follows). The subtasks are left as they are
            // until every worker has said so, because a worker that stopped
            // them first would close its connections and fail the others.
            _ = stopped.notified() => {
                ending = "stopped";
                break;
            }
            reason = lost(&mut lost_rx) => return Err(prefer_fatal(&mut tasks, Error::Job(reason)).await),
            e = &mut coordinator_failed => return Err(e),
        }
    }
    // Every subtask has ended (the final checkpoint is committed here), or the job was stopped.
    let msg = ToCoordinator::Metrics {
        records_in: counters.records_in.load(std::sync::atomic::Ordering::Relaxed),
        records_out: counters.records_out.load(std::sync::atomic::Ordering::Relaxed),
        records_skipped: counters.records_skipped.load(std::sync::atomic::Ordering::Relaxed),
        records_late: counters.records_late.load(std::sync::atomic::Ordering::Relaxed),
    };
    metrics.abort();
    set_phase(if ending == "finished" { "finishing" } else { ending });
    let _ = to_coord.send(msg);
    let _ = to_coord.send(ToCoordinator::Finished);
    tokio::select! {
        biased;
        _ = shutdown.notified() => {}
        reason = lost(&mut lost_rx) => return Err(Error::Job(reason)),
        e = &mut coordinator_failed => return Err(e),
        _ = tokio::time::sleep(Duration::from_secs(30)) => return Err(Error::Job(format!("no shutdown from the coordinator after the job {ending}"))),
    }
    set_phase(ending);
    tasks.abort_all();
    if index == 0 {
        // Retention ran before the final commit: what it deleted no longer
        // protects in-progress files. A job stopped with a savepoint may
        // never be resumed, so it leaves nothing behind either (what the
        // savepoint references stays).
        clean_up::clean_up_after_end(&job_outputs, job_id, &cluster.run_id, crate::sink::RunEnd::Over, &cfg.base_dir, &storage).await?;
    }
    // Let the coordinator answer the last status requests of the supervisor.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

/// Why the coordinator connection was lost; never returns while it is up or
/// after it closed normally (on shutdown).
async fn lost(rx: &mut mpsc::Receiver<String>) -> String {
    match rx.recv().await {
        Some(reason) => reason,
        None => std::future::pending().await,
    }
}

/// Listens on `addr`: on the socket the local supervisor bound for it and
/// handed over (see `local::listeners`), or else on a new one.
pub(crate) async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener> {
    if let Some(l) = crate::local::listeners::take(addr)? {
        l.set_nonblocking(true).map_err(Error::io(format!("cannot listen on {addr}")))?;
        return TcpListener::from_std(l).map_err(Error::io(format!("cannot listen on {addr}")));
    }
    TcpListener::bind(addr).await.map_err(Error::io(format!("cannot listen on {addr}")))
}

/// Accepts data connections and feeds each into its subtask's input channel.
async fn accept_data(
    listener: TcpListener,
    run_id: String,
    run_key: ring::hmac::Key,
    routes: Routes,
    input_schemas: Vec<arrow::datatypes::SchemaRef>,
    accepted: mpsc::UnboundedSender<Result<()>>,
) {
    let input_schemas = Arc::new(input_schemas);
    let routes = Arc::new(Mutex::new(routes));
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else { continue };
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
            let hello = match handshake::accept(&mut stream, &run_key, &peer).await.and_then(|body| decode_hello(&peer, &body)) {
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
            let tx = routes.lock().ok().and_then(|mut r| r.remove(&(hello.stage, hello.to, hello.from)));
            let Some(tx) = tx else {
                let _ = accepted.send(Err(Error::Protocol { peer, message: format!("unexpected channel {hello:?}") }));
                return;
            };
            let _ = accepted.send(Ok(()));
            let Some(expected) = input_schemas.get(hello.stage).cloned() else { return };
            let mut decoder = FrameDecoder::new(&peer);
            while let Some(frame) = frames.next().await {
                let msg = match frame.map_err(|e| Error::Network { peer: peer.clone(), message: e.to_string() }).and_then(|f| decoder.decode(f.freeze())) {
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

/// A lost peer or a closed input is often the echo of this worker's own
/// failure: its subtask failed on a record, its connections closed, the
/// other worker gave up, and that news can arrive before the subtask's own
/// error is seen. A fatal error of one of this worker's subtasks within a
/// moment is the cause and wins, so a deterministic failure is reported as
/// one (exit 3) instead of being restarted.
async fn prefer_fatal(tasks: &mut JoinSet<Result<()>>, e: Error) -> Error {
    let deadline = tokio::time::sleep(Duration::from_millis(300));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return e,
            joined = tasks.join_next() => match joined {
                Some(Ok(Err(fatal))) if fatal.is_fatal() => return fatal,
                Some(_) => {}
                None => return e,
            },
        }
    }
}
