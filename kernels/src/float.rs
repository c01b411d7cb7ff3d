//! The scalar types the CPU reference computes in.
//!
//! `f32` is the serving precision (with bf16 rounding of activations where K3 keeps them in bf16);
//! `f64` is the checking precision, where no activation is rounded, so that the forward can be
//! compared tightly with an independent float64 reference of the math.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point scalar of the CPU reference.
pub trait Real:
    Copy
    + Debug
    + Default
    + PartialOrd
    + Send
    + Sync
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    const ZERO: Self;
    const ONE: Self;
    /// True for the serving precision: activations K3 keeps in bf16 are rounded to bf16.
    const ROUNDS_TO_BF16: bool;

    fn from_f32(x: f32) -> Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn to_f32(self) -> f32;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn ln(self) -> Self;
    fn max(self, other: Self) -> Self;

    /// Rounds an activation to bf16 in the serving precision; identity in the checking precision.
    #[inline]
    fn act(self) -> Self {
        self
    }

    #[inline]
    fn sigmoid(self) -> Self {
        Self::ONE / (Self::ONE + (-self).exp())
    }

    #[inline]
    fn silu(self) -> Self {
        self * self.sigmoid()
    }
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const ROUNDS_TO_BF16: bool = true;

    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    #[inline]
    fn act(self) -> Self {
        crate::tensor::round_bf16(self)
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const ROUNDS_TO_BF16: bool = false;

    fn from_f32(x: f32) -> Self {
        x as f64
    }
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
}
