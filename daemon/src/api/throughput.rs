//! The periodic throughput line (`--log-stats-interval`), after vLLM's "Avg prompt throughput … Avg generation
//! throughput …" log: what the server did in the last interval, for an operator reading the log.
//!
//! Invariants:
//! - The counts are the API's own (every generation adds its prompt, cached and generated tokens and its
//!   drafts as the engine reports them), kept in atomics that never reset: a line is the difference of two
//!   snapshots over the time between them, so no count is lost between lines or double-counted.
//! - A generation counts as running from the engine's `Started` until it ends or is dropped ([`Running`]).
//! - A line is written only for an interval in which something happened (tokens moved, or requests ran or
//!   waited), so an idle server's log stays quiet.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::AppState;

/// Counts since start-up, shared by every generation.
#[derive(Debug, Default)]
pub struct Throughput {
    prompt: AtomicU64,
    cached: AtomicU64,
    generated: AtomicU64,
    drafted: AtomicU64,
    accepted: AtomicU64,
    spec_steps: AtomicU64,
    finished: AtomicU64,
    running: AtomicUsize,
}

/// One generation between its start in the engine and its end; dropping it ends it.
#[derive(Debug)]
pub struct Running(Arc<Throughput>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
        self.0.finished.fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of the counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    pub prompt: u64,
    pub cached: u64,
    pub generated: u64,
    pub drafted: u64,
    pub accepted: u64,
    pub spec_steps: u64,
    pub finished: u64,
    pub running: usize,
}

impl Throughput {
    /// A generation the engine started, with its prompt and the part of it served from cache.
    pub fn started(self: &Arc<Self>, prompt: usize, cached: usize) -> Running {
        self.prompt.fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached.fetch_add(cached as u64, Ordering::Relaxed);
        self.running.fetch_add(1, Ordering::Relaxed);
        Running(self.clone())
    }

    /// One step's tokens of a generation, and the drafts verified for them (`drafted` 0 when none were).
    pub fn step(&self, tokens: usize, drafted: usize, accepted: usize) {
        self.generated.fetch_add(tokens as u64, Ordering::Relaxed);
        if drafted > 0 {
            self.drafted.fetch_add(drafted as u64, Ordering::Relaxed);
            self.accepted.fetch_add(accepted as u64, Ordering::Relaxed);
            self.spec_steps.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn totals(&self) -> Totals {
        Totals {
            prompt: self.prompt.load(Ordering::Relaxed),
            cached: self.cached.load(Ordering::Relaxed),
            generated: self.generated.load(Ordering::Relaxed),
            drafted: self.drafted.load(Ordering::Relaxed),
            accepted: self.accepted.load(Ordering::Relaxed),
            spec_steps: self.spec_steps.load(Ordering::Relaxed),
            finished: self.finished.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
        }
    }
}

/// The line for the interval from `before` to `now` (`secs` long, `waiting` requests queued now), or `None`
/// when nothing happened in it.
pub fn line(before: Totals, now: Totals, secs: f64, waiting: usize) -> Option<String> {
    let d = |a: u64, b: u64| b.saturating_sub(a);
    let (prompt, cached, generated) =
        (d(before.prompt, now.prompt), d(before.cached, now.cached), d(before.generated, now.generated));
    let finished = d(before.finished, now.finished);
    if prompt + generated + finished == 0 && now.running == 0 && waiting == 0 {
        return None;
    }
    let secs = secs.max(1e-3);
    let computed = prompt - cached.min(prompt);
    let mut text = format!(
        "prompt {:.1} tok/s computed ({:.1}% of {prompt} prompt tokens from cache), generation {:.1} \
         tok/s, running {}, waiting {waiting}, finished {finished}",
        computed as f64 / secs,
        if prompt == 0 { 0.0 } else { 100.0 * cached as f64 / prompt as f64 },
        generated as f64 / secs,
        now.running,
    );
    let (drafted, steps) = (d(before.drafted, now.drafted), d(before.spec_steps, now.spec_steps));
    if steps > 0 {
        let accepted = d(before.accepted, now.accepted);
        text.push_str(&format!(
            ", speculation: acceptance length {:.2}, {:.1}% of {drafted} drafts accepted",
            1.0 + accepted as f64 / steps as f64,
            100.0 * accepted as f64 / drafted.max(1) as f64
        ));
    }
    Some(text)
}

/// Writes the line every `every` until the server stops.
pub async fn log_every(state: Arc<AppState>, every: Duration) {
    let mut shutdown = state.shutdown.clone();
    let mut before = (Instant::now(), state.throughput.totals());
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = shutdown.changed() => return,
        }
        let now = (Instant::now(), state.throughput.totals());
        let secs = (now.0 - before.0).as_secs_f64();
        if let Some(text) = line(before.1, now.1, secs, state.admission.waiting()) {
            tracing::info!(target: "sparkd::throughput", "{text}");
        }
        before = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_the_difference_of_two_snapshots_and_running_follows_the_guards() {
        let t = Arc::new(Throughput::default());
        let before = t.totals();
        let a = t.started(100, 60);
        let b = t.started(50, 0);
        t.step(1, 0, 0);
        t.step(4, 6, 3);
        t.step(2, 6, 1);
        drop(a);
        let now = t.totals();
        assert_eq!(now.running, 1);
        assert_eq!(now.finished, 1);
        let text = line(before, now, 2.0, 3).expect("something happened");
        assert!(text.starts_with("prompt 45.0 tok/s computed (40.0% of 150 prompt tokens"), "{text}");
        assert!(text.contains("generation 3.5 tok/s, running 1, waiting 3, finished 1"), "{text}");
        assert!(text.contains("acceptance length 3.00, 33.3% of 12 drafts accepted"), "{text}");
        drop(b);
        let later = t.totals();
        assert!(line(now, later, 2.0, 0).is_some(), "a request finished in the interval");
        assert_eq!(line(later, t.totals(), 2.0, 0), None, "an idle interval writes nothing");
        assert!(line(later, t.totals(), 2.0, 1).is_some(), "a waiting request is news");
    }
}
