//! A gap in a worker's KV event sequence, end to end over real gRPC: the router
//! notices the skipped seq on the worker's `KvEvents` stream, resyncs that worker from
//! its `CacheDump` (`kvfleet_index_resyncs_total` +1), and its index then equals the
//! worker's dump.
//!
//! The gap is injected into the worker's event log: an event two seqs ahead, naming a
//! block the engine does not hold, so only a resync from the dump can drop it.

use kvfleet_core::{hash_blocks, namespace_seed, BlockHash, DEFAULT_BLOCK_SIZE};
use kvfleet_engine::{KvEvent, KvEventSink};
use kvfleet_proto::v1 as pb;
use kvfleet_router::worker_conn::{ConnTimeouts, WorkerConn};
use kvfleet_router::{fleet_metrics, Fleet, FleetConfig};
use kvfleet_worker::{serve_service, WorkerConfig, WorkerModel, WorkerService};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const BOGUS: BlockHash = BlockHash(0xdead_beef_dead_beef);

fn resyncs(worker: &str) -> f64 {
    let text = fleet_metrics::prometheus_handle()
        .map(|h| h.render())
        .unwrap_or_default();
    let series = format!("kvfleet_index_resyncs_total{{worker=\"{worker}\"}}");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str())?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn router_blocks(fleet: &Fleet, worker: &str) -> BTreeSet<u64> {
    fleet
        .routing
        .worker_blocks(worker)
        .expect("worker registered")
        .into_iter()
        .map(|b| b.hash.0)
        .collect()
}

async fn dump_blocks(conn: &WorkerConn) -> (BTreeSet<u64>, u64) {
    let d = conn.cache_dump().await.expect("dump");
    (d.blocks.iter().map(|b| b.hash).collect(), d.seq)
}

async fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_gap_resyncs_the_workers_index_from_its_dump() {
    fleet_metrics::prometheus_handle();
    let service = WorkerService::start(WorkerConfig::new(
        String::from("gap-w0"),
        WorkerModel::Spec("tiny".into()),
    ))
    .await
    .expect("worker");
    let log = service.event_log().clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_service(service, listener, async move {
        let _ = stop_rx.await;
    }));
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    fleet.add_worker(&addr).await.expect("add worker");
    let conn = WorkerConn::connect_with(&addr, ConnTimeouts::default(), None)
        .await
        .expect("connect");

    // Real cached blocks: one generation of a 4-block prompt.
    let tokens: Vec<u32> = (0..(4 * DEFAULT_BLOCK_SIZE as u32))
        .map(|i| 97 + i % 26)
        .collect();
    let hashes = hash_blocks(namespace_seed("tiny", ""), &tokens, DEFAULT_BLOCK_SIZE);
    let mut stream = conn
        .generate(pb::GenerateRequest {
            request_id: "gap-1".into(),
            model: "tiny".into(),
            token_ids: tokens,
            block_hashes: hashes.iter().map(|h| h.0).collect(),
            block_size: DEFAULT_BLOCK_SIZE as u32,
            sampling: Some(pb::SamplingParams {
                max_tokens: 2,
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("generate");
    while stream.message().await.expect("stream").is_some() {}
    let (dump, _) = dump_blocks(&conn).await;
    assert!(dump.len() >= 4, "the prompt's blocks are cached: {dump:?}");
    wait_for("the router to index the blocks", || {
        router_blocks(&fleet, "gap-w0") == dump
    })
    .await;
    let before = resyncs("gap-w0");

    // The gap: seq last+2 (last+1 never comes), naming a block nobody holds.
    let skipped_to = log.last_seq() + 2;
    log.publish(&KvEvent::stored(skipped_to, None, vec![BOGUS]));
    wait_for("a resync", || resyncs("gap-w0") > before).await;
    let (dump, _) = dump_blocks(&conn).await;
    wait_for("the index to equal the dump", || {
        router_blocks(&fleet, "gap-w0") == dump
    })
    .await;
    assert!(!router_blocks(&fleet, "gap-w0").contains(&BOGUS.0));
    // The injected seq is ahead of the engine's own counter (which the dump reports),
    // so the router resyncs again each time it meets it; a real gap resyncs once.
    assert!(resyncs("gap-w0") >= before + 1.0);

    let _ = stop_tx.send(());
    fleet.remove_worker("gap-w0");
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
}
