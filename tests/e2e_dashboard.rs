//! The router's `/dashboard` in real headless Chromium (Debian's `chromium`, driven by
//! tests/browser/dashboard.mjs with playwright-core; scripts/test.sh installs both),
//! against `kvfleet up --workers 3` while this test sends traffic.
//!
//! It checks what the page shows, read from its DOM: the page loads and keeps polling
//! (its update counter and newest decision number both grow between samples), the
//! decision feed lists this test's own requests on the workers that served them
//! (matched by request id and `x-kvfleet-worker`), a worker's hit ratio is above 0,
//! and the heat map puts each of the test's prefix groups on the worker that served
//! it. Then it stops the router and checks that the page says so: the counter stops
//! and `data-state` turns to `error`. A page that stops updating fails it.
//!
//! `KVFLEET_DASHBOARD_SCREENSHOT=path` keeps the screenshot taken under traffic
//! (scripts/dashboard-screenshot.sh writes docs/dashboard.png this way).

mod support;

use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{chat, filler, Cluster};

/// One request the test sent, as its response described it.
#[derive(Clone, Debug)]
struct Sent {
    request_id: String,
    worker: String,
    label: String,
    cached: u64,
}

const SESSIONS: [&str; 5] = [
    "dash-agent-a",
    "dash-agent-b",
    "dash-agent-c",
    "dash-agent-d",
    "dash-agent-e",
];
const FORK_GROUP: &str = "dash-fork-1";

/// Sends round after round of requests until `stop`: five sessions and one fork
/// group, each with its own long system prompt repeated turn after turn (so later
/// turns hit the cache), and one one-off prompt per round (a cache miss).
fn traffic(url: String, stop: Arc<AtomicBool>, sent: Arc<Mutex<Vec<Sent>>>) {
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let mut turn = 0u32;
    while !stop.load(Ordering::Relaxed) {
        for (g, label) in SESSIONS.iter().chain([&FORK_GROUP, &"one-off"]).enumerate() {
            let system = if *label == "one-off" {
                filler(50_000 + turn, 300)
            } else {
                filler(7000 + g as u32, 700)
            };
            let body = chat(
                json!([
                    {"role": "system", "content": system},
                    {"role": "user", "content": format!("turn {turn}: {}", filler(turn, 40))},
                ]),
                2,
            );
            let mut req = http.post(format!("{url}/v1/chat/completions")).json(&body);
            if *label == FORK_GROUP {
                req = req.header("x-kvfleet-fork-group", *label);
            } else if *label != "one-off" {
                req = req.header("x-kvfleet-session", *label);
            }
            let Ok(resp) = req.send() else {
                continue;
            };
            let worker = resp
                .headers()
                .get("x-kvfleet-worker")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let Ok(v) = resp.json::<Value>() else {
                continue;
            };
            let (Some(worker), Some(id)) = (worker, v["id"].as_str()) else {
                continue;
            };
            sent.lock().unwrap().push(Sent {
                request_id: id.trim_start_matches("chatcmpl-").to_string(),
                worker,
                label: label.to_string(),
                cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            });
        }
        turn += 1;
        // Steady, not flat out: the router, three workers and Chromium share 2 cores in CI.
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn phase(line: &str, tag: &str) -> Value {
    let text = line
        .strip_prefix(tag)
        .unwrap_or_else(|| panic!("expected {tag}, got {line:?}"));
    serde_json::from_str(text.trim()).expect("phase json")
}

fn num(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn the_dashboard_shows_live_routing_in_headless_chromium() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let browser_dir = root.join("tests/browser");
    assert!(
        browser_dir.join("node_modules/playwright-core").is_dir(),
        "playwright-core is missing: run `npm ci` in tests/browser (scripts/test.sh does)"
    );
    let chromium = std::env::var("KVFLEET_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "no Chromium at {chromium}: apt-get install chromium (scripts/test.sh does)"
    );

    let mut cluster = Cluster::up(&["--workers", "3"]);
    let html = cluster.get_text("/dashboard");
    assert!(html.contains("live cache map"), "not the dashboard page");

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let driver = {
        let (url, stop, sent) = (cluster.url.clone(), stop.clone(), sent.clone());
        std::thread::spawn(move || traffic(url, stop, sent))
    };
    // A first round before the page opens, so every group is on the map.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while sent.lock().unwrap().len() < 8 {
        assert!(
            std::time::Instant::now() < deadline,
            "traffic never got going"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let shot_dir = tempfile::tempdir().expect("tempdir");
    let shot = shot_dir.path().join("dashboard.png");
    let mut node = Command::new("node")
        .arg(browser_dir.join("dashboard.mjs"))
        .args([
            cluster.url.as_str(),
            shot.to_str().expect("utf-8 path"),
            "6000",
        ])
        .env("KVFLEET_CHROMIUM", &chromium)
        .current_dir(&browser_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn node");
    let mut out = BufReader::new(node.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("phase 1");
    let p1 = phase(&line, "PHASE1 ");

    stop.store(true, Ordering::Relaxed);
    driver.join().expect("traffic thread");
    let sent: Vec<Sent> = sent.lock().unwrap().clone();
    if let Ok(keep) = std::env::var("KVFLEET_DASHBOARD_SCREENSHOT") {
        std::fs::copy(&shot, root.join(&keep)).expect("keep the screenshot");
    }
    assert!(
        std::fs::metadata(&shot).expect("screenshot").len() > 10_000,
        "the screenshot is empty"
    );

    // The page stops hearing from a router that is gone.
    cluster.kill();
    let mut stdin = node.stdin.take().expect("stdin");
    writeln!(stdin, "stopped").expect("tell the driver");
    line.clear();
    out.read_line(&mut line).expect("phase 2");
    let p2 = phase(&line, "PHASE2 ");
    assert!(
        node.wait().expect("node").success(),
        "the browser driver failed"
    );

    let samples = p1["samples"].as_array().expect("samples");
    assert!(
        p1["errors"].as_array().expect("errors").is_empty(),
        "page errors: {}",
        p1["errors"]
    );
    let first = &samples[0];
    let last = samples.last().expect("a sample");
    assert!(first["title"].as_str().unwrap_or("").contains("kvfleet"));
    for s in samples {
        assert_eq!(
            s["state"], "ok",
            "the page could not poll: {}",
            s["updatedText"]
        );
    }

    // Live: the counter grows every sample or two, and so does the newest decision
    // the page shows, while traffic runs.
    let updates: Vec<u64> = samples.iter().map(|s| num(&s["updates"])).collect();
    assert!(
        updates.windows(2).all(|w| w[1] >= w[0]),
        "update counter went back: {updates:?}"
    );
    assert!(
        updates.last().unwrap() - updates[0] >= 4,
        "the page polled only {updates:?} over ~6 s"
    );
    // No stall: any two samples 3 s apart saw at least one more update.
    for (i, a) in samples.iter().enumerate() {
        if let Some(b) = samples[i..]
            .iter()
            .find(|b| num(&b["t"]) >= num(&a["t"]) + 3000)
        {
            assert!(
                num(&b["updates"]) > num(&a["updates"]),
                "the page stopped updating for 3 s: {updates:?}"
            );
        }
    }
    let seqs: Vec<u64> = samples.iter().map(|s| num(&s["lastSeq"])).collect();
    assert!(
        seqs.last().unwrap() > &(seqs[0] + 4),
        "newest decision did not move under traffic: {seqs:?}"
    );
    let top = |s: &Value| s["feed"][0]["requestId"].as_str().unwrap_or("").to_string();
    assert_ne!(top(first), top(last), "the feed did not change");
    let text = last["updatedText"].as_str().unwrap_or("");
    assert!(
        text.contains(&format!("update #{}", num(&last["updates"]))),
        "{text}"
    );

    // The feed lists this test's requests, on the worker each response named.
    let by_id: HashMap<&str, &Sent> = sent.iter().map(|s| (s.request_id.as_str(), s)).collect();
    let feed = last["feed"].as_array().expect("feed");
    assert!(!feed.is_empty());
    let mut matched = 0;
    for row in feed {
        let rid = row["requestId"].as_str().unwrap_or("");
        if let Some(s) = by_id.get(rid) {
            assert_eq!(row["worker"], s.worker.as_str(), "request {rid}");
            if row["cached"].is_u64() {
                assert_eq!(num(&row["cached"]), s.cached, "cached tokens of {rid}");
            }
            matched += 1;
        }
    }
    assert!(
        matched >= 8,
        "only {matched} of the feed's rows are this test's requests"
    );
    assert!(
        feed.iter().any(|r| r["forkGroup"] == FORK_GROUP),
        "no fork-group decision in the feed"
    );

    // Hit ratios: repeated system prompts are served from cache.
    let workers = last["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 3);
    assert!(
        workers
            .iter()
            .any(|w| w["hitRatio"].as_f64().unwrap_or(0.0) > 0.3),
        "no worker shows cache hits: {workers:?}"
    );

    // Heat map: each group's row holds blocks on the worker that served it most.
    let heat = last["heat"].as_array().expect("heat");
    for label in SESSIONS.iter().chain([&FORK_GROUP]) {
        let mut served: BTreeMap<&str, usize> = BTreeMap::new();
        for s in sent.iter().filter(|s| s.label == *label) {
            *served.entry(s.worker.as_str()).or_default() += 1;
        }
        let (home, _) = served
            .iter()
            .max_by_key(|(_, n)| **n)
            .unwrap_or_else(|| panic!("no responses for {label}"));
        let row = heat
            .iter()
            .find(|r| r["label"] == *label)
            .unwrap_or_else(|| panic!("{label} is not on the heat map: {heat:?}"));
        let held = num(&row["cells"][*home]);
        assert!(held >= 8, "{label}: {home} holds {held} blocks on the map");
    }

    // And once the router is gone the page says so and stops counting.
    let after = p2["samples"].as_array().expect("samples");
    let end = after.last().expect("a sample");
    assert_eq!(
        end["state"], "error",
        "the page did not notice the router was gone"
    );
    let down: Vec<u64> = after
        .iter()
        .skip_while(|s| s["state"] != "error")
        .map(|s| num(&s["updates"]))
        .collect();
    assert!(
        down.len() >= 2 && down.iter().all(|u| *u == down[0]),
        "updates kept counting with no router: {down:?}"
    );
}
