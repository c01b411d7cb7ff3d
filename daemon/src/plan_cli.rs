//! `sparkd plan`: its arguments, the config it plans (a preset or a `config.json`), and the table it prints.
//!
//! Invariants: the arithmetic is `sparkd::plan` (pure, unit-tested); this module only reads the arguments and
//! the config, prints, and turns a plan that does not fit into an error naming what does not fit (so the exit
//! status is non-zero). Bad input is an error naming the flag, never a panic.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use sparkd::config::DEFAULT_MAX_MODEL_LEN;
use sparkd::engine::types::{DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS};
use sparkd::plan::units::{gib, human, parse_bytes};
use sparkd::plan::{memory, plan, Plan, PlanInput};
use sparkd_kernels::config::PRESET_NAMES;
use sparkd_kernels::ModelConfig;

/// `sparkd plan` arguments.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// A preset (k3, k3-mini, k3-mini-wide, k3-tiny), a `config.json`, or a checkpoint folder holding one.
    #[arg(long, default_value = "k3")]
    config: String,
    /// GPUs in all, over every node.
    #[arg(long)]
    gpus: usize,
    /// Memory of each GPU: bytes, or a number with a unit (141GB, 139GiB, 0.5TiB).
    #[arg(long, value_name = "BYTES")]
    gpu_memory: String,
    /// Ranks of one tensor-parallel group (default: every GPU); `--gpus / N` replicas serve behind a balancer.
    #[arg(long, value_name = "N")]
    tensor_parallel_size: Option<usize>,
    /// Place routed experts whole on ranks instead of slicing every expert over them.
    #[arg(long)]
    expert_parallel: bool,
    /// Sequences running at once per replica.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    max_num_seqs: usize,
    /// Tokens of each sequence (prompt + output; the daemon's --max-model-len).
    #[arg(long, default_value_t = DEFAULT_MAX_MODEL_LEN)]
    context: usize,
    /// Tokens one engine step computes (the step workspace's size).
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    max_num_batched_tokens: usize,
    /// Draft tokens verified per row (0: speculation off); each costs a KDA state snapshot per running row.
    #[arg(long, default_value_t = 0)]
    num_spec_tokens: usize,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The config `--config` names: a preset, a `config.json` file, or a folder holding one.
fn load_config(name: &str) -> Result<ModelConfig> {
    if PRESET_NAMES.contains(&name) {
        return Ok(ModelConfig::preset(name)?);
    }
    let path = Path::new(name);
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    if !file.is_file() {
        bail!(
            "--config: `{name}` is neither a preset ({}) nor a config.json or a folder with one",
            PRESET_NAMES.join(", ")
        );
    }
    ModelConfig::from_file(&file).with_context(|| format!("--config: reading {}", file.display()))
}

/// Runs `sparkd plan`: prints the plan; an error when it does not fit.
pub fn run(args: &PlanArgs) -> Result<()> {
    let gpu_memory = parse_bytes(&args.gpu_memory).map_err(|e| anyhow!("--gpu-memory: {e}"))?;
    let input = PlanInput {
        cfg: load_config(&args.config)?,
        gpus: args.gpus,
        gpu_memory,
        tp: args.tensor_parallel_size.unwrap_or(args.gpus),
        expert_parallel: args.expert_parallel,
        max_num_seqs: args.max_num_seqs,
        context: args.context,
        step_tokens: args.max_num_batched_tokens,
        spec_tokens: args.num_spec_tokens,
    };
    let p = plan(&input)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", table(&args.config, &input, &p));
    }
    if !p.fits() {
        bail!("{}", does_not_fit(&p));
    }
    Ok(())
}

/// What does not fit, and what would.
fn does_not_fit(p: &Plan) -> String {
    let weights = p.weights.per_rank();
    let memory = gib(p.gpu_memory);
    if weights > p.gpu_memory {
        return format!(
            "does not fit: the weights alone need {} per rank, more than the GPU's {memory}; use more GPUs per \
             replica (--tensor-parallel-size){}",
            gib(weights),
            if p.expert_parallel { "" } else { " or --expert-parallel" }
        );
    }
    let fixed = weights + p.asked.fixed();
    if fixed > p.gpu_memory {
        return format!(
            "does not fit: weights, step workspace, CUDA graphs and runtime need {} per rank, more than the GPU's \
             {memory}, before any sequence state; lower --max-num-batched-tokens, --max-num-seqs or --context",
            gib(fixed)
        );
    }
    format!(
        "does not fit: {} sequences of {} tokens need {} of state per rank, and {} is left after the weights and \
         workspace; the largest batch at this context is {}, the longest context at this batch {} tokens",
        p.asked.batch,
        p.asked.context,
        gib(p.asked.states),
        gib(p.state_budget()),
        p.largest_batch,
        p.largest_context
    )
}

/// A parameter count in billions (`2779.5 B`), or millions below a billion (`42.3 M`).
fn params(count: u64) -> String {
    if count >= 1_000_000_000 {
        format!("{:.1} B", count as f64 / 1e9)
    } else {
        format!("{:.1} M", count as f64 / 1e6)
    }
}

/// The plan as a table of bytes per rank.
fn table(config: &str, input: &PlanInput, p: &Plan) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    let cfg = &input.cfg;
    line(format!(
        "sparkd plan: {config} on {} GPU{} of {} each: tensor parallel {}{}, {} replica{}",
        p.gpus,
        if p.gpus == 1 { "" } else { "s" },
        gib(p.gpu_memory),
        p.tp,
        if p.expert_parallel { ", expert parallel" } else { "" },
        p.replicas,
        if p.replicas == 1 { "" } else { "s" }
    ));
    line(format!(
        "model: {} parameters, {} checkpoint; {} layers ({} KDA, {} MLA), {} routed experts \
         ({} on the fullest rank{})",
        params(p.weights.params),
        gib(p.weights.checkpoint_bytes),
        cfg.num_layers(),
        cfg.kda_layers().len(),
        cfg.mla_layers().len(),
        cfg.moe.num_experts,
        p.weights.experts_per_rank,
        if p.expert_parallel { ", whole" } else { ", each sliced" }
    ));
    line(String::new());
    line(format!("{:<48}{:>14}{:>16}{:>16}", "weights", "per rank", "replicated", "whole model"));
    for (class, b) in &p.weights.classes {
        line(format!("  {:<46}{:>14}{:>16}{:>16}", class.label(), gib(b.per_rank), gib(b.replicated), gib(b.total)));
    }
    line(format!("  {:<46}{:>14}{:>16}{:>16}", "total", gib(p.weights.per_rank()), "", gib(p.weights.total())));
    line(String::new());
    let k = &cfg.kda;
    let s = &p.seq;
    line("one sequence, per rank".into());
    line(format!(
        "  {:<62}{:>14}",
        format!(
            "KDA states (fp32 [{}, {}, {}] x {} layers)",
            k.num_heads / p.tp,
            k.head_dim,
            k.head_dim,
            cfg.kda_layers().len()
        ),
        human(s.kda_state)
    ));
    line(format!("  {:<62}{:>14}", "KDA conv windows (bf16)", human(s.kda_conv)));
    line(format!(
        "  {:<62}{:>14}",
        format!(
            "MLA latent cache per token ({} bf16 x {} layers, replicated)",
            cfg.mla.latent_dim(),
            cfg.mla_layers().len()
        ),
        human(s.mla_per_token)
    ));
    line(format!(
        "  {:<62}{:>14}",
        format!("verify snapshots (--num-spec-tokens {})", input.spec_tokens),
        human(s.verify_undo)
    ));
    let capacity = memory::mla_capacity(p.asked.context, p.step_tokens);
    line(format!(
        "  {:<62}{:>14}",
        format!("one sequence of {} tokens (MLA cache of {capacity})", p.asked.context),
        human(s.at(p.asked.context, p.step_tokens))
    ));
    line(String::new());
    line(format!("at --max-num-seqs {} and --context {}, per rank", p.asked.batch, p.asked.context));
    let rows = [
        ("weights".to_string(), p.weights.per_rank()),
        (format!("sequence states ({} sequences)", p.asked.batch), p.asked.states),
        (
            format!("step workspace ({} tokens, MLA splits {})", p.step_tokens, memory::mla_splits(p.asked.context)),
            p.asked.workspace,
        ),
        (
            format!(
                "CUDA graphs ({} rows x {} tokens)",
                p.asked.batch,
                (input.spec_tokens + 1).min(memory::GRAPH_MAX_WINDOW)
            ),
            p.asked.graphs,
        ),
        ("runtime (CUDA context, kernels, cuBLAS, NCCL; estimate)".to_string(), p.asked.runtime),
    ];
    for (what, bytes) in rows {
        line(format!("  {what:<62}{:>14}", gib(bytes)));
    }
    line(format!(
        "  {:<62}{:>14}  of {} ({})",
        "total",
        gib(p.needed()),
        gib(p.gpu_memory),
        if p.fits() { "fits" } else { "does NOT fit" }
    ));
    line(String::new());
    line(format!("largest batch at --context {}: {} sequences", p.asked.context, p.largest_batch));
    line(format!("largest context at --max-num-seqs {}: {} tokens", p.asked.batch, p.largest_context));
    if p.fits() {
        let parallel = if p.tp > 1 {
            format!(" --tensor-parallel-size {}{}", p.tp, if p.expert_parallel { " --expert-parallel" } else { "" })
        } else {
            String::new()
        };
        line(format!(
            "serve each replica with:{parallel} --max-num-seqs {} --max-model-len {} --max-num-batched-tokens {} \
             --state-budget-bytes {}",
            p.asked.batch,
            p.asked.context,
            p.step_tokens,
            p.state_budget()
        ));
    }
    out
}
