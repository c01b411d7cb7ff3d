//! Speculation policy, device-free.
