//! The worker processes of one node: `sparkd serve --device cuda --tensor-parallel-size N` holds its node's
//! first rank and starts one `sparkd worker` (the same binary, a hidden subcommand) for each other rank of
//! the node, which then joins the rendezvous like any other process of the group.
//!
//! Invariants:
//! - Each worker sees one GPU: `CUDA_VISIBLE_DEVICES` is the local rank's entry of the launcher's own list
//!   (or the local rank itself when the launcher has none), so the worker's device ordinal is 0.
//! - Each worker's environment has [`NVLINK_MULTICAST_OFF`] set, whatever the launcher's environment says.
//! - [`Workers`] owns its children: [`Workers::check`] reports one that exited, and dropping it gives each
//!   child [`EXIT_GRACE`] to leave on its own, then kills and reaps it, so no worker outlives its launcher.
//!   A worker also asks the kernel for SIGTERM should its launcher die first ([`die_with_parent`]).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{LaunchError, Layout, Rank, NVLINK_MULTICAST_OFF};

/// How long a dropped [`Workers`] waits for each child to exit by itself before killing it.
pub const EXIT_GRACE: Duration = Duration::from_secs(5);

/// What every worker of a node is started with.
#[derive(Clone, Debug)]
pub struct WorkerLaunch {
    /// The `sparkd` binary (this process's own).
    pub exe: PathBuf,
    pub layout: Layout,
    pub master_addr: String,
    /// The port the master listens on (the one it bound, when it chose).
    pub master_port: u16,
    pub fingerprint: String,
    pub rendezvous_timeout: Duration,
    pub heartbeat_timeout: Duration,
    /// The launcher's `CUDA_VISIBLE_DEVICES`, if set.
    pub visible_devices: Option<String>,
    /// What every rank loads its shard of: `--model DIR`, else the synthetic preset; and `--expert-parallel`.
    pub model: Option<PathBuf>,
    pub synthetic: String,
    pub expert_parallel: bool,
}

impl WorkerLaunch {
    /// The GPU of the node's `local`-th rank, as `CUDA_VISIBLE_DEVICES` for its worker.
    pub fn device_for(&self, local: u32) -> Result<String, LaunchError> {
        let Some(list) = self.visible_devices.as_deref() else { return Ok(local.to_string()) };
        let devices: Vec<&str> = list.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
        devices.get(local as usize).map(|d| d.to_string()).ok_or_else(|| LaunchError::Config {
            flags: "--tensor-parallel-size/--nnodes",
            reason: format!(
                "{} ranks per node, but CUDA_VISIBLE_DEVICES=`{list}` lists {} GPUs",
                self.layout.per_node(),
                devices.len()
            ),
        })
    }

    /// The command line of the worker holding `rank` (the node's `local`-th rank).
    fn command(&self, rank: Rank, local: u32) -> Result<Command, LaunchError> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("worker")
            .args(["--rank", &rank.0.to_string()])
            .args(["--tensor-parallel-size", &self.layout.world.to_string()])
            .args(["--nnodes", &self.layout.nnodes.to_string()])
            .args(["--node-rank", &self.layout.node.0.to_string()])
            .args(["--master-addr", &self.master_addr])
            .args(["--master-port", &self.master_port.to_string()])
            .args(["--fingerprint", &self.fingerprint])
            .args(["--rendezvous-timeout", &self.rendezvous_timeout.as_secs().to_string()])
            .args(["--heartbeat-timeout", &self.heartbeat_timeout.as_secs().to_string()])
            .args(["--synthetic", &self.synthetic])
            .env("CUDA_VISIBLE_DEVICES", self.device_for(local)?)
            .stdin(Stdio::null());
        if let Some(dir) = &self.model {
            cmd.arg("--model").arg(dir);
        }
        if self.expert_parallel {
            cmd.arg("--expert-parallel");
        }
        for (name, value) in NVLINK_MULTICAST_OFF {
            cmd.env(name, value);
        }
        Ok(cmd)
    }
}

/// The running workers of this node, killed and reaped on drop.
pub struct Workers {
    children: Vec<(Rank, Child)>,
}

impl Workers {
    /// Starts a worker for every rank of this node but its first (which the launcher holds).
    pub fn spawn(launch: &WorkerLaunch) -> Result<Workers, LaunchError> {
        let mut workers = Workers { children: Vec::new() };
        let ranks = launch.layout.ranks_of(launch.layout.node);
        for (local, &rank) in ranks.iter().enumerate().skip(1) {
            let local = local as u32;
            let mut cmd = launch.command(rank, local)?;
            let child = cmd.spawn().map_err(|e| {
                LaunchError::Worker(format!("cannot start the worker of {rank} ({}): {e}", launch.exe.display()))
            })?;
            tracing::info!(
                "started the worker of {rank} (pid {}, CUDA_VISIBLE_DEVICES={})",
                child.id(),
                launch.device_for(local)?
            );
            workers.children.push((rank, child));
        }
        Ok(workers)
    }

    /// An error naming the first worker that has exited.
    pub fn check(&mut self) -> Result<(), LaunchError> {
        for (rank, child) in &mut self.children {
            match child.try_wait() {
                Ok(Some(status)) => {
                    return Err(LaunchError::Worker(format!(
                        "the worker of {rank} (pid {}) exited ({status}) before the group formed",
                        child.id()
                    )))
                }
                Ok(None) => {}
                Err(e) => return Err(LaunchError::Worker(format!("cannot check the worker of {rank}: {e}"))),
            }
        }
        Ok(())
    }

    /// The workers' process ids, in rank order.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|(_, c)| c.id()).collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        let deadline = Instant::now() + EXIT_GRACE;
        for (rank, child) in &mut self.children {
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Ok(None) = child.try_wait() {
                tracing::warn!("killing the worker of {rank} (pid {})", child.id());
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// Asks the kernel to send this process SIGTERM when its parent (the launcher) dies, and exits at once if
/// the parent is already gone, so that a worker never outlives a launcher killed without its clean-up.
pub fn die_with_parent() -> Result<(), LaunchError> {
    #[cfg(target_os = "linux")]
    {
        let parent = std::os::unix::process::parent_id();
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory of ours.
        let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            return Err(LaunchError::io("prctl(PR_SET_PDEATHSIG)", std::io::Error::last_os_error()));
        }
        if parent == 1 {
            return Err(LaunchError::Worker("the launcher is already gone".into()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::rendezvous::{Join, Master, RandomUniqueId};
    use crate::launch::NodeRank;

    fn launch(visible: Option<&str>) -> WorkerLaunch {
        WorkerLaunch {
            exe: PathBuf::from("/bin/true"),
            layout: Layout { world: 4, nnodes: 2, node: NodeRank(1) },
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            fingerprint: "f".into(),
            rendezvous_timeout: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(1),
            visible_devices: visible.map(str::to_string),
            model: None,
            synthetic: "k3-mini".into(),
            expert_parallel: false,
        }
    }

    #[test]
    fn launch_workers_get_one_gpu_each_and_multicast_off() {
        assert_eq!(launch(None).device_for(1).unwrap(), "1");
        assert_eq!(launch(Some("4, 5")).device_for(1).unwrap(), "5");
        let err = launch(Some("4")).device_for(1).unwrap_err();
        assert!(err.to_string().contains("CUDA_VISIBLE_DEVICES=`4` lists 1 GPUs"), "{err}");
        let cmd = launch(Some("4,5")).command(Rank(3), 1).unwrap();
        let envs: Vec<(String, String)> =
            cmd.get_envs().filter_map(|(k, v)| Some((k.to_str()?.to_string(), v?.to_str()?.to_string()))).collect();
        for (name, value) in NVLINK_MULTICAST_OFF.iter().chain(&[("CUDA_VISIBLE_DEVICES", "5")]) {
            assert!(envs.contains(&(name.to_string(), value.to_string())), "{name} in {envs:?}");
        }
        let args: Vec<&str> = cmd.get_args().filter_map(|a| a.to_str()).collect();
        assert_eq!(&args[..3], ["worker", "--rank", "3"]);
    }

    #[test]
    fn launch_a_worker_that_dies_ends_the_rendezvous_at_once_and_is_reaped() {
        let layout = Layout { world: 2, nnodes: 1, node: NodeRank(0) };
        let me = Join {
            layout,
            ranks: vec![Rank(0)],
            fingerprint: "f".into(),
            rendezvous_timeout: Duration::from_secs(60),
            heartbeat_timeout: Duration::from_secs(1),
        };
        let master = Master::bind("127.0.0.1", 0, me).unwrap();
        let mut w = Workers::spawn(&WorkerLaunch { exe: PathBuf::from("/bin/false"), layout, ..launch(None) }).unwrap();
        let pid = w.pids()[0];
        let started = Instant::now();
        let err = master.gather(&RandomUniqueId, &mut || w.check()).err().expect("the worker died");
        assert_eq!(err.kind(), "worker");
        assert!(err.to_string().contains("the worker of rank 1"), "{err}");
        assert!(err.to_string().contains("before the group formed"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "not the 60 s rendezvous timeout");
        drop(w);
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "pid {pid} reaped");
    }
}
