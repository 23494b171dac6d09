//! `cache-aware`: kvfleet's policy. Send a request where its estimated cost is lowest,
//! counting the prefix a worker already holds (or is computing), but never pile
//! unbounded work onto the holder of a hot prefix.
//!
//! Estimated cost of worker `W`, in prompt-token equivalents:
//!
//! ```text
//! cost(W) = prefill_weight × uncached(W)            // this request's prefill on W
//!         + backlog(W)                              // prefill queued ahead of it
//!         + decode_cost_per_sequence × active(W)    // decode work sharing W's steps
//! ```
//!
//! `prefill_weight` is above 1 (default 2) because an uncached token costs twice: it
//! delays this request, and it spends fleet capacity that a cache hit would not. With
//! a weight of 1 a fork sibling would be indifferent between waiting behind its first
//! sibling's prefix on `W` and recomputing the whole prefix elsewhere — equal latency,
//! but double the fleet's work.
//!
//! Bounded-load guard: a worker is skipped in favour of the next cheapest when its
//! active sequences after taking the request would exceed
//! `(1 + balance_epsilon) × mean + balance_slack` (the mean including the request), or
//! when its backlog plus this request's prefill would exceed
//! `max_prefill_backlog_tokens`. The slack keeps a fork family together on its
//! holder while loads are small; the relative bound stops one hot prefix from growing a
//! worker's load without limit. The worker it spills to then holds a second copy of the
//! prefix, and later requests for it see both. If every worker is over its bound, the
//! cheapest is used. Ties go to fewer active sequences, then to the lower index.

use super::{Candidate, RouteContext, RoutingPolicy, Selection};
use crate::registry::WorkerIdx;
use serde::{Deserialize, Serialize};

/// (cost, active sequences, worker): the order in which candidates are preferred.
type Key = (f64, usize, WorkerIdx);

/// Weights and bounds of [`CacheAware`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CacheAwareConfig {
    /// Cost of one uncached prompt token on the chosen worker (default 2.0).
    pub prefill_weight: f64,
    /// Cost of one active sequence on the worker, in prompt-token equivalents
    /// (default 16.0).
    pub decode_cost_per_sequence: f64,
    /// Relative slack of the load bound over the mean (default 0.25).
    pub balance_epsilon: f64,
    /// Absolute slack of the load bound, in sequences (default 16).
    pub balance_slack: f64,
    /// Cap on a worker's prefill backlog including this request, in tokens
    /// (default: none).
    pub max_prefill_backlog_tokens: Option<usize>,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            prefill_weight: 2.0,
            decode_cost_per_sequence: 16.0,
            balance_epsilon: 0.25,
            balance_slack: 16.0,
            max_prefill_backlog_tokens: None,
        }
    }
}

/// The cache-aware policy; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct CacheAware {
    config: CacheAwareConfig,
}

impl CacheAware {
    /// A policy with the given weights.
    pub fn new(config: CacheAwareConfig) -> Self {
        Self { config }
    }

    /// The policy's weights.
    pub fn config(&self) -> &CacheAwareConfig {
        &self.config
    }

    /// Estimated cost of sending the request of `ctx` to `c`.
    pub fn cost(&self, ctx: &RouteContext<'_>, c: &Candidate) -> f64 {
        self.config.prefill_weight * ctx.uncached_tokens(c) as f64
            + c.load.prefill_backlog_tokens() as f64
            + self.config.decode_cost_per_sequence * c.load.active_sequences() as f64
    }
}

impl RoutingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection> {
        let n = ctx.candidates.len();
        let (wp, wd) = (
            self.config.prefill_weight,
            self.config.decode_cost_per_sequence,
        );
        let key = |c: &Candidate| -> Key {
            let active = c.load.active_sequences();
            let cost = wp * ctx.uncached_tokens(c) as f64
                + c.load.prefill_backlog_tokens() as f64
                + wd * active as f64;
            (cost, active, c.worker)
        };
        // Candidates are ordered by (cost, active sequences, index): plain `<` on the
        // cost with an exact-tie fallback keeps this hot loop branch-light.
        let lt = |a: &Key, b: &Key| a.0 < b.0 || (a.0 == b.0 && (a.1, a.2) < (b.1, b.2));

        // Pass 1: the cheapest worker, and the total load the bound needs.
        let mut total = 0usize;
        let mut best: Option<(Key, &Candidate)> = None;
        for c in ctx.candidates {
            let k = key(c);
            total += k.1;
            if best.as_ref().is_none_or(|(b, _)| lt(&k, b)) {
                best = Some((k, c));
            }
        }
        let (best_key, best_c) = best?;
        let bound = (1.0 + self.config.balance_epsilon) * (total + 1) as f64 / n as f64
            + self.config.balance_slack;
        let cap = self.config.max_prefill_backlog_tokens.unwrap_or(usize::MAX);
        let overloaded = |k: &Key, c: &Candidate| {
            (k.1 + 1) as f64 > bound
                || c.load
                    .prefill_backlog_tokens()
                    .saturating_add(ctx.uncached_tokens(c))
                    > cap
        };
        if !overloaded(&best_key, best_c) {
            return Some(Selection::to(best_key.2));
        }
        // Pass 2 (rare): the cheapest worker within its bounds; if none is, the
        // cheapest overall.
        let mut best_ok: Option<Key> = None;
        for c in ctx.candidates {
            let k = key(c);
            if !overloaded(&k, c) && best_ok.as_ref().is_none_or(|b| lt(&k, b)) {
                best_ok = Some(k);
            }
        }
        Some(match best_ok {
            Some(ok) => Selection {
                worker: ok.2,
                spilled_from: Some(best_key.2),
            },
            None => Selection::to(best_key.2),
        })
    }
}
