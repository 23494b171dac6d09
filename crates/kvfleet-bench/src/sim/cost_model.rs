//! The simulated worker's cost model. The data type and its JSON files' reading live
//! in `kvfleet_core::cost_model` (the simulated engine uses them too); this module
//! re-exports them so the simulator's users keep their paths, and adds what only the
//! routing side needs: the router's tier pricing for a cost model.

pub use kvfleet_core::cost_model::{CostModel, CostModelError};

/// The router's tier pricing for `cost`'s model and hardware, scored by `scoring`,
/// with pulls of at least `peer_pull_min_blocks` blocks (0: none).
pub fn tier_pricing(
    cost: &CostModel,
    scoring: kvfleet_routing::policy::TierScoring,
    peer_pull_min_blocks: usize,
) -> kvfleet_routing::policy::TierCostConfig {
    kvfleet_routing::policy::TierCostConfig {
        scoring,
        kv_bytes_per_token: cost.kv_bytes_per_token,
        host_bytes_per_s: cost.host_bytes_per_s,
        disk_bytes_per_s: cost.disk_bytes_per_s,
        peer_bytes_per_s: cost.peer_bytes_per_s,
        peer_pull_min_blocks,
        prefill_tokens_per_s: cost.prefill_tokens_per_s,
        prefill_overhead_ms: cost.prefill_overhead_ms,
        ..Default::default()
    }
}
