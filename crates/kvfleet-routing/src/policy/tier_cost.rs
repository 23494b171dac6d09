//! How `cache-aware` prices a prefix hit in a worker's host or disk tier.
//!
//! A device hit is free. A block in host memory or on disk must first be copied into
//! the device pool: `kv_bytes_per_token × block tokens ÷ the tier's bandwidth`
//! seconds. Recomputing it instead costs `block tokens ÷ prefill_tokens_per_s`. So a
//! tier token costs the fraction
//!
//! ```text
//! load_fraction(tier) = kv_bytes_per_token × prefill_tokens_per_s ÷ bandwidth(tier)
//! ```
//!
//! of a recomputed token (capped at 1: a tier slower than recompute is a miss). The
//! policy adds `load_fraction × tier tokens` to the tokens it must compute, so a tier
//! hit scores as the prefill it really saves, never better than a device hit.
//!
//! Defaults are Llama-3-8B in bf16 (32 layers × 8 KV heads × 128 dims × K and V × 2
//! bytes = 128 KiB per token) on an H200: 8,000 prefill tokens/s (the simulator's
//! `h200-llama8b` cost model), host over PCIe Gen5 at an effective 50 GB/s, disk on
//! one NVMe drive at 5 GB/s — host 2.1% and disk 21% of a recompute. Set them from
//! the model config and a measured copy rate.
//!
//! A block another worker holds (device or host) can also be *pulled* from it over the
//! network (`FetchBlocks`) when `peer_pull_min_blocks` is set: it costs
//! `kv_bytes_per_token × prefill_tokens_per_s ÷ peer_bytes_per_s` of a recompute
//! (default 12.5 GB/s, one 100 Gb/s link: 8.4%). So the policy may send a request to a
//! less loaded worker that pulls the prefix when that transfer plus its queue beats
//! the holder's queue.
//!
//! [`TierScoring::Discount`] is the fixed-weight alternative of NVIDIA Dynamo's KV
//! router (a host block counts 0.75 of a device block, a disk block 0.25, whatever the
//! model and hardware); [`TierScoring::DeviceOnly`] ignores the lower tiers.

use kvfleet_core::kv_events::Medium;
use serde::{Deserialize, Serialize};

/// The smallest prefix, in tokens, that `kvfleet router` and `kvfleet up` pull from a
/// peer by default (`--peer-pull-min-blocks` unset): one block of the engine's 16
/// tokens. A pull's round trip is small next to recomputing even that little:
/// `scripts/bench_peer_pull.py` (docs/kv-tiers.md) measured SmolLM2-135M on the CPU
/// engine adding 14.8 ms over a local hit to pull 64 cached tokens, where recomputing
/// them adds 61.2 ms; and the pull trigger moves a request only to end a wait.
/// (It was 256 tokens, on an unmeasured guess of a 32 ms round trip; that kept the
/// ~100-token prefixes of short fork children from being pulled.) The core's own
/// [`TierCostConfig::default`] keeps pulls off: only the deployment knows whether its
/// workers can reach each other.
pub const DEFAULT_PEER_PULL_MIN_TOKENS: usize = 16;

/// [`DEFAULT_PEER_PULL_MIN_TOKENS`] in whole blocks of `block_size` tokens (at least 1):
/// the serving default of `peer_pull_min_blocks`.
pub fn default_peer_pull_min_blocks(block_size: usize) -> usize {
    DEFAULT_PEER_PULL_MIN_TOKENS
        .div_ceil(block_size.max(1))
        .max(1)
}

/// How tier hits are scored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TierScoring {
    /// By load time against recompute time (the default).
    #[default]
    LoadTime,
    /// By fixed discounts: a tier token saves `host_discount` / `disk_discount` of a
    /// recomputed token (Dynamo's 0.75 / 0.25).
    Discount,
    /// Host and disk hits count for nothing (tier-blind routing).
    DeviceOnly,
}

/// Tier pricing knobs of the `cache-aware` policy; see the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierCostConfig {
    /// How tier hits are scored (default `load-time`).
    pub scoring: TierScoring,
    /// KV cache bytes of one token over all layers, K and V (default 131,072:
    /// Llama-3-8B, bf16). A block's bytes are this × the block size.
    pub kv_bytes_per_token: f64,
    /// Host → device copy bandwidth, bytes/s (default 50e9).
    pub host_bytes_per_s: f64,
    /// Disk → device bandwidth, bytes/s (default 5e9).
    pub disk_bytes_per_s: f64,
    /// Prefill throughput of one worker, tokens/s (default 8,000).
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of each prefill on a worker, ms, on top of its tokens (default 20,
    /// the simulator's `h200-llama8b` estimate). The pull trigger adds it for every
    /// prefill queued or running ahead of a request (see `PullTrigger::IdleWait`).
    pub prefill_overhead_ms: f64,
    /// Fraction of a recompute a host token saves under `discount` (default 0.75).
    pub host_discount: f64,
    /// Fraction of a recompute a disk token saves under `discount` (default 0.25).
    pub disk_discount: f64,
    /// Worker → worker transfer bandwidth for pulled blocks, bytes/s (default 12.5e9).
    pub peer_bytes_per_s: f64,
    /// Pull a prefix from the worker holding it when that worker holds at least this
    /// many more of the prompt's blocks than the chosen one (default 0: no pulls).
    pub peer_pull_min_blocks: usize,
}

impl Default for TierCostConfig {
    fn default() -> Self {
        Self {
            scoring: TierScoring::LoadTime,
            kv_bytes_per_token: 131_072.0,
            host_bytes_per_s: 50e9,
            disk_bytes_per_s: 5e9,
            prefill_tokens_per_s: 8_000.0,
            prefill_overhead_ms: 20.0,
            host_discount: 0.75,
            disk_discount: 0.25,
            peer_bytes_per_s: 12.5e9,
            peer_pull_min_blocks: 0,
        }
    }
}

impl TierCostConfig {
    /// [`prefill_overhead_ms`](Self::prefill_overhead_ms) in prompt-token equivalents
    /// at [`prefill_tokens_per_s`](Self::prefill_tokens_per_s) (0 when either is not a
    /// finite number above 0).
    pub fn prefill_overhead_tokens(&self) -> f64 {
        let t = self.prefill_overhead_ms * self.prefill_tokens_per_s / 1000.0;
        if t.is_finite() && t > 0.0 {
            t
        } else {
            0.0
        }
    }

    /// The cost of one token found in tier `m`, as a fraction of recomputing it, in
    /// `[0, 1]` (0 for the device; 1 when the tier is no faster than recompute or the
    /// knobs are not finite and positive).
    pub fn load_fraction(&self, m: Medium) -> f64 {
        let f = match (self.scoring, m) {
            (_, Medium::Device) => return 0.0,
            (TierScoring::DeviceOnly, _) => 1.0,
            (TierScoring::Discount, Medium::Host) => 1.0 - self.host_discount,
            (TierScoring::Discount, Medium::Disk) => 1.0 - self.disk_discount,
            (TierScoring::LoadTime, Medium::Host) => self.load_time_fraction(self.host_bytes_per_s),
            (TierScoring::LoadTime, Medium::Disk) => self.load_time_fraction(self.disk_bytes_per_s),
        };
        if f.is_finite() {
            f.clamp(0.0, 1.0)
        } else {
            1.0
        }
    }

    /// The cost of one token pulled from a peer, as a fraction of recomputing it, in
    /// `[0, 1]`: by transfer time under every scoring but `device-only` (which prices
    /// it as a miss). 1 means pulls never pay.
    pub fn peer_load_fraction(&self) -> f64 {
        if self.scoring == TierScoring::DeviceOnly {
            return 1.0;
        }
        let f = self.load_time_fraction(self.peer_bytes_per_s);
        if f.is_finite() {
            f.clamp(0.0, 1.0)
        } else {
            1.0
        }
    }

    /// Whether requests may pull prefix blocks from peers: pulls are on and cheaper
    /// than recompute.
    pub fn pulls_enabled(&self) -> bool {
        self.peer_pull_min_blocks > 0 && self.peer_load_fraction() < 1.0
    }

    /// Seconds to load one token's KV from tier `m` (0 for the device).
    pub fn load_s_per_token(&self, m: Medium) -> f64 {
        match m {
            Medium::Device => 0.0,
            Medium::Host => self.kv_bytes_per_token / self.host_bytes_per_s,
            Medium::Disk => self.kv_bytes_per_token / self.disk_bytes_per_s,
        }
    }

    fn load_time_fraction(&self, bytes_per_s: f64) -> f64 {
        if bytes_per_s > 0.0 {
            self.kv_bytes_per_token * self.prefill_tokens_per_s / bytes_per_s
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_overhead_is_priced_in_tokens_at_the_prefill_rate() {
        let t = TierCostConfig::default();
        assert_eq!(t.prefill_overhead_tokens(), 160.0);
        let cpu = TierCostConfig {
            prefill_tokens_per_s: 1_340.0,
            prefill_overhead_ms: 45.0,
            ..TierCostConfig::default()
        };
        assert!((cpu.prefill_overhead_tokens() - 60.3).abs() < 1e-9);
        for bad in [f64::NAN, -1.0, f64::INFINITY] {
            let t = TierCostConfig {
                prefill_overhead_ms: bad,
                ..TierCostConfig::default()
            };
            assert_eq!(t.prefill_overhead_tokens(), 0.0);
        }
    }

    #[test]
    fn load_time_pricing_follows_bandwidth_and_never_beats_the_device() {
        let c = TierCostConfig::default();
        assert_eq!(c.load_fraction(Medium::Device), 0.0);
        let host = c.load_fraction(Medium::Host);
        let disk = c.load_fraction(Medium::Disk);
        assert!((host - 131_072.0 * 8_000.0 / 50e9).abs() < 1e-12, "{host}");
        assert!((disk - 10.0 * host).abs() < 1e-12);
        // A tier slower than recompute is priced as a miss, not worse.
        let slow = TierCostConfig {
            disk_bytes_per_s: 1e6,
            ..c.clone()
        };
        assert_eq!(slow.load_fraction(Medium::Disk), 1.0);
        let broken = TierCostConfig {
            host_bytes_per_s: 0.0,
            ..c.clone()
        };
        assert_eq!(broken.load_fraction(Medium::Host), 1.0);
        let dynamo = TierCostConfig {
            scoring: TierScoring::Discount,
            ..c.clone()
        };
        assert_eq!(dynamo.load_fraction(Medium::Host), 0.25);
        assert_eq!(dynamo.load_fraction(Medium::Disk), 0.75);
        let blind = TierCostConfig {
            scoring: TierScoring::DeviceOnly,
            ..c
        };
        assert_eq!(blind.load_fraction(Medium::Host), 1.0);
        assert_eq!(blind.peer_load_fraction(), 1.0);
        let json = serde_json::to_string(&blind).unwrap();
        assert!(json.contains("\"device-only\""), "{json}");
    }

    #[test]
    fn peer_pulls_are_priced_by_transfer_time_and_off_by_default() {
        let c = TierCostConfig::default();
        assert!(!c.pulls_enabled(), "no pulls unless asked for");
        let on = TierCostConfig {
            peer_pull_min_blocks: 1,
            ..c.clone()
        };
        assert!(on.pulls_enabled());
        let f = on.peer_load_fraction();
        assert!((f - 131_072.0 * 8_000.0 / 12.5e9).abs() < 1e-12, "{f}");
        // A link slower than recompute never pays: no pulls.
        let slow = TierCostConfig {
            peer_bytes_per_s: 1e6,
            ..on
        };
        assert_eq!(slow.peer_load_fraction(), 1.0);
        assert!(!slow.pulls_enabled());
    }

    #[test]
    fn the_serving_default_pulls_16_tokens_or_more_in_whole_blocks() {
        assert_eq!(default_peer_pull_min_blocks(16), 1);
        assert_eq!(default_peer_pull_min_blocks(8), 2);
        assert_eq!(default_peer_pull_min_blocks(100), 1);
        assert_eq!(default_peer_pull_min_blocks(512), 1);
        assert_eq!(default_peer_pull_min_blocks(0), 16);
    }
}
