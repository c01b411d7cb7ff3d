//! K3 model configuration: parsing the real `config.json` and the built-in scaled presets.
//!
//! Invariants of a parsed [`ModelConfig`]:
//! - `layers` has exactly `num_hidden_layers` entries; each layer is KDA or MLA (from the 1-based
//!   `linear_attn_config` lists, which must partition `1..=num_hidden_layers`) and dense or MoE
//!   (`first_k_dense_replace`).
//! - Every value the math does not support (a SiLU model, no q-LoRA, grouped top-k with several
//!   groups, ...) was rejected with a [`KernelError::Config`] naming the field.
//! - The MoE latent width and expert width are multiples of the MXFP4 group (32) when the
//!   experts are quantized.
//! - Every dimension (widths, head counts and sizes, ranks, the vocabulary, expert counts, the layer
//!   count) is at most [`MAX_DIM`], so every tensor's element count is below 2^62 and its byte size
//!   fits in `usize`; a larger one is refused naming the field, never an overflow later.
//!
//! Source of the schema: shared/reference/k3-architecture.md §1 (the published K3 `config.json`).

use serde_json::{json, Map, Value};

use crate::error::{KernelError, Result};

/// Which token mixer a layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Mixer {
    /// Kimi Delta Attention (linear attention with a recurrent state).
    Kda,
    /// Gated NoPE multi-head latent attention over a latent cache.
    Mla,
}

/// Which feed-forward block a layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Ffn {
    /// The dense SiTU MLP (layer 0 of K3).
    Dense,
    /// The latent MoE with routed MXFP4 experts and a shared expert.
    Moe,
}

/// One decoder layer's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LayerKind {
    pub mixer: Mixer,
    pub ffn: Ffn,
}

/// KDA geometry (`linear_attn_config`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KdaConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    /// The lower bound of the log-decay gate: `g = lb * sigmoid(exp(A_log) * (f + dt_bias))`.
    pub gate_lower_bound: f32,
}

impl KdaConfig {
    /// `num_heads * head_dim`: the width of q, k, v and the output gate.
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

/// MLA geometry.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MlaConfig {
    pub num_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl MlaConfig {
    /// Width of one cached latent entry: `kv_lora_rank + qk_rope_head_dim` (576 for K3).
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
    /// Width of one query head: nope + rope (192 for K3).
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How the routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ExpertFormat {
    /// `weight_packed` (U8, two E2M1 codes per byte, low nibble first) + `weight_scale` (U8 E8M0).
    Mxfp4 { group_size: usize },
    /// Plain BF16 `weight` tensors.
    Bf16,
}

/// Latent MoE geometry and routing rule.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    /// Width of one routed expert (`moe_intermediate_size`).
    pub expert_dim: usize,
    /// Latent width the routed experts run at (`routed_expert_hidden_size`).
    pub latent_dim: usize,
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
    pub expert_format: ExpertFormat,
}

impl MoeConfig {
    /// Width of the fused shared-expert MLP.
    pub fn shared_dim(&self) -> usize {
        self.num_shared_experts * self.expert_dim
    }
}

/// The K3 text model configuration.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: Vec<LayerKind>,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    pub moe: MoeConfig,
    /// Width of the dense SiTU MLP.
    pub dense_intermediate: usize,
    pub attn_res_block_size: usize,
    pub situ_beta: f32,
    pub situ_linear_beta: f32,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
}

/// The eps KimiRMSNorm uses when the config eps is not passed (MLA q_a/kv_a norms).
pub const MLA_NORM_EPS: f32 = 1e-6;
/// The eps of the KDA q/k L2 normalisation (fla kernel).
pub const L2_NORM_EPS: f32 = 1e-6;

/// The largest dimension a config may give (2^20; K3's largest is its 163,840-token vocabulary). The products the
/// schema forms are at most three dimensions (`heads · (nope + rope) · q_lora`), below 2^62 elements.
pub const MAX_DIM: usize = 1 << 20;

/// The named configs sparkd knows without a checkpoint.
pub const PRESET_NAMES: [&str; 4] = ["k3-tiny", "k3-mini", "k3-mini-wide", "k3"];

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// True when AttnRes seals a block before layer `layer` (`layer % block_size == 0`).
    pub fn seals_before(&self, layer: usize) -> bool {
        layer % self.attn_res_block_size == 0
    }

    /// Indices of the KDA layers, in order.
    pub fn kda_layers(&self) -> Vec<usize> {
        self.layer_indices(Mixer::Kda)
    }

    /// Indices of the MLA layers, in order.
    pub fn mla_layers(&self) -> Vec<usize> {
        self.layer_indices(Mixer::Mla)
    }

    fn layer_indices(&self, mixer: Mixer) -> Vec<usize> {
        self.layers.iter().enumerate().filter(|(_, k)| k.mixer == mixer).map(|(i, _)| i).collect()
    }

    /// Reads a `config.json` file.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| KernelError::CheckpointFile { path: path.to_path_buf(), reason: e.to_string() })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| KernelError::CheckpointFile {
            path: path.to_path_buf(),
            reason: format!("invalid JSON: {e}"),
        })?;
        Self::from_json(&value)
    }

    /// Parses either a `kimi_k3` wrapper (with `text_config`) or a bare `kimi_linear` config.
    pub fn from_json(root: &Value) -> Result<Self> {
        let obj = root.as_object().ok_or_else(|| KernelError::config("<root>", "not a JSON object"))?;
        let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
        let (text, prefix) = match model_type {
            "kimi_k3" => {
                let text = obj
                    .get("text_config")
                    .and_then(Value::as_object)
                    .ok_or_else(|| KernelError::config("text_config", "missing or not an object"))?;
                (text, "text_config.")
            }
            "kimi_linear" => (obj, ""),
            other => {
                return Err(KernelError::config(
                    "model_type",
                    format!("`{other}` is not supported (expected `kimi_k3` or `kimi_linear`)"),
                ))
            }
        };
        if !prefix.is_empty() {
            let inner = text.get("model_type").and_then(Value::as_str).unwrap_or("kimi_linear");
            if inner != "kimi_linear" {
                return Err(KernelError::config(
                    "text_config.model_type",
                    format!("`{inner}` is not supported (expected `kimi_linear`)"),
                ));
            }
        }
        Fields { obj: text, prefix }.parse(obj)
    }

    /// The `config.json` of this model in the real K3 layout (a `kimi_k3` wrapper).
    pub fn to_json(&self) -> Value {
        let kda_1based: Vec<usize> = self.kda_layers().iter().map(|l| l + 1).collect();
        let mla_1based: Vec<usize> = self.mla_layers().iter().map(|l| l + 1).collect();
        let first_dense = self.layers.iter().take_while(|k| k.ffn == Ffn::Dense).count();
        let mut text = json!({
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "dtype": "bfloat16",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers(),
            "num_attention_heads": self.mla.num_heads,
            "num_key_value_heads": self.mla.num_heads,
            "q_lora_rank": self.mla.q_lora_rank,
            "kv_lora_rank": self.mla.kv_lora_rank,
            "qk_nope_head_dim": self.mla.qk_nope_head_dim,
            "qk_rope_head_dim": self.mla.qk_rope_head_dim,
            "v_head_dim": self.mla.v_head_dim,
            "mla_use_nope": true,
            "mla_use_output_gate": true,
            "linear_attn_config": {
                "num_heads": self.kda.num_heads,
                "head_dim": self.kda.head_dim,
                "short_conv_kernel_size": self.kda.conv_kernel,
                "gate_lower_bound": self.kda.gate_lower_bound,
                "use_full_rank_gate": true,
                "full_attn_layers": mla_1based,
                "kda_layers": kda_1based,
            },
            "attn_res_block_size": self.attn_res_block_size,
            "intermediate_size": self.dense_intermediate,
            "first_k_dense_replace": first_dense,
            "moe_layer_freq": 1,
            "num_experts": self.moe.num_experts,
            "num_experts_per_token": self.moe.top_k,
            "num_shared_experts": self.moe.num_shared_experts,
            "moe_intermediate_size": self.moe.expert_dim,
            "routed_expert_hidden_size": self.moe.latent_dim,
            "latent_moe_use_norm": true,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe.renormalize,
            "routed_scaling_factor": self.moe.routed_scaling_factor,
            "topk_method": "noaux_tc",
            "use_grouped_topk": true,
            "num_expert_group": 1,
            "topk_group": 1,
            "hidden_act": "situ",
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": false,
            "use_cache": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        });
        if let ExpertFormat::Mxfp4 { group_size } = self.moe.expert_format {
            text["quantization_config"] = json!({
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["Linear"],
                    "input_activations": null,
                    "output_activations": null,
                    "weights": {"num_bits": 4, "type": "float", "group_size": group_size,
                                "strategy": "group", "symmetric": true, "dynamic": false,
                                "scale_dtype": "torch.uint8", "zp_dtype": null, "observer": "minmax",
                                "observer_kwargs": {}, "actorder": null, "block_structure": null}
                }},
                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                           "re:.*vision_tower.*", "re:.*mm_projector.*"],
                "kv_cache_scheme": null,
                "global_compression_ratio": null
            });
        }
        json!({
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "media_placeholder_token_id": 163605,
            "tie_word_embeddings": false,
            "text_config": text,
        })
    }

    /// A built-in config by name (see [`PRESET_NAMES`]).
    pub fn preset(name: &str) -> Result<Self> {
        let base = Self::k3();
        let cfg = match name {
            "k3" => base,
            "k3-tiny" => ModelConfig {
                hidden_size: 128,
                layers: schedule(9, &[1, 2, 3, 5, 6, 7], 1),
                kda: KdaConfig { num_heads: 4, head_dim: 32, conv_kernel: 4, gate_lower_bound: -5.0 },
                mla: MlaConfig {
                    num_heads: 4,
                    q_lora_rank: 64,
                    kv_lora_rank: 32,
                    qk_nope_head_dim: 32,
                    qk_rope_head_dim: 16,
                    v_head_dim: 32,
                },
                moe: MoeConfig {
                    num_experts: 16,
                    top_k: 4,
                    num_shared_experts: 2,
                    expert_dim: 64,
                    latent_dim: 64,
                    ..base.moe.clone()
                },
                dense_intermediate: 512,
                attn_res_block_size: 4,
                ..base
            },
            "k3-mini" => ModelConfig {
                layers: schedule(8, &[1, 2, 3, 5, 6, 7], 1),
                moe: MoeConfig { num_experts: 64, ..base.moe.clone() },
                attn_res_block_size: 2,
                ..base
            },
            "k3-mini-wide" => ModelConfig { layers: schedule(4, &[1, 2, 3], 1), attn_res_block_size: 2, ..base },
            other => {
                return Err(KernelError::config(
                    "--config",
                    format!("unknown preset `{other}` (known: {})", PRESET_NAMES.join(", ")),
                ))
            }
        };
        Ok(cfg)
    }

    /// The real Kimi K3 text model.
    fn k3() -> Self {
        let kda_1based: Vec<usize> = (1..=93).filter(|l| l % 4 != 0 && *l != 93).collect();
        ModelConfig {
            vocab_size: 163_840,
            hidden_size: 7168,
            layers: schedule(93, &kda_1based, 1),
            kda: KdaConfig { num_heads: 96, head_dim: 128, conv_kernel: 4, gate_lower_bound: -5.0 },
            mla: MlaConfig {
                num_heads: 96,
                q_lora_rank: 1536,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            },
            moe: MoeConfig {
                num_experts: 896,
                top_k: 16,
                num_shared_experts: 2,
                expert_dim: 3072,
                latent_dim: 3584,
                renormalize: true,
                routed_scaling_factor: 1.0,
                expert_format: ExpertFormat::Mxfp4 { group_size: 32 },
            },
            dense_intermediate: 33_792,
            attn_res_block_size: 12,
            situ_beta: 4.0,
            situ_linear_beta: 25.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 1_048_576,
            bos_token_id: 163_584,
            eos_token_id: 163_586,
            pad_token_id: 163_839,
        }
    }
}

/// Builds the layer list from 1-based KDA layer numbers; the rest are MLA. The first
/// `first_dense` layers are dense, the rest MoE.
fn schedule(num_layers: usize, kda_1based: &[usize], first_dense: usize) -> Vec<LayerKind> {
    (0..num_layers)
        .map(|l| LayerKind {
            mixer: if kda_1based.contains(&(l + 1)) { Mixer::Kda } else { Mixer::Mla },
            ffn: if l < first_dense { Ffn::Dense } else { Ffn::Moe },
        })
        .collect()
}

/// Typed field access on a config object; every error names the full field path.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn path(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }

    fn get(&self, key: &str) -> Result<&Value> {
        self.obj.get(key).ok_or_else(|| KernelError::config(self.path(key), "missing"))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        v.as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| KernelError::config(self.path(key), format!("expected a non-negative integer, found {v}")))
    }

    fn positive(&self, key: &str) -> Result<usize> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(KernelError::config(self.path(key), "must be positive"));
        }
        Ok(n)
    }

    /// A tensor dimension or count: at most [`MAX_DIM`].
    fn at_most_max_dim(&self, key: &str, n: usize) -> Result<usize> {
        if n > MAX_DIM {
            return Err(KernelError::config(self.path(key), format!("{n} is larger than sparkd supports ({MAX_DIM})")));
        }
        Ok(n)
    }

    /// A positive dimension, at most [`MAX_DIM`].
    fn dim(&self, key: &str) -> Result<usize> {
        let n = self.positive(key)?;
        self.at_most_max_dim(key, n)
    }

    fn f32(&self, key: &str) -> Result<f32> {
        let v = self.get(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .filter(|x| x.is_finite())
            .ok_or_else(|| KernelError::config(self.path(key), format!("expected a finite number, found {v}")))
    }

    fn bool(&self, key: &str) -> Result<bool> {
        let v = self.get(key)?;
        v.as_bool().ok_or_else(|| KernelError::config(self.path(key), format!("expected a boolean, found {v}")))
    }

    fn str(&self, key: &str) -> Result<&str> {
        let v = self.get(key)?;
        v.as_str().ok_or_else(|| KernelError::config(self.path(key), format!("expected a string, found {v}")))
    }

    fn require_bool(&self, key: &str, want: bool, why: &str) -> Result<()> {
        if self.bool(key)? != want {
            return Err(KernelError::config(self.path(key), format!("must be {want}: {why}")));
        }
        Ok(())
    }

    fn require_str(&self, key: &str, want: &str) -> Result<()> {
        let found = self.str(key)?;
        if found != want {
            return Err(KernelError::config(self.path(key), format!("`{found}` is not supported (expected `{want}`)")));
        }
        Ok(())
    }

    fn require_usize(&self, key: &str, want: usize, why: &str) -> Result<()> {
        let found = self.usize(key)?;
        if found != want {
            return Err(KernelError::config(
                self.path(key),
                format!("{found} is not supported (expected {want}: {why})"),
            ));
        }
        Ok(())
    }

    fn object(&self, key: &str) -> Result<&Map<String, Value>> {
        self.get(key)?.as_object().ok_or_else(|| KernelError::config(self.path(key), "expected an object"))
    }

    fn layer_list(&self, lin: &Map<String, Value>, key: &str, num_layers: usize) -> Result<Vec<usize>> {
        let field = format!("{}linear_attn_config.{key}", self.prefix);
        let arr = lin
            .get(key)
            .ok_or_else(|| KernelError::config(&field, "missing"))?
            .as_array()
            .ok_or_else(|| KernelError::config(&field, "expected an array of 1-based layer numbers"))?;
        arr.iter()
            .map(|v| match v.as_u64() {
                Some(n) if n >= 1 && (n as usize) <= num_layers => Ok(n as usize),
                _ => Err(KernelError::config(&field, format!("{v} is not a layer number in 1..={num_layers}"))),
            })
            .collect()
    }

    fn parse(&self, root: &Map<String, Value>) -> Result<ModelConfig> {
        let num_layers = self.dim("num_hidden_layers")?;
        let hidden_size = self.dim("hidden_size")?;

        // Layer schedule from the 1-based lists; they must partition 1..=num_layers.
        let lin = self.object("linear_attn_config")?;
        let lin_field = |k: &str| format!("{}linear_attn_config.{k}", self.prefix);
        let kda_list = self.layer_list(lin, "kda_layers", num_layers)?;
        let mla_list = self.layer_list(lin, "full_attn_layers", num_layers)?;
        for l in 1..=num_layers {
            match (kda_list.contains(&l), mla_list.contains(&l)) {
                (true, true) => {
                    return Err(KernelError::config(
                        lin_field("kda_layers"),
                        format!("layer {l} is also in full_attn_layers"),
                    ))
                }
                (false, false) => {
                    return Err(KernelError::config(
                        lin_field("kda_layers"),
                        format!("layer {l} is in neither kda_layers nor full_attn_layers"),
                    ))
                }
                _ => {}
            }
        }
        let lin_usize = |k: &str| -> Result<usize> {
            lin.get(k)
                .and_then(Value::as_u64)
                .filter(|n| (1..=MAX_DIM as u64).contains(n))
                .map(|n| n as usize)
                .ok_or_else(|| KernelError::config(lin_field(k), format!("missing or not an integer in 1..={MAX_DIM}")))
        };
        // Checked as the f32 it is stored in: a finite f64 can round to an infinite or zero f32.
        let gate_lower_bound =
            lin.get("gate_lower_bound").and_then(Value::as_f64).map(|x| x as f32).filter(|x| x.is_finite() && *x < 0.0);
        let gate_lower_bound = gate_lower_bound.ok_or_else(|| {
            KernelError::config(
                lin_field("gate_lower_bound"),
                "missing or not a negative number (the softplus gate of Kimi-Linear is not supported)",
            )
        })?;
        if lin.get("use_full_rank_gate").and_then(Value::as_bool) != Some(true) {
            return Err(KernelError::config(
                lin_field("use_full_rank_gate"),
                "must be true (the low-rank g_a/g_b output gate is not supported)",
            ));
        }
        let kda = KdaConfig {
            num_heads: lin_usize("num_heads")?,
            head_dim: lin_usize("head_dim")?,
            conv_kernel: lin_usize("short_conv_kernel_size")?,
            gate_lower_bound,
        };

        let heads = self.dim("num_attention_heads")?;
        self.require_usize("num_key_value_heads", heads, "MLA has as many kv heads as query heads")?;
        let q_lora_rank = match self.get("q_lora_rank")? {
            Value::Null => {
                return Err(KernelError::config(self.path("q_lora_rank"), "null (a direct q_proj) is not supported"))
            }
            _ => self.dim("q_lora_rank")?,
        };
        self.require_bool("mla_use_nope", true, "K3's MLA has no rotary embedding")?;
        self.require_bool("mla_use_output_gate", true, "K3's MLA is gated")?;
        let mla = MlaConfig {
            num_heads: heads,
            q_lora_rank,
            kv_lora_rank: self.dim("kv_lora_rank")?,
            qk_nope_head_dim: self.dim("qk_nope_head_dim")?,
            qk_rope_head_dim: self.dim("qk_rope_head_dim")?,
            v_head_dim: self.dim("v_head_dim")?,
        };
        if mla.v_head_dim != mla.qk_nope_head_dim {
            return Err(KernelError::config(self.path("v_head_dim"), "must equal qk_nope_head_dim"));
        }

        let first_dense = self.usize("first_k_dense_replace")?;
        if first_dense > num_layers {
            return Err(KernelError::config(self.path("first_k_dense_replace"), "larger than num_hidden_layers"));
        }
        self.require_usize("moe_layer_freq", 1, "every layer after the dense ones is MoE")?;
        self.require_str("moe_router_activation_func", "sigmoid")?;
        self.require_str("topk_method", "noaux_tc")?;
        self.require_usize("num_expert_group", 1, "group-limited routing is not supported")?;
        self.require_usize("topk_group", 1, "group-limited routing is not supported")?;
        self.require_bool("latent_moe_use_norm", true, "K3's latent MoE normalises the combined output")?;
        self.require_str("hidden_act", "situ")?;
        if self.obj.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false) {
            return Err(KernelError::config(
                self.path("tie_word_embeddings"),
                "must be false (K3 has its own lm_head)",
            ));
        }

        let expert_format = self.expert_format()?;
        let num_experts = self.dim("num_experts")?;
        let top_k = self.dim("num_experts_per_token")?;
        if top_k > num_experts {
            return Err(KernelError::config(self.path("num_experts_per_token"), "larger than num_experts"));
        }
        let moe = MoeConfig {
            num_experts,
            top_k,
            num_shared_experts: self.at_most_max_dim("num_shared_experts", self.usize("num_shared_experts")?)?,
            expert_dim: self.dim("moe_intermediate_size")?,
            latent_dim: self.dim("routed_expert_hidden_size")?,
            renormalize: self.bool("moe_renormalize")?,
            routed_scaling_factor: self.f32("routed_scaling_factor")?,
            expert_format,
        };
        if let ExpertFormat::Mxfp4 { group_size } = expert_format {
            for (key, width) in
                [("moe_intermediate_size", moe.expert_dim), ("routed_expert_hidden_size", moe.latent_dim)]
            {
                if width % group_size != 0 {
                    return Err(KernelError::config(
                        self.path(key),
                        format!("{width} is not a multiple of the MXFP4 group size {group_size}"),
                    ));
                }
            }
        }

        let attn_res_block_size = self.dim("attn_res_block_size")?;
        let token_id = |key: &str| -> Result<u32> {
            let v = self.obj.get(key).or_else(|| root.get(key));
            match v.and_then(Value::as_u64) {
                Some(n) if n < u32::MAX as u64 => Ok(n as u32),
                _ => Err(KernelError::config(self.path(key), "missing or not a token id")),
            }
        };
        let vocab_size = self.dim("vocab_size")?;
        let cfg = ModelConfig {
            vocab_size,
            hidden_size,
            layers: schedule(num_layers, &kda_list, first_dense),
            kda,
            mla,
            moe,
            dense_intermediate: self.dim("intermediate_size")?,
            attn_res_block_size,
            situ_beta: self.f32("activation_situ_beta")?,
            situ_linear_beta: self.f32("activation_situ_linear_beta")?,
            rms_norm_eps: self.f32("rms_norm_eps")?,
            max_position_embeddings: self.positive("max_position_embeddings")?,
            bos_token_id: token_id("bos_token_id")?,
            eos_token_id: token_id("eos_token_id")?,
            pad_token_id: token_id("pad_token_id")?,
        };
        for (key, id) in [("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)] {
            if id as usize >= vocab_size {
                return Err(KernelError::config(self.path(key), format!("{id} is outside vocab_size {vocab_size}")));
            }
        }
        Ok(cfg)
    }

    fn expert_format(&self) -> Result<ExpertFormat> {
        let Some(q) = self.obj.get("quantization_config") else { return Ok(ExpertFormat::Bf16) };
        let field = |k: &str| format!("{}quantization_config.{k}", self.prefix);
        let q = q.as_object().ok_or_else(|| KernelError::config(field(""), "expected an object"))?;
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if method != "compressed-tensors" {
            return Err(KernelError::config(field("quant_method"), format!("`{method}` is not supported")));
        }
        let format = q.get("format").and_then(Value::as_str).unwrap_or("");
        if format != "mxfp4-pack-quantized" {
            return Err(KernelError::config(field("format"), format!("`{format}` is not supported")));
        }
        let groups = q
            .get("config_groups")
            .and_then(Value::as_object)
            .ok_or_else(|| KernelError::config(field("config_groups"), "missing"))?;
        let mut group_size = None;
        for (name, group) in groups {
            let w = group
                .get("weights")
                .and_then(Value::as_object)
                .ok_or_else(|| KernelError::config(field(&format!("config_groups.{name}.weights")), "missing"))?;
            let wf = |k: &str| field(&format!("config_groups.{name}.weights.{k}"));
            if w.get("num_bits").and_then(Value::as_u64) != Some(4) {
                return Err(KernelError::config(wf("num_bits"), "only 4-bit (MXFP4) weights are supported"));
            }
            if w.get("type").and_then(Value::as_str) != Some("float") {
                return Err(KernelError::config(wf("type"), "only `float` (E2M1) weights are supported"));
            }
            match w.get("group_size").and_then(Value::as_u64) {
                Some(32) => group_size = Some(32),
                other => {
                    return Err(KernelError::config(
                        wf("group_size"),
                        format!("{other:?} is not supported (MXFP4 groups are 32)"),
                    ))
                }
            }
        }
        let group_size = group_size.ok_or_else(|| KernelError::config(field("config_groups"), "empty"))?;
        Ok(ExpertFormat::Mxfp4 { group_size })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k3_schedule_matches_the_published_lists() {
        let k3 = ModelConfig::preset("k3").unwrap();
        assert_eq!(k3.kda_layers().len(), 69);
        let mla = k3.mla_layers();
        assert_eq!(mla.len(), 24);
        assert_eq!(&mla[..3], &[3, 7, 11]);
        assert_eq!(&mla[22..], &[91, 92]);
        assert_eq!(k3.layers[0], LayerKind { mixer: Mixer::Kda, ffn: Ffn::Dense });
        assert!(k3.layers[1..].iter().all(|k| k.ffn == Ffn::Moe));
        assert_eq!((0..93).filter(|l| k3.seals_before(*l)).count(), 8);
        assert_eq!(k3.mla.latent_dim(), 576);
    }

    #[test]
    fn presets_round_trip_through_json() {
        for name in PRESET_NAMES {
            let cfg = ModelConfig::preset(name).unwrap();
            let back = ModelConfig::from_json(&cfg.to_json()).unwrap();
            assert_eq!(cfg, back, "{name}");
            // The bare text config parses to the same model.
            let bare = ModelConfig::from_json(&cfg.to_json()["text_config"]).unwrap();
            assert_eq!(cfg, bare, "{name} bare");
        }
    }

    #[test]
    fn tiny_has_every_feature() {
        let t = ModelConfig::preset("k3-tiny").unwrap();
        assert_eq!(t.vocab_size, 163_840);
        assert_eq!(t.mla_layers(), vec![3, 7, 8]);
        assert_eq!(t.layers[0].ffn, Ffn::Dense);
        assert!(matches!(t.moe.expert_format, ExpertFormat::Mxfp4 { group_size: 32 }));
    }

    fn err_field(v: &Value) -> String {
        match ModelConfig::from_json(v) {
            Err(KernelError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn unsupported_values_name_the_field() {
        let base = ModelConfig::preset("k3-tiny").unwrap().to_json();
        let mut v = base.clone();
        v["text_config"]["hidden_act"] = json!("silu");
        assert_eq!(err_field(&v), "text_config.hidden_act");
        let mut v = base.clone();
        v["text_config"]["q_lora_rank"] = Value::Null;
        assert_eq!(err_field(&v), "text_config.q_lora_rank");
        let mut v = base.clone();
        v["text_config"]["linear_attn_config"]["kda_layers"] = json!([1, 2, 3, 5, 6]);
        assert_eq!(err_field(&v), "text_config.linear_attn_config.kda_layers");
        let mut v = base.clone();
        v["text_config"]["linear_attn_config"]["full_attn_layers"] = json!([4, 8, 10]);
        assert_eq!(err_field(&v), "text_config.linear_attn_config.full_attn_layers");
        let mut v = base.clone();
        v["text_config"]["num_expert_group"] = json!(8);
        assert_eq!(err_field(&v), "text_config.num_expert_group");
        let mut v = base.clone();
        v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = json!(16);
        assert_eq!(err_field(&v), "text_config.quantization_config.config_groups.group_0.weights.group_size");
        let mut v = base.clone();
        v["text_config"].as_object_mut().unwrap().remove("attn_res_block_size");
        assert_eq!(err_field(&v), "text_config.attn_res_block_size");
        let mut v = base;
        v["model_type"] = json!("llama");
        assert_eq!(err_field(&v), "model_type");
    }
}
