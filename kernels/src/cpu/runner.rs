//! [`CpuRunner`]: the `Runner` contract on the CPU reference forward (f32 with bf16 activations).
//!
//! Invariants: the runner owns every `SeqState` it hands out, keyed by `StateId`. A step validates
//! everything that can be wrong with its input (unknown or repeated states, empty rows, token ids,
//! draft lengths, sampling parameters) before it touches any state, so a rejected step changes
//! nothing; it then takes the rows' states out of the map and always puts them back. Acceptance runs
//! here, where the logits are, and only tokens and requested log-probabilities leave.
//!
//! With a drafter attached (`Runner::attach_drafter`), every step also taps the target layers
//! the drafter reads and appends, per row, the taps of exactly the tokens the step commits to that
//! state's drafter context, so the context follows the target's commit and rollback. The drafter is
//! lent as a [`Drafter`] that reads the target's weights, state lengths and token mask in place.

use std::collections::HashMap;

use crate::acceptance::{self, AcceptanceMode, Verdict, VerifyWindow};
use crate::config::ModelConfig;
use crate::cpu::forward::{CpuModel, Probe, WindowRow};
use crate::dspark::{DrafterModel, DrafterSlot, DrafterSource};
use crate::error::{KernelError, Result};
use crate::launches::{SyncLaunches, SyncStepper};
use crate::runner::{
    apply_row_mask, DraftProposal, DraftRequest, Drafter, RowInput, RowOutput, Runner, SampleRequest, StateId, TokenId,
    TokenMask,
};
use crate::state::SeqState;
use crate::tensor::WeightSource;

/// The CPU backend.
pub struct CpuRunner {
    model: CpuModel<f32>,
    states: HashMap<StateId, SeqState<f32>>,
    next_id: u64,
    acceptance: AcceptanceMode,
    /// The attached DSpark drafter, if any.
    drafter: Option<DrafterSlot>,
    /// Tokens the runner may not emit.
    token_mask: Option<TokenMask>,
    /// Steps launched and not yet collected.
    launches: SyncLaunches,
}

impl CpuRunner {
    /// Loads and checks every weight of `cfg` from `source`.
    pub fn new(cfg: ModelConfig, source: &dyn WeightSource) -> Result<Self> {
        Ok(CpuRunner {
            model: CpuModel::load(cfg, source)?,
            states: HashMap::new(),
            next_id: 1,
            acceptance: AcceptanceMode::Standard,
            drafter: None,
            token_mask: None,
            launches: SyncLaunches::default(),
        })
    }

    /// The attached drafter and its per-sequence contexts.
    pub fn drafter(&self) -> Option<&DrafterSlot> {
        self.drafter.as_ref()
    }

    /// Switches between the lossless acceptance rule and forced acceptance (benchmarks only).
    pub fn set_acceptance(&mut self, mode: AcceptanceMode) {
        self.acceptance = mode;
    }

    fn insert(&mut self, state: SeqState<f32>) -> StateId {
        let id = StateId(self.next_id);
        self.next_id += 1;
        if let Some(d) = &mut self.drafter {
            d.add_state(id, state.len);
        }
        self.states.insert(id, state);
        id
    }

    /// Appends to `id`'s drafter context the taps of the `count` tokens it committed, which start at
    /// token `first` of the step's tokens (row order).
    fn commit_drafter_context(&mut self, id: StateId, probe: &Probe<f32>, first: usize, count: usize) -> Result<()> {
        let Some(slot) = &mut self.drafter else { return Ok(()) };
        let d = self.model.cfg.hidden_size;
        let taps: Vec<&[f32]> = probe.taps.iter().map(|t| &t[first * d..(first + count) * d]).collect();
        slot.commit(id, &taps)
    }

    fn state(&self, id: StateId) -> Result<&SeqState<f32>> {
        self.states.get(&id).ok_or(KernelError::UnknownState(id.0))
    }

    fn validate(&self, rows: &[RowInput]) -> Result<()> {
        crate::runner::check_rows(rows, self.model.cfg.vocab_size, |id| self.states.contains_key(&id))?;
        if let Some(d) = &self.drafter {
            for row in rows {
                d.check_row(row, self.state(row.state)?.len)?;
            }
        }
        Ok(())
    }
}

impl Runner for CpuRunner {
    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn device_name(&self) -> String {
        "cpu".to_string()
    }

    fn alloc_state(&mut self) -> Result<StateId> {
        let state = SeqState::new(&self.model.cfg);
        Ok(self.insert(state))
    }

    fn fork_state(&mut self, src: StateId) -> Result<StateId> {
        self.launches.check_settled(src, "forked")?;
        let copy = self.state(src)?.clone();
        let id = self.insert(copy);
        if let Some(d) = &mut self.drafter {
            d.fork_state(src, id)?;
        }
        Ok(id)
    }

    fn free_state(&mut self, id: StateId) -> Result<()> {
        self.launches.check_settled(id, "freed")?;
        if let Some(d) = &mut self.drafter {
            d.remove_state(id);
        }
        self.states.remove(&id).map(|_| ()).ok_or(KernelError::UnknownState(id.0))
    }

    fn state_len(&self, id: StateId) -> Result<usize> {
        Ok(self.state(id)?.len)
    }

    fn state_bytes(&self, id: StateId) -> Result<usize> {
        let drafter = self.drafter.as_ref().map_or(0, |d| d.state_bytes(id));
        Ok(self.state(id)?.bytes() + drafter)
    }

    fn export_state(&self, id: StateId) -> Result<SeqState> {
        self.launches.check_settled(id, "exported")?;
        Ok(self.state(id)?.clone())
    }

    fn import_state(&mut self, state: SeqState) -> Result<StateId> {
        state.check_fits(&self.model.cfg)?;
        Ok(self.insert(state))
    }

    fn set_token_mask(&mut self, mask: TokenMask) -> Result<()> {
        let vocab = self.model.cfg.vocab_size;
        mask.check_fits(vocab)?;
        self.token_mask = Some(mask);
        Ok(())
    }

    crate::sync_stepper_runner_methods!();

    fn attach_drafter(&mut self, source: DrafterSource) -> Result<()> {
        let model = DrafterModel::load(source.config, &self.model.cfg, source.weights.as_ref())?;
        let mut slot = DrafterSlot::new(model);
        for (id, state) in &self.states {
            slot.add_state(*id, state.len);
        }
        self.drafter = Some(slot);
        Ok(())
    }

    fn model_drafter(&mut self) -> Option<Box<dyn Drafter + '_>> {
        let slot = self.drafter.as_mut()?;
        Some(Box::new(CpuDrafter { slot, target: &self.model, states: &self.states, mask: self.token_mask.as_ref() }))
    }
}

impl SyncStepper for CpuRunner {
    fn launches(&mut self) -> &mut SyncLaunches {
        &mut self.launches
    }

    fn step_now(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>> {
        self.validate(rows)?;
        // Present and distinct: checked by `validate`.
        let mut states: Vec<SeqState<f32>> = rows.iter().filter_map(|r| self.states.remove(&r.state)).collect();
        let start_lens: Vec<usize> = states.iter().map(|s| s.len).collect();
        let mut windows: Vec<WindowRow<f32>> = states
            .iter_mut()
            .zip(rows)
            .map(|(state, row)| {
                let (logits_from, snapshots_from) = row.window_bounds();
                WindowRow { state, tokens: &row.tokens, logits_from, snapshots_from }
            })
            .collect();
        let mut probe = Probe {
            tap_layers: self.drafter.as_ref().map(|d| d.tap_layers().to_vec()).unwrap_or_default(),
            ..Probe::default()
        };
        let forward = self.model.forward_probed(&mut windows, &mut probe);
        drop(windows);
        let mut row_start = 0usize; // the row's first token among all the step's tokens
        let result = forward.and_then(|outs| {
            let mut results = Vec::with_capacity(rows.len());
            for (((row, mut out), state), start) in rows.iter().zip(outs).zip(states.iter_mut()).zip(&start_lens) {
                let t = row.tokens.len();
                let first = row_start;
                row_start += t;
                let Some(sample) = &row.sample else {
                    if let Some(d) = &mut self.drafter {
                        d.take_selected(row.state, 0);
                    }
                    self.commit_drafter_context(row.state, &probe, first, t)?;
                    results.push(RowOutput::default());
                    continue;
                };
                let draft_q = self.drafter.as_mut().and_then(|d| d.take_selected(row.state, sample.draft_len));
                let verdict = verify_row(
                    RowVerify {
                        logits: &mut out.logits,
                        vocab: self.model.cfg.vocab_size,
                        token_mask: self.token_mask.as_ref(),
                        sample,
                        drafts: &row.tokens[t - sample.draft_len..],
                        draft_q: draft_q.as_deref(),
                        first_position: (start + t - sample.draft_len) as u64,
                    },
                    &self.acceptance,
                )?;
                let committed = t - sample.draft_len + verdict.num_accepted;
                if let Some(undo) = out.undo {
                    undo.commit(state, committed)?;
                }
                self.commit_drafter_context(row.state, &probe, first, committed)?;
                results.push(RowOutput {
                    tokens: verdict.tokens,
                    num_accepted: verdict.num_accepted,
                    logprobs: verdict.logprobs,
                });
            }
            Ok(results)
        });
        for (row, state) in rows.iter().zip(states) {
            self.states.insert(row.state, state);
        }
        result
    }
}

/// One sampling row's window of logits as a CPU runner verifies it, once they are whole on one thread.
pub(crate) struct RowVerify<'a> {
    /// `[draft_len + 1, vocab]`, masked in place.
    pub logits: &'a mut [f32],
    pub vocab: usize,
    /// The runner's token mask, if any.
    pub token_mask: Option<&'a TokenMask>,
    pub sample: &'a SampleRequest,
    pub drafts: &'a [TokenId],
    /// The selected model draft's `q`, when a model draft is verified against it.
    pub draft_q: Option<&'a [f32]>,
    pub first_position: u64,
}

/// Masks `row`'s logits (the runner's token mask, then the row's own mask per sampling position) and runs the
/// acceptance rule on them.
pub(crate) fn verify_row(row: RowVerify<'_>, mode: &AcceptanceMode) -> Result<Verdict> {
    if let Some(mask) = row.token_mask {
        mask.apply(row.logits);
    }
    for (mask, position) in row.sample.masks.iter().zip(row.logits.chunks_mut(row.vocab)) {
        apply_row_mask(mask, position);
    }
    let window = VerifyWindow {
        target_logits: row.logits,
        vocab: row.vocab,
        drafts: row.drafts,
        draft_logits: row.draft_q,
        first_position: row.first_position,
    };
    acceptance::verify(&window, &row.sample.params, mode)
}

/// A CPU runner's attached drafter lent as the [`Drafter`] capability, with the target's weights, states and
/// token mask borrowed in place.
struct CpuDrafter<'a> {
    slot: &'a mut DrafterSlot,
    target: &'a CpuModel<f32>,
    states: &'a HashMap<StateId, SeqState<f32>>,
    mask: Option<&'a TokenMask>,
}

impl Drafter for CpuDrafter<'_> {
    fn block_size(&self) -> usize {
        self.slot.model().config().block_size
    }

    fn draft(&mut self, rows: &[DraftRequest]) -> Result<Vec<DraftProposal>> {
        let states = self.states;
        let state_len = |id: StateId| states.get(&id).map(|s| s.len).ok_or(KernelError::UnknownState(id.0));
        self.slot.draft(self.target.into(), state_len, self.mask, rows)
    }

    fn select_proposal(&mut self, state: StateId) -> Result<()> {
        self.slot.select(state)
    }
}
