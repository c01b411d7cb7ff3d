//! The drafter checkpoint folder: a synthetic write reads back byte for byte, a drafter loads from
//! it and drafts like one loaded from the generator, and malformed folders give errors that name the
//! tensor, the field or the file; the backbone attends non-causally inside the block and reads the context.

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sparkd_kernels::checkpoint::{CONFIG_FILE, SINGLE_FILE};
use sparkd_kernels::cpu::CpuModel;
use sparkd_kernels::dspark::{
    drafter_tensors, write_drafter_checkpoint, DrafterCheckpoint, DrafterConfig, DrafterModel, SyntheticDrafterWeights,
};
use sparkd_kernels::runner::SamplingParams;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::tensor::{DType, WeightSource};
use sparkd_kernels::{KernelError, ModelConfig};

fn tiny() -> (ModelConfig, DrafterConfig) {
    (ModelConfig::preset("k3-tiny").unwrap(), DrafterConfig::preset("k3-tiny").unwrap())
}

/// Writes a drafter folder whose tensors are the synthetic ones passed through `edit`
/// (name, dtype, shape, bytes) → `None` drops the tensor.
fn write_edited(
    dir: &Path,
    cfg: &DrafterConfig,
    edit: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(CONFIG_FILE), cfg.to_json().unwrap()).unwrap();
    let synth = SyntheticDrafterWeights::new(cfg.clone(), 1);
    let mut kept = Vec::new();
    for spec in drafter_tensors(cfg) {
        let t = synth.tensor(&spec).unwrap();
        let dtype = match t.dtype {
            DType::Bf16 => Dtype::BF16,
            DType::F32 => Dtype::F32,
            DType::U8 => Dtype::U8,
        };
        if let Some(e) = edit(&spec.name, dtype, t.shape.clone(), t.bytes().to_vec()) {
            kept.push((spec.name.clone(), e));
        }
    }
    let views: Vec<(String, TensorView)> =
        kept.iter().map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join(SINGLE_FILE)).unwrap();
}

#[test]
fn synthetic_drafter_round_trips_through_a_folder() {
    let (target, cfg) = tiny();
    let dir = tempfile::tempdir().unwrap();
    let bytes = write_drafter_checkpoint(&cfg, 7, dir.path()).unwrap();
    let expected: usize = drafter_tensors(&cfg).iter().map(|s| s.canonical_bytes()).sum();
    assert_eq!(bytes, expected as u64);
    let ckpt = DrafterCheckpoint::open(dir.path(), &target).unwrap();
    assert_eq!(ckpt.config(), &cfg);
    ckpt.verify().unwrap();
    let synth = SyntheticDrafterWeights::new(cfg.clone(), 7);
    for spec in drafter_tensors(&cfg) {
        assert_eq!(ckpt.tensor(&spec).unwrap().bytes(), synth.tensor(&spec).unwrap().bytes(), "{}", spec.name);
    }
    // Another seed gives other weights.
    let other = SyntheticDrafterWeights::new(cfg.clone(), 8);
    let w1 = drafter_tensors(&cfg).into_iter().find(|s| s.name == "markov_head.w1.weight").unwrap();
    assert_ne!(other.tensor(&w1).unwrap().bytes(), synth.tensor(&w1).unwrap().bytes());

    // A drafter loaded from the folder drafts exactly like one loaded from the generator.
    let model = CpuModel::<f32>::load(target.clone(), &SyntheticWeights::new(target.clone(), 11)).unwrap();
    let from_disk = DrafterModel::<f32>::open(dir.path(), &target).unwrap();
    let from_synth = DrafterModel::<f32>::load(cfg.clone(), &target, &synth).unwrap();
    let state = from_disk.new_state(0);
    let greedy = SamplingParams::greedy();
    let a = from_disk.draft(&model, &state, 42, 3, &greedy, None).unwrap();
    let b = from_synth.draft(&model, &state, 42, 3, &greedy, None).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.logits.len(), 3 * target.vocab_size);
}

fn open_err(dir: &Path) -> KernelError {
    let (target, _) = tiny();
    match DrafterCheckpoint::open(dir, &target) {
        Ok(c) => c.verify().unwrap_err(),
        Err(e) => e,
    }
}

#[test]
fn malformed_drafter_folders_name_what_is_wrong() {
    let (_, cfg) = tiny();
    let root = tempfile::tempdir().unwrap();

    let missing = root.path().join("missing");
    write_edited(&missing, &cfg, |n, d, s, b| (n != "layers.0.mlp.up_proj.weight").then_some((d, s, b)));
    match open_err(&missing) {
        KernelError::MissingTensor { name } => assert_eq!(name, "layers.0.mlp.up_proj.weight"),
        other => panic!("{other:?}"),
    }

    let shape = root.path().join("shape");
    write_edited(&shape, &cfg, |n, d, s, b| {
        if n == "context_proj.weight" {
            let half = b.len() / 2;
            Some((d, vec![s[0], s[1] / 2], b[..half].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    match open_err(&shape) {
        KernelError::TensorMismatch { name, .. } => assert_eq!(name, "context_proj.weight"),
        other => panic!("{other:?}"),
    }

    let dtype = root.path().join("dtype");
    write_edited(&dtype, &cfg, |n, d, s, b| {
        if n == "confidence_head.bias" {
            Some((Dtype::BF16, s, b[..2].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    match open_err(&dtype) {
        KernelError::TensorMismatch { name, .. } => assert_eq!(name, "confidence_head.bias"),
        other => panic!("{other:?}"),
    }

    let truncated = root.path().join("truncated");
    write_drafter_checkpoint(&cfg, 1, &truncated).unwrap();
    let file = truncated.join(SINGLE_FILE);
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len - 10).unwrap();
    match open_err(&truncated) {
        KernelError::CheckpointFile { path, .. } => assert_eq!(path, file),
        other => panic!("{other:?}"),
    }

    let no_weights = root.path().join("no_weights");
    write_drafter_checkpoint(&cfg, 1, &no_weights).unwrap();
    std::fs::remove_file(no_weights.join(SINGLE_FILE)).unwrap();
    assert_eq!(open_err(&no_weights).kind(), "checkpoint_file");

    let wrong_target = root.path().join("wrong_target");
    write_drafter_checkpoint(&DrafterConfig { hidden_size: 256, ..cfg.clone() }, 1, &wrong_target).unwrap();
    match open_err(&wrong_target) {
        KernelError::Config { field, .. } => assert_eq!(field, "drafter.hidden_size"),
        other => panic!("{other:?}"),
    }

    let bad_json = root.path().join("bad_json");
    write_drafter_checkpoint(&cfg, 1, &bad_json).unwrap();
    std::fs::write(bad_json.join(CONFIG_FILE), "{\"model_type\": \"sparkd_dspark\", \"extra\": 1}").unwrap();
    assert_eq!(open_err(&bad_json).kind(), "config");

    assert_eq!(open_err(&root.path().join("absent")).kind(), "checkpoint_file");
}

#[test]
fn the_backbone_is_non_causal_in_the_block_and_reads_the_context() {
    let (target, cfg) = tiny();
    let model = CpuModel::<f32>::load(target.clone(), &SyntheticWeights::new(target.clone(), 11)).unwrap();
    let drafter = DrafterModel::<f32>::load(cfg.clone(), &target, &SyntheticDrafterWeights::new(cfg, 2)).unwrap();
    let d = target.hidden_size;
    let empty = drafter.new_state(0);
    let (h3, _) = drafter.block_forward(&model, &empty, 42, 3).unwrap();
    let (h4, _) = drafter.block_forward(&model, &empty, 42, 4).unwrap();
    // The anchor attends to the mask positions after it, so a longer block changes it.
    assert_ne!(h3[..d], h4[..d]);
    // RoPE tells the identical mask tokens apart.
    assert_ne!(h4[d..2 * d], h4[2 * d..3 * d]);
    // Context entries (one per committed token, from the target's taps) change the block.
    let mut ctx = drafter.new_state(0);
    let taps: Vec<Vec<f32>> = (0..drafter.config().num_taps())
        .map(|i| (0..2 * d).map(|j| ((i * 31 + j) % 17) as f32 / 8.0 - 1.0).collect())
        .collect();
    let views: Vec<&[f32]> = taps.iter().map(Vec::as_slice).collect();
    drafter.append_context(&mut ctx, &views).unwrap();
    assert_eq!(ctx.len(), 2);
    let (with_ctx, _) = drafter.block_forward(&model, &ctx, 42, 3).unwrap();
    assert_ne!(with_ctx, h3);
    // Rolling the context back to empty restores the empty-context block exactly.
    ctx.truncate(0);
    assert_eq!(drafter.block_forward(&model, &ctx, 42, 3).unwrap().0, h3);
    // Taps of the wrong count or width are errors.
    assert!(drafter.append_context(&mut ctx, &views[1..]).is_err());
    let short: Vec<&[f32]> = taps.iter().map(|t| &t[..d + 1]).collect();
    assert!(drafter.append_context(&mut ctx, &short).is_err());
}
