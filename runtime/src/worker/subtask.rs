//! One subtask: its input (a source, or an input gate over upstream
//! channels), its chained operators, and its output (edges into other
//! stages, or the sink), driven by one loop.
//!
//! At an aligned barrier the subtask copies its operators' state (the only
//! synchronous part), pre-commits its sink, forwards the barrier downstream,
//! and writes the state out in a separate task that acknowledges the
//! checkpoint to the coordinator when done; records keep flowing meanwhile.
//!
//! At-most-once ([`AtMostOnce`]) changes three things: a source records its
//! read marks before it emits (`read_marks.rs`), a barrier carries no state
//! (there is only the final one, which flushes the sink), and the sink
//! publishes what it has every flush interval, on its own.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::SchemaRef;
use tokio::sync::{broadcast, mpsc};

use super::gate::{GateEvent, InFlight, InputGate};
use super::protocol::ToCoordinator;
use super::read_marks::ReadMarks;
pub use super::snapshot::Incremental;
use super::snapshot::{Changes, Chains, SnapshotWrite};
use crate::checkpoint::{CheckpointStorage, OperatorSubtaskState, SubtaskAck};
use crate::error::{Error, Result};
use crate::exchange::partition::Partitioner;
use crate::exchange::{Barrier, Message};
use crate::operator::Operator;
use crate::plan::EventTimePlan;
use crate::sink::SinkWriter;
use crate::source::{Poll, RowSplits, SourceReader};

#[derive(Default)]
pub struct Counters {
    pub records_in: AtomicU64,
    pub records_out: AtomicU64,
    /// Input records a source left out under its bad-line policy.
    pub records_skipped: AtomicU64,
    /// Records windows dropped as late.
    pub records_late: AtomicU64,
}

/// A source subtask's event-time watermark, per split: each split's
/// largest event time read, less the allowed out-of-orderness, less 1 ms;
/// the subtask's is the smallest over the splits being read (a split with
/// nothing read yet holds it back; one silent for `idle_timeout` does not).
/// Per split, because a subtask reads its splits side by side and one may
/// lag: with one watermark for all, the lagging split's records would be
/// late, and after a restore the lag can differ from before.
pub struct SourceClock {
    plan: EventTimePlan,
    /// Split → (largest event time read, when it last gave a record).
    splits: std::collections::HashMap<String, (Option<i64>, tokio::time::Instant)>,
    emitted: Option<i64>,
    started: tokio::time::Instant,
    last_read: tokio::time::Instant,
    idle: bool,
}

impl SourceClock {
    pub fn new(plan: EventTimePlan) -> SourceClock {
        let now = tokio::time::Instant::now();
        SourceClock { plan, splits: Default::default(), emitted: None, started: now, last_read: now, idle: false }
    }

    fn saw(&mut self, split: &str, time: i64, now: tokio::time::Instant) {
        let entry = self.splits.entry(split.to_string()).or_insert((None, now));
        entry.0 = Some(entry.0.map_or(time, |m| m.max(time)));
        entry.1 = now;
    }

    /// The watermark after `batch` (whose rows came from `origin`), when it
    /// grew, or when the source was idle until now.
    fn after(&mut self, batch: &RecordBatch, origin: RowSplits, active: &[String]) -> Option<i64> {
        let now = tokio::time::Instant::now();
        self.last_read = now;
        let times = batch.column(self.plan.column).as_primitive_opt::<arrow::datatypes::Int64Type>()?.clone();
        match origin {
            RowSplits::All(split) => {
                if let Some(max) = arrow::compute::max(&times) {
                    self.saw(&split, max, now);
                }
            }
            RowSplits::Each(each) => {
                for (r, split) in each.iter().enumerate().take(times.len()) {
                    if !times.is_null(r) {
                        self.saw(split, times.value(r), now);
                    }
                }
            }
        }
        let watermark = self.watermark(active)?;
        if self.emitted.is_some_and(|e| e >= watermark) && !self.idle {
            return None;
        }
        self.idle = false;
        self.emitted = Some(self.emitted.map_or(watermark, |e| e.max(watermark)));
        self.emitted
    }

    /// The smallest over the active, non-idle splits; with none of those,
    /// the largest time read at all (nothing being read holds anything back).
    fn watermark(&self, active: &[String]) -> Option<i64> {
        let mut smallest: Option<i64> = None;
        for split in active {
            let (max, seen) = self.splits.get(split).copied().unwrap_or((None, self.started));
            if self.plan.idle_timeout.is_some_and(|t| seen.elapsed() >= t) {
                continue;
            }
            let max = max?;
            smallest = Some(smallest.map_or(max, |s| s.min(max)));
        }
        let base = match smallest {
            Some(s) => s,
            None => self.splits.values().filter_map(|(m, _)| *m).max()?,
        };
        Some(base.saturating_sub(self.plan.max_out_of_orderness_ms).saturating_sub(1))
    }

    /// Whether the source just became idle (nothing read for `idle_timeout`).
    fn became_idle(&mut self) -> bool {
        let Some(timeout) = self.plan.idle_timeout else { return false };
        if self.idle || self.last_read.elapsed() < timeout {
            return false;
        }
        self.idle = true;
        true
    }
}

/// What the coordinator tells sinks.
#[derive(Debug, Clone)]
pub enum Notification {
    Complete(u64),
    Abort(u64),
}

pub enum Input {
    /// `ahead` is set under at-most-once: batches read, marked, not yet emitted.
    /// `state_id`: where checkpoints keep the source's positions.
    Source { reader: SourceReader, triggers: mpsc::UnboundedReceiver<Barrier>, ahead: Option<ReadAhead>, state_id: String },
    /// The schema, when the gate merges inputs whose fields differ in
    /// whether they may be null: batches are relabelled to the stage's.
    Gate(InputGate, Option<SchemaRef>),
}

/// A source subtask's batches read ahead of what it emitted, under
/// at-most-once: the read marks already cover them.
pub struct ReadAhead {
    marks: ReadMarks,
    batches: VecDeque<RecordBatch>,
    finished: bool,
}

impl ReadAhead {
    /// Batches read before their marks are written: one write per this
    /// many batches, and at most this many lost with a failed source.
    const BATCHES: usize = 16;

    pub fn new(marks: ReadMarks) -> ReadAhead {
        ReadAhead { marks, batches: VecDeque::new(), finished: false }
    }
}

/// How an at-most-once subtask works without checkpoints.
#[derive(Clone, Copy)]
pub struct AtMostOnce {
    /// How often a sink publishes what it has written.
    pub flush_every: Duration,
}

pub enum Output {
    /// Into the stages that read this one, one entry per edge.
    Edges(Vec<EdgeOut>),
    /// `state_id`: where checkpoints keep the sink's pending output.
    Sink { sink: SinkWriter, notifications: broadcast::Receiver<Notification>, state_id: String },
}

/// One edge out of a subtask: how records are routed and the channels to
/// the downstream subtasks it reaches (one for a forward edge, every
/// downstream subtask's otherwise).
pub struct EdgeOut {
    pub route: Route,
    pub senders: Vec<mpsc::Sender<Message>>,
}

pub enum Route {
    Forward,
    Hash(Partitioner),
    Broadcast,
}

impl Output {
    /// Every channel downstream: barriers, watermarks and the end go to
    /// each, whatever the edge.
    fn senders(&self) -> impl Iterator<Item = &mpsc::Sender<Message>> {
        let edges = match self {
            Output::Edges(edges) => edges.as_slice(),
            Output::Sink { .. } => &[],
        };
        edges.iter().flat_map(|e| e.senders.iter())
    }
}

/// A window's side output of late records: a file output written like the
/// sink's, pre-committed at each barrier and committed when the checkpoint
/// completes, its pending files kept in checkpoints under `state_id`.
pub struct LateRecords {
    /// The window's position among the subtask's operators.
    pub operator: usize,
    pub state_id: String,
    pub sink: SinkWriter,
}

pub struct Subtask {
    pub stage: usize,
    pub index: u32,
    pub input: Input,
    /// The edge id of each input (none for a source): an unaligned
    /// snapshot's records in flight are labelled with it.
    pub input_edges: Vec<String>,
    pub operators: Vec<Operator>,
    pub output: Output,
    pub to_coordinator: mpsc::UnboundedSender<ToCoordinator>,
    pub storage: CheckpointStorage,
    pub counters: Arc<Counters>,
    /// Set when the job is at-most-once.
    pub at_most_once: Option<AtMostOnce>,
    /// Set for a source subtask of a job with event time.
    pub clock: Option<SourceClock>,
    /// Set when checkpoints are incremental.
    pub incremental: Option<Incremental>,
    /// The late-records outputs of the subtask's windows.
    pub late_records: Vec<LateRecords>,
    /// Completed checkpoints, for a subtask that is not a sink subtask (a
    /// sink subtask hears of them on its output) but writes late records or
    /// keeps incremental chains.
    pub notifications: Option<broadcast::Receiver<Notification>>,
    /// The newest checkpoint this subtask committed (`u64::MAX` once it is
    /// clear that it commits nothing), for the worker to report a stopping
    /// savepoint committed.
    pub committed: tokio::sync::watch::Sender<u64>,
}

enum Event {
    /// A batch of the stage's input `.0` (always 0 for a source).
    Batch(usize, RecordBatch),
    /// A sink commit that was in flight is done.
    SinkCommitted,
    Barrier(Barrier),
    End,
    Notification(Notification),
    SourceFinished,
    /// A rate-limited source may emit again.
    Idle,
    /// At-most-once: time for the sink to publish.
    Flush,
    /// The inputs' watermark grew.
    Watermark(i64),
    /// Every input is idle.
    InputIdle,
    /// Snapshot now; the records in flight come on the receiver.
    UnalignedBarrier(Barrier, tokio::sync::oneshot::Receiver<InFlight>),
}

impl Subtask {
    fn name(&self) -> String {
        format!("stage {} subtask {}", self.stage, self.index)
    }

    /// Whether the subtask commits output when checkpoints complete, and so
    /// must see the final one complete before it ends.
    fn commits(&self) -> bool {
        matches!(self.output, Output::Sink { .. }) || !self.late_records.is_empty()
    }

    pub async fn run(mut self) -> Result<()> {
        if !self.commits() {
            self.committed.send_replace(u64::MAX);
        }
        let mut source_done = false;
        // A source stops at a stopping savepoint's barrier and emits nothing
        // until the next barrier, which comes only if it was abandoned.
        let mut paused = false;
        let mut final_barrier: Option<u64> = None;
        let mut input_ended = false;
        // The highest checkpoint this sink has committed: the final
        // checkpoint's completion may reach it before the end of its input.
        let mut committed: Option<u64> = None;
        // The newest completed checkpoint whose sink commit is in flight.
        let mut committing: Option<u64> = None;
        // At-most-once sinks publish on their own: flushes are numbered
        // here, never by the coordinator.
        let mut flushes = 0u64;
        let mut flush_at = self.at_most_once.map(|a| tokio::time::Instant::now() + a.flush_every);
        loop {
            let ev = self.next_event(&mut source_done, paused, input_ended, flush_at).await?;
            match ev {
                Event::Batch(input, b) => {
                    let watermark = match (&mut self.clock, &self.input) {
                        (Some(c), Input::Source { reader, .. }) => c.after(&b, reader.last_batch_splits(), &reader.active_splits()),
                        _ => None,
                    };
                    self.process(input, b).await?;
                    if let Some(w) = watermark {
                        self.on_watermark(w).await?;
                    }
                }
                Event::Idle => {
                    if self.clock.as_mut().is_some_and(|c| c.became_idle()) {
                        self.forward(|| Message::Idle).await?;
                    }
                }
                Event::Watermark(w) => self.on_watermark(w).await?,
                Event::InputIdle => self.forward(|| Message::Idle).await?,
                Event::Flush => {
                    self.flush_sink(&mut flushes).await?;
                    flush_at = self.at_most_once.map(|a| tokio::time::Instant::now() + a.flush_every);
                }
                Event::SourceFinished => {
                    // The end of the input is the end of time: every window
                    // fires before the final barrier, so its results are in
                    // the final checkpoint.
                    if self.clock.is_some() {
                        self.on_watermark(i64::MAX).await?;
                    }
                    let _ = self.to_coordinator.send(ToCoordinator::SourceFinished { stage: self.stage, subtask: self.index });
                }
                Event::Barrier(b) => {
                    let is_final = b.is_final;
                    let id = b.checkpoint_id;
                    paused = b.stop && matches!(self.input, Input::Source { .. });
                    if self.at_most_once.is_some() {
                        self.on_flush_barrier(b, &mut flushes).await?;
                    } else {
                        self.on_barrier(b, None).await?;
                    }
                    if is_final {
                        final_barrier = Some(id);
                        if let Input::Source { .. } = self.input {
                            self.end().await?;
                            input_ended = true;
                        }
                    }
                }
                Event::UnalignedBarrier(b, in_flight) => {
                    self.on_barrier(b, Some(in_flight)).await?
                }
                Event::End => {
                    self.end().await?;
                    input_ended = true;
                    if final_barrier.is_some_and(|f| committed.is_some_and(|c| f <= c)) {
                        return Ok(());
                    }
                }
                Event::Notification(n) => {
                    if let Some(inc) = &self.incremental {
                        inc.on_notification(&n);
                    }
                    if let Notification::Complete(id) = n {
                        let mut in_flight = false;
                        // At-most-once sinks published at the barrier already.
                        if self.at_most_once.is_none() {
                            crate::fault::crash_point("before-commit", id);
                            for late in &mut self.late_records {
                                late.sink.commit(id).await?;
                            }
                            if let Output::Sink { sink, .. } = &mut self.output {
                                in_flight = sink.start_commit(id).await?;
                                if !in_flight {
                                    crate::fault::crash_point("after-sink-commit", id);
                                }
                            }
                        }
                        // A commit still in flight is reported once done
                        // (Event::SinkCommitted): only then is the output
                        // published, and may a stop or the end be reported.
                        if in_flight {
                            committing = Some(id);
                        } else if self.on_committed(id, &mut committed, input_ended, final_barrier) {
                            return Ok(());
                        }
                    }
                }
                Event::SinkCommitted => {
                    if let Output::Sink { sink, .. } = &mut self.output {
                        sink.after_committed().await?;
                    }
                    let still = matches!(&self.output, Output::Sink { sink, .. } if sink.commits_in_flight());
                    if let (false, Some(id)) = (still, committing) {
                        committing = None;
                        if self.on_committed(id, &mut committed, input_ended, final_barrier) {
                            return Ok(());
                        }
                    }
                }
            }
            if input_ended && !self.commits() {
                return Ok(());
            }
        }
    }

    /// Everything up to checkpoint `id` is published: records it, and for
    /// the worker (a stopping savepoint is reported once every subtask
    /// has committed it). Whether the subtask is done.
    fn on_committed(&mut self, id: u64, committed: &mut Option<u64>, input_ended: bool, final_barrier: Option<u64>) -> bool {
        *committed = (*committed).max(Some(id));
        if self.commits() {
            self.committed.send_if_modified(|c| {
                let newer = id > *c;
                *c = (*c).max(id);
                newer
            });
        }
        input_ended && final_barrier.is_some_and(|f| f <= id)
    }

    async fn next_event(&mut self, source_done: &mut bool, paused: bool, input_ended: bool, flush_at: Option<tokio::time::Instant>) -> Result<Event> {
        let (notifications, sink) = match &mut self.output {
            Output::Sink { notifications, sink, .. } => (Some(notifications), Some(sink)),
            _ => (self.notifications.as_mut(), None),
        };
        let sink_committed = async {
            match sink {
                Some(sink) if sink.commits_in_flight() => sink.next_committed().await.map(|_| Event::SinkCommitted),
                _ => std::future::pending().await,
            }
        };
        let input = &mut self.input;
        let counters = &self.counters;
        let input_next = async {
            if input_ended {
                return std::future::pending::<Result<Event>>().await;
            }
            match input {
                Input::Gate(g, schema) => Ok(match g.next().await? {
                    // A union's inputs share one schema; a join reads each
                    // of its own (and is told which input a batch is of).
                    GateEvent::Batch(input, b) => match schema {
                        Some(schema) => Event::Batch(
                            input,
                            RecordBatch::try_new(schema.clone(), b.columns().to_vec())
                                .map_err(|e| Error::Job(format!("a union's input does not fit its schema: {e}")))?,
                        ),
                        None => Event::Batch(input, b),
                    },
                    GateEvent::Barrier(b) => Event::Barrier(b),
                    GateEvent::UnalignedBarrier(b, in_flight) => {
                        Event::UnalignedBarrier(b, in_flight)
                    }
                    GateEvent::End => Event::End,
                    GateEvent::Watermark(w) => Event::Watermark(w),
                    GateEvent::Idle => Event::InputIdle,
                }),
                Input::Source { reader, triggers, ahead, .. } => {
                    if let Ok(b) = triggers.try_recv() {
                        return Ok(Event::Barrier(b));
                    }
                    let lost = || Error::Job("the coordinator went away".into());
                    if *source_done || paused {
                        return triggers.recv().await.map(Event::Barrier).ok_or_else(lost);
                    }
                    if let Some(ahead) = ahead {
                        let wait = match read_ahead(reader, ahead, counters).await? {
                            Poll::Batch(b) => return Ok(Event::Batch(0, b)),
                            Poll::Finished => {
                                *source_done = true;
                                return Ok(Event::SourceFinished);
                            }
                            Poll::Wait(d) => d,
                        };
                        return tokio::select! {
                            t = triggers.recv() => t.map(Event::Barrier).ok_or_else(lost),
                            _ = tokio::time::sleep(wait) => Ok(Event::Idle),
                        };
                    }
                    let polled = reader.poll();
                    counters.records_skipped.fetch_add(reader.take_skipped(), Ordering::Relaxed);
                    match polled? {
                        Poll::Batch(b) => Ok(Event::Batch(0, b)),
                        Poll::Finished => {
                            *source_done = true;
                            Ok(Event::SourceFinished)
                        }
                        Poll::Wait(d) => tokio::select! {
                            t = triggers.recv() => t.map(Event::Barrier).ok_or_else(lost),
                            _ = tokio::time::sleep(d) => Ok(Event::Idle),
                        },
                    }
                }
            }
        };
        let flush = async {
            match flush_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        match notifications {
            None => input_next.await,
            Some(rx) => tokio::select! {
                biased;
                _ = flush => Ok(Event::Flush),
                n = rx.recv() => match n {
                    Ok(n) => Ok(Event::Notification(n)),
                    // A lagged receiver missed some notifications; a later
                    // Complete commits everything up to its id anyway.
                    Err(broadcast::error::RecvError::Lagged(_)) => Ok(Event::Notification(Notification::Abort(0))),
                    Err(broadcast::error::RecvError::Closed) => Err(Error::Job("the coordinator went away".into())),
                },
                c = sink_committed => c,
                ev = input_next => ev,
            },
        }
    }

    async fn process(&mut self, input: usize, batch: RecordBatch) -> Result<()> {
        if let Input::Source { .. } = self.input {
            self.counters.records_in.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
        }
        if let (Output::Sink { .. }, Some(d)) = (&self.output, crate::fault::slow_sink()) {
            tokio::time::sleep(d).await;
        }
        if let Some(d) = crate::fault::slow_stage(self.stage) {
            tokio::time::sleep(d).await;
        }
        self.emit_from(0, input, batch).await
    }

    /// Runs `batch` through the operators from `first` on, then out; the
    /// first of them hears which stage input `input` it came from.
    async fn emit_from(&mut self, first: usize, input: usize, batch: RecordBatch) -> Result<()> {
        let mut current = Some(batch);
        for (k, op) in self.operators[first..].iter_mut().enumerate() {
            let Some(b) = current.take() else { break };
            current = op.process_async(if k == 0 { input } else { 0 }, b).await?;
        }
        let late: u64 = self.operators.iter_mut().map(|op| op.take_late()).sum();
        if late > 0 {
            self.counters.records_late.fetch_add(late, Ordering::Relaxed);
            for output in &mut self.late_records {
                for records in self.operators[output.operator].take_late_records() {
                    output.sink.write(&records).await?;
                }
            }
        }
        let Some(batch) = current else { return Ok(()) };
        match &mut self.output {
            Output::Edges(edges) => {
                let gone = |target: usize| Error::PeerGone(format!("stage {} subtask {}: downstream {target} went away", self.stage, self.index));
                for edge in edges.iter() {
                    match &edge.route {
                        Route::Forward => edge.senders[0].send(Message::Batch(batch.clone())).await.map_err(|_| gone(self.index as usize))?,
                        Route::Hash(partitioner) => {
                            for (target, part) in partitioner.split(&batch)? {
                                edge.senders[target].send(Message::Batch(part)).await.map_err(|_| gone(target))?;
                            }
                        }
                        Route::Broadcast => {
                            for (target, s) in edge.senders.iter().enumerate() {
                                s.send(Message::Batch(batch.clone())).await.map_err(|_| gone(target))?;
                            }
                        }
                    }
                }
            }
            Output::Sink { sink, .. } => {
                self.counters.records_out.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
                sink.write(&batch).await?;
            }
        }
        Ok(())
    }

    /// Snapshots for `barrier`: aligned, or unaligned with the records in
    /// flight towards this subtask coming on `in_flight` once every input
    /// delivered the barrier (they are written beside the state, and the
    /// acknowledgement waits for them).
    async fn on_barrier(
        &mut self,
        barrier: Barrier,
        in_flight: Option<tokio::sync::oneshot::Receiver<InFlight>>,
    ) -> Result<()> {
        let mut inline: Vec<(String, OperatorSubtaskState)> = Vec::new();
        if let Input::Source { reader, state_id, .. } = &self.input {
            let positions = serde_json::to_value(reader.positions()?).map_err(|e| Error::Job(e.to_string()))?;
            inline.push((state_id.clone(), OperatorSubtaskState { subtask: self.index, inline: Some(positions), file: None, shared: Vec::new() }));
        }
        // The synchronous part: copies of keyed state. Incremental ones
        // copy what changed since the last file of their chain; savepoints
        // are always whole (and leave the chains alone).
        let mut keyed = Vec::new();
        let mut changes = Vec::new();
        let mut chains = None;
        match &self.incremental {
            Some(inc) if !barrier.savepoint => {
                // Built on the chain of the newest completed checkpoint, so
                // that neither a write still in progress nor the files of an
                // abandoned checkpoint are ever named.
                for op in &mut self.operators {
                    if op.is_incremental() {
                        let chain = inc.confirmed(op.id());
                        let full = chain.wants_full();
                        if let Some((copy, generation)) = op.snapshot_changed_after(if full { None } else { chain.covered })? {
                            changes.push(Changes { op: op.id().to_string(), copy, full, generation, chain });
                        }
                    } else {
                        keyed.extend(op.snapshot()?);
                    }
                }
                chains = Some(Chains { book: inc.clone(), dir: self.storage.dir(crate::checkpoint::storage::SHARED_DIR) });
            }
            _ => {
                for op in &self.operators {
                    keyed.extend(op.snapshot()?);
                }
            }
        }
        let name = self.name();
        for late in &mut self.late_records {
            if let Some(state) = late.sink.pre_commit(barrier.checkpoint_id).await? {
                let v = serde_json::to_value(state).map_err(|e| Error::Job(e.to_string()))?;
                inline.push((late.state_id.clone(), OperatorSubtaskState { subtask: self.index, inline: Some(v), file: None, shared: Vec::new() }));
            }
        }
        match &mut self.output {
            Output::Sink { sink, state_id, .. } => {
                if let Some(state) = sink.pre_commit(barrier.checkpoint_id).await? {
                    if barrier.savepoint {
                        crate::sink::copy_log_into_savepoint(&state, &crate::sink::SinkScope::of(state_id), &self.storage, &barrier.dir).await?;
                    }
                    let v = serde_json::to_value(state).map_err(|e| Error::Job(e.to_string()))?;
                    inline.push((state_id.clone(), OperatorSubtaskState { subtask: self.index, inline: Some(v), file: None, shared: Vec::new() }));
                }
            }
            Output::Edges(_) => {
                for s in self.output.senders() {
                    s.send(Message::Barrier(barrier.clone()))
                        .await
                        .map_err(|_| Error::PeerGone(format!("{name}: downstream went away")))?;
                }
            }
        }
        // The asynchronous part: write state files, then acknowledge.
        tokio::spawn(
            SnapshotWrite {
                checkpoint_id: barrier.checkpoint_id,
                stage: self.stage,
                subtask: self.index,
                dir: self.storage.dir(&barrier.dir),
                inline,
                keyed,
                changes,
                chains,
                in_flight: in_flight.map(|rx| (rx, self.input_edges.clone())),
                to_coordinator: self.to_coordinator.clone(),
            }
            .run(),
        );
        Ok(())
    }

    /// The watermark grew: each operator in turn fires what it completes
    /// (the results go through the operators after it), then it moves on,
    /// as each operator passes it on (a join holds it back).
    async fn on_watermark(&mut self, watermark: i64) -> Result<()> {
        let mut watermark = watermark;
        for k in 0..self.operators.len() {
            if let Some(fired) = self.operators[k].on_watermark(watermark)? {
                self.emit_from(k + 1, 0, fired).await?;
            }
            watermark = self.operators[k].output_watermark(watermark);
        }
        self.forward(|| Message::Watermark(watermark)).await
    }

    /// Sends a message to every downstream subtask (none after a sink).
    async fn forward(&mut self, message: impl Fn() -> Message) -> Result<()> {
        for s in self.output.senders() {
            s.send(message()).await.map_err(|_| Error::PeerGone(format!("stage {} subtask {}: downstream went away", self.stage, self.index)))?;
        }
        Ok(())
    }

    /// At-most-once: publishes what the sink and the windows' late-record
    /// outputs hold, under a flush number of this subtask's own (each
    /// output's names stay unique within the run).
    async fn flush_sink(&mut self, flushes: &mut u64) -> Result<()> {
        if !self.commits() {
            return Ok(());
        }
        *flushes += 1;
        for late in &mut self.late_records {
            late.sink.pre_commit(*flushes).await?;
            late.sink.commit(*flushes).await?;
        }
        if let Output::Sink { sink, .. } = &mut self.output {
            sink.pre_commit(*flushes).await?;
            sink.commit(*flushes).await?;
        }
        Ok(())
    }

    /// At-most-once: a barrier (only the final one) carries no state: the
    /// sink publishes, the barrier moves on, and the ack is empty.
    async fn on_flush_barrier(&mut self, barrier: Barrier, flushes: &mut u64) -> Result<()> {
        self.flush_sink(flushes).await?;
        for s in self.output.senders() {
            s.send(Message::Barrier(barrier.clone())).await.map_err(|_| Error::Job(format!("{}: downstream went away", self.name())))?;
        }
        let ack = SubtaskAck { stage: self.stage, subtask: self.index, operators: Vec::new() };
        let _ = self.to_coordinator.send(ToCoordinator::Ack { checkpoint_id: barrier.checkpoint_id, ack });
        Ok(())
    }

    async fn end(&mut self) -> Result<()> {
        for s in self.output.senders() {
            let _ = s.send(Message::End).await;
        }
        Ok(())
    }
}

/// At-most-once: the next batch to emit. When none is read ahead, reads up
/// to [`ReadAhead::BATCHES`] more and writes the read marks past them
/// before the first is emitted.
async fn read_ahead(reader: &mut SourceReader, ahead: &mut ReadAhead, counters: &Counters) -> Result<Poll> {
    if let Some(b) = ahead.batches.pop_front() {
        return Ok(Poll::Batch(b));
    }
    let mut wait = None;
    while !ahead.finished && ahead.batches.len() < ReadAhead::BATCHES {
        let polled = reader.poll();
        counters.records_skipped.fetch_add(reader.take_skipped(), Ordering::Relaxed);
        match polled? {
            Poll::Batch(b) => ahead.batches.push_back(b),
            Poll::Finished => ahead.finished = true,
            Poll::Wait(d) => {
                wait = Some(d);
                break;
            }
        }
    }
    let Some(first) = ahead.batches.pop_front() else {
        return Ok(match wait {
            Some(d) => Poll::Wait(d),
            None => Poll::Finished,
        });
    };
    let positions = reader.positions()?;
    // A source with nothing to resume from (a socket) has no marks to keep.
    if !positions.splits.is_empty() {
        ahead.marks.save(&positions).await?;
    }
    Ok(Poll::Batch(first))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    fn times(ts: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("t", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(ts.to_vec()))]).unwrap()
    }

    fn clock(idle_ms: Option<u64>) -> SourceClock {
        SourceClock::new(EventTimePlan { column: 0, field: "t".into(), max_out_of_orderness_ms: 10, idle_timeout: idle_ms.map(Duration::from_millis) })
    }

    #[test]
    fn a_lagging_split_holds_the_watermark_back_and_a_split_not_read_yet_holds_it_entirely() {
        let active = vec!["a".to_string(), "b".to_string()];
        let mut c = clock(None);
        assert_eq!(c.after(&times(&[100, 500]), RowSplits::All("a".into()), &active), None, "b has given nothing yet");
        assert_eq!(c.after(&times(&[200]), RowSplits::All("b".into()), &active), Some(189));
        assert_eq!(c.after(&times(&[900]), RowSplits::All("a".into()), &active), None, "b still at 200");
        // Rows of several splits in one batch (Kafka).
        assert_eq!(c.after(&times(&[300, 1000]), RowSplits::Each(vec!["b".into(), "a".into()]), &active), Some(289));
        // A finished split (no longer active) holds nothing back.
        assert_eq!(c.after(&times(&[1001]), RowSplits::All("a".into()), &["a".to_string()]), Some(990));
    }

    #[tokio::test]
    async fn a_split_silent_for_the_idle_timeout_holds_nothing_back() {
        let active = vec!["a".to_string(), "b".to_string()];
        let mut c = clock(Some(30));
        assert_eq!(c.after(&times(&[100]), RowSplits::All("a".into()), &active), None);
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(c.after(&times(&[200]), RowSplits::All("a".into()), &active), Some(189), "b never read, idle now");
    }
}

