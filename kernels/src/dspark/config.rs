//! The DSpark drafter's geometry ([`DrafterConfig`]): its tap layers, draft layers, block size γ and
//! Markov rank, the built-in analogues for each target preset, and the active-bytes budget.
//!
//! Invariants of a config that passed [`DrafterConfig::check_against`]:
//! - `hidden_size` and `vocab_size` equal the target's (the drafter reads the target's embedding and
//!   lm_head, and its context features are the target's hidden states);
//! - `target_layer_ids` are strictly ascending, 0-based target layer indices, and never the last layer;
//! - `mask_token_id` lies inside the vocabulary; every width is positive and at most [`MAX_DIM`], and there are at
//!   most [`MAX_DRAFT_LAYERS`] draft layers, so every tensor's byte size fits in `usize`; `qk_rope_head_dim` is
//!   even.
//!
//! Tap convention (shared/reference/dspark.md §1.1): DeepSpec's `target_layer_ids` are 0-based decoder
//! layer ids whose OUTPUT is tapped (`hidden_states[id + 1]`), and the last layer is never used. The
//! K3 drafter's "layers 2, 23, 47, 71, 89 of 93" follow that convention here: 0-based ids, the output
//! of layer l, which is what `cpu::Probe::tap_layers` records (the AttnRes read feeding layer l + 1).
//!
//! Draft layers: DeepSeek-V3-style RoPE MLA (no output gate; tokenspeed #905 says K3's drafter uses
//! RoPE MLA, not K3's NoPE gated MLA) plus a dense SiTU MLP, pre-norm residual. RoPE is required, not
//! a detail: the block's mask tokens are identical inputs under non-causal attention, so without
//! positions every mask position would produce the same hidden state.

use serde::{Deserialize, Serialize};

use crate::config::{MlaConfig, ModelConfig, MAX_DIM};
use crate::error::{KernelError, Result};
use crate::schema::model_tensors;

/// The drafter's `config.json` `model_type`.
pub const DRAFTER_MODEL_TYPE: &str = "sparkd_dspark";

/// Geometry of a DSpark drafter (DFlash backbone + Markov head + confidence head).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterConfig {
    /// Always [`DRAFTER_MODEL_TYPE`].
    pub model_type: String,
    /// Equal to the target's hidden size.
    pub hidden_size: usize,
    /// Equal to the target's vocabulary.
    pub vocab_size: usize,
    /// 0-based target layers whose output feeds the drafter, ascending (DeepSpec `target_layer_ids`).
    pub target_layer_ids: Vec<usize>,
    pub num_draft_layers: usize,
    /// γ: the block the drafter was built for (anchor + γ−1 mask tokens, γ predictions).
    pub block_size: usize,
    /// r of the Markov head `W1 [V, r]`, `W2 [r, V]`.
    pub markov_rank: usize,
    /// The token fed at the γ−1 positions after the anchor.
    pub mask_token_id: u32,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Width of each draft layer's dense SiTU MLP.
    pub intermediate_size: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f32,
    pub situ_beta: f32,
    pub situ_linear_beta: f32,
}

/// Most drafts one block may ask for.
pub const MAX_BLOCK: usize = 64;
/// Most draft layers (DSpark's drafters have one to five).
pub const MAX_DRAFT_LAYERS: usize = 64;

impl DrafterConfig {
    /// The drafter analogue of a built-in target preset (see the table in [`Self::for_target`]).
    pub fn preset(target_preset: &str) -> Result<Self> {
        let target = ModelConfig::preset(target_preset)?;
        Self::for_target(target_preset, &target)
    }

    /// The drafter of a preset target. K3: the published analogue (taps 2, 23, 47, 71, 89; 5 MLA
    /// layers; γ = 7; r = 256; K3's MLA widths with RoPE; MLP width 23296, chosen so the drafter has
    /// 3.56 B parameters like `Inferact/Kimi-K3-DSpark`, whose exact widths are not published). The
    /// scaled configs keep the drafter's share of the target's active bytes per token near K3's (the
    /// test `dspark_config::drafter_share_of_active_bytes` prints every share):
    ///
    /// | target | taps | layers | r | heads | MLP |
    /// |---|---|---|---|---|---|
    /// | k3-tiny (9 layers, d 128) | 0, 2, 4, 6, 7 | 1 | 6 | 2 | 256 |
    /// | k3-mini (8 layers, d 7168) | 1, 4, 6 | 1 | 128 | 32 | 5120 |
    /// | k3-mini-wide (4 layers, d 7168) | 1, 2 | 1 | 64 | 16 | 3072 |
    ///
    /// Taps spread over the depth like K3's (fractions 0.02, 0.25, 0.51, 0.77, 0.97 of the depth),
    /// fewer where the depth or the byte budget is small (the context projection alone is `m·d²`).
    pub fn for_target(name: &str, target: &ModelConfig) -> Result<Self> {
        let base = DrafterConfig {
            model_type: DRAFTER_MODEL_TYPE.to_string(),
            hidden_size: target.hidden_size,
            vocab_size: target.vocab_size,
            target_layer_ids: vec![2, 23, 47, 71, 89],
            num_draft_layers: 5,
            block_size: 7,
            markov_rank: 256,
            mask_token_id: (target.vocab_size - 2) as u32,
            num_attention_heads: 96,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            intermediate_size: 23_296,
            rope_theta: 10_000.0,
            rms_norm_eps: target.rms_norm_eps,
            situ_beta: target.situ_beta,
            situ_linear_beta: target.situ_linear_beta,
        };
        let cfg = match name {
            "k3" => base,
            "k3-tiny" => DrafterConfig {
                target_layer_ids: vec![0, 2, 4, 6, 7],
                num_draft_layers: 1,
                markov_rank: 6,
                num_attention_heads: 2,
                q_lora_rank: 32,
                kv_lora_rank: 32,
                qk_nope_head_dim: 16,
                qk_rope_head_dim: 16,
                v_head_dim: 16,
                intermediate_size: 256,
                ..base
            },
            "k3-mini" => DrafterConfig {
                target_layer_ids: vec![1, 4, 6],
                num_draft_layers: 1,
                markov_rank: 128,
                num_attention_heads: 32,
                intermediate_size: 5120,
                ..base
            },
            "k3-mini-wide" => DrafterConfig {
                target_layer_ids: vec![1, 2],
                num_draft_layers: 1,
                markov_rank: 64,
                num_attention_heads: 16,
                intermediate_size: 3072,
                ..base
            },
            other => {
                return Err(KernelError::config("--config", format!("no drafter analogue for preset `{other}`")));
            }
        };
        cfg.check_against(target)?;
        Ok(cfg)
    }

    /// The draft layers' attention geometry in the target's MLA terms (latent cache entries are
    /// `[c (kv_lora) | k_rot (rope)]`, K3's 576-wide layout for the K3 drafter).
    pub fn mla(&self) -> MlaConfig {
        MlaConfig {
            num_heads: self.num_attention_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
        }
    }

    /// m: the number of tapped target layers.
    pub fn num_taps(&self) -> usize {
        self.target_layer_ids.len()
    }

    /// Checks the config on its own and against the target it drafts for; errors name the field.
    pub fn check_against(&self, target: &ModelConfig) -> Result<()> {
        let field = |f: &str| format!("drafter.{f}");
        if self.model_type != DRAFTER_MODEL_TYPE {
            return Err(KernelError::config(
                field("model_type"),
                format!("`{}` is not supported (expected `{DRAFTER_MODEL_TYPE}`)", self.model_type),
            ));
        }
        if self.hidden_size != target.hidden_size {
            return Err(KernelError::config(
                field("hidden_size"),
                format!("{} differs from the target's {}", self.hidden_size, target.hidden_size),
            ));
        }
        if self.vocab_size != target.vocab_size {
            return Err(KernelError::config(
                field("vocab_size"),
                format!("{} differs from the target's {}", self.vocab_size, target.vocab_size),
            ));
        }
        let last = target.num_layers() - 1;
        if self.target_layer_ids.is_empty()
            || self.target_layer_ids.windows(2).any(|w| w[0] >= w[1])
            || self.target_layer_ids.iter().any(|l| *l >= last)
        {
            return Err(KernelError::config(
                field("target_layer_ids"),
                format!(
                    "{:?} must be non-empty, strictly ascending 0-based layers below the last layer {last}",
                    self.target_layer_ids
                ),
            ));
        }
        for (name, value) in [
            ("num_draft_layers", self.num_draft_layers),
            ("block_size", self.block_size),
            ("markov_rank", self.markov_rank),
            ("num_attention_heads", self.num_attention_heads),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("intermediate_size", self.intermediate_size),
        ] {
            if value == 0 {
                return Err(KernelError::config(field(name), "must be positive"));
            }
            if value > MAX_DIM {
                return Err(KernelError::config(
                    field(name),
                    format!("{value} is larger than sparkd supports ({MAX_DIM})"),
                ));
            }
        }
        if self.num_draft_layers > MAX_DRAFT_LAYERS {
            return Err(KernelError::config(field("num_draft_layers"), format!("at most {MAX_DRAFT_LAYERS}")));
        }
        if self.block_size > MAX_BLOCK {
            return Err(KernelError::config(field("block_size"), format!("at most {MAX_BLOCK}")));
        }
        if self.qk_rope_head_dim % 2 != 0 {
            return Err(KernelError::config(field("qk_rope_head_dim"), "must be even (RoPE rotates pairs)"));
        }
        if self.mask_token_id as usize >= self.vocab_size {
            return Err(KernelError::config(field("mask_token_id"), "outside the vocabulary"));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(KernelError::config(field("rope_theta"), "must be a finite number above 1"));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(KernelError::config(field("rms_norm_eps"), "must be a positive number"));
        }
        if !(self.situ_beta > 0.0 && self.situ_linear_beta > 0.0) {
            return Err(KernelError::config(field("situ_beta"), "SiTU betas must be positive"));
        }
        Ok(())
    }

    /// Parses a drafter `config.json` and checks it against the target.
    pub fn from_json(text: &str, target: &ModelConfig) -> Result<Self> {
        let cfg: DrafterConfig =
            serde_json::from_str(text).map_err(|e| KernelError::config("drafter/config.json", e.to_string()))?;
        cfg.check_against(target)?;
        Ok(cfg)
    }

    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| KernelError::InvalidInput(e.to_string()))
    }

    /// Parameters of the drafter's own tensors (the shared embedding and lm_head excluded), saturating at
    /// `u64::MAX` (each tensor's count fits, but the widths allowed can make their sum overflow).
    pub fn num_params(&self) -> u64 {
        super::schema::drafter_tensors(self)
            .iter()
            .map(|s| s.shape.canonical().iter().product::<usize>() as u64)
            .fold(0, u64::saturating_add)
    }

    /// Weight bytes the drafter reads per proposal: every tensor of its own except the Markov table
    /// `W1`, of which it reads one row per draft position (counted once, like the target's embedding);
    /// saturating at `u64::MAX`.
    pub fn active_bytes(&self) -> u64 {
        super::schema::drafter_tensors(self)
            .iter()
            .map(|s| {
                let bytes = s.canonical_bytes() as u64;
                if s.name == super::schema::MARKOV_W1 {
                    (self.markov_rank * s.dtype.size()) as u64
                } else {
                    bytes
                }
            })
            .fold(0, u64::saturating_add)
    }
}

/// Weight bytes the target reads per decoded token: every tensor except the embedding table (one
/// row) and the routed experts that are not chosen (top_k of num_experts per MoE layer).
pub fn target_active_bytes(cfg: &ModelConfig) -> u64 {
    let expert_share = cfg.moe.top_k as f64 / cfg.moe.num_experts as f64;
    model_tensors(cfg)
        .iter()
        .map(|s| {
            let bytes = s.canonical_bytes() as f64;
            if s.name == "model.embed_tokens.weight" {
                (cfg.hidden_size * s.dtype.size()) as f64
            } else if s.name.contains(".experts.") {
                bytes * expert_share
            } else {
                bytes
            }
        })
        .sum::<f64>()
        .round() as u64
}
