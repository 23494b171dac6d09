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
//!
//! The `lmetric` variant ([`DynamoMetric::Lmetric`]) multiplies instead of adding:
//! `cost(W) = overlap_weight × prefill_blocks(W) × (W's active blocks + 1)`, so a busy
//! decoder is avoided in proportion to how busy it is, and an idle one is judged by its
//! prefill alone.

use super::{RouteReq, SimRouter, SimWorker};
use kvfleet_routing::policy::mix64;
use serde::{Deserialize, Serialize};

/// How prefill and decode blocks combine into a worker's cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DynamoMetric {
    /// `overlap_weight × prefill + decode` (the default KV router cost).
    #[default]
    Additive,
    /// `overlap_weight × prefill × (active blocks + 1)` (`lmetric`).
    Lmetric,
}

/// Dynamo KV router settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DynamoConfig {
    /// Weight of prefill blocks against decode blocks (1.0).
    pub overlap_weight: f64,
    /// How the two combine.
    pub metric: DynamoMetric,
    /// Seed of the tie-break.
    pub seed: u64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            metric: DynamoMetric::Additive,
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
            let cost = match self.config.metric {
                DynamoMetric::Additive => {
                    self.config.overlap_weight * prefill + (w.active_blocks + n) as f64
                }
                DynamoMetric::Lmetric => {
                    self.config.overlap_weight * prefill * (w.active_blocks + 1) as f64
                }
            };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimWorker;
    use kvfleet_core::BlockHash;

    /// Worker 0 holds the prompt's first 6 of 8 blocks but decodes 60 blocks; worker 1
    /// is idle and cold.
    fn workers(prompt: &[BlockHash]) -> Vec<SimWorker> {
        let mut w = vec![SimWorker::new(100, 0, 0), SimWorker::new(100, 0, 0)];
        w[0].lru.insert_chain(&prompt[..6]);
        w[0].active_blocks = 60;
        w
    }

    #[test]
    fn lmetric_weighs_prefill_by_decode_load() {
        let prompt: Vec<BlockHash> = (1..=8).map(BlockHash).collect();
        let req = RouteReq {
            hashes: &prompt,
            input_tokens: 8 * 16,
            block_size: 16,
        };
        let w = workers(&prompt);
        // Additive: 2 + 68 = 70 against 8 + 8 = 16 → the idle worker.
        let mut add = DynamoKvCost::new(DynamoConfig::default());
        assert_eq!(add.route(&req, &w, 0.0).0, 1);
        // lmetric: 2 × 61 = 122 against 8 × 1 = 8 → the idle worker. At 4 active blocks
        // on worker 0 still the idle one (2 × 5 = 10 > 8), where the additive cost already
        // picks worker 0 (2 + 12 = 14 < 16); at 2 active blocks worker 0 (2 × 3 = 6 < 8).
        let mut lm = DynamoKvCost::new(DynamoConfig {
            metric: DynamoMetric::Lmetric,
            ..DynamoConfig::default()
        });
        assert_eq!(lm.route(&req, &w, 0.0).0, 1);
        let mut w4 = workers(&prompt);
        w4[0].active_blocks = 4;
        assert_eq!(lm.route(&req, &w4, 0.0).0, 1);
        assert_eq!(add.route(&req, &w4, 0.0).0, 0, "additive: 2 + 12 = 14 < 16");
        w4[0].active_blocks = 2;
        assert_eq!(lm.route(&req, &w4, 0.0).0, 0);
    }
}
