//! Separate processes: two `kvfleet worker`s and a `kvfleet router`, real gRPC between
//! them. A worker killed with SIGKILL loses no request that had not started on it.

mod support;

use serde_json::json;
use std::time::{Duration, Instant};
use support::{chat, filler, http_client, start, start_worker};

#[test]
fn a_killed_worker_loses_no_request_that_had_not_started() {
    let w0 = start_worker("w0");
    let w1 = start_worker("w1");
    let workers = format!("{},{}", w0.addr, w1.addr);
    let router = start(
        &["router", "--http", "127.0.0.1:0", "--workers", &workers],
        "http://",
    );
    let url = format!("http://{}", router.addr);
    let http = http_client();
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

/// A router polls each worker's load, every 100 ms by default. A poll taken while a
/// request ran used to show the worker busy until the next poll, steering requests
/// away from an idle worker (two routers sending a herd at once split it unevenly).
/// The worker now pushes its load with its KV events: with polls ten minutes apart,
/// a router whose poll caught a request running sees the worker idle as soon as the
/// request has ended.
#[test]
fn a_router_sees_work_end_between_polls_from_the_load_the_worker_pushes() {
    let w0 = start_worker("w0");
    let router = start(
        &[
            "router",
            "--http",
            "127.0.0.1:0",
            "--workers",
            &w0.addr,
            "--load-poll-interval-ms",
            "600000",
        ],
        "http://",
    );
    let url = format!("http://{}", router.addr);
    let http = http_client();
    let get = |path: &str| -> serde_json::Value {
        http.get(format!("{url}{path}"))
            .send()
            .and_then(|r| r.json())
            .unwrap_or_default()
    };
    // `GET /fleet` polls every worker: poll until one poll finds a request running.
    let mut caught = None;
    for attempt in 0..5u32 {
        let body = chat(
            json!([{"role": "user", "content": filler(40 + attempt, 1500)}]),
            64,
        );
        let sender = {
            let (http, url) = (http.clone(), url.clone());
            std::thread::spawn(move || {
                http.post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            })
        };
        // No poll after the one that found it running.
        while caught.is_none() && !sender.is_finished() {
            let l = get("/fleet")["workers"][0]["load"].clone();
            let busy = l["running"].as_u64().unwrap_or(0) + l["waiting"].as_u64().unwrap_or(0);
            if busy > 0 {
                caught = Some(l);
            }
        }
        assert_eq!(sender.join().expect("sender"), 200);
        if caught.is_some() {
            break;
        }
    }
    let caught = caught.expect("a poll found a request running in 5 attempts");
    // The request has ended; the router has not polled since.
    let t = Instant::now();
    let routing_load = || get("/dashboard/state?decisions=0")["workers"][0]["routing_load"].clone();
    loop {
        let l = routing_load();
        if l["active_sequences"] == 0 && l["prefill_backlog_tokens"] == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the router still sees w0 busy {:?} after its request ended: {l} (its last poll: {caught})",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "w0 idle in the router's view {:?} after the request ended (its poll had caught it running: {caught})",
        t.elapsed()
    );
}
