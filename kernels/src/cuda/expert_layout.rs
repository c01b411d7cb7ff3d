//! The device layout of the routed experts' MXFP4 weights: tiles of 16 rows by 128 inputs, each stored whole.
//!
//! A checkpoint stores an expert matrix `[rows, cols]` row by row (`mxfp4`): packed codes `[rows, cols/2]`, scale
//! bytes `[rows, cols/32]`. The tensor-core expert kernels (`moe_gate_up` / `moe_down` in `kernels/cuda/moe.cu`)
//! give each warp a 16-row tile and walk its inputs 128 at a time (a *quad* of four 32-input groups, the kernels'
//! K block). On the device each (tile, quad) is one contiguous chunk: [`CHUNK_CODE_BYTES`] bytes of codes, its 16
//! rows in order with 64 bytes each, and [`CHUNK_SCALE_BYTES`] scale bytes, 16 rows of 4. Chunks run quad by quad
//! within a tile and tile by tile within a matrix, so a warp's step reads whole kilobytes in address order
//! instead of 64 bytes from each of 16 rows 1–2 KB apart.
//!
//! Within each 32-bit word of codes (8 codes, element i in nibble i of the checkpoint's little-endian word) the bits
//! are stored permuted ([`CODE_BIT_SOURCE`]): the order that lets the kernels' `word_codes_bf16x2` turn a word into
//! four bf16x2 registers in 9 integer instructions, each holding a pair of neighbouring codes as the token inputs
//! come (derived by `kernels/bench/code_bit_order.py`, which finds no 8-instruction form of its kind; checked here
//! against the plain E2M1 decoding).
//!
//! Invariants:
//! - The layout is a permutation of the checkpoint's bytes (of the bits within each code word) plus zero padding:
//!   rows past `rows` (to a multiple of 16) and groups past `cols/32` (to a multiple of 4) are zero codes with zero
//!   scale bytes, which the kernels never read (they check the row and group bounds).
//! - Code words are permuted bit by bit, so zero padding stays zero and every code keeps its word.
//! - [`tile_codes`] and [`tile_scales`] check their lengths and fail with an error naming the sizes, never panic.

use crate::error::{KernelError, Result};
use crate::mxfp4::GROUP_SIZE;

/// Rows of a tile (`MMA` row tile).
pub const TILE_ROWS: usize = 16;

/// 32-input groups of a quad.
pub const QUAD_GROUPS: usize = 4;

/// Bytes of codes of one (tile, quad) chunk: 16 rows of 4 groups of 16 bytes.
pub const CHUNK_CODE_BYTES: usize = TILE_ROWS * QUAD_GROUPS * GROUP_SIZE / 2;

/// Scale bytes of one (tile, quad) chunk.
pub const CHUNK_SCALE_BYTES: usize = TILE_ROWS * QUAD_GROUPS;

/// The (tiles, quads) of a `[rows, cols]` matrix.
pub fn tile_grid(rows: usize, cols: usize) -> (usize, usize) {
    (rows.div_ceil(TILE_ROWS), (cols / GROUP_SIZE).div_ceil(QUAD_GROUPS))
}

/// Bytes of codes of one tiled `[rows, cols]` matrix.
pub fn tiled_code_bytes(rows: usize, cols: usize) -> usize {
    let (tiles, quads) = tile_grid(rows, cols);
    tiles * quads * CHUNK_CODE_BYTES
}

/// Scale bytes of one tiled `[rows, cols]` matrix.
pub fn tiled_scale_bytes(rows: usize, cols: usize) -> usize {
    let (tiles, quads) = tile_grid(rows, cols);
    tiles * quads * CHUNK_SCALE_BYTES
}

fn check(what: &str, found: usize, rows: usize, cols: usize, per_row: usize) -> Result<()> {
    if cols % GROUP_SIZE != 0 {
        return Err(KernelError::InvalidInput(format!(
            "MXFP4 {what} of a [{rows}, {cols}] matrix: {cols} inputs are not a whole number of \
             {GROUP_SIZE}-input groups"
        )));
    }
    if found != rows * per_row {
        return Err(KernelError::InvalidInput(format!(
            "MXFP4 {what} of a [{rows}, {cols}] matrix: expected {} bytes, found {found}",
            rows * per_row
        )));
    }
    Ok(())
}

/// Rearranges the `unit` bytes of each 32-input group (16 of codes, or 1 scale) from row-major `[rows, groups]`
/// into the tiled order (see the module doc): chunks of 16 rows of 4 groups.
fn tile(src: &[u8], rows: usize, groups: usize, unit: usize) -> Vec<u8> {
    let (quads, chunk) = (groups.div_ceil(QUAD_GROUPS), TILE_ROWS * QUAD_GROUPS * unit);
    let mut out = vec![0u8; rows.div_ceil(TILE_ROWS) * quads * chunk];
    for row in 0..rows {
        let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
        for group in 0..groups {
            let (quad, g) = (group / QUAD_GROUPS, group % QUAD_GROUPS);
            let at = (tile * quads + quad) * chunk + (r * QUAD_GROUPS + g) * unit;
            let from = (row * groups + group) * unit;
            out[at..at + unit].copy_from_slice(&src[from..from + unit]);
        }
    }
    out
}

/// Stored bit `s` of a code word holds bit `CODE_BIT_SOURCE[s]` of the checkpoint's word (code `i`: mantissa bit
/// `4i`, exponent bits `4i + 1`, `4i + 2`, sign `4i + 3`). `word_codes_bf16x2` in `kernels/cuda/moe.cu` reads
/// register `j`'s low half (code `2j`) and high half (code `2j + 1`) from these places: the two must change
/// together.
pub const CODE_BIT_SOURCE: [u8; 32] = [
    10, 16, 3, 18, 17, 25, 24, 11, 26, 4, 5, 6, 19, 27, 12, 13, 14, 20, 7, 22, 21, 29, 28, 15, 30, 0, 1, 2, 23, 31, 8,
    9,
];

/// For each byte of a checkpoint word, the stored bits its 256 values set ([`CODE_BIT_SOURCE`]).
const CODE_BYTE_BITS: [[u32; 256]; 4] = code_byte_bits();

const fn code_byte_bits() -> [[u32; 256]; 4] {
    let mut table = [[0u32; 256]; 4];
    let mut stored = 0;
    while stored < 32 {
        let from = CODE_BIT_SOURCE[stored] as usize;
        let mut value = 0;
        while value < 256 {
            if (value >> (from % 8)) & 1 == 1 {
                table[from / 8][value] |= 1 << stored;
            }
            value += 1;
        }
        stored += 1;
    }
    table
}

/// A checkpoint code word (little-endian bytes) in the stored bit order.
pub fn store_code_word(word: [u8; 4]) -> [u8; 4] {
    let t = &CODE_BYTE_BITS;
    let bits = t[0][word[0] as usize] | t[1][word[1] as usize] | t[2][word[2] as usize] | t[3][word[3] as usize];
    bits.to_le_bytes()
}

/// The packed codes `[rows, cols/2]` of one matrix in the tiled layout ([`tiled_code_bytes`] long), each word's bits
/// in the stored order.
pub fn tile_codes(packed: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    check("codes", packed.len(), rows, cols, cols / 2)?;
    let mut tiled = tile(packed, rows, cols / GROUP_SIZE, GROUP_SIZE / 2);
    for word in tiled.chunks_exact_mut(4) {
        let stored = store_code_word([word[0], word[1], word[2], word[3]]);
        word.copy_from_slice(&stored);
    }
    Ok(tiled)
}

/// The scale bytes `[rows, cols/32]` of one matrix in the tiled layout ([`tiled_scale_bytes`] long).
pub fn tile_scales(scales: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    check("scales", scales.len(), rows, cols, cols / GROUP_SIZE)?;
    Ok(tile(scales, rows, cols / GROUP_SIZE, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where byte `b` of group `group` of row `row` lands, straight from the module doc's description.
    fn code_at(rows: usize, cols: usize, row: usize, group: usize, b: usize) -> usize {
        let (_, quads) = tile_grid(rows, cols);
        let chunk = (row / 16) * quads + group / 4;
        chunk * 1024 + (row % 16) * 64 + (group % 4) * 16 + b
    }

    #[test]
    fn every_code_byte_lands_in_its_chunk_and_the_padding_is_zero() {
        for (rows, cols) in [(16, 128), (40, 96), (3, 32), (48, 3584)] {
            let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i % 251) as u8 + 1).collect();
            let tiled = tile_codes(&packed, rows, cols).unwrap();
            assert_eq!(tiled.len(), tiled_code_bytes(rows, cols));
            let mut hit = vec![false; tiled.len()];
            for row in 0..rows {
                for group in 0..cols / 32 {
                    for w in 0..4 {
                        let at = code_at(rows, cols, row, group, 4 * w);
                        let from = row * cols / 2 + group * 16 + 4 * w;
                        let word = [packed[from], packed[from + 1], packed[from + 2], packed[from + 3]];
                        assert_eq!(tiled[at..at + 4], store_code_word(word), "[{rows}, {cols}] row {row}");
                        hit[at..at + 4].iter_mut().for_each(|h| *h = true);
                    }
                }
            }
            // Every byte no source byte landed on is padding, and zero.
            assert!(tiled.iter().zip(&hit).all(|(v, h)| *h || *v == 0));
            assert_eq!(hit.iter().filter(|h| **h).count(), packed.len());
        }
    }

    /// `word_codes_bf16x2` of `kernels/cuda/moe.cu`, instruction for instruction, on a stored word.
    fn kernel_conversion(w: u32) -> [u32; 4] {
        const KEEP: u32 = 0x81C0_81C0;
        let blend = crate::cuda::compile::source_define("moe.cu", "CODE_BLEND_MASK");
        let u = (w & blend) | ((w << 2) & !blend);
        [w.rotate_left(13) & KEEP, w.rotate_left(8) & KEEP, u.rotate_left(3) & KEEP, u & KEEP]
    }

    /// The bf16 bits of E2M1 code `c` times 2^-126: sign to bit 15, exponent bits to 8-7, mantissa bit to 6.
    fn code_bf16_bits(c: u32) -> u32 {
        ((c >> 3) << 15) | (((c >> 1) & 3) << 7) | ((c & 1) << 6)
    }

    #[test]
    fn the_stored_bit_order_is_a_permutation_that_the_kernel_decodes_exactly() {
        let mut seen = [false; 32];
        CODE_BIT_SOURCE.iter().for_each(|&b| seen[b as usize] = true);
        assert!(seen.iter().all(|s| *s), "CODE_BIT_SOURCE is not a permutation");
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let words = (0..20_000).map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u32
        });
        for word in words.chain([0, u32::MAX, 0x8888_8888, 0x7777_7777, 0x1111_1111]) {
            let stored = u32::from_le_bytes(store_code_word(word.to_le_bytes()));
            let regs = kernel_conversion(stored);
            for (j, reg) in regs.iter().enumerate() {
                let (lo, hi) = ((word >> (8 * j)) & 15, (word >> (8 * j + 4)) & 15);
                assert_eq!(*reg, code_bf16_bits(lo) | (code_bf16_bits(hi) << 16), "word {word:#010x}, register {j}");
            }
        }
    }

    #[test]
    fn every_scale_byte_lands_in_its_chunk() {
        let (rows, cols) = (40, 96); // 3 tiles (the last one half padding), 1 quad of which 3 groups are real
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| i as u8 + 1).collect();
        let tiled = tile_scales(&scales, rows, cols).unwrap();
        assert_eq!(tiled.len(), 3 * 64);
        for row in 0..rows {
            for group in 0..3 {
                assert_eq!(tiled[(row / 16) * 64 + (row % 16) * 4 + group], scales[row * 3 + group]);
            }
            assert_eq!(tiled[(row / 16) * 64 + (row % 16) * 4 + 3], 0, "the fourth group of the quad is padding");
        }
        assert!(tiled[2 * 64 + 8 * 4..].iter().all(|&v| v == 0), "rows 40..48 are padding");
    }

    #[test]
    fn wrong_sizes_are_errors_that_name_them() {
        let err = tile_codes(&[0u8; 10], 2, 64).unwrap_err().to_string();
        assert!(err.contains("[2, 64]") && err.contains("64 bytes") && err.contains("10"), "{err}");
        let err = tile_scales(&[0u8; 4], 2, 48).unwrap_err().to_string();
        assert!(err.contains("48 inputs"), "{err}");
    }
}
