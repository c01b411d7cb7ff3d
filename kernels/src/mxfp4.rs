//! MXFP4 weights as K3 stores its routed experts: E2M1 codes packed two per byte, one E8M0 scale
//! byte per group of 32 consecutive inputs of one output row.
//!
//! Layout (shared/reference/k3-architecture.md §2.8; OCP Microscaling Formats v1.0): a matrix
//! `[rows, cols]` is stored as `weight_packed` U8 `[rows, cols/2]` and `weight_scale` U8
//! `[rows, cols/32]`. Element `2i` of a row sits in the low nibble of packed byte `i`, element
//! `2i+1` in the high nibble. A nibble is E2M1: bit 3 is the sign, bits 0-2 index
//! [`E2M1_MAGNITUDES`]; code 8 is -0.0. A scale byte `b` is E8M0, the value `2^(b-127)`; 0xFF is NaN.
//!
//! Invariants: decoding is exact in f32 (every code times every scale is a 2-bit mantissa times a
//! power of two; only where f32's range ends, magnitudes >= 4 at scale byte 253 and >= 2 at 254,
//! does the product overflow to ±inf); lengths are checked and a mismatch is an error, never a panic.

use crate::error::{KernelError, Result};

/// Inputs per scale byte.
pub const GROUP_SIZE: usize = 32;

/// The magnitudes of the eight E2M1 codes 0..=7 (codes 8..=15 are their negatives).
pub const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The E8M0 byte that encodes NaN.
pub const E8M0_NAN: u8 = 0xFF;

/// The value of an E2M1 code (the low four bits of `code`).
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    let magnitude = E2M1_MAGNITUDES[(code & 0x7) as usize];
    if code & 0x8 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// The value of an E8M0 scale byte: `2^(byte-127)`, NaN for 0xFF.
#[inline]
pub fn e8m0_to_f32(byte: u8) -> f32 {
    match byte {
        E8M0_NAN => f32::NAN,
        // 2^-127 is an f32 subnormal: only mantissa bit 22 set.
        0 => f32::from_bits(0x0040_0000),
        b => f32::from_bits((b as u32) << 23),
    }
}

/// Dequantises one output row: `out[j] = e2m1(code j) * e8m0(scales[j / 32])`.
///
/// `packed` holds `out.len() / 2` bytes and `scales` `out.len() / 32` bytes.
pub fn dequant_row(packed: &[u8], scales: &[u8], out: &mut [f32]) -> Result<()> {
    check_row_lengths(packed.len(), scales.len(), out.len())?;
    let groups = out.chunks_exact_mut(GROUP_SIZE).zip(packed.chunks_exact(GROUP_SIZE / 2)).zip(scales);
    for ((out_group, packed_group), &scale_byte) in groups {
        let scale = e8m0_to_f32(scale_byte);
        for (pair, &byte) in out_group.chunks_exact_mut(2).zip(packed_group) {
            pair[0] = e2m1_to_f32(byte & 0x0F) * scale;
            pair[1] = e2m1_to_f32(byte >> 4) * scale;
        }
    }
    Ok(())
}

/// Dequantises a whole `[rows, cols]` matrix (row-major) from `packed` `[rows, cols/2]` and
/// `scales` `[rows, cols/32]`.
pub fn dequant(rows: usize, cols: usize, packed: &[u8], scales: &[u8]) -> Result<Vec<f32>> {
    check_row_lengths(cols / 2, cols / GROUP_SIZE, cols)?;
    if packed.len() != rows * (cols / 2) || scales.len() != rows * (cols / GROUP_SIZE) {
        return Err(KernelError::InvalidInput(format!(
            "MXFP4 [{rows}, {cols}] needs {} packed and {} scale bytes, got {} and {}",
            rows * (cols / 2),
            rows * (cols / GROUP_SIZE),
            packed.len(),
            scales.len()
        )));
    }
    let mut out = vec![0.0f32; rows * cols];
    if cols == 0 {
        return Ok(out);
    }
    let rows_iter =
        out.chunks_exact_mut(cols).zip(packed.chunks_exact(cols / 2)).zip(scales.chunks_exact(cols / GROUP_SIZE));
    for ((out_row, packed_row), scale_row) in rows_iter {
        dequant_row(packed_row, scale_row, out_row)?;
    }
    Ok(out)
}

fn check_row_lengths(packed: usize, scales: usize, cols: usize) -> Result<()> {
    if cols % GROUP_SIZE != 0 || packed * 2 != cols || scales * GROUP_SIZE != cols {
        return Err(KernelError::InvalidInput(format!(
            "an MXFP4 row of {cols} values needs a multiple of {GROUP_SIZE} values, {} packed and {} scale bytes; \
             got {packed} packed and {scales} scale bytes",
            cols / 2,
            cols / GROUP_SIZE
        )));
    }
    Ok(())
}

/// Packs E2M1 codes (one per byte, low four bits used) two per byte, element `2i` in the low nibble.
pub fn pack_codes(codes: &[u8]) -> Result<Vec<u8>> {
    if codes.len() % 2 != 0 {
        return Err(KernelError::InvalidInput(format!("cannot pack an odd number ({}) of E2M1 codes", codes.len())));
    }
    Ok(codes.chunks_exact(2).map(|p| (p[0] & 0x0F) | ((p[1] & 0x0F) << 4)).collect())
}

/// The E2M1 code nearest to `x` (ties to the even code, i.e. the one with a zero mantissa bit;
/// beyond ±6 it saturates to ±6; -0.0 and negative values that round to zero give code 8).
pub fn e2m1_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x8 } else { 0x0 };
    let a = x.abs();
    // Midpoints between consecutive magnitudes; at a tie the code with an even index wins.
    const MIDPOINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let mut code = 7u8;
    for (i, &mid) in MIDPOINTS.iter().enumerate() {
        if a < mid || (a == mid && i % 2 == 0) {
            code = i as u8;
            break;
        }
    }
    sign | code
}

/// Quantises one row to MXFP4: per group of 32 the scale is the smallest power of two that
/// brings the group's largest magnitude to at most 6, then each value rounds to the nearest code.
/// Values that are exactly `code * 2^k` with a shared `k` per group round-trip exactly.
/// Non-finite inputs are an error.
pub fn quantize_row(values: &[f32], packed: &mut [u8], scales: &mut [u8]) -> Result<()> {
    check_row_lengths(packed.len(), scales.len(), values.len())?;
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(KernelError::InvalidInput(format!("cannot quantise the non-finite value {bad} to MXFP4")));
    }
    let groups = values.chunks_exact(GROUP_SIZE).zip(packed.chunks_exact_mut(GROUP_SIZE / 2)).zip(scales.iter_mut());
    for ((group, packed_group), scale_byte) in groups {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *scale_byte = scale_for_amax(amax);
        let inv = 1.0 / e8m0_to_f32(*scale_byte) as f64;
        for (pair, byte) in group.chunks_exact(2).zip(packed_group.iter_mut()) {
            let lo = e2m1_from_f32((pair[0] as f64 * inv) as f32);
            let hi = e2m1_from_f32((pair[1] as f64 * inv) as f32);
            *byte = lo | (hi << 4);
        }
    }
    Ok(())
}

/// The smallest E8M0 byte whose scale maps `amax` to at most 6 (the largest E2M1 magnitude).
fn scale_for_amax(amax: f32) -> u8 {
    if amax == 0.0 {
        return 0;
    }
    // exponent e with 6 * 2^e >= amax; search the 255 finite scales directly (exact, no log rounding).
    (0u8..=254).find(|&b| 6.0 * e8m0_to_f32(b) as f64 >= amax as f64).unwrap_or(254)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_times_every_scale_is_exact() {
        for scale_byte in 0u8..=254 {
            let scale = 2f64.powi(scale_byte as i32 - 127);
            for code in 0u8..16 {
                let magnitude = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize];
                let want = if code & 8 != 0 { -magnitude * scale } else { magnitude * scale };
                // A row of 32 copies of one code, checked through the public row decoder.
                let packed = [code | (code << 4); 16];
                let mut out = [0.0f32; 32];
                dequant_row(&packed, &[scale_byte], &mut out).unwrap();
                for v in out {
                    if (want as f32).is_finite() {
                        assert_eq!(v as f64, want, "code {code} scale {scale_byte} must be exact");
                    } else {
                        // f32 tops out below 2^128: magnitudes >= 4 overflow at 253, >= 2 at 254.
                        let overflows =
                            (scale_byte == 253 && magnitude >= 4.0) || (scale_byte == 254 && magnitude >= 2.0);
                        assert!(overflows, "code {code} scale {scale_byte} overflowed");
                        assert_eq!(v, want as f32);
                    }
                }
            }
        }
    }

    #[test]
    fn overflow_and_signed_zero() {
        assert_eq!(e2m1_to_f32(7) * e8m0_to_f32(254), f32::INFINITY);
        assert_eq!(e2m1_to_f32(15) * e8m0_to_f32(253), f32::NEG_INFINITY);
        assert_eq!(e2m1_to_f32(3) * e8m0_to_f32(254), 1.5 * 2f32.powi(127));
        assert_eq!(e2m1_to_f32(4) * e8m0_to_f32(254), f32::INFINITY);
        assert_eq!(e2m1_to_f32(5) * e8m0_to_f32(252), 3.0 * 2f32.powi(125));
        let neg_zero = e2m1_to_f32(8);
        assert_eq!(neg_zero, 0.0);
        assert!(neg_zero.is_sign_negative());
        assert_eq!(e8m0_to_f32(0) as f64, 2f64.powi(-127));
        assert_eq!(e8m0_to_f32(127), 1.0);
    }

    #[test]
    fn scale_255_is_nan_for_every_code() {
        for code in 0u8..16 {
            let mut out = [0.0f32; 32];
            dequant_row(&[code | (code << 4); 16], &[E8M0_NAN], &mut out).unwrap();
            assert!(out.iter().all(|v| v.is_nan()), "code {code}");
        }
    }

    #[test]
    fn nibble_order_low_first_and_groups_per_row() {
        // Row of 64: byte 0 = (lo 1 → 0.5, hi 7 → 6); group 1 scaled by 2^1.
        let mut packed = [0u8; 32];
        packed[0] = 0x71;
        packed[16] = 0xA3; // element 32: code 3 → 1.5, element 33: code 10 → -1.0
        let mut out = [0.0f32; 64];
        dequant_row(&packed, &[127, 128], &mut out).unwrap();
        assert_eq!(&out[..3], &[0.5, 6.0, 0.0]);
        assert_eq!(&out[32..34], &[3.0, -2.0]);

        let m = dequant(2, 32, &[packed[0]; 32], &[127, 126]).unwrap();
        assert_eq!((m[0], m[1], m[32], m[33]), (0.5, 6.0, 0.25, 3.0));
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut out = [0.0f32; 32];
        assert!(dequant_row(&[0; 15], &[127], &mut out).is_err());
        assert!(dequant_row(&[0; 16], &[127, 127], &mut out).is_err());
        let mut odd = [0.0f32; 48];
        assert!(dequant_row(&[0; 24], &[127], &mut odd).is_err());
        assert!(dequant(2, 32, &[0; 16], &[127; 2]).is_err());
        assert!(pack_codes(&[1, 2, 3]).is_err());
    }

    #[test]
    fn pack_then_dequant_matches_codes() {
        let codes: Vec<u8> = (0..32).map(|i| (i * 7 % 16) as u8).collect();
        let packed = pack_codes(&codes).unwrap();
        let mut out = [0.0f32; 32];
        dequant_row(&packed, &[127], &mut out).unwrap();
        for (c, v) in codes.iter().zip(out) {
            assert_eq!(v.to_bits(), e2m1_to_f32(*c).to_bits());
        }
    }

    #[test]
    fn quantize_round_trips_representable_values_and_bounds_the_rest() {
        let exact: Vec<f32> = (0..64).map(|i| e2m1_to_f32(i as u8 % 16) * if i < 32 { 0.25 } else { 8.0 }).collect();
        let (mut packed, mut scales) = ([0u8; 32], [0u8; 2]);
        quantize_row(&exact, &mut packed, &mut scales).unwrap();
        let mut back = [0.0f32; 64];
        dequant_row(&packed, &scales, &mut back).unwrap();
        assert_eq!(back.to_vec(), exact);

        let smooth: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin() * 0.1).collect();
        quantize_row(&smooth, &mut packed, &mut scales).unwrap();
        dequant_row(&packed, &scales, &mut back).unwrap();
        for g in 0..2 {
            let amax = smooth[g * 32..(g + 1) * 32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for j in g * 32..(g + 1) * 32 {
                // The coarsest E2M1 step is 2 (between 4 and 6) in units of the scale, and the
                // scale is below amax/3; half a step bounds the error.
                assert!((back[j] - smooth[j]).abs() <= amax / 3.0, "element {j}");
            }
        }
        assert!(quantize_row(&[f32::NAN; 32], &mut [0; 16], &mut [0; 1]).is_err());
    }

    #[test]
    fn nearest_code_ties_to_even() {
        assert_eq!(e2m1_from_f32(0.25), 0);
        assert_eq!(e2m1_from_f32(0.75), 2);
        assert_eq!(e2m1_from_f32(2.5), 4);
        assert_eq!(e2m1_from_f32(5.0), 6);
        assert_eq!(e2m1_from_f32(100.0), 7);
        assert_eq!(e2m1_from_f32(-1.4), 0x8 | 3);
        assert_eq!(e2m1_from_f32(-0.0), 8);
    }
}
