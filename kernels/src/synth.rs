//! Synthetic K3 weights: generated on demand, and written as a checkpoint in the real layout.
//!
//! Invariants:
//! - A tensor's bytes depend on `(seed, tensor name)` alone: the name (without the
//!   `language_model.` prefix) is hashed with FNV-1a after the seed's eight little-endian bytes, and
//!   the hash seeds a ChaCha8 stream that fills the tensor in order. Any one tensor can be made
//!   without the others, and the bytes never depend on the chunking used to produce them.
//! - [`SyntheticWeights`] hands out exactly the tensors of `schema::model_tensors(cfg)`, with the
//!   stored shape (`A_log` gets `max(num_heads, head_dim)` entries, as the real checkpoint stores
//!   `[128]` for 96 heads); [`write_checkpoint`] writes the same bytes under `language_model.` names.
//! - Every bf16 value is the f32 sample rounded to nearest even; f32 tensors are stored as sampled.
//!
//! Initialisation (`d` = hidden size, `in` = a Linear's fan-in, shapes `[out, in]`; the gains are the
//! constants below, in one place, so they can be tuned against the forward):
//!
//! | tensor | init |
//! |---|---|
//! | `embed_tokens` | N(0, [`EMBED_STD`]) |
//! | `lm_head` | N(0, [`LM_HEAD_GAIN`]/sqrt(d)) |
//! | every other bf16 Linear `.weight` (router `gate`, AttnRes `*_res_proj` `[1,d]`, BF16 experts) | N(0, 1/sqrt(in)) |
//! | RMSNorm `.weight`s (`*norm.weight`, `*layernorm.weight`, incl. `o_norm`, `routed_expert_norm`) | 1 + N(0, [`NORM_JITTER_STD`]) |
//! | KDA `A_log` | ln(U([`A_RANGE`])) |
//! | KDA `dt_bias` | ln(expm1(dt)), dt = exp(U(ln [`DT_RANGE`].0, ln [`DT_RANGE`].1)) |
//! | KDA `{q,k,v}_conv1d.weight` `[P,1,K]` (F32) | N(0, 1/sqrt(K)) |
//! | router `e_score_correction_bias` (F32) | N(0, [`ROUTER_BIAS_STD`]) |
//! | MXFP4 `weight_packed` | uniform random bytes (two uniform E2M1 codes) |
//! | MXFP4 `weight_scale` | `round(127 + log2(1/(sqrt(in)·`[`E2M1_RANDOM_RMS`]`)))`, plus a uniform jitter in {-1, 0, +1} per group |
//!
//! Normal samples use Box–Muller on 53-bit uniforms, so the streams do not depend on a
//! distributions crate. With the scale jitter, the dequantised experts' std is about
//! `sqrt(1.75)·2^(r-x)/sqrt(in)`, with `x` the unrounded and `r` the rounded log2 scale offset:
//! within a factor of two of 1/sqrt(in). Concretely: 0.97/sqrt(in) for k3-tiny (in = 64, scale
//! byte 122), 1.68/sqrt(in) and 1.81/sqrt(in) for K3's w2 (in = 3072) and w1/w3 (in = 3584), both
//! at scale byte 120.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use half::bf16;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};

use crate::checkpoint::{CONFIG_FILE, INDEX_FILE};
use crate::config::ModelConfig;
use crate::error::{KernelError, Result};
use crate::mxfp4::GROUP_SIZE;
use crate::schema::{model_tensors, TEXT_PREFIX};
use crate::tensor::{DType, ExpectedTensor, HostTensor, ShapeRule, WeightSource};

/// Std of the token embedding.
pub const EMBED_STD: f64 = 1.0;
/// lm_head std is `LM_HEAD_GAIN / sqrt(d)`.
pub const LM_HEAD_GAIN: f64 = 3.0;
/// RMSNorm weights are `1 + N(0, NORM_JITTER_STD)`.
pub const NORM_JITTER_STD: f64 = 0.05;
/// Std of the router's selection bias.
pub const ROUTER_BIAS_STD: f64 = 0.01;
/// `A_log = ln(A)` with `A` uniform in this range.
pub const A_RANGE: (f64, f64) = (1.0, 16.0);
/// The KDA time step `dt` is log-uniform in this range; `dt_bias` is its inverse softplus.
pub const DT_RANGE: (f64, f64) = (0.001, 0.1);
/// RMS of a uniformly random E2M1 code: sqrt(mean of the squared magnitudes) = sqrt(68.5 / 8).
pub const E2M1_RANDOM_RMS: f64 = 2.926_174_978_1;
/// Scale bytes are jittered uniformly by up to this much per group.
pub const SCALE_JITTER: i64 = 1;

/// Elements produced per step of a generator (a multiple of 4, so byte streams stay word-aligned).
const CHUNK: usize = 1 << 16;

/// How one tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    Normal {
        mean: f64,
        std: f64,
    },
    /// `ln(U(A_RANGE))`.
    ALog,
    /// `ln(expm1(dt))`, `dt` log-uniform in `DT_RANGE`.
    DtBias,
    /// Uniform random bytes (MXFP4 `weight_packed`).
    RandomBytes,
    /// MXFP4 `weight_scale`: `base` jittered by ±`SCALE_JITTER` per byte.
    Scales {
        base: i64,
    },
}

/// A deterministic generator of the model's weights.
#[derive(Clone, Debug)]
pub struct SyntheticWeights {
    cfg: ModelConfig,
    seed: u64,
    /// `model_tensors(cfg)`, in checkpoint order.
    specs: Vec<ExpectedTensor>,
    /// Spec name → position in `specs`.
    by_name: HashMap<String, usize>,
}

impl SyntheticWeights {
    pub fn new(cfg: ModelConfig, seed: u64) -> Self {
        let specs = model_tensors(&cfg);
        let by_name = specs.iter().enumerate().map(|(i, s)| (s.name.clone(), i)).collect();
        SyntheticWeights { cfg, seed, specs, by_name }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The shape a tensor is stored with: the canonical one, except `A_log`, which gets
    /// `max(num_heads, head_dim)` entries like the real checkpoint.
    fn stored_shape(&self, spec: &ExpectedTensor) -> Vec<usize> {
        match &spec.shape {
            ShapeRule::VectorAtLeast(n) => vec![(*n).max(self.cfg.kda.head_dim)],
            ShapeRule::Exact(shape) => shape.clone(),
        }
    }

    /// The initialisation rule of a model tensor (see the module doc).
    fn init(&self, spec: &ExpectedTensor, shape: &[usize]) -> Result<Init> {
        let name = spec.name.as_str();
        let d = self.cfg.hidden_size as f64;
        let fan_in = || shape.last().copied().unwrap_or(1).max(1) as f64;
        let init = if name == "model.embed_tokens.weight" {
            Init::Normal { mean: 0.0, std: EMBED_STD }
        } else if name == "lm_head.weight" {
            Init::Normal { mean: 0.0, std: LM_HEAD_GAIN / d.sqrt() }
        } else if name.ends_with(".A_log") {
            Init::ALog
        } else if name.ends_with(".dt_bias") {
            Init::DtBias
        } else if name.ends_with("_conv1d.weight") {
            Init::Normal { mean: 0.0, std: 1.0 / fan_in().sqrt() }
        } else if name.ends_with(".e_score_correction_bias") {
            Init::Normal { mean: 0.0, std: ROUTER_BIAS_STD }
        } else if name.ends_with(".weight_packed") {
            Init::RandomBytes
        } else if name.ends_with(".weight_scale") {
            let expert_fan_in = fan_in() * GROUP_SIZE as f64;
            Init::Scales { base: (127.0 + (1.0 / (expert_fan_in.sqrt() * E2M1_RANDOM_RMS)).log2()).round() as i64 }
        } else if name.ends_with("norm.weight") {
            Init::Normal { mean: 1.0, std: NORM_JITTER_STD }
        } else if name.ends_with(".weight") && shape.len() == 2 {
            Init::Normal { mean: 0.0, std: 1.0 / fan_in().sqrt() }
        } else {
            return Err(KernelError::InvalidInput(format!("no synthetic initialisation for tensor `{name}`")));
        };
        Ok(init)
    }

    /// The model spec of a tensor name (with or without the `language_model.` prefix).
    fn model_spec(&self, name: &str) -> Result<&ExpectedTensor> {
        let bare = name.strip_prefix(TEXT_PREFIX).unwrap_or(name);
        self.by_name.get(bare).map(|&i| &self.specs[i]).ok_or_else(|| KernelError::MissingTensor { name: name.into() })
    }

    /// Streams the stored bytes of a model tensor into `sink`, `CHUNK` elements at a time.
    fn generate(&self, spec: &ExpectedTensor, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let shape = self.stored_shape(spec);
        let init = self.init(spec, &shape)?;
        self.generate_range(spec, init, 0, shape.iter().product(), sink)
    }

    /// Streams the bytes of elements `start..start + count` of a tensor. The ChaCha stream is entered
    /// at the word that element `start` draws first ([`word_pos`]), so `start` must be even (a
    /// Box–Muller pair boundary) and, for random bytes, a multiple of 4 (a word boundary).
    fn generate_range(
        &self,
        spec: &ExpectedTensor,
        init: Init,
        start: usize,
        count: usize,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        debug_assert!(start % 4 == 0, "segments start at a word and pair boundary");
        let mut rng = ChaCha8Rng::seed_from_u64(stream_seed(self.seed, &spec.name));
        rng.set_word_pos(word_pos(init, start));
        let mut gauss = Gaussian::default();
        let mut bytes = Vec::with_capacity(CHUNK.min(count) * spec.dtype.size());
        let mut done = 0;
        while done < count {
            let n = CHUNK.min(count - done);
            bytes.clear();
            match init {
                Init::RandomBytes => {
                    bytes.resize(n, 0);
                    rng.fill_bytes(&mut bytes);
                }
                Init::Scales { base } => {
                    bytes.extend((0..n).map(|_| {
                        let jitter = (rng.next_u64() % (2 * SCALE_JITTER as u64 + 1)) as i64 - SCALE_JITTER;
                        (base + jitter).clamp(0, 254) as u8
                    }));
                }
                Init::Normal { mean, std } => {
                    emit(spec.dtype, n, &mut bytes, || (mean + std * gauss.sample(&mut rng)) as f32)?;
                }
                Init::ALog => {
                    let (lo, hi) = A_RANGE;
                    emit(spec.dtype, n, &mut bytes, || (lo + (hi - lo) * unit(&mut rng)).ln() as f32)?;
                }
                Init::DtBias => {
                    let (lo, hi) = (DT_RANGE.0.ln(), DT_RANGE.1.ln());
                    emit(spec.dtype, n, &mut bytes, || (lo + (hi - lo) * unit(&mut rng)).exp().exp_m1().ln() as f32)?;
                }
            }
            sink(&bytes)?;
            done += n;
        }
        Ok(())
    }

    /// The stored bytes of a model tensor, generated by one thread per available core over segments
    /// of `segment` elements (a positive multiple of 4). The bytes equal [`Self::generate`]'s: each
    /// segment enters the tensor's ChaCha stream at its own word position.
    fn generate_parallel(&self, spec: &ExpectedTensor, segment: usize) -> Result<Vec<u8>> {
        let shape = self.stored_shape(spec);
        let init = self.init(spec, &shape)?;
        let numel: usize = shape.iter().product();
        let size = spec.dtype.size();
        let mut data = vec![0u8; numel * size];
        let segments = numel.div_ceil(segment.max(1));
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, segments.max(1));
        let queue = std::sync::Mutex::new(data.chunks_mut(segment * size).enumerate());
        let failed = AtomicBool::new(false);
        let work = || -> Result<()> {
            while !failed.load(Ordering::Relaxed) {
                let next =
                    queue.lock().map_err(|_| KernelError::InvalidInput("a generator thread panicked".into()))?.next();
                let Some((i, out)) = next else { break };
                let mut at = 0;
                let result = self.generate_range(spec, init, i * segment, out.len() / size, &mut |chunk| {
                    out[at..at + chunk.len()].copy_from_slice(chunk);
                    at += chunk.len();
                    Ok(())
                });
                failed.fetch_or(result.is_err(), Ordering::Relaxed);
                result?;
            }
            Ok(())
        };
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers).map(|_| scope.spawn(work)).collect();
            handles.into_iter().try_for_each(|h| {
                h.join().unwrap_or_else(|_| Err(KernelError::InvalidInput("a generator thread panicked".into())))
            })
        })?;
        Ok(data)
    }
}

/// Elements per segment of a parallel generation: a multiple of 4, so every segment starts at a
/// Box–Muller pair boundary and at a ChaCha word boundary of the byte streams.
const SEGMENT: usize = 1 << 20;

/// The ChaCha word (32-bit) position where element `index` starts drawing: random bytes take one
/// byte of the stream each (4 per word; `index % 4 == 0`), every other init one `u64` (two words) per
/// element: a Box–Muller pair draws two `u64`s and yields two elements, so an even `index` starts a
/// pair at word `2 * index`.
fn word_pos(init: Init, index: usize) -> u128 {
    match init {
        Init::RandomBytes => index as u128 / 4,
        _ => 2 * index as u128,
    }
}

impl WeightSource for SyntheticWeights {
    fn tensor(&self, spec: &ExpectedTensor) -> Result<HostTensor> {
        let model_spec = self.model_spec(&spec.name)?;
        let shape = self.stored_shape(model_spec);
        spec.check(model_spec.dtype, &shape)?;
        let data = self.generate_parallel(model_spec, SEGMENT)?;
        HostTensor::owned(model_spec.dtype, shape, data)
    }
}

/// FNV-1a (64-bit) over the seed's little-endian bytes, then the bare tensor name.
fn stream_seed(seed: u64, name: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bare = name.strip_prefix(TEXT_PREFIX).unwrap_or(name);
    seed.to_le_bytes().iter().chain(bare.as_bytes()).fold(OFFSET, |h, &b| (h ^ b as u64).wrapping_mul(PRIME))
}

/// A uniform sample in [0, 1) with 53 random bits.
fn unit(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal samples by Box–Muller, keeping the second value of each pair.
#[derive(Default)]
struct Gaussian {
    spare: Option<f64>,
}

impl Gaussian {
    fn sample(&mut self, rng: &mut ChaCha8Rng) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - unit(rng); // (0, 1]: the log is finite
        let u2 = unit(rng);
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        self.spare = Some(r * s);
        r * c
    }
}

/// Appends `n` values from `next` to `bytes` in `dtype` (bf16 rounded to nearest even).
fn emit(dtype: DType, n: usize, bytes: &mut Vec<u8>, mut next: impl FnMut() -> f32) -> Result<()> {
    match dtype {
        DType::Bf16 => (0..n).for_each(|_| bytes.extend_from_slice(&bf16::from_f32(next()).to_le_bytes())),
        DType::F32 => (0..n).for_each(|_| bytes.extend_from_slice(&next().to_le_bytes())),
        DType::U8 => return Err(KernelError::InvalidInput("a float initialisation cannot fill a U8 tensor".into())),
    }
    Ok(())
}

/// One written shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardReport {
    /// File name inside the checkpoint folder.
    pub file: String,
    pub tensors: usize,
    /// Tensor data bytes (the header excluded).
    pub bytes: u64,
}

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteReport {
    pub dir: PathBuf,
    pub shards: Vec<ShardReport>,
    pub tensor_count: usize,
    /// Sum of tensor data bytes (the index's `metadata.total_size`).
    pub total_bytes: u64,
}

/// A tensor placed in a shard.
struct Placed<'a> {
    spec: &'a ExpectedTensor,
    shape: Vec<usize>,
    bytes: u64,
}

/// Writes a synthetic checkpoint in the real K3 layout: `config.json`, shards
/// `model-0000i-of-0000N.safetensors` (names under `language_model.`) of at most `max_shard_bytes`
/// of data each (a single larger tensor or expert gets a shard of its own), and
/// `model.safetensors.index.json` last, so an interrupted write never looks complete. An expert's
/// six MXFP4 tensors always share a shard. Tensors are streamed, so memory stays bounded by one
/// generator chunk per writer thread, whatever the shard size. Shards are written by one thread
/// per available core; the bytes do not depend on the thread count.
pub fn write_checkpoint(cfg: &ModelConfig, seed: u64, dir: &Path, max_shard_bytes: u64) -> Result<WriteReport> {
    let synth = SyntheticWeights::new(cfg.clone(), seed);
    let file_err = |path: &Path, e: std::io::Error| KernelError::CheckpointFile {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
    let config_path = dir.join(CONFIG_FILE);
    let config_text =
        serde_json::to_string_pretty(&cfg.to_json()).map_err(|e| KernelError::InvalidInput(e.to_string()))?;
    std::fs::write(&config_path, config_text + "\n").map_err(|e| file_err(&config_path, e))?;

    let shards = plan_shards(&synth, max_shard_bytes);
    let count = shards.len();
    let files: Vec<String> = (0..count).map(|i| format!("model-{:05}-of-{:05}.safetensors", i + 1, count)).collect();
    let shard_bytes = write_shards_in_parallel(&synth, &shards, &files, dir)?;
    let mut report = WriteReport { dir: dir.to_path_buf(), shards: Vec::new(), tensor_count: 0, total_bytes: 0 };
    let mut weight_map = Map::new();
    for ((shard, file), bytes) in shards.iter().zip(files).zip(shard_bytes) {
        for placed in shard {
            weight_map.insert(format!("{TEXT_PREFIX}{}", placed.spec.name), Value::String(file.clone()));
        }
        report.tensor_count += shard.len();
        report.total_bytes += bytes;
        report.shards.push(ShardReport { file, tensors: shard.len(), bytes });
    }
    let index = json!({ "metadata": { "total_size": report.total_bytes }, "weight_map": weight_map });
    let index_path = dir.join(INDEX_FILE);
    let index_text = serde_json::to_string_pretty(&index).map_err(|e| KernelError::InvalidInput(e.to_string()))?;
    std::fs::write(&index_path, index_text + "\n").map_err(|e| file_err(&index_path, e))?;
    Ok(report)
}

/// Writes every shard, one worker per available core taking the next unwritten shard; returns
/// each shard's data bytes in shard order, or the first error in shard order.
fn write_shards_in_parallel(
    synth: &SyntheticWeights,
    shards: &[Vec<Placed<'_>>],
    files: &[String],
    dir: &Path,
) -> Result<Vec<u64>> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, shards.len().max(1));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = || {
        let mut done = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(shard) = shards.get(i) else { break };
            let result = write_shard(synth, shard, &dir.join(&files[i]));
            failed.fetch_or(result.is_err(), Ordering::Relaxed);
            done.push((i, result));
        }
        done
    };
    let mut results: Vec<(usize, Result<u64>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers).map(|_| scope.spawn(work)).collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![(usize::MAX, Err(KernelError::InvalidInput("a shard writer thread panicked".into())))]
                })
            })
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    let bytes: Vec<u64> = results.into_iter().map(|(_, r)| r).collect::<Result<_>>()?;
    if bytes.len() != shards.len() {
        return Err(KernelError::InvalidInput(format!("wrote {} of {} shards", bytes.len(), shards.len())));
    }
    Ok(bytes)
}

/// Splits the tensors, in checkpoint order, into shards of at most `max_bytes` of data. Units
/// are single tensors, except that an expert's tensors form one unit.
fn plan_shards(synth: &SyntheticWeights, max_bytes: u64) -> Vec<Vec<Placed<'_>>> {
    let mut units: Vec<Vec<Placed<'_>>> = Vec::new();
    let mut last_expert: Option<&str> = None;
    for spec in &synth.specs {
        let shape = synth.stored_shape(spec);
        let bytes = (shape.iter().product::<usize>() * spec.dtype.size()) as u64;
        let expert = expert_prefix(&spec.name);
        let placed = Placed { spec, shape, bytes };
        match units.last_mut() {
            Some(unit) if expert.is_some() && expert == last_expert => unit.push(placed),
            _ => units.push(vec![placed]),
        }
        last_expert = expert;
    }
    let mut shards: Vec<Vec<Placed<'_>>> = Vec::new();
    let mut current_bytes = 0u64;
    for unit in units {
        let unit_bytes: u64 = unit.iter().map(|p| p.bytes).sum();
        match shards.last_mut() {
            Some(shard) if !shard.is_empty() && current_bytes + unit_bytes <= max_bytes => {
                shard.extend(unit);
                current_bytes += unit_bytes;
            }
            _ => {
                shards.push(unit);
                current_bytes = unit_bytes;
            }
        }
    }
    shards
}

/// `model.layers.{l}.block_sparse_moe.experts.{e}` for a routed expert's tensor, else None.
fn expert_prefix(name: &str) -> Option<&str> {
    const MARK: &str = ".experts.";
    let at = name.find(MARK)? + MARK.len();
    let end = name[at..].find('.').map_or(name.len(), |i| at + i);
    Some(&name[..end])
}

/// Writes one shard: the safetensors header (8-byte length, JSON padded with spaces to a multiple
/// of 8), then the data, widest dtype first so every tensor stays aligned to its element size.
/// Returns the data bytes written.
fn write_shard(synth: &SyntheticWeights, shard: &[Placed<'_>], path: &Path) -> Result<u64> {
    let file_err = |e: std::io::Error| KernelError::CheckpointFile { path: path.to_path_buf(), reason: e.to_string() };
    let mut order: Vec<&Placed<'_>> = shard.iter().collect();
    order.sort_by_key(|p| std::cmp::Reverse(p.spec.dtype.size()));

    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for p in &order {
        header.insert(
            format!("{TEXT_PREFIX}{}", p.spec.name),
            json!({ "dtype": p.spec.dtype.name(), "shape": p.shape, "data_offsets": [offset, offset + p.bytes] }),
        );
        offset += p.bytes;
    }
    let mut header_bytes =
        serde_json::to_vec(&Value::Object(header)).map_err(|e| KernelError::InvalidInput(e.to_string()))?;
    header_bytes.resize(header_bytes.len().next_multiple_of(8), b' ');

    let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(file_err)?);
    out.write_all(&(header_bytes.len() as u64).to_le_bytes()).map_err(file_err)?;
    out.write_all(&header_bytes).map_err(file_err)?;
    for p in &order {
        let mut written = 0u64;
        synth.generate(p.spec, &mut |chunk| {
            written += chunk.len() as u64;
            out.write_all(chunk).map_err(file_err)
        })?;
        if written != p.bytes {
            return Err(KernelError::InvalidInput(format!(
                "synthetic tensor `{}` produced {written} bytes, its header says {}",
                p.spec.name, p.bytes
            )));
        }
    }
    out.flush().map_err(file_err)?;
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExpertFormat;
    use crate::mxfp4;

    /// k3-tiny with a 4096-token vocabulary, so the embedding stays small in unit tests.
    fn tiny() -> ModelConfig {
        let mut cfg = ModelConfig::preset("k3-tiny").unwrap();
        (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) = (4096, 4000, 4001, 4095);
        cfg
    }

    fn spec_named<'a>(s: &'a SyntheticWeights, name: &str) -> &'a ExpectedTensor {
        s.model_spec(name).unwrap()
    }

    fn mean_std(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / n;
        let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn every_model_tensor_has_an_init_and_its_stored_shape() {
        let s = SyntheticWeights::new(tiny(), 7);
        for spec in &s.specs {
            let shape = s.stored_shape(spec);
            s.init(spec, &shape).unwrap();
            spec.check(spec.dtype, &shape).unwrap();
        }
        let a_log = spec_named(&s, "model.layers.0.self_attn.A_log");
        assert_eq!(s.stored_shape(a_log), vec![32], "A_log stores head_dim (32) >= num_heads (4) entries");
    }

    #[test]
    fn linear_norm_and_head_statistics() {
        let cfg = tiny();
        let s = SyntheticWeights::new(cfg.clone(), 1);
        let q = s.tensor(spec_named(&s, "model.layers.0.self_attn.q_proj.weight")).unwrap().to_f32().unwrap();
        let (m, sd) = mean_std(&q);
        assert!(m.abs() < 0.01 && (sd * (cfg.hidden_size as f64).sqrt() - 1.0).abs() < 0.05, "q_proj {m} {sd}");
        let norm = s.tensor(spec_named(&s, "model.layers.0.input_layernorm.weight")).unwrap().to_f32().unwrap();
        let (m, sd) = mean_std(&norm);
        assert!((m - 1.0).abs() < 0.02 && (sd - NORM_JITTER_STD).abs() < 0.02, "norm {m} {sd}");
        let head = s.tensor(spec_named(&s, "lm_head.weight")).unwrap().to_f32().unwrap();
        let (_, sd) = mean_std(&head);
        assert!((sd * (cfg.hidden_size as f64).sqrt() / LM_HEAD_GAIN - 1.0).abs() < 0.01, "lm_head {sd}");
        assert!(head.iter().all(|v| *v == crate::tensor::round_bf16(*v)));
    }

    #[test]
    fn kda_parameters_lie_in_their_ranges() {
        let s = SyntheticWeights::new(tiny(), 2);
        let a_log = s.tensor(spec_named(&s, "model.layers.1.self_attn.A_log")).unwrap().to_f32().unwrap();
        assert!(a_log.iter().all(|v| *v >= 0.0 && *v <= 16f32.ln()));
        let dt_bias = s.tensor(spec_named(&s, "model.layers.1.self_attn.dt_bias")).unwrap().to_f32().unwrap();
        for b in dt_bias {
            let dt = (b as f64).exp().ln_1p(); // softplus inverts the stored inverse softplus
            assert!(dt > 0.00099 && dt < 0.1001, "dt {dt}");
        }
    }

    #[test]
    fn mxfp4_experts_dequantise_near_the_fan_in_std() {
        let cfg = tiny();
        let s = SyntheticWeights::new(cfg.clone(), 3);
        let get = |n: &str| s.tensor(spec_named(&s, n)).unwrap();
        let base = "model.layers.1.block_sparse_moe.experts.5.w2";
        let (packed, scales) = (get(&format!("{base}.weight_packed")), get(&format!("{base}.weight_scale")));
        let (rows, cols) = (cfg.moe.latent_dim, cfg.moe.expert_dim);
        let w = mxfp4::dequant(rows, cols, packed.bytes(), scales.bytes()).unwrap();
        let (_, sd) = mean_std(&w);
        let ratio = sd * (cols as f64).sqrt();
        assert!(ratio > 0.5 && ratio < 2.0, "dequantised std is {ratio} / sqrt(in)");
        let distinct: std::collections::BTreeSet<u8> = scales.bytes().iter().copied().collect();
        assert_eq!(distinct.len(), 3, "scale jitter of ±1 gives three bytes: {distinct:?}");
    }

    #[test]
    fn bf16_experts_use_the_fan_in_std() {
        let mut cfg = tiny();
        cfg.moe.expert_format = ExpertFormat::Bf16;
        let s = SyntheticWeights::new(cfg.clone(), 4);
        let w1 = s.tensor(spec_named(&s, "model.layers.2.block_sparse_moe.experts.0.w1.weight")).unwrap();
        assert_eq!(w1.shape, vec![cfg.moe.expert_dim, cfg.moe.latent_dim]);
        let (_, sd) = mean_std(&w1.to_f32().unwrap());
        assert!((sd * (cfg.moe.latent_dim as f64).sqrt() - 1.0).abs() < 0.1, "{sd}");
    }

    #[test]
    fn parallel_generation_equals_the_sequential_stream() {
        // Every tensor of k3-tiny (every init kind), cut into segments that do not divide the
        // tensors (so tails are odd-sized), and the embedding over several default segments.
        let s = SyntheticWeights::new(tiny(), 9);
        let sequential = |spec: &ExpectedTensor| {
            let mut v = Vec::new();
            s.generate(spec, &mut |c| {
                v.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
            v
        };
        let mut kinds = std::collections::BTreeSet::new();
        for spec in s.specs.iter().filter(|p| !p.name.contains("embed") && !p.name.starts_with("lm_head")) {
            kinds.insert(
                format!("{:?}", s.init(spec, &s.stored_shape(spec)).unwrap())
                    .split([' ', '{'])
                    .next()
                    .unwrap()
                    .to_string(),
            );
            assert_eq!(s.generate_parallel(spec, 12).unwrap(), sequential(spec), "{}", spec.name);
        }
        assert_eq!(kinds.len(), 5, "every init kind is covered: {kinds:?}");
        let mut cfg = tiny();
        cfg.vocab_size = 3 * SEGMENT / cfg.hidden_size + 3;
        let big = SyntheticWeights::new(cfg, 9);
        let embed = spec_named(&big, "model.embed_tokens.weight");
        let whole = big.tensor(embed).unwrap();
        let mut v = Vec::new();
        big.generate(embed, &mut |c| {
            v.extend_from_slice(c);
            Ok(())
        })
        .unwrap();
        assert_eq!(whole.bytes(), &v[..]);
    }

    #[test]
    fn generation_is_independent_of_chunking_and_prefix() {
        let s = SyntheticWeights::new(tiny(), 5);
        let spec = spec_named(&s, "model.embed_tokens.weight");
        let whole = s.tensor(spec).unwrap();
        assert!(whole.bytes().len() > 2 * CHUNK, "the embedding spans several chunks");
        let prefixed = ExpectedTensor { name: format!("{TEXT_PREFIX}{}", spec.name), ..spec.clone() };
        assert_eq!(s.tensor(&prefixed).unwrap().bytes(), whole.bytes());
        assert_eq!(stream_seed(5, "lm_head.weight"), stream_seed(5, "language_model.lm_head.weight"));
        assert_ne!(stream_seed(5, "lm_head.weight"), stream_seed(6, "lm_head.weight"));
    }

    #[test]
    fn unknown_or_misshapen_requests_are_errors() {
        let s = SyntheticWeights::new(tiny(), 6);
        let missing = ExpectedTensor::exact("model.layers.99.input_layernorm.weight", &[128], DType::Bf16);
        assert!(matches!(s.tensor(&missing), Err(KernelError::MissingTensor { .. })));
        let wrong = ExpectedTensor::exact("model.norm.weight", &[64], DType::Bf16);
        assert!(matches!(s.tensor(&wrong), Err(KernelError::TensorMismatch { .. })));
    }

    #[test]
    fn shard_plan_keeps_experts_whole_and_respects_the_limit() {
        let s = SyntheticWeights::new(tiny(), 0);
        let limit = 300_000;
        let shards = plan_shards(&s, limit);
        assert!(shards.len() > 3);
        let mut seen = std::collections::HashMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let bytes: u64 = shard.iter().map(|p| p.bytes).sum();
            assert!(bytes <= limit || shard.len() == 1, "shard {i} holds {bytes} bytes in {} tensors", shard.len());
            for p in shard {
                if let Some(e) = expert_prefix(&p.spec.name) {
                    assert_eq!(*seen.entry(e.to_string()).or_insert(i), i, "{e} is split");
                }
            }
        }
        assert_eq!(shards.iter().map(Vec::len).sum::<usize>(), s.specs.len());
        assert_eq!(
            expert_prefix("model.layers.3.block_sparse_moe.experts.12.w1.weight_packed"),
            Some("model.layers.3.block_sparse_moe.experts.12")
        );
        assert_eq!(expert_prefix("model.layers.3.block_sparse_moe.shared_experts.up_proj.weight"), None);
    }
}
