//! `sparkd-spec`: speculation policy, device-free.
//!
//! What to draft and how much of it to verify, and what came of it: proposers behind one trait
//! ([`draft::Proposer`]: SuffixDecoding trees, n-gram lookup, model drafts from the runner's DSpark
//! drafter (the kernels' `Drafter` capability), and the hybrid rule between them), verify budgets ([`budget`]: DSpark Algorithm 1, the
//! production stale-capacity/top-K variant, a static threshold) over an SPS(B) profile ([`sps`], with
//! the drafter's cost), online calibration of survivals from verified rounds ([`calibration`]), the gate that
//! skips model-drafting rounds which cannot pay ([`gate`]), and acceptance statistics ([`stats`]). The acceptance rule itself runs in the runner, where the
//! distributions are (`sparkd_kernels::acceptance`); forced-acceptance schedules live there too and
//! are re-exported here so benchmarks and the engine share one definition.
//!
//! Invariants: nothing here sees a distribution or a device type; every budget is non-anticipating
//! (it never depends on the value of the token it admits).

pub mod budget;
pub mod calibration;
pub mod draft;
pub mod error;
pub mod forced;
pub mod gate;
pub mod hybrid;
pub mod ngram;
pub mod sps;
pub mod stats;
pub mod suffix;

pub use budget::{BudgetPolicy, BudgetRow, ProductionBudget};
pub use calibration::{Calibration, Calibrations};
pub use draft::{Draft, DraftSource, Proposer, RoundRow, SeqKey};
pub use error::{Result, SpecError};
pub use forced::ForcedAcceptance;
pub use gate::{DraftGate, GateDecision, GateInput};
pub use hybrid::{HybridProposer, HybridRule, ModelDrafts};
pub use sparkd_kernels::acceptance::SyntheticSchedule;
pub use sps::{DraftPoint, SpsProfile};
pub use stats::{AiperfSpeculativeDecoding, RequestSpecStats, SpecCounters};
