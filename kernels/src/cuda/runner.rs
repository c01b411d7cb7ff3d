//! [`CudaRunner`]: the `Runner` contract on one GPU, over the device forward of `cuda::forward`.
//!
//! Invariants:
//! - The runner owns every [`DeviceState`] it hands out, keyed by `StateId`; a step validates all of
//!   its input (the same checks as `CpuRunner`) before it touches any state, so a rejected step
//!   changes nothing, and it always puts the rows' states back.
//! - Every row is decided on the device (`SampleKernels::verify_rows`, one launch per step): greedy,
//!   sampling, log-probabilities and forced acceptance, with the token mask and a constrained row's own masks
//!   (uploaded per step, `RowMasks`) applied first; masks from a `MaskSource` are asked once the forward is
//!   launched, so the host computes them while the device runs it. Only the
//!   emitted tokens and requested log-probabilities come back; logits never leave the device.
//!   `acceptance::verify` stays the CPU reference the device rule is tested against.
//! - Commit and rollback happen on the device: the KDA states and conv windows saved after the last
//!   accepted token are copied back, and the MLA length moves back.
//! - A step is launched (`launch_rows`: forward, acceptance, the verdicts' copy back started) and then
//!   landed (`land`: wait for that copy alone, roll back, grow the drafter contexts). `step` does both and
//!   waits for the stream; `launch`, `launch_fed` and `collect` keep up to two steps in flight
//!   (`crate::launches`), and a fed step's token ids come from the step before it on the device (each row's
//!   emitted token is also written to that step's `emitted` buffer), so the host never sees them first.
//! - With a DSpark drafter attached (`Runner::attach_drafter`), the forward taps the layers the
//!   drafter reads and each row's drafter context grows by the taps of exactly the tokens the step
//!   commits (`cuda::drafter_slot`); a selected sampled proposal is verified with its device `q`.
//! - A runner built by [`CudaRunner::sharded`] is rank 0 of a tensor-parallel group (`cuda::tp`): it leads, sending
//!   the plan of every group-wide action (a state allocated, forked, freed, exported or imported; a forward; the
//!   verdicts' cuts) before it acts, and the other ranks follow (`cuda::follower`). Its logits are whole on rank 0,
//!   so acceptance runs here alone. Its states are its shards (the KDA heads of rank 0, the whole MLA cache); an
//!   export gathers and joins every rank's shards into the whole model's state, and an import hands each rank its
//!   shards, so states move between sharded and whole runners. A group steps one step at a time (no launches
//!   ahead: a follower's rollback must follow the forward it undoes) and has no drafter yet. Dropping the runner
//!   ends the group.

use std::collections::{HashMap, VecDeque};

use cudarc::driver::{CudaEvent, CudaSlice};
use half::bf16;

use crate::acceptance::AcceptanceMode;
use crate::config::ModelConfig;
use crate::cpu::plan::{Plan, PlanRow};
use crate::cpu::shard::{join_state, kda_shards, shard_state, state_values, state_values_len};
use crate::cuda::device::device_err;
use crate::cuda::drafter::DeviceDrafter;
use crate::cuda::drafter_slot::DeviceDrafterSlot;
use crate::cuda::forward::{DeviceModel, StepOptions};
use crate::cuda::gpu::{Gemm, Gpu};
use crate::cuda::launch::DPtr;
use crate::cuda::ops::Ops;
use crate::cuda::sample::{DeviceTokenMask, PendingVerify, VerifyRow};
use crate::cuda::state::{DeviceRow, DeviceState, DeviceUndo};
use crate::cuda::tp::DeviceGroup;
use crate::cuda::weights::DevWeights;
use crate::dspark::DrafterSource;
use crate::error::{KernelError, Result};
use crate::launches::{check_fed, in_flight_error, too_many_in_flight, FedRow, LaunchedRow, MAX_IN_FLIGHT};
use crate::routing::Routing;
use crate::runner::{
    check_row_masks, DraftProposal, DraftRequest, Drafter, MaskSource, RowInput, RowOutput, Runner, SampleRequest,
    StateId, TokenMask,
};
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

/// The CUDA backend on one device (and, built by [`CudaRunner::sharded`], rank 0 of a group of devices).
pub struct CudaRunner {
    gpu: Gpu,
    load: LoadStats,
    /// The whole model's config (the model's own is the rank's in a group).
    cfg: ModelConfig,
    model: DeviceModel,
    states: HashMap<StateId, DeviceState>,
    next_id: u64,
    acceptance: AcceptanceMode,
    /// The ids the runner may emit ([`Runner::set_token_mask`]); `None`: all.
    token_mask: Option<DeviceTokenMask>,
    /// The attached DSpark drafter, if any.
    drafter: Option<DeviceDrafterSlot>,
    /// Steps launched and not yet collected, oldest first (`crate::launches`).
    in_flight: VecDeque<InFlight>,
}

impl CudaRunner {
    /// Opens device `ordinal`, compiles the kernels and uploads every weight of `cfg` from `source`.
    pub fn new(ordinal: usize, cfg: ModelConfig, source: &dyn WeightSource) -> Result<Self> {
        let t0 = std::time::Instant::now();
        let gpu = Gpu::new(ordinal)?;
        Self::load(gpu, t0, cfg, source, None)
    }

    /// Rank 0 of `group` on `gpu` (the device its communicator was formed on): uploads rank 0's shard of every
    /// weight of `cfg` (the whole model's config) from `source`. The other ranks run `cuda::follower::Follower`
    /// over the same group, model and source.
    pub fn sharded(gpu: Gpu, cfg: ModelConfig, source: &dyn WeightSource, group: DeviceGroup) -> Result<Self> {
        if group.shard.rank != 0 {
            return Err(KernelError::InvalidInput(format!(
                "rank {} of a group follows (cuda::follower); rank 0 runs the runner",
                group.shard.rank
            )));
        }
        Self::load(gpu, std::time::Instant::now(), cfg, source, Some(group))
    }

    /// The runner on `gpu` (opened at `t0`) over the whole model, or over rank 0's shard of `group`.
    fn load(
        gpu: Gpu,
        t0: std::time::Instant,
        cfg: ModelConfig,
        source: &dyn WeightSource,
        group: Option<DeviceGroup>,
    ) -> Result<Self> {
        let ops = Ops::load(&gpu)?;
        let kernel_setup_seconds = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let weights = match &group {
            Some(g) => DevWeights::load_shard(&gpu, &cfg, source, g.shard)?,
            None => DevWeights::load(&gpu, &cfg, source)?,
        };
        gpu.synchronize()?;
        let load = LoadStats {
            kernel_setup_seconds,
            weights_seconds: t1.elapsed().as_secs_f64(),
            fetch_seconds: weights.fetch_seconds,
            upload_seconds: weights.upload_seconds,
            weight_bytes: weights.bytes,
        };
        let model = match group {
            Some(g) => DeviceModel::sharded(&cfg, weights, ops, g)?,
            None => DeviceModel::new(cfg.clone(), weights, ops),
        };
        Ok(CudaRunner {
            gpu,
            load,
            cfg,
            model,
            states: HashMap::new(),
            next_id: 1,
            acceptance: AcceptanceMode::Standard,
            token_mask: None,
            drafter: None,
            in_flight: VecDeque::new(),
        })
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

    /// Turns programmatic dependent launch on or off (see [`Gpu::dependent_launch`]; it stays off on a device
    /// before Hopper). The graphs held are dropped: their kernels were captured with the old setting.
    pub fn set_dependent_launch(&mut self, on: bool) {
        self.gpu.set_dependent_launch(on);
        self.model.clear_graphs();
    }

    /// Chooses how MLA windows run (benchmarks compare the forms): windows of at least `group_from` tokens 4 tokens
    /// to a block, and about `chunk_split_tokens` (token, split) pairs for a window longer than a verify window
    /// (`DeviceModel::mla_group_from`, `mla_chunk_split_tokens`). The graphs held are dropped: they were captured
    /// with the old forms.
    pub fn set_mla_forms(&mut self, group_from: usize, chunk_split_tokens: usize) {
        self.model.mla_group_from = group_from;
        self.model.mla_chunk_split_tokens = chunk_split_tokens;
        self.model.clear_graphs();
    }

    /// Turns the capture and replay of repeated step shapes as CUDA graphs on or off (on by default;
    /// off drops the graphs held).
    pub fn set_graphs(&mut self, on: bool) {
        self.model.graphs_enabled = on;
        if !on {
            self.model.clear_graphs();
        }
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
        self.step_now(rows, StepOptions { trace, ..StepOptions::default() }, None)
    }

    /// One step launched and landed, waiting for the stream; with `masks` its rows' masks come from it.
    fn step_now(
        &mut self,
        rows: &[RowInput],
        opts: StepOptions<'_>,
        masks: Option<&mut dyn MaskSource>,
    ) -> Result<Vec<RowOutput>> {
        if !self.in_flight.is_empty() {
            return Err(KernelError::InvalidInput(format!(
                "{} launched steps are not yet collected; `step` waits for none",
                self.in_flight.len()
            )));
        }
        self.validate(rows, masks.is_some())?;
        let flight = self.launch_rows(rows, opts, masks)?;
        let outputs = self.land(flight);
        self.gpu.synchronize()?;
        outputs
    }

    /// One step launched ahead of its outputs ([`Runner::launch`]); with `masks` its rows' masks come from it.
    fn launch_now(&mut self, rows: &[RowInput], masks: Option<&mut dyn MaskSource>) -> Result<()> {
        self.check_launches()?;
        if self.in_flight.len() >= MAX_IN_FLIGHT {
            return Err(too_many_in_flight());
        }
        for row in rows {
            self.check_settled(row.state, "stepped by a launch that does not feed it")?;
        }
        self.validate(rows, masks.is_some())?;
        let flight = self.launch_rows(rows, StepOptions::default(), masks)?;
        self.in_flight.push_back(flight);
        Ok(())
    }

    /// Rank 0 of a group: sends `plan` to the other ranks before acting on it (nothing without a group).
    fn lead(&self, plan: &Plan) -> Result<()> {
        match self.model.group() {
            Some(group) => group.send_plan(&self.gpu, plan),
            None => Ok(()),
        }
    }

    /// Launching ahead is refused in a group (module invariants).
    fn check_launches(&self) -> Result<()> {
        match self.model.group() {
            Some(g) => Err(KernelError::InvalidInput(format!(
                "a group of {} ranks steps one step at a time (it does not launch steps ahead)",
                g.shard.world
            ))),
            None => Ok(()),
        }
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

    /// The checks of a step before it touches any state; `sourced`: its masks come from a [`MaskSource`], so its
    /// rows carry none of their own.
    fn validate(&self, rows: &[RowInput], sourced: bool) -> Result<()> {
        crate::runner::check_rows(rows, self.model.cfg.vocab_size, |id| self.state(id).is_ok())?;
        if sourced && rows.iter().any(|r| r.sample.as_ref().is_some_and(|s| !s.masks.is_empty())) {
            return Err(KernelError::InvalidInput(
                "a step whose masks come from a mask source has rows with masks of their own".into(),
            ));
        }
        if let Some(d) = &self.drafter {
            for row in rows {
                d.check_row(row, self.state(row.state)?.len)?;
            }
        }
        Ok(())
    }

    /// Fails when `state` is in a launched step not yet collected.
    fn check_settled(&self, state: StateId, what: &str) -> Result<()> {
        match self.in_flight.iter().any(|f| f.launched.iter().any(|r| r.state == state)) {
            true => Err(in_flight_error(state, what)),
            false => Ok(()),
        }
    }

    /// Launches the forward and the acceptance rule of validated `rows` (their states are taken out of the map
    /// for the forward and always put back) and starts bringing the verdicts back, without waiting.
    /// With `masks`, the sampling rows' masks are asked of it once the forward is launched (they are computed on the
    /// host while the device runs the forward).
    fn launch_rows(
        &mut self,
        rows: &[RowInput],
        opts: StepOptions<'_>,
        masks: Option<&mut dyn MaskSource>,
    ) -> Result<InFlight> {
        let tap_layers = self.drafter.as_ref().map(|d| d.tap_layers().to_vec()).unwrap_or_default();
        if self.model.group().is_some() {
            let rows = rows
                .iter()
                .map(|row| {
                    let (logits_from, snapshots_from) = row.window_bounds();
                    PlanRow { state: row.state, tokens: row.tokens.clone(), logits_from, snapshots_from }
                })
                .collect();
            self.lead(&Plan::Forward { rows, argmax: false })?;
        }
        // Present and distinct: checked by `validate`.
        let mut states: Vec<DeviceState> = rows.iter().filter_map(|r| self.states.remove(&r.state)).collect();
        let start_lens: Vec<usize> = states.iter().map(|s| s.len).collect();
        let forward = {
            let mut windows: Vec<DeviceRow> = states
                .iter_mut()
                .zip(rows)
                .map(|(state, row)| {
                    let (logits_from, snapshots_from) = row.window_bounds();
                    DeviceRow { state, tokens: &row.tokens, logits_from, snapshots_from }
                })
                .collect();
            self.model.forward_tapped(&self.gpu, &mut windows, StepOptions { tap_layers: &tap_layers, ..opts })
        };
        for (row, state) in rows.iter().zip(states) {
            self.states.insert(row.state, state);
        }
        let out = forward?;
        let (gpu, vocab) = (&self.gpu, self.model.cfg.vocab_size);
        let logits = gpu.ptr(&out.logits);
        // Every stepped state's pending proposal is dropped; a selected sampled one lends its `q`.
        let mut draft_q = Vec::with_capacity(rows.len());
        for row in rows {
            let q = self.drafter.as_mut().and_then(|d| d.take_selected(row.state));
            draft_q.push(q.filter(|_| row.sample.is_some()));
        }
        let emitted = gpu.uninit::<u32>(rows.len())?; // [rows]: written for every row that emits one token
        let emitted_at = gpu.ptr(&emitted);
        let row_masks = RowMasks::upload(gpu, vocab, rows, masks)?;
        let windows: Vec<VerifyRow> = rows
            .iter()
            .enumerate()
            .zip(&out.rows)
            .zip(&start_lens)
            .zip(&draft_q)
            .filter_map(|((((i, row), &(first, _)), start), q)| {
                let sample = row.sample.as_ref()?;
                let t = row.tokens.len();
                Some(VerifyRow {
                    logits: logits + (first * vocab * 2) as u64,
                    drafts: &row.tokens[t - sample.draft_len..],
                    params: &sample.params,
                    first_position: (start + t - sample.draft_len) as u64,
                    q: q.as_ref().map(|q| gpu.ptr(q)),
                    token_out: Some(emitted_at + (i * 4) as u64),
                    masks: row_masks.of(i),
                })
            })
            .collect();
        let verify = self.model.ops.sample.launch_verify_rows(
            gpu,
            vocab,
            &windows,
            self.token_mask.as_ref(),
            &self.acceptance,
        )?;
        let done = gpu.stream.record_event(None).map_err(|e| device_err("recording a step's end", e))?;
        let mut row_start = 0usize;
        let landing = rows
            .iter()
            .map(|row| {
                let first_token = row_start;
                row_start += row.tokens.len();
                LandingRow {
                    state: row.state,
                    first_token,
                    tokens: row.tokens.len(),
                    draft_len: row.sample.as_ref().map(|s| s.draft_len),
                }
            })
            .collect();
        Ok(InFlight {
            launched: rows.iter().map(LaunchedRow::of).collect(),
            rows: landing,
            tokens: row_start,
            verify,
            done,
            undo: out.undo,
            taps: out.taps,
            emitted,
            _logits: out.logits,
            _draft_q: draft_q,
            _row_masks: row_masks.words,
        })
    }

    /// Waits for a launched step's verdicts and lands it: rolls back each verify window to its accepted
    /// drafts, grows the drafter contexts by the committed tokens, and returns the rows' outputs.
    fn land(&mut self, flight: InFlight) -> Result<Vec<RowOutput>> {
        let verdicts = flight.verify.wait()?;
        // A step without sampled rows has no verdicts to wait for: it lands once its work is done.
        flight.done.synchronize().map_err(|e| device_err("waiting for a step", e))?;
        if self.model.group().is_some() && flight.undo.iter().any(Option::is_some) {
            // The followers cut their windows as this rank does: each sampled row with snapshots keeps its accepted
            // drafts (the verdicts come in the order of the sampled rows).
            let sampled = flight.rows.iter().zip(&flight.undo).filter(|(row, _)| row.draft_len.is_some());
            let cuts = sampled
                .zip(&verdicts)
                .filter(|((_, undo), _)| undo.is_some())
                .map(|((row, _), v)| (row.state, row.tokens - row.draft_len.unwrap_or(0) + v.num_accepted))
                .collect();
            self.lead(&Plan::Commit(cuts))?;
        }
        let mut verdicts = verdicts.into_iter();
        let (gpu, cfg) = (&self.gpu, &self.model.cfg);
        let mut results = Vec::with_capacity(flight.rows.len());
        // (state, first token of the row in the step, tokens committed): the drafter contexts' growth.
        let mut commits = Vec::with_capacity(flight.rows.len());
        for (row, undo) in flight.rows.iter().zip(flight.undo) {
            let Some(draft_len) = row.draft_len else {
                commits.push((row.state, row.first_token, row.tokens));
                results.push(RowOutput::default());
                continue;
            };
            let verdict = verdicts
                .next()
                .ok_or_else(|| KernelError::Device("the device verify returned fewer verdicts than rows".into()))?;
            if let Some(undo) = undo {
                let state = self.states.get_mut(&row.state).ok_or(KernelError::UnknownState(row.state.0))?;
                undo.commit(gpu, cfg, state, row.tokens - draft_len + verdict.num_accepted)?;
            }
            commits.push((row.state, row.first_token, row.tokens - draft_len + verdict.num_accepted));
            results.push(RowOutput {
                tokens: verdict.tokens,
                num_accepted: verdict.num_accepted,
                logprobs: verdict.logprobs,
            });
        }
        if let (Some(d), Some(taps)) = (&mut self.drafter, &flight.taps) {
            d.commit(gpu, &self.model, taps, flight.tokens, &commits)?;
        }
        Ok(results)
    }
}

impl Drop for CudaRunner {
    /// Ends the group: the followers return (nothing to do without a group). A group already down has no one to
    /// tell, so a failed send is left unreported.
    fn drop(&mut self) {
        let _ = self.lead(&Plan::Shutdown);
    }
}

/// A step launched on the device whose outputs the host has not collected (see `crate::launches`).
struct InFlight {
    /// Its rows as a fed step after it checks them.
    launched: Vec<LaunchedRow>,
    /// What landing each row needs.
    rows: Vec<LandingRow>,
    /// Tokens of the step, all rows.
    tokens: usize,
    verify: PendingVerify,
    /// Recorded after the step's last work (the verdicts' copy): landing waits for it, not for later steps.
    done: CudaEvent,
    /// Per row: the states saved inside a verify window, for the rollback to the accepted drafts.
    undo: Vec<Option<DeviceUndo>>,
    /// `[taps, tokens, d]` bf16: the drafter's features of the step.
    taps: Option<CudaSlice<bf16>>,
    /// `[rows]` u32: the token each row that emits exactly one emits (what a fed step after this one reads).
    emitted: CudaSlice<u32>,
    /// What the device still reads until the step lands: the logits and the selected proposals' `q`.
    _logits: CudaSlice<bf16>,
    _draft_q: Vec<Option<CudaSlice<f32>>>,
    _row_masks: Option<CudaSlice<u32>>,
}

/// The constrained rows' token masks of one step on the device: every mask of every row, in row order, uploaded
/// in one copy through the staging buffers; the sampling kernel reads a row's masks beside the runner's.
struct RowMasks {
    /// u32 `[masks, ceil(vocab / 32)]`; `None` when no row is constrained.
    words: Option<CudaSlice<u32>>,
    /// Per row: the device address of its first mask.
    at: Vec<Option<DPtr>>,
}

impl RowMasks {
    /// Uploads the masks of validated `rows`: their own, or with `source` those it gives (checked here).
    fn upload(gpu: &Gpu, vocab: usize, rows: &[RowInput], mut source: Option<&mut dyn MaskSource>) -> Result<Self> {
        let mut per_row = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let Some(sample) = &row.sample else {
                per_row.push(Vec::new());
                continue;
            };
            per_row.push(match source.as_deref_mut() {
                Some(source) => {
                    let masks = source.masks(i)?;
                    check_row_masks(&masks, sample.draft_len, vocab)?;
                    masks
                }
                None => sample.masks.clone(),
            });
        }
        let total: usize = per_row.iter().map(Vec::len).sum();
        if total == 0 {
            return Ok(RowMasks { words: None, at: vec![None; rows.len()] });
        }
        let width = vocab.div_ceil(32);
        let mut host = Vec::with_capacity(total * width); // [masks, width]
        let mut firsts = Vec::with_capacity(rows.len());
        for masks in &per_row {
            firsts.push((!masks.is_empty()).then_some(host.len()));
            for m in masks {
                host.extend_from_slice(m);
            }
        }
        let words = gpu.uninit::<u32>(host.len())?; // written in full by the copy
        let base = gpu.ptr(&words);
        gpu.upload_async_at(base, bytemuck::cast_slice(&host))?;
        let at = firsts.into_iter().map(|f| f.map(|w| base + (w * 4) as u64)).collect();
        Ok(RowMasks { words: Some(words), at })
    }

    /// The device address of row `i`'s masks; `None`: unconstrained.
    fn of(&self, i: usize) -> Option<DPtr> {
        self.at[i]
    }
}

/// One row of an [`InFlight`] step.
struct LandingRow {
    state: StateId,
    /// The row's first token among the step's.
    first_token: usize,
    tokens: usize,
    /// `None`: a prefill chunk that emits nothing.
    draft_len: Option<usize>,
}

impl Runner for CudaRunner {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn device_name(&self) -> String {
        format!("cuda:{} {}", self.gpu.info.ordinal, self.gpu.info.name)
    }

    fn alloc_state(&mut self) -> Result<StateId> {
        let state = DeviceState::new(&self.gpu, &self.model.cfg)?;
        let id = self.insert(state)?;
        self.lead(&Plan::Alloc(id))?;
        Ok(id)
    }

    fn fork_state(&mut self, src: StateId) -> Result<StateId> {
        self.check_settled(src, "forked")?;
        let copy = self.state(src)?.duplicate(&self.gpu, &self.model.cfg)?;
        let id = self.insert(copy)?;
        self.lead(&Plan::Fork { src, dst: id })?;
        if let Some(d) = &mut self.drafter {
            d.fork_state(&self.gpu, src, id)?;
        }
        Ok(id)
    }

    fn free_state(&mut self, id: StateId) -> Result<()> {
        self.check_settled(id, "freed")?;
        if let Some(d) = &mut self.drafter {
            d.remove_state(id);
        }
        self.states.remove(&id).ok_or(KernelError::UnknownState(id.0))?;
        self.lead(&Plan::Free(id))
    }

    fn state_len(&self, id: StateId) -> Result<usize> {
        Ok(self.state(id)?.len)
    }

    /// In a group, what every rank holds together: each rank's shard is the same size (the KDA heads split evenly,
    /// the MLA cache whole on each).
    fn state_bytes(&self, id: StateId) -> Result<usize> {
        let drafter = self.drafter.as_ref().map_or(0, |d| d.state_bytes(id));
        let ranks = self.model.group().map_or(1, |g| g.shard.world);
        Ok(self.state(id)?.bytes(&self.model.cfg) * ranks + drafter)
    }

    fn export_state(&self, id: StateId) -> Result<SeqState> {
        self.check_settled(id, "exported")?;
        let mine = self.state(id)?.export(&self.gpu, &self.model.cfg)?;
        let Some(group) = self.model.group() else { return Ok(mine) };
        self.lead(&Plan::Export(id))?;
        let gathered = group.gather_values(&self.gpu, &kda_shards(&mine))?;
        Ok(join_state(&gathered, &self.cfg, group.shard.world, mine.len, mine.mla))
    }

    fn import_state(&mut self, state: SeqState) -> Result<StateId> {
        state.check_fits(&self.cfg)?;
        let dev = match self.model.group() {
            None => DeviceState::import(&self.gpu, &self.model.cfg, &state)?,
            Some(group) => {
                let (id, len) = (StateId(self.next_id), state.len);
                self.lead(&Plan::Import { id, len })?;
                let values = state_values(&state);
                group.broadcast_values(&self.gpu, Some(&values), state_values_len(&self.cfg, len))?;
                let mine = shard_state(&values, &self.cfg, &group.shard, len)?;
                DeviceState::import(&self.gpu, &self.model.cfg, &mine)?
            }
        };
        self.insert(dev)
    }

    fn step(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>> {
        self.step_with_trace(rows, None)
    }

    fn step_masked(&mut self, rows: &[RowInput], masks: &mut dyn MaskSource) -> Result<Vec<RowOutput>> {
        self.step_now(rows, StepOptions::default(), Some(masks))
    }

    fn launches_ahead(&self) -> bool {
        self.model.group().is_none()
    }

    fn launch(&mut self, rows: &[RowInput]) -> Result<()> {
        self.launch_now(rows, None)
    }

    fn launch_masked(&mut self, rows: &[RowInput], masks: &mut dyn MaskSource) -> Result<()> {
        self.launch_now(rows, Some(masks))
    }

    fn launch_fed(&mut self, rows: &[FedRow]) -> Result<()> {
        self.check_launches()?;
        let last = self.in_flight.back();
        check_fed(last.map(|f| f.launched.as_slice()), rows)?;
        if self.in_flight.len() >= MAX_IN_FLIGHT {
            return Err(too_many_in_flight());
        }
        let fed = last.map(|f| self.gpu.ptr(&f.emitted));
        // Placeholder ids: the step table's token ids are copied over from `fed` on the device.
        let inputs: Vec<RowInput> = rows
            .iter()
            .map(|r| RowInput {
                state: r.state,
                tokens: vec![0],
                sample: Some(SampleRequest::new(r.params.clone(), 0)),
            })
            .collect();
        self.validate(&inputs, false)?;
        let flight = self.launch_rows(&inputs, StepOptions { fed_tokens: fed, ..StepOptions::default() }, None)?;
        self.in_flight.push_back(flight);
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<RowOutput>> {
        let flight = self
            .in_flight
            .pop_front()
            .ok_or_else(|| KernelError::InvalidInput("collect: no step is in flight".into()))?;
        self.land(flight)
    }

    fn set_token_mask(&mut self, mask: TokenMask) -> Result<()> {
        let vocab = self.model.cfg.vocab_size;
        mask.check_fits(vocab)?;
        self.token_mask = Some(DeviceTokenMask::upload(&self.gpu, &mask)?);
        Ok(())
    }

    /// Uploads the drafter (the target's embedding and lm_head are shared).
    fn attach_drafter(&mut self, source: DrafterSource) -> Result<()> {
        if let Some(g) = self.model.group() {
            return Err(KernelError::InvalidInput(format!(
                "a DSpark drafter is not built for a CUDA group yet (--tensor-parallel-size {}): serve without \
                 --spec dspark, or on one GPU",
                g.shard.world
            )));
        }
        source.config.check_against(&self.model.cfg)?;
        let mut slot = DeviceDrafterSlot::new(DeviceDrafter::load(&self.gpu, source.config, source.weights.as_ref())?);
        for (id, state) in &self.states {
            slot.add_state(&self.gpu, *id, state.len)?;
        }
        self.gpu.synchronize()?;
        self.drafter = Some(slot);
        Ok(())
    }

    fn model_drafter(&mut self) -> Option<Box<dyn Drafter + '_>> {
        let slot = self.drafter.as_mut()?;
        let (gpu, target, states, mask) = (&self.gpu, &self.model, &self.states, self.token_mask.as_ref());
        Some(Box::new(CudaDrafter { slot, gpu, target, states, mask }))
    }
}

/// A CUDA runner's attached drafter lent as the [`Drafter`] capability, with the device, the target's weights,
/// states and token mask borrowed in place.
struct CudaDrafter<'a> {
    slot: &'a mut DeviceDrafterSlot,
    gpu: &'a Gpu,
    target: &'a DeviceModel,
    states: &'a HashMap<StateId, DeviceState>,
    mask: Option<&'a DeviceTokenMask>,
}

impl Drafter for CudaDrafter<'_> {
    fn block_size(&self) -> usize {
        self.slot.model().config().block_size
    }

    fn draft(&mut self, rows: &[DraftRequest]) -> Result<Vec<DraftProposal>> {
        let states = self.states;
        let state_len = |id: StateId| states.get(&id).map(|s| s.len).ok_or(KernelError::UnknownState(id.0));
        let proposals = self.slot.draft(self.gpu, self.target, self.mask, state_len, rows)?;
        self.gpu.synchronize()?;
        Ok(proposals)
    }

    fn select_proposal(&mut self, state: StateId) -> Result<()> {
        self.slot.select(state)
    }
}
