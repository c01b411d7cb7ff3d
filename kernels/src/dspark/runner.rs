//! [`DrafterSlot`]: a drafter attached to a CPU runner, with every sequence's drafter context and
//! pending proposal.
//!
//! Invariants:
//! - Every live runner state has exactly one context here, created, forked and freed with it; its
//!   length equals the state's committed length after every step (the runner appends the taps of
//!   exactly the tokens it commits).
//! - A state has at most one pending proposal: the last `draft` for it, dropped by any step on the
//!   state. A step uses the proposal's `q` only when the proposal was selected, and then only after
//!   the row was checked to be `[anchor, prefix of the proposal]` at the proposal's position, with the
//!   sampling parameters the proposal was drafted with (so `q` is the distribution the drafts came from).
//! - Greedy proposals keep no `q`: greedy verification never reads it.

use std::collections::HashMap;

use crate::dspark::model::DrafterModel;
use crate::dspark::model::TargetHead;
use crate::dspark::state::DrafterState;
use crate::error::{KernelError, Result};
use crate::runner::{DraftProposal, DraftRequest, RowInput, SamplingParams, StateId, TokenId, TokenMask};

/// A proposal kept for verification; `Q` holds its draft distributions (host logits on the CPU, a
/// device buffer on CUDA).
#[derive(Debug)]
pub(crate) struct Pending<Q> {
    /// The anchor's position (the committed length when drafted).
    pub position: usize,
    pub anchor: TokenId,
    /// The parameters `q` was processed with; the verifying row must use the same.
    pub params: SamplingParams,
    pub tokens: Vec<TokenId>,
    pub q: Q,
    pub selected: bool,
}

impl<Q> Pending<Q> {
    /// Checks a step row against this proposal when it is selected (before any state changes): the row
    /// must sample, be `[anchor, prefix of the proposal]` at the proposal's position, with the
    /// parameters the proposal was drafted with.
    pub fn check_row(&self, row: &RowInput, state_len: usize) -> Result<()> {
        if !self.selected {
            return Ok(());
        }
        let bad = |why: &str| Err(KernelError::InvalidInput(format!("{}: selected proposal: {why}", row.state)));
        let Some(sample) = &row.sample else { return bad("the row must sample") };
        if row.tokens.len() != sample.draft_len + 1 || state_len != self.position {
            return bad("the row must be [anchor, drafts] at the position the proposal was drafted for");
        }
        let (a, b) = (&sample.params, &self.params);
        if (a.temperature, a.top_p, a.top_k, a.seed) != (b.temperature, b.top_p, b.top_k, b.seed) {
            return bad("the row's sampling parameters differ from those the proposal was drafted with");
        }
        if row.tokens[0] != self.anchor {
            return bad("the row's first token is not the proposal's anchor");
        }
        if sample.draft_len > self.tokens.len() || row.tokens[1..] != self.tokens[..sample.draft_len] {
            return bad("the row's drafts are not a prefix of the proposal");
        }
        Ok(())
    }
}

/// Every state's pending proposal (at most one each), kept the same way by the CPU and CUDA drafter slots.
#[derive(Debug)]
pub(crate) struct PendingProposals<Q>(HashMap<StateId, Pending<Q>>);

impl<Q> Default for PendingProposals<Q> {
    fn default() -> Self {
        PendingProposals(HashMap::new())
    }
}

impl<Q> PendingProposals<Q> {
    /// Keeps each row's new proposal, replacing an older one, and returns the proposals to hand out:
    /// `made` holds `(state, pending, confidences)` per row.
    pub fn keep(&mut self, made: impl IntoIterator<Item = (StateId, Pending<Q>, Vec<f32>)>) -> Vec<DraftProposal> {
        made.into_iter()
            .map(|(id, pending, confidences)| {
                let proposal = DraftProposal { tokens: pending.tokens.clone(), confidences };
                self.0.insert(id, pending);
                proposal
            })
            .collect()
    }

    /// Selects a state's pending proposal for its next step.
    pub fn select(&mut self, id: StateId) -> Result<()> {
        let p = self
            .0
            .get_mut(&id)
            .ok_or_else(|| KernelError::InvalidInput(format!("{id} has no pending proposal to select")))?;
        p.selected = true;
        Ok(())
    }

    /// Checks a step row against its state's selected proposal, if any (before any state changes).
    pub fn check_row(&self, row: &RowInput, state_len: usize) -> Result<()> {
        self.0.get(&row.state).map_or(Ok(()), |p| p.check_row(row, state_len))
    }

    /// Drops a state's pending proposal and returns it.
    pub fn take(&mut self, id: StateId) -> Option<Pending<Q>> {
        self.0.remove(&id)
    }
}

/// The drafter of a CPU runner and its per-sequence data.
pub struct DrafterSlot {
    model: DrafterModel<f32>,
    contexts: HashMap<StateId, DrafterState<f32>>,
    /// `q`: `[tokens.len(), vocab]` logits; empty for greedy drafts, whose verification never reads it.
    pending: PendingProposals<Vec<f32>>,
}

impl DrafterSlot {
    pub fn new(model: DrafterModel<f32>) -> Self {
        DrafterSlot { model, contexts: HashMap::new(), pending: PendingProposals::default() }
    }

    pub fn model(&self) -> &DrafterModel<f32> {
        &self.model
    }

    /// The target layers the forward must tap.
    pub fn tap_layers(&self) -> &[usize] {
        &self.model.config().target_layer_ids
    }

    /// A fresh context for a new state whose committed length is `len` (nonzero only for imports and
    /// states that existed before the drafter was attached: their earlier features are unavailable).
    pub fn add_state(&mut self, id: StateId, len: usize) {
        self.contexts.insert(id, self.model.new_state(len));
    }

    pub fn fork_state(&mut self, src: StateId, dst: StateId) -> Result<()> {
        let copy = self.context(src)?.clone();
        self.contexts.insert(dst, copy);
        Ok(())
    }

    pub fn remove_state(&mut self, id: StateId) {
        self.contexts.remove(&id);
        self.pending.take(id);
    }

    /// The drafter context of a state.
    pub fn context(&self, id: StateId) -> Result<&DrafterState<f32>> {
        self.contexts.get(&id).ok_or(KernelError::UnknownState(id.0))
    }

    /// Bytes of a state's drafter context.
    pub fn state_bytes(&self, id: StateId) -> usize {
        self.contexts.get(&id).map_or(0, DrafterState::bytes)
    }

    /// Drafts every row; `state_len` gives the target's committed length of a state (checked to
    /// equal the context's), `mask` the runner's emittable tokens. Nothing is kept unless every row
    /// succeeds.
    pub fn draft(
        &mut self,
        target: TargetHead<'_, f32>,
        state_len: impl Fn(StateId) -> Result<usize>,
        mask: Option<&TokenMask>,
        rows: &[DraftRequest],
    ) -> Result<Vec<DraftProposal>> {
        // (state, pending, confidences) per row.
        let mut made: Vec<(StateId, Pending<Vec<f32>>, Vec<f32>)> = Vec::with_capacity(rows.len());
        for row in rows {
            let len = state_len(row.state)?;
            let ctx = self.context(row.state)?;
            if ctx.len() != len {
                return Err(KernelError::InvalidInput(format!(
                    "drafter context of {} covers {} tokens, the state has {len}",
                    row.state,
                    ctx.len()
                )));
            }
            if made.iter().any(|(id, _, _)| *id == row.state) {
                return Err(KernelError::InvalidInput(format!("{} appears twice in one draft call", row.state)));
            }
            let block = self.model.draft(target, ctx, row.anchor, row.num_drafts, &row.params, mask)?;
            let logits = if row.params.is_greedy() { Vec::new() } else { block.logits };
            let pending = Pending {
                position: len,
                anchor: row.anchor,
                params: row.params.clone(),
                tokens: block.tokens,
                q: logits,
                selected: false,
            };
            made.push((row.state, pending, block.confidences));
        }
        Ok(self.pending.keep(made))
    }

    /// Selects a state's pending proposal for its next step.
    pub fn select(&mut self, id: StateId) -> Result<()> {
        self.context(id)?;
        self.pending.select(id)
    }

    /// Checks a step row against its state's selected proposal, if any (before any state changes).
    pub fn check_row(&self, row: &RowInput, state_len: usize) -> Result<()> {
        self.pending.check_row(row, state_len)
    }

    /// Drops a stepped state's pending proposal; returns its `q` logits `[draft_len, vocab]` when it
    /// was selected (the row was checked by [`Self::check_row`]).
    pub fn take_selected(&mut self, id: StateId, draft_len: usize) -> Option<Vec<f32>> {
        let p = self.pending.take(id).filter(|p| p.selected && !p.q.is_empty())?;
        let vocab = self.model.config().vocab_size;
        let mut logits = p.q;
        logits.truncate(draft_len * vocab);
        Some(logits)
    }

    /// Appends the context of a state's newly committed tokens: `taps[i]` `[n, d]`.
    pub fn commit(&mut self, id: StateId, taps: &[&[f32]]) -> Result<()> {
        let ctx = self.contexts.get_mut(&id).ok_or(KernelError::UnknownState(id.0))?;
        self.model.append_context(ctx, taps)
    }
}
