//! The worker's `Fork` RPC over real gRPC on loopback: a shared prefix computed once,
//! children that equal plain `Generate` runs, validation, `Abort` and cancellation.

use kvfleet_proto::v1 as pb;
use kvfleet_proto::v1::worker_client::WorkerClient;
use kvfleet_worker::MAX_FORK_CHILDREN;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::{Code, Streaming};

mod common;

use common::{hashes, prompt, worker, BS};

fn greedy(max_tokens: i32) -> pb::SamplingParams {
    pb::SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn child(suffix: Vec<u32>, max_tokens: i32) -> pb::ForkChild {
    pb::ForkChild {
        suffix_token_ids: suffix,
        sampling: Some(greedy(max_tokens)),
    }
}

fn fork_request(id: &str, prefix: Vec<u32>, children: Vec<pb::ForkChild>) -> pb::ForkRequest {
    pb::ForkRequest {
        request_id: id.to_string(),
        model: "tiny".into(),
        block_hashes: hashes(&prefix),
        prefix_token_ids: prefix,
        block_size: BS as u32,
        cache_salt: String::new(),
        children,
        fork_group: Some("g".into()),
        report_acceptance: false,
    }
}

/// Every message of a fork call, grouped by child.
async fn collect_fork(
    mut stream: Streaming<pb::ForkResponse>,
    children: usize,
) -> Vec<Vec<pb::GenerateResponse>> {
    let mut out = vec![Vec::new(); children];
    while let Some(m) = tokio::time::timeout(Duration::from_secs(60), stream.message())
        .await
        .expect("fork messages in time")
        .expect("stream item")
    {
        let i = m.child_index as usize;
        assert!(i < children, "child index {i} out of range");
        out[i].push(m.response.expect("a fork message carries a response"));
    }
    out
}

fn tokens_of(msgs: &[pb::GenerateResponse]) -> Vec<u32> {
    msgs.iter().flat_map(|m| m.token_ids.clone()).collect()
}

async fn load(client: &mut WorkerClient<Channel>) -> pb::LoadResponse {
    client
        .load(pb::LoadRequest {})
        .await
        .expect("load")
        .into_inner()
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

async fn abort(client: &mut WorkerClient<Channel>, id: &str) -> bool {
    client
        .abort(pb::AbortRequest {
            request_id: id.into(),
        })
        .await
        .expect("abort")
        .into_inner()
        .found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_children_equal_plain_generates_and_compute_the_prefix_once() {
    let (handle, mut client) = worker("w-fork", |_| {}).await;
    // Ends in a partial block: the children copy it on write.
    let prefix = prompt(5, 7 * BS + 9);
    let suffixes: Vec<Vec<u32>> = (0..3)
        .map(|i| prompt(200 + i, 5 + 6 * i as usize))
        .collect();
    let max_tokens = 8;
    let req = fork_request(
        "f",
        prefix.clone(),
        suffixes
            .iter()
            .map(|s| child(s.clone(), max_tokens))
            .collect(),
    );
    let stream = client.fork(req).await.expect("accepted").into_inner();
    let per_child = collect_fork(stream, 3).await;

    for (i, (msgs, suffix)) in per_child.iter().zip(&suffixes).enumerate() {
        let prompt_tokens = (prefix.len() + suffix.len()) as u32;
        let head = msgs[0].usage.expect("first message carries usage");
        assert_eq!(head.prompt_tokens, prompt_tokens, "child {i}");
        assert_eq!(
            head.cached_tokens,
            prefix.len() as u32,
            "child {i} reuses the whole shared prefix"
        );
        let last = msgs.last().unwrap();
        assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
        let u = last.usage.expect("final message has usage");
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            (prompt_tokens, prefix.len() as u32, max_tokens as u32)
        );
        let t = last.timings.expect("final message has timings");
        assert!(t.total_ms >= t.ttft_ms && t.ttft_ms >= t.queue_ms && t.queue_ms >= 0.0);
        for m in &msgs[..msgs.len() - 1] {
            assert_eq!(m.finish_reason, pb::FinishReason::Unspecified as i32);
        }
        assert_eq!(tokens_of(msgs).len(), max_tokens as usize, "child {i}");
    }

    let suffix_total: u64 = suffixes.iter().map(|s| s.len() as u64).sum();
    let p = prefix.len() as u64;
    let l = wait_idle(&mut client).await;
    assert_eq!(
        l.prompt_tokens_computed,
        p + suffix_total,
        "the prefix is computed once for all children"
    );
    // The engine counts the prefix computation's prompt and each child's whole prompt.
    assert_eq!(l.prompt_tokens, p + 3 * p + suffix_total);
    assert_eq!(l.cached_tokens, 3 * p);
    assert_eq!(l.generated_tokens, 3 * max_tokens as u64);
    // Finished: the names are free again.
    assert!(!abort(&mut client, "f").await);
    assert!(!abort(&mut client, "f.0").await);
    handle.shutdown().await.unwrap();

    // Each child equals a plain Generate of prefix + suffix on a fresh worker.
    for (i, (msgs, suffix)) in per_child.iter().zip(&suffixes).enumerate() {
        let (handle, mut client) = worker(&format!("w-ref-{i}"), |_| {}).await;
        let mut tokens = prefix.clone();
        tokens.extend(suffix);
        let mut stream = client
            .generate(pb::GenerateRequest {
                request_id: format!("ref-{i}"),
                model: "tiny".into(),
                block_hashes: hashes(&tokens),
                token_ids: tokens,
                block_size: BS as u32,
                sampling: Some(greedy(max_tokens)),
                ..Default::default()
            })
            .await
            .expect("accepted")
            .into_inner();
        let mut plain = Vec::new();
        while let Some(m) = stream.message().await.expect("stream item") {
            plain.push(m);
        }
        assert_eq!(tokens_of(&plain), tokens_of(msgs), "child {i}");
        let text =
            |ms: &[pb::GenerateResponse]| ms.iter().map(|m| m.text.clone()).collect::<String>();
        assert_eq!(text(&plain), text(msgs), "child {i}");
        handle.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_forks_are_invalid_arguments_and_nothing_starts() {
    let (handle, mut client) = worker("w-fork-bad", |_| {}).await;
    let prefix = prompt(6, 40);
    let good = || {
        fork_request(
            "bad",
            prefix.clone(),
            vec![child(prompt(7, 5), 2), child(prompt(8, 6), 2)],
        )
    };
    let mut cases: Vec<(&str, pb::ForkRequest)> = Vec::new();
    let mut r = good();
    r.children.clear();
    cases.push(("no children", r));
    let mut r = good();
    r.children[1].suffix_token_ids.clear();
    cases.push(("empty suffix", r));
    let mut r = good();
    r.block_hashes[1] ^= 1;
    cases.push(("mismatched block hash", r));
    let mut r = good();
    r.cache_salt = "tenant-b".into();
    cases.push(("hashes from another salt", r));
    let mut r = good();
    r.block_hashes.extend([42, 43]);
    cases.push(("more hashes than full blocks", r));
    let mut r = good();
    r.block_size = 32;
    cases.push(("wrong block size", r));
    let mut r = good();
    r.model = "llama-70b".into();
    cases.push(("wrong model", r));
    let mut r = good();
    r.children = vec![child(prompt(9, 3), 1); MAX_FORK_CHILDREN + 1];
    cases.push(("too many children", r));
    let mut r = good();
    r.children[1].sampling.as_mut().unwrap().max_tokens = 0;
    cases.push(("child max_tokens", r));
    let mut r = good();
    r.children[0].sampling.as_mut().unwrap().top_p = Some(1.5);
    cases.push(("child top_p", r));
    let mut r = good();
    r.prefix_token_ids.clear();
    r.block_hashes.clear();
    cases.push(("empty prefix", r));
    let mut r = good();
    r.children[1].suffix_token_ids[2] = 320;
    cases.push(("suffix token id >= vocab", r));
    for (what, req) in cases {
        let err = client.fork(req).await.expect_err(what);
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
    // Nothing started, and the worker still serves forks (also without hashes,
    // block size, model or sampling).
    let l = load(&mut client).await;
    assert_eq!((l.running, l.waiting, l.prompt_tokens), (0, 0, 0));
    let stream = client.fork(good()).await.expect("accepted").into_inner();
    let msgs = collect_fork(stream, 2).await;
    for m in &msgs {
        assert_eq!(tokens_of(m).len(), 2);
    }
    let mut r = good();
    r.block_hashes.clear();
    r.block_size = 0;
    r.model.clear();
    r.request_id.clear();
    for c in &mut r.children {
        c.sampling = None;
    }
    let stream = client.fork(r).await.expect("accepted").into_inner();
    for m in collect_fork(stream, 2).await {
        assert!(m.last().unwrap().finish_reason != pb::FinishReason::Unspecified as i32);
    }
    wait_idle(&mut client).await;
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_by_fork_id_ends_every_child_with_aborted() {
    let (handle, mut client) = worker("w-fork-abort", |_| {}).await;
    let req = || {
        fork_request(
            "fa",
            prompt(10, 50),
            (0..3).map(|i| child(prompt(20 + i, 4), 2000)).collect(),
        )
    };
    let mut stream = client.fork(req()).await.expect("accepted").into_inner();
    let first = stream.message().await.unwrap().expect("a first message");
    let mut per_child = vec![Vec::new(); 3];
    per_child[first.child_index as usize].push(first.response.unwrap());
    // The fork's id and its children's names are taken while it runs.
    let err = client.fork(req()).await.expect_err("duplicate fork id");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    let err = client
        .generate(pb::GenerateRequest {
            request_id: "fa.1".into(),
            token_ids: prompt(1, 10),
            ..Default::default()
        })
        .await
        .expect_err("a child's name");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    let err = client
        .generate(pb::GenerateRequest {
            request_id: "fa".into(),
            token_ids: prompt(1, 10),
            ..Default::default()
        })
        .await
        .expect_err("the fork's name");
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");

    assert!(abort(&mut client, "fa").await);
    for (i, msgs) in collect_fork(stream, 3).await.into_iter().enumerate() {
        per_child[i].extend(msgs);
    }
    for (i, msgs) in per_child.iter().enumerate() {
        let last = msgs.last().expect("a final message");
        assert_eq!(
            last.finish_reason,
            pb::FinishReason::Aborted as i32,
            "child {i}"
        );
        assert!(last.usage.is_some() && last.timings.is_some(), "child {i}");
    }
    let l = wait_idle(&mut client).await;
    assert!(l.generated_tokens < 3 * 2000, "{l:?}");
    assert!(!abort(&mut client, "fa").await);
    assert!(!abort(&mut client, "fa.0").await);
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_one_child_leaves_its_siblings_running() {
    let (handle, mut client) = worker("w-fork-child", |_| {}).await;
    let req = fork_request(
        "fc",
        prompt(11, 40),
        vec![
            child(prompt(30, 3), 16),
            child(prompt(31, 3), 4000),
            child(prompt(32, 3), 16),
        ],
    );
    let mut stream = client.fork(req).await.expect("accepted").into_inner();
    let first = stream.message().await.unwrap().expect("a first message");
    assert!(abort(&mut client, "fc.1").await);
    let mut per_child = collect_fork(stream, 3).await;
    per_child[first.child_index as usize].insert(0, first.response.unwrap());
    let reasons: Vec<i32> = per_child
        .iter()
        .map(|m| m.last().expect("a final message").finish_reason)
        .collect();
    use pb::FinishReason::{Aborted, Length};
    assert_eq!(reasons, vec![Length as i32, Aborted as i32, Length as i32]);
    assert_eq!(tokens_of(&per_child[0]).len(), 16);
    assert_eq!(tokens_of(&per_child[2]).len(), 16);
    wait_idle(&mut client).await;
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_fork_call_aborts_every_child() {
    let (handle, mut client) = worker("w-fork-drop", |_| {}).await;
    let max = 2000;
    let req = || {
        fork_request(
            "fd",
            prompt(12, 50),
            (0..3).map(|i| child(prompt(40 + i, 4), max)).collect(),
        )
    };
    let mut stream = client.fork(req()).await.expect("accepted").into_inner();
    stream.message().await.unwrap().expect("a first message");
    drop(stream);
    let l = wait_idle(&mut client).await;
    assert!(
        l.generated_tokens < 3 * max as u64,
        "the engine kept generating for a gone client: {}",
        l.generated_tokens
    );
    // The names are free again.
    assert!(!abort(&mut client, "fd").await);
    let mut short = req();
    for c in &mut short.children {
        c.sampling = Some(greedy(2));
    }
    let stream = client.fork(short).await.expect("accepted").into_inner();
    for m in collect_fork(stream, 3).await {
        assert_eq!(tokens_of(&m).len(), 2);
    }
    handle.shutdown().await.unwrap();
}

/// Abort and cancellation while the shared prefix is still being computed (a long
/// prefix in small prefill chunks): nothing is left running, and no child runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_or_cancel_during_the_prefix_stops_the_whole_fork() {
    let (handle, mut client) = worker("w-fork-early", |c| {
        c.num_blocks = 512;
        c.max_prefill_chunk = 16;
        c.max_batched_tokens = 16;
    })
    .await;
    let req = |id: &str, seed: u32| {
        fork_request(
            id,
            prompt(seed, 3000),
            (0..3).map(|i| child(prompt(50 + i, 4), 2000)).collect(),
        )
    };
    // Abort by the fork's id.
    let stream = client
        .fork(req("fe", 13))
        .await
        .expect("accepted")
        .into_inner();
    assert!(abort(&mut client, "fe").await);
    for (i, msgs) in collect_fork(stream, 3).await.iter().enumerate() {
        let last = msgs.last().expect("a final message");
        assert_eq!(
            last.finish_reason,
            pb::FinishReason::Aborted as i32,
            "child {i}"
        );
    }
    let l = wait_idle(&mut client).await;
    assert!(l.generated_tokens < 3 * 2000, "{l:?}");

    // Every child aborted by name, one by one: the last one stops the prefix.
    let stream = client
        .fork(req("fn", 14))
        .await
        .expect("accepted")
        .into_inner();
    for i in 0..3 {
        assert!(abort(&mut client, &format!("fn.{i}")).await);
    }
    for msgs in collect_fork(stream, 3).await {
        assert_eq!(
            msgs.last().unwrap().finish_reason,
            pb::FinishReason::Aborted as i32
        );
    }
    // Aborts are queued, not awaited: once the children have ended, the fork is gone.
    assert!(!abort(&mut client, "fn").await, "the fork is gone");
    wait_idle(&mut client).await;

    // The call dropped right away.
    let before = load(&mut client).await;
    let stream = client
        .fork(req("fx", 15))
        .await
        .expect("accepted")
        .into_inner();
    drop(stream);
    let l = wait_idle(&mut client).await;
    assert!(
        l.prompt_tokens_computed - before.prompt_tokens_computed <= 3000 + 3 * 4,
        "{l:?}"
    );
    assert!(
        l.generated_tokens - before.generated_tokens < 3 * 2000,
        "{l:?}"
    );
    handle.shutdown().await.unwrap();
}
