//! Copying cached blocks out of the engine from another thread, while it steps.
//!
//! A peer's `FetchBlocks` asks for blocks the engine holds; served on the engine
//! thread, it would wait for the step in progress (over a second for a long prefill
//! chunk on a CPU), and a pull goes precisely to a busy holder. So the pool shares a
//! [`ReadyIndex`] of its ready, hashed blocks, the backend shares a [`KvBlockReader`]
//! of its KV memory, and a [`BlockExporter`] combines them on any thread.
//!
//! Why a copy is never torn: a ready block's K/V never change while it stays in the
//! index. The pool removes a block from the index when it unpublishes it (eviction,
//! clearing), and only after that is the block handed out and written again. The
//! exporter looks blocks up, copies them, then looks again: a block whose index entry
//! is gone or was replaced meanwhile may have been rewritten during the copy, and it
//! and everything after it are dropped (the peer recomputes those).

use crate::block_pool::BlockId;
use crate::error::Result;
use crate::kv_tiers::KvBlockPayload;
use kvfleet_core::{BlockHash, BlockHashMap};
use std::sync::{Arc, Mutex, PoisonError};

/// Blocks copied under one round of layer locks: bounds how long a step can wait to
/// write a layer while a copy reads it.
const COPY_CHUNK: usize = 32;

/// Reads blocks out of a backend's KV memory from any thread.
pub trait KvBlockReader: Send + Sync {
    /// The K/V of each block, every layer, in the backend's block format (what
    /// [`crate::ModelBackend::read_block`] returns).
    fn read_blocks(&self, ids: &[BlockId]) -> Result<Vec<Vec<u8>>>;
}

/// Where a ready block sits, and which publication of it this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadyEntry {
    id: BlockId,
    parent: Option<BlockHash>,
    /// Distinguishes a block evicted and published again in the same place.
    generation: u64,
}

#[derive(Default)]
struct ReadyMap {
    blocks: BlockHashMap<ReadyEntry>,
    next_generation: u64,
}

/// The pool's ready, hashed blocks, kept by the pool and read by exporters.
#[derive(Default)]
pub struct ReadyIndex {
    map: Mutex<ReadyMap>,
}

impl ReadyIndex {
    /// Records that block `id` now holds the computed K/V of `hash`.
    pub(crate) fn insert(&self, hash: BlockHash, id: BlockId, parent: Option<BlockHash>) {
        let mut m = self.lock();
        let generation = m.next_generation;
        m.next_generation += 1;
        m.blocks.insert(
            hash,
            ReadyEntry {
                id,
                parent,
                generation,
            },
        );
    }

    /// Records that `hash`'s block may be rewritten from now on.
    pub(crate) fn remove(&self, hash: BlockHash) {
        self.lock().blocks.remove(&hash);
    }

    /// How many blocks the index holds.
    pub fn len(&self) -> usize {
        self.lock().blocks.len()
    }

    /// Where the index has `hash`'s block.
    pub fn id_of(&self, hash: BlockHash) -> Option<BlockId> {
        self.lock().blocks.get(&hash).map(|e| e.id)
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn leading_run(&self, hashes: &[BlockHash]) -> Vec<(BlockHash, ReadyEntry)> {
        let m = self.lock();
        hashes
            .iter()
            .map_while(|h| m.blocks.get(h).map(|e| (*h, *e)))
            .collect()
    }

    fn entries(&self, hashes: &[BlockHash]) -> Vec<(BlockHash, ReadyEntry)> {
        let m = self.lock();
        hashes
            .iter()
            .filter_map(|h| m.blocks.get(h).map(|e| (*h, *e)))
            .collect()
    }

    /// Whether each of `entries` is still published as it was.
    fn each_still_held(&self, entries: &[(BlockHash, ReadyEntry)]) -> Vec<bool> {
        let m = self.lock();
        entries
            .iter()
            .map(|(h, e)| m.blocks.get(h) == Some(e))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReadyMap> {
        // The map is consistent after every operation: a panic elsewhere cannot tear it.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Copies the engine's ready blocks out from any thread (see the module docs).
#[derive(Clone)]
pub struct BlockExporter {
    index: Arc<ReadyIndex>,
    reader: Arc<dyn KvBlockReader>,
}

impl BlockExporter {
    /// An exporter over the pool's index and the backend's memory.
    pub fn new(index: Arc<ReadyIndex>, reader: Arc<dyn KvBlockReader>) -> Self {
        Self { index, reader }
    }

    /// An exporter over the same pool that copies through `reader` instead (one that
    /// wraps the backend's, to count or slow the copies).
    pub fn with_reader(&self, reader: Arc<dyn KvBlockReader>) -> Self {
        Self {
            index: Arc::clone(&self.index),
            reader,
        }
    }

    /// The leading run of `hashes` held ready in the device pool, as payloads a peer
    /// can import; stops at the first block it lacks (or that was evicted while being
    /// copied). Blocks in lower tiers are the engine's to export.
    pub fn export(&self, hashes: &[BlockHash]) -> Result<Vec<KvBlockPayload>> {
        let mut out = Vec::new();
        for chunk in hashes.chunks(COPY_CHUNK) {
            let copied = self.copy_entries(&self.index.leading_run(chunk))?;
            let before = out.len();
            out.extend(copied.into_iter().map_while(|b| b));
            if out.len() - before < chunk.len() {
                break;
            }
        }
        Ok(out)
    }

    /// Each of `hashes` held ready in the device pool, copied, in order; a block that
    /// is not held, or was evicted while being copied, is left out (alone: unlike
    /// [`BlockExporter::export`], a gap does not end the copy). What the write-out
    /// thread copies down to the host tier.
    pub fn copy_each(&self, hashes: &[BlockHash]) -> Result<Vec<KvBlockPayload>> {
        let mut out = Vec::new();
        for chunk in hashes.chunks(COPY_CHUNK) {
            out.extend(
                self.copy_entries(&self.index.entries(chunk))?
                    .into_iter()
                    .flatten(),
            );
        }
        Ok(out)
    }

    /// Copies the blocks of `entries`, then looks again: `None` for a block whose
    /// entry is gone or was replaced meanwhile (it may have been rewritten mid-copy).
    fn copy_entries(
        &self,
        entries: &[(BlockHash, ReadyEntry)],
    ) -> Result<Vec<Option<KvBlockPayload>>> {
        let ids: Vec<BlockId> = entries.iter().map(|(_, e)| e.id).collect();
        let bytes = self.reader.read_blocks(&ids)?;
        let held = self.index.each_still_held(entries);
        Ok(entries
            .iter()
            .zip(bytes)
            .zip(held)
            .map(|(((hash, e), bytes), held)| {
                held.then(|| KvBlockPayload {
                    hash: *hash,
                    parent: e.parent,
                    bytes: bytes.into(),
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader whose copy of block `evict` is interrupted by the pool evicting it
    /// and, if `republish`, publishing the same hash there again (ABA).
    struct EvictingReader {
        index: Arc<ReadyIndex>,
        evict: BlockHash,
        republish: bool,
    }

    impl KvBlockReader for EvictingReader {
        fn read_blocks(&self, ids: &[BlockId]) -> Result<Vec<Vec<u8>>> {
            if let Some(id) = self.index.id_of(self.evict) {
                self.index.remove(self.evict);
                if self.republish {
                    self.index.insert(self.evict, id, None);
                }
            }
            Ok(ids.iter().map(|&id| vec![id as u8; 4]).collect())
        }
    }

    fn index_of(n: u64) -> Arc<ReadyIndex> {
        let index = Arc::new(ReadyIndex::default());
        for i in 0..n {
            let parent = i.checked_sub(1).map(|p| BlockHash(100 + p));
            index.insert(BlockHash(100 + i), (i * 10) as BlockId, parent);
        }
        index
    }

    #[test]
    fn a_block_evicted_during_its_copy_is_dropped_with_everything_after_it() {
        let hashes: Vec<BlockHash> = (0..5).map(|i| BlockHash(100 + i)).collect();
        for republish in [false, true] {
            let index = index_of(5);
            let reader = EvictingReader {
                index: Arc::clone(&index),
                evict: BlockHash(102),
                republish,
            };
            let got = BlockExporter::new(index, Arc::new(reader))
                .export(&hashes)
                .unwrap();
            let served: Vec<u64> = got.iter().map(|b| b.hash.0).collect();
            assert_eq!(served, vec![100, 101], "republish {republish}");
            assert_eq!(got[1].parent, Some(BlockHash(100)));
            assert_eq!(&got[1].bytes[..], &[10u8; 4]);
        }
    }

    #[test]
    fn copy_each_skips_gaps_and_blocks_evicted_during_the_copy() {
        let index = index_of(4);
        let reader = EvictingReader {
            index: Arc::clone(&index),
            evict: BlockHash(101),
            republish: true,
        };
        let exporter = BlockExporter::new(index, Arc::new(reader));
        let asked = [BlockHash(103), BlockHash(7), BlockHash(101), BlockHash(100)];
        let got = exporter.copy_each(&asked).unwrap();
        let served: Vec<u64> = got.iter().map(|b| b.hash.0).collect();
        // 7 is not held; 101 was evicted and republished during its copy (ABA).
        assert_eq!(served, vec![103, 100]);
        assert_eq!(got[0].parent, Some(BlockHash(102)));
        assert_eq!(&got[0].bytes[..], &[30u8; 4]);
    }

    #[test]
    fn an_untouched_run_is_served_up_to_the_first_block_not_held() {
        let index = index_of(3);
        let reader = EvictingReader {
            index: Arc::clone(&index),
            evict: BlockHash(999),
            republish: false,
        };
        let exporter = BlockExporter::new(index, Arc::new(reader));
        // More than one copy chunk, and a gap after the third block.
        let mut hashes: Vec<BlockHash> = (0..3).map(|i| BlockHash(100 + i)).collect();
        hashes.extend((0..COPY_CHUNK as u64).map(|i| BlockHash(5000 + i)));
        let got = exporter.export(&hashes).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[2].parent, Some(BlockHash(101)));
        assert_eq!(&got[2].bytes[..], &[20u8; 4]);
        assert!(exporter.export(&[BlockHash(7)]).unwrap().is_empty());
    }
}
