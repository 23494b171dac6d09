//! The message that turns a parent conversation into one fork child.
//!
//! A cache-exploiting fork gives every child the parent's messages, the parent's
//! assistant message with its tool calls, and then one `user` message holding a
//! constant placeholder result for every tool call followed by the child's directive.
//! Everything before the directive is byte-identical across siblings, so the fleet
//! computes it once; only the directive (a few hundred tokens) differs.

use super::messages::{ChatMessage, ToolCall};

/// The placeholder result used when a fork request names none.
pub const DEFAULT_PLACEHOLDER: &str =
    "[result pending: this call is being handled by a parallel sub-agent]";

/// Opening tag of a child's directive.
pub const DIRECTIVE_OPEN: &str = "<fork-directive>";
/// Closing tag of a child's directive.
pub const DIRECTIVE_CLOSE: &str = "</fork-directive>";

/// The shared part of every child's last message: one placeholder result per tool
/// call, in call order. Empty when the parent made no tool calls.
pub fn placeholder_results(tool_calls: &[ToolCall], placeholder: &str) -> String {
    let mut out = String::new();
    for call in tool_calls {
        out.push_str("<tool_result id=\"");
        out.push_str(&call.id);
        out.push_str("\" name=\"");
        out.push_str(&call.function.name);
        out.push_str("\">");
        out.push_str(placeholder);
        out.push_str("</tool_result>\n");
    }
    out
}

/// The final `user` message of one child: the placeholder results, then the
/// directive inside `<fork-directive>` tags.
pub fn fork_child_message(
    tool_calls: &[ToolCall],
    placeholder: &str,
    directive: &str,
) -> ChatMessage {
    let mut text = placeholder_results(tool_calls, placeholder);
    text.push_str(DIRECTIVE_OPEN);
    text.push('\n');
    text.push_str(directive);
    text.push('\n');
    text.push_str(DIRECTIVE_CLOSE);
    ChatMessage::user(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::FunctionCall;

    fn call(id: &str, name: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: "{}".into(),
            },
        }
    }

    #[test]
    fn children_differ_only_in_the_directive() {
        let calls = [call("c1", "search"), call("c2", "read")];
        let a = fork_child_message(&calls, "PENDING", "look at logs").text();
        let b = fork_child_message(&calls, "PENDING", "write tests").text();
        assert_eq!(
            a,
            "<tool_result id=\"c1\" name=\"search\">PENDING</tool_result>\n\
             <tool_result id=\"c2\" name=\"read\">PENDING</tool_result>\n\
             <fork-directive>\nlook at logs\n</fork-directive>"
        );
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        let shared = placeholder_results(&calls, "PENDING") + DIRECTIVE_OPEN + "\n";
        assert_eq!(&a[..common], shared);
    }

    #[test]
    fn without_tool_calls_only_the_directive_remains() {
        assert_eq!(
            fork_child_message(&[], DEFAULT_PLACEHOLDER, "go").text(),
            "<fork-directive>\ngo\n</fork-directive>"
        );
    }
}
