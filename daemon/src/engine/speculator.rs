//! The engine's speculator: before each step it drafts for every decode row, decides how many of the
//! drafts to verify, and hands them to the scheduler; after each step it records what was accepted.
//!
//! Follows dspark.md §4.2 (vLLM's proposer/speculator split) and §7 (the daemon's wiring):
//! 1. Draft: model-free proposers (`sparkd_spec::suffix`, `ngram`) read the row's committed context
//!    (prompt, tool outputs, output); DSpark asks the runner's drafter for a block after the row's
//!    last token; the hybrid keeps the suffix draft when its score reaches the DSpark draft's
//!    expected accepted tokens (`HybridRule::ModelExpected`).
//! 2. Budget: every row's cap is `request_cap` (ℓ of the request, and accepted drafts plus the bonus
//!    must fit in `max_tokens`); the policy (`BudgetPolicy`) trims each draft to a prefix.
//! 3. Select: a DSpark draft that will be verified is selected on the runner, so it is verified
//!    against its own `q` (lossless speculative sampling); every other draft is verified one-hot.
//!
//! Invariants:
//! - Drafts depend only on committed tokens and the drafter's own state; budgets are
//!   non-anticipating (`sparkd_spec::budget`), so greedy output is token-identical to decoding
//!   without speculation and sampled output keeps the target's distribution.
//! - Under forced acceptance every round verifies its whole cap: drafts of model-free proposers
//!   that stop short are padded with the row's last token (as the kernels' decode benchmark does),
//!   so every round is a full `ℓ` window and the forced schedule yields the asked mean length.
//! - Per-request memory lives under `SeqKey(request id)` and is released by [`Speculator::end`]
//!   exactly once per request that began.

use std::collections::HashMap;

use metrics::{counter, gauge};
use sparkd_kernels::runner::{DraftRequest, SamplingParams};
use sparkd_kernels::{KernelError, Runner, StateId, TokenId};
use sparkd_spec::budget::request_cap;
use sparkd_spec::hybrid::{DraftSource, HybridRule};
use sparkd_spec::ngram::{NgramConfig, NgramProposer};
use sparkd_spec::suffix::{SuffixConfig, SuffixProposer};
use sparkd_spec::{BudgetPolicy, BudgetRow, Draft, ProductionBudget, Proposer, SeqKey, SpecCounters, SpsProfile};

use super::spec::{measure_sps, SpecBudget, SpecConfig, SpecMethod};
use super::types::{EngineError, RequestId};
use crate::metrics as names;

/// One decode row that may carry drafts at the next step.
#[derive(Clone, Copy, Debug)]
pub struct DraftSlot<'a> {
    pub id: RequestId,
    pub state: StateId,
    /// Prompt plus output so far; its last token is the one the next step feeds.
    pub context: &'a [TokenId],
    /// Output tokens the request may still produce (`max_tokens − output so far`).
    pub new_tokens_left: usize,
    pub sampling: &'a SamplingParams,
}

/// The draft sources of each method.
enum Proposers {
    Suffix(SuffixProposer),
    Ngram(NgramProposer),
    Dspark,
    Hybrid(SuffixProposer),
}

/// Drafts, budgets and speculation statistics for the engine thread.
pub struct Speculator {
    cfg: SpecConfig,
    proposers: Proposers,
    budget: BudgetPolicy,
    /// The DSpark drafter's block size γ, when the method uses it.
    block: usize,
    /// ℓ of each request that began (the per-request override applied).
    lengths: HashMap<RequestId, usize>,
    totals: SpecCounters,
}

impl Speculator {
    /// Builds the speculator for `cfg` (which must be on), checking the runner has the drafter the
    /// method needs and measuring SPS(B) on it when a load-aware budget has no loaded profile.
    pub fn new(cfg: SpecConfig, runner: &mut dyn Runner, max_batch_tokens: usize) -> Result<Self, EngineError> {
        let invalid = |why: String| EngineError::InvalidRequest(format!("speculation: {why}"));
        let block = match (cfg.method.needs_drafter(), runner.drafter_block_size()) {
            (true, None) => {
                return Err(invalid(format!("--spec {} needs a runner with a DSpark drafter", cfg.method.as_str())))
            }
            (true, Some(gamma)) => gamma,
            (false, _) => 0,
        };
        let suffix = || SuffixProposer::new(SuffixConfig::default()).map_err(|e| invalid(e.to_string()));
        let proposers = match cfg.method {
            SpecMethod::Off => return Err(invalid("the speculator needs a method other than off".into())),
            SpecMethod::Suffix => Proposers::Suffix(suffix()?),
            SpecMethod::Hybrid => Proposers::Hybrid(suffix()?),
            SpecMethod::Ngram => {
                Proposers::Ngram(NgramProposer::new(NgramConfig::default()).map_err(|e| invalid(e.to_string()))?)
            }
            SpecMethod::Dspark => Proposers::Dspark,
        };
        let profile = |runner: &mut dyn Runner| -> Result<SpsProfile, EngineError> {
            match &cfg.sps_profile {
                Some(p) => Ok(p.clone()),
                None => {
                    let p = measure_sps(runner, max_batch_tokens)?;
                    tracing::info!(profile = %p.to_json(), "measured SPS(B) for the verify budget");
                    Ok(p)
                }
            }
        };
        let budget = match cfg.budget {
            SpecBudget::Static if cfg.threshold > 0.0 => BudgetPolicy::StaticThreshold(cfg.threshold),
            SpecBudget::Static => BudgetPolicy::Full,
            SpecBudget::Dspark => BudgetPolicy::Dspark(profile(runner)?),
            SpecBudget::Production => BudgetPolicy::Production(ProductionBudget::new(profile(runner)?, 0.0)),
        };
        for position in 0..cfg.num_spec_tokens {
            counter!(names::SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL, "position" => position.to_string())
                .increment(0);
        }
        let forced = cfg.synthetic.as_ref().map_or(0.0, |s| s.mean_acceptance_length());
        gauge!(names::SPEC_DECODE_FORCED_ACCEPTANCE_LENGTH).set(forced);
        Ok(Speculator { cfg, proposers, budget, block, lengths: HashMap::new(), totals: SpecCounters::default() })
    }

    /// Whether acceptance is forced (every round this speculator drafts is flagged synthetic).
    pub fn is_synthetic(&self) -> bool {
        self.cfg.synthetic.is_some()
    }

    /// A request starts with `prompt` (its whole context: kept history, tool outputs, new input) and
    /// asked for at most `requested` draft tokens per step.
    pub fn begin(&mut self, id: RequestId, prompt: &[TokenId], requested: Option<usize>) {
        self.lengths.insert(id, self.cfg.request_len(requested));
        let key = SeqKey(id.0);
        match &mut self.proposers {
            Proposers::Suffix(p) | Proposers::Hybrid(p) => p.begin(key, prompt),
            Proposers::Ngram(p) => p.begin(key, prompt),
            Proposers::Dspark => {}
        }
    }

    /// The request finished (or was cancelled or failed) with `tokens` as its history; its output
    /// joins the suffix proposer's global tree.
    pub fn end(&mut self, id: RequestId, tokens: &[TokenId]) {
        if self.lengths.remove(&id).is_none() {
            return;
        }
        let key = SeqKey(id.0);
        match &mut self.proposers {
            Proposers::Suffix(p) | Proposers::Hybrid(p) => p.end(key, tokens, false),
            Proposers::Ngram(p) => p.end(key, tokens, false),
            Proposers::Dspark => {}
        }
    }

    /// Drafts for `slots` and returns, per slot, the draft tokens to verify at the next step.
    /// A drafter failure is returned as is (the engine fails the slots' requests).
    pub fn propose(
        &mut self,
        runner: &mut dyn Runner,
        slots: &[DraftSlot<'_>],
    ) -> Result<Vec<Vec<TokenId>>, KernelError> {
        let lengths: Vec<usize> = slots.iter().map(|s| self.lengths.get(&s.id).copied().unwrap_or(0)).collect();
        let caps: Vec<usize> =
            slots.iter().zip(&lengths).map(|(s, &l)| request_cap(l, s.new_tokens_left, usize::MAX)).collect();
        let model = self.model_drafts(runner, slots, &lengths, &caps)?;
        let mut drafts = Vec::with_capacity(slots.len());
        for ((slot, &cap), model) in slots.iter().zip(&caps).zip(model) {
            let key = SeqKey(slot.id.0);
            // (draft, whether it is the runner's DSpark proposal)
            let (mut draft, from_model) = match &mut self.proposers {
                Proposers::Suffix(p) => (p.propose(key, slot.context, cap), false),
                Proposers::Ngram(p) => (p.propose(key, slot.context, cap), false),
                Proposers::Dspark => (model, true),
                Proposers::Hybrid(p) => {
                    let (suffix, score) = p.propose_scored(key, slot.context, cap);
                    let (draft, source) = HybridRule::ModelExpected.choose(suffix, score, model);
                    (draft, source == DraftSource::Model)
                }
            };
            draft.truncate(cap);
            drafts.push((draft, from_model));
        }
        let verified: Vec<usize> = if self.is_synthetic() {
            caps.clone()
        } else {
            let rows: Vec<BudgetRow<'_>> =
                drafts.iter().zip(&caps).map(|((draft, _), &cap)| BudgetRow { draft, cap }).collect();
            self.budget.plan(&rows)
        };
        let mut out = Vec::with_capacity(slots.len());
        for ((slot, (draft, from_model)), &len) in slots.iter().zip(drafts).zip(&verified) {
            let mut tokens = draft.tokens().to_vec();
            if from_model {
                tokens.truncate(len);
                if !tokens.is_empty() {
                    runner.select_proposal(slot.state)?;
                }
            } else if self.is_synthetic() {
                let pad = slot.context.last().copied().unwrap_or_default();
                tokens.resize(len, pad);
            } else {
                tokens.truncate(len);
            }
            out.push(tokens);
        }
        Ok(out)
    }

    /// The runner's DSpark drafts per slot (empty drafts when the method has no model drafter or the
    /// slot may verify nothing).
    fn model_drafts(
        &self,
        runner: &mut dyn Runner,
        slots: &[DraftSlot<'_>],
        lengths: &[usize],
        caps: &[usize],
    ) -> Result<Vec<Draft>, KernelError> {
        let mut drafts = vec![Draft::empty(); slots.len()];
        if !self.cfg.method.needs_drafter() {
            return Ok(drafts);
        }
        // DSpark drafts its request's ℓ; the hybrid's model drafts are DSpark blocks of γ.
        let num_drafts = |l: usize| if self.cfg.method == SpecMethod::Hybrid { l.min(self.block) } else { l };
        let asked: Vec<usize> = (0..slots.len()).filter(|&i| caps[i] > 0).collect();
        let requests: Vec<DraftRequest> = asked
            .iter()
            .filter_map(|&i| {
                let anchor = *slots[i].context.last()?;
                let num_drafts = num_drafts(lengths[i]);
                Some(DraftRequest { state: slots[i].state, anchor, num_drafts, params: slots[i].sampling.clone() })
            })
            .collect();
        if requests.is_empty() {
            return Ok(drafts);
        }
        let proposals = runner.draft(&requests)?;
        for (&i, proposal) in asked.iter().zip(proposals) {
            let confidences = proposal.confidences.iter().map(|&c| f64::from(c)).collect();
            drafts[i] =
                Draft::new(proposal.tokens, confidences).map_err(|e| KernelError::InvalidInput(e.to_string()))?;
        }
        Ok(drafts)
    }

    /// Records one verify round of `drafted` draft tokens of which `accepted` were accepted (rounds
    /// without drafts are not drafts, vLLM's definition).
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 || self.totals.record(drafted, accepted, self.is_synthetic()).is_err() {
            return;
        }
        counter!(names::SPEC_DECODE_NUM_DRAFTS_TOTAL).increment(1);
        counter!(names::SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL).increment(drafted as u64);
        counter!(names::SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL).increment(accepted as u64);
        for position in 0..accepted {
            counter!(names::SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL, "position" => position.to_string())
                .increment(1);
        }
        if self.is_synthetic() {
            counter!(names::SPEC_DECODE_NUM_SYNTHETIC_DRAFTS_TOTAL).increment(1);
        }
        if let Some(al) = self.totals.mean_acceptance_length() {
            gauge!(names::SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH).set(al);
        }
    }
}
