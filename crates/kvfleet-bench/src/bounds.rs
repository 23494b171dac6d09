//! The two bounds every result is reported beside:
//!
//! - the **ceiling**: prefix hits with one unbounded cache holding every block ever
//!   seen — what perfect routing with infinite memory reaches;
//! - the **pooled bound**: prefix hits with one LRU cache as large as the whole
//!   fleet's memory (`workers × blocks per worker`) — what perfect routing reaches
//!   when memory is pooled. Below it, memory (not routing) is the limit;
//! - the **pooled bound with tiers**: the same with one LRU cache of the fleet's
//!   device, host and disk blocks together (`workers × (device + host + disk)`) —
//!   perfect routing of a fleet with host and disk tiers, ignoring their load time;
//! - the **no-queue floor**: each request's TTFT if it got the ceiling's hits and never
//!   waited (its own uncached prefill under the cost model). A policy's TTFT above it
//!   is queueing and misses.
//!
//! - the **pooled queue**: each request's TTFT in a fleet whose prefill lanes share
//!   one first-come-first-served queue and whose memory is one LRU cache
//!   ([`pooled_queue`]): perfect routing with pooled lanes and pooled memory. A
//!   policy's p99 excess over the floor far above the pooled queue's is routing; an
//!   excess near it is the load and the memory.
//!
//! The pooled bound is taken over the trace's order. A request with a parent starts
//! only once its parent finished, and decode time does not shrink when a trace is
//! sped up, so a faster replay interleaves more sessions: [`pooled_no_queue`] is the
//! pooled bound over the order the requests start in when nothing queues, at a
//! given speed-up (what the benchmark loads are calibrated on).
//!
//! Hit ratios count blocks (hash ids): a request's hits are the leading blocks of its
//! chain already cached.

use crate::sim::cost_model::CostModel;
use crate::sim::lru::LruBlockCache;
use crate::sim::Percentiles;
use crate::token_blocks::{chained_hashes, tenant_seed};
use crate::trace::Trace;
use kvfleet_core::{BlockHash, BlockHashMap};
use serde::Serialize;

/// The bounds of one trace on one fleet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bounds {
    /// Hit ratio of one unbounded cache.
    pub ceiling: f64,
    /// Hit ratio of one LRU cache of the fleet's total blocks.
    pub pooled: f64,
    /// The pooled cache's size in blocks.
    pub pooled_blocks: usize,
    /// Hit ratio of one LRU cache of the fleet's device, host and disk blocks (the
    /// pooled bound when there are no tiers).
    pub pooled_tiered: f64,
    /// That cache's size in blocks.
    pub pooled_tiered_blocks: usize,
    /// TTFT with the ceiling's hits and no waiting, ms.
    pub no_queue_floor_ms: Percentiles,
}

/// Every request's chained block hashes, in trace order.
pub fn chains(trace: &Trace) -> Vec<Vec<kvfleet_core::BlockHash>> {
    trace
        .records
        .iter()
        .map(|r| chained_hashes(tenant_seed(r.tenant.as_deref()), &r.hash_ids))
        .collect()
}

/// Distinct blocks of `trace`.
pub fn distinct_blocks_of(trace: &Trace) -> usize {
    let mut seen: BlockHashMap<()> = BlockHashMap::default();
    for c in chains(trace) {
        seen.extend(c.into_iter().map(|h| (h, ())));
    }
    seen.len()
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

/// Each request's uncached prompt tokens with the ceiling's hits (at least one is
/// computed, as in the simulator), given its `chains`.
fn ceiling_uncached(trace: &Trace, chains: &[Vec<BlockHash>]) -> Vec<usize> {
    let mut seen: BlockHashMap<()> = BlockHashMap::default();
    trace
        .records
        .iter()
        .zip(chains)
        .map(|(r, c)| {
            let hits = c.iter().take_while(|h| seen.contains_key(h)).count();
            let cached = (hits * r.block_size()).min(r.input_length.saturating_sub(1));
            seen.extend(c.iter().map(|&h| (h, ())));
            r.input_length - cached
        })
        .collect()
}

/// Whether any request of `trace` waits for a parent (only then does the order, and
/// so the pooled bound, depend on the replay speed).
pub fn has_parents(trace: &Trace) -> bool {
    trace.records.iter().any(|r| r.parent_id.is_some())
}

/// A trace replayed with no queueing, at any speed: what does not depend on the speed
/// (chains, parents, each request's no-queue service time) worked out once, for a
/// bisection over speeds.
pub struct NoQueueReplay<'a> {
    trace: &'a Trace,
    chains: Vec<Vec<BlockHash>>,
    parents: Vec<Option<usize>>,
    /// Each request's no-queue prefill (the ceiling's hits) plus its decode steps at
    /// batch 1, ms.
    service_ms: Vec<f64>,
}

impl<'a> NoQueueReplay<'a> {
    /// `trace` under `cost`.
    pub fn new(trace: &'a Trace, cost: &CostModel) -> Self {
        let chains = chains(trace);
        let service_ms = ceiling_uncached(trace, &chains)
            .into_iter()
            .zip(&trace.records)
            .map(|(uncached, r)| {
                let steps = r.output_length.saturating_sub(1) as f64;
                cost.prefill_ms(uncached) + steps * cost.decode_step_ms(1)
            })
            .collect();
        Self {
            trace,
            chains,
            parents: trace.parent_indices(),
            service_ms,
        }
    }

    /// The order the requests start in, timestamps multiplied by `scale`: a request
    /// starts at its timestamp or, if later, when its parent finished. Ties keep trace
    /// order.
    pub fn order(&self, scale: f64) -> Vec<usize> {
        let n = self.trace.records.len();
        let mut start = vec![0.0f64; n];
        let mut done = vec![0.0f64; n];
        for (i, r) in self.trace.records.iter().enumerate() {
            // Parents come earlier in a trace (the reader checks), so `done` is set.
            let after = self.parents[i]
                .filter(|&p| p < i)
                .map_or(f64::NEG_INFINITY, |p| done[p]);
            start[i] = (r.timestamp as f64 * scale).max(after);
            done[i] = start[i] + self.service_ms[i];
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| start[a].total_cmp(&start[b]).then(a.cmp(&b)));
        order
    }

    /// The pooled bound (one LRU cache of `blocks` blocks) over [`Self::order`] at
    /// `scale`.
    pub fn pooled(&self, blocks: usize, scale: f64) -> f64 {
        let mut lru = LruBlockCache::new(blocks);
        let (mut hit, mut total) = (0usize, 0usize);
        for i in self.order(scale) {
            let c = &self.chains[i];
            hit += lru.match_prefix(c);
            total += c.len();
            lru.insert_chain(c);
        }
        ratio(hit, total)
    }
}

/// The pooled bound (one LRU cache of `blocks` blocks) over the order `trace`'s
/// requests start in at speed-up `scale` when nothing queues (a request waits for its
/// parent's no-queue prefill with the ceiling's hits, then its decode steps at batch
/// 1). For many speeds, prepare a [`NoQueueReplay`] once.
pub fn pooled_no_queue(trace: &Trace, blocks: usize, scale: f64, cost: &CostModel) -> f64 {
    NoQueueReplay::new(trace, cost).pooled(blocks, scale)
}

/// Each request's TTFT with the ceiling's hits and no waiting: its uncached prefill
/// under `cost` (at least one token is computed, as in the simulator).
pub fn no_queue_floor(trace: &Trace, cost: &CostModel) -> Percentiles {
    let mut ttft: Vec<f64> = ceiling_uncached(trace, &chains(trace))
        .into_iter()
        .map(|n| cost.prefill_ms(n))
        .collect();
    Percentiles::of(&mut ttft)
}

/// Each request's TTFT, ms, in a fleet of `workers` prefill lanes that share one
/// first-come-first-served queue and whose `workers × blocks_per_worker` blocks form
/// one LRU cache (the pooled bound's): a request takes the leading blocks of its
/// prompt that cache holds when it starts, computes the rest, and starts on the lane
/// that frees first. A request with a parent arrives at its timestamp or, if later,
/// when its parent finished (its first token, then its decode steps at batch 1), as in
/// the simulator. Pooled lanes and pooled memory are what no real fleet has, so this
/// is a reference for how much of a policy's queueing the load and the memory alone
/// cause, not a strict bound on every percentile (neither first-come-first-served nor
/// LRU is optimal for a p99).
pub fn pooled_queue(
    trace: &Trace,
    workers: usize,
    blocks_per_worker: usize,
    cost: &CostModel,
) -> Percentiles {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    // Times as integer nanoseconds, for the heaps' ordering.
    let ns = |ms: f64| (ms * 1e6).round().max(0.0) as u64;
    let recs = &trace.records;
    let chains = chains(trace);
    let mut lru = LruBlockCache::new(workers.max(1) * blocks_per_worker);
    let parents = trace.parent_indices();
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); recs.len()];
    let mut ready = BinaryHeap::new();
    for (i, r) in recs.iter().enumerate() {
        match parents[i] {
            Some(p) => children[p].push(i),
            None => ready.push(Reverse((ns(r.timestamp as f64), i))),
        }
    }
    let mut lanes: BinaryHeap<Reverse<u64>> = (0..workers.max(1)).map(|_| Reverse(0)).collect();
    let mut ttft = Vec::with_capacity(recs.len());
    // Requests are taken in arrival order; a child becomes known when its parent
    // starts, and arrives after it finishes, so no later arrival is ever taken first.
    while let Some(Reverse((arrival, i))) = ready.pop() {
        let Some(Reverse(free)) = lanes.pop() else {
            break;
        };
        let r = &recs[i];
        let hits = lru.match_prefix(&chains[i]);
        lru.insert_chain(&chains[i]);
        let cached = (hits * r.block_size()).min(r.input_length.saturating_sub(1));
        let first_token = arrival.max(free) + ns(cost.prefill_ms(r.input_length - cached));
        lanes.push(Reverse(first_token));
        ttft.push((first_token - arrival) as f64 / 1e6);
        let steps = r.output_length.saturating_sub(1) as f64;
        let done = first_token + ns(steps * cost.decode_step_ms(1));
        for &k in &children[i] {
            ready.push(Reverse((ns(recs[k].timestamp as f64).max(done), k)));
        }
    }
    Percentiles::of(&mut ttft)
}

/// The bounds for a fleet of `workers × blocks_per_worker` blocks under `cost`.
pub fn bounds(trace: &Trace, workers: usize, blocks_per_worker: usize, cost: &CostModel) -> Bounds {
    bounds_with_tiers(trace, workers, blocks_per_worker, 0, cost)
}

/// [`bounds`] for workers that also have `lower_blocks_per_worker` host plus disk
/// blocks.
pub fn bounds_with_tiers(
    trace: &Trace,
    workers: usize,
    blocks_per_worker: usize,
    lower_blocks_per_worker: usize,
    cost: &CostModel,
) -> Bounds {
    let pooled_blocks = workers * blocks_per_worker;
    let pooled_bound = pooled(trace, pooled_blocks);
    let pooled_tiered_blocks = workers * (blocks_per_worker + lower_blocks_per_worker);
    Bounds {
        ceiling: ceiling(trace),
        pooled: pooled_bound,
        pooled_blocks,
        pooled_tiered: if lower_blocks_per_worker == 0 {
            pooled_bound
        } else {
            pooled(trace, pooled_tiered_blocks)
        },
        pooled_tiered_blocks,
        no_queue_floor_ms: no_queue_floor(trace, cost),
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
        // Two workers of 2 device + 0 lower blocks pool to 4; with 48 lower blocks
        // each, the pooled tiers hold everything.
        let cost = CostModel::h200_llama8b();
        let b = bounds_with_tiers(&t, 2, 2, 0, &cost);
        assert_eq!((b.pooled_blocks, b.pooled_tiered_blocks), (4, 4));
        assert_eq!(b.pooled_tiered, b.pooled);
        let b = bounds_with_tiers(&t, 2, 2, 48, &cost);
        assert_eq!(b.pooled_tiered_blocks, 100);
        assert!((b.pooled_tiered - ceiling(&t)).abs() < 1e-12);
        assert!((b.pooled - p4).abs() < 1e-12);
        // Tenants never share.
        let mut t2 = t.clone();
        t2.records[2].tenant = Some("b".into());
        assert!((ceiling(&t2) - 3.0 / 12.0).abs() < 1e-12);
    }

    #[test]
    fn the_pooled_queue_serves_in_arrival_order_on_the_lane_free_first() {
        let cost = CostModel::h200_llama8b();
        let p = |n| cost.prefill_ms(n);
        // Three cold 12-token prompts at once, then one at 1 ms.
        let t = Trace {
            records: vec![
                rec(0, &[1, 2, 3]),
                rec(0, &[4, 5, 6]),
                rec(0, &[7, 8, 9]),
                rec(1, &[10, 11, 12]),
            ],
        };
        // One lane: each waits for those before it.
        let one = pooled_queue(&t, 1, 100, &cost);
        let want1 = [p(12), 2.0 * p(12), 3.0 * p(12), 4.0 * p(12) - 1.0];
        assert!((one.p99 - want1[3]).abs() < 1e-6, "{one:?}");
        // Two lanes: the third waits for the first lane, the fourth for the second.
        let two = pooled_queue(&t, 2, 100, &cost);
        assert!(
            (two.p99 - (2.0 * p(12) - 1.0).max(2.0 * p(12))).abs() < 1e-6,
            "{two:?}"
        );
        // As many lanes as requests: nobody waits, and the queue is the floor.
        assert_eq!(pooled_queue(&t, 4, 100, &cost), no_queue_floor(&t, &cost));
        // A child arrives when its parent has finished: its first token, then one
        // decode step per output token after the first.
        let mut t = Trace {
            records: vec![rec(0, &[1, 2, 3]), rec(0, &[1, 2, 3, 4])],
        };
        t.records[0].id = Some(0);
        t.records[0].output_length = 3;
        t.records[1].id = Some(1);
        t.records[1].parent_id = Some(0);
        let q = pooled_queue(&t, 2, 100, &cost);
        // The child computes its last block only (12 of its 16 tokens are cached), and
        // never waits: its parent's lane is free again by then.
        assert!(
            (q.p99 - p(12)).abs() < 1e-6 && (q.p50 - p(4)).abs() < 1e-6,
            "{q:?}"
        );
        // With one block in all the pooled cache keeps only the parent's first block
        // (a chain is touched tail first, so its prefix outlives the rest): the child
        // computes 12 of its 16 tokens.
        let q = pooled_queue(&t, 1, 1, &cost);
        let child = 2.0 * q.mean - p(12);
        assert!((child - p(12)).abs() < 1e-6, "{q:?}");
        assert!(p(16) > p(12) && p(12) > p(4));
    }

    #[test]
    fn the_floor_is_each_requests_uncached_prefill() {
        let t = Trace {
            records: vec![
                rec(0, &[1, 2, 3]), // 12 tokens, none cached
                rec(1, &[1, 2, 3]), // all cached but the last token
                rec(2, &[1, 2, 7]), // 8 cached, 4 computed
                rec(3, &[9]),       // 4 computed
            ],
        };
        let cost = CostModel::h200_llama8b();
        let mut want = [12, 1, 4, 4].map(|n| cost.prefill_ms(n));
        let floor = no_queue_floor(&t, &cost);
        assert_eq!(floor, Percentiles::of(&mut want));
        assert_eq!(floor.p99, cost.prefill_ms(12));
        assert_eq!(floor.p50, cost.prefill_ms(4));
    }
}
