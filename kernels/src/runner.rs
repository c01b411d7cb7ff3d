//! The `Runner` trait: one model on one device, stepping many sequences at once.
//!
//! Invariants of the contract (every backend keeps them, and one test suite checks them):
//! - A runner owns every per-sequence state it hands out; callers hold only [`StateId`]s.
//! - `step` appends each row's tokens to its state. A row without `sample` (a prefill chunk that
//!   is not the last) commits all of them and emits nothing. A row with `sample` produces
//!   distributions for its last `draft_len + 1` positions, applies the acceptance rule to the
//!   `draft_len` draft tokens, commits the tokens before the drafts plus the accepted drafts, and
//!   emits the accepted drafts followed by one sampled token (the correction, or the bonus when
//!   every draft was accepted). The emitted last token is not in the state: the next step feeds it.
//! - Randomness comes only from `SamplingParams::seed` and the position of the sampled token, so
//!   a seeded request gives the same tokens whatever else is batched with it.
//! - Full logits never leave the runner; only sampled tokens and requested log-probabilities do.
//! - A constrained row's masks ([`SampleRequest::masks`]) forbid ids at each of its sampling positions as the
//!   runner's [`TokenMask`] does (a forbidden draft is rejected, a forbidden id never sampled). They may also
//!   come from a [`MaskSource`] asked once the step's forward is launched ([`Runner::step_masked`],
//!   [`Runner::launch_masked`]), so that the host computes them while the device runs the forward.
//!
//! - Steps may also be launched ahead of their outputs ([`Runner::launch`], [`Runner::launch_fed`],
//!   [`Runner::collect`]: asynchronous scheduling); a runner that does says so in
//!   [`Runner::launches_ahead`], and keeps the invariants of [`crate::launches`].
//!
//! A model drafter (DSpark) is a capability beside the contract, not part of it: [`Runner::attach_drafter`]
//! takes a [`DrafterSource`] on every backend (those that cannot host one say so), and
//! [`Runner::model_drafter`] lends the attached one as a [`Drafter`], which reads the target's weights and
//! hidden-state taps in place.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::dspark::DrafterSource;
use crate::error::{KernelError, Result};
use crate::launches::FedRow;
use crate::state::SeqState;

/// A token id in the model's vocabulary.
pub type TokenId = u32;

/// A handle to one sequence's state inside a runner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StateId(pub u64);

impl std::fmt::Display for StateId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "state#{}", self.0)
    }
}

/// How to turn a distribution into a token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Seed of the request's random stream.
    pub seed: u64,
    /// Return this many top alternatives with each emitted token's log-probability (None: no logprobs).
    pub logprobs: Option<usize>,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, logprobs: None }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// What a row asks the runner to produce.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleRequest {
    pub params: SamplingParams,
    /// The last `draft_len` tokens of the row are draft proposals to verify.
    pub draft_len: usize,
    /// A constrained row's allowed ids at each position that samples (`draft_len + 1` masks: before the first
    /// draft, after each), each `ceil(vocab / 32)` words with bit `id % 32` of word `id / 32` set for an allowed
    /// id (a grammar's masks, `sparkd-grammar`). Masked ids get logit `-inf` before sampling and acceptance, as
    /// with the runner's [`TokenMask`]. Empty: unconstrained.
    pub masks: Vec<Arc<[u32]>>,
}

impl SampleRequest {
    /// An unconstrained request.
    pub fn new(params: SamplingParams, draft_len: usize) -> Self {
        SampleRequest { params, draft_len, masks: Vec::new() }
    }

    /// Checks the masks against a vocabulary of `vocab` ids: none, or one per sampling position, each of the
    /// right length and allowing at least one id.
    pub fn check_masks(&self, vocab: usize) -> Result<()> {
        check_row_masks(&self.masks, self.draft_len, vocab)
    }
}

/// Checks a row's `masks` ([`SampleRequest::masks`]' form) for `draft_len` drafts over `vocab` ids: none, or one
/// per sampling position, each of the right length and allowing at least one id.
pub fn check_row_masks(masks: &[Arc<[u32]>], draft_len: usize, vocab: usize) -> Result<()> {
    if masks.is_empty() {
        return Ok(());
    }
    if masks.len() != draft_len + 1 {
        return Err(KernelError::InvalidInput(format!(
            "{} token masks for a row sampling at {} positions",
            masks.len(),
            draft_len + 1
        )));
    }
    let words = vocab.div_ceil(32);
    for (i, m) in masks.iter().enumerate() {
        if m.len() != words || m.iter().all(|w| *w == 0) {
            return Err(KernelError::InvalidInput(format!(
                "token mask {i} has {} words and allows {} ids (a vocabulary of {vocab} needs {words} words and \
                 at least one id)",
                m.len(),
                m.iter().map(|w| w.count_ones()).sum::<u32>()
            )));
        }
    }
    Ok(())
}

/// Constrained rows' masks, asked for once a step's forward is launched, so that the host computes them while
/// the device runs it (follows vLLM v1's `EngineCore.step`: `execute_model`, then `get_grammar_bitmask` while
/// the forward runs, then `sample_tokens`).
pub trait MaskSource {
    /// The masks of the step's row `row` in [`SampleRequest::masks`]' form (`draft_len + 1` of them); empty for
    /// an unconstrained row. Asked at most once per sampling row, in row order.
    fn masks(&mut self, row: usize) -> Result<Vec<Arc<[u32]>>>;
}

/// `rows` with each sampling row's masks taken from `source` (the form every runner that gains nothing from
/// asking later uses).
pub fn with_masks(rows: &[RowInput], source: &mut dyn MaskSource) -> Result<Vec<RowInput>> {
    let mut rows = rows.to_vec();
    for (i, row) in rows.iter_mut().enumerate() {
        if let Some(sample) = row.sample.as_mut() {
            sample.masks = source.masks(i)?;
        }
    }
    Ok(rows)
}

/// Whether `mask` (a [`SampleRequest::masks`] entry) allows `id`.
pub fn mask_allows(mask: &[u32], id: TokenId) -> bool {
    mask.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// Sets the logits of the ids `mask` forbids to `-inf` (`logits` one position's `[vocab]`).
pub fn apply_row_mask(mask: &[u32], logits: &mut [f32]) {
    for (id, l) in logits.iter_mut().enumerate() {
        if !mask_allows(mask, id as TokenId) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq)]
pub struct RowInput {
    pub state: StateId,
    /// Tokens appended to the state this step: a prefill chunk, or `[last, draft_1..draft_l]`.
    pub tokens: Vec<TokenId>,
    /// `None` for a prefill chunk that produces no token.
    pub sample: Option<SampleRequest>,
}

impl RowInput {
    /// Where the row's forward window wants logits from and keeps snapshots from (token indices in the row): a
    /// sampling row's last `draft_len + 1` positions give logits and its drafts keep snapshots for the rollback;
    /// a prefill chunk wants neither.
    pub fn window_bounds(&self) -> (usize, Option<usize>) {
        let t = self.tokens.len();
        match &self.sample {
            Some(s) => (t - s.draft_len - 1, (s.draft_len > 0).then_some(t - s.draft_len)),
            None => (t, None),
        }
    }
}

/// A token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: TokenId,
    pub logprob: f32,
    /// `(token, logprob)` in descending probability, as many as asked.
    pub top: Vec<(TokenId, f32)>,
}

/// One row's result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowOutput {
    /// Accepted drafts, then one sampled token; empty for a row without `sample`.
    pub tokens: Vec<TokenId>,
    /// How many drafts were accepted (`tokens.len() - 1` when `tokens` is not empty).
    pub num_accepted: usize,
    /// One entry per emitted token when log-probabilities were asked for.
    pub logprobs: Vec<TokenLogprob>,
}

/// One row's request for a model draft (DSpark, dspark.md §1.2): the drafter drafts `num_drafts`
/// tokens after `anchor`, the last emitted token, which is not yet in the state (the next step feeds
/// it). `params` are the request's: greedy drafts for greedy requests, else samples from `q`.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftRequest {
    pub state: StateId,
    pub anchor: TokenId,
    /// The block length: the anchor plus `num_drafts - 1` mask tokens, one draft per position.
    pub num_drafts: usize,
    pub params: SamplingParams,
}

/// A model draft for one row: the tokens with their confidences `c_k` (the estimated probability
/// that draft k is accepted given drafts 1..k−1 were). The draft distributions stay in the runner.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftProposal {
    pub tokens: Vec<TokenId>,
    pub confidences: Vec<f32>,
}

/// The token ids a runner may emit (sampled, correction and bonus tokens). A tokenizer whose
/// vocabulary has holes (the built-in cl100k ranks leave K3 ids 100,256..163,583 without a token)
/// masks them, so that every emitted id decodes. Masked ids get logit `-inf` before sampling and
/// acceptance (so a masked draft is always rejected) and `-inf` log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenMask {
    /// Ascending ids that may not be emitted.
    disallowed: Vec<TokenId>,
    vocab: usize,
}

impl TokenMask {
    /// A mask over `vocab` ids allowing exactly those for which `allowed` is true.
    pub fn from_fn(vocab: usize, allowed: impl Fn(TokenId) -> bool) -> Self {
        let disallowed = (0..vocab as TokenId).filter(|id| !allowed(*id)).collect();
        TokenMask { disallowed, vocab }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn is_allowed(&self, id: TokenId) -> bool {
        (id as usize) < self.vocab && self.disallowed.binary_search(&id).is_err()
    }

    pub fn num_allowed(&self) -> usize {
        self.vocab - self.disallowed.len()
    }

    /// Checks that the mask covers a vocabulary of `vocab` ids and allows at least one (what every runner's
    /// `set_token_mask` requires).
    pub fn check_fits(&self, vocab: usize) -> Result<()> {
        if self.vocab != vocab || self.num_allowed() == 0 {
            return Err(KernelError::InvalidInput(format!(
                "a token mask over {} ids with {} allowed does not fit a vocabulary of {vocab}",
                self.vocab,
                self.num_allowed()
            )));
        }
        Ok(())
    }

    /// Sets the masked entries of each `[vocab]` row of `logits` to `-inf`.
    pub fn apply(&self, logits: &mut [f32]) {
        for row in logits.chunks_exact_mut(self.vocab) {
            for id in &self.disallowed {
                row[*id as usize] = f32::NEG_INFINITY;
            }
        }
    }
}

/// Checks a step's rows for what every backend rejects before touching any state: a state named twice,
/// an empty row, a token id outside `vocab`, unusable sampling parameters, or more drafts than the row
/// holds after its anchor. `known` says whether the runner has a state.
pub fn check_rows(rows: &[RowInput], vocab: usize, known: impl Fn(StateId) -> bool) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for row in rows {
        if !known(row.state) {
            return Err(KernelError::UnknownState(row.state.0));
        }
        if !seen.insert(row.state) {
            return Err(KernelError::InvalidInput(format!("{} appears twice in one step", row.state)));
        }
        if row.tokens.is_empty() {
            return Err(KernelError::InvalidInput(format!("{} has no tokens", row.state)));
        }
        if let Some(bad) = row.tokens.iter().find(|t| **t as usize >= vocab) {
            return Err(KernelError::InvalidInput(format!("token id {bad} outside the vocabulary of {vocab}")));
        }
        if let Some(s) = &row.sample {
            crate::sampling::check_params(&s.params)?;
            s.check_masks(vocab)?;
            if s.draft_len >= row.tokens.len() {
                return Err(KernelError::InvalidInput(format!(
                    "{} drafts need at least {} tokens, the row has {}",
                    s.draft_len,
                    s.draft_len + 1,
                    row.tokens.len()
                )));
            }
        }
    }
    Ok(())
}

/// The token offsets `[0, t_0, t_0 + t_1, ...]` of a forward's windows, each given as `(tokens, logits_from,
/// snapshots_from)`, after the checks both backends' forwards make: a window has tokens, all inside `vocab`,
/// and its logits and snapshot starts lie inside it.
pub(crate) fn window_offsets<'a>(
    windows: impl Iterator<Item = (&'a [TokenId], usize, Option<usize>)>,
    vocab: usize,
) -> Result<Vec<usize>> {
    let mut offsets = vec![0usize];
    for (tokens, logits_from, snapshots_from) in windows {
        if tokens.is_empty() {
            return Err(KernelError::InvalidInput("a row has no tokens".into()));
        }
        if logits_from > tokens.len() || snapshots_from.is_some_and(|s| s > tokens.len()) {
            return Err(KernelError::InvalidInput("logits/snapshot range outside the window".into()));
        }
        if let Some(bad) = tokens.iter().find(|t| **t as usize >= vocab) {
            return Err(KernelError::InvalidInput(format!("token id {bad} outside the vocabulary of {vocab}")));
        }
        offsets.push(offsets[offsets.len() - 1] + tokens.len());
    }
    Ok(offsets)
}

/// A model drafter attached to a runner (DSpark, dspark.md §1.2), lent by [`Runner::model_drafter`].
///
/// `draft` proposes tokens per row and keeps each row's proposal (with its `q`) as the state's pending
/// proposal; `select_proposal` declares that the state's next step verifies (a prefix of) that proposal, so
/// the step verifies it against `q` (lossless speculative sampling with draft distributions). A step on a
/// state drops its pending proposal whether it was selected or not; drafts that were not selected are
/// verified one-hot, which is lossless for drafts of any origin.
pub trait Drafter {
    /// The block size γ the drafter was built for.
    fn block_size(&self) -> usize;

    /// Drafts for each row (one output per row, in order) and keeps each as its state's pending
    /// proposal, replacing an older one.
    fn draft(&mut self, rows: &[DraftRequest]) -> Result<Vec<DraftProposal>>;

    /// Marks `state`'s pending proposal as the drafts of its next step: that step's row must be
    /// `[anchor, x_1..x_l]` with `x_1..x_l` a prefix of the proposal, with the sampling parameters the
    /// proposal was drafted with, and is verified with `q`.
    fn select_proposal(&mut self, state: StateId) -> Result<()>;
}

/// A model on a device that steps batches of sequences.
pub trait Runner: Send {
    fn config(&self) -> &ModelConfig;

    /// A short name of the backend and device ("cpu", "cuda:0 NVIDIA H200").
    fn device_name(&self) -> String;

    /// A fresh, empty sequence state.
    fn alloc_state(&mut self) -> Result<StateId>;

    /// A new state equal to `src` (a subagent fork); later steps on either leave the other unchanged.
    fn fork_state(&mut self, src: StateId) -> Result<StateId>;

    /// Releases a state and its memory.
    fn free_state(&mut self, id: StateId) -> Result<()>;

    /// Number of tokens committed to the state.
    fn state_len(&self, id: StateId) -> Result<usize>;

    /// Bytes the state holds on the device.
    fn state_bytes(&self, id: StateId) -> Result<usize>;

    /// A host copy of the state (for offload and for prefix-cache snapshots).
    fn export_state(&self, id: StateId) -> Result<SeqState>;

    /// Installs a host copy as a new state.
    fn import_state(&mut self, state: SeqState) -> Result<StateId>;

    /// Runs one step over the rows; returns one output per row, in order. No launched step may be
    /// waiting to be collected.
    fn step(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>>;

    /// [`Runner::step`] with the sampling rows' masks asked of `masks` (the rows carry none of their own). A
    /// runner that can asks once the forward is launched; an error from `masks` then fails the step after its
    /// forward ran, as a device error reported at the end of a step does.
    fn step_masked(&mut self, rows: &[RowInput], masks: &mut dyn MaskSource) -> Result<Vec<RowOutput>> {
        self.step(&with_masks(rows, masks)?)
    }

    /// Whether the runner launches steps ahead ([`Runner::launch`], [`Runner::launch_fed`],
    /// [`Runner::collect`]; the invariants are in [`crate::launches`]).
    fn launches_ahead(&self) -> bool {
        false
    }

    /// Starts a step over `rows` (what [`Runner::step`] computes) and returns without waiting for its
    /// outputs; [`Runner::collect`] returns them. None of its states may be in a step not yet collected.
    fn launch(&mut self, _rows: &[RowInput]) -> Result<()> {
        Err(KernelError::InvalidInput(format!("the {} runner does not launch steps ahead", self.device_name())))
    }

    /// [`Runner::launch`] with the sampling rows' masks asked of `masks`, as in [`Runner::step_masked`].
    fn launch_masked(&mut self, rows: &[RowInput], masks: &mut dyn MaskSource) -> Result<()> {
        self.launch(&with_masks(rows, masks)?)
    }

    /// Starts the next step of exactly the rows of the step launched last, each fed the one token that
    /// step emits for it, before the host has seen that token.
    fn launch_fed(&mut self, _rows: &[FedRow]) -> Result<()> {
        Err(KernelError::InvalidInput(format!("the {} runner does not launch steps ahead", self.device_name())))
    }

    /// The outputs of the oldest launched step not yet collected (one per row, in order), waiting for them.
    fn collect(&mut self) -> Result<Vec<RowOutput>> {
        Err(KernelError::InvalidInput(format!("the {} runner does not launch steps ahead", self.device_name())))
    }

    /// Restricts the tokens the runner emits from now on (see [`TokenMask`]).
    fn set_token_mask(&mut self, _mask: TokenMask) -> Result<()> {
        Err(KernelError::InvalidInput(format!("the {} runner cannot restrict the tokens it emits", self.device_name())))
    }

    /// Loads the drafter of `source` (its config checked against this model) and attaches it in place of any
    /// earlier one; states that already exist get an empty drafter context starting at their current length.
    /// One signature on every backend; a runner that cannot host a drafter says so.
    fn attach_drafter(&mut self, _source: DrafterSource) -> Result<()> {
        Err(KernelError::InvalidInput(format!("the {} runner cannot host a drafter", self.device_name())))
    }

    /// The attached drafter; `None` without one.
    fn model_drafter(&mut self) -> Option<Box<dyn Drafter + '_>> {
        None
    }
}
