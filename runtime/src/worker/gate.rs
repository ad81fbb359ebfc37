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
//! nothing back downstream either).

use std::future::poll_fn;
use std::task::Poll;

use arrow::array::RecordBatch;
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::exchange::{Barrier, Message};

pub enum GateEvent {
    Batch(RecordBatch),
    /// Barrier n has arrived on every live input.
    Barrier(Barrier),
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

pub struct InputGate {
    inputs: Vec<mpsc::Receiver<Message>>,
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
}

impl InputGate {
    pub fn new(name: String, inputs: Vec<mpsc::Receiver<Message>>, alignment: Alignment) -> Self {
        let n = inputs.len();
        InputGate {
            inputs,
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
        }
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

    /// The next event. Cancel-safe: nothing is lost when the future is dropped.
    pub async fn next(&mut self) -> Result<GateEvent> {
        loop {
            let (i, msg) = poll_fn(|cx| {
                let n = self.inputs.len();
                for k in 0..n {
                    let i = (self.next + k) % n;
                    if (self.blocked[i] && self.alignment == Alignment::Aligned) || self.ended[i] {
                        continue;
                    }
                    match self.inputs[i].poll_recv(cx) {
                        Poll::Ready(Some(m)) => {
                            self.next = i + 1;
                            return Poll::Ready(Ok((i, m)));
                        }
                        Poll::Ready(None) => {
                            return Poll::Ready(Err(Error::Job(format!("{}: input {i} disconnected before its end of stream", self.name))))
                        }
                        Poll::Pending => {}
                    }
                }
                Poll::Pending
            })
            .await?;
            match msg {
                Message::Batch(b) => return Ok(GateEvent::Batch(b)),
                Message::Barrier(b) => {
                    match &self.aligning {
                        None => self.aligning = Some(b),
                        // Tracked inputs run ahead: a newer barrier means the
                        // older checkpoint was abandoned; an older one is late.
                        Some(a) if self.alignment == Alignment::Tracked && b.checkpoint_id > a.checkpoint_id => {
                            self.blocked.iter_mut().for_each(|x| *x = false);
                            self.aligning = Some(b);
                        }
                        Some(a) if self.alignment == Alignment::Tracked && b.checkpoint_id < a.checkpoint_id => continue,
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
                        return Ok(GateEvent::Barrier(b));
                    }
                    if let Some(a) = &self.aligning {
                        crate::fault::crash_point("mid-alignment", a.checkpoint_id);
                    }
                }
                Message::Watermark(w) => {
                    self.idle[i] = false;
                    self.watermarks[i] = Some(self.watermarks[i].map_or(w, |old| old.max(w)));
                    if let Some(e) = self.watermark_event() {
                        return Ok(e);
                    }
                }
                Message::Idle => {
                    self.idle[i] = true;
                    if let Some(e) = self.watermark_event() {
                        return Ok(e);
                    }
                }
                Message::End => {
                    self.ended[i] = true;
                    if self.live() == 0 {
                        return Ok(GateEvent::End);
                    }
                    if let Some(b) = self.try_release() {
                        return Ok(GateEvent::Barrier(b));
                    }
                    // An ended input holds nothing back: the others may now
                    // allow a larger watermark. (Handed on with the next
                    // message: a barrier released above comes first.)
                    if let Some(e) = self.watermark_event() {
                        return Ok(e);
                    }
                }
            }
        }
    }

    fn try_release(&mut self) -> Option<Barrier> {
        if self.aligning.is_some() && self.arrived() == self.live() {
            self.blocked.iter_mut().for_each(|b| *b = false);
            return self.aligning.take();
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
        Message::Barrier(Barrier { checkpoint_id: id, savepoint: false, is_final: false, dir: String::new() })
    }

    fn value(e: &GateEvent) -> i64 {
        match e {
            GateEvent::Batch(b) => b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0),
            GateEvent::Barrier(b) => -(b.checkpoint_id as i64),
            GateEvent::End => i64::MIN,
            GateEvent::Watermark(w) => 1_000_000 + w,
            GateEvent::Idle => i64::MAX,
        }
    }

    #[tokio::test]
    async fn the_watermark_is_the_smallest_of_the_live_inputs_and_idle_inputs_hold_nothing_back() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1], Alignment::Aligned);
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
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1], Alignment::Aligned);
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
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1], Alignment::Tracked);
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
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1], Alignment::Tracked);
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
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1], Alignment::Aligned);
        tx0.send(barrier(5)).await.unwrap();
        tx0.send(Message::End).await.unwrap();
        tx1.send(barrier(5)).await.unwrap();
        tx1.send(Message::End).await.unwrap();
        assert_eq!(value(&gate.next().await.unwrap()), -5);
        assert!(matches!(gate.next().await.unwrap(), GateEvent::End));
    }

    #[tokio::test]
    async fn a_vanished_upstream_is_an_error() {
        let (tx0, rx0) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![rx0], Alignment::Aligned);
        drop(tx0);
        assert!(gate.next().await.is_err());
    }
}
