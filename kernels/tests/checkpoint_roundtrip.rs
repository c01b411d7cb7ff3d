//! Synthetic checkpoints written by `synth::write_checkpoint` load back through
//! `checkpoint::Checkpoint` byte for byte: sharded (the real layout), single-file, and with names
//! stored without the `language_model.` prefix; and the writer is deterministic in its seed.

mod checkpoint_common;

use std::collections::HashMap;
use std::path::Path;

use checkpoint_common::{rewrite_header, rewrite_weight_map, shard_of, small_config};
use serde_json::Value;
use sparkd_kernels::checkpoint::{Checkpoint, INDEX_FILE, SINGLE_FILE};
use sparkd_kernels::schema::{model_tensors, TEXT_PREFIX};
use sparkd_kernels::synth::{write_checkpoint, SyntheticWeights};
use sparkd_kernels::tensor::WeightSource;
use sparkd_kernels::ModelConfig;

/// Every tensor of the config reads back byte-equal to the generator's, with its dtype and shape.
fn assert_matches_generator(ckpt: &Checkpoint, cfg: &ModelConfig, seed: u64) {
    let synth = SyntheticWeights::new(cfg.clone(), seed);
    for spec in model_tensors(cfg) {
        let (got, want) = (ckpt.tensor(&spec).unwrap(), synth.tensor(&spec).unwrap());
        assert_eq!((got.dtype, &got.shape), (want.dtype, &want.shape), "{}", spec.name);
        assert!(got.bytes() == want.bytes(), "bytes of {} differ", spec.name);
    }
}

fn read_index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap()
}

/// The real k3-tiny (vocabulary 163,840, so the embedding alone is 40 MiB): written once, in
/// shards of at most 1 MiB, then read back completely.
#[test]
fn sharded_k3_tiny_round_trips_byte_equal() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let report = write_checkpoint(&cfg, 42, dir, 1 << 20).unwrap();

    let specs = model_tensors(&cfg);
    assert_eq!(report.tensor_count, specs.len());
    assert!(report.shards.len() > 4, "{} shards", report.shards.len());
    let n = report.shards.len();
    for (i, shard) in report.shards.iter().enumerate() {
        assert_eq!(shard.file, format!("model-{:05}-of-{:05}.safetensors", i + 1, n));
        let header_and_data = std::fs::metadata(dir.join(&shard.file)).unwrap().len();
        assert!(header_and_data > shard.bytes);
        assert!(shard.bytes <= 1 << 20 || shard.tensors == 1 || shard.tensors == 6, "{shard:?}");
    }

    // The index: every name prefixed, total_size the data bytes, an expert's six tensors together.
    let index = read_index(dir);
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(report.total_bytes));
    let weight_map = index["weight_map"].as_object().unwrap();
    assert_eq!(weight_map.len(), specs.len());
    assert!(weight_map.keys().all(|k| k.starts_with(TEXT_PREFIX)));
    // Checkpoint order: the 40 MiB embedding opens the first shard and lm_head closes the last.
    assert_eq!(shard_of(dir, "language_model.model.embed_tokens.weight"), report.shards[0].file);
    assert_eq!(shard_of(dir, "language_model.lm_head.weight"), report.shards[n - 1].file);
    let mut expert_shards: HashMap<String, Vec<&str>> = HashMap::new();
    for (name, file) in weight_map {
        if let Some(at) = name.find(".experts.") {
            let expert_end = at + ".experts.".len() + name[at + 9..].find('.').unwrap();
            expert_shards.entry(name[..expert_end].to_string()).or_default().push(file.as_str().unwrap());
        }
    }
    assert_eq!(expert_shards.len(), 8 * cfg.moe.num_experts);
    for (expert, files) in &expert_shards {
        assert_eq!(files.len(), 6, "{expert}");
        assert!(files.iter().all(|f| *f == files[0]), "{expert} is split over {files:?}");
    }

    let ckpt = Checkpoint::open(dir).unwrap();
    assert_eq!(ckpt.config(), &cfg);
    assert_eq!(ckpt.num_tensors(), specs.len());
    assert_eq!(ckpt.shard_paths().count(), n);
    assert!(ckpt.contains("model.norm.weight") && ckpt.contains("language_model.model.norm.weight"));
    ckpt.verify().unwrap();
    assert_matches_generator(&ckpt, &cfg, 42);
    // A_log is stored with head_dim entries for fewer heads, as in the real checkpoint.
    let a_log = specs.iter().find(|s| s.name.ends_with(".A_log")).unwrap();
    assert_eq!(ckpt.tensor(a_log).unwrap().shape, vec![cfg.kda.head_dim]);
}

#[test]
fn single_file_checkpoint_loads() {
    let cfg = small_config();
    let tmp = tempfile::tempdir().unwrap();
    let report = write_checkpoint(&cfg, 3, tmp.path(), u64::MAX).unwrap();
    assert_eq!(report.shards.len(), 1);
    std::fs::rename(tmp.path().join(&report.shards[0].file), tmp.path().join(SINGLE_FILE)).unwrap();
    std::fs::remove_file(tmp.path().join(INDEX_FILE)).unwrap();

    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    ckpt.verify().unwrap();
    assert_matches_generator(&ckpt, &cfg, 3);
}

#[test]
fn names_without_the_prefix_load_the_same() {
    let cfg = small_config();
    let tmp = tempfile::tempdir().unwrap();
    let report = write_checkpoint(&cfg, 9, tmp.path(), 512 << 10).unwrap();
    assert!(report.shards.len() > 2);
    let strip = |map: &mut serde_json::Map<String, Value>| {
        *map = std::mem::take(map)
            .into_iter()
            .map(|(k, v)| (k.strip_prefix(TEXT_PREFIX).map(str::to_string).unwrap_or(k), v))
            .collect();
    };
    for shard in &report.shards {
        rewrite_header(&tmp.path().join(&shard.file), strip);
    }
    rewrite_weight_map(tmp.path(), strip);
    assert!(read_index(tmp.path())["weight_map"].as_object().unwrap().contains_key("lm_head.weight"));

    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    ckpt.verify().unwrap();
    assert!(ckpt.contains("lm_head.weight") && ckpt.contains("language_model.lm_head.weight"));
    assert_matches_generator(&ckpt, &cfg, 9);
}

#[test]
fn writes_are_deterministic_in_the_seed() {
    let cfg = small_config();
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let reports: Vec<_> =
        dirs.iter().zip([5, 5, 6]).map(|(d, seed)| write_checkpoint(&cfg, seed, d.path(), 1 << 20).unwrap()).collect();
    assert_eq!(reports[0].shards, reports[1].shards);
    assert_eq!(reports[0].shards, reports[2].shards, "the layout does not depend on the seed");
    let read = |d: &tempfile::TempDir, f: &str| std::fs::read(d.path().join(f)).unwrap();
    let mut differing = 0;
    for shard in &reports[0].shards {
        assert!(read(&dirs[0], &shard.file) == read(&dirs[1], &shard.file), "{} differs for one seed", shard.file);
        differing += usize::from(read(&dirs[0], &shard.file) != read(&dirs[2], &shard.file));
    }
    assert_eq!(differing, reports[0].shards.len(), "every shard changes with the seed");
    for f in [INDEX_FILE, "config.json"] {
        assert_eq!(read(&dirs[0], f), read(&dirs[2], f));
    }
}
