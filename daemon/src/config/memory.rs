//! The memory budgets of `sparkd serve` (`--state-budget-bytes`, `--host-offload-bytes`, `--kept-responses-bytes`,
//! `--prefix-cache-bytes`, `--prefix-cache-device-bytes`), sized from the memory actually present once the model is
//! loaded.
//!
//! Invariants:
//! - A budget not given is the smaller of its fixed default and a share of the memory present: sequence states
//!   take at most [`STATE_SHARE`] of the device's free memory (of the host's available memory on the CPU and
//!   null backends, where states live in host memory), host copies of kept states at most [`OFFLOAD_SHARE`] and
//!   prefix snapshots at most [`PREFIX_SHARE`] of the host's available memory; together the host-resident
//!   defaults stay under two thirds of it. On a GPU, prefix snapshots kept as device forks take at most
//!   [`PREFIX_DEVICE_SHARE`] of the device's free memory; where states live in host memory there is no device
//!   tier (0), and a prefix cache disabled by `--prefix-cache-bytes 0` has none either.
//! - A budget given explicitly is kept as given, but start-up is refused (naming the flags and the memory found)
//!   when the budgets that live on the host add up to more than the host's available memory, or the state and
//!   prefix device budgets together are more than the device's free memory.
//! - Where the memory present cannot be read ([`MemoryPresent::unknown`]), the fixed defaults apply unchecked.
//! - The kept-responses budget bounds what kept responses hold in every tier, so it is not memory of its own:
//!   by default it is the state and host-offload budgets together.

use std::io;

use super::{ConfigError, Device};
use crate::engine::types::{
    DEFAULT_HOST_BUDGET_BYTES, DEFAULT_PREFIX_CACHE_BYTES, DEFAULT_PREFIX_DEVICE_BYTES, DEFAULT_STATE_BUDGET_BYTES,
};

/// Share of the free device memory (host memory on the CPU) the default state budget may take.
pub const STATE_SHARE: f64 = 0.25;
/// Share of the available host memory the default host-offload budget may take.
pub const OFFLOAD_SHARE: f64 = 0.25;
/// Share of the available host memory the default prefix-cache budget may take.
pub const PREFIX_SHARE: f64 = 0.125;
/// Share of the free device memory the default device tier of the prefix cache may take.
pub const PREFIX_DEVICE_SHARE: f64 = 0.0625;

/// The memory present once the model is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPresent {
    /// Host memory available to new allocations (`MemAvailable`).
    pub host_available: u64,
    /// Free device memory; `None` when states live in host memory (CPU and null backends).
    pub device_free: Option<u64>,
}

impl MemoryPresent {
    /// Memory that could not be read (no `/proc/meminfo`: not Linux): budgets take their fixed defaults, unchecked.
    pub fn unknown() -> Self {
        MemoryPresent { host_available: u64::MAX, device_free: None }
    }

    /// Reads `/proc/meminfo` and, for CUDA, the free memory of device 0.
    pub fn read(device: Device) -> io::Result<Self> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")?;
        let host_available = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .ok_or_else(|| io::Error::other("/proc/meminfo has no MemAvailable line"))?;
        let device_free = match device {
            Device::Cuda => Some(
                sparkd_kernels::cuda::device::probe(0).map_err(|e| io::Error::other(e.to_string()))?.free_memory as u64,
            ),
            _ => None,
        };
        Ok(MemoryPresent { host_available, device_free })
    }
}

/// The memory budgets flags; `None`: sized from the memory present.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct MemoryArgs {
    /// Device bytes for sequence states (live and kept). Default: 8 GiB, or a quarter of the free device memory
    /// (host memory on the CPU) when that is less.
    #[arg(long, value_name = "BYTES")]
    pub state_budget_bytes: Option<usize>,
    /// Host bytes for kept states offloaded from the device. Default: 16 GiB, or a quarter of the available host
    /// memory when that is less.
    #[arg(long, value_name = "BYTES")]
    pub host_offload_bytes: Option<usize>,
    /// Bytes for everything kept responses hold (`store`, `previous_response_id`): states on device and host,
    /// token histories, stored response objects. Beyond it the least recently used are removed (0 keeps none).
    /// Default: the state and host-offload budgets together.
    #[arg(long, value_name = "BYTES")]
    pub kept_responses_bytes: Option<usize>,
    /// Host bytes for prefix-cache snapshots (0 disables the prefix cache). Default: 8 GiB, or an eighth of the
    /// available host memory when that is less.
    #[arg(long, value_name = "BYTES")]
    pub prefix_cache_bytes: Option<usize>,
    /// Device bytes for prefix-cache snapshots kept as forked device states (GPU only): taking one is a
    /// device-to-device copy instead of a download of the whole state; beyond it the least recently used move to
    /// the host budget above. Default: 4 GiB, or a sixteenth of the free device memory when that is less; 0 on the
    /// CPU, and 0 exports every snapshot to the host.
    #[arg(long, value_name = "BYTES")]
    pub prefix_cache_device_bytes: Option<usize>,
}

/// The budgets the engine runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    pub state_bytes: usize,
    pub host_offload_bytes: usize,
    pub kept_responses_bytes: usize,
    pub prefix_cache_bytes: usize,
    pub prefix_device_bytes: usize,
}

fn share(bytes: u64, fraction: f64) -> usize {
    usize::try_from((bytes as f64 * fraction) as u64).unwrap_or(usize::MAX)
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl MemoryArgs {
    /// The budgets under `present` (module invariants).
    pub fn budgets(&self, present: &MemoryPresent) -> Result<Budgets, ConfigError> {
        let host = present.host_available;
        let state_pool = present.device_free.unwrap_or(host);
        let state_bytes =
            self.state_budget_bytes.unwrap_or(DEFAULT_STATE_BUDGET_BYTES.min(share(state_pool, STATE_SHARE)));
        let host_offload_bytes =
            self.host_offload_bytes.unwrap_or(DEFAULT_HOST_BUDGET_BYTES.min(share(host, OFFLOAD_SHARE)));
        let prefix_cache_bytes =
            self.prefix_cache_bytes.unwrap_or(DEFAULT_PREFIX_CACHE_BYTES.min(share(host, PREFIX_SHARE)));
        let prefix_device_bytes = match (present.device_free, prefix_cache_bytes) {
            (None, _) | (_, 0) => 0,
            (Some(free), _) => self
                .prefix_cache_device_bytes
                .unwrap_or(DEFAULT_PREFIX_DEVICE_BYTES.min(share(free, PREFIX_DEVICE_SHARE))),
        };
        let kept_responses_bytes = self.kept_responses_bytes.unwrap_or(state_bytes.saturating_add(host_offload_bytes));
        if state_bytes == 0 {
            return Err(ConfigError { flag: "state-budget-bytes", reason: "must be at least 1".into() });
        }
        if let Some(free) = present.device_free {
            let on_device = state_bytes as u64 + prefix_device_bytes as u64;
            if on_device > free {
                let flag = match state_bytes as u64 > free {
                    true => "state-budget-bytes",
                    false => "prefix-cache-device-bytes",
                };
                return Err(ConfigError {
                    flag,
                    reason: format!(
                        "{} of sequence states and {} of prefix snapshots do not fit the {} of device memory free \
                         after the model loaded",
                        gib(state_bytes as u64),
                        gib(prefix_device_bytes as u64),
                        gib(free)
                    ),
                });
            }
        }
        let on_host = [
            (present.device_free.is_none(), "--state-budget-bytes", state_bytes),
            (true, "--host-offload-bytes", host_offload_bytes),
            (true, "--prefix-cache-bytes", prefix_cache_bytes),
        ];
        let host_total: u64 = on_host.iter().filter(|(on, ..)| *on).map(|(_, _, b)| *b as u64).sum();
        if host_total > host {
            let parts: Vec<String> = on_host
                .iter()
                .filter(|(on, ..)| *on)
                .map(|(_, flag, b)| format!("{flag} {}", gib(*b as u64)))
                .collect();
            return Err(ConfigError {
                flag: "host-offload-bytes",
                reason: format!(
                    "the host-resident budgets ({}) add up to {}, more than the {} of host memory available; lower them",
                    parts.join(", "),
                    gib(host_total),
                    gib(host)
                ),
            });
        }
        Ok(Budgets { state_bytes, host_offload_bytes, kept_responses_bytes, prefix_cache_bytes, prefix_device_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn defaults_follow_the_memory_present_and_stay_fixed_on_large_machines() {
        let big = MemoryPresent { host_available: 1024 * GIB, device_free: Some(100 * GIB) };
        let b = MemoryArgs::default().budgets(&big).unwrap();
        assert_eq!(b.state_bytes, DEFAULT_STATE_BUDGET_BYTES);
        assert_eq!(b.host_offload_bytes, DEFAULT_HOST_BUDGET_BYTES);
        assert_eq!(b.prefix_cache_bytes, DEFAULT_PREFIX_CACHE_BYTES);
        assert_eq!(b.kept_responses_bytes, DEFAULT_STATE_BUDGET_BYTES + DEFAULT_HOST_BUDGET_BYTES);
        assert_eq!(b.prefix_device_bytes, DEFAULT_PREFIX_DEVICE_BYTES);

        // A 24 GB host on the CPU: the old fixed defaults (8 + 16 + 8 GiB) did not fit; these take five eighths.
        let small = MemoryPresent { host_available: 20 * GIB, device_free: None };
        let b = MemoryArgs::default().budgets(&small).unwrap();
        assert_eq!((b.state_bytes, b.host_offload_bytes, b.prefix_cache_bytes), (5 << 30, 5 << 30, (5 << 30) / 2));
        assert!((b.state_bytes + b.host_offload_bytes + b.prefix_cache_bytes) as u64 <= small.host_available * 2 / 3);
        assert_eq!(b.prefix_device_bytes, 0, "no device tier where states live in host memory");
    }

    #[test]
    fn the_prefix_device_tier_takes_a_share_of_the_gpu_and_goes_with_the_cache() {
        let gpu = MemoryPresent { host_available: 1024 * GIB, device_free: Some(32 * GIB) };
        assert_eq!(MemoryArgs::default().budgets(&gpu).unwrap().prefix_device_bytes, 2 << 30);
        let off = MemoryArgs { prefix_cache_bytes: Some(0), ..MemoryArgs::default() };
        assert_eq!(off.budgets(&gpu).unwrap().prefix_device_bytes, 0, "disabling the cache disables both tiers");
        let too_much = MemoryArgs {
            state_budget_bytes: Some(20 << 30),
            prefix_cache_device_bytes: Some(16 << 30),
            ..MemoryArgs::default()
        };
        let err = too_much.budgets(&gpu).unwrap_err();
        assert_eq!(err.flag, "prefix-cache-device-bytes");
        assert!(err.to_string().contains("16.0 GiB of prefix snapshots"), "{err}");
    }

    #[test]
    fn unknown_memory_leaves_the_fixed_defaults() {
        let b = MemoryArgs::default().budgets(&MemoryPresent::unknown()).unwrap();
        assert_eq!((b.state_bytes, b.host_offload_bytes), (DEFAULT_STATE_BUDGET_BYTES, DEFAULT_HOST_BUDGET_BYTES));
    }

    #[test]
    fn explicit_budgets_that_do_not_fit_are_refused_naming_the_flags() {
        let host = MemoryPresent { host_available: 20 * GIB, device_free: None };
        let args = MemoryArgs { host_offload_bytes: Some(16 << 30), ..MemoryArgs::default() };
        let err = args.budgets(&host).unwrap_err();
        assert!(err.to_string().contains("--host-offload-bytes 16.0 GiB"), "{err}");
        assert!(err.to_string().contains("20.0 GiB of host memory"), "{err}");

        let gpu = MemoryPresent { host_available: 1024 * GIB, device_free: Some(10 * GIB) };
        let args = MemoryArgs { state_budget_bytes: Some(12 << 30), ..MemoryArgs::default() };
        assert_eq!(args.budgets(&gpu).unwrap_err().flag, "state-budget-bytes");
        // On a GPU the state budget is device memory, not host memory.
        let fits = MemoryArgs { state_budget_bytes: Some(9 << 30), ..MemoryArgs::default() };
        assert_eq!(fits.budgets(&gpu).unwrap().state_bytes, 9 << 30);
        assert_eq!(
            MemoryArgs { state_budget_bytes: Some(0), ..MemoryArgs::default() }.budgets(&gpu).unwrap_err().flag,
            "state-budget-bytes"
        );
    }
}
