//! The agent status bar: fresh per-turn state (tool-call counts, time, TODO progress)
//! rendered as the conversation's last `user` message, after the cached prefix.
//!
//! Agents that write such state into the system prompt change the first block of every
//! prompt and lose the whole prefix cache each turn. Rendered here, at the tail, the
//! status costs only its own tokens. The format is fixed and machine-like — one
//! `key: value` line per field inside `<agent_status>` tags, never prose — so the same
//! state always renders to the same bytes.

use super::messages::ChatMessage;
use serde::Deserialize;
use serde_json::{Map, Value};

/// Opening tag of a rendered status.
pub const STATUS_OPEN: &str = "<agent_status>";
/// Closing tag of a rendered status.
pub const STATUS_CLOSE: &str = "</agent_status>";

/// Why a status object cannot be rendered.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StatusError {
    /// A field name is empty or holds characters that would break the line format.
    #[error("agent_status field name {0:?} must be non-empty and hold no newline, ':' or '<'")]
    BadKey(String),
    /// `null` has no rendering.
    #[error("agent_status field `{0}` is null; leave it out instead")]
    NullValue(String),
    /// Objects nest at most [`MAX_DEPTH`] levels.
    #[error("agent_status field `{0}` nests deeper than {MAX_DEPTH} levels")]
    TooDeep(String),
}

/// How deep status objects may nest.
pub const MAX_DEPTH: usize = 4;

/// Renders `fields` (in their order) as the status text:
///
/// ```text
/// <agent_status>
/// todo: [parse logs, write report]
/// tool_calls:
///   phone_call: 3 (Xfinity: 3/3)
/// turns: 4
/// </agent_status>
/// ```
///
/// Strings are written as they are (newlines escaped as `\n` so one field stays one
/// line), numbers and booleans as JSON, lists as `[a, b]`, and nested objects as
/// indented `key: value` lines under their field.
pub fn render_status(fields: &Map<String, Value>) -> Result<String, StatusError> {
    let mut out = String::with_capacity(64 + 32 * fields.len());
    out.push_str(STATUS_OPEN);
    out.push('\n');
    write_fields(&mut out, fields, 0)?;
    out.push_str(STATUS_CLOSE);
    Ok(out)
}

/// The status as the final `user` message of a conversation.
pub fn status_message(fields: &Map<String, Value>) -> Result<ChatMessage, StatusError> {
    Ok(ChatMessage::user(render_status(fields)?))
}

fn write_fields(
    out: &mut String,
    fields: &Map<String, Value>,
    depth: usize,
) -> Result<(), StatusError> {
    for (key, value) in fields {
        if key.is_empty() || key.contains(['\n', '\r', ':', '<']) {
            return Err(StatusError::BadKey(key.clone()));
        }
        for _ in 0..depth {
            out.push_str("  ");
        }
        out.push_str(key);
        out.push(':');
        match value {
            Value::Null => return Err(StatusError::NullValue(key.clone())),
            Value::Object(inner) => {
                if depth + 1 >= MAX_DEPTH {
                    return Err(StatusError::TooDeep(key.clone()));
                }
                out.push('\n');
                write_fields(out, inner, depth + 1)?;
            }
            other => {
                out.push(' ');
                write_inline(out, other);
                out.push('\n');
            }
        }
    }
    Ok(())
}

/// One value on one line.
fn write_inline(out: &mut String, value: &Value) {
    match value {
        Value::String(s) => push_escaped(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_inline(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                push_escaped(out, k);
                out.push_str(": ");
                write_inline(out, v);
            }
            out.push('}');
        }
        Value::Null => out.push_str("null"),
        other => out.push_str(&other.to_string()),
    }
}

fn push_escaped(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
}

/// Server-observed fields a request may ask for.
pub const SERVER_FIELDS: [&str; 5] = ["tool_calls", "elapsed", "turns", "now", "cache"];

/// What happens to the status after this request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatusMode {
    /// The status is for this request only and never enters the shared prefix cache:
    /// the next turn's prefix stays identical.
    #[default]
    Replace,
    /// The status becomes part of the history and is cached like any message.
    Append,
}

/// The status-bar fields of a chat request.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StatusRequest {
    /// Client fields, rendered in their order.
    pub agent_status: Option<Map<String, Value>>,
    /// `replace` (default) or `append`.
    pub status_mode: Option<StatusMode>,
    /// Server-observed fields to add, from [`SERVER_FIELDS`].
    pub status_fields: Option<Vec<String>>,
    /// Per-tool call limits for the `tool_calls` field: a number (`"search": 10` →
    /// `search: 4/10`) or `{"max": 3, "per": "company"}`, a limit per value of one
    /// argument (`phone_call: 3 (Xfinity: 3/3)`).
    pub tool_call_limits: Option<Map<String, Value>>,
}

impl StatusRequest {
    /// Whether the request asks for a status at all.
    pub fn wanted(&self) -> bool {
        self.agent_status.is_some() || self.status_fields.as_ref().is_some_and(|f| !f.is_empty())
    }

    /// The mode, `replace` unless asked otherwise.
    pub fn mode(&self) -> StatusMode {
        self.status_mode.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("test input is an object"),
        }
    }

    #[test]
    fn renders_one_line_per_field_in_order() {
        let s = render_status(&obj(json!({
            "todo": ["parse logs", "write report"],
            "done": 2,
            "phase": "review\nthen ship",
            "ok": true,
            "tool_calls": {"phone_call": "3 (Xfinity: 3/3)", "search": 1},
            "limits": [{"a": 1}],
        })))
        .unwrap();
        assert_eq!(
            s,
            "<agent_status>\ntodo: [parse logs, write report]\ndone: 2\n\
             phase: review\\nthen ship\nok: true\ntool_calls:\n  phone_call: 3 (Xfinity: 3/3)\n  \
             search: 1\nlimits: [{a: 1}]\n</agent_status>"
        );
    }

    #[test]
    fn same_fields_render_the_same_bytes() {
        let a = obj(json!({"x": 1.5, "y": "z"}));
        assert_eq!(
            render_status(&a).unwrap(),
            render_status(&a.clone()).unwrap()
        );
    }

    #[test]
    fn rejects_bad_keys_nulls_and_deep_nesting() {
        assert_eq!(
            render_status(&obj(json!({"a:b": 1}))),
            Err(StatusError::BadKey("a:b".into()))
        );
        assert_eq!(
            render_status(&obj(json!({"a": null}))),
            Err(StatusError::NullValue("a".into()))
        );
        assert_eq!(
            render_status(&obj(json!({"a": {"b": {"c": {"d": {"e": 1}}}}}))),
            Err(StatusError::TooDeep("d".into()))
        );
        assert!(render_status(&obj(json!({"": 1}))).is_err());
    }

    #[test]
    fn status_is_a_user_message() {
        let m = status_message(&obj(json!({"turns": 3}))).unwrap();
        assert_eq!(m.role, crate::chat::Role::User);
        assert_eq!(m.text(), "<agent_status>\nturns: 3\n</agent_status>");
    }
}
