//! K3 weights on the device, uploaded tensor by tensor from any [`WeightSource`].
//!
//! Invariants: every tensor is fetched through `schema::model_tensors` (name, shape, dtype checked by
//! the source) and uploaded in its stored precision: bf16 matrices and norm weights stay bf16, the
//! f32 KDA tensors stay f32, MXFP4 experts stay packed, rearranged into the expert kernels' tiles
//! (`expert_layout`; the kernels dequantise them). The host never holds more than one tensor at a time, so a
//! large checkpoint does not need host memory for the whole model. Derived values match the CPU reference
//! exactly: `a = exp(A_log[..num_heads])` and the AttnRes pseudo-query `norm * proj` are computed on the host in
//! f32, as `cpu::weights` computes them.
//! The projections a mixer applies to the same input are stacked at load into one matrix
//! ([`DevMerged`]: KDA's q, k, v, g, f_a, b, MLA's q_a, kv_a, g and an MLP's gate and up), uploaded part by part into their
//! rows, so each runs as one GEMM whose output parts keep the separate tensors' layouts.
//! A rank of a tensor-parallel group ([`DevWeights::load_shard`]) uploads only its part of each tensor, cut from
//! the stored bytes as `crate::shard_rule` says for its name (the rule the CPU loader and `sparkd plan` follow),
//! and of the routed experts only those it holds; the whole model is the shard of a group of one, loaded exactly
//! as before.

use std::collections::HashMap;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;

use crate::config::{ExpertFormat, Ffn, Mixer, ModelConfig};
use crate::cuda::attn::{check_kda_shape, check_mla_shape};
use crate::cuda::expert_layout::{tile_codes, tile_scales, tiled_code_bytes, tiled_scale_bytes};
use crate::cuda::gemm::{LinearArgs, PartsArgs};
use crate::cuda::gpu::Gpu;
use crate::cuda::launch::DPtr;
use crate::cuda::moe::check_expert_width;
use crate::cuda::rows::RmsNormArgs;
use crate::error::{KernelError, Result};
use crate::schema::{expert_specs, layer_name, model_tensors};
use crate::shard_rule::{split_of, Shard};
use crate::tensor::{DType, ExpectedTensor, HostTensor, WeightSource};

/// A bf16 matrix `[out, in]` on the device.
pub struct DevLinear {
    pub w: CudaSlice<bf16>,
    pub out_dim: usize,
    pub in_dim: usize,
}

impl DevLinear {
    /// The GEMM of this weight on tokens `x` `[n, in_dim]` into `y` `[n, out_dim]`.
    pub fn args(&self, gpu: &Gpu, x: DPtr, n: usize, y: DPtr) -> LinearArgs {
        LinearArgs { w: gpu.ptr(&self.w), out_dim: self.out_dim, in_dim: self.in_dim, x, n, y }
    }
}

/// Projections of the same input stacked into one bf16 matrix `[sum of outs, in]` (rows in part
/// order), run as one GEMM with a segment-major output (`GemmKernels::linear_parts`): part `i` is its own
/// contiguous `[n, bounds[i + 1] - bounds[i]]` block at element offset `n * bounds[i]`.
pub struct DevMerged {
    pub w: CudaSlice<bf16>,
    pub in_dim: usize,
    /// Row boundaries of the parts: `[0, out_0, out_0 + out_1, .., total]`.
    pub bounds: Vec<usize>,
    /// `bounds` as i32 on the device.
    pub bounds_dev: CudaSlice<i32>,
}

impl DevMerged {
    /// The merged GEMM of these parts on tokens `x` `[n, in_dim]` into `y` (segment-major, see [`DevMerged`]).
    pub fn args(&self, gpu: &Gpu, x: DPtr, n: usize, y: DPtr) -> PartsArgs<'_> {
        PartsArgs {
            w: gpu.ptr(&self.w),
            bounds: &self.bounds,
            bounds_dev: gpu.ptr(&self.bounds_dev),
            in_dim: self.in_dim,
            x,
            n,
            y,
        }
    }

    /// Total output width.
    pub fn out_dim(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }
}

/// The parts of [`DevKda::in_proj`], in row order.
pub const KDA_IN_PARTS: [&str; 6] = ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"];
/// The parts of [`DevMlp::gate_up`], in row order.
pub const MLP_IN_PARTS: [&str; 2] = ["gate_proj", "up_proj"];
/// The parts of [`DevMla::in_proj`], in row order.
pub const MLA_IN_PARTS: [&str; 3] = ["q_a_proj", "kv_a_proj_with_mqa", "g_proj"];

/// A bf16 norm weight with its epsilon.
pub struct DevNorm {
    pub w: CudaSlice<bf16>,
    pub eps: f32,
}

impl DevNorm {
    /// This norm over contiguous rows `x` `[rows, dim]` into `y` `[rows, dim]`.
    pub fn args(&self, gpu: &Gpu, x: DPtr, y: DPtr, rows: usize, dim: usize) -> RmsNormArgs {
        RmsNormArgs::packed(x, gpu.ptr(&self.w), y, rows, dim, self.eps)
    }
}

pub struct DevKda {
    /// q, k, v, g, f_a, b ([`KDA_IN_PARTS`]) of the normalised input.
    pub in_proj: DevMerged,
    pub o_proj: DevLinear,
    pub f_b_proj: DevLinear,
    /// q, k, v conv weights, each `[P, kernel]` f32.
    pub conv: [CudaSlice<f32>; 3],
    /// `exp(A_log[h])`, `[H]`.
    pub a: CudaSlice<f32>,
    /// `[P]`
    pub dt_bias: CudaSlice<f32>,
    /// `[head_dim]`
    pub o_norm: CudaSlice<f32>,
}

pub struct DevMla {
    /// q_a, kv_a (with the rope part), g ([`MLA_IN_PARTS`]) of the normalised input.
    pub in_proj: DevMerged,
    pub q_a_norm: DevNorm,
    pub q_b_proj: DevLinear,
    pub kv_a_norm: DevNorm,
    pub kv_b_proj: DevLinear,
    pub o_proj: DevLinear,
}

/// A SiTU MLP: `gate_proj` and `up_proj` stacked into one matrix (parts [`MLP_IN_PARTS`]), and `down_proj`.
pub struct DevMlp {
    pub gate_up: DevMerged,
    pub down: DevLinear,
}

impl DevMlp {
    /// The intermediate width.
    pub fn inter(&self) -> usize {
        self.gate_up.bounds[1]
    }
}

/// One MXFP4 projection `[out, in]` of every expert of a layer that the rank holds (all of them but under expert
/// parallelism, `Shard::experts`), each expert's codes and scales in the tiled layout of
/// [`crate::cuda::expert_layout`] (expert after expert, in expert order).
pub struct DevExperts {
    pub packed: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
}

pub struct DevMoe {
    pub router: DevLinear,
    /// `[E]` f32
    pub bias: CudaSlice<f32>,
    pub down: DevLinear,
    pub up: DevLinear,
    pub norm: DevNorm,
    pub shared: Option<DevMlp>,
    pub w1: DevExperts,
    pub w2: DevExperts,
    pub w3: DevExperts,
}

pub enum DevMixer {
    Kda(Box<DevKda>),
    Mla(Box<DevMla>),
}

pub enum DevFfn {
    Dense(Box<DevMlp>),
    Moe(Box<DevMoe>),
}

pub struct DevLayer {
    /// Folded AttnRes pseudo-queries `[d]` f32.
    pub attn_res: CudaSlice<f32>,
    pub input_norm: DevNorm,
    pub mixer: DevMixer,
    pub mlp_res: CudaSlice<f32>,
    pub post_norm: DevNorm,
    pub ffn: DevFfn,
}

pub struct DevWeights {
    /// `[V, d]`
    pub embed: CudaSlice<bf16>,
    pub layers: Vec<DevLayer>,
    pub out_res: CudaSlice<f32>,
    pub norm: DevNorm,
    pub lm_head: DevLinear,
    /// Bytes uploaded.
    pub bytes: usize,
    /// Seconds the load spent fetching (or generating) tensors on the host, and copying them over.
    pub fetch_seconds: f64,
    pub upload_seconds: f64,
}

struct Uploader<'a> {
    gpu: &'a Gpu,
    specs: HashMap<String, ExpectedTensor>,
    src: &'a dyn WeightSource,
    /// The part of each tensor this rank uploads.
    shard: Shard,
    bytes: usize,
    /// Seconds spent fetching (or generating) tensors, and uploading them.
    fetch_seconds: f64,
    upload_seconds: f64,
}

impl Uploader<'_> {
    /// The whole tensor `name`, as stored.
    fn whole(&mut self, name: &str) -> Result<HostTensor> {
        let spec = self.specs.get(name).ok_or_else(|| KernelError::MissingTensor { name: name.to_string() })?.clone();
        self.fetch(&spec)
    }

    /// This rank's part of the tensor `name`, as stored.
    fn raw(&mut self, name: &str) -> Result<HostTensor> {
        let t = self.whole(name)?;
        self.shard.part_tensor(name, t)
    }

    fn fetch(&mut self, spec: &ExpectedTensor) -> Result<HostTensor> {
        let t0 = Instant::now();
        let t = self.src.tensor(spec);
        self.fetch_seconds += t0.elapsed().as_secs_f64();
        t
    }

    fn put<T>(&mut self, up: impl FnOnce(&Gpu) -> Result<T>) -> Result<T> {
        let t0 = Instant::now();
        let out = up(self.gpu);
        self.upload_seconds += t0.elapsed().as_secs_f64();
        out
    }

    fn bf16(&mut self, name: &str) -> Result<CudaSlice<bf16>> {
        let t = self.raw(name)?;
        self.upload_bf16(name, &t)
    }

    fn upload_bf16(&mut self, name: &str, t: &HostTensor) -> Result<CudaSlice<bf16>> {
        if t.dtype != DType::Bf16 {
            return Err(KernelError::TensorMismatch {
                name: name.into(),
                expected: "BF16".into(),
                found: t.dtype.name().into(),
            });
        }
        self.bytes += t.bytes().len();
        self.put(|gpu| gpu.upload_bytes(t.bytes()))
    }

    fn f32(&mut self, name: &str) -> Result<CudaSlice<f32>> {
        let v = self.raw(name)?.to_f32()?;
        self.bytes += v.len() * 4;
        self.put(|gpu| gpu.upload(&v))
    }

    fn linear(&mut self, name: &str) -> Result<DevLinear> {
        // Fetched once: the shape and the bytes come from the same tensor.
        let t = self.raw(name)?;
        let (out_dim, in_dim) = (t.shape[0], t.shape[1..].iter().product());
        Ok(DevLinear { w: self.upload_bf16(name, &t)?, out_dim, in_dim })
    }

    /// The bf16 matrices `names` stacked into one; shapes come from the schema, so the device matrix is
    /// allocated before any part is fetched and the host holds one part at a time.
    fn merged(&mut self, names: &[String]) -> Result<DevMerged> {
        let mut bounds = vec![0usize];
        let mut in_dim = None;
        for name in names {
            let spec = self.specs.get(name).ok_or_else(|| KernelError::MissingTensor { name: name.clone() })?;
            let (rows, cols) = match &spec.shape {
                crate::tensor::ShapeRule::Exact(s) if s.len() == 2 => (s[0], s[1]),
                other => {
                    return Err(KernelError::InvalidInput(format!("`{name}` is not a matrix in the schema: {other:?}")))
                }
            };
            // This rank's part (`raw` below cuts the same, and the byte check holds it to these dims).
            let (rows, cols) = match self.shard.split_axis(split_of(name)?) {
                None => (rows, cols),
                Some(0) => (rows / self.shard.world, cols),
                Some(_) => (rows, cols / self.shard.world),
            };
            if *in_dim.get_or_insert(cols) != cols {
                return Err(KernelError::TensorMismatch {
                    name: name.clone(),
                    expected: format!("{} input columns, as the projections merged with it", in_dim.unwrap_or(0)),
                    found: format!("{cols}"),
                });
            }
            bounds.push(bounds[bounds.len() - 1] + rows);
        }
        let in_dim = in_dim.unwrap_or(0);
        let w = self.gpu.zeros::<bf16>(bounds[bounds.len() - 1] * in_dim)?;
        for (name, rows) in names.iter().zip(bounds.windows(2)) {
            let t = self.raw(name)?;
            let expected = (rows[1] - rows[0]) * in_dim * 2;
            if t.dtype != DType::Bf16 || t.bytes().len() != expected {
                return Err(KernelError::TensorMismatch {
                    name: name.clone(),
                    expected: format!("BF16, {expected} bytes"),
                    found: format!("{}, {} bytes", t.dtype.name(), t.bytes().len()),
                });
            }
            self.put(|gpu| gpu.upload_bytes_at(gpu.ptr(&w) + (rows[0] * in_dim * 2) as u64, t.bytes()))?;
            self.bytes += expected;
        }
        let table: Vec<i32> = bounds.iter().map(|b| *b as i32).collect();
        let bounds_dev = self.put(|gpu| gpu.upload(&table))?;
        Ok(DevMerged { w, in_dim, bounds, bounds_dev })
    }

    fn norm(&mut self, name: &str, eps: f32) -> Result<DevNorm> {
        Ok(DevNorm { w: self.bf16(name)?, eps })
    }

    fn attn_res(&mut self, norm: &str, proj: &str) -> Result<CudaSlice<f32>> {
        let n = self.raw(norm)?.to_f32()?;
        let p = self.raw(proj)?.to_f32()?;
        let q: Vec<f32> = n.iter().zip(&p).map(|(a, b)| a * b).collect();
        self.bytes += q.len() * 4;
        self.put(|gpu| gpu.upload(&q))
    }

    fn mlp(&mut self, prefix: &str) -> Result<DevMlp> {
        let parts: Vec<String> = MLP_IN_PARTS.iter().map(|p| format!("{prefix}.{p}.weight")).collect();
        let gate_up = self.merged(&parts)?;
        if gate_up.bounds[1] * 2 != gate_up.out_dim() {
            return Err(KernelError::InvalidInput(format!(
                "`{prefix}`: gate_proj has {} rows and up_proj {}; SiTU needs them equal",
                gate_up.bounds[1],
                gate_up.out_dim() - gate_up.bounds[1]
            )));
        }
        Ok(DevMlp { gate_up, down: self.linear(&format!("{prefix}.down_proj.weight"))? })
    }

    /// Every expert's `proj` of layer `l`, concatenated in expert order on the device in the tiled layout of
    /// [`crate::cuda::expert_layout`]; each expert's tensors are tiled and uploaded as they arrive, so the host
    /// holds one expert at a time.
    fn experts(&mut self, cfg: &ModelConfig, l: usize, proj: &str) -> Result<DevExperts> {
        let specs = expert_specs(cfg, l, 0, proj);
        let (rows, cols) = match &specs[0].shape {
            crate::tensor::ShapeRule::Exact(shape) if shape.len() == 2 => (shape[0], shape[1] * 2),
            other => {
                return Err(KernelError::InvalidInput(format!(
                    "expert tensor `{}` has no exact 2-d shape: {other:?}",
                    specs[0].name
                )))
            }
        };
        // [out, in] of this rank's part of each expert it holds (whole, or split by the inner width).
        let (rows, cols) = match self.shard.split_axis(split_of(&specs[0].name)?) {
            None => (rows, cols),
            Some(0) => (rows / self.shard.world, cols),
            Some(_) => (rows, cols / self.shard.world),
        };
        let (per_packed, per_scales) = (rows * cols / 2, rows * cols / crate::mxfp4::GROUP_SIZE);
        let (tiled_packed, tiled_scales) = (tiled_code_bytes(rows, cols), tiled_scale_bytes(rows, cols));
        let held = self.shard.experts(cfg.moe.num_experts);
        let packed = self.gpu.zeros::<u8>(held.len() * tiled_packed)?;
        let scales = self.gpu.zeros::<u8>(held.len() * tiled_scales)?;
        type Tiling = fn(&[u8], usize, usize) -> Result<Vec<u8>>;
        for (slot, e) in held.enumerate() {
            let specs = expert_specs(cfg, l, e, proj);
            let parts: [(_, _, _, _, Tiling); 2] = [
                (&specs[0], &packed, per_packed, tiled_packed, tile_codes),
                (&specs[1], &scales, per_scales, tiled_scales, tile_scales),
            ];
            for (spec, dst, per, tiled, tiling) in parts {
                let t = self.fetch(spec)?;
                let t = self.shard.part_tensor(&spec.name, t)?;
                if t.bytes().len() != per {
                    return Err(KernelError::TensorMismatch {
                        name: spec.name.clone(),
                        expected: format!("{per} bytes"),
                        found: format!("{} bytes", t.bytes().len()),
                    });
                }
                let bytes = tiling(t.bytes(), rows, cols)?;
                self.put(|gpu| gpu.upload_bytes_at(gpu.ptr(dst) + (slot * tiled) as u64, &bytes))?;
                self.bytes += per;
            }
        }
        Ok(DevExperts { packed, scales })
    }
}

/// Whether the CUDA kernels take the widths of `cfg` (a whole model's config, or a rank's `Shard::local_config`),
/// checked before any weight is fetched: KDA head dim and conv kernel, MLA widths, and routed experts in MXFP4 with
/// groups of 32 whose latent and inner widths are whole groups (split by width over `N` ranks, an expert's inner
/// width must stay a multiple of 32). The kernels themselves are compiled once per device whatever the widths
/// (`cuda::compile`: shapes are launch arguments), so a shard whose widths pass here runs the same CUBINs.
pub fn check_shapes(cfg: &ModelConfig) -> Result<()> {
    match cfg.moe.expert_format {
        ExpertFormat::Mxfp4 { group_size: 32 } => {}
        other => {
            return Err(KernelError::config(
                "quantization_config",
                format!("the CUDA backend runs MXFP4 experts with groups of 32; this checkpoint has {other:?}"),
            ))
        }
    }
    check_kda_shape(cfg.kda.head_dim, cfg.kda.conv_kernel)?;
    check_mla_shape(&cfg.mla)?;
    check_expert_width("latent", cfg.moe.latent_dim)?;
    check_expert_width("expert", cfg.moe.expert_dim)
}

impl DevWeights {
    /// Uploads and checks every tensor of `cfg` from `src`.
    pub fn load(gpu: &Gpu, cfg: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_shard(gpu, cfg, src, Shard::WHOLE)
    }

    /// Uploads and checks every tensor of `cfg` (the whole model's config) from `src`, keeping `shard`'s part of
    /// each; a group size that does not divide the model, or that would cut an MXFP4 group, is an error naming
    /// the flag or the tensor. `DeviceModel::sharded` runs the rank's forward over these parts (`cuda::tp`).
    pub fn load_shard(gpu: &Gpu, cfg: &ModelConfig, src: &dyn WeightSource, shard: Shard) -> Result<Self> {
        check_shapes(&shard.local_config(cfg)?)?;
        let specs = model_tensors(cfg).into_iter().map(|s| (s.name.clone(), s)).collect();
        let mut up = Uploader { gpu, specs, src, shard, bytes: 0, fetch_seconds: 0.0, upload_seconds: 0.0 };
        let eps = cfg.rms_norm_eps;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (l, kind) in cfg.layers.iter().enumerate() {
            let n = |s: &str| layer_name(l, s);
            let mixer = match kind.mixer {
                Mixer::Kda => {
                    // Stored with max(heads, head_dim) entries; the rule splits the first `heads`.
                    let a_name = n("self_attn.A_log");
                    let a_log = up.whole(&a_name)?.to_f32()?;
                    let a = shard.part(
                        split_of(&a_name)?,
                        a_log[..cfg.kda.num_heads].iter().map(|x| x.exp()).collect(),
                        1,
                    )?;
                    DevMixer::Kda(Box::new(DevKda {
                        in_proj: up.merged(&KDA_IN_PARTS.map(|p| n(&format!("self_attn.{p}.weight"))))?,
                        o_proj: up.linear(&n("self_attn.o_proj.weight"))?,
                        f_b_proj: up.linear(&n("self_attn.f_b_proj.weight"))?,
                        conv: [
                            up.f32(&n("self_attn.q_conv1d.weight"))?,
                            up.f32(&n("self_attn.k_conv1d.weight"))?,
                            up.f32(&n("self_attn.v_conv1d.weight"))?,
                        ],
                        a: gpu.upload(&a)?,
                        dt_bias: up.f32(&n("self_attn.dt_bias"))?,
                        o_norm: up.f32(&n("self_attn.o_norm.weight"))?,
                    }))
                }
                Mixer::Mla => DevMixer::Mla(Box::new(DevMla {
                    in_proj: up.merged(&MLA_IN_PARTS.map(|p| n(&format!("self_attn.{p}.weight"))))?,
                    q_a_norm: up.norm(&n("self_attn.q_a_layernorm.weight"), crate::config::MLA_NORM_EPS)?,
                    q_b_proj: up.linear(&n("self_attn.q_b_proj.weight"))?,
                    kv_a_norm: up.norm(&n("self_attn.kv_a_layernorm.weight"), crate::config::MLA_NORM_EPS)?,
                    kv_b_proj: up.linear(&n("self_attn.kv_b_proj.weight"))?,
                    o_proj: up.linear(&n("self_attn.o_proj.weight"))?,
                })),
            };
            let ffn = match kind.ffn {
                Ffn::Dense => DevFfn::Dense(Box::new(up.mlp(&n("mlp"))?)),
                Ffn::Moe => {
                    let m = |s: &str| n(&format!("block_sparse_moe.{s}"));
                    DevFfn::Moe(Box::new(DevMoe {
                        router: up.linear(&m("gate.weight"))?,
                        bias: up.f32(&m("gate.e_score_correction_bias"))?,
                        down: up.linear(&m("routed_expert_down_proj.weight"))?,
                        up: up.linear(&m("routed_expert_up_proj.weight"))?,
                        norm: up.norm(&m("routed_expert_norm.weight"), eps)?,
                        shared: if cfg.moe.num_shared_experts > 0 { Some(up.mlp(&m("shared_experts"))?) } else { None },
                        w1: up.experts(cfg, l, "w1")?,
                        w2: up.experts(cfg, l, "w2")?,
                        w3: up.experts(cfg, l, "w3")?,
                    }))
                }
            };
            layers.push(DevLayer {
                attn_res: up.attn_res(&n("self_attention_res_norm.weight"), &n("self_attention_res_proj.weight"))?,
                input_norm: up.norm(&n("input_layernorm.weight"), eps)?,
                mixer,
                mlp_res: up.attn_res(&n("mlp_res_norm.weight"), &n("mlp_res_proj.weight"))?,
                post_norm: up.norm(&n("post_attention_layernorm.weight"), eps)?,
                ffn,
            });
        }
        let embed = up.bf16("model.embed_tokens.weight")?;
        let out_res = up.attn_res("model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight")?;
        let norm = up.norm("model.norm.weight", eps)?;
        let lm_head = up.linear("lm_head.weight")?;
        Ok(DevWeights {
            embed,
            layers,
            out_res,
            norm,
            lm_head,
            bytes: up.bytes,
            fetch_seconds: up.fetch_seconds,
            upload_seconds: up.upload_seconds,
        })
    }
}
