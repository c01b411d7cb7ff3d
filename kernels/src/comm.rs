//! The `Communicator` seam: the collectives a sharded forward needs, over a fixed group of ranks.
//!
//! Invariants (every implementation keeps them; NCCL's communicators keep them by construction):
//! - A collective is a group-wide call: every rank of the group makes the same calls in the same order
//!   with matching sizes. A rank that calls a different collective, or a different size, gets an error
//!   on every rank, never a wrong result.
//! - Reductions are deterministic and identical on every rank: rank `r`'s contribution is added in
//!   rank order (`((x_0 + x_1) + x_2) + ...`), never in arrival order, so every rank holds the same bits.
//! - A rank that fails, leaves the group ([`Communicator::abort`], or dropping its handle) or does not
//!   arrive within the group's timeout makes every other rank's pending and later collectives return
//!   [`KernelError::Device`] naming the cause; no rank waits forever on a peer that is gone.
//!
//! One implementation lives here: [`local_group`], ranks as threads of one process sharing a group
//! object (a mutex, a condvar and a round counter), for the CPU reference, so the sharded math is
//! tested exactly on machines without GPUs. The CUDA backend's collectives take device buffers and a
//! stream instead of host slices, so they have a seam of their own, `cuda::nccl::DeviceCommunicator`,
//! whose NCCL implementation maps each method to the NCCL call of the same name (`ncclAllReduce`,
//! `ncclAllGather`, `ncclReduceScatter`, `ncclBroadcast`) and `abort` to `ncclCommAbort`; it keeps the
//! invariants above except the rank-order summation (NCCL's order is its own; every rank still holds the
//! same bits).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{KernelError, Result};

/// One rank's handle on a group of ranks.
pub trait Communicator: Send {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Sums `buf` over every rank in place (rank order).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// [`Communicator::all_reduce_sum`] in f64, the checking precision (NCCL's `ncclFloat64`), so a sharded
    /// forward can be checked exactly without bf16 rounding.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()>;

    /// Every rank's `send` (equal lengths) concatenated in rank order into `out` (`[world, send.len()]`).
    fn all_gather(&self, send: &[f32], out: &mut [f32]) -> Result<()>;

    /// Sums `send` (`[world, chunk]`) over every rank and keeps chunk `rank` of the sum in `out` (`[chunk]`).
    fn reduce_scatter_sum(&self, send: &[f32], out: &mut [f32]) -> Result<()>;

    /// Variable-count all-to-all: `send[j]` goes to rank `j`; returns what every rank `i` sent to this one,
    /// in rank order (`recv[i]`). Counts may differ per pair and may be zero.
    fn all_to_all(&self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>>;

    /// Copies `root`'s `buf` into every rank's `buf` (equal lengths).
    fn broadcast(&self, root: usize, buf: &mut [f32]) -> Result<()>;

    /// [`Communicator::broadcast`] of bytes (a step plan, a command).
    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) -> Result<()>;

    /// Takes the group down: every rank's pending and later collectives fail with `reason`.
    fn abort(&self, reason: &str);

    /// A message of any length from `root` to every rank: its length, then its bytes. `msg` is read on
    /// `root` only.
    fn broadcast_message(&self, root: usize, msg: &[u8]) -> Result<Vec<u8>> {
        let mut len = (msg.len() as u64).to_le_bytes();
        self.broadcast_bytes(root, &mut len)?;
        let mut buf = if self.rank() == root { msg.to_vec() } else { vec![0u8; u64::from_le_bytes(len) as usize] };
        self.broadcast_bytes(root, &mut buf)?;
        Ok(buf)
    }
}

/// What a rank puts into one collective.
#[derive(Debug)]
enum Payload {
    Floats(Vec<f32>),
    Doubles(Vec<f64>),
    Bytes(Vec<u8>),
    /// All-to-all: one buffer per destination rank.
    Parts(Vec<Vec<f32>>),
}

/// The group's shared state; one collective (a round) at a time.
#[derive(Default)]
struct Round {
    /// Rounds completed so far.
    done: u64,
    /// The collective of the round being gathered, with its size, as the first rank to arrive named it.
    op: Option<(&'static str, usize)>,
    /// Contributions of the round being gathered, by rank.
    slots: Vec<Option<Payload>>,
    arrived: usize,
    /// The contributions of the last completed round, until every rank has read them.
    result: Option<Arc<Vec<Payload>>>,
    readers: usize,
    /// Why the group is down.
    poisoned: Option<String>,
}

struct Group {
    world: usize,
    timeout: Option<Duration>,
    round: Mutex<Round>,
    wake: Condvar,
}

/// An in-process group of `world` ranks (threads): one [`LocalComm`] per rank, to move into its rank's
/// thread. With a `timeout`, a rank that waits longer than that for its peers in one collective takes the
/// group down; without one, only a rank that aborts or drops its handle does (right for a serving group whose
/// ranks idle between steps).
pub fn local_group(world: usize, timeout: Option<Duration>) -> Result<Vec<LocalComm>> {
    if world == 0 {
        return Err(KernelError::InvalidInput("a communicator group needs at least one rank".into()));
    }
    let group = Arc::new(Group {
        world,
        timeout,
        round: Mutex::new(Round { slots: (0..world).map(|_| None).collect(), ..Round::default() }),
        wake: Condvar::new(),
    });
    Ok((0..world).map(|rank| LocalComm { rank, group: group.clone() }).collect())
}

/// One rank of a [`local_group`]. Dropping it takes the group down (a rank that exits, or panics, never
/// leaves its peers waiting).
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
}

impl LocalComm {
    fn lock(&self) -> MutexGuard<'_, Round> {
        self.group.round.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn down(reason: &str) -> KernelError {
        KernelError::Device(format!("communicator group is down: {reason}"))
    }

    /// Waits on the condvar until `ready`, the group goes down, or the deadline passes (which takes the
    /// group down, naming `what`).
    fn wait_until<'a>(
        &self,
        mut guard: MutexGuard<'a, Round>,
        deadline: Option<Instant>,
        what: &str,
        ready: impl Fn(&Round) -> bool,
    ) -> Result<MutexGuard<'a, Round>> {
        loop {
            if ready(&guard) {
                return Ok(guard);
            }
            if let Some(reason) = &guard.poisoned {
                return Err(Self::down(reason));
            }
            guard = match deadline {
                None => self.group.wake.wait(guard).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let missing: Vec<usize> = (0..self.group.world).filter(|r| guard.slots[*r].is_none()).collect();
                        let reason = format!(
                            "rank {} waited {:?} for {what}; ranks {missing:?} never arrived",
                            self.rank,
                            self.group.timeout.unwrap_or_default()
                        );
                        guard.poisoned = Some(reason.clone());
                        self.group.wake.notify_all();
                        return Err(Self::down(&reason));
                    }
                    self.group.wake.wait_timeout(guard, deadline - now).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }

    /// One round: deposits `mine` and returns every rank's contribution, by rank.
    fn exchange(&self, op: &'static str, size: usize, mine: Payload) -> Result<Arc<Vec<Payload>>> {
        let deadline = self.group.timeout.map(|t| Instant::now() + t);
        let guard = self.lock();
        // The previous round's result must be read by every rank before a new round gathers.
        let mut g = self.wait_until(guard, deadline, op, |r| r.result.is_none())?;
        if let Some(reason) = &g.poisoned {
            return Err(Self::down(reason));
        }
        match g.op {
            None => g.op = Some((op, size)),
            Some((other, other_size)) if other != op || other_size != size => {
                let reason = format!(
                    "rank {} called {op} of {size} while another rank called {other} of {other_size} (collectives \
                     must be called in the same order with the same sizes on every rank)",
                    self.rank
                );
                g.poisoned = Some(reason.clone());
                self.group.wake.notify_all();
                return Err(Self::down(&reason));
            }
            Some(_) => {}
        }
        g.slots[self.rank] = Some(mine);
        g.arrived += 1;
        let round = g.done;
        if g.arrived == self.group.world {
            let contributions: Vec<Payload> = g.slots.iter_mut().filter_map(Option::take).collect();
            g.result = Some(Arc::new(contributions));
            g.readers = self.group.world;
            g.arrived = 0;
            g.op = None;
            g.done += 1;
            self.group.wake.notify_all();
        }
        let mut g = self.wait_until(g, deadline, op, |r| r.done > round)?;
        let result = g.result.clone().ok_or_else(|| Self::down("a round's result vanished"))?;
        g.readers -= 1;
        if g.readers == 0 {
            g.result = None;
            self.group.wake.notify_all();
        }
        Ok(result)
    }

    fn floats(p: &Payload) -> Result<&[f32]> {
        match p {
            Payload::Floats(v) => Ok(v),
            _ => Err(Self::down("mismatched payloads in one collective")),
        }
    }

    fn doubles(p: &Payload) -> Result<&[f64]> {
        match p {
            Payload::Doubles(v) => Ok(v),
            _ => Err(Self::down("mismatched payloads in one collective")),
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut g = self.lock();
        if g.poisoned.is_none() {
            g.poisoned = Some(format!("rank {} left the group", self.rank));
        }
        self.group.wake.notify_all();
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        if self.group.world == 1 {
            return Ok(());
        }
        let all = self.exchange("all_reduce_sum", buf.len(), Payload::Floats(buf.to_vec()))?;
        buf.copy_from_slice(Self::floats(&all[0])?);
        for p in &all[1..] {
            for (b, x) in buf.iter_mut().zip(Self::floats(p)?) {
                *b += *x;
            }
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        if self.group.world == 1 {
            return Ok(());
        }
        let all = self.exchange("all_reduce_sum_f64", buf.len(), Payload::Doubles(buf.to_vec()))?;
        buf.copy_from_slice(Self::doubles(&all[0])?);
        for p in &all[1..] {
            for (b, x) in buf.iter_mut().zip(Self::doubles(p)?) {
                *b += *x;
            }
        }
        Ok(())
    }

    fn all_gather(&self, send: &[f32], out: &mut [f32]) -> Result<()> {
        if out.len() != send.len() * self.group.world {
            return Err(KernelError::InvalidInput(format!(
                "all_gather of {} values into {} over {} ranks",
                send.len(),
                out.len(),
                self.group.world
            )));
        }
        let all = self.exchange("all_gather", send.len(), Payload::Floats(send.to_vec()))?;
        for (chunk, p) in out.chunks_exact_mut(send.len().max(1)).zip(all.iter()) {
            chunk.copy_from_slice(Self::floats(p)?);
        }
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &[f32], out: &mut [f32]) -> Result<()> {
        let chunk = out.len();
        if send.len() != chunk * self.group.world {
            return Err(KernelError::InvalidInput(format!(
                "reduce_scatter of {} values into chunks of {chunk} over {} ranks",
                send.len(),
                self.group.world
            )));
        }
        let all = self.exchange("reduce_scatter_sum", send.len(), Payload::Floats(send.to_vec()))?;
        let range = self.rank * chunk..(self.rank + 1) * chunk;
        out.copy_from_slice(&Self::floats(&all[0])?[range.clone()]);
        for p in &all[1..] {
            for (o, x) in out.iter_mut().zip(&Self::floats(p)?[range.clone()]) {
                *o += *x;
            }
        }
        Ok(())
    }

    fn all_to_all(&self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        if send.len() != self.group.world {
            return Err(KernelError::InvalidInput(format!(
                "all_to_all with {} buffers over {} ranks",
                send.len(),
                self.group.world
            )));
        }
        let all = self.exchange("all_to_all", 0, Payload::Parts(send.to_vec()))?;
        all.iter()
            .map(|p| match p {
                Payload::Parts(parts) => Ok(parts[self.rank].clone()),
                _ => Err(Self::down("mismatched payloads in one collective")),
            })
            .collect()
    }

    fn broadcast(&self, root: usize, buf: &mut [f32]) -> Result<()> {
        self.check_root(root)?;
        let mine = if self.rank == root { buf.to_vec() } else { Vec::new() };
        let all = self.exchange("broadcast", buf.len(), Payload::Floats(mine))?;
        if self.rank != root {
            buf.copy_from_slice(Self::floats(&all[root])?);
        }
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) -> Result<()> {
        self.check_root(root)?;
        let mine = if self.rank == root { buf.to_vec() } else { Vec::new() };
        let all = self.exchange("broadcast_bytes", buf.len(), Payload::Bytes(mine))?;
        if self.rank != root {
            match &all[root] {
                Payload::Bytes(b) => buf.copy_from_slice(b),
                _ => return Err(Self::down("mismatched payloads in one collective")),
            }
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        let mut g = self.lock();
        if g.poisoned.is_none() {
            g.poisoned = Some(format!("rank {} aborted: {reason}", self.rank));
        }
        self.group.wake.notify_all();
    }
}

impl LocalComm {
    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.group.world {
            return Err(KernelError::InvalidInput(format!(
                "broadcast root {root} outside a group of {}",
                self.group.world
            )));
        }
        Ok(())
    }
}
