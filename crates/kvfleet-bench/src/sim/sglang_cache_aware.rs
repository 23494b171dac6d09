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
//! Here prompts are chains of block hashes, so the tree is a set of chained hashes
//! (equivalent to a radix tree over blocks) with LRU trimming, and lengths count
//! blocks instead of characters.

use super::lru::LruBlockCache;
use super::{RouteReq, SimRouter, SimWorker};
use serde::{Deserialize, Serialize};

/// SGLang `cache_aware` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
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
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_blocks: (1 << 26) / 4 / 512,
        }
    }
}

/// The SGLang `cache_aware` baseline.
pub struct SglangCacheAware {
    config: SglangConfig,
    trees: Vec<LruBlockCache>,
}

impl SglangCacheAware {
    /// A router for `workers` workers.
    pub fn new(config: SglangConfig, workers: usize) -> Self {
        let trees = (0..workers)
            .map(|_| LruBlockCache::new(config.max_tree_blocks))
            .collect();
        Self { config, trees }
    }
}

impl SimRouter for SglangCacheAware {
    fn route(&mut self, req: &RouteReq<'_>, workers: &[SimWorker], _now_ms: f64) -> (usize, usize) {
        let loads = workers.iter().map(|w| w.inflight);
        let max = loads.clone().max().unwrap_or(0);
        let min = loads.min().unwrap_or(0);
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold;
        let chosen = if imbalanced {
            argmin(workers.iter().map(|w| w.inflight))
        } else {
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
