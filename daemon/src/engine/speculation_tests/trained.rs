//! Speculation on the trained embedded model (k3-tiny and its DSpark drafter trained on the Python standard
//! library) through the real engine thread, on code prompts: it continues `def` with Python; greedy output with
//! every method equals spec off; its drafts are accepted (a random drafter's almost never are); and the
//! load-aware budget verifies fewer drafts than the static budget where the drafter's confidence is low, with a
//! higher share of them accepted. Every window stays at most 16 tokens, where a window's forward equals
//! token-by-token decoding bit for bit.

use sparkd_kernels::trained::TrainedModel;
use sparkd_tokenizer::Tokenizer;

use super::*;

/// Code the model has not seen verbatim (the corpus is the standard library; these are written here).
const CODE: [&str; 3] = [
    "import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n    result = []\n    for name in os.listdir(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n    parser.add_argument(\"--verbose\", action=\"store_true\")\n",
];

fn trained_runner(cfg: &SpeculationConfig) -> Box<dyn Runner> {
    let model = TrainedModel::embedded().expect("the embedded trained model");
    startup::cpu_runner(model.config(), &model.target(), cfg, &startup::DrafterOrigin::Trained(Arc::clone(&model)))
        .expect("cpu runner")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::builtin().expect("built-in tokenizer")
}

fn code_requests(max_tokens: usize) -> Vec<(Vec<TokenId>, usize, Option<usize>)> {
    let t = tokenizer();
    CODE.iter().map(|code| (t.encode(code), max_tokens, None)).collect()
}

#[test]
fn the_trained_model_continues_def_with_python() {
    let t = tokenizer();
    let off = SpeculationConfig::default();
    let o = Harness::new(trained_runner(&off), off, 16).run(&[(t.encode("def"), 16, None)]).remove(0);
    assert!(o.failed.is_none(), "{:?}", o.failed);
    let text = format!("def{}", t.decode_lossy(&o.tokens).expect("decodes"));
    // A function header (a name, then a parameter list closed by `):`) and an indented body with Python words.
    // The random k3-tiny gives word salad from ids across the vocabulary ("defsoftwarepdbSecure_CUSTOMQU ...").
    let named =
        text.strip_prefix("def ").and_then(|rest| rest.chars().next()).is_some_and(|c| c.is_alphabetic() || c == '_');
    let keyword = ["self", "return", "if ", "for ", "with ", "import", "None"].iter().any(|k| text.contains(k));
    assert!(named && text.contains("):\n    ") && keyword, "not a Python function: {text:?}");
}

#[test]
fn greedy_output_of_the_trained_model_is_unchanged_by_every_method() {
    let requests = code_requests(24);
    let off = SpeculationConfig::default();
    let reference: Vec<Vec<TokenId>> =
        Harness::new(trained_runner(&off), off, 16).run(&requests).into_iter().map(|o| o.tokens).collect();
    for method in [SpecMethod::Dspark, SpecMethod::Suffix, SpecMethod::Ngram, SpecMethod::Hybrid] {
        let cfg = spec(method, 7);
        let outcomes = Harness::new(trained_runner(&cfg), cfg, 16).run(&requests);
        for (o, want) in outcomes.iter().zip(&reference) {
            assert!(o.failed.is_none(), "{method:?}: {:?}", o.failed);
            assert_eq!(&o.tokens, want, "{method:?}");
        }
        let accepted: usize = outcomes.iter().map(Outcome::accepted).sum();
        let drafted: usize = outcomes.iter().map(Outcome::drafted).sum();
        // The trained drafter's first draft alone is right about a third of the time; model-free drafting finds
        // the prompts' own repeats (`self.items`, `parser.add_argument`).
        assert!(accepted * 10 >= drafted.min(60), "{method:?}: {accepted} of {drafted} drafts accepted");
    }
}

/// A profile whose steps slow gently with batch size, so a draft pays only when it is likely accepted.
fn gentle_profile() -> SpsProfile {
    let points = [(1, 100.0), (2, 99.0), (4, 97.0), (8, 92.0), (16, 80.0), (32, 55.0)];
    SpsProfile::from_points(points.iter().map(|&(b, s)| SpsPoint { batch_tokens: b, steps_per_second: s }).collect())
        .expect("profile")
        .with_draft_cost(vec![DraftPoint { rows: 1, seconds: 0.002 }])
        .expect("draft table")
}

#[test]
fn the_load_aware_budget_verifies_fewer_drafts_where_confidence_is_low() {
    let requests = code_requests(32);
    let run = |budget| {
        let cfg = SpeculationConfig { budget, sps_profile: Some(gentle_profile()), ..spec(SpecMethod::Dspark, 7) };
        Harness::new(trained_runner(&cfg), cfg, 16).run(&requests)
    };
    let (fixed, aware) = (run(SpecBudget::Static), run(SpecBudget::Production));
    for (f, a) in fixed.iter().zip(&aware) {
        assert!(f.failed.is_none() && a.failed.is_none(), "{:?} {:?}", f.failed, a.failed);
        assert_eq!(f.tokens, a.tokens, "both lossless");
        // The static budget verifies all 7 drafts in every round that has 8 tokens to go (the prefill's step
        // emits the first token; a round emits its accepted drafts and one more).
        let mut to_go = 32 - 1;
        for round in &f.rounds {
            assert_eq!(round.0, 7.min(to_go - 1), "static rounds {:?}", f.rounds);
            to_go -= round.1 + 1;
        }
    }
    let total = |o: &[Outcome], f: fn(&Outcome) -> usize| o.iter().map(f).sum::<usize>();
    let (fixed_drafted, aware_drafted) = (total(&fixed, Outcome::drafted), total(&aware, Outcome::drafted));
    let (fixed_accepted, aware_accepted) = (total(&fixed, Outcome::accepted), total(&aware, Outcome::accepted));
    assert!(aware_drafted * 2 <= fixed_drafted, "load-aware verified {aware_drafted} drafts, static {fixed_drafted}");
    // What it cut was the unlikely tail: the drafts it kept are accepted more often.
    let rate = |accepted: usize, drafted: usize| accepted as f64 / drafted.max(1) as f64;
    assert!(
        rate(aware_accepted, aware_drafted) > rate(fixed_accepted, fixed_drafted),
        "accepted {aware_accepted}/{aware_drafted} load-aware vs {fixed_accepted}/{fixed_drafted} static"
    );
}
