//! Per-connection bounds: how many connections are open at once, how long a request's head may take, how long
//! a connection may sit idle.
//!
//! Invariants:
//! - At most `max_connections` connections are open: the accept loop takes a slot before it accepts, so past the
//!   bound new connections wait in the kernel's backlog instead of taking file descriptors the daemon needs.
//! - A request's head must arrive whole within `header_timeout` of its first byte (an HTTP/1 connection that
//!   trickles a head, slowloris-style, is closed); a connection that already speaks HTTP/2 is exempt, as its
//!   control frames are not request heads.
//! - A connection with no request in flight and no byte either way for `idle_timeout` is closed. A request is
//!   in flight from its dispatch until its response body ends ([`InFlight`] rides on the body), so a
//!   non-streaming request that computes for minutes in silence is never idle.
//! - Times are kept as milliseconds since the connection's start in atomics, read by one watchdog per
//!   connection ([`Activity::expired`]) that sleeps until the nearest deadline, or until a head starts.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The first bytes of an HTTP/2 connection (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";
/// No head started.
const NONE: u64 = u64::MAX;

/// The bounds of every connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    /// Responses in progress at once on one WebSocket.
    pub max_ws_streams: usize,
}

/// What a connection's watchdog reads: when bytes last moved, when the head being read began, how many
/// requests are in flight.
#[derive(Debug)]
pub struct Activity {
    start: Instant,
    last_io_ms: AtomicU64,
    head_started_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// Whether the connection turned out to be HTTP/2 (no head timeout).
    h2: AtomicBool,
    /// Whether the first read has been looked at.
    seen_first: AtomicBool,
    /// Wakes the watchdog when a head starts (its deadline may be nearer than the one it sleeps to).
    head_started: Notify,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Activity {
            start: Instant::now(),
            last_io_ms: AtomicU64::new(0),
            head_started_ms: AtomicU64::new(NONE),
            in_flight: AtomicUsize::new(0),
            h2: AtomicBool::new(false),
            seen_first: AtomicBool::new(false),
            head_started: Notify::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn on_read(&self, bytes: &[u8]) {
        let now = self.now_ms();
        self.last_io_ms.store(now, Ordering::Relaxed);
        if !self.seen_first.swap(true, Ordering::Relaxed) && bytes.starts_with(H2_PREFACE) {
            self.h2.store(true, Ordering::Relaxed);
        }
        if self.in_flight.load(Ordering::Relaxed) == 0
            && !self.h2.load(Ordering::Relaxed)
            && self.head_started_ms.compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            self.head_started.notify_one();
        }
    }

    fn on_write(&self) {
        self.last_io_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Resolves when the connection broke a bound, with what it broke; never while it keeps them.
    pub async fn expired(&self, limits: &ConnLimits) -> &'static str {
        let header = limits.header_timeout.as_millis() as u64;
        let idle = limits.idle_timeout.as_millis() as u64;
        loop {
            let now = self.now_ms();
            let head = self.head_started_ms.load(Ordering::Relaxed);
            let busy = self.in_flight.load(Ordering::Relaxed) > 0;
            let head_deadline = (head != NONE && !busy).then(|| head.saturating_add(header));
            let idle_deadline = (!busy).then(|| self.last_io_ms.load(Ordering::Relaxed).saturating_add(idle));
            if head_deadline.is_some_and(|d| now >= d) {
                return "the request head did not arrive within --header-timeout";
            }
            if idle_deadline.is_some_and(|d| now >= d) {
                return "idle for --idle-timeout";
            }
            // Sleep until the nearest deadline or a head's start; while busy, look again after a header timeout.
            let next = [head_deadline, idle_deadline].into_iter().flatten().min().unwrap_or(now.saturating_add(header));
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(next.saturating_sub(now).max(1))) => {}
                _ = self.head_started.notified() => {}
            }
        }
    }
}

/// A request being served on a connection, from dispatch until its response body ends.
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl InFlight {
    pub fn new(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::Relaxed);
        activity.head_started_ms.store(NONE, Ordering::Relaxed);
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.on_write();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request in flight until it ends.
pub struct TrackedBody<B, G> {
    inner: B,
    _guard: G,
}

impl<B, G> TrackedBody<B, G> {
    /// `inner`, holding `guard` (an [`InFlight`], and whatever else ends with the body) until it is dropped.
    pub fn new(inner: B, guard: G) -> Self {
        TrackedBody { inner, _guard: guard }
    }
}

impl<B: Body<Data = Bytes> + Unpin, G: Unpin> Body for TrackedBody<B, G> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A socket whose reads and writes are recorded in its connection's [`Activity`].
pub struct WatchedIo<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T> WatchedIo<T> {
    pub fn new(inner: T, activity: Arc<Activity>) -> Self {
        WatchedIo { inner, activity }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WatchedIo<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_read(&buf.filled()[before..]);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WatchedIo<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.on_write();
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.on_write();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The open-file limit this process may use: the soft limit, raised to the hard limit first (the kernel's
/// default soft limit of 1024 is far below what a server with many agents needs).
pub fn raise_open_file_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Err(io::Error::last_os_error());
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const LIMITS: ConnLimits = ConnLimits {
        max_connections: 1,
        header_timeout: Duration::from_millis(100),
        idle_timeout: Duration::from_millis(400),
        max_ws_streams: 1,
    };

    #[tokio::test(start_paused = true)]
    async fn a_trickled_head_times_out_and_an_idle_connection_closes() {
        let activity = Activity::new();
        let (client, server) = tokio::io::duplex(64);
        let mut io = WatchedIo::new(server, activity.clone());
        let mut client = client;
        // Idle with nothing sent: the idle bound applies, not the head bound.
        let started = tokio::time::Instant::now();
        assert_eq!(activity.expired(&LIMITS).await, "idle for --idle-timeout");
        assert!(started.elapsed() >= LIMITS.idle_timeout);

        // A head's first byte starts the head clock.
        client.write_all(b"GET / HT").await.unwrap();
        let mut buf = [0u8; 16];
        let _ = io.read(&mut buf).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(activity.expired(&LIMITS).await, "the request head did not arrive within --header-timeout");
        assert!(started.elapsed() >= LIMITS.header_timeout && started.elapsed() < LIMITS.idle_timeout);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_is_never_idle_and_h2_has_no_head_bound() {
        let activity = Activity::new();
        let busy = InFlight::new(&activity);
        let watchdog = activity.expired(&LIMITS);
        tokio::pin!(watchdog);
        assert!(tokio::time::timeout(Duration::from_secs(60), &mut watchdog).await.is_err(), "busy for a minute");
        drop(busy);
        assert_eq!(watchdog.await, "idle for --idle-timeout");

        let h2 = Activity::new();
        let (mut client, server) = tokio::io::duplex(64);
        let mut io = WatchedIo::new(server, h2.clone());
        client.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 32];
        let _ = io.read(&mut buf).await.unwrap();
        assert_eq!(h2.expired(&LIMITS).await, "idle for --idle-timeout");
    }
}
