//! An LRU cache of KV blocks addressed by chained hash, as a worker's prefix cache
//! behaves: a request reuses the leading blocks of its chain that are cached, then
//! every block of its chain becomes most recently used, tail first, so a prefix always
//! outlives the suffixes that hang off it (the engine releases blocks tail-first).
//!
//! A block a sequence holds is *pinned* ([`LruBlockCache::pin_chain`]): an engine's
//! pool never evicts a block in use, only the free ones, least recently released
//! first. A pinned block leaves the eviction order and rejoins it, as most recently
//! used, when its last holder lets go ([`LruBlockCache::unpin_chain`]). When every
//! block is pinned, a new one is cached beyond the capacity rather than evict a
//! held one (where an engine would make the request wait for blocks).
//!
//! A running sequence's blocks for its generated tokens are *anonymous*
//! ([`LruBlockCache::occupy`]): they take room in the pool, evicting as a new block
//! does, but no prefix can hit them.

use kvfleet_core::kv_events::Medium;
use kvfleet_core::{BlockHash, BlockHashMap};

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    hash: BlockHash,
    prev: u32,
    next: u32,
    /// Sequences holding the block; a pinned node is out of the eviction list.
    pins: u32,
    /// Out of the eviction list for the length of one `insert_chain`.
    detached: bool,
}

/// What one [`LruBlockCache::insert_chain`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChainChange {
    /// Runs of newly stored blocks: (parent hash, blocks), in prefix order.
    pub stored: Vec<(Option<BlockHash>, Vec<BlockHash>)>,
    /// Evicted blocks.
    pub removed: Vec<BlockHash>,
    /// What the worker's host and disk tiers stored and dropped, in order (empty
    /// without tiers).
    pub lower: Vec<LowerOp>,
}

/// One change to a lower tier of a simulated worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowerOp {
    /// The tier (host or disk).
    pub medium: Medium,
    /// Stored (`true`) or evicted (`false`).
    pub stored: bool,
    /// The block.
    pub hash: BlockHash,
}

/// A fixed-capacity LRU set of block hashes.
#[derive(Clone, Debug)]
pub struct LruBlockCache {
    capacity: usize,
    map: BlockHashMap<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    /// Blocks held without a hash ([`Self::occupy`]).
    anonymous: usize,
}

impl LruBlockCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            map: BlockHashMap::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            anonymous: 0,
        }
    }

    /// Blocks taken: cached ones and anonymous ones.
    fn used(&self) -> usize {
        self.map.len() + self.anonymous
    }

    /// Takes the unpinned cached block `h` out of the cache without evicting it (a
    /// sequence makes it its own again: its blocks are anonymous); returns whether it
    /// was there.
    pub fn take(&mut self, h: BlockHash) -> bool {
        match self.map.get(&h) {
            Some(&n) if self.nodes[n as usize].pins == 0 => {
                self.unlink(n);
                self.map.remove(&h);
                self.free.push(n);
                true
            }
            _ => false,
        }
    }

    /// Whether one more block can be taken without going past the capacity: a free
    /// slot, or an unpinned block to evict.
    pub fn has_room(&self) -> bool {
        self.used() < self.capacity || self.tail != NIL
    }

    /// Takes one anonymous block (a running sequence's next block of generated
    /// tokens), evicting the least recently used unpinned block when the pool is
    /// full; returns the block it evicted. When every block is pinned it is taken
    /// beyond the capacity (where an engine would preempt: see [`Self::has_room`]).
    pub fn occupy(&mut self) -> Option<BlockHash> {
        let evicted = (self.used() >= self.capacity && self.tail != NIL).then(|| self.evict_tail());
        self.anonymous += 1;
        evicted
    }

    /// Gives back `n` anonymous blocks; a pool grown past its capacity evicts back
    /// down to it (returned).
    pub fn vacate(&mut self, n: usize) -> Vec<BlockHash> {
        self.anonymous = self.anonymous.saturating_sub(n);
        self.evict_to_capacity()
    }

    /// Turns `blocks.len()` anonymous blocks into cached, unpinned ones named
    /// `blocks`, each made the most recently used in turn (a finished sequence's full
    /// blocks of generated tokens: the engine keeps them cached, though no trace's
    /// prompt asks for them). Returns what a pool over its capacity evicted.
    pub fn settle(&mut self, blocks: &[BlockHash]) -> Vec<BlockHash> {
        self.anonymous = self.anonymous.saturating_sub(blocks.len());
        let mut evicted = Vec::new();
        for &h in blocks {
            if !self.touch(h) {
                evicted.extend(self.push_new(h));
            }
        }
        evicted.extend(self.evict_to_capacity());
        evicted
    }

    /// Evicts unpinned blocks while the pool is over its capacity.
    fn evict_to_capacity(&mut self) -> Vec<BlockHash> {
        let mut evicted = Vec::new();
        while self.used() > self.capacity && self.tail != NIL {
            evicted.push(self.evict_tail());
        }
        evicted
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `h` is cached.
    pub fn contains(&self, h: BlockHash) -> bool {
        self.map.contains_key(&h)
    }

    /// Leading blocks of `chain` that are cached.
    pub fn match_prefix(&self, chain: &[BlockHash]) -> usize {
        chain
            .iter()
            .take_while(|h| self.map.contains_key(h))
            .count()
    }

    /// Makes every block of `chain` (at most `capacity` of its first blocks) cached and
    /// most recently used, tail first; returns what was stored and evicted.
    pub fn insert_chain(&mut self, chain: &[BlockHash]) -> ChainChange {
        let chain = &chain[..chain.len().min(self.capacity)];
        let mut change = ChainChange::default();
        let mut new = vec![false; chain.len()];
        // The chain's cached blocks leave the eviction order while its new blocks are
        // stored, and the new ones join it only at the end: they evict other blocks,
        // never the ones this request reuses or stores (an engine takes its cached
        // prefix before it allocates; evicting it here would store it again as computed
        // by a request charged only for its new blocks).
        for &h in chain {
            if let Some(&n) = self.map.get(&h) {
                let node = &self.nodes[n as usize];
                if node.pins == 0 && !node.detached {
                    self.unlink(n);
                    self.nodes[n as usize].detached = true;
                }
            }
        }
        for (i, &h) in chain.iter().enumerate() {
            if !self.map.contains_key(&h) {
                change.removed.extend(self.store_detached(h).1);
                new[i] = true;
            }
        }
        // Back in, tail first: the head ends up most recently used.
        for &h in chain.iter().rev() {
            if let Some(&n) = self.map.get(&h) {
                if self.nodes[n as usize].detached {
                    self.nodes[n as usize].detached = false;
                    self.push_front(n);
                }
            }
        }
        let mut i = 0;
        while i < chain.len() {
            if !new[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < chain.len() && new[i] {
                i += 1;
            }
            let parent = start.checked_sub(1).map(|p| chain[p]);
            change.stored.push((parent, chain[start..i].to_vec()));
        }
        change
    }

    /// Makes `h` most recently used if it is cached; returns whether it was.
    pub fn touch(&mut self, h: BlockHash) -> bool {
        match self.map.get(&h) {
            Some(&n) => {
                if self.nodes[n as usize].pins == 0 {
                    self.unlink(n);
                    self.push_front(n);
                }
                true
            }
            None => false,
        }
    }

    /// Whether a sequence holds block `h` ([`pin_chain`](Self::pin_chain)).
    pub fn pinned(&self, h: BlockHash) -> bool {
        self.map
            .get(&h)
            .is_some_and(|&n| self.nodes[n as usize].pins > 0)
    }

    /// A sequence holds the cached blocks of `chain`: none of them can be evicted
    /// until [`unpin_chain`](Self::unpin_chain) releases them.
    pub fn pin_chain(&mut self, chain: &[BlockHash]) {
        for h in chain {
            if let Some(&n) = self.map.get(h) {
                if self.nodes[n as usize].pins == 0 {
                    self.unlink(n);
                }
                self.nodes[n as usize].pins += 1;
            }
        }
    }

    /// A sequence that pinned `chain` finished: each block it was the last holder of
    /// becomes evictable again, most recently used, tail first (as the engine releases
    /// blocks), so the chain's prefix outlives its suffix. A cache that had grown past
    /// its capacity (every block pinned) evicts back down to it; returns what it
    /// evicted.
    pub fn unpin_chain(&mut self, chain: &[BlockHash]) -> Vec<BlockHash> {
        for h in chain.iter().rev() {
            if let Some(&n) = self.map.get(h) {
                let node = &mut self.nodes[n as usize];
                if node.pins == 0 {
                    continue;
                }
                node.pins -= 1;
                if node.pins == 0 {
                    self.push_front(n);
                }
            }
        }
        self.evict_to_capacity()
    }

    /// Evicts the least recently used unpinned block (the list must not be empty).
    fn evict_tail(&mut self) -> BlockHash {
        let lru = self.tail;
        let old = self.nodes[lru as usize].hash;
        self.unlink(lru);
        self.map.remove(&old);
        self.free.push(lru);
        old
    }

    /// Caches the single block `h` as most recently used (a block demoted from the
    /// tier above). Returns whether it was new and the block it evicted, if any; a
    /// zero-capacity cache stores nothing.
    pub fn insert_one(&mut self, h: BlockHash) -> (bool, Option<BlockHash>) {
        if self.capacity == 0 {
            return (false, None);
        }
        if self.touch(h) {
            return (false, None);
        }
        (true, self.push_new(h))
    }

    /// Links the uncached block `h` in as most recently used, first evicting the least
    /// recently used block when full; returns the evicted block.
    fn push_new(&mut self, h: BlockHash) -> Option<BlockHash> {
        let (n, evicted) = self.store_detached(h);
        self.nodes[n as usize].detached = false;
        self.push_front(n);
        evicted
    }

    /// Caches the uncached block `h` outside the eviction list (the caller links it
    /// in), first evicting the least recently used block when full; returns its node
    /// and the evicted block.
    fn store_detached(&mut self, h: BlockHash) -> (u32, Option<BlockHash>) {
        let mut evicted = None;
        // Every listed block gone (the rest pinned or detached): cache beyond the
        // capacity rather than evict a held one.
        if self.used() >= self.capacity && self.tail != NIL {
            evicted = Some(self.evict_tail());
        }
        let node = Node {
            hash: h,
            prev: NIL,
            next: NIL,
            pins: 0,
            detached: true,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(h, n);
        (n, evicted)
    }

    fn unlink(&mut self, n: u32) {
        let Node { prev, next, .. } = self.nodes[n as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, n: u32) {
        self.nodes[n as usize].prev = NIL;
        self.nodes[n as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = n;
        }
        self.head = n;
        if self.tail == NIL {
            self.tail = n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn evicts_least_recent_tail_first() {
        let mut c = LruBlockCache::new(4);
        let ch = c.insert_chain(&h(&[1, 2, 3]));
        assert_eq!(ch.stored, vec![(None, h(&[1, 2, 3]))]);
        assert_eq!(c.match_prefix(&h(&[1, 2, 3, 4])), 3);
        // [1,2,9]: 1,2 hit; 9 new. Now 4 blocks; order MRU→LRU: 1,2,9,3.
        let ch = c.insert_chain(&h(&[1, 2, 9]));
        assert_eq!(ch.stored, vec![(Some(BlockHash(2)), h(&[9]))]);
        assert!(ch.removed.is_empty());
        // A new chain of 2 evicts 3 then 9 (the oldest tails), never the shared root.
        let ch = c.insert_chain(&h(&[7, 8]));
        assert_eq!(ch.removed, h(&[3, 9]));
        assert_eq!(c.len(), 4);
        assert_eq!(c.match_prefix(&h(&[1, 2])), 2);
        assert_eq!(c.match_prefix(&h(&[1, 2, 3])), 2);
        // A chain longer than the cache keeps its first blocks.
        let ch = c.insert_chain(&h(&[10, 11, 12, 13, 14, 15]));
        assert_eq!(c.len(), 4);
        assert_eq!(c.match_prefix(&h(&[10, 11, 12, 13, 14])), 4);
        assert_eq!(ch.removed.len(), 4);
    }

    #[test]
    fn anonymous_blocks_take_room_evicting_the_least_recent_and_give_it_back() {
        let mut c = LruBlockCache::new(3);
        c.insert_chain(&h(&[1, 2]));
        // One free slot: no eviction; then the chain's tail goes first.
        assert_eq!(c.occupy(), None);
        assert!(c.has_room());
        assert_eq!(c.occupy(), Some(BlockHash(2)));
        // Every cached block pinned: taken beyond the capacity, reported as not fitting.
        c.pin_chain(&h(&[1]));
        assert!(!c.has_room());
        assert_eq!(c.occupy(), None);
        // Given back: the pool is at its capacity again without evicting (1 cached +
        // 2 anonymous), and 2 more free slots let a new chain in whole.
        assert!(c.vacate(1).is_empty());
        assert!(c.vacate(2).is_empty());
        assert!(c.insert_chain(&h(&[7, 8])).removed.is_empty());
        assert_eq!(c.len(), 3);
        // A sequence takes a cached block back as its own: it leaves the cache
        // without an eviction; a pinned or absent one cannot be taken.
        assert!(c.take(BlockHash(8)));
        assert!(!c.contains(BlockHash(8)));
        assert!(!c.take(BlockHash(1)), "pinned");
        assert!(!c.take(BlockHash(8)), "gone");
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_come_back_most_recent() {
        let mut c = LruBlockCache::new(4);
        c.insert_chain(&h(&[1, 2]));
        c.pin_chain(&h(&[1, 2]));
        c.insert_chain(&h(&[3, 4]));
        // Full; 1 and 2 are held, so a new chain evicts 4 then 3, the free ones,
        // though 1 and 2 were used before them.
        let ch = c.insert_chain(&h(&[5, 6]));
        assert_eq!(ch.removed, h(&[4, 3]));
        assert_eq!(c.match_prefix(&h(&[1, 2])), 2);
        // Every block held: a new one is cached past the capacity, evicting nothing.
        c.pin_chain(&h(&[5, 6]));
        let ch = c.insert_chain(&h(&[7]));
        assert!(ch.removed.is_empty());
        assert_eq!(c.len(), 5);
        // 1 and 2 released: they rejoin as most recent, head last, and the cache
        // evicts back to its capacity from the least recent free block (7).
        assert_eq!(c.unpin_chain(&h(&[1, 2])), h(&[7]));
        assert_eq!(c.len(), 4);
        // Two holders of a block: it stays pinned until both let go.
        c.pin_chain(&h(&[1]));
        c.pin_chain(&h(&[1]));
        assert!(c.unpin_chain(&h(&[1])).is_empty());
        let ch = c.insert_chain(&h(&[8]));
        assert_eq!(ch.removed, h(&[2]));
        assert!(c.contains(BlockHash(1)));
    }

    #[test]
    fn a_chain_never_evicts_its_own_cached_prefix() {
        // An engine takes its cached prefix blocks before it allocates the new ones,
        // so the blocks a request reuses are never what its own new blocks evict.
        let mut c = LruBlockCache::new(4);
        c.insert_chain(&h(&[1, 2]));
        c.insert_chain(&h(&[3, 4]));
        // MRU→LRU: 3, 4, 1, 2. [1, 2, 5, 6] reuses 1 and 2 and stores 5 and 6, which
        // evict the free blocks 4 and 3, not 2 and 1.
        let ch = c.insert_chain(&h(&[1, 2, 5, 6]));
        assert_eq!(ch.stored, vec![(Some(BlockHash(2)), h(&[5, 6]))]);
        assert_eq!(ch.removed, h(&[4, 3]));
        assert_eq!(c.match_prefix(&h(&[1, 2, 5, 6])), 4);
        // With the other blocks held, the chain is cached past the capacity rather
        // than evict one of its own blocks, reused or new.
        let mut c = LruBlockCache::new(3);
        c.insert_chain(&h(&[1]));
        c.pin_chain(&h(&[1]));
        c.insert_chain(&h(&[2]));
        let ch = c.insert_chain(&h(&[2, 5, 6]));
        assert!(ch.removed.is_empty());
        assert_eq!(ch.stored, vec![(Some(BlockHash(2)), h(&[5, 6]))]);
        assert_eq!(c.match_prefix(&h(&[2, 5, 6])), 3);
    }

    #[test]
    fn single_inserts_evict_the_least_recent() {
        let mut c = LruBlockCache::new(2);
        assert_eq!(c.insert_one(BlockHash(1)), (true, None));
        assert_eq!(c.insert_one(BlockHash(2)), (true, None));
        assert!(c.touch(BlockHash(1)));
        assert_eq!(c.insert_one(BlockHash(1)), (false, None));
        assert_eq!(c.insert_one(BlockHash(3)), (true, Some(BlockHash(2))));
        let mut none = LruBlockCache::new(0);
        assert_eq!(none.insert_one(BlockHash(1)), (false, None));
        assert!(none.is_empty());
    }
}
