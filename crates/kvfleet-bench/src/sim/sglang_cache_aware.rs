//! Baseline: SGLang router's `cache_aware` policy, re-implemented from its public
//! documentation (sgl-router, `--policy cache_aware`).
//!
//! The router keeps one *approximate* radix tree per worker of the prompts it sent
//! there (not the worker's real cache: it never hears about evictions, only trims
//! its own trees when they exceed `max_tree_size`). For each request:
//!
//! 1. If the load is imbalanced — `max − min > balance_abs_threshold` **and**
//!    `max > min × balance_rel_threshold`, load being each worker's pending requests —
//!    route to the worker with the fewest pending requests (shortest queue).
//! 2. Otherwise find the worker whose tree matches the longest prefix; if
//!    `matched / prompt length > cache_threshold`, route there; else route to the
//!    worker with the smallest tree (the most cache room).
//!
//! Either way the prompt is inserted into the chosen worker's tree. Defaults:
//! cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5.
//!
//! The `spill` variant ([`SglangConfig::spill`]) replaces step 1 with SGLang's newer
//! per-worker rule: the worker step 2 picks *spills* to the one with the fewest pending
//! requests when its own load exceeds both `balance_rel_threshold × mean` and
//! `mean + balance_abs_threshold`, the mean taken over all workers.
//! Here prompts are chains of block hashes, so the tree is a set of chained hashes
//! (equivalent to a radix tree over blocks) with LRU trimming, and lengths count
//! blocks instead of characters.
//!
//! [`SglangConfig::idle_guard`] is not SGLang's: it is an experiment that asks how much
//! of the rule's hit ratio comes from making requests wait. With it, a request whose
//! chosen worker would start it later than the soonest idle prefill lane goes to that
//! lane instead, so the rule's choices cause no avoidable wait (the sweep's `idle`
//! target) as `cache-aware`'s must not (docs/policy-sweep.head.md, 2026-12-07).

use super::lru::LruBlockCache;
use super::{RouteReq, SimRouter, SimWorker};
use serde::{Deserialize, Serialize};

/// SGLang `cache_aware` settings (JSON with `kvfleet sim --sglang-config`; an unknown
/// field is an error).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangConfig {
    /// Minimum prefix match ratio to follow the cache (0.3).
    pub cache_threshold: f64,
    /// Absolute pending-request gap that means imbalance (64).
    pub balance_abs_threshold: usize,
    /// Relative pending-request ratio that means imbalance (1.5).
    pub balance_rel_threshold: f64,
    /// Tree size cap per worker, in blocks: SGLang's `max_tree_size` of 2^26
    /// characters at ~4 characters per token, in 512-token blocks.
    pub max_tree_blocks: usize,
    /// The per-worker spill rule instead of the fleet-wide imbalance check.
    pub spill: bool,
    /// Not SGLang's (see the module docs): send the request to the idle prefill lane
    /// that would start it soonest when that is sooner than the rule's choice.
    pub idle_guard: bool,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_blocks: (1 << 26) / 4 / 512,
            spill: false,
            idle_guard: false,
        }
    }
}

impl SglangConfig {
    /// Checks that the thresholds are finite numbers of at least 0; the error names
    /// the first that is not.
    pub fn validate(&self) -> Result<(), String> {
        kvfleet_routing::policy::non_negative(
            "sglang",
            &[
                ("cache_threshold", self.cache_threshold),
                ("balance_rel_threshold", self.balance_rel_threshold),
            ],
        )
    }
}

/// The SGLang `cache_aware` baseline.
pub struct SglangCacheAware {
    config: SglangConfig,
    trees: Vec<LruBlockCache>,
    /// The fixed overhead of one prefill, in prompt tokens (for the idle guard).
    overhead_tokens: f64,
}

impl SglangCacheAware {
    /// A router for `workers` workers; `overhead_tokens` is the fixed cost of one
    /// prefill in prompt tokens (the cost model's), which the idle guard counts for
    /// each prefill queued ahead.
    pub fn new(config: SglangConfig, workers: usize, overhead_tokens: f64) -> Self {
        let trees = (0..workers)
            .map(|_| LruBlockCache::new(config.max_tree_blocks))
            .collect();
        Self {
            config,
            trees,
            overhead_tokens,
        }
    }

    /// [`SglangConfig::idle_guard`]: the idle prefill lane that would start `req`
    /// soonest, if that is sooner than `chosen` would, in prompt-token equivalents
    /// (the prefill left on the lane, each queued prefill's fixed overhead, and the
    /// prompt tokens the worker lacks).
    fn sooner_idle_lane(
        &self,
        req: &RouteReq<'_>,
        workers: &[SimWorker],
        chosen: usize,
        now_ms: f64,
    ) -> Option<usize> {
        let start = |w: &SimWorker| {
            let ahead = w.queue.len() + usize::from(w.prefilling.is_some());
            let lacks = req
                .input_tokens
                .saturating_sub(w.lru.match_prefix(req.hashes) * req.block_size);
            w.prefill_backlog_at(now_ms) as f64 + self.overhead_tokens * ahead as f64 + lacks as f64
        };
        let here = start(&workers[chosen]);
        workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.lane_idle())
            .map(|(k, w)| (k, start(w)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .filter(|&(_, t)| t < here)
            .map(|(k, _)| k)
    }
}

impl SimRouter for SglangCacheAware {
    fn route(&mut self, req: &RouteReq<'_>, workers: &[SimWorker], now_ms: f64) -> (usize, usize) {
        let loads = workers.iter().map(|w| w.inflight);
        let least_loaded = || argmin(workers.iter().map(|w| w.inflight));
        let (abs, rel) = (
            self.config.balance_abs_threshold,
            self.config.balance_rel_threshold,
        );
        let by_cache = || {
            let matches = self.trees.iter().map(|t| t.match_prefix(req.hashes));
            let best = argmax(matches.clone());
            let best_len = matches.clone().nth(best).unwrap_or(0);
            let ratio = best_len as f64 / req.hashes.len().max(1) as f64;
            if ratio > self.config.cache_threshold {
                best
            } else {
                argmin(self.trees.iter().map(LruBlockCache::len))
            }
        };
        let chosen = if self.config.spill {
            let mean = loads.sum::<usize>() as f64 / workers.len().max(1) as f64;
            let pick = by_cache();
            let load = workers[pick].inflight as f64;
            if load > rel * mean && load > mean + abs as f64 {
                least_loaded()
            } else {
                pick
            }
        } else {
            let max = loads.clone().max().unwrap_or(0);
            let min = loads.min().unwrap_or(0);
            if max - min > abs && max as f64 > min as f64 * rel {
                least_loaded()
            } else {
                by_cache()
            }
        };
        let chosen = if self.config.idle_guard {
            self.sooner_idle_lane(req, workers, chosen, now_ms)
                .unwrap_or(chosen)
        } else {
            chosen
        };
        self.trees[chosen].insert_chain(req.hashes);
        (chosen, 0)
    }
}

/// Index of the first smallest value.
pub(crate) fn argmin(it: impl Iterator<Item = usize>) -> usize {
    let mut best = (usize::MAX, 0);
    for (i, v) in it.enumerate() {
        if v < best.0 {
            best = (v, i);
        }
    }
    best.1
}

/// Index of the first largest value.
pub(crate) fn argmax(it: impl Iterator<Item = usize>) -> usize {
    let mut best: Option<(usize, usize)> = None;
    for (i, v) in it.enumerate() {
        if best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i));
        }
    }
    best.map_or(0, |b| b.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::BlockHash;

    /// Four workers; worker 0 has seen the prompt and holds `load` requests, the others
    /// `others` each.
    fn route(spill: bool, load: usize, others: usize) -> usize {
        let prompt: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let req = RouteReq {
            hashes: &prompt,
            input_tokens: 64,
            block_size: 16,
        };
        let mut workers: Vec<SimWorker> = (0..4).map(|_| SimWorker::new(100, 0, 0)).collect();
        for (i, w) in workers.iter_mut().enumerate() {
            w.inflight = if i == 0 { load } else { others };
        }
        let mut r = SglangCacheAware::new(
            SglangConfig {
                spill,
                ..SglangConfig::default()
            },
            4,
            0.0,
        );
        r.trees[0].insert_chain(&prompt);
        r.route(&req, &workers, 0.0).0
    }

    #[test]
    fn the_idle_guard_sends_a_request_to_an_idle_lane_only_where_it_starts_sooner() {
        let prompt: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let req = RouteReq {
            hashes: &prompt,
            input_tokens: 64,
            block_size: 16,
        };
        // Worker 0 holds the prompt (its tree and its pool) behind `backlog` queued
        // prompt tokens; the others are idle and hold nothing.
        let route = |idle_guard: bool, backlog: usize| {
            let mut workers: Vec<SimWorker> = (0..4).map(|_| SimWorker::new(100, 0, 0)).collect();
            workers[0].lru.insert_chain(&prompt);
            workers[0].queue.push_back(99);
            workers[0].queued_prefill_tokens = backlog;
            let mut r = SglangCacheAware::new(
                SglangConfig {
                    spill: true,
                    idle_guard,
                    ..SglangConfig::default()
                },
                4,
                0.0,
            );
            r.trees[0].insert_chain(&prompt);
            r.route(&req, &workers, 0.0).0
        };
        // SGLang's rule keeps it on its prefix whatever the queue there.
        assert_eq!(route(false, 1_000), 0);
        // 1,000 tokens of queue against a 64-token cold start: the first idle lane.
        assert_eq!(route(true, 1_000), 1);
        // 30 tokens of queue and nothing to compute beat the cold start: it stays.
        assert_eq!(route(true, 30), 0);
    }

    #[test]
    fn the_spill_rule_judges_the_matched_worker_against_the_mean() {
        // Loads 100, 40, 40, 40: mean 55; 100 > 1.5 × 55 and > 55 + 64 fails (119), so
        // the matched worker keeps the request under the spill rule, while the global
        // rule (100 − 40 > 64 fails too) also keeps it.
        assert_eq!(route(true, 100, 40), 0);
        assert_eq!(route(false, 100, 40), 0);
        // Loads 200, 100, 100, 100: mean 125; 200 > 187.5 and > 189 → spills. The global
        // rule: 200 − 100 > 64 and 200 > 150 → least loaded too.
        assert_eq!(route(true, 200, 100), 1);
        assert_eq!(route(false, 200, 100), 1);
        // Loads 70, 0, 0, 0: mean 17.5; 70 > 26.25 but not > 81.5 → stays under the spill
        // rule, where the global rule (70 − 0 > 64 and 70 > 0) moves it.
        assert_eq!(route(true, 70, 0), 0);
        assert_eq!(route(false, 70, 0), 1);
    }
}
