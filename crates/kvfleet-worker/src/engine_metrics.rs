//! The worker's metrics, recorded through the `metrics` facade from the engine thread.
//! No exporter is installed here: the process does that (see the router's
//! `fleet_metrics`), and [`describe_metrics`] adds help texts once it has.

use kvfleet_engine::{EngineLoad, EngineStats};
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics::{Counter, Gauge, Histogram};

/// Registers help texts for the worker-side metrics with the installed recorder.
/// Call after installing an exporter; without one it does nothing.
pub fn describe_metrics() {
    crate::tier_metrics::describe_tier_metrics();
    describe_gauge!("kvfleet_worker_running", "Sequences running on a worker.");
    describe_gauge!("kvfleet_worker_waiting", "Sequences queued on a worker.");
    describe_gauge!("kvfleet_worker_free_blocks", "Free KV blocks on a worker.");
    describe_gauge!(
        "kvfleet_worker_admit_blocks",
        "KV blocks a new sequence may take now: free blocks less the running sequences' expected growth."
    );
    describe_gauge!(
        "kvfleet_worker_cached_blocks",
        "Cached prefix blocks on a worker."
    );
    describe_gauge!(
        "kvfleet_worker_queued_prefill_tokens",
        "Prompt tokens waiting to be computed on a worker."
    );
    describe_counter!(
        "kvfleet_worker_prompt_tokens_total",
        "Prompt tokens received by a worker."
    );
    describe_counter!(
        "kvfleet_worker_prompt_tokens_computed_total",
        "Prompt tokens a worker ran through the model (recomputation included)."
    );
    describe_counter!(
        "kvfleet_worker_cached_tokens_total",
        "Prompt tokens a worker served from its prefix cache."
    );
    describe_counter!(
        "kvfleet_worker_generated_tokens_total",
        "Tokens a worker generated."
    );
    describe_counter!(
        "kvfleet_worker_preemptions_total",
        "Sequences a worker preempted (to recompute later)."
    );
    describe_counter!(
        "kvfleet_worker_requests_total",
        "Generate requests a worker finished, by finish reason."
    );
    describe_counter!(
        "kvfleet_worker_fork_group_requests_total",
        "Generate requests a worker accepted that belong to a fork group."
    );
    describe_counter!(
        "kvfleet_worker_forks_total",
        "Fork requests a worker accepted (each computes its shared prefix once)."
    );
    describe_counter!(
        "kvfleet_worker_fork_children_total",
        "Children of the fork requests a worker accepted."
    );
    describe_histogram!(
        "kvfleet_worker_ttft_seconds",
        "Time to first token on a worker, from receiving the call."
    );
    describe_histogram!(
        "kvfleet_worker_queue_seconds",
        "Time a request waited in a worker's command queue."
    );
}

/// Metric handles of one worker (label `worker`), resolved once.
pub(crate) struct EngineMetrics {
    worker: String,
    running: Gauge,
    waiting: Gauge,
    free_blocks: Gauge,
    admit_blocks: Gauge,
    cached_blocks: Gauge,
    queued_prefill_tokens: Gauge,
    prompt_tokens: Counter,
    prompt_tokens_computed: Counter,
    cached_tokens: Counter,
    generated_tokens: Counter,
    preemptions: Counter,
    fork_group_requests: Counter,
    forks: Counter,
    fork_children: Counter,
    ttft: Histogram,
    queue: Histogram,
    last: EngineStats,
}

impl EngineMetrics {
    /// Handles for `worker`.
    pub(crate) fn new(worker: &str) -> Self {
        let w = || worker.to_string();
        EngineMetrics {
            worker: w(),
            running: gauge!("kvfleet_worker_running", "worker" => w()),
            waiting: gauge!("kvfleet_worker_waiting", "worker" => w()),
            free_blocks: gauge!("kvfleet_worker_free_blocks", "worker" => w()),
            admit_blocks: gauge!("kvfleet_worker_admit_blocks", "worker" => w()),
            cached_blocks: gauge!("kvfleet_worker_cached_blocks", "worker" => w()),
            queued_prefill_tokens: gauge!("kvfleet_worker_queued_prefill_tokens", "worker" => w()),
            prompt_tokens: counter!("kvfleet_worker_prompt_tokens_total", "worker" => w()),
            prompt_tokens_computed: counter!(
                "kvfleet_worker_prompt_tokens_computed_total",
                "worker" => w()
            ),
            cached_tokens: counter!("kvfleet_worker_cached_tokens_total", "worker" => w()),
            generated_tokens: counter!("kvfleet_worker_generated_tokens_total", "worker" => w()),
            preemptions: counter!("kvfleet_worker_preemptions_total", "worker" => w()),
            fork_group_requests: counter!(
                "kvfleet_worker_fork_group_requests_total",
                "worker" => w()
            ),
            forks: counter!("kvfleet_worker_forks_total", "worker" => w()),
            fork_children: counter!("kvfleet_worker_fork_children_total", "worker" => w()),
            ttft: histogram!("kvfleet_worker_ttft_seconds", "worker" => w()),
            queue: histogram!("kvfleet_worker_queue_seconds", "worker" => w()),
            last: EngineStats::default(),
        }
    }

    /// Records the engine's current load and what its totals grew by since last time.
    pub(crate) fn update(&mut self, load: &EngineLoad, stats: &EngineStats) {
        self.running.set(load.running as f64);
        self.waiting.set(load.waiting as f64);
        self.free_blocks.set(load.free_blocks as f64);
        self.admit_blocks.set(load.admit_blocks as f64);
        self.cached_blocks.set(load.cached_blocks as f64);
        self.queued_prefill_tokens
            .set(load.queued_prefill_tokens as f64);
        let d = |now: u64, before: u64| now.saturating_sub(before);
        self.prompt_tokens
            .increment(d(stats.prompt_tokens, self.last.prompt_tokens));
        self.prompt_tokens_computed.increment(d(
            stats.prompt_tokens_computed,
            self.last.prompt_tokens_computed,
        ));
        self.cached_tokens
            .increment(d(stats.cached_tokens, self.last.cached_tokens));
        self.generated_tokens
            .increment(d(stats.generated_tokens, self.last.generated_tokens));
        self.preemptions
            .increment(d(stats.preemptions, self.last.preemptions));
        self.last = stats.clone();
    }

    /// A request was accepted after `queue_secs` in the command queue.
    pub(crate) fn accepted(&self, queue_secs: f64, in_fork_group: bool) {
        self.queue.record(queue_secs);
        if in_fork_group {
            self.fork_group_requests.increment(1);
        }
    }

    /// A fork of `children` children was accepted after `queue_secs` in the command
    /// queue; its children count as requests of its fork group, if it has one.
    pub(crate) fn fork_accepted(&self, queue_secs: f64, children: usize, in_fork_group: bool) {
        self.queue.record(queue_secs);
        self.forks.increment(1);
        self.fork_children.increment(children as u64);
        if in_fork_group {
            self.fork_group_requests.increment(children as u64);
        }
    }

    /// A request produced its first output `secs` after the call arrived.
    pub(crate) fn first_token(&self, secs: f64) {
        self.ttft.record(secs);
    }

    /// A request finished with `reason` (a label such as `stop`).
    pub(crate) fn finished(&self, reason: &'static str) {
        counter!(
            "kvfleet_worker_requests_total",
            "worker" => self.worker.clone(),
            "finish_reason" => reason
        )
        .increment(1);
    }
}
