//! The checkpoint coordinator: one per job run, hosted by worker 0.
//!
//! It injects barrier n into every source subtask (through the workers),
//! collects one acknowledgement per subtask, and completes the checkpoint by
//! writing its metadata last and recording it in the job's lineage; only then,
//! and only if no newer run has claimed the job (the fence, `lineage.rs`),
//! does it tell the workers, whose sinks commit. A superseded run fails with
//! `Error::Fenced` instead. Before a trigger it takes ownership of the
//! snapshot's directory, so no other run ever writes state into it. A checkpoint that is declined or not
//! complete within the timeout is abandoned and the job goes on; the next one
//! gets a new id. Savepoints are checkpoints that are kept: they complete
//! like checkpoints (recorded in the lineage, so a crash after one restores
//! it or a later checkpoint, and sinks commit their output up to it), in a
//! directory of their own that retention never deletes. When every source
//! has ended, a final checkpoint is taken; once it is committed the workers
//! are told to shut down and the job has finished.
//!
//! Savepoints are requested through the control endpoint by request id; their
//! outcomes are kept in the run's [`SavepointBook`], which callers poll. A
//! savepoint that *stops* the job (before an upgrade, a suspension or a
//! deletion, which restore from it or end with it) is the run's last
//! snapshot: sources emit nothing after its barrier, no checkpoint follows
//! it, and it is reported complete only once every worker's sinks have
//! committed it, so that a job stopped and never resumed has published
//! everything it read up to the savepoint and leaves nothing open.
//!
//! A checkpoint of incremental state names shared files of earlier
//! checkpoints. It is completed only if each of them is named by a
//! checkpoint that retention keeps (`retained_shared`), so that no
//! complete checkpoint ever names a file retention deleted.
//!
//! The coordinator holds no job data: losing it fails the run, and the run is
//! restored from the latest completed checkpoint like any other failure.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::lineage::RunClaim;
use super::metadata::{CheckpointMetadata, SnapshotKind, SubtaskAck};
use super::savepoints::SavepointBook;
use super::storage::{CheckpointStorage, SnapshotInfo};
use crate::control::{ApiRequest, CheckpointStatus, SharedStatus};
use crate::error::{Error, Result};
use crate::exchange::Barrier;
use crate::worker::protocol::{framed, heartbeat_interval, heartbeat_timeout, silence, ToCoordinator, ToWorker};

/// The status of the last run that finished, in the job's storage root.
pub const FINAL_STATUS: &str = "finished.json";

pub struct CoordinatorConfig {
    pub job: String,
    pub run_id: String,
    /// What a worker proves it holds in its handshake (`worker::handshake`).
    pub run_key: crate::worker::handshake::RunKey,
    pub parallelism: u32,
    pub max_parallelism: u32,
    pub stages: usize,
    /// How many stages read a source: the final checkpoint comes once
    /// every subtask of each has finished.
    pub source_stages: usize,
    pub workers: usize,
    /// Zero: no periodic checkpoints (savepoints and the final checkpoint still happen).
    pub interval: Duration,
    /// False for an at-most-once job: no snapshot is ever written. Savepoints
    /// are refused, and the final barrier only flushes the sinks.
    pub snapshots: bool,
    pub timeout: Duration,
    pub retain: usize,
    pub storage: CheckpointStorage,
    /// Where savepoint outcomes are recorded for the control endpoint.
    pub savepoints: SavepointBook,
    /// The checkpoint this run restores (worker 0's view); every worker must
    /// restore the same one, or the run would mix states of different moments.
    pub restored_from: Option<String>,
    /// After a stopping savepoint the job ends by itself (`weir run`: nobody
    /// else would stop it). On Kubernetes the operator removes the pods.
    pub end_after_stop: bool,
    /// This run's claim on the job's state (worker 0 claimed it at start).
    pub claim: RunClaim,
}

/// A savepoint request admitted by the control endpoint.
struct Ask {
    request_id: String,
    stop: bool,
}

enum Event {
    Connected { worker: u32, tx: mpsc::UnboundedSender<ToWorker> },
    Message { worker: u32, msg: ToCoordinator },
    Lost { worker: u32, reason: String },
}

struct Pending {
    id: u64,
    kind: SnapshotKind,
    is_final: bool,
    dir: String,
    started: Instant,
    acks: HashMap<(usize, u32), SubtaskAck>,
    /// The savepoint request this snapshot answers.
    request: Option<Ask>,
}

/// A stopping savepoint that completed, waiting for every worker's sinks
/// to commit it before it is reported.
struct StopCommit {
    id: u64,
    ask: Ask,
    status: CheckpointStatus,
    waiting: BTreeSet<u32>,
}

struct Coordinator {
    cfg: CoordinatorConfig,
    status: SharedStatus,
    workers: HashMap<u32, mpsc::UnboundedSender<ToWorker>>,
    ready: BTreeSet<u32>,
    /// Workers whose subtasks are all open (see `ToCoordinator::Running`).
    running: BTreeSet<u32>,
    finished_workers: BTreeSet<u32>,
    started: bool,
    next_id: u64,
    pending: Option<Pending>,
    last_trigger: Instant,
    sources_finished: BTreeSet<(usize, u32)>,
    final_completed: bool,
    final_failed: bool,
    /// Savepoints asked for and not yet triggered, oldest first.
    savepoint_queue: VecDeque<Ask>,
    /// Set once a stopping savepoint completed: no snapshot follows.
    stopped_by: Option<u64>,
    /// The request that stopped the job, so that it can be cancelled.
    stopped_for: Option<String>,
    /// The stopping savepoint whose commits are awaited.
    stop_commit: Option<StopCommit>,
    /// A stopping savepoint was abandoned: its sources wait for the next
    /// barrier to go on, so one is triggered at once.
    resume_sources: bool,
    /// The shared state files each complete checkpoint that retention
    /// keeps names (the newest `retain` ones), by checkpoint id.
    retained_shared: std::collections::BTreeMap<u64, std::collections::HashSet<String>>,
    /// Each worker's (records in, records out, records skipped, records late).
    metrics: HashMap<u32, (u64, u64, u64, u64)>,
    /// Set when a newer run has claimed the job: this run ends with it.
    fenced: Option<Error>,
    /// The lineage records of older runs were deleted (once per run).
    forgot_older_runs: bool,
}

/// Runs the coordinator until the job finishes (Ok) or a worker is lost (Err).
pub async fn run(cfg: CoordinatorConfig, listener: TcpListener, mut api: mpsc::Receiver<ApiRequest>, status: SharedStatus) -> Result<()> {
    // One listing gives both: every snapshot's metadata is read once.
    let snapshots = cfg.storage.list_with_metadata().await?;
    let next_id = crate::checkpoint::storage::next_id_after(snapshots.iter().map(|(info, _)| info));
    let retained_shared = retained_shared_files(&snapshots);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let run_id = cfg.run_id.clone();
    tokio::spawn(accept_workers(listener, run_id, cfg.run_key.clone(), cfg.restored_from.clone(), events_tx));
    let mut c = Coordinator {
        cfg,
        status,
        workers: HashMap::new(),
        ready: BTreeSet::new(),
        running: BTreeSet::new(),
        finished_workers: BTreeSet::new(),
        started: false,
        next_id,
        pending: None,
        last_trigger: Instant::now(),
        sources_finished: BTreeSet::new(),
        final_completed: false,
        final_failed: false,
        savepoint_queue: VecDeque::new(),
        stopped_by: None,
        stopped_for: None,
        stop_commit: None,
        resume_sources: false,
        retained_shared,
        metrics: HashMap::new(),
        fenced: None,
        forgot_older_runs: false,
    };
    c.set_phase("starting");
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ev = events.recv() => {
                let Some(ev) = ev else { return Err(Error::Job("coordinator: control listener stopped".into())) };
                if c.handle(ev).await? {
                    return Ok(());
                }
            }
            req = api.recv() => {
                if let Some(ApiRequest::Cancel { request_id, done }) = req {
                    c.cancel(&request_id).await;
                    let _ = done.send(());
                } else if let Some(ApiRequest::Savepoint { request_id, stop }) = req {
                    if !c.cfg.snapshots {
                        c.cfg.savepoints.fail(
                            &request_id,
                            "the job is at-most-once: it takes no checkpoints or savepoints (stop it and start it again without state; on Kubernetes, upgradeMode: stateless)",
                        );
                    } else if c.final_completed {
                        c.cfg.savepoints.fail(&request_id, "the job has finished; no savepoint can be taken");
                    } else if let Some(id) = c.stopped_by {
                        c.cfg.savepoints.fail(&request_id, format!("the job was stopped with savepoint {id}; it takes no further snapshot"));
                    } else {
                        c.savepoint_queue.push_back(Ask { request_id, stop });
                    }
                }
            }
            _ = tick.tick() => c.on_tick().await,
        }
        if let Some(e) = c.fenced.take() {
            tracing::error!(error = %e, "superseded by a newer run");
            return Err(e);
        }
        if c.final_failed {
            return Err(Error::Job("the final checkpoint failed; the job is restored from its latest completed checkpoint".into()));
        }
    }
}

/// The shared state files of the complete checkpoints in storage, by id:
/// what retention keeps until this run completes checkpoints of its own.
fn retained_shared_files(snapshots: &[(SnapshotInfo, Option<CheckpointMetadata>)]) -> std::collections::BTreeMap<u64, std::collections::HashSet<String>> {
    snapshots
        .iter()
        .filter_map(|(info, meta)| match (info.kind, meta) {
            (SnapshotKind::Checkpoint, Some(meta)) => Some((info.id, shared_files(meta))),
            _ => None,
        })
        .collect()
}

/// The shared state files a checkpoint names.
fn shared_files(meta: &CheckpointMetadata) -> std::collections::HashSet<String> {
    meta.operators.values().flatten().flat_map(|s| s.shared.iter().map(|f| f.name.clone())).collect()
}

async fn accept_workers(listener: TcpListener, run_id: String, run_key: crate::worker::handshake::RunKey, restored_from: Option<String>, events: mpsc::UnboundedSender<Event>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        let events = events.clone();
        let run_id = run_id.clone();
        let run_key = run_key.clone();
        let restored_from = restored_from.clone();
        tokio::spawn(async move {
            let peer = peer.to_string();
            let accepted = crate::worker::handshake::accept(stream, &run_key, &peer).await.and_then(|(link, body)| {
                let hello = serde_json::from_slice::<ToCoordinator>(&body).map_err(|e| Error::Protocol { peer: peer.clone(), message: format!("bad hello: {e}") })?;
                Ok((framed(link), hello))
            });
            let (conn, hello) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "ignoring a connection to the coordinator");
                    return;
                }
            };
            let worker = match hello {
                ToCoordinator::Hello { worker, run_id: r, restored_from: theirs } if r == run_id => {
                    // Workers resolve `--restore latest` each on their own; if the
                    // latest pointer moved in between, they would disagree.
                    if theirs != restored_from {
                        let reason = format!(
                            "it restores from {} but worker 0 from {}; every worker of a run must restore the same checkpoint",
                            theirs.as_deref().unwrap_or("nothing"),
                            restored_from.as_deref().unwrap_or("nothing")
                        );
                        let _ = events.send(Event::Lost { worker, reason });
                        return;
                    }
                    worker
                }
                ToCoordinator::Hello { .. } => {
                    tracing::warn!(%peer, "ignoring a worker of another run of this job");
                    return;
                }
                other => {
                    tracing::warn!(%peer, "ignoring a connection that began with {other:?} instead of a hello");
                    return;
                }
            };
            let (tx, mut rx) = mpsc::unbounded_channel::<ToWorker>();
            let heartbeats = tx.clone();
            let _ = events.send(Event::Connected { worker, tx });
            // Beats from a task of their own: a coordinator busy writing a
            // checkpoint to slow storage is still alive.
            tokio::spawn(async move {
                while heartbeats.send(ToWorker::Heartbeat).is_ok() {
                    tokio::time::sleep(heartbeat_interval()).await;
                }
            });
            use futures::StreamExt;
            let (mut sink, mut stream) = conn.split::<bytes::Bytes>();
            let writer_peer = peer.clone();
            tokio::spawn(async move {
                use futures::SinkExt;
                while let Some(msg) = rx.recv().await {
                    let Ok(bytes) = serde_json::to_vec(&msg) else { continue };
                    if sink.send(bytes::Bytes::from(bytes)).await.is_err() {
                        tracing::debug!(peer = %writer_peer, "control connection closed");
                        break;
                    }
                }
            });
            loop {
                let Ok(next) = tokio::time::timeout(heartbeat_timeout(), stream.next()).await else {
                    let _ = events.send(Event::Lost { worker, reason: silence(worker, &peer.to_string()) });
                    return;
                };
                let msg = match next {
                    Some(Ok(frame)) => match serde_json::from_slice::<ToCoordinator>(&frame) {
                        Ok(m) => m,
                        Err(e) => {
                            let _ = events.send(Event::Lost { worker, reason: format!("bad control message: {e}") });
                            return;
                        }
                    },
                    Some(Err(e)) => {
                        let _ = events.send(Event::Lost { worker, reason: e.to_string() });
                        return;
                    }
                    None => {
                        let _ = events.send(Event::Lost { worker, reason: "connection closed".into() });
                        return;
                    }
                };
                if events.send(Event::Message { worker, msg }).is_err() {
                    return;
                }
            }
        });
    }
}

impl Coordinator {
    fn set_phase(&self, phase: &str) {
        if let Ok(mut s) = self.status.lock() {
            s.phase = phase.into();
        }
    }

    /// The final status outlives the run: `weir run` and `weir status` read
    /// it after the processes are gone.
    async fn write_final_status(&self) {
        let final_status = self.status.lock().map(|s| s.clone()).unwrap_or_default();
        if let Ok(bytes) = serde_json::to_vec_pretty(&final_status) {
            if let Err(e) = self.cfg.storage.job_root.put(FINAL_STATUS, bytes).await {
                tracing::warn!(error = %e, "could not write the final status");
            }
        }
    }

    fn broadcast(&self, msg: ToWorker) {
        for tx in self.workers.values() {
            let _ = tx.send(msg.clone());
        }
    }

    fn subtask_count(&self) -> usize {
        self.cfg.stages * self.cfg.parallelism as usize
    }

    /// Returns true when the job has finished.
    async fn handle(&mut self, ev: Event) -> Result<bool> {
        match ev {
            Event::Connected { worker, tx } => {
                self.workers.insert(worker, tx);
            }
            Event::Lost { worker, reason } => {
                let ended = self.final_completed || (self.cfg.end_after_stop && self.stopped_by.is_some());
                if ended && self.finished_workers.contains(&worker) {
                    return Ok(false);
                }
                return Err(Error::Job(format!("worker {worker} was lost ({reason})")));
            }
            Event::Message { worker, msg } => match msg {
                ToCoordinator::Hello { .. } | ToCoordinator::Heartbeat => {}
                ToCoordinator::Ready => {
                    self.ready.insert(worker);
                    if !self.started && self.ready.len() == self.cfg.workers {
                        self.started = true;
                        self.last_trigger = Instant::now();
                        self.broadcast(ToWorker::Start);
                        self.set_phase("running");
                        tracing::info!(workers = self.cfg.workers, "all workers ready; job running");
                    }
                }
                ToCoordinator::Running => {
                    self.running.insert(worker);
                    if self.running.len() == self.cfg.workers {
                        // The first checkpoint comes an interval after every
                        // subtask is open, not after the start.
                        self.last_trigger = Instant::now();
                        tracing::debug!("every subtask is open; checkpoints may start");
                    }
                }
                ToCoordinator::Ack { checkpoint_id, ack } => {
                    let complete = match &mut self.pending {
                        Some(p) if p.id == checkpoint_id => {
                            p.acks.insert((ack.stage, ack.subtask), ack);
                            p.acks.len() == self.subtask_count()
                        }
                        _ => false,
                    };
                    if complete {
                        self.complete_pending().await;
                    }
                }
                ToCoordinator::Decline { checkpoint_id, reason } => {
                    if self.pending.as_ref().map(|p| p.id) == Some(checkpoint_id) {
                        self.abort_pending(format!("declined by worker {worker}: {reason}")).await;
                    }
                }
                ToCoordinator::SourceFinished { stage, subtask } => {
                    self.sources_finished.insert((stage, subtask));
                }
                ToCoordinator::Committed { checkpoint_id } => self.on_committed(worker, checkpoint_id),
                ToCoordinator::Metrics { records_in, records_out, records_skipped, records_late } => {
                    self.metrics.insert(worker, (records_in, records_out, records_skipped, records_late));
                    let (i, o, k, l) = self.metrics.values().fold((0, 0, 0, 0), |(a, b, c, d), (w, x, y, z)| (a + w, b + x, c + y, d + z));
                    if let Ok(mut s) = self.status.lock() {
                        s.records_in = i;
                        s.records_out = o;
                        s.records_skipped = k;
                        s.records_late = l;
                    }
                }
                ToCoordinator::Finished => {
                    self.finished_workers.insert(worker);
                    let ended = self.final_completed || (self.cfg.end_after_stop && self.stopped_by.is_some());
                    if ended && self.finished_workers.len() == self.cfg.workers {
                        if self.final_completed {
                            self.set_phase("finished");
                        }
                        self.write_final_status().await;
                        self.broadcast(ToWorker::Shutdown);
                        return Ok(true);
                    }
                }
            },
        }
        Ok(false)
    }

    async fn on_tick(&mut self) {
        if !self.started || self.running.len() < self.cfg.workers || self.final_completed || self.stopped_by.is_some() {
            return;
        }
        if let Some(p) = &self.pending {
            if p.started.elapsed() > self.cfg.timeout {
                let msg = format!("not complete after {:?}", self.cfg.timeout);
                self.abort_pending(msg).await;
            }
            return;
        }
        if std::mem::take(&mut self.resume_sources) {
            self.trigger(SnapshotKind::Checkpoint, false, None).await;
        } else if let Some(request) = self.savepoint_queue.pop_front() {
            self.trigger(SnapshotKind::Savepoint, false, Some(request)).await;
        } else if self.sources_finished.len() == self.cfg.source_stages * self.cfg.parallelism as usize {
            self.trigger(SnapshotKind::Checkpoint, true, None).await;
        } else if !self.cfg.interval.is_zero() && self.last_trigger.elapsed() >= self.cfg.interval {
            self.trigger(SnapshotKind::Checkpoint, false, None).await;
        }
    }

    async fn trigger(&mut self, kind: SnapshotKind, is_final: bool, request: Option<Ask>) {
        let id = self.next_id;
        self.next_id += 1;
        if !self.cfg.snapshots {
            // The final barrier of an at-most-once job: no directory, no state.
            tracing::debug!(id, "triggering the final flush");
            self.broadcast(ToWorker::Trigger(Barrier { checkpoint_id: id, savepoint: false, is_final, dir: String::new(), stop: false }));
            self.last_trigger = Instant::now();
            self.set_phase("finishing");
            self.pending = Some(Pending { id, kind, is_final, dir: String::new(), started: Instant::now(), acks: HashMap::new(), request });
            return;
        }
        let dir = match kind {
            SnapshotKind::Checkpoint => CheckpointStorage::checkpoint_dir(id),
            SnapshotKind::Savepoint => CheckpointStorage::savepoint_dir(id),
        };
        // The directory becomes this run's before any barrier names it. If
        // another run owns it, that run is newer (ids are listed after the
        // claim) or abandoned it; either way this id is skipped.
        // Bounded by the checkpoint timeout: the store's client retries for
        // a minute, and meanwhile this loop would hear no worker (seen: a
        // store down for 6 s froze checkpointing without a word).
        let owned = match tokio::time::timeout(self.cfg.timeout, self.cfg.storage.own_dir(&self.cfg.claim, &dir)).await {
            Ok(owned) => owned,
            Err(_) => Err(Error::Job(format!("the store did not answer within the checkpoint timeout ({:?})", self.cfg.timeout))),
        };
        match owned {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(id, dir, "another run owns this snapshot directory; skipping the id");
                if let Err(e @ Error::Fenced { .. }) = self.cfg.storage.check_fence(&self.cfg.claim).await {
                    self.fenced = Some(e);
                }
                if let Some(r) = request {
                    self.savepoint_queue.push_front(r);
                }
                return;
            }
            Err(e) => {
                let reason = format!("could not start it in storage: {e}");
                tracing::warn!(id, %reason, "checkpoint not started; the job goes on");
                self.last_trigger = Instant::now();
                if let Ok(mut s) = self.status.lock() {
                    s.checkpoints_failed += 1;
                    s.last_checkpoint_failure = Some(format!("checkpoint {id}: {reason}"));
                }
                if let Some(ask) = request {
                    self.cfg.savepoints.fail(&ask.request_id, format!("savepoint {id} failed: {reason}"));
                }
                return;
            }
        }
        tracing::debug!(id, ?kind, is_final, "triggering checkpoint");
        let stop = request.as_ref().is_some_and(|r| r.stop);
        self.broadcast(ToWorker::Trigger(Barrier { checkpoint_id: id, savepoint: kind == SnapshotKind::Savepoint, is_final, dir: dir.clone(), stop }));
        self.last_trigger = Instant::now();
        if let Ok(mut s) = self.status.lock() {
            s.checkpoint_in_progress = Some(id);
        }
        if is_final {
            self.set_phase("finishing");
        }
        self.pending = Some(Pending { id, kind, is_final, dir, started: Instant::now(), acks: HashMap::new(), request });
    }

    async fn complete_pending(&mut self) {
        let Some(mut p) = self.pending.take() else { return };
        if !self.cfg.snapshots {
            // Every sink has flushed: the job is done, and nothing is written.
            tracing::info!(id = p.id, "final flush complete");
            self.broadcast(ToWorker::Complete { checkpoint_id: p.id });
            self.final_completed = p.is_final;
            return;
        }
        if let Some(gone) = self.shared_file_not_retained(&p) {
            self.pending = Some(p);
            self.abort_pending(format!("it names the shared state file {gone}, which no retained checkpoint names any more"))
                .await;
            return;
        }
        let mut meta = CheckpointMetadata::new(&self.cfg.job, p.id, p.kind, self.cfg.parallelism, self.cfg.max_parallelism, p.is_final);
        for (_, ack) in p.acks.drain() {
            meta.add(ack);
        }
        let writing = Instant::now();
        let completed = self.cfg.storage.complete(&p.dir, &meta, &self.cfg.claim).await;
        // Not bounded (metadata that lands after an abort would be a
        // complete checkpoint nobody committed), but never silent: a store
        // that stalls the coordinator past the timeout is worth a warning.
        if writing.elapsed() > self.cfg.timeout {
            tracing::warn!(id = p.id, waited_ms = writing.elapsed().as_millis() as u64, "checkpoint metadata waited for storage longer than the checkpoint timeout");
        }
        match completed {
            Ok(location) => {
                crate::fault::crash_point("after-complete", p.id);
                let st = CheckpointStatus {
                    id: p.id,
                    location: location.display,
                    completed_unix_ms: meta.created_unix_ms,
                    duration_ms: p.started.elapsed().as_millis() as u64,
                };
                tracing::info!(id = p.id, kind = ?p.kind, duration_ms = st.duration_ms, location = %st.location, "checkpoint complete");
                if let Ok(mut s) = self.status.lock() {
                    s.checkpoint_in_progress = None;
                    match p.kind {
                        SnapshotKind::Checkpoint => {
                            s.latest_checkpoint = Some(st.clone());
                            s.checkpoints_completed += 1;
                        }
                        SnapshotKind::Savepoint => s.last_savepoint = Some(st.clone()),
                    }
                }
                if p.kind == SnapshotKind::Savepoint && !p.is_final {
                    // A savepoint's output is published like a checkpoint's.
                    // A stopping one's is awaited before it is reported.
                    self.broadcast(ToWorker::Complete { checkpoint_id: p.id });
                }
                if p.kind == SnapshotKind::Checkpoint {
                    self.retain_shared(&meta);
                    let storage = self.cfg.storage.clone();
                    let retain = self.cfg.retain;
                    let claim = self.cfg.claim.clone();
                    let older_runs = !self.forgot_older_runs;
                    self.forgot_older_runs = true;
                    if p.is_final {
                        // The job ends with this checkpoint: retention is done
                        // before the commit, so that the final cleanup of
                        // in-progress files sees what is retained.
                        if let Err(e) = storage.apply_retention(retain).await {
                            tracing::warn!(error = %e, "could not delete old checkpoints");
                        }
                        self.broadcast(ToWorker::Complete { checkpoint_id: p.id });
                    } else {
                        self.broadcast(ToWorker::Complete { checkpoint_id: p.id });
                        tokio::spawn(async move {
                            if let Err(e) = storage.apply_retention(retain).await {
                                tracing::warn!(error = %e, "could not delete old checkpoints");
                            }
                            if let Err(e) = storage.forget_older_records(&claim, older_runs).await {
                                tracing::warn!(error = %e, "could not delete old lineage records");
                            }
                        });
                    }
                }
                if p.is_final {
                    self.final_completed = true;
                    for ask in self.savepoint_queue.drain(..) {
                        self.cfg.savepoints.fail(&ask.request_id, "the job finished before the savepoint could be taken");
                    }
                }
                if let Some(ask) = p.request.take() {
                    if ask.stop {
                        tracing::info!(id = p.id, "stopped with a savepoint: no further checkpoint is taken; waiting for the sinks to commit it");
                        self.stopped_by = Some(p.id);
                        self.stopped_for = Some(ask.request_id.clone());
                        for other in self.savepoint_queue.drain(..) {
                            let reason = format!("the job was stopped with savepoint {} before this one could be taken", p.id);
                            self.cfg.savepoints.fail(&other.request_id, reason);
                        }
                        let waiting = self.workers.keys().copied().collect();
                        self.stop_commit = Some(StopCommit { id: p.id, ask, status: st, waiting });
                    } else {
                        self.cfg.savepoints.complete(&ask.request_id, st);
                    }
                }
            }
            Err(e @ Error::Fenced { .. }) => {
                // Nothing is committed, and the pending files stay pending:
                // the newer run decides about them.
                self.pending = None;
                self.fenced = Some(e);
            }
            Err(e) => {
                self.pending = Some(p);
                self.abort_pending(format!("writing its metadata failed: {e}")).await;
            }
        }
    }

    /// A worker's sinks committed `checkpoint_id`: once every worker's have
    /// committed a stopping savepoint, it is reported complete (and a local
    /// job ends).
    fn on_committed(&mut self, worker: u32, checkpoint_id: u64) {
        let Some(sc) = &mut self.stop_commit else { return };
        if sc.id != checkpoint_id {
            return;
        }
        sc.waiting.remove(&worker);
        if !sc.waiting.is_empty() {
            return;
        }
        let Some(StopCommit { id, ask, status, .. }) = self.stop_commit.take() else { return };
        tracing::info!(id, "every sink committed the stopping savepoint");
        self.cfg.savepoints.complete(&ask.request_id, status);
        if self.cfg.end_after_stop {
            // Every worker answers Finished; then all shut down together.
            self.set_phase("stopped");
            self.broadcast(ToWorker::Stopped { savepoint_id: id });
        }
    }

    /// The requester no longer wants the job stopped for `request_id`: a
    /// queued savepoint is dropped and an unfinished one abandoned (both
    /// reported failed); a stopping savepoint that already completed stays
    /// a usable savepoint (reported completed), and the job goes on. In
    /// every case a job stopped for it resumes checkpointing, its sources
    /// released by the next barrier, triggered at once. A job that already
    /// ended locally (`end_after_stop`) cannot be resumed here.
    async fn cancel(&mut self, request_id: &str) {
        const WHY: &str = "cancelled by its requester; the job goes on";
        if let Some(pos) = self.savepoint_queue.iter().position(|a| a.request_id == request_id) {
            self.savepoint_queue.remove(pos);
            self.cfg.savepoints.fail(request_id, WHY);
        } else if self.pending.as_ref().and_then(|p| p.request.as_ref()).is_some_and(|a| a.request_id == request_id) {
            self.abort_pending(WHY.into()).await;
        } else if self.stopped_for.as_deref() == Some(request_id) && (self.stop_commit.is_some() || !self.cfg.end_after_stop) {
            if let Some(sc) = self.stop_commit.take() {
                // Its sinks commit it whatever happens; the savepoint is usable.
                self.cfg.savepoints.complete(&sc.ask.request_id, sc.status);
            }
            tracing::info!(id = ?self.stopped_by, "the stop was cancelled; the job goes on");
            self.stopped_by = None;
            self.stopped_for = None;
            self.resume_sources = true;
            self.set_phase("running");
        }
    }

    /// A shared state file the pending checkpoint names that it did not
    /// write and no retained checkpoint names: retention deleted it, or
    /// will, so the checkpoint would not restore. (A subtask builds on the
    /// chain of the newest completion it heard of, which retention may have
    /// retired meanwhile.)
    fn shared_file_not_retained(&self, p: &Pending) -> Option<String> {
        let own = |name: &str| crate::checkpoint::storage::shared_file_checkpoint(name) == Some(p.id);
        p.acks
            .values()
            .flat_map(|ack| ack.operators.iter().flat_map(|(_, s)| s.shared.iter()))
            .map(|f| &f.name)
            .find(|name| !own(name) && !self.retained_shared.values().any(|names| names.contains(*name)))
            .cloned()
    }

    /// Mirrors retention: it keeps the newest `retain` complete checkpoints.
    fn retain_shared(&mut self, meta: &CheckpointMetadata) {
        self.retained_shared.insert(meta.checkpoint_id, shared_files(meta));
        while self.retained_shared.len() > self.cfg.retain.max(1) {
            self.retained_shared.pop_first();
        }
    }

    async fn abort_pending(&mut self, reason: String) {
        let Some(mut p) = self.pending.take() else { return };
        tracing::warn!(id = p.id, %reason, "checkpoint abandoned; the job goes on");
        self.broadcast(ToWorker::Abort { checkpoint_id: p.id });
        if let Ok(mut s) = self.status.lock() {
            s.checkpoint_in_progress = None;
            s.checkpoints_failed += 1;
            s.last_checkpoint_failure = Some(format!("checkpoint {}: {reason}", p.id));
        }
        if let Some(ask) = p.request.take() {
            self.cfg.savepoints.fail(&ask.request_id, format!("savepoint {} failed: {reason}", p.id));
            // Its sources stopped at its barrier and wait for the next one.
            self.resume_sources = ask.stop;
        }
        // The owner record stays, so that no later run reuses the id while a
        // straggling state write of this one may still land in it. (An
        // at-most-once flush has no directory: `dir("")` is the job's root.)
        if self.cfg.snapshots {
            let dir = self.cfg.storage.dir(&p.dir);
            tokio::spawn(async move {
                let _ = dir.delete_all_but(Some("_owner")).await;
            });
        }
        if p.is_final {
            // Sources have already ended after the final barrier; the run
            // cannot take another one. Failing makes the supervisor restore
            // it from the latest completed checkpoint.
            self.final_failed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::JobStatus;
    use crate::worker::protocol::{join_coordinator, recv, send, ControlStream};
    use std::sync::{Arc, Mutex};

    /// Joins the coordinator as a worker of run `r` with the token `token`.
    async fn join(addr: std::net::SocketAddr, hello: ToCoordinator) -> ControlStream {
        let key = crate::worker::handshake::run_key("token", "r");
        join_coordinator(addr, &key, &hello, Duration::from_secs(5)).await.unwrap()
    }

    /// The next message to the worker that is not a heartbeat.
    async fn recv_skipping_heartbeats(conn: &mut crate::worker::protocol::ControlStream) -> Result<Option<ToWorker>> {
        loop {
            match recv::<ToWorker>(conn, "c").await? {
                Some(ToWorker::Heartbeat) => continue,
                other => return Ok(other),
            }
        }
    }

    /// Plays one worker hosting the only subtask, against a real coordinator.
    #[tokio::test]
    async fn a_checkpoint_that_times_out_is_abandoned_and_the_next_one_completes() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let claim = storage.claim_run("r").await.unwrap();
        let cfg = CoordinatorConfig {
            job: "job".into(),
            run_id: "r".into(),
            run_key: crate::worker::handshake::run_key("token", "r"),
            parallelism: 1,
            max_parallelism: 8,
            stages: 1,
            source_stages: 1,
            workers: 1,
            interval: Duration::from_millis(50),
            snapshots: true,
            timeout: Duration::from_millis(200),
            retain: 3,
            storage: storage.clone(),
            savepoints: SavepointBook::default(),
            restored_from: None,
            end_after_stop: false,
            claim: claim.clone(),
        };
        let status = Arc::new(Mutex::new(JobStatus::default()));
        let (_api_tx, api_rx) = mpsc::channel(1);
        let coordinator = tokio::spawn(run(cfg, listener, api_rx, status.clone()));

        let mut conn = join(addr, ToCoordinator::Hello { worker: 0, run_id: "r".into(), restored_from: None }).await;
        send(&mut conn, &ToCoordinator::Ready, "c").await.unwrap();
        assert!(matches!(recv_skipping_heartbeats(&mut conn).await.unwrap(), Some(ToWorker::Start)));
        send(&mut conn, &ToCoordinator::Running, "c").await.unwrap();
        let Some(ToWorker::Trigger(first)) = recv_skipping_heartbeats(&mut conn).await.unwrap() else { panic!("no trigger") };
        // No acknowledgement: the checkpoint must be abandoned, not waited for forever.
        let abandoned = recv_skipping_heartbeats(&mut conn).await.unwrap();
        assert!(matches!(abandoned, Some(ToWorker::Abort { checkpoint_id }) if checkpoint_id == first.checkpoint_id), "{abandoned:?}");
        let Some(ToWorker::Trigger(second)) = recv_skipping_heartbeats(&mut conn).await.unwrap() else { panic!("no second trigger") };
        assert!(second.checkpoint_id > first.checkpoint_id);
        let ack = SubtaskAck { stage: 0, subtask: 0, operators: vec![] };
        send(&mut conn, &ToCoordinator::Ack { checkpoint_id: second.checkpoint_id, ack }, "c").await.unwrap();
        let done = recv_skipping_heartbeats(&mut conn).await.unwrap();
        assert!(matches!(done, Some(ToWorker::Complete { checkpoint_id }) if checkpoint_id == second.checkpoint_id), "{done:?}");
        let latest = storage.latest().await.unwrap().unwrap();
        assert_eq!(latest.read_metadata().await.unwrap().checkpoint_id, second.checkpoint_id);
        {
            let st = status.lock().unwrap();
            assert_eq!(st.checkpoints_failed, 1);
            assert_eq!(st.checkpoints_completed, 1);
            assert!(st.last_checkpoint_failure.as_deref().unwrap_or("").contains("not complete after"));
        }
        // Losing the worker ends the run with an error the supervisor acts on.
        drop(conn);
        let result = tokio::time::timeout(Duration::from_secs(5), coordinator).await.unwrap().unwrap();
        assert!(result.unwrap_err().to_string().contains("worker 0 was lost"));
    }

    #[tokio::test]
    async fn a_worker_restoring_another_checkpoint_than_worker_0_fails_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let claim = storage.claim_run("r").await.unwrap();
        let cfg = CoordinatorConfig {
            job: "job".into(),
            run_id: "r".into(),
            run_key: crate::worker::handshake::run_key("token", "r"),
            parallelism: 2,
            max_parallelism: 8,
            stages: 1,
            source_stages: 1,
            workers: 2,
            interval: Duration::ZERO,
            snapshots: true,
            timeout: Duration::from_secs(5),
            retain: 3,
            storage,
            savepoints: SavepointBook::default(),
            restored_from: Some("/s/job/checkpoints/chk-4".into()),
            end_after_stop: false,
            claim: claim.clone(),
        };
        let (_api_tx, api_rx) = mpsc::channel(1);
        let coordinator = tokio::spawn(run(cfg, listener, api_rx, Arc::new(Mutex::new(JobStatus::default()))));
        let hello = ToCoordinator::Hello { worker: 1, run_id: "r".into(), restored_from: Some("/s/job/checkpoints/chk-5".into()) };
        let _conn = join(addr, hello).await;
        let result = tokio::time::timeout(Duration::from_secs(5), coordinator).await.unwrap().unwrap();
        let e = result.unwrap_err().to_string();
        assert!(e.contains("chk-5") && e.contains("chk-4") && e.contains("must restore the same checkpoint"), "{e}");
    }

    #[tokio::test]
    async fn a_stopping_savepoint_is_committed_reported_once_committed_and_followed_by_no_checkpoint_until_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        let storage = CheckpointStorage::open(dir.path().to_str().unwrap(), "job", true).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let book = SavepointBook::default();
        let claim = storage.claim_run("r").await.unwrap();
        let cfg = CoordinatorConfig {
            job: "job".into(),
            run_id: "r".into(),
            run_key: crate::worker::handshake::run_key("token", "r"),
            parallelism: 1,
            max_parallelism: 8,
            stages: 1,
            source_stages: 1,
            workers: 1,
            interval: Duration::from_millis(30),
            snapshots: true,
            timeout: Duration::from_secs(5),
            retain: 3,
            storage: storage.clone(),
            savepoints: book.clone(),
            restored_from: None,
            end_after_stop: false,
            claim: claim.clone(),
        };
        let storage_for_test = storage;
        let (api_tx, api_rx) = mpsc::channel(4);
        let _coordinator = tokio::spawn(run(cfg, listener, api_rx, Arc::new(Mutex::new(JobStatus::default()))));
        let mut conn = join(addr, ToCoordinator::Hello { worker: 0, run_id: "r".into(), restored_from: None }).await;
        send(&mut conn, &ToCoordinator::Ready, "c").await.unwrap();
        assert!(matches!(recv_skipping_heartbeats(&mut conn).await.unwrap(), Some(ToWorker::Start)));
        send(&mut conn, &ToCoordinator::Running, "c").await.unwrap();
        assert!(matches!(book.admit("stop-1"), crate::checkpoint::savepoints::Admission::New(_)));
        api_tx.send(ApiRequest::Savepoint { request_id: "stop-1".into(), stop: true }).await.unwrap();
        // Acknowledge every snapshot (periodic checkpoints may come first) until the savepoint.
        let savepoint = loop {
            match recv_skipping_heartbeats(&mut conn).await.unwrap() {
                Some(ToWorker::Trigger(b)) => {
                    let ack = SubtaskAck { stage: 0, subtask: 0, operators: vec![] };
                    send(&mut conn, &ToCoordinator::Ack { checkpoint_id: b.checkpoint_id, ack }, "c").await.unwrap();
                    if b.savepoint {
                        assert!(b.stop, "a stopping savepoint's barrier says so: the sources stop at it");
                        break b.checkpoint_id;
                    }
                }
                Some(ToWorker::Complete { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        };
        // The savepoint completes like a checkpoint: its sinks are told to commit.
        loop {
            match recv_skipping_heartbeats(&mut conn).await.unwrap() {
                Some(ToWorker::Complete { checkpoint_id }) if checkpoint_id == savepoint => break,
                Some(ToWorker::Complete { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        // Many intervals pass without another trigger, and the savepoint is
        // not reported before the worker says its sinks committed it.
        let quiet = tokio::time::timeout(Duration::from_millis(300), recv_skipping_heartbeats(&mut conn)).await;
        assert!(quiet.is_err(), "a message after the stopping savepoint's completion: {quiet:?}");
        assert_eq!(book.get("stop-1").map(|o| o.state), Some(weir_api::control::SavepointState::Pending));
        send(&mut conn, &ToCoordinator::Committed { checkpoint_id: savepoint }, "c").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(book.get("stop-1").map(|o| o.state), Some(weir_api::control::SavepointState::Completed));
        let lineage = storage_for_test.latest().await.unwrap().expect("the savepoint is in the lineage");
        assert!(lineage.display.contains("savepoints/sp-"), "{}", lineage.display);
        assert!(matches!(book.admit("later"), crate::checkpoint::savepoints::Admission::New(_)));
        api_tx.send(ApiRequest::Savepoint { request_id: "later".into(), stop: false }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let later = book.get("later").unwrap();
        assert_eq!(later.state, weir_api::control::SavepointState::Failed);
        assert!(later.error.unwrap().contains("stopped with savepoint"));

        // The requester gives up on the stop (an operator whose user set
        // spec.state back to running): the job takes checkpoints again and
        // the savepoint stays usable.
        let (done, answered) = tokio::sync::oneshot::channel();
        api_tx.send(ApiRequest::Cancel { request_id: "stop-1".into(), done }).await.unwrap();
        answered.await.unwrap();
        assert_eq!(book.get("stop-1").map(|o| o.state), Some(weir_api::control::SavepointState::Completed));
        let next = tokio::time::timeout(Duration::from_secs(5), recv_skipping_heartbeats(&mut conn)).await.expect("a checkpoint after the cancelled stop");
        assert!(matches!(next, Ok(Some(ToWorker::Trigger(ref b))) if !b.savepoint && b.checkpoint_id > savepoint), "{next:?}");
    }
}
