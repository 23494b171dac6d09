//! Kafka unreachable: every client of the broker (tansu) reaches it through a TCP proxy
//! that the broker advertises as its address, so partitioning the proxy cuts the
//! workers' KV event publishers and the router's consumer at once, without restarting
//! the (in-memory) broker. While it is cut the router keeps routing on its own
//! placements, says so (`/health` `"events": {"status": "stale"}`,
//! `kvfleet_control_plane_up{component="kafka"}` 0) and its index stops advancing;
//! once healed the metric returns to 1 and the events published during the outage
//! reach the index, which then equals each worker's `CacheDump`.

use crate::support::{chat, filler, start, Proc};
use kvfleet_control::test_services::{free_port, EtcdServer, KafkaBroker, TcpProxy};
use kvfleet_router::worker_conn::{ConnTimeouts, WorkerConn};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long Kafka stays cut: several reconnect attempts and probes.
const HOLD: Duration = Duration::from_secs(4);

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

fn get(router: &str, path: &str) -> Value {
    http()
        .get(format!("http://{router}{path}"))
        .send()
        .and_then(|r| r.json())
        .unwrap_or(Value::Null)
}

fn kafka_up_metric(router: &str) -> Option<f64> {
    let text = http()
        .get(format!("http://{router}/metrics"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default();
    text.lines().find_map(|l| {
        l.strip_prefix("kvfleet_control_plane_up{component=\"kafka\"}")?
            .trim()
            .parse()
            .ok()
    })
}

fn events_status(router: &str) -> Value {
    get(router, "/health")["events"]["status"].clone()
}

/// Sends a chat request with a 300-word prompt; (status, serving worker, cached tokens).
fn send(router: &str, seed: u32) -> (u16, String, u64) {
    let body = chat(json!([{"role": "user", "content": filler(seed, 300)}]), 2);
    let Ok(resp) = http()
        .post(format!("http://{router}/v1/chat/completions"))
        .json(&body)
        .send()
    else {
        return (0, String::new(), 0);
    };
    let status = resp.status().as_u16();
    let worker = resp
        .headers()
        .get("x-kvfleet-worker")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let v: Value = resp.json().unwrap_or(Value::Null);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (status, worker, cached)
}

/// worker id → (cached blocks, last applied event seq) in the router's index.
fn index_view(router: &str) -> BTreeMap<String, (u64, u64)> {
    get(router, "/fleet")["router"]["workers"]
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

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

#[test]
fn routers_serve_through_a_kafka_outage_and_catch_up_after_it() {
    let _serial = crate::one_at_a_time();
    // The proxy's tasks run on this runtime's threads; the test itself blocks.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let etcd = EtcdServer::start();
    let broker_port = free_port();
    let proxy = rt.block_on(TcpProxy::start(broker_port));
    let mut broker = KafkaBroker::start_on(broker_port, proxy.port);
    let kafka = format!("127.0.0.1:{}", proxy.port);
    let etcd_url = etcd.url();
    let prefix = format!("kout{}.", std::process::id());
    let common = [
        "--etcd",
        etcd_url.as_str(),
        "--kafka",
        kafka.as_str(),
        "--topic-prefix",
        prefix.as_str(),
        "--kafka-session-timeout-ms",
        "2000",
    ];
    let worker = |id: &str| -> Proc {
        let mut args = vec!["worker", "--grpc", "127.0.0.1:0", "--worker-id", id];
        args.extend_from_slice(&common);
        start(&args, "grpc://")
    };
    let workers: BTreeMap<String, Proc> = ["k0", "k1"]
        .iter()
        .map(|id| (id.to_string(), worker(id)))
        .collect();
    let mut args = vec!["router", "--http", "127.0.0.1:0", "--router-id", "kr"];
    args.extend_from_slice(&common);
    let r = start(&args, "http://");
    let router = r.addr.as_str();

    // worker id → (blocks, seq) of its own CacheDump.
    let dumps = || -> BTreeMap<String, (u64, u64)> {
        rt.block_on(async {
            let mut out = BTreeMap::new();
            for (id, p) in &workers {
                let conn = WorkerConn::connect_with(&p.addr, ConnTimeouts::default(), None)
                    .await
                    .expect("connect");
                let d = conn.cache_dump().await.expect("dump");
                out.insert(id.clone(), (d.blocks.len() as u64, d.seq));
            }
            out
        })
    };
    let caught_up = || index_view(router) == dumps();

    wait_for(
        "the router to see both workers",
        Duration::from_secs(30),
        || get(router, "/health")["healthy_workers"] == 2 && events_status(router) == "live",
    );
    assert_eq!(kafka_up_metric(router), Some(1.0));
    let (status, first, _) = send(router, 1);
    assert_eq!(status, 200);
    wait_for(
        "the index to follow the event stream",
        Duration::from_secs(30),
        caught_up,
    );
    let fed = index_view(router);
    assert!(fed[&first].0 > 0, "blocks indexed from Kafka: {fed:?}");

    // Cut Kafka off from every process.
    let t_cut = Instant::now();
    let open = proxy.partition();
    assert!(open > 0, "clients were connected through the proxy");
    let detect = wait_for("events to turn stale", Duration::from_secs(30), || {
        events_status(router) == "stale"
    });
    assert_eq!(kafka_up_metric(router), Some(0.0));

    // Requests keep succeeding; a repeated prefix stays where it was served first.
    let mut sent = 0;
    let mut ok = 0;
    let (status, again, cached) = send(router, 1);
    sent += 1;
    ok += u32::from(status == 200);
    assert_eq!(again, first, "the pre-outage prefix stays on its worker");
    assert!(cached > 0, "and hits its cache");
    let (status, placed, _) = send(router, 2);
    sent += 1;
    ok += u32::from(status == 200);
    let mut outage_cached = 0;
    for _ in 0..3 {
        let (status, w, cached) = send(router, 2);
        sent += 1;
        ok += u32::from(status == 200);
        assert_eq!(w, placed, "a prefix first seen during the outage stays put");
        assert!(cached > 0, "and hits its cache");
        outage_cached = cached;
    }
    assert_eq!(ok, sent, "every request during the outage succeeded");
    // The index is stale: the worker made new blocks the router has not heard about.
    let during = index_view(router);
    let dumped = dumps();
    assert_eq!(
        during[&placed].1, fed[&placed].1,
        "no event applied while Kafka is cut"
    );
    assert!(
        dumped[&placed].1 > during[&placed].1,
        "the worker moved on: {dumped:?} vs {during:?}"
    );
    // Stays stale for as long as the cut lasts (the consumer itself goes quiet
    // between reconnect attempts; only a broker's answer may turn it live).
    while t_cut.elapsed() < HOLD {
        assert_eq!(
            events_status(router),
            "stale",
            "{:?} into the outage",
            t_cut.elapsed()
        );
        assert_eq!(kafka_up_metric(router), Some(0.0));
        std::thread::sleep(Duration::from_millis(100));
    }
    broker.assert_alive();

    // Heal: the metric returns to 1 and the outage's events reach the index.
    let outage = t_cut.elapsed();
    let t_heal = Instant::now();
    proxy.heal();
    wait_for("events to be live again", Duration::from_secs(60), || {
        events_status(router) == "live" && kafka_up_metric(router) == Some(1.0)
    });
    let live = t_heal.elapsed();
    wait_for(
        "the index to catch up with the dumps",
        Duration::from_secs(60),
        caught_up,
    );
    let synced = t_heal.elapsed();
    let after = index_view(router);
    assert!(
        after[&placed].1 > during[&placed].1 && after[&placed].0 > during[&placed].0,
        "the outage's blocks are indexed: {after:?} vs {during:?}"
    );
    let (status, w, cached) = send(router, 2);
    assert_eq!((status, w.as_str()), (200, placed.as_str()));
    assert_eq!(cached, outage_cached);
    eprintln!(
        "FIGURE kafka outage: detect (cut -> stale, metric 0) {:.0} ms; {ok}/{sent} requests served during the {:.1} s outage, 0 lost; recover (heal -> live, metric 1) {:.0} ms; index == workers' dumps {:.0} ms after heal ({} connections cut)",
        detect.as_secs_f64() * 1e3,
        outage.as_secs_f64(),
        live.as_secs_f64() * 1e3,
        synced.as_secs_f64() * 1e3,
        open
    );
}
