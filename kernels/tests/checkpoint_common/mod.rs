//! Helpers shared by the checkpoint tests: a small config and in-place edits of written
//! checkpoints (safetensors headers and the shard index), used to build malformed or
//! differently-named checkpoints from a good one.

use std::path::Path;

use serde_json::{Map, Value};
use sparkd_kernels::checkpoint::INDEX_FILE;
use sparkd_kernels::ModelConfig;

/// k3-tiny with a 4096-token vocabulary: every feature of K3, but a checkpoint of a few MB.
pub fn small_config() -> ModelConfig {
    let mut cfg = ModelConfig::preset("k3-tiny").unwrap();
    (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) = (4096, 4000, 4001, 4095);
    cfg
}

/// Rewrites a safetensors file's JSON header with `edit`, keeping its data bytes.
pub fn rewrite_header(path: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

/// Rewrites the `weight_map` of the checkpoint's index with `edit`.
pub fn rewrite_weight_map(dir: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let path = dir.join(INDEX_FILE);
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(index["weight_map"].as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&index).unwrap()).unwrap();
}

/// The shard file the index places a (prefixed) tensor name in.
pub fn shard_of(dir: &Path, name: &str) -> String {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
    index["weight_map"][name].as_str().unwrap().to_string()
}
