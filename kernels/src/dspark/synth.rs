//! Synthetic drafter weights: generated on demand ([`SyntheticDrafterWeights`]) and written as a
//! drafter folder ([`write_drafter_checkpoint`]) in the layout of `dspark::schema`.
//!
//! Invariants: a tensor's bytes depend on `(seed, tensor name)` alone (FNV-1a of the seed's eight
//! little-endian bytes, then `drafter.` and the name, seeds a ChaCha8 stream that fills the tensor in
//! order), so any tensor can be made without the others; bf16 values are the f32 samples rounded to
//! nearest even. The weights are random: real drafts from them are rarely accepted, which is expected
//! (forced acceptance covers speed measurements).
//!
//! Initialisation (`in` = a Linear's fan-in):
//!
//! | tensor | init |
//! |---|---|
//! | `*norm.weight`, `*layernorm.weight` | 1 + N(0, 0.05) |
//! | `markov_head.w1.weight` (an embedding table) | N(0, 1) |
//! | `confidence_head.bias` | N(0, 0.5) |
//! | every other `.weight` (Linears, incl. `W2` and the confidence weight) | N(0, 1/sqrt(in)) |

use std::path::Path;

use half::bf16;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::checkpoint::{write_single_file, CONFIG_FILE, SINGLE_FILE};
use crate::dspark::config::DrafterConfig;
use crate::dspark::schema::{drafter_tensors, CONFIDENCE_BIAS, MARKOV_W1};
use crate::error::{KernelError, Result};
use crate::tensor::{DType, ExpectedTensor, HostTensor, WeightSource};

const NORM_JITTER_STD: f64 = 0.05;
const CONFIDENCE_BIAS_STD: f64 = 0.5;

/// A deterministic generator of a drafter's weights.
#[derive(Clone, Debug)]
pub struct SyntheticDrafterWeights {
    cfg: DrafterConfig,
    seed: u64,
    specs: Vec<ExpectedTensor>,
}

impl SyntheticDrafterWeights {
    pub fn new(cfg: DrafterConfig, seed: u64) -> Self {
        let specs = drafter_tensors(&cfg);
        SyntheticDrafterWeights { cfg, seed, specs }
    }

    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }

    /// The f32 values of a drafter tensor, before storage rounding.
    fn values(&self, spec: &ExpectedTensor) -> Vec<f32> {
        let shape = spec.shape.canonical();
        let numel: usize = shape.iter().product();
        let fan_in = shape.last().copied().unwrap_or(1).max(1) as f64;
        let (mean, std) = if spec.name.ends_with("norm.weight") {
            (1.0, NORM_JITTER_STD)
        } else if spec.name == MARKOV_W1 {
            (0.0, 1.0)
        } else if spec.name == CONFIDENCE_BIAS {
            (0.0, CONFIDENCE_BIAS_STD)
        } else {
            (0.0, 1.0 / fan_in.sqrt())
        };
        let mut rng = ChaCha8Rng::seed_from_u64(stream_seed(self.seed, &spec.name));
        let mut out = Vec::with_capacity(numel);
        while out.len() < numel {
            let (a, b) = gaussian_pair(&mut rng);
            out.push((mean + std * a) as f32);
            if out.len() < numel {
                out.push((mean + std * b) as f32);
            }
        }
        out
    }

    /// The stored bytes of a drafter tensor.
    fn bytes(&self, spec: &ExpectedTensor) -> Vec<u8> {
        let values = self.values(spec);
        match spec.dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        }
    }
}

impl WeightSource for SyntheticDrafterWeights {
    fn tensor(&self, spec: &ExpectedTensor) -> Result<HostTensor> {
        let own = self
            .specs
            .iter()
            .find(|s| s.name == spec.name)
            .ok_or_else(|| KernelError::MissingTensor { name: spec.name.clone() })?;
        let shape = own.shape.canonical();
        spec.check(own.dtype, &shape)?;
        HostTensor::owned(own.dtype, shape, self.bytes(own))
    }
}

/// FNV-1a (64-bit) over the seed's little-endian bytes, then `drafter.` and the tensor name.
fn stream_seed(seed: u64, name: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    seed.to_le_bytes()
        .iter()
        .chain(b"drafter.")
        .chain(name.as_bytes())
        .fold(OFFSET, |h, &b| (h ^ b as u64).wrapping_mul(PRIME))
}

/// Two independent standard normals by Box–Muller on 53-bit uniforms.
fn gaussian_pair(rng: &mut ChaCha8Rng) -> (f64, f64) {
    let unit = |rng: &mut ChaCha8Rng| (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    let u1 = 1.0 - unit(rng);
    let u2 = unit(rng);
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    (r * c, r * s)
}

/// Writes a synthetic drafter folder: `config.json`, then `model.safetensors` (F32 tensors first so
/// every tensor stays aligned to its element size). Returns the tensor data bytes written.
pub fn write_drafter_checkpoint(cfg: &DrafterConfig, seed: u64, dir: &Path) -> Result<u64> {
    let synth = SyntheticDrafterWeights::new(cfg.clone(), seed);
    let file_err = |path: &Path, e: std::io::Error| KernelError::CheckpointFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, cfg.to_json()? + "\n").map_err(|e| file_err(&config_path, e))?;

    write_single_file(&dir.join(SINGLE_FILE), &synth, &synth.specs, "")
}
