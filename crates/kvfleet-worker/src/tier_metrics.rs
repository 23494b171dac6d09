//! Metrics of a worker's KV tiers below the block pool (host memory, disk): blocks
//! and bytes held per tier, blocks and bytes moved each way, and the disk tier's
//! faults. Recorded from the engine thread as absolute totals of the engine's
//! [`TierStats`], so a missed update loses nothing.

use kvfleet_engine::TierStats;
use metrics::{counter, describe_counter, describe_gauge, gauge, Counter, Gauge};

/// Registers help texts for the tier metrics with the installed recorder.
pub fn describe_tier_metrics() {
    describe_gauge!(
        "kvfleet_worker_tier_blocks",
        "KV blocks held below the device pool, by tier (host, disk)."
    );
    describe_gauge!(
        "kvfleet_worker_tier_bytes",
        "Bytes of KV blocks held below the device pool, by tier."
    );
    describe_counter!(
        "kvfleet_worker_tier_demoted_blocks_total",
        "KV blocks copied from the device pool into the host tier."
    );
    describe_counter!(
        "kvfleet_worker_tier_demoted_off_thread_blocks_total",
        "Of the demoted blocks, those the write-out thread copied while the engine stepped; the rest were copied on the engine thread, between steps."
    );
    describe_counter!(
        "kvfleet_worker_tier_promoted_blocks_total",
        "KV blocks promoted into the device pool instead of recomputed, by source tier (host, disk, peer)."
    );
    describe_counter!(
        "kvfleet_worker_tier_bytes_moved_total",
        "Bytes of KV blocks moved between the device pool and lower tiers, by direction (demote, promote, disk_write)."
    );
    describe_counter!(
        "kvfleet_worker_tier_demotion_misses_total",
        "Cached blocks the device pool evicted before they were copied to a lower tier."
    );
    describe_counter!(
        "kvfleet_worker_disk_tier_faults_total",
        "Disk-tier trouble, by kind (full, write_error, backlog, missing, corrupt); each is a recompute, never a wrong block."
    );
}

/// Metric handles of one worker's tiers.
pub(crate) struct TierMetrics {
    held: [(Gauge, Gauge); 2],
    demoted: Counter,
    demoted_off_thread: Counter,
    promoted: [Counter; 3],
    moved: [Counter; 3],
    misses: Counter,
    faults: [Counter; 5],
}

impl TierMetrics {
    pub(crate) fn new(worker: &str) -> Self {
        let w = || worker.to_string();
        let held = |tier: &'static str| {
            (
                gauge!("kvfleet_worker_tier_blocks", "worker" => w(), "tier" => tier),
                gauge!("kvfleet_worker_tier_bytes", "worker" => w(), "tier" => tier),
            )
        };
        let promoted = |tier: &'static str| counter!("kvfleet_worker_tier_promoted_blocks_total", "worker" => w(), "tier" => tier);
        let moved = |dir: &'static str| counter!("kvfleet_worker_tier_bytes_moved_total", "worker" => w(), "direction" => dir);
        let fault = |kind: &'static str| counter!("kvfleet_worker_disk_tier_faults_total", "worker" => w(), "kind" => kind);
        TierMetrics {
            held: [held("host"), held("disk")],
            demoted: counter!("kvfleet_worker_tier_demoted_blocks_total", "worker" => w()),
            demoted_off_thread: counter!("kvfleet_worker_tier_demoted_off_thread_blocks_total", "worker" => w()),
            promoted: [promoted("host"), promoted("disk"), promoted("peer")],
            moved: [moved("demote"), moved("promote"), moved("disk_write")],
            misses: counter!("kvfleet_worker_tier_demotion_misses_total", "worker" => w()),
            faults: [
                fault("full"),
                fault("write_error"),
                fault("backlog"),
                fault("missing"),
                fault("corrupt"),
            ],
        }
    }

    pub(crate) fn update(&self, s: &TierStats) {
        self.held[0].0.set(s.host_blocks as f64);
        self.held[0].1.set(s.host_bytes as f64);
        self.held[1].0.set(s.disk_blocks as f64);
        self.held[1].1.set(s.disk_bytes as f64);
        self.demoted.absolute(s.demoted_blocks);
        self.demoted_off_thread.absolute(s.demoted_off_thread);
        self.promoted[0].absolute(s.promoted_host);
        self.promoted[1].absolute(s.promoted_disk);
        self.promoted[2].absolute(s.promoted_peer);
        self.moved[0].absolute(s.demoted_bytes);
        self.moved[1].absolute(s.promoted_bytes);
        self.moved[2].absolute(s.disk.written_bytes);
        self.misses.absolute(s.demotion_misses);
        let d = &s.disk;
        for (c, v) in self.faults.iter().zip([
            d.full,
            d.write_errors,
            d.backlog_drops,
            d.missing,
            d.corrupt,
        ]) {
            c.absolute(v);
        }
    }
}
