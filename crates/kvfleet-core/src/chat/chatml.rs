//! The built-in ChatML renderer, in the layout of Qwen2.5's chat template.
//!
//! Each message is `<|im_start|>{role}\n{content}<|im_end|>\n`. With tools, a system
//! block listing them comes first (merged with the conversation's first system
//! message); assistant tool calls follow the content as `<tool_call>` blocks; tool
//! results are written as a user turn of `<tool_response>` blocks, consecutive results
//! sharing one turn. Unlike Qwen's template, no default system prompt is invented when
//! the conversation has none, so the output depends only on the messages.
//!
//! Rendering is append-only: for `0 < k < n`, the rendering of `messages[..k]` without
//! a generation prompt is a byte prefix of the rendering of `messages[..n]`, unless
//! `messages[k - 1]` and `messages[k]` are both tool results (the shared user turn is
//! still open there). That property is what lets a new turn reuse the cached prefix of
//! the previous one. Each message ends in `<|im_end|>\n` and the next starts with a
//! special token, so the token ids are append-only too.

use super::canonical_json::write_canonical_json;
use super::messages::{ChatMessage, Role, ToolCall, ToolDefinition};
use super::ChatError;

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>\n";

const TOOLS_HEADER: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";

const TOOLS_FOOTER: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// Renders `messages` (and `tools`) as ChatML; see the module documentation.
pub(crate) fn render(
    messages: &[ChatMessage],
    tools: &[ToolDefinition],
    add_generation_prompt: bool,
) -> Result<String, ChatError> {
    if messages.is_empty() {
        return Err(ChatError::EmptyMessages);
    }
    let mut out = String::with_capacity(estimated_len(messages));
    let mut first = 0;
    if !tools.is_empty() {
        out.push_str(IM_START);
        out.push_str("system\n");
        if messages[0].role == Role::System {
            write_content(&mut out, &messages[0]);
            out.push_str("\n\n");
            first = 1;
        }
        out.push_str(TOOLS_HEADER);
        for tool in tools {
            out.push('\n');
            write_canonical_json(&mut out, &tool.to_json());
        }
        out.push_str(TOOLS_FOOTER);
        out.push_str(IM_END);
    }
    for (i, message) in messages.iter().enumerate().skip(first) {
        match message.role {
            Role::Tool => {
                let after_tool = i > 0 && messages[i - 1].role == Role::Tool;
                if !after_tool {
                    out.push_str(IM_START);
                    out.push_str("user");
                }
                out.push_str("\n<tool_response>\n");
                write_content(&mut out, message);
                out.push_str("\n</tool_response>");
                let before_tool = messages.get(i + 1).is_some_and(|m| m.role == Role::Tool);
                if !before_tool {
                    out.push_str(IM_END);
                }
            }
            Role::Assistant if !message.tool_calls.is_empty() => {
                out.push_str(IM_START);
                out.push_str("assistant");
                if message.content.as_ref().is_some_and(|c| !c.is_empty()) {
                    out.push('\n');
                    write_content(&mut out, message);
                }
                for call in &message.tool_calls {
                    write_tool_call(&mut out, call);
                }
                out.push_str(IM_END);
            }
            role => {
                out.push_str(IM_START);
                out.push_str(role.as_str());
                out.push('\n');
                write_content(&mut out, message);
                out.push_str(IM_END);
            }
        }
    }
    if add_generation_prompt {
        out.push_str(IM_START);
        out.push_str("assistant\n");
    }
    Ok(out)
}

fn write_content(out: &mut String, message: &ChatMessage) {
    if let Some(content) = &message.content {
        content.write_text(out);
    }
}

/// `\n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`. Arguments that parse
/// as JSON are re-serialized canonically (so argument key order does not change the
/// prompt); anything else is written verbatim, exactly as the model produced it.
fn write_tool_call(out: &mut String, call: &ToolCall) {
    out.push_str("\n<tool_call>\n{\"name\": ");
    write_canonical_json(out, &serde_json::Value::from(call.function.name.as_str()));
    out.push_str(", \"arguments\": ");
    match serde_json::from_str::<serde_json::Value>(&call.function.arguments) {
        Ok(args) => write_canonical_json(out, &args),
        Err(_) => out.push_str(&call.function.arguments),
    }
    out.push_str("}\n</tool_call>");
}

/// A capacity hint: content plus per-message framing, so that long conversations are
/// rendered without repeated reallocation.
fn estimated_len(messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                Some(super::MessageContent::Text(t)) => t.len(),
                _ => 64,
            };
            content + 32 + m.tool_calls.len() * 128
        })
        .sum()
}
