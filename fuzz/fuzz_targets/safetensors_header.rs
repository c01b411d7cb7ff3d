//! Fuzz target: safetensors weight files as the checkpoint loaders of `sparkd-kernels` open them
//! (`checkpoint::Checkpoint::open`, single file or sharded behind `model.safetensors.index.json`, and
//! `dspark::schema::DrafterCheckpoint::open`), then hand out every tensor the config implies
//! (`WeightSource::tensor`). Each file is small: a header and a few bytes of data, never a real checkpoint.
//!
//! The input is used twice: as the raw file, and as a description of a header (tensor names from the schema or
//! fuzzed, with or without the `language_model.` prefix, any dtype name, the expected shape or a fuzzed one,
//! consistent or fuzzed offsets, `__metadata__`, data cut short or padded), written out as a file, with a fuzzed
//! shard index when the description asks for the sharded layout.
//!
//! Checks, for any file:
//! - nothing panics (a bad header, offset or index is an error naming the file or the tensor);
//! - a tensor handed out has the dtype and a shape its spec accepts, and exactly `numel × dtype size` bytes, all
//!   inside the mapping; a floating-point one widens to `numel` values.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};
use sparkd_kernels::checkpoint::{Checkpoint, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use sparkd_kernels::dspark::config::DrafterConfig;
use sparkd_kernels::dspark::schema::{drafter_tensors, DrafterCheckpoint};
use sparkd_kernels::schema::{model_tensors, TEXT_PREFIX};
use sparkd_kernels::tensor::{DType, ExpectedTensor, WeightSource};
use sparkd_kernels::ModelConfig;

const DTYPES: [&str; 10] = ["BF16", "F32", "U8", "F16", "I64", "BOOL", "F8_E4M3", "I8", "F64", "E8M0"];
/// Most data bytes written per tensor (larger tensors get their offsets cut short, which the loader refuses).
const MAX_TENSOR_BYTES: usize = 1 << 14;
/// The one shard of the sharded layout.
const SHARD: &str = "model-00001-of-00001.safetensors";

#[derive(Arbitrary, Debug)]
enum Name {
    Spec(u16),
    Other(String),
}

#[derive(Arbitrary, Debug)]
struct Tensor {
    name: Name,
    prefixed: bool,
    dtype: u8,
    /// `None`: the shape the spec expects (a small one of 2 elements for other names).
    shape: Option<Vec<u8>>,
    /// `None`: right after the previous tensor, as long as the dtype and shape say.
    offsets: Option<(u16, u16)>,
}

#[derive(Arbitrary, Debug)]
struct Header {
    tensors: Vec<Tensor>,
    metadata: Option<Vec<(String, String)>>,
    /// Bytes added to (positive) or cut from (negative) the data the offsets cover.
    data_delta: i8,
    /// `Some`: the sharded layout, every tensor placed in the shard or, for fuzzed names, in this file.
    index: Option<Option<String>>,
    /// Names from the drafter's schema instead of the target's.
    drafter: bool,
}

/// A scratch checkpoint folder (k3-tiny with a 4096-token vocabulary) with a drafter folder inside.
struct Scratch {
    dir: PathBuf,
    drafter_dir: PathBuf,
    config: ModelConfig,
    specs: Vec<ExpectedTensor>,
    drafter_specs: Vec<ExpectedTensor>,
}

fn scratch() -> &'static Scratch {
    static SCRATCH: OnceLock<Scratch> = OnceLock::new();
    SCRATCH.get_or_init(|| {
        let mut config = ModelConfig::preset("k3-tiny").expect("preset");
        (config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id) = (4096, 4000, 4001, 4095);
        let drafter = DrafterConfig::for_target("k3-tiny", &config).expect("the tiny drafter");
        // In memory where there is a tmpfs: a disk file system flushes each rewritten file on close.
        let shm = std::path::Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let dir = base.join(format!("sparkd-fuzz-safetensors-{}", std::process::id()));
        let drafter_dir = dir.join("drafter");
        std::fs::create_dir_all(&drafter_dir).expect("scratch folder");
        std::fs::write(dir.join(CONFIG_FILE), config.to_json().to_string()).expect("config");
        std::fs::write(drafter_dir.join(CONFIG_FILE), drafter.to_json().expect("JSON")).expect("drafter config");
        let specs = model_tensors(&config);
        let drafter_specs = drafter_tensors(&drafter);
        Scratch { dir, drafter_dir, config, specs, drafter_specs }
    })
}

fn dtype_size(name: &str) -> usize {
    match name {
        "U8" | "BOOL" | "F8_E4M3" | "I8" | "E8M0" => 1,
        "BF16" | "F16" => 2,
        "F32" => 4,
        _ => 8,
    }
}

/// The file a header description stands for, and its shard index when it asks for one.
fn build(h: &Header, specs: &[ExpectedTensor]) -> (Vec<u8>, Option<String>) {
    let mut table = Map::new();
    let mut weight_map = Map::new();
    let mut end = 0usize;
    for t in &h.tensors {
        let spec = match &t.name {
            Name::Spec(i) => Some(&specs[usize::from(*i) % specs.len()]),
            Name::Other(_) => None,
        };
        let bare = match (&t.name, spec) {
            (_, Some(spec)) => spec.name.clone(),
            (Name::Other(name), None) => name.clone(),
            (Name::Spec(_), None) => unreachable!("a spec name has its spec"),
        };
        let name = if t.prefixed { format!("{TEXT_PREFIX}{bare}") } else { bare };
        let dtype = DTYPES[usize::from(t.dtype) % DTYPES.len()];
        let shape: Vec<usize> = match (&t.shape, spec) {
            (Some(dims), _) => dims.iter().map(|&d| usize::from(d)).collect(),
            (None, Some(spec)) => spec.shape.canonical(),
            (None, None) => vec![2],
        };
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX);
        let bytes = elements.saturating_mul(dtype_size(dtype)).min(MAX_TENSOR_BYTES);
        let (begin, stop) = match t.offsets {
            Some((a, b)) => (usize::from(a), usize::from(b)),
            None => (end, end + bytes),
        };
        end = end.max(stop);
        table.insert(name.clone(), json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, stop]}));
        let file = match (&h.index, spec) {
            (Some(Some(other)), None) => other.clone(),
            _ => SHARD.to_string(),
        };
        weight_map.insert(name, json!(file));
    }
    if let Some(pairs) = &h.metadata {
        table.insert("__metadata__".into(), Value::Object(pairs.iter().map(|(k, v)| (k.clone(), json!(v))).collect()));
    }
    let mut text = Value::Object(table).to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&text);
    let data = end.saturating_add_signed(isize::from(h.data_delta));
    file.resize(file.len() + data, 0x3f);
    let index = h.index.as_ref().map(|_| json!({"metadata": {}, "weight_map": weight_map}).to_string());
    (file, index)
}

fn assert_tensors(source: &dyn WeightSource, specs: &[ExpectedTensor]) {
    for spec in specs {
        let Ok(t) = source.tensor(spec) else { continue };
        assert_eq!(t.dtype, spec.dtype, "{}", spec.name);
        assert!(spec.shape.accepts(&t.shape), "{}: shape {:?} for {}", spec.name, t.shape, spec.shape);
        assert_eq!(t.bytes().len(), t.numel() * t.dtype.size(), "{}", spec.name);
        if t.dtype != DType::U8 {
            assert_eq!(t.to_f32().expect("a float tensor widens").len(), t.numel(), "{}", spec.name);
        }
    }
}

/// Opens the scratch checkpoint (and its drafter) holding `file`, sharded behind `index` when given.
fn open(s: &Scratch, file: &[u8], index: Option<&str>) {
    let write = |name: &std::path::Path, bytes: &[u8]| std::fs::write(name, bytes).expect("scratch write");
    let single = s.dir.join(SINGLE_FILE);
    match index {
        Some(index) => {
            let _ = std::fs::remove_file(&single);
            write(&s.dir.join(INDEX_FILE), index.as_bytes());
            write(&s.dir.join(SHARD), file);
        }
        None => write(&single, file),
    }
    if let Ok(ckpt) = Checkpoint::open(&s.dir) {
        assert_eq!(ckpt.config(), &s.config);
        let stored: Vec<ExpectedTensor> = s.specs.iter().filter(|spec| ckpt.contains(&spec.name)).cloned().collect();
        assert_tensors(&ckpt, &stored);
    }
    write(&s.drafter_dir.join(SINGLE_FILE), file);
    if let Ok(drafter) = DrafterCheckpoint::open(&s.drafter_dir, &s.config) {
        assert_tensors(&drafter, &s.drafter_specs);
    }
}

fuzz_target!(|data: &[u8]| {
    let s = scratch();
    open(s, data, None);
    let Ok(header) = Header::arbitrary(&mut Unstructured::new(data)) else { return };
    let specs = if header.drafter { &s.drafter_specs } else { &s.specs };
    let (file, index) = build(&header, specs);
    open(s, &file, index.as_deref());
});
