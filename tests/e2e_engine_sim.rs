//! The simulated engine as real processes: four `kvfleet worker --engine sim` (the real
//! gRPC service, scheduler, block pool, prefix cache and KV events; a cost model instead
//! of the model's compute) behind a real `kvfleet router`. Requests sharing a prefix
//! land on one worker and the repeats are served from its cache.

mod support;

use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;
use support::{filler, post_json, start};

fn cost_model_file() -> String {
    format!(
        "{}/crates/kvfleet-bench/cost-models/h200-llama8b.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn sim_workers_serve_and_keep_shared_prefixes_together() {
    let cost = cost_model_file();
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let id = format!("sim{i}");
            start(
                &[
                    "worker",
                    "--grpc",
                    "127.0.0.1:0",
                    "--worker-id",
                    &id,
                    "--engine",
                    "sim",
                    "--cost-model",
                    &cost,
                    "--num-blocks",
                    "512",
                ],
                "grpc://",
            )
        })
        .collect();
    for w in &workers {
        assert!(w.line.contains("model tiny"), "{}", w.line);
    }
    let addrs: Vec<&str> = workers.iter().map(|w| w.addr.as_str()).collect();
    let router = start(
        &[
            "router",
            "--http",
            "127.0.0.1:0",
            "--workers",
            &addrs.join(","),
        ],
        "http://",
    );
    let url = format!("http://{}/v1/chat/completions", router.addr);
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let send = |system: &str, user: &str| {
        let body = json!({
            "model": "tiny",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": 5,
            "temperature": 0,
        });
        let (status, worker, v) = post_json(&http, &url, &body, &[]);
        assert_eq!(status, 200, "{v}");
        (worker.expect("x-kvfleet-worker"), v)
    };

    let mut served_by: HashMap<String, usize> = HashMap::new();
    for group in 0..3u32 {
        // ~40 blocks of shared system prompt per group, then a per-request question.
        let system = filler(100 + group, 640);
        let (first, v) = send(&system, "question zero");
        assert_eq!(
            v["usage"]["completion_tokens"], 5,
            "max_tokens ends it: {v}"
        );
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content");
        assert!(
            text.len() == 5 && text.bytes().all(|b| b.is_ascii_lowercase()),
            "the simulator's deterministic output: {text:?}"
        );
        *served_by.entry(first.clone()).or_default() += 1;
        for (i, user) in ["question one", "question zero"].iter().enumerate() {
            let (w, v) = send(&system, user);
            assert_eq!(w, first, "group {group} repeat {i} stays with its prefix");
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            assert!(
                cached >= 600,
                "group {group} repeat {i} reuses the shared prefix: {v}"
            );
        }
    }
    eprintln!("groups per sim worker: {served_by:?}");
}

#[test]
fn engine_flags_are_checked() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(["worker", "--model", "tiny", "--engine", "mocker"])
        .output()
        .expect("run kvfleet");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model") && err.contains("sim"), "{err}");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(["worker", "--grpc", "127.0.0.1:0", "--model", "tiny"])
        .args(["--cost-model", &cost_model_file()])
        .output()
        .expect("run kvfleet");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--engine sim"), "{err}");
}
