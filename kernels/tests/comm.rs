//! The in-process communicator: every collective against a serial reference on groups of 1 to 4 ranks,
//! bit-identical reductions on every rank, and a group that goes down (a rank aborts, exits, panics, never
//! arrives, or calls another collective) failing every other rank within a bounded wait, never hanging.

use std::time::{Duration, Instant};

use sparkd_kernels::comm::{local_group, Communicator, LocalComm};
use sparkd_kernels::KernelError;

/// Runs `body` on every rank of a fresh group, one thread each; returns the ranks' results in rank order.
fn on_ranks<T: Send>(world: usize, timeout: Option<Duration>, body: impl Fn(LocalComm) -> T + Sync) -> Vec<T> {
    let comms = local_group(world, timeout).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| body(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `r`'s test values: not exactly representable sums, so the reduction order shows in the bits.
fn values(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 31 + i * 7) as f32 * 0.1).sin() * 1e3 + 1e-3 * i as f32).collect()
}

#[test]
fn collectives_match_a_serial_reference() {
    for world in 1..=4 {
        let len = 10;
        // The serial reference: rank order.
        let mut sum = values(0, len);
        for r in 1..world {
            for (s, v) in sum.iter_mut().zip(values(r, len)) {
                *s += v;
            }
        }
        let mut sum_f64: Vec<f64> = values(0, len).iter().map(|v| *v as f64).collect();
        for r in 1..world {
            for (s, v) in sum_f64.iter_mut().zip(values(r, len)) {
                *s += v as f64;
            }
        }
        let gathered: Vec<f32> = (0..world).flat_map(|r| values(r, len)).collect();
        let results = on_ranks(world, Some(Duration::from_secs(10)), |c| {
            let r = c.rank();
            let mut reduced = values(r, len);
            c.all_reduce_sum(&mut reduced).unwrap();
            let mut reduced_f64: Vec<f64> = values(r, len).iter().map(|v| *v as f64).collect();
            c.all_reduce_sum_f64(&mut reduced_f64).unwrap();
            assert_eq!(reduced_f64, sum_f64, "world {world} rank {r}: f64 all-reduce");
            let mut all = vec![0.0; len * world];
            c.all_gather(&values(r, len), &mut all).unwrap();
            let send: Vec<f32> = (0..world).flat_map(|_| values(r, len)).collect();
            let mut scattered = vec![0.0; len];
            c.reduce_scatter_sum(&send, &mut scattered).unwrap();
            // Rank r sends r + j + 1 copies of the value 100 r + j to rank j.
            let parts: Vec<Vec<f32>> = (0..world).map(|j| vec![(100 * r + j) as f32; r + j + 1]).collect();
            let received = c.all_to_all(&parts).unwrap();
            let mut root_buf = if r == world - 1 { vec![7.5f32; 3] } else { vec![0.0; 3] };
            c.broadcast(world - 1, &mut root_buf).unwrap();
            let msg = c.broadcast_message(0, if r == 0 { b"plan bytes" } else { b"" }).unwrap();
            (reduced, all, scattered, received, root_buf, msg)
        });
        for (r, (reduced, all, scattered, received, root_buf, msg)) in results.into_iter().enumerate() {
            assert_eq!(reduced, sum, "world {world} rank {r}: all-reduce differs from the rank-order sum");
            assert_eq!(all, gathered);
            assert_eq!(scattered, sum, "reduce-scatter of identical chunks is the all-reduce");
            for (i, part) in received.iter().enumerate() {
                assert_eq!(part, &vec![(100 * i + r) as f32; i + r + 1]);
            }
            assert_eq!(root_buf, vec![7.5; 3]);
            assert_eq!(msg, b"plan bytes");
        }
    }
}

#[test]
fn reduce_scatter_keeps_each_ranks_chunk_of_the_sum() {
    let world = 3;
    let results = on_ranks(world, Some(Duration::from_secs(10)), |c| {
        let send: Vec<f32> = (0..6).map(|i| (i * (c.rank() + 1)) as f32).collect(); // [3 ranks, 2]
        let mut out = vec![0.0; 2];
        c.reduce_scatter_sum(&send, &mut out).unwrap();
        out
    });
    // Sum over ranks of i·(r+1) = 6 i.
    assert_eq!(results, vec![vec![0.0, 6.0], vec![12.0, 18.0], vec![24.0, 30.0]]);
}

fn is_down(e: &KernelError) -> bool {
    matches!(e, KernelError::Device(m) if m.contains("group is down"))
}

#[test]
fn an_aborting_rank_fails_every_other_rank() {
    let started = Instant::now();
    let results = on_ranks(4, None, |c| {
        if c.rank() == 2 {
            c.abort("simulated device fault");
            return None;
        }
        let mut buf = vec![1.0f32; 4];
        Some(c.all_reduce_sum(&mut buf).unwrap_err())
    });
    for e in results.into_iter().flatten() {
        assert!(is_down(&e), "{e}");
        assert!(e.to_string().contains("rank 2 aborted: simulated device fault"), "{e}");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_rank_that_exits_fails_the_others_between_and_during_collectives() {
    let results = on_ranks(3, None, |c| {
        let mut buf = vec![c.rank() as f32; 2];
        c.all_reduce_sum(&mut buf).unwrap();
        if c.rank() == 0 {
            // Rank 0 leaves after one collective (its handle drops); the others are blocked in the next.
            drop(c);
            return None;
        }
        Some(c.all_gather(&buf, &mut [0.0; 6]).unwrap_err())
    });
    for e in results.into_iter().flatten() {
        assert!(e.to_string().contains("rank 0 left the group"), "{e}");
    }
}

#[test]
fn a_rank_that_panics_fails_the_others() {
    let results = on_ranks(3, None, |c| {
        if c.rank() == 1 {
            // The handle drops while the panic unwinds.
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _held = c;
                panic!("a bug inside rank 1");
            }));
            assert!(panicked.is_err());
            return None;
        }
        Some(c.broadcast_message(0, b"plan").unwrap_err())
    });
    for e in results.into_iter().flatten() {
        assert!(e.to_string().contains("rank 1 left the group"), "{e}");
    }
}

#[test]
fn a_rank_that_never_arrives_times_the_group_out() {
    let started = Instant::now();
    let results = on_ranks(2, Some(Duration::from_millis(200)), |c| {
        if c.rank() == 1 {
            // Stays alive but never calls: a hung peer.
            std::thread::sleep(Duration::from_millis(600));
            let mut late = vec![0.0f32; 1];
            return c.broadcast(0, &mut late).unwrap_err();
        }
        c.broadcast(0, &mut [1.0]).unwrap_err()
    });
    assert!(results[0].to_string().contains("ranks [1] never arrived"), "{}", results[0]);
    assert!(is_down(&results[1]));
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn mismatched_collectives_are_an_error_on_every_rank() {
    let results = on_ranks(2, Some(Duration::from_secs(5)), |c| {
        if c.rank() == 0 {
            c.all_reduce_sum(&mut [1.0, 2.0]).unwrap_err()
        } else {
            c.all_reduce_sum(&mut [1.0, 2.0, 3.0]).unwrap_err()
        }
    });
    for e in results {
        assert!(is_down(&e) && e.to_string().contains("same order with the same sizes"), "{e}");
    }
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let results = on_ranks(2, Some(Duration::from_secs(5)), |c| {
        let gather = c.all_gather(&[1.0], &mut [0.0; 3]).is_err();
        let root = c.broadcast(5, &mut [0.0]).is_err();
        let parts = c.all_to_all(&[vec![1.0]]).is_err();
        gather && root && parts
    });
    assert!(results.into_iter().all(|ok| ok));
    assert!(local_group(0, None).is_err());
}
