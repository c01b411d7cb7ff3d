//! Helpers shared by the black-box tests: start the real `sparkd` binary, talk to it over loopback.
//!
//! Invariants:
//! - [`Server::start`] runs the real binary (built by cargo for this profile, or `$SPARKD_BIN`) with `--port 0`,
//!   learns the port from its "listening on" log line, waits for `GET /health`, and kills the process on drop.
//! - Clients are real: hyper over TCP for HTTP/SSE, tokio-tungstenite for WebSocket.
//! - [`chromium`] drives a headless Chromium over the DevTools protocol to check that a page renders cleanly.
//! - [`PromText::parse`] is a small, strict parser of the Prometheus text format (version 0.0.4): a malformed
//!   line is an error, so a test that parses `/metrics` also checks its syntax.
//! - [`prometheus::Prometheus`] runs a real Prometheus on loopback for the dashboard tests.
//! - [`nginx::Nginx`] runs a real nginx on loopback in front of daemons; [`http_answer`] talks to any base URL
//!   and keeps the answer's headers.

pub mod chromium;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;

pub mod nginx;
pub mod prometheus;

/// How long a server may take to come up (the CPU model is built at start).
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// The `sparkd` binary: `$SPARKD_BIN`, else `target/<profile>/sparkd` next to this test executable, built once
/// per test process with the cargo that runs the tests.
pub fn sparkd_bin() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| locate_or_build().map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow!(e))
}

fn locate_or_build() -> Result<PathBuf> {
    if let Ok(bin) = std::env::var("SPARKD_BIN") {
        return Ok(PathBuf::from(bin));
    }
    // target/<profile>/deps/<test exe>
    let exe = std::env::current_exe()?;
    let profile_dir =
        exe.parent().and_then(|d| d.parent()).context("test executable has no target/<profile> parent")?;
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "-p", "sparkd", "--bin", "sparkd"]);
    if release {
        cmd.arg("--release");
    }
    if let Some(target_dir) = profile_dir.parent() {
        cmd.env("CARGO_TARGET_DIR", target_dir);
    }
    let status = cmd.status().context("running cargo build for the sparkd binary")?;
    if !status.success() {
        bail!("cargo build -p sparkd --bin sparkd failed ({status})");
    }
    let bin = profile_dir.join(format!("sparkd{}", std::env::consts::EXE_SUFFIX));
    if !bin.is_file() {
        bail!("{} does not exist after cargo build", bin.display());
    }
    Ok(bin)
}

/// One HTTP answer with its headers; the body as text.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub text: String,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.text).with_context(|| format!("body is not JSON: {:?}", self.text))
    }

    /// A header's value as text (`None`: absent or not visible ASCII).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// How long [`http_answer`] waits for a whole answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// Sends `method path` with a JSON `body` and extra `headers` to `base` (`http://host:port`: a daemon or a proxy
/// in front of one) on a fresh connection, and reads the whole answer (at most [`ANSWER_TIMEOUT`]).
pub async fn http_answer(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> Result<Answer> {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let mut req =
        Request::builder().method(method).uri(format!("{base}{path}")).header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let exchange = async {
        let resp = client.request(req.body(Full::new(bytes))?).await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok::<_, anyhow::Error>(Answer { status, headers, text: String::from_utf8(body.to_vec())? })
    };
    tokio::time::timeout(ANSWER_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{method} {base}{path}: no whole answer within {ANSWER_TIMEOUT:?}"))?
}

/// A running `sparkd serve`.
pub struct Server {
    child: Child,
    pub port: u16,
    pub base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Every log line the server printed so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `sparkd serve --port 0 ARGS...` and waits until `/health` answers.
    pub async fn start(args: &[&str]) -> Result<Server> {
        let bin = sparkd_bin()?;
        let mut child = Command::new(&bin)
            .arg("serve")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env("RUST_LOG", std::env::var("SPARKD_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stderr = child.stderr.take().context("no stderr pipe")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    // The address ends the text line; a JSON line goes on after it.
                    let addr: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_hexdigit() || matches!(c, '.' | ':' | '[' | ']'))
                        .collect();
                    let port = addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
                    let _ = port_tx.send(port);
                }
                if let Ok(mut l) = sink.lock() {
                    l.push(line);
                }
            }
        });
        let started = Instant::now();
        let port = loop {
            if let Ok(Some(port)) = port_rx.recv_timeout(Duration::from_millis(100)) {
                break port;
            }
            if let Some(status) = child.try_wait()? {
                // The reader ends when the pipe closes: every line the server printed is in the log then.
                let _ = reader.join();
                let log = log.lock().map(|l| l.join("\n")).unwrap_or_default();
                bail!("sparkd exited ({status}) before listening:\n{log}");
            }
            if started.elapsed() > STARTUP_TIMEOUT {
                let _ = child.kill();
                bail!("sparkd did not start listening within {STARTUP_TIMEOUT:?}");
            }
        };
        let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let server = Server { child, port, base: format!("http://127.0.0.1:{port}"), client, log };
        loop {
            if let Ok((200, _)) = server.get("/health").await {
                return Ok(server);
            }
            if started.elapsed() > STARTUP_TIMEOUT {
                bail!("/health did not answer 200 within {STARTUP_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The server's resident memory (`VmRSS`), in MiB.
    pub fn rss_mb(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb / 1024)
            .context("no VmRSS line in /proc/PID/status")
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> Result<std::process::ExitStatus> {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status()?;
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!("sparkd did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    async fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<hyper::Response<Incoming>> {
        self.request_with(method, path, body, &[]).await
    }

    async fn request_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<hyper::Response<Incoming>> {
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        Ok(self.client.request(req.body(Full::new(bytes))?).await?)
    }

    /// Any method with extra `headers` (an API key, an `Origin`): status and body JSON.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<(u16, Value)> {
        let resp = self.request_with(method, path, body, headers).await?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        let value = serde_json::from_slice(&bytes)
            .with_context(|| format!("body is not JSON: {:?}", String::from_utf8_lossy(&bytes)))?;
        Ok((status, value))
    }

    /// GET: status and body text.
    pub async fn get(&self, path: &str) -> Result<(u16, String)> {
        let resp = self.request("GET", path, None).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8(body.to_vec())?))
    }

    /// GET a JSON document: status and body JSON.
    pub async fn get_json(&self, path: &str) -> Result<(u16, Value)> {
        self.json_answer("GET", path, None).await
    }

    /// DELETE: status and body JSON.
    pub async fn delete(&self, path: &str) -> Result<(u16, Value)> {
        self.json_answer("DELETE", path, None).await
    }

    async fn json_answer(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        self.send(method, path, body, &[]).await
    }

    /// POST a JSON body: status and body JSON.
    pub async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        self.json_answer("POST", path, Some(body)).await
    }

    /// POST a body with a raw (possibly invalid) text.
    pub async fn post_raw(&self, path: &str, body: &str) -> Result<(u16, Value)> {
        let req = Request::builder()
            .method("POST")
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        let resp = self.client.request(req).await?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, serde_json::from_slice(&bytes)?))
    }

    /// POST and open the response as an SSE stream (status must be 200).
    pub async fn sse(&self, path: &str, body: &Value) -> Result<SseStream> {
        let resp = self.request("POST", path, Some(body)).await?;
        let status = resp.status().as_u16();
        if status != 200 {
            let bytes = resp.into_body().collect().await?.to_bytes();
            bail!("status {status}: {}", String::from_utf8_lossy(&bytes));
        }
        let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        if !ct.starts_with("text/event-stream") {
            bail!("content-type is {ct:?}, not text/event-stream");
        }
        Ok(SseStream { body: resp.into_body(), buf: Vec::new() })
    }

    /// POST and read the whole SSE stream: every `data:` payload ("[DONE]" included as a string value).
    pub async fn sse_all(&self, path: &str, body: &Value) -> Result<Vec<SseEvent>> {
        let mut s = self.sse(path, body).await?;
        let mut out = Vec::new();
        while let Some(ev) = s.next().await? {
            out.push(ev);
        }
        Ok(out)
    }

    /// Scrapes and parses `/metrics`.
    pub async fn metrics(&self) -> Result<PromText> {
        let (status, text) = self.get("/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        PromText::parse(&text)
    }

    /// Opens the Responses WebSocket.
    pub async fn websocket(&self) -> Result<WsClient> {
        self.websocket_with(&[]).await
    }

    /// Opens the Responses WebSocket with extra handshake `headers`.
    pub async fn websocket_with(&self, headers: &[(&'static str, &str)]) -> Result<WsClient> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut req = format!("ws://127.0.0.1:{}/v1/responses", self.port).into_client_request()?;
        for (name, value) in headers {
            req.headers_mut().insert(*name, value.parse()?);
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await?;
        Ok(WsClient { ws })
    }

    /// Polls `/metrics` until `pred` holds (or fails after `timeout`).
    pub async fn wait_metrics(&self, timeout: Duration, pred: impl Fn(&PromText) -> bool) -> Result<PromText> {
        let started = Instant::now();
        loop {
            let m = self.metrics().await?;
            if pred(&m) {
                return Ok(m);
            }
            if started.elapsed() > timeout {
                bail!("metrics condition not reached within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One SSE event: its `event:` name (if any) and its `data:` payload.
#[derive(Clone, Debug)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: Value,
}

impl SseEvent {
    pub fn is_done(&self) -> bool {
        self.data == Value::String("[DONE]".into())
    }
}

/// An SSE body read incrementally.
pub struct SseStream {
    body: Incoming,
    buf: Vec<u8>,
}

impl SseStream {
    /// The next event, or `None` at the end of the body.
    pub async fn next(&mut self) -> Result<Option<SseEvent>> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..end + 2).collect();
                let text = String::from_utf8(block)?;
                let mut event = None;
                let mut data = String::new();
                for line in text.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        event = Some(v.to_string());
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                if event.is_none() && data.is_empty() {
                    continue; // a comment (`: queued`), as SSE allows
                }
                let data = if data == "[DONE]" { Value::String(data) } else { serde_json::from_str(&data)? };
                return Ok(Some(SseEvent { event, data }));
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(bytes) = frame?.into_data() {
                        self.buf.extend_from_slice(&bytes);
                    }
                }
                None if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                None => bail!("SSE body ended inside an event: {:?}", String::from_utf8_lossy(&self.buf)),
            }
        }
    }
}

/// The concatenated `delta.content` (chat) or `text` (completions) of SSE chunks.
pub fn sse_text(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter_map(|e| e.data.get("choices")?.get(0).cloned())
        .filter_map(|c| {
            c.get("delta")
                .and_then(|d| d.get("content"))
                .or_else(|| c.get("text"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .collect()
}

/// What a WebSocket delivers next.
#[derive(Debug)]
pub enum WsIncoming {
    Event(Value),
    /// The socket closed, with the close frame's code when there was one.
    Closed(Option<u16>),
}

/// A Responses WebSocket client.
pub struct WsClient {
    ws: tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
}

impl WsClient {
    pub async fn send(&mut self, event: &Value) -> Result<()> {
        self.ws.send(Message::Text(event.to_string().into())).await?;
        Ok(())
    }

    /// The next JSON event (pings skipped); `None` when the socket closed.
    pub async fn recv(&mut self) -> Result<Option<Value>> {
        Ok(match self.recv_or_close().await? {
            WsIncoming::Event(event) => Some(event),
            WsIncoming::Closed(_) => None,
        })
    }

    /// The next JSON event, or the close and its code (`None`: closed without a close frame or code).
    pub async fn recv_or_close(&mut self) -> Result<WsIncoming> {
        loop {
            match tokio::time::timeout(Duration::from_secs(60), self.ws.next()).await? {
                Some(Ok(Message::Text(t))) => return Ok(WsIncoming::Event(serde_json::from_str(t.as_str())?)),
                Some(Ok(Message::Close(frame))) => return Ok(WsIncoming::Closed(frame.map(|f| u16::from(f.code)))),
                None => return Ok(WsIncoming::Closed(None)),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.into()),
            }
        }
    }

    /// Receives until a terminal event (`response.completed`, `response.incomplete`) or `error` for each of
    /// `streams` stream ids; returns every event received.
    pub async fn recv_until_done(&mut self, streams: usize) -> Result<Vec<Value>> {
        let mut events = Vec::new();
        let mut done = 0;
        while done < streams {
            let ev = self.recv().await?.context("socket closed early")?;
            let ty = ev["type"].as_str().unwrap_or_default();
            if matches!(ty, "response.completed" | "response.incomplete" | "error") {
                done += 1;
            }
            events.push(ev);
        }
        Ok(events)
    }

    pub async fn close(mut self) -> Result<()> {
        self.ws.close(None).await?;
        Ok(())
    }
}

/// One sample of the Prometheus text format.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed `/metrics` page.
#[derive(Clone, Debug, Default)]
pub struct PromText {
    /// Metric family name → type (`counter`, `gauge`, `histogram`, `summary`, `untyped`).
    pub types: BTreeMap<String, String>,
    /// Metric family name → help text.
    pub help: BTreeMap<String, String>,
    pub samples: Vec<Sample>,
}

impl PromText {
    /// Parses the text exposition format; any malformed line is an error naming it.
    pub fn parse(text: &str) -> Result<PromText> {
        let mut out = PromText::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, ty) = rest.split_once(' ').with_context(|| format!("line {}: bad TYPE: {line}", n + 1))?;
                if !matches!(ty, "counter" | "gauge" | "histogram" | "summary" | "untyped") {
                    bail!("line {}: unknown type {ty}", n + 1);
                }
                out.types.insert(name.to_string(), ty.to_string());
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                out.help.insert(name.to_string(), help.to_string());
            } else if line.starts_with('#') {
                continue;
            } else {
                out.samples.push(parse_sample(line).with_context(|| format!("line {}: {line}", n + 1))?);
            }
        }
        Ok(out)
    }

    /// Samples of exactly `name` whose labels include all of `labels`.
    pub fn find<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The sum of the matching samples' values (`None` when there are none).
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = false;
        let sum = self.find(name, labels).inspect(|_| found = true).map(|s| s.value).sum();
        found.then_some(sum)
    }
}

/// A sample line, parsed by the replay tool's parser (`sparkd_workloads::prometheus`), its labels by name.
fn parse_sample(line: &str) -> Result<Sample> {
    let sample = sparkd_workloads::prometheus::parse_sample(line).map_err(anyhow::Error::msg)?;
    Ok(Sample { name: sample.name, labels: sample.labels.into_iter().collect(), value: sample.value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_prometheus_text_format() {
        let text = "# HELP vllm:x_total Things.\n# TYPE vllm:x_total counter\nvllm:x_total{engine=\"0\",model_name=\"m \\\"q\\\"\"} 5\n\
                    # TYPE h histogram\nh_bucket{le=\"+Inf\"} 3\nh_sum 1.5\nh_count 3\n";
        let p = PromText::parse(text).unwrap();
        assert_eq!(p.types["vllm:x_total"], "counter");
        assert_eq!(p.help["vllm:x_total"], "Things.");
        assert_eq!(p.value("vllm:x_total", &[("model_name", "m \"q\"")]), Some(5.0));
        assert_eq!(p.value("h_bucket", &[("le", "+Inf")]), Some(3.0));
        assert_eq!(p.value("h_count", &[]), Some(3.0));
        assert_eq!(p.value("missing", &[]), None);
        assert!(PromText::parse("bad line without value{").is_err());
        assert!(PromText::parse("9name 1").is_err());
        assert!(PromText::parse("# TYPE x wrong").is_err());
    }
}
