//! Router restart: how long rebuilding the index of 1M cached blocks takes.
//!
//! - from `CacheDump`s (8 workers × 131,072 blocks, chains of 64): `rebuild_worker`;
//! - from event replay: the same blocks as KV event records (protobuf envelopes of
//!   256 `Stored` events of 64 blocks, as workers publish them), decoded and applied;
//! - from event replay over a real Kafka-protocol broker (tansu, started by the bench
//!   when its binary is found — see scripts/test.sh): consume the records with a fresh
//!   consumer group from the earliest offset, decode, apply. Timed once, printed.
//!
//! `cargo bench --bench control_plane`

use criterion::{Criterion, Throughput};
use kvfleet_control::kafka::{KafkaConfig, KafkaEventStream};
use kvfleet_control::{decode_kv_events, encode_kv_events, EventStream, StartAt, Topic, Topics};
use kvfleet_core::BlockHash;
use kvfleet_proto::kv_events::from_wire as router_event;
use kvfleet_proto::v1 as pb;
use kvfleet_routing::{DumpedBlock, KvRouter, RouterConfig};
use std::hint::black_box;
use std::time::{Duration, Instant};

const WORKERS: usize = 8;
const CHAIN: usize = 64;
const BLOCKS_PER_WORKER: usize = 1 << 17;
const EVENTS_PER_RECORD: usize = 256;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Per worker: its chains of hashes.
fn chains(worker: usize) -> Vec<Vec<u64>> {
    (0..BLOCKS_PER_WORKER / CHAIN)
        .map(|c| {
            let mut h = mix((worker * 1_000_003 + c) as u64);
            (0..CHAIN)
                .map(|i| {
                    h = mix(h ^ i as u64);
                    h
                })
                .collect()
        })
        .collect()
}

fn worker_id(w: usize) -> String {
    format!("worker-{w}")
}

fn dumps() -> Vec<Vec<DumpedBlock>> {
    (0..WORKERS)
        .map(|w| {
            let mut d = Vec::with_capacity(BLOCKS_PER_WORKER);
            for chain in chains(w) {
                let mut parent = None;
                for h in chain {
                    d.push(DumpedBlock::device(BlockHash(h), parent));
                    parent = Some(BlockHash(h));
                }
            }
            d
        })
        .collect()
}

/// (key, payload) records as workers publish them.
fn records() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for w in 0..WORKERS {
        let mut seq = 0;
        let events: Vec<pb::KvEvent> = chains(w)
            .into_iter()
            .map(|chain| {
                seq += 1;
                pb::KvEvent {
                    seq,
                    kind: Some(pb::kv_event::Kind::Stored(pb::kv_event::Stored {
                        medium: Default::default(),
                        parent_hash: None,
                        block_hashes: chain,
                    })),
                }
            })
            .collect();
        for batch in events.chunks(EVENTS_PER_RECORD) {
            let b = pb::KvEventBatch {
                worker_id: worker_id(w),
                events: batch.to_vec(),
                load: None,
            };
            out.push((worker_id(w), encode_kv_events(1, &b)));
        }
    }
    out
}

fn new_router() -> KvRouter {
    let mut r = KvRouter::new(RouterConfig::default());
    for w in 0..WORKERS {
        let _ = r.add_worker(&worker_id(w), 16);
    }
    r
}

fn apply(r: &mut KvRouter, payload: &[u8]) {
    let env = decode_kv_events(payload).expect("decode");
    let batch = env.batch.expect("batch");
    for e in &batch.events {
        r.apply_event(&batch.worker_id, &router_event(e))
            .expect("apply");
    }
}

fn over_kafka(records: &[(String, Vec<u8>)]) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let broker = match std::panic::catch_unwind(kvfleet_control::test_services::KafkaBroker::start)
    {
        Ok(b) => b,
        Err(_) => {
            eprintln!("rebuild over Kafka: skipped (no tansu binary; run scripts/test.sh once)");
            return;
        }
    };
    rt.block_on(async {
        let mut config = KafkaConfig::new(broker.brokers());
        config.topics = Topics::prefixed("bench.");
        config.session_timeout = Duration::from_millis(2000);
        let stream = KafkaEventStream::connect(config).await.expect("connect");
        let t = Instant::now();
        let bytes: usize = records.iter().map(|r| r.1.len()).sum();
        for (k, p) in records {
            stream
                .publish(Topic::KvEvents, k, p.clone())
                .await
                .expect("publish");
        }
        eprintln!(
            "published {} records ({:.1} MB) of 1M blocks in {:?}",
            records.len(),
            bytes as f64 / 1e6,
            t.elapsed()
        );
        let t = Instant::now();
        let mut sub = stream
            .subscribe(Topic::KvEvents, "bench-rebuild", StartAt::Earliest)
            .await
            .expect("subscribe");
        let mut r = new_router();
        let mut first = None;
        for _ in 0..records.len() {
            let rec = sub
                .next(Duration::from_secs(30))
                .await
                .expect("consume")
                .expect("record");
            first.get_or_insert_with(|| t.elapsed());
            apply(&mut r, &rec.payload);
        }
        let total = t.elapsed();
        let first = first.unwrap_or_default();
        eprintln!(
            "rebuild of {} blocks from Kafka replay: {total:?} (group join + first record {first:?}, then consume+decode+apply {:?}); {} indexed blocks",
            WORKERS * BLOCKS_PER_WORKER,
            total - first,
            r.snapshot().indexed_blocks
        );
    });
    drop(broker);
}

fn main() {
    let dumps = dumps();
    let records = records();
    let blocks = (WORKERS * BLOCKS_PER_WORKER) as u64;
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .configure_from_args();
    let mut g = c.benchmark_group("index_rebuild_1M_blocks");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("from_cache_dumps", |b| {
        b.iter(|| {
            let mut r = new_router();
            for (w, d) in dumps.iter().enumerate() {
                r.rebuild_worker(&worker_id(w), d, 1).expect("rebuild");
            }
            black_box(r.snapshot().indexed_blocks)
        })
    });
    g.bench_function("from_event_replay_decode_apply", |b| {
        b.iter(|| {
            let mut r = new_router();
            for (_, p) in &records {
                apply(&mut r, p);
            }
            black_box(r.snapshot().indexed_blocks)
        })
    });
    g.finish();
    over_kafka(&records);
    c.final_summary();
}
