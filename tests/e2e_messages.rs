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

fn header(h: &reqwest::header::HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_pinned_prefix_survives_traffic_that_evicts_everything_unpinned() {
    // Two workers of 64 blocks (1,024 tokens) each: the traffic below cycles every
    // unpinned block of both several times over.
    let c = Cluster::up(&["--workers", "2", "--num-blocks", "64"]);
    let system = filler(11, 300);
    let ask = |q: &str, policy: &str| {
        let body = msg(cached_system(&system), q, 2);
        let (s, h, v) = c.post_with_headers("/v1/messages", &body, &[("x-kvfleet-policy", policy)]);
        assert_eq!(s, 200, "{v}");
        (
            header(&h, "x-kvfleet-worker"),
            header(&h, "x-kvfleet-pin"),
            v,
        )
    };
    let (pinner, pin, first) = ask("First question?", "cache-aware");
    let (read1, created1, _) = usage(&first);
    assert_eq!(read1, 0, "{first}");
    assert!(created1 >= 256, "{first}");
    assert!(
        pin.starts_with(&format!(
            "pinned; blocks={}; tokens={created1}; expires=",
            created1 / 16
        )),
        "{pin}"
    );
    // An unpinned prompt is cached too, until the traffic comes.
    let unpinned = msg(json!(filler(12, 300)), "Unpinned?", 2);
    let (_, _, u1) = c.post_with_headers("/v1/messages", &unpinned, &[]);
    let (_, _, u2) = c.post_with_headers("/v1/messages", &unpinned, &[]);
    assert_eq!(usage(&u1).0, 0, "{u1}");
    assert!(usage(&u2).0 >= 256, "cached before the traffic: {u2}");
    // Traffic: twelve distinct ~32-block prompts, alternating between the workers.
    for i in 0..12 {
        let body = msg(json!(filler(100 + i, 500)), "Other traffic.", 1);
        let (s, _, v) = c.post(
            "/v1/messages",
            &body,
            &[("x-kvfleet-policy", "round-robin")],
        );
        assert_eq!(s, 200, "{v}");
    }
    // Evicted, all but the chat template's first block, which every prompt shares.
    let (_, _, u3) = c.post_with_headers("/v1/messages", &unpinned, &[]);
    assert!(usage(&u3).0 <= 16, "the unpinned prefix was evicted: {u3}");
    // The pinned prefix is whole on the worker that pinned it, and requests within the
    // ttl go there even under a policy that would alternate.
    for q in ["Second question?", "Third question?"] {
        let (worker, pin, v) = ask(q, "round-robin");
        assert_eq!(worker, pinner, "{v}");
        let (read, created, _) = usage(&v);
        assert_eq!((read, created), (created1, 0), "{v}");
        assert!(pin.starts_with("pinned; "), "{pin}");
    }
}

#[test]
fn a_pin_over_budget_or_capacity_is_served_unpinned_and_says_so() {
    let system = filler(21, 300);
    let body = msg(cached_system(&system), "Question?", 2);
    let budget = Cluster::up(&["--workers", "1", "--pin-budget-bytes-per-tenant", "1"]);
    let (s, h, v) = budget.post_with_headers("/v1/messages", &body, &[]);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    assert_eq!(header(&h, "x-kvfleet-pin"), "refused; reason=over-budget");
    // Streamed, the header comes with the event stream.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = budget
        .http
        .post(format!("{}/v1/messages", budget.url))
        .json(&streamed)
        .send()
        .expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        header(resp.headers(), "x-kvfleet-pin"),
        "refused; reason=over-budget"
    );
    assert!(resp.text().expect("body").contains("message_stop"));
    drop(budget);
    // The worker's cap (here 2 of its 2,048 blocks) refuses the ~19-block prefix.
    let cap = Cluster::up(&["--workers", "1", "--pin-pool-fraction", "0.001"]);
    let (s, h, v) = cap.post_with_headers("/v1/messages", &body, &[]);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        header(&h, "x-kvfleet-pin"),
        "refused; reason=worker-capacity"
    );
    // A 1h ttl is granted for an hour.
    let mut hour = msg(
        json!([{"type": "text", "text": filler(22, 300),
        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]),
        "Q?",
        2,
    );
    hour["temperature"] = json!(0);
    let roomy = Cluster::up(&["--workers", "1"]);
    let (_, h, v) = roomy.post_with_headers("/v1/messages", &hour, &[]);
    let pin = header(&h, "x-kvfleet-pin");
    let expires: u64 = pin
        .rsplit("expires=")
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{pin} {v}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    assert!(
        (now + 3590..=now + 3601).contains(&expires),
        "{pin} at {now}"
    );
}

#[test]
fn tool_choice_any_and_tool_force_a_valid_tool_use() {
    let c = Cluster::up(&["--workers", "1"]);
    let tools = json!([
        {"name": "get_weather", "description": "Weather in a city", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"], "additionalProperties": false}},
        {"name": "get_time", "description": "Time in a zone", "input_schema": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": false}},
    ]);
    for (choice, names) in [
        (json!({"type": "any"}), vec!["get_weather", "get_time"]),
        (
            json!({"type": "tool", "name": "get_time"}),
            vec!["get_time"],
        ),
    ] {
        let mut body = msg(json!("Use a tool."), "What now?", 200);
        body["tools"] = tools.clone();
        body["tool_choice"] = choice.clone();
        let (s, v) = c.post_raw("/v1/messages", &body.to_string());
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["stop_reason"], "tool_use", "{choice}: {v}");
        let uses: Vec<&Value> = v["content"]
            .as_array()
            .expect("content")
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert_eq!(uses.len(), 1, "{v}");
        let name = uses[0]["name"].as_str().expect("name");
        assert!(names.contains(&name), "{name} for {choice}");
        let input = uses[0]["input"].as_object().expect("input object");
        match name {
            "get_time" => assert!(matches!(input["zone"].as_str(), Some("UTC" | "CET")), "{v}"),
            _ => assert!(input["city"].is_string(), "{v}"),
        }
    }
    // `any` with no tools cannot be satisfied.
    let mut none = msg(json!("s"), "hi", 4);
    none["tool_choice"] = json!({"type": "any"});
    let (s, v) = c.post_raw("/v1/messages", &none.to_string());
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (400, Some("invalid_request_error")),
        "{v}"
    );
}

#[test]
fn a_stop_sequence_is_reported_as_such() {
    let c = Cluster::up(&["--workers", "1"]);
    // What the model writes, greedily, without a stop sequence.
    let free = msg(json!("s"), "Say something.", 24);
    let (_, v) = c.post_raw("/v1/messages", &free.to_string());
    let text = v["content"][0]["text"].as_str().expect("text").to_string();
    assert!(text.chars().count() >= 8, "{v}");
    // Its 5th..7th characters as the stop sequence (next to one that never occurs).
    let stop: String = text.chars().skip(4).take(3).collect();
    let mut body = free.clone();
    body["stop_sequences"] = json!(["\u{1F600}never", stop]);
    let (_, v) = c.post_raw("/v1/messages", &body.to_string());
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], stop.as_str(), "{v}");
    let cut = v["content"][0]["text"].as_str().expect("text");
    assert!(
        text.starts_with(cut) && !cut.contains(&stop),
        "{cut:?} of {text:?}"
    );
    // Streamed: the message_delta says the same.
    body["stream"] = json!(true);
    let sse = c
        .http
        .post(format!("{}/v1/messages", c.url))
        .json(&body)
        .send()
        .expect("request")
        .text()
        .expect("body");
    let delta: Value = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|d| d["type"] == "message_delta")
        .expect("message_delta");
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence", "{delta}");
    assert_eq!(delta["delta"]["stop_sequence"], stop.as_str(), "{delta}");
    // Without stop sequences nothing changes.
    let (_, v) = c.post_raw("/v1/messages", &free.to_string());
    assert!(v["stop_sequence"].is_null(), "{v}");
}
