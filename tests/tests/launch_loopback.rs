//! Black-box tests of the launch contract with real `sparkd` processes on loopback, without GPUs: two
//! `sparkd rendezvous` nodes form one group and print the same ranks and unique id; nodes of different
//! deployments both fail naming the mismatch; a node killed after the rendezvous takes the other down with an
//! error naming its rank (and a killed node 0 takes node 1 down naming the master), in bounded time; on a machine
//! without NCCL or without a GPU, `sparkd serve --device cuda --tensor-parallel-size 2` starts its worker, forms
//! the group with it, then stops with a clear error (no NCCL to draw the group's id with, no GPU to join its
//! communicator on) and leaves no worker behind; a group that
//! cannot shard the model on CUDA is refused before any worker starts.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sparkd_tests::sparkd_bin;

/// The longest any process of these tests may run.
const LIMIT: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `sparkd rendezvous` as node `node` of two, on `port`, with `extra` flags; stdout and stderr piped.
fn node(node: u32, port: u16, extra: &[&str]) -> Child {
    Command::new(sparkd_bin().unwrap())
        .arg("rendezvous")
        .args(["--nnodes", "2", "--node-rank", &node.to_string(), "--master-addr", "127.0.0.1"])
        .args(["--master-port", &port.to_string(), "--rendezvous-timeout", "30"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sparkd starts")
}

/// Waits for `child` at most [`LIMIT`] (killing it past that, which fails the test): exit code, stdout, stderr.
fn finish(mut child: Child) -> (i32, String, String) {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("sparkd did not exit within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code().unwrap_or(-1), out, err)
}

#[test]
fn two_nodes_form_one_group_with_the_same_unique_id() {
    let port = free_port();
    let node0 = node(0, port, &["--tensor-parallel-size", "4", "--fingerprint", "k3 tp4"]);
    let node1 = node(1, port, &["--tensor-parallel-size", "4", "--fingerprint", "k3 tp4"]);
    let (code0, out0, err0) = finish(node0);
    let (code1, out1, err1) = finish(node1);
    assert_eq!((code0, code1), (0, 0), "node 0: {err0}\nnode 1: {err1}");
    assert_eq!(out0, out1, "both nodes print the same group");
    let id = out0.lines().find_map(|l| l.strip_prefix("unique id: ")).expect("a unique id line");
    assert!(id.len() == 256 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    let ranks: Vec<(&str, &str)> = out0
        .lines()
        .filter(|l| l.starts_with("rank "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[1], f[3])
        })
        .collect();
    assert_eq!(ranks, [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], "{out0}");
    assert!(out0.starts_with("group: 4 ranks on 2 nodes (2 per node)"), "{out0}");
}

#[test]
fn nodes_of_different_deployments_both_fail_naming_the_mismatch() {
    let port = free_port();
    let node0 = node(0, port, &["--tensor-parallel-size", "2"]);
    let node1 = node(1, port, &["--tensor-parallel-size", "4"]);
    let (code0, _, err0) = finish(node0);
    let (code1, _, err1) = finish(node1);
    assert!(code0 != 0 && code1 != 0, "both fail:\n{err0}\n{err1}");
    for err in [&err0, &err1] {
        assert!(err.contains("world size mismatch: it has --tensor-parallel-size 4, node 0 has 2"), "{err}");
    }

    let port = free_port();
    let node0 = node(0, port, &["--fingerprint", "k3 tp2 ep"]);
    let node1 = node(1, port, &["--fingerprint", "k3 tp2"]);
    let (code0, _, err0) = finish(node0);
    let (code1, _, err1) = finish(node1);
    assert!(code0 != 0 && code1 != 0, "both fail:\n{err0}\n{err1}");
    for err in [&err0, &err1] {
        assert!(err.contains("fingerprint mismatch: it serves `k3 tp2`, node 0 serves `k3 tp2 ep`"), "{err}");
    }
}

#[test]
fn a_node_killed_after_the_rendezvous_takes_the_group_down() {
    let port = free_port();
    let hold = ["--hold-seconds", "120", "--heartbeat-timeout", "5"];
    let node0 = node(0, port, &hold);
    let mut node1 = node(1, port, &hold);
    // Node 1 prints its group once the rendezvous is done.
    let mut lines = BufReader::new(node1.stdout.take().unwrap()).lines();
    let first = lines.next().expect("node 1 prints the group").unwrap();
    assert!(first.starts_with("group: 2 ranks"), "{first}");
    node1.kill().unwrap();
    node1.wait().unwrap();
    let killed = Instant::now();
    let (code0, _, err0) = finish(node0);
    assert_ne!(code0, 0, "{err0}");
    assert!(err0.contains("sparkd: error: rank 1 on node 1 (127.0.0.1:"), "{err0}");
    assert!(err0.contains("went away: its connection closed"), "{err0}");
    assert!(killed.elapsed() < Duration::from_secs(10), "node 0 noticed within {:?}", killed.elapsed());

    // The other way round: node 0 (the master) dies, node 1 names it.
    let port = free_port();
    let mut node0 = node(0, port, &hold);
    let node1 = node(1, port, &hold);
    let mut lines = BufReader::new(node0.stdout.take().unwrap()).lines();
    assert!(lines.next().expect("node 0 prints the group").unwrap().starts_with("group: 2 ranks"));
    node0.kill().unwrap();
    node0.wait().unwrap();
    let killed = Instant::now();
    let (code1, _, err1) = finish(node1);
    assert_ne!(code1, 0, "{err1}");
    assert!(err1.contains(&format!("the master, rank 0 on node 0 (127.0.0.1:{port}), went away")), "{err1}");
    assert!(killed.elapsed() < Duration::from_secs(10), "node 1 noticed within {:?}", killed.elapsed());
}

#[test]
fn serve_on_cuda_over_two_ranks_without_gpus_forms_the_group_then_stops_cleanly() {
    // With NCCL and a driver the group would go on to serve (on a machine with two GPUs): the multi-GPU run checks
    // that, not this test.
    if sparkd_kernels::cuda::nccl::nccl_present() && sparkd_kernels::cuda::device::driver_present() {
        eprintln!("SKIPPED: this machine has NCCL and a CUDA driver; the two-rank group would serve, so its error path was NOT checked");
        return;
    }
    let child = Command::new(sparkd_bin().unwrap())
        .args(["serve", "--device", "cuda", "--tensor-parallel-size", "2", "--port", "0"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sparkd starts");
    let (code, _, err) = finish(child);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("rank 1 on node 0 (127.0.0.1:"), "the worker joined:\n{err}");
    // Node 0 draws the group's id with ncclGetUniqueId: without NCCL (this process sees the same library path as
    // the daemon) that is where it stops, naming the library. With it but without a driver, every rank fails to
    // open its GPU for the NCCL communicator, naming the missing driver.
    if !sparkd_kernels::cuda::nccl::nccl_present() {
        assert!(err.contains("NCCL not found: libnccl.so.2") && err.contains("LD_LIBRARY_PATH"), "{err}");
    } else {
        assert!(err.contains("no CUDA driver"), "{err}");
    }
    let pids: Vec<u32> = err
        .lines()
        .filter_map(|l| l.split("started the worker of rank 1 (pid ").nth(1))
        .filter_map(|rest| rest.split(',').next()?.parse().ok())
        .collect();
    assert_eq!(pids.len(), 1, "one worker:\n{err}");
    assert!(err.contains("CUDA_VISIBLE_DEVICES=1"), "{err}");
    for pid in pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "worker {pid} is gone");
    }
}

#[test]
fn launch_flags_that_make_no_group_are_refused_by_name() {
    let run = |args: &[&str]| {
        let child = Command::new(sparkd_bin().unwrap())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sparkd starts");
        finish(child)
    };
    let (code, _, err) = run(&["rendezvous", "--nnodes", "2", "--tensor-parallel-size", "3", "--master-port", "1"]);
    assert_eq!(code, 1);
    assert!(err.contains("--tensor-parallel-size/--nnodes: 3 ranks do not split evenly over 2 nodes"), "{err}");
    let (code, _, err) = run(&["rendezvous", "--nnodes", "2"]);
    assert_eq!(code, 1);
    assert!(err.contains("--master-port: needed with --nnodes 2"), "{err}");
    let (code, _, err) = run(&["serve", "--device", "cpu", "--nnodes", "2", "--tensor-parallel-size", "2"]);
    assert_eq!(code, 1);
    assert!(err.contains("--nnodes:"), "{err}");
    // A group that cannot shard the model on CUDA is refused before any worker starts.
    let cuda = ["serve", "--device", "cuda", "--synthetic", "k3-tiny", "--port", "0", "--tensor-parallel-size"];
    let (code, _, err) = run(&[&cuda[..], &["3"]].concat());
    assert_eq!(code, 1);
    assert!(err.contains("--tensor-parallel-size`: 3 does not divide KDA heads"), "{err}");
    assert!(!err.contains("started the worker"), "{err}");
    let (code, _, err) = run(&[&cuda[..], &["4"]].concat());
    assert_eq!(code, 1);
    assert!(
        err.contains("--tensor-parallel-size 4: a rank's part of the model does not fit the CUDA kernels"),
        "{err}"
    );
    assert!(err.contains("MoE expert width 16"), "{err}");
}
