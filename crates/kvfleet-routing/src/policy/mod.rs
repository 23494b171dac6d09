//! Routing policies: given a request's prefix matches and every candidate's load,
//! pick a worker.
//!
//! All policies implement [`RoutingPolicy`] and see the same [`RouteContext`]; the
//! router holds one instance of each and picks one per request by [`PolicyKind`]
//! (per deployment, or per request through the `x-kvfleet-policy` header).
//!
//! - [`CacheAware`] (`cache-aware`, ours): lowest estimated cost of uncached prefill,
//!   prefill backlog and decode load, with a bounded-load guard.
//! - [`RoundRobin`] (`round-robin`), [`LeastLoaded`] (`least-loaded`),
//!   [`ConsistentHash`] (`consistent-hash`, with bounded loads), [`RandomPolicy`]
//!   (`random`, seeded): baselines, also useful when cache affinity does not matter.

mod cache_aware;
mod consistent_hash;
mod least_loaded;
mod random;
mod round_robin;
mod tier_cost;

pub use cache_aware::{
    anchor_block, non_negative, prompt_anchor, rendezvous_score, ring_point, CacheAware,
    CacheAwareConfig, PullTrigger, TIE_RING_REACH,
};
pub use consistent_hash::{ConsistentHash, ConsistentHashConfig};
pub use least_loaded::LeastLoaded;
pub use random::RandomPolicy;
pub use round_robin::RoundRobin;
pub use tier_cost::{
    default_peer_pull_min_blocks, TierCostConfig, TierScoring, DEFAULT_PEER_PULL_MIN_TOKENS,
};

use crate::load::CandidateLoad;
use crate::registry::WorkerIdx;
use kvfleet_core::BlockHash;
use serde::{Deserialize, Serialize};

/// One worker a request may go to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerIdx,
    /// A hash of the worker's string id, identical in every router replica (used by
    /// consistent hashing, where indices would differ between replicas).
    pub id_hash: u64,
    /// The worker's load, including this router's in-flight work.
    pub load: CandidateLoad,
    /// Blocks of the request's prompt the worker holds or will hold in its device pool
    /// (index plus pending reservations), already capped at the blocks a request can
    /// reuse.
    pub matched_blocks: usize,
    /// Leading blocks of the prompt that requests this router sent the worker, and
    /// that have not ended, share with it (at most `matched_blocks`): its running
    /// sequences hold them, or will once the queued ones start, so its free pool need
    /// not hold them to admit the prompt ([`RouteContext::admit_blocks_on`]).
    pub running_blocks: usize,
    /// Blocks after those the worker holds in its host tier (capped likewise).
    pub host_blocks: usize,
    /// Blocks after those the worker holds on disk only (capped likewise).
    pub disk_blocks: usize,
    /// Whether the worker can import a peer's blocks (it reports KV block bytes; a
    /// simulated engine does not): only then is it a pull target.
    pub kv_movable: bool,
}

/// Everything a policy may look at to route one request.
#[derive(Clone, Copy, Debug)]
pub struct RouteContext<'a> {
    /// Chained hashes of the prompt's full blocks.
    pub hashes: &'a [BlockHash],
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The workers to choose from, sorted by index; never empty when a policy runs.
    /// For `cache-aware` on a large fleet these are only the workers that can win:
    /// those matching the prompt unlike the rest, and the cheapest of each large group
    /// of equally matched ones (see [`crate::load_order`]).
    pub candidates: &'a [Candidate],
    /// The fleet the bounded-load rules compare with: every worker that could take the
    /// request, including those not in `candidates`.
    pub fleet: FleetLoad,
    /// The worker a chosen one could pull the prompt's prefix from, when peer pulls
    /// are on (see [`TierCostConfig::peer_pull_min_blocks`]).
    pub peer_source: Option<PeerSource>,
    /// The most leading device blocks of the prompt any worker holds or is computing
    /// (its reservations included), capped at the blocks a request can reuse; over
    /// every worker the request may use, not only `candidates` (a fenced worker, or
    /// one a retry failed on, does not count: its copy is going away or out of reach).
    pub deepest_blocks: usize,
    /// The wait for the prompt's holder that a cold start elsewhere could end, in
    /// tokens: the soonest a worker the request may use that holds its
    /// `deepest_blocks` would start its first token (its prefill backlog plus the
    /// prompt tokens it lacks). 0 when nobody holds any of the prompt, and while its
    /// deepest prefix is still being computed (a live reservation, a sibling routed
    /// there, reaches deeper than any reported copy): that queue is the prefix itself,
    /// no wait to end. The router works it out for `cache-aware` only.
    pub holder_wait_tokens: usize,
}

/// Workers, their active sequences and their KV pools' use, for load bounds and
/// prices relative to the fleet's mean.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetLoad {
    /// Workers.
    pub workers: usize,
    /// Active sequences over them.
    pub active_sequences: usize,
    /// Their pools' usage levels ([`crate::USAGE_LEVELS`] ths in use), summed.
    pub usage_levels: usize,
}

impl FleetLoad {
    /// The fleet of `candidates`.
    pub fn of(candidates: &[Candidate]) -> Self {
        Self {
            workers: candidates.len(),
            active_sequences: total_active(candidates),
            usage_levels: candidates
                .iter()
                .map(|c| usize::from(c.load.usage_level()))
                .sum(),
        }
    }

    /// The share of the mean worker's KV pool in use, in `[0, 1]` (0 for no workers).
    pub fn mean_usage(&self) -> f64 {
        if self.workers == 0 {
            return 0.0;
        }
        self.usage_levels as f64 / (self.workers as f64 * f64::from(crate::USAGE_LEVELS))
    }
}

/// The worker holding the longest prefix of a prompt that it can hand to a peer
/// (device and host blocks the index confirms, not pending reservations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerSource {
    /// The holder.
    pub worker: WorkerIdx,
    /// Its leading blocks of the prompt, capped at the blocks a request can reuse.
    pub blocks: usize,
}

impl RouteContext<'_> {
    /// Prompt tokens `c` would serve from cache, in any tier.
    pub fn cached_tokens(&self, c: &Candidate) -> usize {
        (c.matched_blocks + c.host_blocks + c.disk_blocks)
            .saturating_mul(self.block_size)
            .min(self.prompt_tokens)
    }

    /// Blocks a worker's admission headroom must hold for it to start the request at
    /// once, were no running sequence holding any of it: the whole prompt, since the
    /// free pool must hold every block no running sequence holds, cached or not.
    #[inline]
    pub fn admit_blocks(&self) -> usize {
        admit_blocks(self.prompt_tokens, self.block_size)
    }

    /// Blocks `c`'s admission headroom must hold for it to start the request at once
    /// ([`CandidateLoad::admits`](crate::load::CandidateLoad::admits)); see
    /// [`admit_need`].
    #[inline]
    pub fn admit_blocks_on(&self, c: &Candidate) -> usize {
        admit_need(self.admit_blocks(), &c.load, c.running_blocks)
    }

    /// Prompt tokens `c` would have to compute.
    pub fn uncached_tokens(&self, c: &Candidate) -> usize {
        self.prompt_tokens - self.cached_tokens(c)
    }

    /// Blocks `c` would pull from [`Self::peer_source`]: those after everything `c`
    /// holds itself, when the source is another worker ahead by at least
    /// `min_blocks` (0 otherwise, and always 0 with `min_blocks` 0).
    pub fn pull_blocks(&self, c: &Candidate, min_blocks: usize) -> usize {
        self.peer_source
            .map_or(0, |src| src.pull_blocks(c, min_blocks))
    }
}

impl PeerSource {
    /// Blocks `c` would pull from this source: those after everything `c` holds
    /// itself, when the source is another worker ahead by at least `min_blocks` and
    /// `c` can import blocks (0 otherwise, and always 0 with `min_blocks` 0).
    pub fn pull_blocks(&self, c: &Candidate, min_blocks: usize) -> usize {
        let have = c.matched_blocks + c.host_blocks + c.disk_blocks;
        if min_blocks == 0
            || !c.kv_movable
            || self.worker == c.worker
            || self.blocks < have + min_blocks
        {
            return 0;
        }
        self.blocks - have
    }
}

/// A policy's choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The chosen worker.
    pub worker: WorkerIdx,
    /// The worker the policy preferred but skipped because it was over its load
    /// bound (a "spill"), if any.
    pub spilled_from: Option<WorkerIdx>,
}

impl Selection {
    /// A plain choice, without a spill.
    pub fn to(worker: WorkerIdx) -> Self {
        Self {
            worker,
            spilled_from: None,
        }
    }
}

/// A routing policy.
pub trait RoutingPolicy {
    /// The policy's name, as accepted by [`PolicyKind`]'s `FromStr`.
    fn name(&self) -> &'static str;

    /// Picks a worker among `ctx.candidates`; `None` only when there is none.
    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection>;
}

/// The policies a router offers, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Prefix-cache-aware cost minimisation with bounded load (the default).
    #[default]
    CacheAware,
    /// Each worker in turn.
    RoundRobin,
    /// Fewest active sequences, then smallest prefill backlog.
    LeastLoaded,
    /// Hash of the prompt's first blocks on a ring, with bounded loads.
    ConsistentHash,
    /// Uniformly random (seeded, reproducible).
    Random,
}

impl PolicyKind {
    /// Every policy, in documentation order.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::CacheAware,
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoaded,
        PolicyKind::ConsistentHash,
        PolicyKind::Random,
    ];

    /// The policy's name: `cache-aware`, `round-robin`, `least-loaded`,
    /// `consistent-hash` or `random`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache-aware",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::ConsistentHash => "consistent-hash",
            PolicyKind::Random => "random",
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is not one of [`PolicyKind::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing policy {given:?}; valid policies: cache-aware, round-robin, least-loaded, consistent-hash, random")]
pub struct ParsePolicyError {
    /// The name that was given.
    pub given: String,
}

impl std::str::FromStr for PolicyKind {
    type Err = ParsePolicyError;

    /// Parses a policy name, ignoring ASCII case, surrounding spaces, and `_` for `-`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == norm)
            .ok_or_else(|| ParsePolicyError {
                given: s.to_owned(),
            })
    }
}

/// A 64-bit hash of a string that every router replica computes identically
/// (FNV-1a, then a SplitMix64 finaliser for avalanche).
pub fn stable_str_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// SplitMix64's finaliser: a bijective avalanche mix of a 64-bit value.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Total sequences over `candidates`, used by the bounded-load rules.
fn total_active(candidates: &[Candidate]) -> usize {
    candidates.iter().map(|c| c.load.active_sequences()).sum()
}

/// The blocks a worker's admission headroom must hold to start a prompt of
/// `prompt_tokens` at once ([`RouteContext::admit_blocks`]).
pub fn admit_blocks(prompt_tokens: usize, block_size: usize) -> usize {
    prompt_tokens.div_ceil(block_size.max(1))
}

/// The blocks the admission headroom of a worker with `load` must hold to start a
/// prompt of `admit_blocks` blocks, `running` of whose leading blocks requests this
/// router sent there and that have not ended share ([`Candidate::running_blocks`]).
///
/// With nothing queued, its running sequences hold those blocks, so its free pool
/// need not: the need is the rest of the prompt. (Another router's requests are
/// unknown here, so the need errs high.) With prefills queued, those take the free
/// blocks first, in numbers the router does not know, and the whole prompt stands in
/// for the need: in `kvfleet bench sweep`'s engine-faithful mode, subtracting the
/// queue's needs from the reported headroom instead moved `conversation` turns off
/// their holders (hit target met in 41 of 63 groups, against 45), and counting the
/// running blocks on a busy lane too made fork children queue behind their siblings
/// (avoidable waits 484 → 1,303; docs/policy-sweep.head.md, 2026-12-07, late night).
#[inline]
pub fn admit_need(admit_blocks: usize, load: &CandidateLoad, running: usize) -> usize {
    if load.prefill_backlog_tokens() > 0 {
        admit_blocks
    } else {
        admit_blocks.saturating_sub(running)
    }
}

/// Of `running` blocks ([`Candidate::running_blocks`]), those that change a decision:
/// all of them where they let a worker with `load` admit a prompt of `admit_blocks`
/// blocks that it could not admit were they not held ([`admit_need`]), none elsewhere,
/// where they change no price. Counting only these keeps the workers whose running
/// chains change nothing in one match class, so the load order's walk stays as short
/// as without them.
#[inline]
pub fn running_that_admits(admit_blocks: usize, load: &CandidateLoad, running: usize) -> usize {
    if running > 0
        && !load.admits(admit_blocks)
        && load.admits(admit_need(admit_blocks, load, running))
    {
        running
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_parse_and_print() {
        for k in PolicyKind::ALL {
            assert_eq!(k.as_str().parse::<PolicyKind>(), Ok(k));
            assert_eq!(k.to_string(), k.as_str());
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.as_str()));
        }
        assert_eq!(
            " Cache_Aware ".parse::<PolicyKind>(),
            Ok(PolicyKind::CacheAware)
        );
        let err = "fastest".parse::<PolicyKind>().unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("\"fastest\""), "{msg}");
        for k in PolicyKind::ALL {
            assert!(msg.contains(k.as_str()), "{msg}");
        }
        assert_eq!(PolicyKind::default(), PolicyKind::CacheAware);
    }

    #[test]
    fn stable_hash_is_stable() {
        // Pinned: replicas and releases must agree on ring positions.
        assert_eq!(stable_str_hash("worker-0"), stable_str_hash("worker-0"));
        assert_ne!(stable_str_hash("worker-0"), stable_str_hash("worker-1"));
        assert_eq!(mix64(0), 0);
    }
}
