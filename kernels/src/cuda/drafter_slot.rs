//! [`DeviceDrafterSlot`]: a DSpark drafter attached to the CUDA runner, with every sequence's device
//! context and pending proposal; the CUDA counterpart of `dspark::DrafterSlot`, with the same rules.
//!
//! Invariants:
//! - Every live runner state has exactly one context here, created, forked and freed with it; its
//!   length equals the state's committed length after every step (the runner appends the taps of
//!   exactly the tokens it commits, so a rejected draft never enters a context).
//! - An imported state (and one that existed before the drafter was attached) gets an empty context
//!   starting at its length, as on the CPU: `export_state` carries no drafter context, so drafts after
//!   an import attend over the tokens committed since (still verified losslessly).
//! - A state has at most one pending proposal: the last `draft` for it, dropped by any step on the
//!   state. Its `q` (the processed draft distributions `[num_drafts, V]` f32, as
//!   `SampleKernels::probs_from_logits` writes them) stays on the device for `SampleKernels::verify_rows`;
//!   greedy proposals keep none, since greedy verification never reads it. A selected proposal's row
//!   is checked by `dspark::runner::Pending::check_row` before any state changes.

use std::collections::HashMap;

use cudarc::driver::CudaSlice;
use half::bf16;

use crate::cuda::drafter::{BlockRow, DeviceDrafter, DrafterContext};
use crate::cuda::forward::DeviceModel;
use crate::cuda::gpu::Gpu;
use crate::cuda::sample::DeviceTokenMask;
use crate::dspark::runner::{Pending, PendingProposals};
use crate::error::{KernelError, Result};
use crate::runner::{DraftProposal, DraftRequest, RowInput, StateId};

/// The drafter of a CUDA runner and its per-sequence data.
pub struct DeviceDrafterSlot {
    model: DeviceDrafter,
    contexts: HashMap<StateId, DrafterContext>,
    /// `q`: `Some([tokens.len(), V])` for sampled proposals.
    pending: PendingProposals<Option<CudaSlice<f32>>>,
}

impl DeviceDrafterSlot {
    pub fn new(model: DeviceDrafter) -> Self {
        DeviceDrafterSlot { model, contexts: HashMap::new(), pending: PendingProposals::default() }
    }

    pub fn model(&self) -> &DeviceDrafter {
        &self.model
    }

    /// The target layers the forward must tap.
    pub fn tap_layers(&self) -> &[usize] {
        &self.model.config().target_layer_ids
    }

    /// A fresh context for a new state whose committed length is `len` (see the module invariants).
    pub fn add_state(&mut self, gpu: &Gpu, id: StateId, len: usize) -> Result<()> {
        let context = DrafterContext::new(gpu, self.model.config(), len)?;
        self.contexts.insert(id, context);
        Ok(())
    }

    pub fn fork_state(&mut self, gpu: &Gpu, src: StateId, dst: StateId) -> Result<()> {
        let copy = self.context(src)?.duplicate(gpu, self.model.config())?;
        self.contexts.insert(dst, copy);
        Ok(())
    }

    pub fn remove_state(&mut self, id: StateId) {
        self.contexts.remove(&id);
        self.pending.take(id);
    }

    /// The device context of a state.
    pub fn context(&self, id: StateId) -> Result<&DrafterContext> {
        self.contexts.get(&id).ok_or(KernelError::UnknownState(id.0))
    }

    /// Bytes of a state's drafter context.
    pub fn state_bytes(&self, id: StateId) -> usize {
        self.contexts.get(&id).map_or(0, |c| c.bytes(self.model.config()))
    }

    /// Drafts every row in one batched block forward; `state_len` gives the target's committed length
    /// of a state (checked to equal the context's). Nothing is kept unless every row succeeds.
    pub fn draft(
        &mut self,
        gpu: &Gpu,
        target: &DeviceModel,
        mask: Option<&DeviceTokenMask>,
        state_len: impl Fn(StateId) -> Result<usize>,
        rows: &[DraftRequest],
    ) -> Result<Vec<DraftProposal>> {
        for (i, row) in rows.iter().enumerate() {
            let len = state_len(row.state)?;
            let ctx = self.context(row.state)?;
            if ctx.len() != len {
                return Err(KernelError::InvalidInput(format!(
                    "drafter context of {} covers {} tokens, the state has {len}",
                    row.state,
                    ctx.len()
                )));
            }
            if rows[..i].iter().any(|r| r.state == row.state) {
                return Err(KernelError::InvalidInput(format!("{} appears twice in one draft call", row.state)));
            }
        }
        // Present and distinct: checked above; always put back.
        let mut contexts: Vec<DrafterContext> = rows.iter().filter_map(|r| self.contexts.remove(&r.state)).collect();
        let result = {
            let mut block: Vec<BlockRow> = contexts
                .iter_mut()
                .zip(rows)
                .map(|(context, r)| BlockRow { context, anchor: r.anchor, num_drafts: r.num_drafts, params: &r.params })
                .collect();
            self.model.draft(gpu, target, mask, &mut block)
        };
        let positions: Vec<usize> = contexts.iter().map(DrafterContext::len).collect();
        for (row, context) in rows.iter().zip(contexts) {
            self.contexts.insert(row.state, context);
        }
        let drafts = result?;
        let vocab = self.model.config().vocab_size;
        let mut made = Vec::with_capacity(rows.len());
        for (((row, tokens), first), position) in rows.iter().zip(drafts.tokens).zip(&drafts.first).zip(positions) {
            let q = if row.params.is_greedy() {
                None
            } else {
                let q = gpu.uninit::<f32>(row.num_drafts * vocab)?; // [num_drafts, V], written in full by the copy
                gpu.copy::<f32>(gpu.ptr(&q), gpu.ptr(&drafts.q) + (first * vocab * 4) as u64, row.num_drafts * vocab)?;
                Some(q)
            };
            made.push(Pending { position, anchor: row.anchor, params: row.params.clone(), tokens, q, selected: false });
        }
        let made = rows.iter().zip(made).zip(drafts.confidences).map(|((row, p), c)| (row.state, p, c));
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

    /// Drops a stepped state's pending proposal; when it was selected and sampled, returns its `q`
    /// (`[num_drafts, V]` processed probabilities on the device; the row was checked by
    /// [`Self::check_row`], so its drafts are a prefix of the proposal).
    pub fn take_selected(&mut self, id: StateId) -> Option<CudaSlice<f32>> {
        self.pending.take(id).filter(|p| p.selected).and_then(|p| p.q)
    }

    /// Appends to each state's context the taps (`[m, tokens, d]`, the forward's of `target`) of the `count`
    /// tokens it committed, which start at token `first` of the step: `commits` holds `(state, first, count)`.
    pub fn commit(
        &mut self,
        gpu: &Gpu,
        target: &DeviceModel,
        taps: &CudaSlice<bf16>,
        tokens: usize,
        commits: &[(StateId, usize, usize)],
    ) -> Result<()> {
        for (i, (id, _, _)) in commits.iter().enumerate() {
            self.context(*id)?;
            if commits[..i].iter().any(|c| c.0 == *id) {
                return Err(KernelError::InvalidInput(format!("{id} commits twice in one step")));
            }
        }
        let mut contexts: Vec<DrafterContext> = commits.iter().filter_map(|c| self.contexts.remove(&c.0)).collect();
        let result = {
            let mut rows: Vec<(&mut DrafterContext, usize, usize)> =
                contexts.iter_mut().zip(commits).map(|(c, (_, first, count))| (c, *first, *count)).collect();
            self.model.append_context(gpu, target, taps, tokens, &mut rows)
        };
        for ((id, _, _), context) in commits.iter().zip(contexts) {
            self.contexts.insert(*id, context);
        }
        result
    }
}
