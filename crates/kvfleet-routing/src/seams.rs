//! The traits at the routing core's edges, so that what feeds it and what it is built
//! from can be named (and replaced) without reading [`KvRouter`]'s internals:
//!
//! - [`BlockIndex`] (the indexer): block hash → holding workers, fed by KV events.
//!   [`PrefixIndex`] is the implementation.
//! - [`RoutingPolicy`](crate::policy::RoutingPolicy) (the selector): picks a worker
//!   from scored candidates; one implementation per [`PolicyKind`](crate::PolicyKind).
//! - [`KvEventSink`] (the event sink): where a worker's KV events go in, by worker id.
//!   [`KvRouter`] is the implementation; the serving router's gRPC event follower and
//!   its Kafka consumer both feed one through it.

use crate::events::{CacheDump, RouterKvEvent};
use crate::kv_router::KvRouter;
use crate::prefix_index::{IndexError, Matches, PrefixIndex};
use crate::registry::WorkerIdx;
use kvfleet_core::BlockHash;

/// The block index: which workers hold which blocks, kept current by KV events.
pub trait BlockIndex {
    /// Applies one event of `worker` (in sequence order; a gap is refused).
    fn apply(&mut self, worker: WorkerIdx, event: &RouterKvEvent) -> Result<(), IndexError>;
    /// Replaces `worker`'s blocks with a cache dump taken at event `seq`.
    fn rebuild_worker(&mut self, worker: WorkerIdx, dump: &CacheDump, seq: u64);
    /// Forgets `worker`'s blocks.
    fn remove_worker(&mut self, worker: WorkerIdx);
    /// How deep each worker matches the chain `hashes`.
    fn find_matches(&self, hashes: &[BlockHash]) -> Matches;
    /// The last event seq applied for `worker` (0: none).
    fn last_seq(&self, worker: WorkerIdx) -> u64;
}

impl BlockIndex for PrefixIndex {
    fn apply(&mut self, worker: WorkerIdx, event: &RouterKvEvent) -> Result<(), IndexError> {
        PrefixIndex::apply(self, worker, event)
    }
    fn rebuild_worker(&mut self, worker: WorkerIdx, dump: &CacheDump, seq: u64) {
        PrefixIndex::rebuild_worker(self, worker, dump, seq)
    }
    fn remove_worker(&mut self, worker: WorkerIdx) {
        PrefixIndex::remove_worker(self, worker)
    }
    fn find_matches(&self, hashes: &[BlockHash]) -> Matches {
        PrefixIndex::find_matches(self, hashes)
    }
    fn last_seq(&self, worker: WorkerIdx) -> u64 {
        PrefixIndex::last_seq(self, worker)
    }
}

/// Where KV events go in, keyed by the worker's string id.
pub trait KvEventSink {
    /// Applies one event of worker `id`. [`IndexError::UnknownWorker`]: the worker is
    /// not (or no longer) followed; [`IndexError::Gap`]: events were lost, resync it.
    fn apply_event(&mut self, id: &str, event: &RouterKvEvent) -> Result<(), IndexError>;

    /// Applies `events` in order, stopping at the first error (later events of the
    /// batch would only widen a gap).
    fn apply_events<'a, I>(&mut self, id: &str, events: I) -> Result<(), IndexError>
    where
        I: IntoIterator<Item = &'a RouterKvEvent>,
        Self: Sized,
    {
        for e in events {
            self.apply_event(id, e)?;
        }
        Ok(())
    }
}

impl KvEventSink for KvRouter {
    fn apply_event(&mut self, id: &str, event: &RouterKvEvent) -> Result<(), IndexError> {
        KvRouter::apply_event(self, id, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::RouterKvEventKind;
    use crate::kv_router::RouterConfig;

    fn stored(seq: u64, parent: Option<u64>, hashes: &[u64]) -> RouterKvEvent {
        RouterKvEvent {
            seq,
            kind: RouterKvEventKind::Stored {
                medium: Default::default(),
                parent_hash: parent.map(BlockHash),
                block_hashes: hashes.iter().map(|h| BlockHash(*h)).collect(),
            },
        }
    }

    /// Drives any [`BlockIndex`] through one worker's events; the caller checks.
    fn feed<I: BlockIndex>(index: &mut I, w: WorkerIdx) -> Result<(), IndexError> {
        index.apply(w, &stored(1, None, &[10, 11]))?;
        index.apply(w, &stored(2, Some(11), &[12]))?;
        // seq 4 skips 3: refused, nothing applied.
        index.apply(w, &stored(4, Some(12), &[13]))
    }

    #[test]
    fn prefix_index_through_the_indexer_seam() {
        let mut index = PrefixIndex::new();
        let w = WorkerIdx(0);
        let err = feed(&mut index, w).unwrap_err();
        assert!(
            matches!(
                err,
                IndexError::Gap {
                    expected: 3,
                    got: 4,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(BlockIndex::last_seq(&index, w), 2);
        let chain: Vec<BlockHash> = [10, 11, 12, 13].map(BlockHash).to_vec();
        assert_eq!(BlockIndex::find_matches(&index, &chain).depth(w), 3);
        BlockIndex::remove_worker(&mut index, w);
        assert_eq!(BlockIndex::find_matches(&index, &chain).depth(w), 0);
    }

    #[test]
    fn kv_router_through_the_event_sink_seam() {
        let mut router = KvRouter::new(RouterConfig::default());
        let bs = router.block_size();
        router.add_worker("w0", bs).unwrap();
        let events = [stored(1, None, &[10, 11]), stored(2, Some(11), &[12])];
        router.apply_events("w0", events.iter()).unwrap();
        assert_eq!(router.last_seq("w0"), Some(2));
        let err = router.apply_events("nobody", events.iter()).unwrap_err();
        assert!(matches!(err, IndexError::UnknownWorker(_)), "{err:?}");
        let m = router.matches(&[BlockHash(10), BlockHash(11), BlockHash(12)], 0);
        assert_eq!(m.deepest(), 3);
    }
}
