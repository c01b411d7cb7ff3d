//! The decode step-time limit: how many prefill tokens, in how many rows, a step that carries decode rows may
//! add, so that decode rows do not stall behind large prefill chunks.
//!
//! Cost model ([`StepCosts`]): the predicted seconds of a step computing `tokens` tokens in `rows` rows whose
//! tokens read `context_reads` context tokens is `t(tokens) + per_row × (rows − 1) + per_read × context_reads`.
//! - `t` is a step-cost profile ([`SpsProfile`], one row of B tokens on a fresh state, measured on the runner at
//!   start-up: linear between measured points, non-decreasing, extrapolated with the last segment's slope).
//! - `per_row` is what each further row adds (its own recurrent state, attention and sampling), measured at
//!   start-up as the excess of B one-token rows over one row of B tokens (decision D82: on the CPU reference four
//!   decode rows cost 2.6x one row of four tokens, so a profile of single rows alone over-admitted prefill beside
//!   many decode rows).
//! - `context_reads` is `Σ tokens × context` over the rows, `context` being the tokens already in a row's state
//!   (the MLA cache each of its tokens attends to; `t` covers the step's own tokens). `per_read` is measured at
//!   start-up from a chunk on a state holding a long context (decision D83: on k3-mini on an H200 a 64-token
//!   chunk at a 98k context took 48.6 ms against 8.1 ms fresh, and 16 decode rows 13.0 ms against 4.7 ms, both
//!   5–8 ns a context read, which a model of fresh states predicted as 8.7 and 6.4 ms).
//!
//! Policy, for a step whose decode rows (rows that sample after their one unfed token, verify windows
//! included) have the shape `d` (tokens, rows):
//! - the target is `T = max(target, cost(d))`, where `target` is absolute ([`StepTarget::Seconds`]) or
//!   relative, `factor × cost(d)` ([`StepTarget::Factor`]); so it never falls below what the decode rows
//!   themselves need;
//! - each prefill row the scheduler adds, at context `c`, with the step's shape so far `s` and `room` tokens of
//!   `max_num_batched_tokens` left, may take the largest `p ≤ room` with `cost(s with a row of p tokens at
//!   context c) ≤ T` (0 when none fits); the step's first prefill row may always take
//!   `min(min_prefill_chunk, room)`.
//!
//! Invariants:
//! - Pure: a function of the costs, the target and the arguments (no clock, no runner).
//! - Progress: a step with decode rows may always give its first prefill row `min(min_prefill_chunk, room)`
//!   tokens, however tight the target, so a long prompt is never starved by decode traffic.
//! - A prefill row past the first fits the target (`cost ≤ T` with it), and so does the first whenever it
//!   takes more than `min_prefill_chunk`; so a step whose prefill exceeds `min_prefill_chunk` tokens is
//!   predicted within `T`.
//! - An allowance never exceeds `room` (the token budget stays the hard cap).

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

/// A step's size as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    pub tokens: usize,
    pub rows: usize,
    /// `Σ tokens × context` over the rows: the context tokens the step's tokens read.
    pub context_reads: u64,
}

impl StepShape {
    /// `self` with one more row of `tokens` tokens on a state that holds `context` tokens.
    pub fn with_row(self, tokens: usize, context: usize) -> StepShape {
        StepShape {
            tokens: self.tokens + tokens,
            rows: self.rows + 1,
            context_reads: self.context_reads.saturating_add(tokens as u64 * context as u64),
        }
    }
}

/// The next prefill row a step may add: its context, the step's token budget left, and whether it is the
/// step's first prefill row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NextPrefill {
    pub context: usize,
    pub room: usize,
    pub first: bool,
}

/// The step-cost model (module doc): the profile of single rows, what each further row adds and what each
/// context read adds.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCosts {
    tokens: SpsProfile,
    per_row_seconds: f64,
    per_context_read_seconds: f64,
}

/// `x` if finite and positive, else zero (a measured excess that noise made negative costs nothing).
fn non_negative(x: f64) -> f64 {
    if x.is_finite() {
        x.max(0.0)
    } else {
        0.0
    }
}

impl StepCosts {
    /// `per_row_seconds` below zero or not finite counts as zero; context reads cost nothing until
    /// [`StepCosts::with_context_read_seconds`].
    pub fn new(tokens: SpsProfile, per_row_seconds: f64) -> Self {
        StepCosts { tokens, per_row_seconds: non_negative(per_row_seconds), per_context_read_seconds: 0.0 }
    }

    /// `self` with each context read costing `seconds` (below zero or not finite: zero).
    pub fn with_context_read_seconds(self, seconds: f64) -> Self {
        StepCosts { per_context_read_seconds: non_negative(seconds), ..self }
    }

    pub fn per_context_read_seconds(&self) -> f64 {
        self.per_context_read_seconds
    }

    /// The profile of single rows, `t(B)`.
    pub fn tokens(&self) -> &SpsProfile {
        &self.tokens
    }

    pub fn per_row_seconds(&self) -> f64 {
        self.per_row_seconds
    }

    /// The predicted seconds of a step of `shape`.
    pub fn predicted_seconds(&self, shape: StepShape) -> f64 {
        self.tokens.step_seconds(shape.tokens)
            + self.per_row_seconds * shape.rows.saturating_sub(1) as f64
            + self.per_context_read_seconds * shape.context_reads as f64
    }
}

/// A step-cost model, a target, and the least prefill a step with decode rows may always add.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimeLimit {
    costs: StepCosts,
    target: StepTarget,
    min_prefill_chunk: usize,
}

impl StepTimeLimit {
    pub fn new(costs: StepCosts, target: StepTarget, min_prefill_chunk: usize) -> Self {
        StepTimeLimit { costs, target, min_prefill_chunk }
    }

    pub fn costs(&self) -> &StepCosts {
        &self.costs
    }

    pub fn target(&self) -> StepTarget {
        self.target
    }

    pub fn min_prefill_chunk(&self) -> usize {
        self.min_prefill_chunk
    }

    /// The predicted seconds of a step of `shape`.
    pub fn predicted_seconds(&self, shape: StepShape) -> f64 {
        self.costs.predicted_seconds(shape)
    }

    /// `T`: the predicted seconds a step whose decode rows have the shape `decode` may take.
    pub fn target_seconds(&self, decode: StepShape) -> f64 {
        let decode = self.predicted_seconds(decode);
        let target = match self.target {
            StepTarget::Factor(factor) => factor * decode,
            StepTarget::Seconds(seconds) => seconds,
        };
        // `f64::max` ignores a NaN side, so a bad target falls back to the decode rows' own time.
        target.max(decode)
    }

    /// Prefill tokens the prefill row `next` may take in a step of the shape `planned` so far (decode rows and
    /// the prefill rows before this one), held to `target` (from [`StepTimeLimit::target_seconds`]) (module
    /// invariants).
    pub fn chunk_allowance(&self, planned: StepShape, target: f64, next: NextPrefill) -> usize {
        let NextPrefill { context, room, first } = next;
        let fits = |p: usize| self.predicted_seconds(planned.with_row(p, context)) <= target;
        let fitting = if fits(0) {
            // The cost is non-decreasing in p: search the largest fitting p in [0, room].
            let (mut fits_at, mut over) = (0, room + 1);
            while over - fits_at > 1 {
                let mid = fits_at + (over - fits_at) / 2;
                if fits(mid) {
                    fits_at = mid;
                } else {
                    over = mid;
                }
            }
            fits_at
        } else {
            0
        };
        let least = if first { self.min_prefill_chunk } else { 0 };
        fitting.max(least).min(room)
    }
}

/// A test cost model `t(B) = base + B × per_token` (seconds), measured at B = 1 and B = `up_to`, with no
/// per-row cost.
#[cfg(test)]
pub(crate) fn linear_costs(base: f64, per_token: f64, up_to: usize) -> StepCosts {
    let point = |b: usize| sparkd_spec::sps::SpsPoint {
        batch_tokens: b,
        steps_per_second: 1.0 / (base + b as f64 * per_token),
    };
    StepCosts::new(SpsProfile::from_points(vec![point(1), point(up_to)]).expect("a valid linear profile"), 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t(B) = 4 ms + B × 0.05 ms` (a GPU-like profile: flat-ish at small B).
    fn linear() -> StepCosts {
        linear_costs(0.004, 5e-5, 2048)
    }

    fn rows(rows: usize, tokens: usize) -> StepShape {
        StepShape { tokens, rows, context_reads: 0 }
    }

    /// The next prefill row on a fresh state.
    fn fresh(room: usize, first: bool) -> NextPrefill {
        NextPrefill { context: 0, room, first }
    }

    #[test]
    fn the_relative_target_scales_the_decode_rows_time() {
        let limit = StepTimeLimit::new(linear(), StepTarget::Factor(1.4), 64);
        // One row of 16 tokens: t(16) = 4.8 ms, T = 6.72 ms, B* = 54: 38 prefill tokens, below the minimum
        // chunk, so the first chunk takes the minimum and a second one nothing.
        let target = limit.target_seconds(rows(1, 16));
        assert!((target - 0.00672).abs() < 1e-12);
        assert_eq!(limit.chunk_allowance(rows(1, 16), target, fresh(2032, true)), 64);
        assert_eq!(limit.chunk_allowance(rows(2, 80), target, fresh(1968, false)), 0);
        let limit = StepTimeLimit::new(linear(), StepTarget::Factor(2.2), 64);
        // T = 10.56 ms: B* = 131.
        let target = limit.target_seconds(rows(1, 16));
        assert_eq!(limit.chunk_allowance(rows(1, 16), target, fresh(2032, true)), 115);
        assert!(limit.predicted_seconds(rows(2, 131)) <= target);
        assert!(limit.predicted_seconds(rows(2, 132)) > target);
        assert_eq!(limit.chunk_allowance(rows(1, 16), target, fresh(50, true)), 50, "never more than the room left");
        // A second prefill row gets what the first left: 131 − 16 − 100.
        assert_eq!(limit.chunk_allowance(rows(2, 116), target, fresh(1916, false)), 15);
    }

    #[test]
    fn an_absolute_target_is_never_below_the_decode_rows_need() {
        let limit = StepTimeLimit::new(linear(), StepTarget::Seconds(0.00902), 8);
        let target = limit.target_seconds(rows(1, 20));
        assert_eq!(
            limit.chunk_allowance(rows(1, 20), target, fresh(4000, true)),
            80,
            "t(100) = 9 ms, t(101) = 9.05 ms"
        );
        let tight = StepTimeLimit::new(linear(), StepTarget::Seconds(0.001), 8);
        let target = tight.target_seconds(rows(1, 20));
        assert!((target - tight.predicted_seconds(rows(1, 20))).abs() < 1e-15);
        assert_eq!(tight.chunk_allowance(rows(1, 20), target, fresh(4000, true)), 8, "the minimum chunk still runs");
        assert_eq!(tight.chunk_allowance(rows(1, 20), target, fresh(3, true)), 3);
        assert_eq!(tight.chunk_allowance(rows(2, 28), target, fresh(3992, false)), 0, "and only the first");
        let nan = StepTimeLimit::new(linear(), StepTarget::Factor(f64::NAN), 8);
        assert_eq!(nan.chunk_allowance(rows(1, 20), nan.target_seconds(rows(1, 20)), fresh(4000, true)), 8);
    }

    #[test]
    fn each_row_past_the_first_adds_the_per_row_cost() {
        let costs = StepCosts::new(linear().tokens().clone(), 0.001);
        assert!((costs.predicted_seconds(rows(4, 4)) - (0.0042 + 0.003)).abs() < 1e-12);
        assert_eq!(costs.predicted_seconds(rows(1, 4)), costs.predicted_seconds(rows(0, 4)));
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(StepCosts::new(linear().tokens().clone(), bad).per_row_seconds(), 0.0);
        }
        // Four decode rows at 1.02 ms a row: T = 1.5 × 7.26 ms = 10.89 ms; the prefill row makes five rows, leaving
        // t(4 + p) ≤ 6.81 ms: p = 52. Without the per-row cost the same factor gives T = 6.3 ms: p = 42.
        let limit = StepTimeLimit::new(StepCosts::new(linear().tokens().clone(), 0.00102), StepTarget::Factor(1.5), 8);
        assert_eq!(limit.chunk_allowance(rows(4, 4), limit.target_seconds(rows(4, 4)), fresh(1000, true)), 52);
        let single = StepTimeLimit::new(linear(), StepTarget::Factor(1.5), 8);
        assert_eq!(single.chunk_allowance(rows(4, 4), single.target_seconds(rows(4, 4)), fresh(1000, true)), 42);
    }

    #[test]
    fn each_context_read_adds_its_cost_and_a_long_context_shrinks_the_chunk() {
        // 5 ns a read (D83's H200 figure): a decode row at a 100k context adds 0.5 ms, a 64-token chunk 32 ms.
        let costs = linear().with_context_read_seconds(5e-9);
        let decode = StepShape::default().with_row(1, 100_000);
        assert_eq!(decode.context_reads, 100_000);
        assert!((costs.predicted_seconds(decode) - (0.00405 + 0.0005)).abs() < 1e-12);
        let chunk = StepShape::default().with_row(64, 100_000);
        assert!((costs.predicted_seconds(chunk) - (0.0072 + 0.032)).abs() < 1e-12);
        for bad in [-1e-9, f64::NAN] {
            assert_eq!(linear().with_context_read_seconds(bad).per_context_read_seconds(), 0.0);
        }
        // Beside one decode row at a 1k context, T = 1.5 × (4.05 + 0.005) ms = 6.0825 ms. With an 8-token prefill
        // row planned, a further row of p tokens at context c fits 4 + 0.05 × (9 + p) + 0.005 + p × c × 5e-6 ≤
        // 6.0825 ms: the longer its context, the smaller its share.
        let limit = StepTimeLimit::new(costs, StepTarget::Factor(1.5), 64);
        let decode = StepShape::default().with_row(1, 1_000);
        let target = limit.target_seconds(decode);
        let planned = decode.with_row(8, 0);
        let at = |context| limit.chunk_allowance(planned, target, NextPrefill { context, room: 4000, first: false });
        assert_eq!(at(0), 32, "p ≤ 32.55");
        assert_eq!(at(10_000), 16, "each token adds 0.05 ms of reads: p ≤ 16.3");
        assert_eq!(at(100_000), 2, "each token adds 0.5 ms of reads: p ≤ 2.96");
        assert!(limit.predicted_seconds(planned.with_row(16, 10_000)) <= target);
        assert!(limit.predicted_seconds(planned.with_row(17, 10_000)) > target);
    }
}
