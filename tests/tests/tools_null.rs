//! Black-box tests of the tool fields against `sparkd serve --device null`: tools are declared in the prompt
//! (and not with `tool_choice: none`), a tool loop's history (assistant calls, tool results) is accepted over chat
//! and Responses and renders the same through both, `tool_choice: required` and a named function produce calls
//! (the null runner follows a constraint's masks), streamed and whole alike, and bad tools are 400s naming the
//! field.

use serde_json::{json, Value};
use sparkd_tests::Server;

async fn null_server() -> Server {
    Server::start(&["--device", "null", "--served-model-name", "null-k3"]).await.expect("server starts")
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

async fn prompt_tokens(s: &Server, body: &Value) -> u64 {
    let (status, reply) = s.post("/v1/chat/completions", body).await.unwrap();
    assert_eq!(status, 200, "{reply}");
    reply["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_declared_in_the_prompt_unless_the_choice_is_none() {
    let s = null_server().await;
    let base =
        json!({"messages": [{"role": "user", "content": "weather in Oslo?"}], "max_tokens": 2, "temperature": 0});
    let plain = prompt_tokens(&s, &base).await;
    let mut with_tools = base.clone();
    with_tools["tools"] = json!([weather_tool()]);
    let declared = prompt_tokens(&s, &with_tools).await;
    assert!(declared > plain + 20, "the tool declaration adds its JSON: {plain} -> {declared}");
    with_tools["tool_choice"] = json!("none");
    assert_eq!(prompt_tokens(&s, &with_tools).await, plain);
    with_tools["tool_choice"] = json!("auto");
    with_tools["parallel_tool_calls"] = json!(false);
    let (status, reply) = s.post("/v1/chat/completions", &with_tools).await.unwrap();
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    assert!(reply["choices"][0]["message"].get("tool_calls").is_none(), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_loop_history_renders_the_same_over_chat_and_responses() {
    let s = null_server().await;
    let args = r#"{"city":"Oslo"}"#;
    let chat = json!({
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
             "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                             "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "snow"}],
        "tools": [weather_tool()], "max_tokens": 3, "temperature": 0});
    let (status, chat_reply) = s.post("/v1/chat/completions", &chat).await.unwrap();
    assert_eq!(status, 200, "{chat_reply}");
    let responses = json!({
        "input": [
            {"role": "user", "content": "weather in Oslo?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
            {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather", "arguments": args},
            {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "snow"}],
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "max_output_tokens": 3, "temperature": 0, "store": false});
    let (status, resp_reply) = s.post("/v1/responses", &responses).await.unwrap();
    assert_eq!(status, 200, "{resp_reply}");
    // The same prompt tokens, and (greedy, the null model a function of the tokens) the same reply.
    assert_eq!(chat_reply["usage"]["prompt_tokens"], resp_reply["usage"]["input_tokens"]);
    assert_eq!(chat_reply["choices"][0]["message"]["content"], resp_reply["output"][0]["content"][0]["text"]);
    assert_eq!(resp_reply["output"][0]["type"], "message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tools_are_400s_naming_the_field() {
    let s = null_server().await;
    let cases = [
        (json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}), "tools[0].function.name"),
        (json!({"tools": [weather_tool(), weather_tool()]}), "tools[1].function.name"),
        (json!({"tool_choice": {"type": "function", "function": {"name": "x"}}}), "tool_choice"),
        (json!({"tools": "all"}), "tools"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, reply) = s.post("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(status, 400, "{extra}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{reply}");
    }
    let bad_call = json!({"messages": [{"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}], "max_tokens": 1});
    let (status, reply) = s.post("/v1/chat/completions", &bad_call).await.unwrap();
    assert_eq!((status, reply["error"]["param"].as_str()), (400, Some("messages[1].tool_calls[0].id")), "{reply}");
    let bad_item = json!({"input": [{"type": "function_call", "call_id": "c"}]});
    let (status, reply) = s.post("/v1/responses", &bad_item).await.unwrap();
    assert_eq!((status, reply["error"]["param"].as_str()), (400, Some("input[0].name")), "{reply}");
    // The server still answers.
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    assert_eq!(s.post("/v1/chat/completions", &ok).await.unwrap().0, 200);
}

/// The calls of a streamed chat, assembled from `delta.tool_calls` as a client does.
fn streamed_calls(events: &[sparkd_tests::SseEvent]) -> (Vec<Value>, String) {
    let mut calls: Vec<Value> = Vec::new();
    let mut finish = String::new();
    for e in events {
        let chunk = &e.data;
        let choice = &chunk["choices"][0];
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
        for d in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().unwrap() as usize;
            if d.get("id").is_some() {
                assert_eq!(i, calls.len(), "calls begin in index order");
                calls.push(json!({"id": d["id"], "name": d["function"]["name"], "arguments": ""}));
            }
            let args =
                calls[i]["arguments"].as_str().unwrap().to_string() + d["function"]["arguments"].as_str().unwrap();
            calls[i]["arguments"] = json!(args);
        }
    }
    (calls, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_tool_choices_produce_calls_streamed_and_whole() {
    let s = null_server().await;
    let alarm = json!({"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object",
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["hour"],
        "additionalProperties": false}}});
    let bounded_weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": false}}});
    for (choice, parallel) in
        [(json!("required"), false), (json!({"type": "function", "function": {"name": "set_alarm"}}), true)]
    {
        let body = json!({"messages": [{"role": "user", "content": "wake me"}], "tools": [bounded_weather, alarm],
                          "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 200,
                          "temperature": 0});
        let (status, reply) = s.post("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(status, 200, "{reply}");
        let choice0 = &reply["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{reply}");
        assert_eq!(choice0["message"]["content"], Value::Null, "{reply}");
        let calls = choice0["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{reply}");
        for c in calls {
            let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            match c["function"]["name"].as_str().unwrap() {
                "set_alarm" => assert!(args["hour"].as_i64().is_some_and(|h| (0..24).contains(&h)), "{args}"),
                "get_weather" => assert!(!parallel && args["city"].is_string(), "{args}"),
                other => panic!("undeclared {other}"),
            }
            assert!(c["id"].as_str().unwrap().starts_with("functions."), "{c}");
        }
        // The same request streamed gives the same calls.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = s.sse_all("/v1/chat/completions", &streamed).await.unwrap();
        let (assembled, finish) = streamed_calls(&events);
        assert_eq!(finish, "tool_calls");
        let whole: Vec<Value> = calls
            .iter()
            .map(|c| json!({"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}))
            .collect();
        assert_eq!(assembled, whole);
    }
}
