//! End-to-end: the agent status bar, the fork API and the cache-break diagnostics
//! against a real `kvfleet up` (tiny seeded model: byte tokens, ChatML, 16-token blocks).

mod support;

use kvfleet_core::chat::{ChatMessage, ChatTemplate};
use kvfleet_core::tokenizer::{ByteTokenizer, Tokenizer};
use serde_json::{json, Value};
use support::{filler, Cluster};

const BLOCK: u64 = 16;

/// Prompt ids of `messages` rendered as history (no generation prompt), as the
/// router's template and tokenizer produce them.
fn history_tokens(messages: &[Value]) -> u64 {
    let msgs: Vec<ChatMessage> = serde_json::from_value(json!(messages)).expect("messages");
    let text = ChatTemplate::ChatMl
        .render(&msgs, &[], false)
        .expect("render");
    ByteTokenizer::new().encode(&text).expect("encode").len() as u64
}

fn cached(r: &Value) -> u64 {
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

fn tool_call(id: &str, name: &str, args: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
}

/// The calls the agent makes on turn `t`: tool calls spread over many turns.
fn calls_of_turn(t: usize) -> Vec<(String, Value)> {
    let companies = ["Xfinity", "Comcast", "Xfinity", "Verizon"];
    let mut calls = vec![(
        "phone_call".to_string(),
        json!({"company": companies[t % 4]}),
    )];
    if t.is_multiple_of(3) {
        calls.push(("search".to_string(), json!({"q": format!("plan {t}")})));
    }
    calls
}

#[test]
fn replace_mode_status_keeps_every_turn_cached() {
    let c = Cluster::up(&["--workers", "2"]);
    let mut messages = vec![
        json!({"role": "system", "content": filler(1, 1500)}),
        json!({"role": "user", "content": format!("Cancel my internet plan. {}", filler(2, 300))}),
    ];
    let mut prev_history: Option<u64> = None;
    let mut expected_calls: Vec<(String, Value)> = Vec::new();
    for turn in 1..=10usize {
        let body = json!({
            "model": "tiny",
            "messages": messages,
            "max_tokens": 3,
            "temperature": 0,
            "agent_status": {"todo": format!("{turn}/10 steps"), "phase": if turn < 5 { "calling" } else { "wrapping up" }},
            "status_fields": ["tool_calls", "turns", "elapsed", "now", "cache"],
            "tool_call_limits": {"phone_call": {"max": 3, "per": "company"}, "search": 5},
        });
        let (s, h, r) = c.post_with_headers(
            "/v1/chat/completions",
            &body,
            &[("x-kvfleet-session", "agent-1")],
        );
        assert_eq!(s, 200, "{r}");
        assert!(
            h.get("x-kvfleet-prefix-break").is_none(),
            "turn {turn} broke the cache: {h:?}"
        );
        assert_eq!(h["x-kvfleet-session-turn"], turn.to_string().as_str());

        // Every full block of the previous turn's conversation is served from cache:
        // the status that followed it never entered the prefix.
        let history = history_tokens(&messages);
        match prev_history {
            None => assert_eq!(cached(&r), 0, "turn 1 is cold"),
            Some(prev) => assert_eq!(cached(&r), prev / BLOCK * BLOCK, "turn {turn}"),
        }
        assert!(cached(&r) < r["usage"]["prompt_tokens"].as_u64().unwrap());

        // The status the model saw: client fields, then server-observed ones, counted
        // from the history exactly.
        assert_eq!(r["agent_status"]["mode"], "replace");
        let status = r["agent_status"]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(r["agent_status"]["message"]["role"], "user");
        let lines: Vec<&str> = status.lines().collect();
        assert_eq!(lines[0], "<agent_status>");
        assert_eq!(lines[1], format!("todo: {turn}/10 steps"));
        assert_eq!(*lines.last().unwrap(), "</agent_status>");
        assert!(status.contains(&format!("\nturns: {turn}\n")), "{status}");
        assert!(status.contains("\nnow: 20"), "{status}");
        if turn == 1 {
            assert!(status.contains("cache: n/a (first turn)"), "{status}");
            // Limited tools show up at zero before their first call.
            assert!(
                lines.contains(&"  phone_call: 0 (limit 3 per company)"),
                "{status}"
            );
            assert!(lines.contains(&"  search: 0/5"), "{status}");
        } else {
            assert!(status.contains("cache: 0."), "{status}");
            let mut per_company: Vec<(String, usize)> = Vec::new();
            let mut searches = 0;
            for (name, args) in &expected_calls {
                if name == "search" {
                    searches += 1;
                    continue;
                }
                let co = args["company"].as_str().unwrap().to_string();
                match per_company.iter_mut().find(|(c, _)| *c == co) {
                    Some((_, n)) => *n += 1,
                    None => per_company.push((co, 1)),
                }
            }
            let phone: usize = per_company.iter().map(|(_, n)| n).sum();
            let parts: Vec<String> = per_company
                .iter()
                .map(|(co, n)| format!("{co}: {n}/3"))
                .collect();
            let want_phone = format!("  phone_call: {phone} ({})", parts.join(", "));
            assert!(
                lines.contains(&want_phone.as_str()),
                "{want_phone:?} not in\n{status}"
            );
            let want_search = format!("  search: {searches}/5");
            assert!(
                lines.contains(&want_search.as_str()),
                "{want_search:?} not in\n{status}"
            );
        }

        // The agent's next step: its tool calls and their results.
        prev_history = Some(history);
        let calls = calls_of_turn(turn);
        let tool_calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(k, (name, args))| tool_call(&format!("call_{turn}_{k}"), name, args.clone()))
            .collect();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": tool_calls}));
        for (k, _) in calls.iter().enumerate() {
            messages.push(json!({"role": "tool", "tool_call_id": format!("call_{turn}_{k}"), "content": format!("result {turn}.{k}")}));
        }
        expected_calls.extend(calls);
    }
}

#[test]
fn status_in_the_system_prompt_breaks_the_cache_and_is_named() {
    let c = Cluster::up(&["--workers", "2"]);
    let mut messages = vec![json!({"role": "user", "content": filler(5, 800)})];
    for turn in 1..=4 {
        // The anti-pattern: fresh state written at the top of the system prompt.
        let system = format!("Turn {turn}. Time 10:0{turn}. {}", filler(6, 1200));
        let mut all = vec![json!({"role": "system", "content": system})];
        all.extend(messages.iter().cloned());
        let body = json!({"model": "tiny", "messages": all, "max_tokens": 2, "temperature": 0, "user": "anti-pattern"});
        let (s, h, r) = c.post_with_headers("/v1/chat/completions", &body, &[]);
        assert_eq!(s, 200, "{r}");
        assert_eq!(
            cached(&r),
            0,
            "turn {turn}: the changed first block spoils everything after it"
        );
        let brk = h
            .get("x-kvfleet-prefix-break")
            .map(|v| v.to_str().unwrap().to_string());
        if turn == 1 {
            assert_eq!(brk, None);
        } else {
            let brk = brk.expect("a prefix-break header");
            // `<|im_start|>` is one token, then "system\n" and "Turn " (13 tokens).
            assert!(
                brk.starts_with("reason=system_prompt_changed; token=13; message=0; role=system"),
                "{brk}"
            );
        }
        messages.push(json!({"role": "assistant", "content": "ok"}));
        messages.push(json!({"role": "user", "content": format!("step {turn}")}));
    }
    let metrics = c.get_text("/metrics");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("kvfleet_prefix_breaks_total{reason=\"system_prompt_changed\"}"))
        .expect("prefix break counter");
    assert!(line.ends_with(" 3"), "{line}");
}

#[test]
fn append_mode_status_becomes_cached_history() {
    let c = Cluster::up(&["--workers", "1"]);
    let mut messages = vec![
        json!({"role": "system", "content": filler(7, 1000)}),
        json!({"role": "user", "content": "go"}),
    ];
    let body = |messages: &Vec<Value>, turn: usize| {
        json!({"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0,
               "agent_status": {"step": turn}, "status_mode": "append"})
    };
    let (s, _, r1) = c.post_with_headers("/v1/chat/completions", &body(&messages, 1), &[]);
    assert_eq!(s, 200, "{r1}");
    assert_eq!(r1["agent_status"]["mode"], "append");
    let status = r1["agent_status"]["message"].clone();
    assert_eq!(
        status["content"],
        "<agent_status>\nstep: 1\n</agent_status>"
    );
    messages.push(status);
    // The whole first prompt (status and generation prompt included) was cacheable.
    let first_prompt = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(first_prompt > history_tokens(&messages));
    messages.push(json!({"role": "assistant", "content": "done"}));
    messages.push(json!({"role": "user", "content": "next"}));
    let (s, _, r2) = c.post_with_headers("/v1/chat/completions", &body(&messages, 2), &[]);
    assert_eq!(s, 200, "{r2}");
    assert_eq!(
        cached(&r2),
        first_prompt / BLOCK * BLOCK,
        "the appended status is cached history"
    );
}

#[test]
fn forks_compute_the_shared_prefix_once_and_match_solo_children() {
    let c = Cluster::up(&["--workers", "2"]);
    let parent = vec![
        json!({"role": "system", "content": filler(11, 2000)}),
        json!({"role": "user", "content": filler(12, 600)}),
        json!({"role": "assistant", "content": null, "tool_calls": [
            tool_call("c1", "search", json!({"q": "a"})),
            tool_call("c2", "read_file", json!({"path": "/x"})),
        ]}),
    ];
    let directives: Vec<String> = (0..5)
        .map(|i| format!("Sub-agent {i}: {}", filler(20 + i, 200)))
        .collect();
    let before = c.fleet_prompt_tokens_computed();
    let body = json!({"model": "tiny", "messages": parent, "directives": directives,
                      "placeholder": "PENDING", "max_tokens": 6, "temperature": 0});
    let (s, h, r) = c.post_with_headers("/v1/forks", &body, &[]);
    assert_eq!(s, 200, "{r}");
    let computed = c.fleet_prompt_tokens_computed() - before;
    let shared = r["fork"]["shared_prefix_tokens"].as_u64().unwrap();
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 5);
    assert!(h.get("x-kvfleet-fork-group").is_some());
    let worker = choices[0]["worker"].as_str().unwrap();
    let mut tails = 0;
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(ch["worker"], worker, "all five children on one worker");
        let p = ch["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            cached(&json!({"usage": ch["usage"]})),
            shared,
            "child {i} reused the prefix"
        );
        tails += p - shared;
    }
    // The prefix once, then only each child's own tail.
    assert_eq!(
        computed,
        shared + tails,
        "engine counters: prefix computed once"
    );
    assert!(
        shared > 2500,
        "the shared prefix is the parent's whole conversation: {shared}"
    );
    assert_eq!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"],
        shared * 5
    );

    // Each child equals what it gets sent alone.
    for (i, d) in directives.iter().enumerate() {
        let mut msgs = parent.clone();
        msgs.push(json!({"role": "user", "content": format!(
            "<tool_result id=\"c1\" name=\"search\">PENDING</tool_result>\n\
             <tool_result id=\"c2\" name=\"read_file\">PENDING</tool_result>\n\
             <fork-directive>\n{d}\n</fork-directive>")}));
        let solo = json!({"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0});
        let (s, _, r1) = c.post_with_headers("/v1/chat/completions", &solo, &[]);
        assert_eq!(s, 200, "{r1}");
        assert_eq!(
            r1["usage"]["prompt_tokens"], choices[i]["usage"]["prompt_tokens"],
            "child {i}: same prompt"
        );
        assert_eq!(
            r1["choices"][0]["message"]["content"], choices[i]["message"]["content"],
            "child {i}: same output"
        );
    }
}

#[test]
fn bad_status_and_fork_requests_get_clear_errors() {
    let c = Cluster::up(&["--workers", "1"]);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": msgs, "status_fields": ["weather"]}),
            "weather",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": msgs, "status_fields": ["elapsed"]}),
            "session",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": msgs, "agent_status": {"a": null}}),
            "null",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": msgs, "status_mode": "sideways", "agent_status": {"a": 1}}),
            "sideways",
        ),
        (
            "/v1/forks",
            json!({"model": "tiny", "messages": msgs, "directives": []}),
            "directives",
        ),
        (
            "/v1/forks",
            json!({"model": "tiny", "messages": msgs, "directives": ["x"], "stream": true}),
            "stream",
        ),
    ];
    for (path, body, needle) in cases {
        let (s, _, r) = c.post_with_headers(path, &body, &[]);
        assert_eq!(s, 400, "{body} → {r}");
        let msg = r["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{msg:?} should mention {needle}");
    }
}
