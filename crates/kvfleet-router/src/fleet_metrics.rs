//! The router's Prometheus metrics: names, help texts and the helpers that record them.
//!
//! One process-wide recorder (the `metrics` crate's global) serves `/metrics`; workers
//! running in the same process (`kvfleet up`) record into it too.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Latency buckets (seconds) from 1 µs (router decisions) to 60 s (long generations).
const SECONDS_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Installs the process-wide Prometheus recorder (once) and returns its handle, or
/// `None` if another recorder was installed first.
pub fn prometheus_handle() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .ok()?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            describe();
            register_at_zero();
            Some(handle)
        })
        .clone()
}

fn describe() {
    describe_counter!(
        "kvfleet_requests_total",
        "Requests by routing policy and outcome."
    );
    describe_counter!(
        "kvfleet_prompt_tokens_total",
        "Prompt tokens served, split by whether they came from the prefix cache."
    );
    describe_counter!("kvfleet_completion_tokens_total", "Tokens generated.");
    describe_histogram!(
        "kvfleet_router_decision_seconds",
        "Router decision latency by phase: hashing, index_lookup, scoring."
    );
    describe_counter!(
        "kvfleet_predicted_cached_tokens_total",
        "Cached prompt tokens the router predicted when it chose a worker."
    );
    describe_counter!(
        "kvfleet_actual_cached_tokens_total",
        "Cached prompt tokens the chosen worker reported."
    );
    describe_counter!("kvfleet_routed_total", "Requests routed to each worker.");
    describe_gauge!(
        "kvfleet_router_worker_events_behind",
        "KV events a worker published that this router's index has not applied (last poll)."
    );
    describe_gauge!(
        "kvfleet_router_worker_running",
        "Sequences running on a worker (last poll)."
    );
    describe_gauge!(
        "kvfleet_router_worker_waiting",
        "Sequences queued on a worker (last poll)."
    );
    describe_gauge!(
        "kvfleet_router_worker_free_blocks",
        "Free KV blocks on a worker (last poll)."
    );
    describe_gauge!(
        "kvfleet_router_worker_cached_blocks",
        "Cached prefix blocks on a worker (last poll)."
    );
    describe_gauge!(
        "kvfleet_router_worker_queued_prefill_tokens",
        "Prompt tokens waiting to be computed on a worker (last poll)."
    );
    describe_counter!(
        "kvfleet_fork_group_requests_total",
        "Fork-group requests, by whether they landed on their group's first worker."
    );
    describe_gauge!(
        "kvfleet_fork_group_colocation_ratio",
        "Share of fork-group requests served by their group's first worker."
    );
    describe_histogram!(
        "kvfleet_ttft_seconds",
        "Time to first token, seen by the router."
    );
    describe_histogram!(
        "kvfleet_itl_seconds",
        "Inter-token latency, seen by the router."
    );
    describe_histogram!(
        "kvfleet_request_seconds",
        "Whole request latency, seen by the router."
    );
    describe_counter!(
        "kvfleet_peer_pulls_total",
        "Requests sent with a hint to pull prefix blocks from the worker holding them."
    );
    describe_counter!(
        "kvfleet_peer_pull_hinted_blocks_total",
        "Prefix blocks requests were hinted to pull from a peer instead of recomputing."
    );
    describe_counter!(
        "kvfleet_retries_total",
        "Requests retried on another worker before they started."
    );
    describe_counter!(
        "kvfleet_router_placements_total",
        "Requests by how a placement shared with other routers took part (step: indexed, followed, claimed, lost, unplaced, pinned)."
    );
    describe_gauge!(
        "kvfleet_worker_circuit_state",
        "A worker's circuit breaker: 0 closed, 1 open, 2 half-open."
    );
    describe_counter!(
        "kvfleet_circuit_transitions_total",
        "Circuit breaker state changes, by worker, from and to."
    );
    describe_gauge!(
        "kvfleet_control_plane_up",
        "Whether a control-plane component (etcd, kafka) was reachable at the last attempt."
    );
    describe_counter!(
        "kvfleet_deadline_exceeded_total",
        "Worker calls that missed a deadline, by stage (first_token, queued, stall)."
    );
    describe_gauge!(
        "kvfleet_router_worker_queue_position",
        "Sequences queued ahead of the last request a worker acknowledged."
    );
    describe_counter!(
        "kvfleet_index_resyncs_total",
        "Prefix-index resyncs from a worker's CacheDump."
    );
    describe_counter!(
        "kvfleet_pins_total",
        "Requests that asked to pin their prefix (Anthropic cache_control ttl), by outcome: pinned, or why not."
    );
    describe_counter!(
        "kvfleet_prefix_breaks_total",
        "Session turns whose prompt diverged before the end of the previous turn's, by likely reason."
    );
    describe_counter!(
        "kvfleet_agent_status_requests_total",
        "Chat requests carrying an agent status, by status_mode."
    );
    describe_counter!(
        "kvfleet_agent_status_tokens_total",
        "Prompt tokens of rendered agent statuses (never cached in replace mode), by status_mode."
    );
}

/// Series that appear only on a rare first use (a fork group, a prefix break), set to
/// zero at start so a fresh deployment's dashboards and alerts read 0, not "No data".
fn register_at_zero() {
    for colocated in ["true", "false"] {
        counter!("kvfleet_fork_group_requests_total", "colocated" => colocated).absolute(0);
    }
    gauge!("kvfleet_fork_group_colocation_ratio").set(0.0);
    for reason in crate::prefix_breaks::BreakReason::ALL {
        counter!("kvfleet_prefix_breaks_total", "reason" => reason.as_str()).absolute(0);
    }
}

/// A finished request, by policy and outcome (`ok`, `client_error`, `worker_error`...).
pub fn request_done(policy: &str, outcome: &'static str) {
    counter!("kvfleet_requests_total", "policy" => policy.to_string(), "outcome" => outcome)
        .increment(1);
}

/// Prompt and completion token counts of a finished request.
pub fn tokens(prompt: usize, cached: usize, completion: usize) {
    counter!("kvfleet_prompt_tokens_total", "cached" => "true").increment(cached as u64);
    counter!("kvfleet_prompt_tokens_total", "cached" => "false")
        .increment(prompt.saturating_sub(cached) as u64);
    counter!("kvfleet_completion_tokens_total").increment(completion as u64);
}

/// Router decision phase latency.
pub fn decision_phase(phase: &'static str, nanos: u64) {
    histogram!("kvfleet_router_decision_seconds", "phase" => phase).record(nanos as f64 * 1e-9);
}

/// Predicted vs. actual cached tokens of one request.
pub fn cache_prediction(worker: &str, predicted: usize, actual: usize) {
    counter!("kvfleet_predicted_cached_tokens_total", "worker" => worker.to_string())
        .increment(predicted as u64);
    counter!("kvfleet_actual_cached_tokens_total", "worker" => worker.to_string())
        .increment(actual as u64);
}

/// A request was sent to `worker`.
pub fn routed(worker: &str, policy: &str) {
    counter!("kvfleet_routed_total", "worker" => worker.to_string(), "policy" => policy.to_string())
        .increment(1);
}

/// A worker's polled load.
pub fn worker_load(worker: &str, running: u64, waiting: u64, free: u64, cached: u64, queued: u64) {
    let w = worker.to_string();
    gauge!("kvfleet_router_worker_running", "worker" => w.clone()).set(running as f64);
    gauge!("kvfleet_router_worker_waiting", "worker" => w.clone()).set(waiting as f64);
    gauge!("kvfleet_router_worker_free_blocks", "worker" => w.clone()).set(free as f64);
    gauge!("kvfleet_router_worker_cached_blocks", "worker" => w.clone()).set(cached as f64);
    gauge!("kvfleet_router_worker_queued_prefill_tokens", "worker" => w).set(queued as f64);
}

/// How many KV events a worker has published beyond those this router's index applied
/// (the event-stream lag, sampled at each load poll).
pub fn worker_events_behind(worker: &str, behind: u64) {
    gauge!("kvfleet_router_worker_events_behind", "worker" => worker.to_string())
        .set(behind as f64);
}

/// A fork-group request landed on (or off) its group's first worker; `ratio` is the
/// router's running co-location share.
pub fn fork_group(colocated: bool, ratio: f64) {
    counter!("kvfleet_fork_group_requests_total", "colocated" => if colocated { "true" } else { "false" })
        .increment(1);
    gauge!("kvfleet_fork_group_colocation_ratio").set(ratio);
}

/// Time to first token.
pub fn ttft(seconds: f64) {
    histogram!("kvfleet_ttft_seconds").record(seconds);
}

/// One inter-token gap.
pub fn itl(seconds: f64) {
    histogram!("kvfleet_itl_seconds").record(seconds);
}

/// Whole request latency.
pub fn request_seconds(seconds: f64) {
    histogram!("kvfleet_request_seconds").record(seconds);
}

/// A session turn that lost the cache of the turn before it.
pub fn prefix_break(reason: &'static str) {
    counter!("kvfleet_prefix_breaks_total", "reason" => reason).increment(1);
}

/// A request that asked for a pin, by outcome (`pinned`, or the refusal's reason).
pub fn pin(outcome: &'static str) {
    counter!("kvfleet_pins_total", "outcome" => outcome).increment(1);
}

/// A request carrying an agent status, by mode.
pub fn agent_status(mode: &'static str, tokens: usize) {
    counter!("kvfleet_agent_status_requests_total", "mode" => mode).increment(1);
    counter!("kvfleet_agent_status_tokens_total", "mode" => mode).increment(tokens as u64);
}

/// A request sent to `worker` with a hint to pull `blocks` prefix blocks from `holder`.
pub fn peer_pull(worker: &str, holder: &str, blocks: usize) {
    counter!("kvfleet_peer_pulls_total", "worker" => worker.to_string(), "holder" => holder.to_string())
        .increment(1);
    counter!("kvfleet_peer_pull_hinted_blocks_total", "worker" => worker.to_string())
        .increment(blocks as u64);
}

/// How a routed request's placement took part (`crate::decision_log::PlacementStep`).
pub fn placement(step: &'static str) {
    counter!("kvfleet_router_placements_total", "step" => step).increment(1);
}

/// A request retried elsewhere before it started.
pub fn retry() {
    counter!("kvfleet_retries_total").increment(1);
}

/// A prefix-index resync from a worker's dump.
pub fn resync(worker: &str) {
    counter!("kvfleet_index_resyncs_total", "worker" => worker.to_string()).increment(1);
}

/// A worker's circuit breaker changed state.
pub fn circuit(
    worker: &str,
    from: crate::circuit_breaker::CircuitState,
    to: crate::circuit_breaker::CircuitState,
) {
    gauge!("kvfleet_worker_circuit_state", "worker" => worker.to_string()).set(to.gauge());
    counter!(
        "kvfleet_circuit_transitions_total",
        "worker" => worker.to_string(),
        "from" => from.as_str(),
        "to" => to.as_str()
    )
    .increment(1);
}

/// Whether a control-plane component is reachable.
pub fn control_plane_up(component: &'static str, up: bool) {
    gauge!("kvfleet_control_plane_up", "component" => component).set(if up { 1.0 } else { 0.0 });
}

/// Worker `worker` acknowledged a request with `position` sequences queued ahead of it.
pub fn queue_position(worker: &str, position: u32) {
    gauge!("kvfleet_router_worker_queue_position", "worker" => worker.to_string())
        .set(f64::from(position));
}

/// A worker call missed its deadline at `stage` (`first_token`, `queued`, `stall`).
pub fn deadline_exceeded(worker: &str, stage: &'static str) {
    counter!("kvfleet_deadline_exceeded_total", "worker" => worker.to_string(), "stage" => stage)
        .increment(1);
}
