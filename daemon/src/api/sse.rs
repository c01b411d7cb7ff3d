//! Server-sent events bodies: a bounded channel body, `data:` frames, `event:` frames, `[DONE]`.
//!
//! Invariants:
//! - The body is a bounded channel (backpressure: a slow client slows its own generation, nobody else's).
//! - Every frame whose send completed reaches the client, also when the writer is dropped right after it: the
//!   body ends only once the channel is both closed and empty. (`http_body_util::channel::Channel` does not
//!   promise that: it polls its frame queue, then its error channel, so a frame sent and a writer dropped
//!   between the two polls on another thread was lost, and streams ended without `data: [DONE]`.)
//! - A failed send means the client hung up; the caller then drops its generation, which cancels it. While a
//!   request waits for the engine nothing else is written, so the caller sends a `: queued` comment every
//!   [`QUEUED_HEARTBEAT`]: the write after the client left fails, and the queued request is dropped.
//! - Frames are serialized into one reused buffer, then copied once into `Bytes`.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use serde::Serialize;
use tokio::sync::mpsc;

/// Frames buffered between the generator and the socket.
pub const SSE_CHANNEL: usize = 32;

/// How often a stream whose request still waits for the engine writes a `: queued` comment.
pub const QUEUED_HEARTBEAT: std::time::Duration = std::time::Duration::from_millis(500);

/// The client is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disconnected;

/// The reading end of an SSE body: the frames its writer sent, in order, then the end of the stream.
pub struct SseBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        // `Receiver::poll_recv` yields `None` only when every sender is gone and the queue is drained.
        self.get_mut().rx.poll_recv(cx).map(|frame| frame.map(|bytes| Ok(Frame::data(bytes))))
    }

    fn is_end_stream(&self) -> bool {
        self.rx.is_closed() && self.rx.is_empty()
    }
}

/// The writing end of an SSE body.
pub struct SseWriter {
    tx: mpsc::Sender<Bytes>,
    buf: Vec<u8>,
}

impl SseWriter {
    /// A writer and the body to put in the response.
    pub fn new() -> (SseWriter, SseBody) {
        let (tx, rx) = mpsc::channel(SSE_CHANNEL);
        (SseWriter { tx, buf: Vec::with_capacity(512) }, SseBody { rx })
    }

    /// Sends `data: {json}\n\n`.
    pub async fn data<T: Serialize>(&mut self, value: &T) -> Result<(), Disconnected> {
        self.buf.clear();
        self.buf.extend_from_slice(b"data: ");
        serde_json::to_writer(&mut self.buf, value).map_err(|_| Disconnected)?;
        self.buf.extend_from_slice(b"\n\n");
        self.flush().await
    }

    /// Sends `data: {raw json}\n\n` where `write` appends the JSON.
    pub async fn data_with(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>) -> serde_json::Result<()>,
    ) -> Result<(), Disconnected> {
        self.buf.clear();
        self.buf.extend_from_slice(b"data: ");
        write(&mut self.buf).map_err(|_| Disconnected)?;
        self.buf.extend_from_slice(b"\n\n");
        self.flush().await
    }

    /// Sends `event: {name}\ndata: {json}\n\n` (the Responses API's framing).
    pub async fn event<T: Serialize>(&mut self, name: &str, value: &T) -> Result<(), Disconnected> {
        self.buf.clear();
        self.buf.extend_from_slice(b"event: ");
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.extend_from_slice(b"\ndata: ");
        serde_json::to_writer(&mut self.buf, value).map_err(|_| Disconnected)?;
        self.buf.extend_from_slice(b"\n\n");
        self.flush().await
    }

    /// Sends the comment `: queued\n\n` (SSE clients ignore it): writing to a connection is how a client that
    /// left is noticed while its request still waits for the engine.
    pub async fn queued(&mut self) -> Result<(), Disconnected> {
        self.tx.send(Bytes::from_static(b": queued\n\n")).await.map_err(|_| Disconnected)
    }

    /// Sends `data: [DONE]\n\n`.
    pub async fn done(&mut self) -> Result<(), Disconnected> {
        self.tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.map_err(|_| Disconnected)
    }

    async fn flush(&mut self) -> Result<(), Disconnected> {
        self.tx.send(Bytes::copy_from_slice(&self.buf)).await.map_err(|_| Disconnected)
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn read_all(body: SseBody) -> String {
        let bytes = body.collect().await.expect("an SSE body cannot fail").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("SSE frames are UTF-8")
    }

    #[tokio::test]
    async fn frames_sent_before_the_writer_drops_are_all_read() {
        let (mut writer, body) = SseWriter::new();
        writer.data(&serde_json::json!({"n": 1})).await.unwrap();
        writer.event("response.completed", &serde_json::json!({"n": 2})).await.unwrap();
        writer.done().await.unwrap();
        assert!(!body.is_end_stream(), "the queue still holds three frames");
        drop(writer);
        assert_eq!(
            read_all(body).await,
            "data: {\"n\":1}\n\nevent: response.completed\ndata: {\"n\":2}\n\ndata: [DONE]\n\n"
        );
    }

    /// The writer runs on another worker thread, so its last send and its drop race the reader's polls; the
    /// stream must end with `[DONE]` every time. (The loss this guards against was rare: one chat stream in one
    /// CI run, under `http_body_util`'s channel body; this loop did not reproduce it on a 2-core machine.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_last_frame_survives_a_writer_dropped_on_another_thread() {
        for round in 0..1000 {
            let (mut writer, body) = SseWriter::new();
            let sender = tokio::spawn(async move {
                writer.data(&round).await.unwrap();
                tokio::task::yield_now().await;
                writer.done().await.unwrap();
            });
            let text = read_all(body).await;
            sender.await.unwrap();
            assert_eq!(text, format!("data: {round}\n\ndata: [DONE]\n\n"), "round {round}");
        }
    }

    #[tokio::test]
    async fn a_dropped_body_reports_the_client_gone() {
        let (mut writer, body) = SseWriter::new();
        drop(body);
        assert_eq!(writer.done().await, Err(Disconnected));
    }
}
