//! Property tests of the built-in tokenizer's text paths: encoding, the chat template and the incremental
//! detokenizer, on text that mixes ASCII, multi-byte characters, whitespace runs and special-token strings.
//! - encoding round trip: `decode(encode(s)) == s`, with no special id and every id inside the vocabulary;
//! - chat template: the rendered ids (a full history, or a continuation of a kept turn) decode (special tokens as
//!   names) to the text the template's documentation describes (`support/template_oracle.rs`); the special ids are
//!   exactly the markers (content cannot inject one);
//!   an unknown role is refused naming the first one;
//! - detokenizer: fed in any chunking, the concatenated output equals `decode_lossy` of the ids it keeps (specials
//!   skipped or named, unknown ids counted and dropped), and valid text comes back unchanged with no U+FFFD.

use std::sync::OnceLock;

use proptest::prelude::*;
use sparkd_tokenizer::specials::{IM_END, TOOL_CALL_BEGIN};
use sparkd_tokenizer::{
    ChatMessage, ChatRole, ChatTemplate, IncrementalDecoder, RenderSpec, Tokenizer, TokenizerError, ToolCall,
};

#[path = "support/template_oracle.rs"]
mod template_oracle;
#[path = "support/token_ids.rs"]
mod token_ids;
use template_oracle::Expected;
use token_ids::token_id;

fn template() -> &'static ChatTemplate {
    static TEMPLATE: OnceLock<ChatTemplate> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        ChatTemplate::new(Tokenizer::builtin().expect("the built-in tokenizer builds")).expect("it has the markers")
    })
}

fn tokenizer() -> &'static Tokenizer {
    template().tokenizer()
}

/// Text mixing words, whitespace runs, multi-byte characters and special-token strings.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z0-9 ]{1,12}",
        "[ \t\n]{1,6}",
        "[é€😀中文]{1,4}",
        Just(IM_END.to_string()),
        Just("<think>".to_string()),
        Just(TOOL_CALL_BEGIN.to_string()),
        any::<char>().prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|pieces| pieces.concat())
}

fn message() -> impl Strategy<Value = ChatMessage> {
    let role = prop::sample::select(vec!["system", "developer", "user", "assistant", "tool"]);
    let calls = prop::collection::vec((text(), text()), 0..3);
    (role, text(), prop::option::of(text()), prop::option::of(text()), calls).prop_map(
        |(role, content, name, reasoning, calls)| ChatMessage {
            role: role.to_string(),
            content,
            name,
            reasoning,
            tool_calls: calls
                .into_iter()
                .map(|(id, arguments)| ToolCall { id, name: String::new(), arguments })
                .collect(),
        },
    )
}

/// Feeds `ids` to `decoder` in chunks of the given sizes (the rest at once) and returns everything it gave back.
fn stream(decoder: &mut IncrementalDecoder, ids: &[u32], chunks: &[usize]) -> String {
    let mut out = String::new();
    let mut rest = ids;
    let mut sizes = chunks.iter();
    while !rest.is_empty() {
        let n = sizes.next().map_or(rest.len(), |&n| n.min(rest.len()));
        out.push_str(&decoder.push(&rest[..n]));
        rest = &rest[n..];
    }
    out.push_str(&decoder.finish());
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn encoding_round_trips(s in text()) {
        let ids = tokenizer().encode(&s);
        prop_assert!(ids.iter().all(|&id| !tokenizer().is_special(id) && (id as usize) < tokenizer().vocab_size()));
        prop_assert_eq!(tokenizer().decode(&ids).expect("decodes"), s);
    }

    #[test]
    fn the_template_renders_what_its_documentation_says(
        messages in prop::collection::vec(message(), 0..5),
        tools in prop::option::of(prop_oneof![text(), Just("[]".to_string())]),
        add_generation_prompt in any::<bool>(),
        thinking in any::<bool>(),
    ) {
        let spec = RenderSpec { messages: &messages, tools: tools.as_deref(), add_generation_prompt, thinking };
        let ids = template().render_spec(&spec).expect("known roles render");
        let expected = Expected::render(&messages, tools.as_deref(), add_generation_prompt, thinking);
        prop_assert_eq!(tokenizer().decode(&ids).expect("decodes"), expected.text);
        prop_assert_eq!(ids.iter().filter(|&&id| tokenizer().is_special(id)).count(), expected.markers);
    }

    #[test]
    fn a_continuation_renders_what_its_documentation_says(
        messages in prop::collection::vec(message(), 0..4),
        kept_ends_turn in any::<bool>(),
        thinking in any::<bool>(),
    ) {
        let im_end = template().im_end();
        let kept = if kept_ends_turn { vec![1, im_end] } else { vec![im_end, 1] };
        let ids = template().render_continuation(&kept, &messages, thinking).expect("known roles render");
        let expected = Expected::continuation(&messages, kept_ends_turn, thinking);
        prop_assert_eq!(tokenizer().decode(&ids).expect("decodes"), expected.text);
        prop_assert_eq!(ids.iter().filter(|&&id| tokenizer().is_special(id)).count(), expected.markers);
    }

    #[test]
    fn an_unknown_role_is_named(
        mut messages in prop::collection::vec(message(), 1..5),
        at in any::<prop::sample::Index>(),
        role in "[A-Za-z]{1,8}",
    ) {
        prop_assume!(ChatRole::parse(&role).is_none());
        let index = at.index(messages.len());
        messages[index].role = role.clone();
        match template().render(&messages) {
            Err(TokenizerError::UnknownRole { index: got, role: named }) => prop_assert_eq!((got, named), (index, role)),
            other => prop_assert!(false, "expected an unknown role, got {:?}", other),
        }
    }

    #[test]
    fn the_detokenizer_agrees_with_lossy_decoding(
        raw in prop::collection::vec(any::<u32>(), 0..64),
        chunks in prop::collection::vec(0usize..6, 0..32),
        special_tokens in any::<bool>(),
    ) {
        let t = tokenizer();
        let ids: Vec<u32> = raw.into_iter().map(token_id).collect();
        let mut decoder = IncrementalDecoder::new(t.clone()).with_special_tokens(special_tokens);
        let streamed = stream(&mut decoder, &ids, &chunks);
        prop_assert!(!decoder.has_pending());
        let skipped = |id: u32| t.is_special(id) && !special_tokens;
        let kept: Vec<u32> = ids.iter().copied().filter(|&id| !skipped(id) && t.token_bytes(id).is_some()).collect();
        let unknown = ids.iter().filter(|&&id| !skipped(id) && t.token_bytes(id).is_none()).count();
        prop_assert_eq!(streamed, t.decode_lossy(&kept).expect("kept ids are in the vocabulary"));
        prop_assert_eq!(decoder.unknown_ids(), unknown);
    }

    #[test]
    fn the_detokenizer_returns_valid_text_unchanged(s in text(), chunks in prop::collection::vec(0usize..4, 0..32)) {
        let ids = tokenizer().encode(&s);
        let mut decoder = IncrementalDecoder::new(tokenizer().clone());
        prop_assert_eq!(stream(&mut decoder, &ids, &chunks), s);
    }
}
