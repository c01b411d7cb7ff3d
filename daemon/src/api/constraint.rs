//! The output constraint a request asks for: `response_format` (chat: `json_object`, `json_schema`; Responses:
//! `text.format`), the extension field `structured_outputs` (`{"regex": …}`, `{"grammar": …}` in llguidance's
//! Lark dialect, or `{"json": schema}`), or a `tool_choice` of `required` or a named function.
//!
//! Invariants:
//! - A request has at most one constraint; asking for two is a 400 naming the second field.
//! - The constraint is compiled (by `sparkd-grammar`, with its limits, on the preparation pool) before the request
//!   reaches the engine, so an invalid schema, regex or grammar is a 400 naming the field and what llguidance
//!   found wrong.

use serde_json::Value;
use sparkd_grammar::{Constraint, ConstraintSpec, GrammarEnv};

use super::error::ApiError;
use super::openai::Fields;
use super::tools::Tools;
use super::AppState;

/// The constraint fields of a request (`f`): chat's `response_format`, or Responses' `text.format` when
/// `responses`; `structured_outputs`; and the tools' choice. `None`: unconstrained.
pub fn parse(f: &Fields, tools: Option<&Tools>, responses: bool) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
    let mut found: Vec<(String, ConstraintSpec)> = Vec::new();
    let format = if responses {
        match f.get("text") {
            Some(text) => {
                let t = Fields::new(text, &f.name("text"))?;
                t.get("format").map(|v| (t.name("format"), v))
            }
            None => None,
        }
    } else {
        f.get("response_format").map(|v| (f.name("response_format"), v))
    };
    if let Some((field, value)) = format {
        if let Some(spec) = response_format(&field, value, responses)? {
            found.push((field, spec));
        }
    }
    if let Some(value) = f.get("structured_outputs") {
        let s = Fields::new(value, &f.name("structured_outputs"))?;
        let specs = [
            s.str("regex")?.map(|r| (s.name("regex"), ConstraintSpec::Regex(r.to_string()))),
            s.str("grammar")?.map(|g| (s.name("grammar"), ConstraintSpec::Lark(g.to_string()))),
            s.get("json").map(|j| (s.name("json"), ConstraintSpec::JsonSchema(j.clone()))),
        ];
        found.extend(specs.into_iter().flatten());
    }
    if let Some(spec) = tools.and_then(Tools::constraint) {
        found.push((f.name("tool_choice"), spec));
    }
    if found.len() > 1 {
        let (second, _) = &found[1];
        return Err(ApiError::field(
            second.clone(),
            format!("`{second}`: a request takes one output constraint, and `{}` already sets one", found[0].0),
        ));
    }
    Ok(found.pop())
}

/// `response_format` / `text.format`: `text` (none), `json_object`, or `json_schema` (chat nests the schema
/// under `json_schema.schema`, Responses puts it at `schema`).
fn response_format(field: &str, value: &Value, responses: bool) -> Result<Option<ConstraintSpec>, ApiError> {
    let r = Fields::new(value, field)?;
    match r.str("type")? {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSpec::JsonObject)),
        Some("json_schema") => {
            let holder = if responses {
                r
            } else {
                let inner = r.get("json_schema").ok_or_else(|| {
                    ApiError::field(r.name("json_schema"), format!("`{}` is required", r.name("json_schema")))
                })?;
                Fields::new(inner, &r.name("json_schema"))?
            };
            let schema = holder.get("schema").ok_or_else(|| {
                ApiError::field(holder.name("schema"), format!("`{}` is required", holder.name("schema")))
            })?;
            Ok(Some(ConstraintSpec::JsonSchema(schema.clone())))
        }
        Some(other) => Err(ApiError::field(
            r.name("type"),
            format!("`{}` = {other:?}: expected \"text\", \"json_object\" or \"json_schema\"", r.name("type")),
        )),
    }
}

/// Compiles the constraint `field` asked for; an invalid one is a 400 naming the field.
pub fn compile(env: &GrammarEnv, field: &str, spec: &ConstraintSpec) -> Result<Box<Constraint>, ApiError> {
    env.constraint(spec).map(Box::new).map_err(|e| ApiError::field(field.to_string(), format!("`{field}`: {e}")))
}

/// Compiles a request's constraint, if any (on the preparation pool: the first one also describes the tokenizer
/// to llguidance, about half a second, and a large schema takes milliseconds).
pub fn compile_request(
    state: &AppState,
    requested: &Option<(String, ConstraintSpec)>,
) -> Result<Option<Box<Constraint>>, ApiError> {
    let Some((field, spec)) = requested else { return Ok(None) };
    compile(state.grammar()?, field, spec).map(Some)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parsed(body: Value, responses: bool) -> Result<Option<(String, ConstraintSpec)>, ApiError> {
        let f = Fields::new(&body, "").unwrap();
        let tools = super::super::tools::parse(&f, responses).unwrap();
        parse(&f, tools.as_ref(), responses)
    }

    #[test]
    fn each_form_of_constraint_is_read_from_its_field() {
        let schema = json!({"type": "object"});
        let chat = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}});
        assert_eq!(
            parsed(chat, false).unwrap(),
            Some(("response_format".into(), ConstraintSpec::JsonSchema(schema.clone())))
        );
        let resp = json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}});
        assert_eq!(parsed(resp, true).unwrap().unwrap().1, ConstraintSpec::JsonSchema(schema));
        assert_eq!(
            parsed(json!({"response_format": {"type": "json_object"}}), false).unwrap().unwrap().1,
            ConstraintSpec::JsonObject
        );
        assert_eq!(parsed(json!({"response_format": {"type": "text"}}), false).unwrap(), None);
        let rx = parsed(json!({"structured_outputs": {"regex": "a+"}}), false).unwrap().unwrap();
        assert_eq!(rx, ("structured_outputs.regex".into(), ConstraintSpec::Regex("a+".into())));
        let tools = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"});
        assert!(matches!(parsed(tools, false).unwrap().unwrap().1, ConstraintSpec::ToolCalls { .. }));
    }

    #[test]
    fn two_constraints_or_a_bad_format_are_400s_naming_the_field() {
        let both = json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}});
        assert_eq!(parsed(both, false).unwrap_err().param(), Some("structured_outputs.regex"));
        let bad = json!({"response_format": {"type": "yaml"}});
        assert_eq!(parsed(bad, false).unwrap_err().param(), Some("response_format.type"));
        let no_schema = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}});
        assert_eq!(parsed(no_schema, false).unwrap_err().param(), Some("response_format.json_schema.schema"));
    }
}
