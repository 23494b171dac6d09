//! End-to-end: `kvfleet up` as a real process, HTTP in, gRPC to workers on loopback.

mod support;

use serde_json::json;
use std::collections::HashMap;
use support::{chat, filler, Cluster};

#[test]
fn the_same_request_twice_is_served_from_cache() {
    let c = Cluster::up(&["--workers", "2"]);
    let body = chat(
        json!([
            {"role": "system", "content": filler(1, 600)},
            {"role": "user", "content": "What is the capital of France?"}
        ]),
        4,
    );
    let (s1, w1, r1) = c.post("/v1/chat/completions", &body, &[]);
    assert_eq!(s1, 200, "{r1}");
    let (s2, w2, r2) = c.post("/v1/chat/completions", &body, &[]);
    assert_eq!(s2, 200, "{r2}");
    let prompt = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(prompt > 600);
    assert!(cached >= prompt - 16, "cached {cached} of {prompt}");
    assert_eq!(w1, w2, "the repeat goes where the prefix is");
    assert_eq!(
        r1["choices"][0]["message"]["content"],
        r2["choices"][0]["message"]["content"]
    );
    assert_eq!(r2["choices"][0]["finish_reason"], "length");
    assert_eq!(r2["usage"]["completion_tokens"], 4);
}

/// Sends a parent turn, then 5 children at once; returns the workers that served the
/// children and the prompt tokens the fleet computed for them.
fn fork_fan_out(c: &Cluster, seed: u32, policy: &str) -> (Vec<String>, u64) {
    let system = filler(seed, 3000);
    let history = filler(seed + 1, 1500);
    let parent = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": history},
    ]);
    let headers = [("x-kvfleet-policy", policy), ("x-kvfleet-fork-group", "g")];
    let (s, _, r) = c.post("/v1/chat/completions", &chat(parent.clone(), 2), &headers);
    assert_eq!(s, 200, "{r}");
    let before = c.fleet_prompt_tokens_computed();
    let mut children = Vec::new();
    for i in 0..5 {
        let mut msgs = parent.as_array().unwrap().clone();
        msgs.push(json!({"role": "assistant", "content": "Forking five sub-agents."}));
        msgs.push(json!({"role": "user", "content": format!("<fork-directive>child {i}: {}</fork-directive>", filler(100 + i, 150))}));
        children.push(chat(json!(msgs), 2));
    }
    let workers: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = children
            .iter()
            .map(|b| s.spawn(|| c.post("/v1/chat/completions", b, &headers)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (status, w, r) = h.join().expect("thread");
                assert_eq!(status, 200, "{r}");
                w.expect("worker header")
            })
            .collect()
    });
    let computed = c.fleet_prompt_tokens_computed() - before;
    (workers, computed)
}

#[test]
fn fork_children_land_on_one_worker_and_compute_the_prefix_once() {
    let c = Cluster::up(&["--workers", "4"]);
    let (workers, computed) = fork_fan_out(&c, 10, "cache-aware");
    assert!(
        workers.iter().all(|w| *w == workers[0]),
        "children spread: {workers:?}"
    );
    // Prefix (~4,500 tokens) once at most: five tails of ~200 tokens plus the parent's
    // uncached partial block each.
    assert!(
        computed < 5 * 260,
        "cache-aware computed {computed} prompt tokens for 5 children"
    );

    // Without peer pulls, round-robin recomputes the prefix on each new worker.
    let c = Cluster::up(&["--workers", "4", "--peer-pull-min-blocks", "0"]);
    let (rr_workers, rr_computed) = fork_fan_out(&c, 20, "round-robin");
    let distinct: std::collections::HashSet<_> = rr_workers.iter().collect();
    assert!(
        distinct.len() >= 3,
        "round-robin should spread: {rr_workers:?}"
    );
    assert!(
        rr_computed > 3 * 4000,
        "round-robin recomputes the prefix on each new worker ({rr_computed} tokens)"
    );
    // With pulls (the default) the children still spread, but each new worker pulls
    // the prefix its holder reported instead of computing it again.
    let c = Cluster::up(&["--workers", "4"]);
    let (pull_workers, pull_computed) = fork_fan_out(&c, 20, "round-robin");
    let distinct: std::collections::HashSet<_> = pull_workers.iter().collect();
    assert!(
        distinct.len() >= 3,
        "round-robin should spread: {pull_workers:?}"
    );
    assert!(
        pull_computed * 2 < rr_computed,
        "pulls should spare most of the recompute: {pull_computed} vs {rr_computed} tokens"
    );
    eprintln!(
        "fork fan-out prompt tokens computed: cache-aware {computed}, round-robin {rr_computed}, round-robin with pulls {pull_computed}"
    );
}

#[test]
fn unrelated_sessions_spread_evenly() {
    let c = Cluster::up(&["--workers", "4"]);
    let mut per_worker: HashMap<String, usize> = HashMap::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let c = &c;
                s.spawn(move || {
                    let body = chat(
                        json!([{"role": "user", "content": filler(1000 + i, 200)}]),
                        2,
                    );
                    c.post("/v1/chat/completions", &body, &[])
                })
            })
            .collect();
        for h in handles {
            let (status, w, r) = h.join().expect("thread");
            assert_eq!(status, 200, "{r}");
            *per_worker.entry(w.expect("worker")).or_default() += 1;
        }
    });
    let max = per_worker.values().copied().max().unwrap_or(0);
    assert_eq!(per_worker.values().sum::<usize>(), 64);
    assert!(max as f64 <= 1.5 * 16.0, "imbalanced: {per_worker:?}");
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let c = Cluster::up(&["--workers", "1"]);
    let check = |status: u16, body: &serde_json::Value, want: u16| {
        assert_eq!(status, want, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert!(body["error"]["type"].is_string(), "{body}");
    };
    let (s, b) = c.post_raw("/v1/chat/completions", "{not json");
    check(s, &b, 400);
    let (s, _, b) = c.post(
        "/v1/chat/completions",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    );
    check(s, &b, 404);
    assert_eq!(b["error"]["code"], "model_not_found");
    let (s, _, b) = c.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": []}),
        &[],
    );
    check(s, &b, 400);
    let (s, _, b) = c.post(
        "/v1/chat/completions",
        &chat(json!([{"role": "user", "content": filler(3, 9000)}]), 4),
        &[],
    );
    check(s, &b, 400);
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    let mut neg = chat(json!([{"role": "user", "content": "hi"}]), 1);
    neg["max_tokens"] = json!(-5);
    let (s, _, b) = c.post("/v1/chat/completions", &neg, &[]);
    check(s, &b, 400);
    assert_eq!(b["error"]["param"], "max_tokens");
    let (s, _, b) = c.post(
        "/v1/chat/completions",
        &chat(json!([{"role": "user", "content": "hi"}]), 1),
        &[("x-kvfleet-policy", "fastest")],
    );
    check(s, &b, 400);
    let (s, _, b) = c.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": [1, 2, 99999], "max_tokens": 1}),
        &[],
    );
    check(s, &b, 400);
    // Still serving.
    let (s, _, b) = c.post(
        "/v1/chat/completions",
        &chat(json!([{"role": "user", "content": "hi"}]), 2),
        &[],
    );
    assert_eq!(s, 200, "{b}");
}

#[test]
fn stop_strings_over_the_bounds_are_a_400_on_every_front_end() {
    let c = Cluster::up(&["--workers", "1"]);
    let messages = json!([{"role": "user", "content": "hi"}]);
    let five = json!(["a", "b", "c", "d", "e"]);
    let long = json!(["x".repeat(257)]);
    let with_stop = |mut body: serde_json::Value, stop: &serde_json::Value| {
        body["stop"] = stop.clone();
        body
    };
    let bodies = [
        ("/v1/chat/completions", chat(messages.clone(), 2)),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hello", "max_tokens": 2}),
        ),
        (
            "/v1/forks",
            json!({"model": "tiny", "messages": messages, "directives": ["one", "two"],
                   "max_tokens": 2}),
        ),
    ];
    for (path, body) in &bodies {
        for stop in [&five, &long] {
            let (s, _, b) = c.post(path, &with_stop(body.clone(), stop), &[]);
            assert_eq!(s, 400, "{path} with stop {stop}: {b}");
            assert_eq!(b["error"]["param"], "stop", "{path}: {b}");
            assert_eq!(b["error"]["type"], "invalid_request_error", "{path}: {b}");
        }
        // At the bounds: four stops of 256 bytes are served.
        let at_bound = json!(vec!["\u{1}".repeat(256); 4]);
        let (s, _, b) = c.post(path, &with_stop(body.clone(), &at_bound), &[]);
        assert_eq!(s, 200, "{path} at the bounds: {b}");
    }
}

#[test]
fn unknown_fields_are_a_400_naming_them_and_extensions_are_served() {
    let c = Cluster::up(&["--workers", "1"]);
    let messages = json!([{"role": "user", "content": "hi"}]);
    let bodies = [
        ("/v1/chat/completions", chat(messages.clone(), 2)),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hello", "max_tokens": 2}),
        ),
        (
            "/v1/forks",
            json!({"model": "tiny", "messages": messages, "directives": ["one", "two"],
                   "max_tokens": 2}),
        ),
    ];
    for (path, body) in &bodies {
        let mut unknown = body.clone();
        unknown["frobnicate"] = json!(1);
        let (s, _, b) = c.post(path, &unknown, &[]);
        assert_eq!(s, 400, "{path}: {b}");
        assert_eq!(b["error"]["type"], "invalid_request_error", "{path}: {b}");
        assert_eq!(b["error"]["param"], "frobnicate", "{path}: {b}");
        assert_eq!(
            b["error"]["message"], "Unrecognized request argument supplied: frobnicate",
            "{path}: {b}"
        );
        // kvfleet's own extensions are not unknown.
        let mut ext = body.clone();
        ext["cache_salt"] = json!("salt");
        ext["ignore_eos"] = json!(true);
        ext["top_k"] = json!(5);
        ext["user"] = json!("u1");
        ext["stream_options"] = json!({"include_usage": false});
        let (s, _, b) = c.post(path, &ext, &[]);
        assert_eq!(s, 200, "{path} with extensions: {b}");
    }
    let mut status = chat(messages.clone(), 2);
    status["agent_status"] = json!({"step": 1});
    status["status_mode"] = json!("replace");
    let (s, _, b) = c.post("/v1/chat/completions", &status, &[]);
    assert_eq!(s, 200, "status-bar extension: {b}");
}

#[test]
fn logit_bias_and_penalties_reach_the_sampler_and_bad_values_are_a_400() {
    let c = Cluster::up(&["--workers", "1"]);
    // The tiny model's tokens are bytes: +100 on `A` (65) makes greedy write only `A`.
    let mut body = json!({"model": "tiny", "prompt": "hello", "max_tokens": 6,
                          "temperature": 0, "ignore_eos": true, "logit_bias": {"65": 100}});
    let (s, _, b) = c.post("/v1/completions", &body, &[]);
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], "AAAAAA", "{b}");
    // Penalties at their bounds are served.
    body["frequency_penalty"] = json!(2);
    body["presence_penalty"] = json!(-2);
    let (s, _, b) = c.post("/v1/completions", &body, &[]);
    assert_eq!(s, 200, "{b}");
    for (field, value) in [
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3)),
        ("logit_bias", json!({"65": 101})),
        ("logit_bias", json!({"not-a-token": 1})),
        ("logit_bias", json!({"99999999": 1})),
    ] {
        let mut bad = body.clone();
        bad[field] = value;
        let (s, _, b) = c.post("/v1/completions", &bad, &[]);
        assert_eq!(s, 400, "{field}: {b}");
        assert_eq!(b["error"]["type"], "invalid_request_error", "{b}");
    }
}

#[test]
fn completions_accept_text_and_token_ids() {
    let c = Cluster::up(&["--workers", "1"]);
    let text = "The quick brown fox jumps over the lazy dog";
    let ids: Vec<u32> = text.bytes().map(u32::from).collect();
    let (s, _, a) = c.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": text, "max_tokens": 5, "temperature": 0}),
        &[],
    );
    assert_eq!(s, 200, "{a}");
    let (s, _, b) = c.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0}),
        &[],
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(b["usage"]["prompt_tokens"], ids.len());
    assert_eq!(a["object"], "text_completion");
    let models = c.get("/v1/models");
    assert_eq!(models["data"][0]["id"], "tiny");
}

#[test]
fn metrics_are_exposed_in_prometheus_format() {
    let c = Cluster::up(&["--workers", "2"]);
    let body = chat(json!([{"role": "user", "content": filler(5, 100)}]), 2);
    for _ in 0..2 {
        let (s, _, _) = c.post("/v1/chat/completions", &body, &[]);
        assert_eq!(s, 200);
    }
    let text = c.get_text("/metrics");
    for name in [
        "kvfleet_requests_total{",
        "kvfleet_prompt_tokens_total{cached=\"true\"}",
        "kvfleet_router_decision_seconds_bucket{",
        "kvfleet_ttft_seconds_bucket",
        "kvfleet_router_worker_free_blocks{",
        "kvfleet_predicted_cached_tokens_total{",
    ] {
        assert!(text.contains(name), "missing {name} in /metrics");
    }
}

#[test]
fn a_fresh_cluster_exposes_its_rare_series_at_zero() {
    // Dashboards and alerts on fork groups, prefix breaks and peer pulls must read 0 on
    // a fresh deployment, not "No data" until the first fork, break or pull.
    let c = Cluster::up(&["--workers", "1"]);
    let text = c.get_text("/metrics");
    let value = |series: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    };
    let mut series = vec![
        "kvfleet_fork_group_requests_total{colocated=\"true\"}".to_string(),
        "kvfleet_fork_group_requests_total{colocated=\"false\"}".to_string(),
        "kvfleet_fork_group_colocation_ratio".to_string(),
    ];
    for reason in [
        "namespace_changed",
        "tools_reordered",
        "tools_changed",
        "system_prompt_changed",
        "message_edited",
        "history_truncated",
        "template_rendering",
    ] {
        series.push(format!(
            "kvfleet_prefix_breaks_total{{reason=\"{reason}\"}}"
        ));
    }
    // Peer pulls are on by default: their counters read 0 before the first pull.
    for name in [
        "kvfleet_worker_peer_pull_blocks_total",
        "kvfleet_worker_peer_pull_bytes_total",
        "kvfleet_worker_peer_pull_failures_total",
    ] {
        series.push(format!("{name}{{worker=\"worker-0\"}}"));
    }
    for s in &series {
        assert_eq!(value(s), Some(0.0), "{s} is not exposed at 0:\n{text}");
    }
}

#[test]
fn a_request_longer_than_the_pool_ends_with_length_and_the_worker_keeps_serving() {
    // 40 blocks of 16 tokens: 640 tokens of KV. The request asks for 3000 more and
    // never stops on EOS; it used to preempt and re-admit itself forever.
    let c = Cluster::up(&["--workers", "1", "--num-blocks", "40"]);
    let mut big = chat(json!([{"role": "user", "content": filler(9, 100)}]), 3000);
    big["ignore_eos"] = json!(true);
    let t = std::time::Instant::now();
    let (s, _, b) = c.post("/v1/chat/completions", &big, &[]);
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["finish_reason"], "length", "{b}");
    let total = b["usage"]["total_tokens"].as_u64().unwrap_or(0);
    assert!(
        total > 100 && total <= 640,
        "the pool holds 640 tokens; usage {b}"
    );
    eprintln!("FIGURE pool overflow ended after {:?}", t.elapsed());
    let t = std::time::Instant::now();
    let small = chat(json!([{"role": "user", "content": "hello"}]), 2);
    let (s, _, b) = c.post("/v1/chat/completions", &small, &[]);
    assert_eq!(s, 200, "{b}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "the next request took {:?}",
        t.elapsed()
    );
}
