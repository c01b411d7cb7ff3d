//! Headless Chromium over the DevTools protocol (CDP), to check that a page renders: no script exception, no
//! console or log error, no failed request, no request that leaves the machine, and what a JavaScript
//! expression says about the rendered page.
//!
//! Invariants:
//! - Chromium runs with a fresh profile folder, no sandbox, no GPU, no QUIC and no background networking, and is
//!   killed (and its folder removed) on drop.
//! - Every wait is bounded: the DevTools port file, the WebSocket handshake, each command's answer and the load
//!   event each have a deadline, after which the check fails naming what it waited for.
//! - The page is loaded by one `Page.navigate` after `Runtime`, `Log`, `Network` and `Page` are enabled, so
//!   nothing it does goes unseen.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

/// How long Chromium may take to open its DevTools port.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one CDP command, or the page load, may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// The `chromium` binary on `PATH`, if any.
pub fn chromium_bin() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("chromium")).find(|p| p.is_file())
}

/// What loading a page showed.
#[derive(Debug, Default)]
pub struct PageCheck {
    /// Exceptions, `console.error` calls and error log entries, as text.
    pub errors: Vec<String>,
    /// Requests that failed, and requests to anything but `file:` and `data:` URLs.
    pub bad_requests: Vec<String>,
    /// The value of the probe expression (`returnByValue`).
    pub probe: Value,
}

/// A headless Chromium with a DevTools WebSocket.
pub struct Chromium {
    child: Child,
    profile: tempfile::TempDir,
}

impl Drop for Chromium {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Chromium {
    /// Starts `bin` headless and waits for its DevTools port.
    pub fn start(bin: &Path) -> Result<(Chromium, String)> {
        let profile = tempfile::tempdir()?;
        let child = Command::new(bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut chromium = Chromium { child, profile };
        let port_file = chromium.profile.path().join("DevToolsActivePort");
        let started = Instant::now();
        loop {
            // Line 1: the port; line 2: the browser endpoint's path.
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                let mut lines = text.lines();
                if let (Some(port), Some(path)) = (lines.next(), lines.next()) {
                    return Ok((chromium, format!("ws://127.0.0.1:{}{}", port.trim(), path.trim())));
                }
            }
            if let Some(status) = chromium.child.try_wait()? {
                bail!("chromium exited ({status}) before opening its DevTools port");
            }
            if started.elapsed() > START_TIMEOUT {
                bail!("chromium wrote no {} within {START_TIMEOUT:?}", port_file.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One CDP connection: commands with ids, events kept in arrival order.
struct Cdp {
    socket: Socket,
    next_id: u64,
    events: Vec<Value>,
}

impl Cdp {
    async fn next_message(&mut self, deadline: Instant, waiting_for: &str) -> Result<Value> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = tokio::time::timeout(left, self.socket.next())
                .await
                .map_err(|_| anyhow!("no {waiting_for} within {STEP_TIMEOUT:?}"))?
                .ok_or_else(|| anyhow!("the DevTools socket closed while waiting for {waiting_for}"))??;
            if let Message::Text(text) = msg {
                return Ok(serde_json::from_str(text.as_str())?);
            }
        }
    }

    /// Sends a command (to `session` when given) and waits for its answer; events meanwhile are kept.
    async fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Result<Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut command = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            command["sessionId"] = json!(s);
        }
        self.socket.send(Message::text(command.to_string())).await?;
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let msg = self.next_message(deadline, &format!("answer to {method}")).await?;
            if msg.get("id").and_then(Value::as_u64) == Some(id) {
                if let Some(err) = msg.get("error") {
                    bail!("{method} failed: {err}");
                }
                return Ok(msg.get("result").cloned().unwrap_or(Value::Null));
            }
            self.events.push(msg);
        }
    }

    /// Waits for event `method`, keeping every event.
    async fn wait_event(&mut self, method: &str) -> Result<()> {
        if self.events.iter().any(|e| e["method"] == method) {
            return Ok(());
        }
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let msg = self.next_message(deadline, method).await?;
            let found = msg["method"] == method;
            self.events.push(msg);
            if found {
                return Ok(());
            }
        }
    }
}

/// Loads `page` in a new tab of a headless Chromium (`bin`), waits for its load event, then evaluates `probe`
/// in it.
pub async fn check_page(bin: &Path, page: &Path, probe: &str) -> Result<PageCheck> {
    let (_chromium, endpoint) = Chromium::start(bin)?;
    let (socket, _) = tokio::time::timeout(STEP_TIMEOUT, tokio_tungstenite::connect_async(endpoint.as_str()))
        .await
        .map_err(|_| anyhow!("the DevTools handshake took over {STEP_TIMEOUT:?}"))??;
    let mut cdp = Cdp { socket, next_id: 0, events: Vec::new() };
    let target = cdp.call(None, "Target.createTarget", json!({"url": "about:blank"})).await?;
    let target_id = target["targetId"].as_str().context("Target.createTarget gave no targetId")?.to_owned();
    let attached = cdp.call(None, "Target.attachToTarget", json!({"targetId": target_id, "flatten": true})).await?;
    let session = attached["sessionId"].as_str().context("Target.attachToTarget gave no sessionId")?.to_owned();
    let s = Some(session.as_str());
    for domain in ["Runtime", "Log", "Network", "Page"] {
        cdp.call(s, &format!("{domain}.enable"), json!({})).await?;
    }
    let page = std::fs::canonicalize(page)?;
    let url = format!("file://{}", page.display());
    let nav = cdp.call(s, "Page.navigate", json!({"url": url})).await?;
    if let Some(err) = nav.get("errorText") {
        bail!("Page.navigate {url}: {err}");
    }
    cdp.wait_event("Page.loadEventFired").await?;
    let probe = cdp
        .call(s, "Runtime.evaluate", json!({"expression": probe, "returnByValue": true, "awaitPromise": true}))
        .await?;
    if let Some(exception) = probe.get("exceptionDetails") {
        bail!("the probe threw: {exception}");
    }
    let mut check = PageCheck { probe: probe["result"]["value"].clone(), ..PageCheck::default() };
    for event in &cdp.events {
        let params = &event["params"];
        match event["method"].as_str().unwrap_or("") {
            "Runtime.exceptionThrown" => check.errors.push(format!("exception: {}", params["exceptionDetails"])),
            "Runtime.consoleAPICalled" if params["type"] == "error" => {
                check.errors.push(format!("console.error: {}", params["args"]))
            }
            "Log.entryAdded" if params["entry"]["level"] == "error" => {
                check.errors.push(format!("log: {}", params["entry"]["text"]))
            }
            "Network.loadingFailed" => check.bad_requests.push(format!("failed: {params}")),
            "Network.requestWillBeSent" => {
                let url = params["request"]["url"].as_str().unwrap_or("");
                if !(url.starts_with("file:") || url.starts_with("data:")) {
                    check.bad_requests.push(format!("left the machine: {url}"));
                }
            }
            _ => {}
        }
    }
    Ok(check)
}
