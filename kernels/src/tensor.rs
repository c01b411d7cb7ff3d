//! Host tensors as stored in a checkpoint: raw little-endian bytes with a dtype and a shape.
//!
//! Invariants: a [`HostTensor`]'s byte length is always `numel(shape) * dtype.size()`; its bytes
//! are either owned or a range of a memory-mapped shard that the tensor keeps alive. Conversions
//! to f32 are exact (bf16 and f32 widen without rounding).

use std::sync::Arc;

use half::bf16;
use memmap2::Mmap;

use crate::error::{KernelError, Result};

/// The dtypes a K3 checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    F32,
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
            DType::U8 => 1,
        }
    }

    /// The safetensors name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "BF16",
            DType::F32 => "F32",
            DType::U8 => "U8",
        }
    }
}

/// What shape a tensor must have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeRule {
    /// Exactly this shape.
    Exact(Vec<usize>),
    /// A vector of at least this many elements (K3 stores `A_log` as `[head_dim]` for fewer heads),
    /// given as `[n]` or as `[1, 1, n, 1]` (Kimi-Linear's layout).
    VectorAtLeast(usize),
}

impl ShapeRule {
    pub fn accepts(&self, shape: &[usize]) -> bool {
        match self {
            ShapeRule::Exact(s) => s.as_slice() == shape,
            ShapeRule::VectorAtLeast(n) => {
                let numel: usize = shape.iter().product();
                let vector_like = shape.iter().filter(|d| **d != 1).count() <= 1;
                !shape.is_empty() && vector_like && numel >= *n
            }
        }
    }

    /// The shape a writer uses for this rule.
    pub fn canonical(&self) -> Vec<usize> {
        match self {
            ShapeRule::Exact(s) => s.clone(),
            ShapeRule::VectorAtLeast(n) => vec![*n],
        }
    }
}

impl std::fmt::Display for ShapeRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShapeRule::Exact(s) => write!(f, "{s:?}"),
            ShapeRule::VectorAtLeast(n) => write!(f, "a vector of at least {n} elements"),
        }
    }
}

/// A tensor the model expects: its name (without any `language_model.` prefix), shape and dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: ShapeRule,
    pub dtype: DType,
}

impl ExpectedTensor {
    pub fn exact(name: impl Into<String>, shape: &[usize], dtype: DType) -> Self {
        ExpectedTensor { name: name.into(), shape: ShapeRule::Exact(shape.to_vec()), dtype }
    }

    /// The number of bytes a writer stores for this tensor.
    pub fn canonical_bytes(&self) -> usize {
        self.shape.canonical().iter().product::<usize>() * self.dtype.size()
    }

    /// Checks a found tensor against the spec, naming the tensor on mismatch.
    pub fn check(&self, dtype: DType, shape: &[usize]) -> Result<()> {
        if dtype != self.dtype || !self.shape.accepts(shape) {
            return Err(KernelError::TensorMismatch {
                name: self.name.clone(),
                expected: format!("{} {}", self.dtype.name(), self.shape),
                found: format!("{} {:?}", dtype.name(), shape),
            });
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Bytes {
    Owned(Arc<Vec<u8>>),
    Mapped { map: Arc<Mmap>, start: usize, end: usize },
}

/// A tensor's bytes on the host, with its dtype and shape.
#[derive(Clone, Debug)]
pub struct HostTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    bytes: Bytes,
}

impl HostTensor {
    /// An owned tensor; the byte length must match the shape and dtype.
    pub fn owned(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let want = shape.iter().product::<usize>() * dtype.size();
        if data.len() != want {
            return Err(KernelError::InvalidInput(format!(
                "tensor of shape {shape:?} {} needs {want} bytes, got {}",
                dtype.name(),
                data.len()
            )));
        }
        Ok(HostTensor { dtype, shape, bytes: Bytes::Owned(Arc::new(data)) })
    }

    /// A tensor backed by `map[start..end]`; the caller has checked the range.
    pub fn mapped(dtype: DType, shape: Vec<usize>, map: Arc<Mmap>, start: usize, end: usize) -> Self {
        HostTensor { dtype, shape, bytes: Bytes::Mapped { map, start, end } }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Owned(v) => v,
            Bytes::Mapped { map, start, end } => &map[*start..*end],
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values widened to f32 (exact). U8 tensors are not floating point and are refused.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes();
        match self.dtype {
            DType::Bf16 => Ok(b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
            DType::F32 => Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            DType::U8 => Err(KernelError::InvalidInput("a U8 tensor has no float values".into())),
        }
    }
}

/// Anything that can hand out the model's tensors: a checkpoint on disk or a synthetic generator.
pub trait WeightSource {
    /// The tensor named by `spec`, checked against the spec's shape and dtype.
    fn tensor(&self, spec: &ExpectedTensor) -> Result<HostTensor>;
}

/// bf16 bytes (little-endian) of f32 values, rounding to nearest even.
pub fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
}

/// f32 bytes (little-endian).
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Rounds an f32 to the nearest bf16 value (ties to even), returned as f32.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}
