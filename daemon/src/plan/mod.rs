//! `sparkd plan`: the bytes one rank needs to serve a K3-family model over several GPUs, and the largest batch
//! and context that fit. Pure arithmetic over the config (no device, no file): [`weights`] counts the tensor
//! list the loader uses, sharded as the reference's §6.3 says; [`memory`] estimates sequence state, the step
//! workspace, CUDA graphs and the runtime from what the CUDA backend allocates; [`units`] reads `141GB`.
//!
//! Invariants:
//! - [`PlanInput::check`] refuses what cannot be planned (zero counts, a tensor-parallel size that does not
//!   divide the GPUs, a context past the model's positions, more draft tokens than the daemon verifies) with a
//!   [`PlanError`] naming the flag; [`plan`] never panics on input.
//! - `gpus / tp` replicas each hold a whole model (tensor-parallel groups of `tp` ranks); every number is per
//!   rank, the fullest rank where ranks differ (expert parallelism over an expert count `tp` does not divide).
//! - [`Plan::fits`] holds exactly when weights, runtime, workspace, graphs and the states of `max_num_seqs`
//!   sequences of `context` tokens add up to at most the GPU's memory. The largest batch (at `context`) and the
//!   largest context (at `max_num_seqs`) are the exact maxima of that same sum, found by bisection (the sum is
//!   monotone in both).

pub mod memory;
pub mod units;
pub mod weights;

use sparkd_kernels::ModelConfig;

use self::memory::{Layout, Load, SeqBytes};
use self::weights::WeightPlan;

/// The most draft tokens the daemon verifies per row (`--num-spec-tokens`).
pub const MAX_SPEC_TOKENS: usize = 64;
/// The largest batch the search considers.
const MAX_BATCH: usize = 1 << 20;

/// Why a plan cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A byte quantity that cannot be read.
    #[error("`{value}` is not a byte size: {reason}")]
    Bytes { value: String, reason: String },
    /// A flag out of its range.
    #[error("{flag}: {reason}")]
    Flag { flag: &'static str, reason: String },
    /// A dimension that the ranks cannot split.
    #[error("{what}: {dim} does not split over {tp} ranks ({why})")]
    Indivisible { what: String, dim: usize, tp: usize, why: String },
    /// A tensor the shard rule (`sparkd_kernels::shard_rule`) does not know.
    #[error("{0}")]
    NoShardRule(String),
}

/// What to plan for.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub cfg: ModelConfig,
    /// GPUs in all (every node).
    pub gpus: usize,
    /// Bytes of memory of each GPU.
    pub gpu_memory: u64,
    /// Ranks of one tensor-parallel group (`--tensor-parallel-size`).
    pub tp: usize,
    /// Routed experts placed whole on ranks (`--expert-parallel`) instead of sliced.
    pub expert_parallel: bool,
    /// Sequences running at once per replica (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens of each sequence (`--context`, the daemon's `--max-model-len`).
    pub context: usize,
    /// Tokens per step (`--max-num-batched-tokens`).
    pub step_tokens: usize,
    /// Draft tokens verified per row (`--num-spec-tokens`; 0: no speculation).
    pub spec_tokens: usize,
}

impl PlanInput {
    /// Refuses input that cannot be planned, naming the flag.
    pub fn check(&self) -> Result<(), PlanError> {
        let flag = |flag, reason: String| Err(PlanError::Flag { flag, reason });
        if self.gpus == 0 {
            return flag("--gpus", "must be at least 1".into());
        }
        if self.tp == 0 || self.gpus % self.tp != 0 {
            return flag(
                "--tensor-parallel-size",
                format!("{} must be at least 1 and divide --gpus {}", self.tp, self.gpus),
            );
        }
        if self.max_num_seqs == 0 {
            return flag("--max-num-seqs", "must be at least 1".into());
        }
        if self.step_tokens == 0 {
            return flag("--max-num-batched-tokens", "must be at least 1".into());
        }
        let positions = self.cfg.max_position_embeddings;
        if self.context == 0 || self.context > positions {
            return flag("--context", format!("{} must be in 1..={positions} (the model's positions)", self.context));
        }
        if self.spec_tokens > MAX_SPEC_TOKENS {
            return flag("--num-spec-tokens", format!("{} is more than {MAX_SPEC_TOKENS}", self.spec_tokens));
        }
        Ok(())
    }

    fn layout(&self) -> Layout {
        Layout { tp: self.tp, expert_parallel: self.expert_parallel }
    }

    fn load(&self, batch: usize, context: usize) -> Load {
        Load { batch, context, step_tokens: self.step_tokens, spec_tokens: self.spec_tokens }
    }
}

/// Everything but the weights, for one batch and context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub batch: usize,
    pub context: usize,
    /// Sequence states of the whole batch.
    pub states: u64,
    pub workspace: u64,
    pub graphs: u64,
    pub runtime: u64,
}

impl Usage {
    /// What is not sequence state.
    pub fn fixed(&self) -> u64 {
        self.workspace + self.graphs + self.runtime
    }
}

/// A plan: the bytes of one rank and what fits.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Plan {
    pub gpus: usize,
    pub tp: usize,
    pub expert_parallel: bool,
    /// Tensor-parallel groups: whole models behind a load balancer.
    pub replicas: usize,
    pub gpu_memory: u64,
    pub weights: WeightPlan,
    pub seq: SeqBytes,
    /// At the asked batch and context.
    pub asked: Usage,
    /// The most sequences of the asked context that fit (0: none).
    pub largest_batch: usize,
    /// The longest context that fits with the asked batch (0: none).
    pub largest_context: usize,
    /// The chunk the MLA caches grow by (`--max-num-batched-tokens`).
    pub step_tokens: usize,
}

impl Plan {
    /// Bytes of the asked batch and context on one rank.
    pub fn needed(&self) -> u64 {
        self.weights.per_rank() + self.asked.fixed() + self.asked.states
    }

    /// Whether the asked batch and context fit.
    pub fn fits(&self) -> bool {
        self.needed() <= self.gpu_memory
    }

    /// What the daemon's `--state-budget-bytes` may be at the asked batch and context: the memory left after
    /// everything but states (0 when not even that fits).
    pub fn state_budget(&self) -> u64 {
        self.gpu_memory.saturating_sub(self.weights.per_rank() + self.asked.fixed())
    }
}

/// Plans `input` (module invariants).
pub fn plan(input: &PlanInput) -> Result<Plan, PlanError> {
    input.check()?;
    let weights = weights::weight_plan(&input.cfg, input.tp, input.expert_parallel)?;
    let layout = input.layout();
    let seq = memory::seq_bytes(&input.cfg, layout, input.spec_tokens);
    let usage = |batch: usize, context: usize| {
        let load = input.load(batch, context);
        Usage {
            batch,
            context,
            states: batch as u64 * seq.at(context, input.step_tokens),
            workspace: memory::workspace_bytes(&input.cfg, layout, load),
            graphs: memory::graph_bytes(&input.cfg, layout, load),
            runtime: memory::runtime_bytes(layout),
        }
    };
    let fits = |batch: usize, context: usize| {
        let u = usage(batch, context);
        weights.per_rank() + u.fixed() + u.states <= input.gpu_memory
    };
    let largest_batch = largest(MAX_BATCH, |b| fits(b, input.context));
    let largest_context = largest(input.cfg.max_position_embeddings, |c| fits(input.max_num_seqs, c));
    Ok(Plan {
        gpus: input.gpus,
        tp: input.tp,
        expert_parallel: input.expert_parallel,
        replicas: input.gpus / input.tp,
        gpu_memory: input.gpu_memory,
        weights,
        seq,
        asked: usage(input.max_num_seqs, input.context),
        largest_batch,
        largest_context,
        step_tokens: input.step_tokens,
    })
}

/// The largest `x` in `1..=max` with `ok(x)` for a monotone `ok` (true up to some point, false after), or 0.
fn largest(max: usize, ok: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0usize, max);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(gpus: usize, gpu_memory: u64, tp: usize, expert_parallel: bool) -> PlanInput {
        PlanInput {
            cfg: ModelConfig::preset("k3").unwrap(),
            gpus,
            gpu_memory,
            tp,
            expert_parallel,
            max_num_seqs: 32,
            context: 32_768,
            step_tokens: 2048,
            spec_tokens: 0,
        }
    }

    #[test]
    fn largest_is_the_exact_edge_of_a_monotone_predicate() {
        assert_eq!(largest(100, |x| x <= 37), 37);
        assert_eq!(largest(100, |_| true), 100);
        assert_eq!(largest(100, |_| false), 0);
        assert_eq!(largest(1, |x| x <= 1), 1);
    }

    #[test]
    fn k3_fits_16_gb300s_and_16_h200s_but_not_8_h200s() {
        let gb300 = plan(&input(16, 288_000_000_000, 16, true)).unwrap();
        assert!(gb300.fits(), "{gb300:?}");
        assert_eq!(gb300.replicas, 1);
        let h200 = plan(&input(16, 139 << 30, 16, true)).unwrap();
        assert!(h200.fits(), "{h200:?}");
        // The edges are exact: one more sequence (or token) does not fit.
        for p in [&gb300, &h200] {
            assert!(p.largest_batch >= 32 && p.largest_context >= 32_768);
            let more = plan(&PlanInput { max_num_seqs: p.largest_batch + 1, ..input(16, p.gpu_memory, 16, true) });
            assert!(!more.unwrap().fits());
            let edge = plan(&PlanInput { max_num_seqs: p.largest_batch, ..input(16, p.gpu_memory, 16, true) });
            assert!(edge.unwrap().fits());
        }
        // The experts alone need more than eight H200s hold.
        let eight = plan(&input(8, 139 << 30, 8, true)).unwrap();
        // ... and 64 sequences of 128k tokens need more than a GB300 has left: the latent cache is replicated.
        let long = plan(&PlanInput { max_num_seqs: 64, context: 131_072, ..input(16, 288_000_000_000, 16, true) });
        assert!(!long.unwrap().fits());
        assert!(!eight.fits() && eight.weights.per_rank() > 139 << 30);
        assert_eq!((eight.largest_batch, eight.largest_context), (0, 0));
    }

    #[test]
    fn the_state_budget_is_what_states_may_take() {
        let p = plan(&input(16, 139 << 30, 16, true)).unwrap();
        assert_eq!(p.state_budget(), p.gpu_memory - p.weights.per_rank() - p.asked.fixed());
        assert!(p.asked.states <= p.state_budget());
    }

    #[test]
    fn bad_input_names_the_flag() {
        let cases = [
            (PlanInput { gpus: 0, ..input(16, 1 << 40, 16, true) }, "--gpus"),
            (input(16, 1 << 40, 3, true), "--tensor-parallel-size"),
            (input(16, 1 << 40, 0, true), "--tensor-parallel-size"),
            (PlanInput { max_num_seqs: 0, ..input(16, 1 << 40, 16, true) }, "--max-num-seqs"),
            (PlanInput { context: 0, ..input(16, 1 << 40, 16, true) }, "--context"),
            (PlanInput { context: 1 << 21, ..input(16, 1 << 40, 16, true) }, "--context"),
            (PlanInput { step_tokens: 0, ..input(16, 1 << 40, 16, true) }, "--max-num-batched-tokens"),
            (PlanInput { spec_tokens: 65, ..input(16, 1 << 40, 16, true) }, "--num-spec-tokens"),
        ];
        for (bad, flag) in cases {
            let e = plan(&bad).unwrap_err().to_string();
            assert!(e.starts_with(flag), "{flag}: {e}");
        }
    }

    #[test]
    fn replicas_are_the_tensor_parallel_groups() {
        let mini = PlanInput { cfg: ModelConfig::preset("k3-mini").unwrap(), ..input(8, 139 << 30, 1, false) };
        let p = plan(&PlanInput { context: 32_768, ..mini }).unwrap();
        assert_eq!(p.replicas, 8);
        assert!(p.fits());
    }
}
