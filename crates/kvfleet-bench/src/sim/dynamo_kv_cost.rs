//! Baseline: NVIDIA Dynamo's KV router cost, re-implemented from its public
//! documentation (KV cache routing, `--kv-overlap-score-weight`,
//! `--router-temperature`).
//!
//! The router learns every worker's cached blocks from KV events (here: the simulated
//! workers' caches, read directly — events with no delay) and tracks each worker's
//! active sequences. For a request of `n` blocks, with `overlap(W)` blocks cached on W:
//!
//! ```text
//! prefill_blocks(W) = (W's pending prefill tokens) / block_size + n − overlap(W)
//! decode_blocks(W)  = (W's active blocks) + n
//! cost(W)           = overlap_weight × prefill_blocks(W) + decode_blocks(W)
//! ```
//!
//! With temperature 0 the lowest cost wins; ties are broken at random (seeded).
//! Defaults: overlap_weight 1.0, temperature 0.

use super::{RouteReq, SimRouter, SimWorker};
use kvfleet_routing::policy::mix64;
use serde::{Deserialize, Serialize};

/// Dynamo KV router settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DynamoConfig {
    /// Weight of prefill blocks against decode blocks (1.0).
    pub overlap_weight: f64,
    /// Seed of the tie-break.
    pub seed: u64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            seed: 7,
        }
    }
}

/// The Dynamo KV-cost baseline.
pub struct DynamoKvCost {
    config: DynamoConfig,
    rng: u64,
}

impl DynamoKvCost {
    /// A router with `config`.
    pub fn new(config: DynamoConfig) -> Self {
        let rng = config.seed;
        Self { config, rng }
    }
}

impl SimRouter for DynamoKvCost {
    fn route(&mut self, req: &RouteReq<'_>, workers: &[SimWorker], _now_ms: f64) -> (usize, usize) {
        let n = req.hashes.len();
        let bs = req.block_size as f64;
        let mut best = f64::INFINITY;
        let mut ties = 0u64;
        let mut chosen = 0;
        for (i, w) in workers.iter().enumerate() {
            let overlap = w.lru.match_prefix(req.hashes);
            let prefill = w.queued_prefill_tokens as f64 / bs + (n - overlap) as f64;
            let decode = (w.active_blocks + n) as f64;
            let cost = self.config.overlap_weight * prefill + decode;
            if cost < best {
                best = cost;
                chosen = i;
                ties = 1;
            } else if cost == best {
                // Reservoir sampling: each tied worker wins with equal chance.
                ties += 1;
                self.rng = mix64(self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15));
                if self.rng.is_multiple_of(ties) {
                    chosen = i;
                }
            }
        }
        (chosen, 0)
    }
}
