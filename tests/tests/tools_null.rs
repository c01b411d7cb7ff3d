//! Black-box tests of the tool fields against `sparkd serve --device null`: tools are declared in the prompt
//! (and not with `tool_choice: none`), a tool loop's history (assistant calls, tool results) is accepted over chat
//! and Responses and renders the same through both, and bad tools are 400s naming the field. The null runner
//! emits plain text ids, so the reply itself holds no calls: the reply parser and the wire shapes of calls are
//! tested in `tokenizer/tests/agent_formats.rs` and the daemon's unit tests.

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
        (json!({"tools": [weather_tool()], "tool_choice": "required"}), "tool_choice"),
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
