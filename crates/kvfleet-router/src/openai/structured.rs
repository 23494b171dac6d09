//! Structured outputs at the front: `response_format` and a forced `tool_choice`
//! become the grammar the worker constrains decoding to. The router compiles it once
//! against a byte vocabulary ([`OutputGrammar::check`]) so a grammar llguidance rejects
//! is a 400 with llguidance's message before any work; the worker compiles it again
//! against its model's vocabulary.

use super::error::ApiError;
use kvfleet_core::chat::ToolDefinition;
use kvfleet_core::openai::ResponseFormat;
use kvfleet_core::structured_output::OutputGrammar;
use kvfleet_proto::v1 as pb;

/// The grammar a request asks for, if any: from `response_format`, or from
/// `tool_choice` (`required`, or a named function) over `tools`. Not yet checked.
pub fn request_grammar(
    response_format: Option<&ResponseFormat>,
    tool_choice: Option<&serde_json::Value>,
    tools: &[ToolDefinition],
) -> Result<Option<OutputGrammar>, ApiError> {
    let from_tools = tool_grammar(tool_choice, tools)?;
    let from_format = match response_format {
        None | Some(ResponseFormat::Text) => None,
        Some(ResponseFormat::JsonObject) => Some(OutputGrammar::JsonObject),
        Some(ResponseFormat::JsonSchema { json_schema }) => Some(OutputGrammar::JsonSchema(
            json_schema
                .schema
                .as_ref()
                .map_or_else(|| "{}".to_string(), |s| s.to_string()),
        )),
    };
    match (from_format, from_tools) {
        (Some(_), Some(_)) => Err(ApiError::invalid_param(
            "response_format",
            "response_format cannot be combined with a forced tool_choice",
        )),
        (f, t) => Ok(f.or(t)),
    }
}

/// Compiles `grammar` the way the worker will (against bytes instead of its vocabulary):
/// a grammar llguidance rejects is a 400 on `param` with its message. CPU work that
/// grows with the schema: run it off the async runtime.
pub fn check(grammar: &OutputGrammar, param: &str) -> Result<(), ApiError> {
    grammar
        .check()
        .map_err(|e| ApiError::invalid_param(param, e))
}

/// The wire form of a grammar.
pub fn to_proto(grammar: OutputGrammar) -> pb::OutputGrammar {
    use pb::output_grammar::Kind;
    pb::OutputGrammar {
        kind: Some(match grammar {
            OutputGrammar::JsonObject => Kind::JsonObject(true),
            OutputGrammar::JsonSchema(s) => Kind::JsonSchema(s),
            OutputGrammar::Lark(s) => Kind::Lark(s),
        }),
    }
}

/// The request field a grammar came from, for error messages.
pub fn param_of(grammar: &OutputGrammar) -> &'static str {
    match grammar {
        OutputGrammar::Lark(_) => "tool_choice",
        _ => "response_format",
    }
}

/// The grammar of a forced tool call: one `<tool_call>` block as the tool-call parser
/// reads it (`<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, the Hermes
/// convention the ChatML tools prompt asks for), the arguments valid against the
/// function's parameter schema. `None` when the model keeps the choice.
fn tool_grammar(
    tool_choice: Option<&serde_json::Value>,
    tools: &[ToolDefinition],
) -> Result<Option<OutputGrammar>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("tool_choice", m);
    let chosen: Vec<&ToolDefinition> = match tool_choice {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "auto" | "none" => return Ok(None),
            "required" => tools.iter().collect(),
            other => {
                return Err(bad(format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or a named function, got \"{other}\""
                )))
            }
        },
        Some(v) => {
            let name = v
                .pointer("/function/name")
                .and_then(serde_json::Value::as_str)
                .filter(|_| v.get("type").and_then(serde_json::Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": …}}".into())
                })?;
            let found: Vec<&ToolDefinition> =
                tools.iter().filter(|t| t.function.name == name).collect();
            if found.is_empty() {
                return Err(bad(format!("tool_choice names `{name}`, which is not in tools")));
            }
            found
        }
    };
    if chosen.is_empty() {
        return Err(bad(
            "tool_choice \"required\" needs at least one tool".into()
        ));
    }
    let calls: Vec<serde_json::Value> = chosen
        .iter()
        .map(|t| {
            let arguments = t
                .function
                .parameters
                .clone()
                .unwrap_or_else(|| serde_json::json!({"type": "object"}));
            serde_json::json!({
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": arguments,
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = match <[serde_json::Value; 1]>::try_from(calls) {
        Ok([one]) => one,
        Err(calls) => serde_json::json!({"anyOf": calls}),
    };
    if let Some(obj) = schema.as_object_mut() {
        obj.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    Ok(Some(OutputGrammar::Lark(format!(
        "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n"
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<ToolDefinition> {
        serde_json::from_value(serde_json::json!([
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}},
        ]))
        .unwrap()
    }

    #[test]
    fn forced_tool_calls_compile() {
        let t = tools();
        for choice in [
            serde_json::json!("required"),
            serde_json::json!({"type": "function", "function": {"name": "get_weather"}}),
        ] {
            let g = request_grammar(None, Some(&choice), &t).unwrap().unwrap();
            check(&g, "tool_choice").unwrap();
        }
        assert_eq!(
            request_grammar(None, Some(&serde_json::json!("auto")), &t).unwrap(),
            None
        );
    }

    #[test]
    fn bad_choices_are_400s_on_tool_choice() {
        let t = tools();
        for choice in [
            serde_json::json!("always"),
            serde_json::json!({"type": "function", "function": {"name": "missing"}}),
            serde_json::json!({"function": {"name": "now"}}),
        ] {
            let e = request_grammar(None, Some(&choice), &t).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("tool_choice"), "{choice}");
        }
        let e = request_grammar(None, Some(&serde_json::json!("required")), &[]).unwrap_err();
        assert!(e.message.contains("at least one tool"), "{}", e.message);
    }

    #[test]
    fn a_schema_llguidance_rejects_is_a_400_with_its_message() {
        let rf: ResponseFormat = serde_json::from_value(serde_json::json!({
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}
        }))
        .unwrap();
        let g = request_grammar(Some(&rf), None, &[]).unwrap().unwrap();
        let e = check(&g, "response_format").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("nope"), "{}", e.message);
    }
}
