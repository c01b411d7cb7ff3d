//! What one rank of a tensor-parallel group holds of K3, and how its partial sums are completed.
//!
//! Follows §6.3 of the K3 reference (shared/reference/k3-architecture.md, "TP2 over 2 GPUs: what gets
//! sharded"), for any group size `N` that divides the sharded dimensions:
//! - KDA: heads split in contiguous blocks (`q/k/v/g_proj`, `f_b_proj`, `b_proj`, the conv weights,
//!   `dt_bias` and `A_log` by head-major rows); `f_a_proj` and `o_norm` replicated; `o_proj` split by
//!   columns (row-parallel), its partial output all-reduced. The KDA state shards with the heads.
//! - MLA: heads split (`q_b_proj`, `kv_b_proj`, `g_proj` by rows); `q_a_proj`, `q_a_layernorm`,
//!   `kv_a_proj_with_mqa` and `kv_a_layernorm` replicated, so the latent cache is replicated; `o_proj`
//!   row-parallel.
//! - Dense and shared-expert MLPs: `gate`/`up` column-parallel, `down` row-parallel (Megatron's MLP split).
//! - Routed experts: expert-parallel with `--expert-parallel` (rank `r` holds experts `r·E/N..(r+1)·E/N`
//!   whole), else tensor-parallel (every expert's `w1`/`w3` rows and `w2` columns split). The router,
//!   its bias, `routed_expert_down_proj`, `routed_expert_norm` and `routed_expert_up_proj` are
//!   replicated. The routed latent output is complete before `routed_expert_norm`: under expert
//!   parallelism each rank's partial combined output is all-reduced; split by width, each expert's
//!   partial output is (`cpu::moe::latent_moe_reduced` says why, and why not an all-to-all).
//! - Embedding and lm_head vocabulary-parallel (rank `r` holds ids `r·V/N..(r+1)·V/N`, after vLLM's
//!   `VocabParallelEmbedding` / `ParallelLMHead`): an embedding row is the owner's, zeros elsewhere,
//!   summed exactly by the all-reduce; the logits stay split until the runner gathers them.
//! - AttnRes queries and every `d`-wide RMSNorm replicated.
//!
//! Invariants: with `N = 1` a shard is the whole model and the forward computes exactly the bits of the
//! unsharded one (a partial sum completed by the identity, then rounded, is the unsharded output). With
//! `N > 1`, every rank's activations between layers are bit-identical (all-reduces sum in rank order on
//! every rank), so the router's decisions agree across ranks; they differ from `N = 1`'s only by the
//! order of the f32 additions in the row-parallel sums (and the bf16 rounding that follows).

use std::ops::Range;

use crate::comm::Communicator;
use crate::config::ModelConfig;
use crate::error::{KernelError, Result};
use crate::state::KdaState;

/// The flag a group size comes from (named in errors).
pub const TP_FLAG: &str = "--tensor-parallel-size";
/// The flag that places routed experts whole on ranks (named in errors).
pub const EP_FLAG: &str = "--expert-parallel";

/// One rank's place in a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
    /// Routed experts placed whole on ranks (expert parallelism) instead of split by width.
    pub expert_parallel: bool,
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1, expert_parallel: false };

    /// This rank's block of `total` items split in `world` equal contiguous blocks (`total % world == 0`,
    /// checked by [`Shard::check`]).
    pub fn block(&self, total: usize) -> Range<usize> {
        let per = total / self.world;
        self.rank * per..(self.rank + 1) * per
    }

    /// Checks that a group of `world` ranks divides every dimension `cfg` shards; errors name the flag.
    pub fn check(cfg: &ModelConfig, world: usize, expert_parallel: bool) -> Result<()> {
        if world == 0 {
            return Err(KernelError::config(TP_FLAG, "must be at least 1"));
        }
        let mut dims = vec![
            ("KDA heads (kda.num_heads)", cfg.kda.num_heads),
            ("MLA heads (mla.num_heads)", cfg.mla.num_heads),
            ("the dense MLP width (intermediate_size)", cfg.dense_intermediate),
            ("the shared-expert width (num_shared_experts · moe_intermediate_size)", cfg.moe.shared_dim()),
            ("the vocabulary (vocab_size)", cfg.vocab_size),
        ];
        if !expert_parallel {
            dims.push(("the routed-expert width (moe_intermediate_size)", cfg.moe.expert_dim));
        }
        for (what, n) in dims {
            if n % world != 0 {
                return Err(KernelError::config(TP_FLAG, format!("{world} does not divide {what} = {n}")));
            }
        }
        if expert_parallel && cfg.moe.num_experts % world != 0 {
            return Err(KernelError::config(
                EP_FLAG,
                format!(
                    "{TP_FLAG} {world} does not divide the routed experts (n_routed_experts = {})",
                    cfg.moe.num_experts
                ),
            ));
        }
        Ok(())
    }

    /// The config of this rank's part of the model: the per-rank head counts and MLP widths (what its
    /// forward and its states are shaped by). The vocabulary, hidden size, layers and expert count stay
    /// the model's.
    pub fn local_config(&self, cfg: &ModelConfig) -> Result<ModelConfig> {
        Self::check(cfg, self.world, self.expert_parallel)?;
        let mut local = cfg.clone();
        local.kda.num_heads /= self.world;
        local.mla.num_heads /= self.world;
        local.dense_intermediate /= self.world;
        if !self.expert_parallel {
            local.moe.expert_dim /= self.world;
        }
        Ok(local)
    }

    /// The routed experts this rank holds whole (expert parallelism), or every expert (split by width).
    pub fn experts(&self, num_experts: usize) -> Range<usize> {
        if self.expert_parallel {
            self.block(num_experts)
        } else {
            0..num_experts
        }
    }
}

/// Completes the partial sums of a forward: the identity on a whole model ([`Unsharded`], any precision),
/// an all-reduce over the group on a rank of a sharded one (`dyn Communicator`, in the f32 serving and the
/// f64 checking precision).
pub trait Reduce<F> {
    fn all_reduce(&self, buf: &mut [F]) -> Result<()>;
}

/// The reduction of a whole (unsharded) model: nothing to add.
pub struct Unsharded;

impl<F> Reduce<F> for Unsharded {
    fn all_reduce(&self, _buf: &mut [F]) -> Result<()> {
        Ok(())
    }
}

impl Reduce<f32> for dyn Communicator + '_ {
    fn all_reduce(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce_sum(buf)
    }
}

impl Reduce<f64> for dyn Communicator + '_ {
    fn all_reduce(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce_sum_f64(buf)
    }
}

/// Rows `rows` of a row-major `[_, width]` matrix.
pub fn slice_rows<T: Copy>(values: &[T], width: usize, rows: Range<usize>) -> Vec<T> {
    values[rows.start * width..rows.end * width].to_vec()
}

/// Columns `cols` of every row of a row-major `[_, width]` matrix.
pub fn slice_cols<T: Copy>(values: &[T], width: usize, cols: Range<usize>) -> Vec<T> {
    values.chunks_exact(width).flat_map(|row| row[cols.clone()].iter().copied()).collect()
}

/// Rank `shard.rank`'s part of a whole KDA layer state (`whole` shaped by the model's config): its heads'
/// recurrent states and its channels of the conv windows.
pub fn split_kda(whole: &KdaState<f32>, cfg: &ModelConfig, shard: &Shard) -> KdaState<f32> {
    let dk = cfg.kda.head_dim;
    let heads = shard.block(cfg.kda.num_heads);
    let p = cfg.kda.proj_dim();
    let channels = shard.block(p);
    KdaState {
        s: slice_rows(&whole.s, dk * dk, heads),
        conv: [0, 1, 2].map(|x| slice_cols(&whole.conv[x], p, channels.clone())),
    }
}

/// A KDA layer state's values in one flat buffer (`s`, then the q, k, v conv windows): what a rank
/// contributes to an export's all-gather.
pub fn flatten_kda(state: &KdaState<f32>) -> Vec<f32> {
    let mut out = state.s.clone();
    for c in &state.conv {
        out.extend_from_slice(c);
    }
    out
}

/// The whole KDA layer state from every rank's [`flatten_kda`] buffer, in rank order (`parts`, each of
/// the same length): heads concatenated, conv channels interleaved back per window row.
pub fn join_kda(parts: &[&[f32]], cfg: &ModelConfig, world: usize) -> KdaState<f32> {
    let dk = cfg.kda.head_dim;
    let s_len = cfg.kda.num_heads / world * dk * dk;
    let p_local = cfg.kda.proj_dim() / world;
    let window = (cfg.kda.conv_kernel - 1) * p_local;
    let mut whole = KdaState { s: Vec::with_capacity(s_len * world), conv: Default::default() };
    for part in parts {
        whole.s.extend_from_slice(&part[..s_len]);
    }
    for (x, conv) in whole.conv.iter_mut().enumerate() {
        let at = s_len + x * window;
        for row in 0..cfg.kda.conv_kernel - 1 {
            for part in parts {
                conv.extend_from_slice(&part[at + row * p_local..at + (row + 1) * p_local]);
            }
        }
    }
    whole
}
