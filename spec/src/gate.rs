//! The drafting gate: before a step, whether a round of the model drafter can pay for itself, decided
//! from history only.
//!
//! A model draft costs the drafter's round (`SpsProfile::draft_seconds(rows)`) whatever is verified of
//! it. The gate compares the best expected rate of a drafted step with the rate of a plain decode step
//! over the step's `R` decode rows, `n` of which would draft:
//!
//! ```text
//! drafted = max_k E(k) / C(k),  E(k) = R + Σ top-k of ē_j over the n rows' positions j < cap,
//!                              C(k) = draft_seconds(n) + step_seconds(R + k)     (budget::best_capacity)
//! plain   = R / step_seconds(R)
//! ```
//!
//! where `draft_seconds(n)` is the start-up table scaled by what drafter rounds have really cost since
//! ([`DraftGate::record_draft_cost`]: the draft's attention walks each row's context, so agent contexts of
//! thousands of tokens cost more than the short ones measured at start-up), and `ē_j` is the calibrated survival of a typical draft: the decayed mean of the raw survivals the
//! drafter gave at position j ([`DraftGate::record_draft`]) through the calibration's factors
//! (`crate::calibration`). It drafts when `drafted > plain`. Otherwise the step decodes plainly with no
//! drafter call, and every `interval` such steps a probe drafts anyway (the engine verifies at least one
//! token of each probed draft, so acceptance that comes back is seen); `interval` doubles from
//! [`MIN_PROBE_INTERVAL`] to [`MAX_PROBE_INTERVAL`] at each probe and resets when drafting pays again.
//!
//! Invariants:
//! - A decision depends only on earlier rounds (recorded drafts, calibration) and on the step's row
//!   counts and caps, never on a token: skipping or probing cannot bias the output.
//! - Without any recorded draft the gate drafts (there is nothing to judge by).
//! - Skipping a drafter round is free for the drafter's state: the runners append every committed
//!   token's taps to the drafter contexts at every step, drafted or not.

use crate::budget::best_capacity;
use crate::calibration::Calibration;
use crate::sps::SpsProfile;

/// Skipped steps before the first probe.
pub const MIN_PROBE_INTERVAL: u32 = 4;
/// The longest run of skipped steps between probes.
pub const MAX_PROBE_INTERVAL: u32 = 256;
/// Decay of the mean raw survivals, per recorded draft.
const SURVIVAL_DECAY: f64 = 0.95;
/// Decay of the observed-over-predicted draft cost, per timed drafter round.
const COST_DECAY: f64 = 0.9;

/// What the next step does with the model drafter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateDecision {
    /// Drafting is expected to pay: draft.
    Draft,
    /// It is not: decode plainly, no drafter call.
    Skip,
    /// It is not, but it is time to look again: draft, and verify at least one token per draft.
    Probe,
}

/// One step as the gate sees it.
#[derive(Clone, Copy, Debug)]
pub struct GateInput<'a> {
    /// Decode rows in the step (each feeds one token besides its drafts).
    pub rows: usize,
    /// The caps (most verifiable drafts) of the rows the drafter would draft for.
    pub caps: &'a [usize],
    /// The calibration of model drafts.
    pub calibration: &'a Calibration,
}

/// The gate's history: mean raw survivals per position, and the probe back-off.
#[derive(Clone, Debug)]
pub struct DraftGate {
    sps: SpsProfile,
    /// Decayed sums of raw survivals per position, and their decayed counts.
    survival_sum: Vec<f64>,
    survival_weight: Vec<f64>,
    /// Decayed sums of observed over predicted drafter-round seconds, and their decayed count.
    cost_ratio_sum: f64,
    cost_ratio_weight: f64,
    /// Steps skipped since the last probe.
    skipped: u32,
    interval: u32,
}

impl DraftGate {
    /// A gate over SPS(B) and the drafter's cost table in `sps`.
    pub fn new(sps: SpsProfile) -> Self {
        DraftGate {
            sps,
            survival_sum: Vec::new(),
            survival_weight: Vec::new(),
            cost_ratio_sum: 0.0,
            cost_ratio_weight: 0.0,
            skipped: 0,
            interval: MIN_PROBE_INTERVAL,
        }
    }

    /// Records the raw survivals of one fresh model draft (the whole block the drafter made).
    pub fn record_draft(&mut self, survival: &[f64]) {
        if self.survival_sum.len() < survival.len() {
            self.survival_sum.resize(survival.len(), 0.0);
            self.survival_weight.resize(survival.len(), 0.0);
        }
        for (j, &a) in survival.iter().enumerate() {
            self.survival_sum[j] = SURVIVAL_DECAY * self.survival_sum[j] + a.clamp(0.0, 1.0);
            self.survival_weight[j] = SURVIVAL_DECAY * self.survival_weight[j] + 1.0;
        }
    }

    /// Records the wall time of one drafter round over `rows` rows; later decisions scale the start-up cost
    /// table by the decayed mean of observed over predicted. Rounds the table prices at nothing are ignored.
    pub fn record_draft_cost(&mut self, rows: usize, seconds: f64) {
        let predicted = self.sps.draft_seconds(rows);
        if !(predicted > 0.0 && seconds.is_finite() && seconds > 0.0) {
            return;
        }
        self.cost_ratio_sum = COST_DECAY * self.cost_ratio_sum + seconds / predicted;
        self.cost_ratio_weight = COST_DECAY * self.cost_ratio_weight + 1.0;
    }

    /// The predicted seconds of a drafter round over `rows` rows: the start-up table scaled by what rounds
    /// have cost (the table as it is before any round was timed).
    pub fn draft_seconds(&self, rows: usize) -> f64 {
        let ratio = if self.cost_ratio_weight > 0.0 { self.cost_ratio_sum / self.cost_ratio_weight } else { 1.0 };
        self.sps.draft_seconds(rows) * ratio
    }

    /// `ē_j`: the calibrated survivals of a typical draft, over the positions drafted so far (empty
    /// before the first draft).
    pub fn expected_survival(&self, calibration: &Calibration) -> Vec<f64> {
        let mean: Vec<f64> = self.survival_sum.iter().zip(&self.survival_weight).map(|(s, w)| s / w).collect();
        calibration.calibrate(&mean)
    }

    /// Whether a drafted step is expected to beat a plain one (true without history).
    pub fn pays(&self, input: &GateInput<'_>) -> bool {
        if input.caps.is_empty() || input.rows == 0 {
            return false;
        }
        let expected = self.expected_survival(input.calibration);
        if expected.is_empty() {
            return true;
        }
        let mut candidates: Vec<f64> =
            input.caps.iter().flat_map(|&cap| expected.iter().take(cap).copied()).filter(|&a| a > 0.0).collect();
        candidates.sort_by(|x, y| y.total_cmp(x));
        let draft_seconds = self.draft_seconds(input.caps.len());
        let (_, drafted) = best_capacity(&candidates, input.rows, draft_seconds, &self.sps);
        drafted > input.rows as f64 / self.sps.step_seconds(input.rows)
    }

    /// The decision for the next step, advancing the probe back-off.
    pub fn decide(&mut self, input: &GateInput<'_>) -> GateDecision {
        if self.pays(input) {
            self.skipped = 0;
            self.interval = MIN_PROBE_INTERVAL;
            return GateDecision::Draft;
        }
        self.skipped += 1;
        if self.skipped < self.interval {
            return GateDecision::Skip;
        }
        self.skipped = 0;
        self.interval = (self.interval * 2).min(MAX_PROBE_INTERVAL);
        GateDecision::Probe
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sps::{DraftPoint, SpsPoint};

    /// An H200-like profile: a 4 ms step nearly flat up to 16 tokens, 5 ms at 64; a draft of 1.4 ms (one
    /// row), 3.7 ms (8 rows), 8 ms (64 rows).
    fn h200() -> SpsProfile {
        let points = [(1, 250.0), (16, 230.0), (64, 200.0), (256, 120.0), (1024, 40.0)];
        let draft = [(1, 0.0014), (8, 0.0037), (64, 0.008)];
        SpsProfile::from_points(
            points.iter().map(|&(b, s)| SpsPoint { batch_tokens: b, steps_per_second: s }).collect(),
        )
        .unwrap()
        .with_draft_cost(draft.iter().map(|&(rows, seconds)| DraftPoint { rows, seconds }).collect())
        .unwrap()
    }

    fn input<'a>(rows: usize, caps: &'a [usize], calibration: &'a Calibration) -> GateInput<'a> {
        GateInput { rows, caps, calibration }
    }

    /// A calibration that has seen `rounds` drafts of raw survivals `survival` with `accepted` accepted.
    fn seen(survival: &[f64], accepted: usize, rounds: usize) -> Calibration {
        let mut cal = Calibration::default();
        for _ in 0..rounds {
            cal.observe(survival, accepted);
            cal.next_round();
        }
        cal
    }

    fn gate_with(survival: &[f64], drafts: usize) -> DraftGate {
        let mut gate = DraftGate::new(h200());
        (0..drafts).for_each(|_| gate.record_draft(survival));
        gate
    }

    #[test]
    fn drafter_rounds_that_cost_more_than_measured_at_start_up_stop_paying() {
        // Drafts that pay at the start-up price of 1.4 ms stop paying when rounds really take 14 ms (a long
        // context), and pay again once rounds are cheap.
        let cal = Calibration::default();
        let mut gate = gate_with(&[0.6, 0.35, 0.2, 0.1, 0.05, 0.02, 0.01], 10);
        assert!(gate.pays(&input(1, &[7], &cal)));
        assert!((gate.draft_seconds(1) - 0.0014).abs() < 1e-12);
        (0..20).for_each(|_| gate.record_draft_cost(1, 0.014));
        assert!((gate.draft_seconds(1) - 0.014).abs() < 1e-9, "{}", gate.draft_seconds(1));
        assert!(!gate.pays(&input(1, &[7], &cal)));
        (0..40).for_each(|_| gate.record_draft_cost(1, 0.0014));
        assert!(gate.pays(&input(1, &[7], &cal)));
        gate.record_draft_cost(1, f64::NAN);
        gate.record_draft_cost(1, 0.0);
        assert!(gate.draft_seconds(1).is_finite());
    }

    #[test]
    fn without_history_the_gate_drafts() {
        let mut gate = DraftGate::new(h200());
        let cal = Calibration::default();
        assert_eq!(gate.decide(&input(1, &[7], &cal)), GateDecision::Draft);
        assert!(!gate.pays(&input(1, &[], &cal)), "no row may draft: nothing to pay for");
    }

    #[test]
    fn drafts_that_are_never_accepted_are_gated_at_every_batch() {
        let head = [0.5, 0.25, 0.125, 0.06, 0.03, 0.015, 0.008];
        let gate = gate_with(&head, 30);
        // The head alone says drafting pays; 30 rounds of nothing accepted say it does not.
        assert!(gate.pays(&input(1, &[7], &Calibration::default())));
        let cal = seen(&head, 0, 30);
        for rows in [1, 4, 16, 64] {
            let caps = vec![7; rows];
            assert!(!gate.pays(&input(rows, &caps, &cal)), "{rows} rows");
        }
    }

    #[test]
    fn good_drafts_pay_and_weak_ones_pay_only_where_verifying_is_cheap() {
        let cal = Calibration::default();
        let good = gate_with(&[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], 10);
        for rows in [1, 8, 64] {
            assert!(good.pays(&input(rows, &vec![7; rows], &cal)), "{rows} rows");
        }
        // One draft in ten accepted at position 0: 0.1 expected tokens do not cover a 1.4 ms draft.
        let weak = gate_with(&[0.1, 0.01], 10);
        assert!(!weak.pays(&input(1, &[7], &cal)));
    }

    #[test]
    fn probes_back_off_exponentially_and_reset_when_drafting_pays() {
        let head = [0.5, 0.25];
        let mut gate = gate_with(&head, 30);
        let bad = seen(&head, 0, 40);
        let decisions: Vec<GateDecision> = (0..1000).map(|_| gate.decide(&input(1, &[2], &bad))).collect();
        let probes: Vec<usize> =
            decisions.iter().enumerate().filter(|(_, d)| **d == GateDecision::Probe).map(|(i, _)| i).collect();
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(probes[0], 3, "the first probe after 4 skipped steps");
        assert_eq!(&gaps[..6], &[8, 16, 32, 64, 128, 256]);
        assert!(gaps[6..].iter().all(|&g| g == 256), "{gaps:?}");
        assert!(!decisions.contains(&GateDecision::Draft));
        // Acceptance comes back: the calibration sees it, the gate drafts and the back-off restarts.
        let good = seen(&head, 2, 60);
        assert_eq!(gate.decide(&input(1, &[2], &good)), GateDecision::Draft);
        let first = (0..10).position(|_| gate.decide(&input(1, &[2], &bad)) == GateDecision::Probe);
        assert_eq!(first, Some(3));
    }
}
