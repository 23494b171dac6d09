//! Separate processes: two `kvfleet worker`s and a `kvfleet router`, real gRPC between
//! them. A worker killed with SIGKILL loses no request that had not started on it.

mod support;

use serde_json::json;
use std::time::{Duration, Instant};
use support::{chat, filler, start};

#[test]
fn a_killed_worker_loses_no_request_that_had_not_started() {
    let w0 = start(
        &["worker", "--grpc", "127.0.0.1:0", "--worker-id", "w0"],
        "grpc://",
    );
    let w1 = start(
        &["worker", "--grpc", "127.0.0.1:0", "--worker-id", "w1"],
        "grpc://",
    );
    let workers = format!("{},{}", w0.addr, w1.addr);
    let router = start(
        &["router", "--http", "127.0.0.1:0", "--workers", &workers],
        "http://",
    );
    let url = format!("http://{}", router.addr);
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let send = |i: u32| {
        let body = chat(json!([{"role": "user", "content": filler(i, 300)}]), 2);
        // Round-robin sends every other request to each worker, so requests keep
        // targeting the killed one until the router notices, exercising the retry.
        let r = http
            .post(format!("{url}/v1/chat/completions"))
            .header("x-kvfleet-policy", "round-robin")
            .json(&body)
            .send()
            .expect("request");
        let status = r.status().as_u16();
        let worker = r
            .headers()
            .get("x-kvfleet-worker")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        (status, worker)
    };
    let mut seen = std::collections::HashSet::new();
    for i in 0..8 {
        let (s, w) = send(i);
        assert_eq!(s, 200);
        seen.extend(w);
    }
    assert_eq!(
        seen.len(),
        2,
        "both workers serve before the kill: {seen:?}"
    );

    // SIGKILL w0, then keep sending: every request is answered, by w1.
    let mut w0 = w0;
    w0.child.kill().expect("kill w0");
    let _ = w0.child.wait();
    let t = Instant::now();
    for i in 100..120 {
        let (s, w) = send(i);
        assert_eq!(s, 200, "request {i} after the kill");
        assert_eq!(w.as_deref(), Some("w1"));
    }
    eprintln!(
        "20 requests after SIGKILL of a worker: all answered in {:?}",
        t.elapsed()
    );
    let health: serde_json::Value = http
        .get(format!("{url}/health"))
        .send()
        .expect("health")
        .json()
        .expect("json");
    assert_eq!(health["healthy_workers"], 1, "{health}");
}
