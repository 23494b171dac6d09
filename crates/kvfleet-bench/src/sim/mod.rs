//! `kvfleet sim`: a discrete-event simulation of a fleet.
//!
//! Requests arrive at their trace timestamps (a child waits for its parent to finish),
//! are routed by a [`SimRouter`] — kvfleet's own policies through the real
//! [`KvRouter`](kvfleet_routing::KvRouter) (prefix index fed by the simulated workers'
//! KV events, load fed by their queues), or a re-implemented baseline — and served by
//! simulated workers: an [`lru::LruBlockCache`] of `cache_blocks` blocks, prefill
//! serialized per worker and decode overlapped, timed by a [`cost_model::CostModel`].
//!
//! A request's prefix hits are the leading blocks of its chain cached on its worker
//! when it is enqueued (the engine publishes blocks when it allocates them, so a
//! sibling enqueued behind it reuses them too); then its whole chain becomes cached
//! there. Hit ratios count blocks, as the [`crate::bounds`] do.
//!
//! # Hits at admission
//!
//! An engine allocates a waiting sequence's blocks when it admits it, not when it is
//! queued. With [`SimConfig::hits_at_admission`] (`--hits-at-admission`) a request
//! takes its hits, stores its chain and evicts what that evicts when its prefill
//! starts (`Admitter`); while it waits, the router's backlog carries the prefill its
//! expected hits leave (the pool's blocks and those of the chains queued ahead of
//! it), and it keeps its cached prefix as the engine's scheduler keeps a waiting
//! sequence's (`Scheduler::enqueue`): it holds the leading blocks while the queued
//! requests have taken at most half the pool to hold (a block another request holds
//! or runs with costs nothing more), and the rest is made the most recently used.
//! A worker's pool takes the same
//! chains in the same order either way; what changes is what a router sees while
//! requests queue, and which blocks are least recent when the queue's admissions
//! evict. Taken at arrival (the default), the evictions of the
//! requests queued ahead of a new one are already reported when it is routed, so the
//! router knows which cached prefixes the queue will evict before an engine would
//! evict them. On the sweep (seed 1, 84 groups, docs/policy-sweep.head.md,
//! 2026-12-06) `cache-aware` met all three targets in 16 groups this way against 40,
//! with 13,426 avoidable waits against 1: requests sent to a holder behind a queue
//! whose admissions evict the prefix they came for. Since the engine touches a
//! waiting request's prefix (same page, "2026-12-06, last"), the same sweep meets 18
//! with 3,566 waits, and every policy's hits rise; since it holds it ("2026-12-06, a
//! held prefix"), 20 with 1,424.
//!
//! # Held blocks
//!
//! By default a worker's pool evicts its least recently used blocks whether or not a
//! running sequence holds them, and a prefill lane never waits for memory. With
//! [`SimConfig::hold_blocks`] (`--hold-blocks`) a request's blocks are held as an
//! engine holds them, from the start of its prefill (its admission) to its last token
//! (a queued request holds none, as an engine's waiting sequence holds none): the pool
//! evicts only blocks nobody holds (see [`lru`]), and a lane starts a request only
//! once the blocks the running sequences hold plus its own fit the pool. Under memory
//! pressure the default evicts mostly held blocks (`cache-aware` at 256 workers in the sweep's heaviest
//! loads: 171,089 of 205,542 evictions in `conversation`, 276,155 of 432,690 in
//! `fork`), so it overstates what a pool loses and understates how long a request
//! waits for memory.
//!
//! `--hold-blocks` alone books a request's whole output when its prefill starts. With
//! [`SimConfig::decode_reserve`] (`--decode-reserve-ratio`) the worker follows the
//! engine's scheduler instead ([`engine_memory`]): the output takes blocks as it is
//! generated, a request is admitted while the free blocks cover it and the share of
//! the running requests' remaining output the decode reserve expects, and a growth
//! that finds no free block preempts the newest decoding request, which computes its
//! prompt's uncached part and its generated tokens again when admitted anew. A
//! finished (or preempted) request's full blocks of generated tokens stay cached
//! behind its prompt's, as the engine keeps them. Against a live fleet of
//! `--engine sim` workers replaying 8-turn conversations under memory pressure
//! (`scripts/bench_engine_sim.sh`, docs/policy-sweep.head.md, "2026-12-06, the
//! engine's memory rule") it is the one configuration whose preemptions and p99 TTFT
//! follow the live fleet's at both 4 and 64 workers; its cached share is still 10–12%
//! high there, and 41% low at 4 workers of 40 blocks.
//!
//! # Tiers
//!
//! With `host_blocks` / `disk_blocks` a worker keeps two more LRU caches below its
//! device pool, as the engine does: a block evicted from the device is demoted to host
//! (a host eviction to disk, a disk eviction is gone); a request's hits continue past
//! its device prefix into host and then disk blocks, which are promoted (stored on the
//! device again; the lower copy stays, touched). Each promoted block's copy time under
//! the cost model (`kv_bytes_per_token ÷ host_bytes_per_s` per token, or disk's) is
//! added to the request's prefill, on the worker's prefill lane. Every tier reports its
//! own stored/removed events, so kvfleet's router sees them; its tier pricing is set
//! from the same cost model, scored by [`SimConfig::tier_scoring`]. The baselines see
//! device blocks only.
//!
//! # Peer pulls
//!
//! With [`SimConfig::peer_pull_min_blocks`] set, kvfleet's router may plan "pull blocks
//! i..j from W" (see [`SimRouter::take_pull`]). The chosen worker then gets those of
//! W's device and host blocks that W really holds when the request is enqueued; their
//! transfer (`kv_bytes_per_token ÷ peer_bytes_per_s` per token) is added to the
//! request's prefill, and they count as hits (`peer_hit_blocks`). The blocks W no
//! longer holds are computed.

pub mod blocks_in_use;
pub mod cost_model;
pub mod dynamo_kv_cost;
pub mod engine_memory;
pub mod kvfleet_policy;
pub mod lru;
pub mod sglang_cache_aware;

use crate::bounds::chains;
use crate::session_placement::{max_over_mean, SessionPlacement};
use crate::trace::Trace;
use blocks_in_use::BlocksInUse;
use cost_model::CostModel;
use dynamo_kv_cost::{DynamoConfig, DynamoKvCost, DynamoMetric};
use engine_memory::EngineMemory;
use kvfleet_core::decode_reserve::DecodeReserveConfig;
use kvfleet_core::kv_events::Medium;
use kvfleet_core::BlockHash;
use kvfleet_routing::policy::default_peer_pull_min_blocks;
pub use kvfleet_routing::policy::TierScoring;
use kvfleet_routing::{PolicyKind, RouterConfig};
use lru::{ChainChange, LowerOp, LruBlockCache};
use serde::Serialize;
use sglang_cache_aware::{SglangCacheAware, SglangConfig};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};

/// A policy the simulator can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimPolicy {
    /// One of kvfleet's policies, through the real router core.
    Kvfleet(PolicyKind),
    /// SGLang router's `cache_aware`.
    SglangCacheAware,
    /// Dynamo's KV router cost.
    DynamoKvCost,
    /// SGLang router's `cache_aware` with its per-worker spill rule.
    SglangSpill,
    /// Dynamo's `lmetric` cost: prefill × (decode blocks + 1).
    DynamoLmetric,
}

impl SimPolicy {
    /// Every policy: kvfleet's five, then the four baselines.
    pub fn all() -> Vec<SimPolicy> {
        let mut v: Vec<SimPolicy> = PolicyKind::ALL
            .into_iter()
            .map(SimPolicy::Kvfleet)
            .collect();
        v.push(SimPolicy::SglangCacheAware);
        v.push(SimPolicy::DynamoKvCost);
        v.push(SimPolicy::SglangSpill);
        v.push(SimPolicy::DynamoLmetric);
        v
    }

    /// The policy's name.
    pub fn as_str(self) -> &'static str {
        match self {
            SimPolicy::Kvfleet(k) => k.as_str(),
            SimPolicy::SglangCacheAware => "sglang-cache-aware",
            SimPolicy::DynamoKvCost => "dynamo-kv-cost",
            SimPolicy::SglangSpill => "sglang-spill",
            SimPolicy::DynamoLmetric => "dynamo-lmetric",
        }
    }
}

impl std::str::FromStr for SimPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "sglang-cache-aware" | "sglang" => Ok(SimPolicy::SglangCacheAware),
            "dynamo-kv-cost" | "dynamo" => Ok(SimPolicy::DynamoKvCost),
            "sglang-spill" => Ok(SimPolicy::SglangSpill),
            "dynamo-lmetric" => Ok(SimPolicy::DynamoLmetric),
            other => other.parse::<PolicyKind>().map(SimPolicy::Kvfleet).map_err(|_| {
                format!("unknown policy {s:?}; valid: cache-aware, round-robin, least-loaded, consistent-hash, random, sglang-cache-aware, dynamo-kv-cost, sglang-spill, dynamo-lmetric")
            }),
        }
    }
}

/// One simulated worker's state, as routers may observe it.
#[derive(Clone, Debug)]
pub struct SimWorker {
    /// The prefix cache (the device pool).
    pub lru: LruBlockCache,
    /// The host tier below it (capacity 0: none).
    pub host: LruBlockCache,
    /// The disk tier below the host (capacity 0: none).
    pub disk: LruBlockCache,
    queue: VecDeque<usize>,
    /// The blocks of the queued requests' chains (with how many chains hold each):
    /// not in the pool yet (a request takes its blocks when its prefill starts), but
    /// a request queued behind them will find them computed.
    queued_blocks: HashMap<BlockHash, u32>,
    prefilling: Option<usize>,
    /// Requests whose prefills run in the same step as `prefilling`'s and end with it,
    /// as the engine admits the waiting requests that fit its step's token budget
    /// together ([`SimConfig::mixed_steps`]).
    riders: Vec<usize>,
    /// When the step of the prefill in progress starts, ms: a request sent before then
    /// may still ride in it.
    step_starts_ms: f64,
    /// Uncached prompt tokens of the prefills in that step.
    step_tokens: usize,
    /// The lane tokens of the prefill in progress (with its riders').
    prefilling_tokens: usize,
    /// When the prefill in progress started and ends, ms.
    prefill_started: f64,
    prefill_until: f64,
    /// How long its decode rows have waited for prefills sharing their steps, in all,
    /// ms ([`SimConfig::mixed_steps`]).
    stalled_ms: f64,
    /// The end of its latest step the simulation knows of (a prefill's end, a
    /// sequence's last token or its next block), ms: its decoding sequences' next
    /// steps follow from there ([`SimConfig::mixed_steps`]).
    step_anchor_ms: f64,
    /// The time its load is reported at, ms (set before each report).
    report_ms: f64,
    /// Uncached prompt tokens queued or being prefilled.
    pub queued_prefill_tokens: usize,
    /// Sequences decoding.
    pub decoding: usize,
    /// Blocks of the requests in flight (queued, prefilling or decoding).
    pub active_blocks: usize,
    /// Blocks the running sequences hold, as the engine's pool counts them.
    in_use: BlocksInUse,
    /// The engine's memory rule for its running sequences, when the simulation
    /// follows it ([`SimConfig::decode_reserve`]).
    memory: Option<EngineMemory>,
    /// Whether its running sequences hold their blocks and a prompt starts only
    /// where they fit ([`SimConfig::hold_blocks`]): its load report then gives the
    /// admission headroom, as the engine's does.
    holds_blocks: bool,
    /// Queued requests holding the leading blocks of their chain in the pool, as the
    /// engine's waiting sequences hold their cached prefix: (how many, how many of
    /// them nobody else held when taken). The second counts against the cap of half
    /// the pool, so queued fork siblings hold their shared prefix once.
    held: HashMap<usize, (usize, usize)>,
    /// Requests in flight.
    pub inflight: usize,
    /// Prompt tokens computed so far.
    pub prefill_computed: u64,
    /// Requests served.
    pub requests: u64,
    /// Blocks stored by requests whose prefill has not finished (with how many such
    /// requests stored each): cached for routing, but not yet computed, so a peer
    /// cannot pull them yet.
    unready: HashMap<BlockHash, u32>,
}

impl SimWorker {
    fn new(cache_blocks: usize, host_blocks: usize, disk_blocks: usize) -> Self {
        Self {
            lru: LruBlockCache::new(cache_blocks),
            host: LruBlockCache::new(host_blocks),
            disk: LruBlockCache::new(disk_blocks),
            queue: VecDeque::new(),
            queued_blocks: HashMap::new(),
            prefilling: None,
            riders: Vec::new(),
            step_starts_ms: 0.0,
            step_tokens: 0,
            prefilling_tokens: 0,
            prefill_started: 0.0,
            prefill_until: 0.0,
            stalled_ms: 0.0,
            step_anchor_ms: 0.0,
            report_ms: 0.0,
            queued_prefill_tokens: 0,
            decoding: 0,
            active_blocks: 0,
            in_use: BlocksInUse::default(),
            memory: None,
            holds_blocks: false,
            held: HashMap::new(),
            inflight: 0,
            prefill_computed: 0,
            requests: 0,
            unready: HashMap::new(),
        }
    }

    /// Whether its prefill lane is idle: nothing computing, nothing queued.
    pub fn lane_idle(&self) -> bool {
        self.prefilling.is_none() && self.queue.is_empty()
    }

    /// Prompt tokens still to compute at `now_ms`, as an engine reports them: the
    /// queued prefills and what is left of the one in progress (its lane time spent
    /// so far counted as computed).
    pub fn prefill_backlog_at(&self, now_ms: f64) -> usize {
        if self.prefilling.is_none() {
            return self.queued_prefill_tokens;
        }
        let span = self.prefill_until - self.prefill_started;
        let left = if span > 0.0 {
            ((self.prefill_until - now_ms) / span).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let done = (self.prefilling_tokens as f64 * (1.0 - left)) as usize;
        self.queued_prefill_tokens.saturating_sub(done)
    }

    /// The leading blocks of `chain` (up to `end`) this worker can hand to a peer now:
    /// computed and in its device pool or host tier.
    fn pullable(&self, chain: &[BlockHash], end: usize) -> usize {
        chain[..end.min(chain.len())]
            .iter()
            .take_while(|&&h| {
                (self.lru.contains(h) || self.host.contains(h)) && !self.unready.contains_key(&h)
            })
            .count()
    }

    /// The blocks of `runs` (parent, blocks) no longer in the device pool: evicted
    /// while their request waited (a real worker allocates at admission and pins them
    /// until computed; this queue does not, so it reports them computed and then gone).
    fn evicted_of(&self, runs: &[(Option<BlockHash>, Vec<BlockHash>)]) -> Vec<BlockHash> {
        runs.iter()
            .flat_map(|(_, b)| b.iter().copied())
            .filter(|&h| !self.lru.contains(h))
            .collect()
    }

    /// The leading blocks of `chain` a request queued now would find when its prefill
    /// starts, if nothing were evicted meanwhile: those in some tier of this worker or
    /// in the chain of a request queued ahead of it.
    fn expected_hits(&self, chain: &[BlockHash]) -> usize {
        chain
            .iter()
            .take_while(|&h| {
                self.lru.contains(*h)
                    || self.host.contains(*h)
                    || self.disk.contains(*h)
                    || self.queued_blocks.contains_key(h)
            })
            .count()
    }

    /// Queues request `i`. If `expected` (hits taken at admission: otherwise the chain
    /// is already stored), its chain counts for [`Self::expected_hits`], and it keeps
    /// its cached prefix until it is admitted as the engine's scheduler keeps a waiting
    /// request's (`Scheduler::enqueue`): it holds the leading blocks while the queued
    /// requests have taken at most half the pool to hold (a block another request
    /// holds or runs with costs nothing more), and the rest becomes the most recently
    /// used.
    fn enqueue(&mut self, i: usize, chain: &[BlockHash], expected: bool) {
        self.queue.push_back(i);
        if expected {
            for &h in chain {
                *self.queued_blocks.entry(h).or_default() += 1;
            }
            let cached = self.lru.match_prefix(chain);
            let mut room = (self.lru.capacity() / 2).saturating_sub(self.held_total());
            let (mut held, mut took) = (0, 0);
            for &h in &chain[..cached] {
                let free = !self.lru.pinned(h) && !self.in_use.holds(&h);
                if free && room == 0 {
                    break;
                }
                if free {
                    room -= 1;
                    took += 1;
                }
                held += 1;
            }
            if held > 0 {
                self.lru.pin_chain(&chain[..held]);
                self.held.insert(i, (held, took));
            }
            // Pinned blocks are out of the eviction order: the touch moves the rest.
            for &h in chain[..cached].iter().rev() {
                self.lru.touch(h);
            }
        }
    }

    /// Blocks the queued requests took from the free pool to hold.
    fn held_total(&self) -> usize {
        self.held.values().map(|&(_, took)| took).sum()
    }

    /// Request `i`, admitted, lets go of the blocks it held while queued (it takes them
    /// at once as its hits) and makes room for the rest of `chains[i]` as the engine's
    /// scheduler does for a sequence that finds no free block: the youngest queued
    /// requests release their holds while its new blocks would not fit beside the held
    /// ones (and, `holding`, the running sequences' blocks). Returns what a pool grown
    /// past its capacity evicted meanwhile.
    fn admit_holds(&mut self, i: usize, chains: &[Vec<BlockHash>], holding: bool) -> ChainChange {
        let mut change = ChainChange::default();
        self.release_held(i, &chains[i], &mut change);
        let chain = &chains[i][..chains[i].len().min(self.lru.capacity())];
        let new = chain.iter().filter(|&&h| !self.lru.contains(h)).count();
        let running = if holding { self.in_use.len() } else { 0 };
        while new + self.held_total() + running > self.lru.capacity() {
            let Some(&j) = self
                .queue
                .iter()
                .rev()
                .find(|&&j| j != i && self.held.contains_key(&j))
            else {
                break;
            };
            self.release_held(j, &chains[j], &mut change);
        }
        self.demote_removed(&mut change);
        change
    }

    /// Request `i` lets go of the blocks of `chain` it held while queued; what a pool
    /// grown past its capacity evicts goes into `change`.
    fn release_held(&mut self, i: usize, chain: &[BlockHash], change: &mut ChainChange) {
        if let Some((n, _)) = self.held.remove(&i) {
            change.removed.extend(self.lru.unpin_chain(&chain[..n]));
        }
    }

    /// The youngest queued request holding a prefix lets go of it (a running
    /// sequence found no free block); `None` if no queued request holds one.
    fn release_youngest_hold(&mut self, chains: &[Vec<BlockHash>]) -> Option<ChainChange> {
        let &j = self
            .queue
            .iter()
            .rev()
            .find(|j| self.held.contains_key(j))?;
        let mut change = ChainChange::default();
        self.release_held(j, &chains[j], &mut change);
        self.demote_removed(&mut change);
        Some(change)
    }

    fn dequeue(&mut self, chain: &[BlockHash]) {
        self.queue.pop_front();
        if self.queued_blocks.is_empty() {
            return;
        }
        for h in chain {
            if let Some(n) = self.queued_blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.queued_blocks.remove(h);
                }
            }
        }
    }

    fn mark_unready(&mut self, blocks: &[BlockHash]) {
        for &h in blocks {
            *self.unready.entry(h).or_default() += 1;
        }
    }

    fn mark_ready(&mut self, blocks: &[BlockHash]) {
        for h in blocks {
            if let Some(n) = self.unready.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.unready.remove(h);
                }
            }
        }
    }

    /// The leading blocks of `chain` this worker holds in some tier, each counted at
    /// its fastest: (device, host, disk).
    pub fn tiered_match(&self, chain: &[BlockHash]) -> TierHits {
        let mut hits = TierHits {
            device: self.lru.match_prefix(chain),
            ..TierHits::default()
        };
        for &h in &chain[hits.device..] {
            if self.lru.contains(h) {
                hits.device += 1;
            } else if self.host.contains(h) {
                hits.host += 1;
            } else if self.disk.contains(h) {
                hits.disk += 1;
            } else {
                break;
            }
        }
        hits
    }

    /// Serves `chain` with `hits`: touches the lower-tier copies it promotes, caches
    /// the whole chain on the device and demotes what that evicts.
    fn admit(&mut self, chain: &[BlockHash], hits: TierHits) -> ChainChange {
        for &h in &chain[hits.device..hits.total()] {
            if !self.host.touch(h) {
                self.disk.touch(h);
            }
        }
        let mut change = self.lru.insert_chain(chain);
        self.demote_removed(&mut change);
        change
    }

    /// Demotes the blocks `change` evicted from the device to the lower tiers,
    /// recording what the tiers stored and dropped (nothing without tiers).
    fn demote_removed(&mut self, change: &mut ChainChange) {
        if self.host.capacity() > 0 || self.disk.capacity() > 0 {
            for i in 0..change.removed.len() {
                let h = change.removed[i];
                self.demote(h, &mut change.lower);
            }
        }
    }

    /// A request that held `chain` (see [`SimConfig::hold_blocks`]) and `anonymous`
    /// blocks of generated tokens finished or was preempted: its blocks may be evicted
    /// again, and a pool that had grown past its capacity while every block was held
    /// evicts back down to it (demoting as `admit` does). Released tail first, as the
    /// engine releases them: `generated`, its full blocks of generated tokens, last
    /// first, stay cached behind its prompt's blocks; the rest of `anonymous` is freed.
    fn release(
        &mut self,
        chain: &[BlockHash],
        anonymous: usize,
        generated: &[BlockHash],
    ) -> ChainChange {
        let mut removed = self.lru.vacate(anonymous.saturating_sub(generated.len()));
        removed.extend(self.lru.settle(generated));
        removed.extend(self.lru.unpin_chain(chain));
        let mut change = ChainChange {
            removed,
            ..ChainChange::default()
        };
        self.demote_removed(&mut change);
        change
    }

    /// How long a prefill starting at `now` on this worker waits for the step of its
    /// decoding sequences under way to end ([`SimConfig::mixed_steps`]), ms; 0 while
    /// nothing decodes.
    ///
    /// A request already queued (`queued`) starts at the step boundary where its lane
    /// frees. One just sent misses a boundary that falls at the same instant: its
    /// message takes time to arrive, and the engine starts the next step at once. So a
    /// turn sent when its parent's last token comes waits a whole step of the
    /// sequences still decoding, where an arrival at a random time waits half of one.
    fn step_wait_ms(&self, now: f64, queued: bool, cost: &CostModel) -> f64 {
        if self.decoding == 0 {
            return 0.0;
        }
        let step = cost.decode_step_ms(self.decoding);
        let steps = ((now - self.step_anchor_ms) / step).max(0.0);
        let next = if queued {
            // A boundary within rounding of `now` is `now` itself.
            (steps - ROUNDING_MS / step).ceil()
        } else {
            steps.floor() + 1.0
        };
        (self.step_anchor_ms + next * step - now).max(0.0)
    }

    /// What the rows of this worker's decoding sequences add to the step a prefill
    /// runs in ([`SimConfig::mixed_steps`]), ms: one decode step, or 0 while nothing
    /// decodes.
    fn step_rows_ms(&self, cost: &CostModel) -> f64 {
        if self.decoding == 0 {
            0.0
        } else {
            cost.decode_step_ms(self.decoding)
        }
    }

    /// A prefill of `prefill_ms` starts at `now` in the steps of this worker's decoding
    /// sequences ([`SimConfig::mixed_steps`]): they wait that long for it, and it waits
    /// for their step under way and runs with their rows. Returns its time and the
    /// part of it spent waiting for the step under way.
    fn share_steps(
        &mut self,
        prefill_ms: f64,
        now: f64,
        queued: bool,
        cost: &CostModel,
    ) -> (f64, f64) {
        let wait = self.step_wait_ms(now, queued, cost);
        let own = prefill_ms + wait + self.step_rows_ms(cost);
        self.stall(prefill_ms);
        (own, wait)
    }

    /// Its decoding sequences wait `ms` for a prefill run in their steps: each of
    /// their later tokens comes that much later.
    fn stall(&mut self, ms: f64) {
        self.stalled_ms += ms;
        if let Some(m) = self.memory.as_mut() {
            m.stall(ms);
        }
    }

    /// A step of this worker ended at `now`: its decoding sequences' steps follow on
    /// from it ([`SimConfig::mixed_steps`]).
    fn step_ended(&mut self, now: f64) {
        self.step_anchor_ms = now;
    }

    /// Request `i` (state `r`, prompt `chain`) stops running, finished or preempted,
    /// having generated `generated` tokens: it lets go of its blocks as the engine
    /// does. Returns what the pool evicted (nothing unless blocks are held: `hold`).
    fn stop_running(
        &mut self,
        i: usize,
        r: &ReqState,
        chain: &[BlockHash],
        generated: usize,
        bs: usize,
        hold: bool,
    ) -> ChainChange {
        let (output, anonymous) = match self.memory.as_mut() {
            Some(m) => {
                let grown = m.finish(i);
                (grown, grown)
            }
            None => (r.output_blocks, 0),
        };
        self.in_use.release(chain, output);
        if !hold {
            return ChainChange::default();
        }
        let kept = generated_blocks(i, r, generated, chain.len(), anonymous, bs);
        self.release(chain, anonymous, &kept)
    }

    /// Whether the prefill of a request with `chain` (`input` tokens, `output` to
    /// generate of which it had generated `generated` before a preemption,
    /// `output_blocks` blocks beyond its chain in all) may start at `now_ms`,
    /// or nothing runs (a lone request always starts). Under the engine's rule
    /// ([`EngineMemory::admits`]) its blocks and the running sequences' expected
    /// growth fit the free blocks; otherwise the blocks running sequences hold plus
    /// its whole output fit the pool.
    fn fits(
        &self,
        chain: &[BlockHash],
        input: usize,
        output: usize,
        generated: usize,
        output_blocks: usize,
        now_ms: f64,
    ) -> bool {
        if self.in_use.is_empty() {
            return true;
        }
        let new = chain.iter().filter(|h| !self.in_use.holds(h)).count();
        match &self.memory {
            Some(m) => {
                let free = self.lru.capacity().saturating_sub(self.in_use.len());
                m.admits(input, output, generated, new, free, now_ms)
            }
            None => self.in_use.len() + new + output_blocks <= self.lru.capacity(),
        }
    }

    /// A running sequence takes one more block for its generated tokens (the engine's
    /// rule): what the pool evicted for it (beyond the capacity when every block is
    /// held: the caller preempts first where the engine would).
    fn grow_output(&mut self) -> ChainChange {
        let evicted = self.lru.occupy();
        self.in_use.take_output(1);
        let mut change = ChainChange {
            removed: evicted.into_iter().collect(),
            ..ChainChange::default()
        };
        self.demote_removed(&mut change);
        change
    }

    /// Moves `h`, just evicted from the device, to the host tier (or straight to disk
    /// without one), cascading the host's eviction to disk.
    fn demote(&mut self, h: BlockHash, ops: &mut Vec<LowerOp>) {
        let mut to_disk = Some(h);
        if self.host.capacity() > 0 {
            let (new, evicted) = self.host.insert_one(h);
            if new {
                ops.push(LowerOp {
                    medium: Medium::Host,
                    stored: true,
                    hash: h,
                });
            }
            if let Some(e) = evicted {
                ops.push(LowerOp {
                    medium: Medium::Host,
                    stored: false,
                    hash: e,
                });
            }
            to_disk = evicted;
        }
        if let Some(d) = to_disk {
            let (new, evicted) = self.disk.insert_one(d);
            if new {
                ops.push(LowerOp {
                    medium: Medium::Disk,
                    stored: true,
                    hash: d,
                });
            }
            if let Some(e) = evicted {
                ops.push(LowerOp {
                    medium: Medium::Disk,
                    stored: false,
                    hash: e,
                });
            }
        }
    }

    /// The load report a real worker would send.
    pub fn load_report(&self) -> kvfleet_routing::WorkerLoad {
        kvfleet_routing::WorkerLoad {
            running: self.decoding + usize::from(self.prefilling.is_some()) + self.riders.len(),
            waiting: self.queue.len(),
            queued_prefill_tokens: self.prefill_backlog_at(self.report_ms),
            // Blocks no running sequence holds, cached or not, as an engine counts
            // them free.
            free_blocks: self.lru.capacity().saturating_sub(self.in_use.len()),
            total_blocks: self.lru.capacity(),
            // Holding blocks, the engine's rule: the free blocks less the running
            // sequences' expected growth. Without, a prompt starts whatever the pool
            // holds, and the worker says nothing.
            admit_blocks: self.holds_blocks.then(|| {
                let reserved = self
                    .memory
                    .as_ref()
                    .map_or(0, |m| m.reserved_blocks(self.report_ms));
                self.lru
                    .capacity()
                    .saturating_sub(self.in_use.len())
                    .saturating_sub(reserved)
            }),
            ..Default::default()
        }
    }
}

/// A request's prefix hits per tier, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierHits {
    /// Blocks found on the device.
    pub device: usize,
    /// Blocks loaded from the host tier.
    pub host: usize,
    /// Blocks loaded from disk.
    pub disk: usize,
}

impl TierHits {
    /// Every hit.
    pub fn total(&self) -> usize {
        self.device + self.host + self.disk
    }
}

/// What a router sees of one request.
#[derive(Clone, Copy, Debug)]
pub struct RouteReq<'a> {
    /// Chained hashes of the request's blocks.
    pub hashes: &'a [BlockHash],
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
}

/// A routing policy under simulation.
pub trait SimRouter {
    /// Picks a worker; returns it and a token handed back to
    /// [`on_finished`](Self::on_finished).
    fn route(&mut self, req: &RouteReq<'_>, workers: &[SimWorker], now_ms: f64) -> (usize, usize);
    /// Worker `w` enqueued a request whose chain changed its cache by `change`: its
    /// evictions and lower-tier moves happen now; the blocks it stores
    /// (`change.stored`) are computed later, and reported by
    /// [`on_computed`](Self::on_computed).
    fn on_enqueued(&mut self, _w: usize, _change: &ChainChange, _workers: &[SimWorker]) {}
    /// Worker `w` finished computing a request's new blocks (runs of parent, blocks),
    /// as a real worker reports them once computed; `gone`: those of them already
    /// evicted again.
    fn on_computed(
        &mut self,
        _w: usize,
        _stored: &[(Option<BlockHash>, Vec<BlockHash>)],
        _gone: &[BlockHash],
        _workers: &[SimWorker],
    ) {
    }
    /// Worker `w`'s queues changed.
    fn on_load_changed(&mut self, _w: usize, _workers: &[SimWorker]) {}
    /// A request routed with `token` finished on `w` at `now_ms`.
    fn on_finished(&mut self, _w: usize, _token: usize, _workers: &[SimWorker], _now_ms: f64) {}
    /// The pull the last [`route`](Self::route) planned: (worker to pull from, one
    /// past the last block to pull); `None` for no pull (every baseline).
    fn take_pull(&mut self) -> Option<(usize, usize)> {
        None
    }
}

/// Simulation settings.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Workers.
    pub workers: usize,
    /// Cache blocks per worker (of the trace's block size).
    pub cache_blocks: usize,
    /// Host-tier blocks per worker (0: no host tier).
    pub host_blocks: usize,
    /// Disk-tier blocks per worker (0: no disk tier).
    pub disk_blocks: usize,
    /// How kvfleet's router scores host and disk hits (its bandwidths come from
    /// `cost`).
    pub tier_scoring: TierScoring,
    /// kvfleet's router pulls a prefix from its holder when that saves at least this
    /// many blocks (0: no pulls).
    pub peer_pull_min_blocks: usize,
    /// Policy.
    pub policy: SimPolicy,
    /// Prefill/decode cost model.
    pub cost: CostModel,
    /// kvfleet router settings (its block size is set to the trace's).
    pub router: RouterConfig,
    /// SGLang baseline settings.
    pub sglang: SglangConfig,
    /// Dynamo baseline settings.
    pub dynamo: DynamoConfig,
    /// Buckets of the hit-ratio timeline.
    pub timeline_buckets: usize,
    /// Whether a request's blocks are held, as an engine holds them: never evicted
    /// from the start of its prefill to its last token (a queued request holds
    /// none), and a worker's prefill lane starts a request only once the running
    /// sequences' blocks and its own fit the pool (default off: held blocks may be
    /// evicted, and a lane never waits for memory).
    pub hold_blocks: bool,
    /// Whether a request takes its cached prefix when its prefill starts, as an
    /// engine admits a waiting sequence, rather than when it is queued (default off).
    /// While queued it then holds its cached prefix (the queue at most half the pool)
    /// and touches the rest, as the engine's scheduler does.
    /// Queued at arrival, a request's chain is stored at once: the blocks its
    /// admission will evict are reported gone while it waits, so a router sees the
    /// evictions of the requests queued ahead before they happen. Taken at
    /// admission, a router routing behind a queue sees the pool as it is, prefixes
    /// the queue will evict included.
    pub hits_at_admission: bool,
    /// With [`hold_blocks`](Self::hold_blocks): admit and grow as the engine's
    /// scheduler does ([`engine_memory`]): a request's output takes blocks as it is
    /// generated, and a lane starts a request only while the free blocks cover it and
    /// this share of what the running requests may still generate. `None` (the
    /// default): each request's whole output is booked when its prefill starts.
    pub decode_reserve: Option<DecodeReserveConfig>,
    /// Whether a worker's prefills and decodes share its steps, as the engine's
    /// continuous batching runs them (`kvfleet sim --mixed-steps`): a prefill on a
    /// worker that decodes waits for the step under way to end (its steps follow on
    /// from the last step end the simulation knows of) and its step also runs the
    /// decode rows (one more), and every sequence decoding there waits out the
    /// prefill's own time. The queued prefills that fit the engine's step budget
    /// ([`kvfleet_core::step_budget`]) run in one step and get their first tokens
    /// when it ends. Default off: a prefill lane beside decodes that never wait for
    /// it.
    pub mixed_steps: bool,
    /// Time from a request's last token at its worker to its child's arrival, ms: the
    /// answer's way back to the client and the next request's way in (`kvfleet sim
    /// --client-rtt-ms`). Default 0: the child arrives with its parent's last token.
    /// A live replay's client on one machine takes about a millisecond, which decides
    /// whether the child finds the worker before or after the events of that instant.
    pub client_rtt_ms: f64,
    /// Whether [`SimResult::outcomes`] lists every request's outcome (`kvfleet sim
    /// --requests-out`; default off).
    pub record_requests: bool,
}

/// The pull threshold of `policy` in a comparison of policies (the sweep, the
/// matrix): `cache-aware` pulls as `kvfleet router` does, from `explicit` blocks or by
/// default from [`default_peer_pull_min_blocks`] of the trace's `block_size`; every
/// other policy never pulls, as the baselines cannot.
pub fn comparison_pull_min_blocks(
    policy: SimPolicy,
    explicit: Option<usize>,
    block_size: usize,
) -> usize {
    if policy == SimPolicy::Kvfleet(kvfleet_routing::PolicyKind::CacheAware) {
        explicit.unwrap_or_else(|| default_peer_pull_min_blocks(block_size))
    } else {
        0
    }
}

impl SimConfig {
    /// Defaults: H200 estimate cost model, default router and baseline settings.
    pub fn new(workers: usize, cache_blocks: usize, policy: SimPolicy) -> Self {
        Self {
            workers,
            cache_blocks,
            host_blocks: 0,
            disk_blocks: 0,
            tier_scoring: TierScoring::LoadTime,
            peer_pull_min_blocks: 0,
            policy,
            cost: CostModel::h200_llama8b(),
            router: RouterConfig::default(),
            sglang: SglangConfig::default(),
            dynamo: DynamoConfig::default(),
            timeline_buckets: 20,
            hold_blocks: false,
            hits_at_admission: false,
            decode_reserve: None,
            mixed_steps: false,
            client_rtt_ms: 0.0,
            record_requests: false,
        }
    }
}

/// Latency percentiles in ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

impl Percentiles {
    /// Percentiles of `v` (sorted in place).
    pub fn of(v: &mut [f64]) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
        Self {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// One simulation's results.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    /// Policy name.
    pub policy: String,
    /// Workers.
    pub workers: usize,
    /// Cache blocks per worker.
    pub cache_blocks: usize,
    /// Host-tier blocks per worker.
    pub host_blocks: usize,
    /// Disk-tier blocks per worker.
    pub disk_blocks: usize,
    /// How kvfleet's router scored tier hits (`load-time`, `discount`, `device-only`).
    pub tier_scoring: TierScoring,
    /// Cost model name.
    pub cost_model: String,
    /// Requests in the trace.
    pub requests: usize,
    /// Of those, requests refused because their prompt needs more KV blocks than a
    /// worker's pool (`(prompt tokens + 1) ÷ block size`, rounded up), as the engine
    /// refuses them. They count in no other figure; their children still run.
    pub rejected: usize,
    /// Under the engine's memory rule ([`SimConfig::decode_reserve`]): times a running
    /// request's growth found every block held, where the engine would preempt (0
    /// otherwise).
    pub preemptions: usize,
    /// Prompt blocks (hash ids) over all requests.
    pub total_blocks: u64,
    /// Leading blocks found cached, in any tier.
    pub hit_blocks: u64,
    /// Of those, blocks loaded from a host tier.
    pub host_hit_blocks: u64,
    /// Of those, blocks loaded from a disk tier.
    pub disk_hit_blocks: u64,
    /// Of those, blocks pulled from another worker.
    pub peer_hit_blocks: u64,
    /// Pulls that moved at least one block.
    pub peer_pulls: u64,
    /// Time spent copying tier hits and pulled blocks into the device, summed over
    /// requests, ms.
    pub tier_load_ms: f64,
    /// `hit_blocks / total_blocks`.
    pub hit_ratio: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from cache (at least one token of each prompt is computed).
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub cached_token_ratio: f64,
    /// Prompt tokens computed (prefill work).
    pub prefill_tokens: u64,
    /// Input cost with cached tokens at 10% of the price, relative to no caching.
    pub input_cost_relative: f64,
    /// Prefill tokens computed per worker.
    pub worker_prefill_tokens: Vec<u64>,
    /// Requests per worker.
    pub worker_requests: Vec<u64>,
    /// max / mean of the per-worker prefill work.
    pub work_max_over_mean: f64,
    /// Time to first token.
    pub ttft_ms: Percentiles,
    /// Inter-token latency: each request's time from its first token to its last over
    /// the tokens between, as `kvfleet bench replay` measures it (with
    /// [`SimConfig::mixed_steps`], the prefills that stalled its steps included).
    pub itl_ms: Percentiles,
    /// Simulated time from the first arrival to the last completion, s.
    pub makespan_s: f64,
    /// Requests per simulated second.
    pub throughput_rps: f64,
    /// Hit ratio per arrival-time bucket: (bucket end in s, ratio).
    pub hit_timeline: Vec<(f64, f64)>,
    /// Requests that waited although a worker was idle when they arrived, and waited
    /// so long that computing their whole prompt on that idle worker would have
    /// reached the first token sooner ("a worker idle while another queues"). The
    /// time a request waited for blocks of its own prompt that a request ahead of it
    /// was computing (a fork sibling computing the shared prefix) is not counted as
    /// waiting: that is the prefix's cold start, not queueing behind others' work.
    /// Nor is a request its worker started at once: with
    /// [`mixed_steps`](SimConfig::mixed_steps) its prefill shares steps with that
    /// worker's decodes and may end later than on an idle lane with fewer of them,
    /// but it did not queue.
    pub avoidable_waits: usize,
    /// Requests that would have counted as avoidable waits but for that time: they
    /// waited on their own prefix being computed, and finished no sooner on an idle
    /// worker than that prefix's cold start plus their own tail.
    pub own_prefix_waits: usize,
    /// `avoidable_waits` over all requests.
    pub avoidable_wait_ratio: f64,
    /// Requests of a session (`session_id`) served by another worker than the
    /// session's previous request: each one leaves the session's cached prefix behind
    /// and stores a second copy elsewhere.
    pub session_moves: usize,
    /// Distinct sessions each worker served. Under memory pressure a worker's pool
    /// holds its sessions' prefixes, so the busiest one's count, not the mean, sets how
    /// much of them it keeps.
    pub worker_sessions: Vec<usize>,
    /// max / mean of `worker_sessions` (1 without sessions).
    pub sessions_max_over_mean: f64,
    /// Wall time of the simulation, s.
    pub wall_s: f64,
    /// Every TTFT in ms, sorted (for CDF plots; not serialized).
    #[serde(skip)]
    pub ttft_samples: Vec<f64>,
    /// Every request's outcome, in trace order, with [`SimConfig::record_requests`]
    /// (else empty; not serialized: `kvfleet sim --requests-out` writes them apart).
    #[serde(skip)]
    pub outcomes: Vec<SimOutcome>,
}

/// One request's outcome in a simulation, as `kvfleet bench replay` records a live
/// one's, to compare the two request by request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SimOutcome {
    /// Its position in the trace.
    pub index: usize,
    /// The worker that computed its first token.
    pub worker: usize,
    /// When it was sent, ms after the trace's first request.
    pub sent_ms: f64,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens it found cached.
    pub cached_tokens: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive(usize),
    PrefillDone(usize),
    /// Request `.0`'s last token, in its attempt `.1` (a preemption ends an attempt).
    DecodeDone(usize, u32),
    /// Request `.0`'s generated tokens need one more block (the engine's memory rule),
    /// in its attempt `.1`.
    Grow(usize, u32),
    /// A load poll of worker `.0` while it prefills request `.1`.
    Poll(usize, usize),
}

#[derive(Clone, Debug, Default)]
struct ReqState {
    worker: usize,
    token: usize,
    sent_ms: f64,
    /// Prompt tokens.
    input_tokens: usize,
    /// The leading blocks of its chain its worker held or had queued when it arrived
    /// (the hits it expects; the real ones are taken when its prefill starts).
    expected_hits: usize,
    /// The pull its router planned: (source worker, one past the last block).
    pull: Option<(usize, usize)>,
    /// Uncached prompt tokens: expected from `expected_hits` while it is queued, real
    /// once its prefill starts.
    uncached: usize,
    /// Time to load its host and disk hits, ms (part of its prefill).
    load_ms: f64,
    /// Backlog it adds to the worker: uncached tokens plus the load time in
    /// prefill-token equivalents (expected while queued, as `uncached`).
    lane_tokens: usize,
    /// A worker's prefill lane was idle when this request arrived: what its decoding
    /// sequences' rows would have added to this request's prefill there, ms (the
    /// least of the idle lanes'; 0 without [`SimConfig::mixed_steps`]).
    idle_elsewhere: Option<f64>,
    /// Time its prefill spent waiting for its worker's step under way to end, ms
    /// ([`SimConfig::mixed_steps`]). Left out of the avoidable-wait test, as the same
    /// wait on the idle lane is: no router sees where a worker is in its step.
    step_wait_ms: f64,
    /// Time from its arrival to the start of its first prefill, ms: 0 for a request
    /// its worker started at once. Only a request that queued can have waited
    /// avoidably; one started at once on an idle lane whose decode rows make its
    /// steps longer than another idle lane's did not wait.
    queued_ms: f64,
    /// Time its lane spent, after it arrived, computing blocks of its prompt for
    /// requests ahead of it, ms.
    own_prefix_ms: f64,
    /// The runs of blocks this request stored (parent, blocks) when its prefill
    /// started, computed when it ends.
    computing: Vec<(Option<BlockHash>, Vec<BlockHash>)>,
    /// Blocks it holds beyond its prompt's full blocks while it runs (its partial
    /// last block and its output).
    output_blocks: usize,
    /// Tokens it generates.
    output_tokens: usize,
    /// Its attempt: how many times it was preempted.
    epoch: u32,
    /// Tokens it had generated when it was last preempted.
    generated: usize,
    /// Queued again after a preemption: its hits were counted at its first admission,
    /// its first token already came.
    recompute: bool,
    /// It has taken its hits and stored its chain (see [`SimConfig::hits_at_admission`]).
    admitted: bool,
    /// Its worker's `stalled_ms` when its last token's time was last worked out: the
    /// stall since delays its end ([`SimConfig::mixed_steps`]).
    stall_seen_ms: f64,
    /// When its first token came, ms: its inter-token latency runs from there to its
    /// last token, stalls and preemptions included, as a client measures it.
    first_token_ms: f64,
    done: bool,
}

/// Builds the router of `cfg.policy`.
pub fn make_router(cfg: &SimConfig, block_size: usize) -> anyhow::Result<Box<dyn SimRouter>> {
    Ok(match cfg.policy {
        SimPolicy::Kvfleet(kind) => Box::new(kvfleet_policy::KvfleetPolicy::new(
            RouterConfig {
                block_size,
                cache_aware: kvfleet_routing::policy::CacheAwareConfig {
                    tiers: cost_model::tier_pricing(
                        &cfg.cost,
                        cfg.tier_scoring,
                        cfg.peer_pull_min_blocks,
                    ),
                    ..cfg.router.cache_aware.clone()
                },
                ..cfg.router.clone()
            },
            kind,
            cfg.workers,
        )?),
        SimPolicy::SglangCacheAware => Box::new(SglangCacheAware::new(
            cfg.sglang.clone(),
            cfg.workers,
            overhead_tokens(&cfg.cost),
        )),
        SimPolicy::DynamoKvCost => Box::new(DynamoKvCost::new(cfg.dynamo.clone())),
        SimPolicy::SglangSpill => Box::new(SglangCacheAware::new(
            SglangConfig {
                spill: true,
                ..cfg.sglang.clone()
            },
            cfg.workers,
            overhead_tokens(&cfg.cost),
        )),
        SimPolicy::DynamoLmetric => Box::new(DynamoKvCost::new(DynamoConfig {
            metric: DynamoMetric::Lmetric,
            ..cfg.dynamo.clone()
        })),
    })
}

/// The fixed overhead of one prefill under `cost`, in prompt tokens at its prefill
/// rate, as `cache-aware` prices it.
fn overhead_tokens(cost: &CostModel) -> f64 {
    cost_model::tier_pricing(cost, Default::default(), 0).prefill_overhead_tokens()
}

/// Runs one simulation of `trace`.
pub fn simulate(trace: &Trace, cfg: &SimConfig) -> anyhow::Result<SimResult> {
    anyhow::ensure!(cfg.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(cfg.cache_blocks > 0, "--cache-blocks must be at least 1");
    anyhow::ensure!(
        cfg.client_rtt_ms >= 0.0 && cfg.client_rtt_ms.is_finite(),
        "--client-rtt-ms must be a finite number of milliseconds, at least 0"
    );
    cfg.cost.validate()?;
    let wall = std::time::Instant::now();
    let bs = trace.block_size();
    let chains = chains(trace);
    let recs = &trace.records;
    anyhow::ensure!(
        cfg.decode_reserve.is_none() || cfg.hold_blocks,
        "the engine's memory rule (--decode-reserve-ratio) needs --hold-blocks"
    );
    let mut workers: Vec<SimWorker> = (0..cfg.workers)
        .map(|_| {
            let mut w = SimWorker::new(cfg.cache_blocks, cfg.host_blocks, cfg.disk_blocks);
            w.memory = cfg.decode_reserve.map(|c| EngineMemory::new(c, bs));
            w.holds_blocks = cfg.hold_blocks;
            w
        })
        .collect();
    let parent = trace.parent_indices();
    let mut parked: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut st = vec![ReqState::default(); recs.len()];

    let mut adm = Admitter {
        router: make_router(cfg, bs)?,
        events: Events::default(),
        tally: Tally::default(),
        chains: &chains,
        cfg,
        block_size: bs,
    };
    for (i, r) in recs.iter().enumerate() {
        adm.events.push(r.timestamp as f64, Ev::Arrive(i));
    }

    let t0 = recs.first().map_or(0.0, |r| r.timestamp as f64);
    let mut ttft = Vec::with_capacity(recs.len());
    let mut outcomes = Vec::new();
    let mut itl = Vec::with_capacity(recs.len());
    let mut now = t0;
    // Requests served or refused.
    let mut finished = 0usize;
    let mut rejected = 0usize;
    // Workers whose prefill lane is busy, kept up to date on every start and finish.
    let mut prefilling = 0usize;
    let mut avoidable_waits = 0usize;
    let mut preemptions = 0usize;
    let mut own_prefix_waits = 0usize;
    let pulls = cfg.peer_pull_min_blocks > 0;
    let hold = cfg.hold_blocks;
    let mut sessions = SessionPlacement::<usize>::default();

    while let Some((t, ev)) = adm.events.pop() {
        now = t;
        match ev {
            Ev::Arrive(i) => {
                if let Some(p) = parent[i] {
                    if !st[p].done {
                        parked.entry(p).or_default().push(i);
                        continue;
                    }
                }
                let r = &recs[i];
                // The engine refuses a prompt its whole pool cannot hold ("the prompt
                // needs N KV blocks"); the live replay counts it failed and still
                // sends its children.
                if kvfleet_core::blocks_to_start(r.input_length, bs) > cfg.cache_blocks {
                    rejected += 1;
                    st[i].done = true;
                    finished += 1;
                    for k in parked.remove(&i).unwrap_or_default() {
                        adm.events.push(now + cfg.client_rtt_ms, Ev::Arrive(k));
                    }
                    continue;
                }
                let chain = &chains[i];
                let req = RouteReq {
                    hashes: chain,
                    input_tokens: r.input_length,
                    block_size: bs,
                };
                let output_blocks =
                    kvfleet_core::blocks_needed(r.input_length + r.output_length, bs)
                        .saturating_sub(chain.len());
                // A lane waiting for memory is not idle: its queue is not empty. Nor is
                // one whose pool its running sequences hold: it could not start this
                // request either.
                let share = |x: &SimWorker| {
                    if cfg.mixed_steps {
                        x.step_rows_ms(&cfg.cost)
                    } else {
                        0.0
                    }
                };
                let idle_elsewhere = if hold {
                    workers
                        .iter()
                        .filter(|x| {
                            x.lane_idle()
                                && x.fits(
                                    chain,
                                    r.input_length,
                                    r.output_length,
                                    0,
                                    output_blocks,
                                    now,
                                )
                        })
                        .map(share)
                        .min_by(f64::total_cmp)
                } else if cfg.mixed_steps {
                    workers
                        .iter()
                        .filter(|x| x.prefilling.is_none())
                        .map(share)
                        .min_by(f64::total_cmp)
                } else {
                    (prefilling < workers.len()).then_some(0.0)
                };
                let (w, token) = adm.router.route(&req, &workers, now);
                anyhow::ensure!(w < workers.len(), "router chose a worker out of range");
                if let Some(s) = r.session_id {
                    sessions.served(s, w);
                }
                let pull = adm.router.take_pull();
                // Taken at admission, its hits are expected from the pool and the
                // chains queued ahead; until then it adds the prefill they leave to
                // the worker's backlog. Otherwise they are taken below, now.
                let arrival_hits = (!cfg.hits_at_admission).then(|| workers[w].tiered_match(chain));
                let expected_hits =
                    arrival_hits.map_or_else(|| workers[w].expected_hits(chain), |h| h.total());
                let own_prefix_ms = own_prefix_ahead(
                    &workers[w],
                    &st,
                    &chains,
                    &chain[..expected_hits],
                    now,
                    &cfg.cost,
                );
                // A planned pull is expected to bring what its source has computed now.
                let expected_pulled = match (arrival_hits, pull) {
                    (None, Some((src, end))) => {
                        workers.get(src).map_or(0, |s| s.pullable(chain, end))
                    }
                    _ => 0,
                };
                let wk = &mut workers[w];
                let uncached =
                    uncached_tokens(r.input_length, expected_hits.max(expected_pulled), bs);
                wk.enqueue(i, chain, cfg.hits_at_admission);
                wk.queued_prefill_tokens += uncached;
                wk.inflight += 1;
                wk.active_blocks += chain.len();
                wk.requests += 1;
                st[i] = ReqState {
                    worker: w,
                    token,
                    sent_ms: now,
                    input_tokens: r.input_length,
                    expected_hits,
                    pull,
                    uncached,
                    load_ms: 0.0,
                    lane_tokens: uncached,
                    idle_elsewhere,
                    step_wait_ms: 0.0,
                    queued_ms: 0.0,
                    own_prefix_ms,
                    computing: Vec::new(),
                    output_blocks,
                    output_tokens: r.output_length,
                    epoch: 0,
                    generated: 0,
                    recompute: false,
                    admitted: false,
                    stall_seen_ms: 0.0,
                    first_token_ms: 0.0,
                    done: false,
                };
                workers[w].report_ms = now;
                if let Some(hits) = arrival_hits {
                    adm.take_hits(&mut workers, w, &mut st, i, hits);
                }
                if adm.begin(&mut workers, w, &mut st, now) {
                    prefilling += 1;
                } else if adm.ride(&mut workers, w, &mut st, now) {
                    // Sent before the step under way begins, it runs in it, which now
                    // ends later (the event at its old end is skipped).
                    adm.events
                        .push(workers[w].prefill_until, Ev::PrefillDone(w));
                }
                adm.router.on_load_changed(w, &workers);
            }
            Ev::PrefillDone(w) => {
                let wk = &mut workers[w];
                // A request that rode in the step since moved its end on.
                if wk.prefill_until > now + ROUNDING_MS {
                    continue;
                }
                let Some(head) = wk.prefilling.take() else {
                    continue;
                };
                prefilling -= 1;
                wk.step_tokens = 0;
                // Taken out for the loop and put back empty, keeping its allocation.
                let mut riders = std::mem::take(&mut wk.riders);
                // A request whose prefill brought its last token ends at this instant:
                // sharing steps, the next prefill starts once it has (its
                // `DecodeDone` starts it), not with a decode row of it.
                let mut ending_now = false;
                for &i in std::iter::once(&head).chain(&riders) {
                    let wk = &mut workers[w];
                    wk.queued_prefill_tokens -= st[i].lane_tokens;
                    let computed = std::mem::take(&mut st[i].computing);
                    if pulls {
                        for (_, run) in &computed {
                            wk.mark_ready(run);
                        }
                    }
                    let gone = wk.evicted_of(&computed);
                    let took = now - st[i].sent_ms;
                    // A margin for the rounding of event times (`now - sent_ms` of a
                    // request that never queued can exceed its prefill by an ulp).
                    let cold = cfg.cost.prefill_ms(recs[i].input_length) + ROUNDING_MS;
                    let first = !st[i].recompute;
                    let idle = st[i].idle_elsewhere.map(|share| cold + share);
                    let waited = took - st[i].step_wait_ms;
                    let queued = st[i].queued_ms > ROUNDING_MS;
                    if let Some(cold) = idle.filter(|&cold| first && queued && waited > cold) {
                        if waited - st[i].own_prefix_ms > cold {
                            avoidable_waits += 1;
                        } else {
                            own_prefix_waits += 1;
                        }
                    }
                    if first {
                        st[i].first_token_ms = now;
                        ttft.push(took);
                        if cfg.record_requests {
                            outcomes.push(SimOutcome {
                                index: i,
                                worker: w,
                                sent_ms: st[i].sent_ms - t0,
                                ttft_ms: took,
                                prompt_tokens: st[i].input_tokens,
                                cached_tokens: st[i].input_tokens - st[i].uncached,
                            });
                        }
                    }
                    wk.step_ended(now);
                    wk.decoding += 1;
                    let step = cfg.cost.decode_step_ms(wk.decoding);
                    // This prefill's end brings token `generated + 1`.
                    let generated = st[i].generated;
                    let steps = recs[i].output_length.saturating_sub(1 + generated);
                    ending_now |= steps == 0;
                    let epoch = st[i].epoch;
                    st[i].recompute = false;
                    st[i].stall_seen_ms = wk.stalled_ms;
                    adm.events
                        .push(now + step * steps as f64, Ev::DecodeDone(i, epoch));
                    let grow = wk.memory.as_mut();
                    if let Some(t) = grow.and_then(|m| m.decode_started(i, generated, now, step)) {
                        adm.events.push(t, Ev::Grow(i, epoch));
                    }
                    wk.report_ms = now;
                    // Its blocks are reported before the next request's admission
                    // evicts any of them.
                    if !computed.is_empty() {
                        adm.router.on_computed(w, &computed, &gone, &workers);
                    }
                }
                riders.clear();
                workers[w].riders = riders;
                if !(cfg.mixed_steps && ending_now) && adm.begin(&mut workers, w, &mut st, now) {
                    prefilling += 1;
                }
                adm.router.on_load_changed(w, &workers);
            }
            Ev::DecodeDone(i, epoch) => {
                if epoch != st[i].epoch {
                    continue;
                }
                let w = st[i].worker;
                let wk = &mut workers[w];
                // Prefills that shared its steps since its end was set delay it.
                let stall = wk.stalled_ms - st[i].stall_seen_ms;
                if stall > 0.0 {
                    st[i].stall_seen_ms = wk.stalled_ms;
                    adm.events.push(now + stall, Ev::DecodeDone(i, epoch));
                    continue;
                }
                let tokens = recs[i].output_length;
                if tokens > 1 {
                    itl.push((now - st[i].first_token_ms) / (tokens - 1) as f64);
                }
                wk.report_ms = now;
                wk.step_ended(now);
                wk.decoding -= 1;
                wk.inflight -= 1;
                wk.active_blocks -= chains[i].len();
                let change =
                    wk.stop_running(i, &st[i], &chains[i], recs[i].output_length, bs, hold);
                if hold {
                    adm.router.on_enqueued(w, &change, &workers);
                }
                // A lane waiting for memory may start now, or one left for this
                // request to end first (sharing steps).
                if (hold || cfg.mixed_steps) && adm.begin(&mut workers, w, &mut st, now) {
                    prefilling += 1;
                }
                st[i].done = true;
                finished += 1;
                adm.router.on_finished(w, st[i].token, &workers, now);
                if let Some(kids) = parked.remove(&i) {
                    for k in kids {
                        adm.events.push(now + cfg.client_rtt_ms, Ev::Arrive(k));
                    }
                }
            }
            Ev::Grow(i, epoch) => {
                if st[i].done || epoch != st[i].epoch {
                    continue;
                }
                let w = st[i].worker;
                let step = cfg.cost.decode_step_ms(workers[w].decoding.max(1));
                let Some(m) = workers[w].memory.as_mut() else {
                    continue;
                };
                // Prefills that shared its steps moved its next block boundary on.
                let later = m.next_growth_ms(i).filter(|&t| cfg.mixed_steps && t > now);
                if let Some(t) = later {
                    adm.events.push(t, Ev::Grow(i, epoch));
                    continue;
                }
                m.relax_to(now, step);
                workers[w].step_ended(now);
                // No block free: a waiting request's held prefix yields first, then the
                // newest decoding request is preempted, as the engine's scheduler does.
                let mut preempted_self = false;
                while !workers[w].lru.has_room() {
                    if let Some(change) = workers[w].release_youngest_hold(&chains) {
                        adm.router.on_enqueued(w, &change, &workers);
                        continue;
                    }
                    let victim = workers[w].memory.as_ref().and_then(|m| m.victim());
                    let Some(v) = victim.filter(|&v| v != i || workers[w].decoding > 1) else {
                        // Alone it outgrew the pool: it takes the block beyond it.
                        break;
                    };
                    let change = preempt(
                        &mut workers[w],
                        &mut st,
                        &chains,
                        v,
                        now,
                        cfg.hits_at_admission,
                        bs,
                    );
                    preemptions += 1;
                    adm.router.on_enqueued(w, &change, &workers);
                    if v == i {
                        preempted_self = true;
                        break;
                    }
                }
                if !preempted_self {
                    let wk = &mut workers[w];
                    let next = wk.memory.as_mut().and_then(|m| m.grew(i));
                    let change = wk.grow_output();
                    if let Some(t) = next {
                        adm.events.push(t, Ev::Grow(i, epoch));
                    }
                    if !change.removed.is_empty() {
                        adm.router.on_enqueued(w, &change, &workers);
                    }
                }
                workers[w].report_ms = now;
                adm.router.on_load_changed(w, &workers);
            }
            Ev::Poll(w, i) => {
                let wk = &mut workers[w];
                if wk.prefilling != Some(i) {
                    continue;
                }
                wk.report_ms = now;
                if wk.prefill_until > now + LOAD_POLL_MS {
                    adm.events.push(now + LOAD_POLL_MS, Ev::Poll(w, i));
                }
                adm.router.on_load_changed(w, &workers);
            }
        }
    }
    anyhow::ensure!(
        finished == recs.len(),
        "{} requests never ran (a parent_id cycle?)",
        recs.len() - finished
    );

    let makespan_s = (now - t0) / 1000.0;
    let worker_prefill_tokens: Vec<u64> = workers.iter().map(|w| w.prefill_computed).collect();
    let prefill_tokens: u64 = worker_prefill_tokens.iter().sum();
    let mean_work = prefill_tokens as f64 / cfg.workers as f64;
    let max_work = worker_prefill_tokens.iter().copied().max().unwrap_or(0) as f64;
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let Tally {
        hit_blocks,
        total_blocks,
        cached_tokens,
        prompt_tokens,
        host_hit_blocks,
        disk_hit_blocks,
        tier_load_ms,
        peer_hit_blocks,
        peer_pulls,
        arrivals,
    } = adm.tally;
    let hit_timeline = timeline(&arrivals, t0, cfg.timeline_buckets);
    let per_worker = sessions.per_worker();
    let worker_sessions: Vec<usize> = (0..cfg.workers)
        .map(|w| per_worker.get(&w).copied().unwrap_or(0))
        .collect();
    let sessions_max_over_mean = max_over_mean(&worker_sessions);
    let ttft_p = Percentiles::of(&mut ttft);
    Ok(SimResult {
        policy: cfg.policy.as_str().to_string(),
        workers: cfg.workers,
        cache_blocks: cfg.cache_blocks,
        host_blocks: cfg.host_blocks,
        disk_blocks: cfg.disk_blocks,
        tier_scoring: cfg.tier_scoring,
        cost_model: cfg.cost.name.clone(),
        requests: recs.len(),
        rejected,
        preemptions,
        total_blocks,
        hit_blocks,
        host_hit_blocks,
        disk_hit_blocks,
        peer_hit_blocks,
        peer_pulls,
        tier_load_ms,
        hit_ratio: ratio(hit_blocks, total_blocks),
        prompt_tokens,
        cached_tokens,
        cached_token_ratio: ratio(cached_tokens, prompt_tokens),
        prefill_tokens,
        input_cost_relative: if prompt_tokens == 0 {
            1.0
        } else {
            (prefill_tokens as f64 + 0.1 * cached_tokens as f64) / prompt_tokens as f64
        },
        worker_requests: workers.iter().map(|w| w.requests).collect(),
        worker_prefill_tokens,
        work_max_over_mean: if mean_work > 0.0 {
            max_work / mean_work
        } else {
            1.0
        },
        ttft_ms: ttft_p,
        itl_ms: Percentiles::of(&mut itl),
        makespan_s,
        throughput_rps: if makespan_s > 0.0 {
            recs.len() as f64 / makespan_s
        } else {
            0.0
        },
        hit_timeline,
        avoidable_waits,
        avoidable_wait_ratio: ratio(avoidable_waits as u64, recs.len() as u64),
        own_prefix_waits,
        session_moves: sessions.moves(),
        worker_sessions,
        sessions_max_over_mean,
        wall_s: wall.elapsed().as_secs_f64(),
        ttft_samples: ttft,
        outcomes: {
            outcomes.sort_by_key(|o| o.index);
            outcomes
        },
    })
}

/// Prompt tokens a request copies in, by source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct MovedTokens {
    host: usize,
    disk: usize,
    peer: usize,
}

/// The tokens a request reads from its worker's host and disk tiers and from a peer,
/// of its `cached` tokens (`hits` blocks on its worker, then `peer` pulled blocks):
/// the chain's order is device, lower tiers, pulled, and a prompt that ends inside
/// its last hit block copies only the tokens of it the prompt uses. Host blocks are
/// counted before disk ones (they interleave in the chain; only the split of a
/// partial last block between the two can be off).
fn moved_tokens(hits: TierHits, peer: usize, bs: usize, cached: usize) -> MovedTokens {
    let device = (hits.device * bs).min(cached);
    let lower = ((hits.host + hits.disk) * bs).min(cached - device);
    let host = (hits.host * bs).min(lower);
    MovedTokens {
        host,
        disk: lower - host,
        peer: (peer * bs).min(cached - device - lower),
    }
}

/// How often a worker's load is polled while it prefills, ms, as supervisors poll a
/// live worker: the report between events counts only what is left of the prefill
/// in progress, as an engine's does.
const LOAD_POLL_MS: f64 = 100.0;

/// The simulation's pending events, earliest first; events at the same time in the
/// order they were pushed.
#[derive(Default)]
struct Events {
    heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    pushed: u64,
}

impl Events {
    fn push(&mut self, t: f64, ev: Ev) {
        self.pushed += 1;
        self.heap
            .push(Reverse((t.max(0.0).to_bits(), self.pushed, ev)));
    }

    fn pop(&mut self) -> Option<(f64, Ev)> {
        self.heap
            .pop()
            .map(|Reverse((t, _, ev))| (f64::from_bits(t), ev))
    }
}

/// What the simulation counts over the requests it admits.
#[derive(Default)]
struct Tally {
    hit_blocks: u64,
    total_blocks: u64,
    cached_tokens: u64,
    prompt_tokens: u64,
    host_hit_blocks: u64,
    disk_hit_blocks: u64,
    tier_load_ms: f64,
    peer_hit_blocks: u64,
    peer_pulls: u64,
    /// (time sent, hit blocks, blocks) of each admitted request, for the timeline.
    arrivals: Vec<(f64, usize, usize)>,
}

/// Admits queued requests to their worker's prefill lane, as an engine admits a
/// waiting sequence: the request takes its cached prefix (and what it pulls) *now*,
/// stores the rest of its chain, and its prefill starts. What it found evicted while
/// it waited it computes again.
struct Admitter<'a> {
    router: Box<dyn SimRouter>,
    events: Events,
    tally: Tally,
    chains: &'a [Vec<BlockHash>],
    cfg: &'a SimConfig,
    block_size: usize,
}

impl Admitter<'_> {
    /// Starts worker `w`'s next queued prefill at `now`, if its lane is free (and,
    /// holding blocks, they fit), taking the request's hits first unless it took them
    /// when it arrived; schedules its end and, while it runs, its load polls. Returns
    /// whether one started.
    fn begin(
        &mut self,
        workers: &mut [SimWorker],
        w: usize,
        st: &mut [ReqState],
        now: f64,
    ) -> bool {
        let wk = &workers[w];
        let Some(&i) = wk.queue.front() else {
            return false;
        };
        let hold = self.cfg.hold_blocks;
        if wk.prefilling.is_some() {
            return false;
        }
        let step = self.cfg.cost.decode_step_ms(wk.decoding.max(1));
        if let Some(m) = workers[w].memory.as_mut() {
            m.relax_to(now, step);
        }
        if !self.take_the_lane(workers, w, st, i, now) {
            return false;
        }
        let Some((mut t, evicted)) =
            start_prefill(&mut workers[w], st, self.chains, &self.cfg.cost, now, hold)
        else {
            return false;
        };
        if self.cfg.mixed_steps {
            let wk = &mut workers[w];
            let wait = if wk.decoding > 0 {
                // Queued earlier, or again after a preemption: it is in the engine's
                // queue.
                let queued = st[i].sent_ms < now || st[i].recompute;
                let (own, wait) = wk.share_steps(t, now, queued, &self.cfg.cost);
                t = own;
                wk.prefill_until = now + t;
                wait
            } else {
                0.0
            };
            st[i].step_wait_ms = wait;
            wk.step_starts_ms = now + wait;
            wk.step_tokens = st[i].uncached;
        }
        if !evicted.removed.is_empty() {
            self.router.on_enqueued(w, &evicted, workers);
        }
        // The requests queued behind it that fit its step run in it.
        while self.ride(workers, w, st, now) {}
        self.events
            .push(workers[w].prefill_until, Ev::PrefillDone(w));
        if t > LOAD_POLL_MS {
            self.events.push(now + LOAD_POLL_MS, Ev::Poll(w, i));
        }
        true
    }

    /// Lets worker `w`'s next queued request run in the step of the prefill in
    /// progress ([`SimConfig::mixed_steps`]), as the engine admits at a step boundary
    /// every waiting request that fits: one sent before that step starts, whose
    /// uncached prompt fits one sequence's chunk and the step's token budget left by
    /// the decode rows, and (holding blocks) whose blocks fit. Its prefill lengthens the
    /// step, and its first token comes when the step ends. Returns whether it rode; the
    /// caller schedules the step's new end.
    fn ride(&mut self, workers: &mut [SimWorker], w: usize, st: &mut [ReqState], now: f64) -> bool {
        let wk = &workers[w];
        if !self.cfg.mixed_steps || wk.prefilling.is_none() {
            return false;
        }
        let Some(&i) = wk.queue.front() else {
            return false;
        };
        let r = &st[i];
        let budget = kvfleet_core::DEFAULT_MAX_BATCHED_TOKENS.saturating_sub(wk.decoding);
        if r.sent_ms >= wk.step_starts_ms
            || r.uncached > kvfleet_core::DEFAULT_MAX_PREFILL_CHUNK
            || wk.step_tokens + r.uncached > budget
        {
            return false;
        }
        if !self.take_the_lane(workers, w, st, i, now) {
            return false;
        }
        let hold = self.cfg.hold_blocks;
        let evicted = admit_to_lane(&mut workers[w], st, self.chains, i, hold);
        let t = prefill_time(&st[i], &self.cfg.cost);
        let wk = &mut workers[w];
        wk.riders.push(i);
        wk.step_tokens += st[i].uncached;
        wk.prefilling_tokens += st[i].lane_tokens;
        wk.prefill_until += t;
        if wk.decoding > 0 {
            // The decoding sequences wait for it too.
            wk.stall(t);
        }
        st[i].step_wait_ms = (wk.step_starts_ms - now).max(0.0);
        if !evicted.removed.is_empty() {
            self.router.on_enqueued(w, &evicted, workers);
        }
        true
    }

    /// Whether request `i`, at the head of worker `w`'s queue, may start its prefill
    /// now: holding blocks, only if they fit. If it may, it takes its hits first
    /// unless it took them when it arrived.
    fn take_the_lane(
        &mut self,
        workers: &mut [SimWorker],
        w: usize,
        st: &mut [ReqState],
        i: usize,
        now: f64,
    ) -> bool {
        let hold = self.cfg.hold_blocks;
        let r = &st[i];
        if hold
            && !workers[w].fits(
                &self.chains[i],
                r.input_tokens,
                r.output_tokens,
                r.generated,
                r.output_blocks,
                now,
            )
        {
            return false;
        }
        if !st[i].recompute {
            st[i].queued_ms = now - st[i].sent_ms;
        }
        if !st[i].admitted {
            let released = workers[w].admit_holds(i, self.chains, hold);
            if !released.removed.is_empty() {
                self.router.on_enqueued(w, &released, workers);
            }
            let hits = workers[w].tiered_match(&self.chains[i]);
            self.take_hits(workers, w, st, i, hits);
        }
        true
    }

    /// Request `i`, queued on `w`, takes its cached prefix (`tier_hits`, `w`'s
    /// [`SimWorker::tiered_match`] of its chain now) and what it pulls, and stores the
    /// rest of its chain there (to be computed by its prefill); its evictions are
    /// reported to the router now.
    fn take_hits(
        &mut self,
        workers: &mut [SimWorker],
        w: usize,
        st: &mut [ReqState],
        i: usize,
        tier_hits: TierHits,
    ) {
        let (cfg, bs) = (self.cfg, self.block_size);
        let chain = &self.chains[i];
        // What a pull really brings: the source's computed device and host blocks now,
        // past those this worker has.
        let peer = st[i].pull.map_or(0, |(src, end)| {
            workers
                .get(src)
                .map_or(0, |s| s.pullable(chain, end))
                .saturating_sub(tier_hits.total())
        });
        let wk = &mut workers[w];
        let change = wk.admit(chain, tier_hits);
        // Only a pull asks what is computed yet.
        if cfg.peer_pull_min_blocks > 0 {
            for (_, run) in &change.stored {
                wk.mark_unready(run);
            }
        }
        let r = &mut st[i];
        let hits = tier_hits.total() + peer;
        let uncached = uncached_tokens(r.input_tokens, hits, bs);
        let (uncached, load_ms) = if r.recompute {
            // Admitted again after a preemption: its hits were counted the first time.
            // Past a whole cached prompt it reuses the blocks of generated tokens its
            // first attempt left cached (they are its own again: they leave the free
            // pool), and computes the rest of its prompt and of its generated tokens.
            let reused = if tier_hits.device == chain.len() {
                let mut k = 0;
                while k * bs < r.generated && wk.lru.take(generated_block(i, k)) {
                    k += 1;
                }
                k
            } else {
                0
            };
            (uncached + r.generated.saturating_sub(reused * bs), 0.0)
        } else {
            let cached = r.input_tokens - uncached;
            let moved = moved_tokens(tier_hits, peer, bs, cached);
            let load_ms = cfg.cost.host_load_ms(moved.host)
                + cfg.cost.disk_load_ms(moved.disk)
                + cfg.cost.peer_load_ms(moved.peer);
            let tally = &mut self.tally;
            tally.peer_hit_blocks += peer as u64;
            tally.peer_pulls += u64::from(peer > 0);
            tally.host_hit_blocks += tier_hits.host as u64;
            tally.disk_hit_blocks += tier_hits.disk as u64;
            tally.tier_load_ms += load_ms;
            tally.hit_blocks += hits as u64;
            tally.total_blocks += chain.len() as u64;
            tally.cached_tokens += cached as u64;
            tally.prompt_tokens += r.input_tokens as u64;
            tally.arrivals.push((r.sent_ms, hits, chain.len()));
            (uncached, load_ms)
        };
        let lane_tokens =
            uncached + (load_ms * cfg.cost.prefill_tokens_per_s / 1000.0).ceil() as usize;
        // The backlog carried its expected prefill until now.
        wk.queued_prefill_tokens = wk.queued_prefill_tokens - r.lane_tokens + lane_tokens;
        wk.prefill_computed += uncached as u64;
        r.uncached = uncached;
        r.load_ms = load_ms;
        r.lane_tokens = lane_tokens;
        r.computing = change.stored.clone();
        r.admitted = true;
        self.router.on_enqueued(w, &change, workers);
    }
}

/// Times closer than this, in ms, are equal when judging a wait.
const ROUNDING_MS: f64 = 1e-6;

/// Starts the next queued prefill of `wk` at `now` (its hits already taken): its
/// duration, ms, and what taking its blocks evicted; `None` if, holding blocks, they
/// do not fit yet.
fn start_prefill(
    wk: &mut SimWorker,
    st: &[ReqState],
    chains: &[Vec<BlockHash>],
    cost: &CostModel,
    now: f64,
    hold: bool,
) -> Option<(f64, ChainChange)> {
    let &i = wk.queue.front()?;
    let r = &st[i];
    if hold
        && !wk.fits(
            &chains[i],
            r.input_tokens,
            r.output_tokens,
            r.generated,
            r.output_blocks,
            now,
        )
    {
        return None;
    }
    let evicted = admit_to_lane(wk, st, chains, i, hold);
    wk.prefilling = Some(i);
    let t = prefill_time(&st[i], cost);
    wk.prefilling_tokens = st[i].lane_tokens;
    wk.prefill_started = now;
    wk.prefill_until = now + t;
    Some((t, evicted))
}

/// Request `i`, at the head of `wk`'s queue, leaves it for the prefill lane: it holds
/// its prompt's blocks (and, as the engine's rule has it, the first of its output's)
/// from now to its last token. Returns what taking them evicted.
fn admit_to_lane(
    wk: &mut SimWorker,
    st: &[ReqState],
    chains: &[Vec<BlockHash>],
    i: usize,
    hold: bool,
) -> ChainChange {
    let r = &st[i];
    wk.dequeue(&chains[i]);
    let mut evicted = ChainChange::default();
    match wk.memory.as_mut() {
        // The engine's rule: the prompt's blocks now, the output's as it is generated.
        Some(m) => {
            let initial = m.start(
                i,
                r.input_tokens,
                r.output_tokens,
                chains[i].len(),
                r.generated,
            );
            wk.in_use.hold(&chains[i], 0);
            for _ in 0..initial {
                let change = wk.grow_output();
                evicted.removed.extend(change.removed);
                evicted.lower.extend(change.lower);
            }
        }
        None => wk.in_use.hold(&chains[i], r.output_blocks),
    }
    if hold {
        wk.lru.pin_chain(&chains[i]);
    }
    evicted
}

/// Preempts request `v`, decoding on `wk`, as the engine's scheduler does when a
/// running sequence finds no free block: its blocks are released (its prompt's stay
/// cached until evicted), the reserve's share rises, and it waits at the head of the
/// queue to compute its prompt's uncached part and the tokens it generated again.
/// Returns what releasing its blocks evicted.
fn preempt(
    wk: &mut SimWorker,
    st: &mut [ReqState],
    chains: &[Vec<BlockHash>],
    v: usize,
    now: f64,
    hits_at_admission: bool,
    bs: usize,
) -> ChainChange {
    let generated = wk.memory.as_mut().map_or(0, |m| {
        m.preempted();
        m.generated(v, now)
    });
    // Only the engine's rule preempts, and it holds blocks.
    let change = wk.stop_running(v, &st[v], &chains[v], generated, bs, true);
    wk.decoding -= 1;
    let hits = wk.lru.match_prefix(&chains[v]);
    let r = &mut st[v];
    r.epoch += 1;
    r.generated = generated;
    r.recompute = true;
    r.admitted = false;
    r.pull = None;
    // Its place in the backlog until it takes its hits again.
    r.lane_tokens = uncached_tokens(r.input_tokens, hits, bs) + generated;
    wk.queued_prefill_tokens += r.lane_tokens;
    wk.enqueue(v, &chains[v], hits_at_admission);
    // The engine queues it by arrival: ahead of every request that came after it.
    wk.queue.pop_back();
    wk.queue.push_front(v);
    change
}

/// Names for the full blocks of generated tokens request `i` leaves cached when it
/// releases `grown` blocks beyond its `prompt_blocks`, having generated `generated`
/// tokens, last block first (the order the engine releases them in). They are its
/// own, as its output is; a preempted request generates the same tokens again, so
/// its second attempt finds its first attempt's blocks under the same names.
fn generated_blocks(
    i: usize,
    r: &ReqState,
    generated: usize,
    prompt_blocks: usize,
    grown: usize,
    bs: usize,
) -> Vec<BlockHash> {
    let full = kvfleet_core::full_blocks(r.input_tokens + generated, bs)
        .saturating_sub(prompt_blocks)
        .min(grown);
    (0..full).rev().map(|k| generated_block(i, k)).collect()
}

/// The name of request `i`'s `k`-th full block of generated tokens.
fn generated_block(i: usize, k: usize) -> BlockHash {
    // A tag no trace's chained hash is built from, then the request and the block.
    const GENERATED: u64 = 0x6765_6e65_7261_7465;
    BlockHash(kvfleet_routing::policy::mix64(
        GENERATED ^ ((i as u64) << 20) ^ k as u64,
    ))
}

/// The prompt tokens of an `input`-token request with `hits` cached blocks of `bs`
/// tokens still to compute: at least its last one, whose logits it needs.
fn uncached_tokens(input: usize, hits: usize, bs: usize) -> usize {
    input - (hits * bs).min(input.saturating_sub(1))
}

/// A request's time on its prefill lane, ms.
fn prefill_time(r: &ReqState, cost: &CostModel) -> f64 {
    cost.prefill_ms(r.uncached) + r.load_ms
}

/// The time `wk`'s lane will spend, from `now`, on requests ahead of a new one that
/// compute blocks of `reused` (the cached prefix the new request expects): those
/// blocks are not ready before then wherever the request goes, unless recomputed.
fn own_prefix_ahead(
    wk: &SimWorker,
    st: &[ReqState],
    chains: &[Vec<BlockHash>],
    reused: &[BlockHash],
    now: f64,
    cost: &CostModel,
) -> f64 {
    if reused.is_empty() || wk.lane_idle() {
        return 0.0;
    }
    let reused: HashSet<BlockHash> = reused.iter().copied().collect();
    // Hashes are chained: a run that contains a block of `reused` contains the
    // prompt's whole prefix up to it, so its first block is in `reused` too.
    let computes_ours = |j: usize| {
        if st[j].admitted {
            st[j]
                .computing
                .iter()
                .any(|(_, run)| run.first().is_some_and(|h| reused.contains(h)))
        } else {
            // Not admitted yet: it will compute its chain past the hits it expects.
            chains[j]
                .get(st[j].expected_hits)
                .is_some_and(|h| reused.contains(h))
        }
    };
    let running = if wk
        .prefilling
        .iter()
        .chain(&wk.riders)
        .any(|&j| computes_ours(j))
    {
        (wk.prefill_until - now).max(0.0)
    } else {
        0.0
    };
    running
        + wk.queue
            .iter()
            .filter(|&&j| computes_ours(j))
            .map(|&j| prefill_time(&st[j], cost))
            .sum::<f64>()
}

fn timeline(arrivals: &[(f64, usize, usize)], t0: f64, buckets: usize) -> Vec<(f64, f64)> {
    let Some(last) = arrivals.iter().map(|a| a.0).reduce(f64::max) else {
        return Vec::new();
    };
    let buckets = buckets.max(1);
    let span = (last - t0).max(1.0);
    let mut sums = vec![(0usize, 0usize); buckets];
    for &(t, h, n) in arrivals {
        let b = (((t - t0) / span * buckets as f64) as usize).min(buckets - 1);
        sums[b].0 += h;
        sums[b].1 += n;
    }
    sums.iter()
        .enumerate()
        .filter(|(_, s)| s.1 > 0)
        .map(|(b, s)| {
            (
                (t0 + span * (b + 1) as f64 / buckets as f64) / 1000.0,
                s.0 as f64 / s.1 as f64,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn a_queued_chain_leaves_the_pool_alone_but_counts_for_the_requests_behind_it() {
        let mut w = SimWorker::new(4, 0, 0);
        w.lru.insert_chain(&h(&[1, 2]));
        // Queued: nothing is stored or evicted yet...
        w.enqueue(0, &h(&[1, 2, 3, 4]), true);
        assert!(!w.lru.contains(BlockHash(3)));
        assert_eq!(w.tiered_match(&h(&[1, 2, 3, 4, 5])).total(), 2);
        // ...but a request queued behind it expects its blocks.
        assert_eq!(w.expected_hits(&h(&[1, 2, 3, 4, 5])), 4);
        assert_eq!(w.expected_hits(&h(&[1, 9])), 1);
        // Admitted, it no longer counts twice: its chain is in the pool.
        w.dequeue(&h(&[1, 2, 3, 4]));
        assert!(w.queued_blocks.is_empty() && w.queue.is_empty());
        assert_eq!(w.expected_hits(&h(&[1, 2, 3, 4, 5])), 2);
    }

    #[test]
    fn a_queued_request_holds_its_prefix_up_to_half_the_pool_and_lets_go_when_admitted() {
        let mut w = SimWorker::new(8, 0, 0);
        w.lru.insert_chain(&h(&[1, 2, 3, 4, 5]));
        // Five blocks cached; queued requests may take four (half the pool) to hold.
        // The second holds the three the first holds at no cost, and one more.
        w.enqueue(0, &h(&[1, 2, 3, 9]), true);
        w.enqueue(1, &h(&[1, 2, 3, 4, 5, 9]), true);
        assert_eq!(
            (w.held.get(&0), w.held.get(&1)),
            (Some(&(3, 3)), Some(&(4, 1)))
        );
        assert_eq!(w.held_total(), 4);
        // Strangers fill the pool: the held blocks stay, `5` (touched) goes last.
        w.lru.insert_chain(&h(&[20, 21, 22]));
        assert!(w.lru.contains(BlockHash(5)));
        w.lru.insert_chain(&h(&[30, 31, 32, 33, 34]));
        assert_eq!(w.lru.match_prefix(&h(&[1, 2, 3, 4, 5])), 4);
        // Admitted, each lets go of its hold.
        let mut change = ChainChange::default();
        w.release_held(0, &h(&[1, 2, 3, 9]), &mut change);
        w.release_held(1, &h(&[1, 2, 3, 4, 5, 9]), &mut change);
        assert!(w.held.is_empty());
        assert_eq!(w.held_total(), 0);
        w.lru.insert_chain(&h(&[40, 41, 42, 43, 44, 45, 46, 47]));
        assert!(!w.lru.contains(BlockHash(1)), "evictable again");
    }

    #[test]
    fn holds_yield_youngest_first_to_an_admitted_request_that_needs_the_room() {
        let mut w = SimWorker::new(8, 0, 0);
        w.lru.insert_chain(&h(&[1, 2]));
        w.lru.insert_chain(&h(&[3, 4]));
        let chains = vec![h(&[5, 6, 7, 8, 9]), h(&[1, 2, 10]), h(&[3, 4, 11])];
        for (i, c) in chains.iter().enumerate() {
            w.enqueue(i, c, true);
        }
        assert_eq!(w.held_total(), 4);
        // Request 0's five new blocks fit beside two held ones, not four: the
        // youngest (2) lets go, the older (1) keeps its hold.
        w.admit_holds(0, &chains, false);
        assert_eq!((w.held.get(&1), w.held.get(&2)), (Some(&(2, 2)), None));
        assert_eq!(w.held_total(), 2);
        // Nothing more to yield when it fits.
        w.admit_holds(0, &chains, false);
        assert_eq!(w.held_total(), 2);
    }

    #[test]
    fn free_blocks_are_those_no_running_sequence_holds() {
        let mut wk = SimWorker::new(100, 0, 0);
        let chain = h(&[1, 2, 3, 4]);
        wk.admit(&chain, TierHits::default());
        // Cached, but no sequence runs: every block is free, as an engine's pool
        // counts them (the report said 96 before: pool minus cached).
        assert_eq!(wk.load_report().free_blocks, 100);
        // Its prefill starts: 4 prompt blocks and 2 more for its output are in use.
        let st = vec![ReqState {
            output_blocks: 2,
            ..ReqState::default()
        }];
        wk.queue.push_back(0);
        let chains = [chain.clone()];
        assert!(start_prefill(
            &mut wk,
            &st,
            &chains,
            &CostModel::h200_llama8b(),
            0.0,
            false
        )
        .is_some());
        assert_eq!(wk.load_report().free_blocks, 94);
        // Its last token: the blocks stay cached and are free again.
        wk.in_use.release(&chain, 2);
        assert_eq!(wk.load_report().free_blocks, 100);
        assert_eq!(wk.lru.len(), 4);
    }

    #[test]
    fn the_load_report_counts_what_is_left_of_the_prefill_in_progress() {
        // An engine reports the prompt tokens it has yet to compute, and the router
        // polls it while a prefill runs: halfway through an 8,000-token prefill (1 s at
        // 8,000 tokens/s, plus 20 ms) the report says about 4,000, not 8,000.
        let cost = CostModel::h200_llama8b();
        let mut wk = SimWorker::new(100, 0, 0);
        let st = vec![ReqState {
            uncached: 8_000,
            lane_tokens: 8_000,
            ..ReqState::default()
        }];
        wk.queue.push_back(0);
        wk.queued_prefill_tokens = 8_000;
        let chains = [h(&[1])];
        let (t, _) = start_prefill(&mut wk, &st, &chains, &cost, 0.0, false).unwrap();
        wk.report_ms = 0.0;
        assert_eq!(wk.load_report().queued_prefill_tokens, 8_000);
        wk.report_ms = t / 2.0;
        assert_eq!(wk.load_report().queued_prefill_tokens, 4_000);
        wk.report_ms = t;
        assert_eq!(wk.load_report().queued_prefill_tokens, 0);
    }

    #[test]
    fn evictions_demote_down_the_tiers_and_hits_promote_back() {
        let mut wk = SimWorker::new(2, 2, 4);
        let a = h(&[1, 2]);
        let hits = wk.tiered_match(&a);
        wk.admit(&a, hits);
        // [3,4] evicts 1 and 2 from the device: they go to host.
        let ch = wk.admit(&h(&[3, 4]), TierHits::default());
        assert_eq!(ch.removed, h(&[2, 1]));
        assert_eq!(
            ch.lower
                .iter()
                .filter(|o| o.medium == Medium::Host && o.stored)
                .count(),
            2
        );
        assert_eq!(
            wk.tiered_match(&a),
            TierHits {
                device: 0,
                host: 2,
                disk: 0
            }
        );
        // The next chain demotes 3 and 4 to host, which pushes 1 and 2 down to disk.
        let ch = wk.admit(&h(&[5, 6]), TierHits::default());
        assert!(ch.lower.contains(&LowerOp {
            medium: Medium::Disk,
            stored: true,
            hash: BlockHash(1)
        }));
        assert_eq!(wk.tiered_match(&a).disk, 2);
        // A hit promotes them to the device; the disk copies stay.
        let hits = wk.tiered_match(&a);
        wk.admit(&a, hits);
        assert_eq!(wk.tiered_match(&a).device, 2);
        assert!(wk.disk.contains(BlockHash(1)));
        // No tiers: evictions are simply gone.
        let mut flat = SimWorker::new(2, 0, 0);
        flat.admit(&a, TierHits::default());
        let ch = flat.admit(&h(&[3, 4]), TierHits::default());
        assert!(ch.lower.is_empty());
        assert_eq!(flat.tiered_match(&a).total(), 0);
    }

    #[test]
    fn the_router_index_sees_every_tier() {
        let mut wk = SimWorker::new(2, 4, 0);
        let mut router = kvfleet_policy::KvfleetPolicy::new(
            RouterConfig {
                block_size: 16,
                ..RouterConfig::default()
            },
            PolicyKind::CacheAware,
            1,
        )
        .unwrap();
        let workers = std::slice::from_ref(&wk).to_vec();
        for chain in [h(&[1, 2]), h(&[3, 4])] {
            let ch = wk.admit(&chain, TierHits::default());
            router.on_enqueued(0, &ch, &workers);
            // Computed: stored, then whatever was evicted meanwhile removed again.
            let gone = wk.evicted_of(&ch.stored);
            router.on_computed(0, &ch.stored, &gone, &workers);
        }
        let idx = router.router().worker_index("w0").unwrap();
        let index = router.router().index();
        assert_eq!(index.tier_block_count(idx, Medium::Device), 2);
        assert_eq!(index.tier_block_count(idx, Medium::Host), 2);
        let m = index.find_tiered_matches(&h(&[1, 2])).get(idx);
        assert_eq!((m.device, m.host), (0, 2));
    }
}
