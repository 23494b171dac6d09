//! One conformance suite for every implementation: the same cases run against the
//! in-process store and stream and against a real etcd and a real Kafka-protocol
//! broker (tansu), each started by the test on free loopback ports.
//!
//! Real-service-only cases: the etcd watch survives a server kill + restart mid-stream
//! without missing or repeating a change; a Kafka consumer survives its connection to
//! the broker being cut mid-stream.

use kvfleet_control::etcd::EtcdKv;
use kvfleet_control::kafka::{KafkaConfig, KafkaEventStream};
use kvfleet_control::memory::{MemEventStream, MemKv};
use kvfleet_control::test_services::{EtcdServer, KafkaBroker};
use kvfleet_control::{
    EventStream, KvMembership, KvPlacement, KvStore, MemberEvent, Membership, Placement,
    PlacementEvent, PlacementKey, Record, StartAt, Topic, Topics, WatchStream, WorkerRecord,
};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Two independent clients of one store (two routers), and what keeps it running.
struct KvEnv {
    a: Arc<dyn KvStore>,
    b: Arc<dyn KvStore>,
    _server: Option<EtcdServer>,
}

async fn memory_kv() -> KvEnv {
    let kv = MemKv::new();
    KvEnv {
        a: kv.clone(),
        b: kv,
        _server: None,
    }
}

async fn etcd_kv() -> KvEnv {
    let server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .expect("etcd start task");
    let url = vec![server.url()];
    let a = EtcdKv::connect(&url, Duration::from_secs(5))
        .await
        .expect("etcd client a");
    let b = EtcdKv::connect(&url, Duration::from_secs(5))
        .await
        .expect("etcd client b");
    KvEnv {
        a,
        b,
        _server: Some(server),
    }
}

struct StreamEnv {
    stream: Arc<dyn EventStream>,
    _broker: Option<KafkaBroker>,
}

fn unique_topics() -> Topics {
    static N: AtomicU32 = AtomicU32::new(0);
    Topics::prefixed(&format!(
        "t{}-{}.",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

async fn memory_stream() -> StreamEnv {
    StreamEnv {
        stream: Arc::new(MemEventStream::new(unique_topics(), 1 << 16)),
        _broker: None,
    }
}

fn kafka_config(brokers: String) -> KafkaConfig {
    let mut c = KafkaConfig::new(brokers);
    c.topics = unique_topics();
    // The broker holds a group join for half the session timeout.
    c.session_timeout = Duration::from_millis(2000);
    c
}

async fn kafka_stream() -> StreamEnv {
    let broker = tokio::task::spawn_blocking(KafkaBroker::start)
        .await
        .expect("broker start task");
    let stream = KafkaEventStream::connect(kafka_config(broker.brokers()))
        .await
        .expect("kafka connect");
    StreamEnv {
        stream: Arc::new(stream),
        _broker: Some(broker),
    }
}

fn worker(id: &str) -> WorkerRecord {
    WorkerRecord {
        id: id.into(),
        grpc_addr: format!("127.0.0.1:{}", 5000 + id.len()),
        model: "tiny".into(),
        block_size: 16,
        incarnation: 7,
    }
}

async fn next_within<T>(w: &mut WatchStream<T>, limit: Duration) -> T {
    match tokio::time::timeout(limit, w.next()).await {
        Ok(Some(Ok(x))) => x,
        Ok(Some(Err(e))) => panic!("watch failed: {e}"),
        Ok(None) => panic!("watch ended"),
        Err(_) => panic!("no watch event within {limit:?}"),
    }
}

async fn nothing_within<T: std::fmt::Debug>(w: &mut WatchStream<T>, limit: Duration) {
    if let Ok(Some(x)) = tokio::time::timeout(limit, w.next()).await {
        panic!("unexpected watch item: {x:?}");
    }
}

const WAIT: Duration = Duration::from_secs(10);

mod cases {
    use super::*;

    pub async fn membership_register_list_watch(env: KvEnv) {
        let m = KvMembership::new(env.a.clone());
        let observer = KvMembership::new(env.b.clone());
        let r1 = m
            .register(&worker("w1"), Duration::from_secs(5))
            .await
            .expect("register w1");
        let snap = observer.list().await.expect("list");
        assert_eq!(snap.workers, vec![worker("w1")]);
        let mut watch = observer.watch(snap.revision + 1).await.expect("watch");
        let _r2 = m
            .register(&worker("w2"), Duration::from_secs(5))
            .await
            .expect("register w2");
        match next_within(&mut watch, WAIT).await {
            MemberEvent::Joined { worker: w, .. } => assert_eq!(w, worker("w2")),
            e => panic!("expected w2 to join, got {e:?}"),
        }
        r1.deregister().await.expect("deregister");
        match next_within(&mut watch, WAIT).await {
            MemberEvent::Left { id, .. } => assert_eq!(id, "w1"),
            e => panic!("expected w1 to leave, got {e:?}"),
        }
        let ids: Vec<String> = observer
            .list()
            .await
            .expect("list")
            .workers
            .into_iter()
            .map(|w| w.id)
            .collect();
        assert_eq!(ids, vec!["w2".to_string()]);
    }

    pub async fn membership_keep_alive_holds_and_expiry_removes(env: KvEnv) {
        let m = KvMembership::new(env.a.clone());
        let observer = KvMembership::new(env.b.clone());
        let ttl = Duration::from_secs(2);
        let kept = m.register(&worker("kept"), ttl).await.expect("register");
        // The lease is granted after this instant, and lasts at least a TTL from its
        // grant: how long the register, list and watch calls took does not matter.
        let granted_after = Instant::now();
        let crashed = m.register(&worker("crashed"), ttl).await.expect("register");
        let snap = observer.list().await.expect("list");
        assert_eq!(snap.workers.len(), 2);
        let mut watch = observer.watch(snap.revision + 1).await.expect("watch");
        // Dropping a registration stops its keep-alives, as a crash would.
        drop(crashed);
        match next_within(&mut watch, Duration::from_secs(15)).await {
            MemberEvent::Left { id, .. } => assert_eq!(id, "crashed"),
            e => panic!("expected the crashed worker to leave, got {e:?}"),
        }
        let took = granted_after.elapsed();
        assert!(took >= ttl, "left before its TTL was up: {took:?}");
        // Two TTLs later the kept worker is still there.
        tokio::time::sleep(ttl * 2).await;
        let ids: Vec<String> = observer
            .list()
            .await
            .expect("list")
            .workers
            .into_iter()
            .map(|w| w.id)
            .collect();
        assert_eq!(ids, vec!["kept".to_string()]);
        drop(kept);
    }

    pub async fn watch_from_revision_replays_exactly(env: KvEnv) {
        let a = env.a.clone();
        let r1 = a
            .put("/kvfleet/x/a", b"1".to_vec(), None)
            .await
            .expect("put");
        let r2 = a
            .put("/kvfleet/x/b", b"2".to_vec(), None)
            .await
            .expect("put");
        a.put("/kvfleet/y/ignored", b"-".to_vec(), None)
            .await
            .expect("put");
        let r3 = a
            .put("/kvfleet/x/a", b"3".to_vec(), None)
            .await
            .expect("put");
        assert!(r1 < r2 && r2 < r3);
        let mut w = env.b.watch("/kvfleet/x/", r2).await.expect("watch");
        let c = next_within(&mut w, WAIT).await;
        assert_eq!((c.revision, c.key.as_str()), (r2, "/kvfleet/x/b"));
        let c = next_within(&mut w, WAIT).await;
        assert_eq!((c.revision, c.key.as_str()), (r3, "/kvfleet/x/a"));
        nothing_within(&mut w, Duration::from_millis(300)).await;
    }

    pub async fn placement_cas_race_has_one_winner(env: KvEnv) {
        let p1 = Arc::new(KvPlacement::new(env.a.clone()));
        let p2 = Arc::new(KvPlacement::new(env.b.clone()));
        for round in 0..10 {
            let key = PlacementKey::fork_group(&format!("group/{round}"));
            let (k1, k2) = (key.clone(), key.clone());
            let (q1, q2) = (p1.clone(), p2.clone());
            let ttl = Duration::from_secs(30);
            let a = tokio::spawn(async move { q1.place(&k1, "worker-a", ttl).await });
            let b = tokio::spawn(async move { q2.place(&k2, "worker-b", ttl).await });
            let a = a.await.expect("join").expect("place a");
            let b = b.await.expect("join").expect("place b");
            assert_eq!(a, b, "both routers must see the same owner");
            assert!(a == "worker-a" || a == "worker-b");
            // The loser reads the winner; a later claim changes nothing.
            assert_eq!(p2.owner(&key).await.expect("owner"), Some(a.clone()));
            assert_eq!(p2.place(&key, "worker-c", ttl).await.expect("place"), a);
        }
        let (_, all) = p1.list().await.expect("list");
        assert_eq!(all.len(), 10);
        assert_eq!(all[0].0.key, "group/0");
    }

    pub async fn placement_ttl_expires_and_release_frees(env: KvEnv) {
        let p = KvPlacement::new(env.a.clone());
        let observer = KvPlacement::new(env.b.clone());
        let (rev, _) = observer.list().await.expect("list");
        let mut watch = observer.watch(rev + 1).await.expect("watch");
        let short = PlacementKey::prefix_root(0xabc);
        let long = PlacementKey::fork_group("g");
        assert_eq!(
            p.place(&short, "w1", Duration::from_secs(2))
                .await
                .expect("place"),
            "w1"
        );
        assert_eq!(
            p.place(&long, "w2", Duration::from_secs(60))
                .await
                .expect("place"),
            "w2"
        );
        for _ in 0..2 {
            assert!(matches!(
                next_within(&mut watch, WAIT).await,
                PlacementEvent::Placed { .. }
            ));
        }
        match next_within(&mut watch, Duration::from_secs(15)).await {
            PlacementEvent::Freed { key, .. } => assert_eq!(key, short),
            e => panic!("expected the short placement to expire, got {e:?}"),
        }
        assert_eq!(observer.owner(&short).await.expect("owner"), None);
        assert_eq!(p.release_worker("w2").await.expect("release"), 1);
        match next_within(&mut watch, WAIT).await {
            PlacementEvent::Freed { key, .. } => assert_eq!(key, long),
            e => panic!("expected the released placement to go, got {e:?}"),
        }
        // Free again: the next router to route it places it anew.
        assert_eq!(
            p.place(&long, "w3", Duration::from_secs(60))
                .await
                .expect("place"),
            "w3"
        );
    }

    async fn recv(sub: &mut Box<dyn kvfleet_control::Subscription>) -> Record {
        match sub.next(Duration::from_secs(20)).await {
            Ok(Some(r)) => r,
            Ok(None) => panic!("no record within 20 s"),
            Err(e) => panic!("consume failed: {e}"),
        }
    }

    pub async fn publish_subscribe_keyed_by_worker(env: StreamEnv) {
        let s = env.stream.clone();
        let mut sub = s
            .subscribe(Topic::KvEvents, "g-keyed", StartAt::Earliest)
            .await
            .expect("subscribe");
        let mut published = Vec::new();
        for i in 0..6u8 {
            let key = format!("w{}", i % 2);
            let (p, off) = s
                .publish(Topic::KvEvents, &key, vec![i])
                .await
                .expect("publish");
            published.push((key, vec![i], p, off));
        }
        // Usage records go to their own topic.
        s.publish(Topic::Usage, "w0", b"u".to_vec())
            .await
            .expect("publish usage");
        for (key, payload, p, off) in &published {
            let r = recv(&mut sub).await;
            assert_eq!(&r.key, key);
            assert_eq!(&r.payload, payload);
            assert_eq!((r.partition, r.offset), (*p, *off));
        }
        let mut usage = s
            .subscribe(Topic::Usage, "g-usage", StartAt::Earliest)
            .await
            .expect("subscribe usage");
        assert_eq!(recv(&mut usage).await.payload, b"u".to_vec());
    }

    pub async fn consumer_resumes_from_committed_offset(env: StreamEnv) {
        let s = env.stream.clone();
        for i in 0..10u8 {
            s.publish(Topic::KvEvents, "w", vec![i])
                .await
                .expect("publish");
        }
        {
            let mut sub = s
                .subscribe(Topic::KvEvents, "g-resume", StartAt::Earliest)
                .await
                .expect("subscribe");
            for i in 0..4u8 {
                let r = recv(&mut sub).await;
                assert_eq!(r.payload, vec![i]);
                sub.commit(&r).await.expect("commit");
            }
            // Read one more without committing, then go away mid-stream.
            assert_eq!(recv(&mut sub).await.payload, vec![4]);
        }
        for i in 10..12u8 {
            s.publish(Topic::KvEvents, "w", vec![i])
                .await
                .expect("publish");
        }
        // `Latest` must not apply: the group has a committed offset.
        let mut sub = s
            .subscribe(Topic::KvEvents, "g-resume", StartAt::Latest)
            .await
            .expect("resubscribe");
        for i in 4..12u8 {
            let r = recv(&mut sub).await;
            assert_eq!(r.payload, vec![i], "resumed at the wrong record");
            sub.commit(&r).await.expect("commit");
        }
        // Another group has its own offsets: it starts from the beginning.
        let mut fresh = s
            .subscribe(Topic::KvEvents, "g-fresh", StartAt::Earliest)
            .await
            .expect("subscribe");
        assert_eq!(recv(&mut fresh).await.payload, vec![0]);
    }
}

macro_rules! kv_suite {
    ($name:ident, $setup:path) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn membership_register_list_watch() {
                cases::membership_register_list_watch($setup().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn membership_keep_alive_holds_and_expiry_removes() {
                cases::membership_keep_alive_holds_and_expiry_removes($setup().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn watch_from_revision_replays_exactly() {
                cases::watch_from_revision_replays_exactly($setup().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn placement_cas_race_has_one_winner() {
                cases::placement_cas_race_has_one_winner($setup().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn placement_ttl_expires_and_release_frees() {
                cases::placement_ttl_expires_and_release_frees($setup().await).await
            }
        }
    };
}

macro_rules! stream_suite {
    ($name:ident, $setup:path) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn publish_subscribe_keyed_by_worker() {
                cases::publish_subscribe_keyed_by_worker($setup().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn consumer_resumes_from_committed_offset() {
                cases::consumer_resumes_from_committed_offset($setup().await).await
            }
        }
    };
}

kv_suite!(memory_store, memory_kv);
kv_suite!(etcd_store, etcd_kv);
stream_suite!(memory_stream_suite, memory_stream);
stream_suite!(kafka_stream_suite, kafka_stream);

/// Kill etcd mid-stream and start it again: the watch resumes from the last revision
/// seen + 1 — no change missed, none repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_resumes_after_server_restart() {
    let mut server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .expect("etcd");
    let url = vec![server.url()];
    let kv = EtcdKv::connect(&url, Duration::from_secs(3))
        .await
        .expect("client");
    let mut watch = kv.watch("/kvfleet/r/", 1).await.expect("watch");
    for i in 0..3 {
        kv.put(&format!("/kvfleet/r/{i}"), vec![i], None)
            .await
            .expect("put");
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(next_within(&mut watch, WAIT).await);
    }
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .expect("restart");
    // The client reconnects by itself; retry until the server takes writes.
    let t = Instant::now();
    let mut i = 3u8;
    while i < 6 {
        match kv.put(&format!("/kvfleet/r/{i}"), vec![i], None).await {
            Ok(_) => i += 1,
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                tracing::debug!("put after restart: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("etcd did not come back: {e}"),
        }
    }
    for _ in 0..3 {
        seen.push(next_within(&mut watch, Duration::from_secs(30)).await);
    }
    nothing_within(&mut watch, Duration::from_millis(500)).await;
    let keys: Vec<&str> = seen.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "/kvfleet/r/0",
            "/kvfleet/r/1",
            "/kvfleet/r/2",
            "/kvfleet/r/3",
            "/kvfleet/r/4",
            "/kvfleet/r/5"
        ]
    );
    assert!(seen.windows(2).all(|w| w[0].revision < w[1].revision));
    drop(server);
}

/// Membership survives an etcd restart too: the worker's keep-alive resumes and the
/// router's watch sees a worker that joins afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_membership_survives_server_restart() {
    let mut server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .expect("etcd");
    let url = vec![server.url()];
    let kv = EtcdKv::connect(&url, Duration::from_secs(3))
        .await
        .expect("client");
    let m = KvMembership::new(kv.clone());
    let reg = m
        .register(&worker("steady"), Duration::from_secs(10))
        .await
        .expect("register");
    let snap = m.list().await.expect("list");
    let mut watch = m.watch(snap.revision + 1).await.expect("watch");
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .expect("restart");
    let t = Instant::now();
    let _late = loop {
        match m.register(&worker("late"), Duration::from_secs(10)).await {
            Ok(r) => break r,
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                tracing::debug!("register after restart: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("etcd did not come back: {e}"),
        }
    };
    match next_within(&mut watch, Duration::from_secs(30)).await {
        MemberEvent::Joined { worker: w, .. } => assert_eq!(w.id, "late"),
        e => panic!("expected the late worker, got {e:?}"),
    }
    let ids: Vec<String> = m
        .list()
        .await
        .expect("list")
        .workers
        .into_iter()
        .map(|w| w.id)
        .collect();
    assert_eq!(ids, vec!["late".to_string(), "steady".to_string()]);
    drop(reg);
    drop(server);
}

/// Cut every connection between a consumer and the broker mid-stream: the consumer
/// reconnects and continues with the next record — none lost, none repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_survives_connection_cut() {
    use kvfleet_control::test_services::{free_port, TcpProxy};
    let broker_port = free_port();
    let proxy = TcpProxy::start(broker_port).await;
    let proxy_port = proxy.port;
    let broker =
        tokio::task::spawn_blocking(move || KafkaBroker::start_on(broker_port, proxy_port))
            .await
            .expect("broker");
    let stream = KafkaEventStream::connect(kafka_config(format!("127.0.0.1:{proxy_port}")))
        .await
        .expect("connect");
    for i in 0..5u8 {
        stream
            .publish(Topic::KvEvents, "w", vec![i])
            .await
            .expect("publish");
    }
    let mut sub = stream
        .subscribe(Topic::KvEvents, "g-cut", StartAt::Earliest)
        .await
        .expect("subscribe");
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = sub
            .next(Duration::from_secs(20))
            .await
            .expect("next")
            .expect("record");
        sub.commit(&r).await.expect("commit");
        got.push(r.payload[0]);
    }
    let cut = proxy.cut();
    assert!(cut > 0, "no connection was open to cut");
    for i in 5..10u8 {
        stream
            .publish(Topic::KvEvents, "w", vec![i])
            .await
            .expect("publish after cut");
    }
    while got.len() < 10 {
        match sub.next(Duration::from_secs(30)).await {
            Ok(Some(r)) => {
                let _ = sub.commit(&r).await;
                got.push(r.payload[0]);
            }
            Ok(None) => panic!("no record within 30 s after the cut; got {got:?}"),
            Err(e) => tracing::debug!("consumer error after the cut (retrying): {e}"),
        }
    }
    assert_eq!(got, (0..10u8).collect::<Vec<_>>());
    drop(broker);
}
