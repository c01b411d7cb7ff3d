//! The server's own counters around a run: a parser of the Prometheus text format (version 0.0.4, what
//! `GET /metrics` serves) and the deltas the report shows ([`ServerStats`]).
//!
//! Invariants:
//! - Parsing is strict: a line that is neither blank, a `#` comment nor a well-formed sample is an error naming
//!   its line number, so a server that serves something else is reported, never half-read.
//! - Counters are looked up by vLLM's names (agentx.md §5; sparkd exports the same, `daemon/src/metrics.rs`),
//!   exposed with the `_total` suffix (the bare name is accepted too), summed over every label but the one a
//!   section splits by (`position`, `tier`).
//! - A delta is `after − before`; a counter that went down was reset (the server restarted), and then counts
//!   from zero: `after`, as Prometheus' `increase` does. A series missing before the run counts from zero.
//! - A section is `None` when the server does not export its counters: the report then says "not reported by
//!   the server". A section that is present with zero counts (speculation off) is a measurement, not a gap.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{ReplayError, Result};

/// One sample line: `name{label="value",...} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Labels,
    pub value: f64,
}

/// Every sample of one `/metrics` answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    pub samples: Vec<Sample>,
}

impl Scrape {
    /// Parses the text format; `source` names the scrape in errors.
    pub fn parse(source: &str, text: &str) -> Result<Scrape> {
        let mut samples = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let sample = parse_sample(line)
                .map_err(|reason| ReplayError::Protocol(format!("{source}: line {}: {reason}: {line:.120}", i + 1)))?;
            samples.push(sample);
        }
        Ok(Scrape { samples })
    }

    /// The samples of a counter, by its name with `_total` or, failing that, without.
    fn counter_samples(&self, base: &str) -> Vec<&Sample> {
        let total = format!("{base}_total");
        let with_total: Vec<&Sample> = self.samples.iter().filter(|s| s.name == total).collect();
        if with_total.is_empty() {
            self.samples.iter().filter(|s| s.name == base).collect()
        } else {
            with_total
        }
    }

    /// A counter summed over all its series; `None` when the server does not export it.
    pub fn counter(&self, base: &str) -> Option<f64> {
        let samples = self.counter_samples(base);
        (!samples.is_empty()).then(|| samples.iter().map(|s| s.value).sum())
    }

    /// A counter summed per value of `label` (series without the label are left out); `None` when the server
    /// does not export it.
    pub fn counter_by(&self, base: &str, label: &str) -> Option<BTreeMap<String, f64>> {
        let samples = self.counter_samples(base);
        if samples.is_empty() {
            return None;
        }
        let mut out = BTreeMap::new();
        for s in samples {
            if let Some((_, v)) = s.labels.iter().find(|(k, _)| k == label) {
                *out.entry(v.clone()).or_insert(0.0) += s.value;
            }
        }
        Some(out)
    }
}

fn is_name_char(c: char, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || (!first && c.is_ascii_digit())
}

/// Parses one sample line (`name{label="value",...} value [timestamp]`); the error says what is wrong with it.
pub fn parse_sample(line: &str) -> std::result::Result<Sample, String> {
    let name_end = line.find(|c: char| !is_name_char(c, false)).unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || !name.starts_with(|c| is_name_char(c, true)) {
        return Err("no metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(after_brace)?;
        labels = parsed;
        rest = after;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = parse_value(value).ok_or_else(|| format!("value {value:?} is not a number"))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("text after the timestamp".into());
    }
    Ok(Sample { name: name.to_owned(), labels, value })
}

/// A sample's labels, in order.
pub type Labels = Vec<(String, String)>;

/// Parses `a="x",b="y"}` (after the opening brace); returns the labels and the text after the closing brace.
fn parse_labels(mut s: &str) -> std::result::Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let key_end = s.find(|c: char| !is_name_char(c, false)).unwrap_or(s.len());
        let key = &s[..key_end];
        if key.is_empty() || key.contains(':') {
            return Err("bad label name".into());
        }
        s = s[key_end..].trim_start().strip_prefix('=').ok_or("label without `=`")?;
        s = s.trim_start().strip_prefix('"').ok_or("label value without a quote")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err("bad escape in a label value".into()),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_owned(), value));
        s = s[end + 1..].trim_start();
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse().ok(),
    }
}

/// How much a counter grew over the run (see the module invariants for resets); a count, so never negative.
fn increase(before: Option<f64>, after: f64) -> u64 {
    let grew = match before {
        Some(b) if after >= b => after - b,
        _ => after,
    };
    if grew.is_finite() && grew > 0.0 {
        grew.round() as u64
    } else {
        0
    }
}

/// Speculative decoding over the run: vLLM's `spec_decode` counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecCounters {
    /// Verify rounds that carried drafts (`vllm:spec_decode_num_drafts`).
    pub drafts: u64,
    /// Draft tokens proposed (`vllm:spec_decode_num_draft_tokens`).
    pub draft_tokens: u64,
    /// Draft tokens accepted, bonus token excluded (`vllm:spec_decode_num_accepted_tokens`).
    pub accepted_tokens: u64,
    /// Rounds in which the draft token at position `j` (0-based) was accepted
    /// (`vllm:spec_decode_num_accepted_tokens_per_pos{position="j"}`).
    pub accepted_per_position: Vec<u64>,
}

impl SpecCounters {
    /// Mean tokens committed per verify round, `1 + accepted / drafts`; `None` without drafts.
    pub fn acceptance_length(&self) -> Option<f64> {
        (self.drafts > 0).then(|| 1.0 + self.accepted_tokens as f64 / self.drafts as f64)
    }

    /// `accepted / drafted` tokens; `None` without drafts.
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.draft_tokens > 0).then(|| self.accepted_tokens as f64 / self.draft_tokens as f64)
    }

    /// Per draft position (0-based), the share of verify rounds that accepted it (vLLM's per-position rate).
    pub fn position_rates(&self) -> Vec<f64> {
        if self.drafts == 0 {
            return Vec::new();
        }
        self.accepted_per_position.iter().map(|&a| a as f64 / self.drafts as f64).collect()
    }
}

/// The prefix cache over the run, in prompt tokens (`vllm:prefix_cache_queries` / `_hits`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefixCacheCounters {
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

impl PrefixCacheCounters {
    pub fn hit_rate(&self) -> Option<f64> {
        (self.queried_tokens > 0).then(|| self.hit_tokens as f64 / self.queried_tokens as f64)
    }
}

/// Continuations of kept responses (`previous_response_id`) over the run, by where their state came from
/// (`sparkd:sessions_restored_total{tier}`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeptStateCounters {
    /// The state was still on the device.
    pub from_device: u64,
    /// The state came back from host memory.
    pub from_host: u64,
    /// The state was gone and rebuilt by prefill.
    pub rebuilt: u64,
}

impl KeptStateCounters {
    /// Share of continuations whose kept state was reused (device or host) rather than rebuilt.
    pub fn reuse_rate(&self) -> Option<f64> {
        let all = self.from_device + self.from_host + self.rebuilt;
        (all > 0).then(|| (self.from_device + self.from_host) as f64 / all as f64)
    }
}

/// What the server's counters say about one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerStats {
    pub spec: Option<SpecCounters>,
    pub prefix_cache: Option<PrefixCacheCounters>,
    pub kept_state: Option<KeptStateCounters>,
}

const DRAFTS: &str = "vllm:spec_decode_num_drafts";
const DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens";
const ACCEPTED: &str = "vllm:spec_decode_num_accepted_tokens";
const ACCEPTED_PER_POS: &str = "vllm:spec_decode_num_accepted_tokens_per_pos";
const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries";
const PREFIX_HITS: &str = "vllm:prefix_cache_hits";
const RESTORED: &str = "sparkd:sessions_restored";

impl ServerStats {
    /// The counters' growth from `before` to `after`.
    pub fn between(before: &Scrape, after: &Scrape) -> ServerStats {
        let grew = |name: &str| after.counter(name).map(|a| increase(before.counter(name), a));
        let grew_by = |name: &str, label: &str| -> Option<BTreeMap<String, u64>> {
            let earlier = before.counter_by(name, label).unwrap_or_default();
            let now = after.counter_by(name, label)?;
            Some(now.into_iter().map(|(k, a)| (k.clone(), increase(earlier.get(&k).copied(), a))).collect())
        };
        let spec = grew(DRAFTS).map(|drafts| {
            let per_pos = grew_by(ACCEPTED_PER_POS, "position").unwrap_or_default();
            let positions: BTreeMap<usize, u64> =
                per_pos.into_iter().filter_map(|(k, v)| Some((k.parse::<usize>().ok()?, v))).collect();
            let len = positions.keys().next_back().map_or(0, |&last| last + 1);
            let mut accepted_per_position = vec![0; len];
            for (p, v) in positions {
                accepted_per_position[p] = v;
            }
            // Positions never accepted in the run are trailing zeros: cut them, they say nothing.
            while accepted_per_position.last() == Some(&0) {
                accepted_per_position.pop();
            }
            SpecCounters {
                drafts,
                draft_tokens: grew(DRAFT_TOKENS).unwrap_or(0),
                accepted_tokens: grew(ACCEPTED).unwrap_or(0),
                accepted_per_position,
            }
        });
        let prefix_cache = match (grew(PREFIX_QUERIES), grew(PREFIX_HITS)) {
            (Some(queried_tokens), Some(hit_tokens)) => Some(PrefixCacheCounters { queried_tokens, hit_tokens }),
            _ => None,
        };
        let kept_state = grew_by(RESTORED, "tier").map(|tiers| {
            let tier = |t: &str| tiers.get(t).copied().unwrap_or(0);
            KeptStateCounters { from_device: tier("device"), from_host: tier("host"), rebuilt: tier("prefill") }
        });
        ServerStats { spec, prefix_cache, kept_state }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_escapes_special_values_and_timestamps() {
        let text = "# HELP x help\n# TYPE x counter\n\
                    x_total{model_name=\"k3\",engine=\"0\"} 12\n\
                    y{a=\"q\\\"uote\\\\ \\n\",} +Inf 1700000000000\n\
                    z NaN\n\n";
        let s = Scrape::parse("t", text).expect("parses");
        assert_eq!(s.samples.len(), 3);
        assert_eq!(s.samples[0].labels, vec![("model_name".into(), "k3".into()), ("engine".into(), "0".into())]);
        assert_eq!(s.samples[1].labels, vec![("a".into(), "q\"uote\\ \n".into())]);
        assert_eq!(s.samples[1].value, f64::INFINITY);
        assert!(s.samples[2].value.is_nan());
        assert_eq!(s.counter("x"), Some(12.0));
        assert_eq!(s.counter("w"), None);
    }

    #[test]
    fn a_malformed_line_is_an_error_naming_it() {
        for (text, line) in [
            ("ok 1\n<html>\n", 2),
            ("ok 1\nx{a=\"b} 1\n", 2),
            ("x{a=b} 1\n", 1),
            ("x one\n", 1),
            ("x 1 2 3\n", 1),
            ("x\n", 1),
        ] {
            let err = Scrape::parse("GET /metrics", text).expect_err(text).to_string();
            assert!(err.contains(&format!("GET /metrics: line {line}:")), "{text:?}: {err}");
        }
    }

    const BEFORE: &str = "vllm:spec_decode_num_drafts_total{engine=\"0\"} 10\n\
        vllm:spec_decode_num_draft_tokens_total 40\n\
        vllm:spec_decode_num_accepted_tokens_total 20\n\
        vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 9\n\
        vllm:prefix_cache_queries_total 1000\nvllm:prefix_cache_hits_total 100\n\
        sparkd:sessions_restored_total{tier=\"device\"} 1\n";
    const AFTER: &str = "vllm:spec_decode_num_drafts_total{engine=\"0\"} 110\n\
        vllm:spec_decode_num_draft_tokens_total 440\n\
        vllm:spec_decode_num_accepted_tokens_total 170\n\
        vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 99\n\
        vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 50\n\
        vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"} 10\n\
        vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"3\"} 0\n\
        vllm:prefix_cache_queries_total 3000\nvllm:prefix_cache_hits_total 1600\n\
        sparkd:sessions_restored_total{tier=\"device\"} 7\nsparkd:sessions_restored_total{tier=\"host\"} 1\n\
        sparkd:sessions_restored_total{tier=\"prefill\"} 2\n";

    #[test]
    fn deltas_follow_the_counters_over_the_run() {
        let stats = ServerStats::between(&Scrape::parse("b", BEFORE).unwrap(), &Scrape::parse("a", AFTER).unwrap());
        let spec = stats.spec.expect("spec counters");
        assert_eq!((spec.drafts, spec.draft_tokens, spec.accepted_tokens), (100, 400, 150));
        // Position 1 and 2 appeared during the run (counted from zero); position 3 never accepted is cut.
        assert_eq!(spec.accepted_per_position, vec![90, 50, 10]);
        assert_eq!(spec.acceptance_length(), Some(2.5));
        assert_eq!(spec.acceptance_rate(), Some(0.375));
        assert_eq!(spec.position_rates(), vec![0.9, 0.5, 0.1]);
        let cache = stats.prefix_cache.expect("prefix cache counters");
        assert_eq!(cache.hit_rate(), Some(0.75));
        let kept = stats.kept_state.expect("kept-state counters");
        assert_eq!((kept.from_device, kept.from_host, kept.rebuilt), (6, 1, 2));
        assert_eq!(kept.reuse_rate(), Some(7.0 / 9.0));
    }

    #[test]
    fn missing_counters_are_none_and_a_reset_counts_from_zero() {
        let other = Scrape::parse("a", "process_cpu_seconds_total 3\n").unwrap();
        assert_eq!(ServerStats::between(&Scrape::default(), &other), ServerStats::default());
        let off = Scrape::parse("a", "vllm:spec_decode_num_drafts_total 0\n").unwrap();
        let spec = ServerStats::between(&off, &off).spec.expect("exported at zero: present");
        assert_eq!((spec.drafts, spec.acceptance_length()), (0, None));
        let restarted = Scrape::parse("a", "vllm:prefix_cache_queries 5\nvllm:prefix_cache_hits 2\n").unwrap();
        let before = Scrape::parse("b", BEFORE).unwrap();
        let cache = ServerStats::between(&before, &restarted).prefix_cache.unwrap();
        assert_eq!((cache.queried_tokens, cache.hit_tokens), (5, 2));
    }
}
