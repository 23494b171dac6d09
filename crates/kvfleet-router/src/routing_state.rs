//! The serving router's one routing core: a [`KvRouter`] behind a lock, and the
//! router's monotonic clock that reservations run on.
//!
//! No lock guard leaves this module, and no call holds the lock for more than one
//! short step:
//!
//! - a request takes it once to route and once when it ends (the in-flight count and
//!   the cached-token outcome are given back together, by [`InFlight`]'s drop);
//! - KV events are applied at most [`EVENT_PART_BLOCKS`] blocks per lock, and a dump
//!   rebuild in parts of [`REBUILD_PART`] blocks, so a routing decision never waits
//!   for a whole batch, a whole large event or a whole dump. Both yield to the runtime
//!   between parts.
//!
//! Why a lock and not a routing thread fed by channels (Dynamo's indexer task): a
//! decision costs microseconds, less than handing it to another thread and back.
//! `kvfleet bench router-scale` measured both on 2 cores, 256 workers, 20k requests/s
//! and 1M event blocks/s, before the decision was made faster: handlers waited
//! 0.38 ms at the median and 1.3-1.9 ms at p99 with the thread, 22 µs and 0.34 ms with
//! the lock. Waiters spin briefly before sleeping ([`SPIN`]), which took the lock's
//! p99 from about 270 µs to about 50 µs. docs/router-scale.md has the current figures.

use kvfleet_core::sync::lock;
use kvfleet_core::BlockHash;
use kvfleet_routing::{
    CacheDump, DumpedBlock, IndexError, KvRouter, Pin, PolicyKind, RebuildStep, RegisterError,
    ReservationId, RouteDecision, RouteError, RouterConfig, RouterKvEvent, RouterSnapshot,
    RunningId, UnknownWorker, WorkerIdx, WorkerLoad,
};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Instant;

/// How long a caller spins for the routing lock before it sleeps on it. Every hold
/// is a few microseconds; a thread that sleeps instead waits to be woken, and on a
/// virtual machine whose idle core has halted that alone measured 50-250 µs.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Takes the routing lock: spinning first (see [`SPIN`]), then sleeping on it.
fn hold(kv: &Mutex<KvRouter>) -> MutexGuard<'_, KvRouter> {
    let mut started = None;
    loop {
        match kv.try_lock() {
            Ok(guard) => return guard,
            Err(TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(TryLockError::WouldBlock) => {}
        }
        // The clock is read only once a first try failed, and the lock's cache line is
        // left to its holder for a while between tries.
        let since = *started.get_or_insert_with(Instant::now);
        if since.elapsed() >= SPIN {
            return lock(kv);
        }
        for _ in 0..8 {
            std::hint::spin_loop();
        }
    }
}

/// Event parts applied between two yields to the runtime.
const EVENTS_PER_YIELD: usize = 64;
/// Blocks of one event applied under one lock: a worker that evicts a long prompt
/// reports it as one event of hundreds of blocks, and a decision would wait for all
/// of them (about 0.3 µs a block on 2 busy cores).
pub const EVENT_PART_BLOCKS: usize = 16;
/// Dumped blocks added under one lock during a rebuild.
pub const REBUILD_PART: usize = 2_048;

/// The routing core, shared by request handlers, worker supervisors and the
/// control-plane event consumer.
pub struct RoutingState {
    kv: Arc<Mutex<KvRouter>>,
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

/// A routed request: the decision, and its count in flight on the chosen worker.
pub struct Routed {
    /// Where it goes, and what the router expects there.
    pub decision: RouteDecision,
    /// Counts the request in flight on `decision.worker` until dropped.
    pub in_flight: InFlight,
    /// Nanoseconds the call waited for the routing lock.
    pub lock_wait_ns: u64,
}

/// No outcome recorded yet.
const NO_OUTCOME: usize = usize::MAX;

/// Keeps a routed request counted as in flight on its worker until dropped; then
/// gives the count back and records how many cached tokens the worker served against
/// the router's prediction, under one lock.
pub struct InFlight {
    kv: Arc<Mutex<KvRouter>>,
    worker: Arc<str>,
    prefill_tokens: usize,
    /// The worker's load-report count when the request was routed.
    load_reports: u64,
    /// The first token came: the prefill tokens already left the worker's backlog.
    prefill_done: AtomicBool,
    predicted_cached_tokens: usize,
    actual_cached_tokens: AtomicUsize,
    /// The request's reservation, and the reservations' clock: when the request ends,
    /// the reservation counts only for the grace period more.
    reservation: Option<ReservationId>,
    /// The request's chain among those running on its worker, ended with it.
    running: Option<RunningId>,
    clock: Instant,
}

impl InFlight {
    /// Cached tokens the router predicted for the request.
    pub fn predicted_cached_tokens(&self) -> usize {
        self.predicted_cached_tokens
    }

    /// The request's first token came: its prefill tokens leave the worker's backlog
    /// now rather than at the next load report (once; later calls do nothing).
    pub fn prefill_done(&self) {
        if !self.prefill_done.swap(true, Ordering::Relaxed) {
            let _ = hold(&self.kv).prefill_finished(
                &self.worker,
                self.prefill_tokens,
                self.load_reports,
            );
        }
    }

    /// The worker served `actual` prompt tokens from cache (recorded when this drops).
    pub fn record_outcome(&self, actual: usize) {
        self.actual_cached_tokens
            .store(actual.min(NO_OUTCOME - 1), Ordering::Relaxed);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let actual = self.actual_cached_tokens.load(Ordering::Relaxed);
        // Prefill tokens a first token already took out of the backlog are not taken
        // twice.
        let prefill = if self.prefill_done.load(Ordering::Relaxed) {
            0
        } else {
            self.prefill_tokens
        };
        let now_ms = self.clock.elapsed().as_millis() as u64;
        let mut kv = hold(&self.kv);
        let _ = kv.request_finished(&self.worker, prefill);
        if let Some(id) = self.reservation {
            kv.request_ended(id, now_ms);
        }
        if let Some(id) = self.running {
            kv.request_done(id);
        }
        if actual != NO_OUTCOME {
            kv.record_outcome(self.predicted_cached_tokens, actual);
        }
    }
}

impl RoutingState {
    /// A routing core with no workers, its clock starting now.
    pub fn new(config: RouterConfig) -> Self {
        Self::from_router(KvRouter::new(config))
    }

    /// A routing core around `kv` (set up beforehand, e.g. to price every worker as a
    /// benchmark's reference), its clock starting now.
    pub fn from_router(kv: KvRouter) -> Self {
        RoutingState {
            block_size: kv.config().block_size,
            kv: Arc::new(Mutex::new(kv)),
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
    /// flight there until the returned [`InFlight`] is dropped.
    pub fn route(&self, r: &RouteRequest<'_>) -> Result<Routed, RouteError> {
        let now = self.now_ms();
        let asked = Instant::now();
        let mut kv = hold(&self.kv);
        let lock_wait_ns = asked.elapsed().as_nanos() as u64;
        let decision =
            kv.route_excluding(r.hashes, r.prompt_tokens, r.pin, r.policy, now, r.exclude)?;
        drop(kv);
        let in_flight = InFlight {
            kv: self.kv.clone(),
            worker: decision.worker.clone(),
            prefill_tokens: decision.prefill_tokens,
            load_reports: decision.load_reports,
            prefill_done: AtomicBool::new(false),
            predicted_cached_tokens: decision.predicted_cached_tokens,
            actual_cached_tokens: AtomicUsize::new(NO_OUTCOME),
            reservation: decision.reservation,
            running: decision.running,
            clock: self.started,
        };
        Ok(Routed {
            decision,
            in_flight,
            lock_wait_ns,
        })
    }

    /// Whether some worker holds (or is about to hold) every block of `hashes`.
    pub fn holds_prefix(&self, hashes: &[BlockHash]) -> bool {
        let now = self.now_ms();
        hold(&self.kv).matches(hashes, now).deepest() >= hashes.len()
    }

    /// Ends a reservation early (the request never reached the worker).
    pub fn cancel_reservation(&self, id: ReservationId) {
        hold(&self.kv).cancel_reservation(id);
    }

    /// Takes worker `id` out of routing (`true`) or lets it back (`false`), keeping its
    /// index.
    pub fn set_fenced(&self, id: &str, fenced: bool) {
        hold(&self.kv).set_fenced(id, fenced);
    }

    /// [`Self::set_fenced`], and whether worker `id` may be the source of a peer pull
    /// (see [`KvRouter::set_pull_source`]), under one lock: a breaker's verdict on a
    /// request's outcome.
    pub fn set_breaker_verdict(&self, id: &str, fenced: bool, pull_source: bool) {
        let mut kv = hold(&self.kv);
        kv.set_fenced(id, fenced);
        kv.set_pull_source(id, pull_source);
    }

    /// Adds worker `id` (no-op if present).
    pub fn add_worker(&self, id: &str, block_size: usize) -> Result<(), RegisterError> {
        hold(&self.kv).add_worker(id, block_size).map(|_| ())
    }

    /// Drops worker `id` and its blocks from routing.
    pub fn remove_worker(&self, id: &str) {
        hold(&self.kv).remove_worker(id);
    }

    /// Whether worker `id` is in routing.
    pub fn is_registered(&self, id: &str) -> bool {
        hold(&self.kv).worker_index(id).is_some()
    }

    /// Replaces worker `id`'s blocks with a cache dump taken at event `seq`, in parts
    /// of [`REBUILD_PART`] blocks with routing running between them.
    pub async fn rebuild_worker(
        &self,
        id: &str,
        dump: &CacheDump,
        seq: u64,
    ) -> Result<(), IndexError> {
        hold(&self.kv).rebuild_step(id, RebuildStep::Begin)?;
        for part in dump.chunks(REBUILD_PART) {
            tokio::task::yield_now().await;
            hold(&self.kv).rebuild_step(id, RebuildStep::Blocks(part))?;
        }
        hold(&self.kv).rebuild_step(id, RebuildStep::End(seq))
    }

    /// Applies a batch of worker `id`'s events, [`EVENT_PART_BLOCKS`] blocks per lock
    /// and yielding to the runtime every [`EVENTS_PER_YIELD`] parts, stopping at the
    /// first error (see
    /// [`kvfleet_routing::KvEventSink::apply_events`]).
    pub async fn apply_events(&self, id: &str, events: &[RouterKvEvent]) -> Result<(), IndexError> {
        let mut parts = 0usize;
        for event in events {
            let mut start = 0;
            loop {
                if parts > 0 && parts.is_multiple_of(EVENTS_PER_YIELD) {
                    tokio::task::yield_now().await;
                }
                parts += 1;
                let part = start..start + EVENT_PART_BLOCKS;
                if !hold(&self.kv).apply_event_part(id, event, part)? {
                    break;
                }
                start += EVENT_PART_BLOCKS;
            }
        }
        Ok(())
    }

    /// Takes a load report of worker `id`; returns the last event seq applied for it.
    pub fn update_load(&self, id: &str, report: WorkerLoad) -> Result<u64, UnknownWorker> {
        let mut kv = hold(&self.kv);
        kv.update_load(id, report)?;
        Ok(kv.last_seq(id).unwrap_or(0))
    }

    /// Takes a load worker `id` pushed with its KV events (see
    /// [`kvfleet_routing::WorkerLoad::apply_pushed`]); a worker no longer routed to is
    /// skipped.
    pub fn apply_pushed_load(&self, id: &str, pushed: &WorkerLoad) {
        let _ = hold(&self.kv).apply_pushed_load(id, pushed);
    }

    /// The last event seq applied for worker `id`.
    pub fn last_seq(&self, id: &str) -> Option<u64> {
        hold(&self.kv).last_seq(id)
    }

    /// Records the KV size worker `id` reported (see [`KvRouter::set_kv_block_bytes`]).
    pub fn set_kv_block_bytes(&self, id: &str, block_bytes: u64, block_size: usize) {
        self.kv_block_bytes.store(block_bytes, Ordering::Relaxed);
        hold(&self.kv).set_kv_block_bytes(id, block_bytes, block_size);
    }

    /// Bytes of one KV block as the workers last reported it (0 before any, or from
    /// workers that cannot copy blocks out).
    pub fn kv_block_bytes(&self) -> u64 {
        self.kv_block_bytes.load(Ordering::Relaxed)
    }

    /// Worker `id`'s blocks as the index has them, or `None` if it is not in routing.
    pub fn worker_blocks(&self, id: &str) -> Option<Vec<DumpedBlock>> {
        let kv = hold(&self.kv);
        let idx = kv.worker_index(id)?;
        Some(kv.index().worker_blocks(idx))
    }

    /// A copy of the routing core's state.
    pub fn snapshot(&self) -> RouterSnapshot {
        hold(&self.kv).snapshot()
    }

    /// A copy of the routing core's state and, for each chain, every worker's matched
    /// depth in the index (indexed like `snapshot.workers`), taken under one lock.
    pub fn snapshot_with_depths(
        &self,
        chains: &[&[BlockHash]],
    ) -> (RouterSnapshot, Vec<Vec<usize>>) {
        let kv = hold(&self.kv);
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

    /// A cache-aware request for `chain`, one token past its last full block.
    fn whole_chain(chain: &[BlockHash], bs: usize) -> RouteRequest<'_> {
        RouteRequest {
            hashes: chain,
            prompt_tokens: chain.len() * bs + 1,
            pin: None,
            policy: PolicyKind::CacheAware,
            exclude: &[],
        }
    }

    fn inflight(r: &RoutingState) -> usize {
        r.snapshot()
            .workers
            .iter()
            .map(|w| w.load.inflight_requests)
            .sum()
    }

    #[test]
    fn a_reservation_outlives_a_long_queue_but_not_its_request_by_more_than_the_grace() {
        // Grace 0: an ended request's reservation goes at the next lookup.
        let r = RoutingState::new(RouterConfig {
            reservation_grace_ms: 0,
            ..RouterConfig::default()
        });
        let bs = r.block_size();
        r.add_worker("w0", bs).unwrap();
        let chain: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let routed = r.route(&whole_chain(&chain, bs)).unwrap();
        // While the request is in flight (queued, say), its prefix stays findable.
        assert!(r.holds_prefix(&chain));
        assert!(r.holds_prefix(&chain));
        // Its end starts the grace, here none: nothing confirmed it, so it is gone.
        drop(routed);
        assert!(!r.holds_prefix(&chain), "an ended request still steers");
        assert_eq!(inflight(&r), 0);
    }

    #[tokio::test]
    async fn routes_confirms_and_abandons_without_handing_out_the_lock() {
        let r = RoutingState::new(RouterConfig::default());
        let bs = r.block_size();
        r.add_worker("w0", bs).unwrap();
        r.add_worker("w1", bs).unwrap();
        let chain: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let req = whole_chain(&chain, bs);
        assert!(!r.holds_prefix(&chain));
        let routed = r.route(&req).unwrap();
        assert_eq!(inflight(&r), 1);
        // The reservation makes the chain known before any event confirms it.
        assert!(r.holds_prefix(&chain));
        // What dispatch does for a request that never reached its worker: the
        // reservation is cancelled and its in-flight count dropped.
        r.cancel_reservation(routed.decision.reservation.unwrap());
        drop(routed);
        assert!(
            !r.holds_prefix(&chain),
            "abandoned reservation still steers"
        );
        assert_eq!(inflight(&r), 0);

        let stored = RouterKvEvent {
            seq: 1,
            kind: RouterKvEventKind::Stored {
                medium: Default::default(),
                parent_hash: None,
                block_hashes: chain[..3].to_vec(),
            },
        };
        r.apply_events("w1", &[stored]).await.unwrap();
        assert_eq!(r.last_seq("w1"), Some(1));
        let (snap, depths) = r.snapshot_with_depths(&[&chain]);
        let w1 = snap.workers.iter().position(|w| w.id == "w1").unwrap();
        assert_eq!(depths[0][w1], 3);
        assert_eq!(r.worker_blocks("w1").map(|b| b.len()), Some(3));
        r.remove_worker("w1");
        assert!(!r.is_registered("w1"));
        assert_eq!(r.worker_blocks("w1"), None);
    }

    /// An event longer than a part is applied a part per lock, all of it: the blocks,
    /// its sequence number, and the reservation its last block confirms.
    #[tokio::test]
    async fn a_long_event_is_applied_whole_a_part_per_lock() {
        let r = RoutingState::new(RouterConfig::default());
        let bs = r.block_size();
        r.add_worker("w0", bs).unwrap();
        let n = EVENT_PART_BLOCKS * 3 + 5;
        let chain: Vec<BlockHash> = (1..=n as u64).map(BlockHash).collect();
        let routed = r.route(&whole_chain(&chain, bs)).unwrap();
        assert_eq!(r.snapshot().reservations, 1);
        let stored = RouterKvEvent::stored(1, None, chain.clone());
        let removed = RouterKvEvent::removed(2, chain[n - 20..].iter().rev().copied().collect());
        r.apply_events("w0", &[stored]).await.unwrap();
        assert_eq!(r.last_seq("w0"), Some(1));
        assert_eq!(r.worker_blocks("w0").map(|b| b.len()), Some(n));
        assert_eq!(
            r.snapshot().reservations,
            0,
            "the chain's last block, in the event's last part, confirms it"
        );
        r.apply_events("w0", &[removed]).await.unwrap();
        assert_eq!(r.last_seq("w0"), Some(2));
        assert_eq!(r.worker_blocks("w0").map(|b| b.len()), Some(n - 20));
        drop(routed);
    }

    /// A request's end gives back its in-flight count and records its outcome at once.
    #[test]
    fn the_end_of_a_request_records_its_outcome_with_its_count() {
        let r = RoutingState::new(RouterConfig::default());
        let bs = r.block_size();
        r.add_worker("w0", bs).unwrap();
        let chain: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let req = whole_chain(&chain, bs);
        let first = r.route(&req).unwrap();
        let second = r.route(&req).unwrap();
        let predicted = second.decision.predicted_cached_tokens;
        assert_eq!(predicted, 4 * bs, "the first one's reservation is counted");
        second.in_flight.record_outcome(2 * bs);
        drop(second);
        // The first ends without an outcome (it failed before its usage came).
        drop(first);
        let snap = r.snapshot();
        assert_eq!(inflight(&r), 0);
        assert_eq!(snap.predictions.outcomes, 1);
        assert_eq!(snap.predictions.outcome_predicted_tokens, predicted as u64);
        assert_eq!(snap.predictions.outcome_actual_tokens, 2 * bs as u64);
    }

    /// A large dump is rebuilt in parts with routing running between them, and ends
    /// equal to the dump at its seq.
    #[tokio::test]
    async fn a_large_dump_is_rebuilt_in_parts() {
        let r = Arc::new(RoutingState::new(RouterConfig::default()));
        let bs = r.block_size();
        r.add_worker("w0", bs).unwrap();
        let stale = RouterKvEvent {
            seq: 1,
            kind: RouterKvEventKind::Stored {
                medium: Default::default(),
                parent_hash: None,
                block_hashes: vec![BlockHash(7)],
            },
        };
        r.apply_events("w0", &[stale]).await.unwrap();
        let n = REBUILD_PART * 3 + 5;
        let dump: Vec<DumpedBlock> = (0..n as u64)
            .map(|i| DumpedBlock {
                hash: BlockHash(1_000 + i),
                parent: i.checked_sub(1).map(|p| BlockHash(1_000 + p)),
                medium: Default::default(),
            })
            .collect();
        let rebuild = {
            let r = r.clone();
            tokio::spawn(async move { r.rebuild_worker("w0", &dump, 42).await })
        };
        // Between parts the index holds a part of the dump and nothing stale.
        let mut seen_part = false;
        while !rebuild.is_finished() {
            let held = r.worker_blocks("w0").map_or(0, |b| b.len());
            seen_part |= held > 0 && held < n;
            tokio::task::yield_now().await;
        }
        rebuild.await.unwrap().unwrap();
        assert!(
            seen_part,
            "the rebuild never let routing run between its parts"
        );
        let blocks = r.worker_blocks("w0").unwrap();
        assert_eq!(blocks.len(), n);
        assert!(blocks.iter().all(|b| b.hash != BlockHash(7)));
        assert_eq!(r.last_seq("w0"), Some(42));
        assert!(matches!(
            r.rebuild_worker("w9", &[], 1).await,
            Err(IndexError::UnknownWorker(_))
        ));
    }
}
