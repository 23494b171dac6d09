//! Relaying a worker's Generate stream to an HTTP client: collected into one JSON
//! body, or re-encoded as server-sent events chunk by chunk.

use crate::dispatch::{
    classify, dispatch_excluding, finish_reason_name, report_usage, Dispatched, Fault,
};
use crate::fleet::Fleet;
use crate::fleet_metrics as m;
use crate::openai::error::ApiError;
use axum::response::sse::Event;
use kvfleet_core::openai::{PromptTokensDetails, Usage};
use kvfleet_proto::v1 as pb;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Everything a worker produced for one request.
#[derive(Debug, Default)]
pub struct Collected {
    /// Generated text.
    pub text: String,
    /// Finish reason, OpenAI's name.
    pub finish: Option<&'static str>,
    /// Token accounting.
    pub usage: Usage,
    /// Each generated token's log-probabilities, when the request asked for them.
    pub logprobs: Vec<pb::TokenLogprob>,
    /// The stop string that ended the answer, if one did.
    pub stop_sequence: Option<String>,
}

/// Builds the SSE chunks of one endpoint's response format.
pub trait ChunkWriter: Send + 'static {
    /// Chunks sent before any text (the chat role chunk).
    fn start(&mut self) -> Vec<String>;
    /// Chunks for newly generated text and its tokens' log-probabilities (empty
    /// unless the request asked for them).
    fn text(&mut self, delta: &str, logprobs: &[pb::TokenLogprob]) -> Vec<String>;
    /// Chunks closing the answer; `usage` is set when the client asked for it.
    fn finish(&mut self, reason: &'static str, usage: Option<&Usage>) -> Vec<String>;
    /// Told, just before [`ChunkWriter::finish`], the stop string that ended the answer
    /// (OpenAI's formats do not report it).
    fn stop_sequence(&mut self, _stop: &str) {}
    /// The chunk that reports a failure after the stream began.
    fn error(&mut self, message: &str) -> String {
        error_chunk(message)
    }
    /// The last chunk after a finished answer (OpenAI's `[DONE]`).
    fn done(&self) -> Option<String> {
        Some("[DONE]".to_string())
    }
    /// One chunk as its SSE event (OpenAI's have only `data`).
    fn event(&self, chunk: String) -> Event {
        Event::default().data(chunk)
    }
    /// The usage-only chunk that closes a stream of several choices.
    fn usage_chunk(&mut self, usage: &Usage) -> String;
}

/// The usage of `n` choices sampled from one prompt: the prompt (and its cached part)
/// counted once, from the first choice, which computed it; completions summed.
pub fn choices_usage(usages: &[Usage]) -> Usage {
    let mut total = usages.first().cloned().unwrap_or_default();
    total.completion_tokens = usages.iter().map(|u| u.completion_tokens).sum();
    total.total_tokens = total.prompt_tokens + total.completion_tokens;
    total
}

pub(super) fn usage_of(u: Option<&pb::Usage>, completion: usize) -> Usage {
    let u = u.copied().unwrap_or_default();
    let prompt = u.prompt_tokens as usize;
    let completion = (u.completion_tokens as usize).max(completion);
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: u.cached_tokens as usize,
            promoted: kvfleet_core::kv_events::PromotedTokens {
                host: u.host_cached_tokens as usize,
                disk: u.disk_cached_tokens as usize,
                peer: u.peer_cached_tokens as usize,
            },
        },
    }
}

/// Per-request timing and accounting, recorded once when the request ends.
pub(super) struct Tally {
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    tokens: usize,
    usage: Option<pb::Usage>,
}

impl Tally {
    pub(super) fn new(started: Instant) -> Self {
        Tally {
            started,
            first_token: None,
            last_token: None,
            tokens: 0,
            usage: None,
        }
    }

    /// Counts `msg`; returns whether it brought the request's first token.
    pub(super) fn message(&mut self, msg: &pb::GenerateResponse) -> bool {
        if let Some(u) = &msg.usage {
            self.usage = Some(*u);
        }
        if msg.token_ids.is_empty() {
            return false;
        }
        let first = self.first_token.is_none();
        let now = Instant::now();
        match self.last_token {
            None => m::ttft(now.duration_since(self.started).as_secs_f64()),
            Some(prev) => {
                // Tokens that arrive together share the gap.
                let gap = now.duration_since(prev).as_secs_f64() / msg.token_ids.len() as f64;
                for _ in 0..msg.token_ids.len() {
                    m::itl(gap);
                }
            }
        }
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        self.tokens += msg.token_ids.len();
        first
    }

    /// Time to the first token, once one came.
    pub(super) fn ttft(&self) -> Option<std::time::Duration> {
        self.first_token.map(|t| t - self.started)
    }

    /// Records the request's outcome, latency and tokens; returns its usage.
    pub(super) fn close_counts(&self, policy: &str, outcome: &'static str) -> Usage {
        let usage = usage_of(self.usage.as_ref(), self.tokens);
        m::request_done(policy, outcome);
        m::request_seconds(self.started.elapsed().as_secs_f64());
        m::tokens(
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens,
        );
        usage
    }

    fn close(&self, fleet: &Fleet, d: &Dispatched, outcome: &'static str) -> Usage {
        let usage = self.close_counts(d.guard.policy, outcome);
        m::cache_prediction(
            &d.worker,
            d.guard.predicted_cached_tokens(),
            usage.prompt_tokens_details.cached_tokens,
        );
        d.guard
            .record_outcome(usage.prompt_tokens_details.cached_tokens);
        report_usage(fleet, d, &usage, self.ttft());
        fleet.decisions.outcome(
            d.guard.decision_seq,
            Some(usage.prompt_tokens_details.cached_tokens),
            Some(outcome),
        );
        usage
    }
}

/// Why the next message of a started stream did not come.
pub(super) enum NextError {
    /// The worker (or its connection) failed.
    Failed(tonic::Status),
    /// Nothing came within the stall deadline.
    Stalled(std::time::Duration),
}

impl NextError {
    /// Whether the worker (or its connection) failed, not this one request: a stall or
    /// a transport failure. Only those charge its breaker, and only those are redone
    /// elsewhere.
    pub(super) fn is_worker_fault(&self) -> bool {
        match self {
            NextError::Stalled(_) => true,
            NextError::Failed(s) => classify(s) == Fault::Transport,
        }
    }

    /// What to tell the client.
    pub(super) fn message(&self, worker: &str) -> String {
        match self {
            NextError::Failed(s) => {
                format!("worker {worker} failed mid-generation: {}", s.message())
            }
            NextError::Stalled(d) => {
                format!("worker {worker} sent nothing for {d:?} mid-generation")
            }
        }
    }
}

/// The stream's next message within the stall deadline; a stall or a transport failure
/// counts against the worker's breaker (a failure of the request itself does not).
/// Every stream the router reads (generations and forks) goes through this one guard.
pub(super) async fn next_message<T: prost::Message + Default>(
    fleet: &Fleet,
    d: &mut Dispatched<T>,
) -> Result<Option<T>, NextError> {
    let limit = fleet.config.stall_timeout;
    let err = match tokio::time::timeout(limit, d.stream.message()).await {
        Ok(Ok(next)) => return Ok(next),
        Ok(Err(s)) => NextError::Failed(s),
        Err(_) => {
            m::deadline_exceeded(&d.worker, "stall");
            NextError::Stalled(limit)
        }
    };
    if err.is_worker_fault() {
        fleet.workers.breaker_failure(&d.worker);
    }
    Err(err)
}

/// Reads a generation to its end. Nothing has reached the client yet, so a worker that
/// fails, stalls or ends the stream early mid-generation does not fail the request: it
/// starts over on a worker it has not been on (until `max_attempts` workers failed it
/// mid-generation), as a request no worker accepted would. A failure of the request itself (not its worker's) is not
/// resent.
pub async fn collect(
    fleet: &Arc<Fleet>,
    mut d: Dispatched,
) -> Result<(Collected, String), ApiError> {
    let mut failed: Vec<String> = Vec::new();
    loop {
        let unfinished = match collect_once(fleet, &mut d).await {
            Ok(out) => return Ok((out, d.worker)),
            Err(u) => u,
        };
        let mut spec = match d.spec.take() {
            Some(spec) if unfinished.worker_fault => spec,
            _ => return Err(unfinished.error),
        };
        failed.push(d.worker.clone());
        if failed.len() >= fleet.config.max_attempts.max(1) {
            return Err(unfinished.error);
        }
        m::retry();
        let (started, tenant) = (d.started, std::mem::take(&mut d.facts.cache_salt));
        // Dropping the call aborts the request on the failed worker.
        drop(d);
        // Its pin, if any, was settled on the first worker: the new one computes the
        // prefix without pinning it again outside the tenant's budget.
        if spec.pin.is_some() {
            Arc::make_mut(&mut spec).pin = None;
        }
        d = match dispatch_excluding(fleet, &spec, &failed).await {
            Ok(d) => d,
            Err(_) => return Err(unfinished.error),
        };
        d.started = started;
        d.facts.cache_salt = tenant;
    }
}

/// Why [`collect_once`] has no answer.
struct Unfinished {
    /// What the client is told if the request is not redone.
    error: ApiError,
    /// The worker (or its connection) failed, not the request: it may be redone.
    worker_fault: bool,
}

/// Reads the whole stream of one worker's attempt.
async fn collect_once(fleet: &Fleet, d: &mut Dispatched) -> Result<Collected, Unfinished> {
    let mut tally = Tally::new(d.started);
    let mut out = Collected::default();
    let mut msg = Some(std::mem::take(&mut d.first));
    while let Some(cur) = msg.take() {
        if tally.message(&cur) {
            d.guard.prefill_done();
        }
        out.text.push_str(&cur.text);
        out.logprobs.extend(cur.logprobs);
        if let Some(f) = finish_reason_name(cur.finish_reason) {
            out.finish = Some(f);
            out.stop_sequence = cur.stop_sequence;
            break;
        }
        match next_message(fleet, d).await {
            Ok(next) => msg = next,
            Err(e) => {
                tally.close(fleet, d, "worker_error");
                let worker_fault = e.is_worker_fault();
                return Err(Unfinished {
                    error: ApiError::worker_failed(e.message(&d.worker)),
                    worker_fault,
                });
            }
        }
    }
    if out.finish.is_none() {
        tally.close(fleet, d, "worker_error");
        return Err(Unfinished {
            error: ApiError::worker_failed(format!("worker {} ended the stream early", d.worker)),
            worker_fault: true,
        });
    }
    out.usage = tally.close(fleet, d, "ok");
    Ok(out)
}

/// Relays the stream as SSE events into `tx` until it ends or the client goes away
/// (then the worker call is dropped, which aborts the request there).
pub async fn relay_sse(
    fleet: Arc<Fleet>,
    mut d: Dispatched,
    mut writer: impl ChunkWriter,
    include_usage: bool,
    tx: mpsc::Sender<Result<Event, Infallible>>,
) {
    let mut tally = Tally::new(d.started);
    let send = |events: Vec<Event>| {
        let tx = tx.clone();
        async move {
            for e in events {
                if tx.send(Ok(e)).await.is_err() {
                    return false;
                }
            }
            true
        }
    };
    let start = writer.start();
    if !send(events(&writer, start)).await {
        tally.close(&fleet, &d, "client_gone");
        return;
    }
    let mut msg = Some(std::mem::take(&mut d.first));
    loop {
        let Some(cur) = msg.take() else {
            tally.close(&fleet, &d, "worker_error");
            let e = writer.error("the worker ended the stream early");
            let _ = send(events(&writer, vec![e])).await;
            return;
        };
        if tally.message(&cur) {
            d.guard.prefill_done();
        }
        if !cur.text.is_empty() || !cur.logprobs.is_empty() {
            let chunks = writer.text(&cur.text, &cur.logprobs);
            if !send(events(&writer, chunks)).await {
                tally.close(&fleet, &d, "client_gone");
                return;
            }
        }
        if let Some(reason) = finish_reason_name(cur.finish_reason) {
            let usage = tally.close(&fleet, &d, "ok");
            if let Some(stop) = &cur.stop_sequence {
                writer.stop_sequence(stop);
            }
            let mut chunks = writer.finish(reason, include_usage.then_some(&usage));
            chunks.extend(writer.done());
            send(events(&writer, chunks)).await;
            return;
        }
        match next_message(&fleet, &mut d).await {
            Ok(next) => msg = next,
            Err(e) => {
                tally.close(&fleet, &d, "worker_error");
                let e = writer.error(&e.message(&d.worker));
                let _ = send(events(&writer, vec![e])).await;
                return;
            }
        }
    }
}

/// Chunks as the writer's SSE events.
fn events(w: &impl ChunkWriter, chunks: Vec<String>) -> Vec<Event> {
    chunks.into_iter().map(|c| w.event(c)).collect()
}

/// Collects every choice of a request (`first`, then `more` for `n > 1`), in order,
/// with their usage combined by [`choices_usage`] and the worker that served the first
/// (another than it was sent to, when [`collect`] redid it); the first failed choice's
/// error fails the request.
pub(super) async fn collect_choices(
    fleet: &Arc<Fleet>,
    first: Dispatched,
    more: Vec<Dispatched>,
) -> Result<(Vec<Collected>, Usage, String), ApiError> {
    let ds = std::iter::once(first).chain(more);
    let outs = futures::future::join_all(ds.map(|d| collect(fleet, d))).await;
    let mut collected = Vec::with_capacity(outs.len());
    let mut served_by = None;
    for r in outs {
        let (out, worker) = r?;
        served_by.get_or_insert(worker);
        collected.push(out);
    }
    let usages: Vec<Usage> = collected.iter().map(|c| c.usage.clone()).collect();
    Ok((
        collected,
        choices_usage(&usages),
        served_by.unwrap_or_default(),
    ))
}

/// Streams a request's choices as one SSE response: [`relay_sse`] for a single choice,
/// else [`relay_sse_choices`]; `writer(i)` builds choice `i`'s writer.
pub(super) fn stream_choices<W: ChunkWriter>(
    fleet: Arc<Fleet>,
    headers: axum::http::HeaderMap,
    first: Dispatched,
    more: Vec<Dispatched>,
    writer: impl Fn(usize) -> W,
    include_usage: bool,
) -> axum::response::Response {
    if more.is_empty() {
        let w = writer(0);
        return super::sse_response(headers, move |tx| {
            relay_sse(fleet, first, w, include_usage, tx)
        });
    }
    let ds: Vec<_> = std::iter::once(first).chain(more).collect();
    let writers = (0..ds.len()).map(writer).collect();
    super::sse_response(headers, move |tx| {
        relay_sse_choices(fleet, ds, writers, include_usage, tx)
    })
}

/// Relays several choices of one request (`n > 1`) as SSE events into `tx`: each
/// choice's chunks as they come (tagged with its index by its writer), then one usage
/// chunk over all of them when asked, then `[DONE]`.
pub async fn relay_sse_choices<W: ChunkWriter>(
    fleet: Arc<Fleet>,
    ds: Vec<Dispatched>,
    writers: Vec<W>,
    include_usage: bool,
    tx: mpsc::Sender<Result<Event, Infallible>>,
) {
    let runs = ds
        .into_iter()
        .zip(writers)
        .map(|(d, w)| relay_choice(fleet.clone(), d, w, tx.clone()));
    let mut done = Vec::new();
    for r in futures::future::join_all(runs).await {
        match r {
            Some(r) => done.push(r),
            // That choice already sent its error (or the client left).
            None => return,
        }
    }
    let mut chunks = Vec::new();
    if include_usage {
        let usages: Vec<Usage> = done.iter().map(|(u, _)| u.clone()).collect();
        if let Some((_, w)) = done.first_mut() {
            chunks.push(w.usage_chunk(&choices_usage(&usages)));
        }
    }
    chunks.push("[DONE]".to_string());
    send_all(&tx, chunks).await;
}

/// One choice of [`relay_sse_choices`]: its usage and writer once it finished.
async fn relay_choice<W: ChunkWriter>(
    fleet: Arc<Fleet>,
    mut d: Dispatched,
    mut writer: W,
    tx: mpsc::Sender<Result<Event, Infallible>>,
) -> Option<(Usage, W)> {
    let mut tally = Tally::new(d.started);
    if !send_all(&tx, writer.start()).await {
        tally.close(&fleet, &d, "client_gone");
        return None;
    }
    let mut msg = Some(std::mem::take(&mut d.first));
    loop {
        let Some(cur) = msg.take() else {
            tally.close(&fleet, &d, "worker_error");
            let _ = send_all(&tx, vec![error_chunk("the worker ended the stream early")]).await;
            return None;
        };
        if tally.message(&cur) {
            d.guard.prefill_done();
        }
        let fresh = !cur.text.is_empty() || !cur.logprobs.is_empty();
        if fresh && !send_all(&tx, writer.text(&cur.text, &cur.logprobs)).await {
            tally.close(&fleet, &d, "client_gone");
            return None;
        }
        if let Some(reason) = finish_reason_name(cur.finish_reason) {
            let usage = tally.close(&fleet, &d, "ok");
            if !send_all(&tx, writer.finish(reason, None)).await {
                return None;
            }
            return Some((usage, writer));
        }
        match next_message(&fleet, &mut d).await {
            Ok(next) => msg = next,
            Err(e) => {
                tally.close(&fleet, &d, "worker_error");
                let _ = send_all(&tx, vec![error_chunk(&e.message(&d.worker))]).await;
                return None;
            }
        }
    }
}

/// Sends `chunks` as SSE events; false once the client is gone.
async fn send_all(tx: &mpsc::Sender<Result<Event, Infallible>>, chunks: Vec<String>) -> bool {
    for c in chunks {
        if tx.send(Ok(Event::default().data(c))).await.is_err() {
            return false;
        }
    }
    true
}

/// An OpenAI-style error object sent as an SSE event (what OpenAI clients raise on).
fn error_chunk(message: &str) -> String {
    ApiError::worker_failed(message).body().to_string()
}
