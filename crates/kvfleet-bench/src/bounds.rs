//! The two bounds every result is reported beside:
//!
//! - the **ceiling**: prefix hits with one unbounded cache holding every block ever
//!   seen — what perfect routing with infinite memory reaches;
//! - the **pooled bound**: prefix hits with one LRU cache as large as the whole
//!   fleet's memory (`workers × blocks per worker`) — what perfect routing reaches
//!   when memory is pooled. Below it, memory (not routing) is the limit.
//!
//! Hit ratios count blocks (hash ids): a request's hits are the leading blocks of its
//! chain already cached.

use crate::sim::lru::LruBlockCache;
use crate::token_blocks::{chained_hashes, tenant_seed};
use crate::trace::Trace;
use kvfleet_core::BlockHashMap;
use serde::Serialize;

/// Hit ratios of the two bounds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bounds {
    /// One unbounded cache.
    pub ceiling: f64,
    /// One LRU cache of the fleet's total blocks.
    pub pooled: f64,
    /// The pooled cache's size in blocks.
    pub pooled_blocks: usize,
}

/// Every request's chained block hashes, in trace order.
pub fn chains(trace: &Trace) -> Vec<Vec<kvfleet_core::BlockHash>> {
    trace
        .records
        .iter()
        .map(|r| chained_hashes(tenant_seed(r.tenant.as_deref()), &r.hash_ids))
        .collect()
}

/// Hit ratio of one unbounded cache.
pub fn ceiling(trace: &Trace) -> f64 {
    let mut seen: BlockHashMap<()> = BlockHashMap::default();
    let (mut hit, mut total) = (0usize, 0usize);
    for c in chains(trace) {
        hit += c.iter().take_while(|h| seen.contains_key(h)).count();
        total += c.len();
        seen.extend(c.into_iter().map(|h| (h, ())));
    }
    ratio(hit, total)
}

/// Hit ratio of one LRU cache of `blocks` blocks.
pub fn pooled(trace: &Trace, blocks: usize) -> f64 {
    let mut lru = LruBlockCache::new(blocks);
    let (mut hit, mut total) = (0usize, 0usize);
    for c in chains(trace) {
        hit += lru.match_prefix(&c);
        total += c.len();
        lru.insert_chain(&c);
    }
    ratio(hit, total)
}

/// Both bounds for a fleet of `workers × blocks_per_worker` blocks.
pub fn bounds(trace: &Trace, workers: usize, blocks_per_worker: usize) -> Bounds {
    let pooled_blocks = workers * blocks_per_worker;
    Bounds {
        ceiling: ceiling(trace),
        pooled: pooled(trace, pooled_blocks),
        pooled_blocks,
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRecord;

    fn rec(ts: u64, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: ts,
            input_length: ids.len() * 4,
            output_length: 1,
            hash_ids: ids.to_vec(),
            block_size: Some(4),
            id: None,
            session_id: None,
            parent_id: None,
            fork_group: None,
            tenant: None,
        }
    }

    #[test]
    fn tiny_trace_known_answers() {
        // 12 blocks in all.
        let t = Trace {
            records: vec![
                rec(0, &[1, 2, 3]),
                rec(1, &[4, 5, 6]),
                rec(2, &[1, 2, 7]), // hits 1,2
                rec(3, &[4, 5, 6]), // hits 4,5,6 (unbounded)
            ],
        };
        assert!((ceiling(&t) - 5.0 / 12.0).abs() < 1e-12);
        let p4 = pooled(&t, 4);
        // Capacity 4, MRU first: [1,2,3] → 1,2,3; [4,5,6] evicts 3,2 → 4,5,6,1;
        // [1,2,7] hits 1, then storing 7,2,1 evicts 1,6,5 → 1,2,7,4; [4,5,6] hits 4.
        assert!((p4 - 2.0 / 12.0).abs() < 1e-12, "{p4}");
        assert!((pooled(&t, 100) - ceiling(&t)).abs() < 1e-12);
        // Tenants never share.
        let mut t2 = t.clone();
        t2.records[2].tenant = Some("b".into());
        assert!((ceiling(&t2) - 3.0 / 12.0).abs() < 1e-12);
    }
}
