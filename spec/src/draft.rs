//! Drafts and the `Proposer` trait every draft source implements.
//!
//! Invariants:
//! - A [`Draft`] holds one confidence per token: `confidences[k]` is the *conditional* probability
//!   that token k survives verification given that tokens 0..k did (DSpark's `c_k`, dspark.md §2.1),
//!   in [0, 1]. The survival of the prefix through k is the product of the first k+1 confidences,
//!   so it never increases along the draft.
//! - A proposer never returns more tokens than the `max_len` it was asked for.
//! - Proposers see only tokens already committed to the sequence (the context); they never see the
//!   target's distribution, so drafting cannot bias the output.

use sparkd_kernels::TokenId;

use crate::error::{Result, SpecError};

/// The key under which a proposer keeps per-sequence memory. The daemon uses one key per agent
/// session (so a session's later turns reuse what its earlier turns indexed) or per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqKey(pub u64);

/// Draft tokens with per-token conditional confidences.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    tokens: Vec<TokenId>,
    confidences: Vec<f64>,
}

impl Draft {
    /// A draft; `confidences` must match `tokens` in length and lie in [0, 1].
    pub fn new(tokens: Vec<TokenId>, confidences: Vec<f64>) -> Result<Self> {
        if tokens.len() != confidences.len() {
            return Err(SpecError::InvalidInput(format!(
                "draft has {} tokens but {} confidences",
                tokens.len(),
                confidences.len()
            )));
        }
        if let Some(k) = confidences.iter().position(|c| !(0.0..=1.0).contains(c)) {
            return Err(SpecError::InvalidInput(format!("draft confidence {k} is {}, not in [0, 1]", confidences[k])));
        }
        Ok(Draft { tokens, confidences })
    }

    /// A draft from unconditional path probabilities (suffix-tree style: `path[k]` = P(tokens 0..=k
    /// all right)), which must be non-increasing; the conditional confidences are their ratios.
    pub fn from_path_probabilities(tokens: Vec<TokenId>, path: &[f64]) -> Result<Self> {
        let mut previous = 1.0;
        let mut confidences = Vec::with_capacity(path.len());
        for &p in path {
            confidences.push(if previous > 0.0 { (p / previous).clamp(0.0, 1.0) } else { 0.0 });
            previous = p;
        }
        Draft::new(tokens, confidences)
    }

    pub fn empty() -> Self {
        Draft::default()
    }

    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }

    pub fn confidences(&self) -> &[f64] {
        &self.confidences
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Prefix survival probabilities `a_j = Π_{i<=j} c_i` (non-increasing).
    pub fn survival(&self) -> Vec<f64> {
        let mut a = 1.0;
        self.confidences.iter().map(|c| (a *= c, a).1).collect()
    }

    /// Expected accepted draft tokens if the whole draft is verified: `Σ_j a_j`.
    pub fn expected_accepted(&self) -> f64 {
        self.survival().iter().sum()
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.confidences.truncate(len);
    }
}

/// A source of draft tokens for one sequence at a time.
///
/// The daemon calls, per sequence: `begin` when a request starts (its prompt is the whole context
/// so far, tool outputs included), `propose` before each verify step with the committed context,
/// and `end` when the request finishes. Model drafts (DSpark) come out of the runner's drafter;
/// [`crate::hybrid::ModelDrafts`] carries them through this same interface.
pub trait Proposer: Send {
    /// A short stable name ("suffix", "ngram", "dspark", "hybrid") for logs and metric labels.
    fn name(&self) -> &'static str;

    /// A request on `seq` starts with `prompt` as its context.
    fn begin(&mut self, seq: SeqKey, prompt: &[TokenId]);

    /// Up to `max_len` draft tokens to follow `context` (prompt plus committed output).
    fn propose(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> Draft;

    /// The request on `seq` finished with `context` as its final committed tokens. `keep` says the
    /// sequence continues later (a kept session turn), so per-sequence memory may stay.
    fn end(&mut self, seq: SeqKey, context: &[TokenId], keep: bool);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survival_is_the_running_product() {
        let d = Draft::new(vec![1, 2, 3], vec![0.9, 0.5, 1.0]).unwrap();
        let a = d.survival();
        assert!((a[0] - 0.9).abs() < 1e-12 && (a[1] - 0.45).abs() < 1e-12 && (a[2] - 0.45).abs() < 1e-12);
        assert!((d.expected_accepted() - 1.8).abs() < 1e-12);
    }

    #[test]
    fn path_probabilities_become_conditional_confidences() {
        let d = Draft::from_path_probabilities(vec![4, 5, 6], &[0.8, 0.4, 0.0]).unwrap();
        assert_eq!(d.confidences(), &[0.8, 0.5, 0.0]);
        let back = d.survival();
        assert!((back[1] - 0.4).abs() < 1e-12);
    }

    #[test]
    fn malformed_drafts_are_errors() {
        assert_eq!(Draft::new(vec![1], vec![]).unwrap_err().kind(), "invalid_input");
        assert!(Draft::new(vec![1], vec![1.5]).is_err());
        assert!(Draft::new(vec![1], vec![f64::NAN]).is_err());
    }
}
