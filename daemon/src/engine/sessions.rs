//! Kept responses (session turns): their token history and their state, in one of three tiers.
//!
//! Invariants:
//! - Every kept response has its full token history (prompt plus output). Its state, when it has
//!   one, holds exactly `history.len() - 1` tokens: the last output token is not in the state (the
//!   runner contract), so a continuation feeds it first.
//! - Tiers: `Device` (a runner state), `Host` (an exported copy, counted against the host budget),
//!   `Dropped` (history only; a continuation rebuilds the state by prefill: correct, only slower).
//! - Kept states are idle: a continuation gets a fork (`Runner::fork_state`) or an import of the
//!   host copy, never the kept state itself, so two requests continuing one response at once each
//!   get their own state and nothing is recomputed. Running states are not in this store, so they
//!   are pinned by construction.
//! - Eviction order is decided by an [`EvictionPolicy`] (LRU today), a separate piece behind a
//!   trait so a think-time-aware policy can replace it. Device pressure moves the policy's victim
//!   to host; host pressure drops the policy's victim.
//! - Complexity: LRU victim choice is O(kept responses in the tier) per eviction.

use std::collections::HashMap;

use sparkd_kernels::state::SeqState;
use sparkd_kernels::{Result, Runner, StateId, TokenId};

use super::types::ResponseId;

/// Chooses which idle kept response to demote next.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// The response was kept or continued.
    fn touched(&mut self, id: &ResponseId);
    /// The response is gone from the store.
    fn removed(&mut self, id: &ResponseId);
    /// The next victim among `candidates`, or `None` when there is none.
    fn victim<'a>(&self, candidates: &[&'a ResponseId]) -> Option<&'a ResponseId>;
}

/// Least recently used first.
#[derive(Debug, Default)]
pub struct LruPolicy {
    clock: u64,
    last_used: HashMap<ResponseId, u64>,
}

impl EvictionPolicy for LruPolicy {
    fn touched(&mut self, id: &ResponseId) {
        self.clock += 1;
        self.last_used.insert(id.clone(), self.clock);
    }

    fn removed(&mut self, id: &ResponseId) {
        self.last_used.remove(id);
    }

    fn victim<'a>(&self, candidates: &[&'a ResponseId]) -> Option<&'a ResponseId> {
        candidates.iter().copied().min_by_key(|id| (self.last_used.get(*id).copied().unwrap_or(0), (*id).clone()))
    }
}

/// Where a kept response's state lives.
#[derive(Debug)]
enum Tier {
    Device { state: StateId, bytes: usize },
    Host { state: SeqState, bytes: usize },
    Dropped,
}

#[derive(Debug)]
struct Kept {
    history: Vec<TokenId>,
    tier: Tier,
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
    /// States dropped (from host, or straight from device when they do not fit on host).
    pub dropped: usize,
}

/// The kept responses and their byte accounting.
#[derive(Debug)]
pub struct SessionStore {
    entries: HashMap<ResponseId, Kept>,
    policy: Box<dyn EvictionPolicy>,
    device_bytes: usize,
    host_bytes: usize,
    host_budget_bytes: usize,
}

impl SessionStore {
    pub fn new(policy: Box<dyn EvictionPolicy>, host_budget_bytes: usize) -> Self {
        SessionStore { entries: HashMap::new(), policy, device_bytes: 0, host_bytes: 0, host_budget_bytes }
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
    /// keeps the history only). Replaces, and frees, an earlier entry of the same id.
    pub fn keep(
        &mut self,
        runner: &mut dyn Runner,
        id: ResponseId,
        history: Vec<TokenId>,
        state: Option<StateId>,
    ) -> Result<()> {
        self.remove(runner, &id)?;
        let tier = match state {
            Some(state) => {
                let bytes = runner.state_bytes(state)?;
                self.device_bytes += bytes;
                Tier::Device { state, bytes }
            }
            None => Tier::Dropped,
        };
        self.policy.touched(&id);
        self.entries.insert(id, Kept { history, tier });
        Ok(())
    }

    /// A new state for a request continuing `id`: a fork of the device state, an import of the host
    /// copy, or `None` when only the history is kept. `Ok(None)` also when `id` is unknown; check
    /// [`SessionStore::history`] first.
    pub fn checkout(&mut self, runner: &mut dyn Runner, id: &ResponseId) -> Result<(Option<StateId>, RestoredFrom)> {
        let Some(kept) = self.entries.get(id) else { return Ok((None, RestoredFrom::Prefill)) };
        let restored = match &kept.tier {
            Tier::Device { state, .. } => (Some(runner.fork_state(*state)?), RestoredFrom::Device),
            Tier::Host { state, .. } => (Some(runner.import_state(state.clone())?), RestoredFrom::Host),
            Tier::Dropped => (None, RestoredFrom::Prefill),
        };
        self.policy.touched(id);
        Ok(restored)
    }

    /// Forgets `id` and frees its state; `Ok(false)` when it was not kept.
    pub fn remove(&mut self, runner: &mut dyn Runner, id: &ResponseId) -> Result<bool> {
        let Some(kept) = self.entries.remove(id) else { return Ok(false) };
        self.policy.removed(id);
        match kept.tier {
            Tier::Device { state, bytes } => {
                self.device_bytes -= bytes;
                runner.free_state(state)?;
            }
            Tier::Host { bytes, .. } => self.host_bytes -= bytes,
            Tier::Dropped => {}
        }
        Ok(true)
    }

    fn candidates(&self, on_device: bool) -> Vec<&ResponseId> {
        self.entries
            .iter()
            .filter(|(_, k)| match k.tier {
                Tier::Device { .. } => on_device,
                Tier::Host { .. } => !on_device,
                Tier::Dropped => false,
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Brings kept device states within `device_budget - live_bytes` (live = running states, pinned)
    /// by moving victims to host, and host copies within the host budget by dropping victims.
    pub fn enforce(&mut self, runner: &mut dyn Runner, live_bytes: usize, device_budget: usize) -> Result<Evictions> {
        let mut done = Evictions::default();
        while live_bytes + self.device_bytes > device_budget {
            let Some(victim) = self.policy.victim(&self.candidates(true)).cloned() else { break };
            let Some(kept) = self.entries.get_mut(&victim) else { break };
            let Tier::Device { state, bytes } = kept.tier else { break };
            let host_copy = runner.export_state(state)?;
            runner.free_state(state)?;
            self.device_bytes -= bytes;
            let host_bytes = host_copy.bytes();
            if host_bytes <= self.host_budget_bytes {
                kept.tier = Tier::Host { state: host_copy, bytes: host_bytes };
                self.host_bytes += host_bytes;
                done.to_host += 1;
            } else {
                kept.tier = Tier::Dropped;
                done.dropped += 1;
            }
        }
        while self.host_bytes > self.host_budget_bytes {
            let Some(victim) = self.policy.victim(&self.candidates(false)).cloned() else { break };
            let Some(kept) = self.entries.get_mut(&victim) else { break };
            if let Tier::Host { bytes, .. } = kept.tier {
                self.host_bytes -= bytes;
            }
            kept.tier = Tier::Dropped;
            done.dropped += 1;
        }
        Ok(done)
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

    /// A state holding `n` tokens, kept with a history of `n + 1` tokens.
    fn keep(store: &mut SessionStore, r: &mut NullRunner, id: &str, n: usize) {
        let s = r.alloc_state().unwrap();
        let tokens: Vec<TokenId> = (0..n as TokenId).map(|t| t + 10).collect();
        r.step(&[RowInput { state: s, tokens: tokens.clone(), sample: None }]).unwrap();
        let mut history = tokens;
        history.push(7);
        store.keep(r, rid(id), history, Some(s)).unwrap();
    }

    #[test]
    fn lru_policy_picks_the_least_recently_touched() {
        let mut lru = LruPolicy::default();
        let (a, b, c) = (rid("a"), rid("b"), rid("c"));
        lru.touched(&a);
        lru.touched(&b);
        lru.touched(&c);
        lru.touched(&a);
        assert_eq!(lru.victim(&[&a, &b, &c]), Some(&b));
        assert_eq!(lru.victim(&[&a, &c]), Some(&c));
        lru.removed(&c);
        assert_eq!(lru.victim(&[]), None);
    }

    #[test]
    fn checkout_forks_so_the_kept_state_is_untouched() {
        let mut r = runner();
        let mut store = SessionStore::new(Box::<LruPolicy>::default(), 1 << 20);
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
        let mut store = SessionStore::new(Box::<LruPolicy>::default(), 300);
        keep(&mut store, &mut r, "old", 10);
        keep(&mut store, &mut r, "mid", 10);
        keep(&mut store, &mut r, "new", 10);
        store.checkout(&mut r, &rid("old")).map(|(s, _)| r.free_state(s.unwrap()).unwrap()).unwrap();
        // Budget: live 40 bytes + one kept 10-token state (40 bytes).
        let done = store.enforce(&mut r, 40, 80).unwrap();
        assert_eq!(done, Evictions { to_host: 2, dropped: 1 });
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
