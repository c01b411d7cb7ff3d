//! The CUDA backend's side of tensor parallelism on a GPU: a rank's weights (`DevWeights::load_shard`) are exactly its
//! part of each tensor under `shard_rule`, byte for byte as uploaded (merged projections part by part, row-parallel
//! projections by columns, the vocabulary-parallel head, the routed experts it holds in the tiled MXFP4 layout), and
//! the whole model loaded as the shard of a group of one is the model `DevWeights::load` uploads. The sharded forward
//! (`DeviceModel::sharded`, `cuda::tp`): a group of one, through NCCL (graphs captured with the collectives in them)
//! and through the host-staged communicator, computes the whole model's logits bit for bit, over a prefill of two
//! rows and teacher-forced decode steps; two ranks sharing the GPU (threads, `HostComm`) hold the same logits on
//! both ranks and agree with the whole model as the CPU's ranks do (`cpu_tp.rs`: 5% relative L2 before the first
//! routing difference, which must be a near-tie; the same greedy token unless the whole model's top two are closer
//! than the difference). The sharded runner (`CudaRunner::sharded` leading, `cuda::follower::Follower` following on
//! threads, two ranks sharing the GPU) keeps the `Runner` contract (`contract/`), and a state imported into it
//! exports the same values (its shards joined back), so states move between sharded and whole runners. Every test
//! here needs a GPU, so all are `#[ignore]`d; the lead runs them on the GPU
//! machine:
//!
//! ```sh
//! SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/x cuda_tp cuda_nccl   # here, no GPU
//! . kernels/bench/device_env.sh .bin/x && NCCL_NVLS_ENABLE=0 .bin/x/cuda_tp --include-ignored --test-threads 1
//! ```

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::CudaSlice;
use half::bf16;
use sparkd_kernels::comm::{local_group, LocalComm};
use sparkd_kernels::cuda::expert_layout::tile_codes;
use sparkd_kernels::cuda::follower::Follower;
use sparkd_kernels::cuda::forward::DeviceModel;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::nccl::{unique_id, DeviceCommunicator, NcclComm, NcclGroup};
use sparkd_kernels::cuda::ops::Ops;
use sparkd_kernels::cuda::state::{DeviceRow, DeviceState};
use sparkd_kernels::cuda::tp::{DeviceGroup, HostComm};
use sparkd_kernels::cuda::weights::{DevFfn, DevMixer, DevWeights, KDA_IN_PARTS};
use sparkd_kernels::cuda::CudaRunner;
use sparkd_kernels::routing::Routing;
use sparkd_kernels::runner::RowInput;
use sparkd_kernels::schema::{expert_specs, layer_name};
use sparkd_kernels::shard_rule::Shard;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::tensor::{ExpectedTensor, WeightSource};
use sparkd_kernels::{ModelConfig, Runner, TokenId};

// The launch-ahead checks of the contract are left out: a CUDA group steps one step at a time (asserted below).
#[allow(dead_code)]
mod contract;
use contract::*;

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
    group_of_one_is_whole(&ModelConfig::preset("k3-tiny").unwrap());
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn a_group_of_one_at_k3_minis_widths_computes_the_whole_models_bits() {
    group_of_one_is_whole(&ModelConfig::preset("k3-mini").unwrap());
}

/// The whole model's logits over [`script`] against a group of one's, through NCCL and through the host.
fn group_of_one_is_whole(cfg: &ModelConfig) {
    let cfg = cfg.clone();
    let script = script(cfg.vocab_size);
    let (gpu, whole) = whole_model(&cfg, 5);
    let want = run(&gpu, &whole, &script, false);
    assert!(whole.graph_stats().replayed > 0, "the whole model's decode steps replay graphs");
    drop(whole);

    let id = unique_id().unwrap();
    let nccl: Arc<dyn DeviceCommunicator> =
        Arc::new(NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank: 0, world: 1 }).unwrap());
    let through_nccl = rank_model(&gpu, &cfg, 5, nccl);
    assert_same_bits(&run(&gpu, &through_nccl, &script, false), &want, "TP1 through NCCL");
    let stats = through_nccl.graph_stats();
    assert!(stats.captured > 0 && stats.replayed > 0, "NCCL's collectives are captured with the step: {stats:?}");
    drop(through_nccl);

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
    // k3-tiny's routers leave room: most positions precede any routing difference.
    let (compared, positions) = two_ranks_agree(&ModelConfig::preset("k3-tiny").unwrap());
    assert!(compared * 2 > positions, "{compared} of {positions} positions compared");
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn two_ranks_agree_with_the_whole_model_at_k3_minis_widths() {
    // At k3-mini's widths random routers are near-ties from the first tokens (measured: a routing difference after
    // 1 of 44 positions), so what is checked is the ranks' agreement, that every routing difference is a near-tie,
    // and the positions before one.
    let (compared, _) = two_ranks_agree(&ModelConfig::preset("k3-mini").unwrap());
    assert!(compared >= 1, "no position preceded a routing difference");
}

/// The forward of two ranks sharing the GPU (threads, `HostComm`) against the whole model's, over [`script`]:
/// returns how many positions were compared (those before their row's first routing difference) of all.
fn two_ranks_agree(cfg: &ModelConfig) -> (usize, usize) {
    let cfg = cfg.clone();
    let vocab = cfg.vocab_size;
    let script = script(vocab);
    let (gpu, whole) = whole_model(&cfg, 9);
    let want = run(&gpu, &whole, &script, true);
    drop((whole, gpu));
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
    (compared, positions)
}

fn host_group(comm: LocalComm) -> DeviceGroup {
    let comm: Arc<dyn DeviceCommunicator> = Arc::new(HostComm::new(comm));
    DeviceGroup::new(Shard { rank: comm.rank(), world: comm.world_size(), expert_parallel: false }, comm).unwrap()
}

/// Rank 0's runner of a group of `world` ranks sharing the GPU (`HostComm`), the other ranks following on threads
/// (each returns how its run ended).
fn sharded_runner(cfg: &ModelConfig, seed: u64, world: usize) -> (CudaRunner, Vec<JoinHandle<Result<(), String>>>) {
    // The followers wait for rank 0's plans while the test thread works between steps: a generous bound.
    let mut comms = local_group(world, Some(Duration::from_secs(300))).unwrap().into_iter();
    let lead = host_group(comms.next().unwrap());
    let followers = comms
        .map(|comm| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
                let src = SyntheticWeights::new(cfg.clone(), seed);
                let follower = Follower::new(gpu, &cfg, &src, host_group(comm)).map_err(|e| e.to_string())?;
                follower.run().map_err(|e| e.to_string())
            })
        })
        .collect();
    let src = SyntheticWeights::new(cfg.clone(), seed);
    (CudaRunner::sharded(Gpu::new(0).unwrap(), cfg.clone(), &src, lead).unwrap(), followers)
}

/// Drops rank 0's runner (which ends the group) and checks every follower returned cleanly.
fn end_group(runner: CudaRunner, followers: Vec<JoinHandle<Result<(), String>>>) {
    drop(runner);
    for (i, f) in followers.into_iter().enumerate() {
        assert_eq!(f.join().unwrap(), Ok(()), "follower {}", i + 1);
    }
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn a_sharded_runner_keeps_the_runner_contract() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let (mut runner, followers) = sharded_runner(&cfg, 11, 2);
    assert!(!runner.launches_ahead(), "a group steps one step at a time");
    let a = runner.alloc_state().unwrap();
    let row = RowInput { state: a, tokens: vec![1], sample: None };
    let err = runner.launch(std::slice::from_ref(&row)).unwrap_err();
    assert!(err.to_string().contains("one step at a time"), "{err}");
    assert_eq!(runner.state_len(a).unwrap(), 0, "a refused launch changes nothing");
    runner.free_state(a).unwrap();
    contract_prefill_chunks_equal_one_window(&mut runner);
    contract_greedy_speculation_is_lossless(&mut runner);
    contract_forks_and_exports_are_independent(&mut runner);
    contract_seeded_sampling_ignores_batching(&mut runner);
    contract_bad_input_is_rejected_without_side_effects(&mut runner);
    contract_row_masks_hold_at_every_position(&mut runner);
    end_group(runner, followers);
}

#[test]
#[ignore = "needs a GPU (see the command at the top of this file)"]
fn a_state_moves_between_a_whole_and_a_sharded_runner() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 13);
    let mut whole = CudaRunner::new(0, cfg.clone(), &src).unwrap();
    let prompt: Vec<TokenId> = (0..40).map(|i| (i * 7919 + 5) % 100_000).collect();
    let a = whole.alloc_state().unwrap();
    prefill(&mut whole, a, &prompt);
    let exported = whole.export_state(a).unwrap();
    let (mut sharded, followers) = sharded_runner(&cfg, 13, 2);
    let imported = sharded.import_state(exported.clone()).unwrap();
    assert_eq!(sharded.state_len(imported).unwrap(), 40);
    // Split over the ranks and joined back: the same values.
    assert_eq!(sharded.export_state(imported).unwrap(), exported, "the group's export of an imported state");
    // The KDA state is held once over the ranks, the MLA cache once on each: more than one whole state, less than two.
    let (group, one) = (sharded.state_bytes(imported).unwrap(), whole.state_bytes(a).unwrap());
    assert!(one < group && group < 2 * one, "the group holds {group} bytes of a {one}-byte state");
    end_group(sharded, followers);
}
