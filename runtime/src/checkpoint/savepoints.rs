//! The outcomes of the savepoints requested in this run, by request id.
//!
//! Savepoint requests are asynchronous and idempotent: the control endpoint
//! admits a request id here (once), the coordinator records how it ended, and
//! callers poll. Admission is one check-and-insert under the lock, so two
//! requests with the same id can never queue two savepoints. The book is
//! bounded: finished outcomes beyond [`MAX_OUTCOMES`] are forgotten oldest
//! first; pending ones never are (there is at most one per queued request,
//! and admission refuses when the book is full of pending ones).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use weir_api::control::{CheckpointStatus, SavepointOutcome, SavepointState};

pub const MAX_OUTCOMES: usize = 64;

#[derive(Clone, Default)]
pub struct SavepointBook {
    inner: Arc<Mutex<Book>>,
}

#[derive(Default)]
struct Book {
    outcomes: HashMap<String, SavepointOutcome>,
    /// Request ids, oldest first.
    order: VecDeque<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// A new request: the caller must queue it with the coordinator.
    New(SavepointOutcome),
    /// Asked before: its outcome so far; nothing is to be queued.
    Known(SavepointOutcome),
    /// Every remembered request is still pending.
    Full,
}

impl SavepointBook {
    fn book(&self) -> MutexGuard<'_, Book> {
        // A panic elsewhere while holding the lock leaves the map consistent
        // (every change is one insert or remove); keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn admit(&self, request_id: &str) -> Admission {
        let mut b = self.book();
        if let Some(known) = b.outcomes.get(request_id) {
            return Admission::Known(known.clone());
        }
        if b.order.len() >= MAX_OUTCOMES {
            let Some(pos) = b.order.iter().position(|id| b.outcomes.get(id).is_none_or(|o| o.state != SavepointState::Pending)) else {
                return Admission::Full;
            };
            if let Some(old) = b.order.remove(pos) {
                b.outcomes.remove(&old);
            }
        }
        let outcome = SavepointOutcome { request_id: request_id.into(), state: SavepointState::Pending, savepoint: None, error: None };
        b.outcomes.insert(request_id.into(), outcome.clone());
        b.order.push_back(request_id.into());
        Admission::New(outcome)
    }

    pub fn get(&self, request_id: &str) -> Option<SavepointOutcome> {
        self.book().outcomes.get(request_id).cloned()
    }

    pub fn complete(&self, request_id: &str, savepoint: CheckpointStatus) {
        if let Some(o) = self.book().outcomes.get_mut(request_id) {
            o.state = SavepointState::Completed;
            o.savepoint = Some(savepoint);
        }
    }

    pub fn fail(&self, request_id: &str, reason: impl Into<String>) {
        if let Some(o) = self.book().outcomes.get_mut(request_id) {
            o.state = SavepointState::Failed;
            o.error = Some(reason.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_id_is_admitted_once_and_then_reports_its_outcome() {
        let book = SavepointBook::default();
        assert!(matches!(book.admit("a"), Admission::New(o) if o.state == SavepointState::Pending));
        assert!(matches!(book.admit("a"), Admission::Known(o) if o.state == SavepointState::Pending));
        book.complete("a", CheckpointStatus { id: 7, location: "/s/sp-7".into(), ..Default::default() });
        let Admission::Known(o) = book.admit("a") else { panic!("admitted twice") };
        assert_eq!(o.state, SavepointState::Completed);
        assert_eq!(o.savepoint.map(|s| s.id), Some(7));
        book.fail("b", "unknown ids are ignored");
        assert_eq!(book.get("b"), None);
    }

    #[test]
    fn finished_outcomes_are_forgotten_oldest_first_and_pending_ones_never() {
        let book = SavepointBook::default();
        for i in 0..MAX_OUTCOMES {
            assert!(matches!(book.admit(&format!("r{i}")), Admission::New(_)));
        }
        assert_eq!(book.admit("one-too-many"), Admission::Full);
        book.fail("r5", "declined");
        book.fail("r9", "declined");
        assert!(matches!(book.admit("x"), Admission::New(_)));
        assert_eq!(book.get("r5"), None, "the oldest finished outcome makes room");
        assert!(book.get("r9").is_some());
        assert!(book.get("r0").is_some(), "pending outcomes are kept");
    }
}
