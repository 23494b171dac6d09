//! The agent status bar on `/v1/chat/completions`: the request fields `agent_status`,
//! `status_mode`, `status_fields` and `tool_call_limits`, and the server-observed
//! fields computed by code from what the router sees — never by a model.
//!
//! | field        | value                                                            |
//! |--------------|------------------------------------------------------------------|
//! | `tool_calls` | calls per tool in the message history, with limits when given     |
//! | `elapsed`    | time since the session's first request                            |
//! | `turns`      | this request's turn number in the session                         |
//! | `now`        | the current UTC time (timestamps appear only here, at the tail)   |
//! | `cache`      | the previous turn's cached-token ratio                            |

use crate::openai::error::ApiError;
use crate::sessions::SessionState;
use kvfleet_core::chat::{ChatMessage, Role};
use serde_json::{Map, Value};

pub use kvfleet_core::chat::status_bar::{StatusMode, StatusRequest, SERVER_FIELDS};

/// The router's side of a [`StatusRequest`]: checking it against what the router knows
/// and computing the server-observed fields (the request type itself is wire format
/// and lives in `kvfleet-core`).
pub trait StatusRequestExt {
    /// Checks field names before anything is computed: a 400 for an unknown server
    /// field, a client field that collides with one, or a bad limit.
    fn validate(&self, session: Option<&str>) -> Result<(), ApiError>;

    /// The status fields in render order: the client's, then the server's in the
    /// order asked. `session` is the state before this turn (if any), `now_unix_ms`
    /// the wall clock, `now_ms` the router clock the session times are on.
    fn fields(
        &self,
        messages: &[ChatMessage],
        session: Option<&SessionState>,
        now_unix_ms: u64,
        now_ms: u64,
    ) -> Map<String, Value>;
}

impl StatusRequestExt for StatusRequest {
    fn validate(&self, session: Option<&str>) -> Result<(), ApiError> {
        let fields = self.status_fields.as_deref().unwrap_or_default();
        for f in fields {
            if !SERVER_FIELDS.contains(&f.as_str()) {
                return Err(ApiError::invalid_param(
                    "status_fields",
                    format!(
                        "unknown status field `{f}`; known: {}",
                        SERVER_FIELDS.join(", ")
                    ),
                ));
            }
            if self
                .agent_status
                .as_ref()
                .is_some_and(|s| s.contains_key(f))
            {
                return Err(ApiError::invalid_param(
                    "agent_status",
                    format!("`{f}` is a server-observed field; drop it from agent_status"),
                ));
            }
            if matches!(f.as_str(), "elapsed" | "cache") && session.is_none() {
                return Err(ApiError::invalid_param(
                    "status_fields",
                    format!(
                        "status field `{f}` needs a session: send the x-kvfleet-session header \
                         or the `user` field"
                    ),
                ));
            }
        }
        for (tool, limit) in self.tool_call_limits.iter().flatten() {
            parse_limit(limit).map_err(|e| {
                ApiError::invalid_param("tool_call_limits", format!("`{tool}`: {e}"))
            })?;
        }
        Ok(())
    }

    fn fields(
        &self,
        messages: &[ChatMessage],
        session: Option<&SessionState>,
        now_unix_ms: u64,
        now_ms: u64,
    ) -> Map<String, Value> {
        let mut out = self.agent_status.clone().unwrap_or_default();
        for f in self.status_fields.as_deref().unwrap_or_default() {
            let value = match f.as_str() {
                "tool_calls" => tool_call_field(messages, self.tool_call_limits.as_ref()),
                "elapsed" => Value::String(format_duration(
                    session.map_or(0, |s| now_ms.saturating_sub(s.first_seen_ms)),
                )),
                "turns" => Value::from(match session {
                    Some(s) => s.turns + 1,
                    None => {
                        messages
                            .iter()
                            .filter(|m| m.role == Role::Assistant)
                            .count() as u64
                            + 1
                    }
                }),
                "now" => Value::String(format_utc(now_unix_ms)),
                "cache" => Value::String(match session.and_then(|s| s.last_cached) {
                    Some((cached, prompt)) if prompt > 0 => format!(
                        "{:.2} ({cached}/{prompt} prompt tokens cached last turn)",
                        cached as f64 / prompt as f64
                    ),
                    _ => "n/a (first turn)".to_string(),
                }),
                _ => continue,
            };
            out.insert(f.clone(), value);
        }
        out
    }
}

/// A tool's call limit.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Limit {
    Total(u64),
    PerArgument { max: u64, per: String },
}

fn parse_limit(v: &Value) -> Result<Limit, String> {
    if let Some(n) = v.as_u64() {
        return Ok(Limit::Total(n));
    }
    let obj = v
        .as_object()
        .ok_or("a limit is a number or {\"max\": N, \"per\": \"argument\"}")?;
    let max = obj
        .get("max")
        .and_then(Value::as_u64)
        .ok_or("`max` must be a non-negative integer")?;
    match obj.get("per") {
        None => Ok(Limit::Total(max)),
        Some(Value::String(per)) => Ok(Limit::PerArgument {
            max,
            per: per.clone(),
        }),
        Some(_) => Err("`per` must name an argument".into()),
    }
}

/// Calls of one tool, and per value of its limit's `per` argument (first-seen order).
struct ToolCount {
    name: String,
    count: u64,
    per_value: Vec<(String, u64)>,
}

impl ToolCount {
    fn new(name: &str) -> Self {
        ToolCount {
            name: name.to_string(),
            count: 0,
            per_value: Vec::new(),
        }
    }
}

/// Counts every assistant tool call in the history, per tool, in order of first call
/// (tools with a limit but no call yet come last, at 0).
fn tool_call_field(messages: &[ChatMessage], limits: Option<&Map<String, Value>>) -> Value {
    let mut counts: Vec<ToolCount> = Vec::new();
    for call in messages.iter().flat_map(|m| &m.tool_calls) {
        let name = &call.function.name;
        let i = match counts.iter().position(|c| &c.name == name) {
            Some(i) => i,
            None => {
                counts.push(ToolCount::new(name));
                counts.len() - 1
            }
        };
        counts[i].count += 1;
        if let Some(Ok(Limit::PerArgument { per, .. })) =
            limits.and_then(|l| l.get(name)).map(parse_limit)
        {
            let arg = serde_json::from_str::<Value>(&call.function.arguments)
                .ok()
                .and_then(|a| a.get(&per).cloned())
                .map(|v| match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                })
                .unwrap_or_else(|| "?".to_string());
            let per_values = &mut counts[i].per_value;
            match per_values.iter_mut().find(|(v, _)| *v == arg) {
                Some((_, c)) => *c += 1,
                None => per_values.push((arg, 1)),
            }
        }
    }
    for name in limits.into_iter().flat_map(|l| l.keys()) {
        if !counts.iter().any(|c| &c.name == name) {
            counts.push(ToolCount::new(name));
        }
    }
    if counts.is_empty() {
        return Value::String("none".into());
    }
    let mut out = Map::new();
    for ToolCount {
        name,
        count,
        per_value: per_values,
    } in counts
    {
        let limit = limits
            .and_then(|l| l.get(&name))
            .and_then(|v| parse_limit(v).ok());
        let text = match limit {
            None => Value::from(count),
            Some(Limit::Total(max)) => Value::String(format!("{count}/{max}")),
            Some(Limit::PerArgument { max, per }) if per_values.is_empty() => {
                Value::String(format!("{count} (limit {max} per {per})"))
            }
            Some(Limit::PerArgument { max, .. }) => {
                let parts: Vec<String> = per_values
                    .iter()
                    .map(|(v, c)| format!("{v}: {c}/{max}"))
                    .collect();
                Value::String(format!("{count} ({})", parts.join(", ")))
            }
        };
        out.insert(name, text);
    }
    Value::Object(out)
}

/// `1h 02m 03s`, `12m 04s`, `5s`.
pub fn format_duration(ms: u64) -> String {
    let s = ms / 1000;
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    if h > 0 {
        format!("{h}h {m:02}m {s:02}s")
    } else if m > 0 {
        format!("{m}m {s:02}s")
    } else {
        format!("{s}s")
    }
}

/// RFC 3339 UTC at second resolution, e.g. `2026-11-30T06:45:12Z`.
pub fn format_utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::chat::{FunctionCall, ToolCall};
    use serde_json::json;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            id: format!("call_{name}"),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: args.into(),
            },
        }
    }

    fn assistant_calling(calls: Vec<ToolCall>) -> ChatMessage {
        ChatMessage {
            tool_calls: calls,
            content: None,
            ..ChatMessage::assistant("")
        }
    }

    #[test]
    fn tool_calls_are_counted_over_many_turns_with_limits() {
        let history = vec![
            ChatMessage::user("call them"),
            assistant_calling(vec![
                call("phone_call", r#"{"company":"Xfinity"}"#),
                call("search", "{}"),
            ]),
            ChatMessage::tool("call_phone_call", "busy"),
            assistant_calling(vec![call("phone_call", r#"{"company":"Xfinity"}"#)]),
            ChatMessage::tool("call_phone_call", "busy"),
            assistant_calling(vec![
                call("phone_call", r#"{"company": "Xfinity"}"#),
                call("phone_call", r#"{"company":"Comcast"}"#),
            ]),
        ];
        let limits = json!({"phone_call": {"max": 3, "per": "company"}, "search": 5, "email": 2});
        let v = tool_call_field(&history, limits.as_object());
        assert_eq!(
            v,
            json!({
                "phone_call": "4 (Xfinity: 3/3, Comcast: 1/3)",
                "search": "1/5",
                "email": "0/2",
            })
        );
        assert_eq!(
            tool_call_field(&history, None),
            json!({"phone_call": 4, "search": 1})
        );
        assert_eq!(
            tool_call_field(&[ChatMessage::user("hi")], None),
            json!("none")
        );
    }

    #[test]
    fn server_fields_follow_client_fields_in_order() {
        let req = StatusRequest {
            agent_status: json!({"todo": "3/7"}).as_object().cloned(),
            status_fields: Some(vec![
                "turns".into(),
                "elapsed".into(),
                "cache".into(),
                "now".into(),
            ]),
            ..StatusRequest::default()
        };
        let session = SessionState {
            first_seen_ms: 1_000,
            turns: 4,
            last_cached: Some((900, 1000)),
            ..SessionState::default()
        };
        let f = req.fields(&[], Some(&session), 1_764_484_312_000, 3_726_000);
        assert_eq!(
            Value::Object(f),
            json!({
                "todo": "3/7",
                "turns": 5,
                "elapsed": "1h 02m 05s",
                "cache": "0.90 (900/1000 prompt tokens cached last turn)",
                "now": "2025-11-30T06:31:52Z",
            })
        );
    }

    #[test]
    fn validation_names_the_problem() {
        let bad = StatusRequest {
            status_fields: Some(vec!["weather".into()]),
            ..StatusRequest::default()
        };
        assert!(bad
            .validate(Some("s"))
            .unwrap_err()
            .to_string()
            .contains("weather"));
        let needs_session = StatusRequest {
            status_fields: Some(vec!["elapsed".into()]),
            ..StatusRequest::default()
        };
        assert!(needs_session.validate(None).is_err());
        assert!(needs_session.validate(Some("s")).is_ok());
        let clash = StatusRequest {
            agent_status: json!({"turns": 1}).as_object().cloned(),
            status_fields: Some(vec!["turns".into()]),
            ..StatusRequest::default()
        };
        assert!(clash.validate(None).is_err());
        let bad_limit = StatusRequest {
            tool_call_limits: json!({"x": "ten"}).as_object().cloned(),
            ..StatusRequest::default()
        };
        assert!(bad_limit.validate(None).is_err());
    }

    #[test]
    fn utc_and_durations_format() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(format_duration(5_400), "5s");
        assert_eq!(format_duration(724_000), "12m 04s");
    }
}
