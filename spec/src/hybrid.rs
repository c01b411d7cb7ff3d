//! Model drafts through the `Proposer` interface, and the hybrid rule that picks the suffix draft or
//! the model draft per request (ArcticInference `model_runner.py`, dspark.md §5.3).
//!
//! Invariants:
//! - A model draft (DSpark) is produced by the runner's drafter for one round; [`ModelDrafts`] hands
//!   each one out once, so a draft never outlives the context it was made for.
//! - The hybrid rule sees only the two drafts' own scores, never the target: the suffix draft is
//!   used when its score (expected accepted tokens) reaches the threshold and it is non-empty,
//!   otherwise the model draft. With [`HybridRule::ModelExpected`] the threshold is the model
//!   draft's expected accepted tokens `Σ_j a_j` (our mapping of Arctic's rule to DSpark, not in
//!   either project); with [`HybridRule::Fixed`] it is a constant (Arctic: the model's draft length
//!   `n_predict`; 0 = suffix whenever it has a draft).

use std::collections::HashMap;

use sparkd_kernels::TokenId;

use crate::draft::{Draft, Proposer, SeqKey};
use crate::suffix::SuffixProposer;

/// Drafts made by a model drafter inside the runner, delivered per sequence for the next round.
#[derive(Debug)]
pub struct ModelDrafts {
    name: &'static str,
    pending: HashMap<SeqKey, Draft>,
}

impl ModelDrafts {
    pub fn new(name: &'static str) -> Self {
        ModelDrafts { name, pending: HashMap::new() }
    }

    /// Stores the drafter's output for `seq` (tokens with confidences `c_k`) for its next round.
    pub fn deliver(&mut self, seq: SeqKey, draft: Draft) {
        self.pending.insert(seq, draft);
    }
}

impl Proposer for ModelDrafts {
    fn name(&self) -> &'static str {
        self.name
    }

    fn begin(&mut self, seq: SeqKey, _prompt: &[TokenId]) {
        self.pending.remove(&seq);
    }

    fn propose(&mut self, seq: SeqKey, _context: &[TokenId], max_len: usize) -> Draft {
        let mut draft = self.pending.remove(&seq).unwrap_or_default();
        draft.truncate(max_len);
        draft
    }

    fn end(&mut self, seq: SeqKey, _context: &[TokenId], _keep: bool) {
        self.pending.remove(&seq);
    }
}

/// When the suffix draft replaces the model draft.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HybridRule {
    /// Suffix when its score >= the model draft's expected accepted tokens.
    ModelExpected,
    /// Suffix when its score >= this constant.
    Fixed(f64),
}

impl HybridRule {
    /// The hybrid choice between a suffix draft of score `suffix_score` and a model draft made for
    /// the same round (the engine drafts with the runner itself, then asks this).
    pub fn choose(self, suffix: Draft, suffix_score: f64, model: Draft) -> (Draft, DraftSource) {
        let threshold = match self {
            HybridRule::ModelExpected => model.expected_accepted(),
            HybridRule::Fixed(t) => t,
        };
        if !suffix.is_empty() && suffix_score >= threshold {
            (suffix, DraftSource::Suffix)
        } else {
            (model, DraftSource::Model)
        }
    }
}

/// Which source a hybrid draft came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSource {
    Suffix,
    Model,
}

/// Suffix drafts for repetitive (agentic) text, model drafts otherwise.
pub struct HybridProposer {
    suffix: SuffixProposer,
    model: Box<dyn Proposer>,
    rule: HybridRule,
}

impl HybridProposer {
    pub fn new(suffix: SuffixProposer, model: Box<dyn Proposer>, rule: HybridRule) -> Self {
        HybridProposer { suffix, model, rule }
    }

    /// The chosen draft and where it came from.
    pub fn propose_with_source(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> (Draft, DraftSource) {
        let (suffix, score) = self.suffix.propose_scored(seq, context, max_len);
        let model = self.model.propose(seq, context, max_len);
        self.rule.choose(suffix, score, model)
    }
}

impl Proposer for HybridProposer {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn begin(&mut self, seq: SeqKey, prompt: &[TokenId]) {
        self.suffix.begin(seq, prompt);
        self.model.begin(seq, prompt);
    }

    fn propose(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> Draft {
        self.propose_with_source(seq, context, max_len).0
    }

    fn end(&mut self, seq: SeqKey, context: &[TokenId], keep: bool) {
        self.suffix.end(seq, context, keep);
        self.model.end(seq, context, keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suffix::SuffixConfig;

    fn hybrid(rule: HybridRule, model_draft: Option<Draft>) -> HybridProposer {
        let mut model = ModelDrafts::new("dspark");
        if let Some(d) = model_draft {
            model.deliver(SeqKey(1), d);
        }
        HybridProposer::new(SuffixProposer::new(SuffixConfig::default()).unwrap(), Box::new(model), rule)
    }

    /// A context whose tail [1, 2] was once followed by [3, 4]: a suffix draft [3, 4] of score 1.0.
    const REPEAT: [TokenId; 9] = [1, 2, 3, 4, 5, 6, 9, 1, 2];

    #[test]
    fn model_drafts_are_handed_out_once_and_truncated() {
        let mut m = ModelDrafts::new("dspark");
        m.deliver(SeqKey(4), Draft::new(vec![1, 2, 3], vec![0.9, 0.9, 0.9]).unwrap());
        assert_eq!(m.propose(SeqKey(4), &[], 2).tokens(), &[1, 2]);
        assert!(m.propose(SeqKey(4), &[], 2).is_empty());
    }

    #[test]
    fn a_confident_suffix_draft_beats_a_weak_model_draft() {
        let weak = Draft::new(vec![7, 7], vec![0.3, 0.3]).unwrap();
        let mut h = hybrid(HybridRule::ModelExpected, Some(weak));
        let (d, source) = h.propose_with_source(SeqKey(1), &REPEAT, 4);
        assert_eq!(source, DraftSource::Suffix);
        assert_eq!(&d.tokens()[..2], &[3, 4]);
    }

    #[test]
    fn a_confident_model_draft_beats_a_weak_suffix_draft() {
        let strong = Draft::new(vec![7, 8, 9, 10], vec![0.95; 4]).unwrap();
        let mut h = hybrid(HybridRule::ModelExpected, Some(strong));
        let (d, source) = h.propose_with_source(SeqKey(1), &REPEAT, 4);
        assert_eq!(source, DraftSource::Model);
        assert_eq!(d.tokens(), &[7, 8, 9, 10]);
    }

    #[test]
    fn a_fixed_threshold_of_zero_is_suffix_only_when_a_suffix_draft_exists() {
        let model = Draft::new(vec![7], vec![1.0]).unwrap();
        let mut h = hybrid(HybridRule::Fixed(0.0), Some(model.clone()));
        assert_eq!(h.propose_with_source(SeqKey(1), &REPEAT, 4).1, DraftSource::Suffix);
        let mut h = hybrid(HybridRule::Fixed(0.0), Some(model));
        let (d, source) = h.propose_with_source(SeqKey(1), &[5, 6, 7], 4);
        assert_eq!((d.tokens(), source), (&[7][..], DraftSource::Model));
    }
}
