//! Where the engine thread's time goes: each turn of its loop is cut into phases, and the time of each
//! phase is one sample of `sparkd:engine_phase_seconds{phase}`.
//!
//! Invariants:
//! - One `Instant::now()` per phase boundary: [`PhaseClock::lap`] charges the time since the previous lap
//!   to the phase that just ended, so the phases of a turn add up to the turn, with no gap and no overlap.
//! - The histogram handles are taken once, when the clock is made (the recorder is installed before the
//!   engine starts), so a lap is a clock read and one histogram push, never a registry lookup.
//! - The phase names are the label values pre-registered in `crate::metrics` (`ENGINE_PHASES`), in the
//!   order of [`Phase`].

use std::time::Instant;

use metrics::{histogram, Histogram};

use crate::metrics::{ENGINE_PHASES, ENGINE_PHASE_SECONDS};

/// One phase of the engine loop; its discriminant indexes `ENGINE_PHASES`, its label value (the help text of
/// `sparkd:engine_phase_seconds` says what each covers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Blocked on the command queue with nothing to step, or waiting to retry undelivered events.
    Idle = 0,
    /// Handling the commands taken this turn (accepting requests, dropping or recording responses).
    Commands,
    /// Giving newly admitted requests a state (kept-response checkout, prefix import, or a fresh one).
    Admit,
    /// Drafting for the decode rows and choosing what to verify (speculation on only).
    Draft,
    /// Planning the step.
    Schedule,
    /// `runner.step`: the device forward and the verify of the drafts, which the backends fuse.
    Step,
    /// Applying the outputs: scheduler update, speculation statistics, snapshots, finished requests.
    Apply,
    /// Building and sending events, and retrying the backlogs.
    Emit,
    /// The memory budgets of kept responses and the gauges.
    Memory,
}

/// Times the phases of the engine loop.
pub(crate) struct PhaseClock {
    last: Instant,
    /// One handle per [`Phase`], indexed by its discriminant.
    histograms: Vec<Histogram>,
}

impl PhaseClock {
    pub(crate) fn new() -> Self {
        let histograms =
            ENGINE_PHASES.iter().map(|&phase| histogram!(ENGINE_PHASE_SECONDS, "phase" => phase)).collect();
        PhaseClock { last: Instant::now(), histograms }
    }

    /// Ends `phase` now: records the time since the previous lap as one sample of it.
    pub(crate) fn lap(&mut self, phase: Phase) {
        let now = Instant::now();
        self.histograms[phase as usize].record(now.saturating_duration_since(self.last).as_secs_f64());
        self.last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_names_its_own_label_value() {
        let phases = [
            Phase::Idle,
            Phase::Commands,
            Phase::Admit,
            Phase::Draft,
            Phase::Schedule,
            Phase::Step,
            Phase::Apply,
            Phase::Emit,
            Phase::Memory,
        ];
        assert_eq!(phases.len(), ENGINE_PHASES.len());
        let names: Vec<&str> = phases.iter().map(|&p| ENGINE_PHASES[p as usize]).collect();
        assert_eq!(names, ["idle", "commands", "admit", "draft", "schedule", "step", "apply", "emit", "memory"]);
    }
}
