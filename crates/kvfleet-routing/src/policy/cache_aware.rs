//! `cache-aware`: kvfleet's policy. Send a request where its estimated cost is lowest,
//! counting the prefix a worker already holds (or is computing), but never pile
//! unbounded work onto the holder of a hot prefix.
//!
//! Estimated cost of worker `W`, in prompt-token equivalents (one latency estimate:
//! the tokens that must be computed on `W` before this request's first token, plus a
//! price on the fleet work a cache miss spends):
//!
//! ```text
//! cost(W) = λ(W) × (uncached(W) + load(W))          // this request's prefill on W
//!         + backlog(W)                              // prefill queued ahead of it
//!         + decode_cost_per_sequence × active(W)    // decode work sharing W's steps
//!         + δ(W) × duplicated(W)                    // held elsewhere, recomputed on W
//!         + memory_weight × computed(W) × usage(W)  // what W stores, by its pool's use
//! backlog(W) = W's queued prefill
//!         + admission_wait_ratio × prompt           // if W cannot admit the prompt now
//! λ(W)    = prefill_weight          if W's prefill lane is busy (or W cannot admit
//!                                   the prompt now)
//!         = idle_prefill_weight     if it is idle
//!         = wait_ending_prefill_weight
//!                                   if it is idle and starting there ends a wait:
//!                                   the prompt's deepest prefix is computed, and its
//!                                   holder's wait ≥ wait_ending_ratio × W's prefill
//! δ(W)    = busy_duplicate_weight   if W's prefill lane is busy, else 0
//! ```
//!
//! **Admission.** An engine starts a prompt only where its free blocks hold the
//! prompt's blocks beside what its running sequences are expected to grow by (the
//! decode reserve); otherwise the prompt waits for running sequences to end, however
//! idle the prefill lane. Workers report that headroom
//! ([`WorkerLoad::admit_blocks`](crate::load::WorkerLoad::admit_blocks)); a worker
//! whose headroom cannot hold the prompt's blocks its running sequences do not hold
//! ([`admit_need`](super::admit_need): on an idle lane, the prompt less the leading
//! blocks that requests this router sent there and that have not ended share; on a
//! busy one, the whole prompt) and that runs anything is priced as a busy lane
//! with `admission_wait_ratio` (0.5) × the prompt's tokens of wait added, and so is a
//! prompt's holder in the wait the wait-ending weight reads. Until a worker's next poll
//! the prompts this router sent it since take their blocks from its headroom
//! ([`WorkerLoad::admit_blocks_since_poll`](crate::load::WorkerLoad::admit_blocks_since_poll)). In `kvfleet bench sweep`
//! in the engine-faithful mode (docs/policy-sweep.head.md, 2026-12-07), where the
//! simulated workers admit by the engine's rule, this took the avoidable waits of
//! seed 1 at 8-64 workers from 1,982 to 484 and the groups meeting the hit target
//! from 36 to 45 of 63 (all three targets: 7 to 12); the held-out seeds 2 and 3 went
//! from 1,781 and 1,621 waits to 362 and 382, and from 6 and 6 groups meeting all
//! three to 8 and 8 of 42. A ratio of 0.25, 0.75 and 1 gave 13, 12 and 8 groups
//! meeting all three (905, 555 and 615 avoidable waits; the holder's wait priced at
//! a whole prompt in these three). In the default mode, whose
//! workers start a prompt whatever their pool holds and say nothing of headroom,
//! nothing changes. Leaving out of an idle lane's need the blocks its running
//! sequences hold (docs/policy-sweep.head.md, 2026-12-07, late night) matters where sessions
//! share a system prompt: on `herd` and `tenants` an idle lane running other sessions
//! had looked short of room, and requests queued behind a busy holder instead. It took
//! the avoidable waits of seed 1 at 8-64 workers from 484 to 194 (all three targets
//! in 15 of 63 groups, against 12), and of seeds 2 and 3 from 358 and 376 to 178 and
//! 136, changing no other family.
//!
//! `uncached(W)` counts every tier as cached; `load(W)` prices W's host and disk hits
//! as the recompute-equivalent of copying them in (`tiers`, see
//! [`TierCostConfig`]): a tier hit is worth the prefill it really saves, never more
//! than a device hit. With peer pulls on, the blocks `W` could pull from the prompt's
//! deepest holder count as cached too, and `load(W)` adds their transfer time: a less
//! loaded worker wins when pulling there plus its queue beats the holder's queue.
//!
//! An uncached token delays this request once (weight 1); it also spends capacity
//! that other requests may be waiting for, which is why its weight is above 1: with
//! `prefill_weight` 2 a fork sibling waits behind its first sibling's prefix rather
//! than recompute it elsewhere at equal latency but double the fleet's work.
//!
//! `idle_prefill_weight` (1.5) prices an uncached token on a worker whose prefill lane
//! is idle: the capacity it spends there is not taken from anyone queued. It applies
//! however busy the rest of the fleet is: a discount scaled down by the fraction of
//! busy lanes vanished exactly when requests queued behind a hot prefix next to an
//! idle lane.
//!
//! `wait_ending_prefill_weight` (0.9) replaces it where recomputing on the idle lane
//! ends a wait: the worker holding the prompt's deepest prefix
//! ([`RouteContext::holder_wait_tokens`]) would start the request no sooner than
//! `wait_ending_ratio` (0.7) × the idle lane's own prefill. A request then leaves a
//! hot prefix's queue once a cold start is about as soon as waiting; the weight is a
//! little under 1 and the ratio well under, because the router sees a queue late
//! and short (loads are polled every 100 ms, and leave out each request's fixed
//! overhead). Elsewhere the full weight holds, for two reasons:
//! - while the prefix is still being computed (the router then passes no wait: a
//!   fork sibling routed there, its blocks not yet reported), the holder's queue is
//!   mostly that very prefix, and recomputing it would double the work to save at
//!   most the sibling's head start;
//! - where the holder would start the request soon anyway, the discount would only
//!   let the decode and memory terms move short prompts off their prefix: on fork
//!   fan-outs of ~120-token prompts (the sweep's `short`) a flat 0.9 lost 0.17 in hit
//!   ratio against SGLang's rule for no gain in p99.
//!
//! In `kvfleet bench sweep` (docs/policy-sweep.head.md, 2026-12-05), with load reports
//! polled as a live router sees them, this met all three targets in 38, 38 and 35 of
//! the 72 groups that predate `short` (seeds 1, 2, 3), as a flat 0.9 pending-aware
//! discount did, against 23, 22 and 23 with 1.5 throughout; the ratio at 0.6, 0.8 and
//! 0.9 gave 114, 109 and 104 over the three seeds against 111, trading hits on `short`
//! (mean gap to the best baseline −0.080, −0.054, −0.046 against −0.065).
//!
//! `duplicated(W)` counts the tokens `W` would recompute that another worker already
//! holds or is computing (up to the deepest match, `RouteContext::deepest_blocks`). On
//! a busy lane each costs `busy_duplicate_weight` (6) more: recomputing a prefix that
//! exists elsewhere delays every request queued on `W` and buys a second copy that
//! crowds `W`'s pool, for the sake of a shorter queue. So when every lane is busy a
//! request stays with its prefix's holder unless the holder's queue is much longer;
//! an idle lane pays no such price, so the rule above still ends long waits. Within a
//! class of equally matched workers the term is the same for all, so the load order's
//! walk (`crate::load_order`) is unchanged.
//!
//! `usage(W)` is the share of W's KV pool held by running sequences (its last load
//! report: `1 − free ÷ total`, in sixteenths, [`crate::USAGE_LEVELS`]), and
//! `computed(W)` the prompt tokens W would compute. Whatever a worker computes it
//! also stores, evicting the least recently used prefixes in the part of its pool the
//! running sequences leave free; the fuller the pool, the fewer such prefixes and the
//! sooner the evicted ones are asked for again. So a prompt nobody holds goes to a
//! worker whose pool is free rather than to one whose running sequences crowd out its
//! cache, and a session whose holder is crowded may leave it once it must recompute
//! most of its prompt anyway, as Dynamo's router does with its active-blocks term. A
//! fork child that computes a few hundred tokens pays almost nothing, so it stays
//! with its prefix. The price is taken against the fleet's mean usage
//! ([`FleetLoad::mean_usage`]): it moves work from fuller pools to emptier ones
//! without making idle lanes dearer than busy ones on average, so it does not make
//! requests queue (priced on usage alone, seed 1 of the sweep had 148 avoidable
//! waits instead of 94). With weight 0.25 the sweep met all three targets in 30 of
//! 72 groups against 29 (held-out seeds 2 and 3: 14 and 14 of 36, against 14 and 12),
//! the mean hit ratio and the summed p99 excess improved on every family, and
//! `conversation` at 256 workers, light load, went from 0.642 to 0.697 in hits
//! (Dynamo: 0.695).
//!
//! `kvfleet bench sweep` (docs/policy-sweep.head.md, 2026-12-05) chose both: the
//! duplicate price (plateau 3-10) raised the hit target from 40 to 44-45 of 72 groups
//! and Mooncake's mean hit ratio by 0.012, and with it an idle weight of 1.4-1.6
//! (1.7 before; 1.5 with a wait-ending 0.9 since, above) met all three targets in 28 of 72 groups against 22 (held-out seeds 2
//! and 3: 12 and 13 of 36, against 9 and 12). A flat busy weight of 8 did as well on
//! the sweep, but without pulls it moved requests off their holder to idle lanes at
//! once, losing hits and p99 where memory is plentiful (`tests/sim.rs`).
//!
//! With peer pulls on, [`PullTrigger`] says when a request moves to pull its prefix:
//! by default (`idle-wait`) only to end a wait longer than a cold start on an idle
//! lane; with `cost`, whenever pricing the pull makes another worker cheapest.
//!
//! **Ties** (with `near_tie_tokens` / `near_tie_ratio`, costs that close to the
//! cheapest count as ties too) are broken on the prompt's *anchor*, the chained hash
//! of its block `2^⌊log2 n⌋ − 1` (`n` full blocks), which covers at least half the
//! prompt: of the [`TIE_RING_REACH`] (8) tied workers whose id hashes come first at or
//! after the anchor's point on a 64-bit ring, the one with the highest rendezvous
//! score wins. Every router replica computes the same anchor, ring and scores from the
//! workers' string ids, so fork siblings that reach two routers at the same instant,
//! with no header, land on one worker. With 8 tied workers or fewer this is plain
//! rendezvous hashing; the ring bounds the work on a large fleet, where hundreds of
//! idle workers tie at light load: the load order finds the 8 in `O(log n)` (see
//! [`crate::load_order`]), and rendezvous among 8 neighbours evens out the ring's
//! uneven arcs (a worker owning a long arc would otherwise win its anchors again and
//! again, which makes two routers whose load views differ by that worker disagree).
//! Conversations that share only a system prompt (under half their length) get
//! different anchors, so where their costs tie they spread over the tied workers
//! rather than following one; a conversation keeps its anchor from turn to turn until
//! its length doubles.
//! A prompt shorter than one block has nothing to keep together: its ties go to the
//! candidate chosen least recently.
//!
//! Bounded-load guard: a worker is skipped in favour of the next cheapest when its
//! active sequences after taking the request would exceed
//! `(1 + balance_epsilon) × mean + balance_slack` (the mean including the request), or
//! when its backlog plus this request's prefill would exceed
//! `max_prefill_backlog_tokens`. The slack keeps a fork family together on its
//! holder while loads are small; the relative bound stops one hot prefix from growing a
//! worker's load without limit. The worker it spills to then holds a second copy of the
//! prefix, and later requests for it see both. If every worker is over its bound, the
//! cheapest is used.

use super::{mix64, Candidate, FleetLoad, RouteContext, RoutingPolicy, Selection, TierCostConfig};
use crate::load::CandidateLoad;
use crate::registry::WorkerIdx;
use kvfleet_core::kv_events::Medium;
use serde::{Deserialize, Serialize};

/// Weights and bounds of [`CacheAware`]. Read from JSON by `kvfleet router
/// --cache-aware-config` and the simulators: a field left out keeps its default, an
/// unknown one is an error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareConfig {
    /// Cost of one uncached prompt token on a worker whose prefill lane is busy
    /// (default 2.0).
    pub prefill_weight: f64,
    /// Cost of one uncached prompt token on a worker whose prefill lane is idle
    /// (default 1.5; `prefill_weight` turns the discount off).
    pub idle_prefill_weight: f64,
    /// The same where recomputing there ends a wait: the prompt's deepest prefix is
    /// computed (no sibling is still computing it) and its holder would start the
    /// request no sooner than `wait_ending_ratio` × a cold start there (default 0.9).
    pub wait_ending_prefill_weight: f64,
    /// The holder's wait, as a fraction of a cold start on an idle lane, from which the
    /// idle lane pays `wait_ending_prefill_weight` (default 0.7: the router sees a
    /// queue late and short, so a wait it puts at 70% of a cold start may be longer).
    pub wait_ending_ratio: f64,
    /// The wait priced on a worker that cannot admit the prompt now (its admission
    /// headroom, [`CandidateLoad::admits`], is short of the prompt's blocks: its
    /// running sequences must end first), as a fraction of the prompt's tokens
    /// (default 0.5; 0 prices only the busy lane).
    pub admission_wait_ratio: f64,
    /// Extra cost of one prompt token a worker whose prefill lane is busy would
    /// recompute although another worker holds or is computing it (default 6.0; 0
    /// turns it off).
    pub busy_duplicate_weight: f64,
    /// Cost of one active sequence on the worker, in prompt-token equivalents
    /// (default 16.0).
    pub decode_cost_per_sequence: f64,
    /// Cost of one prompt token a worker would compute (and so store), per unit of
    /// its KV pool held by running sequences (default 0.25; 0 turns it off).
    pub memory_weight: f64,
    /// Relative slack of the load bound over the mean (default 0.25).
    pub balance_epsilon: f64,
    /// Absolute slack of the load bound, in sequences (default 16).
    pub balance_slack: f64,
    /// Cap on a worker's prefill backlog including this request, in tokens
    /// (default: none).
    pub max_prefill_backlog_tokens: Option<usize>,
    /// Costs within this many tokens of the cheapest are near ties (default 0: exact
    /// ties only).
    pub near_tie_tokens: f64,
    /// Costs within this fraction of the cheapest are near ties (default 0).
    pub near_tie_ratio: f64,
    /// How host and disk hits are priced (default: by load time).
    pub tiers: TierCostConfig,
    /// When a request goes to another worker to pull its prefix there, with peer pulls
    /// on (default `idle-wait`).
    pub pull_trigger: PullTrigger,
}

/// When `cache-aware` sends a request to a worker that pulls its prefix from a peer
/// (with peer pulls on, [`TierCostConfig::peer_pull_min_blocks`] > 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PullTrigger {
    /// Every candidate is priced with the blocks it could pull (at their transfer
    /// time), and the cheapest wins.
    Cost,
    /// Routing is priced without pulls; the choice is replaced by the idle prefill lane
    /// that can pull the prefix only when the choice would make the request wait
    /// longer than a cold start on an idle lane, and the pulled start there is
    /// sooner still. Copies are made only to end such a wait, so they crowd the
    /// pools less (docs/policy-sweep.head.md: 18 of 54 groups meet all three
    /// targets at 8-64 workers, against 16 with `cost` and 12 without pulls). The
    /// wait counts the fixed overhead of every prefill ahead
    /// ([`TierCostConfig::prefill_overhead_ms`]).
    #[default]
    IdleWait,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            prefill_weight: 2.0,
            idle_prefill_weight: 1.5,
            wait_ending_prefill_weight: 0.9,
            wait_ending_ratio: 0.7,
            admission_wait_ratio: 0.5,
            busy_duplicate_weight: 6.0,
            decode_cost_per_sequence: 16.0,
            memory_weight: 0.25,
            balance_epsilon: 0.25,
            balance_slack: 16.0,
            max_prefill_backlog_tokens: None,
            near_tie_tokens: 0.0,
            near_tie_ratio: 0.0,
            tiers: TierCostConfig::default(),
            pull_trigger: PullTrigger::IdleWait,
        }
    }
}

/// The cache-aware policy; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct CacheAware {
    config: CacheAwareConfig,
    /// When each worker (by index) was last chosen, on `clock`'s scale (0: never).
    last_chosen: Vec<u64>,
    /// Selections made so far.
    clock: u64,
    /// Keys of the candidates within their bounds, reused across selections.
    within: Vec<Key>,
    /// The near ties of a selection, reused likewise.
    ties: Vec<Key>,
}

impl CacheAwareConfig {
    /// Checks that every weight, ratio and slack is a finite number of at least 0
    /// (a negative or NaN weight would turn the cost order upside down); the error
    /// names the first field that is not.
    pub fn validate(&self) -> Result<(), String> {
        let fields = [
            ("prefill_weight", self.prefill_weight),
            ("idle_prefill_weight", self.idle_prefill_weight),
            (
                "wait_ending_prefill_weight",
                self.wait_ending_prefill_weight,
            ),
            ("wait_ending_ratio", self.wait_ending_ratio),
            ("admission_wait_ratio", self.admission_wait_ratio),
            ("busy_duplicate_weight", self.busy_duplicate_weight),
            ("decode_cost_per_sequence", self.decode_cost_per_sequence),
            ("memory_weight", self.memory_weight),
            ("balance_epsilon", self.balance_epsilon),
            ("balance_slack", self.balance_slack),
            ("near_tie_tokens", self.near_tie_tokens),
            ("near_tie_ratio", self.near_tie_ratio),
        ];
        non_negative("cache-aware", &fields)
    }
}

/// Checks that every `(name, value)` of `fields` is a finite number of at least 0; the
/// error names the first that is not, as a field of `owner`'s settings.
pub fn non_negative(owner: &str, fields: &[(&str, f64)]) -> Result<(), String> {
    match fields.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
        Some((name, v)) => Err(format!(
            "{owner} `{name}` must be a finite number of at least 0, not {v}"
        )),
        None => Ok(()),
    }
}

impl CacheAware {
    /// A policy with the given weights.
    pub fn new(config: CacheAwareConfig) -> Self {
        Self {
            config,
            last_chosen: Vec::new(),
            clock: 0,
            within: Vec::new(),
            ties: Vec::new(),
        }
    }

    /// The policy's weights.
    pub fn config(&self) -> &CacheAwareConfig {
        &self.config
    }

    /// Sets the KV bytes of one token the tier pricing uses (from the workers' model).
    pub fn set_kv_bytes_per_token(&mut self, bytes: f64) {
        self.config.tiers.kv_bytes_per_token = bytes;
    }

    /// Whether a request may move to an idle lane to pull its prefix there, to end a
    /// wait ([`PullTrigger::IdleWait`] with peer pulls on).
    pub fn pulls_end_waits(&self) -> bool {
        self.config.pull_trigger == PullTrigger::IdleWait && self.config.tiers.pulls_enabled()
    }

    /// The weight of an uncached token on `c`, which would compute `own` token
    /// equivalents for the request: `prefill_weight` when its prefill lane is busy;
    /// when it is idle, `wait_ending_prefill_weight` if that ends a wait
    /// (`ends_a_wait`), else `idle_prefill_weight`.
    #[inline]
    pub fn prefill_weight(&self, ctx: &RouteContext<'_>, c: &Candidate, own: f64) -> f64 {
        if c.load.prefill_backlog_tokens() > 0 {
            return self.config.prefill_weight;
        }
        let idle = if self.ends_a_wait(ctx, own) {
            self.config.wait_ending_prefill_weight
        } else {
            self.config.idle_prefill_weight
        };
        if c.load.admits(ctx.admit_blocks_on(c)) {
            idle
        } else {
            // An idle lane that cannot admit the prompt is busy with its running
            // sequences; never cheaper than were it to admit it (the load order's
            // walk relies on that).
            idle.max(self.config.prefill_weight)
        }
    }

    /// The prompt tokens `c` is priced as computing before it can start this
    /// request: its prefill backlog ([`Self::backlog_of`]).
    #[inline]
    pub fn backlog(&self, ctx: &RouteContext<'_>, c: &Candidate) -> usize {
        self.backlog_of(&c.load, ctx.prompt_tokens, ctx.admit_blocks_on(c))
    }

    /// The prefill backlog of a worker with `load`, and where its admission headroom
    /// cannot hold a prompt of `prompt_tokens` in `admit_blocks` blocks,
    /// `admission_wait_ratio` × the prompt more: the running sequences it waits on to
    /// end first. Its prefill lane then counts as busy.
    #[inline]
    pub fn backlog_of(
        &self,
        load: &CandidateLoad,
        prompt_tokens: usize,
        admit_blocks: usize,
    ) -> usize {
        let backlog = load.prefill_backlog_tokens();
        if load.admits(admit_blocks) {
            backlog
        } else {
            let wait = self.config.admission_wait_ratio * prompt_tokens as f64;
            // At least one token: a lane that cannot start the prompt is never idle.
            backlog.saturating_add((wait as usize).max(1))
        }
    }

    /// Whether `c` would start this request's prefill at once: its prefill lane is
    /// idle and its admission headroom holds the prompt.
    #[inline]
    pub fn starts_at_once(&self, ctx: &RouteContext<'_>, c: &Candidate) -> bool {
        self.backlog(ctx, c) == 0
    }

    /// Whether an idle lane computing `own` token equivalents would end a wait: the
    /// prompt's holder would start the request no sooner than `wait_ending_ratio` ×
    /// `own`. The router passes no wait while a sibling still computes the prefix: the
    /// holder's queue is then mostly that prefix, and recomputing it would double the
    /// work to save at most the sibling's head start.
    #[inline]
    fn ends_a_wait(&self, ctx: &RouteContext<'_>, own: f64) -> bool {
        self.config.wait_ending_ratio * own < ctx.holder_wait_tokens as f64
    }

    /// Estimated cost of sending the request of `ctx` to `c`.
    pub fn cost(&self, ctx: &RouteContext<'_>, c: &Candidate) -> f64 {
        self.priced(ctx, c, self.pulls_priced()).0
    }

    /// Whether candidates are priced with the blocks they could pull: pulls on, and
    /// triggered by cost.
    #[inline]
    fn pulls_priced(&self) -> bool {
        self.config.tiers.pulls_enabled() && self.config.pull_trigger == PullTrigger::Cost
    }

    /// `c`'s [`cost`](Self::cost) and the prompt tokens it would compute, worked out
    /// once (the policy needs both for every candidate). `pulls`: whether peer pulls
    /// are on, decided once per request rather than per candidate.
    #[inline]
    fn priced(&self, ctx: &RouteContext<'_>, c: &Candidate, pulls: bool) -> (f64, usize) {
        let (computed, own) = self.own_prefill(ctx, c, pulls);
        let cost = self.prefill_weight(ctx, c, own) * own
            + self.backlog(ctx, c) as f64
            + self.config.decode_cost_per_sequence * c.load.active_sequences() as f64
            + self.memory_price(ctx, c, computed)
            + self.duplicate_price(ctx, c, computed);
        (cost, computed)
    }

    /// The price of storing `computed` prompt tokens on `c` rather than on the mean
    /// worker: `memory_weight` each, in proportion to how much more of `c`'s pool
    /// than of the mean pool running sequences hold (negative on an emptier pool).
    #[inline]
    fn memory_price(&self, ctx: &RouteContext<'_>, c: &Candidate, computed: usize) -> f64 {
        let usage = f64::from(c.load.usage_level()) / f64::from(crate::USAGE_LEVELS);
        self.config.memory_weight * computed as f64 * (usage - ctx.fleet.mean_usage())
    }

    /// The price of the tokens `c` would recompute (`computed`, the prompt's last
    /// ones) that another worker already holds: `busy_duplicate_weight` each on a busy
    /// lane, nothing on an idle one.
    #[inline]
    fn duplicate_price(&self, ctx: &RouteContext<'_>, c: &Candidate, computed: usize) -> f64 {
        if self.backlog(ctx, c) == 0 || self.config.busy_duplicate_weight == 0.0 {
            return 0.0;
        }
        let held = (ctx.deepest_blocks * ctx.block_size).min(ctx.prompt_tokens);
        // `computed` is the prompt's tail; what lies before it is cached or pulled.
        let duplicated = held.saturating_sub(ctx.prompt_tokens.saturating_sub(computed));
        self.config.busy_duplicate_weight * duplicated as f64
    }

    /// This request's own prefill on `c`: the prompt tokens in none of `c`'s tiers and
    /// not pulled, and those plus the load time of its tier and pulled blocks, in
    /// recomputed-token equivalents.
    #[inline]
    fn own_prefill(&self, ctx: &RouteContext<'_>, c: &Candidate, pulls: bool) -> (usize, f64) {
        self.own_prefill_pulling(ctx, c, self.pulled(ctx, c, pulls))
    }

    /// [`Self::own_prefill`] with `pulled` blocks brought from a peer.
    #[inline]
    fn own_prefill_pulling(
        &self,
        ctx: &RouteContext<'_>,
        c: &Candidate,
        pulled: usize,
    ) -> (usize, f64) {
        let computed = ctx
            .uncached_tokens(c)
            .saturating_sub(pulled * ctx.block_size);
        (computed, computed as f64 + self.loaded(ctx, c, pulled))
    }

    /// Blocks `c` would pull from a peer (0 with pulls off).
    pub fn pull_blocks(&self, ctx: &RouteContext<'_>, c: &Candidate) -> usize {
        self.pulled(ctx, c, self.config.tiers.pulls_enabled())
    }

    #[inline]
    fn pulled(&self, ctx: &RouteContext<'_>, c: &Candidate, pulls: bool) -> usize {
        if pulls {
            ctx.pull_blocks(c, self.config.tiers.peer_pull_min_blocks)
        } else {
            0
        }
    }

    /// `c`'s host, disk and `pulled` blocks priced in recomputed-token equivalents (0
    /// without any).
    #[inline]
    fn loaded(&self, ctx: &RouteContext<'_>, c: &Candidate, pulled: usize) -> f64 {
        if c.host_blocks == 0 && c.disk_blocks == 0 && pulled == 0 {
            return 0.0;
        }
        let tiers = &self.config.tiers;
        let bs = ctx.block_size as f64;
        (c.host_blocks as f64 * tiers.load_fraction(Medium::Host)
            + c.disk_blocks as f64 * tiers.load_fraction(Medium::Disk)
            + pulled as f64 * tiers.peer_load_fraction())
            * bs
    }

    /// The bounded-load guard's bound: a worker whose active sequences after taking
    /// the request would exceed it is over its bound.
    pub fn load_bound(&self, fleet: FleetLoad) -> f64 {
        (1.0 + self.config.balance_epsilon) * (fleet.active_sequences + 1) as f64
            / fleet.workers.max(1) as f64
            + self.config.balance_slack
    }

    /// `c`'s [`cost`](Self::cost) and whether it is within its bounds (`bound` from
    /// [`load_bound`](Self::load_bound)), as [`RoutingPolicy::select`] prices it.
    pub fn price(&self, ctx: &RouteContext<'_>, c: &Candidate, bound: f64) -> (f64, bool) {
        self.price_with(ctx, c, bound, self.pulls_priced())
    }

    #[inline]
    fn price_with(
        &self,
        ctx: &RouteContext<'_>,
        c: &Candidate,
        bound: f64,
        pulls: bool,
    ) -> (f64, bool) {
        let (cost, computed) = self.priced(ctx, c, pulls);
        (cost, self.within_bounds(c, computed, bound))
    }

    /// Whether `c`, taking a request that computes `computed` prompt tokens there,
    /// stays within the bounded-load guard (`bound` from [`Self::load_bound`]) and the
    /// prefill backlog cap.
    #[inline]
    fn within_bounds(&self, c: &Candidate, computed: usize, bound: f64) -> bool {
        let cap = self.config.max_prefill_backlog_tokens.unwrap_or(usize::MAX);
        (c.load.active_sequences() + 1) as f64 <= bound
            && c.load.prefill_backlog_tokens().saturating_add(computed) <= cap
    }

    /// The widest near-tie band of a choice costing at most `cost`: a candidate
    /// costing more than `cost` plus this can be neither the choice nor a tie of it.
    pub fn tie_band(&self, cost: f64) -> f64 {
        self.config
            .near_tie_tokens
            .max(self.config.near_tie_ratio * cost)
            .max(0.0)
    }

    fn last_chosen(&self, w: WorkerIdx) -> u64 {
        self.last_chosen.get(w.index()).copied().unwrap_or(0)
    }

    fn mark_chosen(&mut self, w: WorkerIdx) {
        self.clock += 1;
        let i = w.index();
        if self.last_chosen.len() <= i {
            self.last_chosen.resize(i + 1, 0);
        }
        self.last_chosen[i] = self.clock;
    }
}

/// (cost, active sequences, worker, the worker's id hash): candidates are preferred
/// by cost, then fewer sequences, then the smaller id hash (then index), before near
/// ties are broken on the anchor's ring.
type Key = (f64, usize, WorkerIdx, u64);

fn lt(a: &Key, b: &Key) -> bool {
    a.0 < b.0 || (a.0 == b.0 && (a.1, a.3, a.2) < (b.1, b.3, b.2))
}

impl RoutingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection> {
        let mut within = std::mem::take(&mut self.within);
        within.clear();
        let bound = self.load_bound(ctx.fleet);
        let pulls = self.pulls_priced();

        // The cheapest worker, and the cheapest within its bounds; the keys of those
        // within bounds are kept for the tie pass. Each candidate's cost and computed
        // tokens are worked out once.
        let mut best: Option<Key> = None;
        let mut best_ok: Option<Key> = None;
        for c in ctx.candidates {
            let (cost, ok) = self.price_with(ctx, c, bound, pulls);
            let k: Key = (cost, c.load.active_sequences(), c.worker, c.id_hash);
            if best.as_ref().is_none_or(|b| lt(&k, b)) {
                best = Some(k);
            }
            if ok {
                within.push(k);
                if best_ok.as_ref().is_none_or(|b| lt(&k, b)) {
                    best_ok = Some(k);
                }
            }
        }
        let anchor = prompt_anchor(ctx.hashes);
        let picked = self.pick(best, best_ok, &within, anchor);
        self.within = within;
        match picked {
            Some(sel) if self.pulls_end_waits() => {
                Some(self.pull_to_end_a_wait(ctx, sel).unwrap_or(sel))
            }
            other => other,
        }
    }
}

impl CacheAware {
    /// Tokens `c` must compute (or load) before this request's first token: its
    /// backlog with the fixed overhead of each prefill ahead
    /// ([`TierCostConfig::prefill_overhead_tokens`]), then the request's own prefill,
    /// with or without the blocks it could pull. The overhead matters where prompts
    /// are short: four fork children of 120 tokens queued on their prefix's holder
    /// wait 20 ms each behind one another for 15 ms of tokens, which the backlog
    /// alone puts at 2 ms.
    fn time_to_first_token(&self, ctx: &RouteContext<'_>, c: &Candidate, pulls: bool) -> f64 {
        self.backlog(ctx, c) as f64
            + self.config.tiers.prefill_overhead_tokens() * c.load.prefills_ahead() as f64
            + self.own_prefill(ctx, c, pulls).1
    }

    /// [`PullTrigger::IdleWait`]: the idle prefill lane that pulls the prompt's prefix,
    /// when `sel` would make the request wait longer than a cold start on an idle lane
    /// and the pulled start there is sooner still.
    fn pull_to_end_a_wait(&self, ctx: &RouteContext<'_>, sel: Selection) -> Option<Selection> {
        let at = ctx
            .candidates
            .binary_search_by_key(&sel.worker, |c| c.worker)
            .ok()?;
        let wait = self.time_to_first_token(ctx, &ctx.candidates[at], false);
        let bound = self.load_bound(ctx.fleet);
        // Over the idle lanes: the soonest cold start, and the soonest pulled start
        // (then fewer sequences, then the smaller id hash: the load order's preference,
        // so the ordered walk's candidates choose the same). A lane whose decode load
        // is over the bounded-load guard may time the cold start, but never takes the
        // pull: the guard holds for every choice.
        let mut cold = f64::INFINITY;
        let mut pull: Option<(f64, usize, u64, WorkerIdx)> = None;
        for c in ctx.candidates.iter().filter(|c| self.backlog(ctx, c) == 0) {
            cold = cold.min(self.time_to_first_token(ctx, c, false));
            let pulled = self.pulled(ctx, c, true);
            if pulled == 0 {
                continue;
            }
            let (computed, prefill) = self.own_prefill_pulling(ctx, c, pulled);
            if !self.within_bounds(c, computed, bound) {
                continue;
            }
            let k = (prefill, c.load.active_sequences(), c.id_hash, c.worker);
            if pull.is_none_or(|p| {
                k.0.total_cmp(&p.0)
                    .then((k.1, k.2, k.3).cmp(&(p.1, p.2, p.3)))
                    .is_lt()
            }) {
                pull = Some(k);
            }
        }
        let (start, _, _, worker) = pull?;
        (wait > cold && start < wait).then_some(Selection {
            worker,
            spilled_from: Some(sel.worker),
        })
    }

    /// The end of [`RoutingPolicy::select`]: `best` overall, `best_ok` within bounds,
    /// `within` every candidate within bounds; near ties are broken on `anchor`.
    fn pick(
        &mut self,
        best: Option<Key>,
        best_ok: Option<Key>,
        within: &[Key],
        anchor: Option<u64>,
    ) -> Option<Selection> {
        let best = best?;
        // Every worker over its bound: the cheapest takes it.
        let Some(target) = best_ok else {
            self.mark_chosen(best.2);
            return Some(Selection::to(best.2));
        };

        // Pass 3: among the near ties of the target (within bounds), the highest
        // rendezvous score of the prompt's anchor among the `TIE_RING_REACH` nearest
        // at or after the anchor's point on the ring (the least recently chosen
        // without an anchor).
        let band = self.tie_band(target.0);
        let mut pick = target;
        match anchor {
            Some(a) => {
                let mut ties = std::mem::take(&mut self.ties);
                ties.clear();
                ties.extend(within.iter().filter(|k| k.0 <= target.0 + band));
                let point = ring_point(a);
                if ties.len() > TIE_RING_REACH {
                    ties.select_nth_unstable_by_key(TIE_RING_REACH - 1, |k| {
                        (k.3.wrapping_sub(point), k.2)
                    });
                    ties.truncate(TIE_RING_REACH);
                }
                let mut pick_score = None;
                for k in &ties {
                    let sc = rendezvous_score(a, k.3);
                    if pick_score.is_none_or(|p| sc > p || (sc == p && lt(k, &pick))) {
                        pick = *k;
                        pick_score = Some(sc);
                    }
                }
                self.ties = ties;
            }
            None => {
                let mut pick_score = u64::MAX - self.last_chosen(target.2);
                for k in within.iter().filter(|k| k.0 <= target.0 + band) {
                    let sc = u64::MAX - self.last_chosen(k.2);
                    if sc > pick_score || (sc == pick_score && lt(k, &pick)) {
                        pick = *k;
                        pick_score = sc;
                    }
                }
            }
        }
        self.mark_chosen(pick.2);
        Some(Selection {
            worker: pick.2,
            spilled_from: (best.2 != target.2).then_some(best.2),
        })
    }
}

/// The prompt's anchor: the chained hash of block `2^⌊log2 n⌋ − 1` of its `n` full
/// blocks (it covers at least half of them), `None` without a full block. Prompts that
/// differ only in a short tail share it; prompts that share less than half their
/// blocks do not.
pub fn prompt_anchor(hashes: &[kvfleet_core::BlockHash]) -> Option<u64> {
    anchor_block(hashes.len()).and_then(|at| hashes.get(at).map(|h| h.0))
}

/// The index of the anchor block among `blocks` full blocks: `2^⌊log2 blocks⌋ − 1`
/// (`None` for none). See [`prompt_anchor`].
pub fn anchor_block(blocks: usize) -> Option<usize> {
    (blocks > 0).then(|| (1usize << (usize::BITS - 1 - blocks.leading_zeros())) - 1)
}

/// Rendezvous (highest random weight) score of a worker for an anchor: every replica
/// computes the same from the worker's string-id hash.
pub fn rendezvous_score(anchor: u64, worker_id_hash: u64) -> u64 {
    mix64(anchor ^ mix64(worker_id_hash))
}

/// Tied workers a tie is decided among: those nearest at or after the anchor's point
/// on the ring of id hashes. On a fleet this small or smaller, every tied worker.
pub const TIE_RING_REACH: usize = 8;

/// An anchor's point on the ring of worker id hashes.
pub fn ring_point(anchor: u64) -> u64 {
    mix64(anchor ^ 0x6b76_666c_6565_7472)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::CandidateLoad;
    use crate::policy::PeerSource;
    use kvfleet_core::BlockHash;

    fn cand(i: u32, backlog: usize, active: usize, matched: usize) -> Candidate {
        Candidate {
            worker: WorkerIdx(i),
            id_hash: u64::from(i),
            load: CandidateLoad::new(active, backlog),
            matched_blocks: matched,
            running_blocks: 0,
            host_blocks: 0,
            disk_blocks: 0,
            kv_movable: true,
        }
    }

    fn ctx(candidates: &[Candidate], blocks: usize) -> RouteContext<'_> {
        let prompt_tokens = blocks * 16 + 1;
        let deepest_blocks = candidates
            .iter()
            .map(|c| c.matched_blocks)
            .max()
            .unwrap_or(0)
            .min(blocks);
        // As the router works it out: the soonest start among the deepest holders.
        let holder_wait_tokens = candidates
            .iter()
            .filter(|c| deepest_blocks > 0 && c.matched_blocks >= deepest_blocks)
            .map(|c| c.load.prefill_backlog_tokens() + prompt_tokens - deepest_blocks * 16)
            .min()
            .unwrap_or(0);
        RouteContext {
            hashes: &[],
            prompt_tokens,
            block_size: 16,
            candidates,
            fleet: FleetLoad::of(candidates),
            peer_source: None,
            deepest_blocks,
            // Every match computed: nothing pending.
            holder_wait_tokens,
        }
    }

    fn chain(seed: u64, n: usize) -> Vec<BlockHash> {
        (0..n as u64)
            .map(|i| BlockHash(mix64(seed ^ mix64(i + 1))))
            .collect()
    }

    /// `c` with `level` sixteenths of its KV pool in use.
    fn using(mut c: Candidate, level: u8) -> Candidate {
        c.load = c.load.with_usage_level(level);
        c
    }

    #[test]
    fn a_prompt_nobody_holds_goes_where_running_sequences_leave_the_pool_free() {
        // Two idle workers, one sequence each; w0's running sequences hold 12/16 of its
        // pool, w1's 2/16. 1,601 cold tokens: 1.5 × 1,601 + 16 plus the memory
        // price, 0.25 × 1,601 × 12/16 ≈ 300.2 on w0 against ≈ 50.0 on w1.
        let c = [using(cand(0, 0, 1, 0), 12), using(cand(1, 0, 1, 0), 2)];
        let mut p = CacheAware::default();
        let ctx = ctx(&c, 100);
        assert_eq!(p.select(&ctx).unwrap().worker, WorkerIdx(1));
        let cost = |i: usize| p.cost(&ctx, &c[i]);
        let price = 0.25 * 1_601.0 * 10.0 / 16.0;
        assert!(
            (cost(0) - cost(1) - price).abs() < 1e-6,
            "{} {}",
            cost(0),
            cost(1)
        );
        // Without the price the two tie (and the tie-break is w0's, by id hash).
        let off = CacheAware::new(CacheAwareConfig {
            memory_weight: 0.0,
            ..CacheAwareConfig::default()
        });
        assert_eq!(off.cost(&ctx, &c[0]), off.cost(&ctx, &c[1]));
    }

    #[test]
    fn a_prompt_that_computes_little_stays_with_its_prefix_in_a_full_pool() {
        // w0 holds 98 of 100 blocks but its pool is full of running sequences; w1 is
        // idle and empty. Computing 2 blocks (33 tokens) on w0 costs 0.9 × 33 + 16
        // plus at most 0.25 × 33 for its full pool (under 55); computing all 1,601
        // on w1 ends no wait and costs 1.5 × 1,601 ≈ 2,402.
        let c = [using(cand(0, 0, 1, 98), 16), cand(1, 0, 0, 0)];
        let mut p = CacheAware::default();
        assert_eq!(p.select(&ctx(&c, 100)).unwrap().worker, WorkerIdx(0));
    }

    /// Routes `prompts` in turn over idle, equal workers, counting each choice as one
    /// more running sequence there (as the router's in-flight bookkeeping does).
    fn route_in_turn(p: &mut CacheAware, workers: u32, prompts: &[Vec<BlockHash>]) -> Vec<u32> {
        let mut c: Vec<Candidate> = (0..workers).map(|i| cand(i, 0, 0, 0)).collect();
        prompts
            .iter()
            .map(|h| {
                let ctx = RouteContext {
                    hashes: h,
                    ..ctx(&c, h.len())
                };
                let w = p.select(&ctx).unwrap().worker.0;
                let l = c[w as usize].load;
                c[w as usize].load =
                    CandidateLoad::new(l.active_sequences() + 1, l.prefill_backlog_tokens());
                w
            })
            .collect()
    }

    #[test]
    fn cold_prompts_on_an_idle_fleet_spread_over_every_worker() {
        // Eight idle, equal workers and no cache anywhere: the old tie-break (fewer
        // sequences, then the lower index) sent each of these to w0.
        let c: Vec<Candidate> = (0..8).map(|i| cand(i, 0, 0, 0)).collect();
        let mut p = CacheAware::default();
        let chosen: std::collections::BTreeSet<u32> = (0..8)
            .map(|_| p.select(&ctx(&c, 100)).unwrap().worker.0)
            .collect();
        assert_eq!(chosen.len(), 8, "{chosen:?}");
        // With real prompts the anchors pick: eight different prompts on eight idle
        // workers still take one worker each.
        let prompts: Vec<Vec<BlockHash>> = (0..8).map(|s| chain(s, 100)).collect();
        let chosen: std::collections::BTreeSet<u32> =
            route_in_turn(&mut CacheAware::default(), 8, &prompts)
                .into_iter()
                .collect();
        assert_eq!(chosen.len(), 8, "{chosen:?}");
    }

    #[test]
    fn two_routers_put_cold_siblings_on_one_worker_and_spread_a_herd() {
        // Fork siblings: 120 shared blocks, then 1 to 5 blocks of their own. Each goes
        // to its own router replica (no shared state, no header), each of which has
        // routed a different number of unrelated prompts before: all pick the same
        // worker. (Choosing the least recently chosen worker split them.)
        let shared = chain(7, 120);
        let sibling = |k: u64| {
            let mut h = shared.clone();
            h.extend(chain(100 + k, 1 + k as usize % 5));
            h
        };
        let alone: Vec<u32> = (0..6u64)
            .map(|k| {
                let mut replica = CacheAware::default();
                let before: Vec<Vec<BlockHash>> = (0..k).map(|u| chain(500 + u, 30)).collect();
                route_in_turn(&mut replica, 8, &before);
                route_in_turn(&mut replica, 8, &[sibling(k)])[0]
            })
            .collect();
        assert!(alone.iter().all(|w| *w == alone[0]), "{alone:?}");
        // A herd: 64 conversations sharing a 40-block system prompt, each 100 blocks
        // long. Their anchors differ, so one router spreads them evenly over 8 idle
        // workers (the load bookkeeping breaks the remaining ties).
        let herd: Vec<Vec<BlockHash>> = (0..64)
            .map(|s| {
                let mut h = shared[..40].to_vec();
                h.extend(chain(1_000 + s, 60));
                h
            })
            .collect();
        let anchors: std::collections::BTreeSet<u64> =
            herd.iter().filter_map(|h| prompt_anchor(h)).collect();
        assert_eq!(anchors.len(), 64);
        let mut per = [0u32; 8];
        for w in route_in_turn(&mut CacheAware::default(), 8, &herd) {
            per[w as usize] += 1;
        }
        assert_eq!(per, [8; 8]);
    }

    #[test]
    fn a_tie_goes_to_the_best_rendezvous_score_among_the_ring_neighbours_of_the_anchor() {
        // 64 idle, equal workers with spread id hashes: every one ties.
        let c: Vec<Candidate> = (0..64)
            .map(|i| Candidate {
                id_hash: mix64(1_000 + i as u64),
                ..cand(i, 0, 0, 0)
            })
            .collect();
        // The best rendezvous score among `among` for `h`'s anchor, and the choice.
        let best_score = |among: &[&Candidate], h: &[BlockHash]| {
            let a = prompt_anchor(h).unwrap();
            among
                .iter()
                .max_by_key(|x| rendezvous_score(a, x.id_hash))
                .unwrap()
                .worker
        };
        let choose = |fleet: &[Candidate], h: &[BlockHash]| {
            let ctx = RouteContext {
                hashes: h,
                ..ctx(fleet, 40)
            };
            CacheAware::default().select(&ctx).unwrap().worker
        };
        let mut wins = std::collections::BTreeSet::new();
        for s in 0..200 {
            let h = chain(s, 40);
            let point = ring_point(prompt_anchor(&h).unwrap());
            // The 8 nearest at or after the point, then the highest score among them.
            let mut near: Vec<&Candidate> = c.iter().collect();
            near.sort_by_key(|x| x.id_hash.wrapping_sub(point));
            let got = choose(&c, &h);
            assert_eq!(got, best_score(&near[..TIE_RING_REACH], &h), "prompt {s}");
            wins.insert(got);
        }
        // Different anchors spread over most of the fleet.
        assert!(wins.len() > 40, "{}", wins.len());
        // With 8 tied workers or fewer it is plain rendezvous hashing.
        let few = &c[..TIE_RING_REACH];
        let h = chain(7, 40);
        let all: Vec<&Candidate> = few.iter().collect();
        assert_eq!(choose(few, &h), best_score(&all, &h));
    }

    #[test]
    fn the_anchor_covers_at_least_half_the_prompt() {
        let h = chain(3, 1_000);
        assert_eq!(prompt_anchor(&h[..0]), None);
        assert_eq!(prompt_anchor(&h[..1]), Some(h[0].0));
        assert_eq!(prompt_anchor(&h[..3]), Some(h[1].0));
        assert_eq!(prompt_anchor(&h[..511]), Some(h[255].0));
        assert_eq!(prompt_anchor(&h[..512]), Some(h[511].0));
        assert_eq!(prompt_anchor(&h[..1_000]), Some(h[511].0));
    }

    #[test]
    fn near_ties_never_override_a_real_cache_hit() {
        // w3 holds 90 of the 100 blocks: no amount of recency moves it elsewhere.
        let mut c: Vec<Candidate> = (0..8).map(|i| cand(i, 0, 0, 0)).collect();
        c[3].matched_blocks = 90;
        let mut p = CacheAware::default();
        for _ in 0..5 {
            assert_eq!(p.select(&ctx(&c, 100)).unwrap().worker, WorkerIdx(3));
        }
    }

    #[test]
    fn a_request_leaves_a_long_queue_behind_a_hot_prefix_for_an_idle_lane() {
        // w0 holds 60 of 100 blocks (1,601 prompt tokens, 641 uncached there); w5's
        // lane is idle.
        let prompt_blocks = 100;
        let route = |config: CacheAwareConfig, backlog: usize, others: usize| {
            let mut c: Vec<Candidate> = (0..8).map(|i| cand(i, others, 1, 0)).collect();
            c[0] = cand(0, backlog, 1, 60);
            c[5] = cand(5, 0, 1, 0);
            CacheAware::new(config)
                .select(&ctx(&c, prompt_blocks))
                .unwrap()
                .worker
        };
        let d = CacheAwareConfig::default();
        assert_eq!(
            (
                d.idle_prefill_weight,
                d.wait_ending_prefill_weight,
                d.wait_ending_ratio
            ),
            (1.5, 0.9, 0.7)
        );
        // A short queue: the wait there (400 + 641) is under 70% of a cold start on
        // w5 (1,121), so w5 pays the full idle weight (1.5 × 1,601) and the request
        // stays, saving 960 tokens of fleet work.
        assert_eq!(route(d.clone(), 400, 5_000), WorkerIdx(0));
        // A longer one (600 + 641): recomputing on w5 ends a wait, at 0.9 × 1,601 +
        // 16 = 1,457 against 600 + 2 × 641 + 16 = 1,898. It moves to the idle lane,
        // however busy the rest of the fleet is...
        assert_eq!(route(d.clone(), 600, 5_000), WorkerIdx(5));
        assert_ne!(route(d.clone(), 600, 0), WorkerIdx(0));
        // ...where without the discounts (idle weights = prefill weight) it waited.
        let flat = CacheAwareConfig {
            idle_prefill_weight: 2.0,
            wait_ending_prefill_weight: 2.0,
            ..d
        };
        assert_eq!(route(flat, 600, 5_000), WorkerIdx(0));
    }

    #[test]
    fn an_idle_lane_takes_no_short_prompt_from_a_holder_that_would_not_keep_it_waiting() {
        // An 8-block prompt (129 tokens) whose first 7 blocks w0 holds; w0's lane is
        // idle but it decodes 8 sequences, w1 is empty. Starting on w0 (17 tokens)
        // is sooner than a cold start on w1, so w1 ends no wait and pays the full
        // idle weight: 1.5 × 129 = 193.5 against 0.9 × 17 + 16 × 8 = 143.3.
        let c = [cand(0, 0, 8, 7), cand(1, 0, 0, 0)];
        let mut p = CacheAware::default();
        let cx = ctx(&c, 8);
        assert_eq!(cx.holder_wait_tokens, 17);
        assert_eq!(p.cost(&cx, &c[1]), 1.5 * 129.0);
        assert_eq!(p.select(&cx).unwrap().worker, WorkerIdx(0));
        // Behind 100 queued tokens w0 would start the request after 117, over 70% of
        // w1's cold start: w1 ends a wait and takes it (0.9 × 129 = 116.1 against
        // 100 + 2 × 17 + 128).
        let c = [cand(0, 100, 8, 7), cand(1, 0, 0, 0)];
        let cx = ctx(&c, 8);
        assert_eq!(p.cost(&cx, &c[1]), 0.9 * 129.0);
        assert_eq!(p.select(&cx).unwrap().worker, WorkerIdx(1));
    }

    #[test]
    fn a_busy_worker_pays_for_recomputing_what_a_busy_holder_has() {
        // w0 holds 60 of 100 blocks (1,601 prompt tokens) behind 4,000 queued
        // tokens; w1 holds nothing behind 100; no lane is idle. Without the duplicate
        // price the queue difference (3,900) outweighs the 960 cached tokens at
        // weight 2 and the request moves, recomputing the prefix on a busy lane; with
        // it w1 also pays 6 × 960 and the request stays.
        let c = vec![cand(0, 4_000, 1, 60), cand(1, 100, 1, 0)];
        let route = |dup: f64| {
            CacheAware::new(CacheAwareConfig {
                busy_duplicate_weight: dup,
                ..CacheAwareConfig::default()
            })
            .select(&ctx(&c, 100))
            .unwrap()
            .worker
        };
        assert_eq!(route(0.0), WorkerIdx(1));
        assert_eq!(
            route(CacheAwareConfig::default().busy_duplicate_weight),
            WorkerIdx(0)
        );
        // A much longer queue on the holder still moves it (the price is not a pin).
        let c = vec![cand(0, 20_000, 1, 60), cand(1, 100, 1, 0)];
        let p = CacheAware::default();
        let cx = ctx(&c, 100);
        assert_eq!(p.cost(&cx, &c[0]), 2.0 * 641.0 + 20_000.0 + 16.0);
        assert_eq!(
            p.cost(&cx, &c[1]),
            2.0 * 1_601.0 + 100.0 + 16.0 + 6.0 * 960.0
        );
        assert_eq!(
            CacheAware::default().select(&cx).unwrap().worker,
            WorkerIdx(1)
        );
        // An idle lane pays no duplicate price: it recomputes without delaying anyone,
        // and ends a wait (4,000 + 641 against 0.7 × 1,601).
        let c = vec![cand(0, 4_000, 1, 60), cand(1, 0, 1, 0)];
        let mut cx = ctx(&c, 100);
        assert_eq!(p.cost(&cx, &c[1]), 0.9 * 1_601.0 + 16.0);
        // Unless the prefix is still being computed on w0: recomputing it in parallel
        // would double that work, so the idle lane pays the full idle weight.
        cx.holder_wait_tokens = 0;
        assert_eq!(p.cost(&cx, &c[1]), 1.5 * 1_601.0 + 16.0);
    }

    #[test]
    fn a_fork_sibling_waits_for_its_first_siblings_prefix() {
        // w2 is computing the shared 2,000-block prefix (the first sibling); the
        // sibling's own tail is 10 blocks. At equal latency it stays on the holder:
        // an idle lane would recompute the prefix (1.5 × 32,161 against 32,000 queued
        // + 2 × 160 + 16).
        let mut c: Vec<Candidate> = (0..8).map(|i| cand(i, 0, 0, 0)).collect();
        c[2] = cand(2, 2_000 * 16, 1, 2_000);
        let mut p = CacheAware::default();
        let pending = RouteContext {
            holder_wait_tokens: 0,
            ..ctx(&c, 2_010)
        };
        assert_eq!(p.select(&pending).unwrap().worker, WorkerIdx(2));
        // The same queue in front of a prefix w2 has already computed is other work:
        // an idle lane starts sooner (0.9 × 32,161) and takes the request.
        assert_ne!(p.select(&ctx(&c, 2_010)).unwrap().worker, WorkerIdx(2));
    }

    /// `cache-aware` with the idle-wait trigger and pulls on, choosing among `c` for a
    /// 101-block prompt whose first 100 blocks w0 can hand over.
    fn select_idle_wait_pulling_from_w0(c: &[Candidate]) -> Selection {
        select_idle_wait_pulling(c, 101, 100, TierCostConfig::default())
    }

    /// The same for a `blocks`-block prompt whose first `held` blocks w0 can hand
    /// over, with `tiers` (pulls of 1 block or more).
    fn select_idle_wait_pulling(
        c: &[Candidate],
        blocks: usize,
        held: usize,
        tiers: TierCostConfig,
    ) -> Selection {
        let mut ctx = ctx(c, blocks);
        ctx.peer_source = Some(PeerSource {
            worker: WorkerIdx(0),
            blocks: held,
        });
        let mut p = CacheAware::new(CacheAwareConfig {
            pull_trigger: PullTrigger::IdleWait,
            tiers: TierCostConfig {
                peer_pull_min_blocks: 1,
                ..tiers
            },
            ..CacheAwareConfig::default()
        });
        p.select(&ctx).unwrap()
    }

    #[test]
    fn with_the_idle_wait_trigger_a_pull_only_ends_a_wait_past_a_cold_start() {
        // w0 holds 100 of 101 blocks (1,617 prompt tokens); w1's lane is idle but
        // decodes 30 sequences, so by cost alone (at most 0.9 × 1,617 + 16 × 30 =
        // 1,935) a request stays on w0 behind up to about 1,885 queued tokens.
        let route = |backlog: usize| {
            select_idle_wait_pulling_from_w0(&[cand(0, backlog, 1, 100), cand(1, 0, 30, 0)])
        };
        // 1,000 tokens queued: the wait there (1,017) is under a cold start on w1
        // (1,617), so it stays, where the `cost` trigger pulls to w1 (next test).
        assert_eq!(route(1_000).worker, WorkerIdx(0));
        // 1,800 queued: past a cold start; w1 pulls and starts in about 150 tokens.
        let sel = route(1_800);
        assert_eq!(sel.worker, WorkerIdx(1));
        assert_eq!(sel.spilled_from, Some(WorkerIdx(0)));
        // Without pulls the same trigger changes nothing.
        let c = vec![cand(0, 1_800, 1, 100), cand(1, 0, 30, 0)];
        let mut off = CacheAware::new(CacheAwareConfig {
            pull_trigger: PullTrigger::IdleWait,
            ..CacheAwareConfig::default()
        });
        assert_eq!(off.select(&ctx(&c, 101)).unwrap().worker, WorkerIdx(0));
    }

    #[test]
    fn the_idle_wait_trigger_counts_the_overhead_of_each_prefill_ahead() {
        // A fork child of 8 blocks (129 tokens): w0 holds 7 and is computing one short
        // prefill (16 tokens left) with another queued; w1's lane is idle. In tokens
        // alone the wait on w0 is 16 + 17 = 33, under a cold start on w1 (129); but
        // each prefill ahead also costs the engine 20 ms (160 tokens at 8,000/s), so
        // the child really waits 353: w1 pulls the 7 blocks and starts in about 26.
        let c = [
            Candidate {
                load: CandidateLoad::new(2, 16).with_prefills_ahead(2),
                ..cand(0, 16, 2, 7)
            },
            cand(1, 0, 0, 0),
        ];
        let route = |overhead_ms: f64| {
            let tiers = TierCostConfig {
                prefill_overhead_ms: overhead_ms,
                ..TierCostConfig::default()
            };
            select_idle_wait_pulling(&c, 8, 7, tiers)
        };
        let sel = route(20.0);
        assert_eq!(sel.worker, WorkerIdx(1));
        assert_eq!(sel.spilled_from, Some(WorkerIdx(0)));
        // Blind to the overhead, the trigger leaves it queued on w0.
        assert_eq!(route(0.0).worker, WorkerIdx(0));
    }

    #[test]
    fn the_idle_wait_trigger_never_pulls_onto_a_worker_over_its_load_bound() {
        // w0 holds 100 of 101 blocks behind 2,000 queued tokens: past a cold start, so
        // the trigger looks for an idle lane to pull to. w1's lane is idle, but it
        // decodes `active` sequences; w2 is busy.
        let route = |active: usize| {
            select_idle_wait_pulling_from_w0(&[
                cand(0, 2_000, 1, 100),
                cand(1, 0, active, 0),
                cand(2, 5_000, 1, 0),
            ])
            .worker
        };
        // 10 sequences: within (1.25 × 13 / 3 + 16 = 21.4); w1 pulls.
        assert_eq!(route(10), WorkerIdx(1));
        // 60: the bound is 1.25 × 63 / 3 + 16 = 42.25, and w1 would hold 61: the
        // request stays with the holder.
        assert_eq!(route(60), WorkerIdx(0));
    }

    #[test]
    fn with_peer_pulls_a_busy_holder_loses_to_an_idle_worker_that_pulls() {
        // w0 holds 100 of 101 blocks but has 1,000 tokens of prefill queued; w1 is
        // idle. Without pulls a cold start on w1 (1.5 × 1,617 = 2,426: w0's wait is
        // under 70% of it) loses to waiting on w0 (1,000 + 2 × 17 + 16 = 1,050). With
        // pulls at 8.4% of a recompute, w1 computes 17 tokens and pulls 100 blocks,
        // which ends the wait (0.9 × (17 + 0.084 × 1,600) ≈ 136): it wins.
        let c = vec![cand(0, 1_000, 1, 100), cand(1, 0, 0, 0)];
        let mut ctx = ctx(&c, 101);
        ctx.peer_source = Some(PeerSource {
            worker: WorkerIdx(0),
            blocks: 100,
        });
        let mut off = CacheAware::default();
        assert_eq!(off.select(&ctx).unwrap().worker, WorkerIdx(0));
        let mut on = CacheAware::new(CacheAwareConfig {
            pull_trigger: PullTrigger::Cost,
            tiers: TierCostConfig {
                peer_pull_min_blocks: 1,
                ..TierCostConfig::default()
            },
            ..CacheAwareConfig::default()
        });
        assert_eq!(on.pull_blocks(&ctx, &c[1]), 100);
        assert_eq!(
            on.pull_blocks(&ctx, &c[0]),
            0,
            "the holder pulls from nobody"
        );
        assert_eq!(on.select(&ctx).unwrap().worker, WorkerIdx(1));
        // An idle holder keeps it: pulling is never free.
        let idle = vec![cand(0, 0, 0, 100), cand(1, 0, 0, 0)];
        let mut ictx = ctx;
        ictx.candidates = &idle;
        assert_eq!(on.select(&ictx).unwrap().worker, WorkerIdx(0));
    }

    #[test]
    fn weights_from_json_keep_defaults_refuse_unknown_fields_and_bad_values() {
        let c: CacheAwareConfig =
            serde_json::from_str(r#"{"idle_prefill_weight": 1.2}"#).expect("one field");
        assert_eq!(c.idle_prefill_weight, 1.2);
        assert_eq!(c.prefill_weight, CacheAwareConfig::default().prefill_weight);
        assert_eq!(c.validate(), Ok(()));
        let e = serde_json::from_str::<CacheAwareConfig>(r#"{"idle_weight": 1.2}"#)
            .expect_err("unknown field");
        assert!(e.to_string().contains("idle_weight"), "{e}");
        let negative = CacheAwareConfig {
            memory_weight: -0.5,
            ..CacheAwareConfig::default()
        };
        let e = negative.validate().expect_err("negative weight");
        assert!(e.contains("memory_weight"), "{e}");
        let nan = CacheAwareConfig {
            wait_ending_ratio: f64::NAN,
            ..CacheAwareConfig::default()
        };
        assert!(nan
            .validate()
            .expect_err("NaN")
            .contains("wait_ending_ratio"));
    }
}
