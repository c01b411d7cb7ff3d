//! CUDA graphs of the decode and verify steps: which step shapes are captured, and the captured steps.
//!
//! Invariants:
//! - A step is captured by its [`StepShape`]: every row's window (tokens, first logits position,
//!   snapshots), the MLA split count of the step, the tapped layers and the device address of the step
//!   table. Everything else a captured launch reads through a fixed address: the weights, the step table
//!   (rewritten before each replay, see `cuda::step`), and the graph's own buffers. Temporaries are
//!   allocated and freed inside the graph (stream-ordered memory nodes), so a graph is self-contained and
//!   can be replayed any number of times.
//! - A shape is captured the second time it is seen ([`GraphCache::decide`]): one-off shapes (a prefill
//!   chunk, an odd batch) run eagerly and cost no capture. When the step table moves (its buffer grew),
//!   every graph captured against the old one is dropped: it could never be replayed again. At most [`MAX_GRAPHS`] are kept; the least
//!   recently used one is dropped first. A step that needs a routing trace, a profile or cuBLAS is never
//!   captured (the caller decides; see `DeviceModel::forward_tapped`).
//! - A shape whose capture fails runs eagerly from then on ([`GraphCache::refuse`]): a driver that cannot
//!   capture some step costs that step its graph, never the step itself.
//! - The outputs of a replay (logits and taps) are copied out of the graph's buffers into fresh ones,
//!   so an output outlives later replays of the same graph, as an eager step's does.
//! - Batch-size buckets: a decode step of `b` rows is captured for exactly `b` rows (a bucket of one).
//!   Padding rows up to a coarser bucket would make every row pay the largest batch's MoE and attention
//!   work; with capture on second sight and the LRU bound, the daemon's batch sizes each get a graph
//!   after one eager step.

use std::collections::HashMap;

use cudarc::driver::{CudaGraph, CudaSlice};
use half::bf16;

use crate::cuda::launch::DPtr;

/// The most captured steps kept at once.
pub const MAX_GRAPHS: usize = 64;

/// Windows longer than this many tokens are never captured (prefill chunks; they are long enough that
/// launch overhead is a small part of their time).
pub const GRAPH_MAX_WINDOW: usize = 16;

/// One row's window in a step shape.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct RowShape {
    pub tokens: usize,
    pub logits_from: usize,
    pub snapshots_from: Option<usize>,
}

/// What identifies a captured step (see the module invariants).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct StepShape {
    pub rows: Vec<RowShape>,
    pub mla_splits: usize,
    pub tap_layers: Vec<usize>,
    pub table: DPtr,
}

/// What to do with a step of a given shape.
#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run it eagerly (first sight).
    Eager,
    /// Capture it into a graph, then replay the graph.
    Capture,
    /// Replay the graph captured before.
    Replay,
}

struct Entry<G> {
    graph: Option<G>,
    /// Its capture failed: always eager.
    refused: bool,
    last_used: u64,
}

/// The captured steps by shape, with the capture policy of the module invariants. Generic over the
/// captured payload so the policy is tested without a GPU.
pub struct GraphCache<G> {
    entries: HashMap<StepShape, Entry<G>>,
    /// The step table address of the entries.
    table: DPtr,
    clock: u64,
    /// Graphs captured, replays served and captures that failed since the cache was made, and the last
    /// failure's error.
    pub captured: u64,
    pub replayed: u64,
    pub capture_failures: u64,
    pub last_capture_error: Option<String>,
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        GraphCache {
            entries: HashMap::new(),
            table: 0,
            clock: 0,
            captured: 0,
            replayed: 0,
            capture_failures: 0,
            last_capture_error: None,
        }
    }
}

impl<G> GraphCache<G> {
    /// Records a step of `shape` and says how to run it.
    pub fn decide(&mut self, shape: &StepShape) -> Decision {
        if shape.table != self.table {
            self.entries.clear();
            self.table = shape.table;
        }
        self.clock += 1;
        let clock = self.clock;
        if let Some(e) = self.entries.get_mut(shape) {
            e.last_used = clock;
            return match (&e.graph, e.refused) {
                (Some(_), _) => Decision::Replay,
                (None, true) => Decision::Eager,
                (None, false) => Decision::Capture,
            };
        }
        if self.entries.len() >= MAX_GRAPHS {
            if let Some(oldest) = self.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone()) {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(shape.clone(), Entry { graph: None, refused: false, last_used: clock });
        Decision::Eager
    }

    /// Keeps the graph captured for `shape`.
    pub fn store(&mut self, shape: &StepShape, graph: G) {
        self.captured += 1;
        let clock = self.clock;
        self.entries.insert(shape.clone(), Entry { graph: Some(graph), refused: false, last_used: clock });
    }

    /// Records that capturing `shape` failed with `error`: the shape runs eagerly from now on.
    pub fn refuse(&mut self, shape: &StepShape, error: String) {
        self.capture_failures += 1;
        self.last_capture_error = Some(error);
        let clock = self.clock;
        self.entries.insert(shape.clone(), Entry { graph: None, refused: true, last_used: clock });
    }

    /// The graph of `shape`, counted as a replay.
    pub fn replay(&mut self, shape: &StepShape) -> Option<&G> {
        let g = self.entries.get(shape)?.graph.as_ref()?;
        self.replayed += 1;
        Some(g)
    }

    /// Drops every graph (their buffers and memory go with them).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Graphs held now.
    pub fn held(&self) -> usize {
        self.entries.values().filter(|e| e.graph.is_some()).count()
    }
}

/// A captured step: the executable graph and the buffers its outputs land in.
pub struct CapturedStep {
    pub graph: CudaGraph,
    /// Nodes of the graph (kernels, memsets, copies, memory nodes, event edges).
    pub nodes: usize,
    /// `[logits rows, vocab]`
    pub logits: CudaSlice<bf16>,
    /// `[taps, tokens, d]`, when the step taps layers.
    pub taps: Option<CudaSlice<bf16>>,
}

// SAFETY: CUDA graph objects are not bound to a thread; they need external serialisation, which the
// model's lock around its `GraphCache` gives (the graph is only launched or dropped under it).
unsafe impl Send for CapturedStep {}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(rows: usize, tokens: usize) -> StepShape {
        StepShape {
            rows: vec![RowShape { tokens, logits_from: 0, snapshots_from: None }; rows],
            mla_splits: 1,
            tap_layers: vec![],
            table: 0x1000,
        }
    }

    #[test]
    fn a_shape_is_captured_on_second_sight_and_replayed_after() {
        let mut c = GraphCache::<u32>::default();
        let s = shape(4, 1);
        assert_eq!(c.decide(&s), Decision::Eager);
        assert_eq!(c.decide(&s), Decision::Capture);
        c.store(&s, 7);
        assert_eq!(c.decide(&s), Decision::Replay);
        assert_eq!(c.replay(&s), Some(&7));
        assert_eq!((c.captured, c.replayed, c.held()), (1, 1, 1));
        // Any difference in the shape is another graph: the rows, a window, the table address.
        let mut other = s.clone();
        other.rows[2].snapshots_from = Some(1);
        assert_eq!(c.decide(&other), Decision::Eager);
        assert_eq!(c.decide(&shape(3, 1)), Decision::Eager);
        assert_eq!(c.replay(&shape(3, 1)), None);
        // A moved step table drops every graph captured against the old one.
        let mut moved = s.clone();
        moved.table = 0x2000;
        assert_eq!(c.decide(&moved), Decision::Eager);
        assert_eq!(c.held(), 0);
        assert_eq!(c.decide(&s), Decision::Eager);
    }

    #[test]
    fn a_shape_whose_capture_failed_stays_eager() {
        let mut c = GraphCache::<u32>::default();
        let s = shape(2, 1);
        assert_eq!(c.decide(&s), Decision::Eager);
        assert_eq!(c.decide(&s), Decision::Capture);
        c.refuse(&s, "capture unsupported".into());
        for _ in 0..3 {
            assert_eq!(c.decide(&s), Decision::Eager);
        }
        assert!(c.replay(&s).is_none());
        assert_eq!((c.captured, c.capture_failures, c.held()), (0, 1, 0));
        assert_eq!(c.last_capture_error.as_deref(), Some("capture unsupported"));
        // Other shapes still get graphs.
        let t = shape(3, 1);
        c.decide(&t);
        assert_eq!(c.decide(&t), Decision::Capture);
    }

    #[test]
    fn the_least_recently_used_shape_goes_first_when_full() {
        let mut c = GraphCache::<usize>::default();
        for b in 0..MAX_GRAPHS {
            let s = shape(b + 1, 1);
            c.decide(&s);
            c.decide(&s);
            c.store(&s, b);
        }
        assert_eq!(c.held(), MAX_GRAPHS);
        // Touch batch 1 so batch 2 is the oldest, then a new shape evicts batch 2 only.
        assert_eq!(c.decide(&shape(1, 1)), Decision::Replay);
        assert_eq!(c.decide(&shape(1, 7)), Decision::Eager);
        assert_eq!(c.held(), MAX_GRAPHS - 1);
        assert!(c.replay(&shape(2, 1)).is_none());
        assert_eq!(c.replay(&shape(1, 1)), Some(&0));
        assert_eq!(c.replay(&shape(3, 1)), Some(&2));
        c.clear();
        assert_eq!(c.held(), 0);
    }
}
