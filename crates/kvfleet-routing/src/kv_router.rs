//! [`KvRouter`]: the pure routing core — registry, prefix index, pending reservations,
//! load bookkeeping and policies behind one facade.
//!
//! It does no I/O and reads no clock for its decisions: the caller feeds it membership
//! changes, KV events, load reports and the current time in milliseconds, and asks it
//! where to send each request. The serving router (`kvfleet-router`) wraps it.
//!
//! A request's life: [`KvRouter::route`] looks the prompt's block hashes up in the
//! index and in the pending reservations, lets the chosen policy pick a worker,
//! reserves the prompt's chain for that worker (so siblings that arrive before its KV
//! events follow it), records the chain as running there (so a later prompt sharing
//! its prefix is known to need fewer free blocks there) and counts the request as in
//! flight. When the request ends, the caller calls [`KvRouter::request_finished`] with
//! the decision's `prefill_tokens` and [`KvRouter::request_done`] with its `running`,
//! and, once the worker reports how many tokens it actually served from cache,
//! [`KvRouter::record_outcome`] to track prediction accuracy.

use crate::events::{CacheDump, RouterKvEvent, RouterKvEventKind};
use crate::load::{CandidateLoad, WorkerLoad};
use crate::load_order::LoadOrder;
use crate::policy::{
    stable_str_hash, CacheAware, CacheAwareConfig, Candidate, ConsistentHash, ConsistentHashConfig,
    FleetLoad, LeastLoaded, PeerSource, PolicyKind, RandomPolicy, RoundRobin, RouteContext,
    RoutingPolicy,
};
use crate::prefix_index::{IndexError, Matches, PrefixIndex, TieredMatches, WorkerMatch};
use crate::registry::{WorkerIdx, WorkerRegistry};
use crate::reservations::{ReservationId, Reservations};
use kvfleet_core::{BlockHash, DEFAULT_BLOCK_SIZE};
use ordered::{Found, RunningLookup};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Router settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouterConfig {
    /// Tokens per KV block for the whole fleet (default 16). Workers with another
    /// block size are refused.
    pub block_size: usize,
    /// How long a reservation counts while its request is in flight, if the worker's
    /// events never confirm it (default 10 min: a request may queue for minutes on a
    /// slow or overloaded fleet, and the siblings routed meanwhile must still find the
    /// prefix it will compute; at 30 s, a CPU fleet at 90% load lost 0.17 in hit
    /// ratio on the Mooncake trace, docs/policy-sweep.head.md).
    pub reservation_ttl_ms: u64,
    /// How long a reservation counts after its request ends unconfirmed
    /// ([`KvRouter::request_ended`]; default 30 s: the worker's events trail the
    /// request's end by at most a poll, unless they are lost).
    pub reservation_grace_ms: u64,
    /// Weights of the `cache-aware` policy.
    pub cache_aware: CacheAwareConfig,
    /// Ring shape of the `consistent-hash` policy.
    pub consistent_hash: ConsistentHashConfig,
    /// Seed of the `random` policy.
    pub random_seed: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            reservation_ttl_ms: 600_000,
            reservation_grace_ms: 30_000,
            cache_aware: CacheAwareConfig::default(),
            consistent_hash: ConsistentHashConfig::default(),
            random_seed: 0x6b76_666c_6565_7421,
        }
    }
}

/// A worker a request must go to (a placement shared by several routers, or a pin),
/// and how many of the prompt's leading blocks it is known to hold or be computing
/// beyond what this router's index and reservations show (0: none known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin<'a> {
    /// The worker's id.
    pub worker: &'a str,
    /// Leading blocks of the prompt counted as cached there.
    pub holds_blocks: usize,
}

/// Why a worker could not be added.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The worker's block size differs from the fleet's: its block hashes could never
    /// match the router's, so every request sent to it would miss the cache.
    #[error("worker {worker:?} uses KV block size {block_size}, but this router's fleet uses {fleet_block_size}; a router never mixes block sizes (hashes of different block sizes never match) — configure the worker with block size {fleet_block_size} or give it its own router")]
    BlockSizeMismatch {
        /// The worker's id.
        worker: String,
        /// The worker's block size.
        block_size: usize,
        /// The router's block size.
        fleet_block_size: usize,
    },
    /// The worker id is empty.
    #[error("worker id must not be empty")]
    EmptyId,
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No worker is registered.
    #[error("no workers are available to route to")]
    NoWorkers,
}

/// An operation named a worker the router does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker {0:?}")]
pub struct UnknownWorker(pub String);

/// A step of [`KvRouter::rebuild_step`].
#[derive(Clone, Copy, Debug)]
pub enum RebuildStep<'a> {
    /// Forget the worker's blocks.
    Begin,
    /// Add these dumped blocks (parents before children).
    Blocks(&'a CacheDump),
    /// The dump was taken at this event seq.
    End(u64),
}

/// Wall time spent in the phases of one [`KvRouter::route`] call, for histograms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RouteTimings {
    /// Index plus reservation lookup.
    pub index_lookup_ns: u64,
    /// Building candidates and running the policy.
    pub scoring_ns: u64,
    /// Recording the reservation and in-flight work.
    pub reserve_ns: u64,
}

/// Where to send one request, and what the router expects to happen there.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteDecision {
    /// The chosen worker's id.
    pub worker: Arc<str>,
    /// The chosen worker's index in this router.
    pub worker_idx: WorkerIdx,
    /// Name of the policy that chose it.
    pub policy: &'static str,
    /// Prompt blocks the worker holds or will hold in its device pool, capped at the
    /// reusable blocks.
    pub matched_blocks: usize,
    /// Blocks after those it holds in its host tier (to be loaded, not computed).
    pub host_blocks: usize,
    /// Blocks after those it holds on disk only.
    pub disk_blocks: usize,
    /// Blocks after those it pulls from a peer (`pull`).
    pub peer_blocks: usize,
    /// The peer to pull the next `peer_blocks` blocks from, when pulls are on and
    /// another worker holds more of the prefix than the chosen one.
    pub pull: Option<PullPlan>,
    /// Deepest match over the fleet, in blocks (uncapped).
    pub deepest_match_blocks: usize,
    /// Prompt tokens the router expects the worker to serve from cache, in any tier or
    /// pulled: `(matched_blocks + host_blocks + disk_blocks + peer_blocks) ×
    /// block_size`, at most `prompt_tokens - 1` rounded down to a whole block (a
    /// worker always computes at least one prompt token).
    pub predicted_cached_tokens: usize,
    /// `prompt_tokens - predicted_cached_tokens`: the prefill recorded as in flight;
    /// pass it back to [`KvRouter::request_finished`].
    pub prefill_tokens: usize,
    /// The worker the policy preferred but skipped as overloaded, if any.
    pub spilled_from: Option<Arc<str>>,
    /// The reservation made for the prompt's chain (none for prompts shorter than one
    /// block, or when the worker already holds the whole chain); release it with
    /// [`KvRouter::cancel_reservation`] if the request never reaches the worker.
    pub reservation: Option<ReservationId>,
    /// The request's chain as running on the chosen worker (none for prompts shorter
    /// than one block, or while no worker reports its admission headroom, the one
    /// thing the running chains are read for): give it back to
    /// [`KvRouter::request_done`] when the request ends, however it ends.
    pub running: Option<RunningId>,
    /// Load reports the chosen worker's load had taken in when this was decided: give
    /// it back to [`KvRouter::prefill_finished`].
    pub load_reports: u64,
    /// Time spent per phase.
    pub timings: RouteTimings,
}

/// Handle of a routed request's chain among the chains running on its worker; see
/// [`RouteDecision::running`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RunningId(ReservationId);

/// "Pull blocks `first_block..end_block` of the prompt from `from`": the chosen worker
/// fetches them (`FetchBlocks`) before it queues the request, instead of computing
/// them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullPlan {
    /// The worker holding them.
    pub from: Arc<str>,
    /// Its index in this router.
    pub from_idx: WorkerIdx,
    /// First block to pull (the blocks before it the chosen worker holds itself).
    pub first_block: usize,
    /// One past the last block to pull.
    pub end_block: usize,
}

/// Predicted versus actual cached tokens, summed over decisions and outcomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PredictionStats {
    /// Requests routed.
    pub decisions: u64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: u64,
    /// Cached tokens predicted for those requests.
    pub predicted_cached_tokens: u64,
    /// Outcomes reported through [`KvRouter::record_outcome`].
    pub outcomes: u64,
    /// Predicted cached tokens of the reported outcomes.
    pub outcome_predicted_tokens: u64,
    /// Actual cached tokens of the reported outcomes.
    pub outcome_actual_tokens: u64,
    /// Outcomes where the worker cached fewer tokens than predicted.
    pub overestimates: u64,
    /// Outcomes where the worker cached more tokens than predicted.
    pub underestimates: u64,
    /// Sum of |predicted − actual| over outcomes.
    pub abs_error_tokens: u64,
}

/// One worker as the dashboard sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerSnapshot {
    /// The worker's id.
    pub id: String,
    /// Its index in this router.
    pub index: u32,
    /// Blocks the index says it holds.
    pub cached_blocks: usize,
    /// Its live reservations.
    pub reservations: usize,
    /// Sequence number of its last applied KV event.
    pub last_event_seq: u64,
    /// Its load, including this router's in-flight work.
    pub load: WorkerLoad,
}

/// The router's state for a dashboard.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RouterSnapshot {
    /// Tokens per block.
    pub block_size: usize,
    /// Distinct blocks cached anywhere.
    pub indexed_blocks: usize,
    /// Live reservations.
    pub reservations: usize,
    /// Workers in index order.
    pub workers: Vec<WorkerSnapshot>,
    /// Prediction accuracy so far.
    pub predictions: PredictionStats,
}

#[derive(Clone, Debug)]
struct WorkerEntry {
    id: Arc<str>,
    id_hash: u64,
    load: WorkerLoad,
    /// Whether the worker can hand KV blocks to a peer and import them (false once it
    /// reported no KV block bytes: the simulated engine has no KV to move).
    kv_movable: bool,
}

/// What a decision reads of each worker, kept dense beside the entries (24 bytes a
/// worker, not a whole load report): scoring 1,000 workers walks a few hundred cache
/// lines, not a few thousand.
#[derive(Clone, Copy, Debug)]
struct Scored {
    id_hash: u64,
    load: CandidateLoad,
    kv_movable: bool,
}

/// The pure routing core; see the module docs.
#[derive(Debug)]
pub struct KvRouter {
    config: RouterConfig,
    registry: WorkerRegistry,
    index: PrefixIndex,
    reservations: Reservations,
    /// The chains of the requests this router sent that have not ended, by worker
    /// (the same trie as `reservations`, but each entry lives until its request ends
    /// rather than until the worker's events confirm it): the blocks a worker's running
    /// sequences hold, as far as this router knows, which its admission headroom need
    /// not hold again ([`Candidate::running_blocks`]).
    running: Reservations,
    /// Workers whose load reports their admission headroom: only then do the running
    /// chains change a decision, so only then are they recorded and looked up (a
    /// lookup walks every worker running a shared system prompt).
    headroom_workers: usize,
    workers: Vec<Option<WorkerEntry>>,
    /// `workers`' [`Scored`] parts, by index; refreshed by every load change.
    scored: Vec<Option<Scored>>,
    /// The same workers in load order, for `cache-aware` at scale; refreshed with
    /// `scored`.
    load_order: LoadOrder,
    /// Price every worker instead of walking `load_order` (the reference the ordered
    /// walk must agree with; tests and benchmarks).
    full_scan: bool,
    cache_aware: CacheAware,
    round_robin: RoundRobin,
    least_loaded: LeastLoaded,
    consistent_hash: ConsistentHash,
    random: RandomPolicy,
    predictions: PredictionStats,
    // Workers kept out of routing (an open circuit breaker), by id: survives the
    // worker's removal and re-registration.
    fenced: std::collections::HashSet<String>,
    // Workers no pull may come from (see `set_pull_source`), by id.
    not_pull_sources: std::collections::HashSet<String>,
    // Scratch buffers reused by every route.
    matches: Matches,
    tiered: TieredMatches,
    candidates: Vec<Candidate>,
    /// Scratch of the ordered walk (`ordered.rs`).
    classes: ordered::MatchClasses,
}

impl Default for KvRouter {
    fn default() -> Self {
        Self::new(RouterConfig::default())
    }
}

impl KvRouter {
    /// A router with no workers.
    pub fn new(config: RouterConfig) -> Self {
        Self {
            registry: WorkerRegistry::new(),
            index: PrefixIndex::new(),
            reservations: Reservations::new(config.reservation_ttl_ms)
                .with_grace(config.reservation_grace_ms),
            running: Reservations::new(config.reservation_ttl_ms).with_grace(0),
            headroom_workers: 0,
            workers: Vec::new(),
            scored: Vec::new(),
            load_order: LoadOrder::new(config.cache_aware.decode_cost_per_sequence),
            full_scan: false,
            cache_aware: CacheAware::new(config.cache_aware.clone()),
            round_robin: RoundRobin::new(),
            least_loaded: LeastLoaded,
            consistent_hash: ConsistentHash::new(config.consistent_hash.clone()),
            random: RandomPolicy::new(config.random_seed),
            predictions: PredictionStats::default(),
            fenced: std::collections::HashSet::new(),
            not_pull_sources: std::collections::HashSet::new(),
            matches: Matches::new(),
            tiered: TieredMatches::new(),
            candidates: Vec::new(),
            classes: ordered::MatchClasses::default(),
            config,
        }
    }

    /// The router's settings.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Tokens per block of the fleet.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Number of registered workers.
    pub fn worker_count(&self) -> usize {
        self.registry.len()
    }

    /// The index of worker `id`, if registered.
    pub fn worker_index(&self, id: &str) -> Option<WorkerIdx> {
        self.registry.get(id)
    }

    /// Records the KV size worker `id` reports in its `Info`: `block_bytes` of one
    /// block of `block_size` tokens. Tier hits and pulls are priced with it. A worker
    /// reporting 0 cannot copy blocks out or in (the simulated engine), so it is never
    /// a pull's source or target, and the pricing stays as it was.
    pub fn set_kv_block_bytes(&mut self, id: &str, block_bytes: u64, block_size: usize) {
        if let Ok((idx, e)) = self.entry_mut(id) {
            e.kv_movable = block_bytes > 0;
            self.rescore(idx);
        }
        if block_bytes == 0 || block_size == 0 {
            return;
        }
        let per_token = block_bytes as f64 / block_size as f64;
        self.config.cache_aware.tiers.kv_bytes_per_token = per_token;
        self.cache_aware.set_kv_bytes_per_token(per_token);
    }

    /// The id of the worker at `idx`, if one is registered there.
    pub fn worker_name(&self, idx: WorkerIdx) -> Option<&Arc<str>> {
        self.registry.name(idx)
    }

    /// The prefix index (read-only).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The pending reservations (read-only).
    pub fn reservations(&self) -> &Reservations {
        &self.reservations
    }

    /// Worker `id`'s current load, including this router's in-flight work.
    pub fn load(&self, id: &str) -> Option<WorkerLoad> {
        self.entry(id).ok().map(|(_, e)| e.load)
    }

    /// Sequence number of worker `id`'s last applied KV event (0 before any).
    pub fn last_seq(&self, id: &str) -> Option<u64> {
        self.registry.get(id).map(|w| self.index.last_seq(w))
    }

    /// Adds worker `id` whose KV blocks hold `block_size` tokens. Refuses a block size
    /// other than the fleet's. Adding a registered worker again is a no-op that returns
    /// its index; to reset a restarted worker, remove it first or rebuild it.
    pub fn add_worker(&mut self, id: &str, block_size: usize) -> Result<WorkerIdx, RegisterError> {
        if id.is_empty() {
            return Err(RegisterError::EmptyId);
        }
        if block_size != self.config.block_size {
            return Err(RegisterError::BlockSizeMismatch {
                worker: id.to_owned(),
                block_size,
                fleet_block_size: self.config.block_size,
            });
        }
        let (idx, _) = self.registry.insert(id);
        if idx.index() >= self.workers.len() {
            self.workers.resize_with(idx.index() + 1, || None);
        }
        let slot = &mut self.workers[idx.index()];
        if slot.is_none() {
            *slot = Some(WorkerEntry {
                id: Arc::from(id),
                id_hash: stable_str_hash(id),
                load: WorkerLoad::default(),
                kv_movable: true,
            });
            self.rescore(idx);
        }
        Ok(idx)
    }

    /// Makes `cache-aware` price every worker (`true`) instead of walking the load
    /// order for large groups of equally matched workers. Both choose the same
    /// worker; the full scan is the reference tests and benchmarks compare with.
    pub fn set_full_scan(&mut self, on: bool) {
        self.full_scan = on;
    }

    /// Removes worker `id` with its cached blocks and reservations. Returns whether it
    /// was registered.
    pub fn remove_worker(&mut self, id: &str) -> bool {
        let Some(idx) = self.registry.remove(id) else {
            return false;
        };
        self.index.remove_worker(idx);
        self.reservations.remove_worker(idx);
        self.running.remove_worker(idx);
        if let Some(slot) = self.workers.get_mut(idx.index()) {
            *slot = None;
        }
        self.rescore(idx);
        true
    }

    /// Whether worker `id` may be the source of a peer pull (default yes). A worker
    /// whose last request failed may be hung: a pull from it would stall the pulling
    /// worker until the pull's start deadline, so the serving router bars it until it
    /// answers a request again. Routing to it is unchanged (its breaker decides that).
    pub fn set_pull_source(&mut self, id: &str, allowed: bool) {
        if allowed {
            self.not_pull_sources.remove(id);
        } else {
            self.not_pull_sources.insert(id.to_owned());
        }
    }

    /// Keeps worker `id` out of routing (`true`) or lets it back (`false`); its index
    /// entries stay. A fenced worker named by a pin is not routed to either.
    pub fn set_fenced(&mut self, id: &str, fenced: bool) {
        if fenced {
            self.fenced.insert(id.to_owned());
        } else {
            self.fenced.remove(id);
        }
    }

    /// Whether worker `id` is kept out of routing.
    pub fn is_fenced(&self, id: &str) -> bool {
        self.fenced.contains(id)
    }

    /// Takes a load report of worker `id` (its polled fields; the router keeps its own
    /// in-flight counters).
    pub fn update_load(&mut self, id: &str, report: WorkerLoad) -> Result<(), UnknownWorker> {
        let (idx, e) = self.entry_mut(id)?;
        e.load.apply_report(&report);
        self.rescore(idx);
        Ok(())
    }

    /// Takes a load worker `id` pushed with its KV events ([`WorkerLoad::apply_pushed`]).
    pub fn apply_pushed_load(
        &mut self,
        id: &str,
        pushed: &WorkerLoad,
    ) -> Result<(), UnknownWorker> {
        let (idx, e) = self.entry_mut(id)?;
        if e.load.apply_pushed(pushed) {
            self.rescore(idx);
        }
        Ok(())
    }

    /// Applies one KV event of worker `id`. A gap is returned (and the event not
    /// applied) so the caller can fetch a dump and call
    /// [`rebuild_worker`](Self::rebuild_worker). `Stored` events confirm the worker's
    /// reservations whose chains are now cached.
    pub fn apply_event(&mut self, id: &str, event: &RouterKvEvent) -> Result<(), IndexError> {
        self.apply_event_part(id, event, 0..usize::MAX).map(|_| ())
    }

    /// [`Self::apply_event`] for blocks `part` of the event only (see
    /// [`PrefixIndex::apply_part`]): returns whether to go on with the next part.
    pub fn apply_event_part(
        &mut self,
        id: &str,
        event: &RouterKvEvent,
        part: std::ops::Range<usize>,
    ) -> Result<bool, IndexError> {
        let idx = self
            .registry
            .get(id)
            .ok_or_else(|| IndexError::UnknownWorker(id.to_owned()))?;
        let more = self.index.apply_part(idx, event, part.clone())?;
        if let RouterKvEventKind::Stored { .. } = &event.kind {
            self.reservations
                .confirm_stored(idx, crate::prefix_index::event_blocks(&event.kind, part));
        }
        Ok(more)
    }

    /// Replaces worker `id`'s blocks with a cache dump reflecting its events up to
    /// `seq`.
    pub fn rebuild_worker(
        &mut self,
        id: &str,
        dump: &CacheDump,
        seq: u64,
    ) -> Result<(), IndexError> {
        let idx = self
            .registry
            .get(id)
            .ok_or_else(|| IndexError::UnknownWorker(id.to_owned()))?;
        self.index.rebuild_worker(idx, dump, seq);
        self.confirm(idx);
        Ok(())
    }

    /// One step of [`rebuild_worker`](Self::rebuild_worker) in parts, so that a caller
    /// sharing this router can let routing run between the parts of a large dump:
    /// [`RebuildStep::Begin`] forgets the worker's blocks, each
    /// [`RebuildStep::Blocks`] adds a part of the dump, [`RebuildStep::End`] records
    /// the dump's seq and confirms reservations. Between the steps the worker's index
    /// holds part of its dump: routing sees fewer of its blocks, never ones it lacks.
    pub fn rebuild_step(&mut self, id: &str, step: RebuildStep<'_>) -> Result<(), IndexError> {
        let idx = self
            .registry
            .get(id)
            .ok_or_else(|| IndexError::UnknownWorker(id.to_owned()))?;
        match step {
            RebuildStep::Begin => self.index.begin_rebuild(idx),
            RebuildStep::Blocks(part) => self.index.insert_dumped(idx, part),
            RebuildStep::End(seq) => {
                self.index.end_rebuild(idx, seq);
                self.confirm(idx);
            }
        }
        Ok(())
    }

    /// Records a request sent to worker `id` without [`route`](Self::route) (which
    /// records its own), with the prompt tokens it must compute.
    pub fn request_started(
        &mut self,
        id: &str,
        prefill_tokens: usize,
    ) -> Result<(), UnknownWorker> {
        let (idx, e) = self.entry_mut(id)?;
        e.load.start_request(prefill_tokens);
        self.rescore(idx);
        Ok(())
    }

    /// Records the end (success or failure) of a request sent to worker `id`, with the
    /// `prefill_tokens` it was started with.
    pub fn request_finished(
        &mut self,
        id: &str,
        prefill_tokens: usize,
    ) -> Result<(), UnknownWorker> {
        let (idx, e) = self.entry_mut(id)?;
        e.load.finish_request(prefill_tokens);
        self.rescore(idx);
        Ok(())
    }

    /// Records that a request routed to worker `id` (whose [`RouteDecision`] read
    /// `load_reports`) has computed its `prefill_tokens`: its first token came. They
    /// leave the worker's backlog now; the request still counts as in flight until
    /// [`request_finished`](Self::request_finished), which must then be given 0
    /// prefill tokens.
    pub fn prefill_finished(
        &mut self,
        id: &str,
        prefill_tokens: usize,
        load_reports: u64,
    ) -> Result<(), UnknownWorker> {
        let (idx, e) = self.entry_mut(id)?;
        e.load.finish_prefill(prefill_tokens, load_reports);
        self.rescore(idx);
        Ok(())
    }

    /// The request that made reservation `id` ended at `now_ms` (its worker answered
    /// it): unless the worker's events confirm the reservation first, it ends
    /// `reservation_grace_ms` later rather than at its TTL.
    pub fn request_ended(&mut self, id: ReservationId, now_ms: u64) {
        self.reservations.finish(id, now_ms);
    }

    /// The request whose decision made `running` ([`RouteDecision::running`]) ended,
    /// answered or failed: its blocks no longer count as held by its worker's running
    /// sequences.
    pub fn request_done(&mut self, running: RunningId) {
        self.running.release(running.0);
    }

    /// Ends a reservation early, e.g. when the request never reached the worker.
    /// Returns whether it was still live.
    pub fn cancel_reservation(&mut self, id: ReservationId) -> bool {
        self.reservations.release(id)
    }

    /// Records how many prompt tokens a worker actually served from cache for a
    /// request predicted to get `predicted_cached_tokens`.
    pub fn record_outcome(&mut self, predicted_cached_tokens: usize, actual_cached_tokens: usize) {
        let p = &mut self.predictions;
        let (pred, act) = (predicted_cached_tokens as u64, actual_cached_tokens as u64);
        p.outcomes += 1;
        p.outcome_predicted_tokens += pred;
        p.outcome_actual_tokens += act;
        p.abs_error_tokens += pred.abs_diff(act);
        match act.cmp(&pred) {
            std::cmp::Ordering::Less => p.overestimates += 1,
            std::cmp::Ordering::Greater => p.underestimates += 1,
            std::cmp::Ordering::Equal => {}
        }
    }

    /// Every worker's matched depth for `hashes`, counting the index and live
    /// reservations at `now_ms`.
    pub fn matches(&mut self, hashes: &[BlockHash], now_ms: u64) -> Matches {
        self.reservations.expire(now_ms);
        let mut m = Matches::new();
        self.index.find_matches_into(hashes, &mut m);
        self.reservations.pending_into(hashes, &mut m);
        m
    }

    /// Routes a request whose prompt has `prompt_tokens` tokens and full-block chained
    /// hashes `hashes`, with `policy`, at time `now_ms`. Reserves the chain for the
    /// chosen worker and records the request as in flight there.
    pub fn route(
        &mut self,
        hashes: &[BlockHash],
        prompt_tokens: usize,
        policy: PolicyKind,
        now_ms: u64,
    ) -> Result<RouteDecision, RouteError> {
        self.route_pinned(hashes, prompt_tokens, None, policy, now_ms)
    }

    /// [`Self::route`], restricted to worker `pinned` when it is registered (a
    /// placement shared by several routers names it); an unknown `pinned` is ignored.
    pub fn route_pinned(
        &mut self,
        hashes: &[BlockHash],
        prompt_tokens: usize,
        pinned: Option<&str>,
        policy: PolicyKind,
        now_ms: u64,
    ) -> Result<RouteDecision, RouteError> {
        let pinned = pinned.map(|worker| Pin {
            worker,
            holds_blocks: 0,
        });
        self.route_excluding(hashes, prompt_tokens, pinned, policy, now_ms, &[])
    }

    /// [`Self::route_pinned`] that skips the workers in `exclude` (those a retried
    /// request already failed on), and counts the blocks a [`Pin`] says its worker
    /// holds as cached there.
    pub fn route_excluding(
        &mut self,
        hashes: &[BlockHash],
        prompt_tokens: usize,
        pinned: Option<Pin<'_>>,
        policy: PolicyKind,
        now_ms: u64,
        exclude: &[String],
    ) -> Result<RouteDecision, RouteError> {
        // A pin on a fenced worker is dropped: the request goes elsewhere.
        let pin = pinned
            .map(|p| p.worker)
            .filter(|id| !self.fenced.contains(*id) && !exclude.iter().any(|x| x == id))
            .and_then(|id| self.registry.get(id));
        let pin_blocks = pinned.map_or(0, |p| p.holds_blocks);
        self.reservations.expire(now_ms);
        self.running.expire(now_ms);
        if self.registry.is_empty() {
            return Err(RouteError::NoWorkers);
        }
        let bs = self.config.block_size;
        let t0 = Instant::now();
        let mut matches = std::mem::take(&mut self.matches);
        let mut tiered = std::mem::take(&mut self.tiered);
        // The tier walk runs only once some worker reported a host or disk block.
        let with_tiers = self.index.has_lower_tiers();
        if with_tiers {
            self.index.find_tiered_matches_into(hashes, &mut tiered);
            std::mem::swap(&mut matches, tiered.device_mut());
        } else {
            self.index.find_matches_into(hashes, &mut matches);
        }
        // The worker must compute at least one prompt token, so at most
        // (prompt_tokens - 1) / bs whole blocks can come from cache.
        let reusable = hashes.len().min(prompt_tokens.saturating_sub(1) / bs);
        // Taken before the reservations merge in: only blocks a worker has reported
        // can be pulled from it.
        let peer_source = if self.config.cache_aware.tiers.pulls_enabled() {
            self.peer_source(&matches, with_tiers.then_some(&tiered), reusable, exclude)
        } else {
            None
        };
        // A holder this request cannot use (fenced, or one a retry failed on) does
        // not make a recompute a duplicate: its copy is going away or out of reach.
        let deepest = |matches: &Matches| {
            if self.fenced.is_empty() && exclude.is_empty() {
                matches.deepest()
            } else {
                self.usable_matches(matches, exclude)
                    .map(|m| m.depth)
                    .max()
                    .unwrap_or(0)
            }
            .min(reusable)
        };
        let computed_blocks = deepest(&matches);
        let admit_blocks = crate::policy::admit_blocks(prompt_tokens, bs);
        let running = RunningLookup::new(&self.running, hashes);
        self.reservations.pending_into(hashes, &mut matches);
        let deepest_blocks = deepest(&matches);
        // Only `cache-aware` reads it, and not while a sibling still computes the
        // prefix (a reservation reaches deeper than any reported copy).
        let holder_wait_tokens =
            if policy == PolicyKind::CacheAware && deepest_blocks == computed_blocks {
                self.holder_wait_tokens(&matches, &running, deepest_blocks, prompt_tokens, exclude)
            } else {
                0
            };
        let t1 = Instant::now();
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        let tiers = with_tiers.then_some(&tiered);
        let found = Found {
            matches: &matches,
            running,
            tiered: tiers,
            reusable,
            admit_blocks,
        };
        // cache-aware walks the load order unless the candidates are restricted (a
        // pin, fenced or excluded workers) or the prompt has no reusable block, or
        // a weight is not a number the orders can follow.
        let ordered = policy == PolicyKind::CacheAware
            && !self.full_scan
            && pin.is_none()
            && self.fenced.is_empty()
            && exclude.is_empty()
            && reusable > 0
            && self.load_order.usable()
            && self.cache_aware.config().memory_weight.is_finite();
        let fleet = if ordered {
            let mut classes = std::mem::take(&mut self.classes);
            let fleet = FleetLoad {
                workers: self.load_order.workers(),
                active_sequences: self.load_order.active_sequences(),
                usage_levels: self.load_order.usage_levels(),
            };
            let base = RouteContext {
                hashes,
                prompt_tokens,
                block_size: bs,
                candidates: &[],
                fleet,
                peer_source,
                deepest_blocks,
                holder_wait_tokens,
            };
            self.ordered_candidates(&base, &found, &mut classes, &mut candidates);
            self.classes = classes;
            fleet
        } else {
            self.scan_candidates(
                &found,
                pin.map(|w| (w, pin_blocks)),
                exclude,
                &mut candidates,
            );
            FleetLoad::of(&candidates)
        };
        let ctx = RouteContext {
            hashes,
            prompt_tokens,
            block_size: bs,
            candidates: &candidates,
            fleet,
            peer_source,
            deepest_blocks,
            holder_wait_tokens,
        };
        let policy_impl: &mut dyn RoutingPolicy = match policy {
            PolicyKind::CacheAware => &mut self.cache_aware,
            PolicyKind::RoundRobin => &mut self.round_robin,
            PolicyKind::LeastLoaded => &mut self.least_loaded,
            PolicyKind::ConsistentHash => &mut self.consistent_hash,
            PolicyKind::Random => &mut self.random,
        };
        let selection = policy_impl.select(&ctx);
        let policy_name = policy_impl.name();
        let chosen = selection.and_then(|s| {
            candidates
                .binary_search_by_key(&s.worker, |c| c.worker)
                .ok()
                .map(|i| (s, candidates[i]))
        });
        let deepest = matches.deepest();
        if with_tiers {
            std::mem::swap(&mut matches, tiered.device_mut());
        }
        self.matches = matches;
        self.tiered = tiered;
        self.candidates = candidates;
        let (selection, chosen) = chosen.ok_or(RouteError::NoWorkers)?;
        let t2 = Instant::now();

        let worker = selection.worker;
        let matched_blocks = chosen.matched_blocks;
        let have = matched_blocks + chosen.host_blocks + chosen.disk_blocks;
        // Any policy's choice pulls what a peer holds beyond it (cache-aware chose
        // knowing it would).
        let min_pull = self.config.cache_aware.tiers.peer_pull_min_blocks;
        let target_movable = self
            .workers
            .get(worker.index())
            .and_then(Option::as_ref)
            .is_some_and(|e| e.kv_movable);
        let pull = peer_source.filter(|_| target_movable).and_then(|src| {
            let blocks = src.pull_blocks(&chosen, min_pull);
            if blocks == 0 {
                return None;
            }
            Some(PullPlan {
                from: self.registry.name(src.worker)?.clone(),
                from_idx: src.worker,
                first_block: have,
                end_block: have + blocks,
            })
        });
        let peer_blocks = pull.as_ref().map_or(0, |p| p.end_block - p.first_block);
        let predicted_cached_tokens = (have + peer_blocks) * bs;
        let prefill_tokens = prompt_tokens.saturating_sub(predicted_cached_tokens);
        let id_of = |w: WorkerIdx| {
            self.workers
                .get(w.index())
                .and_then(Option::as_ref)
                .map(|e| e.id.clone())
        };
        let worker_id = id_of(worker).ok_or(RouteError::NoWorkers)?;
        let spilled_from = selection.spilled_from.and_then(id_of);
        // No reservation is needed when the worker's own events already cover the chain.
        let reservation = match hashes.last() {
            Some(&last) if !self.index.holds(worker, last) => {
                self.reservations.reserve(worker, hashes, now_ms)
            }
            _ => None,
        };
        let running = if self.headroom_workers > 0 {
            self.running.reserve(worker, hashes, now_ms).map(RunningId)
        } else {
            None
        };
        let mut load_reports = 0;
        if let Some(Some(e)) = self.workers.get_mut(worker.index()) {
            e.load.start_request(prefill_tokens);
            // The prompt takes its blocks from the worker's headroom until the next
            // poll reports what is left.
            e.load.admit_blocks_since_poll =
                e.load
                    .admit_blocks_since_poll
                    .saturating_add(crate::policy::admit_need(
                        admit_blocks,
                        &chosen.load,
                        chosen.running_blocks,
                    ));
            load_reports = e.load.reports;
        }
        self.rescore(worker);
        let p = &mut self.predictions;
        p.decisions += 1;
        p.prompt_tokens += prompt_tokens as u64;
        p.predicted_cached_tokens += predicted_cached_tokens as u64;
        let t3 = Instant::now();

        Ok(RouteDecision {
            worker: worker_id,
            worker_idx: worker,
            policy: policy_name,
            matched_blocks,
            host_blocks: chosen.host_blocks,
            disk_blocks: chosen.disk_blocks,
            peer_blocks,
            pull,
            deepest_match_blocks: deepest,
            predicted_cached_tokens,
            prefill_tokens,
            spilled_from,
            reservation,
            running,
            load_reports,
            timings: RouteTimings {
                index_lookup_ns: nanos(t1 - t0),
                scoring_ns: nanos(t2 - t1),
                reserve_ns: nanos(t3 - t2),
            },
        })
    }

    /// The soonest a worker the request may use that holds its `deepest` leading blocks
    /// would start its first token: that worker's prefill backlog plus the prompt
    /// tokens it lacks. 0 when nobody holds any.
    fn holder_wait_tokens(
        &self,
        matches: &Matches,
        running: &RunningLookup<'_>,
        deepest: usize,
        prompt_tokens: usize,
        exclude: &[String],
    ) -> usize {
        if deepest == 0 {
            return 0;
        }
        let bs = self.config.block_size;
        let lacks = prompt_tokens.saturating_sub(deepest * bs);
        let admit = crate::policy::admit_blocks(prompt_tokens, bs);
        // A holder that cannot admit the prompt now waits for its running sequences
        // first, priced as the policy prices it.
        self.usable_matches(matches, exclude)
            .filter(|m| m.depth >= deepest)
            .filter_map(|m| {
                let e = self.scored.get(m.worker.index())?.as_ref()?;
                let run = running.admitting(m.worker, m.depth, &e.load, admit);
                let need = crate::policy::admit_need(admit, &e.load, run);
                Some(
                    self.cache_aware
                        .backlog_of(&e.load, prompt_tokens, need)
                        .saturating_add(lacks),
                )
            })
            .min()
            .unwrap_or(0)
    }

    /// The matches of the workers the request may use: neither fenced nor in
    /// `exclude`.
    fn usable_matches<'a>(
        &'a self,
        matches: &'a Matches,
        exclude: &'a [String],
    ) -> impl Iterator<Item = WorkerMatch> + 'a {
        let all = self.fenced.is_empty() && exclude.is_empty();
        matches
            .iter()
            .filter(move |m| all || !self.is_barred(m.worker, exclude))
    }

    /// Whether `worker` may not serve this request: fenced, or in `exclude`.
    fn is_barred(&self, worker: WorkerIdx, exclude: &[String]) -> bool {
        self.workers
            .get(worker.index())
            .and_then(Option::as_ref)
            .is_some_and(|e| self.fenced.contains(&*e.id) || exclude.iter().any(|x| **x == *e.id))
    }

    /// Every worker a request may go to as a candidate: all registered workers but
    /// fenced and `exclude`d ones, or only `pin`'s worker (whose match is raised to
    /// the pin's blocks).
    fn scan_candidates(
        &self,
        found: &Found<'_>,
        pin: Option<(WorkerIdx, usize)>,
        exclude: &[String],
        out: &mut Vec<Candidate>,
    ) {
        let (matches, tiered, reusable) = (found.matches, found.tiered, found.reusable);
        let mut device = matches.as_slice().iter().peekable();
        // Fenced and excluded workers are looked up by id only when there are some.
        let skip_ids = !self.fenced.is_empty() || !exclude.is_empty();
        for (i, scored) in self.scored.iter().enumerate() {
            let Some(e) = scored else { continue };
            let worker = WorkerIdx(i as u32);
            // Both lists are sorted by index: merge instead of searching.
            while device.next_if(|m| m.worker < worker).is_some() {}
            let depth = device
                .next_if(|m| m.worker == worker)
                .map_or(0, |m| m.depth);
            if pin.is_some_and(|(p, _)| p != worker) {
                continue;
            }
            if skip_ids && self.is_barred(worker, exclude) {
                continue;
            }
            // A placement's worker is computing (or holds) the prompt up to the
            // blocks the pin names, though this router has not heard of it yet.
            let depth = match pin {
                Some((_, blocks)) => depth.max(blocks),
                None => depth,
            };
            let run = found.running_of(worker, depth.min(reusable), &e.load);
            out.push(self.candidate(worker, e, depth, run, tiered, reusable));
        }
    }

    /// `worker`'s candidate for a prompt it holds `depth` device blocks of, `running`
    /// of them shared with requests this router sent it that have not ended.
    #[inline]
    fn candidate(
        &self,
        worker: WorkerIdx,
        e: &Scored,
        depth: usize,
        running: usize,
        tiered: Option<&TieredMatches>,
        reusable: usize,
    ) -> Candidate {
        let matched_blocks = depth.min(reusable);
        let (host_blocks, disk_blocks) = match tiered {
            Some(t) => lower_tier_blocks(t.get(worker), matched_blocks, reusable),
            None => (0, 0),
        };
        Candidate {
            worker,
            id_hash: e.id_hash,
            load: e.load,
            matched_blocks,
            running_blocks: running.min(matched_blocks),
            host_blocks,
            disk_blocks,
            kv_movable: e.kv_movable,
        }
    }

    /// The worker (neither fenced nor in `exclude`) whose reported device and host
    /// blocks cover the longest prefix, capped at `reusable`; the lowest index wins a
    /// tie. `tiered` is the tier walk when one ran (`matches` is then its device part).
    fn peer_source(
        &self,
        matches: &Matches,
        tiered: Option<&TieredMatches>,
        reusable: usize,
        exclude: &[String],
    ) -> Option<PeerSource> {
        let usable = |w: WorkerIdx| {
            self.workers
                .get(w.index())
                .and_then(Option::as_ref)
                .is_some_and(|e| e.kv_movable && !self.not_pull_sources.contains(&*e.id))
                && !self.is_barred(w, exclude)
        };
        let mut best: Option<PeerSource> = None;
        let mut offer = |worker: WorkerIdx, blocks: usize| {
            let blocks = blocks.min(reusable);
            if blocks > 0 && best.is_none_or(|b| blocks > b.blocks) && usable(worker) {
                best = Some(PeerSource { worker, blocks });
            }
        };
        match tiered {
            Some(t) => t
                .as_slice()
                .iter()
                .for_each(|m| offer(m.worker, m.device + m.host)),
            None => matches.iter().for_each(|m| offer(m.worker, m.depth)),
        }
        best
    }

    /// The router's state for a dashboard.
    pub fn snapshot(&self) -> RouterSnapshot {
        let workers = self
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let e = e.as_ref()?;
                let w = WorkerIdx(i as u32);
                Some(WorkerSnapshot {
                    id: e.id.to_string(),
                    index: w.0,
                    cached_blocks: self.index.worker_block_count(w),
                    reservations: self.reservations.worker_len(w),
                    last_event_seq: self.index.last_seq(w),
                    load: e.load,
                })
            })
            .collect();
        RouterSnapshot {
            block_size: self.config.block_size,
            indexed_blocks: self.index.num_blocks(),
            reservations: self.reservations.len(),
            workers,
            predictions: self.predictions,
        }
    }

    // --- internals -------------------------------------------------------------

    fn confirm(&mut self, idx: WorkerIdx) {
        if self.reservations.worker_len(idx) > 0 {
            let index = &self.index;
            self.reservations.confirm(idx, |h| index.holds(idx, h));
        }
    }

    /// Refreshes worker `idx`'s [`Scored`] part from its entry (after a load change,
    /// an arrival or a departure).
    fn rescore(&mut self, idx: WorkerIdx) {
        let i = idx.index();
        if i >= self.scored.len() {
            self.scored.resize(i + 1, None);
        }
        let says = |s: &Option<Scored>| s.is_some_and(|s| s.load.admit_blocks() != u32::MAX);
        let said = says(&self.scored[i]);
        self.scored[i] = self
            .workers
            .get(i)
            .and_then(Option::as_ref)
            .map(|e| Scored {
                id_hash: e.id_hash,
                load: CandidateLoad::from(&e.load),
                kv_movable: e.kv_movable,
            });
        match (said, says(&self.scored[i])) {
            (false, true) => self.headroom_workers += 1,
            (true, false) => self.headroom_workers -= 1,
            _ => {}
        }
        self.load_order
            .set(idx, self.scored[i].map(|s| (s.load, s.id_hash)));
    }

    fn entry(&self, id: &str) -> Result<(WorkerIdx, &WorkerEntry), UnknownWorker> {
        self.registry
            .get(id)
            .and_then(|w| Some((w, self.workers.get(w.index())?.as_ref()?)))
            .ok_or_else(|| UnknownWorker(id.to_owned()))
    }

    fn entry_mut(&mut self, id: &str) -> Result<(WorkerIdx, &mut WorkerEntry), UnknownWorker> {
        let w = self.registry.get(id);
        w.and_then(|w| Some((w, self.workers.get_mut(w.index())?.as_mut()?)))
            .ok_or_else(|| UnknownWorker(id.to_owned()))
    }
}

/// The host and disk blocks of tiered match `m` beyond a device depth of `device`
/// (raised by reservations above the index's), within `reusable` blocks. Lower tiers
/// hold the deeper blocks (leaves leave the device first, then the host), so blocks a
/// reservation covers are taken from the host count first.
fn lower_tier_blocks(
    m: crate::prefix_index::TieredMatch,
    device: usize,
    reusable: usize,
) -> (usize, usize) {
    let covered = device.saturating_sub(m.device);
    let host = m.host.saturating_sub(covered);
    let disk = m.disk.saturating_sub(covered.saturating_sub(m.host));
    let room = reusable.saturating_sub(device);
    let host = host.min(room);
    (host, disk.min(room - host))
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

mod ordered;
#[cfg(test)]
mod tests;
