//! Prompt synthesis against the daemon's real tokenizer: determinism, exact token counts, shared
//! prefixes, scopes, markers, the decode→encode round trip, and the chat template's offset.

use std::sync::OnceLock;

use sparkd_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use sparkd_workloads::dag::{Chain, Scope, SetupSource, Turn};
use sparkd_workloads::synth::{Conversation, HistoryMode, Role, Synth, TokenPool, MARKER_TOKENS, POOL_SIZE};

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::builtin().expect("builtin tokenizer"))
}

fn synth() -> &'static Synth {
    static S: OnceLock<Synth> = OnceLock::new();
    S.get_or_init(|| Synth::new(TokenPool::build(tokenizer()).expect("pool"), 1.0).expect("synth"))
}

fn turn(input: u32, output: u32, hash_ids: Vec<u64>) -> Turn {
    Turn { t: 0.0, model: "m".into(), input_tokens: input, output_tokens: output, hash_ids, delay_s: 0.0 }
}

#[test]
fn the_pool_is_deterministic_and_full() {
    let again = TokenPool::build(tokenizer()).expect("pool");
    assert_eq!(synth().pool().len(), POOL_SIZE);
    let probe: Vec<u32> = (0..50).map(|i| synth().prompt(Scope(1), &[i], 64, 0, 64)[0]).collect();
    let other = Synth::new(again, 1.0).expect("synth");
    assert_eq!(probe, (0..50).map(|i| other.prompt(Scope(1), &[i], 64, 0, 64)[0]).collect::<Vec<_>>());
}

#[test]
fn prompts_are_exact_deterministic_and_share_exactly_their_hash_prefix() {
    let s = synth();
    let scope = Scope::of("trace_x");
    let a = s.prompt(scope, &[1, 2, 3, 4], 64, 11, 64 * 4 + 17); // tail past the last block
    let b = s.prompt(scope, &[1, 2, 3, 9, 10], 64, 12, 64 * 4 + 30); // trimmed last block
    assert_eq!((a.len(), b.len()), (273, 286));
    assert_eq!(a, s.prompt(scope, &[1, 2, 3, 4], 64, 11, 273));
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!((192..192 + 3).contains(&shared), "shared {shared}: three blocks, then (almost surely) different");
    let other_scope = s.prompt(Scope::of("trace_y"), &[1, 2, 3, 4], 64, 11, 64);
    assert_ne!(&a[..64], &other_scope[..], "scopes never alias");
    // Token scaling keeps the block structure with smaller blocks.
    let half = Synth::new(synth().pool().clone(), 0.5).expect("synth");
    let c = half.prompt(scope, &[1, 2, 3, 4], 64, 11, 128);
    let d = half.prompt(scope, &[1, 2, 7, 8], 64, 11, 128);
    assert_eq!(c.iter().zip(&d).take_while(|(x, y)| x == y).count(), 64);
}

#[test]
fn synthesized_text_round_trips_through_the_daemon_tokenizer() {
    let s = synth();
    let tokens = s.prompt(Scope::of("rt"), &(0..200).collect::<Vec<_>>(), 64, 3, 64 * 200);
    let text = s.pool().text(&tokens).expect("pool text");
    assert_eq!(tokenizer().encode(&text), tokens);
    assert_eq!(tokenizer().decode(&tokens).expect("decode"), text);
    let marker = s.marker(99);
    let text = s.pool().text(&marker.0).expect("marker text");
    assert_eq!(tokenizer().encode(&text), marker.0.to_vec());
}

fn chain(setup_blocks: usize, turns: Vec<Turn>) -> Chain {
    Chain { id: "c".into(), setup_blocks, setup_source: SetupSource::Declared, turns }
}

#[test]
fn markers_differ_between_plays_and_keep_the_system_prefix() {
    let s = synth();
    let c = chain(2, vec![turn(640, 8, (1..=10).collect())]);
    let mut one = Conversation::new(HistoryMode::Resend, s.marker(1));
    let mut two = Conversation::new(HistoryMode::Resend, s.marker(2));
    let a = one.plan(s, Scope(5), 64, &c, 0);
    let b = two.plan(s, Scope(5), 64, &c, 0);
    assert_eq!(a.messages[0], b.messages[0], "system prefix is shared across plays");
    assert_eq!(a.messages[0].tokens.len(), 128);
    assert_ne!(a.messages[1].tokens[..MARKER_TOKENS], b.messages[1].tokens[..MARKER_TOKENS]);
    assert_eq!(a.messages[1].tokens[MARKER_TOKENS..], b.messages[1].tokens[MARKER_TOKENS..]);
    assert_eq!(a.messages.iter().map(|m| m.tokens.len()).sum::<usize>(), 640);
}

#[test]
fn the_chat_template_adds_a_fixed_offset_per_message() {
    // Kimi's template: `<|im_role|>role<|im_middle|>content<|im_end|>` per message (4 tokens of
    // markup) plus the 3-token generation prompt. The replayed prompt is `in + 4·messages + 3`.
    let s = synth();
    let c = chain(2, vec![turn(640, 8, (1..=10).collect()), turn(800, 8, (1..=12).collect())]);
    let mut conv = Conversation::new(HistoryMode::Resend, s.marker(3));
    conv.plan(s, Scope(5), 64, &c, 0);
    conv.complete(s, Scope(5), &c, 0, 8);
    let input = conv.plan(s, Scope(5), 64, &c, 1);
    assert_eq!(
        input.messages.iter().map(|m| m.role).collect::<Vec<_>>(),
        vec![Role::System, Role::User, Role::Assistant, Role::User]
    );
    let messages: Vec<ChatMessage> = input
        .messages
        .iter()
        .map(|m| {
            let role = match m.role {
                Role::System => "system",
                Role::User => "user",
                Role::Assistant => "assistant",
            };
            ChatMessage::new(role, s.pool().text(&m.tokens).expect("text"))
        })
        .collect();
    let template = ChatTemplate::new(tokenizer().clone()).expect("template");
    let rendered = template.render(&messages).expect("render");
    assert_eq!(rendered.len(), 800 + 4 * messages.len() + 3);
}
