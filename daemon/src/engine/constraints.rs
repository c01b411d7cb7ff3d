//! The matchers of constrained requests (`sparkd-grammar`: `response_format`, grammars, required tool calls),
//! owned by the engine thread beside the requests' states.
//!
//! Invariants:
//! - A constrained request's matcher has committed exactly the tokens the request has emitted (each step's
//!   emitted tokens are committed when the step lands), so its mask is the grammar's for the next position.
//! - Before verification a request's drafts are cut at their first token the grammar forbids, and its row
//!   carries one mask per sampling position (before the first draft, after each), computed on a copy of the
//!   matcher that walks the drafts; the runner samples and accepts under them, so a constrained reply is exactly
//!   what sampling from the masked target distribution gives, with speculation on or off.
//! - A matcher error fails its request alone, with the matcher's message.
//! - A step's masks ([`StepMasks`]) are computed when the runner first asks for them ([`MasksOnAsk`], a
//!   `MaskSource`): once it has launched the forward, so the engine thread computes them while the device runs it
//!   (the overlap of vLLM v1's `EngineCore.step`: `execute_model`, `get_grammar_bitmask`, then `sample_tokens`).
//!   A helper thread started before the launch measured slower (docs/perf/decisions.md D75). A matcher that fails lets
//!   its row sample unconstrained for that step, and the engine fails the request and drops its row before the
//!   step lands, so nothing it sampled reaches the client.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sparkd_grammar::{Constraint, GrammarError};
use sparkd_kernels::runner::MaskSource;
use sparkd_kernels::TokenId;

use super::scheduler::StepPlan;
use super::types::{EngineError, RequestId};

/// See the module docs.
#[derive(Debug, Default)]
pub struct Constraints {
    by_request: HashMap<RequestId, Constraint>,
}

fn failed(id: RequestId, e: GrammarError) -> EngineError {
    EngineError::InvalidRequest(format!("{id}: {e}"))
}

impl Constraints {
    pub fn insert(&mut self, id: RequestId, constraint: Constraint) {
        self.by_request.insert(id, constraint);
    }

    pub fn remove(&mut self, id: RequestId) {
        self.by_request.remove(&id);
    }

    /// Whether any live request is constrained (its next step's masks need this step's tokens, so no step is
    /// launched ahead).
    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.by_request.contains_key(&id)
    }

    /// Cuts `drafts` at the first token `id`'s grammar forbids (unconstrained requests keep theirs).
    pub fn cut(&mut self, id: RequestId, drafts: &mut Vec<TokenId>) -> Result<(), EngineError> {
        let Some(c) = self.by_request.get_mut(&id) else { return Ok(()) };
        let keep = c.allowed_prefix(drafts).map_err(|e| failed(id, e))?;
        drafts.truncate(keep);
        Ok(())
    }

    /// Advances `id`'s matcher past the tokens it emitted.
    pub fn commit(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), EngineError> {
        let Some(c) = self.by_request.get_mut(&id) else { return Ok(()) };
        c.commit(tokens).map_err(|e| failed(id, e))
    }
}

/// One row's masks, one per sampling position (`SampleRequest::masks`' form).
type RowMasks = Vec<Arc<[u32]>>;

/// The masks of a row whose matcher is `c`, sampling after `drafts`: `drafts.len() + 1` of them.
fn masks_after(c: &mut Constraint, drafts: &[TokenId]) -> sparkd_grammar::Result<RowMasks> {
    let mut masks = Vec::with_capacity(drafts.len() + 1);
    masks.push(Arc::from(c.allowed()?));
    if !drafts.is_empty() {
        let mut walk = c.clone();
        for &d in drafts {
            walk.commit(&[d])?;
            masks.push(Arc::from(walk.allowed()?));
        }
    }
    Ok(masks)
}

/// Constrained rows one mask thread takes at least: below it a thread's start costs more than it saves (D75).
const ROWS_PER_MASK_THREAD: usize = 8;
/// The most threads one step's masks are computed on.
const MAX_MASK_THREADS: usize = 8;

/// One step's masks, every constrained row's, computed together (see the module docs).
#[derive(Debug, Default)]
pub struct StepMasks {
    /// Per row of the plan: its masks (empty for an unconstrained row or a prefill chunk).
    rows: Vec<RowMasks>,
    /// Requests whose matcher failed: fail them and drop their rows before the step lands.
    pub failed: Vec<(RequestId, EngineError)>,
    /// Host time spent computing the masks.
    pub spent: Duration,
}

impl StepMasks {
    /// Whether a row of `plan` samples under a constraint.
    pub fn needed(constraints: &Constraints, plan: &StepPlan) -> bool {
        plan.rows.iter().any(|r| r.sample.is_some() && constraints.contains(r.id))
    }

    /// Computes the masks of `plan`'s rows over a vocabulary of `vocab` ids, split over threads of at least
    /// [`ROWS_PER_MASK_THREAD`] rows each (at most [`MAX_MASK_THREADS`]; vLLM fills large batches' bitmasks on a
    /// thread pool the same way). A row whose matcher fails gets masks allowing every id and its request is
    /// recorded in `failed`.
    pub fn compute(constraints: &mut Constraints, plan: &StepPlan, vocab: usize) -> Self {
        let start = Instant::now();
        let drafts_of = |row: usize| {
            let planned = &plan.rows[row];
            let draft_len = planned.sample.as_ref().map_or(0, |s| s.draft_len);
            &planned.tokens[planned.tokens.len() - draft_len..]
        };
        let at: HashMap<RequestId, usize> =
            plan.rows.iter().enumerate().filter(|(_, r)| r.sample.is_some()).map(|(i, r)| (r.id, i)).collect();
        // (row, matcher) of every constrained sampling row.
        let mut jobs: Vec<(usize, &mut Constraint)> =
            constraints.by_request.iter_mut().filter_map(|(id, c)| Some((*at.get(id)?, c))).collect();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = jobs.len().div_ceil(ROWS_PER_MASK_THREAD).min(MAX_MASK_THREADS).min(cores);
        let results: Vec<(usize, sparkd_grammar::Result<RowMasks>)> = if threads <= 1 {
            jobs.into_iter().map(|(row, c)| (row, masks_after(c, drafts_of(row)))).collect()
        } else {
            let chunk = jobs.len().div_ceil(threads);
            std::thread::scope(|scope| {
                let handles: Vec<_> = jobs
                    .chunks_mut(chunk)
                    .map(|part| {
                        let rows: Vec<usize> = part.iter().map(|(row, _)| *row).collect();
                        let handle = scope.spawn(move || {
                            part.iter_mut().map(|(row, c)| (*row, masks_after(c, drafts_of(*row)))).collect::<Vec<_>>()
                        });
                        (rows, handle)
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|(rows, h)| {
                        h.join().unwrap_or_else(|_| {
                            let lost = || GrammarError::Matcher("the thread computing its mask panicked".into());
                            rows.into_iter().map(|row| (row, Err(lost()))).collect()
                        })
                    })
                    .collect()
            })
        };
        let mut masks = StepMasks { rows: vec![Vec::new(); plan.rows.len()], ..StepMasks::default() };
        for (row, result) in results {
            let id = plan.rows[row].id;
            masks.rows[row] = result.unwrap_or_else(|e| {
                masks.failed.push((id, failed(id, e)));
                vec![Arc::from(vec![u32::MAX; vocab.div_ceil(32)]); drafts_of(row).len() + 1]
            });
        }
        masks.spent = start.elapsed();
        masks
    }
}

/// A step's masks, computed when the runner first asks for them: once it has launched the forward, so the engine
/// thread computes them while the device runs it.
pub struct MasksOnAsk<'a> {
    constraints: &'a mut Constraints,
    plan: &'a StepPlan,
    vocab: usize,
    done: Option<StepMasks>,
}

impl<'a> MasksOnAsk<'a> {
    pub fn new(constraints: &'a mut Constraints, plan: &'a StepPlan, vocab: usize) -> Self {
        MasksOnAsk { constraints, plan, vocab, done: None }
    }

    /// The computed masks' failures and time, once the step is done (computed now if the runner never asked).
    pub fn finish(mut self) -> StepMasks {
        self.computed();
        self.done.unwrap_or_default()
    }

    fn computed(&mut self) -> &mut StepMasks {
        self.done.get_or_insert_with(|| StepMasks::compute(self.constraints, self.plan, self.vocab))
    }
}

impl MaskSource for MasksOnAsk<'_> {
    fn masks(&mut self, row: usize) -> sparkd_kernels::Result<Vec<Arc<[u32]>>> {
        let rows = self.plan.rows.len();
        let masks = self.computed().rows.get_mut(row).ok_or_else(|| {
            sparkd_kernels::KernelError::InvalidInput(format!("masks asked for row {row} of a step of {rows} rows"))
        })?;
        Ok(std::mem::take(masks))
    }
}

#[cfg(test)]
mod tests {
    use sparkd_grammar::{ConstraintSpec, GrammarEnv};
    use sparkd_kernels::runner::{mask_allows, SampleRequest, SamplingParams};
    use sparkd_tokenizer::Tokenizer;

    use super::*;
    use crate::engine::scheduler::PlannedRow;

    fn row(id: u64, tokens: Vec<TokenId>, draft_len: Option<usize>) -> PlannedRow {
        let sample = draft_len.map(|d| SampleRequest::new(SamplingParams::greedy(), d));
        PlannedRow { id: RequestId(id), start: 0, tokens, sample }
    }

    #[test]
    fn a_step_computes_the_masks_of_its_constrained_sampling_rows_and_records_a_failed_matcher() {
        let tok = Tokenizer::builtin().unwrap();
        let env = GrammarEnv::new(&tok).unwrap();
        let digits = || env.constraint(&ConstraintSpec::Regex("[0-9]+".into())).unwrap();
        let (seven, letter) = (tok.encode("7")[0], tok.encode("x")[0]);
        let mut constraints = Constraints::default();
        let vocab = env.vocab();
        let mut broken = digits();
        assert!(broken.commit(&[letter]).is_err(), "a letter is outside [0-9]+");
        constraints.insert(RequestId(2), broken);
        // Rows 1, 3, 4, ...: constrained and well; row 2 broken; row 0 unconstrained. Enough rows for two threads.
        let mut rows = vec![row(0, vec![5], Some(0)), row(1, vec![9, seven], Some(1)), row(2, vec![9], Some(0))];
        for id in 3..3 + 2 * ROWS_PER_MASK_THREAD as u64 {
            constraints.insert(RequestId(id), digits());
            rows.push(row(id, vec![9, seven, seven], Some(2)));
        }
        constraints.insert(RequestId(1), digits());
        let plan = StepPlan { rows };
        assert!(StepMasks::needed(&constraints, &plan));
        let masks = {
            let mut source = MasksOnAsk::new(&mut constraints, &plan, vocab);
            assert!(source.masks(0).unwrap().is_empty(), "an unconstrained row has no masks");
            let drafted = source.masks(1).unwrap();
            assert_eq!(drafted.len(), 2, "one mask before the draft, one after it");
            assert!(drafted.iter().all(|m| mask_allows(m, seven) && !mask_allows(m, letter)));
            let fallback = source.masks(2).unwrap();
            assert!(fallback.len() == 1 && mask_allows(&fallback[0], letter), "a failed matcher's row samples freely");
            for r in 3..plan.rows.len() {
                let m = source.masks(r).unwrap();
                assert!(m.len() == 3 && m.iter().all(|m| mask_allows(m, seven) && !mask_allows(m, letter)), "row {r}");
            }
            assert!(source.masks(plan.rows.len()).is_err(), "a row outside the step is an error");
            source.finish()
        };
        assert_eq!(masks.failed.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![RequestId(2)]);

        let prefill_only = StepPlan { rows: vec![row(1, vec![9, 9], None)] };
        assert!(!StepMasks::needed(&constraints, &prefill_only), "no sampling row: no masks");
    }
}
