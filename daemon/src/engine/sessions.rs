//! Kept responses (session turns): the one owner of each one's token history, state and stored
//! record, bounded by a byte budget.
//!
//! Invariants:
//! - Every kept response has its full token history (prompt plus output). Its state, when it has
//!   one, holds exactly `history.len() - 1` tokens: the last output token is not in the state (the
//!   runner contract), so a continuation feeds it first.
//! - Tiers: `Device` (a runner state), `Host` (an exported copy, counted against the host budget),
//!   `Dropped` (history only; a continuation rebuilds the state by prefill: correct, only slower).
//! - A kept response may carry a record: the API's rendering of it (what
//!   `GET /v1/responses/{id}` returns), opaque bytes here, attached once the response has ended.
//! - Budget: every byte a kept response holds (its state in whichever tier, its history, its
//!   record, its id, its summary in the view) counts in [`SessionStore::held_bytes`]; beyond
//!   [`StoreBudgets::total_bytes`], or past [`StoreBudgets::max_entries`] of them, the lowest-ranked
//!   responses are removed entirely (state, history and record), so continuing one is continuing an
//!   unknown id.
//! - Kept states are idle: a continuation gets a fork (`Runner::fork_state`) or an import of the
//!   host copy, never the kept state itself, so two requests continuing one response at once each
//!   get their own state and nothing is recomputed. Running states are not in this store, so they
//!   are pinned by construction.
//! - Eviction order: an [`EvictionPolicy`] ranks a response whenever it is kept or continued (LRU
//!   today: a clock), a separate piece behind a trait so a think-time-aware policy can replace it.
//!   The lowest rank goes first everywhere: device pressure moves it to host, host pressure drops
//!   its state, the total budget removes it.
//! - Complexity: ranks are indexed in ordered sets (all entries, device tier, host tier), so keep,
//!   continue, remove and each eviction are O(log n) in the number of kept responses; nothing scans
//!   the store.
//! - With removals tracked (a session journal), every removal is reported once by
//!   [`SessionStore::take_removed`], so the journal forgets what the store forgot.
//! - The API reads kept responses through a [`KeptView`] (a concurrent map of [`KeptSummary`]s),
//!   never by asking the engine thread. The view is written only by the engine thread, inside this
//!   store, in the same call that changes the store (keep, record, remove: by delete or by the
//!   budget), so after every store call it holds exactly the store's entries. Tier moves and rank
//!   changes do not change a summary and leave the view alone. Each summary's bytes count in the
//!   budget.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use sparkd_kernels::state::SeqState;
use sparkd_kernels::{Result, Runner, StateId, TokenId};

use super::types::ResponseId;

/// Ranks kept responses for eviction.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// The rank of `id`, which was just kept or continued. Among idle kept responses the lowest rank
    /// is evicted first (ties by id); a rank holds until the response is touched again.
    fn rank(&mut self, id: &ResponseId) -> u64;
}

/// Least recently used first: the rank is a clock that ticks on every touch.
#[derive(Debug, Default)]
pub struct LruPolicy {
    clock: u64,
}

impl EvictionPolicy for LruPolicy {
    fn rank(&mut self, _id: &ResponseId) -> u64 {
        self.clock += 1;
        self.clock
    }
}

/// A place in an eviction order (lowest first).
type Slot = (u64, ResponseId);

/// What the API reads of one kept response: enough to render and check a continuation, and what
/// `GET /v1/responses/{id}` returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptSummary {
    /// The last token of its history (decides whether a continuation starts with `<|im_end|>`);
    /// `None` only for an empty history, which the engine never keeps.
    pub last_token: Option<TokenId>,
    /// Tokens in its history (prompt + output), for the context-length check.
    pub len: usize,
    /// The API's rendering of it, once attached (`EngineCommand::RecordResponse`); it shares the
    /// store's buffer.
    pub record: Option<Bytes>,
}

/// Bytes the view spends on one entry besides its id's copy (the record is shared with the store).
const SUMMARY_BYTES: usize = std::mem::size_of::<KeptSummary>();

/// The kept responses as the API reads them, without waiting on the engine thread. Cheap to clone.
///
/// Invariant: written only by the engine thread, in the same [`SessionStore`] call that changes the
/// store (its writers are private to this module), so it holds exactly the store's entries.
#[derive(Clone, Debug)]
pub struct KeptView {
    entries: Arc<DashMap<ResponseId, KeptSummary>>,
}

impl KeptView {
    fn new() -> Self {
        KeptView { entries: Arc::new(DashMap::new()) }
    }

    /// The summary of a kept response; `None` when it is not kept (never, or removed).
    pub fn get(&self, id: &ResponseId) -> Option<KeptSummary> {
        self.entries.get(id).map(|summary| summary.value().clone())
    }

    /// How many responses are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No response is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Inserts or replaces the summary of `id` (kept, or its record attached).
    fn publish(&self, id: ResponseId, kept: &Kept) {
        let summary = KeptSummary {
            last_token: kept.history.last().copied(),
            len: kept.history.len(),
            record: kept.record.clone(),
        };
        self.entries.insert(id, summary);
    }

    /// Removes `id` (deleted, or removed by the budget).
    fn withdraw(&self, id: &ResponseId) {
        self.entries.remove(id);
    }
}

/// Where a kept response's state lives.
#[derive(Debug)]
enum Tier {
    Device { state: StateId, bytes: usize },
    Host { state: SeqState, bytes: usize },
    Dropped,
}

impl Tier {
    fn state_bytes(&self) -> usize {
        match self {
            Tier::Device { bytes, .. } | Tier::Host { bytes, .. } => *bytes,
            Tier::Dropped => 0,
        }
    }
}

#[derive(Debug)]
struct Kept {
    history: Vec<TokenId>,
    tier: Tier,
    record: Option<Bytes>,
    rank: u64,
}

impl Kept {
    /// Every byte this entry holds, its id's and its summary in the view included.
    fn held_bytes(&self, id: &ResponseId) -> usize {
        self.tier.state_bytes()
            + self.history.len() * std::mem::size_of::<TokenId>()
            + self.record.as_ref().map_or(0, Bytes::len)
            + 2 * id.0.len()
            + SUMMARY_BYTES
    }
}

/// Where a continuation's state came from (the `tier` label of `sparkd:sessions_restored_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoredFrom {
    Device,
    Host,
    /// No state was kept: the history is prefilled again.
    Prefill,
}

impl RestoredFrom {
    pub fn as_str(self) -> &'static str {
        match self {
            RestoredFrom::Device => "device",
            RestoredFrom::Host => "host",
            RestoredFrom::Prefill => "prefill",
        }
    }
}

/// What [`SessionStore::enforce`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evictions {
    /// Device states moved to host.
    pub to_host: usize,
    /// States dropped (from host, or straight from device when they do not fit on host); their
    /// histories stay.
    pub dropped: usize,
    /// Kept responses removed entirely (the total budget).
    pub removed: usize,
}

/// The store's byte budgets (the device budget is the engine's, shared with running states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreBudgets {
    /// Host copies of kept states.
    pub host_bytes: usize,
    /// Everything kept responses hold: states in every tier, histories, records.
    pub total_bytes: usize,
    /// Kept responses at most, whatever their bytes.
    pub max_entries: usize,
}

/// The kept responses, their eviction order and their byte accounting.
#[derive(Debug)]
pub struct SessionStore {
    entries: HashMap<ResponseId, Kept>,
    policy: Box<dyn EvictionPolicy>,
    /// Every entry, by rank.
    by_rank: BTreeSet<Slot>,
    /// Entries whose state is on the device, by rank.
    device_by_rank: BTreeSet<Slot>,
    /// Entries whose state is on the host, by rank.
    host_by_rank: BTreeSet<Slot>,
    device_bytes: usize,
    host_bytes: usize,
    held_bytes: usize,
    budgets: StoreBudgets,
    /// What the API reads; written in the same calls that change `entries`.
    view: KeptView,
    /// Ids removed since [`SessionStore::take_removed`], when removals are tracked (a session journal
    /// must forget them).
    removed: Option<Vec<ResponseId>>,
}

impl SessionStore {
    pub fn new(policy: Box<dyn EvictionPolicy>, budgets: StoreBudgets) -> Self {
        SessionStore {
            entries: HashMap::new(),
            policy,
            by_rank: BTreeSet::new(),
            device_by_rank: BTreeSet::new(),
            host_by_rank: BTreeSet::new(),
            device_bytes: 0,
            host_bytes: 0,
            held_bytes: 0,
            budgets,
            view: KeptView::new(),
            removed: None,
        }
    }

    /// Records every removal from now on (deleted, replaced or over a budget) for [`SessionStore::take_removed`].
    pub fn track_removals(&mut self) {
        self.removed.get_or_insert_with(Vec::new);
    }

    /// The ids removed since the last call (none unless tracked).
    pub fn take_removed(&mut self) -> Vec<ResponseId> {
        self.removed.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The API's read-only view of this store.
    pub fn view(&self) -> KeptView {
        self.view.clone()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of kept states on the device.
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }

    /// Bytes of kept states on the host.
    pub fn host_bytes(&self) -> usize {
        self.host_bytes
    }

    /// Every byte kept responses hold (states in every tier, histories, records, ids, their
    /// summaries in the view): what the total budget bounds.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The token history of a kept response.
    pub fn history(&self, id: &ResponseId) -> Option<&[TokenId]> {
        self.entries.get(id).map(|k| k.history.as_slice())
    }

    /// The tier name of a kept response ("device", "host", "dropped"), for tests and logs.
    pub fn tier(&self, id: &ResponseId) -> Option<&'static str> {
        self.entries.get(id).map(|k| match k.tier {
            Tier::Device { .. } => "device",
            Tier::Host { .. } => "host",
            Tier::Dropped => "dropped",
        })
    }

    /// Keeps `history` under `id` with `state` (which must hold `history.len() - 1` tokens; `None`
    /// keeps the history only). Replaces, and frees, an earlier entry of the same id. The budgets
    /// are enforced by [`SessionStore::enforce`].
    pub fn keep(
        &mut self,
        runner: &mut dyn Runner,
        id: ResponseId,
        history: Vec<TokenId>,
        state: Option<StateId>,
    ) -> Result<()> {
        self.remove(runner, &id)?;
        let tier = match state {
            Some(state) => Tier::Device { state, bytes: runner.state_bytes(state)? },
            None => Tier::Dropped,
        };
        let rank = self.policy.rank(&id);
        let kept = Kept { history, tier, record: None, rank };
        self.view.publish(id.clone(), &kept);
        self.attach(id, kept);
        Ok(())
    }

    /// Attaches the API's record to a kept response (replacing an earlier one); `false` when `id`
    /// is not kept (never, or evicted meanwhile).
    pub fn set_record(&mut self, id: &ResponseId, record: Bytes) -> bool {
        let Some(mut kept) = self.detach(id) else { return false };
        kept.record = Some(record);
        self.view.publish(id.clone(), &kept);
        self.attach(id.clone(), kept);
        true
    }

    /// A new state for a request continuing `id`: a fork of the device state, an import of the host
    /// copy, or `None` when only the history is kept. `Ok(None)` also when `id` is unknown; check
    /// [`SessionStore::history`] first. Continuing makes `id` the most recently used.
    pub fn checkout(&mut self, runner: &mut dyn Runner, id: &ResponseId) -> Result<(Option<StateId>, RestoredFrom)> {
        let Some(kept) = self.entries.get(id) else { return Ok((None, RestoredFrom::Prefill)) };
        let restored = match &kept.tier {
            Tier::Device { state, .. } => (Some(runner.fork_state(*state)?), RestoredFrom::Device),
            Tier::Host { state, .. } => (Some(runner.import_state(state.clone())?), RestoredFrom::Host),
            Tier::Dropped => (None, RestoredFrom::Prefill),
        };
        let rank = self.policy.rank(id);
        if let Some(mut kept) = self.detach(id) {
            kept.rank = rank;
            self.attach(id.clone(), kept);
        }
        Ok(restored)
    }

    /// Forgets `id` (state, history and record) and frees its state; `Ok(false)` when it was not
    /// kept. The entry is gone even when freeing its state fails.
    pub fn remove(&mut self, runner: &mut dyn Runner, id: &ResponseId) -> Result<bool> {
        let Some(kept) = self.detach(id) else { return Ok(false) };
        self.view.withdraw(id);
        if let Some(removed) = &mut self.removed {
            removed.push(id.clone());
        }
        if let Tier::Device { state, .. } = kept.tier {
            runner.free_state(state)?;
        }
        Ok(true)
    }

    /// Brings kept device states within `device_budget - live_bytes` (live = running states, pinned)
    /// by moving victims to host, host copies within the host budget by dropping victims' states,
    /// and everything held within the total budget by removing victims entirely.
    pub fn enforce(&mut self, runner: &mut dyn Runner, live_bytes: usize, device_budget: usize) -> Result<Evictions> {
        // Removing first spares a victim a device-to-host copy it would not keep.
        let mut done = Evictions { removed: self.remove_over_budget(runner)?, ..Evictions::default() };
        while live_bytes + self.device_bytes > device_budget {
            let Some((_, victim)) = self.device_by_rank.first().cloned() else { break };
            let Some(Tier::Device { state, .. }) = self.entries.get(&victim).map(|k| &k.tier) else { break };
            let state = *state;
            let host_copy = runner.export_state(state)?;
            let Some(mut kept) = self.detach(&victim) else { break };
            let host_bytes = host_copy.bytes();
            if host_bytes <= self.budgets.host_bytes {
                kept.tier = Tier::Host { state: host_copy, bytes: host_bytes };
                done.to_host += 1;
            } else {
                kept.tier = Tier::Dropped;
                done.dropped += 1;
            }
            self.attach(victim, kept);
            runner.free_state(state)?;
        }
        while self.host_bytes > self.budgets.host_bytes {
            let Some((_, victim)) = self.host_by_rank.first().cloned() else { break };
            let Some(mut kept) = self.detach(&victim) else { break };
            kept.tier = Tier::Dropped;
            self.attach(victim, kept);
            done.dropped += 1;
        }
        done.removed += self.remove_over_budget(runner)?;
        Ok(done)
    }

    /// Removes the lowest-ranked kept responses until what is held fits the total budget and the count bound.
    fn remove_over_budget(&mut self, runner: &mut dyn Runner) -> Result<usize> {
        let mut removed = 0;
        while self.held_bytes > self.budgets.total_bytes || self.entries.len() > self.budgets.max_entries {
            let Some((_, victim)) = self.by_rank.first().cloned() else { break };
            removed += 1;
            self.remove(runner, &victim)?;
        }
        Ok(removed)
    }

    /// Inserts an entry with its rank-order places and its bytes.
    fn attach(&mut self, id: ResponseId, kept: Kept) {
        let slot = (kept.rank, id.clone());
        match kept.tier {
            Tier::Device { bytes, .. } => {
                self.device_bytes += bytes;
                self.device_by_rank.insert(slot.clone());
            }
            Tier::Host { bytes, .. } => {
                self.host_bytes += bytes;
                self.host_by_rank.insert(slot.clone());
            }
            Tier::Dropped => {}
        }
        self.held_bytes += kept.held_bytes(&id);
        self.by_rank.insert(slot);
        self.entries.insert(id, kept);
    }

    /// Takes an entry out with its rank-order places and its bytes (its state is not freed).
    fn detach(&mut self, id: &ResponseId) -> Option<Kept> {
        let kept = self.entries.remove(id)?;
        let slot = (kept.rank, id.clone());
        match kept.tier {
            Tier::Device { bytes, .. } => {
                self.device_bytes -= bytes;
                self.device_by_rank.remove(&slot);
            }
            Tier::Host { bytes, .. } => {
                self.host_bytes -= bytes;
                self.host_by_rank.remove(&slot);
            }
            Tier::Dropped => {}
        }
        self.held_bytes -= kept.held_bytes(id);
        self.by_rank.remove(&slot);
        Some(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparkd_kernels::null_runner::NullRunner;
    use sparkd_kernels::runner::RowInput;
    use sparkd_kernels::ModelConfig;

    fn rid(s: &str) -> ResponseId {
        ResponseId(s.to_string())
    }

    fn runner() -> NullRunner {
        NullRunner::new(ModelConfig::preset("k3-tiny").unwrap())
    }

    fn store(host_bytes: usize, total_bytes: usize) -> SessionStore {
        SessionStore::new(
            Box::<LruPolicy>::default(),
            StoreBudgets { host_bytes, total_bytes, max_entries: usize::MAX },
        )
    }

    /// A state holding `n` tokens, kept with a history of `n + 1` tokens.
    fn keep(store: &mut SessionStore, r: &mut NullRunner, id: &str, n: usize) {
        let s = r.alloc_state().unwrap();
        let tokens: Vec<TokenId> = (0..n as TokenId).map(|t| t + 10).collect();
        r.step(&[RowInput { state: s, tokens: tokens.clone(), sample: None }]).unwrap();
        let mut history = tokens;
        history.push(7);
        store.keep(r, rid(id), history, Some(s)).unwrap();
    }

    /// Continues `id` and frees the continuation's state at once (the request ended).
    fn touch(store: &mut SessionStore, r: &mut NullRunner, id: &str) {
        if let (Some(s), _) = store.checkout(r, &rid(id)).unwrap() {
            r.free_state(s).unwrap();
        }
    }

    /// What a one-letter id kept with a 10-token device state holds: state 10 * 4, history 11 * 4,
    /// the id twice (store and view) and the view's summary.
    const HELD_10: usize = 40 + 44 + 2 + SUMMARY_BYTES;

    #[test]
    fn the_total_budget_removes_the_least_recently_kept_or_continued_first() {
        let mut r = runner();
        let mut store = store(1 << 20, 3 * HELD_10);
        for id in ["a", "b", "c"] {
            keep(&mut store, &mut r, id, 10);
        }
        touch(&mut store, &mut r, "a");
        assert_eq!(store.enforce(&mut r, 0, 1 << 20).unwrap(), Evictions::default(), "three fit");
        keep(&mut store, &mut r, "d", 10);
        assert_eq!(store.enforce(&mut r, 0, 1 << 20).unwrap().removed, 1);
        assert_eq!(store.history(&rid("b")), None, "b was the least recently used");
        keep(&mut store, &mut r, "e", 10);
        store.enforce(&mut r, 0, 1 << 20).unwrap();
        assert_eq!(store.history(&rid("c")), None);
        for id in ["a", "d", "e"] {
            assert!(store.history(&rid(id)).is_some(), "{id} is kept");
        }
        assert_eq!((store.len(), store.held_bytes()), (3, 3 * HELD_10));
        assert_eq!(r.num_states(), 3, "the removed responses' states were freed");
    }

    #[test]
    fn the_count_bound_removes_the_least_recently_used_whatever_their_bytes() {
        let mut r = runner();
        let mut store = SessionStore::new(
            Box::<LruPolicy>::default(),
            StoreBudgets { host_bytes: 1 << 20, total_bytes: 1 << 30, max_entries: 2 },
        );
        for id in ["a", "b"] {
            keep(&mut store, &mut r, id, 10);
        }
        touch(&mut store, &mut r, "a");
        keep(&mut store, &mut r, "c", 10);
        assert_eq!(store.enforce(&mut r, 0, 1 << 20).unwrap().removed, 1);
        assert_eq!(store.history(&rid("b")), None, "b was the least recently used");
        assert_eq!(store.len(), 2);
        assert_eq!(r.num_states(), 2, "the removed response's state was freed");
    }

    #[test]
    fn held_bytes_count_state_history_record_and_id_in_every_tier() {
        let mut r = runner();
        let mut store = store(1 << 20, 1 << 20);
        keep(&mut store, &mut r, "a", 10);
        assert_eq!((store.held_bytes(), store.device_bytes()), (HELD_10, 40));
        assert!(store.set_record(&rid("a"), Bytes::from(vec![b'x'; 100])));
        assert!(store.set_record(&rid("a"), Bytes::from(vec![b'y'; 60])), "a record is replaced");
        assert_eq!(store.held_bytes(), HELD_10 + 60);
        assert!(!store.set_record(&rid("nope"), Bytes::from_static(b"{}")));
        // To host: the host copy is one 64-token MLA block of width 1 (256 bytes).
        assert_eq!(store.enforce(&mut r, 0, 0).unwrap(), Evictions { to_host: 1, ..Evictions::default() });
        assert_eq!((store.device_bytes(), store.host_bytes()), (0, 256));
        assert_eq!(store.held_bytes(), 256 + 44 + 2 + SUMMARY_BYTES + 60);
        let kept = store.view().get(&rid("a")).unwrap();
        assert_eq!((kept.last_token, kept.len, kept.record.as_deref()), (Some(7), 11, Some(&[b'y'; 60][..])));
        assert!(store.remove(&mut r, &rid("a")).unwrap());
        assert!(!store.remove(&mut r, &rid("a")).unwrap(), "deleting twice finds nothing");
        assert_eq!((store.held_bytes(), store.host_bytes(), store.len()), (0, 0, 0));
        assert_eq!(store.view().get(&rid("a")), None);
    }

    #[test]
    fn a_removed_response_is_gone_with_its_history_even_when_only_its_history_was_left() {
        let mut r = runner();
        let mut store = store(0, 1 << 20);
        keep(&mut store, &mut r, "old", 10);
        assert_eq!(store.enforce(&mut r, 0, 0).unwrap().dropped, 1);
        assert_eq!(store.tier(&rid("old")), Some("dropped"));
        assert_eq!(store.held_bytes(), 44 + 2 * 3 + SUMMARY_BYTES, "a dropped response still holds its history");
        store.budgets.total_bytes = 0;
        assert_eq!(store.enforce(&mut r, 0, 1 << 20).unwrap().removed, 1);
        assert_eq!((store.history(&rid("old")), store.tier(&rid("old")), store.held_bytes()), (None, None, 0));
        // A response larger than the whole budget is not kept at all.
        keep(&mut store, &mut r, "big", 10);
        assert_eq!(store.enforce(&mut r, 0, 1 << 20).unwrap().removed, 1);
        assert!(store.is_empty());
        assert_eq!(r.num_states(), 0);
    }

    /// The view's summary of `id` as the store's entry says it should be.
    fn summary_of(store: &SessionStore, id: &str) -> Option<KeptSummary> {
        let kept = store.entries.get(&rid(id))?;
        Some(KeptSummary {
            last_token: kept.history.last().copied(),
            len: kept.history.len(),
            record: kept.record.clone(),
        })
    }

    /// The view holds exactly the store's entries, each summarized as the store holds it.
    fn assert_mirrors(store: &SessionStore, ids: &[&str]) {
        let view = store.view();
        assert_eq!(view.len(), store.len(), "the view has exactly the store's entries");
        for id in ids {
            assert_eq!(view.get(&rid(id)), summary_of(store, id), "{id}");
        }
    }

    #[test]
    fn the_view_mirrors_the_store_through_keep_record_tier_moves_eviction_and_delete() {
        let mut r = runner();
        let ids = ["a", "b", "c", "nope"];
        let mut store = store(300, 1 << 20);
        let view = store.view();
        keep(&mut store, &mut r, "a", 10);
        keep(&mut store, &mut r, "b", 10);
        assert_mirrors(&store, &ids);
        assert_eq!(view.get(&rid("a")), Some(KeptSummary { last_token: Some(7), len: 11, record: None }));
        assert!(store.set_record(&rid("a"), Bytes::from_static(b"{\"id\":\"a\"}")));
        assert!(!store.set_record(&rid("nope"), Bytes::from_static(b"{}")));
        assert_mirrors(&store, &ids);
        assert_eq!(view.get(&rid("a")).unwrap().record.as_deref(), Some(&b"{\"id\":\"a\"}"[..]));
        // Tier moves (to host, dropped) and continuing change no summary.
        touch(&mut store, &mut r, "a");
        assert_eq!(store.enforce(&mut r, 0, 0).unwrap(), Evictions { to_host: 2, dropped: 1, removed: 0 });
        assert_mirrors(&store, &ids);
        assert!(view.get(&rid("a")).is_some() && view.get(&rid("b")).is_some(), "moved and dropped stay visible");
        // A replaced entry shows its new history and has no record yet.
        keep(&mut store, &mut r, "a", 4);
        assert_eq!(view.get(&rid("a")), Some(KeptSummary { last_token: Some(7), len: 5, record: None }));
        assert_mirrors(&store, &ids);
        // The total budget removes the least recently used ("b") from both.
        keep(&mut store, &mut r, "c", 10);
        store.budgets.total_bytes = store.held_bytes() - 1;
        assert_eq!(store.enforce(&mut r, 0, 1 << 20).unwrap().removed, 1);
        assert_eq!(view.get(&rid("b")), None);
        assert_mirrors(&store, &ids);
        assert!(store.remove(&mut r, &rid("a")).unwrap());
        assert_eq!(view.get(&rid("a")), None, "a deleted response leaves the view");
        assert_mirrors(&store, &ids);
        assert_eq!(view.len(), 1);
    }

    #[test]
    fn checkout_forks_so_the_kept_state_is_untouched() {
        let mut r = runner();
        let mut store = store(1 << 20, 1 << 20);
        keep(&mut store, &mut r, "a", 10);
        let (first, from) = store.checkout(&mut r, &rid("a")).unwrap();
        let (second, _) = store.checkout(&mut r, &rid("a")).unwrap();
        let (first, second) = (first.unwrap(), second.unwrap());
        assert_eq!(from, RestoredFrom::Device);
        assert_ne!(first, second);
        r.step(&[RowInput { state: first, tokens: vec![1, 2, 3], sample: None }]).unwrap();
        assert_eq!(r.state_len(first).unwrap(), 13);
        assert_eq!(r.state_len(second).unwrap(), 10);
        assert_eq!(store.device_bytes(), 10 * 4);
        assert_eq!(r.num_states(), 3);
        assert!(store.remove(&mut r, &rid("a")).unwrap());
        assert_eq!((store.device_bytes(), r.num_states()), (0, 2));
    }

    #[test]
    fn pressure_moves_lru_to_host_then_drops_it() {
        let mut r = runner();
        // Host holds one 10-token state (one 64-token MLA block of width 1: 256 bytes), not two.
        let mut store = store(300, 1 << 20);
        keep(&mut store, &mut r, "old", 10);
        keep(&mut store, &mut r, "mid", 10);
        keep(&mut store, &mut r, "new", 10);
        store.checkout(&mut r, &rid("old")).map(|(s, _)| r.free_state(s.unwrap()).unwrap()).unwrap();
        // Budget: live 40 bytes + one kept 10-token state (40 bytes).
        let done = store.enforce(&mut r, 40, 80).unwrap();
        assert_eq!(done, Evictions { to_host: 2, dropped: 1, removed: 0 });
        assert_eq!(store.tier(&rid("old")), Some("device"), "recently continued: kept on device");
        assert_eq!(store.tier(&rid("mid")), Some("dropped"));
        assert_eq!(store.tier(&rid("new")), Some("host"));
        assert_eq!(store.history(&rid("mid")).map(<[TokenId]>::len), Some(11), "history survives a drop");
        let (restored, from) = store.checkout(&mut r, &rid("new")).unwrap();
        assert_eq!(from, RestoredFrom::Host);
        assert_eq!(r.state_len(restored.unwrap()).unwrap(), 10);
        assert_eq!(store.checkout(&mut r, &rid("mid")).unwrap(), (None, RestoredFrom::Prefill));
        assert_eq!(store.checkout(&mut r, &rid("nope")).unwrap(), (None, RestoredFrom::Prefill));
    }
}
