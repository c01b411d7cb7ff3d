//! Forced ("synthetic") acceptance for benchmarks: the settings a benchmark passes (vLLM's
//! `synthetic_acceptance_length` or `synthetic_acceptance_rates`) turned into the runner's
//! acceptance mode.
//!
//! Invariant: the schedule itself is defined once, in `sparkd_kernels::acceptance::SyntheticSchedule`
//! (minimum-variance rates from a mean length); this module only validates and wraps it, so the
//! engine and the benchmarks cannot disagree on what a forced AL means.

use sparkd_kernels::acceptance::{AcceptanceMode, SyntheticSchedule};

use crate::error::Result;

/// What a benchmark asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ForcedAcceptance {
    /// Mean acceptance length in [1, k+1], bonus included (InferenceX's golden AL).
    Length(f64),
    /// Unconditional per-position rates, non-increasing.
    Rates(Vec<f64>),
}

impl ForcedAcceptance {
    /// The schedule for drafts of up to `num_spec_tokens` tokens.
    pub fn schedule(&self, num_spec_tokens: usize) -> Result<SyntheticSchedule> {
        Ok(match self {
            ForcedAcceptance::Length(l) => SyntheticSchedule::from_acceptance_length(*l, num_spec_tokens)?,
            ForcedAcceptance::Rates(r) => SyntheticSchedule::from_rates(r.clone())?,
        })
    }

    /// The runner's acceptance mode.
    pub fn mode(&self, num_spec_tokens: usize) -> Result<AcceptanceMode> {
        Ok(AcceptanceMode::Synthetic(self.schedule(num_spec_tokens)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_golden_length_becomes_the_kernels_schedule() {
        let s = ForcedAcceptance::Length(4.258).schedule(7).unwrap();
        assert!((s.mean_acceptance_length() - 4.258).abs() < 1e-12);
        assert_eq!(&s.rates()[..3], &[1.0, 1.0, 1.0]);
        assert!(ForcedAcceptance::Length(9.0).mode(7).is_err());
        let err = ForcedAcceptance::Rates(vec![0.2, 0.9]).schedule(2).unwrap_err();
        assert_eq!(err.kind(), "invalid_input");
    }
}
