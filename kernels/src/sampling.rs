//! Sampling: the counter-based RNG, distributions from logits (temperature → top-k → top-p), greedy
//! argmax, and OpenAI-style log-probabilities.
//!
//! Invariants:
//! - Every random draw is [`uniform`]`(seed, position, stream)`: a pure function of the request seed,
//!   the absolute position of the token it decides and a [`RngStream`]. No state is carried between
//!   draws, so a token does not depend on what else is batched, and a CUDA kernel computes the same
//!   bits with the same 64-bit integer arithmetic.
//! - Ties are broken towards the lowest token id everywhere: greedy argmax, the top-k boundary, the
//!   top-p boundary and the top-N log-probability alternatives.
//! - A [`Distribution`] always sums to 1 over the tokens it keeps and is exactly 0 elsewhere.
//! - `position` is the index the token takes in its sequence (the number of tokens before it).
//!
//! Processing order follows vLLM's V1 sampler (`vllm/v1/sample/sampler.py`): temperature first, then
//! top-k, then top-p over the softmax of what top-k kept. Two deliberate differences: vLLM keeps
//! every token tied with the k-th logit (its mask is `logit < kth`), sparkd keeps exactly k by the
//! lowest-id rule; and vLLM samples with an exponential race on a per-request generator, sparkd
//! with the inverse CDF of one counter-based uniform (the same distribution, reproducible per token).
//!
//! Log-probabilities are vLLM's default `logprobs_mode = "raw_logprobs"`: the log-softmax of the
//! raw logits, before temperature, top-k and top-p. The top-N alternatives are ranked on the same
//! raw values.

use crate::error::{KernelError, Result};
use crate::runner::{SamplingParams, TokenId, TokenLogprob};

/// Independent random streams at one position. Different streams at the same (seed, position)
/// give independent uniforms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RngStream {
    /// The token emitted at a position: a plain sample, a bonus token or a correction (residual).
    Token = 0,
    /// The accept/reject test of the draft token at a position.
    Accept = 1,
    /// Forced ("synthetic") acceptance of a verify window, keyed by the window's first draft position.
    Synthetic = 2,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser (Steele, Lea, Flood 2014): a bijection of u64 with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The raw 64-bit hash of `(seed, position, stream)`. All arithmetic is wrapping u64:
///
/// ```text
/// h = mix64(seed + G)
/// h = mix64(h ^ (position + 2G))
/// h = mix64(h ^ (stream + 3G))        G = 0x9E3779B97F4A7C15, mix64 = splitmix64's finaliser
/// ```
pub fn hash3(seed: u64, position: u64, stream: u64) -> u64 {
    let h = mix64(seed.wrapping_add(GOLDEN));
    let h = mix64(h ^ position.wrapping_add(GOLDEN.wrapping_mul(2)));
    mix64(h ^ stream.wrapping_add(GOLDEN.wrapping_mul(3)))
}

/// A uniform draw in [0, 1): the top 53 bits of [`hash3`] times 2^-53.
pub fn uniform(seed: u64, position: u64, stream: RngStream) -> f64 {
    (hash3(seed, position, stream as u64) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Orders `(value, id)` pairs best first: larger value, then lower id.
fn best_first(a: &(f64, TokenId), b: &(f64, TokenId)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Moves the `n` best entries (by [`best_first`]) to the front of `items`, sorted; O(len + n log n).
fn select_best(items: &mut [(f64, TokenId)], n: usize) {
    let n = n.min(items.len());
    if n == 0 {
        return;
    }
    if n < items.len() {
        items.select_nth_unstable_by(n - 1, best_first);
    }
    items[..n].sort_unstable_by(best_first);
}

fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(KernelError::InvalidInput("logits row is empty".into()));
    }
    if logits.len() > TokenId::MAX as usize {
        return Err(KernelError::InvalidInput(format!("logits row of {} entries exceeds the id range", logits.len())));
    }
    if let Some(id) = logits.iter().position(|l| l.is_nan() || *l == f32::INFINITY) {
        return Err(KernelError::InvalidInput(format!("logit of token {id} is {}", logits[id])));
    }
    if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
        return Err(KernelError::InvalidInput("every logit is -inf".into()));
    }
    Ok(())
}

/// Checks that the sampling parameters are usable (temperature >= 0 and finite, top_p in (0, 1]).
pub fn check_params(params: &SamplingParams) -> Result<()> {
    if !params.temperature.is_finite() || params.temperature < 0.0 {
        return Err(KernelError::InvalidInput(format!(
            "temperature {} is not a finite value >= 0",
            params.temperature
        )));
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) {
        return Err(KernelError::InvalidInput(format!("top_p {} is outside (0, 1]", params.top_p)));
    }
    Ok(())
}

/// The greedy token: argmax of the logits, lowest id on ties.
pub fn argmax(logits: &[f32]) -> Result<TokenId> {
    check_logits(logits)?;
    let mut best = 0usize;
    for (id, &l) in logits.iter().enumerate().skip(1) {
        if l > logits[best] {
            best = id;
        }
    }
    Ok(best as TokenId)
}

/// A probability distribution over the vocabulary, after temperature, top-k and top-p.
#[derive(Clone, Debug, PartialEq)]
pub struct Distribution {
    /// `[vocab]`, sums to 1; 0 for every token the processing removed.
    probs: Vec<f64>,
}

impl Distribution {
    /// Builds the distribution `params` sample from. Greedy parameters give a one-hot distribution on
    /// the argmax.
    pub fn from_logits(logits: &[f32], params: &SamplingParams) -> Result<Self> {
        check_params(params)?;
        check_logits(logits)?;
        let vocab = logits.len();
        let mut probs = vec![0.0f64; vocab];
        if params.is_greedy() {
            probs[argmax(logits)? as usize] = 1.0;
            return Ok(Distribution { probs });
        }
        let inv_t = 1.0 / params.temperature as f64;
        // [kept] (scaled logit, id); all ids when top-k is off.
        let mut kept: Vec<(f64, TokenId)> =
            logits.iter().enumerate().map(|(id, &l)| (l as f64 * inv_t, id as TokenId)).collect();
        let top_k_active = params.top_k > 0 && params.top_k < vocab;
        if top_k_active {
            select_best(&mut kept, params.top_k);
            kept.truncate(params.top_k);
        }
        softmax_in_place(&mut kept);
        if params.top_p < 1.0 {
            truncate_top_p(&mut kept, params.top_p as f64, top_k_active);
        }
        let total: f64 = kept.iter().map(|e| e.0).sum();
        for (p, id) in kept {
            probs[id as usize] = p / total;
        }
        Ok(Distribution { probs })
    }

    /// A distribution from explicit probabilities (`[vocab]`, non-negative, positive sum); normalised.
    pub fn from_probs(probs: Vec<f64>) -> Result<Self> {
        if probs.is_empty() {
            return Err(KernelError::InvalidInput("probability vector is empty".into()));
        }
        if let Some(id) = probs.iter().position(|p| !p.is_finite() || *p < 0.0) {
            return Err(KernelError::InvalidInput(format!("probability of token {id} is {}", probs[id])));
        }
        let total: f64 = probs.iter().sum();
        if total <= 0.0 {
            return Err(KernelError::InvalidInput("probabilities sum to 0".into()));
        }
        Ok(Distribution { probs: probs.into_iter().map(|p| p / total).collect() })
    }

    /// All mass on `token`, which must lie inside the vocabulary.
    pub fn one_hot(vocab: usize, token: TokenId) -> Result<Self> {
        if token as usize >= vocab {
            return Err(KernelError::InvalidInput(format!("token {token} is outside a vocabulary of {vocab}")));
        }
        let mut probs = vec![0.0; vocab];
        probs[token as usize] = 1.0;
        Ok(Distribution { probs })
    }

    pub fn vocab(&self) -> usize {
        self.probs.len()
    }

    /// Probability of `token`; 0 for an id outside the vocabulary.
    pub fn prob(&self, token: TokenId) -> f64 {
        self.probs.get(token as usize).copied().unwrap_or(0.0)
    }

    /// `[vocab]` probabilities.
    pub fn probs(&self) -> &[f64] {
        &self.probs
    }

    /// The inverse CDF over token ids in ascending order: the lowest id whose cumulative probability
    /// exceeds `u` (in [0, 1)). Rounding that leaves `u` above the total picks the last id with
    /// positive probability.
    pub fn sample_with(&self, u: f64) -> TokenId {
        let mut acc = 0.0;
        let mut last_positive = 0usize;
        for (id, &p) in self.probs.iter().enumerate() {
            if p > 0.0 {
                acc += p;
                last_positive = id;
                if acc > u {
                    return id as TokenId;
                }
            }
        }
        last_positive as TokenId
    }

    /// The residual `normalise(max(self - other, 0))` of speculative sampling, or `None` when it has
    /// no mass (the two distributions agree wherever `self` is larger).
    pub fn residual(&self, other: &Distribution) -> Option<Distribution> {
        let probs: Vec<f64> =
            self.probs.iter().enumerate().map(|(id, &p)| (p - other.prob(id as TokenId)).max(0.0)).collect();
        let total: f64 = probs.iter().sum();
        (total > 0.0).then(|| Distribution { probs: probs.into_iter().map(|p| p / total).collect() })
    }
}

/// Replaces the scaled logits of `items` with their softmax (max-subtracted, f64).
fn softmax_in_place(items: &mut [(f64, TokenId)]) {
    let max = items.iter().map(|e| e.0).fold(f64::NEG_INFINITY, f64::max);
    let mut total = 0.0;
    for e in items.iter_mut() {
        e.0 = (e.0 - max).exp();
        total += e.0;
    }
    for e in items.iter_mut() {
        e.0 /= total;
    }
}

/// Keeps the smallest best-first prefix whose mass reaches `top_p`: a token stays while the mass of
/// the tokens ranked above it is below `top_p` (vLLM masks, in ascending order, the tokens whose
/// inclusive cumulative mass is <= 1 - top_p; the two agree up to rounding). `sorted` says the
/// items are already best-first. Without it, the best candidates are found by partial selection of a
/// growing prefix, so a peaked distribution over 163,840 ids costs O(vocab), not a full sort.
fn truncate_top_p(items: &mut Vec<(f64, TokenId)>, top_p: f64, sorted: bool) {
    let mut prefix = if sorted { items.len() } else { 256.min(items.len()) };
    loop {
        if !sorted {
            select_best(items, prefix);
        }
        let mut above = 0.0;
        for (rank, e) in items[..prefix].iter().enumerate() {
            if above >= top_p {
                items.truncate(rank);
                return;
            }
            above += e.0;
        }
        if prefix == items.len() {
            return;
        }
        prefix = (prefix * 4).min(items.len());
    }
}

/// Samples one token for `position` (greedy: argmax; otherwise the inverse CDF of the processed
/// distribution at `uniform(seed, position, Token)`).
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> Result<TokenId> {
    if params.is_greedy() {
        check_params(params)?;
        return argmax(logits);
    }
    let dist = Distribution::from_logits(logits, params)?;
    Ok(dist.sample_with(uniform(params.seed, position, RngStream::Token)))
}

/// The raw log-probability of `token` (log-softmax of the logits at temperature 1) and the `top_n`
/// most likely tokens with theirs, best first, lowest id on ties.
pub fn logprobs(logits: &[f32], token: TokenId, top_n: usize) -> Result<TokenLogprob> {
    check_logits(logits)?;
    if token as usize >= logits.len() {
        return Err(KernelError::InvalidInput(format!("token {token} is outside a vocabulary of {}", logits.len())));
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) as f64;
    let log_total = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let logprob_of = |l: f32| (l as f64 - log_total) as f32;
    let top = if top_n == 0 {
        Vec::new()
    } else {
        let mut all: Vec<(f64, TokenId)> =
            logits.iter().enumerate().map(|(id, &l)| (l as f64, id as TokenId)).collect();
        select_best(&mut all, top_n);
        all.truncate(top_n);
        all.into_iter().map(|(l, id)| (id, logprob_of(l as f32))).collect()
    };
    Ok(TokenLogprob { token, logprob: logprob_of(logits[token as usize]), top })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed, logprobs: None }
    }

    #[test]
    fn uniform_is_reproducible_in_range_and_stream_separated() {
        for pos in 0..1000u64 {
            let u = uniform(7, pos, RngStream::Token);
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u, uniform(7, pos, RngStream::Token));
            assert_ne!(u, uniform(7, pos, RngStream::Accept));
            assert_ne!(u, uniform(8, pos, RngStream::Token));
        }
    }

    #[test]
    fn uniform_buckets_are_flat() {
        // 64 buckets, 64,000 draws over consecutive positions (the correlated case for a weak mix).
        // Chi-square with 63 degrees of freedom: 132 is its 1 - 1e-6 quantile, so a correct mix fails
        // this test with probability 1e-6 (here never: the draws are fixed).
        let buckets = 64usize;
        let n = 64_000u64;
        let mut counts = vec![0u64; buckets];
        for pos in 0..n {
            counts[(uniform(42, pos, RngStream::Accept) * buckets as f64) as usize] += 1;
        }
        let expected = n as f64 / buckets as f64;
        let chi2: f64 = counts.iter().map(|&c| (c as f64 - expected).powi(2) / expected).sum();
        assert!(chi2 < 132.0, "chi2 {chi2}");
    }

    #[test]
    fn argmax_breaks_ties_to_lowest_id() {
        assert_eq!(argmax(&[0.0, 3.0, 1.0, 3.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1.0]).unwrap(), 1);
    }

    #[test]
    fn bad_logits_and_params_are_errors() {
        assert_eq!(argmax(&[]).unwrap_err().kind(), "invalid_input");
        assert!(argmax(&[0.0, f32::NAN]).is_err());
        assert!(argmax(&[f32::NEG_INFINITY; 3]).is_err());
        assert!(Distribution::from_logits(&[0.0, 1.0], &params(-1.0, 0, 1.0, 0)).is_err());
        assert!(Distribution::from_logits(&[0.0, 1.0], &params(1.0, 0, 0.0, 0)).is_err());
        assert!(logprobs(&[0.0, 1.0], 2, 0).is_err());
    }

    #[test]
    fn temperature_zero_is_greedy() {
        let logits = [0.5, 2.0, 2.0, -1.0];
        let d = Distribution::from_logits(&logits, &params(0.0, 0, 1.0, 3)).unwrap();
        assert_eq!(d.probs(), &[0.0, 1.0, 0.0, 0.0]);
        for pos in 0..50 {
            assert_eq!(sample(&logits, &params(0.0, 0, 0.5, pos), pos).unwrap(), 1);
        }
    }

    #[test]
    fn temperature_scales_before_softmax() {
        let d = Distribution::from_logits(&[0.0, 2.0_f32.ln()], &params(0.5, 0, 1.0, 0)).unwrap();
        // logits / 0.5 = [0, ln 4] -> [1/5, 4/5]
        assert!((d.prob(0) - 0.2).abs() < 1e-6 && (d.prob(1) - 0.8).abs() < 1e-6, "f32 logits carry ~1e-7 rounding");
    }

    #[test]
    fn top_k_keeps_exactly_k_lowest_id_on_ties() {
        let logits = [1.0, 3.0, 2.0, 2.0, 2.0, 0.0];
        let d = Distribution::from_logits(&logits, &params(1.0, 3, 1.0, 0)).unwrap();
        let kept: Vec<usize> = (0..6).filter(|&i| d.prob(i as TokenId) > 0.0).collect();
        assert_eq!(kept, vec![1, 2, 3]);
        assert!((d.prob(2) - d.prob(3)).abs() < 1e-15);
        assert!((d.probs().iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let all = Distribution::from_logits(&logits, &params(1.0, 6, 1.0, 0)).unwrap();
        assert!(all.probs().iter().all(|&p| p > 0.0));
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        let probs = [0.1f64, 0.4, 0.3, 0.2];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let kept = |p: f32| {
            let d = Distribution::from_logits(&logits, &params(1.0, 0, p, 0)).unwrap();
            (0..4u32).filter(|&i| d.prob(i) > 0.0).collect::<Vec<_>>()
        };
        assert_eq!(kept(0.3), vec![1]);
        assert_eq!(kept(0.39), vec![1]);
        assert_eq!(kept(0.41), vec![1, 2]);
        assert_eq!(kept(0.69), vec![1, 2]);
        assert_eq!(kept(0.71), vec![1, 2, 3]);
        assert_eq!(kept(1.0), vec![0, 1, 2, 3]);
        // A tie at the boundary keeps the lower id.
        let tied: Vec<f32> = [0.5f64, 0.25, 0.25].iter().map(|p| p.ln() as f32).collect();
        let d = Distribution::from_logits(&tied, &params(1.0, 0, 0.6, 0)).unwrap();
        assert!(d.prob(1) > 0.0 && d.prob(2) == 0.0);
    }

    #[test]
    fn top_p_applies_after_top_k_renormalisation() {
        // top-k 2 keeps {0.4, 0.3} -> {4/7, 3/7}; top-p 0.5 then keeps only the first.
        let logits: Vec<f32> = [0.1f64, 0.4, 0.3, 0.2].iter().map(|p| p.ln() as f32).collect();
        let d = Distribution::from_logits(&logits, &params(1.0, 2, 0.5, 0)).unwrap();
        assert_eq!(d.prob(1), 1.0);
        let d = Distribution::from_logits(&logits, &params(1.0, 2, 0.6, 0)).unwrap();
        assert!((d.prob(1) - 4.0 / 7.0).abs() < 1e-6 && (d.prob(2) - 3.0 / 7.0).abs() < 1e-6);
    }

    #[test]
    fn top_p_on_a_full_vocabulary_matches_a_full_sort() {
        let vocab = 163_840;
        let logits: Vec<f32> = (0..vocab).map(|i| ((i as u64 * 2_654_435_761) % 10_007) as f32 / 700.0).collect();
        let d = Distribution::from_logits(&logits, &params(0.7, 0, 0.9, 0)).unwrap();
        let mut all: Vec<(f64, TokenId)> =
            logits.iter().enumerate().map(|(i, &l)| (l as f64 / 0.7f32 as f64, i as TokenId)).collect();
        all.sort_unstable_by(best_first);
        let kept = d.probs().iter().filter(|&&p| p > 0.0).count();
        assert!(kept > 256, "the test must need more than the first selection round ({kept})");
        assert!(all[..kept].iter().all(|&(_, id)| d.prob(id) > 0.0));
    }

    #[test]
    fn sample_with_inverts_the_cdf_by_id() {
        let d = Distribution::from_probs(vec![0.25, 0.0, 0.5, 0.25]).unwrap();
        assert_eq!(d.sample_with(0.0), 0);
        assert_eq!(d.sample_with(0.2499), 0);
        assert_eq!(d.sample_with(0.25), 2);
        assert_eq!(d.sample_with(0.7499), 2);
        assert_eq!(d.sample_with(0.75), 3);
        assert_eq!(d.sample_with(0.999_999_999), 3);
    }

    #[test]
    fn sample_depends_only_on_seed_and_position() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = params(1.0, 0, 1.0, 99);
        let a: Vec<TokenId> = (0..40).map(|pos| sample(&logits, &p, pos).unwrap()).collect();
        let b: Vec<TokenId> = (0..40).rev().map(|pos| sample(&logits, &p, pos).unwrap()).rev().collect();
        assert_eq!(a, b);
        let other: Vec<TokenId> = (0..40).map(|pos| sample(&logits, &params(1.0, 0, 1.0, 100), pos).unwrap()).collect();
        assert_ne!(a, other);
    }

    #[test]
    fn logprobs_are_raw_log_softmax_with_ranked_alternatives() {
        let logits = [1.0f32, 3.0, 3.0, 0.0];
        let lp = logprobs(&logits, 0, 3).unwrap();
        let total: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((lp.logprob as f64 - (1.0 - total.ln())).abs() < 1e-6);
        let ids: Vec<TokenId> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 2, 0]);
        assert!((lp.top[0].1 as f64 - (3.0 - total.ln())).abs() < 1e-6);
        assert!(logprobs(&logits, 3, 0).unwrap().top.is_empty());
    }
}
