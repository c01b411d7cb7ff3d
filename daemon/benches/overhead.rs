//! Daemon overhead per generated token: `sparkd serve --device null` (a runner that does no math) driven by real
//! clients over SSE (`/v1/chat/completions`) and WebSocket (`/v1/responses`) at 1 and 64 concurrent streams.
//!
//! The number is the CPU time of the daemon process (utime + stime from `/proc/<pid>/stat`, whole process: HTTP,
//! JSON, detokenizer, engine thread, scheduler, null runner) divided by the tokens generated. Goal: < 20 µs/token.
//!
//! Run: `cargo bench -p sparkd --bench overhead` (release build; Linux only, for `/proc`).
//! Environment: `SPARKD_OVERHEAD_TOKENS` = tokens per configuration (default 32768); `SPARKD_OVERHEAD_BIN` = the
//! `sparkd` binary to measure (default: this build's), so that two builds are compared with the same clients;
//! `SPARKD_OVERHEAD_ARGS` = more `sparkd serve` flags (whitespace-separated; default [`DEFAULT_ARGS`]: the null
//! runner outruns any client, so one long stream would be cut off as a slow reader; give `""` for a build older
//! than that flag).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

/// `sparkd serve` flags besides the device, port and batch (see the module's environment).
const DEFAULT_ARGS: &str = "--max-event-backlog 1000000000";

struct Daemon {
    child: Child,
    port: u16,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Daemon {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let bin = std::env::var("SPARKD_OVERHEAD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_sparkd").to_owned());
    let child = Command::new(bin)
        .args(["serve", "--device", "null", "--port", &port.to_string(), "--max-num-seqs", "128"])
        .args(std::env::var("SPARKD_OVERHEAD_ARGS").unwrap_or_else(|_| DEFAULT_ARGS.to_owned()).split_whitespace())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("sparkd starts");
    Daemon { child, port }
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat (Linux only)");
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15 (1-based).
    let after = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / clock_ticks_per_second()
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

async fn sse_stream(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    port: u16,
    tokens: usize,
) -> usize {
    let body = json!({"messages": [{"role": "user", "content": "overhead"}], "stream": true, "max_tokens": tokens,
                      "ignore_eos": true, "stream_options": {"include_usage": true}});
    let req = hyper::Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.expect("request");
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let text = String::from_utf8_lossy(&bytes);
    let usage = text.lines().rev().find_map(|l| {
        let v: serde_json::Value = serde_json::from_str(l.strip_prefix("data: ")?).ok()?;
        v["usage"]["completion_tokens"].as_u64()
    });
    usage.expect("a usage chunk") as usize
}

async fn ws_streams(port: u16, streams: usize, tokens: usize) -> usize {
    let (mut ws, _) =
        tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/v1/responses")).await.expect("ws");
    for i in 0..streams {
        let create = json!({"type": "response.create", "stream_id": i.to_string(), "input": "overhead",
                            "max_output_tokens": tokens, "ignore_eos": true, "store": false});
        ws.send(Message::Text(create.to_string().into())).await.expect("send");
    }
    let (mut done, mut total) = (0, 0usize);
    while done < streams {
        let Some(Ok(Message::Text(t))) = ws.next().await else { panic!("socket closed") };
        let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
        if matches!(v["type"].as_str(), Some("response.completed" | "response.incomplete")) {
            total += v["response"]["usage"]["output_tokens"].as_u64().unwrap() as usize;
            done += 1;
        }
    }
    total
}

async fn measure(d: &Daemon, transport: &str, concurrency: usize, total_tokens: usize) -> (usize, f64, f64) {
    let per_stream = total_tokens / concurrency;
    let client = Client::builder(TokioExecutor::new()).build_http();
    let cpu0 = cpu_seconds(d.child.id());
    let t0 = Instant::now();
    let generated = match transport {
        "sse" => {
            let tasks: Vec<_> = (0..concurrency)
                .map(|_| {
                    let client = client.clone();
                    let port = d.port;
                    tokio::spawn(async move { sse_stream(&client, port, per_stream).await })
                })
                .collect();
            let mut n = 0;
            for t in tasks {
                n += t.await.unwrap();
            }
            n
        }
        _ => ws_streams(d.port, concurrency, per_stream).await,
    };
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(d.child.id()) - cpu0;
    (generated, cpu, wall)
}

fn main() {
    let total: usize = std::env::var("SPARKD_OVERHEAD_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(32768);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let d = start();
        let started = Instant::now();
        loop {
            let up = tokio::net::TcpStream::connect(("127.0.0.1", d.port)).await.is_ok();
            if up {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(60), "sparkd did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Warm-up (tokenizer, allocator, connections).
        measure(&d, "sse", 4, 2048).await;
        println!("sparkd daemon overhead, --device null, {total} tokens per configuration");
        println!(
            "{:<10} {:>11} {:>10} {:>10} {:>12} {:>10}",
            "transport", "concurrency", "tokens", "cpu_s", "us_per_token", "tok_per_s"
        );
        for transport in ["sse", "ws"] {
            for concurrency in [1usize, 64] {
                let (tokens, cpu, wall) = measure(&d, transport, concurrency, total).await;
                println!(
                    "{transport:<10} {concurrency:>11} {tokens:>10} {cpu:>10.3} {:>12.2} {:>10.0}",
                    cpu * 1e6 / tokens as f64,
                    tokens as f64 / wall
                );
            }
        }
    });
}
