//! The launch contract on the command line: `sparkd rendezvous` (the contract alone, for checking a
//! deployment's network before loading its weights), the hidden `sparkd worker` (one local rank, started by
//! `serve`: it follows rank 0), and `sparkd serve --device cuda` over several ranks (workers, rendezvous with an
//! NCCL unique id, every rank's NCCL communicator formed and checked, then rank 0 serves `CudaRunner::sharded`
//! while every other rank runs `cuda::follower::Follower`).
//!
//! Invariants:
//! - Node 0's process is the master; every other process joins it. A process holds its node's ranks
//!   (`rendezvous`), one rank (`worker`), or its node's first rank while its workers hold the others (`serve`).
//! - Every failure is an error with a non-zero exit, never a hang: the rendezvous and every read are bounded.
//! - `serve` sets the NVLink-multicast-off variables in its own environment before any thread starts, and
//!   its workers are killed and reaped before it exits.
//! - A CUDA group's processes join NCCL, load their shards and serve (rank 0) or follow (the others) while the
//!   group is watched (`Group::watch_during`, unbounded: it lasts as long as the group serves): a rank that fails
//!   or goes away ends the group naming it, and every process exits with that error (a collective left waiting on
//!   a peer that is gone ends with its process). The server stopping ends the group normally: rank 0's runner
//!   sends the followers `Shutdown`, and the watch closes the group.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::sync::Arc;

use sparkd::config::ServeArgs;
use sparkd::launch::rendezvous::{join, Group, Join, Master, NcclUniqueId, RandomUniqueId};
use sparkd::launch::workers::{die_with_parent, WorkerLaunch, Workers};
use sparkd::launch::{disable_nvlink_multicast_here, LaunchArgs, LaunchError, Rank};
use sparkd::startup::ModelWeights;
use sparkd_kernels::cuda::follower::Follower;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::nccl::{NcclComm, NcclGroup};
use sparkd_kernels::cuda::tp::DeviceGroup;
use sparkd_kernels::cuda::weights::check_shapes;
use sparkd_kernels::shard_rule::Shard;
use sparkd_kernels::ModelConfig;

/// `sparkd rendezvous` options.
#[derive(clap::Args)]
pub struct RendezvousArgs {
    #[command(flatten)]
    launch: LaunchArgs,
    /// Ranks of the whole group (default: one per node).
    #[arg(long, value_name = "N")]
    tensor_parallel_size: Option<usize>,
    /// What the group will serve; every node must give the same (e.g. the model and its sharding).
    #[arg(long, default_value = "sparkd rendezvous", value_name = "TEXT")]
    fingerprint: String,
    /// Keep the group up this long after it forms, watching every member (0: exit once it is printed).
    #[arg(long, default_value_t = 0, value_name = "SECS")]
    hold_seconds: u64,
}

/// `sparkd worker` options (started by `sparkd serve`, not by people).
#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    launch: LaunchArgs,
    /// The rank this worker holds.
    #[arg(long)]
    rank: u32,
    #[arg(long, value_name = "N")]
    tensor_parallel_size: usize,
    #[arg(long, value_name = "TEXT")]
    fingerprint: String,
    /// The checkpoint whose shard this rank loads (as `serve --model`).
    #[arg(long, value_name = "DIR")]
    model: Option<std::path::PathBuf>,
    /// The synthetic model whose shard this rank loads without `--model` (as `serve --synthetic`).
    #[arg(long, default_value = "k3-mini", value_name = "NAME")]
    synthetic: String,
    /// Routed experts placed whole on ranks (as `serve --expert-parallel`).
    #[arg(long)]
    expert_parallel: bool,
}

/// Runs `sparkd rendezvous`: forms the group, prints it, holds it if asked, exits.
pub fn rendezvous(args: &RendezvousArgs) -> Result<()> {
    let world = args.tensor_parallel_size.unwrap_or(args.launch.nnodes as usize);
    let layout = args.launch.layout(world)?;
    let me = Join {
        layout,
        ranks: layout.ranks_of(layout.node),
        fingerprint: args.fingerprint.clone(),
        rendezvous_timeout: args.launch.rendezvous_timeout(),
        heartbeat_timeout: args.launch.heartbeat_timeout(),
    };
    let group = form(&args.launch, me, &mut || Ok(()))?;
    print_group(&group, &args.fingerprint);
    if args.hold_seconds > 0 {
        group.watch(Some(Duration::from_secs(args.hold_seconds)))?;
    } else {
        group.close("the rendezvous check is done");
    }
    Ok(())
}

/// Runs `sparkd worker`: joins the group as one rank, joins its NCCL communicator, loads its shard and follows rank
/// 0 until rank 0 ends the group (or a member goes away: an error).
pub fn worker(args: &WorkerArgs) -> Result<()> {
    die_with_parent()?;
    let layout = args.launch.layout(args.tensor_parallel_size)?;
    let me = Join {
        layout,
        ranks: vec![Rank(args.rank)],
        fingerprint: args.fingerprint.clone(),
        rendezvous_timeout: args.launch.rendezvous_timeout(),
        heartbeat_timeout: args.launch.heartbeat_timeout(),
    };
    let port = args.launch.master_port.context("--master-port: a worker needs the master's port")?;
    let group = join(&args.launch.master_addr, port, &me)?;
    tracing::info!("{} joined a group of {} ranks", Rank(args.rank), group.layout.world);
    let (rank, world) = (Rank(args.rank), group.layout.world as usize);
    let nccl = bounded(args.launch.rendezvous_timeout(), join_nccl(&group, rank));
    let shard = Shard { rank: rank.0 as usize, world, expert_parallel: args.expert_parallel };
    let (model, synthetic) = (args.model.clone(), args.synthetic.clone());
    let work = move || {
        let device_group = DeviceGroup::new(shard, Arc::new(nccl()?)).map_err(|e| rank_failed(rank, e.into()))?;
        follow(rank, device_group, model.as_deref(), &synthetic)
    };
    group.watch_during(None, "", work)?;
    Ok(())
}

/// A rank's failure, named, as the group's watch reports it.
fn rank_failed(rank: Rank, e: anyhow::Error) -> LaunchError {
    LaunchError::Device(format!("{rank}: {e:#}"))
}

/// A following rank: loads its shard of `--model` (else the synthetic preset) on device 0 of what the process sees
/// and follows rank 0 until rank 0 ends the group.
fn follow(rank: Rank, group: DeviceGroup, model: Option<&Path>, synthetic: &str) -> Result<(), LaunchError> {
    let fail = |e: anyhow::Error| rank_failed(rank, e);
    let weights = ModelWeights::open(model, synthetic).map_err(fail)?;
    let gpu = Gpu::new(0).map_err(|e| fail(e.into()))?;
    let follower = Follower::new(gpu, weights.config(), weights.weights(), group).map_err(|e| fail(e.into()))?;
    tracing::info!("{rank}: loaded its shard; following rank 0");
    follower.run().map_err(|e| fail(e.into()))
}

/// This process's part of the group's NCCL communicator, to run while the group is watched: it opens device 0 of
/// what the process sees (a worker's one GPU, the launcher's first), joins with the welcome's unique id
/// (`ncclCommInitRank`) and checks the group end to end with a one-value all-reduce (`NcclComm::check_sum`).
fn join_nccl(group: &Group, rank: Rank) -> impl FnOnce() -> Result<NcclComm, LaunchError> + Send + 'static {
    let (id, world) = (group.unique_id.0, group.layout.world as usize);
    move || {
        let fail = |e: sparkd_kernels::KernelError| LaunchError::Device(format!("{rank}: {e}"));
        let ctx = sparkd_kernels::cuda::device::open(0).map_err(fail)?;
        let comm = NcclComm::init(&ctx, NcclGroup { id: &id, rank: rank.0 as usize, world }).map_err(fail)?;
        comm.check_sum(&ctx).map_err(fail)?;
        tracing::info!("{rank}: joined the NCCL communicator of {world} ranks; its all-reduce check passed");
        Ok(comm)
    }
}

/// `join` run on a thread of its own and waited for at most `bound` (`--rendezvous-timeout`): the group's watch has
/// no bound once it serves, so forming the communicator keeps its own (a peer alive but never joining would
/// otherwise hold every rank in `ncclCommInitRank`).
fn bounded<T: Send + 'static>(
    bound: Duration,
    join: impl FnOnce() -> Result<T, LaunchError> + Send + 'static,
) -> impl FnOnce() -> Result<T, LaunchError> {
    move || {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(join());
        });
        rx.recv_timeout(bound).unwrap_or_else(|_| {
            Err(LaunchError::Device(format!(
                "the NCCL communicator did not form within {} s (--rendezvous-timeout)",
                bound.as_secs()
            )))
        })
    }
}

/// `sparkd serve --device cuda` over several ranks: starts this node's workers, forms the group with them
/// (and with the other nodes; node 0 draws the id with `ncclGetUniqueId`, so a node 0 without NCCL fails here,
/// naming the library), joins the NCCL communicator and runs `serve` with rank 0's group, watched as long as it
/// serves. A node other than 0 holds one rank of its own beside its workers and follows with it.
pub fn serve_sharded_cuda(
    args: &ServeArgs,
    serve: impl FnOnce(ServeArgs, DeviceGroup) -> Result<()> + Send + 'static,
) -> Result<()> {
    disable_nvlink_multicast_here();
    let layout = args.launch.layout(args.tensor_parallel_size)?;
    check_shards(args)?;
    let fingerprint = fingerprint(args)?;
    let first = layout.ranks_of(layout.node)[0];
    let me = Join {
        layout,
        ranks: vec![first],
        fingerprint: fingerprint.clone(),
        rendezvous_timeout: args.launch.rendezvous_timeout(),
        heartbeat_timeout: args.launch.heartbeat_timeout(),
    };
    let exe = std::env::current_exe().context("locating the sparkd binary for the workers")?;
    let mut launch = WorkerLaunch {
        exe,
        layout,
        master_addr: args.launch.master_addr.clone(),
        master_port: args.launch.master_port.unwrap_or(0),
        fingerprint,
        rendezvous_timeout: args.launch.rendezvous_timeout(),
        heartbeat_timeout: args.launch.heartbeat_timeout(),
        visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        model: args.model.clone(),
        synthetic: args.synthetic.clone(),
        expert_parallel: args.expert_parallel,
    };
    // The workers are dropped (killed and reaped) on every way out of here.
    let (group, workers) = if layout.is_master_node() {
        let master = Master::bind(&args.launch.master_addr, launch.master_port, me)?;
        launch.master_port = master.local_addr()?.port();
        let mut workers = Workers::spawn(&launch)?;
        (master.gather(&NcclUniqueId, &mut || workers.check()), workers)
    } else {
        let workers = Workers::spawn(&launch)?;
        (join(&args.launch.master_addr, launch.master_port, &me), workers)
    };
    let group = group?;
    tracing::info!(
        "the group of {} ranks formed (unique id {}…); worker pids {:?}",
        layout.world,
        &group.unique_id.to_hex()[..16],
        workers.pids()
    );
    let nccl = bounded(args.launch.rendezvous_timeout(), join_nccl(&group, first));
    let shard = Shard { rank: first.0 as usize, world: layout.world as usize, expert_parallel: args.expert_parallel };
    let (args, is_master) = (args.clone(), group.is_master());
    let work = move || {
        let device_group = DeviceGroup::new(shard, Arc::new(nccl()?)).map_err(|e| rank_failed(first, e.into()))?;
        match is_master {
            true => serve(args, device_group).map_err(|e| rank_failed(first, e)),
            false => follow(first, device_group, args.model.as_deref(), &args.synthetic),
        }
    };
    let served = group.watch_during(None, "the server stopped", work);
    drop(workers);
    Ok(served?)
}

/// Refuses, before any process starts, a group that cannot shard the model on CUDA: a size that does not divide
/// its heads, widths, vocabulary or (with `--expert-parallel`) experts, or a rank's widths the kernels do not take
/// (an expert split by width below whole MXFP4 groups). Every rank's widths are the same.
fn check_shards(args: &ServeArgs) -> Result<()> {
    let cfg = match &args.model {
        Some(dir) => ModelConfig::from_file(&Path::new(dir).join("config.json"))?,
        None => ModelWeights::open(None, &args.synthetic)?.config().clone(),
    };
    let shard = Shard { rank: 0, world: args.tensor_parallel_size, expert_parallel: args.expert_parallel };
    check_shapes(&shard.local_config(&cfg)?).with_context(|| {
        format!(
            "--tensor-parallel-size {}{}: a rank's part of the model does not fit the CUDA kernels",
            shard.world,
            if shard.expert_parallel { " --expert-parallel" } else { "" }
        )
    })?;
    Ok(())
}

/// Node 0 listens and gathers the group; every other node joins it.
fn form(launch: &LaunchArgs, me: Join, poll: &mut dyn FnMut() -> Result<(), LaunchError>) -> Result<Group> {
    let port = launch.master_port.unwrap_or(0);
    if !me.layout.is_master_node() {
        return Ok(join(&launch.master_addr, port, &me)?);
    }
    let master = Master::bind(&launch.master_addr, port, me)?;
    tracing::info!("rendezvous: listening on {}", master.local_addr()?);
    Ok(master.gather(&RandomUniqueId, poll)?)
}

/// The group as `sparkd rendezvous` prints it (the same on every node).
fn print_group(group: &Group, fingerprint: &str) {
    let l = group.layout;
    println!("group: {} ranks on {} nodes ({} per node), fingerprint `{fingerprint}`", l.world, l.nnodes, l.per_node());
    println!("unique id: {}", group.unique_id.to_hex());
    for m in &group.members {
        println!("rank {}  node {}  {}  host {}  pid {}", m.rank.0, m.node.0, m.addr, m.hostname, m.pid);
    }
}

/// What a serving group must agree on: the model (its `config.json`'s SHA-256, or the synthetic preset) and
/// the sharding.
fn fingerprint(args: &ServeArgs) -> Result<String> {
    let model = match &args.model {
        Some(dir) => {
            let path = Path::new(dir).join("config.json");
            let bytes = std::fs::read(&path).with_context(|| format!("--model: reading {}", path.display()))?;
            let digest: String = Sha256::digest(&bytes).iter().take(8).map(|b| format!("{b:02x}")).collect();
            format!("config.json sha256 {digest}")
        }
        None => format!("synthetic {}", args.synthetic),
    };
    Ok(format!("{model} tp={} ep={}", args.tensor_parallel_size, args.expert_parallel))
}
