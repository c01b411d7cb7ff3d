//! The grammar of Kimi's tool-call section for `tool_choice: required` or a named function
//! (docs/agent-formats.md): `<|tool_calls_section_begin|>`, one call (or, with parallel calls, one or more), each
//! `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>` with `NAME`
//! one of the declared functions and the arguments following its JSON Schema, then `<|tool_calls_section_end|>`.
//! Written in llguidance's Lark dialect: special tokens by name, `%json` for each function's schema.

use serde_json::Value;

use super::{fixed_whitespace, GrammarError, Result};

/// A function a call may name: its name and its parameters' JSON Schema (`None`: any JSON object).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Option<Value>,
}

/// The Lark grammar of a section calling `tools` (see the module docs).
pub fn tool_calls_grammar(tools: &[ToolSpec], parallel: bool) -> Result<String> {
    if tools.is_empty() {
        return Err(GrammarError::Invalid { what: "tool-call grammar", message: "no function to call".into() });
    }
    let mut g = String::from("start: <|tool_calls_section_begin|> ");
    g.push_str(if parallel { "call+" } else { "call" });
    g.push_str(" <|tool_calls_section_end|>\ncall: ");
    g.push_str(&(0..tools.len()).map(|i| format!("fn_{i}")).collect::<Vec<_>>().join(" | "));
    g.push('\n');
    for (i, tool) in tools.iter().enumerate() {
        if !tool.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') || tool.name.is_empty() {
            return Err(GrammarError::Invalid {
                what: "tool-call grammar",
                message: format!("function name {:?} is not made of A-Z, a-z, 0-9, _ and -", tool.name),
            });
        }
        let schema = fixed_whitespace(tool.parameters.as_ref().unwrap_or(&serde_json::json!({"type": "object"})));
        g.push_str(&format!(
            "fn_{i}: <|tool_call_begin|> \"functions.{}:\" INDEX <|tool_call_argument_begin|> %json {} \
             <|tool_call_end|>\n",
            tool.name, schema
        ));
    }
    g.push_str("INDEX: /[0-9]{1,3}/\n");
    Ok(g)
}
