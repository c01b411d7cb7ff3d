//! [`CudaRunner`]: the `Runner` contract on one GPU, over the device forward of `cuda::forward`.
//!
//! Invariants:
//! - The runner owns every [`DeviceState`] it hands out, keyed by `StateId`; a step validates all of
//!   its input (the same checks as `CpuRunner`) before it touches any state, so a rejected step
//!   changes nothing, and it always puts the rows' states back.
//! - Greedy rows under the standard acceptance rule are decided on the device: one argmax per
//!   logits row, and only the token ids come back to the host, where the acceptance rule compares
//!   them with the drafts (vLLM's greedy rule, as in `acceptance::verify`).
//! - Greedy rows under forced acceptance are decided on the device too: the schedule gives the accepted
//!   count (as `acceptance::verify` draws it) and the device argmax the bonus token.
//! - Rows that sample (temperature > 0) or ask for log-probabilities
//!   copy their `draft_len + 1` logits rows to the host and use `acceptance::verify`, the same code
//!   the CPU runner uses, so the counter-based RNG draws are identical. (On-device sampling is a later
//!   issue; this keeps one implementation of the rule until then.)
//! - Commit and rollback happen on the device: the KDA states and conv windows saved after the last
//!   accepted token are copied back, and the MLA length moves back.
//! - With a DSpark drafter attached ([`CudaRunner::attach_drafter`]), the forward taps the layers the
//!   drafter reads and each row's drafter context grows by the taps of exactly the tokens the step
//!   commits (`cuda::drafter_slot`). A selected sampled proposal's `q` is copied to the host for
//!   `acceptance::verify`, like the target logits of sampled rows.

use std::collections::HashMap;

use half::bf16;

use crate::acceptance::{self, AcceptanceMode, VerifyWindow};
use crate::config::ModelConfig;
use crate::cpu::moe::Routing;
use crate::cuda::drafter::DeviceDrafter;
use crate::cuda::drafter_slot::DeviceDrafterSlot;
use crate::cuda::forward::{DeviceModel, DeviceRow, DeviceState};
use crate::cuda::ops::{Gemm, Gpu};
use crate::cuda::weights::DevWeights;
use crate::dspark::DrafterConfig;
use crate::error::{KernelError, Result};
use crate::runner::{DraftProposal, DraftRequest, RowInput, RowOutput, Runner, StateId, TokenId};
use crate::state::SeqState;
use crate::tensor::WeightSource;

/// How long start-up took.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadStats {
    /// Opening the device and compiling (or loading cached) kernels.
    pub kernel_setup_seconds: f64,
    /// Fetching (or generating) every tensor and uploading it.
    pub weights_seconds: f64,
    /// The part of `weights_seconds` spent fetching (or generating) tensors on the host, and copying.
    pub fetch_seconds: f64,
    pub upload_seconds: f64,
    pub weight_bytes: usize,
}

/// The CUDA backend on one device.
pub struct CudaRunner {
    gpu: Gpu,
    load: LoadStats,
    model: DeviceModel,
    states: HashMap<StateId, DeviceState>,
    next_id: u64,
    acceptance: AcceptanceMode,
    /// The attached DSpark drafter, if any.
    drafter: Option<DeviceDrafterSlot>,
}

impl CudaRunner {
    /// Opens device `ordinal`, compiles the kernels and uploads every weight of `cfg` from `source`.
    pub fn new(ordinal: usize, cfg: ModelConfig, source: &dyn WeightSource) -> Result<Self> {
        let t0 = std::time::Instant::now();
        let gpu = Gpu::new(ordinal)?;
        let kernel_setup_seconds = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let weights = DevWeights::load(&gpu, &cfg, source)?;
        gpu.synchronize()?;
        let load = LoadStats {
            kernel_setup_seconds,
            weights_seconds: t1.elapsed().as_secs_f64(),
            fetch_seconds: weights.fetch_seconds,
            upload_seconds: weights.upload_seconds,
            weight_bytes: weights.bytes,
        };
        Ok(CudaRunner {
            gpu,
            load,
            model: DeviceModel { cfg, weights },
            states: HashMap::new(),
            next_id: 1,
            acceptance: AcceptanceMode::Standard,
            drafter: None,
        })
    }

    /// Uploads the DSpark drafter `cfg` from `source` and attaches it (the target's embedding and
    /// lm_head are shared). States that already exist get an empty drafter context starting at their
    /// current length, as on the CPU.
    pub fn attach_drafter(&mut self, cfg: DrafterConfig, source: &dyn WeightSource) -> Result<()> {
        cfg.check_against(&self.model.cfg)?;
        let mut slot = DeviceDrafterSlot::new(DeviceDrafter::load(&self.gpu, cfg, source)?);
        for (id, state) in &self.states {
            slot.add_state(&self.gpu, *id, state.len)?;
        }
        self.gpu.synchronize()?;
        self.drafter = Some(slot);
        Ok(())
    }

    /// The attached drafter and its per-sequence device contexts.
    pub fn drafter(&self) -> Option<&DeviceDrafterSlot> {
        self.drafter.as_ref()
    }

    /// Switches between the lossless acceptance rule and forced acceptance (benchmarks only).
    pub fn set_acceptance(&mut self, mode: AcceptanceMode) {
        self.acceptance = mode;
    }

    /// Chooses the GEMM of the linear layers (the default is batch-invariant; see [`Gemm`]).
    pub fn set_gemm(&mut self, gemm: Gemm) {
        self.gpu.gemm = gemm;
    }

    pub fn load_stats(&self) -> &LoadStats {
        &self.load
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn model(&self) -> &DeviceModel {
        &self.model
    }

    /// [`Runner::step`], also filling `trace` with every MoE layer's routing of every token (tokens in
    /// row order), as the benchmark needs to count the experts a step reads.
    pub fn step_with_trace(
        &mut self,
        rows: &[RowInput],
        trace: Option<&mut Vec<Vec<Routing<f32>>>>,
    ) -> Result<Vec<RowOutput>> {
        self.validate(rows)?;
        // Present and distinct: checked by `validate`.
        let mut states: Vec<DeviceState> = rows.iter().filter_map(|r| self.states.remove(&r.state)).collect();
        let result = self.run(rows, &mut states, trace);
        for (row, state) in rows.iter().zip(states) {
            self.states.insert(row.state, state);
        }
        result
    }

    fn insert(&mut self, state: DeviceState) -> Result<StateId> {
        let id = StateId(self.next_id);
        self.next_id += 1;
        if let Some(d) = &mut self.drafter {
            d.add_state(&self.gpu, id, state.len)?;
        }
        self.states.insert(id, state);
        Ok(id)
    }

    fn state(&self, id: StateId) -> Result<&DeviceState> {
        self.states.get(&id).ok_or(KernelError::UnknownState(id.0))
    }

    fn validate(&self, rows: &[RowInput]) -> Result<()> {
        crate::runner::check_rows(rows, self.model.cfg.vocab_size, |id| self.state(id).is_ok())?;
        if let Some(d) = &self.drafter {
            for row in rows {
                d.check_row(row, self.state(row.state)?.len)?;
            }
        }
        Ok(())
    }

    /// Runs the forward and the acceptance rule over states taken out of the map.
    fn run(
        &mut self,
        rows: &[RowInput],
        states: &mut [DeviceState],
        trace: Option<&mut Vec<Vec<Routing<f32>>>>,
    ) -> Result<Vec<RowOutput>> {
        let cfg = &self.model.cfg;
        let gpu = &self.gpu;
        let mut windows: Vec<DeviceRow> = states
            .iter_mut()
            .zip(rows)
            .map(|(state, row)| {
                let t = row.tokens.len();
                let (logits_from, snapshots_from) = match &row.sample {
                    Some(s) => (t - s.draft_len - 1, (s.draft_len > 0).then_some(t - s.draft_len)),
                    None => (t, None),
                };
                DeviceRow { state, tokens: &row.tokens, logits_from, snapshots_from }
            })
            .collect();
        let start_lens: Vec<usize> = windows.iter().map(|w| w.state.len).collect();
        let tap_layers = self.drafter.as_ref().map(|d| d.tap_layers().to_vec()).unwrap_or_default();
        let mut out = self.model.forward_tapped(gpu, &mut windows, trace, &tap_layers)?;
        drop(windows);
        let taps = out.taps.take();
        // (state, first token of the row in the step, tokens committed): the drafter context's growth.
        let mut commits = Vec::with_capacity(rows.len());
        let mut row_start = 0usize;
        let total_rows: usize = out.rows.iter().map(|r| r.1).sum();
        let on_device =
            |row: &RowInput| row.sample.as_ref().is_some_and(|s| s.params.is_greedy() && s.params.logprobs.is_none());
        let argmax = if rows.iter().any(on_device) {
            let ids = gpu.zeros::<u32>(total_rows)?;
            gpu.argmax(gpu.ptr(&out.logits), total_rows, cfg.vocab_size, gpu.ptr(&ids))?;
            gpu.download(&ids, total_rows)?
        } else {
            Vec::new()
        };
        let vocab = cfg.vocab_size;
        let mut results = Vec::with_capacity(rows.len());
        for (((row, (first, count)), undo), (state, start)) in
            rows.iter().zip(out.rows).zip(out.undo).zip(states.iter_mut().zip(&start_lens))
        {
            let t = row.tokens.len();
            let first_token = row_start;
            row_start += t;
            let Some(sample) = &row.sample else {
                if let Some(d) = &mut self.drafter {
                    d.take_selected(gpu, row.state, 0)?;
                }
                commits.push((row.state, first_token, t));
                results.push(RowOutput::default());
                continue;
            };
            let draft_q = match &mut self.drafter {
                Some(d) => d.take_selected(gpu, row.state, sample.draft_len)?,
                None => None,
            };
            let drafts = &row.tokens[t - sample.draft_len..];
            let (tokens, logprobs) = if on_device(row) {
                let argmax = &argmax[first..first + count];
                let tokens = match &self.acceptance {
                    AcceptanceMode::Standard => greedy_accept(argmax, drafts),
                    AcceptanceMode::Synthetic(schedule) => {
                        // `acceptance::verify`'s forced rule, with the greedy token taken on the device.
                        let first_position = (start + t - sample.draft_len) as u64;
                        let accepted = schedule.accepted_count(sample.params.seed, first_position, drafts.len());
                        let mut tokens = drafts[..accepted].to_vec();
                        tokens.push(argmax[accepted]);
                        tokens
                    }
                };
                (tokens, Vec::new())
            } else {
                let host: Vec<bf16> = {
                    let view = out.logits.slice(first * vocab..(first + count) * vocab);
                    let mut v = vec![bf16::ZERO; count * vocab];
                    gpu.stream
                        .memcpy_dtoh(&view, &mut v)
                        .map_err(|e| KernelError::Device(format!("logits copy: {e}")))?;
                    v
                };
                let target: Vec<f32> = host.into_iter().map(f32::from).collect();
                let window = VerifyWindow {
                    target_logits: &target,
                    vocab,
                    drafts,
                    draft_logits: draft_q.as_deref(),
                    first_position: (start + t - sample.draft_len) as u64,
                };
                let verdict = acceptance::verify(&window, &sample.params, &self.acceptance)?;
                (verdict.tokens, verdict.logprobs)
            };
            let num_accepted = tokens.len() - 1;
            if let Some(undo) = undo {
                undo.commit(gpu, cfg, state, t - sample.draft_len + num_accepted)?;
            }
            commits.push((row.state, first_token, t - sample.draft_len + num_accepted));
            results.push(RowOutput { tokens, num_accepted, logprobs });
        }
        if let (Some(d), Some(taps)) = (&mut self.drafter, &taps) {
            d.commit(gpu, taps, row_start, &commits)?;
        }
        gpu.synchronize()?;
        Ok(results)
    }
}

/// vLLM's greedy rule on the target argmaxes of a window (`argmax[i]` is the token at draft `i`'s
/// position): emit the argmax while it equals the draft; the first mismatch, or the bonus, ends it.
pub fn greedy_accept(argmax: &[TokenId], drafts: &[TokenId]) -> Vec<TokenId> {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (target, draft) in argmax.iter().zip(drafts) {
        tokens.push(*target);
        if target != draft {
            return tokens;
        }
    }
    tokens.push(argmax[drafts.len()]);
    tokens
}

impl Runner for CudaRunner {
    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn device_name(&self) -> String {
        format!("cuda:{} {}", self.gpu.info.ordinal, self.gpu.info.name)
    }

    fn alloc_state(&mut self) -> Result<StateId> {
        let state = DeviceState::new(&self.gpu, &self.model.cfg)?;
        self.insert(state)
    }

    fn fork_state(&mut self, src: StateId) -> Result<StateId> {
        let copy = self.state(src)?.duplicate(&self.gpu, &self.model.cfg)?;
        let id = self.insert(copy)?;
        if let Some(d) = &mut self.drafter {
            d.fork_state(&self.gpu, src, id)?;
        }
        Ok(id)
    }

    fn free_state(&mut self, id: StateId) -> Result<()> {
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
        Ok(self.state(id)?.bytes(&self.model.cfg) + drafter)
    }

    fn export_state(&self, id: StateId) -> Result<SeqState> {
        self.state(id)?.export(&self.gpu, &self.model.cfg)
    }

    fn import_state(&mut self, state: SeqState) -> Result<StateId> {
        state.check_fits(&self.model.cfg)?;
        let dev = DeviceState::import(&self.gpu, &self.model.cfg, &state)?;
        self.insert(dev)
    }

    fn step(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>> {
        self.step_with_trace(rows, None)
    }

    fn drafter_block_size(&self) -> Option<usize> {
        self.drafter.as_ref().map(|d| d.model().config().block_size)
    }

    fn draft(&mut self, rows: &[DraftRequest]) -> Result<Vec<DraftProposal>> {
        let slot = self.drafter.as_mut().ok_or_else(crate::runner::no_drafter)?;
        let states = &self.states;
        let state_len = |id: StateId| states.get(&id).map(|s| s.len).ok_or(KernelError::UnknownState(id.0));
        let proposals = slot.draft(&self.gpu, &self.model, state_len, rows)?;
        self.gpu.synchronize()?;
        Ok(proposals)
    }

    fn select_proposal(&mut self, state: StateId) -> Result<()> {
        self.drafter.as_mut().ok_or_else(crate::runner::no_drafter)?.select(state)
    }
}

#[cfg(test)]
mod tests {
    use super::greedy_accept;

    #[test]
    fn greedy_accept_follows_the_vllm_rule() {
        assert_eq!(greedy_accept(&[1, 2, 3], &[1, 2]), vec![1, 2, 3]);
        assert_eq!(greedy_accept(&[2, 3], &[1]), vec![2]);
        assert_eq!(greedy_accept(&[4, 7, 6, 1], &[4, 5, 6]), vec![4, 7]);
        assert_eq!(greedy_accept(&[5], &[]), vec![5]);
    }
}
