//! The access log: one line per request, written when the request is over (its response body ended or was
//! dropped, and its generation, if any, finished), as a `tracing` event of target `sparkd::access`.
//!
//! Invariants:
//! - Every HTTP request gets exactly one line, and every `response.create` received on a WebSocket one more
//!   (the socket's upgrade is its own line, status 101): an [`AccessEntry`] is shared by whatever serves the
//!   request, and the line is written when the last holder drops it, so a stream's line carries its tokens, time
//!   to first token and finish reason, and its duration ends with the stream.
//! - The line names the request (its response id when one was made: `chatcmpl-…`, `resp_…`), the endpoint,
//!   method, path, status, peer, prompt / cached / completion tokens, TTFT and duration; an answer that fails
//!   after its head was sent (status 200) says how it ended in `finish` (`error:<kind>`, `abort` when the client
//!   left).
//! - Probes (`/health`, `/metrics`) are logged at `debug`, everything else at `info`; `RUST_LOG=sparkd::access=off`
//!   silences the log.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::generate::Outcome;

/// Endpoints polled by probes and scrapers, logged at `debug`.
const PROBES: [&str; 2] = ["health", "metrics"];

/// Where a request came from and what it asked, known when it arrives.
#[derive(Clone, Debug)]
pub struct AccessStart {
    pub method: String,
    pub path: String,
    pub peer: Option<SocketAddr>,
}

/// One request's access-log line in the making; cloned by whatever serves the request.
#[derive(Clone, Debug)]
pub struct AccessEntry(Arc<Entry>);

#[derive(Debug)]
struct Entry {
    start: AccessStart,
    arrival: Instant,
    fields: Mutex<Fields>,
}

#[derive(Debug, Default)]
struct Fields {
    endpoint: &'static str,
    status: u16,
    id: Option<String>,
    tokens: Option<Tokens>,
    finish: Option<String>,
}

#[derive(Clone, Copy, Debug)]
struct Tokens {
    prompt: usize,
    cached: usize,
    completion: usize,
    ttft_ms: f64,
}

impl AccessEntry {
    /// The entry of a request that arrived now.
    pub fn new(start: AccessStart) -> Self {
        AccessEntry(Arc::new(Entry { start, arrival: Instant::now(), fields: Mutex::default() }))
    }

    /// The peer the request came from.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.0.start.peer
    }

    /// The endpoint that answered and the status of its answer's head.
    pub fn answered(&self, endpoint: &'static str, status: u16) {
        let mut f = self.fields();
        f.endpoint = endpoint;
        f.status = status;
    }

    /// The id the client sees for this request's response.
    pub fn name(&self, id: &str) {
        self.fields().id = Some(id.to_owned());
    }

    /// The request's generation finished.
    pub fn finished(&self, outcome: &Outcome) {
        let mut f = self.fields();
        f.tokens = Some(Tokens {
            prompt: outcome.usage.prompt_tokens,
            cached: outcome.usage.cached_tokens,
            completion: outcome.usage.completion_tokens,
            ttft_ms: outcome.timings.ttft_ms,
        });
        f.finish = Some(outcome.finish_reason.to_owned());
    }

    /// The request's generation ended without an outcome: `how` is `abort` (the client left) or `error:<kind>`.
    pub fn ended(&self, how: String) {
        self.fields().finish.get_or_insert(how);
    }

    fn fields(&self) -> std::sync::MutexGuard<'_, Fields> {
        self.0.fields.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let f = self.fields.get_mut().unwrap_or_else(PoisonError::into_inner);
        let duration_ms = self.arrival.elapsed().as_secs_f64() * 1e3;
        let id = f.id.as_deref().unwrap_or("-");
        let peer = self.start.peer.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let (method, path, endpoint, status) = (&self.start.method, &self.start.path, f.endpoint, f.status);
        let duration_ms = round2(duration_ms);
        match (f.tokens, f.finish.as_deref(), PROBES.contains(&endpoint)) {
            (_, _, true) => tracing::debug!(
                target: "sparkd::access", id, method, path, endpoint, status, peer, duration_ms, "request"
            ),
            (Some(t), finish, false) => tracing::info!(
                target: "sparkd::access", id, method, path, endpoint, status, peer, prompt_tokens = t.prompt,
                cached_tokens = t.cached, completion_tokens = t.completion, ttft_ms = round2(t.ttft_ms), duration_ms,
                finish = finish.unwrap_or("-"), "request"
            ),
            (None, Some(finish), false) => tracing::info!(
                target: "sparkd::access", id, method, path, endpoint, status, peer, duration_ms, finish, "request"
            ),
            (None, None, false) => tracing::info!(
                target: "sparkd::access", id, method, path, endpoint, status, peer, duration_ms, "request"
            ),
        }
    }
}

/// `v` to two decimals, for a log line a person reads.
fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::generate::Timings;
    use crate::engine::types::Usage;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    /// Collects the formatted lines of target `sparkd::access`.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(run: impl FnOnce()) -> String {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .with_filter(tracing_subscriber::EnvFilter::new("sparkd::access=info")),
        );
        tracing::subscriber::with_default(subscriber, run);
        let bytes = lines.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    fn start(path: &str) -> AccessStart {
        AccessStart { method: "POST".into(), path: path.into(), peer: Some("127.0.0.1:4242".parse().unwrap()) }
    }

    #[test]
    fn one_line_when_the_last_holder_drops_it_with_the_generations_numbers() {
        let text = logged(|| {
            let entry = AccessEntry::new(start("/v1/chat/completions"));
            entry.answered("chat_completions", 200);
            let stream = entry.clone();
            drop(entry);
            stream.name("chatcmpl-1");
            let usage = Usage { prompt_tokens: 12, cached_tokens: 8, completion_tokens: 5, ..Usage::default() };
            let timings = Timings { ttft_ms: 3.456, ..Timings::default() };
            stream.finished(&Outcome { finish_reason: "stop", usage, timings, spec: None });
            drop(stream);
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        for field in [
            "id=\"chatcmpl-1\"",
            "endpoint=\"chat_completions\"",
            "status=200",
            "peer=\"127.0.0.1:4242\"",
            "prompt_tokens=12",
            "cached_tokens=8",
            "completion_tokens=5",
            "ttft_ms=3.46",
            "finish=\"stop\"",
        ] {
            assert!(text.contains(field), "{field} missing from {text}");
        }
    }

    #[test]
    fn a_stream_that_failed_after_its_head_says_how_and_probes_are_not_info() {
        let text = logged(|| {
            let entry = AccessEntry::new(start("/v1/responses"));
            entry.answered("responses", 200);
            entry.ended("error:engine_unavailable".into());
            entry.ended("abort".into());
            drop(entry);
            let probe = AccessEntry::new(start("/metrics"));
            probe.answered("metrics", 200);
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("finish=\"error:engine_unavailable\""), "the first ending is kept: {text}");
        assert!(!text.contains("prompt_tokens"), "{text}");
    }
}
