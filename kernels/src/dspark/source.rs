//! [`DrafterSource`]: what every backend's `Runner::attach_drafter` takes, a DSpark drafter's config with the
//! weights of exactly that config.
//!
//! Invariants: a source is backend-free (a checkpoint folder opened against its target, or the seeded synthetic
//! generator); the runner that takes it checks the config against its own model and loads the weights in its own
//! form (host f32 on the CPU, device buffers on CUDA), so the same source gives the same drafter everywhere.

use std::path::Path;

use crate::config::ModelConfig;
use crate::dspark::config::DrafterConfig;
use crate::dspark::schema::DrafterCheckpoint;
use crate::dspark::synth::SyntheticDrafterWeights;
use crate::error::Result;
use crate::tensor::WeightSource;

/// A drafter's config and the source of its weights.
pub struct DrafterSource {
    pub config: DrafterConfig,
    pub weights: Box<dyn WeightSource>,
}

impl DrafterSource {
    /// The drafter checkpoint folder `dir` (by convention `MODEL/drafter`), its config checked against `target`.
    pub fn checkpoint(dir: &Path, target: &ModelConfig) -> Result<Self> {
        let checkpoint = DrafterCheckpoint::open(dir, target)?;
        Ok(DrafterSource { config: checkpoint.config().clone(), weights: Box::new(checkpoint) })
    }

    /// The seeded synthetic weights of `config`.
    pub fn synthetic(config: DrafterConfig, seed: u64) -> Self {
        DrafterSource { weights: Box::new(SyntheticDrafterWeights::new(config.clone(), seed)), config }
    }
}
