//! etcd unreachable (its process killed, then restarted on the same data): the router
//! keeps serving on the membership it last knew, says so in `/health`
//! (`"membership": {"status": "stale"}`) and in `kvfleet_control_plane_up{component="etcd"}`,
//! and goes back to `live` / 1 once etcd answers again.

use crate::support::{chat, filler, start};
use kvfleet_control::test_services::EtcdServer;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn get(http: &reqwest::blocking::Client, url: &str) -> reqwest::blocking::Response {
    http.get(url).send().expect("GET")
}

fn etcd_up_metric(http: &reqwest::blocking::Client, router: &str) -> Option<f64> {
    let text = get(http, &format!("{router}/metrics"))
        .text()
        .unwrap_or_default();
    text.lines().find_map(|l| {
        l.strip_prefix("kvfleet_control_plane_up{component=\"etcd\"}")?
            .trim()
            .parse()
            .ok()
    })
}

fn membership(http: &reqwest::blocking::Client, router: &str) -> Value {
    let h: Value = get(http, &format!("{router}/health"))
        .json()
        .unwrap_or_default();
    h["membership"]["status"].clone()
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

#[test]
fn the_router_serves_on_known_membership_while_etcd_is_down() {
    let _serial = crate::one_at_a_time();
    let mut etcd = EtcdServer::start();
    let url = etcd.url();
    let _w = start(
        &[
            "worker",
            "--grpc",
            "127.0.0.1:0",
            "--worker-id",
            "e0",
            "--etcd",
            &url,
            "--lease-ttl",
            "30",
        ],
        "grpc://",
    );
    let r = start(
        &["router", "--http", "127.0.0.1:0", "--etcd", &url],
        "http://",
    );
    let router = format!("http://{}", r.addr);
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let send = |i: u32| {
        http.post(format!("{router}/v1/chat/completions"))
            .json(&chat(
                json!([{"role": "user", "content": filler(i, 100)}]),
                2,
            ))
            .send()
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    wait_for("the worker to join", || {
        let h: Value = get(&http, &format!("{router}/health"))
            .json()
            .unwrap_or_default();
        h["healthy_workers"] == 1 && h["membership"]["status"] == "live"
    });
    assert_eq!(send(0), 200);
    assert_eq!(etcd_up_metric(&http, &router), Some(1.0));

    etcd.kill();
    let detect = wait_for("membership to turn stale", || {
        membership(&http, &router) == "stale"
    });
    assert_eq!(etcd_up_metric(&http, &router), Some(0.0));
    let mut ok = 0;
    for i in 1..=10 {
        assert_eq!(send(i), 200, "request {i} while etcd is down");
        ok += 1;
    }
    let health: Value = get(&http, &format!("{router}/health"))
        .json()
        .expect("health");
    assert_eq!(health["healthy_workers"], 1, "{health}");
    assert!(
        health["membership"]["since_s"].as_f64().is_some(),
        "{health}"
    );

    let t = Instant::now();
    etcd.restart();
    wait_for("membership to be live again", || {
        membership(&http, &router) == "live"
    });
    let recover = t.elapsed();
    assert_eq!(etcd_up_metric(&http, &router), Some(1.0));
    assert_eq!(send(100), 200);
    eprintln!(
        "FIGURE etcd outage: detect (kill -> stale) {:.0} ms; {ok}/10 requests served while down, 0 lost; recover (etcd restart started -> live) {:.0} ms",
        detect.as_secs_f64() * 1e3,
        recover.as_secs_f64() * 1e3
    );
}
