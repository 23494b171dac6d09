//! `kvfleet bench replay`: replays a trace against a live OpenAI-compatible endpoint.
//!
//! Every request becomes a streamed `POST /v1/completions` whose prompt is token ids:
//! each hash id is a deterministic block of `tokens_per_id` tokens
//! ([`crate::token_blocks`]), so shared ids are shared token prefixes. Open loop: each
//! request is sent at its timestamp divided by `speed`. Closed loop
//! (`concurrency`): at most that many requests in flight, sent as soon as a slot
//! frees. Either way a request with a `parent_id` waits for its parent to finish.
//! Each outcome records TTFT (first streamed choice), inter-token gaps,
//! `usage.prompt_tokens_details.cached_tokens` and the `x-kvfleet-worker` header.

use crate::bounds;
use crate::session_placement::{max_over_mean, SessionPlacement};
use crate::sim::Percentiles;
use crate::token_blocks::{prompt_tokens, DEFAULT_TOKEN_VOCAB};
use crate::trace::Trace;
use anyhow::{Context, Result};
use futures::StreamExt;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Replay settings.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub target: String,
    /// Model id (None: the first of `GET /v1/models`).
    pub model: Option<String>,
    /// Time compression of the open loop (2 = twice as fast).
    pub speed: f64,
    /// Replay only the first N requests.
    pub max_requests: Option<usize>,
    /// Closed loop with this many requests in flight (None: open loop).
    pub concurrency: Option<usize>,
    /// Tokens per hash id (None: the trace's block size).
    pub tokens_per_id: Option<usize>,
    /// Token ids stay below this.
    pub vocab: u32,
    /// Cap on each request's output tokens.
    pub max_output_tokens: Option<usize>,
    /// `x-kvfleet-policy` header, if any.
    pub policy: Option<String>,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Per-request timeout.
    pub timeout: Duration,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            target: "http://127.0.0.1:8080".into(),
            model: None,
            speed: 1.0,
            max_requests: None,
            concurrency: None,
            tokens_per_id: None,
            vocab: DEFAULT_TOKEN_VOCAB,
            max_output_tokens: None,
            policy: None,
            progress: true,
            timeout: Duration::from_secs(600),
        }
    }
}

/// One request's outcome.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcome {
    /// Index in the trace.
    pub index: usize,
    /// Whether it completed.
    pub ok: bool,
    /// Why not.
    pub error: Option<String>,
    /// Send time, s from the start.
    pub sent_s: f64,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Mean gap between later streamed chunks, ms.
    pub itl_ms: Option<f64>,
    /// From the send to the end of the stream, ms.
    pub latency_ms: f64,
    /// Prompt tokens (from usage).
    pub prompt_tokens: usize,
    /// Cached prompt tokens (from usage).
    pub cached_tokens: usize,
    /// Completion tokens.
    pub completion_tokens: usize,
    /// The serving worker.
    pub worker: Option<String>,
}

/// Per-worker totals.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkerTotals {
    /// Requests served.
    pub requests: u64,
    /// Prompt tokens computed (prompt − cached).
    pub prefill_tokens: u64,
    /// Distinct trace sessions it served.
    pub sessions: usize,
}

/// The replay report.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// Target URL.
    pub target: String,
    /// Requests sent.
    pub requests: usize,
    /// Completed.
    pub ok: usize,
    /// Failed.
    pub failed: usize,
    /// Tokens per hash id.
    pub tokens_per_id: usize,
    /// Time to first token.
    pub ttft_ms: Percentiles,
    /// Inter-token latency (per-request means).
    pub itl_ms: Percentiles,
    /// Request latency, from the send to the end of the stream.
    pub latency_ms: Percentiles,
    /// Wall time, s.
    pub duration_s: f64,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Generated tokens per second.
    pub output_tokens_per_s: f64,
    /// Prompt tokens of completed requests.
    pub prompt_tokens: u64,
    /// Cached prompt tokens.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub cached_token_ratio: f64,
    /// The trace's ceiling (blocks hit with one unbounded cache).
    pub ceiling: f64,
    /// Input cost with cached tokens at 10%, relative to no caching.
    pub input_cost_relative: f64,
    /// Per-worker totals.
    pub workers: BTreeMap<String, WorkerTotals>,
    /// max / mean of per-worker prefill tokens.
    pub work_max_over_mean: f64,
    /// Completed requests served by another worker than their session's previous
    /// completed request (see [`crate::session_placement`]).
    pub session_moves: usize,
    /// max / mean of the workers' distinct sessions (1 without sessions).
    pub sessions_max_over_mean: f64,
    /// Cached ratio per send-time bucket: (bucket end in s, ratio).
    pub hit_timeline: Vec<(f64, f64)>,
    /// Up to 5 error messages.
    pub errors: Vec<String>,
    /// Every outcome.
    pub outcomes: Vec<Outcome>,
}

/// Replays `trace` against `cfg.target`.
pub async fn replay(trace: &Trace, cfg: &ReplayConfig) -> Result<ReplayReport> {
    anyhow::ensure!(
        cfg.speed > 0.0 && cfg.speed.is_finite(),
        "--speed must be positive"
    );
    anyhow::ensure!(
        cfg.concurrency != Some(0),
        "--concurrency must be at least 1"
    );
    let trace = match cfg.max_requests {
        Some(n) => trace.truncated(n),
        None => trace.clone(),
    };
    let bs = trace.block_size();
    let k = cfg.tokens_per_id.unwrap_or(bs);
    anyhow::ensure!(k > 0, "--tokens-per-id must be at least 1");
    let base = cfg.target.trim_end_matches('/').to_string();
    let client = reqwest::Client::builder()
        .timeout(cfg.timeout)
        .build()
        .context("building the HTTP client")?;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => {
            let v: serde_json::Value = client
                .get(format!("{base}/v1/models"))
                .send()
                .await
                .with_context(|| format!("GET {base}/v1/models"))?
                .json()
                .await
                .context("reading /v1/models")?;
            v["data"][0]["id"]
                .as_str()
                .context("/v1/models lists no model")?
                .to_string()
        }
    };
    let n = trace.records.len();
    let parents = trace.parent_indices();
    let done: Vec<tokio::sync::watch::Sender<bool>> = (0..n)
        .map(|_| tokio::sync::watch::channel(false).0)
        .collect();
    let done = Arc::new(done);
    let sem = cfg
        .concurrency
        .map(|c| Arc::new(tokio::sync::Semaphore::new(c)));
    let finished = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let t0 = trace.records.first().map_or(0, |r| r.timestamp);
    let mut handles = Vec::with_capacity(n);
    for (i, r) in trace.records.iter().enumerate() {
        let prompt = prompt_tokens(&r.hash_ids, r.input_length, r.block_size(), k, cfg.vocab);
        let max_tokens = cfg
            .max_output_tokens
            .map_or(r.output_length, |m| r.output_length.min(m))
            .max(1);
        let mut body = serde_json::json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(t) = &r.tenant {
            body["cache_salt"] = serde_json::Value::String(t.clone());
        }
        let parent_rx = parents[i].map(|p| done[p].subscribe());
        let at = Duration::from_secs_f64((r.timestamp - t0) as f64 / 1000.0 / cfg.speed);
        let open_loop = sem.is_none();
        let sem = sem.clone();
        let (client, url, done, finished, failed) = (
            client.clone(),
            format!("{base}/v1/completions"),
            done.clone(),
            finished.clone(),
            failed.clone(),
        );
        let mut headers = Vec::new();
        if let Some(p) = &cfg.policy {
            headers.push(("x-kvfleet-policy", p.clone()));
        }
        if let Some(g) = r.fork_group {
            headers.push(("x-kvfleet-fork-group", g.to_string()));
        }
        handles.push(tokio::spawn(async move {
            if open_loop {
                tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
            }
            if let Some(mut rx) = parent_rx {
                let _ = rx.wait_for(|d| *d).await;
            }
            let _permit = match &sem {
                Some(s) => Some(s.clone().acquire_owned().await),
                None => None,
            };
            let sent = Instant::now();
            let mut out = send(&client, &url, &body, &headers).await;
            out.index = i;
            out.sent_s = (sent - start).as_secs_f64();
            if !out.ok {
                failed.fetch_add(1, Ordering::Relaxed);
            }
            finished.fetch_add(1, Ordering::Relaxed);
            let _ = done[i].send(true);
            out
        }));
    }
    let progress = cfg.progress.then(|| {
        let (finished, failed) = (finished.clone(), failed.clone());
        tokio::spawn(async move {
            loop {
                let f = finished.load(Ordering::Relaxed);
                let bad = failed.load(Ordering::Relaxed);
                let width = 40;
                let filled = (f * width).checked_div(n).unwrap_or(width);
                eprint!(
                    "\r[{}{}] {f}/{n} done, {bad} failed, {:.0} s",
                    "#".repeat(filled),
                    ".".repeat(width - filled),
                    start.elapsed().as_secs_f64()
                );
                if f >= n {
                    eprintln!();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let mut outcomes = Vec::with_capacity(n);
    for h in handles {
        outcomes.push(h.await.context("a replay task panicked")?);
    }
    if let Some(p) = progress {
        let _ = p.await;
    }
    let duration_s = start.elapsed().as_secs_f64();
    Ok(summarize(&trace, &base, k, outcomes, duration_s))
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    headers: &[(&'static str, String)],
) -> Outcome {
    let mut out = Outcome::default();
    let t = Instant::now();
    let mut req = client.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("sending: {e}"));
            return out;
        }
    };
    out.worker = resp
        .headers()
        .get("x-kvfleet-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        out.error = Some(format!(
            "HTTP {status}: {}",
            text.chars().take(300).collect::<String>()
        ));
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    let mut got_usage = false;
    while let Some(item) = stream.next().await {
        let bytes = match item {
            Ok(b) => b,
            Err(e) => {
                out.error = Some(format!("reading the stream: {e}"));
                return out;
            }
        };
        buf.extend_from_slice(&bytes);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                out.error = Some(format!("stream error: {}", v["error"]));
                return out;
            }
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                if first.is_none() {
                    first = Some(now);
                }
                last = Some(now);
                chunks += 1;
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                got_usage = true;
                out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                out.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0) as usize;
            }
        }
    }
    let Some(first) = first else {
        out.error = Some("the stream ended without a token".into());
        return out;
    };
    if !got_usage {
        out.error = Some("the stream carried no usage".into());
        return out;
    }
    out.ttft_ms = (first - t).as_secs_f64() * 1000.0;
    out.latency_ms = t.elapsed().as_secs_f64() * 1000.0;
    if let Some(last) = last.filter(|_| chunks > 1) {
        out.itl_ms = Some((last - first).as_secs_f64() * 1000.0 / (chunks - 1) as f64);
    }
    out.ok = true;
    out
}

fn summarize(
    trace: &Trace,
    target: &str,
    k: usize,
    outcomes: Vec<Outcome>,
    duration_s: f64,
) -> ReplayReport {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft_ms).collect();
    let mut itl: Vec<f64> = ok.iter().filter_map(|o| o.itl_ms).collect();
    let mut latency: Vec<f64> = ok.iter().map(|o| o.latency_ms).collect();
    let prompt: u64 = ok.iter().map(|o| o.prompt_tokens as u64).sum();
    let cached: u64 = ok.iter().map(|o| o.cached_tokens as u64).sum();
    let out_tokens: u64 = ok.iter().map(|o| o.completion_tokens as u64).sum();
    let mut workers: BTreeMap<String, WorkerTotals> = BTreeMap::new();
    for o in &ok {
        let w = workers
            .entry(o.worker.clone().unwrap_or_else(|| "?".into()))
            .or_default();
        w.requests += 1;
        w.prefill_tokens += (o.prompt_tokens - o.cached_tokens.min(o.prompt_tokens)) as u64;
    }
    // In send order: a session's requests are its turns, each sent after the last.
    let mut sessions = SessionPlacement::default();
    let mut by_index: Vec<&&Outcome> = ok.iter().collect();
    by_index.sort_by_key(|o| o.index);
    for o in by_index {
        let session = trace.records.get(o.index).and_then(|r| r.session_id);
        if let (Some(s), Some(w)) = (session, o.worker.as_deref()) {
            sessions.served(s, w);
        }
    }
    for (w, n) in sessions.per_worker() {
        if let Some(t) = workers.get_mut(w) {
            t.sessions = n;
        }
    }
    let worker_sessions: Vec<usize> = workers.values().map(|w| w.sessions).collect();
    let work: Vec<u64> = workers.values().map(|w| w.prefill_tokens).collect();
    let mean = work.iter().sum::<u64>() as f64 / work.len().max(1) as f64;
    let max = work.iter().copied().max().unwrap_or(0) as f64;
    let buckets = 20usize;
    let span = ok.iter().map(|o| o.sent_s).fold(0.0, f64::max).max(1e-3);
    let mut sums = vec![(0u64, 0u64); buckets];
    for o in &ok {
        let b = ((o.sent_s / span * buckets as f64) as usize).min(buckets - 1);
        sums[b].0 += o.cached_tokens as u64;
        sums[b].1 += o.prompt_tokens as u64;
    }
    let hit_timeline = sums
        .iter()
        .enumerate()
        .filter(|(_, s)| s.1 > 0)
        .map(|(b, s)| {
            (
                span * (b + 1) as f64 / buckets as f64,
                s.0 as f64 / s.1 as f64,
            )
        })
        .collect();
    let ratio = if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    };
    ReplayReport {
        target: target.to_string(),
        requests: outcomes.len(),
        ok: ok.len(),
        failed: outcomes.len() - ok.len(),
        tokens_per_id: k,
        ttft_ms: Percentiles::of(&mut ttft),
        itl_ms: Percentiles::of(&mut itl),
        latency_ms: Percentiles::of(&mut latency),
        duration_s,
        throughput_rps: ok.len() as f64 / duration_s.max(1e-9),
        output_tokens_per_s: out_tokens as f64 / duration_s.max(1e-9),
        prompt_tokens: prompt,
        cached_tokens: cached,
        cached_token_ratio: ratio,
        ceiling: bounds::ceiling(trace),
        input_cost_relative: 1.0 - 0.9 * ratio,
        workers,
        work_max_over_mean: if mean > 0.0 { max / mean } else { 1.0 },
        session_moves: sessions.moves(),
        sessions_max_over_mean: max_over_mean(&worker_sessions),
        hit_timeline,
        errors: outcomes
            .iter()
            .filter_map(|o| o.error.clone())
            .take(5)
            .collect(),
        outcomes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(index: usize, worker: &str, cached: usize) -> Outcome {
        Outcome {
            index,
            ok: true,
            prompt_tokens: 32,
            cached_tokens: cached,
            worker: Some(worker.into()),
            ..Outcome::default()
        }
    }

    #[test]
    fn the_report_counts_session_moves_and_sessions_per_worker() {
        // Session 7: turns 0, 2, 3; session 8: turns 1, 4; request 5 has no session.
        let lines = [
            r#"{"timestamp":0,"input_length":32,"output_length":4,"block_size":16,"hash_ids":[1,2],"session_id":7}"#,
            r#"{"timestamp":1,"input_length":32,"output_length":4,"block_size":16,"hash_ids":[5,6],"session_id":8}"#,
            r#"{"timestamp":2,"input_length":32,"output_length":4,"block_size":16,"hash_ids":[1,2],"session_id":7}"#,
            r#"{"timestamp":3,"input_length":32,"output_length":4,"block_size":16,"hash_ids":[1,2],"session_id":7}"#,
            r#"{"timestamp":4,"input_length":32,"output_length":4,"block_size":16,"hash_ids":[5,6],"session_id":8}"#,
            r#"{"timestamp":5,"input_length":32,"output_length":4,"block_size":16,"hash_ids":[9,10]}"#,
        ];
        let trace = Trace::read(lines.join("\n").as_bytes()).unwrap();
        // Outcomes arrive in any order; session 7 goes a, b, b (one move), session 8
        // stays on a; a failed request counts for nothing.
        let mut failed = served(4, "b", 0);
        failed.ok = false;
        let outcomes = vec![
            served(3, "b", 16),
            served(0, "a", 0),
            served(2, "b", 0),
            served(1, "a", 0),
            failed,
            served(5, "c", 0),
        ];
        let r = summarize(&trace, "http://x", 16, outcomes, 1.0);
        assert_eq!(r.session_moves, 1);
        let sessions: Vec<(&str, usize)> = r
            .workers
            .iter()
            .map(|(w, t)| (w.as_str(), t.sessions))
            .collect();
        assert_eq!(sessions, [("a", 2), ("b", 1), ("c", 0)]);
        assert_eq!(r.sessions_max_over_mean, 2.0);
        assert!(replay_markdown_has(
            &r,
            "| session moves (turns served away from the turn before) | 1 |"
        ));
    }

    fn replay_markdown_has(r: &ReplayReport, line: &str) -> bool {
        crate::report::replay_markdown(r).lines().any(|l| l == line)
    }
}
