//! Steps launched ahead: the part of the [`Runner`](crate::Runner) contract behind asynchronous
//! scheduling ([`Runner::launch`](crate::Runner::launch), [`Runner::launch_fed`](crate::Runner::launch_fed),
//! [`Runner::collect`](crate::Runner::collect)), and [`SyncLaunches`], which gives that contract to a runner
//! that computes each step as it is launched (CPU, null).
//!
//! Follows vLLM v1's asynchronous scheduling: the next decode step is launched before the host has seen the
//! tokens of the step in flight; each of its rows is fed, on the device, the token that step emits for it.
//!
//! Invariants (every backend keeps them; the contract suite checks them):
//! - At most [`MAX_IN_FLIGHT`] steps are launched and not yet collected; `collect` returns them in launch
//!   order, each exactly once.
//! - A fed step has exactly the rows of the step launched just before it (same states, same order), and
//!   each of those rows sampled one token with no drafts, so each fed row appends exactly that one token.
//! - While a state is in a step not yet collected, it is not freed, forked, exported or stepped by anything
//!   but a fed step, and `step` runs only when nothing is in flight: those calls fail with a clear error and
//!   change nothing.
//! - A launch that fails leaves nothing in flight for it; steps launched before it stay in flight.

use std::collections::VecDeque;

use crate::error::{KernelError, Result};
use crate::runner::{RowInput, RowOutput, SampleRequest, SamplingParams, StateId};

/// The most steps a runner holds launched and not yet collected: the step whose outputs the host waits
/// for and the one launched ahead of it.
pub const MAX_IN_FLIGHT: usize = 2;

/// A row of a fed step: a decode row whose one input token is the token the step launched before it
/// emits for the same state.
#[derive(Clone, Debug, PartialEq)]
pub struct FedRow {
    pub state: StateId,
    pub params: SamplingParams,
}

/// What a fed step needs to know of the step launched just before it, per row: its state and whether
/// it emits exactly one token (it samples and carries no drafts).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchedRow {
    pub state: StateId,
    pub emits_one: bool,
}

impl LaunchedRow {
    pub fn of(row: &RowInput) -> Self {
        LaunchedRow { state: row.state, emits_one: row.sample.as_ref().is_some_and(|s| s.draft_len == 0) }
    }
}

/// Checks that `rows` may be fed from `last`, the rows of the step launched just before (`None`: no step
/// is in flight).
pub fn check_fed(last: Option<&[LaunchedRow]>, rows: &[FedRow]) -> Result<()> {
    let bad = |why: String| Err(KernelError::InvalidInput(format!("a fed step: {why}")));
    let Some(last) = last else { return bad("no step is in flight to feed it".into()) };
    if last.len() != rows.len() {
        return bad(format!("it has {} rows, the step in flight has {}", rows.len(), last.len()));
    }
    for (i, (prev, row)) in last.iter().zip(rows).enumerate() {
        if prev.state != row.state {
            return bad(format!("row {i} is {}, the step in flight's row {i} is {}", row.state, prev.state));
        }
        if !prev.emits_one {
            return bad(format!("row {i} ({}) does not emit exactly one token in the step in flight", row.state));
        }
        crate::sampling::check_params(&row.params)?;
    }
    Ok(())
}

/// The error for a call that touches `state` while it is in a step not yet collected.
pub fn in_flight_error(state: StateId, what: &str) -> KernelError {
    KernelError::InvalidInput(format!("{state} is in a step not yet collected; it cannot be {what}"))
}

/// The error for a launch past [`MAX_IN_FLIGHT`].
pub fn too_many_in_flight() -> KernelError {
    KernelError::InvalidInput(format!("{MAX_IN_FLIGHT} steps are already in flight; collect one first"))
}

/// A runner that computes each step when it is launched (CPU, null): its launched steps and its synchronous step,
/// from which [`sync_launch`] and [`sync_launch_fed`] give it the launch contract.
pub trait SyncStepper {
    fn launches(&mut self) -> &mut SyncLaunches;
    /// The step itself (what `Runner::step` runs once nothing is in flight).
    fn step_now(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>>;
}

/// The `Runner` methods every [`SyncStepper`] shares, written once: `step` (refused while launched steps wait to
/// be collected), `launches_ahead`, `launch`, `launch_fed` and `collect`. Expands inside `impl Runner for T`, where
/// `T: SyncStepper` keeps its [`SyncLaunches`] in a field named `launches`.
#[macro_export]
macro_rules! sync_stepper_runner_methods {
    () => {
        fn step(&mut self, rows: &[$crate::runner::RowInput]) -> $crate::error::Result<Vec<$crate::runner::RowOutput>> {
            self.launches.check_idle()?;
            $crate::launches::SyncStepper::step_now(self, rows)
        }

        fn launches_ahead(&self) -> bool {
            true
        }

        fn launch(&mut self, rows: &[$crate::runner::RowInput]) -> $crate::error::Result<()> {
            $crate::launches::sync_launch(self, rows)
        }

        fn launch_fed(&mut self, rows: &[$crate::launches::FedRow]) -> $crate::error::Result<()> {
            $crate::launches::sync_launch_fed(self, rows)
        }

        fn collect(&mut self) -> $crate::error::Result<Vec<$crate::runner::RowOutput>> {
            self.launches.collect()
        }
    };
}

/// `Runner::launch` of a [`SyncStepper`].
pub fn sync_launch(runner: &mut impl SyncStepper, rows: &[RowInput]) -> Result<()> {
    let mut launches = std::mem::take(runner.launches());
    let result = launches.launch(rows, |rows| runner.step_now(rows));
    *runner.launches() = launches;
    result
}

/// `Runner::launch_fed` of a [`SyncStepper`].
pub fn sync_launch_fed(runner: &mut impl SyncStepper, rows: &[FedRow]) -> Result<()> {
    let mut launches = std::mem::take(runner.launches());
    let result = launches.launch_fed(rows, |rows| runner.step_now(rows));
    *runner.launches() = launches;
    result
}

/// One step computed at launch, waiting to be collected.
#[derive(Debug)]
struct Done {
    rows: Vec<LaunchedRow>,
    outputs: Vec<RowOutput>,
}

/// The launch contract for a runner that computes a step when it is launched: the outputs wait here until
/// collected. The runner keeps one and passes its synchronous step in.
#[derive(Debug, Default)]
pub struct SyncLaunches {
    done: VecDeque<Done>,
}

impl SyncLaunches {
    /// Runs `rows` through `step` now and holds the outputs for [`SyncLaunches::collect`].
    pub fn launch(
        &mut self,
        rows: &[RowInput],
        step: impl FnOnce(&[RowInput]) -> Result<Vec<RowOutput>>,
    ) -> Result<()> {
        for row in rows {
            self.check_settled(row.state, "stepped by a launch that does not feed it")?;
        }
        self.push(rows, step)
    }

    /// Runs the fed step of `rows` now: each row is fed the one token the step launched last emitted for it.
    pub fn launch_fed(
        &mut self,
        rows: &[FedRow],
        step: impl FnOnce(&[RowInput]) -> Result<Vec<RowOutput>>,
    ) -> Result<()> {
        let last = self.done.back();
        check_fed(last.map(|d| d.rows.as_slice()), rows)?;
        let previous = last.map(|d| d.outputs.as_slice()).unwrap_or_default();
        let inputs: Vec<RowInput> = rows
            .iter()
            .zip(previous)
            .map(|(row, out)| RowInput {
                state: row.state,
                tokens: out.tokens.last().copied().into_iter().collect(),
                sample: Some(SampleRequest::new(row.params.clone(), 0)),
            })
            .collect();
        self.push(&inputs, step)
    }

    /// The outputs of the oldest step not yet collected.
    pub fn collect(&mut self) -> Result<Vec<RowOutput>> {
        self.done
            .pop_front()
            .map(|d| d.outputs)
            .ok_or_else(|| KernelError::InvalidInput("collect: no step is in flight".into()))
    }

    /// Fails with a clear error when `state` is in a step not yet collected.
    pub fn check_settled(&self, state: StateId, what: &str) -> Result<()> {
        match self.done.iter().any(|d| d.rows.iter().any(|r| r.state == state)) {
            true => Err(in_flight_error(state, what)),
            false => Ok(()),
        }
    }

    /// Fails unless no step is in flight (what the synchronous `step` needs).
    pub fn check_idle(&self) -> Result<()> {
        match self.done.is_empty() {
            true => Ok(()),
            false => Err(KernelError::InvalidInput(format!(
                "{} launched steps are not yet collected; `step` waits for none",
                self.done.len()
            ))),
        }
    }

    fn push(&mut self, rows: &[RowInput], step: impl FnOnce(&[RowInput]) -> Result<Vec<RowOutput>>) -> Result<()> {
        if self.done.len() >= MAX_IN_FLIGHT {
            return Err(too_many_in_flight());
        }
        let outputs = step(rows)?;
        self.done.push_back(Done { rows: rows.iter().map(LaunchedRow::of).collect(), outputs });
        Ok(())
    }
}
