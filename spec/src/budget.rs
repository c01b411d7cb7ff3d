//! Verify budgets: how many of each request's draft tokens the next target step verifies.
//!
//! Three policies over the prefix survival probabilities `a_{r,j} = Π_{i<=j} c_{r,i}`:
//! - [`dspark_schedule`]: DSpark Algorithm 1 exactly (dspark.md §2.2): admit candidates in
//!   descending survival (ties: lower request index, then lower position) while the throughput
//!   estimate `Θ = τ·SPS(B)` strictly improves, and stop at the first candidate that does not.
//! - [`ProductionBudget`]: DSpark §5.2 as vLLM implements it (`adaptive_verification.py`): the
//!   capacity K is the global argmax over k of `E(k) / C(k)` with no early stop, computed from the
//!   survivals of two steps earlier, where `C(k)` includes the model drafter's measured cost for the
//!   step's model-drafted rows ([`SpsProfile::draft_seconds`]); the K slots go to the current step's
//!   top-K candidates with the (request, position) index tie-break.
//! - [`threshold_schedule`]: keep the positions whose survival is at least a static threshold.
//!
//! Invariants (the property tests below check them):
//! - Non-anticipating: whether position j of request r is verified depends on confidences
//!   `c_{r,1..j}` and on other requests, never on `c_{r,>j}` (which depends on the token at j) and
//!   never on token values. That is what keeps verification lossless (DSpark Appendix A).
//! - Every request gets a prefix of its draft, of length at most its [`BudgetRow::cap`].
//! - The same holds over calibrated drafts (`crate::calibration`), whose survivals depend only on
//!   `c_{r,≤j}` and on earlier rounds: the property tests run every policy over them too.

use std::collections::VecDeque;

use crate::draft::{Draft, DraftSource};
use crate::sps::SpsProfile;

/// One request's input to a budget decision.
#[derive(Clone, Copy, Debug)]
pub struct BudgetRow<'a> {
    pub draft: &'a Draft,
    /// The most draft tokens this request may verify (see [`request_cap`]).
    pub cap: usize,
}

/// The per-request cap: verifying ℓ drafts appends `1 + ℓ` tokens to the state and emits up to
/// `ℓ + 1` tokens, so ℓ <= `max_new_tokens_left − 1` and ℓ <= `context_tokens_left − 1`.
pub fn request_cap(draft_len: usize, max_new_tokens_left: usize, context_tokens_left: usize) -> usize {
    draft_len.min(max_new_tokens_left.saturating_sub(1)).min(context_tokens_left.saturating_sub(1))
}

/// A verify candidate: request `row`, draft position `pos` (0-based), survival `survival`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    survival: f64,
    row: usize,
    pos: usize,
}

/// All candidates with positive survival within each row's cap, best first: survival descending,
/// then (row, position) ascending. Within a row survival never increases, so each row's candidates
/// appear in position order and every prefix of the list admits a prefix of each draft.
fn ranked_candidates(survivals: &[Vec<f64>], caps: &[usize]) -> Vec<Candidate> {
    let mut all: Vec<Candidate> = survivals
        .iter()
        .zip(caps)
        .enumerate()
        .flat_map(|(row, (a, &cap))| {
            a.iter().take(cap).enumerate().map(move |(pos, &survival)| Candidate { survival, row, pos })
        })
        .filter(|c| c.survival > 0.0)
        .collect();
    all.sort_by(|x, y| y.survival.total_cmp(&x.survival).then(x.row.cmp(&y.row)).then(x.pos.cmp(&y.pos)));
    all
}

fn survivals_and_caps(rows: &[BudgetRow<'_>]) -> (Vec<Vec<f64>>, Vec<usize>) {
    let survivals = rows.iter().map(|r| r.draft.survival()).collect();
    let caps = rows.iter().map(|r| r.cap.min(r.draft.len())).collect();
    (survivals, caps)
}

/// DSpark Algorithm 1: verify lengths per row.
pub fn dspark_schedule(rows: &[BudgetRow<'_>], sps: &SpsProfile) -> Vec<usize> {
    let (survivals, caps) = survivals_and_caps(rows);
    let mut lengths = vec![0usize; rows.len()];
    let requests = rows.len();
    let mut batch = requests;
    let mut tau = requests as f64;
    let mut best = tau * sps.sps(batch);
    for c in ranked_candidates(&survivals, &caps) {
        batch += 1;
        tau += c.survival;
        let theta = tau * sps.sps(batch);
        if theta > best {
            best = theta;
            lengths[c.row] = c.pos + 1;
        } else {
            break;
        }
    }
    lengths
}

/// Static threshold: verify the positions whose survival is at least `threshold`.
pub fn threshold_schedule(rows: &[BudgetRow<'_>], threshold: f64) -> Vec<usize> {
    rows.iter()
        .map(|r| r.draft.survival().iter().take(r.cap.min(r.draft.len())).take_while(|&&a| a >= threshold).count())
        .collect()
}

/// The top-K allocation: the first `capacity` ranked candidates, counted per row.
pub fn allocate_top_k(rows: &[BudgetRow<'_>], capacity: usize) -> Vec<usize> {
    let (survivals, caps) = survivals_and_caps(rows);
    let mut lengths = vec![0usize; rows.len()];
    for c in ranked_candidates(&survivals, &caps).into_iter().take(capacity) {
        lengths[c.row] = c.pos + 1;
    }
    lengths
}

/// The best verify capacity over candidate survivals `sorted` (descending) for `requests` rows that
/// each feed one token: `(K, E(K) / C(K))` with K = argmax_k E(k) / C(k) (smallest k on ties),
/// E(k) = requests + Σ top-k survivals and C(k) = draft_seconds + step_seconds(requests + k).
pub fn best_capacity(sorted: &[f64], requests: usize, draft_seconds: f64, sps: &SpsProfile) -> (usize, f64) {
    let rate = |k: usize, expected: f64| expected / (draft_seconds + sps.step_seconds(requests + k));
    let mut expected = requests as f64;
    let (mut best_k, mut best) = (0, rate(0, expected));
    for (i, a) in sorted.iter().enumerate() {
        expected += a;
        let r = rate(i + 1, expected);
        if r > best {
            best = r;
            best_k = i + 1;
        }
    }
    (best_k, best)
}

/// The production budget: stale capacity, current top-K allocation.
#[derive(Clone, Debug)]
pub struct ProductionBudget {
    /// SPS(B) and the drafter's cost per round (shifts the argmax of E/C toward larger k).
    sps: SpsProfile,
    /// Capped survivals of the last two steps, oldest first.
    history: VecDeque<Vec<Vec<f64>>>,
}

impl ProductionBudget {
    pub fn new(sps: SpsProfile) -> Self {
        ProductionBudget { sps, history: VecDeque::new() }
    }

    /// K = argmax_k E(k) / C(k) over the survivals `snapshot` ([`best_capacity`]), with the drafter's
    /// cost for `model_rows` drafted rows.
    pub fn capacity(&self, snapshot: &[Vec<f64>], requests: usize, model_rows: usize) -> usize {
        let mut all: Vec<f64> = snapshot.iter().flatten().copied().filter(|&a| a > 0.0).collect();
        all.sort_by(|x, y| y.total_cmp(x));
        best_capacity(&all, requests, self.sps.draft_seconds(model_rows), &self.sps).0
    }

    /// Verify lengths for this step. The capacity uses the survivals recorded two calls earlier (at
    /// start-up, the oldest available; at the very first call, no limit) and this step's count of
    /// model drafts; the allocation uses this step's survivals.
    pub fn plan(&mut self, rows: &[BudgetRow<'_>]) -> Vec<usize> {
        let (survivals, caps) = survivals_and_caps(rows);
        let capped: Vec<Vec<f64>> = survivals.iter().zip(&caps).map(|(a, &cap)| a[..cap].to_vec()).collect();
        let model_rows = rows.iter().filter(|r| r.draft.source() == DraftSource::Model && !r.draft.is_empty()).count();
        let capacity = match self.history.front() {
            Some(snapshot) => self.capacity(snapshot, rows.len(), model_rows),
            // The first step has no earlier survivals; a capacity from its own would let later positions'
            // confidences decide whether an earlier one is verified (DSpark Appendix A), so it verifies every
            // candidate.
            None => usize::MAX,
        };
        self.history.push_back(capped);
        while self.history.len() > 2 {
            self.history.pop_front();
        }
        allocate_top_k(rows, capacity)
    }
}

/// A verify-budget policy the engine applies every step.
#[derive(Clone, Debug)]
pub enum BudgetPolicy {
    /// Verify every draft token up to the cap.
    Full,
    StaticThreshold(f64),
    Dspark(SpsProfile),
    Production(ProductionBudget),
}

impl BudgetPolicy {
    /// Whether the policy weighs survivals against SPS(B) (and so runs over calibrated survivals).
    pub fn is_load_aware(&self) -> bool {
        self.profile().is_some()
    }

    /// The SPS(B) profile of a load-aware policy.
    pub fn profile(&self) -> Option<&SpsProfile> {
        match self {
            BudgetPolicy::Dspark(sps) => Some(sps),
            BudgetPolicy::Production(p) => Some(&p.sps),
            BudgetPolicy::Full | BudgetPolicy::StaticThreshold(_) => None,
        }
    }

    pub fn plan(&mut self, rows: &[BudgetRow<'_>]) -> Vec<usize> {
        match self {
            BudgetPolicy::Full => rows.iter().map(|r| r.cap.min(r.draft.len())).collect(),
            BudgetPolicy::StaticThreshold(t) => threshold_schedule(rows, *t),
            BudgetPolicy::Dspark(sps) => dspark_schedule(rows, sps),
            BudgetPolicy::Production(p) => p.plan(rows),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::Calibration;
    use crate::sps::{DraftPoint, SpsPoint};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn profile(points: &[(usize, f64)]) -> SpsProfile {
        SpsProfile::from_points(
            points.iter().map(|&(b, s)| SpsPoint { batch_tokens: b, steps_per_second: s }).collect(),
        )
        .unwrap()
    }

    /// A profile where verifying is cheap at first and then saturates (a roofline-like curve).
    fn roofline() -> SpsProfile {
        profile(&[(1, 100.0), (16, 95.0), (32, 80.0), (64, 45.0), (128, 22.0)])
    }

    fn draft(conf: &[f64]) -> Draft {
        Draft::new((0..conf.len() as u32).collect(), conf.to_vec()).unwrap()
    }

    fn rows(drafts: &[Draft], cap: usize) -> Vec<BudgetRow<'_>> {
        drafts.iter().map(|d| BudgetRow { draft: d, cap }).collect()
    }

    fn random_drafts(rng: &mut ChaCha8Rng, n: usize, gamma: usize) -> Vec<Draft> {
        (0..n).map(|_| draft(&(0..gamma).map(|_| rng.gen_range(0.0..1.0)).collect::<Vec<_>>())).collect()
    }

    /// A calibration learned from `rounds` random verified drafts with random outcomes.
    fn random_calibration(rng: &mut ChaCha8Rng, rounds: usize) -> Calibration {
        let mut cal = Calibration::default();
        for _ in 0..rounds {
            let len = rng.gen_range(1..8);
            let survival = random_drafts(rng, 1, len)[0].survival();
            cal.observe(&survival, rng.gen_range(0..=len));
            cal.next_round();
        }
        cal
    }

    /// The drafts as the engine hands them to a load-aware budget: calibrated.
    fn calibrated(cal: &Calibration, drafts: &[Draft]) -> Vec<Draft> {
        drafts.iter().map(|d| cal.apply(d)).collect()
    }

    #[test]
    fn algorithm_1_admits_in_survival_order_and_stops_early() {
        // SPS falls slowly up to 4 tokens, then steeply: only the most confident drafts pay off.
        let sps = profile(&[(2, 100.0), (4, 98.0), (5, 40.0)]);
        let drafts = [draft(&[0.9, 0.9, 0.9]), draft(&[0.5, 0.9])];
        let lengths = dspark_schedule(&rows(&drafts, 8), &sps);
        assert_eq!(lengths, vec![2, 0]);
    }

    #[test]
    fn algorithm_1_reproduces_the_appendix_a_counterexample_without_bias() {
        // DSpark Appendix A: p_t = (0.7, 0.3), p_d = (0.5, 0.5), SPS(1..3) = 1.0, 0.5, 0.45.
        // c_1 = 1 - TV = 0.8; c_2 depends on the draft token x_1 (high after 0, low after 1).
        let sps = profile(&[(1, 1.0), (2, 0.5), (3, 0.45)]);
        let (p_t, p_d): ([f64; 2], [f64; 2]) = ([0.7, 0.3], [0.5, 0.5]);
        let c2 = [0.9, 0.1];
        // Exact law of the first emitted token: with ℓ = 0 it is drawn from p_t; with ℓ >= 1 the
        // draft is accepted with min(1, p_t/p_d), else the residual norm(max(p_t − p_d, 0)) = token 0.
        let first_token_law = |schedule: &dyn Fn(&Draft) -> usize| {
            let mut law = [0.0f64; 2];
            for x1 in 0..2 {
                let d = Draft::new(vec![x1 as u32, 0], vec![0.8, c2[x1]]).unwrap();
                if schedule(&d) == 0 {
                    law[0] += p_d[x1] * p_t[0];
                    law[1] += p_d[x1] * p_t[1];
                } else {
                    let accept = (p_t[x1] / p_d[x1]).min(1.0);
                    law[x1] += p_d[x1] * accept;
                    law[0] += p_d[x1] * (1.0 - accept);
                }
            }
            law
        };
        let ours = first_token_law(&|d| dspark_schedule(&[BudgetRow { draft: d, cap: 2 }], &sps)[0]);
        assert!((ours[0] - 0.7).abs() < 1e-12 && (ours[1] - 0.3).abs() < 1e-12, "{ours:?}");
        // A look-ahead search (global argmax over ℓ, no early stop) peeks at c_2 and is biased.
        let lookahead = |d: &Draft| {
            let a = d.survival();
            (0..=2)
                .map(|l| (l, (1.0 + a[..l].iter().sum::<f64>()) * sps.sps(1 + l)))
                .fold((0, 0.0), |b, x| if x.1 > b.1 { x } else { b })
                .0
        };
        let biased = first_token_law(&lookahead);
        assert!((biased[0] - 0.85).abs() < 1e-12, "{biased:?}");
    }

    #[test]
    fn schedules_ignore_token_values() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let sps = roofline();
        for _ in 0..200 {
            let a = random_drafts(&mut rng, 6, 7);
            let b: Vec<Draft> = a
                .iter()
                .map(|d| {
                    Draft::new(d.tokens().iter().map(|_| rng.gen_range(0..163_840)).collect(), d.confidences().to_vec())
                        .unwrap()
                })
                .collect();
            assert_eq!(dspark_schedule(&rows(&a, 7), &sps), dspark_schedule(&rows(&b, 7), &sps));
            assert_eq!(allocate_top_k(&rows(&a, 7), 9), allocate_top_k(&rows(&b, 7), 9));
            assert_eq!(threshold_schedule(&rows(&a, 7), 0.3), threshold_schedule(&rows(&b, 7), 0.3));
            let cal = random_calibration(&mut rng, 20);
            let (ca, cb) = (calibrated(&cal, &a), calibrated(&cal, &b));
            assert_eq!(dspark_schedule(&rows(&ca, 7), &sps), dspark_schedule(&rows(&cb, 7), &sps), "calibrated");
            assert_eq!(allocate_top_k(&rows(&ca, 7), 9), allocate_top_k(&rows(&cb, 7), 9), "calibrated");
        }
    }

    /// Changes every confidence of `row` after position `j` (those depend on the token at j).
    fn perturb_after(drafts: &[Draft], row: usize, j: usize, rng: &mut ChaCha8Rng) -> Vec<Draft> {
        let mut out = drafts.to_vec();
        let mut conf = drafts[row].confidences().to_vec();
        for c in conf.iter_mut().skip(j + 1) {
            *c = rng.gen_range(0.0..1.0);
        }
        out[row] = Draft::new(drafts[row].tokens().to_vec(), conf).unwrap();
        out
    }

    #[test]
    fn admission_of_a_position_never_depends_on_later_confidences() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let sps = roofline();
        for trial in 0..400 {
            let drafts = random_drafts(&mut rng, 1 + trial % 8, 7);
            let row = rng.gen_range(0..drafts.len());
            let j = rng.gen_range(0..7);
            let other = perturb_after(&drafts, row, j, &mut rng);
            let admitted = |lengths: &[usize]| lengths[row] > j;
            let (r1, r2) = (rows(&drafts, 7), rows(&other, 7));
            assert_eq!(admitted(&dspark_schedule(&r1, &sps)), admitted(&dspark_schedule(&r2, &sps)), "Algorithm 1");
            let k = rng.gen_range(0..20);
            assert_eq!(admitted(&allocate_top_k(&r1, k)), admitted(&allocate_top_k(&r2, k)), "top-K");
            assert_eq!(admitted(&threshold_schedule(&r1, 0.2)), admitted(&threshold_schedule(&r2, 0.2)), "threshold");
            // Calibrated survivals (learned from earlier rounds only) under Algorithm 1 and the
            // production budget past its first two steps.
            let cal = random_calibration(&mut rng, trial % 40);
            let (c1, c2) = (calibrated(&cal, &drafts), calibrated(&cal, &other));
            let (r1, r2) = (rows(&c1, 7), rows(&c2, 7));
            assert_eq!(
                admitted(&dspark_schedule(&r1, &sps)),
                admitted(&dspark_schedule(&r2, &sps)),
                "calibrated Alg. 1"
            );
            let mut production = ProductionBudget::new(sps.clone());
            for _ in 0..2 {
                production.plan(&rows(&calibrated(&cal, &random_drafts(&mut rng, drafts.len(), 7)), 7));
            }
            let mut twin = production.clone();
            assert_eq!(admitted(&production.plan(&r1)), admitted(&twin.plan(&r2)), "calibrated production");
        }
    }

    #[test]
    fn budgets_respect_caps_and_admit_prefixes() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let sps = roofline();
        let draft_cost = vec![DraftPoint { rows: 1, seconds: 0.001 }];
        let mut production = ProductionBudget::new(sps.clone().with_draft_cost(draft_cost).unwrap());
        for _ in 0..200 {
            let drafts = random_drafts(&mut rng, 5, 7);
            let caps: Vec<usize> = (0..5).map(|_| request_cap(7, rng.gen_range(0..9), rng.gen_range(0..9))).collect();
            let r: Vec<BudgetRow<'_>> = drafts.iter().zip(&caps).map(|(d, &cap)| BudgetRow { draft: d, cap }).collect();
            let mut policies =
                [BudgetPolicy::Full, BudgetPolicy::StaticThreshold(0.1), BudgetPolicy::Dspark(sps.clone())];
            let mut plans: Vec<Vec<usize>> = policies.iter_mut().map(|p| p.plan(&r)).collect();
            plans.push(production.plan(&r));
            for plan in plans {
                for (len, cap) in plan.iter().zip(&caps) {
                    assert!(len <= cap, "{plan:?} exceeds caps {caps:?}");
                }
            }
        }
        assert_eq!(request_cap(7, 1, 100), 0, "one token left: only the bonus");
        assert_eq!(request_cap(7, 100, 4), 3);
    }

    #[test]
    fn the_first_production_step_does_not_size_its_capacity_from_its_own_survivals() {
        // Hopeless drafts never pay here, yet the first step has no earlier survivals: it verifies every candidate,
        // so no position's admission depends on the confidences after it.
        let sps = profile(&[(1, 100.0), (2, 50.0), (16, 10.0)]);
        let hopeless = [draft(&[0.01; 7]), draft(&[0.01, 0.0])];
        let mut p = ProductionBudget::new(sps);
        assert_eq!(p.plan(&rows(&hopeless, 5)), vec![5, 1]);
        assert_eq!(p.plan(&rows(&hopeless, 5)), vec![0, 0], "step 2 sizes its capacity from step 1: hopeless");
    }

    #[test]
    fn production_capacity_uses_survivals_from_two_steps_earlier() {
        // Every verified token costs a lot here, so drafts of survival 0.01 never pay.
        let sps = profile(&[(1, 100.0), (2, 50.0), (16, 10.0)]);
        let confident = [draft(&[0.99; 7]), draft(&[0.99; 7])];
        let hopeless = [draft(&[0.01; 7]), draft(&[0.01; 7])];
        let mut p = ProductionBudget::new(sps);
        let full = p.capacity(&[vec![0.99; 7], vec![0.99; 7]], 2, 2);
        assert!(full > 0);
        assert_eq!(p.capacity(&[vec![0.01; 7], vec![0.01; 7]], 2, 2), 0);
        // Steps 1 and 2 are confident, step 3 is hopeless but its budget comes from step 1.
        p.plan(&rows(&confident, 7));
        p.plan(&rows(&confident, 7));
        let step3 = p.plan(&rows(&hopeless, 7));
        assert_eq!(step3.iter().sum::<usize>(), full.min(14), "stale capacity, current allocation");
        // Steps 4 (stale: step 2, confident) and 5 (stale: step 3, hopeless).
        p.plan(&rows(&hopeless, 7));
        assert_eq!(p.plan(&rows(&confident, 7)), vec![0, 0]);
    }

    #[test]
    fn the_drafters_cost_counts_for_model_drafts_only_and_favours_longer_verification() {
        // Verify cost grows linearly (1 ms + 0.2 ms per token); survivals 0.5, 0.25, 0.125, ...: free, K <= 2;
        // after a 10 ms draft, K = 4 (K = 1 and 2 tie without one).
        let sps = profile(&[(1, 1000.0), (101, 1.0 / 0.021)]);
        let with_cost = |s: f64| sps.clone().with_draft_cost(vec![DraftPoint { rows: 1, seconds: s }]).unwrap();
        let snapshot = [draft(&[0.5; 7]).survival()];
        let free = ProductionBudget::new(with_cost(0.0)).capacity(&snapshot, 1, 1);
        let costly = ProductionBudget::new(with_cost(0.01)).capacity(&snapshot, 1, 1);
        assert!(free < costly, "a paid-for draft is worth verifying further: {free} vs {costly}");
        assert_eq!(ProductionBudget::new(with_cost(0.01)).capacity(&snapshot, 1, 0), free, "no model rows, no cost");
        let mut p = ProductionBudget::new(with_cost(0.01));
        assert!(free <= 2 && costly == 4, "{free} {costly}");
        let model = [draft(&[0.5; 7]).with_source(DraftSource::Model)];
        let suffix = [draft(&[0.5; 7])];
        assert_eq!(p.plan(&rows(&model, 7)), vec![7], "the first step verifies every candidate");
        assert_eq!(p.plan(&rows(&model, 7)), vec![costly]);
        assert_eq!(p.clone().plan(&rows(&suffix, 7)), vec![free]);
    }

    #[test]
    fn top_k_breaks_ties_by_request_then_position() {
        let drafts = [draft(&[1.0, 0.5]), draft(&[1.0, 0.5])];
        assert_eq!(allocate_top_k(&rows(&drafts, 2), 1), vec![1, 0]);
        assert_eq!(allocate_top_k(&rows(&drafts, 2), 3), vec![2, 1]);
        assert_eq!(allocate_top_k(&rows(&drafts, 2), 10), vec![2, 2]);
    }
}
