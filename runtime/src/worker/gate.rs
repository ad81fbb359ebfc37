//! The input gate of a subtask with upstream channels: fair reading, and
//! barrier alignment.
//!
//! When barrier n arrives on an input, that input is blocked (not read) until
//! barrier n has arrived on every input that has not ended; then the gate
//! hands the barrier to the subtask once and unblocks everything. So the
//! subtask's snapshot holds exactly the records before barrier n on every
//! input. Blocking leaves the records in the channel: the upstream sees a
//! full channel and waits, instead of this subtask buffering without bound.

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
}

pub struct InputGate {
    inputs: Vec<mpsc::Receiver<Message>>,
    blocked: Vec<bool>,
    ended: Vec<bool>,
    aligning: Option<Barrier>,
    next: usize,
    name: String,
}

impl InputGate {
    pub fn new(name: String, inputs: Vec<mpsc::Receiver<Message>>) -> Self {
        let n = inputs.len();
        InputGate { inputs, blocked: vec![false; n], ended: vec![false; n], aligning: None, next: 0, name }
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
                    if self.blocked[i] || self.ended[i] {
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
                Message::End => {
                    self.ended[i] = true;
                    if self.live() == 0 {
                        return Ok(GateEvent::End);
                    }
                    if let Some(b) = self.try_release() {
                        return Ok(GateEvent::Barrier(b));
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
        }
    }

    #[tokio::test]
    async fn records_after_a_barrier_wait_until_every_input_delivered_it() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1]);
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
    async fn an_ended_input_does_not_hold_back_alignment() {
        let (tx0, rx0) = mpsc::channel(16);
        let (tx1, rx1) = mpsc::channel(16);
        let mut gate = InputGate::new("t".into(), vec![rx0, rx1]);
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
        let mut gate = InputGate::new("t".into(), vec![rx0]);
        drop(tx0);
        assert!(gate.next().await.is_err());
    }
}
