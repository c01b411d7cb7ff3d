//! `sparkd spec-eval`: what speculation achieves on code continuations. The prompts are the first
//! `--prompt-tokens` tokens (served tokenizer) of the first `--prompts` readable files of a list (Python sources
//! for the trained k3-tiny; `sparkd corpus` writes the held-out list), each continued greedily for `--max-tokens`.
//! It reports DSpark's acceptance per draft position and the calibration of its confidences (with an optional
//! reliability diagram, `svg`), and the acceptance length, draft counts and wall time of every drafting method of
//! the engine (dspark, suffix, ngram, hybrid) beside the run without speculation.
//!
//! Invariants:
//! - Every number comes from the served path: each method runs in its own engine thread on a runner composed as
//!   `sparkd serve --device D [--model DIR | --synthetic NAME] --spec M --spec-budget static --num-spec-tokens γ
//!   --decode-step-target off` composes it (`startup::compose`: the same runner, drafter, token mask and proposer),
//!   with the prefix cache off so every prompt is prefilled on its own. The prompts are sent one after another,
//!   greedy, ignoring EOS; the suffix proposer keeps what the engine gives it (each prompt, and the outputs of the
//!   prompts before it). With `--device auto` the first run picks the backend and the later ones use it.
//! - The static budget verifies every draft position the request may still produce (`request_cap`), so DSpark's
//!   per-position figures see every drafted position up to the end of the continuation.
//! - DSpark's per-position rounds are the drafts its proposer handed the engine (recorded by a wrapper that changes
//!   nothing), paired in order with the request's decode steps as the engine reported them; a pairing that does
//!   not line up (counts, or accepted tokens that are not the draft's) is an error, never a guess.
//! - Lossless: every method's greedy tokens must equal the run without speculation, prompt by prompt; the report
//!   is written either way, and any mismatch makes the command exit non-zero.
//! - Bad input (no readable prompt, a bad flag, an unusable model) is one error naming what is wrong; a file of
//!   the list that cannot be read, is not UTF-8 or has no tokens is skipped with a warning and listed as skipped.

mod stats;
mod svg;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use serde::Serialize;
use sparkd::config::speculation::{SpecMethod, DSPARK_DEFAULT_NUM_SPEC_TOKENS, MAX_NUM_SPEC_TOKENS};
use sparkd::config::{Device, ServeArgs, DEFAULT_SYNTHETIC_CONFIG};
use sparkd::engine::{
    spawn, EngineCommand, EngineConfig, EngineEvent, EngineHandle, FinishReason, GenerateRequest, RequestId,
    Speculation,
};
use sparkd::startup::{compose, load_tokenizer};
use sparkd_kernels::runner::{Drafter, RowInput, SampleRequest, SamplingParams};
use sparkd_kernels::{KernelError, Runner, TokenId};
use sparkd_spec::{Draft, Proposer, RoundRow, SeqKey};
use sparkd_tokenizer::Tokenizer;
use tokio::sync::mpsc;

use self::stats::{calibration, Calibration, Round};

/// The drafting methods compared, in the order they run (after the run without speculation).
const METHODS: [SpecMethod; 4] = [SpecMethod::Dspark, SpecMethod::Suffix, SpecMethod::Ngram, SpecMethod::Hybrid];
/// Events a request may have in flight to this command before the engine parks them.
const EVENT_CHANNEL: usize = 256;
/// Decode steps of the throwaway decode that warms each runner up before its engine is timed.
const WARM_UP_STEPS: usize = 4;

/// `sparkd spec-eval` options.
#[derive(Clone, Debug, clap::Args)]
pub struct SpecEvalArgs {
    /// Backend, as `sparkd serve --device` (`null` has no model to measure).
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Checkpoint folder (config.json + safetensors, and `drafter/` for dspark and hybrid).
    #[arg(long, value_name = "DIR", conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// Without --model: the synthetic config generated in memory, as `sparkd serve --synthetic`.
    #[arg(long, default_value = DEFAULT_SYNTHETIC_CONFIG)]
    pub synthetic: String,
    /// A text file listing the prompt files, one path per line (relative paths are relative to the list's
    /// folder; blank lines are skipped).
    #[arg(long, value_name = "LIST.txt")]
    pub files: PathBuf,
    /// Prompts: the first N listed files that read as UTF-8 text with at least one token.
    #[arg(long, value_name = "N")]
    pub prompts: usize,
    /// Tokens of each file's beginning that form its prompt (fewer when the file is shorter).
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens generated after each prompt (greedy, EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// γ: the most draft tokens verified per step, for every method (the static budget verifies all of them).
    #[arg(long, default_value_t = DSPARK_DEFAULT_NUM_SPEC_TOKENS, value_name = "γ")]
    pub num_spec_tokens: usize,
    /// Write the JSON report here.
    #[arg(long, value_name = "REPORT.json")]
    pub out: PathBuf,
    /// Also write DSpark's reliability diagram (SVG) here.
    #[arg(long, value_name = "RELIABILITY.svg")]
    pub svg: Option<PathBuf>,
}

/// `sparkd serve`'s flags, parsed the way `sparkd serve` parses them.
#[derive(Parser)]
struct ServeCli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// One prompt: a file's first tokens.
struct Prompt {
    file: PathBuf,
    tokens: Vec<TokenId>,
}

/// A listed file that gave no prompt, and why.
#[derive(Debug, Serialize)]
struct Skipped {
    file: String,
    reason: String,
}

/// One step's result for one request, as the engine reported it.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Step {
    /// Tokens committed (accepted drafts and one more).
    emitted: usize,
    /// Draft tokens verified.
    drafted: usize,
    /// Of those, accepted.
    accepted: usize,
}

/// What one request received: its tokens and the steps that committed them (the first ends the prefill).
#[derive(Clone, Debug, Default, PartialEq)]
struct Generation {
    tokens: Vec<TokenId>,
    steps: Vec<Step>,
}

/// A draft the proposer handed the engine.
#[derive(Clone, Debug, PartialEq)]
struct Proposed {
    seq: SeqKey,
    tokens: Vec<TokenId>,
    confidences: Vec<f64>,
}

/// One method's engine run over every prompt.
struct MethodRun {
    method: SpecMethod,
    /// The backend it ran on (`auto` resolved) and the runner's own name.
    device: Device,
    device_name: String,
    generations: Vec<Generation>,
    wall: Duration,
    /// Every draft proposed, in order (recorded for DSpark only).
    drafts: Vec<Proposed>,
}

/// A proposer that passes every draft it proposes on to `drafts` as well as to the engine, changing nothing.
struct Recording {
    inner: Box<dyn Proposer>,
    drafts: std_mpsc::Sender<Proposed>,
}

impl Proposer for Recording {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn begin(&mut self, seq: SeqKey, prompt: &[TokenId]) {
        self.inner.begin(seq, prompt);
    }

    fn prepare_round(
        &mut self,
        drafter: Option<&mut (dyn Drafter + '_)>,
        rows: &[RoundRow<'_>],
    ) -> sparkd_spec::Result<()> {
        self.inner.prepare_round(drafter, rows)
    }

    fn drafts_from_context(&self) -> bool {
        self.inner.drafts_from_context()
    }

    fn propose(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> Draft {
        let draft = self.inner.propose(seq, context, max_len);
        let proposed = Proposed { seq, tokens: draft.tokens().to_vec(), confidences: draft.confidences().to_vec() };
        // The receiver outlives the engine run; should it not, the draft is still verified, only not recorded, and
        // the pairing then fails with an error.
        let _ = self.drafts.send(proposed);
        draft
    }

    fn end(&mut self, seq: SeqKey, context: &[TokenId], keep: bool) {
        self.inner.end(seq, context, keep);
    }
}

/// Runs `sparkd spec-eval`: every method over the prompts, the report written (and the diagram), the table on
/// stderr; an error when an output was not lossless.
pub fn run(args: &SpecEvalArgs) -> Result<()> {
    check(args)?;
    let tokenizer = load_tokenizer(args.model.as_deref())?;
    let (prompts, skipped) = load_prompts(&args.files, args.prompts, args.prompt_tokens, &tokenizer)?;
    tracing::info!("spec-eval: {} prompts; the run without speculation first", prompts.len());
    let baseline = run_method(args, SpecMethod::Off, args.device, &prompts)?;
    let mut runs = Vec::with_capacity(METHODS.len());
    for method in METHODS {
        tracing::info!("spec-eval: --spec {}", method.as_str());
        runs.push(run_method(args, method, baseline.device, &prompts)?);
    }
    let report = build_report(args, &prompts, skipped, &baseline, &runs)?;
    eprint!("{}", table(&report));
    let json = serde_json::to_string_pretty(&report).context("serializing the report")?;
    std::fs::write(&args.out, json).with_context(|| format!("--out: writing {}", args.out.display()))?;
    if let Some(path) = &args.svg {
        let title = format!("DSpark confidence calibration: {} on {}", report.settings.model, report.settings.device);
        std::fs::write(path, svg::reliability_svg(&report.dspark, &title))
            .with_context(|| format!("--svg: writing {}", path.display()))?;
    }
    let failed: Vec<String> = report
        .methods
        .iter()
        .filter(|m| !m.lossless)
        .map(|m| format!("{} ({} prompts)", m.method, m.mismatches.len()))
        .collect();
    if !failed.is_empty() {
        bail!(
            "greedy output with speculation differs from the output without it: {}; see {}",
            failed.join(", "),
            args.out.display()
        );
    }
    Ok(())
}

/// The flags clap's types cannot check.
fn check(args: &SpecEvalArgs) -> Result<()> {
    let positive = [("prompts", args.prompts), ("prompt-tokens", args.prompt_tokens), ("max-tokens", args.max_tokens)];
    if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
        bail!("--{flag}: must be at least 1");
    }
    if !(1..=MAX_NUM_SPEC_TOKENS).contains(&args.num_spec_tokens) {
        bail!("--num-spec-tokens: {} is not in 1..={MAX_NUM_SPEC_TOKENS}", args.num_spec_tokens);
    }
    if args.device == Device::Null {
        bail!("--device null has no model to measure; use cpu, cuda or auto");
    }
    if let Some(dir) = &args.model {
        ensure!(dir.is_dir(), "--model: {} is not a folder", dir.display());
    }
    Ok(())
}

/// The first `wanted` prompts of the files `list` names (each file's first `prompt_tokens` tokens), and the
/// files skipped on the way. No prompt at all is an error.
fn load_prompts(
    list: &Path,
    wanted: usize,
    prompt_tokens: usize,
    tokenizer: &Tokenizer,
) -> Result<(Vec<Prompt>, Vec<Skipped>)> {
    let text = std::fs::read_to_string(list).with_context(|| format!("--files: reading {}", list.display()))?;
    let base = list.parent().unwrap_or(Path::new(""));
    let (mut prompts, mut skipped) = (Vec::new(), Vec::new());
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if prompts.len() == wanted {
            break;
        }
        let file = base.join(line);
        let tokens = std::fs::read(&file)
            .map_err(|e| e.to_string())
            .and_then(|bytes| String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string()))
            .map(|text| tokenizer.encode(&text))
            .and_then(|mut tokens| {
                tokens.truncate(prompt_tokens);
                if tokens.is_empty() {
                    Err("no tokens".to_string())
                } else {
                    Ok(tokens)
                }
            });
        match tokens {
            Ok(tokens) => prompts.push(Prompt { file, tokens }),
            Err(reason) => {
                tracing::warn!("--files: skipping {}: {reason}", file.display());
                skipped.push(Skipped { file: file.display().to_string(), reason });
            }
        }
    }
    if prompts.is_empty() {
        bail!("--files: no prompt in {}: none of its files reads as UTF-8 text with tokens", list.display());
    }
    if prompts.len() < wanted {
        tracing::warn!("--prompts {wanted}: {} lists only {} usable files", list.display(), prompts.len());
    }
    Ok((prompts, skipped))
}

/// The flag name of a backend.
fn device_flag(device: Device) -> &'static str {
    match device {
        Device::Auto => "auto",
        Device::Cpu => "cpu",
        Device::Cuda => "cuda",
        Device::Null => "null",
    }
}

/// The serve settings of `method` on `device`: the model of `args`, the static budget, γ, no step-time limit.
fn serve_args(args: &SpecEvalArgs, method: SpecMethod, device: Device) -> Result<ServeArgs> {
    let mut argv: Vec<String> = ["sparkd", "--device", device_flag(device), "--decode-step-target", "off"]
        .into_iter()
        .map(String::from)
        .collect();
    match &args.model {
        Some(dir) => argv.extend(["--model".into(), dir.display().to_string()]),
        None => argv.extend(["--synthetic".into(), args.synthetic.clone()]),
    }
    argv.extend(["--spec".into(), method.as_str().into()]);
    if method != SpecMethod::Off {
        argv.extend(["--spec-budget".into(), "static".into(), "--num-spec-tokens".into()]);
        argv.push(args.num_spec_tokens.to_string());
    }
    let cli = ServeCli::try_parse_from(&argv).with_context(|| format!("the serve settings {}", argv[1..].join(" ")))?;
    Ok(cli.serve)
}

/// Runs every prompt through an engine composed for `method` on `device`, one prompt after another.
fn run_method(args: &SpecEvalArgs, method: SpecMethod, device: Device, prompts: &[Prompt]) -> Result<MethodRun> {
    let serve = serve_args(args, method, device)?;
    let served = compose(&serve, None).with_context(|| format!("composing --spec {}", method.as_str()))?;
    let (device, device_name) = (served.device, served.runner.device_name());
    let mut runner = served.runner;
    if let Some(first) = prompts.first() {
        warm_up(runner.as_mut(), &first.tokens).context("warming the runner up")?;
    }
    let (record, recorded) = std_mpsc::channel();
    let speculation = match served.speculation {
        Some(s) if method == SpecMethod::Dspark => {
            Some(Speculation { proposer: Box::new(Recording { inner: s.proposer, drafts: record }), ..s })
        }
        other => other,
    };
    let config = EngineConfig { prefix_cache_bytes: 0, ..EngineConfig::default() };
    let engine = spawn(runner, speculation, config).context("starting the engine thread")?;
    let handle = engine.handle();
    let started = Instant::now();
    let generations: Result<Vec<Generation>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            generate(&handle, RequestId(i as u64 + 1), &p.tokens, args.max_tokens)
                .with_context(|| format!("--spec {}: prompt {} ({})", method.as_str(), i + 1, p.file.display()))
        })
        .collect();
    let wall = started.elapsed();
    drop(handle);
    engine.shutdown();
    let drafts = recorded.try_iter().collect();
    Ok(MethodRun { method, device, device_name, generations: generations?, wall, drafts })
}

/// One throwaway greedy decode of `prompt` (its prefill, then [`WARM_UP_STEPS`] decode steps) on a state freed
/// after it, so that no method's wall time pays the runner's first use (the weights' first reads, lazy loading on
/// a GPU). Start-up's measurements use the runner the same way before the engine owns it.
fn warm_up(runner: &mut dyn Runner, prompt: &[TokenId]) -> Result<(), KernelError> {
    let state = runner.alloc_state()?;
    let decoded = (|| {
        let mut tokens = prompt.to_vec();
        for _ in 0..=WARM_UP_STEPS {
            let row = RowInput { state, tokens, sample: Some(SampleRequest::new(SamplingParams::greedy(), 0)) };
            tokens = runner.step(std::slice::from_ref(&row))?.into_iter().flat_map(|o| o.tokens).collect();
            if tokens.is_empty() {
                return Err(KernelError::InvalidInput("a warm-up step sampled no token".into()));
            }
        }
        Ok(())
    })();
    runner.free_state(state)?;
    decoded
}

/// Sends one greedy request and collects its steps until it finishes at `max_tokens`.
fn generate(handle: &EngineHandle, id: RequestId, prompt: &[TokenId], max_tokens: usize) -> Result<Generation> {
    let (events, mut received) = mpsc::channel(EVENT_CHANNEL);
    let request = GenerateRequest::greedy(id, prompt.to_vec(), max_tokens);
    handle.blocking_send(EngineCommand::Generate { request, events })?;
    let mut generation = Generation::default();
    while let Some(event) = received.blocking_recv() {
        match event {
            EngineEvent::Started { .. } => {}
            EngineEvent::Tokens { tokens, drafted, accepted, .. } => {
                generation.steps.push(Step { emitted: tokens.len(), drafted, accepted });
                generation.tokens.extend(tokens);
            }
            EngineEvent::Finished { reason: FinishReason::Length, .. } => return Ok(generation),
            EngineEvent::Finished { reason, .. } => {
                bail!("finished early ({}) after {} tokens", reason.as_str(), generation.tokens.len())
            }
            EngineEvent::Failed(e) => return Err(e.into()),
        }
    }
    bail!("the engine stopped before the request finished")
}

/// The verify rounds of one request: its decode steps (every step after the first, which ends its prefill) paired
/// in order with the drafts proposed for it, each cut to the positions the step verified.
fn rounds_of(generation: &Generation, drafts: &[&Proposed]) -> Result<Vec<Round>> {
    let Some((first, decode)) = generation.steps.split_first() else { return Ok(Vec::new()) };
    ensure!(
        decode.len() == drafts.len(),
        "{} drafts were proposed for {} decode steps: the recorded drafts do not line up with the engine's rounds",
        drafts.len(),
        decode.len()
    );
    let mut offset = first.emitted;
    let mut rounds = Vec::new();
    for (k, (step, draft)) in decode.iter().zip(drafts).enumerate() {
        let emitted = generation.tokens.get(offset..offset + step.emitted).context("steps past the tokens")?;
        offset += step.emitted;
        if step.drafted == 0 {
            continue;
        }
        ensure!(
            step.drafted <= draft.tokens.len() && step.accepted <= step.drafted,
            "decode step {k} verified {} drafts and accepted {} of a {}-token draft",
            step.drafted,
            step.accepted,
            draft.tokens.len()
        );
        ensure!(
            emitted.get(..step.accepted) == draft.tokens.get(..step.accepted),
            "decode step {k} committed tokens that are not the recorded draft's"
        );
        rounds.push(Round { confidences: draft.confidences[..step.drafted].to_vec(), accepted: step.accepted });
    }
    Ok(rounds)
}

/// DSpark's per-position figures over every request of its run.
fn dspark_calibration(run: &MethodRun, positions: usize) -> Result<Calibration> {
    let mut rounds = Vec::new();
    for (i, generation) in run.generations.iter().enumerate() {
        let seq = SeqKey(i as u64 + 1);
        let drafts: Vec<&Proposed> = run.drafts.iter().filter(|d| d.seq == seq).collect();
        rounds.extend(rounds_of(generation, &drafts).with_context(|| format!("dspark, prompt {}", i + 1))?);
    }
    Ok(calibration(&rounds, positions)?)
}

/// A prompt whose output differs from the run without speculation.
#[derive(Debug, PartialEq, Serialize)]
struct Mismatch {
    /// 1-based, in the order of `prompts`.
    prompt: usize,
    file: String,
    /// The first output token that differs (or the shorter output's length).
    first_difference: usize,
}

/// One method's engine-level figures.
#[derive(Debug, PartialEq, Serialize)]
struct MethodReport {
    method: &'static str,
    output_tokens: usize,
    /// Steps after each prompt's first token: every one fed a decode row, with or without drafts.
    decode_steps: usize,
    /// Decode steps that verified at least one draft token.
    verify_rounds: usize,
    drafted: usize,
    accepted: usize,
    /// accepted / drafted.
    acceptance_rate: Option<f64>,
    /// Tokens committed per verify round: 1 + accepted / verify_rounds (vLLM's mean acceptance length).
    acceptance_length: Option<f64>,
    /// Tokens committed per decode step, the steps without drafts included (what the speed-up follows).
    tokens_per_step: Option<f64>,
    /// From the first request sent to the last one finished (prefill, drafting and verification).
    wall_seconds: f64,
    /// The run without speculation's wall time over this one's.
    speedup: f64,
    lossless: bool,
    mismatches: Vec<Mismatch>,
}

/// The figures of `run` against `baseline` (the run without speculation) over `prompts`.
fn method_report(run: &MethodRun, baseline: &MethodRun, prompts: &[Prompt]) -> MethodReport {
    let decode = || run.generations.iter().flat_map(|g| g.steps.iter().skip(1));
    let sum = |f: fn(&Step) -> usize| decode().map(f).sum::<usize>();
    let (decode_steps, drafted, accepted) = (decode().count(), sum(|s| s.drafted), sum(|s| s.accepted));
    let verify_rounds = decode().filter(|s| s.drafted > 0).count();
    let decode_tokens = sum(|s| s.emitted);
    let ratio = |a: usize, b: usize| (b > 0).then(|| a as f64 / b as f64);
    let mismatches: Vec<Mismatch> = run
        .generations
        .iter()
        .zip(&baseline.generations)
        .zip(prompts)
        .enumerate()
        .filter(|(_, ((g, want), _))| g.tokens != want.tokens)
        .map(|(i, ((g, want), p))| Mismatch {
            prompt: i + 1,
            file: p.file.display().to_string(),
            first_difference: g.tokens.iter().zip(&want.tokens).take_while(|(a, b)| a == b).count(),
        })
        .collect();
    MethodReport {
        method: run.method.as_str(),
        output_tokens: run.generations.iter().map(|g| g.tokens.len()).sum(),
        decode_steps,
        verify_rounds,
        drafted,
        accepted,
        acceptance_rate: ratio(accepted, drafted),
        acceptance_length: ratio(accepted, verify_rounds).map(|a| 1.0 + a),
        tokens_per_step: ratio(decode_tokens, decode_steps),
        wall_seconds: run.wall.as_secs_f64(),
        speedup: baseline.wall.as_secs_f64() / run.wall.as_secs_f64().max(1e-9),
        lossless: mismatches.is_empty(),
        mismatches,
    }
}

/// What the command was asked and what it ran on.
#[derive(Debug, Serialize)]
struct Settings {
    /// The model: the checkpoint folder, or the synthetic config's name.
    model: String,
    requested_device: &'static str,
    device: &'static str,
    device_name: String,
    files: String,
    prompts: usize,
    prompt_tokens: usize,
    max_tokens: usize,
    num_spec_tokens: usize,
    budget: &'static str,
    sampling: &'static str,
}

/// One prompt as used.
#[derive(Debug, Serialize)]
struct PromptInfo {
    file: String,
    tokens: usize,
}

/// The JSON report.
#[derive(Debug, Serialize)]
struct Report {
    settings: Settings,
    prompts: Vec<PromptInfo>,
    skipped: Vec<Skipped>,
    /// DSpark per draft position and the calibration of its confidences.
    dspark: Calibration,
    /// The run without speculation (`off`, the reference), then every method.
    methods: Vec<MethodReport>,
    /// Every method's greedy output equals the run without speculation's.
    lossless: bool,
}

fn build_report(
    args: &SpecEvalArgs,
    prompts: &[Prompt],
    skipped: Vec<Skipped>,
    baseline: &MethodRun,
    runs: &[MethodRun],
) -> Result<Report> {
    let dspark = runs.iter().find(|r| r.method == SpecMethod::Dspark).context("no dspark run")?;
    let methods: Vec<MethodReport> =
        std::iter::once(baseline).chain(runs).map(|r| method_report(r, baseline, prompts)).collect();
    Ok(Report {
        settings: Settings {
            model: args.model.as_ref().map_or_else(|| args.synthetic.clone(), |dir| dir.display().to_string()),
            requested_device: device_flag(args.device),
            device: device_flag(baseline.device),
            device_name: baseline.device_name.clone(),
            files: args.files.display().to_string(),
            prompts: args.prompts,
            prompt_tokens: args.prompt_tokens,
            max_tokens: args.max_tokens,
            num_spec_tokens: args.num_spec_tokens,
            budget: "static",
            sampling: "greedy",
        },
        prompts: prompts
            .iter()
            .map(|p| PromptInfo { file: p.file.display().to_string(), tokens: p.tokens.len() })
            .collect(),
        skipped,
        dspark: dspark_calibration(dspark, args.num_spec_tokens)?,
        lossless: methods.iter().all(|m| m.lossless),
        methods,
    })
}

/// `value` with 3 decimals, `-` when there is none.
fn fixed(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.3}"))
}

/// The readable table of `report`.
fn table(report: &Report) -> String {
    let s = &report.settings;
    let mut t = String::new();
    let prompt_tokens: usize = report.prompts.iter().map(|p| p.tokens).sum();
    // Writing into a String cannot fail.
    let _ = writeln!(
        t,
        "sparkd spec-eval: {} on {}: {} prompts ({prompt_tokens} prompt tokens), {} new tokens each, γ = {}, static \
         budget, greedy",
        s.model,
        s.device_name,
        report.prompts.len(),
        s.max_tokens,
        s.num_spec_tokens
    );
    let d = &report.dspark;
    let _ = writeln!(t, "DSpark per draft position (predicted: mean conditional confidence where reached)");
    let _ = writeln!(t, "  pos  reached  accepted  observed  predicted");
    for p in &d.positions {
        let _ = writeln!(
            t,
            "{:>5}  {:>7}  {:>8}  {:>8}  {:>9}",
            p.position,
            p.reached,
            p.accepted,
            fixed(p.observed_rate),
            fixed(p.mean_confidence)
        );
    }
    let _ = writeln!(
        t,
        "  AL {} (predicted {}) over {} verify rounds; ECE {} over {} reached positions",
        fixed(d.acceptance_length),
        fixed(d.predicted_acceptance_length),
        d.rounds,
        fixed(d.ece),
        d.samples
    );
    let _ = writeln!(t, "method   rounds  drafted  accepted   rate     AL  tok/step   wall s  speed-up  lossless");
    for m in &report.methods {
        let _ = writeln!(
            t,
            "{:<7}  {:>6}  {:>7}  {:>8}  {:>5}  {:>5}  {:>8}  {:>7.2}  {:>7.2}x  {}",
            m.method,
            m.verify_rounds,
            m.drafted,
            m.accepted,
            m.acceptance_rate.map_or_else(|| "-".into(), |r| format!("{r:.2}")),
            m.acceptance_length.map_or_else(|| "-".into(), |a| format!("{a:.2}")),
            fixed(m.tokens_per_step),
            m.wall_seconds,
            m.speedup,
            if m.lossless { "yes" } else { "NO" }
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(emitted: usize, drafted: usize, accepted: usize) -> Step {
        Step { emitted, drafted, accepted }
    }

    fn proposed(tokens: &[TokenId], confidences: &[f64]) -> Proposed {
        Proposed { seq: SeqKey(1), tokens: tokens.to_vec(), confidences: confidences.to_vec() }
    }

    /// A request: its prefill step emits 10; then a round accepting 1 of 2 drafts (11, then the correction 99),
    /// a step without drafts (12), and a round accepting both of 2 drafts (13, 14 and the bonus 15).
    fn generation() -> Generation {
        Generation {
            tokens: vec![10, 11, 99, 12, 13, 14, 15],
            steps: vec![step(1, 0, 0), step(2, 2, 1), step(1, 0, 0), step(3, 2, 2)],
        }
    }

    #[test]
    fn rounds_pair_decode_steps_with_drafts_cut_to_what_was_verified() {
        let drafts = [proposed(&[11, 50, 51], &[0.9, 0.5, 0.4]), proposed(&[], &[]), proposed(&[13, 14], &[0.8, 0.7])];
        let refs: Vec<&Proposed> = drafts.iter().collect();
        let rounds = rounds_of(&generation(), &refs).unwrap();
        assert_eq!(
            rounds,
            vec![
                Round { confidences: vec![0.9, 0.5], accepted: 1 },
                Round { confidences: vec![0.8, 0.7], accepted: 2 }
            ]
        );
    }

    #[test]
    fn drafts_that_do_not_line_up_are_errors() {
        let good = [proposed(&[11, 50], &[0.9, 0.5]), proposed(&[], &[]), proposed(&[13, 14], &[0.8, 0.7])];
        let refs: Vec<&Proposed> = good.iter().collect();
        assert!(rounds_of(&generation(), &refs[..2]).is_err(), "a draft missing");
        let wrong = [proposed(&[12, 50], &[0.9, 0.5]), proposed(&[], &[]), proposed(&[13, 14], &[0.8, 0.7])];
        let refs: Vec<&Proposed> = wrong.iter().collect();
        assert!(rounds_of(&generation(), &refs).is_err(), "an accepted token that is not the draft's");
        let short = [proposed(&[11], &[0.9]), proposed(&[], &[]), proposed(&[13, 14], &[0.8, 0.7])];
        let refs: Vec<&Proposed> = short.iter().collect();
        assert!(rounds_of(&generation(), &refs).is_err(), "more verified than drafted");
        assert!(rounds_of(&Generation::default(), &[]).unwrap().is_empty());
    }

    fn method_run(method: SpecMethod, generations: Vec<Generation>, wall_ms: u64) -> MethodRun {
        MethodRun {
            method,
            device: Device::Cpu,
            device_name: "cpu".into(),
            generations,
            wall: Duration::from_millis(wall_ms),
            drafts: Vec::new(),
        }
    }

    #[test]
    fn a_method_reports_rounds_tokens_per_step_and_mismatches_against_the_baseline() {
        let prompts =
            [Prompt { file: "a.py".into(), tokens: vec![1, 2] }, Prompt { file: "b.py".into(), tokens: vec![3] }];
        let plain = |tokens: Vec<TokenId>| Generation { steps: vec![step(1, 0, 0); tokens.len()], tokens };
        let baseline = method_run(SpecMethod::Off, vec![plain(generation().tokens), plain(vec![7, 8, 9])], 200);
        let mut differs = plain(vec![7, 8, 5]);
        differs.steps = vec![step(1, 0, 0), step(2, 3, 1)];
        let run = method_run(SpecMethod::Suffix, vec![generation(), differs], 100);
        let m = method_report(&run, &baseline, &prompts);
        assert_eq!((m.decode_steps, m.verify_rounds, m.drafted, m.accepted), (4, 3, 7, 4));
        assert_eq!(m.output_tokens, 10);
        assert!((m.acceptance_length.unwrap() - (1.0 + 4.0 / 3.0)).abs() < 1e-12);
        assert!((m.acceptance_rate.unwrap() - 4.0 / 7.0).abs() < 1e-12);
        // Decode tokens 2 + 1 + 3 and 2 over 4 decode steps.
        assert!((m.tokens_per_step.unwrap() - 2.0).abs() < 1e-12);
        assert!((m.speedup - 2.0).abs() < 1e-9);
        assert!(!m.lossless);
        assert_eq!(m.mismatches, vec![Mismatch { prompt: 2, file: "b.py".into(), first_difference: 2 }]);
        let off = method_report(&baseline, &baseline, &prompts);
        assert!(off.lossless && off.acceptance_length.is_none() && off.tokens_per_step == Some(1.0));
    }

    #[test]
    fn prompts_are_the_first_readable_files_beginnings() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.py"), "import os\nprint(os.getcwd())\n").unwrap();
        std::fs::write(dir.path().join("latin1.py"), b"caf\xe9 = 1\n").unwrap();
        std::fs::write(dir.path().join("empty.py"), "").unwrap();
        std::fs::write(dir.path().join("b.py"), "def f(x):\n    return x\n").unwrap();
        std::fs::write(dir.path().join("c.py"), "x = 1\n").unwrap();
        let list = dir.path().join("list.txt");
        std::fs::write(&list, "a.py\n\nmissing.py\nlatin1.py\nempty.py\n  b.py  \nc.py\n").unwrap();
        let tokenizer = Tokenizer::builtin().unwrap();
        let (prompts, skipped) = load_prompts(&list, 2, 4, &tokenizer).unwrap();
        let names: Vec<String> = prompts.iter().map(|p| p.file.file_name().unwrap().to_string_lossy().into()).collect();
        assert_eq!(names, vec!["a.py", "b.py"]);
        assert_eq!(prompts[0].tokens, tokenizer.encode("import os\nprint(os.getcwd())\n")[..4].to_vec());
        let reasons: Vec<&str> = skipped.iter().map(|s| s.reason.as_str()).collect();
        assert_eq!(reasons.len(), 3);
        assert_eq!(&reasons[1..], ["not UTF-8 text", "no tokens"]);
        // More asked than there are: what there is; nothing usable: an error naming the flag.
        assert_eq!(load_prompts(&list, 10, 4, &tokenizer).unwrap().0.len(), 3);
        std::fs::write(&list, "missing.py\nempty.py\n").unwrap();
        let err = load_prompts(&list, 2, 4, &tokenizer).err().expect("no prompt");
        assert!(format!("{err:#}").contains("--files"), "{err:#}");
        assert!(load_prompts(&dir.path().join("nope.txt"), 2, 4, &tokenizer).is_err());
    }

    #[test]
    fn the_serve_settings_are_the_methods_with_the_static_budget() {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            eval: SpecEvalArgs,
        }
        let args = Cli::try_parse_from([
            "x",
            "--files",
            "l.txt",
            "--prompts",
            "2",
            "--out",
            "r.json",
            "--num-spec-tokens",
            "5",
        ])
        .unwrap()
        .eval;
        let serve = serve_args(&args, SpecMethod::Hybrid, Device::Cpu).unwrap();
        let spec = serve.spec.to_config().unwrap();
        assert_eq!((spec.method, spec.num_spec_tokens), (SpecMethod::Hybrid, 5));
        assert_eq!(spec.budget, sparkd::config::speculation::SpecBudget::Static);
        assert_eq!(
            (serve.device, serve.synthetic.as_str(), serve.model.as_ref()),
            (Device::Cpu, DEFAULT_SYNTHETIC_CONFIG, None)
        );
        assert!(!serve_args(&args, SpecMethod::Off, Device::Auto).unwrap().spec.to_config().unwrap().is_on());
        let on_disk = SpecEvalArgs { model: Some("/models/k3".into()), ..args.clone() };
        let serve = serve_args(&on_disk, SpecMethod::Off, Device::Cuda).unwrap();
        assert_eq!((serve.device, serve.model), (Device::Cuda, Some(PathBuf::from("/models/k3"))));
        let bad = |extra: &[&str]| {
            let mut all = vec!["x", "--files", "l.txt", "--out", "r.json"];
            all.extend_from_slice(extra);
            check(&Cli::try_parse_from(all).unwrap().eval).unwrap_err().to_string()
        };
        assert!(bad(&["--prompts", "0"]).contains("--prompts"));
        assert!(bad(&["--prompts", "1", "--num-spec-tokens", "65"]).contains("--num-spec-tokens"));
        assert!(bad(&["--prompts", "1", "--device", "null"]).contains("--device"));
        assert!(bad(&["--prompts", "1", "--model", "/no/such/dir"]).contains("--model"));
        assert!(Cli::try_parse_from([
            "x",
            "--files",
            "l",
            "--prompts",
            "1",
            "--out",
            "r",
            "--model",
            "m",
            "--synthetic",
            "k3-tiny"
        ])
        .is_err());
    }
}
