//! [`CpuRunner`]: the `Runner` contract on the CPU reference forward (f32 with bf16 activations).
//!
//! Invariants: the runner owns every `SeqState` it hands out, keyed by `StateId`. A step validates
//! everything that can be wrong with its input (unknown or repeated states, empty rows, token ids,
//! draft lengths, sampling parameters) before it touches any state, so a rejected step changes
//! nothing; it then takes the rows' states out of the map and always puts them back. Acceptance runs
//! here, where the logits are, and only tokens and requested log-probabilities leave.

use std::collections::HashMap;

use crate::acceptance::{self, AcceptanceMode, VerifyWindow};
use crate::config::ModelConfig;
use crate::cpu::forward::{CpuModel, WindowRow};
use crate::error::{KernelError, Result};
use crate::runner::{RowInput, RowOutput, Runner, StateId};
use crate::state::SeqState;
use crate::tensor::WeightSource;

/// The CPU backend.
pub struct CpuRunner {
    model: CpuModel<f32>,
    states: HashMap<StateId, SeqState<f32>>,
    next_id: u64,
    acceptance: AcceptanceMode,
}

impl CpuRunner {
    /// Loads and checks every weight of `cfg` from `source`.
    pub fn new(cfg: ModelConfig, source: &dyn WeightSource) -> Result<Self> {
        Ok(CpuRunner {
            model: CpuModel::load(cfg, source)?,
            states: HashMap::new(),
            next_id: 1,
            acceptance: AcceptanceMode::Standard,
        })
    }

    /// Switches between the lossless acceptance rule and forced acceptance (benchmarks only).
    pub fn set_acceptance(&mut self, mode: AcceptanceMode) {
        self.acceptance = mode;
    }

    fn insert(&mut self, state: SeqState<f32>) -> StateId {
        let id = StateId(self.next_id);
        self.next_id += 1;
        self.states.insert(id, state);
        id
    }

    fn state(&self, id: StateId) -> Result<&SeqState<f32>> {
        self.states.get(&id).ok_or(KernelError::UnknownState(id.0))
    }

    fn validate(&self, rows: &[RowInput]) -> Result<()> {
        let vocab = self.model.cfg.vocab_size;
        let mut seen = std::collections::HashSet::new();
        for row in rows {
            self.state(row.state)?;
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
        let copy = self.state(src)?.clone();
        Ok(self.insert(copy))
    }

    fn free_state(&mut self, id: StateId) -> Result<()> {
        self.states.remove(&id).map(|_| ()).ok_or(KernelError::UnknownState(id.0))
    }

    fn state_len(&self, id: StateId) -> Result<usize> {
        Ok(self.state(id)?.len)
    }

    fn state_bytes(&self, id: StateId) -> Result<usize> {
        Ok(self.state(id)?.bytes())
    }

    fn export_state(&self, id: StateId) -> Result<SeqState> {
        Ok(self.state(id)?.clone())
    }

    fn import_state(&mut self, state: SeqState) -> Result<StateId> {
        let fresh = SeqState::<f32>::new(&self.model.cfg);
        let kda_ok =
            state.kda.len() == fresh.kda.len()
                && state.kda.iter().zip(&fresh.kda).all(|(k, f)| {
                    k.s.len() == f.s.len() && k.conv.iter().zip(&f.conv).all(|(a, b)| a.len() == b.len())
                });
        let latent = self.model.cfg.mla.latent_dim();
        let mla_ok = state.mla.len() == fresh.mla.len()
            && state.mla.iter().all(|m| m.len() == state.len && m.latent_dim() == latent);
        if !kda_ok || !mla_ok {
            return Err(KernelError::InvalidInput("imported state does not match the model's layers".into()));
        }
        Ok(self.insert(state))
    }

    fn step(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>> {
        self.validate(rows)?;
        // Present and distinct: checked by `validate`.
        let mut states: Vec<SeqState<f32>> = rows.iter().filter_map(|r| self.states.remove(&r.state)).collect();
        let start_lens: Vec<usize> = states.iter().map(|s| s.len).collect();
        let mut windows: Vec<WindowRow<f32>> = states
            .iter_mut()
            .zip(rows)
            .map(|(state, row)| {
                let t = row.tokens.len();
                let (logits_from, snapshots_from) = match &row.sample {
                    Some(s) => (t - s.draft_len - 1, (s.draft_len > 0).then_some(t - s.draft_len)),
                    None => (t, None),
                };
                WindowRow { state, tokens: &row.tokens, logits_from, snapshots_from }
            })
            .collect();
        let forward = self.model.forward(&mut windows);
        drop(windows);
        let result = forward.and_then(|outs| {
            let vocab = self.model.cfg.vocab_size;
            let mut results = Vec::with_capacity(rows.len());
            for (((row, out), state), start) in rows.iter().zip(outs).zip(states.iter_mut()).zip(&start_lens) {
                let Some(sample) = &row.sample else {
                    results.push(RowOutput::default());
                    continue;
                };
                let t = row.tokens.len();
                let window = VerifyWindow {
                    target_logits: &out.logits,
                    vocab,
                    drafts: &row.tokens[t - sample.draft_len..],
                    draft_logits: None,
                    first_position: (start + t - sample.draft_len) as u64,
                };
                let verdict = acceptance::verify(&window, &sample.params, &self.acceptance)?;
                if let Some(undo) = out.undo {
                    undo.commit(state, t - sample.draft_len + verdict.num_accepted)?;
                }
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
