//! N-gram prompt lookup (vLLM's `"ngram"` method, dspark.md §5.5): find an earlier occurrence of the
//! context's last n tokens, n from `max_n` down to `min_n`, and propose the tokens that followed it.
//!
//! Invariants:
//! - Stateless across calls: a draft depends only on the context passed in.
//! - The longest n wins; among occurrences of that n-gram the most recent one is used (vLLM's exact
//!   tie rule is not confirmed in the notes; the most recent occurrence is our choice).
//! - There is no frequency model, so every drafted token carries the same configured conditional
//!   confidence (an assumption for the verify budget, not a measured rate).

use sparkd_kernels::TokenId;

use crate::draft::{Draft, Proposer, SeqKey};
use crate::error::{Result, SpecError};

/// Knobs (vLLM `prompt_lookup_min` / `prompt_lookup_max`).
#[derive(Clone, Debug, PartialEq)]
pub struct NgramConfig {
    pub min_n: usize,
    pub max_n: usize,
    /// Conditional confidence given to every drafted token.
    pub confidence: f64,
}

impl Default for NgramConfig {
    fn default() -> Self {
        NgramConfig { min_n: 1, max_n: 4, confidence: 0.7 }
    }
}

/// The n-gram proposer.
#[derive(Clone, Debug)]
pub struct NgramProposer {
    cfg: NgramConfig,
}

impl NgramProposer {
    pub fn new(cfg: NgramConfig) -> Result<Self> {
        if cfg.min_n == 0 || cfg.min_n > cfg.max_n {
            return Err(SpecError::config(
                "prompt_lookup_min",
                format!("need 1 <= min ({}) <= max ({})", cfg.min_n, cfg.max_n),
            ));
        }
        if !(0.0..=1.0).contains(&cfg.confidence) {
            return Err(SpecError::config("confidence", format!("{} is not in [0, 1]", cfg.confidence)));
        }
        Ok(NgramProposer { cfg })
    }

    /// The draft for `context`, at most `max_len` tokens.
    pub fn lookup(&self, context: &[TokenId], max_len: usize) -> Draft {
        if max_len == 0 {
            return Draft::empty();
        }
        let len = context.len();
        for n in (self.cfg.min_n..=self.cfg.max_n.min(len.saturating_sub(1))).rev() {
            let pattern = &context[len - n..];
            // Occurrences must end before the last token so that something follows them.
            let found = (0..len - n).rev().find(|&start| &context[start..start + n] == pattern);
            if let Some(start) = found {
                let from = start + n;
                let tokens = context[from..(from + max_len).min(len)].to_vec();
                let confidences = vec![self.cfg.confidence; tokens.len()];
                return Draft::new(tokens, confidences).unwrap_or_default();
            }
        }
        Draft::empty()
    }
}

impl Proposer for NgramProposer {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn begin(&mut self, _seq: SeqKey, _prompt: &[TokenId]) {}

    fn propose(&mut self, _seq: SeqKey, context: &[TokenId], max_len: usize) -> Draft {
        self.lookup(context, max_len)
    }

    fn end(&mut self, _seq: SeqKey, _context: &[TokenId], _keep: bool) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proposer(min_n: usize, max_n: usize) -> NgramProposer {
        NgramProposer::new(NgramConfig { min_n, max_n, confidence: 0.5 }).unwrap()
    }

    #[test]
    fn proposes_what_followed_the_longest_match() {
        let p = proposer(1, 3);
        // [2, 3] last occurred followed by 9; [1, 2, 3] occurred followed by 4.
        let ctx = [1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3];
        assert_eq!(p.lookup(&ctx, 2).tokens(), &[4, 5]);
        let shorter = proposer(1, 2);
        assert_eq!(shorter.lookup(&ctx, 2).tokens(), &[9, 1], "the most recent [2, 3]");
        assert_eq!(p.lookup(&ctx, 2).confidences(), &[0.5, 0.5]);
    }

    #[test]
    fn stops_at_the_end_of_the_context_and_at_max_len() {
        let p = proposer(1, 2);
        assert_eq!(p.lookup(&[5, 6, 5], 4).tokens(), &[6, 5]);
        assert!(p.lookup(&[5, 6, 5], 0).is_empty());
        assert!(p.lookup(&[1, 2, 3], 3).is_empty(), "no repeat, no draft");
        assert!(p.lookup(&[], 3).is_empty());
    }

    #[test]
    fn min_n_is_respected() {
        let p = proposer(2, 3);
        assert!(p.lookup(&[1, 2, 3, 4, 2], 2).is_empty(), "a 1-gram match is below min_n");
    }

    #[test]
    fn bad_config_is_an_error() {
        assert!(NgramProposer::new(NgramConfig { min_n: 3, max_n: 2, confidence: 0.5 }).is_err());
        assert!(NgramProposer::new(NgramConfig { min_n: 0, max_n: 2, confidence: 0.5 }).is_err());
    }
}
