//! Anthropic's Messages API (`POST /v1/messages`) against a real `kvfleet up` (the
//! seeded `tiny` model): the answer's shape, `cache_control` usage accounting, the
//! rendering shared with chat completions, sessions from `metadata.user_id`, the SSE
//! event sequence, and every error in Anthropic's shape.

mod support;

use serde_json::{json, Value};
use support::{filler, Cluster};

fn msg(system: Value, user: &str, max_tokens: u32) -> Value {
    json!({
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "system": system,
        "messages": [{"role": "user", "content": user}],
    })
}

fn cached_system(text: &str) -> Value {
    json!([{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}])
}

fn usage(v: &Value) -> (u64, u64, u64) {
    let u = &v["usage"];
    (
        u["cache_read_input_tokens"].as_u64().expect("read"),
        u["cache_creation_input_tokens"].as_u64().expect("creation"),
        u["input_tokens"].as_u64().expect("input"),
    )
}

#[test]
fn a_message_has_anthropics_shape_and_cache_usage() {
    let c = Cluster::up(&["--workers", "1"]);
    let system = filler(1, 600);
    let (s, first) = c.post_raw(
        "/v1/messages",
        &msg(cached_system(&system), "First question?", 4).to_string(),
    );
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["type"], "message");
    assert_eq!(first["role"], "assistant");
    assert_eq!(first["model"], "tiny");
    assert!(first["id"].as_str().unwrap().starts_with("msg_"), "{first}");
    assert_eq!(first["content"][0]["type"], "text");
    assert!(
        matches!(
            first["stop_reason"].as_str(),
            Some("end_turn" | "max_tokens")
        ),
        "{first}"
    );
    assert!(first["usage"]["output_tokens"].as_u64().unwrap() >= 1);
    // Cold: the prefix up to the breakpoint (whole blocks) is written, nothing read.
    let (read1, created1, input1) = usage(&first);
    assert_eq!(read1, 0, "{first}");
    assert!(created1 >= 512, "{first}");
    assert!(input1 > 0 && input1 < 128, "{first}");

    // Another question after the same cached system prompt reads exactly those blocks.
    let (_, second) = c.post_raw(
        "/v1/messages",
        &msg(cached_system(&system), "Second question?", 4).to_string(),
    );
    let (read2, created2, input2) = usage(&second);
    assert_eq!((read2, created2), (created1, 0), "{second}");
    // The same request again: what follows the breakpoint was kept out of the cache.
    let (_, third) = c.post_raw(
        "/v1/messages",
        &msg(cached_system(&system), "Second question?", 4).to_string(),
    );
    assert_eq!(usage(&third), (read2, 0, input2), "{third}");

    // The same conversation as a chat completion renders to the same prompt, and finds
    // the blocks the Messages request wrote.
    let chat = json!({"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Second question?"}
    ]});
    let (s, _, chat) = c.post("/v1/chat/completions", &chat, &[]);
    assert_eq!(s, 200, "{chat}");
    assert_eq!(
        chat["usage"]["prompt_tokens"].as_u64().unwrap(),
        read2 + created2 + input2
    );
    assert_eq!(
        chat["usage"]["prompt_tokens_details"]["cached_tokens"],
        read2
    );

    // Without a breakpoint kvfleet caches anyway: reads are reported, nothing written.
    let plain = msg(json!(system), "Second question?", 4);
    let (_, a) = c.post_raw("/v1/messages", &plain.to_string());
    let (_, b) = c.post_raw("/v1/messages", &plain.to_string());
    let (read_b, created_b, _) = usage(&b);
    assert_eq!(usage(&a).1, 0, "{a}");
    assert_eq!(created_b, 0, "{b}");
    assert!(read_b > read2, "the whole prompt was cached: {b}");
}

#[test]
fn metadata_user_id_is_the_session() {
    let c = Cluster::up(&["--workers", "1"]);
    let mut body = msg(json!("Be brief."), "Hello", 2);
    body["metadata"] = json!({"user_id": "agent-7"});
    let turn = |b: &Value| {
        let (s, h, v) =
            c.post_with_headers("/v1/messages", b, &[("anthropic-version", "2023-06-01")]);
        assert_eq!(s, 200, "{v}");
        h.get("x-kvfleet-session-turn")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    assert_eq!(turn(&body).as_deref(), Some("1"));
    assert_eq!(turn(&body).as_deref(), Some("2"));
    body["metadata"] = json!({"user_id": "agent-8"});
    assert_eq!(turn(&body).as_deref(), Some("1"));
}

#[test]
fn a_streamed_message_sends_anthropics_event_sequence() {
    let c = Cluster::up(&["--workers", "1"]);
    let mut body = msg(cached_system(&filler(2, 300)), "Stream it", 6);
    body["stream"] = json!(true);
    let resp = c
        .http
        .post(format!("{}/v1/messages", c.url))
        .json(&body)
        .send()
        .expect("request");
    assert_eq!(resp.status(), 200);
    let text = resp.text().expect("body");
    let mut names = Vec::new();
    let mut datas = Vec::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            names.push(n.to_string());
        }
        if let Some(d) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).expect("json data");
            datas.push(v);
        }
    }
    assert_eq!(names.len(), datas.len(), "{text}");
    for (n, d) in names.iter().zip(&datas) {
        assert_eq!(d["type"], n.as_str(), "event name is its type");
    }
    assert_eq!(names[0], "message_start", "{text}");
    assert_eq!(names[1], "ping", "{text}");
    assert_eq!(names[2], "content_block_start", "{text}");
    assert_eq!(names[names.len() - 3], "content_block_stop", "{text}");
    assert_eq!(names[names.len() - 2], "message_delta", "{text}");
    assert_eq!(names[names.len() - 1], "message_stop", "{text}");
    assert!(!text.contains("[DONE]"));
    let start = &datas[0]["message"];
    let created = start["usage"]["cache_creation_input_tokens"]
        .as_u64()
        .unwrap();
    assert!(created >= 256, "{start}");
    let delta = &datas[datas.len() - 2];
    assert!(
        delta["usage"]["output_tokens"].as_u64().unwrap() >= 1,
        "{delta}"
    );
    assert!(delta["delta"]["stop_reason"].is_string(), "{delta}");
    let streamed: String = datas
        .iter()
        .filter(|d| d["type"] == "content_block_delta")
        .map(|d| d["delta"]["text"].as_str().unwrap_or_default().to_string())
        .collect();
    body["stream"] = json!(false);
    let (_, whole) = c.post_raw("/v1/messages", &body.to_string());
    assert_eq!(streamed, whole["content"][0]["text"].as_str().unwrap());
}

#[test]
fn bad_requests_get_anthropic_errors() {
    let c = Cluster::up(&["--workers", "1"]);
    let ok = msg(json!("s"), "hi", 2);
    let expect = |body: &Value, status: u16, kind: &str, needle: &str| {
        let (s, v) = c.post_raw("/v1/messages", &body.to_string());
        assert_eq!(s, status, "{v}");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(needle), "{needle:?} not in {m:?}");
    };
    let mut unknown = ok.clone();
    unknown["frobnicate"] = json!(1);
    expect(&unknown, 400, "invalid_request_error", "frobnicate");
    let mut no_max = ok.clone();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    expect(&no_max, 400, "invalid_request_error", "max_tokens");
    let mut model = ok.clone();
    model["model"] = json!("nope");
    expect(&model, 404, "not_found_error", "nope");
    let mut hot = ok.clone();
    hot["temperature"] = json!(1.5);
    expect(&hot, 400, "invalid_request_error", "temperature");
    let cc = json!({"type": "ephemeral"});
    let five: Vec<Value> = (0..5)
        .map(|i| json!({"type": "text", "text": format!("b{i}"), "cache_control": cc}))
        .collect();
    expect(
        &msg(json!(five), "hi", 2),
        400,
        "invalid_request_error",
        "at most 4",
    );
    let ttl =
        json!([{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]);
    expect(&msg(ttl, "hi", 2), 400, "invalid_request_error", "ttl");
    let mut inside = ok.clone();
    inside["messages"] = json!([{"role": "user", "content": [{"type": "tool_result",
        "tool_use_id": "t1", "content": [{"type": "text", "text": "r", "cache_control": cc}]}]}]);
    expect(&inside, 400, "invalid_request_error", "tool_result");
    let mut image = ok.clone();
    image["messages"] = json!([{"role": "user", "content": [{"type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]);
    expect(&image, 400, "invalid_request_error", "image");
    let (s, v) = c.post_raw("/v1/messages", "{not json");
    assert_eq!((s, v["type"].as_str()), (400, Some("error")), "{v}");
    // The server keeps serving.
    let (s, v) = c.post_raw("/v1/messages", &ok.to_string());
    assert_eq!(s, 200, "{v}");
}

#[test]
fn a_missing_key_is_an_anthropic_authentication_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(["keys", "hash", "--tenant=a"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvfleet keys hash");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"key-a")
        .expect("write key");
    let out = child.wait_with_output().expect("keys hash");
    let keys = dir.path().join("keys");
    std::fs::write(&keys, out.stdout).expect("write keys");
    let c = Cluster::up(&["--workers", "1", "--api-keys", keys.to_str().expect("path")]);
    let body = msg(json!("s"), "hi", 2);
    let (s, _, v) = c.post("/v1/messages", &body, &[]);
    assert_eq!(s, 401, "{v}");
    assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    let (s, _, v) = c.post("/v1/messages", &body, &[("x-api-key", "wrong")]);
    assert_eq!((s, v["type"].as_str()), (401, Some("error")), "{v}");
    let (s, _, v) = c.post("/v1/messages", &body, &[("x-api-key", "key-a")]);
    assert_eq!(s, 200, "{v}");
    // Other routes keep OpenAI's shape.
    let (s, _, v) = c.post("/v1/chat/completions", &body, &[]);
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
}
