//! The device communicator (`cuda::nccl`) on GPUs: NCCL loads, a group of one is a copy (in place: nothing) for
//! every collective, eagerly and inside a captured CUDA graph, and over two GPUs (when the process sees two) the
//! collectives give exact sums, gathers and broadcasts, a captured all-reduce replays, and an abort ends a
//! collective whose peer never comes. Every test here needs a GPU and NCCL, so all are `#[ignore]`d; the lead runs
//! them on the GPU machine (NCCL from the nvidia-nccl-cu13 wheel, which `device_env.sh` puts on the path):
//!
//! ```sh
//! # here (no GPU): build and stage the test binary with a filled kernel cache
//! SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/x cuda_nccl
//! # on the GPU machine (one GPU runs the one-rank tests; two run them all), from the repository root:
//! . kernels/bench/device_env.sh .bin/x && NCCL_NVLS_ENABLE=0 .bin/x/cuda_nccl --include-ignored --test-threads 1
//! ```

use std::sync::mpsc;
use std::time::Duration;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaContext;
use half::bf16;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::nccl::{
    nccl_version, unique_id, DeviceBuf, DeviceCommunicator, Elem, NcclComm, NcclGroup, UNIQUE_ID_BYTES,
};

/// Values whose sums over two ranks are exact in bf16 and f32: small integers.
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 3) % 61) as f32 - 30.0).collect()
}

/// 77 bytes that differ per rank (a step plan's worth).
fn plan_bytes(rank: usize) -> Vec<u8> {
    (0..77).map(|i| (i * 31 + rank * 101) as u8).collect()
}

fn bf16s(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|x| bf16::from_f32(*x)).collect()
}

fn one_rank(gpu: &Gpu) -> NcclComm {
    let (lib, version) = nccl_version().unwrap();
    eprintln!("NCCL {version:?} from {lib}");
    let id = unique_id().unwrap();
    NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank: 0, world: 1 }).unwrap()
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn a_group_of_one_copies_every_collective_bit_for_bit() {
    let gpu = Gpu::new(0).unwrap();
    let comm = one_rank(&gpu);
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let n = 4099; // not a multiple of any chunk size
                  // Arbitrary bits (NaNs and infinities included): a copy keeps them all.
    let raw: Vec<f32> = (0..n as u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).collect();
    let f = gpu.upload(&raw).unwrap();
    comm.all_reduce_sum(DeviceBuf { at: gpu.ptr(&f), count: n, elem: Elem::F32 }, &gpu.stream).unwrap();
    let back = gpu.download(&f, n).unwrap();
    assert!(back.iter().zip(&raw).all(|(a, b)| a.to_bits() == b.to_bits()), "an in-place all-reduce of one rank");
    let hb = bf16s(&values(0, n));
    let b = gpu.upload(&hb).unwrap();
    let out = gpu.zeros::<bf16>(n).unwrap();
    let buf = DeviceBuf { at: gpu.ptr(&b), count: n, elem: Elem::Bf16 };
    comm.all_gather(buf, gpu.ptr(&out), &gpu.stream).unwrap();
    assert_eq!(gpu.download(&out, n).unwrap(), hb, "all-gather of one rank");
    let out2 = gpu.zeros::<bf16>(n).unwrap();
    comm.reduce_scatter_sum(gpu.ptr(&b), DeviceBuf { at: gpu.ptr(&out2), count: n, elem: Elem::Bf16 }, &gpu.stream)
        .unwrap();
    assert_eq!(gpu.download(&out2, n).unwrap(), hb, "reduce-scatter of one rank");
    comm.broadcast(0, buf, &gpu.stream).unwrap();
    assert_eq!(gpu.download(&b, n).unwrap(), hb, "broadcast of one rank");
    let bytes = gpu.upload(&plan_bytes(0)).unwrap();
    comm.broadcast(0, DeviceBuf { at: gpu.ptr(&bytes), count: 77, elem: Elem::U8 }, &gpu.stream).unwrap();
    assert_eq!(gpu.download(&bytes, 77).unwrap(), plan_bytes(0), "bytes broadcast by one rank");
    let err = comm.broadcast(1, buf, &gpu.stream).unwrap_err();
    assert_eq!(err.kind(), "invalid_input");
    comm.health().unwrap();
    comm.check_sum(&gpu.ctx).unwrap();
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn a_collective_is_captured_into_a_graph_and_replays() {
    let gpu = Gpu::new(0).unwrap();
    let comm = one_rank(&gpu);
    let n = 1000;
    let host = values(0, n);
    let f = gpu.upload(&host).unwrap();
    let out = gpu.zeros::<f32>(n).unwrap();
    gpu.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let issued = comm.all_gather(DeviceBuf { at: gpu.ptr(&f), count: n, elem: Elem::F32 }, gpu.ptr(&out), &gpu.stream);
    let graph = gpu.stream.end_capture(CUgraphInstantiate_flags(0));
    issued.unwrap();
    let graph = graph.unwrap().expect("the capture holds the collective");
    assert_eq!(gpu.download(&out, n).unwrap(), vec![0.0; n], "capturing runs nothing");
    graph.launch().unwrap();
    gpu.synchronize().unwrap();
    assert_eq!(gpu.download(&out, n).unwrap(), host);
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn an_aborted_communicator_refuses_every_later_call() {
    let gpu = Gpu::new(0).unwrap();
    let comm = one_rank(&gpu);
    let f = gpu.zeros::<f32>(16).unwrap();
    comm.abort("the test takes it down");
    comm.abort("twice is harmless");
    let err = comm.all_reduce_sum(DeviceBuf { at: gpu.ptr(&f), count: 16, elem: Elem::F32 }, &gpu.stream).unwrap_err();
    assert_eq!(err.kind(), "device");
    assert!(err.to_string().contains("the test takes it down"), "{err}");
    assert!(comm.health().is_err());
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn a_rank_outside_its_group_is_refused() {
    let gpu = Gpu::new(0).unwrap();
    let id = [0u8; UNIQUE_ID_BYTES];
    for (rank, world) in [(1, 1), (0, 0)] {
        let err = NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank, world }).err().expect("refused");
        assert_eq!(err.kind(), "invalid_input");
    }
}

/// Runs `body(rank, gpu, comm)` on two GPUs, one thread each with its own context and communicator; `None` (after
/// saying so) when the process sees fewer than two GPUs.
fn on_two_gpus<T: Send + 'static>(body: fn(usize, &Gpu, &NcclComm) -> T) -> Option<Vec<T>> {
    let count = CudaContext::device_count().unwrap_or(0);
    if count < 2 {
        eprintln!("SKIPPED: this process sees {count} GPU(s); the two-rank NCCL checks did NOT run");
        return None;
    }
    let id = unique_id().unwrap();
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let gpu = Gpu::new(rank).unwrap();
                let comm = NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank, world: 2 }).unwrap();
                body(rank, &gpu, &comm)
            })
        })
        .collect();
    Some(threads.into_iter().map(|t| t.join().expect("a rank panicked")).collect())
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn two_ranks_sum_gather_scatter_and_broadcast_exactly() {
    let Some(results) = on_two_gpus(|rank, gpu, comm| {
        let n = 4096;
        let mine = values(rank, n);
        let f = gpu.upload(&mine).unwrap();
        comm.all_reduce_sum(DeviceBuf { at: gpu.ptr(&f), count: n, elem: Elem::F32 }, &gpu.stream).unwrap();
        let b = gpu.upload(&bf16s(&mine)).unwrap();
        comm.all_reduce_sum(DeviceBuf { at: gpu.ptr(&b), count: n, elem: Elem::Bf16 }, &gpu.stream).unwrap();
        let send = gpu.upload(&mine).unwrap();
        let gathered = gpu.zeros::<f32>(2 * n).unwrap();
        comm.all_gather(DeviceBuf { at: gpu.ptr(&send), count: n, elem: Elem::F32 }, gpu.ptr(&gathered), &gpu.stream)
            .unwrap();
        let scattered = gpu.zeros::<f32>(n / 2).unwrap();
        let half = DeviceBuf { at: gpu.ptr(&scattered), count: n / 2, elem: Elem::F32 };
        comm.reduce_scatter_sum(gpu.ptr(&send), half, &gpu.stream).unwrap();
        let cast = gpu.upload(&mine).unwrap();
        comm.broadcast(1, DeviceBuf { at: gpu.ptr(&cast), count: n, elem: Elem::F32 }, &gpu.stream).unwrap();
        let plan = gpu.upload(&plan_bytes(rank)).unwrap();
        comm.broadcast(0, DeviceBuf { at: gpu.ptr(&plan), count: 77, elem: Elem::U8 }, &gpu.stream).unwrap();
        gpu.synchronize().unwrap();
        comm.health().unwrap();
        comm.check_sum(&gpu.ctx).unwrap();
        (
            gpu.download(&f, n).unwrap(),
            gpu.download(&b, n).unwrap(),
            gpu.download(&gathered, 2 * n).unwrap(),
            gpu.download(&scattered, n / 2).unwrap(),
            gpu.download(&cast, n).unwrap(),
            gpu.download(&plan, 77).unwrap(),
        )
    }) else {
        return;
    };
    let n = 4096;
    let (x0, x1) = (values(0, n), values(1, n));
    let sum: Vec<f32> = x0.iter().zip(&x1).map(|(a, b)| a + b).collect();
    let whole: Vec<f32> = x0.iter().chain(&x1).copied().collect();
    for (rank, (f, b, gathered, scattered, cast, plan)) in results.iter().enumerate() {
        assert_eq!(f, &sum, "rank {rank}: f32 all-reduce");
        assert_eq!(b, &bf16s(&sum), "rank {rank}: bf16 all-reduce");
        assert_eq!(gathered, &whole, "rank {rank}: all-gather in rank order");
        assert_eq!(scattered.as_slice(), &sum[rank * n / 2..(rank + 1) * n / 2], "rank {rank}: reduce-scatter");
        assert_eq!(cast, &x1, "rank {rank}: broadcast from rank 1");
        assert_eq!(plan, &plan_bytes(0), "rank {rank}: bytes broadcast from rank 0");
    }
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn two_ranks_replay_a_captured_all_reduce() {
    let Some(results) = on_two_gpus(|rank, gpu, comm| {
        let n = 2048;
        let f = gpu.upload(&values(rank, n)).unwrap();
        gpu.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        let issued = comm.all_reduce_sum(DeviceBuf { at: gpu.ptr(&f), count: n, elem: Elem::F32 }, &gpu.stream);
        let graph = gpu.stream.end_capture(CUgraphInstantiate_flags(0));
        issued.unwrap();
        let graph = graph.unwrap().expect("the capture holds the collective");
        // In place, twice: the sum, then the sum of the sums.
        graph.launch().unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        gpu.download(&f, n).unwrap()
    }) else {
        return;
    };
    let n = 2048;
    let twice: Vec<f32> = values(0, n).iter().zip(&values(1, n)).map(|(a, b)| 2.0 * (a + b)).collect();
    assert_eq!(results[0], twice);
    assert_eq!(results[1], twice);
}

#[test]
#[ignore = "needs a GPU and NCCL (see the command at the top of this file)"]
fn an_abort_ends_a_collective_whose_peer_never_comes() {
    let count = CudaContext::device_count().unwrap_or(0);
    if count < 2 {
        eprintln!("SKIPPED: this process sees {count} GPU(s); the abort check did NOT run");
        return;
    }
    let id = unique_id().unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    // Rank 1 joins and then never calls the collective; rank 0 waits in it until its own abort.
    let (joined_tx, joined_rx) = mpsc::channel();
    let peer = std::thread::spawn(move || {
        let gpu = Gpu::new(1).unwrap();
        let comm = NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank: 1, world: 2 }).unwrap();
        joined_rx.recv().ok();
        drop(comm);
    });
    std::thread::spawn(move || {
        let gpu = Gpu::new(0).unwrap();
        let comm = std::sync::Arc::new(NcclComm::init(&gpu.ctx, NcclGroup { id: &id, rank: 0, world: 2 }).unwrap());
        let f = gpu.zeros::<f32>(1 << 20).unwrap();
        comm.all_reduce_sum(DeviceBuf { at: gpu.ptr(&f), count: 1 << 20, elem: Elem::F32 }, &gpu.stream).unwrap();
        let watchdog = comm.clone();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            watchdog.abort("rank 1 went away (the test)");
        });
        let waited = gpu.synchronize();
        aborter.join().unwrap();
        eprintln!("rank 0's wait ended after the abort: {waited:?}");
        done_tx.send(comm.health().err().map(|e| e.to_string())).ok();
        joined_tx.send(()).ok();
    });
    let reason = done_rx.recv_timeout(Duration::from_secs(60)).expect("the abort ended rank 0's wait within 60 s");
    assert!(reason.as_ref().is_some_and(|r| r.contains("rank 1 went away")), "{reason:?}");
    peer.join().unwrap();
}
