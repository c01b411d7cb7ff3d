//! The bound on requests waiting for the engine (`--max-waiting`).
//!
//! Invariants:
//! - A request holds one [`QueueTicket`] from its submission until the engine reports it started (or until the
//!   request ends first: failed, cancelled, client gone); the ticket is released when dropped, so no path leaks
//!   a slot.
//! - At most `max_waiting` tickets exist at once; past that a request is refused before it reaches the engine
//!   ([`ApiError::QueueFull`]: 429 with `Retry-After` over HTTP, an error event on the WebSocket). The count
//!   covers the command queue and the scheduler's waiting queue together, so it is exact, not a sampled gauge.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::error::ApiError;

/// Waiting slots shared by every request of the server.
#[derive(Debug)]
pub struct Admission {
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
}

impl Admission {
    /// At most `max_waiting` requests wait for the engine at once.
    pub fn new(max_waiting: usize) -> Self {
        Admission { waiting: Arc::new(AtomicUsize::new(0)), max_waiting }
    }

    /// A waiting slot, or `QueueFull` when all `max_waiting` are taken.
    pub fn enter(&self) -> Result<QueueTicket, ApiError> {
        // Counted first, so that racing requests never overshoot; a refused one's ticket drops at once.
        let before = self.waiting.fetch_add(1, Ordering::AcqRel);
        let ticket = QueueTicket { waiting: self.waiting.clone() };
        if before >= self.max_waiting {
            return Err(ApiError::QueueFull { max_waiting: self.max_waiting });
        }
        Ok(ticket)
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

/// One waiting slot; dropping it frees the slot.
#[derive(Debug)]
pub struct QueueTicket {
    waiting: Arc<AtomicUsize>,
}

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_freed_by_dropping_the_ticket() {
        let admission = Admission::new(2);
        let a = admission.enter().expect("first slot");
        let b = admission.enter().expect("second slot");
        let refused = admission.enter().expect_err("a third waiter is refused");
        assert_eq!(refused.status(), hyper::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.kind(), "queue_full");
        assert_eq!(admission.waiting(), 2, "a refused request holds no slot");
        drop(a);
        let c = admission.enter().expect("a freed slot is reused");
        drop((b, c));
        assert_eq!(admission.waiting(), 0);
    }
}
