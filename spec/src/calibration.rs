//! Online calibration of draft survivals from what verification has shown (dspark.md §2.1: the
//! budget needs absolute survivals, and an untrained or drifting confidence head gives any value).
//!
//! Per draft position j, decayed sums over every verified draft that reached j: the number of such
//! drafts `N_j`, their predicted survivals `P_j = Σ a_j` and the observed survivals
//! `O_j = Σ 1[accepted > j]`. The factor of position j is the empirical ratio `O_j / P_j` weighted by
//! `N_j` against the factor of the position before it (1 before position 0), weighted by
//! [`PRIOR_ROWS`] pseudo-drafts:
//!
//! ```text
//! f_{-1} = 1,   f_j = (N_j · O_j / P_j + k · f_{j−1}) / (N_j + k)   (f_j = f_{j−1} while P_j = 0)
//! a'_j = min_{i ≤ j} min(1, a_i · f_i)
//! ```
//!
//! So a fresh calibration trusts the head (f = 1), a position with data converges to `O_j / P_j`
//! within tens of rounds, and a position never verified follows the one before it. Every sum decays
//! by [`DECAY`] once per round that verified a draft ([`Calibration::next_round`]), so positions that
//! stop being verified drift back to that prior and a changed drafter is followed.
//!
//! Invariants:
//! - Non-anticipating (DSpark Appendix A): `a'_j` depends on `a_{≤j}` of the draft and on rounds that
//!   were verified before this one, never on this round's tokens or on `c_{>j}`. The factors only
//!   change between rounds, so every budget over calibrated survivals stays lossless (the property
//!   tests in `budget` run the budgets over calibrated drafts).
//! - `a'` is non-increasing along the draft and lies in [0, 1]; factors are finite and non-negative.
//! - Model drafts and model-free drafts are calibrated separately ([`Calibrations`]): their
//!   confidences come from different estimators.

use crate::draft::{Draft, DraftSource};

/// Per-round decay of every sum (an effective memory of ~20 verified rounds).
pub const DECAY: f64 = 0.95;
/// The prior's weight, in verified drafts.
pub const PRIOR_ROWS: f64 = 1.0;

/// Per-position survival factors learned from verified drafts of one source.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    /// `N_j`: decayed count of verified drafts that reached position j.
    verified: Vec<f64>,
    /// `P_j`: decayed sum of predicted survivals of verified positions.
    predicted: Vec<f64>,
    /// `O_j`: decayed count of verified positions that were accepted.
    observed: Vec<f64>,
    /// Observations arrived since the last decay.
    fresh: bool,
}

impl Calibration {
    /// One verified draft: `survival[j]` the raw survival predicted for each verified position, of
    /// which the first `accepted` were accepted.
    pub fn observe(&mut self, survival: &[f64], accepted: usize) {
        if survival.is_empty() {
            return;
        }
        if self.predicted.len() < survival.len() {
            self.verified.resize(survival.len(), 0.0);
            self.predicted.resize(survival.len(), 0.0);
            self.observed.resize(survival.len(), 0.0);
        }
        for (j, &a) in survival.iter().enumerate() {
            self.verified[j] += 1.0;
            self.predicted[j] += a.clamp(0.0, 1.0);
            self.observed[j] += f64::from(u8::from(j < accepted));
        }
        self.fresh = true;
    }

    /// Closes a round: decays every sum once if the round observed anything.
    pub fn next_round(&mut self) {
        if !std::mem::take(&mut self.fresh) {
            return;
        }
        let sums = self.verified.iter_mut().chain(self.predicted.iter_mut()).chain(self.observed.iter_mut());
        sums.for_each(|x| *x *= DECAY);
    }

    /// `f_j` for positions `0..len`.
    pub fn factors(&self, len: usize) -> Vec<f64> {
        let mut prior = 1.0;
        (0..len)
            .map(|j| {
                let sum = |v: &[f64]| v.get(j).copied().unwrap_or(0.0);
                let (n, p, o) = (sum(&self.verified), sum(&self.predicted), sum(&self.observed));
                if p > 0.0 {
                    prior = (n * o / p + PRIOR_ROWS * prior) / (n + PRIOR_ROWS);
                }
                prior
            })
            .collect()
    }

    /// Calibrated survivals `a'` of raw survivals `survival`.
    pub fn calibrate(&self, survival: &[f64]) -> Vec<f64> {
        let mut floor = 1.0f64;
        survival
            .iter()
            .zip(self.factors(survival.len()))
            .map(|(&a, f)| {
                floor = floor.min((a.clamp(0.0, 1.0) * f).min(1.0));
                floor
            })
            .collect()
    }

    /// `draft` with calibrated confidences (tokens and source unchanged).
    pub fn apply(&self, draft: &Draft) -> Draft {
        draft.with_survival(&self.calibrate(&draft.survival()))
    }
}

/// One calibration per draft source.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibrations {
    pub model: Calibration,
    pub model_free: Calibration,
}

impl Calibrations {
    pub fn of(&self, source: DraftSource) -> &Calibration {
        match source {
            DraftSource::Model => &self.model,
            DraftSource::ModelFree => &self.model_free,
        }
    }

    pub fn of_mut(&mut self, source: DraftSource) -> &mut Calibration {
        match source {
            DraftSource::Model => &mut self.model,
            DraftSource::ModelFree => &mut self.model_free,
        }
    }

    /// Closes a round on both.
    pub fn next_round(&mut self) {
        self.model.next_round();
        self.model_free.next_round();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// `rounds` rounds of one draft each, predicted survivals `predicted`, true conditional
    /// acceptance `truth[j]`, every position verified.
    fn train(cal: &mut Calibration, rng: &mut ChaCha8Rng, predicted: &[f64], truth: &[f64], rounds: usize) {
        for _ in 0..rounds {
            let accepted = truth.iter().take_while(|&&c| rng.gen_bool(c)).count();
            cal.observe(predicted, accepted);
            cal.next_round();
        }
    }

    #[test]
    fn a_fresh_calibration_trusts_the_head() {
        let cal = Calibration::default();
        assert_eq!(cal.calibrate(&[0.9, 0.5, 0.2]), vec![0.9, 0.5, 0.2]);
        let d = Draft::new(vec![1, 2], vec![0.8, 0.5]).unwrap().with_source(DraftSource::Model);
        assert_eq!(cal.apply(&d), d);
    }

    #[test]
    fn an_overconfident_head_converges_to_the_truth_within_tens_of_rounds() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut cal = Calibration::default();
        // The head says 0.5 at every position; nothing is ever accepted (a random-weight drafter).
        let predicted = [0.5, 0.25, 0.125, 0.0625];
        train(&mut cal, &mut rng, &predicted, &[0.0; 4], 10);
        let after_10 = cal.calibrate(&predicted);
        assert!(after_10[0] < 0.5 * 0.25, "{after_10:?}");
        train(&mut cal, &mut rng, &predicted, &[0.0; 4], 30);
        let after_40 = cal.calibrate(&predicted);
        assert!(after_40[0] < 0.04, "{after_40:?}");
        assert!(after_40.windows(2).all(|w| w[1] <= w[0]));
    }

    #[test]
    fn an_underconfident_head_is_raised_and_capped_at_one() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut cal = Calibration::default();
        let predicted = [0.3, 0.09, 0.027];
        train(&mut cal, &mut rng, &predicted, &[1.0; 3], 40);
        let a = cal.calibrate(&predicted);
        assert!(a.iter().all(|&x| x > 0.9 && x <= 1.0), "{a:?}");
    }

    #[test]
    fn a_noisy_head_converges_to_the_empirical_rate() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut cal = Calibration::default();
        // True conditional rates 0.6, 0.5: survivals 0.6, 0.3. The head says 0.9, 0.81.
        let predicted = [0.9, 0.81];
        train(&mut cal, &mut rng, &predicted, &[0.6, 0.5], 50);
        // The estimate after each of 200 more rounds, averaged (one estimate remembers ~20 rounds).
        let mut mean = [0.0f64; 2];
        for _ in 0..200 {
            train(&mut cal, &mut rng, &predicted, &[0.6, 0.5], 1);
            let a = cal.calibrate(&predicted);
            mean.iter_mut().zip(&a).for_each(|(m, x)| *m += x / 200.0);
        }
        assert!((mean[0] - 0.6).abs() < 0.05 && (mean[1] - 0.3).abs() < 0.05, "{mean:?}");
    }

    #[test]
    fn unverified_positions_follow_the_position_before_and_decay_back() {
        let mut cal = Calibration::default();
        for _ in 0..30 {
            cal.observe(&[0.8], 0);
            cal.next_round();
        }
        let f = cal.factors(3);
        assert!(f[0] < 0.1 && (f[1] - f[0]).abs() < 1e-12 && (f[2] - f[0]).abs() < 1e-12, "{f:?}");
        // Position 0 is then always accepted: it recovers, and the positions after it follow.
        for _ in 0..60 {
            cal.observe(&[0.8], 1);
            cal.next_round();
        }
        let f = cal.factors(2);
        assert!(f[0] > 1.0 && f[1] > 1.0, "{f:?}");
        // A round without observations does not decay.
        let before = cal.clone();
        cal.next_round();
        assert_eq!(cal, before);
    }

    #[test]
    fn sources_are_calibrated_apart() {
        let mut c = Calibrations::default();
        c.of_mut(DraftSource::Model).observe(&[0.9], 0);
        c.next_round();
        assert!(c.of(DraftSource::Model).factors(1)[0] < 1.0);
        assert_eq!(c.of(DraftSource::ModelFree).factors(1), vec![1.0]);
    }
}
