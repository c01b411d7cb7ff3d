//! The weights one rank holds, by class, from the tensor list the loader checks and the synthesizer writes
//! (`sparkd_kernels::schema::model_tensors`), so the plan cannot drift from what is loaded.
//!
//! How each tensor splits is `sparkd_kernels::shard_rule::split_of`, the rule the loaders keep each rank's part
//! by; in summary (shared/reference/k3-architecture.md §6.3, over the `tp` ranks of one tensor-parallel group):
//! - Embedding and lm_head: vocabulary-parallel (rows split).
//! - KDA: `q/k/v/g_proj`, `f_b_proj`, `b_proj`, the conv weights, `dt_bias` and `A_log[..heads]` split by heads
//!   (rows); `o_proj` split by its input (row-parallel); `f_a_proj` and `o_norm` replicated.
//! - MLA: `q_b_proj`, `kv_b_proj`, `g_proj` split by heads; `o_proj` row-parallel; `q_a_proj`, `kv_a_proj_with_mqa`
//!   and their norms replicated. (Its latent cache is replicated too: see `plan::memory`.)
//! - Dense MLP and shared experts: gate and up split by their width, down row-parallel.
//! - Router, its bias, the latent down/up projections and `routed_expert_norm`: replicated (the router's fp32
//!   logits must be bit-identical on every rank).
//! - Routed experts: without expert parallelism every expert is sliced by its inner width (rows of w1/w3,
//!   columns of w2); with it, whole experts are placed on ranks, contiguous blocks of `ceil(E / tp)`, and the
//!   plan counts the fullest rank.
//! - Every d-wide RMSNorm and the AttnRes norms and projections: replicated.
//!
//! Invariants:
//! - A split dimension must divide by `tp` (and a sliced MXFP4 expert width must stay a whole number of 32-input
//!   groups); otherwise [`PlanError::Indivisible`] names the tensor, the dimension and `tp`.
//! - Bytes are the device's: every tensor in its stored dtype, except MXFP4 experts, counted in the CUDA backend's
//!   tiled layout (`cuda::expert_layout`, which pads rows to 16 and groups to 4 per tile); with `tp = 1` and K3's
//!   widths that is exactly the checkpoint's bytes. `A_log` is stored with `max(heads, head_dim)` entries (as the
//!   real checkpoint and `sparkd synth` store it), of which a rank keeps its heads.
//! - Parameters count elements: a packed MXFP4 byte holds two, scale bytes are not parameters.

use sparkd_kernels::config::{ExpertFormat, ModelConfig};
use sparkd_kernels::cuda::expert_layout::{tiled_code_bytes, tiled_scale_bytes};
use sparkd_kernels::schema::model_tensors;
use sparkd_kernels::shard_rule::{split_of, Split};
use sparkd_kernels::tensor::{DType, ShapeRule};

use super::PlanError;

/// What a weight tensor is, for the plan's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightClass {
    /// `model.embed_tokens` (vocabulary-parallel).
    Embedding,
    /// `lm_head` (vocabulary-parallel).
    LmHead,
    /// KDA and MLA projections and their per-head tensors (split by heads, or replicated where §6.3 says).
    Attention,
    /// The dense SiTU MLP (layer 0).
    Dense,
    /// The fused shared-expert MLP of each MoE layer.
    SharedExperts,
    /// Router, router bias, latent down/up projections and the latent norm (replicated).
    MoeReplicated,
    /// Routed experts' weights: MXFP4 codes (or BF16 weights).
    RoutedExperts,
    /// Routed experts' E8M0 scales.
    ExpertScales,
    /// d-wide RMSNorms, AttnRes norms and pseudo-queries (replicated).
    Norms,
}

impl WeightClass {
    /// The row name in the plan's table.
    pub fn label(self) -> &'static str {
        match self {
            WeightClass::Embedding => "embedding (vocab-parallel)",
            WeightClass::LmHead => "lm_head (vocab-parallel)",
            WeightClass::Attention => "attention (KDA + MLA, by heads)",
            WeightClass::Dense => "dense MLP (layer 0)",
            WeightClass::SharedExperts => "shared experts",
            WeightClass::MoeReplicated => "router + latent projections (replicated)",
            WeightClass::RoutedExperts => "routed experts (MXFP4 codes)",
            WeightClass::ExpertScales => "routed expert scales (E8M0)",
            WeightClass::Norms => "norms + AttnRes (replicated)",
        }
    }
}

/// One class's bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClassBytes {
    /// The whole model's, as loaded on one device (tp = 1; `A_log`'s unused entries are not loaded).
    pub total: u64,
    /// The fullest rank's.
    pub per_rank: u64,
    /// Of `per_rank`, what every rank holds the same copy of.
    pub replicated: u64,
}

/// The weights of one rank, by class.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WeightPlan {
    /// Every class present, in [`WeightClass`] order.
    pub classes: Vec<(WeightClass, ClassBytes)>,
    /// Parameters of the whole model.
    pub params: u64,
    /// Bytes of the whole checkpoint (stored dtypes, untiled).
    pub checkpoint_bytes: u64,
    /// Routed experts the fullest rank holds (whole experts with expert parallelism; every expert, sliced,
    /// without).
    pub experts_per_rank: usize,
}

impl WeightPlan {
    /// Bytes on the fullest rank.
    pub fn per_rank(&self) -> u64 {
        self.classes.iter().map(|(_, b)| b.per_rank).sum()
    }

    /// Bytes of the whole model as loaded on one device.
    pub fn total(&self) -> u64 {
        self.classes.iter().map(|(_, b)| b.total).sum()
    }
}

/// The class of a tensor, by its name (how it splits is `sparkd_kernels::shard_rule`'s).
fn class_of(name: &str) -> WeightClass {
    use WeightClass::*;
    if name == "model.embed_tokens.weight" {
        return Embedding;
    }
    if name == "lm_head.weight" {
        return LmHead;
    }
    if name.contains(".self_attn.") {
        return Attention;
    }
    if name.contains(".block_sparse_moe.experts.") {
        return if name.ends_with(".weight_scale") { ExpertScales } else { RoutedExperts };
    }
    if name.contains(".mlp.") {
        return Dense;
    }
    if name.contains(".shared_experts.") {
        return SharedExperts;
    }
    if name.contains(".block_sparse_moe.") {
        return MoeReplicated;
    }
    Norms
}

/// The expert index of a routed expert's tensor name (`...experts.{e}.w1...`).
fn expert_index(name: &str) -> Option<usize> {
    name.split(".experts.").nth(1)?.split('.').next()?.parse().ok()
}

/// The weight plan of `cfg` over `tp` ranks, with or without expert parallelism.
pub fn weight_plan(cfg: &ModelConfig, tp: usize, expert_parallel: bool) -> Result<WeightPlan, PlanError> {
    let experts = cfg.moe.num_experts;
    let experts_per_rank = if expert_parallel { experts.div_ceil(tp) } else { experts };
    if expert_parallel && experts < tp {
        return Err(PlanError::Indivisible {
            what: "routed experts".into(),
            dim: experts,
            tp,
            why: "expert parallelism needs at least one expert per rank".into(),
        });
    }
    let mut classes: Vec<(WeightClass, ClassBytes)> = Vec::new();
    let mut params = 0u64;
    let mut checkpoint_bytes = 0u64;
    for spec in model_tensors(cfg) {
        let class = class_of(&spec.name);
        let split = split_of(&spec.name).map_err(|e| PlanError::NoShardRule(e.to_string()))?;
        let (shape, split_len) = match &spec.shape {
            // A_log: stored with max(heads, head_dim) entries; the heads are what ranks split.
            ShapeRule::VectorAtLeast(heads) => (vec![(*heads).max(cfg.kda.head_dim)], Some(*heads)),
            ShapeRule::Exact(shape) => (shape.clone(), None),
        };
        let numel: u64 = shape.iter().map(|&d| d as u64).product();
        let stored = numel * spec.dtype.size() as u64;
        checkpoint_bytes += stored;
        params += match (class, spec.dtype) {
            (WeightClass::ExpertScales, _) => 0,
            (WeightClass::RoutedExperts, DType::U8) => 2 * numel,
            _ => numel,
        };
        let (total, per_rank, replicated) = match split {
            Split::Replicated => (stored, stored, stored),
            Split::Rows | Split::Vocab | Split::Columns => {
                let axis = usize::from(split == Split::Columns);
                let dim = split_len.unwrap_or(shape[axis]);
                if dim % tp != 0 {
                    return Err(PlanError::Indivisible {
                        what: format!("{} (axis {axis})", spec.name),
                        dim,
                        tp,
                        why: "a split dimension must divide by the tensor-parallel size".into(),
                    });
                }
                let row = numel / shape[axis] as u64 * spec.dtype.size() as u64;
                (row * dim as u64, row * (dim / tp) as u64, 0)
            }
            Split::Expert { .. } => {
                let e = expert_index(&spec.name).unwrap_or(0);
                let full = expert_bytes(cfg, &spec.name, &shape, 1)?;
                let rank = if expert_parallel {
                    if e < experts_per_rank {
                        full
                    } else {
                        0
                    }
                } else {
                    expert_bytes(cfg, &spec.name, &shape, tp)?
                };
                (full, rank, 0)
            }
        };
        let entry = match classes.iter_mut().find(|(c, _)| *c == class) {
            Some((_, b)) => b,
            None => {
                classes.push((class, ClassBytes::default()));
                &mut classes.last_mut().expect("just pushed").1
            }
        };
        entry.total += total;
        entry.per_rank += per_rank;
        entry.replicated += replicated;
    }
    classes.sort_by_key(|(c, _)| *c);
    Ok(WeightPlan { classes, params, checkpoint_bytes, experts_per_rank })
}

/// Device bytes of one routed-expert tensor sliced over `slices` ranks by the expert's inner width.
fn expert_bytes(cfg: &ModelConfig, name: &str, shape: &[usize], slices: usize) -> Result<u64, PlanError> {
    let (inner, latent) = (cfg.moe.expert_dim, cfg.moe.latent_dim);
    let down = name.contains(".w2.");
    // The logical [out, in] matrix and the inner width's slice of it.
    let slice = inner / slices;
    if inner % slices != 0 {
        return Err(PlanError::Indivisible {
            what: format!("the routed experts' width (moe_intermediate_size) of {name}"),
            dim: inner,
            tp: slices,
            why: "without --expert-parallel every expert is sliced over the ranks".into(),
        });
    }
    let (rows, cols) = if down { (latent, slice) } else { (slice, latent) };
    match cfg.moe.expert_format {
        ExpertFormat::Mxfp4 { group_size } => {
            if cols % group_size != 0 {
                return Err(PlanError::Indivisible {
                    what: format!("the routed experts' width (moe_intermediate_size) of {name}"),
                    dim: inner,
                    tp: slices,
                    why: format!("each rank's slice must be whole {group_size}-input MXFP4 groups"),
                });
            }
            let bytes = if name.ends_with(".weight_scale") {
                tiled_scale_bytes(rows, cols)
            } else {
                tiled_code_bytes(rows, cols)
            };
            Ok(bytes as u64)
        }
        ExpertFormat::Bf16 => {
            debug_assert_eq!(shape.iter().product::<usize>(), inner * latent);
            Ok((rows * cols * 2) as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset(name: &str) -> ModelConfig {
        ModelConfig::preset(name).unwrap()
    }

    /// Parameters and checkpoint bytes computed independently of the schema: a closed form over the config
    /// fields, written from the reference's §7 table (and run in Python to cross-check before it was written
    /// here).
    fn closed_form(cfg: &ModelConfig) -> (u64, u64) {
        let (v, d) = (cfg.vocab_size as u64, cfg.hidden_size as u64);
        let k = &cfg.kda;
        let (h, hd, p, kw) = (k.num_heads as u64, k.head_dim as u64, k.proj_dim() as u64, k.conv_kernel as u64);
        let m = &cfg.mla;
        let (mh, ql, kvl) = (m.num_heads as u64, m.q_lora_rank as u64, m.kv_lora_rank as u64);
        let (nope, rope, vd) = (m.qk_nope_head_dim as u64, m.qk_rope_head_dim as u64, m.v_head_dim as u64);
        let moe = &cfg.moe;
        let (e, inner, lat, s) =
            (moe.num_experts as u64, moe.expert_dim as u64, moe.latent_dim as u64, moe.shared_dim() as u64);
        // (parameters, bytes)
        let mut t = (0u64, 0u64);
        let add = |t: &mut (u64, u64), n: u64, size: u64| {
            t.0 += n;
            t.1 += n * size;
        };
        add(&mut t, 2 * v * d + 3 * d, 2);
        for layer in &cfg.layers {
            add(&mut t, 6 * d, 2);
            if layer.mixer == sparkd_kernels::config::Mixer::Kda {
                add(&mut t, 5 * p * d + hd * d + p * hd + h * d, 2);
                add(&mut t, 3 * p * kw + h.max(hd) + p + hd, 4);
            } else {
                add(&mut t, ql * d + ql + mh * (nope + rope) * ql + (kvl + rope) * d + kvl + mh * (nope + vd) * kvl, 2);
                add(&mut t, 2 * mh * vd * d, 2);
            }
            if layer.ffn == sparkd_kernels::config::Ffn::Dense {
                add(&mut t, 3 * cfg.dense_intermediate as u64 * d, 2);
            } else {
                add(&mut t, e * d + 2 * lat * d + lat + 3 * s * d, 2);
                add(&mut t, e, 4);
                // MXFP4: half a byte per parameter, plus one scale byte per 32 (not parameters).
                let per_expert = 3 * inner * lat;
                t.0 += e * per_expert;
                t.1 += e * (per_expert / 2 + per_expert / 32);
            }
        }
        t
    }

    #[test]
    fn totals_match_the_reference_and_an_independent_closed_form() {
        // shared/reference/k3-architecture.md §1 and §6.2: K3 has 2,779.5 B parameters; k3-mini (MXFP4
        // experts) 22.3 B in 22.8 GB, k3-mini-wide 94.0 B in 57.6 GB.
        let cases =
            [("k3", 2_779.5e9, None), ("k3-mini", 22.3e9, Some(22.8e9)), ("k3-mini-wide", 94.0e9, Some(57.6e9))];
        for (name, params, bytes) in cases {
            let cfg = preset(name);
            let plan = weight_plan(&cfg, 1, false).unwrap();
            assert_eq!((plan.params, plan.checkpoint_bytes), closed_form(&cfg), "{name}");
            assert!((plan.params as f64 - params).abs() < 0.05e9, "{name}: {} params", plan.params);
            if let Some(b) = bytes {
                assert!((plan.checkpoint_bytes as f64 - b).abs() < 0.05e9, "{name}: {} bytes", plan.checkpoint_bytes);
            }
            // On one device K3's expert tiles need no padding: the loaded bytes are the checkpoint's, but for the
            // entries of A_log past the heads.
            let k = &cfg.kda;
            let a_log_unused = (cfg.kda_layers().len() * (k.head_dim.max(k.num_heads) - k.num_heads) * 4) as u64;
            assert_eq!(plan.total() + a_log_unused, plan.checkpoint_bytes, "{name}");
            assert_eq!(plan.per_rank(), plan.total(), "{name}: one rank holds everything");
        }
        // The exact figures of the Python cross-check.
        assert_eq!(closed_form(&preset("k3")), (2_779_484_478_208, 1_559_965_606_912));
    }

    #[test]
    fn k3_routed_experts_are_17_55_mb_each() {
        let plan = weight_plan(&preset("k3"), 1, false).unwrap();
        let experts: u64 = plan
            .classes
            .iter()
            .filter(|(c, _)| matches!(c, WeightClass::RoutedExperts | WeightClass::ExpertScales))
            .map(|(_, b)| b.total)
            .sum();
        // 92 MoE layers × 896 experts; 3 × 3072 × 3584 codes at 4 bits plus one scale byte per 32.
        assert_eq!(experts, 92 * 896 * (3 * 3072 * 3584 / 2 + 3 * 3072 * 3584 / 32));
        assert_eq!(experts / (92 * 896), 17_547_264);
    }

    #[test]
    fn tensor_parallel_splits_what_the_reference_splits() {
        let cfg = preset("k3");
        let one = weight_plan(&cfg, 1, false).unwrap();
        let two = weight_plan(&cfg, 2, false).unwrap();
        let class = |p: &WeightPlan, c| p.classes.iter().find(|(k, _)| *k == c).unwrap().1;
        // Vocabulary-parallel: 81,920 rows of 7168 bf16 per rank.
        assert_eq!(class(&two, WeightClass::Embedding).per_rank, 81_920 * 7168 * 2);
        assert_eq!(class(&two, WeightClass::LmHead).per_rank, 81_920 * 7168 * 2);
        // Replicated classes keep their size; split ones halve.
        for c in [WeightClass::Norms, WeightClass::MoeReplicated] {
            assert_eq!(class(&two, c).per_rank, class(&one, c).per_rank, "{c:?}");
            assert_eq!(class(&two, c).replicated, class(&two, c).per_rank, "{c:?}");
        }
        for c in [WeightClass::Dense, WeightClass::SharedExperts, WeightClass::RoutedExperts, WeightClass::ExpertScales]
        {
            assert_eq!(class(&two, c).per_rank * 2, class(&one, c).per_rank, "{c:?}");
        }
        // Attention: the replicated LoRA projections stay whole, the rest halves.
        let att1 = class(&one, WeightClass::Attention);
        let att2 = class(&two, WeightClass::Attention);
        let replicated = 69 * 128 * 7168 * 2 + 69 * 128 * 4 + 24 * (1536 * 7168 + 1536 + 576 * 7168 + 512) * 2;
        assert_eq!(att2.replicated, replicated);
        assert_eq!(att2.per_rank, (att1.per_rank - replicated) / 2 + replicated);
    }

    #[test]
    fn expert_parallel_places_whole_experts_and_counts_the_fullest_rank() {
        let cfg = preset("k3");
        let ep = weight_plan(&cfg, 16, true).unwrap();
        assert_eq!(ep.experts_per_rank, 56);
        let one = weight_plan(&cfg, 1, false).unwrap();
        let class = |p: &WeightPlan, c| p.classes.iter().find(|(k, _)| *k == c).unwrap().1;
        assert_eq!(class(&ep, WeightClass::RoutedExperts).per_rank * 16, class(&one, WeightClass::RoutedExperts).total);
        assert!(weight_plan(&cfg, 3, true).is_err(), "3 ranks cannot split K3's vocabulary or heads");
        // k3-tiny's 16 experts over 8 ranks (k3-tiny's 4 heads do not split 8 ways: EP alone is not enough).
        assert!(weight_plan(&preset("k3-tiny"), 8, true).is_err());
        let mini_wide = weight_plan(&preset("k3-mini-wide"), 1, true).unwrap();
        assert_eq!(mini_wide.experts_per_rank, 896);
    }

    #[test]
    fn sliced_mxfp4_experts_pad_to_the_device_tiles() {
        // Over 16 ranks an expert's 3072 inner width is 192: w2's 6 groups per row pad to 8 in 4-group tiles.
        let cfg = preset("k3");
        let tp16 = weight_plan(&cfg, 16, false).unwrap();
        let one = weight_plan(&cfg, 1, false).unwrap();
        let class = |p: &WeightPlan, c| p.classes.iter().find(|(k, _)| *k == c).unwrap().1;
        let codes16 = class(&tp16, WeightClass::RoutedExperts).per_rank;
        let w1w3 = 2 * 192 * 3584 / 2;
        let w2 = 3584 * 8 * 32 / 2;
        assert_eq!(codes16, 92 * 896 * (w1w3 + w2) as u64);
        assert!(codes16 * 16 > class(&one, WeightClass::RoutedExperts).total);
    }

    #[test]
    fn indivisible_splits_name_the_tensor_and_the_size() {
        let e = weight_plan(&preset("k3"), 5, false).unwrap_err().to_string();
        assert!(e.contains("model.layers.0.self_attn.q_proj.weight") && e.contains("12288") && e.contains('5'), "{e}");
        // k3-tiny's expert width 64 over 4 ranks is 16 inputs: not a whole MXFP4 group.
        let e = weight_plan(&preset("k3-tiny"), 4, false).unwrap_err().to_string();
        assert!(e.contains("moe_intermediate_size") && e.contains("32-input"), "{e}");
        assert!(weight_plan(&preset("k3-tiny"), 4, true).is_ok(), "expert parallelism keeps experts whole");
    }
}
