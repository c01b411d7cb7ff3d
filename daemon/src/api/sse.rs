//! Server-sent events bodies: a bounded channel body, `data:` frames, `event:` frames, `[DONE]`.
//!
//! Invariants:
//! - The body is a bounded channel (backpressure: a slow client slows its own generation, nobody else's).
//! - A failed send means the client hung up; the caller then drops its generation, which cancels it.
//! - Frames are serialized into one reused buffer, then copied once into `Bytes`.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::channel::{Channel, Sender};
use serde::Serialize;

/// Frames buffered between the generator and the socket.
pub const SSE_CHANNEL: usize = 32;

/// The client is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disconnected;

/// The writing end of an SSE body.
pub struct SseWriter {
    tx: Sender<Bytes, Infallible>,
    buf: Vec<u8>,
}

impl SseWriter {
    /// A writer and the body to put in the response.
    pub fn new() -> (SseWriter, Channel<Bytes, Infallible>) {
        let (tx, body) = Channel::new(SSE_CHANNEL);
        (SseWriter { tx, buf: Vec::with_capacity(512) }, body)
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

    /// Sends `data: [DONE]\n\n`.
    pub async fn done(&mut self) -> Result<(), Disconnected> {
        self.tx.send_data(Bytes::from_static(b"data: [DONE]\n\n")).await.map_err(|_| Disconnected)
    }

    async fn flush(&mut self) -> Result<(), Disconnected> {
        self.tx.send_data(Bytes::copy_from_slice(&self.buf)).await.map_err(|_| Disconnected)
    }
}
