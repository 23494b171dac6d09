//! The worker over real gRPC on loopback, driven by the generated tonic client.

use kvfleet_core::{hash_blocks, namespace_seed};
use kvfleet_proto::v1 as pb;
use kvfleet_proto::v1::worker_client::WorkerClient;
use kvfleet_worker::{spawn_worker, WorkerConfig, WorkerError};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::{Code, Streaming};

mod common;

use common::{prompt, worker, BS};

fn request(id: &str, tokens: Vec<u32>, max_tokens: i32) -> pb::GenerateRequest {
    let hashes = hash_blocks(namespace_seed("tiny", ""), &tokens, BS)
        .into_iter()
        .map(|h| h.0)
        .collect();
    pb::GenerateRequest {
        request_id: id.to_string(),
        model: "tiny".into(),
        token_ids: tokens,
        block_hashes: hashes,
        block_size: BS as u32,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn collect(mut stream: Streaming<pb::GenerateResponse>) -> Vec<pb::GenerateResponse> {
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.expect("stream item") {
        out.push(m);
    }
    out
}

async fn generate(
    client: &mut WorkerClient<Channel>,
    req: pb::GenerateRequest,
) -> Vec<pb::GenerateResponse> {
    let stream = client.generate(req).await.expect("accepted").into_inner();
    collect(stream).await
}

fn last_usage(msgs: &[pb::GenerateResponse]) -> pb::Usage {
    msgs.last()
        .and_then(|m| m.usage)
        .expect("final message has usage")
}

async fn load(client: &mut WorkerClient<Channel>) -> pb::LoadResponse {
    client
        .load(pb::LoadRequest {})
        .await
        .expect("load")
        .into_inner()
}

/// The next batch with events (batches that only push the worker's load are skipped).
async fn next_batch(stream: &mut Streaming<pb::KvEventBatch>) -> pb::KvEventBatch {
    loop {
        let b = next_message(stream).await;
        if !b.events.is_empty() {
            return b;
        }
    }
}

async fn next_message(stream: &mut Streaming<pb::KvEventBatch>) -> pb::KvEventBatch {
    tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("a batch in time")
        .expect("no error")
        .expect("stream open")
}

#[tokio::test]
async fn unusable_configurations_fail_to_start() {
    let err = spawn_worker(WorkerConfig::new("w", "no-such-model"))
        .await
        .expect_err("unknown model");
    assert!(matches!(err, WorkerError::Engine(_)), "{err}");
    let mut c = WorkerConfig::new("w", "tiny");
    c.block_size = 0;
    assert!(spawn_worker(c).await.is_err());
    let mut c = WorkerConfig::new("w", "tiny");
    c.event_ring_capacity = 0;
    assert!(matches!(spawn_worker(c).await, Err(WorkerError::Config(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_worker_reports_its_whole_pool_free() {
    // Before any request: the pool's size and every block free (a router prices a
    // worker's KV usage from these; zeros used to stand until the first step).
    let (_handle, mut client) = worker("w-fresh", |_| {}).await;
    let l = load(&mut client).await;
    assert_eq!((l.total_blocks, l.free_blocks), (256, 256), "{l:?}");
    assert_eq!(l.running + l.waiting, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_streams_tokens_and_second_request_hits_the_cache() {
    let (handle, mut client) = worker("w-gen", |_| {}).await;
    let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.worker_id, "w-gen");
    assert_eq!(info.model_id, "tiny");
    assert_eq!((info.block_size, info.num_blocks), (BS as u32, 256));
    assert_eq!(info.vocab_size, 320);
    assert!(info.max_context > 0);
    assert_eq!(info.device, "cpu");

    let tokens = prompt(1, 100);
    let first = generate(&mut client, request("a", tokens.clone(), 8)).await;
    let all: Vec<u32> = first.iter().flat_map(|m| m.token_ids.clone()).collect();
    assert_eq!(all.len(), 8);
    let head = first[0].usage.expect("first message carries usage");
    assert_eq!(head.prompt_tokens, 100);
    assert_eq!(head.cached_tokens, 0);
    let last = first.last().unwrap();
    assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
    let u = last_usage(&first);
    assert_eq!((u.prompt_tokens, u.completion_tokens), (100, 8));
    let t = last.timings.expect("final message has timings");
    assert!(t.total_ms >= t.ttft_ms && t.ttft_ms >= t.queue_ms && t.queue_ms >= 0.0);
    for m in &first[..first.len() - 1] {
        assert_eq!(m.finish_reason, pb::FinishReason::Unspecified as i32);
        assert!(m.timings.is_none());
    }

    let second = generate(&mut client, request("a", tokens, 8)).await;
    let u2 = last_usage(&second);
    assert!(
        u2.cached_tokens as usize >= 100 - BS,
        "second request cached only {} of 100",
        u2.cached_tokens
    );
    assert_eq!(
        second[0].usage.map(|u| u.cached_tokens),
        Some(u2.cached_tokens)
    );
    // Greedy and identical: the same tokens.
    let all2: Vec<u32> = second.iter().flat_map(|m| m.token_ids.clone()).collect();
    assert_eq!(all, all2);
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_siblings_compute_the_shared_prefix_once() {
    let (handle, client) = worker("w-siblings", |_| {}).await;
    let shared = prompt(2, 320);
    let child = |tail_seed: u32| {
        let mut t = shared.clone();
        t.extend(prompt(tail_seed, 10));
        t
    };
    let (mut c1, mut c2) = (client.clone(), client.clone());
    let (r1, r2) = tokio::join!(
        generate(&mut c1, request("child-1", child(10), 4)),
        generate(&mut c2, request("child-2", child(11), 4)),
    );
    let (u1, u2) = (last_usage(&r1), last_usage(&r2));
    assert_eq!((u1.prompt_tokens, u2.prompt_tokens), (330, 330));
    assert!(
        u1.cached_tokens.max(u2.cached_tokens) >= 320,
        "one child reuses the other's prefix: {u1:?} {u2:?}"
    );
    let mut client = client;
    let l = load(&mut client).await;
    assert_eq!(l.prompt_tokens, 660);
    assert!(
        l.prompt_tokens_computed <= 330 + 10 + BS as u64,
        "the shared prefix was computed twice: {} prompt tokens computed",
        l.prompt_tokens_computed
    );
    assert_eq!(
        l.cached_tokens,
        u64::from(u1.cached_tokens + u2.cached_tokens)
    );
    handle.shutdown().await.unwrap();
}

/// Applies `batch` to a model of the cache (hash → parent); returns the seqs seen.
fn apply(cache: &mut HashMap<u64, Option<u64>>, batch: &pb::KvEventBatch) -> Vec<u64> {
    use pb::kv_event::Kind;
    for e in &batch.events {
        match e.kind.as_ref().expect("event kind") {
            Kind::Stored(s) => {
                let mut parent = s.parent_hash;
                for h in &s.block_hashes {
                    cache.insert(*h, parent);
                    parent = Some(*h);
                }
            }
            Kind::Removed(r) => {
                for h in &r.block_hashes {
                    cache.remove(h);
                }
            }
            Kind::Cleared(_) => cache.clear(),
        }
    }
    batch.events.iter().map(|e| e.seq).collect()
}

/// The event stream pushes the worker's load: once a request ends, a batch says the
/// worker is idle, and it is ordered after a `Load` poll taken while the request ran,
/// so a router that polled mid-request learns at once that the work ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_pushes_the_load_once_a_request_ends() {
    let (_handle, mut client) = worker("w-push", |c| {
        // Steps slow enough for a poll to find the request running.
        c.faults.step_delay = Some(Duration::from_millis(5));
    })
    .await;
    let mut events = client
        .kv_events(pb::KvEventsRequest { from_seq: 1 })
        .await
        .expect("subscribe")
        .into_inner();
    let running = client
        .generate(request("r1", prompt(5, 96), 40))
        .await
        .expect("accepted")
        .into_inner();
    let deadline = Instant::now() + Duration::from_secs(20);
    let busy = loop {
        let l = load(&mut client).await;
        if l.running + l.waiting > 0 {
            break l;
        }
        assert!(Instant::now() < deadline, "never saw the request running");
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    assert!(busy.load_seq > 0, "a poll carries the load's seq");
    let msgs = collect(running).await;
    assert_eq!(last_usage(&msgs).completion_tokens, 40);
    let mut stored = 0;
    let idle = loop {
        let b = next_message(&mut events).await;
        assert_eq!(b.worker_id, "w-push");
        stored += b.events.len();
        if let Some(l) = b.load.filter(|l| l.load_seq > busy.load_seq) {
            if (l.running, l.waiting, l.queued_prefill_tokens) == (0, 0, 0) {
                break l;
            }
        }
    };
    assert!(stored > 0, "the prompt's blocks were stored first");
    assert_eq!(idle.total_blocks, 256);
    assert!(
        idle.cached_blocks > busy.cached_blocks,
        "the prompt's blocks are cached now: {idle:?} against {busy:?}"
    );
    assert!(
        idle.last_event_seq >= 1,
        "stamped with the events before it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_replay_then_live_and_match_the_cache_dump() {
    let (handle, mut client) = worker("w-events", |_| {}).await;
    let p1 = prompt(3, 64);
    generate(&mut client, request("r1", p1.clone(), 2)).await;

    let mut events = client
        .kv_events(pb::KvEventsRequest { from_seq: 1 })
        .await
        .expect("subscribe")
        .into_inner();
    let mut cache = HashMap::new();
    let mut seqs = Vec::new();
    let replayed = next_batch(&mut events).await;
    assert_eq!(replayed.worker_id, "w-events");
    seqs.extend(apply(&mut cache, &replayed));
    assert_eq!(seqs[0], 1);
    let expect1 = hash_blocks(namespace_seed("tiny", ""), &p1, BS);
    for h in &expect1[..3] {
        assert!(cache.contains_key(&h.0), "replay lacks block {h}");
    }
    assert_eq!(cache.get(&expect1[1].0), Some(&Some(expect1[0].0)));

    // Live: a new prompt's blocks arrive on the same stream, continuing the sequence.
    let p2 = prompt(4, 48);
    generate(&mut client, request("r2", p2.clone(), 2)).await;
    let expect2 = hash_blocks(namespace_seed("tiny", ""), &p2, BS);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cache.contains_key(&expect2[1].0) {
        assert!(Instant::now() < deadline, "live events did not arrive");
        seqs.extend(apply(&mut cache, &next_batch(&mut events).await));
    }
    let want: Vec<u64> = (1..=*seqs.last().unwrap()).collect();
    assert_eq!(seqs, want, "events without gaps or duplicates");

    let dump = client
        .cache_dump(pb::CacheDumpRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dump.worker_id, "w-events");
    assert_eq!(
        dump.seq,
        *seqs.last().unwrap(),
        "dump reflects every event seen"
    );
    let dumped: HashMap<u64, Option<u64>> = dump
        .blocks
        .iter()
        .map(|b| (b.hash, b.parent_hash))
        .collect();
    assert_eq!(dumped, cache, "dump equals the cache the events describe");
    // Load carries the newest event's seq: routers compare it with their index's to
    // export how far behind the event stream they are.
    assert_eq!(load(&mut client).await.last_event_seq, dump.seq);
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_outside_the_ring_are_out_of_range() {
    let (handle, mut client) = worker("w-ring", |c| c.event_ring_capacity = 2).await;
    for i in 0..4 {
        generate(
            &mut client,
            request(&format!("r{i}"), prompt(20 + i, 40), 1),
        )
        .await;
    }
    let dump = client
        .cache_dump(pb::CacheDumpRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(dump.seq >= 4, "one event per distinct prompt at least");
    let err = client
        .kv_events(pb::KvEventsRequest { from_seq: 1 })
        .await
        .expect_err("event 1 left the ring");
    assert!(
        matches!(err.code(), Code::OutOfRange | Code::FailedPrecondition),
        "{err:?}"
    );
    assert!(err.message().contains("CacheDump"), "{}", err.message());
    // A sequence number this worker never reached (the router saw an earlier process).
    let err = client
        .kv_events(pb::KvEventsRequest {
            from_seq: dump.seq + 100,
        })
        .await
        .expect_err("ahead of the worker");
    assert_eq!(err.code(), Code::OutOfRange);
    // Resuming right after the dump works.
    client
        .kv_events(pb::KvEventsRequest {
            from_seq: dump.seq + 1,
        })
        .await
        .expect("resume after a dump");
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_arguments_and_the_worker_keeps_serving() {
    let (handle, mut client) = worker("w-bad", |_| {}).await;
    let good = || request("ok", prompt(5, 40), 2);
    let mut cases: Vec<(&str, pb::GenerateRequest)> = Vec::new();
    let mut r = good();
    r.token_ids.clear();
    r.block_hashes.clear();
    cases.push(("empty prompt", r));
    let mut r = good();
    r.token_ids[3] = 320;
    r.block_hashes.clear();
    cases.push(("token id >= vocab", r));
    let mut r = good();
    r.block_hashes[1] ^= 1;
    cases.push(("mismatched block hash", r));
    let mut r = good();
    r.cache_salt = "tenant-b".into();
    cases.push(("hashes from another salt", r));
    let mut r = good();
    r.block_hashes.push(42);
    r.block_hashes.push(43);
    cases.push(("more hashes than full blocks", r));
    let mut r = good();
    r.block_size = 32;
    cases.push(("wrong block size", r));
    let mut r = good();
    r.block_size = 0;
    cases.push(("hashes without a block size", r));
    let mut r = good();
    r.model = "llama-70b".into();
    cases.push(("wrong model", r));
    for max_tokens in [0, -5] {
        let mut r = good();
        r.sampling.as_mut().unwrap().max_tokens = max_tokens;
        cases.push(("max_tokens", r));
    }
    let mut r = good();
    r.sampling.as_mut().unwrap().top_p = Some(1.5);
    cases.push(("top_p", r));
    // Stop strings and stop token ids are bounded (kvfleet_core::openai): the engine
    // thread checks them on every token.
    let mut r = good();
    r.sampling.as_mut().unwrap().stop = ["a", "b", "c", "d", "e"].map(String::from).to_vec();
    cases.push(("five stop strings", r));
    let mut r = good();
    r.sampling.as_mut().unwrap().stop = vec!["x".repeat(257)];
    cases.push(("a 257-byte stop string", r));
    let mut r = good();
    r.sampling.as_mut().unwrap().stop_token_ids = (1..=65).collect();
    cases.push(("65 stop token ids", r));
    for (what, req) in cases {
        let err = client.generate(req).await.expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        assert!(!err.message().is_empty(), "{what}: empty message");
        if what.contains("hash") || what.contains("block size") {
            assert!(
                err.message().contains("mismatch"),
                "{what}: {}",
                err.message()
            );
        }
    }
    // Still serving, and a request without hashes or block size is fine too.
    let msgs = generate(&mut client, good()).await;
    assert_eq!(last_usage(&msgs).completion_tokens, 2);
    let mut r = good();
    r.block_hashes.clear();
    r.block_size = 0;
    r.model.clear();
    r.sampling = None;
    let msgs = generate(&mut client, r).await;
    assert!(last_usage(&msgs).completion_tokens >= 1);
    let l = load(&mut client).await;
    assert_eq!((l.running, l.waiting), (0, 0));
    handle.shutdown().await.unwrap();
}

async fn wait_idle(client: &mut WorkerClient<Channel>) -> pb::LoadResponse {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let l = load(client).await;
        if l.running == 0 && l.waiting == 0 {
            return l;
        }
        assert!(
            Instant::now() < deadline,
            "request still in the engine: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_aborts_its_request() {
    let (handle, mut client) = worker("w-drop", |_| {}).await;
    let max = 2000;
    let mut stream = client
        .generate(request("long", prompt(6, 40), max))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("a first message");
    assert!(!first.token_ids.is_empty());
    drop(stream);
    let l = wait_idle(&mut client).await;
    assert!(
        l.generated_tokens < max as u64,
        "the engine kept generating for a gone client: {}",
        l.generated_tokens
    );
    // The id is free again.
    let msgs = generate(&mut client, request("long", prompt(6, 40), 2)).await;
    assert_eq!(last_usage(&msgs).completion_tokens, 2);
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_ends_the_stream_with_aborted() {
    let (handle, mut client) = worker("w-abort", |_| {}).await;
    let mut stream = client
        .generate(request("to-abort", prompt(7, 40), 2000))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("a first message");
    // A second request with the same id is refused while the first runs.
    let err = client
        .generate(request("to-abort", prompt(7, 40), 2))
        .await
        .expect_err("duplicate id");
    assert_eq!(err.code(), Code::AlreadyExists);
    let found = client
        .abort(pb::AbortRequest {
            request_id: "to-abort".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .found;
    assert!(found);
    let rest = collect(stream).await;
    let last = rest.last().expect("a final message");
    assert_eq!(last.finish_reason, pb::FinishReason::Aborted as i32);
    assert!(last.usage.is_some() && last.timings.is_some());
    wait_idle(&mut client).await;
    let again = client
        .abort(pb::AbortRequest {
            request_id: "to-abort".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.found);
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_graceful_with_live_event_subscribers() {
    let (handle, mut client) = worker("w-shutdown", |_| {}).await;
    let mut events = client
        .kv_events(pb::KvEventsRequest { from_seq: 0 })
        .await
        .unwrap()
        .into_inner();
    let mut stream = client
        .generate(request("finishing", prompt(8, 40), 64))
        .await
        .unwrap()
        .into_inner();
    stream
        .message()
        .await
        .unwrap()
        .expect("the request is running");
    // Shut down while it runs: the request still finishes, then the worker stops.
    let (stopped, rest) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(30), handle.shutdown()),
        collect(stream),
    );
    stopped
        .expect("shutdown does not hang")
        .expect("clean shutdown");
    assert_eq!(
        rest.last().map(|m| m.finish_reason),
        Some(pb::FinishReason::Length as i32)
    );
    // The event stream ended (after any events it had) with UNAVAILABLE.
    let mut seen = HashSet::new();
    loop {
        match events.message().await {
            Ok(Some(b)) => seen.extend(b.events.iter().map(|e| e.seq)),
            Ok(None) => break,
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                break;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_cache_dump_and_abort_answer_while_a_long_step_runs() {
    // Every engine step takes 4 s (a long prefill on a real model): the unary calls
    // must not wait behind it, or a busy worker looks dead to its routers.
    let (handle, mut client) = worker("w-slow-step", |c| {
        c.faults.step_delay = Some(Duration::from_secs(4));
    })
    .await;
    let stream = client
        .generate(request("slow", prompt(3, 40), 4))
        .await
        .expect("accepted")
        .into_inner();
    // The engine thread is now inside its first step.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prompt_answer = Duration::from_secs(1);
    let l = tokio::time::timeout(prompt_answer, client.load(pb::LoadRequest {}))
        .await
        .expect("Load answered during the step")
        .expect("load")
        .into_inner();
    assert_eq!(l.running + l.waiting, 1, "{l:?}");
    assert_eq!(l.total_blocks, 256);
    tokio::time::timeout(prompt_answer, client.cache_dump(pb::CacheDumpRequest {}))
        .await
        .expect("CacheDump answered during the step")
        .expect("cache dump");
    let found = tokio::time::timeout(
        prompt_answer,
        client.abort(pb::AbortRequest {
            request_id: "slow".into(),
        }),
    )
    .await
    .expect("Abort answered during the step")
    .expect("abort")
    .into_inner()
    .found;
    assert!(found);
    // The abort is carried out once the step ends.
    let msgs = collect(stream).await;
    let last = msgs.last().expect("a final message");
    assert_eq!(last.finish_reason, pb::FinishReason::Aborted as i32);
    handle.shutdown().await.unwrap();
}

/// Every block of a `FetchBlocks` answer, within `within`.
async fn fetch_all(
    client: &mut WorkerClient<Channel>,
    info: &pb::InfoResponse,
    hashes: &[u64],
    within: Duration,
) -> Vec<pb::KvBlockData> {
    let req = pb::FetchBlocksRequest {
        block_hashes: hashes.to_vec(),
        block_format: info.kv_block_format.clone(),
        block_bytes: info.kv_block_bytes,
    };
    tokio::time::timeout(within, async {
        let mut stream = client.fetch_blocks(req).await.expect("fetch").into_inner();
        let mut out = Vec::new();
        while let Some(b) = stream.message().await.expect("block") {
            out.push(b);
        }
        out
    })
    .await
    .expect("FetchBlocks answered in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_blocks_is_served_while_a_long_step_runs() {
    // A pull goes to a holder because it is busy: its blocks must not wait for the
    // step in progress (4 s here, a long prefill on a real model).
    let (handle, mut client) = worker("w-export-busy", |c| {
        c.faults.step_delay = Some(Duration::from_secs(4));
    })
    .await;
    let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
    let held = prompt(7, 3 * BS + 5);
    generate(&mut client, request("held", held.clone(), 1)).await;
    let want = common::hashes(&held);
    assert_eq!(want.len(), 3);
    let idle = fetch_all(&mut client, &info, &want, Duration::from_secs(10)).await;
    assert_eq!(idle.len(), 3, "the idle holder serves every block");

    let busy_stream = client
        .generate(request("busy", prompt(8, 40), 1))
        .await
        .expect("accepted")
        .into_inner();
    // The engine thread is now inside its step.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = fetch_all(&mut client, &info, &want, Duration::from_secs(1)).await;
    assert_eq!(busy.len(), 3, "served during the step");
    for (a, b) in idle.iter().zip(&busy) {
        assert_eq!(a.hash, b.hash);
        assert_eq!(a.parent_hash, b.parent_hash);
        assert_eq!(a.data.len() as u64, info.kv_block_bytes);
        assert_eq!(a.data, b.data, "the same K/V, whichever thread copied it");
    }
    collect(busy_stream).await;
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_request_is_acknowledged_at_once_with_its_queue_position() {
    // One sequence at a time: while `a` runs, later requests wait in the queue.
    let (handle, mut client) = worker("w-ack", |c| c.max_num_seqs = 1).await;
    let mut running = client
        .generate(request("a", prompt(1, 40), 3000))
        .await
        .unwrap()
        .into_inner();
    let head = running.message().await.unwrap().expect("a's first message");
    assert!(
        head.accepted.is_none(),
        "not asked for: no acceptance message"
    );
    assert!(head.usage.is_some(), "{head:?}");

    let mut acks = Vec::new();
    let mut queued = Vec::new();
    for id in ["b", "c"] {
        let mut req = request(id, prompt(2, 40), 4);
        req.report_acceptance = true;
        let mut s = client.generate(req).await.unwrap().into_inner();
        let first = tokio::time::timeout(Duration::from_secs(10), s.message())
            .await
            .expect("acknowledged without waiting for the running request")
            .unwrap()
            .expect("an acceptance message");
        acks.push(first);
        queued.push(s);
    }
    for (ack, position) in acks.iter().zip([0, 1]) {
        let a = ack.accepted.expect("the first message is the acceptance");
        assert_eq!(a.queue_position, position, "{ack:?}");
        assert!(ack.token_ids.is_empty() && ack.usage.is_none(), "{ack:?}");
    }
    // The acceptance came while `a` still held the only slot.
    let l = load(&mut client).await;
    assert_eq!((l.running, l.waiting), (1, 2), "{l:?}");

    let ok = client
        .abort(pb::AbortRequest {
            request_id: "a".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ok.found);
    for s in queued {
        let msgs = collect(s).await;
        assert!(msgs[0].usage.is_some(), "then the prompt's usage: {msgs:?}");
        assert!(
            msgs.iter().all(|m| m.accepted.is_none()),
            "acknowledged once"
        );
        assert_eq!(last_usage(&msgs).completion_tokens, 4);
    }
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_from_a_hung_peer_is_given_up_at_once_and_the_prompt_computed() {
    // A peer whose kernel completes the TCP handshake but which never answers, as a
    // SIGSTOPped worker does. The router's first-token deadline runs while the worker
    // pulls (it acknowledges the request only after), so waiting out the whole pull
    // deadline made a healthy worker miss it: the request was retried elsewhere, or
    // lost when there was nowhere else to go.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let peer = format!("http://{}", hung.local_addr().expect("addr"));
    let (handle, mut client) = worker("w-pull", |_| {}).await;
    let tokens = prompt(7, 40);
    let mut req = request("pulls", tokens.clone(), 4);
    req.report_acceptance = true;
    req.pull = Some(pb::PeerPull {
        peer_endpoint: peer,
        first_block: 0,
        end_block: 2,
    });
    let asked = Instant::now();
    let answered = tokio::time::timeout(Duration::from_secs(8), client.generate(req))
        .await
        .expect("answered before the whole pull's deadline (10 s)");
    let waited = asked.elapsed();
    let msgs = collect(answered.expect("accepted").into_inner()).await;
    assert!(
        waited < Duration::from_secs(3),
        "acknowledged after {waited:?}"
    );
    assert!(msgs[0].accepted.is_some(), "{:?}", msgs[0]);
    let u = last_usage(&msgs);
    assert_eq!((u.cached_tokens, u.peer_cached_tokens), (0, 0), "{u:?}");
    let pulled: Vec<u32> = msgs.iter().flat_map(|m| m.token_ids.clone()).collect();
    // The same tokens as the prompt computed with no hint (now from the cache).
    let again = generate(&mut client, request("again", tokens, 4)).await;
    let plain: Vec<u32> = again.iter().flat_map(|m| m.token_ids.clone()).collect();
    assert_eq!((pulled.len(), &pulled), (4, &plain));
    assert_eq!(load(&mut client).await.peer_pulled_blocks, 0);
    drop(hung);
    handle.shutdown().await.unwrap();
}
