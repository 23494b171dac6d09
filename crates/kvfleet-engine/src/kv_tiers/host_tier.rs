//! The host-memory tier: blocks evicted from the device pool, kept in an LRU bounded in
//! bytes. Payloads are shared (`Arc`), so handing one to the disk writer or back to the
//! device never copies it twice.

use super::KvBlockPayload;
use kvfleet_core::byte_lru::ByteLru;
use kvfleet_core::BlockHash;

/// Bookkeeping bytes charged per entry on top of its payload (map slot, list node).
const ENTRY_OVERHEAD: usize = 96;

/// Host-memory blocks, least recently used out first.
pub struct HostTier {
    lru: ByteLru<BlockHash, KvBlockPayload>,
}

impl HostTier {
    /// A tier holding at most `max_bytes` (payloads plus bookkeeping).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            lru: ByteLru::new(max_bytes),
        }
    }

    /// Whether `hash` is held.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.lru.contains(&hash)
    }

    /// The block under `hash`, marked recently used.
    pub fn get(&mut self, hash: BlockHash) -> Option<KvBlockPayload> {
        self.lru.get(&hash).cloned()
    }

    /// Adds a block; returns the blocks pushed out to make room (oldest first), and
    /// whether the new one was kept (false: larger than the whole tier).
    pub fn insert(&mut self, block: KvBlockPayload) -> (bool, Vec<KvBlockPayload>) {
        let size = block.bytes.len() + ENTRY_OVERHEAD;
        let mut out = Vec::new();
        if self.lru.contains(&block.hash) {
            self.lru.get(&block.hash);
            return (true, out);
        }
        if size > self.lru.max_bytes() {
            return (false, out);
        }
        while self.lru.bytes() + size > self.lru.max_bytes() {
            match self.lru.pop_lru() {
                Some((_, b)) => out.push(b),
                None => break,
            }
        }
        let kept = self.lru.insert(block.hash, block, size);
        (kept, out)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// Bytes held, bookkeeping included.
    pub fn bytes(&self) -> usize {
        self.lru.bytes()
    }

    /// Every block held, for a cache dump.
    pub fn blocks(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        self.lru.iter().map(|(h, b)| (*h, b.parent)).collect()
    }

    /// Drops everything; returns what was held.
    pub fn clear(&mut self) -> Vec<BlockHash> {
        let mut out = Vec::new();
        while let Some((h, _)) = self.lru.pop_lru() {
            out.push(h);
        }
        out
    }
}
