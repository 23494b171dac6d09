//! Tool calls in generated text: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
//! blocks (the Hermes / Qwen convention ChatML prompts ask for) become OpenAI
//! `tool_calls`; the text around them stays content.

use kvfleet_core::chat::{to_canonical_json, FunctionCall, ToolCall};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Splits generated text into content and tool calls. A block that is not valid JSON
/// with a string `name` stays in the content, so nothing the model wrote is lost.
/// `id_prefix` makes call ids unique per response (`call_<prefix>_<n>`).
pub fn parse_tool_calls(text: &str, id_prefix: &str) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            break;
        };
        let body = after[..end].trim();
        match parse_call(body) {
            Some(function) => {
                content.push_str(&rest[..start]);
                calls.push(ToolCall {
                    id: format!("call_{id_prefix}_{}", calls.len()),
                    kind: "function".to_string(),
                    function,
                });
            }
            None => content.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &after[end + CLOSE.len()..];
    }
    content.push_str(rest);
    let content = if calls.is_empty() {
        content
    } else {
        content.trim().to_string()
    };
    (content, calls)
}

/// Length of the tail of `text` that could be the start of a tool-call block, which a
/// streaming response must hold back until it knows.
pub fn partial_open_len(text: &str) -> usize {
    (1..OPEN.len())
        .rev()
        .find(|k| text.ends_with(&OPEN[..*k]))
        .unwrap_or(0)
}

/// Whether `text` contains the start of a tool-call block.
pub fn has_open(text: &str) -> bool {
    text.contains(OPEN)
}

fn parse_call(body: &str) -> Option<FunctionCall> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(a) => to_canonical_json(a),
        None => "{}".to_string(),
    };
    Some(FunctionCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_calls_and_keeps_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>";
        let (content, calls) = parse_tool_calls(text, "x");
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].id, "call_x_0");
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(
            calls[0].function.arguments,
            "{\"city\": \"Paris\", \"unit\": \"c\"}"
        );
        assert_eq!(calls[1].function.name, "now");
    }

    #[test]
    fn malformed_blocks_stay_text() {
        let text = "a <tool_call>not json</tool_call> b <tool_call>{\"name\"";
        let (content, calls) = parse_tool_calls(text, "x");
        assert!(calls.is_empty());
        assert_eq!(content, text);
    }

    #[test]
    fn partial_open_tags_are_detected() {
        assert_eq!(partial_open_len("hello <tool"), 5);
        assert_eq!(partial_open_len("hello"), 0);
        assert!(has_open("x<tool_call>"));
    }
}
