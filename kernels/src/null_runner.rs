//! `NullRunner`: a [`Runner`] that does no math, for daemon tests and the daemon's overhead benchmark.
//!
//! Invariants:
//! - A state is its committed token history; the "model" is a pure function of that history: the
//!   next token is a hash of (history, and for sampled requests the seed and position) mapped into
//!   [`NULL_TOKEN_RANGE`], a range of ordinary text ids (no special ids). Greedy is deterministic;
//!   sampling is deterministic per seed. So a state restored by any route (fork, export/import,
//!   re-prefill of the same tokens) continues with the same tokens.
//! - The distribution is a point mass, so a draft is accepted exactly when it equals the token the
//!   runner would emit at that position: an oracle draft is always fully accepted. A constrained row's masks
//!   move the point to an allowed id (chosen by the same hash), so constrained output follows its grammar.
//! - `state_bytes` is `len * bytes_per_token` (default [`NULL_BYTES_PER_TOKEN`]), growing like an
//!   MLA cache.
//! - Export carries the history in one MLA cache of latent width 1 (the token id as an `f32`, exact
//!   below 2^24, which covers every vocabulary here) and no KDA states; import checks that form.
//! - Bad input (unknown state, empty row, a token outside the vocabulary, `draft_len` not below the
//!   row length, one state in two rows) is a `KernelError::InvalidInput`/`UnknownState`, never a panic.

use std::collections::HashMap;
use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::{KernelError, Result};
use crate::launches::{SyncLaunches, SyncStepper};
use crate::runner::{mask_allows, RowInput, RowOutput, Runner, SamplingParams, StateId, TokenId, TokenLogprob};
use crate::state::{MlaCache, SeqState};

/// The ids the NullRunner emits: ordinary BPE text ids, clear of every special token.
pub const NULL_TOKEN_RANGE: Range<TokenId> = 1_000..9_000;

/// Default bytes a NullRunner state reports per committed token.
pub const NULL_BYTES_PER_TOKEN: usize = 4;

/// One sequence: its committed tokens and a running hash of them.
#[derive(Clone, Debug)]
struct NullState {
    tokens: Vec<TokenId>,
    hash: u64,
}

impl NullState {
    fn new() -> Self {
        NullState { tokens: Vec::new(), hash: 0x5350_4152_4b44_4e55 }
    }

    fn push(&mut self, token: TokenId) {
        self.hash = mix(self.hash ^ u64::from(token).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.tokens.push(token);
    }

    /// The token the "model" emits after the current history; under a constraint's `mask`, that token if the
    /// mask allows it, else the allowed id the same hash picks among all the allowed ones (still a point mass).
    fn next_token(&self, params: &SamplingParams, mask: Option<&[u32]>) -> TokenId {
        let h = if params.is_greedy() {
            mix(self.hash)
        } else {
            mix(self.hash ^ mix(params.seed ^ (self.tokens.len() as u64).rotate_left(32)))
        };
        let span = u64::from(NULL_TOKEN_RANGE.end - NULL_TOKEN_RANGE.start);
        let free = NULL_TOKEN_RANGE.start + (h % span) as TokenId;
        let Some(mask) = mask.filter(|m| !mask_allows(m, free)) else { return free };
        let allowed: u64 = mask.iter().map(|w| u64::from(w.count_ones())).sum();
        let mut k = mix(h) % allowed.max(1);
        for (w, bits) in mask.iter().enumerate() {
            let n = u64::from(bits.count_ones());
            if k < n {
                let mut b = *bits;
                for _ in 0..k {
                    b &= b - 1;
                }
                return w as TokenId * 32 + b.trailing_zeros();
            }
            k -= n;
        }
        free
    }
}

/// splitmix64's finaliser: a cheap, well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A runner with no math (see the module doc).
#[derive(Debug)]
pub struct NullRunner {
    config: ModelConfig,
    bytes_per_token: usize,
    states: HashMap<StateId, NullState>,
    next_id: u64,
    /// Steps launched and not yet collected.
    launches: SyncLaunches,
}

impl NullRunner {
    pub fn new(config: ModelConfig) -> Self {
        NullRunner {
            config,
            bytes_per_token: NULL_BYTES_PER_TOKEN,
            states: HashMap::new(),
            next_id: 1,
            launches: SyncLaunches::default(),
        }
    }

    /// Reports `bytes` per committed token from `state_bytes` (to exercise memory budgets).
    pub fn with_bytes_per_token(mut self, bytes: usize) -> Self {
        self.bytes_per_token = bytes;
        self
    }

    /// Number of live states.
    pub fn num_states(&self) -> usize {
        self.states.len()
    }

    /// The tokens the runner would emit greedily after `history`, `n` of them (an oracle for tests
    /// and for drafting benchmarks).
    pub fn greedy_continuation(history: &[TokenId], n: usize) -> Vec<TokenId> {
        let mut state = NullState::new();
        history.iter().for_each(|&t| state.push(t));
        let params = SamplingParams::greedy();
        (0..n)
            .map(|_| {
                let t = state.next_token(&params, None);
                state.push(t);
                t
            })
            .collect()
    }

    fn insert(&mut self, state: NullState) -> StateId {
        let id = StateId(self.next_id);
        self.next_id += 1;
        self.states.insert(id, state);
        id
    }

    fn get(&self, id: StateId) -> Result<&NullState> {
        self.states.get(&id).ok_or(KernelError::UnknownState(id.0))
    }

    fn check_row(&self, row: &RowInput) -> Result<()> {
        self.get(row.state)?;
        if row.tokens.is_empty() {
            return Err(KernelError::InvalidInput(format!("row for {} has no tokens", row.state)));
        }
        if let Some(sample) = &row.sample {
            if sample.draft_len >= row.tokens.len() {
                return Err(KernelError::InvalidInput(format!(
                    "row for {}: draft_len {} must be below the row length {}",
                    row.state,
                    sample.draft_len,
                    row.tokens.len()
                )));
            }
        }
        let vocab = self.config.vocab_size;
        if let Some(bad) = row.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(KernelError::InvalidInput(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        row.sample.as_ref().map_or(Ok(()), |s| s.check_masks(vocab))
    }

    fn logprob(token: TokenId, k: usize) -> TokenLogprob {
        // A point mass: the emitted token has probability 1; alternatives are listed with a tiny one.
        let top = (0..k as TokenId)
            .map(|i| if i == 0 { (token, 0.0) } else { (NULL_TOKEN_RANGE.start + (token + i) % 8_000, -30.0) })
            .collect();
        TokenLogprob { token, logprob: 0.0, top }
    }
}

impl Runner for NullRunner {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device_name(&self) -> String {
        "null (no math)".to_string()
    }

    fn alloc_state(&mut self) -> Result<StateId> {
        Ok(self.insert(NullState::new()))
    }

    fn fork_state(&mut self, src: StateId) -> Result<StateId> {
        self.launches.check_settled(src, "forked")?;
        let copy = self.get(src)?.clone();
        Ok(self.insert(copy))
    }

    fn free_state(&mut self, id: StateId) -> Result<()> {
        self.launches.check_settled(id, "freed")?;
        self.states.remove(&id).map(|_| ()).ok_or(KernelError::UnknownState(id.0))
    }

    fn state_len(&self, id: StateId) -> Result<usize> {
        Ok(self.get(id)?.tokens.len())
    }

    fn state_bytes(&self, id: StateId) -> Result<usize> {
        Ok(self.get(id)?.tokens.len() * self.bytes_per_token)
    }

    fn export_state(&self, id: StateId) -> Result<SeqState> {
        self.launches.check_settled(id, "exported")?;
        let state = self.get(id)?;
        let mut history = MlaCache::new(1);
        for &t in &state.tokens {
            history.push(&[t as f32]);
        }
        Ok(SeqState { len: state.tokens.len(), kda: Vec::new(), mla: vec![history] })
    }

    fn import_state(&mut self, seq: SeqState) -> Result<StateId> {
        let bad = |why: &str| KernelError::InvalidInput(format!("NullRunner state import: {why}"));
        let [history] = seq.mla.as_slice() else {
            return Err(bad("expected exactly one history cache"));
        };
        if !seq.kda.is_empty() || history.latent_dim() != 1 || history.len() != seq.len {
            return Err(bad("expected no KDA states and a width-1 history of `len` entries"));
        }
        let mut state = NullState::new();
        for t in 0..history.len() {
            let v = history.entry(t)[0];
            if v < 0.0 || v.fract() != 0.0 || v as usize >= self.config.vocab_size {
                return Err(bad(&format!("entry {t} ({v}) is not a token id")));
            }
            state.push(v as TokenId);
        }
        Ok(self.insert(state))
    }

    /// NullRunner emits only ids of [`NULL_TOKEN_RANGE`]; a mask is accepted when it allows them all.
    fn set_token_mask(&mut self, mask: crate::runner::TokenMask) -> Result<()> {
        match NULL_TOKEN_RANGE.clone().find(|id| !mask.is_allowed(*id)) {
            Some(id) => {
                Err(KernelError::InvalidInput(format!("the null runner emits token {id}, which the mask forbids")))
            }
            None => Ok(()),
        }
    }

    crate::sync_stepper_runner_methods!();
}

impl SyncStepper for NullRunner {
    fn launches(&mut self) -> &mut SyncLaunches {
        &mut self.launches
    }

    fn step_now(&mut self, rows: &[RowInput]) -> Result<Vec<RowOutput>> {
        for (i, row) in rows.iter().enumerate() {
            self.check_row(row)?;
            if rows[..i].iter().any(|r| r.state == row.state) {
                return Err(KernelError::InvalidInput(format!("{} appears in two rows of one step", row.state)));
            }
        }
        let mut outputs = Vec::with_capacity(rows.len());
        for row in rows {
            let state = self.states.get_mut(&row.state).ok_or(KernelError::UnknownState(row.state.0))?;
            let Some(sample) = &row.sample else {
                row.tokens.iter().for_each(|&t| state.push(t));
                outputs.push(RowOutput::default());
                continue;
            };
            let fed = row.tokens.len() - sample.draft_len;
            row.tokens[..fed].iter().for_each(|&t| state.push(t));
            let mut emitted = Vec::with_capacity(sample.draft_len + 1);
            let mask = |i: usize| sample.masks.get(i).map(|m| &m[..]);
            for (i, &draft) in row.tokens[fed..].iter().enumerate() {
                let want = state.next_token(&sample.params, mask(i));
                if want != draft {
                    break;
                }
                state.push(draft);
                emitted.push(draft);
            }
            let num_accepted = emitted.len();
            emitted.push(state.next_token(&sample.params, mask(num_accepted)));
            let logprobs = match sample.params.logprobs {
                Some(k) => emitted.iter().map(|&t| Self::logprob(t, k)).collect(),
                None => Vec::new(),
            };
            outputs.push(RowOutput { tokens: emitted, num_accepted, logprobs });
        }
        Ok(outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::SampleRequest;

    fn runner() -> NullRunner {
        NullRunner::new(ModelConfig::preset("k3-tiny").expect("k3-tiny preset"))
    }

    fn sample_row(state: StateId, tokens: Vec<TokenId>, draft_len: usize) -> RowInput {
        RowInput { state, tokens, sample: Some(SampleRequest::new(SamplingParams::greedy(), draft_len)) }
    }

    #[test]
    fn chunked_prefill_matches_one_shot_and_the_oracle() {
        let mut r = runner();
        let prompt: Vec<TokenId> = (100..140).collect();
        let a = r.alloc_state().unwrap();
        let one_shot = r.step(&[sample_row(a, prompt.clone(), 0)]).unwrap();
        let b = r.alloc_state().unwrap();
        let chunk = RowInput { state: b, tokens: prompt[..25].to_vec(), sample: None };
        assert_eq!(r.step(&[chunk]).unwrap(), vec![RowOutput::default()]);
        let chunked = r.step(&[sample_row(b, prompt[25..].to_vec(), 0)]).unwrap();
        assert_eq!(one_shot, chunked);
        assert_eq!(one_shot[0].tokens, NullRunner::greedy_continuation(&prompt, 1));
        assert!(NULL_TOKEN_RANGE.contains(&one_shot[0].tokens[0]));
        assert_eq!(r.state_len(a).unwrap(), 40);
        assert_eq!(r.state_bytes(a).unwrap(), 40 * NULL_BYTES_PER_TOKEN);
    }

    #[test]
    fn oracle_drafts_are_fully_accepted_and_wrong_ones_cut_the_window() {
        let mut r = runner();
        let prompt: Vec<TokenId> = vec![5, 6, 7];
        let oracle = NullRunner::greedy_continuation(&prompt, 5);
        let s = r.alloc_state().unwrap();
        let mut row = prompt.clone();
        row.extend_from_slice(&oracle[..4]);
        let out = r.step(&[sample_row(s, row, 4)]).unwrap();
        assert_eq!(out[0].num_accepted, 4);
        assert_eq!(out[0].tokens, oracle);
        assert_eq!(r.state_len(s).unwrap(), 3 + 4);

        let t = r.alloc_state().unwrap();
        let mut row = prompt.clone();
        row.extend_from_slice(&[oracle[0], oracle[1] + 1, oracle[2]]);
        let out = r.step(&[sample_row(t, row, 3)]).unwrap();
        assert_eq!(out[0].num_accepted, 1);
        assert_eq!(out[0].tokens, oracle[..2].to_vec());
        assert_eq!(r.state_len(t).unwrap(), 4);
    }

    #[test]
    fn sampling_is_seeded_and_differs_from_greedy() {
        let mut r = runner();
        let params = |seed| SamplingParams { temperature: 1.0, seed, ..SamplingParams::greedy() };
        let mut run = |p: SamplingParams| {
            let s = r.alloc_state().unwrap();
            let mut tokens = vec![42];
            let mut out = Vec::new();
            for _ in 0..8 {
                let row = RowInput { state: s, tokens: tokens.clone(), sample: Some(SampleRequest::new(p.clone(), 0)) };
                let t = r.step(&[row]).unwrap()[0].tokens[0];
                out.push(t);
                tokens = vec![t];
            }
            out
        };
        let a = run(params(1));
        assert_eq!(a, run(params(1)));
        assert_ne!(a, run(params(2)));
        assert_ne!(a, run(SamplingParams::greedy()));
    }

    #[test]
    fn fork_and_export_import_continue_identically() {
        let mut r = runner();
        let s = r.alloc_state().unwrap();
        r.step(&[RowInput { state: s, tokens: (200..300).collect(), sample: None }]).unwrap();
        let f = r.fork_state(s).unwrap();
        let snapshot = r.export_state(s).unwrap();
        assert_eq!(snapshot.len, 100);
        let i = r.import_state(snapshot).unwrap();
        let outs = r.step(&[sample_row(s, vec![7], 0), sample_row(f, vec![7], 0), sample_row(i, vec![7], 0)]).unwrap();
        assert_eq!(outs[0], outs[1]);
        assert_eq!(outs[0], outs[2]);
        // The fork is independent: stepping the original did not touch it beyond its own row.
        r.step(&[sample_row(s, vec![8, 9], 0)]).unwrap();
        assert_eq!(r.state_len(f).unwrap(), 101);
        r.free_state(s).unwrap();
        assert!(matches!(r.state_len(s), Err(KernelError::UnknownState(_))));
        assert_eq!(r.num_states(), 2);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let mut r = runner();
        let s = r.alloc_state().unwrap();
        let vocab = r.config().vocab_size as TokenId;
        assert!(matches!(r.step(&[sample_row(s, vec![vocab], 0)]), Err(KernelError::InvalidInput(_))));
        assert!(matches!(r.step(&[sample_row(s, vec![1, 2], 2)]), Err(KernelError::InvalidInput(_))));
        assert!(matches!(r.step(&[sample_row(s, vec![], 0)]), Err(KernelError::InvalidInput(_))));
        assert!(matches!(
            r.step(&[sample_row(s, vec![1], 0), sample_row(s, vec![2], 0)]),
            Err(KernelError::InvalidInput(_))
        ));
        assert!(matches!(r.step(&[sample_row(StateId(999), vec![1], 0)]), Err(KernelError::UnknownState(999))));
        // Nothing was committed by the failed steps.
        assert_eq!(r.state_len(s).unwrap(), 0);
        let mut bad = r.export_state(s).unwrap();
        bad.len = 3;
        assert!(matches!(r.import_state(bad), Err(KernelError::InvalidInput(_))));
    }
}
