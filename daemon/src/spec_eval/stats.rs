//! The report math of `sparkd spec-eval`: per-position acceptance, acceptance length and the calibration of a
//! drafter's confidences (a reliability table and its expected calibration error), from verify rounds.
//!
//! A [`Round`] is one verify step of one request: the conditional confidences `c_j` of the draft positions it
//! verified (DSpark's `c_j`: the predicted probability that draft j is accepted given that drafts 0..j were) and
//! how many of them were accepted, a prefix.
//!
//! Invariants:
//! - Position j of a round is *reached* when every position before it was accepted (j ≤ accepted, within the
//!   verified positions); a reached position is accepted or is the first rejected one, so for every position
//!   `accepted[j] <= reached[j]` and `reached[j + 1] <= accepted[j]`.
//! - Every reached position is one calibration sample `(c_j, accepted or not)`; the observed rate of a position or a
//!   bin is accepted / reached, comparable with the mean conditional confidence of the same samples. Positions
//!   never reached are never samples.
//! - The acceptance length (AL) is the mean over rounds of accepted + 1 (the tokens a verify round commits, the
//!   correction or bonus token included, vLLM's definition); the predicted AL is the mean over rounds of
//!   1 + Σ_j Π_{i≤j} c_i over the verified positions.
//! - Bins are [`NUM_BINS`] equal-width intervals of [0, 1], the last one closed (a confidence of 1 is in it); the
//!   expected calibration error (ECE) is Σ_b (n_b / N) |mean confidence_b − observed rate_b| over the samples.
//! - Rounds that break these rules (more accepted than verified, a confidence outside [0, 1]) are an error, never a
//!   panic; rates of empty positions and bins are `None`, never NaN.

use serde::Serialize;

/// Equal-width confidence bins of the reliability table.
pub const NUM_BINS: usize = 10;

/// One verify round of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Round {
    /// The conditional confidence of each verified draft position.
    pub confidences: Vec<f64>,
    /// Verified positions accepted (a prefix of them).
    pub accepted: usize,
}

/// A round that cannot be scored.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum StatsError {
    #[error("round {round}: {accepted} drafts accepted of {verified} verified")]
    AcceptedPastVerified { round: usize, accepted: usize, verified: usize },
    #[error("round {round}: the confidence of position {position} is {value}, not in [0, 1]")]
    Confidence { round: usize, position: usize, value: f64 },
}

/// What verification showed at one draft position (1-based, as the per-position metrics count).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PositionStats {
    pub position: usize,
    /// Rounds in which every position before this one was accepted.
    pub reached: usize,
    /// Of those, rounds that accepted this position.
    pub accepted: usize,
    /// accepted / reached (`None` when never reached).
    pub observed_rate: Option<f64>,
    /// The mean conditional confidence over the rounds that reached it (`None` when never reached).
    pub mean_confidence: Option<f64>,
}

/// One confidence bin of the reliability table: the reached positions whose confidence lies in it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bin {
    pub lower: f64,
    pub upper: f64,
    pub count: usize,
    pub accepted: usize,
    pub mean_confidence: Option<f64>,
    pub observed_rate: Option<f64>,
}

/// Per-position acceptance and the calibration of the confidences over a set of rounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// Verify rounds scored.
    pub rounds: usize,
    /// Calibration samples: reached positions over every round.
    pub samples: usize,
    /// Mean tokens committed per verify round (accepted + 1); `None` without rounds.
    pub acceptance_length: Option<f64>,
    /// Mean of 1 + Σ of the predicted prefix survivals per round; `None` without rounds.
    pub predicted_acceptance_length: Option<f64>,
    pub positions: Vec<PositionStats>,
    /// Expected calibration error over the bins, weighted by count; `None` without samples.
    pub ece: Option<f64>,
    pub bins: Vec<Bin>,
}

/// Running sums of one position or bin.
#[derive(Clone, Copy, Default)]
struct Tally {
    reached: usize,
    accepted: usize,
    confidence: f64,
}

impl Tally {
    fn add(&mut self, confidence: f64, accepted: bool) {
        self.reached += 1;
        self.accepted += usize::from(accepted);
        self.confidence += confidence;
    }

    fn rate(&self) -> Option<f64> {
        (self.reached > 0).then(|| self.accepted as f64 / self.reached as f64)
    }

    fn mean_confidence(&self) -> Option<f64> {
        (self.reached > 0).then(|| self.confidence / self.reached as f64)
    }
}

/// The bin of a confidence in [0, 1].
fn bin_of(confidence: f64) -> usize {
    ((confidence * NUM_BINS as f64) as usize).min(NUM_BINS - 1)
}

/// Scores `rounds`, reporting at least `positions` positions (more when a round verified more).
pub fn calibration(rounds: &[Round], positions: usize) -> Result<Calibration, StatsError> {
    for (r, round) in rounds.iter().enumerate() {
        let verified = round.confidences.len();
        if round.accepted > verified {
            return Err(StatsError::AcceptedPastVerified { round: r, accepted: round.accepted, verified });
        }
        if let Some(j) = round.confidences.iter().position(|c| !(0.0..=1.0).contains(c)) {
            return Err(StatsError::Confidence { round: r, position: j, value: round.confidences[j] });
        }
    }
    let width = rounds.iter().map(|r| r.confidences.len()).fold(positions, usize::max);
    let mut by_position = vec![Tally::default(); width];
    let mut by_bin = [Tally::default(); NUM_BINS];
    let (mut committed, mut predicted) = (0.0, 0.0);
    for round in rounds {
        let reached = (round.accepted + 1).min(round.confidences.len());
        for (j, &c) in round.confidences[..reached].iter().enumerate() {
            let accepted = j < round.accepted;
            by_position[j].add(c, accepted);
            by_bin[bin_of(c)].add(c, accepted);
        }
        committed += (round.accepted + 1) as f64;
        let mut survival = 1.0;
        predicted += 1.0 + round.confidences.iter().map(|c| (survival *= c, survival).1).sum::<f64>();
    }
    let samples: usize = by_bin.iter().map(|b| b.reached).sum();
    let ece = (samples > 0).then(|| {
        by_bin.iter().filter_map(|b| Some(b.reached as f64 * (b.mean_confidence()? - b.rate()?).abs())).sum::<f64>()
            / samples as f64
    });
    let per_round = |sum: f64| (!rounds.is_empty()).then(|| sum / rounds.len() as f64);
    Ok(Calibration {
        rounds: rounds.len(),
        samples,
        acceptance_length: per_round(committed),
        predicted_acceptance_length: per_round(predicted),
        positions: by_position
            .iter()
            .enumerate()
            .map(|(j, t)| PositionStats {
                position: j + 1,
                reached: t.reached,
                accepted: t.accepted,
                observed_rate: t.rate(),
                mean_confidence: t.mean_confidence(),
            })
            .collect(),
        ece,
        bins: by_bin
            .iter()
            .enumerate()
            .map(|(b, t)| Bin {
                lower: b as f64 / NUM_BINS as f64,
                upper: (b + 1) as f64 / NUM_BINS as f64,
                count: t.reached,
                accepted: t.accepted,
                mean_confidence: t.mean_confidence(),
                observed_rate: t.rate(),
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(confidences: &[f64], accepted: usize) -> Round {
        Round { confidences: confidences.to_vec(), accepted }
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-12)
    }

    /// Three rounds with known answers: two of three accepted, none accepted, every position accepted.
    fn hand_made() -> Vec<Round> {
        vec![round(&[0.9, 0.8, 0.5], 2), round(&[0.9, 0.6, 0.3], 0), round(&[0.7, 0.2], 2)]
    }

    #[test]
    fn positions_count_the_rounds_that_reached_and_accepted_them() {
        let c = calibration(&hand_made(), 3).unwrap();
        let counts: Vec<(usize, usize, usize)> =
            c.positions.iter().map(|p| (p.position, p.reached, p.accepted)).collect();
        assert_eq!(counts, vec![(1, 3, 2), (2, 2, 2), (3, 1, 0)]);
        assert!(close(c.positions[0].observed_rate, 2.0 / 3.0));
        assert!(close(c.positions[0].mean_confidence, (0.9 + 0.9 + 0.7) / 3.0));
        assert!(close(c.positions[1].mean_confidence, (0.8 + 0.2) / 2.0));
        assert!(close(c.positions[2].observed_rate, 0.0) && close(c.positions[2].mean_confidence, 0.5));
        assert!(c.positions.windows(2).all(|w| w[1].reached <= w[0].accepted));
        assert_eq!((c.rounds, c.samples), (3, 6));
    }

    #[test]
    fn acceptance_length_is_committed_tokens_per_round() {
        let c = calibration(&hand_made(), 3).unwrap();
        assert!(close(c.acceptance_length, 7.0 / 3.0));
        // 1 + 0.9 + 0.72 + 0.36, 1 + 0.9 + 0.54 + 0.162, 1 + 0.7 + 0.14.
        assert!(close(c.predicted_acceptance_length, (2.98 + 2.602 + 1.84) / 3.0));
    }

    #[test]
    fn ece_weighs_each_bins_gap_by_its_samples() {
        let c = calibration(&hand_made(), 3).unwrap();
        // Samples (0.9, 1) (0.8, 1) (0.5, 0) (0.9, 0) (0.7, 1) (0.2, 1): gaps 0.8, 0.5, 0.3, 0.2 and 0.4 twice.
        assert!(close(c.ece, (0.8 + 0.5 + 0.3 + 0.2 + 2.0 * 0.4) / 6.0), "{:?}", c.ece);
        let counts: Vec<usize> = c.bins.iter().map(|b| b.count).collect();
        assert_eq!(counts, vec![0, 0, 1, 0, 0, 1, 0, 1, 1, 2]);
        assert!(close(c.bins[9].mean_confidence, 0.9) && close(c.bins[9].observed_rate, 0.5));
        assert!(c.bins[0].mean_confidence.is_none() && c.bins[0].observed_rate.is_none());
        assert!(close(Some(c.bins[9].upper), 1.0) && close(Some(c.bins[2].lower), 0.2));
    }

    #[test]
    fn a_confidence_of_one_is_in_the_last_bin_and_a_calibrated_head_scores_zero() {
        let c = calibration(&[round(&[1.0, 0.0], 1)], 2).unwrap();
        assert_eq!((c.bins[9].count, c.bins[0].count), (1, 1));
        assert!(close(c.ece, 0.0));
    }

    #[test]
    fn no_rounds_give_empty_positions_and_no_rates() {
        let c = calibration(&[], 4).unwrap();
        assert_eq!(c.positions.len(), 4);
        assert!(c.positions.iter().all(|p| p.reached == 0 && p.observed_rate.is_none()));
        assert!(c.acceptance_length.is_none() && c.ece.is_none());
        // A round longer than asked widens the table.
        assert_eq!(calibration(&[round(&[0.5; 6], 0)], 4).unwrap().positions.len(), 6);
    }

    #[test]
    fn malformed_rounds_are_errors() {
        assert_eq!(
            calibration(&[round(&[0.5], 2)], 1).unwrap_err(),
            StatsError::AcceptedPastVerified { round: 0, accepted: 2, verified: 1 }
        );
        assert!(matches!(calibration(&[round(&[1.5], 0)], 1), Err(StatsError::Confidence { position: 0, .. })));
        assert!(calibration(&[round(&[0.5, f64::NAN], 0)], 2).is_err());
    }
}
