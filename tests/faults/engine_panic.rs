//! An engine panic (`kvfleet worker --fault-panic-after-steps N`, a hidden test hook):
//! the worker must leave routing on its own — `/health` 503 (or gone), its etcd lease
//! revoked so the router drops it from membership, the process exited non-zero within
//! its lease TTL — while its requests that had not started are served by the other
//! worker, so none is lost.

use crate::support::start;
use kvfleet_control::test_services::EtcdServer;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The membership lease of both workers: everything must happen well inside it.
const LEASE_TTL_S: u64 = 10;

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// One round-robin request of one token: each is a single engine step (its prefill),
/// so the step that panics is always a request's prefill, before it has started.
fn send(http: &reqwest::blocking::Client, router: &str, i: u32) -> (u16, Option<String>) {
    crate::send_tokens(http, router, i, 1)
}

#[test]
fn a_panicked_engine_takes_its_worker_out_of_routing_and_the_process_exits_non_zero() {
    let _serial = crate::one_at_a_time();
    let etcd = EtcdServer::start();
    let url = etcd.url();
    let ttl = LEASE_TTL_S.to_string();
    let worker = |id: &str, extra: &[&str]| {
        let mut args = vec![
            "worker",
            "--grpc",
            "127.0.0.1:0",
            "--worker-id",
            id,
            "--etcd",
            &url,
            "--lease-ttl",
            &ttl,
            "--metrics",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        start(&args, "grpc://")
    };
    // Six one-step batches, then the seventh step on p0 panics.
    let mut p0 = worker("p0", &["--fault-panic-after-steps", "6"]);
    let _p1 = worker("p1", &[]);
    let p0_health = p0
        .line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http://"))
        .map(|a| format!("http://{a}/health"))
        .unwrap_or_else(|| panic!("no metrics address in {:?}", p0.line));
    let r = start(
        &["router", "--http", "127.0.0.1:0", "--etcd", &url],
        "http://",
    );
    let router = format!("http://{}", r.addr);
    let http = http();
    let health = |http: &reqwest::blocking::Client| -> Value {
        http.get(format!("{router}/health"))
            .send()
            .and_then(|r| r.json())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while health(&http)["healthy_workers"] != 2 {
        assert!(Instant::now() < deadline, "both workers joined");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        http.get(&p0_health)
            .send()
            .map(|r| r.status().as_u16())
            .ok(),
        Some(200),
        "p0 is healthy before the fault"
    );

    // Two clients send until told to stop; every outcome is kept.
    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<crate::Outcome>>> = Arc::default();
    let clients: Vec<_> = (0..2u32)
        .map(|c| {
            let (stop, log, router) = (stop.clone(), log.clone(), router.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::builder()
                    .timeout(Duration::from_secs(30))
                    .build()
                    .expect("client");
                let mut i = c * 100_000;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    let (s, w) = send(&http, &router, i);
                    log.lock().expect("log").push((Instant::now(), s, w));
                }
            })
        })
        .collect();

    // Watch p0 leave: its /health, its membership in the router, its process.
    let probe = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .expect("probe client");
    let mut panicked_at: Option<Instant> = None;
    let mut health_503_at: Option<Instant> = None;
    let mut health_gone_at: Option<Instant> = None;
    let mut dropped_at: Option<Instant> = None;
    let mut exited: Option<(Instant, std::process::ExitStatus)> = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while exited.is_none() || dropped_at.is_none() {
        assert!(
            Instant::now() < deadline,
            "p0 did not leave: /health 503 {health_503_at:?}, dropped {dropped_at:?}, exited {exited:?}"
        );
        if health_503_at.is_none() && health_gone_at.is_none() {
            match probe.get(&p0_health).send() {
                Ok(resp) if resp.status().as_u16() == 503 => {
                    let now = Instant::now();
                    let body: Value = resp.json().unwrap_or_default();
                    assert_eq!(body["status"], "engine_failed", "{body}");
                    let ago = body["failed_ms_ago"].as_u64().expect("failed_ms_ago");
                    panicked_at = Some(now - Duration::from_millis(ago));
                    health_503_at = Some(now);
                }
                Ok(resp) => assert_eq!(resp.status().as_u16(), 200, "p0's /health"),
                Err(_) => health_gone_at = Some(Instant::now()),
            }
        }
        if exited.is_none() {
            if let Some(status) = p0.child.try_wait().expect("try_wait") {
                exited = Some((Instant::now(), status));
            }
        }
        if dropped_at.is_none() && health(&http)["workers"] == 1 {
            dropped_at = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Traffic goes on for a while on p1 alone.
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().expect("client thread");
    }

    let (exited_at, status) = exited.expect("exited");
    assert!(!status.success(), "p0 exits non-zero: {status}");
    assert!(
        health_503_at.is_some() || health_gone_at.is_some(),
        "p0's /health stopped answering 200"
    );
    let fleet: Value = http
        .get(format!("{router}/fleet"))
        .send()
        .and_then(|r| r.json())
        .expect("/fleet");
    let ids: Vec<&str> = fleet["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .filter_map(|w| w["id"].as_str())
        .collect();
    assert_eq!(ids, ["p1"], "the router's membership dropped p0: {fleet}");

    let log = log.lock().expect("log");
    let lost: Vec<_> = log.iter().filter(|(_, s, _)| *s != 200).collect();
    assert!(lost.is_empty(), "requests lost: {lost:?}");
    let on_p0 = log
        .iter()
        .filter(|(.., w)| w.as_deref() == Some("p0"))
        .count();
    // Six steps hold six to twelve requests (two clients may share a step).
    assert!(
        (1..=12).contains(&on_p0),
        "p0 served its six steps: {on_p0}"
    );
    assert!(
        !log.iter()
            .any(|(t, _, w)| *t > exited_at && w.as_deref() == Some("p0")),
        "nothing was served by p0 after it exited"
    );
    assert!(
        log.iter()
            .any(|(t, _, w)| *t > exited_at && w.as_deref() == Some("p1")),
        "p1 kept serving after p0 exited"
    );
    // The lease TTL bounds it all, from the first sign of the fault.
    let origin = panicked_at
        .or(health_gone_at)
        .expect("a time for the fault");
    let ms = |t: Instant| t.saturating_duration_since(origin).as_secs_f64() * 1e3;
    assert!(
        exited_at.saturating_duration_since(origin) < Duration::from_secs(LEASE_TTL_S),
        "p0 exited within its lease TTL"
    );
    let dropped = dropped_at.expect("dropped");
    assert!(dropped.saturating_duration_since(origin) < Duration::from_secs(LEASE_TTL_S));
    eprintln!(
        "FIGURE engine panic: panic -> /health 503 {} ms; -> membership drop (lease revoked) {:.0} ms; -> exit ({status}) {:.0} ms; {} requests, 0 lost, {on_p0} on p0 before the panic",
        health_503_at.map_or("not seen (already gone)".into(), |t| format!("{:.0}", ms(t))),
        ms(dropped),
        ms(exited_at),
        log.len()
    );
}
