//! The plan rank 0 of a tensor-parallel group broadcasts before every group-wide action, and its bytes.
//!
//! Invariants: a plan carries everything every rank needs to make the same calls in the same order (the
//! state ids, each window's tokens and bounds), and nothing only rank 0 needs (sampling parameters, masks:
//! acceptance runs on rank 0, where the gathered logits are). [`Plan::decode`] of [`Plan::encode`] is the
//! plan itself; bytes that do not decode are an error, never a panic. The encoding is little-endian
//! integers with length prefixes, so it is the same across the hosts of a multi-node group.

use crate::error::{KernelError, Result};
use crate::runner::{StateId, TokenId};

/// One row of a forward plan: a window of one state (`cpu::forward::WindowRow` without the state).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanRow {
    pub state: StateId,
    pub tokens: Vec<TokenId>,
    pub logits_from: usize,
    pub snapshots_from: Option<usize>,
}

/// One group-wide action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// A fresh empty state under this id on every rank.
    Alloc(StateId),
    /// A copy of `src` under `dst` on every rank.
    Fork {
        src: StateId,
        dst: StateId,
    },
    Free(StateId),
    /// Every rank runs these windows; rank 0 gathers the logits, or with `argmax` only each position's
    /// greedy choice (`cpu::vocab`).
    Forward {
        rows: Vec<PlanRow>,
        argmax: bool,
    },
    /// The ids no emitted token may be (the runner's token mask), whole-vocabulary, ascending.
    TokenMask(Vec<TokenId>),
    /// Keeps the first `m` tokens of each listed window of the last forward; the other windows keep all.
    Commit(Vec<(StateId, usize)>),
    /// Every rank contributes its part of the state to rank 0.
    Export(StateId),
    /// A state of `len` tokens, whose values rank 0 broadcasts next, installed under this id.
    Import {
        id: StateId,
        len: usize,
    },
    /// The group ends.
    Shutdown,
    /// Every rank contributes its vocabulary rows of the embedding and lm_head to rank 0 (for a drafter).
    GatherHead,
}

const ALLOC: u8 = 1;
const FORK: u8 = 2;
const FREE: u8 = 3;
const FORWARD: u8 = 4;
const COMMIT: u8 = 5;
const EXPORT: u8 = 6;
const IMPORT: u8 = 7;
const SHUTDOWN: u8 = 8;
const GATHER_HEAD: u8 = 9;
const TOKEN_MASK: u8 = 10;

impl Plan {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::new();
        let put = |w: &mut Vec<u8>, v: u64| w.extend_from_slice(&v.to_le_bytes());
        match self {
            Plan::Alloc(id) => {
                w.push(ALLOC);
                put(&mut w, id.0);
            }
            Plan::Fork { src, dst } => {
                w.push(FORK);
                put(&mut w, src.0);
                put(&mut w, dst.0);
            }
            Plan::Free(id) => {
                w.push(FREE);
                put(&mut w, id.0);
            }
            Plan::Forward { rows, argmax } => {
                w.push(FORWARD);
                w.push(u8::from(*argmax));
                put(&mut w, rows.len() as u64);
                for r in rows {
                    put(&mut w, r.state.0);
                    put(&mut w, r.logits_from as u64);
                    // Snapshots from `s` as `s + 1`; 0 for none.
                    put(&mut w, r.snapshots_from.map_or(0, |s| s as u64 + 1));
                    put(&mut w, r.tokens.len() as u64);
                    for t in &r.tokens {
                        w.extend_from_slice(&t.to_le_bytes());
                    }
                }
            }
            Plan::Commit(commits) => {
                w.push(COMMIT);
                put(&mut w, commits.len() as u64);
                for (id, m) in commits {
                    put(&mut w, id.0);
                    put(&mut w, *m as u64);
                }
            }
            Plan::Export(id) => {
                w.push(EXPORT);
                put(&mut w, id.0);
            }
            Plan::Import { id, len } => {
                w.push(IMPORT);
                put(&mut w, id.0);
                put(&mut w, *len as u64);
            }
            Plan::Shutdown => w.push(SHUTDOWN),
            Plan::GatherHead => w.push(GATHER_HEAD),
            Plan::TokenMask(ids) => {
                w.push(TOKEN_MASK);
                put(&mut w, ids.len() as u64);
                for t in ids {
                    w.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        w
    }

    pub fn decode(bytes: &[u8]) -> Result<Plan> {
        let mut r = Reader { bytes, at: 0 };
        let plan = match r.byte()? {
            ALLOC => Plan::Alloc(StateId(r.u64()?)),
            FORK => Plan::Fork { src: StateId(r.u64()?), dst: StateId(r.u64()?) },
            FREE => Plan::Free(StateId(r.u64()?)),
            FORWARD => {
                let argmax = r.byte()? == 1;
                let n = r.count()?;
                let mut rows = Vec::with_capacity(n);
                for _ in 0..n {
                    let state = StateId(r.u64()?);
                    let logits_from = r.u64()? as usize;
                    let snapshots_from = r.u64()?.checked_sub(1).map(|s| s as usize);
                    let t = r.count()?;
                    let tokens = (0..t).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
                    rows.push(PlanRow { state, tokens, logits_from, snapshots_from });
                }
                Plan::Forward { rows, argmax }
            }
            TOKEN_MASK => {
                let n = r.count()?;
                Plan::TokenMask((0..n).map(|_| r.u32()).collect::<Result<Vec<_>>>()?)
            }
            COMMIT => {
                let n = r.count()?;
                let commits = (0..n).map(|_| Ok((StateId(r.u64()?), r.u64()? as usize))).collect::<Result<Vec<_>>>()?;
                Plan::Commit(commits)
            }
            EXPORT => Plan::Export(StateId(r.u64()?)),
            IMPORT => Plan::Import { id: StateId(r.u64()?), len: r.u64()? as usize },
            SHUTDOWN => Plan::Shutdown,
            GATHER_HEAD => Plan::GatherHead,
            other => return Err(KernelError::Device(format!("a step plan starts with unknown tag {other}"))),
        };
        if r.at != bytes.len() {
            return Err(KernelError::Device(format!("{} trailing bytes after a step plan", bytes.len() - r.at)));
        }
        Ok(plan)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len()).ok_or_else(|| {
            KernelError::Device(format!("a step plan of {} bytes ends inside a field at {}", self.bytes.len(), self.at))
        })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    /// A length prefix, bounded by the bytes left (so a corrupt count cannot ask for a huge allocation).
    fn count(&mut self) -> Result<usize> {
        let n = self.u64()?;
        if n > (self.bytes.len() - self.at) as u64 {
            return Err(KernelError::Device(format!("a step plan announces {n} items in {} bytes", self.bytes.len())));
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_truncated_bytes_are_errors() {
        let plans = [
            Plan::Alloc(StateId(3)),
            Plan::Fork { src: StateId(1), dst: StateId(9) },
            Plan::Free(StateId(4)),
            Plan::TokenMask(vec![2, 9, 100_255]),
            Plan::Forward {
                argmax: true,
                rows: vec![
                    PlanRow { state: StateId(2), tokens: vec![5, 6, 7], logits_from: 1, snapshots_from: Some(2) },
                    PlanRow { state: StateId(5), tokens: vec![1], logits_from: 1, snapshots_from: None },
                ],
            },
            Plan::Forward { argmax: false, rows: Vec::new() },
            Plan::Commit(vec![(StateId(2), 2)]),
            Plan::Export(StateId(7)),
            Plan::Import { id: StateId(8), len: 130 },
            Plan::Shutdown,
            Plan::GatherHead,
        ];
        for p in plans {
            let bytes = p.encode();
            assert_eq!(Plan::decode(&bytes).unwrap(), p);
            if bytes.len() > 1 {
                assert!(Plan::decode(&bytes[..bytes.len() - 1]).is_err());
            }
        }
        assert!(Plan::decode(&[]).is_err());
        assert!(Plan::decode(&[99]).is_err());
    }
}
