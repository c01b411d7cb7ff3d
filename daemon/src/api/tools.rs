//! The tool fields of a request: `tools`, `tool_choice` and `parallel_tool_calls` (chat completions and
//! Responses), and the tool calls of assistant messages in a resent history.
//!
//! Invariants:
//! - A request's tools are checked before anything is rendered: every entry is a function with a name of 1 to
//!   [`MAX_TOOL_NAME`] characters from `[A-Za-z0-9_-]` (OpenAI's rule; Kimi's call ids `functions.NAME:IDX`
//!   need a name without `.` or `:`), names are unique, `parameters` is an object when present, and there are
//!   at most [`MAX_TOOLS`]. Every error names the field at fault.
//! - The declaration rendered into the prompt is the request's `tools` array as compact JSON, its keys in the
//!   client's order, as Kimi's template serialises it (docs/agent-formats.md).
//! - `tool_choice: none` declares no tools and reports no calls; `auto` lets the model choose; `required` and a
//!   named function constrain the reply to Kimi's tool-call section calling a declared function (the named one),
//!   its arguments following the function's `parameters` schema ([`Tools::constraint`]).

use std::collections::HashSet;

use serde_json::Value;
use sparkd_grammar::{ConstraintSpec, ToolSpec};
use sparkd_tokenizer::{call_name, ToolCall};

use super::error::ApiError;
use super::openai::Fields;

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;
/// Most tool calls one resent assistant message may carry.
pub const MAX_MESSAGE_TOOL_CALLS: usize = 128;

/// How the model may use the tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    /// At least one call, to any declared function.
    Required,
    /// Calls to this function only.
    Named(String),
}

/// A request's validated tools.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The `tools` array as compact JSON (the prompt's declaration).
    pub declaration: String,
    pub names: Vec<String>,
    /// Each function's name and parameters schema, for the constraint of `required` and named choices.
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): false keeps only a reply's first call.
    pub parallel: bool,
}

impl Tools {
    /// The declaration the prompt carries: none with `tool_choice: none`.
    pub fn prompt_declaration(&self) -> Option<&str> {
        (self.choice != ToolChoice::None).then_some(self.declaration.as_str())
    }

    /// Whether the reply's calls are reported (not with `tool_choice: none`).
    pub fn reports_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The constraint `tool_choice` puts on the reply: a tool-call section calling any function (`required`) or
    /// the named one; none for `auto` and `none`.
    pub fn constraint(&self) -> Option<ConstraintSpec> {
        let tools = match &self.choice {
            ToolChoice::Auto | ToolChoice::None => return None,
            ToolChoice::Required => self.specs.clone(),
            ToolChoice::Named(name) => self.specs.iter().filter(|s| &s.name == name).cloned().collect(),
        };
        Some(ConstraintSpec::ToolCalls { tools, parallel: self.parallel })
    }
}

/// The name of a tool turn without one: the function of a Kimi call id (`functions.NAME:IDX`), else none (the
/// turn is then named `tool`). Both APIs name result turns this way, so a conversation renders the same through
/// either (docs/agent-formats.md).
pub fn tool_turn_name(call_id: &str) -> Option<String> {
    call_id.starts_with("functions.").then(|| call_name(call_id).to_string())
}

/// Whether `name` is a valid function name.
fn valid_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a request (`f`); `None` when it declares no tools.
/// `flat` is the Responses form (`{"type": "function", "name": …, "parameters": …}`), else chat's (`{"type":
/// "function", "function": {…}}`); the declaration is always chat's form, as Kimi's template expects.
pub fn parse(f: &Fields, flat: bool) -> Result<Option<Tools>, ApiError> {
    let choice_value = f.get("tool_choice");
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(items)) => Some(items),
        Some(_) => return Err(ApiError::field(f.name("tools"), format!("`{}` must be an array", f.name("tools")))),
    };
    let Some(items) = tools.filter(|t| !t.is_empty()) else {
        return match choice_value {
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
            None => Ok(None),
            Some(_) => Err(ApiError::field(
                f.name("tool_choice"),
                format!("`{}` needs `{}`", f.name("tool_choice"), f.name("tools")),
            )),
        };
    };
    if items.len() > MAX_TOOLS {
        return Err(ApiError::field(
            f.name("tools"),
            format!("`{}` declares {} tools; at most {MAX_TOOLS} are allowed", f.name("tools"), items.len()),
        ));
    }
    let mut names = Vec::with_capacity(items.len());
    let mut specs = Vec::with_capacity(items.len());
    let mut seen = HashSet::new();
    let mut declared = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let t = Fields::new(item, &format!("{}[{i}]", f.name("tools")))?;
        match t.str("type")? {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::field(
                    t.name("type"),
                    format!("`{}`: tool type `{other}` is not supported (only function)", t.name("type")),
                ))
            }
            None => return Err(ApiError::field(t.name("type"), format!("`{}` is required", t.name("type")))),
        }
        let function = if flat {
            t
        } else {
            let inner = t
                .get("function")
                .ok_or_else(|| ApiError::field(t.name("function"), format!("`{}` is required", t.name("function"))))?;
            Fields::new(inner, &t.name("function"))?
        };
        let name = function.str("name")?.ok_or_else(|| {
            ApiError::field(function.name("name"), format!("`{}` is required", function.name("name")))
        })?;
        if !valid_name(name) {
            return Err(ApiError::field(
                function.name("name"),
                format!(
                    "`{}` = {name:?}: a function name is 1 to {MAX_TOOL_NAME} characters of A-Z, a-z, 0-9, _ and -",
                    function.name("name")
                ),
            ));
        }
        if !seen.insert(name.to_string()) {
            return Err(ApiError::field(
                function.name("name"),
                format!("`{}`: the function `{name}` is declared twice", function.name("name")),
            ));
        }
        function.str("description")?;
        if let Some(p) = function.get("parameters") {
            if !p.is_object() {
                return Err(ApiError::field(
                    function.name("parameters"),
                    format!("`{}` must be a JSON Schema object", function.name("parameters")),
                ));
            }
        }
        function.bool("strict")?;
        specs.push(ToolSpec { name: name.to_string(), parameters: function.get("parameters").cloned() });
        names.push(name.to_string());
        declared.push(if flat { chat_form(item) } else { item.clone() });
    }
    let choice = tool_choice(f, choice_value, &names)?;
    let declaration = serde_json::to_string(&Value::Array(declared))
        .map_err(|e| ApiError::field(f.name("tools"), format!("`{}` cannot be serialised: {e}", f.name("tools"))))?;
    Ok(Some(Tools { declaration, names, specs, choice, parallel }))
}

/// A Responses tool (`{"type": "function", "name", "description", "parameters", "strict"}`) in chat's form.
fn chat_form(item: &Value) -> Value {
    let mut function = serde_json::Map::new();
    if let Some(map) = item.as_object() {
        for (k, v) in map {
            if k != "type" {
                function.insert(k.clone(), v.clone());
            }
        }
    }
    serde_json::json!({"type": "function", "function": Value::Object(function)})
}

fn tool_choice(f: &Fields, value: Option<&Value>, names: &[String]) -> Result<ToolChoice, ApiError> {
    let field = f.name("tool_choice");
    match value {
        None => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::field(
                field.clone(),
                format!("`{field}` = {other:?}: expected \"auto\", \"none\", \"required\" or a function"),
            )),
        },
        Some(v @ Value::Object(_)) => {
            let c = Fields::new(v, &field)?;
            let name = match c.get("function") {
                Some(inner) => Fields::new(inner, &c.name("function"))?.str("name")?,
                None => c.str("name")?,
            };
            match name {
                Some(n) if names.iter().any(|d| d == n) => Ok(ToolChoice::Named(n.to_string())),
                Some(n) => Err(ApiError::field(
                    field.clone(),
                    format!("`{field}` names `{n}`, which `tools` does not declare"),
                )),
                None => Err(ApiError::field(field.clone(), format!("`{field}` must name a function"))),
            }
        }
        Some(_) => Err(ApiError::field(field.clone(), format!("`{field}` must be a string or an object"))),
    }
}

/// The `tool_calls` of a resent assistant message (`m`): `[{"id", "type": "function", "function": {"name",
/// "arguments"}}]`, arguments as a JSON string (or an object, serialised compactly).
pub fn message_calls(m: &Fields) -> Result<Vec<ToolCall>, ApiError> {
    let Some(value) = m.get("tool_calls") else { return Ok(Vec::new()) };
    let items = value
        .as_array()
        .ok_or_else(|| ApiError::field(m.name("tool_calls"), format!("`{}` must be an array", m.name("tool_calls"))))?;
    if items.len() > MAX_MESSAGE_TOOL_CALLS {
        return Err(ApiError::field(
            m.name("tool_calls"),
            format!("`{}` holds {} calls; at most {MAX_MESSAGE_TOOL_CALLS}", m.name("tool_calls"), items.len()),
        ));
    }
    let mut calls = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let c = Fields::new(item, &format!("{}[{i}]", m.name("tool_calls")))?;
        let id =
            c.str("id")?.ok_or_else(|| ApiError::field(c.name("id"), format!("`{}` is required", c.name("id"))))?;
        let function = c
            .get("function")
            .ok_or_else(|| ApiError::field(c.name("function"), format!("`{}` is required", c.name("function"))))?;
        let function = Fields::new(function, &c.name("function"))?;
        let name = function.str("name")?.ok_or_else(|| {
            ApiError::field(function.name("name"), format!("`{}` is required", function.name("name")))
        })?;
        let arguments = match function.get("arguments") {
            None => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v @ Value::Object(_)) => v.to_string(),
            Some(_) => {
                return Err(ApiError::field(
                    function.name("arguments"),
                    format!("`{}` must be a JSON string", function.name("arguments")),
                ))
            }
        };
        calls.push(ToolCall { id: id.to_string(), name: name.to_string(), arguments });
    }
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tools(body: Value) -> Result<Option<Tools>, ApiError> {
        parse(&Fields::new(&body, "").unwrap(), false)
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "d",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn message(e: ApiError) -> String {
        e.to_string()
    }

    #[test]
    fn tools_keep_the_clients_key_order_in_the_declaration() {
        let t = tools(json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!(
            t.declaration,
            r#"[{"type":"function","function":{"name":"get_weather","description":"d","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#
        );
        assert_eq!(
            (t.names.clone(), t.choice.clone(), t.parallel),
            (vec!["get_weather".to_string()], ToolChoice::Auto, true)
        );
        assert_eq!(t.prompt_declaration(), Some(t.declaration.as_str()));
        let none = tools(json!({"tools": [weather()], "tool_choice": "none"})).unwrap().unwrap();
        assert!(none.prompt_declaration().is_none() && !none.reports_calls());
        assert!(tools(json!({"tools": []})).unwrap().is_none());
        assert!(tools(json!({})).unwrap().is_none());
    }

    #[test]
    fn bad_tools_are_refused_naming_the_field() {
        let cases = [
            (json!({"tools": {}}), "`tools` must be an array"),
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
            (json!({"tools": [{"type": "function"}]}), "`tools[0].function` is required"),
            (json!({"tools": [{"type": "function", "function": {"name": "a.b"}}]}), "tools[0].function.name"),
            (json!({"tools": [weather(), weather()]}), "declared twice"),
            (json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}), "JSON Schema"),
            (json!({"tools": [weather()], "tool_choice": "sometimes"}), "\"sometimes\""),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "`other`",
            ),
            (json!({"tool_choice": "required"}), "needs `tools`"),
        ];
        for (body, want) in cases {
            let err = message(tools(body.clone()).unwrap_err());
            assert!(err.contains(want), "{body}: {err}");
        }
        let required = tools(json!({"tools": [weather()], "tool_choice": "required"})).unwrap().unwrap();
        assert!(
            matches!(required.constraint(), Some(ConstraintSpec::ToolCalls { ref tools, parallel: true }) if tools.len() == 1)
        );
        let named = tools(json!({"tools": [weather()], "parallel_tool_calls": false,
                                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}));
        let named = named.unwrap().unwrap();
        assert_eq!(named.choice, ToolChoice::Named("get_weather".into()));
        assert!(matches!(named.constraint(), Some(ConstraintSpec::ToolCalls { parallel: false, .. })));
        let many: Vec<Value> =
            (0..=MAX_TOOLS).map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}})).collect();
        assert!(message(tools(json!({"tools": many})).unwrap_err()).contains("at most 128"));
    }

    #[test]
    fn responses_tools_are_declared_in_chat_form() {
        let body = json!({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]});
        let t = parse(&Fields::new(&body, "").unwrap(), true).unwrap().unwrap();
        assert_eq!(t.declaration, r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#);
    }

    #[test]
    fn resent_calls_take_string_or_object_arguments() {
        let m = json!({"role": "assistant", "tool_calls": [
            {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
            {"id": "functions.g:1", "type": "function", "function": {"name": "g", "arguments": {"b": 2}}}]});
        let calls = message_calls(&Fields::new(&m, "messages[1]").unwrap()).unwrap();
        assert_eq!(calls[0].arguments, "{\"a\": 1}");
        assert_eq!((calls[1].id.as_str(), calls[1].arguments.as_str()), ("functions.g:1", r#"{"b":2}"#));
        let bad = json!({"tool_calls": [{"function": {"name": "f"}}]});
        let err = message(message_calls(&Fields::new(&bad, "messages[1]").unwrap()).unwrap_err());
        assert!(err.contains("messages[1].tool_calls[0].id"), "{err}");
    }
}
