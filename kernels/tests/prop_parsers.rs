//! Property tests of the checkpoint parsers: `config.json` (`ModelConfig::from_json`, `DrafterConfig::from_json`) and
//! safetensors headers as `Checkpoint::open` reads them, single file or sharded.
//! - config round trip: any config within the supported bounds (every dimension up to `MAX_DIM`) survives
//!   `to_json` then `from_json`, wrapped or bare, and every tensor it implies has a byte size that fits in `usize`;
//!   a number stored as f32 (the KDA gate's bound) is refused when the f32 would not keep it, never kept as an
//!   infinity or a zero that its own JSON cannot carry;
//! - config corruption: a required key removed, a dimension past `MAX_DIM`, or a value of the wrong type is a
//!   `Config` error naming that field; any bytes parse or are refused without a panic;
//! - drafter config: any `rope_theta` and `rms_norm_eps` survive `to_json` then `from_json` exactly; a width past
//!   `MAX_DIM` or more than `MAX_DRAFT_LAYERS` layers is an error naming the field, and anything accepted has a
//!   parameter count and active bytes (no overflow);
//! - safetensors round trip: tensors written with any names (with or without `language_model.`), dtypes, shapes
//!   and bytes, in one file or spread over shards, come back with the same dtype, shape and bytes;
//! - safetensors corruption: a file cut short or padded at any byte, a name stored twice, a shard named by a path,
//!   or a spec of another dtype or shape is an error naming the file or the tensor; flipped header bytes are
//!   parsed or refused without a panic, and a tensor handed out always has exactly its bytes.

use std::path::Path;

use proptest::prelude::*;
use serde_json::{json, Value};
use sparkd_kernels::checkpoint::{Checkpoint, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use sparkd_kernels::config::{ExpertFormat, Ffn, KdaConfig, LayerKind, Mixer, MlaConfig, MoeConfig, MAX_DIM};
use sparkd_kernels::dspark::config::{DrafterConfig, MAX_DRAFT_LAYERS};
use sparkd_kernels::schema::{model_tensors, TEXT_PREFIX};
use sparkd_kernels::tensor::{DType, ExpectedTensor, WeightSource};
use sparkd_kernels::{KernelError, ModelConfig};

/// The keys of `text_config` that have no default.
const REQUIRED: [&str; 34] = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_nope",
    "mla_use_output_gate",
    "linear_attn_config",
    "attn_res_block_size",
    "intermediate_size",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "moe_router_activation_func",
    "moe_renormalize",
    "routed_scaling_factor",
    "topk_method",
    "num_expert_group",
    "topk_group",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "rms_norm_eps",
    "max_position_embeddings",
];

/// The keys of `text_config` that are dimensions or counts, bounded by `MAX_DIM`.
const DIMENSIONS: [&str; 16] = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "intermediate_size",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "attn_res_block_size",
    "linear_attn_config.head_dim",
];

/// A dimension anywhere in 1..=MAX_DIM, small ones as likely as large ones.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..=64, 1usize..=MAX_DIM]
}

/// An f32 that JSON carries exactly (a multiple of 1/16 below 2^20).
fn exact_f32() -> impl Strategy<Value = f32> {
    (1u32..1 << 24).prop_map(|n| n as f32 / 16.0)
}

prop_compose! {
    fn kda()(num_heads in dim(), head_dim in dim(), conv_kernel in dim(), lb in exact_f32()) -> KdaConfig {
        KdaConfig { num_heads, head_dim, conv_kernel, gate_lower_bound: -lb }
    }
}

prop_compose! {
    fn mla()(num_heads in dim(), q_lora_rank in dim(), kv_lora_rank in dim(), nope in dim(), rope in dim()) -> MlaConfig {
        MlaConfig { num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim: nope, qk_rope_head_dim: rope, v_head_dim: nope }
    }
}

prop_compose! {
    fn moe()(
        num_experts in dim(),
        top_k_seed in any::<usize>(),
        num_shared_experts in 0..=MAX_DIM,
        groups in (1..=MAX_DIM / 32, 1..=MAX_DIM / 32),
        renormalize in any::<bool>(),
        routed_scaling_factor in exact_f32(),
        mxfp4 in any::<bool>(),
    ) -> MoeConfig {
        MoeConfig {
            num_experts,
            top_k: 1 + top_k_seed % num_experts,
            num_shared_experts,
            expert_dim: groups.0 * 32,
            latent_dim: groups.1 * 32,
            renormalize,
            routed_scaling_factor,
            expert_format: if mxfp4 { ExpertFormat::Mxfp4 { group_size: 32 } } else { ExpertFormat::Bf16 },
        }
    }
}

prop_compose! {
    fn model_config()(
        (mixers, first_dense) in prop::collection::vec(any::<bool>(), 1..10)
            .prop_flat_map(|m| { let n = m.len(); (Just(m), 0..=n) }),
        kda in kda(),
        mla in mla(),
        moe in moe(),
        (vocab_size, bos, eos) in dim().prop_flat_map(|v| (Just(v), 0..v as u32, 0..v as u32)),
        pad in 0..u32::MAX,
        (hidden_size, dense_intermediate, attn_res_block_size) in (dim(), dim(), dim()),
        betas in (exact_f32(), exact_f32(), exact_f32()),
        max_position_embeddings in 1usize..1 << 40,
    ) -> ModelConfig {
        let layers = mixers
            .iter()
            .enumerate()
            .map(|(l, &kda)| LayerKind {
                mixer: if kda { Mixer::Kda } else { Mixer::Mla },
                ffn: if l < first_dense { Ffn::Dense } else { Ffn::Moe },
            })
            .collect();
        ModelConfig {
            vocab_size,
            hidden_size,
            layers,
            kda,
            mla,
            moe,
            dense_intermediate,
            attn_res_block_size,
            situ_beta: betas.0,
            situ_linear_beta: betas.1,
            rms_norm_eps: betas.2 / (1 << 20) as f32,
            max_position_embeddings,
            bos_token_id: bos,
            eos_token_id: eos,
            pad_token_id: pad,
        }
    }
}

/// The field of the `Config` error `root` gives.
fn config_error(root: &Value) -> String {
    match ModelConfig::from_json(root) {
        Err(KernelError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    }
}

/// `text_config`'s entry at a key or a `linear_attn_config.` key.
fn text_entry<'a>(root: &'a mut Value, key: &str) -> &'a mut Value {
    let text = &mut root["text_config"];
    match key.strip_prefix("linear_attn_config.") {
        Some(inner) => &mut text["linear_attn_config"][inner],
        None => &mut text[key],
    }
}

/// k3-tiny with a 4096-token vocabulary.
fn small_config() -> ModelConfig {
    let mut cfg = ModelConfig::preset("k3-tiny").expect("preset");
    (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) = (4096, 4000, 4001, 4095);
    cfg
}

/// One stored tensor: its name without prefix, whether it is stored with `language_model.`, dtype, shape, bytes.
#[derive(Clone, Debug)]
struct Stored {
    name: String,
    prefixed: bool,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Stored {
    fn stored_name(&self) -> String {
        if self.prefixed {
            format!("{TEXT_PREFIX}{}", self.name)
        } else {
            self.name.clone()
        }
    }

    fn spec(&self) -> ExpectedTensor {
        ExpectedTensor::exact(self.name.clone(), &self.shape, self.dtype)
    }
}

fn stored_tensors() -> impl Strategy<Value = Vec<Stored>> {
    let one = (
        any::<bool>(),
        prop::sample::select(vec![DType::Bf16, DType::F32, DType::U8]),
        prop::collection::vec(1usize..5, 1..4),
    )
        .prop_flat_map(|(prefixed, dtype, shape)| {
            let len = shape.iter().product::<usize>() * dtype.size();
            (Just(prefixed), Just(dtype), Just(shape), prop::collection::vec(any::<u8>(), len))
        });
    prop::collection::vec(one, 0..6).prop_map(|tensors| {
        tensors
            .into_iter()
            .enumerate()
            .map(|(i, (prefixed, dtype, shape, bytes))| Stored {
                name: format!("model.layers.{i}.t.weight"),
                prefixed,
                dtype,
                shape,
                bytes,
            })
            .collect()
    })
}

/// A safetensors file holding `tensors` in order.
fn safetensors(tensors: &[&Stored]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for t in tensors {
        let begin = data.len();
        data.extend_from_slice(&t.bytes);
        header.insert(
            t.stored_name(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let mut text = Value::Object(header).to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&text);
    file.extend_from_slice(&data);
    file
}

/// A checkpoint folder with the small config and `files`.
fn folder(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join(CONFIG_FILE), small_config().to_json().to_string()).expect("config");
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).expect("file");
    }
    dir
}

fn assert_holds(dir: &Path, tensors: &[Stored]) -> Result<(), TestCaseError> {
    let ckpt = Checkpoint::open(dir).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(ckpt.num_tensors(), tensors.len());
    for t in tensors {
        let prefixed = format!("{TEXT_PREFIX}{}", t.name);
        prop_assert!(ckpt.contains(&t.name) && ckpt.contains(&prefixed), "{} is not found", t.name);
        let got = ckpt.tensor(&t.spec()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!((got.dtype, &got.shape), (t.dtype, &t.shape));
        prop_assert_eq!(got.bytes(), t.bytes.as_slice());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn configs_round_trip_and_have_usize_tensor_sizes(cfg in model_config()) {
        let json = cfg.to_json();
        prop_assert_eq!(&ModelConfig::from_json(&json).expect("its own JSON parses"), &cfg);
        prop_assert_eq!(&ModelConfig::from_json(&json["text_config"]).expect("the bare text config parses"), &cfg);
        // Two routed experts stand for all: they have the same shapes.
        let mut few = cfg.clone();
        few.moe.num_experts = few.moe.num_experts.min(2);
        for spec in model_tensors(&few) {
            let elements = spec.shape.canonical().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            prop_assert_eq!(elements.and_then(|n| n.checked_mul(spec.dtype.size())), Some(spec.canonical_bytes()));
        }
    }

    #[test]
    fn a_finite_number_kept_as_f32_round_trips_or_is_named(cfg in model_config(), gate in -1e300f64..-1e-300) {
        let mut json = cfg.to_json();
        json["text_config"]["linear_attn_config"]["gate_lower_bound"] = json!(gate);
        match ModelConfig::from_json(&json) {
            Ok(parsed) => {
                prop_assert!(parsed.kda.gate_lower_bound.is_finite() && parsed.kda.gate_lower_bound < 0.0);
                prop_assert_eq!(&ModelConfig::from_json(&parsed.to_json()).expect("its own JSON parses"), &parsed);
            }
            Err(KernelError::Config { field, .. }) => {
                prop_assert_eq!(field, "text_config.linear_attn_config.gate_lower_bound")
            }
            Err(e) => prop_assert!(false, "{}", e),
        }
    }

    #[test]
    fn a_missing_oversized_or_mistyped_field_is_named(
        cfg in model_config(),
        required in prop::sample::select(REQUIRED.to_vec()),
        dimension in prop::sample::select(DIMENSIONS.to_vec()),
        oversize in (MAX_DIM as u64 + 1)..,
    ) {
        let good = cfg.to_json();
        let mut missing = good.clone();
        missing["text_config"].as_object_mut().expect("object").remove(required);
        prop_assert_eq!(config_error(&missing), format!("text_config.{required}"));

        let mut mistyped = good.clone();
        mistyped["text_config"][required] = json!([]);
        prop_assert_eq!(config_error(&mistyped), format!("text_config.{required}"));

        let mut oversized = good;
        *text_entry(&mut oversized, dimension) = json!(oversize);
        prop_assert_eq!(config_error(&oversized), format!("text_config.{dimension}"));
    }

    #[test]
    fn drafter_configs_round_trip_or_name_the_field(
        rope_theta in 1.0f64..1e300,
        eps in 1e-30f32..1.0,
        field in prop::sample::select(vec!["num_draft_layers", "markov_rank", "q_lora_rank", "intermediate_size"]),
        size in prop_oneof![1..=2 * MAX_DIM as u64, 1..u64::MAX],
    ) {
        let target = ModelConfig::preset("k3-tiny").expect("preset");
        let mut drafter = DrafterConfig::preset("k3-tiny").expect("preset");
        (drafter.rope_theta, drafter.rms_norm_eps) = (rope_theta, eps);
        let text = drafter.to_json().expect("JSON");
        prop_assume!(rope_theta > 1.0);
        prop_assert_eq!(&DrafterConfig::from_json(&text, &target).expect("its own JSON parses"), &drafter);

        let mut v: Value = serde_json::from_str(&text).expect("JSON");
        v[field] = json!(size);
        let limit = if field == "num_draft_layers" { MAX_DRAFT_LAYERS } else { MAX_DIM } as u64;
        match DrafterConfig::from_json(&v.to_string(), &target) {
            Ok(parsed) => {
                prop_assert!(size <= limit, "{} = {} accepted", field, size);
                prop_assert!(parsed.num_params() > 0 && parsed.active_bytes() > 0);
            }
            Err(KernelError::Config { field: named, .. }) => {
                prop_assert!(size > limit);
                prop_assert_eq!(named, format!("drafter.{field}"));
            }
            Err(e) => prop_assert!(false, "{}", e),
        }
    }

    #[test]
    fn any_config_bytes_parse_or_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..512), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        if let Ok(root) = serde_json::from_slice::<Value>(&bytes) {
            let _ = ModelConfig::from_json(&root);
        }
        let target = small_config();
        let _ = DrafterConfig::from_json(&String::from_utf8_lossy(&bytes), &target);
        let mut drafter = DrafterConfig::preset("k3-tiny").expect("preset").to_json().expect("JSON").into_bytes();
        for (at, byte) in flips {
            let i = at.index(drafter.len());
            drafter[i] = byte;
        }
        let _ = DrafterConfig::from_json(&String::from_utf8_lossy(&drafter), &ModelConfig::preset("k3-tiny").expect("preset"));
    }

    #[test]
    fn safetensors_round_trip(tensors in stored_tensors(), shards in 1usize..4) {
        let all: Vec<&Stored> = tensors.iter().collect();
        let single = folder(&[(SINGLE_FILE, &safetensors(&all))]);
        assert_holds(single.path(), &tensors)?;

        let names: Vec<String> = (0..shards).map(|s| format!("model-{s:05}.safetensors")).collect();
        let files: Vec<Vec<u8>> = (0..shards)
            .map(|s| safetensors(&tensors.iter().enumerate().filter(|(i, _)| i % shards == s).map(|(_, t)| t).collect::<Vec<_>>()))
            .collect();
        let weight_map: serde_json::Map<String, Value> =
            tensors.iter().enumerate().map(|(i, t)| (t.stored_name(), json!(names[i % shards]))).collect();
        let index = json!({"metadata": {}, "weight_map": weight_map}).to_string();
        let mut listed: Vec<(&str, &[u8])> = names.iter().map(String::as_str).zip(files.iter().map(Vec::as_slice)).collect();
        listed.push((INDEX_FILE, index.as_bytes()));
        let sharded = folder(&listed);
        assert_holds(sharded.path(), &tensors)?;

        for t in &tensors {
            let mut other = t.spec();
            other.dtype = if t.dtype == DType::U8 { DType::F32 } else { DType::U8 };
            match Checkpoint::open(sharded.path()).expect("opens").tensor(&other) {
                Err(KernelError::TensorMismatch { name, .. }) => prop_assert_eq!(name, t.name.clone()),
                other => prop_assert!(false, "expected a mismatch, got {:?}", other),
            }
        }
    }

    #[test]
    fn a_cut_padded_or_doubly_named_file_is_refused_naming_it(
        tensors in stored_tensors(),
        cut in any::<prop::sample::Index>(),
        pad in 1usize..16,
    ) {
        let all: Vec<&Stored> = tensors.iter().collect();
        let file = safetensors(&all);
        let refused = |bytes: &[u8]| -> Result<String, TestCaseError> {
            let dir = folder(&[(SINGLE_FILE, bytes)]);
            match Checkpoint::open(dir.path()) {
                Err(KernelError::CheckpointFile { path, reason }) => {
                    prop_assert_eq!(path, dir.path().join(SINGLE_FILE));
                    Ok(reason)
                }
                other => Err(TestCaseError::fail(format!("expected a file error, got {other:?}"))),
            }
        };
        refused(&file[..cut.index(file.len())])?;
        let mut padded = file.clone();
        padded.resize(file.len() + pad, 0);
        refused(&padded)?;

        if let Some(first) = tensors.first() {
            let twin = Stored { prefixed: !first.prefixed, ..first.clone() };
            let reason = refused(&safetensors(&[first, &twin]))?;
            prop_assert!(reason.contains(&first.name), "{}", reason);
        }
    }

    #[test]
    fn flipped_header_bytes_never_panic(
        tensors in stored_tensors(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        shard_name in prop::sample::select(vec!["../x.safetensors", "a/b.safetensors", "", ".."]),
    ) {
        let all: Vec<&Stored> = tensors.iter().collect();
        let mut file = safetensors(&all);
        let header_end = 8 + u64::from_le_bytes(file[..8].try_into().expect("8 bytes")) as usize;
        for (at, byte) in flips {
            let i = at.index(header_end);
            file[i] = byte;
        }
        let dir = folder(&[(SINGLE_FILE, &file)]);
        if let Ok(ckpt) = Checkpoint::open(dir.path()) {
            for t in &tensors {
                if let Ok(got) = ckpt.tensor(&t.spec()) {
                    prop_assert_eq!(got.bytes().len(), got.numel() * got.dtype.size());
                }
            }
        }

        let index = json!({"weight_map": {"model.norm.weight": shard_name}}).to_string();
        let dir = folder(&[(INDEX_FILE, index.as_bytes())]);
        match Checkpoint::open(dir.path()) {
            Err(KernelError::CheckpointFile { path, .. }) => prop_assert_eq!(path, dir.path().join(INDEX_FILE)),
            other => prop_assert!(false, "a shard outside the folder must be refused, got {:?}", other),
        }
    }
}
