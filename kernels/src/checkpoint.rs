//! A K3 checkpoint on disk: `config.json` plus safetensors shards, memory-mapped.
//!
//! Layout (shared/reference/k3-architecture.md §7): either one `model.safetensors`, or
//! `model.safetensors.index.json` whose `weight_map` maps each tensor name to a shard file in the
//! same folder. Names may carry the multimodal wrapper's `language_model.` prefix or not; both are
//! found under the bare name the schema uses. When both layouts are present the single file wins,
//! as in Hugging Face transformers.
//!
//! Invariants, established by [`Checkpoint::open`]:
//! - every shard the index names exists, is mapped, and its safetensors header is valid and covers
//!   the file exactly (a truncated or padded shard is refused);
//! - every tensor the index lists is present in the shard it points at;
//! - every recorded byte range lies inside its shard's mapping.
//!
//! So [`WeightSource::tensor`] only has to compare names, dtypes and shapes, and the tensors it
//! returns borrow the mapping without copying. Errors name the file or the tensor; nothing panics.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Map, Value};

use crate::config::ModelConfig;
use crate::error::{KernelError, Result};
use crate::schema::{model_tensors, TEXT_PREFIX};
use crate::tensor::{DType, ExpectedTensor, HostTensor, WeightSource};

/// The config file of a checkpoint folder.
pub const CONFIG_FILE: &str = "config.json";
/// The single-file weights of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor's bytes are.
#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the shard's mapping.
    start: usize,
    end: usize,
}

/// One mapped shard file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
}

/// An opened checkpoint: its config and the location of every tensor.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    /// Keyed by the name without the `language_model.` prefix.
    entries: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: parses `config.json`, maps every shard and reads its header.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let config = ModelConfig::from_file(&dir.join(CONFIG_FILE))?;
        let mut ckpt = Checkpoint { dir: dir.to_path_buf(), config, shards: Vec::new(), entries: HashMap::new() };
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            ckpt.add_single_file(&single)?;
        } else if index.is_file() {
            ckpt.add_indexed_shards(&index)?;
        } else {
            return Err(KernelError::CheckpointFile {
                path: dir.to_path_buf(),
                reason: format!("neither {SINGLE_FILE} nor {INDEX_FILE} is present"),
            });
        }
        Ok(ckpt)
    }

    /// The model config read from `config.json`.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The number of tensors the checkpoint holds.
    pub fn num_tensors(&self) -> usize {
        self.entries.len()
    }

    /// The paths of the mapped shard files, in the order they were first named.
    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// True when a tensor of this name (with or without the `language_model.` prefix) is stored.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(strip_prefix(name))
    }

    /// Checks every tensor the config implies (names, dtypes, shapes); the first problem wins.
    pub fn verify(&self) -> Result<()> {
        for spec in model_tensors(&self.config) {
            self.tensor(&spec)?;
        }
        Ok(())
    }

    fn add_single_file(&mut self, path: &Path) -> Result<()> {
        let shard = self.map_shard(path)?;
        let (data_start, metadata) = read_header(&self.shards[shard])?;
        for (name, info) in metadata.tensors() {
            self.insert(path, &name, entry(shard, data_start, info))?;
        }
        Ok(())
    }

    fn add_indexed_shards(&mut self, index_path: &Path) -> Result<()> {
        let weight_map = read_weight_map(index_path)?;
        // Shard file name → (shard number, data start, parsed header).
        let mut opened: HashMap<String, (usize, usize, safetensors::tensor::Metadata)> = HashMap::new();
        for (name, file) in weight_map {
            if !opened.contains_key(&file) {
                let shard = self.map_shard(&self.dir.join(&file))?;
                let (data_start, metadata) = read_header(&self.shards[shard])?;
                opened.insert(file.clone(), (shard, data_start, metadata));
            }
            let (shard, data_start, metadata) = &opened[&file];
            let info = metadata.info(&name).ok_or_else(|| KernelError::CheckpointFile {
                path: self.shards[*shard].path.clone(),
                reason: format!("{INDEX_FILE} places tensor `{name}` in this shard, but the shard does not hold it"),
            })?;
            self.insert(index_path, &name, entry(*shard, *data_start, info))?;
        }
        Ok(())
    }

    fn insert(&mut self, listed_in: &Path, stored_name: &str, entry: Entry) -> Result<()> {
        let key = strip_prefix(stored_name).to_string();
        if self.entries.insert(key, entry).is_some() {
            return Err(KernelError::CheckpointFile {
                path: listed_in.to_path_buf(),
                reason: format!("tensor `{stored_name}` is stored twice (with and without `{TEXT_PREFIX}`)"),
            });
        }
        Ok(())
    }

    fn map_shard(&mut self, path: &Path) -> Result<usize> {
        let file_err = |reason: String| KernelError::CheckpointFile { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(|e| file_err(e.to_string()))?;
        // SAFETY: the mapping is read-only. sparkd relies on checkpoint files not being truncated or
        // rewritten while it runs (the usual contract of memory-mapped weights); every byte range
        // handed out is checked against the mapping's length when the header is parsed.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| file_err(format!("cannot memory-map: {e}")))?;
        self.shards.push(Shard { path: path.to_path_buf(), map: Arc::new(map) });
        Ok(self.shards.len() - 1)
    }
}

impl WeightSource for Checkpoint {
    fn tensor(&self, spec: &ExpectedTensor) -> Result<HostTensor> {
        let entry = self
            .entries
            .get(strip_prefix(&spec.name))
            .ok_or_else(|| KernelError::MissingTensor { name: spec.name.clone() })?;
        let dtype = checked_dtype(spec, entry.dtype, &entry.shape)?;
        let shard = &self.shards[entry.shard];
        Ok(HostTensor::mapped(dtype, entry.shape.clone(), Arc::clone(&shard.map), entry.start, entry.end))
    }
}

/// The name without the `language_model.` prefix.
/// The host dtype of a stored tensor, checked against what `spec` expects (dtype and shape); a dtype sparkd
/// never stores (anything but BF16, F32, U8) is a mismatch naming the tensor.
pub(crate) fn checked_dtype(spec: &ExpectedTensor, stored: Dtype, shape: &[usize]) -> Result<DType> {
    let dtype = match stored {
        Dtype::BF16 => DType::Bf16,
        Dtype::F32 => DType::F32,
        Dtype::U8 => DType::U8,
        other => {
            return Err(KernelError::TensorMismatch {
                name: spec.name.clone(),
                expected: format!("{} {}", spec.dtype.name(), spec.shape),
                found: format!("{other:?} {shape:?}"),
            })
        }
    };
    spec.check(dtype, shape)?;
    Ok(dtype)
}

fn strip_prefix(name: &str) -> &str {
    name.strip_prefix(TEXT_PREFIX).unwrap_or(name)
}

fn entry(shard: usize, data_start: usize, info: &safetensors::tensor::TensorInfo) -> Entry {
    let (begin, end) = info.data_offsets;
    Entry { shard, dtype: info.dtype, shape: info.shape.clone(), start: data_start + begin, end: data_start + end }
}

/// Parses a shard's header; returns where its data section starts and the tensor table.
/// `read_metadata` checks that the offsets are contiguous, match each dtype and shape, and end
/// exactly at the end of the file, so every range is inside the mapping.
fn read_header(shard: &Shard) -> Result<(usize, safetensors::tensor::Metadata)> {
    let (header_len, metadata) = SafeTensors::read_metadata(&shard.map).map_err(|e| KernelError::CheckpointFile {
        path: shard.path.clone(),
        reason: format!("not a valid safetensors file (truncated or corrupt): {e}"),
    })?;
    Ok((8 + header_len, metadata))
}

/// Reads `weight_map` (tensor name → shard file) from an index file.
fn read_weight_map(path: &Path) -> Result<Vec<(String, String)>> {
    let file_err = |reason: String| KernelError::CheckpointFile { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?;
    let root: Value = serde_json::from_str(&text).map_err(|e| file_err(format!("invalid JSON: {e}")))?;
    let map = root
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| file_err("`weight_map` is missing or not an object".into()))?;
    let mut out = Vec::with_capacity(map.len());
    for (name, file) in map {
        let file =
            file.as_str().ok_or_else(|| file_err(format!("`weight_map.{name}` is not a string: {file}")))?.to_string();
        // Shards live beside the index: a plain file name, never a path out of the folder.
        if file.is_empty() || file.contains(['/', '\\']) || file == "." || file == ".." {
            return Err(file_err(format!("`weight_map.{name}` names `{file}`, which is not a plain file name")));
        }
        out.push((name.clone(), file));
    }
    Ok(out)
}

/// Writes `specs` from `source` into one safetensors file, names prefixed by `prefix`, wider dtypes first (so
/// every tensor stays aligned to its element size); returns the tensor data bytes.
pub(crate) fn write_single_file(
    path: &Path,
    source: &dyn WeightSource,
    specs: &[ExpectedTensor],
    prefix: &str,
) -> Result<u64> {
    let file_err = |e: std::io::Error| KernelError::CheckpointFile { path: PathBuf::from(path), reason: e.to_string() };
    let mut order: Vec<&ExpectedTensor> = specs.iter().collect();
    order.sort_by_key(|s| std::cmp::Reverse(s.dtype.size()));
    let tensors = order.iter().map(|spec| source.tensor(spec)).collect::<Result<Vec<HostTensor>>>()?;
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for (spec, t) in order.iter().zip(&tensors) {
        let bytes = t.bytes().len() as u64;
        header.insert(
            format!("{prefix}{}", spec.name),
            json!({ "dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, offset + bytes] }),
        );
        offset += bytes;
    }
    let mut header_bytes =
        serde_json::to_vec(&Value::Object(header)).map_err(|e| KernelError::InvalidInput(e.to_string()))?;
    header_bytes.resize(header_bytes.len().next_multiple_of(8), b' ');
    let mut out = BufWriter::new(std::fs::File::create(path).map_err(file_err)?);
    out.write_all(&(header_bytes.len() as u64).to_le_bytes()).map_err(file_err)?;
    out.write_all(&header_bytes).map_err(file_err)?;
    for t in &tensors {
        out.write_all(t.bytes()).map_err(file_err)?;
    }
    out.flush().map_err(file_err)?;
    Ok(offset)
}
