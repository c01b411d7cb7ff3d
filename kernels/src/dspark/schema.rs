//! The drafter checkpoint: its tensor names, shapes and dtypes ([`drafter_tensors`]) and the folder
//! that holds them ([`DrafterCheckpoint`]).
//!
//! Layout: a folder (by convention `drafter/` inside the target's checkpoint folder) with
//! `config.json` (a [`DrafterConfig`], `model_type = "sparkd_dspark"`) and one `model.safetensors`.
//! The embedding and the lm_head are the target's and are not stored. Shapes are `[out, in]`; every
//! tensor is BF16 except `confidence_head.bias` (F32). With `d` = hidden, `m` = taps, `H` = heads,
//! `V` = vocab, `r` = Markov rank, `I` = MLP width, `i` = draft layer:
//!
//! | tensor | shape | role |
//! |---|---|---|
//! | `context_proj.weight` | `[d, m·d]` | `W_c` over the concatenated taps (in `target_layer_ids` order) |
//! | `context_norm.weight` | `[d]` | RMSNorm after `W_c`: `H_ctx = RMSNorm(W_c · concat(taps))` |
//! | `layers.{i}.input_layernorm.weight` | `[d]` | pre-attention norm of block tokens |
//! | `layers.{i}.self_attn.q_a_proj.weight` | `[q_lora, d]` | |
//! | `layers.{i}.self_attn.q_a_layernorm.weight` | `[q_lora]` | eps 1e-6 like K3 |
//! | `layers.{i}.self_attn.q_b_proj.weight` | `[H·(nope+rope), q_lora]` | |
//! | `layers.{i}.self_attn.kv_a_proj_with_mqa.weight` | `[kv_lora+rope, d]` | applied to block tokens AND `H_ctx` |
//! | `layers.{i}.self_attn.kv_a_layernorm.weight` | `[kv_lora]` | eps 1e-6 |
//! | `layers.{i}.self_attn.kv_b_proj.weight` | `[H·(nope+v), kv_lora]` | per head: nope rows of W_UK, then v rows of W_UV |
//! | `layers.{i}.self_attn.o_proj.weight` | `[d, H·v]` | no output gate |
//! | `layers.{i}.post_attention_layernorm.weight` | `[d]` | |
//! | `layers.{i}.mlp.{gate,up}_proj.weight` | `[I, d]` | SiTU MLP |
//! | `layers.{i}.mlp.down_proj.weight` | `[d, I]` | |
//! | `norm.weight` | `[d]` | final norm before the shared lm_head |
//! | `markov_head.w1.weight` | `[V, r]` | `W1`: the Markov embedding of the previous token |
//! | `markov_head.w2.weight` | `[V, r]` | `W2ᵀ` as a Linear r→V: the bias is `W2ᵀ W1[x]` |
//! | `confidence_head.weight` | `[1, d + r]` | `w` over `[h_k ; W1[x_{k−1}]]` |
//! | `confidence_head.bias` | `[1]` F32 | `b` |
//!
//! Invariants: [`DrafterCheckpoint::open`] parses the config (checked against the target), maps the
//! file and validates its safetensors header; [`WeightSource::tensor`] then checks each tensor's
//! name, dtype and shape, and every error names the tensor or the file.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::checkpoint::{checked_dtype, CONFIG_FILE, SINGLE_FILE};
use crate::config::ModelConfig;
use crate::dspark::config::DrafterConfig;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, ExpectedTensor, HostTensor, WeightSource};

/// The drafter folder's conventional name inside a target checkpoint folder.
pub const DRAFTER_DIR: &str = "drafter";
pub const CONTEXT_PROJ: &str = "context_proj.weight";
pub const CONTEXT_NORM: &str = "context_norm.weight";
pub const FINAL_NORM: &str = "norm.weight";
pub const MARKOV_W1: &str = "markov_head.w1.weight";
pub const MARKOV_W2: &str = "markov_head.w2.weight";
pub const CONFIDENCE_WEIGHT: &str = "confidence_head.weight";
pub const CONFIDENCE_BIAS: &str = "confidence_head.bias";

/// `layers.{layer}.{suffix}`.
pub fn draft_layer_name(layer: usize, suffix: &str) -> String {
    format!("layers.{layer}.{suffix}")
}

/// Every tensor of the drafter, in checkpoint order.
pub fn drafter_tensors(cfg: &DrafterConfig) -> Vec<ExpectedTensor> {
    let d = cfg.hidden_size;
    let m = cfg.mla();
    let bf = DType::Bf16;
    let mut v = vec![
        ExpectedTensor::exact(CONTEXT_PROJ, &[d, cfg.num_taps() * d], bf),
        ExpectedTensor::exact(CONTEXT_NORM, &[d], bf),
    ];
    for i in 0..cfg.num_draft_layers {
        let t = |suffix: &str, shape: &[usize]| ExpectedTensor::exact(draft_layer_name(i, suffix), shape, bf);
        v.push(t("input_layernorm.weight", &[d]));
        v.push(t("self_attn.q_a_proj.weight", &[m.q_lora_rank, d]));
        v.push(t("self_attn.q_a_layernorm.weight", &[m.q_lora_rank]));
        v.push(t("self_attn.q_b_proj.weight", &[m.num_heads * m.q_head_dim(), m.q_lora_rank]));
        v.push(t("self_attn.kv_a_proj_with_mqa.weight", &[m.latent_dim(), d]));
        v.push(t("self_attn.kv_a_layernorm.weight", &[m.kv_lora_rank]));
        v.push(t("self_attn.kv_b_proj.weight", &[m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank]));
        v.push(t("self_attn.o_proj.weight", &[d, m.num_heads * m.v_head_dim]));
        v.push(t("post_attention_layernorm.weight", &[d]));
        v.push(t("mlp.gate_proj.weight", &[cfg.intermediate_size, d]));
        v.push(t("mlp.up_proj.weight", &[cfg.intermediate_size, d]));
        v.push(t("mlp.down_proj.weight", &[d, cfg.intermediate_size]));
    }
    v.push(ExpectedTensor::exact(FINAL_NORM, &[d], bf));
    v.push(ExpectedTensor::exact(MARKOV_W1, &[cfg.vocab_size, cfg.markov_rank], bf));
    v.push(ExpectedTensor::exact(MARKOV_W2, &[cfg.vocab_size, cfg.markov_rank], bf));
    v.push(ExpectedTensor::exact(CONFIDENCE_WEIGHT, &[1, d + cfg.markov_rank], bf));
    v.push(ExpectedTensor::exact(CONFIDENCE_BIAS, &[1], DType::F32));
    v
}

/// Where one tensor's bytes are inside the mapped file.
#[derive(Debug)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// An opened drafter folder: its config and the location of every stored tensor.
#[derive(Debug)]
pub struct DrafterCheckpoint {
    config: DrafterConfig,
    path: PathBuf,
    map: Arc<Mmap>,
    entries: HashMap<String, Entry>,
}

impl DrafterCheckpoint {
    /// Opens `dir/config.json` and `dir/model.safetensors`, checking the config against `target`.
    pub fn open(dir: &Path, target: &ModelConfig) -> Result<Self> {
        let config_path = dir.join(CONFIG_FILE);
        let file_err = |path: &Path, reason: String| KernelError::CheckpointFile { path: path.to_path_buf(), reason };
        let text = std::fs::read_to_string(&config_path).map_err(|e| file_err(&config_path, e.to_string()))?;
        let config = DrafterConfig::from_json(&text, target)?;
        let path = dir.join(SINGLE_FILE);
        let file = File::open(&path).map_err(|e| file_err(&path, e.to_string()))?;
        // SAFETY: read-only mapping of a weights file that is not rewritten while sparkd runs (the
        // contract of `crate::checkpoint`); every range handed out is checked against its length below.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| file_err(&path, format!("cannot memory-map: {e}")))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map[..])
            .map_err(|e| file_err(&path, format!("not a valid safetensors file (truncated or corrupt): {e}")))?;
        let data_start = 8 + header_len;
        let entries = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (begin, end) = info.data_offsets;
                let entry = Entry {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + begin,
                    end: data_start + end,
                };
                (name, entry)
            })
            .collect();
        Ok(DrafterCheckpoint { config, path, map: Arc::new(map), entries })
    }

    pub fn config(&self) -> &DrafterConfig {
        &self.config
    }

    /// Checks every tensor the config implies; the first problem wins.
    pub fn verify(&self) -> Result<()> {
        for spec in drafter_tensors(&self.config) {
            self.tensor(&spec)?;
        }
        Ok(())
    }
}

impl WeightSource for DrafterCheckpoint {
    fn tensor(&self, spec: &ExpectedTensor) -> Result<HostTensor> {
        let entry =
            self.entries.get(&spec.name).ok_or_else(|| KernelError::MissingTensor { name: spec.name.clone() })?;
        let dtype = checked_dtype(spec, entry.dtype, &entry.shape)?;
        if entry.end > self.map.len() || entry.start > entry.end {
            return Err(KernelError::CheckpointFile {
                path: self.path.clone(),
                reason: format!("tensor `{}` lies outside the file", spec.name),
            });
        }
        Ok(HostTensor::mapped(dtype, entry.shape.clone(), Arc::clone(&self.map), entry.start, entry.end))
    }
}
