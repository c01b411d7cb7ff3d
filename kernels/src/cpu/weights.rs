//! K3 weights laid out for the CPU reference, loaded from any [`WeightSource`].
//!
//! Invariants: every tensor was checked against `schema::model_tensors` (name, shape, dtype) by the
//! source; bf16 and f32 values are widened exactly into `F`; MXFP4 experts are dequantised exactly
//! (every E2M1 code times an E8M0 scale is a bf16 value); `A_log` keeps only its first `num_heads`
//! entries; the AttnRes norm and projection weights are folded into one pseudo-query per read.
//! A rank of a tensor-parallel group loads the whole tensors through the same checks and keeps only its
//! part of each (`crate::shard_rule` says which); the whole model is the shard of a group of one.

use std::collections::HashMap;

use crate::config::{ExpertFormat, Ffn, Mixer, ModelConfig, MLA_NORM_EPS};
use crate::cpu::ops::{AttnResQuery, Linear, RmsNorm};
use crate::error::{KernelError, Result};
use crate::float::Real;
use crate::mxfp4;
use crate::schema::{expert_specs, layer_name, model_tensors};
use crate::shard_rule::{split_of, Shard, Split};
use crate::tensor::{ExpectedTensor, HostTensor, WeightSource};

/// One KDA layer.
pub struct KdaWeights<F> {
    pub q_proj: Linear<F>,
    pub k_proj: Linear<F>,
    pub v_proj: Linear<F>,
    /// Output-gate logits, `[P, d]`.
    pub g_proj: Linear<F>,
    pub o_proj: Linear<F>,
    pub f_a_proj: Linear<F>,
    pub f_b_proj: Linear<F>,
    pub b_proj: Linear<F>,
    /// Depthwise conv weights of q, k, v, each `[P, kernel]`; tap `kernel - 1` multiplies the current token.
    pub conv: [Vec<F>; 3],
    /// `exp(A_log[h])`, `[H]`.
    pub a: Vec<F>,
    /// `[P]`
    pub dt_bias: Vec<F>,
    /// Per-head output norm weight, `[head_dim]`.
    pub o_norm: Vec<F>,
    /// The output norm's epsilon (`rms_norm_eps`).
    pub o_norm_eps: F,
}

/// One MLA layer (weights in the unabsorbed checkpoint form; the forward absorbs on the fly).
pub struct MlaWeights<F> {
    pub q_a_proj: Linear<F>,
    pub q_a_norm: RmsNorm<F>,
    pub q_b_proj: Linear<F>,
    pub kv_a_proj: Linear<F>,
    pub kv_a_norm: RmsNorm<F>,
    /// `[H * (nope + v), kv_lora]`: per head, `nope` rows of W_UK then `v` rows of W_UV.
    pub kv_b_proj: Linear<F>,
    pub g_proj: Linear<F>,
    pub o_proj: Linear<F>,
}

/// A SiTU MLP: `down(SiTU(gate x, up x))` (the dense layer and the shared experts).
pub struct SituMlp<F> {
    pub gate: Linear<F>,
    pub up: Linear<F>,
    pub down: Linear<F>,
}

/// One routed expert, dequantised.
pub struct Expert<F> {
    /// Gate, `[expert_dim, latent]`.
    pub w1: Linear<F>,
    /// Down, `[latent, expert_dim]`.
    pub w2: Linear<F>,
    /// Up, `[expert_dim, latent]`.
    pub w3: Linear<F>,
}

/// The latent MoE block.
pub struct MoeWeights<F> {
    /// Router, `[E, d]`.
    pub router: Linear<F>,
    /// `e_score_correction_bias`, `[E]` (selection only).
    pub bias: Vec<F>,
    pub down: Linear<F>,
    pub up: Linear<F>,
    pub norm: RmsNorm<F>,
    pub shared: Option<SituMlp<F>>,
    /// The routed experts this rank holds: experts `first_expert..first_expert + experts.len()`.
    pub experts: Vec<Expert<F>>,
    pub first_expert: usize,
    /// The experts are split by width (tensor-parallel): each `w2` output is this rank's partial sum, left
    /// unrounded until the all-reduce of the per-expert outputs.
    pub partial_experts: bool,
}

pub enum MixerWeights<F> {
    Kda(Box<KdaWeights<F>>),
    Mla(Box<MlaWeights<F>>),
}

pub enum FfnWeights<F> {
    Dense(SituMlp<F>),
    Moe(Box<MoeWeights<F>>),
}

pub struct LayerWeights<F> {
    pub attn_res: AttnResQuery<F>,
    pub input_norm: RmsNorm<F>,
    pub mixer: MixerWeights<F>,
    pub mlp_res: AttnResQuery<F>,
    pub post_norm: RmsNorm<F>,
    pub ffn: FfnWeights<F>,
}

pub struct ModelWeights<F> {
    /// `[V / N, d]`: the rows of ids `vocab_start..` (all of them on a whole model).
    pub embed: Vec<F>,
    pub vocab_start: usize,
    pub layers: Vec<LayerWeights<F>>,
    pub out_res: AttnResQuery<F>,
    pub norm: RmsNorm<F>,
    /// `[V / N, d]`: the rows of ids `vocab_start..`.
    pub lm_head: Linear<F>,
}

/// Fetches tensors by name through the schema, so every read is checked, and keeps `shard`'s part of each as
/// `crate::shard_rule` says for its name.
struct Loader<'a> {
    specs: HashMap<String, ExpectedTensor>,
    src: &'a dyn WeightSource,
    shard: Shard,
}

impl Loader<'_> {
    fn raw(&self, name: &str) -> Result<HostTensor> {
        let spec = self.specs.get(name).ok_or_else(|| KernelError::MissingTensor { name: name.to_string() })?;
        self.src.tensor(spec)
    }

    /// The whole tensor's values, widened.
    fn whole<F: Real>(&self, name: &str) -> Result<Vec<F>> {
        Ok(self.raw(name)?.to_f32()?.into_iter().map(F::from_f32).collect())
    }

    /// This rank's part of the tensor `name`, a row-major `[_, width]` matrix (a vector: `width` 1).
    fn values<F: Real>(&self, name: &str, width: usize) -> Result<Vec<F>> {
        self.shard.part(split_of(name)?, self.whole(name)?, width)
    }

    /// `whole` `[out, in]` cut to this rank's part under `split`.
    fn cut<F: Real>(&self, split: Split, whole: Linear<F>) -> Result<Linear<F>> {
        let (out_dim, in_dim) = match self.shard.split_axis(split) {
            None => (whole.out_dim, whole.in_dim),
            Some(0) => (whole.out_dim / self.shard.world, whole.in_dim),
            Some(_) => (whole.out_dim, whole.in_dim / self.shard.world),
        };
        Ok(Linear::new(out_dim, in_dim, self.shard.part(split, whole.w, whole.in_dim)?))
    }

    /// This rank's part of the projection `name`: rows (column parallelism, output channels split), columns
    /// (row parallelism, input channels split, outputs partial) or whole, as the rule says.
    fn linear<F: Real>(&self, name: &str) -> Result<Linear<F>> {
        let t = self.raw(name)?;
        let (out_dim, in_dim) = (t.shape[0], t.shape[1..].iter().product());
        let whole = Linear::new(out_dim, in_dim, t.to_f32()?.into_iter().map(F::from_f32).collect());
        self.cut(split_of(name)?, whole)
    }

    fn norm<F: Real>(&self, name: &str, eps: f32) -> Result<RmsNorm<F>> {
        Ok(RmsNorm { w: self.values(name, 1)?, eps: F::from_f32(eps) })
    }

    fn attn_res<F: Real>(&self, norm: &str, proj: &str, eps: f32) -> Result<AttnResQuery<F>> {
        let n: Vec<f32> = self.values(norm, 1)?;
        let p: Vec<f32> = self.values(proj, 1)?;
        Ok(AttnResQuery { q: n.iter().zip(&p).map(|(a, b)| F::from_f32(a * b)).collect(), eps: F::from_f32(eps) })
    }

    /// A SiTU MLP split Megatron-style (the rule: `gate`/`up` by rows, `down` by columns).
    fn mlp<F: Real>(&self, prefix: &str) -> Result<SituMlp<F>> {
        Ok(SituMlp {
            gate: self.linear(&format!("{prefix}.gate_proj.weight"))?,
            up: self.linear(&format!("{prefix}.up_proj.weight"))?,
            down: self.linear(&format!("{prefix}.down_proj.weight"))?,
        })
    }

    /// Routed expert `e`: whole under expert parallelism, else `w1`/`w3` by rows and `w2` by columns (the rule).
    fn routed_expert<F: Real>(&self, cfg: &ModelConfig, layer: usize, e: usize) -> Result<Expert<F>> {
        let [w1, w2, w3] = ["w1", "w2", "w3"].map(|proj| self.expert(cfg, layer, e, proj));
        Ok(Expert { w1: w1?, w2: w2?, w3: w3? })
    }

    fn expert<F: Real>(&self, cfg: &ModelConfig, layer: usize, e: usize, proj: &str) -> Result<Linear<F>> {
        let specs = expert_specs(cfg, layer, e, proj);
        let (out_dim, in_dim) = match proj {
            "w2" => (cfg.moe.latent_dim, cfg.moe.expert_dim),
            _ => (cfg.moe.expert_dim, cfg.moe.latent_dim),
        };
        let values = match cfg.moe.expert_format {
            ExpertFormat::Mxfp4 { .. } => {
                let packed = self.src.tensor(&specs[0])?;
                let scales = self.src.tensor(&specs[1])?;
                mxfp4::dequant(out_dim, in_dim, packed.bytes(), scales.bytes())?
            }
            ExpertFormat::Bf16 => self.src.tensor(&specs[0])?.to_f32()?,
        };
        let whole = Linear::new(out_dim, in_dim, values.into_iter().map(F::from_f32).collect());
        self.cut(split_of(&specs[0].name)?, whole)
    }
}

impl<F: Real> ModelWeights<F> {
    /// Loads and checks every tensor of `cfg` from `src`.
    pub fn load(cfg: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_shard(cfg, src, Shard::WHOLE)
    }

    /// Loads and checks every tensor of `cfg` from `src` and keeps `shard`'s part of each (`cfg` is the
    /// whole model's config; a group size that does not divide it is an error naming the flag).
    pub fn load_shard(cfg: &ModelConfig, src: &dyn WeightSource, shard: Shard) -> Result<Self> {
        Shard::check(cfg, shard.world, shard.expert_parallel)?;
        let specs = model_tensors(cfg).into_iter().map(|s| (s.name.clone(), s)).collect();
        let ld = Loader { specs, src, shard };
        let eps = cfg.rms_norm_eps;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (l, kind) in cfg.layers.iter().enumerate() {
            let n = |s: &str| layer_name(l, s);
            let mixer = match kind.mixer {
                Mixer::Kda => {
                    // Stored with max(heads, head_dim) entries; the first `heads` are the heads the rule splits.
                    let a_name = n("self_attn.A_log");
                    let a_log: Vec<F> = ld.whole(&a_name)?;
                    let a = a_log[..cfg.kda.num_heads].iter().map(|x| x.exp()).collect();
                    // [P, kernel] per channel: this rank's channels are a block of rows.
                    let conv = |x: &str| ld.values(&n(&format!("self_attn.{x}_conv1d.weight")), cfg.kda.conv_kernel);
                    MixerWeights::Kda(Box::new(KdaWeights {
                        q_proj: ld.linear(&n("self_attn.q_proj.weight"))?,
                        k_proj: ld.linear(&n("self_attn.k_proj.weight"))?,
                        v_proj: ld.linear(&n("self_attn.v_proj.weight"))?,
                        g_proj: ld.linear(&n("self_attn.g_proj.weight"))?,
                        o_proj: ld.linear(&n("self_attn.o_proj.weight"))?,
                        f_a_proj: ld.linear(&n("self_attn.f_a_proj.weight"))?,
                        f_b_proj: ld.linear(&n("self_attn.f_b_proj.weight"))?,
                        b_proj: ld.linear(&n("self_attn.b_proj.weight"))?,
                        conv: [conv("q")?, conv("k")?, conv("v")?],
                        a: ld.shard.part(split_of(&a_name)?, a, 1)?,
                        dt_bias: ld.values(&n("self_attn.dt_bias"), 1)?,
                        o_norm: ld.values(&n("self_attn.o_norm.weight"), 1)?,
                        o_norm_eps: F::from_f32(eps),
                    }))
                }
                Mixer::Mla => MixerWeights::Mla(Box::new(MlaWeights {
                    q_a_proj: ld.linear(&n("self_attn.q_a_proj.weight"))?,
                    q_a_norm: ld.norm(&n("self_attn.q_a_layernorm.weight"), MLA_NORM_EPS)?,
                    q_b_proj: ld.linear(&n("self_attn.q_b_proj.weight"))?,
                    kv_a_proj: ld.linear(&n("self_attn.kv_a_proj_with_mqa.weight"))?,
                    kv_a_norm: ld.norm(&n("self_attn.kv_a_layernorm.weight"), MLA_NORM_EPS)?,
                    kv_b_proj: ld.linear(&n("self_attn.kv_b_proj.weight"))?,
                    g_proj: ld.linear(&n("self_attn.g_proj.weight"))?,
                    o_proj: ld.linear(&n("self_attn.o_proj.weight"))?,
                })),
            };
            let ffn = match kind.ffn {
                Ffn::Dense => FfnWeights::Dense(ld.mlp(&n("mlp"))?),
                Ffn::Moe => {
                    let m = |s: &str| n(&format!("block_sparse_moe.{s}"));
                    let held = shard.experts(cfg.moe.num_experts);
                    let first_expert = held.start;
                    let experts = held.map(|e| ld.routed_expert(cfg, l, e)).collect::<Result<Vec<_>>>()?;
                    FfnWeights::Moe(Box::new(MoeWeights {
                        router: ld.linear(&m("gate.weight"))?,
                        bias: ld.values(&m("gate.e_score_correction_bias"), 1)?,
                        down: ld.linear(&m("routed_expert_down_proj.weight"))?,
                        up: ld.linear(&m("routed_expert_up_proj.weight"))?,
                        norm: ld.norm(&m("routed_expert_norm.weight"), eps)?,
                        shared: if cfg.moe.num_shared_experts > 0 { Some(ld.mlp(&m("shared_experts"))?) } else { None },
                        experts,
                        first_expert,
                        partial_experts: shard.world > 1 && !shard.expert_parallel,
                    }))
                }
            };
            layers.push(LayerWeights {
                attn_res: ld.attn_res(
                    &n("self_attention_res_norm.weight"),
                    &n("self_attention_res_proj.weight"),
                    eps,
                )?,
                input_norm: ld.norm(&n("input_layernorm.weight"), eps)?,
                mixer,
                mlp_res: ld.attn_res(&n("mlp_res_norm.weight"), &n("mlp_res_proj.weight"), eps)?,
                post_norm: ld.norm(&n("post_attention_layernorm.weight"), eps)?,
                ffn,
            });
        }
        Ok(ModelWeights {
            embed: ld.values("model.embed_tokens.weight", cfg.hidden_size)?,
            vocab_start: shard.block(cfg.vocab_size).start,
            layers,
            out_res: ld.attn_res("model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight", eps)?,
            norm: ld.norm("model.norm.weight", eps)?,
            lm_head: ld.linear("lm_head.weight")?,
        })
    }
}
