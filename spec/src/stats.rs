//! Speculation statistics, per request and global, in the forms the daemon exports.
//!
//! - [`SpecCounters`] are vLLM's counters (`vllm/v1/spec_decode/metrics.py`, dspark.md §4.5):
//!   `num_drafts` → `vllm:spec_decode_num_drafts`, `num_draft_tokens` →
//!   `vllm:spec_decode_num_draft_tokens`, `num_accepted_tokens` →
//!   `vllm:spec_decode_num_accepted_tokens`, `accepted_per_pos[i]` →
//!   `vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}`; plus `num_synthetic_drafts` for a
//!   `sparkd:` metric of forced acceptance.
//! - [`RequestSpecStats::to_aiperf`] builds the response-root `metrics.speculative_decoding` object
//!   AIPerf 0.13.0 reads (agentx.md §2.4, following vLLM PR #48915).
//!
//! Invariants:
//! - Only verify rounds that carried at least one draft token count as drafts (vLLM's definition).
//! - `Σ_i accepted_per_pos[i] == num_accepted_tokens`, and `accepted_per_pos[i]` counts rounds in
//!   which position i was accepted, so `accepted_per_pos[i] / num_drafts` is the unconditional rate.
//! - Mean acceptance length = `1 + num_accepted_tokens / num_drafts` (the bonus token included).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Result, SpecError};

/// Counters with vLLM's definitions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecCounters {
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    /// Accepted draft tokens (the bonus/correction token excluded).
    pub num_accepted_tokens: u64,
    /// `[position]`: rounds in which that draft position was accepted.
    pub accepted_per_pos: Vec<u64>,
    /// Rounds whose acceptance was forced (synthetic mode); included in `num_drafts`.
    pub num_synthetic_drafts: u64,
}

impl SpecCounters {
    /// Records one verify round of `draft_tokens` drafts of which `accepted` were accepted.
    pub fn record(&mut self, draft_tokens: usize, accepted: usize, synthetic: bool) -> Result<()> {
        if accepted > draft_tokens {
            return Err(SpecError::InvalidInput(format!("{accepted} accepted of only {draft_tokens} draft tokens")));
        }
        if draft_tokens == 0 {
            return Ok(());
        }
        self.num_drafts += 1;
        self.num_draft_tokens += draft_tokens as u64;
        self.num_accepted_tokens += accepted as u64;
        self.num_synthetic_drafts += u64::from(synthetic);
        if self.accepted_per_pos.len() < accepted {
            self.accepted_per_pos.resize(accepted, 0);
        }
        for slot in &mut self.accepted_per_pos[..accepted] {
            *slot += 1;
        }
        Ok(())
    }

    /// Adds another set of counters (a finished request into the global totals).
    pub fn merge(&mut self, other: &SpecCounters) {
        self.num_drafts += other.num_drafts;
        self.num_draft_tokens += other.num_draft_tokens;
        self.num_accepted_tokens += other.num_accepted_tokens;
        self.num_synthetic_drafts += other.num_synthetic_drafts;
        if self.accepted_per_pos.len() < other.accepted_per_pos.len() {
            self.accepted_per_pos.resize(other.accepted_per_pos.len(), 0);
        }
        for (mine, theirs) in self.accepted_per_pos.iter_mut().zip(&other.accepted_per_pos) {
            *mine += theirs;
        }
    }

    /// `1 + accepted / drafts`; `None` before the first draft.
    pub fn mean_acceptance_length(&self) -> Option<f64> {
        (self.num_drafts > 0).then(|| 1.0 + self.num_accepted_tokens as f64 / self.num_drafts as f64)
    }

    /// `accepted / draft tokens`; `None` before the first draft.
    pub fn draft_acceptance_rate(&self) -> Option<f64> {
        (self.num_draft_tokens > 0).then(|| self.num_accepted_tokens as f64 / self.num_draft_tokens as f64)
    }

    /// Unconditional per-position rates `accepted_per_pos[i] / num_drafts`.
    pub fn per_position_rates(&self) -> Vec<f64> {
        if self.num_drafts == 0 {
            return Vec::new();
        }
        self.accepted_per_pos.iter().map(|&n| n as f64 / self.num_drafts as f64).collect()
    }
}

/// One request's statistics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestSpecStats {
    counters: SpecCounters,
    /// accepted drafts per round → rounds.
    histogram: BTreeMap<usize, u64>,
    longest_draft: usize,
    /// `(drafted, accepted)` per round, kept only in detailed mode.
    per_step: Option<Vec<(u32, u32)>>,
}

/// AIPerf's `metrics.speculative_decoding` object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AiperfSpeculativeDecoding {
    /// `{"j": rounds}`: rounds in which exactly j drafts were accepted (bonus excluded), string keys.
    pub acceptance_histogram: BTreeMap<String, u64>,
    pub num_spec_steps: u64,
    pub mean_acceptance_length: f64,
    pub draft_acceptance_rate: f64,
    pub num_accepted_draft_tokens: u64,
    pub num_draft_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub num_spec_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub per_step_accepted: Option<Vec<u64>>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub per_step_drafted: Option<Vec<u64>>,
}

impl RequestSpecStats {
    /// `detailed` keeps per-round lists (vLLM `--per-request-spec-decode-metrics detailed`).
    pub fn new(detailed: bool) -> Self {
        RequestSpecStats { per_step: detailed.then(Vec::new), ..RequestSpecStats::default() }
    }

    pub fn record(&mut self, draft_tokens: usize, accepted: usize, synthetic: bool) -> Result<()> {
        self.counters.record(draft_tokens, accepted, synthetic)?;
        if draft_tokens == 0 {
            return Ok(());
        }
        *self.histogram.entry(accepted).or_insert(0) += 1;
        self.longest_draft = self.longest_draft.max(draft_tokens);
        if let Some(steps) = &mut self.per_step {
            steps.push((draft_tokens as u32, accepted as u32));
        }
        Ok(())
    }

    pub fn counters(&self) -> &SpecCounters {
        &self.counters
    }

    /// The AIPerf object; `None` when the request had no speculative round. The histogram lists every
    /// j from 0 to the longest draft (or `num_spec_tokens` when larger), zeros included.
    pub fn to_aiperf(&self, num_spec_tokens: Option<usize>) -> Option<AiperfSpeculativeDecoding> {
        let c = &self.counters;
        let mean_acceptance_length = c.mean_acceptance_length()?;
        let top = self.longest_draft.max(num_spec_tokens.unwrap_or(0));
        let acceptance_histogram =
            (0..=top).map(|j| (j.to_string(), self.histogram.get(&j).copied().unwrap_or(0))).collect();
        Some(AiperfSpeculativeDecoding {
            acceptance_histogram,
            num_spec_steps: c.num_drafts,
            mean_acceptance_length,
            draft_acceptance_rate: c.draft_acceptance_rate().unwrap_or(0.0),
            num_accepted_draft_tokens: c.num_accepted_tokens,
            num_draft_tokens: c.num_draft_tokens,
            num_spec_tokens: num_spec_tokens.map(|k| k as u64),
            per_step_accepted: self.per_step.as_ref().map(|s| s.iter().map(|&(_, a)| u64::from(a)).collect()),
            per_step_drafted: self.per_step.as_ref().map(|s| s.iter().map(|&(d, _)| u64::from(d)).collect()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_follow_vllm_definitions() {
        let mut c = SpecCounters::default();
        c.record(3, 3, false).unwrap();
        c.record(3, 1, false).unwrap();
        c.record(0, 0, false).unwrap();
        c.record(2, 0, true).unwrap();
        assert_eq!((c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens), (3, 8, 4));
        assert_eq!(c.accepted_per_pos, vec![2, 1, 1]);
        assert_eq!(c.accepted_per_pos.iter().sum::<u64>(), c.num_accepted_tokens);
        assert!((c.mean_acceptance_length().unwrap() - (1.0 + 4.0 / 3.0)).abs() < 1e-12);
        assert!((c.draft_acceptance_rate().unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(c.per_position_rates()[0], 2.0 / 3.0);
        assert_eq!(c.num_synthetic_drafts, 1);
        assert!(c.record(1, 2, false).is_err());
        assert_eq!(SpecCounters::default().mean_acceptance_length(), None);
    }

    #[test]
    fn merge_adds_counters() {
        let (mut a, mut b) = (SpecCounters::default(), SpecCounters::default());
        a.record(2, 1, false).unwrap();
        b.record(4, 4, false).unwrap();
        a.merge(&b);
        assert_eq!((a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens), (2, 6, 5));
        assert_eq!(a.accepted_per_pos, vec![2, 1, 1, 1]);
    }

    #[test]
    fn aiperf_object_has_the_fields_aiperf_reads() {
        let mut s = RequestSpecStats::new(true);
        s.record(4, 2, false).unwrap();
        s.record(4, 4, false).unwrap();
        s.record(4, 0, false).unwrap();
        let obj = s.to_aiperf(Some(4)).unwrap();
        let json = serde_json::to_value(&obj).unwrap();
        for key in [
            "acceptance_histogram",
            "num_spec_steps",
            "mean_acceptance_length",
            "draft_acceptance_rate",
            "num_accepted_draft_tokens",
            "num_draft_tokens",
            "num_spec_tokens",
            "per_step_accepted",
            "per_step_drafted",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert_eq!(json["acceptance_histogram"]["0"], 1);
        assert_eq!(json["acceptance_histogram"]["1"], 0);
        assert_eq!(json["acceptance_histogram"]["4"], 1);
        assert_eq!(json["num_spec_steps"], 3);
        assert_eq!(json["mean_acceptance_length"], 3.0);
        assert_eq!(json["per_step_accepted"], serde_json::json!([2, 4, 0]));
        let summary = RequestSpecStats::new(false);
        assert!(summary.to_aiperf(None).is_none(), "no speculative round, no object");
        let mut summary = RequestSpecStats::new(false);
        summary.record(2, 1, false).unwrap();
        let json = serde_json::to_value(summary.to_aiperf(None).unwrap()).unwrap();
        assert!(json.get("per_step_accepted").is_none() && json.get("num_spec_tokens").is_none());
    }
}
