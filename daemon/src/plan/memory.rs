//! Per-rank bytes besides the weights: sequence state, the step workspace, CUDA graphs and the runtime; estimated
//! from what the CUDA backend allocates (`kernels/src/cuda/{state,step,forward,attn,graph}.rs`).
//!
//! Invariants:
//! - Every function is pure arithmetic on the config and the parallel layout; each is monotone in the batch and
//!   the context, which the searches of `plan` rely on.
//! - Sequence state (`cuda::state::DeviceState`): per KDA layer an fp32 `[H, dk, dk]` state and three bf16
//!   `[kernel - 1, P]` conv windows, sharded with the heads; per MLA layer a bf16 `[capacity, kv_lora + rope]`
//!   latent cache, replicated on every rank (576 values per token for K3; it cannot be split by heads). The
//!   cache grows by doubling (`cuda::state::reserve`), so a sequence of `L` tokens holds
//!   [`mla_capacity`]`(L)` entries, less than `2L`.
//! - A verify window of `T = ℓ + 1` tokens (`--num-spec-tokens ℓ`) keeps, per row, the KDA states after each of
//!   its tokens and the conv histories (`cuda::step`, `KdaUndo`): `T` more KDA states per running sequence.
//! - The step workspace is the largest layer's temporaries plus what lives through the whole forward (AttnRes's
//!   residual slots, the normalised input, the logits of the sampled positions), for a step of
//!   `--max-num-batched-tokens` tokens. Temporaries are stream-ordered allocations freed when their op family
//!   ends, so only one layer's are live at once. A step that mixes decode rows (split over their MLA cache in up
//!   to 64 splits, `cuda::step::mla_span`) with a prefill chunk gives every token of the step the decode rows'
//!   split count: at long contexts the MLA partials dominate.
//! - CUDA graphs (`cuda::graph`): captured decode and verify steps (windows of at most 16 tokens) allocate their
//!   temporaries inside the graph (memory nodes), from the graph pool, separate from the stream pool. Graphs
//!   replayed on one stream share that physical memory, so the plan counts one workspace of the largest
//!   captured step (every running row, its verify window).
//! - The runtime reserve (CUDA context, the kernel modules, cuBLAS, and with `tp > 1` NCCL's channel buffers)
//!   is a fixed estimate: [`RUNTIME_BYTES`], [`NCCL_BASE_BYTES`], [`NCCL_PEER_BYTES`].

use sparkd_kernels::config::{Ffn, Mixer, ModelConfig};
pub use sparkd_kernels::cuda::graph::GRAPH_MAX_WINDOW;
use sparkd_kernels::cuda::sample::{WIDE_CHUNK as SAMPLE_CHUNK, WIDE_PARTIAL_BYTES as SAMPLE_PARTIAL_BYTES};
use sparkd_kernels::cuda::state::MLA_MIN_CAPACITY;
use sparkd_kernels::cuda::step::{mla_grid_splits, mla_span, MLA_CHUNK_SPLIT_TOKENS};

/// The CUDA context, the compiled kernel modules and cuBLAS's workspace (an estimate; a context on a Hopper
/// GPU takes about 0.5 GiB before any allocation).
pub const RUNTIME_BYTES: u64 = 1 << 30;
/// NCCL's communicator when `tp > 1`: its channels' buffers (an estimate, NCCL's default 4 MiB buffers).
pub const NCCL_BASE_BYTES: u64 = 512 << 20;
/// NCCL's buffers per peer rank (all-to-all reaches every peer with expert parallelism).
pub const NCCL_PEER_BYTES: u64 = 32 << 20;

/// The parallel layout of one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub tp: usize,
    pub expert_parallel: bool,
}

/// What one step and the running sequences look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// Sequences running at once.
    pub batch: usize,
    /// Tokens of each sequence (prompt + output).
    pub context: usize,
    /// Tokens one step computes (`--max-num-batched-tokens`).
    pub step_tokens: usize,
    /// Draft tokens verified per row (`--num-spec-tokens`; 0: no speculation).
    pub spec_tokens: usize,
}

/// One sequence's state on a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SeqBytes {
    /// KDA recurrent states, fp32, this rank's heads.
    pub kda_state: u64,
    /// KDA conv windows, bf16, this rank's channels.
    pub kda_conv: u64,
    /// MLA latent cache per token, every MLA layer (replicated).
    pub mla_per_token: u64,
    /// A verify window's KDA snapshots and conv histories, per running sequence.
    pub verify_undo: u64,
}

impl SeqBytes {
    /// A sequence of `context` tokens, prefilled in chunks of `chunk`.
    pub fn at(&self, context: usize, chunk: usize) -> u64 {
        self.kda_state + self.kda_conv + self.verify_undo + self.mla_per_token * mla_capacity(context, chunk) as u64
    }
}

/// Entries an MLA cache holds for `tokens` tokens appended in chunks of at most `chunk`: it starts at the first
/// chunk (at least [`MLA_MIN_CAPACITY`]) and doubles (`cuda::state::reserve`).
pub fn mla_capacity(tokens: usize, chunk: usize) -> usize {
    let mut capacity = tokens.min(chunk.max(1)).max(MLA_MIN_CAPACITY);
    while capacity < tokens {
        capacity = capacity.saturating_mul(2);
    }
    capacity
}

/// The state of one sequence on one rank.
pub fn seq_bytes(cfg: &ModelConfig, layout: Layout, spec_tokens: usize) -> SeqBytes {
    let k = &cfg.kda;
    let kda_layers = cfg.kda_layers().len() as u64;
    let heads = (k.num_heads / layout.tp) as u64;
    let channels = (k.proj_dim() / layout.tp) as u64;
    let state = heads * (k.head_dim * k.head_dim) as u64 * 4;
    let window = (k.conv_kernel - 1) as u64;
    let verify_undo = if spec_tokens == 0 {
        0
    } else {
        let t = spec_tokens as u64 + 1;
        kda_layers * (t * state + 3 * (window + t) * channels * 2)
    };
    SeqBytes {
        kda_state: kda_layers * state,
        kda_conv: kda_layers * 3 * window * channels * 2,
        mla_per_token: (cfg.mla_layers().len() * cfg.mla.latent_dim() * 2) as u64,
        verify_undo,
    }
}

/// The MLA split grid of a step whose decode rows see `context` tokens (`cuda::step::mla_span`, `mla_grid_splits`).
pub fn mla_splits(context: usize) -> usize {
    let span = mla_span(context.saturating_sub(1), 1, MLA_CHUNK_SPLIT_TOKENS);
    mla_grid_splits(context.div_ceil(span).max(1))
}

/// Peak bytes of one forward of `tokens` tokens, `logit_rows` of which are sampled, with decode rows at
/// `context` (module invariants).
pub fn forward_bytes(cfg: &ModelConfig, layout: Layout, tokens: usize, logit_rows: usize, context: usize) -> u64 {
    let n = tokens as u64;
    let tp = layout.tp as u64;
    let d = cfg.hidden_size as u64;
    let k = &cfg.kda;
    let (h, hd, p) = (k.num_heads as u64 / tp, k.head_dim as u64, k.proj_dim() as u64 / tp);
    let m = &cfg.mla;
    let mh = m.num_heads as u64 / tp;
    let (ql, r, latent) = (m.q_lora_rank as u64, m.kv_lora_rank as u64, m.latent_dim() as u64);
    let (qhd, vd) = (m.q_head_dim() as u64, m.v_head_dim as u64);
    let moe = &cfg.moe;
    let (e, top_k, lat) = (moe.num_experts as u64, moe.top_k as u64, moe.latent_dim as u64);
    let inner = if layout.expert_parallel { moe.expert_dim as u64 } else { moe.expert_dim as u64 / tp };
    let shared = moe.shared_dim() as u64 / tp;
    let dense = cfg.dense_intermediate as u64 / tp;
    let splits = mla_splits(context) as u64;
    let bf = 2;

    let seals = cfg.layers.iter().enumerate().filter(|(l, _)| cfg.seals_before(*l)).count() as u64;
    let lasting = (1 + seals) * n * d * bf + n * d * bf;
    let kda = n * (4 * p + hd + h) * bf + n * p * bf + n * d * bf;
    let mla = n * (ql + latent + mh * vd) * bf
        + n * ql * bf
        + n * mh * qhd * bf
        + n * mh * r * 4
        + n * mh * splits * (r + 2) * 4
        + n * mh * vd * bf
        + n * d * bf;
    let routed = n * lat * bf + n * e * 4 + n * top_k * 12 + n * 4 + n * top_k * (inner + lat) * bf + n * lat * bf;
    let moe_bytes = routed + n * d * bf + n * 3 * shared * bf + n * d * bf;
    let dense_bytes = n * 3 * dense * bf + n * d * bf;
    let mut layer = 0;
    for kind in &cfg.layers {
        let mixer = match kind.mixer {
            Mixer::Kda => kda,
            Mixer::Mla => mla,
        };
        let ffn = match kind.ffn {
            Ffn::Dense => dense_bytes,
            Ffn::Moe => moe_bytes,
        };
        layer = layer.max(mixer).max(ffn);
    }
    let v = cfg.vocab_size as u64;
    let rows = logit_rows as u64;
    let local_logits = if tp > 1 { rows * v / tp * bf } else { 0 };
    let logits = rows * v * bf + local_logits + rows * v.div_ceil(SAMPLE_CHUNK as u64) * SAMPLE_PARTIAL_BYTES as u64;
    lasting + layer + logits
}

/// The step workspace: a step of `--max-num-batched-tokens` tokens, logits for every running row's window.
pub fn workspace_bytes(cfg: &ModelConfig, layout: Layout, load: Load) -> u64 {
    let rows = (load.batch * (load.spec_tokens + 1)).min(load.step_tokens);
    forward_bytes(cfg, layout, load.step_tokens, rows, load.context)
}

/// The graph pool: the largest captured step (every running row with its verify window, capped at
/// [`GRAPH_MAX_WINDOW`] tokens a row).
pub fn graph_bytes(cfg: &ModelConfig, layout: Layout, load: Load) -> u64 {
    let window = (load.spec_tokens + 1).min(GRAPH_MAX_WINDOW);
    let tokens = load.batch * window;
    forward_bytes(cfg, layout, tokens, tokens, load.context)
}

/// The runtime reserve of one rank (module invariants).
pub fn runtime_bytes(layout: Layout) -> u64 {
    if layout.tp > 1 {
        RUNTIME_BYTES + NCCL_BASE_BYTES + NCCL_PEER_BYTES * (layout.tp as u64 - 1)
    } else {
        RUNTIME_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k3() -> ModelConfig {
        ModelConfig::preset("k3").unwrap()
    }

    const ONE: Layout = Layout { tp: 1, expert_parallel: false };

    #[test]
    fn k3_sequence_state_matches_the_reference() {
        // §2.10: 69 KDA layers × [96, 128, 128] fp32 = 414 MiB; conv 69 × 3 × [3, 12288] bf16; MLA 24 × 576 bf16
        // per token = 27 KiB.
        let s = seq_bytes(&k3(), ONE, 0);
        assert_eq!(s.kda_state, 414 << 20);
        assert_eq!(s.kda_conv, 69 * 3 * 3 * 12288 * 2);
        assert_eq!(s.mla_per_token, 27 << 10);
        assert_eq!(s.verify_undo, 0);
        // Sharded by heads over 16 ranks; the latent cache is replicated.
        let tp16 = seq_bytes(&k3(), Layout { tp: 16, expert_parallel: true }, 0);
        assert_eq!(tp16.kda_state * 16, s.kda_state);
        assert_eq!(tp16.kda_conv * 16, s.kda_conv);
        assert_eq!(tp16.mla_per_token, s.mla_per_token);
        // A verify window of 8 tokens keeps 8 more states.
        let spec = seq_bytes(&k3(), ONE, 7);
        assert_eq!(spec.verify_undo, 69 * (8 * (6 << 20) + 3 * (3 + 8) * 12288 * 2));
    }

    #[test]
    fn mla_capacity_doubles_from_the_first_chunk() {
        assert_eq!(mla_capacity(1, 2048), 64);
        assert_eq!(mla_capacity(2048, 2048), 2048);
        assert_eq!(mla_capacity(2049, 2048), 4096);
        assert_eq!(mla_capacity(131_072, 2048), 131_072);
        assert_eq!(mla_capacity(100_000, 2048), 131_072);
        assert_eq!(mla_capacity(1000, 2048), 1000);
        for tokens in [1, 63, 64, 65, 3000, 1 << 20] {
            let c = mla_capacity(tokens, 2048);
            assert!(c >= tokens && c < 2 * tokens.max(64), "{tokens}: {c}");
        }
    }

    #[test]
    fn mla_splits_follow_the_backend() {
        assert_eq!(mla_splits(1), 1);
        assert_eq!(mla_splits(256), 1);
        assert_eq!(mla_splits(257), 2);
        assert_eq!(mla_splits(4096), 16);
        assert_eq!(mla_splits(16_384), 64);
        assert_eq!(mla_splits(1 << 20), 64);
    }

    #[test]
    fn workspace_grows_with_the_step_and_the_context_and_shrinks_with_tp() {
        let cfg = k3();
        let load = Load { batch: 64, context: 4096, step_tokens: 2048, spec_tokens: 0 };
        let w = workspace_bytes(&cfg, ONE, load);
        assert!(w < workspace_bytes(&cfg, ONE, Load { step_tokens: 4096, ..load }));
        assert!(w < workspace_bytes(&cfg, ONE, Load { context: 131_072, ..load }));
        assert!(workspace_bytes(&cfg, Layout { tp: 16, expert_parallel: false }, load) < w);
        // The MLA partials of a mixed step at 128k: 2048 tokens × 96 heads × 64 splits × 514 × 4 bytes.
        let long = workspace_bytes(&cfg, ONE, Load { context: 131_072, ..load });
        assert!(long > 2048 * 96 * 64 * 514 * 4, "{long}");
        assert!(graph_bytes(&cfg, ONE, load) < graph_bytes(&cfg, ONE, Load { spec_tokens: 7, ..load }));
    }

    #[test]
    fn nccl_is_reserved_only_across_ranks() {
        assert_eq!(runtime_bytes(ONE), RUNTIME_BYTES);
        let tp16 = runtime_bytes(Layout { tp: 16, expert_parallel: true });
        assert_eq!(tp16, RUNTIME_BYTES + NCCL_BASE_BYTES + 15 * NCCL_PEER_BYTES);
    }
}
