//! The control plane end to end: a real etcd, a real Kafka-protocol broker (tansu),
//! three `kvfleet worker` and two `kvfleet router` processes.
//!
//! - Fork siblings sent alternately (and concurrently) to router 1 and router 2 all
//!   land on one worker: the first router to route the group places it with a
//!   compare-and-set, the other follows.
//! - Fork children with no header, and a herd behind one shared system prompt, sent
//!   through both routers: each agent's children on one worker (the prompt's anchor is
//!   placed with one compare-and-set), the herd spread (busiest ≤ 1.5 × the mean).
//! - Both routers converge to the same index from the KV event stream.
//! - SIGKILL a worker: no request that had not started is lost, and the lease's expiry
//!   (3 s here) removes it from both routers.
//! - Restart a router: a repeated request hits the cache as soon as it is back.
//! - `kvfleet trace export` turns the usage records into a trace, without text.

mod support;

use kvfleet_control::test_services::{EtcdServer, KafkaBroker};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{chat, filler, post_json, start, Proc};

struct Env {
    etcd: String,
    kafka: String,
    prefix: String,
}

impl Env {
    fn worker(&self, id: &str) -> Proc {
        start(
            &[
                "worker",
                "--grpc",
                "127.0.0.1:0",
                "--worker-id",
                id,
                "--etcd",
                &self.etcd,
                "--kafka",
                &self.kafka,
                "--topic-prefix",
                &self.prefix,
                "--kafka-session-timeout-ms",
                "2000",
                "--lease-ttl",
                "3",
            ],
            "grpc://",
        )
    }

    fn router(&self, id: &str) -> Proc {
        start(
            &[
                "router",
                "--http",
                "127.0.0.1:0",
                "--router-id",
                id,
                "--etcd",
                &self.etcd,
                "--kafka",
                &self.kafka,
                "--topic-prefix",
                &self.prefix,
                "--kafka-session-timeout-ms",
                "2000",
            ],
            "http://",
        )
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

fn get(router: &str, path: &str) -> Value {
    client()
        .get(format!("http://{router}{path}"))
        .send()
        .and_then(|r| r.json())
        .unwrap_or(Value::Null)
}

/// Sends a chat request; returns (status, worker, cached tokens).
fn send(router: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Option<String>, u64) {
    let url = format!("http://{router}/v1/chat/completions");
    let (status, worker, v) = post_json(&client(), &url, body, headers);
    if status != 200 {
        // The error body names the worker and what failed; a flake is diagnosable from CI.
        eprintln!("{router} answered {status}: {v}");
    }
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (status, worker, cached)
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while t.elapsed() < limit {
        if ok() {
            return t.elapsed();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}: not within {limit:?}");
}

fn healthy(router: &str) -> u64 {
    get(router, "/health")["healthy_workers"]
        .as_u64()
        .unwrap_or(0)
}

/// A router's `kvfleet_router_placements_total{step}` counter.
fn placements(router: &str, step: &str) -> u64 {
    let text = client()
        .get(format!("http://{router}/metrics"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default();
    let series = format!("kvfleet_router_placements_total{{step=\"{step}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A router's newest `n` routing decisions, newest first: worker, how placement took
/// part, workers tried, predicted and reported cached tokens.
fn recent_decisions(router: &str, n: usize) -> Vec<(String, String, u64, u64, u64)> {
    let s = get(router, &format!("/dashboard/state?decisions={n}"));
    s["decisions"]
        .as_array()
        .map(|ds| {
            ds.iter()
                .map(|d| {
                    (
                        d["worker"].as_str().unwrap_or_default().to_string(),
                        d["placement"].as_str().unwrap_or_default().to_string(),
                        d["attempts"].as_u64().unwrap_or(0),
                        d["predicted_cached_tokens"].as_u64().unwrap_or(0),
                        d["actual_cached_tokens"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// worker id → (active sequences, prefill backlog tokens): the load a router's policy
/// scores, without polling (`/fleet` would poll every worker).
fn load_view(router: &str) -> BTreeMap<String, (u64, u64)> {
    let s = get(router, "/dashboard/state?decisions=0");
    s["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .map(|w| {
                    let l = &w["routing_load"];
                    let n = |k: &str| l[k].as_u64().unwrap_or(0);
                    (
                        w["id"].as_str().unwrap_or_default().to_string(),
                        (n("active_sequences"), n("prefill_backlog_tokens")),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The workers a router tracks (healthy or not).
fn fleet_workers(router: &str) -> Vec<String> {
    get(router, "/fleet")["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .filter_map(|w| w["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// worker id → (cached blocks, last event seq) in a router's index.
fn index_view(router: &str) -> BTreeMap<String, (u64, u64)> {
    let f = get(router, "/fleet");
    f["router"]["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .map(|w| {
                    (
                        w["id"].as_str().unwrap_or_default().to_string(),
                        (
                            w["cached_blocks"].as_u64().unwrap_or(0),
                            w["last_event_seq"].as_u64().unwrap_or(0),
                        ),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn fork_child(group: u32, child: u32) -> Value {
    // A long shared prefix (history + the assistant turn), then a short directive.
    chat(
        json!([
            {"role": "system", "content": format!("agent {group}: {}", filler(group, 1500))},
            {"role": "user", "content": format!("sub-task {child}: {}", filler(1000 + child, 40))},
        ]),
        2,
    )
}

#[test]
fn two_routers_three_workers_on_etcd_and_kafka() {
    let etcd = EtcdServer::start();
    let mut broker = KafkaBroker::start();
    let env = Env {
        etcd: etcd.url(),
        kafka: broker.brokers(),
        prefix: format!("e2e{}.", std::process::id()),
    };
    let workers: Vec<Proc> = ["w0", "w1", "w2"].iter().map(|id| env.worker(id)).collect();
    let r1 = env.router("r1");
    let r2 = env.router("r2");
    for r in [&r1, &r2] {
        let took = wait_for("routers see 3 workers", Duration::from_secs(30), || {
            healthy(&r.addr) == 3
        });
        eprintln!("router {} sees 3 workers after {took:?}", r.addr);
    }

    // 1. Fork siblings, alternately to router 1 and router 2, concurrently.
    let mut placed = BTreeMap::new();
    for group in 0..3u32 {
        let name = format!("fork-{group}");
        let handles: Vec<_> = (0..6u32)
            .map(|child| {
                let router = if child % 2 == 0 { &r1.addr } else { &r2.addr }.clone();
                let name = name.clone();
                std::thread::spawn(move || {
                    send(
                        &router,
                        &fork_child(group, child),
                        &[("x-kvfleet-fork-group", &name)],
                    )
                })
            })
            .collect();
        let served: Vec<(u16, Option<String>, u64)> = handles
            .into_iter()
            .map(|h| h.join().expect("sibling thread"))
            .collect();
        let ws: HashSet<Option<String>> = served.iter().map(|s| s.1.clone()).collect();
        assert!(served.iter().all(|s| s.0 == 200), "{served:?}");
        assert_eq!(ws.len(), 1, "fork group {group} was split: {served:?}");
        let cached: u64 = served.iter().map(|s| s.2).sum();
        eprintln!("fork group {group}: 6 siblings on {ws:?}, {cached} cached prompt tokens");
        placed.insert(group, ws.into_iter().next().flatten().expect("worker"));
    }

    // 2. Both routers converge to the same index from the event stream.
    let took = wait_for("routers converge", Duration::from_secs(20), || {
        let (a, b) = (index_view(&r1.addr), index_view(&r2.addr));
        a.len() == 3 && a == b && a.values().any(|v| v.0 > 0)
    });
    eprintln!(
        "indexes converged after {took:?}: {:?}",
        index_view(&r1.addr)
    );

    // 2b. Siblings as an agent SDK sends them, with no fork header: 20 agents, each
    // forking 6 children whose prompts share the agent's ~1.9k-token history and
    // differ in a short directive, sent concurrently and alternately to both routers.
    // Every agent's children must land on one worker, which computes the shared
    // prefix once: at most one child per agent finds less than the history cached.
    let agent_child = |agent: u32, child: u32| {
        chat(
            json!([
                {"role": "system", "content": format!("agent {agent}: {}", filler(2_000 + agent, 1_900))},
                {"role": "user", "content": format!("sub-task {child}: {}", filler(3_000 + agent * 10 + child, 40))},
            ]),
            2,
        )
    };
    let mut one_worker = 0;
    let mut computed_once = 0;
    for agent in 0..20u32 {
        let handles: Vec<_> = (0..6u32)
            .map(|child| {
                let router = if child % 2 == 0 { &r1.addr } else { &r2.addr }.clone();
                let body = agent_child(agent, child);
                std::thread::spawn(move || send(&router, &body, &[]))
            })
            .collect();
        let served: Vec<(u16, Option<String>, u64)> = handles
            .into_iter()
            .map(|h| h.join().expect("child thread"))
            .collect();
        assert!(served.iter().all(|s| s.0 == 200), "{served:?}");
        let ws: HashSet<&Option<String>> = served.iter().map(|s| &s.1).collect();
        let cold = served.iter().filter(|s| s.2 < 1_800).count();
        one_worker += usize::from(ws.len() == 1);
        computed_once += usize::from(cold <= 1);
        if ws.len() != 1 || cold > 1 {
            eprintln!("agent {agent}: children on {ws:?}, {cold} computed the prefix: {served:?}");
            for r in [&r1, &r2] {
                eprintln!(
                    "  {} routed them: {:?}",
                    r.addr,
                    recent_decisions(&r.addr, 3)
                );
            }
        }
    }
    eprintln!(
        "header-less siblings through two routers: one worker in {one_worker} of 20 agents, prefix computed once in {computed_once} of 20"
    );
    assert_eq!((one_worker, computed_once), (20, 20));
    // Each agent's key was claimed once, by whichever router won it; the Prometheus
    // counter of both routers says so.
    let claimed: u64 = [&r1, &r2]
        .iter()
        .map(|r| placements(&r.addr, "claimed"))
        .sum();
    assert!(claimed >= 20, "{claimed} claims counted for 20 agents");

    // 2c. A herd: 12 sessions behind one shared ~1.2k-token system prompt, each with
    // ~1.5k tokens of its own, sent at one instant through both routers. The shared
    // prompt is cached on one worker first; the sessions must not all pile onto it.
    // They are released together from a barrier and decode long enough to overlap:
    // a session that starts after another one's prefill has ended would see an
    // accurately idler fleet, and the count per worker would then measure arrival
    // order, not piling (2 cores serve 12 requests of 2 tokens one after another).
    let herd_system = format!("shared agent rules: {}", filler(7_777, 1_200));
    let herd = |s: u32, max_tokens: u32| {
        chat(
            json!([
                {"role": "system", "content": herd_system},
                {"role": "user", "content": format!("session {s}: {}", filler(9_000 + s, 1_500))},
            ]),
            max_tokens,
        )
    };
    let (status, holder, _) = send(&r1.addr, &herd(999, 2), &[]);
    assert_eq!(status, 200);
    // For a failure's diagnosis: each router's view as the herd starts. Router 2 hears
    // that the holder's request ended from the load the holder pushes with its events.
    for r in [&r1, &r2] {
        eprintln!(
            "  {} sees (active sequences, prefill backlog) {:?}",
            r.addr,
            load_view(&r.addr)
        );
    }
    let release = std::sync::Arc::new(std::sync::Barrier::new(12));
    let herd_start = Instant::now();
    let handles: Vec<_> = (0..12u32)
        .map(|s| {
            let router = if s % 2 == 0 { &r1.addr } else { &r2.addr }.clone();
            let body = herd(s, 24);
            let release = release.clone();
            std::thread::spawn(move || {
                release.wait();
                let sent = herd_start.elapsed();
                let out = send(&router, &body, &[]);
                (out, sent, herd_start.elapsed())
            })
        })
        .collect();
    let mut per_worker: BTreeMap<String, usize> = BTreeMap::new();
    let mut herd_served = Vec::new();
    let mut last_sent = Duration::ZERO;
    let mut first_done = Duration::MAX;
    for h in handles {
        let ((status, w, cached), sent, done) = h.join().expect("herd thread");
        assert_eq!(status, 200);
        *per_worker.entry(w.clone().unwrap_or_default()).or_default() += 1;
        last_sent = last_sent.max(sent);
        first_done = first_done.min(done);
        herd_served.push((w, cached, sent.as_millis(), done.as_millis()));
    }
    let busiest = per_worker.values().copied().max().unwrap_or(0);
    eprintln!(
        "herd of 12 through two routers (system prompt cached on {holder:?}): {per_worker:?}, busiest {busiest} against a mean of 4"
    );
    eprintln!("  (worker, cached tokens, sent ms, done ms) by session: {herd_served:?}");
    for r in [&r1, &r2] {
        eprintln!("  {} routed: {:?}", r.addr, recent_decisions(&r.addr, 7));
    }
    // All 12 were in flight together: the last was sent before the first finished.
    assert!(
        last_sent < first_done,
        "the herd did not overlap: last sent at {last_sent:?}, first done at {first_done:?}"
    );
    assert!(busiest <= 6, "the herd piled up: {per_worker:?}");

    // 3. SIGKILL the worker holding fork group 0; keep sending through both routers.
    let victim = placed[&0].clone();
    let mut workers = workers;
    let vi = ["w0", "w1", "w2"]
        .iter()
        .position(|w| *w == victim)
        .expect("victim index");
    let mut killed = workers.remove(vi);
    killed.child.kill().expect("SIGKILL");
    let _ = killed.child.wait();
    let killed_at = Instant::now();
    for i in 0..12u32 {
        let router = if i % 2 == 0 { &r1.addr } else { &r2.addr };
        let body = chat(
            json!([{"role": "user", "content": filler(500 + i, 300)}]),
            2,
        );
        let (s, w, _) = send(router, &body, &[("x-kvfleet-policy", "round-robin")]);
        assert_eq!(s, 200, "request {i} after the kill was lost");
        assert_ne!(w.as_deref(), Some(victim.as_str()));
    }
    for r in [&r1, &r2] {
        wait_for(
            "the killed worker leaves routing",
            Duration::from_secs(3),
            || healthy(&r.addr) == 2,
        );
        // Membership (not just a failed poll) removes it: it leaves /fleet's list.
        wait_for(
            "lease expiry removes the killed worker",
            Duration::from_secs(10),
            || !fleet_workers(&r.addr).contains(&victim),
        );
    }
    eprintln!(
        "worker {victim} SIGKILLed: out of routing and removed from both routers' membership after {:?} (lease TTL 3 s)",
        killed_at.elapsed()
    );
    // Its placement was freed: the group is placed anew, again on one worker.
    let mut after = HashSet::new();
    for child in 10..14u32 {
        let router = if child % 2 == 0 { &r1.addr } else { &r2.addr };
        let (s, w, _) = send(
            router,
            &fork_child(0, child),
            &[("x-kvfleet-fork-group", "fork-0")],
        );
        assert_eq!(s, 200);
        after.insert(w);
    }
    assert_eq!(after.len(), 1, "fork-0 split after re-placement: {after:?}");
    assert!(!after.contains(&Some(victim.clone())));

    // 4. Restart router 1: a repeated request hits the cache right after it is back.
    let repeat = chat(json!([{"role": "user", "content": filler(4242, 1200)}]), 2);
    let (s, _, _) = send(&r1.addr, &repeat, &[]);
    assert_eq!(s, 200);
    let (_, _, cached_before) = send(&r1.addr, &repeat, &[]);
    assert!(cached_before > 0);
    drop(r1);
    let restarted = Instant::now();
    let r1 = env.router("r1");
    wait_for(
        "restarted router sees 2 workers",
        Duration::from_secs(30),
        || healthy(&r1.addr) == 2,
    );
    let back_after = restarted.elapsed();
    let (s, _, cached_after) = send(&r1.addr, &repeat, &[]);
    assert_eq!(s, 200);
    assert!(
        cached_after > 0,
        "no cache hit right after the router restart"
    );
    eprintln!(
        "router restarted: serving after {back_after:?}; repeated request cached {cached_after} tokens (before the restart: {cached_before})"
    );
    broker.assert_alive();

    // 5. The usage records as a trace.
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("trace.jsonl");
    let status = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args([
            "trace",
            "export",
            "--kafka",
            &env.kafka,
            "--topic-prefix",
            &env.prefix,
        ])
        .args(["--from-beginning", "--idle-ms", "2000", "--out"])
        .arg(&out)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .status()
        .expect("trace export");
    assert!(status.success());
    let text = std::fs::read_to_string(&out).expect("trace");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("trace line"))
        .collect();
    // 18 siblings + 12 after the kill + 4 re-placed + 3 repeats (the killed router may
    // not have published its last records).
    assert!(lines.len() >= 35, "only {} trace lines", lines.len());
    // Fork groups are numbered; siblings share a number.
    assert!(lines.iter().filter(|l| l["fork_group"] == 0).count() >= 6);
    assert!(lines
        .iter()
        .all(|l| l["hash_ids"].is_array() && l["block_size"] == 16));
    // It is a trace the replay tools read (every line validated).
    let trace = kvfleet_bench::Trace::read_path(&out).expect("a valid trace");
    assert_eq!(trace.records.len(), lines.len());
    assert!(
        !text.contains("alpha"),
        "the trace must not contain prompt text"
    );
    eprintln!("trace export: {} lines", lines.len());
    drop(r2);
    drop(workers);
    drop(etcd);
}
