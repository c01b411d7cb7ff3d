//! DSpark: the drafter network (DFlash backbone with KV injection of target hidden states, a Markov
//! head and a confidence head), its checkpoint, its per-sequence context cache, and the glue that
//! lets a runner draft and verify with it ([`DrafterSource`] is what every backend's `Runner::attach_drafter`
//! takes).
//!
//! Invariants (each module states its own in detail):
//! - The drafter owns only its own weights; embedding and lm_head are the target's, read in place.
//! - A sequence's drafter context always covers exactly the target's committed tokens, so commit and
//!   rollback of a verify window move both together.
//! - Draft distributions `q` never leave the runner; callers see tokens and confidences only.
//!
//! Source: shared/reference/dspark.md §1–§2.4 and §4 (DSpark paper, DeepSpec, vLLM's speculator).

pub mod config;
pub mod model;
pub mod runner;
pub mod schema;
pub mod source;
pub mod state;
pub mod synth;

pub use config::{target_active_bytes, DrafterConfig};
pub use model::{BlockDraft, DrafterModel, TargetHead};
pub use runner::DrafterSlot;
pub use schema::{drafter_tensors, DrafterCheckpoint, DRAFTER_DIR};
pub use source::DrafterSource;
pub use state::DrafterState;
pub use synth::{write_drafter_checkpoint, SyntheticDrafterWeights};
