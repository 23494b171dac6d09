//! An engine panic (`EngineFaults::panic_after_steps`) over real gRPC: the running
//! and the queued requests end with UNAVAILABLE (a transport-class error, so a router
//! resends what had not started), new calls are refused with UNAVAILABLE, and the
//! worker's health reports the failure (what `kvfleet worker` turns into a 503 on
//! `/health`, leaving membership and a non-zero exit).

use kvfleet_proto::v1 as pb;
use kvfleet_worker::EngineStatus;
use std::time::Duration;
use tonic::Code;

mod common;

use common::{hashes, prompt, worker, BS};

fn request(id: &str, tokens: Vec<u32>, max_tokens: i32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.to_string(),
        model: "tiny".into(),
        block_hashes: hashes(&tokens),
        token_ids: tokens,
        block_size: BS as u32,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        report_acceptance: true,
        ..Default::default()
    }
}

/// Reads a stream to its end: the messages, and the error it ended with.
async fn drain(
    mut stream: tonic::Streaming<pb::GenerateResponse>,
) -> (Vec<pb::GenerateResponse>, Option<tonic::Status>) {
    let mut msgs = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("the stream ends")
        {
            Ok(Some(m)) => msgs.push(m),
            Ok(None) => return (msgs, None),
            Err(s) => return (msgs, Some(s)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_fails_requests_as_unavailable_and_reports_the_worker_failed() {
    // Steps 0-1 serve `a`, step 2 is `b`'s prefill; the engine panics before step 3.
    // Each step is slowed so that `c` is queued behind `b` (one sequence at a time)
    // when the panic comes.
    let (handle, mut client) = worker("w-panic", |c| {
        c.max_num_seqs = 1;
        c.faults.panic_after_steps = Some(3);
        c.faults.step_delay = Some(Duration::from_millis(300));
    })
    .await;
    let health = handle.health().clone();
    let a = client
        .generate(request("a", prompt(1, 40), 2))
        .await
        .expect("a accepted")
        .into_inner();
    let (msgs, err) = drain(a).await;
    assert!(err.is_none(), "a finished before the fault: {err:?}");
    assert_eq!(
        msgs.last().map(|m| m.finish_reason),
        Some(pb::FinishReason::Length as i32)
    );
    assert!(health.is_running());

    let mut b = client
        .generate(request("b", prompt(2, 40), 100))
        .await
        .expect("b accepted")
        .into_inner();
    let mut b_tokens = 0;
    while b_tokens == 0 {
        let m = b.message().await.expect("b's next message").expect("open");
        b_tokens += m.token_ids.len();
    }
    let c = client
        .generate(request("c", prompt(3, 40), 4))
        .await
        .map(|r| r.into_inner());

    // `b` had started: it ends with UNAVAILABLE, not INTERNAL (which a router would
    // charge to the request, not to the worker).
    let (_, b_err) = drain(b).await;
    let b_err = b_err.expect("b ends with an error");
    assert_eq!(b_err.code(), Code::Unavailable, "{b_err:?}");
    assert!(b_err.message().contains("fault injected"), "{b_err:?}");
    // `c` was queued (or refused on arrival): UNAVAILABLE either way.
    let c_err = match c {
        Ok(stream) => drain(stream).await.1.expect("c ends with an error"),
        Err(s) => s,
    };
    assert_eq!(c_err.code(), Code::Unavailable, "{c_err:?}");

    let (reason, _) = tokio::time::timeout(Duration::from_secs(10), health.failed())
        .await
        .expect("the failure is reported");
    assert!(reason.contains("panicked"), "{reason}");
    assert!(matches!(health.status(), EngineStatus::Failed { .. }));
    // Nothing new is taken, and no stale load is served.
    let refused = client
        .generate(request("d", prompt(4, 40), 4))
        .await
        .expect_err("a dead engine takes no request");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let load = client
        .load(pb::LoadRequest {})
        .await
        .expect_err("a dead engine has no load");
    assert_eq!(load.code(), Code::Unavailable, "{load:?}");
    handle.shutdown().await.expect("shuts down");
}
