//! Sessions as request DAGs: a main chain of turns plus subagent branches (agentx.md §1.4).
//!
//! Invariants:
//! - A chain's turns run strictly one after another; `Turn::delay_s` is the recorded end-to-start
//!   gap before the turn (agentx.md §1.5), never negative.
//! - A subagent entry between two parent turns becomes a [`Branch`] spawned after the preceding
//!   parent turn (`after_turn`) and joined before the following one (`join_before`); with no
//!   following turn it is a background branch (`join_before == None`) that still holds the lane;
//!   with no preceding turn it is dropped and counted in `Session::dropped_subagents`. Adjacent
//!   subagents with the same anchors collapse into one multi-child branch whose children run in
//!   parallel. Subagents are spawns: fresh contexts with their own setup prefix.
//! - `setup_blocks` is the number of leading hash blocks that form the tools+system prefix: from
//!   the declared `tool_tokens + system_tokens` (summed in 64 bits, each may be any u32) when the
//!   trace declares them, else derived from the longest common hash-id prefix of the chain's turns
//!   (the AgentX v1.0 corpus declares zeros). It always leaves at least one token of the first turn
//!   outside the prefix.
//! - A Mooncake trace has no sessions: each line becomes a one-turn session, all sharing the file's
//!   hash-id scope.

use crate::trace::{MooncakeTrace, RecordedRequest, WekaEntry, WekaTrace, MOONCAKE_BLOCK_SIZE};

/// A hash-id namespace: hash ids are only equal within one trace (`hash_id_scope: "local"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Scope(pub u64);

impl Scope {
    /// The scope of a trace id (FNV-1a of the id), stable across runs and machines.
    pub fn of(trace_id: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in trace_id.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Scope(h)
    }
}

/// Where the setup (tools + system) prefix length came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SetupSource {
    /// `tool_tokens + system_tokens` declared in the trace (kv-cache-tester v1 capture).
    Declared,
    /// Longest common hash-id prefix of the chain's turns (declared zeros, AgentX v1.0).
    Lcp,
    /// Mooncake: no setup prefix.
    None,
}

/// One request of a chain.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// Recorded start time, seconds from the start of its chain.
    pub t: f64,
    pub model: String,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub hash_ids: Vec<u64>,
    /// Recorded end-to-start delay before this turn, seconds (0 for a chain's first turn).
    pub delay_s: f64,
}

/// A linear chain of turns: the main agent, or one subagent.
#[derive(Clone, Debug, PartialEq)]
pub struct Chain {
    /// `<trace>` for the main agent, `<trace>::sa:<agent_id>` for a subagent (AIPerf's naming).
    pub id: String,
    pub setup_blocks: usize,
    pub setup_source: SetupSource,
    pub turns: Vec<Turn>,
}

/// A subagent spawned by its parent.
#[derive(Clone, Debug, PartialEq)]
pub struct Subagent {
    pub agent_id: String,
    pub subagent_type: String,
    /// Recorded gap from the end of the spawning parent turn to the subagent's first request.
    pub spawn_delay_s: f64,
    pub chain: Chain,
}

/// Subagents spawned after one parent turn and joined before another.
#[derive(Clone, Debug, PartialEq)]
pub struct Branch {
    /// Index in the main chain of the turn after which the children start.
    pub after_turn: usize,
    /// Index of the main turn that waits for every child; `None` for a background branch.
    pub join_before: Option<usize>,
    pub children: Vec<Subagent>,
}

/// One replayable session tree.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub id: String,
    pub scope: Scope,
    /// Tokens per hash block as recorded (64 Weka, 512 Mooncake).
    pub block_size: u32,
    pub main: Chain,
    pub branches: Vec<Branch>,
    pub dropped_subagents: usize,
}

impl Session {
    /// Requests in the tree (main plus subagent turns).
    pub fn request_count(&self) -> usize {
        self.main.turns.len()
            + self.branches.iter().flat_map(|b| &b.children).map(|c| c.chain.turns.len()).sum::<usize>()
    }

    /// The recorded duration of the main chain: the last turn's start time.
    pub fn duration_s(&self) -> f64 {
        self.main.turns.last().map_or(0.0, |t| t.t)
    }

    /// Branches that the main turn `turn` must wait for.
    pub fn joins_before(&self, turn: usize) -> impl Iterator<Item = usize> + '_ {
        self.branches.iter().enumerate().filter(move |(_, b)| b.join_before == Some(turn)).map(|(i, _)| i)
    }
}

/// Builds the session tree of a Weka trace.
pub fn weka_session(trace: &WekaTrace) -> Session {
    let declared = declared_setup(trace.tool_tokens, trace.system_tokens);
    let mut main_turns: Vec<RecordedRequest> = Vec::new();
    // (index of the preceding main turn or None, subagent entry)
    let mut pending: Vec<(Option<usize>, &crate::trace::WekaSubagent)> = Vec::new();
    let mut branches: Vec<Branch> = Vec::new();
    let mut dropped = 0;

    for entry in &trace.requests {
        match entry {
            WekaEntry::Normal(r) => main_turns.push(r.into()),
            WekaEntry::Streaming(r) => main_turns.push(r.into()),
            WekaEntry::Subagent(s) => {
                pending.push((main_turns.len().checked_sub(1), s));
                continue;
            }
        }
        // A main turn closes the pending subagents: they join before it.
        let join = main_turns.len() - 1;
        flush(&mut pending, Some(join), trace, &mut branches, &mut dropped, &main_turns);
    }
    flush(&mut pending, None, trace, &mut branches, &mut dropped, &main_turns);

    let main = chain_from(trace.id.clone(), &main_turns, declared, trace.block_size);
    Session {
        id: trace.id.clone(),
        scope: Scope::of(&trace.id),
        block_size: trace.block_size,
        main,
        branches,
        dropped_subagents: dropped,
    }
}

fn flush(
    pending: &mut Vec<(Option<usize>, &crate::trace::WekaSubagent)>,
    join_before: Option<usize>,
    trace: &WekaTrace,
    branches: &mut Vec<Branch>,
    dropped: &mut usize,
    main_turns: &[RecordedRequest],
) {
    for (after, sub) in pending.drain(..) {
        let Some(after_turn) = after else {
            *dropped += 1;
            continue;
        };
        let recorded: Vec<RecordedRequest> = sub.requests.iter().map(|r| r.recorded()).collect();
        let Some(first) = recorded.first() else {
            *dropped += 1;
            continue;
        };
        let parent = &main_turns[after_turn];
        let parent_end = parent.t + parent.api_time.unwrap_or(0.0);
        // The entry's `t` is its completion time when `duration_ms` is known, its launch time otherwise.
        let start = match sub.duration_ms {
            Some(ms) => sub.t - ms as f64 / 1000.0,
            None => sub.t,
        };
        let spawn_delay_s = (start - parent_end).max(0.0) + first.think_time.unwrap_or(0.0);
        let chain = chain_from(
            format!("{}::sa:{}", trace.id, sub.agent_id),
            &recorded,
            declared_setup(sub.tool_tokens, sub.system_tokens),
            trace.block_size,
        );
        let child =
            Subagent { agent_id: sub.agent_id.clone(), subagent_type: sub.subagent_type.clone(), spawn_delay_s, chain };
        match branches.last_mut() {
            Some(b) if b.after_turn == after_turn && b.join_before == join_before => b.children.push(child),
            _ => branches.push(Branch { after_turn, join_before, children: vec![child] }),
        }
    }
}

fn chain_from(id: String, recorded: &[RecordedRequest], declared: u64, block_size: u32) -> Chain {
    let turns: Vec<Turn> = recorded
        .iter()
        .enumerate()
        .map(|(i, r)| Turn {
            t: r.t,
            model: r.model.clone(),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            hash_ids: r.hash_ids.clone(),
            delay_s: if i == 0 { 0.0 } else { r.think_time.unwrap_or_else(|| start_gap(&recorded[i - 1], r)) },
        })
        .collect();
    let (setup_blocks, setup_source) = setup_prefix(&turns, declared, block_size);
    Chain { id, setup_blocks, setup_source, turns }
}

/// End-to-start gap when `think_time` is absent: start minus the previous start and server time.
fn start_gap(prev: &RecordedRequest, next: &RecordedRequest) -> f64 {
    (next.t - prev.t - prev.api_time.unwrap_or(0.0)).max(0.0)
}

/// The setup tokens a trace or subagent declares: its tool and system tokens.
fn declared_setup(tool_tokens: u32, system_tokens: u32) -> u64 {
    u64::from(tool_tokens) + u64::from(system_tokens)
}

fn setup_prefix(turns: &[Turn], declared: u64, block_size: u32) -> (usize, SetupSource) {
    let Some(first) = turns.first() else { return (0, SetupSource::None) };
    // Keep at least one token of the first turn for the user message.
    let max_blocks = ((first.input_tokens as usize).saturating_sub(1) / block_size as usize).min(first.hash_ids.len());
    if declared > 0 {
        return (((declared / u64::from(block_size)) as usize).min(max_blocks), SetupSource::Declared);
    }
    if turns.len() < 2 {
        return (0, SetupSource::Lcp);
    }
    let lcp = turns[1..].iter().fold(first.hash_ids.len(), |lcp, t| {
        lcp.min(first.hash_ids.iter().zip(&t.hash_ids).take_while(|(a, b)| a == b).count())
    });
    (lcp.min(max_blocks), SetupSource::Lcp)
}

/// One one-turn session per Mooncake line, in file order, sharing the file's scope.
pub fn mooncake_sessions(trace: &MooncakeTrace) -> Vec<Session> {
    let scope = Scope::of(&trace.id);
    trace
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let id = format!("{}#{i}", trace.id);
            let turn = Turn {
                t: r.timestamp as f64 / 1000.0,
                model: String::new(),
                input_tokens: r.input_length,
                output_tokens: r.output_length,
                hash_ids: r.hash_ids.clone(),
                delay_s: 0.0,
            };
            Session {
                id: id.clone(),
                scope,
                block_size: MOONCAKE_BLOCK_SIZE,
                main: Chain { id, setup_blocks: 0, setup_source: SetupSource::None, turns: vec![turn] },
                branches: Vec::new(),
                dropped_subagents: 0,
            }
        })
        .collect()
}

/// The sessions of parsed trace files, in file order.
pub fn sessions(files: &[crate::trace::TraceFile]) -> Vec<Session> {
    files
        .iter()
        .flat_map(|f| match f {
            crate::trace::TraceFile::Weka(t) => vec![weka_session(t)],
            crate::trace::TraceFile::Mooncake(m) => mooncake_sessions(m),
        })
        .collect()
}
