//! The router's control-plane link under faults, on the in-memory control plane (the
//! same traits etcd implements) with scripted workers over real gRPC: watches that
//! fail and resume, workers that leave, requests cancelled mid-routing.

mod support;

use futures::future::BoxFuture;
use kvfleet_control::memory::MemKv;
use kvfleet_control::{KvMembership, KvPlacement, Membership, Placement, PlacementKey};
use kvfleet_control::{Registration, WorkerRecord};
use kvfleet_router::circuit_breaker::{BreakerConfig, CircuitState};
use kvfleet_router::control_hooks::{ControlHooks, KnownPlacement, PlacementRef, RequestUsage};
use kvfleet_router::control_plane::RouterControl;
use kvfleet_router::dispatch::{dispatch, GenerationSpec};
use kvfleet_router::{Fleet, FleetConfig, RouterConfig};
use std::sync::Arc;
use std::time::Duration;
use support::fake_worker::{chat_spec, FakeWorker, Script, BS, MODEL};
use support::flaky_control::{FlakyMembership, FlakyPlacement};

const TTL: Duration = Duration::from_secs(30);

fn fleet() -> Arc<Fleet> {
    Fleet::new(FleetConfig {
        router: RouterConfig {
            block_size: BS as usize,
            ..RouterConfig::default()
        },
        ..FleetConfig::default()
    })
    .expect("fleet")
}

async fn register(m: &dyn Membership, w: &FakeWorker, incarnation: u64) -> Registration {
    let record = WorkerRecord {
        id: w.id.clone(),
        grpc_addr: w.endpoint.clone(),
        model: MODEL.into(),
        block_size: BS,
        incarnation,
    };
    m.register(&record, TTL).await.expect("register")
}

/// Whether `cond` holds within 10 s (checked every 20 ms).
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

fn healthy(fleet: &Fleet) -> Vec<String> {
    fleet
        .workers
        .statuses()
        .into_iter()
        .filter(|s| s.healthy)
        .map(|s| s.id)
        .collect()
}

fn group(name: &str) -> PlacementRef {
    PlacementRef::ForkGroup(name.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_placement_watch_is_listed_and_watched_again() {
    let fleet = fleet();
    let kv = MemKv::new();
    let membership = Arc::new(KvMembership::new(kv.clone()));
    let placement = FlakyPlacement::new(KvPlacement::new(kv.clone()));
    let w0 = FakeWorker::start("w0", &[], Script::Answer).await;
    let _r0 = register(membership.as_ref(), &w0, 1).await;
    let other_router = &placement.inner;
    other_router
        .place(&PlacementKey::fork_group("old"), "w0", TTL)
        .await
        .unwrap();

    let _rc = RouterControl::start_with(fleet.clone(), placement.clone(), membership, TTL)
        .await
        .expect("start");
    assert!(eventually(|| healthy(&fleet) == ["w0"]).await);
    let hooks = fleet.control.hooks().expect("hooks installed");
    assert_eq!(hooks.placed_worker(&group("old")).as_deref(), Some("w0"));

    // While this router's watch is silent, another router's changes land in the store;
    // then the watch fails.
    other_router.release_worker("w0").await.unwrap();
    other_router
        .place(&PlacementKey::fork_group("new"), "w0", TTL)
        .await
        .unwrap();
    placement.first.fail().await;

    assert!(
        eventually(|| hooks.placed_worker(&group("new")).as_deref() == Some("w0")).await,
        "a placement made while the watch was down is never seen"
    );
    assert_eq!(
        hooks.placed_worker(&group("old")),
        None,
        "a placement freed while the watch was down is still followed"
    );
    assert!(placement.first.watches() >= 2, "watched again");
    // The new watch follows later changes.
    other_router
        .place(&PlacementKey::fork_group("later"), "w0", TTL)
        .await
        .unwrap();
    assert!(
        eventually(|| hooks.placed_worker(&group("later")).as_deref() == Some("w0")).await,
        "a placement made after the watch resumed is never seen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_membership_watch_changes_only_what_changed() {
    let fleet = fleet();
    let kv = MemKv::new();
    let membership = FlakyMembership::new(KvMembership::new(kv.clone()));
    let placement: Arc<dyn Placement> = Arc::new(KvPlacement::new(kv.clone()));
    let stays = FakeWorker::start("w0", &[], Script::Answer).await;
    let leaves = FakeWorker::start("w1", &[], Script::Answer).await;
    let restarts = FakeWorker::start("w2", &[], Script::Answer).await;
    let joins = FakeWorker::start("w3", &[], Script::Answer).await;
    let _r0 = register(&membership.inner, &stays, 1).await;
    let r1 = register(&membership.inner, &leaves, 1).await;
    let _r2 = register(&membership.inner, &restarts, 1).await;

    let _rc = RouterControl::start_with(fleet.clone(), placement, membership.clone(), TTL)
        .await
        .expect("start");
    assert!(eventually(|| healthy(&fleet) == ["w0", "w1", "w2"]).await);
    for w in [&stays, &leaves, &restarts] {
        assert_eq!(w.dumps(), 1, "{} indexed once", w.id);
    }

    // While the router's watch is silent: one worker leaves, one restarts (a new
    // incarnation), one joins; then the watch fails and the router lists again.
    r1.deregister().await.unwrap();
    let _r2b = register(&membership.inner, &restarts, 2).await;
    let _r3 = register(&membership.inner, &joins, 1).await;
    membership.first.fail().await;

    assert!(
        eventually(|| healthy(&fleet) == ["w0", "w2", "w3"] && restarts.dumps() == 2).await,
        "after the resume the fleet is {:?} (w2 dumped {} times)",
        healthy(&fleet),
        restarts.dumps()
    );
    assert!(
        eventually(|| membership.first.watches() >= 2).await,
        "watched again"
    );
    // Anything the resume re-added would dump again shortly after.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        stays.dumps(),
        1,
        "an unchanged worker was removed and re-added"
    );
    assert_eq!(joins.dumps(), 1);
    assert_eq!(restarts.dumps(), 2, "the new incarnation is indexed once");
    assert_eq!(healthy(&fleet), ["w0", "w2", "w3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakers_go_with_their_workers() {
    let fleet = Fleet::new(FleetConfig {
        router: RouterConfig {
            block_size: BS as usize,
            ..RouterConfig::default()
        },
        breaker: BreakerConfig {
            failure_threshold: 1,
            cooldown: Duration::from_secs(60),
        },
        ..FleetConfig::default()
    })
    .expect("fleet");
    let w0 = FakeWorker::start("w0", &[], Script::Answer).await;
    fleet.add_worker(&w0.endpoint).await.expect("add w0");
    fleet.workers.breaker_failure("w0");
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Open);

    // The worker departs (its lease expired): its breaker goes with it.
    fleet.remove_worker("w0");
    assert_eq!(
        fleet.workers.breaker_failures("w0"),
        0,
        "a departed worker's breaker is kept"
    );
    // Back under the same id, it starts with a closed breaker, not the old cool-down.
    fleet.add_worker(&w0.endpoint).await.expect("re-add w0");
    assert_eq!(fleet.workers.circuit_state("w0"), CircuitState::Closed);

    // A failure reported for a worker the fleet does not know creates nothing.
    fleet.workers.breaker_failure("ghost");
    assert_eq!(fleet.workers.breaker_failures("ghost"), 0);
    assert_eq!(fleet.workers.circuit_state("ghost"), CircuitState::Closed);
}

/// Placement hooks whose claim never resolves (a control plane that hangs).
struct NeverClaims;

impl ControlHooks for NeverClaims {
    fn placement(&self, _key: &PlacementRef) -> Option<KnownPlacement> {
        None
    }
    fn claim(&self, _key: PlacementRef, _worker: String) -> BoxFuture<'static, Option<String>> {
        Box::pin(futures::future::pending())
    }
    fn request_done(&self, _usage: RequestUsage) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_cancelled_during_its_placement_claim_is_not_left_in_flight() {
    let fleet = fleet();
    let w0 = FakeWorker::start("w0", &[], Script::Answer).await;
    fleet.add_worker(&w0.endpoint).await.expect("add w0");
    fleet.set_control_hooks(Arc::new(NeverClaims));
    let inflight = || {
        fleet
            .routing
            .snapshot()
            .workers
            .iter()
            .map(|w| w.load.inflight_requests)
            .sum::<usize>()
    };

    // A prompt no worker holds: its prefix root is claimed first, and the claim hangs
    // until the client goes away.
    let tokens: Vec<u32> = (0..64).map(|i| (i * 5 + 1) % 300 + 1).collect();
    let spec = chat_spec("r1", tokens);
    let cancelled = tokio::time::timeout(Duration::from_millis(300), dispatch(&fleet, &spec)).await;
    assert!(cancelled.is_err(), "the claim resolved");
    assert_eq!(
        inflight(),
        0,
        "the cancelled request is still counted in flight"
    );
    assert_eq!(w0.generates(), 0);
}

/// Placement hooks standing for another router that placed the keys first, its
/// placements not yet seen here: a claim takes a while (an etcd round trip under load),
/// then names the owner `owner` gives for this router's choice.
struct OtherRouterPlaced {
    claims: std::sync::Mutex<Vec<String>>,
    owner: fn(&str) -> &'static str,
}

impl OtherRouterPlaced {
    fn new(owner: fn(&str) -> &'static str) -> Arc<Self> {
        Arc::new(OtherRouterPlaced {
            claims: std::sync::Mutex::default(),
            owner,
        })
    }

    /// The workers this router claimed, in order.
    fn claims(&self) -> Vec<String> {
        self.claims.lock().expect("claims").clone()
    }
}

impl ControlHooks for OtherRouterPlaced {
    fn placement(&self, _key: &PlacementRef) -> Option<KnownPlacement> {
        None
    }
    fn claim(&self, _key: PlacementRef, worker: String) -> BoxFuture<'static, Option<String>> {
        let owner = (self.owner)(&worker);
        self.claims.lock().expect("claims").push(worker);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Some(owner.to_string())
        })
    }
    fn request_done(&self, _usage: RequestUsage) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_arriving_during_a_placement_claim_follow_its_owner() {
    let fleet = fleet();
    let mut workers = Vec::new();
    for id in ["w0", "w1", "w2"] {
        let w = FakeWorker::start(id, &[], Script::QueueFor(Duration::from_millis(300))).await;
        fleet.add_worker(&w.endpoint).await.expect("add worker");
        workers.push(w);
    }
    // It won every key, on a worker other than this router's choice.
    let hooks = OtherRouterPlaced::new(|w| if w == "w0" { "w1" } else { "w0" });
    fleet.set_control_hooks(hooks.clone());

    // Four siblings: 30 shared blocks (their anchor, block 15, lies inside them) and a
    // one-block tail of their own, sent 20 ms apart, so the later ones arrive while the
    // first one's claim is in flight.
    let shared: Vec<u32> = (0..30 * BS).map(|i| i % 300 + 1).collect();
    let mut handles = Vec::new();
    for child in 0..4u32 {
        let mut tokens = shared.clone();
        tokens.extend((0..BS).map(|i| 400 + child * BS + i));
        let spec = chat_spec(&format!("sibling-{child}"), tokens);
        let fleet = fleet.clone();
        handles.push(tokio::spawn(async move {
            dispatch(&fleet, &spec).await.map(|d| d.worker)
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut served = Vec::new();
    for h in handles {
        served.push(h.await.expect("join").expect("dispatched"));
    }
    let claims = hooks.claims();
    assert_eq!(claims.len(), 1, "one claim per key per router: {claims:?}");
    let owner = if claims[0] == "w0" { "w1" } else { "w0" };
    assert!(
        served.iter().all(|w| w == owner),
        "siblings split while the claim was in flight: served by {served:?}, owner {owner}"
    );
}

/// An 8-block prompt (its anchor is its last block), and two answering workers: w0
/// holding nothing, w1 all of the prompt.
async fn sibling_held_by_w1() -> (Arc<GenerationSpec>, FakeWorker, FakeWorker) {
    let tokens: Vec<u32> = (0..8 * BS + 3).map(|i| i % 300 + 1).collect();
    let spec = chat_spec("sibling", tokens);
    let chain: Vec<(u64, Option<u64>)> = spec
        .hashes
        .iter()
        .enumerate()
        .map(|(i, h)| (h.0, i.checked_sub(1).map(|p| spec.hashes[p].0)))
        .collect();
    let w0 = FakeWorker::start("w0", &[], Script::Answer).await;
    let w1 = FakeWorker::start("w1", &chain, Script::Answer).await;
    (spec, w0, w1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_follows_a_fresh_placement_even_where_another_worker_holds_the_prefix() {
    let fleet = fleet();
    let kv = MemKv::new();
    let membership = Arc::new(KvMembership::new(kv.clone()));
    let placement = Arc::new(KvPlacement::new(kv.clone()));
    let (spec, w0, w1) = sibling_held_by_w1().await;
    let _r0 = register(membership.as_ref(), &w0, 1).await;
    let _r1 = register(membership.as_ref(), &w1, 1).await;
    let _rc = RouterControl::start_with(fleet.clone(), placement.clone(), membership, TTL)
        .await
        .expect("start");
    assert!(eventually(|| healthy(&fleet).len() == 2).await);
    assert!(eventually(|| fleet.routing.holds_prefix(&spec.hashes)).await);

    // Another router placed the prompt's anchor on w0 just now (a sibling of this
    // prompt is computing it there): this one follows, though w1 holds all of it.
    let anchor = spec.hashes[7].0;
    placement
        .place(&PlacementKey::prefix_root(anchor), "w0", TTL)
        .await
        .expect("place");
    let hooks = fleet.control.hooks().expect("hooks installed");
    assert!(
        eventually(|| hooks
            .placed_worker(&PlacementRef::PrefixRoot(anchor))
            .is_some())
        .await
    );
    let served = dispatch(&fleet, &spec).await.expect("dispatched").worker;
    assert_eq!(served, "w0", "a sibling left its fresh placement");
    assert_eq!((w0.generates(), w1.generates()), (1, 0));
}

/// A fork sibling whose prefix this router's index already holds (the first sibling's
/// events, through another router, arrived before that router's placement did) was
/// routed on the index alone: with the holder busy computing it, to an idle worker,
/// computing the prefix a second time. Routed away from every holder of its anchor with
/// the key's placement unknown, it now claims the key, and follows the placement found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_routed_away_from_its_held_prefix_claims_it_and_follows_an_unseen_placement() {
    let fleet = Fleet::new(FleetConfig {
        router: RouterConfig {
            block_size: BS as usize,
            ..RouterConfig::default()
        },
        // The loads set below stay until the test ends.
        load_poll_interval: Duration::from_secs(3600),
        ..FleetConfig::default()
    })
    .expect("fleet");
    let (spec, w0, w1) = sibling_held_by_w1().await;
    fleet.add_worker(&w0.endpoint).await.expect("add w0");
    fleet.add_worker(&w1.endpoint).await.expect("add w1");
    assert!(eventually(|| fleet.routing.holds_prefix(&spec.hashes)).await);
    // w1 is busy: far cheaper to compute the prompt on idle w0, on this router's view.
    fleet
        .routing
        .update_load(
            "w1",
            kvfleet_routing::WorkerLoad {
                running: 8,
                waiting: 8,
                queued_prefill_tokens: 1_000_000,
                free_blocks: 1000,
                total_blocks: 1000,
                ..kvfleet_routing::WorkerLoad::default()
            },
        )
        .expect("w1 routed");
    // It placed the prompt's key on w1 a moment ago.
    let hooks = OtherRouterPlaced::new(|_| "w1");
    fleet.set_control_hooks(hooks.clone());

    // Two siblings, the second while the first one's claim is in flight: it waits for
    // that claim and follows its outcome too.
    let first = {
        let (fleet, spec) = (fleet.clone(), spec.clone());
        tokio::spawn(async move { dispatch(&fleet, &spec).await.map(|d| d.worker) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = chat_spec("sibling-2", spec.token_ids.to_vec());
    let served = [
        dispatch(&fleet, &second).await.expect("dispatched").worker,
        first.await.expect("join").expect("dispatched"),
    ];
    assert_eq!(hooks.claims(), ["w0"], "the choice of w0 was claimed, once");
    assert_eq!(
        served,
        ["w1", "w1"],
        "a sibling computed its prefix a second time"
    );
    assert_eq!((w0.generates(), w1.generates()), (0, 2));

    // Routed to a holder, a request claims nothing: the index is enough.
    fleet
        .routing
        .update_load("w1", kvfleet_routing::WorkerLoad::default())
        .expect("w1 routed");
    let again = chat_spec("repeat", spec.token_ids.to_vec());
    assert_eq!(
        dispatch(&fleet, &again).await.expect("dispatched").worker,
        "w1"
    );
    assert_eq!(hooks.claims().len(), 1);
    assert_eq!(w1.generates(), 3);
}
