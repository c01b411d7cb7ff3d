//! The greedy choice over a vocabulary-parallel lm_head without gathering the logits: each rank reduces its
//! slice of every position to one candidate, and the candidates of all ranks (4 floats per position instead
//! of `V / N`) decide (after vLLM's vocab-parallel lm_head, whose greedy path also reduces before gathering).
//!
//! Invariants: [`resolve`] over every rank's [`local_best`] is exactly `sampling::argmax` of the whole row,
//! errors included: the first non-finite logit (NaN or +inf) in id order is an error naming it, a row of
//! only `-inf` is an error, and ties go to the lowest id (ranks hold ascending id ranges, so the first rank
//! holding the maximum wins, and within a rank the first id). Ids are sent as f32, exact below 2^24 (every
//! vocabulary a config allows).

use crate::runner::TokenId;

/// Floats per position in a rank's candidate: best value, its id, the first non-finite id (or -1), its value.
pub const CANDIDATE: usize = 4;

/// This rank's candidate for every position of `logits` (`[positions, slice]`, ids from `vocab_start`):
/// `[positions, CANDIDATE]`.
pub fn local_best(logits: &[f32], slice: usize, vocab_start: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(logits.len() / slice * CANDIDATE);
    for row in logits.chunks_exact(slice) {
        let mut best = 0usize;
        for (id, &l) in row.iter().enumerate().skip(1) {
            if l > row[best] {
                best = id;
            }
        }
        let bad = row.iter().position(|l| l.is_nan() || *l == f32::INFINITY);
        out.extend([
            row[best],
            (vocab_start + best) as f32,
            bad.map_or(-1.0, |b| (vocab_start + b) as f32),
            bad.map_or(0.0, |b| row[b]),
        ]);
    }
    out
}

/// The argmax of each of `positions` positions from every rank's candidates (`[world, positions, CANDIDATE]`,
/// rank order), or the message `sampling::argmax` gives for that row.
pub fn resolve(gathered: &[f32], world: usize, positions: usize) -> Vec<Result<TokenId, String>> {
    (0..positions)
        .map(|p| {
            let candidates: Vec<&[f32]> = (0..world)
                .map(|r| &gathered[(r * positions + p) * CANDIDATE..(r * positions + p + 1) * CANDIDATE])
                .collect();
            if let Some(c) = candidates.iter().find(|c| c[2] >= 0.0) {
                return Err(format!("logit of token {} is {}", c[2] as usize, c[3]));
            }
            let best = candidates.iter().skip(1).fold(candidates[0], |best, c| if c[0] > best[0] { c } else { best });
            if best[0] == f32::NEG_INFINITY {
                return Err("every logit is -inf".into());
            }
            Ok(best[1] as TokenId)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KernelError;
    use crate::sampling::argmax;

    /// Splits each row over `world` ranks, resolves, and compares with the whole row's argmax.
    fn check(rows: &[Vec<f32>], world: usize) {
        let vocab = rows[0].len();
        let slice = vocab / world;
        let mut gathered = Vec::new();
        for r in 0..world {
            let local: Vec<f32> = rows.iter().flat_map(|row| row[r * slice..(r + 1) * slice].to_vec()).collect();
            gathered.extend(local_best(&local, slice, r * slice));
        }
        for (row, got) in rows.iter().zip(resolve(&gathered, world, rows.len())) {
            let want = argmax(row).map_err(|e| match e {
                KernelError::InvalidInput(m) => m,
                other => other.to_string(),
            });
            assert_eq!(got, want, "{row:?} over {world} ranks");
        }
    }

    #[test]
    fn the_distributed_argmax_is_the_whole_rows() {
        let ninf = f32::NEG_INFINITY;
        let rows = vec![
            vec![0.5, 2.0, -1.0, 2.0, 1.0, 0.0, 2.0, -3.0], // ties across ranks: the lowest id
            vec![ninf, ninf, ninf, ninf, ninf, ninf, ninf, 4.0],
            vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            vec![ninf; 8],
            vec![0.0, 1.0, 2.0, 3.0, f32::NAN, 5.0, f32::INFINITY, 7.0],
            vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, f32::INFINITY, f32::NAN],
            vec![-2.0, -1.0, ninf, -0.5, ninf, -0.5, -7.0, -0.25],
        ];
        for world in [1, 2, 4, 8] {
            check(&rows, world);
        }
    }
}
