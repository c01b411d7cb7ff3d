//! Delivering a request's events to its client: the per-request backlog behind the bounded event channel, the
//! slow-reader bound (`--max-event-backlog`), and what happens when a client leaves (a waiting request is dropped
//! before it is scheduled; a running one is cancelled and its state freed, a state it was to keep included).
//!
//! Invariants: events of a request are delivered in order; a failed send means the client left; a request whose
//! client leaves `max_event_backlog` events unread is cancelled with `SlowReader` as its one remaining event.

use metrics::counter;
use tokio::sync::mpsc::error::TrySendError;

use super::super::types::{EngineError, EngineEvent, FinishReason, RequestId};
use super::EngineCore;
use crate::metrics as names;

impl EngineCore {
    /// Drops the waiting requests whose client went away (their event channel is closed), so that nothing is
    /// prefilled for nobody; one that asked to be kept is not (it never started: there is nothing to continue).
    /// A running request's departure shows when its next event cannot be sent.
    pub(super) fn drop_abandoned(&mut self) {
        let gone: Vec<RequestId> =
            self.scheduler.waiting_ids().filter(|id| self.live.get(id).is_some_and(|l| l.events.is_closed())).collect();
        for id in gone {
            self.client_gone(id);
        }
    }

    /// Queues an event for a request, delivering what its channel has room for.
    pub(super) fn emit(&mut self, id: RequestId, event: EngineEvent) {
        let Some(live) = self.live.get_mut(&id) else { return };
        if matches!(event, EngineEvent::Finished { .. } | EngineEvent::Failed(_)) {
            live.done = true;
        }
        live.backlog.push_back(event);
        if !self.deliver(id) {
            self.client_gone(id);
            return;
        }
        let limit = self.config.max_event_backlog;
        if self.live.get(&id).is_some_and(|l| !l.done && l.backlog.len() > limit) {
            self.slow_reader(id);
        }
    }

    /// Cancels a request whose client left `max_event_backlog` events unread: frees its state (never kept:
    /// the client did not read the response), drops the backlog and leaves `Failed(SlowReader)` as the one
    /// event to deliver, so the memory it held returns now and the client learns why when it reads again.
    pub(super) fn slow_reader(&mut self, id: RequestId) {
        let Some(live) = self.live.get_mut(&id) else { return };
        let error = EngineError::SlowReader { backlog: live.backlog.len() };
        live.backlog.clear();
        live.keep_as = None;
        counter!(names::SLOW_READER_CANCELS_TOTAL).increment(1);
        counter!(names::ERRORS_TOTAL, "kind" => error.kind()).increment(1);
        tracing::warn!(request = %id, "{error}");
        if let Some(finished) = self.scheduler.remove(id, FinishReason::Cancelled) {
            self.release(finished);
        }
        if let Some(live) = self.live.get_mut(&id) {
            live.done = true;
            live.backlog.push_back(EngineEvent::Failed(error));
        }
    }

    /// Sends a request's backlog until its channel is full; `false` when the receiver is gone.
    pub(super) fn deliver(&mut self, id: RequestId) -> bool {
        let Some(live) = self.live.get_mut(&id) else { return true };
        while let Some(event) = live.backlog.pop_front() {
            match live.events.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    live.backlog.push_front(event);
                    return true;
                }
                Err(TrySendError::Closed(_)) => return false,
            }
        }
        if live.done {
            self.live.remove(&id);
        }
        true
    }

    /// Retries every backlog and cancels requests whose client left.
    pub(super) fn flush_events(&mut self) {
        let ids: Vec<RequestId> = self.live.keys().copied().collect();
        for id in ids {
            let closed = self.live.get(&id).is_some_and(|l| l.events.is_closed());
            if closed || !self.deliver(id) {
                self.client_gone(id);
            }
        }
    }

    /// Cancels a request whose client left and frees its state: one it was to keep too, since nobody received
    /// the response it would be kept under (issue 33: no orphaned kept state).
    pub(super) fn client_gone(&mut self, id: RequestId) {
        let Some(live) = self.live.get_mut(&id) else { return };
        live.backlog.clear();
        if live.done {
            self.live.remove(&id);
            return;
        }
        counter!(names::CLIENT_DISCONNECTS_TOTAL).increment(1);
        live.done = true;
        live.keep_as = None;
        if let Some(finished) = self.scheduler.remove(id, FinishReason::Cancelled) {
            self.release(finished);
        }
        self.live.remove(&id);
    }
}
