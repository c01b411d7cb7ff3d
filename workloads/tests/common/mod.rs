//! Test helpers: a toy tokenizer, fixture traces, and a fake transport under tokio's paused clock.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sparkd_workloads::dag::{weka_session, Session};
use sparkd_workloads::error::{ReplayError, Result};
use sparkd_workloads::synth::{Synth, TokenCodec, TokenPool};
use sparkd_workloads::trace::parse_weka;
use sparkd_workloads::transport::{Connection, Transport, TurnOutcome, TurnRequest};
use tokio::time::Instant;

/// A toy vocabulary: id `i` is the word `" q" + three base-26 letters`; `encode` inverts it.
pub struct ToyCodec;

fn word(i: u32) -> String {
    let mut s = String::from(" q");
    for shift in [2u32, 1, 0] {
        s.push((b'a' + ((i / 26u32.pow(shift)) % 26) as u8) as char);
    }
    s
}

impl TokenCodec for ToyCodec {
    fn vocab_size(&self) -> u32 {
        2000
    }
    fn token_text(&self, id: u32) -> Option<String> {
        Some(word(id))
    }
    fn encode(&self, text: &str) -> Vec<u32> {
        text.split(' ')
            .filter(|w| !w.is_empty())
            .map(|w| w.bytes().skip(1).fold(0u32, |acc, b| acc * 26 + u32::from(b - b'a')))
            .collect()
    }
}

pub fn toy_synth(token_scale: f64) -> Arc<Synth> {
    Arc::new(Synth::new(TokenPool::build(&ToyCodec).expect("toy pool"), token_scale).expect("synth"))
}

/// A request JSON object for fixtures.
pub fn req(t: f64, input: u32, out: u32, hash_ids: &[u64], think: f64) -> serde_json::Value {
    serde_json::json!({"t": t, "type": "n", "model": "m", "in": input, "out": out, "hash_ids": hash_ids,
        "input_types": ["text"], "output_types": ["text"], "stop": "end_turn", "api_time": 1.0, "think_time": think})
}

pub fn subagent(t: f64, agent: &str, requests: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({"t": t, "type": "subagent", "agent_id": agent, "subagent_type": "Explore",
        "duration_ms": null, "total_tokens": null, "tool_use_count": null, "status": "async_launched",
        "models": ["m"], "tool_tokens": 64, "system_tokens": 64, "requests": requests})
}

pub fn trace(id: &str, tool: u32, system: u32, requests: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({"id": id, "models": ["m"], "block_size": 64, "hash_id_scope": "local",
        "tool_tokens": tool, "system_tokens": system, "requests": requests})
}

pub fn session(v: &serde_json::Value) -> Session {
    let bytes = serde_json::to_vec(v).expect("json");
    weka_session(&parse_weka(std::path::Path::new("fixture.json"), &bytes).expect("fixture parses"))
}

/// One request the fake server saw.
#[derive(Clone, Debug)]
pub struct Seen {
    pub stream_id: String,
    pub at: Instant,
    pub done: Instant,
    pub max_tokens: usize,
    pub previous: Option<String>,
    pub words: usize,
    pub messages: usize,
}

/// Decides, per arrival index and request, whether the fake server fails it.
pub type FailRule = dyn Fn(usize, &TurnRequest) -> Option<ReplayError> + Send + Sync;

/// A fake server: each request takes `service`; `fail` decides per request (by arrival index).
#[derive(Clone)]
pub struct FakeTransport {
    pub service: Duration,
    pub log: Arc<Mutex<Vec<Seen>>>,
    pub fail: Arc<FailRule>,
    pub start: Instant,
}

impl FakeTransport {
    pub fn new(service: Duration) -> Self {
        FakeTransport { service, log: Arc::default(), fail: Arc::new(|_, _| None), start: Instant::now() }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.log.lock().expect("log").clone()
    }

    /// Seconds since the transport was made, for readable asserts.
    pub fn secs(&self, t: Instant) -> f64 {
        (t - self.start).as_secs_f64()
    }
}

impl Transport for FakeTransport {
    type Conn = FakeTransport;
    async fn connect(&self) -> Result<FakeTransport> {
        Ok(self.clone())
    }
}

impl Connection for FakeTransport {
    async fn send(&self, request: TurnRequest) -> Result<TurnOutcome> {
        let at = Instant::now();
        let index = self.log.lock().expect("log").len();
        let failure = (self.fail)(index, &request);
        let words: usize = request.messages.iter().map(|(_, t)| t.split(' ').filter(|w| !w.is_empty()).count()).sum();
        self.log.lock().expect("log").push(Seen {
            stream_id: request.stream_id.clone(),
            at,
            done: at + self.service,
            max_tokens: request.max_tokens,
            previous: request.previous_response_id.clone(),
            words,
            messages: request.messages.len(),
        });
        tokio::time::sleep(self.service).await;
        if let Some(e) = failure {
            return Err(e);
        }
        let first = at + self.service / 10;
        Ok(TurnOutcome {
            response_id: Some(format!("resp_{index}")),
            first_content: Some(first),
            last_content: Some(at + self.service),
            content_chunks: request.max_tokens,
            prompt_tokens: Some(words as u64),
            completion_tokens: request.max_tokens as u64,
            cached_tokens: Some(0),
            spec: None,
        })
    }
}
