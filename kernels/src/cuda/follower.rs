//! [`Follower`]: a rank other than 0 of a tensor-parallel CUDA group. It holds its shard of the model and of every
//! sequence state and acts only on the plans rank 0 (a `CudaRunner` built by `CudaRunner::sharded`) sends, so every
//! rank makes the same collectives in the same order (`cuda::tp`).
//!
//! Invariants:
//! - A plan is carried out whole or the follower stops with its error: a rank that cannot follow leaves the group
//!   (its communicator goes down with it, and the launch contract's liveness takes the others down), never a
//!   rank that goes on out of step.
//! - The undo records of the last forward are kept until the next plan: a `Commit` cuts the windows it lists back to
//!   their kept tokens exactly as rank 0 does (`DeviceUndo::commit`), and the other windows keep all their tokens.
//! - Exports contribute this rank's KDA shards to rank 0's gather; imports take this rank's shards of the values
//!   rank 0 broadcasts (`cpu::shard`, shared with the CPU's group).

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::cpu::plan::Plan;
use crate::cpu::shard::{kda_shards, shard_state, state_values_len};
use crate::cuda::forward::DeviceModel;
use crate::cuda::gpu::Gpu;
use crate::cuda::ops::Ops;
use crate::cuda::state::{DeviceRow, DeviceState, DeviceUndo};
use crate::cuda::tp::DeviceGroup;
use crate::cuda::weights::DevWeights;
use crate::error::{KernelError, Result};
use crate::runner::StateId;
use crate::tensor::WeightSource;

/// A following rank of a CUDA group: its device, its shard of the model and its shards of the states.
pub struct Follower {
    gpu: Gpu,
    /// The whole model's config (the model's own is this rank's).
    whole: ModelConfig,
    group: DeviceGroup,
    model: DeviceModel,
    states: HashMap<StateId, DeviceState>,
    /// The undo records of the last forward's windows that asked for them.
    undo: Vec<(StateId, DeviceUndo)>,
}

impl Follower {
    /// Rank `group.shard.rank` (not 0) on `gpu` (the device its communicator was formed on), uploading its shard of
    /// every weight of `cfg` (the whole model's config) from `source`.
    pub fn new(gpu: Gpu, cfg: &ModelConfig, source: &dyn WeightSource, group: DeviceGroup) -> Result<Self> {
        if group.shard.rank == 0 {
            return Err(KernelError::InvalidInput("rank 0 of a group leads (CudaRunner::sharded)".into()));
        }
        let ops = Ops::load(&gpu)?;
        let weights = DevWeights::load_shard(&gpu, cfg, source, group.shard)?;
        let model = DeviceModel::sharded(cfg, weights, ops, group.clone())?;
        gpu.synchronize()?;
        Ok(Follower { gpu, whole: cfg.clone(), group, model, states: HashMap::new(), undo: Vec::new() })
    }

    /// Follows rank 0's plans until it ends the group (`Ok`) or a plan cannot be carried out (the error).
    pub fn run(mut self) -> Result<()> {
        loop {
            let plan = self.group.recv_plan(&self.gpu)?;
            if matches!(plan, Plan::Shutdown) {
                return Ok(());
            }
            self.act(plan)?;
        }
    }

    fn missing(&self, id: StateId) -> KernelError {
        KernelError::Device(format!("rank {} has no {id}", self.group.shard.rank))
    }

    fn state(&self, id: StateId) -> Result<&DeviceState> {
        self.states.get(&id).ok_or_else(|| self.missing(id))
    }

    fn act(&mut self, plan: Plan) -> Result<()> {
        let (gpu, cfg) = (&self.gpu, &self.model.cfg);
        match plan {
            Plan::Alloc(id) => {
                self.states.insert(id, DeviceState::new(gpu, cfg)?);
            }
            Plan::Fork { src, dst } => {
                let copy = self.state(src)?.duplicate(gpu, cfg)?;
                self.states.insert(dst, copy);
            }
            Plan::Free(id) => {
                self.states.remove(&id).ok_or_else(|| self.missing(id))?;
            }
            Plan::Forward { rows, .. } => {
                self.undo.clear();
                if let Some(row) = rows.iter().find(|r| !self.states.contains_key(&r.state)) {
                    return Err(self.missing(row.state));
                }
                // Present (checked above) and distinct (rank 0 validated the step); always put back.
                let mut states: Vec<DeviceState> = rows.iter().filter_map(|r| self.states.remove(&r.state)).collect();
                let out = {
                    let mut windows: Vec<DeviceRow> = states
                        .iter_mut()
                        .zip(&rows)
                        .map(|(state, row)| DeviceRow {
                            state,
                            tokens: &row.tokens,
                            logits_from: row.logits_from,
                            snapshots_from: row.snapshots_from,
                        })
                        .collect();
                    self.model.forward(&self.gpu, &mut windows, None)
                };
                for (row, state) in rows.iter().zip(states) {
                    self.states.insert(row.state, state);
                }
                self.undo = rows.iter().zip(out?.undo).filter_map(|(row, u)| Some((row.state, u?))).collect();
            }
            Plan::Commit(cuts) => {
                for (id, undo) in std::mem::take(&mut self.undo) {
                    if let Some((_, keep)) = cuts.iter().find(|(s, _)| *s == id) {
                        let missing = self.missing(id);
                        let state = self.states.get_mut(&id).ok_or(missing)?;
                        undo.commit(&self.gpu, &self.model.cfg, state, *keep)?;
                    }
                }
            }
            Plan::Export(id) => {
                let mine = self.state(id)?.export(gpu, cfg)?;
                self.group.gather_values(&self.gpu, &kda_shards(&mine))?;
            }
            Plan::Import { id, len } => {
                let values = self.group.broadcast_values(&self.gpu, None, state_values_len(&self.whole, len))?;
                let mine = shard_state(&values, &self.whole, &self.group.shard, len)?;
                let state = DeviceState::import(&self.gpu, &self.model.cfg, &mine)?;
                self.states.insert(id, state);
            }
            Plan::TokenMask(_) | Plan::GatherHead | Plan::Shutdown => {
                return Err(KernelError::Device(format!(
                    "a CUDA group's follower got {plan:?}, which rank 0 never sends"
                )));
            }
        }
        Ok(())
    }
}
