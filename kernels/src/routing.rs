//! The routing trace type both backends record: which experts a token chose at one MoE layer, with
//! their combine weights and how close the choice was to a tie.
//!
//! Invariants: `experts` ascend and have the layer's top-k length; `weights[i]` is the combine weight of
//! `experts[i]`; a trace of a step holds, per MoE layer, one [`Routing`] per token, tokens in row order
//! (`cpu::RoutingTrace`, `cuda::forward::DeviceModel::forward`). Neither backend's code lives here.

/// The experts chosen for one token and their combine weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing<F> {
    /// Chosen experts, ascending.
    pub experts: Vec<usize>,
    pub weights: Vec<F>,
    /// Selection score of the last chosen expert minus that of the best unchosen one (how close the
    /// decision was to a tie); 0 when every expert is chosen.
    pub margin: F,
}
