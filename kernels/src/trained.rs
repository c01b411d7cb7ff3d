//! The trained k3-tiny and its DSpark drafter, the embedded default model: weights trained on the Python
//! standard library by `kernels/reference/train_k3_tiny.py`, shipped compact and expanded into the real K3
//! layout in memory, so the loaders under test are the real ones.
//!
//! The shipped form (`kernels/assets/k3-tiny-trained.safetensors.xz`, format [`FORMAT`]) is one xz-compressed
//! safetensors file:
//! - `__metadata__`: `format`, `target_preset` (the target config is exactly that preset), `drafter_config` (the
//!   drafter's `config.json` text) and `summary` (the training run's numbers, JSON).
//! - `kept_ids` I32 `[n_kept]`: ascending, unique, every token the corpus uses plus the special ids the model
//!   needs (BOS, EOS, pad, the drafter's mask token).
//! - The target's tensors under their real names (without `language_model.`), the drafter's under `drafter.`,
//!   each with the dtype and shape of the real layout, except the vocabulary-sized ones (the embedding,
//!   `lm_head` and the Markov head's `W1`, `W2`), stored `[n_kept + 1, width]`: row `i` is token `kept_ids[i]`,
//!   and the last row is the one row every token outside `kept_ids` shares.
//!
//! Invariants:
//! - Expansion is exact: row `t` of a vocabulary-sized tensor is the stored row of `t` if `t` is kept, else the
//!   shared row; the trainer ties the unseen tokens the same way, so the served model is the trained one (up
//!   to the bf16 and MXFP4 storage the trainer already accounts for).
//! - Every stored tensor is checked against the schema's name, dtype and shape when it is asked for; a bad
//!   artifact is an error naming the tensor, never a panic.
//! - The embedded artifact is decompressed once per process ([`TrainedModel::embedded`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::checkpoint::{write_single_file, CONFIG_FILE, SINGLE_FILE};
use crate::config::ModelConfig;
use crate::dspark::{drafter_tensors, DrafterConfig, DrafterSource, DRAFTER_DIR};
use crate::error::{KernelError, Result};
use crate::schema::{model_tensors, TEXT_PREFIX};
use crate::tensor::{DType, ExpectedTensor, HostTensor, WeightSource};

/// The name the daemon serves the trained model under (`--synthetic k3-tiny-trained`, the default).
pub const TRAINED_NAME: &str = "k3-tiny-trained";
/// The `format` metadata of the shipped artifact.
pub const FORMAT: &str = "sparkd-trained-v1";
/// Where the drafter's tensors live in the artifact.
const DRAFTER_PREFIX: &str = "drafter.";
/// The tensor of token ids with rows of their own.
const KEPT_IDS: &str = "kept_ids";

static EMBEDDED_XZ: &[u8] = include_bytes!("../assets/k3-tiny-trained.safetensors.xz");

/// One tensor's place in the decompressed artifact.
#[derive(Clone, Debug)]
struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The trained target and drafter, decompressed, with the map from token ids to stored rows.
#[derive(Debug)]
pub struct TrainedModel {
    config: ModelConfig,
    drafter: DrafterConfig,
    summary: Value,
    kept: Vec<u32>,
    /// Stored row of every token id: its index in `kept`, or `kept.len()` (the shared row).
    row_of: Vec<u32>,
    bytes: Vec<u8>,
    entries: HashMap<String, Entry>,
}

impl TrainedModel {
    /// The artifact built into this binary, decompressed on the first call.
    pub fn embedded() -> Result<Arc<TrainedModel>> {
        static MODEL: OnceLock<std::result::Result<Arc<TrainedModel>, String>> = OnceLock::new();
        MODEL
            .get_or_init(|| TrainedModel::from_xz(EMBEDDED_XZ).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| artifact_error(format!("the embedded artifact: {reason}")))
    }

    /// An artifact from its xz-compressed bytes.
    pub fn from_xz(compressed: &[u8]) -> Result<Self> {
        let mut bytes = Vec::new();
        lzma_rs::xz_decompress(&mut &compressed[..], &mut bytes)
            .map_err(|e| artifact_error(format!("not an xz stream: {e}")))?;
        Self::from_safetensors(bytes)
    }

    /// An artifact from its decompressed safetensors bytes.
    pub fn from_safetensors(bytes: Vec<u8>) -> Result<Self> {
        let (header_len, meta) =
            SafeTensors::read_metadata(&bytes).map_err(|e| artifact_error(format!("safetensors header: {e}")))?;
        let data_start = 8 + header_len;
        let text = |key: &str| -> Result<String> {
            meta.metadata()
                .as_ref()
                .and_then(|m| m.get(key))
                .cloned()
                .ok_or_else(|| artifact_error(format!("metadata `{key}` is missing")))
        };
        let format = text("format")?;
        if format != FORMAT {
            return Err(artifact_error(format!("format `{format}`, expected `{FORMAT}`")));
        }
        let config = ModelConfig::preset(&text("target_preset")?)?;
        let drafter = DrafterConfig::from_json(&text("drafter_config")?, &config)?;
        let summary: Value = serde_json::from_str(&text("summary")?)
            .map_err(|e| artifact_error(format!("metadata `summary` is not JSON: {e}")))?;
        let mut entries = HashMap::new();
        let mut kept = None;
        for (name, info) in meta.tensors() {
            let (start, end) = (data_start + info.data_offsets.0, data_start + info.data_offsets.1);
            if end > bytes.len() || start > end {
                return Err(artifact_error(format!("tensor `{name}` lies outside the file")));
            }
            let dtype = match info.dtype {
                Dtype::BF16 => DType::Bf16,
                Dtype::F32 => DType::F32,
                Dtype::U8 => DType::U8,
                Dtype::I32 if name == KEPT_IDS => {
                    kept = Some(kept_ids(&bytes[start..end], &info.shape, config.vocab_size)?);
                    continue;
                }
                other => return Err(artifact_error(format!("tensor `{name}` has dtype {other:?}"))),
            };
            entries.insert(name, Entry { dtype, shape: info.shape.clone(), start, end });
        }
        let kept = kept.ok_or_else(|| artifact_error(format!("no I32 tensor `{KEPT_IDS}`")))?;
        let mut row_of = vec![kept.len() as u32; config.vocab_size];
        for (row, id) in kept.iter().enumerate() {
            row_of[*id as usize] = row as u32;
        }
        Ok(TrainedModel { config, drafter, summary, kept, row_of, bytes, entries })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn drafter_config(&self) -> &DrafterConfig {
        &self.drafter
    }

    /// The training run's numbers, as the trainer recorded them.
    pub fn summary(&self) -> &Value {
        &self.summary
    }

    /// The token ids with rows of their own, ascending.
    pub fn kept_ids(&self) -> &[u32] {
        &self.kept
    }

    /// The target's weights in the real layout.
    pub fn target(self: &Arc<Self>) -> TrainedWeights {
        TrainedWeights { model: Arc::clone(self), prefix: "" }
    }

    /// The drafter, for `Runner::attach_drafter`.
    pub fn drafter(self: &Arc<Self>) -> DrafterSource {
        let weights = TrainedWeights { model: Arc::clone(self), prefix: DRAFTER_PREFIX };
        DrafterSource { config: self.drafter.clone(), weights: Box::new(weights) }
    }

    /// Writes the expanded model as a checkpoint folder in the real layout (`config.json`, `model.safetensors`
    /// under `language_model.`) with the drafter in `drafter/`; returns the bytes of tensor data written.
    pub fn write_checkpoint(self: &Arc<Self>, dir: &Path) -> Result<u64> {
        let file_err = |path: &Path, e: std::io::Error| KernelError::CheckpointFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let drafter_dir = dir.join(DRAFTER_DIR);
        std::fs::create_dir_all(&drafter_dir).map_err(|e| file_err(&drafter_dir, e))?;
        let config_text = serde_json::to_string_pretty(&self.config.to_json())
            .map_err(|e| KernelError::InvalidInput(e.to_string()))?;
        let config_path = dir.join(CONFIG_FILE);
        std::fs::write(&config_path, config_text + "\n").map_err(|e| file_err(&config_path, e))?;
        let drafter_config_path = drafter_dir.join(CONFIG_FILE);
        std::fs::write(&drafter_config_path, self.drafter.to_json()? + "\n")
            .map_err(|e| file_err(&drafter_config_path, e))?;
        let target = self.target();
        let specs = model_tensors(&self.config);
        let target_bytes = write_single_file(&dir.join(SINGLE_FILE), &target, &specs, TEXT_PREFIX)?;
        let drafter = TrainedWeights { model: Arc::clone(self), prefix: DRAFTER_PREFIX };
        let drafter_specs = drafter_tensors(&self.drafter);
        let drafter_bytes = write_single_file(&drafter_dir.join(SINGLE_FILE), &drafter, &drafter_specs, "")?;
        Ok(target_bytes + drafter_bytes)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| KernelError::MissingTensor { name: name.to_string() })
    }

    /// The stored tensor `stored` checked against `spec`, vocabulary-sized tensors expanded to every id.
    fn tensor(&self, stored: &str, spec: &ExpectedTensor) -> Result<HostTensor> {
        let entry = self.entry(stored)?;
        let data = &self.bytes[entry.start..entry.end];
        let compact = self.kept.len() + 1;
        let expected = spec.shape.canonical();
        let is_vocab = expected.len() == 2 && expected[0] == self.config.vocab_size;
        if !is_vocab {
            spec.check(entry.dtype, &entry.shape)?;
            return HostTensor::owned(entry.dtype, entry.shape.clone(), data.to_vec());
        }
        if entry.dtype != spec.dtype || entry.shape != [compact, expected[1]] {
            return Err(KernelError::TensorMismatch {
                name: stored.to_string(),
                expected: format!(
                    "{} [{compact}, {}] (the kept rows and the shared row)",
                    spec.dtype.name(),
                    expected[1]
                ),
                found: format!("{} {:?}", entry.dtype.name(), entry.shape),
            });
        }
        let row_bytes = expected[1] * entry.dtype.size();
        let mut full = Vec::with_capacity(self.config.vocab_size * row_bytes);
        for row in &self.row_of {
            let at = *row as usize * row_bytes;
            full.extend_from_slice(&data[at..at + row_bytes]);
        }
        HostTensor::owned(entry.dtype, expected, full)
    }
}

/// The target's (prefix `""`) or the drafter's (prefix `drafter.`) weights of a [`TrainedModel`].
pub struct TrainedWeights {
    model: Arc<TrainedModel>,
    prefix: &'static str,
}

impl WeightSource for TrainedWeights {
    fn tensor(&self, spec: &ExpectedTensor) -> Result<HostTensor> {
        let bare = spec.name.strip_prefix(TEXT_PREFIX).unwrap_or(&spec.name);
        self.model.tensor(&format!("{}{bare}", self.prefix), spec)
    }
}

/// `kept_ids`: an ascending, unique I32 vector of ids below the vocabulary.
fn kept_ids(data: &[u8], shape: &[usize], vocab: usize) -> Result<Vec<u32>> {
    if shape.len() != 1 || shape[0] == 0 {
        return Err(artifact_error(format!("`{KEPT_IDS}` has shape {shape:?}, expected one non-empty dimension")));
    }
    let ids: Vec<i64> = data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect();
    let ascending = ids.windows(2).all(|w| w[0] < w[1]);
    if !ascending || !ids.iter().all(|id| (0..vocab as i64).contains(id)) {
        return Err(artifact_error(format!("`{KEPT_IDS}` must be ascending, unique ids below {vocab}")));
    }
    Ok(ids.into_iter().map(|id| id as u32).collect())
}

fn artifact_error(reason: String) -> KernelError {
    KernelError::CheckpointFile { path: PathBuf::from(TRAINED_NAME), reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::cpu::CpuRunner;
    use crate::dspark::SyntheticDrafterWeights;
    use crate::synth::SyntheticWeights;

    /// A tensor of the hand-built artifact: name, safetensors dtype, shape, bytes.
    type Stored = (String, &'static str, Vec<usize>, Vec<u8>);

    /// The compact form of a vocabulary-sized tensor: the kept rows of `full`, then `full`'s row `shared`.
    fn compact(full: &HostTensor, kept: &[u32], shared: usize) -> (Vec<usize>, Vec<u8>) {
        let row = full.bytes().len() / full.shape[0];
        let mut out = Vec::new();
        for id in kept.iter().map(|i| *i as usize).chain([shared]) {
            out.extend_from_slice(&full.bytes()[id * row..(id + 1) * row]);
        }
        (vec![kept.len() + 1, full.shape[1]], out)
    }

    /// An artifact holding seeded synthetic weights of k3-tiny and its preset drafter, compacted to `kept`.
    fn artifact(kept: &[u32], shared: usize, format: &str) -> Vec<u8> {
        artifact_listing(kept, kept, shared, format)
    }

    /// [`artifact`] whose `kept_ids` tensor holds `listed`, its vocabulary rows those of `kept`.
    fn artifact_listing(listed: &[u32], kept: &[u32], shared: usize, format: &str) -> Vec<u8> {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let drafter = DrafterConfig::for_target("k3-tiny", &cfg).unwrap();
        let target = SyntheticWeights::new(cfg.clone(), 3);
        let draft = SyntheticDrafterWeights::new(drafter.clone(), 4);
        let mut stored: Vec<Stored> = vec![(
            KEPT_IDS.into(),
            "I32",
            vec![listed.len()],
            listed.iter().flat_map(|i| (*i as i32).to_le_bytes()).collect(),
        )];
        let sources: [(&dyn WeightSource, Vec<ExpectedTensor>, &str); 2] =
            [(&target, model_tensors(&cfg), ""), (&draft, drafter_tensors(&drafter), DRAFTER_PREFIX)];
        for (source, specs, prefix) in sources {
            for spec in specs {
                let t = source.tensor(&spec).unwrap();
                let (shape, bytes) = if t.shape.len() == 2 && t.shape[0] == cfg.vocab_size {
                    compact(&t, kept, shared)
                } else {
                    (t.shape.clone(), t.bytes().to_vec())
                };
                let bare = spec.name.strip_prefix(TEXT_PREFIX).unwrap_or(&spec.name);
                stored.push((format!("{prefix}{bare}"), t.dtype.name(), shape, bytes));
            }
        }
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({
                "format": format,
                "target_preset": "k3-tiny",
                "drafter_config": drafter.to_json().unwrap(),
                "summary": "{\"steps\": 1}",
            }),
        );
        let mut offset = 0;
        for (name, dtype, shape, bytes) in &stored {
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
            );
            offset += bytes.len();
        }
        let mut head = serde_json::to_vec(&Value::Object(header)).unwrap();
        head.resize(head.len().next_multiple_of(8), b' ');
        let mut out = (head.len() as u64).to_le_bytes().to_vec();
        out.extend(head);
        for (_, _, _, bytes) in stored {
            out.extend(bytes);
        }
        out
    }

    fn kept() -> Vec<u32> {
        let mut ids: Vec<u32> = (0..5000).map(|i| i * 7 + 1).collect();
        ids.extend([163_584, 163_586, 163_838, 163_839]);
        ids
    }

    fn xz(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        lzma_rs::xz_compress(&mut &bytes[..], &mut out).unwrap();
        out
    }

    #[test]
    fn vocabulary_rows_expand_to_their_token_or_the_shared_row() {
        let kept = kept();
        let model = Arc::new(TrainedModel::from_xz(&xz(&artifact(&kept, 2, FORMAT))).unwrap());
        assert_eq!(model.kept_ids(), kept.as_slice());
        assert_eq!(model.summary()["steps"], 1);
        let cfg = model.config().clone();
        let synthetic = SyntheticWeights::new(cfg.clone(), 3);
        for name in ["model.embed_tokens.weight", "lm_head.weight"] {
            let spec = model_tensors(&cfg).into_iter().find(|s| s.name == name).unwrap();
            let full = synthetic.tensor(&spec).unwrap();
            let expanded = model.target().tensor(&spec).unwrap();
            assert_eq!(expanded.shape, full.shape);
            let row = full.bytes().len() / cfg.vocab_size;
            let of = |t: &HostTensor, id: usize| t.bytes()[id * row..(id + 1) * row].to_vec();
            for id in [1usize, 8, 34_994, 163_586, 163_839] {
                assert_eq!(of(&expanded, id), of(&full, id), "{name} row {id} is its own");
            }
            for id in [0usize, 2, 50_000, 163_585] {
                assert_eq!(of(&expanded, id), of(&full, 2), "{name} row {id} is the shared row");
            }
        }
    }

    #[test]
    fn the_written_checkpoint_is_the_real_layout_with_the_same_bytes() {
        let model = Arc::new(TrainedModel::from_safetensors(artifact(&kept(), 2, FORMAT)).unwrap());
        let dir = tempfile::tempdir().unwrap();
        model.write_checkpoint(dir.path()).unwrap();
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(checkpoint.config(), model.config());
        for spec in model_tensors(model.config()) {
            let ours = model.target().tensor(&spec).unwrap();
            assert_eq!(checkpoint.tensor(&spec).unwrap().bytes(), ours.bytes(), "{}", spec.name);
        }
        let drafter = DrafterSource::checkpoint(&dir.path().join(DRAFTER_DIR), model.config()).unwrap();
        assert_eq!(&drafter.config, model.drafter_config());
        for spec in drafter_tensors(model.drafter_config()) {
            let ours = model.drafter().weights.tensor(&spec).unwrap();
            assert_eq!(drafter.weights.tensor(&spec).unwrap().bytes(), ours.bytes(), "drafter {}", spec.name);
        }
        // The real loader takes the folder.
        CpuRunner::new(checkpoint.config().clone(), &checkpoint).unwrap();
    }

    #[test]
    fn a_bad_artifact_is_an_error_naming_what_is_wrong() {
        let err = |r: Result<TrainedModel>| r.unwrap_err().to_string();
        assert!(err(TrainedModel::from_xz(b"not xz")).contains("not an xz stream"));
        assert!(err(TrainedModel::from_safetensors(artifact(&kept(), 2, "other"))).contains("format `other`"));
        let mut unsorted = kept();
        unsorted.swap(0, 1);
        assert!(err(TrainedModel::from_safetensors(artifact(&unsorted, 2, FORMAT))).contains("ascending"));
        let mut beyond = kept();
        beyond.push(200_000);
        assert!(
            err(TrainedModel::from_safetensors(artifact_listing(&beyond, &kept(), 2, FORMAT))).contains("below 163840")
        );
        let mut truncated = artifact(&kept(), 2, FORMAT);
        truncated.truncate(truncated.len() - 100);
        assert!(err(TrainedModel::from_safetensors(truncated)).contains("safetensors header"));
    }

    #[test]
    fn a_vocabulary_tensor_with_the_wrong_row_count_names_the_tensor() {
        // Rows for every kept id and the shared row, but `kept_ids` lists one id fewer.
        let rows = kept();
        let model = Arc::new(TrainedModel::from_safetensors(artifact_listing(&rows[1..], &rows, 2, FORMAT)).unwrap());
        let spec = model_tensors(model.config()).into_iter().find(|s| s.name == "lm_head.weight").unwrap();
        let e = model.target().tensor(&spec).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight") && e.contains("[5004, 128]") && e.contains("[5005, 128]"), "{e}");
    }

    #[test]
    fn the_trainers_config_is_the_k3_tiny_preset() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("reference/k3-tiny.config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let cfg = ModelConfig::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(cfg, ModelConfig::preset("k3-tiny").unwrap(), "regenerate it with `sparkd synth --config k3-tiny`");
    }

    #[test]
    fn the_embedded_model_loads_with_its_drafter() {
        let model = TrainedModel::embedded().unwrap();
        assert_eq!(model.config(), &ModelConfig::preset("k3-tiny").unwrap());
        assert!(model.kept_ids().len() > 10_000, "{} kept ids", model.kept_ids().len());
        assert!(model.summary()["target"]["held_ppl_served"].as_f64().is_some_and(|p| p < 100.0));
        CpuRunner::new(model.config().clone(), &model.target()).unwrap();
    }
}
