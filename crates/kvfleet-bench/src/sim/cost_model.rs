//! The simulated worker's cost model, read from a JSON file
//! (`crates/kvfleet-bench/cost-models/*.json`).
//!
//! Prefill is serialized per worker: a request's prefill takes
//! `prefill_overhead_ms + uncached_tokens / prefill_tokens_per_s`, after the prefills
//! queued before it. Decode overlaps with prefill (continuous batching with chunked
//! prefill): each decode step of a worker takes
//! `decode_step_base_ms + decode_step_per_seq_ms × batch`, where `batch` is the number
//! of sequences decoding on that worker when the request starts decoding.
//!
//! Host and disk tiers: a prefix hit in a lower tier is copied into the device pool
//! first, taking `block tokens × kv_bytes_per_token ÷ host_bytes_per_s` (or
//! `disk_bytes_per_s`), added to the request's prefill on the same lane. The tier
//! fields are optional in the file (defaults: Llama-3-8B bf16 KV, 128 KiB per token;
//! PCIe Gen5 host copies at 50 GB/s; one NVMe drive at 5 GB/s).
//!
//! Peer pulls: blocks fetched from another worker take `block tokens ×
//! kv_bytes_per_token ÷ peer_bytes_per_s` (default 12.5 GB/s, one 100 Gb/s link), on
//! the pulling worker's lane too.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A worker's prefill/decode cost model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// Short name.
    pub name: String,
    /// Where the figures come from.
    #[serde(default)]
    pub description: String,
    /// Uncached prompt tokens computed per second.
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of one request's prefill (scheduling, the first decode step), ms.
    pub prefill_overhead_ms: f64,
    /// Decode step time at batch 0, ms.
    pub decode_step_base_ms: f64,
    /// Extra decode step time per sequence in the batch, ms.
    pub decode_step_per_seq_ms: f64,
    /// KV cache bytes per token (all layers, K and V).
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: f64,
    /// Host-tier → device copy bandwidth, bytes/s.
    #[serde(default = "default_host_bytes_per_s")]
    pub host_bytes_per_s: f64,
    /// Disk-tier → device bandwidth, bytes/s.
    #[serde(default = "default_disk_bytes_per_s")]
    pub disk_bytes_per_s: f64,
    /// Worker → worker transfer bandwidth for pulled blocks, bytes/s.
    #[serde(default = "default_peer_bytes_per_s")]
    pub peer_bytes_per_s: f64,
}

fn default_peer_bytes_per_s() -> f64 {
    12.5e9
}

fn default_kv_bytes_per_token() -> f64 {
    131_072.0
}

fn default_host_bytes_per_s() -> f64 {
    50e9
}

fn default_disk_bytes_per_s() -> f64 {
    5e9
}

impl CostModel {
    /// Reads a cost model file.
    pub fn read_path(path: &Path) -> Result<CostModel> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading cost model {}", path.display()))?;
        let m: CostModel = serde_json::from_str(&text)
            .with_context(|| format!("parsing cost model {}", path.display()))?;
        m.validate()
            .with_context(|| format!("cost model {}", path.display()))?;
        Ok(m)
    }

    /// Checks that every figure is positive and finite.
    pub fn validate(&self) -> Result<()> {
        for (k, v) in [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("prefill_overhead_ms", self.prefill_overhead_ms),
            ("decode_step_base_ms", self.decode_step_base_ms),
            ("decode_step_per_seq_ms", self.decode_step_per_seq_ms),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
        ] {
            anyhow::ensure!(v.is_finite() && v >= 0.0, "{k} must be finite and >= 0");
        }
        for (k, v) in [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("host_bytes_per_s", self.host_bytes_per_s),
            ("disk_bytes_per_s", self.disk_bytes_per_s),
            ("peer_bytes_per_s", self.peer_bytes_per_s),
        ] {
            anyhow::ensure!(v.is_finite() && v > 0.0, "{k} must be finite and > 0");
        }
        Ok(())
    }

    /// The built-in H200 estimate (the same figures as `cost-models/h200-llama8b.json`).
    pub fn h200_llama8b() -> CostModel {
        serde_json::from_str(include_str!("../../cost-models/h200-llama8b.json"))
            .expect("built-in cost model parses")
    }

    /// The built-in CPU calibration (`cost-models/cpu-small.json`).
    pub fn cpu_small() -> CostModel {
        serde_json::from_str(include_str!("../../cost-models/cpu-small.json"))
            .expect("built-in cost model parses")
    }

    /// Prefill time of `uncached` tokens, in ms.
    pub fn prefill_ms(&self, uncached: usize) -> f64 {
        self.prefill_overhead_ms + uncached as f64 * 1000.0 / self.prefill_tokens_per_s
    }

    /// Time to copy `tokens` tokens' KV from the host tier into the device, in ms.
    pub fn host_load_ms(&self, tokens: usize) -> f64 {
        tokens as f64 * self.kv_bytes_per_token * 1000.0 / self.host_bytes_per_s
    }

    /// Time to read `tokens` tokens' KV from the disk tier into the device, in ms.
    pub fn disk_load_ms(&self, tokens: usize) -> f64 {
        tokens as f64 * self.kv_bytes_per_token * 1000.0 / self.disk_bytes_per_s
    }

    /// Time to pull `tokens` tokens' KV from a peer worker, in ms.
    pub fn peer_load_ms(&self, tokens: usize) -> f64 {
        tokens as f64 * self.kv_bytes_per_token * 1000.0 / self.peer_bytes_per_s
    }

    /// The router's tier pricing for this model and hardware, scored by `scoring`,
    /// with pulls of at least `peer_pull_min_blocks` blocks (0: none).
    pub fn tier_pricing(
        &self,
        scoring: kvfleet_routing::policy::TierScoring,
        peer_pull_min_blocks: usize,
    ) -> kvfleet_routing::policy::TierCostConfig {
        kvfleet_routing::policy::TierCostConfig {
            scoring,
            kv_bytes_per_token: self.kv_bytes_per_token,
            host_bytes_per_s: self.host_bytes_per_s,
            disk_bytes_per_s: self.disk_bytes_per_s,
            peer_bytes_per_s: self.peer_bytes_per_s,
            peer_pull_min_blocks,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            ..Default::default()
        }
    }

    /// One decode step at `batch` sequences, in ms.
    pub fn decode_step_ms(&self, batch: usize) -> f64 {
        self.decode_step_base_ms + self.decode_step_per_seq_ms * batch as f64
    }
}
