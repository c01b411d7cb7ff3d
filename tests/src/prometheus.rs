//! A real Prometheus for black-box tests: the `prometheus` binary on loopback, queried through its HTTP API.
//!
//! Invariants:
//! - [`Prometheus::start`] listens on 127.0.0.1 only, on a port free when it is chosen, with its configuration and
//!   TSDB under a folder the caller owns; it waits (at most [`PROMETHEUS_STARTUP`]) for `/-/ready`, and the process
//!   is killed when the value is dropped.
//! - Every API call is one bounded HTTP request ([`API_TIMEOUT`]); an answer whose `status` is not `success` is an
//!   error naming the call and Prometheus's own error text.
//! - Query parameters are form-encoded here (every byte but RFC 3986's unreserved ones percent-encoded), so any
//!   PromQL travels unchanged.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// How long Prometheus may take to become ready.
pub const PROMETHEUS_STARTUP: Duration = Duration::from_secs(60);
/// How long one API call may take.
pub const API_TIMEOUT: Duration = Duration::from_secs(30);

/// The first file called `name` in a folder of `$PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}

/// One sample of a query answer: the series' labels and its value (`NaN` and `±Inf` included as they are).
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub labels: serde_json::Map<String, Value>,
    pub value: f64,
}

/// A running Prometheus.
pub struct Prometheus {
    child: Child,
    pub base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Every line Prometheus logged so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Prometheus {
    /// Writes `config` (Prometheus YAML) to `dir/prometheus.yml` and starts `binary` on it with its TSDB in
    /// `dir/data`, then waits until it is ready.
    pub async fn start(binary: &Path, config: &str, dir: &Path) -> Result<Prometheus> {
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).with_context(|| format!("writing {}", config_path.display()))?;
        let port = free_port()?;
        let mut child = Command::new(binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stderr = child.stderr.take().context("no stderr pipe")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut l) = sink.lock() {
                    l.push(line);
                }
            }
        });
        let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let mut prometheus = Prometheus { child, base: format!("http://127.0.0.1:{port}"), client, log };
        let started = Instant::now();
        loop {
            if let Ok((200, _)) = prometheus.get("/-/ready").await {
                return Ok(prometheus);
            }
            if let Some(status) = prometheus.child.try_wait()? {
                bail!("prometheus exited ({status}) before it was ready:\n{}", prometheus.log_text());
            }
            if started.elapsed() > PROMETHEUS_STARTUP {
                bail!("prometheus was not ready within {PROMETHEUS_STARTUP:?}:\n{}", prometheus.log_text());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Everything Prometheus logged so far, one line each.
    pub fn log_text(&self) -> String {
        self.log.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    async fn get(&self, path_and_query: &str) -> Result<(u16, String)> {
        let req = Request::get(format!("{}{path_and_query}", self.base)).body(Full::new(Bytes::new()))?;
        let resp = tokio::time::timeout(API_TIMEOUT, self.client.request(req))
            .await
            .with_context(|| format!("GET {path_and_query}: no answer within {API_TIMEOUT:?}"))??;
        let status = resp.status().as_u16();
        let body = tokio::time::timeout(API_TIMEOUT, resp.into_body().collect())
            .await
            .with_context(|| format!("GET {path_and_query}: body not read within {API_TIMEOUT:?}"))??
            .to_bytes();
        Ok((status, String::from_utf8(body.to_vec())?))
    }

    /// `GET /api/v1/<call>?<params>`: the `data` of a successful answer.
    pub async fn api(&self, call: &str, params: &[(&str, &str)]) -> Result<Value> {
        let query: Vec<String> = params.iter().map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v))).collect();
        let (status, body) = self.get(&format!("/api/v1/{call}?{}", query.join("&"))).await?;
        let answer: Value = serde_json::from_str(&body)
            .with_context(|| format!("/api/v1/{call} {params:?} answered {status} with no JSON: {body}"))?;
        if answer["status"] != "success" {
            bail!("/api/v1/{call} {params:?} answered {status}: {} {}", answer["errorType"], answer["error"]);
        }
        Ok(answer["data"].clone())
    }

    /// An instant query evaluated at `time` (Unix seconds): one point per series of the vector (or the scalar).
    pub async fn query(&self, expr: &str, time: f64) -> Result<Vec<Point>> {
        let data = self.api("query", &[("query", expr), ("time", &format!("{time:.3}"))]).await?;
        match data["resultType"].as_str() {
            Some("vector") => data["result"]
                .as_array()
                .context("vector without result")?
                .iter()
                .map(|s| Ok(Point { labels: labels_of(s), value: sample_value(&s["value"])? }))
                .collect(),
            Some("scalar") => Ok(vec![Point { labels: Default::default(), value: sample_value(&data["result"])? }]),
            other => bail!("{expr}: unexpected result type {other:?}"),
        }
    }

    /// A range query over `[start, end]` every `step_s` seconds: every point of every series.
    pub async fn query_range(&self, expr: &str, start: f64, end: f64, step_s: f64) -> Result<Vec<Point>> {
        let params = [
            ("query", expr),
            ("start", &format!("{start:.3}")),
            ("end", &format!("{end:.3}")),
            ("step", &format!("{step_s}")),
        ];
        let data = self.api("query_range", &params).await?;
        let series = data["result"].as_array().context("matrix without result")?;
        let mut points = Vec::new();
        for s in series {
            for v in s["values"].as_array().context("series without values")? {
                points.push(Point { labels: labels_of(s), value: sample_value(v)? });
            }
        }
        Ok(points)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn labels_of(series: &Value) -> serde_json::Map<String, Value> {
    series["metric"].as_object().cloned().unwrap_or_default()
}

/// A `[time, "value"]` pair's value (Prometheus writes values as strings: `"NaN"`, `"+Inf"`, `"1.5"`).
fn sample_value(pair: &Value) -> Result<f64> {
    let text = pair.get(1).and_then(Value::as_str).with_context(|| format!("bad sample {pair}"))?;
    match text {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        other => other.parse().with_context(|| format!("bad sample value {other:?}")),
    }
}

/// A loopback port that was free when asked.
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `application/x-www-form-urlencoded` of one key or value.
fn form_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_encoding_keeps_unreserved_bytes_and_escapes_the_rest() {
        assert_eq!(form_encode("rate(x{a=\"b\"}[5m])"), "rate%28x%7Ba%3D%22b%22%7D%5B5m%5D%29");
        assert_eq!(form_encode("A-z.0_~"), "A-z.0_~");
        assert_eq!(form_encode("é "), "%C3%A9%20");
    }

    #[test]
    fn sample_values_are_read_as_prometheus_writes_them() {
        assert_eq!(sample_value(&serde_json::json!([1.5, "2.25"])).unwrap(), 2.25);
        assert!(sample_value(&serde_json::json!([1, "NaN"])).unwrap().is_nan());
        assert_eq!(sample_value(&serde_json::json!([1, "+Inf"])).unwrap(), f64::INFINITY);
        assert!(sample_value(&serde_json::json!([1, 2])).is_err());
    }
}
