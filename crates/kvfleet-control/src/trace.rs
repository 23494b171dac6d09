//! Usage records → a replayable trace: one JSON object per line with `timestamp`
//! (milliseconds since the first record), `input_length`, `output_length`, `hash_ids`
//! (block hash ids), `block_size`, and, when known, `session_id`, `fork_group`,
//! `tenant`.

use crate::usage::UsageRecord;
use serde::Serialize;

/// One trace line.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceLine {
    /// Milliseconds since the first request of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// The prompt's block hash ids, in prefix order.
    pub hash_ids: Vec<u64>,
    /// Tokens per block.
    pub block_size: u32,
    /// Session, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Fork group, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fork_group: Option<String>,
    /// Tenant, if not the default one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// The trace of `records`, ordered by arrival time.
pub fn to_trace(records: &[UsageRecord]) -> Vec<TraceLine> {
    let mut sorted: Vec<&UsageRecord> = records.iter().collect();
    sorted.sort_by_key(|r| r.timestamp_ms);
    let t0 = sorted.first().map_or(0, |r| r.timestamp_ms);
    sorted
        .into_iter()
        .map(|r| TraceLine {
            timestamp: r.timestamp_ms - t0,
            input_length: r.prompt_tokens,
            output_length: r.output_tokens,
            hash_ids: r.block_hashes.clone(),
            block_size: r.block_size,
            session_id: r.session_id.clone(),
            fork_group: r.fork_group.clone(),
            tenant: (!r.tenant.is_empty()).then(|| r.tenant.clone()),
        })
        .collect()
}

/// The trace as JSONL text.
pub fn to_jsonl(records: &[UsageRecord]) -> String {
    let mut out = String::new();
    for line in to_trace(records) {
        out.push_str(&serde_json::to_string(&line).unwrap_or_default());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: u64, group: Option<&str>) -> UsageRecord {
        UsageRecord {
            tenant: String::new(),
            model: "tiny".into(),
            prompt_tokens: 40,
            cached_tokens: 32,
            output_tokens: 4,
            worker: "w0".into(),
            ttft_ms: 3.5,
            fork_group: group.map(str::to_string),
            session_id: None,
            block_hashes: vec![1, 2],
            block_size: 16,
            timestamp_ms: ts,
        }
    }

    #[test]
    fn timestamps_are_relative_and_sorted() {
        let t = to_trace(&[rec(1_000_050, None), rec(1_000_000, Some("g"))]);
        assert_eq!(t[0].timestamp, 0);
        assert_eq!(t[0].fork_group.as_deref(), Some("g"));
        assert_eq!(t[1].timestamp, 50);
        let line = to_jsonl(&[rec(5, None)]);
        assert_eq!(
            line,
            "{\"timestamp\":0,\"input_length\":40,\"output_length\":4,\"hash_ids\":[1,2],\"block_size\":16}\n"
        );
    }
}
