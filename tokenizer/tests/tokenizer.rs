//! Tokenizer, chat template, incremental detokenizer and Hugging Face export, tested through the public API.

use std::path::Path;
use std::process::Command;

use base64::Engine as _;
use sparkd_tokenizer::{
    export_hf, specials, ChatMessage, ChatTemplate, IncrementalDecoder, RenderSpec, Tokenizer, TokenizerError,
    VocabSource,
};

fn builtin() -> Tokenizer {
    Tokenizer::builtin().expect("the built-in tokenizer builds")
}

/// Varied texts: ASCII prose, code, whitespace runs, numbers, contractions, CJK, emoji, mixed scripts.
fn sample_texts() -> Vec<String> {
    let fixed = [
        "Hello, world!",
        "hello world 你好<|im_end|>",
        "It's what they'd've done; I'm sure you'll see.",
        "fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "def f(a, b):\n\treturn a**2 + b  # comment\n\n\n",
        "    leading spaces and trailing spaces    ",
        "tabs\t\t\tand\r\nwindows\r\nnewlines\n\n\n\n",
        "1234567890 3.14159 1e-9 0xDEADBEEF 1,000,000",
        "日本語のテキストと中文字符混合。한국어도 있습니다.",
        "Ünïcödé façade naïve résumé Ωμέγα Привет мир",
        "emoji: 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ✨🚀",
        "MixedCASEWordsAndCamelCase HTTPServerError XMLHttpRequest",
        "[rid:8a3f2c1b9e7d]\n\nThe quick brown fox jumps over the lazy dog.",
        "<think>不是特殊</think> <|im_user|> [BOS]",
        "a\u{0301}e\u{0300} combining marks and \u{200b}zero width\u{feff}",
        "",
        " ",
        "\n",
        "!!!???...---___***",
        "https://example.com/path?query=1&other=two#frag",
    ];
    let mut texts: Vec<String> = fixed.iter().map(|s| s.to_string()).collect();
    let words = ["the", " cat", "猫", " 🐈", "\n", "  ", "Rust", "'s", "123", "\t", "—", "é", "中文", "ok.", "x_y"];
    // A deterministic LCG mixes the words into a few hundred strings.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..300 {
        let mut text = String::new();
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let len = 1 + (state >> 59) as usize;
        for _ in 0..len {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            text.push_str(words[(state >> 33) as usize % words.len()]);
        }
        texts.push(text);
    }
    texts
}

/// A tiny tiktoken vocabulary: the 256 bytes, then `merges` in rank order.
fn write_synthetic_model(dir: &Path, merges: &[&str]) -> u32 {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut lines: Vec<String> = (0..=255u8).map(|b| format!("{} {}", b64.encode([b]), b)).collect();
    for (i, token) in merges.iter().enumerate() {
        lines.push(format!("{} {}", b64.encode(token.as_bytes()), 256 + i));
    }
    std::fs::write(dir.join("tiktoken.model"), lines.join("\n")).unwrap();
    256 + merges.len() as u32
}

#[test]
fn builtin_places_k3_special_tokens_at_their_real_ids() {
    let tok = builtin();
    assert_eq!(tok.source(), VocabSource::BuiltinCl100k);
    assert_eq!(tok.vocab_size(), 163_840);
    assert_eq!(tok.n_base(), 100_256);
    for (name, id) in [
        ("[BOS]", 163_584),
        ("[EOS]", 163_585),
        ("<|im_end|>", 163_586),
        ("<|im_user|>", 163_587),
        ("<|im_assistant|>", 163_588),
        ("<|im_system|>", 163_594),
        ("<|tool_calls_section_begin|>", 163_595),
        ("<|tool_call_end|>", 163_599),
        ("<|im_middle|>", 163_601),
        ("[UNK]", 163_838),
        ("[PAD]", 163_839),
        ("<|reserved_token_163700|>", 163_700),
    ] {
        assert_eq!(tok.token_id(name), Some(id), "{name}");
        assert!(tok.is_special(id));
        assert_eq!(tok.special_name(id), Some(name));
    }
    assert_eq!(tok.token_id("<|endoftext|>"), None, "cl100k's own specials are not used");
    assert_eq!(tok.eos_ids(), &[163_586, 163_585]);
    assert!(!tok.is_special(100));
}

#[test]
fn builtin_encodes_text_exactly_as_cl100k() {
    let tok = builtin();
    let cl100k = tiktoken_rs::cl100k_base().unwrap();
    for text in sample_texts() {
        let text = text.replace("<|", "<-"); // cl100k's encode_ordinary has no K3 specials to worry about
        assert_eq!(tok.encode(&text), cl100k.encode_ordinary(&text), "{text:?}");
    }
}

#[test]
fn encode_round_trips_and_stays_inside_the_vocabulary() {
    let tok = builtin();
    for text in sample_texts() {
        let ids = tok.encode(&text);
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size() && !tok.is_special(id)), "{text:?}");
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
}

#[test]
fn special_strings_are_text_unless_encoded_with_special() {
    let tok = builtin();
    let text = "a<|im_end|>b[EOS]";
    let plain = tok.encode(text);
    assert!(!plain.iter().any(|&id| tok.is_special(id)));
    assert_eq!(tok.decode(&plain).unwrap(), text);
    let special = tok.encode_with_special(text);
    assert_eq!(special, [tok.encode("a"), vec![163_586], tok.encode("b"), vec![163_585]].concat());
}

#[test]
fn long_runs_are_cut_like_kimi_and_still_round_trip() {
    let tok = builtin();
    let text = format!("{}x{}", " ".repeat(30_000), "y".repeat(26_000));
    let ids = tok.encode(&text);
    assert_eq!(tok.decode(&ids).unwrap(), text);
}

#[test]
fn decode_rejects_ids_outside_the_vocabulary() {
    let tok = builtin();
    for id in [100_256, 120_000, 163_583, 163_840, u32::MAX] {
        let err = tok.decode(&[id]).unwrap_err();
        assert_eq!(err.kind(), "unknown_token_id", "{id}");
        assert!(matches!(err, TokenizerError::UnknownTokenId(bad) if bad == id));
    }
    // Half of a multi-byte character is not valid UTF-8: strict decode errors, lossy decode replaces.
    let ids = tok.encode("😀");
    assert!(ids.len() > 1, "the emoji takes several byte tokens in cl100k");
    assert_eq!(tok.decode(&ids[..1]).unwrap_err().kind(), "invalid_utf8");
    assert!(tok.decode_lossy(&ids[..1]).unwrap().contains('\u{fffd}'));
    assert_eq!(tok.decode(&[163_586]).unwrap(), "<|im_end|>");
}

#[test]
fn from_dir_loads_a_synthetic_model_with_specials_from_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let n_base = write_synthetic_model(dir.path(), &["he", "ll", "hell", "hello", " w", " wo"]);
    let config = serde_json::json!({"added_tokens_decoder": {
        n_base.to_string(): {"content": "[BOS]"},
        (n_base + 2).to_string(): {"content": "<|im_end|>"},
        (n_base + 10).to_string(): {"content": "<|im_system|>"},
        "5": {"content": "<|ignored_outside_the_range|>"},
    }});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();

    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.source(), VocabSource::KimiTiktoken);
    assert_eq!(tok.n_base(), n_base as usize);
    assert_eq!(tok.vocab_size(), n_base as usize + 256);
    assert_eq!(tok.token_id("[BOS]"), Some(n_base));
    assert_eq!(tok.token_id("<|im_end|>"), Some(n_base + 2));
    assert_eq!(tok.token_id("<|im_system|>"), Some(n_base + 10));
    assert_eq!(tok.token_id("[EOS]"), None, "not named in the config");
    let reserved = format!("<|reserved_token_{}|>", n_base + 1);
    assert_eq!(tok.token_id(&reserved), Some(n_base + 1));
    assert_eq!(tok.eos_ids(), &[n_base + 2]);
    assert_eq!(tok.token_id("<|ignored_outside_the_range|>"), None);

    let hello = tok.encode("hello world");
    assert_eq!(hello[0], 256 + 3, "\"hello\" is one token");
    assert_eq!(tok.decode(&hello).unwrap(), "hello world");
    assert_eq!(tok.encode_with_special("hello<|im_end|>"), vec![256 + 3, n_base + 2]);
}

#[test]
fn from_dir_without_config_names_k3_specials_at_their_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let n_base = write_synthetic_model(dir.path(), &["ab"]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    for (offset, name) in specials::K3_NAMED_SPECIALS {
        assert_eq!(tok.token_id(name), Some(n_base + offset));
    }
    assert!(ChatTemplate::new(tok).is_ok());
}

#[test]
fn from_dir_rejects_malformed_files_with_errors_not_panics() {
    let cases: [(&str, &str); 5] = [
        ("bad base64", "!!!notbase64 0\n"),
        ("duplicate rank", "YQ== 0\nYg== 0\n"),
        ("gap in ranks", "YQ== 0\nYg== 2\n"),
        ("bad rank", "YQ== zero\n"),
        ("missing byte tokens", "YQ== 0\nYg== 1\n"),
    ];
    for (what, content) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tiktoken.model"), content).unwrap();
        let err = Tokenizer::from_dir(dir.path()).expect_err(what);
        assert!(matches!(err.kind(), "tokenizer_file" | "tokenizer_build"), "{what}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(Tokenizer::from_dir(dir.path()).unwrap_err().kind(), "tokenizer_file", "no tiktoken.model");
    write_synthetic_model(dir.path(), &[]);
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

fn template() -> ChatTemplate {
    ChatTemplate::new(builtin()).unwrap()
}

#[test]
fn chat_template_renders_kimi_role_markers() {
    let chat = template();
    let tok = chat.tokenizer().clone();
    let messages = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi <|im_end|> there")];
    let ids = chat.render(&messages).unwrap();
    let expected = [
        vec![163_594],
        tok.encode("system"),
        vec![163_601],
        tok.encode("Be brief."),
        vec![163_586, 163_587],
        tok.encode("user"),
        vec![163_601],
        tok.encode("Hi <|im_end|> there"),
        vec![163_586, 163_588],
        tok.encode("assistant"),
        vec![163_601],
    ]
    .concat();
    assert_eq!(ids, expected);
    assert_eq!(
        tok.decode(&ids).unwrap(),
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi <|im_end|> there\
         <|im_end|><|im_assistant|>assistant<|im_middle|>"
    );
}

#[test]
fn chat_template_adds_the_default_system_turn_names_and_tool_results() {
    let chat = template();
    let tok = chat.tokenizer().clone();
    let mut named = ChatMessage::new("user", "hello");
    named.name = Some("alice".into());
    let messages = [named, ChatMessage::tool_result("call_1", "42"), ChatMessage::new("developer", "d")];
    let text = tok.decode(&chat.render(&messages).unwrap()).unwrap();
    assert_eq!(
        text,
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\
         <|im_user|>alice<|im_middle|>hello<|im_end|>\
         <|im_system|>tool<|im_middle|>## Return of call_1\n42<|im_end|>\
         <|im_system|>developer<|im_middle|>d<|im_end|>\
         <|im_assistant|>assistant<|im_middle|>"
    );
    // Without the generation prompt the last message stays open.
    let open = tok.decode(&chat.render_with(&[ChatMessage::new("system", "s")], false).unwrap()).unwrap();
    assert_eq!(open, "<|im_system|>system<|im_middle|>s");
}

#[test]
fn chat_template_rejects_unknown_roles_by_name() {
    let chat = template();
    let messages = [ChatMessage::new("user", "a"), ChatMessage::new("narrator", "b")];
    let err = chat.render(&messages).unwrap_err();
    assert_eq!(err.kind(), "unknown_role");
    assert!(err.to_string().contains("narrator") && err.to_string().contains("message 1"), "{err}");
    assert_eq!(chat.render_continuation(&[], &messages[1..], true).unwrap_err().kind(), "unknown_role");
}

#[test]
fn chat_template_needs_the_role_markers() {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_model(dir.path(), &[]);
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(ChatTemplate::new(tok).unwrap_err().kind(), "missing_special_token");
}

#[test]
fn continuing_a_kept_response_equals_resending_the_full_history() {
    let chat = template();
    let tok = chat.tokenizer().clone();
    let history = vec![ChatMessage::new("system", "You are a coder."), ChatMessage::new("user", "Write hello world.")];
    let reply = "```rust\nfn main() { println!(\"hello 🌍\"); }\n```";

    // Turn 1 as served: prompt, then the generated reply ending with <|im_end|>.
    let mut kept = chat.render(&history).unwrap();
    kept.extend(tok.encode(reply));
    kept.push(chat.im_end());

    // Turn 2 continued by previous_response_id: only the new input items.
    let new_items = vec![ChatMessage::new("user", "Now in Python."), ChatMessage::tool_result("c9", "ok")];
    let continued = [kept.clone(), chat.render_continuation(&kept, &new_items, true).unwrap()].concat();

    let mut full = history.clone();
    full.push(ChatMessage::new("assistant", reply));
    full.extend(new_items.clone());
    assert_eq!(continued, chat.render(&full).unwrap());

    // A reply cut by a length limit (no <|im_end|>) is closed by the continuation.
    let cut = kept[..kept.len() - 1].to_vec();
    let continued = [cut.clone(), chat.render_continuation(&cut, &new_items, true).unwrap()].concat();
    assert_eq!(continued, chat.render(&full).unwrap());
}

#[test]
fn incremental_decoder_never_splits_characters() {
    let tok = builtin();
    for text in ["emoji 😀👩‍👩‍👧‍👦🇫🇷 end", "中文字符和日本語のテキスト", "mixed é 漢 🚀 ok", "plain ascii"]
    {
        let ids = tok.encode(text);
        let mut decoder = IncrementalDecoder::new(tok.clone());
        let mut streamed = String::new();
        let mut held_back = false;
        for id in &ids {
            let piece = decoder.push(&[*id]);
            assert!(!piece.contains('\u{fffd}'), "{text:?}: {piece:?}");
            held_back |= decoder.has_pending();
            streamed.push_str(&piece);
        }
        streamed.push_str(&decoder.finish());
        assert_eq!(streamed, tok.decode(&ids).unwrap());
        assert_eq!(streamed, text);
        if !text.is_ascii() {
            assert!(held_back, "{text:?}: some character should span tokens in cl100k");
        }
    }
}

#[test]
fn incremental_decoder_skips_specials_and_flushes_invalid_tails_lossily() {
    let tok = builtin();
    let mut ids = tok.encode("a😀");
    ids.push(163_586);
    let mut decoder = IncrementalDecoder::new(tok.clone());
    assert_eq!(decoder.push(&ids), "a😀");
    let mut with_special = IncrementalDecoder::new(tok.clone()).with_special_tokens(true);
    assert_eq!(with_special.push(&ids), "a😀<|im_end|>");

    // A truncated emoji: held back, then flushed as U+FFFD.
    let emoji = tok.encode("😀");
    let mut decoder = IncrementalDecoder::new(tok.clone());
    assert_eq!(decoder.push(&emoji[..emoji.len() - 1]), "");
    assert_eq!(decoder.finish(), "\u{fffd}");
    // A truncated emoji followed by text can never complete: replaced at once, text kept.
    let mut decoder = IncrementalDecoder::new(tok.clone());
    let mut broken = emoji[..emoji.len() - 1].to_vec();
    broken.extend(tok.encode("ok"));
    assert_eq!(decoder.push(&broken), "\u{fffd}ok");
    // Ids in the unused gap produce no text and are counted.
    assert_eq!(decoder.push(&[120_000]), "");
    assert_eq!(decoder.unknown_ids(), 1);
}

#[test]
fn export_writes_a_consistent_hugging_face_folder() {
    let tok = builtin();
    let dir = tempfile::tempdir().unwrap();
    export_hf(&tok, dir.path()).unwrap();
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(f)).unwrap()).unwrap()
    };
    let tokenizer = read("tokenizer.json");
    let vocab = tokenizer["model"]["vocab"].as_object().unwrap();
    assert_eq!(vocab.len(), 100_256 + 256);
    assert_eq!(vocab["<|im_end|>"], 163_586);
    assert_eq!(vocab["Ġthe"], tok.encode(" the")[0]);
    let merges = tokenizer["model"]["merges"].as_array().unwrap();
    assert!(merges.len() > 99_000, "almost every multi-byte token has a merge: {}", merges.len());
    for merge in merges.iter().take(2000) {
        let (a, b) = (merge[0].as_str().unwrap(), merge[1].as_str().unwrap());
        assert!(vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}")));
    }
    let added = tokenizer["added_tokens"].as_array().unwrap();
    assert_eq!(added.len(), 256);
    assert!(added.iter().any(|t| t["id"] == 163_601 && t["content"] == "<|im_middle|>"));
    let config = read("tokenizer_config.json");
    assert_eq!(config["chat_template"], ChatTemplate::JINJA);
    assert_eq!(config["split_special_tokens"], true, "special-token text is text, as the daemon reads it");
    assert_eq!(config["added_tokens_decoder"]["163839"]["content"], "[PAD]");
    assert_eq!(read("special_tokens_map.json")["eos_token"], "[EOS]");
}

/// Python used to check the export: `python3` with the `tokenizers` package (it, `jinja2` and `transformers` are
/// installed with pip when missing; pip does nothing when they are present). `None` when unavailable.
fn python_with_tokenizers() -> Option<&'static str> {
    let has = |module: &str| {
        Command::new("python3").args(["-c", &format!("import {module}")]).output().is_ok_and(|o| o.status.success())
    };
    if has("tokenizers") && has("jinja2") && has("transformers") {
        return Some("python3");
    }
    let _ =
        Command::new("python3").args(["-m", "pip", "install", "-q", "tokenizers", "jinja2", "transformers"]).output();
    has("tokenizers").then_some("python3")
}

/// Exports `tok`, loads it with Python's `tokenizers`, and compares its encodings (and, when `jinja2` is
/// present, its chat-template rendering) with the daemon's.
fn compare_with_hugging_face(tok: &Tokenizer, label: &str) {
    let Some(python) = python_with_tokenizers() else {
        eprintln!("SKIPPED {label}: python3 with the `tokenizers` package is not available");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    export_hf(tok, dir.path()).unwrap();
    let texts = sample_texts();
    let expected: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode_with_special(t)).collect();
    // What the daemon charges for text: special-token text is ordinary text.
    let served: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t)).collect();
    let chat = ChatTemplate::new(tok.clone()).unwrap();
    let conversation = serde_json::json!([
        {"role": "user", "content": "Hi there, 你好 😀"},
        {"role": "assistant", "content": "Hello!\n\n  How can I help?"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "thanks", "name": "bob"},
    ]);
    let mut bob = ChatMessage::new("user", "thanks");
    bob.name = Some("bob".into());
    let messages = [
        ChatMessage::new("user", "Hi there, 你好 😀"),
        ChatMessage::new("assistant", "Hello!\n\n  How can I help?"),
        ChatMessage::tool_result("call_1", "42"),
        bob,
    ];
    let case = serde_json::json!({
        "texts": texts, "expected": expected, "served": served, "conversation": conversation,
        "chat_expected": chat.render(&messages).unwrap(),
        "chat_expected_thinking_off": chat.render_spec(&RenderSpec { thinking: false, ..RenderSpec::new(&messages) }).unwrap(),
    });
    std::fs::write(dir.path().join("case.json"), case.to_string()).unwrap();
    let script = r#"
import json, os, sys
from tokenizers import Tokenizer
d = sys.argv[1]
tok = Tokenizer.from_file(d + "/tokenizer.json")
case = json.load(open(d + "/case.json"))
bad = 0
for text, want in zip(case["texts"], case["expected"]):
    got = tok.encode(text, add_special_tokens=False).ids
    if got != want:
        bad += 1
        if bad <= 5:
            print("MISMATCH", repr(text), got, want)
    if tok.decode(want, skip_special_tokens=False) != text:
        bad += 1
        print("DECODE MISMATCH", repr(text))
print("compared", len(case["texts"]), "texts")
try:
    from transformers import AutoTokenizer
except ImportError:
    AutoTokenizer = None
    if os.environ.get("CI"):
        print("transformers is missing in CI")
        bad += 1
if AutoTokenizer is not None:
    # As AIPerf loads it: text is counted as the daemon counts it, special-token text included.
    hf = AutoTokenizer.from_pretrained(d)
    for text, want in zip(case["texts"], case["served"]):
        got = hf.encode(text, add_special_tokens=False)
        if got != want:
            bad += 1
            print("TRANSFORMERS MISMATCH", repr(text), got, want)
    print("compared", len(case["texts"]), "texts through transformers")
try:
    import jinja2
except ImportError:
    jinja2 = None
if jinja2 is not None:
    cfg = json.load(open(d + "/tokenizer_config.json"))
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(cfg["chat_template"])
    text = template.render(messages=case["conversation"], add_generation_prompt=True)
    if tok.encode(text, add_special_tokens=False).ids != case["chat_expected"]:
        bad += 1
        print("CHAT MISMATCH", repr(text))
    # Thinking off: the same text. sparkd encodes an empty think block apart from the content after it (as the
    # model saw it before its reply), where encoding the whole text may join `>` to the next word.
    text = template.render(messages=case["conversation"], add_generation_prompt=True, thinking=False)
    if tok.decode(case["chat_expected_thinking_off"], skip_special_tokens=False) != text:
        bad += 1
        print("CHAT MISMATCH (thinking off)", repr(text))
    print("compared the chat template, thinking on and off")
else:
    print("jinja2 missing: chat template not compared")
sys.exit(1 if bad else 0)
"#;
    let out = Command::new(python).arg("-c").arg(script).arg(dir.path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{label}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{label}: Hugging Face disagrees with the daemon:\n{stdout}");
}

#[test]
fn hugging_face_export_of_builtin_counts_tokens_like_the_daemon() {
    compare_with_hugging_face(&builtin(), "builtin cl100k");
}

#[test]
fn hugging_face_export_of_a_kimi_style_model_counts_tokens_like_the_daemon() {
    // Kimi's regex over cl100k's ranks written as a tiktoken.model: exercises the Han-aware pattern.
    let dir = tempfile::tempdir().unwrap();
    let b64 = base64::engine::general_purpose::STANDARD;
    let lines: Vec<String> =
        builtin().ranks().iter().enumerate().map(|(r, b)| format!("{} {r}", b64.encode(b))).collect();
    std::fs::write(dir.path().join("tiktoken.model"), lines.join("\n")).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.token_id("<|im_end|>"), Some(100_256 + 2));
    compare_with_hugging_face(&tok, "kimi regex");
}
