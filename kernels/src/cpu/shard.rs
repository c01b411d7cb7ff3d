//! What one rank of a tensor-parallel group holds of K3 beyond its weights (its shards of the KDA states), and
//! how its partial sums are completed. Which part of each weight a rank holds is `crate::shard_rule`'s (the one
//! per-tensor rule the loaders and `sparkd plan` share); in summary, after §6.3 of the K3 reference
//! (shared/reference/k3-architecture.md, "TP2 over 2 GPUs: what gets sharded"), for any group size `N` that
//! divides the sharded dimensions:
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

use crate::comm::Communicator;
use crate::config::ModelConfig;
use crate::error::{KernelError, Result};
use crate::shard_rule::{slice_cols, slice_rows, Shard};
use crate::state::{KdaState, MlaCache, SeqState};

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

/// A rank's KDA state shards, every layer's [`flatten_kda`] in layer order: what it contributes to an export's
/// all-gather (equal lengths on every rank: the heads split evenly).
pub fn kda_shards(state: &SeqState<f32>) -> Vec<f32> {
    state.kda.iter().flat_map(flatten_kda).collect()
}

/// The whole state of `len` tokens from every rank's [`kda_shards`] gathered in rank order (`gathered`
/// `[world, local]`) and the replicated MLA caches (`mla`, rank 0's). `whole` is the whole model's config.
pub fn join_state(
    gathered: &[f32],
    whole: &ModelConfig,
    world: usize,
    len: usize,
    mla: Vec<MlaCache<f32>>,
) -> SeqState {
    let layers = SeqState::<f32>::new(whole).kda.len();
    let local = gathered.len() / world;
    let layer = local.checked_div(layers).unwrap_or(0);
    let kda = (0..layers)
        .map(|l| {
            let per_rank: Vec<&[f32]> =
                (0..world).map(|r| &gathered[r * local + l * layer..r * local + (l + 1) * layer]).collect();
            join_kda(&per_rank, whole, world)
        })
        .collect();
    SeqState { len, kda, mla }
}

/// The values of a whole state as rank 0 broadcasts them for an import: every KDA layer's [`flatten_kda`], then
/// every MLA layer's entries in token order.
pub fn state_values(state: &SeqState<f32>) -> Vec<f32> {
    let mut values = kda_shards(state);
    for cache in &state.mla {
        for t in 0..cache.len() {
            values.extend_from_slice(cache.entry(t));
        }
    }
    values
}

/// How many [`state_values`] a whole state of `len` tokens of the model `whole` has.
pub fn state_values_len(whole: &ModelConfig, len: usize) -> usize {
    let fresh = SeqState::<f32>::new(whole);
    let kda: usize = fresh.kda.iter().map(|k| flatten_kda(k).len()).sum();
    kda + fresh.mla.len() * len * whole.mla.latent_dim()
}

/// `shard`'s part of the whole state of `len` tokens whose [`state_values`] are `values`: its KDA head shards and
/// the whole MLA caches.
pub fn shard_state(values: &[f32], whole: &ModelConfig, shard: &Shard, len: usize) -> Result<SeqState> {
    if values.len() != state_values_len(whole, len) {
        return Err(KernelError::InvalidInput(format!(
            "{} values for a state of {len} tokens ({} expected)",
            values.len(),
            state_values_len(whole, len)
        )));
    }
    let fresh = SeqState::<f32>::new(whole);
    let ld = whole.mla.latent_dim();
    let kda_len: usize = fresh.kda.iter().map(|k| flatten_kda(k).len()).sum();
    let (kda_values, mla_values) = values.split_at(kda_len);
    let mut at = 0;
    let mut kda = Vec::with_capacity(fresh.kda.len());
    for template in &fresh.kda {
        let s_len = template.s.len();
        let w = template.conv[0].len();
        let mut layer = template.clone();
        layer.s.copy_from_slice(&kda_values[at..at + s_len]);
        for (x, conv) in layer.conv.iter_mut().enumerate() {
            conv.copy_from_slice(&kda_values[at + s_len + x * w..at + s_len + (x + 1) * w]);
        }
        at += s_len + 3 * w;
        kda.push(split_kda(&layer, whole, shard));
    }
    let mla = (0..fresh.mla.len())
        .map(|l| {
            let mut cache = MlaCache::new(ld);
            for entry in mla_values[l * len * ld..(l + 1) * len * ld].chunks_exact(ld) {
                cache.push(entry);
            }
            cache
        })
        .collect();
    Ok(SeqState { len, kda, mla })
}
