//! Speculative acceptance: the rule that turns a verify window (the target's logits for the anchor
//! and the drafts) into emitted tokens, and the forced ("synthetic") acceptance used to benchmark
//! at a fixed acceptance length.
//!
//! Follows shared/reference/dspark.md §2.4 (vLLM's rejection sampler):
//! - Greedy: emit the target argmax while it equals the draft; at the first mismatch emit the argmax
//!   (the correction) and stop; when every draft matches, emit the argmax of the last row (the bonus).
//! - Sampling (standard speculative sampling, Leviathan et al. 2023): accept draft `x` at position i
//!   iff `u < p(x) / q(x)` (written `u·q(x) < p(x)`); at the first rejection emit a token from
//!   `normalise(max(p − q, 0))`; when every draft is accepted emit a bonus token from the last row.
//!   `p` and `q` are both processed with the request's temperature, top-k and top-p. Drafts without
//!   a distribution (suffix, n-gram) use a one-hot `q`: accept with probability `p(x)`, and the
//!   residual is `p` with `x` removed.
//! - Synthetic: the accepted count is decided by one uniform against per-position *unconditional*
//!   rates (`rates[i]` = P(the first i+1 drafts are accepted)); the real draft tokens are emitted and
//!   the token after them comes from the target's row at that point. The output is flagged.
//!
//! Invariants:
//! - Row i of the target logits is the distribution of the token at `first_position + i`; draft i
//!   sits at `first_position + i`. Every random draw is `uniform(seed, position, stream)` with that
//!   position (the synthetic draw uses `first_position`), so verdicts do not depend on batching.
//! - A verdict emits `num_accepted + 1` tokens: the accepted drafts, then one target token.
//! - Log-probabilities, when asked, are the raw log-softmax of the target row of each emitted token.

use crate::error::{KernelError, Result};
use crate::runner::{RowOutput, SamplingParams, TokenId, TokenLogprob};
use crate::sampling::{self, uniform, Distribution, RngStream};

/// One request's verify window.
#[derive(Clone, Copy, Debug)]
pub struct VerifyWindow<'a> {
    /// `[drafts.len() + 1, vocab]`: row i gives the token at `first_position + i`.
    pub target_logits: &'a [f32],
    pub vocab: usize,
    /// The draft tokens, in order.
    pub drafts: &'a [TokenId],
    /// `[drafts.len(), vocab]` logits of the distributions the drafts were sampled from; `None` for
    /// model-free drafts (one-hot `q`).
    pub draft_logits: Option<&'a [f32]>,
    /// Absolute position of the first draft token (the number of tokens before it).
    pub first_position: u64,
}

impl VerifyWindow<'_> {
    fn check(&self) -> Result<()> {
        let rows = self.drafts.len() + 1;
        if self.vocab == 0 || self.target_logits.len() != rows * self.vocab {
            return Err(KernelError::InvalidInput(format!(
                "target logits hold {} values, expected [{rows}, {}] for {} drafts",
                self.target_logits.len(),
                self.vocab,
                self.drafts.len()
            )));
        }
        if let Some(q) = self.draft_logits {
            if q.len() != self.drafts.len() * self.vocab {
                return Err(KernelError::InvalidInput(format!(
                    "draft logits hold {} values, expected [{}, {}]",
                    q.len(),
                    self.drafts.len(),
                    self.vocab
                )));
            }
        }
        if let Some(&bad) = self.drafts.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(KernelError::InvalidInput(format!(
                "draft token {bad} is outside a vocabulary of {}",
                self.vocab
            )));
        }
        Ok(())
    }

    fn target_row(&self, i: usize) -> &[f32] {
        &self.target_logits[i * self.vocab..(i + 1) * self.vocab]
    }

    fn draft_row(&self, i: usize) -> Option<&[f32]> {
        self.draft_logits.map(|q| &q[i * self.vocab..(i + 1) * self.vocab])
    }

    fn position(&self, i: usize) -> u64 {
        self.first_position + i as u64
    }
}

/// Per-position unconditional acceptance rates for forced acceptance (vLLM's
/// `synthetic_acceptance_rates`). The single source of truth for forced-AL schedules.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSchedule {
    /// Non-increasing, each in [0, 1]; entry i = P(the first i+1 drafts are all accepted).
    rates: Vec<f64>,
}

impl SyntheticSchedule {
    /// Validates explicit rates: each in [0, 1], non-increasing.
    pub fn from_rates(rates: Vec<f64>) -> Result<Self> {
        if let Some(i) = rates.iter().position(|r| !(0.0..=1.0).contains(r)) {
            return Err(KernelError::InvalidInput(format!(
                "synthetic acceptance rate {i} is {}, not in [0, 1]",
                rates[i]
            )));
        }
        if let Some(i) = rates.windows(2).position(|w| w[1] > w[0]) {
            return Err(KernelError::InvalidInput(format!(
                "synthetic acceptance rates must be non-increasing, but rate {} ({}) > rate {i} ({})",
                i + 1,
                rates[i + 1],
                rates[i]
            )));
        }
        Ok(SyntheticSchedule { rates })
    }

    /// The minimum-variance schedule of mean acceptance length `length` (bonus included) over
    /// `num_spec_tokens` drafts, as vLLM resolves `synthetic_acceptance_length` (dspark.md §4.5): the
    /// first ⌊L−1⌋ positions get rate 1, the next the fractional part, the rest 0. (2.6, 3) → [1, 0.6, 0].
    pub fn from_acceptance_length(length: f64, num_spec_tokens: usize) -> Result<Self> {
        let max = num_spec_tokens as f64 + 1.0;
        if !(length.is_finite() && (1.0..=max).contains(&length)) {
            return Err(KernelError::InvalidInput(format!(
                "synthetic acceptance length {length} is outside [1, {max}] for {num_spec_tokens} speculative tokens"
            )));
        }
        let accepted = length - 1.0;
        let rates = (0..num_spec_tokens).map(|i| (accepted - i as f64).clamp(0.0, 1.0)).collect();
        Ok(SyntheticSchedule { rates })
    }

    pub fn rates(&self) -> &[f64] {
        &self.rates
    }

    /// Expected tokens per verify window when every window carries `rates().len()` drafts.
    pub fn mean_acceptance_length(&self) -> f64 {
        1.0 + self.rates.iter().sum::<f64>()
    }

    /// Accepted drafts of a window of `draft_len` drafts: the number of rates above one uniform
    /// `uniform(seed, first_position, Synthetic)`. Positions past the schedule have rate 0.
    pub fn accepted_count(&self, seed: u64, first_position: u64, draft_len: usize) -> usize {
        let u = uniform(seed, first_position, RngStream::Synthetic);
        self.rates.iter().take(draft_len).take_while(|&&r| u < r).count()
    }
}

/// How drafts are accepted.
#[derive(Clone, Debug, PartialEq)]
pub enum AcceptanceMode {
    /// The lossless rule (greedy or speculative sampling).
    Standard,
    /// Forced acceptance for benchmarks; the output is not the model's.
    Synthetic(SyntheticSchedule),
}

/// The result of verifying one window.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Accepted drafts, then the correction or bonus token.
    pub tokens: Vec<TokenId>,
    pub num_accepted: usize,
    /// One per emitted token when `SamplingParams::logprobs` is set.
    pub logprobs: Vec<TokenLogprob>,
    /// True when the acceptance was forced (the text is not the model's).
    pub synthetic: bool,
}

impl From<Verdict> for RowOutput {
    /// The runner's row result; the synthetic flag is not part of `RowOutput`.
    fn from(v: Verdict) -> Self {
        RowOutput { tokens: v.tokens, num_accepted: v.num_accepted, logprobs: v.logprobs }
    }
}

/// Verifies `window` under `params` and `mode`.
pub fn verify(window: &VerifyWindow<'_>, params: &SamplingParams, mode: &AcceptanceMode) -> Result<Verdict> {
    window.check()?;
    let (tokens, synthetic) = match mode {
        AcceptanceMode::Standard if params.is_greedy() => (verify_greedy(window)?, false),
        AcceptanceMode::Standard => (verify_sampling(window, params)?, false),
        AcceptanceMode::Synthetic(schedule) => {
            let accepted = schedule.accepted_count(params.seed, window.first_position, window.drafts.len());
            let mut tokens = window.drafts[..accepted].to_vec();
            tokens.push(sampling::sample(window.target_row(accepted), params, window.position(accepted))?);
            (tokens, true)
        }
    };
    let logprobs = match params.logprobs {
        Some(top_n) => tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| sampling::logprobs(window.target_row(i), t, top_n))
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    Ok(Verdict { num_accepted: tokens.len() - 1, tokens, logprobs, synthetic })
}

fn verify_greedy(window: &VerifyWindow<'_>) -> Result<Vec<TokenId>> {
    greedy_tokens(window.drafts, |i| sampling::argmax(window.target_row(i)))
}

/// The greedy rule over the target's choices: `argmax(i)` is the target's token after `i` drafts (asked only
/// up to the first mismatch). Returns the accepted drafts, then the correction or bonus token.
pub fn greedy_tokens(drafts: &[TokenId], mut argmax: impl FnMut(usize) -> Result<TokenId>) -> Result<Vec<TokenId>> {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (i, &draft) in drafts.iter().enumerate() {
        let target = argmax(i)?;
        tokens.push(target);
        if target != draft {
            return Ok(tokens);
        }
    }
    tokens.push(argmax(drafts.len())?);
    Ok(tokens)
}

fn verify_sampling(window: &VerifyWindow<'_>, params: &SamplingParams) -> Result<Vec<TokenId>> {
    let mut tokens = Vec::with_capacity(window.drafts.len() + 1);
    for (i, &draft) in window.drafts.iter().enumerate() {
        let position = window.position(i);
        let p = Distribution::from_logits(window.target_row(i), params)?;
        let q = match window.draft_row(i) {
            Some(row) => Distribution::from_logits(row, params)?,
            None => Distribution::one_hot(window.vocab, draft)?,
        };
        let (px, qx) = (p.prob(draft), q.prob(draft));
        if px > 0.0 && uniform(params.seed, position, RngStream::Accept) * qx < px {
            tokens.push(draft);
            continue;
        }
        // Rounding can leave no residual mass although the draft was rejected; p itself is then the
        // distribution to sample.
        let residual = p.residual(&q).unwrap_or(p);
        tokens.push(residual.sample_with(uniform(params.seed, position, RngStream::Token)));
        return Ok(tokens);
    }
    let last = window.drafts.len();
    let bonus = Distribution::from_logits(window.target_row(last), params)?;
    tokens.push(bonus.sample_with(uniform(params.seed, window.position(last), RngStream::Token)));
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Logit rows that put (almost) all mass on the given tokens.
    fn peaked_rows(tokens: &[TokenId], vocab: usize) -> Vec<f32> {
        let mut rows = vec![0.0f32; tokens.len() * vocab];
        for (i, &t) in tokens.iter().enumerate() {
            rows[i * vocab + t as usize] = 50.0;
        }
        rows
    }

    fn window<'a>(target: &'a [f32], vocab: usize, drafts: &'a [TokenId], q: Option<&'a [f32]>) -> VerifyWindow<'a> {
        VerifyWindow { target_logits: target, vocab, drafts, draft_logits: q, first_position: 10 }
    }

    fn sampling(seed: u64) -> SamplingParams {
        SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed, logprobs: None }
    }

    #[test]
    fn greedy_cases_match_vllm() {
        let greedy = SamplingParams::greedy();
        let run = |drafts: &[TokenId], target: &[TokenId]| {
            let logits = peaked_rows(target, 8);
            verify(&window(&logits, 8, drafts, None), &greedy, &AcceptanceMode::Standard).unwrap()
        };
        let all = run(&[1, 2], &[1, 2, 3]);
        assert_eq!((all.tokens, all.num_accepted), (vec![1, 2, 3], 2));
        let first = run(&[1], &[2, 3]);
        assert_eq!((first.tokens, first.num_accepted), (vec![2], 0));
        let middle = run(&[4, 5, 6], &[4, 7, 6, 1]);
        assert_eq!((middle.tokens, middle.num_accepted), (vec![4, 7], 1));
        let none = run(&[], &[5]);
        assert_eq!((none.tokens, none.num_accepted), (vec![5], 0));
    }

    #[test]
    fn an_oracle_draft_is_accepted_fully() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let vocab = 32;
        let target: Vec<f32> = (0..5 * vocab).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let drafts: Vec<TokenId> =
            (0..4).map(|i| sampling::argmax(&target[i * vocab..(i + 1) * vocab]).unwrap()).collect();
        let v = verify(&window(&target, vocab, &drafts, None), &SamplingParams::greedy(), &AcceptanceMode::Standard)
            .unwrap();
        assert_eq!(v.num_accepted, 4);
        assert_eq!(&v.tokens[..4], &drafts[..]);
        // A draft distribution equal to the target's is never rejected, whatever was sampled from it.
        let q = &target[..4 * vocab];
        for seed in 0..200 {
            let drafts: Vec<TokenId> = (0..4).map(|i| ((seed as usize * 7 + i * 3) % vocab) as TokenId).collect();
            let v =
                verify(&window(&target, vocab, &drafts, Some(q)), &sampling(seed), &AcceptanceMode::Standard).unwrap();
            assert_eq!(v.num_accepted, 4);
        }
    }

    #[test]
    fn temperature_zero_sampling_is_the_greedy_rule() {
        let logits = peaked_rows(&[3, 1, 2], 6);
        let q = vec![0.0f32; 2 * 6];
        let params = SamplingParams { temperature: 0.0, top_p: 0.5, top_k: 2, seed: 9, logprobs: None };
        let v = verify(&window(&logits, 6, &[3, 4], Some(&q)), &params, &AcceptanceMode::Standard).unwrap();
        assert_eq!(v.tokens, vec![3, 1]);
    }

    #[test]
    fn bad_windows_are_errors() {
        let logits = vec![0.0f32; 16];
        let greedy = SamplingParams::greedy();
        let err = verify(&window(&logits, 8, &[1, 2], None), &greedy, &AcceptanceMode::Standard).unwrap_err();
        assert_eq!(err.kind(), "invalid_input");
        assert!(verify(&window(&logits, 8, &[9], None), &greedy, &AcceptanceMode::Standard).is_err());
        assert!(verify(&window(&logits, 8, &[1], Some(&logits)), &greedy, &AcceptanceMode::Standard).is_err());
    }

    /// Pearson chi-square of `counts` against `expected` probabilities, over the cells with
    /// positive expectation; cells with zero expectation must be empty.
    fn chi_square(counts: &[u64], expected: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .map(|(&c, &p)| {
                if p == 0.0 {
                    assert_eq!(c, 0, "a token with target probability 0 was emitted");
                    0.0
                } else {
                    (c as f64 - n as f64 * p).powi(2) / (n as f64 * p)
                }
            })
            .sum()
    }

    fn sample_from(d: &Distribution, rng: &mut ChaCha8Rng) -> TokenId {
        d.sample_with(rng.gen::<f64>())
    }

    /// Runs many seeded windows with drafts drawn from q and checks that the tokens emitted at each
    /// of the three positions follow the processed target distribution of that row.
    fn check_reproduces_target(params_of: impl Fn(u64) -> SamplingParams, with_q: bool, degrees_bound: f64) {
        let vocab = 8;
        let mut rng = ChaCha8Rng::seed_from_u64(2024);
        let target: Vec<f32> = (0..3 * vocab).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let draft: Vec<f32> = (0..2 * vocab).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let base = params_of(0);
        let p: Vec<Distribution> =
            (0..3).map(|i| Distribution::from_logits(&target[i * vocab..(i + 1) * vocab], &base).unwrap()).collect();
        let q: Vec<Distribution> =
            (0..2).map(|i| Distribution::from_logits(&draft[i * vocab..(i + 1) * vocab], &base).unwrap()).collect();
        let mut counts = vec![vec![0u64; vocab]; 3];
        for run in 0..30_000u64 {
            let drafts: Vec<TokenId> = if with_q {
                q.iter().map(|d| sample_from(d, &mut rng)).collect()
            } else {
                // Model-free drafts: any fixed rule; here a token from a fixed skewed table.
                vec![[0, 1, 1, 2, 5, 7][run as usize % 6], [3, 3, 4][run as usize % 3]]
            };
            let w = VerifyWindow {
                target_logits: &target,
                vocab,
                drafts: &drafts,
                draft_logits: with_q.then_some(&draft[..]),
                first_position: 1000 + run % 17,
            };
            let v = verify(&w, &params_of(run), &AcceptanceMode::Standard).unwrap();
            for (pos, &t) in v.tokens.iter().enumerate() {
                counts[pos][t as usize] += 1;
            }
        }
        for pos in 0..3 {
            let chi2 = chi_square(&counts[pos], p[pos].probs());
            assert!(chi2 < degrees_bound, "position {pos}: chi2 {chi2}, counts {:?}", counts[pos]);
        }
    }

    // Each chi-square below has at most 7 degrees of freedom (8 tokens); 29.9 is the 1 - 1e-4
    // quantile of chi2(7), so a correct sampler fails one position with probability <= 1e-4 (fewer
    // degrees of freedom make the bound only more conservative). The seeds are fixed, so the
    // outcome is deterministic; a biased rule (e.g. emitting q's token on rejection) exceeds it by
    // orders of magnitude at 30,000 runs.
    #[test]
    fn speculative_sampling_reproduces_the_target_distribution() {
        check_reproduces_target(sampling, true, 29.9);
    }

    #[test]
    fn speculative_sampling_with_temperature_and_top_k_reproduces_the_processed_target() {
        let params = |seed| SamplingParams { temperature: 0.7, top_p: 0.9, top_k: 6, seed, logprobs: None };
        check_reproduces_target(params, true, 29.9);
    }

    #[test]
    fn one_hot_drafts_reproduce_the_target_distribution() {
        check_reproduces_target(sampling, false, 29.9);
    }

    #[test]
    fn acceptance_rate_is_one_minus_total_variation() {
        // One draft, q and p on 4 tokens: P(accept) = sum_v min(p, q).
        let p = [0.1f64, 0.4, 0.3, 0.2];
        let q = [0.25f64, 0.25, 0.25, 0.25];
        let target: Vec<f32> = p.iter().chain(p.iter()).map(|x| x.ln() as f32).collect();
        let draft: Vec<f32> = q.iter().map(|x| x.ln() as f32).collect();
        let expected: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b)).sum();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let qd = Distribution::from_probs(q.to_vec()).unwrap();
        let n = 40_000u64;
        let mut accepted = 0;
        for seed in 0..n {
            let drafts = [sample_from(&qd, &mut rng)];
            let w = VerifyWindow {
                target_logits: &target,
                vocab: 4,
                drafts: &drafts,
                draft_logits: Some(&draft),
                first_position: 3,
            };
            accepted += verify(&w, &sampling(seed), &AcceptanceMode::Standard).unwrap().num_accepted;
        }
        let rate = accepted as f64 / n as f64;
        // Binomial standard error ~0.0022; 0.012 is over 5 of them.
        assert!((rate - expected).abs() < 0.012, "rate {rate} vs {expected}");
    }

    #[test]
    fn logprobs_follow_each_emitted_token() {
        let logits = peaked_rows(&[1, 2, 3], 8);
        let params = SamplingParams { logprobs: Some(2), ..SamplingParams::greedy() };
        let v = verify(&window(&logits, 8, &[1, 5], None), &params, &AcceptanceMode::Standard).unwrap();
        assert_eq!(v.tokens, vec![1, 2]);
        assert_eq!(v.logprobs.len(), 2);
        assert_eq!(v.logprobs[1].token, 2);
        assert_eq!(v.logprobs[1].top[0].0, 2);
        assert!(v.logprobs[1].logprob > -1e-3);
    }

    #[test]
    fn synthetic_length_resolves_to_the_minimum_variance_schedule() {
        let s = SyntheticSchedule::from_acceptance_length(2.6, 3).unwrap();
        let r = s.rates();
        assert_eq!(r.len(), 3);
        assert!((r[0] - 1.0).abs() < 1e-12 && (r[1] - 0.6).abs() < 1e-12 && r[2] == 0.0);
        assert!((s.mean_acceptance_length() - 2.6).abs() < 1e-12);
        assert_eq!(SyntheticSchedule::from_acceptance_length(4.0, 3).unwrap().rates(), &[1.0, 1.0, 1.0]);
        assert_eq!(SyntheticSchedule::from_acceptance_length(1.0, 2).unwrap().rates(), &[0.0, 0.0]);
        assert!(SyntheticSchedule::from_acceptance_length(4.5, 3).is_err());
        assert!(SyntheticSchedule::from_acceptance_length(0.5, 3).is_err());
        assert!(SyntheticSchedule::from_rates(vec![0.5, 0.7]).is_err());
        assert!(SyntheticSchedule::from_rates(vec![1.2]).is_err());
    }

    #[test]
    fn synthetic_acceptance_meets_the_asked_mean_length() {
        let vocab = 16;
        let target = peaked_rows(&[9; 6], vocab);
        let drafts = [1, 2, 3, 4, 5];
        for (rates, expected) in [(vec![0.9, 0.7, 0.5, 0.3, 0.1], 3.5), (vec![1.0, 1.0, 0.35, 0.0, 0.0], 3.35)] {
            let mode = AcceptanceMode::Synthetic(SyntheticSchedule::from_rates(rates).unwrap());
            let n = 20_000u64;
            let mut emitted = 0usize;
            for step in 0..n {
                let w = VerifyWindow {
                    target_logits: &target,
                    vocab,
                    drafts: &drafts,
                    draft_logits: None,
                    first_position: step * 5,
                };
                let v = verify(&w, &SamplingParams { seed: 77, ..SamplingParams::greedy() }, &mode).unwrap();
                assert!(v.synthetic);
                assert_eq!(&v.tokens[..v.num_accepted], &drafts[..v.num_accepted], "real drafts are emitted");
                assert_eq!(*v.tokens.last().unwrap(), 9, "the last token is the target's");
                emitted += v.tokens.len();
            }
            let mean = emitted as f64 / n as f64;
            // The standard deviation of one window's length is below 1.5, so of the mean below 0.011.
            assert!((mean - expected).abs() < 0.05, "mean AL {mean} vs {expected}");
        }
    }

    #[test]
    fn synthetic_extremes_accept_all_or_nothing() {
        let target = peaked_rows(&[7, 6, 5, 4], 8);
        let drafts = [1, 2, 3];
        let all = AcceptanceMode::Synthetic(SyntheticSchedule::from_rates(vec![1.0; 3]).unwrap());
        let none = AcceptanceMode::Synthetic(SyntheticSchedule::from_rates(vec![0.0; 3]).unwrap());
        for seed in 0..50 {
            let params = SamplingParams { seed, ..sampling(seed) };
            let v = verify(&window(&target, 8, &drafts, None), &params, &all).unwrap();
            assert_eq!(v.tokens, vec![1, 2, 3, 4]);
            let v = verify(&window(&target, 8, &drafts, None), &params, &none).unwrap();
            assert_eq!(v.tokens, vec![7]);
        }
    }
}
