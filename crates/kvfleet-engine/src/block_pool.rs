//! The block pool: a fixed set of KV blocks, content-addressed by chained hash.
//!
//! Blocks are reference counted. A block whose count drops to zero goes on a free list
//! kept in LRU order but *keeps its hash*: it is still a cache hit until its memory is
//! handed out again, and only then is it evicted (a `Removed` event). Unhashed free
//! blocks sit at the LRU end so they are reused before any cached block.
//!
//! A hashed block is either *ready* (its K/V are computed) or *in flight* (some
//! sequence, its owner, is computing it now). Publishing a hash when a block is
//! allocated, not when it is computed, is what lets a sibling arriving a moment later
//! take the block by reference and wait for it instead of computing it again.
//!
//! Every operation is O(1): the free list is an intrusive doubly linked list over the
//! block array, and the hash map is keyed by the hash itself.
//!
//! Once asked for one, the pool also keeps a [`ReadyIndex`] of its ready blocks, which
//! other threads read to copy blocks out while the engine steps.

use crate::block_export::ReadyIndex;
use crate::kv_events::{push_coalesced, KvEventKind, Medium};
use kvfleet_core::{BlockHash, BlockHashMap};
use std::sync::Arc;

/// Index of a KV block in the pool (and in the KV memory).
pub type BlockId = u32;

/// Identifies the sequence computing an in-flight block.
pub type OwnerId = u64;

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct BlockMeta {
    ref_count: u32,
    hash: Option<BlockHash>,
    parent: Option<BlockHash>,
    ready: bool,
    owner: Option<OwnerId>,
    prev: u32,
    next: u32,
    in_free_list: bool,
}

/// A cached block [`BlockPool::next_evictions`] lists: the allocation that would evict
/// it (0: the next one), where it is, and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Eviction {
    /// How many allocations come before the one that evicts it.
    pub position: usize,
    /// The block.
    pub id: BlockId,
    /// Its hash.
    pub hash: BlockHash,
    /// Its parent's hash.
    pub parent: Option<BlockHash>,
}

/// Reference-counted, hash-addressed KV blocks with an LRU free list.
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    by_hash: BlockHashMap<BlockId>,
    head: u32,
    tail: u32,
    free_len: usize,
    ready_cached: usize,
    events: Vec<KvEventKind>,
    ready_index: Option<Arc<ReadyIndex>>,
}

impl BlockPool {
    /// A pool of `num_blocks` free, unhashed blocks.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        let mut pool = BlockPool {
            blocks: Vec::with_capacity(num_blocks),
            by_hash: BlockHashMap::default(),
            head: NIL,
            tail: NIL,
            free_len: 0,
            ready_cached: 0,
            events: Vec::new(),
            ready_index: None,
        };
        for i in 0..num_blocks {
            pool.blocks.push(BlockMeta {
                ref_count: 0,
                hash: None,
                parent: None,
                ready: false,
                owner: None,
                prev: NIL,
                next: NIL,
                in_free_list: false,
            });
            pool.push_mru(i as u32);
        }
        pool
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (unused, whether or not they still cache a prefix).
    pub fn num_free(&self) -> usize {
        self.free_len
    }

    /// Blocks holding a ready, hashed prefix block (in use or idle).
    pub fn num_cached(&self) -> usize {
        self.ready_cached
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_in_use(&self) -> usize {
        self.blocks.len() - self.free_len
    }

    /// Takes the least recently used free block, evicting the prefix block it cached,
    /// if any. Returns `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        if let Some(h) = self.blocks[id as usize].hash {
            self.unpublish(id);
            push_coalesced(
                &mut self.events,
                KvEventKind::Removed {
                    block_hashes: vec![h],
                    medium: Medium::Device,
                },
            );
        }
        let b = &mut self.blocks[id as usize];
        b.ref_count = 1;
        b.ready = false;
        b.owner = None;
        Some(id)
    }

    /// Takes a reference to the block cached (ready or in flight) under `hash`.
    pub fn acquire(&mut self, hash: BlockHash) -> Option<BlockId> {
        let id = *self.by_hash.get(&hash)?;
        if self.blocks[id as usize].in_free_list {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_count += 1;
        Some(id)
    }

    /// Makes the idle block cached under `hash` the most recently used, so that it is
    /// evicted last; a block in use cannot be evicted and is left as it is. Returns
    /// whether `hash` is cached.
    pub fn touch(&mut self, hash: BlockHash) -> bool {
        let Some(&id) = self.by_hash.get(&hash) else {
            return false;
        };
        if self.blocks[id as usize].in_free_list {
            self.unlink(id);
            self.push_mru(id);
        }
        true
    }

    /// The block cached under `hash`, without taking a reference.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    /// Names a freshly allocated block by the hash of the tokens `owner` is about to
    /// compute into it, so that others can share it while it is in flight. Returns
    /// false (and leaves the block private) when the hash is already cached elsewhere.
    pub fn publish_in_flight(
        &mut self,
        id: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        owner: OwnerId,
    ) -> bool {
        if self.by_hash.contains_key(&hash) || self.blocks[id as usize].hash.is_some() {
            return false;
        }
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.ref_count > 0);
        b.hash = Some(hash);
        b.parent = parent;
        b.ready = false;
        b.owner = Some(owner);
        self.by_hash.insert(hash, id);
        true
    }

    /// Names a private block whose K/V are already computed and marks it ready (a
    /// block filled during decode). Returns false when the hash is cached elsewhere.
    pub fn publish_ready(
        &mut self,
        id: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
    ) -> bool {
        let owner = OwnerId::MAX;
        if !self.publish_in_flight(id, hash, parent, owner) {
            return false;
        }
        self.mark_ready(id);
        true
    }

    /// The block's K/V are now fully computed. A hashed block becomes a cache hit
    /// and a `Stored` event is recorded.
    pub fn mark_ready(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.ready {
            return;
        }
        b.ready = true;
        b.owner = None;
        if let Some(h) = b.hash {
            let parent = b.parent;
            self.ready_cached += 1;
            if let Some(index) = &self.ready_index {
                index.insert(h, id, parent);
            }
            push_coalesced(
                &mut self.events,
                KvEventKind::Stored {
                    parent_hash: parent,
                    block_hashes: vec![h],
                    medium: Medium::Device,
                },
            );
        }
    }

    /// Whether the block's K/V are computed.
    pub fn is_ready(&self, id: BlockId) -> bool {
        self.blocks[id as usize].ready
    }

    /// The sequence computing this in-flight block, if any.
    pub fn owner(&self, id: BlockId) -> Option<OwnerId> {
        self.blocks[id as usize].owner
    }

    /// Makes `owner` responsible for computing an in-flight block whose previous owner
    /// gave it up. Returns whether `owner` now owns it.
    pub fn claim(&mut self, id: BlockId, owner: OwnerId) -> bool {
        let b = &mut self.blocks[id as usize];
        if b.ready {
            return false;
        }
        match b.owner {
            None => {
                b.owner = Some(owner);
                true
            }
            Some(o) => o == owner,
        }
    }

    /// The hash a block is published under, if any.
    pub fn hash_of(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks[id as usize].hash
    }

    /// The parent hash a block is published with, if any.
    pub fn parent_of(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks[id as usize].parent
    }

    /// Current reference count of a block.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_count
    }

    /// Adds a reference to a block already held (fork children share their parent's blocks).
    pub fn share(&mut self, id: BlockId) {
        debug_assert!(self.blocks[id as usize].ref_count > 0);
        self.blocks[id as usize].ref_count += 1;
    }

    /// Drops one reference held by `holder`. At zero, a ready hashed block joins the MRU
    /// end of the free list and stays cached; an in-flight block nobody will finish is
    /// unpublished; a private block is queued for reuse first. If `holder` owned the
    /// in-flight block, ownership is released so a remaining sharer can take it over.
    pub fn release(&mut self, id: BlockId, holder: OwnerId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.ref_count > 0, "release of a free block");
        if b.ref_count == 0 {
            return;
        }
        b.ref_count -= 1;
        if b.owner == Some(holder) {
            b.owner = None;
        }
        if b.ref_count > 0 {
            return;
        }
        match (b.hash.is_some(), b.ready) {
            (true, true) => self.push_mru(id),
            (true, false) => {
                self.unpublish(id);
                self.push_lru(id);
            }
            (false, _) => self.push_lru(id),
        }
    }

    /// Drops every cached hash (in use or not); in-use blocks become private.
    pub fn clear(&mut self) {
        for id in 0..self.blocks.len() {
            if self.blocks[id].hash.is_some() {
                self.unpublish(id as BlockId);
            }
        }
        self.events.push(KvEventKind::Cleared);
    }

    /// The index of ready blocks that other threads may copy out, kept from now on
    /// (created, with the blocks ready now, on the first call).
    pub fn ready_index(&mut self) -> Arc<ReadyIndex> {
        if let Some(index) = &self.ready_index {
            return Arc::clone(index);
        }
        let index = Arc::new(ReadyIndex::default());
        for (id, b) in self.blocks.iter().enumerate() {
            if let (Some(h), true) = (b.hash, b.ready) {
                index.insert(h, id as BlockId, b.parent);
            }
        }
        self.ready_index = Some(Arc::clone(&index));
        index
    }

    /// Every ready cached block with its parent, for a router's resync (`CacheDump`).
    pub fn cached_blocks(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        self.blocks
            .iter()
            .filter(|b| b.ready)
            .filter_map(|b| b.hash.map(|h| (h, b.parent)))
            .collect()
    }

    /// The cached (hashed, ready) blocks among the next `n` blocks [`BlockPool::allocate`]
    /// would hand out, in that order: what a lower tier must have copied before the
    /// next `n` allocations, or lose.
    pub fn next_evictions(&self, n: usize) -> Vec<Eviction> {
        let mut out = Vec::new();
        let mut cur = self.head;
        for position in 0..n {
            if cur == NIL {
                break;
            }
            let b = &self.blocks[cur as usize];
            if let (Some(hash), true) = (b.hash, b.ready) {
                out.push(Eviction {
                    position,
                    id: cur,
                    hash,
                    parent: b.parent,
                });
            }
            cur = b.next;
        }
        out
    }

    /// Takes the events recorded since the last call, in order.
    pub fn drain_events(&mut self) -> Vec<KvEventKind> {
        std::mem::take(&mut self.events)
    }

    /// Checks every structural invariant; for tests. Returns a description of the
    /// first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.blocks.len()];
        let mut n = 0;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let b = &self.blocks[cur as usize];
            if seen[cur as usize] {
                return Err(format!("free list cycles at {cur}"));
            }
            seen[cur as usize] = true;
            if !b.in_free_list || b.ref_count != 0 || b.prev != prev {
                return Err(format!("free list entry {cur} inconsistent: {b:?}"));
            }
            n += 1;
            prev = cur;
            cur = b.next;
        }
        if prev != self.tail || n != self.free_len {
            return Err(format!(
                "free list tail/len wrong: len {n} vs {}",
                self.free_len
            ));
        }
        let mut ready = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            if (b.ref_count == 0) != seen[i] {
                return Err(format!(
                    "block {i} refcount {} but free-list={}",
                    b.ref_count, seen[i]
                ));
            }
            if let Some(h) = b.hash {
                if self.by_hash.get(&h) != Some(&(i as BlockId)) {
                    return Err(format!("block {i} hashed {h} but map disagrees"));
                }
                if b.ready {
                    ready += 1;
                } else if b.ref_count == 0 {
                    return Err(format!("in-flight block {i} has no holder"));
                }
            }
            if b.ready && b.owner.is_some() {
                return Err(format!("ready block {i} still has an owner"));
            }
        }
        if ready != self.ready_cached {
            return Err(format!("ready count {ready} vs {}", self.ready_cached));
        }
        if let Some(index) = &self.ready_index {
            // Exactly the ready hashed blocks, each where the pool has it.
            if index.len() != ready {
                return Err(format!("ready index holds {} of {ready}", index.len()));
            }
            for (i, b) in self.blocks.iter().enumerate() {
                if let (Some(h), true) = (b.hash, b.ready) {
                    if index.id_of(h) != Some(i as BlockId) {
                        return Err(format!("ready index misplaces block {i} ({h})"));
                    }
                }
            }
        }
        for (h, id) in &self.by_hash {
            if self.blocks[*id as usize].hash != Some(*h) {
                return Err(format!("map entry {h} -> {id} stale"));
            }
        }
        Ok(())
    }

    fn unpublish(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if let Some(h) = b.hash.take() {
            self.by_hash.remove(&h);
            if b.ready {
                self.ready_cached -= 1;
                // Before the block can be handed out and rewritten.
                if let Some(index) = &self.ready_index {
                    index.remove(h);
                }
            }
        }
        b.parent = None;
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            debug_assert!(b.in_free_list);
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free_list = false;
        self.free_len -= 1;
    }

    fn push_mru(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free_list = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.free_len += 1;
    }

    fn push_lru(&mut self, id: BlockId) {
        let head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = NIL;
            b.next = head;
            b.in_free_list = true;
        }
        if head == NIL {
            self.tail = id;
        } else {
            self.blocks[head as usize].prev = id;
        }
        self.head = id;
        self.free_len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn cached_blocks_survive_release_until_reused() {
        let mut p = BlockPool::new(2);
        let a = p.allocate().unwrap();
        assert!(p.publish_in_flight(a, h(1), None, 7));
        p.mark_ready(a);
        p.release(a, 7);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.lookup(h(1)), Some(a), "released block is still a hit");
        // The unhashed block is reused first.
        let b = p.allocate().unwrap();
        assert_ne!(a, b);
        assert_eq!(p.lookup(h(1)), Some(a));
        // Then the cached one is evicted.
        let c = p.allocate().unwrap();
        assert_eq!(c, a);
        assert_eq!(p.lookup(h(1)), None);
        let ev = p.drain_events();
        assert_eq!(
            ev,
            vec![
                KvEventKind::Stored {
                    parent_hash: None,
                    block_hashes: vec![h(1)],
                    medium: Medium::Device,
                },
                KvEventKind::Removed {
                    block_hashes: vec![h(1)],
                    medium: Medium::Device,
                },
            ]
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn tail_first_release_keeps_prefixes_longest() {
        let mut p = BlockPool::new(3);
        let ids: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        let mut parent = None;
        for (i, id) in ids.iter().enumerate() {
            let hh = h(10 + i as u64);
            assert!(p.publish_in_flight(*id, hh, parent, 1));
            p.mark_ready(*id);
            parent = Some(hh);
        }
        for id in ids.iter().rev() {
            p.release(*id, 1);
        }
        assert_eq!(p.allocate(), Some(ids[2]), "the suffix goes first");
        assert_eq!(p.allocate(), Some(ids[1]));
        assert_eq!(p.lookup(h(10)), Some(ids[0]), "the root outlives them");
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_touched_idle_block_is_evicted_last() {
        let mut p = BlockPool::new(2);
        let ids: Vec<_> = (0..2).map(|_| p.allocate().unwrap()).collect();
        for (i, id) in ids.iter().enumerate() {
            assert!(p.publish_in_flight(*id, h(20 + i as u64), None, 1));
            p.mark_ready(*id);
            p.release(*id, 1);
        }
        // h(20) was released first, so it would go first; touched, it goes last.
        assert!(p.touch(h(20)));
        assert!(!p.touch(h(99)), "not cached");
        assert_eq!(p.allocate(), Some(ids[1]));
        assert_eq!(p.lookup(h(20)), Some(ids[0]));
        p.check_invariants().unwrap();
    }

    #[test]
    fn in_flight_block_is_shared_then_unpublished_if_abandoned() {
        let mut p = BlockPool::new(2);
        let a = p.allocate().unwrap();
        assert!(p.publish_in_flight(a, h(5), None, 1));
        assert_eq!(p.acquire(h(5)), Some(a));
        assert!(!p.is_ready(a));
        assert_eq!(p.owner(a), Some(1));
        assert!(!p.claim(a, 2), "owner still computing");
        p.release(a, 1);
        assert_eq!(p.owner(a), None);
        assert!(p.claim(a, 2), "a sharer takes over");
        p.release(a, 2);
        assert_eq!(p.lookup(h(5)), None, "nobody will finish it: unpublished");
        assert!(p.drain_events().is_empty(), "never stored, never removed");
        p.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_publish_is_refused() {
        let mut p = BlockPool::new(2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.publish_ready(a, h(1), None));
        assert!(!p.publish_ready(b, h(1), None));
        assert_eq!(p.hash_of(b), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn stored_events_coalesce_along_a_chain() {
        let mut p = BlockPool::new(4);
        let mut parent = None;
        for i in 0..3 {
            let id = p.allocate().unwrap();
            p.publish_ready(id, h(i + 1), parent);
            parent = Some(h(i + 1));
        }
        assert_eq!(
            p.drain_events(),
            vec![KvEventKind::Stored {
                parent_hash: None,
                block_hashes: vec![h(1), h(2), h(3)],
                medium: Medium::Device,
            }]
        );
    }
}
