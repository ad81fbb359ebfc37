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

pub(crate) mod clean_up;
pub mod gate;
pub mod handshake;
pub mod protocol;
mod read_marks;
mod snapshot;
mod sources;
pub mod restore;
pub(crate) mod start_positions;
mod start;
pub mod subtask;
mod subtask_positions;
pub mod tls;
mod wiring;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::task::JoinSet;

use crate::checkpoint::coordinator::{self, CoordinatorConfig};
use crate::checkpoint::CheckpointStorage;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::exchange::Barrier;
use crate::operator::Operator;
use crate::plan::{JobPlan, OperatorKind, StageOutput, WindowPlan};
use crate::sink::{SinkRestore, SinkScope, SinkState, SinkWriter};

pub use protocol::Cluster;
pub use start::{at_most_once_refuses, run, Placement};
use protocol::{ToCoordinator, ToWorker};
use restore::RestoreFrom;
use start::restore_state;
use gate::{Alignment, InputGate, Unaligning};
use weir_api::{Guarantee, SinkSpec};
use read_marks::ReadMarks;
use subtask::{AtMostOnce, Counters, Incremental, Input, LateRecords, Notification, Output, SourceClock, Subtask};
use sources::SourceOpening;

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
    /// TLS on the run's connections and the control endpoint (`weir worker
    /// --tls-dir`); plain TCP when unset.
    pub tls: Option<Arc<tls::JobTls>>,
}

const CONNECT_WITHIN: Duration = Duration::from_secs(30);

/// Runs this worker's part of run `cluster` until the job finishes or the run fails.
async fn run_job(cfg: &WorkerConfig, cluster: &Cluster, control: Control) -> Result<()> {
    let plan = cfg.plan.clone();
    let spec = &plan.spec;
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
    let at_most_once = spec.runtime_guarantee() == Guarantee::AtMostOnce;
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
            run_key: handshake::run_key(&cfg.token, &cluster.run_id).with_tls(cfg.tls.clone()),
            parallelism: p,
            max_parallelism: max_p,
            stages: plan.stage_count(),
            source_stages: plan.sources().count(),
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
    let run_key = handshake::run_key(&cfg.token, &cluster.run_id).with_tls(cfg.tls.clone());
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
    // Every source subtask hears of each checkpoint from the coordinator.
    let mut trigger_txs = Vec::new();
    let mut trigger_rxs = HashMap::new();
    for (stage, _) in plan.sources() {
        for &j in &hosted {
            let (tx, rx) = mpsc::unbounded_channel::<Barrier>();
            trigger_txs.push(tx);
            trigger_rxs.insert((stage, j), rx);
        }
    }
    // Unaligned checkpoints: every subtask with inputs hears of a periodic
    // checkpoint from the coordinator directly, ahead of any queue.
    let unaligned_after = if at_most_once || spec.runtime_guarantee() != Guarantee::ExactlyOnce { None } else { spec.checkpoint.unaligned_after() };
    let mut notice_txs = Vec::new();
    let mut notice_rxs = HashMap::new();
    if unaligned_after.is_some() {
        for stage in plan.stages.iter().filter(|s| !s.inputs.is_empty()).map(|s| s.index) {
            for &j in &hosted {
                let (tx, rx) = mpsc::unbounded_channel::<Barrier>();
                notice_txs.push(tx);
                notice_rxs.insert((stage, j), rx);
            }
        }
    }
    let (notify_tx, _) = broadcast::channel::<Notification>(256);
    let mut sink_notifications: HashMap<(usize, u32), broadcast::Receiver<Notification>> = HashMap::new();
    for (stage, plan_stage) in plan.stages.iter().enumerate() {
        if matches!(plan_stage.output, StageOutput::Sink(_)) {
            for &j in &hosted {
                sink_notifications.insert((stage, j), notify_tx.subscribe());
            }
        }
    }
    // Subtasks that write late records commit them as a sink does; those
    // of stages other than the sink's hear of completions on their own.
    // So does every subtask under incremental checkpoints: its chains of
    // state files move when their checkpoint completes.
    let late_outputs = plan.late_records_outputs();
    let job_outputs = clean_up::Outputs {
        sinks: plan.sinks().map(|s| (s.state_id.clone(), s.spec.clone())).collect(),
        late_records: late_outputs.iter().map(|(_, _, op, output)| (op.clone(), output.clone())).collect(),
    };
    let incremental = spec.checkpoint.incremental && !at_most_once;
    let mut stage_notifications: HashMap<(usize, u32), broadcast::Receiver<Notification>> = HashMap::new();
    for (stage, plan_stage) in plan.stages.iter().enumerate() {
        let writes_late = late_outputs.iter().any(|(s, ..)| *s == stage);
        if (writes_late || incremental) && !matches!(plan_stage.output, StageOutput::Sink(_)) {
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
        if index == 0 {
            let at = clean_up::AtStop { outputs: job_outputs.clone(), job: job_id.to_string(), run_id: cluster.run_id.clone(), base_dir: cfg.base_dir.clone(), storage: storage.clone() };
            control.serve_disposals(clean_up::SavepointDisposal { at });
        }
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

    // Channels into every subtask with inputs, one per edge and upstream subtask.
    let wiring::Inputs { mut gates, local: mut local_routes, remote: remote_routes } = wiring::inputs(&plan, cluster, index, &hosted);
    let expected_remote = remote_routes.len();
    let (accepted_tx, mut accepted_rx) = mpsc::unbounded_channel::<Result<()>>();
    let input_schemas = wiring::input_schemas(&plan);
    tokio::spawn(wiring::accept_data(data_listener, cluster.run_id.clone(), run_key.clone(), remote_routes, input_schemas, accepted_tx));
    let encode_failure: Arc<Mutex<Option<Error>>> = Arc::default();
    let connecting = wiring::Connecting { plan: &plan, cluster, worker: index, run_key: &run_key, within: CONNECT_WITHIN, encode_failure: encode_failure.clone() };
    let mut outputs = connecting.outputs(&hosted, &mut local_routes).await?;
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
    let own_runs = if hosted.contains(&0) { Some(storage.claimed_runs().await?) } else { None };
    // Alignment is what exactly-once costs; a job whose every sink is
    // promised less skips it.
    let alignment = if spec.runtime_guarantee() == Guarantee::ExactlyOnce { Alignment::Aligned } else { Alignment::Tracked };
    let mut sink_openings: HashMap<usize, SinkOpening> = HashMap::new();
    let settling = plan.stages.iter().filter(|s| matches!(&s.output, StageOutput::Sink(sink) if crate::sink::settles_kafka_transactions(&sink.spec))).count() * hosted.len();
    for stage in &plan.stages {
        let StageOutput::Sink(sink) = &stage.output else { continue };
        let states = match &restored {
            Some(r) => r.sink_states_of(&sink.state_id)?,
            None => Vec::new(),
        };
        // Subtask 0 of each sink cleans up after earlier attempts; it must keep
        // whatever any retained snapshot (or the restored one) still references.
        let keep = if hosted.contains(&0) { Some(restore::referenced_sink_files(&storage, restored.as_ref(), &sink.state_id).await?) } else { None };
        let scope = SinkScope::of(&sink.state_id);
        let hosted_sinks: Vec<(u32, Vec<SinkState>)> = hosted.iter().map(|&j| (j, states_of_subtask(&states, j, p))).collect();
        crate::sink::before_opening(&sink.spec, &scope, job_id, (&hosted_sinks, settling), p, &storage).await?;
        sink_openings.insert(stage.index, SinkOpening { states, keep, scope });
    }
    let mut tasks = JoinSet::new();
    for (stage_index, stage) in plan.stages.iter().enumerate() {
        for &j in &hosted {
            let input = match &stage.source {
                Some(source) => {
                    let triggers = trigger_rxs.remove(&(stage_index, j)).ok_or_else(|| Error::Job("source triggers taken twice".into()))?;
                    let opening = SourceOpening { cfg, storage: &storage, restored: restored.as_ref(), at_most_once };
                    opening.open(source, stage.input_schema.clone(), j, triggers).await?
                }
                None => {
                    let rxs = gates.remove(&(stage_index, j)).ok_or_else(|| Error::Job("input gate taken twice".into()))?;
                    let mut gate = InputGate::new(format!("stage {stage_index} subtask {j}"), rxs, alignment);
                    if let (Some(after), Some(notices)) = (unaligned_after, notice_rxs.remove(&(stage_index, j))) {
                        gate = gate.unaligned(Unaligning { after, notices });
                    }
                    if let Some(r) = &restored {
                        gate = gate.with_restored(r.in_flight_batches(&plan, stage_index, j).await?);
                    }
                    // A union may merge inputs whose fields differ only in
                    // whether they may be null; a join reads each as it is.
                    let apart = stage.operators.first().is_some_and(|o| o.kind.reads_inputs_apart());
                    let differ = stage.inputs.iter().any(|i| i.schema.fields() != stage.input_schema.fields());
                    let relabel = (differ && !apart).then(|| stage.input_schema.clone());
                    Input::Gate(gate, relabel)
                }
            };
            let mut operators = Vec::new();
            let mut late_records = Vec::new();
            let mut schema = stage.input_schema.clone();
            for (k, op_plan) in stage.operators.iter().enumerate() {
                let mut op = Operator::new(op_plan, &schema, j, p, max_p)?;
                op.open(&schema).await?;
                if let Some(r) = &restored {
                    for state_id in op.state_ids() {
                        for (batch, changes) in r.keyed_batches(&state_id, j, p).await? {
                            op.restore(&state_id, &batch, &r.location.display, changes)?;
                        }
                    }
                }
                if let OperatorKind::Window(WindowPlan { late_records: Some(output), .. }) = &op_plan.kind {
                    let state_id = crate::plan::late_records_id(&op_plan.id);
                    let states = match &restored {
                        Some(r) => r.sink_states_of(&state_id)?,
                        None => Vec::new(),
                    };
                    let keep = if j == 0 { Some(restore::referenced_sink_files(&storage, restored.as_ref(), &state_id).await?) } else { None };
                    let restore = SinkRestore { mine: states_of_subtask(&states, j, p), keep: keep.as_ref(), runs: own_runs.as_ref(), parallelism: p, snapshot_log: None };
                    let sink = SinkWriter::open(&SinkSpec::File(output.clone()), &SinkScope::of(&state_id), &schema, job_id, j, &cluster.run_id, restore, &cfg.base_dir, &storage).await?;
                    late_records.push(LateRecords { operator: k, state_id, sink });
                }
                schema = op_plan.output_schema.clone();
                operators.push(op);
            }
            let output = match &stage.output {
                StageOutput::Sink(sink) => {
                    let opening = sink_openings.get(&stage_index).ok_or_else(|| Error::Job("sink opened twice".into()))?;
                    let restore = SinkRestore {
                        mine: states_of_subtask(&opening.states, j, p),
                        keep: if j == 0 { opening.keep.as_ref() } else { None },
                        runs: if j == 0 { own_runs.as_ref() } else { None },
                        parallelism: p,
                        snapshot_log: restored.as_ref().map(|r| r.location.child(&opening.scope.log_dir())),
                    };
                    let writer = SinkWriter::open(&sink.spec, &opening.scope, &schema, job_id, j, &cluster.run_id, restore, &cfg.base_dir, &storage).await?;
                    let notifications = sink_notifications.remove(&(stage_index, j)).ok_or_else(|| Error::Job("sink notifications taken twice".into()))?;
                    Output::Sink { sink: writer, notifications, state_id: sink.state_id.clone() }
                }
                StageOutput::Edges(_) => Output::Edges(outputs.remove(&(stage_index, j)).ok_or_else(|| Error::Job("outputs taken twice".into()))?),
            };
            let subtask = Subtask {
                stage: stage_index,
                index: j,
                input,
                input_edges: stage.inputs.iter().map(|i| i.edge_id.clone()).collect(),
                operators,
                output,
                to_coordinator: to_coord.clone(),
                storage: storage.clone(),
                counters: counters.clone(),
                at_most_once: at_most_once.then(|| AtMostOnce { flush_every: spec.checkpoint.interval.get() }),
                clock: stage.source.as_ref().and_then(|s| s.event_time.clone()).map(SourceClock::new),
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

/// A lost peer or a closed input is often the echo of this worker's own
/// failure: its subtask failed on a record, its connections closed, the
/// other worker gave up, and that news can arrive before the subtask's own
/// error is seen. A fatal error of one of this worker's subtasks within a
/// moment is the cause and wins, so a deterministic failure is reported as
/// one (exit 3) instead of being restarted; else any error that is not an
/// echo ([`Error::PeerGone`]) wins over one that is (a sink's lost broker
/// over "downstream went away" of the stage feeding it).
async fn prefer_fatal(tasks: &mut JoinSet<Result<()>>, e: Error) -> Error {
    let deadline = tokio::time::sleep(Duration::from_millis(300));
    tokio::pin!(deadline);
    let mut cause = e;
    loop {
        tokio::select! {
            _ = &mut deadline => return cause,
            joined = tasks.join_next() => match joined {
                Some(Ok(Err(fatal))) if fatal.is_fatal() => return fatal,
                Some(Ok(Err(other))) if matches!(cause, Error::PeerGone(_)) && !matches!(other, Error::PeerGone(_)) => cause = other,
                Some(_) => {}
                None => return cause,
            },
        }
    }
}

/// What the subtasks of one sink open with: every old subtask's restored
/// state, what retained snapshots still reference (on the worker of its
/// subtask 0, which cleans up), and the names that keep it apart.
struct SinkOpening {
    states: Vec<(u32, SinkState)>,
    keep: Option<HashSet<String>>,
    scope: SinkScope,
}

/// The restored states subtask `j` takes over at parallelism `p`.
fn states_of_subtask(states: &[(u32, SinkState)], j: u32, p: u32) -> Vec<SinkState> {
    states.iter().filter(|(old, _)| old % p == j).map(|(_, s)| s.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_subtasks_own_error_wins_over_the_echo_of_it_that_came_first() {
        let mut tasks = JoinSet::new();
        tasks.spawn(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Err(Error::Kafka { context: "kafka sink topic out subtask 0".into(), message: "Flush error: OperationTimedOut".into(), fatal: false })
        });
        let echo = Error::PeerGone("stage 0 subtask 0: downstream 0 went away".into());
        let reported = prefer_fatal(&mut tasks, echo).await;
        assert!(matches!(reported, Error::Kafka { .. }), "reported: {reported}");
    }

    #[tokio::test]
    async fn an_error_that_is_no_echo_is_kept_over_a_later_echo() {
        let mut tasks = JoinSet::new();
        tasks.spawn(async { Err(Error::PeerGone("stage 1 subtask 0: input 1 disconnected before its end of stream".into())) });
        let reported = prefer_fatal(&mut tasks, Error::Job("lost the coordinator".into())).await;
        assert_eq!(reported.to_string(), "lost the coordinator");
    }
}
