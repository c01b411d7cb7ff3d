//! The speculative-decoding settings of `sparkd serve`: the `--spec*` command-line flags and their validation
//! into a [`SpeculationConfig`] (start-up turns it into a runner's drafter, a proposer and a verify budget).
//!
//! Invariants:
//! - [`SpecArgs::to_config`] rejects every inconsistent combination with a [`SpecSettingError`]
//!   naming the flag, before anything is loaded; a [`SpeculationConfig`] that exists is usable as it is.
//! - `--spec off` (the default) means no proposer, no drafts, no spec metrics beyond zeros: the
//!   engine behaves exactly as without speculation.
//! - A forced acceptance length (`--spec-synthetic-al`, vLLM's `synthetic_acceptance_length`) becomes the
//!   kernels' one schedule definition (`SyntheticSchedule::from_acceptance_length`); start-up sets it on the
//!   runner and hands the same schedule to the engine, so the engine flags exactly the rounds the runner forced.
//! - The per-request override (`speculation.num_tokens`) can only lower ℓ: it is capped by
//!   `num_spec_tokens`, the server's maximum.
//! - Without `--spec-budget` the budget follows the method: `production` for the model-drafting methods
//!   (`dspark`, `hybrid`: DSpark §5.2, so drafts that will not pay are not verified and drafter rounds that
//!   cannot pay are skipped), `static` for the model-free ones and whenever `--spec-synthetic-al` or
//!   `--spec-threshold` asks for a fixed rule.

use std::path::PathBuf;

use sparkd_spec::suffix::SuffixConfig;
use sparkd_spec::{ForcedAcceptance, SpsProfile, SyntheticSchedule};

/// ℓ when `--spec dspark` is given without `--num-spec-tokens` (DSpark's γ = 7, dspark.md §1.3).
pub const DSPARK_DEFAULT_NUM_SPEC_TOKENS: usize = 7;
/// Most draft tokens a round may verify (the drafter's largest block, `dspark::config::MAX_BLOCK`).
pub const MAX_NUM_SPEC_TOKENS: usize = 64;

/// Where draft tokens come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecMethod {
    /// No speculation.
    #[default]
    Off,
    /// The runner's DSpark drafter (model drafts with confidences).
    Dspark,
    /// SuffixDecoding trees over each request's context and recent outputs (model-free).
    Suffix,
    /// N-gram prompt lookup (model-free).
    Ngram,
    /// The suffix draft when its score reaches the DSpark draft's expected accepted tokens, else DSpark.
    Hybrid,
}

impl SpecMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Off => "off",
            SpecMethod::Dspark => "dspark",
            SpecMethod::Suffix => "suffix",
            SpecMethod::Ngram => "ngram",
            SpecMethod::Hybrid => "hybrid",
        }
    }

    /// Whether the method needs the runner's DSpark drafter.
    pub fn needs_drafter(self) -> bool {
        matches!(self, SpecMethod::Dspark | SpecMethod::Hybrid)
    }
}

/// How many of the drafted tokens each step verifies (dspark.md §2.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecBudget {
    /// Every draft position whose survival probability is at least `--spec-threshold` (0: all).
    #[default]
    Static,
    /// DSpark Algorithm 1 over SPS(B): admit while the throughput estimate improves.
    Dspark,
    /// DSpark §5.2 / vLLM adaptive verification: stale capacity, current top-K allocation.
    Production,
}

/// A speculation flag with a value that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--{flag}: {reason}")]
pub struct SpecSettingError {
    pub flag: &'static str,
    pub reason: String,
}

fn bad(flag: &'static str, reason: impl Into<String>) -> SpecSettingError {
    SpecSettingError { flag, reason: reason.into() }
}

/// The `--spec*` flags of `sparkd serve`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct SpecArgs {
    /// Speculative decoding method.
    #[arg(long = "spec", value_enum, default_value_t = SpecMethod::Off)]
    pub method: SpecMethod,
    /// ℓ: most draft tokens verified per request per step (default 7 for dspark, the suffix tree
    /// depth, 24, otherwise). Requests may ask for fewer with `speculation: {"num_tokens": N}`.
    #[arg(long)]
    pub num_spec_tokens: Option<usize>,
    /// Forced mean acceptance length in [1, ℓ+1] (vLLM's synthetic_acceptance_length): real drafts
    /// are still made and emitted, but accepted by a fixed schedule; output is flagged synthetic.
    #[arg(long, value_name = "AL")]
    pub spec_synthetic_al: Option<f64>,
    /// Verify budget policy (default: production for dspark and hybrid, static for suffix and ngram and
    /// with --spec-synthetic-al or --spec-threshold).
    #[arg(long, value_enum)]
    pub spec_budget: Option<SpecBudget>,
    /// Survival-probability threshold of `--spec-budget static`, in [0, 1].
    #[arg(long, default_value_t = 0.0)]
    pub spec_threshold: f64,
    /// SPS(B) profile JSON for `--spec-budget dspark|production` (default: measured at start-up).
    #[arg(long, value_name = "FILE")]
    pub sps_profile: Option<PathBuf>,
}

/// The validated speculation settings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculationConfig {
    pub method: SpecMethod,
    /// ℓ, the server's maximum draft tokens per request per step (0 when off).
    pub num_spec_tokens: usize,
    pub budget: SpecBudget,
    pub threshold: f64,
    /// The forced-acceptance schedule to set on the runner, if any.
    pub synthetic: Option<SyntheticSchedule>,
    /// SPS(B) loaded from `--sps-profile`; `None` with a load-aware budget means "measure at start-up".
    pub sps_profile: Option<SpsProfile>,
}

impl SpecArgs {
    /// `--spec-budget`, or the method's default when it is not given.
    fn budget(&self) -> SpecBudget {
        match self.spec_budget {
            Some(budget) => budget,
            None if self.spec_synthetic_al.is_some() || self.spec_threshold > 0.0 => SpecBudget::Static,
            None if self.method.needs_drafter() => SpecBudget::Production,
            None => SpecBudget::Static,
        }
    }

    /// Validates the flags (and reads `--sps-profile`).
    pub fn to_config(&self) -> Result<SpeculationConfig, SpecSettingError> {
        if self.method == SpecMethod::Off {
            let stray = [
                ("num-spec-tokens", self.num_spec_tokens.is_some()),
                ("spec-synthetic-al", self.spec_synthetic_al.is_some()),
                ("spec-budget", self.spec_budget.is_some()),
                ("spec-threshold", self.spec_threshold != 0.0),
                ("sps-profile", self.sps_profile.is_some()),
            ];
            if let Some((flag, _)) = stray.iter().find(|(_, set)| *set) {
                return Err(bad(flag, "needs --spec dspark|suffix|ngram|hybrid"));
            }
            return Ok(SpeculationConfig::default());
        }
        let default_len = match self.method {
            SpecMethod::Dspark => DSPARK_DEFAULT_NUM_SPEC_TOKENS,
            _ => SuffixConfig::default().max_tree_depth,
        };
        let num_spec_tokens = self.num_spec_tokens.unwrap_or(default_len);
        if !(1..=MAX_NUM_SPEC_TOKENS).contains(&num_spec_tokens) {
            return Err(bad("num-spec-tokens", format!("{num_spec_tokens} is not in 1..={MAX_NUM_SPEC_TOKENS}")));
        }
        if !(0.0..=1.0).contains(&self.spec_threshold) {
            return Err(bad("spec-threshold", format!("{} is not in [0, 1]", self.spec_threshold)));
        }
        let budget = self.budget();
        if self.spec_threshold > 0.0 && budget != SpecBudget::Static {
            return Err(bad("spec-threshold", "only applies to --spec-budget static"));
        }
        let synthetic = match self.spec_synthetic_al {
            None => None,
            Some(al) => {
                if budget != SpecBudget::Static || self.spec_threshold > 0.0 {
                    return Err(bad(
                        "spec-synthetic-al",
                        "a forced acceptance length verifies every draft; it cannot be combined with a budget or a threshold",
                    ));
                }
                let schedule = ForcedAcceptance::Length(al)
                    .schedule(num_spec_tokens)
                    .map_err(|e| bad("spec-synthetic-al", e.to_string()))?;
                Some(schedule)
            }
        };
        let sps_profile = match &self.sps_profile {
            None => None,
            Some(_) if budget == SpecBudget::Static => {
                return Err(bad("sps-profile", "only used by --spec-budget dspark|production"));
            }
            Some(path) => Some(SpsProfile::load(path).map_err(|e| bad("sps-profile", e.to_string()))?),
        };
        Ok(SpeculationConfig {
            method: self.method,
            num_spec_tokens,
            budget,
            threshold: self.spec_threshold,
            synthetic,
            sps_profile,
        })
    }
}

impl SpeculationConfig {
    pub fn is_on(&self) -> bool {
        self.method != SpecMethod::Off
    }

    /// Whether the budget needs SPS(B) and none was loaded.
    pub fn needs_measured_profile(&self) -> bool {
        self.is_on() && self.budget != SpecBudget::Static && self.sps_profile.is_none()
    }

    /// Checks that a runner which cannot take these settings is not asked to (the null runner has
    /// no drafter and no forced acceptance).
    pub fn check_null_runner(&self) -> Result<(), SpecSettingError> {
        if self.method.needs_drafter() {
            return Err(bad("spec", format!("{} needs a DSpark drafter; use --device cpu", self.method.as_str())));
        }
        if self.synthetic.is_some() {
            return Err(bad("spec-synthetic-al", "the null runner has no forced acceptance; use --device cpu"));
        }
        Ok(())
    }
}

/// One line for the start-up log.
pub fn describe(cfg: &SpeculationConfig) -> String {
    if !cfg.is_on() {
        return "speculation off".into();
    }
    let forced = cfg
        .synthetic
        .as_ref()
        .map_or(String::new(), |s| format!(", forced AL {:.3} (synthetic)", s.mean_acceptance_length()));
    format!("speculation {} (ℓ = {}, budget {:?}{forced})", cfg.method.as_str(), cfg.num_spec_tokens, cfg.budget)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        spec: SpecArgs,
    }

    fn parse(args: &[&str]) -> Result<SpeculationConfig, SpecSettingError> {
        let mut all = vec!["sparkd"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).expect("parses").spec.to_config()
    }

    #[test]
    fn defaults_are_off_and_lengths_follow_the_method() {
        assert_eq!(parse(&[]).unwrap(), SpeculationConfig::default());
        assert_eq!(parse(&["--spec", "dspark"]).unwrap().num_spec_tokens, 7);
        assert_eq!(parse(&["--spec", "suffix"]).unwrap().num_spec_tokens, 24);
        assert_eq!(parse(&["--spec", "ngram", "--num-spec-tokens", "3"]).unwrap().num_spec_tokens, 3);
        assert_eq!(parse(&["--spec", "suffix", "--num-spec-tokens", "5"]).unwrap().num_spec_tokens, 5);
    }

    #[test]
    fn the_default_budget_follows_the_method() {
        let budget = |args: &[&str]| parse(args).unwrap().budget;
        assert_eq!(budget(&["--spec", "dspark"]), SpecBudget::Production);
        assert_eq!(budget(&["--spec", "hybrid"]), SpecBudget::Production);
        assert_eq!(budget(&["--spec", "suffix"]), SpecBudget::Static);
        assert_eq!(budget(&["--spec", "ngram"]), SpecBudget::Static);
        assert_eq!(budget(&["--spec", "dspark", "--spec-budget", "static"]), SpecBudget::Static);
        assert_eq!(budget(&["--spec", "dspark", "--spec-synthetic-al", "3"]), SpecBudget::Static);
        assert_eq!(budget(&["--spec", "dspark", "--spec-threshold", "0.2"]), SpecBudget::Static);
        assert_eq!(budget(&["--spec", "suffix", "--spec-budget", "dspark"]), SpecBudget::Dspark);
        assert!(parse(&["--spec", "dspark"]).unwrap().needs_measured_profile());
        assert_eq!(parse(&["--spec-budget", "static"]).unwrap_err().flag, "spec-budget");
    }

    #[test]
    fn a_forced_length_becomes_the_kernels_schedule() {
        let c = parse(&["--spec", "dspark", "--spec-synthetic-al", "6"]).unwrap();
        let s = c.synthetic.unwrap();
        assert_eq!(s.rates(), &[1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert!((s.mean_acceptance_length() - 6.0).abs() < 1e-12);
    }

    #[test]
    fn bad_values_name_the_flag() {
        let flag = |args: &[&str]| parse(args).unwrap_err().flag;
        assert_eq!(flag(&["--num-spec-tokens", "3"]), "num-spec-tokens");
        assert_eq!(flag(&["--spec", "suffix", "--num-spec-tokens", "0"]), "num-spec-tokens");
        assert_eq!(flag(&["--spec", "suffix", "--num-spec-tokens", "65"]), "num-spec-tokens");
        assert_eq!(flag(&["--spec", "dspark", "--spec-synthetic-al", "9"]), "spec-synthetic-al");
        assert_eq!(flag(&["--spec", "dspark", "--spec-synthetic-al", "0.5"]), "spec-synthetic-al");
        assert_eq!(
            flag(&["--spec", "dspark", "--spec-synthetic-al", "3", "--spec-budget", "dspark"]),
            "spec-synthetic-al"
        );
        assert_eq!(flag(&["--spec", "suffix", "--spec-threshold", "1.5"]), "spec-threshold");
        assert_eq!(flag(&["--spec", "suffix", "--spec-threshold", "0.5", "--spec-budget", "dspark"]), "spec-threshold");
        assert_eq!(flag(&["--spec", "suffix", "--sps-profile", "/nope.json"]), "sps-profile");
        let missing =
            parse(&["--spec", "suffix", "--spec-budget", "dspark", "--sps-profile", "/nope.json"]).unwrap_err();
        assert!(missing.to_string().contains("/nope.json"), "{missing}");
        assert!(Cli::try_parse_from(["sparkd", "--spec", "medusa"]).is_err());
        let null = parse(&["--spec", "hybrid"]).unwrap().check_null_runner().unwrap_err();
        assert_eq!(null.flag, "spec");
    }

    #[test]
    fn a_profile_file_is_loaded_for_load_aware_budgets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sps.json");
        std::fs::write(&path, r#"{"points": [{"batch_tokens": 1, "steps_per_second": 50.0}]}"#).unwrap();
        let c = parse(&["--spec", "suffix", "--spec-budget", "production", "--sps-profile", path.to_str().unwrap()])
            .unwrap();
        assert!(!c.needs_measured_profile());
        assert!((c.sps_profile.unwrap().sps(1) - 50.0).abs() < 1e-9);
        assert!(parse(&["--spec", "suffix", "--spec-budget", "dspark"]).unwrap().needs_measured_profile());
    }
}
