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
//! Its workers have no KV tiers, and the page's "KV tiers" panel says so. A second
//! case starts one worker with a 64-block pool and a host tier, pushes a prompt out
//! of the pool and sends it again (promoted back from host memory), and checks that
//! the panel shows the host hits and the bytes demoted and promoted that the worker's
//! own `/metrics` counted.
//!
//! `KVFLEET_DASHBOARD_SCREENSHOT=path` keeps the screenshot taken under traffic
//! (scripts/dashboard-screenshot.sh writes docs/dashboard.png this way).

mod support;

use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{chat, filler, Cluster};

/// One browser case at a time: both cases start a cluster and Chromium, and the live
/// one's "no stall" check needs the 2 CI cores to itself.
static BROWSER: Mutex<()> = Mutex::new(());

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

/// The browser driver's directory and the Chromium binary, checked to exist.
fn browser() -> (PathBuf, String) {
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
    (browser_dir, chromium)
}

/// Starts tests/browser/dashboard.mjs on `url`'s dashboard, sampling for `sample_ms`.
fn open_dashboard(url: &str, shot: &Path, sample_ms: u64) -> (Child, BufReader<ChildStdout>) {
    let (browser_dir, chromium) = browser();
    let mut node = Command::new("node")
        .arg(browser_dir.join("dashboard.mjs"))
        .args([
            url,
            shot.to_str().expect("utf-8 path"),
            &sample_ms.to_string(),
        ])
        .env("KVFLEET_CHROMIUM", &chromium)
        .current_dir(&browser_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn node");
    let out = BufReader::new(node.stdout.take().expect("stdout"));
    (node, out)
}

#[test]
fn the_dashboard_shows_live_routing_in_headless_chromium() {
    let _one = BROWSER.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    browser();

    // No peer pulls: the router pulls a prefix to end a wait longer than a cold start,
    // which a slow CI runner's queues can cause, and the KV tiers table below must
    // stay off (the host-tier test covers it on).
    let mut cluster = Cluster::up(&["--workers", "3", "--peer-pull-min-blocks", "0"]);
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
    let (mut node, mut out) = open_dashboard(&cluster.url, &shot, 6000);
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

    // None of these workers has a KV tier, and pulls are off.
    assert_eq!(last["tiers"], "off", "a KV tiers table without tiers");
    assert!(
        last["tiersText"]
            .as_str()
            .unwrap_or("")
            .contains("no tiers"),
        "{}",
        last["tiersText"]
    );
    assert_eq!(last["tierRows"].as_array().map(Vec::len), Some(0));

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

/// Sum of the samples of `name` whose labels contain `label` (all, if empty).
fn metric(text: &str, name: &str, label: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The page's `bytes()`: binary units, two decimals under 10, one under 100.
fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut x, mut i) = (n as f64, 0);
    while x >= 1024.0 && i < units.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        let d = if x >= 100.0 {
            0
        } else if x >= 10.0 {
            1
        } else {
            2
        };
        format!("{x:.d$} {}", units[i])
    }
}

#[test]
fn the_dashboard_shows_host_tier_hits_and_bytes_moved() {
    let _one = BROWSER.lock().unwrap_or_else(|e| e.into_inner());
    browser();
    // As tests/e2e_kv_tiers.rs: a 64-block pool and a host tier below it.
    let mut c = Cluster::up(&[
        "--workers",
        "1",
        "--num-blocks",
        "64",
        "--host-cache-gib",
        "0.25",
    ]);
    let ask = |seed: u32, bytes: usize| {
        let body = chat(json!([{"role": "user", "content": filler(seed, bytes)}]), 1);
        let (status, _, r) = c.post("/v1/chat/completions", &body, &[]);
        assert_eq!(status, 200, "{r}");
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens")
    };
    // ~40 blocks, then three prompts of ~55 blocks that evict all of it, then the
    // first again: promoted from host memory instead of recomputed.
    let mut cached = ask(1, 640);
    for seed in 2..5 {
        cached += ask(seed, 880);
    }
    let warm = ask(1, 640);
    cached += warm;
    assert!(warm >= 600, "only {warm} tokens cached after eviction");

    // The worker is idle now: its counters hold still. Wait until the router's load
    // poll has caught up with them.
    let m = c.get_text("/metrics");
    let promoted_blocks = metric(
        &m,
        "kvfleet_worker_tier_promoted_blocks_total",
        "tier=\"host\"",
    );
    let demoted_blocks = metric(&m, "kvfleet_worker_tier_demoted_blocks_total", "");
    let promoted_bytes = metric(
        &m,
        "kvfleet_worker_tier_bytes_moved_total",
        "direction=\"promote\"",
    );
    let demoted_bytes = metric(
        &m,
        "kvfleet_worker_tier_bytes_moved_total",
        "direction=\"demote\"",
    );
    assert!(
        promoted_blocks >= 30,
        "host promotions in /metrics: {promoted_blocks}"
    );
    assert!(
        demoted_bytes > 0 && promoted_bytes > 0,
        "{demoted_bytes} / {promoted_bytes}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let block_size = loop {
        let s = c.get("/dashboard/state");
        let k = &s["kv_tiers"];
        if k["bytes_moved"]["promoted"] == promoted_bytes
            && k["hits"]["device"].as_u64().unwrap_or(0) + k["hits"]["host"].as_u64().unwrap_or(0)
                == cached
        {
            break num(&s["block_size"]);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the router's view never caught up with the worker: {k} vs /metrics promote {promoted_bytes}, {cached} cached"
        );
        std::thread::sleep(Duration::from_millis(100));
    };

    let shot_dir = tempfile::tempdir().expect("tempdir");
    let shot = shot_dir.path().join("dashboard.png");
    let (mut node, mut out) = open_dashboard(&c.url, &shot, 1000);
    let mut line = String::new();
    out.read_line(&mut line).expect("phase 1");
    let p1 = phase(&line, "PHASE1 ");
    c.kill();
    let mut stdin = node.stdin.take().expect("stdin");
    writeln!(stdin, "done").expect("tell the driver");
    line.clear();
    out.read_line(&mut line).expect("phase 2");
    assert!(
        node.wait().expect("node").success(),
        "the browser driver failed"
    );
    assert!(
        p1["errors"].as_array().expect("errors").is_empty(),
        "page errors: {}",
        p1["errors"]
    );

    // What the page shows, read from its DOM.
    let last = p1["samples"]
        .as_array()
        .and_then(|s| s.last())
        .expect("a sample");
    assert_eq!(last["state"], "ok");
    assert_eq!(last["tiers"], "on", "{}", last["tiersText"]);
    let rows = last["tierRows"].as_array().expect("tier rows");
    let ids: Vec<&str> = rows
        .iter()
        .map(|r| r["id"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(ids.len(), 2, "the fleet's row and the worker's: {ids:?}");
    assert_eq!(ids[0], "fleet");
    let (fleet, worker) = (&rows[0], &rows[1]);
    for row in [fleet, worker] {
        assert_eq!(num(&row["tiered"]), 1, "{row}");
        let hits = &row["hits"];
        let host = num(&hits["host"]);
        // Every promoted host block's tokens were reported cached, and nothing else
        // came from a lower tier: the rest of the cached tokens were device hits.
        assert_eq!(host, promoted_blocks * block_size, "{row}");
        assert!(
            host > 0 && host <= warm,
            "{host} host hits, {warm} cached on the warm turn"
        );
        assert_eq!((num(&hits["disk"]), num(&hits["peer"])), (0, 0));
        assert_eq!(num(&hits["device"]) + host, cached, "{row}");
        assert!(
            row["hostHitsText"]
                .as_str()
                .unwrap_or("")
                .starts_with(&host.to_string()),
            "{row}"
        );
        // Bytes moved: the worker's own counters, in human units.
        let bytes = &row["bytes"];
        assert_eq!(num(&bytes["demoted"]), demoted_bytes, "{row}");
        assert_eq!(num(&bytes["promoted"]), promoted_bytes, "{row}");
        assert_eq!(num(&bytes["peer"]), 0);
        assert_eq!(num(&row["promotedHostBlocks"]), promoted_blocks);
        assert_eq!(num(&row["demotedBlocks"]), demoted_blocks);
        assert_eq!(
            row["bytesText"]["demoted"],
            human_bytes(demoted_bytes).as_str()
        );
        assert_eq!(
            row["bytesText"]["promoted"],
            human_bytes(promoted_bytes).as_str()
        );
        assert_eq!(row["bytesText"]["peer"], "0 B");
    }
}
