//! The CUDA backend's side of tensor parallelism on a GPU: a rank's weights (`DevWeights::load_shard`) are exactly its
//! part of each tensor under `shard_rule`, byte for byte as uploaded (merged projections part by part, row-parallel
//! projections by columns, the vocabulary-parallel head, the routed experts it holds in the tiled MXFP4 layout), and
//! the whole model loaded as the shard of a group of one is the model `DevWeights::load` uploads. The sharded forward
//! itself is not built yet (docs/multi-gpu.md, "The sharded CUDA forward"). Every test here needs a GPU, so all are
//! `#[ignore]`d; the lead runs them on the GPU machine:
//!
//! ```sh
//! SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/x cuda_tp cuda_nccl   # here, no GPU
//! . kernels/bench/device_env.sh .bin/x && NCCL_NVLS_ENABLE=0 .bin/x/cuda_tp --include-ignored --test-threads 1
//! ```

use cudarc::driver::CudaSlice;
use half::bf16;
use sparkd_kernels::cuda::expert_layout::tile_codes;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::weights::{DevFfn, DevMixer, DevWeights, KDA_IN_PARTS};
use sparkd_kernels::schema::{expert_specs, layer_name};
use sparkd_kernels::shard_rule::Shard;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::tensor::{ExpectedTensor, WeightSource};
use sparkd_kernels::ModelConfig;

/// The stored bytes of `shard`'s part of the tensor `name`.
fn part(src: &SyntheticWeights, cfg: &ModelConfig, shard: Shard, name: &str) -> Vec<u8> {
    let spec = spec(cfg, name);
    shard.part_tensor(name, src.tensor(&spec).unwrap()).unwrap().bytes().to_vec()
}

fn spec(cfg: &ModelConfig, name: &str) -> ExpectedTensor {
    sparkd_kernels::schema::model_tensors(cfg).into_iter().find(|s| s.name == name).unwrap()
}

fn bytes_of(gpu: &Gpu, w: &CudaSlice<bf16>) -> Vec<u8> {
    gpu.download(w, w.len()).unwrap().iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn check_rank(gpu: &Gpu, cfg: &ModelConfig, src: &SyntheticWeights, shard: Shard) {
    let w = DevWeights::load_shard(gpu, cfg, src, shard).unwrap();
    let p = |name: &str| part(src, cfg, shard, name);
    assert_eq!(bytes_of(gpu, &w.embed), p("model.embed_tokens.weight"), "{shard:?}: embedding");
    assert_eq!(bytes_of(gpu, &w.lm_head.w), p("lm_head.weight"), "{shard:?}: lm_head");
    for (l, layer) in w.layers.iter().enumerate() {
        let n = |s: &str| layer_name(l, &format!("self_attn.{s}.weight"));
        match &layer.mixer {
            DevMixer::Kda(k) => {
                let want: Vec<u8> = KDA_IN_PARTS.iter().flat_map(|x| p(&n(x))).collect();
                assert_eq!(bytes_of(gpu, &k.in_proj.w), want, "{shard:?}: layer {l} KDA in_proj");
                assert_eq!(bytes_of(gpu, &k.o_proj.w), p(&n("o_proj")), "{shard:?}: layer {l} KDA o_proj");
                assert_eq!(k.o_proj.in_dim * shard.world, cfg.kda.proj_dim(), "{shard:?}: layer {l}");
            }
            DevMixer::Mla(m) => {
                assert_eq!(bytes_of(gpu, &m.q_b_proj.w), p(&n("q_b_proj")), "{shard:?}: layer {l} q_b_proj");
                assert_eq!(bytes_of(gpu, &m.kv_b_proj.w), p(&n("kv_b_proj")), "{shard:?}: layer {l} kv_b_proj");
                assert_eq!(bytes_of(gpu, &m.o_proj.w), p(&n("o_proj")), "{shard:?}: layer {l} MLA o_proj");
            }
        }
        if let DevFfn::Moe(moe) = &layer.ffn {
            let held = shard.experts(cfg.moe.num_experts);
            let codes = gpu.download(&moe.w2.packed, moe.w2.packed.len()).unwrap();
            let per = codes.len() / held.len();
            for (slot, e) in held.enumerate() {
                let s = expert_specs(cfg, l, e, "w2");
                let mine = shard.part_tensor(&s[0].name, src.tensor(&s[0]).unwrap()).unwrap();
                let tiled = tile_codes(mine.bytes(), mine.shape[0], mine.shape[1] * 2).unwrap();
                assert_eq!(
                    &codes[slot * per..(slot + 1) * per],
                    tiled.as_slice(),
                    "{shard:?}: layer {l} expert {e} w2"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn a_rank_uploads_exactly_its_part_of_every_weight() {
    let gpu = Gpu::new(0).unwrap();
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 3);
    for (world, expert_parallel) in [(1, false), (2, false), (2, true)] {
        for rank in 0..world {
            check_rank(&gpu, &cfg, &src, Shard { rank, world, expert_parallel });
        }
    }
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn a_split_that_cuts_an_mxfp4_group_is_refused_at_load() {
    let gpu = Gpu::new(0).unwrap();
    let cfg = ModelConfig::preset("k3-tiny").unwrap(); // 64-wide experts: 16 per rank over 4
    let src = SyntheticWeights::new(cfg.clone(), 3);
    let err = DevWeights::load_shard(&gpu, &cfg, &src, Shard { rank: 0, world: 4, expert_parallel: false })
        .err()
        .expect("refused");
    assert!(err.to_string().contains("multiple of 32"), "{err}");
}
