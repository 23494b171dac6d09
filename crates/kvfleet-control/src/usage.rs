//! Per-request usage records, published on `kvfleet.usage`. They carry token counts,
//! timing and block hash ids — never prompt or output text.

use crate::error::{ControlError, Result};
use kvfleet_core::kv_events::PromotedTokens;
use serde::{Deserialize, Serialize};

/// One served request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Tenant (the request's cache salt; empty for the default tenant).
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the worker's cache.
    pub cached_tokens: u64,
    /// The part of `cached_tokens` promoted from the worker's host or disk tier, or
    /// pulled from a peer, instead of found in its device pool.
    #[serde(default, skip_serializing_if = "PromotedTokens::is_empty")]
    pub cached_by_tier: PromotedTokens,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Serving worker.
    pub worker: String,
    /// Time to first token, milliseconds (from arrival at the router).
    pub ttft_ms: f64,
    /// Fork group, if the client named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_group: Option<String>,
    /// Session (conversation) id, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<u64>,
    /// Tokens per block.
    pub block_size: u32,
    /// When the request arrived, Unix milliseconds.
    pub timestamp_ms: u64,
}

impl UsageRecord {
    /// JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses [`Self::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes).map_err(|e| ControlError::Decode {
            what: "usage record",
            message: e.to_string(),
        })
    }
}
