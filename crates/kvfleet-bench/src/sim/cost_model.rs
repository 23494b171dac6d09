//! The simulated worker's cost model, read from a JSON file
//! (`crates/kvfleet-bench/cost-models/*.json`).
//!
//! Prefill is serialized per worker: a request's prefill takes
//! `prefill_overhead_ms + uncached_tokens / prefill_tokens_per_s`, after the prefills
//! queued before it. Decode overlaps with prefill (continuous batching with chunked
//! prefill): each decode step of a worker takes
//! `decode_step_base_ms + decode_step_per_seq_ms × batch`, where `batch` is the number
//! of sequences decoding on that worker when the request starts decoding.

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
        ] {
            anyhow::ensure!(v.is_finite() && v >= 0.0, "{k} must be finite and >= 0");
        }
        anyhow::ensure!(
            self.prefill_tokens_per_s > 0.0,
            "prefill_tokens_per_s must be > 0"
        );
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

    /// One decode step at `batch` sequences, in ms.
    pub fn decode_step_ms(&self, batch: usize) -> f64 {
        self.decode_step_base_ms + self.decode_step_per_seq_ms * batch as f64
    }
}
