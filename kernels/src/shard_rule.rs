//! The one per-tensor shard rule: for every checkpoint tensor name, how it lays over the ranks of a
//! tensor-parallel group ([`split_of`] gives a [`Split`]), and one rank's place in the group ([`Shard`]). The CPU
//! loader (`cpu::weights`, on widened values: [`Shard::part`]) and the CUDA loader (`cuda::weights`, on the stored
//! bytes: [`Shard::part_tensor`]) take each rank's part through it, and `sparkd plan`
//! (`daemon/src/plan/weights.rs`) counts each rank's bytes by it, so what is planned is what is loaded.
//!
//! The rule follows §6.3 of the K3 reference (shared/reference/k3-architecture.md, "TP2 over 2 GPUs: what gets
//! sharded"), for any group size `N` that divides the split dimensions ([`Shard::check`]):
//! - Embedding and lm_head: vocabulary rows ([`Split::Vocab`]; vLLM's `VocabParallelEmbedding`/`ParallelLMHead`).
//! - KDA: `q/k/v/g_proj`, `f_b_proj`, `b_proj`, the conv weights, `dt_bias` and `A_log` by head-major rows;
//!   `o_proj` by columns (row-parallel, its output a partial sum); `f_a_proj` and `o_norm` replicated.
//! - MLA: `q_b_proj`, `kv_b_proj`, `g_proj` by rows (heads); `o_proj` by columns; `q_a_proj`,
//!   `kv_a_proj_with_mqa` and their norms replicated (so the latent cache is replicated).
//! - Dense and shared-expert MLPs: `gate`/`up` by rows, `down` by columns (Megatron's MLP split).
//! - Router, its bias, `routed_expert_down_proj`/`up_proj`, `routed_expert_norm`: replicated (the fp32 router
//!   logits must be identical on every rank).
//! - Routed experts ([`Split::Expert`]): whole experts placed on ranks with expert parallelism, else every expert
//!   split by its inner width (`w1`/`w3` rows, `w2` columns; MXFP4 codes and scales alike, since both are
//!   `[out, in / x]` row-major and a block of inner rows or of 32-wide input groups stays whole).
//! - Every `d`-wide RMSNorm and the AttnRes norms and projections: replicated.
//!
//! Invariants: every name [`crate::schema::model_tensors`] lists has a rule (a name it does not know is an error,
//! never a silent replica); a part is a contiguous block of rows or columns in rank order, so the parts of all
//! ranks concatenated along the split axis are the whole tensor; a group of one holds every tensor whole.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::{KernelError, Result};
use crate::tensor::HostTensor;

/// The flag a group size comes from (named in errors).
pub const TP_FLAG: &str = "--tensor-parallel-size";
/// The flag that places routed experts whole on ranks (named in errors).
pub const EP_FLAG: &str = "--expert-parallel";

/// How one tensor (row-major, `[rows, width]` with rows its first axis) lays over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds it whole.
    Replicated,
    /// A block of rows (output channels, heads, per-channel vectors) per rank.
    Rows,
    /// A block of columns (input channels) per rank: a row-parallel projection, whose outputs are partial sums.
    Columns,
    /// A block of vocabulary rows per rank (embedding, lm_head).
    Vocab,
    /// A routed expert's tensor: whole on the rank that holds the expert (expert parallelism), else split by the
    /// expert's inner width along `width_axis` (0: rows of `w1`/`w3`; 1: columns of `w2`).
    Expert { width_axis: usize },
}

/// The rule of the tensor `name` (with or without the checkpoint's `language_model.` prefix).
pub fn split_of(name: &str) -> Result<Split> {
    use Split::*;
    let name = name.strip_prefix(crate::schema::TEXT_PREFIX).unwrap_or(name);
    let unknown = || KernelError::InvalidInput(format!("no shard rule for tensor `{name}`"));
    if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
        return Ok(Vocab);
    }
    if matches!(name, "model.norm.weight" | "model.output_attn_res_norm.weight" | "model.output_attn_res_proj.weight") {
        return Ok(Replicated);
    }
    let suffix = name.strip_prefix("model.layers.").and_then(|rest| rest.split_once('.')).ok_or_else(unknown)?.1;
    if let Some(attn) = suffix.strip_prefix("self_attn.") {
        return match attn {
            "o_proj.weight" => Ok(Columns),
            "f_a_proj.weight"
            | "o_norm.weight"
            | "q_a_proj.weight"
            | "q_a_layernorm.weight"
            | "kv_a_proj_with_mqa.weight"
            | "kv_a_layernorm.weight" => Ok(Replicated),
            "q_proj.weight" | "k_proj.weight" | "v_proj.weight" | "g_proj.weight" | "f_b_proj.weight"
            | "b_proj.weight" | "q_conv1d.weight" | "k_conv1d.weight" | "v_conv1d.weight" | "A_log" | "dt_bias"
            | "q_b_proj.weight" | "kv_b_proj.weight" => Ok(Rows),
            _ => Err(unknown()),
        };
    }
    if let Some(moe) = suffix.strip_prefix("block_sparse_moe.") {
        if let Some(expert) = moe.strip_prefix("experts.") {
            // `{e}.{w1|w2|w3}.{weight|weight_packed|weight_scale}`
            let mut parts = expert.split('.');
            let (index, proj, what) = (parts.next(), parts.next(), parts.next());
            let known = index.is_some_and(|e| e.parse::<usize>().is_ok())
                && matches!(what, Some("weight" | "weight_packed" | "weight_scale"))
                && parts.next().is_none();
            return match proj {
                Some("w1" | "w3") if known => Ok(Expert { width_axis: 0 }),
                Some("w2") if known => Ok(Expert { width_axis: 1 }),
                _ => Err(unknown()),
            };
        }
        return match moe {
            "gate.weight"
            | "gate.e_score_correction_bias"
            | "routed_expert_down_proj.weight"
            | "routed_expert_up_proj.weight"
            | "routed_expert_norm.weight" => Ok(Replicated),
            "shared_experts.gate_proj.weight" | "shared_experts.up_proj.weight" => Ok(Rows),
            "shared_experts.down_proj.weight" => Ok(Columns),
            _ => Err(unknown()),
        };
    }
    match suffix {
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => Ok(Rows),
        "mlp.down_proj.weight" => Ok(Columns),
        "input_layernorm.weight"
        | "post_attention_layernorm.weight"
        | "self_attention_res_norm.weight"
        | "self_attention_res_proj.weight"
        | "mlp_res_norm.weight"
        | "mlp_res_proj.weight" => Ok(Replicated),
        _ => Err(unknown()),
    }
}

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

    /// The axis along which this rank holds a block of a tensor under `split`; `None`: it holds it whole (a
    /// replica, a group of one, or a routed expert's tensor under expert parallelism).
    pub fn split_axis(&self, split: Split) -> Option<usize> {
        match split {
            _ if self.world == 1 => None,
            Split::Replicated => None,
            Split::Expert { .. } if self.expert_parallel => None,
            Split::Rows | Split::Vocab | Split::Expert { width_axis: 0 } => Some(0),
            Split::Columns | Split::Expert { .. } => Some(1),
        }
    }

    /// This rank's part, under `split`, of a row-major `[values.len() / width, width]` tensor. A split axis this
    /// group does not divide is an error naming it.
    pub fn part<T: Copy>(&self, split: Split, values: Vec<T>, width: usize) -> Result<Vec<T>> {
        let Some(axis) = self.split_axis(split) else {
            return Ok(values);
        };
        let rows = values.len().checked_div(width).unwrap_or(0);
        let dim = if axis == 0 { rows } else { width };
        if width == 0 || values.len() % width != 0 || dim % self.world != 0 {
            return Err(KernelError::InvalidInput(format!(
                "a [{rows}, {width}] tensor split along axis {axis} over {} ranks ({TP_FLAG})",
                self.world
            )));
        }
        Ok(match axis {
            0 => slice_rows(&values, width, self.block(rows)),
            _ => slice_cols(&values, width, self.block(width)),
        })
    }
}

impl Shard {
    /// This rank's part of the checkpoint tensor `t` (named `name`) as stored, without widening: what the CUDA
    /// loader uploads. A split is taken on whole stored elements, so an MXFP4 routed expert split by width keeps
    /// whole code bytes (two inputs each) and whole scale bytes (a 32-input group each): its part is the same
    /// expert's dequantised part. A split that would cut an element, or that the group does not divide, is an
    /// error naming the tensor. A tensor this rank holds whole is returned as it is (no copy).
    pub fn part_tensor(&self, name: &str, t: HostTensor) -> Result<HostTensor> {
        let Some(axis) = self.split_axis(split_of(name)?) else {
            return Ok(t);
        };
        let size = t.dtype.size();
        let rows = t.shape.first().copied().unwrap_or(0);
        let width: usize = t.shape.iter().skip(1).product(); // elements per row
        let (dim, shape) = match axis {
            0 => (rows, [rows / self.world].into_iter().chain(t.shape.iter().skip(1).copied()).collect()),
            _ if t.shape.len() == 2 => (width, vec![rows, width / self.world]),
            _ => (0, Vec::new()),
        };
        if dim == 0 || dim % self.world != 0 {
            return Err(KernelError::InvalidInput(format!(
                "`{name}` of shape {:?} cannot be split along axis {axis} over {} ranks ({TP_FLAG})",
                t.shape, self.world
            )));
        }
        let row_bytes = width * size;
        let bytes = match axis {
            0 => {
                let block = self.block(rows);
                t.bytes()[block.start * row_bytes..block.end * row_bytes].to_vec()
            }
            _ => {
                let block = self.block(width);
                let cols = block.start * size..block.end * size;
                t.bytes().chunks_exact(row_bytes).flat_map(|row| row[cols.clone()].iter().copied()).collect()
            }
        };
        HostTensor::owned(t.dtype, shape, bytes)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::model_tensors;

    #[test]
    fn every_schema_tensor_of_every_preset_has_a_rule() {
        for preset in ["k3", "k3-mini", "k3-mini-wide", "k3-tiny"] {
            let cfg = ModelConfig::preset(preset).unwrap();
            for spec in model_tensors(&cfg) {
                split_of(&spec.name).unwrap_or_else(|e| panic!("{preset}: {e}"));
            }
        }
    }

    #[test]
    fn the_rule_is_section_6_3s() {
        let l = |s: &str| crate::schema::layer_name(3, s);
        let cases = [
            ("language_model.lm_head.weight", Split::Vocab),
            (&l("self_attn.o_proj.weight"), Split::Columns),
            (&l("self_attn.A_log"), Split::Rows),
            (&l("self_attn.kv_a_proj_with_mqa.weight"), Split::Replicated),
            (&l("block_sparse_moe.shared_experts.down_proj.weight"), Split::Columns),
            (&l("block_sparse_moe.gate.weight"), Split::Replicated),
            (&l("block_sparse_moe.experts.17.w2.weight_packed"), Split::Expert { width_axis: 1 }),
            (&l("block_sparse_moe.experts.17.w3.weight_scale"), Split::Expert { width_axis: 0 }),
            (&l("mlp_res_proj.weight"), Split::Replicated),
        ];
        for (name, split) in cases {
            assert_eq!(split_of(name).unwrap(), split, "{name}");
        }
        for bad in ["model.layers.3.self_attn.z_proj.weight", "model.layers.x", "experts", ""] {
            assert_eq!(split_of(bad).unwrap_err().kind(), "invalid_input", "{bad}");
        }
        assert!(split_of(&l("block_sparse_moe.experts.e.w1.weight")).is_err());
    }

    /// The CUDA loader's parts (stored bytes) are the CPU loader's parts (widened values), for every tensor of
    /// k3-tiny over 2 and 4 ranks, experts placed or split by width; MXFP4 experts dequantise to the same part.
    /// Over 4 ranks k3-tiny's 64-wide experts would split into 16-wide slices, half an MXFP4 group: refused.
    #[test]
    fn stored_parts_are_the_widened_parts() {
        use crate::tensor::{DType, WeightSource};
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let src = crate::synth::SyntheticWeights::new(cfg.clone(), 5);
        let specs = model_tensors(&cfg);
        let mut checked = 0;
        for (world, expert_parallel) in [(2, false), (2, true), (4, true)] {
            Shard::check(&cfg, world, expert_parallel).unwrap();
            for rank in 0..world {
                let shard = Shard { rank, world, expert_parallel };
                for spec in specs.iter().filter(|s| !s.name.ends_with("A_log")) {
                    let t = src.tensor(spec).unwrap();
                    let split = split_of(&spec.name).unwrap();
                    let width = t.shape.iter().skip(1).product::<usize>();
                    let part = shard.part_tensor(&spec.name, t.clone()).unwrap();
                    if t.dtype != DType::U8 {
                        let want = shard.part(split, t.to_f32().unwrap(), width).unwrap();
                        assert_eq!(part.to_f32().unwrap(), want, "{} on {shard:?}", spec.name);
                        checked += 1;
                        continue;
                    }
                    let Some(base) = spec.name.strip_suffix(".weight_packed") else { continue };
                    let scales_spec = specs.iter().find(|s| s.name == format!("{base}.weight_scale")).unwrap();
                    let scales = src.tensor(scales_spec).unwrap();
                    let (out, inp) = (t.shape[0], t.shape[1] * 2);
                    let whole = crate::mxfp4::dequant(out, inp, t.bytes(), scales.bytes()).unwrap();
                    let scales_part = shard.part_tensor(&scales_spec.name, scales).unwrap();
                    let (pout, pin) = (part.shape[0], part.shape[1] * 2);
                    let got = crate::mxfp4::dequant(pout, pin, part.bytes(), scales_part.bytes()).unwrap();
                    assert_eq!(got, shard.part(split, whole, inp).unwrap(), "{base} on {shard:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 0);
        let w2 = crate::schema::expert_specs(&cfg, 1, 0, "w2");
        let quarter = Shard { rank: 1, world: 4, expert_parallel: false };
        let err = quarter.part_tensor(&w2[1].name, src.tensor(&w2[1]).unwrap()).unwrap_err();
        assert!(err.to_string().contains("weight_scale"), "{err}");
    }

    #[test]
    fn parts_concatenate_to_the_whole_along_the_split_axis() {
        let whole: Vec<u32> = (0..24).collect(); // [4, 6]
        let parts = |split, expert_parallel| -> Vec<Vec<u32>> {
            (0..2)
                .map(|rank| Shard { rank, world: 2, expert_parallel }.part(split, whole.clone(), 6).unwrap())
                .collect()
        };
        let rows = parts(Split::Rows, false);
        assert_eq!([rows[0].as_slice(), rows[1].as_slice()].concat(), whole);
        let cols = parts(Split::Columns, false);
        assert_eq!(cols[0], [0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20]);
        assert_eq!(parts(Split::Expert { width_axis: 1 }, false), cols);
        assert_eq!(parts(Split::Expert { width_axis: 1 }, true), [whole.clone(), whole.clone()]);
        assert_eq!(parts(Split::Replicated, false), [whole.clone(), whole.clone()]);
        let three = Shard { rank: 0, world: 3, expert_parallel: false };
        assert_eq!(three.part(Split::Rows, whole.clone(), 6).unwrap_err().kind(), "invalid_input");
        assert_eq!(Shard::WHOLE.part(Split::Columns, whole.clone(), 6).unwrap(), whole);
    }
}
