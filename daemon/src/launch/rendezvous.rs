//! The rendezvous and the liveness of a formed group, over TCP with [`super::wire`]'s frames.
//!
//! Order: node 0's rank 0 process (the master) listens on `--master-addr:--master-port`; every other process
//! of the group (each node's launcher, each local worker) connects, retrying until `--rendezvous-timeout`,
//! and sends its [`Hello`] (protocol version, node, the ranks it holds, world size, nodes, fingerprint). The
//! master checks each hello against its own view; when every rank of the group is held it draws the group's
//! [`UniqueId`] from its [`UniqueIdSource`] and answers every peer with a `welcome` (world size, nodes, unique
//! id, every rank's node, address, host name and pid). A hello that does not fit is answered `refused` with
//! the reason, the peers already joined get an `abort`, and the master fails with the same reason.
//!
//! After the rendezvous each peer keeps its connection to the master open; both sides send a `heartbeat` every
//! fifth of `--heartbeat-timeout`. When a connection closes, breaks or stays silent past the timeout, the
//! master sends `abort` with "rank R on node N (addr) went away: why" to every other peer and fails; a peer
//! that loses the master fails the same way. A group ends normally with the master's `shutdown` (or a peer's
//! `bye`). [`Group::watch_during`] watches the same way while every process runs its part of a group-wide work
//! (a CUDA group's NCCL communicator): a part that fails leaves the group, which names its rank, and the master
//! ends the group normally once its own part is done.
//!
//! Invariants:
//! - No wait is unbounded: accepting and connecting stop at the rendezvous deadline, a hello must arrive
//!   within [`HELLO_TIMEOUT`], every write has a timeout, and after the rendezvous every read has the
//!   heartbeat timeout.
//! - A connection that does not speak the protocol (a port scanner, a health check) is dropped with a
//!   warning and does not take the group down; a sparkd process of another deployment (version, world size,
//!   nodes, fingerprint, ranks) does.
//! - Every rank is held by exactly one process, and rank `r` by a process of node `r / per_node`.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::wire::{read_message, write_message, FrameError, Hello, Member, Message, UniqueId, PROTOCOL, VERSION};
use super::{LaunchError, Layout, NodeRank, Rank};

/// How long a connection may take to send its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one write may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between connection attempts to a master that is not listening yet, and between accept polls.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// The longest single connection attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// Where the group's unique id comes from.
pub trait UniqueIdSource {
    fn unique_id(&self) -> Result<UniqueId, LaunchError>;
}

/// 128 random bytes: the id of a group whose ranks do not talk through NCCL (the CPU backend's in-process ranks,
/// `sparkd rendezvous`), where nothing reads it but the launch contract.
pub struct RandomUniqueId;

impl UniqueIdSource for RandomUniqueId {
    fn unique_id(&self) -> Result<UniqueId, LaunchError> {
        let mut id = UniqueId([0; super::wire::UNIQUE_ID_BYTES]);
        getrandom::getrandom(&mut id.0)
            .map_err(|e| LaunchError::io("drawing the group's unique id", std::io::Error::other(e.to_string())))?;
        Ok(id)
    }
}

/// `ncclGetUniqueId` (`sparkd_kernels::cuda::nccl::unique_id`), drawn by the master (rank 0's process) of a CUDA
/// group: its bytes carry the address NCCL's bootstrap listens on in this process, and every rank passes them to
/// `ncclCommInitRank`. Fails, naming the library and `LD_LIBRARY_PATH`, when NCCL cannot be loaded.
pub struct NcclUniqueId;

impl UniqueIdSource for NcclUniqueId {
    fn unique_id(&self) -> Result<UniqueId, LaunchError> {
        let id = sparkd_kernels::cuda::nccl::unique_id()
            .map_err(|e| LaunchError::Device(format!("drawing the group's NCCL unique id: {e}")))?;
        Ok(UniqueId(id))
    }
}

/// What this process brings to the group.
#[derive(Clone, Debug)]
pub struct Join {
    pub layout: Layout,
    /// The ranks this process holds (all of its node's for a launcher, one for a worker).
    pub ranks: Vec<Rank>,
    /// What the group serves; every member must bring the same.
    pub fingerprint: String,
    pub rendezvous_timeout: Duration,
    pub heartbeat_timeout: Duration,
}

impl Join {
    fn hello(&self) -> Hello {
        Hello {
            protocol: PROTOCOL.into(),
            version: VERSION,
            node: self.layout.node,
            ranks: self.ranks.clone(),
            world_size: self.layout.world,
            nnodes: self.layout.nnodes,
            fingerprint: self.fingerprint.clone(),
            hostname: hostname(),
            pid: std::process::id(),
        }
    }
}

/// A formed group, seen from one process.
pub struct Group {
    pub unique_id: UniqueId,
    /// Every rank, in rank order.
    pub members: Vec<Member>,
    pub layout: Layout,
    heartbeat_timeout: Duration,
    link: Link,
}

/// This process's connections: the master holds one per peer, a peer one to the master.
enum Link {
    Master(Vec<Conn>),
    Peer(Conn),
}

/// One open connection and who is at its other end.
struct Conn {
    stream: TcpStream,
    /// "rank 3 on node 1 (10.0.0.2:41234)".
    who: String,
}

/// Node 0's listening socket, bound before the workers that will connect to it start.
pub struct Master {
    listener: TcpListener,
    join: Join,
}

impl Master {
    /// Listens on `host:port` (port 0: any free port).
    pub fn bind(host: &str, port: u16, join: Join) -> Result<Master, LaunchError> {
        let what = || format!("--master-addr/--master-port: cannot listen on {host}:{port}");
        let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs().map_err(|e| LaunchError::io(what(), e))?.collect();
        let mut last = std::io::Error::new(ErrorKind::AddrNotAvailable, "the host resolves to no address");
        for addr in addrs {
            match TcpListener::bind(addr) {
                Ok(listener) => return Ok(Master { listener, join }),
                Err(e) => last = e,
            }
        }
        Err(LaunchError::io(what(), last))
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr, LaunchError> {
        self.listener.local_addr().map_err(|e| LaunchError::io("reading the rendezvous address", e))
    }

    /// Waits for every rank of the group, then hands out the unique id from `ids`. `poll` runs between accepts
    /// (the launcher checks its worker processes there); its error ends the rendezvous.
    pub fn gather(
        self,
        ids: &dyn UniqueIdSource,
        poll: &mut dyn FnMut() -> Result<(), LaunchError>,
    ) -> Result<Group, LaunchError> {
        let mut peers: Vec<Conn> = Vec::new();
        match self.gather_peers(&mut peers, poll).and_then(|members| Ok((members, ids.unique_id()?))) {
            Ok((members, unique_id)) => {
                let layout = self.join.layout;
                let welcome = Message::Welcome {
                    version: VERSION,
                    world_size: layout.world,
                    nnodes: layout.nnodes,
                    unique_id: unique_id.clone(),
                    members: members.clone(),
                };
                for peer in &mut peers {
                    write_message(&mut peer.stream, &welcome)
                        .map_err(|e| LaunchError::PeerGone(format!("{} went away: {e}", peer.who)))?;
                }
                Ok(Group {
                    unique_id,
                    members,
                    layout,
                    heartbeat_timeout: self.join.heartbeat_timeout,
                    link: Link::Master(peers),
                })
            }
            Err(e) => {
                broadcast(&mut peers, &Message::Abort { reason: e.to_string() });
                Err(e)
            }
        }
    }

    /// Accepts until every rank is held; the joined peers' connections are pushed to `peers` as they come.
    fn gather_peers(
        &self,
        peers: &mut Vec<Conn>,
        poll: &mut dyn FnMut() -> Result<(), LaunchError>,
    ) -> Result<Vec<Member>, LaunchError> {
        let layout = self.join.layout;
        let own = self.local_addr()?.to_string();
        let mut held: BTreeMap<Rank, Member> = BTreeMap::new();
        for &rank in &self.join.ranks {
            let member =
                Member { rank, node: layout.node, addr: own.clone(), hostname: hostname(), pid: std::process::id() };
            held.insert(rank, member);
        }
        self.listener.set_nonblocking(true).map_err(|e| LaunchError::io("the rendezvous socket", e))?;
        let deadline = Instant::now() + self.join.rendezvous_timeout;
        while held.len() < layout.world as usize {
            poll()?;
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> =
                    (0..layout.world).map(Rank).filter(|r| !held.contains_key(r)).map(|r| r.0.to_string()).collect();
                return Err(LaunchError::Timeout {
                    secs: self.join.rendezvous_timeout.as_secs(),
                    waiting: format!("ranks {} never joined (listening on {own})", missing.join(", ")),
                });
            }
            let (stream, addr) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    std::thread::sleep(ACCEPT_POLL);
                    continue;
                }
                Err(e) => return Err(LaunchError::io(format!("accepting on {own}"), e)),
            };
            let Some((mut stream, hello)) = read_hello(stream, addr, HELLO_TIMEOUT.min(deadline - now)) else {
                continue;
            };
            let who = describe(&hello.ranks, hello.node, &addr.to_string());
            if let Err(reason) = check_hello(&self.join, &hello, &held) {
                let reason = format!("{who} ({}, pid {}): {reason}", hello.hostname, hello.pid);
                let _ = write_message(&mut stream, &Message::Refused { reason: reason.clone() });
                return Err(LaunchError::Mismatch(reason));
            }
            tracing::info!("rendezvous: {who} joined ({}, pid {})", hello.hostname, hello.pid);
            for &rank in &hello.ranks {
                let member = Member {
                    rank,
                    node: hello.node,
                    addr: addr.to_string(),
                    hostname: hello.hostname.clone(),
                    pid: hello.pid,
                };
                held.insert(rank, member);
            }
            peers.push(Conn { stream, who });
        }
        Ok(held.into_values().collect())
    }
}

/// The hello of a fresh connection, or `None` (logged) when it does not send one in time.
fn read_hello(stream: TcpStream, addr: SocketAddr, timeout: Duration) -> Option<(TcpStream, Hello)> {
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))))
        .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
        .and_then(|()| stream.set_nodelay(true));
    if let Err(e) = setup {
        tracing::warn!("rendezvous: dropped a connection from {addr}: {e}");
        return None;
    }
    let mut stream = stream;
    match read_message(&mut stream) {
        Ok(Message::Hello(hello)) => Some((stream, hello)),
        Ok(other) => {
            tracing::warn!("rendezvous: dropped {addr}: it sent `{}` before a hello", other.name());
            None
        }
        Err(e) => {
            tracing::warn!("rendezvous: dropped {addr}: {e}");
            None
        }
    }
}

/// Why `hello` does not fit the group the master sees (`held`: the ranks held so far).
fn check_hello(join: &Join, hello: &Hello, held: &BTreeMap<Rank, Member>) -> Result<(), String> {
    let layout = join.layout;
    if hello.protocol != PROTOCOL || hello.version != VERSION {
        return Err(format!(
            "speaks {} version {}; node 0 speaks {PROTOCOL} version {VERSION} (run the same sparkd everywhere)",
            hello.protocol, hello.version
        ));
    }
    if hello.world_size != layout.world {
        return Err(format!(
            "world size mismatch: it has --tensor-parallel-size {}, node 0 has {}",
            hello.world_size, layout.world
        ));
    }
    if hello.nnodes != layout.nnodes {
        return Err(format!("node count mismatch: it has --nnodes {}, node 0 has {}", hello.nnodes, layout.nnodes));
    }
    if hello.fingerprint != join.fingerprint {
        return Err(format!(
            "fingerprint mismatch: it serves `{}`, node 0 serves `{}`",
            hello.fingerprint, join.fingerprint
        ));
    }
    if hello.node.0 >= layout.nnodes || hello.ranks.is_empty() {
        return Err(format!("holds no rank of the group ({} of {} nodes)", hello.node, layout.nnodes));
    }
    let mut distinct = hello.ranks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != hello.ranks.len() {
        return Err("names a rank twice".into());
    }
    for &rank in &hello.ranks {
        if rank.0 >= layout.world || layout.node_of(rank) != hello.node {
            return Err(format!("{rank} does not live on {} ({} ranks per node)", hello.node, layout.per_node()));
        }
        if let Some(m) = held.get(&rank) {
            return Err(format!(
                "{rank} is already held by pid {} on {} ({}): is --node-rank repeated?",
                m.pid, m.hostname, m.addr
            ));
        }
    }
    Ok(())
}

/// Connects to the master at `host:port`, retrying until the rendezvous deadline, and joins the group.
pub fn join(host: &str, port: u16, join: &Join) -> Result<Group, LaunchError> {
    let deadline = Instant::now() + join.rendezvous_timeout;
    let mut stream = connect(host, port, deadline, join.rendezvous_timeout)?;
    let master = format!("rank 0 on node 0 ({host}:{port})");
    let lost = |e: &dyn std::fmt::Display| LaunchError::PeerGone(format!("the master, {master}, went away: {e}"));
    let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(remaining))
        .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| LaunchError::io(format!("the connection to {host}:{port}"), e))?;
    write_message(&mut stream, &Message::Hello(join.hello())).map_err(|e| lost(&e))?;
    let welcome = match read_message(&mut stream) {
        Ok(msg) => msg,
        Err(FrameError::TimedOut) => {
            return Err(LaunchError::Timeout {
                secs: join.rendezvous_timeout.as_secs(),
                waiting: format!("joined {master}, but the group did not form"),
            })
        }
        Err(e) => return Err(lost(&e)),
    };
    match welcome {
        Message::Welcome { version, world_size, nnodes, unique_id, members } => {
            if version != VERSION || world_size != join.layout.world || nnodes != join.layout.nnodes {
                return Err(LaunchError::Protocol(format!(
                    "the master's welcome (version {version}, world size {world_size}, {nnodes} nodes) does not fit \
                     this process (version {VERSION}, world size {}, {} nodes)",
                    join.layout.world, join.layout.nnodes
                )));
            }
            let ranks_ok = members.len() == world_size as usize
                && members.iter().enumerate().all(|(i, m)| m.rank.0 as usize == i)
                && join.ranks.iter().all(|r| members.get(r.0 as usize).is_some_and(|m| m.pid == std::process::id()));
            if !ranks_ok {
                return Err(LaunchError::Protocol("the master's rank assignment does not list every rank once".into()));
            }
            let conn = Conn { stream, who: master };
            Ok(Group {
                unique_id,
                members,
                layout: join.layout,
                heartbeat_timeout: join.heartbeat_timeout,
                link: Link::Peer(conn),
            })
        }
        Message::Refused { reason } => Err(LaunchError::Mismatch(reason)),
        Message::Abort { reason } => Err(LaunchError::PeerGone(format!("the group did not form: {reason}"))),
        other => Err(LaunchError::Protocol(format!("{master} answered the hello with `{}`", other.name()))),
    }
}

/// A connection to `host:port`, retried (the master may not listen yet) until `deadline`.
fn connect(host: &str, port: u16, deadline: Instant, timeout: Duration) -> Result<TcpStream, LaunchError> {
    let mut last = String::from("no attempt");
    loop {
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let attempt = deadline.saturating_duration_since(Instant::now()).min(CONNECT_ATTEMPT);
                    match TcpStream::connect_timeout(&addr, attempt.max(Duration::from_millis(1))) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last = format!("resolving {host}: {e}"),
        }
        if Instant::now() + RETRY_PAUSE >= deadline {
            return Err(LaunchError::Timeout {
                secs: timeout.as_secs(),
                waiting: format!("cannot reach the master at {host}:{port} (last: {last})"),
            });
        }
        std::thread::sleep(RETRY_PAUSE);
    }
}

impl Group {
    /// Whether this process is the master (node 0's rank 0).
    pub fn is_master(&self) -> bool {
        matches!(self.link, Link::Master(_))
    }

    /// Ends the group normally: the master tells every peer `shutdown` with `reason`, a peer says `bye`.
    pub fn close(self, reason: &str) {
        match self.link {
            Link::Master(mut peers) => broadcast(&mut peers, &Message::Shutdown { reason: reason.into() }),
            Link::Peer(mut master) => {
                let _ = write_message(&mut master.stream, &Message::Bye);
            }
        }
    }

    /// Keeps the group up, sending heartbeats, until `hold` passes (then closes it normally; `None`: until the
    /// master shuts it down or every peer has left) or a member goes away (an error naming it; the master
    /// tells the other peers first).
    pub fn watch(self, hold: Option<Duration>) -> Result<(), LaunchError> {
        let deadline = hold.map(|h| Instant::now() + h);
        let timeout = self.heartbeat_timeout;
        let (conns, is_master) = match self.link {
            Link::Master(peers) => (peers, true),
            Link::Peer(master) => (vec![master], false),
        };
        let watch = Watch::start(conns, timeout)?;
        if is_master {
            watch.run_master(deadline)
        } else {
            watch.run_peer(deadline)
        }
    }

    /// Keeps the group up, watched as [`Group::watch`] watches it, while `work` runs on a thread of its own, and
    /// returns what the work returned once the group agrees it is done: the master, when its own work is done,
    /// ends the group normally with `close_reason`; a peer, once its work is done, waits for that. A member that
    /// goes away, a work that fails (a peer's failure ends its part of the group, which the master sees as that
    /// rank going away), or the master's work not done within `bound` ends the group with an error instead (`None`:
    /// no bound, for a work that lasts as long as the group serves).
    pub fn watch_during<T: Send + 'static>(
        self,
        bound: Option<Duration>,
        close_reason: &str,
        work: impl FnOnce() -> Result<T, LaunchError> + Send + 'static,
    ) -> Result<T, LaunchError> {
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(work());
        });
        let is_master = self.is_master();
        let conns = match self.link {
            Link::Master(peers) => peers,
            Link::Peer(master) => vec![master],
        };
        let watch = Watch::start(conns, self.heartbeat_timeout)?;
        watch.run_during(is_master, &done, bound, close_reason)
    }
}

/// The heartbeat sender and one reader thread per connection; stopped (sockets shut down) on drop.
struct Watch {
    writers: Arc<Vec<Mutex<Conn>>>,
    events: mpsc::Receiver<(usize, Result<Message, FrameError>)>,
    stop: Arc<AtomicBool>,
    timeout: Duration,
}

impl Watch {
    fn start(conns: Vec<Conn>, timeout: Duration) -> Result<Watch, LaunchError> {
        let (tx, events) = mpsc::channel();
        for (i, conn) in conns.iter().enumerate() {
            let mut reader =
                conn.stream.try_clone().map_err(|e| LaunchError::io(format!("watching {}", conn.who), e))?;
            reader.set_read_timeout(Some(timeout)).map_err(|e| LaunchError::io(format!("watching {}", conn.who), e))?;
            let tx = tx.clone();
            std::thread::spawn(move || loop {
                let msg = read_message(&mut reader);
                if !matches!(msg, Ok(Message::Heartbeat)) {
                    let _ = tx.send((i, msg));
                    return;
                }
            });
        }
        let writers = Arc::new(conns.into_iter().map(Mutex::new).collect::<Vec<_>>());
        let stop = Arc::new(AtomicBool::new(false));
        let (beat_writers, beat_stop) = (writers.clone(), stop.clone());
        std::thread::spawn(move || {
            while !beat_stop.load(Ordering::Relaxed) {
                for w in beat_writers.iter() {
                    if let Ok(mut conn) = w.lock() {
                        // A failed write shows up on the reader's side as a closed connection.
                        let _ = write_message(&mut conn.stream, &Message::Heartbeat);
                    }
                }
                std::thread::sleep(timeout / 5);
            }
        });
        Ok(Watch { writers, events, stop, timeout })
    }

    fn who(&self, i: usize) -> String {
        self.writers[i].lock().map(|c| c.who.clone()).unwrap_or_else(|_| format!("peer {i}"))
    }

    fn send(&self, i: usize, msg: &Message) {
        if let Ok(mut conn) = self.writers[i].lock() {
            let _ = write_message(&mut conn.stream, msg);
        }
    }

    /// Why a connection's read ended, in words.
    fn why(&self, e: &FrameError) -> String {
        match e {
            FrameError::Closed => "its connection closed".into(),
            FrameError::Io(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => {
                format!("its connection closed ({e})")
            }
            FrameError::TimedOut => format!("no heartbeat for {} s", self.timeout.as_secs()),
            other => other.to_string(),
        }
    }

    fn next(&self, deadline: Option<Instant>) -> Option<(usize, Result<Message, FrameError>)> {
        match deadline {
            Some(d) => self.events.recv_timeout(d.saturating_duration_since(Instant::now())).ok(),
            None => self.events.recv().ok(),
        }
    }

    fn run_master(self, deadline: Option<Instant>) -> Result<(), LaunchError> {
        let mut left = vec![false; self.writers.len()];
        while left.iter().any(|l| !l) {
            let Some((i, event)) = self.next(deadline) else {
                self.send_all(&left, &Message::Shutdown { reason: "the master's hold ended".into() });
                return Ok(());
            };
            left[i] = true;
            let Some(reason) = self.member_failure(i, event) else { continue };
            self.send_all(&left, &Message::Abort { reason: reason.clone() });
            return Err(LaunchError::PeerGone(reason));
        }
        Ok(())
    }

    fn run_peer(self, deadline: Option<Instant>) -> Result<(), LaunchError> {
        let Some((_, event)) = self.next(deadline) else {
            self.send(0, &Message::Bye);
            return Ok(());
        };
        match event {
            Ok(Message::Shutdown { reason }) => {
                tracing::info!("the group was shut down: {reason}");
                Ok(())
            }
            Ok(Message::Abort { reason }) => Err(LaunchError::PeerGone(format!("the group went down: {reason}"))),
            Ok(other) => Err(LaunchError::Protocol(format!("{} sent `{}` out of turn", self.who(0), other.name()))),
            Err(e) => Err(LaunchError::PeerGone(format!("the master, {}, went away: {}", self.who(0), self.why(&e)))),
        }
    }
}

/// How often [`Watch::run_during`] looks at its work between the members' events.
const WORK_POLL: Duration = Duration::from_millis(50);
/// How long a peer whose master ended the group waits for its own part of the work to report.
const WORK_GRACE: Duration = Duration::from_secs(2);

impl Watch {
    /// Sends `msg` to every member that has not left.
    /// What member `i`'s event on the master means: `None` for a clean `Bye` (logged), else why the group goes down.
    fn member_failure(&self, i: usize, event: Result<Message, FrameError>) -> Option<String> {
        match event {
            Ok(Message::Bye) => {
                tracing::info!("{} left the group", self.who(i));
                None
            }
            Ok(other) => Some(format!("{} sent `{}` out of turn", self.who(i), other.name())),
            Err(e) => Some(format!("{} went away: {}", self.who(i), self.why(&e))),
        }
    }

    fn send_all(&self, left: &[bool], msg: &Message) {
        for (j, gone) in left.iter().enumerate() {
            if !gone {
                self.send(j, msg);
            }
        }
    }

    /// The loop of [`Group::watch_during`]: the members' events, and the work's result from `done`.
    fn run_during<T>(
        self,
        is_master: bool,
        done: &mpsc::Receiver<Result<T, LaunchError>>,
        bound: Option<Duration>,
        close_reason: &str,
    ) -> Result<T, LaunchError> {
        let deadline = bound.map(|b| (Instant::now() + b, b));
        let mut left = vec![false; self.writers.len()];
        let mut result = None;
        loop {
            if result.is_none() {
                match done.try_recv() {
                    Ok(Ok(t)) if is_master => {
                        self.send_all(&left, &Message::Shutdown { reason: close_reason.into() });
                        return Ok(t);
                    }
                    Ok(Ok(t)) => result = Some(t),
                    Ok(Err(e)) => {
                        if is_master {
                            self.send_all(&left, &Message::Abort { reason: format!("rank 0: {e}") });
                        }
                        return Err(e);
                    }
                    Err(mpsc::TryRecvError::Disconnected) => {
                        let e =
                            LaunchError::Device("this rank's part of the group's work ended without a result".into());
                        return Err(e);
                    }
                    Err(mpsc::TryRecvError::Empty)
                        if is_master && deadline.is_some_and(|(at, _)| Instant::now() >= at) =>
                    {
                        let secs = deadline.map_or(0, |(_, b)| b.as_secs());
                        let why = format!("the group's work did not finish on every rank within {secs} s");
                        self.send_all(&left, &Message::Abort { reason: why.clone() });
                        return Err(LaunchError::Device(why));
                    }
                    Err(mpsc::TryRecvError::Empty) => {}
                }
            }
            let (i, event) = match self.events.recv_timeout(WORK_POLL) {
                Ok(event) => event,
                Err(_) => continue,
            };
            if is_master {
                left[i] = true;
                let Some(reason) = self.member_failure(i, event) else { continue };
                self.send_all(&left, &Message::Abort { reason: reason.clone() });
                return Err(LaunchError::PeerGone(reason));
            }
            return match event {
                Ok(Message::Shutdown { reason }) => {
                    tracing::info!("the group was shut down: {reason}");
                    match result {
                        Some(t) => Ok(t),
                        // The master finished first; a group-wide work ends on every rank at about the same time.
                        None => done.recv_timeout(WORK_GRACE).unwrap_or_else(|_| {
                            Err(LaunchError::PeerGone(format!(
                                "the group ended before this rank's part of its work did: {reason}"
                            )))
                        }),
                    }
                }
                Ok(Message::Abort { reason }) => Err(LaunchError::PeerGone(format!("the group went down: {reason}"))),
                Ok(other) => Err(LaunchError::Protocol(format!("{} sent `{}` out of turn", self.who(0), other.name()))),
                Err(e) => {
                    Err(LaunchError::PeerGone(format!("the master, {}, went away: {}", self.who(0), self.why(&e))))
                }
            };
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.writers.iter() {
            if let Ok(conn) = w.lock() {
                let _ = conn.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// Sends `msg` to every connection, ignoring the ones that fail (they are going away anyway).
fn broadcast(conns: &mut [Conn], msg: &Message) {
    for conn in conns {
        let _ = write_message(&mut conn.stream, msg);
    }
}

/// "rank 3 on node 1 (addr)" or "ranks 2, 3 on node 1 (addr)".
fn describe(ranks: &[Rank], node: NodeRank, addr: &str) -> String {
    match ranks {
        [one] => format!("{one} on {node} ({addr})"),
        many => {
            let list: Vec<String> = many.iter().map(|r| r.0.to_string()).collect();
            format!("ranks {} on {node} ({addr})", list.join(", "))
        }
    }
}

/// This host's name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else `?`).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::wire::{read_message, write_message};

    #[test]
    fn an_nccl_id_is_128_bytes_or_an_error_naming_the_library() {
        match NcclUniqueId.unique_id() {
            Ok(id) => assert!(id.0.iter().any(|b| *b != 0), "ncclGetUniqueId gave zeros"),
            Err(e) => {
                assert_eq!(e.kind(), "device");
                let text = e.to_string();
                assert!(text.contains("libnccl.so.2") && text.contains("LD_LIBRARY_PATH"), "{text}");
            }
        }
    }

    fn me(node: u32, ranks: &[u32], world: u32, fingerprint: &str) -> Join {
        Join {
            layout: Layout { world, nnodes: 2, node: NodeRank(node) },
            ranks: ranks.iter().map(|&r| Rank(r)).collect(),
            fingerprint: fingerprint.into(),
            rendezvous_timeout: Duration::from_secs(20),
            heartbeat_timeout: Duration::from_secs(1),
        }
    }

    /// Node 0 gathering on an ephemeral loopback port in a thread; the port and the thread.
    fn master(join: Join) -> (u16, std::thread::JoinHandle<Result<Group, LaunchError>>) {
        let m = Master::bind("127.0.0.1", 0, join).unwrap();
        let port = m.local_addr().unwrap().port();
        (port, std::thread::spawn(move || m.gather(&RandomUniqueId, &mut || Ok(()))))
    }

    #[test]
    fn launch_rendezvous_hands_every_rank_the_same_id_and_ignores_strangers() {
        let (port, node0) = master(me(0, &[0, 1], 4, "f"));
        // A stranger (an HTTP probe) is dropped without harm.
        let mut probe = TcpStream::connect(("127.0.0.1", port)).unwrap();
        std::io::Write::write_all(&mut probe, b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let node1 = join("127.0.0.1", port, &me(1, &[2, 3], 4, "f")).unwrap();
        let node0 = node0.join().unwrap().unwrap();
        assert_eq!(node0.unique_id, node1.unique_id);
        assert_eq!(node0.members, node1.members);
        let ranks: Vec<(u32, u32)> = node1.members.iter().map(|m| (m.rank.0, m.node.0)).collect();
        assert_eq!(ranks, [(0, 0), (1, 0), (2, 1), (3, 1)]);
        assert!(node0.is_master() && !node1.is_master());
        let peer = std::thread::spawn(move || node1.watch(None));
        node0.close("done");
        peer.join().unwrap().expect("a shutdown ends the peer's watch cleanly");
    }

    /// A master and one peer (node 1, rank 1) of a formed group of two.
    fn pair() -> (Group, Group) {
        let (port, node0) = master(me(0, &[0], 2, "f"));
        let node1 = join("127.0.0.1", port, &me(1, &[1], 2, "f")).unwrap();
        (node0.join().unwrap().unwrap(), node1)
    }

    #[test]
    fn launch_work_done_on_every_rank_ends_the_group_normally() {
        let (node0, node1) = pair();
        let bound = Duration::from_secs(20);
        let peer = std::thread::spawn(move || node1.watch_during(Some(bound), "", || Ok("peer")));
        let started = Instant::now();
        let slow = move || {
            std::thread::sleep(Duration::from_millis(1500)); // past the heartbeat timeout: the watch keeps them going
            Ok("master")
        };
        assert_eq!(node0.watch_during(Some(bound), "checked", slow).unwrap(), "master");
        assert_eq!(peer.join().unwrap().unwrap(), "peer");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn launch_work_that_fails_or_overruns_takes_the_group_down() {
        // A peer whose work fails leaves: the master's work (waiting for it) ends with that rank named.
        let (node0, node1) = pair();
        let bound = Duration::from_secs(20);
        let peer = std::thread::spawn(move || {
            node1.watch_during::<()>(Some(bound), "", || Err(LaunchError::Device("no GPU here".into())))
        });
        let err = node0
            .watch_during(Some(bound), "checked", || {
                std::thread::sleep(Duration::from_secs(30));
                Ok(())
            })
            .unwrap_err();
        assert!(err.to_string().starts_with("rank 1 on node 1 (127.0.0.1:"), "{err}");
        assert_eq!(peer.join().unwrap().unwrap_err().to_string(), "no GPU here");

        // The master's work not done in time: both fail, the peer told why.
        let (node0, node1) = pair();
        let peer = std::thread::spawn(move || node1.watch_during(Some(Duration::from_secs(20)), "", || Ok(())));
        let hang = || {
            std::thread::sleep(Duration::from_secs(30));
            Ok(())
        };
        let err = node0.watch_during(Some(Duration::from_secs(1)), "checked", hang).unwrap_err();
        assert_eq!(err.kind(), "device");
        assert!(err.to_string().contains("did not finish on every rank within 1 s"), "{err}");
        let err = peer.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("did not finish on every rank"), "{err}");
    }

    #[test]
    fn launch_rendezvous_refuses_another_deployment_on_both_sides() {
        let (port, node0) = master(me(0, &[0, 1], 4, "k3 tp4"));
        let err = join("127.0.0.1", port, &me(1, &[2, 3], 4, "k3-mini tp4")).err().expect("refused");
        assert_eq!(err.kind(), "mismatch");
        assert!(err.to_string().contains("fingerprint mismatch"), "{err}");
        let err = node0.join().unwrap().err().expect("the master fails too");
        assert!(err.to_string().contains("ranks 2, 3 on node 1"), "{err}");

        let (port, node0) = master(me(0, &[0], 2, "f"));
        let err = join("127.0.0.1", port, &me(1, &[2, 3], 4, "f")).err().expect("refused");
        assert!(err.to_string().contains("world size mismatch"), "{err}");
        assert_eq!(node0.join().unwrap().err().map(|e| e.kind()), Some("mismatch"));

        let (port, node0) = master(me(0, &[0, 1], 4, "f"));
        let err = join("127.0.0.1", port, &me(1, &[1, 2], 4, "f")).err().expect("refused");
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(node0.join().unwrap().is_err());
    }

    #[test]
    fn launch_rendezvous_times_out_naming_who_is_missing() {
        let short = Join { rendezvous_timeout: Duration::from_secs(1), ..me(0, &[0], 2, "f") };
        let (_, node0) = master(short);
        let err = node0.join().unwrap().err().expect("nobody came");
        assert!(err.to_string().contains("ranks 1 never joined"), "{err}");
        let alone = Join { rendezvous_timeout: Duration::from_secs(1), ..me(1, &[1], 2, "f") };
        let free = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let err = join("127.0.0.1", free, &alone).err().expect("no master");
        assert!(err.to_string().contains("cannot reach the master"), "{err}");
    }

    #[test]
    fn launch_peers_that_die_or_go_silent_take_the_group_down() {
        // A peer whose process ends: its connection closes.
        let (port, node0) = master(me(0, &[0], 2, "f"));
        let node1 = join("127.0.0.1", port, &me(1, &[1], 2, "f")).unwrap();
        let node0 = node0.join().unwrap().unwrap();
        drop(node1);
        let err = node0.watch(Some(Duration::from_secs(20))).unwrap_err();
        assert_eq!(err.kind(), "peer_gone");
        assert!(err.to_string().starts_with("rank 1 on node 1 (127.0.0.1:"), "{err}");
        assert!(err.to_string().contains("went away: its connection closed"), "{err}");

        // A peer that hangs with its connection open: it says hello, then nothing.
        let (port, node0) = master(me(0, &[0], 2, "f"));
        let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write_message(&mut silent, &Message::Hello(me(1, &[1], 2, "f").hello())).unwrap();
        assert_eq!(read_message(&mut silent).unwrap().name(), "welcome");
        let started = Instant::now();
        let err = node0.join().unwrap().unwrap().watch(None).unwrap_err();
        assert!(err.to_string().contains("no heartbeat for 1 s"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
