//! The CUDA backend's side of tensor parallelism on a GPU: a rank's weights (`DevWeights::load_shard`) are exactly its
//! part of each tensor under `shard_rule`, byte for byte as uploaded (merged projections part by part, row-parallel
//! projections by columns, the vocabulary-parallel head, the routed experts it holds in the tiled MXFP4 layout), and
//! the whole model loaded as the shard of a group of one is the model `DevWeights::load` uploads. The sharded forward
//! (`DeviceModel::sharded`, `cuda::tp`): a group of one, through NCCL (graphs captured with the collectives in them)
//! and through the host-staged communicator, computes the whole model's logits bit for bit, over a prefill of two
//! rows and teacher-forced decode steps; two ranks sharing the GPU (threads, `HostComm`) hold the same logits on
//! both ranks and agree with the whole model as the CPU's ranks do (`cpu_tp.rs`: 5% relative L2 before the first
//! routing difference, which must be a near-tie; the same greedy token unless the whole model's top two are closer
//! than the difference). Every test here needs a GPU, so all are `#[ignore]`d; the lead runs them on the GPU
//! machine:
//!
//! ```sh
//! SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/x cuda_tp cuda_nccl   # here, no GPU
//! . kernels/bench/device_env.sh .bin/x && NCCL_NVLS_ENABLE=0 .bin/x/cuda_tp --include-ignored --test-threads 1
//! ```

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;
use sparkd_kernels::comm::local_group;
use sparkd_kernels::cuda::expert_layout::tile_codes;
use sparkd_kernels::cuda::forward::DeviceModel;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::nccl::{unique_id, DeviceCommunicator, NcclComm, NcclGroup};
use sparkd_kernels::cuda::ops::Ops;
use sparkd_kernels::cuda::state::{DeviceRow, DeviceState};
use sparkd_kernels::cuda::tp::{DeviceGroup, HostComm};
use sparkd_kernels::cuda::weights::{DevFfn, DevMixer, DevWeights, KDA_IN_PARTS};
use sparkd_kernels::routing::Routing;
use sparkd_kernels::schema::{expert_specs, layer_name};
use sparkd_kernels::shard_rule::Shard;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::tensor::{ExpectedTensor, WeightSource};
use sparkd_kernels::{ModelConfig, TokenId};

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

/// Two prompts of different lengths, then teacher-forced decode steps (one token per row each): the inputs every
/// model under comparison sees, so their logits can be compared at every position.
struct Script {
    prompts: [Vec<TokenId>; 2],
    steps: Vec<[TokenId; 2]>,
}

fn script(vocab: usize) -> Script {
    let token = |i: usize| ((i * 7919 + 13) % vocab) as TokenId;
    Script {
        prompts: [(0..23).map(token).collect(), (100..109).map(token).collect()],
        steps: (200..206).map(|i| [token(i), token(i + 50)]).collect(),
    }
}

/// One forward's results: `[positions, V]` logits (rows in order) and, when traced, the routing per MoE layer.
struct Call {
    logits: Vec<f32>,
    routing: Vec<Vec<Routing<f32>>>,
}

/// Runs `script` through `model`: the prefill (logits at every position) then each decode step. `traced` records
/// the routing (and so runs every step eagerly).
fn run(gpu: &Gpu, model: &DeviceModel, script: &Script, traced: bool) -> Vec<Call> {
    let mut states = [DeviceState::new(gpu, &model.cfg).unwrap(), DeviceState::new(gpu, &model.cfg).unwrap()];
    let mut calls = Vec::new();
    let mut call = |states: &mut [DeviceState; 2], windows: [&[TokenId]; 2], logits_from: [usize; 2]| {
        let [a, b] = states;
        let mut rows = [
            DeviceRow { state: a, tokens: windows[0], logits_from: logits_from[0], snapshots_from: None },
            DeviceRow { state: b, tokens: windows[1], logits_from: logits_from[1], snapshots_from: None },
        ];
        let mut routing = Vec::new();
        let out = model.forward(gpu, &mut rows, traced.then_some(&mut routing)).unwrap();
        let logits = gpu.download(&out.logits, out.logits.len()).unwrap().iter().map(|x| x.to_f32()).collect();
        calls.push(Call { logits, routing });
    };
    call(&mut states, [&script.prompts[0], &script.prompts[1]], [0, 0]);
    for step in &script.steps {
        call(&mut states, [&step[..1], &step[1..]], [0, 0]);
    }
    calls
}

fn whole_model(cfg: &ModelConfig, seed: u64) -> (Gpu, DeviceModel) {
    let gpu = Gpu::new(0).unwrap();
    let weights = DevWeights::load(&gpu, cfg, &SyntheticWeights::new(cfg.clone(), seed)).unwrap();
    let model = DeviceModel::new(cfg.clone(), weights, Ops::load(&gpu).unwrap());
    (gpu, model)
}

fn rank_model(gpu: &Gpu, cfg: &ModelConfig, seed: u64, comm: Arc<dyn DeviceCommunicator>) -> DeviceModel {
    let shard = Shard { rank: comm.rank(), world: comm.world_size(), expert_parallel: false };
    let weights = DevWeights::load_shard(gpu, cfg, &SyntheticWeights::new(cfg.clone(), seed), shard).unwrap();
    DeviceModel::sharded(cfg, weights, Ops::load(gpu).unwrap(), DeviceGroup::new(shard, comm).unwrap()).unwrap()
}

fn assert_same_bits(got: &[Call], want: &[Call], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.logits.len(), w.logits.len(), "{what}: call {i}");
        let differ = g.logits.iter().zip(&w.logits).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{what}: call {i} has {differ} logits that differ from the whole model's");
    }
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn a_group_of_one_computes_the_whole_models_bits_through_nccl_and_through_the_host() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let script = script(cfg.vocab_size);
    let (gpu, whole) = whole_model(&cfg, 5);
    let want = run(&gpu, &whole, &script, false);
    assert!(whole.graph_stats().replayed > 0, "the whole model's decode steps replay graphs");

    let id = unique_id().unwrap();
    let nccl: Arc<dyn DeviceCommunicator> =
        Arc::new(NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank: 0, world: 1 }).unwrap());
    let through_nccl = rank_model(&gpu, &cfg, 5, nccl);
    assert_same_bits(&run(&gpu, &through_nccl, &script, false), &want, "TP1 through NCCL");
    let stats = through_nccl.graph_stats();
    assert!(stats.captured > 0 && stats.replayed > 0, "NCCL's collectives are captured with the step: {stats:?}");

    let host: Arc<dyn DeviceCommunicator> = Arc::new(HostComm::new(local_group(1, None).unwrap().remove(0)));
    let through_host = rank_model(&gpu, &cfg, 5, host);
    assert_same_bits(&run(&gpu, &through_host, &script, false), &want, "TP1 through the host");
    assert_eq!(through_host.graph_stats().captured, 0, "a host-staged group runs eagerly");
}

/// The relative L2 distance of `got` from `want`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
}

/// The gap between the two largest logits of `row`.
fn top_two_gap(row: &[f32]) -> f32 {
    let best = argmax(row);
    let second = row.iter().enumerate().filter(|(i, _)| *i != best).map(|(_, v)| *v).fold(f32::MIN, f32::max);
    row[best] - second
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn two_ranks_sharing_the_gpu_agree_with_the_whole_model() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let vocab = cfg.vocab_size;
    let script = script(vocab);
    let (gpu, whole) = whole_model(&cfg, 9);
    let want = run(&gpu, &whole, &script, true);
    let ranks: Vec<Vec<Call>> = std::thread::scope(|s| {
        let handles: Vec<_> = local_group(2, Some(std::time::Duration::from_secs(120)))
            .unwrap()
            .into_iter()
            .map(|comm| {
                let (cfg, script) = (&cfg, &script);
                s.spawn(move || {
                    let gpu = Gpu::new(0).unwrap();
                    let model = rank_model(&gpu, cfg, 9, Arc::new(HostComm::new(comm)));
                    assert_eq!(model.cfg.kda.num_heads * 2, cfg.kda.num_heads, "the rank's config is its share");
                    run(&gpu, &model, script, true)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_same_bits(&ranks[1], &ranks[0], "rank 1 against rank 0");

    // A row whose routing differed from the whole model's (a near-tie, asserted) has a different state from then
    // on: its later positions are not compared. Every position's logits were asked for, so positions are tokens.
    let (mut positions, mut compared, mut flips) = (0usize, 0usize, 0usize);
    let mut diverged = [false; 2];
    for (c, (got, w)) in ranks[0].iter().zip(&want).enumerate() {
        let lens = if c == 0 { [script.prompts[0].len(), script.prompts[1].len()] } else { [1, 1] };
        for (row, span) in [0..lens[0], lens[0]..lens[0] + lens[1]].into_iter().enumerate() {
            let flip =
                span.clone().find(|t| got.routing.iter().zip(&w.routing).any(|(g, w)| g[*t].experts != w[*t].experts));
            if let Some(t) = flip.filter(|_| !diverged[row]) {
                flips += 1;
                let (g, w) = got.routing.iter().zip(&w.routing).find(|(g, w)| g[t].experts != w[t].experts).unwrap();
                let margin = g[t].margin.min(w[t].margin);
                assert!(margin < 0.01, "call {c}: token {t}'s routing differs at margin {margin} (not a near-tie)");
            }
            for p in span {
                positions += 1;
                if diverged[row] || flip.is_some_and(|t| p >= t) {
                    continue;
                }
                compared += 1;
                let (g, w) = (&got.logits[p * vocab..(p + 1) * vocab], &w.logits[p * vocab..(p + 1) * vocab]);
                let rel = rel_l2(g, w);
                assert!(rel < 0.05, "call {c} position {p}: relative L2 {rel} from the whole model");
                // A different greedy token needs the whole model's top two within twice the largest difference.
                let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(
                    argmax(g) == argmax(w) || top_two_gap(w) <= 2.0 * diff,
                    "call {c} position {p}: greedy token {} against the whole model's {} (top-two gap {}, max diff \
                     {diff})",
                    argmax(g),
                    argmax(w),
                    top_two_gap(w)
                );
            }
            diverged[row] |= flip.is_some();
        }
    }
    println!("{compared} of {positions} positions compared, {flips} rows with a routing near-tie");
    assert!(compared * 2 > positions, "{compared} of {positions} positions compared ({flips} calls with a flip)");
}
