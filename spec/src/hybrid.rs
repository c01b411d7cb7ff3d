//! Model drafts through the `Proposer` interface, and the hybrid rule that picks the suffix draft or
//! the model draft per request (ArcticInference `model_runner.py`, dspark.md §5.3).
//!
//! Invariants:
//! - A model draft (DSpark) is made by the runner's [`Drafter`] for one round: [`ModelDrafts`] drafts every
//!   row of the round in one batch (`prepare_round`) and hands each draft out once, marked
//!   [`DraftSource::Model`], so a draft never outlives the round it was made for.
//! - The hybrid rule sees only the two drafts' own scores, never the target: the suffix draft is
//!   used when its score (expected accepted tokens) reaches the threshold and it is non-empty,
//!   otherwise the model draft. With [`HybridRule::ModelExpected`] the threshold is the model
//!   draft's expected accepted tokens `Σ_j a_j` over the whole block the drafter made (our mapping of
//!   Arctic's rule to DSpark, not in either project); with [`HybridRule::Fixed`] it is a constant (Arctic:
//!   the model's draft length `n_predict`; 0 = suffix whenever it has a draft). The chosen draft is then
//!   cut to the round's length.

use std::collections::HashMap;

use sparkd_kernels::runner::{DraftRequest, Drafter};
use sparkd_kernels::TokenId;

use crate::draft::{Draft, DraftSource, Proposer, RoundRow, SeqKey};
use crate::error::{Result, SpecError};
use crate::suffix::SuffixProposer;

/// Drafts made by a model drafter inside the runner, delivered per sequence for the round they were made for.
#[derive(Debug)]
pub struct ModelDrafts {
    name: &'static str,
    /// The longest block asked of the drafter (`None`: the request's ℓ).
    max_block: Option<usize>,
    pending: HashMap<SeqKey, Draft>,
}

impl ModelDrafts {
    /// Model drafts of ℓ tokens per request.
    pub fn new(name: &'static str) -> Self {
        ModelDrafts { name, max_block: None, pending: HashMap::new() }
    }

    /// Model drafts of at most `block` tokens (the hybrid's DSpark blocks of γ).
    pub fn with_max_block(self, block: usize) -> Self {
        ModelDrafts { max_block: Some(block), ..self }
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

    /// Drafts, in one call, a block after the anchor of every row that may verify drafts this round.
    fn prepare_round(&mut self, drafter: Option<&mut (dyn Drafter + '_)>, rows: &[RoundRow<'_>]) -> Result<()> {
        self.pending.clear();
        // (row, anchor) of every row that may verify drafts.
        let asked: Vec<(&RoundRow<'_>, TokenId)> =
            rows.iter().filter(|r| r.cap > 0).filter_map(|r| Some((r, *r.context.last()?))).collect();
        if asked.is_empty() {
            return Ok(());
        }
        let drafter = drafter
            .ok_or_else(|| SpecError::InvalidInput(format!("{} drafts need the runner's model drafter", self.name)))?;
        let requests: Vec<DraftRequest> = asked
            .iter()
            .map(|&(row, anchor)| DraftRequest {
                state: row.state,
                anchor,
                num_drafts: self.max_block.map_or(row.request_len, |block| row.request_len.min(block)),
                params: row.sampling.clone(),
            })
            .collect();
        let proposals = drafter.draft(&requests)?;
        for ((row, _), proposal) in asked.iter().zip(proposals) {
            let confidences = proposal.confidences.iter().map(|&c| f64::from(c)).collect();
            self.deliver(row.seq, Draft::new(proposal.tokens, confidences)?);
        }
        Ok(())
    }

    /// Model drafts come only from the round's drafter call.
    fn drafts_from_context(&self) -> bool {
        false
    }

    fn propose(&mut self, seq: SeqKey, _context: &[TokenId], max_len: usize) -> Draft {
        let mut draft = self.pending.remove(&seq).unwrap_or_default();
        draft.truncate(max_len);
        draft.with_source(DraftSource::Model)
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
    /// the same round.
    pub fn choose(self, suffix: Draft, suffix_score: f64, model: Draft) -> Draft {
        let threshold = match self {
            HybridRule::ModelExpected => model.expected_accepted(),
            HybridRule::Fixed(t) => t,
        };
        if !suffix.is_empty() && suffix_score >= threshold {
            suffix
        } else {
            model
        }
    }
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
}

impl Proposer for HybridProposer {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn begin(&mut self, seq: SeqKey, prompt: &[TokenId]) {
        self.suffix.begin(seq, prompt);
        self.model.begin(seq, prompt);
    }

    /// The model proposer's round (the suffix proposer needs none).
    fn prepare_round(&mut self, drafter: Option<&mut (dyn Drafter + '_)>, rows: &[RoundRow<'_>]) -> Result<()> {
        self.model.prepare_round(drafter, rows)
    }

    /// The suffix draft of up to `max_len` tokens against the model's whole draft for the round, the chosen
    /// one cut to `max_len`.
    fn propose(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> Draft {
        let (suffix, score) = self.suffix.propose_scored(seq, context, max_len);
        let model = self.model.propose(seq, context, usize::MAX);
        let mut draft = self.rule.choose(suffix, score, model);
        draft.truncate(max_len);
        draft
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
    use sparkd_kernels::runner::{DraftProposal, SamplingParams};
    use sparkd_kernels::StateId;

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
        let d = h.propose(SeqKey(1), &REPEAT, 4);
        assert_eq!(d.source(), DraftSource::ModelFree);
        assert_eq!(&d.tokens()[..2], &[3, 4]);
    }

    #[test]
    fn a_confident_model_draft_beats_a_weak_suffix_draft() {
        let strong = Draft::new(vec![7, 8, 9, 10], vec![0.95; 4]).unwrap();
        let mut h = hybrid(HybridRule::ModelExpected, Some(strong));
        let d = h.propose(SeqKey(1), &REPEAT, 4);
        assert_eq!(d.source(), DraftSource::Model);
        assert_eq!(d.tokens(), &[7, 8, 9, 10]);
    }

    #[test]
    fn a_fixed_threshold_of_zero_is_suffix_only_when_a_suffix_draft_exists() {
        let model = Draft::new(vec![7], vec![1.0]).unwrap();
        let mut h = hybrid(HybridRule::Fixed(0.0), Some(model.clone()));
        assert_eq!(h.propose(SeqKey(1), &REPEAT, 4).source(), DraftSource::ModelFree);
        let mut h = hybrid(HybridRule::Fixed(0.0), Some(model));
        let d = h.propose(SeqKey(1), &[5, 6, 7], 4);
        assert_eq!((d.tokens(), d.source()), (&[7][..], DraftSource::Model));
    }

    /// A drafter that drafts `anchor + 1, anchor + 2, ...` at confidence 0.5 and records what it was asked.
    #[derive(Default)]
    struct Recording {
        asked: Vec<DraftRequest>,
    }

    impl Drafter for Recording {
        fn block_size(&self) -> usize {
            4
        }

        fn draft(&mut self, rows: &[DraftRequest]) -> sparkd_kernels::Result<Vec<DraftProposal>> {
            self.asked.extend_from_slice(rows);
            Ok(rows
                .iter()
                .map(|r| DraftProposal {
                    tokens: (1..=r.num_drafts as TokenId).map(|k| r.anchor + k).collect(),
                    confidences: vec![0.5; r.num_drafts],
                })
                .collect())
        }

        fn select_proposal(&mut self, _state: StateId) -> sparkd_kernels::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn model_drafts_are_drafted_in_one_batch_per_round() {
        let greedy = SamplingParams::greedy();
        let row = |seq: u64, context, request_len, cap| RoundRow {
            seq: SeqKey(seq),
            state: StateId(seq),
            context,
            request_len,
            cap,
            sampling: &greedy,
        };
        let rows = [row(1, &[5, 6][..], 6, 6), row(2, &[9][..], 6, 0), row(3, &[4][..], 2, 1)];
        let mut drafter = Recording::default();
        let mut m = ModelDrafts::new("dspark").with_max_block(4);
        m.prepare_round(Some(&mut drafter), &rows).unwrap();
        // One call: the rows that may verify drafts, each a block of min(ℓ, 4) after its last token.
        let asked: Vec<(StateId, TokenId, usize)> =
            drafter.asked.iter().map(|r| (r.state, r.anchor, r.num_drafts)).collect();
        assert_eq!(asked, vec![(StateId(1), 6, 4), (StateId(3), 4, 2)]);
        let d = m.propose(SeqKey(1), &[5, 6], 6);
        assert_eq!((d.tokens(), d.source()), (&[7, 8, 9, 10][..], DraftSource::Model));
        assert!(m.propose(SeqKey(2), &[9], 0).is_empty());
        assert_eq!(m.propose(SeqKey(3), &[4], 1).tokens(), &[5]);
        // A new round drops what the last one left; without a drafter it fails unless no row may verify drafts.
        assert_eq!(m.prepare_round(None, &rows).unwrap_err().kind(), "invalid_input");
        m.prepare_round(None, &rows[1..2]).unwrap();
        assert!(m.propose(SeqKey(1), &[5, 6], 6).is_empty());
    }

    #[test]
    fn the_hybrid_weighs_the_models_whole_block_then_cuts_it_to_the_round() {
        // Over its whole block the model draft expects 0.4 + 0.16 + 0.064 + 0.026 = 0.65 accepted tokens, more
        // than the one-token suffix draft's score; its first token alone would expect only 0.4.
        let model = Draft::new(vec![7, 8, 9, 10], vec![0.4; 4]).unwrap();
        let mut h = hybrid(HybridRule::ModelExpected, Some(model));
        let d = h.propose(SeqKey(1), &REPEAT, 1);
        assert_eq!((d.tokens(), d.source()), (&[7][..], DraftSource::Model));
        let (suffix, score) =
            SuffixProposer::new(SuffixConfig::default()).unwrap().propose_scored(SeqKey(1), &REPEAT, 1);
        assert_eq!(suffix.tokens(), &[3]);
        assert!((0.4..0.65).contains(&score), "the suffix draft's score {score} must lie between the two");
    }
}
