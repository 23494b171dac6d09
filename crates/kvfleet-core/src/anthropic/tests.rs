use super::*;
use crate::chat::ChatTemplate;
use crate::tokenizer::{ByteTokenizer, Tokenizer};
use serde_json::json;

fn req(v: Value) -> Result<MessagesRequest, String> {
    serde_json::from_value(v).map_err(|e| e.to_string())
}

fn base() -> Value {
    json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
}

fn with(extra: Value) -> Value {
    let mut v = base();
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

#[test]
fn unknown_fields_are_refused_by_name_at_every_level() {
    let e = req(with(json!({"frobnicate": 1}))).unwrap_err();
    assert!(e.contains("frobnicate"), "{e}");
    let e = req(with(json!({"metadata": {"user_id": "u", "x": 1}}))).unwrap_err();
    assert!(e.contains("`x`"), "{e}");
    let e = req(with(json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "colour": "red"}]}]})))
    .unwrap_err();
    assert!(e.contains("colour"), "{e}");
    let e = req(json!({"model": "m", "messages": []})).unwrap_err();
    assert!(e.contains("max_tokens"), "{e}");
    // kvfleet's own extensions stay accepted.
    req(with(
        json!({"cache_salt": "s", "agent_status": {"step": 1}}),
    ))
    .unwrap();
}

#[test]
fn maps_system_blocks_tool_use_and_tool_results_onto_chat_messages() {
    let tools = json!([{"name": "get_weather", "description": "d",
                        "input_schema": {"type": "object"}}]);
    let r = req(with(json!({
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "tools": tools.clone(),
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "text", "text": "Thanks"}]}
        ]
    })))
    .unwrap();
    let c = Conversation::from_request(&r).unwrap();
    let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::User
        ]
    );
    assert_eq!(c.messages[0].text(), "A\nB");
    assert_eq!(
        c.messages[2].tool_calls[0].function.arguments,
        r#"{"city": "Paris"}"#
    );
    assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(c.messages[3].text(), "18C");
    assert_eq!(c.tools[0].function.name, "get_weather");
    let none = req(with(
        json!({"tools": tools, "tool_choice": {"type": "none"}}),
    ));
    let none = Conversation::from_request(&none.unwrap()).unwrap();
    assert!(none.tools.is_empty());
}

#[test]
fn bad_content_and_breakpoints_are_refused() {
    let cc = json!({"type": "ephemeral"});
    let text = |n: usize| {
        (0..n)
            .map(|i| json!({"type": "text", "text": format!("t{i}"), "cache_control": cc}))
            .collect::<Vec<_>>()
    };
    let conv = |v: Value| Conversation::from_request(&req(v).unwrap());
    let five = with(json!({"messages": [{"role": "user", "content": text(5)}]}));
    assert_eq!(conv(five).unwrap_err().param, "cache_control");
    let four = with(json!({"messages": [{"role": "user", "content": text(4)}]}));
    assert_eq!(conv(four).unwrap().breakpoints.len(), 4);
    let inside = with(json!({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": text(1)}]}]}));
    assert!(conv(inside).unwrap_err().message.contains("inside"));
    let on_result = with(json!({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x", "cache_control": cc}]}]}));
    assert_eq!(conv(on_result).unwrap().breakpoints.len(), 1);
    let ttl = with(json!({"system": [{"type": "text", "text": "s",
        "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}));
    assert!(conv(ttl).unwrap_err().message.contains("ttl"));
    let hour = with(json!({"system": [{"type": "text", "text": "s",
        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}));
    assert_eq!(conv(hour).unwrap().breakpoints[0].ttl_s, 3600);
    let image = with(json!({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}));
    assert!(conv(image).unwrap_err().message.contains("image"));
    let unknown_tool = with(json!({"tool_choice": {"type": "tool", "name": "nope"}}));
    assert_eq!(conv(unknown_tool).unwrap_err().param, "tool_choice");
}

#[test]
fn breakpoints_sort_in_prefix_order() {
    let cc = json!({"type": "ephemeral"});
    let r = req(with(json!({
        "tools": [{"name": "f", "input_schema": {}, "cache_control": cc}],
        "system": [{"type": "text", "text": "s", "cache_control": cc}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a", "cache_control": cc}]}]
    })))
    .unwrap();
    let c = Conversation::from_request(&r).unwrap();
    let at: Vec<Breakpoint> = c.breakpoints.iter().map(|b| b.at).collect();
    assert_eq!(
        at,
        [
            Breakpoint::Tool(0),
            Breakpoint::System(0),
            Breakpoint::Message {
                message: 0,
                block: 0
            }
        ]
    );
    assert!(at.windows(2).all(|w| w[0] < w[1]));
    // The top-level marker is a breakpoint on the last block.
    let auto = req(with(json!({"cache_control": cc, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}
    ]})))
    .unwrap();
    let c = Conversation::from_request(&auto).unwrap();
    assert_eq!(
        c.breakpoints[0].at,
        Breakpoint::Message {
            message: 2,
            block: 1
        }
    );
}

#[test]
fn a_breakpoint_ends_where_its_block_ends_in_the_prompt() {
    let cc = json!({"type": "ephemeral"});
    let r = req(with(json!({
        "system": [{"type": "text", "text": "SYSTEM", "cache_control": cc},
                   {"type": "text", "text": "MORE"}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "first", "cache_control": cc},
            {"type": "text", "text": "second"}]}]
    })))
    .unwrap();
    let (t, tok) = (ChatTemplate::ChatMl, ByteTokenizer::new());
    let c = Conversation::from_request(&r).unwrap();
    let text = t.render(&c.messages, &c.tools, true).unwrap();
    let full = tok.encode(&text).unwrap();
    let upto = |needle: &str| {
        let end = text.find(needle).unwrap() + needle.len();
        tok.encode(&text[..end]).unwrap().len()
    };
    let sys = breakpoint_tokens(&r, c.breakpoints[0].at, &t, &tok, &full).unwrap();
    assert_eq!(sys, upto("SYSTEM"));
    let msg = breakpoint_tokens(&r, c.breakpoints[1].at, &t, &tok, &full).unwrap();
    assert_eq!(msg, upto("first"));
}

#[test]
fn usage_splits_reads_writes_and_the_rest() {
    // 100 tokens, a breakpoint at 70, blocks of 16: 64 cacheable.
    let cold = MessagesUsage::split(100, 0, Some(70), 16, 5);
    assert_eq!(
        (
            cold.cache_read_input_tokens,
            cold.cache_creation_input_tokens,
            cold.input_tokens
        ),
        (0, 64, 36)
    );
    let warm = MessagesUsage::split(100, 64, Some(70), 16, 5);
    assert_eq!(
        (
            warm.cache_read_input_tokens,
            warm.cache_creation_input_tokens,
            warm.input_tokens
        ),
        (64, 0, 36)
    );
    let partial = MessagesUsage::split(100, 32, Some(70), 16, 5);
    assert_eq!(partial.cache_creation_input_tokens, 32);
    // Without a breakpoint: reads are still reported, nothing counts as written.
    let none = MessagesUsage::split(100, 48, None, 16, 5);
    assert_eq!(
        (
            none.cache_read_input_tokens,
            none.cache_creation_input_tokens,
            none.input_tokens
        ),
        (48, 0, 52)
    );
}

#[test]
fn stream_events_name_themselves_by_their_type() {
    let e = StreamEvent::ContentBlockStop { index: 0 };
    let s = serde_json::to_string(&e).unwrap();
    assert!(s.starts_with(r#"{"type":"content_block_stop""#), "{s}");
    assert_eq!(e.name(), "content_block_stop");
    let s = serde_json::to_string(&StreamEvent::MessageStop).unwrap();
    assert_eq!(s, r#"{"type":"message_stop"}"#);
}
