//! The serving router's one routing core: a [`KvRouter`] behind a lock, and the
//! router's monotonic clock that reservations run on.
//!
//! No lock guard leaves this module. Every method takes the lock for one short step and
//! returns owned values, so nothing (a dashboard building JSON, an `await`) can run
//! while the routing lock is held by its caller.

use kvfleet_core::sync::lock;
use kvfleet_core::BlockHash;
use kvfleet_routing::{
    CacheDump, IndexError, KvEventSink, KvRouter, Pin, PolicyKind, RegisterError, ReservationId,
    RouteDecision, RouteError, RouterConfig, RouterKvEvent, RouterSnapshot, UnknownWorker,
    WorkerIdx, WorkerLoad,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The routing core, shared by request handlers, worker supervisors and the
/// control-plane event consumer.
pub struct RoutingState {
    kv: Mutex<KvRouter>,
    block_size: usize,
    started: Instant,
    /// Bytes of one KV block as the workers last reported it (0 before any).
    kv_block_bytes: AtomicU64,
}

/// What a request asks of [`RoutingState::route`].
pub struct RouteRequest<'a> {
    /// The prompt's full-block chained hashes.
    pub hashes: &'a [BlockHash],
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// A worker the request must go to (a shared placement or a pin), if routable,
    /// with the leading blocks it is known to hold or be computing.
    pub pin: Option<Pin<'a>>,
    /// The policy.
    pub policy: PolicyKind,
    /// Workers the request already failed on.
    pub exclude: &'a [String],
}

impl RoutingState {
    /// A routing core with no workers, its clock starting now.
    pub fn new(config: RouterConfig) -> Self {
        RoutingState {
            block_size: config.block_size,
            kv: Mutex::new(KvRouter::new(config)),
            started: Instant::now(),
            kv_block_bytes: AtomicU64::new(0),
        }
    }

    /// Milliseconds since the router started (the clock of reservations).
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Tokens per KV block of this fleet.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Routes a request now: reserves its chain on the chosen worker and counts it in
    /// flight there.
    pub fn route(&self, r: &RouteRequest<'_>) -> Result<RouteDecision, RouteError> {
        let now = self.now_ms();
        lock(&self.kv).route_excluding(r.hashes, r.prompt_tokens, r.pin, r.policy, now, r.exclude)
    }

    /// Whether some worker holds (or is about to hold) every block of `hashes`.
    pub fn holds_prefix(&self, hashes: &[BlockHash]) -> bool {
        let now = self.now_ms();
        lock(&self.kv).matches(hashes, now).deepest() >= hashes.len()
    }

    /// Ends a reservation early (the request never reached the worker).
    pub fn cancel_reservation(&self, id: ReservationId) {
        lock(&self.kv).cancel_reservation(id);
    }

    /// A request started on `worker` with `prefill_tokens` has ended.
    pub fn request_finished(&self, worker: &str, prefill_tokens: usize) {
        let _ = lock(&self.kv).request_finished(worker, prefill_tokens);
    }

    /// The worker served `actual` cached tokens where `predicted` were expected.
    pub fn record_outcome(&self, predicted: usize, actual: usize) {
        lock(&self.kv).record_outcome(predicted, actual);
    }

    /// Takes worker `id` out of routing (`true`) or lets it back (`false`), keeping its
    /// index.
    pub fn set_fenced(&self, id: &str, fenced: bool) {
        lock(&self.kv).set_fenced(id, fenced);
    }

    /// Adds worker `id` (no-op if present).
    pub fn add_worker(&self, id: &str, block_size: usize) -> Result<(), RegisterError> {
        lock(&self.kv).add_worker(id, block_size).map(|_| ())
    }

    /// Drops worker `id` and its blocks from routing.
    pub fn remove_worker(&self, id: &str) {
        lock(&self.kv).remove_worker(id);
    }

    /// Whether worker `id` is in routing.
    pub fn is_registered(&self, id: &str) -> bool {
        lock(&self.kv).worker_index(id).is_some()
    }

    /// Replaces worker `id`'s blocks with a cache dump taken at event `seq`.
    pub fn rebuild_worker(&self, id: &str, dump: &CacheDump, seq: u64) -> Result<(), IndexError> {
        lock(&self.kv).rebuild_worker(id, dump, seq)
    }

    /// Applies a batch of worker `id`'s events under one lock, stopping at the first
    /// error (see [`KvEventSink::apply_events`]).
    pub fn apply_events<'a, I>(&self, id: &str, events: I) -> Result<(), IndexError>
    where
        I: IntoIterator<Item = &'a RouterKvEvent>,
    {
        lock(&self.kv).apply_events(id, events)
    }

    /// Takes a load report of worker `id`; returns the last event seq applied for it.
    pub fn update_load(&self, id: &str, report: WorkerLoad) -> Result<u64, UnknownWorker> {
        let mut kv = lock(&self.kv);
        kv.update_load(id, report)?;
        Ok(kv.last_seq(id).unwrap_or(0))
    }

    /// The last event seq applied for worker `id`.
    pub fn last_seq(&self, id: &str) -> Option<u64> {
        lock(&self.kv).last_seq(id)
    }

    /// Prices tier hits with the KV size a worker reported (see
    /// [`KvRouter::set_kv_block_bytes`]).
    pub fn set_kv_block_bytes(&self, block_bytes: u64, block_size: usize) {
        self.kv_block_bytes.store(block_bytes, Ordering::Relaxed);
        lock(&self.kv).set_kv_block_bytes(block_bytes, block_size);
    }

    /// Bytes of one KV block as the workers last reported it (0 before any, or from
    /// workers that cannot copy blocks out).
    pub fn kv_block_bytes(&self) -> u64 {
        self.kv_block_bytes.load(Ordering::Relaxed)
    }

    /// Worker `id`'s blocks as the index has them, or `None` if it is not in routing.
    pub fn worker_blocks(&self, id: &str) -> Option<Vec<kvfleet_routing::DumpedBlock>> {
        let kv = lock(&self.kv);
        let idx = kv.worker_index(id)?;
        Some(kv.index().worker_blocks(idx))
    }

    /// A copy of the routing core's state.
    pub fn snapshot(&self) -> RouterSnapshot {
        lock(&self.kv).snapshot()
    }

    /// A copy of the routing core's state and, for each chain, every worker's matched
    /// depth in the index (indexed like `snapshot.workers`), taken under one lock.
    pub fn snapshot_with_depths(
        &self,
        chains: &[&[BlockHash]],
    ) -> (RouterSnapshot, Vec<Vec<usize>>) {
        let kv = lock(&self.kv);
        let snapshot = kv.snapshot();
        let depths = chains
            .iter()
            .map(|chain| {
                let m = kv.index().find_matches(chain);
                snapshot
                    .workers
                    .iter()
                    .map(|w| m.depth(WorkerIdx(w.index)))
                    .collect()
            })
            .collect();
        (snapshot, depths)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_routing::RouterKvEventKind;

    #[test]
    fn routes_confirms_and_abandons_without_handing_out_the_lock() {
        let r = RoutingState::new(RouterConfig::default());
        let bs = r.block_size();
        r.add_worker("w0", bs).unwrap();
        r.add_worker("w1", bs).unwrap();
        let chain: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let req = RouteRequest {
            hashes: &chain,
            prompt_tokens: 4 * bs + 1,
            pin: None,
            policy: PolicyKind::CacheAware,
            exclude: &[],
        };
        assert!(!r.holds_prefix(&chain));
        let d = r.route(&req).unwrap();
        // The reservation makes the chain known before any event confirms it.
        assert!(r.holds_prefix(&chain));
        // What dispatch does for a request that never reached its worker: the
        // reservation is cancelled and its in-flight guard dropped.
        r.cancel_reservation(d.reservation.unwrap());
        r.request_finished(&d.worker, d.prefill_tokens);
        assert!(
            !r.holds_prefix(&chain),
            "abandoned reservation still steers"
        );
        let snap = r.snapshot();
        assert!(snap.workers.iter().all(|w| w.load.inflight_requests == 0));

        let stored = RouterKvEvent {
            seq: 1,
            kind: RouterKvEventKind::Stored {
                medium: Default::default(),
                parent_hash: None,
                block_hashes: chain[..3].to_vec(),
            },
        };
        r.apply_events("w1", [&stored]).unwrap();
        assert_eq!(r.last_seq("w1"), Some(1));
        let (snap, depths) = r.snapshot_with_depths(&[&chain]);
        let w1 = snap.workers.iter().position(|w| w.id == "w1").unwrap();
        assert_eq!(depths[0][w1], 3);
        assert_eq!(r.worker_blocks("w1").map(|b| b.len()), Some(3));
        r.remove_worker("w1");
        assert!(!r.is_registered("w1"));
        assert_eq!(r.worker_blocks("w1"), None);
    }
}
