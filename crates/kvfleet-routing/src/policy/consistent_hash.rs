//! `consistent-hash`: the prompt's first blocks pick a point on a hash ring of virtual
//! nodes, with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing
//! with Bounded Loads", 2018).
//!
//! The key is the chained hash of block `min(key_blocks, n) - 1`, which already covers
//! every block before it, so requests sharing their first `key_blocks` blocks share a
//! key. Ring points come from the workers' string ids, not their indices, so every
//! router replica builds the same ring. Walking clockwise from the key, the first
//! worker whose active sequences stay within `⌈(1 + ε) × (total + 1) / n⌉` after taking
//! the request wins; such a worker always exists.

use super::{mix64, total_active, RouteContext, RoutingPolicy, Selection};
use crate::registry::WorkerIdx;
use serde::{Deserialize, Serialize};

/// Ring shape and load bound of [`ConsistentHash`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConsistentHashConfig {
    /// Ring points per worker (default 64).
    pub virtual_nodes: usize,
    /// Leading blocks that form the key (default 4, i.e. 64 tokens at block size 16).
    pub key_blocks: usize,
    /// Load bound slack ε (default 0.25).
    pub epsilon: f64,
}

impl Default for ConsistentHashConfig {
    fn default() -> Self {
        Self {
            virtual_nodes: 64,
            key_blocks: 4,
            epsilon: 0.25,
        }
    }
}

/// The consistent-hashing policy; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct ConsistentHash {
    config: ConsistentHashConfig,
    // The membership the ring was built for; rebuilt when candidates differ.
    members: Vec<(WorkerIdx, u64)>,
    ring: Vec<(u64, WorkerIdx)>,
}

impl ConsistentHash {
    /// A policy with the given ring shape.
    pub fn new(config: ConsistentHashConfig) -> Self {
        Self {
            config,
            members: Vec::new(),
            ring: Vec::new(),
        }
    }

    /// The ring's home worker for `key` (before load bounds), if any.
    pub fn home(&self, key: u64) -> Option<WorkerIdx> {
        let start = self.ring.partition_point(|(p, _)| *p < key);
        self.ring
            .get(start)
            .or_else(|| self.ring.first())
            .map(|(_, w)| *w)
    }

    /// The ring key of a request.
    pub fn key(&self, ctx: &RouteContext<'_>) -> u64 {
        let k = self.config.key_blocks.max(1).min(ctx.hashes.len());
        match k.checked_sub(1).and_then(|i| ctx.hashes.get(i)) {
            Some(h) => mix64(h.0),
            // Shorter than a block: nothing to keep together, so spread by length.
            None => mix64(ctx.prompt_tokens as u64 ^ 0x6b76_666c_6565_7400),
        }
    }

    fn refresh(&mut self, ctx: &RouteContext<'_>) {
        let same = self.members.len() == ctx.candidates.len()
            && self
                .members
                .iter()
                .zip(ctx.candidates)
                .all(|(m, c)| m.0 == c.worker && m.1 == c.id_hash);
        if same {
            return;
        }
        self.members = ctx
            .candidates
            .iter()
            .map(|c| (c.worker, c.id_hash))
            .collect();
        self.ring.clear();
        let v = self.config.virtual_nodes.max(1);
        for &(w, h) in &self.members {
            for i in 0..v {
                self.ring.push((mix64(h ^ mix64(i as u64 + 1)), w));
            }
        }
        self.ring.sort_unstable();
    }
}

impl RoutingPolicy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent-hash"
    }

    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection> {
        let n = ctx.candidates.len();
        if n == 0 {
            return None;
        }
        self.refresh(ctx);
        let key = self.key(ctx);
        let total = total_active(ctx.candidates) + 1;
        let cap = ((1.0 + self.config.epsilon) * total as f64 / n as f64).ceil() as usize;
        let start = self.ring.partition_point(|(p, _)| *p < key);
        let mut home = None;
        for i in 0..self.ring.len() {
            let (_, w) = self.ring[(start + i) % self.ring.len()];
            home.get_or_insert(w);
            let Ok(pos) = ctx.candidates.binary_search_by_key(&w, |c| c.worker) else {
                continue;
            };
            if ctx.candidates[pos].load.active_sequences() < cap {
                return Some(Selection {
                    worker: w,
                    spilled_from: home.filter(|h| *h != w),
                });
            }
        }
        home.map(Selection::to)
    }
}
