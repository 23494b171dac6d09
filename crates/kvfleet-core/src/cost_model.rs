//! A worker's prefill/decode cost model, read from a JSON file
//! (`crates/kvfleet-bench/cost-models/*.json`). One definition shared by the fleet
//! simulator (`kvfleet-bench`, which adds the routing-side tier pricing) and the
//! simulated engine backend (`kvfleet-engine`'s `SimBackend`): it lives here because
//! both depend on this crate and neither may depend on the other.
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

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Why a cost model could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CostModelError {
    /// The file could not be read.
    #[error("reading cost model {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The text is not a cost model (bad JSON, a missing or unknown field).
    #[error("parsing cost model {what}: {source}")]
    Parse {
        /// The file, or `"text"` when parsed from a string.
        what: String,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// A figure is out of range.
    #[error("cost model {what}: {reason}")]
    Invalid {
        /// The file, or the model's name.
        what: String,
        /// Which figure and why.
        reason: String,
    },
}

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

// The built-in files stay beside the other cost models in kvfleet-bench, where the
// docs point; they are compiled in here so there is one copy of each.
const H200_LLAMA8B_JSON: &str = include_str!("../../kvfleet-bench/cost-models/h200-llama8b.json");
const CPU_SMALL_JSON: &str = include_str!("../../kvfleet-bench/cost-models/cpu-small.json");

impl CostModel {
    /// Reads and validates a cost model file.
    pub fn read_path(path: &Path) -> Result<CostModel, CostModelError> {
        let what = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CostModelError::Io {
            path: what.clone(),
            source,
        })?;
        Self::parse(&text, &what)
    }

    /// Parses and validates a cost model from JSON text.
    pub fn from_json(text: &str) -> Result<CostModel, CostModelError> {
        Self::parse(text, "text")
    }

    fn parse(text: &str, what: &str) -> Result<CostModel, CostModelError> {
        let m: CostModel = serde_json::from_str(text).map_err(|source| CostModelError::Parse {
            what: what.to_string(),
            source,
        })?;
        m.validate().map_err(|e| match e {
            CostModelError::Invalid { reason, .. } => CostModelError::Invalid {
                what: what.to_string(),
                reason,
            },
            other => other,
        })?;
        Ok(m)
    }

    /// Checks that every figure is finite and not negative, and that the rates a time
    /// is divided by are above zero.
    pub fn validate(&self) -> Result<(), CostModelError> {
        let invalid = |reason: String| CostModelError::Invalid {
            what: self.name.clone(),
            reason,
        };
        for (k, v) in [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("prefill_overhead_ms", self.prefill_overhead_ms),
            ("decode_step_base_ms", self.decode_step_base_ms),
            ("decode_step_per_seq_ms", self.decode_step_per_seq_ms),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(format!("{k} must be finite and >= 0")));
            }
        }
        for (k, v) in [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("host_bytes_per_s", self.host_bytes_per_s),
            ("disk_bytes_per_s", self.disk_bytes_per_s),
            ("peer_bytes_per_s", self.peer_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(format!("{k} must be finite and > 0")));
            }
        }
        Ok(())
    }

    /// The built-in H200 estimate (the same figures as `cost-models/h200-llama8b.json`).
    pub fn h200_llama8b() -> CostModel {
        Self::built_in(H200_LLAMA8B_JSON)
    }

    /// The built-in CPU calibration (`cost-models/cpu-small.json`).
    pub fn cpu_small() -> CostModel {
        Self::built_in(CPU_SMALL_JSON)
    }

    fn built_in(json: &str) -> CostModel {
        // Compiled-in files checked by this module's tests: a failure is a build bug.
        serde_json::from_str(json).expect("built-in cost model parses")
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

    /// One decode step at `batch` sequences, in ms.
    pub fn decode_step_ms(&self, batch: usize) -> f64 {
        self.decode_step_base_ms + self.decode_step_per_seq_ms * batch as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_models_parse_and_validate() {
        for m in [CostModel::h200_llama8b(), CostModel::cpu_small()] {
            m.validate().unwrap();
        }
        assert_eq!(CostModel::h200_llama8b().name, "h200-llama8b");
    }

    #[test]
    fn rejects_unknown_fields_and_bad_figures() {
        let mut v: serde_json::Value = serde_json::from_str(H200_LLAMA8B_JSON).unwrap();
        v["prefill_tokens_per_s"] = serde_json::json!(0.0);
        let e = CostModel::from_json(&v.to_string()).unwrap_err();
        assert!(e.to_string().contains("prefill_tokens_per_s"), "{e}");
        v["prefill_tokens_per_s"] = serde_json::json!(100.0);
        v["bogus"] = serde_json::json!(1);
        assert!(matches!(
            CostModel::from_json(&v.to_string()),
            Err(CostModelError::Parse { .. })
        ));
    }

    #[test]
    fn reading_a_missing_file_names_it() {
        let e = CostModel::read_path(Path::new("/nonexistent/cm.json")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cm.json"), "{e}");
    }
}
