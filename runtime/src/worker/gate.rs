//! The input gate of a subtask with upstream channels: fair reading, and
//! barrier alignment.
//!
//! Aligned (exactly-once): when barrier n arrives on an input, that input is
//! blocked (not read) until barrier n has arrived on every input that has
//! not ended; then the gate hands the barrier to the subtask once and
//! unblocks everything. So the subtask's snapshot holds exactly the records
//! before barrier n on every input. Blocking leaves the records in the
//! channel: the upstream sees a full channel and waits, instead of this
//! subtask buffering without bound.
//!
//! Unaligned ([`Unaligning`], exactly-once too): a periodic checkpoint is
//! announced to every subtask directly (the coordinator's trigger, which
//! overtakes every queue), and the first of that notice and barrier n on
//! any input makes the gate hand out [`GateEvent::UnalignedBarrier`]: the
//! subtask snapshots at once. This is Chandy and Lamport's snapshot: the
//! records still in flight towards the subtask, those that reach it on an
//! input before that input's barrier n, are the channels' state. The gate
//! drains them into memory without waiting for the subtask to process
//! them (that is what makes the checkpoint quick under backpressure),
//! records them, and delivers the recording once every input delivered
//! barrier n; the subtask writes it with its state, and a restore processes
//! those records before anything else. Drained records are processed in
//! order afterwards, each input's before anything newer from it. With an
//! alignment timeout the gate aligns first and switches to an unaligned
//! snapshot of the checkpoint when alignment takes longer. Savepoints and
//! the final checkpoint are always aligned, so they hold no in-flight
//! records.
//!
//! Tracked (at-least-once): nothing is blocked; the gate only counts which
//! inputs delivered barrier n and hands it over once all have. Records that
//! followed the barrier on a quick input are then in the snapshot, so a
//! restore replays them a second time: at least once, never lost, and no
//! input waits for a slow one. A newer barrier overtaking an older one
//! (possible only once the older checkpoint was abandoned) replaces it.
//!
//! Watermarks: the gate keeps each input's latest watermark and hands on
//! the smallest over the inputs that are neither ended nor idle, whenever
//! it grows. An input that has sent no watermark yet holds it back. When
//! every live input is idle, the gate says so once (its subtask then holds
//! nothing back downstream either). Watermarks in flight are not part of a
//! channel's state: a restored window keeps the watermark of its snapshot,
//! so a replayed record is never later than it was before the failure.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use arrow::array::RecordBatch;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::exchange::{Barrier, Message};

/// Records of a stage's inputs, each tagged with the input it came on
/// (the index of the stage input in the plan, not of the channel).
pub type InFlight = Vec<(usize, RecordBatch)>;

pub enum GateEvent {
    /// Records from stage input `.0`.
    Batch(usize, RecordBatch),
    /// Barrier n has arrived on every live input.
    Barrier(Barrier),
    /// Snapshot now, before barrier n arrived on every input: the records
    /// in flight before it come on the receiver once it has.
    UnalignedBarrier(Barrier, oneshot::Receiver<InFlight>),
    /// Every input has ended.
    End,
    /// The smallest watermark of the live inputs grew to this.
    Watermark(i64),
    /// Every live input is idle.
    Idle,
}

/// How the gate treats an input that delivered a barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alignment {
    /// Blocked until every input delivered it: exactly-once.
    Aligned,
    /// Read on: at-least-once.
    Tracked,
}

/// Unaligned checkpoints: the announcements of periodic checkpoints, and
/// how long the gate aligns one before it takes it unaligned (zero: never).
pub struct Unaligning {
    pub after: Duration,
    pub notices: mpsc::UnboundedReceiver<Barrier>,
}

/// An unaligned snapshot whose in-flight records are still being drained.
struct Recording {
    checkpoint_id: u64,
    batches: InFlight,
    /// Inputs that delivered the barrier (or ended): nothing more of theirs belongs to it.
    done: Vec<bool>,
    deliver: oneshot::Sender<InFlight>,
}

/// What waiting on the inputs gave.
enum Received {
    /// A message to handle, from input `i` (from its channel or its drained records).
    Message(usize, Message),
    /// A message read from an input while recording, before that input's barrier.
    Drained(usize, Message),
    Notice(Barrier),
    /// The alignment timeout of the announced checkpoint passed.
    Deadline,
}

pub struct InputGate {
    /// The channels, one per upstream subtask of each stage input.
    inputs: Vec<mpsc::Receiver<Message>>,
    /// Per channel, the stage input it belongs to: recorded and restored
    /// records keep it, since each input has its own schema and edge.
    input_of: Vec<usize>,
    alignment: Alignment,
    /// Inputs that delivered the barrier being aligned (blocked, when aligned).
    blocked: Vec<bool>,
    ended: Vec<bool>,
    aligning: Option<Barrier>,
    next: usize,
    name: String,
    /// Each input's latest watermark (`None`: none yet).
    watermarks: Vec<Option<i64>>,
    idle: Vec<bool>,
    /// The last watermark handed on, and whether idleness was.
    emitted: Option<i64>,
    emitted_idle: bool,
    unaligning: Option<Unaligning>,
    /// A periodic checkpoint heard of (notice or first barrier) and not yet
    /// snapshotted, with the end of its alignment timeout.
    announced: Option<Barrier>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    recording: Option<Recording>,
    /// The newest periodic checkpoint snapshotted: later news of it (a
    /// slow notice, barriers after an unaligned snapshot) is ignored.
    snapshotted: u64,
    /// Per input, messages drained while recording and not yet handed out.
    drained: Vec<VecDeque<Message>>,
    /// In-flight records of the restored checkpoint, handed out before anything else.
    restored: VecDeque<(usize, RecordBatch)>,
}

impl InputGate {
    /// A gate over `channels`, each with the stage input it belongs to.
    pub fn new(name: String, channels: Vec<(usize, mpsc::Receiver<Message>)>, alignment: Alignment) -> Self {
        let n = channels.len();
        let (input_of, inputs) = channels.into_iter().unzip();
        InputGate {
            inputs,
            input_of,
            alignment,
            blocked: vec![false; n],
            ended: vec![false; n],
            aligning: None,
            next: 0,
            name,
            watermarks: vec![None; n],
            idle: vec![false; n],
            emitted: None,
            emitted_idle: false,
            unaligning: None,
            announced: None,
            deadline: None,
            recording: None,
            snapshotted: 0,
            drained: (0..n).map(|_| VecDeque::new()).collect(),
            restored: VecDeque::new(),
        }
    }

    /// Takes periodic checkpoints unaligned (see the module comment).
    pub fn unaligned(mut self, unaligning: Unaligning) -> Self {
        self.unaligning = Some(unaligning);
        self
    }

    /// Records of the restored checkpoint that were in flight towards this
    /// subtask: handed out first, before any input is read.
    pub fn with_restored(mut self, batches: InFlight) -> Self {
        self.restored = batches.into();
        self
    }

    /// What the inputs' watermarks now allow: a grown combined watermark,
    /// or idleness of every live input, when not handed on already.
    fn watermark_event(&mut self) -> Option<GateEvent> {
        let live: Vec<usize> = (0..self.inputs.len()).filter(|&i| !self.ended[i]).collect();
        if live.is_empty() {
            return None;
        }
        let active: Vec<usize> = live.iter().copied().filter(|&i| !self.idle[i]).collect();
        if active.is_empty() {
            if self.emitted_idle {
                return None;
            }
            self.emitted_idle = true;
            return Some(GateEvent::Idle);
        }
        let mut combined = i64::MAX;
        for &i in &active {
            combined = combined.min(self.watermarks[i]?);
        }
        self.emitted_idle = false;
        if self.emitted.is_some_and(|e| e >= combined) {
            return None;
        }
        self.emitted = Some(combined);
        Some(GateEvent::Watermark(combined))
    }

    fn live(&self) -> usize {
        self.ended.iter().filter(|e| !**e).count()
    }

    fn arrived(&self) -> usize {
        self.blocked.iter().zip(&self.ended).filter(|(b, e)| **b && !**e).count()
    }

    /// Whether input `i`'s channel may be read now.
    fn readable(&self, i: usize) -> bool {
        // While recording, inputs before their barrier are drained instead,
        // and inputs past it wait until the recording is complete: what
        // follows the barrier belongs to no checkpoint yet.
        !self.ended[i]
            && self.drained[i].is_empty()
            && self.recording.is_none()
            && !(self.blocked[i] && self.alignment == Alignment::Aligned)
    }

    /// The next event. Cancel-safe: nothing is lost when the future is dropped.
    pub async fn next(&mut self) -> Result<GateEvent> {
        loop {
            if let Some((input, b)) = self.restored.pop_front() {
                return Ok(GateEvent::Batch(input, b));
            }
            self.deliver_recording();
            if let Some(ev) = self.switch_to_unaligned() {
                return Ok(ev);
            }
            match self.receive().await? {
                Received::Notice(b) => self.announce(b),
                Received::Deadline => self.deadline = None,
                Received::Drained(i, msg) => self.record(i, msg)?,
                Received::Message(i, msg) => {
                    if let Some(ev) = self.handle(i, msg)? {
                        return Ok(ev);
                    }
                }
            }
        }
    }

    async fn receive(&mut self) -> Result<Received> {
        poll_fn(|cx| {
            if let Some(u) = &mut self.unaligning {
                if let Poll::Ready(Some(b)) = u.notices.poll_recv(cx) {
                    return Poll::Ready(Ok(Received::Notice(b)));
                }
            }
            if let Some(d) = &mut self.deadline {
                if d.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Ok(Received::Deadline));
                }
            }
            // Draining comes first: it is what completes a checkpoint.
            if let Some(r) = &self.recording {
                for i in 0..self.inputs.len() {
                    if r.done[i] || self.ended[i] {
                        continue;
                    }
                    match self.inputs[i].poll_recv(cx) {
                        Poll::Ready(Some(m)) => return Poll::Ready(Ok(Received::Drained(i, m))),
                        Poll::Ready(None) => return Poll::Ready(Err(self.disconnected(i))),
                        Poll::Pending => {}
                    }
                }
            }
            let n = self.inputs.len();
            for k in 0..n {
                let i = (self.next + k) % n;
                if let Some(m) = self.drained[i].pop_front() {
                    self.next = i + 1;
                    return Poll::Ready(Ok(Received::Message(i, m)));
                }
                if !self.readable(i) {
                    continue;
                }
                match self.inputs[i].poll_recv(cx) {
                    Poll::Ready(Some(m)) => {
                        self.next = i + 1;
                        return Poll::Ready(Ok(Received::Message(i, m)));
                    }
                    Poll::Ready(None) => return Poll::Ready(Err(self.disconnected(i))),
                    Poll::Pending => {}
                }
            }
            Poll::Pending
        })
        .await
    }

    fn disconnected(&self, i: usize) -> Error {
        Error::PeerGone(format!(
            "{}: input {i} disconnected before its end of stream",
            self.name
        ))
    }

    /// A periodic checkpoint was announced by the coordinator.
    fn announce(&mut self, b: Barrier) {
        if b.checkpoint_id <= self.snapshotted
            || self
                .announced
                .as_ref()
                .is_some_and(|a| a.checkpoint_id >= b.checkpoint_id)
        {
            return;
        }
        if self
            .aligning
            .as_ref()
            .is_some_and(|a| a.checkpoint_id > b.checkpoint_id)
        {
            return;
        }
        let after = self.unaligning.as_ref().map_or(Duration::ZERO, |u| u.after);
        self.deadline = (!after.is_zero()).then(|| Box::pin(tokio::time::sleep(after)));
        self.announced = Some(b);
    }

    /// Starts the unaligned snapshot of the announced checkpoint when its
    /// alignment timeout has passed (at once without one).
    fn switch_to_unaligned(&mut self) -> Option<GateEvent> {
        if self.recording.is_some() || self.deadline.is_some() {
            return None;
        }
        let b = self.announced.as_ref()?;
        // A savepoint being aligned finishes first; the periodic checkpoint it overtook is stale.
        if let Some(a) = &self.aligning {
            if a.checkpoint_id != b.checkpoint_id {
                return None;
            }
        }
        let b = self.announced.take()?;
        Some(self.start_recording(b))
    }

    /// Unaligned snapshot of `b`: inputs that delivered its barrier (while
    /// aligning) are done; the others are drained until they do.
    fn start_recording(&mut self, b: Barrier) -> GateEvent {
        let done: Vec<bool> = (0..self.inputs.len())
            .map(|i| self.ended[i] || (self.aligning.is_some() && self.blocked[i]))
            .collect();
        self.aligning = None;
        self.blocked.iter_mut().for_each(|x| *x = false);
        self.deadline = None;
        self.announced = None;
        self.snapshotted = b.checkpoint_id;
        // Records drained for an earlier checkpoint and not processed yet
        // are in flight for this one too.
        let batches = self
            .drained
            .iter()
            .zip(&self.input_of)
            .flat_map(|(queue, &input)| {
                queue.iter().filter_map(move |m| match m {
                    Message::Batch(b) => Some((input, b.clone())),
                    _ => None,
                })
            })
            .collect();
        let (deliver, rx) = oneshot::channel();
        self.recording = Some(Recording {
            checkpoint_id: b.checkpoint_id,
            batches,
            done,
            deliver,
        });
        GateEvent::UnalignedBarrier(b, rx)
    }

    fn deliver_recording(&mut self) {
        let complete = self
            .recording
            .as_ref()
            .is_some_and(|r| r.done.iter().zip(&self.ended).all(|(d, e)| *d || *e));
        if complete {
            if let Some(r) = self.recording.take() {
                // The subtask may have failed meanwhile; nobody to tell then.
                let _ = r.deliver.send(r.batches);
            }
        }
    }

    /// A message drained from input `i` while recording.
    fn record(&mut self, i: usize, msg: Message) -> Result<()> {
        let Some(r) = &mut self.recording else {
            return Ok(());
        };
        match msg {
            Message::Barrier(b) if b.checkpoint_id == r.checkpoint_id => r.done[i] = true,
            // An abandoned checkpoint's barrier.
            Message::Barrier(b) if b.checkpoint_id < r.checkpoint_id => {}
            Message::Barrier(b) => {
                return Err(Error::Job(format!(
                    "{}: barrier {} arrived on input {i} before barrier {} it was recording",
                    self.name, b.checkpoint_id, r.checkpoint_id
                )))
            }
            Message::Batch(b) => {
                crate::fault::crash_point("mid-recording", r.checkpoint_id);
                r.batches.push((self.input_of[i], b.clone()));
                self.drained[i].push_back(Message::Batch(b));
            }
            Message::End => {
                r.done[i] = true;
                self.drained[i].push_back(Message::End);
            }
            m @ (Message::Watermark(_) | Message::Idle) => self.drained[i].push_back(m),
        }
        Ok(())
    }

    fn handle(&mut self, i: usize, msg: Message) -> Result<Option<GateEvent>> {
        Ok(match msg {
            Message::Batch(b) => Some(GateEvent::Batch(self.input_of[i], b)),
            Message::Barrier(b) => self.on_barrier(i, b)?,
            Message::Watermark(w) => {
                self.idle[i] = false;
                self.watermarks[i] = Some(self.watermarks[i].map_or(w, |old| old.max(w)));
                self.watermark_event()
            }
            Message::Idle => {
                self.idle[i] = true;
                self.watermark_event()
            }
            Message::End => {
                self.ended[i] = true;
                if self.live() == 0 {
                    return Ok(Some(GateEvent::End));
                }
                if let Some(b) = self.try_release() {
                    return Ok(Some(GateEvent::Barrier(b)));
                }
                // An ended input holds nothing back: the others may now
                // allow a larger watermark. (Handed on with the next
                // message: a barrier released above comes first.)
                self.watermark_event()
            }
        })
    }

    fn on_barrier(&mut self, i: usize, b: Barrier) -> Result<Option<GateEvent>> {
        let periodic = !b.savepoint && !b.is_final;
        if self.unaligning.is_some() && periodic {
            if b.checkpoint_id <= self.snapshotted {
                return Ok(None);
            }
            let after = self.unaligning.as_ref().map_or(Duration::ZERO, |u| u.after);
            if after.is_zero() {
                // Chandy-Lamport: the first barrier is as good as the notice.
                self.blocked.iter_mut().for_each(|x| *x = false);
                self.blocked[i] = true;
                self.aligning = Some(b.clone());
                return Ok(Some(self.start_recording(b)));
            }
            // Aligning, with a timeout counted from the first news of it.
            if self.announced.as_ref().is_none_or(|a| a.checkpoint_id != b.checkpoint_id) {
                self.announce(b.clone());
            }
        }
        match &self.aligning {
            None => self.aligning = Some(b),
            // Tracked inputs run ahead: a newer barrier means the
            // older checkpoint was abandoned; an older one is late.
            Some(a)
                if self.alignment == Alignment::Tracked && b.checkpoint_id > a.checkpoint_id =>
            {
                self.blocked.iter_mut().for_each(|x| *x = false);
                self.aligning = Some(b);
            }
            Some(a)
                if self.alignment == Alignment::Tracked && b.checkpoint_id < a.checkpoint_id =>
            {
                return Ok(None)
            }
            Some(a) if a.checkpoint_id != b.checkpoint_id => {
                return Err(Error::Job(format!(
                    "{}: barrier {} arrived on input {i} while aligning barrier {}",
                    self.name, b.checkpoint_id, a.checkpoint_id
                )))
            }
            Some(_) => {}
        }
        self.blocked[i] = true;
        if let Some(b) = self.try_release() {
            return Ok(Some(GateEvent::Barrier(b)));
        }
        if let Some(a) = &self.aligning {
            crate::fault::crash_point("mid-alignment", a.checkpoint_id);
        }
        Ok(None)
    }

    fn try_release(&mut self) -> Option<Barrier> {
        if self.aligning.is_some() && self.arrived() == self.live() {
            self.blocked.iter_mut().for_each(|b| *b = false);
            let b = self.aligning.take()?;
            if !b.savepoint && !b.is_final {
                self.snapshotted = self.snapshotted.max(b.checkpoint_id);
            }
            // Aligned in time: no unaligned snapshot of it.
            if self
                .announced
                .as_ref()
                .is_some_and(|a| a.checkpoint_id <= b.checkpoint_id)
            {
                self.announced = None;
                self.deadline = None;
            }
            return Some(b);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn batch(v: i64) -> Message {
        let s = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        Message::Batch(RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(vec![v]))]).unwrap())
    }

    fn barrier(id: u64) -> Message {
        Message::Barrier(Barrier { checkpoint_id: id, savepoint: false, is_final: false, dir: String::new(), stop: false })
    }

    fn value(e: &GateEvent) -> i64 {
        match e {
            GateEvent::Batch(_, b) => b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0),
            GateEvent::Barrier(b) => -(b.checkpoint_id as i64),
            GateEvent::UnalignedBarrier(b, _) => -1000 - (b.checkpoint_id as i64),
            GateEvent::End => i64::MIN,
            GateEvent::Watermark(w) => 1_000_000 + w,
            GateEvent::Idle => i64::MAX,
        }
    }

    #[tokio::test]
    async fn the_watermark_is_the_smallest_of_the_live_inputs_and_idle_inputs_hold_nothing_back() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![(0, rx0), (1, rx1)], Alignment::Aligned);
        tx0.send(Message::Watermark(10)).await.unwrap();
        tx0.send(Message::Watermark(20)).await.unwrap();
        // Until input 1 sends one, nothing; then the smaller of the two.
        tx1.send(Message::Watermark(15)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 1_000_010);
        assert_eq!(value(&gate.next().await.unwrap()), 1_000_015);
        tx1.send(Message::Idle).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 1_000_020, "an idle input holds nothing back");
        tx0.send(Message::Idle).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), i64::MAX, "all idle");
        tx1.send(Message::Watermark(30)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 1_000_030);
        tx1.send(Message::End).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), i64::MAX, "the one live input left is idle");
        tx0.send(Message::Watermark(25)).await.unwrap();
        tx0.send(Message::Watermark(40)).await.unwrap();
        // 25 is below what was handed on: only 40 comes through.
        assert_eq!(value(&gate.next().await.unwrap()), 1_000_040);
    }

    #[tokio::test]
    async fn records_after_a_barrier_wait_until_every_input_delivered_it() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![(0, rx0), (1, rx1)], Alignment::Aligned);
        // Input 0 is ahead: its barrier and a record after it are queued.
        tx0.send(batch(1)).await.unwrap();
        tx0.send(barrier(1)).await.unwrap();
        tx0.send(batch(100)).await.unwrap();
        tx1.send(batch(2)).await.unwrap();
        tx1.send(batch(3)).await.unwrap();
        tx1.send(barrier(1)).await.unwrap();
        tx1.send(batch(200)).await.unwrap();
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(value(&gate.next().await.unwrap()));
        }
        let at = seen.iter().position(|&v| v == -1).unwrap();
        let mut before: Vec<i64> = seen[..at].to_vec();
        before.sort();
        assert_eq!(before, vec![1, 2, 3], "{seen:?}");
        let mut after: Vec<i64> = seen[at + 1..].to_vec();
        after.sort();
        assert_eq!(after, vec![100, 200], "{seen:?}");
    }

    #[tokio::test]
    async fn tracked_inputs_are_read_past_a_barrier_until_every_input_delivered_it() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![(0, rx0), (1, rx1)], Alignment::Tracked);
        tx0.send(barrier(1)).await.unwrap();
        tx0.send(batch(100)).await.unwrap();
        tx0.send(batch(101)).await.unwrap();
        // Input 1 has not delivered barrier 1: input 0's later records
        // still come through, and the barrier waits for input 1.
        let mut seen = vec![value(&gate.next().await.unwrap()), value(&gate.next().await.unwrap())];
        tx1.send(batch(2)).await.unwrap();
        tx1.send(barrier(1)).await.unwrap();
        for _ in 0..2 {
            seen.push(value(&gate.next().await.unwrap()));
        }
        assert_eq!(seen, vec![100, 101, 2, -1]);
    }

    #[tokio::test]
    async fn a_tracked_gate_gives_up_an_abandoned_barrier_for_a_newer_one() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![(0, rx0), (1, rx1)], Alignment::Tracked);
        tx0.send(barrier(1)).await.unwrap();
        tx0.send(barrier(2)).await.unwrap();
        tx0.send(batch(7)).await.unwrap();
        // Input 0 delivers 1 and 2 before input 1 delivers 1: checkpoint 1
        // is given up, its late barrier on input 1 ignored, and 2 released.
        assert_eq!(value(&gate.next().await.unwrap()), 7);
        tx1.send(barrier(1)).await.unwrap();
        tx1.send(barrier(2)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), -2);
        tx0.send(Message::End).await.unwrap();
        tx1.send(Message::End).await.unwrap();
        assert!(matches!(gate.next().await.unwrap(), GateEvent::End));
    }

    #[tokio::test]
    async fn an_ended_input_does_not_hold_back_alignment() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![(0, rx0), (1, rx1)], Alignment::Aligned);
        tx0.send(barrier(5)).await.unwrap();
        tx0.send(Message::End).await.unwrap();
        tx1.send(barrier(5)).await.unwrap();
        tx1.send(Message::End).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), -5);
        assert!(matches!(gate.next().await.unwrap(), GateEvent::End));
    }

    /// The recorded values, sorted, whichever input they came on.
    fn values(batches: &[(usize, RecordBatch)]) -> Vec<i64> {
        let mut v: Vec<i64> = tagged(batches).into_iter().map(|(_, v)| v).collect();
        v.sort();
        v
    }

    /// The recorded (input, value) pairs, sorted.
    fn tagged(batches: &[(usize, RecordBatch)]) -> Vec<(usize, i64)> {
        let mut v: Vec<(usize, i64)> = batches
            .iter()
            .map(|(input, b)| {
                (*input,
                b.column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap()
                    .value(0))
            })
            .collect();
        v.sort();
        v
    }

    /// A gate over two inputs taking periodic checkpoints unaligned after `after`.
    fn unaligned_gate(
        after: Duration,
    ) -> (
        InputGate,
        [mpsc::Sender<Message>; 2],
        mpsc::UnboundedSender<Barrier>,
    ) {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let (notice, notices) = mpsc::unbounded_channel();
        let gate = InputGate::new("t".into(), vec![(0, rx0), (1, rx1)], Alignment::Aligned)
            .unaligned(Unaligning { after, notices });
        (gate, [tx0, tx1], notice)
    }

    fn notice(id: u64) -> Barrier {
        Barrier {
            checkpoint_id: id,
            savepoint: false,
            is_final: false,
            dir: String::new(),
            stop: false,
        }
    }

    async fn unaligned(gate: &mut InputGate) -> (u64, oneshot::Receiver<InFlight>) {
        match gate.next().await.unwrap() {
            GateEvent::UnalignedBarrier(b, rx) => (b.checkpoint_id, rx),
            other => panic!("expected an unaligned barrier, got {}", value(&other)),
        }
    }

    async fn nothing_within(gate: &mut InputGate, ms: u64) {
        if let Ok(e) = tokio::time::timeout(Duration::from_millis(ms), gate.next()).await {
            panic!("expected nothing yet, got {}", value(&e.unwrap()));
        }
    }

    #[tokio::test]
    async fn an_unaligned_snapshot_is_taken_at_the_notice_and_records_what_was_in_flight_before_each_barrier(
    ) {
        let (mut gate, [tx0, tx1], notices) = unaligned_gate(Duration::ZERO);
        tx0.send(batch(1)).await.unwrap();
        tx0.send(batch(2)).await.unwrap();
        tx1.send(batch(3)).await.unwrap();
        notices.send(notice(1)).unwrap();
        // The notice overtakes the records queued on both inputs.
        let (id, mut in_flight) = unaligned(&mut gate).await;
        assert_eq!(id, 1);
        tx0.send(barrier(1)).await.unwrap();
        tx0.send(batch(100)).await.unwrap();
        let first = value(&gate.next().await.unwrap());
        assert!(
            in_flight.try_recv().is_err(),
            "input 1 has not delivered barrier 1 yet"
        );
        tx1.send(batch(4)).await.unwrap();
        tx1.send(barrier(1)).await.unwrap();
        tx1.send(batch(200)).await.unwrap();
        let mut seen = vec![first];
        for _ in 0..5 {
            seen.push(value(&gate.next().await.unwrap()));
        }
        assert_eq!(
            tagged(&in_flight.await.unwrap()),
            vec![(0, 1), (0, 2), (1, 3), (1, 4)],
            "in flight: what came before each input's barrier, tagged with its input"
        );
        let mut before = seen[..4].to_vec();
        before.sort();
        assert_eq!(before, vec![1, 2, 3, 4], "{seen:?}");
        let mut after = seen[4..].to_vec();
        after.sort();
        assert_eq!(
            after,
            vec![100, 200],
            "records after the barriers come after the recorded ones: {seen:?}"
        );
    }

    #[tokio::test]
    async fn records_in_flight_are_tagged_with_the_stage_input_of_their_channel_not_the_channel() {
        // Input 0 comes from two upstream subtasks (two channels), input 1 from one.
        let (a0, ra0) = mpsc::channel(16);
        let (a1, ra1) = mpsc::channel(16);
        let (b0, rb0) = mpsc::channel(16);
        let (notice_tx, notices) = mpsc::unbounded_channel();
        let mut gate = InputGate::new("t".into(), vec![(0, ra0), (0, ra1), (1, rb0)], Alignment::Aligned)
            .unaligned(Unaligning { after: Duration::ZERO, notices });
        a0.send(batch(1)).await.unwrap();
        a1.send(batch(2)).await.unwrap();
        b0.send(batch(3)).await.unwrap();
        notice_tx.send(notice(1)).unwrap();
        let (_, in_flight) = unaligned(&mut gate).await;
        for tx in [&a0, &a1, &b0] {
            tx.send(barrier(1)).await.unwrap();
        }
        let mut handed_out = Vec::new();
        for _ in 0..3 {
            match gate.next().await.unwrap() {
                GateEvent::Batch(input, b) => handed_out.push((input, b)),
                other => panic!("expected records, got {}", value(&other)),
            }
        }
        assert_eq!(tagged(&in_flight.await.unwrap()), vec![(0, 1), (0, 2), (1, 3)]);
        assert_eq!(tagged(&handed_out), vec![(0, 1), (0, 2), (1, 3)], "handed out with their input too");
    }

    #[tokio::test]
    async fn the_first_barrier_starts_an_unaligned_snapshot_without_waiting_for_the_notice() {
        let (mut gate, [tx0, tx1], _notices) = unaligned_gate(Duration::ZERO);
        tx0.send(barrier(3)).await.unwrap();
        tx0.send(batch(100)).await.unwrap();
        let (id, in_flight) = unaligned(&mut gate).await;
        assert_eq!(id, 3);
        // Input 0 is past its barrier: it waits until input 1 delivers it.
        tx1.send(batch(5)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 5);
        nothing_within(&mut gate, 50).await;
        tx1.send(barrier(3)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 100);
        assert_eq!(values(&in_flight.await.unwrap()), vec![5]);
    }

    #[tokio::test]
    async fn records_drained_and_not_yet_processed_are_in_flight_for_the_next_checkpoint_too() {
        let (mut gate, [tx0, tx1], notices) = unaligned_gate(Duration::ZERO);
        notices.send(notice(1)).unwrap();
        let (_, first) = unaligned(&mut gate).await;
        for v in [1, 2, 3] {
            tx0.send(batch(v)).await.unwrap();
        }
        tx0.send(barrier(1)).await.unwrap();
        tx1.send(barrier(1)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 1);
        assert_eq!(values(&first.await.unwrap()), vec![1, 2, 3]);
        // 2 and 3 are drained but not processed when checkpoint 2 is taken.
        notices.send(notice(2)).unwrap();
        let (id, second) = unaligned(&mut gate).await;
        assert_eq!(id, 2);
        tx0.send(barrier(2)).await.unwrap();
        tx1.send(barrier(2)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 2);
        assert_eq!(values(&second.await.unwrap()), vec![2, 3]);
    }

    #[tokio::test]
    async fn with_an_alignment_timeout_a_slow_alignment_turns_unaligned_and_a_quick_one_stays_aligned(
    ) {
        let (mut gate, [tx0, tx1], notices) = unaligned_gate(Duration::from_millis(100));
        notices.send(notice(1)).unwrap();
        tx0.send(barrier(1)).await.unwrap();
        tx1.send(barrier(1)).await.unwrap();
        assert_eq!(
            value(&gate.next().await.unwrap()),
            -1,
            "aligned within the timeout"
        );
        nothing_within(&mut gate, 200).await;

        notices.send(notice(2)).unwrap();
        tx0.send(barrier(2)).await.unwrap();
        tx0.send(batch(100)).await.unwrap();
        tx1.send(batch(7)).await.unwrap();
        // Input 0 is blocked (aligned); input 1's record comes through, then the timeout.
        assert_eq!(value(&gate.next().await.unwrap()), 7);
        let started = std::time::Instant::now();
        let (id, in_flight) = unaligned(&mut gate).await;
        assert_eq!(id, 2);
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "switched only after the timeout"
        );
        tx1.send(batch(8)).await.unwrap();
        tx1.send(barrier(2)).await.unwrap();
        let mut next_two = vec![
            value(&gate.next().await.unwrap()),
            value(&gate.next().await.unwrap()),
        ];
        next_two.sort();
        assert_eq!(next_two, vec![8, 100]);
        assert_eq!(
            values(&in_flight.await.unwrap()),
            vec![8],
            "input 0 had delivered its barrier: nothing of it is in flight"
        );
    }

    #[tokio::test]
    async fn savepoints_stay_aligned_when_checkpoints_are_unaligned() {
        let (mut gate, [tx0, tx1], _notices) = unaligned_gate(Duration::ZERO);
        let savepoint = Barrier {
            checkpoint_id: 4,
            savepoint: true,
            is_final: false,
            dir: String::new(),
            stop: false,
        };
        tx0.send(Message::Barrier(savepoint.clone())).await.unwrap();
        tx0.send(batch(100)).await.unwrap();
        tx1.send(batch(1)).await.unwrap();
        tx1.send(Message::Barrier(savepoint)).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), 1);
        assert_eq!(value(&gate.next().await.unwrap()), -4);
        assert_eq!(value(&gate.next().await.unwrap()), 100);
    }

    #[tokio::test]
    async fn restored_in_flight_records_come_before_any_input() {
        let (tx0, rx0) = mpsc::channel(16);
        tx0.send(batch(10)).await.unwrap();
        let restored = vec![batch(1), batch(2)]
            .into_iter()
            .map(|m| {
                if let Message::Batch(b) = m {
                    (0, b)
                } else {
                    unreachable!()
                }
            })
            .collect();
        let mut gate =
            InputGate::new("t".into(), vec![(0, rx0)], Alignment::Aligned).with_restored(restored);
        let seen: Vec<i64> = [
            gate.next().await.unwrap(),
            gate.next().await.unwrap(),
            gate.next().await.unwrap(),
        ]
        .iter()
        .map(value)
        .collect();
        assert_eq!(seen, vec![1, 2, 10]);
    }

    #[tokio::test]
    async fn a_vanished_upstream_is_an_error() {
        let (tx0, rx0) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![(0, rx0)], Alignment::Aligned);
        drop(tx0);
        assert!(gate.next().await.is_err());
    }
}
