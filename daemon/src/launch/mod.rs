//! The launch contract of a group of ranks that spans processes and hosts: who is rank what, the group's
//! unique id (NCCL's `ncclUniqueId` once the NCCL communicator exists), and liveness: a rank that dies takes
//! the whole group down with an error naming it, never a hang. `docs/multi-gpu.md` ("Launch contract") is the
//! operator's description; this is the code's.
//!
//! - [`wire`]: the framing and the messages (length-prefixed JSON over TCP, versioned, every read bounded).
//! - [`rendezvous`]: node 0's rank 0 (the master) listens; every other process connects with bounded
//!   retries, says hello, and is answered with the unique id and the rank assignment. Afterwards each peer
//!   keeps its connection to the master open and both sides send heartbeats.
//! - [`workers`]: the worker processes of one host (`sparkd worker`), one per local rank but the first, with
//!   their GPU and the NVLink-multicast-off variables in their environment, killed and reaped on drop.
//!
//! Invariants:
//! - The group is `--tensor-parallel-size` ranks over `--nnodes` nodes, `tp / nnodes` ranks per node; rank
//!   `r` lives on node `r / per_node` ([`Layout`]). A layout that does not divide is an error naming the flags.
//! - Every wait is bounded: the rendezvous by `--rendezvous-timeout`, each read by a frame-size limit and a
//!   read timeout, a silent peer by `--heartbeat-timeout`.
//! - Every process the daemon starts for the group, and the daemon itself, runs with NVLink multicast off
//!   ([`NVLINK_MULTICAST_OFF`]): a program that uses it can put a host's shared GPUs out of service.

pub mod rendezvous;
pub mod wire;
pub mod workers;

use std::fmt;
use std::time::Duration;

/// Variables that keep NVLink multicast off in NCCL, PyTorch and NVSHMEM, set in every environment the daemon
/// builds for workers and in its own.
pub const NVLINK_MULTICAST_OFF: [(&str, &str); 3] =
    [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")];

/// Default `--rendezvous-timeout`: long enough for every node of a cluster to be started by hand.
pub const DEFAULT_RENDEZVOUS_TIMEOUT_SECS: u64 = 300;
/// Default `--heartbeat-timeout`: a peer silent for this long (it sends a heartbeat every fifth of it) is
/// taken for dead even though its connection is open.
pub const DEFAULT_HEARTBEAT_TIMEOUT_SECS: u64 = 15;

/// One rank of the group (0 ..= world size − 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Rank(pub u32);

/// One node (host) of the group (0 ..= nnodes − 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct NodeRank(pub u32);

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

impl fmt::Display for NodeRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// The multi-node flags, shared by `sparkd serve`, `sparkd rendezvous` and `sparkd worker`.
#[derive(Clone, Debug, clap::Args)]
pub struct LaunchArgs {
    /// Nodes (hosts) the group spans; `--tensor-parallel-size` counts the ranks of all of them and must be a
    /// multiple of it.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub nnodes: u32,
    /// This node's place in the group (0 ..= nnodes − 1); node 0 runs the rendezvous.
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub node_rank: u32,
    /// The host node 0 listens on for the rendezvous and every other node connects to.
    #[arg(long, default_value = "127.0.0.1", value_name = "HOST")]
    pub master_addr: String,
    /// The rendezvous port on `--master-addr`. Needed with `--nnodes` above 1; on one node any free port.
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// How long the rendezvous may take, in seconds: node 0 waits this long for every rank to join, every
    /// other node retries its connection this long.
    #[arg(long, default_value_t = DEFAULT_RENDEZVOUS_TIMEOUT_SECS, value_name = "SECS")]
    pub rendezvous_timeout: u64,
    /// After the rendezvous, how long a peer may stay silent (no heartbeat) before the group is taken down.
    #[arg(long, default_value_t = DEFAULT_HEARTBEAT_TIMEOUT_SECS, value_name = "SECS")]
    pub heartbeat_timeout: u64,
}

impl LaunchArgs {
    /// The group layout of `world` ranks (`--tensor-parallel-size`) over these nodes, checked.
    pub fn layout(&self, world: usize) -> Result<Layout, LaunchError> {
        let bad = |flags: &'static str, reason: String| LaunchError::Config { flags, reason };
        if self.nnodes == 0 {
            return Err(bad("--nnodes", "must be at least 1".into()));
        }
        if self.node_rank >= self.nnodes {
            return Err(bad("--node-rank", format!("{} is not below --nnodes {}", self.node_rank, self.nnodes)));
        }
        let world = u32::try_from(world).ok().filter(|&w| w > 0).ok_or_else(|| {
            bad("--tensor-parallel-size", format!("{world} ranks: must be between 1 and {}", u32::MAX))
        })?;
        if world % self.nnodes != 0 {
            return Err(bad(
                "--tensor-parallel-size/--nnodes",
                format!("{world} ranks do not split evenly over {} nodes", self.nnodes),
            ));
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return Err(bad(
                "--master-port",
                format!("needed with --nnodes {} (every node must agree on it)", self.nnodes),
            ));
        }
        if self.master_addr.trim().is_empty() {
            return Err(bad("--master-addr", "must name a host".into()));
        }
        if self.rendezvous_timeout == 0 || self.heartbeat_timeout == 0 {
            return Err(bad("--rendezvous-timeout/--heartbeat-timeout", "must be at least 1 second".into()));
        }
        Ok(Layout { world, nnodes: self.nnodes, node: NodeRank(self.node_rank) })
    }

    /// `--rendezvous-timeout` as a duration.
    pub fn rendezvous_timeout(&self) -> Duration {
        Duration::from_secs(self.rendezvous_timeout)
    }

    /// `--heartbeat-timeout` as a duration.
    pub fn heartbeat_timeout(&self) -> Duration {
        Duration::from_secs(self.heartbeat_timeout)
    }
}

/// The shape of the group, seen from one node: `world` ranks, `nnodes` nodes, `world / nnodes` per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub world: u32,
    pub nnodes: u32,
    /// This process's node.
    pub node: NodeRank,
}

impl Layout {
    /// Ranks per node.
    pub fn per_node(&self) -> u32 {
        self.world / self.nnodes
    }

    /// The node rank `r` lives on.
    pub fn node_of(&self, r: Rank) -> NodeRank {
        NodeRank(r.0 / self.per_node())
    }

    /// The ranks of `node`, in order.
    pub fn ranks_of(&self, node: NodeRank) -> Vec<Rank> {
        let first = node.0 * self.per_node();
        (first..first + self.per_node()).map(Rank).collect()
    }

    /// Whether this process is node 0, which runs the rendezvous.
    pub fn is_master_node(&self) -> bool {
        self.node.0 == 0
    }
}

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Flags that do not make a group.
    #[error("{flags}: {reason}")]
    Config { flags: &'static str, reason: String },
    /// The network: cannot listen, cannot connect, a write failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A frame that is not the protocol's (oversize, truncated, not JSON, an unexpected message).
    #[error("{0}")]
    Protocol(String),
    /// A peer whose deployment differs (protocol version, world size, nodes, model fingerprint, ranks).
    #[error("rendezvous refused: {0}")]
    Mismatch(String),
    /// The rendezvous did not complete in time.
    #[error("rendezvous timed out after {secs} s: {waiting}")]
    Timeout { secs: u64, waiting: String },
    /// A member of the group went away (its connection closed or it stopped sending heartbeats).
    #[error("{0}")]
    PeerGone(String),
    /// A worker process this daemon started exited or could not be started.
    #[error("{0}")]
    Worker(String),
    /// The device side of the group: NCCL cannot be loaded, or its unique id cannot be drawn.
    #[error("{0}")]
    Device(String),
}

impl LaunchError {
    /// A stable short name of the failure, for logs and tests.
    pub fn kind(&self) -> &'static str {
        match self {
            LaunchError::Config { .. } => "config",
            LaunchError::Io { .. } => "io",
            LaunchError::Protocol(_) => "protocol",
            LaunchError::Mismatch(_) => "mismatch",
            LaunchError::Timeout { .. } => "timeout",
            LaunchError::PeerGone(_) => "peer_gone",
            LaunchError::Worker(_) => "worker",
            LaunchError::Device(_) => "device",
        }
    }

    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> LaunchError {
        LaunchError::Io { what: what.into(), source }
    }
}

/// Sets [`NVLINK_MULTICAST_OFF`] in this process's environment. Call it before any thread starts (setting
/// the environment races with threads that read it).
pub fn disable_nvlink_multicast_here() {
    for (name, value) in NVLINK_MULTICAST_OFF {
        std::env::set_var(name, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchArgs,
    }

    fn args(extra: &[&str]) -> LaunchArgs {
        let mut all = vec!["sparkd"];
        all.extend_from_slice(extra);
        Cli::try_parse_from(all).expect("parses").launch
    }

    #[test]
    fn launch_layouts_split_the_ranks_over_the_nodes() {
        let l = args(&["--nnodes", "2", "--node-rank", "1", "--master-port", "29500"]).layout(16).unwrap();
        assert_eq!((l.per_node(), l.node_of(Rank(9)), l.is_master_node()), (8, NodeRank(1), false));
        assert_eq!(l.ranks_of(NodeRank(1)).first(), Some(&Rank(8)));
        let one = args(&[]).layout(4).unwrap();
        assert_eq!((one.world, one.nnodes, one.per_node()), (4, 1, 4));
    }

    #[test]
    fn launch_flags_that_make_no_group_name_the_flags() {
        let err = args(&["--nnodes", "3", "--master-port", "1"]).layout(4).unwrap_err();
        assert!(err.to_string().starts_with("--tensor-parallel-size/--nnodes:"), "{err}");
        assert_eq!(err.kind(), "config");
        let err = args(&["--nnodes", "2", "--node-rank", "2", "--master-port", "1"]).layout(4).unwrap_err();
        assert!(err.to_string().starts_with("--node-rank:"), "{err}");
        let err = args(&["--nnodes", "2"]).layout(4).unwrap_err();
        assert!(err.to_string().starts_with("--master-port:"), "{err}");
        assert!(args(&["--nnodes", "0"]).layout(4).is_err());
        assert!(args(&["--rendezvous-timeout", "0"]).layout(4).is_err());
        assert!(args(&[]).layout(0).is_err());
    }
}
