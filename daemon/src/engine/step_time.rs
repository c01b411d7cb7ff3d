//! The decode step-time limit: how many prefill tokens a step that carries decode rows may add, so
//! that decode rows do not stall behind large prefill chunks.
//!
//! Cost model: `t(B)`, the predicted seconds of a step computing `B` tokens, is the step-cost
//! profile's `step_seconds(B)` (an [`SpsProfile`] measured on the runner at start-up: linear between
//! measured points, non-decreasing in `B`, extrapolated with the last segment's slope).
//!
//! Policy, for a step whose decode rows (rows that sample after their one unfed token, verify
//! windows included) hold `d` tokens and that has `room` tokens of `max_num_batched_tokens` left:
//! - the target is `T = max(target, t(d))`, where `target` is absolute ([`StepTarget::Seconds`]) or
//!   relative, `factor × t(d)` ([`StepTarget::Factor`]); so it never falls below what the decode rows
//!   themselves need;
//! - the prefill allowance is `max(min(B* − d, room), min(min_prefill_chunk, room))`, where `B*` is
//!   the largest `B ≤ d + room` with `t(B) ≤ T`.
//!
//! Invariants:
//! - Pure: a function of the profile, the target and the arguments (no clock, no runner).
//! - Progress: a step with decode rows may always add `min(min_prefill_chunk, room)` prefill tokens,
//!   however tight the target, so a long prompt is never starved by decode traffic.
//! - Whenever the allowance exceeds `min_prefill_chunk`, `t(d + allowance) ≤ T`.
//! - The allowance never exceeds `room` (the token budget stays the hard cap).

use sparkd_spec::SpsProfile;

/// The default relative target: a step carrying decode rows may take 1.5× the predicted time of its
/// decode rows alone. The replay goal is decode ITL P90 ≤ 2× the bench step; the other 0.5× is left
/// for what the profile does not see (per-step host work, attention over long contexts, the error of
/// a profile measured on fresh states). On k3-mini on an H200 half a step (about 2 ms) fits fewer than
/// 64 prompt tokens (t(64) = 8.97 ms against t(1) = 4.29 ms at start-up, BENCHMARKS.md, issue 31), so
/// the minimum chunk decides there: a step beside decode rows prefills one 64-token block.
pub const DEFAULT_STEP_TARGET_FACTOR: f64 = 1.5;

/// How long a step carrying decode rows may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepTarget {
    /// This multiple of the predicted time of the step's decode rows alone.
    Factor(f64),
    /// This many seconds.
    Seconds(f64),
}

impl std::fmt::Display for StepTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepTarget::Factor(x) => write!(f, "{x}x the decode rows' step"),
            StepTarget::Seconds(s) => write!(f, "{} ms", s * 1e3),
        }
    }
}

/// A step-cost profile, a target, and the least prefill a step with decode rows may always add.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimeLimit {
    costs: SpsProfile,
    target: StepTarget,
    min_prefill_chunk: usize,
}

impl StepTimeLimit {
    pub fn new(costs: SpsProfile, target: StepTarget, min_prefill_chunk: usize) -> Self {
        StepTimeLimit { costs, target, min_prefill_chunk }
    }

    pub fn costs(&self) -> &SpsProfile {
        &self.costs
    }

    pub fn target(&self) -> StepTarget {
        self.target
    }

    pub fn min_prefill_chunk(&self) -> usize {
        self.min_prefill_chunk
    }

    /// `t(B)`: the predicted seconds of a step computing `tokens` tokens.
    pub fn predicted_seconds(&self, tokens: usize) -> f64 {
        self.costs.step_seconds(tokens)
    }

    /// `T`: the predicted seconds a step whose decode rows hold `decode_tokens` tokens may take.
    pub fn target_seconds(&self, decode_tokens: usize) -> f64 {
        let decode = self.predicted_seconds(decode_tokens);
        let target = match self.target {
            StepTarget::Factor(factor) => factor * decode,
            StepTarget::Seconds(seconds) => seconds,
        };
        // `f64::max` ignores a NaN side, so a bad target falls back to the decode rows' own time.
        target.max(decode)
    }

    /// Prefill tokens a step whose decode rows hold `decode_tokens` tokens may add, with `room`
    /// tokens of the step's budget left.
    pub fn prefill_allowance(&self, decode_tokens: usize, room: usize) -> usize {
        let target = self.target_seconds(decode_tokens);
        // `t` is non-decreasing and `t(d) ≤ T`: search the largest fitting B in [d, d + room].
        let (mut fits, mut over) = (decode_tokens, decode_tokens + room + 1);
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if self.predicted_seconds(mid) <= target {
                fits = mid;
            } else {
                over = mid;
            }
        }
        (fits - decode_tokens).max(self.min_prefill_chunk).min(room)
    }
}

/// A test cost profile `t(B) = base + B × per_token` (seconds), measured at B = 1 and B = `up_to`.
#[cfg(test)]
pub(crate) fn linear_costs(base: f64, per_token: f64, up_to: usize) -> SpsProfile {
    let point = |b: usize| sparkd_spec::sps::SpsPoint {
        batch_tokens: b,
        steps_per_second: 1.0 / (base + b as f64 * per_token),
    };
    SpsProfile::from_points(vec![point(1), point(up_to)]).expect("a valid linear profile")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t(B) = 4 ms + B × 0.05 ms` (a GPU-like profile: flat-ish at small B).
    fn linear() -> SpsProfile {
        linear_costs(0.004, 5e-5, 2048)
    }

    #[test]
    fn the_relative_target_scales_the_decode_rows_time() {
        let limit = StepTimeLimit::new(linear(), StepTarget::Factor(1.4), 64);
        // d = 16: t(16) = 4.8 ms, T = 6.72 ms, B* = 54: 38 prefill tokens, below the minimum chunk,
        // so the minimum chunk.
        assert!((limit.target_seconds(16) - 0.00672).abs() < 1e-12);
        assert_eq!(limit.prefill_allowance(16, 2032), 64);
        let limit = StepTimeLimit::new(linear(), StepTarget::Factor(2.2), 64);
        // T = 10.56 ms: B* = 131.
        assert_eq!(limit.prefill_allowance(16, 2032), 115);
        assert!(limit.predicted_seconds(131) <= limit.target_seconds(16));
        assert!(limit.predicted_seconds(132) > limit.target_seconds(16));
        assert_eq!(limit.prefill_allowance(16, 50), 50, "never more than the room left");
    }

    #[test]
    fn an_absolute_target_is_never_below_the_decode_rows_need() {
        let limit = StepTimeLimit::new(linear(), StepTarget::Seconds(0.00902), 8);
        assert_eq!(limit.prefill_allowance(20, 4000), 80, "t(100) = 9 ms, t(101) = 9.05 ms");
        let tight = StepTimeLimit::new(linear(), StepTarget::Seconds(0.001), 8);
        assert!((tight.target_seconds(20) - tight.predicted_seconds(20)).abs() < 1e-15);
        assert_eq!(tight.prefill_allowance(20, 4000), 8, "the minimum chunk still runs");
        assert_eq!(tight.prefill_allowance(20, 3), 3);
        let nan = StepTimeLimit::new(linear(), StepTarget::Factor(f64::NAN), 8);
        assert_eq!(nan.prefill_allowance(20, 4000), 8);
    }
}
