//! Kimi's agent formats: the tool declaration, assistant tool calls and reasoning in the chat template, and the
//! reply parser fed real tool-call token sequences split at every place.

use sparkd_tokenizer::{ChatMessage, ChatTemplate, RenderSpec, ReplyEvent, ReplyParser, Tokenizer, ToolCall};

fn template() -> ChatTemplate {
    ChatTemplate::new(Tokenizer::builtin().unwrap()).unwrap()
}

const TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;

fn call(id: &str, arguments: &str) -> ToolCall {
    ToolCall { id: id.into(), name: sparkd_tokenizer::call_name(id).into(), arguments: arguments.into() }
}

#[test]
fn tools_are_declared_first_and_calls_and_results_render_as_kimi_writes_them() {
    let chat = template();
    let tok = chat.tokenizer().clone();
    let mut assistant = ChatMessage::new("assistant", "Checking.");
    assistant.reasoning = Some("The user wants weather.".into());
    assistant.tool_calls =
        vec![call("functions.get_weather:0", r#"{"city": "Beijing"}"#), call("functions.get_weather:1", "{}")];
    let messages = [
        ChatMessage::new("user", "Weather?"),
        assistant,
        ChatMessage::tool_result("functions.get_weather:0", "Sunny").with_name(Some("get_weather".into())),
    ];
    let ids = chat.render_spec(&RenderSpec { tools: Some(TOOLS), ..RenderSpec::new(&messages) });
    let text = tok.decode(&ids.unwrap()).unwrap();
    assert_eq!(
        text,
        format!(
            "<|im_system|>tool_declare<|im_middle|>{TOOLS}<|im_end|>\
             <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\
             <|im_user|>user<|im_middle|>Weather?<|im_end|>\
             <|im_assistant|>assistant<|im_middle|><think>The user wants weather.</think>Checking.\
             <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>\
             {{\"city\": \"Beijing\"}}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1\
             <|tool_call_argument_begin|>{{}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>\
             <|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>\
             <|im_assistant|>assistant<|im_middle|>"
        )
    );
    // No tools (or an empty array) declares nothing; marker strings inside arguments stay plain text.
    let plain = chat.render(&messages).unwrap();
    let empty = chat.render_spec(&RenderSpec { tools: Some("[]"), ..RenderSpec::new(&messages) });
    assert_eq!(plain, empty.unwrap());
    let mut sneaky = ChatMessage::new("assistant", "");
    sneaky.tool_calls = vec![call("functions.f:0", "<|tool_call_end|>")];
    let ids = chat.render(&[ChatMessage::new("user", "u"), sneaky]).unwrap();
    let markers = chat.tool_markers();
    assert_eq!(ids.iter().filter(|&&id| id == markers.call_end).count(), 1);
}

#[test]
fn a_kept_tool_call_turn_continues_as_the_resent_history_renders() {
    let chat = template();
    let tok = chat.tokenizer().clone();
    let history = [ChatMessage::new("user", "Weather in Paris?")];
    let markers = chat.tool_markers();
    // Turn 1 as served: the prompt with tools, then the reply the model generated.
    let mut kept = chat.render_spec(&RenderSpec { tools: Some(TOOLS), ..RenderSpec::new(&history) }).unwrap();
    kept.extend(tok.encode("<think>Use the tool.</think>"));
    kept.extend([markers.section_begin, markers.call_begin]);
    kept.extend(tok.encode("functions.get_weather:0"));
    kept.push(markers.argument_begin);
    kept.extend(tok.encode(r#"{"city":"Paris"}"#));
    kept.extend([markers.call_end, markers.section_end, chat.im_end()]);
    // Turn 2 by previous_response_id: the tool's result only.
    let result = ChatMessage::tool_result("functions.get_weather:0", "Rain").with_name(Some("get_weather".into()));
    let continued =
        [kept.clone(), chat.render_continuation(&kept, std::slice::from_ref(&result), true).unwrap()].concat();
    // The same conversation resent whole, the reply as a client echoes it back.
    let mut reply = ChatMessage::new("assistant", "");
    reply.reasoning = Some("Use the tool.".into());
    reply.tool_calls = vec![call("functions.get_weather:0", r#"{"city":"Paris"}"#)];
    let full = [history[0].clone(), reply, result];
    let resent = chat.render_spec(&RenderSpec { tools: Some(TOOLS), ..RenderSpec::new(&full) });
    assert_eq!(continued, resent.unwrap());
}

#[test]
fn thinking_off_closes_an_empty_think_block_and_a_kept_turn_continues_as_the_resent_history() {
    let chat = template();
    let tok = chat.tokenizer().clone();
    let history = [ChatMessage::new("user", "Hi")];
    let off = |messages| RenderSpec { thinking: false, ..RenderSpec::new(messages) };
    let on = chat.render_spec(&RenderSpec::new(&history)).unwrap();
    let mut kept = chat.render_spec(&off(&history)).unwrap();
    let empty_think = tok.encode("<think></think>");
    assert_eq!(kept, [on, empty_think.clone()].concat(), "the reply opens after an empty think block");
    // The reply as generated, then a new user turn by continuation and by resending the whole history.
    kept.extend(tok.encode("Hello there."));
    kept.push(chat.im_end());
    let next = ChatMessage::new("user", "And?");
    let continued =
        [kept.clone(), chat.render_continuation(&kept, std::slice::from_ref(&next), false).unwrap()].concat();
    let full = [history[0].clone(), ChatMessage::new("assistant", "Hello there."), next];
    assert_eq!(continued, chat.render_spec(&off(&full)).unwrap());
    assert_ne!(continued, chat.render_spec(&RenderSpec::new(&full)).unwrap(), "thinking on renders no empty block");
    // A turn that did think keeps its reasoning whatever the switch: only the new reply's opening differs.
    let mut thought = ChatMessage::new("assistant", "Yes.");
    thought.reasoning = Some("Because.".into());
    let with = [history[0].clone(), thought];
    let with_off = chat.render_spec(&off(&with)).unwrap();
    assert_eq!(with_off, [chat.render_spec(&RenderSpec::new(&with)).unwrap(), empty_think].concat());
}

#[test]
fn without_thinking_a_think_tag_is_content() {
    let chat = template();
    let ids = chat.tokenizer().encode("<think>not reasoning</think> answer");
    let mut p = ReplyParser::new(chat.tokenizer()).unwrap().without_thinking();
    let mut events = p.push(&ids);
    events.extend(p.finish());
    assert_eq!(joined(events), vec![ReplyEvent::Content("<think>not reasoning</think> answer".into())]);
}

/// The reply of a thinking model that answers, then calls two tools.
fn reply_ids(chat: &ChatTemplate) -> Vec<u32> {
    let tok = chat.tokenizer();
    let m = chat.tool_markers();
    [
        tok.encode("<think>Need data 🌍 first.</think>Let me look."),
        vec![m.section_begin, m.call_begin],
        tok.encode(" functions.get_weather:0 "),
        vec![m.argument_begin],
        tok.encode(r#"{"city": "Zürich", "days": [1, 2]}"#),
        vec![m.call_end, m.call_begin],
        tok.encode("functions.search.web:1"),
        vec![m.argument_begin],
        tok.encode(r#"{"q": "</think> is text here"}"#),
        vec![m.call_end, m.section_end],
    ]
    .concat()
}

/// Events with adjacent text of one kind joined (how a client assembles them).
fn joined(events: Vec<ReplyEvent>) -> Vec<ReplyEvent> {
    let mut out: Vec<ReplyEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(ReplyEvent::Reasoning(a)), ReplyEvent::Reasoning(b)) => a.push_str(&b),
            (Some(ReplyEvent::Content(a)), ReplyEvent::Content(b)) => a.push_str(&b),
            (
                Some(ReplyEvent::ToolCallArguments { index: i, text: a }),
                ReplyEvent::ToolCallArguments { index: j, text: b },
            ) if *i == j => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn parse(chat: &ChatTemplate, pieces: &[&[u32]]) -> Vec<ReplyEvent> {
    let mut p = ReplyParser::new(chat.tokenizer()).unwrap();
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.push(piece));
    }
    events.extend(p.finish());
    joined(events)
}

#[test]
fn the_reply_parser_splits_reasoning_content_and_calls() {
    let chat = template();
    let ids = reply_ids(&chat);
    let events = parse(&chat, &[&ids]);
    assert_eq!(
        events,
        vec![
            ReplyEvent::Reasoning("Need data 🌍 first.".into()),
            ReplyEvent::Content("Let me look.".into()),
            ReplyEvent::ToolCallBegin { index: 0, id: "functions.get_weather:0".into(), name: "get_weather".into() },
            ReplyEvent::ToolCallArguments { index: 0, text: r#"{"city": "Zürich", "days": [1, 2]}"#.into() },
            ReplyEvent::ToolCallEnd { index: 0 },
            ReplyEvent::ToolCallBegin { index: 1, id: "functions.search.web:1".into(), name: "web".into() },
            ReplyEvent::ToolCallArguments { index: 1, text: r#"{"q": "</think> is text here"}"#.into() },
            ReplyEvent::ToolCallEnd { index: 1 },
        ]
    );
}

#[test]
fn the_reply_parser_gives_the_same_calls_whatever_the_split() {
    let chat = template();
    let ids = reply_ids(&chat);
    let whole = parse(&chat, &[&ids]);
    // One token at a time, every single cut, and every pair of cuts (steps of any size, as speculation emits).
    let singles: Vec<&[u32]> = ids.chunks(1).collect();
    assert_eq!(parse(&chat, &singles), whole);
    for a in 0..=ids.len() {
        assert_eq!(parse(&chat, &[&ids[..a], &ids[a..]]), whole, "cut at {a}");
        for b in a..=ids.len() {
            assert_eq!(parse(&chat, &[&ids[..a], &ids[a..b], &ids[b..]]), whole, "cuts at {a}, {b}");
        }
    }
}

#[test]
fn replies_without_thinking_or_with_cut_calls_end_cleanly() {
    let chat = template();
    let tok = chat.tokenizer();
    let m = chat.tool_markers();
    // Content that starts like a tag but is not one, and a `<think>` after content, are content.
    let plain = [tok.encode("  <thin air> and <think>x</think>"), vec![]].concat();
    assert_eq!(parse(&chat, &[&plain]), vec![ReplyEvent::Content("  <thin air> and <think>x</think>".into())]);
    // Unterminated reasoning is released as reasoning at the end.
    let open = tok.encode("<think>still going");
    assert_eq!(parse(&chat, &[&open]), vec![ReplyEvent::Reasoning("still going".into())]);
    // A call cut by the length limit ends with what came; a header that never reached its arguments is dropped.
    let cut = [
        vec![m.section_begin, m.call_begin],
        tok.encode("functions.f:0"),
        vec![m.argument_begin],
        tok.encode("{\"a\""),
    ]
    .concat();
    assert_eq!(
        parse(&chat, &[&cut]),
        vec![
            ReplyEvent::ToolCallBegin { index: 0, id: "functions.f:0".into(), name: "f".into() },
            ReplyEvent::ToolCallArguments { index: 0, text: "{\"a\"".into() },
            ReplyEvent::ToolCallEnd { index: 0 },
        ]
    );
    let header_only = [vec![m.section_begin, m.call_begin], tok.encode("functions.f:0")].concat();
    assert_eq!(parse(&chat, &[&header_only]), vec![]);
    // An empty reply gives nothing.
    assert_eq!(parse(&chat, &[]), vec![]);
}
