//! Cross-worker prefix transfer between separate processes: two `kvfleet worker`s and
//! a `kvfleet router` with `--peer-pull-min-blocks`. A prompt served by one worker,
//! then sent to the other, is pulled over gRPC (`FetchBlocks`) instead of recomputed:
//! its usage reports it cached, and its answer is the cold one. A holder killed in
//! the middle of the transfer costs a recompute, never the request.

mod support;

use serde_json::json;
use std::time::Duration;
use support::{chat, filler, start, Proc};

struct Fleet {
    workers: Vec<Proc>,
    _router: Proc,
    url: String,
    http: reqwest::blocking::Client,
}

fn fleet(worker_extra: &[&str]) -> Fleet {
    let workers: Vec<Proc> = ["w0", "w1"]
        .iter()
        .map(|id| {
            let mut args = vec!["worker", "--grpc", "127.0.0.1:0", "--worker-id", id];
            args.extend_from_slice(worker_extra);
            start(&args, "grpc://")
        })
        .collect();
    let endpoints = format!("{},{}", workers[0].addr, workers[1].addr);
    let router = start(
        &[
            "router",
            "--http",
            "127.0.0.1:0",
            "--workers",
            &endpoints,
            "--peer-pull-min-blocks",
            "2",
        ],
        "http://",
    );
    let url = format!("http://{}", router.addr);
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    Fleet {
        workers,
        _router: router,
        url,
        http,
    }
}

impl Fleet {
    /// A round-robin request (so the second goes to the worker without the prefix):
    /// (worker, body).
    fn ask(&self, content: &str) -> (String, serde_json::Value) {
        let r = self
            .http
            .post(format!("{}/v1/chat/completions", self.url))
            .header("x-kvfleet-policy", "round-robin")
            .json(&chat(json!([{"role": "user", "content": content}]), 4))
            .send()
            .expect("request");
        assert_eq!(r.status().as_u16(), 200);
        let worker = r
            .headers()
            .get("x-kvfleet-worker")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        (worker, r.json().expect("json"))
    }

    /// Waits until the router's index has the first worker's blocks.
    fn settle(&self) {
        std::thread::sleep(Duration::from_millis(1000));
    }
}

fn cached(body: &serde_json::Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(u64::MAX)
}

#[test]
fn a_prefix_held_by_another_worker_is_pulled_not_recomputed() {
    let f = fleet(&[]);
    let text = filler(11, 700);
    let (w_first, first) = f.ask(&text);
    assert_eq!(cached(&first), 0);
    f.settle();
    let (w_second, second) = f.ask(&text);
    assert_ne!(w_first, w_second, "round-robin sent it to the other worker");
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let got = cached(&second);
    assert!(
        got * 10 >= prompt * 8,
        "{got} of {prompt} tokens cached on the worker that pulled them"
    );
    assert_eq!(
        first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"],
        "pulled K/V give the cold answer"
    );
}

#[test]
fn a_holder_killed_mid_transfer_costs_a_recompute_not_the_request() {
    // Whichever worker is asked for blocks dies after sending two of them.
    let mut f = fleet(&["--fault-exit-mid-fetch", "2"]);
    let text = filler(12, 700);
    let (w_first, first) = f.ask(&text);
    f.settle();
    let (w_second, second) = f.ask(&text);
    assert_ne!(w_first, w_second);
    assert_eq!(
        first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"],
        "the request is answered, and correctly"
    );
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(cached(&second) < prompt / 2, "most of it was recomputed");
    let holder = if w_first == "w0" { 0 } else { 1 };
    let exited = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        matches!(f.workers[holder].child.try_wait(), Ok(Some(_)))
    });
    assert!(exited, "the holder died in the transfer");
}
