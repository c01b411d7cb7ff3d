//! How much of each admitted request's prompt the engine found already computed, counted for `/metrics` in vLLM's
//! terms (`vllm:prefix_cache_queries_total` / `_hits_total`: tokens looked up / tokens served from a cache) and,
//! for continuations, on sparkd's session-cache counters.
//!
//! Invariants:
//! - A request's lookup is counted once, when it is given its state, over the tokens a cache could have served:
//!   all of its context but the last token, which is always fed (it produces the first output token).
//! - `vllm:prefix_cache_*` counts every lookup, whichever store served it: a kept response's state
//!   (`previous_response_id`) or a prefix-cache snapshot. A continuation reuses its kept tokens as a resent chat
//!   reuses its cached prefix, so the hit rate over both agrees with the `cached_tokens` the responses report. A
//!   request for which neither store was consulted (no continuation, prefix cache disabled) is not a query.
//! - `sparkd:session_cache_*` counts continuations only: queries are their reusable tokens, hits the tokens
//!   restored from the kept state. A kept state dropped from memory (rebuilt by prefill) is a session miss; the
//!   prefix cache may still serve that request, which `vllm:prefix_cache_hits_total` then counts.
//! - The counter handles are taken once, when the engine is made (as `phases::PhaseClock` does), so counting is
//!   four atomic adds, never a registry lookup.

use metrics::{counter, Counter};

use crate::metrics::{
    PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_QUERIES_TOTAL, SESSION_CACHE_HITS_TOTAL, SESSION_CACHE_QUERIES_TOTAL,
};

/// One admitted request's lookup: what it could have reused and what it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lookup {
    /// Context tokens a cache could have served (all but the last).
    pub reusable: usize,
    /// Tokens restored (a kept state's length, or a prefix snapshot's).
    pub restored: usize,
}

/// The reuse counters of one engine.
pub(crate) struct ReuseCounters {
    prefix_queries: Counter,
    prefix_hits: Counter,
    session_queries: Counter,
    session_hits: Counter,
}

impl ReuseCounters {
    /// Takes the handles from the recorder installed now.
    pub fn new() -> Self {
        ReuseCounters {
            prefix_queries: counter!(PREFIX_CACHE_QUERIES_TOTAL),
            prefix_hits: counter!(PREFIX_CACHE_HITS_TOTAL),
            session_queries: counter!(SESSION_CACHE_QUERIES_TOTAL),
            session_hits: counter!(SESSION_CACHE_HITS_TOTAL),
        }
    }

    /// A continuation's lookup of its kept state (`restored` 0 when the state was dropped or unusable).
    pub fn continuation(&self, lookup: Lookup) {
        self.session_queries.increment(lookup.reusable as u64);
        self.session_hits.increment(lookup.restored as u64);
    }

    /// A request's whole lookup, whichever store served it.
    pub fn prompt(&self, lookup: Lookup) {
        self.prefix_queries.increment(lookup.reusable as u64);
        self.prefix_hits.increment(lookup.restored as u64);
    }
}
