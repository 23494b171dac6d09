//! Usage records (from `kvfleet.usage`) → a replayable trace in this crate's format, so
//! production traffic can be replayed and simulated like any trace (`kvfleet trace
//! export`).
//!
//! A usage record carries the chained hashes of the prompt's full *cacheable* blocks
//! only; the trace format wants one id per block, the last possibly partial. Blocks the
//! record does not name (a partial tail, an uncacheable status tail) get ids unique to
//! that request, so the replay shares exactly what production could share. Session and
//! fork-group names become small integers in order of first appearance.

use crate::trace::{Trace, TraceRecord};
use kvfleet_control::UsageRecord;
use std::collections::HashMap;

/// The trace of `records`, ordered by arrival, timestamps relative to the first.
pub fn trace_from_usage(records: &[UsageRecord]) -> Trace {
    let mut sorted: Vec<&UsageRecord> = records.iter().collect();
    sorted.sort_by_key(|r| r.timestamp_ms);
    let t0 = sorted.first().map_or(0, |r| r.timestamp_ms);
    let mut sessions = Names::default();
    let mut groups = Names::default();
    let records = sorted
        .into_iter()
        .enumerate()
        .filter(|(_, r)| r.prompt_tokens > 0 && r.block_size > 0)
        .map(|(i, r)| {
            let bs = r.block_size as usize;
            let input = r.prompt_tokens as usize;
            let mut hash_ids = r.block_hashes.clone();
            hash_ids.truncate(input.div_ceil(bs));
            // Ids no other request can share: the request's index mixed with the block's.
            let mut k = 0u64;
            while hash_ids.len() < input.div_ceil(bs) {
                hash_ids.push(unique_id(i as u64, k));
                k += 1;
            }
            TraceRecord {
                timestamp: r.timestamp_ms.saturating_sub(t0),
                input_length: input,
                output_length: r.output_tokens.max(1) as usize,
                hash_ids,
                block_size: Some(bs),
                id: None,
                session_id: r.session_id.as_deref().map(|s| sessions.id(s)),
                parent_id: None,
                fork_group: r.fork_group.as_deref().map(|g| groups.id(g)),
                tenant: (!r.tenant.is_empty()).then(|| r.tenant.clone()),
            }
        })
        .collect();
    Trace { records }
}

#[derive(Default)]
struct Names(HashMap<String, u64>);

impl Names {
    fn id(&mut self, name: &str) -> u64 {
        let next = self.0.len() as u64;
        *self.0.entry(name.to_string()).or_insert(next)
    }
}

fn unique_id(request: u64, block: u64) -> u64 {
    // splitmix64 of a value no block hash chain produces on purpose.
    let mut z = (request << 20 ^ block) ^ 0x6b76_666c_6565_7421;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: u64, prompt: u64, hashes: &[u64], group: Option<&str>) -> UsageRecord {
        UsageRecord {
            tenant: String::new(),
            model: "tiny".into(),
            prompt_tokens: prompt,
            cached_tokens: 0,
            cached_by_tier: Default::default(),
            output_tokens: 4,
            worker: "w0".into(),
            ttft_ms: 3.5,
            fork_group: group.map(str::to_string),
            session_id: None,
            block_hashes: hashes.to_vec(),
            block_size: 16,
            timestamp_ms: ts,
        }
    }

    #[test]
    fn exported_traces_read_back_and_share_only_real_blocks() {
        let t = trace_from_usage(&[
            rec(1_000_050, 40, &[1, 2], Some("g7")),
            rec(1_000_000, 40, &[1, 2], Some("g7")),
            rec(1_000_090, 64, &[1, 9], None),
        ]);
        let mut text = Vec::new();
        t.write(&mut text).unwrap();
        let back = Trace::read(text.as_slice()).unwrap();
        assert_eq!(back.records.len(), 3);
        let r = &back.records;
        assert_eq!(
            (r[0].timestamp, r[1].timestamp, r[2].timestamp),
            (0, 50, 90)
        );
        assert_eq!(r[0].fork_group, Some(0));
        assert_eq!(r[1].fork_group, Some(0));
        // 40 tokens = 2 full blocks + a partial one, unique to each request.
        assert_eq!(&r[0].hash_ids[..2], &[1, 2]);
        assert_eq!(r[0].hash_ids.len(), 3);
        assert_ne!(r[0].hash_ids[2], r[1].hash_ids[2]);
        // 64 tokens with 2 named blocks (an uncacheable tail): 4 ids, 2 unique.
        assert_eq!(r[2].hash_ids.len(), 4);
        assert_eq!(&r[2].hash_ids[..2], &[1, 9]);
    }
}
