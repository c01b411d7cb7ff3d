//! The launch protocol on the wire: every message is one frame, a 4-byte big-endian length followed by that
//! many bytes of UTF-8 JSON, an object tagged by `"type"`.
//!
//! Invariants:
//! - A frame is at most [`MAX_FRAME_BYTES`] and never empty; a length outside that is refused before any body
//!   byte is read, so a stranger on the port (an HTTP request's `GET ` reads as a 1.2 GB length) is a clear
//!   error, not an allocation.
//! - Reads are bounded in time by the socket's read timeout, which the caller sets; a timeout, an end of
//!   stream between frames, an end of stream inside a frame and a body that is not a message are four distinct
//!   errors.
//! - The first message on a connection is the peer's [`Hello`], which carries [`PROTOCOL`] and [`VERSION`];
//!   a version this build does not speak is refused by name.

use std::io::{ErrorKind, Read, Write};

use serde::{Deserialize, Serialize};

use super::{NodeRank, Rank};

/// The protocol's name, in every hello.
pub const PROTOCOL: &str = "sparkd-launch";
/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// The largest frame: a group of thousands of ranks fits.
pub const MAX_FRAME_BYTES: usize = 1 << 20;
/// Bytes in the group's unique id (NCCL's `NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The group's unique id: opaque bytes every rank must hold before the communicator starts
/// (`ncclCommInitRank(world, id, rank)`). Hex on the wire.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Lower-case hex, two digits a byte.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`UniqueId::to_hex`]'s text.
    pub fn from_hex(text: &str) -> Result<UniqueId, String> {
        if text.len() != 2 * UNIQUE_ID_BYTES || !text.is_ascii() {
            return Err(format!("a unique id is {} hex digits, not {}", 2 * UNIQUE_ID_BYTES, text.len()));
        }
        let mut id = [0u8; UNIQUE_ID_BYTES];
        for (i, byte) in id.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                .map_err(|_| format!("a unique id is hex digits: `{}`", &text[2 * i..2 * i + 2]))?;
        }
        Ok(UniqueId(id))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({}…)", &self.to_hex()[..16])
    }
}

impl Serialize for UniqueId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for UniqueId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        UniqueId::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

/// A peer's first message: who it is and what deployment it belongs to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL`].
    pub protocol: String,
    /// [`VERSION`] of the sender.
    pub version: u32,
    pub node: NodeRank,
    /// The ranks this process holds (a node's launcher holds them all, a worker one).
    pub ranks: Vec<Rank>,
    /// `--tensor-parallel-size` as the sender sees it.
    pub world_size: u32,
    pub nnodes: u32,
    /// What the group serves (model and sharding); every member must send the same.
    pub fingerprint: String,
    pub hostname: String,
    pub pid: u32,
}

/// One rank of the formed group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub rank: Rank,
    pub node: NodeRank,
    /// The address the master saw the process's connection come from (the master's own for its ranks).
    pub addr: String,
    pub hostname: String,
    pub pid: u32,
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// Peer → master, first.
    Hello(Hello),
    /// Master → peer: the group is formed.
    Welcome { version: u32, world_size: u32, nnodes: u32, unique_id: UniqueId, members: Vec<Member> },
    /// Master → peer: the hello does not fit the group; the master gives up too.
    Refused { reason: String },
    /// Both ways, every fifth of the heartbeat timeout.
    Heartbeat,
    /// Master → peers: the group is going down because of `reason` (a member went away).
    Abort { reason: String },
    /// Master → peers: the group closes normally.
    Shutdown { reason: String },
    /// Peer → master: this peer leaves normally.
    Bye,
}

impl Message {
    /// The message's `type`, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Welcome { .. } => "welcome",
            Message::Refused { .. } => "refused",
            Message::Heartbeat => "heartbeat",
            Message::Abort { .. } => "abort",
            Message::Shutdown { .. } => "shutdown",
            Message::Bye => "bye",
        }
    }
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream ended cleanly between frames.
    #[error("connection closed")]
    Closed,
    /// Nothing arrived within the read timeout.
    #[error("no message within the read timeout")]
    TimedOut,
    /// The stream ended inside a frame.
    #[error("connection closed inside a frame ({got} of {want} bytes)")]
    Truncated { got: usize, want: usize },
    /// A length of 0 or over [`MAX_FRAME_BYTES`].
    #[error("a frame of {0} bytes is not a launch message (at most {MAX_FRAME_BYTES}; is something else than sparkd on this port?)")]
    BadLength(u64),
    /// A body that is not one of [`Message`].
    #[error("a frame that is not a launch message: {0}")]
    Malformed(String),
    /// Any other socket error.
    #[error("{0}")]
    Io(std::io::Error),
}

/// Writes `msg` as one frame and flushes.
pub fn write_message(w: &mut impl Write, msg: &Message) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len()).ok().filter(|&l| l as usize <= MAX_FRAME_BYTES).ok_or_else(|| {
        std::io::Error::new(ErrorKind::InvalidInput, format!("a {}-byte message is over the frame limit", body.len()))
    })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one frame and parses its message.
pub fn read_message(r: &mut impl Read) -> Result<Message, FrameError> {
    let mut head = [0u8; 4];
    let got = read_full(r, &mut head)?;
    if got == 0 {
        return Err(FrameError::Closed);
    }
    if got < head.len() {
        return Err(FrameError::Truncated { got, want: head.len() });
    }
    let len = u32::from_be_bytes(head) as usize;
    if len == 0 || len > MAX_FRAME_BYTES {
        return Err(FrameError::BadLength(len as u64));
    }
    let mut body = vec![0u8; len];
    let got = read_full(r, &mut body)?;
    if got < len {
        return Err(FrameError::Truncated { got: 4 + got, want: 4 + len });
    }
    serde_json::from_slice(&body).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Fills `buf` unless the stream ends first; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<usize, FrameError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(FrameError::TimedOut)
            }
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Message {
        Message::Hello(Hello {
            protocol: PROTOCOL.into(),
            version: VERSION,
            node: NodeRank(1),
            ranks: vec![Rank(2), Rank(3)],
            world_size: 4,
            nnodes: 2,
            fingerprint: "k3-tiny tp4".into(),
            hostname: "b".into(),
            pid: 7,
        })
    }

    fn frame(msg: &Message) -> Vec<u8> {
        let mut out = Vec::new();
        write_message(&mut out, msg).unwrap();
        out
    }

    #[test]
    fn launch_frames_round_trip_every_message() {
        let id = UniqueId([0xab; UNIQUE_ID_BYTES]);
        let member =
            Member { rank: Rank(0), node: NodeRank(0), addr: "127.0.0.1:1".into(), hostname: "a".into(), pid: 1 };
        let msgs = [
            hello(),
            Message::Welcome {
                version: VERSION,
                world_size: 4,
                nnodes: 2,
                unique_id: id.clone(),
                members: vec![member],
            },
            Message::Refused { reason: "no".into() },
            Message::Heartbeat,
            Message::Abort { reason: "rank 3 went away".into() },
            Message::Shutdown { reason: "done".into() },
            Message::Bye,
        ];
        let mut stream = Vec::new();
        for m in &msgs {
            stream.extend(frame(m));
        }
        let mut r = stream.as_slice();
        for m in &msgs {
            assert_eq!(&read_message(&mut r).unwrap(), m);
        }
        assert!(matches!(read_message(&mut r), Err(FrameError::Closed)));
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
    }

    #[test]
    fn launch_frames_that_are_bad_oversize_or_truncated_are_clear_errors() {
        let whole = frame(&hello());
        let mut cut = &whole[..whole.len() - 5];
        let err = read_message(&mut cut).unwrap_err();
        assert!(matches!(err, FrameError::Truncated { .. }), "{err}");
        assert!(err.to_string().contains("inside a frame"), "{err}");
        let mut head_only = &whole[..2];
        assert!(matches!(read_message(&mut head_only), Err(FrameError::Truncated { got: 2, want: 4 })));

        let mut http = &b"GET / HTTP/1.1\r\n\r\n"[..];
        let err = read_message(&mut http).unwrap_err();
        assert!(matches!(err, FrameError::BadLength(_)) && err.to_string().contains("something else"), "{err}");
        let mut empty = &[0u8, 0, 0, 0][..];
        assert!(matches!(read_message(&mut empty), Err(FrameError::BadLength(0))));

        let not_json = [&5u32.to_be_bytes()[..], b"hello"].concat();
        let err = read_message(&mut not_json.as_slice()).unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)), "{err}");
        let unknown = br#"{"type":"launch_missiles"}"#;
        let framed = [&(unknown.len() as u32).to_be_bytes()[..], unknown].concat();
        assert!(matches!(read_message(&mut framed.as_slice()), Err(FrameError::Malformed(_))));
        let short_id = br#"{"type":"welcome","version":1,"world_size":1,"nnodes":1,"unique_id":"ab","members":[]}"#;
        let framed = [&(short_id.len() as u32).to_be_bytes()[..], short_id].concat();
        let err = read_message(&mut framed.as_slice()).unwrap_err();
        assert!(err.to_string().contains("256 hex digits"), "{err}");
    }

    #[test]
    fn launch_messages_over_the_frame_limit_are_not_written() {
        let huge = Message::Refused { reason: "x".repeat(MAX_FRAME_BYTES) };
        let mut out = Vec::new();
        assert_eq!(write_message(&mut out, &huge).unwrap_err().kind(), ErrorKind::InvalidInput);
        assert!(out.is_empty());
    }
}
