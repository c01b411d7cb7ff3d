//! What moving one sequence's state costs at the bench's context, in `sparkd bench --device cuda`: a host
//! export (prefix-cache snapshots, offload of kept responses), an import (restoring either), and a fork on the
//! device (subagents, kept-state continuations). These are the per-turn costs the engine thread pays besides
//! the steps, so they are measured where the steps are.
//!
//! Invariants:
//! - One sequence prefilled with the bench's prompt, as a served turn's state; every time is host wall-clock
//!   around one `Runner` call that ends with the device idle (an export downloads, an import and a fork are
//!   followed by a synchronisation), the median of the timed calls after one warm-up.
//! - Every state made here is freed before the function returns, whatever fails.

use std::time::Instant;

use crate::cuda::runner::CudaRunner;
use crate::error::Result;
use crate::harness::cuda_bench::{median, Batch};
use crate::runner::{Runner, StateId};

/// The state of one sequence moved between the device and the host.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StateMoves {
    /// Tokens the state holds.
    pub tokens: usize,
    /// Device bytes of the state (KDA states and conv windows, MLA latents).
    pub device_bytes: usize,
    /// Host bytes of its export (the CPU reference's f32 layout).
    pub host_bytes: usize,
    pub export_ms_median: f64,
    pub import_ms_median: f64,
    pub fork_ms_median: f64,
}

/// Times export, import and fork of one sequence of `prompt_len` tokens, `reps` times each.
pub fn state_moves(runner: &mut CudaRunner, prompt_len: usize, reps: usize) -> Result<StateMoves> {
    let batch = Batch::new(runner, 1, prompt_len)?;
    let result = time_moves(runner, batch.states[0], reps.max(1));
    batch.free(runner)?;
    result
}

fn time_moves(runner: &mut CudaRunner, id: StateId, reps: usize) -> Result<StateMoves> {
    let (mut export, mut import, mut fork) = (Vec::new(), Vec::new(), Vec::new());
    let host = runner.export_state(id)?;
    let host_bytes = host.bytes();
    for rep in 0..=reps {
        let t = Instant::now();
        let exported = runner.export_state(id)?;
        let export_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let imported = runner.import_state(exported);
        runner.gpu().synchronize()?;
        let import_ms = t.elapsed().as_secs_f64() * 1e3;
        runner.free_state(imported?)?;
        let t = Instant::now();
        let forked = runner.fork_state(id);
        runner.gpu().synchronize()?;
        let fork_ms = t.elapsed().as_secs_f64() * 1e3;
        runner.free_state(forked?)?;
        if rep > 0 {
            export.push(export_ms);
            import.push(import_ms);
            fork.push(fork_ms);
        }
    }
    Ok(StateMoves {
        tokens: runner.state_len(id)?,
        device_bytes: runner.state_bytes(id)?,
        host_bytes,
        export_ms_median: median(&mut export),
        import_ms_median: median(&mut import),
        fork_ms_median: median(&mut fork),
    })
}
