//! Malformed checkpoints give the right `KernelError` variant, naming the file or the tensor,
//! and never a panic. Each test writes a small synthetic checkpoint and breaks one thing.

mod checkpoint_common;

use std::path::Path;

use checkpoint_common::{rewrite_header, rewrite_weight_map, shard_of, small_config};
use serde_json::{json, Value};
use sparkd_kernels::checkpoint::{Checkpoint, CONFIG_FILE, INDEX_FILE};
use sparkd_kernels::synth::write_checkpoint;
use sparkd_kernels::KernelError;

fn written() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&small_config(), 11, tmp.path(), 1 << 20).unwrap();
    tmp
}

/// Opens the checkpoint, expecting a `CheckpointFile` error; returns its path and reason.
fn file_error(dir: &Path) -> (std::path::PathBuf, String) {
    match Checkpoint::open(dir) {
        Err(KernelError::CheckpointFile { path, reason }) => (path, reason),
        other => panic!("expected a checkpoint-file error, got {other:?}"),
    }
}

/// Opens the checkpoint (which must succeed) and returns what `verify` says.
fn verify_error(dir: &Path) -> KernelError {
    let ckpt = Checkpoint::open(dir).unwrap();
    ckpt.verify().expect_err("verify must fail")
}

#[test]
fn missing_config() {
    let tmp = written();
    std::fs::remove_file(tmp.path().join(CONFIG_FILE)).unwrap();
    let (path, _) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(CONFIG_FILE));
}

#[test]
fn bad_json_in_config() {
    let tmp = written();
    std::fs::write(tmp.path().join(CONFIG_FILE), "{\"model_type\": \"kimi_k3\",").unwrap();
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(CONFIG_FILE));
    assert!(reason.contains("invalid JSON"), "{reason}");
}

#[test]
fn bad_json_in_index() {
    let tmp = written();
    std::fs::write(tmp.path().join(INDEX_FILE), "{\"weight_map\": {\"a\": ").unwrap();
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(INDEX_FILE));
    assert!(reason.contains("invalid JSON"), "{reason}");

    std::fs::write(tmp.path().join(INDEX_FILE), "{\"metadata\": {}}").unwrap();
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(INDEX_FILE));
    assert!(reason.contains("weight_map"), "{reason}");
}

#[test]
fn index_naming_a_missing_shard() {
    let tmp = written();
    let gone = "model-00099-of-00099.safetensors";
    rewrite_weight_map(tmp.path(), |m| {
        m.insert("language_model.model.norm.weight".into(), json!(gone));
    });
    let (path, _) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(gone));
}

#[test]
fn index_naming_a_path_outside_the_folder() {
    let tmp = written();
    rewrite_weight_map(tmp.path(), |m| {
        m.insert("language_model.model.norm.weight".into(), json!("../model-00001-of-00001.safetensors"));
    });
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(INDEX_FILE));
    assert!(reason.contains("not a plain file name"), "{reason}");
}

#[test]
fn index_listing_a_tensor_the_shard_lacks() {
    let tmp = written();
    let shard = shard_of(tmp.path(), "language_model.model.norm.weight");
    let ghost = "language_model.model.layers.0.self_attn.ghost.weight";
    rewrite_weight_map(tmp.path(), |m| {
        m.insert(ghost.into(), json!(shard));
    });
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(&shard));
    assert!(reason.contains(ghost), "{reason}");
}

#[test]
fn missing_tensor() {
    let tmp = written();
    rewrite_weight_map(tmp.path(), |m| {
        m.remove("language_model.model.layers.2.self_attn.b_proj.weight");
    });
    match verify_error(tmp.path()) {
        KernelError::MissingTensor { name } => assert_eq!(name, "model.layers.2.self_attn.b_proj.weight"),
        other => panic!("expected a missing tensor, got {other:?}"),
    }
}

/// Edits one tensor's header entry in its shard.
fn edit_entry(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) {
    let shard = dir.join(shard_of(dir, name));
    rewrite_header(&shard, |h| edit(h.get_mut(name).unwrap()));
}

fn mismatch(dir: &Path) -> (String, String, String) {
    match verify_error(dir) {
        KernelError::TensorMismatch { name, expected, found } => (name, expected, found),
        other => panic!("expected a tensor mismatch, got {other:?}"),
    }
}

#[test]
fn wrong_dtype() {
    // F16 has the size of BF16, so the file stays consistent: a dtype sparkd does not map.
    let tmp = written();
    edit_entry(tmp.path(), "language_model.model.norm.weight", |e| e["dtype"] = json!("F16"));
    let (name, expected, found) = mismatch(tmp.path());
    assert_eq!(name, "model.norm.weight");
    assert_eq!((expected.as_str(), found.as_str()), ("BF16 [128]", "F16 [128]"));

    // A mapped dtype that is not the expected one: the bf16 norm read as 256 bytes.
    let tmp = written();
    edit_entry(tmp.path(), "language_model.model.norm.weight", |e| {
        e["dtype"] = json!("U8");
        e["shape"] = json!([256]);
    });
    let (name, _, found) = mismatch(tmp.path());
    assert_eq!((name.as_str(), found.as_str()), ("model.norm.weight", "U8 [256]"));
}

#[test]
fn wrong_shape() {
    let tmp = written();
    let name = "language_model.model.layers.1.mlp_res_proj.weight";
    edit_entry(tmp.path(), name, |e| e["shape"] = json!([2, 64]));
    let (name, expected, found) = mismatch(tmp.path());
    assert_eq!(name, "model.layers.1.mlp_res_proj.weight");
    assert_eq!((expected.as_str(), found.as_str()), ("BF16 [1, 128]", "BF16 [2, 64]"));
}

#[test]
fn truncated_shard() {
    let tmp = written();
    let shard = tmp.path().join(shard_of(tmp.path(), "language_model.lm_head.weight"));
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 100).unwrap();
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, shard);
    assert!(reason.contains("truncated or corrupt"), "{reason}");

    // Cut inside the header, and to nothing at all.
    for len in [12, 0] {
        std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len).unwrap();
        assert_eq!(file_error(tmp.path()).0, shard);
    }
}

#[test]
fn corrupt_shard_header() {
    let tmp = written();
    let shard = tmp.path().join(shard_of(tmp.path(), "language_model.model.norm.weight"));
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[8..16].copy_from_slice(b"\xff\xfe garbage"[..8].as_ref());
    std::fs::write(&shard, bytes).unwrap();
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, shard);
    assert!(reason.contains("truncated or corrupt"), "{reason}");
}

#[test]
fn no_weights_at_all() {
    let tmp = written();
    std::fs::remove_file(tmp.path().join(INDEX_FILE)).unwrap();
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path());
    assert!(reason.contains(INDEX_FILE), "{reason}");
}

#[test]
fn error_kinds_are_stable() {
    let tmp = written();
    rewrite_weight_map(tmp.path(), |m| {
        m.remove("language_model.model.norm.weight");
    });
    assert_eq!(verify_error(tmp.path()).kind(), "missing_tensor");
    std::fs::write(tmp.path().join(CONFIG_FILE), "[").unwrap();
    assert_eq!(Checkpoint::open(tmp.path()).unwrap_err().kind(), "checkpoint_file");
}

#[test]
fn a_tensor_stored_with_and_without_the_prefix() {
    // Rename layer 0's input norm (same dtype and shape) to the bare name of the final norm.
    let tmp = written();
    let (from, to) = ("language_model.model.layers.0.input_layernorm.weight", "model.norm.weight");
    let shard = shard_of(tmp.path(), from);
    rewrite_header(&tmp.path().join(&shard), |h| {
        let entry = h.remove(from).unwrap();
        h.insert(to.into(), entry);
    });
    rewrite_weight_map(tmp.path(), |m| {
        m.remove(from);
        m.insert(to.into(), json!(shard));
    });
    let (path, reason) = file_error(tmp.path());
    assert_eq!(path, tmp.path().join(INDEX_FILE));
    assert!(reason.contains("stored twice"), "{reason}");
}

#[test]
fn writing_where_a_file_blocks_the_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let blocker = tmp.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    match write_checkpoint(&small_config(), 1, &blocker.join("ckpt"), 1 << 20) {
        Err(KernelError::CheckpointFile { path, .. }) => assert_eq!(path, blocker.join("ckpt")),
        other => panic!("expected a checkpoint-file error, got {other:?}"),
    }
}
