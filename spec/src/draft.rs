//! Drafts and the `Proposer` trait every draft source implements.
//!
//! Invariants:
//! - A draft knows its [`DraftSource`]: only a model draft is the runner drafter's pending proposal, which may
//!   be verified against the drafter's `q`; every other draft is verified one-hot.
//! - A [`Draft`] holds one confidence per token: `confidences[k]` is the *conditional* probability
//!   that token k survives verification given that tokens 0..k did (DSpark's `c_k`, dspark.md §2.1),
//!   in [0, 1]. The survival of the prefix through k is the product of the first k+1 confidences,
//!   so it never increases along the draft.
//! - A proposer never returns more tokens than the `max_len` it was asked for.
//! - Proposers see only tokens already committed to the sequence (the context); they never see the
//!   target's distribution, so drafting cannot bias the output.

use sparkd_kernels::runner::{Drafter, SamplingParams};
use sparkd_kernels::{StateId, TokenId};

use crate::error::{Result, SpecError};

/// The key under which a proposer keeps per-sequence memory. The daemon uses one key per agent
/// session (so a session's later turns reuse what its earlier turns indexed) or per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqKey(pub u64);

/// Where a draft came from, which decides how it is verified.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftSource {
    /// A model-free proposer (suffix tree, n-gram): verified one-hot.
    #[default]
    ModelFree,
    /// The runner's model drafter (DSpark): its pending proposal, verified against the drafter's `q` once
    /// selected.
    Model,
}

/// Draft tokens with per-token conditional confidences.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    tokens: Vec<TokenId>,
    confidences: Vec<f64>,
    source: DraftSource,
}

impl Draft {
    /// A model-free draft; `confidences` must match `tokens` in length and lie in [0, 1].
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
        Ok(Draft { tokens, confidences, source: DraftSource::ModelFree })
    }

    /// The same draft, marked as coming from `source`.
    pub fn with_source(self, source: DraftSource) -> Self {
        Draft { source, ..self }
    }

    pub fn source(&self) -> DraftSource {
        self.source
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

    /// The same tokens and source with prefix survivals `survival` (one per token, in [0, 1] and
    /// non-increasing; clamped where they are not): the conditional confidences become their ratios.
    pub(crate) fn with_survival(&self, survival: &[f64]) -> Draft {
        let mut previous = 1.0f64;
        let confidences = survival
            .iter()
            .map(|&a| {
                let c = if previous > 0.0 { (a / previous).clamp(0.0, 1.0) } else { 0.0 };
                previous = a.clamp(0.0, previous);
                c
            })
            .collect();
        Draft { tokens: self.tokens.clone(), confidences, source: self.source }
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.confidences.truncate(len);
    }
}

/// One sequence of a drafting round, as [`Proposer::prepare_round`] sees it.
#[derive(Clone, Copy, Debug)]
pub struct RoundRow<'a> {
    pub seq: SeqKey,
    /// The sequence's state in the runner (where a model drafter keeps its context).
    pub state: StateId,
    /// The committed context; its last token is the one the next step feeds (a model draft's anchor).
    pub context: &'a [TokenId],
    /// ℓ of the request: the most draft tokens it verifies per step.
    pub request_len: usize,
    /// The draft tokens this round may verify (ℓ within the tokens the request may still produce); 0: none.
    pub cap: usize,
    pub sampling: &'a SamplingParams,
}

/// A source of draft tokens for one sequence at a time.
///
/// The daemon calls, per sequence: `begin` when a request starts (its prompt is the whole context
/// so far, tool outputs included), `propose` before each verify step with the committed context,
/// and `end` when the request finishes. Before the `propose` calls of a round it calls
/// `prepare_round` once for all of the round's sequences: model drafts (DSpark) are drafted there, in
/// one batch on the runner's [`Drafter`] ([`crate::hybrid::ModelDrafts`]), and handed out by `propose`.
pub trait Proposer: Send {
    /// A short stable name ("suffix", "ngram", "dspark", "hybrid") for logs and metric labels.
    fn name(&self) -> &'static str;

    /// A request on `seq` starts with `prompt` as its context.
    fn begin(&mut self, seq: SeqKey, prompt: &[TokenId]);

    /// Drafts what the round's `propose` calls hand out, for every row at once (`drafter`: the runner's model
    /// drafter, if it has one). Model-free proposers have nothing to prepare.
    fn prepare_round(&mut self, _drafter: Option<&mut (dyn Drafter + '_)>, _rows: &[RoundRow<'_>]) -> Result<()> {
        Ok(())
    }

    /// Whether `propose` may draft from the committed context alone, without a prepared round (model-free
    /// drafts: suffix, n-gram, the hybrid's suffix side). A proposer that drafts only in its rounds says no, so a
    /// round the gate skips is known to draft nothing before the step's tokens are (asynchronous scheduling).
    fn drafts_from_context(&self) -> bool {
        true
    }

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
