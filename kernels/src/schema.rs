//! The real K3 checkpoint's tensor names, shapes and dtypes, derived from a [`ModelConfig`].
//!
//! One function, [`model_tensors`], lists every tensor of the text model; the loader checks a
//! checkpoint against it and the synthetic writer writes exactly it, so the code that loads
//! synthetic checkpoints is the code that loads the real one. Names carry no `language_model.`
//! prefix; the checkpoint reader accepts them with or without it.
//!
//! Source: shared/reference/k3-architecture.md §7. Shapes are `[out, in]`.

use crate::config::{ExpertFormat, Ffn, Mixer, ModelConfig};
use crate::tensor::{DType, ExpectedTensor, ShapeRule};

/// The prefix of the text model inside the multimodal K3 checkpoint.
pub const TEXT_PREFIX: &str = "language_model.";

/// `model.layers.{layer}.{suffix}`.
pub fn layer_name(layer: usize, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// `model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}` (proj is w1, w2 or w3).
pub fn expert_name(layer: usize, expert: usize, proj: &str) -> String {
    layer_name(layer, &format!("block_sparse_moe.experts.{expert}.{proj}"))
}

/// The specs of one routed expert projection `[out, in]`: `.weight_packed` + `.weight_scale`
/// for MXFP4, or a single `.weight` for BF16 experts.
pub fn expert_specs(cfg: &ModelConfig, layer: usize, expert: usize, proj: &str) -> Vec<ExpectedTensor> {
    let (out, inp) = match proj {
        "w2" => (cfg.moe.latent_dim, cfg.moe.expert_dim),
        _ => (cfg.moe.expert_dim, cfg.moe.latent_dim),
    };
    let base = expert_name(layer, expert, proj);
    match cfg.moe.expert_format {
        ExpertFormat::Mxfp4 { group_size } => vec![
            ExpectedTensor::exact(format!("{base}.weight_packed"), &[out, inp / 2], DType::U8),
            ExpectedTensor::exact(format!("{base}.weight_scale"), &[out, inp / group_size], DType::U8),
        ],
        ExpertFormat::Bf16 => vec![ExpectedTensor::exact(format!("{base}.weight"), &[out, inp], DType::Bf16)],
    }
}

/// Every tensor of the K3 text model, in checkpoint order (embedding, layers, head).
pub fn model_tensors(cfg: &ModelConfig) -> Vec<ExpectedTensor> {
    let d = cfg.hidden_size;
    let bf = DType::Bf16;
    let f32_ = DType::F32;
    let mut v = vec![ExpectedTensor::exact("model.embed_tokens.weight", &[cfg.vocab_size, d], bf)];
    for (l, kind) in cfg.layers.iter().enumerate() {
        let t =
            |suffix: &str, shape: &[usize], dtype: DType| ExpectedTensor::exact(layer_name(l, suffix), shape, dtype);
        v.push(t("input_layernorm.weight", &[d], bf));
        v.push(t("post_attention_layernorm.weight", &[d], bf));
        v.push(t("self_attention_res_norm.weight", &[d], bf));
        v.push(t("self_attention_res_proj.weight", &[1, d], bf));
        v.push(t("mlp_res_norm.weight", &[d], bf));
        v.push(t("mlp_res_proj.weight", &[1, d], bf));
        match kind.mixer {
            Mixer::Kda => {
                let k = &cfg.kda;
                let p = k.proj_dim();
                for name in ["q_proj", "k_proj", "v_proj", "g_proj"] {
                    v.push(t(&format!("self_attn.{name}.weight"), &[p, d], bf));
                }
                v.push(t("self_attn.o_proj.weight", &[d, p], bf));
                v.push(t("self_attn.f_a_proj.weight", &[k.head_dim, d], bf));
                v.push(t("self_attn.f_b_proj.weight", &[p, k.head_dim], bf));
                v.push(t("self_attn.b_proj.weight", &[k.num_heads, d], bf));
                for name in ["q_conv1d", "k_conv1d", "v_conv1d"] {
                    v.push(t(&format!("self_attn.{name}.weight"), &[p, 1, k.conv_kernel], f32_));
                }
                v.push(ExpectedTensor {
                    name: layer_name(l, "self_attn.A_log"),
                    shape: ShapeRule::VectorAtLeast(k.num_heads),
                    dtype: f32_,
                });
                v.push(t("self_attn.dt_bias", &[p], f32_));
                v.push(t("self_attn.o_norm.weight", &[k.head_dim], f32_));
            }
            Mixer::Mla => {
                let m = &cfg.mla;
                v.push(t("self_attn.q_a_proj.weight", &[m.q_lora_rank, d], bf));
                v.push(t("self_attn.q_a_layernorm.weight", &[m.q_lora_rank], bf));
                v.push(t("self_attn.q_b_proj.weight", &[m.num_heads * m.q_head_dim(), m.q_lora_rank], bf));
                v.push(t("self_attn.kv_a_proj_with_mqa.weight", &[m.latent_dim(), d], bf));
                v.push(t("self_attn.kv_a_layernorm.weight", &[m.kv_lora_rank], bf));
                v.push(t(
                    "self_attn.kv_b_proj.weight",
                    &[m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
                    bf,
                ));
                v.push(t("self_attn.g_proj.weight", &[m.num_heads * m.v_head_dim, d], bf));
                v.push(t("self_attn.o_proj.weight", &[d, m.num_heads * m.v_head_dim], bf));
            }
        }
        match kind.ffn {
            Ffn::Dense => {
                let i = cfg.dense_intermediate;
                v.push(t("mlp.gate_proj.weight", &[i, d], bf));
                v.push(t("mlp.up_proj.weight", &[i, d], bf));
                v.push(t("mlp.down_proj.weight", &[d, i], bf));
            }
            Ffn::Moe => {
                let m = &cfg.moe;
                v.push(t("block_sparse_moe.gate.weight", &[m.num_experts, d], bf));
                v.push(t("block_sparse_moe.gate.e_score_correction_bias", &[m.num_experts], f32_));
                v.push(t("block_sparse_moe.routed_expert_down_proj.weight", &[m.latent_dim, d], bf));
                v.push(t("block_sparse_moe.routed_expert_up_proj.weight", &[d, m.latent_dim], bf));
                v.push(t("block_sparse_moe.routed_expert_norm.weight", &[m.latent_dim], bf));
                if m.num_shared_experts > 0 {
                    let s = m.shared_dim();
                    v.push(t("block_sparse_moe.shared_experts.gate_proj.weight", &[s, d], bf));
                    v.push(t("block_sparse_moe.shared_experts.up_proj.weight", &[s, d], bf));
                    v.push(t("block_sparse_moe.shared_experts.down_proj.weight", &[d, s], bf));
                }
                for e in 0..m.num_experts {
                    for proj in ["w1", "w2", "w3"] {
                        v.extend(expert_specs(cfg, l, e, proj));
                    }
                }
            }
        }
    }
    v.push(ExpectedTensor::exact("model.output_attn_res_norm.weight", &[d], bf));
    v.push(ExpectedTensor::exact("model.output_attn_res_proj.weight", &[1, d], bf));
    v.push(ExpectedTensor::exact("model.norm.weight", &[d], bf));
    v.push(ExpectedTensor::exact("lm_head.weight", &[cfg.vocab_size, d], bf));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k3_tensor_count_and_expert_shapes() {
        let k3 = ModelConfig::preset("k3").unwrap();
        let specs = model_tensors(&k3);
        // 92 MoE layers × 896 experts × 3 projections × 2 tensors of routed experts.
        let experts = specs.iter().filter(|s| s.name.contains(".experts.")).count();
        assert_eq!(experts, 92 * 896 * 6);
        let w1 = specs.iter().find(|s| s.name == "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed").unwrap();
        assert_eq!(w1.shape, ShapeRule::Exact(vec![3072, 1792]));
        let w2s = specs.iter().find(|s| s.name == "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale").unwrap();
        assert_eq!(w2s.shape, ShapeRule::Exact(vec![3584, 96]));
        let kvb = specs.iter().find(|s| s.name == "model.layers.3.self_attn.kv_b_proj.weight").unwrap();
        assert_eq!(kvb.shape, ShapeRule::Exact(vec![24576, 512]));
    }

    #[test]
    fn a_log_accepts_longer_and_kimi_linear_layouts() {
        let rule = ShapeRule::VectorAtLeast(96);
        assert!(rule.accepts(&[128]));
        assert!(rule.accepts(&[1, 1, 96, 1]));
        assert!(!rule.accepts(&[64]));
        assert!(!rule.accepts(&[2, 96]));
    }
}
