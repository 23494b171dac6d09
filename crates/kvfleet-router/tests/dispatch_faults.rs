//! Dispatch against scripted workers over real gRPC (`support/fake_worker.rs`): which
//! worker failures are retried elsewhere, which reach the client, what the breakers
//! and the prefix index make of each.

mod support;

use kvfleet_core::{hash_blocks, namespace_seed};
use kvfleet_router::circuit_breaker::{BreakerConfig, CircuitState};
use kvfleet_router::dispatch::{dispatch, GenerationSpec};
use kvfleet_router::http_front::collect;
use kvfleet_router::{Fleet, FleetConfig, RouterConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::fake_worker::{chat_spec, FakeWorker, Script, BS, MODEL};

/// A 64-token prompt (4 full blocks) and its chained hashes.
fn prompt() -> (Vec<u32>, Vec<kvfleet_core::BlockHash>) {
    let tokens: Vec<u32> = (0..64).map(|i| (i * 7 + 3) % 300 + 1).collect();
    let hashes = hash_blocks(namespace_seed(MODEL, ""), &tokens, BS as usize);
    (tokens, hashes)
}

/// The prompt's blocks as a worker's dump lists them.
fn cached_chain() -> Vec<(u64, Option<u64>)> {
    let (_, hashes) = prompt();
    let mut parent = None;
    hashes
        .iter()
        .map(|h| {
            let b = (h.0, parent);
            parent = Some(h.0);
            b
        })
        .collect()
}

fn spec(id: &str) -> Arc<GenerationSpec> {
    chat_spec(id, prompt().0)
}

/// A fleet with short deadlines whose breakers open on the `breaker_failures`-th
/// consecutive failure.
fn fleet(breaker_failures: u32, tweak: impl FnOnce(&mut FleetConfig)) -> Arc<Fleet> {
    let mut config = FleetConfig {
        router: RouterConfig {
            block_size: BS as usize,
            ..RouterConfig::default()
        },
        first_message_timeout: Duration::from_millis(400),
        queued_timeout: Duration::from_secs(20),
        breaker: BreakerConfig {
            failure_threshold: breaker_failures,
            cooldown: Duration::from_secs(60),
        },
        ..FleetConfig::default()
    };
    tweak(&mut config);
    Fleet::new(config).expect("fleet")
}

/// w0 holds the prompt's prefix (so the cache-aware policy picks it first), w1 holds
/// nothing.
async fn two_workers(fleet: &Fleet, w0: Script, w1: Script) -> (FakeWorker, FakeWorker) {
    let a = FakeWorker::start("w0", &cached_chain(), w0).await;
    let b = FakeWorker::start("w1", &[], w1).await;
    assert_eq!(fleet.add_worker(&a.endpoint).await.unwrap(), "w0");
    assert_eq!(fleet.add_worker(&b.endpoint).await.unwrap(), "w1");
    (a, b)
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_past_the_first_token_deadline_stays_on_its_worker() {
    // The queue outlasts the first-token deadline (400 ms) five times over.
    let fleet = fleet(1, |_| {});
    let (w0, w1) = two_workers(
        &fleet,
        Script::QueueFor(Duration::from_secs(2)),
        Script::Answer,
    )
    .await;
    let d = dispatch(&fleet, &spec("deep-queue"))
        .await
        .expect("answered by the worker that queued it");
    assert_eq!(d.worker, "w0");
    assert!(
        d.first.usage.is_some(),
        "the first real message: {:?}",
        d.first
    );
    assert!(
        d.first.accepted.is_none(),
        "the acknowledgement is not handed on"
    );
    assert_eq!(w1.generates(), 0, "not prefilled again elsewhere");
    assert_eq!(w0.aborts(), 0, "not aborted");
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Closed);
    assert!(fleet.routing.is_registered("w0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_past_the_queue_deadline_is_aborted_not_resent() {
    let fleet = fleet(1, |c| c.queued_timeout = Duration::from_millis(800));
    let (w0, w1) = two_workers(&fleet, Script::QueueForever, Script::Answer).await;
    let err = match dispatch(&fleet, &spec("stuck")).await {
        Ok(d) => panic!("answered by {}", d.worker),
        Err(e) => e,
    };
    assert_eq!(err.status.as_u16(), 503, "{err:?}");
    assert!(err.message.contains("queue"), "{}", err.message);
    eventually("the queued request is aborted on w0", || w0.aborts() == 1).await;
    assert_eq!(w1.generates(), 0, "not resent");
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_never_acknowledged_is_retried_elsewhere() {
    // A hung worker (or one too old to acknowledge) sends nothing: the request never
    // started there, so it goes to the next worker and w0's breaker is charged.
    let fleet = fleet(1, |_| {});
    let (w0, w1) = two_workers(&fleet, Script::Silent, Script::Answer).await;
    let d = dispatch(&fleet, &spec("hung")).await.expect("retried");
    assert_eq!(d.worker, "w1");
    assert_eq!((w0.generates(), w1.generates()), (1, 1));
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Open);
}

/// Request-level failures, before or after the worker accepted the request.
const REQUEST_LEVEL: [tonic::Code; 8] = [
    tonic::Code::Internal,
    tonic::Code::Unknown,
    tonic::Code::AlreadyExists,
    tonic::Code::Aborted,
    tonic::Code::NotFound,
    tonic::Code::PermissionDenied,
    tonic::Code::Unimplemented,
    tonic::Code::DataLoss,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_level_errors_reach_the_client_and_leave_the_worker_alone() {
    // One failure would open the breaker: none may be charged.
    let fleet = fleet(1, |_| {});
    let (w0, w1) = two_workers(&fleet, Script::Answer, Script::Answer).await;
    let scripts = REQUEST_LEVEL
        .iter()
        .flat_map(|&c| [Script::Reject(c), Script::FailAfterAccept(c)]);
    for (i, script) in scripts.enumerate() {
        w0.set_script(script.clone());
        let err = match dispatch(&fleet, &spec(&format!("r{i}"))).await {
            Ok(d) => panic!("{script:?}: answered by {}", d.worker),
            Err(e) => e,
        };
        assert_eq!(err.status.as_u16(), 502, "{script:?}: {err:?}");
        assert_eq!(w1.generates(), 0, "{script:?}: resent to w1");
        assert_eq!(
            fleet.workers.circuit_state("w0"),
            CircuitState::Closed,
            "{script:?}"
        );
        assert_eq!(
            fleet.routing.worker_blocks("w0").map(|b| b.len()),
            Some(4),
            "{script:?}: w0's index was dropped"
        );
    }
    // The supervisor had time to notice a dropped worker: it would have resynced.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(w0.dumps(), 1, "no reconnect, no second CacheDump");
    assert_eq!(fleet.workers.breaker_failures("w0"), 0);
    // And w0 still serves.
    w0.set_script(Script::Answer);
    assert_eq!(dispatch(&fleet, &spec("after")).await.unwrap().worker, "w0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_errors_are_the_workers_retried_and_charged_once() {
    // w1's reservation from each retry lapses at the next route (the fake worker sends no KV
    // events to confirm it): w0 stays the only holder, so each request tries w0 first.
    let fleet = fleet(3, |c| c.router.reservation_ttl_ms = 0);
    let (w0, w1) = two_workers(&fleet, Script::Answer, Script::Answer).await;
    for (i, code) in [tonic::Code::Unavailable, tonic::Code::DeadlineExceeded]
        .into_iter()
        .enumerate()
    {
        w0.set_script(Script::Reject(code));
        let d = dispatch(&fleet, &spec(&format!("t{i}")))
            .await
            .expect("retried on w1");
        assert_eq!(d.worker, "w1", "{code:?}");
        assert_eq!(w1.generates(), i + 1);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        fleet.workers.breaker_failures("w0"),
        2,
        "one charge per failed request, none from a forced reconnect"
    );
    assert_eq!(w0.dumps(), 1, "the index was kept: no resync");
    assert_eq!(fleet.routing.worker_blocks("w0").map(|b| b.len()), Some(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_a_transport_error_and_retried_elsewhere() {
    use support::fake_worker::Proxy;
    let fleet = fleet(1, |_| {});
    let w0 = FakeWorker::start("w0", &cached_chain(), Script::Silent).await;
    let proxy = Proxy::start(&w0.endpoint).await;
    let w1 = FakeWorker::start("w1", &[], Script::Answer).await;
    fleet.add_worker(&proxy.endpoint).await.unwrap();
    fleet.add_worker(&w1.endpoint).await.unwrap();
    let f = fleet.clone();
    let call = tokio::spawn(async move { dispatch(&f, &spec("cut")).await });
    eventually("w0 got the request", || w0.generates() == 1).await;
    proxy.cut();
    let d = call.await.unwrap().expect("retried");
    assert_eq!(d.worker, "w1");
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Open);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_whose_worker_fails_mid_way_is_redone_elsewhere_before_the_client_sees_it() {
    // A non-streamed answer has reached no client yet: a worker that hangs (SIGSTOP)
    // or drops the connection after its first token costs a retry, not the request.
    // As above, w1's reservations from the redos lapse at the next route: w0 stays the only
    // holder of the prefix.
    let fleet = fleet(5, |c| {
        c.stall_timeout = Duration::from_millis(300);
        c.router.reservation_ttl_ms = 0;
    });
    let (w0, w1) = two_workers(&fleet, Script::StallAfterFirst, Script::Answer).await;
    let scripts = [
        Script::StallAfterFirst,
        Script::FailAfterFirst(tonic::Code::Unavailable),
    ];
    for (i, script) in scripts.into_iter().enumerate() {
        w0.set_script(script.clone());
        let d = dispatch(&fleet, &spec(&format!("m{i}"))).await.unwrap();
        assert_eq!(d.worker, "w0", "{script:?}: w0 holds the prefix");
        let (out, worker) = collect(&fleet, d).await.expect("redone on w1");
        assert_eq!(worker, "w1", "{script:?}");
        // w0's partial "y" is dropped: the answer is w1's alone.
        assert_eq!(out.text, "x", "{script:?}");
        assert_eq!(out.finish, Some("length"), "{script:?}");
        assert_eq!((w0.generates(), w1.generates()), (i + 1, i + 1));
    }
    // A failure of the request itself is not the worker's: not resent.
    w0.set_script(Script::FailAfterFirst(tonic::Code::Internal));
    let d = dispatch(&fleet, &spec("request-level")).await.unwrap();
    let err = collect(&fleet, d).await.expect_err("502");
    assert_eq!(err.status.as_u16(), 502);
    assert_eq!(w1.generates(), 2, "not resent to w1");
    // Every worker failing it: the client gets the error once the attempts run out.
    w1.set_script(Script::StallAfterFirst);
    w0.set_script(Script::StallAfterFirst);
    let d = dispatch(&fleet, &spec("everywhere")).await.unwrap();
    let err = collect(&fleet, d).await.expect_err("502");
    assert_eq!(err.status.as_u16(), 502, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_fails_mid_generation_on_a_working_worker_does_not_charge_its_breaker() {
    // The worker sends a first token, then fails this one request (an engine error, not
    // a lost connection): the client gets a 502, and the worker stays in routing however
    // often that happens. Breakers open on the second charged failure here.
    let fleet = fleet(2, |c| c.router.reservation_ttl_ms = 0);
    let (w0, w1) = two_workers(
        &fleet,
        Script::FailAfterFirst(tonic::Code::Internal),
        Script::Answer,
    )
    .await;
    for i in 0..3 {
        let d = dispatch(&fleet, &spec(&format!("bad{i}"))).await.unwrap();
        assert_eq!(d.worker, "w0", "w0 holds the prefix");
        let err = collect(&fleet, d).await.expect_err("502");
        assert_eq!(err.status.as_u16(), 502);
    }
    assert_eq!(fleet.workers.breaker_failures("w0"), 0);
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Closed);
    // Its prefix still draws the next request, which it now answers.
    w0.set_script(Script::Answer);
    let d = dispatch(&fleet, &spec("good")).await.unwrap();
    assert_eq!(d.worker, "w0");
    let (out, worker) = collect(&fleet, d).await.expect("answered");
    assert_eq!((worker.as_str(), out.text.as_str()), ("w0", "x"));
    assert_eq!(w1.generates(), 0);
}
