//! `kvfleet up` serving the real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), asked
//! what a user would ask: a completion, a greeting, and a repeated agent turn whose
//! prefix must come from cache. scripts/test.sh installs the model (scripts/fetch-model.sh).

mod support;

use serde_json::{json, Value};
use support::Cluster;

fn up(workers: &str) -> Cluster {
    Cluster::up(&["--model", "smollm2-135m", "--workers", workers])
}

/// The id the cluster serves (the GGUF's file stem).
fn model_id(c: &Cluster) -> String {
    let models = c.get("/v1/models");
    models["data"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no model in {models}"))
        .to_string()
}

fn no_special_tokens(text: &str) {
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        assert!(!text.contains(special), "{special} in content {text:?}");
    }
}

#[test]
fn the_default_model_is_smollm2_served_under_its_file_stem() {
    // No --model: what a user gets from plain `kvfleet up`.
    let c = Cluster::up_exact(&["--workers", "1"]);
    assert_eq!(model_id(&c), "SmolLM2-135M-Instruct.Q4_1");
}

#[test]
fn completion_knows_the_capital_of_france_and_a_greeting_stops_at_end_of_turn() {
    let c = up("1");
    let model = model_id(&c);
    let (status, _, body) = c.post(
        "/v1/completions",
        &json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}),
        &[],
    );
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(text.starts_with(" Paris"), "completion {text:?}");

    let (status, _, body) = c.post(
        "/v1/chat/completions",
        &json!({"model": model, "messages": [{"role": "user", "content": "Hi!"}],
                "max_tokens": 96, "temperature": 0}),
        &[],
    );
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{body}");
    let content = choice["message"]["content"].as_str().unwrap_or_default();
    assert!(!content.trim().is_empty(), "{body}");
    no_special_tokens(content);
    // The end-of-turn token ended it, well before the token budget.
    let completion_tokens = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!(completion_tokens < 96, "{body}");
}

#[test]
fn streamed_chat_ends_with_stop_and_no_special_tokens() {
    let c = up("1");
    let model = model_id(&c);
    let resp = c
        .http
        .post(format!("{}/v1/chat/completions", c.url))
        .json(
            &json!({"model": model, "messages": [{"role": "user", "content": "Hi!"}],
                      "max_tokens": 96, "temperature": 0, "stream": true}),
        )
        .send()
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    let body = resp.text().expect("body");
    let mut text = String::new();
    let mut finish = None;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).expect("chunk json");
        if let Some(c) = chunk["choices"].get(0) {
            text.push_str(c["delta"]["content"].as_str().unwrap_or_default());
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    assert_eq!(finish.as_deref(), Some("stop"), "{body}");
    assert!(!text.trim().is_empty(), "{body}");
    no_special_tokens(&text);
}

#[test]
fn a_repeated_agent_turn_is_served_from_cache_by_the_same_worker() {
    let c = up("2");
    let model = model_id(&c);
    let system = "You are a careful coding agent. You read the repository before you change it, \
                  you run the tests after every change, and you explain what you did in one \
                  short paragraph. "
        .repeat(12);
    let turn1 = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "List the files you would read first."},
    ]);
    let req = |messages: &Value| json!({"model": model, "messages": messages, "max_tokens": 24, "temperature": 0});
    let (status, w1, first) = c.post("/v1/chat/completions", &req(&turn1), &[]);
    assert_eq!(status, 200, "{first}");
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(prompt1 > 400, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();

    // The next turn: the whole previous prompt and answer, plus a new user message.
    let mut turn2 = turn1.as_array().cloned().unwrap_or_default();
    turn2.push(json!({"role": "assistant", "content": answer}));
    turn2.push(json!({"role": "user", "content": "Now run the tests."}));
    let (status, w2, second) = c.post("/v1/chat/completions", &req(&Value::Array(turn2)), &[]);
    assert_eq!(status, 200, "{second}");
    assert_eq!(w1, w2, "the follow-up turn went to another worker");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    // Every full 16-token block of the first prompt is reused.
    assert!(
        cached >= prompt1 / 16 * 16 - 16,
        "cached {cached} of {prompt1}: {second}"
    );
}

#[test]
fn large_prompts_being_tokenized_do_not_stall_health_or_a_small_request() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let c = up("1");
    let model = model_id(&c);
    let small_chat = |c: &Cluster| {
        let t = Instant::now();
        let status = c
            .http
            .post(format!("{}/v1/chat/completions", c.url))
            .timeout(Duration::from_secs(30))
            .json(&json!({"model": model, "max_tokens": 1,
                          "messages": [{"role": "user", "content": "Hi!"}]}))
            .send()
            .map(|r| r.status().as_u16());
        (status, t.elapsed())
    };
    // Warm (the worker's first request), then timed idle for comparison.
    let _ = small_chat(&c);
    let (_, idle) = small_chat(&c);
    // More large prompts than the router has runtime threads (one per core): seconds
    // of BPE work each.
    let n = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    let big = support::filler(3, 8 << 20);
    let done = Arc::new(AtomicUsize::new(0));
    let senders: Vec<_> = (0..n)
        .map(|i| {
            let (url, model, done) = (c.url.clone(), model.clone(), done.clone());
            let content = format!("{i} {big}");
            std::thread::spawn(move || {
                let r = reqwest::blocking::Client::new()
                    .post(format!("{url}/v1/chat/completions"))
                    .timeout(Duration::from_secs(600))
                    .json(&json!({"model": model, "max_tokens": 1,
                                  "messages": [{"role": "user", "content": content}]}))
                    .send()
                    .map(|r| r.status().as_u16());
                done.fetch_add(1, Ordering::SeqCst);
                r
            })
        })
        .collect();
    // Let the uploads arrive and their tokenization start.
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    let health = c
        .http
        .get(format!("{}/health", c.url))
        .timeout(Duration::from_secs(30))
        .send()
        .map(|r| r.status().as_u16());
    let health_took = t.elapsed();
    let (small, small_took) = small_chat(&c);
    let still_running = n - done.load(Ordering::SeqCst);
    eprintln!(
        "FIGURE tokenizing {n} x 8 MiB prompts: /health {health:?} in {health_took:?}, \
         small chat {small:?} in {small_took:?} (idle {idle:?}), {still_running} large still running"
    );
    assert!(
        still_running > 0,
        "the large prompts finished before the probes: not a test"
    );
    assert_eq!(health.ok(), Some(200));
    assert!(
        health_took < Duration::from_secs(2),
        "/health took {health_took:?}"
    );
    assert_eq!(small.ok(), Some(200));
    // Generous: the small chat shares the CPU with the large prompts' tokenization.
    assert!(
        small_took < Duration::from_secs(10),
        "a small chat took {small_took:?}"
    );
    drop(c);
    for s in senders {
        let _ = s.join();
    }
}
