//! [`ShardedCpuRunner`]: the `Runner` contract on the CPU reference forward sharded over `N` in-process
//! ranks (tensor parallelism, optionally expert parallelism for the routed experts), one thread per rank,
//! each owning its shard's weights and its shards of every sequence state (`cpu::shard` says what each
//! rank holds; shared/reference/k3-architecture.md §6.3 is the source).
//!
//! Invariants:
//! - Rank 0 alone receives work (from this runner, over a channel) and broadcasts each action's
//!   [`Plan`] through the [`Communicator`]; the other ranks act only on what they receive, so every rank
//!   makes the same collectives in the same order and no rank diverges.
//! - A step is validated here, before any rank sees it, with exactly the checks of [`CpuRunner`], so a
//!   rejected step changes nothing. Acceptance runs on rank 0. A step whose sampling rows are all greedy,
//!   without log-probabilities or row masks, needs only each position's argmax: every rank reduces its
//!   vocabulary slice (under its part of the token mask) to one candidate and the candidates decide, ties
//!   to the lowest id (`cpu::vocab`). Any other step gathers the full-vocabulary logits to rank 0 (an
//!   all-gather of `[positions, V / N]` per rank), the one exact way to apply temperature, top-k/top-p,
//!   seeded sampling, draft `q`s, row masks and log-probabilities on the CPU: each logit is the same dot
//!   product as unsharded, so the unsharded rules applied to them give exactly the unsharded tokens. Rank 0
//!   then broadcasts how many tokens each verify window keeps and every rank cuts its state shards back
//!   the same way, so speculation with rollback stays lossless.
//! - A failure inside the group (a rank's error, a rank that exits) takes the whole group down: every
//!   rank's collectives fail, and this runner answers every later call with a device error naming the
//!   first cause; nothing waits forever.
//! - Exported states are whole-model states (the KDA head shards joined, the replicated MLA cache taken
//!   from rank 0), so they import into any runner of the same model, sharded or not.
//! - `state_bytes` counts what the group holds: the KDA state once (split over the ranks) and the
//!   replicated MLA cache once per rank (and a drafter context once).
//! - The DSpark drafter is replicated, not sharded: it runs whole beside rank 0, on the hidden-state taps
//!   rank 0's forward records (full width, identical on every rank) and on a whole-vocabulary copy of the
//!   embedding and lm_head gathered from the ranks once when it is attached, so its drafts and `q` are
//!   exactly the unsharded runner's. Its contexts follow each step's commits as in [`CpuRunner`].
//!
//! [`CpuRunner`]: crate::cpu::CpuRunner

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::acceptance::{self, AcceptanceMode};
use crate::comm::{local_group, Communicator};
use crate::config::ModelConfig;
use crate::cpu::forward::{CpuModel, Probe, WindowRow, WindowUndo};
use crate::cpu::ops::Linear;
use crate::cpu::plan::{Plan, PlanRow};
use crate::cpu::runner::{verify_row, RowVerify};
use crate::cpu::shard::{join_state, kda_shards, shard_state, state_values, state_values_len};
use crate::cpu::vocab::{local_best, resolve};
use crate::dspark::{DrafterModel, DrafterSlot, DrafterSource, TargetHead};
use crate::error::{KernelError, Result};
use crate::launches::{SyncLaunches, SyncStepper};
use crate::runner::{DraftProposal, DraftRequest, Drafter, RowInput, RowOutput, Runner, StateId, TokenId, TokenMask};
use crate::shard_rule::Shard;
use crate::state::{SeqState, MLA_BLOCK_TOKENS};
use crate::tensor::WeightSource;

/// How a sharded CPU runner splits the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelConfig {
    /// Ranks (`--tensor-parallel-size`).
    pub tensor_parallel: usize,
    /// Routed experts placed whole on ranks (`--expert-parallel`) instead of split by width.
    pub expert_parallel: bool,
}

/// A step as rank 0 receives it: the rows with everything acceptance needs.
struct StepWork {
    rows: Vec<RowInput>,
    acceptance: AcceptanceMode,
    token_mask: Option<Arc<TokenMask>>,
    /// Target layers whose hidden states the drafter reads (empty without a drafter).
    tap_layers: Vec<usize>,
    /// Per row, the draft distributions `q` of its selected model draft, if any.
    draft_q: Vec<Option<Vec<f32>>>,
}

/// What this runner asks of rank 0.
enum Request {
    Plain(Plan),
    Step(StepWork),
    Export(StateId),
    Import(StateId, SeqState),
    /// The whole-vocabulary embedding and lm_head, for a drafter.
    Head,
}

/// Rank 0's answer.
enum Reply {
    Done,
    /// A step's outputs (or the error that stopped its acceptance), with every row's committed length
    /// afterwards, which holds either way, and the taps of every token of the step (`[tokens, d]` per tap
    /// layer, rows in order).
    Step {
        outputs: Result<Vec<RowOutput>>,
        lens: Vec<usize>,
        taps: Vec<Vec<f32>>,
    },
    State(SeqState),
    /// `[V, d]` each.
    Head {
        embed: Vec<f32>,
        lm_head: Vec<f32>,
    },
}

/// The CPU backend over an in-process tensor-parallel group.
pub struct ShardedCpuRunner {
    cfg: ModelConfig,
    parallel: ParallelConfig,
    to_lead: Sender<Request>,
    from_lead: Receiver<Result<Reply>>,
    ranks: Vec<JoinHandle<()>>,
    /// Committed tokens of every state the group holds.
    lens: HashMap<StateId, usize>,
    next_id: u64,
    acceptance: AcceptanceMode,
    token_mask: Option<Arc<TokenMask>>,
    launches: SyncLaunches,
    /// The attached DSpark drafter, with the whole-vocabulary embedding `[V, d]` and lm_head it reads.
    drafter: Option<(DrafterSlot, Vec<f32>, Linear<f32>)>,
    /// Why the group went down, once it has.
    down: RefCell<Option<String>>,
}

impl ShardedCpuRunner {
    /// Loads every rank's shard of `cfg` from `source` and starts the ranks. A group size that does not
    /// divide the model's heads, widths, experts or vocabulary is an error naming the flag.
    pub fn new(cfg: ModelConfig, source: &dyn WeightSource, parallel: ParallelConfig) -> Result<Self> {
        let world = parallel.tensor_parallel;
        Shard::check(&cfg, world, parallel.expert_parallel)?;
        let mut models = Vec::with_capacity(world);
        for rank in 0..world {
            let shard = Shard { rank, world, expert_parallel: parallel.expert_parallel };
            models.push(CpuModel::<f32>::load_shard(&cfg, source, shard)?);
        }
        let (to_lead, lead_inbox) = channel();
        let (lead_outbox, from_lead) = channel();
        let mut inbox = Some((lead_inbox, lead_outbox));
        let mut ranks = Vec::with_capacity(world);
        for ((rank, model), comm) in models.into_iter().enumerate().zip(local_group(world, None)?) {
            let shard = Shard { rank, world, expert_parallel: parallel.expert_parallel };
            let member = Member {
                whole: cfg.clone(),
                shard,
                model,
                comm: Box::new(comm),
                states: HashMap::new(),
                undo: Vec::new(),
                masked: Vec::new(),
            };
            let lead = if rank == 0 { inbox.take() } else { None };
            let handle = std::thread::Builder::new()
                .name(format!("sparkd-tp-rank{rank}"))
                .spawn(move || match lead {
                    Some((requests, replies)) => member.lead(requests, replies),
                    None => member.follow(),
                })
                .map_err(|e| KernelError::Device(format!("cannot start tensor-parallel rank {rank}: {e}")))?;
            ranks.push(handle);
        }
        Ok(ShardedCpuRunner {
            cfg,
            parallel,
            to_lead,
            from_lead,
            ranks,
            lens: HashMap::new(),
            next_id: 1,
            acceptance: AcceptanceMode::Standard,
            token_mask: None,
            launches: SyncLaunches::default(),
            drafter: None,
            down: RefCell::new(None),
        })
    }

    /// Switches between the lossless acceptance rule and forced acceptance (benchmarks only).
    pub fn set_acceptance(&mut self, mode: AcceptanceMode) {
        self.acceptance = mode;
    }

    /// Sends one request to rank 0 and waits for its answer; a device error takes the runner down.
    fn call(&self, request: Request) -> Result<Reply> {
        if let Some(reason) = self.down.borrow().as_ref() {
            return Err(KernelError::Device(format!("the tensor-parallel group is down: {reason}")));
        }
        let reply = self
            .to_lead
            .send(request)
            .map_err(|_| KernelError::Device("tensor-parallel rank 0 has exited".into()))
            .and_then(|()| {
                self.from_lead.recv().map_err(|_| KernelError::Device("tensor-parallel rank 0 has exited".into()))?
            });
        if let Err(KernelError::Device(reason)) = &reply {
            *self.down.borrow_mut() = Some(reason.clone());
        }
        reply
    }

    fn len(&self, id: StateId) -> Result<usize> {
        self.lens.get(&id).copied().ok_or(KernelError::UnknownState(id.0))
    }

    fn fresh_id(&mut self) -> StateId {
        let id = StateId(self.next_id);
        self.next_id += 1;
        id
    }

    /// Records a state the group now holds, with an empty drafter context at its length.
    fn insert(&mut self, id: StateId, len: usize) {
        self.lens.insert(id, len);
        if let Some((slot, _, _)) = &mut self.drafter {
            slot.add_state(id, len);
        }
    }

    /// Checks a step's rows (as [`CpuRunner`](crate::cpu::CpuRunner) does) before any rank sees them.
    fn validate(&self, rows: &[RowInput]) -> Result<()> {
        crate::runner::check_rows(rows, self.cfg.vocab_size, |id| self.lens.contains_key(&id))?;
        if let Some((slot, _, _)) = &self.drafter {
            for row in rows {
                slot.check_row(row, self.len(row.state)?)?;
            }
        }
        Ok(())
    }
}

impl Drop for ShardedCpuRunner {
    fn drop(&mut self) {
        // Rank 0 broadcasts the shutdown; a group already down has nobody left to tell, and its ranks
        // have exited or are exiting.
        if self.down.borrow().is_none() {
            let _ = self.call(Request::Plain(Plan::Shutdown));
        }
        for rank in self.ranks.drain(..) {
            let _ = rank.join();
        }
    }
}

impl Runner for ShardedCpuRunner {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn device_name(&self) -> String {
        let ep = if self.parallel.expert_parallel { " ep" } else { "" };
        format!("cpu tp{}{ep}", self.parallel.tensor_parallel)
    }

    fn alloc_state(&mut self) -> Result<StateId> {
        let id = self.fresh_id();
        self.call(Request::Plain(Plan::Alloc(id)))?;
        self.insert(id, 0);
        Ok(id)
    }

    fn fork_state(&mut self, src: StateId) -> Result<StateId> {
        self.launches.check_settled(src, "forked")?;
        let len = self.len(src)?;
        let dst = self.fresh_id();
        self.call(Request::Plain(Plan::Fork { src, dst }))?;
        self.lens.insert(dst, len);
        if let Some((slot, _, _)) = &mut self.drafter {
            slot.fork_state(src, dst)?;
        }
        Ok(dst)
    }

    fn free_state(&mut self, id: StateId) -> Result<()> {
        self.launches.check_settled(id, "freed")?;
        self.len(id)?;
        self.call(Request::Plain(Plan::Free(id)))?;
        self.lens.remove(&id);
        if let Some((slot, _, _)) = &mut self.drafter {
            slot.remove_state(id);
        }
        Ok(())
    }

    fn state_len(&self, id: StateId) -> Result<usize> {
        self.len(id)
    }

    fn state_bytes(&self, id: StateId) -> Result<usize> {
        let len = self.len(id)?;
        let kda = SeqState::<f32>::new(&self.cfg).bytes();
        let mla_layers = SeqState::<f32>::new(&self.cfg).mla.len();
        let mla = mla_layers * len.div_ceil(MLA_BLOCK_TOKENS) * MLA_BLOCK_TOKENS * self.cfg.mla.latent_dim() * 4;
        let drafter = self.drafter.as_ref().map_or(0, |(slot, _, _)| slot.state_bytes(id));
        Ok(kda + self.parallel.tensor_parallel * mla + drafter)
    }

    fn export_state(&self, id: StateId) -> Result<SeqState> {
        self.launches.check_settled(id, "exported")?;
        self.len(id)?;
        match self.call(Request::Export(id))? {
            Reply::State(state) => Ok(state),
            _ => Err(KernelError::Device("rank 0 answered an export with something else".into())),
        }
    }

    fn import_state(&mut self, state: SeqState) -> Result<StateId> {
        state.check_fits(&self.cfg)?;
        let id = self.fresh_id();
        let len = state.len;
        self.call(Request::Import(id, state))?;
        self.insert(id, len);
        Ok(id)
    }

    fn set_token_mask(&mut self, mask: TokenMask) -> Result<()> {
        mask.check_fits(self.cfg.vocab_size)?;
        let masked = (0..self.cfg.vocab_size as TokenId).filter(|id| !mask.is_allowed(*id)).collect();
        self.call(Request::Plain(Plan::TokenMask(masked)))?;
        self.token_mask = Some(Arc::new(mask));
        Ok(())
    }

    crate::sync_stepper_runner_methods!();

    fn attach_drafter(&mut self, source: DrafterSource) -> Result<()> {
        let model = DrafterModel::load(source.config, &self.cfg, source.weights.as_ref())?;
        let (embed, lm_head) = match self.drafter.take() {
            Some((_, embed, lm_head)) => (embed, lm_head),
            None => match self.call(Request::Head)? {
                Reply::Head { embed, lm_head } => {
                    let (vocab, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
                    (embed, Linear::new(vocab, d, lm_head))
                }
                _ => return Err(KernelError::Device("rank 0 answered a head request with something else".into())),
            },
        };
        let mut slot = DrafterSlot::new(model);
        for (id, len) in &self.lens {
            slot.add_state(*id, *len);
        }
        self.drafter = Some((slot, embed, lm_head));
        Ok(())
    }

    fn model_drafter(&mut self) -> Option<Box<dyn Drafter + '_>> {
        let (slot, embed, lm_head) = self.drafter.as_mut()?;
        Some(Box::new(ShardedDrafter {
            slot,
            head: TargetHead { embed, lm_head },
            lens: &self.lens,
            mask: self.token_mask.as_deref(),
        }))
    }
}

/// A sharded runner's drafter lent as the [`Drafter`] capability, with the gathered head, the committed
/// lengths and the token mask borrowed in place.
struct ShardedDrafter<'a> {
    slot: &'a mut DrafterSlot,
    head: TargetHead<'a, f32>,
    lens: &'a HashMap<StateId, usize>,
    mask: Option<&'a TokenMask>,
}

impl Drafter for ShardedDrafter<'_> {
    fn block_size(&self) -> usize {
        self.slot.model().config().block_size
    }

    fn draft(&mut self, rows: &[DraftRequest]) -> Result<Vec<DraftProposal>> {
        let lens = self.lens;
        let state_len = |id: StateId| lens.get(&id).copied().ok_or(KernelError::UnknownState(id.0));
        self.slot.draft(self.head, state_len, self.mask, rows)
    }

    fn select_proposal(&mut self, state: StateId) -> Result<()> {
        self.slot.select(state)
    }
}

impl SyncStepper for ShardedCpuRunner {
    fn launches(&mut self) -> &mut SyncLaunches {
        &mut self.launches
    }

    fn step_now(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>> {
        self.validate(rows)?;
        // Each row's selected model draft is verified against its `q`; a step drops every row's proposal.
        let draft_q = rows
            .iter()
            .map(|row| {
                let (slot, _, _) = self.drafter.as_mut()?;
                slot.take_selected(row.state, row.sample.as_ref().map_or(0, |s| s.draft_len))
            })
            .collect();
        let tap_layers = self.drafter.as_ref().map(|(slot, _, _)| slot.tap_layers().to_vec()).unwrap_or_default();
        let work = StepWork {
            rows: rows.to_vec(),
            acceptance: self.acceptance.clone(),
            token_mask: self.token_mask.clone(),
            tap_layers,
            draft_q,
        };
        let Reply::Step { outputs, lens, taps } = self.call(Request::Step(work))? else {
            return Err(KernelError::Device("rank 0 answered a step with something else".into()));
        };
        let d = self.cfg.hidden_size;
        let mut first = 0; // the row's first token among all the step's tokens
        for (row, len) in rows.iter().zip(lens) {
            let committed = len - self.len(row.state)?;
            if let Some((slot, _, _)) = &mut self.drafter {
                let row_taps: Vec<&[f32]> = taps.iter().map(|t| &t[first * d..(first + committed) * d]).collect();
                slot.commit(row.state, &row_taps)?;
            }
            first += row.tokens.len();
            self.lens.insert(row.state, len);
        }
        outputs
    }
}

/// One rank: its shard of the model, its shards of every state, and its handle on the group.
struct Member {
    /// The whole model's config (states are exported and imported whole).
    whole: ModelConfig,
    shard: Shard,
    model: CpuModel<f32>,
    comm: Box<dyn Communicator>,
    states: HashMap<StateId, SeqState<f32>>,
    /// The undo records of the last forward's verify windows.
    undo: Vec<(StateId, WindowUndo<f32>)>,
    /// The masked ids of the runner's token mask in this rank's vocabulary slice, as indices into it.
    masked: Vec<usize>,
}

impl Member {
    /// Rank 0: takes requests, broadcasts each one's plan, runs it, answers. Exits on shutdown or on a
    /// device error (which the group's other ranks then see as the group going down).
    fn lead(mut self, requests: Receiver<Request>, replies: Sender<Result<Reply>>) {
        for request in requests {
            let shutdown = matches!(request, Request::Plain(Plan::Shutdown));
            let reply = self.serve(request);
            let fatal = match &reply {
                Err(e @ KernelError::Device(_)) => {
                    self.comm.abort(&e.to_string());
                    true
                }
                _ => false,
            };
            if replies.send(reply).is_err() || fatal || shutdown {
                return;
            }
        }
    }

    /// Ranks 1..N: act on each plan rank 0 broadcasts until shutdown or the group goes down.
    fn follow(mut self) {
        loop {
            let plan = match self.comm.broadcast_message(0, &[]).and_then(|b| Plan::decode(&b)) {
                Ok(plan) => plan,
                Err(_) => return,
            };
            let result = match &plan {
                Plan::Shutdown => return,
                Plan::Import { id, len } => self.import(*id, *len, None),
                _ => self.act(&plan).map(|_| ()),
            };
            if let Err(e) = result {
                self.comm.abort(&format!("rank {}: {e}", self.shard.rank));
                return;
            }
        }
    }

    fn broadcast(&self, plan: &Plan) -> Result<()> {
        self.comm.broadcast_message(0, &plan.encode()).map(|_| ())
    }

    fn serve(&mut self, request: Request) -> Result<Reply> {
        match request {
            Request::Plain(plan) => {
                self.broadcast(&plan)?;
                self.act(&plan)?;
                Ok(Reply::Done)
            }
            Request::Export(id) => {
                let plan = Plan::Export(id);
                self.broadcast(&plan)?;
                match self.act(&plan)? {
                    Some(state) => Ok(Reply::State(state)),
                    None => Err(KernelError::Device("an export gathered nothing".into())),
                }
            }
            Request::Import(id, state) => {
                self.broadcast(&Plan::Import { id, len: state.len })?;
                self.import(id, state.len, Some(&state))?;
                Ok(Reply::Done)
            }
            Request::Step(work) => self.step(work),
            Request::Head => {
                self.broadcast(&Plan::GatherHead)?;
                self.gather_head()
            }
        }
    }

    fn state(&self, id: StateId) -> Result<&SeqState<f32>> {
        self.states.get(&id).ok_or_else(|| KernelError::Device(format!("rank {} has no {id}", self.shard.rank)))
    }

    /// Runs a plan every rank runs alike (an export returns the whole state on rank 0).
    fn act(&mut self, plan: &Plan) -> Result<Option<SeqState>> {
        match plan {
            Plan::Alloc(id) => {
                self.states.insert(*id, SeqState::new(&self.model.cfg));
            }
            Plan::Fork { src, dst } => {
                let copy = self.state(*src)?.clone();
                self.states.insert(*dst, copy);
            }
            Plan::Free(id) => {
                self.states.remove(id);
            }
            Plan::Forward { rows, argmax } => {
                let local = self.forward(rows, &mut Probe::default())?;
                if *argmax {
                    self.gather_argmax(local)?;
                } else {
                    self.gather_logits(rows, &local)?;
                }
            }
            Plan::TokenMask(ids) => {
                let w = &self.model.weights;
                let held = w.vocab_start..w.vocab_start + w.lm_head.out_dim;
                self.masked = ids
                    .iter()
                    .map(|id| *id as usize)
                    .filter(|id| held.contains(id))
                    .map(|id| id - held.start)
                    .collect();
            }
            Plan::Commit(commits) => self.commit(commits)?,
            Plan::Export(id) => return self.export(*id),
            Plan::GatherHead => {
                self.gather_head()?;
            }
            Plan::Import { .. } | Plan::Shutdown => {}
        }
        Ok(None)
    }

    /// Runs the windows over this rank's shards, keeps their undo records, and returns this rank's logits
    /// `[positions, V / N]` (every row's, in order).
    fn forward(&mut self, plan: &[PlanRow], probe: &mut Probe<f32>) -> Result<Vec<f32>> {
        self.undo.clear();
        if let Some(row) = plan.iter().find(|r| !self.states.contains_key(&r.state)) {
            return Err(KernelError::Device(format!("rank {} has no {}", self.shard.rank, row.state)));
        }
        // Present and distinct (the runner checked the step).
        let mut states: Vec<SeqState<f32>> = plan.iter().filter_map(|r| self.states.remove(&r.state)).collect();
        let mut windows: Vec<WindowRow<f32>> = states
            .iter_mut()
            .zip(plan)
            .map(|(state, row)| WindowRow {
                state,
                tokens: &row.tokens,
                logits_from: row.logits_from,
                snapshots_from: row.snapshots_from,
            })
            .collect();
        let result = self.model.forward_reduced(&mut windows, probe, self.comm.as_ref());
        drop(windows);
        for (row, state) in plan.iter().zip(states) {
            self.states.insert(row.state, state);
        }
        let mut local = Vec::new();
        for (row, out) in plan.iter().zip(result?) {
            if let Some(undo) = out.undo {
                self.undo.push((row.state, undo));
            }
            local.extend(out.logits);
        }
        Ok(local)
    }

    /// Gathers every rank's logits (all ranks call this); rank 0 returns each row's whole-vocabulary logits
    /// `[positions, V]`, the others nothing.
    fn gather_logits(&self, plan: &[PlanRow], local: &[f32]) -> Result<Vec<Vec<f32>>> {
        let slice = self.model.weights.lm_head.out_dim; // V / N
        let positions = local.len() / slice;
        let world = self.shard.world;
        let mut gathered = vec![0f32; local.len() * world]; // [N, positions, V / N]
        self.comm.all_gather(local, &mut gathered)?;
        if self.shard.rank != 0 {
            return Ok(Vec::new());
        }
        let mut logits = Vec::with_capacity(plan.len());
        let mut first = 0;
        for row in plan {
            let count = row.tokens.len() - row.logits_from;
            let mut full = Vec::with_capacity(count * slice * world); // [count, V]
            for p in first..first + count {
                for r in 0..world {
                    let at = (r * positions + p) * slice;
                    full.extend_from_slice(&gathered[at..at + slice]);
                }
            }
            logits.push(full);
            first += count;
        }
        Ok(logits)
    }

    /// Each position's greedy choice under the token mask, from every rank's candidate (all ranks call this):
    /// `[positions]`, or the message of the position's argmax error.
    fn gather_argmax(&self, mut local: Vec<f32>) -> Result<Vec<std::result::Result<TokenId, String>>> {
        let slice = self.model.weights.lm_head.out_dim; // V / N
        for row in local.chunks_exact_mut(slice) {
            for i in &self.masked {
                row[*i] = f32::NEG_INFINITY;
            }
        }
        let mine = local_best(&local, slice, self.model.weights.vocab_start); // [positions, CANDIDATE]
        let mut gathered = vec![0f32; mine.len() * self.shard.world]; // [N, positions, CANDIDATE]
        self.comm.all_gather(&mine, &mut gathered)?;
        Ok(resolve(&gathered, self.shard.world, local.len() / slice))
    }

    /// Cuts the listed windows of the last forward back to their accepted prefixes.
    fn commit(&mut self, commits: &[(StateId, usize)]) -> Result<()> {
        let mut undo: HashMap<StateId, WindowUndo<f32>> = self.undo.drain(..).collect();
        for (id, m) in commits {
            let record =
                undo.remove(id).ok_or_else(|| KernelError::Device(format!("no verify window of {id} to cut")))?;
            let state = self.states.get_mut(id).ok_or_else(|| KernelError::Device(format!("rank has no {id}")))?;
            record.commit(state, *m)?;
        }
        Ok(())
    }

    /// Rank 0's step: broadcast the windows, run them, accept on the gathered logits, broadcast the cuts.
    fn step(&mut self, work: StepWork) -> Result<Reply> {
        let plan: Vec<PlanRow> = work
            .rows
            .iter()
            .map(|row| {
                let (logits_from, snapshots_from) = row.window_bounds();
                PlanRow { state: row.state, tokens: row.tokens.clone(), logits_from, snapshots_from }
            })
            .collect();
        let starts: Vec<usize> = work.rows.iter().map(|r| self.state(r.state).map(|s| s.len)).collect::<Result<_>>()?;
        // Greedy rows without log-probabilities or row masks need only each position's argmax (`cpu::vocab`).
        let argmax = matches!(work.acceptance, AcceptanceMode::Standard)
            && work
                .rows
                .iter()
                .filter_map(|r| r.sample.as_ref())
                .all(|s| s.params.is_greedy() && s.params.logprobs.is_none() && s.masks.is_empty());
        self.broadcast(&Plan::Forward { rows: plan.clone(), argmax })?;
        let mut probe = Probe { tap_layers: work.tap_layers.clone(), ..Probe::default() };
        let local = self.forward(&plan, &mut probe)?;
        let (choices, mut logits) = if argmax {
            (self.gather_argmax(local)?, Vec::new())
        } else {
            (Vec::new(), self.gather_logits(&plan, &local)?)
        };
        let vocab = self.whole.vocab_size;
        let mut outputs = Vec::with_capacity(work.rows.len());
        let mut commits = Vec::new();
        let mut failure = None;
        let mut first = 0; // the row's first logits position among the step's
        for (i, ((row, start), q)) in work.rows.iter().zip(starts).zip(&work.draft_q).enumerate() {
            let Some(sample) = &row.sample else {
                outputs.push(RowOutput::default());
                continue;
            };
            let t = row.tokens.len();
            let drafts = &row.tokens[t - sample.draft_len..];
            let verdict = if argmax {
                let row_choices = &choices[first..first + sample.draft_len + 1];
                acceptance::greedy_tokens(drafts, |p| row_choices[p].clone().map_err(KernelError::InvalidInput))
                    .map(|tokens| RowOutput { num_accepted: tokens.len() - 1, tokens, logprobs: Vec::new() })
            } else {
                let row = RowVerify {
                    logits: &mut logits[i],
                    vocab,
                    token_mask: work.token_mask.as_deref(),
                    sample,
                    drafts,
                    draft_q: q.as_deref(),
                    first_position: (start + t - sample.draft_len) as u64,
                };
                verify_row(row, &work.acceptance).map(RowOutput::from)
            };
            first += sample.draft_len + 1;
            match verdict {
                Ok(out) => {
                    if sample.draft_len > 0 {
                        commits.push((row.state, t - sample.draft_len + out.num_accepted));
                    }
                    outputs.push(out);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let cut = Plan::Commit(commits);
        self.broadcast(&cut)?;
        self.act(&cut)?;
        let lens = work.rows.iter().map(|r| self.state(r.state).map(|s| s.len)).collect::<Result<_>>()?;
        Ok(Reply::Step { outputs: failure.map_or(Ok(outputs), Err), lens, taps: probe.taps })
    }

    /// Gathers every rank's vocabulary rows of the embedding and lm_head (all ranks call this); rank 0
    /// answers with the whole `[V, d]` of each.
    fn gather_head(&self) -> Result<Reply> {
        let w = &self.model.weights;
        let world = self.shard.world;
        let mut embed = vec![0f32; w.embed.len() * world];
        self.comm.all_gather(&w.embed, &mut embed)?;
        let mut lm_head = vec![0f32; w.lm_head.w.len() * world];
        self.comm.all_gather(&w.lm_head.w, &mut lm_head)?;
        Ok(Reply::Head { embed, lm_head })
    }

    /// Gathers every rank's KDA shards of `id` (all ranks call this); rank 0 returns the whole state.
    fn export(&mut self, id: StateId) -> Result<Option<SeqState>> {
        let state = self.state(id)?;
        let local = kda_shards(state);
        let mut gathered = vec![0f32; local.len() * self.shard.world]; // [N, local]
        self.comm.all_gather(&local, &mut gathered)?;
        if self.shard.rank != 0 {
            return Ok(None);
        }
        Ok(Some(join_state(&gathered, &self.whole, self.shard.world, state.len, state.mla.clone())))
    }

    /// Installs a whole state of `len` tokens under `id`: rank 0 (which has it) broadcasts its values, every
    /// rank keeps its KDA head shards and the whole MLA cache.
    fn import(&mut self, id: StateId, len: usize, whole: Option<&SeqState>) -> Result<()> {
        let mut values = match whole {
            Some(s) => state_values(s),
            None => vec![0f32; state_values_len(&self.whole, len)],
        };
        self.comm.broadcast(0, &mut values)?;
        let state = shard_state(&values, &self.whole, &self.shard, len)?;
        self.states.insert(id, state);
        Ok(())
    }
}
